"""Prefill + step-by-step decoding with the KV cache equals a full forward; generation contracts."""

import pytest
import torch
from tolerance import assert_fp32_close, assert_greedy_agrees, forward_terms, fp32_rel

from olmoflow.infer.generate import generate, top_k_top_p_filter
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, mlp_hidden=96,
                      max_sequence_length=128, sliding_window=8)
    return Olmo(cfg).eval()


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_decode_equals_full_forward(model, backend):
    ids = torch.randint(0, 97, (2, 40))  # well past the sliding window of 8
    try:
        for b in model.blocks:
            b.attention.backend = backend
        with torch.no_grad():
            full = model(ids).logits
            cache = model.new_cache(2, 40)
            parts = [model(ids[:, :11], cache=cache).logits]
            for t in range(11, 40):
                parts.append(model(ids[:, t : t + 1], cache=cache).logits)
    finally:
        for b in model.blocks:
            b.attention.backend = "sdpa"
    # Other shapes, so other sums: two ulps per accumulated term of the logits (tolerance.py).
    assert_fp32_close(torch.cat(parts, 1), full, forward_terms(model.config, 40), 2)


def test_left_padded_batch_matches_single_prompts(model):
    prompts = [torch.randint(0, 97, (n,)) for n in (5, 12, 9)]
    singles = [generate(model, p[None], max_new_tokens=15)[0, len(p):] for p in prompts]
    T = max(len(p) for p in prompts)
    ids = torch.zeros(3, T, dtype=torch.long)
    mask = torch.zeros(3, T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = p
        mask[i, T - len(p):] = 1
    batched = generate(model, ids, attention_mask=mask, max_new_tokens=15)[:, T:]
    for i, p in enumerate(prompts):
        # Padded and alone are other shapes, so other sums: the same tokens wherever the logits'
        # bound (tolerance.py) cannot flip the argmax.
        alone = torch.cat([p, singles[i]])[None]
        with torch.no_grad():
            logits = model(alone).logits
        atol = fp32_rel(forward_terms(model.config, alone.shape[1]), 2) * float(logits.abs().max())
        assert assert_greedy_agrees(torch.cat([p, batched[i]])[None], alone, logits, atol,
                                    len(p)) > 0


def test_max_length_counts_prompt(model):
    ids = torch.randint(0, 97, (1, 10))
    assert generate(model, ids, max_length=25).shape == (1, 25)
    assert generate(model, ids, max_new_tokens=25).shape == (1, 35)
    with pytest.raises(ValueError, match="shorter than the prompt"):
        generate(model, ids, max_length=5)
    assert model.generate(ids, max_length=10).shape == (1, 10)


def test_seeded_sampling_is_reproducible(model):
    ids = torch.randint(0, 97, (2, 6))
    kw = dict(max_new_tokens=12, do_sample=True, temperature=1.0, top_k=20, top_p=0.9)
    a = generate(model, ids, seed=3, **kw)
    b = generate(model, ids, seed=3, **kw)
    assert torch.equal(a, b)


def test_eos_stops_row_and_pads(model):
    ids = torch.randint(0, 97, (1, 6))
    greedy = generate(model, ids, max_new_tokens=10)[0, 6:]
    eos = int(greedy[2])
    out = generate(model, ids, max_new_tokens=10, eos_token_id=eos, pad_token_id=0)[0, 6:]
    first = (out == eos).nonzero()[0, 0]
    assert len(out) == first + 1  # a single row stops right after its EOS


def test_top_p_keeps_crossing_token():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = top_k_top_p_filter(logits, None, 0.6).isfinite()[0].tolist()
    assert kept == [True, True, False, False]  # 0.5 < 0.6, so the token that crosses (0.3) stays
    kept = top_k_top_p_filter(logits, 1, None).isfinite()[0].tolist()
    assert kept == [True, False, False, False]


def test_all_masked_rows_are_finite(model):
    ids = torch.randint(0, 97, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :5] = 0
    with torch.no_grad():
        out = model(ids, attention_mask=mask).logits
    assert torch.isfinite(out).all()


def test_lm_loss_matches_reference_formula():
    from olmoflow.model.olmo import IGNORE_INDEX, lm_loss

    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, requires_grad=True)
    labels = torch.randint(0, 11, (3, 5))
    labels[0, :2] = IGNORE_INDEX
    loss, ce, z = lm_loss(logits, labels, 1e-2)
    valid = labels != IGNORE_INDEX
    lse = torch.logsumexp(logits, -1)[valid]
    ref_ce = torch.nn.functional.cross_entropy(logits[valid], labels[valid])
    ref_z = 1e-2 * (lse**2).mean()
    # Another kernel for the same sums: the logsumexp over 11 logits and the mean over the 13
    # targets, two ulps per term (exp and log rounded their own way); the gradient goes back
    # through them (tolerance.py).
    terms = 11 + int(valid.sum())
    assert_fp32_close(ce, ref_ce, terms, 2)
    assert_fp32_close(z, ref_z, terms, 2)
    g1 = torch.autograd.grad(loss, logits)[0]
    g2 = torch.autograd.grad(ref_ce + ref_z, logits)[0]
    assert_fp32_close(g1, g2, terms, 4)


def test_padded_vocab_rows_are_never_generated(model):
    ids = torch.randint(0, 97, (2, 5))
    with torch.no_grad():  # make the padding rows the most likely tokens
        model.lm_head.weight[90:] += 5.0
    try:
        free = generate(model, ids, max_new_tokens=20)
        assert (free[:, 5:] >= 90).any()
        limited = generate(model, ids, max_new_tokens=20, vocab_size=90, do_sample=True, seed=0)
        assert (limited[:, 5:] < 90).all()
    finally:
        with torch.no_grad():
            model.lm_head.weight[90:] -= 5.0
