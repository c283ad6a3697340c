"""Config section of evaluation (``evaluate``)."""

from __future__ import annotations

from dataclasses import dataclass

from olmoflow.errors import OlmoflowError


@dataclass
class EvalConfig:
    """Held-out evaluation: loss, perplexity and bits-per-byte over at most ``max_tokens`` target
    tokens (None: the whole held-out split), every target scored once, in batches of
    ``batch_size`` windows of ``sequence_length`` tokens (None: ``train.sequence_length``).

    ``stride`` (None: disjoint windows) makes the evaluation sliding: each window after the first
    scores the next ``stride`` targets with the ``sequence_length - stride`` tokens before them as
    extra context, as lm-eval's ``loglikelihood_rolling`` and Hugging Face's fixed-length
    perplexity guide do (see :mod:`olmoflow.eval.perplexity`); it costs about
    ``sequence_length / stride`` times the compute.
    """

    max_tokens: int | None = 200_000
    batch_size: int = 8
    sequence_length: int | None = None
    stride: int | None = None

    def __post_init__(self) -> None:
        for key in ("max_tokens", "batch_size", "sequence_length", "stride"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise OlmoflowError(f"evaluate.{key}={value} must be >= 1")
        if self.stride is not None and self.sequence_length is not None \
                and self.stride > self.sequence_length:
            raise OlmoflowError(f"evaluate.stride={self.stride} exceeds "
                                f"evaluate.sequence_length={self.sequence_length}")
