"""Readers that turn raw sources into Dolma documents, tolerating damaged input.

One reader per format, each a generator of documents ``{"id", "text", "source", ["created"],
"metadata"}`` in file order:

======= ================================================ =====================================
format  files                                            document id (same file, same ids)
======= ================================================ =====================================
text    ``.txt`` (one document per file)                 ``<name>``
jsonl   ``.jsonl``, ``.json.gz``, ``.jsonl.gz``, ``.zst`` the record's ``id``, else
                                                         ``<name>:<line>``
parquet ``.parquet`` (``text_field`` column)             the ``id`` column, else ``<name>:<row>``
warc    ``.warc``, ``.warc.gz``, ``.warc.zst``           the WARC-Record-ID, else
                                                         ``<name>:<record>``
stdlib  the running Python's standard library            ``stdlib/<module path>``,
                                                         ``pydoc_topics/<t>``
hf      ``hf://name[:config]/split`` (Hugging Face)      the ``id`` column, else
                                                         ``<name>/<split>:<row>``
======= ================================================ =====================================

``<name>`` is the file's machine-independent name (``<directory label>/<relative path>``), so ids
do not depend on where the data lives, how many workers read it or how its output is sharded.
Line, row and record numbers start at 1.

Bad input never stops a run and is never silently lost: every damaged file, undecodable or
malformed record, over-large document or empty file is counted by kind in a :class:`ReadLog`
with ``file:line`` examples and logged; with ``strict`` the first one raises
:class:`~olmoflow.errors.OlmoflowError` naming the file and line. The kinds: ``damaged_file``
(truncated or corrupt gzip, zstd, Parquet or WARC: the documents before the damage are kept;
of a compressed file, those of the gzip members or zstd frames before the damaged one, each
checked whole, checksum included, before any of its lines is read, so no document of a damaged
member is kept),
``empty_file``, ``invalid_utf8``, ``not_json``, ``not_object``, ``missing_text``,
``text_not_string``, ``too_large`` (over ``max_document_bytes``) and, from ingest,
``unsupported_file``. A zstd file with frames written without a content checksum is read but
named once in :attr:`ReadLog.unverified` (and logged): damage in it may go unseen. WARC
records that are not documents (non-2xx, not text, no text left after extraction) are counted
as removed (``http_status``, ``not_text``, ``no_text``) but are not errors.
WARC text is extracted from HTML with Resiliparse (main content, as in DCLM), or trafilatura on
request (:mod:`olmoflow.data.warc`).
"""

from __future__ import annotations

import datetime as _dt
import decimal
import logging
import os
import re
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from olmoflow.data.documents import jsonl_document, parse_jsonl_line
from olmoflow.data.read_base import (  # re-exported: the readers' shared types
    _CHUNK,
    FORMATS,
    HF_PREFIX,
    MALFORMED,
    Input,
    ReadLog,
    ReadOptions,
    SourceOptions,
    _damage_errors,
    _damage_kind,
    _first_line,
    _need,
    _rel_path,
    _too_large,
    file_format,
    open_binary,
)
from olmoflow.data.warc import read_warc
from olmoflow.errors import OlmoflowError, unknown_name_error

log = logging.getLogger(__name__)
_TEST_DIRS = {"test", "tests", "idle_test"}
_VENDOR_DIRS = {"site-packages", "dist-packages"}

# --- text ---------------------------------------------------------------------------------------


def read_text(inp: Input, opts: ReadOptions, rl: ReadLog) -> Iterator[dict[str, Any]]:
    """One document from a whole UTF-8 text file (a byte-order mark is dropped)."""
    path = inp.path
    rl.files.append(Path(path))
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise OlmoflowError(f"cannot read '{path}': {e.strerror or e}") from None
    if size == 0:
        rl.bad("empty_file", path, "empty file", documents=0)
        return
    if opts.max_document_bytes is not None and size > opts.max_document_bytes:
        rl.bad("too_large", f"{path}:1", _too_large(size, opts), size)
        return
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8-sig")  # -sig: drop a byte-order mark (common in .txt)
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        rl.bad("invalid_utf8", f"{path}:{line}", f"invalid UTF-8 at byte {e.start}", size)
        return
    yield {"id": inp.name, "text": text, "source": inp.source, "metadata": {"path": _rel_path(inp)}}


