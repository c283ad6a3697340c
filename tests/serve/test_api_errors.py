"""Every bad request gets its 4xx OpenAI-shaped JSON error (raw bodies through httpx), and no
input at all gets a 500."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest
from serving import MODEL_NAME, LiveServer, make_server

from olmoflow.serve.protocol import Limits

COMPLETION = {"model": MODEL_NAME, "prompt": "The cat", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "temperature": 0}
KEY = "test-key-123"


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def keyed(tiny_model):
    """A server with an API key and a 4 KiB body limit."""
    model, tok = tiny_model
    live = make_server(model, tok, api_key=KEY, limits=Limits(max_body_bytes=4096,
                                                               max_batch=4, max_queue=8))
    with httpx.Client(base_url=live.url, timeout=60) as c:
        yield c
    live.close()


def error_of(r: httpx.Response, status: int) -> dict:
    """The error object of ``r``, checked to have OpenAI's shape and ``status``."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in r.text
    return err


@pytest.mark.parametrize("raw", [b"{", b"not json", b"", b"\xff\xfe", b'{"a": NaN}',
                                 b"[" * 100_000 + b"]" * 100_000])
def test_malformed_json(http, raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        err = error_of(http.post(path, content=raw), 400)
        assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("where", ["prompt", "content", "stop"])
def test_lone_surrogates_are_a_400(http, where):
    # a JSON escape of half a UTF-16 pair is valid JSON but no Unicode text a tokenizer can take
    bad = '"x \\ud800 y"'
    if where == "prompt":
        path, raw = "/v1/completions", f'{{"prompt": {bad}, "max_tokens": 2}}'
    elif where == "content":
        path, raw = "/v1/chat/completions", \
            f'{{"messages": [{{"role": "user", "content": {bad}}}], "max_tokens": 2}}'
    else:
        path, raw = "/v1/completions", f'{{"prompt": "hi", "stop": [{bad}], "max_tokens": 2}}'
    assert "surrogate" in error_of(http.post(path, content=raw.encode()), 400)["message"]
    ok = http.post("/v1/completions", json=COMPLETION)  # the connection is still good
    assert ok.status_code == 200


@pytest.mark.parametrize("raw", [b"[]", b"3", b'"text"', b"null", b"true"])
def test_body_not_an_object(http, raw):
    err = error_of(http.post("/v1/completions", content=raw), 400)
    assert "JSON object" in err["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"model": MODEL_NAME}, "prompt"),
    ("/v1/chat/completions", {"model": MODEL_NAME}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages.0.role"),
])
def test_missing_fields(http, path, body, param):
    err = error_of(http.post(path, json=body), 400)
    assert err["param"] == param and "Missing" in err["message"]


WRONG_TYPES = [
    ("temperature", "hot"), ("temperature", [1]), ("n", "2"), ("n", 1.5), ("n", True),
    ("max_tokens", 1.5), ("max_tokens", "16"), ("stop", 3), ("stop", [1, 2]), ("stream", "yes"),
    ("seed", 0.5), ("top_p", "1"), ("top_k", 2.5), ("stream_options", 3), ("user", 5),
    ("repetition_penalty", "1"), ("presence_penalty", "0"),
]


@pytest.mark.parametrize("field,value", WRONG_TYPES)
def test_wrong_types_name_the_field(http, field, value):
    for path, base in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        err = error_of(http.post(path, json={**base, field: value}), 400)
        assert err["param"] == field, err
        assert "Invalid type" in err["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {**COMPLETION, "prompt": 5}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "logprobs": True}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "echo": "yes"}, "echo"),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [3]}, "messages.0"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]},
     "messages.0.content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": 1, "content": "x"}]},
     "messages.0.role"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": "2"}, "top_logprobs"),
])
def test_wrong_types_of_endpoint_fields(http, path, body, param):
    assert error_of(http.post(path, json=body), 400)["param"] == param


