"""The files of a checkpoint against the sha256s recorded when it was saved.

``torch.distributed.checkpoint`` reads its ``.metadata`` with ``pickle``: ``checksums.json``,
written last before a checkpoint's directory is renamed into place, records the sha256 and size of
every other file, and every load checks the whole directory against it first. That detects
corruption and edits, not a malicious checkpoint whose author recomputed the hashes.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from olmoflow.artifacts import atomic_write_text, sha256_file
from olmoflow.errors import OlmoflowError
from olmoflow.train import distributed
from olmoflow.train.checkpoint_names import list_checkpoints

CHECKSUMS = "checksums.json"
CHECKSUMS_FORMAT = 1

log = logging.getLogger(__name__)


def _other_checkpoint_hint(path: Path) -> str:
    """Where to resume instead of the unreadable checkpoint ``path``."""
    others = [c.name for c in list_checkpoints(path.parent) if c.name != path.name]
    return (f"resume from another one, e.g. resume_from={others[-1]}" if others
            else "no other checkpoint is left to resume from")


def _unreadable(path: Path, what: str, e: BaseException) -> OlmoflowError:
    """The one-line error for a checkpoint that exists but cannot be loaded, naming the others."""
    path = Path(path)
    # The first rank's own error, no traceback.
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    detail = " ".join(f"{type(e).__name__}: {e}".split())[:300]
    return OlmoflowError(f"checkpoint '{path}' cannot be read ({what}: {detail}); it is damaged or "
                         f"was saved for another model or train.optimizer; "
                         f"{_other_checkpoint_hint(path)}")


def _checkpoint_files(path: Path) -> tuple[list[str], list[str]]:
    """``(files, links)``: the relative POSIX paths of the regular files under checkpoint ``path``
    except :data:`CHECKSUMS`, and of its symbolic links (never followed), both sorted."""
    files, links = [], []
    for root, dirs, names in os.walk(path):
        rel_root = Path(root).relative_to(path)
        for name in names + [d for d in dirs if (Path(root) / d).is_symlink()]:
            rel = (rel_root / name).as_posix()
            full = Path(root) / name
            if full.is_symlink():
                links.append(rel)
            elif rel != CHECKSUMS and full.is_file():
                files.append(rel)
    return sorted(files), sorted(links)


def write_checksums(path: Path) -> None:
    """Record the sha256 and size of every file of checkpoint directory ``path`` in its
    :data:`CHECKSUMS` (JSON), which :func:`verify_checkpoint` checks before any load."""
    path = Path(path)
    files = {rel: {"sha256": sha256_file(path / rel), "bytes": (path / rel).stat().st_size}
             for rel in _checkpoint_files(path)[0]}
    atomic_write_text(path / CHECKSUMS, json.dumps(
        {"format": CHECKSUMS_FORMAT, "algorithm": "sha256", "files": files},
        indent=1, sort_keys=True) + "\n")


def _recorded_checksums(path: Path) -> dict[str, dict[str, Any]] | None:
    """The files :data:`CHECKSUMS` of ``path`` records, or None when it has none (saved by an
    older olmoflow).

    Raises:
        OlmoflowError: the file is not one :func:`write_checksums` wrote.
    """
    file = path / CHECKSUMS
    if not file.exists() and not file.is_symlink():
        return None
    try:
        if file.is_symlink() or not file.is_file():
            raise ValueError("not a regular file")
        data = json.loads(file.read_bytes())
        files = data.get("files") if isinstance(data, dict) else None
        if (not isinstance(files, dict) or data.get("algorithm") != "sha256"
                or not all(isinstance(v, dict) and isinstance(v.get("sha256"), str)
                           and isinstance(v.get("bytes"), int) for v in files.values())):
            raise ValueError("not a checksum list olmoflow wrote")
        return files
    except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise _changed(path, CHECKSUMS, " ".join(str(e).split())[:200]) from None


def _changed(path: Path, name: str, why: str) -> OlmoflowError:
    """The one-line error for a checkpoint whose files differ from those saved."""
    name = name if name.isprintable() else ascii(name)  # an added file's name may hold a newline
    return OlmoflowError(f"checkpoint '{path}' cannot be read ({name}: {why}); it was damaged or "
                         f"edited after it was saved; {_other_checkpoint_hint(path)}")


def _verify_files(path: Path) -> str | None:
    """The error line :func:`verify_checkpoint` raises for ``path``, or None when it loads."""
    try:
        recorded = _recorded_checksums(path)
        if recorded is None:
            log.warning("checkpoint '%s' has no %s (saved by an older olmoflow): its files are "
                        "loaded without checking them", path, CHECKSUMS)
            return None
        files, links = _checkpoint_files(path)
        if links:
            raise _changed(path, links[0], "a symbolic link, which a saved checkpoint never has")
        # Names are compared as sets: a recorded name is never opened, so '../x' reads nothing.
        missing = sorted(set(recorded) - set(files))
        if missing:
            raise _changed(path, missing[0], f"missing (one of {len(missing)} file(s) recorded "
                                             f"in {CHECKSUMS} but absent)")
        extra = sorted(set(files) - set(recorded))
        if extra:
            raise _changed(path, extra[0], f"not in {CHECKSUMS}: added after the save "
                                           f"({len(extra)} such file(s))")
        for rel in files:
            want = recorded[rel]
            try:
                size, digest = (path / rel).stat().st_size, None
                if size == want["bytes"]:
                    digest = sha256_file(path / rel)
            except OSError as e:  # unreadable (permissions) or gone meanwhile
                raise _changed(path, rel, f"unreadable: {e.strerror or e}") from None
            if size != want["bytes"]:
                raise _changed(path, rel, f"changed: {size} bytes, {want['bytes']} when saved")
            if digest != want["sha256"]:
                raise _changed(path, rel, "changed: its sha256 differs from the one recorded "
                                          "when saved")
    except OlmoflowError as e:
        return str(e)
    return None


def verify_checkpoint(path: Path, *, collective: bool = False) -> None:
    """Check every file of checkpoint directory ``path`` against the sha256 its
    :data:`CHECKSUMS` recorded at save time, before anything of it is unpickled (``dcp`` reads
    ``.metadata`` with ``pickle``). A checkpoint saved before checksums were recorded loads, with
    one warning. ``collective``: under torchrun rank 0 checks and every rank raises its verdict.

    Raises:
        OlmoflowError: a file changed, is missing, was added or is a symbolic link; naming it.
    """
    path = Path(path)
    if collective:
        error = distributed.broadcast_object(_verify_files(path) if distributed.is_main()
                                             else None)
    else:
        error = _verify_files(path)
    if error is not None:
        raise OlmoflowError(error)
