"""The OLMo building blocks: RMSNorm, rotary embeddings (with YaRN) and the SwiGLU MLP, and the
inference-only derived weights (:func:`fused_weight`, :func:`derived_weights`) the KV-cache
decode path multiplies by.

References: Zhang & Sennrich 2019 (RMSNorm); Su et al. 2021 (RoPE, rotate-half form as in GPT-NeoX
and OLMo); Peng et al. 2023 (YaRN); Shazeer 2020 (SwiGLU); OLMo 2 (Team OLMo 2024) for the order of
operations in RMSNorm.
"""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

# model -> (_Stamp, derived value). Kept beside the model, not on it: never in a state_dict, a
# checkpoint or an HF export, not copied by deepcopy or pickled.
_DERIVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Stamp:
    """What a model's derived weights were built from: every submodule's children and
    parameters, each parameter with its version counter and storage address. :meth:`valid` is
    four list comprehensions of lookups and compares (tens of microseconds for a small model,
    against milliseconds a decode step)."""

    def __init__(self, model: nn.Module):
        modules = list(model.modules())
        self.slots = [(m._modules, n) for m in modules for n in m._modules]
        self.children = [d[n] for d, n in self.slots]
        self.param_slots = [(m._parameters, n) for m in modules for n, p in m._parameters.items()
                            if p is not None]
        self.params = [d[n] for d, n in self.param_slots]
        self.versions = [p._version for p in self.params]
        self.ptrs = [p.data_ptr() for p in self.params]

    def valid(self) -> bool:
        # identity, not ==: a list compare would call Tensor.__eq__ on a replaced parameter
        return (all(map(operator.is_, [d.get(n) for d, n in self.slots], self.children))
                and all(map(operator.is_, [d.get(n) for d, n in self.param_slots], self.params))
                and [p._version for p in self.params] == self.versions
                and [p.data_ptr() for p in self.params] == self.ptrs)


T = TypeVar("T")


def derived_weights(model: nn.Module, build: Callable[[], T]) -> T:
    """``build()`` (tensors derived from ``model``'s parameters, for inference) computed once
    and cached beside ``model``, rebuilt when the model changes: a submodule replaced (LoRA
    injection, quantization), a parameter replaced or moved (``.to()``, ``param.data = ...``) or
    written in place through the parameter (its ``_version``: optimizer steps and
    ``load_state_dict`` bump it). Writes through ``param.data`` are not seen (PyTorch does not
    count them): call :func:`clear_inference_weights` after such writes. Built outside autograd
    (plain, non-inference tensors), so the value serves ``no_grad`` and ``inference_mode``
    callers alike.
    """
    hit = _DERIVED.get(model)
    if hit is not None and hit[0].valid():
        return hit[1]
    with torch.inference_mode(False), torch.no_grad():
        value = build()
    _DERIVED[model] = (_Stamp(model), value)
    return value


def clear_inference_weights(model: nn.Module) -> None:
    """Drop the derived inference weights of ``model`` (their memory is freed; the next
    inference forward builds them again). ``Olmo.train()`` calls it."""
    _DERIVED.pop(model, None)


def fused_weight(linears: Sequence[nn.Module]) -> torch.Tensor | None:
    """The weights of bias-free ``linears`` (``[out_i, in]`` each) as one ``[in, sum out_i]``
    contiguous matrix, for ``x @ W``: one matmul instead of one per linear (fused QKV, gate/up),
    in the layout MKL multiplies fastest at decode batch sizes (about 1.5x on the LM head at
    batch 1-8 against ``F.linear``'s transposed read). A copy: the caller keeps it (see
    :func:`derived_weights`). Returns None when a linear is not a plain ``nn.Linear`` with a
    plain dense weight (LoRA wrappers, bitsandbytes or torchao quantized weights, the meta
    device): the caller then calls the modules themselves.
    """
    weights = []
    for lin in linears:
        if type(lin) is not nn.Linear or lin.bias is not None:
            return None
        w = lin.weight
        if type(w) is not nn.Parameter or w.layout is not torch.strided or w.is_meta:
            return None
        weights.append(w.detach())
    return (weights[0] if len(weights) == 1 else torch.cat(weights)).t().contiguous()


