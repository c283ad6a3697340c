"""The OpenAI-compatible HTTP API over a serving :class:`~olmoflow.serve.engine.Engine`.

:func:`build_app` returns a FastAPI app with

- ``GET /health``: ``{"status": "ok", ...}`` and the engine's load (no key needed);
- ``GET /v1/models`` (and ``/v1/models/{id}``): the one served model;
- ``POST /v1/completions`` and ``POST /v1/chat/completions``: the OpenAI API reference's
  endpoints (request fields in :mod:`olmoflow.serve.protocol`, response shapes in
  :mod:`olmoflow.serve.formatting`), streamed as server-sent events with ``"stream": true``;
- the web chat page (``serve/web/``) at ``/``, mounted after the API so it never shadows it.

Behaviour follows vLLM's OpenAI server: ``n`` choices are ``n`` engine requests, choice ``i``
seeded ``seed + i``; chat prompts are the model's chat template rendered with
``add_generation_prompt=True`` and the template's end-of-turn token ends a reply; ``max_tokens``
defaults to 16 for completions and, for chat, to what fits in the context window (at most the
server's cap). A client that disconnects (mid-stream or while waiting for a whole answer) has its
engine requests aborted at once, freeing their batch slots.

Safety limits (:class:`~olmoflow.serve.protocol.Limits`): request bodies over
``max_body_bytes`` get 413 before they are read; ``max_tokens`` is capped; the engine decodes at
most ``max_batch`` sequences together and queues at most ``max_queue`` more, beyond which a
request is answered 429 with ``Retry-After`` (no request is ever queued unboundedly). With an
``api_key``, every ``/v1`` route needs ``Authorization: Bearer KEY`` (401 otherwise); ``/health``
and the page do not (the page sends the key the user types).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from olmoflow.errors import OlmoflowError
from olmoflow.infer.sampling import SamplingParams
from olmoflow.serve import formatting as fmt
from olmoflow.serve.engine import Engine, GenerationRequest, QueueFull, RequestOutput
from olmoflow.serve.errors import (
    APIError,
    error_body,
    install_error_handlers,
    invalid,
    model_not_found,
    queue_full,
    server_error,
    too_large,
    unauthorized,
    unavailable,
)
from olmoflow.serve.protocol import (
    ChatCompletionRequest,
    Checked,
    CompletionRequest,
    Limits,
    check_chat,
    check_completion,
    check_context,
    parse_request,
    validation_error,
)
from olmoflow.tokenizer.chat import ChatTemplate, end_of_turn_ids, get_template, render

log = logging.getLogger("olmoflow.serve")

WEB_DIR = Path(__file__).parent / "web"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _ClientGone(Exception):
    """The HTTP client disconnected before its answer was complete."""


_GONE = object()  # put into an event queue when the client disconnects


@dataclass
class _Choice:
    """What one engine request (one choice) has produced so far."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    generated: int = 0
    finish_reason: str | None = None
    started: bool = False


