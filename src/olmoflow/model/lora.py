"""LoRA and QLoRA fine-tuning of an :class:`~olmoflow.model.olmo.Olmo`, through ``peft``.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") freezes the base
weights and learns ``W + (alpha / r) * B @ A`` for the targeted linears, with ``A [r, in]``
(Kaiming-uniform init) and ``B [out, r]`` (zeros, so training starts from the base model).
QLoRA (Dettmers et al. 2023) does the same over a base whose block linears are stored in 4-bit
NF4 (or 8-bit LLM.int8) by ``bitsandbytes``; the LM head stays in full precision, as
``transformers``' ``load_in_4bit`` keeps it.

The adapters are injected in place (``peft.inject_adapter_in_model``): the result is still an
``Olmo``, so ``model(input_ids, labels, ...)``, ``model.blocks``, ``activation_checkpointing``
and the Trainer (optimizer, checkpoints, exact resume) work unchanged. Only the state-dict keys of
the targeted linears change, deterministically (``...w_q.base_layer.weight``,
``...w_q.lora_A.default.weight``, ``...w_q.lora_B.default.weight``), so a checkpoint of a wrapped
model loads into the same wrapping of the same base. :func:`merge_lora` folds the adapters back
and returns a plain ``Olmo`` with exactly the base model's keys.

A checkpoint directory of a LoRA run records its settings in ``lora.json``
(:func:`write_lora_settings`); :func:`merge_lora_files` turns such a checkpoint into a Hugging
Face directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from olmoflow.config import from_dict
from olmoflow.errors import OlmoflowError, closest
from olmoflow.model.config import LORA_TARGET_ALIASES, LORA_TARGETS
from olmoflow.model.olmo import Olmo

# The short names, what they adapt and the other names accepted: beside the model's config, so
# that a run config checks them without importing peft or this module.
TARGETS, TARGET_ALIASES = LORA_TARGETS, LORA_TARGET_ALIASES
QUANTIZE = (None, "8bit", "4bit")
SETTINGS_FILE = "lora.json"
ADAPTER = "default"  # peft's adapter name; part of the state-dict keys
_FORMAT = 1


@dataclass(frozen=True)
class LoraSettings:
    """How to adapt a model.

    Attributes:
        r: rank of the adapters (``A [r, in]``, ``B [out, r]``).
        alpha: scale numerator: the update is ``(alpha / r) * B @ A``.
        dropout: dropout on the adapter's input (training only).
        targets: which linears of every block get an adapter: ``q k v o`` (attention
            projections), ``gate up down`` (SwiGLU); the Hugging Face names (``q_proj``) and ours
            (``w_q``) are accepted too and stored as the short names.
        quantize: ``None`` (LoRA), ``"8bit"`` or ``"4bit"`` (QLoRA: NF4 base linears).

    Raises:
        OlmoflowError: a value out of range or an unknown target (naming the closest one).
    """

    r: int = 8
    alpha: float = 16
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    quantize: str | None = None

    def __post_init__(self):
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", (self.targets,))
        canon = []
        for t in self.targets:
            name = t if t in TARGETS else TARGET_ALIASES.get(t)
            if name is None:
                hint = closest(t, [*TARGETS, *TARGET_ALIASES])
                raise OlmoflowError(f"unknown LoRA target '{t}'"
                                    + (f"; did you mean '{TARGET_ALIASES.get(hint, hint)}'?" if hint
                                       else f"; valid: {', '.join(TARGETS)}"))
            if name not in canon:
                canon.append(name)
        if not canon:
            raise OlmoflowError(f"LoRA targets must name at least one of {', '.join(TARGETS)}")
        object.__setattr__(self, "targets", tuple(canon))
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise OlmoflowError(f"LoRA r must be a positive integer, got {self.r!r}")
        if not isinstance(self.alpha, int | float) or self.alpha <= 0:
            raise OlmoflowError(f"LoRA alpha must be a positive number, got {self.alpha!r}")
        if not isinstance(self.dropout, int | float) or not 0.0 <= self.dropout < 1.0:
            raise OlmoflowError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if self.quantize not in QUANTIZE:
            hint = closest(str(self.quantize), [q for q in QUANTIZE if q])
            raise OlmoflowError(f"unknown LoRA quantize {self.quantize!r}; "
                                + (f"did you mean '{hint}'?" if hint else
                                   "valid: null, '8bit', '4bit'"))

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready)."""
        d = asdict(self)
        d["targets"] = list(self.targets)
        return d


