"""``olmoflow data report``: every dropped document is explained by a rule, with exact counts."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest
from engine_inputs import engine_config, jsonl

from olmoflow.artifacts import atomic_write_json
from olmoflow.cli import main
from olmoflow.data.engine import Engine, load_data_config
from olmoflow.data.engine.report import check_accounting, report, step_manifests

pytest.importorskip("datasketch", reason="dedup needs datasketch (pip install 'olmoflow[data]')")

VOCAB = ("river mountain forest village garden window morning evening summer winter letter "
         "teacher student market bridge harbor island valley castle kitchen library painter "
         "farmer doctor soldier captain baker sailor writer singer dancer walked carried found "
         "opened painted wrote built crossed watched followed answered remembered gathered "
         "quiet bright heavy gentle ancient narrow golden silver careful sudden distant").split()
STOP = ("the", "and", "of", "to", "with", "that")

N_GOOD, N_DUP, N_SHORT = 24, 5, 7


def sentence(rng: random.Random) -> str:
    words = [rng.choice(VOCAB) if i % 3 else rng.choice(STOP) for i in range(rng.randint(8, 14))]
    return " ".join(words).capitalize() + "."


def document(rng: random.Random, n_sentences: int) -> str:
    return " ".join(sentence(rng) for _ in range(n_sentences))


def make_corpus(root: Path) -> Path:
    """Good documents (pass the Gopher rules), exact copies of some, and too-short ones."""
    rng = random.Random(0)
    good = [document(rng, 8) for _ in range(N_GOOD)]
    short = [document(rng, 1) for _ in range(N_SHORT)]  # < 50 words: Gopher's short_doc
    texts = good + short + good[:N_DUP]
    # The copies come after their originals in corpus order (file a, then b), so they go.
    half = len(texts) // 2
    for name, part in (("a.jsonl", texts[:half]), ("b.jsonl", texts[half:])):
        (root / "in").mkdir(parents=True, exist_ok=True)
        (root / "in" / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    cfg = root / "data.yaml"
    cfg.write_text(f"""
output: {root / "run"}
executor: serial
steps: [ingest, tag, dedup, mix]
sources:
  - {{name: web, paths: ["{root / "in"}"]}}
taggers: [gopher]
dedup: {{exact: true}}
mixer:
  exclude: ["gopher__fail_any == 1"]
""")
    return cfg


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("report")
    Engine(load_data_config(make_corpus(root))).run()
    return root / "run"


def test_report_explains_every_dropped_document(run_dir, capsys):
    text, files = report(run_dir)
    mix = step_manifests(run_dir)["mix"]["counts"]
    total = N_GOOD + N_DUP + N_SHORT
    assert mix["documents_in"] == total
    assert mix["removed"]["exclude: gopher__fail_any == 1"]["documents"] == N_SHORT
    assert mix["removed"]["exclude: dedup__exact == 1"]["documents"] == N_DUP
    assert mix["documents_out"] == N_GOOD
    assert mix["documents_in"] == mix["documents_out"] + sum(
        r["documents"] for r in mix["removed"].values())
    assert mix["sources"]["web"]["documents_in"] == total
    assert "every dropped document is explained" in text
    # Each dropped id has its reason in the mixer's attributes, and they add up to the counts.
    reasons: dict[str, int] = {}
    for f in sorted((run_dir / "attributes" / "mixer").rglob("*.jsonl.gz")):
        for line in gzip.open(f, "rt"):
            why = json.loads(line).get("dropped_by")
            if why:
                reasons[why] = reasons.get(why, 0) + 1
    assert reasons == {k: v["documents"] for k, v in mix["removed"].items()}
    pngs = [f for f in files if f.suffix == ".png"]
    assert [f.name for f in pngs] == ["hist_length.png"]  # no quality / language tagger ran
    assert pngs[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["data", "report", str(run_dir), "--no-histograms"]) == 0
    out = capsys.readouterr().out
    assert "exclude: dedup__exact == 1" in out and "Per source" in out


def test_an_unexplained_drop_is_flagged(run_dir, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    path = copy / "mixed" / "manifest.json"
    m = json.loads(path.read_text())
    del m["counts"]["removed"]["exclude: dedup__exact == 1"]
    atomic_write_json(path, m)
    bad = check_accounting(step_manifests(copy))
    assert bad == [f"mix: +{N_DUP} documents unexplained (in - kept - removed)"]
    text, _ = report(copy, histograms=False)
    assert "NOT explained" in text


def test_report_of_an_empty_directory_is_a_one_line_error(tmp_path, capsys):
    assert main(["data", "report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("olmoflow: error: no finished data step") and "\n" not in err


# --- bad input counted, decisions per line, a deleted shard ---------------------------------------


def test_bad_input_count_is_every_bad_line_not_the_examples(tmp_path, capsys):
    # `olmoflow data run` on a file with 30 non-JSON lines said "5 bad input" (the number of
    # examples kept per file), and the report's "bad input" column said 5.
    from olmoflow.cli import main

    assert main(["data", "run", str(engine_config(tmp_path)), "--no-progress"]) == 0
    assert "30 bad input" in capsys.readouterr().out
    counts = json.loads((tmp_path / "run" / "documents" / "manifest.json").read_text())["counts"]
    assert counts["errors"] == 30 and counts["sources"]["web"]["errors"] == 30
    assert counts["removed"]["not_json"]["documents"] == 30
    # The report named no bad file at all: a damaged file removes no counted document, so it was
    # visible only as a number. Now the examples are listed with file and line.
    from olmoflow.data.engine.report import report

    text, _ = report(tmp_path / "run", histograms=False)
    assert "ingest: 30 in all" in text
    assert f"{tmp_path / 'in' / 'a.jsonl'}:4: malformed JSONL: not JSON" in text


def test_histograms_follow_the_mixer_decision_per_line_not_per_id(tmp_path):
    # Two copies of one document with the same id (a shard ingested twice): dedup drops the
    # second, but the report's histograms looked ids up in the output and drew both as kept.
    from olmoflow.data.engine.report import document_scores

    src = tmp_path / "in"
    src.mkdir()
    for name in ("a", "b"):
        jsonl(src / f"{name}.jsonl", [{"id": "same", "text": "one text, twice over."}])
    cfg = load_data_config(engine_config(tmp_path, paths=f"['{src}/*.jsonl']",
                                  steps="[ingest, dedup, mix]"))
    Engine(cfg).run()
    lengths = document_scores(tmp_path / "run")["length"]
    assert (len(lengths["kept"]), len(lengths["removed"])) == (1, 1)


def test_report_on_a_run_with_a_deleted_shard_is_a_one_line_error(tmp_path, capsys):
    # `olmoflow data report DIR` after a mixed shard was deleted ended in a FileNotFoundError
    # traceback from the histogram code.
    from olmoflow.cli import main

    cfg = load_data_config(engine_config(tmp_path, steps="[ingest, mix]"))
    Engine(cfg).run()
    next((tmp_path / "run" / "mixed").rglob("*.jsonl.gz")).unlink()
    assert main(["data", "report", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("olmoflow: error: cannot read ") and "\n" not in err
