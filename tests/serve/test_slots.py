"""The slot KV cache: a ragged decode step over rows of different lengths (sliding window
included) gives each row the logits of a plain full forward over its own tokens, before and
after a row leaves and the last row moves into its place."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_fp32_close, forward_terms

from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo
from olmoflow.serve.slots import SlotKVCache


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Olmo(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                            mlp_hidden=64, max_sequence_length=64, sliding_window=4)).eval()


def full_last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


@torch.no_grad()
def test_ragged_decode_matches_full_forward(model):
    cfg = model.config
    cache = SlotKVCache.for_model(model, max_batch=4, max_context=32)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (3, 9, 6)]
    for ids in seqs:  # prefill each alone into its own row
        row = cache.add_row()
        model(torch.tensor([ids]), cache=cache.row_cache(row), last_logits_only=True)
        cache.set_length(row, len(ids))
    assert cache.lengths == [3, 9, 6]

    def step():
        nxt = torch.randint(0, 64, (len(seqs),), generator=g)
        for s, t in zip(seqs, nxt.tolist()):
            s.append(t)
        logits = model(nxt[:, None], cache=cache, last_logits_only=True).logits[:, -1]
        assert cache.lengths == [len(s) for s in seqs]
        for r, s in enumerate(seqs):
            assert_fp32_close(logits[r], full_last_logits(model, s),
                              forward_terms(cfg, len(s)), ulps=4)

    for _ in range(5):  # rows pass the window of 4 at different steps
        step()
    assert cache.remove_row(0) == 2  # the last row moved into row 0
    seqs = [seqs[2], seqs[1]]
    assert cache.lengths == [len(s) for s in seqs]
    for _ in range(3):
        step()
    assert cache.remove_row(1) is None and cache.n == 1


def test_prepare_rejects_bad_steps(model):
    cache = SlotKVCache.for_model(model, max_batch=2, max_context=4)
    with pytest.raises(ValueError, match="no running rows"):
        cache.prepare(1, {None}, torch.device("cpu"))
    row = cache.add_row()
    with pytest.raises(ValueError, match="T=2"):
        cache.prepare(2, {None}, torch.device("cpu"))
    cache.set_length(row, 4)
    with pytest.raises(ValueError, match="overflow"):
        cache.prepare(1, {None}, torch.device("cpu"))
    cache.add_row()
    with pytest.raises(RuntimeError, match="no free slot"):
        cache.add_row()
    with pytest.raises(IndexError):
        cache.remove_row(5)
