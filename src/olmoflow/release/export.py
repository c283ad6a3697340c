"""Export a training checkpoint to a Hugging Face model directory (``olmoflow export hf``).

The output loads with ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` as
``Olmo3ForCausalLM`` (``Olmo2ForCausalLM`` when the model has no sliding windows) and with
``AutoTokenizer.from_pretrained(OUT)`` giving the same token ids as olmoflow's tokenizer.

Sources are any form :func:`olmoflow.model.load.load_model` reads (a step directory, a folder of
checkpoints or its ``latest``, a Hugging Face directory such as a release, re-exported optionally
in another dtype, a run directory with a release, a Hub id), with the tokenizer it finds
(``--tokenizer`` overrides it). The tokenizer's files are copied as they are, its chat template
included: ``chat_template.jinja`` and the ``chat_template`` key of ``tokenizer_config.json`` are
both written when either is there (``transformers`` prefers the ``.jinja`` file), so
``apply_chat_template`` on the export gives the ids
:func:`olmoflow.tokenizer.chat.render` gives.
The directory is assembled under a temporary name beside ``OUT`` and renamed onto it when complete.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from olmoflow.artifacts import atomic_write_json, atomic_write_text, data_files, now, sha256_file
from olmoflow.errors import OlmoflowError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


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
    from olmoflow.model.load import load_model, resolve_source

    kind, src = resolve_source(checkpoint)
    out = check_output(out, kind, src, force)  # before the (slow) load
    loaded = load_model(src, tokenizer=tokenizer)
    return write_model_dir(loaded.model, out, loaded.tokenizer_dir, dtype=dtype,
                           tok=loaded.tokenizer, manifest={
                               "command": "olmoflow export hf", "source": str(src.resolve()),
                               "source_kind": kind})


def check_output(out: str | Path, kind: str, src: Path, force: bool) -> Path:
    """``out`` as a path, checked as the destination of a model directory written from the
    checkpoint ``src`` (``kind`` as :func:`olmoflow.model.load.resolve_source` says).

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
