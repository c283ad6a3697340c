"""The ``tokenize`` stage: documents to OLMo-format token arrays, split into train and held-out.

Layout of ``out_dir``::

    train/part-00000.npy      raw little-endian token ids (no numpy header; OLMo's memmap format)
    train/part-00000.csv.gz   a row per document: start,end,id,source (token offsets, end exclusive)
    heldout/part-00000.npy
    heldout/part-00000.csv.gz
    meta.json                 dtype, vocab_size, eos/pad ids, tokens/documents/bytes/files per split

Every document is followed by EOS, and the EOS lies inside its ``[start, end)``. The dtype is uint16
when the vocabulary fits (``vocab_size <= 65536``), else uint32. Outputs are byte-identical across
reruns (gzip with mtime 0 and no file name in its header).

Held-out documents are chosen by a seeded hash of their id, so a document's split does not depend
on the order of the documents nor on how many processes tokenize them.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import hashlib
import heapq
import io
import itertools
from pathlib import Path

import numpy as np

from olmoflow.artifacts import StageResult, atomic_open, atomic_write_json, data_files
from olmoflow.data.config import TokenizeConfig
from olmoflow.data.documents import read_documents
from olmoflow.errors import OlmoflowError
from olmoflow.tokenizer import BaseTokenizer, Tokenizer

SPLITS = ("train", "heldout")
PART = "part-00000"
META = "meta.json"
CHUNK_DOCUMENTS = 1024  # texts per encode_batch call: big enough for tokenizers' threads


def token_dtype(vocab_size: int) -> np.dtype:
    """Little-endian uint16 when every id fits in 16 bits, else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def heldout_score(seed: int, doc_id: str) -> float:
    """A uniform number in [0, 1) from sha256 of ``f"{seed}:{doc_id}"``."""
    digest = hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def choose_heldout(
    scores: list[tuple[float, int]], fraction: float, max_documents: int
) -> set[int]:
    """Positions of the held-out documents, from ``(score, position)`` pairs of all documents.

    A document is held out when its score is below ``fraction``; if more than ``max_documents``
    qualify, those with the lowest scores are kept (so the choice does not depend on order). With
    two or more documents at least one is held out and at least one stays in train.
    """
    if len(scores) < 2:
        return set()  # a lone document is needed for training
    picked = heapq.nsmallest(max(max_documents, 1), (s for s in scores if s[0] < fraction))
    if not picked:
        picked = [min(scores)]
    if len(picked) == len(scores):
        picked.remove(max(picked))
    return {pos for _, pos in picked}


def tokenize(
    cfg: TokenizeConfig,
    docs_path: Path,
    tokenizer_dir: Path,
    out_dir: Path,
    seed: int,
    progress: bool = True,
    tokenizer: BaseTokenizer | None = None,
) -> StageResult:
    """Tokenize every document into ``out_dir/{train,heldout}`` (see the module docstring).

    Reads the documents twice: once to choose the held-out split, once to tokenize.
    ``tokenizer`` is the loaded tokenizer of ``tokenizer_dir`` when it is not the default BPE.

    Returns:
        StageResult; counts ``dtype``, ``vocab_size`` and ``{split}_tokens``, ``{split}_documents``,
        ``{split}_bytes`` (UTF-8 bytes of text) for each split.

    Raises:
        OlmoflowError: no documents, a missing tokenizer, or a bad ``heldout_fraction``.
    """
    docs_path, out_dir = Path(docs_path), Path(out_dir)
    if not 0.0 <= cfg.heldout_fraction <= 1.0:
        raise OlmoflowError(
            f"tokenize.heldout_fraction must be in [0, 1], got {cfg.heldout_fraction}"
        )
    tok = tokenizer if tokenizer is not None else Tokenizer.from_pretrained(tokenizer_dir)
    dtype = token_dtype(tok.vocab_size)
    eos = tok.eos_token_id

    docs = read_documents(docs_path)
    scores = [(heldout_score(seed, str(d["id"])), i) for i, d in enumerate(docs)]
    if not scores:
        raise OlmoflowError(f"no documents to tokenize in {docs_path}")
    heldout = choose_heldout(scores, cfg.heldout_fraction, cfg.heldout_max_documents)

    stats = {s: {"tokens": 0, "documents": 0, "bytes": 0} for s in SPLITS}
    paths = {s: (out_dir / s / f"{PART}.npy", out_dir / s / f"{PART}.csv.gz") for s in SPLITS}
    with contextlib.ExitStack() as stack:
        arrays, indexes = {}, {}
        for s in SPLITS:
            arrays[s] = stack.enter_context(atomic_open(paths[s][0], "wb"))
            raw = stack.enter_context(atomic_open(paths[s][1], "wb"))
            # filename="" and mtime=0 keep the gzip header free of temp names and times.
            gz = stack.enter_context(gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0))
            text = stack.enter_context(io.TextIOWrapper(gz, encoding="utf-8", newline=""))
            indexes[s] = csv.writer(text, lineterminator="\n")
        docs = enumerate(read_documents(docs_path))
        bar = _progress(len(scores), progress)
        while chunk := list(itertools.islice(docs, CHUNK_DOCUMENTS)):
            rows = tok.encode_batch([d["text"] for _, d in chunk], add_eos=True)
            for s in SPLITS:
                want = s == "heldout"
                mine = [(d, ids) for (i, d), ids in zip(chunk, rows) if (i in heldout) == want]
                if not mine:
                    continue
                st = stats[s]
                for d, ids in mine:
                    start = st["tokens"]
                    st["tokens"] += len(ids)
                    st["documents"] += 1
                    st["bytes"] += len(d["text"].encode("utf-8"))
                    indexes[s].writerow([start, st["tokens"], d["id"], d.get("source", "")])
                flat = itertools.chain.from_iterable(ids for _, ids in mine)
                arrays[s].write(np.fromiter(flat, dtype=dtype).tobytes())
            if bar is not None:
                bar.update(len(chunk))
        if bar is not None:
            bar.close()

    for s in SPLITS:
        check_part(paths[s][0], dtype, eos_token_id=eos)
    meta = {
        "dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "eos_token_id": eos,
        "pad_token_id": tok.pad_token_id,
        "splits": {
            s: {**stats[s], "files": [p.relative_to(out_dir).as_posix() for p in paths[s]]}
            for s in SPLITS
        },
    }
    atomic_write_json(out_dir / META, meta)
    counts: dict[str, int | str] = {"dtype": dtype.name, "vocab_size": tok.vocab_size}
    for s in SPLITS:
        counts.update({f"{s}_{k}": v for k, v in stats[s].items()})
    outputs = [p for s in SPLITS for p in paths[s]] + [out_dir / META]
    inputs = data_files(docs_path) + data_files(tokenizer_dir)
    return StageResult(inputs=inputs, outputs=outputs, counts=counts)


