"""Dolma layout helpers shared by dedup, decontamination and the mixer.

A data run directory ``DIR`` holds ``documents/<source>/<shard>.jsonl.gz`` and, line-aligned with
each shard, ``attributes/<set>/<source>/<shard>.jsonl.gz`` (``{"id", "attributes"}`` per line; a
line that is not a usable document gets ``{"id": null, "attributes": {}}``). These helpers list the
shards in corpus order, map a shard to its attribute file, and read and write gzipped JSONL
deterministically (gzip mtime 0, so equal content gives equal bytes).
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from olmoflow.artifacts import atomic_open
from olmoflow.data.executor import run_shards
from olmoflow.errors import OlmoflowError

log = logging.getLogger(__name__)

DOCUMENTS_DIR = "documents"
ATTRIBUTES_DIR = "attributes"
MIXED_DIR = "mixed"
WORK_DIR = "work"
SHARD_SUFFIXES = (".jsonl.gz", ".json.gz", ".jsonl")
# Bad lines past this many per shard are counted but not listed (a broken file can have millions).
MAX_ERRORS_LISTED = 100

def document_shards(data_dir: str | os.PathLike, documents: str = DOCUMENTS_DIR) -> list[str]:
    """The documents shards of a data run, as paths relative to ``DIR/<documents>``, sorted.

    This order (source, then shard name) is the corpus order: dedup keeps the first copy in it and
    the mixer's total limits keep a prefix of it.

    Raises:
        OlmoflowError: ``DIR/<documents>`` is missing or holds no shard.
    """
    root = Path(data_dir) / documents
    if not root.is_dir():
        raise OlmoflowError(f"no documents directory '{root}' (run ingest first)")
    shards = sorted(
        p.relative_to(root).as_posix() for p in root.rglob("*")
        if p.is_file() and p.name.endswith(SHARD_SUFFIXES) and not p.name.startswith(".")
    )
    if not shards:
        raise OlmoflowError(f"no documents shards (*.jsonl.gz) under '{root}'")
    return shards


def shard_source(shard: str) -> str:
    """The source of a shard: its first directory (``"wiki/0000.jsonl.gz"`` → ``"wiki"``)."""
    return shard.split("/", 1)[0] if "/" in shard else ""


def shard_stem(shard: str) -> str:
    """A shard's path without its suffix (``"wiki/0000.jsonl.gz"`` → ``"wiki/0000"``)."""
    for suffix in SHARD_SUFFIXES:
        if shard.endswith(suffix):
            return shard[: -len(suffix)]
    return shard


def attribute_path(data_dir: str | os.PathLike, attribute_set: str, shard: str) -> Path:
    """``DIR/attributes/<attribute_set>/<shard stem>.jsonl.gz``: the attributes of one shard."""
    return Path(data_dir) / ATTRIBUTES_DIR / attribute_set / f"{shard_stem(shard)}.jsonl.gz"


def input_signature(path: str | os.PathLike) -> list[int | str]:
    """``[size, sha256]`` of a file: put in a task so a rewritten input makes a fresh task (its
    content, not its modification time: one rerun policy for both flows)."""
    from olmoflow.artifacts import sha256_file

    return [Path(path).stat().st_size, sha256_file(path)]


def text_bytes(text: str) -> int:
    """UTF-8 bytes of ``text`` (the data engine's unit of size)."""
    return len(text.encode("utf-8", "surrogatepass"))


