"""Many clients at once (answers equal to each request alone), client disconnects aborting
their engine requests, and the bounded queue answering 429."""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import httpx
import openai
import pytest
import torch
from serving import MODEL_NAME, TEXTS, make_server

from olmoflow.infer.generate import generate
from olmoflow.serve.protocol import Limits

STEP_DELAY = 0.05  # seconds added to every forward of the slowed model


def prompts(count: int) -> list[str]:
    """``count`` different short prompts cut from the training texts."""
    out = []
    for i in range(count):
        text = TEXTS[i % len(TEXTS)]
        start = (i * 7) % (len(text) - 12)
        out.append(text[start : start + 6 + i % 7])
    assert len(set(out)) == count
    return out


async def one(client: openai.AsyncOpenAI, i: int, prompt: str) -> tuple:
    """Request ``i``: completions or chat, streamed or not (by ``i``), greedy; the text, the
    tokens (completions), the finish reason."""
    if i % 4 == 3:
        msgs = [{"role": "user", "content": prompt}]
        if i % 8 == 7:
            chunks = [c async for c in await client.chat.completions.create(
                model=MODEL_NAME, messages=msgs, max_tokens=12, temperature=0, stream=True)]
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            return text, None, chunks[-1].choices[0].finish_reason
        r = await client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=12,
                                                 temperature=0)
        return r.choices[0].message.content, None, r.choices[0].finish_reason
    if i % 2:
        chunks = [c async for c in await client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0, logprobs=0,
            stream=True)]
        tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens
                                              if c.choices[0].logprobs else [])]
        text = "".join(c.choices[0].text for c in chunks)
        return text, tokens, chunks[-1].choices[0].finish_reason
    r = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16,
                                        temperature=0, logprobs=0)
    return r.choices[0].text, r.choices[0].logprobs.tokens, r.choices[0].finish_reason


def test_fifty_concurrent_clients_equal_alone(server):
    texts = prompts(50)

    async def run() -> tuple[list, list]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                      timeout=120) as client:
            alone = [await one(client, i, p) for i, p in enumerate(texts)]
            before = server.engine.stats()
            together = await asyncio.gather(*(one(client, i, p) for i, p in enumerate(texts)))
            after = server.engine.stats()
        return alone, together, before, after

    alone, together, before, after = asyncio.run(run())
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert a == b, (i, texts[i], a, b)
    assert any(len(a[0]) > 0 for a in alone)
    # batched: fewer decode steps than tokens generated
    steps = after["steps"] - before["steps"]
    tokens = after["tokens_generated"] - before["tokens_generated"]
    assert steps < tokens
    assert after["running"] == 0


# ---- a slowed model: disconnects and the full queue ---------------------------------------

@pytest.fixture(scope="module")
def slow(tiny_model):
    """A server (batch 1, queue 1) over a copy of the tiny model that sleeps STEP_DELAY in
    each forward, so requests stay in flight long enough to disconnect from; ``(server,
    prompt, aborted)``: a prompt whose greedy continuation has no EOS in 40 tokens, and the ids
    the engine was asked to abort."""
    model, tok = tiny_model
    prompt = None
    for text in TEXTS:
        for start in range(0, 40, 5):
            ids = tok.encode(text[start : start + 12])
            out = generate(model, torch.tensor([ids]), max_new_tokens=40)[0, len(ids):]
            if tok.eos_token_id not in out.tolist():
                prompt = text[start : start + 12]
                break
        if prompt:
            break
    assert prompt is not None
    slowed = copy.deepcopy(model)
    slowed.register_forward_hook(lambda *_: time.sleep(STEP_DELAY))
    live = make_server(slowed, tok, limits=Limits(max_batch=1, max_queue=1))
    aborted: list[str] = []
    real_abort = live.engine.abort

    def spy(request_id: str) -> None:
        aborted.append(request_id)
        real_abort(request_id)

    live.engine.abort = spy
    yield live, prompt, aborted
    live.close()


def wait_for(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_disconnect_mid_stream_aborts(slow):
    live, prompt, aborted = slow
    before = live.engine.stats()["tokens_generated"]
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 40, "temperature": 0,
            "stream": True}
    with httpx.Client(base_url=live.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert '"text_completion"' in first
            wait_for(lambda: live.engine.stats()["running"] == 1)
    # the connection is closed: the request is aborted and its slot freed
    wait_for(lambda: live.engine.stats()["running"] == 0)
    assert len(aborted) == 1 and aborted[0].startswith("cmpl-")
    assert live.engine.stats()["tokens_generated"] - before < 40
    aborted.clear()


def test_disconnect_while_waiting_for_a_whole_answer_aborts(slow):
    live, prompt, aborted = slow
    before = live.engine.stats()["tokens_generated"]
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 40, "temperature": 0}
    with httpx.Client(base_url=live.url, timeout=httpx.Timeout(30, read=0.5)) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=body)
    wait_for(lambda: len(aborted) == 1)
    wait_for(lambda: live.engine.stats()["running"] == 0)
    assert live.engine.stats()["tokens_generated"] - before < 40
    aborted.clear()


def test_queue_full_is_429_with_retry_after(slow):
    live, prompt, aborted = slow
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 40, "temperature": 0}
    with httpx.Client(base_url=live.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)
            wait_for(lambda: live.engine.stats()["running"] == 1)
            # n=2 with a queue of one could never be accepted: a 400, not a 429 to retry
            r = c.post("/v1/completions", json={**body, "n": 2})
            assert r.status_code == 400 and "--max-queue" in r.json()["error"]["message"]
            assert live.engine.stats()["waiting"] == 0
            # one waits (in a thread), the next is refused
            waiting = threading.Thread(target=lambda: c.post(
                "/v1/completions", json={**body, "max_tokens": 2}))
            waiting.start()
            wait_for(lambda: live.engine.stats()["waiting"] == 1)
            r = c.post("/v1/chat/completions", json={
                "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert err["code"] == "rate_limit_exceeded" and "busy" in err["message"]
        waiting.join(timeout=30)
    wait_for(lambda: live.engine.stats()["running"] == 0)
    aborted.clear()
