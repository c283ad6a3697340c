"""Checkpoint directory names as OLMo's (``stage1-step1000-tokens5B``) and listing them."""

from __future__ import annotations

import re
from pathlib import Path

TRAINER_STATE = "trainer_state.pt"
# "{stage}-step{N}-tokens{T}" (the stage may itself contain hyphens) or the older "stepN".
_NAME = re.compile(r"^(?:(?P<stage>.+)-)?step(?P<step>\d+)(?:-tokens(?P<tokens>\d+[KMB]?))?$")
_UNITS = (("B", 10**9), ("M", 10**6), ("K", 10**3))


def format_tokens(tokens: int) -> str:
    """Token count for a checkpoint name: the largest unit of K=1e3, M=1e6, B=1e9 that is at most
    ``tokens``, rounded UP to a whole number of it, as OLMo 2's published checkpoints do in B
    (step 1000 x 4,194,304 tokens = 4.19B -> ``tokens5B``; 3.895T -> ``tokens3896B``); below
    1000, the exact count. Names stay unique because the step is in them too.

    >>> format_tokens(640), format_tokens(5120), format_tokens(4_194_304_000)
    ('640', '6K', '5B')
    """
    for unit, size in _UNITS:
        if tokens >= size:
            return f"{-(-tokens // size)}{unit}"
    return str(tokens)


def checkpoint_name(stage: str, step: int, tokens: int) -> str:
    """``{stage}-step{step}-tokens{format_tokens(tokens)}``, e.g. ``stage1-step1000-tokens5B``."""
    return f"{stage}-step{step}-tokens{format_tokens(tokens)}"


def parse_checkpoint_name(name: str) -> int | None:
    """The step of a checkpoint directory name (new ``stage1-step10-tokens6K`` or old ``step10``
    form), or None when ``name`` is not one."""
    m = _NAME.match(name)
    return int(m["step"]) if m else None


def list_checkpoints(save_folder: Path) -> list[Path]:
    """The complete checkpoint directories in ``save_folder`` (either name form), oldest first."""
    save_folder = Path(save_folder)
    if not save_folder.is_dir():
        return []
    found = [(step, p) for p in save_folder.iterdir()
             if (step := parse_checkpoint_name(p.name)) is not None
             and (p / TRAINER_STATE).is_file()]
    return [p for _, p in sorted(found, key=lambda sp: (sp[0], sp[1].name))]
