"""Dolma-format document files: gzipped JSONL, one document object per line.

A document is ``{"id", "text", "source", ["added"], ["created"], "metadata"}``. Files are written
atomically and deterministically (gzip header with mtime 0 and no file name), so the same documents
always give byte-identical files and a stage's output hash only changes when its content does.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterable, Iterator
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
# Level 6 is zlib's default trade-off; level 9 triples the time for ~1% smaller files.
_COMPRESS_LEVEL = 6


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


def write_documents(path: str | os.PathLike, docs: Iterable[dict[str, Any]]) -> int:
    """Write ``docs`` to ``path`` as gzipped JSONL, atomically; return the number written.

    The file appears only once complete (see :func:`olmoflow.artifacts.atomic_open`); if ``docs``
    raises while being consumed, ``path`` is left as it was.
    """
    n = 0
    block: list[bytes] = []
    size = 0
    with (
        atomic_open(path, "wb") as raw,
        # filename="" keeps atomic_open's random temporary name out of the gzip header.
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=_COMPRESS_LEVEL)
        as gz,
    ):
        for doc in docs:
            line = encode_document(doc)
            block.append(line)
            size += len(line)
            n += 1
            if size >= _BLOCK_BYTES:
                gz.write(b"".join(block))
                block, size = [], 0
        gz.write(b"".join(block))
    return n


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
    except (EOFError, gzip.BadGzipFile, zlib.error, ValueError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise OlmoflowError(
            f"damaged documents file '{path}' ({reason}); rerun the stage that wrote it"
        ) from None


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
