"""Multi-head attention for OLMo 2/3: QK-norm over the full projected width, RoPE, GQA, sliding
windows, a KV cache for decoding (dynamic or static-shape), and pluggable attention backends.

Masking rule, shared by every backend: query at absolute position ``i`` sees key ``j`` when
``j <= i``, ``i - j < window`` (sliding layers), key ``j`` is not padding, and (packed sequences)
both belong to the same document. A query that sees no key at all (a left pad) outputs exactly
zeros, never NaN, in the forward and the backward pass.

Backends (``ModelConfig.attention_backend``), all with the signature of :data:`AttentionFn`:

- ``eager``: the explicit math with an fp32 softmax; the reference the others are tested against.
- ``sdpa``: :func:`torch.nn.functional.scaled_dot_product_attention`; plain causal attention is
  passed as ``is_causal=True`` with no mask tensor (the fast training path).
- ``flex``: :func:`torch.nn.attention.flex_attention.flex_attention` with a ``BlockMask`` built from
  the same rule (PyTorch docs and the "FlexAttention" blog post, 2024). Without ``torch.compile``
  it runs an unfused reference kernel; PyTorch 2.13 has no FlexAttention backward on CPU.
- ``flash``: the ``flash_attn`` package (FlashAttention-2, Dao 2023) on CUDA in fp16/bf16:
  ``flash_attn_func(..., causal=True, window_size=(w - 1, 0))``, and ``flash_attn_varlen_func``
  for packed documents (each document one contiguous run of ``doc_ids``).

A backend that cannot run a call (not installed, wrong device or dtype, unsupported mask) falls
back to ``sdpa`` and says so in one warning per process and reason.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from olmoflow.model.layers import (
    RMSNorm,
    apply_rotary,
    apply_rotary_rolled,
    fused_weight,
    inference_rms_norm,
)


class KVCache:
    """Preallocated keys and values for every layer, ``[B, n_kv_heads, max_length, head_dim]``.

    Two modes:

    - dynamic (``static=False``): ``length`` (a Python int) counts the filled positions, the same
      for every row (left padding keeps rows aligned); attention reads the filled prefix only.
    - static (``static=True``): the fill position is a tensor (``position``, ``[1]`` long), writes
      use ``index_copy_`` at a ``cache_position`` tensor, and attention always reads all
      ``max_length`` slots under a mask, so every decode step has the same shapes and the same
      code path: ``torch.compile`` compiles one decode graph and reuses it.

    ``key_padding`` ``[B, max_length]`` (bool, True = real token) masks left pads; ``n_pad`` ``[B]``
    counts each row's pads so that later tokens get RoPE positions ``slot - n_pad`` without an
    attention mask; ``padded`` (a Python bool) says whether any pad was written, so that a decode
    step without pads builds no mask and reads no device value. Sliding-window layers keep the
    full history too and mask by distance, which keeps the layout uniform; memory is
    ``2 * n_layers * B * max_length * n_kv_heads * head_dim``.
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_length: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, static: bool = False):
        shape = (batch, n_kv_heads, max_length, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.key_padding = torch.ones(batch, max_length, dtype=torch.bool, device=device)
        self.n_pad = torch.zeros(batch, dtype=torch.long, device=device)
        self.max_length = max_length
        self.static = static
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # static mode only
        self.padded = False
        self._length = 0

    @property
    def length(self) -> int:
        """Filled positions (reads the ``position`` tensor in static mode: a device sync)."""
        return int(self.position) if self.static else self._length

    @length.setter
    def length(self, value: int) -> None:
        if self.static:
            self.position.fill_(value)
        else:
            self._length = value

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor,
        cache_position: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v [B, H_kv, T, hd]`` and return the keys/values attention should read.

        Dynamic: written at ``length``; returns the filled prefix ``[B, H_kv, length + T, hd]``.
        Static: written at the slots ``cache_position [T]`` (long); returns the whole cache
        ``[B, H_kv, max_length, hd]``.

        Raises:
            ValueError: (dynamic) the write would pass ``max_length``.
        """
        if cache_position is not None:
            self.k[layer].index_copy_(2, cache_position, k)
            self.v[layer].index_copy_(2, cache_position, v)
            return self.k[layer], self.v[layer]
        start, end = self._length, self._length + k.shape[2]
        if end > self.max_length:
            raise ValueError(f"KV cache overflow: {end} positions > max_length {self.max_length}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


def build_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None,
    key_padding: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean attention mask, True where attending is allowed (the rule in the module docstring).

    Rows may be all False (a pad query); backends turn those rows into zeros.

    Args:
        q_pos: ``[Tq]`` absolute positions of the queries (cache slots, not RoPE positions).
        k_pos: ``[Tk]`` absolute positions of the keys.
        window: sliding window (query included) or None for full causal attention.
        key_padding: ``[B, Tk]`` True for real tokens.
        doc_ids: ``[B, T]`` document index per position (Tq == Tk == T); keys of other documents
            are masked.
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
    return mask


class AttentionMask:
    """The masking rule of one forward pass for one window size, shared by the layers using it.

    Holds the rule, not a tensor: each backend asks for the form it consumes (:meth:`dense`,
    :meth:`block_mask`, or nothing when :attr:`is_causal`), built lazily once and reused by every
    layer with this window.

    Args:
        q_pos: ``[Tq]`` long, absolute cache slots of the queries.
        k_len: number of keys ``Tk``; key ``j`` sits at slot ``j``.
        window: sliding window (query included) or None.
        key_padding: ``[B, Tk]`` bool, True for real tokens, or None.
        doc_ids: ``[B, Tq]`` document per position (requires ``Tq == Tk``), or None.
        aligned: the queries are the last ``Tq`` of the ``Tk`` positions (no static cache).
    Raises:
        ValueError: ``doc_ids`` given while ``Tq != Tk`` (decoding with packed documents).
    """

    def __init__(self, q_pos: torch.Tensor, k_len: int, window: int | None = None, *,
                 key_padding: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
                 aligned: bool = True):
        if doc_ids is not None and (doc_ids.shape[-1] != q_pos.shape[0] or q_pos.shape[0] != k_len):
            raise ValueError(
                f"doc_ids {tuple(doc_ids.shape)} needs as many queries as keys (got "
                f"{q_pos.shape[0]} queries, {k_len} keys): intra-document masking is for full "
                "forwards, not decoding"
            )
        self.q_pos, self.k_len, self.window = q_pos, k_len, window
        self.key_padding, self.doc_ids, self.aligned = key_padding, doc_ids, aligned
        self._dense: torch.Tensor | None = None
        self._has_key: torch.Tensor | None = None
        self._block_masks: dict = {}

    @classmethod
    def causal(cls, q_len: int, k_len: int, device: torch.device,
               window: int | None = None) -> AttentionMask:
        """Causal (and windowed) attention of the last ``q_len`` of ``k_len`` positions."""
        return cls(torch.arange(k_len - q_len, k_len, device=device), k_len, window)

    @property
    def q_len(self) -> int:
        return self.q_pos.shape[0]

    @property
    def is_causal(self) -> bool:
        """True when the rule is exactly plain causal attention with ``Tq == Tk`` (no window
        reaches, no padding, no documents): backends may use their built-in causal kernel."""
        return (self.aligned and self.q_len == self.k_len and self.key_padding is None
                and self.doc_ids is None and (self.window is None or self.k_len <= self.window))

    @property
    def may_have_empty_rows(self) -> bool:
        """Whether some query may see no key (only with key padding: otherwise it sees itself)."""
        return self.key_padding is not None

    def dense(self) -> torch.Tensor:
        """``[1 or B, 1, Tq, Tk]`` bool, True where attending is allowed (:func:`build_mask`)."""
        if self._dense is None:
            k_pos = torch.arange(self.k_len, device=self.q_pos.device)
            self._dense = build_mask(self.q_pos, k_pos, self.window, self.key_padding, self.doc_ids)
        return self._dense

    def has_key(self) -> torch.Tensor | None:
        """``[1 or B, 1, Tq, 1]`` bool, False for queries that see no key; None if there are
        none."""
        if not self.may_have_empty_rows:
            return None
        if self._has_key is None:
            self._has_key = self.dense().any(-1, keepdim=True)
        return self._has_key

    def safe_dense(self) -> torch.Tensor:
        """:meth:`dense` with empty rows opened up (they attend everywhere), so a softmax over
        them stays finite; their outputs are then replaced by zeros (:func:`zero_empty_rows`)."""
        has_key = self.has_key()
        return self.dense() if has_key is None else self.dense() | ~has_key

    def mask_mod(self) -> Callable:
        """The rule as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool``."""
        q_pos, window, pad, docs = self.q_pos, self.window, self.key_padding, self.doc_ids

        def mask_mod(b, h, q_idx, kv_idx):
            qp = q_pos[q_idx]
            ok = kv_idx <= qp
            if window is not None:
                ok = ok & (qp - kv_idx < window)
            if pad is not None:
                ok = ok & pad[b, kv_idx]
            if docs is not None:
                ok = ok & (docs[b, q_idx] == docs[b, kv_idx])
            return ok

        return mask_mod

    def block_mask(self, batch: int):
        """A FlexAttention ``BlockMask`` for this rule (built once, shared by the layers)."""
        per_row = self.key_padding is not None or self.doc_ids is not None
        key = batch if per_row else None
        if key not in self._block_masks:
            from torch.nn.attention.flex_attention import create_block_mask

            self._block_masks[key] = create_block_mask(
                self.mask_mod(), B=key, H=None, Q_LEN=self.q_len, KV_LEN=self.k_len,
                device=self.q_pos.device)
        return self._block_masks[key]


def zero_empty_rows(out: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """Zero the outputs ``[B, H, Tq, hd]`` of queries that see no key (see
    :meth:`AttentionMask.safe_dense`)."""
    has_key = mask.has_key()
    return out if has_key is None else out.masked_fill(~has_key, 0.0)


# ---------------------------------------------------------------------------------------------
# Backends. Each takes q [B, H, Tq, hd], k/v [B, H_kv, Tk, hd] (H a multiple of H_kv), the rule,
# and a dropout probability, and returns [B, H, Tq, hd] in q's dtype with zeros on empty rows.

AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMask, float], torch.Tensor
]


def eager_attention(q, k, v, mask: AttentionMask, dropout_p: float = 0.0) -> torch.Tensor:
    """``softmax(q k^T / sqrt(hd) + mask) v`` spelled out, scores and softmax in fp32."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask.safe_dense(), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return zero_empty_rows(probs @ v, mask)


def sdpa_attention(q, k, v, mask: AttentionMask, dropout_p: float = 0.0) -> torch.Tensor:
    """PyTorch SDPA; plain causal attention goes in as ``is_causal=True`` with no mask tensor."""
    gqa = q.shape[1] != k.shape[1]
    if mask.is_causal:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                              enable_gqa=gqa)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.safe_dense(), dropout_p=dropout_p,
                                         enable_gqa=gqa)
    return zero_empty_rows(out, mask)


