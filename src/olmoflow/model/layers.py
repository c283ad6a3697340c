"""The OLMo building blocks: RMSNorm, rotary embeddings (with YaRN) and the SwiGLU MLP.

References: Zhang & Sennrich 2019 (RMSNorm); Su et al. 2021 (RoPE, rotate-half form as in GPT-NeoX
and OLMo); Peng et al. 2023 (YaRN); Shazeer 2020 (SwiGLU); OLMo 2 (Team OLMo 2024) for the order of
operations in RMSNorm.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


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
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # All fp32: both orders agree, and PyTorch's fused kernel saves a few launches a call.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(dtype)


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
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, device: torch.device, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._tables.get(device)
        if table is None or table[0].shape[0] < length:
            pos = torch.arange(max(length, self.max_length), dtype=torch.float32, device="cpu")
            freqs = pos[:, None] * self.inv_freq[None, :]  # [L, hd/2]
            emb = torch.cat((freqs, freqs), dim=-1)
            table = ((emb.cos() * self.scale).to(device), (emb.sin() * self.scale).to(device))
            self._tables[device] = table
        return table

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            positions = positions[None]
        cos, sin = self._table(positions.device, self.max_length)
        if (not torch.compiler.is_compiling() and positions.device.type == "cpu"
                and positions.numel()):
            # Growing needs the largest position: a cheap read on CPU (on GPU, size max_length).
            top = int(positions.max())
            if top >= cos.shape[0]:
                cos, sin = self._table(positions.device, top + 1)
        return cos[positions], sin[positions]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, T, hd]`` by ``cos/sin [B|1, T, hd]``, in fp32, returning x's dtype."""
    cos, sin = cos[:, None], sin[:, None]
    x32 = x.float()
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``, no biases. ``[..., d_model] -> [..., d_model]``."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)  # gate
        self.w3 = nn.Linear(d_model, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
