"""Streaming text out of generation without ever splitting a UTF-8 character.

Byte-level BPE tokens can end in the middle of a multi-byte character (an emoji is 4 bytes, a CJK
character 3, and a token may hold only some of them). Decoding such a prefix gives the Unicode
replacement character U+FFFD at the end, which means "wait for more bytes". The
:class:`IncrementalDecoder` follows the offset scheme of Hugging Face's text-generation-inference
(``decode_token`` with ``prefix_offset`` / ``read_offset``): decode a short window of already
emitted ids, decode the same window plus the new ids, and emit the difference only when it does not
end in U+FFFD. Each step decodes a few tokens, not the whole sequence, so streaming stays O(n).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from olmoflow.infer.generate import iter_tokens

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Turn a growing list of ids into text pieces that never end inside a character.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)``.
        context_ids: ids before the streamed ones (e.g. the prompt); the last few are used as
            decoding context (some decoders treat the first token of a sequence specially) but are
            never emitted.
        skip_special_tokens: passed to ``decode``.

    ``push(ids)`` returns the new complete text (possibly ``""``); ``flush()`` returns what is
    still held back (incomplete bytes decode to U+FFFD there, as in a full decode). The
    concatenation of every piece equals ``tokenizer.decode(streamed_ids)`` for byte-level
    tokenizers.
    """

    def __init__(self, tokenizer: Any, context_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True, context: int = 5):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = [int(i) for i in context_ids][-context:] if context else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: int | Sequence[int] | torch.Tensor) -> str:
        """Add ``ids`` (an int, a list, or a tensor with one row) and return the newly complete
        text."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        elif isinstance(ids, int):
            ids = [ids]
        self.ids.extend(int(i) for i in ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        if len(text) > len(prefix) and not text.endswith(REPLACEMENT):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix) :]
        return ""

    def flush(self) -> str:
        """The text of ids not yet emitted (may end in U+FFFD if the bytes never completed)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix) :]


class TextStreamer:
    """A ``streamer=`` for :func:`olmoflow.infer.generate.generate` (batch 1), like
    ``transformers.TextStreamer``: ``put(tokens)`` per step, ``end()`` once.

    Args:
        tokenizer: decodes the ids.
        on_text: called with each complete text piece; default prints it without a newline.
        skip_special_tokens: drop special tokens (EOS) from the text.
    Raises:
        ValueError: from ``put`` when given more than one row.
    """

    def __init__(self, tokenizer: Any, on_text: Callable[[str], None] | None = None, *,
                 skip_special_tokens: bool = True):
        self.decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip_special_tokens)
        self.on_text = on_text or (lambda s: print(s, end="", flush=True))
        self.text = ""

    def put(self, tokens: torch.Tensor | int | Sequence[int]) -> None:
        if isinstance(tokens, torch.Tensor) and tokens.numel() != 1:
            raise ValueError(
                f"TextStreamer streams one row; got tokens of shape {tuple(tokens.shape)}")
        self._emit(self.decoder.push(tokens))

    def end(self) -> None:
        self._emit(self.decoder.flush())

    def _emit(self, piece: str) -> None:
        if piece:
            self.text += piece
            self.on_text(piece)


def stream_generate(
    model, tokenizer: Any, prompt: str | Sequence[int] | torch.Tensor, *,
    skip_special_tokens: bool = True, **generate_kwargs: Any,
) -> Iterator[str]:
    """Generate from one prompt and yield text pieces as tokens arrive.

    Args:
        prompt: a string (encoded with ``tokenizer.encode``), a list of ids, or ``[T]``/``[1, T]``.
        generate_kwargs: as for :func:`olmoflow.infer.generate.generate` (``sampling=`` a
            :class:`~olmoflow.infer.sampling.SamplingParams`, or max_new_tokens, do_sample,
            temperature, top_k, top_p, repetition_penalty, seed, stop_strings, ...).
            ``eos_token_id`` defaults to the tokenizer's EOS id when it has one; ``tokenizer`` is
            passed through for stop strings.
    Yields:
        Non-empty strings whose concatenation is the decoded continuation; no piece ends inside a
        multi-byte character, so no piece holds U+FFFD unless the full decode does.
    Raises:
        ValueError: a batch of prompts (stream one row at a time), or any error of ``generate``
            (raised by this call, before the first piece).
    """
    if isinstance(prompt, str):
        ids = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long)
    else:
        ids = torch.as_tensor(prompt, dtype=torch.long)
        ids = ids[None] if ids.dim() == 1 else ids
    if ids.shape[0] != 1:
        raise ValueError(f"stream_generate takes one prompt; got a batch of {ids.shape[0]}")
    ids = ids.to(model.device) if hasattr(model, "device") else ids
    if "eos_token_id" not in generate_kwargs:
        try:
            generate_kwargs["eos_token_id"] = tokenizer.eos_token_id
        except Exception:  # a tokenizer without EOS: stream until max_new_tokens
            pass
    generate_kwargs.setdefault("tokenizer", tokenizer)
    steps = iter_tokens(model, ids, **generate_kwargs)
    decoder = IncrementalDecoder(tokenizer, ids[0].tolist(),
                                 skip_special_tokens=skip_special_tokens)
    return _pieces(steps, decoder)


def _pieces(steps: Iterator[torch.Tensor], decoder: IncrementalDecoder) -> Iterator[str]:
    for nxt in steps:
        piece = decoder.push(nxt)
        if piece:
            yield piece
    rest = decoder.flush()
    if rest:
        yield rest
