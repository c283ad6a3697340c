"""The data engine end to end: configs/data/web_crawl.yaml runs ingest -> tag -> dedup ->
decontaminate -> mix -> tokenize on the web-crawl samples in a local process pool and on a local Ray
instance with byte-identical outputs, and the report explains every dropped document.

Three documents are planted beside the real ones so that every global step has work: an exact
copy and a one-word-edited copy of two C4 documents (dedup: exact, MinHash) and a paragraph that
quotes a GSM8K test question (decontamination).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest
import yaml

from olmoflow.cli import main
from olmoflow.data.engine.report import check_accounting, report, step_manifests
from olmoflow.data.tokenize import SPLITS, check_token_dir, open_token_dir, read_index

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"
CONFIG = REPO / "configs" / "data" / "web_crawl.yaml"
COPIED, EDITED = 1, 40  # lines of c4_demo.jsonl (0-based) that pass every filter of the config
PROSE = (
    "The farm sits at the end of a long gravel road, and every morning the family walks out to "
    "the barn before the sun comes up. They feed the animals, check the fences and talk about "
    "the weather, which decides most of what they will do that day. In the spring they plant "
    "corn and beans in the lower field, and in the autumn the children help with the harvest "
    "after school. Their grandmother keeps a notebook of every season since she was young, and "
    "she likes to read from it at dinner. One evening she read a puzzle her teacher once gave "
    "her class, and the children tried to solve it together at the kitchen table: "
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (SHARED / "web-crawl").is_dir(),
                       reason="../shared/data absent: the web-crawl samples are needed"),
]


def planted_source(tmp: Path) -> Path:
    lines = (SHARED / "web-crawl" / "c4_demo.jsonl").read_text().splitlines()
    copied = json.loads(lines[COPIED])["text"]
    words = json.loads(lines[EDITED])["text"].split(" ")
    words[len(words) // 2] = "zeppelin"
    question = json.loads((SHARED / "gsm8k" / "test.jsonl").read_text().splitlines()[0])
    docs = [{"id": "planted-copy", "text": copied},
            {"id": "planted-near-copy", "text": " ".join(words)},
            {"id": "planted-contaminated", "text": PROSE + question["question"]}]
    path = tmp / "planted" / "planted.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def config_for(tmp: Path, planted: Path) -> Path:
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["sources"].append({"name": "planted", "paths": [str(planted)]})
    path = tmp / "web_crawl.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def outputs(run: Path) -> dict[str, str]:
    """sha256 of every data file a run wrote (manifests and reports record times and paths)."""
    out = {}
    for sub in ("documents", "attributes", "mixed", "tokens", "tokenizer", "quality"):
        for p in sorted((run / sub).rglob("*")):
            if p.is_file() and p.name not in ("manifest.json", "quality_report.json"):
                out[p.relative_to(run).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def dropped_by(run: Path) -> dict[str, str | None]:
    """Every document's fate from the mixer's per-document attributes: the rule or None (kept)."""
    fate = {}
    for f in sorted((run / "attributes" / "mixer").rglob("*.jsonl.gz")):
        for line in gzip.open(f, "rt", encoding="utf-8"):
            row = json.loads(line)
            fate[row["id"]] = row.get("dropped_by")
    return fate


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray", reason="ray not installed (pip install 'olmoflow[ray]')")
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    except Exception as e:  # noqa: BLE001 - any failure to start means "cannot test Ray here"
        pytest.skip(f"a local Ray instance cannot start here: {e}")
    yield ray
    ray.shutdown()


def test_web_crawl_local_and_ray_identical_and_every_drop_explained(tmp_path, monkeypatch,
                                                                    capsys, ray_local):
    monkeypatch.chdir(REPO)  # the config's paths are relative to the repo root
    cfg = config_for(tmp_path, planted_source(tmp_path))
    local, remote = tmp_path / "local", tmp_path / "ray"
    assert main(["data", "run", str(cfg), f"output={local}", "--workers", "2",
                 "--no-progress"]) == 0
    assert main(["data", "run", str(cfg), f"output={remote}", "--executor", "ray",
                 "--no-progress"]) == 0
    summary = capsys.readouterr().out
    assert summary.count("skipped") == 0 and summary.count("tokenize ") == 2

    a, b = outputs(local), outputs(remote)
    assert a == b and len(a) > 40
    assert main(["data", "run", str(cfg), f"output={local}", "--no-progress"]) == 0
    assert capsys.readouterr().out.count("skipped (done)") == 6

    # The report: every step adds up, per source too, and says so.
    text, files = report(local)
    manifests = step_manifests(local)
    assert check_accounting(manifests) == [] and "every dropped document is explained" in text
    assert {f.name for f in files} >= {"hist_length.png", "hist_quality.png", "hist_language.png"}
    mix = manifests["mix"]["counts"]
    ingest = manifests["ingest"]["counts"]
    assert mix["documents_in"] == ingest["documents_out"] >= 350
    fate = dropped_by(local)
    assert len(fate) == mix["documents_in"]
    reasons: dict[str, int] = {}
    for why in fate.values():
        if why:
            reasons[why] = reasons.get(why, 0) + 1
    assert reasons == {k: v["documents"] for k, v in mix["removed"].items()}
    # The planted documents go for the right reason; their originals stay.
    assert fate[f"c4/c4_demo.jsonl:{COPIED + 1}"] is None
    assert fate[f"c4/c4_demo.jsonl:{EDITED + 1}"] is None
    assert fate["planted-copy"] == "exclude: dedup__exact == 1"
    assert fate["planted-near-copy"] == "exclude: dedup__minhash == 1"
    assert fate["planted-contaminated"] == "exclude: decontam__contaminated == 1"
    assert manifests["decontaminate"]["counts"]["flagged"]["decontam__gsm8k"]["documents"] == 1
    assert fate["misc/cs336_german.txt"] == "exclude: langid__en < 0.5"

    # PII is masked: no email address is left in what the mixer wrote.
    from olmoflow.data.taggers.pii import EMAIL

    assert mix["edited"]["replace: pii__email_address"]["documents"] > 0
    mixed = [json.loads(line)["text"] for p in sorted((local / "mixed").rglob("*.jsonl.gz"))
             for line in gzip.open(p, "rt", encoding="utf-8")]
    assert any("|||EMAIL_ADDRESS|||" in t for t in mixed)
    assert not any(EMAIL.search(t) for t in mixed)

    # Tokens: indexes match the arrays, and hold exactly the mixed documents, in order.
    checked = check_token_dir(local / "tokens", expected_documents=mix["documents_out"])
    assert checked["tokens"] == manifests["tokenize"]["counts"]["tokens"]
    meta = json.loads((local / "tokens" / "meta.json").read_text())
    split_ids = {s: [row[2] for f in meta["splits"][s]["files"]
                     for row in read_index(local / "tokens" / f["index"])] for s in SPLITS}
    ids = split_ids["train"] + split_ids["heldout"]
    kept = [i for i, why in fate.items() if why is None]
    assert sorted(ids) == sorted(kept) and len(ids) == len(set(ids))
    # The held-out split: whole documents, the main flow's seeded rule, and pretraining can open it.
    assert split_ids["heldout"] and split_ids["train"]
    td = open_token_dir(local / "tokens")
    assert td.split("heldout") and td.split("train") and td.load_tokenizer().vocab_size
