"""The real ``olmoflow serve`` command: it starts, answers /health, enforces --api-key, and stops
cleanly on SIGINT and SIGTERM; bad directories and ports in use are one-line errors."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from olmoflow.cli import main


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


def test_serve_command(release_dir):
    """One real server process: the key comes from OLMOFLOW_API_KEY, Ctrl-C (SIGINT) stops it
    with status 0 (SIGTERM takes the same path: see test_sigterm_is_not_re_raised)."""
    key = "cli-key-9"
    cmd = [sys.executable, "-m", "olmoflow", "serve", str(release_dir), "--port", "0",
           "--served-model-name", "tiny", "--max-batch", "4", "--log-level", "warning"]
    env = {**os.environ, "OLMOFLOW_API_KEY": key}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True)
    reader.start()
    seen = []
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "serve exited early:\n" + "".join(seen)
            seen.append(line)
            m = re.search(r"OpenAI API: (http://127\.0\.0\.1:\d+)/v1", line)
            url = m.group(1) if m else None
        assert any("chat page:" in s for s in seen)
        with httpx.Client(base_url=url, timeout=30) as c:
            health = c.get("/health")
            assert health.status_code == 200 and health.json()["model"] == "tiny"
            assert c.get("/v1/models").status_code == 401
            auth = {"Authorization": f"Bearer {key}"}
            assert c.get("/v1/models", headers=auth).json()["data"][0]["id"] == "tiny"
            r = c.post("/v1/completions", headers=auth,
                       json={"model": "tiny", "prompt": "The cat", "max_tokens": 3,
                             "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        reader.join(timeout=10)
        rest = []
        while not lines.empty():
            item = lines.get()
            if item is not None:
                rest.append(item)
        out = "".join(seen + rest)
        assert "stopped" in out and "Traceback" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_directory_is_one_line_exit_2(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("olmoflow: error:") and "\n" not in err


def test_port_in_use_is_one_line_exit_2(release_dir, capsys):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(release_dir), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert "already in use" in err and "\n" not in err


@pytest.mark.parametrize("flag", [["--max-batch", "0"], ["--port", "70000"],
                                  ["--max-queue", "0"], ["--api-key", " "]])
def test_bad_flags_are_one_line_exit_2(release_dir, capsys, flag):
    assert main(["serve", str(release_dir), *flag]) == 2
    assert capsys.readouterr().err.strip().startswith("olmoflow: error: --")


def test_sigterm_is_not_re_raised():
    """uvicorn re-raises a caught SIGINT / SIGTERM after shutting down; the serve command's
    server does not, so the process ends with status 0 after cleaning up."""
    import uvicorn

    from olmoflow.serve.cli import _server_class

    server = _server_class()(uvicorn.Config(app=None))
    before = signal.getsignal(signal.SIGTERM)
    with server.capture_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs in the main thread at the next bytecode
    assert server.should_exit
    assert signal.getsignal(signal.SIGTERM) == before


def test_parser_does_not_import_the_http_stack():
    """``olmoflow --help`` stays fast: the verb's parser imports neither the HTTP stack nor
    torch."""
    code = ("import sys, argparse; from olmoflow.serve.cli import add_serve_parser; "
            "add_serve_parser(argparse.ArgumentParser().add_subparsers()); "
            "print([m for m in ('fastapi', 'uvicorn', 'starlette', 'pydantic', 'torch') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "[]", out.stderr
