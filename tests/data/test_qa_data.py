"""Regression tests for what QA found using the data engine as a new user would.

Each test names the command that went wrong and states what must hold instead: every bad input
line counted, config mistakes reported before the first step runs, one-line errors instead of
tracebacks, no worker processes or temporary files left behind by a killed run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from olmoflow.data.engine import Engine, load_data_config
from olmoflow.data.readers import Input, ReadLog, ReadOptions, read_input
from olmoflow.errors import OlmoflowError

GOOD = [{"text": f"document number {i} says something about the weather today.", "n": i}
        for i in range(3)]


def jsonl(path: Path, rows: list, garbage: int = 0) -> Path:
    lines = [json.dumps(r) for r in rows] + [f"garbage line {i}" for i in range(garbage)]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def config(tmp: Path, extra: str = "", steps: str = "[ingest]", paths: str | None = None) -> Path:
    src = tmp / "in"
    src.mkdir(exist_ok=True)
    if paths is None:
        jsonl(src / "a.jsonl", GOOD, garbage=30)
        paths = f"[{src / 'a.jsonl'}]"
    cfg = tmp / "data.yaml"
    cfg.write_text(f"output: {tmp / 'run'}\nexecutor: serial\nsteps: {steps}\n"
                   f"sources: [{{name: web, paths: {paths}}}]\ntaggers: [pii]\n{extra}")
    return cfg


def test_bad_input_count_is_every_bad_line_not_the_examples(tmp_path, capsys):
    # `olmoflow data run` on a file with 30 non-JSON lines said "5 bad input" (the number of
    # examples kept per file), and the report's "bad input" column said 5.
    from olmoflow.cli import main

    assert main(["data", "run", str(config(tmp_path)), "--no-progress"]) == 0
    assert "30 bad input" in capsys.readouterr().out
    counts = json.loads((tmp_path / "run" / "documents" / "manifest.json").read_text())["counts"]
    assert counts["errors"] == 30 and counts["sources"]["web"]["errors"] == 30
    assert counts["removed"]["not_json"]["documents"] == 30
    # The report named no bad file at all: a damaged file removes no counted document, so it was
    # visible only as a number. Now the examples are listed with file and line.
    from olmoflow.data.report import report

    text, _ = report(tmp_path / "run", histograms=False)
    assert "ingest: 30 in all" in text
    assert f"{tmp_path / 'in' / 'a.jsonl'}:4: malformed JSONL: not JSON" in text


@pytest.mark.parametrize("override, message", [
    ("mixer.exclud=[]", "unknown config key 'mixer.exclud'; did you mean 'mixer.exclude'?"),
    ("mixer.exclude=['gopher__fail_any = 1']", "cannot parse rule"),
    ("mixer.weights={webb: 2}", "unknown source 'webb'; did you mean 'web'?"),
    ("dedup.exakt=true", "unknown config key 'dedup.exakt'; did you mean 'dedup.exact'?"),
    ("decontaminate.evals=[arcc]", "did you mean 'arc'?"),
    ("taggers=[pii, gopherr]", "unknown tagger 'gopherr'; did you mean 'gopher'?"),
    ("dedup.minhash.threshold=abc", "dedup.minhash.threshold' expects float, got 'abc'"),
    ("tokenize.dtype=uint8", "unknown tokenize.dtype 'uint8'"),
    ("tokenize.tokenizer=/no/such/tokenizer", "no such directory '/no/such/tokenizer'"),
    ("quality.labeled=[/no/such/labels.jsonl]", "'/no/such/labels.jsonl' matches no file"),
])
def test_config_mistakes_stop_the_run_before_the_first_step(tmp_path, override, message):
    # A typo in the mixer (or dedup, decontamination, taggers) was reported only when its step
    # came, after ingest and tagging had run: hours, on a real corpus.
    steps = "[ingest, tag, dedup, decontaminate, mix, tokenize]"
    with pytest.raises(OlmoflowError, match=re.escape(message)):  # at load, or before ingest
        Engine(load_data_config(config(tmp_path, steps=steps), [override])).run()
    assert not (tmp_path / "run" / "documents").exists()


def test_output_that_is_a_file_is_a_one_line_error(tmp_path, capsys):
    # `olmoflow data run CFG --output FILE` ended in a FileExistsError traceback.
    from olmoflow.cli import main

    target = tmp_path / "not_a_dir"
    target.write_text("precious")
    for out in (target, target / "sub"):
        assert main(["data", "run", str(config(tmp_path)), "--output", str(out),
                     "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("olmoflow: error: ") and "\n" not in err and str(target) in err
    assert target.read_text() == "precious"


def test_no_usable_document_is_named_at_ingest(tmp_path):
    # With a wrong text_field every line was skipped, tag/dedup/decontaminate ran on nothing,
    # and the mixer failed with "unknown attribute 'dedup__exact'", a rule the user never wrote.
    src = tmp_path / "in"
    src.mkdir()
    jsonl(src / "a.jsonl", [{"body": "text under another field"}] * 4)
    cfg = load_data_config(config(tmp_path, paths=f"[{src / 'a.jsonl'}]",
                                  steps="[ingest, tag, dedup, mix]"))
    with pytest.raises(OlmoflowError, match=r"missing_text 4.*a\.jsonl:1: .*field 'text' "
                                            r"missing.*text_field"):
        Engine(cfg).run()
    (src / "a.jsonl").write_text("")
    with pytest.raises(OlmoflowError, match="empty_file 1"):
        Engine(cfg, force=True).run()


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


def test_train_quality_takes_options_after_out(tmp_path, capsys):
    # docs/data.md: `olmoflow data train-quality FILES --out DIR epoch=10` failed with
    # "unrecognized arguments: epoch=10". An unknown option shows the options reach training.
    from olmoflow.cli import main

    f = jsonl(tmp_path / "l.jsonl", [{"text": "x", "label": 1}])
    assert main(["data", "train-quality", str(f), "--out", str(tmp_path / "q"), "epochz=3"]) == 2
    assert "unknown quality training option 'epochz'; did you mean 'epoch'?" in \
        capsys.readouterr().err


def test_a_rerun_removes_temporaries_left_by_a_killed_writer(tmp_path):
    # After kill -9 mid-step, hidden `.<shard>.<random>.tmp` files stayed in the run directory
    # for good (a rerun wrote fresh ones beside them).
    cfg = load_data_config(config(tmp_path))
    stale = tmp_path / "run" / "documents" / "web" / ".00000_a.jsonl.gz.k2j4x9.tmp"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"\x1f\x8b half a shard")
    Engine(cfg).run()
    assert not stale.exists()
    assert not list((tmp_path / "run").rglob("*.tmp"))


DRIVER = textwrap.dedent("""
    import sys, time
    from olmoflow.data.executor import _pool
    pool = _pool(2)
    futures = [pool.submit(time.sleep, 600) for _ in range(2)]
    time.sleep(0.5)
    print(" ".join(str(p) for p in pool._processes), flush=True)
    time.sleep(600)
