"""The layout of a run directory: which directory each stage of the flow writes, and which
stages make a model.

Everything about a stage lives in its record (:class:`olmoflow.pipeline.stage.Stage`), the
directory it writes included. This module sits at the bottom of the layer order and must not
import ``pipeline/``, yet its readers (the release bundle, ``export``, ``plot``, ``chat``,
``verify``) need the directories of the flow's stages. So the part of a record that readers need,
:class:`StagePlace` (name, directory, the model it makes), is defined here, ``Stage`` extends it,
and the flow's table of stages registers its records here when it is built
(:func:`register_flow`); directory names are spelt once, in the records. A process that never
imported the records (library use of a reader alone) still finds the directories of a finished
run: each stage directory's ``manifest.json`` names its stage (:func:`own_manifest_stage`), and a
stage found nowhere lies in a directory named after itself.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from olmoflow.errors import OlmoflowError

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
#: the training log a training stage writes in its directory (one JSON object per logged step).
TRAINING_LOG = "metrics.jsonl"
# A stage name becomes a directory name: one path component, no hidden or relative names.
_STAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Makes:
    """What a stage that makes a model records of it: its checkpoints lie in the stage's
    directory (``latest`` the final one), and the stages that make models, in table order, are
    the run's model chain (pretrain, sft, dpo, rl: each starts from the one before).

    Attributes:
        sequence_length: the dotted config key of the window it trains on
            (``"sft.train.sequence_length"``); None when it has no fixed window (RL trains on its
            prompts and ``max_new_tokens``).
        data: the dotted key of the data whose presence makes the stage part of a run
            (``"sft.data"``: its ``paths``, ``processors`` or ``generate``); empty: always part of
            it (pretraining).
        own_tokenizer: its tokenizer (chat template, added tokens) is saved in the stage's
            ``tokenizer/`` directory; otherwise it is the run's tokenizer.
    """

    sequence_length: str | None = None
    data: str = ""
    own_tokenizer: bool = False


@dataclass(frozen=True)
class StagePlace:
    """The part of a stage's record that readers of a run directory need: where the stage writes
    and whether it makes a model. :class:`olmoflow.pipeline.stage.Stage` extends it with what the
    runner needs.

    Attributes:
        name: the CLI verb and the stage's key in manifests and :class:`RunDir`.
        directory: its directory under the run directory; empty: its name.
        makes: set for a stage that makes a model (see :class:`Makes`).
    """

    name: str
    directory: str = field(default="", kw_only=True)
    makes: Makes | None = field(default=None, kw_only=True)

    @property
    def dirname(self) -> str:
        """The directory name the stage writes in (``directory``, else ``name``)."""
        return self.directory or self.name


# The flow's stages, registered by its table of records (see the module docstring).
_FLOW: tuple[StagePlace, ...] = ()


def register_flow(places: Iterable[StagePlace]) -> None:
    """Make ``places`` (the flow's table of stage records, in run order) the stages every
    :class:`RunDir` knows; the table of stages calls this when it is built.

    Raises:
        ValueError: a name or directory that is not one plain directory name, or two stages of
            one directory (a mistake in the table, not in the user's input).
    """
    global _FLOW
    places = tuple(places)
    seen: dict[str, str] = {}
    for p in places:
        for what in (p.name, p.dirname):
            if not _STAGE_NAME.match(what):
                raise ValueError(f"stage '{p.name}': '{what}' is not a plain directory name")
        if p.dirname in seen:
            raise ValueError(f"stages '{seen[p.dirname]}' and '{p.name}' share directory "
                             f"'{p.dirname}'")
        seen[p.dirname] = p.name
    _FLOW = places


def flow_places() -> tuple[StagePlace, ...]:
    """The flow's stages in run order, as registered (empty when the records are not loaded)."""
    return _FLOW


def model_places() -> list[StagePlace]:
    """The flow's stages that make a model, in chain order."""
    return [p for p in _FLOW if p.makes is not None]


def _registered(name: str) -> StagePlace | None:
    return next((p for p in _FLOW if p.name == name), None)


def _stage_dirnames() -> set[str]:
    return {p.dirname for p in _FLOW}


def _dotted(tree: Any, key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def _data_named(data: Any) -> bool:
    return isinstance(data, dict) and any(data.get(k) for k in ("paths", "processors", "generate"))


def trained_lengths(tree: dict[str, Any]) -> list[int]:
    """The sequence lengths a model was trained on, by the saved run config ``tree`` it carries
    (a checkpoint's or release's ``config.yaml``, as a mapping), in chain order: a model is
    trained on the windows of every stage of its chain that ran (pretraining on short ones, SFT
    on longer conversations), each at its record's :attr:`Makes.sequence_length` key; a stage
    with data to name (:attr:`Makes.data`) ran when that data is set. Without the records
    loaded, the same rule read from the config's shape: ``train.sequence_length`` and the
    ``<section>.train.sequence_length`` of every section whose ``data`` is set."""
    if _FLOW:
        keys = [p.makes.sequence_length for p in model_places()
                if p.makes is not None and p.makes.sequence_length is not None
                and (not p.makes.data or _data_named(_dotted(tree, p.makes.data)))]
    else:
        keys = ["train.sequence_length"] + [
            f"{name}.train.sequence_length" for name, section in tree.items()
            if isinstance(section, dict) and _data_named(section.get("data"))]
    values = [_dotted(tree, k) for k in keys]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0]


@dataclass(frozen=True)
class RunDir:
    """A run directory (``runs/demo``) and the directory of each of its stages."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    def stage(self, name: str) -> Path:
        """The directory of stage ``name``: the one its record names (``"train-tokenizer"`` ->
        ``root/tokenizer``); for a stage not registered (see the module docstring) the
        directory named after it when there is one, else the one whose manifest names the
        stage, else ``root/<name>``.

        Raises:
            OlmoflowError: ``name`` cannot be a directory name (empty, a path, or hidden).
        """
        place = _registered(name)
        if place is not None:
            return self.root / place.dirname
        if not isinstance(name, str) or not _STAGE_NAME.match(name):
            known = f"; the flow's stages: {', '.join(p.name for p in _FLOW)}" if _FLOW else ""
            raise OlmoflowError(f"'{name}' is not a stage name (letters, digits, '-', '_', "
                                f"'.'{known})")
        own = self.root / name
        if not own.is_dir() and self.root.is_dir():
            for d in sorted(self.root.iterdir()):
                if d.is_dir() and not d.is_symlink() and own_manifest_stage(d) == name:
                    return d
        return own

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

    def training_log(self, stage: str | None = None) -> Path:
        """The training log of training stage ``stage`` (``root/pretrain/metrics.jsonl``); it may
        not exist yet. ``stage`` None: the first stage of the model chain (pretraining).

        Raises:
            OlmoflowError: ``stage`` is None, the records are not loaded and the run holds
                not exactly one training log (the message says to name the stage).
        """
        if stage is None:
            models = model_places()
            if models:
                stage = models[0].name
            else:
                logs = sorted(self.root.glob(f"*/{TRAINING_LOG}")) if self.root.is_dir() else []
                if len(logs) != 1:
                    raise OlmoflowError(f"'{self.root}' holds {len(logs)} training logs and the "
                                        "flow's stage records are not loaded; name the stage")
                return logs[0]
        return self.stage(stage) / TRAINING_LOG

    @property
    def config(self) -> Path:
        """The resolved config the run was made with (``root/config.yaml``)."""
        return self.root / CONFIG_FILE

    @classmethod
    def containing(cls, path: str | Path) -> RunDir | None:
        """The run directory ``path`` is, or is a stage directory of (``runs/demo/pretrain`` ->
        ``runs/demo``); None when it is neither. A stage directory is one a registered stage
        writes, or one whose manifest names a stage."""
        p = Path(path)
        if (p.parent / CONFIG_FILE).is_file() and _is_stage_dir(p):
            return cls(p.parent)
        if (p / CONFIG_FILE).is_file() or (p.is_dir() and any(
                _is_stage_dir(d) for d in p.iterdir() if d.is_dir())):
            return cls(p)
        return None


def _is_stage_dir(p: Path) -> bool:
    """Whether ``p`` is named as a registered stage's directory or holds a manifest naming a
    stage."""
    return p.name in _stage_dirnames() or own_manifest_stage(p) is not None


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
            if p.name in _stage_dirnames():
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
    if RunDir.containing(p) is not None and _is_stage_dir(p):
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
