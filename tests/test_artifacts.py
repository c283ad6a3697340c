"""Atomic writes: a failed write leaves the old file; a finished one has ordinary permissions."""

import os
import stat

import pytest

from olmoflow.artifacts import atomic_open, atomic_write_text


def test_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "out.txt"
    atomic_write_text(path, "old")
    with pytest.raises(RuntimeError), atomic_open(path, "w") as f:
        f.write("half")
        raise RuntimeError("crash mid-write")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]  # no temporary file left behind


def test_written_file_has_the_mode_open_would_give(tmp_path):
    # mkstemp makes 0600 files; artifacts are shared (release bundles, data shards), so they must
    # get the umask-derived mode that a plain open() gives.
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    atomic = tmp_path / "atomic.txt"
    atomic_write_text(atomic, "x")
    assert stat.S_IMODE(os.stat(atomic).st_mode) == stat.S_IMODE(os.stat(plain).st_mode)
