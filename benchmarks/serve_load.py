"""Load-test an OpenAI-compatible server on this machine: N streaming clients for T seconds.

Each of ``--clients`` clients sends requests one after another (``/v1/completions`` or, with
``--endpoint chat``, ``/v1/chat/completions``; ``stream: true``, greedy, ``--max-tokens``, usage
requested with ``stream_options.include_usage``) until ``--duration`` seconds have passed; requests
then in flight may finish within ``--drain`` more seconds, after which they are cancelled and
reported as unfinished. Prompts: ``--prompt-file`` (one a line, or JSONL with ``prompt`` /
``messages``) or a built-in set of 16 short ones, client k starting at prompt k.

Reported (as vLLM's ``benchmark_serving.py`` defines them): requests/s and generated tokens/s over
the time from the first request to the last response; generated tokens from the final chunk's
``usage`` (or, for a server that sends none, the number of streamed text chunks: said so in the
output); p50/p99 latency (request -> end of stream) and time to first token (request -> first
chunk with text); errors (count and the first few messages). Exit status 1 if any request failed,
2 on bad options or a server that does not start.

``--serve DIR`` starts ``olmoflow serve DIR --port <free>`` itself (extra flags with
``--serve-args``), waits for ``/health``, and stops it at the end; otherwise ``--url`` names a
running server. Only loopback URLs are accepted: this is a benchmark, not a tool to load other
machines.

Usage:  python benchmarks/serve_load.py --serve runs/demo/release --clients 32 --duration 20
        python benchmarks/serve_load.py --url http://127.0.0.1:8000 --endpoint chat --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_common import (  # noqa: E402  (the benchmarks folder is not a package)
    ENDPOINTS,
    MAX_CLIENTS,
    BenchError,
    LoadConfig,
    ServerProcess,
    fetch_model_name,
    format_report,
    free_port,
    load_prompts,
    olmoflow_serve_cmd,
    run_load,
)

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--serve", metavar="DIR",
                       help="start `olmoflow serve DIR` on a free port for the run")
    ap.add_argument("--serve-args", default="",
                    help="extra flags for `olmoflow serve`, one string (e.g. '--max-batch 64')")
    ap.add_argument("--clients", type=int, default=8, help=f"concurrent clients (1..{MAX_CLIENTS})")
    ap.add_argument("--duration", type=float, default=10.0,
                    help="seconds during which clients start requests")
    ap.add_argument("--drain", type=float, default=60.0,
                    help="seconds after --duration for requests in flight to finish")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    ap.add_argument("--endpoint", choices=ENDPOINTS, default="completions")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-file", help="one prompt a line, or .jsonl with prompt / messages")
    ap.add_argument("--model", help="the request's model field (default: from /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("OLMOFLOW_API_KEY"),
                    help="bearer token (default: $OLMOFLOW_API_KEY)")
    ap.add_argument("--extra-body", default="{}",
                    help="JSON object merged into every request (server extensions)")
    ap.add_argument("--warmup", type=int, default=1, help="uncounted requests sent first")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    return ap.parse_args(argv)


def check_loopback(url: str) -> None:
    """Raises BenchError unless ``url`` is http(s) on a loopback host."""
    u = urlparse(url)
    if u.scheme not in ("http", "https") or u.hostname not in LOOPBACK:
        raise BenchError(f"--url must be an http(s) URL on this machine "
                         f"({', '.join(sorted(LOOPBACK))}), got {url!r}")


def run(args: argparse.Namespace) -> int:
    """Run the load and print the report; the exit status (0 ok, 1 some request failed)."""
    try:
        extra = json.loads(args.extra_body)
    except json.JSONDecodeError as e:
        raise BenchError(f"--extra-body is not JSON: {e.msg}") from None
    if not isinstance(extra, dict):
        raise BenchError("--extra-body must be a JSON object")
    cfg = LoadConfig(base_url=args.url or "http://127.0.0.1:0", clients=args.clients,
                     duration_s=args.duration, endpoint=args.endpoint,
                     max_tokens=args.max_tokens,
                     prompts=load_prompts(args.prompt_file, args.endpoint), model=args.model,
                     extra_body=extra, request_timeout_s=args.request_timeout,
                     drain_s=args.drain, warmup=args.warmup, api_key=args.api_key)
    cfg.check()  # before starting any server

    def go(url: str, name: str) -> int:
        cfg.base_url = url
        if cfg.model is None:
            cfg.model = fetch_model_name(url, cfg.api_key)
        rep = asyncio.run(run_load(cfg))
        if args.json:
            print(json.dumps({"server": name, "url": url, "endpoint": cfg.endpoint,
                              "max_tokens": cfg.max_tokens, **rep.summary()}, indent=2))
        else:
            print(format_report(name, rep))
        if rep.unfinished:
            print(f"warning: {rep.unfinished} requests did not finish within --drain "
                  f"{cfg.drain_s:g} s", file=sys.stderr)
        return 1 if rep.errors else 0

    if args.serve:
        d = Path(args.serve)
        if not d.is_dir():
            raise BenchError(f"--serve: no such directory: {d}")
        port = free_port()
        cmd = olmoflow_serve_cmd(d, port, shlex.split(args.serve_args))
        with ServerProcess("olmoflow serve", cmd, port) as srv:
            return go(srv.url, f"olmoflow serve {d}")
    check_loopback(args.url)
    return go(args.url, args.url)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
