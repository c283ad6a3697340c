"""Is our data engine at least 5x faster per core than datatrove, and does it decide the same?

Side by side, in this process, pinned to one CPU core: olmoflow's pipeline (Gopher + C4 tagging
with ``tag_shard``, exact + MinHash dedup with ``olmoflow.data.dedup``, tokenization with
``tokenize_shard``) and datatrove 0.10.1's ``GopherRepetitionFilter``, ``GopherQualityFilter`` and
``C4QualityFilter`` (English words from ``spacy.blank("en")``, which needs no model download),
on the same input: the web-crawl samples of ``../shared/data`` repeated to at least ``--mb``
megabytes. Every datatrove filter sees every document (as every rule of our taggers does), so
both sides do the same work; datatrove's word cache lets its two Gopher filters share one spaCy
pass per document, as our two share one regex pass.

Prints documents/s and MB/s (MB = 10^6 bytes of UTF-8 text) for each step, the agreement of the
keep/drop decisions per shared filter on the distinct documents, and the causes of disagreement
(datatrove's reason vs. the rules of ours that fired). The last line is
``ratio (ours/datatrove) = X``: filter throughput of ours over datatrove's, in CPU time (the
machine may be shared; wall-clock figures are printed too). Target X >= 5.

Usage:  python benchmarks/data_speed.py [--mb 50] [--core 0] [--keep DIR]
Needs:  pip install -e '.[data,bench]'  (datatrove, spacy, datasketch)
"""

from __future__ import annotations

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the tokenizers library: one thread, one core
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "web-crawl"
SHARD_MB = 5


def load_texts() -> list[str]:
    """The distinct web-crawl documents of ../shared/data (C4, DCLM, Dolma CC)."""
    texts = []
    for name in ("c4_demo.jsonl", "dclm_majority_data.jsonl", "dolma_cc_en_head-0091.jsonl",
                 "dolma_cc_en_head-0174.jsonl"):
        texts += [json.loads(line)["text"] for line in open(DATA / name, encoding="utf-8")]
    with gzip.open(DATA / "dolma_documents_000.json.gz", "rt", encoding="utf-8") as f:
        texts += [json.loads(line)["text"] for line in f]
    seen: set[str] = set()
    return [t for t in texts if not (t in seen or seen.add(t))]


def build_corpus(texts: list[str], mb: float, root: Path) -> tuple[list[Path], list[str], int]:
    """Write ``texts`` repeated to >= ``mb`` MB as Dolma shards; return (shards, corpus, bytes)."""
    from olmoflow.data.documents import write_documents

    corpus, size = [], 0
    while size < mb * 1e6:
        for t in texts:
            corpus.append(t)
            size += len(t.encode("utf-8"))
    shards, batch, batch_bytes = [], [], 0

    def flush():
        path = root / "documents" / "web" / f"{len(shards):04d}.jsonl.gz"
        write_documents(path, [{"id": f"{len(shards)}-{i}", "text": t, "source": "web"}
                               for i, t in enumerate(batch)])
        shards.append(path)

    for t in corpus:
        batch.append(t)
        batch_bytes += len(t.encode("utf-8"))
        if batch_bytes >= SHARD_MB * 1e6:
            flush()
            batch, batch_bytes = [], 0
    if batch:
        flush()
    return shards, corpus, size


class Clock:
    """Wall-clock and CPU seconds of a block (CPU time is what one core gives on a shared host)."""

    def __enter__(self):
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0


def run_ours(root: Path, shards: list[Path], corpus: list[str]) -> dict[str, Clock]:
    """(wall, CPU) seconds per step of our pipeline, run serially in this process."""
    from olmoflow.data.dedup import dedup
    from olmoflow.data.taggers import tag_shard
    from olmoflow.data.tokenize_shards import tokenize_shard
    from olmoflow.tokenizer.bpe import BPETokenizer

    secs = {}
    with Clock() as secs["tag (gopher + c4)"]:
        for s in shards:
            tag_shard({"documents": str(s), "taggers": ["gopher", "c4"],
                       "output": str(root / "attributes" / "heuristics" / "web" / s.name)})
    with Clock() as secs["dedup (exact + minhash)"]:
        dedup(root, {"exact": True, "minhash": {"threshold": 0.8, "ngram": 5, "num_perm": 128}},
              executor="serial", workers=1)

    # The tokenizer is trained outside the timing: tokenization speed is what is measured.
    tok_dir = root / "tokenizer"
    BPETokenizer(vocab_size=8192).train_from_texts(corpus[:2000]).save(tok_dir)
    with Clock() as secs["tokenize (BPE 8k)"]:
        for s in shards:
            tokenize_shard({"input": str(s), "tokenizer": str(tok_dir), "output": str(
                root / "tokens" / (s.name[: -len(".jsonl.gz")] + ".npy"))})
    return secs


