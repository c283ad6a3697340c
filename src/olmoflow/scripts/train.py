"""``python -m olmoflow.scripts.train CONFIG [key=value ...]``: pretraining in the form of OLMo's
training script (``torchrun scripts/train.py CONFIG resume_from=latest``).

The same as ``olmoflow pretrain CONFIG [key=value ...]``: the ``pretrain`` stage on the run's
tokens (made by ``olmoflow run``, or by the ``collect``, ``clean``, ``train-tokenizer`` and
``tokenize`` verbs; a missing one is a one-line error naming the verb to run).
``resume_from=latest`` continues from the newest checkpoint (``train.checkpoint.resume_from``);
every other option and override of ``olmoflow pretrain`` is accepted as well. From the root of a
checkout, ``python -m scripts.train`` is the same command.

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