def flex_attention(q, k, v, mask: AttentionMask, dropout_p: float = 0.0) -> torch.Tensor:
    """FlexAttention with the rule as a ``BlockMask``. Rows that see no key come out as zeros
    (FlexAttention's documented behaviour; tested). No dropout (checked by :func:`attend`)."""
    from torch.nn.attention.flex_attention import flex_attention as _flex

    return _flex(q, k, v, block_mask=mask.block_mask(q.shape[0]),
                 enable_gqa=q.shape[1] != k.shape[1])


@functools.cache
def _flash_attn():
    """The ``flash_attn`` module, or None when it is not installed."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    import flash_attn

    return flash_attn


def _doc_runs(doc_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``doc_ids [B, T]`` -> (``cu_seqlens`` int32 over the flattened batch, longest run)."""
    B, T = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    idx = starts.flatten().nonzero().squeeze(1)
    cu = torch.cat([idx, idx.new_tensor([B * T])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def flash_attention(q, k, v, mask: AttentionMask, dropout_p: float = 0.0) -> torch.Tensor:
    """FlashAttention-2 (Dao 2023). Causal with ``window_size=(w - 1, 0)``; packed documents via
    ``flash_attn_varlen_func``, assuming each document is one contiguous run of ``doc_ids``."""
    fa = _flash_attn()
    B, H, Tq, hd = q.shape
    ws = (mask.window - 1, 0) if mask.window is not None else (-1, -1)
    q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))  # [B, T, H, hd]
    if mask.doc_ids is None:
        out = fa.flash_attn_func(q_, k_, v_, dropout_p, causal=True, window_size=ws)
    else:
        cu, longest = _doc_runs(mask.doc_ids)
        flat = [t.reshape(B * t.shape[1], t.shape[2], hd) for t in (q_, k_, v_)]
        out = fa.flash_attn_varlen_func(*flat, cu, cu, longest, longest, dropout_p, causal=True,
                                        window_size=ws).view(B, Tq, H, hd)
    return out.transpose(1, 2)