# --- JSONL --------------------------------------------------------------------------------------


def _read_line(f: IO[bytes], limit: int | None) -> tuple[bytes | None, int]:
    """The next line, or ``(None, size)`` for a line over ``limit`` bytes, which is consumed in
    chunks and never held whole. ``(b"", 0)`` at the end of the file."""
    if limit is None:
        raw = f.readline()
        return raw, len(raw)
    raw = f.readline(limit + 1)
    if len(raw) <= limit or raw.endswith(b"\n"):
        return raw, len(raw)
    size = len(raw)
    del raw
    while chunk := f.readline(_CHUNK):
        size += len(chunk)
        if chunk.endswith(b"\n"):
            break
    return None, size


_REASON_KIND = (
    ("invalid UTF-8", "invalid_utf8"), ("not JSON", "not_json"),
    ("not a JSON object", "not_object"),
    ("missing", "missing_text"), ("is not a string", "text_not_string"),
)


def _damage_message(path: str, e: BaseException, kept: int, lines: int) -> str:
    """What a damaged compressed file cost, saying exactly which documents were kept: those of
    the members (gzip) or frames (zstd) before the damaged one, each decoded whole and checked
    before any of its lines was read (:func:`open_binary`); nothing of the damaged one, whose
    lines may be wrong text, nor of anything after it."""
    kind = _damage_kind(path)
    unit = "frame" if kind == "zstd" else "member"
    what = f"damaged {kind} data ({_first_line(e)})"
    if not lines:
        return f"{what}; kept no documents: the damage is in the file's first {unit}"
    return (f"{what}; kept the {kept} documents of lines 1-{lines}, those of the {unit}s before "
            f"the damaged {unit}, and nothing from it on")


def read_jsonl(inp: Input, opts: ReadOptions, rl: ReadLog) -> Iterator[dict[str, Any]]:
    """Documents of a JSONL file (plain, gzip or zstd), one per non-blank line.

    Dolma records keep their ``id``, ``source``, ``added``, ``created`` and ``metadata``; other
    fields go into ``metadata`` with the ``path`` and ``line`` they came from.
    """
    path = inp.path
    rl.files.append(Path(path))
    lineno, records, kept = 0, 0, 0
    try:
        with open_binary(path, lambda why: rl.unverifiable(path, why)) as f:
            while True:
                # A line cut by damage is never returned: readline raises before returning it.
                raw, size = _read_line(f, opts.max_document_bytes)
                if not size:
                    break
                lineno += 1
                if raw is None:
                    records += 1
                    rl.bad("too_large", f"{path}:{lineno}", _too_large(size, opts), size)
                    continue
                if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    # A UTF-8 byte-order mark (Windows editors) is not part of the JSON.
                    raw = raw[3:]
                if not raw.strip():
                    continue
                records += 1
                obj, reason = parse_jsonl_line(raw, opts.text_field)
                raw = None  # a 100 MB line must not outlive its parse
                if obj is None:
                    kind = next(k for prefix, k in _REASON_KIND if prefix in reason)
                    rl.bad(kind, f"{path}:{lineno}", f"malformed JSONL: {reason}", size)
                    continue
                meta = {"path": _rel_path(inp), "line": lineno}
                kept += 1
                yield jsonl_document(obj, opts.text_field, f"{inp.name}:{lineno}", inp.source, meta)
    except _damage_errors() as e:
        rl.bad("damaged_file", f"{path}:{lineno + 1}",
               _damage_message(path, e, kept, lineno), documents=0)
        return
    if records == 0:
        rl.bad("empty_file", path, "empty file (no records)", documents=0)


# --- Parquet ------------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    """A JSON-serializable copy of a Parquet/Arrow value (dates as ISO text, bytes as hex)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (_dt.date, _dt.time)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    if isinstance(value, decimal.Decimal):
        return str(value)
    return str(value)


