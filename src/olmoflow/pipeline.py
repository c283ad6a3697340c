"""Running stages: fingerprints, skipping what is complete, manifests and the summary table.

A stage's fingerprint is the sha256 of its config sections and of the manifests (outputs and their
hashes) of the stages it reads. A stage whose directory has a manifest with the same fingerprint
and intact outputs is skipped; otherwise its directory is cleared and it runs again. Pretraining
is the exception: an interrupted run with the same fingerprint resumes from its latest checkpoint,
and checkpoints made under another fingerprint are kept until the user says ``resume_from=latest``
(continue them) or ``--force`` (start over).
"""

from __future__ import annotations

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
    sha256_file,
    sha256_json,
    write_manifest,
)
from olmoflow.config import RunConfig, dump_config
from olmoflow.errors import OlmoflowError
from olmoflow.stages import BY_NAME, RUNNERS, STAGES, stage_dir
from olmoflow.train import distributed
from olmoflow.train.checkpoint import has_checkpoint, resolve_checkpoint

FINGERPRINT = ".fingerprint"
# train.* keys that change how a run is kept, logged or scheduled on the machine, not the weights it
# makes: changing one resumes an interrupted run (and leaves a complete one complete) instead of
# deleting its checkpoints and training again from step 0.
TRAIN_BOOKKEEPING = ("resume_from", "save_interval", "log_interval", "keep_every", "keep_last",
                     "num_threads", "detailed_log_interval", "loggers")


def _source_stamp(sources: list[str]) -> list[Any]:
    """Identity of the sources: the content hash of every file collect reads (an edit that keeps
    the size and the modification time still reruns collect), and the Python version for the stdlib."""
    from olmoflow.data.sources import source_files

    stamp: list[Any] = [["stdlib", sys.version]] if "stdlib" in sources else []
    return stamp + [[str(f), sha256_file(f)] for f in source_files(sources)]


def fingerprint(cfg: RunConfig, name: str) -> str:
    stage = BY_NAME[name]
    parts: dict[str, Any] = {"stage": name}
    for sec in stage.sections:
        parts[sec] = cfg.section(sec) if sec != "seed" else cfg.seed
    if "train" in parts:
        for key in TRAIN_BOOKKEEPING:
            parts["train"].pop(key, None)
    for up in stage.upstream:
        m = read_manifest(stage_dir(cfg, up)) or {}
        parts[f"upstream:{up}"] = [m.get("fingerprint"), m.get("outputs")]
    if name == "collect":
        parts["sources"] = _source_stamp(cfg.collect.sources)
    return sha256_json(parts)


def run_stage(cfg: RunConfig, name: str, *, progress: bool = True, force: bool = False,
              command: str = "") -> tuple[str, float, dict[str, Any]]:
    """Run one stage unless it is complete. Returns ``(status, seconds, counts)``."""
    out = stage_dir(cfg, name)
    info = distributed.init_from_env()  # under torchrun; one process otherwise
    if out.exists() and not out.is_dir():
        raise OlmoflowError(f"'{out}' exists and is not a directory; the {name} stage writes there")
    if force and name == "pretrain" and cfg.train.resume_from and _resumes_inside(out, cfg.train.resume_from):
        raise OlmoflowError(f"--force would delete the checkpoints in '{out}' that resume_from="
                            f"{cfg.train.resume_from} continues; drop one of the two")
    fp = fingerprint(cfg, name)
    complete = not force and is_complete(out, fp)
    # An explicit resume_from continues the stage's checkpoints even under a changed config (e.g.
    # more train.max_steps) instead of clearing them.
    resuming = (not complete and name == "pretrain" and not force and has_checkpoint(out)
                and (_same_fingerprint(out, fp) or bool(cfg.train.resume_from)))
    # Checkpoints made under another config or other upstream data are never deleted implicitly:
    # they may hold days of training. The user says which way to go.
    kept = (None if complete or resuming or force or name != "pretrain" or not has_checkpoint(out)
            else resolve_checkpoint(out, "latest").name)
    # Under torchrun rank 0 decides and every rank follows; rank 0 alone writes the stage's files.
    complete, resuming, kept = distributed.broadcast_object((complete, resuming, kept))
    if kept is not None:
        raise OlmoflowError(
            f"'{out}' holds checkpoints (newest: {kept}) made under a different config or different "
            "upstream data; add resume_from=latest to continue them under this config, or --force "
            "to delete them and train from step 0")
    if complete:
        return "skipped", 0.0, (read_manifest(out) or {}).get("counts", {})
    if resuming:
        cfg.train.resume_from = cfg.train.resume_from or "latest"
    if info.is_main:
        if not resuming and out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / FINGERPRINT, fp)
    distributed.barrier()
    started, t0 = now(), time.time()
    # Pretraining runs on every rank; rank 0 runs any other stage while the others wait.
    runs_here = info.is_main or name == "pretrain"
    error: OlmoflowError | None = None
    result: StageResult | None = None
    try:
        result = RUNNERS[name](cfg, progress) if runs_here else None
    except OlmoflowError as e:
        if not resuming and info.is_main:  # leave no empty or half-made stage directory behind
            shutil.rmtree(out, ignore_errors=True)
        if not info.is_distributed or name == "pretrain":
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


