"""The continuous-batching engine on the real tiny model: batched == alone == generate(), seeds,
stop strings and held-back text, UTF-8 pieces, logprobs against a plain forward, abort, queue
limits, bad input, errors inside a step, the asyncio wrapper, and no thread left behind."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest
import torch
from serving import TEXTS

from olmoflow.infer.generate import generate
from olmoflow.infer.sampling import SamplingParams
from olmoflow.serve.engine import Engine, GenerationRequest, QueueFull, RequestOutput

TIMEOUT = 30.0


class Collector:
    """A callback that records one request's events."""

    def __init__(self, on_event=None):
        self.events: list[RequestOutput] = []
        self.done = threading.Event()
        self.started = threading.Event()
        self.on_event = on_event

    def __call__(self, out: RequestOutput) -> None:
        self.events.append(out)
        self.started.set()
        if self.on_event is not None:
            self.on_event(out)
        if out.finish_reason is not None:
            self.done.set()

    def wait(self) -> Collector:
        assert self.done.wait(TIMEOUT), "request did not finish"
        return self

    @property
    def ids(self) -> list[int]:
        return [t for e in self.events for t in e.token_ids]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def last(self) -> RequestOutput:
        return self.events[-1]


def engine_threads() -> set[threading.Thread]:
    """The engine loop threads alive now (a server fixture of another test file may hold one
    for the whole session: tests compare against the threads alive before they started)."""
    return {t for t in threading.enumerate() if t.name == "olmoflow-engine"}


@pytest.fixture
def make_engine(tiny_model):
    """``make_engine(**kwargs) -> Engine`` on the tiny model; every engine is stopped after the
    test and no engine thread it started may be left."""
    model, tok = tiny_model
    engines: list[Engine] = []
    before = engine_threads()

    def make(**kwargs) -> Engine:
        engine = Engine(model, tok, **kwargs)
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()
    assert engine_threads() <= before


def prompts(tok) -> list[list[int]]:
    """12 prompts of varied lengths (several longer than the 16-token sliding window)."""
    out = []
    for text in TEXTS:
        ids = tok.encode(text)
        out += [ids[:3], ids[:11], ids[:29]]
    return out


def run(engine: Engine, requests: list[GenerationRequest]) -> list[Collector]:
    cols = [Collector() for _ in requests]
    for r, c in zip(requests, cols):
        engine.submit(r, c)
    return [c.wait() for c in cols]


def alone(engine: Engine, request: GenerationRequest) -> Collector:
    return run(engine, [request])[0]


def reference(model, tok, prompt: list[int], sp: SamplingParams) -> list[int]:
    out = generate(model, torch.tensor([prompt]), sampling=sp, eos_token_id=tok.eos_token_id,
                   vocab_size=tok.vocab_size)
    return out[0, len(prompt):].tolist()


def test_greedy_batched_equals_alone_and_generate(tiny_model, make_engine):
    model, tok = tiny_model
    sp = SamplingParams(max_new_tokens=24)
    ps = prompts(tok)
    reqs = [GenerationRequest(f"r{i}", p, sp) for i, p in enumerate(ps)]
    engine = make_engine(max_batch=8)
    # Staggered arrival: half first; the rest once the first ones are mid-decode, more than
    # max_batch in all so some wait for a slot freed by a finished sequence.
    first = [Collector() for _ in range(6)]
    for r, c in zip(reqs[:6], first):
        engine.submit(r, c)
    for c in first:
        assert c.started.wait(TIMEOUT)
    rest = run(engine, reqs[6:])
    together = [c.wait() for c in first] + rest
    assert engine.stats()["steps"] > 0
    for i, (r, c) in enumerate(zip(reqs, together)):
        ref = reference(model, tok, r.prompt_ids, sp)
        assert c.ids == ref, f"prompt {i}: batched differs from generate()"
        assert alone(engine, GenerationRequest(f"a{i}", r.prompt_ids, sp)).ids == ref
        assert c.last.finish_reason in ("stop", "length")
        assert c.last.num_prompt_tokens == len(r.prompt_ids)
        assert c.last.num_generated_tokens == len(ref)


