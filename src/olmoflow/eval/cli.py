"""``olmoflow eval``: the task registry and scoring a model directory outside a run.

    olmoflow eval list                         every task: type, primary metric, chance, source
    olmoflow eval info TASK[:opt=val,...]      description, data format, settings, an example
    olmoflow eval run --model DIR --tasks SPECS [--limit N] [--data-dir D] [--strict]
                      [--batch-size B] [--max-length L] [--out FILE.json]

``--model`` is a release or Hugging Face export directory, a training checkpoint (a step
directory, or a folder of them: its ``latest``), a run directory with a release, or a Hub id
(any form :func:`olmoflow.model.load.load_model` reads). SPECS are task specs
(:mod:`olmoflow.eval.spec`).
Errors are :class:`~olmoflow.errors.OlmoflowError` (one line, exit status 2).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from olmoflow.errors import OlmoflowError


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``eval`` verb and its actions (``list``, ``info``, ``run``) to the subparsers."""
    ev = sub.add_parser("eval", help="evaluation tasks: list, info, run (score a model directory)")
    esub = ev.add_subparsers(dest="action", required=True, metavar="ACTION")
    lst = esub.add_parser("list", help="the registered tasks")
    lst.set_defaults(tool=eval_list)
    info = esub.add_parser("info", help="one task: data format, settings, an example request")
    info.add_argument("task", help="a task name (see 'olmoflow eval list') or a spec, e.g. "
                      "arc_easy:split=validation")
    info.add_argument("--data-dir", help="a folder of datasets in their published layout")
    info.set_defaults(tool=eval_info)
    run = esub.add_parser("run", help="score a release / HF-export / checkpoint directory")
    run.add_argument("--model", required=True, help="release or Hugging Face directory, or a "
                     "training checkpoint directory")
    run.add_argument("--tasks", required=True, action="append",
                     help="task specs, e.g. arc_easy,hellaswag:limit=100 or all (repeatable)")
    run.add_argument("--limit", type=int, help="documents per task when a spec gives none")
    run.add_argument("--data-dir", help="a folder of datasets in their published layout")
    run.add_argument("--strict", action="store_true",
                     help="a malformed document is an error (file and line named)")
    run.add_argument("--allow-network", action="store_true",
                     help="download a task's data when no local copy is found (and a Hub "
                     "model id the local Hugging Face cache lacks)")
    run.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass")
    run.add_argument("--max-length", type=int,
                     help="the model's context (default: the longest training sequence length "
                     "its config.yaml records, else the model's maximum)")
    run.add_argument("--tokenizer", help="directory with tokenizer.json (default: beside the "
                     "model)")
    run.add_argument("--out", help="write the results as JSON to this file")
    run.set_defaults(tool=eval_run)


# ---- list / info ---------------------------------------------------------------------------


def _instance(cls: type) -> Any:
    """The task with default settings (its primary metric may depend on the formulation), or
    the class itself when it cannot be made without data."""
    try:
        return cls()
    except Exception:  # a task's own checks: fall back to its class attributes
        return cls


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "n/a" if not math.isfinite(v) else f"{v:.4g}"
    return "" if v is None else str(v)


def task_table() -> list[dict[str, Any]]:
    """One row per registered task: name, type, primary metric, chance, source."""
    from olmoflow.eval.registry import task_class, task_names

    rows = []
    for name in task_names():
        cls = task_class(name)
        t = _instance(cls)
        rows.append({"name": name, "type": cls.output_type, "primary": t.primary_metric,
                     "chance": t.chance, "source": cls.source or cls.description})
    return rows


def eval_list(args: argparse.Namespace) -> None:
    """Print the registered tasks as a table."""
    rows = task_table()
    if not rows:
        print("no tasks registered")
        return
    w = max(len(r["name"]) for r in rows)
    print(f"{'task':<{w}}  {'type':<15}  {'primary':<15}  {'chance':>6}  source")
    for r in rows:
        src = r["source"] if len(r["source"]) <= 70 else r["source"][:67] + "..."
        print(f"{r['name']:<{w}}  {r['type']:<15}  {r['primary']:<15}  {_fmt(r['chance']):>6}  "
              f"{src}")


#: (instance attribute, its default's class attribute, label) ``eval info`` shows when a task
#: has them (not every task does).
_INFO_ATTRS = (("formulation", None, "formulation"), ("num_shots", "default_shots", "shots"),
               ("split", "default_split", "split"))


def _data_dir(data_dir: str | None) -> Path | None:
    """``--data-dir`` as a Path; a path that is not a folder is an error rather than a source
    silently passed over for the data that installs with the package."""
    if data_dir is None:
        return None
    if not Path(data_dir).is_dir():
        raise OlmoflowError(f"--data-dir {data_dir}: no such directory (give the folder that "
                            "holds the datasets, laid out like ../shared/data)")
    return Path(data_dir)


