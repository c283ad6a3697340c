"""The server's safety limits, in a module of their own so the ``serve`` command's flags can
read the defaults without importing the HTTP stack."""

from __future__ import annotations

from dataclasses import dataclass

MAX_N = 16  # choices per request (OpenAI has no documented cap; vLLM none by default)


@dataclass(frozen=True)
class Limits:
    """The server's safety limits (``olmoflow serve`` flags in brackets).

    Attributes:
        max_body_bytes: largest request body in bytes; beyond: 413 [``--max-body-bytes``].
        max_tokens: largest ``max_tokens`` a request may ask for (also capped by the context
            window); the chat default is ``min(max_tokens, window - prompt)`` [``--max-tokens``].
        max_n: largest ``n`` [``--max-n``].
        max_batch: sequences decoded together by the engine [``--max-batch``].
        max_queue: requests waiting for a slot; a request beyond is answered 429 with
            ``Retry-After`` [``--max-queue``].
        max_prompts: prompts in one ``/v1/completions`` request (a list of prompts).
        retry_after: seconds to tell a client answered 429 to wait.
    """

    max_body_bytes: int = 1 << 20
    max_tokens: int = 2048
    max_n: int = MAX_N
    max_batch: int = 32
    max_queue: int = 256
    max_prompts: int = 64
    retry_after: int = 1
