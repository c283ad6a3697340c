"""8-bit weights for inference: bitsandbytes LLM.int8 linears or torchao int8 weight-only.

Every ``nn.Linear`` is replaced except the ones named in ``skip`` (default: ``lm_head``). The LM
head is kept in full precision as bitsandbytes/transformers do by default
(``llm_int8_skip_modules``): its output *is* the logits, so its quantization error moves top-1
choices most directly, while it is only one matrix of the model. Embeddings are not linears and
stay as they are.

References: Dettmers et al. 2022, "LLM.int8()" (bitsandbytes ``Linear8bitLt`` with
``has_fp16_weights=False``: int8 weights with one fp32 scale per output row, ``SCB``); torchao
``quantize_(model, Int8WeightOnlyConfig())`` (int8 weights, per-row scales, activations unchanged).
Both run on CPU (bitsandbytes >= 0.45 ships a CPU backend for int8).

A bitsandbytes int8 model saves as ``transformers`` saves one (``Olmo.save_pretrained``: each
quantized linear's int8 ``weight`` with its fp32 row scales ``SCB``, and ``quantization_config``
in ``config.json``) and loads back bit-identically (:func:`load_int8_linears`: the saved int8
weights and scales are used as they are, never re-quantized). A torchao model does not save:
its tensor subclasses have no safetensors layout that ``transformers`` reads.
"""

from __future__ import annotations

import torch
from torch import nn

METHODS = ("bnb", "torchao")


def _linears(model: nn.Module, skip: tuple[str, ...]) -> list[tuple[str, nn.Linear]]:
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.split(".")[-1] not in skip and name not in skip]


def quantize_model(model: nn.Module, method: str = "torchao", *,
                   skip: tuple[str, ...] = ("lm_head",), threshold: float = 0.0) -> nn.Module:
    """Replace the model's linears by 8-bit-weight versions, in place; returns the model (in
    eval mode).

    Args:
        method: ``"bnb"`` (bitsandbytes ``Linear8bitLt``, int8 weights, int8 matmul) or
            ``"torchao"`` (torchao int8 weight-only: dequantized on the fly, activations untouched).
        skip: module names (last component or full dotted name) left in full precision.
        threshold: bnb only, LLM.int8's outlier threshold: input features with a magnitude above
            it go through a 16-bit matmul; 0.0 = pure int8 (the default here).
    Raises:
        ValueError: an unknown method, or a model with no linear to quantize.
        ImportError: the library of ``method`` is not installed.
    """
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; expected one of {METHODS}")
    targets = _linears(model, skip)
    if not targets:
        raise ValueError("the model has no nn.Linear outside of `skip` to quantize")
    model.eval()
    if method == "torchao":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        ids = {id(m) for _, m in targets}
        quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: id(m) in ids)
        return model
    import bitsandbytes as bnb

    for name, lin in targets:
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        dev = lin.weight.device
        q = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                has_fp16_weights=False, threshold=threshold)
        q.weight = bnb.nn.Int8Params(lin.weight.data.detach().clone(), requires_grad=False,
                                     has_fp16_weights=False)
        if lin.bias is not None:
            q.bias = nn.Parameter(lin.bias.data.detach().clone(), requires_grad=False)
        setattr(parent, name.rpartition(".")[2], q.to(dev))  # moving quantizes the weight
    return model


def load_int8_linears(model: nn.Module, saved: dict[str, dict[str, torch.Tensor]], *,
                      threshold: float = 0.0) -> None:
    """Replace the linears named in ``saved`` by bitsandbytes int8 linears holding the saved
    tensors as they are, in place: ``saved[name]`` has ``weight`` (int8, ``[out, in]``), ``SCB``
    (fp32 absmax per output row, ``[out]``) and ``bias`` when the layer has one. The weights
    are not quantized again, so the model computes exactly what the saved one did.

    Raises:
        ImportError: bitsandbytes is not installed.
        ValueError: a name that is not a linear of ``model``, or tensors of the wrong dtype or
            shape for it.
    """
    import bitsandbytes as bnb

    for name, t in saved.items():
        lin = model.get_submodule(name)
        if not isinstance(lin, nn.Linear):
            raise ValueError(f"{name} is not a linear layer of the model")
        w, scb = t["weight"], t["SCB"]
        if w.dtype != torch.int8 or tuple(w.shape) != (lin.out_features, lin.in_features) \
                or scb.dtype != torch.float32 or tuple(scb.shape) != (lin.out_features,):
            raise ValueError(f"{name}: int8 weight {tuple(w.shape)} {w.dtype} with scales "
                             f"{tuple(scb.shape)} {scb.dtype} does not fit a "
                             f"{lin.in_features} -> {lin.out_features} linear")
        with torch.device("meta"):  # no memory for a float weight that is replaced at once
            q = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features, bias="bias" in t,
                                    has_fp16_weights=False, threshold=threshold)
        q.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False, CB=w,
                                     SCB=scb)
        if "bias" in t:
            q.bias = nn.Parameter(t["bias"], requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, q)


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor, looking inside tensor subclasses (torchao) and bnb's row scales."""
    if hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, nn.Parameter):
        names, _ = t.__tensor_flatten__()
        n = sum(_nbytes(getattr(t, a)) for a in names)
    else:
        n = t.numel() * t.element_size()
    scb = getattr(t, "SCB", None)  # bitsandbytes Int8Params keeps its fp32 scales here
    return n + (scb.numel() * scb.element_size() if isinstance(scb, torch.Tensor) else 0)


def memory_footprint(model: nn.Module) -> int:
    """Bytes held by the model's parameters and buffers (shared tensors counted once), including
    quantization scales; like ``transformers``' ``get_memory_footprint``."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += _nbytes(t)
    return total


@torch.inference_mode()
def top1_agreement(reference: nn.Module, candidate: nn.Module, tokens: torch.Tensor, *,
                   sequence_length: int = 256, max_tokens: int | None = None) -> float:
    """Fraction of positions where both models predict the same next token (argmax).

    Args:
        tokens: ``[N]`` held-out token ids, cut into rows of ``sequence_length``
            (a trailing remainder shorter than that is dropped).
        max_tokens: use at most this many tokens (from the start).
    Returns:
        Agreement in [0, 1] over ``rows * sequence_length`` positions.
    Raises:
        ValueError: fewer than ``sequence_length`` tokens.
    """
    tokens = tokens.reshape(-1).long()
    if max_tokens is not None:
        tokens = tokens[:max_tokens]
    rows = tokens.numel() // sequence_length
    if rows == 0:
        raise ValueError(
            f"need at least sequence_length={sequence_length} tokens, got {tokens.numel()}")
    batch = tokens[: rows * sequence_length].reshape(rows, sequence_length)
    same = total = 0
    for chunk in batch.split(8):
        a = reference(chunk).logits.argmax(-1)
        b = candidate(chunk).logits.argmax(-1)
        same += int((a == b).sum())
        total += a.numel()
    return same / total
