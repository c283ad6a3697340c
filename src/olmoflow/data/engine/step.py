"""The record of a data engine step: everything the runner needs to know about it.

The runner (:class:`olmoflow.data.engine.Engine`) knows no step by name: it runs records in the
order of their table (:data:`olmoflow.data.engine.steps.STEPS`), each through the one skip /
fingerprint / manifest rule (:func:`olmoflow.recorded.run_recorded`), as the flow's runner does
with its ``Stage`` records (datatrove's executor, likewise, runs a list of step objects).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from olmoflow.artifacts import StageResult

if TYPE_CHECKING:
    from olmoflow.data.config import DataConfig


class EngineView(Protocol):
    """What a step's functions use of the engine that runs them
    (:class:`olmoflow.data.engine.Engine`, which imports the steps: stated here as a protocol, so
    the steps do not need the runner's module)."""

    cfg: DataConfig
    root: Path
    progress: bool
    force: bool

    def step_dir(self, step: str) -> Path:
        """The directory ``step`` writes (and holds its manifest)."""
        ...

    def shards(self, step: str) -> list[dict[str, str]]:
        """The shards a finished step wrote, in order: ``[{"source", "path"}]``."""
        ...

    def run_jobs(self, step: str, fn: Callable, tasks: list[dict[str, Any]], *,
                 phase: str = "", workers: int | None = None) -> list[dict[str, Any]]:
        """Run ``fn`` over ``tasks`` with the run's executor and done-markers."""
        ...


@dataclass(frozen=True)
class Step:
    """One step of the data engine.

    Attributes:
        name: the step's name (``olmoflow data NAME``, the config's ``steps`` list).
        directory: where it writes, relative to the data run directory; its manifest lies there.
        upstream: the steps whose outputs it reads: their fingerprints are part of its own.
        section: ``section(engine) -> plain data``: the part of the config it depends on
            (fingerprinted, and saved in its manifest).
        run: ``run(engine) -> (StageResult, extra)``; ``extra`` goes into its manifest
            (``shards``: the files it wrote, with their source; ``errors``: examples of bad input).
        preflight: ``preflight(engine)`` checks what its section names (files, plugins, sources)
            before any step of the run starts; raises :class:`~olmoflow.errors.OlmoflowError`.
        work_dir: its intermediate files (hashes, an index, its own markers), deleted by
            ``--force``.
        part_of: for a step that makes what another step uses (the tokenizer, the quality
            classifier): that step's name. It runs, when ``enabled``, just before it, is not
            listed in ``steps`` nor in the summary, and is forced with it.
        enabled: ``enabled(cfg) -> bool``: whether a ``part_of`` step has work to do.
    """

    name: str
    directory: str
    upstream: tuple[str, ...]
    section: Callable[[EngineView], Any]
    run: Callable[[EngineView], tuple[StageResult, dict[str, Any]]]
    preflight: Callable[[EngineView], None] | None = None
    work_dir: str | None = None
    part_of: str | None = None
    enabled: Callable[[DataConfig], bool] | None = None
