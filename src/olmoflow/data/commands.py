"""The ``olmoflow data ...`` verbs (hooked into :mod:`olmoflow.cli`).

    olmoflow data run CONFIG [key=value ...]         every step, skipping those already done
    olmoflow data STEP CONFIG|DIR [key=value ...]    one step: ingest, tag, dedup, decontaminate,
                                                     mix, tokenize (DIR: a run's saved config.yaml)
    olmoflow data report DIR                         tables per step / rule / source + histograms
    olmoflow data train-quality FILE ... --out DIR   the fastText quality classifier

CONFIG is a YAML file (e.g. configs/data/web_crawl.yaml) or a name under configs/data/.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from olmoflow.data.engine.steps import STEP_NAMES as STEP_VERBS

CONFIG_FILE = "config.yaml"


def add_data_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``data`` verb and its actions to the top-level subparsers."""
    data = sub.add_parser("data", help="the data engine: ingest, tag, dedup, decontaminate, mix, "
                          "tokenize (locally or on Ray), report")
    dsub = data.add_subparsers(dest="action", required=True, metavar="ACTION")

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("config", help="data config YAML (or a name under configs/data/), or "
                        "a data run directory holding config.yaml")
        sp.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted config overrides, e.g. executor=ray workers=4")
        sp.add_argument("--output", help="the data run directory (config key 'output')")
        sp.add_argument("--executor", choices=("local", "ray", "serial"),
                        help="where shard jobs run (config key 'executor')")
        sp.add_argument("--workers", type=int, help="processes / Ray CPUs (default: all cores)")
        sp.add_argument("--strict", action="store_true",
                        help="stop at the first bad input (file and line named)")
        sp.add_argument("--follow-symlinks", action="store_true",
                        help="read files behind symbolic links that lead out of a source "
                        "directory (skipped otherwise; the source option follow_symlinks)")
        sp.add_argument("--force", action="store_true", help="redo steps even when done")
        sp.add_argument("--no-progress", action="store_true", help="no progress bars")
        sp.set_defaults(tool=_run)

    common(dsub.add_parser("run", help="run every step of the config"))
    for step in STEP_VERBS:
        common(dsub.add_parser(step, help=f"run the {step} step"))

    rep = dsub.add_parser("report", help="print kept/removed per step, rule and source; draw "
                          "histograms (PNG)")
    rep.add_argument("dir", help="a data run directory")
    rep.add_argument("--no-histograms", action="store_true", help="tables only")
    rep.set_defaults(tool=_report)

    tq = dsub.add_parser("train-quality", help="train the fastText quality classifier on "
                         "labeled {text, label} JSONL (label 1 = keep)")
    tq.add_argument("labeled", nargs="+", metavar="FILE|key=value",
                    help="labeled JSONL files, then training options for train_quality "
                    "(e.g. epoch=10)")
    tq.add_argument("--out", required=True, help="directory for the model and its report")
    # overrides: the CLI appends key=value options that come after --out here (argparse ends
    # the FILE list at the first option).
    tq.set_defaults(tool=_train_quality, overrides=[])


def load_for_args(args: argparse.Namespace):
    """The DataConfig named by ``args.config`` (a file, a preset or a run directory) with the
    overrides and flags applied."""
    from olmoflow.data.engine import load_data_config

    values = {}
    path = Path(args.config)
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            from olmoflow.errors import OlmoflowError

            raise OlmoflowError(f"{path} is not a data run directory (no {CONFIG_FILE}); give "
                                "the config file instead")
        values["output"] = str(path)
        path = path / CONFIG_FILE
    if args.output:
        values["output"] = args.output
    if args.executor:
        values["executor"] = args.executor
    if args.workers is not None:
        values["workers"] = args.workers
    if args.strict:
        values["strict"] = True
    cfg = load_data_config(path, args.overrides, values)
    if getattr(args, "follow_symlinks", False):
        for s in cfg.sources:
            s.options = dataclasses.replace(s.options, follow_symlinks=True)
    return cfg


def _run(args: argparse.Namespace) -> None:
    from olmoflow.data.engine import Engine, summary_line

    cfg = load_for_args(args)
    engine = Engine(cfg, progress=not args.no_progress, force=args.force)
    steps = None if args.action == "run" else [args.action]
    where = cfg.executor if cfg.executor == "serial" else \
        f"{cfg.executor}, workers={cfg.workers or 'all cores'}"
    print(f"data run {engine.root} ({where})")
    engine.run(steps, on_step=lambda o: print(summary_line(o), flush=True))
    if args.action in ("run", "mix", "tokenize"):
        print(f"report: olmoflow data report {engine.root}")
    if args.action in ("run", "tokenize") and (engine.step_dir("tokenize") / "meta.json").is_file():
        print(f"train:  olmoflow run CONFIG train.data={engine.step_dir('tokenize')}")


def _report(args: argparse.Namespace) -> None:
    from olmoflow.data.engine.report import report

    text, files = report(args.dir, histograms=not args.no_histograms)
    print(text)
    print("\nwrote " + ", ".join(str(f) for f in files))


def _train_quality(args: argparse.Namespace) -> None:
    import json

    from olmoflow.config import parse_override
    from olmoflow.data.engine import expand_paths
    from olmoflow.data.taggers.quality import train_quality

    words = [*args.labeled, *args.overrides]
    options = dict(parse_override(o) for o in words if "=" in o)
    files = expand_paths([f for f in words if "=" not in f])
    result = train_quality(files, Path(args.out), **options)
    print(json.dumps({k: v for k, v in result.items() if k != "outputs"}, indent=2, default=str))
