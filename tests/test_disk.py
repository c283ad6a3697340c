"""A full disk (or a quota, or ``ulimit -f``) while olmoflow writes (``olmoflow.disk``): one line
naming the file being written and the room left, exit 2, the half-written file removed and nothing
half-written trusted. Atomic writes at a full disk are tested in test_artifacts.py.

The disk is never really filled: the unit tests make the writers fail as they do on a full disk
(``OSError(ENOSPC)``, torch's ``unexpected pos``), and the CLI tests run the real command in a child
process under ``RLIMIT_FSIZE``, where every write past the limit genuinely fails (``EFBIG``, with
``SIGXFSZ`` ignored) through the same code paths a full disk takes.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checks import tree
from test_cli import assert_one_line_error

from olmoflow import disk
from olmoflow.artifacts import atomic_write_text
from olmoflow.errors import OlmoflowError
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo
from olmoflow.train import checkpoint
from olmoflow.train.checkpoint import LATEST, save_checkpoint

resource = pytest.importorskip("resource")
ROOT = Path(__file__).resolve().parents[1]
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def three_mb_free(monkeypatch):
    monkeypatch.setattr(disk, "free_mb", lambda path: 3)


# --- recognising a write that failed for lack of room ----------------------------------------


class FakeCheckpointException(BaseException):
    """torch.distributed.checkpoint's CheckpointException: rank -> (exception, traceback)."""

    def __init__(self, failures):
        super().__init__("write")
        self.failures = failures


def torch_short_write() -> RuntimeError:
    return RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")


@pytest.mark.parametrize("exc", [
    ENOSPC,
    OSError(getattr(errno, "EDQUOT", errno.ENOSPC), "Disk quota exceeded"),
    RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),
    FakeCheckpointException({0: (torch_short_write(), [])}),
    torch_short_write(),  # no reason given, and 3 MB left: a full disk
], ids=["enospc", "edquot", "safetensors", "dcp", "torch-short-write"])
def test_no_space_is_one_line_naming_the_file(exc, three_mb_free, tmp_path):
    err = disk.write_failure(tmp_path / "x.bin", exc)
    assert str(err) == f"{tmp_path / 'x.bin'}: no space left on device (3 MB free)"


def test_a_chained_oserror_is_found(three_mb_free, tmp_path):
    try:
        try:
            raise ENOSPC
        except OSError:
            raise torch_short_write() from None
    except RuntimeError as e:
        e.__context__ = ENOSPC  # what torch.save into a Python file leaves
        assert "no space left on device" in str(disk.write_failure(tmp_path / "f", e))


def test_efbig_names_the_file_size_limit(tmp_path):
    err = disk.write_failure(tmp_path / "f", OSError(errno.EFBIG, "File too large"))
    assert str(err).startswith(f"{tmp_path / 'f'}: file too large (")


@pytest.mark.parametrize("exc", [ValueError("bad"), OSError(errno.EACCES, "Permission denied"),
                                 KeyboardInterrupt(), OlmoflowError("already one line")])
def test_other_failures_are_not_rewrapped(exc, tmp_path):
    assert disk.write_failure(tmp_path / "f", exc) is None


def test_a_short_torch_write_with_room_left_still_says_what_failed(monkeypatch, tmp_path):
    monkeypatch.setattr(disk, "free_mb", lambda path: 50_000)
    monkeypatch.setattr(disk, "_file_size_limit", lambda: None)
    err = str(disk.write_failure(tmp_path / "f", torch_short_write()))
    assert err.startswith(f"{tmp_path / 'f'}: the write failed (") and "50000 MB free" in err


def test_free_mb_reads_the_nearest_existing_parent(tmp_path):
    assert isinstance(disk.free_mb(tmp_path / "not" / "yet" / "made"), int)


# --- checkpoint save -------------------------------------------------------------------------


def tiny_save(folder: Path, step: int) -> Path:
    torch.manual_seed(0)
    model = Olmo(ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, mlp_hidden=32,
                             max_sequence_length=16, sliding_window=None))
    opt = torch.optim.AdamW(model.parameters())
    return save_checkpoint(folder, step, model, opt, {"step": step, "tokens_seen": 8 * step},
                           "x: 1\n")


@pytest.mark.parametrize("where", ["dcp", "trainer_state", "checksums"])
def test_a_full_disk_at_checkpoint_save_keeps_the_previous_checkpoint(where, monkeypatch,
                                                                      three_mb_free, tmp_path):
    first = tiny_save(tmp_path, 2)
    before = tree(tmp_path)
    if where == "dcp":
        def save(state, checkpoint_id):  # a shard half written, then torch's short write
            Path(checkpoint_id).mkdir(parents=True)
            (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half")
            raise FakeCheckpointException({0: (torch_short_write(), [])})

        monkeypatch.setattr(checkpoint.dcp, "save", save)
        named = "model_and_optim"
    elif where == "trainer_state":
        real = Path.write_bytes

        def write_bytes(self, data):
            if self.name == checkpoint.TRAINER_STATE:
                real(self, data[: len(data) // 2])
                raise ENOSPC
            return real(self, data)

        monkeypatch.setattr(Path, "write_bytes", write_bytes)
        named = checkpoint.TRAINER_STATE
    else:
        def fsync(fd):
            raise ENOSPC

        monkeypatch.setattr(checkpoint, "write_checksums",
                            lambda p: (monkeypatch.setattr(os, "fsync", fsync),
                                       atomic_write_text(Path(p) / "checksums.json", "{}")))
        named = "checksums.json"
    with pytest.raises(OlmoflowError) as e:
        tiny_save(tmp_path, 4)
    final = tmp_path / "stage1-step4-tokens32"
    assert str(e.value) == f"{final / named}: no space left on device (3 MB free)"
    monkeypatch.undo()
    assert tree(tmp_path) == before  # no half-written checkpoint; latest still on the first
    assert (tmp_path / LATEST).read_text().strip() == first.name


# --- the real command under a file size limit -------------------------------------------------


def olmoflow_limited(limit: int | None, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m olmoflow ARGV`` in a child whose files may grow to ``limit`` bytes."""
    def pre() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # inherited across exec: EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(
            resource.RLIMIT_FSIZE)[1]))

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "olmoflow", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240,
                          preexec_fn=pre if limit else None)


def test_the_cli_at_a_checkpoint_it_cannot_write(tmp_path):
    """``olmoflow run tiny`` whose checkpoint shard (2 MB) is over the limit while everything
    before it (1 MB of tokens at most) is not: one line naming the shard, exit 2; the stages
    before it stay complete and the stage rerun with room trains from step 0."""
    run = tmp_path / "run"
    args = ["run", "tiny", "--run-dir", str(run), "--no-progress", "train.max_steps=2",
            "train.checkpoint.save_interval=2", "train.schedule.warmup_steps=1"]
    r = olmoflow_limited(1_500_000, *args, cwd=tmp_path)
    line = assert_one_line_error(r.returncode, r.stderr, "model_and_optim: file too large")
    assert str(run / "pretrain") in line
    assert not (run / "pretrain").exists()  # no half-made stage, no temporary checkpoint
    tokens = tree(run / "tokens")
    r = olmoflow_limited(None, "pretrain", *args[1:], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "[pretrain] ran" in r.stdout and "steps=2," in r.stdout, r.stdout
    assert tree(run / "tokens") == tokens
