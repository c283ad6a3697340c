"""The stage runner: a stage is one entry in the table of stages, and the runner treats every
entry alike (skips what is complete, reruns what changed, keeps a training stage's checkpoints).

The stages here are written in the test and added to a copy of the flow's table, so they run in
milliseconds and show what a new stage (sft, evaluation across checkpoints, ...) gets for free.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from olmoflow.artifacts import StageResult, atomic_write_text, read_manifest
from olmoflow.errors import OlmoflowError
from olmoflow.pipeline import runner
from olmoflow.pipeline.config import RunConfig
from olmoflow.pipeline.runner import fingerprint, run_pipeline, run_stage
from olmoflow.pipeline.stage import Stage, Trains
from olmoflow.pipeline.stages import STAGES
from olmoflow.run_dir import RunDir

CALLS: list[str] = []


def _write_source(cfg: RunConfig, progress: bool) -> StageResult:
    CALLS.append("toy-source")
    out = RunDir(cfg.run_dir).stage("toy-source")
    atomic_write_text(out / "words.txt", f"{cfg.release.name}\n")
    return StageResult(inputs=[], outputs=[out / "words.txt"], counts={"words": 1})


def _count(cfg: RunConfig, progress: bool) -> StageResult:
    CALLS.append("toy")
    runs = RunDir(cfg.run_dir)
    text = runs.need("toy-source", "words.txt").read_text()
    out = runs.stage("toy")
    atomic_write_text(out / "count.json", json.dumps({"chars": len(text), "seed": cfg.seed}))
    return StageResult(inputs=[runs.stage("toy-source") / "words.txt"],
                       outputs=[out / "count.json"], counts={"chars": len(text), "ok": True})


SOURCE = Stage("toy-source", _write_source, ("release.name",), headline=("words",))
TOY = Stage("toy", _count, ("seed",), upstream=("toy-source",), headline=("chars",),
            help="count the source's characters")


@pytest.fixture
def table():
    CALLS.clear()
    return STAGES.with_stage(SOURCE).with_stage(TOY)


def cfg_for(root: Path, **release) -> RunConfig:
    cfg = RunConfig(run_dir=str(root))
    cfg.release = replace(cfg.release, **release)
    return cfg


def statuses(rows) -> dict[str, str]:
    return {name: status for name, status, _, _ in rows}


def test_a_stage_added_to_a_copy_of_the_table_is_skipped_when_complete(tmp_path, table, capsys):
    assert "toy" in table and "toy" not in STAGES  # the flow's own table is unchanged
    assert table.names[-2:] == ["toy-source", "toy"]
    cfg = cfg_for(tmp_path / "run")
    rows = run_pipeline(cfg, stages=["toy-source", "toy"], progress=False, table=table)
    assert statuses(rows) == {"toy-source": "ran", "toy": "ran"}
    out = capsys.readouterr().out
    assert "[toy] ran" in out and "chars=" in out and "toy-source" in out  # headline and summary
    toy_dir = RunDir(cfg.run_dir).stage("toy")
    assert toy_dir == tmp_path / "run" / "toy"  # a stage RunDir does not list: its own name
    manifest = read_manifest(toy_dir)
    assert manifest["stage"] == "toy" and manifest["counts"]["chars"] == len("olmoflow-model\n")
    assert manifest["inputs"][0]["path"] == "toy-source/words.txt"
    assert RunDir(cfg.run_dir).config.is_file()

    rows = run_pipeline(cfg, stages=["toy-source", "toy"], progress=False, table=table)
    assert statuses(rows) == {"toy-source": "skipped", "toy": "skipped"}
    assert CALLS == ["toy-source", "toy"]  # neither ran again
    assert rows[1][3]["chars"] == len("olmoflow-model\n")  # counts come from the manifest


def test_a_stage_reruns_when_its_upstream_or_its_own_sections_change(tmp_path, table):
    cfg = cfg_for(tmp_path / "run")
    run_pipeline(cfg, stages=["toy-source", "toy"], progress=False, table=table)
    CALLS.clear()

    other = cfg_for(tmp_path / "run", name="another-name")  # only the source's section
    before = fingerprint(cfg, "toy", table)
    rows = run_pipeline(other, stages=["toy-source", "toy"], progress=False, table=table)
    assert statuses(rows) == {"toy-source": "ran", "toy": "ran"}  # the toy's upstream changed
    assert fingerprint(other, "toy", table) != before
    assert json.loads((tmp_path / "run" / "toy" / "count.json").read_text())["chars"] == 13

    CALLS.clear()
    reseeded = cfg_for(tmp_path / "run", name="another-name")
    reseeded.seed = 7  # only the toy's own section
    rows = run_pipeline(reseeded, stages=["toy-source", "toy"], progress=False, table=table)
    assert statuses(rows) == {"toy-source": "skipped", "toy": "ran"}

    CALLS.clear()
    reseeded.release = replace(reseeded.release, license="mit")  # in neither stage's sections
    rows = run_pipeline(reseeded, stages=["toy-source", "toy"], progress=False, table=table)
    assert statuses(rows) == {"toy-source": "skipped", "toy": "skipped"} and CALLS == []


def test_an_edited_output_makes_its_stage_run_again(tmp_path, table):
    cfg = cfg_for(tmp_path / "run")
    run_pipeline(cfg, stages=["toy-source", "toy"], progress=False, table=table)
    (tmp_path / "run" / "toy" / "count.json").write_text("{}")
    status, _, _ = run_stage(cfg, "toy", progress=False, table=table)
    assert status == "ran"
    assert json.loads((tmp_path / "run" / "toy" / "count.json").read_text())["seed"] == cfg.seed


def test_bookkeeping_keys_and_stamps_are_the_records_business(tmp_path, table):
    stamp_file = tmp_path / "outside.txt"
    stamp_file.write_text("v1")
    stage = Stage("toy-kept", _count, ("release",), upstream=("toy-source",),
                  ignore=("release.license",), stamp=lambda cfg: stamp_file.read_text())
    t = table.with_stage(stage)
    cfg = cfg_for(tmp_path / "run")
    base = fingerprint(cfg, "toy-kept", t)
    assert fingerprint(cfg_for(tmp_path / "run", license="mit"), "toy-kept", t) == base
    assert fingerprint(cfg_for(tmp_path / "run", name="x"), "toy-kept", t) != base
    stamp_file.write_text("v2")
    assert fingerprint(cfg, "toy-kept", t) != base


def test_a_disabled_stage_is_not_run_and_not_part_of_its_downstream_fingerprint(tmp_path):
    cfg = cfg_for(tmp_path / "run")
    on = STAGES.with_stage(SOURCE).with_stage(TOY)
    off = STAGES.with_stage(replace(SOURCE, enabled=lambda c: c.seed != cfg.seed)).with_stage(TOY)
    assert "toy-source" in [s.name for s in on.enabled(cfg)]
    assert "toy-source" not in [s.name for s in off.enabled(cfg)]
    source_dir = RunDir(cfg.run_dir).stage("toy-source")
    source_dir.mkdir(parents=True)
    prints = {}
    for made in ("first", "second"):  # the upstream's manifest changes
        (source_dir / "manifest.json").write_text(json.dumps({"fingerprint": made}))
        prints[made] = fingerprint(cfg, "toy", on), fingerprint(cfg, "toy", off)
    assert prints["first"][0] != prints["second"][0]  # enabled: part of the fingerprint
    assert prints["first"][1] == prints["second"][1]  # disabled: not read at all


def _fake_train(cfg: RunConfig, progress: bool) -> StageResult:
    """Saves a 'checkpoint' the way the trainer lays them out (step dir, trainer state, latest)."""
    CALLS.append(f"train resume_from={runner._get_dotted(cfg, PRETRAIN_RESUME)}")
    out = RunDir(cfg.run_dir).stage("toy-train")
    step = out / "step1"
    step.mkdir(parents=True, exist_ok=True)
    (step / "trainer_state.pt").write_bytes(b"state")
    atomic_write_text(out / "latest", "step1\n")
    return StageResult(inputs=[], outputs=[step / "trainer_state.pt"], counts={"steps": 1})


PRETRAIN_RESUME = STAGES["pretrain"].trains.resume_key
TRAIN = Stage("toy-train", _fake_train, ("release.name",), trains=Trains(PRETRAIN_RESUME))


def test_a_training_stage_keeps_checkpoints_made_under_another_config(tmp_path):
    CALLS.clear()
    t = STAGES.with_stage(TRAIN)
    cfg = cfg_for(tmp_path / "run")
    assert run_stage(cfg, "toy-train", progress=False, table=t)[0] == "ran"
    changed = cfg_for(tmp_path / "run", name="changed")
    with pytest.raises(OlmoflowError,
                       match="holds checkpoints .* train.checkpoint.resume_from=latest .* --force"):
        run_stage(changed, "toy-train", progress=False, table=t)
    assert (tmp_path / "run" / "toy-train" / "step1" / "trainer_state.pt").is_file()

    runner._set_dotted_attr(changed, PRETRAIN_RESUME, "latest")
    assert run_stage(changed, "toy-train", progress=False, table=t)[0] == "resumed"
    assert CALLS[-1] == "train resume_from=latest"

    again = cfg_for(tmp_path / "run", name="again")
    assert run_stage(again, "toy-train", progress=False, table=t, force=True)[0] == "ran"
    assert CALLS[-1] == "train resume_from=None"


def test_unknown_stage_names_fail_before_anything_runs(tmp_path, table):
    root = tmp_path / "run"
    with pytest.raises(OlmoflowError, match="unknown stage 'tyo'; did you mean 'toy'"):
        run_pipeline(cfg_for(root), stages=["toy-source", "tyo"], progress=False, table=table)
    assert CALLS == [] and not root.exists()


def test_the_runner_names_no_stage():
    source = Path(runner.__file__).read_text()
    for word in {*STAGES.names, *(s.dirname for s in STAGES), "pretraining", "tokenizer"}:
        assert not re.search(rf"(?i)(?<![\w-]){re.escape(word)}(?![\w-])", source), word
