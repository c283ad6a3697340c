"""The ``collect`` stage: gather raw documents from sources into one Dolma documents file.

A source is ``"stdlib"`` (the running Python's standard library, an offline default corpus) or a
file, directory or glob of ``.txt`` (one document per file), ``.jsonl``, ``.jsonl.gz`` or
``.json.gz`` (Dolma's name for gzipped JSONL; one document per line) files. User data is read
tolerantly: malformed lines, invalid UTF-8 and damaged gzip files are skipped, counted and logged,
unless ``strict`` asks for an error instead.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import itertools
import logging
import os
import sys
import sysconfig
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from olmoflow.artifacts import StageResult
from olmoflow.config import CollectConfig
from olmoflow.data.documents import (
    DOCUMENTS,
    jsonl_document,
    parse_jsonl_line,
    write_documents,
)
from olmoflow.errors import OlmoflowError

log = logging.getLogger(__name__)

STDLIB = "stdlib"
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz")
SUFFIXES = (".txt", *JSONL_SUFFIXES)
_TEST_DIRS = {"test", "tests", "idle_test"}
_VENDOR_DIRS = {"site-packages", "dist-packages"}
_GZ_DAMAGE = (EOFError, gzip.BadGzipFile, zlib.error)
# Past this many warnings per file, one summary line replaces the rest (a broken file can have
# millions of bad lines).
_MAX_WARNINGS_PER_FILE = 5


@dataclasses.dataclass(frozen=True)
class _Task:
    """One unit of reading: a file (kind "py", "txt", "jsonl") or the pydoc topics ("topics")."""

    kind: str
    path: Path | None
    name: str  # stable, machine-independent name: the id prefix and what the logs show
    source: str


@dataclasses.dataclass
class _Tally:
    documents: int = 0
    bytes: int = 0
    skipped_malformed: int = 0
    skipped_undecodable: int = 0
    damaged_files: int = 0
    files: int = 0
    per_source: Counter = dataclasses.field(default_factory=Counter)
    inputs: list[Path] = dataclasses.field(default_factory=list)


def python_version() -> str:
    """The running Python's version (``3.11.7``): the stdlib corpus depends on it."""
    return sys.version.split()[0]


