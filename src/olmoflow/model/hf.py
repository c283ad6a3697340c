"""Conversion between olmoflow's :class:`Olmo` and the Hugging Face OLMo 2/3 format.

Hugging Face names appear only here. A saved directory holds ``config.json`` (``model_type``
``olmo3``, or ``olmo2`` when there are no sliding windows), ``model.safetensors`` (or shards with
``model.safetensors.index.json`` when loading) and ``generation_config.json``; ``transformers``'
``AutoModelForCausalLM`` loads it as is.

Loading accepts what ``transformers`` 4 and 5 write: ``rope_theta``/``rope_scaling`` or
``rope_parameters`` (flat, or per layer type), sharded or single-file safetensors, any float dtype
(kept unless ``dtype=`` is given). Saving strips ``torch.compile`` (``_orig_mod.``) and DDP
(``module.``) prefixes. Reference: ``transformers/models/olmo3/{configuration,modeling}_olmo3.py``.

This module converts configs and state dicts and never builds a model: :class:`Olmo` imports it
(``from_pretrained``, ``save_pretrained``), so the imports point one way.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
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
    """Strip wrapper prefixes: ``_orig_mod.`` (torch.compile) and ``module.`` (DDP/FSDP1), at any
    nesting (``module._orig_mod.x`` and ``_orig_mod.module.x`` both become ``x``)."""
    out = {}
    for k, v in state.items():
        parts = [p for p in k.split(".") if p != "_orig_mod"]
        while parts and parts[0] == "module":
            parts = parts[1:]
        out[".".join(parts)] = v
    return out


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The bare :class:`Olmo` inside ``torch.compile`` (``_orig_mod``) and DDP (``module``)
    wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif (isinstance(getattr(model, "module", None), torch.nn.Module)
              and not hasattr(model, "config")):
            model = model.module
        else:
            return model


#: what a bitsandbytes int8 linear saves beside its int8 ``weight``: the fp32 absmax of each
#: output row, and the layout of the weight (0: rows), as ``transformers`` saves them.
INT8_EXTRAS = ("SCB", "weight_format")


def _translate_any(name: str, table: list[tuple[str, str]]) -> str | None:
    """:func:`_translate`, where a linear's :data:`INT8_EXTRAS` follow its weight's name."""
    base, _, last = name.rpartition(".")
    if last in INT8_EXTRAS:
        weight = _translate(f"{base}.weight", table)
        return None if weight is None else weight.removesuffix("weight") + last
    return _translate(name, table)


def to_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename our parameters to Hugging Face's ``Olmo3ForCausalLM`` names."""
    out = {}
    for k, v in clean_state_dict(state).items():
        hf = _translate_any(k, _NAMES)
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
        ours = _translate_any(k, reverse)
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


def _get(d: dict[str, Any], key: str, default: Any) -> Any:
    """``d[key]``, or ``default`` when it is absent or null (as transformers reads a config)."""
    v = d.get(key)
    return default if v is None else v


