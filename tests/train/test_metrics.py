"""The detailed training log: it is wide (>= 200 numbers for a 4-layer model), it agrees with
quantities computed independently (global grad norm, SGD's update size, the attention the model
really used, known distributions), and turning it on does not change training by one bit."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from resume_helpers import parse_train_config
from tolerance import EPS32, assert_fp32_close, forward_terms, fp32_rel

from olmoflow.errors import OlmoflowError
from olmoflow.model.attention import AttentionMask
from olmoflow.model.config import ModelConfig
from olmoflow.model.layers import apply_rotary
from olmoflow.model.olmo import Olmo
from olmoflow.train.config import LogConfig
from olmoflow.train.loader import DataLoader, InstanceDataset
from olmoflow.train.metrics import (
    TrainingMetrics,
    attention_probs,
    head_stats,
    train_flops_per_token,
)
from olmoflow.train.trainer import METRICS, Trainer

VOCAB, SEQ, LAYERS, HEADS = 64, 16, 4, 4
BASIC = ("loss", "ce_loss", "z_loss", "lr", "grad_norm", "tokens_per_s", "data_wait_s")



def model_config(**kw) -> ModelConfig:
    base = dict(vocab_size=VOCAB, d_model=32, n_layers=LAYERS, n_heads=HEADS, mlp_hidden=64,
                max_sequence_length=64, sliding_window=8)
    return ModelConfig(**{**base, **kw})


def run_trainer(folder, detailed: int, steps: int = 4, dropout: float = 0.0, **cfg_kw) -> Trainer:
    rng = np.random.default_rng(0)
    data = InstanceDataset([rng.integers(0, VOCAB, 40 * SEQ).astype(np.uint16)], SEQ)
    cfg = parse_train_config(**{**dict(
        sequence_length=SEQ, global_batch_size=4, micro_batch_size=2, max_steps=steps,
        optimizer__lr=1e-2, schedule__warmup_steps=1, checkpoint__save_interval=0,
        log__interval=1, num_threads=1, log__detailed_interval=detailed), **cfg_kw})
    torch.manual_seed(0)
    model = Olmo(model_config(dropout=dropout, n_kv_heads=2))
    trainer = Trainer(model, cfg, DataLoader(data, cfg.global_batch_size, seed=3), folder,
                      progress=False)
    trainer.fit()
    return trainer


def read(folder) -> list[dict]:
    return [json.loads(ln) for ln in (folder / METRICS).read_text().splitlines()]


def test_detailed_log_is_wide_complete_and_finite(tmp_path):
    run_trainer(tmp_path, detailed=2)
    lines = read(tmp_path)
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    for r in lines:  # every step: the basics
        assert all(math.isfinite(r[k]) for k in BASIC), r
    plain, detailed = lines[0], lines[1]
    assert "perf/mfu" not in plain and "perf/mfu" in lines[3]
    numeric = {k for k, v in detailed.items() if isinstance(v, int | float)}
    assert len(numeric) >= 200, len(numeric)
    assert all(math.isfinite(detailed[k]) for k in numeric)
    for i in range(LAYERS):
        for kind in ("grad_norm", "param_norm", "update_ratio", "act_rms", "attn_uniform_frac"):
            assert f"{kind}/layer.{i}" in detailed
        for h in range(HEADS):
            for kind in ("attn_entropy", "attn_entropy_norm", "attn_max_prob"):
                assert f"{kind}/layer.{i}.head.{h}" in detailed
    for k in ("perf/tokens_per_s", "perf/mfu", "perf/peak_flops", "perf/collector_s",
              "sys/rss_gb", "sys/peak_rss_gb", "sys/cpu_percent", "data_wait_s"):
        assert k in detailed, k
    assert 0 < detailed["perf/mfu"] < 1
    assert detailed["perf/mfu"] == pytest.approx(
        detailed["perf/tokens_per_s"] * detailed["perf/flops_per_token"]
        / detailed["perf/peak_flops"])
    assert detailed["sys/peak_rss_gb"] >= detailed["sys/rss_gb"] > 0.01


def test_detailed_log_does_not_change_training(tmp_path):
    """The probe runs without dropout and without drawing from torch's RNG: with dropout on,
    losses and final weights are bit-identical with the detailed log every step and without it."""
    on = run_trainer(tmp_path / "on", detailed=1, dropout=0.1)
    off = run_trainer(tmp_path / "off", detailed=0, dropout=0.1)
    assert [r["loss"] for r in read(tmp_path / "on")] == [r["loss"] for r in read(tmp_path / "off")]
    for (name, a), (_, b) in zip(on.model.named_parameters(), off.model.named_parameters()):
        assert torch.equal(a, b), name
    assert off.metrics is None  # off means the trainer holds no collector at all


def test_per_tensor_grad_norms_add_up_to_the_global_norm(tmp_path):
    """The per-tensor norms are taken before clipping: their root-sum-square is the global norm
    that clip_grad_norm_ reports, and each layer's norm is the root-sum-square of its tensors."""
    t = run_trainer(tmp_path, detailed=1, steps=2, max_grad_norm=1e-3)  # clipping on every step
    for r in read(tmp_path):
        tensors = {k: v for k, v in r.items() if k.startswith("grad_norm/") and "layer." not in k}
        assert len(tensors) == 11 * LAYERS + 3
        total = math.sqrt(sum(v * v for v in tensors.values()))
        # clip_grad_norm_'s kernel against one vector_norm per tensor: sums of squares (no
        # cancellation) over the largest tensor's entries, then over the tensors, in fp32.
        terms = max(p.numel() for p in t.model.parameters()) + len(tensors)
        assert total == pytest.approx(r["grad_norm"], rel=fp32_rel(terms), abs=0)
        for i in range(LAYERS):
            mine = [v for k, v in tensors.items() if k.startswith(f"grad_norm/blocks.{i}.")]
            layer = math.sqrt(sum(v * v for v in mine))
            # The same per-tensor numbers combined in float64 both times.
            assert layer == pytest.approx(r[f"grad_norm/layer.{i}"], rel=1e-12)


