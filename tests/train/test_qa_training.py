"""What a new user broke in the training engine, each as a regression test.

Every bad input is one OlmoflowError line (the CLI's exit 2), found before training starts where it
can be, and no failure deletes or rewrites a complete checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from resume_helpers import build_model, dataset, make_trainer, train_config

from olmoflow.cli import main
from olmoflow.data.loader import DataLoader, InstanceDataset
from olmoflow.errors import OlmoflowError
from olmoflow.pipeline.config import load_config
from olmoflow.train import distributed
from olmoflow.train.checkpoint import LATEST, list_checkpoints, resolve_checkpoint
from olmoflow.train.config import (
    CheckpointConfig,
    LogConfig,
    OptimizerConfig,
    ScheduleConfig,
    TrainConfig,
)
from olmoflow.train.plan_report import plan_config
from olmoflow.train.trainer import Trainer


def tree_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``, by relative path."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


# --- train.* numbers: every one that used to train silently wrong or crash with a traceback -------

@pytest.mark.parametrize("override,message", [
    ("train.optimizer.lr=.nan", "train.optimizer.lr must be a finite number"),
    ("train.optimizer.lr=.inf", "train.optimizer.lr must be a finite number"),
    ("train.optimizer.muon_lr=.nan", "train.optimizer.muon_lr must be a finite number"),
    ("train.memory_budget_gb=.inf", "train.memory_budget_gb must be a finite number"),
    ("train.optimizer.betas=[1.5, 0.95]", "train.optimizer.betas must be two numbers in [0, 1)"),
    ("train.optimizer.betas=[0.9, -0.1]", "train.optimizer.betas must be two numbers in [0, 1)"),
    ("train.optimizer.betas=[0.9]", "train.optimizer.betas must be two numbers"),
    ("train.optimizer.eps=0", "train.optimizer.eps must be > 0"),
    ("train.max_grad_norm=-1", "train.max_grad_norm must be >= 0"),
    ("train.optimizer.weight_decay=-1", "train.optimizer.weight_decay must be >= 0"),
    ("train.schedule.min_lr_ratio=2", "train.schedule.min_lr_ratio must be in [0, 1]"),
    ("train.schedule.min_lr_ratio=-1", "train.schedule.min_lr_ratio must be in [0, 1]"),
    ("train.num_threads=-1", "train.num_threads must be >= 1"),
    ("train.checkpoint.save_interval=-1", "train.checkpoint.save_interval must be >= 0"),
    ("train.log.interval=-1", "train.log.interval must be >= 0"),
    ("train.optimizer.skip_step_window=0", "train.optimizer.skip_step_window must be >= 2"),
    ("train.optimizer.skip_step_window=1", "train.optimizer.skip_step_window must be >= 2"),
    # the old flat spellings name the new key in the message
    ("train.lr=.nan", "train.optimizer.lr must be a finite number"),
    ("train.beta1=1.5", "train.optimizer.betas must be two numbers in [0, 1)"),
    ("train.grad_clip=-1", "train.max_grad_norm must be >= 0"),
])
def test_bad_train_numbers_are_one_line_errors(override, message):
    with pytest.raises(OlmoflowError) as e:
        load_config("tiny", [override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_train_number_exits_2_before_any_stage_runs(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["pretrain", "tiny", "--run-dir", str(run_dir), "train.max_grad_norm=-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["olmoflow: error: train.max_grad_norm must be >= 0 (0: off), got -1.0"]
    assert not run_dir.exists()


def test_valid_edges_and_presets_still_load():
    for preset in ("tiny", "demo", "olmo3_7b", "olmo3_32b"):
        load_config(preset)
    TrainConfig(max_grad_norm=0.0, num_threads=0,
                optimizer=OptimizerConfig(weight_decay=0.0, betas=[0.0, 0.95], skip_step_window=2),
                schedule=ScheduleConfig(min_lr_ratio=0.0),
                checkpoint=CheckpointConfig(save_interval=0), log=LogConfig(interval=0))
    ScheduleConfig(min_lr_ratio=1.0)


def test_plan_rejects_an_infinite_gpu(capsys):
    with pytest.raises(OlmoflowError, match="--gpu-memory-gb must be a number of GB > 0, got inf"):
        plan_config(load_config("olmo3_7b"), 64, math.inf)
    # was: OverflowError
    assert main(["plan", "olmo3_7b", "--gpus", "64", "--gpu-memory-gb", "inf"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


# --- damaged and mismatched checkpoints -----------------------------------------------------------

def _two_checkpoints(folder: Path) -> tuple[Path, Path]:
    make_trainer(folder, 27, 0.0, max_steps=4, checkpoint__save_interval=2).fit()
    older, newest = list_checkpoints(folder)
    assert resolve_checkpoint(folder, LATEST) == newest
    return older, newest


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


DAMAGE = {
    "shard deleted": lambda c: next((c / "model_and_optim").glob("*.distcp")).unlink(),
    "shard truncated": lambda c: _truncate(next((c / "model_and_optim").glob("*.distcp")), 1000),
    "metadata deleted": lambda c: (c / "model_and_optim" / ".metadata").unlink(),
    "trainer_state truncated": lambda c: _truncate(c / "trainer_state.pt", 100),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_latest_is_a_user_error_naming_the_previous_one(tmp_path, damage):
    older, newest = _two_checkpoints(tmp_path)
    kept = tree_digest(older)
    DAMAGE[damage](newest)  # was: FileNotFoundError / EOFError / RuntimeError / AssertionError
    t = make_trainer(tmp_path, 27, 0.0, max_steps=6, checkpoint__save_interval=2,
                     checkpoint__resume_from="latest")
    with pytest.raises(OlmoflowError) as e:
        t.fit()
    msg = str(e.value)
    assert f"checkpoint '{newest}' cannot be read" in msg and f"resume_from={older.name}" in msg
    assert "\n" not in msg and "Traceback" not in msg
    assert tree_digest(older) == kept and (tmp_path / LATEST).read_text().strip() == newest.name
    # ... and the one it names resumes.
    t = make_trainer(tmp_path, 27, 0.0, max_steps=3, checkpoint__save_interval=0,
                     checkpoint__resume_from=older.name)
    t.fit()
    assert t.step == 3


def test_a_checkpoint_of_another_model_shape_is_a_user_error(tmp_path):
    _, newest = _two_checkpoints(tmp_path)
    before = tree_digest(tmp_path)
    cfg = train_config(max_steps=6, checkpoint__resume_from="latest")
    wider = Trainer(build_model(d_model=48), cfg, DataLoader(dataset(27), 4, seed=7), tmp_path,
                    progress=False)
    with pytest.raises(OlmoflowError,
                       match=r"cannot be read \(model_and_optim: ValueError: Size mismatch"):
        wider.fit()  # was: ValueError traceback
    assert tree_digest(tmp_path) == before


def test_resume_from_a_pruned_checkpoint_says_it_was_pruned(tmp_path):
    make_trainer(tmp_path, 27, 0.0, max_steps=6, checkpoint__save_interval=2,
                 checkpoint__keep_last=1).fit()
    with pytest.raises(OlmoflowError,
                       match=r"'stage1-step2-tokens64' was pruned \(train.checkpoint.keep_last"):
        resolve_checkpoint(tmp_path, "step2")
    with pytest.raises(OlmoflowError, match="was pruned"):
        resolve_checkpoint(tmp_path, "stage1-step4-tokens128")
    with pytest.raises(OlmoflowError) as e:
        resolve_checkpoint(tmp_path, "step3")  # never saved: no pruning story to tell
    assert "was pruned" not in str(e.value)


def test_resume_from_a_folder_of_checkpoints_takes_its_latest(tmp_path):
    """README: resume_from is latest, stepN "or a dir"; a folder of checkpoints (this run's or
    another run's) used to be 'no checkpoint at ...'."""
    make_trainer(tmp_path / "a", 27, 0.0, max_steps=4, checkpoint__save_interval=2).fit()
    latest_a = resolve_checkpoint(tmp_path / "a", LATEST)
    assert resolve_checkpoint(tmp_path / "b", str(tmp_path / "a")) == latest_a
    assert resolve_checkpoint(tmp_path / "a", ".") == latest_a
    t = make_trainer(tmp_path / "b", 27, 0.0, max_steps=6, checkpoint__save_interval=0,
                     checkpoint__resume_from=str(tmp_path / "a"))
    t.fit()
    assert t.step == 6
    assert resolve_checkpoint(tmp_path / "b", LATEST).name.startswith("stage1-step6-")
    with pytest.raises(OlmoflowError, match="no checkpoint at"):
        resolve_checkpoint(tmp_path / "b", str(tmp_path))  # a folder without checkpoints


# --- no complete checkpoint is deleted or rewritten -----------------------------------------------

def test_pruning_a_new_stage_keeps_the_previous_stage(tmp_path):
    """Stage 2 resumed from stage 1 with keep_last=1 used to delete every stage-1 checkpoint."""
    from olmoflow.train.checkpoint import read_index

    make_trainer(tmp_path, 27, 0.0, max_steps=6, checkpoint__save_interval=2).fit()
    stage1 = tree_digest(tmp_path / "stage1-step6-tokens192")
    make_trainer(tmp_path, 27, 0.0, max_steps=10, checkpoint__save_interval=2,
                 checkpoint__stage="stage2", checkpoint__keep_last=1,
                 checkpoint__resume_from="latest").fit()
    on_disk = [p.name for p in list_checkpoints(tmp_path)]
    assert on_disk == ["stage1-step2-tokens64", "stage1-step4-tokens128", "stage1-step6-tokens192",
                       "stage2-step10-tokens320"]
    assert tree_digest(tmp_path / "stage1-step6-tokens192") == stage1
    index = {r["name"]: r["status"] for r in read_index(tmp_path)}
    # the index says what is there
    assert sorted(n for n, st in index.items() if st == "kept") == on_disk
    assert index["stage2-step8-tokens256"] == "pruned"


class Killed(BaseException):
    pass


def test_a_prune_killed_midway_never_leaves_a_half_deleted_checkpoint(tmp_path, monkeypatch):
    """Pruning deleted checkpoints in place: a kill mid-delete (Slurm preemption) could leave one
    with trainer_state.pt but no shards, listed as complete and picked by resume_from=stepN."""
    import shutil

    from olmoflow.train import checkpoint
    from olmoflow.train.checkpoint import checkpoint_name, prune_checkpoints

    def fake(step: int) -> Path:
        d = tmp_path / checkpoint_name("stage1", step, step * 100)
        (d / "model_and_optim").mkdir(parents=True)
        (d / "model_and_optim" / "__0_0.distcp").write_bytes(b"shard")
        (d / "trainer_state.pt").write_bytes(b"state")
        return d

    real_rmtree = shutil.rmtree

    def killed_rmtree(path, *a, **kw):  # deletes the shards, then the process dies
        if not Path(path).exists():
            return real_rmtree(path, *a, **kw)
        for f in Path(path).rglob("*.distcp"):
            f.unlink()
        raise Killed

    for step in (1, 2):
        fake(step)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_rmtree)
    with pytest.raises(Killed):
        prune_checkpoints(tmp_path, fake(3), keep_last=1)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    for c in list_checkpoints(tmp_path):  # every checkpoint still listed is whole
        assert (c / "model_and_optim" / "__0_0.distcp").is_file(), c.name
    prune_checkpoints(tmp_path, fake(4), keep_last=1)  # the next save clears the leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_name("stage1", 4, 400)]


