"""A run's configuration: the sections of every package the flow runs, composed.

``RunConfig`` holds one section per part of the flow, each defined beside its code
(:mod:`olmoflow.data.config`, :mod:`olmoflow.tokenizer.config`, :mod:`olmoflow.model.config`,
:mod:`olmoflow.train.config`, ...). :func:`load_config` reads a YAML file or a preset name (``demo``
means ``configs/demo.yaml``), applies dotted ``key=value`` overrides and builds it with the one
parser of :mod:`olmoflow.config`. The resolved config is saved with every run
(``run_dir/config.yaml``), in every manifest and in every checkpoint.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from olmoflow.config import (
    all_keys,
    from_dict,
    load_tree,
    note_renamed,
    read_yaml_mapping,
    resolve_preset,
    to_yaml,
)
from olmoflow.data.config import CleanConfig, CollectConfig, TokenizeConfig
from olmoflow.errors import OlmoflowError
from olmoflow.eval.config import EvalConfig
from olmoflow.infer.config import GenerateConfig
from olmoflow.model.config import ModelConfig
from olmoflow.posttrain.config import DPOConfig, RLConfig, SFTConfig
from olmoflow.release.config import ReleaseConfig
from olmoflow.tokenizer.config import TokenizerConfig
from olmoflow.train.config import TrainConfig


@dataclass
class RunConfig:
    """A whole run of the flow: one section per stage, a run directory and a seed."""

    run_dir: str = "runs/demo"
    seed: int = 42
    collect: CollectConfig = field(default_factory=CollectConfig)
    clean: CleanConfig = field(default_factory=CleanConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    evaluate: EvalConfig = field(default_factory=EvalConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    release: ReleaseConfig = field(default_factory=ReleaseConfig)

    @classmethod
    def upgrade_keys(cls, data: dict[str, Any], prefix: str) -> dict[str, Any]:
        """Accept the forms of OLMo's docs: a top-level ``resume_from`` (``olmoflow pretrain CONFIG
        resume_from=latest``), and a finetuning config's top-level ``optimizer: {type, lr}`` and
        ``data: {paths: [...]}``, which are ``train.checkpoint.resume_from``, ``train.optimizer``
        and ``train.data`` here (the last two with a one-line note).

        Raises:
            OlmoflowError: OLMo's ``run_name`` or ``save_folder`` (:data:`OLMO_RUN_KEYS`), naming
                ``run_dir``.
        """
        for key, does in OLMO_RUN_KEYS.items():
            if key in data:
                raise OlmoflowError(f"{key}={data[key]!r} is OLMo's; olmoflow has no such key: "
                                    f"{does}")
        if "resume_from" in data:
            train = _subsection(data, "train")
            _subsection(train, "checkpoint")["resume_from"] = data.pop("resume_from")
        if "optimizer" in data:
            note_renamed(f"{prefix}optimizer", f"{prefix}train.optimizer")
            value, train = data.pop("optimizer"), _subsection(data, "train")
            old = train.get("optimizer")
            both = isinstance(old, dict) and isinstance(value, dict)
            train["optimizer"] = {**old, **value} if both else value
        paths = data.get("data")
        if isinstance(paths, dict) and "paths" in paths:
            note_renamed(f"{prefix}data.paths", f"{prefix}train.data")
            rest = {k: v for k, v in paths.items() if k != "paths"}
            _subsection(data, "train")["data"] = paths["paths"]
            if rest:
                data["data"] = rest
            else:
                data.pop("data")
        return data

    def __post_init__(self) -> None:
        # Checks across sections, made before any stage runs (not after minutes of training).
        if not str(self.run_dir).strip():
            raise OlmoflowError("run_dir is empty")
        limit = self.model.max_sequence_length
        if self.train.sequence_length > limit:
            raise OlmoflowError(f"train.sequence_length={self.train.sequence_length} exceeds "
                                f"model.max_sequence_length={limit}")
        if (self.evaluate.sequence_length or 0) > limit:
            raise OlmoflowError(f"evaluate.sequence_length={self.evaluate.sequence_length} exceeds "
                                f"model.max_sequence_length={limit}")

    @property
    def eval_sequence_length(self) -> int:
        """Tokens per evaluation window: ``evaluate.sequence_length``, else the training length."""
        return self.evaluate.sequence_length or self.train.sequence_length

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def section(self, name: str) -> dict[str, Any]:
        """The resolved dict of one section (used in stage fingerprints)."""
        return dataclasses.asdict(getattr(self, name))


def finetune_sections() -> list[str]:
    """The sections of a post-training stage (those with a ``base`` to start from: ``sft``,
    ``dpo``, ``rl``); ``olmoflow STAGE CONFIG`` reads a finetuning config (below) for them."""
    hints = typing.get_type_hints(RunConfig)
    return [f.name for f in dataclasses.fields(RunConfig)
            if dataclasses.is_dataclass(hints[f.name])
            and "base" in {g.name for g in dataclasses.fields(hints[f.name])}]


#: OLMo's top-level trainer keys, put in the training section they belong to (``train``, or the
#: stage's ``<stage>.train`` for a finetuning config), where ``TrainConfig`` and its sections read
#: them as their exact equivalents or name the key that does the job.
OLMO_TRAIN_PLACES = {"global_train_batch_size": "global_train_batch_size",
                     "device_train_microbatch_size": "device_train_microbatch_size",
                     "max_duration": "max_duration", "scheduler": "schedule",
                     "reset_trainer_state": "checkpoint.reset_trainer_state"}
#: OLMo's top-level keys with no equivalent here, and what does their job.
OLMO_RUN_KEYS = {
    "run_name": "a run is named by its directory: set run_dir (e.g. run_dir=runs/NAME)",
    "save_folder": "checkpoints are written to run_dir/<stage>/ (pretrain/, sft/, ...): set "
                   "run_dir",
}


def olmo_keys(train: str) -> Callable[[str], str]:
    """The key mapping that puts OLMo's top-level trainer keys (:data:`OLMO_TRAIN_PLACES`) into
    the training section ``train`` (``"train"`` or ``"sft.train"``); other keys are unchanged."""
    def reroot(key: str) -> str:
        head, _, rest = key.partition(".")
        if head in OLMO_TRAIN_PLACES:
            return f"{train}.{OLMO_TRAIN_PLACES[head]}" + (f".{rest}" if rest else "")
        return key

    return reroot


def finetune_form(name_or_path: str | None, stage: str | None) -> Callable[[str], str] | None:
    """For ``olmoflow sft CONFIG`` (likewise ``dpo``, ``rl``) where CONFIG is written the way OLMo's
    docs write a finetuning config (top-level ``data: {paths: [...]}`` or ``data.processors``,
    ``train``, ``optimizer``, ``load_path``, and no ``sft`` section): the key mapping that puts
    those keys in the stage's section (``train`` -> ``sft.train``, ``optimizer`` ->
    ``sft.train.optimizer``, ``data`` -> ``sft.data``, ``load_path`` -> ``sft.base``, and OLMo's
    trainer keys, :func:`olmo_keys`, into ``sft.train``). None for any other config or verb."""
    if stage not in finetune_sections() or not name_or_path:
        return None
    try:
        raw = read_yaml_mapping(resolve_preset(name_or_path))
    except OlmoflowError:
        return None  # load_tree reports it
    data = raw.get("data")
    if stage in raw or not (isinstance(data, dict) and ("paths" in data or "processors" in data)):
        return None
    places = {"train": f"{stage}.train", "optimizer": f"{stage}.train.optimizer",
              "data": f"{stage}.data", "load_path": f"{stage}.base",
              "scheduler": f"{stage}.train.schedule"}

    olmo = olmo_keys(f"{stage}.train")

    def reroot(key: str) -> str:
        head, _, rest = key.partition(".")
        return places[head] + (f".{rest}" if rest else "") if head in places else olmo(key)

    return reroot


def load_config(name_or_path: str | None = "demo", overrides: list[str] | None = None,
                values: dict[str, Any] | None = None, stage: str | None = None) -> RunConfig:
    """Load a YAML preset or file, apply dotted overrides, and return a validated RunConfig.

    ``overrides`` are ``key=value`` strings (values parsed as YAML); ``values`` maps dotted keys to
    Python values, applied last (what CLI flags such as ``--data`` set). A top-level
    ``resume_from`` (``olmoflow pretrain CONFIG resume_from=latest``, the form OLMo's docs use) is
    ``train.checkpoint.resume_from``: ``latest``, a checkpoint directory, or ``stepN``; OLMo's
    trainer keys (``global_train_batch_size``, ``max_duration``, ...; :func:`olmo_keys`) go to the
    training section and are read as their exact equivalents with a note, or are an error naming
    the key that does the job; older spellings of keys are accepted with a note (see
    :meth:`RunConfig.upgrade_keys` and :meth:`~olmoflow.train.config.TrainConfig.upgrade_keys`).
    ``stage``: the verb's stage; for a post-training verb a finetuning config in OLMo's form is
    read into its section (see :func:`finetune_form`).

    Raises:
        OlmoflowError: missing file, invalid YAML, unknown key (with the closest valid key), or a
            value of the wrong type.
    """
    tree = load_tree(name_or_path, overrides, values, schema=RunConfig,
                     reroot=finetune_form(name_or_path, stage) or olmo_keys("train"))
    if name_or_path and "run_dir" not in tree:
        # A config that names no run directory gets its own, never another preset's.
        tree["run_dir"] = f"runs/{resolve_preset(name_or_path).stem}"
    return from_dict(RunConfig, tree, universe=all_keys(RunConfig))


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML text."""
    return to_yaml(cfg)


def _subsection(data: dict[str, Any], name: str) -> dict[str, Any]:
    """The raw mapping ``data[name]``, created (or copied, so a shared tree is not changed)."""
    sub = data.get(name)
    sub = dict(sub) if isinstance(sub, dict) else {}
    data[name] = sub
    return sub