def parse_lora_settings(data: Any, where: str = "LoRA settings") -> LoraSettings:
    """:class:`LoraSettings` from :meth:`LoraSettings.to_dict`'s output, parsed by
    :func:`olmoflow.config.from_dict` (the one config parser); ``where`` (a file) begins every
    error message.

    Raises:
        OlmoflowError: not a mapping, an unknown key (naming the closest), or a bad value.
    """
    if not isinstance(data, dict):
        raise OlmoflowError(f"{where}: expected a mapping of LoRA settings, got "
                            f"{type(data).__name__}")
    try:
        return from_dict(LoraSettings, data)
    except OlmoflowError as e:  # "config key 'r'": in a settings file, a LoRA setting
        raise OlmoflowError(f"{where}: {str(e).replace('config key', 'LoRA setting')}") from None


# --- applying, reporting, merging --------------------------------------------------------------


@contextlib.contextmanager
def _quiet_imports():
    """Silence what importing peft logs on a CPU machine (torchao's and bitsandbytes' probes for
    triton and GPU kernels): warnings about features this process does not use."""
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)


def _bnb(quantize: str):
    """Import bitsandbytes or raise the one-line error that QLoRA needs it."""
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise OlmoflowError(f"LoRA quantize='{quantize}' (QLoRA) needs bitsandbytes, which cannot "
                            f"be imported ({e}); pip install 'olmoflow[quant]' or set quantize: "
                            "null") from None
    return bnb


class _DenseStateDict:
    """A bitsandbytes linear whose state dict holds its weight dequantized, as one ``weight``
    ``[out, in]`` tensor: bitsandbytes' own entries (NF4 ``absmax``/``quant_map``/packed quant
    state, int8 ``SCB``/``weight_format``) are not parameters that
    ``torch.distributed.checkpoint`` can address, so a QLoRA model could not be checkpointed.
    Loading a weight equal to the current dequantized one keeps the quantized tensor as it is
    (a resume is bit-exact); another weight is quantized anew."""

    dense_dtype: torch.dtype = torch.float32
    quantize: str = "4bit"

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = _dense_weight(self, self.dense_dtype)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
            return
        w, current = state_dict[key], _dense_weight(self, self.dense_dtype)
        if tuple(w.shape) != tuple(current.shape):
            error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                              f"{tuple(w.shape)}, the shape in current model is "
                              f"{tuple(current.shape)}.")
            return
        if not torch.equal(w.to(current.device, current.dtype), current):
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device=current.device,
                            dtype=self.dense_dtype)
            with torch.no_grad():
                lin.weight.copy_(w)
            fresh = _quantized_linear(_bnb(self.quantize), lin, self.quantize)
            self.weight = fresh.weight
            if hasattr(fresh, "state"):  # int8: the matmul state holds the row scales
                self.state = fresh.state


_QUANTIZED_CLASSES: dict[str, type] = {}


def _quantized_linear(bnb, lin: nn.Linear, quantize: str) -> nn.Module:
    """A bitsandbytes copy of ``lin`` (moving it to its device quantizes the weight)."""
    if quantize not in _QUANTIZED_CLASSES:
        base = bnb.nn.Linear4bit if quantize == "4bit" else bnb.nn.Linear8bitLt
        _QUANTIZED_CLASSES[quantize] = type(base.__name__, (_DenseStateDict, base),
                                            {"quantize": quantize})
    cls = _QUANTIZED_CLASSES[quantize]
    w = lin.weight.data.detach().clone()
    if quantize == "4bit":
        q = cls(lin.in_features, lin.out_features, bias=False, compute_dtype=w.dtype,
                quant_type="nf4")
        q.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4")
        # On CPUs with AVX512-BF16, bitsandbytes repacks the weight in place at the first
        # no-grad eval forward (a faster layout whose quant state our dense state dict and the
        # derived-weight stamps do not know, and which fails for small layers): keep the one
        # NF4 layout on every CPU, so QLoRA computes and checkpoints alike everywhere.
        if hasattr(q, "support_avx512bf16_for_cpu"):
            q.support_avx512bf16_for_cpu = False
    else:
        q = cls(lin.in_features, lin.out_features, bias=False, has_fp16_weights=False,
                threshold=0.0)
        q.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
    q.dense_dtype = w.dtype
    return q.to(w.device)


