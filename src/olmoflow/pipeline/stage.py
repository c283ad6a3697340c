"""The record of a stage, and the table of them: everything about a stage, so that nothing else
(the runner, the readers of a run, the CLI) knows a stage by name.

A :class:`Stage` says where the stage writes and whether it makes a model (the fields of
:class:`olmoflow.run_dir.StagePlace`, which it extends: readers below ``pipeline/`` in the layer
order see that part, registered by the flow's table), which model it reads, which config it
depends on and how it runs. The stages that make a model, in table order, are the run's model
chain (see :mod:`olmoflow.pipeline.models`). A new stage is one record in the table
(:data:`olmoflow.pipeline.stages.STAGES`); its CLI verb comes from its name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from olmoflow.errors import unknown_name_error
from olmoflow.run_dir import Makes, StagePlace, register_flow

__all__ = ["FIRST_MODEL", "FINAL_MODEL", "PREVIOUS_MODEL", "Flag", "Makes", "Stage", "StageTable",
           "Trains", "flow"]

#: :attr:`Stage.reads`: the first model of the run's chain (the pretrained model).
FIRST_MODEL = "first model"
#: :attr:`Stage.reads`: the model the chain has made before this stage (a post-training base).
PREVIOUS_MODEL = "previous model"
#: :attr:`Stage.reads`: the model the run ends with (the last enabled stage of the chain).
FINAL_MODEL = "final model"
_READS = (FIRST_MODEL, PREVIOUS_MODEL, FINAL_MODEL)

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
        switch: the option takes no value and sets the key to true (``--git``).
    """

    option: str
    key: str
    help: str = ""
    type: Callable[[str], Any] = str
    repeat: bool = False
    forces_rerun: bool = False
    switch: bool = False

    @property
    def dest(self) -> str:
        """The argparse attribute the option's value lands in."""
        return self.option.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Stage(StagePlace):
    """One stage of the flow.

    Attributes:
        name: the CLI verb and its key in manifests and :class:`olmoflow.run_dir.RunDir`.
        directory: its directory under the run directory (keyword; default: its name).
        makes: set for a stage that makes a model (keyword; see :class:`~olmoflow.run_dir.Makes`).
        reads: the model of the chain it reads (keyword): :data:`FIRST_MODEL`,
            :data:`PREVIOUS_MODEL` or :data:`FINAL_MODEL`; empty: none. The stages that make
            that model are added to its ``upstream`` by the table (every earlier one for the
            previous or final model: which of them is enabled is the config's choice).
        run: ``(cfg, progress) -> StageResult``; writes only into the stage's directory.
        sections: dotted config keys (``"model"``, ``"train"``, ``"seed"``, ``"train.optimizer"``)
            whose resolved values its output depends on; they are part of its fingerprint.
        upstream: stages whose manifests (fingerprint and outputs) are part of its fingerprint;
            each comes before it in the table (the model stages ``reads`` names are added).
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
        finish: ``(cfg) -> None``, run by the runner on rank 0 once the stage is complete (ran,
            resumed or skipped), its manifest written: a step over the finished output, which
            must leave a finished one as it is (the release's git repository); None: none.
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
    finish: Callable[[RunConfig], None] | None = None
    reads: str = field(default="", kw_only=True)

    def is_enabled(self, cfg: RunConfig) -> bool:
        """Whether this stage is part of the run ``cfg`` (see ``enabled``)."""
        return self.enabled is None or bool(self.enabled(cfg))


def _with_models(stage: Stage, earlier: list[Stage]) -> tuple[str, ...]:
    """``stage.upstream`` with the model stages among ``earlier`` that its ``reads`` names put
    first (once each), in table order.

    Raises:
        ValueError: ``reads`` is not one of the three, or no earlier stage makes a model.
    """
    if stage.reads not in _READS:
        raise ValueError(f"stage '{stage.name}': reads='{stage.reads}' is none of {_READS}")
    models = [s.name for s in earlier if s.makes is not None]
    if not models:
        raise ValueError(f"stage '{stage.name}' reads the {stage.reads} but no earlier stage "
                         "makes a model")
    chosen = models[:1] if stage.reads == FIRST_MODEL else models
    return tuple(dict.fromkeys([*chosen, *stage.upstream]))


class StageTable:
    """The stages of a flow in run order, looked up by name.

    Raises (on construction):
        ValueError: two stages of one name, or a stage whose upstream is not an earlier stage
            (a mistake in the table, not in the user's input).
    """

    def __init__(self, stages: Iterable[Stage]) -> None:
        out: list[Stage] = []
        seen: set[str] = set()
        for s in stages:
            if s.name in seen:
                raise ValueError(f"two stages named '{s.name}'")
            if s.reads:
                s = replace(s, upstream=_with_models(s, out))
            missing = [u for u in s.upstream if u not in seen]
            if missing:
                raise ValueError(f"stage '{s.name}': upstream {missing} must be earlier stages")
            seen.add(s.name)
            out.append(s)
        self._stages: tuple[Stage, ...] = tuple(out)
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

    def ancestors(self, name: str) -> list[str]:
        """Every stage that stage ``name`` is made from (its upstream, theirs, ...), in run
        order.

        Raises:
            OlmoflowError: ``name`` is no stage.
        """
        todo, found = list(self[name].upstream), set()
        while todo:
            up = todo.pop()
            if up not in found:
                found.add(up)
                todo.extend(self[up].upstream)
        return [n for n in self.names if n in found]

    def models(self) -> list[Stage]:
        """The stages that make a model (the model chain, enabled or not), in run order."""
        return [s for s in self._stages if s.makes is not None]

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


# The flow's table (olmoflow.pipeline.stages.STAGES), set when it is built.
_FLOW: StageTable | None = None


def register_flow_table(table: StageTable) -> StageTable:
    """Make ``table`` the flow's: the one :func:`flow` returns and whose directories and model
    chain every :class:`~olmoflow.run_dir.RunDir` knows. Returns ``table``."""
    global _FLOW
    register_flow(table)
    _FLOW = table
    return table


def flow() -> StageTable:
    """The flow's table of stages (:data:`olmoflow.pipeline.stages.STAGES`), for the stage
    functions that ask about other stages (the model chain) without importing the table that
    holds them.

    Raises:
        RuntimeError: the table is not built yet (``olmoflow.pipeline.stages`` not imported).
    """
    if _FLOW is None:
        raise RuntimeError("the flow's table of stages is not built; import "
                           "olmoflow.pipeline.stages first")
    return _FLOW