def _cpu_rms_parts(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xhat, rstd)`` of fp32 ``x [..., n]``: ``rstd = rsqrt(|x|^2 / n + eps)`` ``[..., 1]``
    with the norm from one ``vector_norm`` kernel (as :func:`inference_rms_norm`), ``xhat = x *
    rstd``."""
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    rstd = torch.addcmul(_eps_tensor(eps), n, n, value=1.0 / x.shape[-1]).rsqrt_()
    return x * rstd, rstd


class _RMSNormFn(torch.autograd.Function):
    """fp32 RMSNorm on CPU with its own backward, in fewer passes over memory than
    ``F.rms_norm`` (there a composite of about six kernels, three of them allocating a copy of
    ``x``, whose backward autograd retraces op by op: PyTorch has no fused RMSNorm backward on
    CPU).

    Forward: :func:`_cpu_rms_parts`, then ``out = xhat * w``. Backward, with ``gh = g * w``:
    ``grad_x = rstd * (gh - xhat * mean(gh * xhat))``, ``grad_w = sum(g * xhat)`` over all but
    the last dimension.
    """

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        xhat, rstd = _cpu_rms_parts(x, eps)
        ctx.save_for_backward(xhat, weight, rstd)
        return xhat * weight

    @staticmethod
    def backward(ctx, g):
        xhat, weight, rstd = ctx.saved_tensors
        d = xhat.shape[-1]
        grad_x = grad_w = tmp = None
        if ctx.needs_input_grad[1]:
            tmp = g * xhat
            grad_w = tmp.reshape(-1, d).sum(0)
        if ctx.needs_input_grad[0]:
            gh = g * weight if tmp is None else torch.mul(g, weight, out=tmp)  # tmp is spent
            m = torch.linalg.vecdot(gh, xhat).unsqueeze_(-1).div_(d)
            grad_x = gh.addcmul_(xhat, m, value=-1).mul_(rstd)
        return grad_x, grad_w, None


# The CPU-only eager RMSNorm with its own backward (:class:`_RMSNormFn`). False traces the
# plain ops the GPU runs instead: the memory plan (olmoflow.train.plan) counts what they save.
CPU_FUSED_RMS_NORM = True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`RMSNorm`'s computation as a function: ``[..., size]`` -> the same shape and dtype
    (``weight [size]``).

    fp32 on CPU, eager: :func:`_cpu_rms_parts` times the weight (``F.rms_norm``'s value within
    an ulp or two: ``|x|^2`` is rounded once more), the same numbers with or without autograd,
    whose backward is :class:`_RMSNormFn`'s. Elsewhere ``F.rms_norm`` (fused on GPU; under
    ``torch.compile`` the compiler fuses it with its neighbours).
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # All fp32: both orders agree. Plain tensors only: DTensors (tensor parallelism) go
        # through F.rms_norm's sharding rules.
        if (CPU_FUSED_RMS_NORM and x.device.type == "cpu" and not torch.compiler.is_compiling()
                and not hasattr(x, "placements") and not hasattr(weight, "placements")):
            if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
                return _RMSNormFn.apply(x, weight, eps)
            return _cpu_rms_parts(x, eps)[0].mul_(weight)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x32).to(dtype)


_EPS: dict[float, torch.Tensor] = {}


def _eps_tensor(eps: float) -> torch.Tensor:
    """``eps`` as a CPU fp32 0-dim tensor, made once: usable as a scalar operand on any device."""
    eps_t = _EPS.get(eps)
    if eps_t is None:
        eps_t = _EPS[eps] = torch.tensor(eps, dtype=torch.float32)
    return eps_t


def inference_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                       dims: int = 1, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of ``x`` over its last ``dims`` dimensions for the inference path, times
    ``weight`` (broadcast over them; None: no weight), plus ``residual`` when given (the
    block's ``h = x + RMSNorm(a)``, folded into one ``addcmul``).

    In fp32, ``x * rsqrt(|x|^2 / n + eps)`` with the norm from one ``vector_norm`` kernel: on
    CPU ``F.rms_norm`` is a composite of about a dozen kernel calls (power, mean, scalar
    conversions, add, rsqrt, two products), this is five, about 1.7x faster at decode shapes,
    and equal to it within an ulp or two (``|x|^2`` is rounded once more). Other dtypes
    (``dims == 1``) get :func:`rms_norm`. Not for training: the training forward keeps
    :func:`rms_norm`. Shapes: ``x [..., *normalized]`` -> the same.
    """
    if x.dtype != torch.float32 or (weight is not None and weight.dtype != torch.float32):
        y = rms_norm(x, weight, eps)
        return y if residual is None else residual + y
    eps_t = _eps_tensor(eps)
    n = torch.linalg.vector_norm(x, dim=tuple(range(-dims, 0)), keepdim=True)
    size = math.prod(x.shape[-dims:])
    y = torch.mul(x, torch.addcmul(eps_t, n, n, value=1.0 / size).rsqrt_())
    if residual is not None:
        return residual + y if weight is None else torch.addcmul(residual, y, weight)
    return y if weight is None else y.mul_(weight)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in fp32.

    OLMo's order: normalise in fp32, multiply by the weight in fp32, then cast back to the input
    dtype (Llama casts before the multiply; the two differ in bf16).

    Shapes: input ``[..., size]`` -> output of the same shape and dtype.
    """

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def yarn_inv_freq(
    head_dim: int, theta: float, factor: float, original_max_length: int,
    beta_fast: float = 32.0, beta_slow: float = 1.0,
) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies and attention scaling (Peng et al. 2023, as in transformers).

    Returns ``(inv_freq [head_dim/2] fp32, mscale)``: high-frequency dims keep their frequency,
    low-frequency dims are interpolated by ``factor``, with a linear ramp between; cos/sin are
    multiplied by ``mscale = 0.1 ln(factor) + 1``.
    """
    even = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu")
    pos_freqs = theta ** (even / head_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(original_max_length / (num_rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    dims = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((dims - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    mscale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq, mscale


class RotaryEmbedding(nn.Module):
    """Rotary position embedding tables (fp32), rotate-half convention.

    ``forward(positions [B, T] or [T])`` returns ``(cos, sin)`` of shape ``[B or 1, T, head_dim]``
    in fp32; :func:`apply_rotary` applies them to ``[B, H, T, head_dim]`` queries/keys. The tables
    for positions ``0 .. max_length - 1`` are computed once per device and indexed, so a decode step
    costs a gather, not a cos and a sin; a position past ``max_length`` grows the table.
    :meth:`inference_tables` serves the inference path (:func:`apply_rotary_rolled`).
    """

    def __init__(
        self, head_dim: int, theta: float, yarn_factor: float | None = None,
        yarn_original_max_length: int = 8192, max_length: int = 4096,
    ):
        super().__init__()
        if yarn_factor:
            inv_freq, self.scale = yarn_inv_freq(head_dim, theta, yarn_factor,
                                                 yarn_original_max_length)
        else:
            even = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu")
            inv_freq = 1.0 / (theta ** (even / head_dim))
            self.scale = 1.0
        # Kept out of the state dict and out of .to(dtype): the tables are derived from the config
        # and must stay fp32 even when the weights are bf16 or were built on the meta device.
        self.inv_freq = inv_freq
        self.max_length = max_length
        self._tables: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def _table(self, device: torch.device, length: int) -> tuple[torch.Tensor, ...]:
        """``(cos, sin)`` ``[L, head_dim]`` and, for the inference path, ``(cos, rolled sin)``
        ``[1, L, 1, head_dim]``, with ``L >= max(length, max_length)``."""
        table = self._tables.get(device)
        if table is None or table[0].shape[0] < length:
            pos = torch.arange(max(length, self.max_length), dtype=torch.float32, device="cpu")
            freqs = pos[:, None] * self.inv_freq[None, :]  # [L, hd/2]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = (emb.cos() * self.scale).to(device), (emb.sin() * self.scale).to(device)
            half = sin.shape[1] // 2
            rolled = torch.cat((-sin[:, :half], sin[:, half:]), -1)
            table = (cos, sin, cos[None, :, None], rolled[None, :, None])
            self._tables[device] = table
        return table

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            positions = positions[None]
        cos, sin = self._grown(positions)[:2]
        return cos[positions], sin[positions]

    def _grown(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        table = self._table(positions.device, self.max_length)
        if (not torch.compiler.is_compiling() and positions.device.type == "cpu"
                and positions.numel()):
            # Growing needs the largest position: a cheap read on CPU (on GPU, size max_length).
            top = int(positions.max())
            if top >= table[0].shape[0]:
                table = self._table(positions.device, top + 1)
        return table

    def inference_tables(self, positions: int | torch.Tensor, length: int, device: torch.device,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin_rolled)`` for :func:`apply_rotary_rolled`, broadcasting over heads.

        Args:
            positions: an int ``start`` (every row at ``start .. start + length - 1``: views of
                the tables, ``[1, length, 1, head_dim]``, no gather), or ``[B|1, length]`` long
                (gathered: ``[B|1, length, 1, head_dim]``).
            length: the number of positions ``T``.
            device: where the tables live.
        """
        if isinstance(positions, int):
            cos, sin_r = self._table(device, positions + length)[2:]
            return cos.narrow(1, positions, length), sin_r.narrow(1, positions, length)
        cos, sin_r = self._grown(positions)[2:]
        return cos[0, positions], sin_r[0, positions]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` over half-width views, without the concatenation:
    ``[x1 c1 - x2 s1, x2 c2 + x1 s2]``; fp32, any broadcastable shapes."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    c1, c2, s1, s2 = cos[..., :h], cos[..., h:], sin[..., :h], sin[..., h:]
    shape = torch.broadcast_shapes(x.shape, cos.shape, sin.shape)
    # x's own layout when it has the output's shape: q and k arrive as [B, H, T, hd] views of
    # [B, T, H, hd] and are read and written in memory order.
    out = (torch.empty_like(x, dtype=torch.float32) if shape == x.shape
           else torch.empty(shape, dtype=torch.float32, device=x.device))
    torch.mul(x1, c1, out=out[..., :h]).addcmul_(x2, s1, value=-1)
    torch.mul(x2, c2, out=out[..., h:]).addcmul_(x1, s2)
    return out


class _RotaryFn(torch.autograd.Function):
    """RoPE as one autograd node: the rotation is linear in ``x``, so the backward is the
    transposed rotation, ``_rotate(g, cos, sin')`` with ``sin' = [-s2, -s1]``, four half-width
    kernels instead of autograd's trail through the chunk, negation and concatenation."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.dtype = x.dtype
        return _rotate(x if x.dtype == torch.float32 else x.float(), cos, sin)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        h = sin.shape[-1] // 2
        sin_t = torch.cat((-sin[..., h:], -sin[..., :h]), -1)
        return _rotate(g, cos, sin_t).to(ctx.dtype), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, T, hd]`` by ``cos/sin [B|1, T, hd]``, in fp32, returning x's dtype.

    ``x * cos + rotate_half(x) * sin``; eagerly over half-width views (:func:`_rotate`), with its
    own backward when autograd records; as written above under ``torch.compile``, which fuses it.
    """
    cos, sin = cos[:, None], sin[:, None]
    if torch.compiler.is_compiling():
        x32 = x.float()
        return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)
    if torch.is_grad_enabled() and x.requires_grad and not (cos.requires_grad
                                                            or sin.requires_grad):
        out = _RotaryFn.apply(x, cos, sin)
    else:
        out = _rotate(x if x.dtype == torch.float32 else x.float(), cos, sin)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def apply_rotary_rolled(x: torch.Tensor, cos: torch.Tensor, sin_rolled: torch.Tensor,
                        ) -> torch.Tensor:
    """:func:`apply_rotary` in fewer kernels, for the inference path: ``x [..., hd]`` and
    ``cos``, ``sin_rolled`` broadcastable to it (:meth:`RotaryEmbedding.inference_tables`:
    ``sin`` with its first half negated, so that ``rotate_half(x) * sin == x.roll(hd / 2) *
    sin_rolled`` term by term, ``-a * b`` being ``a * -b`` exactly). One roll replaces a chunk, a
    negation and a concatenation and ``addcmul`` the last multiply and add (which it may fuse:
    a rounding apart from :func:`apply_rotary`). In fp32, returning x's dtype."""
    x32 = x if x.dtype == torch.float32 else x.float()
    out = torch.addcmul(x32 * cos, x32.roll(x.shape[-1] // 2, -1), sin_rolled)
    return out if out.dtype == x.dtype else out.to(x.dtype)


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``, no biases. ``[..., d_model] -> [..., d_model]``."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)  # gate
        self.w3 = nn.Linear(d_model, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def inference_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(W_gate_up [d, 2 * hidden], W_down [hidden, d])`` for :meth:`inference`
        (:func:`fused_weight`; None where the linears are wrapped or quantized)."""
        return fused_weight((self.w1, self.w3)), fused_weight((self.w2,))

    def inference(self, x: torch.Tensor, weights: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """:meth:`forward` for the no-grad KV-cache path over :meth:`inference_weights`: one
        gate/up matmul and the down matmul (the modules themselves where a weight is None).
        Not differentiable."""
        w13, w2 = weights
        if w13 is None:
            y = F.silu(self.w1(x)) * self.w3(x)
        else:
            gate, up = torch.matmul(x, w13).chunk(2, dim=-1)
            y = F.silu(gate, inplace=True).mul_(up)  # in place: the matmul's own buffer
        return self.w2(y) if w2 is None else torch.matmul(y, w2)
