"""Engine events -> the JSON bodies and SSE chunks of the OpenAI API.

Shapes follow the OpenAI API reference (and vLLM's ``serving_completion`` / ``serving_chat``):

- completions: ``{"id": "cmpl-...", "object": "text_completion", "created", "model",
  "choices": [{"index", "text", "logprobs", "finish_reason"}], "usage"}``; ``logprobs`` is the
  legacy object ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` whose
  ``top_logprobs`` maps token text -> logprob for the ``k`` most likely tokens plus the chosen
  one (so up to ``k + 1`` entries, as the reference says), ``null`` for the first prompt token
  under ``echo``;
- chat: ``{"id": "chatcmpl-...", "object": "chat.completion", ..., "choices": [{"index",
  "message": {"role": "assistant", "content"}, "logprobs", "finish_reason"}]}`` with
  ``logprobs`` ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}]}], "refusal": null}`` (exactly ``top_logprobs`` alternatives);
- streaming: ``text_completion`` / ``chat.completion.chunk`` objects sent as
  ``data: {json}\\n\\n`` server-sent events, ending ``data: [DONE]\\n\\n``; chat deltas start with
  ``{"role": "assistant", "content": ""}``; the chunk with ``finish_reason`` has an empty delta;
  with ``stream_options.include_usage`` every chunk carries ``"usage": null`` and a last chunk
  has ``"choices": []`` and the usage.

A logprob of ``-inf`` (a token the model gives no mass) is sent as -9999.0, as vLLM does: JSON
has no infinity.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from olmoflow.serve.engine import TokenLogprob

NEG_INF = -9999.0


def new_id(prefix: str) -> str:
    """``prefix-<32 hex digits>`` (``cmpl``, ``chatcmpl``), unique per request."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """``created``: Unix time in whole seconds."""
    return int(time.time())


def _lp(value: float) -> float:
    return value if value > NEG_INF else NEG_INF


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event ``data: ...\\n\\n`` (a dict as compact JSON; ``"[DONE]"`` as is)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False,
                                                       separators=(",", ":"))
    return f"data: {data}\n\n".encode()


DONE = sse("[DONE]")


class CompletionLogprobs:
    """Builds the legacy completions ``logprobs`` object one event at a time; ``text_offset``
    counts characters from the start of the choice's returned ``text`` (the prompt's start under
    ``echo``), so offsets continue across stream chunks.

    Args:
        k: alternatives per token (the request's ``logprobs``).
    """

    def __init__(self, k: int):
        self.k = k
        self.offset = 0

    def add(self, entries: Sequence[TokenLogprob | None], none_text: str = "") -> dict[str, Any]:
        """The object for ``entries`` (one per token; None: no logprob, the first prompt token
        under ``echo``, whose text is ``none_text``)."""
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
        for e in entries:
            if e is None:
                out["tokens"].append(none_text)
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                out["text_offset"].append(self.offset)
                self.offset += len(none_text)
                continue
            top = {t: _lp(lp) for _, t, _, lp in e.top[: self.k]}
            top.setdefault(e.token, _lp(e.logprob))
            out["tokens"].append(e.token)
            out["token_logprobs"].append(_lp(e.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(e.token)
        return out


def chat_logprobs(entries: Sequence[TokenLogprob], k: int) -> dict[str, Any]:
    """The chat ``logprobs`` object for ``entries`` with ``k`` alternatives each."""
    return {"content": [
        {"token": e.token, "logprob": _lp(e.logprob), "bytes": list(e.bytes),
         "top_logprobs": [{"token": t, "logprob": _lp(lp), "bytes": list(b)}
                          for _, t, b, lp in e.top[:k]]}
        for e in entries], "refusal": None}


def _envelope(rid: str, obj: str, created: int, model: str,
              choices: list[dict[str, Any]], **rest: Any) -> dict[str, Any]:
    """The fields every response and chunk of the OpenAI API share, then ``rest``."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
            **rest}


def _chunk(rid: str, obj: str, created: int, model: str, choice: dict[str, Any],
           with_usage: bool) -> dict[str, Any]:
    """A streamed chunk of one choice; ``usage`` is null on it under ``include_usage`` (the
    usage comes in a chunk of its own at the end)."""
    return _envelope(rid, obj, created, model, [choice], **({"usage": None} if with_usage else {}))


def completion_body(rid: str, created: int, model: str, choices: list[dict[str, Any]],
                    use: dict[str, int]) -> dict[str, Any]:
    """A whole (non-streamed) completions response."""
    return _envelope(rid, "text_completion", created, model, choices, usage=use)


def completion_chunk(rid: str, created: int, model: str, index: int, text: str,
                     logprobs: dict[str, Any] | None, finish_reason: str | None,
                     with_usage: bool) -> dict[str, Any]:
    """One streamed completions chunk for choice ``index``."""
    return _chunk(rid, "text_completion", created, model,
                  {"index": index, "text": text, "logprobs": logprobs,
                   "finish_reason": finish_reason}, with_usage)


def chat_body(rid: str, created: int, model: str, choices: list[dict[str, Any]],
              use: dict[str, int]) -> dict[str, Any]:
    """A whole (non-streamed) chat response."""
    return _envelope(rid, "chat.completion", created, model, choices, usage=use)


def chat_choice(index: int, text: str, logprobs: dict[str, Any] | None,
                finish_reason: str | None) -> dict[str, Any]:
    """One choice of a chat response."""
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict[str, Any],
               logprobs: dict[str, Any] | None, finish_reason: str | None,
               with_usage: bool) -> dict[str, Any]:
    """One streamed ``chat.completion.chunk`` for choice ``index``."""
    return _chunk(rid, "chat.completion.chunk", created, model,
                  {"index": index, "delta": delta, "logprobs": logprobs,
                   "finish_reason": finish_reason}, with_usage)


def usage_chunk(rid: str, created: int, model: str, obj: str,
                use: dict[str, int]) -> dict[str, Any]:
    """The last chunk under ``include_usage``: no choices, the request's usage."""
    return _envelope(rid, obj, created, model, [], usage=use)