@functools.cache
def _has_flex() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def _flex_unavailable(q, k, v, mask: AttentionMask, dropout_p: float) -> str | None:
    if not _has_flex():
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    if dropout_p > 0:
        return "flex_attention has no attention dropout"
    needs_grad = any(t.requires_grad for t in (q, k, v))
    if q.device.type == "cpu" and torch.is_grad_enabled() and needs_grad:
        return f"FlexAttention has no backward pass on CPU in torch {torch.__version__}"
    return None


def _flash_unavailable(q, k, v, mask: AttentionMask, dropout_p: float) -> str | None:
    if _flash_attn() is None:
        return "flash_attn not installed; needs CUDA"
    if q.device.type != "cuda":
        return f"flash_attn needs CUDA, got device '{q.device.type}'"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"flash_attn needs fp16/bf16, got {q.dtype}"
    if q.shape[-1] > 256:
        return f"flash_attn supports head_dim <= 256, got {q.shape[-1]}"
    if mask.key_padding is not None or not mask.aligned:
        return "flash_attn path has no key-padding masks (left padding, static KV cache)"
    return None


@dataclass(frozen=True)
class AttentionBackend:
    """A registered backend: the kernel and a check that returns why it cannot run a call."""

    name: str
    fn: AttentionFn
    unavailable: Callable[..., str | None] | None = None


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {}
FALLBACK_BACKEND = "sdpa"
_warned: set[tuple[str, str]] = set()


