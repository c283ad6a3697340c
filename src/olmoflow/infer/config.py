"""Config section of the generate stage (``generate``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from olmoflow.errors import OlmoflowError, unknown_name_error
from olmoflow.infer.sampling import SamplingParams, validate_sampling

# generate.speculative: off, or the drafter (olmoflow.infer.speculative).
SPECULATIVE = ("none", "prompt_lookup")


@dataclass
class GenerateConfig:
    """The ``generate`` stage: the prompts, and the sampling fields of :class:`SamplingParams`
    (same names and meanings; kept flat so ``generate.temperature=0.6`` stays the override).

    ``seed`` is the first prompt's seed: prompt ``i`` is sampled with ``seed + i``, so adding a
    prompt at the end leaves the earlier samples unchanged.

    ``speculative``: ``none`` or ``prompt_lookup`` (speculative decoding drafting up to
    ``num_draft_tokens`` tokens per step from the text itself, see
    :mod:`olmoflow.infer.speculative`): the same greedy tokens, the same sampling distribution.

    Raises:
        SamplingError: (an OlmoflowError) a sampling field out of range, named ``generate.<field>``.
        OlmoflowError: an unknown ``speculative`` (the closest name suggested), a
            ``num_draft_tokens`` < 1.
    """

    prompts: list[str] = field(
        default_factory=lambda: ["def fibonacci(n):", "import os\n", "class Stack:"]
    )
    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: int | None = 50
    top_p: float | None = 0.95
    repetition_penalty: float = 1.0
    seed: int = 0
    speculative: str = "none"
    num_draft_tokens: int = 10

    def __post_init__(self) -> None:
        validate_sampling(self, "generate")
        if self.speculative not in SPECULATIVE:
            raise unknown_name_error("generate.speculative", str(self.speculative), SPECULATIVE)
        n = self.num_draft_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise OlmoflowError(f"generate.num_draft_tokens must be an integer >= 1, got {n!r}")

    def speculative_kwargs(self) -> dict:
        """The ``Olmo.generate`` keywords of ``speculative`` (none when off)."""
        if self.speculative == "prompt_lookup":
            return {"prompt_lookup_num_tokens": self.num_draft_tokens, "return_stats": True}
        return {}

    def sampling(self, prompt_index: int = 0) -> SamplingParams:
        """The :class:`SamplingParams` for prompt number ``prompt_index`` (seed ``seed + i``)."""
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                              top_k=self.top_k, top_p=self.top_p,
                              repetition_penalty=self.repetition_penalty,
                              seed=self.seed + prompt_index)