def _quantize_blocks(model: Olmo, quantize: str) -> None:
    """Replace every linear inside the blocks by its bitsandbytes version (QLoRA's base)."""
    bnb = _bnb(quantize)
    device = model.device
    try:  # a backend for this device? (bitsandbytes >= 0.45 has CPU kernels; older ones do not)
        probe = _quantized_linear(bnb, nn.Linear(64, 64, bias=False).to(device), quantize)
        probe(torch.zeros(1, 64, device=device, dtype=model.embeddings.weight.dtype))
    except Exception as e:  # bitsandbytes raises many kinds for a missing backend
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise OlmoflowError(f"LoRA quantize='{quantize}' (QLoRA): bitsandbytes cannot quantize "
                            f"on {device} here ({first}); use a GPU or set quantize: null"
                            ) from None
    for name, lin in [(n, m) for n, m in model.blocks.named_modules()
                      if isinstance(m, nn.Linear)]:
        parent, _, attr = name.rpartition(".")
        setattr(model.blocks.get_submodule(parent), attr, _quantized_linear(bnb, lin, quantize))


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` carries LoRA adapters injected by :func:`apply_lora`."""
    return getattr(model, "lora_settings", None) is not None


def apply_lora(model: Olmo, settings: LoraSettings) -> Olmo:
    """Inject LoRA adapters into ``model`` in place and return it (still an ``Olmo``).

    Every parameter of the base (embeddings, norms, LM head, linears) is frozen; only the adapters
    (``lora_A``/``lora_B``, fp32) train. With ``settings.quantize`` the block linears are first
    replaced by bitsandbytes 4-bit NF4 / 8-bit versions (QLoRA). The settings are kept on the
    model as ``model.lora_settings``. Adapter init draws from torch's global RNG (``A``;
    ``B`` starts at zero, so the adapted model equals the base until it trains).

    Raises:
        OlmoflowError: ``model`` is not an Olmo or already has adapters; QLoRA without
            bitsandbytes or without a bitsandbytes backend for the model's device.
    """
    if not isinstance(model, Olmo):
        raise OlmoflowError(f"apply_lora needs an olmoflow Olmo model, got {type(model).__name__}")
    if is_lora(model):
        raise OlmoflowError("the model already has LoRA adapters; merge_lora() it first")
    if settings.quantize:
        _quantize_blocks(model, settings.quantize)
    with _quiet_imports():
        from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=[TARGETS[t] for t in settings.targets], bias="none")
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        adapter = ".lora_" in name
        p.requires_grad_(adapter)
        if adapter and p.dtype != torch.float32:  # adapters train in fp32 over a low-bit base
            p.data = p.data.float()
    model.lora_settings = settings
    return model


def _logical_numel(p: torch.Tensor) -> int:
    """Parameters a tensor stands for (a packed 4-bit weight holds two per byte)."""
    state = getattr(p, "quant_state", None)
    shape = getattr(state, "shape", None)
    return int(torch.Size(shape).numel()) if shape is not None else p.numel()


def _nbytes(p: torch.Tensor) -> int:
    """Storage bytes of a parameter, including bitsandbytes' scales (int8 ``SCB``, NF4
    ``absmax``)."""
    n = p.numel() * p.element_size()
    scb = getattr(p, "SCB", None)
    if isinstance(scb, torch.Tensor):
        n += scb.numel() * scb.element_size()
    absmax = getattr(getattr(p, "quant_state", None), "absmax", None)
    if isinstance(absmax, torch.Tensor):
        n += absmax.numel() * absmax.element_size()
    return n


def lora_report(model: nn.Module) -> dict[str, Any]:
    """Parameter counts and memory of a (LoRA-)model.

    Returns:
        ``trainable_params``, ``total_params`` (logical counts: a 4-bit weight counts its
        unpacked size), ``trainable_share`` (``trainable / total``, in [0, 1]),
        ``trainable_bytes``, ``frozen_bytes``, ``param_bytes`` (storage of the parameters,
        quantization scales included; gradients and optimizer state not included) and
        ``text``, a one-line summary for printing.
    """
    trainable = total = t_bytes = f_bytes = 0
    for p in model.parameters():
        n = _logical_numel(p)
        total += n
        if p.requires_grad:
            trainable += n
            t_bytes += _nbytes(p)
        else:
            f_bytes += _nbytes(p)
    share = trainable / total if total else 0.0
    text = (f"trainable params: {trainable:,} || all params: {total:,} || trainable%: "
            f"{100 * share:.4f} || param memory: {(t_bytes + f_bytes) / 2**20:.2f} MiB "
            f"({t_bytes / 2**20:.2f} trainable + {f_bytes / 2**20:.2f} frozen)")
    return {"trainable_params": trainable, "total_params": total, "trainable_share": share,
            "trainable_bytes": t_bytes, "frozen_bytes": f_bytes, "param_bytes": t_bytes + f_bytes,
            "text": text}


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights only (``...lora_A.default.weight`` / ``...lora_B.default.weight``,
    keys as in ``model.state_dict()``), detached: a small file to save and share.

    Raises:
        OlmoflowError: the model has no adapters.
    """
    state = {k: v.detach() for k, v in model.state_dict().items() if ".lora_" in k}
    if not state:
        raise OlmoflowError("the model has no LoRA adapters (apply_lora() was not called)")
    return state


def load_lora_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy adapter weights (from :func:`lora_state_dict`) into a model wrapped with the same
    settings.

    Raises:
        OlmoflowError: the keys or shapes differ from the model's adapters.
    """
    own = lora_state_dict(model)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    wrong = [k for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or wrong:
        raise OlmoflowError(f"adapter weights do not match the model's LoRA adapters: missing "
                            f"{missing[:3]}, unexpected {unexpected[:3]}, wrong shape {wrong[:3]}")
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(state[k])


def _dense_weight(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The ``[out, in]`` weight of a linear, dequantized when it is a bitsandbytes one."""
    w = layer.weight
    if type(w).__name__ in ("Params4bit", "Int8Params"):
        from peft.utils.integrations import dequantize_bnb_weight

        w = dequantize_bnb_weight(w, state=getattr(layer, "state", None))
    return w.detach().to(dtype)


def merge_lora(model: Olmo) -> Olmo:
    """Fold the adapters into the base weights, in place: ``W <- W + (alpha / r) * B @ A``, and
    return the plain ``Olmo`` (its state dict has exactly the base model's keys, every parameter
    trainable again, as a freshly built model).

    A quantized (QLoRA) base is dequantized first, so the merged weights are the NF4/int8 base
    plus the update (what the adapted model computed), in the dtype of the embeddings.

    Raises:
        OlmoflowError: the model has no adapters.
    """
    if not is_lora(model):
        raise OlmoflowError("the model has no LoRA adapters to merge (apply_lora() was not "
                            "called)")
    from peft.tuners.lora import LoraLayer

    dtype = model.embeddings.weight.dtype

    def swap(name: str, layer: nn.Module, delta: torch.Tensor | None) -> None:
        with torch.no_grad():
            w = _dense_weight(layer, dtype)
            if delta is not None:
                w = (w.float() + delta.float()).to(dtype)
            plain = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=dtype)
            plain.weight.copy_(w)
        parent, _, attr = name.rpartition(".")
        setattr(model.blocks.get_submodule(parent), attr, plain)

    # Adapted linears first (their quantized base goes with them), then the quantized linears
    # that had no adapter (QLoRA quantizes every block linear).
    for name, module in list(model.blocks.named_modules()):
        if isinstance(module, LoraLayer):
            swap(name, module.get_base_layer(),
                    sum(module.get_delta_weight(a) for a in module.active_adapters))
    for name, module in list(model.blocks.named_modules()):
        if type(getattr(module, "weight", None)).__name__ in ("Params4bit", "Int8Params"):
            swap(name, module, None)
    for p in model.parameters():
        p.requires_grad_(True)
    for attr in ("lora_settings", "peft_config"):
        if hasattr(model, attr):
            delattr(model, attr)
    return model


# --- settings on disk and merging a checkpoint --------------------------------------------------


def write_lora_settings(directory: str | Path, settings: LoraSettings) -> Path:
    """Record ``settings`` as ``directory/lora.json`` (atomically); returns the file.

    The LoRA run's caller writes it into the save folder (and/or each step directory), so that
    :func:`merge_lora_files` rebuilds the same wrapping.
    """
    from olmoflow.artifacts import atomic_write_json

    path = Path(directory) / SETTINGS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"format": _FORMAT, **settings.to_dict()})
    return path


def find_lora_settings(path: str | Path) -> Path | None:
    """``lora.json`` in ``path`` (a step directory) or its parent (the save folder), or None."""
    path = Path(path)
    for d in (path, path.parent):
        if (d / SETTINGS_FILE).is_file():
            return d / SETTINGS_FILE
    return None


def read_lora_settings(path: str | Path) -> LoraSettings:
    """Read the settings :func:`write_lora_settings` recorded: ``path`` is the ``lora.json``
    file, or a directory holding it (a step directory, or the save folder above it).

    Raises:
        OlmoflowError: no ``lora.json`` there, it is not JSON, or it holds bad settings (the
            message names the file and the key).
    """
    path = Path(path)
    file = path if path.is_file() else find_lora_settings(path)
    if file is None:
        raise OlmoflowError(f"no {SETTINGS_FILE} in '{path}' or its parent: not a LoRA "
                            "checkpoint (its run writes the LoRA settings there)")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise OlmoflowError(f"{file}: cannot read the LoRA settings ({e})") from None
    if isinstance(data, dict):
        data = {k: v for k, v in data.items() if k != "format"}
    return parse_lora_settings(data, str(file))


def merge_lora_files(src: str | Path, out: str | Path, *, load_model: Callable[[], Olmo],
                     settings: LoraSettings | None = None,
                     load_weights: Callable[[Path, nn.Module], None] | None = None) -> Path:
    """Turn a LoRA checkpoint into a plain Hugging Face model directory.

    Args:
        src: the step directory of a LoRA run (``.../sft-step100-tokens1M``).
        out: the HF directory to write (``config.json`` + ``model.safetensors``).
        load_model: builds the base ``Olmo`` of the run (architecture of the checkpoint,
            materialised on CPU; its weights are overwritten by the checkpoint's).
        settings: the run's LoRA settings; default :func:`read_lora_settings` of ``src``.
        load_weights: ``(step_dir, model)`` restoring the wrapped model's weights; default
            :func:`olmoflow.model.checkpoint_files.load_weights` (verifies, then reads with dcp).
    A QLoRA checkpoint merges without bitsandbytes: it holds the dequantized base, so the merged
    weights are exactly ``dequantize(base) + (alpha / r) * B @ A``, what the run computed with.

    Returns:
        ``out``.
    Raises:
        OlmoflowError: no settings recorded, or the checkpoint does not hold this wrapping's
            weights (other settings or another base).
    """
    src, out = Path(src), Path(out)
    settings = settings if settings is not None else read_lora_settings(src)
    if load_weights is None:
        from olmoflow.model.checkpoint_files import load_weights
    # A QLoRA checkpoint holds its base dequantized (see _DenseStateDict) under the keys of a
    # plain LoRA wrapping: loading it unquantized gives exactly the weights the run computed
    # with, and needs no bitsandbytes backend here.
    model = apply_lora(load_model(), replace(settings, quantize=None))
    try:
        load_weights(src, model)
    except OlmoflowError as e:
        raise OlmoflowError(f"cannot load '{src}' as a LoRA checkpoint with {settings}: "
                            f"{str(e).splitlines()[0]}") from None
    merged = merge_lora(model.eval())
    merged.save_pretrained(out)
    return out
