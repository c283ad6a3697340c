"""The data engine's steps are records run by one rule of recorded work; the runner names none."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from test_engine import small_run

import olmoflow.data.engine.runner as runner
from olmoflow.data.engine import Engine, load_data_config
from olmoflow.data.engine.steps import STEP_NAMES, STEP_TABLE, STEPS, enabled_steps


def test_every_step_is_a_record_and_the_runner_names_none():
    names = [s.name for s in STEPS]
    assert len(set(names)) == len(names)
    for s in STEPS:
        assert all(names.index(u) < names.index(s.name) for u in s.upstream), s.name
        assert s.part_of is None or names.index(s.part_of) == names.index(s.name) + 1
    assert STEP_NAMES == ("ingest", "tag", "dedup", "decontaminate", "mix", "tokenize")
    # The runner's source holds no step's name: what it needs is in the records.
    tree = ast.parse(Path(runner.__file__).read_text())
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
               and isinstance(n.value, str)}
    assert not strings & set(names), strings & set(names)


def test_a_trained_tokenizer_is_a_step_skipped_and_rerun_by_its_fingerprint(tmp_path):
    cfg = load_data_config(small_run(tmp_path))
    assert [s.name for s in enabled_steps(cfg, ["mix", "tokenize"])] == \
        ["mix", "train-tokenizer", "tokenize"]
    outcomes = Engine(cfg).run()
    assert [o.step for o in outcomes] == cfg.steps  # a part is reported with its step
    tok = tmp_path / "run" / "tokenizer"
    m = json.loads((tok / "manifest.json").read_text())
    assert m["stage"] == "data train-tokenizer" and m["command"] == "olmoflow data tokenize"
    assert m["fingerprint"] == Engine(cfg).fingerprint("train-tokenizer")
    stamp = (tok / "tokenizer.json").stat().st_mtime_ns
    assert all(o.skipped for o in Engine(cfg).run())
    assert (tok / "tokenizer.json").stat().st_mtime_ns == stamp  # skipped: not trained again
    # A new vocabulary size: the tokenizer step runs again (and tokenize with it).
    cfg2 = load_data_config(small_run(tmp_path), ["tokenize.vocab_size=290"])
    again = {o.step: o.skipped for o in Engine(cfg2).run()}
    assert again["tokenize"] is False and again["mix"] is True
    assert json.loads((tok / "manifest.json").read_text())["config"]["vocab_size"] == 290
    # A given tokenizer: no tokenizer step at all.
    cfg3 = load_data_config(small_run(tmp_path), [f"tokenize.tokenizer={tok}"])
    assert "train-tokenizer" not in [s.name for s in enabled_steps(cfg3, ["tokenize"])]
    assert STEP_TABLE["train-tokenizer"].directory == "tokenizer"


def test_a_new_step_is_one_record_in_the_table_the_engine_runs(tmp_path):
    # datatrove's executor runs a list of step objects; so does the engine: a step added by a
    # record runs, is recorded and skipped like the built-in ones, and the runner is unchanged.
    import pytest

    from olmoflow.artifacts import StageResult, atomic_write_text
    from olmoflow.data.documents import read_documents
    from olmoflow.data.engine import Step
    from olmoflow.errors import OlmoflowError

    def run_count(engine):
        out = engine.step_dir("count")
        shards = [Path(s["path"]) for s in engine.shards("mix")]
        n = sum(1 for p in shards for _ in read_documents(p))
        atomic_write_text(out / "count.txt", f"{n}\n")
        return StageResult(inputs=shards, outputs=[out / "count.txt"], counts={"documents": n}), {}

    count = Step("count", "count", ("mix",), lambda engine: {"what": "documents"}, run_count)
    cfg = load_data_config(small_run(tmp_path), ["steps=[ingest, tag, dedup, mix, count]"])
    first = Engine(cfg, steps=(*STEPS, count)).run()
    assert [o.step for o in first][-1] == "count" and not first[-1].skipped
    mixed = first[-2].counts["documents_out"]
    assert (tmp_path / "run" / "count" / "count.txt").read_text() == f"{mixed}\n"
    m = json.loads((tmp_path / "run" / "count" / "manifest.json").read_text())
    assert m["stage"] == "data count" and m["counts"] == {"documents": mixed}
    assert all(o.skipped for o in Engine(cfg, steps=(*STEPS, count)).run())
    with pytest.raises(OlmoflowError, match="unknown step 'count'"):
        Engine(cfg).run()  # not in the engine's own table
