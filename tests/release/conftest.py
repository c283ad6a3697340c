"""A tiny run with its release, made once for the release tests (verify, git, push), which work on
copies of it."""

from __future__ import annotations

import io
import shutil
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from olmoflow.cli import main


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """A run of the tiny preset on the standard library's text: 4 steps, two kept checkpoints
    exported into its release. Read only: copy it (:func:`copy_run`) to change anything."""
    run = tmp_path_factory.mktemp("release-run") / "run"
    threads = torch.get_num_threads()
    buf = io.StringIO()
    try:
        with redirect_stdout(buf):
            rc = main(["run", "tiny", "train.max_steps=4", "train.checkpoint.save_interval=2",
                       "train.num_threads=1", "evaluate.max_tokens=512",
                       "--run-dir", str(run), "--no-progress"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0, buf.getvalue()
    return run


@pytest.fixture
def copy_run(tiny_run, tmp_path) -> Path:
    """A copy of :func:`tiny_run` (its release still inside its run directory)."""
    copy = tmp_path / "run"
    shutil.copytree(tiny_run, copy, symlinks=True)
    return copy
