"""Export an OLMo 2 / OLMo 3 model to one GGUF file for llama.cpp (``olmoflow export gguf``).

The file is what llama.cpp's own converter (``convert_hf_to_gguf.py``, class ``Olmo2Model``,
registered for both ``Olmo2ForCausalLM`` and ``Olmo3ForCausalLM``) writes for a Hugging Face
OLMo 2/3 directory, written here with the ``gguf`` package straight from our weights:

- ``general.architecture`` ``olmo2`` (llama.cpp runs OLMo 3 under the same architecture), the
  hyper-parameters under ``olmo2.*``: ``context_length`` (``max_sequence_length``),
  ``embedding_length``, ``block_count``, ``feed_forward_length``, ``attention.head_count`` /
  ``head_count_kv`` / ``key_length`` / ``value_length``, ``rope.freq_base``,
  ``attention.layer_norm_rms_epsilon``; OLMo 3 adds ``attention.sliding_window`` and
  ``attention.sliding_window_pattern`` (one bool a layer, true = sliding) and, with YaRN,
  ``rope.scaling.type`` ``yarn`` / ``factor`` / ``original_context_length``. llama.cpp's
  ``olmo2`` graph masks a key ``p1 - p0 >= window`` positions back, as our window (which counts
  the query) does, and applies YaRN to the full-attention layers only, as OLMo 3 does. Builds of
  llama.cpp older than its OLMo 3 support ignore the sliding-window keys and attend over the whole
  context, which differs from the model past the window.
- tensors named as llama.cpp's ``olmo2`` loader asks: ``token_embd``, ``blk.N.attn_q`` / ``attn_k``
  / ``attn_v`` / ``attn_output``, ``attn_q_norm`` / ``attn_k_norm`` (over the full projected width,
  as OLMo's QK-norm), ``post_attention_norm`` / ``post_ffw_norm`` (OLMo 2's reordered norms),
  ``ffn_gate`` / ``ffn_up`` / ``ffn_down``, ``output_norm``, ``output``. No q/k permutation:
  llama.cpp runs ``olmo2`` with NEOX (rotate-half) RoPE, the convention of our model and of
  Hugging Face's, so the converter copies q/k as they are (it permutes only for the older
  ``olmo`` architecture, whose RoPE is interleaved).
- the tokenizer as ``tokenizer.ggml.model`` ``gpt2`` (byte-level BPE): every id up to the model's
  vocabulary (ids without a token, the padding rows, as ``[PAD<id>]`` of type UNUSED, special
  added tokens CONTROL), the merges, eos / padding (and bos, when the tokenizer has one) ids,
  ``add_bos_token`` false (olmoflow never prepends one), the chat template, and the
  pre-tokenizer: ``dbrx`` for OLMo's cl100k split (llama.cpp gives it the cl100k / Llama 3 regex;
  it is the name the converter's hash gives the dolma2 tokenizer) or ``gpt-2`` for GPT-2's.

Weights: ``f32``; ``f16`` (2-D weights, norms kept in f32 as the converter keeps every norm and
1-D tensor); or ``q8_0`` (2-D weights in blocks of 32 with an f16 scale, by ``gguf.quants``; a
weight whose rows are not a multiple of 32 falls back to f16, as in the converter).

Reference: ggml-org/llama.cpp ``conversion/olmo.py`` (``Olmo2Model``), ``conversion/base.py``
(``TextModel.set_gguf_parameters``, ``prepare_tensors``, ``_set_vocab_gpt2``) and
``src/models/olmo2.cpp``, as vendored in llama-cpp-python 0.3.36.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from olmoflow.errors import OlmoflowError

ARCH = "olmo2"
GGUF_DTYPES = ("f32", "f16", "q8_0")
# Our pre-tokenizer name (olmoflow.tokenizer.bpe.PRE_TOKENIZERS) -> llama.cpp's
# ``tokenizer.ggml.pre`` whose regex is the same split.
LLAMA_CPP_PRE = {"cl100k": "dbrx", "gpt2": "gpt-2"}

# (our parameter pattern, gguf tensor name); {i} is the layer index.
TENSOR_NAMES = [
    ("embeddings.weight", "token_embd.weight"),
    ("blocks.{i}.attention.w_q.weight", "blk.{i}.attn_q.weight"),
    ("blocks.{i}.attention.w_k.weight", "blk.{i}.attn_k.weight"),
    ("blocks.{i}.attention.w_v.weight", "blk.{i}.attn_v.weight"),
    ("blocks.{i}.attention.w_out.weight", "blk.{i}.attn_output.weight"),
    ("blocks.{i}.attention.q_norm.weight", "blk.{i}.attn_q_norm.weight"),
    ("blocks.{i}.attention.k_norm.weight", "blk.{i}.attn_k_norm.weight"),
    ("blocks.{i}.attention_norm.weight", "blk.{i}.post_attention_norm.weight"),
    ("blocks.{i}.feed_forward_norm.weight", "blk.{i}.post_ffw_norm.weight"),
    ("blocks.{i}.feed_forward.w1.weight", "blk.{i}.ffn_gate.weight"),
    ("blocks.{i}.feed_forward.w3.weight", "blk.{i}.ffn_up.weight"),
    ("blocks.{i}.feed_forward.w2.weight", "blk.{i}.ffn_down.weight"),
    ("norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
]


def _import_gguf():
    try:
        import gguf
    except ImportError:
        raise OlmoflowError("GGUF export needs the gguf package: pip install 'olmoflow[gguf]' "
                            "(or pip install gguf==0.19.0)") from None
    return gguf


def gguf_name(name: str) -> str:
    """The GGUF tensor name of our parameter ``name`` (``blocks.3.feed_forward.w1.weight`` ->
    ``blk.3.ffn_gate.weight``).

    Raises:
        KeyError: a parameter with no GGUF name.
    """
    parts = name.split(".")
    layer = parts[1] if parts[0] == "blocks" and len(parts) > 1 and parts[1].isdecimal() else None
    pattern = ".".join(["blocks", "{i}", *parts[2:]]) if layer is not None else name
    for ours, theirs in TENSOR_NAMES:
        if ours == pattern:
            return theirs.replace("{i}", layer) if layer is not None else theirs
    raise KeyError(f"no GGUF name for parameter '{name}'")


def check_expressible(cfg) -> None:
    """Refuse a :class:`~olmoflow.model.config.ModelConfig` that llama.cpp's ``olmo2`` cannot run.

    Raises:
        OlmoflowError: ``n_heads * head_dim != d_model`` (llama.cpp's ``olmo2`` loader sizes
            ``attn_q``, ``attn_output`` and ``attn_q_norm`` as ``d_model`` square / wide).
    """
    if cfg.n_heads * cfg.hd != cfg.d_model:
        raise OlmoflowError(
            f"cannot export to GGUF: n_heads * head_dim = {cfg.n_heads} * {cfg.hd} != d_model "
            f"{cfg.d_model}, and llama.cpp's olmo2 architecture needs them equal")


def _file_type(gguf, dtype: str):
    return {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
            "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]


def _add_hparams(w, gguf, cfg, name: str, dtype: str) -> None:
    """The ``general.*`` and ``olmo2.*`` keys (the module docstring lists them)."""
    w.add_name(name)
    w.add_file_type(_file_type(gguf, dtype))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_sequence_length)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(cfg.mlp_hidden)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.hd)
    w.add_value_length(cfg.hd)
    w.add_rope_freq_base(float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    if cfg.yarn_factor:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(cfg.yarn_factor))
        w.add_rope_scaling_orig_ctx_len(cfg.yarn_original_max_length)
    if cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([not cfg.is_full_attention(i) for i in range(cfg.n_layers)])


def _merges(tok_dir: Path) -> list[str]:
    """The BPE merges of ``tok_dir/tokenizer.json`` as ``"left right"`` strings (``tokenizers``
    writes them as such strings or, since 0.20, as ``[left, right]`` pairs)."""
    file = tok_dir / "tokenizer.json"
    try:
        model = json.loads(file.read_text(encoding="utf-8")).get("model") or {}
    except (OSError, ValueError, AttributeError) as e:
        raise OlmoflowError(f"cannot read {file}: {e}") from None
    if model.get("type") != "BPE":
        raise OlmoflowError(f"{file}: a {model.get('type')} tokenizer; GGUF export needs "
                            "byte-level BPE")
    return [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]


def vocab_entries(tok, n_vocab: int) -> tuple[list[str], list[int]]:
    """``(tokens, token_types)`` for ids ``0 .. n_vocab - 1`` as llama.cpp's converter lists
    them: the byte-level token strings; ids without a token ``[PAD<id>]`` (UNUSED); special added
    tokens CONTROL, other added tokens USER_DEFINED, the rest NORMAL."""
    gguf = _import_gguf()
    backend = tok.backend
    added = backend.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(n_vocab):
        text = backend.id_to_token(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(text)
            types.append(gguf.TokenType.CONTROL if added[i].special
                         else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(text)
            types.append(gguf.TokenType.NORMAL)
    return tokens, [int(t) for t in types]


def _add_vocab(w, tok, tok_dir: Path, n_vocab: int) -> None:
    """The ``tokenizer.ggml.*`` keys and the chat template (see the module docstring)."""
    from olmoflow.tokenizer.bpe import pre_tokenizer_name

    pre = LLAMA_CPP_PRE.get(pre_tokenizer_name(tok.backend) or "")
    if pre is None:
        raise OlmoflowError(f"the tokenizer in '{tok_dir}' splits text with a pre-tokenizer "
                            "llama.cpp has no match for; GGUF export supports OLMo's cl100k "
                            "split and GPT-2's")
    tokens, types = vocab_entries(tok, n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(_merges(tok_dir))
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    if tok.bos_token_id is not None:
        w.add_bos_token_id(tok.bos_token_id)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)


def tensor_data(gguf, name: str, weight: torch.Tensor, dtype: str) -> tuple[Any, Any]:
    """``(array, ggml type)`` of one weight as written: norms and 1-D tensors f32; 2-D weights in
    ``dtype`` (``q8_0`` falling back to f16 where a row is not a multiple of 32)."""
    import numpy as np

    data = weight.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    q = gguf.GGMLQuantizationType
    if data.ndim <= 1 or name.endswith("_norm.weight") or dtype == "f32":
        return data, q.F32
    if dtype == "q8_0":
        try:
            return gguf.quants.quantize(data, q.Q8_0), q.Q8_0
        except gguf.QuantError:
            pass
    return data.astype(np.float16), q.F16


def write_gguf(model, tok, tok_dir: Path, out: Path, *, dtype: str = "f16",
               name: str = "olmoflow") -> Path:
    """Write ``model`` (an :class:`~olmoflow.model.olmo.Olmo`) and ``tok`` (its
    :class:`~olmoflow.tokenizer.BPETokenizer`, loaded from ``tok_dir``) to the GGUF file ``out``,
    through a temporary file beside it renamed into place; returns ``out``. Weights of shape
    ``[out, in]`` are stored row-major as they are (ggml's ``ne`` = ``[in, out]``).

    Raises:
        OlmoflowError: the gguf package is missing; the model or tokenizer cannot be expressed
            (:func:`check_expressible`, a pre-tokenizer llama.cpp lacks, a parameter with no GGUF
            name such as an unmerged LoRA adapter, a quantized weight); the write fails (a full
            disk names ``out``).
    """
    from olmoflow.artifacts import atomic_path
    from olmoflow.model.hf import clean_state_dict

    gguf = _import_gguf()
    cfg = model.config
    check_expressible(cfg)
    state = clean_state_dict(model.state_dict())
    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), ARCH)
        try:
            _add_hparams(w, gguf, cfg, name, dtype)
            _add_vocab(w, tok, tok_dir, cfg.vocab_size)
            for key, weight in state.items():
                if not torch.is_floating_point(weight):
                    raise OlmoflowError(f"parameter '{key}' is {weight.dtype}, not a float "
                                        "tensor (a quantized model? export the unquantized one)")
                try:
                    target = gguf_name(key)
                except KeyError as e:  # a wrapped model (LoRA adapters not merged, ...)
                    raise OlmoflowError(f"cannot export to GGUF: {e.args[0]}") from None
                data, qtype = tensor_data(gguf, target, weight, dtype)
                w.add_tensor(target, data, raw_dtype=qtype)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file(progress=False)
        finally:
            w.close()
    return out


def check_output_file(out: str | Path, kind: str, src: Path, force: bool) -> Path:
    """``out`` as a path, checked as the destination of a GGUF file exported from the checkpoint
    ``src`` (``kind`` as :func:`olmoflow.model.load.resolve_source` says).

    Raises:
        OlmoflowError: ``out`` is a directory; it exists without ``force``; it lies inside the
            checkpoint or (for a step) its folder, beside the run's other checkpoints; a parent
            of it is a file.
    """
    out = Path(out)
    if out.is_dir():
        raise OlmoflowError(f"output '{out}' is a directory; give the .gguf file to write")
    if out.exists() and not force:
        raise OlmoflowError(f"output '{out}' exists; pass --force to replace it")
    ro, rs = out.resolve(), src.resolve()
    if rs in ro.parents:
        raise OlmoflowError(f"output '{out}' must not be inside the checkpoint '{src}'")
    if kind == "step" and rs.parent in ro.parents:
        raise OlmoflowError(f"output '{out}' lies inside the checkpoint folder '{src.parent}'; "
                            "write the export outside it")
    blocked = next((p for p in ro.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise OlmoflowError(f"output '{out}': '{blocked}' is a file, not a directory")
    return out


def export_gguf(source: str | Path, out: str | Path, *, dtype: str = "f16",
                tokenizer: str | Path | None = None, force: bool = False) -> Path:
    """Write the GGUF file ``out`` for ``source``; returns ``out``.

    Args:
        source: a step directory, a checkpoint folder with ``latest``, or a Hugging Face
            directory (a release), as :func:`olmoflow.model.load.load_model` accepts.
        out: the file to write; it must not exist unless ``force``.
        dtype: ``f32``, ``f16`` (default) or ``q8_0`` for the 2-D weights (norms stay f32).
        tokenizer: directory with ``tokenizer.json`` (default: found as ``export hf`` finds it).
        force: replace an existing ``out``.
    Raises:
        OlmoflowError: an unknown dtype, bad paths, a checkpoint that does not load, a model
            vocabulary smaller than the tokenizer's, or what :func:`write_gguf` raises.
    """
    from olmoflow.model.load import load_model, resolve_source

    if dtype not in GGUF_DTYPES:
        raise OlmoflowError(f"unknown GGUF dtype '{dtype}'; valid: {', '.join(GGUF_DTYPES)}")
    _import_gguf()
    kind, src = resolve_source(source)
    out = check_output_file(out, kind, src, force)
    loaded = load_model(src, tokenizer=tokenizer)
    name = src.parent.parent.name if kind == "step" else src.resolve().name
    return write_gguf(loaded.model, loaded.tokenizer, loaded.tokenizer_dir, out, dtype=dtype,
                      name=name or "olmoflow")
