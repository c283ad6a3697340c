"""Damaged compressed files, by seeded single-bit flips at many positions: no document whose
text is not in the original file ever comes through, a gzip (or checksummed zstd) file whose
bytes changed is counted damaged unless every document came through unchanged, the members
before the damage give all their documents, and a zstd file without checksums is named
unverifiable. Both ways a member is checked are covered: held in memory, and decoded twice."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest

from olmoflow.data import read_base
from olmoflow.data.config import CollectConfig
from olmoflow.data.readers import Input, ReadLog, ReadOptions, read_input
from olmoflow.data.sources import collect, ingest_shard

ROWS = [{"id": f"d{i}", "text": f"document {i}: " + " ".join(
    random.Random(i).choice(["river", "stone", "light", "grass", "cloud"]) for _ in range(i % 13))}
    for i in range(120)]
TEXTS = {r["text"] for r in ROWS}
PER_MEMBER = 40
FLIPS = 120


def _lines(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def _zstd(checksum: bool):
    import zstandard

    return zstandard.ZstdCompressor(level=3, write_checksum=checksum).compress


def _members(compress) -> bytes:
    return b"".join(compress(_lines(ROWS[i:i + PER_MEMBER]))
                    for i in range(0, len(ROWS), PER_MEMBER))


CODECS = {
    "gzip": ("x.jsonl.gz", lambda d: gzip.compress(d, mtime=0)),
    "zstd+checksum": ("x.jsonl.zst", _zstd(True)),
}


def _read(path: Path) -> tuple[list[dict], ReadLog]:
    rl = ReadLog()
    docs = list(read_input(Input("jsonl", f"s/{path.name}", "s", path=str(path)), ReadOptions(),
                           rl))
    return docs, rl


def _flips(blob: bytes, seed: int):
    rng = random.Random(seed)
    for _ in range(FLIPS):
        data = bytearray(blob)
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
        yield at, bytes(data)


@pytest.fixture(params=["held", "decoded twice"])
def hold(request, monkeypatch):
    if request.param == "decoded twice":  # every member is over the bound
        monkeypatch.setattr(read_base, "_HOLD_BYTES", 64)
    return request.param


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_a_flipped_bit_never_gives_a_document_not_in_the_file(tmp_path, codec, hold):
    name, compress = CODECS[codec]
    blob = _members(compress)
    path = tmp_path / name
    path.write_bytes(blob)
    docs, rl = _read(path)
    assert [d["text"] for d in docs] == [r["text"] for r in ROWS] and rl.errors == {}
    damaged = 0
    for at, data in _flips(blob, seed=len(codec)):
        path.write_bytes(data)
        docs, rl = _read(path)
        texts = [d["text"] for d in docs]
        assert set(texts) <= TEXTS, (codec, at, set(texts) - TEXTS)
        assert rl.unverified == []
        if rl.count("damaged_file"):
            damaged += 1
            # Whole members before the damage, in order, nothing of the damaged one.
            assert len(texts) % PER_MEMBER == 0 and len(texts) < len(ROWS), (codec, at)
            assert texts == [r["text"] for r in ROWS[:len(texts)]], (codec, at)
        else:  # a bit no checksum covers and no decoder reads (gzip's mtime, padding bits)
            assert texts == [r["text"] for r in ROWS], (codec, at)
    assert damaged >= FLIPS * 9 // 10, damaged


def test_zstd_without_checksums_is_named_unverifiable(tmp_path):
    blob = _members(_zstd(False))
    path = tmp_path / "x.jsonl.zst"
    path.write_bytes(blob)
    docs, rl = _read(path)
    assert len(docs) == len(ROWS) and rl.errors == {}
    assert rl.unverified == [f"{path}: zstd frames without a content checksum: their documents "
                             "could not be verified against damage"]  # once, not per frame
    for at, data in _flips(blob, seed=7):
        path.write_bytes(data)
        docs, rl = _read(path)
        # A flip is either caught by the decoder or the file is named: never silent.
        assert rl.count("damaged_file") or len(rl.unverified) == 1, at


def test_collect_and_ingest_report_the_same(tmp_path):
    gz, zst = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.zst"
    data = bytearray(_members(lambda d: gzip.compress(d, 0, mtime=0)))  # stored: text visible
    at = bytes(data).index(b"document 50:")
    # In the second member "document 50" now reads "document 52", which only its CRC shows.
    data[at + len("document 5")] ^= 0x02
    gz.write_bytes(bytes(data))
    zst.write_bytes(_members(_zstd(False)))
    result = collect(CollectConfig(sources=[str(gz), str(zst)]), tmp_path / "out", progress=False)
    c = result.counts
    assert c["damaged_files"] == 1 and c["documents"] == PER_MEMBER + len(ROWS)
    assert c["unverifiable"] == [f"{zst}: zstd frames without a content checksum: their "
                                 "documents could not be verified against damage"]
    stats = [ingest_shard({"input": str(p), "source": "s",
                           "output": str(tmp_path / "shards" / f"{p.stem}.jsonl.gz")})
             for p in (gz, zst)]
    assert [s["documents_out"] for s in stats] == [PER_MEMBER, len(ROWS)]
    assert stats[0]["error_counts"] == {"damaged_file": 1} and stats[0]["unverifiable"] == []
    assert stats[1]["unverifiable"] == c["unverifiable"]
    assert [e.split(": ", 1)[1] for e in stats[0]["errors"]] == [
        e.split(": ", 1)[1] for e in c["error_examples"]]


_PEAK_SCRIPT = r"""
import re, sys
from olmoflow.data.readers import Input, ReadLog, ReadOptions, read_input
def peak_mb():  # this process's own peak (ru_maxrss would carry the parent's over exec)
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) / 1024
base, rl = peak_mb(), ReadLog()
inp = Input("jsonl", "s/big.jsonl.gz", "s", path=sys.argv[1])
assert not list(read_input(inp, ReadOptions(max_document_bytes=1024), rl))
assert rl.error_counts() == {"too_large": 1536}, rl.error_counts()
print(peak_mb() - base)
"""


def test_a_member_too_large_to_hold_is_decoded_twice_in_bounded_memory(tmp_path):
    """96 MiB in one gzip member: checked first, then read again, never held whole."""
    import subprocess
    import sys

    if not Path("/proc/self/status").is_file():
        pytest.skip("needs /proc/self/status (Linux) to read the peak memory")

    line = b'{"text": "' + b"a steady stream of words " * 2620 + b'"}\n'  # 64 KiB
    path = tmp_path / "big.jsonl.gz"
    path.write_bytes(gzip.compress(line * 1536, 1, mtime=0))
    proc = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    grew = float(proc.stdout.strip().splitlines()[-1])
    assert grew < 32 + 16, grew  # the bound and the buffers, never the 96 MiB


def test_the_engine_report_names_unverifiable_input(tmp_path):
    from olmoflow.data.engine import Engine, load_data_config
    from olmoflow.data.engine.report import report, step_manifests

    (tmp_path / "in").mkdir()
    zst = tmp_path / "in" / "b.jsonl.zst"
    zst.write_bytes(_members(_zstd(False)))
    cfg = tmp_path / "data.yaml"
    cfg.write_text(f"output: {tmp_path / 'run'}\nexecutor: serial\nsteps: [ingest]\n"
                   f"sources:\n  - {{name: web, paths: [\"{tmp_path / 'in'}\"]}}\n")
    Engine(load_data_config(cfg)).run()
    counts = step_manifests(tmp_path / "run")["ingest"]["counts"]
    assert counts["unverifiable"] == [f"{zst}: zstd frames without a content checksum: their "
                                      "documents could not be verified against damage"]
    text, _ = report(tmp_path / "run", histograms=False)
    assert f"Unverifiable input (kept: no checksum to check it against damage)\ningest: {zst}: " \
        in text
