"""Running stages: fingerprints, skipping what is complete, manifests and the summary table.

A stage's fingerprint is the sha256 of its config sections and of the manifests (outputs and their
hashes) of the stages it reads. A stage whose directory has a manifest with the same fingerprint
and intact outputs is skipped; otherwise it runs again into a fresh directory. A training
stage (one whose record says it trains) is the exception: an interrupted run with the same
fingerprint resumes from its latest checkpoint, and checkpoints made under another fingerprint are
kept until the user says ``resume_from=latest`` (continue them) or ``--force`` (start over).

The previous output of a stage that runs again is set aside (``.<dir>.previous`` beside it) and
deleted only once the new output is complete: a rerun that fails (a bad value, an input that is
gone, an interrupt) puts it back, so a failed rerun never costs finished work. A run killed
halfway leaves both; the next run keeps the new one when it is finished (or, for a training stage,
holds a checkpoint to resume) and puts the previous one back otherwise. The disk holds both until
the new output is complete.

The runner writes and deletes only in a directory that is olmoflow's (it carries the marker
``.olmoflow-run``, see :func:`olmoflow.run_dir.claim_directory`): a ``--run-dir`` holding the
user's own files is refused. Inputs that lie inside the run's stage directories are refused too
(:func:`olmoflow.run_dir.check_inputs`). One process at a time works in a run directory: the
runner holds its lock (:func:`olmoflow.artifacts.directory_lock`) for the whole run; under
torchrun rank 0 holds it for the job.

The runner knows no stage by name: what it needs to know is in each :class:`Stage` record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from olmoflow.artifacts import (
    LOCK_FILE,
    StageResult,
    atomic_write_text,
    directory_lock,
    hash_once,
    now,
    read_manifest,
    sha256_json,
)
from olmoflow.config import set_dotted
from olmoflow.errors import OlmoflowError
from olmoflow.pipeline.config import RunConfig, dump_config
from olmoflow.pipeline.stage import Stage, StageTable, Trains
from olmoflow.pipeline.stages import STAGES
from olmoflow.recorded import is_current, record
from olmoflow.run_dir import (
    INPUT_KEYS,
    RUN_MARKER,
    RunDir,
    check_inputs,
    claim_directory,
    legacy_run_problem,
    previous_output,
)
from olmoflow.train import distributed
from olmoflow.train.checkpoint import has_checkpoint, resolve_checkpoint

FINGERPRINT = ".fingerprint"


def _get_dotted(cfg: RunConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _set_dotted_attr(cfg: RunConfig, key: str, value: Any) -> None:
    *head, last = key.split(".")
    node: Any = cfg
    for part in head:
        node = getattr(node, part)
    setattr(node, last, value)


def _drop(tree: dict[str, Any], dotted: str) -> None:
    *head, last = dotted.split(".")
    for part in head:
        tree = tree.get(part)
        if not isinstance(tree, dict):
            return
    tree.pop(last, None)


def _resolved(cfg: RunConfig, key: str) -> Any:
    """The resolved value of a config section or key, as plain data (a dataclass as a dict)."""
    value = _get_dotted(cfg, key)
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def stage_path(cfg: RunConfig, stage: Stage) -> Path:
    """The directory ``stage`` writes in the run ``cfg`` (its record's directory)."""
    return RunDir(cfg.run_dir).root / stage.dirname


def fingerprint(cfg: RunConfig, name: str, table: StageTable | None = None) -> str:
    """The sha256 of what stage ``name`` makes its output from: its config sections (less its
    bookkeeping keys), its extra stamp, and the manifests of the enabled upstream stages.

    ``table``: the table of stages (default: the flow's, :data:`STAGES`).

    Raises:
        OlmoflowError: ``name`` is no stage of ``table``.
    """
    table = STAGES if table is None else table
    stage = table[name]
    parts: dict[str, Any] = {"stage": name}
    for sec in stage.sections:
        set_dotted(parts, sec, _resolved(cfg, sec))
    for key in stage.ignore:
        _drop(parts, key)
    for up in stage.upstream:
        if table[up].is_enabled(cfg):
            m = read_manifest(stage_path(cfg, table[up])) or {}
            parts[f"upstream:{up}"] = [m.get("fingerprint"), m.get("outputs")]
    if stage.stamp is not None:
        parts["stamp"] = stage.stamp(cfg)
    return sha256_json(parts)


def run_stage(cfg: RunConfig, name: str, *, progress: bool = True, force: bool = False,
              command: str = "", table: StageTable | None = None
              ) -> tuple[str, float, dict[str, Any]]:
    """Run one stage unless it is complete (see the module docstring).

    Args:
        force: run it even when complete (a training stage then starts over from step 0).
        command: the command line recorded in its manifest (default: ``sys.argv``).
        table: the table of stages (default: the flow's, :data:`STAGES`).
    Returns:
        ``(status, seconds, counts)``: status ``"ran"``, ``"resumed"`` or ``"skipped"``.
    Raises:
        OlmoflowError: an unknown stage, a path in the way, a run directory that is not
            olmoflow's or that another process is using, checkpoints made under another config
            (the message says how to continue or start over), or the stage's own errors; the
            stage's previous output is back in place after an error.
    """
    table = STAGES if table is None else table
    stage = table[name]
    out = stage_path(cfg, stage)
    info = distributed.init_from_env()  # under torchrun; one process otherwise
    with contextlib.ExitStack() as held:
        _hold(Path(cfg.run_dir), info, held)
        outcome = _run_stage(cfg, name, stage, out, info, progress=progress, force=force,
                             command=command, table=table)
        if stage.finish is not None and info.is_main:
            stage.finish(cfg)
        return outcome


def _run_stage(cfg: RunConfig, name: str, stage: Stage, out: Path, info: distributed.DistInfo,
               *, progress: bool, force: bool, command: str, table: StageTable
               ) -> tuple[str, float, dict[str, Any]]:
    """:func:`run_stage` once the run directory is held."""
    trains = stage.trains
    if info.is_main:
        _settle(out, trains is not None)  # an earlier run killed while the stage ran again
    if out.exists() and not out.is_dir():
        raise OlmoflowError(f"'{out}' exists and is not a directory; the {name} stage writes there")
    resume_from = _get_dotted(cfg, trains.resume_key) if trains else None
    if force and resume_from and _resumes_inside(out, resume_from):
        raise OlmoflowError(f"--force would delete the checkpoints in '{out}' that resume_from="
                            f"{resume_from} continues; drop one of the two")
    fp = fingerprint(cfg, name, table)
    complete = is_current(out, fp, force)
    # An explicit resume_from continues the stage's checkpoints even under a changed config (e.g.
    # more train.max_steps) instead of clearing them.
    resuming = (not complete and trains is not None and not force and has_checkpoint(out)
                and (_same_fingerprint(out, fp) or bool(resume_from)))
    # Checkpoints made under another config or other upstream data are never deleted implicitly:
    # they may hold days of training. The user says which way to go.
    kept = (None if complete or resuming or force or trains is None or not has_checkpoint(out)
            else resolve_checkpoint(out, "latest").name)
    # Under torchrun rank 0 decides and every rank follows; rank 0 alone writes the stage's files.
    complete, resuming, kept = distributed.broadcast_object((complete, resuming, kept))
    if kept is not None:
        raise OlmoflowError(
            f"'{out}' holds checkpoints (newest: {kept}) made under a different config or "
            f"different upstream data; add {resume_hint(trains)} to continue them under this "
            "config, or --force to delete them and train from step 0")
    if complete:
        return "skipped", 0.0, (read_manifest(out) or {}).get("counts", {})
    if resuming:
        _set_dotted_attr(cfg, trains.resume_key, resume_from or "latest")
    if info.is_main:
        if not resuming and out.exists():
            # Kept until the new output is complete: a failing rerun must not cost finished work.
            os.replace(out, previous_output(out))
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / FINGERPRINT, fp)
    distributed.barrier()
    started, t0 = now(), time.time()
    # A training stage runs on every rank; rank 0 runs any other stage while the others wait.
    runs_here = info.is_main or trains is not None
    error: OlmoflowError | None = None
    result: StageResult | None = None
    try:
        result = stage.run(cfg, progress) if runs_here else None
    except OlmoflowError as e:
        if not resuming and info.is_main:  # leave no empty or half-made stage directory behind
            shutil.rmtree(out, ignore_errors=True)
            _settle(out, trains is not None)  # and the previous output back in its place
        if not info.is_distributed or trains is not None:
            raise
        error = e
    except BaseException:
        if not resuming and info.is_main:
            _settle(out, trains is not None)
        raise
    secs = time.time() - t0
    if info.is_main and result is not None:
        record(out, fp, result, stage=name, command=command or " ".join(sys.argv),
               config=cfg.to_dict(), started=started, extra={"seconds": round(secs, 2)})
    if info.is_main:
        _settle(out, trains is not None)  # the new output is complete: the previous one goes
    # Every rank leaves with rank 0's outcome, after its manifest exists (the next stage's
    # fingerprint reads it).
    message, counts = distributed.broadcast_object(
        (str(error) if error else None, result.counts if result is not None else {}))
    if message is not None:
        raise OlmoflowError(message)
    return ("resumed" if resuming else "ran"), secs, counts


