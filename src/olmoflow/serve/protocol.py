"""Request models of the OpenAI-compatible API, and the checks of their values.

Field names, types and defaults follow the OpenAI API reference for ``POST /v1/completions`` and
``POST /v1/chat/completions``, with vLLM's extensions ``top_k`` and ``repetition_penalty``
(vLLM's ``protocol.py``). Parsing is in two steps so that each mistake gets its own clear 400:

1. :func:`parse_request` turns the raw body into a model: malformed JSON, a body that is not a
   JSON object, and wrong types (pydantic errors, strict: ``"0.5"`` is not a number, ``1.0`` is
   not an integer, ``true`` is not an integer) each raise :class:`~olmoflow.serve.errors.APIError`
   naming the field as OpenAI does (``Invalid type for 'temperature': expected a number, but got
   a string instead``).
2. :func:`check_completion` / :func:`check_chat` check the values (ranges, empty prompt or
   messages, unknown role, unsupported penalties) against the server's :class:`Limits`.

Unknown fields are ignored (OpenAI and vLLM do the same), ``null`` means the default, and
``presence_penalty`` / ``frequency_penalty`` are accepted only when 0 (the engine has the CTRL
``repetition_penalty`` instead; any other value is a 400 naming the field, never a silent no-op).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from olmoflow.serve.errors import APIError, invalid
from olmoflow.serve.limits import Limits

__all__ = ["ChatCompletionRequest", "Checked", "CompletionRequest", "Limits", "check_chat",
           "check_completion", "check_context", "parse_request", "validation_error"]

MAX_STOP = 16          # stop strings per request (vLLM has no limit, OpenAI 4)
MAX_LOGPROBS = 20      # top alternatives per token (vLLM's default max_logprobs)
MAX_SEED = 2**63 - 1 - 1024   # room for seed + i across n choices and prompts
ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {"developer": "system"}


class _Model(BaseModel):
    # strict: JSON types are taken as they are ("16" is not an integer); extra fields ignored.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Model):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and no choices."""

    include_usage: bool | None = None


class TextPart(_Model):
    """One part of a message's ``content`` list; only ``{"type": "text", "text": ...}``."""

    type: str
    text: str | None = None


