"""Parallel tokenization for the data engine: one shard job per mixed documents shard.

Each job turns ``mixed/<source>/<shard>.jsonl.gz`` into one part of each split, with the same
writer the main flow's ``tokenize`` uses (:func:`olmoflow.data.tokenize.write_token_part`)::

    tokens/train/<source>/<shard>.npy (+ .csv.gz)     the shard's training documents
    tokens/heldout/<source>/<shard>.npy (+ .csv.gz)   its held-out documents (often none)

The driver chooses the held-out documents over the whole corpus first (the main flow's seeded
per-document rule) and hands each job the positions of its shard's; the step finishes with the one
``tokens/meta.json`` schema after :func:`~olmoflow.data.tokenize.check_token_dir`. The files depend
only on the shard's documents, the held-out choice and the tokenizer, so any number of workers,
and Ray, give byte-identical output (gzip with mtime 0 and no file name).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from olmoflow.data.documents import read_documents
from olmoflow.data.tokenize import SPLITS, index_path, token_dtype, write_token_part
from olmoflow.errors import OlmoflowError

DTYPES = ("auto", "uint16", "uint32")


def load_tokenizer(tokenizer_dir: str, implementation: str = "bpe"):
    """The tokenizer saved in ``tokenizer_dir`` (loaded once per worker process, and again when
    its files' content changes: a run that retrains ``DIR/tokenizer`` in a process that tokenized
    before must not encode with the old one).

    Raises:
        OlmoflowError: no ``tokenizer.json`` there (or the implementation's files), or an unknown
            implementation.
    """
    from olmoflow.artifacts import data_files, sha256_file

    stamp = tuple((str(f), sha256_file(f))
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


def tokenize_shard(task: dict[str, Any]) -> dict[str, Any]:
    """Shard job: tokenize one documents shard into a part of each split.

    Task keys: ``input`` (a ``.jsonl.gz`` documents shard), ``parts`` (``{split: .npy path}``;
    each index goes beside its array), ``heldout`` (positions in the shard of its held-out
    documents), ``tokenizer`` (a directory), ``implementation`` (default ``"bpe"``) and ``dtype``
    (``auto``/``uint16``/``uint32``).

    Returns:
        ``documents_in``, ``documents_out`` (equal: nothing is dropped here), ``bytes_in`` (UTF-8
        bytes of text), ``tokens``, ``splits`` (``{split: {tokens, documents, bytes}}``),
        ``outputs`` and ``sources``: ``{source: {documents, tokens}}``.

    Raises:
        OlmoflowError: an unreadable shard or tokenizer, or a token id the dtype cannot hold.
    """
    tok = load_tokenizer(task["tokenizer"], task.get("implementation", "bpe"))
    dtype = resolve_dtype(task.get("dtype", "auto"), tok.vocab_size)
    parts = {s: Path(task["parts"][s]) for s in SPLITS}
    stats = write_token_part(read_documents(task["input"]), parts, tok, dtype,
                             set(task.get("heldout") or ()), where=str(task["input"]))
    n_docs = sum(stats[s]["documents"] for s in SPLITS)
    return {"documents_in": n_docs, "documents_out": n_docs,
            "bytes_in": sum(stats[s]["bytes"] for s in SPLITS),
            "tokens": sum(stats[s]["tokens"] for s in SPLITS),
            "splits": {s: stats[s] for s in SPLITS}, "sources": stats["sources"],
            "outputs": [str(p) for s in SPLITS for p in (parts[s], index_path(parts[s]))]}
