"""Callbacks the :class:`~olmoflow.train.trainer.Trainer` runs inside its loop (in-loop
evaluation: held-out loss, a few tasks, samples)."""

from __future__ import annotations

from typing import Any


class Callback:
    """Runs every ``interval`` optimizer steps (0: never) after the step's update.

    :meth:`on_step` gets the trainer and the step just finished (1-based) and returns metrics
    (``{name: number}``) or None. The trainer logs them in that step's metrics line as
    ``eval/<name>``. It runs under ``torch.no_grad`` and a forked torch RNG, and the model is put
    back in train mode afterwards, so a callback does not change the training numbers. Under
    torchrun it runs on every rank (an evaluation may use collectives); only rank 0 logs.
    """

    def __init__(self, interval: int = 0):
        if interval < 0:
            raise ValueError(f"callback interval must be >= 0 (0: never), got {interval}")
        self.interval = interval

    def due(self, step: int) -> bool:
        """Whether the callback runs after optimizer step ``step``."""
        return self.interval > 0 and step % self.interval == 0

    def on_step(self, trainer: Any, step: int) -> dict[str, float] | None:
        """Do the work; return metrics to log (keys without the ``eval/`` prefix) or None."""
        return None
