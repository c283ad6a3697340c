"""Tasks x checkpoints: which checkpoints to score, and a cache so a rerun scores only what is new.

Each (checkpoint, task) result is a JSON file under the cache folder, named by the sha256 of
everything that makes the number: the checkpoint's content hash (the sha256 of its
``checksums.json``, which records the sha256 of every file it holds, so it costs one small read),
the tokenizer's content hash, the task name, ``EvalSettings.key()``, the data files' signature
(:func:`data_signature`: paths, sizes and modification times), the
model's context length (``max_length``) and :data:`CACHE_VERSION`. Renaming or moving a
checkpoint keeps its results; retraining it (other weights) does not.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from olmoflow.artifacts import atomic_write_json, data_files, sha256_file, sha256_json
from olmoflow.errors import OlmoflowError
from olmoflow.eval.lm import LanguageModel
from olmoflow.eval.spec import Resolved

#: bump when a change to the scorer or the result format makes cached results stale.
CACHE_VERSION = "olmoflow-eval-1"
#: the checksum file every olmoflow checkpoint carries (model/checkpoint_files.py)
CHECKSUMS = "checksums.json"


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint to score: its directory, step, tokens seen and content hash."""

    path: Path
    step: int
    tokens: int
    content_hash: str

    @property
    def name(self) -> str:
        return self.path.name


def content_hash(path: Path) -> str:
    """The sha256 of checkpoint ``path``'s ``checksums.json`` (which holds the sha256 of each of
    its files); for a checkpoint without one (older olmoflow), of its files' hashes."""
    path = Path(path)
    if (path / CHECKSUMS).is_file():
        return sha256_file(path / CHECKSUMS)
    return sha256_json([[f.relative_to(path).as_posix(), sha256_file(f)]
                        for f in data_files(path)])


def directory_hash(path: Path) -> str:
    """The sha256 of a directory's files (names and contents), e.g. a tokenizer's."""
    path = Path(path)
    return sha256_json([[f.relative_to(path).as_posix(), sha256_file(f)]
                        for f in data_files(path)])


def _describe(found: Sequence[Path]) -> str:
    names = [p.name for p in found]
    if len(names) > 8:
        names = names[:3] + [f"... ({len(names) - 6} more)"] + names[-3:]
    return ", ".join(names) or "none"


def select_checkpoints(folder: Path, which: str) -> list[Checkpoint]:
    """The checkpoints of training folder ``folder`` that ``which`` names, oldest first:
    ``latest`` (what the ``latest`` pointer names), ``all`` (every complete checkpoint), or a
    comma list of checkpoint names, ``stepN`` or bare step numbers.

    Raises:
        OlmoflowError: the folder has no checkpoint, or an entry names none (listing those kept).
    """
    from olmoflow.model.checkpoint_names import list_checkpoints, parse_checkpoint_name
    from olmoflow.train.checkpoint import resolve_checkpoint, step_and_tokens

    folder = Path(folder)
    found = list_checkpoints(folder)
    if not found:
        raise OlmoflowError(f"'{folder}' has no complete checkpoint to evaluate; run 'olmoflow "
                            "pretrain' first")
    if which == "latest":
        chosen = [resolve_checkpoint(folder, "latest")]
    elif which == "all":
        chosen = found
    else:
        chosen = []
        for entry in (e.strip() for e in which.split(",")):
            step = int(entry) if entry.isdigit() else parse_checkpoint_name(entry)
            match = [p for p in found if p.name == entry] or \
                [p for p in found if re.fullmatch(r"\d+|step\d+", entry)
                 and parse_checkpoint_name(p.name) == step]
            if not match:
                raise OlmoflowError(f"evaluate.checkpoints: no checkpoint '{entry}' in "
                                    f"'{folder}' (it has: {_describe(found)})")
            chosen.append(match[-1])
    out, seen = [], set()
    for p in chosen:
        if p.resolve() in seen:
            continue
        seen.add(p.resolve())
        step, tokens = step_and_tokens(p)
        out.append(Checkpoint(p, step, tokens, content_hash(p)))
    return sorted(out, key=lambda c: (c.step, c.name))


def cache_key(checkpoint_hash: str, resolved: Resolved, *, max_length: int,
              tokenizer_hash: str = "") -> str:
    """The cache file name (sha256 hex) of one (checkpoint, task, settings) result."""
    s = resolved.settings
    return sha256_json({
        "version": CACHE_VERSION, "checkpoint": checkpoint_hash, "tokenizer": tokenizer_hash,
        "task": resolved.name, "settings": s.key(),
        # where the data lives and what is there now: a file edited in place is scored again
        "data": [data_signature(s.path), data_signature(s.data_dir)],
        "max_length": max_length})


def data_signature(path: Path | None) -> list[Any] | None:
    """What identifies the data under ``path`` for the cache: its resolved path and, for the file
    or every file below the folder, (relative path, size, mtime in ns). Cheap (stat calls only,
    no reading); an edit changes the mtime, so a changed dataset is never served stale results.
    None for no path; a path that does not exist is just its name (the task will say so)."""
    if path is None:
        return None
    p = Path(path).expanduser()
    try:
        root = p.resolve()
        if root.is_file():
            st = root.stat()
            return [str(root), st.st_size, st.st_mtime_ns]
        files = sorted(f for f in root.rglob("*") if f.is_file())
        return [str(root)] + [[str(f.relative_to(root)), f.stat().st_size, f.stat().st_mtime_ns]
                              for f in files]
    except OSError:
        return [str(p)]


