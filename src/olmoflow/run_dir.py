"""The layout of a run directory: which directory each stage of the flow writes.

:data:`STAGE_DIRS` is the one place stage directory names are spelt. The pipeline's stages, the
release bundle, ``export``, ``plot`` and anything that reads a finished run ask :class:`RunDir`.
A stage that is not in the table (a new one: ``sft``, ``evaluate-checkpoints``) writes in a
directory named after itself, so adding a stage is one entry in the pipeline's table of stages.

A directory is an olmoflow run when it holds the marker file ``.olmoflow-run``
(:func:`claim_directory`): the project clears and rewrites stage directories only there, so a
``--run-dir`` that points at the user's own files is refused instead of emptied. The data engine
marks its output the same way with its own marker (``.olmoflow-data``).
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Callable, Iterable
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
    "sft": "sft",
    "dpo": "dpo",
    "rl": "rl",
    "evaluate": "eval",
    "generate": "generate",
    "release": "release",
}
CONFIG_FILE = "config.yaml"
#: The marker file that says a directory is an olmoflow run directory (see :func:`claim_directory`).
RUN_MARKER = ".olmoflow-run"
#: Config keys whose values are paths (files, directories, globs) the run reads as its raw input.
#: An input inside one of the run's stage directories would be deleted when that stage is cleared
#: and made again, so the runner refuses it (:func:`check_inputs`).
INPUT_KEYS = ("collect.sources",)
# A stage directory's files that only the runner writes, and its manifest.
_FINGERPRINT = ".fingerprint"
_MANIFEST = "manifest.json"
# A config.yaml or manifest larger than this is not one of ours (and is not parsed).
_MAX_OWN_FILE = 16 << 20
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


# ---- whose directory it is ---------------------------------------------------------------------


def previous_output(out: Path) -> Path:
    """Where the runner sets a stage directory's previous output aside while the stage runs
    again (``.<dir>.previous`` beside it); a stage may still read it (the evaluate stage reuses
    its cached task results)."""
    return out.parent / f".{out.name}.previous"


def _read_small(path: Path) -> str | None:
    """The text of a small regular file (at most 16 MiB), or None."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > _MAX_OWN_FILE:
            return None
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def own_manifest_stage(directory: Path) -> str | None:
    """The ``stage`` a directory's ``manifest.json`` names (what olmoflow writes last in every
    directory it makes), or None when there is no such manifest."""
    text = _read_small(Path(directory) / _MANIFEST)
    try:
        m = json.loads(text) if text is not None else None
    except (ValueError, RecursionError):
        return None
    stage = m.get("stage") if isinstance(m, dict) else None
    return stage if isinstance(stage, str) else None


def config_has_keys(path: Path, keys: Iterable[str]) -> bool:
    """Whether ``path`` is a YAML mapping holding every key of ``keys`` (a resolved config that
    olmoflow saved)."""
    import yaml

    text = _read_small(path)
    try:
        tree = yaml.safe_load(text) if text is not None else None
    except (yaml.YAMLError, ValueError, TypeError, RecursionError):  # anyone's file: not ours
        return False
    return isinstance(tree, dict) and all(k in tree for k in keys)


def legacy_run_problem(root: Path, made: Callable[[Path], bool] | None = None) -> str | None:
    """Why ``root`` (not empty, no marker) is not a run directory that olmoflow made before it
    marked them; None when it is one, to be adopted.

    It is one when every entry not hidden is an olmoflow artifact: a ``config.yaml`` that is a
    YAML mapping with a ``run_dir`` key (the resolved config the runner saves), or a stage
    directory the runner made: a real directory whose ``manifest.json`` names the stage that
    writes there, that holds the runner's ``.fingerprint`` (a stage interrupted before its
    manifest), or that ``made`` recognises (the runner passes its checkpoint test); and at least
    one stage directory is there. A file or directory of anyone else makes it foreign.
    """
    config = root / CONFIG_FILE
    if config.exists() and not config_has_keys(config, ("run_dir",)):
        return f"its {CONFIG_FILE} is not an olmoflow run config"
    stages = 0
    for p in sorted(root.iterdir()):
        if p.name == CONFIG_FILE or p.name.startswith("."):
            continue
        if not p.is_dir() or p.is_symlink():
            if p.name in STAGE_DIRS.values():
                return f"'{p}' exists and is not a directory"
            return f"'{p.name}' is not an olmoflow stage directory"
        stage = own_manifest_stage(p)
        try:
            ours = stage is not None and RunDir(root).stage(stage) == p
        except OlmoflowError:
            ours = False
        if not (ours or (p / _FINGERPRINT).is_file() or (made is not None and made(p))):
            return f"'{p.name}' is not an olmoflow stage directory"
        stages += 1
    return None if stages else "no stage directory"


def _holds_files(root: Path) -> bool:
    """Whether anything lies under ``root`` but directories and the half-written temporaries of
    olmoflow's atomic writes (a killed first run leaves only those: nothing of anyone's)."""
    from olmoflow.artifacts import is_atomic_temporary

    for p in root.rglob("*"):
        if p.is_symlink() or not (p.is_dir() or is_atomic_temporary(p.name)):
            return True
    return False