BAD_VALUES = [
    ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": 10**9}, "max_tokens"),
    ({"max_tokens": 2049}, "max_tokens"), ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"seed": -1}, "seed"), ({"seed": 2**70}, "seed"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"), ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"logit_bias": {"5": 10}}, "logit_bias"), ({"best_of": 3}, "best_of"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop"), ({"stop": [""]}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize("change,param", BAD_VALUES)
def test_bad_values_name_the_field(http, change, param):
    for path, base in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        err = error_of(http.post(path, json={**base, **change}), 400)
        assert err["param"] == param, err
        assert err["type"] == "invalid_request_error"


def test_unsupported_penalties_say_so(http):
    err = error_of(http.post("/v1/chat/completions", json={**CHAT, "presence_penalty": 1}), 400)
    assert "not supported" in err["message"] and "presence_penalty" in err["message"]
    ok = http.post("/v1/chat/completions",
                   json={**CHAT, "presence_penalty": 0, "frequency_penalty": 0.0})
    assert ok.status_code == 200


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {**COMPLETION, "prompt": ""}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["a", ""]}, "prompt.1"),
    ("/v1/completions", {**COMPLETION, "prompt": [[1, 2], []]}, "prompt.1"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, 10**6]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [-1]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "logprobs": -1}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]},
     "messages.0.role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, "messages.0.content"),
    ("/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content.0"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -3}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_bad_endpoint_values(http, path, body, param):
    assert error_of(http.post(path, json=body), 400)["param"] == param


def test_unknown_fields_are_ignored(http):
    r = http.post("/v1/completions", json={**COMPLETION, "best_of_luck": 3, "logit_bias": {}})
    assert r.status_code == 200


def test_unknown_model(http):
    for path, base in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        err = error_of(http.post(path, json={**base, "model": "gpt-5"}), 404)
        assert err["code"] == "model_not_found" and err["param"] == "model"
    assert error_of(http.get("/v1/models/gpt-5"), 404)["code"] == "model_not_found"
    assert http.get(f"/v1/models/{MODEL_NAME}").json()["id"] == MODEL_NAME


def test_context_window(http, server, tiny_model):
    _, tok = tiny_model
    window = server.engine.max_context
    long = "The cat sat on the mat. " * 40
    n = len(tok.encode(long))
    assert n > window
    err = error_of(http.post("/v1/completions", json={**COMPLETION, "prompt": long}), 400)
    assert f"maximum context length is {window} tokens" in err["message"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    # fits alone, not with the completion
    ids = tok.encode(long)[: window - 10]
    err = error_of(http.post("/v1/completions", json={**COMPLETION, "prompt": ids,
                                                      "max_tokens": 11}), 400)
    assert f"{window} tokens" in err["message"]
    assert http.post("/v1/completions", json={**COMPLETION, "prompt": ids,
                                              "max_tokens": 10}).status_code == 200
    msgs = [{"role": "user", "content": long}]
    err = error_of(http.post("/v1/chat/completions", json={**CHAT, "messages": msgs}), 400)
    assert err["param"] == "messages" and f"{window} tokens" in err["message"]
    no_max = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    err = error_of(http.post("/v1/chat/completions", json={**no_max, "messages": msgs}), 400)
    assert err["code"] == "context_length_exceeded"


def test_auth(keyed):
    err = error_of(keyed.post("/v1/completions", json=COMPLETION), 401)
    assert err["code"] == "invalid_api_key"
    bad = keyed.post("/v1/completions", json=COMPLETION,
                     headers={"Authorization": "Bearer wrong"})
    assert "Incorrect" in error_of(bad, 401)["message"]
    assert error_of(keyed.get("/v1/models", headers={"Authorization": KEY}), 401)
    assert error_of(keyed.post("/v1/chat/completions", json=CHAT), 401)
    good = {"Authorization": f"Bearer {KEY}"}
    assert keyed.get("/v1/models", headers=good).status_code == 200
    assert keyed.post("/v1/completions", json=COMPLETION, headers=good).status_code == 200
    # the health check and the page need no key
    assert keyed.get("/health").status_code == 200
    assert keyed.get("/").status_code == 200


def test_body_too_large(keyed):
    good = {"Authorization": f"Bearer {KEY}"}
    big = {**COMPLETION, "prompt": "x" * 5000}
    err = error_of(keyed.post("/v1/completions", json=big, headers=good), 413)
    assert "4096 bytes" in err["message"]
    # without Content-Length (chunked): counted as it arrives

    def chunks():
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i : i + 1000]

    error_of(keyed.post("/v1/completions", content=chunks(), headers=good), 413)
    assert keyed.post("/v1/completions", json=COMPLETION, headers=good).status_code == 200


