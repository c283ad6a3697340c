"""Training checkpoints named like OLMo's, an index of them, and a pruning policy.

A checkpoint is a directory ``save_folder/{stage}-step{N}-tokens{T}`` (``stage1-step1000-tokens5M``;
see :mod:`olmoflow.model.checkpoint_names`) holding model and optimizer state through
``torch.distributed.checkpoint`` (so a run saved on N processes loads on M) in ``model_and_optim/``,
the trainer state (step, tokens seen, data-loader cursor, every RNG state, scheduler and optimizer
extras) in ``trainer_state.pt``, and the resolved run config in ``config.yaml``. Directories of the
older ``stepN`` form are still read.

The trainer state holds plain data only (tensors, numbers, strings, lists and dicts; the RNG states
as tensors) and is read with ``torch.load(weights_only=True)``, so a crafted ``trainer_state.pt``
cannot run code. ``torch.distributed.checkpoint`` reads its ``.metadata`` with ``pickle``, though:
``checksums.json``, written last before the rename, records the sha256 of every other file, and
every load checks the whole directory against it first (:mod:`olmoflow.model.checkpoint_files`).
That detects corruption and edits, not a malicious checkpoint whose author recomputed the hashes:
a checkpoint directory is trusted input (a release directory, safetensors + JSON, is safe from
anyone).

A checkpoint is written under a temporary name and renamed when complete; then older checkpoints
are pruned (``keep_every``/``keep_last``), ``checkpoints.csv`` (every checkpoint ever saved, kept or
pruned) is rewritten atomically, and ``latest`` (a text file naming the newest checkpoint) is
written last. A crash mid-save therefore never leaves a checkpoint that a resume would trust; what
it does leave (hidden temporaries) the next run's start or save removes
(:func:`remove_stale_leftovers`).
"""

from __future__ import annotations

import csv
import io
import logging
import pickle
import random
import re
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from olmoflow.artifacts import atomic_write_text, remove_stale_temporaries
from olmoflow.disk import writing
from olmoflow.errors import OlmoflowError
from olmoflow.model.checkpoint_files import (
    _dcp_load,
    _other_checkpoint_hint,
    _unreadable,
    write_checksums,
)
from olmoflow.model.checkpoint_names import (  # re-exported: the names a checkpoint user needs
    _NAME,
    TRAINER_STATE,
    checkpoint_name,
    list_checkpoints,
    parse_checkpoint_name,
)
from olmoflow.train import distributed
from olmoflow.train.checkpoint_verify import verify_checkpoint

LATEST = "latest"
INDEX = "checkpoints.csv"
INDEX_FIELDS = ("step", "tokens", "name", "loss", "saved_at", "status")

log = logging.getLogger(__name__)

# What trainer states saved before the RNG states became tensors pickled besides plain data:
# NumPy's state as a uint32 array. Rebuilding an array of a dtype runs no user-chosen code.
_NUMPY_ARRAY_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype,
                        type(np.dtype(np.uint32))]


