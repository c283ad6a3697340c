"""Attention backends agree with the eager reference under every mask; empty rows are zeros;
fallbacks warn once; the static KV cache decodes under torch.compile without recompiling."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_fp32_close, forward_terms

from olmoflow.model import attention as attn
from olmoflow.model.attention import AttentionMask, attend
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo

# Backends that run on this machine's CPU. flex: forward only (no CPU backward in torch 2.13).
CPU_BACKENDS = ["sdpa", "flex"]
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture(autouse=True)
def _fresh_warnings():
    attn._warned.clear()
    yield
    attn._warned.clear()


def _qkv(B=2, H=4, H_kv=4, T=40, hd=16, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, hd, generator=g) for h in (H, H_kv, H_kv))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _docs(B=2, lengths=(13, 17, 10)):
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].expand(B, -1)


def _left_pad(B=2, T=40, pads=(0, 9)):
    kp = torch.ones(B, T, dtype=torch.bool)
    for b, p in enumerate(pads):
        kp[b, :p] = False
    return kp


# attend() on q, k, v of _qkv: the scores sum head_dim terms, the softmax and the weighted sum T
# terms each; two ulps per term, as each backend rounds its exp its own way (tolerance.py).
ATTEND_TERMS, ATTEND_ULPS = 16 + 2 * 40, 2

CASES = {
    "causal": dict(),
    "window": dict(window=8),
    "docs": dict(doc_ids=_docs()),
    "docs+window": dict(doc_ids=_docs(), window=8),
    "left_pad": dict(key_padding=_left_pad()),
    "left_pad+window": dict(key_padding=_left_pad(), window=8),
}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("h_kv", [4, 2], ids=["mha", "gqa"])
def test_backend_matches_eager(backend, case, h_kv):
    q, k, v = _qkv(H_kv=h_kv)
    kw = dict(CASES[case])
    mask = AttentionMask(torch.arange(40), 40, kw.pop("window", None), **kw)
    with torch.no_grad():
        ref = attend(q, k, v, mask, "eager")
        out = attend(q, k, v, mask, backend)
    assert_fp32_close(out, ref, ATTEND_TERMS, ATTEND_ULPS)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_decode_shaped_queries_match_eager(backend):
    """Tq < Tk: the last queries of a dynamic cache, and a static cache's slots (unaligned)."""
    q, k, v = _qkv(H_kv=2)
    q = q[:, :, -3:]
    with torch.no_grad():
        for mask in (AttentionMask(torch.arange(37, 40), 40, 8),
                     AttentionMask(torch.arange(20, 23), 40, 8, key_padding=_left_pad(),
                                   aligned=False)):
            assert_fp32_close(attend(q, k, v, mask, backend), attend(q, k, v, mask, "eager"),
                              ATTEND_TERMS, ATTEND_ULPS)


def test_plain_causal_uses_is_causal_without_mask(monkeypatch):
    """The training fast path: no padding, no documents, T <= window -> is_causal=True, no
    tensor."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, mlp_hidden=48,
                      max_sequence_length=64, sliding_window=16, full_attention_every=2)
    Olmo(cfg)(torch.randint(0, 64, (2, 16)))
    assert len(calls) == 2
    assert all(c.get("is_causal") and c.get("attn_mask") is None for c in calls)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex"])
def test_fully_masked_rows_are_zero_forward_and_backward(backend):
    grad = backend != "flex"  # flex has no CPU backward: it is checked forward-only
    q, k, v = _qkv(H_kv=2, grad=grad)
    mask = AttentionMask(torch.arange(40), 40, 8, key_padding=_left_pad(pads=(3, 9)))
    with torch.set_grad_enabled(grad):
        out = attend(q, k, v, mask, backend)
    assert torch.isfinite(out).all()
    assert (out[0, :, :3] == 0).all() and (out[1, :, :9] == 0).all()  # exactly zero
    assert (out[1, :, 9:].abs().sum(-1) > 0).all()
    if grad:
        (out.square().sum()).backward()
        for t in (q, k, v):
            assert torch.isfinite(t.grad).all()
        assert (q.grad[1, :, :9] == 0).all()
        assert (k.grad[1, :, :9] == 0).all() and (v.grad[1, :, :9] == 0).all()  # pad keys unused


def test_sdpa_gradients_match_eager_under_masks():
    for case in ("docs+window", "left_pad"):
        kw = dict(CASES[case])
        mask = AttentionMask(torch.arange(40), 40, kw.pop("window", None), **kw)
        grads = []
        for backend in ("eager", "sdpa"):
            q, k, v = _qkv(H_kv=2, grad=True)
            attend(q, k, v, mask, backend).sin().sum().backward()
            grads.append([t.grad for t in (q, k, v)])
        for a, b in zip(*grads):  # back through the same sums: twice the forward's bound
            assert_fp32_close(a, b, ATTEND_TERMS, 2 * ATTEND_ULPS)


def _model(backend="sdpa", **kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=97, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, mlp_hidden=96,
               max_sequence_length=64, sliding_window=8, attention_backend=backend)
    return Olmo(ModelConfig(**{**cfg, **kw})).eval()


def assert_logits_close(actual, expected, model, positions, ulps=2):
    """Two code paths of one model's forward over ``positions`` positions: within ``ulps`` ulps per
    accumulated term of the logits' scale (tolerance.py; two: backends round exp differently)."""
    assert_fp32_close(actual, expected, forward_terms(model.config, positions), ulps)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex"])
