"""Shared pieces for the inference tests: a byte-level BPE trained in the test, and a model stub
that emits a scripted token sequence (so streaming and stop strings are tested on known text)."""

from types import SimpleNamespace

import pytest
import torch

TEXTS = [
    "Hello world! The cat sat on the mat. " * 3,
    "emoji 😀🎉🚀 and more 🌍🐍 text",
    "中文字符测试，你好世界。日本語のテキスト",
    "mixed: naïve café — ü ö ä ß 😀 中文",
]


@pytest.fixture(scope="module")
def model():
    """A random 2-layer Olmo with sliding-window layers (window 8), in eval mode."""
    from olmoflow.model.config import ModelConfig
    from olmoflow.model.olmo import Olmo

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=2, mlp_hidden=64,
                      max_sequence_length=128, sliding_window=8)
    return Olmo(cfg).eval()


@pytest.fixture(scope="session")
def bpe():
    from olmoflow.tokenizer import BPETokenizer

    return BPETokenizer().train_from_texts(TEXTS * 4, vocab_size=300)


class Scripted(torch.nn.Module):
    """Greedy decoding of this 'model' reproduces ``script[b]`` for row b (then repeats its last
    token). Implements the slice of the Olmo API that generation uses."""

    def __init__(self, script: list[list[int]], vocab_size: int):
        super().__init__()
        self.script, self.vocab_size = script, vocab_size
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    @property
    def device(self):
        return self.dummy.device

    def new_cache(self, batch, max_length):
        return SimpleNamespace(step=0)

    def forward(self, input_ids, attention_mask=None, cache=None, last_logits_only=False):
        B = input_ids.shape[0]
        logits = torch.zeros(B, 1, self.vocab_size)
        for b in range(B):
            row = self.script[b]
            logits[b, 0, row[min(cache.step, len(row) - 1)]] = 1.0
        cache.step += 1
        return SimpleNamespace(logits=logits)


@pytest.fixture
def scripted():
    return Scripted