def test_sliding_window_prompt_longer_than_window(tiny_model, make_engine):
    model, tok = tiny_model
    ids = tok.encode(TEXTS[3])[:50]
    assert len(ids) > 16 and model.config.sliding_window == 16
    sp = SamplingParams(max_new_tokens=40)
    engine = make_engine(max_batch=4)
    others = [GenerationRequest(f"o{i}", tok.encode(TEXTS[i])[:5 + 7 * i], sp) for i in range(3)]
    cols = run(engine, [GenerationRequest("long", ids, sp), *others])
    assert cols[0].ids == reference(model, tok, ids, sp)
    for r, c in zip(others, cols[1:]):
        assert c.ids == reference(model, tok, r.prompt_ids, sp)


def test_sampling_seeds_together_equal_alone(tiny_model, make_engine):
    model, tok = tiny_model
    engine = make_engine(max_batch=8)
    ps = prompts(tok)[:6]
    sps = [SamplingParams(max_new_tokens=20, temperature=1.3, top_k=(0, 40)[i % 2],
                          top_p=(None, 0.95)[i % 2 == 0], seed=100 + i,
                          repetition_penalty=(1.0, 1.3)[i % 3 == 0])
           for i in range(len(ps))]
    reqs = [GenerationRequest(f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(ps, sps))]
    together = run(engine, reqs)
    for i, (r, c) in enumerate(zip(reqs, together)):
        assert c.ids == alone(engine, GenerationRequest(f"a{i}", r.prompt_ids, r.sampling)).ids
        assert c.ids == reference(model, tok, r.prompt_ids, r.sampling)
    hot = SamplingParams(max_new_tokens=20, temperature=2.0)
    outs = {tuple(alone(engine, GenerationRequest(f"d{s}", ps[0], replace(hot, seed=s))).ids)
            for s in range(4)}
    assert len(outs) > 1, "different seeds gave the same tokens"


def test_repetition_penalty_greedy_equals_generate(tiny_model, make_engine):
    model, tok = tiny_model
    engine = make_engine(max_batch=4)
    sp = SamplingParams(max_new_tokens=20, repetition_penalty=1.5)
    reqs = [GenerationRequest(f"p{i}", p, sp) for i, p in enumerate(prompts(tok)[:4])]
    for r, c in zip(reqs, run(engine, reqs)):
        assert c.ids == reference(model, tok, r.prompt_ids, sp)


def greedy_text(engine, prompt, n=30) -> tuple[list[int], str]:
    c = alone(engine, GenerationRequest("probe", prompt, SamplingParams(max_new_tokens=n)))
    return c.ids, c.text


def test_stop_string_removed_and_finish_reasons(tiny_model, make_engine):
    _, tok = tiny_model
    engine = make_engine()
    prompt = tok.encode("Hello world! The cat")
    ids, text = greedy_text(engine, prompt)
    stop = text[8:12]  # a piece of the greedy continuation, wherever token boundaries fall
    assert len(stop) == 4 and len(text) > 20
    c = alone(engine, GenerationRequest("s", prompt, SamplingParams(max_new_tokens=30,
                                                                     stop=("\x01zz", stop))))
    assert c.last.finish_reason == "stop"
    assert c.text == text[: text.index(stop)]
    # generation stops at the token completing the stop string; usage counts that token
    assert text.index(stop) + len(stop) <= len(tok.decode(c.ids))
    assert c.ids == ids[: len(c.ids)] and len(c.ids) < len(ids)
    assert c.last.num_generated_tokens == len(c.ids)
    assert c.last.num_prompt_tokens == len(prompt)
    # max_new_tokens -> "length"
    c = alone(engine, GenerationRequest("l", prompt, SamplingParams(max_new_tokens=5)))
    assert c.last.finish_reason == "length" and len(c.ids) == 5
    assert c.last.num_generated_tokens == 5
    # stop_token_ids end with "stop"; the id is counted but adds no text
    c = alone(engine, GenerationRequest("t", prompt, SamplingParams(max_new_tokens=30),
                                        stop_token_ids=(ids[3],)))
    assert c.last.finish_reason == "stop" and c.ids == ids[:4]
    assert c.text == tok.decode(ids[:3])


def test_eos_ends_with_stop(tiny_model, make_engine):
    _, tok = tiny_model
    engine = make_engine()
    prompt = tok.encode(TEXTS[0])  # trained with EOS after each text
    c = alone(engine, GenerationRequest("e", prompt, SamplingParams(max_new_tokens=10)))
    assert c.ids[-1] == tok.eos_token_id and c.last.finish_reason == "stop"
    assert c.text == tok.decode(c.ids[:-1])


