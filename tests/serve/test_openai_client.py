"""The server through the official ``openai`` client: completions and chat, streamed and not,
``n`` with seeds, logprobs, echo, usage; greedy answers checked against ``generate()``."""

from __future__ import annotations

import math

import openai
import pytest
import torch
from serving import MODEL_NAME, TEXTS

from olmoflow.infer.generate import generate
from olmoflow.tokenizer.chat import IM_END, render

PROMPT = "The quick brown fox"
CHAT = [{"role": "system", "content": "be brief and helpful"},
        {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


def greedy_ids(model, tok, ids: list[int], n: int, stop: set[int]) -> list[int]:
    """``generate()``'s greedy continuation of ``ids``, cut after the first stop id."""
    out = generate(model, torch.tensor([ids]), max_new_tokens=n, eos_token_id=tok.eos_token_id)
    new = out[0, len(ids):].tolist()
    for i, t in enumerate(new):
        if t in stop:
            return new[:i]
    return new


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_completion_greedy_equals_generate(client, tiny_model):
    model, tok = tiny_model
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12,
                                  temperature=0)
    ids = tok.encode(PROMPT)
    want = greedy_ids(model, tok, ids, 12, {tok.eos_token_id})
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == tok.decode(want)
    assert r.choices[0].finish_reason == ("length" if len(want) == 12 else "stop")
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == min(12, len(want) + 1)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_equals_whole(client):
    kw = dict(model=MODEL_NAME, prompt=TEXTS[2][:20], max_tokens=24, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    assert "\ufffd" not in text


def test_chat_greedy_equals_generate_and_stream(client, tiny_model):
    model, tok = tiny_model
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=16,
                                       temperature=0)
    ids = render(CHAT, "olmo3", tok, add_generation_prompt=True)[0]
    want = greedy_ids(model, tok, ids, 16, {tok.eos_token_id, tok.token_to_id(IM_END)})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == tok.decode(want)
    assert r.usage.prompt_tokens == len(ids)

    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=16,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_chat_text_parts_and_developer_role(client):
    plain = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=8,
                                           temperature=0)
    parts = [{"role": "developer", "content": CHAT[0]["content"]},
             {"role": "user", "content": [{"type": "text", "text": "What is "},
                                          {"type": "text", "text": "2+2?"}]}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=parts, max_tokens=8,
                                       temperature=0)
    assert r.choices[0].message.content == plain.choices[0].message.content


def test_n_with_seed(client):
    kw = dict(model=MODEL_NAME, prompt="The cat", max_tokens=10, temperature=1.0, seed=123)
    two = client.completions.create(n=2, **kw)
    again = client.completions.create(n=2, **kw)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.text for c in two.choices] == [c.text for c in again.choices]
    # choice i is seeded seed + i: the same as a request of its own with that seed
    alone = [client.completions.create(**{**kw, "seed": 123 + i}).choices[0].text
             for i in range(2)]
    assert [c.text for c in two.choices] == alone
    assert two.usage.completion_tokens == sum(
        client.completions.create(**{**kw, "seed": 123 + i}).usage.completion_tokens
        for i in range(2))
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=10,
                                          temperature=1.0, seed=7, n=3)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    streamed = list(client.chat.completions.create(model=MODEL_NAME, messages=CHAT,
                                                   max_tokens=10, temperature=1.0, seed=7, n=3,
                                                   stream=True))
    for i in range(3):
        text = "".join(c.choices[0].delta.content or "" for c in streamed
                       if c.choices and c.choices[0].index == i)
        assert text == chat.choices[i].message.content


def test_completion_logprobs_shape(client, tiny_model):
    _, tok = tiny_model
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    if r.choices[0].finish_reason == "stop":
        n -= 1  # the EOS is counted but not returned
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for chosen, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and 3 <= len(top) <= 4 and top[chosen] == value
        # greedy: the chosen token is the most likely one
        assert max(top.values()) == pytest.approx(value)


def test_chat_logprobs_shape(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=8,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
        assert e.top_logprobs[0].token == e.token  # greedy
    none = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4,
                                          temperature=0)
    assert none.choices[0].logprobs is None


def test_echo_and_prompt_logprobs_match_a_forward(client, tiny_model):
    model, tok = tiny_model
    text = TEXTS[0][:40]
    r = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=0, echo=True,
                                  logprobs=1, temperature=0)
    ids = tok.encode(text)
    choice = r.choices[0]
    assert choice.text == text and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and "".join(lp.tokens) == text
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1, : tok.vocab_size].float()
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), want, atol=1e-4)
    # echo with new tokens: the prompt comes first, then the completion
    more = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=5, echo=True,
                                     temperature=0)
    alone = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=5,
                                      temperature=0)
    assert more.choices[0].text == text + alone.choices[0].text
    assert not math.isnan(sum(lp.token_logprobs[1:]))


def test_token_id_prompts_and_prompt_lists(client, tiny_model):
    _, tok = tiny_model
    prompts = ["The cat", "def add(a, b):", "emoji"]
    one_by_one = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=6,
                                            temperature=0).choices[0].text for p in prompts]
    listed = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=6,
                                       temperature=0)
    assert [c.text for c in sorted(listed.choices, key=lambda c: c.index)] == one_by_one
    ids = client.completions.create(model=MODEL_NAME, prompt=tok.encode(prompts[1]),
                                    max_tokens=6, temperature=0)
    assert ids.choices[0].text == one_by_one[1]
    id_lists = client.completions.create(model=MODEL_NAME,
                                         prompt=[tok.encode(p) for p in prompts], max_tokens=6,
                                         temperature=0)
    assert [c.text for c in id_lists.choices] == one_by_one
    assert listed.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)


def test_stop_sequences(client):
    kw = dict(model=MODEL_NAME, prompt="The cat sat", max_tokens=30, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    assert len(full) > 6
    stop = full[3:6]
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        stop=stop, stream=True, **kw))
    assert streamed == cut.text


def test_ignore_eos_and_min_tokens_run_on(client, tiny_model):
    _, tok = tiny_model
    kw = dict(model=MODEL_NAME, prompt=TEXTS[0], max_tokens=16, temperature=0)
    free = client.completions.create(**kw)
    assert free.choices[0].finish_reason == "stop"  # trained to end this text with EOS
    n = free.usage.completion_tokens
    forced = client.completions.create(extra_body={"ignore_eos": True}, **kw)
    assert forced.usage.completion_tokens == 16 and forced.choices[0].finish_reason == "length"
    held = client.completions.create(extra_body={"min_tokens": n + 1}, **kw)
    assert held.usage.completion_tokens >= n + 1
    assert held.choices[0].text.startswith(free.choices[0].text)


def test_default_chat_max_tokens_fits_the_context(client, server):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=0)
    window = server.engine.max_context
    assert r.usage.total_tokens <= window


def test_errors_reach_the_client_as_openai_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=-1)
    assert e.value.body["param"] == "temperature"
