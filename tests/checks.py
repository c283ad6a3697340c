"""Assertions and stand-ins shared by the tests: what the project leaves on disk, what the CLI
prints on bad input, and scripted terminal input."""

from __future__ import annotations

import hashlib
from pathlib import Path


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (hidden ones too) -> the sha256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def one_line_error(capsys) -> str:
    """The CLI's error on stderr, asserted to be one ``olmoflow: error:`` line, no traceback."""
    err = capsys.readouterr().err.strip()
    assert err.startswith("olmoflow: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def exits_with_one_line(rc: int, err: str, *fragments: str) -> None:
    """``rc`` is 2 and ``err`` one ``olmoflow: error:`` line holding every fragment."""
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("olmoflow: error: "), err
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def scripted_input(lines):
    """An ``input()`` stand-in that answers each prompt with the next of ``lines``, then raises
    EOFError (the user pressed Ctrl-D)."""
    it = iter(lines)

    def input_fn(prompt):
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None
    return input_fn


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``olmoflow ARGV`` in this process: ``(exit status, stdout, stderr)``."""
    from olmoflow.cli import main

    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err
