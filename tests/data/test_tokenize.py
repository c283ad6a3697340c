"""train-tokenizer and tokenize stages: OLMo-format arrays, index, held-out split, determinism."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from test_cli import cli, doc_text, write_jsonl

from olmoflow.data.config import TokenizeConfig
from olmoflow.data.documents import document_texts
from olmoflow.data.tokenize import (
    check_part,
    choose_heldout,
    read_index,
    read_token_array,
    token_dtype,
    tokenize,
)
from olmoflow.errors import OlmoflowError
from olmoflow.tokenizer import Tokenizer
from olmoflow.tokenizer.config import TokenizerConfig
from olmoflow.tokenizer.train import train_tokenizer

WORDS = "the a cat dog sat ran on under mat log quickly slowly café 日本 😀 def return".split()


def make_docs(n: int = 60) -> list[dict]:
    rng = np.random.default_rng(1)
    docs = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS, size=int(rng.integers(3, 40))))
        if i % 7 == 0:
            text = "\n\n  " + text.replace(" ", "\t", 2) + "\r\n"
        docs.append({"id": f"doc-{i}", "text": text, "source": "src-a" if i % 2 else "src,b"})
    docs.append({"id": "empty", "text": "", "source": "src-a"})
    return docs


def write_docs(path: Path, docs: list[dict]) -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    docs = make_docs()
    docs_path = write_docs(root / "docs.jsonl.gz", docs)
    res = train_tokenizer(TokenizerConfig(vocab_size=320), document_texts([docs_path]),
                          root / "tokenizer", False, files=[docs_path])
    return root, docs, docs_path, res


def run(setup, out: str, cfg=None, docs_path=None, seed=7):
    root, _, default_docs, _ = setup
    cfg = cfg or TokenizeConfig(heldout_fraction=0.2, heldout_max_documents=200)
    return tokenize(cfg, docs_path or default_docs, root / "tokenizer", root / out, seed, False)


def test_train_tokenizer_stage(setup):
    root, docs, docs_path, res = setup
    assert res.counts["vocab_size"] <= 320 and res.counts["documents"] == len(docs)
    assert res.counts["bytes"] == sum(len(d["text"].encode()) for d in docs)
    assert res.counts["bytes_per_token"] > 1.0
    assert {p.name for p in res.outputs} >= {"tokenizer.json", "tokenizer_config.json"}
    assert res.inputs == [docs_path]
    empty = write_docs(root / "none.jsonl.gz", [])
    with pytest.raises(OlmoflowError, match="no documents"):
        train_tokenizer(TokenizerConfig(vocab_size=320), document_texts([empty]), root / "t2",
                        False, files=[empty])


def test_tokenize_layout_and_contents(setup):
    root, docs, _, _ = setup
    res = run(setup, "tokens")
    out = root / "tokens"
    meta = json.loads((out / "meta.json").read_text())
    tok = Tokenizer.from_pretrained(root / "tokenizer")
    assert meta["dtype"] == "uint16" and res.counts["dtype"] == "uint16"
    assert meta["vocab_size"] == tok.vocab_size and meta["eos_token_id"] == tok.eos_token_id
    by_id = {d["id"]: d for d in docs}
    seen = []
    for split in ("train", "heldout"):
        npy, idx = out / split / "part-00000.npy", out / split / "part-00000.csv.gz"
        assert npy in res.outputs and idx in res.outputs
        arr = read_token_array(npy, meta["dtype"])
        rows = read_index(idx)
        # Raw memmap, no header: the file is exactly 2 bytes per token.
        assert npy.stat().st_size == 2 * len(arr) == 2 * meta["splits"][split]["tokens"]
        assert rows[-1][1] == len(arr) and check_part(npy, "uint16", tok.eos_token_id) == len(arr)
        assert len(rows) == meta["splits"][split]["documents"] == res.counts[f"{split}_documents"]
        nbytes = 0
        for start, end, doc_id, source in rows:
            doc = by_id[doc_id]
            assert source == doc["source"]  # "src,b" survives CSV quoting
            assert arr[end - 1] == tok.eos_token_id  # EOS inside [start, end)
            assert tok.decode(arr[start:end]) == doc["text"]
            assert list(arr[start:end]) == tok.encode(doc["text"], add_eos=True)
            nbytes += len(doc["text"].encode())
        assert nbytes == meta["splits"][split]["bytes"]
        seen.append({r[2] for r in rows})
    train_ids, heldout_ids = seen
    assert not train_ids & heldout_ids and train_ids | heldout_ids == set(by_id)
    assert 1 <= len(heldout_ids) < len(docs)


def test_byte_identical_rerun_and_order_independent_split(setup):
    root, docs, _, _ = setup
    run(setup, "a")
    run(setup, "b")
    files = sorted(p.relative_to(root / "a") for p in (root / "a").rglob("*") if p.is_file())
    assert len(files) == 5
    for f in files:
        assert (root / "a" / f).read_bytes() == (root / "b" / f).read_bytes(), f
    # Same documents in another order: same held-out ids.
    shuffled = write_docs(root / "shuffled.jsonl.gz", docs[::-1])
    run(setup, "c", docs_path=shuffled)
    ids = {s: {r[2] for r in read_index(root / s / "heldout" / "part-00000.csv.gz")} for s in "ac"}
    assert ids["a"] == ids["c"]
    # Another seed gives another split.
    run(setup, "d", seed=8)
    assert {r[2] for r in read_index(root / "d" / "heldout" / "part-00000.csv.gz")} != ids["a"]


def test_heldout_cap_and_minimum(setup):
    root, _, _, _ = setup
    res = run(setup, "capped", cfg=TokenizeConfig(heldout_fraction=0.9, heldout_max_documents=3))
    assert res.counts["heldout_documents"] == 3
    res = run(setup, "none", cfg=TokenizeConfig(heldout_fraction=0.0))
    assert res.counts["heldout_documents"] == 1  # at least one, for evaluation
    with pytest.raises(OlmoflowError, match="heldout_fraction"):
        run(setup, "bad", cfg=TokenizeConfig(heldout_fraction=1.5))


def test_choose_heldout_rules():
    scores = [(0.5, 0), (0.1, 1), (0.9, 2), (0.05, 3)]
    assert choose_heldout(scores, 0.2, 10) == {1, 3}
    assert choose_heldout(scores, 0.2, 1) == {3}  # cap keeps the lowest scores
    assert choose_heldout(scores, 0.0, 10) == {3}  # at least one
    assert choose_heldout(scores, 1.0, 10) == {0, 1, 3}  # train keeps one
    assert choose_heldout([(0.0, 0)], 0.5, 10) == set()  # a single document trains
    assert choose_heldout(scores[::-1], 0.2, 1) == {3}


def test_token_dtype():
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    assert token_dtype(100_352).itemsize == 4


def test_check_part_detects_mismatch(setup, tmp_path):
    root, _, _, _ = setup
    run(setup, "broken")
    npy = root / "broken" / "train" / "part-00000.npy"
    npy.write_bytes(npy.read_bytes()[:-2])
    with pytest.raises(OlmoflowError, match="index ends at"):
        check_part(npy, "uint16")
    with pytest.raises(OlmoflowError, match="not found"):
        read_token_array(tmp_path / "x.npy", "uint16")
    odd = tmp_path / "odd.npy"
    odd.write_bytes(b"\x00" * 3)
    with pytest.raises(OlmoflowError, match="multiple"):
        read_token_array(odd, "uint16")


def test_tokenize_errors(setup):
    root, _, _, _ = setup
    empty = write_docs(root / "empty.jsonl.gz", [])
    with pytest.raises(OlmoflowError, match="no documents"):
        run(setup, "e", docs_path=empty)
    with pytest.raises(OlmoflowError, match="not found"):
        tokenize(TokenizeConfig(), root / "docs.jsonl.gz", root / "missing", root / "e2", 0, False)

def test_literal_special_tokens_stay_text(tmp_path, capsys):
    import numpy as np

    corpus = write_jsonl(tmp_path / "c.jsonl", [
        {"text": doc_text(i) * 3 + " Hello <|endoftext|> world <|pad|> end."} for i in range(12)])
    for verb in ("collect", "clean", "train-tokenizer", "tokenize"):
        rc, _, err = cli(capsys, verb, "tiny", "--data", str(corpus), "--run-dir",
                         str(tmp_path / "r"), "--no-progress", "tokenize.heldout_fraction=0.5")
        assert rc == 0, err
    meta = json.loads((tmp_path / "r" / "tokens" / "meta.json").read_text())
    tokens = np.memmap(tmp_path / "r" / "tokens" / "train" / "part-00000.npy",
                       dtype=meta["dtype"], mode="r")
    # exactly one EOS per document (the one the pipeline appends), and no pad token at all
    assert int((tokens == meta["eos_token_id"]).sum()) == meta["splits"]["train"]["documents"]
    assert int((tokens == meta["pad_token_id"]).sum()) == 0
