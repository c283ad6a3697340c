"""Helpers of the serving tests (imported as ``serving``: a test module importing ``conftest``
could get another directory's): a tiny model trained for a few steps in the test (so its
next-token distributions are peaked and greedy decoding is not decided by rounding), its BPE
tokenizer with the ``olmo3`` chat template, a live server in a thread, and a free port."""

from __future__ import annotations

import socket

import torch

from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo
from olmoflow.tokenizer import BPETokenizer
from olmoflow.tokenizer.chat import add_chat_template

TEXTS = [
    "Hello world! The cat sat on the mat. What is 2+2? It is 4.\n\nSure thing (yes).",
    "def add(a, b):\n    return a + b\n# user, assistant, system: be brief and helpful",
    "emoji 😀 and café, naïve — 中文 text; more words about cats and mats",
    "The quick brown fox jumps over the lazy dog. 1, 2, 3, 4, 5, 6, 7, 8, 9, 10.",
]
WINDOW = 256


def train_tiny(steps: int = 60, sliding_window: int | None = 16) -> tuple[Olmo, BPETokenizer]:
    """A 2-layer Olmo (one sliding-window layer, one full) and its tokenizer with the ``olmo3``
    chat template, trained ``steps`` AdamW steps on :data:`TEXTS`; eval mode."""
    torch.manual_seed(0)
    tok = BPETokenizer().train_from_texts(TEXTS * 8, vocab_size=320)
    model = Olmo(ModelConfig(vocab_size=tok.vocab_size, d_model=64, n_layers=2, n_heads=4,
                             n_kv_heads=2, mlp_hidden=128, max_sequence_length=WINDOW,
                             sliding_window=sliding_window))
    add_chat_template(tok, "olmo3", model=model)
    ids = [torch.tensor(tok.encode(t) + [tok.eos_token_id]) for t in TEXTS]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        for row in ids:
            out = model(row[None, :-1], labels=row[None, 1:])
            out.loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval(), tok


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- a live server ---------------------------------------------------------------------------

MODEL_NAME = "olmoflow-tiny"


class LiveServer:
    """A uvicorn server running ``app`` in a thread on 127.0.0.1 (a port of its own, bound
    before the thread starts, so there is no race for it). ``url`` is ``http://127.0.0.1:PORT``;
    :meth:`close` stops the server and joins the thread."""

    def __init__(self, app, engine=None):
        import threading

        import uvicorn

        self.engine = engine
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says
        # TCP, and without it every keep-alive answer waits ~40 ms for a delayed ACK (Nagle)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name=f"uvicorn-{self.port}", daemon=True)
        self.thread.start()
        import time

        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
        if self.engine is not None:
            self.engine.stop()


def make_server(model, tok, *, api_key=None, limits=None, max_batch=64, max_queue=256):
    """A :class:`LiveServer` over a fresh engine on ``model`` (the caller closes it)."""
    from olmoflow.serve.app import build_app
    from olmoflow.serve.engine import Engine
    from olmoflow.serve.protocol import Limits

    limits = limits or Limits(max_batch=max_batch, max_queue=max_queue)
    engine = Engine(model, tok, max_batch=limits.max_batch, max_queue=limits.max_queue,
                    max_context=WINDOW)
    app = build_app(engine, tok, "olmo3", model_name=MODEL_NAME, api_key=api_key,
                    limits=limits)
    return LiveServer(app, engine)
