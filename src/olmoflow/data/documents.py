"""Dolma-format document files: gzipped JSONL, one document object per line.

A document is ``{"id", "text", "source", ["added"], ["created"], "metadata"}``. Files are written
atomically and deterministically (gzip header with mtime 0 and no file name), so the same documents
always give byte-identical files and a stage's output hash only changes when its content does.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from olmoflow.artifacts import atomic_open
from olmoflow.errors import OlmoflowError

#: File name of the documents a data stage (collect, clean) writes into its directory.
DOCUMENTS = "documents.jsonl.gz"

# Dolma's field order first; any other keys follow in the order the document has them.
_KEY_ORDER = ("id", "text", "source", "added", "created", "metadata")
_REQUIRED = ("id", "text", "source")
# Write compressed data in blocks: one GzipFile.write per line is several times slower.
_BLOCK_BYTES = 1 << 20
# Level 1: on web text zlib compresses at ~29 MB/s and a ratio of 0.45 against ~6 MB/s and 0.40
# at the default level 6 (measured on this project's 2-core machines), and these are
# intermediate files that every data step reads and writes: speed wins.
COMPRESS_LEVEL = 1


def encode_document(doc: dict[str, Any]) -> bytes:
    """One document as a UTF-8 JSON line (with its trailing newline), keys in Dolma's order.

    Raises:
        ValueError: ``id``, ``text`` or ``source`` is missing or not a string (a bug in the caller).
    """
    for key in _REQUIRED:
        if not isinstance(doc.get(key), str):
            raise ValueError(f"document field '{key}' must be a string, got {doc.get(key)!r}")
    ordered = {k: doc[k] for k in _KEY_ORDER if k in doc}
    ordered.update((k, v) for k, v in doc.items() if k not in ordered)
    try:
        line = json.dumps(ordered, ensure_ascii=False)
        return line.encode("utf-8") + b"\n"
    except UnicodeEncodeError:
        # A lone surrogate (legal in JSON input, illegal in UTF-8) somewhere in the metadata:
        # escaping everything keeps the line valid JSON and valid UTF-8.
        return json.dumps(ordered, ensure_ascii=True).encode("ascii") + b"\n"


class _GzipLines:
    """Lines into a deterministic gzip stream (mtime 0, no file name), written in blocks."""

    def __init__(self, raw):
        # filename="" keeps atomic_open's random temporary name out of the gzip header.
        self._gz = gzip.GzipFile(
            filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=COMPRESS_LEVEL
        )
        self._block: list[bytes] = []
        self._size = 0

    def write(self, line: bytes) -> None:
        if len(line) >= _BLOCK_BYTES:  # a huge document is written as is, never copied into a block
            self._flush()
            self._gz.write(line)
            return
        self._block.append(line)
        self._size += len(line)
        if self._size >= _BLOCK_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self._block:
            self._gz.write(b"".join(self._block))
            self._block, self._size = [], 0

    def close(self) -> None:
        self._flush()
        self._gz.close()


def write_documents(path: str | os.PathLike, docs: Iterable[dict[str, Any]]) -> int:
    """Write ``docs`` to ``path`` as gzipped JSONL, atomically; return the number written.

    The file appears only once complete (see :func:`olmoflow.artifacts.atomic_open`); if ``docs``
    raises while being consumed, ``path`` is left as it was.
    """
    n = 0
    with atomic_open(path, "wb") as raw, contextlib.closing(_GzipLines(raw)) as out:
        for doc in docs:
            out.write(encode_document(doc))
            n += 1
    return n


class ShardWriter:
    """Documents into ``<stem>.jsonl.gz``, then (past ``max_shard_bytes``) ``<stem>-0001.jsonl.gz``,
    ``<stem>-0002.jsonl.gz``, ... beside it.

    A new shard starts once the current one holds ``max_shard_bytes`` bytes of uncompressed JSONL
    (None: one shard), so the split depends only on the documents: the same documents always
    give byte-identical shards. Each shard is written atomically; :meth:`close` writes an empty
    first shard when there were no documents (so the output always exists) and deletes shards of
    the same stem numbered past the last one written (left by an earlier run with a smaller
    split). Used as a context manager, an exception discards the shard being written.

    Raises:
        ValueError: ``path`` does not end in ``.jsonl.gz``.
        OlmoflowError: ``max_shard_bytes`` below 1.
    """

    SUFFIX = ".jsonl.gz"

    def __init__(self, path: str | os.PathLike, max_shard_bytes: int | None = None):
        path = Path(path)
        if not path.name.endswith(self.SUFFIX):
            raise ValueError(f"shard path must end in {self.SUFFIX}: {path}")
        if max_shard_bytes is not None and max_shard_bytes < 1:
            raise OlmoflowError(f"max_shard_bytes must be at least 1, got {max_shard_bytes}")
        self.directory = path.parent
        self.stem = path.name[: -len(self.SUFFIX)]
        self.max_shard_bytes = max_shard_bytes
        self.paths: list[Path] = []
        self.documents = 0
        self._stack: contextlib.ExitStack | None = None
        self._out: _GzipLines | None = None
        self._bytes = 0

    def shard_path(self, k: int) -> Path:
        """Where shard ``k`` goes."""
        name = self.stem if k == 0 else f"{self.stem}-{k:04d}"
        return self.directory / f"{name}{self.SUFFIX}"

    def _open(self) -> None:
        path = self.shard_path(len(self.paths))
        self._stack = contextlib.ExitStack()
        self._out = _GzipLines(self._stack.enter_context(atomic_open(path, "wb")))
        self.paths.append(path)
        self._bytes = 0

    def write(self, doc: dict[str, Any]) -> int:
        """Append one document; return the bytes of its JSON line (uncompressed)."""
        line = encode_document(doc)
        if self._out is None:
            self._open()
        self._out.write(line)
        self._bytes += len(line)
        self.documents += 1
        if self.max_shard_bytes is not None and self._bytes >= self.max_shard_bytes:
            self._finish()
        return len(line)

    def _finish(self) -> None:
        out, stack, self._out, self._stack = self._out, self._stack, None, None
        out.close()
        stack.close()  # fsync and rename the shard into place

    def close(self) -> list[Path]:
        """Finish the last shard, delete stale higher-numbered ones, return the shards written."""
        if not self.paths:
            self._open()
        if self._out is not None:
            self._finish()
        pattern = re.compile(rf"{re.escape(self.stem)}-(\d{{4,}})\.jsonl\.gz")
        if self.directory.is_dir():
            for p in self.directory.iterdir():
                m = pattern.fullmatch(p.name)
                if m and int(m.group(1)) >= len(self.paths):
                    p.unlink(missing_ok=True)
        return list(self.paths)

    def abort(self, exc: BaseException | None = None) -> None:
        """Discard the shard being written (its temporary file); finished shards stay."""
        out, stack, self._out, self._stack = self._out, self._stack, None, None
        if stack is not None:
            err = exc if exc is not None else RuntimeError("aborted")
            with contextlib.suppress(Exception):
                out.close()  # else the GzipFile would write its trailer into a closed file later
            with contextlib.suppress(BaseException):
                stack.__exit__(type(err), err, err.__traceback__)
            if self.paths:
                self.paths.pop()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
        else:
            self.abort(exc)


def read_documents(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Yield the documents of a ``.jsonl.gz`` (or plain ``.jsonl``) file written by olmoflow.

    Blank lines are ignored. This reader is for olmoflow's own artifacts and so is strict; user data
    goes through :func:`olmoflow.data.sources.collect`, which tolerates damage.

    Raises:
        OlmoflowError: the file is missing, or is damaged (bad gzip, truncated, invalid JSON).
    """
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)
    except FileNotFoundError:
        raise OlmoflowError(f"no such file: '{path}'") from None
    except (EOFError, gzip.BadGzipFile, zlib.error, ValueError, RecursionError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise OlmoflowError(
            f"damaged documents file '{path}' ({reason}); rerun the stage that wrote it"
        ) from None


def document_texts(paths: Sequence[str | os.PathLike]) -> Iterator[str]:
    """The ``text`` of every document of these documents files (:func:`read_documents`), in
    order: what the tokenizer trainer reads.

    Raises:
        OlmoflowError: as :func:`read_documents`.
    """
    for path in paths:
        for doc in read_documents(path):
            yield doc["text"]


def parse_jsonl_line(raw: bytes, text_field: str = "text") -> tuple[dict[str, Any] | None, str]:
    """Parse one line of user JSONL: ``(object, "")`` when usable, else ``(None, reason)``.

    Usable means valid UTF-8, a JSON object, and ``text_field`` holding a string that is valid
    Unicode. Reasons about encoding start with ``"invalid UTF-8"`` so callers can count them apart.
    """
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"invalid UTF-8 at byte {e.start}"
    try:
        obj = json.loads(line)
    except ValueError as e:
        return None, f"not JSON ({getattr(e, 'msg', e)})"
    except RecursionError:
        # The decoder recurses per nesting level; a line nested ~1,000 deep exhausts the stack.
        return None, "not JSON (nested too deeply)"
    if not isinstance(obj, dict):
        return None, f"not a JSON object (a {type(obj).__name__})"
    if text_field not in obj:
        return None, f"field '{text_field}' missing"
    if not isinstance(obj[text_field], str):
        return None, f"field '{text_field}' is not a string"
    try:
        obj[text_field].encode("utf-8")
    except UnicodeEncodeError:  # JSON's "\ud800" escapes decode to lone surrogates
        return None, f"invalid UTF-8 in field '{text_field}' (a lone surrogate)"
    return obj, ""


def jsonl_document(
    obj: dict[str, Any], text_field: str, default_id: str, default_source: str,
    metadata: dict[str, Any],
) -> dict[str, Any]:
    """A Dolma document from a parsed JSONL object (which is consumed).

    ``id`` (made a string), ``source``, ``added`` and ``created`` are kept; ``default_id`` and
    ``default_source`` fill a missing id or source. Every other field, and the object's own
    ``metadata`` mapping, are merged into ``metadata`` (the object's values win).
    """
    text = obj.pop(text_field)
    doc_id = obj.pop("id", None)
    source = obj.pop("source", None)
    meta = dict(metadata)
    own_meta = obj.pop("metadata", None)
    if isinstance(own_meta, dict):
        meta.update(own_meta)
    elif own_meta is not None:
        meta["metadata"] = own_meta
    doc = {
        "id": default_id if doc_id is None else str(doc_id),
        "text": text,
        "source": source if isinstance(source, str) and source else default_source,
    }
    doc.update((k, obj.pop(k)) for k in ("added", "created") if k in obj)
    meta.update(obj)
    doc["metadata"] = meta
    return doc
