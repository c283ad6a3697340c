"""Shared pieces of the serving benchmarks (``serve_load.py``, ``serve_speed.py``).

- :func:`run_load`: N concurrent streaming clients against an OpenAI-compatible base URL for a
  bounded time, each sending requests in a loop; a :class:`LoadReport` of what came back.
- :class:`ServerProcess`: start a server command as a subprocess, wait for ``GET /health``, stop it
  (SIGTERM, then SIGKILL) at the end.
- :func:`olmoflow_serve_cmd`, :func:`transformers_serve_cmd`: the two servers compared.

Measurements follow vLLM's ``benchmarks/benchmark_serving.py``: throughput is what completed
requests generated divided by the wall time from the first request to the last response (the drain
after the load window included, so a server that queues requests pays for it); latency is request
sent -> last byte of the stream; time to first token (TTFT) is request sent -> first streamed chunk
carrying text. Generated tokens come from the ``usage`` object of the final chunk (requested with
``stream_options.include_usage``); a server that sends none is counted in streamed text chunks,
which undercounts when a chunk holds several tokens; the report says which was used.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

MAX_CLIENTS = 256
ENDPOINTS = ("completions", "chat")

# Short and varied, so prompt + max_tokens stays inside small windows (the demo model's is 256).
BUILTIN_PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):\n",
    "In the beginning of the twentieth century,",
    "import numpy as np\n\n",
    "The quick brown fox",
    "Here is a list of fruits: apples,",
    "class Stack:\n    def __init__(self):\n",
    "Dear Sir or Madam,\n\nI am writing to",
    "The most important thing about science is",
    "for i in range(10):\n",
    "Water boils at",
    "A short poem about the sea:\n",
    "SELECT name, age FROM users WHERE",
    "The history of the printing press",
    "Step 1: preheat the oven to",
]


class BenchError(Exception):
    """A one-line problem with the benchmark's inputs or its server (printed, exit status 2)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linearly interpolated (numpy's default); NaN if empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# --- prompts -------------------------------------------------------------------------------------

def load_prompts(path: str | None, endpoint: str) -> list[dict[str, Any]]:
    """Request bodies' prompt part: ``{"prompt": str}`` (completions) or ``{"messages": [...]}``.

    ``path`` None: :data:`BUILTIN_PROMPTS`. A ``.jsonl`` file: one object a line with ``prompt``
    (a string) or ``messages`` (OpenAI chat messages). Any other file: one prompt a line (blank
    lines skipped; ``\\n`` in a line stands for a newline). A plain prompt sent to the chat endpoint
    becomes one user message.

    Raises:
        BenchError: unreadable file, bad JSON line, no prompts, messages for completions.
    """
    if path is None:
        raw: list[Any] = list(BUILTIN_PROMPTS)
    else:
        p = Path(path)
        try:
            lines = p.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise BenchError(f"cannot read prompt file {p}: {e}") from None
        raw = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if p.suffix == ".jsonl":
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise BenchError(f"{p}:{n}: not JSON ({e.msg})") from None
                good = isinstance(obj, dict) and (isinstance(obj.get("prompt"), str)
                                                  or isinstance(obj.get("messages"), list))
                if not good:
                    raise BenchError(f"{p}:{n}: need an object with 'prompt' (a string) or "
                                     "'messages' (a list)")
                raw.append(obj)
            else:
                raw.append(line.replace("\\n", "\n"))
        if not raw:
            raise BenchError(f"no prompts in {p}")
    out = []
    for item in raw:
        if isinstance(item, str):
            item = {"prompt": item}
        if endpoint == "chat":
            msgs = item.get("messages") or [{"role": "user", "content": item["prompt"]}]
            out.append({"messages": msgs})
        else:
            if "prompt" not in item:
                raise BenchError("a prompt file with 'messages' needs --endpoint chat")
            out.append({"prompt": item["prompt"]})
    return out


# --- one request ---------------------------------------------------------------------------------

