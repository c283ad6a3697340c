"""Lineage: from a tokens directory back to every raw file, with sha256, through the manifests."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from olmoflow.data.engine import Engine, load_data_config
from olmoflow.data.lineage import data_lineage
from olmoflow.errors import OlmoflowError

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "web-crawl"
WORDS = "river stone water bank fish reed mud star orbit comet moon dust sky leaf root".split()


def engine_run(tmp: Path) -> tuple[Path, list[Path]]:
    """All six steps over two JSONL sources, a text file and an eval set; returns the config and
    the raw files (sources and the eval set)."""
    (tmp / "in").mkdir()
    raw = []
    for name in ("a", "b"):
        rows = [{"text": " ".join(WORDS[i:] + WORDS[:i]) * 2 + f" {name}{i}."} for i in range(8)]
        p = tmp / "in" / f"{name}.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in rows + rows[:2]))
        raw.append(p)
    txt = tmp / "in" / "note.txt"
    txt.write_text("A note about moon dust and comet orbits, long enough to keep. " * 3)
    raw.append(txt)
    ev = tmp / "eval.jsonl"
    ev.write_text(json.dumps({"q": "what colour is the sky over the river bank at noon"}) + "\n")
    raw.append(ev)
    cfg = tmp / "data.yaml"
    cfg.write_text(f"""
output: {tmp / "run"}
executor: serial
sources:
  - {{name: web, paths: ["{tmp / "in"}/*.jsonl"]}}
  - {{name: notes, paths: ["{txt}"]}}
taggers: [pii]
dedup: {{exact: true}}
decontaminate: {{evals: [], files: {{mine: {{path: "{ev}", fields: [q]}}}}, ngram: 8, action: tag}}
tokenize: {{vocab_size: 300, min_frequency: 1, heldout_fraction: 0.2}}
""")
    return cfg, raw


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_engine_lineage_reaches_every_raw_file_through_every_step(tmp_path):
    cfg, raw = engine_run(tmp_path)
    Engine(load_data_config(cfg)).run()
    run = tmp_path / "run"
    lin = data_lineage(run / "tokens")
    got = {r["path"]: r for r in lin["raw_files"]}
    assert set(got) == {str(p.resolve()) for p in raw}
    for p in raw:
        rec = got[str(p.resolve())]
        assert rec["sha256"] == sha(p) and rec["bytes"] == p.stat().st_size
    dirs = {Path(s["dir"]).relative_to(run.resolve()).as_posix() for s in lin["steps"]}
    assert dirs == {"tokens", "tokenizer", "mixed", "documents", "attributes/tags",
                    "attributes/dedup", "attributes/decontam"}
    assert lin["steps"][0]["dir"] == str((run / "tokens").resolve()) and not lin["warnings"]
    steps = {s["stage"]: s for s in lin["steps"]}
    assert steps["data ingest"]["counts"]["documents_out"] == 21
    # Every input recorded with the sha256 of the file on disk.
    for s in lin["steps"]:
        for i in s["inputs"]:
            assert i["sha256"] == sha(Path(i["path"])), i["path"]


def test_main_flow_lineage_and_a_stale_input(tmp_path):
    from olmoflow.pipeline.config import load_config
    from olmoflow.pipeline.runner import run_stage

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"{i}.txt").write_text(f"document {i}: " + " ".join(WORDS) * 4)
    cfg = load_config("tiny", [f"run_dir={tmp_path / 'run'}", f"collect.sources=[{docs}]",
                               "tokenize.heldout_fraction=0.3", "evaluate.sequence_length=8"])
    for stage in ("collect", "clean", "train-tokenizer", "tokenize"):
        run_stage(cfg, stage, progress=False)
    lin = data_lineage(tmp_path / "run" / "tokens")
    assert [Path(s["dir"]).name for s in lin["steps"]] == [
        "tokens", "clean", "tokenizer", "collect"]
    assert {r["path"]: r["sha256"] for r in lin["raw_files"]} == {
        str(p.resolve()): sha(p) for p in sorted(docs.iterdir())}
    # clean rerun with other output: tokens now read a file its producer no longer records.
    manifest = tmp_path / "run" / "clean" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["outputs"][0]["sha256"] = "0" * 64
    manifest.write_text(json.dumps(m))
    warnings = data_lineage(tmp_path / "run" / "tokens")["warnings"]
    assert any("clean now records" in w for w in warnings)


def test_lineage_of_a_directory_without_manifest_is_a_clear_error(tmp_path):
    with pytest.raises(OlmoflowError, match="no manifest.json"):
        data_lineage(tmp_path)


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data/web-crawl is absent")
@pytest.mark.slow
def test_web_crawl_lineage_reaches_the_raw_web_crawl_files(tmp_path):
    cfg = load_data_config("web_crawl", [f"output={tmp_path / 'wc'}", "workers=1"])
    Engine(cfg).run()
    raw = {Path(r["path"]).name: r["sha256"] for r in data_lineage(tmp_path / "wc" / "tokens")[
        "raw_files"]}
    for name in ("c4_demo.jsonl", "dolma_sample-0000.warc.gz", "cs336_german.txt",
                 "dclm_agreement_data.jsonl"):
        assert raw[name] == sha(SHARED / name)