def test_update_ratio_is_lr_times_grad_over_weight_for_sgd():
    """With plain SGD, ``w' = w - lr g``, so ``||dw|| / ||w|| = lr ||g|| / ||w||`` exactly."""
    torch.manual_seed(0)
    model = Olmo(model_config())
    lr = 0.05
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    tm = TrainingMetrics(model, interval=3, peak_flops=1e12)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    assert not tm.due(2) and tm.due(3)
    tm.start_step(2, ids)
    assert tm.end_step(ids.numel()) == {}  # not a detailed step: nothing measured
    tm.start_step(3, ids)
    model(ids, ids).loss.backward()
    tm.after_backward()
    opt.step()
    out = tm.end_step(ids.numel())
    for name, _ in model.named_parameters():
        expected = lr * out[f"grad_norm/{name}"] / out[f"param_norm/{name}"]
        # rel: ||w' - w|| and ||g|| are fp32 sums of squares over the tensor's entries (one ulp
        # per term); abs: the rounding of w - lr g, half an ulp of each entry of w, so at most one
        # ulp of ||w|| (norm weights are 1 and their g small, so this term dominates there).
        rel = fp32_rel(dict(model.named_parameters())[name].numel())
        assert out[f"update_ratio/{name}"] == pytest.approx(expected, rel=rel, abs=EPS32), name
    assert out["perf/peak_flops"] == 1e12


