"""The model presets and ``olmoflow model info``.

``PRESETS`` (defined beside :class:`ModelConfig`, re-exported here) maps OLMo-core-style names to
:class:`ModelConfig` classmethods:

=============  ==========================================================================
olmo2_1b       OLMo-2-0425-1B   d_model 2048, 16 layers, 16 heads, MLP 8192
olmo2_7b       OLMo-2-1124-7B   d_model 4096, 32 layers, 32 heads, MLP 11008
olmo2_13b      OLMo-2-1124-13B  d_model 5120, 40 layers, 40 heads, MLP 13824
olmo2_32b      OLMo-2-0325-32B  d_model 5120, 64 layers, 40 heads / 8 KV heads, MLP 27648
olmo3_7b       Olmo-3-7B        the 7B shape, sliding windows 4096 + YaRN on full layers
olmo3_32b      Olmo-3-32B       the 32B shape, sliding windows 4096 + YaRN on full layers
olmo3_14m ..   ladder sizes for experiments; the number counts NON-embedding parameters
olmo3_370m
=============  ==========================================================================

Parameter counts are taken from a model built on the meta device (no memory is allocated), and
agree with the closed form :meth:`ModelConfig.num_params`.
"""

from __future__ import annotations

import torch

from olmoflow.model.config import PRESETS, ModelConfig, get_preset
from olmoflow.model.olmo import Olmo

__all__ = ["PRESETS", "format_info", "get_preset", "info_rows", "meta_param_counts"]


def meta_param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts of ``Olmo(cfg)`` built on the meta device (nothing is allocated).

    Returns ``{"total", "embedding", "non_embedding"}``; ``embedding`` counts the input embedding
    and the (untied) LM head, ``non_embedding`` everything else (blocks + final norm).
    """
    with torch.device("meta"):
        model = Olmo(cfg)
    total = emb = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if name in ("embeddings.weight", "lm_head.weight"):
            emb += p.numel()
    return {"total": total, "embedding": emb, "non_embedding": total - emb}


def _human(n: float, unit: str = "") -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}{unit}"
    return f"{n:g}{unit}"


def info_rows(cfg: ModelConfig) -> list[tuple[str, str]]:
    """``(field, value)`` rows describing ``cfg``: shape, attention pattern, parameters (counted on
    the meta device) and the memory of its weights in bf16 (2 bytes per parameter, GiB = 2**30)."""
    counts = meta_param_counts(cfg)
    full = [i for i in range(cfg.n_layers) if cfg.is_full_attention(i)]
    if cfg.sliding_window:
        window = (f"{cfg.sliding_window} on {cfg.n_layers - len(full)} layers; full on "
                  f"{len(full)} ({', '.join(map(str, full))})")
    else:
        window = f"none (full attention on all {cfg.n_layers} layers)"
    rope = f"theta {cfg.rope_theta:g}"
    if cfg.yarn_factor:
        rope += f"; YaRN x{cfg.yarn_factor:g} from {cfg.yarn_original_max_length} on full layers"
    gib = counts["total"] * 2 / 2**30
    return [
        ("architecture", "OLMo 3" if cfg.sliding_window else "OLMo 2"),
        ("d_model", str(cfg.d_model)),
        ("n_layers", str(cfg.n_layers)),
        ("n_heads", str(cfg.n_heads)),
        ("n_kv_heads", str(cfg.n_kv_heads) + (" (GQA)" if cfg.n_kv_heads < cfg.n_heads else "")),
        ("head_dim", str(cfg.hd)),
        ("mlp_hidden", str(cfg.mlp_hidden)),
        ("vocab_size", str(cfg.vocab_size)),
        ("max_sequence_length", str(cfg.max_sequence_length)),
        ("sliding_window", window),
        ("rope", rope),
        ("params total", f"{counts['total']:,} ({_human(counts['total'])})"),
        ("params non-embedding",
         f"{counts['non_embedding']:,} ({_human(counts['non_embedding'])})"),
        ("params embedding", f"{counts['embedding']:,} (input embedding + untied LM head)"),
        ("bf16 weights", f"{gib:.2f} GiB"),
    ]


def format_info(name: str, cfg: ModelConfig) -> str:
    """A two-column markdown table of :func:`info_rows` headed by the preset name."""
    rows = info_rows(cfg)
    w = max(len(k) for k, _ in rows)
    lines = [f"| {name:<{w}} | value |", f"|{'-' * (w + 2)}|-------|"]
    lines += [f"| {k:<{w}} | {v} |" for k, v in rows]
    return "\n".join(lines)
