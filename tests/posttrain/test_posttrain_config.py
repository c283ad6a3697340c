"""Post-training config sections: stage defaults survive partial YAML, OLMo's finetuning form is
read into the verb's section, and bad values are one-line errors."""

from __future__ import annotations

import pytest

from olmoflow.config import from_dict
from olmoflow.errors import OlmoflowError
from olmoflow.pipeline.config import load_config
from olmoflow.pipeline.models import final_model_stage, previous_model_stage
from olmoflow.pipeline.stages import STAGES  # noqa: F401  (the flow's table, which the chain reads)
from olmoflow.posttrain.config import DPOConfig, LoraConfig, SFTConfig
from olmoflow.train.config import TrainConfig

FINETUNE = """\
data:
  paths: [your_data.jsonl]   # each line has a text field (or messages)
train:
  batch_size: 4
optimizer:
  type: adamw
  lr: 1e-5
"""


def test_a_partial_train_section_keeps_the_stage_defaults():
    c = from_dict(SFTConfig, {"train": {"max_steps": 5}}, "sft.")
    assert c.train.max_steps == 5
    assert c.train.optimizer.lr == 2e-5 and c.train.optimizer.weight_decay == 0.0
    assert c.train.schedule.type == "linear" and c.train.checkpoint.stage == "sft"
    # the pretraining section is untouched by that
    assert from_dict(TrainConfig, {}, "train.").optimizer.lr == TrainConfig().optimizer.lr
    d = from_dict(DPOConfig, {"train": {"optimizer": {"type": "adamw"}}}, "dpo.")
    assert d.train.optimizer.lr == 5e-7 and d.train.checkpoint.stage == "dpo"


def test_the_finetuning_config_of_olmos_docs_works_as_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ft.yaml").write_text(FINETUNE)
    cfg = load_config(str(tmp_path / "ft.yaml"), ["train.max_steps=7"], stage="sft")
    assert cfg.sft.data.paths == [str(tmp_path / "your_data.jsonl")]
    assert cfg.sft.train.global_batch_size == 4 and cfg.sft.train.micro_batch_size == 4
    assert cfg.sft.train.optimizer.lr == 1e-5 and cfg.sft.train.max_steps == 7
    assert cfg.train.data == [] and cfg.train.max_steps == TrainConfig().max_steps
    assert cfg.run_dir == "runs/ft"
    # the same file under another verb is a pretraining config, as before
    assert load_config(str(tmp_path / "ft.yaml")).train.data == [str(tmp_path / "your_data.jsonl")]


def test_load_path_names_the_base(tmp_path):
    (tmp_path / "ft.yaml").write_text(FINETUNE + "load_path: /models/base\n")
    assert load_config(str(tmp_path / "ft.yaml"), stage="dpo").dpo.base == "/models/base"


def test_a_run_config_with_its_own_section_is_not_rerooted(tmp_path):
    (tmp_path / "run.yaml").write_text(
        "sft:\n  data:\n    paths: [a.jsonl]\ntrain:\n  max_steps: 3\n")
    cfg = load_config(str(tmp_path / "run.yaml"), stage="sft")
    assert cfg.train.max_steps == 3 and cfg.sft.train.max_steps == 100


@pytest.mark.parametrize("override, words", [
    ("sft.template=tullu", "tulu"),
    ("sft.data.on_too_long=cut", "truncate"),
    ("dpo.loss=simpoo", "simpo"),
    ("dpo.beta=0", "dpo.beta"),
    ("rl.group_size=1", "rl.group_size"),
    ("rl.prompts.source=gsm8k", "rl.prompts.path"),
    ("sft.lora.targets=[q,kk]", "k"),
    ("sft.trian.max_steps=3", "sft.train.max_steps"),
])
def test_bad_values_are_one_line_errors(override, words):
    with pytest.raises(OlmoflowError) as e:
        load_config("tiny", [override])
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_stage_order_decides_each_base_and_the_final_model():
    cfg = load_config("tiny")
    assert final_model_stage(cfg) == "pretrain"
    cfg = load_config("tiny", ["sft.data.paths=[a.jsonl]", "rl.prompts.source=arithmetic"])
    assert final_model_stage(cfg) == "rl"
    assert previous_model_stage(cfg, "rl") == "sft"
    assert previous_model_stage(cfg, "dpo") == "sft"
    assert previous_model_stage(cfg, "sft") == "pretrain"

@pytest.mark.parametrize("lora, match", [
    ({"alpha": 0}, "lora.alpha must be > 0"),
    ({"alpha": -1.0}, "lora.alpha must be > 0"),
    ({"targets": []}, "lora.targets must name at least one"),
])
def test_bad_lora_values_fail_when_the_config_is_read(lora, match):
    with pytest.raises(OlmoflowError, match=match):
        from_dict(LoraConfig, lora, "sft.lora.")


def test_one_lora_target_given_as_a_string_is_one_target():
    assert from_dict(LoraConfig, {"targets": "q"}, "sft.lora.").targets == ["q"]
    with pytest.raises(OlmoflowError, match="lora.targets"):
        from_dict(LoraConfig, {"targets": "qk"}, "sft.lora.")
    # peft's module names, as a user coming from peft writes them, are the same targets
    assert from_dict(LoraConfig, {"targets": ["q_proj", "v_proj", "w_q"]},
                     "sft.lora.").targets == ["q", "v"]


def test_a_negative_simpo_margin_is_an_error():
    with pytest.raises(OlmoflowError, match="dpo.simpo_gamma must be >= 0"):
        from_dict(DPOConfig, {"loss": "simpo", "simpo_gamma": -1}, "dpo.")
    assert from_dict(DPOConfig, {"simpo_gamma": 0.0}, "dpo.").simpo_gamma == 0.0
