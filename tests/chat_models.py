"""A tiny byte-level BPE and a tiny random Olmo over it, for tests that need a real tokenizer and
model but no training (post-training data and configs, a DPO reference, chat)."""

from __future__ import annotations

import torch

from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo
from olmoflow.tokenizer import BPETokenizer

TEXTS = ["Hello world! The cat sat on the mat. What is 2+2? It is 4.",
         "def add(a, b):\n    return a + b\n# user, assistant, system: be brief",
         "emoji and cafe, more words about cats and mats; numbers 1 2 3 4 5 6 7 8 9"]


def chat_tokenizer(vocab: int = 300) -> BPETokenizer:
    """A BPE of ``vocab`` tokens trained on :data:`TEXTS` (deterministic)."""
    return BPETokenizer().train_from_texts(TEXTS * 8, vocab_size=vocab)


def chat_model(tok: BPETokenizer, window: int = 128) -> Olmo:
    """A seeded random 2-layer Olmo (d_model 32) over ``tok``'s vocabulary, in eval mode."""
    torch.manual_seed(0)
    return Olmo(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=2,
                            mlp_hidden=64, max_sequence_length=window)).eval()
