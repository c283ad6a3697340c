"""Readers that turn raw sources into Dolma documents, tolerating damaged input.

One reader per format, each a generator of documents ``{"id", "text", "source", ["created"],
"metadata"}`` in file order:

========== =================================================== ===========================================
format     files                                               document id (stable: same file, same ids)
========== =================================================== ===========================================
text       ``.txt`` (one document per file)                    ``<name>``
jsonl      ``.jsonl``, ``.json.gz``, ``.jsonl.gz``, ``.zst``   the record's ``id``, else ``<name>:<line>``
parquet    ``.parquet`` (``text_field`` column)                the ``id`` column, else ``<name>:<row>``
warc       ``.warc``, ``.warc.gz``, ``.warc.zst``              the WARC-Record-ID, else ``<name>:<record>``
stdlib     the running Python's standard library               ``stdlib/<module path>``, ``pydoc_topics/<t>``
hf         ``hf://name[:config]/split`` (Hugging Face)         the ``id`` column, else ``<name>/<split>:<row>``
========== =================================================== ===========================================

``<name>`` is the file's machine-independent name (``<directory label>/<relative path>``), so ids
do not depend on where the data lives, how many workers read it or how its output is sharded.
Line, row and record numbers start at 1.

Bad input never stops a run and is never silently lost: every damaged file, undecodable or
malformed record, over-large document or empty file is counted by kind in a :class:`ReadLog`
with ``file:line`` examples and logged; with ``strict`` the first one raises
:class:`~olmoflow.errors.OlmoflowError` naming the file and line. The kinds: ``damaged_file``
(truncated or corrupt gzip, zstd, Parquet or WARC: the documents before the damage are kept),
``empty_file``, ``invalid_utf8``, ``not_json``, ``not_object``, ``missing_text``,
``text_not_string``, ``too_large`` (over ``max_document_bytes``) and, from ingest,
``unsupported_file``. WARC records that are not documents (non-2xx, not text, no text left after
extraction) are counted as removed (``http_status``, ``not_text``, ``no_text``) but are not errors.
WARC text is extracted from HTML with Resiliparse (main content, as in DCLM), or trafilatura on
request (:mod:`olmoflow.data.warc`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import decimal
import gzip
import importlib
import io
import logging
import os
import re
import sys
import sysconfig
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from olmoflow.data.documents import jsonl_document, parse_jsonl_line
from olmoflow.errors import OlmoflowError, unknown_name_error

log = logging.getLogger(__name__)

#: File suffix (lower case) -> reader format. Longest suffix wins.
FORMATS = {
    ".txt": "text",
    ".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".json.gz": "jsonl",
    ".jsonl.zst": "jsonl", ".json.zst": "jsonl", ".jsonl.zstd": "jsonl",
    ".parquet": "parquet",
    ".warc": "warc", ".warc.gz": "warc", ".warc.zst": "warc",
}
HTML_EXTRACTORS = ("resiliparse", "trafilatura")
HF_PREFIX = "hf://"
# Record-level kinds a reader reports; file-level ones are "damaged_file" and "empty_file".
MALFORMED = ("not_json", "not_object", "missing_text", "text_not_string", "too_large")
# Past this many warnings per file, one summary line replaces the rest (a broken file can have
# millions of bad lines).
_MAX_WARNINGS_PER_FILE = 5
_MAX_EXAMPLES = 5
_CHUNK = 1 << 20
_DAMAGE = (EOFError, gzip.BadGzipFile, zlib.error)
_TEST_DIRS = {"test", "tests", "idle_test"}
_VENDOR_DIRS = {"site-packages", "dist-packages"}


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """How sources are read.

    ``text_field``: the JSONL field / Parquet or HF column holding the text. ``strict``: raise at
    the first bad input instead of counting it. ``max_document_bytes``: a record (JSONL line,
    ``.txt`` file, Parquet or HF text, WARC payload) larger than this is skipped as ``too_large``
    without being held in memory whole (``None``: no limit). ``html_extractor``: ``resiliparse``
    or ``trafilatura``. ``allow_network``: let ``hf://`` sources reach the Hugging Face Hub
    (off by default; local dataset directories always work).
    """

    text_field: str = "text"
    strict: bool = False
    max_document_bytes: int | None = 32 << 20
    html_extractor: str = "resiliparse"
    allow_network: bool = False

    @classmethod
    def from_mapping(cls, values: dict[str, Any] | None) -> ReadOptions:
        """Options from a plain dict (a task's config). Unknown keys are ignored so one config dict
        can carry the keys of several steps; bad values raise OlmoflowError."""
        names = {f.name for f in dataclasses.fields(cls)}
        opts = cls(**{k: v for k, v in (values or {}).items() if k in names})
        if opts.html_extractor not in HTML_EXTRACTORS:
            raise unknown_name_error("html_extractor", str(opts.html_extractor), HTML_EXTRACTORS)
        if opts.max_document_bytes is not None and opts.max_document_bytes < 1:
            raise OlmoflowError(f"max_document_bytes must be at least 1, got {opts.max_document_bytes}")
        return opts


@dataclasses.dataclass
class ReadLog:
    """What reading found besides documents: bad input by kind, records skipped, files read.

    ``errors[kind]`` is ``{"count", "examples"}``, the examples (the first few) as
    ``"file:line: reason"``. ``removed[kind]`` is ``{"documents", "bytes"}`` for records that were
    not kept (bytes: UTF-8 bytes of the record as read). ``files`` lists every file opened.
    """

    strict: bool = False
    errors: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    removed: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    files: list[Path] = dataclasses.field(default_factory=list)
    _warned: Counter = dataclasses.field(default_factory=Counter)

    def bad(self, kind: str, where: str, reason: str, nbytes: int = 0, documents: int = 1) -> None:
        """Count bad input ``kind`` at ``where`` (``file:line``); raise at once when strict.

        Raises:
            OlmoflowError: ``strict`` is set (message ``"<where>: <reason>"``).
        """
        if self.strict:
            raise OlmoflowError(f"{where}: {reason}")
        entry = self.errors.setdefault(kind, {"count": 0, "examples": []})
        entry["count"] += 1
        if len(entry["examples"]) < _MAX_EXAMPLES:
            entry["examples"].append(f"{where}: {reason}")
        if documents:
            self.skip(kind, nbytes, documents)
        file = where.rsplit(":", 1)[0] if re.search(r":\d+$", where) else where
        self._warned[file] += 1
        if self._warned[file] <= _MAX_WARNINGS_PER_FILE:
            log.warning("%s: %s%s", where, reason, " (skipped)" if documents else "")

    def skip(self, kind: str, nbytes: int, documents: int = 1) -> None:
        """Count ``documents`` records of ``nbytes`` bytes not kept for reason ``kind``."""
        entry = self.removed.setdefault(kind, {"documents": 0, "bytes": 0})
        entry["documents"] += documents
        entry["bytes"] += nbytes

    def count(self, *kinds: str) -> int:
        """How many bad inputs of these kinds were seen."""
        return sum(self.errors.get(k, {}).get("count", 0) for k in kinds)

    def summarize(self) -> None:
        """Log one line per file whose warnings were cut short."""
        for file, n in self._warned.items():
            if n > _MAX_WARNINGS_PER_FILE:
                log.warning("%s: %d bad records skipped in all", file, n)

    def error_counts(self) -> dict[str, int]:
        """``{kind: count}`` of the bad input seen, sorted by kind."""
        return {k: v["count"] for k, v in sorted(self.errors.items())}

    def error_examples(self) -> list[str]:
        """The first few ``"file:line: reason"`` of each kind, kinds sorted."""
        return [ex for _, v in sorted(self.errors.items()) for ex in v["examples"]]


@dataclasses.dataclass(frozen=True)
class Input:
    """One thing to read: a file (``path``), the stdlib, or an ``hf://`` spec (``path`` None).

    ``name`` is stable and machine-independent (ids and logs use it); ``source`` is the label of
    the source it came from (the documents' default ``source`` and their output directory).
    """

    format: str
    name: str
    source: str
    path: str | None = None
    spec: str | None = None


def _need(module: str, what: str):
    """Import an optional reader dependency, or raise a one-line install hint.

    Raises:
        OlmoflowError: ``module`` is not installed.
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        extra = "hf" if module == "datasets" else "data"
        raise OlmoflowError(
            f"{what} needs the '{module.split('.')[0]}' package: pip install 'olmoflow[{extra}]'"
        ) from None


def file_format(path: str | os.PathLike) -> str | None:
    """The reader format of a file from its name (``"jsonl"`` for ``x.jsonl.gz``), or None."""
    name = os.fspath(path).lower()
    best = max((s for s in FORMATS if name.endswith(s)), key=len, default=None)
    return FORMATS[best] if best else None


# --- decompression ----------------------------------------------------------------------------


class _ZstdRaw(io.RawIOBase):
    """A raw stream of zstd-decompressed bytes that, unlike ``zstandard``'s own stream reader,
    raises ``EOFError`` when the input ends inside a frame (a truncated file). Multi-frame files
    (pzstd, concatenated shards) are read across frames."""

    def __init__(self, f: IO[bytes]):
        self._f = f
        self._dctx = _need("zstandard", "reading .zst files").ZstdDecompressor()
        self._obj = None
        self._pending = b""
        self._out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._out:
            chunk, self._pending = (self._pending or self._f.read(_CHUNK)), b""
            if not chunk:
                if self._obj is not None:
                    raise EOFError("zstd file ended inside a frame (truncated)")
                return 0
            if self._obj is None:
                self._obj = self._dctx.decompressobj()
            self._out = memoryview(self._obj.decompress(chunk))
            if self._obj.eof:
                self._pending, self._obj = self._obj.unused_data, None
        n = min(len(b), len(self._out))
        b[:n] = self._out[:n]
        self._out = self._out[n:]
        return n


class _Read1:
    """``read(n)`` as one ``read1(n)`` of the wrapped stream, and ``tell``: what FastWARC needs.
    A plain ``read(n)`` of a damaged gzip stream raises and drops the bytes it had already
    decompressed; one chunk at a time, every record before the damage still comes through."""

    def __init__(self, f: IO[bytes]):
        self._f = f
        self._pos = 0

    def read(self, n: int = -1) -> bytes:
        data = self._f.read1(n if n and n > 0 else _CHUNK)
        self._pos += len(data)
        return data

    def tell(self) -> int:
        return self._pos


@contextlib.contextmanager
def open_binary(path: str | os.PathLike) -> Iterator[IO[bytes]]:
    """Open a file for binary reading, decompressing ``.gz`` and ``.zst``/``.zstd`` by name.

    Damage surfaces while reading: ``EOFError`` (truncated), ``gzip.BadGzipFile``, ``zlib.error``
    or ``zstandard.ZstdError`` (corrupt). Raises OlmoflowError when the file cannot be opened.
    """
    name = os.fspath(path).lower()
    try:
        raw = open(path, "rb")
    except OSError as e:
        raise OlmoflowError(f"cannot read '{path}': {e.strerror or e}") from None
    with raw:
        if name.endswith(".gz"):
            with gzip.GzipFile(fileobj=raw, mode="rb") as f:
                yield f
        elif name.endswith((".zst", ".zstd")):
            yield io.BufferedReader(_ZstdRaw(raw), buffer_size=_CHUNK)
        else:
            yield raw


def _damage_errors() -> tuple[type[BaseException], ...]:
    try:
        import zstandard
    except ImportError:
        return _DAMAGE
    return (*_DAMAGE, zstandard.ZstdError)


def _damage_kind(path: str) -> str:
    name = path.lower()
    return "gzip" if name.endswith(".gz") else "zstd" if name.endswith((".zst", ".zstd")) else "file"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _rel_path(inp: Input) -> str:
    return inp.name.split("/", 1)[1] if "/" in inp.name else inp.name


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


def _too_large(size: int, opts: ReadOptions) -> str:
    return f"document of {size} bytes is over max_document_bytes={opts.max_document_bytes}"


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
    ("invalid UTF-8", "invalid_utf8"), ("not JSON", "not_json"), ("not a JSON object", "not_object"),
    ("missing", "missing_text"), ("is not a string", "text_not_string"),
)


def read_jsonl(inp: Input, opts: ReadOptions, rl: ReadLog) -> Iterator[dict[str, Any]]:
    """Documents of a JSONL file (plain, gzip or zstd), one per non-blank line.

    Dolma records keep their ``id``, ``source``, ``added``, ``created`` and ``metadata``; other
    fields go into ``metadata`` with the ``path`` and ``line`` they came from.
    """
    path = inp.path
    rl.files.append(Path(path))
    lineno, records = 0, 0
    try:
        with open_binary(path) as f:
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
                    raw = raw[3:]  # a UTF-8 byte-order mark (Windows editors) is not part of the JSON
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
                yield jsonl_document(obj, opts.text_field, f"{inp.name}:{lineno}", inp.source, meta)
    except _damage_errors() as e:
        rl.bad("damaged_file", f"{path}:{lineno + 1}",
               f"damaged {_damage_kind(path)} data ({_first_line(e)}); kept the documents before it",
               documents=0)
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
        rels += [(rel_top / f).as_posix() for f in files if f.endswith(".py") and _is_stdlib_part(f)]
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
    except Exception as e:  # datasets raises many types (ConnectionError, ValueError, HfHubHTTPError...)
        raise OlmoflowError(f"cannot load Hugging Face dataset '{spec}': {_first_line(e)}") from None


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


def read_warc(inp: Input, opts: ReadOptions, rl: ReadLog) -> Iterator[dict[str, Any]]:
    """Documents of a WARC file: see :func:`olmoflow.data.warc.read_warc`."""
    from olmoflow.data.warc import read_warc as read

    return read(inp, opts, rl)


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
