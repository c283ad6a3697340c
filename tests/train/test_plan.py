"""The memory plan (``olmoflow plan``) against closed forms, the official parameter counts and a
measurement of what autograd really saves in this model."""

from __future__ import annotations

import math

import pytest
import torch

from olmoflow.cli import main
from olmoflow.errors import OlmoflowError
from olmoflow.model import layers
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo
from olmoflow.pipeline.config import load_config
from olmoflow.train.plan import (
    GB,
    activation_bytes_per_token,
    block_bytes_per_token,
    memory_plan,
    saved_activation_bytes,
)
from olmoflow.train.plan_report import plan_config

OLMO2_7B_PARAMS = 7_298_617_344  # allenai/OLMo-2-1124-7B (tests/model/test_presets.py)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor behind a DTensor or a functional collective's wrapper."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return getattr(t, "elem", t)


def measured_saved_bytes(cfg: ModelConfig, batch: int, seq: int, model=None) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward with labels
    (this rank's, for a tensor-parallel ``model``), through the ops a GPU runs (the CPU-only
    fused RMSNorm off: the plan is for GPUs)."""
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    model = model if model is not None else Olmo(cfg)
    storages: dict[object, int] = {}

    def pack(t):
        x = _local(t)
        try:
            s = x.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        except RuntimeError:  # a tensor without storage of its own: count its elements
            storages[("tensor", id(x))] = x.numel() * x.element_size()
        return t

    fused, layers.CPU_FUSED_RMS_NORM = layers.CPU_FUSED_RMS_NORM, False
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(ids, ids)
    finally:
        layers.CPU_FUSED_RMS_NORM = fused
    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    saved = sum(n for ptr, n in storages.items() if ptr not in params)
    # The fused LM head and loss compute their gradients in the forward and hold them on the
    # autograd node until backward, out of the saved-tensor hooks' sight: counted here.
    held = getattr(out.loss.grad_fn, "grads", None) or ()
    return saved + sum(t.untyped_storage().nbytes() for t in held if t is not None)


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
    # the fused, chunked head: the bf16 gradient of its input, the fp32 gradient of its weight and
    # two fp32 chunks of 128 rows (2**21 logits / V, at least 128) x V
    assert ddp.logits == tokens * 2 * d
    assert ddp.loss_buffers == 4 * v * d + 8 * 128 * v
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


# --- 3D layouts (olmoflow.train.plan_layout) ------------------------------------------------------

def _layout_plan(cfg, layout, **kw):
    from olmoflow.train.plan_layout import layout_plan

    args = dict(global_batch_size=64, micro_batch_size=2, sequence_length=4096)
    return layout_plan(cfg, layout, **{**args, **kw})


def test_one_dimensional_layouts_are_the_ddp_and_fsdp_plans():
    """tp = pp = 1 reproduces memory_plan term for term: the 3D plan only splits its counts."""
    from olmoflow.train.plan_layout import Layout

    cfg = load_config("olmo3_7b").model
    for method in ("ddp", "fsdp"):
        flat = memory_plan(cfg, world_size=8, data_parallel=method, micro_batch_size=2,
                           sequence_length=4096)
        plan = _layout_plan(cfg, Layout(dp=8, data_parallel=method))
        assert plan.memory.total == pytest.approx(flat.total(False), rel=1e-12)
        assert plan.memory_checkpointed.total == pytest.approx(flat.total(True), rel=1e-12)
        assert plan.memory.fsdp_buffers == pytest.approx(flat.fsdp_buffers, rel=1e-12)
        assert plan.bubble == 0 and plan.comm_tp == plan.comm_pp == 0


def test_bubble_fraction_values():
    from olmoflow.train.plan_layout import bubble_fraction

    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)  # (pp - 1) / (m + pp - 1)
    assert bubble_fraction(4, 8, "gpipe") == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, "interleaved_1f1b", 2) == pytest.approx(3 / 19)  # v m
    assert bubble_fraction(2, 1) == pytest.approx(1 / 2)
    with pytest.raises(OlmoflowError, match="did you mean 'gpipe'"):
        bubble_fraction(2, 4, "gpip")


def test_tensor_parallel_shards_sum_to_the_model():
    from olmoflow.train.plan_layout import tp_param_counts

    cfg = load_config("olmo3_32b").model
    block, emb, head, norm = tp_param_counts(cfg, 1)
    assert cfg.n_layers * block + emb + head + norm == cfg.num_params()
    block8, emb8, head8, _ = tp_param_counts(cfg, 8)
    replicated = 2 * cfg.d_model  # the two block RMSNorms
    assert 8 * (block8 - replicated) + replicated == pytest.approx(block)
    assert (8 * emb8, 8 * head8) == (emb, head)


def test_memory_falls_as_tp_or_pp_grows():
    from olmoflow.train.plan_layout import Layout

    cfg = load_config("olmo3_7b").model
    for method in ("ddp", "fsdp"):
        by_tp = [_layout_plan(cfg, Layout(dp=4, tp=t, data_parallel=method)).memory.total
                 for t in (1, 2, 4, 8)]
        by_pp = [_layout_plan(cfg, Layout(dp=4, pp=p, data_parallel=method)).memory.total
                 for p in (1, 2, 4, 8)]
        assert by_tp == sorted(by_tp, reverse=True) and len(set(by_tp)) == 4, (method, by_tp)
        assert by_pp == sorted(by_pp, reverse=True) and len(set(by_pp)) == 4, (method, by_pp)
    # With sequence parallelism the activations divide by tp, but for the all-gathered inputs
    # of attention, MLP (2 d per block) and LM head (4 d) that the projections save.
    from olmoflow.train.plan import block_bytes_per_token

    acts = [_layout_plan(cfg, Layout(dp=4, tp=t)).memory.activations for t in (1, 8)]
    d, tokens = cfg.d_model, 2 * 4096
    block = block_bytes_per_token(cfg, 2)
    assert acts[1] == pytest.approx(tokens * (
        32 * ((block - 2 * d * 2) / 8 + 2 * d * 2) + 8 * d / 8 + 4 * d + 24), rel=1e-12)
    assert acts[0] / 6 < acts[1] < acts[0] / 4


def test_pipeline_schedules_hold_micro_batches_as_documented():
    """1F1B keeps pp micro-batches on the first stage (L layers' worth: as much as no pipeline),
    interleaved a little more, GPipe all m; the bubble shrinks with v."""
    from olmoflow.train.plan_layout import Layout

    cfg = load_config("olmo3_7b").model
    flat = _layout_plan(cfg, Layout(dp=2, data_parallel="ddp")).memory.activations
    plans = {s: _layout_plan(cfg, Layout(dp=2, pp=4, data_parallel="ddp", schedule=s,
                                         stages_per_rank=2))
             for s in ("1f1b", "interleaved_1f1b", "gpipe")}
    acts = {s: p.memory_checkpointed.activations for s, p in plans.items()}
    d, tokens = cfg.d_model, 2 * 4096
    # the first stage's activations: pp micro-batches of its L / pp blocks, plus pp embedding
    # outputs in flight where the flat model has one, minus the last stage's LM head inputs
    assert plans["1f1b"].memory.activations == pytest.approx(
        flat + tokens * (3 * 4 * d - 8 * d - 24), rel=1e-9)
    assert acts["1f1b"] < acts["interleaved_1f1b"] < acts["gpipe"]
    m = plans["gpipe"].micro_batches
    assert m == 16 and plans["gpipe"].bubble == pytest.approx(3 / 19)
    assert plans["interleaved_1f1b"].bubble == pytest.approx(3 / 35)


def test_communication_closed_forms():
    from olmoflow.train.plan_layout import Layout, tp_param_counts

    cfg = ModelConfig(vocab_size=1024, d_model=256, n_layers=8, n_heads=8, mlp_hidden=512,
                      sliding_window=None)
    kw = dict(global_batch_size=16, micro_batch_size=2, sequence_length=128, gpu_memory_gb=80)
    act = 2 * 128 * 256 * 2  # b s d a (bf16)
    plan = _layout_plan(cfg, Layout(dp=2, tp=4, pp=2, data_parallel="fsdp"), **kw)
    m = plan.micro_batches
    assert m == 4 and not plan.checkpointing
    assert plan.comm_tp == pytest.approx(m * 3 / 4 * act * 8 * 4)  # 8 per layer, 4 layers/stage
    assert plan.comm_pp == pytest.approx(m * 2 * 1 / 2 * act / 4)
    block, emb, head, norm = tp_param_counts(cfg, 4)
    params = max(4 * block + emb, 4 * block + head + norm)  # the heavier stage
    # pipelined FSDP2 over 2 shards: bf16 gathers per backward and warm-up forward, one fp32
    # reduce-scatter per step
    assert plan.comm_dp == pytest.approx((m + 2) / 2 * 2 * params + 1 / 2 * 4 * params)
    ddp = _layout_plan(cfg, Layout(dp=8, data_parallel="ddp"), **kw)
    p = cfg.num_params()
    assert ddp.comm_dp == pytest.approx(2 * 7 / 8 * 4 * p)  # one fp32 ring all-reduce per step
    fsdp = _layout_plan(cfg, Layout(dp=8, data_parallel="fsdp"), **kw)
    assert fsdp.comm_dp == pytest.approx(fsdp.micro_batches * 7 / 8 * 12 * p)  # fp32 AG, AG, RS
    hsdp = _layout_plan(cfg, Layout(dp=8, data_parallel="hsdp", shard_size=4), **kw)
    assert hsdp.comm_dp == pytest.approx(
        hsdp.micro_batches * (3 / 4 * (2 * 2 + 4) * p + 2 * 1 / 2 * 4 * p / 4))


def test_32b_on_128_gpus_recommends_tensor_and_pipeline_parallelism(capsys):
    from olmoflow.train.plan_layout import candidate_plans

    run = load_config("olmo3_32b")
    t = run.train
    plans = candidate_plans(run.model, 128, global_batch_size=t.global_batch_size,
                            micro_batch_size=t.micro_batch_size,
                            sequence_length=t.sequence_length, gpu_memory_gb=80)
    best = plans[0]
    assert best.fits and 1 < best.layout.tp <= 8 and best.layout.pp > 1, best.layout
    assert best.used.total <= 80 * GB
    flat = [p for p in plans if p.layout.tp == p.layout.pp == 1]
    assert flat and all(p.step_seconds > best.step_seconds for p in flat)
    assert main(["plan", "olmo3_32b", "--gpus", "128"]) == 0
    out = capsys.readouterr().out
    rec = next(line for line in out.splitlines() if line.startswith("recommended: "))
    assert best.layout.name in rec and "GB" in rec
    row = next(line for line in out.splitlines() if line.startswith(f"| {best.layout.name} "))
    assert f"{best.used.total / GB:,.2f}" in row and "yes" in row
    # docs/launch.md's torchrun line for 32B launches that layout
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[2] / "docs" / "launch.md").read_text()
    launch = guide[guide.index("-m olmoflow pretrain olmo3_32b train.parallel"):]
    launch = launch[:launch.index("```")]
    lay = best.layout
    for key, value in (("data_parallel", lay.data_parallel), ("tensor_parallel", lay.tp),
                       ("pipeline_parallel", lay.pp)):
        assert f"train.parallel.{key}={value} " in launch, (key, value, launch)
    assert f"train.activation_checkpointing={int(best.checkpointing)} " in launch


def test_a_pipeline_only_when_it_pays():
    """7B on 64 GPUs fits without a pipeline: the plan takes none."""
    from olmoflow.train.plan_layout import candidate_plans

    run = load_config("olmo3_7b")
    t = run.train
    kw = dict(global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
              sequence_length=t.sequence_length, gpu_memory_gb=80)
    assert candidate_plans(run.model, 64, **kw)[0].layout.pp == 1
    fixed = candidate_plans(run.model, 64, tp=8, pp=2, data_parallel="hsdp", shard_size=2, **kw)
    assert [p.layout.name for p in fixed] == ["hsdp4 (shard 2) tp8 pp2"]
    tight = candidate_plans(run.model, 8, **{**kw, "gpu_memory_gb": 1})
    assert not tight[0].fits
    # A shard size alone fixes HSDP with that shard group.
    sharded = candidate_plans(run.model, 64, shard_size=4, **kw)
    assert {(p.layout.data_parallel, p.layout.shard_size) for p in sharded} <= {("hsdp", 4)}
    assert any(p.layout.tp == 1 for p in sharded)


def test_a_tensor_parallel_group_wider_than_a_node_is_named(capsys):
    assert main(["plan", "olmo3_7b", "--gpus", "64", "--tp", "16"]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("recommended")][0]
    assert "tensor parallelism across nodes (tp 16 > 8 GPUs per node" in line
    assert "inside a node" not in line


def test_bad_layout_flags_are_one_line_errors(capsys):
    assert main(["plan", "olmo3_7b", "--gpus", "64", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--tp 3 does not divide model.n_heads=32; closest valid: 2" in err
    assert main(["plan", "olmo3_32b", "--gpus", "128", "--tp", "5"]) == 2  # 40 heads, 8 KV heads
    assert "--tp 5 does not divide model.n_kv_heads=8; closest valid: 4" in capsys.readouterr().err
    assert main(["plan", "olmo3_7b", "--gpus", "64", "--pp", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--pp 3 does not divide model.n_layers=32" in err
    assert main(["plan", "olmo3_7b", "--gpus", "64", "--data-parallel", "fsd"]) == 2
    assert capsys.readouterr().err == ("olmoflow: error: unknown --data-parallel 'fsd'; did you "
                                       "mean 'fsdp'?\n")
    assert main(["plan", "olmo3_7b", "--gpus", "64", "--data-parallel", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "takes a method (ddp, fsdp, hsdp), not a degree ('8')" in err
    assert main(["plan", "olmo3_7b", "--gpus", "64", "--shard-size", "8",
                 "--data-parallel", "fsdp"]) == 2
    assert capsys.readouterr().err == ("olmoflow: error: --shard-size 8 is for --data-parallel "
                                       "hsdp, not fsdp\n")


TP_SHAPE = dict(vocab_size=1024, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, mlp_hidden=768,
                max_sequence_length=512, sliding_window=None)


def test_tensor_parallel_activations_match_what_autograd_saves():
    """Under tp=2 with sequence parallelism (the trainer's apply_tensor_parallel, rank 0 of a
    fake two-rank process group: the shapes and what autograd saves are those of a real run, the
    collectives move no data) a rank saves what tp_block_bytes_per_token and
    outside_bytes_per_token say: about half, plus the all-gathered attention, MLP and LM head
    inputs. (Measured the same under two gloo processes.)"""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from olmoflow.train.parallel.tensor import apply_tensor_parallel

    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    cfg = ModelConfig(**TP_SHAPE)
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=2)
    try:
        torch.manual_seed(0)
        model = apply_tensor_parallel(Olmo(cfg), init_device_mesh("cpu", (2,)))
        measured = measured_saved_bytes(cfg, 2, 256, model)
    finally:
        dist.destroy_process_group()
    predicted = saved_activation_bytes(cfg, 2, 256, act_bytes=4, tp=2)
    one = saved_activation_bytes(cfg, 2, 256, act_bytes=4)
    assert abs(predicted - measured) / measured < 0.01, (predicted, measured, one)
    assert 0.5 * one < measured < 0.6 * one

def test_plan_rejects_an_infinite_gpu(capsys):
    with pytest.raises(OlmoflowError, match="--gpu-memory-gb must be a number of GB > 0, got inf"):
        plan_config(load_config("olmo3_7b"), 64, math.inf)
    # was: OverflowError
    assert main(["plan", "olmo3_7b", "--gpus", "64", "--gpu-memory-gb", "inf"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
