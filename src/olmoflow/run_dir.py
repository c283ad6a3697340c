"""The layout of a run directory: which directory each stage of the flow writes.

This table is the one place stage directory names are spelt. The pipeline's stages, the release
bundle, ``export``, ``plot`` and anything that reads a finished run ask :class:`RunDir`, so a new
stage is one entry here and one in the pipeline's table of stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from olmoflow.errors import OlmoflowError, unknown_name_error

#: stage name (the CLI verb) -> its directory under the run directory.
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


@dataclass(frozen=True)
class RunDir:
    """A run directory (``runs/demo``) and the directory of each of its stages."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    def stage(self, name: str) -> Path:
        """The directory of stage ``name`` (``"pretrain"`` -> ``root/pretrain``).

        Raises:
            OlmoflowError: ``name`` is no stage (naming the closest one).
        """
        if name not in STAGE_DIRS:
            raise unknown_name_error("stage", name, STAGE_DIRS)
        return self.root / STAGE_DIRS[name]

    def need(self, name: str, filename: str) -> Path:
        """Path of an artifact of stage ``name``, or an error telling the user what to run first.

        Raises:
            OlmoflowError: the file does not exist.
        """
        p = self.stage(name) / filename
        if not p.exists():
            raise OlmoflowError(f"'{p}' is missing; run 'olmoflow {name}' (or 'olmoflow run') first")
        return p

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
