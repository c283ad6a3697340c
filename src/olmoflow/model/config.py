"""Model configuration and presets for the OLMo 2 / OLMo 3 decoder.

Follows OLMo-core's shape: one ``ModelConfig`` dataclass, presets as classmethods, and derived
quantities (``head_dim``, per-layer attention windows) computed, never stored twice.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from olmoflow.errors import OlmoflowError


@dataclass
class ModelConfig:
    """Shape and numerics of an OLMo-architecture decoder.

    Attributes:
        vocab_size: rows of the embedding and LM head (the tokenizer's vocab padded up to a multiple
            of ``vocab_pad_multiple``); 0 means "take it from the tokenizer".
        d_model: residual stream width.
        n_layers, n_heads, n_kv_heads: depth, query heads, key/value heads (GQA when fewer).
        head_dim: per-head width; None means ``d_model // n_heads``.
        mlp_hidden: SwiGLU hidden width.
        max_sequence_length: longest sequence the RoPE tables and KV cache are built for.
        rope_theta: RoPE base (500,000 for OLMo 2/3).
        sliding_window: window of sliding-window layers, counting the query itself; None or 0
            disables sliding windows (OLMo 2).
        full_attention_every: layer ``i`` is full attention when ``i % full_attention_every ==
            full_attention_every - 1`` or it is the last layer (OLMo 3 uses 4).
        yarn_factor, yarn_original_max_length: YaRN RoPE scaling, applied to full-attention layers
            only as OLMo 3 does; factor None disables it.
        rms_norm_eps: RMSNorm epsilon.
        init_std: std of the truncated-normal init (cut at +-3 std).
        z_loss: z-loss coefficient (loss += z_loss * mean(logsumexp^2)).
        dropout: dropout on the residual branches (0 in OLMo; kept for experiments).
        attention_backend: "sdpa" (PyTorch scaled_dot_product_attention) or "eager" (explicit math).
    """

    vocab_size: int = 0
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    head_dim: int | None = None
    mlp_hidden: int = 768
    max_sequence_length: int = 4096
    rope_theta: float = 500_000.0
    sliding_window: int | None = 4096
    full_attention_every: int = 4
    yarn_factor: float | None = None
    yarn_original_max_length: int = 8192
    rms_norm_eps: float = 1e-6
    init_std: float = 0.02
    z_loss: float = 1e-5
    dropout: float = 0.0
    attention_backend: str = "sdpa"
    vocab_pad_multiple: int = 128

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        self.validate()

    def validate(self) -> None:
        """Raise :class:`OlmoflowError` naming the first inconsistent field."""
        if self.d_model <= 0 or self.n_layers <= 0 or self.n_heads <= 0 or self.mlp_hidden <= 0:
            raise OlmoflowError("model: d_model, n_layers, n_heads and mlp_hidden must be positive")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise OlmoflowError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                "set model.head_dim"
            )
        if self.n_heads % self.n_kv_heads:
            raise OlmoflowError(
                f"model.n_heads={self.n_heads} is not a multiple of model.n_kv_heads={self.n_kv_heads}"
            )
        if self.hd % 2:
            raise OlmoflowError(f"model.head_dim={self.hd} must be even for RoPE")
        if self.attention_backend not in ("sdpa", "eager"):
            raise OlmoflowError(
                f"model.attention_backend='{self.attention_backend}' is not one of: sdpa, eager"
            )

    @property
    def hd(self) -> int:
        """The per-head width actually used."""
        return self.head_dim or self.d_model // self.n_heads

    def is_full_attention(self, layer: int) -> bool:
        """Whether layer ``layer`` attends to the whole prefix (OLMo 3: every 4th and the last)."""
        if not self.sliding_window:
            return True
        k = self.full_attention_every
        return layer % k == k - 1 or layer == self.n_layers - 1

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (query included), or None for full attention."""
        return None if self.is_full_attention(layer) else self.sliding_window

    def padded_vocab_size(self, tokenizer_vocab: int) -> int:
        """``tokenizer_vocab`` rounded up to a multiple of ``vocab_pad_multiple`` (OLMo pads 100,278 to 100,352)."""
        m = self.vocab_pad_multiple
        return (tokenizer_vocab + m - 1) // m * m

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count, computed from the shape (no allocation)."""
        d, hd, v = self.d_model, self.hd, self.vocab_size
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        attn = d * q + 2 * d * kv + q * d + q + kv  # projections + q/k norms
        mlp = 3 * d * self.mlp_hidden
        block = attn + mlp + 2 * d
        total = self.n_layers * block + d  # final norm
        if include_embedding:
            total += 2 * v * d  # untied embedding and LM head
        return total

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # Presets (OLMo-core style names). vocab 100,278 padded to 100,352 as in the official models.
    @classmethod
    def olmo2_1b(cls) -> ModelConfig:
        return cls(vocab_size=100_352, d_model=2048, n_layers=16, n_heads=16, mlp_hidden=8192,
                   sliding_window=None)

    @classmethod
    def olmo3_7b(cls) -> ModelConfig:
        return cls(vocab_size=100_352, d_model=4096, n_layers=32, n_heads=32, mlp_hidden=11008,
                   max_sequence_length=65536, yarn_factor=8.0)

    @classmethod
    def olmo3_32b(cls) -> ModelConfig:
        return cls(vocab_size=100_352, d_model=5120, n_layers=64, n_heads=40, n_kv_heads=8,
                   mlp_hidden=27648, max_sequence_length=65536, yarn_factor=8.0)
