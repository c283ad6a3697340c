"""JSONL lines nested too deeply for the JSON decoder are malformed lines (file:line), never a
RecursionError: in collect, collect with --strict, and the data engine's ingest."""

from __future__ import annotations

import gzip
import json

import pytest

from olmoflow.cli import main
from olmoflow.data.documents import parse_jsonl_line


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
