"""Best-fit packing and token-budget batching as properties: every target token is covered once,
bins never overflow and no two bins could be merged (the any-fit guarantee), the packing equals a
plain reference best-fit decreasing, and token-budget micro-batches hold every item once within
their budget."""

from __future__ import annotations

import numpy as np
import pytest

from olmoflow.errors import OlmoflowError
from olmoflow.train.packing import (
    best_fit_decreasing,
    pad_batch,
    split_documents,
    token_budget_batches,
)


def documents(lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
    ends = np.cumsum(lengths)
    return ends - np.asarray(lengths), ends


@pytest.mark.parametrize("T", [1, 4, 16])
def test_pieces_make_every_token_but_the_first_a_target_once(T):
    rng = np.random.default_rng(T)
    lengths = ([1, 2, T, T + 1, T + 2, 2 * T + 1, 3 * T + 2]
               + rng.integers(1, 5 * T + 3, 60).tolist())
    starts, ends = documents(lengths)
    ps, pe, doc = split_documents(starts, ends, T)
    assert ((pe - ps) >= 2).all() and ((pe - ps) <= T + 1).all()
    assert (ps >= starts[doc]).all() and (pe <= ends[doc]).all()
    # In a piece of L tokens, positions 1..L-1 are targets.
    targets = np.concatenate([np.arange(s + 1, e) for s, e in zip(ps, pe)])
    expected = np.concatenate([np.arange(s + 1, e) for s, e in zip(starts, ends)])
    np.testing.assert_array_equal(np.sort(targets), expected)  # each exactly once
    assert np.all(np.diff(doc) >= 0)


def reference_bfd(lengths: np.ndarray, capacity: int) -> list[int]:
    """Textbook best-fit decreasing: scan every open bin for the fullest that fits."""
    fills: list[int] = []
    for size in sorted(lengths.tolist(), reverse=True):
        fitting = [b for b, f in enumerate(fills) if f + size <= capacity]
        if fitting:
            b = max(fitting, key=lambda b: fills[b])
            fills[b] += size
        else:
            fills.append(size)
    return sorted(fills)


@pytest.mark.parametrize("seed", range(4))
def test_best_fit_decreasing_packs_like_the_reference_and_is_any_fit(seed):
    rng = np.random.default_rng(seed)
    capacity = int(rng.integers(8, 70))
    lengths = rng.integers(1, capacity + 1, int(rng.integers(1, 300)))
    offsets, items = best_fit_decreasing(lengths, capacity, seed=seed)
    np.testing.assert_array_equal(np.sort(items), np.arange(len(lengths)))  # each item once
    fills = np.add.reduceat(lengths[items], offsets[:-1])
    assert (fills <= capacity).all()
    assert sorted(fills.tolist()) == reference_bfd(lengths, capacity)
    # Any-fit: a new bin opens only when no bin fits, so no two bins fit into one.
    if len(fills) > 1:
        two_emptiest = np.sort(fills)[:2]
        assert two_emptiest.sum() > capacity
    # Inside a bin items are placed longest first.
    for b in range(len(fills)):
        sizes = lengths[items[offsets[b] : offsets[b + 1]]]
        assert (np.diff(sizes) <= 0).all()


def test_packing_depends_on_the_seed_only():
    lengths = np.array([3, 5, 3, 5, 3, 7, 2, 3, 5, 1] * 20)
    a = best_fit_decreasing(lengths, 16, seed=1)
    b = best_fit_decreasing(lengths.copy(), 16, seed=1)
    c = best_fit_decreasing(lengths, 16, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[1], c[1]), "the seed orders equal-length items"
    with pytest.raises(OlmoflowError, match=r"item sizes must be in \[1, 16\]"):
        best_fit_decreasing(np.array([3, 17]), 16, seed=0)


@pytest.mark.parametrize("sort", [True, False])
@pytest.mark.parametrize("multiple", [1, 8])
def test_token_budget_batches_hold_every_item_once_within_budget(sort, multiple):
    rng = np.random.default_rng(multiple)
    lengths = rng.integers(1, 200, 500)
    budget = 1024
    batches = token_budget_batches(lengths, budget, sort=sort, pad_to_multiple_of=multiple)
    np.testing.assert_array_equal(np.sort(np.concatenate(batches)), np.arange(len(lengths)))
    for idx in batches:
        ids, mask = pad_batch([np.arange(n) for n in lengths[idx]], -1, pad_to_multiple_of=multiple)
        assert ids.numel() <= budget and ids.shape[1] % multiple == 0
        assert int(mask.sum()) == lengths[idx].sum()
        assert (ids[~mask] == -1).all()
    if not sort:
        np.testing.assert_array_equal(np.concatenate(batches), np.arange(len(lengths)))
    again = token_budget_batches(lengths, budget, sort=sort, pad_to_multiple_of=multiple)
    assert all(np.array_equal(x, y) for x, y in zip(batches, again))


def test_token_budget_sorting_fills_micro_batches():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, 2000)
    sorted_ = token_budget_batches(lengths, 2048)
    streamed = token_budget_batches(lengths, 2048, sort=False)
    assert len(sorted_) < len(streamed)
    real = lengths.sum() / sum(len(b) * lengths[b].max() for b in sorted_)
    assert real > 0.9, f"sorted micro-batches are {real:.1%} real tokens"


def test_token_budget_seeded_order_and_errors():
    lengths = np.arange(1, 101)
    plain = token_budget_batches(lengths, 300)
    shuffled = token_budget_batches(lengths, 300, seed=3)
    assert sorted(map(tuple, plain)) == sorted(map(tuple, shuffled))
    assert [tuple(b) for b in plain] != [tuple(b) for b in shuffled]
    assert [tuple(b) for b in shuffled] == [
        tuple(b) for b in token_budget_batches(lengths, 300, seed=3)
    ]
    with pytest.raises(OlmoflowError, match="item 99 has 100 tokens.*budget of 64"):
        token_budget_batches(lengths, 64)
    with pytest.raises(OlmoflowError, match="max_tokens"):
        token_budget_batches(lengths, 0)
    assert token_budget_batches([], 10) == []
