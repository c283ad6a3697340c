"""Sources into Dolma documents: the ``collect`` stage and the data engine's ``ingest`` shard job.

A source entry is ``"stdlib"`` (the running Python's standard library, an offline default
corpus), ``hf://name[:config]/split`` (a Hugging Face dataset; see
:mod:`olmoflow.data.readers`), or a file, directory or glob of supported files: ``.txt`` (one
document per file), JSONL (``.jsonl``, ``.json.gz``/``.jsonl.gz``, ``.jsonl.zst``; one document
per line), ``.parquet`` (one per row) and WARC (``.warc``, ``.warc.gz``; one per HTML response).
User data is read tolerantly: damaged files, bad records and empty files are skipped, counted by
kind and logged with file and line, unless ``strict`` asks for an error at the first.

``collect`` gathers every source into one ``documents.jsonl.gz`` (the demo flow).
:func:`ingest_shard` reads one input into ``DIR/documents/<source>/<shard>.jsonl.gz`` (split
into ``<shard>-0001.jsonl.gz``, ... past ``max_shard_bytes``) for the data engine, which runs one
such job per input file (:func:`ingest_tasks` builds them).
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import logging
import os
import re
import reprlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from olmoflow.artifacts import MANIFEST, StageResult
from olmoflow.config import as_section, from_dict
from olmoflow.data.documents import DOCUMENTS, ShardWriter, write_documents
from olmoflow.data.readers import (
    FORMATS,
    HF_PREFIX,
    MALFORMED,
    Input,
    ReadLog,
    ReadOptions,
    SourceOptions,
    file_format,
    hf_label,
    python_version,
    read_input,
)
from olmoflow.errors import OlmoflowError

if TYPE_CHECKING:
    from olmoflow.data.config import CollectConfig

__all__ = ["STDLIB", "SUFFIXES", "INGEST_OPTIONS", "collect", "source_files", "plan_inputs",
           "ingest_tasks", "ingest_shard", "python_version"]

STDLIB = "stdlib"
SUFFIXES = tuple(sorted(FORMATS))
_TASK_KEYS = ("input", "name", "source", "output", "strict", "options")


#: The keys of a source's ``options`` (:class:`SourceOptions`).
INGEST_OPTIONS = tuple(f.name for f in dataclasses.fields(SourceOptions))
log = logging.getLogger(__name__)


# --- planning -----------------------------------------------------------------------------------


def _walk(directory: Path, follow_symlinks: bool) -> Iterator[Path]:
    """Every path under ``directory``. Without ``follow_symlinks`` linked directories are listed
    but not entered (``Path.rglob``); with it they are entered too, each real directory once, so a
    link to an ancestor ends instead of looping."""
    if not follow_symlinks:
        yield from directory.rglob("*")
        return
    seen: set[str] = set()
    for top, dirs, files in os.walk(directory, followlinks=True):
        real = os.path.realpath(top)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        for name in dirs + files:
            yield Path(top) / name


def _outside(path: Path, root: Path | None) -> bool:
    """Whether ``path``, its links resolved, lies outside the real directory ``root``."""
    return root is not None and not path.resolve().is_relative_to(root)


def _dir_files(directory: Path, root: Path | None = None,
               skipped: list[Path] | None = None) -> list[Path]:
    """Supported files under ``directory``, recursively, sorted; hidden files and dirs skipped.
    Other files (a README, ``.json.bz2``) are skipped with a warning that names them, so data in
    an unsupported format is never dropped without a word.

    ``root`` is the real (resolved) directory the user named; a file or linked directory whose
    real path lies outside it is left out and added to ``skipped``. ``root`` None follows every
    link (``follow_symlinks``)."""
    found, other = [], []
    for p in _walk(directory, follow_symlinks=root is None):
        rel = p.relative_to(directory)
        if any(s.startswith(".") for s in rel.parts):
            continue
        if p.is_symlink() and _outside(p, root):
            if p.exists() and skipped is not None:  # a dangling link is no data either way
                skipped.append(p)
            continue
        # An olmoflow artifact directory (e.g. a data run's mixed/) carries its manifest.json:
        # bookkeeping, not data, so reading such a directory warns about nothing.
        if p.name == MANIFEST or not p.is_file():
            continue
        (found if file_format(p) else other).append(p)
    if other and found:  # with no supported file at all, _expand raises instead
        names = sorted(p.relative_to(directory).as_posix() for p in other)
        log.warning("%s: skipped %d file(s) of an unsupported type: %s%s", directory, len(names),
                    ", ".join(names[:5]), ", ..." if len(names) > 5 else "")
    return sorted(found, key=lambda p: p.relative_to(directory).as_posix())


def _absolute(path: str) -> Path:
    # abspath, not resolve: ".." is normalized (names stay clean) but symlinks are not followed.
    return Path(os.path.abspath(path))


def _expand(entry: str, follow_symlinks: bool = False,
            skipped: list[Path] | None = None) -> list[tuple[Path, Path]]:
    """``(file, root)`` pairs for one user source; ``root`` anchors the file's stable name.

    In a directory or a glob, a symbolic link whose target lies outside the directory named (a
    glob's part before its first wildcard) is not followed unless ``follow_symlinks``: it goes
    into ``skipped`` instead. A file named on its own is read wherever its link points.

    Raises:
        OlmoflowError: nothing matches, an explicit file has an unsupported type, or a directory or
            glob holds no supported file.
    """
    text = os.path.expanduser(entry)
    wild = [i for i, c in enumerate(text) if c in "*?["]
    kinds = ", ".join(SUFFIXES)
    mine: list[Path] = []  # this entry's skipped links, for the message when nothing is left

    def none_left(what: str) -> OlmoflowError:
        if not mine:
            return OlmoflowError(what)
        return OlmoflowError(f"{what} ({len(mine)} symbolic link(s) that lead outside it were "
                             f"skipped, e.g. '{mine[0]}'; --follow-symlinks reads them)")

    if wild:
        matches = sorted(glob.glob(text, recursive=True))
        if not matches:
            raise OlmoflowError(f"no such file or directory: '{entry}'")
        root = _absolute(os.path.dirname(text[: wild[0]]) or ".")
        real = None if follow_symlinks else root.resolve()
        files, other = [], []
        for m in map(_absolute, matches):
            if _outside(m, real):
                if m.exists():
                    mine.append(m)
            elif m.is_dir():
                files += _dir_files(m, real, mine)
            elif m.is_file():
                (files if file_format(m) else other).append(m)
        mine.sort()  # the warning names the first: the same one on every run
        if skipped is not None:
            skipped += mine
        if not files:
            raise none_left(f"no {kinds} files match '{entry}'")
        if other:
            log.warning("%s: skipped %d file(s) of an unsupported type: %s%s", entry, len(other),
                        ", ".join(m.name for m in other[:5]), ", ..." if len(other) > 5 else "")
        return [(f, root) for f in files]
    path = _absolute(text)
    if path.is_dir():
        files = _dir_files(path, None if follow_symlinks else path.resolve(), mine)
        mine.sort()
        if skipped is not None:
            skipped += mine
        if not files:
            raise none_left(f"no {kinds} files in directory '{entry}'")
        return [(f, path) for f in files]
    if path.is_file():
        if not file_format(path):
            raise OlmoflowError(f"unsupported file type '{entry}': expected one of {kinds}")
        return [(path, path.parent)]
    raise OlmoflowError(f"no such file or directory: '{entry}'")


def plan_inputs(entries: list[str], label: str | None = None, *, follow_symlinks: bool = False,
                skipped: list[Path] | None = None) -> list[Input]:
    """Every input the source ``entries`` name, in a deterministic order; a file named twice is
    read once. Each file's stable name is ``<label>/<path relative to its entry>``; ``label``
    defaults to the entry's directory name (and is also each input's ``source``).

    Symbolic links in a directory or glob that lead outside it are not followed unless
    ``follow_symlinks``; they are appended to ``skipped`` (the caller warns).

    Raises:
        OlmoflowError: an entry that matches nothing or names an unsupported file.
    """
    inputs: list[Input] = []
    seen: set[Any] = set()
    for entry in entries:
        if entry == STDLIB or entry.startswith(HF_PREFIX):
            if entry not in seen:
                seen.add(entry)
                if entry == STDLIB:
                    inputs.append(Input("stdlib", "stdlib", label or STDLIB))
                else:
                    src = label or hf_label(entry)
                    inputs.append(Input("hf", src, src, spec=entry))
            continue
        for path, root in _expand(entry, follow_symlinks, skipped):
            real = path.resolve()
            if real in seen:
                continue
            seen.add(real)
            src = label or root.name or "user"
            name = f"{src}/{path.relative_to(root).as_posix()}"
            # The path as listed, not its target: a link's name carries the suffix that says
            # how to decompress it (a content-addressed blob behind it has none).
            inputs.append(Input(file_format(path), name, src, path=str(path)))
    return inputs


def warn_skipped_links(skipped: list[Path], where: str, how: str) -> None:
    """One warning line for the symbolic links that were not followed: how many, the first one
    and its target, and ``how`` to read them."""
    if skipped:
        first = skipped[0]
        log.warning("%s: skipped %d symbolic link(s) that lead outside their directory, first "
                    "'%s' -> '%s' (%s reads them)", where, len(skipped), first, first.resolve(),
                    how)


def source_files(entries: list[str], follow_symlinks: bool = False) -> list[Path]:
    """The user files ``collect`` reads for ``entries`` (``stdlib`` and ``hf://`` entries
    contribute none), in reading order; links leading out of a directory only with
    ``follow_symlinks``, as in :func:`collect`. Raises OlmoflowError like :func:`collect` for a
    source that matches nothing or has an unsupported type."""
    return [Path(i.path) for i in plan_inputs(entries, follow_symlinks=follow_symlinks)
            if i.path is not None]


# --- collect ------------------------------------------------------------------------------------


def _all_docs(inputs: list[Input], opts: ReadOptions, rl: ReadLog, tally: Counter,
              progress: bool) -> Iterator[dict[str, Any]]:
    with tqdm(inputs, desc="collect", unit="file", disable=not progress) as bar:
        for inp in bar:
            for doc in read_input(inp, opts, rl):
                tally["documents"] += 1
                tally["bytes"] += len(doc["text"].encode("utf-8"))
                tally["source:" + doc["source"]] += 1
                yield doc


def collect(cfg: CollectConfig, out_dir: Path, progress: bool = True) -> StageResult:
    """Read every source in ``cfg.sources`` and write ``out_dir/documents.jsonl.gz``.

    Documents keep their order (sources in the order given, files sorted, records in file order),
    so the same sources give a byte-identical file. Stops after ``cfg.max_documents`` documents.
    Counts: ``documents``, ``bytes`` (UTF-8 bytes of text), ``files``, ``per_source``,
    ``skipped_malformed`` (lines that are not JSON objects with a string text, or too large),
    ``skipped_undecodable`` (invalid UTF-8 lines or files), ``damaged_files`` (truncated or
    corrupt compression), ``empty_files``, ``errors`` (count by kind), ``error_examples``
    (``file:line: reason``), ``removed`` (records not kept, by kind), ``skipped_symlinks``
    (links in a source directory that lead outside it, not followed unless
    ``cfg.follow_symlinks``; one warning names the first), ``unverifiable`` (each file read
    whose documents had no checksum to be checked against, once, as ``"file: reason"``: zstd
    frames written without one), and ``python_version`` when stdlib is a source. ``inputs``
    lists every file read (user files and stdlib sources) by its real path, links resolved.

    Raises:
        OlmoflowError: no sources, a source that matches nothing or has an unsupported type, an
            unreadable file, no documents at all, or (``cfg.strict``) any bad input.
    """
    if not cfg.sources:
        raise OlmoflowError("collect.sources is empty; name 'stdlib' or a file, directory or glob")
    if cfg.max_documents is not None and cfg.max_documents < 1:
        raise OlmoflowError(f"collect.max_documents must be at least 1, got {cfg.max_documents}")
    follow = cfg.follow_symlinks
    links: list[Path] = []
    inputs = plan_inputs(list(cfg.sources), follow_symlinks=follow, skipped=links)
    warn_skipped_links(links, "collect", "--follow-symlinks or collect.follow_symlinks=true")
    opts = ReadOptions(text_field=cfg.text_field, strict=cfg.strict)
    rl = ReadLog(strict=cfg.strict)
    tally: Counter = Counter()
    out = Path(out_dir) / DOCUMENTS
    docs = _all_docs(inputs, opts, rl, tally, progress)
    try:
        write_documents(out, itertools.islice(docs, cfg.max_documents))
    finally:
        docs.close()  # closes the progress bar when max_documents stopped the reading early
    rl.summarize()
    counts: dict[str, Any] = {
        "documents": tally["documents"], "bytes": tally["bytes"], "files": len(rl.files),
        "per_source": {k[7:]: v for k, v in sorted(tally.items()) if k.startswith("source:")},
        "skipped_malformed": rl.count(*MALFORMED),
        "skipped_undecodable": rl.count("invalid_utf8"),
        "damaged_files": rl.count("damaged_file"),
        "empty_files": rl.count("empty_file"),
        "errors": rl.error_counts(), "error_examples": rl.error_examples(),
        "removed": dict(sorted(rl.removed.items())),
        "skipped_symlinks": len(links),
        "unverifiable": list(rl.unverified),
    }
    if tally["documents"] == 0:
        out.unlink(missing_ok=True)
        raise OlmoflowError(
            f"no documents collected from {', '.join(cfg.sources)} ({counts['files']} files, "
            f"{counts['skipped_malformed']} malformed lines, {counts['skipped_undecodable']} "
            f"undecodable, {counts['damaged_files']} damaged files, {counts['empty_files']} empty)"
        )
    if STDLIB in cfg.sources:
        counts["python_version"] = python_version()
    # Real paths: a link's target is what was read, and what the lineage must lead back to.
    return StageResult(inputs=[Path(os.path.realpath(f)) for f in rl.files], outputs=[out],
                       counts=counts)


# --- ingest (the data engine's first step) ------------------------------------------------------


def _shard_stem(index: int, inp: Input) -> str:
    base = inp.name.rsplit("/", 1)[-1] if inp.path else (inp.spec or inp.name).rsplit("/", 1)[-1]
    suffix = max((s for s in FORMATS if base.lower().endswith(s)), key=len, default="")
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", base[: len(base) - len(suffix)]) or "part"
    return f"{index:05d}_{base}"


def ingest_tasks(
    source: str, entries: list[str], out_dir: str | os.PathLike, *,
    options: SourceOptions | dict[str, Any] | None = None, strict: bool = False,
) -> list[dict[str, Any]]:
    """The :func:`ingest_shard` tasks of one named source: one per input file (or stdlib, or
    ``hf://`` split), each writing ``<out_dir>/<source>/<index>_<file stem>.jsonl.gz``.

    Document ids are ``<source>/<path relative to its entry>`` plus the line or row, so they do
    not depend on where the data lives. ``options`` (:class:`SourceOptions` or its mapping) go
    into every task as a :class:`SourceOptions` (``follow_symlinks`` left out: it decides which
    files become tasks): symbolic links in a source directory that lead outside it are skipped
    (one warning names the first) unless ``follow_symlinks`` is true.

    Raises:
        OlmoflowError: an entry that matches nothing or names an unsupported file, a source name
            that is not a plain directory name, an unknown option (naming the closest one), or an
            option of the wrong type.
    """
    if not source or not re.fullmatch(r"[A-Za-z0-9._-]+", source) or source in (".", ".."):
        raise OlmoflowError(f"source name '{source}' must be a plain name (letters, digits, . _ -)")
    opts = as_section(SourceOptions, options, "options.")
    follow = opts.follow_symlinks
    task_opts = dataclasses.replace(opts, follow_symlinks=False, strict=None)
    strict = strict if opts.strict is None else opts.strict
    links: list[Path] = []
    tasks = []
    for i, inp in enumerate(plan_inputs(entries, label=source, follow_symlinks=follow,
                                        skipped=links)):
        tasks.append({
            "input": inp.path or inp.spec or STDLIB, "name": inp.name, "source": source,
            "output": str(Path(out_dir) / source / f"{_shard_stem(i, inp)}{ShardWriter.SUFFIX}"),
            "strict": strict, "options": task_opts,
        })
    warn_skipped_links(links, f"source '{source}'",
                       "--follow-symlinks or the source option follow_symlinks: true")
    return tasks


def _task_options(task: dict[str, Any]) -> SourceOptions:
    """The :class:`SourceOptions` of an ingest task: the one it carries, else (a task written by
    hand, or read back from JSON) its option keys, at the top level or under ``options``, parsed
    by :func:`olmoflow.config.from_dict`."""
    opts = task.get("options")
    if isinstance(opts, SourceOptions):
        return opts
    if not isinstance(opts or {}, dict):
        raise OlmoflowError("ingest task options must be a mapping, got "
                            f"{reprlib.repr(opts)}")
    flat = {k: v for k, v in task.items() if k not in _TASK_KEYS}
    return from_dict(SourceOptions, {**flat, **(opts or {})}, "options.")


def _task_input(task: dict[str, Any], rl: ReadLog) -> Input | None:
    """The input of an ingest task; None (counted as ``unsupported_file``) for a file no reader
    handles."""
    spec, source = str(task["input"]), task["source"]
    if spec == STDLIB:
        return Input("stdlib", STDLIB, source)
    if spec.startswith(HF_PREFIX):
        return Input("hf", task.get("name") or source, source, spec=spec)
    name = task.get("name") or f"{source}/{Path(spec).name}"
    fmt = file_format(spec)
    if fmt is None:
        rl.bad("unsupported_file", spec,
               f"unsupported file type: expected one of {', '.join(SUFFIXES)}", documents=0)
        return None
    return Input(fmt, name, source, path=spec)


def ingest_shard(task: dict[str, Any]) -> dict[str, Any]:
    """Read one input into Dolma documents shards; the data engine's ``ingest`` shard job.

    ``task``: ``input`` (a file path, ``"stdlib"`` or ``"hf://..."``), ``source`` (the source's
    name), ``output`` (the first shard's path, ``.jsonl.gz``), optional ``name`` (the input's
    stable name, the id prefix; default ``<source>/<file name>``), ``strict``, and ``options``
    (a :class:`SourceOptions`; a task written by hand may give its keys as a mapping or at the
    top level: ``text_field``, ``max_document_bytes``, ``html_extractor``, ``allow_network``,
    ``max_shard_bytes``).

    Returns the stats ``{"input", "source", "documents_in", "documents_out", "bytes_in",
    "bytes_out", "removed", "errors", "error_counts", "outputs", "unverifiable", "files",
    "input_bytes"}``:
    ``documents_in = documents_out + sum(removed documents)`` and likewise for bytes (text bytes
    for documents kept, bytes as read for records removed), so nothing goes unaccounted;
    ``errors`` are ``"file:line: reason"`` examples (the first few of each kind) and
    ``error_counts`` counts bad input by kind (including file-level kinds such as
    ``damaged_file`` and ``empty_file``); ``outputs`` are the shard paths written (at least one,
    maybe empty), in order; ``unverifiable`` names the input, once, when its documents had no
    checksum to be checked against (zstd frames written without one). Output bytes are
    deterministic (gzip mtime 0).

    Raises:
        OlmoflowError: an unknown option, an unreadable file, an unusable ``hf://`` source, or
            (``strict``) the first bad input, naming its file and line.
    """
    options = _task_options(task)
    opts = options.read_options(bool(task.get("strict", False)))
    rl = ReadLog(strict=opts.strict)
    out = {"documents": 0, "bytes": 0}
    inp = _task_input(task, rl)
    with ShardWriter(task["output"], options.max_shard_bytes) as writer:
        if inp is not None:
            for doc in read_input(inp, opts, rl):
                writer.write(doc)
                out["documents"] += 1
                out["bytes"] += len(doc["text"].encode("utf-8"))
    rl.summarize()
    removed = dict(sorted(rl.removed.items()))
    return {
        "input": str(task["input"]), "source": task["source"],
        "documents_in": out["documents"] + sum(r["documents"] for r in removed.values()),
        "documents_out": out["documents"],
        "bytes_in": out["bytes"] + sum(r["bytes"] for r in removed.values()),
        "bytes_out": out["bytes"],
        "removed": removed,
        "errors": rl.error_examples(),
        "error_counts": rl.error_counts(),
        "outputs": [str(p) for p in writer.paths],
        "unverifiable": list(rl.unverified),
        "files": len(rl.files),
        "input_bytes": sum(p.stat().st_size for p in rl.files if p.is_file()),
    }
