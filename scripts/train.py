"""``python -m scripts.train CONFIG [key=value ...]`` from the repository root: OLMo's training
command (``scripts/train.py CONFIG resume_from=latest``), the same as
``python -m olmoflow.scripts.train`` and ``olmoflow pretrain``."""

from __future__ import annotations

import sys

if not __package__:  # run as a file (`torchrun scripts/train.py ...`): the checkout's src/ first
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import scripts  # noqa: F401

from olmoflow.scripts.train import main

if __name__ == "__main__":
    sys.exit(main())