def test_min_tokens_and_ignore_eos_hold_off_the_end(tiny_model, make_engine):
    model, tok = tiny_model
    engine = make_engine()
    prompt = tok.encode(TEXTS[0])
    free = alone(engine, GenerationRequest("f", prompt, SamplingParams(max_new_tokens=12)))
    ends_at = len(free.ids)  # greedy reaches EOS before the limit
    assert free.ids[-1] == tok.eos_token_id and ends_at < 12
    held = alone(engine, GenerationRequest("m", prompt, SamplingParams(max_new_tokens=12),
                                           min_tokens=ends_at + 1, logprobs=0))
    assert held.ids[:ends_at - 1] == free.ids[:-1]  # the same tokens until EOS would come
    assert held.ids[ends_at - 1] != tok.eos_token_id and len(held.ids) >= ends_at + 1
    # the logprob of the token picked instead of EOS is the model's own, not renormalised
    lp = torch.log_softmax(model(torch.tensor([prompt + held.ids[:ends_at - 1]])).logits[0, -1]
                           .masked_fill(torch.arange(model.config.vocab_size) >= tok.vocab_size,
                                        float("-inf")), -1)
    logged = [x for e in held.events for x in e.logprobs][ends_at - 1]
    assert logged.logprob == pytest.approx(lp[held.ids[ends_at - 1]].item(), abs=1e-4)
    never = alone(engine, GenerationRequest("i", prompt, SamplingParams(max_new_tokens=12),
                                            ignore_eos=True))
    assert len(never.ids) == 12 and tok.eos_token_id not in never.ids
    assert never.last.finish_reason == "length"
    with pytest.raises(ValueError, match="min_tokens"):
        engine.submit(GenerationRequest("x", prompt, min_tokens=-1), Collector())


def test_held_back_text_released_when_not_a_stop(tiny_model, make_engine):
    _, tok = tiny_model
    engine = make_engine()
    prompt = tok.encode("Hello world! The cat")
    ids, text = greedy_text(engine, prompt, 20)
    # A stop that the text after the second token starts but the third token never completes.
    head = tok.decode(ids[:2])
    stop = head[-2:] + "\x01"
    assert len(head) >= 2 and stop not in text
    c = alone(engine, GenerationRequest("h", prompt, SamplingParams(max_new_tokens=20,
                                                                     stop=(stop,))))
    assert c.text == text and c.last.finish_reason == "length"
    sent, decoded, held = "", [], False
    for e in c.events:
        sent += e.text
        decoded += e.token_ids
        full = tok.decode(decoded)
        assert full.startswith(sent)
        held |= len(sent) < len(full)
    assert held, "no text was held back"


def test_stop_string_across_events_and_batched(tiny_model, make_engine):
    _, tok = tiny_model
    engine = make_engine(max_batch=4)
    ps = [tok.encode("Hello world! The cat"), tok.encode("The quick brown")]
    full = [greedy_text(engine, p)[1] for p in ps]
    stop = (full[0][10:13], full[1][12:15])
    sp = SamplingParams(max_new_tokens=30, stop=stop)
    cols = run(engine, [GenerationRequest(f"x{i}", p, sp) for i, p in enumerate(ps)])
    for text, c in zip(full, cols):
        cut = min(text.index(s) for s in stop if s in text)
        assert c.text == text[:cut] and c.last.finish_reason == "stop"
        assert all(s not in e.text for e in c.events for s in stop)


def test_utf8_pieces_never_split(tiny_model, make_engine):
    _, tok = tiny_model
    engine = make_engine(max_batch=4)
    sp = SamplingParams(max_new_tokens=40)
    ps = [tok.encode(TEXTS[2])[:n] for n in (1, 2, 8, 12)]
    cols = run(engine, [GenerationRequest(f"u{i}", p, sp) for i, p in enumerate(ps)])
    assert any(any(ord(ch) > 0x2000 for ch in c.text) for c in cols), "no emoji/CJK generated"
    for c in cols:
        ids = c.ids[:-1] if c.ids[-1] == tok.eos_token_id else c.ids
        assert c.text == tok.decode(ids)
        assert all("\ufffd" not in e.text for e in c.events)


