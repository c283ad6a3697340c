"""Speculative decoding (prompt lookup and a draft model): greedy output equals plain greedy
decoding, and sampled output follows the plain sampling distribution (a chi-square test against
the exact distribution of the first tokens)."""

import math

import pytest
import torch
from tolerance import assert_greedy_agrees, forward_terms, fp32_rel

from olmoflow.errors import OlmoflowError
from olmoflow.infer.generate import apply_repetition_penalty, generate
from olmoflow.infer.speculative import prompt_lookup_draft, speculative_generate
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models: thread start-up would dominate, and the statistical tests run many calls.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(seed: int, vocab: int = 61, head_scale: float = 1.0, window: int | None = 8) -> Olmo:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=2, mlp_hidden=64,
                      max_sequence_length=256, sliding_window=window)
    m = Olmo(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(head_scale)
    return m


def prompts(n: int, seed: int = 1) -> list[torch.Tensor]:
    """Half repetitive (code-like: a motif repeated, drafts get accepted), half random."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        if i % 2:
            out.append(torch.randint(0, 61, (1, 5), generator=g).repeat(1, 3))
        else:
            out.append(torch.randint(0, 61, (1, 4 + i % 9), generator=g))
    return out


def assert_same_greedy(model, plain, spec, T, penalty=1.0, mask=None):
    """Token for token, up to a step where the two paths' rounding could flip the argmax."""
    assert spec.shape == plain.shape
    with torch.no_grad():
        full_mask = None
        if mask is not None:
            full_mask = torch.cat([mask, torch.ones(mask.shape[0], plain.shape[1] - T,
                                                    dtype=mask.dtype)], 1)
        logits = model(plain, attention_mask=full_mask).logits
    if penalty != 1.0:
        for t in range(plain.shape[1]):
            seen = torch.zeros_like(logits[:, t], dtype=torch.bool).scatter_(
                1, plain[:, : t + 1], True)
            logits[:, t] = apply_repetition_penalty(logits[:, t], seen, penalty)
    atol = fp32_rel(forward_terms(model.config, plain.shape[1]), 2) * float(logits.abs().max())
    return assert_greedy_agrees(spec, plain, logits, atol, T)


def test_prompt_lookup_draft_rule():
    seq = torch.tensor([5, 1, 2, 7, 8, 1, 2, 9, 1, 2])
    # the last bigram (1, 2) occurs first at 1: its continuation follows
    assert prompt_lookup_draft(seq, 3, 2).tolist() == [7, 8, 1]
    assert prompt_lookup_draft(seq, 10, 2).tolist() == [7, 8, 1, 2, 9, 1, 2]
    # no bigram match: the unigram 4 matches
    assert prompt_lookup_draft(torch.tensor([4, 6, 3, 4]), 2, 2).tolist() == [6, 3]
    # a longer n-gram is preferred over the earliest shorter one
    seq = torch.tensor([3, 9, 2, 3, 4, 0, 2, 3])
    assert prompt_lookup_draft(seq, 1, 2).tolist() == [4]
    assert prompt_lookup_draft(seq, 1, 1).tolist() == [9]
    # nothing matches (and the n-gram never matches itself)
    assert prompt_lookup_draft(torch.tensor([1, 2, 3, 4]), 5, 3).numel() == 0
    assert prompt_lookup_draft(torch.tensor([7]), 5, 3).numel() == 0


@pytest.mark.parametrize("k", [1, 3, 8])
def test_prompt_lookup_greedy_equals_plain_greedy(k):
    model = tiny(0)
    accepted = compared = 0
    for ids in prompts(24):
        plain = generate(model, ids, max_new_tokens=40)
        spec, stats = model.generate(ids, max_new_tokens=40, prompt_lookup_num_tokens=k,
                                     return_stats=True)
        compared += assert_same_greedy(model, plain, spec, ids.shape[1])
        accepted += stats.accepted
        assert stats.emitted == stats.forwards + stats.accepted
    assert compared >= 24 * 30  # near-ties are rare: almost every token was compared
    assert accepted > 50  # the repetitive prompts exercise acceptance, not just rejection


def test_nothing_drafted_is_plain_decoding():
    """One new token, or drafts that never match: the same tokens, one forward per token."""
    model = tiny(0)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    out, stats = speculative_generate(model, ids, max_new_tokens=1, prompt_lookup_num_tokens=4,
                                      return_stats=True)
    assert torch.equal(out, generate(model, ids, max_new_tokens=1))
    assert stats.drafted == stats.forwards == 0


def test_eos_and_max_new_tokens_boundaries():
    model = tiny(0)
    ids = prompts(2)[1]  # repetitive: blocks of several tokens are accepted
    plain = generate(model, ids, max_new_tokens=30)
    T = ids.shape[1]
    for n in (1, 2, 3, 4, 7, 13):  # the budget cuts a draft block short
        spec = speculative_generate(model, ids, max_new_tokens=n, prompt_lookup_num_tokens=6)
        assert_same_greedy(model, plain[:, : T + n], spec, T)
    for j in (0, 3, 9, 17):  # EOS = the token plain greedy emits at new position j
        eos = int(plain[0, T + j])
        first = int((plain[0, T:] == eos).nonzero()[0, 0])
        ref, ref_len = generate(model, ids, max_new_tokens=30, eos_token_id=eos,
                                return_lengths=True)
        spec, lengths = speculative_generate(model, ids, max_new_tokens=30, eos_token_id=eos,
                                             prompt_lookup_num_tokens=6, return_lengths=True)
        assert torch.equal(spec, ref) and spec.shape[1] == T + first + 1
        assert lengths.tolist() == ref_len.tolist() == [first + 1]


def test_batch_with_left_padding_equals_plain_batch():
    model = tiny(0)
    ps = prompts(6)
    T = max(p.shape[1] for p in ps)
    ids = torch.zeros(len(ps), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(ps):
        ids[b, T - p.shape[1]:], mask[b, T - p.shape[1]:] = p[0], 1
    plain = generate(model, ids, attention_mask=mask, max_new_tokens=30)
    spec, stats = speculative_generate(model, ids, attention_mask=mask, max_new_tokens=30,
                                       prompt_lookup_num_tokens=5, return_stats=True)
    assert_same_greedy(model, plain, spec, T, mask=mask)
    # a batch with EOS: finished rows are filled as plain decoding fills them
    eos = int(plain[0, T + 4])
    ref = generate(model, ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos,
                   pad_token_id=0)
    got = speculative_generate(model, ids, attention_mask=mask, max_new_tokens=30,
                               eos_token_id=eos, pad_token_id=0, prompt_lookup_num_tokens=5)
    assert torch.equal(got, ref)


def test_repetition_penalty_and_full_attention_layers():
    model = tiny(3, window=None)
    for ids in prompts(6, seed=4):
        plain = generate(model, ids, max_new_tokens=25, repetition_penalty=1.3)
        spec = speculative_generate(model, ids, max_new_tokens=25, repetition_penalty=1.3,
                                    prompt_lookup_num_tokens=4)
        assert_same_greedy(model, plain, spec, ids.shape[1], penalty=1.3)


def test_draft_model_greedy_equals_plain_greedy():
    model, draft = tiny(0), tiny(5)
    for ids in prompts(8):
        plain = generate(model, ids, max_new_tokens=30)
        spec = model.generate(ids, max_new_tokens=30, draft_model=draft, num_draft_tokens=4)
        assert_same_greedy(model, plain, spec, ids.shape[1])
    # the model as its own draft: (almost) every draft is accepted
    ids = prompts(1)[0]
    spec, stats = model.generate(ids, max_new_tokens=30, draft_model=model, num_draft_tokens=4,
                                 return_stats=True)
    assert_same_greedy(model, generate(model, ids, max_new_tokens=30), spec, ids.shape[1])
    assert stats.acceptance_rate > 0.9 and stats.tokens_per_forward > 4


def test_refusals():
    model = tiny(0)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(OlmoflowError, match=r"draft model vocabulary \(64\) differs"):
        model.generate(ids, draft_model=tiny(0, vocab=64))
    with pytest.raises(ValueError, match="exactly one"):
        model.generate(ids, draft_model=model, prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="exactly one"):
        model.generate(ids, return_stats=True)
    # the keywords at their "off" values are plain decoding
    assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=None, draft_model=None,
                                      return_stats=False), generate(model, ids))
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens must be an integer >= 1"):
        model.generate(ids, prompt_lookup_num_tokens=0)
    with pytest.raises(ValueError, match="compile"):
        model.generate(ids, prompt_lookup_num_tokens=3, compile=True)
    with pytest.raises(ValueError, match="num_draft_tokens= is for draft_model"):
        model.generate(ids, prompt_lookup_num_tokens=3, num_draft_tokens=2)


