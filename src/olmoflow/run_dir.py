"""The layout of a run directory: which directory each stage of the flow writes.

:data:`STAGE_DIRS` is the one place stage directory names are spelt. The pipeline's stages, the
release bundle, ``export``, ``plot`` and anything that reads a finished run ask :class:`RunDir`.
A stage that is not in the table (a new one: ``sft``, ``evaluate-checkpoints``) writes in a
directory named after itself, so adding a stage is one entry in the pipeline's table of stages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from olmoflow.errors import OlmoflowError

#: stage name (the CLI verb) -> its directory under the run directory, where the two differ or
#: where readers look for a stage's directory by its name (``RunDir.containing``).
STAGE_DIRS: dict[str, str] = {
    "collect": "collect",
    "clean": "clean",
    "train-tokenizer": "tokenizer",
    "tokenize": "tokens",
    "pretrain": "pretrain",
    "evaluate": "eval",
    "generate": "generate",
    "release": "release",
}
CONFIG_FILE = "config.yaml"
#: the stage whose checkpoints and training log a run's readers mean by default (plot, export).
TRAINING_STAGE = "pretrain"
#: the training log a training stage writes in its directory (one JSON object per logged step).
TRAINING_LOG = "metrics.jsonl"
# A stage name becomes a directory name: one path component, no hidden or relative names.
_STAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class RunDir:
    """A run directory (``runs/demo``) and the directory of each of its stages."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    def stage(self, name: str) -> Path:
        """The directory of stage ``name`` (``"train-tokenizer"`` -> ``root/tokenizer``; a stage
        not in :data:`STAGE_DIRS` -> ``root/<name>``).

        Raises:
            OlmoflowError: ``name`` cannot be a directory name (empty, a path, or hidden).
        """
        if name in STAGE_DIRS:
            return self.root / STAGE_DIRS[name]
        if not isinstance(name, str) or not _STAGE_NAME.match(name):
            raise OlmoflowError(f"'{name}' is not a stage name (letters, digits, '-', '_', '.'; "
                                f"the flow's stages: {', '.join(STAGE_DIRS)})")
        return self.root / name

    def need(self, name: str, filename: str) -> Path:
        """Path of an artifact of stage ``name``, or an error telling the user what to run first.

        Raises:
            OlmoflowError: the file does not exist.
        """
        p = self.stage(name) / filename
        if not p.exists():
            raise OlmoflowError(f"'{p}' is missing; run 'olmoflow {name}' (or 'olmoflow run') "
                                "first")
        return p

    def training_log(self, stage: str = TRAINING_STAGE) -> Path:
        """The training log of training stage ``stage`` (``root/pretrain/metrics.jsonl``); it may
        not exist yet."""
        return self.stage(stage) / TRAINING_LOG

    @property
    def config(self) -> Path:
        """The resolved config the run was made with (``root/config.yaml``)."""
        return self.root / CONFIG_FILE

    @classmethod
    def containing(cls, path: str | Path) -> RunDir | None:
        """The run directory ``path`` is, or is a stage directory of (``runs/demo/pretrain`` ->
        ``runs/demo``); None when it is neither."""
        p = Path(path)
        if p.name in STAGE_DIRS.values() and (p.parent / CONFIG_FILE).is_file():
            return cls(p.parent)
        if (p / CONFIG_FILE).is_file() or any((p / d).is_dir() for d in STAGE_DIRS.values()):
            return cls(p)
        return None
