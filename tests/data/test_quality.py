"""The fastText quality classifier: training, its held-out report, and the quality tagger."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_inputs import jsonl

pytest.importorskip("fasttext", reason="fastText not installed (pip install 'olmoflow[data]')")

from olmoflow.artifacts import sha256_file  # noqa: E402
from olmoflow.data.documents import write_documents  # noqa: E402
from olmoflow.data.taggers import get_tagger, read_attributes, tag_shard  # noqa: E402
from olmoflow.data.taggers.quality import (  # noqa: E402
    MODEL_FILE,
    REPORT_FILE,
    _is_heldout,
    normalize,
    read_labeled,
    train_quality,
)
from olmoflow.errors import OlmoflowError  # noqa: E402

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "web-crawl"
DCLM = [DATA / "dclm_agreement_data.jsonl", DATA / "dclm_majority_data.jsonl"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    if not DATA.is_dir():
        pytest.skip(f"../shared/data absent: {DATA}")
    out = tmp_path_factory.mktemp("quality")
    return out, train_quality(DCLM, out)


def test_training_reports_heldout_accuracy_above_the_majority_baseline(trained):
    out, report = trained
    assert json.loads((out / REPORT_FILE).read_text()) == report
    assert report["model_sha256"] == sha256_file(out / MODEL_FILE)
    # The agreement file is a subset of the majority file: each text counts once.
    distinct = {normalize(t) for t, _ in read_labeled(DCLM)[0]}
    assert report["train_examples"] + report["heldout_examples"] == len(distinct)
    assert report["duplicates_dropped"] == 281
    assert 0.1 < report["heldout_examples"] / len(distinct) < 0.3
    assert report["heldout_accuracy"] > report["baseline_accuracy"] + 0.05


def test_training_is_deterministic(trained, tmp_path):
    out, report = trained
    again = train_quality(DCLM, tmp_path)
    assert (tmp_path / MODEL_FILE).read_bytes() == (out / MODEL_FILE).read_bytes()
    assert again["heldout_accuracy"] == report["heldout_accuracy"]


def test_quality_tagger_scores_heldout_keepers_higher(trained, tmp_path):
    out, _ = trained
    heldout = [(t, lab) for t, lab in read_labeled(DCLM)[0] if _is_heldout(normalize(t), 0.2)]
    docs = [{"id": str(i), "text": t, "source": "dclm"} for i, (t, _) in enumerate(heldout)]
    write_documents(tmp_path / "docs.jsonl.gz", docs)
    tag_shard({"documents": str(tmp_path / "docs.jsonl.gz"), "output": str(tmp_path / "a.jsonl.gz"),
               "taggers": {"quality": {"model": str(out)}}})
    scores = [r["attributes"]["quality__score"][0][2]
              for r in read_attributes(tmp_path / "a.jsonl.gz")]
    assert len(scores) == len(heldout) and all(0.0 <= s <= 1.0 for s in scores)
    keep = [s for s, (_, lab) in zip(scores, heldout) if lab == 1]
    drop = [s for s, (_, lab) in zip(scores, heldout) if lab == 0]
    assert sum(keep) / len(keep) > sum(drop) / len(drop) + 0.1


def test_bad_labeled_lines_are_counted_or_raise(tmp_path):
    path = tmp_path / "labeled.jsonl"
    good = [json.dumps({"text": f"example number {i} " * 5, "label": i % 2}) for i in range(40)]
    path.write_text("\n".join(good[:10] + ["not json", json.dumps({"text": "x", "label": 2})]
                              + good[10:]) + "\n")
    examples, errors = read_labeled([path])
    assert len(examples) == 40
    assert errors == [f"{path}:11: not JSON", f"{path}:12: field 'label' is not 0 or 1 (2)"]
    with pytest.raises(OlmoflowError, match=":11: not JSON"):
        read_labeled([path], strict=True)
    with pytest.raises(OlmoflowError, match="did you mean 'epoch'"):
        train_quality([path], tmp_path / "m", epochs=3)
    with pytest.raises(OlmoflowError, match="no such quality model"):
        get_tagger("quality", model=str(tmp_path / "missing"))
    with pytest.raises(OlmoflowError, match="needs option 'model'"):
        get_tagger("quality")

def test_train_quality_takes_options_after_out(tmp_path, capsys):
    # docs/data.md: `olmoflow data train-quality FILES --out DIR epoch=10` failed with
    # "unrecognized arguments: epoch=10". An unknown option shows the options reach training.
    from olmoflow.cli import main

    f = jsonl(tmp_path / "l.jsonl", [{"text": "x", "label": 1}])
    assert main(["data", "train-quality", str(f), "--out", str(tmp_path / "q"), "epochz=3"]) == 2
    assert "unknown quality training option 'epochz'; did you mean 'epoch'?" in \
        capsys.readouterr().err