def test_logprobs_match_a_plain_forward(tiny_model, make_engine):
    model, tok = tiny_model
    engine = make_engine(max_batch=4)
    ps = [tok.encode(TEXTS[i])[:9 + 5 * i] for i in range(3)]
    sp = SamplingParams(max_new_tokens=12)
    reqs = [GenerationRequest(f"lp{i}", p, sp, logprobs=3, prompt_logprobs=True)
            for i, p in enumerate(ps)]
    for r, c in zip(reqs, run(engine, reqs)):
        seq = r.prompt_ids + c.ids
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0].float()
        logits[:, tok.vocab_size:] = float("-inf")
        lp = torch.log_softmax(logits, -1)
        got = [t for e in c.events for t in e.logprobs]
        assert [t.token_id for t in got] == c.ids
        P = len(r.prompt_ids)
        for i, t in enumerate(got):
            assert t.logprob == pytest.approx(lp[P - 1 + i, t.token_id].item(), abs=1e-4)
            assert len(t.top) == 3
            assert [x[3] for x in t.top] == sorted((x[3] for x in t.top), reverse=True)
            assert t.top[0][0] == t.token_id  # greedy picks the most likely
            assert t.top[1][3] == pytest.approx(lp[P - 1 + i].topk(2).values[1].item(), abs=1e-4)
        # the tokens' bytes rebuild the text exactly, partial characters included
        text_ids = [t for t in got if t.token_id != tok.eos_token_id]
        assert b"".join(bytes(t.bytes) for t in text_ids).decode() == c.text
        plp = c.events[0].prompt_logprobs
        assert plp is not None and plp[0] is None and len(plp) == P
        for i in range(1, P):
            assert plp[i].token_id == r.prompt_ids[i]
            assert plp[i].logprob == pytest.approx(lp[i - 1, r.prompt_ids[i]].item(), abs=1e-4)
        assert all(e.prompt_logprobs is None for e in c.events[1:])


def test_no_logprobs_unless_asked(tiny_model, make_engine):
    _, tok = tiny_model
    c = alone(make_engine(), GenerationRequest("n", tok.encode("Hello"),
                                               SamplingParams(max_new_tokens=4)))
    assert all(e.logprobs is None and e.prompt_logprobs is None for e in c.events)


def test_abort_mid_decode_frees_the_slot(tiny_model, make_engine):
    _, tok = tiny_model
    engine = make_engine(max_batch=2)
    sp = SamplingParams(max_new_tokens=200)
    prompt = tok.encode("The quick")
    c = Collector(on_event=lambda e: engine.abort("a") if len(c.events) == 3 else None)
    other = Collector()
    engine.submit(GenerationRequest("a", prompt, sp), c)
    engine.submit(GenerationRequest("b", prompt, SamplingParams(max_new_tokens=30)), other)
    c.wait()
    other.wait()
    assert c.last.finish_reason == "abort" and len(c.ids) < 200
    assert engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0
    engine.abort("a")  # idempotent, and unknown ids are ignored
    engine.abort("nope")
    # the id is free again once the request ended
    again = alone(engine, GenerationRequest("a", prompt, SamplingParams(max_new_tokens=3)))
    assert again.last.finish_reason == "length"


def test_queue_full_duplicate_id_and_waiting_abort(tiny_model, make_engine):
    _, tok = tiny_model
    engine = make_engine(max_batch=1, max_queue=1)
    gate, started = threading.Event(), threading.Event()

    def hold(e):  # blocks the engine thread inside the first event: the slot stays busy
        started.set()
        gate.wait(TIMEOUT)

    prompt = tok.encode("Hello")
    sp = SamplingParams(max_new_tokens=50)
    first = Collector(on_event=hold)
    engine.submit(GenerationRequest("a", prompt, sp), first)
    assert started.wait(TIMEOUT)
    with pytest.raises(ValueError, match="already running"):
        engine.submit(GenerationRequest("a", prompt, sp), Collector())
    waiting = Collector()
    engine.submit(GenerationRequest("b", prompt, sp), waiting)
    with pytest.raises(QueueFull):
        engine.submit(GenerationRequest("c", prompt, sp), Collector())
    assert engine.stats()["waiting"] == 1
    engine.abort("b")
    first.on_event = None
    gate.set()
    waiting.wait()
    assert waiting.last.finish_reason == "abort" and waiting.ids == []
    engine.abort("a")
    assert first.wait().last.finish_reason == "abort"


