"""Checkpoint names, the checkpoints.csv index, the keep_every/keep_last pruning policy, finding
checkpoints by name, and the config keys of the checkpoint policy and resume."""

from __future__ import annotations

import csv
import io
import itertools
from pathlib import Path

import pytest
import torch
from resume_helpers import make_trainer, read_metrics

from olmoflow.errors import OlmoflowError
from olmoflow.pipeline.config import load_config
from olmoflow.train.checkpoint import (
    INDEX,
    checkpoint_name,
    has_checkpoint,
    list_checkpoints,
    parse_checkpoint_name,
    prune_checkpoints,
    resolve_checkpoint,
)
from olmoflow.train.checkpoint_names import format_tokens

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
