"""What the data engine's runner and its steps share: summing shard stats into a step's counts,
error examples, shard lists and the expansion of source paths."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

from olmoflow.data.executor import sum_stats
from olmoflow.errors import OlmoflowError

MAX_ERROR_EXAMPLES = 20


def step_stats(tasks: list[dict[str, Any]], results: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest counts of a step: totals (:func:`sum_stats`), ``sources`` (the same per
    ``task["source"]``), ``shards``, and ``errors`` as a count (examples go in the manifest's
    ``errors`` field)."""
    total = sum_stats(results)
    by_source: dict[str, list[dict[str, Any]]] = {}
    for t, r in zip(tasks, results):
        by_source.setdefault(t.get("source", ""), []).append(r)
    total["sources"] = {}
    for s, rs in sorted(by_source.items()):
        st = sum_stats(rs)
        st["errors"] = error_count(rs)
        total["sources"][s] = st
    total["shards"] = len(results)
    total["errors"] = error_count(results)
    return total


def error_count(results: list[dict[str, Any]]) -> int:
    """Bad input lines the shards saw. A shard that reports ``error_counts`` (by kind) lists only
    the first few examples in ``errors``, so its count comes from there, not from the list."""
    n = 0
    for r in results:
        counts = r.get("error_counts")
        n += sum(counts.values()) if isinstance(counts, dict) else len(r.get("errors") or [])
    return n


def error_examples(results: list[dict[str, Any]]) -> list[Any]:
    """The first few errors the shards reported (``file:line: reason``), for the manifest."""
    out: list[Any] = []
    for r in results:
        out.extend(r.get("errors") or [])
        if len(out) >= MAX_ERROR_EXAMPLES:
            break
    return out[:MAX_ERROR_EXAMPLES]


def relative_shards(base: Path, tasks: list[dict[str, Any]], key: str = "output"
                    ) -> list[dict[str, str]]:
    """``[{"source", "path"}]`` of task outputs, relative to ``base`` (the step's directory)."""
    return [{"source": t["source"], "path": Path(t[key]).relative_to(base).as_posix()}
            for t in tasks]


def expand_paths(entries: list[str]) -> list[str]:
    """Files named by ``entries`` (files, directories, globs; ``stdlib`` and ``hf://`` kept as
    they are), sorted within each entry, as absolute paths.

    Raises:
        OlmoflowError: an entry that matches nothing.
    """
    out: list[str] = []
    for e in entries:
        if e == "stdlib" or e.startswith("hf://"):
            out.append(e)
            continue
        p = Path(e).expanduser()
        if p.is_dir():
            found = sorted(str(f.resolve()) for f in p.rglob("*")
                           if f.is_file() and not f.name.startswith("."))
        elif p.is_file():
            found = [str(p.resolve())]
        else:
            found = sorted(str(Path(f).resolve()) for f in glob.glob(e, recursive=True)
                           if Path(f).is_file())
        if not found:
            raise OlmoflowError(f"source path '{e}' matches no file")
        out.extend(found)
    return out