def _rope_entries(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(sliding, full)`` RoPE parameter dicts from either config style.

    transformers < 5 writes ``rope_theta`` + ``rope_scaling`` (scaling on full layers for OLMo 3);
    transformers 5 writes ``rope_parameters``: flat (``{"rope_type", "rope_theta", ...}``, every
    layer) or per layer type (``{"full_attention": {...}, "sliding_attention": {...}}``).
    """
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params:
        if "full_attention" in params or "sliding_attention" in params:
            full = dict(params.get("full_attention") or params.get("sliding_attention"))
            sliding = dict(params.get("sliding_attention") or full)
        else:
            full = dict(params)
            sliding = {"rope_type": "default", "rope_theta": params.get("rope_theta")}
    else:
        full = dict(d.get("rope_scaling") or {})
        sliding = {}
    for e in (full, sliding):
        if e.get("rope_theta") is None:
            e["rope_theta"] = _get(d, "rope_theta", 500_000.0)
        e["rope_type"] = e.get("rope_type", e.get("type", "default"))
    return sliding, full


# config.json keys that must be positive integers, and those that may be absent, null or 0.
_REQUIRED_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads")
_OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window",
                  "original_max_position_embeddings")
# Positions the RoPE tables and the KV cache may be built for: 16M, far past any released model
# (OLMo 3: 65,536), and small enough that a hand-edited value cannot allocate terabytes.
_MAX_POSITIONS = 1 << 24
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_config_values(d: Any) -> None:
    """Raise :class:`OlmoflowError` naming the first key of an OLMo config dict that is missing
    or of the wrong type, before any of it is used."""
    if not isinstance(d, dict):
        raise OlmoflowError(f"config.json holds a JSON {type(d).__name__}, not an object")
    for key in (*_REQUIRED_INTS, *_OPTIONAL_INTS):
        v = d.get(key)
        if v is None and key in _OPTIONAL_INTS:
            continue
        if key not in d:
            raise OlmoflowError(f"config.json has no '{key}'")
        least = 1 if key in _REQUIRED_INTS else 0
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            kind = "a positive" if least else "a non-negative"
            raise OlmoflowError(f"config.json '{key}' must be {kind} integer, not {_short(v)}")
    for key in ("max_position_embeddings", "original_max_position_embeddings"):
        if (d.get(key) or 0) > _MAX_POSITIONS:
            raise OlmoflowError(f"config.json '{key}'={d[key]} is over {_MAX_POSITIONS}")
    for key in ("rope_theta", "rms_norm_eps", "initializer_range"):
        v = d.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)
                              or not math.isfinite(v) or v < 0):
            raise OlmoflowError(f"config.json '{key}' must be a non-negative number, "
                                f"not {_short(v)}")
    for key in ("rope_parameters", "rope_scaling"):
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise OlmoflowError(f"config.json '{key}' must be an object, not {_short(d[key])}")
    layer_types = d.get("layer_types")
    if d.get("model_type") == "olmo3" and layer_types is not None and (
            not isinstance(layer_types, list) or len(layer_types) != d["num_hidden_layers"]
            or not all(isinstance(t, str) for t in layer_types)):
        raise OlmoflowError(f"config.json 'layer_types' must be a list of "
                            f"num_hidden_layers={d['num_hidden_layers']} strings")


def model_config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """Build a :class:`ModelConfig` from an OLMo 2/3 ``config.json`` dict.

    Accepts both the transformers 4 (``rope_theta``/``rope_scaling``) and the transformers 5
    (``rope_parameters``, flat or per layer type) styles. ``head_dim`` defaults to
    ``hidden_size // num_attention_heads`` as in transformers.

    Raises:
        OlmoflowError: not a JSON object, a shape key missing or not a positive integer (sizes
            beyond any model bounded), not OLMo 2/3, tied embeddings, a RoPE variant other than
            default/YaRN (or YaRN with non-default ``beta_fast``/``beta_slow``/
            ``attention_factor``), or a ``layer_types`` pattern other than OLMo 3's.
    """
    _check_config_values(d)
    mt = d.get("model_type")
    if mt not in ("olmo2", "olmo3"):
        raise OlmoflowError(
            f"config.json model_type '{mt}' is not supported (expected olmo2 or olmo3)")
    if d.get("tie_word_embeddings"):
        raise OlmoflowError(
            "config.json has tie_word_embeddings=true; OLMo 2/3 use an untied LM head")
    layer_types = d.get("layer_types") if mt == "olmo3" else None
    sliding_rope, rope = _rope_entries(d)
    yarn = None
    for e in (sliding_rope, rope):
        if e["rope_type"] not in ("default", "yarn"):
            raise OlmoflowError(f"config.json RoPE type '{e['rope_type']}' is not supported "
                                "(expected default or yarn)")
    if sliding_rope["rope_type"] != "default" and mt == "olmo3":
        raise OlmoflowError("config.json scales RoPE on sliding-window layers; OLMo 3 scales full "
                            "layers only")
    if sliding_rope["rope_theta"] != rope["rope_theta"]:
        raise OlmoflowError("config.json uses different rope_theta per layer type; not supported")
    if rope["rope_type"] == "yarn":
        yarn = float(rope["factor"])
        default_mscale = 0.1 * math.log(yarn) + 1.0 if yarn > 1 else 1.0
        af = rope.get("attention_factor")
        if (rope.get("beta_fast", 32) != 32 or rope.get("beta_slow", 1) != 1
                or (af is not None and abs(af - default_mscale) > 1e-6)):
            raise OlmoflowError("config.json YaRN uses non-default beta_fast/beta_slow/"
                                "attention_factor; not supported")
    every = 4
    if layer_types:
        full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        every = full[0] + 1 if full else len(layer_types) + 1
    heads = d["num_attention_heads"]
    head_dim = d.get("head_dim")
    if head_dim == d["hidden_size"] // heads and d["hidden_size"] % heads == 0:
        head_dim = None  # the default; keeps configs equal across a round trip
    cfg = ModelConfig(
        vocab_size=d["vocab_size"], d_model=d["hidden_size"], n_layers=d["num_hidden_layers"],
        n_heads=heads, n_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=head_dim, mlp_hidden=d["intermediate_size"],
        max_sequence_length=_get(d, "max_position_embeddings", 4096),
        rope_theta=float(rope["rope_theta"]),
        sliding_window=d.get("sliding_window") if mt == "olmo3" else None,
        full_attention_every=every, yarn_factor=yarn,
        yarn_original_max_length=rope.get("original_max_position_embeddings")
        or d.get("original_max_position_embeddings") or 8192,
        rms_norm_eps=_get(d, "rms_norm_eps", 1e-6), init_std=_get(d, "initializer_range", 0.02),
    )
    if layer_types and [cfg.is_full_attention(i) for i in range(cfg.n_layers)] != [
        t == "full_attention" for t in layer_types
    ]:
        raise OlmoflowError(f"config.json layer_types {layer_types} is not an OLMo 3 pattern")
    return cfg


# Packages whose tensor types hold quantized weights (int8 data plus scales, or a subclass that
# dequantizes on the fly): bitsandbytes ``Int8Params``, torchao ``Int8Tensor`` and kin.
_QUANTIZED_PACKAGES = ("bitsandbytes", "torchao")


def quantized_weight(model: torch.nn.Module) -> str | None:
    """Describe the first quantized parameter of ``model`` (``"blocks.0.attention.w_q.weight is a
    bitsandbytes Int8Params"``), or None when every parameter is a plain float tensor.

    A parameter is quantized when its type comes from bitsandbytes or torchao, or when it is not a
    floating-point tensor (an Olmo has no integer parameters or buffers of its own).
    """
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        package = type(t).__module__.split(".")[0]
        if package in _QUANTIZED_PACKAGES or not t.is_floating_point():
            # torchao's subclasses report the dtype they dequantize to: name the type instead
            kind = (f"{package} {type(t).__name__}" if package in _QUANTIZED_PACKAGES
                    else f"{str(t.dtype).removeprefix('torch.')} tensor")
            return f"{name} is a {kind}"
    return None


def int8_linears(model: torch.nn.Module) -> dict[str, float]:
    """``{name: outlier threshold}`` of the model's bitsandbytes int8 linears (``Linear8bitLt``),
    by dotted name; empty without such layers."""
    return {name: float(m.state.threshold) for name, m in model.named_modules()
            if type(m).__name__ == "Linear8bitLt"
            and type(m).__module__.split(".")[0] == "bitsandbytes"}


def _unsaveable(model: torch.nn.Module, int8: dict[str, float]) -> str | None:
    """What makes a quantized ``model`` unsaveable (:func:`quantized_weight`'s words), or None:
    only bitsandbytes int8 linears of one threshold save."""
    if len(set(int8.values())) > 1:
        return f"its int8 linears have different outlier thresholds {sorted(set(int8.values()))}"
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.rpartition(".")[0] in int8 and name.endswith(".weight") \
                and type(t).__name__ == "Int8Params" and t.dtype == torch.int8:
            continue
        package = type(t).__module__.split(".")[0]
        if package in _QUANTIZED_PACKAGES or not t.is_floating_point():
            return quantized_weight(model)
    return None


def int8_quantization_config(threshold: float, skip: list[str]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` of a bitsandbytes int8 model, as
    ``transformers``' ``BitsAndBytesConfig(load_in_8bit=True)`` writes it; ``skip``: the HF
    names of the linears left in full precision (``lm_head``)."""
    return {"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False,
            "llm_int8_threshold": threshold, "llm_int8_skip_modules": skip,
            "llm_int8_has_fp16_weight": False, "llm_int8_enable_fp32_cpu_offload": False}


def saved_int8_threshold(raw: dict[str, Any], cfg_path: Path) -> float | None:
    """The outlier threshold of a saved bitsandbytes int8 model (``quantization_config`` of its
    ``config.json``, as read in ``raw``), or None when it is not quantized.

    Raises:
        OlmoflowError: a ``quantization_config`` of another kind (only bitsandbytes 8-bit loads).
    """
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict) or q.get("quant_method") != "bitsandbytes" \
            or q.get("load_in_8bit") is not True or q.get("load_in_4bit"):
        shown = q.get("quant_method") if isinstance(q, dict) else type(q).__name__
        raise OlmoflowError(f"{cfg_path}: quantization_config {shown!r} is not supported "
                            "(olmoflow loads bitsandbytes 8-bit, quant_method 'bitsandbytes' with "
                            "load_in_8bit true)")
    threshold = q.get("llm_int8_threshold", 6.0)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold < 0:
        raise OlmoflowError(f"{cfg_path}: quantization_config.llm_int8_threshold must be a "
                            f"number >= 0, got {threshold!r}")
    return float(threshold)


def int8_threshold_of(path: str | Path) -> float | None:
    """:func:`saved_int8_threshold` of the directory ``path`` (read after :func:`read_hf_dir`
    checked its ``config.json``)."""
    cfg_path = Path(path) / "config.json"
    return saved_int8_threshold(json.loads(cfg_path.read_text(encoding="utf-8")), cfg_path)


def save_hf_dir(model, path: str | Path, *, eos_token_id: int | None = None,
                pad_token_id: int | None = None, dtype: torch.dtype | None = None) -> list[Path]:
    """Write ``config.json``, ``generation_config.json`` and ``model.safetensors`` into ``path``.

    ``model`` may be wrapped by ``torch.compile`` or DDP; saved names never carry ``_orig_mod.`` or
    ``module.``. Weights keep the model's dtype unless ``dtype`` is given. Each file is written
    atomically (for a whole directory written atomically see
    :func:`olmoflow.release.export.export_hf`). Returns the files written.

    A bitsandbytes int8 model (``load_in_8bit=True``) saves as ``transformers`` saves one: each
    int8 linear's ``weight`` (int8) with its ``SCB`` (fp32 row scales) and ``weight_format``,
    the other weights in float (``dtype`` applies to those), and ``quantization_config`` in
    ``config.json``; it loads back bit-identically.

    Raises:
        OlmoflowError: the model is quantized otherwise (torchao), checked before anything is
            created: its tensor subclasses have no safetensors layout that ``transformers``
            reads, and dequantizing them would save the rounding error as if it were the model.
            Save the unquantized model and quantize when loading.
    """
    path = Path(path)
    bare = unwrap_model(model)
    int8 = int8_linears(bare)
    quantized = _unsaveable(bare, int8) if quantized_weight(bare) is not None else None
    if quantized is not None:
        raise OlmoflowError(
            f"cannot save a quantized model ({quantized}): save the unquantized model and "
            "quantize when loading it (Olmo.from_pretrained(dir, load_in_8bit=True) or "
            "quantization='torchao'); a bitsandbytes int8 model saves as it is")
    path.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if dtype and v.is_floating_point()
                 and k.rpartition(".")[2] not in INT8_EXTRAS else v).detach().cpu()
             for k, v in model.state_dict().items()}
    hf_state = to_hf_state_dict(state)
    dt = str(hf_state["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    with atomic_path(path / "model.safetensors") as tmp:
        save_file(hf_state, str(tmp), metadata={"format": "pt"})
    config = hf_config(bare.config, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                       dtype=dt)
    if int8:
        skip = [_translate(f"{n}.weight", _NAMES).removesuffix(".weight")
                for n, m in bare.named_modules()
                if isinstance(m, torch.nn.Linear) and n not in int8]
        config["quantization_config"] = int8_quantization_config(next(iter(int8.values())), skip)
    atomic_write_json(path / "config.json", config)
    gen = {"eos_token_id": eos_token_id, "pad_token_id": pad_token_id, "do_sample": False}
    atomic_write_json(path / "generation_config.json", gen)
    return [path / "config.json", path / "generation_config.json", path / "model.safetensors"]


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [path / f for f in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise OlmoflowError(f"'{index}' is not a safetensors index "
                                f"({type(e).__name__}: {e})") from None
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        raise OlmoflowError(f"no model.safetensors (or model.safetensors.index.json) in '{path}'")
    for f in files:
        if not f.is_file():
            raise OlmoflowError(f"'{f}' (named in the safetensors index) is missing")
    return files


def _read_headers(files: list[Path]) -> dict[str, tuple[tuple[int, ...], str, Path]]:
    """``{name: (shape, dtype, file)}`` of every tensor in ``files``, from the safetensors headers
    alone (no tensor data is read).

    Raises:
        OlmoflowError: a file that is not a complete safetensors file (truncated, a damaged
            header, garbage), or a tensor name in two shards.
    """
    out: dict[str, tuple[tuple[int, ...], str, Path]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    if k in out:
                        raise OlmoflowError(f"'{f}': weight '{k}' is also in '{out[k][2]}'")
                    sl = st.get_slice(k)
                    out[k] = (tuple(sl.get_shape()), sl.get_dtype(), f)
        except (SafetensorError, OSError) as e:
            raise OlmoflowError(f"'{f}' is not a readable safetensors file "
                                f"({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                                ) from None
    return out


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Hugging Face name and shape of every weight of an OLMo 2/3 model of shape ``cfg`` (the
    shapes :class:`olmoflow.model.olmo.Olmo` builds, worked out without building it)."""
    d, hidden, v = cfg.d_model, cfg.mlp_hidden, cfg.vocab_size
    q, kv = cfg.n_heads * cfg.hd, cfg.n_kv_heads * cfg.hd
    layer = {
        "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
        "self_attn.q_norm.weight": (q,), "self_attn.k_norm.weight": (kv,),
        "post_attention_layernorm.weight": (d,), "post_feedforward_layernorm.weight": (d,),
        "mlp.gate_proj.weight": (hidden, d), "mlp.up_proj.weight": (hidden, d),
        "mlp.down_proj.weight": (d, hidden),
    }
    out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
           "lm_head.weight": (v, d)}
    for i in range(cfg.n_layers):
        out.update({f"model.layers.{i}.{k}": shape for k, shape in layer.items()})
    return out


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _check_weights(cfg: ModelConfig, header: dict[str, tuple[tuple[int, ...], str, Path]],
                   cfg_path: Path, int8: bool = False) -> None:
    """Raise :class:`OlmoflowError` unless the safetensors headers hold exactly the weights of
    ``cfg``, in float dtypes (``int8``: a saved bitsandbytes int8 model, whose quantized linears
    hold an int8 weight with its fp32 ``SCB`` row scales). Checked before a model is built or a
    tensor read, so an edited config (a million layers) fails at once instead of allocating a
    model the file cannot fill."""
    extras = {k for k in header if int8 and k.rpartition(".")[2] in INT8_EXTRAS}
    for k in sorted(extras):
        if k.endswith(".SCB"):
            w = header.get(k.removesuffix("SCB") + "weight")
            shape, dtype, f = header[k]
            if w is None or w[1] != "I8" or dtype != "F32" or shape != w[0][:1]:
                raise OlmoflowError(f"'{f}': '{k}' is not the fp32 row scales of an int8 weight")
    names = [k for k in header if "rotary_emb" not in k and k not in extras]
    layers = {int(m.group(1)) for k in names if (m := _LAYER.match(k))}
    if len(layers) != cfg.n_layers or (layers and max(layers) != cfg.n_layers - 1):
        top = f" (indices up to {max(layers)})" if layers else ""
        raise OlmoflowError(f"{cfg_path}: num_hidden_layers={cfg.n_layers} but the weights hold "
                            f"{len(layers)} layers{top}")
    expected = expected_hf_shapes(cfg)
    reverse = [(dst, src) for src, dst in _NAMES]

    def ours(names: list[str]) -> list[str]:  # the names from_pretrained's own check reports
        return [_translate(k, reverse) or k for k in names[:3]]

    missing = sorted(set(expected) - set(names))
    unexpected = sorted(set(names) - set(expected))
    wrong = [k for k, s in expected.items() if k in header and header[k][0] != s]
    if missing or unexpected or wrong:
        detail = (f"; {ours(wrong)[0]} is {list(header[wrong[0]][0])} in the file, "
                  f"{list(expected[wrong[0]])} by the config" if wrong else "")
        raise OlmoflowError(f"the weights in '{cfg_path.parent}' do not match its config.json: "
                            f"missing {ours(missing)}, unexpected {ours(unexpected)}, "
                            f"wrong shape {ours(wrong)}{detail}")
    for k in names:
        shape, dtype, f = header[k]
        scaled = k.endswith(".weight") and k.removesuffix("weight") + "SCB" in extras
        if dtype not in _FLOAT_DTYPES and not (dtype == "I8" and scaled):
            raise OlmoflowError(f"'{f}': weight '{k}' has dtype {dtype}, not a float type"
                                + (" (an int8 weight needs its SCB scales)" if int8 else ""))


def read_hf_dir(path: str | Path, *, device: str | torch.device = "cpu",
                ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The :class:`ModelConfig` and the weights (in olmoflow's names) of a local Hugging Face
    OLMo 2/3 directory. :meth:`olmoflow.model.olmo.Olmo.from_pretrained` builds the model.

    Reads ``config.json`` (transformers 4 or 5 style) and ``model.safetensors`` or the shards
    listed in ``model.safetensors.index.json``, onto ``device``, keeping the stored dtype.

    The config is checked against the safetensors headers (names, shapes, float dtypes) before
    any tensor is read, so damaged or mismatched files cost no more than their headers.

    Raises:
        OlmoflowError: missing directory/config/weights; a ``config.json`` that is not JSON, not
            an object, lacks a key or has one of the wrong type, or is unsupported; a damaged
            safetensors file (truncated, bad header, garbage); or weights that do not match the
            config. Each names the file.
    """
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise OlmoflowError(f"no config.json in '{path}' (expected a Hugging Face model directory)")
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise OlmoflowError(f"'{cfg_path}' is not valid JSON ({e})") from None
    except RecursionError:  # json's decoder recurses per nesting level
        raise OlmoflowError(f"'{cfg_path}' is not valid JSON (nested too deeply)") from None
    try:
        cfg = model_config_from_hf(raw)
    except OlmoflowError as e:
        raise OlmoflowError(f"{cfg_path}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError,
            OverflowError) as e:
        # a value of an unexpected type deeper in the config (RoPE entries and the like)
        raise OlmoflowError(f"{cfg_path}: unsupported value ({type(e).__name__}: {e})") from None
    int8 = saved_int8_threshold(raw, cfg_path) if isinstance(raw, dict) else None
    files = _weight_files(path)
    _check_weights(cfg, _read_headers(files), cfg_path, int8=int8 is not None)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f), device=str(device)))
        except (SafetensorError, OSError) as e:
            raise OlmoflowError(f"'{f}' is not a readable safetensors file "
                                f"({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                                ) from None
    return cfg, from_hf_state_dict(state)
