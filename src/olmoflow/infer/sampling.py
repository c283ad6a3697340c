"""One description of how to sample: :class:`SamplingParams`.

Every caller that samples from a model takes one of these: :func:`olmoflow.infer.generate.generate`
(``sampling=``), the ``generate`` stage (built from its config section), and later evaluation
(``generate_until``), serving and RL rollouts. The fields follow vLLM's ``SamplingParams``
(``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``, ``seed``, ``stop``) with
Hugging Face ``GenerationConfig``'s ``max_new_tokens``; sampling is on exactly when
``temperature > 0`` (vLLM's rule), so there is no separate ``do_sample`` flag to disagree with it.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from olmoflow.errors import OlmoflowError


class SamplingError(OlmoflowError, ValueError):
    """Invalid sampling settings. A :class:`ValueError` too, as ``transformers``' ``generate``
    raises for the same mistakes, so Python callers catching either keep working."""


def _is_int(v: Any) -> bool:
    # numbers.Integral admits numpy integers too; a bool is an int to Python but never meant here.
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def validate_sampling(settings: Any, prefix: str) -> None:
    """Check the sampling fields of ``settings`` (a :class:`SamplingParams` or any object with the
    same attribute names, such as the ``generate`` config section; a missing ``stop`` counts as
    none). ``prefix`` names the owner in messages (``generate.temperature must be >= 0, got -1``).

    Raises:
        SamplingError: the first field out of range, in one line.
    """
    def bad(field: str, rule: str) -> SamplingError:
        return SamplingError(f"{prefix}.{field} {rule}, got {getattr(settings, field)!r}")

    if not _is_int(settings.max_new_tokens) or settings.max_new_tokens < 0:
        raise bad("max_new_tokens", "must be >= 0 (an integer)")
    if not _is_number(settings.temperature) or settings.temperature < 0:
        raise bad("temperature", "must be >= 0 (0 is greedy decoding)")
    if settings.top_k is not None and (not _is_int(settings.top_k) or settings.top_k < 0):
        raise bad("top_k", "must be None/null or an integer >= 0 (0 or None: no top-k)")
    if settings.top_p is not None and (
        not _is_number(settings.top_p) or not 0 < settings.top_p <= 1
    ):
        raise bad("top_p", "must be None/null or in (0, 1] (1 or None: no top-p)")
    if not _is_number(settings.repetition_penalty) or settings.repetition_penalty <= 0:
        raise bad("repetition_penalty", "must be > 0 (1.0 is off)")
    if settings.seed is not None and not _is_int(settings.seed):
        raise bad("seed", "must be None/null or an integer")
    stop = getattr(settings, "stop", ())
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", "must be a list of non-empty strings")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token; immutable, so one instance can be shared between requests.

    The defaults are greedy decoding of 20 new tokens, as ``transformers``' ``generate`` without
    arguments (vLLM defaults to ``temperature=1.0``). Field names and meanings follow vLLM's
    ``SamplingParams`` and Hugging Face's ``GenerationConfig``.

    Attributes:
        max_new_tokens: tokens to add after the prompt (at most; EOS and stop strings end early).
        temperature: logits are divided by it before sampling; 0 means greedy (argmax) decoding.
        top_k: sample among the ``top_k`` most likely tokens only; None or 0 keeps all.
        top_p: nucleus sampling (Holtzman et al. 2020): the smallest set of most likely tokens
            whose mass reaches ``top_p``, the crossing token included; None or 1 keeps all.
        repetition_penalty: CTRL penalty (Keskar et al. 2019, as ``transformers``) on every token
            already in the prompt or the continuation; applies to greedy decoding too. 1.0 is off.
        seed: seeds a private generator, so sampling is reproducible and leaves the global torch
            RNG alone; None draws from a fresh unseeded generator.
        stop: a row stops once its decoded continuation contains one of these strings (kept in the
            output, as ``transformers``' ``stop_strings``); needs a tokenizer at generation time.
    Raises:
        SamplingError: (an :class:`OlmoflowError` and a :class:`ValueError`) a field out of range,
            named in one line.
    """

    max_new_tokens: int = 20
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.stop, str) and isinstance(self.stop, Sequence):
            # A list from YAML or a caller; stored as a tuple so the instance stays hashable.
            object.__setattr__(self, "stop", tuple(self.stop))
        validate_sampling(self, "SamplingParams")

    @property
    def do_sample(self) -> bool:
        """Whether tokens are drawn at random (``temperature > 0``) rather than by argmax."""
        return self.temperature > 0

    @classmethod
    def from_hf_kwargs(
        cls, *, max_new_tokens: int = 20, do_sample: bool = False, temperature: float = 1.0,
        top_k: int | None = None, top_p: float | None = None, repetition_penalty: float = 1.0,
        seed: int | None = None, stop_strings: Sequence[str] | None = None,
    ) -> SamplingParams:
        """The settings meant by ``transformers``-style ``generate`` keywords (defaults as there):
        ``do_sample=False`` is greedy whatever the temperature, and ``temperature=0`` is greedy
        too. ``temperature`` is checked even when unused.

        Raises:
            SamplingError: a value out of range.
        """
        params = cls(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                     top_p=top_p, repetition_penalty=repetition_penalty, seed=seed,
                     stop=tuple(s for s in (stop_strings or ()) if s))
        return params if do_sample else replace(params, temperature=0.0)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values (``stop`` as a list), e.g. for a manifest or a JSON reply."""
        d = asdict(self)
        d["stop"] = list(self.stop)
        return d
