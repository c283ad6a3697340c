"""Nothing of the user's is lost to a run: the runner writes and deletes only in a directory that
is olmoflow's (its marker), refuses inputs inside its own stage directories, lets one process at
a time work in a run directory (a lock another process can hold), and never deletes a stage's
finished output before the rerun that replaces it has succeeded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
from checks import one_line_error, tree
from test_cli import assert_one_line_error, cli, doc_text, write_jsonl

from olmoflow.artifacts import LOCK_FILE, StageResult, atomic_write_text
from olmoflow.cli import main
from olmoflow.errors import OlmoflowError
from olmoflow.pipeline.config import RunConfig
from olmoflow.pipeline.runner import run_pipeline, run_stage
from olmoflow.pipeline.stage import Stage, Trains
from olmoflow.pipeline.stages import STAGES
from olmoflow.run_dir import RUN_MARKER, RunDir, previous_output
from olmoflow.train import distributed

WORDS = "river stone tree alpha beta gamma delta lantern harbor meadow quartz violet".split()


@pytest.fixture
def docs(tmp_path) -> Path:
    import random

    rng = random.Random(0)
    p = tmp_path / "docs.jsonl"
    p.write_text("".join(json.dumps({"id": str(i), "text": " ".join(rng.choices(WORDS, k=80))})
                         + "\n" for i in range(40)))
    return p


def collect(docs: Path, run: Path, *extra: str) -> int:
    return main(["collect", "tiny", "--data", str(docs), "--run-dir", str(run), "--no-progress",
                 *extra])


# ---- whose directory -----------------------------------------------------------------------------


def test_a_directory_holding_the_users_own_files_is_refused_and_left_alone(tmp_path, docs,
                                                                          capsys):
    mine = tmp_path / "mine"
    for rel in ("collect/notes.txt", "eval/report.json", "release/model.safetensors"):
        (mine / rel).parent.mkdir(parents=True, exist_ok=True)
        (mine / rel).write_text(f"the user's {rel}")
    before = tree(mine)
    assert collect(docs, mine) == 2
    err = one_line_error(capsys)
    assert str(mine) in err and RUN_MARKER in err and "new or empty directory" in err
    assert tree(mine) == before and sorted(os.listdir(mine)) == ["collect", "eval", "release"]


def test_a_new_or_empty_directory_is_marked_and_used(tmp_path, docs, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    for run in (tmp_path / "new", empty):
        assert collect(docs, run) == 0
        assert (run / RUN_MARKER).is_file() and (run / "collect" / "manifest.json").is_file()
    assert collect(docs, empty) == 0 and "[collect] skipped" in capsys.readouterr().out


def test_a_run_made_before_the_marker_is_adopted_but_not_one_with_foreign_files(tmp_path, docs,
                                                                               capsys):
    run = tmp_path / "run"
    assert collect(docs, run) == 0
    (run / RUN_MARKER).unlink()
    (run / LOCK_FILE).unlink()
    interrupted = run / "pretrain"  # a stage killed before its manifest: the runner's fingerprint
    interrupted.mkdir()
    (interrupted / ".fingerprint").write_text("0" * 64)
    capsys.readouterr()
    assert collect(docs, run) == 0 and "[collect] skipped" in capsys.readouterr().out
    assert (run / RUN_MARKER).is_file()

    (run / RUN_MARKER).unlink()
    (run / "notes.txt").write_text("mine")  # not olmoflow's: the directory is not adopted
    before = tree(run)
    assert collect(docs, run, "--force") == 2
    assert "'notes.txt' is not an olmoflow stage directory" in one_line_error(capsys)
    assert tree(run) == before


# ---- inputs inside the run's own output ------------------------------------------------------


def test_an_input_inside_a_stage_directory_is_refused_before_it_is_deleted(tmp_path, docs, capsys):
    run = tmp_path / "run"
    assert collect(docs, run) == 0
    inside = run / "collect" / "more.jsonl"
    inside.write_bytes(docs.read_bytes())
    capsys.readouterr()
    before = tree(run)
    for data in (str(inside), str(run / "*" / "more.jsonl")):
        assert collect(Path(data), run) == 2
        err = one_line_error(capsys)
        assert "collect.sources" in err and "inside this run's own 'collect' directory" in err
        assert tree(run) == before  # the input is still there, and so is the finished stage
    # A directory that holds the run directory would read the run's outputs back in.
    assert collect(tmp_path, run) == 2
    assert "holds the run directory" in one_line_error(capsys)


# ---- one process at a time -----------------------------------------------------------------------

HOLDER = textwrap.dedent("""
    import sys, time
    from olmoflow.artifacts import directory_lock
    with directory_lock(sys.argv[1], command="olmoflow run demo --holder"):
        print("locked", flush=True)
        time.sleep(60)
