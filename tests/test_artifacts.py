"""Atomic writes: a failed write leaves the old file (a full disk and a file size limit included);
a finished one has ordinary permissions. Manifests name their files so that they can be followed
back."""

import errno
import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from olmoflow import disk
from olmoflow.artifacts import atomic_open, atomic_write_json, atomic_write_text
from olmoflow.errors import OlmoflowError

ROOT = Path(__file__).resolve().parents[1]
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


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


def test_manifest_paths_are_relative_inside_the_parent_and_absolute_outside(tmp_path,
                                                                            monkeypatch):
    import json

    from olmoflow.artifacts import write_manifest

    (tmp_path / "run" / "up").mkdir(parents=True)
    (tmp_path / "run" / "up" / "a.txt").write_text("a")
    (tmp_path / "outside.txt").write_text("b")
    out = tmp_path / "run" / "step"
    out.mkdir()
    (out / "c.txt").write_text("c")
    monkeypatch.chdir(tmp_path / "run")  # inputs given relative to the working directory
    write_manifest(out, stage="s", command="", config={}, fingerprint="f",
                   inputs=[Path("up/a.txt"), Path("../outside.txt")], outputs=[out / "c.txt"],
                   counts={}, started="")
    m = json.loads((out / "manifest.json").read_text())
    assert [r["path"] for r in m["inputs"]] == ["up/a.txt", str(tmp_path / "outside.txt")]
    assert m["outputs"][0]["path"] == "c.txt"


def test_a_stage_is_incomplete_once_an_input_or_output_changes(tmp_path):
    """A finished stage is skipped only while its outputs and its still-existing inputs are the
    files its manifest recorded: editing a token array in place reruns the stage that read it."""
    from olmoflow.artifacts import is_complete, write_manifest

    run = tmp_path / "run"
    (run / "up").mkdir(parents=True)
    (run / "stage").mkdir()
    inside, outside = run / "up" / "tokens.npy", tmp_path / "external.npy"
    inside.write_bytes(b"\1\2\3\4")
    outside.write_bytes(b"\5\6")
    out = run / "stage" / "model.bin"
    out.write_bytes(b"weights")
    write_manifest(run / "stage", stage="s", command="c", config={}, fingerprint="fp",
                   inputs=[inside, outside], outputs=[out], counts={}, started="t")
    assert is_complete(run / "stage", "fp") and not is_complete(run / "stage", "other")
    for path, edited in ((inside, b"\1\2\3\5"), (outside, b"\5\7"), (out, b"weightz")):
        original = path.read_bytes()
        path.write_bytes(edited)  # same size, other content
        assert not is_complete(run / "stage", "fp"), path
        path.write_bytes(original)
        assert is_complete(run / "stage", "fp")
    outside.unlink()  # a deleted input: nothing contradicts the output made from it
    assert is_complete(run / "stage", "fp")
    out.unlink()
    assert not is_complete(run / "stage", "fp")


def test_hash_once_reads_a_file_once_per_identity(tmp_path):
    """Inside hash_once a file is hashed once while its path, inode, size and mtime stay the same
    (a rerun checks a checkpoint as pretrain's output and again as each later stage's input); a
    file replaced by rename, as the project writes, is hashed again."""
    import hashlib

    from olmoflow.artifacts import hash_once, sha256_file

    f = tmp_path / "weights.bin"
    f.write_bytes(b"first")
    first = hashlib.sha256(b"first").hexdigest()

    def edit_in_place_keeping_identity():
        st = f.stat()
        with open(f, "r+b") as h:
            h.write(b"FIRST")
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))

    with hash_once():
        assert sha256_file(f) == first
        edit_in_place_keeping_identity()
        assert sha256_file(f) == first  # remembered, not read again
        with hash_once():  # nested: the same memory
            assert sha256_file(f) == first
        tmp = tmp_path / "weights.tmp"
        tmp.write_bytes(b"third")
        os.replace(tmp, f)  # a new inode
        assert sha256_file(f) == hashlib.sha256(b"third").hexdigest()
    f.write_bytes(b"first")
    edit_in_place_keeping_identity()
    assert sha256_file(f) == hashlib.sha256(b"FIRST").hexdigest()  # outside: always read


# --- at a full disk or a file size limit -----------------------------------------------------


@pytest.fixture
def three_mb_free(monkeypatch):
    monkeypatch.setattr(disk, "free_mb", lambda path: 3)


def test_a_full_disk_at_an_atomic_write_keeps_the_old_file(monkeypatch, three_mb_free, tmp_path):
    target = tmp_path / "manifest.json"
    atomic_write_json(target, {"old": True})

    def full(fd):
        raise ENOSPC

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OlmoflowError) as e:
        atomic_write_json(target, {"new": True})
    assert str(e.value) == f"{target}: no space left on device (3 MB free)"
    assert json.loads(target.read_text()) == {"old": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]  # temporary gone


def in_child_under_a_file_size_limit(body: str, tmp_path: Path) -> None:
    """Run ``body`` in a child Python whose ``lower(n)`` lowers its own file size limit (writes
    past it fail with EFBIG). Never in the test process: the limit would also cut off every other
    file it writes, pytest's own log among them."""
    pytest.importorskip("resource")
    prelude = textwrap.dedent("""
        import resource, signal, sys
        from pathlib import Path
        import pytest
        from olmoflow.artifacts import atomic_open, atomic_write_text
        from olmoflow.errors import OlmoflowError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        def lower(n):
            resource.setrlimit(resource.RLIMIT_FSIZE, (n, resource.getrlimit(
                resource.RLIMIT_FSIZE)[1]))
        tmp_path = Path(sys.argv[1])
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(body) + "\nprint('OK')\n",
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr


def test_of_two_open_files_the_one_that_failed_is_named(tmp_path):
    """Token arrays and their indexes are written side by side: the error names the array whose
    write really failed, not the file opened last; both temporaries are removed."""
    in_child_under_a_file_size_limit("""
        with pytest.raises(OlmoflowError) as e:
            with atomic_open(tmp_path / "big.npy") as big, \\
                    atomic_open(tmp_path / "small.csv") as small:
                small.write(b"0,1\\n")
                lower(10_000)
                big.write(b"x" * 20_000)
                big.flush()
        assert str(e.value).startswith(f"{tmp_path / 'big.npy'}: file too large ("), e.value
        assert list(tmp_path.iterdir()) == []
    """, tmp_path)


def test_a_real_short_write_leaves_the_previous_file(tmp_path):
    in_child_under_a_file_size_limit("""
        target = tmp_path / "notes.txt"
        atomic_write_text(target, "before\\n")
        lower(1000)
        with pytest.raises(OlmoflowError, match="file too large"):
            atomic_write_text(target, "y" * 5000)
        assert target.read_text() == "before\\n"
        assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    """, tmp_path)

