"""The fast scorer (shared-context KV cache, batched windows, batched greedy generation) gives the
answers of a naive one-request-at-a-time full forward, on a tiny random Olmo with sliding-window
layers (so left padding and windows interact)."""

import pytest
import torch
import torch.nn.functional as F

from olmoflow.errors import OlmoflowError
from olmoflow.eval.requests import GenerateRequest, LoglikelihoodRequest, RollingRequest
from olmoflow.eval.scorer import OlmoflowLM, cut_at_stop
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo

TEXTS = [
    "Hello world! The cat sat on the mat. The dog sat on the log. " * 3,
    "Question: what is the capital of France? Answer: Paris is the capital.",
    "mixed: naïve café — ü ö ä ß 😀 中文 and more text here",
]
REL, ABS = 1e-5, 1e-4


@pytest.fixture(scope="module")
def tok():
    from olmoflow.tokenizer import BPETokenizer

    return BPETokenizer().train_from_texts(TEXTS * 4, vocab_size=300)


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=320, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      mlp_hidden=64, max_sequence_length=96, sliding_window=8)
    return Olmo(cfg).eval()


class HFLike(torch.nn.Module):
    """The same model seen through a ``transformers``-style call (no cache API): exercises the
    plain batched path."""

    def __init__(self, olmo):
        super().__init__()
        self.olmo, self.config = olmo, olmo.config

    def forward(self, input_ids):
        return self.olmo(input_ids)


def naive(model, lm, req):
    """log P(cont | ctx) and is_greedy from one unpadded full forward of this request alone."""
    ctx, cont = lm.encode_pair(req.context, req.continuation)
    ids = torch.tensor([(ctx + cont)[:-1]])
    with torch.no_grad():
        logp = F.log_softmax(model(ids).logits[0].float(), -1)[len(ctx) - 1:]
    tgt = torch.tensor(cont)
    return float(logp.gather(1, tgt[:, None]).sum()), bool((logp.argmax(-1) == tgt).all())


def requests_mix():
    """Shared contexts (4 choices), distinct contexts, mixed lengths, an empty context, one-token
    and long continuations, a context with trailing space, a context that repeats exactly."""
    reqs = []
    q = "Question: what is the capital of France? Answer:"
    reqs += [LoglikelihoodRequest(q, c) for c in (" Paris", " the cat sat on the mat", " dog",
                                                  " Paris is the capital.")]
    reqs += [LoglikelihoodRequest("The cat sat on the", c) for c in (" mat", " log. The dog")]
    reqs += [LoglikelihoodRequest("", "Hello world!"), LoglikelihoodRequest("", " the")]
    reqs += [LoglikelihoodRequest("mixed: naïve café ", c) for c in ("ü ö", "中文 and more")]
    reqs += [LoglikelihoodRequest(TEXTS[0][:150], " sat on the mat.")]
    reqs += [LoglikelihoodRequest("Hello", " world")]
    reqs += [LoglikelihoodRequest(q, " Paris")]  # a duplicate request
    return reqs


@pytest.mark.parametrize("batch_size", [1, 3, 16])
@pytest.mark.parametrize("plain", [False, True])
def test_loglikelihood_matches_naive(model, tok, batch_size, plain):
    lm = OlmoflowLM(HFLike(model) if plain else model, tok, batch_size=batch_size)
    assert lm.cached is not plain
    reqs = requests_mix()
    got = lm.loglikelihood(reqs)
    for r, g in zip(reqs, got):
        lp, greedy = naive(model, lm, r)
        assert g.logprob == pytest.approx(lp, rel=REL, abs=ABS), r
        assert g.is_greedy == greedy
        assert g.n_tokens == len(lm.encode_pair(r.context, r.continuation)[1])
    # the same request gives the same answer wherever it sits
    assert got[0] == got[-1]


def test_greedy_continuation_is_detected(model, tok):
    """is_greedy must be able to come out True: score the model's own argmax next token after
    prefixes whose text re-tokenizes to the same ids."""
    lm = OlmoflowLM(model, tok, batch_size=4)
    reqs = []
    for text in TEXTS:
        for n in range(5, len(text), 3):
            ctx = text[:n]
            if ctx != ctx.rstrip():
                continue
            ids = tok.encode(ctx)
            with torch.no_grad():
                t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            cont = tok.decode([t])
            if cont and tok.encode(ctx + cont) == ids + [t]:
                reqs += [LoglikelihoodRequest(ctx, cont), LoglikelihoodRequest(ctx, cont + "zq")]
    assert reqs, "no prefix whose greedy token re-tokenizes cleanly"
    res = lm.loglikelihood(reqs)
    assert all(r.is_greedy for r in res[::2])
    assert not any(r.is_greedy for r in res[1::2])


