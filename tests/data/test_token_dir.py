"""One token writer, one meta.json, one reader: the main flow and the data engine write the same
tokens directory, with the same held-out rule, and :func:`open_token_dir` opens both."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from olmoflow.data.config import TokenizeConfig
from olmoflow.data.documents import document_texts, read_documents, write_documents
from olmoflow.data.tokenize import SPLITS, open_token_dir, read_index, tokenize
from olmoflow.errors import OlmoflowError
from olmoflow.tokenizer.config import TokenizerConfig
from olmoflow.tokenizer.train import train_tokenizer

WORDS = "the a cat dog sat ran on under mat log quickly slowly café 日本 😀 def return".split()


def docs(n: int = 40) -> list[dict]:
    rng = np.random.default_rng(3)
    return [{"id": f"d{i}", "text": " ".join(rng.choice(WORDS, size=int(rng.integers(2, 30)))),
             "source": "s"} for i in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    path = root / "docs.jsonl.gz"
    write_documents(path, docs())
    train_tokenizer(TokenizerConfig(vocab_size=300, min_frequency=1), document_texts([path]),
                    root / "tokenizer", progress=False, files=[path])
    return root, path


def digests(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.suffix in (".npy", ".gz")}


def engine_parts(corpus, shards: int, out: Path, seed: int = 7, fraction: float = 0.2):
    """The data engine's tokenize step (its held-out choice and shard job) over ``shards``
    mixed shards of the corpus, without the rest of the engine."""
    from olmoflow.data.engine import steps
    from olmoflow.data.tokenize_shards import tokenize_shard

    root, path = corpus
    all_docs = list(read_documents(path))
    mixed = []
    for k in range(shards):
        p = out / "mixed" / f"{k:05d}.jsonl.gz"
        write_documents(p, all_docs[k::shards] if shards > 1 else all_docs)
        mixed.append({"source": "s", "path": str(p)})
    cfg = SimpleNamespace(tokenize=SimpleNamespace(seed=seed, heldout_fraction=fraction,
                                                   heldout_max_documents=200))
    held = steps.choose_heldout_parts(SimpleNamespace(cfg=cfg), mixed)
    ids = set()
    for s, h in zip(mixed, held):
        name = Path(s["path"]).name.replace(".jsonl.gz", ".npy")
        tokenize_shard({"input": s["path"], "heldout": h, "tokenizer": str(root / "tokenizer"),
                        "parts": {sp: str(out / "tokens" / sp / name) for sp in SPLITS}})
        ids |= {d["id"] for j, d in enumerate(read_documents(s["path"])) if j in h}
    return ids


def test_main_flow_and_engine_write_the_same_bytes(corpus, tmp_path):
    root, path = corpus
    tokenize(TokenizeConfig(heldout_fraction=0.2), path, root / "tokenizer", tmp_path / "main",
             seed=7, progress=False)
    engine_parts(corpus, 1, tmp_path / "eng")
    main = digests(tmp_path / "main")
    eng = {k.replace("00000", "part-00000"): v
           for k, v in digests(tmp_path / "eng" / "tokens").items()}
    assert main == eng and len(main) == 4


def test_heldout_split_does_not_depend_on_sharding(corpus, tmp_path):
    one = engine_parts(corpus, 1, tmp_path / "one")
    three = engine_parts(corpus, 3, tmp_path / "three")
    assert one == three and 0 < len(one) < 40


def test_open_token_dir_opens_the_main_flow_and_names_what_is_missing(corpus, tmp_path):
    root, path = corpus
    out = root / "tokens"
    tokenize(TokenizeConfig(heldout_fraction=0.2), path, root / "tokenizer", out, seed=1,
             progress=False)
    td = open_token_dir(out)
    assert td.tokenizer_dir == root / "tokenizer" and td.implementation == "bpe"
    assert td.meta["tokenizer"]["path"] == "../tokenizer" and td.dtype == np.dtype("<u2")
    held = [r for p in td.split("heldout") for r in read_index(p.with_suffix(".csv.gz"))]
    train = [r for p in td.split("train") for r in read_index(p.with_suffix(".csv.gz"))]
    assert len(held) + len(train) == 40 and td.meta["splits"]["heldout"]["documents"] == len(held)
    assert td.load_tokenizer().vocab_size == td.meta["vocab_size"]

    with pytest.raises(OlmoflowError, match="no such directory"):
        open_token_dir(tmp_path / "nope")
    with pytest.raises(OlmoflowError, match="not a tokens directory: no meta.json"):
        open_token_dir(tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16"}))
    with pytest.raises(OlmoflowError, match="has no 'splits'"):
        open_token_dir(tmp_path)
    meta = json.loads((out / "meta.json").read_text())
    meta["tokenizer"]["path"] = "../elsewhere"
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(OlmoflowError, match="token array 'train/part-00000.npy'.*missing"):
        open_token_dir(tmp_path)
    for s in SPLITS:
        (tmp_path / s).mkdir()
        (tmp_path / s / "part-00000.npy").write_bytes((out / s / "part-00000.npy").read_bytes())
    with pytest.raises(OlmoflowError, match="tokenizer directory .*elsewhere.* is missing"):
        open_token_dir(tmp_path)
    with pytest.raises(OlmoflowError, match="did you mean 'heldout'"):
        td.split("heldot")


def test_a_cut_or_grown_token_array_is_refused(corpus, tmp_path):
    """An array whose size disagrees with the token count meta.json records would train on other
    tokens than its index describes: refused with one line."""
    root, path = corpus
    out = root / "tokens"
    tokenize(TokenizeConfig(heldout_fraction=0.2), path, root / "tokenizer", out, seed=1,
             progress=False)
    array = out / "train" / "part-00000.npy"
    data = array.read_bytes()
    array.write_bytes(data[:1000])
    with pytest.raises(OlmoflowError, match=r"part-00000.npy: 1000 bytes, but meta.json records"):
        open_token_dir(out)
    array.write_bytes(data + b"\0\0")
    with pytest.raises(OlmoflowError, match="damaged or changed"):
        open_token_dir(out)
    array.write_bytes(data)
    assert open_token_dir(out).train == [array]


def test_a_tokens_directory_naming_code_is_not_loaded_unless_trusted(corpus):
    """meta.json may come from someone else: a tokenizer implementation other than the built-in
    one is imported only when the user's own config names the same one."""
    root, path = corpus
    out = root / "tokens"
    tokenize(TokenizeConfig(heldout_fraction=0.2), path, root / "tokenizer", out, seed=1,
             progress=False)
    meta = json.loads((out / "meta.json").read_text())
    meta["tokenizer"]["implementation"] = "os:system"
    (out / "meta.json").write_text(json.dumps(meta))
    td = open_token_dir(out)
    with pytest.raises(OlmoflowError, match="names tokenizer implementation 'os:system'.*"
                                            "tokenizer.implementation=os:system"):
        td.load_tokenizer()
    with pytest.raises(OlmoflowError):  # trusted, it is resolved (and os.system is no tokenizer)
        td.load_tokenizer(trusted="os:system")
