"""Tokenizers: the :class:`BaseTokenizer` plug-in point and byte-level BPE on ``tokenizers``.

``Tokenizer.from_pretrained(dir)`` loads ours or any Hugging Face directory with ``tokenizer.json``
(an OLMo release, for instance).
"""

from olmoflow.tokenizer.base import BaseTokenizer, BatchEncoding
from olmoflow.tokenizer.bpe import BPETokenizer

# The default tokenizer. An alias, so ``Tokenizer.from_pretrained`` returns a BPETokenizer.
Tokenizer = BPETokenizer

__all__ = ["BaseTokenizer", "BatchEncoding", "BPETokenizer", "Tokenizer"]
