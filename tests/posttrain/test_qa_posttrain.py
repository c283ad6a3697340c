"""Regressions found by trying the post-training commands as a new user would: data paths that
are not files, a DPO reference with another tokenizer, GRPO's KL term from the stage, config values
that used to pass, and ``olmoflow chat`` details."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from checks import scripted_input

from olmoflow.config import from_dict
from olmoflow.errors import OlmoflowError
from olmoflow.infer.chat import _trained_length, chat_main
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo
from olmoflow.pipeline.stages.posttrain import Base, check_same_tokenizer
from olmoflow.posttrain.chat_template import add_chat_template
from olmoflow.posttrain.config import DPOConfig, LoraConfig
from olmoflow.posttrain.data import DataStats, check_data_files, read_conversations
from olmoflow.posttrain.rewards import read_prompts
from olmoflow.posttrain.sft import build_sft_data
from olmoflow.tokenizer import BPETokenizer

TEXTS = ["Hello world! The cat sat on the mat. What is 2+2? It is 4.",
         "def add(a, b):\n    return a + b\n# user, assistant, system: be brief",
         "emoji and cafe, more words about cats and mats; numbers 1 2 3 4 5 6 7 8 9"]
CONV = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def _tok(vocab: int = 300) -> BPETokenizer:
    return BPETokenizer().train_from_texts(TEXTS * 8, vocab_size=vocab)


def _model(tok: BPETokenizer, window: int = 128) -> Olmo:
    torch.manual_seed(0)
    return Olmo(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=2,
                            mlp_hidden=64, max_sequence_length=window)).eval()


# ---- data paths ---------------------------------------------------------------------------


def test_a_missing_path_without_a_data_suffix_is_an_error_not_a_text_record(tmp_path):
    missing = tmp_path / "mydata"  # no .jsonl: it used to be trained on as the text "…/mydata"
    with pytest.raises(OlmoflowError, match="sft.data.paths: no such data file"):
        check_data_files([missing], "sft.data.paths")
    with pytest.raises(OlmoflowError, match="no such data file"):
        build_sft_data([str(missing)], None, "tulu", _tok(), 64)


def test_a_directory_path_is_an_error_naming_it(tmp_path):
    d = tmp_path / "convs"
    d.mkdir()
    with pytest.raises(OlmoflowError, match="is a directory"):
        check_data_files([d], "dpo.data.paths")
    with pytest.raises(OlmoflowError, match="is a directory"):
        list(read_conversations([str(d)]))
    with pytest.raises(OlmoflowError, match="is a directory"):
        build_sft_data([d], None, "tulu", _tok(), 64)
    ok = tmp_path / "ok.jsonl"
    ok.write_text(json.dumps(CONV) + "\n")
    check_data_files([ok])  # a file passes
    assert len(list(read_conversations([ok]))) == 1


def test_a_prompt_directory_is_named_as_a_directory(tmp_path):
    with pytest.raises(OlmoflowError, match="is a directory"):
        read_prompts(tmp_path, stats=DataStats())


# ---- config values ------------------------------------------------------------------------


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


# ---- DPO reference ------------------------------------------------------------------------


def _base(tok: BPETokenizer, path: str) -> Base:
    return Base(model=_model(tok), tokenizer=tok, path=Path(path), kind="hf", files=[])


def test_a_reference_with_another_tokenizer_is_refused():
    a, b = _tok(300), _tok(280)
    add_chat_template(a, "tulu")
    add_chat_template(b, "tulu")
    with pytest.raises(OlmoflowError, match="dpo.reference: '/ref' has another tokenizer"):
        check_same_tokenizer(_base(a, "/base"), _base(b, "/ref"), "dpo.reference")
    c = _tok(300)
    add_chat_template(c, "tulu")
    check_same_tokenizer(_base(a, "/base"), _base(c, "/ref"), "dpo.reference")  # the same one


# ---- RL with a KL term --------------------------------------------------------------------


def test_rl_with_kl_coef_trains(tmp_path):
    """``rl.kl_coef > 0`` used to stop at the first step with an internal message ("build the
    RolloutLoader with ref_model="): the stage now gives the loader a frozen copy of the base."""
    from olmoflow.pipeline.config import load_config
    from olmoflow.pipeline.stages.posttrain import run_rl

    tok = _tok()
    model = _model(tok)
    base = tmp_path / "base"
    model.save_pretrained(base, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tok.save(base)
    cfg = load_config("tiny", [
        f"run_dir={tmp_path / 'run'}", f"rl.base={base}", "rl.prompts.source=arithmetic",
        "rl.prompts.count=8", "rl.prompts.heldout=0", "rl.kl_coef=0.1", "rl.group_size=2",
        "rl.prompts_per_step=2", "rl.max_new_tokens=4", "rl.temperature=2.0",
        "rl.train.max_steps=2", "rl.train.global_batch_size=4", "rl.train.micro_batch_size=4",
        "rl.train.optimizer.lr=1e-2", "rl.eval_interval=0"])
    result = run_rl(cfg, progress=False)
    assert result.counts["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "rl" / "metrics.jsonl").open()]
    assert all("kl" in r for r in rows if "step" in r)


# ---- olmoflow chat ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    tok = _tok()
    model = _model(tok, window=128)
    add_chat_template(tok, "tulu", model=model)
    d = tmp_path_factory.mktemp("release")
    model.save_pretrained(d, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tok.save(d)
    (d / "config.yaml").write_text("train:\n  sequence_length: 96\n")
    return d


def test_a_message_not_sent_is_not_also_an_empty_reply(release):
    out = io.StringIO()
    rc = chat_main([str(release), "--seed", "0", "--max-new-tokens", "4", "--device", "cpu"],
                   input_fn=scripted_input(["hi", "cat " * 200]), output=out)
    text = out.getvalue()
    assert rc == 0 and text.count("[note] message not sent") == 1
    sent, not_sent = text.split("message not sent", 1)
    assert "\n" in sent.split("leave\n", 1)[1]  # "hi" was sent and answered (or said no reply)
    assert "[no reply" not in not_sent


def test_max_new_tokens_zero_is_a_one_line_error(release):
    err = io.StringIO()
    assert chat_main([str(release), "--max-new-tokens", "0", "--device", "cpu"],
                     input_fn=scripted_input([]), output=io.StringIO(), errors=err) == 2
    assert "--max-new-tokens must be >= 1" in err.getvalue()
    assert err.getvalue().count("\n") == 1


def test_the_context_of_a_post_trained_checkpoint_is_its_stages_length(tmp_path):
    """A model pretrained on 64-token windows, then fine-tuned on 256-token conversations: chat
    used to cut it to 64 tokens (pretraining's train.sequence_length)."""
    (tmp_path / "config.yaml").write_text(
        "train:\n  sequence_length: 64\n"
        "sft:\n  data:\n    paths: [a.jsonl]\n  train:\n    sequence_length: 256\n"
        "dpo:\n  data:\n    paths: []\n  train:\n    sequence_length: 1024\n")
    assert _trained_length(tmp_path) == 256  # dpo has no data: not part of the run
    (tmp_path / "config.yaml").write_text("train:\n  sequence_length: 64\n")
    assert _trained_length(tmp_path) == 64


def test_one_line_that_is_not_utf8_is_one_bad_line(tmp_path):
    """A JSONL file with one undecodable line: that line is skipped and counted with its number
    (an error under strict), the rest of the file is read."""
    from olmoflow.eval.sources import read_records
    from olmoflow.posttrain.data import DataStats, read_conversations

    path = tmp_path / "mixed.jsonl"
    good = (b'{"messages": [{"role": "user", "content": "a"}, '
            b'{"role": "assistant", "content": "b"}]}\n')
    path.write_bytes(good + b'{"text": "\xff\xfe"}\n' + good)
    skipped: list[str] = []
    assert [w for w, _ in read_records([path], "jsonl", skipped=skipped)] == [
        f"{path}:1", f"{path}:3"]
    assert skipped == [f"{path}:2: not UTF-8 text (invalid start byte at byte 10 of the line)"]
    stats = DataStats()
    assert len(list(read_conversations([path], stats=stats))) == 2
    with pytest.raises(OlmoflowError, match=r"mixed.jsonl:2: not UTF-8"):
        list(read_records([path], "jsonl", strict=True))
