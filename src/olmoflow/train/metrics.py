"""The detailed training log: what the model, the optimizer and the machine did on a step.

:class:`TrainingMetrics` is called by the trainer around every ``train.log.detailed_interval``-th
optimizer step (``start_step`` before the first micro-batch, ``after_backward`` after the last
backward and before gradient clipping, ``end_step`` after the optimizer step) and returns one flat
dict whose keys name the quantity and where it was measured:

- ``grad_norm/<param>``: L2 norm of one parameter tensor's accumulated gradient, before clipping
  (the gradient of the whole global batch); ``grad_norm/layer.<i>``: over all of block ``i``'s
  tensors together (root-sum-square).
- ``param_norm/<param>``, ``param_norm/layer.<i>``: L2 norm of the weights before the step.
- ``update_ratio/<param>``, ``update_ratio/layer.<i>``: ``||w_after - w_before|| / ||w_before||``
  across the optimizer step (Karpathy's "update:data ratio"; around 1e-3 is usual for Adam).
- ``act_rms/embeddings``, ``act_rms/layer.<i>``: root mean square of the residual stream after the
  embedding and after block ``i``, on the probe micro-batch.
- ``attn_entropy/layer.<i>.head.<h>``: mean Shannon entropy (nats) of a query's attention.
- ``attn_entropy_norm/layer.<i>.head.<h>``: the same divided by ``ln(keys the query may see)``:
  0 = all mass on one key, 1 = uniform over the visible keys (queries that see >= 2 keys).
- ``attn_max_prob/layer.<i>.head.<h>``: mean over queries of the largest attention probability
  (activity: near 1 = a sharp head; near 1/keys = a diffuse one).
- ``attn_uniform_frac/layer.<i>``: fraction of the layer's heads whose mean normalised entropy is
  >= :data:`UNIFORM_ENTROPY` (near-uniform, idle heads); ``attn_uniform_frac``: over all heads.
- ``perf/step_s``, ``perf/tokens_per_s``: this step's time and tokens/s without the collector's
  own time; ``perf/mfu``: ``tokens_per_s * flops_per_token / peak_flops``;
  ``perf/flops_per_token``: :func:`train_flops_per_token`; ``perf/peak_flops``: a matmul measured
  once on this device (:func:`matmul_peak`); ``perf/collector_s``: the seconds this collector
  added to the step.
- ``sys/rss_gb``, ``sys/peak_rss_gb``: this process's resident memory now and at its peak
  (GB = 1e9 bytes); ``sys/cpu_percent``: its CPU use since the previous detailed step (100 = one
  core); ``sys/cpu_system_percent``: the machine's over the same time (100 = all cores);
  ``sys/cuda_allocated_gb``, ``sys/cuda_peak_gb``: CUDA memory held by tensors now and at peak;
  ``sys/gpu_util_percent``: GPU busy percentage (needs NVML, ``pynvml``).

The trainer's own keys (``loss``, ``ce_loss``, ``z_loss``, ``lr``, ``grad_norm``,
``tokens_per_s``, ``data_wait_s``, ...) are on every logged line, detailed or not.

The attention statistics and activation RMS come from a *probe*: a no-grad, eval-mode (no dropout)
forward over the first ``probe_rows`` rows and ``probe_tokens`` positions of the step's batch, with
the parameters as they are before the step. Attention probabilities are recomputed from each
attention module's inputs under the very mask the module used, so any backend (sdpa, flash, flex)
can be observed without materialising them on the training path. Nothing here draws from torch's
global RNG, so a run with the detailed log gives bit-identical losses to one without it.

Cost: off (``interval == 0``), the trainer never calls into this module. On a detailed step: one
copy of the parameters (for the update ratio), one probe forward, and a few norms per tensor; the
time is reported in ``perf/collector_s``.
"""

from __future__ import annotations

import math
import re
import resource
import sys
import time
from typing import Any

import psutil
import torch
from torch import nn

from olmoflow.model.attention import Attention, AttentionMask
from olmoflow.model.layers import apply_rotary
from olmoflow.model.olmo import Olmo

UNIFORM_ENTROPY = 0.9  # a head whose mean normalised entropy reaches this counts as near-uniform
_LAYER = re.compile(r"(?:^|\.)(?:blocks|layers)\.(\d+)\.")
GB = 1e9


