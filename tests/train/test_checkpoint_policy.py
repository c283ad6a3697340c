"""Checkpoint names, the checkpoints.csv index, the keep_every/keep_last pruning policy, finding
checkpoints by name, and the config keys of the checkpoint policy and resume."""

from __future__ import annotations

import csv
import io
import itertools
from pathlib import Path

import pytest
import torch
from checks import tree
from resume_helpers import make_trainer, read_metrics

from olmoflow.errors import OlmoflowError
from olmoflow.model.checkpoint_names import format_tokens
from olmoflow.pipeline.config import load_config
from olmoflow.train.checkpoint import (
    INDEX,
    LATEST,
    checkpoint_name,
    has_checkpoint,
    list_checkpoints,
    parse_checkpoint_name,
    prune_checkpoints,
    resolve_checkpoint,
)

TOKENS_PER_STEP = 4 * 8  # resume_helpers.train_config: 4 instances of 8 tokens



def test_token_counts_round_up_in_the_largest_unit():
    assert [format_tokens(n) for n in (0, 1, 999)] == ["0", "1", "999"]
    assert [format_tokens(n) for n in (1000, 1001, 5120, 999_999)] == ["1K", "2K", "6K", "1000K"]
    assert format_tokens(4_194_304) == "5M"
    # OLMo 2 7B's published names: 4,194,304 tokens per step
    assert checkpoint_name("stage1", 1000, 1000 * 4_194_304) == "stage1-step1000-tokens5B"
    assert checkpoint_name("stage1", 928646, 928646 * 4_194_304) == "stage1-step928646-tokens3896B"
    # below 1B we switch to M where OLMo (always in B) writes "tokens1B"
    assert checkpoint_name("stage1", 150, 150 * 4_194_304) == "stage1-step150-tokens630M"
    assert format_tokens(3 * 10**12 + 1) == "3001B"  # B is the largest unit, as in OLMo


def test_names_parse_back_to_their_step():
    for stage, step, tokens in itertools.product(["stage1", "stage2-ingredient1", "mid.train"],
                                                 [0, 7, 123456], [0, 999, 10**6, 5 * 10**13]):
        assert parse_checkpoint_name(checkpoint_name(stage, step, tokens)) == step
    assert parse_checkpoint_name("step42") == 42  # the older form
    for bad in ("latest", "checkpoints.csv", ".stage1-step4-tokens1K.tmp", "stage1-stepX", "step"):
        assert parse_checkpoint_name(bad) is None, bad


def fake_checkpoints(folder: Path, steps: list[int]) -> None:
    for s in steps:
        d = folder / checkpoint_name("stage1", s, s * 100)
        d.mkdir(parents=True)
        (d / "trainer_state.pt").write_bytes(b"")


@pytest.mark.parametrize("keep_every,keep_last",
                         list(itertools.product([0, 1, 3, 4], [0, 1, 2, 5])))
def test_pruning_policy_against_its_definition(tmp_path, keep_every, keep_last):
    """Saving steps 1..12 one by one, pruning after each save, leaves exactly: the multiples of
    keep_every, the newest keep_last of the others, and the newest of all."""
    for s in range(1, 13):
        fake_checkpoints(tmp_path, [s])
        newest = tmp_path / checkpoint_name("stage1", s, s * 100)
        prune_checkpoints(tmp_path, newest, keep_every=keep_every, keep_last=keep_last)
        left = [parse_checkpoint_name(p.name) for p in list_checkpoints(tmp_path)]
        forever = [t for t in range(1, s + 1) if keep_every and t % keep_every == 0]
        others = [t for t in range(1, s + 1) if t not in forever]
        expected = set(forever) | set(others[-keep_last:] if keep_last else others) | {s}
        assert sorted(left) == sorted(expected), (s, left)


def test_pruning_leaves_later_checkpoints_of_an_abandoned_future_alone(tmp_path):
    fake_checkpoints(tmp_path, [2, 4, 6, 8])
    prune_checkpoints(tmp_path, tmp_path / checkpoint_name("stage1", 4, 400), keep_last=1)
    assert [parse_checkpoint_name(p.name) for p in list_checkpoints(tmp_path)] == [4, 6, 8]


def read_index(folder: Path) -> list[dict]:
    return list(csv.DictReader(io.StringIO((folder / INDEX).read_text())))


