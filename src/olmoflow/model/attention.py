"""Multi-head attention for OLMo 2/3: QK-norm over the full projected width, RoPE, GQA, sliding
windows, a KV cache for decoding, and two backends (``sdpa`` and ``eager``).

Masking rule, shared by every path: query at absolute position ``i`` sees key ``j`` when
``j <= i``, ``i - j < window`` (sliding layers) and key ``j`` is not padding. A query always sees
itself, so a padded row never has every key masked (no NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from olmoflow.model.layers import RMSNorm, apply_rotary


class KVCache:
    """Preallocated keys and values for every layer, ``[B, n_kv_heads, max_length, head_dim]``.

    ``length`` is how many positions are filled (the same for every row; left padding keeps rows
    aligned). ``key_padding`` ``[B, max_length]`` (bool, True = real token) masks left pads.
    Sliding-window layers keep the full history too and mask by distance, which keeps the cache
    layout uniform; memory is ``2 * n_layers * B * max_length * n_kv_heads * head_dim`` values.
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_length: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (batch, n_kv_heads, max_length, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.key_padding = torch.ones(batch, max_length, dtype=torch.bool, device=device)
        self.max_length = max_length
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v [B, H_kv, T, hd]`` at ``length`` and return the filled prefix of the cache."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_length:
            raise ValueError(f"KV cache overflow: {end} positions > max_length {self.max_length}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


def build_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None,
    key_padding: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean attention mask, True where attending is allowed.

    Args:
        q_pos: ``[Tq]`` absolute positions of the queries (cache slots, not RoPE positions).
        k_pos: ``[Tk]`` absolute positions of the keys.
        window: sliding window (query included) or None for full causal attention.
        key_padding: ``[B, Tk]`` True for real tokens.
        doc_ids: ``[B, T]`` document index per position (Tq == Tk); keys of other documents masked.
    Returns:
        ``[1 or B, 1, Tq, Tk]`` bool.
    """
    diff = q_pos[:, None] - k_pos[None, :]
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    mask = mask[None, None]
    if key_padding is not None:
        mask = mask & key_padding[:, None, None, :]
    if doc_ids is not None:
        mask = mask & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    return mask | (diff == 0)[None, None]  # a query always sees itself: no all-masked rows


class Attention(nn.Module):
    """OLMo 2/3 self-attention. ``[B, T, d_model] -> [B, T, d_model]``.

    q/k/v/out projections without bias; RMSNorm on the full q (``n_heads*head_dim``) and k
    (``n_kv_heads*head_dim``) before splitting heads and before RoPE (OLMo 2 QK-norm).
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 window: int | None, eps: float, backend: str = "sdpa", dropout: float = 0.0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.window, self.backend, self.dropout = window, backend, dropout
        self.w_q = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.w_k = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.w_v = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.w_out = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.q_norm = RMSNorm(n_heads * head_dim, eps)
        self.k_norm = RMSNorm(n_kv_heads * head_dim, eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, layer: int = 0,
        cache: KVCache | None = None, mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``mask`` is a prebuilt :func:`build_mask` or None for plain causal attention."""
        B, T, _ = x.shape
        q = self.q_norm(self.w_q(x)).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_norm(self.w_k(x)).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.w_v(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        y = self._attend(q, k, v, mask)
        return self.w_out(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def _attend(self, q, k, v, mask):
        p = self.dropout if self.training else 0.0
        if self.backend == "sdpa":
            if mask is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p,
                                                      enable_gqa=self.n_kv_heads != self.n_heads)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                  enable_gqa=self.n_kv_heads != self.n_heads)
        # eager: the explicit math, in fp32 softmax, as a reference and for attention statistics
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) * self.head_dim**-0.5
        if mask is None:
            Tq, Tk = q.shape[2], k.shape[2]
            mask = build_mask(torch.arange(Tk - Tq, Tk, device=q.device),
                              torch.arange(Tk, device=q.device), None)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        probs = F.dropout(probs, p=p, training=self.training)
        return probs @ v
