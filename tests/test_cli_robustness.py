"""Bad inputs a new user tried (QA pass): each is one line and exit 2, or does the right thing."""

from __future__ import annotations

import json

import pytest
from test_cli import assert_one_line_error, cli, doc_text, write_jsonl

from olmoflow.errors import OlmoflowError
from olmoflow.pipeline.config import load_config

FAST = ("--no-progress", "train.max_steps=4", "train.checkpoint.save_interval=2",
        "train.num_threads=1")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One tiny trained run shared by the generate/latest checks."""
    tmp = tmp_path_factory.mktemp("qa")
    corpus = write_jsonl(tmp / "c.jsonl", [{"text": doc_text(i) * 4} for i in range(40)])
    from olmoflow.cli import main

    assert main(["run", "tiny", "--data", str(corpus), "--run-dir", str(tmp / "run"), *FAST]) == 0
    return tmp / "run"


@pytest.mark.parametrize("override, fragment", [
    ("train.max_steps=-1", "train.max_steps must be >= 1"),
    ("train.micro_batch_size=3", "not a multiple of train.micro_batch_size"),
    ("train.sequence_length=512", "exceeds model.max_sequence_length"),
    ("evaluate.sequence_length=100000", "exceeds model.max_sequence_length"),
    ("train=null", "config section 'train' is empty"),
    ("train.schedule.type=cosin", "did you mean 'cosine'"),
])
def test_config_errors_before_any_stage(tmp_path, capsys, override, fragment):
    rc, _, err = cli(capsys, "run", "tiny", "--run-dir", str(tmp_path / "r"), override,
                     "--no-progress")
    assert_one_line_error(rc, err, fragment)
    assert not (tmp_path / "r" / "collect").exists()  # nothing ran


def test_yaml_values_users_write(tmp_path):
    with pytest.raises(OlmoflowError, match="run_dir is empty"):
        load_config("tiny", ["run_dir=''"])
    cfg = load_config("tiny", ["train.optimizer.lr=1e-3", "train={max_steps: 7}"])
    assert cfg.train.optimizer.lr == 1e-3
    assert cfg.train.max_steps == 7 and cfg.train.sequence_length == 64  # merged, not replaced
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(OlmoflowError, match="top level must be a mapping"):
        load_config(str(bad))


def test_run_dir_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    rc, _, err = cli(capsys, "run", "tiny", "--run-dir", str(f), "--no-progress")
    assert_one_line_error(rc, err, "is not a directory")


def test_literal_special_tokens_stay_text(tmp_path, capsys):
    import numpy as np

    corpus = write_jsonl(tmp_path / "c.jsonl", [
        {"text": doc_text(i) * 3 + " Hello <|endoftext|> world <|pad|> end."} for i in range(12)])
    for verb in ("collect", "clean", "train-tokenizer", "tokenize"):
        rc, _, err = cli(capsys, verb, "tiny", "--data", str(corpus), "--run-dir",
                         str(tmp_path / "r"), "--no-progress", "tokenize.heldout_fraction=0.5")
        assert rc == 0, err
    meta = json.loads((tmp_path / "r" / "tokens" / "meta.json").read_text())
    tokens = np.memmap(tmp_path / "r" / "tokens" / "train" / "part-00000.npy",
                       dtype=meta["dtype"], mode="r")
    # exactly one EOS per document (the one the pipeline appends), and no pad token at all
    assert int((tokens == meta["eos_token_id"]).sum()) == meta["splits"]["train"]["documents"]
    assert int((tokens == meta["pad_token_id"]).sum()) == 0


def test_generate_edge_cases(run, capsys):
    rc, out, err = cli(capsys, "generate", "tiny", "--run-dir", str(run), "--prompt", "",
                       "--max-new-tokens", "5", "--no-progress")
    assert rc == 0, err
    rc, out, err = cli(capsys, "generate", "tiny", "--run-dir", str(run), "--prompt", "Hello",
                       "--max-new-tokens", "0", "--no-progress")
    assert rc == 0, err
    sample = json.loads((run / "generate" / "samples.jsonl").read_text().splitlines()[0])
    assert sample == {"prompt": "Hello", "completion": ""}
    assert "Generated text:\n--- prompt: 'Hello'\nHello" in out  # the stage's show hook
    rc, out, err = cli(capsys, "generate", "tiny", "--run-dir", str(run), "--prompt", "a",
                       "--prompt", "b", "--max-new-tokens", "2", "--no-progress")
    assert rc == 0, err
    prompts = [json.loads(ln)["prompt"] for ln in (run / "generate" / "samples.jsonl").open()]
    assert prompts == ["a", "b"] and "--- prompt: 'b'" in out
    rc, _, err = cli(capsys, "generate", "tiny", "--run-dir", str(run), "--prompt", "Hello",
                     "--max-new-tokens", "-5", "--no-progress")
    assert_one_line_error(rc, err, "max_new_tokens must be >= 0")


def test_deleted_latest_pointer_is_repaired(run, capsys):
    (run / "pretrain" / "latest").unlink()
    data = ("--data", str(run.parent / "c.jsonl"))  # the fixture's corpus: same fingerprints
    rc, out, err = cli(capsys, "run", "tiny", "--run-dir", str(run), *data, *FAST)
    assert rc == 0, err
    # repaired from step4, not trained again
    assert "[collect] skipped" in out and "[pretrain] resumed" in out
    assert (run / "pretrain" / "latest").read_text().strip() == "stage1-step4-tokens3K"
    rc, _, err = cli(capsys, "evaluate", "tiny", "--run-dir", str(run), "--force", *FAST)
    assert rc == 0, err


def test_failed_first_stage_leaves_no_run_dir(tmp_path, capsys):
    run = tmp_path / "nothing"
    rc, _, err = cli(capsys, "generate", "tiny", "--run-dir", str(run), "--prompt", "hi",
                     "--no-progress")
    assert_one_line_error(rc, err, "run 'olmoflow")
    assert not run.exists()


def test_checkpoints_of_another_config_are_never_deleted_implicitly(tmp_path, capsys):
    """A changed train config must not wipe an interrupted (or finished) run's checkpoints: the
    rerun stops with one line naming both ways forward, and each of them works."""
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": doc_text(i) * 4} for i in range(40)])
    base = ("tiny", "--data", str(corpus), "--run-dir", str(tmp_path / "run"), *FAST)
    assert cli(capsys, "run", *base)[0] == 0
    pretrain = tmp_path / "run" / "pretrain"
    before = sorted(p.name for p in pretrain.iterdir())
    rc, _, err = cli(capsys, "pretrain", *base, "train.optimizer.lr=1e-3")
    assert_one_line_error(rc, err, "resume_from=latest")
    assert sorted(p.name for p in pretrain.iterdir()) == before, "nothing was deleted"
    rc, out, _ = cli(capsys, "pretrain", *base, "train.optimizer.lr=1e-3", "train.max_steps=6",
                     "resume_from=latest")
    assert rc == 0 and "[pretrain] resumed" in out
    rc, out, _ = cli(capsys, "pretrain", *base, "train.optimizer.lr=2e-3", "--force")
    assert rc == 0 and "[pretrain] ran" in out
