"""Ctrl-C and resume through the command line: ``olmoflow pretrain`` is interrupted with SIGINT
mid-run, then ``olmoflow pretrain CONFIG resume_from=latest`` in a new process finishes it, and
every logged loss, the final loss and the final weights equal an uninterrupted run's exactly; the
seed-style ``python -m olmoflow.scripts.train`` continues it further."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from resume_helpers import make_trainer

from olmoflow.cli import main
from olmoflow.model.load import load_step_model
from olmoflow.pipeline.config import load_config
from olmoflow.pipeline.runner import run_pipeline
from olmoflow.scripts.train import main as train_script
from olmoflow.tokenizer import Tokenizer
from olmoflow.train import distributed
from olmoflow.train.checkpoint import LATEST, parse_checkpoint_name, resolve_checkpoint

STEPS = 100
# The tiny preset on the stdlib corpus, shrunk so a step takes milliseconds; one thread so the
# three processes reduce in the same order.
TRAIN = [f"train.max_steps={STEPS}", "train.log.interval=1", "train.checkpoint.save_interval=0",
         "train.num_threads=1", "train.sequence_length=32", "train.global_batch_size=4",
         "train.micro_batch_size=4", "train.checkpoint.keep_last=1"]


def pretrain_args(run: Path, *extra: str) -> list[str]:
    return ["pretrain", "tiny", "--run-dir", str(run), "--no-progress", *TRAIN, *extra]


def cli(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "olmoflow", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kw)


def logged_steps(log: Path) -> list[int]:
    if not log.is_file():
        return []
    return [json.loads(ln)["step"] for ln in log.read_text().splitlines() if ln.endswith("}")]


def signal_mid_run(run: Path, sig: int) -> tuple[subprocess.Popen, str, str]:
    """Start ``olmoflow pretrain`` on ``run`` and send it ``sig`` once 3 steps are logged;
    returns the finished process and its output."""
    proc = cli(*pretrain_args(run))
    try:
        log, deadline = run / "pretrain" / "metrics.jsonl", time.time() + 120
        while len(logged_steps(log)) < 3:
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "the run logged no steps"
            time.sleep(0.01)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, out, err


def final_state(run: Path) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    log = run / "pretrain" / "metrics.jsonl"
    losses = {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}
    vocab = Tokenizer.from_pretrained(run / "tokenizer").vocab_size
    model = load_step_model(resolve_checkpoint(run / "pretrain", "latest"), vocab)
    return losses, model.state_dict()


@pytest.mark.slow  # three processes (one in this one): ~15 s on an idle 2-core box
def test_ctrl_c_then_resume_equals_an_uninterrupted_run(tmp_path):
    run = tmp_path / "run"
    cfg = load_config("tiny", TRAIN, {"run_dir": str(run)})
    run_pipeline(cfg, stages=["collect", "clean", "train-tokenizer", "tokenize"], progress=False)

    threads = torch.get_num_threads()
    try:
        assert main(pretrain_args(run)) == 0  # the uninterrupted reference
    finally:
        torch.set_num_threads(threads)
    straight_losses, straight_weights = final_state(run)
    assert sorted(straight_losses) == list(range(1, STEPS + 1))
    shutil.rmtree(run / "pretrain")

    # Ctrl-C once a few steps are logged: the trainer stops at the step boundary and saves.
    proc, out, err = signal_mid_run(run, signal.SIGINT)
    log = run / "pretrain" / "metrics.jsonl"
    assert proc.returncode == 130, (out, err)
    assert "interrupted at step" in out and "olmoflow: interrupted" in err
    stopped = parse_checkpoint_name(resolve_checkpoint(run / "pretrain", "latest").name)
    assert 3 <= stopped < STEPS, "the interrupt must fall mid-run"
    assert max(logged_steps(log)) == stopped
    assert not (run / "pretrain" / "manifest.json").exists()

    # Resume in a new process with the form OLMo's docs use.
    proc = cli(*pretrain_args(run, "resume_from=latest"))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "[pretrain] resumed" in out
    losses, weights = final_state(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] == straight_losses[STEPS]
    assert losses == straight_losses
    assert weights.keys() == straight_weights.keys()
    for k in weights:
        assert torch.equal(weights[k], straight_weights[k]), f"final weight {k} differs"
    # keep_last=1: only the final checkpoint is left; the index remembers the interrupted one.
    names = [p.name for p in (run / "pretrain").iterdir() if parse_checkpoint_name(p.name)]
    assert [parse_checkpoint_name(n) for n in names] == [STEPS]
    index = (run / "pretrain" / "checkpoints.csv").read_text().splitlines()
    assert [ln.split(",")[0] for ln in index[1:]] == [str(stopped), str(STEPS)]
    assert index[1].endswith(",pruned") and index[2].endswith(",kept")

    # resume_from with more steps continues the finished run (the config changed: not a restart),
    # here through the seed-style entry point, `python -m olmoflow.scripts.train CONFIG ...`.
    try:
        more = pretrain_args(run, f"train.max_steps={STEPS + 5}", "resume_from=latest")
        assert train_script(more[1:]) == 0
    finally:
        torch.set_num_threads(threads)
    longer, _ = final_state(run)
    assert sorted(longer) == list(range(1, STEPS + 6))
    assert {s: longer[s] for s in losses} == losses


def test_sigterm_stops_at_a_step_boundary_saves_and_exits_143(tmp_path):
    """SIGTERM (``kill``, Slurm's ``scancel`` or time limit; torchrun passes it on to every
    rank) saves like Ctrl-C: the run stops at a step boundary with a checkpoint there, exits
    128 + 15, and a rerun resumes from it."""
    run = tmp_path / "run"
    cfg = load_config("tiny", TRAIN, {"run_dir": str(run)})
    run_pipeline(cfg, stages=["collect", "clean", "train-tokenizer", "tokenize"], progress=False)
    proc, out, err = signal_mid_run(run, signal.SIGTERM)
    log = run / "pretrain" / "metrics.jsonl"
    assert proc.returncode == 128 + signal.SIGTERM, (out, err)
    assert "terminated (SIGTERM) at step" in out and "olmoflow: terminated (SIGTERM)" in err
    assert "Traceback" not in err
    stopped = parse_checkpoint_name(resolve_checkpoint(run / "pretrain", "latest").name)
    assert 3 <= stopped < STEPS and max(logged_steps(log)) == stopped

    more = pretrain_args(run, f"train.max_steps={stopped + 2}", "resume_from=latest")
    proc = cli(*more)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "[pretrain] resumed" in out
    assert logged_steps(log) == list(range(1, stopped + 3))


# --- Ctrl-C under torchrun ------------------------------------------------------------------------


def _interrupt_worker(folder: str) -> None:
    """One rank of a 2-process run in which only rank 1 gets SIGINT (while fetching batch 3)."""
    torch.set_num_threads(1)
    info = distributed.init_from_env()
    t = make_trainer(Path(folder), 27, 0.0, max_steps=40, checkpoint__save_interval=0)
    if info.rank == 1:
        fetch, calls = t.loader.next_batch, []

        def fetch_then_signal():
            calls.append(1)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGINT)
            return fetch()

        t.loader.next_batch = fetch_then_signal
    try:
        t.fit()
        outcome = "finished"
    except KeyboardInterrupt:
        outcome = "interrupted"
    result = json.dumps({"outcome": outcome, "step": t.step})
    (Path(folder) / f"rank{info.rank}.json").write_text(result)


def test_ctrl_c_reaching_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """Before, the rank that got the signal saved (a collective) while the other trained on (another
    collective): a hang, or a checkpoint of mixed steps."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    # Its own process group, so that a hang (the bug) takes the workers down with torchrun.
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node=2", __file__, str(tmp_path)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the ranks hung after a Ctrl-C that reached one of them")
    assert proc.returncode == 0, err[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] == {"outcome": "interrupted", "step": 3}
    assert resolve_checkpoint(tmp_path, LATEST).name.startswith("stage1-step3-")


if __name__ == "__main__":
    _interrupt_worker(sys.argv[1])
