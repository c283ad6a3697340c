"""The tokenizer plug-in point: :class:`BaseTokenizer`.

A tokenizer is swapped by subclassing :class:`BaseTokenizer` and implementing a few hooks:

- ``_train(files)``: learn the vocabulary from text files;
- ``_tokenize(text) -> list[int]``: text to ids, with no special tokens added;
- ``_decode(ids, skip_special_tokens) -> str``: ids to text;
- ``_vocab_size()``, ``_token_to_id(token)``, ``_token_byte_lengths()``;
- ``save(dir)`` and the classmethod ``load(dir)``;
- optionally ``add_special_tokens(tokens)`` (chat templates need it) and
  ``encode_with_offsets(text)`` (exact loss masks for text runs; see
  :mod:`olmoflow.tokenizer.chat`), and ``added_tokens()`` (the tokens a chat template's text is
  cut at).

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
        bos_token: the beginning-of-sequence token, or None (pretraining uses none; the Tülu /
            OLMo 2 chat template starts each conversation with one).

    Attributes:
        chat_template: the Jinja chat template saved with the tokenizer (``chat_template.jinja``
            and ``tokenizer_config.json``), or None; :func:`olmoflow.tokenizer.chat.render`
            renders it, as ``transformers`` does from the files.
    """

    def __init__(
        self,
        eos_token: str = DEFAULT_EOS,
        pad_token: str = DEFAULT_PAD,
        model_max_length: int = 1_000_000,
        bos_token: str | None = None,
    ) -> None:
        self._eos_token = eos_token
        self._pad_token = pad_token
        self._bos_token = bos_token
        self.model_max_length = model_max_length
        self.chat_template: str | None = None

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

    def _add_special_tokens(self, tokens: list[str]) -> int:
        raise OlmoflowError(f"{type(self).__name__} cannot add special tokens")

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of ``text`` (no special tokens) and each token's ``(start, end)`` character
        span in ``text``. Raises NotImplementedError when the tokenizer cannot say; callers then
        encode the parts of a text separately."""
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
    def bos_token(self) -> str | None:
        return self._bos_token

    @property
    def bos_token_id(self) -> int | None:
        """Id of the BOS token, None when the tokenizer has none. Raises OlmoflowError if one is
        set but missing from the vocabulary."""
        return None if self._bos_token is None else self._required_id(self._bos_token, "bos")

    def add_special_tokens(self, tokens: Sequence[str]) -> int:
        """Add ``tokens`` to the vocabulary as special tokens (new ids after the current ones, in
        order; tokens already present are kept as they are); return how many were new.

        A special token is inserted by id only (:func:`olmoflow.tokenizer.chat.render`),
        never matched in user text, and has byte length 0. Grow the model with
        :func:`olmoflow.model.olmo.resize_token_embeddings` afterwards.

        Raises:
            OlmoflowError: an empty token, or a tokenizer that cannot add tokens.
        """
        new = [t for t in dict.fromkeys(tokens) if self._token_to_id(t) is None]
        for t in new:
            if not isinstance(t, str) or not t:
                raise OlmoflowError(f"special token {t!r} must be a non-empty string")
        return self._add_special_tokens(new) if new else 0

    def set_special_tokens(self, *, eos: str | None = None, bos: str | None = None,
                           pad: str | None = None) -> None:
        """Make existing vocabulary entries the EOS / BOS / pad token (None keeps the current
        one). A chat template may end turns with its own token (OLMo 3: ``<|im_end|>``).

        Raises:
            OlmoflowError: a token that is not in the vocabulary.
        """
        for role, token in (("eos", eos), ("bos", bos), ("pad", pad)):
            if token is not None:
                self._required_id(token, role)
        self._eos_token = eos if eos is not None else self._eos_token
        self._bos_token = bos if bos is not None else self._bos_token
        self._pad_token = pad if pad is not None else self._pad_token

    @property
    def eos_token_id(self) -> int:
        """Id of the EOS token. Raises OlmoflowError if the vocabulary lacks it."""
        return self._required_id(self._eos_token, "eos")

    @property
    def pad_token_id(self) -> int:
        """Id of the pad token. Raises OlmoflowError if the vocabulary lacks it."""
        return self._required_id(self._pad_token, "pad")

    def token_to_id(self, token: str) -> int | None:
        """The id of ``token`` (a vocabulary entry, special or not), or None when it is not in
        the vocabulary. Text is never looked up this way: use :meth:`encode`."""
        return self._token_to_id(token)

    def added_tokens(self) -> list[str]:
        """The tokens matched as whole units in a chat template's rendered text (the added
        tokens of ``tokenizer.json``, as ``transformers`` matches them); by default the EOS, pad
        and BOS tokens in the vocabulary."""
        return [t for t in dict.fromkeys((self._eos_token, self._pad_token, self._bos_token))
                if t is not None and self._token_to_id(t) is not None]

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
