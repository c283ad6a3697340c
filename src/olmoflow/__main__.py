"""``python -m olmoflow`` (also what torchrun launches)."""

import sys

from olmoflow.cli import main

sys.exit(main())
