"""Parallel tokenization for the data engine: one shard job per documents shard.

Each job turns ``<shard>.jsonl.gz`` into OLMo's format (as :mod:`olmoflow.data.tokenize` writes
for the simple flow):

    tokens/<source>/<shard>.npy      raw little-endian token ids, EOS appended to every document
    tokens/<source>/<shard>.csv.gz   one ``start,end,id,source`` row per document (end exclusive)

and the step finishes with ``tokens/meta.json`` (dtype, vocab size, EOS id, totals and the files
in shard order) after :func:`check_tokens` has checked every array against its index. The files
depend only on the shard's documents and the tokenizer, so any number of workers, and Ray, give
byte-identical output (gzip with mtime 0 and no file name).
"""

from __future__ import annotations

import csv
import functools
import gzip
import io
import itertools
from pathlib import Path
from typing import Any

import numpy as np

from olmoflow.artifacts import atomic_open, atomic_write_json
from olmoflow.data.documents import read_documents
from olmoflow.data.tokenize import CHUNK_DOCUMENTS, check_part, read_index, token_dtype
from olmoflow.errors import OlmoflowError

META = "meta.json"
DTYPES = ("auto", "uint16", "uint32")


def load_tokenizer(tokenizer_dir: str, implementation: str = "bpe"):
    """The tokenizer saved in ``tokenizer_dir`` (loaded once per worker process, and again when
    its files change: a run that retrains ``DIR/tokenizer`` in a process that tokenized before
    must not encode with the old one).

    Raises:
        OlmoflowError: no ``tokenizer.json`` there (or the implementation's files), or an unknown
            implementation.
    """
    from olmoflow.artifacts import data_files

    stamp = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns)
                  for f in data_files(tokenizer_dir)) if Path(tokenizer_dir).exists() else ()
    return _load_tokenizer(tokenizer_dir, implementation, stamp)


@functools.lru_cache(maxsize=4)
def _load_tokenizer(tokenizer_dir: str, implementation: str, stamp: tuple):
    from olmoflow.tokenizer import tokenizer_class

    return tokenizer_class(implementation).load(tokenizer_dir)


def resolve_dtype(name: str, vocab_size: int) -> np.dtype:
    """``auto`` is uint16 when the vocabulary fits in 16 bits, else uint32 (little-endian).

    Raises:
        OlmoflowError: unknown name, or uint16 for a vocabulary larger than 65,536.
    """
    if name not in DTYPES:
        from olmoflow.errors import unknown_name_error

        raise unknown_name_error("tokenize.dtype", name, DTYPES)
    if name == "auto":
        return token_dtype(vocab_size)
    if name == "uint16" and vocab_size > 1 << 16:
        raise OlmoflowError(f"tokenize.dtype uint16 cannot hold a vocabulary of {vocab_size}")
    return np.dtype("<u2" if name == "uint16" else "<u4")


def index_path(npy_path: str | Path) -> Path:
    """The ``.csv.gz`` index beside a ``.npy`` token file."""
    p = Path(npy_path)
    return p.with_name(p.name[: -len(".npy")] + ".csv.gz")


