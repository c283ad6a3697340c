"""Config section of the generate stage (``generate``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerateConfig:
    """Sampling for the ``generate`` stage."""

    prompts: list[str] = field(
        default_factory=lambda: ["def fibonacci(n):", "import os\n", "class Stack:"]
    )
    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: int | None = 50
    top_p: float | None = 0.95
    repetition_penalty: float = 1.0
    seed: int = 0
