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
from collections.abc import Callable, Iterator
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


@dataclasses.dataclass(frozen=True)
class SourceOptions(ReadOptions):
    """A data engine source's ``options``: how its files are read (:class:`ReadOptions`; a
    ``strict`` given here overrides the run's), ``max_shard_bytes`` (split a document shard past
    this many bytes; None: never) and ``follow_symlinks`` (read the files behind symbolic links
    that lead out of a source directory, which are skipped otherwise). Parsed by
    :func:`olmoflow.config.from_dict`; an ingest task carries one (:mod:`olmoflow.data.sources`).

    Raises:
        ConfigValueError: a value out of range (:class:`ReadOptions`' checks, ``max_shard_bytes``
            outside [1, 2**63)).
    """

    strict: bool | None = None
    max_shard_bytes: int | None = None
    follow_symlinks: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_shard_bytes is not None and not 1 <= self.max_shard_bytes < 2**63:
            raise ConfigValueError("max_shard_bytes", "must be in [1, 2**63), got "
                                                      f"{self.max_shard_bytes}")

    def read_options(self, strict: bool) -> ReadOptions:
        """The :class:`ReadOptions` part, with the run's ``strict`` unless this one sets it."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(ReadOptions)}
        return ReadOptions(**{**values, "strict": strict if self.strict is None else self.strict})


@dataclasses.dataclass
class ReadLog:
    """What reading found besides documents: bad input by kind, records skipped, files read.

    ``errors[kind]`` is ``{"count", "examples"}``, the examples (the first few) as
    ``"file:line: reason"``. ``removed[kind]`` is ``{"documents", "bytes"}`` for records that were
    not kept (bytes: UTF-8 bytes of the record as read). ``files`` lists every file opened.
    ``unverified`` names each file whose documents were kept without a checksum to check them
    against (zstd frames written without one), once, as ``"file: reason"``; not an error.
    """

    strict: bool = False
    errors: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    removed: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    files: list[Path] = dataclasses.field(default_factory=list)
    unverified: list[str] = dataclasses.field(default_factory=list)
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

    def unverifiable(self, file: str, reason: str) -> None:
        """Note once that ``file``'s documents could not be checked (``reason``), with a
        warning; the documents are kept and ``strict`` does not raise."""
        entry = f"{file}: {reason}"
        if entry not in self.unverified:
            self.unverified.append(entry)
            log.warning("%s (kept, unverified)", entry)

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


#: A gzip member or zstd frame whose decompressed size stays within this is held in memory until
#: it has been decoded to its end (and its checksum passed), then handed out: decoded once. A
#: larger one is decoded to its end first with its output dropped, then decoded again from its
#: start to hand its bytes out: twice the decompression, but memory stays within this bound for a
#: file of any size, and no byte of a member reaches a reader before the member is known good.
#: Holding parsed documents instead would cost several times the bytes and no less time; files of
#: many small members (bgzip blocks, pzstd frames, WARC's one member per record) pay once.
_HOLD_BYTES = 32 << 20
#: Input fed to the zstd decoder at a time: its output per call is bounded by what this holds.
_ZSTD_FEED = 1 << 16


class _CheckedStream(io.RawIOBase):
    """The decompressed bytes of a gzip or zstd file, one member (gzip) or frame (zstd) at a time,
    each handed out only once the whole member has been decoded and its checksum passed.

    gzip keeps a CRC-32 and the length at the end of each member, zstd an optional checksum at the
    end of each frame; a decoder that streams (as :class:`gzip.GzipFile` does) hands out a
    member's bytes before reaching them, so a flipped bit reached readers as wrong text. Here
    damage anywhere in a member (a checksum that fails, an invalid block, a file that ends inside
    it) raises before any of the member's bytes are read: the members before it come through
    whole, nothing of it or after it does. A truncated member counts as damaged too: its checksum
    is missing, and a flipped length or block bit can look just like a cut file.

    A zstd frame written without a checksum (python-zstandard's default; the ``zstd`` tool writes
    one) cannot be verified: ``unverified(reason)`` is called once per file when one holds data.
    Damage its decoder detects still drops the frame. Needs a seekable file (see
    :data:`_HOLD_BYTES`).
    """

    def __init__(self, f: IO[bytes], codec: str, unverified: Callable[[str], None] | None = None):
        self._f = f
        self._codec = codec
        self._unverified = unverified
        if codec == "zstd":
            self._zstd = _need("zstandard", "reading .zst files")
            self._dctx = self._zstd.ZstdDecompressor()
        self._chunks = self._verified()
        self._out = memoryview(b"")
        self._end = 0
        self._checked = True

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._out:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._out = memoryview(chunk)
        n = min(len(b), len(self._out))
        b[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _verified(self) -> Iterator[bytes]:
        start, noted = 0, False
        while True:
            self._f.seek(start)
            if not self._f.read(1):
                return  # the end of the file, between members
            held: list[bytes] | None = []
            size = 0
            for piece in self._decode(start):
                size += len(piece)
                if held is not None:
                    held.append(piece)
                    if size > _HOLD_BYTES:
                        held = None  # too large to hold: decode it again once it checked out
            end = self._end
            if size and not self._checked and not noted and self._unverified is not None:
                noted = True
                self._unverified("zstd frames without a content checksum: their documents "
                                 "could not be verified against damage")
            yield from held if held is not None else self._decode(start)
            start = end

    def _decode(self, start: int) -> Iterator[bytes]:
        """The decompressed bytes of the member at compressed offset ``start``, in pieces; sets
        ``_end`` (the offset after it) and ``_checked`` (whether it carried a checksum) once it
        ended. Raises the decoder's error, or EOFError when the file ends inside it."""
        f = self._f
        f.seek(start)
        fed = 0
        if self._codec == "gzip":
            dec = zlib.decompressobj(wbits=31)  # gzip framing: zlib checks CRC-32 and length
            self._checked = True
            while not dec.eof:
                data = f.read(_CHUNK)
                if not data:
                    raise EOFError("gzip file ended inside a member (truncated)")
                fed += len(data)
                while data and not dec.eof:
                    out = dec.decompress(data, _CHUNK)  # bounded output: a zip bomb stays small
                    data = dec.unconsumed_tail
                    if out:
                        yield out
        else:
            dec = self._dctx.decompressobj()
            head = f.read(_CHUNK)
            try:
                self._checked = bool(self._zstd.get_frame_parameters(head).has_checksum)
            except self._zstd.ZstdError:
                self._checked = False  # an unreadable header: decoding it below raises
            data = head
            while not dec.eof:
                if not data:
                    data = f.read(_CHUNK)
                    if not data:
                        raise EOFError("zstd file ended inside a frame (truncated)")
                piece, data = data[:_ZSTD_FEED], data[_ZSTD_FEED:]
                fed += len(piece)
                out = dec.decompress(piece)
                if out:
                    yield out
        self._end = start + fed - len(dec.unused_data)


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
def open_binary(path: str | os.PathLike,
                unverified: Callable[[str], None] | None = None) -> Iterator[IO[bytes]]:
    """Open a file for binary reading, decompressing ``.gz`` and ``.zst``/``.zstd`` by name.

    A compressed file's bytes come one whole, checked member (gzip) or frame (zstd) at a time
    (:class:`_CheckedStream`): damage surfaces while reading, before any byte of the damaged
    member, as ``EOFError`` (truncated), ``zlib.error`` or ``zstandard.ZstdError`` (corrupt; a
    failed checksum). ``unverified(reason)`` is called once when a zstd frame has no checksum.
    Raises OlmoflowError when the file cannot be opened.
    """
    name = os.fspath(path).lower()
    try:
        raw = open(path, "rb")
    except OSError as e:
        raise OlmoflowError(f"cannot read '{path}': {e.strerror or e}") from None
    with raw:
        if name.endswith(".gz"):
            yield io.BufferedReader(_CheckedStream(raw, "gzip"), buffer_size=_CHUNK)
        elif name.endswith((".zst", ".zstd")):
            yield io.BufferedReader(_CheckedStream(raw, "zstd", unverified), buffer_size=_CHUNK)
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