def tokenize_shard(task: dict[str, Any]) -> dict[str, Any]:
    """Shard job: tokenize one documents shard into a token array and its index.

    Task keys: ``input`` (a ``.jsonl.gz`` documents shard), ``output`` (the ``.npy`` path; the
    index goes beside it), ``tokenizer`` (a directory), ``implementation`` (default ``"bpe"``) and
    ``dtype`` (``auto``/``uint16``/``uint32``).

    Returns:
        ``documents_in``, ``documents_out`` (equal: nothing is dropped here), ``bytes_in`` (UTF-8
        bytes of text), ``tokens``, ``outputs``, and ``sources``: ``{source: {documents, tokens}}``.

    Raises:
        OlmoflowError: an unreadable shard or tokenizer, or a token id the dtype cannot hold.
    """
    tok = load_tokenizer(task["tokenizer"], task.get("implementation", "bpe"))
    dtype = resolve_dtype(task.get("dtype", "auto"), tok.vocab_size)
    npy, idx = Path(task["output"]), index_path(task["output"])
    docs = read_documents(task["input"])
    n_docs = n_tokens = n_bytes = 0
    per_source: dict[str, dict[str, int]] = {}
    with atomic_open(npy, "wb") as arr, atomic_open(idx, "wb") as raw, \
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz, \
            io.TextIOWrapper(gz, encoding="utf-8", newline="") as text:
        index = csv.writer(text, lineterminator="\n")
        while chunk := list(itertools.islice(docs, CHUNK_DOCUMENTS)):
            rows = tok.encode_batch([d["text"] for d in chunk], add_eos=True)
            for d, ids in zip(chunk, rows):
                source = d.get("source", "")
                index.writerow([n_tokens, n_tokens + len(ids), d["id"], source])
                n_tokens += len(ids)
                n_docs += 1
                n_bytes += len(d["text"].encode("utf-8"))
                s = per_source.setdefault(source, {"documents": 0, "tokens": 0})
                s["documents"] += 1
                s["tokens"] += len(ids)
            flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64)
            if flat.size and int(flat.max()) > np.iinfo(dtype).max:
                raise OlmoflowError(f"{task['input']}: token id {int(flat.max())} does not fit "
                                    f"{dtype.name}; use tokenize.dtype uint32")
            arr.write(flat.astype(dtype).tobytes())
    return {"documents_in": n_docs, "documents_out": n_docs, "bytes_in": n_bytes,
            "tokens": n_tokens, "sources": dict(sorted(per_source.items())),
            "outputs": [str(npy), str(idx)]}


def write_meta(out_dir: Path, tokenizer, dtype: np.dtype, parts: list[Path],
               results: list[dict[str, Any]]) -> dict[str, Any]:
    """Write ``out_dir/meta.json``: dtype, vocab size, EOS/pad ids, and per file (in shard order)
    its token and document counts; return it."""
    meta = {
        "dtype": dtype.name,
        "vocab_size": tokenizer.vocab_size,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tokens": sum(r["tokens"] for r in results),
        "documents": sum(r["documents_out"] for r in results),
        "files": [{"path": p.relative_to(out_dir).as_posix(), "tokens": r["tokens"],
                   "documents": r["documents_out"]} for p, r in zip(parts, results)],
    }
    atomic_write_json(out_dir / META, meta)
    return meta


def check_tokens(out_dir: str | Path, expected_documents: int | None = None) -> dict[str, int]:
    """Check a tokens directory against its indexes and ``meta.json``.

    Every array must be tiled by its index rows with EOS ending each document
    (:func:`olmoflow.data.tokenize.check_part`); its token and document counts must match
    ``meta.json``; and the total document count must equal ``expected_documents`` when given
    (the documents that went in).

    Returns:
        ``{"tokens": n, "documents": m, "files": k}``.

    Raises:
        OlmoflowError: naming the first mismatch.
    """
    import json

    out_dir = Path(out_dir)
    try:
        meta = json.loads((out_dir / META).read_text())
    except (OSError, ValueError):
        raise OlmoflowError(f"{out_dir / META} is missing or unreadable; rerun tokenize") from None
    tokens = documents = 0
    for rec in meta["files"]:
        path = out_dir / rec["path"]
        n = check_part(path, meta["dtype"], eos_token_id=meta["eos_token_id"])
        rows = len(read_index(index_path(path)))
        if n != rec["tokens"] or rows != rec["documents"]:
            raise OlmoflowError(f"{path}: {n} tokens / {rows} documents in the files but "
                                f"{rec['tokens']} / {rec['documents']} in {META}")
        tokens += n
        documents += rows
    if tokens != meta["tokens"] or documents != meta["documents"]:
        raise OlmoflowError(f"{out_dir}: files hold {tokens} tokens / {documents} documents but "
                            f"{META} says {meta['tokens']} / {meta['documents']}")
    if expected_documents is not None and documents != expected_documents:
        raise OlmoflowError(f"{out_dir}: {documents} documents tokenized but "
                            f"{expected_documents} went in")
    return {"tokens": tokens, "documents": documents, "files": len(meta["files"])}
