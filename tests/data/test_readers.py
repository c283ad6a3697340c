"""Readers and the ingest shard job: every format round-trips with stable ids, the real WARC gives
documents with URLs, and every kind of bad input is counted with file:line (strict: one-line
error)."""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import random
import sys
import uuid
from pathlib import Path

import pytest

from olmoflow.data.documents import ShardWriter, read_documents
from olmoflow.data.readers import (
    Input,
    ReadLog,
    ReadOptions,
    file_format,
    open_binary,
    parse_hf_spec,
    read_input,
)
from olmoflow.data.sources import ingest_shard, ingest_tasks
from olmoflow.data.warc import html_to_text
from olmoflow.errors import OlmoflowError

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
WEB = SHARED_DATA / "web-crawl"

ROWS = [{"text": f"document number {i}: " + "lorem ipsum " * (i % 7), "label": i % 2}
        for i in range(40)]
# Incompressible text, so that damage half-way through a compressed file is many blocks in.
BIG = [{"text": f"doc {i} " + random.Random(i).randbytes(150).hex()} for i in range(1000)]


def jsonl_bytes(rows: list) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()


def zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=3, write_checksum=True).compress(data)


def http_response(html: str, status: str = "200 OK", ctype: str = "text/html; charset=utf-8"):
    return f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n\r\n".encode() + html.encode()


def warc_record(kind: str, uri: str, payload: bytes, n: int) -> bytes:
    ctype = ("application/http; msgtype=response" if kind == "response"
             else "application/warc-fields")
    head = (f"WARC/1.0\r\nWARC-Type: {kind}\r\nWARC-Record-ID: <urn:uuid:{uuid.UUID(int=n)}>\r\n"
            f"WARC-Date: 2024-04-25T16:24:{n % 60:02d}Z\r\nWARC-Target-URI: {uri}\r\n"
            f"Content-Type: {ctype}\r\nContent-Length: {len(payload)}\r\n\r\n")
    return head.encode() + payload + b"\r\n\r\n"


def page(i: int) -> str:
    body = "".join(f"<p>Paragraph {j} of page {i} says something worth keeping.</p>"
                   for j in range(5))
    return (f"<html><head><title>t{i}</title></head><body><nav>menu</nav>"
            f"<main>{body}</main></body></html>")


def make_warc(path: Path, n: int = 6) -> Path:
    recs = [warc_record("warcinfo", "", b"software: test\r\n", 0)]
    for i in range(1, n + 1):
        recs.append(warc_record("response", f"https://example.org/p{i}", http_response(page(i)), i))
    recs.append(warc_record("response", "https://example.org/img",
                            http_response("x", ctype="image/png"), 90))
    recs.append(warc_record("response", "https://example.org/gone",
                            http_response("<p>no</p>", "404 Not Found"), 91))
    # Per-record gzip members, as Common Crawl writes them.
    path.write_bytes(b"".join(gzip.compress(r, mtime=0) for r in recs))
    return path


def read(path: Path, *, strict: bool = False, name: str | None = None, **opts):
    """Documents and the ReadLog of one file."""
    inp = Input(file_format(path), name or f"src/{path.name}", "src", path=str(path))
    rl = ReadLog(strict=strict)
    docs = list(read_input(inp, ReadOptions(strict=strict, **opts), rl))
    return docs, rl


def ingest(tmp: Path, src: Path, stem: str = "shard", **task) -> tuple[dict, list[dict]]:
    out = tmp / "documents" / "src" / f"{stem}.jsonl.gz"
    stats = ingest_shard({"input": str(src), "source": "src", "output": str(out), **task})
    docs = [d for p in stats["outputs"] for d in read_documents(p)]
    return stats, docs


def sha(paths) -> list[str]:
    return [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths]


# --- formats round-trip with stable ids ---------------------------------------------------------


def write_format(tmp: Path, fmt: str) -> Path:
    if fmt == "jsonl":
        return _write(tmp / "d.jsonl", jsonl_bytes(ROWS))
    if fmt == "jsonl.gz":
        return _write(tmp / "d.jsonl.gz", gzip.compress(jsonl_bytes(ROWS)))
    if fmt == "jsonl.zst":
        return _write(tmp / "d.jsonl.zst", zstd(jsonl_bytes(ROWS)))
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp / "d.parquet"
        # Small row groups and batches: the reader must stitch them back in order.
        pq.write_table(pa.Table.from_pylist(ROWS), path, row_group_size=7)
        return path
    raise KeyError(fmt)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "jsonl.zst", "parquet"])