# ---- sampling: the distribution of the first tokens -------------------------------------------

V, NEW = 8, 3
PROMPT = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])  # prompt lookup drafts 3, 1, 2


def exact_joint(model, prompt, temperature=1.0) -> dict[tuple[int, ...], float]:
    """P(first NEW tokens = s) for every s in V**NEW, from full forwards (plain sampling's law)."""
    probs = {(): 1.0}
    with torch.no_grad():
        for _ in range(NEW):
            seqs = list(probs)
            batch = torch.tensor([prompt[0].tolist() + list(s) for s in seqs])
            p = (model(batch).logits[:, -1].double() / temperature).softmax(-1)
            probs = {s + (v,): probs[s] * float(p[i, v]) for i, s in enumerate(seqs)
                     for v in range(V)}
    return probs


def chi_square(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic over cells of expected count >= 5 (the rest pooled in one cell) and
    its degrees of freedom."""
    stat, df, rest_obs, rest_exp = 0.0, -1, 0, 0.0
    for s, p in probs.items():
        e, o = n * p, counts.get(s, 0)
        if e >= 5:
            stat += (o - e) ** 2 / e
            df += 1
        else:
            rest_obs, rest_exp = rest_obs + o, rest_exp + e
    if rest_exp > 0:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        df += 1
    return stat, df


def chi_square_threshold(df: int, false_alarm: float = 1e-6) -> float:
    """A value a chi-square variable with ``df`` degrees of freedom exceeds with probability at
    most ``false_alarm``: Laurent & Massart 2000, Lemma 1, P(X >= df + 2 sqrt(df x) + 2x) <=
    exp(-x). So a correct sampler fails this test about once in a million runs."""
    x = math.log(1 / false_alarm)
    return df + 2 * math.sqrt(df * x) + 2 * x


def sampled_counts(model, n, **kw) -> tuple[dict, object]:
    counts: dict = {}
    total = None
    for seed in range(n):
        out, stats = speculative_generate(model, PROMPT, max_new_tokens=NEW, do_sample=True,
                                          seed=seed, return_stats=True, **kw)
        s = tuple(out[0, PROMPT.shape[1]:].tolist())
        counts[s] = counts.get(s, 0) + 1
        if total is None:
            total = stats
        else:
            for f in ("drafted", "accepted", "forwards", "emitted"):
                setattr(total, f, getattr(total, f) + getattr(stats, f))
    return counts, total


def sampling_model():
    return tiny(0, vocab=V, head_scale=6.0, window=4)  # peaked: drafts are often accepted


def drafter_kwargs(drafter: str) -> dict:
    if drafter == "prompt_lookup":
        return {"prompt_lookup_num_tokens": 3}
    return {"draft_model": tiny(7, vocab=V, head_scale=6.0, window=4), "num_draft_tokens": 2}


@pytest.mark.parametrize("drafter", ["prompt_lookup", "draft_model"])
def test_sampling_follows_the_plain_distribution(drafter):
    """Chi-square of 1200 seeded runs against the exact joint law of the first 3 tokens."""
    model, n = sampling_model(), 1200
    counts, stats = sampled_counts(model, n, **drafter_kwargs(drafter))
    # both branches of the rule are taken many times (accepted and rejected drafts)
    assert stats.accepted > 50 and stats.drafted - stats.accepted > 50, stats
    stat, df = chi_square(counts, exact_joint(model, PROMPT), n)
    assert stat < chi_square_threshold(df), (stat, df)


@pytest.mark.parametrize("drafter", ["prompt_lookup", "draft_model"])
def test_the_distribution_test_catches_a_wrong_rule(drafter, monkeypatch):
    """The same test fails when every draft is accepted (no rejection rule), so passing it
    means something."""
    from olmoflow.infer import speculative

    monkeypatch.setattr(speculative, "_leading_true",
                        lambda ok: torch.full((ok.shape[0],), ok.shape[1], dtype=torch.long))
    model, n = sampling_model(), 1200
    counts, _ = sampled_counts(model, n, **drafter_kwargs(drafter))
    stat, df = chi_square(counts, exact_joint(model, PROMPT), n)
    assert stat > chi_square_threshold(df), (stat, df)


def test_batched_sampling_follows_the_plain_distribution():
    """One batch of 2000 identical prompts: rows truncated to the batch's fewest acceptances still
    follow the law (their draws are independent of one another)."""
    model, n = sampling_model(), 2000
    out, stats = speculative_generate(model, PROMPT.repeat(n, 1), max_new_tokens=NEW,
                                      do_sample=True, seed=0, prompt_lookup_num_tokens=3,
                                      return_stats=True)
    counts: dict = {}
    for row in out[:, PROMPT.shape[1]:].tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert stats.drafted > 0
    stat, df = chi_square(counts, exact_joint(model, PROMPT), n)
    assert stat < chi_square_threshold(df), (stat, df)


def test_sampled_output_is_reproducible_with_a_seed():
    model = tiny(0)
    ids = prompts(2)[1]
    a = speculative_generate(model, ids, max_new_tokens=20, do_sample=True, temperature=0.7,
                             top_k=10, top_p=0.9, seed=3, prompt_lookup_num_tokens=4)
    b = speculative_generate(model, ids, max_new_tokens=20, do_sample=True, temperature=0.7,
                             top_k=10, top_p=0.9, seed=3, prompt_lookup_num_tokens=4)
    assert torch.equal(a, b)