""")


@pytest.fixture
def held_by_another_process(tmp_path):
    """Start a process that holds the lock of ``tmp_path/run`` (marked as a run directory)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / RUN_MARKER).write_text("{}")
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield run, proc
    finally:
        proc.kill()
        proc.wait()


def test_a_second_process_gets_one_line_naming_the_holder(held_by_another_process, docs, capsys):
    run, proc = held_by_another_process
    assert collect(docs, run) == 2
    err = one_line_error(capsys)
    assert "in use by another olmoflow process" in err
    assert f"pid {proc.pid}" in err and "olmoflow run demo --holder" in err and "since " in err
    assert not (run / "collect").exists()
    proc.kill()  # the kernel frees the lock of a process that dies in any way
    proc.wait()
    assert collect(docs, run) == 0


def test_under_torchrun_only_rank_0_takes_the_lock(held_by_another_process, monkeypatch):
    run, _ = held_by_another_process
    table = STAGES.with_stage(SOURCE)
    rank1 = distributed.DistInfo(rank=1, world_size=2)
    monkeypatch.setattr(distributed, "init_from_env", lambda: rank1)
    # Rank 1 is part of rank 0's job: it neither takes nor checks the lock (rank 0 holds it).
    rows = run_pipeline(RunConfig(run_dir=str(run)), stages=["toy-source"], progress=False,
                        table=table)
    assert [r[0] for r in rows] == ["toy-source"]
    monkeypatch.undo()
    with pytest.raises(OlmoflowError, match="in use by another olmoflow process"):
        run_pipeline(RunConfig(run_dir=str(run)), stages=["toy-source"], progress=False,
                     table=table)


# ---- a rerun that fails keeps the finished output ------------------------------------------------


@pytest.fixture(scope="module")
def finished_data_run(tmp_path_factory) -> Path:
    """A run whose data stages (collect, clean, train-tokenizer, tokenize) are finished."""
    import random

    root = tmp_path_factory.mktemp("finished")
    rng = random.Random(1)
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": str(i), "text": " ".join(rng.choices(WORDS, k=80))})
                            + "\n" for i in range(60)))
    run = root / "run"
    for verb in ("collect", "clean", "train-tokenizer", "tokenize"):
        assert main([verb, "tiny", "--data", str(docs), "--run-dir", str(run), "--no-progress",
                     "tokenizer.vocab_size=300"]) == 0, verb
    return run


@pytest.fixture
def finished_copy(finished_data_run, tmp_path) -> Path:
    """A copy of :func:`finished_data_run` of the test's own."""
    run = tmp_path / "run"
    shutil.copytree(finished_data_run, run)
    return run


@pytest.mark.parametrize("verb, override, key", [
    ("clean", "clean.min_chars=-5", "clean.min_chars"),
    ("tokenize", "tokenize.heldout_fraction=.nan", "tokenize.heldout_fraction"),
    ("train-tokenizer", "tokenizer.vocab_size=0", "tokenizer.vocab_size"),
])
def test_an_invalid_rerun_leaves_the_finished_output_byte_identical(finished_data_run,
                                                                    finished_copy, verb,
                                                                    override, key, capsys):
    run = finished_copy
    docs = finished_data_run.parent / "docs.jsonl"
    before = tree(run)
    assert main([verb, "tiny", "--data", str(docs), "--run-dir", str(run), "--no-progress",
                 "tokenizer.vocab_size=300", override]) == 2
    assert key in one_line_error(capsys)
    assert tree(run) == before


def _write_source(cfg: RunConfig, progress: bool) -> StageResult:
    out = RunDir(cfg.run_dir).stage("toy-source")
    if cfg.release.name == "fails":  # a check of the stage's own, made after it started
        raise OlmoflowError("release.name 'fails' is refused by the stage")
    atomic_write_text(out / "words.txt", f"{cfg.release.name}\n")
    return StageResult(inputs=[], outputs=[out / "words.txt"], counts={"words": 1})


SOURCE = Stage("toy-source", _write_source, ("release.name",), headline=("words",))


def named(run: Path, name: str) -> RunConfig:
    cfg = RunConfig(run_dir=str(run))
    cfg.release = replace(cfg.release, name=name)
    return cfg


