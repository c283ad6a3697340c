"""The record of a stage: everything the runner needs to know about it, so that the runner itself
knows no stage by name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from olmoflow.artifacts import StageResult
    from olmoflow.pipeline.config import RunConfig


@dataclass(frozen=True)
class Trains:
    """What a training stage adds: it resumes from its checkpoints, runs on every rank under
    torchrun, and its checkpoints are never deleted implicitly. ``resume_key`` is the dotted config
    key of its ``resume_from`` (``train.checkpoint.resume_from``)."""

    resume_key: str


@dataclass(frozen=True)
class Stage:
    """One stage of the flow.

    Attributes:
        name: the CLI verb and the key of its directory in :class:`olmoflow.run_dir.RunDir`.
        run: ``(cfg, progress) -> StageResult``; writes only into the stage's directory.
        sections: config sections (top-level names, or ``"seed"``) its output depends on; they
            are part of its fingerprint.
        upstream: stages whose manifests (fingerprint and outputs) are part of its fingerprint.
        headline: count keys printed after it runs and in the summary table.
        help: one line for ``olmoflow --help``.
        ignore: dotted config keys left out of the fingerprint because they change how a run is
            kept or logged, not what it makes (``train.log.interval``).
        stamp: extra fingerprint input computed from the config (collect: the content hash of
            every source file).
        enabled: whether the stage is part of this run (data stages are not when ``train.data``
            names a tokens directory made elsewhere); None: always.
        trains: set for a training stage (see :class:`Trains`).
    """

    name: str
    run: Callable[[RunConfig, bool], StageResult]
    sections: tuple[str, ...]
    upstream: tuple[str, ...] = ()
    headline: tuple[str, ...] = ()
    help: str = ""
    ignore: tuple[str, ...] = ()
    stamp: Callable[[RunConfig], Any] | None = None
    enabled: Callable[[RunConfig], bool] | None = None
    trains: Trains | None = None

    def is_enabled(self, cfg: RunConfig) -> bool:
        return self.enabled is None or bool(self.enabled(cfg))