def rng_state() -> dict[str, Any]:
    """Every RNG state a training step can touch (Python, NumPy, torch CPU and CUDA), as plain
    data that ``torch.load(weights_only=True)`` reads: Python's Mersenne Twister words and NumPy's
    key as int64 tensors beside their scalar fields."""
    version, words, gauss_next = random.getstate()
    name, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state = {"python": {"version": int(version),
                        "state": torch.tensor(words, dtype=torch.int64),
                        "gauss_next": gauss_next},
             "numpy": {"bit_generator": str(name),
                       "key": torch.from_numpy(key.astype(np.int64)),
                       "pos": int(pos), "has_gauss": int(has_gauss),
                       "cached_gaussian": float(cached_gaussian)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def seed_all(seed: int) -> None:
    """Seed every RNG a training step can touch (Python, NumPy, torch CPU and every CUDA device)
    from ``seed``: what a stage does first, so that two runs of one config draw the same dropout
    masks whatever the process did before (a resume then restores :func:`rng_state` from the
    checkpoint instead)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # every device's generator, CUDA included
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured (or, from checkpoints saved before it stored plain
    data, the tuples of ``random.getstate`` and ``np.random.get_state``)."""
    py = state["python"]
    if isinstance(py, dict):
        py = (py["version"], tuple(int(w) for w in py["state"].tolist()), py["gauss_next"])
    random.setstate(py)
    npy = state["numpy"]
    if isinstance(npy, dict):
        npy = (npy["bit_generator"], npy["key"].numpy().astype(np.uint32), npy["pos"],
               npy["has_gauss"], npy["cached_gaussian"])
    np.random.set_state(npy)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind ``optimizer`` (a composite such as Muon + AdamW lists
    several)."""
    return list(getattr(optimizer, "optimizers", [optimizer]))


# The optimizer state flattened to one entry per parameter name (``optim.state.<fqn>.exp_avg``,
# ``optim.param_groups.<fqn>.lr``), as torchtitan saves it under pipeline parallelism: there each
# rank holds other parameters, and a nested ``param_groups`` list would be saved from one rank
# only. Other layouts keep the nested form (torch cannot flatten an empty parameter group, which
# a LoRA model's frozen norms leave); either form loads under any layout.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _saved_flat(path: Path) -> bool:
    """Whether the checkpoint's optimizer state is flattened (:data:`FLAT`: its groups keyed by
    parameter name, ``optim.param_groups.<fqn>.lr``) rather than nested (a list of groups,
    which the checkpoint stores as ``optim.param_groups.<i>.lr``)."""
    meta = dcp.FileSystemReader(str(Path(path) / "model_and_optim")).read_metadata()
    nested = re.compile(r"optim\.param_groups\.\d+\.")
    return not any(nested.match(k) for k in meta.state_dict_metadata)


def save_checkpoint(save_folder: Path, step: int, model: torch.nn.Module, optimizer,
                    trainer_state: dict[str, Any], config_yaml: str, *, stage: str = "stage1",
                    loss: float | None = None, keep_every: int = 0, keep_last: int = 0,
                    flat_optimizer: bool = False) -> Path:
    """Write the checkpoint of ``step``, prune by policy, update the index, point ``latest`` at it.

    Args:
        trainer_state: must hold ``tokens_seen`` (used in the name); saved with the RNG states.
        stage: the name's prefix (``train.checkpoint.stage``).
        loss: the training loss at this step, recorded in ``checkpoints.csv`` (6 decimals) and,
            exactly, in the trainer state (:func:`checkpoint_loss` reads it back).
        keep_every, keep_last: see :func:`prune_checkpoints`.
        flat_optimizer: save the optimizer state flattened per parameter name (:data:`FLAT`;
            needed under pipeline parallelism).
    Returns:
        The checkpoint directory.
    Raises:
        OlmoflowError: a write failed for lack of room (a full disk): one line naming the file, with
            the half-written checkpoint removed and ``latest`` still on the previous one.
    """
    save_folder = Path(save_folder)
    final = save_folder / checkpoint_name(stage, step, int(trainer_state["tokens_seen"]))
    tmp = save_folder / f".{final.name}.tmp"
    # Under torchrun every rank writes its shards through dcp; rank 0 alone makes, renames and
    # prunes directories and writes the index, and the barriers keep the others out meanwhile.
    main = distributed.is_main()
    if main:
        remove_stale_leftovers(save_folder)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    distributed.barrier()
    model_state, optim_state = get_state_dict(model, _optimizers(optimizer),
                                              options=FLAT if flat_optimizer else None)
    try:
        with writing(final / "model_and_optim"):
            dcp.save({"model": model_state, "optim": optim_state},
                     checkpoint_id=str(tmp / "model_and_optim"))
        if main:
            # Serialized in memory (a few kB) and written by Python: a full disk is then a plain
            # OSError, not torch's "[enforce fail at inline_container.cc] unexpected pos".
            buf = io.BytesIO()
            torch.save({**trainer_state, "rng": rng_state(), "loss": loss}, buf)
            with writing(final / TRAINER_STATE):
                (tmp / TRAINER_STATE).write_bytes(buf.getvalue())
            with writing(final / "config.yaml"):
                (tmp / "config.yaml").write_text(config_yaml)
            # Last: every rank's shards are written once dcp.save returns on the coordinator.
            write_checksums(tmp)
    except BaseException as e:
        if main:  # a half-written checkpoint is never trusted; on a full disk it also holds room
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OlmoflowError) and str(tmp) in str(e):
            # The user knows the checkpoint by its final name, not the hidden one it is built in.
            raise OlmoflowError(str(e).replace(str(tmp), str(final))) from None
        raise
    if main:
        if final.exists():  # a step saved again (e.g. after resuming an earlier checkpoint)
            trash = final.with_name(f".{final.name}.pruned")
            shutil.rmtree(trash, ignore_errors=True)
            final.rename(trash)  # out of the namespace first, as in prune_checkpoints
            tmp.rename(final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            tmp.rename(final)
        pruned = prune_checkpoints(save_folder, final, keep_every=keep_every, keep_last=keep_last)
        row = {"step": step, "tokens": int(trainer_state["tokens_seen"]), "name": final.name,
               "loss": "" if loss is None else f"{loss:.6f}",
               "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "status": "kept"}
        _update_index(save_folder, row, pruned)
        atomic_write_text(save_folder / LATEST, final.name + "\n")
    distributed.barrier()
    return final


def remove_stale_leftovers(save_folder: Path) -> list[Path]:
    """Delete what killed saves left in ``save_folder`` and return it: temporaries of the atomic
    writes (``.latest.*.tmp``, ``.checkpoints.csv.*.tmp``, ``.metrics.jsonl.*.tmp``), checkpoint
    directories never renamed into place (``.{checkpoint name}.tmp``) and half-pruned ones
    (``.{checkpoint name}.pruned``). Nothing else is touched: only names of those forms.

    For the run's own folder, on one process (rank 0), while no save is under way: at a run's start
    and at each save.
    """
    save_folder = Path(save_folder)
    stale = remove_stale_temporaries(save_folder)
    if not save_folder.is_dir():
        return stale
    for p in sorted(save_folder.iterdir()):
        name, dot, kind = p.name[1:].rpartition(".")
        if (p.name.startswith(".") and dot and kind in ("tmp", "pruned") and p.is_dir()
                and not p.is_symlink() and parse_checkpoint_name(name) is not None):
            shutil.rmtree(p, ignore_errors=True)
            stale.append(p)
    return stale


def checkpoint_loss(path: Path) -> float | None:
    """The training loss at the step of checkpoint ``path``: exact from its trainer state, else
    (checkpoints saved before the trainer state held it) its row of ``checkpoints.csv`` (6
    decimals); None when neither has it.

    Raises:
        OlmoflowError: the trainer state is damaged.
    """
    path = Path(path)
    loss = read_trainer_state(path).get("loss")
    if loss is not None:
        return float(loss)
    rows = [r for r in read_index(path.parent) if r.get("name") == path.name and r.get("loss")]
    return float(rows[-1]["loss"]) if rows else None


def prune_checkpoints(save_folder: Path, newest: Path, *, keep_every: int = 0,
                      keep_last: int = 0) -> list[str]:
    """Delete checkpoints the policy no longer keeps; return their names.

    Kept: every checkpoint whose step is a multiple of ``keep_every`` (when > 0), forever; of the
    rest, the newest ``keep_last`` (0 keeps all); and always ``newest`` (the one just saved).
    Checkpoints of steps after ``newest`` (left by a run resumed from an earlier one) and those of
    another stage (``stage1`` while ``stage2`` trains, or old ``stepN`` directories) are neither
    counted nor touched.
    """
    if keep_last <= 0:
        return []
    newest_step, stage = parse_checkpoint_name(newest.name), _NAME.match(newest.name)["stage"]
    rest = [p for p in list_checkpoints(save_folder)
            if (s := parse_checkpoint_name(p.name)) <= newest_step
            and _NAME.match(p.name)["stage"] == stage
            and not (keep_every > 0 and s % keep_every == 0)]
    doomed = [p for p in rest[: max(0, len(rest) - keep_last)] if p != newest]
    for p in doomed:
        # Renamed out of the checkpoint namespace first: a process killed mid-delete (Slurm
        # preemption) leaves a hidden leftover, never a half-deleted checkpoint a resume would
        # trust.
        trash = p.with_name(f".{p.name}.pruned")
        shutil.rmtree(trash, ignore_errors=True)
        p.rename(trash)
        shutil.rmtree(trash)
    for left in Path(save_folder).glob(".*.pruned"):  # leftovers of a killed earlier prune
        shutil.rmtree(left, ignore_errors=True)
    return [p.name for p in doomed]


def _index_row(r: dict[Any, Any]) -> dict[str, str] | None:
    """``r`` with exactly the index's fields (absent ones empty), or None when it is not a row
    this module wrote: a short or long line, or no checkpoint name and step that agree."""
    if None in r or None in r.values():  # csv.DictReader's marks of a short or a long line
        return None
    name, step, tokens = r.get("name") or "", r.get("step") or "", r.get("tokens") or ""
    if (parse_checkpoint_name(name) is None or not step.isdigit()
            or int(step) != parse_checkpoint_name(name) or (tokens and not tokens.isdigit())):
        return None
    return {k: r.get(k) or "" for k in INDEX_FIELDS}


def _parse_index(save_folder: Path) -> tuple[list[dict[str, str]], bool]:
    """``(well-formed rows of checkpoints.csv, whether the file is damaged)``."""
    path = Path(save_folder) / INDEX
    if not path.is_file():
        return [], False
    try:
        reader = csv.DictReader(io.StringIO(path.read_text(encoding="utf-8")))
        raw = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error):
        return [], True
    rows = [row for r in raw if (row := _index_row(r)) is not None]
    damaged = (len(rows) != len(raw)
               or not {"step", "name"} <= set(reader.fieldnames or ()))
    return rows, damaged


def read_index(save_folder: Path) -> list[dict[str, str]]:
    """The rows of ``save_folder/checkpoints.csv`` (empty when there is none), each with every
    field of ``INDEX_FIELDS``. Lines that are not well-formed rows (a hand edit, a damaged file)
    are left out: the index is bookkeeping, and :func:`save_checkpoint` rebuilds a damaged one.
    """
    return _parse_index(save_folder)[0]


def _rebuilt_row(path: Path) -> dict[str, str]:
    """The index row of checkpoint directory ``path``, from its name and trainer state."""
    step = parse_checkpoint_name(path.name)
    tokens, loss = "", ""
    try:
        state = read_trainer_state(path)
        tokens = str(int(state["tokens_seen"]))
        loss = "" if state.get("loss") is None else f"{float(state['loss']):.6f}"
    except (OlmoflowError, KeyError, TypeError, ValueError):
        pass  # a damaged trainer state still leaves the name and step worth recording
    return {"step": str(step), "tokens": tokens, "name": path.name, "loss": loss,
            "saved_at": "", "status": "kept"}


def _update_index(save_folder: Path, row: dict[str, Any], pruned: list[str]) -> None:
    """Add ``row`` to ``checkpoints.csv`` and mark ``pruned`` there, rewriting it atomically.

    A damaged index (missing columns, garbage lines) never stops a save: it is rebuilt from its
    well-formed rows and the checkpoints on disk, with a one-line warning.
    """
    parsed, damaged = _parse_index(save_folder)
    rows = {r["name"]: r for r in parsed}
    if damaged:
        log.warning("%s is damaged; rebuilt from its readable rows and the checkpoints in %s",
                    Path(save_folder) / INDEX, save_folder)
        for p in list_checkpoints(save_folder):
            if p.name not in rows:
                rows[p.name] = _rebuilt_row(p)
    rows[row["name"]] = {k: str(v) for k, v in row.items()}
    for name in pruned:
        if name in rows:
            rows[name]["status"] = "pruned"
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=INDEX_FIELDS, lineterminator="\n")
    w.writeheader()
    w.writerows(sorted(rows.values(), key=lambda r: (int(r["step"]), r["name"])))
    atomic_write_text(Path(save_folder) / INDEX, buf.getvalue())


def check_save_folder(save_folder: Path, *files: str) -> None:
    """Fail before training, not at the first save, when ``save_folder`` or one of the files a run
    writes there (``latest``, ``checkpoints.csv`` and ``files``) exists but is not what it must be.

    Raises:
        OlmoflowError: naming the path.
    """
    save_folder = Path(save_folder)
    if save_folder.exists() and not save_folder.is_dir():
        raise OlmoflowError(f"checkpoint folder '{save_folder}' exists and is not a directory")
    for name in (LATEST, INDEX, *files):
        if (save_folder / name).is_dir():
            raise OlmoflowError(f"'{save_folder / name}' is a directory, where the run writes a "
                                "file; move it away")


def has_checkpoint(save_folder: Path) -> bool:
    """Whether ``resume_from="latest"`` would find a complete checkpoint in ``save_folder``."""
    try:
        resolve_checkpoint(save_folder, LATEST)
    except OlmoflowError:
        return False
    return True


def resolve_checkpoint(save_folder: Path, resume_from: str) -> Path:
    """Find the checkpoint directory ``resume_from`` names.

    ``latest`` -> the directory the ``latest`` pointer names, or (pointer missing or stale) the
    complete checkpoint with the highest step; a path (absolute, or relative to ``save_folder``) of
    a checkpoint, or of a folder of checkpoints (its ``latest``); or ``stepN`` -> the checkpoint of
    step N whatever its stage and token suffix.

    Raises:
        OlmoflowError: nothing to resume from.
    """
    save_folder = Path(save_folder)
    if resume_from == LATEST:
        pointer = save_folder / LATEST
        if pointer.is_file():
            cand = save_folder / pointer.read_text().strip()
            if pointer.read_text().strip() and (cand / TRAINER_STATE).is_file():
                return cand
        # The pointer is written last; without it, the newest complete checkpoint is latest.
        found = list_checkpoints(save_folder)
        if not found:
            raise OlmoflowError(f"resume_from=latest but '{save_folder}' has no complete "
                                "checkpoint")
        return max(found, key=lambda p: parse_checkpoint_name(p.name))
    p = Path(resume_from)
    for cand in (p, save_folder / p):
        if (cand / TRAINER_STATE).is_file():
            return cand
    # A folder of checkpoints (this run's or another's) means its latest.
    for cand in (p, save_folder / p):
        if cand.is_dir() and list_checkpoints(cand):
            return resolve_checkpoint(cand, LATEST)
    step = parse_checkpoint_name(p.name)
    same_step = [c for c in list_checkpoints(save_folder) if parse_checkpoint_name(c.name) == step]
    if step is not None and str(p) == p.name and same_step:
        return same_step[-1]
    names = [c.name for c in list_checkpoints(save_folder)]
    if len(names) > 8:  # one readable line even after thousands of saves
        names = names[:3] + [f"... ({len(names) - 6} more)"] + names[-3:]
    pruned = [r["name"] for r in read_index(save_folder) if r.get("status") == "pruned"
              and (r["name"] == p.name or (str(p) == p.name and r.get("step") == str(step)))]
    why = (f"'{pruned[-1]}' was pruned (train.checkpoint.keep_last/keep_every, see {INDEX}); "
           if pruned else "")
    raise OlmoflowError(f"no checkpoint at '{resume_from}' ({why}expected 'latest', a checkpoint "
                        f"directory or stepN; '{save_folder}' has: {', '.join(names) or 'none'})")


def _pickled_object(e: BaseException) -> str | None:
    """The global a weights-only ``torch.load`` refused (``builtins.exec``), from its error."""
    m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
    return m[1] if m else None


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The trainer state of checkpoint ``path`` (``trainer_state.pt``), read with
    ``torch.load(weights_only=True)``: plain data only, never a pickled object (which could run
    code), except the NumPy array of older checkpoints' RNG state.

    Raises:
        OlmoflowError: the file is missing, truncated, not a trainer state, or holds a pickled
            object.
    """
    path = Path(path)
    try:
        with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):
            state = torch.load(path / TRAINER_STATE, weights_only=True)
        if not isinstance(state, dict) or "step" not in state or "tokens_seen" not in state:
            raise ValueError("no step / tokens_seen in it")
        return state
    except pickle.UnpicklingError as e:
        if (name := _pickled_object(e)) is None:
            raise _unreadable(path, TRAINER_STATE, e) from None
        raise OlmoflowError(
            f"checkpoint '{path}' cannot be read ({TRAINER_STATE} holds a pickled Python object, "
            f"{name}, which olmoflow never loads: loading it could run code); olmoflow writes "
            f"only tensors, numbers and strings there, so the file was made elsewhere or "
            f"altered; {_other_checkpoint_hint(path)}") from None
    except Exception as e:  # torch.load raises many kinds on a damaged file
        raise _unreadable(path, TRAINER_STATE, e) from None


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer, *,
                    verify: bool = True) -> dict[str, Any]:
    """Restore model, optimizer and RNG states from ``path``; return the trainer state.

    ``verify=False`` skips :func:`verify_checkpoint` for a caller that has just run it (it is
    collective under torchrun, as this load is).

    Raises:
        OlmoflowError: the checkpoint is damaged, was changed since it was saved (see
            :func:`verify_checkpoint`) or holds another model's or optimizer's state.
    """
    if verify:
        verify_checkpoint(path, collective=True)
    trainer_state = read_trainer_state(path)  # before any tensor changes: a bad file changes none
    optimizers = _optimizers(optimizer)
    try:
        options = FLAT if _saved_flat(path) else None
    except Exception as e:  # a damaged .metadata
        raise _unreadable(path, "model_and_optim", e) from None
    model_state, optim_state = get_state_dict(model, optimizers, options=options)
    _dcp_load(path, {"model": model_state, "optim": optim_state},
              lambda st: set_state_dict(model, optimizers, model_state_dict=st["model"],
                                        optim_state_dict=st["optim"], options=options))
    set_rng_state(trainer_state.pop("rng"))
    return trainer_state


def step_and_tokens(path: Path) -> tuple[int, int]:
    """``(step, tokens_seen)`` stored in a checkpoint directory's trainer state."""
    state = read_trainer_state(path)
    return int(state["step"]), int(state["tokens_seen"])
