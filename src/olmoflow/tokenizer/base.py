"""The tokenizer plug-in point: :class:`BaseTokenizer`.

A tokenizer is swapped by subclassing :class:`BaseTokenizer` and implementing a few hooks:

- ``_train(files)``: learn the vocabulary from text files;
- ``_tokenize(text) -> list[int]``: text to ids, with no special tokens added;
- ``_decode(ids, skip_special_tokens) -> str``: ids to text;
- ``_vocab_size()``, ``_token_to_id(token)``, ``_token_byte_lengths()``;
- ``save(dir)`` and the classmethod ``load(dir)``.

Everything else (EOS handling, batching, the Hugging-Face-like ``__call__`` with left padding,
``token_byte_lengths`` for bits-per-byte) lives here, so every tokenizer behaves the same for the
rest of olmoflow.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from olmoflow.errors import OlmoflowError

DEFAULT_EOS = "<|endoftext|>"
DEFAULT_PAD = "<|pad|>"


class BatchEncoding(dict):
    """What ``tokenizer(text)`` returns: a dict with ``input_ids`` and ``attention_mask`` that also
    allows attribute access (``enc.input_ids``), like ``transformers.BatchEncoding``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to(self, device: Any) -> BatchEncoding:
        """Move tensor values to ``device`` (no-op for lists)."""
        return BatchEncoding(
            {k: (v.to(device) if hasattr(v, "to") else v) for k, v in self.items()}
        )