def test_more_choices_than_the_server_can_hold_is_a_400(keyed):
    # a queue of 8: 9 choices could never be accepted; a 429 would invite retrying forever
    good = {"Authorization": f"Bearer {KEY}"}
    err = error_of(keyed.post("/v1/completions", json={**COMPLETION, "n": 9}, headers=good),
                   400)
    assert err["param"] == "n" and "at most 8 (--max-queue)" in err["message"]
    assert keyed.post("/v1/completions", json={**COMPLETION, "n": 8},
                      headers=good).status_code == 200


def test_unknown_path_and_wrong_method(http):
    assert error_of(http.get("/v1/nothing"), 404)["code"] == "unknown_url"
    assert error_of(http.post("/v1/embeddings", json={}), 404)["code"] == "unknown_url"
    assert error_of(http.get("/no/such/page"), 404)
    for method, path in (("GET", "/v1/completions"), ("GET", "/v1/chat/completions"),
                         ("POST", "/v1/models"), ("DELETE", "/health"),
                         ("PUT", "/v1/chat/completions")):
        r = http.request(method, path)
        assert error_of(r, 405)["code"] == "method_not_allowed"
        assert r.headers["allow"] in ("GET", "POST")


def test_unexpected_exception_is_a_json_500(tiny_model):
    """A bug inside a route answers OpenAI's error with no traceback (a route added for the
    test raises; nothing a client sends reaches such a state, see the fuzz test)."""
    from fastapi.routing import APIRoute

    from olmoflow.serve.app import build_app
    from olmoflow.serve.engine import Engine

    model, tok = tiny_model
    engine = Engine(model, tok, max_batch=1, max_queue=1)
    app = build_app(engine, tok, "olmo3", model_name=MODEL_NAME)

    async def boom():
        raise RuntimeError("secret internal detail")

    app.router.routes.insert(0, APIRoute("/v1/boom", boom, methods=["GET"]))
    live = LiveServer(app, engine)
    try:
        with httpx.Client(base_url=live.url, timeout=30) as c:
            r = c.get("/v1/boom")
            err = error_of(r, 500)
            assert err["type"] == "server_error" and "secret" not in r.text
    finally:
        live.close()


ODD = [None, -1, 0, 1, 2.5, -1e300, 1e300, 10**30, "", "x", [], [0], [[]], {}, {"a": 1}, True]
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "stop", "seed", "n", "stream", "stream_options", "logprobs",
          "top_logprobs", "echo", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "user"]


def test_no_input_gives_a_500(http):
    """Every field of both endpoints set to each of a set of odd JSON values: the answer is a
    success or a 4xx JSON error, never a 5xx."""
    statuses = set()
    for (path, base), field, value in itertools.product(
            (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)), FIELDS, ODD):
        body = {**base, field: value}
        if field not in ("max_tokens", "max_completion_tokens") and "max_tokens" in body:
            body["max_tokens"] = 1
        r = http.post(path, json=body)
        statuses.add(r.status_code)
        assert r.status_code < 500, (path, field, value, r.text)
        if r.status_code >= 400:
            error_of(r, r.status_code)
        elif body.get("stream") is True:
            assert r.text.rstrip().endswith("data: [DONE]")
    assert statuses >= {200, 400}
