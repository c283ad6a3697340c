"""Decontamination: a document quoting an eval item is flagged under that eval set's name (spans on
the quote), clean documents are not, drop vs tag through the mixer, the index is built once."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest

from olmoflow.config import from_dict
from olmoflow.data.decontam import DecontamConfig, decontaminate, mixer_rules
from olmoflow.data.documents import read_documents, write_documents
from olmoflow.data.mixer import mix
from olmoflow.errors import OlmoflowError

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
BUILTIN = ["arc", "hellaswag", "piqa", "boolq", "openbookqa", "gsm8k", "wikitext"]


def filler(seed: int, n: int = 60) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(["alpha", "river", "stone", "green", "open", "market", "seven",
                                "quiet", "north", "paper"]) + str(rng.randrange(50))
                    for _ in range(n))


def attrs(root: Path) -> dict[str, dict]:
    rows = {}
    for p in sorted((root / "attributes" / "decontam").rglob("*.jsonl.gz")):
        for line in gzip.open(p, "rt"):
            r = json.loads(line)
            rows[r["id"]] = r["attributes"]
    return rows


def eval_quotes() -> dict[str, str]:
    """One passage of at least 13 words from each built-in eval set, read here independently."""
    d = SHARED_DATA
    arc = next(json.loads(x) for x in open(d / "arc/ARC-Challenge-Test.jsonl")
               if len(json.loads(x)["question"]["stem"].split()) >= 16)
    hs = gzip.open(d / "hellaswag/hellaswag_val_full.txt.gz", "rt").read().split("\n")
    hs_item = next(i for i in range(0, 600, 6) if len(hs[i].split()) >= 16)
    piqa = next(json.loads(x) for x in open(d / "piqa/valid.jsonl")
                if len(json.loads(x)["goal"].split()) >= 16)
    boolq = json.loads(open(d / "boolq/val.jsonl").readline())["passage"]
    obqa = next(r.split("\t")[1] for r in open(d / "openbookqa/Main-test.tsv").readlines()[1:]
                if len(r.split("\t")[1].split()) >= 16)
    gsm = json.loads(open(d / "gsm8k/test.jsonl").readline())["question"]
    wiki = [x for x in open(d / "wikitext-2-raw/wiki.test.raw").read().split("\n")
            if len(x.split()) > 40 and not x.strip().startswith("=")][3]
    return {"arc": arc["question"]["stem"], "hellaswag": hs[hs_item], "piqa": piqa["goal"],
            "boolq": " ".join(boolq.split()[5:30]), "openbookqa": obqa, "gsm8k": gsm,
            "wikitext": " ".join(wiki.split()[10:40])}


@pytest.fixture(scope="module")
def builtin_run(tmp_path_factory):
    if not SHARED_DATA.is_dir():
        pytest.skip(f"../shared/data absent: {SHARED_DATA}")
    root = tmp_path_factory.mktemp("decontam")
    quotes = eval_quotes()
    docs = []
    for i, (name, quote) in enumerate(quotes.items()):
        # Different case and punctuation around the quote: matching is on normalized words.
        docs.append({"id": f"dirty-{name}", "source": "web",
                     "text": f"{filler(i)}. As the saying goes: \"{quote.upper()}\" -- "
                             f"{filler(i + 50)}"})
    docs += [{"id": f"clean-{i}", "text": filler(100 + i, 300), "source": "web"} for i in range(5)]
    moby = (SHARED_DATA / "gutenberg/moby_dick_2701.txt").read_text(encoding="utf-8-sig")
    docs += [{"id": f"moby-{k}", "text": moby[k * 20000: k * 20000 + 20000], "source": "books"}
             for k in range(1, 4)]
    write_documents(root / "documents/web/0000.jsonl.gz", [d for d in docs if d["source"] == "web"])
    write_documents(root / "documents/books/0000.jsonl.gz",
                    [d for d in docs if d["source"] == "books"])
    cfg = {"eval_dir": str(SHARED_DATA), "action": "drop"}
    stats = decontaminate(root, cfg, executor="serial")
    return root, cfg, quotes, stats, docs


def test_eval_quotes_are_flagged_under_their_set_and_clean_documents_are_not(builtin_run):
    root, _, quotes, stats, docs = builtin_run
    rows = attrs(root)
    text = {d["id"]: d["text"] for d in docs}
    for name, quote in quotes.items():
        a = rows[f"dirty-{name}"]
        assert a["decontam__contaminated"][0][2] == 1.0, name
        assert a[f"decontam__{name}"], f"{name} quote not flagged under its own set"
        # the spans lie on the quote
        t = text[f"dirty-{name}"]
        q0, q1 = t.index(quote.upper()), t.index(quote.upper()) + len(quote)
        for s, e, _ in a[f"decontam__{name}"]:
            assert q0 <= s < e <= q1, (name, s, e, q0, q1)
    for i in [*(f"clean-{k}" for k in range(5)), *(f"moby-{k}" for k in range(1, 4))]:
        assert rows[i]["decontam__contaminated"][0][2] == 0.0, i
        assert not any(rows[i][f"decontam__{n}"] for n in BUILTIN), i
    for name in BUILTIN:
        assert stats["flagged"][f"decontam__{name}"]["documents"] >= 1
        assert stats["index"][name]["items"] > 0 and stats["index"][name]["ngrams"] > 0
    assert stats["flagged"]["decontam__contaminated"]["documents"] == len(quotes)
    assert stats["index"]["hellaswag"]["items"] == 10042
    assert stats["index"]["gsm8k"]["items"] == 1319


def test_drop_excludes_contaminated_documents_in_the_mix(builtin_run):
    root, cfg, quotes, _, docs = builtin_run
    stats = mix(root, mixer_rules(cfg), executor="serial")
    kept = {d["id"] for p in sorted((root / "mixed").rglob("*.gz")) for d in read_documents(p)}
    assert kept == {d["id"] for d in docs if not d["id"].startswith("dirty")}
    assert stats["removed"]["exclude: decontam__contaminated == 1"]["documents"] == len(quotes)
    assert mixer_rules({**cfg, "action": "tag"})["exclude"] == []


def test_index_is_built_once(builtin_run):
    root, cfg, *_ = builtin_run
    index = root / "work/decontam/index.npz"
    stamp = index.stat().st_mtime_ns
    decontaminate(root, cfg, executor="serial")
    assert index.stat().st_mtime_ns == stamp


def custom_eval(tmp_path: Path) -> dict:
    ev = tmp_path / "myeval.jsonl"
    ev.write_text(json.dumps({"q": "What is the boiling point of water at sea level in degrees "
                                   "Celsius under normal pressure?",
                              "choices": [{"text": "one hundred"}, {"text": "fifty"}]}) + "\n")
    return {"evals": [], "files": {"myeval": {"path": str(ev), "fields": ["q", "choices.text"]}},
            "ngram": 8, "action": "tag"}


def test_custom_eval_files_short_texts_and_tag_mode(tmp_path):
    cfg = custom_eval(tmp_path)
    docs = [
        {"id": "q", "source": "s",
         "text": "Quiz: what is the BOILING point of water at sea-level?"},
        {"id": "short", "source": "s", "text": "The answer is one hundred, not fifty."},
        {"id": "clean", "source": "s", "text": filler(1)},
    ]
    write_documents(tmp_path / "run/documents/s/0000.jsonl.gz", docs)
    stats = decontaminate(tmp_path / "run", cfg, executor="serial")
    rows = attrs(tmp_path / "run")
    assert rows["q"]["decontam__myeval"] == [[6, 53, 1.0]]  # "what ... level": 10 words
    assert docs[0]["text"][6:53] == "what is the BOILING point of water at sea-level"
    assert rows["short"]["decontam__myeval"] == []  # choices shorter than ngram cannot match
    assert rows["clean"]["decontam__contaminated"] == [[0, len(docs[2]["text"]), 0.0]]
    assert stats["flagged"]["decontam__myeval"] == {"documents": 1,
                                                     "bytes": len(docs[0]["text"])}
    assert stats["index"]["myeval"] == {"items": 1, "texts": 1, "ngrams": 16 - 8 + 1}
    out = mix(tmp_path / "run", mixer_rules(cfg), executor="serial")  # tag: nothing dropped
    assert out["documents_out"] == 3
    # a changed setting rebuilds the index (and re-tags: the quote has 10 words, ngram 11 > 10)
    stats = decontaminate(tmp_path / "run", {**cfg, "ngram": 11}, executor="serial")
    assert stats["index"]["myeval"]["ngrams"] == 16 - 11 + 1
    assert stats["flagged"]["decontam__myeval"]["documents"] == 0


def test_config_errors():
    with pytest.raises(OlmoflowError, match="did you mean 'hellaswag'"):
        from_dict(DecontamConfig, {"evals": ["helaswag"]}, "decontaminate.")
    with pytest.raises(OlmoflowError, match="did you mean 'drop'"):
        from_dict(DecontamConfig, {"action": "dorp"}, "decontaminate.")
    with pytest.raises(OlmoflowError, match="did you mean 'decontaminate.ngram'"):
        from_dict(DecontamConfig, {"ngrams": 13}, "decontaminate.")
    with pytest.raises(OlmoflowError, match="eval set 'gsm8k': no such file .* \\(set "
                       "decontaminate.eval_dir .* it is '/nonexistent'"):
        list(from_dict(DecontamConfig, {"evals": ["gsm8k"], "eval_dir": "/nonexistent"})
             .eval_items("gsm8k"))