def test_packed_document_equals_document_alone(backend):
    """Intra-document masking: document 2 of 3 packed ones gives the logits it gives alone
    (RoPE is relative, so its offset in the pack does not matter)."""
    model = _model(backend)
    lengths = (13, 17, 10)
    ids = torch.randint(0, 97, (1, sum(lengths)))
    with torch.no_grad():
        packed = model(ids, doc_ids=_docs(1, lengths)).logits
        alone = model(ids[:, 13:30]).logits
        ref = _model("eager")(ids, doc_ids=_docs(1, lengths)).logits
    assert_logits_close(packed[:, 13:30], alone, model, sum(lengths))
    assert_logits_close(packed, ref, model, sum(lengths))


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_left_padded_model_matches_eager_and_is_finite(backend):
    ids = torch.randint(0, 97, (2, 20))
    am = _left_pad(2, 20, pads=(0, 7))
    with torch.no_grad():
        out = _model(backend)(ids, attention_mask=am).logits
        ref = _model("eager")(ids, attention_mask=am).logits
    assert torch.isfinite(out).all()
    assert_logits_close(out, ref, _model(), 20)


def test_unavailable_backend_warns_once_and_runs_sdpa():
    ids = torch.randint(0, 97, (2, 20))
    ref = _model("sdpa")(ids).logits
    model = _model("flash")
    with pytest.warns(UserWarning) as record:
        out1 = model(ids).logits
        out2 = model(ids[:, :12]).logits
    msgs = [str(w.message) for w in record if "attention backend" in str(w.message)]
    # once, not per layer or per call
    assert msgs == ["attention backend 'flash' is unavailable (flash_attn not installed; needs "
                    "CUDA); using 'sdpa'"]
    assert torch.equal(out1, ref)  # the very sdpa call: bit for bit
    assert_logits_close(out2, ref[:, :12], model, 20)  # 12 positions, not 20: other blocking


def test_flex_training_on_cpu_falls_back_with_one_warning():
    model = _model("flex").train()
    ref = _model("sdpa").train()
    ids = torch.randint(0, 97, (2, 20))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loss = model(ids, ids).loss
        model(ids, ids)
    msgs = [str(w.message) for w in record if "attention backend 'flex'" in str(w.message)]
    assert len(msgs) == 1 and "backward" in msgs[0] and "using 'sdpa'" in msgs[0]
    loss.backward()
    ref(ids, ids).loss.backward()
    assert torch.equal(loss, ref(ids, ids).loss)  # the fallback is the very sdpa path
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_unknown_backend_is_rejected():
    from olmoflow.errors import OlmoflowError

    with pytest.raises(OlmoflowError, match="attention_backend"):
        ModelConfig(attention_backend="xformers")
    q, k, v = _qkv()
    with pytest.raises(KeyError, match="unknown attention backend"):
        attend(q, k, v, AttentionMask.causal(40, 40, q.device), "xformers")


