"""Config section of tokenizer training."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenizerConfig:
    """Tokenizer training. ``implementation`` is ``"bpe"`` (byte-level BPE on the ``tokenizers``
    library) or ``"package.module:ClassName"``, a :class:`~olmoflow.tokenizer.BaseTokenizer`
    subclass of your own, constructed with ``eos_token`` and ``pad_token``."""

    implementation: str = "bpe"
    vocab_size: int = 8192
    min_frequency: int = 2
    eos_token: str = "<|endoftext|>"
    pad_token: str = "<|pad|>"
