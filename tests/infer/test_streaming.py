"""Streaming never splits a UTF-8 character: pieces concatenate to the full decode."""

import pytest
import torch

from olmoflow.infer.generate import generate
from olmoflow.infer.streaming import IncrementalDecoder, TextStreamer, stream_generate
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo

FFFD = "\ufffd"
TEXT = "Hi 😀🎉 中文字符 café 🚀 end"


def test_tokens_split_characters(bpe):
    """The premise: with a 300-token vocabulary, some tokens hold part of a character."""
    ids = bpe.encode(TEXT)
    assert bpe.decode(ids) == TEXT
    assert any(FFFD in bpe.decode([i]) for i in ids)


def test_incremental_decoder_one_token_at_a_time(bpe):
    ids = bpe.encode(TEXT)
    dec = IncrementalDecoder(bpe, bpe.encode("prompt: "))
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == TEXT
    assert not any(FFFD in p for p in pieces)
    assert sum(1 for p in pieces if p) > 5  # it streams, not one piece at the end


def test_stream_generate_scripted(bpe, scripted):
    ids = bpe.encode(TEXT)
    model = scripted([ids], bpe.vocab_size)
    pieces = list(stream_generate(model, bpe, "go", max_new_tokens=len(ids), eos_token_id=None))
    assert "".join(pieces) == TEXT
    assert all(p and FFFD not in p for p in pieces)
    # the callback streamer sees the same pieces
    got = []
    generate(model, torch.tensor([[5]]), max_new_tokens=len(ids),
             streamer=TextStreamer(bpe, got.append))
    assert got == pieces


def test_stream_generate_random_model(bpe):
    """A random model emits arbitrary bytes; the stream still equals the full decode and holds
    U+FFFD only where the full decode does."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=bpe.vocab_size, d_model=32, n_layers=2, n_heads=2, mlp_hidden=64,
                      max_sequence_length=128)
    model = Olmo(cfg).eval()
    kw = dict(max_new_tokens=40, do_sample=True, seed=1, eos_token_id=None)
    pieces = list(stream_generate(model, bpe, "emoji 😀", **kw))
    full_ids = generate(model, torch.tensor([bpe.encode("emoji 😀")]), **kw)[0]
    full = bpe.decode(full_ids[len(bpe.encode("emoji 😀")):])
    assert "".join(pieces) == full
    if FFFD not in full:
        assert not any(FFFD in p for p in pieces)


def test_stream_generate_rejects_batch(bpe, scripted):
    with pytest.raises(ValueError, match="one prompt"):
        stream_generate(scripted([[1], [1]], bpe.vocab_size), bpe,
                        torch.ones(2, 3, dtype=torch.long))
