"""Dedup keeps exactly one copy: distinct corpora lose nothing, copies go, near-dups by threshold,
idempotence through the mixer, and the same answer for any sharding, executor and worker count."""

from __future__ import annotations

import gzip
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from olmoflow.config import from_dict
from olmoflow.data.dedup import (
    DedupConfig,
    MinHashConfig,
    MinHashSigner,
    dedup,
    mixer_rules,
    paragraphs,
)
from olmoflow.data.documents import read_documents, write_documents
from olmoflow.data.mixer import mix
from olmoflow.data.ngrams import ngram_hashes, ngram_hashes_many, word_hashes, words
from olmoflow.errors import OlmoflowError

VOCAB = [f"w{i}" for i in range(5000)]
ALL = {"exact": True, "key": "metadata.url", "paragraphs": True, "minhash": {"threshold": 0.8}}


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def distinct_docs(n: int, seed: int = 0, prefix: str = "d") -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"{prefix}{i}", "text": sentence(rng, 80) + "\n" + sentence(rng, 40),
             "source": "web", "metadata": {"url": f"https://x/{prefix}{i}"}} for i in range(n)]


def write_corpus(root: Path, docs: list[dict], n_shards: int, source: str = "web") -> None:
    """Split ``docs`` in order into ``n_shards`` contiguous shards (corpus order is kept)."""
    bounds = np.linspace(0, len(docs), n_shards + 1).astype(int)
    for i in range(n_shards):
        write_documents(root / "documents" / source / f"{i:04d}.jsonl.gz",
                        docs[bounds[i]: bounds[i + 1]])


def attrs(root: Path) -> dict[str, dict[str, list]]:
    out = {}
    for p in sorted((root / "attributes" / "dedup").rglob("*.jsonl.gz")):
        for line in gzip.open(p, "rt"):
            row = json.loads(line)
            out[row["id"]] = row["attributes"]
    return out


def flagged(root: Path, name: str) -> set[str]:
    return {i for i, a in attrs(root).items() if any(s[2] for s in a[name])}


def mixed_docs(root: Path) -> list[dict]:
    return [d for p in sorted((root / "mixed").rglob("*.jsonl.gz")) for d in read_documents(p)]


def test_distinct_corpus_loses_nothing(tmp_path):
    docs = distinct_docs(40)
    write_corpus(tmp_path, docs, 2)
    stats = dedup(tmp_path, ALL, executor="serial")
    assert stats["documents_in"] == 40 and stats["errors"] == []
    assert all(v["documents"] == 0 for v in stats["flagged"].values()), stats["flagged"]
    out = mix(tmp_path, mixer_rules(ALL), executor="serial")
    assert out["documents_out"] == 40 and out["removed"] == {}
    assert mixed_docs(tmp_path) == docs  # unchanged, in order


def test_duplicated_corpus_keeps_exactly_the_first_copy(tmp_path):
    base = distinct_docs(30)
    rng = random.Random(1)
    copies = [dict(d, id=f"copy{k}-{d['id']}") for k in range(2) for d in rng.sample(base, 30)]
    corpus = base[:10] + copies[:25] + base[10:] + copies[25:]
    write_corpus(tmp_path, corpus, 3)
    stats = dedup(tmp_path, ALL, executor="serial")
    first = {}
    for d in corpus:
        first.setdefault(d["text"], d["id"])
    later = {d["id"] for d in corpus} - set(first.values())
    assert flagged(tmp_path, "dedup__exact") == later
    assert flagged(tmp_path, "dedup__url") == later  # copies share their url with the original
    assert flagged(tmp_path, "dedup__minhash") == later
    assert stats["flagged"]["dedup__exact"]["documents"] == len(later) == 60
    mix(tmp_path, mixer_rules(ALL), executor="serial")
    kept = mixed_docs(tmp_path)
    assert sorted(d["text"] for d in kept) == sorted(d["text"] for d in base)
    assert [d["id"] for d in kept] == [d["id"] for d in corpus if d["id"] in first.values()]


def test_key_dedup_ignores_documents_without_the_key(tmp_path):
    docs = distinct_docs(6)
    docs[1]["metadata"]["url"] = docs[0]["metadata"]["url"]
    del docs[2]["metadata"]["url"]
    del docs[3]["metadata"]["url"]
    write_corpus(tmp_path, docs, 1)
    dedup(tmp_path, {"exact": False, "key": "metadata.url"}, executor="serial")
    assert flagged(tmp_path, "dedup__url") == {"d1"}


def jaccard(a: str, b: str, n: int) -> float:
    sa = set(ngram_hashes(word_hashes(words(a)), n).tolist())
    sb = set(ngram_hashes(word_hashes(words(b)), n).tolist())
    return len(sa & sb) / len(sa | sb)