@dataclass
class RequestRecord:
    """One streamed request. Times in seconds from sending it; ``ttft_s`` None if no text came."""

    ok: bool
    latency_s: float
    ttft_s: float | None = None
    completion_tokens: int = 0
    from_usage: bool = False        # completion_tokens from the usage object (else chunk count)
    error: str | None = None
    text: str = ""                  # the streamed text, joined
    prompt_index: int = -1          # which of the config's prompts was sent


def _error_text(obj: Any) -> str:
    """The message of an OpenAI-shaped (``{"error": {"message"}}``) or bare error object."""
    err = obj.get("error") if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err if err is not None else obj)


async def stream_request(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                         chat: bool, progress: list[int] | None = None) -> RequestRecord:
    """POST ``body`` (with ``stream: true``) to ``path`` and read its server-sent events.

    The stream ends at ``data: [DONE]`` (OpenAI) or when the server closes it (``transformers
    serve`` sends no ``[DONE]``). A non-200 status, an ``error`` event, a transport error or a
    timeout makes a failed record carrying a one-line message; nothing is raised.
    ``progress[0]``, when given, counts the text chunks as they arrive (what a request cancelled
    midway had generated).
    """
    t0 = time.perf_counter()
    ttft = None
    chunks = 0
    parts: list[str] = []
    usage_tokens = None
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                try:
                    msg = _error_text(json.loads(text))
                except json.JSONDecodeError:
                    msg = text.strip()[:200]
                return RequestRecord(False, time.perf_counter() - t0,
                                     error=f"HTTP {resp.status_code}: {msg}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event: lines
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError:
                    obj = None
                if not isinstance(obj, dict):
                    return RequestRecord(False, time.perf_counter() - t0,
                                         error=f"bad SSE data: {data[:120]}")
                if "error" in obj:
                    return RequestRecord(False, time.perf_counter() - t0,
                                         error=f"stream error: {_error_text(obj)}")
                for choice in obj.get("choices") or []:
                    text = ((choice.get("delta") or {}).get("content") if chat
                            else choice.get("text"))
                    if text:
                        chunks += 1
                        parts.append(text)
                        if progress is not None:
                            progress[0] = chunks
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                usage = obj.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
    except httpx.TimeoutException:
        return RequestRecord(False, time.perf_counter() - t0, error="request timed out")
    except httpx.HTTPError as e:
        return RequestRecord(False, time.perf_counter() - t0,
                             error=f"{type(e).__name__}: {str(e)[:200]}")
    latency = time.perf_counter() - t0
    if usage_tokens is not None:
        return RequestRecord(True, latency, ttft, usage_tokens, True, text="".join(parts))
    return RequestRecord(True, latency, ttft, chunks, False, text="".join(parts))


# --- the load ------------------------------------------------------------------------------------

@dataclass
class LoadConfig:
    """What :func:`run_load` sends.

    ``duration_s``: no request starts after it; requests in flight then may finish during
    ``drain_s`` more seconds, after which they are cancelled and counted as unfinished.
    ``extra_body``: merged into every request (e.g. a server's min-tokens extension).
    ``model``: the ``model`` field; None leaves it out (``transformers serve`` pinned to a model
    accepts that).
    """

    base_url: str
    clients: int = 8
    duration_s: float = 10.0
    endpoint: str = "completions"
    max_tokens: int = 64
    prompts: list[dict[str, Any]] = field(default_factory=lambda: load_prompts(None, "completions"))
    model: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_timeout_s: float = 120.0
    drain_s: float = 60.0
    warmup: int = 1
    api_key: str | None = None

    def check(self) -> None:
        """Raises BenchError on out-of-range values (one line naming the option)."""
        if not 1 <= self.clients <= MAX_CLIENTS:
            raise BenchError(f"--clients must be in 1..{MAX_CLIENTS}, got {self.clients}")
        if not 0 < self.duration_s <= 3600:
            raise BenchError(f"--duration must be in (0, 3600] seconds, got {self.duration_s}")
        if not 1 <= self.max_tokens <= 32768:
            raise BenchError(f"--max-tokens must be in 1..32768, got {self.max_tokens}")
        if self.endpoint not in ENDPOINTS:
            raise BenchError(f"--endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.request_timeout_s <= 0 or self.drain_s < 0 or self.warmup < 0:
            raise BenchError("--request-timeout must be > 0, --drain and --warmup >= 0")
        if not self.base_url.startswith(("http://", "https://")):
            raise BenchError(f"--url must start with http:// or https://, got {self.base_url!r}")

    def body(self, prompt: dict[str, Any]) -> dict[str, Any]:
        """The JSON body of one streamed request for ``prompt``: greedy, ``max_tokens``, usage."""
        b: dict[str, Any] = {**prompt, "max_tokens": self.max_tokens, "temperature": 0.0,
                             "stream": True, "stream_options": {"include_usage": True}}
        if self.model is not None:
            b["model"] = self.model
        b.update(self.extra_body)
        return b


@dataclass
class LoadReport:
    """What :func:`run_load` measured. ``elapsed_s``: first request sent -> last one ended."""

    clients: int
    duration_s: float
    elapsed_s: float
    records: list[RequestRecord]
    unfinished: int
    partial_tokens: int = 0     # text chunks streamed by the unfinished requests before the cut

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    @property
    def errors(self) -> list[RequestRecord]:
        return [r for r in self.records if not r.ok]

    @property
    def requests_per_s(self) -> float:
        return len(self.ok) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tokens(self) -> int:
        return sum(r.completion_tokens for r in self.ok)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second: completed requests' tokens plus the chunks the
        unfinished ones streamed (a server cut off at the drain timeout still did that work)."""
        total = self.tokens + self.partial_tokens
        return total / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def token_source(self) -> str:
        """``usage``, ``streamed chunks`` or ``mixed`` (how completion tokens were counted)."""
        n = sum(r.from_usage for r in self.ok)
        if not self.ok:
            return "n/a"
        if n == len(self.ok):
            return "usage"
        return "streamed chunks" if n == 0 else f"mixed ({n}/{len(self.ok)} from usage)"

    def latency(self, q: float) -> float:
        return percentile([r.latency_s for r in self.ok], q)

    def ttft(self, q: float) -> float:
        return percentile([r.ttft_s for r in self.ok if r.ttft_s is not None], q)

    def error_messages(self, k: int = 5) -> list[str]:
        """The first ``k`` distinct error messages, in order of occurrence."""
        seen: list[str] = []
        for r in self.errors:
            if r.error not in seen:
                seen.append(r.error or "?")
            if len(seen) == k:
                break
        return seen

    def summary(self) -> dict[str, Any]:
        """The numbers as a JSON-ready dict (seconds, per-second rates)."""
        ok = self.ok
        return {
            "clients": self.clients, "duration_s": self.duration_s,
            "elapsed_s": round(self.elapsed_s, 3), "requests_ok": len(ok),
            "errors": len(self.errors), "unfinished": self.unfinished,
            "unfinished_streamed_chunks": self.partial_tokens,
            "requests_per_s": round(self.requests_per_s, 3),
            "tokens": self.tokens, "tokens_per_s": round(self.tokens_per_s, 2),
            "tokens_per_request": round(self.tokens / len(ok), 2) if ok else None,
            "token_source": self.token_source,
            "latency_p50_s": _r(self.latency(50)), "latency_p99_s": _r(self.latency(99)),
            "ttft_p50_s": _r(self.ttft(50)), "ttft_p99_s": _r(self.ttft(99)),
            "first_errors": self.error_messages(),
        }


def _r(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 4)


async def run_load(cfg: LoadConfig) -> LoadReport:
    """Hold ``cfg.clients`` streaming clients for ``cfg.duration_s`` seconds; see the module doc.

    Client ``k`` sends prompts ``k, k + clients, k + 2 clients, ...`` (cycling), so two servers
    given the same config receive the same requests in the same order per client. ``cfg.warmup``
    requests go first, one at a time, and are not counted.

    Raises:
        BenchError: a warm-up request failed (the server is not answering as expected).
    """
    cfg.check()
    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    chat = cfg.endpoint == "chat"
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.clients + 2,
                          max_keepalive_connections=cfg.clients + 2)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), headers=headers,
                                 limits=limits, timeout=timeout) as client:
        for i in range(cfg.warmup):
            rec = await stream_request(client, path, cfg.body(cfg.prompts[i % len(cfg.prompts)]),
                                       chat)
            if not rec.ok:
                raise BenchError(f"warm-up request failed: {rec.error}")

        records: list[RequestRecord] = []
        start = time.perf_counter()
        deadline = start + cfg.duration_s
        last_end = [start]
        progress = [[0] for _ in range(cfg.clients)]  # chunks of each client's current request

        async def client_loop(k: int) -> None:
            j = k
            while time.perf_counter() < deadline:
                i = j % len(cfg.prompts)
                j += cfg.clients
                progress[k][0] = 0
                rec = await stream_request(client, path, cfg.body(cfg.prompts[i]), chat,
                                           progress[k])
                rec.prompt_index = i
                records.append(rec)
                if not rec.ok:
                    # A server that refuses at once (down, 429) must not turn the loop into a
                    # busy spin that starves the server being measured.
                    await asyncio.sleep(0.1)
                last_end[0] = max(last_end[0], time.perf_counter())

        tasks = [asyncio.create_task(client_loop(k)) for k in range(cfg.clients)]
        _, pending = await asyncio.wait(tasks, timeout=cfg.duration_s + cfg.drain_s)
        elapsed = (time.perf_counter() if pending else last_end[0]) - start
        partial = sum(progress[k][0] for k, t in enumerate(tasks) if t in pending)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return LoadReport(cfg.clients, cfg.duration_s, elapsed, records, len(pending), partial)


def fetch_model_name(base_url: str, api_key: str | None = None) -> str | None:
    """The first id of ``GET /v1/models``, or None when the server cannot list its models (then
    requests leave ``model`` out)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10.0)
        data = r.json().get("data") if r.status_code == 200 else None
        return data[0]["id"] if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError):
        return None


