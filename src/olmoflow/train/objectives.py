"""Training objectives: what the :class:`~olmoflow.train.trainer.Trainer` optimises.

The trainer owns the loop (gradient accumulation, clipping, the optimizer step, the schedule,
checkpoints, signals, distributed setup, logging); an objective owns what depends on the loss:

1. :meth:`Objective.prepare` turns what the data loader yields into a **batch**: a dict of tensors
   that all have the global batch as their leading dimension, so the trainer can take each
   rank's slice and cut micro-batches without knowing the fields (language modelling carries
   ``input_ids [B, T]``, ``labels [B, T]`` and, with intra-document masking, ``doc_ids [B, T]``;
   a preference pair could carry ``[B, 2, T]`` chosen/rejected ids and ``[B, 2]`` reference
   log-probabilities; a rollout batch ``[B, T]`` ids with ``[B]`` advantages).
2. :meth:`Objective.normalizer` returns the number every micro-batch loss is divided by, computed
   over the whole global batch (all-reduced across ranks), so that accumulating micro-batches
   gives the gradient of one big batch.
3. :meth:`Objective.loss` returns a micro-batch's loss (already divided by the normaliser; the
   trainer calls ``backward`` on it) and its metrics as floats; the trainer sums the metrics over
   micro-batches, averages them over ranks, and :meth:`Objective.step_metrics` turns the totals
   into the step's metrics, which must include ``loss`` (what skip-step and checkpoints record).
4. :meth:`Objective.state_dict` / :meth:`Objective.load_state_dict`: the objective's own state,
   saved in every checkpoint's trainer state and restored on resume. It must be plain data
   (tensors, numbers, strings, bools, None, and lists/dicts of them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from olmoflow.errors import OlmoflowError
from olmoflow.model.olmo import IGNORE_INDEX
from olmoflow.train import distributed

Batch = dict[str, torch.Tensor]


class Objective:
    """The seam between the training loop and a loss; subclass it (see the module docstring).

    ``name`` is recorded in checkpoints, so a run is never resumed under another objective.
    """

    name = "objective"

    def prepare(self, raw: Any) -> Batch:
        """The global batch as a dict of tensors with a leading batch dimension ``[B, ...]``."""
        raise NotImplementedError

    def num_tokens(self, batch: Batch) -> int:
        """Tokens this global batch consumes (counted in ``tokens`` and ``tokens_per_s``)."""
        return int(batch["input_ids"].numel())

    def normalizer(self, batch: Batch, dist: distributed.DistInfo) -> float:
        """What every micro-batch loss of this rank's slice ``batch`` is divided by.

        Under DDP/FSDP the ranks' gradients are averaged, so a global count must be divided by
        the world size to give the gradient of the whole batch."""
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, micro_batch: Batch,
             normalizer: float) -> tuple[torch.Tensor, dict[str, float]]:
        """``(loss, metrics)`` of one micro-batch (on the model's device, under autocast)."""
        raise NotImplementedError

    def step_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """The step's metrics from the summed micro-batch metrics; must contain ``loss``."""
        return dict(totals)

    def state_dict(self) -> dict[str, Any]:
        """The objective's own state for checkpoints (plain data only)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


class LMObjective(Objective):
    """Next-token prediction: cross-entropy on fp32 logits plus z-loss, summed over the target
    tokens of a micro-batch and divided by the global batch's count of target tokens (labels not
    ``IGNORE_INDEX``); the loss is computed inside :class:`~olmoflow.model.olmo.Olmo`.

    Metrics: ``loss`` = ``ce_loss`` + ``z_loss`` (means per target token over the global batch).
    """

    name = "lm"

    def prepare(self, raw: Any) -> Batch:
        """``input_ids``, ``labels`` (``[B, T]``) and ``doc_ids`` when present, from a loader
        :class:`~olmoflow.train.loader.Batch` or a mapping.

        Raises:
            OlmoflowError: no ``input_ids`` or ``labels``.
        """
        get = raw.get if isinstance(raw, Mapping) else (lambda k: getattr(raw, k, None))
        batch = {k: get(k) for k in ("input_ids", "labels", "doc_ids")}
        if batch["input_ids"] is None or batch["labels"] is None:
            raise OlmoflowError("a language-modelling batch needs input_ids and labels")
        return {k: v for k, v in batch.items() if v is not None}

    def normalizer(self, batch: Batch, dist: distributed.DistInfo) -> float:
        n_targets = distributed.all_reduce_sum(int((batch["labels"] != IGNORE_INDEX).sum()), dist)
        return n_targets / dist.world_size if dist.world_size > 1 else n_targets

    def loss(self, model: torch.nn.Module, micro_batch: Batch,
             normalizer: float) -> tuple[torch.Tensor, dict[str, float]]:
        docs = {"doc_ids": micro_batch["doc_ids"]} if "doc_ids" in micro_batch else {}
        out = model(micro_batch["input_ids"], micro_batch["labels"], loss_normalizer=normalizer,
                    **docs)
        return out.loss, {"ce_loss": out.ce_loss.item(), "z_loss": out.z_loss.item()}

    def step_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        ce, z = totals["ce_loss"], totals["z_loss"]
        return {"loss": ce + z, "ce_loss": ce, "z_loss": z}


def check_plain(value: Any, where: str = "objective state") -> None:
    """Raise :class:`OlmoflowError` unless ``value`` is plain checkpoint data: tensors, numbers,
    strings, bools, None, and lists/tuples/dicts (string keys) of them."""
    if value is None or isinstance(value, bool | int | float | str | torch.Tensor):
        return
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise OlmoflowError(f"{where} has a non-string key {k!r}")
            check_plain(v, f"{where}.{k}")
        return
    raise OlmoflowError(f"{where} holds a {type(value).__name__}; a checkpoint keeps only tensors, "
                        "numbers, strings and lists/dicts of them")