class ResultCache:
    """JSON results by key in ``folder`` (created on the first write); reads also look in the
    ``fallback`` folders (a previous output set aside while the stage runs again) and copy a hit
    into ``folder``, so what was kept stays kept."""

    def __init__(self, folder: Path, fallback: Sequence[Path] = ()):
        self.folder = Path(folder)
        self.fallback = [Path(f) for f in fallback]

    def get(self, key: str) -> dict[str, Any] | None:
        """The cached result of ``key``, or None (absent, unreadable, damaged or edited: its
        checksum or a field does not check out, so it is scored again)."""
        for folder in [self.folder, *self.fallback]:
            try:
                value = json.loads((folder / f"{key}.json").read_text(encoding="utf-8"))
            except (OSError, ValueError, RecursionError):
                continue
            if not _valid_row(value):
                continue
            value = {k: v for k, v in value.items() if k != _CHECK}
            if folder != self.folder:
                self.put(key, value)
            return value
        return None

    def put(self, key: str, value: dict[str, Any]) -> None:
        """Store ``value`` (a :func:`result_row`) under ``key``, with its checksum."""
        value = {k: v for k, v in value.items() if k != _CHECK}
        atomic_write_json(self.folder / f"{key}.json", {**value, _CHECK: sha256_json(value)})


#: the field of a cache file holding the sha256 of the rest (a damaged file fails it)
_CHECK = "sha256"
#: the fields a cached row must have and their types (the reports read every one)
_ROW_TYPES: dict[str, tuple[type, ...]] = {
    "version": (str,), "step": (int,), "tokens": (int,), "checkpoint": (str,), "task": (str,),
    "task_name": (str,), "primary_metric": (str,), "value": (int, float, type(None)),
    "stderr": (int, float, type(None)), "n": (int,), "chance": (int, float, type(None)),
    "higher_is_better": (bool,), "metrics": (dict,), "metrics_stderr": (dict,),
}


def _valid_row(value: Any) -> bool:
    """Whether ``value`` is an intact cached row of this :data:`CACHE_VERSION`."""
    if not isinstance(value, dict) or value.get("version") != CACHE_VERSION:
        return False
    rest = {k: v for k, v in value.items() if k != _CHECK}
    try:
        if value.get(_CHECK) != sha256_json(rest):
            return False
    except (TypeError, ValueError):
        return False
    for k, types in _ROW_TYPES.items():
        if k not in value or not isinstance(value[k], types) or (
                isinstance(value[k], bool) and bool not in types):
            return False
    return all(isinstance(v, int | float | type(None)) and not isinstance(v, bool)
               for d in (value["metrics"], value["metrics_stderr"]) for v in d.values())


def _finite(x: Any) -> Any:
    """NaN (a stderr of one example) as None, so the JSON is standard."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


def result_row(ckpt: Checkpoint, resolved: Resolved, result: Any, seconds: float) -> dict:
    """One row of ``results.jsonl`` from a :class:`~olmoflow.eval.task.TaskResult`."""
    from olmoflow.eval.registry import task_class

    cls = task_class(resolved.name)
    stderr = {k: _finite(v) for k, v in result.stderr.items()}
    return {"version": CACHE_VERSION, "step": ckpt.step, "tokens": ckpt.tokens,
            "checkpoint": ckpt.name, "task": resolved.label, "task_name": resolved.name,
            "primary_metric": result.primary_metric, "value": _finite(result.primary),
            "stderr": stderr.get(result.primary_metric), "n": result.n,
            "skipped": result.skipped, "chance": result.chance,
            "higher_is_better": bool(getattr(cls, "higher_is_better", True)),
            "metrics": {k: _finite(v) for k, v in result.metrics.items()},
            "metrics_stderr": stderr, "settings": resolved.settings.key(),
            "seconds": round(seconds, 3)}


def score_checkpoints(checkpoints: Sequence[Checkpoint], specs: Sequence[Resolved],
                      load: Callable[[Checkpoint], LanguageModel], cache: ResultCache, *,
                      max_length: int, tokenizer_hash: str = "",
                      log: Callable[[str], None] | None = None) -> tuple[list[dict], int]:
    """Score every spec on every checkpoint, taking what ``cache`` holds; returns the rows
    (checkpoint-major, in the order given, see :func:`result_row`) and how many were scored now.

    ``load(checkpoint)`` builds the language model; it is called only for a checkpoint that has
    something left to score, and all of that checkpoint's missing tasks go to the model together
    (:func:`~olmoflow.eval.harness.run_tasks` batches across them).

    Raises:
        OlmoflowError: a task's data is missing or malformed under ``strict``, or a request does
            not fit ``max_length``; results scored before the error stay cached.
    """
    from olmoflow.eval.harness import run_tasks

    rows: list[dict] = []
    scored = 0
    for ckpt in checkpoints:
        keys = [cache_key(ckpt.content_hash, r, max_length=max_length,
                          tokenizer_hash=tokenizer_hash) for r in specs]
        got = [cache.get(k) for k in keys]
        todo = [i for i, g in enumerate(got) if g is None]
        if todo:
            if log:
                log(f"{ckpt.name}: scoring {', '.join(specs[i].label for i in todo)}")
            lm = load(ckpt)
            t0 = time.time()
            try:
                results = run_tasks(lm, [specs[i].task() for i in todo])
            except OlmoflowError as e:
                raise OlmoflowError(f"{ckpt.name}: {e}") from None
            secs = (time.time() - t0) / len(todo)
            for i, res in zip(todo, results):
                got[i] = result_row(ckpt, specs[i], res, secs)
                cache.put(keys[i], got[i])
            scored += len(todo)
        for r, g in zip(specs, got):
            # the cached row under this run's label and checkpoint name
            rows.append({**g, "task": r.label, "checkpoint": ckpt.name, "step": ckpt.step,
                         "tokens": ckpt.tokens})
    return rows, scored