def test_near_duplicates_above_threshold_go_below_stay(tmp_path):
    rng = random.Random(2)
    base = [sentence(rng, 300) for _ in range(4)]

    def mutate(text: str, every: int) -> str:
        toks = text.split()
        return " ".join("zz" + t if i % every == 0 else t for i, t in enumerate(toks))

    near = [mutate(t, 150) for t in base]  # 2 of 300 words changed
    far = [mutate(t, 4) for t in base]     # every 4th word changed
    texts = base + near + far
    docs = [{"id": f"t{i}", "text": t, "source": "web"} for i, t in enumerate(texts)]
    write_corpus(tmp_path, docs, 2)
    cfg = {"exact": False, "minhash": {"threshold": 0.8, "ngram": 5, "num_perm": 128}}
    dedup(tmp_path, cfg, executor="serial")
    for b, n_, f in zip(base, near, far):
        assert jaccard(b, n_, 5) > 0.9 and jaccard(b, f, 5) < 0.1  # the premise
    assert flagged(tmp_path, "dedup__minhash") == {f"t{i}" for i in range(4, 8)}


def test_minhash_estimate_tracks_true_jaccard():
    rng = random.Random(3)
    signer = MinHashSigner(MinHashConfig(ngram=3, num_perm=256, seed=7))
    for swap in (2, 5, 20):
        a = sentence(rng, 400)
        b = " ".join(t if i % swap else "q" + t for i, t in enumerate(a.split()))
        est = float(np.mean(signer(a) == signer(b)))
        assert abs(est - jaccard(a, b, 3)) < 0.1, (swap, est, jaccard(a, b, 3))


def test_paragraph_spans_and_their_removal(tmp_path):
    docs = [
        {"id": "a", "text": "Home | Menu\nFirst unique line.\nShared footer text\n", "source": "s"},
        {"id": "b", "text": "Home | Menu\nSecond unique line.\nShared footer text", "source": "s"},
        {"id": "c", "text": "Shared footer text\n  \nHome | Menu\n", "source": "s"},
    ]
    write_corpus(tmp_path, docs, 1, source="s")
    cfg = {"exact": False, "paragraphs": True}
    stats = dedup(tmp_path, cfg, executor="serial")
    a = attrs(tmp_path)
    assert a["a"]["dedup__paragraphs"] == []
    assert a["b"]["dedup__paragraphs"] == [[0, 12, 1.0], [32, 50, 1.0]]
    assert a["c"]["dedup__paragraphs"] == [[0, 19, 1.0], [22, 34, 1.0]]
    assert stats["flagged"]["dedup__paragraphs"] == {"documents": 2, "bytes": 12 + 18 + 19 + 12}
    out = mix(tmp_path, mixer_rules(cfg), executor="serial")
    assert [d["text"] for d in mixed_docs(tmp_path)] == [docs[0]["text"], "Second unique line.\n"]
    assert out["removed"] == {"empty after span edits": {"documents": 1, "bytes": 34}}


def test_a_paragraph_survives_when_its_first_copy_is_in_a_dropped_document(tmp_path):
    docs = [
        {"id": "0", "text": "zero text", "source": "s", "metadata": {"url": "u"}},
        {"id": "1", "text": "one text\nShared paragraph P", "source": "s",
         "metadata": {"url": "u"}},
        {"id": "2", "text": "two text\nShared paragraph P", "source": "s",
         "metadata": {"url": "v"}},
        {"id": "3", "text": "three text\nShared paragraph P", "source": "s",
         "metadata": {"url": "w"}},
    ]
    write_corpus(tmp_path, docs, 1, source="s")
    cfg = {"exact": False, "key": "metadata.url", "paragraphs": True}
    dedup(tmp_path, cfg, executor="serial")
    assert flagged(tmp_path, "dedup__url") == {"1"}
    assert attrs(tmp_path)["2"]["dedup__paragraphs"] == []  # doc 1 goes, doc 2 keeps P
    assert attrs(tmp_path)["3"]["dedup__paragraphs"] == [[11, 29, 1.0]]
    mix(tmp_path, mixer_rules(cfg), executor="serial")
    assert sum(d["text"].count("Shared paragraph P") for d in mixed_docs(tmp_path)) == 1


def test_dedup_of_its_own_output_removes_nothing(tmp_path):
    rng = random.Random(4)
    base = distinct_docs(20, seed=5)
    for d in base[:8]:  # shared boilerplate paragraphs
        d["text"] += "\nSubscribe to our newsletter\nCopyright 2024"
    near = [dict(d, id=d["id"] + "n", text=d["text"].replace(d["text"].split()[3], "CHANGED", 1),
                 metadata={"url": d["id"] + "n"}) for d in base[:5]]
    corpus = base + near + [dict(d, id=d["id"] + "x") for d in rng.sample(base, 6)]
    write_corpus(tmp_path / "one", corpus, 3)
    first = dedup(tmp_path / "one", ALL, executor="serial")
    assert first["flagged"]["dedup__minhash"]["documents"] >= 5
    mix(tmp_path / "one", mixer_rules(ALL), executor="serial")
    again = tmp_path / "two"
    shutil.copytree(tmp_path / "one" / "mixed", again / "documents")
    for p in (again / "documents").rglob("*.jsonl.gz"):  # only documents shards
        assert not p.name.startswith(".")
    second = dedup(again, ALL, executor="serial")
    assert all(v["documents"] == 0 for v in second["flagged"].values()), second["flagged"]
    assert second["documents_in"] == len(mixed_docs(tmp_path / "one"))


