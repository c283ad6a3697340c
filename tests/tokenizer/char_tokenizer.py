"""A user-written tokenizer for tests: one id per Unicode code point seen in training."""

import json
from pathlib import Path

import numpy as np

from olmoflow.data.documents import read_documents
from olmoflow.tokenizer import BaseTokenizer


class CharTokenizer(BaseTokenizer):
    def __init__(self, eos_token="<|endoftext|>", pad_token="<|pad|>", chars=""):
        super().__init__(eos_token, pad_token)
        self.vocab = [eos_token, pad_token, *chars]
        self.index = {c: i for i, c in enumerate(self.vocab)}

    def _train(self, files):
        chars = sorted({c for f in files for d in read_documents(f) for c in d["text"]})
        self.__init__(self.eos_token, self.pad_token, "".join(chars))

    def _tokenize(self, text):
        return [self.index[c] for c in text]

    def _decode(self, ids, skip_special_tokens=True):
        return "".join(self.vocab[i] for i in ids if not (skip_special_tokens and i < 2))

    def _vocab_size(self):
        return len(self.vocab)

    def _token_to_id(self, token):
        return self.index.get(token)

    def _token_byte_lengths(self):
        return np.array([0, 0] + [len(c.encode()) for c in self.vocab[2:]], dtype=np.int32)

    def save(self, directory):
        path = Path(directory) / "chars.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.vocab))
        return [path]

    @classmethod
    def load(cls, directory):
        vocab = json.loads((Path(directory) / "chars.json").read_text())
        return cls(vocab[0], vocab[1], "".join(vocab[2:]))
