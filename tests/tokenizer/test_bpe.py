"""Byte-level BPE: exact round trips, save/load, HF parity, __call__ and byte lengths."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from fuzzing import CASES, Findings, deep, dumps, mutate_bytes, mutate_json, rng_for

from olmoflow.errors import OlmoflowError
from olmoflow.tokenizer import BaseTokenizer, BPETokenizer, Tokenizer

WORDS = (
    "the quick brown fox jumps over the lazy dog while a small cat sleeps near the warm fire "
    "def main(): return 0 import os print(x) for i in range(10): if x is None: pass "
    "café naïve résumé 東京 日本語 テキスト 😀 🎉 über straße"
).split()


def corpus() -> list[str]:
    """A few KB of varied text, made deterministically."""
    rng = np.random.default_rng(0)
    texts = []
    for i in range(120):
        words = rng.choice(WORDS, size=int(rng.integers(5, 30)))
        sep = ["\n", " ", "\t", "\r\n", "\n\n"][i % 5]
        texts.append(sep.join(words))
    return texts


@pytest.fixture(scope="module")
def tok() -> BPETokenizer:
    return BPETokenizer().train_from_texts(corpus(), vocab_size=400, min_frequency=2)


ROUND_TRIP = [
    "",
    " leading space",
    "   three leading spaces and trailing   ",
    "tabs\tand\t\tmore\ttabs",
    "windows\r\nline\r\nendings\r\n",
    "many\n\n\n\nnewlines\n",
    "accents: café, naïve, e\u0301 (combining), Å vs A\u030a",
    "CJK: 日本語のテキスト、中文文本，한국어",
    "emoji: 😀🎉 family 👨\u200d👩\u200d👧\u200d👦 flag 🇫🇷 skin 👍🏽",
    "zero width\u200bjoiner and nbsp\u00a0here",
    "control \x00\x01\x7f chars",
    "".join(chr(c) for c in range(1, 256)),
    "unseen words: xylophone quixotic zephyr",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip_exact(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_specials_and_vocab(tok):
    assert isinstance(tok, BaseTokenizer)
    assert Tokenizer is BPETokenizer
    assert (tok.eos_token, tok.pad_token) == ("<|endoftext|>", "<|pad|>")
    assert (tok.eos_token_id, tok.pad_token_id) == (0, 1)
    assert 258 < tok.vocab_size <= 400
    assert tok.encode("the fox", add_eos=True)[-1] == tok.eos_token_id
    assert tok.encode("", add_eos=True) == [tok.eos_token_id]


def test_special_token_text_in_user_input_is_ordinary_text(tok, tmp_path):
    # A document cannot forge a boundary: literal special-token strings are plain text.
    text = "before<|endoftext|>after <|pad|>"
    ids = tok.encode(text, add_eos=True)
    assert ids.count(tok.eos_token_id) == 1 and ids[-1] == tok.eos_token_id
    assert tok.pad_token_id not in ids
    assert tok.decode(ids) == text
    tok.save(tmp_path / "t")
    assert type(tok).from_pretrained(tmp_path / "t").encode(text) == ids[:-1]


def test_encode_batch_matches_encode(tok):
    texts = ROUND_TRIP + corpus()[:10]
    assert tok.encode_batch(texts, add_eos=True) == [tok.encode(t, add_eos=True) for t in texts]
    assert tok.batch_decode(tok.encode_batch(texts)) == texts


def test_training_is_deterministic(tok):
    again = BPETokenizer().train_from_texts(corpus(), vocab_size=400, min_frequency=2)
    assert again.backend.to_str() == tok.backend.to_str()


def test_vocab_too_small():
    with pytest.raises(OlmoflowError, match="too small"):
        BPETokenizer().train_from_texts(["abc"], vocab_size=100)


def test_untrained_errors():
    with pytest.raises(OlmoflowError, match="not trained"):
        BPETokenizer().encode("x")


def test_train_from_files(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("\n".join(corpus()), encoding="utf-8")
    t = BPETokenizer(vocab_size=300).train([f])
    assert t.vocab_size <= 300 and t.decode(t.encode("the lazy dog\r\n")) == "the lazy dog\r\n"
    with pytest.raises(OlmoflowError, match="not found"):
        BPETokenizer().train([tmp_path / "missing.txt"])


def test_train_from_jsonl_files_reads_their_texts(tmp_path):
    import gzip
    import json

    texts = corpus()
    f = tmp_path / "docs.jsonl.gz"
    f.write_bytes(gzip.compress("".join(json.dumps({"id": i, "text": t}) + "\n"
                                        for i, t in enumerate(texts)).encode()))
    from_file = BPETokenizer(vocab_size=300).train([f])
    from_texts = BPETokenizer().train_from_texts(texts, vocab_size=300)
    assert from_file.backend.to_str() == from_texts.backend.to_str()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"body": "no text"}\n')
    with pytest.raises(OlmoflowError, match=rf"^{bad}:3: cannot read training text"):
        BPETokenizer(vocab_size=300).train([bad])
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(f.read_bytes()[:-20])
    with pytest.raises(OlmoflowError, match=rf"^{cut}:\d+: cannot read training text"):
        BPETokenizer(vocab_size=300).train([cut])


def test_save_load_identical(tok, tmp_path):
    files = tok.save(tmp_path / "tok")
    assert sorted(p.name for p in files) == [
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"
    ]
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["bos_token"] is None and config["eos_token"] == "<|endoftext|>"
    loaded = Tokenizer.from_pretrained(tmp_path / "tok")
    loaded2 = BPETokenizer.load(tmp_path / "tok" / "tokenizer.json")
    texts = ROUND_TRIP + corpus()[:5]
    assert loaded.encode_batch(texts) == tok.encode_batch(texts)
    assert loaded2.encode_batch(texts) == tok.encode_batch(texts)
    assert (loaded.eos_token_id, loaded.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert np.array_equal(loaded.token_byte_lengths(), tok.token_byte_lengths())


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(OlmoflowError, match="not found"):
        Tokenizer.from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(OlmoflowError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    with pytest.raises(OlmoflowError, match="cannot read tokenizer") as e:
        Tokenizer.from_pretrained(tmp_path / "bad")
    assert "\n" not in str(e.value)


def test_from_pretrained_hf_style_config(tok, tmp_path):
    # A model directory whose config gives EOS as an AddedToken dict and has no pad token.
    d = tmp_path / "hf"
    d.mkdir()
    (d / "tokenizer.json").write_text(tok.backend.to_str())
    (d / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<|pad|>", "special": True}, "pad_token": None})
    )
    t = Tokenizer.from_pretrained(d)
    assert t.eos_token == "<|pad|>" and t.eos_token_id == 1
    assert t.pad_token == "<|pad|>"  # default <|pad|> exists in this vocab
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(OlmoflowError, match="not in the vocabulary"):
        Tokenizer.from_pretrained(d)


def test_call_lists_and_tensors(tok):
    enc = tok("the fox")
    assert enc.input_ids == tok.encode("the fox") and enc.attention_mask == [1] * len(enc.input_ids)
    assert enc["input_ids"] == enc.input_ids

    texts = ["the", "the quick brown fox jumps"]
    enc = tok(texts, return_tensors="pt", padding=True)
    short, long_ = tok.encode(texts[0]), tok.encode(texts[1])
    width = len(long_)
    assert enc.input_ids.shape == (2, width) and enc.input_ids.dtype == torch.long
    pad = width - len(short)
    assert enc.input_ids[0].tolist() == [tok.pad_token_id] * pad + short  # LEFT padding
    assert enc.attention_mask[0].tolist() == [0] * pad + [1] * len(short)
    assert enc.attention_mask[1].tolist() == [1] * width
    assert tok.batch_decode(enc.input_ids) == texts  # pads are special, so skipped

    enc = tok("the fox", return_tensors="pt", add_eos=True)
    assert enc.input_ids.shape == (1, len(tok.encode("the fox")) + 1)
    assert enc.input_ids[0, -1].item() == tok.eos_token_id
    with pytest.raises(OlmoflowError, match="padding=True"):
        tok(texts, return_tensors="pt")
    with pytest.raises(OlmoflowError, match="return_tensors"):
        tok("x", return_tensors="np")


def test_token_byte_lengths(tok):
    lengths = tok.token_byte_lengths()
    assert lengths.dtype == np.int32 and lengths.shape == (tok.vocab_size,)
    assert lengths[tok.eos_token_id] == 0 and lengths[tok.pad_token_id] == 0
    assert (np.delete(lengths, [0, 1]) >= 1).all()
    for text in ROUND_TRIP:
        ids = tok.encode(text)
        assert lengths[ids].sum() == len(text.encode("utf-8"))
    # EOS adds no bytes: bits-per-byte counts only real text.
    assert lengths[tok.encode("café", add_eos=True)].sum() == len("café".encode())


def test_transformers_parity(tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok.save(tmp_path / "tok")
    file = str(tmp_path / "tok" / "tokenizer.json")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=file)
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert auto.eos_token == "<|endoftext|>" and auto.pad_token == "<|pad|>"
    assert auto.eos_token_id == tok.eos_token_id and auto.pad_token_id == tok.pad_token_id
    for text in ROUND_TRIP + ["x ."]:
        ids = tok.encode(text)
        assert fast(text, add_special_tokens=False)["input_ids"] == ids
        assert auto(text, add_special_tokens=False)["input_ids"] == ids
        assert auto.decode(ids, skip_special_tokens=False) == tok.decode(
            ids, skip_special_tokens=False
        )


# --- seeded fuzzing (tests/fuzzing.py): tokenizer.json files --------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from olmoflow.tokenizer import BPETokenizer

    d = tmp_path_factory.mktemp("tok")
    texts = ["the sea and the ships of the harbour " * 4, "def main():\n    return 1\n" * 4]
    BPETokenizer().train_from_texts(texts * 4, vocab_size=300).save(d)
    return d


def test_fuzz_tokenizer_json(tmp_path, tokenizer_dir):
    """Mutated ``tokenizer.json`` files (and their config): a tokenizer that loads encodes text
    into ids below its vocabulary size and decodes them back to a string."""
    from olmoflow.tokenizer import Tokenizer

    r, found = rng_for("tokenizer"), Findings("tokenizer.json")
    base = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab_tokens = list(base["model"]["vocab"])
    for case in range(CASES):
        d = tmp_path / f"case{case:04d}"
        shutil.copytree(tokenizer_dir, d)
        op = r.randrange(10)
        if op < 6:
            (d / "tokenizer.json").write_text(dumps(mutate_json(r, base)))
        elif op == 6:
            tok = json.loads(json.dumps(base))
            tok["model"]["vocab"][r.choice(vocab_tokens)] = r.choice(
                [2**31 - 1, -1, 10**6, 0, 299, 300, 1.5, "7", None])
            (d / "tokenizer.json").write_text(json.dumps(tok))
        elif op == 7:
            (d / "tokenizer.json").write_bytes(
                mutate_bytes(r, (tokenizer_dir / "tokenizer.json").read_bytes()))
        elif op == 8:
            cfg = json.loads((d / "tokenizer_config.json").read_text())
            (d / "tokenizer_config.json").write_text(dumps(mutate_json(r, cfg)))
        else:
            (d / r.choice(["tokenizer.json", "tokenizer_config.json"])).write_text(
                r.choice(["", "[]", "null", "1", "{", dumps(deep(r))]))

        def load_and_use(d: Path = d) -> None:
            tok = Tokenizer.from_pretrained(d)
            ids = tok.encode("the sea and 123 ships\n")
            if not all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids):
                raise AssertionError(f"ids {ids} outside the vocabulary ({tok.vocab_size})")
            if not isinstance(tok.decode(ids), str):
                raise AssertionError("decode gave no string")

        found.outcome(case, f"op {op} in {d}", load_and_use)
    found.check()


def test_a_chat_template_of_the_wrong_type_is_an_error(tok, tmp_path, caplog):
    """``tokenizer_config.json``'s ``chat_template``: a string, or transformers' list of named
    templates whose ``default`` is used; anything else is named, never silently dropped."""
    d = tmp_path / "hf"
    d.mkdir()
    (d / "tokenizer.json").write_text(tok.backend.to_str())
    cfg = d / "tokenizer_config.json"
    for value, fragment in ((42, "chat_template=42 must be a Jinja string"),
                            ([1, 2], "chat_template[0]=1 is not"),
                            ([{"name": "default", "template": 3}], "chat_template[0]=")):
        cfg.write_text(json.dumps({"chat_template": value}))
        with pytest.raises(OlmoflowError, match=r"tokenizer_config\.json: ") as e:
            Tokenizer.from_pretrained(d)
        assert fragment in str(e.value) and "\n" not in str(e.value)
    cfg.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "x"}]}))
    with caplog.at_level("WARNING"):
        assert Tokenizer.from_pretrained(d).chat_template is None
    assert "'tool_use' but no 'default'" in caplog.text
    cfg.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "x"},
                                                 {"name": "default", "template": "{{ 1 }}"}]}))
    assert Tokenizer.from_pretrained(d).chat_template == "{{ 1 }}"
