"""Planning a source's inputs and the ingest job (``olmoflow.data.sources``): files of an
unsupported type are named, an artifact directory's manifest is not data, and a source in which no
document is usable is named at ingest."""

from __future__ import annotations

import gzip

import pytest
from engine_inputs import GOOD, engine_config, jsonl
from fuzzing import CASES, Findings, dumps, mutated_data_file, odd_value, rng_for

from olmoflow.data.engine import Engine, load_data_config
from olmoflow.errors import OlmoflowError


def test_no_usable_document_is_named_at_ingest(tmp_path):
    # With a wrong text_field every line was skipped, tag/dedup/decontaminate ran on nothing,
    # and the mixer failed with "unknown attribute 'dedup__exact'", a rule the user never wrote.
    src = tmp_path / "in"
    src.mkdir()
    jsonl(src / "a.jsonl", [{"body": "text under another field"}] * 4)
    cfg = load_data_config(engine_config(tmp_path, paths=f"[{src / 'a.jsonl'}]",
                                  steps="[ingest, tag, dedup, mix]"))
    with pytest.raises(OlmoflowError, match=r"missing_text 4.*a\.jsonl:1: .*field 'text' "
                                            r"missing.*text_field"):
        Engine(cfg).run()
    (src / "a.jsonl").write_text("")
    with pytest.raises(OlmoflowError, match="empty_file 1"):
        Engine(cfg, force=True).run()


def test_unsupported_files_in_a_source_directory_are_named(tmp_path, caplog):
    # A directory source with a README.md (or data in an unsupported format, e.g. .json.bz2)
    # skipped those files without a word.
    from olmoflow.data.sources import plan_inputs

    d = tmp_path / "corpus"
    d.mkdir()
    jsonl(d / "a.jsonl", GOOD)
    (d / "README.md").write_text("# about this data\n")
    (d / "b.json.bz2").write_bytes(b"BZh9")
    (d / ".hidden").write_text("not data")
    for entry in (str(d), f"{d}/*"):
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert [i.name for i in plan_inputs([entry], "web")] == ["web/a.jsonl"]
        assert "skipped 2 file(s) of an unsupported type: README.md, b.json.bz2" in caplog.text


def test_an_artifact_directory_reads_without_warning_about_its_manifest(tmp_path, caplog):
    # `olmoflow run --data runs/data/web_crawl/mixed`: the data engine's output directory holds
    # its manifest.json beside the shards; that is bookkeeping, not data in an unknown format.
    from olmoflow.data.sources import plan_inputs

    d = tmp_path / "mixed"
    (d / "c4").mkdir(parents=True)
    jsonl(d / "c4" / "0000.jsonl", GOOD)
    (d / "manifest.json").write_text("{}")
    with caplog.at_level("WARNING"):
        assert [i.name for i in plan_inputs([str(d)], "mixed")] == ["mixed/c4/0000.jsonl"]
    assert "unsupported" not in caplog.text


# --- seeded fuzzing (tests/fuzzing.py): damaged data files given to the ingest job ----------------


def test_fuzz_the_ingest_job(tmp_path):
    """The same damage given to the data engine's ingest job (what ``data ingest`` runs per
    file): its stats must add up and its shards hold what it says it kept."""
    from olmoflow.data.sources import ingest_shard

    r, found = rng_for("ingest"), Findings("ingest")
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    for case in range(CASES):
        path = mutated_data_file(r, inputs, case)
        task = {"input": str(path), "source": "web", "strict": r.random() < 0.3,
                "output": str(tmp_path / "out" / f"{case:04d}.jsonl.gz")}
        if r.random() < 0.2:
            task["options"] = {r.choice(["text_field", "max_document_bytes", "max_shard_bytes",
                                         "html_extractor", "bogus"]): odd_value(r)}
        kind, stats = found.outcome(case, f"{dumps(task)[:300]}: {path.read_bytes()[:200]!r}",
                                    lambda task=task: ingest_shard(task))
        if kind != "ok":
            continue
        kept = 0
        for shard in stats["outputs"]:
            with gzip.open(shard, "rt", encoding="utf-8") as f:
                kept += sum(1 for _ in f)
        if kept != stats["documents_out"] or stats["documents_in"] < kept:
            found.add(case, str(path), f"stats do not add up: {stats}")
    found.check()
