"""User-facing errors.

Anything the user can fix (a bad path, a bad config key, malformed data under ``--strict``) is
raised as :class:`OlmoflowError`. The CLI prints its message on one line and exits with status 2;
every other exception is a bug in olmoflow and keeps its traceback.
"""

from __future__ import annotations

import difflib
import signal
from collections.abc import Iterable


class OlmoflowError(Exception):
    """An error caused by the user's input; the message is one line that names the problem."""


class Terminated(KeyboardInterrupt):
    """A run stopped by SIGTERM (``kill``, Slurm's ``scancel`` or its time limit, torchrun passing
    either on) after saving, as Ctrl-C stops one; the CLI exits with ``128 + signum`` (143)."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signum)
        self.signum = signum


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """Return the candidate closest to ``name`` (difflib ratio >= 0.5), or None."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return matches[0] if matches else None


def unknown_name_error(kind: str, name: str, candidates: Iterable[str]) -> OlmoflowError:
    """Build the error for an unknown key/choice, suggesting the closest valid one."""
    candidates = sorted(candidates)
    hint = closest(name, candidates)
    msg = f"unknown {kind} '{name}'"
    msg += f"; did you mean '{hint}'?" if hint else f"; valid: {', '.join(candidates)}"
    return OlmoflowError(msg)