def read_token_array(path: str | Path, dtype: str | np.dtype) -> np.ndarray:
    """Memory-map a token file read-only: a 1-D ``np.memmap`` of ``dtype`` (an empty ndarray for an
    empty file, which cannot be mapped). Raises OlmoflowError if the file is missing or its size is
    not a multiple of the item size."""
    path, dtype = Path(path), np.dtype(dtype).newbyteorder("<")
    if not path.is_file():
        raise OlmoflowError(f"token file not found: {path}")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise OlmoflowError(f"token file {path} has {size} bytes, not a multiple of {dtype.name}")
    if size == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def read_index(path: str | Path) -> list[tuple[int, int, str, str]]:
    """Rows ``(start, end, id, source)`` of a ``.csv.gz`` document index. Raises OlmoflowError if
    the file is missing or a row is malformed."""
    path = Path(path)
    if not path.is_file():
        raise OlmoflowError(f"document index not found: {path}")
    out = []
    with gzip.open(path, "rt", encoding="utf-8", newline="") as f:
        for n, row in enumerate(csv.reader(f), 1):
            try:
                start, end, doc_id, source = row
                out.append((int(start), int(end), doc_id, source))
            except ValueError:
                raise OlmoflowError(f"{path}: row {n} is not start,end,id,source") from None
    return out


def check_part(npy_path: str | Path, dtype: str | np.dtype, eos_token_id: int | None = None) -> int:
    """Check a token file against its sibling ``.csv.gz`` index and return its token count.

    The documents must tile the array (each ``start`` is the previous ``end``, the last ``end`` is
    the token count) and, when ``eos_token_id`` is given, each must end with EOS.

    Raises:
        OlmoflowError: naming the first inconsistency.
    """
    npy_path = Path(npy_path)
    arr = read_token_array(npy_path, dtype)
    rows = read_index(npy_path.with_name(npy_path.name[: -len(".npy")] + ".csv.gz"))
    ends = np.array([r[1] for r in rows], dtype=np.int64)
    starts = np.array([r[0] for r in rows], dtype=np.int64)
    last = int(ends[-1]) if len(rows) else 0
    if last != len(arr):
        raise OlmoflowError(f"{npy_path}: {len(arr)} tokens but its index ends at {last}")
    if len(rows) and (starts[0] != 0 or np.any(starts[1:] != ends[:-1]) or np.any(ends <= starts)):
        raise OlmoflowError(f"{npy_path}: index rows do not tile the token array")
    if eos_token_id is not None and len(rows) and np.any(arr[ends - 1] != eos_token_id):
        raise OlmoflowError(f"{npy_path}: a document does not end with EOS ({eos_token_id})")
    return len(arr)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="tokenize", unit="doc")
