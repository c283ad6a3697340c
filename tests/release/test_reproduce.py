"""``olmoflow reproduce``: a run's steps replayed from a kept checkpoint equal its log bit for
bit; with one setting changed, the first divergent step is the one the change first reaches."""

from __future__ import annotations

import pytest

from olmoflow.cli import main
from olmoflow.pipeline.config import load_config
from olmoflow.pipeline.reproduce import reproduce
from olmoflow.pipeline.runner import run_pipeline

STEPS = 12
TRAIN = [f"train.max_steps={STEPS}", "train.num_threads=1", "train.sequence_length=32",
         "train.global_batch_size=4", "train.micro_batch_size=2", "train.log.interval=1",
         "train.checkpoint.save_interval=5", "train.checkpoint.keep_last=0"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("repro")
    cfg = load_config("tiny", TRAIN, {"run_dir": str(d)})
    run_pipeline(cfg, stages=["collect", "clean", "train-tokenizer", "tokenize", "pretrain"],
                 progress=False)
    return d


def test_a_replay_equals_the_log_bit_for_bit(run, capsys):
    r = reproduce(run, "step5", 7)
    assert r.exact and r.start == 5 and r.steps == 7 and r.compared == list(range(6, 13))
    assert main(["reproduce", str(run), "--from", "step10", "--steps", "20"]) == 0
    out = capsys.readouterr().out
    assert "replayed steps 11..12" in out and "reproduced exactly" in out


def test_a_changed_setting_is_found_at_the_first_step_it_reaches(run, capsys):
    # Clipping changes the update of step 6, so step 6's loss and grad norm (computed before its
    # update) still agree and step 7's loss is the first value that differs.
    r = reproduce(run, "step5", 7, ["train.max_grad_norm=0.01"])
    assert not r.exact and r.divergence.step == 7 and r.divergence.key == "loss"
    assert r.divergence.abs_diff > 0 and r.compared == [6, 7]
    assert main(["reproduce", str(run), "--from", "step5", "--steps", "3",
                 "train.optimizer.lr=0.5"]) == 1
    out = capsys.readouterr().out
    assert "first divergence at step 6: lr logged" in out


def test_bad_input_is_one_line(run, tmp_path, capsys):
    assert main(["reproduce", str(tmp_path), "--from", "step5"]) == 2
    assert main(["reproduce", str(run), "--from", "step99"]) == 2
    assert main(["reproduce", str(run), "--from", "step5", "--steps", "0"]) == 2
    assert main(["reproduce", str(run), "--from", "latest"]) == 2  # nothing logged after it
    assert main(["reproduce", str(run / "pretrain"), "--from", "step5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 5 and all(e.startswith("olmoflow: error:") for e in err)
    assert "replay from an earlier checkpoint" in err[3]
    assert "is a stage directory; give its run directory" in err[4]
