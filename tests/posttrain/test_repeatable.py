"""Post-training is repeatable with dropout: every stage seeds every RNG from the run's seed, so
two runs of one config are bit-identical whatever the process drew before (residual dropout,
``model.dropout``, and LoRA's ``lora.dropout``), and a run killed mid-way and resumed from its
checkpoint (which keeps the RNG states) equals the straight run."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from olmoflow.model.config import ModelConfig
from olmoflow.model.load import load_step_model
from olmoflow.model.olmo import Olmo
from olmoflow.pipeline.config import load_config
from olmoflow.pipeline.stages.posttrain import run_dpo, run_sft
from olmoflow.posttrain.sft import SFTLoader
from olmoflow.tokenizer import BPETokenizer
from olmoflow.train.checkpoint import save_checkpoint
from olmoflow.train.trainer import METRICS

TEXTS = ["Hello world! The cat sat on the mat. What is 2+2? It is 4.",
         "def add(a, b):\n    return a + b\n# user, assistant, system: be brief"]
COMPARED = ("loss", "ce_loss", "grad_norm")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A pretraining checkpoint with residual dropout 0.1 (with its tokenizer), SFT
    conversations and preference pairs."""
    root = tmp_path_factory.mktemp("repeatable")
    tok = BPETokenizer().train_from_texts(TEXTS * 8, vocab_size=300)
    mc = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=2,
                     mlp_hidden=64, max_sequence_length=128, dropout=0.1)
    torch.manual_seed(0)
    model = Olmo(mc)
    folder = root / "base" / "pretrain"
    step = save_checkpoint(folder, 1, model, torch.optim.AdamW(model.parameters()),
                           {"step": 1, "tokens_seen": 0},
                           yaml.safe_dump({"model": dataclasses.asdict(mc)}))
    tok.save(folder / "tokenizer")
    words = "the cat sat on a mat and what is two plus four it is six hello world".split()
    rng = random.Random(0)

    def phrase():
        return " ".join(rng.choice(words) for _ in range(rng.randint(3, 7)))

    sft = root / "sft.jsonl"
    sft.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": phrase()}, {"role": "assistant", "content": phrase()}]})
        + "\n" for _ in range(16)))
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": phrase(), "chosen": phrase(),
                                         "rejected": phrase()}) + "\n" for _ in range(8)))
    return root, step, sft, pairs


def config(run_dir: Path, stage: str, base: Path, data: Path, *extra: str):
    common = [f"run_dir={run_dir}", f"{stage}.base={base}", f"{stage}.data.paths=[{data}]",
              f"{stage}.train.sequence_length=48", f"{stage}.train.global_batch_size=4",
              f"{stage}.train.micro_batch_size=2", f"{stage}.train.max_steps=4",
              f"{stage}.train.num_threads=1", f"{stage}.train.log.interval=1",
              f"{stage}.train.optimizer.lr=1e-3"]
    return load_config("tiny", [*common, *extra])


def disturb(n: int) -> None:
    """Leave every global RNG somewhere else, as whatever ran before in a process would."""
    random.seed(n)
    np.random.seed(n)
    torch.manual_seed(n)


def logged(run_dir: Path, stage: str) -> dict[int, tuple]:
    rows = [json.loads(ln) for ln in (run_dir / stage / METRICS).read_text().splitlines()]
    return {r["step"]: tuple(r[k] for k in COMPARED if k in r) for r in rows}


def final_weights(run_dir: Path, stage: str) -> dict[str, torch.Tensor]:
    out = run_dir / stage
    return load_step_model(out / (out / "latest").read_text().strip(), 0).state_dict()


def assert_same_run(a: Path, b: Path, stage: str) -> None:
    la, lb = logged(a, stage), logged(b, stage)
    assert sorted(la) == [1, 2, 3, 4] and la == lb
    wa, wb = final_weights(a, stage), final_weights(b, stage)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("stage, extra", [
    ("sft", ()),                                          # model.dropout, from the base
    ("sft", ("sft.lora.r=4", "sft.lora.dropout=0.1")),    # LoRA dropout on top
    ("dpo", ()),
], ids=["sft-dropout", "sft-lora-dropout", "dpo-dropout"])
def test_two_runs_with_dropout_are_bit_identical(files, tmp_path, stage, extra):
    root, base, sft, pairs = files
    data = sft if stage == "sft" else pairs
    run = run_sft if stage == "sft" else run_dpo
    for i, name in enumerate(("a", "b")):
        disturb(100 + i)
        run(config(tmp_path / name, stage, base, data, *extra), progress=False)
    assert_same_run(tmp_path / "a", tmp_path / "b", stage)
    # the runs did train with dropout: the model's (from the base) and LoRA's when asked for
    out = tmp_path / "a" / stage
    saved = yaml.safe_load((out / (out / "latest").read_text().strip() / "config.yaml").read_text())
    assert saved["model"]["dropout"] == 0.1
    if extra:
        assert json.loads((out / "lora.json").read_text())["dropout"] == 0.1


class Killed(Exception):
    pass


def test_killed_and_resumed_equals_the_straight_run(files, tmp_path, monkeypatch):
    root, base, sft, _ = files
    extra = ("sft.lora.r=4", "sft.lora.dropout=0.1", "sft.train.checkpoint.save_interval=2")
    disturb(1)
    run_sft(config(tmp_path / "straight", "sft", base, sft, *extra), progress=False)
    fetch, calls = SFTLoader.next_batch, []

    def next_batch(self):
        calls.append(1)
        if len(calls) == 3:  # after the checkpoint of step 2
            raise Killed
        return fetch(self)

    monkeypatch.setattr(SFTLoader, "next_batch", next_batch)
    disturb(2)
    with pytest.raises(Killed):
        run_sft(config(tmp_path / "resumed", "sft", base, sft, *extra), progress=False)
    monkeypatch.setattr(SFTLoader, "next_batch", fetch)
    disturb(3)  # the resume takes its RNG state from the checkpoint, not from the process
    run_sft(config(tmp_path / "resumed", "sft", base, sft, *extra,
                   "sft.train.checkpoint.resume_from=latest"), progress=False)
    assert_same_run(tmp_path / "straight", tmp_path / "resumed", "sft")