def test_bad_requests(tiny_model, make_engine):
    _, tok = tiny_model
    engine = make_engine(max_context=64)
    assert engine.max_context == 64 and engine.vocab_size == tok.vocab_size
    with pytest.raises(ValueError, match="context"):
        engine.submit(GenerationRequest("x", list(range(60)), SamplingParams(max_new_tokens=5)),
                      Collector())
    with pytest.raises(ValueError, match="empty"):
        engine.submit(GenerationRequest("x", [], SamplingParams()), Collector())
    with pytest.raises(ValueError, match="token ids"):
        engine.submit(GenerationRequest("x", [10**6], SamplingParams()), Collector())
    assert engine.stats()["waiting"] == 0
    with pytest.raises(ValueError, match="max_context"):
        Engine(*tiny_model, max_context=10**6)


def test_zero_new_tokens_and_prompt_logprobs_only(tiny_model, make_engine):
    _, tok = tiny_model
    engine = make_engine()
    prompt = tok.encode("Hello world")
    c = alone(engine, GenerationRequest("z", prompt, SamplingParams(max_new_tokens=0),
                                        logprobs=0, prompt_logprobs=True))
    assert c.last.finish_reason == "length" and c.ids == [] and c.text == ""
    plp = c.events[0].prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None and plp[1].top == []


def test_error_in_a_step_fails_the_batch_and_keeps_serving(tiny_model, make_engine):
    model, tok = tiny_model
    engine = make_engine(max_batch=4)
    boom = {"armed": True}

    def explode(module, args):
        if boom["armed"] and args[0].shape[1] == 1:  # a decode step, not a prefill
            boom["armed"] = False
            raise RuntimeError("kaboom")

    handle = model.blocks[0].register_forward_pre_hook(explode)
    try:
        c = alone(engine, GenerationRequest("e", tok.encode("Hello"),
                                            SamplingParams(max_new_tokens=10)))
    finally:
        handle.remove()
    assert c.last.finish_reason == "abort" and "kaboom" in c.last.error
    assert engine.stats()["running"] == 0
    ok = alone(engine, GenerationRequest("f", tok.encode("Hello"),
                                         SamplingParams(max_new_tokens=10)))
    assert ok.last.finish_reason in ("stop", "length") and ok.last.error is None


def test_asyncio_generate_and_disconnect(tiny_model, make_engine):
    model, tok = tiny_model
    engine = make_engine(max_batch=4)
    sp = SamplingParams(max_new_tokens=16)
    ps = prompts(tok)[:3]

    async def collect(i, p):
        return [e async for e in engine.generate(GenerationRequest(f"g{i}", p, sp))]

    async def disconnect():
        agen = engine.generate(GenerationRequest("gone", ps[0],
                                                 SamplingParams(max_new_tokens=200)))
        await agen.__anext__()
        await agen.aclose()  # the client went away: the request is aborted

    async def main():
        outs = await asyncio.gather(*(collect(i, p) for i, p in enumerate(ps)), disconnect())
        return outs[:-1]

    for p, events in zip(ps, asyncio.run(main())):
        assert events[-1].finish_reason is not None
        assert [t for e in events for t in e.token_ids] == reference(model, tok, p, sp)
    for _ in range(200):
        if engine.stats()["running"] == 0:
            break
        threading.Event().wait(0.01)
    assert engine.stats()["running"] == 0


def test_stop_aborts_everything_and_joins(tiny_model):
    model, tok = tiny_model
    before = engine_threads()
    engine = Engine(model, tok, max_batch=1)
    gate = threading.Event()
    first = Collector(on_event=lambda e: gate.wait(TIMEOUT) if len(first.events) == 1 else None)
    engine.submit(GenerationRequest("a", tok.encode("Hi"), SamplingParams(max_new_tokens=100)),
                  first)
    waiting = Collector()
    engine.submit(GenerationRequest("b", tok.encode("Hi"), SamplingParams()), waiting)
    stopper = threading.Thread(target=engine.stop)
    stopper.start()
    gate.set()
    stopper.join(TIMEOUT)
    assert not stopper.is_alive()
    assert first.wait().last.finish_reason == "abort"
    assert waiting.wait().last.finish_reason == "abort"
    assert engine_threads() <= before
    # a request after stop() ends at once with "abort"; start() serves again
    late = Collector()
    engine.submit(GenerationRequest("c", tok.encode("Hi"), SamplingParams()), late)
    assert late.done.is_set() and late.last.finish_reason == "abort"
    assert engine_threads() <= before
    engine.start()
    try:
        again = alone(engine, GenerationRequest("c", tok.encode("Hi"),
                                                SamplingParams(max_new_tokens=3)))
        assert again.last.finish_reason in ("stop", "length")
    finally:
        engine.stop()
    assert engine_threads() <= before
