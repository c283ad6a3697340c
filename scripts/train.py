"""``python -m scripts.train CONFIG [key=value ...]`` from the repository root: OLMo's training
command (``scripts/train.py CONFIG resume_from=latest``), the same as
``python -m olmoflow.scripts.train`` and ``olmoflow pretrain``."""

from __future__ import annotations

import sys

from olmoflow.scripts.train import main

if __name__ == "__main__":
    sys.exit(main())
