"""Held-out loss, perplexity and bits-per-byte on models whose answers we know in closed form."""

import math

import numpy as np
import pytest
import torch

from olmoflow.eval.perplexity import evaluate_tokens

V = 16


def test_uniform_model_scores_log_vocab():
    tokens = np.random.default_rng(0).integers(1, V, size=1 + 4 * 32)
    token_bytes = np.full(V, 3)
    token_bytes[0] = 0  # a special token (EOS) carries no bytes
    tokens[::7] = 0
    r = evaluate_tokens(lambda x: torch.zeros(*x.shape, V), tokens, token_bytes,
                        sequence_length=32, batch_size=3)
    assert r["tokens"] == 128
    assert r["loss"] == pytest.approx(math.log(V))
    assert r["perplexity"] == pytest.approx(V)
    targets = tokens[1:129]
    n_byte_tokens = int((targets != 0).sum())
    assert r["bytes"] == 3 * n_byte_tokens
    # every byte-bearing target costs log2(V) bits and stands for 3 bytes
    assert r["bpb"] == pytest.approx(math.log2(V) / 3)


def test_perfect_model_scores_zero_and_max_tokens_caps():
    tokens = np.arange(1 + 64) % V

    def oracle(x):  # puts all mass on the true next token (x + 1 mod V)
        return torch.nn.functional.one_hot((x + 1) % V, V).float() * 100

    r = evaluate_tokens(oracle, tokens, np.ones(V, dtype=int), sequence_length=16, max_tokens=32)
    assert r["tokens"] == 32
    assert r["loss"] < 1e-6 and r["bpb"] < 1e-6


def test_too_little_data_is_an_error():
    with pytest.raises(ValueError, match="fewer than one window"):
        evaluate_tokens(lambda x: torch.zeros(*x.shape, V), np.zeros(5, dtype=int), np.ones(V),
                        sequence_length=16)