class _Batch:
    """The engine requests of one API request (prompts x ``n`` choices), bridged to asyncio:
    every event lands in one :class:`asyncio.Queue` as ``(choice index, RequestOutput)``.

    Args:
        engine: the engine.
        requests: one per choice, in choice order.
        retry_after: the ``Retry-After`` seconds of a 429.
    Raises:
        APIError: 429 when the engine's queue is full (requests already submitted are aborted),
            400 for a request the engine refuses.
    """

    def __init__(self, engine: Engine, requests: list[GenerationRequest], retry_after: int = 1):
        self.engine = engine
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.open: set[str] = set()
        # Every sequence of a request queues before the engine admits it: more than the queue
        # holds could never be accepted, and a 429 would invite retrying forever.
        if len(requests) > engine.max_queue:
            raise invalid(f"this request needs {len(requests)} sequences (prompts x n) but the "
                          f"server queues at most {engine.max_queue} (--max-queue); send fewer "
                          "prompts or a smaller 'n'", param="n")
        loop = asyncio.get_running_loop()
        for index, req in enumerate(requests):
            def callback(out: RequestOutput, index: int = index) -> None:
                loop.call_soon_threadsafe(self.queue.put_nowait, (index, out))
            try:
                engine.submit(req, callback)
            except QueueFull:
                self.abort()
                raise queue_full(engine.stats()["waiting"], retry_after) from None
            except ValueError as e:
                self.abort()
                raise invalid(str(e)) from None
            self.open.add(req.request_id)

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Events until every choice has finished.

        Raises:
            _ClientGone: the watcher saw the client disconnect.
        """
        while self.open:
            item = await self.queue.get()
            if item is _GONE:
                raise _ClientGone
            index, out = item
            if out.finish_reason is not None:
                self.open.discard(out.request_id)
            yield index, out

    def abort(self) -> None:
        """Abort every choice still running (idempotent)."""
        for rid in list(self.open):
            self.engine.abort(rid)
        self.open.clear()


async def _watch_disconnect(receive: Callable[[], Any], queue: asyncio.Queue[Any]) -> None:
    """Wait for the ASGI ``http.disconnect`` message (after the body was read, ``receive``
    returns nothing else) and tell the consumer of ``queue``."""
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            queue.put_nowait(_GONE)
            return


def _fail(out: RequestOutput) -> APIError:
    """The error for an engine event that ended in ``"abort"`` while the client still waited."""
    if out.error:
        log.error("engine failed request %s: %s", out.request_id, out.error)
        return server_error("the engine failed on this request")
    return unavailable()


class _BodyLimit:
    """ASGI middleware: a body over ``limit`` bytes is answered 413 (at once when
    ``Content-Length`` says so, else as soon as the bytes read pass it)."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            err = too_large(self.limit) if length.isdigit() else invalid(
                "Invalid Content-Length header")
            await _send_json(send, err.status, err.body())
            return
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise too_large(self.limit)
            return message

        await self.app(scope, limited, send)


async def _send_json(send: Callable, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})


