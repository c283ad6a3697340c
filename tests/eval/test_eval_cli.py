"""The evaluation front end from the command line: ``olmoflow eval list | info | run`` and
``olmoflow evaluate RUN --checkpoints ... --tasks ...``, on one tiny run made by ``olmoflow run``
with in-loop evaluation on. Errors are one line and exit status 2."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from test_cli import assert_one_line_error, cli

from olmoflow.cli import main
from olmoflow.errors import OlmoflowError
from olmoflow.eval.registry import register_task
from olmoflow.eval.requests import LoglikelihoodRequest
from olmoflow.eval.task import Task

OVERRIDES = ["collect.max_documents=30", "tokenizer.vocab_size=300", "train.max_steps=6",
             "train.checkpoint.save_interval=2", "train.num_threads=1", "evaluate.max_tokens=512"]


@register_task
class CliMC(Task):
    name = "h4_cli_mc"
    description = "does code continue like code"
    source = "three snippets written in the test"
    primary_metric = "acc_raw"
    chance = 0.5
    DOCS = [("import os\nimport", " sys", " )))"), ("def main():\n    return", " 0", " ]["),
            ("for x in", " range(3):", " ,,,")]

    def load(self):
        return self.DOCS[:self.settings.limit]

    def requests(self, doc):
        return [LoglikelihoodRequest(doc[0], doc[1]), LoglikelihoodRequest(doc[0], doc[2])]

    def score(self, doc, results):
        return {"acc_raw": float(results[0].logprob >= results[1].logprob),
                "margin": results[0].logprob - results[1].logprob}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli") / "run"
    threads = torch.get_num_threads()
    try:
        rc = main(["run", "tiny", *OVERRIDES, "evaluate.tasks=[h4_cli_mc]",
                   "evaluate.in_loop.interval=3", "evaluate.in_loop.tasks=[h4_cli_mc]",
                   "evaluate.in_loop.limit=2", "--run-dir", str(root), "--no-progress"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    return root


def rows(path):
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def test_the_run_logs_in_loop_evals_and_releases_its_task_scores(run):
    logged = {r["step"]: r for r in rows(run / "pretrain" / "metrics.jsonl")}
    with_eval = sorted(s for s, r in logged.items() if "eval/h4_cli_mc/acc_raw" in r)
    assert with_eval == [3, 6] and "eval/heldout/bpb" in logged[3]
    assert "eval/h4_cli_mc/margin" in logged[6]
    (final,) = rows(run / "eval" / "results.jsonl")  # evaluate.checkpoints: latest
    assert final["step"] == 6 and final["n"] == 3
    assert (run / "release" / "eval" / "heatmap.png").is_file()
    assert "| h4_cli_mc | acc_raw |" in (run / "release" / "README.md").read_text()


def test_evaluate_a_run_directory_across_checkpoints(run, capsys):
    rc, out, err = cli(capsys, "evaluate", str(run), "--checkpoints", "all", "--tasks",
                       "h4_cli_mc", "--no-progress")
    assert rc == 0, err
    assert "[evaluate] ran" in out and "checkpoints=3" in out and "scored=2" in out
    got = rows(run / "eval" / "results.jsonl")
    assert [r["step"] for r in got] == [2, 4, 6]
    rc, out, _ = cli(capsys, "evaluate", str(run), "--checkpoints", "all", "--tasks",
                     "h4_cli_mc", "--no-progress")
    assert rc == 0 and "[evaluate] skipped" in out


def test_evaluate_errors_are_one_line(run, capsys, tmp_path):
    rc, _, err = cli(capsys, "evaluate", str(run), "--checkpoints", "99", "--tasks",
                     "h4_cli_mc", "--no-progress")
    assert_one_line_error(rc, err, "no checkpoint '99'", "stage1-step2")
    rc, _, err = cli(capsys, "evaluate", str(run), "--tasks", "h4_cli_mx", "--no-progress")
    assert_one_line_error(rc, err, "evaluate.tasks: unknown task 'h4_cli_mx'", "h4_cli_mc")
    rc, _, err = cli(capsys, "evaluate", str(tmp_path), "--no-progress")
    assert_one_line_error(rc, err, "not a run directory")


def test_eval_list_and_info(run, capsys):
    rc, out, _ = cli(capsys, "eval", "list")
    assert rc == 0
    (line,) = [ln for ln in out.splitlines() if ln.startswith("h4_cli_mc ")]
    assert line.split()[1:4] == ["multiple_choice", "acc_raw", "0.5"]
    assert "three snippets written in the test" in line
    rc, out, _ = cli(capsys, "eval", "info", "h4_cli_mc")
    assert rc == 0
    assert "h4_cli_mc: does code continue like code" in out and "chance 0.5" in out
    assert "--- context:\nimport os\nimport" in out and "other continuations: ' )))'" in out
    rc, _, err = cli(capsys, "eval", "info", "h4_cli_mx")
    assert_one_line_error(rc, err, "unknown task 'h4_cli_mx'; did you mean 'h4_cli_mc'")


def test_eval_run_scores_a_release_as_the_stage_scored_its_checkpoint(run, capsys, tmp_path):
    out_file = tmp_path / "scores.json"
    rc, out, err = cli(capsys, "eval", "run", "--model", str(run / "release"), "--tasks",
                       "h4_cli_mc", "--out", str(out_file), "--batch-size", "2")
    assert rc == 0, err
    assert out.splitlines()[0].split() == ["task", "metric", "value", "stderr", "n"]
    data = json.loads(out_file.read_text())
    assert data["max_length"] == 64  # the training length the release's config.yaml records
    (res,) = data["results"]
    (staged,) = [r for r in rows(run / "eval" / "results.jsonl") if r["step"] == 6]
    assert res["task"] == "h4_cli_mc" and res["n"] == 3
    assert res["primary"] == staged["value"]
    assert res["metrics"]["margin"] == pytest.approx(staged["metrics"]["margin"], rel=1e-5,
                                                     abs=1e-4)
    # a folder of checkpoints means its latest
    rc, out, err = cli(capsys, "eval", "run", "--model", str(run / "pretrain"), "--tasks",
                       "h4_cli_mc:limit=2")
    assert rc == 0, err
    assert "h4_cli_mc" in out


def test_eval_run_errors_are_one_line(run, capsys, tmp_path):
    rc, _, err = cli(capsys, "eval", "run", "--model", str(tmp_path / "nope"), "--tasks",
                     "h4_cli_mc")
    assert_one_line_error(rc, err, "does not exist")
    rc, _, err = cli(capsys, "eval", "run", "--model", str(run / "release"), "--tasks",
                     "h4_cli_mc:lmit=2")
    assert_one_line_error(rc, err, "unknown option 'lmit'; did you mean 'limit'")
    rc, _, err = cli(capsys, "eval", "run", "--model", str(run / "release"), "--tasks",
                     "h4_cli_mc", "--limit", "0")
    assert_one_line_error(rc, err, "--limit=0 must be >= 1")


@pytest.mark.parametrize("tasks", [",", "", " , "])
def test_an_empty_task_list_is_an_error_naming_the_option(capsys, tmp_path, tasks):
    # checked before the model loads: the model directory is not even read
    rc, out, err = cli(capsys, "eval", "run", "--model", str(tmp_path), "--tasks", tasks)
    assert_one_line_error(rc, err, "--tasks", "names no task")
    assert out == ""
    rc, _, err = cli(capsys, "evaluate", "tiny", "--run-dir", str(tmp_path / "run"),
                     "--tasks", tasks, "--no-progress")
    assert_one_line_error(rc, err, "evaluate.tasks=", "names no task")
    assert not (tmp_path / "run").exists()
    rc, _, err = cli(capsys, "evaluate", "tiny", "--run-dir", str(tmp_path / "run"),
                     f"evaluate.in_loop.tasks={tasks}", "--no-progress")
    assert_one_line_error(rc, err, "evaluate.in_loop.tasks=", "names no task")


def test_out_that_is_a_folder_fails_before_scoring(tmp_path):
    from olmoflow.eval.cli import eval_run

    args = argparse.Namespace(model=str(tmp_path / "no-model"), tasks=["hostile_toy"],
                              limit=None, data_dir=None, strict=False, allow_network=False,
                              batch_size=1, max_length=None, tokenizer=None, out=str(tmp_path))
    with pytest.raises(OlmoflowError, match="--out .* is a directory"):
        eval_run(args)


def test_a_data_dir_that_is_not_a_folder_is_an_error(capsys, tmp_path):
    """A mistyped --data-dir is named, not passed over for the data the package installs."""
    missing = tmp_path / "no-such-dir"
    rc, out, err = cli(capsys, "eval", "run", "--model", str(tmp_path), "--tasks", "copa",
                       "--data-dir", str(missing))
    assert_one_line_error(rc, err, "--data-dir", str(missing), "no such directory")
    assert out == ""
    rc, out, err = cli(capsys, "eval", "info", "copa", "--data-dir", str(missing))
    assert_one_line_error(rc, err, "--data-dir", str(missing), "no such directory")
