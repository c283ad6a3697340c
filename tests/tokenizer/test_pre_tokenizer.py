"""The BPE's pre-tokenizer split: cl100k (OLMo 2/3's dolma2) by default, GPT-2's on request, old
tokenizer.json files encoding exactly as before, and lossless round trips under both."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from olmoflow.cli import main
from olmoflow.errors import OlmoflowError
from olmoflow.pipeline.config import load_config
from olmoflow.pipeline.runner import fingerprint
from olmoflow.tokenizer import BPETokenizer
from olmoflow.tokenizer.bpe import CL100K_PATTERN, build_pre_tokenizer, pre_tokenizer_name
from olmoflow.tokenizer.config import TokenizerConfig
from olmoflow.tokenizer.train import train_tokenizer

PROSE = ["One two.\n\nThree four.\n\nFive six."] * 200

CODE = '''import os


class Counter:
    """Counts things."""

    def __init__(self, start=0):
        self.n = start  # 1234567 starts here

    def add(self, k):
        if k > 100:
            return self.n + 2024
        return self.n
'''

# Varied text for parity and split checks: indentation, digits, newline runs, CRLF, tabs, unicode.
VARIED = [
    CODE,
    "def f(x):\n    if x:\n        return 1234567\n\n\n\nclass A:\n\tpass\r\n\r\n",
    "Paragraph one ends.\n\nParagraph two\n\n\n   indented after blank lines  \n",
    "numbers: 1 12 123 1234 12345 3.14159 1,000,000 0x1F 2026-12-01 ١٢٣٤ ²³",
    "contractions: I'm, you're, it's, they'll, we've, I'd, DON'T, She'S",
    "unicode: café naïve 東京 日本語 한국어 Ελληνικά русский עברית العربية",
    "emoji 😀🎉 👨\u200d👩\u200d👧 🇫🇷 👍🏽 and nbsp\u00a0and\u2003em space\u2028line sep",
    "   leading spaces, trailing spaces   ",
    "punctuation!!! ... ?! --- (x) [y] {z} <a href='b'>c</a>\n",
    "\n\n\n",
    "\r\n\t \r\n",
    "",
]


def pieces(tok: BPETokenizer, text: str) -> list[str]:
    return [tok.decode([i]) for i in tok.encode(text)]


def old_way_tokenizer(texts: list[str], vocab_size: int) -> HFTokenizer:
    """A tokenizer built the way olmoflow built every tokenizer before the cl100k split (GPT-2's
    ByteLevel regex), with the ``tokenizers`` library directly, not through olmoflow."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def code_tok() -> BPETokenizer:
    texts = [CODE] * 50 + [t for t in VARIED if t] * 5
    return BPETokenizer().train_from_texts(texts, vocab_size=600)


def test_newline_run_after_punctuation_stays_one_piece():
    tok = BPETokenizer().train_from_texts(PROSE, vocab_size=300)
    assert tok.pre_tokenizer == "cl100k"
    assert pieces(tok, ".\n\nT") == [".\n\n", "T"]
    # The old split, still available by name, cut the newline run in two.
    old = BPETokenizer(pre_tokenizer="gpt2").train_from_texts(PROSE, vocab_size=300)
    assert pieces(old, ".\n\nT") == [".", "\n", "\n", "T"]


def test_learns_paragraph_breaks_indentation_and_digit_groups(code_tok):
    vocab = code_tok.backend.get_vocab()
    assert "ĊĊ" in vocab  # "\n\n" (byte symbols: Ċ is "\n", Ġ is " ")
    assert "ĠĠĠĠĠĠĠ" in vocab  # the 7 spaces before " return" at depth 2
    assert pieces(code_tok, "\n\n\nclass")[0] == "\n\n\n"
    # Digits come in groups of at most three, so no token spans more than three digits.
    assert all(sum(c.isdigit() for c in t) <= 3 for t in vocab)
    assert "".join(pieces(code_tok, "1234567")) == "1234567"
    assert all(len(p) <= 3 for p in pieces(code_tok, "1234567"))


def test_split_is_the_cl100k_regex(code_tok):
    regex = pytest.importorskip("regex")  # the PCRE-like module; Oniguruma must agree with it
    pre = build_pre_tokenizer("cl100k")
    for text in VARIED:
        got = [text[s:e] for _, (s, e) in pre.pre_tokenize_str(text)]
        assert got == regex.findall(CL100K_PATTERN, text), text
        # BPE merges never cross a piece boundary.
        ids, i = code_tok.encode(text), 0
        for piece in got:
            n = len(code_tok.encode(piece))
            assert ids[i:i + n] == code_tok.encode(piece)
            i += n
        assert i == len(ids)


# The pre_tokenizer of a released cl100k-split model's tokenizer.json (dolma2, Llama 3) as JSON
# parses it, written out by hand rather than taken from CL100K_PATTERN.
RELEASED_CL100K = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Split",
         "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+"
                              "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                              "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
         "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": False},
    ],
}


def test_saved_pre_tokenizer_is_the_released_models(code_tok, tmp_path):
    code_tok.save(tmp_path / "t")
    saved = json.loads((tmp_path / "t" / "tokenizer.json").read_text())
    assert saved["pre_tokenizer"] == RELEASED_CL100K
    assert BPETokenizer.from_pretrained(tmp_path / "t").pre_tokenizer == "cl100k"