def build_app(engine: Engine, tokenizer: Any, template: ChatTemplate | str | None = None, *,
              model_name: str, api_key: str | None = None,
              limits: Limits | None = None) -> Any:
    """The FastAPI app serving ``engine`` (see the module docstring for the routes).

    Args:
        engine: a :class:`~olmoflow.serve.engine.Engine` (started by the app's startup if it is
            not yet; stopping it is the caller's job).
        tokenizer: the engine's tokenizer (``encode``, ``decode``, ``vocab_size``,
            ``eos_token_id``).
        template: the chat template (a :class:`ChatTemplate` or its name); None: the
            tokenizer's own (:func:`olmoflow.infer.chat.resolve_template`, which falls back to
            ``plain``; call it before building the engine when the fallback adds tokens).
        model_name: the ``model`` clients name (``/v1/models``); other names get 404.
        api_key: when set, ``/v1`` routes need ``Authorization: Bearer api_key``.
        limits: the safety limits (default :class:`Limits`).
    Returns:
        a ``fastapi.FastAPI``.
    Raises:
        OlmoflowError: an unknown template name.
    """
    from contextlib import asynccontextmanager

    limits = limits or Limits()
    if template is None:
        from olmoflow.infer.chat import resolve_template

        template, note = resolve_template(tokenizer)
        if note:
            log.warning("%s", note)
    tmpl = get_template(template)
    # a reply ends at EOS or at the template's own end-of-turn token (ChatML: <|im_end|>)
    stop_ids = end_of_turn_ids(tmpl, tokenizer)
    window = engine.max_context
    created_at = fmt.now()

    @asynccontextmanager
    async def lifespan(app: Any):  # noqa: ANN202
        engine.start()
        yield

    app = FastAPI(title="olmoflow serve", version="1", docs_url=None, redoc_url=None,
                  lifespan=lifespan)
    install_error_handlers(app, validation_error)
    app.add_middleware(_BodyLimit, limit=limits.max_body_bytes)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 api_key.encode()):
            raise unauthorized(bool(header))

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise model_not_found(name, model_name)

    def sampling(c: Checked, max_new: int, seed: int | None) -> SamplingParams:
        return SamplingParams(max_new_tokens=max_new, temperature=c.temperature, top_k=c.top_k,
                              top_p=c.top_p, repetition_penalty=c.repetition_penalty,
                              seed=seed, stop=c.stop)

    def seed_of(c: Checked, i: int) -> int | None:
        return None if c.seed is None else c.seed + i

    # ---- routes ----------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> dict[str, Any]:
        s = engine.stats()
        return {"status": "ok", "model": model_name, "running": s["running"],
                "waiting": s["waiting"], "max_batch": s["max_batch"],
                "max_queue": s["max_queue"], "max_context": window}

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created_at,
                "owned_by": "olmoflow", "max_model_len": window}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> dict[str, Any]:
        authorize(request)
        check_model(name)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        authorize(request)
        r: CompletionRequest = parse_request(await request.body(), CompletionRequest)
        check_model(r.model)
        c, prompts = check_completion(r, limits, engine.vocab_size)
        ids = [await _tokenize(tokenizer, p) if isinstance(p, str) else p for p in prompts]
        for one in ids:
            if not one:
                raise invalid("'prompt' encodes to no tokens", param="prompt")
            check_context(len(one), c.max_tokens or 0, window, what="prompt")
        echo = bool(r.echo)
        rid = fmt.new_id("cmpl")
        reqs = [GenerationRequest(f"{rid}-{p}-{i}", one, sampling(c, c.max_tokens or 0,
                                                                  seed_of(c, i)),
                                  logprobs=c.logprobs,
                                  prompt_logprobs=echo and c.logprobs is not None,
                                  min_tokens=c.min_tokens, ignore_eos=c.ignore_eos)
                for p, one in enumerate(ids) for i in range(c.n)]
        texts = [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False)
                 for p in prompts]
        batch = _Batch(engine, reqs, limits.retry_after)
        job = _CompletionJob(batch, c, rid, model_name, echo, texts, ids, tokenizer)
        if c.stream:
            return StreamingResponse(job.stream(request.receive), headers=SSE_HEADERS,
                                     media_type="text/event-stream")
        return JSONResponse(await job.whole(request.receive))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        authorize(request)
        r: ChatCompletionRequest = parse_request(await request.body(), ChatCompletionRequest)
        check_model(r.model)
        c, messages = check_chat(r, limits)
        try:
            ids = await asyncio.to_thread(
                lambda: render(messages, tmpl, tokenizer, add_generation_prompt=True)[0])
        except OlmoflowError as e:
            raise invalid(str(e), param="messages") from None
        if c.max_tokens is None:
            room = min(limits.max_tokens, window - len(ids))
            check_context(len(ids), max(room, 1), window, what="messages")
            max_new = room
        else:
            check_context(len(ids), c.max_tokens, window, what="messages")
            max_new = c.max_tokens
        rid = fmt.new_id("chatcmpl")
        reqs = [GenerationRequest(f"{rid}-{i}", ids, sampling(c, max_new, seed_of(c, i)),
                                  logprobs=c.logprobs, stop_token_ids=stop_ids,
                                  min_tokens=c.min_tokens, ignore_eos=c.ignore_eos)
                for i in range(c.n)]
        batch = _Batch(engine, reqs, limits.retry_after)
        job = _ChatJob(batch, c, rid, model_name, len(ids))
        if c.stream:
            return StreamingResponse(job.stream(request.receive), headers=SSE_HEADERS,
                                     media_type="text/event-stream")
        return JSONResponse(await job.whole(request.receive))

    # A wrong method on an API path is a 405 (the page's mount at "/" would otherwise claim
    # the path and answer 404).
    others = ["GET", "PUT", "PATCH", "DELETE"]
    for path, allowed in (("/v1/completions", "POST"), ("/v1/chat/completions", "POST"),
                          ("/v1/models", "GET"), ("/health", "GET")):
        methods = [m for m in [*others, "POST"] if m != allowed]

        async def wrong_method(request: Request, allowed: str = allowed) -> Any:
            raise APIError(f"Method {request.method} is not allowed for {request.url.path}; "
                           f"use {allowed}", 405, code="method_not_allowed",
                           headers={"Allow": allowed})

        app.add_api_route(path, wrong_method, methods=methods, include_in_schema=False)

    if (WEB_DIR / "index.html").is_file():
        app.mount("/", _Page(directory=WEB_DIR, html=True), name="web")
    return app