def _table_documents(
    rows: Iterator[dict[str, Any]], inp: Input, opts: ReadOptions, rl: ReadLog, where_prefix: str,
    id_prefix: str, meta_base: dict[str, Any], counter: list[int],
) -> Iterator[dict[str, Any]]:
    """Documents from row dicts (Parquet, HF); ``counter[0]`` tracks the 1-based row number."""
    field = opts.text_field
    for row in rows:
        counter[0] += 1
        n = counter[0]
        where = f"{where_prefix}:{n}"
        text = row.get(field)
        if field not in row:
            rl.bad("missing_text", where, f"field '{field}' missing", 0)
            continue
        if not isinstance(text, str):
            rl.bad("text_not_string", where, f"field '{field}' is not a string", 0)
            continue
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError:
            rl.bad("invalid_utf8", where, f"invalid UTF-8 in field '{field}' (a lone surrogate)", 0)
            continue
        if opts.max_document_bytes is not None and size > opts.max_document_bytes:
            rl.bad("too_large", where, _too_large(size, opts), size)
            continue
        obj = {k: _jsonable(v) for k, v in row.items() if v is not None or k == field}
        meta = {**meta_base, "row": n}
        yield jsonl_document(obj, field, f"{id_prefix}:{n}", inp.source, meta)


def read_parquet(inp: Input, opts: ReadOptions, rl: ReadLog) -> Iterator[dict[str, Any]]:
    """Documents of a Parquet file, one per row, read in record batches (bounded memory).

    The ``text_field`` column is the text; ``id``, ``source``, ``added``, ``created`` and
    ``metadata`` columns are kept as in Dolma; other columns go into ``metadata``.
    """
    pa = _need("pyarrow", "reading Parquet files")
    pq = _need("pyarrow.parquet", "reading Parquet files")
    path = inp.path
    rl.files.append(Path(path))
    counter = [0]
    try:
        pf = pq.ParquetFile(path)
        if opts.text_field not in pf.schema_arrow.names:
            names = pf.schema_arrow.names
            rl.bad("missing_text", path,
                   f"no column '{opts.text_field}' (columns: {', '.join(names)})", 0,
                   documents=pf.metadata.num_rows)
            return
        rows = (r for b in pf.iter_batches(batch_size=1024) for r in b.to_pylist())
        yield from _table_documents(rows, inp, opts, rl, path, inp.name,
                                    {"path": _rel_path(inp)}, counter)
    except (pa.ArrowException, OSError, EOFError) as e:
        if isinstance(e, FileNotFoundError):
            raise OlmoflowError(f"cannot read '{path}': {e.strerror or e}") from None
        rl.bad("damaged_file", f"{path}:{counter[0] + 1}",
               f"damaged Parquet file ({_first_line(e)}); kept the rows before it", documents=0)
        return
    if counter[0] == 0:
        rl.bad("empty_file", path, "empty file (no rows)", documents=0)


# --- the Python standard library ----------------------------------------------------------------


def python_version() -> str:
    """The running Python's version (``3.11.7``): the stdlib corpus depends on it."""
    return sys.version.split()[0]


def _is_stdlib_part(name: str) -> bool:
    """False for test suites and third-party packages, which are not the stdlib's own code."""
    stem = name[:-3] if name.endswith(".py") else name
    return not (stem in _TEST_DIRS or stem.startswith("test_") or name in _VENDOR_DIRS)


