"""Tokenizers: the :class:`BaseTokenizer` plug-in point and byte-level BPE on ``tokenizers``.

``Tokenizer.from_pretrained(dir)`` loads ours or any Hugging Face directory with ``tokenizer.json``
(an OLMo release, for instance).
"""

import os
import shutil
from pathlib import Path

from olmoflow.tokenizer.base import BaseTokenizer, BatchEncoding
from olmoflow.tokenizer.bpe import BPETokenizer

# The default tokenizer. An alias, so ``Tokenizer.from_pretrained`` returns a BPETokenizer.
Tokenizer = BPETokenizer

BUILTIN = {"bpe": BPETokenizer}


def tokenizer_class(implementation: str) -> type[BaseTokenizer]:
    """The tokenizer class named by ``tokenizer.implementation``: ``"bpe"`` or ``"module:Class"``.

    Raises:
        OlmoflowError: unknown name, a module that does not import, or a class that is not a
            :class:`BaseTokenizer` subclass.
    """
    import importlib

    from olmoflow.errors import OlmoflowError, unknown_name_error

    if implementation in BUILTIN:
        return BUILTIN[implementation]
    if ":" not in implementation:
        raise unknown_name_error("tokenizer.implementation", implementation,
                                 [*BUILTIN, "module:Class"])
    module, _, name = implementation.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise OlmoflowError(
            f"tokenizer.implementation '{implementation}' cannot be loaded: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, BaseTokenizer)):
        raise OlmoflowError(
            f"tokenizer.implementation '{implementation}' is not a BaseTokenizer subclass")
    return cls


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[Path]:
    """Copy every file a tokenizer saved in ``src`` (``tokenizer.json``, ``tokenizer_config.json``,
    ... or a custom tokenizer's own files) into ``dst``; returns the copies. Manifests and hidden
    temporary files are not tokenizer files and stay behind."""
    from olmoflow.artifacts import data_files

    out = []
    for f in data_files(src):  # a tokenizer directory is flat
        shutil.copyfile(f, Path(dst) / f.name)
        out.append(Path(dst) / f.name)
    return out


__all__ = ["BaseTokenizer", "BatchEncoding", "BPETokenizer", "Tokenizer", "copy_tokenizer_files",
           "tokenizer_class"]
