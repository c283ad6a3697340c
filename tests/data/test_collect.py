"""The collect stage and Dolma document I/O: every source kind, damage tolerance, determinism."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest
from checks import tree
from fuzzing import CASES, Findings, good_docs, mutated_data_file, one_line, rng_for, run_cli

from olmoflow.cli import main
from olmoflow.data.config import CollectConfig
from olmoflow.data.documents import DOCUMENTS, parse_jsonl_line, read_documents, write_documents
from olmoflow.data.sources import collect
from olmoflow.errors import OlmoflowError

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def run(tmp_path: Path, *sources: str, **kw) -> tuple[list[dict], dict]:
    out = tmp_path / "out"
    result = collect(CollectConfig(sources=list(sources), **kw), out, progress=False)
    assert result.outputs == [out / DOCUMENTS]
    return list(read_documents(out / DOCUMENTS)), result.counts


def write_jsonl(path: Path, rows: list, gz: bool = False) -> Path:
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


# --- documents.py ---------------------------------------------------------------------------


def test_write_read_roundtrip_is_byte_identical_and_ordered(tmp_path):
    docs = [
        {"metadata": {"k": 1}, "source": "s", "text": f"héllo {i}", "id": str(i)} for i in range(5)
    ]
    assert write_documents(tmp_path / "a.jsonl.gz", docs) == 5
    write_documents(tmp_path / "b.jsonl.gz", docs)
    assert (tmp_path / "a.jsonl.gz").read_bytes() == (tmp_path / "b.jsonl.gz").read_bytes()
    assert list(read_documents(tmp_path / "a.jsonl.gz")) == docs
    first = gzip.decompress((tmp_path / "a.jsonl.gz").read_bytes()).split(b"\n")[0]
    assert list(json.loads(first)) == ["id", "text", "source", "metadata"]  # Dolma order
    assert "é".encode() in first  # written as UTF-8, not \u escapes


def test_read_documents_damaged_file_is_user_error(tmp_path):
    write_documents(tmp_path / "d.jsonl.gz", [{"id": "1", "text": "x" * 5000, "source": "s"}])
    data = (tmp_path / "d.jsonl.gz").read_bytes()
    (tmp_path / "d.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(OlmoflowError, match="damaged documents file"):
        list(read_documents(tmp_path / "d.jsonl.gz"))
    with pytest.raises(OlmoflowError, match="no such file"):
        list(read_documents(tmp_path / "missing.jsonl.gz"))


# --- stdlib -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stdlib_runs(tmp_path_factory):
    runs = []
    for name in ("one", "two"):
        out = tmp_path_factory.mktemp(name)
        runs.append((collect(CollectConfig(sources=["stdlib"]), out, progress=False), out))
    return runs


def test_stdlib_corpus(stdlib_runs):
    result, out = stdlib_runs[0]
    docs = list(read_documents(out / DOCUMENTS))
    assert len(docs) > 300 and result.counts["documents"] == len(docs)
    assert result.counts["python_version"]
    # every module source read is an input (hashed into the manifest), and no test suite is
    assert len(result.inputs) == result.counts["per_source"]["stdlib"]
    assert all(p.suffix == ".py" and "test" not in p.parts for p in result.inputs)
    per = result.counts["per_source"]
    assert per["stdlib"] > 300 and per["pydoc_topics"] > 20
    assert sum(per.values()) == len(docs)
    ids = [d["id"] for d in docs]
    assert len(set(ids)) == len(ids)
    assert "stdlib/json/decoder.py" in ids and "pydoc_topics/assert" in ids
    for d in docs:
        if d["source"] == "stdlib":
            parts = d["metadata"]["path"].split("/")
            assert not any(p in {"test", "tests", "idle_test"} for p in parts), d["id"]
            assert not any(p.startswith("test_") for p in parts), d["id"]
            assert "site-packages" not in parts
    assert result.counts["bytes"] == sum(len(d["text"].encode()) for d in docs)


def test_stdlib_is_deterministic(stdlib_runs):
    (_, a), (_, b) = stdlib_runs
    assert (a / DOCUMENTS).read_bytes() == (b / DOCUMENTS).read_bytes()


def test_max_documents_stops_early(tmp_path):
    docs, counts = run(tmp_path, "stdlib", max_documents=7)
    assert len(docs) == 7 and counts["documents"] == 7 and counts["files"] == 7


# --- user files -------------------------------------------------------------------------------


def test_txt_jsonl_and_gz_inputs(tmp_path):
    (tmp_path / "a.txt").write_bytes("\ufeffplain text\r\nline two".encode())
    write_jsonl(tmp_path / "b.jsonl", [{"text": "one", "label": 1}, {"text": "two", "id": 7}])
    dolma = {"id": "d1", "text": "three", "source": "cc", "added": "2024", "metadata": {"url": "u"}}
    write_jsonl(tmp_path / "c.jsonl.gz", [dolma], gz=True)
    docs, counts = run(tmp_path, *(str(tmp_path / n) for n in ("a.txt", "b.jsonl", "c.jsonl.gz")))
    label = tmp_path.name
    assert [d["text"] for d in docs] == ["plain text\r\nline two", "one", "two", "three"]
    assert [d["id"] for d in docs] == [f"{label}/a.txt", f"{label}/b.jsonl:1", "7", "d1"]
    assert docs[1]["metadata"] == {"path": "b.jsonl", "line": 1, "label": 1}
    assert docs[3] == {
        "id": "d1", "text": "three", "source": "cc", "added": "2024",
        "metadata": {"path": "c.jsonl.gz", "line": 1, "url": "u"},
    }
    assert counts["per_source"] == {label: 3, "cc": 1}
    assert counts["files"] == 3 and counts["skipped_malformed"] == 0


def test_text_field(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", [{"content": "hi", "text": "other"}])
    docs, _ = run(tmp_path, str(tmp_path / "b.jsonl"), text_field="content")
    assert docs[0]["text"] == "hi" and docs[0]["metadata"]["text"] == "other"


def test_directory_and_glob(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text("b")
    (root / "a.txt").write_text("a")
    (root / "sub" / "c.txt").write_text("c")
    (root / "notes.md").write_text("ignored")
    (root / ".hidden.txt").write_text("ignored")
    write_jsonl(root / "sub" / "d.jsonl", [{"text": "d"}])
    docs, counts = run(tmp_path, str(root))
    assert [d["id"] for d in docs] == [
        "corpus/a.txt", "corpus/b.txt", "corpus/sub/c.txt", "corpus/sub/d.jsonl:1"
    ]
    assert counts["per_source"] == {"corpus": 4} and counts["files"] == 4
    docs, _ = run(tmp_path, str(root / "*.txt"), str(root / "**" / "*.jsonl"))
    assert [d["text"] for d in docs] == ["a", "b", "d"]
    # The same file named twice is read once.
    docs, _ = run(tmp_path, str(root / "a.txt"), str(root / "*.txt"))
    assert [d["text"] for d in docs] == ["a", "b"]


def test_missing_unsupported_and_empty_sources(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(OlmoflowError) as e:
        run(tmp_path, missing)
    assert str(e.value) == f"no such file or directory: '{missing}'"
    with pytest.raises(OlmoflowError, match="no such file or directory"):
        run(tmp_path, str(tmp_path / "nothing*.txt"))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(OlmoflowError, match=r"unsupported file type '.*x\.csv'"):
        run(tmp_path, str(tmp_path / "x.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(OlmoflowError, match="files in directory"):
        run(tmp_path, str(tmp_path / "empty"))
    with pytest.raises(OlmoflowError, match="collect.sources is empty"):
        run(tmp_path)
    write_jsonl(tmp_path / "bad.jsonl", [[1]])
    with pytest.raises(OlmoflowError, match="no documents collected"):
        run(tmp_path, str(tmp_path / "bad.jsonl"))
    assert not (tmp_path / "out" / DOCUMENTS).exists()


def test_malformed_lines_skipped_counted_and_strict(tmp_path, caplog):
    path = tmp_path / "m.jsonl"
    path.write_text(
        '{"text": "good"}\n'
        "not json\n"
        "\n"  # blank lines are not malformed
        "[1, 2]\n"
        '{"title": "no text"}\n'
        '{"text": 5}\n'
        '{"text": "good too"}\n'
    )
    with caplog.at_level(logging.WARNING, logger="olmoflow.data"):
        docs, counts = run(tmp_path, str(path))
    assert [d["text"] for d in docs] == ["good", "good too"]
    assert counts["skipped_malformed"] == 4 and counts["documents"] == 2
    assert f"{path}:2" in caplog.text and f"{path}:6" in caplog.text
    with pytest.raises(OlmoflowError) as e:
        run(tmp_path, str(path), strict=True)
    assert str(e.value).startswith(f"{path}:2: malformed JSONL: not JSON")
    assert "\n" not in str(e.value)


def test_invalid_utf8(tmp_path):
    path = tmp_path / "u.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "bad \xff\xfe"}\n{"text": "lone \\ud800"}\n')
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9")
    docs, counts = run(tmp_path, str(path), str(tmp_path / "bad.txt"))
    assert [d["text"] for d in docs] == ["ok"]
    assert counts["skipped_undecodable"] == 3 and counts["skipped_malformed"] == 0
    with pytest.raises(OlmoflowError, match=rf"^{path}:2: malformed JSONL: invalid UTF-8"):
        run(tmp_path, str(path), strict=True)
    with pytest.raises(OlmoflowError, match=r"bad\.txt:1: invalid UTF-8 at byte 3$"):
        run(tmp_path, str(tmp_path / "bad.txt"), strict=True)


def test_truncated_gz_keeps_the_whole_members_before_the_damage(tmp_path, caplog):
    rows = [{"id": str(i), "text": f"document {i} " + "word " * (i % 17)} for i in range(200)]
    members = [gzip.compress("".join(json.dumps(r) + "\n" for r in rows[i:i + 40]).encode())
               for i in range(0, len(rows), 40)]
    whole = b"".join(members)
    ends = [sum(len(m) for m in members[:k]) for k in range(len(members) + 1)]
    cut = tmp_path / "cut.jsonl.gz"
    kept_any = False
    # Every cut point (a stride keeps the test fast) keeps exactly the members that end before
    # it: never a line of the cut member (its checksum is gone), never a partial last line.
    for n in range(20, len(whole), max(1, len(whole) // 60)):
        cut.write_bytes(whole[:n])
        whole_members = max(k for k, end in enumerate(ends) if end <= n)
        with caplog.at_level(logging.WARNING, logger="olmoflow.data"):
            try:
                docs, counts = run(tmp_path, str(cut))
            except OlmoflowError as e:  # cut inside the first member
                assert whole_members == 0
                assert "no documents collected" in str(e) and "1 damaged" in str(e)
                continue
        assert counts["damaged_files"] == (0 if n in ends else 1)
        expected = [(r["id"], r["text"]) for r in rows[: 40 * whole_members]]
        assert [(d["id"], d["text"]) for d in docs] == expected
        kept_any = True
    assert kept_any and "cut.jsonl.gz" in caplog.text
    with pytest.raises(OlmoflowError, match=r"cut\.jsonl\.gz:\d+: damaged gzip data"):
        run(tmp_path, str(cut), strict=True)


def test_not_gzip_at_all_is_damage(tmp_path):
    (tmp_path / "fake.jsonl.gz").write_text('{"text": "plain"}\n')
    write_jsonl(tmp_path / "ok.jsonl", [{"text": "fine"}])
    docs, counts = run(tmp_path, str(tmp_path / "fake.jsonl.gz"), str(tmp_path / "ok.jsonl"))
    assert [d["text"] for d in docs] == ["fine"] and counts["damaged_files"] == 1


def test_real_web_crawl_and_shakespeare(tmp_path):
    web = SHARED_DATA / "web-crawl"
    if not (web / "c4_demo.jsonl").is_file():
        pytest.skip(f"../shared/data not found: {SHARED_DATA}")
    docs, counts = run(
        tmp_path, str(web / "*.jsonl"), str(web / "dolma_documents_000.json.gz"),
        str(SHARED_DATA / "tinyshakespeare" / "input.txt"),
    )
    # c4 300 + dclm 281 + 499 + dolma 10 + 10 jsonl, plus 10 gzipped Dolma documents, plus one book.
    assert counts["documents"] == 300 + 281 + 499 + 10 + 10 + 10 + 1 == len(docs)
    assert counts["skipped_malformed"] == counts["damaged_files"] == 0
    assert counts["files"] == 7 and len(counts["per_source"]) >= 2
    assert docs[-1]["id"] == "tinyshakespeare/input.txt"
    assert docs[-1]["text"].startswith("First Citizen:")


def test_jsonl_with_byte_order_mark_keeps_first_document(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"text": "first"}\n{"text": "second"}\n')
    result = collect(CollectConfig(sources=[str(path)], strict=True), tmp_path / "out",
                     progress=False)
    docs = list(read_documents(tmp_path / "out" / DOCUMENTS))
    assert [d["text"] for d in docs] == ["first", "second"]
    assert result.counts["skipped_malformed"] == 0


# --- JSONL lines nested too deeply: malformed lines (file:line), never a RecursionError -----------


def _nested(depth: int) -> str:
    return json.dumps({"text": "deep document " * 8, "x": "PLACEHOLDER"}).replace(
        '"PLACEHOLDER"', "[" * depth + "]" * depth)


@pytest.fixture
def data(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    good = json.dumps({"text": "a good document " * 8})
    (d / "a.jsonl").write_text(f"{good}\n{_nested(100_000)}\n{_nested(900)}\n")
    return d


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_a_line_nested_too_deep_is_malformed(depth):
    assert parse_jsonl_line(_nested(depth).encode()) == (None, "not JSON (nested too deeply)")


def test_a_line_nested_900_deep_is_fine():
    obj, reason = parse_jsonl_line(_nested(900).encode())
    assert reason == "" and obj["text"].startswith("deep document")


def test_collect_counts_it_as_malformed(data, tmp_path, capsys):
    run = tmp_path / "run"
    rc = main(["collect", "--run-dir", str(run), "--no-progress", "--data", str(data)])
    assert rc == 0, capsys.readouterr().err
    manifest = json.loads((run / "collect" / "manifest.json").read_text())
    assert manifest["counts"]["skipped_malformed"] == 1


def test_collect_strict_is_one_line_naming_the_line(data, tmp_path, capsys):
    rc = main(["collect", "--run-dir", str(tmp_path / "run"), "--no-progress", "--data",
               str(data), "--strict"])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"{data / 'a.jsonl'}:2" in lines[0] and "nested too deeply" in lines[0]


def test_data_ingest_counts_it_as_malformed(data, tmp_path, capsys):
    cfg = tmp_path / "data.yaml"
    out = tmp_path / "engine"
    cfg.write_text(f"output: {out}\nexecutor: serial\nsteps: [ingest]\n"
                   f"sources: [{{name: web, paths: ['{data}']}}]\n")
    rc = main(["data", "ingest", str(cfg), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    texts = []
    for f in sorted((out / "documents").rglob("*.jsonl.gz")):
        with gzip.open(f, "rt") as fh:
            texts += [json.loads(line)["text"] for line in fh]
    assert len(texts) == 2  # the good line and the one nested 900 deep


# --- seeded fuzzing (tests/fuzzing.py): damaged data files given to collect -----------------------


def test_fuzz_collect_through_the_cli(tmp_path, capsys):
    """Mutated JSONL and gzip files given to ``olmoflow collect --data``, rerun in one run
    directory: a success writes a readable corpus whose count matches the manifest; a failure is
    one line and leaves the previous complete collect output as it was."""
    # A whole stage run each (config, lock, fsyncs, manifest): a quarter of the cases; the ingest
    # job below feeds the same readers the full number.
    r, found = rng_for("collect"), Findings("collect", max(CASES // 4, 1))
    run = tmp_path / "run"
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    first = inputs / "good.jsonl"
    first.write_text("".join(json.dumps(d) + "\n" for d in good_docs(r)))
    assert run_cli(capsys, ["collect", "--data", str(first), "--run-dir", str(run),
                        "--no-progress"])[0] == 0
    finished = tree(run / "collect")
    for case in range(found.cases):
        path = mutated_data_file(r, inputs, case)
        argv = ["collect", "--data", str(path), "--run-dir", str(run), "--no-progress"]
        argv += ["--strict"] if r.random() < 0.3 else []
        kind, rc = found.outcome(case, f"{' '.join(argv)}: {path.read_bytes()[:200]!r}",
                                 lambda argv=argv: run_cli(capsys, argv))
        if kind != "ok":
            continue
        rc, err = rc
        if rc == 2 and one_line(err):
            found.counts["ok"] -= 1
            found.counts["error"] += 1
            if tree(run / "collect") != finished:
                found.add(case, str(path), "a failed rerun changed the finished collect output")
            continue
        if rc != 0:
            found.add(case, str(path), f"exit {rc}: {err!r}")
            continue
        manifest = json.loads((run / "collect" / "manifest.json").read_text())
        with gzip.open(run / "collect" / "documents.jsonl.gz", "rt", encoding="utf-8") as f:
            docs = [json.loads(line) for line in f]
        if len(docs) != manifest["counts"]["documents"] or not all(
                isinstance(d.get("text"), str) for d in docs):
            found.add(case, str(path), f"output does not hold up: {docs[:2]}")
        finished = tree(run / "collect")
        path.unlink()
    found.check()