def resume_hint(trains: Trains) -> str:
    """The override that resumes a training stage: its record's ``resume_alias`` when it has one,
    else its ``resume_key``, set to ``latest``."""
    return f"{trains.resume_alias or trains.resume_key}=latest"


def _hold(root: Path, info: distributed.DistInfo, held: contextlib.ExitStack,
          check: Any = None) -> bool:
    """Make the run directory ``root`` ready to work in: run ``check`` (a callable), claim the
    directory (:func:`~olmoflow.run_dir.claim_directory`) and take its lock for the life of
    ``held``. Only rank 0 does this (the other ranks are the same job); every rank raises rank
    0's error. Nested calls in one process are free. Returns whether this call marked ``root``.

    Raises:
        OlmoflowError: ``check``'s error, a directory that is not olmoflow's, or one another
            process holds (the message names it).
    """
    error, marked = None, False
    if info.is_main:
        try:
            if check is not None:
                check()
            marked = claim_directory(root, legacy=_legacy_run_problem)
            held.enter_context(directory_lock(root, what="run directory"))
        except OlmoflowError as e:
            error = str(e)
    error = distributed.broadcast_object(error)
    if error is not None:
        raise OlmoflowError(error)
    return marked


def _legacy_run_problem(root: Path) -> str | None:
    """:func:`~olmoflow.run_dir.legacy_run_problem`, where a directory holding a complete
    checkpoint of a training stage is a stage directory too."""
    return legacy_run_problem(root, made=has_checkpoint)


