"""A model imported with a chat template of its own (none of olmoflow's named ones) is chatted
with and served: the prompt ids are ``transformers``' ``apply_chat_template``'s, and a reply stops
at the template's end-of-turn token."""

from __future__ import annotations

import httpx
import pytest
import torch
from serving import MODEL_NAME, WINDOW, LiveServer

from olmoflow.infer.chat import ChatSession, resolve_template
from olmoflow.infer.generate import generate
from olmoflow.infer.sampling import SamplingParams
from olmoflow.model.olmo import Olmo
from olmoflow.tokenizer import BPETokenizer
from olmoflow.tokenizer.chat import CUSTOM, TEMPLATES

transformers = pytest.importorskip("transformers")

# A Qwen-style ChatML template: no default system turn, generation blocks, its own checks.
CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('the system message must come first') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAT = [{"role": "system", "content": "be brief and helpful"},
        {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def imported(tiny_model, tmp_path_factory):
    """An HF directory of the tiny model whose tokenizer carries :data:`CHATML`, loaded back:
    ``(directory, model, tokenizer)``."""
    model, tok = tiny_model
    d = tmp_path_factory.mktemp("imported")
    model.save_pretrained(d, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tok.save(d)
    mine = BPETokenizer.load(d)
    mine.set_special_tokens(eos="<|endoftext|>")  # as many imports do: EOS is not <|im_end|>
    mine.chat_template = CHATML
    mine.save(d)
    return d, Olmo.from_pretrained(d).eval(), BPETokenizer.load(d)


def want_ids(d, messages) -> list[int]:
    hf = transformers.AutoTokenizer.from_pretrained(d)
    return list(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=False))


def greedy(model, ids, n, stop) -> list[int]:
    out = generate(model, torch.tensor([ids]), max_new_tokens=n)[0, len(ids):].tolist()
    return next((out[:i] for i, t in enumerate(out) if t in stop), out)


def test_chat_uses_the_imported_template(imported):
    d, model, tok = imported
    template, note = resolve_template(tok, model)
    assert template.name == CUSTOM and template.jinja == CHATML and note is None
    assert all(template.jinja != t.jinja for t in TEMPLATES.values())
    session = ChatSession(model, tok, system=CHAT[0]["content"],
                          sampling=SamplingParams(max_new_tokens=8, temperature=0.0),
                          max_context=WINDOW)
    assert session.stop_ids == {tok.eos_token_id, tok.token_to_id("<|im_end|>")}
    reply = "".join(session.reply(CHAT[1]["content"]))
    assert session.last_prompt_ids == want_ids(d, CHAT)
    stop = session.stop_ids
    assert reply == tok.decode(greedy(model, session.last_prompt_ids, 8, stop))


def test_serve_answers_with_the_imported_template(imported):
    from olmoflow.serve.app import build_app
    from olmoflow.serve.engine import Engine

    d, model, tok = imported
    template, _ = resolve_template(tok, model)
    engine = Engine(model, tok, max_batch=4, max_queue=8, max_context=WINDOW)
    live = LiveServer(build_app(engine, tok, template, model_name=MODEL_NAME), engine)
    try:
        r = httpx.post(f"{live.url}/v1/chat/completions", timeout=60,
                       json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 12,
                             "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        ids = want_ids(d, CHAT)
        assert body["usage"]["prompt_tokens"] == len(ids)
        stop = {tok.eos_token_id, tok.token_to_id("<|im_end|>")}
        assert body["choices"][0]["message"]["content"] == tok.decode(greedy(model, ids, 12, stop))
        bad = httpx.post(f"{live.url}/v1/chat/completions", timeout=60,
                         json={"model": MODEL_NAME, "max_tokens": 2,
                               "messages": CHAT[::-1]})
        assert bad.status_code == 400 and "the system message must come first" in bad.text
    finally:
        live.close()