def train_flops_per_token(cfg, sequence_length: int) -> float:
    """Training FLOPs per token of an :class:`~olmoflow.model.config.ModelConfig`.

    ``6 N + 12 * sum over layers of n_heads * head_dim * ctx`` (PaLM, Chowdhery et al. 2022,
    appendix B; nanoGPT's ``estimate_mfu``), where N leaves out the input embedding (a lookup) and
    ctx is ``sequence_length``, capped at the window on sliding-window layers.
    """
    n = cfg.num_params() - cfg.vocab_size * cfg.d_model
    attn = sum(12 * cfg.n_heads * cfg.hd * min(sequence_length, cfg.window(i) or sequence_length)
               for i in range(cfg.n_layers))
    return 6 * n + attn


def matmul_peak(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                n: int | None = None, repeats: int = 3) -> float:
    """FLOP/s of the best of ``repeats`` ``[n, n] @ [n, n]`` matmuls (after one warm-up).

    Default ``n``: 1024 on CPU (about 0.1 s with a few cores), 8192 on CUDA. Operands come from a
    private generator, so torch's global RNG is untouched.
    """
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 1024)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=device).to(dtype)
    b = torch.randn(n, n, generator=g, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = math.inf
    for i in range(repeats + 1):
        sync()
        t = time.perf_counter()
        torch.mm(a, b)
        sync()
        if i:  # the first call is the warm-up
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def _norms(tensors: list[torch.Tensor]) -> list[float]:
    """L2 norms (fp32) of ``tensors`` with one device sync; DTensors (FSDP2) are reduced to the
    norm of the full tensor."""
    out = []
    for t in tensors:
        v = torch.linalg.vector_norm(t, dtype=torch.float32)
        out.append(v.full_tensor() if hasattr(v, "full_tensor") else v)
    return torch.stack(out).tolist() if out else []


def _layer(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def _group(values: dict[str, float]) -> dict[int, float]:
    """Per-layer L2 combination of per-tensor norms: ``sqrt(sum of squares)``."""
    acc: dict[int, float] = {}
    for name, v in values.items():
        i = _layer(name)
        if i is not None:
            acc[i] = acc.get(i, 0.0) + v * v
    return {i: math.sqrt(s) for i, s in sorted(acc.items())}


class TrainingMetrics:
    """Collects the detailed log every ``interval`` optimizer steps (see the module docstring).

    Args:
        model: the model being trained (an :class:`~olmoflow.model.olmo.Olmo`, possibly wrapped by
            DDP; FSDP2-sharded parameters are fine). Probes need its ``blocks``/``embeddings``.
        interval: collect on steps that are multiples of this (1-based step numbers); > 0.
        peak_flops: the FLOP/s that MFU is measured against; None measures a matmul once, on the
            first detailed step, in ``peak_dtype`` (bf16 on CUDA is what a bf16 run should use).
        probe_rows, probe_tokens: size of the probe micro-batch (rows, positions).
    Raises:
        ValueError: ``interval < 1``.
    """

    def __init__(self, model: nn.Module, interval: int, *, peak_flops: float | None = None,
                 peak_dtype: torch.dtype | None = None, probe_rows: int = 2,
                 probe_tokens: int = 512):
        if interval < 1:
            raise ValueError(f"TrainingMetrics interval must be >= 1, got {interval}")
        self.model, self.interval = model, interval
        self.inner = getattr(model, "module", model)  # DDP keeps the model in .module
        self.peak_flops, self.peak_dtype = peak_flops, peak_dtype
        self.probe_rows, self.probe_tokens = probe_rows, probe_tokens
        self.params = [(n.removeprefix("module."), p) for n, p in model.named_parameters()
                       if p.requires_grad]
        self.attn_modules = [(i, m) for i, m in enumerate(
            mod for mod in self.inner.modules() if isinstance(mod, Attention))]
        self._process = psutil.Process()
        self._process.cpu_percent(None)  # starts the interval that the next call measures
        psutil.cpu_percent(None)
        self._active = False
        self._out: dict[str, float] = {}

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based: the step about to finish) is a detailed one."""
        return step % self.interval == 0

    # --- the three calls around a step ------------------------------------------------------------

    def start_step(self, step: int, input_ids: torch.Tensor,
                   doc_ids: torch.Tensor | None = None) -> None:
        """Before the step's first micro-batch: if ``step`` is due, snapshot the weights and run
        the probe on ``input_ids [B, T]`` (the step's global batch, any device), with ``doc_ids
        [B, T]`` when training masks attention within documents."""
        self._active = self.due(step)
        if not self._active:
            return
        t0 = time.perf_counter()
        self._out, self._inside = {}, 0.0
        self._seq_len = input_ids.shape[1]
        with torch.no_grad():
            self._before = [p.detach().clone() for _, p in self.params]
        self._record("param_norm", _norms(self._before))
        rows, cols = slice(0, self.probe_rows), slice(0, self.probe_tokens)
        self._probe(input_ids[rows, cols], None if doc_ids is None else doc_ids[rows, cols])
        self._t_start = time.perf_counter()
        self._overhead = self._t_start - t0

    def after_backward(self) -> None:
        """After the last backward, before clipping: per-tensor norms of the accumulated
        gradients."""
        if not self._active:
            return
        t0 = time.perf_counter()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in self.params]
        self._record("grad_norm", _norms(grads))
        self._inside += time.perf_counter() - t0

    def end_step(self, tokens: int) -> dict[str, float]:
        """After the optimizer step; ``tokens`` is the number this process trained on in the step.
        Returns the detailed metrics (``{}`` on steps that are not due)."""
        if not self._active:
            return {}
        t0 = time.perf_counter()
        step_s = t0 - self._t_start - self._inside
        with torch.no_grad():
            deltas = [p.detach() - b for (_, p), b in zip(self.params, self._before)]
            delta = _norms(deltas)
        del self._before, deltas
        before = {n: self._out[f"param_norm/{n}"] for n, _ in self.params}
        ratio = {n: d / max(before[n], 1e-12) for (n, _), d in zip(self.params, delta)}
        self._out.update({f"update_ratio/{n}": r for n, r in ratio.items()})
        delta_layer = _group(dict(zip((n for n, _ in self.params), delta)))
        for i, w in _group(before).items():
            self._out[f"update_ratio/layer.{i}"] = delta_layer[i] / max(w, 1e-12)
        self._perf(tokens, step_s)
        self._system()
        out, self._out, self._active = self._out, {}, False
        out["perf/collector_s"] = self._overhead + self._inside + time.perf_counter() - t0
        return out

    # --- pieces --------------------------------------------------------------------------------

    def _record(self, kind: str, norms: list[float]) -> None:
        values = {n: v for (n, _), v in zip(self.params, norms)}
        self._out.update({f"{kind}/{n}": v for n, v in values.items()})
        self._out.update({f"{kind}/layer.{i}": v for i, v in _group(values).items()})

    def _probe(self, ids: torch.Tensor, doc_ids: torch.Tensor | None) -> None:
        """No-grad, eval-mode forward on ``ids``: activation RMS and attention statistics."""
        inner = self.inner
        hooks = []
        if hasattr(inner, "embeddings"):
            hooks.append(inner.embeddings.register_forward_hook(
                lambda m, a, out: self._out.__setitem__("act_rms/embeddings", _rms(out))))
        for i, block in enumerate(getattr(inner, "blocks", [])):
            hooks.append(block.register_forward_hook(
                lambda m, a, out, i=i: self._out.__setitem__(f"act_rms/layer.{i}", _rms(out))))
        for i, attn in self.attn_modules:
            hooks.append(attn.register_forward_hook(
                lambda m, a, kw, out, i=i: self._attention(i, m, a, kw), with_kwargs=True))
        was_training = self.model.training
        try:
            self.model.eval()
            with torch.no_grad():
                device = next(self.model.parameters()).device
                kw = {} if doc_ids is None else {"doc_ids": doc_ids.to(device)}
                if isinstance(inner, Olmo):  # the probe needs no logits: skip most of the LM head
                    kw["last_logits_only"] = True
                self.model(ids.to(device), **kw)
        finally:
            self.model.train(was_training)
            for h in hooks:
                h.remove()
        uniform = [v for k, v in self._out.items() if k.startswith("attn_uniform_frac/")]
        if uniform:  # every layer has the same number of heads
            self._out["attn_uniform_frac"] = sum(uniform) / len(uniform)

    def _attention(self, i: int, m: Attention, args: tuple, kwargs: dict) -> None:
        """Recompute layer ``i``'s attention probabilities from its inputs ``(x, cos, sin)`` and
        mask, and record per-head entropy, normalised entropy, max probability, uniform fraction."""
        x, cos, sin = args[:3]
        mask: AttentionMask | None = kwargs.get("mask")
        if kwargs.get("cache") is not None:
            return  # the probe runs without a cache; a cached call is someone else's forward
        B, T, _ = x.shape
        q = m.q_norm(m.w_q(x)).view(B, T, m.n_heads, m.head_dim).transpose(1, 2)
        k = m.k_norm(m.w_k(x)).view(B, T, m.n_kv_heads, m.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        probs, allowed = attention_probs(q, k, mask if mask is not None
                                         else AttentionMask.causal(T, T, x.device, m.window))
        stats = head_stats(probs, allowed)
        for name, values in stats.items():
            if name == "uniform_frac":
                self._out[f"attn_uniform_frac/layer.{i}"] = values
                continue
            for h, v in enumerate(values):
                self._out[f"attn_{name}/layer.{i}.head.{h}"] = v

    def _perf(self, tokens: int, step_s: float) -> None:
        cfg = getattr(self.inner, "config", None)
        step_s = max(step_s, 1e-9)
        self._out["perf/step_s"] = step_s
        self._out["perf/tokens_per_s"] = tokens / step_s
        if cfg is None or not hasattr(cfg, "window"):
            return
        if self.peak_flops is None:
            device = next(self.model.parameters()).device
            dtype = self.peak_dtype or torch.float32
            self.peak_flops = matmul_peak(device, dtype)
        fpt = train_flops_per_token(cfg, self._seq_len)
        self._out["perf/flops_per_token"] = fpt
        self._out["perf/peak_flops"] = self.peak_flops
        self._out["perf/mfu"] = tokens / step_s * fpt / self.peak_flops

    def _system(self) -> None:
        out = self._out
        out["sys/rss_gb"] = self._process.memory_info().rss / GB
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # The kernel updates ru_maxrss lazily, so it can trail the RSS read a moment before; a
        # peak is never below the present value.
        out["sys/peak_rss_gb"] = max(peak * (1 if sys.platform == "darwin" else 1024) / GB,
                                     out["sys/rss_gb"])
        out["sys/cpu_percent"] = self._process.cpu_percent(None)
        out["sys/cpu_system_percent"] = psutil.cpu_percent(None)
        if torch.cuda.is_available():
            out["sys/cuda_allocated_gb"] = torch.cuda.memory_allocated() / GB
            out["sys/cuda_peak_gb"] = torch.cuda.max_memory_allocated() / GB
            try:
                out["sys/gpu_util_percent"] = float(torch.cuda.utilization())
            except Exception:  # no NVML (pynvml) on this machine: the key is left out
                pass


def _rms(out: Any) -> float:
    x = out[0] if isinstance(out, tuple) else out
    return float(x.float().square().mean().sqrt())


def attention_probs(q: torch.Tensor, k: torch.Tensor,
                    mask: AttentionMask) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q k^T / sqrt(head_dim))`` under ``mask``, in fp32.

    Args:
        q: ``[B, H, Tq, hd]``; k: ``[B, H_kv, Tk, hd]`` (grouped-query heads are repeated).
        mask: the attention rule of the call (:class:`AttentionMask`).
    Returns:
        ``(probs [B, H, Tq, Tk], allowed [B|1, 1, Tq, Tk] bool)``; rows of queries that see no key
        are all zeros.
    """
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    allowed = mask.dense()
    probs = torch.softmax(scores.masked_fill(~mask.safe_dense(), float("-inf")), dim=-1)
    return probs * allowed, allowed


def head_stats(probs: torch.Tensor, allowed: torch.Tensor) -> dict[str, Any]:
    """Per-head attention statistics of ``probs [B, H, Tq, Tk]`` (see the module docstring).

    Returns ``{"entropy": [H], "entropy_norm": [H], "max_prob": [H]}`` as lists of floats (means
    over the batch and the queries that see a key; ``entropy_norm`` over queries that see >= 2),
    and ``"uniform_frac"``: the fraction of heads with mean ``entropy_norm >= UNIFORM_ENTROPY``.
    """
    visible = allowed.sum(-1).expand(probs.shape[0], probs.shape[1], -1).float()  # [B, H, Tq]
    ent = -torch.special.xlogy(probs, probs).sum(-1)
    has = (visible >= 1).float()
    many = (visible >= 2).float()
    norm = ent / visible.clamp_min(2).log()

    def mean(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (v * w).sum((0, 2)) / w.sum((0, 2)).clamp_min(1)

    entropy_norm = mean(norm, many)
    return {"entropy": mean(ent, has).tolist(), "entropy_norm": entropy_norm.tolist(),
            "max_prob": mean(probs.amax(-1), has).tolist(),
            "uniform_frac": float((entropy_norm >= UNIFORM_ENTROPY).float().mean())}