def format_report(name: str, rep: LoadReport) -> str:
    """A short human-readable block of :meth:`LoadReport.summary`."""
    s = rep.summary()

    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{1000 * x:.0f} ms"

    lines = [
        f"{name}: {s['clients']} clients, {s['duration_s']:g} s load window, "
        f"{s['elapsed_s']:.1f} s until the last response",
        f"  requests: {s['requests_ok']} ok, {s['errors']} errors, {s['unfinished']} unfinished "
        f"(cancelled after the drain timeout, {s['unfinished_streamed_chunks']} chunks streamed "
        "by then, counted in tok/s)",
        f"  throughput: {s['requests_per_s']:.2f} req/s, {s['tokens_per_s']:.1f} generated tok/s "
        f"({s['tokens']} tokens, {s['tokens_per_request'] or 'n/a'} per request, counted from "
        f"{s['token_source']})",
        f"  latency p50 {ms(s['latency_p50_s'])}, p99 {ms(s['latency_p99_s'])}; "
        f"time to first token p50 {ms(s['ttft_p50_s'])}, p99 {ms(s['ttft_p99_s'])}",
    ]
    for m in s["first_errors"]:
        lines.append(f"  error: {m}")
    return "\n".join(lines)


# --- server processes ----------------------------------------------------------------------------

