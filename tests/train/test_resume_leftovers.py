"""A run resumed at its last step still reports its final loss, and what killed writes leave in
the checkpoint folder is removed by the next run.

A resume at ``max_steps`` trains no step: the final loss must come from the checkpoint (exact,
in its trainer state), the log line of its step, or ``checkpoints.csv``. A process killed inside
an atomic write leaves ``.{name}.{random}.tmp``; a kill inside a save leaves a
``.{checkpoint}.tmp`` directory. The next run's start and every save delete those names and
nothing else.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from resume_helpers import make_trainer, read_metrics
from test_cli import cli, doc_text, write_jsonl

from olmoflow.artifacts import is_atomic_temporary
from olmoflow.model.checkpoint_files import CHECKSUMS
from olmoflow.train.checkpoint import INDEX, LATEST, TRAINER_STATE, list_checkpoints
from olmoflow.train.trainer import METRICS

STEPS = 4
KW = dict(max_steps=STEPS, checkpoint__save_interval=2)


def finished_run(folder):
    """A run trained to ``max_steps``: its summary."""
    return make_trainer(folder, 40, 0.0, **KW).fit()


def resume_at_end(folder):
    return make_trainer(folder, 40, 0.0, **KW, checkpoint__resume_from="latest").fit()


def test_resume_at_max_steps_reports_the_final_loss(tmp_path):
    first = finished_run(tmp_path)
    assert first["final_loss"] == read_metrics(tmp_path)[STEPS]["loss"]
    again = resume_at_end(tmp_path)
    assert again["steps"] == STEPS
    # Not recomputed: the very float the run logged, carried by the checkpoint.
    assert again["final_loss"] == first["final_loss"]


def test_pretrain_stage_rerun_at_its_last_step_keeps_final_loss(tmp_path, capsys):
    """`olmoflow pretrain` finished, its manifest lost (deleted, or a kill -9 between the last
    checkpoint and the manifest): the rerun resumes at max_steps and reports the same loss."""
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": doc_text(i) * 4} for i in range(40)])
    args = ["tiny", "--data", str(corpus), "--run-dir", str(tmp_path / "run"), "--no-progress",
            "train.max_steps=3", "train.num_threads=1"]
    for verb in ("collect", "clean", "train-tokenizer", "tokenize", "pretrain"):
        assert cli(capsys, verb, *args)[0] == 0
    manifest = tmp_path / "run" / "pretrain" / "manifest.json"
    first = json.loads(manifest.read_text())["counts"]["final_loss"]
    assert isinstance(first, float)
    manifest.unlink()
    rc, out, _ = cli(capsys, "pretrain", *args)
    assert rc == 0 and "[pretrain] resumed" in out and f"final_loss={first:.3f}" in out
    assert json.loads(manifest.read_text())["counts"]["final_loss"] == first


def drop_loss_from_trainer_state(folder):
    """Make the final checkpoint look like one saved before the trainer state held the loss."""
    path = list_checkpoints(folder)[-1] / TRAINER_STATE
    state = torch.load(path, weights_only=True)
    del state["loss"]
    torch.save(state, path)
    (path.parent / CHECKSUMS).unlink()  # nor did it record checksums


def test_older_checkpoint_final_loss_from_log_then_index(tmp_path):
    first = finished_run(tmp_path)
    drop_loss_from_trainer_state(tmp_path)
    assert resume_at_end(tmp_path)["final_loss"] == first["final_loss"]  # the log line: exact
    (tmp_path / METRICS).unlink()
    got = resume_at_end(tmp_path)["final_loss"]
    # checkpoints.csv writes 6 decimals: off by at most half of 1e-6 (plus the float's own ulp).
    assert got == pytest.approx(first["final_loss"], abs=5e-7 + 1e-12)


def kill_inside_atomic_write(path):
    """A fresh process that dies (os._exit, no cleanup) between creating the temporary of an
    atomic write to ``path`` and renaming it: what kill -9 at that moment leaves."""
    code = textwrap.dedent(f"""
        import os
        from olmoflow.artifacts import atomic_open
        with atomic_open({str(path)!r}, "w") as f:
            f.write("half")
            f.flush()
            os._exit(9)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 9, proc.stderr[-2000:]


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("next_run", ["resume", "fresh"])
def test_next_run_removes_what_killed_writes_left(tmp_path, next_run):
    finished_run(tmp_path)
    for name in (LATEST, INDEX, METRICS):
        kill_inside_atomic_write(tmp_path / name)
    killed = [n for n in leftovers(tmp_path) if is_atomic_temporary(n)]
    assert len(killed) == 3 and any(n.startswith(".latest.") for n in killed), killed
    half_saved = tmp_path / ".stage1-step3-tokens96.tmp"  # a save killed mid-way
    (half_saved / "model_and_optim").mkdir(parents=True)
    # Look-alikes that are not the project's temporaries stay.
    (tmp_path / ".latest.tmp").write_text("not ours")
    (tmp_path / "notes.x.tmp").write_text("not hidden")
    (tmp_path / ".cache.tmp").mkdir()
    before = (tmp_path / LATEST).read_text()
    if next_run == "resume":
        resume_at_end(tmp_path)  # trains nothing, saves nothing: the start cleans
        assert (tmp_path / LATEST).read_text() == before
    else:
        make_trainer(tmp_path, 40, 0.0, max_steps=1, checkpoint__save_interval=0).fit()
    assert leftovers(tmp_path) == [".cache.tmp", ".latest.tmp"]
    assert (tmp_path / "notes.x.tmp").is_file()


def test_save_removes_leftovers_of_a_killed_save(tmp_path):
    """Kills during a run (not before it) are cleaned by its next save."""
    t = make_trainer(tmp_path, 40, 0.0, max_steps=2, checkpoint__save_interval=1)
    fetch = t.loader.next_batch
    calls = []

    def fetch_after_a_kill():
        calls.append(1)
        if len(calls) == 2:  # between the save of step 1 and the one of step 2
            kill_inside_atomic_write(tmp_path / LATEST)
            assert any(is_atomic_temporary(n) for n in leftovers(tmp_path))
        return fetch()

    t.loader.next_batch = fetch_after_a_kill
    t.fit()
    assert not [n for n in leftovers(tmp_path) if is_atomic_temporary(n)]