def test_resuming_a_finished_run_keeps_its_final_checkpoint_untouched(tmp_path):
    """A resume at max_steps (or a stop right after a periodic save) used to save the same step
    again: delete the complete directory, then rename the copy in."""
    make_trainer(tmp_path, 27, 0.0, max_steps=4, checkpoint__save_interval=2).fit()
    final = resolve_checkpoint(tmp_path, LATEST)
    before, inode = tree_digest(final), (final / "trainer_state.pt").stat().st_ino
    t = make_trainer(tmp_path, 27, 0.0, max_steps=4, checkpoint__save_interval=2,
                     checkpoint__resume_from="latest")
    summary = t.fit()
    assert Path(summary["checkpoint"]) == final and t.step == 4
    assert tree_digest(final) == before and (final / "trainer_state.pt").stat().st_ino == inode


def test_writing_over_a_directory_fails_before_training(tmp_path):
    (tmp_path / "checkpoints.csv").mkdir(parents=True)
    t = make_trainer(tmp_path, 27, 0.0, max_steps=4, checkpoint__save_interval=2)
    with pytest.raises(OlmoflowError, match="checkpoints.csv' is a directory"):
        # was: IsADirectoryError at the first save, after that step's checkpoint was written
        t.fit()
    assert t.step == 0 and list_checkpoints(tmp_path) == []