def olmoflow_serve_cmd(model_dir: str | Path, port: int, extra: Sequence[str] = (), *,
                       device: str | None = None) -> list[str]:
    """``python -m olmoflow serve DIR --host 127.0.0.1 --port PORT --log-level warning
    [--device D] [extra...]`` (flags in ``extra`` come last, so they win)."""
    dev = ["--device", device] if device else []
    return [sys.executable, "-m", "olmoflow", "serve", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", *dev, *extra]


def transformers_serve_cmd(model_dir: str | Path, port: int, continuous_batching: bool, *,
                           device: str = "cpu", max_seqs: int = 32,
                           max_seq_tokens: int = 512) -> list[str]:
    """``transformers serve DIR`` pinned to the local directory, on 127.0.0.1:PORT, with or
    without its continuous batching (paged attention).

    With continuous batching the paged KV cache is sized explicitly, for ``max_seqs`` sequences
    of up to ``max_seq_tokens`` tokens (blocks of 64 tokens; 1024 tokens per forward): left to
    itself on a CPU, transformers sizes it to 80% of the machine's RAM, which takes a minute to
    allocate and starves everything else on a shared machine.
    """
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--device", device, "--log-level",
           "warning"]
    if not continuous_batching:
        return [*cmd, "--no-continuous-batching"]
    blocks = max_seqs * (-(-max_seq_tokens // 64) + 1)
    return [*cmd, "--continuous-batching", "--cb-block-size", "64", "--cb-num-blocks",
            str(blocks), "--cb-max-batch-tokens", "1024"]


def llama_cpp_serve_cmd(gguf: str | Path, port: int, *, n_ctx: int = 2048,
                        threads: int = 1) -> list[str]:
    """``python -m llama_cpp.server`` (llama-cpp-python's OpenAI-compatible server over llama.cpp)
    on a GGUF file, 127.0.0.1:PORT. ``--interrupt_requests False``: by default a new request
    interrupts the one being generated, which would cut every concurrent client short; the
    server then answers one request at a time (it has no batching of its own)."""
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host",
            "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads",
            str(threads), "--n_threads_batch", str(threads), "--interrupt_requests", "False"]


def llama_cpp_available() -> str | None:
    """None when ``llama_cpp.server`` imports in this interpreter (a subprocess, as the server
    runs), else why not."""
    r = subprocess.run([sys.executable, "-c", "import llama_cpp.server.app"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode == 0:
        return None
    last = (r.stderr.strip().splitlines() or ["import failed"])[-1]
    return f"llama-cpp-python's server does not import here ({last}); pip install " \
           "'llama-cpp-python[server]' to add llama.cpp as a reference"


class ServerProcess:
    """A server subprocess for the length of a ``with`` block.

    Started in its own session (so stopping it reaches any worker it forked and nothing else),
    output to a temporary log file; ``__enter__`` waits until ``GET {url}{health_path}`` answers
    200.
    Offline: ``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1`` are set, nothing is downloaded.

    Raises:
        BenchError: the process exited or /health did not answer within ``startup_s`` (the
            message carries the last lines of its log).
    """

    def __init__(self, name: str, cmd: list[str], port: int, *, startup_s: float = 180.0,
                 env: dict[str, str] | None = None, health_path: str = "/health"):
        self.name, self.cmd, self.port, self.startup_s = name, cmd, port, startup_s
        self.health_path = health_path  # llama-cpp-python's server has no /health
        self.url = f"http://127.0.0.1:{port}"
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)

    def log_tail(self, n: int = 8) -> str:
        try:
            lines = Path(self.log.name).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def __enter__(self) -> ServerProcess:
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)
        t_end = time.monotonic() + self.startup_s
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.__exit__()
                raise BenchError(f"{self.name} exited with status {self.proc.returncode} "
                                 f"before answering /health:\n{tail}")
            try:
                if httpx.get(self.url + self.health_path, timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        tail = self.log_tail()
        self.__exit__()
        raise BenchError(f"{self.name} did not answer /health within {self.startup_s:.0f} s:\n"
                         f"{tail}")

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 15 s; idempotent."""
        p = self.proc
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
            except ProcessLookupError:
                pass
        self.log.close()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        Path(self.log.name).unlink(missing_ok=True)
