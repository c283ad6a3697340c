"""Recorded work: the skip / fingerprint / manifest core of olmoflow's step runners.

A piece of recorded work (a data engine step, the tokenizer it trains, the quality classifier)
writes one directory and records it in ``manifest.json`` (:func:`olmoflow.artifacts.write_manifest`)
under a fingerprint: the sha256 of its config and of the fingerprints of the work it reads. Run
again, it is skipped while the manifest is complete (every output present, with its recorded
hash) and its fingerprint unchanged; otherwise it runs and its manifest is written last, so work
killed halfway is redone. :func:`is_current` and :func:`record` are that rule, once: the flow's
stage runner (:mod:`olmoflow.pipeline.runner`, which adds training resumes and keeps a stage's
previous output until the new one is complete) and the data engine
(:func:`run_recorded`, for every step) both call them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from olmoflow.artifacts import (
    StageResult,
    is_complete,
    now,
    read_manifest,
    sha256_json,
    write_manifest,
)


def fingerprint(name: str, config: Any, upstream: list[tuple[str, str | None]]) -> str:
    """sha256 of the work ``name``: its ``config`` (plain data) and the ``(name, fingerprint)``
    of each piece of work it reads (None for one not made)."""
    return sha256_json({"step": name, "config": config, "upstream": upstream})


def upstream_fingerprint(directory: Path) -> str | None:
    """The fingerprint recorded in ``directory``'s manifest (None when it has none)."""
    return (read_manifest(directory) or {}).get("fingerprint")


def is_current(out: Path, fp: str, force: bool = False) -> bool:
    """Whether the work writing ``out`` can be skipped: not ``force``d, and its manifest is
    complete (every output present with its recorded hash) under the fingerprint ``fp``."""
    return not force and is_complete(out, fp)


def record(out: Path, fp: str, result: StageResult, *, stage: str, command: str, config: Any,
           started: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``out``'s manifest for finished work (``result``'s inputs, outputs and counts, under
    ``fp``): written last, it is what makes the work complete. Returns the manifest."""
    return write_manifest(out, stage=stage, command=command, config=config, fingerprint=fp,
                          inputs=result.inputs, outputs=result.outputs, counts=result.counts,
                          started=started, extra=extra)


@dataclass
class Recorded:
    """What :func:`run_recorded` did: ``skipped`` (complete and current), the ``seconds`` it ran
    and the ``counts`` in its manifest."""

    skipped: bool
    seconds: float
    counts: dict[str, Any]


def run_recorded(out: Path, fp: str, run: Callable[[], tuple[StageResult, dict[str, Any]]], *,
                 stage: str, command: str, config: Any, force: bool = False,
                 prepare: Callable[[], None] | None = None,
                 finish: Callable[[StageResult], None] | None = None) -> Recorded:
    """Skip the work writing ``out`` when its manifest is complete under ``fp`` (unless
    ``force``); else ``prepare()``, ``run()`` -> ``(result, extra)``, ``finish(result)``, then
    write the manifest (``stage``, ``command``, ``config``, ``fp``, the result's inputs, outputs
    and counts, and ``extra``'s fields).

    Raises:
        whatever ``prepare``, ``run`` or ``finish`` raise; no manifest is written then, so the
        next run does the work again.
    """
    t0 = time.perf_counter()
    if is_current(out, fp, force):
        return Recorded(True, 0.0, (read_manifest(out) or {}).get("counts", {}))
    started = now()
    if prepare is not None:
        prepare()
    result, extra = run()
    if finish is not None:
        finish(result)
    record(out, fp, result, stage=stage, command=command, config=config, started=started,
           extra=extra)
    return Recorded(False, time.perf_counter() - t0, result.counts)
