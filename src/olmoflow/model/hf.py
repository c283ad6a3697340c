"""Conversion between olmoflow's :class:`Olmo` and the Hugging Face OLMo 2/3 format.

Hugging Face names appear only here. A saved directory holds ``config.json`` (``model_type``
``olmo3``, or ``olmo2`` when there are no sliding windows), ``model.safetensors`` (or shards with
``model.safetensors.index.json`` when loading) and ``generation_config.json``; ``transformers``'
``AutoModelForCausalLM`` loads it as is.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from olmoflow.artifacts import atomic_path, atomic_write_json
from olmoflow.errors import OlmoflowError
from olmoflow.model.config import ModelConfig

# (our name pattern, HF name pattern); {i} is the layer index.
_NAMES = [
    ("embeddings.weight", "model.embed_tokens.weight"),
    ("blocks.{i}.attention.w_q.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("blocks.{i}.attention.w_k.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("blocks.{i}.attention.w_v.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("blocks.{i}.attention.w_out.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("blocks.{i}.attention.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("blocks.{i}.attention.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    ("blocks.{i}.attention_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("blocks.{i}.feed_forward_norm.weight", "model.layers.{i}.post_feedforward_layernorm.weight"),
    ("blocks.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("blocks.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("blocks.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
]


def _translate(name: str, table: list[tuple[str, str]]) -> str | None:
    for src, dst in table:
        pattern = "^" + re.escape(src).replace(r"\{i\}", r"(\d+)") + "$"
        m = re.match(pattern, name)
        if m:
            return dst.replace("{i}", m.group(1)) if m.groups() else dst
    return None


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip wrapper prefixes (``_orig_mod.`` from torch.compile, ``module.`` from DDP)."""
    out = {}
    for k, v in state.items():
        k = k.replace("_orig_mod.", "")
        while k.startswith("module."):
            k = k[len("module."):]
        out[k] = v
    return out


def to_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename our parameters to Hugging Face's ``Olmo3ForCausalLM`` names."""
    out = {}
    for k, v in clean_state_dict(state).items():
        hf = _translate(k, _NAMES)
        if hf is None:
            raise KeyError(f"no Hugging Face name for parameter '{k}'")
        out[hf] = v.contiguous()
    return out


def from_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename Hugging Face OLMo 2/3 parameters to ours (rotary buffers are dropped)."""
    reverse = [(dst, src) for src, dst in _NAMES]
    out = {}
    for k, v in state.items():
        if "rotary_emb" in k:
            continue
        ours = _translate(k, reverse)
        if ours is None:
            raise OlmoflowError(f"unexpected weight '{k}' in a Hugging Face OLMo checkpoint")
        out[ours] = v
    return out


def hf_config(cfg: ModelConfig, *, eos_token_id: int | None = None, pad_token_id: int | None = None,
              dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` dict for ``cfg`` (OLMo 3 when it has sliding windows, else OLMo 2)."""
    olmo3 = bool(cfg.sliding_window)
    d: dict[str, Any] = {
        "architectures": ["Olmo3ForCausalLM" if olmo3 else "Olmo2ForCausalLM"],
        "model_type": "olmo3" if olmo3 else "olmo2",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.hd,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_sequence_length,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "bos_token_id": None,
        "torch_dtype": dtype,
    }
    if olmo3:
        d["sliding_window"] = cfg.sliding_window
        d["layer_types"] = [
            "full_attention" if cfg.is_full_attention(i) else "sliding_attention"
            for i in range(cfg.n_layers)
        ]
        if cfg.yarn_factor:
            d["rope_scaling"] = {
                "rope_type": "yarn", "factor": cfg.yarn_factor,
                "original_max_position_embeddings": cfg.yarn_original_max_length,
            }
    return d


def model_config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """Build a :class:`ModelConfig` from an OLMo 2/3 ``config.json`` dict."""
    mt = d.get("model_type")
    if mt not in ("olmo2", "olmo3"):
        raise OlmoflowError(f"config.json model_type '{mt}' is not supported (expected olmo2 or olmo3)")
    layer_types = d.get("layer_types")
    rope = d.get("rope_scaling") or (d.get("rope_parameters") or {}).get("full_attention") or {}
    theta = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("full_attention", {}).get(
        "rope_theta", 500_000.0)
    yarn = rope.get("factor") if rope.get("rope_type", rope.get("type")) == "yarn" else None
    every = 4
    if layer_types:
        full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        every = full[0] + 1 if full else len(layer_types) + 1
    cfg = ModelConfig(
        vocab_size=d["vocab_size"], d_model=d["hidden_size"], n_layers=d["num_hidden_layers"],
        n_heads=d["num_attention_heads"], n_kv_heads=d.get("num_key_value_heads"),
        head_dim=d.get("head_dim"), mlp_hidden=d["intermediate_size"],
        max_sequence_length=d.get("max_position_embeddings", 4096), rope_theta=float(theta),
        sliding_window=d.get("sliding_window") if mt == "olmo3" else None,
        full_attention_every=every, yarn_factor=yarn,
        yarn_original_max_length=rope.get("original_max_position_embeddings", 8192),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6), init_std=d.get("initializer_range", 0.02),
    )
    if layer_types and [cfg.is_full_attention(i) for i in range(cfg.n_layers)] != [
        t == "full_attention" for t in layer_types
    ]:
        raise OlmoflowError(f"config.json layer_types {layer_types} is not an OLMo 3 pattern")
    return cfg


def save_hf_dir(model, path: str | Path, *, eos_token_id: int | None = None,
                pad_token_id: int | None = None, dtype: torch.dtype | None = None) -> list[Path]:
    """Write ``config.json``, ``generation_config.json`` and ``model.safetensors`` into ``path``.

    Returns the files written. Weights keep the model's dtype unless ``dtype`` is given.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if dtype else v).detach().cpu() for k, v in model.state_dict().items()}
    hf_state = to_hf_state_dict(state)
    dt = str(next(iter(hf_state.values())).dtype).removeprefix("torch.")
    with atomic_path(path / "model.safetensors") as tmp:
        save_file(hf_state, str(tmp), metadata={"format": "pt"})
    atomic_write_json(path / "config.json", hf_config(model.config, eos_token_id=eos_token_id,
                                                      pad_token_id=pad_token_id, dtype=dt))
    gen = {"eos_token_id": eos_token_id, "pad_token_id": pad_token_id, "do_sample": False}
    atomic_write_json(path / "generation_config.json", gen)
    return [path / "config.json", path / "generation_config.json", path / "model.safetensors"]


def load_hf_dir(path: str | Path, *, device="cpu", dtype: torch.dtype | None = None):
    """Load a local Hugging Face OLMo 2/3 directory (single or sharded safetensors) as :class:`Olmo`."""
    from olmoflow.model.olmo import Olmo

    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise OlmoflowError(f"no config.json in '{path}' (expected a Hugging Face model directory)")
    cfg = model_config_from_hf(json.loads(cfg_path.read_text()))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise OlmoflowError(f"no model.safetensors (or index) in '{path}'")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(path / f)))
    state = from_hf_state_dict(state)
    with torch.device("meta"):
        model = Olmo(cfg)
    load_dtype = dtype or next(iter(state.values())).dtype
    model = model.to_empty(device=device).to(load_dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise OlmoflowError(f"checkpoint in '{path}' does not match its config: missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]}")
    return model.eval()