def test_doc_ids_while_decoding_is_rejected():
    model = _model()
    cache = model.new_cache(1, 20)
    ids = torch.randint(0, 97, (1, 10))
    with torch.no_grad():
        model(ids, cache=cache)
        with pytest.raises(ValueError, match="doc_ids"):
            model(ids[:, :1], doc_ids=torch.zeros(1, 1, dtype=torch.long), cache=cache)


# ----- static KV cache ------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_static_cache_decode_equals_full_forward(backend):
    model = _model(backend)
    ids = torch.randint(0, 97, (2, 30))  # past the window of 8
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache(2, 32, static=True)
        parts = [model(ids[:, :7], cache=cache).logits]
        for t in range(7, 30):
            parts.append(model(ids[:, t : t + 1], cache=cache).logits)
    assert cache.length == 30
    assert_logits_close(torch.cat(parts, 1), full, model, 32)


def test_static_cache_left_padding_matches_dynamic():
    """Pads are remembered by the cache: decode steps need no attention_mask."""
    model = _model()
    ids = torch.randint(0, 97, (2, 9))
    am = _left_pad(2, 9, pads=(0, 4))
    with torch.no_grad():
        dyn, sta = model.new_cache(2, 16), model.new_cache(2, 16, static=True)
        a = [model(ids, attention_mask=am, cache=dyn).logits]
        b = [model(ids, attention_mask=am, cache=sta).logits]
        for _ in range(5):
            nxt = a[-1][:, -1].argmax(-1, keepdim=True)
            am = torch.cat([am, torch.ones(2, 1, dtype=torch.bool)], 1)
            a.append(model(nxt, attention_mask=am, cache=dyn).logits)
            b.append(model(nxt, cache=sta).logits)
    a, b = torch.cat(a, 1), torch.cat(b, 1)
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    assert_logits_close(b, a, model, 16)


def test_static_cache_overflow_raises():
    model = _model()
    cache = model.new_cache(1, 4, static=True)
    with torch.no_grad(), pytest.raises(ValueError, match="overflow"):
        model(torch.randint(0, 97, (1, 5)), cache=cache)


# ----- torch.compile (aot_eager: inductor also works here but takes minutes on 2 CPU cores) -----

COMPILE_BACKEND = "aot_eager"


def test_compiled_training_step_matches_eager():
    model = _model(max_sequence_length=32).train()
    ids = torch.randint(0, 97, (2, 16))
    compiled = torch.compile(model, backend=COMPILE_BACKEND, dynamic=False)
    out = compiled(ids, ids)
    out.loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(ids, ids, return_logits=True)
    ref.loss.backward()
    # AOT autograd decomposes some ops (norms, softmax backward) into others: other roundings.
    assert_logits_close(out.logits, ref.logits, model, 16)
    assert_fp32_close(out.loss, ref.loss, forward_terms(model.config, 16, tokens=32), 2)
    for a, p in zip(grads, model.parameters()):  # back through the same sums: twice the bound
        assert_fp32_close(a, p.grad, forward_terms(model.config, 16, tokens=32), 4)


def test_compiled_static_decode_matches_eager_without_recompiling():
    import torch._dynamo

    model = _model()
    ids = torch.randint(0, 97, (2, 14))
    am = _left_pad(2, 6, pads=(0, 2))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=COMPILE_BACKEND, dynamic=False)
    with torch.no_grad():
        ref_cache, cache = model.new_cache(2, 16, static=True), model.new_cache(2, 16, static=True)
        ref = [model(ids[:, :6], attention_mask=am, cache=ref_cache).logits]
        out = [compiled(ids[:, :6], attention_mask=am, cache=cache).logits]
        out.append(compiled(ids[:, 6:7], cache=cache).logits)  # the one decode compile
        ref.append(model(ids[:, 6:7], cache=ref_cache).logits)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for t in range(7, 14):
                out.append(compiled(ids[:, t : t + 1], cache=cache).logits)
                ref.append(model(ids[:, t : t + 1], cache=ref_cache).logits)
    assert_logits_close(torch.cat(out, 1), torch.cat(ref, 1), model, 16)
    torch._dynamo.reset()
