"""RunDir: the one map from stages to directories, and the readers that ask it."""

from __future__ import annotations

import pytest

from olmoflow.errors import OlmoflowError
from olmoflow.run_dir import STAGE_DIRS, TRAINING_LOG, RunDir


def test_stages_map_to_their_directories(tmp_path):
    runs = RunDir(tmp_path)
    assert runs.stage("train-tokenizer") == tmp_path / "tokenizer"
    assert runs.stage("tokenize") == tmp_path / "tokens"
    assert runs.stage("evaluate") == tmp_path / "eval"
    assert runs.stage("sft") == tmp_path / "sft"  # a stage the table does not list: its name
    assert runs.training_log() == tmp_path / "pretrain" / TRAINING_LOG
    assert runs.training_log("sft") == tmp_path / "sft" / TRAINING_LOG
    assert runs.config == tmp_path / "config.yaml"
    assert len(set(STAGE_DIRS.values())) == len(STAGE_DIRS)


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