class _Page(StaticFiles):
    """The web page's files; a path under ``/v1`` that no API route took is an unknown URL
    (404), whatever the method, not a file."""

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path", "")
        if path == "/v1" or path.startswith("/v1/"):
            raise HTTPException(status_code=404)
        await super().__call__(scope, receive, send)


async def _tokenize(tokenizer: Any, text: str) -> list[int]:
    # off the event loop: a long prompt takes a while to encode
    return await asyncio.to_thread(tokenizer.encode, text)


class _Job:
    """Runs a :class:`_Batch` to the end for one HTTP request, streamed or whole; the client's
    disconnect aborts it (both ways)."""

    obj = ""

    def __init__(self, batch: _Batch, c: Checked, rid: str, model: str):
        self.batch, self.c, self.rid, self.model = batch, c, rid, model
        self.created = fmt.now()
        self.choices = [_Choice(i) for i in range(len(batch.open))]

    def prompt_tokens(self) -> int:
        raise NotImplementedError

    def usage(self) -> dict[str, int]:
        return fmt.usage(self.prompt_tokens(), sum(ch.generated for ch in self.choices))

    def update(self, choice: _Choice, out: RequestOutput) -> tuple[str, list[Any]]:
        """Record ``out``; the text and logprob entries it adds to the choice."""
        raise NotImplementedError

    def chunks(self, choice: _Choice, text: str, lps: list[Any], out: RequestOutput
               ) -> list[dict[str, Any]]:
        raise NotImplementedError

    def first_chunks(self) -> list[dict[str, Any]]:
        return []

    def body(self) -> dict[str, Any]:
        raise NotImplementedError

    async def _run(self, receive: Callable) -> AsyncIterator[tuple[_Choice, RequestOutput]]:
        watcher = asyncio.create_task(_watch_disconnect(receive, self.batch.queue))
        try:
            async for index, out in self.batch.events():
                if out.finish_reason == "abort":
                    raise _fail(out)
                choice = self.choices[index]
                choice.generated = out.num_generated_tokens
                choice.finish_reason = out.finish_reason
                yield choice, out
        finally:
            watcher.cancel()
            self.batch.abort()

    async def whole(self, receive: Callable) -> dict[str, Any]:
        """The whole response body once every choice has finished."""
        events = self._run(receive)
        try:
            async for choice, out in events:
                self.update(choice, out)
        except _ClientGone:
            log.info("client gone; aborted %s", self.rid)
            return {}
        finally:
            await events.aclose()
        return self.body()

    async def stream(self, receive: Callable) -> AsyncIterator[bytes]:
        """The server-sent events of the response, ending ``data: [DONE]``; a failure after
        the first byte is sent as an error event (the status is already 200)."""
        events = self._run(receive)
        try:
            for chunk in self.first_chunks():
                yield fmt.sse(chunk)
            async for choice, out in events:
                text, lps = self.update(choice, out)
                for chunk in self.chunks(choice, text, lps, out):
                    yield fmt.sse(chunk)
            if self.c.include_usage:
                yield fmt.sse(fmt.usage_chunk(self.rid, self.created, self.model, self.obj,
                                              self.usage()))
            yield fmt.DONE
        except _ClientGone:
            log.info("client gone; aborted %s", self.rid)
        except APIError as e:
            yield fmt.sse(e.body())
            yield fmt.DONE
        except Exception:
            log.exception("stream of %s failed", self.rid)
            yield fmt.sse(error_body("The server had an error while processing your request",
                                     "server_error"))
            yield fmt.DONE
        finally:
            await events.aclose()


