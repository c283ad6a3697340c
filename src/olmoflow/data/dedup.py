"""Deduplication that keeps exactly one copy: exact, by a metadata key, paragraphs, MinHash LSH.

Dedup is a global step run as map → reduce → map (Dolma's and datatrove's shape):

1. *map* (one job per documents shard): hash each document's text (128-bit BLAKE2b), its key
   (e.g. ``metadata.url``), each paragraph (a line, stripped; 128-bit), and its MinHash signature
   over word n-gram shingles; write them to ``DIR/work/dedup/map/<task hash>.npz``.
2. *reduce* (in the driver): walk the corpus in its order (shard order, then line) and mark every
   copy after the first. Exact and key duplicates use ``np.unique`` (first occurrence wins).
   Near-duplicates are found greedily with ``datasketch.MinHashLSH``: a document is a
   near-duplicate when an earlier *kept* document's estimated Jaccard similarity is at least the
   threshold, otherwise it is kept and inserted into the index. Comparing only with kept
   documents keeps both promises: everything above the threshold of a kept document goes, nothing
   is removed for resembling a document that was itself removed, and deduplicating the output
   again finds nothing. A paragraph's kept copy is its first among the documents no
   document-level method flags, so dropping duplicate documents never loses a paragraph.
3. *map*: write the attribute set ``dedup`` line-aligned with each shard
   (``DIR/attributes/dedup/<shard>.jsonl.gz``):

   - ``dedup__exact``, ``dedup__<key>`` (``metadata.url`` → ``dedup__url``), ``dedup__minhash``:
     document-level, ``[[0, len(text), 1.0]]`` for a duplicate, ``[[0, len(text), 0.0]]`` otherwise;
   - ``dedup__paragraphs``: a span ``[start, end, 1.0]`` per duplicate paragraph, its newline
     included, so the mixer's ``remove_spans`` leaves no blank line behind.

Driver memory in the reduce: 16 bytes per document for exact and for key hashes, 40 per paragraph,
and ``4 * num_perm`` per document for MinHash (512 at 128 permutations) plus the LSH index of kept
documents. :func:`mixer_rules` gives the mixer settings that act on these attributes.

Shingles are the normalized (lowercased, ``\\w+``) words taken ``ngram`` at a time; their 32-bit
hashes come from :mod:`olmoflow.data.ngrams`, and datasketch turns them into signatures (its
``affine32`` permutations, seeded by ``minhash.seed``). References: Broder 1997 (MinHash);
Leskovec et al., *Mining of Massive Datasets* ch. 3 (LSH banding); Lee et al. 2022 (dedup for LMs).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from olmoflow.artifacts import atomic_open, sha256_file
from olmoflow.config import ConfigValueError, as_section, check_int64
from olmoflow.data.executor import task_key
from olmoflow.data.ngrams import digest128, ngram_hashes, unique_sorted, word_hashes, words
from olmoflow.data.shards import (
    WORK_DIR,
    RunJobs,
    doc_level,
    flag_totals,
    input_signature,
    read_records,
    run_global_step,
    text_bytes,
    write_jsonl_gz,
)
from olmoflow.errors import OlmoflowError

log = logging.getLogger(__name__)

ATTRIBUTE_SET = "dedup"
# ---------------------------------------------------------------------------------------------
# Config


@dataclasses.dataclass
class MinHashConfig:
    """Near-duplicate detection: Jaccard ``threshold`` over word ``ngram`` shingles, estimated from
    ``num_perm`` MinHash permutations drawn from ``seed``. ``bands`` x ``rows`` fixes the LSH
    banding (default: datasketch's optimum for the threshold).

    Raises:
        ConfigValueError: ``threshold`` outside (0, 1], ``ngram`` or ``num_perm`` below 1, only
            one of ``bands`` and ``rows``, ``bands * rows`` above ``num_perm``, or an integer
            that does not fit in 64 bits.
    """

    threshold: float = 0.8
    ngram: int = 5
    num_perm: int = 128
    seed: int = 1
    bands: int | None = None
    rows: int | None = None

    def __post_init__(self) -> None:
        check_int64(self)
        if not 0.0 < float(self.threshold) <= 1.0:  # written so that NaN fails too
            raise ConfigValueError("threshold", f"must be in (0, 1], got {self.threshold!r}")
        for k in ("ngram", "num_perm"):
            if getattr(self, k) < 1:
                raise ConfigValueError(k, f"must be a positive integer, got {getattr(self, k)!r}")
        if (self.bands is None) != (self.rows is None):
            raise ConfigValueError("", "give both bands and rows, or neither")
        if self.bands is not None and self.bands * self.rows > self.num_perm:
            raise ConfigValueError("", f"bands * rows ({self.bands * self.rows}) exceeds "
                                       f"num_perm ({self.num_perm})")


@dataclasses.dataclass
class DedupConfig:
    """Which duplicates to find (the data engine's ``dedup`` section). ``key`` is a dotted path
    into the document (``metadata.url``); paragraphs shorter than ``min_paragraph_chars`` (after
    stripping) are never duplicates; ``minhash: true`` takes :class:`MinHashConfig`'s defaults.

    Raises:
        ConfigValueError: ``min_paragraph_chars`` below 1, a ``key`` that is no dotted path or
            whose attribute name dedup uses already, or nothing enabled.
    """

    exact: bool = True
    key: str | None = None
    paragraphs: bool = False
    min_paragraph_chars: int = 1
    minhash: MinHashConfig | None = None

    @classmethod
    def upgrade_keys(cls, data: dict[str, Any], prefix: str) -> dict[str, Any]:
        """``minhash: true`` is MinHash with its defaults, ``minhash: false`` none."""
        if data.get("minhash") is True:
            data["minhash"] = {}
        elif data.get("minhash") is False:
            data["minhash"] = None
        return data

    def __post_init__(self) -> None:
        check_int64(self)
        if self.min_paragraph_chars < 1:
            raise ConfigValueError("min_paragraph_chars", "must be a positive integer, got "
                                                          f"{self.min_paragraph_chars!r}")
        if self.key is not None and not self.key.strip("."):
            raise ConfigValueError("key", "must be a dotted path such as 'metadata.url'")
        if self.key and key_attribute(self.key) in {f"{ATTRIBUTE_SET}__{n}" for n in
                                                    ("exact", "paragraphs", "minhash")}:
            raise ConfigValueError("key", f"'{self.key}' would be written as "
                                          f"{key_attribute(self.key)}, a name dedup already uses")
        if not (self.exact or self.key or self.paragraphs or self.minhash):
            raise ConfigValueError("", "nothing to do; enable exact, key, paragraphs or minhash")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def attributes(self) -> list[str]:
        """The attribute names this config writes, in a fixed order."""
        names = []
        if self.exact:
            names.append(f"{ATTRIBUTE_SET}__exact")
        if self.key:
            names.append(key_attribute(self.key))
        if self.paragraphs:
            names.append(f"{ATTRIBUTE_SET}__paragraphs")
        if self.minhash:
            names.append(f"{ATTRIBUTE_SET}__minhash")
        return names


def key_attribute(key: str) -> str:
    """The attribute name for key dedup: the key's last component (``metadata.url`` →
    ``dedup__url``)."""
    return f"{ATTRIBUTE_SET}__{key.rstrip('.').rsplit('.', 1)[-1]}"


def mixer_rules(cfg: DedupConfig | dict[str, Any]) -> dict[str, Any]:
    """The mixer settings that remove what ``cfg`` flags: ``{"attributes", "exclude",
    "remove_spans"}`` to merge into a :class:`olmoflow.data.mixer.MixConfig` mapping."""
    cfg = as_section(DedupConfig, cfg, "dedup.")
    doc_attrs = [a for a in cfg.attributes() if a != f"{ATTRIBUTE_SET}__paragraphs"]
    return {
        "attributes": [ATTRIBUTE_SET],
        "exclude": [{"attribute": a, "op": "==", "value": 1} for a in doc_attrs],
        "remove_spans": [f"{ATTRIBUTE_SET}__paragraphs"] if cfg.paragraphs else [],
    }


def _lookup(doc: dict[str, Any], key: str) -> Any:
    node: Any = doc
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def paragraphs(text: str, min_chars: int = 1) -> list[tuple[int, int, str]]:
    """``(start, end, stripped)`` for each line of ``text`` with at least ``min_chars`` characters
    after stripping; ``end`` includes the line's newline."""
    out = []
    start = 0
    n = len(text)
    while start < n:
        nl = text.find("\n", start)
        end = n if nl < 0 else nl + 1
        body = text[start:end].strip()
        if body and len(body) >= min_chars:
            out.append((start, end, body))
        start = end
    return out


def _identity(x: Any) -> Any:
    return x


class MinHashSigner:
    """MinHash signatures sharing one set of datasketch permutations (drawing them is slow)."""

    def __init__(self, mh: MinHashConfig):
        from datasketch import MinHash

        self.cfg = mh
        self._minhash = MinHash
        self._perms = MinHash(num_perm=mh.num_perm, seed=mh.seed).permutations
        self._cache: dict[str, int] = {}

    def __call__(self, text: str) -> np.ndarray | None:
        """uint32 signature of shape ``(num_perm,)``, or None for a text without words.

        A text shorter than ``ngram`` words is one shingle of all its words.
        """
        toks = words(text)
        if not toks:
            return None
        shingles = ngram_hashes(word_hashes(toks, self._cache), min(self.cfg.ngram, len(toks)))
        m = self._minhash(num_perm=self.cfg.num_perm, seed=self.cfg.seed, hashfunc=_identity,
                          permutations=self._perms, scheme="affine32")
        m.update_batch(unique_sorted(shingles >> np.uint64(32)).tolist())
        return m.hashvalues


def _bad_doc(doc: dict[str, Any] | None, where: str, strict: bool, errors: list[str]) -> bool:
    if doc is None:
        return True  # read_records has reported it
    if isinstance(doc.get("text"), str):
        return False
    msg = f"{where}: document without a string 'text'"
    if strict:
        raise OlmoflowError(msg)
    errors.append(msg)
    log.warning("%s", msg)
    return True


def _save_npz(path: str | os.PathLike, **arrays: np.ndarray) -> None:
    # numpy writes zip entries with a fixed timestamp, so equal arrays give equal bytes.
    with atomic_open(path, "wb") as f:
        np.savez(f, **arrays)


def dedup_map_shard(task: dict[str, Any]) -> dict[str, Any]:
    """Shard job, phase 1: hashes and signatures of one documents shard into ``task["output"]``.

    The ``.npz`` holds, per document line: ``valid`` (bool), ``exact`` and ``key`` ((n, 2) uint64
    128-bit hashes) with ``key_ok``, ``minhash`` ((n, num_perm) uint32) with ``minhash_ok``; and
    per paragraph: ``para_hash`` ((m, 2) uint64), ``para_doc``, ``para_start``, ``para_end``.
    """
    cfg: DedupConfig = task["config"]
    strict = bool(task.get("strict"))
    errors: list[str] = []
    valid, exact, keys, key_ok, sigs, sig_ok = [], [], [], [], [], []
    p_hash, p_doc, p_start, p_end = [], [], [], []
    signer = MinHashSigner(cfg.minhash) if cfg.minhash else None
    n_docs = n_bytes = 0
    for lineno, doc in read_records(task["documents"], strict=strict, errors=errors):
        i = len(valid)
        bad = _bad_doc(doc, f"{task['documents']}:{lineno}", strict, errors)
        valid.append(not bad)
        text = "" if bad else doc["text"]
        if not bad:
            n_docs += 1
            n_bytes += text_bytes(text)
        if cfg.exact:
            exact.append(exact_key(text))
        if cfg.key:
            value = None if bad else _lookup(doc, cfg.key)
            present = value is not None and value != ""
            keys.append(digest128(repr(value)) if present else (0, 0))
            key_ok.append(present)
        if cfg.paragraphs and not bad:
            for start, end, body in paragraphs(text, cfg.min_paragraph_chars):
                p_hash.append(digest128(body))
                p_doc.append(i)
                p_start.append(start)
                p_end.append(end)
        if signer is not None:
            sig = None if bad else signer(text)
            sig_ok.append(sig is not None)
            sigs.append(np.zeros(cfg.minhash.num_perm, np.uint32) if sig is None else sig)
    n = len(valid)
    arrays = {"valid": np.array(valid, dtype=bool)}
    if cfg.exact:
        arrays["exact"] = np.array(exact, dtype=np.uint64).reshape(n, 2)
    if cfg.key:
        arrays["key"] = np.array(keys, dtype=np.uint64).reshape(n, 2)
        arrays["key_ok"] = np.array(key_ok, dtype=bool)
    if cfg.paragraphs:
        arrays["para_hash"] = np.array(p_hash, dtype=np.uint64).reshape(len(p_hash), 2)
        arrays["para_doc"] = np.array(p_doc, dtype=np.int64)
        arrays["para_start"] = np.array(p_start, dtype=np.int64)
        arrays["para_end"] = np.array(p_end, dtype=np.int64)
    if cfg.minhash:
        arrays["minhash"] = (np.stack(sigs).astype(np.uint32) if sigs
                             else np.zeros((0, cfg.minhash.num_perm), np.uint32))
        arrays["minhash_ok"] = np.array(sig_ok, dtype=bool)
    _save_npz(task["output"], **arrays)
    return {"documents_in": n_docs, "bytes_in": n_bytes, "errors": errors,
            "outputs": [task["output"]]}


def exact_key(text: str) -> tuple[int, int]:
    """The exact-duplicate key of a document's text, as ``dedup.exact`` compares them (and the
    main flow's ``clean``): its 128-bit BLAKE2b, two 64-bit ints."""
    return digest128(text)


def _later_copies(rows: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Bool per row: True for every row whose value (a row of ``rows``) appeared at an earlier
    row with ``mask`` set. Rows without ``mask`` are never copies."""
    dup = np.zeros(len(rows), dtype=bool)
    idx = np.flatnonzero(mask)
    if len(idx):
        # np.unique sorts stably when asked for indices, so return_index is each first occurrence.
        _, first = np.unique(rows[idx], axis=0, return_index=True)
        later = np.ones(len(idx), dtype=bool)
        later[first] = False
        dup[idx] = later
    return dup


def _lsh(mh: MinHashConfig):
    """An empty ``datasketch.MinHashLSH`` for ``mh`` (banding from bands/rows or the optimum)."""
    from datasketch import MinHashLSH

    params = (mh.bands, mh.rows) if mh.bands else None
    try:
        return MinHashLSH(threshold=mh.threshold, num_perm=mh.num_perm, params=params)
    except ValueError as e:  # e.g. fewer than 2 bands for this threshold and num_perm
        raise OlmoflowError(f"dedup.minhash: {e}; change threshold, num_perm or bands/rows") \
            from None


def near_duplicates(sigs: np.ndarray, ok: np.ndarray, mh: MinHashConfig) -> np.ndarray:
    """Greedy MinHash-LSH near-duplicate marking in corpus order.

    Args:
        sigs: (n, num_perm) uint32 signatures, in corpus order.
        ok: (n,) bool, False for documents that take no part (no words, bad lines).
        mh: threshold, num_perm, seed and banding.

    Returns:
        (n,) bool: True where an earlier kept document has estimated Jaccard >= threshold.

    Raises:
        OlmoflowError: datasketch cannot band ``num_perm`` for ``threshold`` (fewer than 2 bands).
    """
    from datasketch import LeanMinHash

    lsh = _lsh(mh)
    dup = np.zeros(len(sigs), dtype=bool)
    for g in np.flatnonzero(ok):
        sig = sigs[g]
        lean = LeanMinHash(seed=mh.seed, hashvalues=sig, scheme="affine32")
        for c in lsh.query(lean):
            if np.count_nonzero(sigs[c] == sig) / mh.num_perm >= mh.threshold:
                dup[g] = True
                break
        else:
            lsh.insert(int(g), lean, check_duplication=False)
    return dup


def _reduce(cfg: DedupConfig, map_paths: list[str]) -> list[dict[str, np.ndarray]]:
    """Mark every copy after the first, over all shards in order; one dict of arrays per shard."""
    maps = [dict(np.load(p)) for p in map_paths]
    sizes = [len(m["valid"]) for m in maps]
    out: list[dict[str, np.ndarray]] = [{} for _ in maps]

    def split(name: str, flags: np.ndarray, lengths: list[int]) -> None:
        edges = np.cumsum([0] + lengths)
        for i in range(len(maps)):
            out[i][name] = flags[edges[i]: edges[i + 1]]

    valid = np.concatenate([m["valid"] for m in maps])
    doc_dup = np.zeros(len(valid), dtype=bool)
    if cfg.exact:
        flags = _later_copies(np.concatenate([m["exact"] for m in maps]), valid)
        doc_dup |= flags
        split("exact", flags, sizes)
    if cfg.key:
        ok = valid & np.concatenate([m["key_ok"] for m in maps])
        flags = _later_copies(np.concatenate([m["key"] for m in maps]), ok)
        doc_dup |= flags
        split("key", flags, sizes)
    if cfg.minhash:
        sigs = np.concatenate([m["minhash"] for m in maps])
        ok = valid & np.concatenate([m["minhash_ok"] for m in maps])
        flags = near_duplicates(sigs, ok, cfg.minhash)
        doc_dup |= flags
        split("minhash", flags, sizes)
    if cfg.paragraphs:
        rows = np.concatenate([m["para_hash"] for m in maps])
        para_doc = np.concatenate([m["para_doc"] + start for m, start in
                                   zip(maps, np.cumsum([0] + sizes[:-1]))]).astype(np.int64)
        # A paragraph's kept copy must lie in a document dedup keeps; otherwise removing the
        # document would take the paragraph's only surviving copy with it.
        in_kept = ~doc_dup[para_doc]
        flags = np.where(in_kept, _later_copies(rows, in_kept),
                         _later_copies(rows, np.ones(len(rows), dtype=bool)))
        split("paragraphs", flags, [len(m["para_hash"]) for m in maps])
    return out


def dedup_write_shard(task: dict[str, Any]) -> dict[str, Any]:
    """Shard job, phase 3: write the ``dedup`` attributes of one shard from the reduce's flags.

    Returns:
        ``documents_in``, ``bytes_in``, ``flagged`` ({attribute: {"documents", "bytes"}}; for
        ``dedup__paragraphs``, documents touched and bytes inside duplicate paragraphs) and
        ``outputs``.
    """
    cfg: DedupConfig = task["config"]
    maps = dict(np.load(task["map"]))
    flags = dict(np.load(task["reduce"]))
    names = cfg.attributes()
    flagged = {a: {"documents": 0, "bytes": 0} for a in names}
    para_edges = None
    if cfg.paragraphs:
        para_doc = maps["para_doc"]
        para_edges = np.searchsorted(para_doc, np.arange(len(maps["valid"]) + 1))
    doc_flags = []
    if cfg.exact:
        doc_flags.append((f"{ATTRIBUTE_SET}__exact", flags["exact"]))
    if cfg.key:
        doc_flags.append((key_attribute(cfg.key), flags["key"]))
    if cfg.minhash:
        doc_flags.append((f"{ATTRIBUTE_SET}__minhash", flags["minhash"]))
    stats = {"documents_in": 0, "bytes_in": 0}

    def rows():
        for i, (_, doc) in enumerate(read_records(task["documents"], quiet=True)):
            if not maps["valid"][i]:
                yield {"id": doc.get("id") if doc else None, "attributes": {}}
                continue
            text = doc["text"]
            nbytes = text_bytes(text)
            stats["documents_in"] += 1
            stats["bytes_in"] += nbytes
            attrs: dict[str, list] = {}
            for name, f in doc_flags:
                attrs[name] = doc_level(text, 1.0 if f[i] else 0.0)
                if f[i]:
                    flagged[name]["documents"] += 1
                    flagged[name]["bytes"] += nbytes
            if para_edges is not None:
                lo, hi = para_edges[i], para_edges[i + 1]
                dup = flags["paragraphs"][lo:hi]
                spans = [[int(s), int(e), 1.0] for s, e, d in
                         zip(maps["para_start"][lo:hi], maps["para_end"][lo:hi], dup) if d]
                attrs[f"{ATTRIBUTE_SET}__paragraphs"] = spans
                if spans:
                    rec = flagged[f"{ATTRIBUTE_SET}__paragraphs"]
                    rec["documents"] += 1
                    rec["bytes"] += sum(text_bytes(text[s:e]) for s, e, _ in spans)
            yield {"id": doc["id"], "attributes": {a: attrs[a] for a in names}}

    n = write_jsonl_gz(task["output"], rows())
    if n != len(maps["valid"]):
        raise OlmoflowError(f"'{task['documents']}' changed during dedup ({n} lines now, "
                            f"{len(maps['valid'])} when hashed); rerun dedup")
    return {**stats, "flagged": flagged, "outputs": [task["output"]]}


def run_dedup(cfg: DedupConfig | dict[str, Any] | None, tasks: list[dict[str, Any]],
              root: str | os.PathLike, run_jobs: RunJobs, *, strict: bool = False
              ) -> dict[str, Any]:
    """Deduplicate the documents shards of ``tasks`` (map → reduce → map).

    Args:
        cfg: a :class:`DedupConfig` or its mapping.
        tasks: one per documents shard, in corpus order: ``{"input": documents path,
            "output": attribute file to write, ...}`` (other keys are kept in the results).
        root: the data run directory; intermediate files go to ``root/work/dedup``.
        run_jobs: ``run_jobs(step, fn, tasks, phase=...)`` runs shard jobs in order (e.g. the
            engine's, or :func:`olmoflow.data.shards.local_runner`).
        strict: raise at the first bad line instead of counting it.

    Returns:
        ``{"results": per-task stats (``documents_in``, ``bytes_in``, ``flagged``, ``errors``:
        bad lines as ``file:line: reason``, ``outputs``), "counts": documents_in, bytes_in,
        flagged per attribute, attributes}``.

    Raises:
        OlmoflowError: bad config; bad lines when ``strict``.
    """
    cfg = as_section(DedupConfig, cfg, "dedup.")
    if cfg.minhash:
        _lsh(cfg.minhash)  # a banding error now, not after hashing the corpus
    work = Path(root) / WORK_DIR / ATTRIBUTE_SET
    map_tasks = []
    for t in tasks:
        mt = {"step": "dedup-map", "documents": str(t["input"]),
              "input_sig": input_signature(t["input"]), "config": cfg, "strict": strict}
        # Named by the task's hash: a marker can never vouch for another config's hashes.
        map_tasks.append({**mt, "output": str(work / "map" / f"{task_key(mt)}.npz")})
    map_results = run_jobs(ATTRIBUTE_SET, dedup_map_shard, map_tasks, phase="map")
    write_tasks = []
    for i, (t, mt, flags) in enumerate(zip(tasks, map_tasks,
                                           _reduce(cfg, [m["output"] for m in map_tasks]))):
        reduce_path = work / "reduce" / f"{i:05d}.npz"
        _save_npz(reduce_path, **flags)
        write_tasks.append({
            "step": "dedup-write", "documents": mt["documents"], "input_sig": mt["input_sig"],
            "map": mt["output"], "reduce": str(reduce_path),
            "reduce_sha256": sha256_file(reduce_path), "output": str(t["output"]),
            "config": cfg,
        })
    results = run_jobs(ATTRIBUTE_SET, dedup_write_shard, write_tasks, phase="write")
    # Bad lines are found while hashing; report them with the shard's final stats.
    results = [{**r, "errors": m.get("errors", [])} for r, m in zip(results, map_results)]
    flagged = flag_totals(cfg.attributes(), results)
    counts = {
        "documents_in": sum(r["documents_in"] for r in results),
        "bytes_in": sum(r["bytes_in"] for r in results),
        "flagged": flagged,
        "attributes": cfg.attributes(),
    }
    return {"results": results, "counts": counts}


def dedup(
    data_dir: str | os.PathLike,
    cfg: DedupConfig | dict[str, Any] | None = None,
    *,
    executor: str = "local",
    workers: int | None = None,
    strict: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Find duplicates in ``DIR/documents`` and write ``DIR/attributes/dedup`` (all shards).

    :func:`run_dedup` over the Dolma layout, its shard jobs run by
    :func:`olmoflow.data.executor.run_shards` with markers in ``DIR/work/dedup/done``. The same
    corpus gives byte-identical attribute files whatever ``executor`` and ``workers``.

    Returns:
        :func:`run_dedup`'s ``counts`` plus ``errors`` and ``outputs`` (the attribute files).

    Raises:
        OlmoflowError: bad config, no documents, and bad lines when ``strict``.
    """
    return run_global_step(data_dir, ATTRIBUTE_SET, run_dedup, cfg, executor=executor,
                           workers=workers, strict=strict, progress=progress)
