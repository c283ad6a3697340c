"""A gzip whose CRC fails: the member's bytes are checked before any of its lines is read, so the
damaged member gives no document (not even those decoded before its checksum), the members before
it give all of theirs, and the message says exactly which were kept."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from olmoflow.data.readers import Input, ReadLog, ReadOptions, read_input

ROWS = [{"text": f"document number {i}"} for i in range(3)]


def _read(path: Path) -> tuple[list[dict], ReadLog]:
    rl = ReadLog()
    docs = list(read_input(Input("jsonl", f"x/{path.name}", "x", path=str(path)), ReadOptions(),
                           rl))
    return docs, rl


def _lines(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def _flip_in_stored_member(data: bytes, needle: bytes) -> bytes:
    # Stored (level 0) deflate: a changed byte in the data changes a document's text and only
    # the CRC at the end of the member notices.
    out = bytearray(data)
    out[data.index(needle) + len(needle) - 1] ^= 0x01
    return bytes(out)


def test_a_crc_failure_keeps_nothing_of_the_member(tmp_path):
    path = tmp_path / "crc.jsonl.gz"
    path.write_bytes(_flip_in_stored_member(gzip.compress(_lines(ROWS), 0, mtime=0), b"number 1"))
    docs, rl = _read(path)
    assert docs == []  # before: all 3 came through, one with "number 0" as its text
    assert rl.error_counts() == {"damaged_file": 1}
    (msg,) = rl.error_examples()
    assert "incorrect data check" in msg and "kept no documents" in msg, msg


def test_a_crc_failure_keeps_the_members_before_it(tmp_path):
    more = [{"text": f"second member {i}"} for i in range(4)]
    good = gzip.compress(_lines(ROWS), 0, mtime=0)
    bad = _flip_in_stored_member(gzip.compress(_lines(more), 0, mtime=0), b"member 2")
    path = tmp_path / "two.jsonl.gz"
    path.write_bytes(good + bad)
    docs, rl = _read(path)
    assert [d["text"] for d in docs] == [r["text"] for r in ROWS]
    (msg,) = rl.error_examples()
    assert msg.startswith(f"{path}:4: damaged gzip data")
    assert "kept the 3 documents of lines 1-3, those of the members before the damaged" in msg


def test_a_line_across_members_is_kept_only_when_both_check_out(tmp_path):
    data = _lines(ROWS)
    cut = data.index(b"number 1") + 3  # the second line starts in member one, ends in two
    one, two = (gzip.compress(part, 0, mtime=0) for part in (data[:cut], data[cut:]))
    path = tmp_path / "split.jsonl.gz"
    path.write_bytes(one + two)
    docs, rl = _read(path)
    assert [d["text"] for d in docs] == [r["text"] for r in ROWS] and rl.errors == {}
    path.write_bytes(one + _flip_in_stored_member(two, b"number 2"))
    docs, rl = _read(path)
    assert [d["text"] for d in docs] == ["document number 0"]
    assert rl.error_counts() == {"damaged_file": 1}


def test_a_truncated_member_keeps_nothing_of_it(tmp_path):
    members = [gzip.compress(_lines([{"text": f"m{m} d{i}"} for i in range(50)]), mtime=0)
               for m in range(3)]
    path = tmp_path / "cut.jsonl.gz"
    whole = b"".join(members)
    path.write_bytes(whole[: len(members[0]) + len(members[1]) // 2])
    docs, rl = _read(path)
    assert [d["text"] for d in docs] == [f"m0 d{i}" for i in range(50)]
    (msg,) = rl.error_examples()
    assert "ended inside a member (truncated)" in msg
    assert "kept the 50 documents of lines 1-50" in msg