class BaseTokenizer:
    """Base class of olmoflow tokenizers.

    Args:
        eos_token: the end-of-document token (appended to every document when tokenizing data).
        pad_token: the padding token (used by ``__call__`` to left-pad batches).
        model_max_length: recorded in the saved config; not enforced by ``encode``.
    """

    def __init__(
        self,
        eos_token: str = DEFAULT_EOS,
        pad_token: str = DEFAULT_PAD,
        model_max_length: int = 1_000_000,
    ) -> None:
        self._eos_token = eos_token
        self._pad_token = pad_token
        self.model_max_length = model_max_length

    # ---- hooks for subclasses -------------------------------------------------------------------

    def _train(self, files: list[str]) -> None:
        raise NotImplementedError

    def _tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def _decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def _vocab_size(self) -> int:
        raise NotImplementedError

    def _token_to_id(self, token: str) -> int | None:
        raise NotImplementedError

    def _token_byte_lengths(self) -> np.ndarray:
        raise NotImplementedError

    def save(self, directory: str | os.PathLike) -> list[Path]:
        """Save into ``directory`` (created if needed); return the files written."""
        raise NotImplementedError

    @classmethod
    def load(cls, directory: str | os.PathLike) -> BaseTokenizer:
        """Load a tokenizer saved by :meth:`save`. Raises OlmoflowError if it is missing."""
        raise NotImplementedError

    # ---- the common API -------------------------------------------------------------------------

    def train(self, files: Sequence[str | os.PathLike]) -> BaseTokenizer:
        """Learn the vocabulary from ``files``; returns self.

        Raises:
            OlmoflowError: a file is missing.
        """
        paths = [str(f) for f in files]
        for p in paths:
            if not os.path.isfile(p):
                raise OlmoflowError(f"tokenizer training file not found: {p}")
        self._train(paths)
        return self

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (ids are ``0 .. vocab_size - 1``)."""
        return self._vocab_size()

    @property
    def eos_token(self) -> str:
        return self._eos_token

    @property
    def pad_token(self) -> str:
        return self._pad_token

    @property
    def eos_token_id(self) -> int:
        """Id of the EOS token. Raises OlmoflowError if the vocabulary lacks it."""
        return self._required_id(self._eos_token, "eos")

    @property
    def pad_token_id(self) -> int:
        """Id of the pad token. Raises OlmoflowError if the vocabulary lacks it."""
        return self._required_id(self._pad_token, "pad")

    def _required_id(self, token: str, role: str) -> int:
        i = self._token_to_id(token)
        if i is None:
            raise OlmoflowError(f"{role} token {token!r} is not in the tokenizer's vocabulary")
        return i

    def encode(self, text: str, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``; with ``add_eos`` the EOS id is appended."""
        ids = self._tokenize(text)
        return ids + [self.eos_token_id] if add_eos else ids

    def encode_batch(self, texts: Sequence[str], add_eos: bool = False) -> list[list[int]]:
        """``[encode(t, add_eos) for t in texts]``; subclasses may override with a faster path."""
        return [self.encode(t, add_eos=add_eos) for t in texts]

    def decode(self, ids: Sequence[int] | Any, skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (a list, numpy array or 1-D tensor). Special tokens are dropped unless
        ``skip_special_tokens=False``."""
        return self._decode(_to_list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(
        self, batch: Sequence[Any] | Any, skip_special_tokens: bool = True
    ) -> list[str]:
        """``decode`` of each row of ``batch`` (lists, or a 2-D array/tensor)."""
        return [self.decode(row, skip_special_tokens=skip_special_tokens) for row in batch]

    def token_byte_lengths(self) -> np.ndarray:
        """For each id, how many UTF-8 bytes of text the token stands for; 0 for special tokens.

        Shape ``[vocab_size]``, dtype int32. ``lengths[ids].sum()`` is the byte length of the
        decoded text of a sequence without special tokens, which is the denominator of
        bits-per-byte: ``bpb = sum(nll_nats) / (ln(2) * sum(lengths[targets]))``.
        """
        return np.asarray(self._token_byte_lengths(), dtype=np.int32)

    def __call__(
        self,
        text: str | Sequence[str],
        return_tensors: str | None = None,
        padding: bool | str = False,
        add_eos: bool = False,
    ) -> BatchEncoding:
        """Encode like a Hugging Face tokenizer.

        Args:
            text: one string or a list of strings.
            return_tensors: None (Python lists) or "pt" (torch int64 tensors of shape [batch, seq]).
            padding: True or "longest" pads every row on the LEFT with ``pad_token_id`` to the
                longest row (generation continues from the right end); ``attention_mask`` is 0 on
                pads.
            add_eos: append EOS to each row before padding.

        Returns:
            BatchEncoding with ``input_ids`` and ``attention_mask``. For a single string without
            tensors they are flat lists, as in ``transformers``.

        Raises:
            OlmoflowError: unknown ``return_tensors``, or rows of different lengths as tensors
                without ``padding``.
        """
        if return_tensors not in (None, "pt"):
            raise OlmoflowError(
                f"return_tensors={return_tensors!r} is not supported; use 'pt' or None"
            )
        single = isinstance(text, str)
        rows = self.encode_batch([text] if single else list(text), add_eos=add_eos)
        masks = [[1] * len(r) for r in rows]
        if padding and padding != "do_not_pad":
            width = max((len(r) for r in rows), default=0)
            pad = self.pad_token_id
            masks = [[0] * (width - len(r)) + m for r, m in zip(rows, masks)]
            rows = [[pad] * (width - len(r)) + r for r in rows]
        if return_tensors == "pt":
            import torch

            if len({len(r) for r in rows}) > 1:
                raise OlmoflowError("rows have different lengths; pass padding=True to stack them")
            width = len(rows[0]) if rows else 0
            ids = torch.tensor(rows, dtype=torch.long).reshape(len(rows), width)
            mask = torch.tensor(masks, dtype=torch.long).reshape(len(rows), width)
            return BatchEncoding(input_ids=ids, attention_mask=mask)
        if single:
            return BatchEncoding(input_ids=rows[0], attention_mask=masks[0])
        return BatchEncoding(input_ids=rows, attention_mask=masks)

    def __len__(self) -> int:
        return self.vocab_size


def _to_list(ids: Any) -> list[int]:
    """Accept a list, numpy array or tensor of ids; return a flat list of Python ints."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, int):
        return [ids]
    return [int(i) for i in ids]
