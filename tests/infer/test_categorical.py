"""The sampler's categorical draw (inverse CDF): the distribution it is asked for, never a token of
probability 0, and the same draws for the same generator seed."""

from __future__ import annotations

import torch

from olmoflow.infer.generate import sample_categorical


def test_draws_follow_the_distribution_and_skip_zero_probabilities():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3, 0.0],
                          [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    n = 20000
    draws = torch.stack([sample_categorical(probs, g) for _ in range(n)])  # [n, 3]
    freq = torch.stack([torch.bincount(draws[:, r], minlength=6).double() / n for r in range(3)])
    # 4 standard errors of a binomial share at n = 20000 is under 0.015
    assert (freq - probs.double()).abs().max() < 0.015
    assert (freq[probs == 0] == 0).all()
    assert (draws[:, 1] == 0).all() and (draws[:, 2] == 5).all()


def test_a_large_vocabulary_matches_its_probabilities():
    g = torch.Generator().manual_seed(1)
    probs = torch.randn(1, 50, generator=g).mul(2).softmax(-1)
    draws = sample_categorical(probs.expand(200000, 50).contiguous(), g)
    freq = torch.bincount(draws, minlength=50).double() / len(draws)
    se = (probs[0].double() * (1 - probs[0].double()) / len(draws)).sqrt()
    assert ((freq - probs[0].double()).abs() <= 5 * se + 1e-6).all()


def test_the_same_seed_gives_the_same_draws():
    probs = torch.randn(8, 300).softmax(-1)
    a = sample_categorical(probs, torch.Generator().manual_seed(7))
    b = sample_categorical(probs, torch.Generator().manual_seed(7))
    c = sample_categorical(probs, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