def _suffix(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def _is_stdlib_part(name: str) -> bool:
    """False for test suites and third-party packages, which are not the stdlib's own code."""
    stem = name[:-3] if name.endswith(".py") else name
    return not (stem in _TEST_DIRS or stem.startswith("test_") or name in _VENDOR_DIRS)


def _stdlib_tasks() -> list[_Task]:
    """One task per module source of the running Python's stdlib, sorted, then the topics."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = []
    for top, dirs, files in os.walk(root):
        # Pruning here skips site-packages, which can be far larger than the stdlib itself.
        dirs[:] = [d for d in dirs if _is_stdlib_part(d) and d != "__pycache__"]
        rel_top = Path(top).relative_to(root)
        rels += [(rel_top / f).as_posix() for f in files if f.endswith(".py") and _is_stdlib_part(f)]
    tasks = [_Task("py", root / rel, f"stdlib/{rel}", "stdlib") for rel in sorted(rels)]
    return tasks + [_Task("topics", None, "pydoc_topics", "pydoc_topics")]


def _dir_files(directory: Path) -> list[Path]:
    """Supported files under ``directory``, recursively, sorted; hidden files and dirs skipped."""
    found = []
    for p in directory.rglob("*"):
        rel = p.relative_to(directory)
        if p.is_file() and _suffix(p) and not any(s.startswith(".") for s in rel.parts):
            found.append(p)
    return sorted(found, key=lambda p: p.relative_to(directory).as_posix())


def _absolute(path: str) -> Path:
    # abspath, not resolve: ".." is normalized (names stay clean) but symlinks are not followed.
    return Path(os.path.abspath(path))


def _expand(entry: str) -> list[tuple[Path, Path]]:
    """``(file, root)`` pairs for one user source; ``root`` anchors the file's stable name.

    Raises:
        OlmoflowError: nothing matches, an explicit file has an unsupported type, or a directory or
            glob holds no supported file.
    """
    text = os.path.expanduser(entry)
    wild = [i for i, c in enumerate(text) if c in "*?["]
    kinds = ", ".join(SUFFIXES)
    if wild:
        matches = sorted(glob.glob(text, recursive=True))
        if not matches:
            raise OlmoflowError(f"no such file or directory: '{entry}'")
        root = _absolute(os.path.dirname(text[: wild[0]]) or ".")
        files = []
        for m in map(_absolute, matches):
            files += _dir_files(m) if m.is_dir() else [m] if m.is_file() and _suffix(m) else []
        if not files:
            raise OlmoflowError(f"no {kinds} files match '{entry}'")
        return [(f, root) for f in files]
    path = _absolute(text)
    if path.is_dir():
        files = _dir_files(path)
        if not files:
            raise OlmoflowError(f"no {kinds} files in directory '{entry}'")
        return [(f, path) for f in files]
    if path.is_file():
        if not _suffix(path):
            raise OlmoflowError(f"unsupported file type '{entry}': expected one of {kinds}")
        return [(path, path.parent)]
    raise OlmoflowError(f"no such file or directory: '{entry}'")


def _plan(entries: list[str]) -> list[_Task]:
    """All reading tasks, in a deterministic order; a file named twice is read once."""
    tasks: list[_Task] = []
    seen: set[Any] = set()
    for entry in entries:
        if entry == STDLIB:
            if STDLIB not in seen:
                seen.add(STDLIB)
                tasks += _stdlib_tasks()
            continue
        for path, root in _expand(entry):
            if path.resolve() in seen:
                continue
            seen.add(path.resolve())
            label = root.name or "user"
            name = f"{label}/{path.relative_to(root).as_posix()}"
            kind = "txt" if _suffix(path) == ".txt" else "jsonl"
            tasks.append(_Task(kind, path, name, label))
    return tasks


def source_files(entries: list[str]) -> list[Path]:
    """The user files ``collect`` reads for ``entries`` (``"stdlib"`` entries contribute none), in
    reading order. Raises OlmoflowError like :func:`collect` for a source that matches nothing."""
    return [t.path for t in _plan([e for e in entries if e != STDLIB])]


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise OlmoflowError(f"cannot read '{path}': {e.strerror or e}") from None


def _whole_file_doc(task: _Task, cfg: CollectConfig, tally: _Tally) -> Iterator[dict[str, Any]]:
    """One document from a whole ``.py`` or ``.txt`` file; undecodable files are skipped."""
    data = _read_bytes(task.path)
    try:
        text = data.decode("utf-8-sig")  # -sig: drop a byte-order mark (common in .txt)
    except UnicodeDecodeError as e:
        if cfg.strict and task.kind == "txt":
            raise OlmoflowError(f"{task.path}: invalid UTF-8 at byte {e.start}") from None
        log.warning("%s: invalid UTF-8 at byte %d; file skipped", task.path, e.start)
        tally.skipped_undecodable += 1
        return
    meta: dict[str, Any] = {"path": task.name.split("/", 1)[1]}
    if task.kind == "py":
        meta["python"] = python_version()
    yield {"id": task.name, "text": text, "source": task.source, "metadata": meta}


def _topic_docs() -> Iterator[dict[str, Any]]:
    """The prose of the language reference (``pydoc_data.topics``), one document per topic."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        log.warning("pydoc_data.topics is not available in this Python; its topics are skipped")
        return
    for name in sorted(topics):
        meta = {"topic": name, "python": python_version()}
        yield {"id": f"pydoc_topics/{name}", "text": topics[name], "source": "pydoc_topics",
               "metadata": meta}


def _jsonl_docs(task: _Task, cfg: CollectConfig, tally: _Tally) -> Iterator[dict[str, Any]]:
    """Documents of one JSONL file; bad lines and gzip damage are counted (errors when strict)."""
    gz = task.path.name.lower().endswith(".gz")
    bad = 0
    try:
        with (gzip.open if gz else open)(task.path, "rb") as f:
            # A line cut by gzip damage is never seen: readline raises before returning it.
            for lineno, raw in enumerate(f, 1):
                if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]  # a UTF-8 byte-order mark (Windows editors) is not part of the JSON
                if not raw.strip():
                    continue
                obj, reason = parse_jsonl_line(raw, cfg.text_field)
                if obj is not None:
                    meta = {"path": task.name.split("/", 1)[1], "line": lineno}
                    yield jsonl_document(
                        obj, cfg.text_field, f"{task.name}:{lineno}", task.source, meta
                    )
                    continue
                if cfg.strict:
                    raise OlmoflowError(f"{task.path}:{lineno}: malformed JSONL: {reason}")
                bad += 1
                if reason.startswith("invalid UTF-8"):
                    tally.skipped_undecodable += 1
                else:
                    tally.skipped_malformed += 1
                if bad <= _MAX_WARNINGS_PER_FILE:
                    log.warning("%s:%d: malformed JSONL, skipped: %s", task.path, lineno, reason)
    except _GZ_DAMAGE as e:
        if cfg.strict:
            raise OlmoflowError(f"damaged gzip file '{task.path}': {e}") from None
        tally.damaged_files += 1
        log.warning("%s: damaged gzip file (%s); kept the documents before it", task.path, e)
    except OSError as e:
        raise OlmoflowError(f"cannot read '{task.path}': {e.strerror or e}") from None
    if bad > _MAX_WARNINGS_PER_FILE:
        log.warning("%s: %d malformed lines skipped in all", task.path, bad)