def _settle(out: Path, trains: bool) -> None:
    """Decide between a stage's new output and its previous one set aside (see the module
    docstring): keep the new one when it is finished or, for a training stage, holds a
    checkpoint to resume; otherwise put the previous one back. Nothing to do without one."""
    previous = previous_output(out)
    if not previous.exists():
        return
    if read_manifest(out) is not None or (trains and has_checkpoint(out)):
        if previous.is_symlink():  # the stage directory was a link: drop the link, not its target
            previous.unlink()
        else:
            shutil.rmtree(previous, ignore_errors=True)
        return
    if out.is_dir() and not out.is_symlink():
        shutil.rmtree(out)
    elif out.exists() or out.is_symlink():
        out.unlink()
    os.replace(previous, out)


def _check_inputs(cfg: RunConfig, table: StageTable) -> None:
    """Refuse input paths (:data:`~olmoflow.run_dir.INPUT_KEYS`) inside the run's own stage
    directories."""
    for key in INPUT_KEYS:
        try:
            entries = _get_dotted(cfg, key)
        except AttributeError:
            continue
        if isinstance(entries, (list, tuple)):
            check_inputs(RunDir(cfg.run_dir), table.names, entries, key)


def _unmark(run_dir: Path, created: bool) -> None:
    """Take back what claiming ``run_dir`` added when nothing else is in it: its marker and lock
    file, and the directory itself when this run created it."""
    ours = {RUN_MARKER, LOCK_FILE}
    with contextlib.suppress(OSError):
        left = {p.name for p in run_dir.iterdir()}
        if left <= ours:
            for n in left:
                (run_dir / n).unlink()
            if created:
                run_dir.rmdir()