def register_backend(name: str, fn: AttentionFn,
                     unavailable: Callable[..., str | None] | None = None) -> None:
    """Add (or replace) a backend. ``unavailable(q, k, v, mask, dropout_p)`` returns a reason
    string when the backend cannot run that call (it then falls back to ``sdpa``), else None."""
    ATTENTION_BACKENDS[name] = AttentionBackend(name, fn, unavailable)


register_backend("eager", eager_attention)
register_backend("sdpa", sdpa_attention)
register_backend("flex", flex_attention, _flex_unavailable)
register_backend("flash", flash_attention, _flash_unavailable)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
           backend: str = "sdpa", dropout_p: float = 0.0) -> torch.Tensor:
    """Run ``backend`` (a name in :data:`ATTENTION_BACKENDS`) on one call, or fall back to
    ``sdpa`` with one warning per process and reason when it cannot run here.

    Shapes: ``q [B, H, Tq, hd]``, ``k, v [B, H_kv, Tk, hd]`` -> ``[B, H, Tq, hd]``.

    Raises:
        KeyError: ``backend`` is not registered.
    """
    try:
        b = ATTENTION_BACKENDS[backend]
    except KeyError:
        raise KeyError(f"unknown attention backend '{backend}'; "
                       f"known: {sorted(ATTENTION_BACKENDS)}") from None
    reason = b.unavailable(q, k, v, mask, dropout_p) if b.unavailable is not None else None
    if reason is not None:
        if (backend, reason) not in _warned:
            _warned.add((backend, reason))
            warnings.warn(f"attention backend '{backend}' is unavailable ({reason}); "
                          f"using '{FALLBACK_BACKEND}'", UserWarning, stacklevel=2)
        b = ATTENTION_BACKENDS[FALLBACK_BACKEND]
    return b.fn(q, k, v, mask, dropout_p)


