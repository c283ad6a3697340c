"""The memory plan (``olmoflow plan``) against closed forms, the official parameter counts and a
measurement of what autograd really saves in this model."""

from __future__ import annotations

import pytest
import torch

from olmoflow.cli import main
from olmoflow.errors import OlmoflowError
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo
from olmoflow.pipeline.config import load_config
from olmoflow.train.plan import (
    GB,
    activation_bytes_per_token,
    block_bytes_per_token,
    memory_plan,
    plan_config,
    saved_activation_bytes,
)

OLMO2_7B_PARAMS = 7_298_617_344  # allenai/OLMo-2-1124-7B (tests/model/test_presets.py)


def measured_saved_bytes(cfg: ModelConfig, batch: int, seq: int) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward with labels."""
    torch.manual_seed(0)
    model = Olmo(cfg)
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, ids)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


@pytest.mark.parametrize("shape", [
    dict(d_model=64, n_layers=2, n_heads=2, mlp_hidden=128, vocab_size=512, sliding_window=None),
    dict(d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, mlp_hidden=384, vocab_size=1024,
         sliding_window=16),  # GQA, OLMo 3 windows
    dict(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=48, mlp_hidden=200,
         vocab_size=768, sliding_window=None),  # q width != d_model
    dict(d_model=96, n_layers=2, n_heads=3, mlp_hidden=256, vocab_size=300, sliding_window=8,
         yarn_factor=8.0, yarn_original_max_length=64),  # a second RoPE table for YaRN
])
def test_activation_count_matches_what_autograd_saves(shape):
    cfg = ModelConfig(max_sequence_length=256, **shape)
    batch, seq = 2, 64
    measured = measured_saved_bytes(cfg, batch, seq)
    predicted = saved_activation_bytes(cfg, batch, seq, act_bytes=4)
    assert abs(predicted - measured) / measured < 0.01, (predicted, measured)


def test_official_7b_plan_closed_forms():
    cfg = load_config("olmo3_7b").model
    p = cfg.num_params()
    assert p == OLMO2_7B_PARAMS
    shape = {"world_size": 8, "micro_batch_size": 2, "sequence_length": 8192}
    ddp = memory_plan(cfg, data_parallel="ddp", **shape)
    fsdp = memory_plan(cfg, data_parallel="fsdp", **shape)
    assert ddp.params == fsdp.params == p
    # 16 bytes per parameter for mixed-precision AdamW with fp32 master weights, / N under FSDP.
    assert (ddp.weights, ddp.gradients, ddp.optimizer) == (4 * p, 4 * p, 8 * p)
    assert (fsdp.weights, fsdp.gradients, fsdp.optimizer) == (4 * p / 8, 4 * p / 8, 8 * p / 8)
    assert ddp.fsdp_buffers == 0
    d, v, layers = 4096, 100_352, 32
    root = 2 * v * d + d
    assert fsdp.fsdp_buffers == pytest.approx(2 * 4 * (root + 2 * (p - root) / layers))
    tokens = 2 * 8192
    assert ddp.logits == tokens * 8 * v
    # bf16: RMSNorm inputs (q + kv + 2d) and statistics in fp32, the rest of 6d+4q+4kv+4f in bf16.
    block = 2 * (6 * d + 4 * d + 4 * d + 4 * 11008 - 4 * d) + 4 * (4 * d + 32 + 4)
    assert block_bytes_per_token(cfg, 2) == block
    assert ddp.activations == tokens * (layers * block + 12 * d + 24)
    assert ddp.activations_checkpointed == tokens * (layers * 4 * d + block + 12 * d + 24)
    assert fsdp.total(True) < 80 * GB < ddp.total(True)


def test_checkpointing_every_n_blocks_and_max_micro_batch():
    cfg = ModelConfig(vocab_size=1024, d_model=128, n_layers=4, n_heads=4, mlp_hidden=384)
    block = block_bytes_per_token(cfg, 2)
    none, every, half = (activation_bytes_per_token(cfg, 2, n) for n in (0, 1, 2))
    assert none == 4 * block + 12 * 128 + 24
    assert every == 4 * 4 * 128 + block + 12 * 128 + 24
    assert half == 2 * block + 2 * 4 * 128 + block + 12 * 128 + 24  # blocks 0 and 2 recomputed
    assert every < half < none
    plan = memory_plan(cfg, world_size=2, data_parallel="fsdp", micro_batch_size=1,
                       sequence_length=512)
    gpu = 2.5 * GB
    m = plan.max_micro_batch(gpu, checkpointed=False)
    at = memory_plan(cfg, world_size=2, data_parallel="fsdp", micro_batch_size=m,
                     sequence_length=512)
    above = memory_plan(cfg, world_size=2, data_parallel="fsdp", micro_batch_size=m + 1,
                        sequence_length=512)
    assert at.total(False) <= gpu < above.total(False)


def test_bad_plan_input():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, mlp_hidden=64)
    with pytest.raises(OlmoflowError, match="did you mean 'fsdp'"):
        memory_plan(cfg, world_size=2, data_parallel="fsd", micro_batch_size=1, sequence_length=8)


def test_plan_cli(capsys):
    assert main(["plan", "olmo3_7b", "--gpus", "64", "--gpu-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "parameters 7,298,617,344" in out and "FSDP x64" in out and "DDP x64" in out
    fits = next(line for line in out.splitlines() if line.startswith("| fits 80 GB, checkpointing"))
    assert fits.split("|")[2:4] == [f"{'no':>15} ", f"{'yes':>15} "] or ["no", "yes"] == [
        c.strip() for c in fits.split("|")[2:4]]
    assert main(["plan", "olmo3_7b", "--gpus", "3"]) == 2  # 512 instances do not split over 3
    assert "not divisible by --gpus 3" in capsys.readouterr().err


def test_official_configs_match_presets_and_the_launch_guide():
    """configs/olmo3_{7b,32b}.yaml have the presets' shapes (stage-1 context, no YaRN), and
    docs/launch.md shows exactly what `olmoflow plan` prints for them."""
    from pathlib import Path

    from olmoflow.model.presets import get_preset
    from olmoflow.train.plan import plan_config

    guide = (Path(__file__).resolve().parents[2] / "docs" / "launch.md").read_text()
    for name, params, gpus in (("olmo3_7b", OLMO2_7B_PARAMS, 64),
                               ("olmo3_32b", 32_234_279_936, 128)):
        cfg = load_config(name)
        preset = get_preset(name, max_sequence_length=8192, yarn_factor=None)
        assert cfg.model == preset and cfg.model.num_params() == params
        assert cfg.train.parallel.data_parallel == "fsdp"
        assert plan_config(cfg, gpus) in guide, f"docs/launch.md is out of date for {name}"


def test_plan_uses_the_runs_own_vocabulary():
    """A preset whose model takes its vocabulary from the tokenizer is planned with the
    tokenizer's size (tiny: 512), not OLMo's 100,352."""
    from dataclasses import replace

    cfg = load_config("tiny")
    want = replace(cfg.model, vocab_size=cfg.model.padded_vocab_size(cfg.tokenizer.vocab_size))
    assert f"parameters {want.num_params():,};" in plan_config(cfg, 1)
