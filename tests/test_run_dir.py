"""RunDir: the map from stages to directories the stage records register, and the readers that
ask it."""

from __future__ import annotations

import json

import pytest

from olmoflow import run_dir
from olmoflow.errors import OlmoflowError
from olmoflow.pipeline.stages import STAGES
from olmoflow.run_dir import TRAINING_LOG, RunDir


def test_stages_map_to_their_directories(tmp_path):
    runs = RunDir(tmp_path)
    assert runs.stage("train-tokenizer") == tmp_path / "tokenizer"
    assert runs.stage("tokenize") == tmp_path / "tokens"
    assert runs.stage("evaluate") == tmp_path / "eval"
    assert runs.stage("sft") == tmp_path / "sft"
    assert runs.stage("toy") == tmp_path / "toy"  # a stage no record names: its name
    assert runs.training_log() == tmp_path / "pretrain" / TRAINING_LOG
    assert runs.training_log("sft") == tmp_path / "sft" / TRAINING_LOG
    assert runs.config == tmp_path / "config.yaml"


def test_every_record_s_directory_is_the_one_run_dir_gives(tmp_path):
    assert run_dir.flow_places() == tuple(STAGES)
    assert [s.name for s in run_dir.model_places()] == [s.name for s in STAGES.models()]
    dirs = [s.dirname for s in STAGES]
    assert len(set(dirs)) == len(dirs)
    for s in STAGES:
        assert RunDir(tmp_path).stage(s.name) == tmp_path / s.dirname


def test_two_stages_of_one_directory_are_refused():
    place = run_dir.StagePlace
    with pytest.raises(ValueError, match="share directory 'x'"):
        run_dir.register_flow([place("a", directory="x"), place("x")])
    with pytest.raises(ValueError, match="not a plain directory name"):
        run_dir.register_flow([place("a", directory="../x")])
    assert run_dir.flow_places() == tuple(STAGES)  # a refused table changes nothing


def test_without_the_records_a_finished_stage_is_found_by_its_manifest(tmp_path, monkeypatch):
    monkeypatch.setattr(run_dir, "_FLOW", ())
    (tmp_path / "tokens").mkdir()
    (tmp_path / "tokens" / "manifest.json").write_text(json.dumps({"stage": "tokenize"}))
    (tmp_path / "pretrain").mkdir()
    (tmp_path / "pretrain" / TRAINING_LOG).write_text("")
    runs = RunDir(tmp_path)
    assert runs.stage("tokenize") == tmp_path / "tokens"
    assert runs.stage("pretrain") == tmp_path / "pretrain"
    assert runs.stage("clean") == tmp_path / "clean"  # nowhere: its name
    assert runs.training_log() == tmp_path / "pretrain" / TRAINING_LOG
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / TRAINING_LOG).write_text("")
    with pytest.raises(OlmoflowError, match="holds 2 training logs.*name the stage"):
        runs.training_log()
    assert RunDir.containing(tmp_path / "tokens") is None  # no config.yaml beside it
    (tmp_path / "config.yaml").write_text("seed: 1\n")
    assert RunDir.containing(tmp_path / "tokens") == runs


@pytest.mark.parametrize("overrides, lengths", [
    ({}, [64]),
    ({"sft": {"data": {"paths": ["a.jsonl"]}, "train": {"sequence_length": 256}}}, [64, 256]),
    # a section without data did not run; RL trains on its prompts, not on windows
    ({"dpo": {"data": {"paths": []}, "train": {"sequence_length": 512}},
      "rl": {"prompts": {"source": "arithmetic"}, "train": {"sequence_length": 999}}}, [64]),
])
def test_trained_lengths_follow_the_records_and_their_rule_without_them(
        monkeypatch, overrides, lengths):
    tree = {"train": {"sequence_length": 64}, **overrides}
    assert run_dir.trained_lengths(tree) == lengths
    monkeypatch.setattr(run_dir, "_FLOW", ())
    assert run_dir.trained_lengths(tree) == lengths


@pytest.mark.parametrize("bad", ["", "..", "../x", "a/b", ".hidden", "-x"])
def test_a_stage_name_must_be_one_plain_directory_name(tmp_path, bad):
    with pytest.raises(OlmoflowError, match="is not a stage name"):
        RunDir(tmp_path).stage(bad)


def test_need_names_the_stage_to_run(tmp_path):
    with pytest.raises(OlmoflowError, match=r"tokens/meta.json' is missing; run 'olmoflow "
                                            r"tokenize' \(or 'olmoflow run'\) first"):
        RunDir(tmp_path).need("tokenize", "meta.json")
    (tmp_path / "tokens").mkdir()
    (tmp_path / "tokens" / "meta.json").write_text("{}")
    assert RunDir(tmp_path).need("tokenize", "meta.json") == tmp_path / "tokens" / "meta.json"


def test_containing_finds_the_run_of_a_stage_directory(tmp_path):
    run = tmp_path / "run"
    assert RunDir.containing(run) is None
    (run / "pretrain").mkdir(parents=True)
    assert RunDir.containing(run) == RunDir(run)
    (run / "config.yaml").write_text("seed: 1\n")
    assert RunDir.containing(run / "pretrain") == RunDir(run)
    assert RunDir.containing(tmp_path) is None


def test_plot_finds_the_training_log_through_run_dir(tmp_path):
    pytest.importorskip("matplotlib")
    from olmoflow.train.plot import _run_name, find_log

    run = tmp_path / "myrun"
    log = RunDir(run).training_log()
    with pytest.raises(OlmoflowError, match=f"no training log at '{run}'.*pretrain/{TRAINING_LOG}"):
        find_log(run)
    log.parent.mkdir(parents=True)
    log.write_text('{"step": 1, "loss": 2.0}\n')
    assert find_log(run) == log == find_log(log.parent) == find_log(log)
    assert _run_name(log) == "myrun"
    other = tmp_path / "elsewhere" / TRAINING_LOG
    other.parent.mkdir()
    other.write_text("")
    assert _run_name(other) == ""


def test_the_training_log_readers_look_for_is_the_one_the_trainer_writes():
    from olmoflow.train.trainer import METRICS

    assert TRAINING_LOG == METRICS
