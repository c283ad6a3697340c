"""OLMo's trainer config keys: those with an exact equivalent are read as it (with one note line
each), the others are one-line errors naming the olmoflow key that does the job."""

from __future__ import annotations

import pytest

from olmoflow import config as config_module
from olmoflow.errors import OlmoflowError
from olmoflow.pipeline.config import load_config

FINETUNE = """\
data:
  paths: [conversations.jsonl]
global_train_batch_size: 8
device_train_microbatch_size: 2
max_duration: 12
optimizer:
  name: adamw
  learning_rate: 1.0e-4
reset_trainer_state: true
load_path: /models/base
"""


@pytest.fixture(autouse=True)
def fresh_notes(monkeypatch):
    monkeypatch.setattr(config_module, "_NOTED", set())


def test_an_olmo_finetuning_config_is_read_into_the_stage(tmp_path, capsys):
    (tmp_path / "ft.yaml").write_text(FINETUNE)
    cfg = load_config(str(tmp_path / "ft.yaml"), stage="sft")
    t = cfg.sft.train
    assert (t.global_batch_size, t.micro_batch_size, t.max_steps) == (8, 2, 12)
    assert t.optimizer.type == "adamw" and t.optimizer.lr == 1e-4
    assert cfg.sft.base == "/models/base"
    notes = capsys.readouterr().err.splitlines()
    for theirs, ours in (("global_train_batch_size", "sft.train.global_batch_size"),
                         ("device_train_microbatch_size", "sft.train.micro_batch_size"),
                         ("max_duration", "sft.train.max_steps"),
                         ("optimizer.name", "sft.train.optimizer.type"),
                         ("optimizer.learning_rate", "sft.train.optimizer.lr")):
        line = f"olmoflow: note: OLMo's config key '{theirs}' is read as '{ours}'"
        assert notes.count(line) == 1, (line, notes)
    assert sum("reset_trainer_state" in n and "sft.base" in n for n in notes) == 1


def test_olmo_keys_as_overrides_of_a_run_config():
    cfg = load_config("tiny", ["global_train_batch_size=8", "device_train_microbatch_size=4",
                               "max_duration=7", "optimizer.learning_rate=1e-3"])
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size) == (8, 4)
    assert cfg.train.max_steps == 7 and cfg.train.optimizer.lr == 1e-3
    assert load_config("tiny", ["max_duration='20'"]).train.max_steps == 20
    assert load_config("tiny", ["train.optimizer.name=muon"]).train.optimizer.type == "muon"


@pytest.mark.parametrize("override, stage, names", [
    ("max_duration=2ep", "sft", ("counts epochs", "sft.train.max_steps")),
    ("max_duration=2e12T", None, ("counts tokens", "train.max_steps")),
    ("scheduler.name=cosine_with_warmup", "sft", ("sft.train.schedule.type=cosine",
                                                  "sft.train.schedule.warmup_steps")),
    ("scheduler.name=inverse_sqrt_with_warmup", None, ("train.schedule.type",)),
    ("reset_trainer_state=false", "sft", ("sft.train.checkpoint.resume_from",)),
    ("reset_trainer_state=true", None, ("train.checkpoint.resume_from", "sft.base")),
    ("run_name=my-run", "sft", ("run_dir",)),
    ("save_folder=/ckpts", None, ("run_dir",)),
    ("optimizer.name=lionw", "sft", ("optimizer.type", "adamw")),
])
def test_keys_without_an_equivalent_name_the_key_that_does_the_job(tmp_path, override, stage,
                                                                   names):
    (tmp_path / "ft.yaml").write_text(FINETUNE)
    source = str(tmp_path / "ft.yaml") if stage else "tiny"
    with pytest.raises(OlmoflowError) as e:
        load_config(source, [override], stage=stage)
    msg = str(e.value)
    assert "\n" not in msg and "did you mean" not in msg
    for name in names:
        assert name in msg, msg
