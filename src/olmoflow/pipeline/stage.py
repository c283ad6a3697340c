"""The record of a stage, and the table of them: everything the runner needs to know about a
stage, so that the runner itself knows no stage by name.

A new stage (evaluation across checkpoints, sft, dpo, rl, a release tool) is one :class:`Stage`
entry in the table (:data:`olmoflow.pipeline.stages.STAGES`); its directory comes from
:class:`olmoflow.run_dir.RunDir` (a directory named after the stage unless that table says
otherwise), its CLI verb from its name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from olmoflow.errors import unknown_name_error

if TYPE_CHECKING:
    from olmoflow.artifacts import StageResult
    from olmoflow.pipeline.config import RunConfig


@dataclass(frozen=True)
class Trains:
    """What a training stage adds: it resumes from its checkpoints, runs on every rank under
    torchrun, and its checkpoints are never deleted implicitly. ``resume_key`` is the dotted config
    key of its ``resume_from`` (``train.checkpoint.resume_from``); ``resume_alias`` a shorter key
    the config also reads as it (``resume_from``, OLMo's spelling), named in messages."""

    resume_key: str
    resume_alias: str = ""


@dataclass(frozen=True)
class Flag:
    """A command-line option of a stage's verb that sets a config key (``olmoflow generate
    --prompt TEXT`` sets ``generate.prompts``).

    Attributes:
        option: the option as typed, ``--prompt``.
        key: the dotted config key it sets.
        help: one line for ``--help``.
        type: the argparse converter of its value (``str``, ``int``).
        repeat: the option may be given several times; the key gets the list.
        forces_rerun: giving it reruns the stage even when it is complete.
    """

    option: str
    key: str
    help: str = ""
    type: Callable[[str], Any] = str
    repeat: bool = False
    forces_rerun: bool = False

    @property
    def dest(self) -> str:
        """The argparse attribute the option's value lands in."""
        return self.option.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Stage:
    """One stage of the flow.

    Attributes:
        name: the CLI verb and the key of its directory in :class:`olmoflow.run_dir.RunDir`.
        run: ``(cfg, progress) -> StageResult``; writes only into the stage's directory.
        sections: dotted config keys (``"model"``, ``"train"``, ``"seed"``, ``"train.optimizer"``)
            whose resolved values its output depends on; they are part of its fingerprint.
        upstream: stages whose manifests (fingerprint and outputs) are part of its fingerprint;
            each comes before it in the table.
        headline: count keys printed after it runs and in the summary table.
        help: one line for ``olmoflow --help``.
        ignore: bookkeeping keys, dotted, left out of the fingerprint because they change how a run
            is kept or logged, not what it makes (``train.log.interval``).
        stamp: extra fingerprint input computed from the config (collect: the content hash of
            every source file).
        enabled: whether the stage is part of this run (data stages are not when ``train.data``
            names a tokens directory made elsewhere); None: always.
        trains: set for a training stage (see :class:`Trains`).
        flags: command-line options of the stage's verb (see :class:`Flag`).
        show: prints what the stage made for the user after ``olmoflow run`` or its own verb
            (generate: the samples); None: nothing beyond the summary line.
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
    flags: tuple[Flag, ...] = ()
    show: Callable[[RunConfig], None] | None = None

    def is_enabled(self, cfg: RunConfig) -> bool:
        """Whether this stage is part of the run ``cfg`` (see ``enabled``)."""
        return self.enabled is None or bool(self.enabled(cfg))


class StageTable:
    """The stages of a flow in run order, looked up by name.

    Raises (on construction):
        ValueError: two stages of one name, or a stage whose upstream is not an earlier stage
            (a mistake in the table, not in the user's input).
    """

    def __init__(self, stages: Iterable[Stage]) -> None:
        self._stages: tuple[Stage, ...] = tuple(stages)
        seen: set[str] = set()
        for s in self._stages:
            if s.name in seen:
                raise ValueError(f"two stages named '{s.name}'")
            missing = [u for u in s.upstream if u not in seen]
            if missing:
                raise ValueError(f"stage '{s.name}': upstream {missing} must be earlier stages")
            seen.add(s.name)
        self._by_name = {s.name: s for s in self._stages}

    def __iter__(self) -> Iterator[Stage]:
        return iter(self._stages)

    def __len__(self) -> int:
        return len(self._stages)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> Stage:
        """The stage ``name``.

        Raises:
            OlmoflowError: no such stage (naming the closest one).
        """
        try:
            return self._by_name[name]
        except KeyError:
            raise unknown_name_error("stage", name, self._by_name) from None

    @property
    def names(self) -> list[str]:
        """The stage names, in run order."""
        return [s.name for s in self._stages]

    def enabled(self, cfg: RunConfig) -> list[Stage]:
        """The stages that are part of the run ``cfg``, in run order."""
        return [s for s in self._stages if s.is_enabled(cfg)]

    def with_stage(self, stage: Stage, *, after: str | None = None) -> StageTable:
        """A new table with ``stage`` added after stage ``after`` (default: last); this table is
        unchanged.

        Raises:
            OlmoflowError: ``after`` is no stage.
            ValueError: ``stage`` has the name of a stage in the table, or an upstream that does
                not come before it.
        """
        stages = list(self._stages)
        at = len(stages) if after is None else stages.index(self[after]) + 1
        return StageTable(stages[:at] + [stage] + stages[at:])
