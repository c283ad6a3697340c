"""The run's model chain, derived from the stage records: the stages that make a model
(:attr:`~olmoflow.pipeline.stage.Stage.makes`), in table order, of which the config enables some
(pretraining always; a post-training stage when its data is named), and the model each stage
that reads one gets (:attr:`~olmoflow.pipeline.stage.Stage.reads`).

Ask these instead of naming a stage: :func:`final_model_stage` is the model the run ends with
(the release ships it), :func:`model_read_by` the one a stage's record says it reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from olmoflow.pipeline.stage import FINAL_MODEL, FIRST_MODEL, PREVIOUS_MODEL, Stage, flow

if TYPE_CHECKING:
    from olmoflow.pipeline.config import RunConfig


def model_chain(cfg: RunConfig) -> list[Stage]:
    """The stages that make a model in the run ``cfg``, in order (``[pretrain, sft, dpo]``):
    each starts from the final checkpoint of the one before it, unless its ``base`` says
    otherwise."""
    return [s for s in flow().models() if s.is_enabled(cfg)]


def first_model_stage(cfg: RunConfig) -> str:
    """The first stage of the chain: the one that makes the pretrained model."""
    return model_chain(cfg)[0].name


def final_model_stage(cfg: RunConfig) -> str:
    """The stage whose final checkpoint is the model the run ends with (the release's)."""
    return model_chain(cfg)[-1].name


def previous_model_stage(cfg: RunConfig, name: str) -> str:
    """The last stage of the chain before stage ``name`` (a post-training stage's default base).

    Raises:
        OlmoflowError: ``name`` is no stage.
        ValueError: no stage before ``name`` makes a model (a mistake in the table).
    """
    table = flow()
    at = table.names.index(table[name].name)
    before = [s.name for s in model_chain(cfg) if table.names.index(s.name) < at]
    if not before:
        raise ValueError(f"no stage before '{name}' makes a model")
    return before[-1]


def model_read_by(cfg: RunConfig, name: str) -> str:
    """The model stage whose final checkpoint stage ``name`` reads, as its record's ``reads``
    says: the first, the previous or the final model of the chain.

    Raises:
        OlmoflowError: ``name`` is no stage.
        ValueError: the stage reads no model.
    """
    reads = flow()[name].reads
    if reads == FIRST_MODEL:
        return first_model_stage(cfg)
    if reads == PREVIOUS_MODEL:
        return previous_model_stage(cfg, name)
    if reads == FINAL_MODEL:
        return final_model_stage(cfg)
    raise ValueError(f"stage '{name}' reads no model")
