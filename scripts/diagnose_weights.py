"""``python -m scripts.diagnose_weights CHECKPOINT_OR_DIR`` from the repository root: OLMo's
weight check, the same as ``python -m olmoflow.scripts.diagnose_weights`` and
``olmoflow diagnose``."""

from __future__ import annotations

import sys

if not __package__:  # run as a file, not with -m: the checkout's src/ first
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import scripts  # noqa: F401

from olmoflow.scripts.diagnose_weights import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m scripts.diagnose_weights"))