def _task_docs(task: _Task, cfg: CollectConfig, tally: _Tally) -> Iterator[dict[str, Any]]:
    if task.kind == "topics":
        return _topic_docs()
    # Every file read is hashed into the manifest, stdlib modules too: that is what lets a release
    # be traced back to its sources (12 MB of stdlib hashes in well under a second).
    tally.inputs += [task.path] if task.path is not None else []
    if task.kind == "jsonl":
        return _jsonl_docs(task, cfg, tally)
    return _whole_file_doc(task, cfg, tally)


def _all_docs(tasks: list[_Task], cfg: CollectConfig, tally: _Tally, progress: bool):
    with tqdm(tasks, desc="collect", unit="file", disable=not progress) as bar:
        for task in bar:
            if task.kind != "topics":
                tally.files += 1
            for doc in _task_docs(task, cfg, tally):
                tally.documents += 1
                tally.bytes += len(doc["text"].encode("utf-8"))
                tally.per_source[doc["source"]] += 1
                yield doc


def collect(cfg: CollectConfig, out_dir: Path, progress: bool = True) -> StageResult:
    """Read every source in ``cfg.sources`` and write ``out_dir/documents.jsonl.gz``.

    Documents keep their order (sources in the order given, files sorted, lines in file order), so
    the same sources give a byte-identical file. Stops after ``cfg.max_documents`` documents.
    Counts: ``documents``, ``bytes`` (UTF-8 bytes of text), ``files``, ``per_source``,
    ``skipped_malformed``, ``skipped_undecodable`` (invalid UTF-8 lines or files),
    ``damaged_files`` (truncated or corrupt gzip), and ``python_version`` when stdlib is a source.
    ``inputs`` lists every file read (user files and stdlib module sources).

    Raises:
        OlmoflowError: no sources, a source that matches nothing or has an unsupported type, an
            unreadable file, no documents at all, or (``cfg.strict``) any malformed line or damage.
    """
    if not cfg.sources:
        raise OlmoflowError("collect.sources is empty; name 'stdlib' or a file, directory or glob")
    if cfg.max_documents is not None and cfg.max_documents < 1:
        raise OlmoflowError(f"collect.max_documents must be at least 1, got {cfg.max_documents}")
    tasks = _plan(list(cfg.sources))
    tally = _Tally()
    out = Path(out_dir) / DOCUMENTS
    docs = _all_docs(tasks, cfg, tally, progress)
    try:
        write_documents(out, itertools.islice(docs, cfg.max_documents))
    finally:
        docs.close()  # closes the progress bar when max_documents stopped the reading early
    if tally.documents == 0:
        out.unlink(missing_ok=True)
        raise OlmoflowError(
            f"no documents collected from {', '.join(cfg.sources)} ({tally.files} files, "
            f"{tally.skipped_malformed} malformed lines, {tally.skipped_undecodable} undecodable, "
            f"{tally.damaged_files} damaged files)"
        )
    counts = {k: v for k, v in dataclasses.asdict(tally).items() if k != "inputs"}
    counts["per_source"] = dict(sorted(tally.per_source.items()))
    if STDLIB in cfg.sources:
        counts["python_version"] = python_version()
    return StageResult(inputs=list(tally.inputs), outputs=[out], counts=counts)