def test_record_formats_round_trip_with_stable_ids(tmp_path, fmt):
    path = write_format(tmp_path, fmt)
    docs, rl = read(path)
    assert [d["text"] for d in docs] == [r["text"] for r in ROWS]
    assert [d["metadata"]["label"] for d in docs] == [r["label"] for r in ROWS]
    key = "row" if fmt == "parquet" else "line"
    assert [d["id"] for d in docs] == [f"src/{path.name}:{i}" for i in range(1, len(ROWS) + 1)]
    assert all(d["metadata"][key] == i + 1 and d["source"] == "src" for i, d in enumerate(docs))
    assert rl.errors == {} and rl.removed == {}
    again, _ = read(path)
    assert again == docs
    # Split into shards of ~1 KB: the same documents, ids and order as one shard.
    whole, one = ingest(tmp_path / "a", path)
    split, many = ingest(tmp_path / "b", path, max_shard_bytes=1000)
    assert len(whole["outputs"]) == 1 and len(split["outputs"]) > 3
    assert many == one == docs
    assert split["documents_out"] == whole["documents_out"] == len(ROWS)


def test_text_file_is_one_document_and_bom_dropped(tmp_path):
    path = _write(tmp_path / "a.txt", "\ufeffline one\r\nline two".encode())
    docs, rl = read(path)
    assert docs == [{"id": "src/a.txt", "text": "line one\r\nline two", "source": "src",
                     "metadata": {"path": "a.txt"}}]


def test_warc_documents_urls_and_skipped_records(tmp_path):
    path = make_warc(tmp_path / "c.warc.gz", n=6)
    docs, rl = read(path)
    assert ([d["metadata"]["url"] for d in docs]
            == [f"https://example.org/p{i}" for i in range(1, 7)])
    assert [d["id"] for d in docs] == [f"urn:uuid:{uuid.UUID(int=i)}" for i in range(1, 7)]
    assert all("Paragraph 4 of page" in d["text"] and "<p>" not in d["text"] for d in docs)
    assert docs[0]["created"] == "2024-04-25T16:24:01Z" and docs[0]["metadata"]["record"] == 2
    # The image and the 404 are accounted for, not errors.
    assert set(rl.removed) == {"not_text", "http_status"} and rl.errors == {}
    assert read(path)[0] == docs
    plain = _write(tmp_path / "p.warc", gzip.decompress(path.read_bytes()))
    assert read(plain, name="src/c.warc.gz")[0] == docs
    stats, shards = ingest(tmp_path, path, max_shard_bytes=300)
    assert shards == docs and len(stats["outputs"]) == 6
    assert (stats["removed"]["not_text"]["documents"]
            == stats["removed"]["http_status"]["documents"] == 1)


def test_real_warc_gives_documents_with_urls(tmp_path):
    warc = WEB / "dolma_sample-0000.warc.gz"
    if not warc.is_file():
        pytest.skip(f"../shared/data absent: {warc}")
    docs, rl = read(warc)
    assert len(docs) >= 20 and rl.errors == {}
    assert all(d["metadata"]["url"].startswith("http") for d in docs)
    assert len({d["id"] for d in docs}) == len(docs)
    assert sum(len(d["text"]) > 500 for d in docs) >= 15
    assert "Dolma" in " ".join(d["text"] for d in docs)
    # Decoded as UTF-8 (the charset the server declared), not mojibake.
    assert not any("â€" in d["text"] or "Ã©" in d["text"] for d in docs)
    assert not any("<div" in d["text"] for d in docs)


def test_trafilatura_extractor_also_works():
    text = html_to_text(page(1), "trafilatura")
    assert "Paragraph 3 of page 1" in text and "<p>" not in text
    with pytest.raises(OlmoflowError, match="did you mean 'trafilatura'"):
        ReadOptions(html_extractor="trafilatora")