def test_training_run_names_indexes_and_prunes_checkpoints(tmp_path):
    t = make_trainer(tmp_path, 27, 0.0, max_steps=13, checkpoint__save_interval=2,
                     checkpoint__keep_every=5, checkpoint__keep_last=2)
    summary = t.fit()
    # saved at 2, 4, ..., 12 and 13 (the end); 10 is a multiple of keep_every; 12 and 13 the last 2
    names = {s: checkpoint_name("stage1", s, s * TOKENS_PER_STEP) for s in (2, 4, 6, 8, 10, 12, 13)}
    assert [p.name for p in list_checkpoints(tmp_path)] == [names[10], names[12], names[13]]
    latest = (tmp_path / "latest").read_text().strip()
    assert latest == names[13] == Path(summary["checkpoint"]).name
    assert not list(tmp_path.glob(".*.tmp"))
    rows = read_index(tmp_path)
    assert list(rows[0]) == ["step", "tokens", "name", "loss", "saved_at", "status"]
    assert [(int(r["step"]), r["name"], r["status"]) for r in rows] == [
        (s, names[s], "kept" if s in (10, 12, 13) else "pruned") for s in names]
    metrics = read_metrics(tmp_path)
    for r in rows:
        step = int(r["step"])
        assert int(r["tokens"]) == metrics[step]["tokens"] == step * TOKENS_PER_STEP
        # The index writes 6 decimals: within half of 1e-6 of the logged float (no other path).
        assert float(r["loss"]) == pytest.approx(metrics[step]["loss"], abs=5e-7 + 1e-12)
        assert r["saved_at"].endswith("+00:00")
    # The state a checkpoint carries besides model and optimizer.
    state = torch.load(tmp_path / names[12] / "trainer_state.pt", weights_only=False)
    assert state["step"] == 12 and state["tokens_seen"] == 12 * TOKENS_PER_STEP
    assert set(state["rng"]) >= {"python", "numpy", "torch"}
    assert state["scheduler"]["step"] == 12 and state["scheduler"]["schedule"] == "cosine"
    assert state["optimizer"]["name"] == "adamw" and "position" in str(state["data_loader"])
    assert (tmp_path / names[12] / "config.yaml").read_text() == "x: 1\n"

    # A later run resumes from the pruned folder and keeps indexing into the same csv.
    more = make_trainer(tmp_path, 27, 0.0, max_steps=15, checkpoint__save_interval=2,
                        checkpoint__keep_every=5,
                        checkpoint__keep_last=2, checkpoint__resume_from="latest")
    more.fit()
    assert [int(r["step"]) for r in read_index(tmp_path)] == [2, 4, 6, 8, 10, 12, 13, 14, 15]
    # 15 is a multiple of keep_every; of the others (12, 13, 14) the newest two stay
    assert [parse_checkpoint_name(p.name) for p in list_checkpoints(tmp_path)] == [10, 13, 14, 15]
    assert [r["status"] for r in read_index(tmp_path)][4:] == ["kept", "pruned"] + ["kept"] * 3


def test_resolve_checkpoint_by_name_step_and_latest(tmp_path):
    assert not has_checkpoint(tmp_path)
    fake_checkpoints(tmp_path, [3, 10])
    (tmp_path / "step7").mkdir()  # an old-style name, complete
    (tmp_path / "step7" / "trainer_state.pt").write_bytes(b"")
    (tmp_path / "step99").mkdir()  # incomplete: no trainer state
    assert has_checkpoint(tmp_path)
    assert resolve_checkpoint(tmp_path, "latest").name == "stage1-step10-tokens1K"
    (tmp_path / "latest").write_text("stage1-step3-tokens300\n")  # the pointer wins
    assert resolve_checkpoint(tmp_path, "latest").name == "stage1-step3-tokens300"
    (tmp_path / "latest").write_text("stage1-step11-tokens2K\n")  # stale pointer: newest complete
    assert resolve_checkpoint(tmp_path, "latest").name == "stage1-step10-tokens1K"
    assert resolve_checkpoint(tmp_path, "step3").name == "stage1-step3-tokens300"
    assert resolve_checkpoint(tmp_path, "step7").name == "step7"
    full = tmp_path / "stage1-step10-tokens1K"
    assert resolve_checkpoint(tmp_path, str(full)) == full
    assert resolve_checkpoint(tmp_path, full.name) == full
    with pytest.raises(OlmoflowError, match="no checkpoint at 'step5'.*stage1-step3-tokens300"):
        resolve_checkpoint(tmp_path, "step5")


