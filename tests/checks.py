"""Assertions shared by the tests of what the project leaves on disk and prints on bad input."""

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
