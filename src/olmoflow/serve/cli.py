"""``olmoflow serve DIR``: an OpenAI-compatible HTTP server (and a chat page) for a model.

    olmoflow serve runs/demo/release                 http://127.0.0.1:8000/ and .../v1
    olmoflow serve DIR --host 0.0.0.0 --api-key KEY  reachable from elsewhere, key required

``DIR`` is anything ``olmoflow chat`` loads (a release / Hugging Face directory, a step directory,
a run directory with a ``release/``). The model runs in a continuous-batching
:class:`~olmoflow.serve.engine.Engine`; the API is :func:`olmoflow.serve.app.build_app`, served by
uvicorn. Limits: ``--max-batch`` sequences decode together, ``--max-queue`` more may wait (a
request beyond gets 429 with ``Retry-After``), ``--max-tokens`` caps a request's ``max_tokens``,
``--max-body-bytes`` its body (413). The server binds 127.0.0.1 unless told otherwise, and warns
when it binds another address without ``--api-key`` (or ``OLMOFLOW_API_KEY``). Ctrl-C (SIGINT) or
SIGTERM stops it cleanly: open requests are aborted and the process exits 0. A port in use or a
directory that is not a model is a one-line error (exit status 2).

fastapi and uvicorn are imported only when the command runs, so ``olmoflow --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from olmoflow.errors import OlmoflowError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
LOG_LEVELS = ("debug", "info", "warning", "error")


def add_serve_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments of ``olmoflow serve`` on parser ``p``; returns ``p``."""
    from olmoflow.serve.limits import Limits

    d = Limits()
    p.add_argument("model", metavar="DIR",
                   help="a release or Hugging Face directory (also a step directory, or a run "
                   "directory with a release)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: any free)")
    p.add_argument("--api-key", default=os.environ.get("OLMOFLOW_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: env "
                   "OLMOFLOW_API_KEY; none: open)")
    p.add_argument("--served-model-name",
                   help="the model name clients send and /v1/models lists (default: DIR as "
                   "given)")
    p.add_argument("--max-batch", type=int, default=d.max_batch,
                   help=f"sequences decoded together (default {d.max_batch})")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help=f"requests that may wait for a slot; more get 429 (default "
                   f"{d.max_queue})")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help=f"largest max_tokens a request may ask for (default {d.max_tokens}; "
                   "also capped by the context window)")
    p.add_argument("--max-n", type=int, default=d.max_n,
                   help=f"largest n (choices per request, default {d.max_n})")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help=f"largest request body; more gets 413 (default {d.max_body_bytes})")
    p.add_argument("--max-context", type=int,
                   help="context window in tokens (default: the trained sequence length, else "
                   "the model's maximum)")
    p.add_argument("--template", help="chat template instead of the tokenizer's: olmo3, tulu "
                   "or plain")
    p.add_argument("--tokenizer", help="directory with tokenizer.json (default: beside the model)")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                   help="server log level (default info; debug also logs every request)")
    return p


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` verb to ``subparsers`` (an ``add_subparsers()`` result); the parsed
    namespace carries ``tool=run_serve`` (it raises OlmoflowError for the CLI to print)."""
    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server and chat page for "
                              "a model")
    add_serve_arguments(p)
    p.set_defaults(tool=run_serve)
    return p


def _check_args(args: argparse.Namespace) -> None:
    for name, low in (("max_batch", 1), ("max_queue", 1), ("max_tokens", 1), ("max_n", 1),
                      ("max_body_bytes", 1024)):
        v = getattr(args, name)
        if v < low:
            raise OlmoflowError(f"--{name.replace('_', '-')} must be >= {low}, got {v}")
    if not 0 <= args.port <= 65535:
        raise OlmoflowError(f"--port must be in 0..65535, got {args.port}")
    if args.max_context is not None and args.max_context < 2:
        raise OlmoflowError(f"--max-context must be >= 2, got {args.max_context}")
    if args.api_key is not None and not args.api_key.strip():
        raise OlmoflowError("--api-key is empty")


def bind(host: str, port: int) -> Any:
    """A TCP socket bound to ``(host, port)`` (not yet listening), for uvicorn's ``sockets=``.

    Raises:
        OlmoflowError: the address is in use, not this machine's, or cannot be resolved.
    """
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OlmoflowError(f"cannot resolve --host '{host}': {e.strerror}") from None
    family, kind, _, _, addr = infos[0]
    # proto IPPROTO_TCP (never 0): asyncio sets TCP_NODELAY only on sockets that say TCP, and
    # without it each keep-alive answer waits ~40 ms for a delayed ACK
    sock = socket.socket(family, kind, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno in (98, 48):  # EADDRINUSE on Linux / macOS
            raise OlmoflowError(f"port {port} on {host} is already in use; stop the other "
                                "server or pass another --port") from None
        raise OlmoflowError(f"cannot bind {host}:{port}: {e.strerror or e}") from None
    return sock


def _server_class() -> type:
    """uvicorn's Server, except that SIGINT / SIGTERM end it without being re-raised afterwards
    (uvicorn re-raises them, which would turn a clean Ctrl-C into KeyboardInterrupt)."""
    import contextlib
    import signal
    import threading

    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # noqa: ANN202 (uvicorn's signature)
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            before = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, handler in before.items():
                    signal.signal(s, handler)

    return Server


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, start the engine, serve until SIGINT / SIGTERM; returns 0.

    Raises:
        OlmoflowError: a bad flag, a directory that does not load, a port in use.
    """
    _check_args(args)
    import logging

    import uvicorn

    from olmoflow.infer.chat import resolve_template
    from olmoflow.model.load import load_model
    from olmoflow.serve.app import build_app
    from olmoflow.serve.engine import Engine
    from olmoflow.serve.limits import Limits

    log = logging.getLogger("olmoflow.serve")
    logging.getLogger("olmoflow").setLevel(args.log_level.upper())
    # the port first: a port in use fails at once, not after loading a large model
    sock = bind(args.host, args.port)
    engine = None
    try:
        loaded = load_model(args.model, tokenizer=args.tokenizer, device=args.device or "auto")
        model, tok, src, window = (loaded.model, loaded.tokenizer, loaded.path,
                                   loaded.context_length)
        if args.max_context is not None:
            if args.max_context > model.config.max_sequence_length:
                raise OlmoflowError(f"--max-context {args.max_context} is over the model's "
                                    f"{model.config.max_sequence_length} positions")
            window = args.max_context
        template, note = resolve_template(tok, model, args.template)
        if note:
            print(f"olmoflow serve: note: {note}", file=sys.stderr)
        limits = Limits(max_body_bytes=args.max_body_bytes, max_tokens=args.max_tokens,
                        max_n=args.max_n, max_batch=args.max_batch, max_queue=args.max_queue)
        name = args.served_model_name or str(args.model).rstrip("/") or str(src)
        engine = Engine(model, tok, max_batch=limits.max_batch, max_queue=limits.max_queue,
                        max_context=window)
        app = build_app(engine, tok, template, model_name=name, api_key=args.api_key,
                        limits=limits)
        config = uvicorn.Config(app, log_level=args.log_level, lifespan="on",
                                access_log=args.log_level == "debug",
                                timeout_graceful_shutdown=3)
        server = _server_class()(config)
        port = sock.getsockname()[1]
        shown = f"[{args.host}]" if ":" in args.host else args.host
        if args.host not in LOOPBACK and args.api_key is None:
            print(f"olmoflow serve: warning: listening on {args.host} without --api-key: anyone "
                  "who can reach this port can use the model", file=sys.stderr)
        print(f"olmoflow serve: '{name}' from {src} (template {template.name}, context {window} "
              f"tokens, batch {limits.max_batch}, queue {limits.max_queue})\n"
              f"  chat page:  http://{shown}:{port}/\n"
              f"  OpenAI API: http://{shown}:{port}/v1   (Ctrl-C to stop)", flush=True)
        server.run(sockets=[sock])
        log.info("server stopped")
    finally:
        if engine is not None:
            engine.stop()
        sock.close()
    print("olmoflow serve: stopped", flush=True)
    return 0


def serve_main(argv: list[str] | None = None) -> int:
    """``olmoflow serve`` as a function: parse ``argv``, serve, return the exit status (0 after
    a clean stop, 2 after a one-line error on stderr)."""
    parser = add_serve_arguments(argparse.ArgumentParser(prog="olmoflow serve"))
    args = parser.parse_args(argv)
    try:
        return run_serve(args)
    except OlmoflowError as e:
        print(f"olmoflow serve: error: {e}", file=sys.stderr)
        return 2