class ChatMessage(_Model):
    """One message: ``role`` (``system``, ``user``, ``assistant``; ``developer`` is read as
    ``system``) and ``content`` (a string or a list of text parts; None only for an assistant)."""

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class _Sampling(_Model):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # accepted only at their no-op values (a client library may send them): 400 otherwise
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions`` (OpenAI's legacy completions; defaults: ``max_tokens`` 16,
    ``temperature`` 1, ``top_p`` 1, ``n`` 1). ``prompt`` is a string, a list of strings, a list
    of token ids, or a list of lists of token ids (several prompts: ``n`` choices each, prompt
    ``p``'s choice ``i`` at index ``p * n + i``). ``logprobs`` (0..20) asks for that many
    alternatives per token besides the chosen one; ``echo`` returns the prompt before the
    completion (with the prompt tokens' logprobs when ``logprobs`` is set)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` is the newer name of
    ``max_tokens`` (either; default: what fits in the context, up to the server's cap).
    ``logprobs`` is a bool here, ``top_logprobs`` (0..20) the alternatives per token."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


# ---- step 1: body -> model -------------------------------------------------------------------

# What a field holds, for "expected ..." in type errors of union fields (pydantic would list
# every member of the union).
EXPECTED = {
    "prompt": "a string, an array of strings, an array of token ids or an array of arrays of "
              "token ids",
    "stop": "a string or an array of strings",
    "messages": "an array of message objects",
    "content": "a string or an array of text content parts",
    "stream_options": "an object",
}
_TYPE_WORDS = {"int_type": "an integer", "int_from_float": "an integer",
               "float_type": "a number", "string_type": "a string", "bool_type": "a boolean",
               "list_type": "an array", "model_type": "an object", "dict_type": "an object",
               "model_attributes_type": "an object"}
_TAGS = {"str", "int", "float", "bool", "list", "dict", "none",
         "TextPart", "ChatMessage", "StreamOptions"}


def _got(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _param(loc: tuple[Any, ...]) -> str:
    """The dotted field path of a pydantic ``loc`` without its union member tags
    (``('prompt', 'list[int]', 1)`` -> ``prompt.1``)."""
    parts = [str(p) for p in loc
             if p != "body" and not (isinstance(p, str) and ("[" in p or p in _TAGS))]
    return ".".join(parts)


def _is_tag(p: Any) -> bool:
    return isinstance(p, str) and ("[" in p or p in _TAGS)


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The 400 for pydantic ``errors`` (``ValidationError.errors()``): the first field at fault,
    in the OpenAI API's wording (``Missing required parameter: 'messages'``, ``Invalid type for
    'n': expected an integer, but got a string instead``)."""
    if not errors:
        return invalid("Invalid request body")
    first = errors[0]
    loc = tuple(first["loc"])
    tag = next((i for i, p in enumerate(loc) if _is_tag(p)), None)
    if tag is not None:
        # a union field fails once per member: name the field and what it may hold (the first
        # member's error carries the field's whole value as its input)
        field = _param(loc[:tag])
        want = EXPECTED.get(str(loc[tag - 1]) if tag else "", "another type")
        return invalid(f"Invalid type for '{field}': expected {want}, but got "
                       f"{_got(first.get('input'))} instead", param=field)
    top = _param(loc)
    kind = first.get("type", "")
    if kind == "missing":
        return invalid(f"Missing required parameter: '{top}'", param=top)
    if kind in _TYPE_WORDS:
        return invalid(f"Invalid type for '{top}': expected {_TYPE_WORDS[kind]}, but got "
                       f"{_got(first.get('input'))} instead", param=top)
    return invalid(f"Invalid value for '{top}': {first.get('msg', 'invalid')}", param=top)


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_request(raw: bytes, kind: type[_Sampling]) -> Any:
    """Parse a request body into ``kind`` (:class:`CompletionRequest` or
    :class:`ChatCompletionRequest`).

    Raises:
        APIError: 400 for a body that is not UTF-8 JSON (``NaN`` / ``Infinity`` included, which
            Python's ``json`` would accept), nested too deeply, not a JSON object, or of wrong
            field types.
    """
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except RecursionError:
        raise invalid("The request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid("We could not parse the JSON body of your request (HINT: send a JSON "
                      f"object with 'Content-Type: application/json'; {str(e)[:120]})") from None
    if not isinstance(body, dict):
        raise invalid(f"The request body must be a JSON object, got {_got(body)}")
    try:  # JSON's \ud800 escapes decode to lone surrogates, which no tokenizer can take
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise invalid("The request body holds a lone UTF-16 surrogate (such as \\ud800), which "
                      "is not valid Unicode text") from None
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None
    except RecursionError:  # absurdly nested arrays
        raise invalid("The request body is nested too deeply") from None


# ---- step 2: value checks --------------------------------------------------------------------

@dataclass(frozen=True)
class Checked:
    """What both endpoints share after the value checks.

    Attributes:
        max_tokens: the requested maximum of new tokens, or None (the endpoint's default).
        temperature, top_p, top_k, repetition_penalty: resolved sampling settings (``top_k``
            None: all tokens; ``top_p`` None: no nucleus filter).
        stop: stop strings.
        seed: the base seed (choice ``i`` uses ``seed + i``), or None (random).
        n: choices per prompt.
        stream, include_usage: the streaming settings.
        logprobs: alternatives per token (None: no logprobs).
        min_tokens: new tokens before EOS or a stop token id may end a choice (vLLM's
            extension; stop strings still stop).
        ignore_eos: never end a choice at EOS or a stop token id (vLLM's extension): it runs to
            ``max_tokens`` or a stop string; for benchmarks that must generate a fixed count.
    """

    max_tokens: int | None
    temperature: float
    top_p: float | None
    top_k: int | None
    repetition_penalty: float
    stop: tuple[str, ...]
    seed: int | None
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    min_tokens: int = 0
    ignore_eos: bool = False


def _finite(value: float, name: str) -> None:
    if not math.isfinite(value):
        raise invalid(f"'{name}' must be a finite number, got {value}", param=name)


def _check_common(r: _Sampling, limits: Limits, *, min_tokens: int,
                  max_tokens: int | None, max_tokens_name: str,
                  logprobs: int | None, logprobs_name: str) -> Checked:
    if max_tokens is not None:
        if max_tokens < min_tokens:
            raise invalid(f"'{max_tokens_name}' must be >= {min_tokens}, got {max_tokens}",
                          param=max_tokens_name)
        if max_tokens > limits.max_tokens:
            raise invalid(f"'{max_tokens_name}' must be <= {limits.max_tokens} (this server's "
                          f"--max-tokens), got {max_tokens}", param=max_tokens_name)
    temperature = 1.0 if r.temperature is None else r.temperature
    _finite(temperature, "temperature")
    if temperature < 0:
        raise invalid(f"'temperature' must be >= 0 (0 is greedy decoding), got {temperature}",
                      param="temperature")
    top_p = r.top_p
    if top_p is not None:
        _finite(top_p, "top_p")
        if not 0 < top_p <= 1:
            raise invalid(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    top_k = r.top_k
    if top_k is not None and top_k < -1:
        raise invalid(f"'top_k' must be -1 or 0 (all tokens) or a positive integer, got {top_k}",
                      param="top_k")
    rep = 1.0 if r.repetition_penalty is None else r.repetition_penalty
    _finite(rep, "repetition_penalty")
    if rep <= 0:
        raise invalid(f"'repetition_penalty' must be > 0 (1 is off), got {rep}",
                      param="repetition_penalty")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(r, name)
        if v is not None and v != 0:
            raise invalid(f"'{name}' is not supported by this server (only 0); use "
                          "'repetition_penalty' (e.g. 1.1) instead", param=name)
    if r.logit_bias:
        raise invalid("'logit_bias' is not supported by this server (only {} or null)",
                      param="logit_bias")
    if r.best_of is not None and r.best_of != 1:
        raise invalid("'best_of' is not supported by this server (only 1); use 'n' and pick "
                      "yourself", param="best_of")
    stop = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
    if len(stop) > MAX_STOP:
        raise invalid(f"'stop' takes at most {MAX_STOP} sequences, got {len(stop)}",
                      param="stop")
    if any(not s for s in stop):
        raise invalid("'stop' sequences must be non-empty strings", param="stop")
    if r.seed is not None and not 0 <= r.seed <= MAX_SEED:
        raise invalid(f"'seed' must be in [0, {MAX_SEED}], got {r.seed}", param="seed")
    n = 1 if r.n is None else r.n
    if not 1 <= n <= limits.max_n:
        raise invalid(f"'n' must be in [1, {limits.max_n}], got {n}", param="n")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise invalid(f"'{logprobs_name}' must be in [0, {MAX_LOGPROBS}], got {logprobs}",
                      param=logprobs_name)
    min_new = 0 if r.min_tokens is None else r.min_tokens
    if min_new < 0 or (max_tokens is not None and min_new > max_tokens):
        raise invalid(f"'min_tokens' must be in [0, {max_tokens_name}], got {min_new}",
                      param="min_tokens")
    include_usage = bool(r.stream_options and r.stream_options.include_usage)
    if r.stream_options is not None and not r.stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true",
                      param="stream_options")
    return Checked(max_tokens=max_tokens, temperature=float(temperature),
                   top_p=None if top_p is None or top_p == 1 else float(top_p),
                   top_k=None if top_k is None or top_k <= 0 else top_k,
                   repetition_penalty=float(rep), stop=tuple(stop), seed=r.seed, n=n,
                   stream=bool(r.stream), include_usage=include_usage, logprobs=logprobs,
                   min_tokens=min_new, ignore_eos=bool(r.ignore_eos))


def check_completion(r: CompletionRequest, limits: Limits, vocab_size: int
                     ) -> tuple[Checked, list[str | list[int]]]:
    """Check a completions request; ``(settings, prompts)`` with each prompt a string or a list
    of token ids. ``max_tokens`` defaults to 16 and may be 0 (with ``echo``: score the prompt
    only, as lm-eval's ``local-completions`` does).

    Raises:
        APIError: 400 naming the field: an empty prompt (or list of prompts), a token id outside
            ``[0, vocab_size)``, too many prompts, or any value :class:`Checked` rejects.
    """
    p = r.prompt
    if not p:
        raise invalid("'prompt' must not be empty", param="prompt")
    single = isinstance(p, str) or isinstance(p[0], int)  # one prompt, not a list of them
    prompts: list[str | list[int]] = [p] if single else list(p)  # type: ignore[list-item]
    if len(prompts) > limits.max_prompts:
        raise invalid(f"'prompt' holds {len(prompts)} prompts; this server takes at most "
                      f"{limits.max_prompts} per request", param="prompt")
    for i, one in enumerate(prompts):
        where = "prompt" if single else f"prompt.{i}"
        if not one:
            raise invalid(f"'{where}' must not be empty", param=where)
        if isinstance(one, list):
            bad = next((t for t in one if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise invalid(f"'{where}' holds token id {bad}, outside this model's vocabulary "
                              f"[0, {vocab_size})", param=where)
    max_tokens = 16 if r.max_tokens is None else r.max_tokens
    checked = _check_common(r, limits, min_tokens=0, max_tokens=max_tokens,
                            max_tokens_name="max_tokens", logprobs=r.logprobs,
                            logprobs_name="logprobs")
    if len(prompts) * checked.n > limits.max_prompts:
        raise invalid(f"{len(prompts)} prompts x n={checked.n} choices is more than this "
                      f"server's {limits.max_prompts} per request", param="n")
    return checked, prompts


def check_chat(r: ChatCompletionRequest, limits: Limits) -> tuple[Checked, list[dict[str, str]]]:
    """Check a chat request; ``(settings, messages)`` with messages as ``{"role", "content"}``
    dicts of strings (``developer`` read as ``system``, text parts joined, an assistant's
    missing content as ``""``).

    Raises:
        APIError: 400 naming the field: no messages, an unknown role, a non-text content part,
            a missing content, both ``max_tokens`` and ``max_completion_tokens`` with different
            values, ``top_logprobs`` without ``logprobs``, or any value :class:`Checked` rejects.
    """
    if not r.messages:
        raise invalid("'messages' must hold at least one message", param="messages")
    messages = []
    for i, m in enumerate(r.messages):
        role = ROLE_ALIASES.get(m.role, m.role)
        if role not in ROLES:
            raise invalid(f"Invalid value for 'messages.{i}.role': '{m.role}'; supported: "
                          "system, developer, user, assistant", param=f"messages.{i}.role")
        if m.content is None:
            if role != "assistant":
                raise invalid(f"'messages.{i}.content' is required for a {role} message",
                              param=f"messages.{i}.content")
            text = ""
        elif isinstance(m.content, str):
            text = m.content
        else:
            pieces = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise invalid(f"'messages.{i}.content.{j}': only text parts "
                                  f"({{\"type\": \"text\", \"text\": ...}}) are supported, got "
                                  f"type '{part.type}'", param=f"messages.{i}.content.{j}")
                pieces.append(part.text)
            text = "".join(pieces)
        messages.append({"role": role, "content": text})
    if (r.max_tokens is not None and r.max_completion_tokens is not None
            and r.max_tokens != r.max_completion_tokens):
        raise invalid("give 'max_completion_tokens' or 'max_tokens', not both with different "
                      "values", param="max_completion_tokens")
    if r.max_completion_tokens is not None:
        max_tokens, name = r.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, name = r.max_tokens, "max_tokens"
    if r.top_logprobs is not None and not r.logprobs:
        raise invalid("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
    logprobs = (r.top_logprobs or 0) if r.logprobs else None
    checked = _check_common(r, limits, min_tokens=1, max_tokens=max_tokens,
                            max_tokens_name=name, logprobs=logprobs,
                            logprobs_name="top_logprobs")
    return checked, messages


def check_context(prompt_tokens: int, max_tokens: int, window: int, *,
                  what: Literal["messages", "prompt"]) -> None:
    """Refuse a request whose prompt plus ``max_tokens`` exceeds the context ``window``
    (OpenAI's ``context_length_exceeded`` wording, the limit named).

    Raises:
        APIError: 400 with ``code`` ``context_length_exceeded`` and ``param`` ``what``.
    """
    if prompt_tokens + max_tokens > window:
        raise APIError(
            f"This model's maximum context length is {window} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {what}, {max_tokens} "
            f"in the completion). Please reduce the length of the {what} or completion.",
            400, param=what, code="context_length_exceeded")
