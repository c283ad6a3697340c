"""What every reader shares: options, the log of bad input, inputs, format detection, and opening
(possibly compressed, possibly damaged) files. :mod:`olmoflow.data.readers` (one reader per format)
and :mod:`olmoflow.data.warc` build on it; it imports neither."""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import importlib
import io
import logging
import os
import re
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from olmoflow.config import ConfigValueError
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


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """How sources are read.

    ``text_field``: the JSONL field / Parquet or HF column holding the text. ``strict``: raise at
    the first bad input instead of counting it. ``max_document_bytes``: a record (JSONL line,
    ``.txt`` file, Parquet or HF text, WARC payload) larger than this is skipped as ``too_large``
    without being held in memory whole (``None``: no limit). ``html_extractor``: ``resiliparse``
    or ``trafilatura``. ``allow_network``: let ``hf://`` sources reach the Hugging Face Hub
    (off by default; local dataset directories always work). Parsed from a config mapping by
    :func:`olmoflow.config.from_dict` (unknown keys named with the closest valid one).

    Raises:
        ConfigValueError: an unknown ``html_extractor`` or a ``max_document_bytes`` outside
            [1, 2**63).
    """

    text_field: str = "text"
    strict: bool = False
    max_document_bytes: int | None = 32 << 20
    html_extractor: str = "resiliparse"
    allow_network: bool = False

    def __post_init__(self) -> None:
        if self.html_extractor not in HTML_EXTRACTORS:
            raise ConfigValueError("html_extractor", unknown_name_error(
                "html_extractor", str(self.html_extractor), HTML_EXTRACTORS).args[0])
        if self.max_document_bytes is not None and not 1 <= self.max_document_bytes < 2**63:
            # Beyond a C integer, the reader's limits fail with OverflowError mid-ingest.
            raise ConfigValueError("max_document_bytes", "must be in [1, 2**63), got "
                                                         f"{self.max_document_bytes}")


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
    if name.endswith(".gz"):
        return "gzip"
    return "zstd" if name.endswith((".zst", ".zstd")) else "file"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _rel_path(inp: Input) -> str:
    return inp.name.split("/", 1)[1] if "/" in inp.name else inp.name


def _too_large(size: int, opts: ReadOptions) -> str:
    return f"document of {size} bytes is over max_document_bytes={opts.max_document_bytes}"
