"""The nested ``train`` config: its sections, the old flat keys (accepted with one note each),
OLMo's finetuning form, and closest-key errors inside a section."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields

import pytest

import olmoflow.config
from olmoflow.cli import main
from olmoflow.config import all_keys
from olmoflow.errors import OlmoflowError
from olmoflow.pipeline.config import RunConfig, load_config
from olmoflow.train.config import (
    RENAMED,
    SECTION_TYPES,
    CheckpointConfig,
    LogConfig,
    OptimizerConfig,
    ScheduleConfig,
    TrainConfig,
)


@pytest.fixture
def notes(monkeypatch, capsys):
    """The rename notes printed from here on (each is printed once per process otherwise)."""
    monkeypatch.setattr(olmoflow.config, "_NOTED", set())
    capsys.readouterr()
    return lambda: [ln for ln in capsys.readouterr().err.splitlines() if "note:" in ln]


def test_old_flat_key_equals_the_nested_key_with_one_note(notes):
    old = load_config("tiny", ["train.lr=1e-3"])
    assert notes() == ["olmoflow: note: config key 'train.lr' is now 'train.optimizer.lr'"]
    assert old == load_config("tiny", ["train.optimizer.lr=1e-3"])
    assert old.train.optimizer.lr == 1e-3
    assert notes() == []


@pytest.mark.parametrize("override,check", [
    ("train.warmup_steps=7", lambda t: t.schedule.warmup_steps == 7),
    ("train.schedule=wsd", lambda t: t.schedule.type == "wsd" and t.schedule.warmup_steps == 5),
    ("train.optimizer=muon", lambda t: t.optimizer.type == "muon"),
    ("train.save_interval=3", lambda t: t.checkpoint.save_interval == 3),
    ("train.stage=stage2", lambda t: t.checkpoint.stage == "stage2"),
    ("train.log_interval=2", lambda t: t.log.interval == 2),
    ("train.detailed_log_interval=4", lambda t: t.log.detailed_interval == 4),
    ("train.loggers=tensorboard", lambda t: t.log.loggers == ["tensorboard"]),
    ("train.data_parallel=fsdp", lambda t: t.parallel.data_parallel == "fsdp"),
    ("train.grad_clip=0.5", lambda t: t.max_grad_norm == 0.5),
    ("train.beta2=0.99", lambda t: t.optimizer.betas == [0.9, 0.99]),
    ("train.batch_size=16", lambda t: t.global_batch_size == 16),
])
def test_old_flat_keys_land_in_their_sections(notes, override, check):
    assert check(load_config("tiny", [override]).train)
    (note,) = notes()
    assert f"'{override.split('=')[0]}' is now 'train." in note


def test_every_old_key_names_a_valid_new_key():
    valid = set(all_keys(TrainConfig))
    assert {f"{k}" for k in {*RENAMED.values(), *SECTION_TYPES.values()}} <= valid
    assert not set(RENAMED) & {f.name for f in fields(TrainConfig)}  # old names are not fields


def test_a_flat_override_wins_over_the_nested_preset_value():
    cfg = load_config("olmo3_7b", ["train.warmup_steps=10", "train.keep_last=1"])
    assert cfg.train.schedule.warmup_steps == 10 and cfg.train.schedule.min_lr_ratio == 0.1
    assert cfg.train.checkpoint.keep_last == 1 and cfg.train.checkpoint.keep_every == 10000


def test_presets_are_nested_and_print_no_note(notes):
    for preset in ("tiny", "demo", "olmo3_7b", "olmo3_32b"):
        load_config(preset)
    assert notes() == []
    big = load_config("olmo3_32b").train
    assert (big.optimizer.lr, big.optimizer.betas, big.schedule.warmup_steps) == (6e-4, [0.9, 0.95],
                                                                                 2000)
    assert big.parallel.data_parallel == "fsdp" and big.checkpoint.keep_last == 2


@pytest.mark.parametrize("override,hint", [
    ("train.optimizer.lrr=1e-3", "unknown config key 'train.optimizer.lrr'; did you mean "
                                 "'train.optimizer.lr'?"),
    ("train.checkpoint.save_intervl=3", "did you mean 'train.checkpoint.save_interval'?"),
    ("train.log.intervall=3", "did you mean 'train.log.interval'?"),
    ("train.schedule.warmup=3", "did you mean 'train.schedule.warmup_steps'?"),
])
def test_unknown_key_in_a_section_names_the_closest(override, hint):
    with pytest.raises(OlmoflowError) as e:
        load_config("tiny", [override])
    assert hint in str(e.value) and "\n" not in str(e.value)


def test_train_data_is_a_list_of_token_directories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config("tiny").train.data == []
    assert load_config("tiny", ["train.data=runs/data/web/tokens"]).train.data == [
        str(tmp_path / "runs/data/web/tokens")]
    assert load_config("tiny", ["train.data=[a/tokens, b/tokens]"]).train.data == [
        str(tmp_path / "a/tokens"), str(tmp_path / "b/tokens")]


def test_olmo_finetuning_form_loads(tmp_path, notes):
    """The shape of a finetuning config in OLMo's docs: top-level data paths and optimizer."""
    path = tmp_path / "finetune.yaml"
    path.write_text("run_dir: runs/ft\n"
                    "data:\n  paths: [your_data.jsonl]\n"
                    "train:\n  batch_size: 4\n"
                    "optimizer:\n  type: adamw\n  lr: 1.0e-5\n")
    cfg = load_config(str(path))
    t = cfg.train
    assert t.data == [os.path.abspath("your_data.jsonl")]  # relative to the working directory
    assert t.global_batch_size == 4 and t.micro_batch_size == 4  # a batch of 4 as one micro-batch
    assert t.optimizer.type == "adamw" and t.optimizer.lr == 1e-5
    assert t.optimizer.weight_decay == 0.1  # the rest of the section keeps its defaults
    assert sorted(notes()) == sorted([
        "olmoflow: note: config key 'data.paths' is now 'train.data'",
        "olmoflow: note: config key 'optimizer' is now 'train.optimizer'",
        "olmoflow: note: config key 'train.batch_size' is now 'train.global_batch_size'",
    ])