def test_boundary_merge_keeps_the_context_alone(model, tok):
    """'capi' + 'tal of' merges across the boundary: the context is still encoded alone (lm-eval's
    split), so every continuation of one context string shares its tokens and its cache."""
    lm = OlmoflowLM(model, tok, batch_size=8)
    ctx = "capi"
    reqs = [LoglikelihoodRequest(ctx, c) for c in ("tal of", "p", "tal of France?", "p the")]
    ctx_ids = tok.encode(ctx)
    assert any(tok.encode(ctx + r.continuation)[:len(ctx_ids)] != ctx_ids for r in reqs), \
        "no merge across the boundary in this tokenizer"
    for r in reqs:
        head, cont = lm.encode_pair(r.context, r.continuation)
        assert head == ctx_ids
        assert cont == tok.encode(ctx + r.continuation)[len(ctx_ids):]
    for r, g in zip(reqs, lm.loglikelihood(reqs)):
        lp, greedy = naive(model, lm, r)
        assert g.logprob == pytest.approx(lp, rel=REL, abs=ABS)
        assert g.is_greedy == greedy


def test_encode_pair_follows_lm_eval(tok, model):
    lm = OlmoflowLM(model, tok)
    # trailing whitespace (any, as lm-eval's rstrip()) moves to the continuation
    a = lm.encode_pair("Answer: \n", "Paris")
    b = lm.encode_pair("Answer:", " \nParis")
    assert a == b
    assert lm.encode_pair("", "Hello") == ([tok.eos_token_id], tok.encode("Hello"))
    with pytest.raises(OlmoflowError, match="empty continuation"):
        lm.loglikelihood([LoglikelihoodRequest("a", "")])


def test_too_long_is_an_error(model, tok):
    lm = OlmoflowLM(model, tok, max_length=20)
    long = "The cat sat on the mat. " * 10
    with pytest.raises(OlmoflowError, match="exceeds the model's context of 20"):
        lm.loglikelihood([LoglikelihoodRequest("Hi", " there"), LoglikelihoodRequest(long, " x")])
    with pytest.raises(OlmoflowError, match="no room to generate"):
        lm.generate_until([GenerateRequest(long, max_new_tokens=4)])


@pytest.mark.parametrize("batch_size", [1, 4])
def test_rolling_matches_per_window_forward(model, tok, batch_size):
    lm = OlmoflowLM(model, tok, batch_size=batch_size, max_length=16)
    reqs = [RollingRequest(t) for t in TEXTS] + [RollingRequest("Hi"), RollingRequest("")]
    got = lm.loglikelihood_rolling(reqs)
    for r, g in zip(reqs, got):
        ids = [tok.eos_token_id] + tok.encode(r.text)
        # every target scored once, each with a full left context of up to 16 tokens (disjoint
        # windows; the last one borrows context): computed here with one forward per target
        total = 0.0
        with torch.no_grad():
            for t in range(1, len(ids)):
                n_win = -(-t // 16)  # window index of target t (1-based)
                end = min(n_win * 16, len(ids) - 1)
                begin = max(0, end - 16)
                logp = F.log_softmax(model(torch.tensor([ids[begin:t]])).logits[0, -1], -1)
                total += float(logp[ids[t]])
        assert g.n_tokens == len(ids) - 1
        assert g.logprob == pytest.approx(total, rel=REL, abs=ABS)
        assert g.n_bytes == len(r.text.encode()) and g.n_words == len(r.text.split())
    assert got[-1].logprob == 0.0 and got[-1].n_tokens == 0


def test_generate_batched_equals_one_at_a_time(model, tok):
    reqs = [GenerateRequest("The cat sat", max_new_tokens=12),
            GenerateRequest("Question: what is the capital of France? Answer:", ("\n",), 10),
            GenerateRequest("Hello", max_new_tokens=5),
            GenerateRequest("mixed: naïve café", ("\n",), 7),
            GenerateRequest("", max_new_tokens=6),
            GenerateRequest("The dog sat on the log. The dog", max_new_tokens=9)]
    one = OlmoflowLM(model, tok, batch_size=1).generate_until(reqs)
    many = OlmoflowLM(model, tok, batch_size=16).generate_until(reqs)
    three = OlmoflowLM(model, tok, batch_size=3).generate_until(reqs)
    assert one == many == three
    assert any(one)


def test_generate_cuts_at_the_earliest_stop(model, tok):
    lm = OlmoflowLM(model, tok, batch_size=4)
    prompts = ["The cat sat", "Hello world!", "Question:"]
    free = lm.generate_until([GenerateRequest(p, max_new_tokens=16) for p in prompts])
    # stop at a piece the free run produced: the stopped answer is the text before it
    checked = 0
    for p, text in zip(prompts, free):
        if len(text) < 4:
            continue
        stop = text[2:4]
        got = lm.generate_until([GenerateRequest(p, (stop, "@@never@@"), 16)])[0]
        assert got == text[:text.find(stop)]
        assert stop not in got
        checked += 1
    assert checked
    assert cut_at_stop("abc\n\ndef\nx", ["\n", "\n\n"]) == "abc"
    assert cut_at_stop("abc", ["z"]) == "abc"