def test_transformers_encodes_identically(code_tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    code_tok.save(tmp_path / "t")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "t" /
                                                                  "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "t"))
    for text in VARIED + random_texts(20, seed=1):
        ids = code_tok.encode(text)
        assert fast(text, add_special_tokens=False)["input_ids"] == ids, text
        assert auto(text, add_special_tokens=False)["input_ids"] == ids, text
        assert auto.decode(ids) == text


def test_old_tokenizer_json_loads_and_encodes_as_before(tmp_path):
    corpus = [CODE] * 20 + PROSE[:20] + [t for t in VARIED if t]
    old = old_way_tokenizer(corpus, vocab_size=400)
    d = tmp_path / "old"
    d.mkdir()
    (d / "tokenizer.json").write_text(old.to_str(pretty=True), encoding="utf-8")
    loaded = BPETokenizer.from_pretrained(d)
    assert loaded.pre_tokenizer == "gpt2"
    texts = VARIED + random_texts(20, seed=2)
    expected = [e.ids for e in old.encode_batch(texts, add_special_tokens=False)]
    assert loaded.encode_batch(texts) == expected
    assert [loaded.encode(t) for t in texts] == expected
    assert pieces(loaded, ".\n\nT")[-3:] == ["\n", "\n", "T"]
    # Saving it again keeps its split: a release of an old run encodes as that run did.
    loaded.save(tmp_path / "again")
    again = json.loads((tmp_path / "again" / "tokenizer.json").read_text())
    assert again["pre_tokenizer"] == json.loads(old.to_str())["pre_tokenizer"]
    # And the gpt2 option trains the very same tokenizer as the old code did.
    same = BPETokenizer(pre_tokenizer="gpt2").train_from_texts(corpus, vocab_size=400)
    assert same.backend.to_str() == old.to_str()


def test_foreign_pre_tokenizer_is_not_named():
    tok = HFTokenizer(models.BPE())
    assert pre_tokenizer_name(tok) is None  # none at all
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    assert pre_tokenizer_name(tok) is None


def random_texts(n: int, seed: int) -> list[str]:
    """Random strings of code points from many scripts, emoji, controls and whitespace (\\r\\n,
    tabs, newline runs); surrogates excluded (no UTF-8 form)."""
    rng = np.random.default_rng(seed)
    ranges = [(0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF),
              (0x590, 0x6FF), (0x900, 0x97F), (0x3040, 0x30FF), (0x4E00, 0x9FFF),
              (0xAC00, 0xD7A3), (0xE000, 0xF8FF), (0xFE00, 0xFFFD), (0x1F300, 0x1FAFF),
              (0x10000, 0x10FFFF)]
    spaces = [" ", "  ", "    ", "\n", "\n\n", "\r\n", "\t", "\n    ", "\u00a0", "\u3000"]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(int(rng.integers(1, 40))):
            if rng.random() < 0.3:
                parts.append(spaces[int(rng.integers(len(spaces)))])
            else:
                lo, hi = ranges[int(rng.integers(len(ranges)))]
                cps = rng.integers(lo, hi + 1, size=int(rng.integers(1, 6)))
                parts.append("".join(chr(int(c)) for c in cps if not 0xD800 <= c <= 0xDFFF))
        out.append("".join(parts))
    return out


@pytest.mark.parametrize("split", ["cl100k", "gpt2"])
def test_round_trip_random_unicode(split):
    texts = random_texts(200, seed=0)
    tok = BPETokenizer(pre_tokenizer=split).train_from_texts(texts[:100], vocab_size=500)
    lengths = tok.token_byte_lengths()
    for text in texts:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert lengths[ids].sum() == len(text.encode("utf-8"))
    assert tok.batch_decode(tok.encode_batch(texts)) == texts


def test_unknown_split_is_one_line_error(tmp_path, capsys):
    with pytest.raises(OlmoflowError, match="tokenizer.pre_tokenizer 'gpt3'; did you mean"):
        TokenizerConfig(pre_tokenizer="gpt3")
    with pytest.raises(OlmoflowError, match="unknown tokenizer.pre_tokenizer"):
        BPETokenizer(pre_tokenizer="bytes")
    rc = main(["train-tokenizer", "demo", "--run-dir", str(tmp_path / "r"), "--no-progress",
               "tokenizer.pre_tokenizer=cl100"])
    err = capsys.readouterr().err
    assert rc == 2 and "did you mean 'cl100k'" in err and "Traceback" not in err
    assert not (tmp_path / "r" / "tokenizer").exists()


def test_split_is_part_of_the_tokenizer_stage_fingerprint(tmp_path):
    run = f"run_dir={tmp_path / 'r'}"
    default = load_config("demo", [run])
    assert default.tokenizer.pre_tokenizer == "cl100k"
    gpt2 = load_config("demo", [run, "tokenizer.pre_tokenizer=gpt2"])
    assert fingerprint(gpt2, "train-tokenizer") != fingerprint(default, "train-tokenizer")


def test_train_tokenizer_uses_the_configured_split(tmp_path):
    from olmoflow.data.documents import document_texts, write_documents

    docs = tmp_path / "docs.jsonl.gz"
    write_documents(docs, [{"id": str(i), "text": t, "source": "t"}
                           for i, t in enumerate(PROSE[:50] + [CODE] * 10)])
    for split in ("cl100k", "gpt2"):
        cfg = TokenizerConfig(vocab_size=300, pre_tokenizer=split)
        res = train_tokenizer(cfg, document_texts([docs]), tmp_path / split, progress=False)
        assert res.counts["bytes_per_token"] > 1
        assert BPETokenizer.from_pretrained(tmp_path / split).pre_tokenizer == split