""")


@pytest.mark.skipif(sys.platform != "linux", reason="process checks use /proc")
def test_killing_the_driver_ends_its_pool_workers(tmp_path):
    # kill -9 of `olmoflow data run` (or the OOM killer) left the forkserver and every pool worker
    # running for good, each holding its memory, blocked on a queue nobody would write to again.
    proc = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True,
                            env={**os.environ,
                                 "PYTHONPATH": str(Path(__file__).parents[2] / "src")})
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 2 and all(Path(f"/proc/{p}").exists() for p in workers)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in workers):
        time.sleep(0.1)
    alive = [p for p in workers if Path(f"/proc/{p}").exists()]
    for p in alive:  # do not leave them behind if the test fails
        os.kill(p, signal.SIGKILL)
    assert not alive


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

def test_histograms_follow_the_mixer_decision_per_line_not_per_id(tmp_path):
    # Two copies of one document with the same id (a shard ingested twice): dedup drops the
    # second, but the report's histograms looked ids up in the output and drew both as kept.
    from olmoflow.data.report import document_scores

    src = tmp_path / "in"
    src.mkdir()
    for name in ("a", "b"):
        jsonl(src / f"{name}.jsonl", [{"id": "same", "text": "one text, twice over."}])
    cfg = load_data_config(config(tmp_path, paths=f"['{src}/*.jsonl']",
                                  steps="[ingest, dedup, mix]"))
    Engine(cfg).run()
    lengths = document_scores(tmp_path / "run")["length"]
    assert (len(lengths["kept"]), len(lengths["removed"])) == (1, 1)


def digests(d: Path) -> dict[str, str]:
    import hashlib

    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and p.name != "manifest.json"}


def test_removing_a_source_gives_the_bytes_of_a_fresh_run(tmp_path):
    # Dropping a source from the config and rerunning left its shards in mixed/ and tokens/ (a
    # glob over tokens/ still trained on them), and kept the other shards' token arrays from
    # the BPE trained before (their done-markers named the tokenizer by path only), while
    # tokenizer/ and meta.json described the retrained one.
    src = tmp_path / "in"
    src.mkdir()
    words = {"a": "river stone water bank fish reed mud", "b": "star orbit comet moon dust sky"}
    for name, vocab in words.items():
        rows = [{"text": " ".join(vocab.split()[i:] + vocab.split()[:i]) * 3} for i in range(7)]
        jsonl(src / f"{name}.jsonl", rows)
    body = ("executor: serial\nsteps: [ingest, mix, tokenize]\ntokenize: {vocab_size: 300, "
            "min_frequency: 1}\nsources:\n  - {name: a, paths: [%s]}\n" % (src / "a.jsonl"))
    both = body + "  - {name: b, paths: [%s]}\n" % (src / "b.jsonl")
    (tmp_path / "both.yaml").write_text(both)
    (tmp_path / "one.yaml").write_text(body)
    run, fresh = str(tmp_path / "run"), str(tmp_path / "fresh")
    Engine(load_data_config(tmp_path / "both.yaml", [f"output={run}"])).run()
    assert (tmp_path / "run" / "tokens" / "train" / "b").is_dir()
    Engine(load_data_config(tmp_path / "one.yaml", [f"output={run}"])).run()
    Engine(load_data_config(tmp_path / "one.yaml", [f"output={fresh}"])).run()
    for d in ("documents", "mixed", "tokens", "tokenizer"):
        assert digests(tmp_path / "run" / d) == digests(tmp_path / "fresh" / d), d


def test_editing_a_plugin_tagger_retags_every_shard(tmp_path):
    # The tag step reran after a plugin file changed (its fingerprint holds the file's stamp),
    # but every shard was skipped by its done-marker, which named the plugin by path only: the
    # attributes kept the old code's scores.
    plugin = tmp_path / "mine.py"
    code = ("from olmoflow.data.taggers import Tagger, register_tagger\n\n"
            "@register_tagger('mine')\nclass Mine(Tagger):\n    def tag(self, doc):\n"
            "        return {self.attr('score'): [[0, len(doc['text']), %s]]}\n")
    cfg = config(tmp_path, steps="[ingest, tag]",
                 extra=f"plugins: [{plugin}]\n").read_text().replace("[pii]", "[mine]")
    (tmp_path / "data.yaml").write_text(cfg)
    cli = [sys.executable, "-c", "import sys; from olmoflow.cli import main; "
           "sys.exit(main(sys.argv[1:]))", "data", "run", str(tmp_path / "data.yaml"),
           "--no-progress"]
    scores = []
    for value in (1.0, 2.0):
        plugin.write_text(code % value)
        subprocess.run(cli, check=True, capture_output=True)
        from olmoflow.data.taggers import read_attributes

        rows = read_attributes(next((tmp_path / "run" / "attributes" / "tags").rglob("*.gz")))
        scores.append({r["attributes"]["mine__score"][0][2] for r in rows})
    assert scores == [{1.0}, {2.0}]


def test_report_on_a_run_with_a_deleted_shard_is_a_one_line_error(tmp_path, capsys):
    # `olmoflow data report DIR` after a mixed shard was deleted ended in a FileNotFoundError
    # traceback from the histogram code.
    from olmoflow.cli import main

    cfg = load_data_config(config(tmp_path, steps="[ingest, mix]"))
    Engine(cfg).run()
    next((tmp_path / "run" / "mixed").rglob("*.jsonl.gz")).unlink()
    assert main(["data", "report", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("olmoflow: error: cannot read ") and "\n" not in err
