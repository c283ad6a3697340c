"""Artifacts on disk: atomic writes, hashing and ``manifest.json``.

Every stage writes into its own directory and finishes by writing ``manifest.json`` (atomically,
last). A directory whose manifest is present, whose fingerprint matches the current config and
inputs, and whose recorded outputs all still hash to what the manifest says, is complete: a rerun
skips it. Anything else is redone from scratch, so a half-written stage is never trusted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

MANIFEST = "manifest.json"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()  # read once: os.umask can only be read by setting it


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it onto ``path``.

    For writers that take a file name (safetensors, numpy memmaps). On an exception the temporary
    file is removed and ``path`` is left as it was, so a reader never sees a half-written file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        # mkstemp makes the file 0600; give the final file the mode a plain open() would have.
        if os.path.exists(tmp):
            os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", **kwargs: Any) -> Iterator[IO]:
    """Open a temporary file beside ``path``; on success fsync it and rename it onto ``path``.

    On an exception the temporary file is removed and ``path`` is left as it was. ``mode`` must be
    a write mode ("w", "wb", "wt").
    """
    with atomic_path(path) as tmp, open(tmp, mode, **kwargs) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    """Hex sha256 of a JSON-serializable object, with sorted keys (a stable fingerprint)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def now() -> str:
    """The current UTC time in ISO 8601."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def git_commit() -> str | None:
    """The git commit of the olmoflow source tree, or None outside a checkout."""
    src = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def environment() -> dict[str, str]:
    """Versions of Python, the platform and the libraries that shape results."""
    env = {"python": sys.version.split()[0], "platform": platform.platform()}
    for mod in ("torch", "numpy", "tokenizers", "safetensors", "transformers"):
        m = sys.modules.get(mod)
        if m is None:
            with contextlib.suppress(ImportError):
                m = __import__(mod)
        if m is not None:
            env[mod] = getattr(m, "__version__", "unknown")
    return env


def file_record(path: Path, root: Path) -> dict[str, Any]:
    """``{"path", "bytes", "sha256"}`` of a file: its path relative to ``root`` when inside it,
    else absolute (a path relative to the working directory of the run could not be followed
    back from the manifest later)."""
    path = Path(path)
    try:
        rel = str(path.resolve().relative_to(Path(root).resolve()))
    except ValueError:
        rel = os.path.abspath(path)
    return {"path": rel, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def write_manifest(
    out_dir: Path,
    *,
    stage: str,
    command: str,
    config: dict[str, Any],
    fingerprint: str,
    inputs: list[Path],
    outputs: list[Path],
    counts: dict[str, Any],
    started: str,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``out_dir/manifest.json`` atomically and return it.

    ``inputs`` and ``outputs`` are hashed (sha256); outputs must lie inside ``out_dir``. Written
    last, the manifest is what marks the stage complete.
    """
    out_dir = Path(out_dir)
    manifest = {
        "stage": stage,
        "command": command,
        "fingerprint": fingerprint,
        "config": config,
        "inputs": [file_record(p, out_dir.parent) for p in inputs],
        "outputs": [file_record(p, out_dir) for p in outputs],
        "counts": counts,
        "environment": environment(),
        "git_commit": git_commit(),
        "started": started,
        "finished": now(),
    }
    if extra:
        manifest.update(extra)
    atomic_write_json(out_dir / MANIFEST, manifest)
    return manifest


def data_files(path: str | os.PathLike) -> list[Path]:
    """The data files at ``path``: the file itself, or a directory's files (recursively, sorted)
    without its ``manifest.json`` (rewritten on every run) and hidden temporaries (``.x.tmp``,
    ``.fingerprint``), which are bookkeeping, not data."""
    path = Path(path)
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and p.name != MANIFEST
                  and not p.name.startswith("."))


def read_manifest(out_dir: Path) -> dict[str, Any] | None:
    """The manifest of ``out_dir``, or None when absent or unreadable (an incomplete stage)."""
    try:
        return json.loads((Path(out_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def is_complete(out_dir: Path, fingerprint: str) -> bool:
    """True when ``out_dir`` holds a finished stage made from the same config and inputs.

    Checks the manifest's fingerprint and that every recorded output exists with its recorded size
    and sha256, so a truncated or edited output makes the stage run again.
    """
    manifest = read_manifest(out_dir)
    if manifest is None or manifest.get("fingerprint") != fingerprint:
        return False
    for rec in manifest.get("outputs", []):
        p = Path(out_dir) / rec["path"]
        if not p.is_file() or p.stat().st_size != rec["bytes"] or sha256_file(p) != rec["sha256"]:
            return False
    return True


@dataclasses.dataclass
class StageResult:
    """What a stage function returns: the files it read and wrote (hashed into the manifest) and
    its counts (documents, tokens, rows removed per rule, ...)."""

    inputs: list[Path]
    outputs: list[Path]
    counts: dict[str, Any]