def test_same_result_for_any_sharding_executor_and_workers(tmp_path):
    base = distinct_docs(24, seed=6)
    for d in base[::5]:
        d["text"] += "\nrepeated paragraph line"
    rng = random.Random(7)
    corpus = base + [dict(d, id=d["id"] + "c") for d in rng.sample(base, 8)]
    corpus += [dict(d, id=d["id"] + "n", text=d["text"] + " extra") for d in base[:4]]
    runs = {}
    for name, shards, kw in [("one", 1, {"executor": "serial"}),
                             ("serial", 3, {"executor": "serial"}),
                             ("pool", 3, {"executor": "local", "workers": 2})]:
        write_corpus(tmp_path / name, corpus, shards)
        dedup(tmp_path / name, ALL, **kw)
        runs[name] = attrs(tmp_path / name)
    assert runs["one"] == runs["serial"] == runs["pool"]
    assert sum(a["dedup__exact"][0][2] for a in runs["one"].values()) == 8
    assert sum(a["dedup__minhash"][0][2] for a in runs["one"].values()) == 12
    files = lambda n: {p.relative_to(tmp_path / n): p.read_bytes()  # noqa: E731
                       for p in (tmp_path / n / "attributes").rglob("*.jsonl.gz")}
    assert files("serial") == files("pool")  # byte-identical


def test_rerun_skips_finished_shards_and_gives_the_same_bytes(tmp_path):
    write_corpus(tmp_path, distinct_docs(10) + distinct_docs(3), 2)
    dedup(tmp_path, ALL, executor="serial")
    before = {p: p.read_bytes() for p in (tmp_path / "attributes").rglob("*.gz")}
    stamps = {p: p.stat().st_mtime_ns for p in before}
    dedup(tmp_path, ALL, executor="serial")
    assert {p: p.read_bytes() for p in before} == before
    assert {p: p.stat().st_mtime_ns for p in before} == stamps  # not rewritten


def test_bad_lines_are_counted_and_stay_aligned(tmp_path):
    shard = tmp_path / "documents" / "web" / "0000.jsonl.gz"
    shard.parent.mkdir(parents=True)
    good = distinct_docs(2)
    with gzip.open(shard, "wt") as f:
        f.write(json.dumps(good[0]) + "\n{not json\n" + json.dumps(good[1]) + "\n")
    stats = dedup(tmp_path, ALL, executor="serial")
    assert stats["documents_in"] == 2
    assert len(stats["errors"]) == 1 and "0000.jsonl.gz:2:" in stats["errors"][0]
    rows = [json.loads(x) for x in gzip.open(tmp_path / "attributes/dedup/web/0000.jsonl.gz")]
    assert [r["id"] for r in rows] == ["d0", None, "d1"]
    with pytest.raises(OlmoflowError, match=r"0000.jsonl.gz:2: not JSON"):
        dedup(tmp_path, {**ALL, "exact": True, "paragraphs": False}, executor="serial",
              strict=True)


def test_config_errors_name_the_closest_key():
    with pytest.raises(OlmoflowError, match="did you mean 'dedup.minhash.threshold'"):
        from_dict(DedupConfig, {"minhash": {"treshold": 0.5}}, "dedup.")
    with pytest.raises(OlmoflowError, match="did you mean 'dedup.paragraphs'"):
        from_dict(DedupConfig, {"paragraph": True}, "dedup.")
    with pytest.raises(OlmoflowError, match="threshold must be in"):
        from_dict(DedupConfig, {"minhash": {"threshold": 1.5}}, "dedup.")
    with pytest.raises(OlmoflowError, match="nothing to do"):
        from_dict(DedupConfig, {"exact": False}, "dedup.")


def test_impossible_banding_is_a_config_error(tmp_path):
    write_corpus(tmp_path, distinct_docs(2), 1)
    with pytest.raises(OlmoflowError, match=r"dedup.minhash: .*b < 2"):
        dedup(tmp_path, {"minhash": {"threshold": 1.0}}, executor="serial")
    assert not (tmp_path / "work" / "dedup" / "map").exists()  # failed before hashing


def test_hash_helpers():
    toks = [words(t) for t in ["a b c d", "e f", "g h i j k"]]
    many = ngram_hashes_many(toks, 3)
    each = np.concatenate([ngram_hashes(word_hashes(t), 3) for t in toks])
    assert many.tolist() == each.tolist() and len(each) == 2 + 0 + 3
    assert words("It's the END, my-friend!") == ["it", "s", "the", "end", "my", "friend"]
    assert paragraphs("a\n\n  b  \nc") == [(0, 2, "a"), (3, 9, "b"), (9, 10, "c")]
