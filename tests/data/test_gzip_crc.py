"""A gzip whose CRC fails: the documents of the member were decoded (and passed on) before the
checksum at its end could be checked, so the warning says exactly which were kept, unverified."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from olmoflow.data.readers import Input, ReadLog, ReadOptions, read_input

ROWS = [{"text": f"document number {i}"} for i in range(3)]


def _gz(path: Path, data: bytes, level: int = 9) -> Path:
    path.write_bytes(gzip.compress(data, compresslevel=level, mtime=0))
    return path


def _read(path: Path) -> tuple[list[dict], ReadLog]:
    rl = ReadLog()
    docs = list(read_input(Input("jsonl", f"x/{path.name}", "x", path=str(path)), ReadOptions(),
                           rl))
    return docs, rl


def _lines() -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in ROWS)


def test_crc_failure_says_the_documents_kept_are_unverified(tmp_path):
    # Stored (level 0) deflate: a flipped byte in the data changes a document's text and only the
    # CRC at the end of the member notices.
    path = _gz(tmp_path / "crc.jsonl.gz", _lines(), level=0)
    data = bytearray(path.read_bytes())
    at = bytes(data).index(b"number 1") + len("number ")
    data[at] = ord("X")
    path.write_bytes(bytes(data))
    docs, rl = _read(path)
    assert [d["text"] for d in docs] == ["document number 0", "document number X",
                                         "document number 2"]  # the corrupt one came through
    assert rl.error_counts() == {"damaged_file": 1}
    (msg,) = rl.error_examples()
    assert "CRC check failed" in msg
    assert "kept the 3 documents of lines 1-3" in msg and "may be corrupt" in msg
    assert "kept the documents before it" not in msg


def test_truncated_gzip_names_the_documents_it_kept(tmp_path):
    lines = _lines() * 2000  # long enough that a cut file still decodes whole lines
    path = _gz(tmp_path / "cut.jsonl.gz", lines)
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    docs, rl = _read(path)
    (msg,) = rl.error_examples()
    assert f"kept the {len(docs)} documents of lines 1-{len(docs)} before it" in msg
    assert "may be corrupt" not in msg