def _headline(name: str, counts: dict[str, Any]) -> str:
    keys = {
        "collect": ["documents", "bytes", "skipped_malformed", "damaged_files"],
        "clean": ["documents", "removed_too_short", "removed_too_long", "removed_duplicate"],
        "train-tokenizer": ["vocab_size", "bytes_per_token"],
        "tokenize": ["train_tokens", "heldout_tokens", "train_documents", "heldout_documents"],
        "pretrain": ["parameters", "steps", "tokens", "final_loss", "packing_efficiency"],
        "evaluate": ["loss", "perplexity", "bpb"],
        "generate": ["samples"],
        "release": ["files"],
    }[name]
    parts = []
    for k in keys:
        if k in counts and counts[k] is not None:
            v = counts[k]
            parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v:,}" if isinstance(v, int) else f"{k}={v}")
    return ", ".join(parts)


def run_pipeline(cfg: RunConfig, *, stages: list[str] | None = None, progress: bool = True,
                 force: bool = False) -> list[tuple[str, str, float, dict[str, Any]]]:
    """Run the flow (all stages, or ``stages``), printing a line per stage and a summary table."""
    run_dir = Path(cfg.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise OlmoflowError(f"run_dir '{run_dir}' exists and is not a directory")
    created = not run_dir.exists()
    main = distributed.init_from_env().is_main  # under torchrun only rank 0 prints and writes
    rows = []
    names = stages or [s.name for s in STAGES]
    try:
        for name in names:
            status, secs, counts = run_stage(cfg, name, progress=progress, force=force)
            if main:
                print(f"[{name}] {status} in {secs:.1f}s: {_headline(name, counts)}", flush=True)
            rows.append((name, status, secs, counts))
            if len(rows) == 1 and main:  # the run exists once a stage is done: record its config
                atomic_write_text(run_dir / "config.yaml", dump_config(cfg))
    except OlmoflowError:
        if main and created and run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()  # a run that failed before its first stage leaves nothing behind
        raise
    if len(names) > 1 and main:
        print_summary(rows, run_dir)
    return rows


def print_summary(rows, run_dir: Path) -> None:
    w = max(len(r[0]) for r in rows)
    lines = [f"{'stage':<{w}}  {'status':<8}  {'time':>8}  result", "-" * (w + 40)]
    for name, status, secs, counts in rows:
        lines.append(f"{name:<{w}}  {status:<8}  {secs:>7.1f}s  {_headline(name, counts)}")
    total = sum(r[2] for r in rows)
    lines.append(f"{'total':<{w}}  {'':<8}  {total:>7.1f}s  artifacts in {run_dir}{os.sep}")
    print("\n" + "\n".join(lines), flush=True)
