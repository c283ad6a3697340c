"""Running stages: fingerprints, skipping what is complete, manifests and the summary table.

A stage's fingerprint is the sha256 of its config sections and of the manifests (outputs and their
hashes) of the stages it reads. A stage whose directory has a manifest with the same fingerprint
and intact outputs is skipped; otherwise its directory is cleared and it runs again. A training
stage (one whose record says it trains) is the exception: an interrupted run with the same
fingerprint resumes from its latest checkpoint, and checkpoints made under another fingerprint are
kept until the user says ``resume_from=latest`` (continue them) or ``--force`` (start over).

The runner knows no stage by name: what it needs to know is in each :class:`Stage` record.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from olmoflow.artifacts import (
    StageResult,
    atomic_write_text,
    is_complete,
    now,
    read_manifest,
    sha256_json,
    write_manifest,
)
from olmoflow.config import set_dotted
from olmoflow.errors import OlmoflowError
from olmoflow.pipeline.config import RunConfig, dump_config
from olmoflow.pipeline.stage import Stage, StageTable
from olmoflow.pipeline.stages import STAGES
from olmoflow.run_dir import RunDir
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
    runs = RunDir(cfg.run_dir)
    for up in stage.upstream:
        if table[up].is_enabled(cfg):
            m = read_manifest(runs.stage(up)) or {}
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
        OlmoflowError: an unknown stage, a path in the way, checkpoints made under another
            config (the message says how to continue or start over), or the stage's own errors.
    """
    table = STAGES if table is None else table
    stage = table[name]
    out = RunDir(cfg.run_dir).stage(name)
    info = distributed.init_from_env()  # under torchrun; one process otherwise
    if out.exists() and not out.is_dir():
        raise OlmoflowError(f"'{out}' exists and is not a directory; the {name} stage writes there")
    trains = stage.trains
    resume_from = _get_dotted(cfg, trains.resume_key) if trains else None
    if force and resume_from and _resumes_inside(out, resume_from):
        raise OlmoflowError(f"--force would delete the checkpoints in '{out}' that resume_from="
                            f"{resume_from} continues; drop one of the two")
    fp = fingerprint(cfg, name, table)
    complete = not force and is_complete(out, fp)
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
            "different upstream data; add resume_from=latest to continue them under this config, "
            "or --force to delete them and train from step 0")
    if complete:
        return "skipped", 0.0, (read_manifest(out) or {}).get("counts", {})
    if resuming:
        _set_dotted_attr(cfg, trains.resume_key, resume_from or "latest")
    if info.is_main:
        if not resuming and out.exists():
            shutil.rmtree(out)
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
        if not info.is_distributed or trains is not None:
            raise
        error = e
    secs = time.time() - t0
    if info.is_main and result is not None:
        write_manifest(out, stage=name, command=command or " ".join(sys.argv), config=cfg.to_dict(),
                       fingerprint=fp, inputs=result.inputs, outputs=result.outputs,
                       counts=result.counts, started=started, extra={"seconds": round(secs, 2)})
    # Every rank leaves with rank 0's outcome, after its manifest exists (the next stage's
    # fingerprint reads it).
    message, counts = distributed.broadcast_object(
        (str(error) if error else None, result.counts if result is not None else {}))
    if message is not None:
        raise OlmoflowError(message)
    return ("resumed" if resuming else "ran"), secs, counts


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
        OlmoflowError: a path in the way, an unknown stage, or a stage's error; a run directory
            the call created is removed again when no stage finished.
    """
    table = STAGES if table is None else table
    run_dir = Path(cfg.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise OlmoflowError(f"run_dir '{run_dir}' exists and is not a directory")
    created = not run_dir.exists()
    main = distributed.init_from_env().is_main  # under torchrun only rank 0 prints and writes
    rows = []
    names = stages or [s.name for s in table.enabled(cfg)]
    for name in names:
        table[name]  # an unknown stage fails before any stage runs
    try:
        for name in names:
            status, secs, counts = run_stage(cfg, name, progress=progress, force=force,
                                             table=table)
            if main:
                print(f"[{name}] {status} in {secs:.1f}s: {_headline(table[name], counts)}",
                      flush=True)
            rows.append((name, status, secs, counts))
            if len(rows) == 1 and main:  # the run exists once a stage is done: record its config
                atomic_write_text(RunDir(run_dir).config, dump_config(cfg))
    except OlmoflowError:
        if main and created and run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()  # a run that failed before its first stage leaves nothing behind
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
