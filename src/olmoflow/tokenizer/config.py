"""Config section of tokenizer training."""

from __future__ import annotations

from dataclasses import dataclass

from olmoflow.errors import OlmoflowError, unknown_name_error

# How text is cut into pieces before BPE merges (a merge never crosses a piece boundary).
# "cl100k": OLMo 2/3's dolma2 tokenizer split (cl100k's): digits in groups of 1-3, a newline run
#   kept whole (and glued to the punctuation before it; the indentation after it is a piece of its
#   own), letters with at most one leading non-letter.
# "gpt2": GPT-2's byte-level split, the default before cl100k; it cuts ".\n\nThe" into ".", "\n",
#   "\n", "The" (a newline run is kept whole only before more whitespace), digits unbounded.
PRE_TOKENIZERS = ("cl100k", "gpt2")
# The smallest byte-level BPE vocabulary: a symbol per byte, plus the EOS and pad tokens.
BPE_MIN_VOCAB = 256 + 2


@dataclass
class TokenizerConfig:
    """Tokenizer training. ``implementation`` is ``"bpe"`` (byte-level BPE on the ``tokenizers``
    library) or a :class:`~olmoflow.tokenizer.BaseTokenizer` subclass of your own, constructed
    with ``eos_token`` and ``pad_token``: ``"package.module:ClassName"`` (importable, never from
    the current directory implicitly) or ``"path/to/file.py:ClassName"``. Either runs that code.

    ``pre_tokenizer`` (``cl100k`` | ``gpt2``) is the byte-level BPE's split, used in training and
    saved in ``tokenizer.json`` for encoding (see :data:`PRE_TOKENIZERS`); a tokenizer that is
    loaded keeps the split it was saved with. A custom ``implementation`` ignores it.

    Raises:
        OlmoflowError: an unknown ``pre_tokenizer``; a ``vocab_size`` below 1, or for ``bpe``
            below 258 (its 256 byte symbols and 2 special tokens); a ``min_frequency`` below 0.
    """

    implementation: str = "bpe"
    vocab_size: int = 8192
    min_frequency: int = 2
    eos_token: str = "<|endoftext|>"
    pad_token: str = "<|pad|>"
    pre_tokenizer: str = "cl100k"

    def __post_init__(self) -> None:
        if self.pre_tokenizer not in PRE_TOKENIZERS:
            raise unknown_name_error("tokenizer.pre_tokenizer", self.pre_tokenizer, PRE_TOKENIZERS)
        # Checked when the config is loaded, before a rerun touches the stage's finished output.
        least = BPE_MIN_VOCAB if self.implementation == "bpe" else 1
        if self.vocab_size < least:
            why = " (byte-level BPE: 256 byte symbols + 2 special tokens)" if least > 1 else ""
            raise OlmoflowError(
                f"tokenizer.vocab_size must be at least {least}{why}, got {self.vocab_size}")
        # The BPE trainer takes an unsigned count: a negative one fails only when training starts.
        if self.min_frequency < 0:
            raise OlmoflowError(f"tokenizer.min_frequency must be >= 0, got {self.min_frequency}")
