"""``python -m olmoflow.scripts.diagnose_weights CHECKPOINT_OR_DIR`` (also ``olmoflow diagnose``):
check a checkpoint's weights before fine-tuning it.

Prints the flagged tensors (``--all``: every tensor) with their NaN/Inf counts, outlier share,
dead rows, RMS against the init scale and against sibling layers (see
:mod:`olmoflow.release.diagnose` for each statistic and the flagging rule); ``--json FILE`` writes
the full report. ``--reinit OUT`` writes a Hugging Face directory of the model with the flagged
tensors re-drawn by the model's own init and every other tensor bit-identical.

Exit status: 0 when nothing is flagged, 1 when a tensor is (also after ``--reinit``), 2 for bad
input (a one-line error).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from olmoflow.errors import OlmoflowError

EXIT_CLEAN, EXIT_FLAGGED, EXIT_USAGE = 0, 1, 2


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments of the command on ``p``; returns ``p``."""
    from olmoflow.release.diagnose import DiagnoseSettings

    d = DiagnoseSettings()
    p.add_argument("checkpoint", metavar="CHECKPOINT_OR_DIR",
                   help="a training step directory (or its folder with a 'latest' pointer) or a "
                   "Hugging Face / release directory")
    p.add_argument("--k", type=float, default=d.k,
                   help=f"outlier: beyond k robust standard deviations of the median "
                   f"(default {d.k:g})")
    p.add_argument("--threshold", type=float, default=d.threshold,
                   help=f"flag a tensor with more than this share of anomalous values "
                   f"(default {d.threshold:g})")
    p.add_argument("--dead-tol", type=float, default=d.dead_tol,
                   help=f"a row whose largest |value| is below this is dead (default "
                   f"{d.dead_tol:g})")
    p.add_argument("--sibling-factor", type=float, default=d.sibling_factor,
                   help="flag a layer whose spread is this many times above or below the median of "
                   f"the same tensor in the other layers (default {d.sibling_factor:g})")
    p.add_argument("--all", action="store_true", help="print every tensor, not only flagged ones")
    p.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    p.add_argument("--reinit", metavar="OUT",
                   help="write a Hugging Face directory with the flagged tensors re-initialised")
    p.add_argument("--seed", type=int, default=0, help="seed of the re-initialisation")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --json FILE or a non-empty --reinit OUT")
    return p


def run(args: argparse.Namespace) -> int:
    """Diagnose ``args.checkpoint``; returns the exit status.

    Raises:
        OlmoflowError: bad settings or paths, a checkpoint that does not load.
    """
    from olmoflow.model.load import load_model
    from olmoflow.release.diagnose import (
        DiagnoseSettings,
        diagnose_model,
        format_table,
        reinit_flagged,
        report_dict,
        write_json,
    )
    from olmoflow.release.export import check_output, write_model_dir

    settings = DiagnoseSettings(k=args.k, threshold=args.threshold, dead_tol=args.dead_tol,
                                sibling_factor=args.sibling_factor)
    if args.json and Path(args.json).exists() and not args.force:
        raise OlmoflowError(f"--json '{args.json}' exists; pass --force to replace it")
    # on the CPU in the stored dtype; a Hugging Face directory needs no tokenizer to be diagnosed
    loaded = load_model(args.checkpoint, need_tokenizer=False)
    model, kind, src = loaded.model, loaded.kind, loaded.path
    out = check_output(args.reinit, kind, src, args.force) if args.reinit else None
    reports = diagnose_model(model, settings)
    flagged = [r.name for r in reports if r.flagged]
    print(f"{src}: {len(reports)} tensors, {model.num_params():,} parameters; "
          f"{len(flagged)} flagged (k={settings.k:g}, threshold {settings.threshold:.0%}, "
          f"sibling factor {settings.sibling_factor:g})")
    if flagged or args.all:
        print(format_table(reports, all_tensors=args.all))
    if args.json:
        write_json(Path(args.json), report_dict(reports, settings, str(src)))
        print(f"report: {args.json}")
    if out is not None:
        if not flagged:
            print("nothing flagged: --reinit wrote nothing")
        else:
            reinit_flagged(model, flagged, init_std=model.config.init_std, seed=args.seed)
            if loaded.tokenizer_dir is None:
                raise OlmoflowError(f"no tokenizer.json in '{src}': --reinit writes a model "
                                    "directory, tokenizer included")
            write_model_dir(model, out, loaded.tokenizer_dir, tok=loaded.tokenizer, manifest={
                "command": "olmoflow diagnose --reinit", "source": str(src.resolve()),
                "source_kind": kind, "reinitialised": flagged, "seed": args.seed})
            print(f"re-initialised {len(flagged)} tensor(s); wrote {out}")
    return EXIT_FLAGGED if flagged else EXIT_CLEAN


def main(argv: Sequence[str] | None = None,
         prog: str = "python -m olmoflow.scripts.diagnose_weights") -> int:
    """The command; returns the exit status (one line on stderr for bad input). ``prog`` is the
    name its usage and help give (the root-level ``scripts/`` entry point passes its own)."""
    p = add_arguments(argparse.ArgumentParser(
        prog=prog,
        description="Check a checkpoint's weights for NaN/Inf, outliers, dead rows and layers "
        "far from their siblings; optionally re-initialise the flagged ones."))
    args = p.parse_args(argv)
    try:
        return run(args)
    except OlmoflowError as e:
        print(f"diagnose_weights: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