def test_a_stage_that_fails_on_rerun_puts_its_previous_output_back(tmp_path):
    table = STAGES.with_stage(SOURCE)
    run = tmp_path / "run"
    assert run_stage(named(run, "first"), "toy-source", progress=False, table=table)[0] == "ran"
    out = RunDir(run).stage("toy-source")
    before = tree(out)
    for force in (False, True):
        with pytest.raises(OlmoflowError, match="refused by the stage"):
            run_stage(named(run, "fails"), "toy-source", progress=False, force=force, table=table)
        assert tree(out) == before
        assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE, RUN_MARKER, "toy-source"]
    # Still complete for its own config; a good rerun replaces it and leaves nothing aside.
    assert run_stage(named(run, "first"), "toy-source", progress=False, table=table)[0] == \
        "skipped"
    assert run_stage(named(run, "second"), "toy-source", progress=False, table=table)[0] == "ran"
    assert (out / "words.txt").read_text() == "second\n"
    assert not (run / ".toy-source.previous").exists()


def test_a_rerun_killed_halfway_is_settled_by_the_next_run(tmp_path):
    table = STAGES.with_stage(SOURCE)
    run = tmp_path / "run"
    run_stage(named(run, "first"), "toy-source", progress=False, table=table)
    out = RunDir(run).stage("toy-source")
    before = tree(out)
    # What kill -9 leaves in the middle of a rerun: the previous output aside, a half-made new one.
    os.replace(out, previous_output(out))
    out.mkdir()
    (out / "words.txt").write_text("half")
    assert run_stage(named(run, "first"), "toy-source", progress=False, table=table)[0] == \
        "skipped"
    assert tree(out) == before and not previous_output(out).exists()


def _train(cfg: RunConfig, progress: bool) -> StageResult:
    out = RunDir(cfg.run_dir).stage("toy-train")
    if cfg.release.name == "fails":
        raise OlmoflowError("refused before the first step")
    step = out / "step1"
    step.mkdir(parents=True, exist_ok=True)
    (step / "trainer_state.pt").write_bytes(cfg.release.name.encode())
    atomic_write_text(out / "latest", "step1\n")
    return StageResult(inputs=[], outputs=[step / "trainer_state.pt"], counts={"steps": 1})


def test_a_forced_training_rerun_that_fails_keeps_the_old_checkpoints(tmp_path):
    resume_key = STAGES["pretrain"].trains.resume_key
    table = STAGES.with_stage(Stage("toy-train", _train, ("release.name",),
                                    trains=Trains(resume_key)))
    run = tmp_path / "run"
    run_stage(named(run, "first"), "toy-train", progress=False, table=table)
    before = tree(run / "toy-train")
    with pytest.raises(OlmoflowError, match="refused before the first step"):
        run_stage(named(run, "fails"), "toy-train", progress=False, force=True, table=table)
    assert tree(run / "toy-train") == before

FAST = ("--no-progress", "train.max_steps=4", "train.checkpoint.save_interval=2",
        "train.num_threads=1")


def test_checkpoints_of_another_config_are_never_deleted_implicitly(tmp_path, capsys):
    """A changed train config must not wipe an interrupted (or finished) run's checkpoints: the
    rerun stops with one line naming both ways forward, and each of them works."""
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": doc_text(i) * 4} for i in range(40)])
    base = ("tiny", "--data", str(corpus), "--run-dir", str(tmp_path / "run"), *FAST)
    assert cli(capsys, "run", *base)[0] == 0
    pretrain = tmp_path / "run" / "pretrain"
    before = sorted(p.name for p in pretrain.iterdir())
    rc, _, err = cli(capsys, "pretrain", *base, "train.optimizer.lr=1e-3")
    assert_one_line_error(rc, err, "resume_from=latest")
    assert sorted(p.name for p in pretrain.iterdir()) == before, "nothing was deleted"
    rc, out, _ = cli(capsys, "pretrain", *base, "train.optimizer.lr=1e-3", "train.max_steps=6",
                     "resume_from=latest")
    assert rc == 0 and "[pretrain] resumed" in out
    rc, out, _ = cli(capsys, "pretrain", *base, "train.optimizer.lr=2e-3", "--force")
    assert rc == 0 and "[pretrain] ran" in out

def test_a_stage_directory_that_is_a_file_is_a_user_error(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "pretrain").write_text("not a directory")
    # was: NotADirectoryError
    assert main(["pretrain", "tiny", "--run-dir", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "'" + str(run / "pretrain") + "' exists and is not a directory" in err