def test_real_dolma_files_keep_id_source_and_metadata(tmp_path):
    path = WEB / "dolma_documents_000.json.gz"
    if not path.is_file():
        pytest.skip(f"../shared/data absent: {path}")
    with gzip.open(path, "rt") as f:
        raw = [json.loads(line) for line in f]
    docs, rl = read(path)
    assert [d["id"] for d in docs] == [r["id"] for r in raw]
    assert [d["source"] for d in docs] == [r["source"] for r in raw] == ["common-crawl"] * 10
    for d, r in zip(docs, raw):
        assert d["text"] == r["text"] and d["added"] == r["added"] and d["created"] == r["created"]
        assert {k: d["metadata"][k] for k in r["metadata"]} == r["metadata"]


def test_real_web_crawl_ingest_is_deterministic(tmp_path):
    if not WEB.is_dir():
        pytest.skip(f"../shared/data absent: {WEB}")
    runs = []
    for run in ("a", "b"):
        tasks = ingest_tasks("web", [str(WEB)], tmp_path / run / "documents")
        runs.append([ingest_shard(t) for t in tasks])
    a, b = runs
    assert [sha(s["outputs"]) for s in a] == [sha(s["outputs"]) for s in b]
    # c4 300 + dclm 281 + 499 + dolma 10 + 10 jsonl + 10 gzipped + 2 texts + 22 WARC pages
    assert sum(s["documents_out"] for s in a) == 300 + 281 + 499 + 10 + 10 + 10 + 2 + 22
    assert all(s["error_counts"] == {} for s in a)


# --- Hugging Face datasets ----------------------------------------------------------------------


def test_hf_spec_parsing():
    assert parse_hf_spec("hf://allenai/c4:en/validation") == ("allenai/c4", "en", "validation")
    assert parse_hf_spec("hf://wikitext/test") == ("wikitext", None, "test")
    assert parse_hf_spec("hf:///data/set/train") == ("/data/set", None, "train")
    with pytest.raises(OlmoflowError, match="expected hf://name"):
        parse_hf_spec("hf://nosplit")


def test_hf_local_dataset_and_clear_errors(tmp_path, monkeypatch):
    pytest.importorskip("datasets", reason="the 'datasets' package (olmoflow[hf]) is not installed")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    data = tmp_path / "myset"
    data.mkdir()
    _write(data / "train.jsonl", jsonl_bytes(ROWS[:10]))
    spec = f"hf://{data}/train"
    stats, docs = ingest(tmp_path, spec)
    assert [d["text"] for d in docs] == [r["text"] for r in ROWS[:10]]
    assert [d["id"] for d in docs] == [f"src/train:{i}" for i in range(1, 11)]
    assert docs[0]["metadata"]["hf_split"] == "train" and docs[0]["metadata"]["label"] == 0
    assert ingest(tmp_path / "again", spec)[1] == docs
    with pytest.raises(OlmoflowError, match="cannot load Hugging Face dataset .*nosuchsplit"):
        ingest(tmp_path, f"hf://{data}/nosuchsplit")
    with pytest.raises(OlmoflowError, match="network access is off; set allow_network"):
        ingest(tmp_path, "hf://allenai/c4:en/validation")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(OlmoflowError,
                       match=r"needs the 'datasets' package: pip install 'olmoflow\[hf\]'"):
        ingest(tmp_path, spec)


# --- bad input: counted with file:line, strict stops at the first -------------------------------


#: BIG is written as this many gzip members or zstd frames, so that damage half-way keeps the
#: whole members before it (a damaged member gives no document).
MEMBERS = 4


def in_members(compress, rows: list) -> bytes:
    step = len(rows) // MEMBERS
    return b"".join(compress(jsonl_bytes(rows[i:i + step])) for i in range(0, len(rows), step))