class AttentionWeights(NamedTuple):
    """:meth:`Attention.inference_forward`'s derived weights (see
    :func:`~olmoflow.model.layers.fused_weight`); None: use the module itself.

    ``qkv [d_model, (H + 2 H_kv) hd]``, ``qk_norm [2, H, hd]`` (the q and k norm weights stacked,
    when ``H == H_kv`` and the two norms share their epsilon), ``out [H hd, d_model]``;
    ``q_norm``, ``k_norm`` are the norm weights themselves and ``q_eps``, ``k_eps`` their
    epsilons (read once here, not every step through the modules)."""

    qkv: torch.Tensor | None
    qk_norm: torch.Tensor | None
    out: torch.Tensor | None
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    q_eps: float
    k_eps: float


class Attention(nn.Module):
    """OLMo 2/3 self-attention. ``[B, T, d_model] -> [B, T, d_model]``.

    q/k/v/out projections without bias; RMSNorm on the full q (``n_heads*head_dim``) and k
    (``n_kv_heads*head_dim``) before splitting heads and before RoPE (OLMo 2 QK-norm).
    ``backend`` names an entry of :data:`ATTENTION_BACKENDS`.
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
        cache: KVCache | None = None, mask: AttentionMask | None = None,
        cache_position: torch.Tensor | None = None, inference: AttentionWeights | None = None,
    ) -> torch.Tensor:
        """Attend ``x [B, T, d_model]``; ``cos/sin [B|1, T, head_dim]`` are the RoPE tables.

        ``mask`` is the rule for this layer's window (None: plain causal over the keys read);
        ``cache_position [T]`` (long) selects the static-cache write slots. ``inference`` (this
        module's :meth:`inference_weights`) takes the no-grad KV-cache path,
        :meth:`inference_forward`, whose RoPE tables come in its own form.
        """
        if inference is not None:
            return self.inference_forward(x, cos, sin, inference, layer=layer, cache=cache,
                                          mask=mask, cache_position=cache_position)
        B, T, _ = x.shape
        # Heads counted from the projections' width: under tensor parallelism a rank holds
        # n_heads / tp query heads and n_kv_heads / tp key/value heads (whole heads per rank).
        hd = self.head_dim
        q = self.q_norm(self.w_q(x)).view(B, T, -1, hd).transpose(1, 2)
        k = self.k_norm(self.w_k(x)).view(B, T, -1, hd).transpose(1, 2)
        v = self.w_v(x).view(B, T, -1, hd).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v, cache_position)
        if mask is None:
            mask = AttentionMask.causal(T, k.shape[2], x.device, self.window)
        y = attend(q, k, v, mask, self.backend, self.dropout if self.training else 0.0)
        return self.w_out(y.transpose(1, 2).reshape(B, T, q.shape[1] * hd))

    def inference_weights(self) -> AttentionWeights:
        """The fused copies :meth:`inference_forward` multiplies by (built by the caller once
        and kept while the parameters do not change: ``Olmo`` keeps them with
        :func:`~olmoflow.model.layers.derived_weights`)."""
        qn, kn = self.q_norm, self.k_norm
        stack = (self.n_heads == self.n_kv_heads and qn.eps == kn.eps
                 and qn.weight.dtype == kn.weight.dtype == torch.float32)
        qk = (torch.stack((qn.weight.detach(), kn.weight.detach())).view(
            2, self.n_heads, self.head_dim) if stack else None)
        return AttentionWeights(fused_weight((self.w_q, self.w_k, self.w_v)), qk,
                                fused_weight((self.w_out,)), qn.weight, kn.weight, qn.eps,
                                kn.eps)

    def inference_forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin_rolled: torch.Tensor,
        weights: AttentionWeights, *, layer: int = 0,
        cache: KVCache | None = None, mask: AttentionMask | None = None,
        cache_position: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` in fewer, larger kernels, for no-grad decoding (not differentiable;
        the training forward keeps its own numerics). ``cos``, ``sin_rolled``: ``[B|1, T, 1,
        head_dim]`` (:meth:`~olmoflow.model.layers.RotaryEmbedding.inference_tables`).

        One ``x @ W_qkv`` over the fused ``[d_model, (H + 2 H_kv) hd]`` copy of the three
        projections (``weights``, :meth:`inference_weights`); in fp32 with as many key
        as query heads, one RMSNorm call and one RoPE call (:func:`apply_rotary_rolled`) serve q
        and k together. A decode step (``T == 1``) without a mask reads the last ``window`` keys
        instead of masking the others (the same keys: a query sees its ``window`` latest
        positions) and calls SDPA without a mask; other calls go through :func:`attend` as
        :meth:`forward` does. Equal to :meth:`forward` within fp32 rounding (other matmul shapes
        sum in another order). Shapes as :meth:`forward`.
        """
        B, T, _ = x.shape
        H, H_kv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        w_qkv, w_qk, w_out, g_q, g_k, q_eps, k_eps = weights
        if (w_qkv is not None and w_qk is not None and w_qkv.dtype == torch.float32
                and x.dtype == torch.float32):
            qkv = torch.matmul(x, w_qkv).view(B, T, 3, H, hd)
            # One norm call normalises q and k, each over its full width, then scales by the
            # stacked weights.
            qk = inference_rms_norm(qkv[:, :, :2], w_qk, q_eps, dims=2)
            qk = apply_rotary_rolled(qk.view(B, T, 2 * H, hd), cos, sin_rolled)
            q, k = qk.transpose(1, 2).split(H, 1)
            v = qkv[:, :, 2].transpose(1, 2)
        else:
            if w_qkv is None:  # wrapped (LoRA) or quantized projections: their own modules
                q, k, v = self.w_q(x), self.w_k(x), self.w_v(x)
            else:
                q, k, v = torch.matmul(x, w_qkv).split((H * hd, H_kv * hd, H_kv * hd), -1)
            q = inference_rms_norm(q, g_q, q_eps).view(B, T, H, hd)
            k = inference_rms_norm(k, g_k, k_eps).view(B, T, H_kv, hd)
            q = apply_rotary_rolled(q, cos, sin_rolled).transpose(1, 2)
            k = apply_rotary_rolled(k, cos, sin_rolled).transpose(1, 2)
            v = v.view(B, T, H_kv, hd).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(layer, k, v, cache_position)
        if mask is None and T == 1 and self.backend == "sdpa":
            L = k.shape[2]
            if self.window is not None and L > self.window:
                k, v = k.narrow(2, L - self.window, self.window), v.narrow(2, L - self.window,
                                                                           self.window)
            y = F.scaled_dot_product_attention(q, k, v, enable_gqa=H != H_kv)
        else:
            if mask is None:
                mask = AttentionMask.causal(T, k.shape[2], x.device, self.window)
            y = attend(q, k, v, mask, self.backend)
        y = y.transpose(1, 2).reshape(B, T, H * hd)
        return self.w_out(y) if w_out is None else torch.matmul(y, w_out)
