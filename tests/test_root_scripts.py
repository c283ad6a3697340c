"""The commands OLMo's documentation gives, run from the root of a checkout as written there:
``python -m scripts.train CONFIG resume_from=latest`` and ``python -m scripts.diagnose_weights``
(thin entry points in the repository's ``scripts/`` over ``olmoflow.scripts.*``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from olmoflow.pipeline.config import load_config
from olmoflow.pipeline.runner import run_pipeline
from olmoflow.train.checkpoint import parse_checkpoint_name, resolve_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["train.log.interval=1", "train.checkpoint.save_interval=0", "train.num_threads=1",
         "train.sequence_length=32", "train.global_batch_size=4", "train.micro_batch_size=4"]


def from_root(*args: str) -> subprocess.CompletedProcess:
    """``python -m ARGS`` with the repository root as the working directory and no PYTHONPATH:
    what a user typing OLMo's command in a checkout gets."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def prepared_run(tmp_path_factory) -> Path:
    """A tiny run directory whose data stages are done (pretraining's inputs)."""
    run = tmp_path_factory.mktemp("root_scripts") / "run"
    cfg = load_config("tiny", TRAIN, {"run_dir": str(run)})
    run_pipeline(cfg, stages=["collect", "clean", "train-tokenizer", "tokenize"], progress=False)
    return run


def test_the_checkout_runs_its_own_sources():
    r = subprocess.run([sys.executable, "-c", "import scripts, olmoflow; print(olmoflow.__file__)"],
                       cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == ROOT / "src" / "olmoflow" / "__init__.py"


def test_scripts_train_trains_and_resumes_from_latest(prepared_run):
    run = prepared_run
    r = from_root("scripts.train", "tiny", "--run-dir", str(run), "--no-progress",
                  "train.max_steps=2", *TRAIN)
    assert r.returncode == 0, r.stderr
    assert parse_checkpoint_name(resolve_checkpoint(run / "pretrain", "latest").name) == 2
    r = from_root("scripts.train", "tiny", "--run-dir", str(run), "--no-progress",
                  "train.max_steps=3", *TRAIN, "resume_from=latest")
    assert r.returncode == 0, r.stderr
    assert "[pretrain] resumed" in r.stdout
    assert parse_checkpoint_name(resolve_checkpoint(run / "pretrain", "latest").name) == 3

    r = from_root("scripts.diagnose_weights", str(run / "pretrain"), "--all")
    assert r.returncode in (0, 1), r.stderr  # 1 only when a tensor is flagged
    assert "embeddings.weight" in r.stdout and "Traceback" not in r.stderr


def test_scripts_help_and_bad_input():
    r = from_root("scripts.train", "--help")
    assert r.returncode == 0 and "resume_from=latest" in r.stdout
    r = from_root("scripts.diagnose_weights", "--help")
    assert r.returncode == 0 and "usage: python -m scripts.diagnose_weights" in r.stdout
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)  # torchrun's form: a file
    assert r.returncode == 0 and "resume_from=latest" in r.stdout, r.stderr
    r = from_root("scripts.diagnose_weights", str(ROOT / "no-such-checkpoint"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "does not exist" in r.stderr
