"""A training checkpoint as a reader sees it: its files against the sha256s recorded when it was
saved, and its model weights.

``torch.distributed.checkpoint`` reads its ``.metadata`` with ``pickle``: ``checksums.json``,
written last before a checkpoint's directory is renamed into place, records the sha256 and size of
every other file, and every load checks the whole directory against it first. That detects
corruption and edits, not a malicious checkpoint whose author recomputed the hashes.

Training writes the checksums (:func:`write_checksums`) and verifies collectively under torchrun
(:func:`olmoflow.train.checkpoint_verify.verify_checkpoint`); every reader of a model loads its
weights through :func:`load_weights` (the one loader, :mod:`olmoflow.model.load`, calls it).
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from olmoflow.artifacts import atomic_write_text, sha256_file
from olmoflow.errors import OlmoflowError
from olmoflow.model.checkpoint_names import list_checkpoints

CHECKSUMS = "checksums.json"
CHECKSUMS_FORMAT = 1

log = logging.getLogger(__name__)

# One process without init_process_group is a supported dcp mode (every reader of a step
# checkpoint: export, diagnose, evaluation), not a problem to warn about.
warnings.filterwarnings("ignore",
                        message="torch.distributed is disabled, unavailable or uninitialized")


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


def checkpoint_error(path: Path) -> str | None:
    """The one-line error :func:`verify_checkpoint` raises for ``path``, or None when its files
    are those saved (or it predates checksums: one warning)."""
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


def verify_checkpoint(path: Path) -> None:
    """Check every file of checkpoint directory ``path`` against the sha256 its
    :data:`CHECKSUMS` recorded at save time, before anything of it is unpickled (``dcp`` reads
    ``.metadata`` with ``pickle``). A checkpoint saved before checksums were recorded loads, with
    one warning. This process checks alone (under torchrun, see
    :func:`olmoflow.train.checkpoint_verify.verify_checkpoint`).

    Raises:
        OlmoflowError: a file changed, is missing, was added or is a symbolic link; naming it.
    """
    error = checkpoint_error(Path(path))
    if error is not None:
        raise OlmoflowError(error)


def _dcp_load(path: Path, state: dict[str, Any], set_state, *, no_dist: bool = False) -> None:
    """``dcp.load`` into ``state`` then ``set_state(state)``; a damaged or mismatched checkpoint
    (missing shard or metadata, truncated file, other shapes or names) is one OlmoflowError.
    ``no_dist``: this process loads alone, even inside a process group (no collectives)."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state, checkpoint_id=str(Path(path) / "model_and_optim"), no_dist=no_dist)
        set_state(state)
    except (Exception, CheckpointException) as e:  # dcp's wrapper is a BaseException
        raise _unreadable(path, "model_and_optim", e) from None


def load_weights(path: Path, model: torch.nn.Module) -> None:
    """Restore only the model weights from checkpoint directory ``path`` into ``model`` (whose
    shapes must be the saved ones), after :func:`verify_checkpoint`.

    Raises:
        OlmoflowError: the checkpoint is damaged, was changed since it was saved (see
            :func:`verify_checkpoint`) or holds another model's weights.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )

    # Evaluation, generation and release run on rank 0 alone under torchrun while the other ranks
    # wait: a collective dcp.load would deadlock there, so this whole-model load never uses one.
    verify_checkpoint(path)
    _dcp_load(path, {"model": get_model_state_dict(model)},
              lambda st: set_model_state_dict(model, st["model"]), no_dist=True)
