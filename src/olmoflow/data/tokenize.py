"""Token arrays: the ONE token writer (both flows), the held-out split, ``meta.json``, and the
reader :func:`open_token_dir`.

A tokens directory holds, for each split (``train``, ``heldout``), raw little-endian token arrays
(no numpy header; OLMo's memmap format) with a ``.csv.gz`` index beside each::

    train/part-00000.npy            the main flow (one part per split)
    train/<source>/<shard>.npy      the data engine (one part per mixed shard)
    train/....csv.gz                a row per document: start,end,id,source (token offsets)
    heldout/...                     the same for the held-out documents
    meta.json                       the schema below

``meta.json``: ``format`` (``"olmoflow-tokens"``), ``dtype``, ``vocab_size``, ``eos_token_id``,
``pad_token_id``, ``tokenizer`` (``path`` relative to the tokens directory when beside it, and
``implementation``), ``heldout`` (``seed``, ``fraction``, ``max_documents``) and ``splits``:
``{split: {tokens, documents, bytes, files: [{path, index, tokens, documents, bytes}]}}``.

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
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from olmoflow.artifacts import StageResult, atomic_open, atomic_write_json, data_files
from olmoflow.data.config import TokenizeConfig
from olmoflow.data.documents import read_documents
from olmoflow.errors import OlmoflowError
from olmoflow.tokenizer import BaseTokenizer, Tokenizer

SPLITS = ("train", "heldout")
FORMAT = "olmoflow-tokens"
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
    implementation: str = "bpe",
) -> StageResult:
    """Tokenize every document of one documents file into ``out_dir/{train,heldout}`` (the main
    flow's ``tokenize``; the data engine calls the same :func:`write_token_part` per shard).

    Reads the documents twice: once to choose the held-out split, once to tokenize.
    ``tokenizer`` is the loaded tokenizer of ``tokenizer_dir`` when it is not the default BPE;
    ``implementation`` is recorded in ``meta.json`` so a reader loads the same class.

    Returns:
        StageResult; counts ``dtype``, ``vocab_size`` and ``{split}_tokens``, ``{split}_documents``,
        ``{split}_bytes`` (UTF-8 bytes of text) for each split.

    Raises:
        OlmoflowError: no documents, a missing tokenizer, or a bad ``heldout_fraction``.
    """
    docs_path, out_dir = Path(docs_path), Path(out_dir)
    check_heldout_config(cfg.heldout_fraction, cfg.heldout_max_documents)
    tok = tokenizer if tokenizer is not None else Tokenizer.from_pretrained(tokenizer_dir)
    dtype = token_dtype(tok.vocab_size)

    scores = [(heldout_score(seed, str(d["id"])), i)
              for i, d in enumerate(read_documents(docs_path))]
    if not scores:
        raise OlmoflowError(f"no documents to tokenize in {docs_path}")
    heldout = choose_heldout(scores, cfg.heldout_fraction, cfg.heldout_max_documents)
    parts = part_paths(out_dir, PART)
    bar = _progress(len(scores), progress)
    stats = write_token_part(read_documents(docs_path), parts, tok, dtype, heldout,
                             where=str(docs_path), on_chunk=bar.update if bar else None)
    if bar is not None:
        bar.close()
    meta = write_meta(out_dir, tok, dtype, [parts], [stats], tokenizer_dir=tokenizer_dir,
                      implementation=implementation,
                      heldout={"seed": seed, "fraction": cfg.heldout_fraction,
                               "max_documents": cfg.heldout_max_documents})
    counts: dict[str, int | str] = {"dtype": dtype.name, "vocab_size": tok.vocab_size}
    for s in SPLITS:
        counts.update({f"{s}_{k}": meta["splits"][s][k] for k in ("tokens", "documents", "bytes")})
    outputs = [p for s in SPLITS for p in (parts[s], index_path(parts[s]))] + [out_dir / META]
    inputs = data_files(docs_path) + data_files(tokenizer_dir)
    return StageResult(inputs=inputs, outputs=outputs, counts=counts)


def check_heldout_config(fraction: float, max_documents: int, section: str = "tokenize") -> None:
    """Raise OlmoflowError naming the key when the held-out settings are out of range."""
    if not 0.0 <= fraction <= 1.0:
        raise OlmoflowError(f"{section}.heldout_fraction must be in [0, 1], got {fraction}")
    if max_documents < 0:
        raise OlmoflowError(f"{section}.heldout_max_documents must be >= 0, got {max_documents}")


def index_path(npy_path: str | Path) -> Path:
    """The ``.csv.gz`` index beside a ``.npy`` token file."""
    p = Path(npy_path)
    return p.with_name(p.name[: -len(".npy")] + ".csv.gz")


def part_paths(out_dir: str | Path, rel: str) -> dict[str, Path]:
    """``{split: out_dir/<split>/<rel>.npy}``: where one part of each split goes."""
    return {s: Path(out_dir) / s / f"{rel}.npy" for s in SPLITS}


def write_token_part(
    docs: Iterable[dict[str, Any]],
    paths: dict[str, Path],
    tok: BaseTokenizer,
    dtype: np.dtype,
    heldout: set[int],
    *,
    where: str = "",
    on_chunk: Callable[[int], Any] | None = None,
) -> dict[str, Any]:
    """Tokenize ``docs`` (in order) into one part of each split; the only token writer.

    Document ``i`` (0-based position in ``docs``) goes to ``heldout`` when ``i in heldout``, else
    to ``train``. Each split's part is ``paths[split]`` (raw ``dtype`` ids, EOS after every
    document) and its ``.csv.gz`` index beside it, written atomically and checked against each
    other (:func:`check_part`) before returning.

    Returns:
        ``{split: {tokens, documents, bytes}}`` (bytes: UTF-8 bytes of text) plus ``sources``:
        ``{source: {documents, tokens}}`` over both splits.

    Raises:
        OlmoflowError: a token id ``dtype`` cannot hold (``where`` names the input).
    """
    stats: dict[str, Any] = {s: {"tokens": 0, "documents": 0, "bytes": 0} for s in SPLITS}
    per_source: dict[str, dict[str, int]] = {}
    limit = np.iinfo(dtype).max
    with contextlib.ExitStack() as stack:
        arrays, indexes = {}, {}
        for s in SPLITS:
            arrays[s] = stack.enter_context(atomic_open(paths[s], "wb"))
            raw = stack.enter_context(atomic_open(index_path(paths[s]), "wb"))
            # filename="" and mtime=0 keep the gzip header free of temp names and times.
            gz = stack.enter_context(gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0))
            text = stack.enter_context(io.TextIOWrapper(gz, encoding="utf-8", newline=""))
            indexes[s] = csv.writer(text, lineterminator="\n")
        numbered = enumerate(docs)
        while chunk := list(itertools.islice(numbered, CHUNK_DOCUMENTS)):
            rows = tok.encode_batch([d["text"] for _, d in chunk], add_eos=True)
            for s in SPLITS:
                want = s == "heldout"
                mine = [(d, ids) for (i, d), ids in zip(chunk, rows) if (i in heldout) == want]
                if not mine:
                    continue
                st = stats[s]
                for d, ids in mine:
                    start = st["tokens"]
                    source = d.get("source", "")
                    st["tokens"] += len(ids)
                    st["documents"] += 1
                    st["bytes"] += len(d["text"].encode("utf-8"))
                    indexes[s].writerow([start, st["tokens"], d["id"], source])
                    per = per_source.setdefault(source, {"documents": 0, "tokens": 0})
                    per["documents"] += 1
                    per["tokens"] += len(ids)
                flat = np.fromiter(itertools.chain.from_iterable(ids for _, ids in mine),
                                   dtype=np.int64)
                if flat.size and int(flat.max()) > limit:
                    raise OlmoflowError(f"{where}: token id {int(flat.max())} does not fit "
                                        f"{dtype.name}; use tokenize.dtype uint32")
                arrays[s].write(flat.astype(dtype).tobytes())
            if on_chunk is not None:
                on_chunk(len(chunk))
    eos = tok.eos_token_id
    for s in SPLITS:
        check_part(paths[s], dtype, eos_token_id=eos)
    stats["sources"] = dict(sorted(per_source.items()))
    return stats


def write_meta(
    out_dir: str | Path,
    tok: BaseTokenizer,
    dtype: np.dtype,
    parts: list[dict[str, Path]],
    stats: list[dict[str, Any]],
    *,
    tokenizer_dir: str | Path,
    implementation: str,
    heldout: dict[str, Any],
) -> dict[str, Any]:
    """Write ``out_dir/meta.json`` (the schema in the module docstring) and return it.

    ``parts[i]`` are the paths :func:`write_token_part` wrote and ``stats[i]`` what it returned;
    parts are listed in this order, which is the order a reader concatenates them in.
    """
    out_dir = Path(out_dir)
    splits = {}
    for s in SPLITS:
        files = [{"path": p[s].relative_to(out_dir).as_posix(),
                  "index": index_path(p[s]).relative_to(out_dir).as_posix(),
                  **{k: st[s][k] for k in ("tokens", "documents", "bytes")}}
                 for p, st in zip(parts, stats)]
        splits[s] = {k: sum(f[k] for f in files) for k in ("tokens", "documents", "bytes")}
        splits[s]["files"] = files
    meta = {
        "format": FORMAT,
        "dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "tokenizer": {"path": _tokenizer_ref(out_dir, Path(tokenizer_dir)),
                      "implementation": implementation},
        "heldout": heldout,
        "splits": splits,
    }
    atomic_write_json(out_dir / META, meta)
    return meta


def _tokenizer_ref(out_dir: Path, tokenizer_dir: Path) -> str:
    """The tokenizer's path as ``meta.json`` records it: relative to the tokens directory when the
    two lie side by side in one run directory (the run moves as a whole), else absolute."""
    tok, out = tokenizer_dir.resolve(), out_dir.resolve()
    if tok.parent == out.parent or tok.is_relative_to(out):
        return os.path.relpath(tok, out)
    return str(tok)


@dataclass(frozen=True)
class TokenDir:
    """An opened tokens directory (either flow's): see :func:`open_token_dir`.

    Attributes:
        root: the directory.
        meta: its ``meta.json``.
        dtype: the token dtype (little-endian uint16 or uint32).
        train, heldout: the non-empty token arrays of each split, in concatenation order.
        tokenizer_dir: the directory of the tokenizer that made them.
        implementation: its class, as ``tokenizer.implementation`` spells it (``"bpe"``).
    """

    root: Path
    meta: dict[str, Any]
    dtype: np.dtype
    train: list[Path]
    heldout: list[Path]
    tokenizer_dir: Path
    implementation: str

    def split(self, name: str) -> list[Path]:
        """The token arrays of split ``name`` (``"train"`` or ``"heldout"``).

        Raises:
            OlmoflowError: another name, or a split without tokens.
        """
        if name not in SPLITS:
            from olmoflow.errors import unknown_name_error

            raise unknown_name_error("token split", name, SPLITS)
        paths = self.train if name == "train" else self.heldout
        if not paths:
            raise OlmoflowError(f"{self.root}: the {name} split holds no tokens")
        return paths

    def load_tokenizer(self, trusted: str = "bpe") -> BaseTokenizer:
        """The tokenizer that made these tokens (of its recorded implementation).

        A tokens directory may come from someone else, and an implementation other than the
        built-in ``bpe`` is code that would be imported: it is loaded only when it equals
        ``trusted`` (the one the user's own config names, ``tokenizer.implementation``).

        Raises:
            OlmoflowError: the recorded implementation is neither ``bpe`` nor ``trusted``.
        """
        from olmoflow.tokenizer import tokenizer_class

        if self.implementation not in ("bpe", trusted):
            raise OlmoflowError(
                f"{self.root / META} names tokenizer implementation '{self.implementation}', "
                "code that loading it would run; set tokenizer.implementation="
                f"{self.implementation} to trust it")
        return tokenizer_class(self.implementation).load(self.tokenizer_dir)


def open_token_dir(path: str | Path, implementation: str | None = None) -> TokenDir:
    """Open a tokens directory made by ``olmoflow tokenize`` or ``olmoflow data tokenize``.

    ``implementation`` is used when ``meta.json`` records none (directories written before it did:
    their tokenizer is ``../tokenizer``).

    Raises:
        OlmoflowError: one line naming what is missing: the directory, its ``meta.json``, a field
            of it, a token array, or the tokenizer directory.
    """
    root = Path(path)
    if not root.is_dir():
        raise OlmoflowError(f"'{root}' is not a tokens directory: no such directory")
    try:
        meta = json.loads((root / META).read_text())
    except OSError:
        raise OlmoflowError(f"'{root}' is not a tokens directory: no {META} (run 'olmoflow "
                            "tokenize' or 'olmoflow data tokenize' to make one)") from None
    except ValueError:
        raise OlmoflowError(f"{root / META}: not valid JSON; rerun tokenize") from None
    for key in ("dtype", "splits"):
        if key not in meta:
            raise OlmoflowError(f"{root / META} has no '{key}': not a tokens directory of this "
                                "olmoflow (rerun tokenize)")
    try:
        itemsize = np.dtype(meta["dtype"]).itemsize
    except TypeError:
        raise OlmoflowError(f"{root / META}: unknown dtype {meta['dtype']!r}; "
                            "rerun tokenize") from None
    arrays = {}
    for s in SPLITS:
        files = meta["splits"].get(s, {}).get("files", [])
        # Older main-flow directories list plain paths (array and index) instead of records.
        recs = [f if isinstance(f, dict) else {"path": f, "tokens": None}
                for f in files if isinstance(f, dict) or str(f).endswith(".npy")]
        arrays[s] = []
        for rec in recs:
            p = root / rec["path"]
            if not p.is_file():
                raise OlmoflowError(f"{root}: token array '{rec['path']}' listed in {META} is "
                                    "missing")
            size, want = p.stat().st_size, rec.get("tokens")
            # A cut or appended array would train silently on other tokens than the index says.
            if isinstance(want, int) and size != want * itemsize:
                raise OlmoflowError(f"{p}: {size} bytes, but {META} records {want} tokens "
                                    f"({want * itemsize} bytes): the array was damaged or changed; "
                                    "rerun tokenize")
            if want != 0 and size:
                arrays[s].append(p)
    tok_meta = meta.get("tokenizer") or {}
    tok_dir = root / tok_meta.get("path", "../tokenizer")
    if not tok_dir.is_dir():
        raise OlmoflowError(f"{root}: its tokenizer directory '{tok_dir}' is missing")
    return TokenDir(root=root, meta=meta, dtype=np.dtype(meta["dtype"]).newbyteorder("<"),
                    train=arrays["train"], heldout=arrays["heldout"],
                    tokenizer_dir=Path(os.path.normpath(tok_dir)),
                    implementation=tok_meta.get("implementation") or implementation or "bpe")


def check_token_dir(path: str | Path, expected_documents: int | None = None) -> dict[str, int]:
    """Check a tokens directory against its indexes and ``meta.json``.

    Every array must be tiled by its index rows with EOS ending each document
    (:func:`check_part`); its token and document counts must match ``meta.json``; and the total
    document count (both splits) must equal ``expected_documents`` when given (the documents that
    went in).

    Returns:
        ``{"tokens": n, "documents": m, "files": k}`` over both splits.

    Raises:
        OlmoflowError: naming the first mismatch.
    """
    root = Path(path)
    td = open_token_dir(root)
    meta = td.meta
    tokens = documents = files = 0
    for s in SPLITS:
        for rec in meta["splits"][s]["files"]:
            p = root / rec["path"]
            n = check_part(p, meta["dtype"], eos_token_id=meta["eos_token_id"])
            rows = len(read_index(index_path(p)))
            if n != rec["tokens"] or rows != rec["documents"]:
                raise OlmoflowError(f"{p}: {n} tokens / {rows} documents in the files but "
                                    f"{rec['tokens']} / {rec['documents']} in {META}")
            tokens, documents, files = tokens + n, documents + rows, files + 1
    want = sum(meta["splits"][s]["tokens"] for s in SPLITS), sum(
        meta["splits"][s]["documents"] for s in SPLITS)
    if (tokens, documents) != want:
        raise OlmoflowError(f"{root}: files hold {tokens} tokens / {documents} documents but "
                            f"{META} says {want[0]} / {want[1]}")
    if expected_documents is not None and documents != expected_documents:
        raise OlmoflowError(f"{root}: {documents} documents tokenized but "
                            f"{expected_documents} went in")
    return {"tokens": tokens, "documents": documents, "files": files}


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
    rows = read_index(index_path(npy_path))
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
