"""Model configuration and presets for the OLMo 2 / OLMo 3 decoder.

Follows OLMo-core's shape: one ``ModelConfig`` dataclass, presets as classmethods, and derived
quantities (``head_dim``, per-layer attention windows) computed, never stored twice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from olmoflow.errors import OlmoflowError, closest

# The dolma2 tokenizer's 100,278 tokens padded to a multiple of 128, as in every official OLMo 2/3.
# LoRA targets (model/lora.py): short name -> our module name (the Hugging Face name in the
# comment).
LORA_TARGETS = {
    "q": "w_q",  # self_attn.q_proj
    "k": "w_k",  # self_attn.k_proj
    "v": "w_v",  # self_attn.v_proj
    "o": "w_out",  # self_attn.o_proj
    "gate": "w1",  # mlp.gate_proj
    "up": "w3",  # mlp.up_proj
    "down": "w2",  # mlp.down_proj
}
# Also accepted in ``targets``: the Hugging Face names and our module names.
LORA_TARGET_ALIASES = {
    **{f"{k}_proj": k for k in LORA_TARGETS}, **{v: k for k, v in LORA_TARGETS.items()},
}
OLMO_VOCAB_SIZE = 100_352


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

    Raises:
        OlmoflowError: an inconsistent or out-of-range field, named (see :meth:`validate`).
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
        """Raise :class:`OlmoflowError` naming the first inconsistent field.

        Checked at load, so a value that would crash later (a zero divisor) or train a NaN model
        (a NaN RoPE base, a non-positive norm epsilon) is refused before anything runs.
        """
        if self.d_model <= 0 or self.n_layers <= 0 or self.n_heads <= 0 or self.mlp_hidden <= 0:
            raise OlmoflowError("model: d_model, n_layers, n_heads and mlp_hidden must be positive")
        for name in ("n_kv_heads", "vocab_pad_multiple", "full_attention_every"):
            if getattr(self, name) < 1:
                raise OlmoflowError(f"model.{name} must be at least 1, got {getattr(self, name)}")
        if self.head_dim is not None and self.head_dim < 1:
            raise OlmoflowError(f"model.head_dim must be at least 1 (or null), got {self.head_dim}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise OlmoflowError(f"model.{name} must be a finite number > 0, got {value}")
        # Written so that NaN fails too; p=1 would zero every residual branch.
        if not 0.0 <= self.dropout < 1.0:
            raise OlmoflowError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise OlmoflowError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                "set model.head_dim"
            )
        if self.n_heads % self.n_kv_heads:
            raise OlmoflowError(
                f"model.n_heads={self.n_heads} is not a multiple of "
                f"model.n_kv_heads={self.n_kv_heads}"
            )
        if self.hd % 2:
            raise OlmoflowError(f"model.head_dim={self.hd} must be even for RoPE")
        if self.attention_backend not in ("sdpa", "eager", "flex", "flash"):
            raise OlmoflowError(
                f"model.attention_backend='{self.attention_backend}' is not one of: "
                "sdpa, eager, flex, flash"
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
        """``tokenizer_vocab`` rounded up to a multiple of ``vocab_pad_multiple`` (OLMo pads
        100,278 to 100,352)."""
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

    # ---- Presets (OLMo-core style names; the registry is PRESETS, below the class) ----
    # Official shapes: the OLMo 2 / OLMo 3 Hugging Face config.json files (allenai/OLMo-2-0425-1B,
    # OLMo-2-1124-7B, OLMo-2-1124-13B, OLMo-2-0325-32B, Olmo-3-1025-7B, Olmo-3-1125-32B) and
    # OLMo-core's ``TransformerConfig.olmo2_*`` / ``olmo3_*``. Vocab: the dolma2 tokenizer's 100,278
    # tokens padded to 100,352. head_dim 128 for every official size.

    @classmethod
    def _olmo2(cls, d_model: int, n_layers: int, n_heads: int, mlp_hidden: int,
               n_kv_heads: int | None = None) -> ModelConfig:
        """OLMo 2: full attention on every layer, RoPE theta 500,000, 4,096-token context."""
        return cls(vocab_size=OLMO_VOCAB_SIZE, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                   n_kv_heads=n_kv_heads, mlp_hidden=mlp_hidden, max_sequence_length=4096,
                   sliding_window=None)

    @classmethod
    def _olmo3(cls, d_model: int, n_layers: int, n_heads: int, mlp_hidden: int,
               n_kv_heads: int | None = None) -> ModelConfig:
        """OLMo 3 (long-context release): 4,096-token sliding windows except every 4th and the last
        layer; YaRN (factor 8 over the original 8,192) on the full layers; 65,536-token context."""
        return cls(vocab_size=OLMO_VOCAB_SIZE, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                   n_kv_heads=n_kv_heads, mlp_hidden=mlp_hidden, max_sequence_length=65536,
                   sliding_window=4096, full_attention_every=4, yarn_factor=8.0,
                   yarn_original_max_length=8192)

    @classmethod
    def _ladder(cls, d_model: int, n_layers: int) -> ModelConfig:
        """A small OLMo 3-architecture model for experiments (scaling ladders).

        head_dim 64, MLP 4 x d_model, so each block has ~16 d_model^2 parameters; the name counts
        the NON-embedding parameters (blocks + final norm), which is what scaling laws use. Sliding
        windows of 4,096 as OLMo 3, 8,192-token context (OLMo 3's pretraining length), no YaRN.
        """
        return cls(vocab_size=OLMO_VOCAB_SIZE, d_model=d_model, n_layers=n_layers,
                   n_heads=d_model // 64, mlp_hidden=4 * d_model, max_sequence_length=8192,
                   sliding_window=4096, full_attention_every=4)

    @classmethod
    def olmo2_1b(cls) -> ModelConfig:
        """OLMo-2-0425-1B: 1,484,916,736 parameters (1,073,874,944 non-embedding)."""
        return cls._olmo2(2048, 16, 16, 8192)

    @classmethod
    def olmo2_7b(cls) -> ModelConfig:
        """OLMo-2-1124-7B: 7,298,617,344 parameters."""
        return cls._olmo2(4096, 32, 32, 11008)

    @classmethod
    def olmo2_13b(cls) -> ModelConfig:
        """OLMo-2-1124-13B: 13,716,198,400 parameters."""
        return cls._olmo2(5120, 40, 40, 13824)

    @classmethod
    def olmo2_32b(cls) -> ModelConfig:
        """OLMo-2-0325-32B: 32,234,279,936 parameters (GQA: 40 query heads, 8 KV heads)."""
        return cls._olmo2(5120, 64, 40, 27648, n_kv_heads=8)

    @classmethod
    def olmo3_7b(cls) -> ModelConfig:
        """Olmo-3-7B: the OLMo 2 7B shape with OLMo 3 attention (7,298,617,344 parameters)."""
        return cls._olmo3(4096, 32, 32, 11008)

    @classmethod
    def olmo3_32b(cls) -> ModelConfig:
        """Olmo-3-32B: the OLMo 2 32B shape with OLMo 3 attention (32,234,279,936 parameters)."""
        return cls._olmo3(5120, 64, 40, 27648, n_kv_heads=8)

    @classmethod
    def olmo3_14m(cls) -> ModelConfig:
        """~14M non-embedding parameters: d_model 384, 6 layers, 6 heads, MLP 1536."""
        return cls._ladder(384, 6)

    @classmethod
    def olmo3_60m(cls) -> ModelConfig:
        """~60M non-embedding parameters: d_model 512, 14 layers, 8 heads, MLP 2048."""
        return cls._ladder(512, 14)

    @classmethod
    def olmo3_190m(cls) -> ModelConfig:
        """~190M non-embedding parameters: d_model 768, 20 layers, 12 heads, MLP 3072."""
        return cls._ladder(768, 20)

    @classmethod
    def olmo3_370m(cls) -> ModelConfig:
        """~370M non-embedding parameters: d_model 1024, 22 layers, 16 heads, MLP 4096."""
        return cls._ladder(1024, 22)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """The preset ``name`` (see :data:`PRESETS`) with field overrides.

        Raises:
            OlmoflowError: unknown preset (naming the closest one) or an inconsistent override.
        """
        return get_preset(name, **overrides)


# The registry lives beside the classmethods it names, so a config never imports the modules
# built on it (presets.py describes models and needs the model itself).
PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "olmo2_1b": ModelConfig.olmo2_1b,
    "olmo2_7b": ModelConfig.olmo2_7b,
    "olmo2_13b": ModelConfig.olmo2_13b,
    "olmo2_32b": ModelConfig.olmo2_32b,
    "olmo3_7b": ModelConfig.olmo3_7b,
    "olmo3_32b": ModelConfig.olmo3_32b,
    "olmo3_14m": ModelConfig.olmo3_14m,
    "olmo3_60m": ModelConfig.olmo3_60m,
    "olmo3_190m": ModelConfig.olmo3_190m,
    "olmo3_370m": ModelConfig.olmo3_370m,
}


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` of preset ``name`` (case-insensitive, ``-`` same as ``_``).

    Raises:
        OlmoflowError: unknown name, naming the closest preset; or invalid ``overrides``.
    """
    key = name.strip().lower().replace("-", "_")
    if key not in PRESETS:
        hint = closest(key, PRESETS)
        msg = f"unknown model preset '{name}'"
        msg += f"; did you mean '{hint}'?" if hint else f"; valid: {', '.join(PRESETS)}"
        raise OlmoflowError(msg)
    cfg = PRESETS[key]()
    if overrides:
        unknown = set(overrides) - set(cfg.to_dict())
        if unknown:
            raise OlmoflowError(f"unknown ModelConfig field(s): {', '.join(sorted(unknown))}")
        cfg = replace(cfg, **overrides)  # re-runs validation
    return cfg