def require_run_dir(path: str | os.PathLike) -> RunDir:
    """The run directory at ``path`` (one olmoflow made: its ``config.yaml`` and the
    :data:`RUN_MARKER`).

    Raises:
        OlmoflowError: ``path`` is missing, a release (a copy of one), a stage directory, or
            any other folder; the message says which and what to give instead.
    """
    p = Path(path)
    if not p.is_dir():
        raise OlmoflowError(f"'{p}' is not a directory; give a run directory such as runs/demo")
    if (p / RUN_MARKER).is_file() and (p / CONFIG_FILE).is_file():
        return RunDir(p)
    if (p / "files.json").is_file() or (p / "config.json").is_file():
        raise OlmoflowError(f"'{p}' is a release or model directory, not a run directory; give "
                            f"the run it came from (e.g. '{p.parent}')")
    if RunDir.containing(p) is not None and p.name in STAGE_DIRS.values():
        raise OlmoflowError(f"'{p}' is a stage directory; give its run directory '{p.parent}'")
    raise OlmoflowError(f"'{p}' is not a run directory (no {CONFIG_FILE} and {RUN_MARKER} in "
                        "it); give a run directory such as runs/demo")


def claim_directory(root: str | os.PathLike, *, marker: str = RUN_MARKER,
                    legacy: Callable[[Path], str | None] = legacy_run_problem,
                    what: str = "run directory") -> bool:
    """Make sure olmoflow may clear and rewrite its stage directories in ``root``, creating it
    when it does not exist; return whether this call marked it.

    A directory carrying ``marker`` is olmoflow's. A new or empty one (empty but for directories
    and olmoflow's own atomic-write temporaries) gets the marker. A non-empty one without it is
    adopted (marked) only when ``legacy`` recognises it as made by olmoflow before the marker
    existed (:func:`legacy_run_problem` for run directories), and refused otherwise: it holds
    someone's files, and a stage would delete those that share its directory's name (``eval/``,
    ``release/``).

    Args:
        legacy: ``root -> None`` when an unmarked, non-empty ``root`` is an old olmoflow
            directory, else the reason it is not (shown in the message).
        what: how the message names the directory.
    Raises:
        OlmoflowError: ``root`` is a file, cannot be created, or is a non-empty directory that
            is not olmoflow's (the message says why and what to do).
    """
    from olmoflow.artifacts import atomic_write_json, now

    root = Path(root)
    if root.exists() and not root.is_dir():
        raise OlmoflowError(f"{what} '{root}' exists and is not a directory")
    if (root / marker).is_file():
        return False
    if root.is_dir() and _holds_files(root):
        problem = legacy(root)
        if problem is not None:
            raise OlmoflowError(
                f"{what} '{root}' is not empty and is not olmoflow's (no {marker} file; "
                f"{problem}); olmoflow would replace files there: give a new or empty directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
        atomic_write_json(root / marker, {"olmoflow": what, "marked": now()})
    except OSError as e:
        raise OlmoflowError(f"cannot create {what} '{root}': {e.strerror or e}") from None
    return True


def _glob_base(pattern: str) -> Path:
    """The directory a glob searches from: its leading components without a wildcard."""
    parts = Path(pattern).expanduser().parts
    fixed = []
    for part in parts:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return Path(*fixed) if fixed else Path(".")


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def input_inside(entry: object, folders: Iterable[Path]) -> Path | None:
    """The first of ``folders`` (resolved paths) that the input path ``entry`` lies in: a file or
    directory, or a glob's fixed part or any file it matches, symlinks resolved. None when it
    lies in none of them, or is not a path (``stdlib``, ``scheme://...``)."""
    if not isinstance(entry, str) or entry == "stdlib" or "://" in entry:
        return None
    folders = list(folders)
    magic = glob.has_magic(entry)
    base = _glob_base(entry) if magic else Path(entry).expanduser()
    found = [Path(m) for m in glob.glob(entry, recursive=True)] if magic else []
    for p in (base, *found):
        r = p.resolve()
        for folder in folders:
            if _inside(r, folder):
                return folder
    return None


def check_inputs(run: RunDir, stages: Iterable[str], entries: Iterable[object], key: str) -> None:
    """Refuse input paths of config key ``key`` that lie inside the run's own output.

    ``entries`` are files, directories or globs (``stdlib`` and ``scheme://`` entries are not
    paths and pass). Refused: an entry that lies (see :func:`input_inside`) in the directory of
    one of ``stages``, which the runner deletes when it makes that stage again, so the input
    would be gone before it is read; and a directory that holds the run directory, whose stage
    outputs would be read back as input.

    Raises:
        OlmoflowError: the first such entry, naming ``key`` and the stage directory.
    """
    root = run.root.resolve()
    outs = [run.stage(name).resolve() for name in stages]
    for entry in entries:
        hit = input_inside(entry, outs)
        if hit is not None:
            raise OlmoflowError(
                f"{key}: '{entry}' lies inside this run's own '{hit.name}' directory "
                f"('{hit}'), which olmoflow deletes when it makes that stage again; move the "
                "input out of the run directory")
        if (isinstance(entry, str) and not glob.has_magic(entry) and "://" not in entry
                and Path(entry).expanduser().is_dir()
                and _inside(root, Path(entry).expanduser().resolve())):
            raise OlmoflowError(
                f"{key}: directory '{entry}' holds the run directory '{run.root}', so the run's "
                "own outputs would be read back as input; give a run directory outside it")