def _resumes_inside(out: Path, resume_from: str) -> bool:
    """Whether ``resume_from`` names a checkpoint in ``out`` (which ``--force`` would delete)."""
    try:
        return resolve_checkpoint(out, resume_from).resolve().parent == out.resolve()
    except OlmoflowError:
        return False


def _same_fingerprint(out: Path, fp: str) -> bool:
    try:
        return (out / FINGERPRINT).read_text().strip() == fp
    except OSError:
        return False


def _headline(stage: Stage, counts: dict[str, Any]) -> str:
    """``k=v, ...`` of the stage's headline counts that ``counts`` holds."""
    parts = []
    for k in stage.headline:
        v = counts.get(k)
        if v is None:
            continue
        if isinstance(v, float):
            parts.append(f"{k}={v:.4g}")
        elif isinstance(v, int) and not isinstance(v, bool):
            parts.append(f"{k}={v:,}")
        else:
            parts.append(f"{k}={v}")
    return ", ".join(parts)


def run_pipeline(cfg: RunConfig, *, stages: list[str] | None = None, progress: bool = True,
                 force: bool = False, table: StageTable | None = None
                 ) -> list[tuple[str, str, float, dict[str, Any]]]:
    """Run the flow, printing a line per stage and (for several) a summary table.

    Args:
        stages: the names of the stages to run, in this order (default: every enabled stage of
            ``table``, in table order).
        table: the table of stages (default: the flow's, :data:`STAGES`).
    Returns:
        A row ``(name, status, seconds, counts)`` per stage run.
    Raises:
        OlmoflowError: a path in the way, an unknown stage, a run directory that is not
            olmoflow's or that another process is using, an input inside the run's own stage
            directories, or a stage's error; a run directory the call created (or marked while
            empty) is left as it was when no stage finished.
    """
    table = STAGES if table is None else table
    run_dir = Path(cfg.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise OlmoflowError(f"run_dir '{run_dir}' exists and is not a directory")
    created = not run_dir.exists()
    info = distributed.init_from_env()
    main = info.is_main  # under torchrun only rank 0 prints and writes
    rows = []
    names = stages or [s.name for s in table.enabled(cfg)]
    for name in names:
        table[name]  # an unknown stage fails before any stage runs
    with contextlib.ExitStack() as held:
        # Held for the whole run, so no other process works in it between two stages.
        marked = _hold(run_dir, info, held, lambda: _check_inputs(cfg, table))
        held.enter_context(hash_once())  # a stage's inputs are the outputs checked before it
        try:
            for name in names:
                status, secs, counts = run_stage(cfg, name, progress=progress, force=force,
                                                 table=table)
                if main:
                    print(f"[{name}] {status} in {secs:.1f}s: {_headline(table[name], counts)}",
                          flush=True)
                rows.append((name, status, secs, counts))
                if len(rows) == 1 and main:  # the run exists once a stage is done: its config
                    atomic_write_text(RunDir(run_dir).config, dump_config(cfg))
        except OlmoflowError:
            if main and marked:  # a run that failed before its first stage leaves nothing behind
                _unmark(run_dir, created)
            raise
    if len(names) > 1 and main:
        print_summary(rows, run_dir, table)
    return rows


def print_summary(rows: list[tuple[str, str, float, dict[str, Any]]], run_dir: Path,
                  table: StageTable | None = None) -> None:
    """Print the table of ``rows`` (from :func:`run_pipeline`): stage, status, time, headline."""
    table = STAGES if table is None else table
    w = max(len(r[0]) for r in rows)
    lines = [f"{'stage':<{w}}  {'status':<8}  {'time':>8}  result", "-" * (w + 40)]
    for name, status, secs, counts in rows:
        lines.append(f"{name:<{w}}  {status:<8}  {secs:>7.1f}s  {_headline(table[name], counts)}")
    total = sum(r[2] for r in rows)
    lines.append(f"{'total':<{w}}  {'':<8}  {total:>7.1f}s  artifacts in {run_dir}{os.sep}")
    print("\n" + "\n".join(lines), flush=True)