def stdlib_files() -> list[tuple[Path, str]]:
    """``(path, "stdlib/<relative path>")`` for every module source of the running Python's
    stdlib, sorted; test suites and site-packages are left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = []
    for top, dirs, files in os.walk(root):
        # Pruning here skips site-packages, which can be far larger than the stdlib itself.
        dirs[:] = [d for d in dirs if _is_stdlib_part(d) and d != "__pycache__"]
        rel_top = Path(top).relative_to(root)
        rels += [(rel_top / f).as_posix() for f in files
                 if f.endswith(".py") and _is_stdlib_part(f)]
    return [(root / rel, f"stdlib/{rel}") for rel in sorted(rels)]


def read_stdlib(inp: Input, opts: ReadOptions, rl: ReadLog) -> Iterator[dict[str, Any]]:
    """The stdlib corpus: one document per module source (source ``stdlib``), then the prose of
    the language reference (``pydoc_data.topics``, source ``pydoc_topics``), one per topic."""
    for path, name in stdlib_files():
        rl.files.append(path)
        try:
            text = path.read_bytes().decode("utf-8-sig")
        except UnicodeDecodeError as e:  # never strict: the stdlib is not the user's data
            log.warning("%s: invalid UTF-8 at byte %d; file skipped", path, e.start)
            rl.skip("invalid_utf8", path.stat().st_size)
            continue
        meta = {"path": name.split("/", 1)[1], "python": python_version()}
        yield {"id": name, "text": text, "source": "stdlib", "metadata": meta}
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        log.warning("pydoc_data.topics is not available in this Python; its topics are skipped")
        return
    for name in sorted(topics):
        meta = {"topic": name, "python": python_version()}
        yield {"id": f"pydoc_topics/{name}", "text": topics[name], "source": "pydoc_topics",
               "metadata": meta}


# --- Hugging Face datasets ----------------------------------------------------------------------


def parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """``hf://name[:config]/split`` -> ``(name, config, split)``; ``name`` may hold ``/``
    (``allenai/c4``) or be a local dataset directory (``hf:///data/my_set/train``).

    Raises:
        OlmoflowError: the spec has no split or no name.
    """
    rest = spec[len(HF_PREFIX):] if spec.startswith(HF_PREFIX) else spec
    head, _, split = rest.rpartition("/")
    name, _, config = head.rpartition(":") if ":" in head else (head, "", "")
    if not head or not split or not name:
        raise OlmoflowError(f"bad Hugging Face source '{spec}': expected hf://name[:config]/split")
    return name, config or None, split


def hf_label(spec: str) -> str:
    """The source label of an ``hf://`` spec: the dataset's last name part (and config)."""
    name, config, _ = parse_hf_spec(spec)
    label = name.rstrip("/").rsplit("/", 1)[-1] + (f"_{config}" if config else "")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label) or "hf"


def _load_hf(spec: str, opts: ReadOptions):
    name, config, split = parse_hf_spec(spec)
    datasets = _need("datasets", f"source '{spec}'")
    local = Path(name).expanduser().is_dir()
    if not local and not opts.allow_network:
        raise OlmoflowError(
            f"source '{spec}' is on the Hugging Face Hub and network access is off; "
            "set allow_network: true, or give a local dataset directory"
        )
    try:
        return datasets.load_dataset(
            str(Path(name).expanduser()) if local else name, config, split=split, streaming=True
        )
    except Exception as e:  # datasets raises many types (ConnectionError, HfHubHTTPError, ...)
        raise OlmoflowError(f"cannot load Hugging Face dataset '{spec}': "
                            f"{_first_line(e)}") from None


def read_hf(inp: Input, opts: ReadOptions, rl: ReadLog) -> Iterator[dict[str, Any]]:
    """Documents of a Hugging Face dataset split, streamed in the dataset's order.

    Raises:
        OlmoflowError: ``datasets`` is not installed, a Hub dataset without ``allow_network``,
            or the dataset cannot be loaded (no network, unknown name, config or split).
    """
    ds = _load_hf(inp.spec, opts)
    name, config, split = parse_hf_spec(inp.spec)
    counter = [0]
    meta = {"hf_dataset": name, "hf_split": split, **({"hf_config": config} if config else {})}
    yield from _table_documents(iter(ds), inp, opts, rl, inp.spec, f"{inp.name}/{split}", meta,
                                counter)
    if counter[0] == 0:
        rl.bad("empty_file", inp.spec, "empty dataset split", documents=0)


__all__ = ["FORMATS", "HF_PREFIX", "MALFORMED", "READERS", "Input", "ReadLog", "ReadOptions",
           "SourceOptions", "file_format", "hf_label", "open_binary", "parse_hf_spec",
           "python_version", "read_hf", "read_input", "read_jsonl", "read_parquet", "read_stdlib",
           "read_text", "read_warc", "stdlib_files"]

READERS = {
    "text": read_text, "jsonl": read_jsonl, "parquet": read_parquet, "warc": read_warc,
    "stdlib": read_stdlib, "hf": read_hf,
}


def read_input(inp: Input, opts: ReadOptions, rl: ReadLog) -> Iterator[dict[str, Any]]:
    """The documents of one input, in order, through the reader for its format.

    Raises:
        OlmoflowError: an unreadable file, an unknown format, or (``opts.strict``) bad input.
    """
    try:
        reader = READERS[inp.format]
    except KeyError:
        raise unknown_name_error("input format", inp.format, READERS) from None
    return reader(inp, opts, rl)