@pytest.mark.parametrize("packed", [False, True])
def test_recomputed_attention_is_the_attention_the_model_used(packed):
    """The probe's probabilities, times the values and the output projection, give back the
    attention module's output (GQA, sliding window, and intra-document masks)."""
    torch.manual_seed(0)
    model = Olmo(model_config(n_kv_heads=2, sliding_window=4)).eval()
    ids = torch.randint(0, VOCAB, (2, SEQ))
    doc_ids = (torch.arange(SEQ) >= 5).long().expand(2, SEQ) if packed else None
    checked = []

    def hook(m, args, kwargs, out):
        x, cos, sin = args[:3]
        B, T, _ = x.shape
        q = m.q_norm(m.w_q(x)).view(B, T, m.n_heads, m.head_dim).transpose(1, 2)
        k = m.k_norm(m.w_k(x)).view(B, T, m.n_kv_heads, m.head_dim).transpose(1, 2)
        v = m.w_v(x).view(B, T, m.n_kv_heads, m.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        mask = kwargs["mask"] or AttentionMask.causal(T, T, x.device, m.window)
        probs, allowed = attention_probs(q, k, mask)
        # A softmax row sums T terms of at most 1 (tolerance.py: one ulp per term).
        assert torch.allclose(probs.sum(-1), torch.ones(()), atol=fp32_rel(T), rtol=0)
        y = probs @ v.repeat_interleave(m.n_heads // m.n_kv_heads, dim=1)
        # sdpa's fused kernel against softmax then matmuls: the scores over head_dim, the softmax
        # and the weighted sum over T keys, the output projection over d_model; two ulps per
        # term for the exp each rounds its own way.
        assert_fp32_close(m.w_out(y.transpose(1, 2).reshape(B, T, -1)), out,
                          m.head_dim + 2 * T + x.shape[-1], 2)
        if packed:  # no query attends across the document boundary
            assert probs[..., 5:, :5].abs().max() == 0
        checked.append(m)

    hooks = [b.attention.register_forward_hook(hook, with_kwargs=True) for b in model.blocks]
    with torch.no_grad():
        model(ids, doc_ids=doc_ids)
    for h in hooks:
        h.remove()
    assert len(checked) == LAYERS


def test_head_stats_on_known_distributions():
    T = 6
    allowed = torch.ones(T, T).tril().bool()[None, None]  # causal: query t sees t + 1 keys
    uniform = allowed.float() / allowed.sum(-1, keepdim=True)
    sharp = torch.eye(T)[None, None]  # each query attends to itself only
    probs = torch.cat([uniform, sharp], dim=1)  # head 0 uniform, head 1 one-hot
    s = head_stats(probs, allowed)
    visible = torch.arange(1, T + 1).double()
    assert s["entropy"][0] == pytest.approx(float(visible.log().mean()), rel=1e-5)
    assert s["entropy"][1] == pytest.approx(0.0, abs=1e-7)
    assert s["entropy_norm"] == pytest.approx([1.0, 0.0], abs=1e-5)
    assert s["max_prob"][0] == pytest.approx(float((1 / visible).mean()), rel=1e-5)
    assert s["max_prob"][1] == pytest.approx(1.0)
    assert s["uniform_frac"] == 0.5


def test_flops_per_token_counts_matmul_weights_and_attention():
    cfg = model_config(sliding_window=8)
    d, L, V, ff = cfg.d_model, cfg.n_layers, cfg.vocab_size, cfg.mlp_hidden
    matmul_params = L * (4 * d * d + 3 * d * ff) + V * d  # projections, MLP, LM head
    norms = L * (2 * d + 2 * d) + d  # q/k-norm, two block norms, final norm
    ctx = [8 if cfg.window(i) else SEQ for i in range(L)]  # windowed layers see 8 keys at most
    expected = 6 * (matmul_params + norms) + sum(12 * cfg.n_heads * cfg.hd * c for c in ctx)
    assert train_flops_per_token(cfg, SEQ) == expected


def test_detailed_log_interval_is_validated():
    with pytest.raises(OlmoflowError, match="train.log.detailed_interval"):
        LogConfig(detailed_interval=-1)
    with pytest.raises(ValueError):
        TrainingMetrics(Olmo(model_config()), interval=0)


DETAIL = ("grad_norm/", "param_norm/", "update_ratio/", "act_rms/", "attn_entropy/",
          "attn_max_prob/")


def _tests_on_path() -> str:
    """PYTHONPATH for this file run as a script: tolerance.py lives in tests/, which pytest, not
    the script, puts on sys.path."""
    return os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                            *filter(None, [os.environ.get("PYTHONPATH")])])


@pytest.mark.slow
def test_two_processes_log_what_one_logs(tmp_path):
    """Under torchrun with 2 gloo processes, DDP and FSDP2 (sharded DTensor parameters) log the
    single-process per-tensor norms, update ratios and probe statistics (rank 0 writes)."""
    run_trainer(tmp_path / "single", detailed=1, steps=2)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", __file__, str(tmp_path)],
                          capture_output=True, text=True, timeout=180,
                          env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": _tests_on_path()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = read(tmp_path / "single")
    rel = fp32_rel(forward_terms(model_config(), SEQ, tokens=4 * SEQ), 2)
    for mode in ("ddp", "fsdp"):
        lines = read(tmp_path / mode)
        assert len(lines) == len(single) == 2
        for ref, got in zip(single, lines):
            keys = [k for k in ref if k.startswith(DETAIL)]
            assert len(keys) > 150
            for k in keys:
                # Another order of the same sums (tolerance.py): two ulps per term of a forward
                # and backward over the batch; abs: one ulp at 1 for values that are 0 in both.
                assert got[k] == pytest.approx(ref[k], rel=rel, abs=EPS32), (mode, ref["step"], k)


if __name__ == "__main__":  # the 2-process half of test_two_processes_log_what_one_logs
    from pathlib import Path

    from olmoflow.train import distributed

    torch.set_num_threads(1)
    distributed.init_from_env()
    for mode in ("ddp", "fsdp"):
        run_trainer(Path(sys.argv[1]) / mode, detailed=1, steps=2, parallel__data_parallel=mode)
