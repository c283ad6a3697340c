"""Examples, pairs, prompts and batches with nothing to train on: each is skipped and counted
under its own name (an error under ``strict``), a file with none left is a one-line error naming
it, and a global batch without a target token is skipped by the trainer instead of dividing the
loss by zero."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from olmoflow.config import from_dict
from olmoflow.errors import OlmoflowError
from olmoflow.model.config import ModelConfig
from olmoflow.model.loss import lm_loss
from olmoflow.model.olmo import IGNORE_INDEX, Olmo
from olmoflow.pipeline.stages.posttrain import data_counts
from olmoflow.posttrain.data import DataStats, PreferencePair, preference_examples, read_pairs
from olmoflow.posttrain.dpo import build_dpo_data
from olmoflow.posttrain.grpo import GRPOObjective
from olmoflow.posttrain.rewards import read_prompts
from olmoflow.posttrain.sft import SFTLoader, SFTObjective, build_sft_data
from olmoflow.tokenizer import BPETokenizer
from olmoflow.tokenizer.chat import add_chat_template
from olmoflow.train import distributed
from olmoflow.train.config import TrainConfig
from olmoflow.train.trainer import METRICS, Trainer

TEXTS = ["Hello world! The cat sat on the mat. What is 2+2? It is 4.",
         "def add(a, b):\n    return a + b\n# user, assistant, system: be brief"]
# The reproducer: the only assistant turn is empty and comes first, so under the plain
# template its one trained token (the EOS) is the row's first token, which is never a target.
EMPTY = {"conversations": [{"from": "gpt", "value": ""}, {"from": "human", "value": "hello"}]}
GOOD = [{"messages": [{"role": "user", "content": f"What is {i} plus 1?"},
                      {"role": "assistant", "content": f"It is {i + 1}."}]} for i in range(6)]


@pytest.fixture(scope="module")
def tok() -> BPETokenizer:
    t = BPETokenizer().train_from_texts(TEXTS * 8, vocab_size=300)
    add_chat_template(t, "plain")
    return t


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ---- SFT examples ---------------------------------------------------------------------------


def test_a_file_of_examples_without_assistant_tokens_is_a_one_line_error(tok, tmp_path):
    z = write_jsonl(tmp_path / "z.jsonl", [EMPTY])
    with pytest.raises(OlmoflowError) as e:
        build_sft_data([str(z)], None, "plain", tok, 64, packing=False)
    msg = str(e.value)
    assert msg.startswith(f"{z}: no example left to train on") and "\n" not in msg
    assert "1 skipped: no assistant tokens" in msg


def test_examples_without_assistant_tokens_are_skipped_and_counted(tok, tmp_path):
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [GOOD[0], EMPTY, *GOOD[1:], EMPTY])
    ds, stats = build_sft_data([str(mixed)], None, "plain", tok, 64, packing=False)
    assert stats.read == 8 and stats.kept == 6 == ds.num_examples
    assert stats.no_targets == [f"{mixed}:2", f"{mixed}:8"]
    assert "6 kept" in stats.summary() and "2 skipped: no assistant tokens" in stats.summary()
    assert data_counts(stats, "examples") == {"examples": 6, "skipped": 2, "truncated": 0,
                                              "dropped": 0, "skipped_no_targets": 2}
    # every row then has a target
    loader = SFTLoader(ds, 1, seed=0)
    for _ in range(len(ds)):
        assert (loader.next_batch().labels != IGNORE_INDEX).any()
    with pytest.raises(OlmoflowError, match=f"{mixed}:2: no assistant tokens"):
        build_sft_data([str(mixed)], None, "plain", tok, 64, packing=False, strict=True)


def test_the_file_with_nothing_left_is_named_among_several(tok, tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", GOOD)
    z = write_jsonl(tmp_path / "z.jsonl", [EMPTY, EMPTY])
    with pytest.raises(OlmoflowError, match=f"^{z}: no example left to train on"):
        build_sft_data([str(good), str(z)], None, "plain", tok, 64)


# ---- the step ---------------------------------------------------------------------------------


def test_a_zero_normalizer_is_a_zero_loss_not_a_division_by_zero():
    logits = torch.randn(2, 3, 7, requires_grad=True)
    labels = torch.full((2, 3), IGNORE_INDEX)
    loss, ce, z = lm_loss(logits, labels, 1e-4, normalizer=0)
    loss.backward()
    assert loss.item() == ce.item() == z.item() == 0.0
    assert torch.count_nonzero(logits.grad) == 0


class Rows:
    """A loader of fixed batches (the first without any target), with a cursor state."""

    def __init__(self, batches):
        self.batches, self.position, self.epoch = batches, 0, 0

    def next_batch(self):
        b = self.batches[self.position % len(self.batches)]
        self.position += 1
        return b

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_a_global_batch_without_targets_is_skipped_and_counted(tmp_path, caplog):
    torch.manual_seed(0)
    model = Olmo(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, mlp_hidden=64,
                             max_sequence_length=16))
    ids = torch.randint(0, 64, (2, 8))
    empty = {"input_ids": ids, "labels": torch.full((2, 8), IGNORE_INDEX)}
    full = {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}
    cfg = from_dict(TrainConfig, {"sequence_length": 8, "global_batch_size": 2,
                                  "micro_batch_size": 1, "max_steps": 2, "num_threads": 1,
                                  "log": {"interval": 1}, "checkpoint": {"save_interval": 0}},
                    "train.")
    trainer = Trainer(model, cfg, Rows([empty, full, empty, full]), tmp_path, progress=False,
                      objective=SFTObjective())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert trainer.train_step(empty) is None  # used to raise ZeroDivisionError
    assert trainer.step == 0 and trainer.empty_batches == 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    trainer.empty_batches = 0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="olmoflow.train.trainer"):
        summary = trainer.fit()
    # two real steps; the two empty batches before them were skipped, each with a line
    assert summary["steps"] == 2 and summary["empty_batches"] == 2
    assert sum("no target token" in r.getMessage() for r in caplog.records) == 2
    rows = [json.loads(ln) for ln in (tmp_path / METRICS).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["assistant_tokens"] == 16 for r in rows)


def test_grpo_reports_a_batch_without_response_tokens_as_empty():
    obj = GRPOObjective()
    batch = {"input_ids": torch.ones(2, 4, dtype=torch.long),
             "response_mask": torch.zeros(2, 4, dtype=torch.bool)}
    assert obj.normalizer(batch, distributed.init_from_env()) == 0
    batch["response_mask"][0, 1] = True
    assert obj.normalizer(batch, distributed.init_from_env()) == 1


# ---- preference pairs -------------------------------------------------------------------------


HH = "\n\nHuman: What is 2+2?\n\nAssistant: It is 4."
SAME = [{"prompt": "p", "chosen": "same", "rejected": "same"},
        {"chosen": HH, "rejected": HH},
        {"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
         "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
PAIRS = [{"prompt": f"What is {i} plus 1?", "chosen": f"{i + 1}", "rejected": f"{i + 7} maybe"}
         for i in range(4)]


@pytest.mark.parametrize("rec", SAME, ids=["prompt", "hh_rlhf", "messages"])
def test_identical_chosen_and_rejected_are_skipped_and_counted(rec, tok, tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [PAIRS[0], rec, *PAIRS[1:]])
    stats = DataStats()
    pairs = list(read_pairs([path], stats=stats))
    assert len(pairs) == 4 and stats.identical == [f"{path}:2"] and stats.kept == 4
    assert "1 skipped: identical chosen and rejected" in stats.summary()
    with pytest.raises(OlmoflowError, match=f"{path}:2: identical chosen and rejected"):
        list(read_pairs([path], strict=True))
    only = write_jsonl(tmp_path / "same.jsonl", [rec])
    with pytest.raises(OlmoflowError, match=f"^{only}: no preference pairs left to train on"):
        build_dpo_data([str(only)], "plain", tok, 96)


def test_a_pair_given_as_an_object_is_checked_on_its_tokens(tok):
    stats = DataStats()
    pair = PreferencePair("x:1", [{"role": "user", "content": "p"}],
                          [{"role": "assistant", "content": "same"}],
                          [{"role": "assistant", "content": "same"}])
    assert list(preference_examples([pair], "plain", tok, stats=stats)) == []
    assert stats.identical == ["x:1"]


# ---- RL prompts -------------------------------------------------------------------------------


def test_a_blank_rl_prompt_is_skipped_and_a_file_of_them_named(tmp_path):
    good = {"messages": [{"role": "user", "content": "What is 1+1?"}], "ground_truth": "2"}
    blank = {"messages": [{"role": "user", "content": "  "}], "ground_truth": "2"}
    path = write_jsonl(tmp_path / "p.jsonl", [good, blank])
    stats = DataStats()
    assert len(read_prompts(path, stats=stats)) == 1
    assert stats.skipped == [f"{path}:2: the prompt is empty (every message's content is blank)"]
    only = write_jsonl(tmp_path / "blank.jsonl", [blank])
    with pytest.raises(OlmoflowError, match=f"^{only}: no RL prompts left to train on"):
        read_prompts(only)
