"""Learning-rate schedules as pure functions of the step (so a resumed run gets the same lr).

``cosine``: linear warmup then cosine decay to ``min_lr_ratio * lr`` at ``max_steps`` (OLMo 2).
``linear``: linear warmup then linear decay to ``min_lr_ratio * lr``.
``wsd``: warmup-stable-decay (Hu et al. 2024, MiniCPM): warmup, constant, and a linear decay over
the last 20% of the steps.
"""

from __future__ import annotations

import math

from olmoflow.errors import OlmoflowError
from olmoflow.train.config import SCHEDULES

__all__ = ["SCHEDULES", "lr_at"]


def lr_at(step: int, *, lr: float, warmup_steps: int, max_steps: int, min_lr_ratio: float = 0.1,
          schedule: str = "cosine", decay_fraction: float = 0.2) -> float:
    """The learning rate for optimizer step ``step`` (0-based).

    Raises:
        OlmoflowError: unknown schedule name.
    """
    if schedule not in SCHEDULES:
        raise OlmoflowError(f"unknown train.schedule.type '{schedule}'; valid: "
                            f"{', '.join(SCHEDULES)}")
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    floor = lr * min_lr_ratio
    if schedule == "wsd":
        decay_start = max(warmup_steps, int(max_steps * (1 - decay_fraction)))
        if step < decay_start:
            return lr
        frac = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
        return lr - (lr - floor) * frac
    frac = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == "linear":
        return lr - (lr - floor) * frac
    return floor + 0.5 * (lr - floor) * (1 + math.cos(math.pi * frac))