def task_info(spec: str, data_dir: str | None = None) -> str:
    """The text of ``olmoflow eval info SPEC`` (a task name, or a spec such as
    ``arc_easy:split=validation`` to show another split or formulation).

    Raises:
        OlmoflowError: a bad spec or an unknown task (naming the closest).
    """
    from olmoflow.eval.registry import task_class
    from olmoflow.eval.spec import parse_spec
    from olmoflow.eval.task import EvalSettings

    parsed = parse_spec(spec)
    name = parsed.name
    cls = task_class(name)
    defaults = EvalSettings(limit=1, data_dir=_data_dir(data_dir))
    settings = parsed.settings(defaults)
    try:
        t = cls(settings)
    except OlmoflowError as e:
        t, made = cls, str(e)
    else:
        made = ""
    lines = [f"{name}: {cls.description}", f"type: {cls.output_type}",
             f"source: {cls.source or 'n/a'}",
             f"primary metric: {t.primary_metric} "
             f"({'higher' if cls.higher_is_better else 'lower'} is better), chance {t.chance:g}"]
    primary = getattr(cls, "primary", None)
    if isinstance(primary, dict):
        lines.append("formulations: " + ", ".join(f"{k} (primary {v})"
                                                  for k, v in primary.items()))
    for attr, default_attr, label in _INFO_ATTRS:
        v = getattr(t, attr, None)
        d = getattr(cls, default_attr, None) if default_attr else None
        if v is None or callable(v):
            v = d
        if v is not None and not callable(v):
            lines.append(f"{label}: {v}" + (f" (default {d})" if d is not None and d != v
                                             else ""))
    if made:
        lines.append(f"example: cannot make the task with default settings ({made})")
        return "\n".join(lines)
    try:
        docs = t.load()
        if not docs:
            raise OlmoflowError("no documents")
        reqs = t.requests(docs[0])
    except OlmoflowError as e:
        lines.append(f"example: no local data ({e}; another split may have it: "
                     f"olmoflow eval info {name}:split=NAME)")
        return "\n".join(lines)
    lines.append(f"example: the {len(reqs)} request(s) of one document (first shown)")
    r = reqs[0]
    for field in ("context", "continuation", "text", "until", "max_new_tokens"):
        if hasattr(r, field):
            v = getattr(r, field)
            lines.append(f"--- {field}:\n{v}" if isinstance(v, str) else f"--- {field}: {v}")
    if len(reqs) > 1 and hasattr(reqs[1], "continuation"):
        lines.append("--- other continuations: " + ", ".join(repr(q.continuation)
                                                            for q in reqs[1:8]))
    return "\n".join(lines)


def eval_info(args: argparse.Namespace) -> None:
    print(task_info(args.task, args.data_dir))


# ---- run -----------------------------------------------------------------------------------


def score_model_dir(model: str | Path, specs: list[str], *, limit: int | None = None,
                    data_dir: str | None = None, strict: bool = False,
                    allow_network: bool = False, batch_size: int = 16,
                    max_length: int | None = None, tokenizer: str | Path | None = None
                    ) -> tuple[list[Any], list[Any], dict[str, Any]]:
    """Score task ``specs`` on a model directory: ``(resolved specs, TaskResults, info)``.

    Raises:
        OlmoflowError: a bad spec or task name, a model that does not load, missing data.
    """
    from olmoflow.eval.harness import run_tasks
    from olmoflow.eval.scorer import OlmoflowLM
    from olmoflow.eval.spec import resolve
    from olmoflow.eval.task import EvalSettings
    from olmoflow.model.load import load_model

    for key, v in (("--limit", limit), ("--batch-size", batch_size), ("--max-length", max_length)):
        if v is not None and v < 1:
            raise OlmoflowError(f"{key}={v} must be >= 1")
    defaults = EvalSettings(limit=limit, data_dir=_data_dir(data_dir), strict=strict,
                            allow_network=allow_network)
    resolved = resolve(specs, defaults)  # bad specs fail before the model loads
    if not resolved:
        raise OlmoflowError(f"--tasks {' '.join(map(repr, specs))} names no task; give task "
                            "specs such as arc_easy,hellaswag (see 'olmoflow eval list')")
    loaded = load_model(model, tokenizer=tokenizer, device="auto",
                        allow_network=allow_network or None)
    length = max_length or loaded.trained_length
    lm = OlmoflowLM(loaded.model, loaded.tokenizer, batch_size=batch_size, max_length=length)
    t0 = time.time()
    results = run_tasks(lm, [r.task() for r in resolved])
    info = {"model": str(loaded.path), "max_length": lm.max_length, "batch_size": batch_size,
            "seconds": round(time.time() - t0, 2)}
    return resolved, results, info


def results_table(resolved: list[Any], results: list[Any]) -> str:
    """The printed table: task, primary metric, value, stderr, documents."""
    w = max([len(r.label) for r in resolved] + [4])
    lines = [f"{'task':<{w}}  {'metric':<15}  {'value':>8}  {'stderr':>8}  {'n':>6}"]
    for r, res in zip(resolved, results):
        err = res.stderr.get(res.primary_metric)
        lines.append(f"{r.label:<{w}}  {res.primary_metric:<15}  {res.primary:>8.4f}  "
                     f"{_fmt(err):>8}  {res.n:>6}")
    return "\n".join(lines)


def eval_run(args: argparse.Namespace) -> None:
    """``olmoflow eval run``: print the table, write ``--out`` JSON."""
    from olmoflow.artifacts import atomic_write_json

    # checked before scoring, which may take long, rather than after it
    if args.out and Path(args.out).is_dir():
        raise OlmoflowError(f"--out {args.out} is a directory; give a file name (results.json)")
    resolved, results, info = score_model_dir(
        args.model, args.tasks, limit=args.limit, data_dir=args.data_dir, strict=args.strict,
        allow_network=args.allow_network, batch_size=args.batch_size,
        max_length=args.max_length, tokenizer=args.tokenizer)
    print(results_table(resolved, results))
    if args.out:
        out = Path(args.out)
        if out.is_dir():
            raise OlmoflowError(f"--out {out} is a directory; give a file name (results.json)")

        def clean(x: Any) -> Any:
            if isinstance(x, float) and not math.isfinite(x):
                return None
            if isinstance(x, dict):
                return {k: clean(v) for k, v in x.items()}
            if isinstance(x, list):
                return [clean(v) for v in x]
            return x

        atomic_write_json(out, clean({**info, "results": [
            {**res.to_json(), "task": r.label, "task_name": r.name, "settings": r.settings.key()}
            for r, res in zip(resolved, results)]}))
        print(f"wrote {out}")
