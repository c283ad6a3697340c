"""Export a training checkpoint to a Hugging Face model directory (``olmoflow export hf``).

The output loads with ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` as
``Olmo3ForCausalLM`` (``Olmo2ForCausalLM`` when the model has no sliding windows) and with
``AutoTokenizer.from_pretrained(OUT)`` giving the same token ids as olmoflow's tokenizer.

Accepted sources:

- a checkpoint directory of a run (``run_dir/pretrain/stage1-step450-tokens2M``, or the older
  ``stepN``: ``config.yaml`` + ``model_and_optim/`` written by :mod:`olmoflow.train.checkpoint`);
- a checkpoint folder with a ``latest`` pointer (``run_dir/pretrain``), or that pointer itself
  (``run_dir/pretrain/latest``): the checkpoint it names;
- a Hugging Face directory (e.g. a release): re-exported, optionally in another dtype.

The tokenizer comes from ``--tokenizer`` when given; for a step directory, else from the tokens
directories the checkpoint's config trained on (``train.data``), else from the run's tokenizer
stage, else its release (the run directory is the step directory's grandparent, laid out as
:class:`olmoflow.run_dir.RunDir` says); for a Hugging Face directory, from the directory itself.
The tokenizer's files are copied as they are, its chat template included: ``chat_template.jinja``
and the ``chat_template`` key of ``tokenizer_config.json`` are both written when either is there
(``transformers`` prefers the ``.jinja`` file), so ``apply_chat_template`` on the export gives
the ids :func:`olmoflow.posttrain.chat_template.render` gives.
The directory is assembled under a temporary name beside ``OUT`` and renamed onto it when complete.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from olmoflow.artifacts import atomic_write_json, atomic_write_text, data_files, now, sha256_file
from olmoflow.config import from_dict, read_yaml_mapping
from olmoflow.errors import OlmoflowError
from olmoflow.run_dir import RunDir

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def _is_step_dir(p: Path) -> bool:
    return (p / "model_and_optim").is_dir() and (p / "config.yaml").is_file()


def resolve_source(checkpoint: str | Path) -> tuple[str, Path]:
    """``("step", dir)`` for a training step directory, ``("hf", dir)`` for a Hugging Face one.

    Raises:
        OlmoflowError: the path is missing or is neither kind.
    """
    p = Path(checkpoint)
    if not p.exists():
        raise OlmoflowError(f"checkpoint '{p}' does not exist")
    if p.is_file() and p.name == "latest":  # run_dir/pretrain/latest: the pointer it holds
        p = p.parent
    if not p.is_dir():
        raise OlmoflowError(f"checkpoint '{p}' is not a directory (expected a checkpoint "
                            "directory such as run_dir/pretrain/stage1-step450-tokens2M)")
    if _is_step_dir(p):
        return "step", p
    if (p / "latest").is_file():
        step = p / (p / "latest").read_text().strip()
        if _is_step_dir(step):
            return "step", step
    if (p / "config.json").is_file():
        return "hf", p
    raise OlmoflowError(f"'{p}' is not a checkpoint: expected a step directory with config.yaml "
                        "and model_and_optim/ (e.g. run_dir/pretrain/stage1-step450-tokens2M) or a "
                        "Hugging Face directory")


def _step_config(step: Path) -> dict:
    """The raw run config saved in a step directory (``config.yaml``)."""
    return read_yaml_mapping(step / "config.yaml")


def _trained_on_tokenizers(step: Path) -> list[Path]:
    """The tokenizer directories of the tokens directories a step was trained on (``train.data``
    in its config; none when it trained on its run's own tokens)."""
    from olmoflow.data.tokenize import open_token_dir

    train = _step_config(step).get("train")
    data = train.get("data") if isinstance(train, dict) else None
    dirs = [data] if isinstance(data, str) else list(data or [])
    found = []
    for d in dirs:
        try:
            found.append(open_token_dir(d).tokenizer_dir)
        except OlmoflowError:  # moved or deleted since; the other candidates may still hold one
            continue
    return found


def find_tokenizer(kind: str, src: Path, tokenizer: str | Path | None = None) -> Path:
    """The directory holding ``tokenizer.json`` for ``src`` (the module docstring gives the
    order).

    Raises:
        OlmoflowError: none found (the message lists where it looked).
    """
    if tokenizer is not None:
        cands = [Path(tokenizer)]
    elif kind == "step":
        runs = RunDir(src.resolve().parent.parent)
        # a post-training stage keeps its own tokenizer (chat template, added tokens) beside
        # its checkpoints
        cands = [src.parent / "tokenizer", *_trained_on_tokenizers(src),
                 runs.stage("train-tokenizer"), runs.stage("release")]
    else:
        cands = [src]
    for c in cands:
        if (c / "tokenizer.json").is_file():
            return c
    raise OlmoflowError(f"no tokenizer.json in {', '.join(repr(str(c)) for c in cands)}; "
                        "pass --tokenizer DIR")


def load_step_model(step: Path, tokenizer_vocab: int):
    """The :class:`Olmo` of a step directory: the shape of the ``model`` section of its
    ``config.yaml`` (vocab padded from ``tokenizer_vocab`` when it says 0), weights from
    ``model_and_optim/`` (built on meta, then materialised once on CPU in fp32). The checkpoint
    of a LoRA run (``lora.json`` beside it) is loaded into the wrapped model and its adapters
    merged, so the model returned is a plain :class:`Olmo`.

    Raises:
        OlmoflowError: the config has no valid model section, or the weights do not load.
    """
    from olmoflow.model.config import ModelConfig
    from olmoflow.model.olmo import Olmo
    from olmoflow.train.checkpoint import load_model

    tree = _step_config(step)
    if not isinstance(tree.get("model"), dict):
        raise OlmoflowError(f"{step / 'config.yaml'}: no 'model' section; not a checkpoint's "
                            "config")
    mc = from_dict(ModelConfig, tree["model"], "model.")
    if mc.vocab_size <= 0:
        mc = replace(mc, vocab_size=mc.padded_vocab_size(tokenizer_vocab))
    with torch.device("meta"):
        model = Olmo(mc)
    model = model.to_empty(device="cpu")
    lora = lora_settings_of(step)
    if lora is not None:  # a LoRA run's checkpoint holds the wrapped model: wrap, load, merge
        from olmoflow.model.lora import apply_lora

        model = apply_lora(model, replace(lora, quantize=None))
    try:
        load_model(step, model)
    except Exception as e:  # dcp raises a variety of errors for damaged or mismatched checkpoints
        raise OlmoflowError(f"cannot load the weights of '{step}': "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if lora is not None:
        from olmoflow.model.lora import merge_lora

        model = merge_lora(model)
    return model.eval()


def lora_settings_of(step: Path):
    """The :class:`~olmoflow.model.lora.LoraSettings` a LoRA run recorded beside its checkpoint
    (``lora.json``), or None for a checkpoint of every weight."""
    from olmoflow.model.lora import find_lora_settings, read_lora_settings

    return read_lora_settings(step) if find_lora_settings(step) is not None else None


def _copy_tokenizer_files(tok_dir: Path, out: Path, skip: set[str]) -> list[Path]:
    """Copy the tokenizer's files into ``out``, except the names in ``skip`` (the model files
    just written: a Hugging Face source is its own tokenizer directory, and its weights must not
    overwrite the converted ones) and an older export's manifest. Both forms of the chat template
    end up in ``out`` when the tokenizer has one."""
    from olmoflow.disk import writing
    from olmoflow.tokenizer.bpe import CHAT_TEMPLATE_FILE, CONFIG_FILE

    skip = skip | {"export_manifest.json"}
    out_files = []
    for f in data_files(tok_dir):
        if f.parent != tok_dir or f.name in skip:  # a tokenizer directory is flat
            continue
        with writing(out / f.name):  # a full disk: one line naming the copy
            shutil.copyfile(f, out / f.name)
        out_files.append(out / f.name)
    config_file, jinja_file = out / CONFIG_FILE, out / CHAT_TEMPLATE_FILE
    if config_file.is_file():
        import json

        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except ValueError as e:
            raise OlmoflowError(f"cannot read {tok_dir / CONFIG_FILE}: {e}") from None
        jinja = jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else None
        key = config.get("chat_template") if isinstance(config, dict) else None
        if jinja is not None and key != jinja:
            atomic_write_json(config_file, {**config, "chat_template": jinja})
        elif jinja is None and isinstance(key, str) and key:
            atomic_write_text(jinja_file, key)
            out_files.append(jinja_file)
    return out_files


def export_hf(checkpoint: str | Path, out: str | Path, *, tokenizer: str | Path | None = None,
              dtype: str | None = None, force: bool = False) -> Path:
    """Write a Hugging Face model directory for ``checkpoint`` at ``out``; returns ``out``.

    Args:
        checkpoint: a step directory, a checkpoint folder with ``latest``, or a HF directory.
        out: the directory to create; it must not exist (or be empty) unless ``force``.
        tokenizer: directory with ``tokenizer.json`` (default: found next to the checkpoint).
        dtype: ``float32``/``bfloat16``/``float16`` for the saved weights (default: as stored).
        force: replace an existing non-empty ``out``.
    Raises:
        OlmoflowError: bad paths, unknown dtype, or a checkpoint that does not load.
    """
    if dtype is not None and dtype not in DTYPES:
        raise OlmoflowError(f"unknown dtype '{dtype}'; valid: {', '.join(DTYPES)}")
    kind, src = resolve_source(checkpoint)
    out = check_output(out, kind, src, force)
    model, tok, tok_dir = load_with_tokenizer(kind, src, tokenizer)
    return write_model_dir(model, out, tok_dir, dtype=dtype, tok=tok, manifest={
        "command": "olmoflow export hf", "source": str(src.resolve()), "source_kind": kind})


def load_with_tokenizer(kind: str, src: Path, tokenizer: str | Path | None = None):
    """``(model, tokenizer, tokenizer directory)`` of a source :func:`resolve_source` found: the
    tokenizer from ``tokenizer`` or beside the model (:func:`find_tokenizer`), the model of a
    step directory sized by it (:func:`load_step_model`) or a Hugging Face directory's.

    Raises:
        OlmoflowError: no tokenizer, weights that do not load, or a model vocabulary smaller than
            the tokenizer's.
    """
    from olmoflow.tokenizer import Tokenizer

    tok_dir = find_tokenizer(kind, src, tokenizer)
    tok = Tokenizer.from_pretrained(tok_dir)
    if kind == "step":
        model = load_step_model(src, tok.vocab_size)
    else:
        from olmoflow.model.olmo import Olmo

        model = Olmo.from_pretrained(src)
    if model.config.vocab_size < tok.vocab_size:
        raise OlmoflowError(f"the model's vocab ({model.config.vocab_size}) is smaller than the "
                            f"tokenizer's ({tok.vocab_size}) in '{tok_dir}'")
    return model, tok, tok_dir


def check_output(out: str | Path, kind: str, src: Path, force: bool) -> Path:
    """``out`` as a path, checked as the destination of a model directory written from the
    checkpoint ``src`` (``kind`` as :func:`resolve_source` says).

    Raises:
        OlmoflowError: ``out`` is non-empty without ``force``; it is, holds or lies inside the
            checkpoint or (for a step) its folder, whose other checkpoints ``force`` would delete;
            a parent of it is a file.
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise OlmoflowError(f"output '{out}' exists and is not empty; pass --force to replace it")
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise OlmoflowError(f"output '{out}' must not be inside the checkpoint '{src}'")
    ro, rs = out.resolve(), src.resolve()
    # A step directory's folder holds the run's other checkpoints, its log and its manifest:
    # --force on it (or on a folder above it) would delete them all.
    if ro in rs.parents or (kind == "step" and rs.parent in (ro, *ro.parents)):
        raise OlmoflowError(f"output '{out}' holds or lies inside the checkpoint folder "
                            f"'{src.parent}'; write the export outside it")
    blocked = next((p for p in ro.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise OlmoflowError(f"output '{out}': '{blocked}' is a file, not a directory")
    return out


def write_model_dir(model, out: Path, tok_dir: Path, *, manifest: dict,
                    dtype: str | None = None, tok=None) -> Path:
    """Write ``model`` as a Hugging Face directory at ``out`` (replacing it whole if it exists):
    the weights (``dtype`` or as stored), the tokenizer files of ``tok_dir``, and an
    ``export_manifest.json`` of ``manifest`` plus the tokenizer, architecture, parameter count,
    time and every file's sha256. Built in a temporary sibling and renamed into place, so ``out``
    is never half written. ``tok`` is the tokenizer of ``tok_dir`` when the caller has it loaded
    already. Returns ``out``.

    Raises:
        OlmoflowError: a write failure (a full disk names ``out``), or the save refused (a
            quantized model).
    """
    from olmoflow.model.hf import save_hf_dir
    from olmoflow.tokenizer import Tokenizer

    tok = tok if tok is not None else Tokenizer.from_pretrained(tok_dir)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        files = save_hf_dir(model, tmp, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id, dtype=DTYPES[dtype] if dtype else None)
        files += _copy_tokenizer_files(tok_dir, tmp, skip={f.name for f in files})
        arch = "Olmo3ForCausalLM" if model.config.sliding_window else "Olmo2ForCausalLM"
        atomic_write_json(tmp / "export_manifest.json", {
            **manifest, "tokenizer": str(Path(tok_dir).resolve()), "architecture": arch,
            "parameters": model.num_params(), "created": now(),
            "files": {f.name: sha256_file(f) for f in files},
        })
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OlmoflowError) and str(tmp) in str(e):  # a full disk: name what the
            raise OlmoflowError(str(e).replace(str(tmp), str(out))) from None  # user asked for
        raise
    return out
