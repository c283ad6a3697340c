"""OLMo's script commands, run from the root of a checkout: ``python -m scripts.train`` and
``python -m scripts.diagnose_weights``.

Each module is a thin entry point over the package's own ``olmoflow.scripts.*`` (the form that
works wherever olmoflow is installed). This folder is not part of the installed package; it exists
so the commands OLMo's documentation gives work as written from the repository root.
"""

from __future__ import annotations

import sys
from pathlib import Path

# A checkout runs its own sources: put src/ first, so these commands never mix this checkout's
# scripts with another installed copy of olmoflow. In an editable install it is the same code.
_SRC = Path(__file__).resolve().parents[1] / "src"
if (_SRC / "olmoflow" / "__init__.py").is_file() and str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))
