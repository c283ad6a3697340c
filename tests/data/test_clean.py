"""The clean stage: length bounds, exact dedup keeping the first copy, idempotence, empty corpus."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_inputs import shouting_plugin

from olmoflow.config import from_dict
from olmoflow.data.clean import clean
from olmoflow.data.config import CleanConfig, CollectConfig
from olmoflow.data.documents import DOCUMENTS, read_documents, write_documents
from olmoflow.data.sources import collect
from olmoflow.errors import OlmoflowError

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def docs_of(texts: list[str]) -> list[dict]:
    return [
        {"id": str(i), "text": t, "source": "s", "metadata": {"i": i}} for i, t in enumerate(texts)
    ]


def run(tmp_path: Path, docs: list[dict], name: str = "out", **kw) -> tuple[list[dict], dict]:
    src = tmp_path / f"{name}-in.jsonl.gz"
    write_documents(src, docs)
    result = clean(CleanConfig(**kw), src, tmp_path / name, progress=False)
    assert result.inputs == [src] and result.outputs == [tmp_path / name / DOCUMENTS]
    return list(read_documents(tmp_path / name / DOCUMENTS)), result.counts


def test_length_bounds_are_inclusive_and_on_stripped_text(tmp_path):
    texts = ["abc", "  abcd  \n", "abcde", "abcdefgh", "abcdefghi", "    "]
    kept, counts = run(tmp_path, docs_of(texts), min_chars=4, max_chars=8)
    assert [d["text"] for d in kept] == ["  abcd  \n", "abcde", "abcdefgh"]
    assert kept[0] == docs_of(texts)[1]  # documents are written unchanged
    assert counts == {
        "input_documents": 6, "documents": 3, "removed_too_short": 2, "removed_too_long": 1,
        "removed_duplicate": 0, "bytes": sum(len(d["text"].encode()) for d in kept),
    }


def test_dedup_keeps_exactly_the_first_copy_in_order(tmp_path):
    texts = ["alpha", "beta", "alpha", "gamma", "beta", "alpha", "alpha "]
    kept, counts = run(tmp_path, docs_of(texts), min_chars=1)
    assert [(d["id"], d["text"]) for d in kept] == [
        ("0", "alpha"), ("1", "beta"), ("3", "gamma"), ("6", "alpha ")  # exact: "alpha " differs
    ]
    assert counts["removed_duplicate"] == 3 and counts["documents"] == 4
    kept, counts = run(tmp_path, docs_of(texts), name="nodedup", min_chars=1, dedup=False)
    assert len(kept) == len(texts) and counts["removed_duplicate"] == 0


def test_short_duplicates_count_as_too_short(tmp_path):
    _, counts = run(tmp_path, docs_of(["ab", "ab", "long enough"]), min_chars=3)
    assert counts["removed_too_short"] == 2 and counts["removed_duplicate"] == 0


def test_distinct_corpus_loses_nothing(tmp_path):
    docs = docs_of([f"document number {i} with some text" for i in range(100)])
    kept, counts = run(tmp_path, docs, min_chars=10)
    assert kept == docs and counts["documents"] == 100


def test_cleaning_is_idempotent(tmp_path):
    texts = ["x" * 30, "short", "y" * 30, "x" * 30, "z" * 500, "y" * 30]
    _, first = run(tmp_path, docs_of(texts), name="a", min_chars=10, max_chars=100)
    again = clean(
        CleanConfig(min_chars=10, max_chars=100), tmp_path / "a" / DOCUMENTS, tmp_path / "b",
        progress=False,
    )
    assert (tmp_path / "a" / DOCUMENTS).read_bytes() == (tmp_path / "b" / DOCUMENTS).read_bytes()
    assert again.counts["documents"] == first["documents"] == again.counts["input_documents"]


def test_empty_after_cleaning_is_one_line_error(tmp_path):
    with pytest.raises(OlmoflowError) as e:
        run(tmp_path, docs_of(["a", "bb", "x" * 50]), min_chars=5, max_chars=20)
    msg = str(e.value)
    assert msg.startswith("corpus is empty after cleaning: 3 documents in, 2 too short")
    assert "1 too long" in msg and "lower clean.min_chars" in msg and "\n" not in msg
    assert not (tmp_path / "out" / DOCUMENTS).exists()


def test_bad_config_and_missing_input(tmp_path):
    with pytest.raises(OlmoflowError, match="below clean.min_chars"):
        bounds = CleanConfig(min_chars=10, max_chars=5)
        clean(bounds, tmp_path / "x", tmp_path / "o", progress=False)
    with pytest.raises(OlmoflowError, match="no such file"):
        clean(CleanConfig(), tmp_path / "missing.jsonl.gz", tmp_path / "o", progress=False)


def test_collect_then_clean_real_data(tmp_path):
    web = SHARED_DATA / "web-crawl"
    if not (web / "dclm_agreement_data.jsonl").is_file():
        pytest.skip(f"../shared/data not found: {SHARED_DATA}")
    sources = [str(web / "dclm_agreement_data.jsonl"), str(web / "dclm_majority_data.jsonl")]
    collected = collect(CollectConfig(sources=sources), tmp_path / "collect", progress=False)
    result = clean(CleanConfig(), collected.outputs[0], tmp_path / "clean", progress=False)
    c = result.counts
    assert c["input_documents"] == collected.counts["documents"] == 780
    removed = c["removed_too_short"] + c["removed_too_long"] + c["removed_duplicate"]
    assert c["documents"] + removed == c["input_documents"]
    # The DCLM agreement set is (but for one short text) a subset of the majority set: a real
    # cross-file duplicate load. The files are pinned by sha256 in ../shared/data/MANIFEST.md.
    assert c["removed_duplicate"] == 280 and c["documents"] == 498
    texts = [d["text"] for d in read_documents(result.outputs[0])]
    assert len(set(texts)) == len(texts)


SHOUTING_CLEAN = shouting_plugin("shouting_clean")


def test_a_tagger_registered_once_filters_both_the_engine_and_olmoflow_run(tmp_path, capsys):
    # One plugin file and one rule: `olmoflow data run`'s mixer and `olmoflow run`'s clean stage
    # drop the same document (clean used only its fixed rules before).
    import json

    from olmoflow.cli import main
    from olmoflow.data.engine import Engine, load_data_config
    from olmoflow.data.engine.report import step_manifests

    plugin = tmp_path / "shout.py"
    plugin.write_text(SHOUTING_CLEAN)
    rule = "shouting_clean__upper_fraction > 0.5"
    src = tmp_path / "in" / "a.jsonl"
    src.parent.mkdir()
    texts = ["quiet words here, nothing loud", "LOUD WORDS HERE, ALL OF THEM", "Mixed Case Words"]
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))

    cfg_path = tmp_path / "data.yaml"
    cfg_path.write_text(json.dumps({
        "output": str(tmp_path / "engine"), "executor": "serial", "steps": ["ingest", "tag", "mix"],
        "sources": [{"name": "web", "paths": [str(src)]}], "plugins": [str(plugin)],
        "taggers": ["shouting_clean"], "mixer": {"exclude": [rule]}}))
    Engine(load_data_config(cfg_path)).run()
    mixed = step_manifests(tmp_path / "engine")["mix"]["counts"]
    assert mixed["removed"][f"exclude: {rule}"]["documents"] == 1

    run = ["--run-dir", str(tmp_path / "run"), "--no-progress"]
    assert main(["collect", "tiny", *run, f"collect.sources=[{src}]"]) == 0
    assert main(["clean", "tiny", *run, "clean.min_chars=1", f"clean.plugins=[{plugin}]",
                 "clean.taggers=[shouting_clean]", f"clean.exclude=['{rule}']"]) == 0
    capsys.readouterr()
    kept = [d["text"] for d in read_documents(tmp_path / "run" / "clean" / DOCUMENTS)]
    assert kept == [texts[0], texts[2]]
    counts = json.loads((tmp_path / "run" / "clean" / "manifest.json").read_text())["counts"]
    assert counts["removed_by_rule"] == {f"exclude: {rule}": 1}
    # A rule naming an attribute no tagger writes is one line naming the closest.
    assert main(["clean", "tiny", *run, "clean.min_chars=1", f"clean.plugins=[{plugin}]",
                 "clean.taggers=[shouting_clean]",
                 "clean.exclude=['shouting_clean__upper_fractoin > 0.5']"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "clean.exclude[0]: unknown attribute" in err
    assert "did you mean 'shouting_clean__upper_fraction'" in err


def test_clean_rules_are_checked_when_the_config_loads():
    with pytest.raises(OlmoflowError, match=r"clean\.exclude\[0\]: cannot parse rule"):
        from_dict(CleanConfig, {"exclude": ["a = 1"]}, "clean.")
    with pytest.raises(OlmoflowError, match="clean.taggers: unknown option of tagger 'gopher'"):
        CleanConfig(taggers=[{"gopher": {"min_wrods": 3}}])
    assert CleanConfig().exclude == [] and CleanConfig().taggers == []
