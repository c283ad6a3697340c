"""Config section of the generate stage (``generate``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from olmoflow.infer.sampling import SamplingParams, validate_sampling


@dataclass
class GenerateConfig:
    """The ``generate`` stage: the prompts, and the sampling fields of :class:`SamplingParams`
    (same names and meanings; kept flat so ``generate.temperature=0.6`` stays the override).

    ``seed`` is the first prompt's seed: prompt ``i`` is sampled with ``seed + i``, so adding a
    prompt at the end leaves the earlier samples unchanged.

    Raises:
        SamplingError: (an OlmoflowError) a sampling field out of range, named ``generate.<field>``.
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

    def __post_init__(self) -> None:
        validate_sampling(self, "generate")

    def sampling(self, prompt_index: int = 0) -> SamplingParams:
        """The :class:`SamplingParams` for prompt number ``prompt_index`` (seed ``seed + i``)."""
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                              top_k=self.top_k, top_p=self.top_p,
                              repetition_penalty=self.repetition_penalty,
                              seed=self.seed + prompt_index)