def run_datatrove(corpus: list[str]):
    """Seconds of datatrove's three filters over ``corpus``, and each filter's decisions."""
    from datatrove.data import Document
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )

    filters = {"gopher_repetition": GopherRepetitionFilter(),
               "gopher_quality": GopherQualityFilter(), "c4": C4QualityFilter()}
    decisions: list[dict[str, object]] = []
    with Clock() as clock:
        for i, text in enumerate(corpus):
            row = {}
            for name, f in filters.items():
                r = f.filter(Document(text=text, id=str(i)))  # C4 rewrites .text: fresh Document
                row[name] = True if r is True else (r[1] if isinstance(r, tuple) else False)
            decisions.append(row)
    return clock, decisions


def our_decisions(texts: list[str]) -> list[dict[str, object]]:
    """Per document and shared filter: True (keep) or the set of our rules that drop it."""
    from olmoflow.data.taggers import get_tagger
    from olmoflow.data.taggers.c4 import c4_measure

    g, c4 = get_tagger("gopher"), get_tagger("c4")
    rows = []
    for text in texts:
        _, gf = g.measure(text)
        _, cf, _ = c4_measure(text, c4.options)
        rep = {k for k in gf if k.startswith(("dup_", "top_")) or k == "empty"}
        qual = {"short_doc", "long_doc", "short_words", "long_words", "too_many_hashes",
                "too_many_ellipsis", "too_many_bullets", "too_many_end_ellipsis",
                "few_alpha_words", "few_stop_words"}
        rows.append({
            "gopher_repetition": True if not gf["repetition"] else {k for k in rep if gf[k]},
            "gopher_quality": True if not gf["quality"] else {k for k in qual if gf[k]},
            "c4": True if not cf["any"] else {k for k in cf if cf[k] and k != "any"},
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=50.0, help="input size in MB (default 50)")
    ap.add_argument("--core", type=int, default=0, help="the CPU core to pin to (default 0)")
    ap.add_argument("--keep", type=Path, help="keep the data run directory here")
    args = ap.parse_args()
    if not DATA.is_dir():
        raise SystemExit(f"../shared/data absent: {DATA}")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.core})

    texts = load_texts()
    root = args.keep or Path(tempfile.mkdtemp(prefix="data_speed_"))
    shutil.rmtree(root, ignore_errors=True)
    shards, corpus, size = build_corpus(texts, args.mb, root)
    mb, n = size / 1e6, len(corpus)
    print(f"input: {len(texts)} distinct web-crawl documents repeated to {n} documents, "
          f"{mb:.1f} MB, {len(shards)} shards; one core (#{args.core})")

    ours = run_ours(root, shards, corpus)
    dt_secs, dt_rows = run_datatrove(corpus)

    total = Clock()
    total.wall = sum(c.wall for c in ours.values())
    total.cpu = sum(c.cpu for c in ours.values())
    rows = [*(("olmoflow " + k, c) for k, c in ours.items()),
            ("olmoflow pipeline (all three)", total),
            ("datatrove gopher rep + quality + c4", dt_secs)]
    print("\nthroughput per core (CPU seconds; wall-clock seconds in brackets)")
    print(f"| {'system / step':38s} | {'CPU s':>7s} | {'wall s':>7s} | {'docs/s':>7s} | "
          f"{'MB/s':>5s} | {'MB/s wall':>9s} |")
    print(f"|{'-' * 40}|{'-' * 9}|{'-' * 9}|{'-' * 9}|{'-' * 7}|{'-' * 11}|")
    for name, c in rows:
        print(f"| {name:38s} | {c.cpu:7.1f} | {c.wall:7.1f} | {n / c.cpu:7.0f} | "
              f"{mb / c.cpu:5.2f} | {mb / c.wall:9.2f} |")

    # Agreement on the distinct documents (the repeats would only weight them).
    dt_distinct = dt_rows[: len(texts)]
    ours_rows = our_decisions(texts)
    print(f"\nkeep/drop agreement with datatrove on the {len(texts)} distinct documents:")
    for name in ("gopher_repetition", "gopher_quality", "c4"):
        causes = Counter()
        for d, o in zip(dt_distinct, ours_rows):
            if (d[name] is True) != (o[name] is True):
                theirs = "keep" if d[name] is True else str(d[name])
                mine = "keep" if o[name] is True else "+".join(sorted(o[name]))
                causes[f"datatrove {theirs} / ours {mine}"] += 1
        agree = 1 - sum(causes.values()) / len(texts)
        print(f"  {name:18s} {100 * agree:6.2f}%  ({sum(causes.values())} disagree)")
        for cause, k in causes.most_common():
            print(f"      {k:3d} x {cause}")
    tag = ours["tag (gopher + c4)"]
    ratio = dt_secs.cpu / tag.cpu
    print(f"\nfilters: olmoflow {mb / tag.cpu:.2f} MB/s vs datatrove {mb / dt_secs.cpu:.2f} MB/s "
          f"per core (wall-clock ratio {dt_secs.wall / tag.wall:.2f}); whole olmoflow pipeline "
          f"{mb / total.cpu:.2f} MB/s")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    print(f"ratio (ours/datatrove) = {ratio:.2f}")


if __name__ == "__main__":
    main()