def test_top_level_resume_from_is_train_checkpoint_resume_from():
    cfg = load_config("tiny", ["resume_from=latest"])
    assert cfg.train.checkpoint.resume_from == "latest"
    nested = load_config("tiny", ["train.checkpoint.resume_from=step10"])
    assert nested.train.checkpoint.resume_from == "step10"
    assert load_config("tiny", ["train.resume_from=step9"]).train.checkpoint.resume_from == "step9"
    assert load_config("tiny").train.checkpoint.resume_from is None


def test_resume_from_does_not_change_the_pretrain_fingerprint(tmp_path):
    from olmoflow.pipeline.runner import fingerprint

    base = load_config("tiny", values={"run_dir": str(tmp_path)})
    again = load_config("tiny", ["resume_from=latest"], values={"run_dir": str(tmp_path)})
    longer = load_config("tiny", ["train.max_steps=31"], values={"run_dir": str(tmp_path)})
    assert fingerprint(base, "pretrain") == fingerprint(again, "pretrain")
    assert fingerprint(base, "pretrain") != fingerprint(longer, "pretrain")


@pytest.mark.parametrize("override,message", [
    ("train.optimizer.type=adamww",
     "unknown train.optimizer.type 'adamww'; did you mean 'adamw'?"),
    ("train.optimizer=moun", "did you mean 'muon'?"),  # the old form: a string is the type
    ("train.precision=bf61", "unknown train.precision 'bf61'; did you mean 'bf16'?"),
    ("train.checkpoint.stage=stage/1", "train.checkpoint.stage 'stage/1'"),
    ("train.checkpoint.keep_last=-1", "train.checkpoint.keep_last must be >= 0"),
    ("train.activation_checkpointing=-2", "train.activation_checkpointing must be >= 0"),
    ("train.optimizer.skip_step_sigma=0", "skip_step_sigma"),
    ("train.optimizer.muon_momentum=1.0", "muon_momentum"),
    ("train.schedule.type=cosin", "unknown train.schedule.type 'cosin'; did you mean 'cosine'?"),
])
def test_bad_engine_keys_are_user_errors(override, message):
    with pytest.raises(OlmoflowError) as e:
        load_config("tiny", [override])
    assert message in str(e.value)


# --- finding a checkpoint that was pruned, or in a folder of checkpoints --------------------------


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
    stage1 = tree(tmp_path / "stage1-step6-tokens192")
    make_trainer(tmp_path, 27, 0.0, max_steps=10, checkpoint__save_interval=2,
                 checkpoint__stage="stage2", checkpoint__keep_last=1,
                 checkpoint__resume_from="latest").fit()
    on_disk = [p.name for p in list_checkpoints(tmp_path)]
    assert on_disk == ["stage1-step2-tokens64", "stage1-step4-tokens128", "stage1-step6-tokens192",
                       "stage2-step10-tokens320"]
    assert tree(tmp_path / "stage1-step6-tokens192") == stage1
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
    before, inode = tree(final), (final / "trainer_state.pt").stat().st_ino
    t = make_trainer(tmp_path, 27, 0.0, max_steps=4, checkpoint__save_interval=2,
                     checkpoint__resume_from="latest")
    summary = t.fit()
    assert Path(summary["checkpoint"]) == final and t.step == 4
    assert tree(final) == before and (final / "trainer_state.pt").stat().st_ino == inode


def test_writing_over_a_directory_fails_before_training(tmp_path):
    (tmp_path / "checkpoints.csv").mkdir(parents=True)
    t = make_trainer(tmp_path, 27, 0.0, max_steps=4, checkpoint__save_interval=2)
    with pytest.raises(OlmoflowError, match="checkpoints.csv' is a directory"):
        # was: IsADirectoryError at the first save, after that step's checkpoint was written
        t.fit()
    assert t.step == 0 and list_checkpoints(tmp_path) == []


def test_force_with_resume_from_deletes_nothing(tmp_path):
    """`pretrain --force resume_from=latest` used to delete every checkpoint, then fail: nothing
    left to resume from."""
    from olmoflow.pipeline.runner import run_stage

    make_trainer(tmp_path / "pretrain", 27, 0.0, max_steps=2, checkpoint__save_interval=0).fit()
    before = tree(tmp_path / "pretrain")
    cfg = load_config("tiny", ["resume_from=latest"], values={"run_dir": str(tmp_path)})
    with pytest.raises(OlmoflowError,
                       match="--force would delete the checkpoints .* resume_from=latest"):
        run_stage(cfg, "pretrain", progress=False, force=True)
    assert tree(tmp_path / "pretrain") == before


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
