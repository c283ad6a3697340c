"""The cross-path bounds of tolerance.py: they scale with magnitude and terms, and the greedy
comparison stops exactly at the first near-tie."""

import pytest
import torch
from tolerance import EPS32, assert_fp32_close, assert_greedy_agrees, forward_terms, fp32_rel

from olmoflow.model.config import ModelConfig


def test_bound_scales_with_terms_and_magnitude():
    assert fp32_rel(100) == pytest.approx(100 * 2**-23) and fp32_rel(100, 2) == 2 * fp32_rel(100)
    big = torch.full((3,), 1000.0)
    assert_fp32_close(big + 1000 * 50 * EPS32, big, terms=100)  # half the bound at scale 1000
    with pytest.raises(AssertionError):
        assert_fp32_close(big + 1000 * 200 * EPS32, big, terms=100)
    # An element near zero is judged by the tensor's scale, not its own.
    assert_fp32_close(torch.tensor([1.0, 1e-3]), torch.tensor([1.0, 1e-3 + 50 * EPS32]), 100)


def test_forward_terms_counts_every_reduction():
    cfg = ModelConfig(vocab_size=10, d_model=8, n_layers=2, n_heads=2, mlp_hidden=16,
                      max_sequence_length=16, sliding_window=None)
    block = 6 * 8 + 4 + 2 * 5 + 16
    assert forward_terms(cfg, 5) == 2 * block + 2 * 8
    assert forward_terms(cfg, 5, tokens=7) == 2 * block + 2 * 8 + 10 + 7


def logits_for(margins):
    """[1, T, 3] logits whose top two differ by ``margins[t]`` at position t."""
    out = torch.zeros(1, len(margins), 3)
    out[0, :, 0] = torch.tensor(margins)
    return out


def test_greedy_compares_up_to_the_first_near_tie():
    expected = torch.tensor([[5, 1, 1, 1, 1]])
    logits = logits_for([1.0, 1.0, 1e-9, 1.0, 1.0])  # position 2 decides token 3: a near-tie
    parted = torch.tensor([[5, 1, 1, 2, 2]])  # the paths part at the near-tie: allowed
    assert assert_greedy_agrees(parted, expected, logits, 1e-6, start=1) == 2
    with pytest.raises(AssertionError):  # a token that differs where greedy is decided
        assert_greedy_agrees(torch.tensor([[5, 2, 1, 1, 1]]), expected, logits, 1e-6, 1)
    with pytest.raises(AssertionError, match="near-tie"):  # nothing decided: nothing checked
        assert_greedy_agrees(parted, expected, logits_for([0.0] * 5), 1e-6, 1)
