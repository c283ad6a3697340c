"""Config section of evaluation (``evaluate``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EvalConfig:
    """Held-out evaluation: loss, perplexity and bits-per-byte over at most ``max_tokens`` tokens
    (None: the whole held-out split), in batches of ``batch_size`` windows of ``sequence_length``
    tokens (None: ``train.sequence_length``)."""

    max_tokens: int | None = 200_000
    batch_size: int = 8
    sequence_length: int | None = None