def read_records(
    path: str | os.PathLike, *, strict: bool = False, errors: list[str] | None = None,
    quiet: bool = False,
) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """Yield ``(line_number, object)`` for each non-blank line of a (gzipped) JSONL file.

    A line that is not a JSON object yields ``(line_number, None)`` so that line-aligned files stay
    aligned; it is logged (unless ``quiet``: a second pass over a file already reported) and
    appended to ``errors`` as ``"path:line: reason"``. A damaged gzip stream ends the file the
    same way.

    Raises:
        OlmoflowError: ``path`` is missing; or, with ``strict``, at the first bad line.
    """
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    lineno = 0

    def bad(reason: str) -> None:
        msg = f"{path}:{lineno}: {reason}"
        if strict:
            raise OlmoflowError(msg)
        if errors is not None and len(errors) < MAX_ERRORS_LISTED:
            errors.append(msg)
        if not quiet:
            log.warning("%s", msg)

    try:
        f = opener(path, "rb")
    except FileNotFoundError:
        raise OlmoflowError(f"no such file: '{path}'") from None
    with f:
        try:
            for raw in f:
                lineno += 1
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw)
                except ValueError as e:
                    bad(f"not JSON ({getattr(e, 'msg', e)})")
                    yield lineno, None
                    continue
                if not isinstance(obj, dict):
                    bad(f"not a JSON object (a {type(obj).__name__})")
                    yield lineno, None
                    continue
                yield lineno, obj
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            bad(f"damaged gzip stream ({e or type(e).__name__}); rest of the file skipped")


def write_jsonl_gz(path: str | os.PathLike, rows: Iterable[dict[str, Any]]) -> int:
    """Write ``rows`` as gzipped JSONL, atomically and byte-deterministically; return the count."""
    n = 0
    with (
        atomic_open(path, "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) as gz,
    ):
        block: list[bytes] = []
        for row in rows:
            block.append(json.dumps(row, ensure_ascii=False).encode("utf-8", "surrogatepass")
                         + b"\n")
            n += 1
            if len(block) >= 1024:
                gz.write(b"".join(block))
                block = []
        gz.write(b"".join(block))
    return n


def doc_level(text: str, score: float) -> list[list[float]]:
    """A document-level attribute value: one span over the whole text, ``[[0, len, score]]``."""
    return [[0, len(text), score]]


RunJobs = Callable[..., list[dict[str, Any]]]


def local_runner(data_dir: str | os.PathLike, executor: str = "local", workers: int | None = None,
                 progress: bool = False) -> RunJobs:
    """A ``run_jobs(step, fn, tasks, phase="")`` over :func:`run_shards`, with done-markers in
    ``DIR/work/<step>/done[/<phase>]`` (the data engine passes its own)."""
    def run_jobs(step: str, fn: Callable, tasks: list[dict[str, Any]], *, phase: str = "",
                 **_: Any) -> list[dict[str, Any]]:
        done = Path(data_dir) / WORK_DIR / step / "done"
        return run_shards(fn, tasks, executor=executor, workers=workers,
                          done_dir=done / phase if phase else done,
                          desc=f"{step}/{phase}" if phase else step, progress=progress)
    return run_jobs


def flag_totals(attributes: Iterable[str],
                results: Iterable[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Documents and text bytes flagged per attribute, summed over the shard results' ``flagged``
    (dedup and decontamination report these in their manifests)."""
    totals = {a: {"documents": 0, "bytes": 0} for a in attributes}
    for r in results:
        for a, rec in r["flagged"].items():
            totals[a]["documents"] += rec["documents"]
            totals[a]["bytes"] += rec["bytes"]
    return totals


def run_global_step(data_dir: str | os.PathLike, attribute_set: str,
                    run: Callable[..., dict[str, Any]],
                    cfg: Any, *, executor: str, workers: int | None, strict: bool,
                    progress: bool) -> dict[str, Any]:
    """A global attribute step (dedup, decontamination) over a Dolma layout outside the engine:
    one task per ``DIR/documents`` shard writing ``DIR/attributes/<attribute_set>/...``, run by
    ``run(cfg, tasks, root, run_jobs, strict=)`` through :func:`local_runner`.

    Returns:
        ``run``'s ``counts`` plus ``errors`` and ``outputs`` (the attribute files), over all shards.
    """
    data_dir = Path(data_dir)
    tasks = [{"input": str(data_dir / DOCUMENTS_DIR / s),
              "output": str(attribute_path(data_dir, attribute_set, s))}
             for s in document_shards(data_dir)]
    res = run(cfg, tasks, data_dir, local_runner(data_dir, executor, workers, progress),
              strict=strict)
    return {**res["counts"], "errors": [e for r in res["results"] for e in r["errors"]],
            "outputs": [o for r in res["results"] for o in r["outputs"]]}