def bad_cases(tmp: Path) -> dict[str, tuple[Path, str, str]]:
    """kind -> (file, where it is reported, what strict's message says)."""
    good = in_members(gzip.compress, BIG)
    corrupt = bytearray(good)
    corrupt[-8] ^= 0xFF  # the CRC-32 in the last member's trailer
    z = in_members(zstd, BIG)
    cases = {
        "truncated gzip": (_write(tmp / "t.jsonl.gz", good[: len(good) // 2]), ":",
                           "damaged gzip data"),
        "corrupt gzip": (_write(tmp / "c.jsonl.gz", bytes(corrupt)), ":", "damaged gzip data"),
        "not gzip": (_write(tmp / "n.jsonl.gz", jsonl_bytes(ROWS)), ":1", "damaged gzip data"),
        "truncated zst": (_write(tmp / "t.jsonl.zst", z[: len(z) // 2]), ":", "damaged zstd data"),
        "not zst": (_write(tmp / "n.jsonl.zst", jsonl_bytes(ROWS)), ":1", "damaged zstd data"),
        "invalid utf8": (_write(tmp / "u.jsonl", b'{"text": "a"}\n{"text": "caf\xe9"}\n'), ":2",
                         "malformed JSONL: invalid UTF-8 at byte 13"),
        "not json": (_write(tmp / "j.jsonl", b'{"text": "a"}\n{"text": "cut\n'), ":2",
                     "malformed JSONL: not JSON"),
        "no text field": (_write(tmp / "f.jsonl", b'{"text": "a"}\n{"body": "b"}\n'), ":2",
                          "malformed JSONL: field 'text' missing"),
        "empty jsonl": (_write(tmp / "e.jsonl", b""), "", "empty file"),
        "empty txt": (_write(tmp / "e.txt", b""), "", "empty file"),
        "empty gzip": (_write(tmp / "e.jsonl.gz", gzip.compress(b"")), "", "empty file"),
        "empty parquet": (_empty_parquet(tmp / "e.parquet"), "", "empty file"),
        "truncated parquet": (_truncated_parquet(tmp / "t.parquet"), ":1", "damaged Parquet file"),
        "truncated warc": (_truncated_warc(tmp), ":", "damaged WARC/gzip data"),
        "invalid utf8 txt": (_write(tmp / "u.txt", b"ok\nline two caf\xe9\n"), ":2",
                             "invalid UTF-8"),
    }
    return cases


def _empty_parquet(path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
    return path


def _truncated_parquet(path: Path) -> Path:
    whole = write_format(path.parent, "parquet").read_bytes()
    return _write(path, whole[: len(whole) - 30])


def _truncated_warc(tmp: Path) -> Path:
    whole = make_warc(tmp / "w.warc.gz", n=8).read_bytes()
    return _write(tmp / "t.warc.gz", whole[: len(whole) * 2 // 3])


def test_each_bad_input_is_counted_with_file_and_line_and_strict_raises(tmp_path, caplog):
    cases = bad_cases(tmp_path)
    for label, (path, where, message) in cases.items():
        with caplog.at_level(logging.WARNING, logger="olmoflow.data"):
            stats, docs = ingest(tmp_path / "out" / path.name, path)
        assert sum(stats["error_counts"].values()) == 1, (label, stats)
        example = stats["errors"][0]
        assert example.startswith(f"{path}{where}") and message in example, (label, example)
        assert example in caplog.text, label
        # Nothing unaccounted: every record read is kept or removed for a named reason.
        removed = stats["removed"]
        assert stats["documents_in"] == stats["documents_out"] + sum(
            r["documents"] for r in removed.values()), label
        assert stats["bytes_in"] == stats["bytes_out"] + sum(r["bytes"] for r in removed.values())
        # The documents of the members before the damaged one are kept, in order, and nothing of
        # the damaged member: a prefix of what the file holds, cut at a member's end.
        texts = [d["text"] for d in docs]
        if path.name.startswith(("t.jsonl", "c.jsonl")):
            assert len(texts) in (len(BIG) // MEMBERS, len(BIG) // 2, len(BIG) * 3 // MEMBERS)
            assert texts == [r["text"] for r in BIG[: len(texts)]], label
        if label == "truncated warc":
            assert 1 <= len(docs) < 8
        with pytest.raises(OlmoflowError) as e:
            ingest(tmp_path / "strict" / path.name, path, strict=True)
        msg = str(e.value)
        assert msg.startswith(f"{path}{where}") and message in msg and "\n" not in msg, (label, msg)


def test_gzip_corrupt_mid_stream(tmp_path):
    data = bytearray(in_members(gzip.compress, BIG))
    data[len(data) // 2 + 100: len(data) // 2 + 140] = b"\x00" * 40  # inside the third member
    path = _write(tmp_path / "c.jsonl.gz", bytes(data))
    stats, docs = ingest(tmp_path, path)
    # No line of the damaged member is read (so no garbage as malformed lines either): the
    # damage is counted and the two whole members before it are kept as they were.
    assert stats["error_counts"] == {"damaged_file": 1}
    assert [d["text"] for d in docs] == [r["text"] for r in BIG[: len(BIG) // 2]]
    with pytest.raises(OlmoflowError, match=rf"^{path}:\d+: "):
        ingest(tmp_path, path, strict=True)


def test_bad_lines_do_not_stop_the_run(tmp_path):
    path = _write(tmp_path / "m.jsonl", b"".join([
        b'{"text": "one"}\n', b"not json\n", b"\n", b"[1, 2]\n", b'{"title": "x"}\n',
        b'{"text": 5}\n', b'{"text": "bad \xff"}\n', b'{"text": "lone \\ud800"}\n',
        b'{"text": "two"}\n',
    ]))
    stats, docs = ingest(tmp_path, path)
    assert [d["text"] for d in docs] == ["one", "two"]
    assert [d["id"] for d in docs] == ["src/m.jsonl:1", "src/m.jsonl:9"]
    assert stats["error_counts"] == {"invalid_utf8": 2, "missing_text": 1, "not_json": 1,
                                     "not_object": 1, "text_not_string": 1}
    assert stats["documents_in"] == 8 and stats["documents_out"] == 2
    with pytest.raises(OlmoflowError, match=r"m\.jsonl:2: malformed JSONL: not JSON"):
        ingest(tmp_path, path, strict=True)


def test_unsupported_file_and_unknown_option(tmp_path):
    path = _write(tmp_path / "notes.md", b"# hi\n")
    stats, docs = ingest(tmp_path, path)
    assert docs == [] and stats["error_counts"] == {"unsupported_file": 1}
    assert len(stats["outputs"]) == 1 and Path(stats["outputs"][0]).is_file()  # an empty shard
    with pytest.raises(OlmoflowError,
                       match="unknown config key 'options.text_feild'; did you mean "
                             "'options.text_field'"):
        ingest(tmp_path, write_format(tmp_path, "jsonl"), text_feild="body")
    with pytest.raises(OlmoflowError, match="no such file"):
        ingest_tasks("src", [str(tmp_path / "missing.jsonl")], tmp_path)


# --- sharding ------------------------------------------------------------------------------------


def test_shards_are_deterministic_and_stale_ones_removed(tmp_path):
    path = write_format(tmp_path, "jsonl.gz")
    a, _ = ingest(tmp_path / "a", path, max_shard_bytes=500)
    b, _ = ingest(tmp_path / "b", path, max_shard_bytes=500)
    assert sha(a["outputs"]) == sha(b["outputs"]) and len(a["outputs"]) > 5
    names = [Path(p).name for p in a["outputs"]]
    assert names[:3] == ["shard.jsonl.gz", "shard-0001.jsonl.gz", "shard-0002.jsonl.gz"]
    # Rerun with bigger shards into the same place: the old higher-numbered shards go away.
    c, docs = ingest(tmp_path / "a", path, max_shard_bytes=4000)
    left = sorted(p.name for p in (tmp_path / "a" / "documents" / "src").iterdir())
    assert left == sorted(Path(p).name for p in c["outputs"]) and len(left) < len(names)
    assert len(docs) == len(ROWS)


def test_shard_writer_discards_a_half_written_shard(tmp_path):
    def docs():
        for i in range(10):
            yield {"id": str(i), "text": "x" * 100, "source": "s"}
        raise RuntimeError("reader died")

    out = tmp_path / "s.jsonl.gz"
    with pytest.raises(RuntimeError), ShardWriter(out, max_shard_bytes=450) as w:
        for d in docs():
            w.write(d)
    finished = sorted(p.name for p in tmp_path.iterdir())
    # Complete shards of 4 documents each stay; the third, half-written one leaves no file at all.
    assert finished == ["s-0001.jsonl.gz", "s.jsonl.gz"]
    assert [len(list(read_documents(tmp_path / n))) for n in finished] == [4, 4]


def test_ingest_output_depends_only_on_the_task(tmp_path):
    """Ids and bytes come from the task alone, so any worker count or scheduling order (the
    executor runs tasks in any order) gives the same shards."""
    src = tmp_path / "in"
    src.mkdir()
    for i in range(4):
        _write(src / f"f{i}.jsonl", jsonl_bytes(ROWS[i * 10:(i + 1) * 10]))
    make_warc(src / "w.warc.gz")
    outs = []
    for run, order in (("forward", 1), ("backward", -1)):
        tasks = ingest_tasks("web", [str(src)], tmp_path / run / "documents",
                             options={"max_shard_bytes": 400})
        results = {t["name"]: ingest_shard(t) for t in tasks[::order]}
        outs.append({n: (sha(r["outputs"]),
                         [d["id"] for p in r["outputs"] for d in read_documents(p)])
                     for n, r in sorted(results.items())})
    assert outs[0] == outs[1]
    assert outs[0]["web/f0.jsonl"][1][0] == "web/f0.jsonl:1"
    assert outs[0]["web/w.warc.gz"][1][0] == f"urn:uuid:{uuid.UUID(int=1)}"


_BIG_DOC_SCRIPT = """
import json, resource, sys
from olmoflow.data.sources import ingest_shard
def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
out = {"base": peak_mb(), "runs": []}
for task in json.loads(sys.argv[1]):
    stats = ingest_shard(task)
    out["runs"].append({"peak": peak_mb(), "stats": stats})
print(json.dumps(out))
"""


def test_100mb_document_memory_is_bounded(tmp_path):
    """A 100 MB line: skipped as too_large (default limit) without ever being held whole, or
    kept (no limit) with peak memory a small multiple of its size."""
    import subprocess

    size = 100 << 20
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"text": "before"}\n{"text": "')
        unit = b"the quick brown fox jumps over the lazy dog " * 1000
        for _ in range(size // len(unit)):
            f.write(unit)
        f.write(b'"}\n{"text": "after"}\n')
    line = path.stat().st_size - len(b'{"text": "before"}\n{"text": "after"}\n')
    tasks = [{"input": str(path), "source": "s", "output": str(tmp_path / run / "s.jsonl.gz"), **kw}
             for run, kw in (("skip", {}), ("keep", {"max_document_bytes": None}))]
    proc = subprocess.run([sys.executable, "-c", _BIG_DOC_SCRIPT, json.dumps(tasks)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (skip, keep), mb = out["runs"], size / (1 << 20)
    assert skip["stats"]["documents_out"] == 2
    assert skip["stats"]["error_counts"] == {"too_large": 1}
    assert skip["stats"]["errors"][0].startswith(f"{path}:2: document of {line} bytes")
    assert skip["stats"]["removed"]["too_large"] == {"documents": 1, "bytes": line}
    assert skip["peak"] - out["base"] < 0.5 * mb  # the 32 MiB limit, never the whole line
    assert keep["stats"]["documents_out"] == 3 and keep["stats"]["error_counts"] == {}
    assert keep["stats"]["bytes_out"] == line - len(b'{"text": ""}\n') + len("beforeafter")
    assert keep["peak"] - out["base"] < 5 * mb, (keep["peak"], out["base"])


def test_open_binary_reads_multi_frame_zstd(tmp_path):
    path = _write(tmp_path / "m.jsonl.zst", zstd(b'{"text": "a"}\n') + zstd(b'{"text": "b"}\n'))
    with open_binary(path) as f:
        assert f.read() == b'{"text": "a"}\n{"text": "b"}\n'
    docs, rl = read(path)
    assert [d["text"] for d in docs] == ["a", "b"] and rl.errors == {}

def test_a_file_that_is_not_warc_is_counted_not_raised(tmp_path):
    # FastWARC raises OSError("Invalid WARC header") on a non-WARC file: ingest crashed with a
    # traceback instead of counting a damaged file.
    bad = tmp_path / "junk.warc"
    bad.write_bytes(b"this is not a WARC file\n" * 10)
    rl = ReadLog()
    docs = list(read_input(Input("warc", "x/junk.warc", "x", path=str(bad)), ReadOptions(), rl))
    assert docs == [] and rl.error_counts() == {"damaged_file": 1}
    assert rl.error_examples()[0].startswith(f"{bad}:1: damaged WARC")
    with pytest.raises(OlmoflowError, match="junk.warc:1: damaged WARC"):
        list(read_input(Input("warc", "x/junk.warc", "x", path=str(bad)),
                        ReadOptions(strict=True), ReadLog(strict=True)))