def test_a_stage_directory_that_is_a_file_is_a_user_error(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "pretrain").write_text("not a directory")
    # was: NotADirectoryError
    assert main(["pretrain", "tiny", "--run-dir", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "'" + str(run / "pretrain") + "' exists and is not a directory" in err


def test_force_with_resume_from_deletes_nothing(tmp_path):
    """`pretrain --force resume_from=latest` used to delete every checkpoint, then fail: nothing
    left to resume from."""
    from olmoflow.pipeline.runner import run_stage

    make_trainer(tmp_path / "pretrain", 27, 0.0, max_steps=2, checkpoint__save_interval=0).fit()
    before = tree_digest(tmp_path / "pretrain")
    cfg = load_config("tiny", ["resume_from=latest"], values={"run_dir": str(tmp_path)})
    with pytest.raises(OlmoflowError,
                       match="--force would delete the checkpoints .* resume_from=latest"):
        run_stage(cfg, "pretrain", progress=False, force=True)
    assert tree_digest(tmp_path / "pretrain") == before


def test_changing_only_bookkeeping_keys_keeps_the_pretrain_fingerprint(tmp_path):
    """An interrupted run whose checkpoint policy, log or thread settings change resumes; before,
    the changed fingerprint deleted every checkpoint and trained again from step 0."""
    from olmoflow.pipeline.runner import fingerprint
    from olmoflow.pipeline.stages.train import TRAIN_BOOKKEEPING

    values = {"run_dir": str(tmp_path)}
    base = fingerprint(load_config("tiny", values=values), "pretrain")
    same = ["train.checkpoint.keep_last=2", "train.checkpoint.keep_every=10",
            "train.checkpoint.save_interval=3", "train.log.interval=1", "train.num_threads=1",
            "train.log.detailed_interval=5", "train.log.loggers=[tensorboard]",
            "train.checkpoint.resume_from=latest",
            # the parallel layout: a checkpoint resumes under another one (tests/train/
            # test_parallel_3d.py), equal within rounding
            "train.parallel.data_parallel=fsdp", "train.parallel.shard_size=null",
            "train.parallel.tensor_parallel=2", "train.parallel.pipeline_parallel=2",
            "train.parallel.pipeline_schedule=gpipe", "train.parallel.stages_per_rank=1",
            "train.parallel.pipeline_split=cost", "train.parallel.context_parallel=1",
            "train.parallel.cpu_offload=false"]
    assert {o.split("=")[0] for o in same} == set(TRAIN_BOOKKEEPING)
    same += ["resume_from=latest", "train.keep_last=2"]  # OLMo's top-level form; an old spelling
    for override in same:
        cfg = load_config("tiny", [override], values=values)
        assert fingerprint(cfg, "pretrain") == base, override
    for override in ["train.max_steps=31", "train.optimizer.lr=1e-3", "train.optimizer.type=muon",
                     "train.packing=best_fit", "train.micro_batch_size=2", "train.precision=bf16",
                     "train.schedule.warmup_steps=3", "train.max_grad_norm=0.5",
                     "train.data=[elsewhere/tokens]", "seed=1", "model.d_model=32",
                     "train.parallel.param_dtype=bf16"]:
        cfg = load_config("tiny", [override], values=values)
        assert fingerprint(cfg, "pretrain") != base, override


# --- the data position means the same instances ---------------------------------------------------

def test_loader_refuses_a_position_over_other_instances_of_the_same_count():
    """64 tokens make 7 instances at sequence_length 8 and at 9: the counts agree, the instances do
    not, so a position would silently skip or repeat data (was: resumed without a word)."""
    tokens = [np.arange(64, dtype=np.uint16)]
    eight, nine = InstanceDataset(tokens, 8), InstanceDataset(tokens, 9)
    assert len(eight) == len(nine) == 7
    state = DataLoader(eight, 2, seed=0).state_dict()
    with pytest.raises(OlmoflowError, match="train.sequence_length=8, this run has 9"):
        DataLoader(nine, 2, seed=0).load_state_dict(state)
    with pytest.raises(OlmoflowError, match="train.packing=best_fit, this run has concat"):
        DataLoader(eight, 2, seed=0).load_state_dict({**state, "packing": "best_fit"})
    old = {k: v for k, v in state.items() if k not in ("packing", "sequence_length")}
    DataLoader(eight, 2, seed=0).load_state_dict(old)  # checkpoints from before still resume


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