class _CompletionJob(_Job):
    obj = "text_completion"

    def __init__(self, batch: _Batch, c: Checked, rid: str, model: str, echo: bool,
                 texts: list[str], ids: list[list[int]], tokenizer: Any):
        super().__init__(batch, c, rid, model)
        self.echo, self.texts, self.ids, self.tokenizer = echo, texts, ids, tokenizer
        self.builders = [fmt.CompletionLogprobs(c.logprobs) if c.logprobs is not None else None
                         for _ in self.choices]

    def prompt_tokens(self) -> int:
        return sum(len(one) for one in self.ids)

    def update(self, choice: _Choice, out: RequestOutput) -> tuple[str, list[Any]]:
        text, lps = out.text, list(out.logprobs or [])
        if not choice.started:
            choice.started = True
            if self.echo:
                p = choice.index // self.c.n
                text = self.texts[p] + text
                lps = list(out.prompt_logprobs or []) + lps
        choice.text.append(text)
        choice.logprobs.extend(lps)
        return text, lps

    def _logprobs(self, choice: _Choice, lps: list[Any]) -> dict[str, Any] | None:
        b = self.builders[choice.index]
        if b is None:
            return None
        first = ""
        if lps and lps[0] is None:
            p = choice.index // self.c.n
            first = self.tokenizer.decode(self.ids[p][:1], skip_special_tokens=False)
        return b.add(lps, first)

    def chunks(self, choice: _Choice, text: str, lps: list[Any], out: RequestOutput
               ) -> list[dict[str, Any]]:
        if not text and not lps and out.finish_reason is None:
            return []
        return [fmt.completion_chunk(self.rid, self.created, self.model, choice.index, text,
                                     self._logprobs(choice, lps), out.finish_reason,
                                     self.c.include_usage)]

    def body(self) -> dict[str, Any]:
        choices = [{"index": ch.index, "text": "".join(ch.text),
                    "logprobs": self._logprobs(ch, ch.logprobs),
                    "finish_reason": ch.finish_reason} for ch in self.choices]
        return fmt.completion_body(self.rid, self.created, self.model, choices, self.usage())


class _ChatJob(_Job):
    obj = "chat.completion.chunk"

    def __init__(self, batch: _Batch, c: Checked, rid: str, model: str, n_prompt: int):
        super().__init__(batch, c, rid, model)
        self.n_prompt = n_prompt

    def prompt_tokens(self) -> int:
        return self.n_prompt

    def update(self, choice: _Choice, out: RequestOutput) -> tuple[str, list[Any]]:
        lps = list(out.logprobs or [])
        choice.text.append(out.text)
        choice.logprobs.extend(lps)
        return out.text, lps

    def _logprobs(self, lps: list[Any]) -> dict[str, Any] | None:
        return None if self.c.logprobs is None else fmt.chat_logprobs(lps, self.c.logprobs)

    def first_chunks(self) -> list[dict[str, Any]]:
        return [fmt.chat_chunk(self.rid, self.created, self.model, ch.index,
                               {"role": "assistant", "content": ""}, None, None,
                               self.c.include_usage) for ch in self.choices]

    def chunks(self, choice: _Choice, text: str, lps: list[Any], out: RequestOutput
               ) -> list[dict[str, Any]]:
        out_chunks = []
        if text or lps:
            out_chunks.append(fmt.chat_chunk(self.rid, self.created, self.model, choice.index,
                                             {"content": text}, self._logprobs(lps), None,
                                             self.c.include_usage))
        if out.finish_reason is not None:
            out_chunks.append(fmt.chat_chunk(self.rid, self.created, self.model, choice.index,
                                             {}, None, out.finish_reason,
                                             self.c.include_usage))
        return out_chunks

    def body(self) -> dict[str, Any]:
        choices = [fmt.chat_choice(ch.index, "".join(ch.text), self._logprobs(ch.logprobs),
                                   ch.finish_reason) for ch in self.choices]
        return fmt.chat_body(self.rid, self.created, self.model, choices, self.usage())