def test_top_level_optimizer_merges_into_the_preset_section():
    cfg = load_config("olmo3_7b", ["optimizer={lr: 1.0e-5}"])
    assert cfg.train.optimizer.lr == 1e-5 and cfg.train.optimizer.eps == 1e-8
    assert cfg.train.optimizer.betas == [0.9, 0.95]


def test_run_config_keys_still_have_closest_hints():
    with pytest.raises(OlmoflowError, match="did you mean 'train.max_steps'"):
        load_config("tiny", ["trian.max_steps=5"])
    assert "train.optimizer.lr" in all_keys(RunConfig)


def test_reading_a_config_imports_no_training_code():
    """The config sections hold the names the trainer modules check against, not the reverse."""
    code = ("import sys; import olmoflow.pipeline.config as c; c.load_config('tiny'); "
            "bad = [m for m in ('olmoflow.train.trainer', 'olmoflow.train.optim', "
            "'olmoflow.train.distributed', 'olmoflow.train.loggers') if m in sys.modules]; "
            "import olmoflow.train.batch_finder; "
            "bad += ['batch_finder -> trainer'] * ('olmoflow.train.trainer' in sys.modules); "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_new_key_overrides_an_old_style_file(tmp_path):
    """A YAML written with the old flat keys (and string sections) still takes nested overrides,
    and on the command line the later spelling wins."""
    path = tmp_path / "flat.yaml"
    path.write_text("train:\n  lr: 1.0e-3\n  save_interval: 3\n  beta1: 0.8\n"
                    "  optimizer: muon\n  schedule: wsd\n")
    cfg = load_config(str(path), ["train.optimizer.lr=5e-3", "train.checkpoint.save_interval=7",
                                  "train.optimizer.betas=[0.5, 0.6]", "train.schedule.type=cosine"])
    t = cfg.train
    assert (t.optimizer.lr, t.checkpoint.save_interval, t.optimizer.betas) == (5e-3, 7, [0.5, 0.6])
    assert (t.optimizer.type, t.schedule.type) == ("muon", "cosine")
    assert load_config("tiny", ["train.lr=1e-3", "train.optimizer.lr=5e-3"]).train.optimizer.lr \
        == 5e-3
    assert load_config("tiny", ["train.optimizer.lr=5e-3", "train.lr=1e-3"]).train.optimizer.lr \
        == 1e-3


def test_train_data_paths_are_absolute_and_named_once(tmp_path, monkeypatch):
    """A relative train.data means the same directories from any later working directory (the
    fingerprint and the saved config hold the absolute path); a directory named twice or an empty
    path is refused."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config("tiny", ["train.data=toks"])
    assert cfg.train.data == [str(tmp_path / "toks")]
    assert load_config("tiny", [f"train.data={tmp_path / 'toks'}"]).train.data == cfg.train.data
    with pytest.raises(OlmoflowError, match="train.data names '.*toks' twice"):
        load_config("tiny", [f"train.data=[toks, {tmp_path / 'toks'}]"])
    with pytest.raises(OlmoflowError, match="train.data has an empty path"):
        load_config("tiny", ["train.data="])


def test_a_config_without_run_dir_gets_its_own(tmp_path, monkeypatch):
    """A config file that names no run_dir writes to runs/<its name>, never into another
    preset's run (the finetuning form of OLMo's docs has no run_dir)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_finetune.yaml").write_text("train:\n  max_steps: 3\n")
    assert load_config("my_finetune.yaml").run_dir == "runs/my_finetune"
    assert load_config("olmo3_7b").run_dir == "runs/olmo3_7b"
    assert load_config("demo").run_dir == "runs/demo"
    assert load_config("my_finetune.yaml", ["run_dir=x"]).run_dir == "x"


# --- train.* numbers that used to train silently wrong or crash with a traceback ------------------


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
