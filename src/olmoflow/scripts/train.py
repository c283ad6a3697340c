"""``python -m olmoflow.scripts.train CONFIG [key=value ...]``: pretraining in the form of OLMo's
training script (``torchrun scripts/train.py CONFIG resume_from=latest``).

The same as ``olmoflow pretrain CONFIG [key=value ...]``: the stages pretraining needs (collect,
clean, tokenizer, tokens) run first when their outputs are missing, then the ``pretrain`` stage.
``resume_from=latest`` continues from the newest checkpoint (``train.checkpoint.resume_from``);
every other option and override of ``olmoflow pretrain`` is accepted as well.

Exit status as ``olmoflow``: 0 done, 2 bad input (one line), 130 interrupted.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``olmoflow pretrain`` with ``argv`` (default: the command line's arguments)."""
    from olmoflow.cli import main as cli_main

    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    return cli_main(["pretrain", *args])


if __name__ == "__main__":
    sys.exit(main())
