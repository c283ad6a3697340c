"""Tokenizers: the :class:`BaseTokenizer` plug-in point and byte-level BPE on ``tokenizers``.

``Tokenizer.from_pretrained(dir)`` loads ours or any Hugging Face directory with ``tokenizer.json``
(an OLMo release, for instance).
"""

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
        raise unknown_name_error("tokenizer.implementation", implementation, [*BUILTIN, "module:Class"])
    module, _, name = implementation.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise OlmoflowError(f"tokenizer.implementation '{implementation}' cannot be loaded: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, BaseTokenizer)):
        raise OlmoflowError(f"tokenizer.implementation '{implementation}' is not a BaseTokenizer subclass")
    return cls


__all__ = ["BaseTokenizer", "BatchEncoding", "BPETokenizer", "Tokenizer", "tokenizer_class"]
