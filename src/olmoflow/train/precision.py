"""Mixed precision: which autocast dtype ``train.precision`` means on a device."""

from __future__ import annotations

import torch


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``train.precision`` on ``device``: ``bf16`` -> bfloat16; ``auto`` ->
    bfloat16 on CUDA, none (fp32) elsewhere; ``fp32`` -> none. Weights stay fp32 either way."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None
