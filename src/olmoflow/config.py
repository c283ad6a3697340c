"""Typed run configuration: YAML presets plus dotted ``key=value`` overrides.

A run's config is one :class:`RunConfig` holding a dataclass per stage. It is loaded from a YAML
file or a preset name (``demo`` means ``configs/demo.yaml``), then dotted overrides such as
``train.max_steps=200`` are applied. Unknown keys are errors that name the closest valid key.
The resolved config is saved with every run (``run_dir/config.yaml``) and in every manifest.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from olmoflow.errors import OlmoflowError, closest, unknown_name_error
from olmoflow.model.config import ModelConfig


@dataclass
class CollectConfig:
    """Where documents come from.

    ``sources`` entries are ``"stdlib"`` (the running Python's standard library: module sources
    without test suites, plus the prose of ``pydoc_data.topics``), ``hf://name[:config]/split`` (a
    local Hugging Face dataset directory), or a file, directory or glob of ``.txt``, JSONL
    (``.jsonl``, ``.jsonl.gz``, ``.json.gz``, ``.jsonl.zst``), ``.parquet`` or WARC (``.warc``,
    ``.warc.gz``) files (see :mod:`olmoflow.data.readers`). ``strict`` turns skipped bad input
    (malformed lines, damaged files, empty files) into errors.
    """

    sources: list[str] = field(default_factory=lambda: ["stdlib"])
    text_field: str = "text"
    strict: bool = False
    max_documents: int | None = None


@dataclass
class CleanConfig:
    """Document filters: length bounds in characters (after stripping) and exact deduplication."""

    min_chars: int = 64
    max_chars: int = 1_000_000
    dedup: bool = True


@dataclass
class TokenizerConfig:
    """Tokenizer training. ``implementation`` is ``"bpe"`` (byte-level BPE on the ``tokenizers``
    library) or ``"package.module:ClassName"``, a :class:`~olmoflow.tokenizer.BaseTokenizer`
    subclass of your own, constructed with ``eos_token`` and ``pad_token``."""

    implementation: str = "bpe"
    vocab_size: int = 8192
    min_frequency: int = 2
    eos_token: str = "<|endoftext|>"
    pad_token: str = "<|pad|>"


@dataclass
class TokenizeConfig:
    """Token arrays and the held-out split (whole documents, chosen by a seeded hash of the id)."""

    heldout_fraction: float = 0.02
    heldout_max_documents: int = 200


PRECISIONS = ("auto", "fp32", "bf16")


@dataclass
class TrainConfig:
    """Pretraining: batch sizes in instances of ``sequence_length`` tokens; lr schedule in steps."""

    sequence_length: int = 256
    global_batch_size: int = 16
    micro_batch_size: int = 16
    max_steps: int = 1000
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    schedule: str = "cosine"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    save_interval: int = 500
    log_interval: int = 10
    num_threads: int | None = None
    resume_from: str | None = None
    # --- checkpoints (issue 4.1): OLMo names "{stage}-step{N}-tokens{T}", checkpoints.csv, pruning
    stage: str = "stage1"
    keep_every: int = 0            # keep checkpoints whose step is a multiple of this forever (0: off)
    keep_last: int = 0             # keep only the newest K of the others (0: keep all)
    # --- optimizer and precision (issue 4.3)
    optimizer: str = "adamw"       # adamw | skip_step_adamw | muon
    skip_step_sigma: float = 6.0   # skip_step_adamw: skip when loss or grad norm > mean + sigma * std
    skip_step_window: int = 128    # ... over this many recent steps
    muon_lr: float = 0.02          # muon: lr of the 2-D hidden matrices (AdamW keeps train.lr)
    muon_momentum: float = 0.95
    precision: str = "auto"        # auto (bf16 autocast on GPU, fp32 on CPU) | fp32 | bf16
    activation_checkpointing: int = 0  # recompute every n-th block in backward (1: every block; 0: off)
    compile: bool = False          # torch.compile each transformer block (one-off compile time)
    # --- scale-out and batching (issue 4.4, 4.5)
    data_parallel: str = "ddp"     # under torchrun: ddp | fsdp (FSDP2 fully_shard)
    auto_micro_batch: bool = False  # find the largest micro-batch that fits, keep global batch
    memory_budget_gb: float | None = None  # CPU budget for the micro-batch finder (default: free RAM)
    # --- data loading (issue 4.2)
    packing: str = "concat"        # concat (chunk the token stream) | best_fit (whole documents)
    intra_document_masking: bool = False  # attention does not cross document boundaries
    # --- training log (issue 4.6)
    detailed_log_interval: int = 0  # every n steps also log per-layer/per-head metrics (0: off)
    loggers: list[str] = field(default_factory=list)  # extra writers: tensorboard, wandb (offline)

    def __post_init__(self) -> None:
        from olmoflow.train.schedule import SCHEDULES

        if self.schedule not in SCHEDULES:
            raise unknown_name_error("train.schedule", self.schedule, SCHEDULES)
        if self.sequence_length < 1 or self.global_batch_size < 1 or self.micro_batch_size < 1:
            raise OlmoflowError("train.sequence_length, global_batch_size and micro_batch_size must be >= 1")
        if self.max_steps < 1:
            raise OlmoflowError(f"train.max_steps must be >= 1, got {self.max_steps}")
        if self.global_batch_size % self.micro_batch_size:
            raise OlmoflowError(f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                                f"train.micro_batch_size={self.micro_batch_size}")
        if self.lr <= 0 or self.warmup_steps < 0:
            raise OlmoflowError("train.lr must be > 0 and train.warmup_steps >= 0")
        from olmoflow.data.packing import PACKINGS

        if self.packing not in PACKINGS:
            raise unknown_name_error("train.packing", self.packing, PACKINGS)
        if not isinstance(self.intra_document_masking, bool):
            raise OlmoflowError("train.intra_document_masking must be true or false, got "
                                f"{self.intra_document_masking!r}")
        self._check_engine()
        self._check_log()
        self._check_scale_out()
        self._check_numbers()

    def _check_numbers(self) -> None:
        """Ranges of the loop and AdamW numbers; NaN and infinity are never valid."""
        import math

        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise OlmoflowError(f"train.{f.name} must be a finite number, got {v}")
        for key in ("save_interval", "log_interval", "weight_decay", "grad_clip"):
            if getattr(self, key) < 0:
                raise OlmoflowError(f"train.{key} must be >= 0 (0: off), got {getattr(self, key)}")
        if self.num_threads is not None and self.num_threads < 0:
            raise OlmoflowError(f"train.num_threads must be >= 1 (or 0/null: one share of the "
                                f"cores), got {self.num_threads}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise OlmoflowError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise OlmoflowError(f"train.{key} must be in [0, 1), got {getattr(self, key)}")
        if self.eps <= 0:
            raise OlmoflowError(f"train.eps must be > 0, got {self.eps}")
        if self.skip_step_window < 2:  # the spike test needs a mean and a std of >= 2 earlier steps
            raise OlmoflowError(f"train.skip_step_window must be >= 2 steps, got {self.skip_step_window}")

    def _check_scale_out(self) -> None:
        """Scale-out and the micro-batch finder (issue 4.4, 4.5)."""
        from olmoflow.train.distributed import DATA_PARALLEL

        if self.data_parallel not in DATA_PARALLEL:
            raise unknown_name_error("train.data_parallel", self.data_parallel, DATA_PARALLEL)
        if not isinstance(self.auto_micro_batch, bool):
            raise OlmoflowError(f"train.auto_micro_batch must be true or false, got {self.auto_micro_batch!r}")
        if self.memory_budget_gb is not None and not self.memory_budget_gb > 0:
            raise OlmoflowError(f"train.memory_budget_gb must be > 0 GB (or null: available RAM), "
                                f"got {self.memory_budget_gb}")

    def _check_log(self) -> None:
        """The training log (issue 4.6): detailed_log_interval >= 0, known writer names."""
        from olmoflow.train.loggers import check_loggers

        if self.detailed_log_interval < 0:
            raise OlmoflowError(f"train.detailed_log_interval must be >= 0 (0: off), got "
                                f"{self.detailed_log_interval}")
        check_loggers(self.loggers)

    def _check_engine(self) -> None:
        """Checkpoint policy, optimizer, precision and activation checkpointing (issue 4.1, 4.3)."""
        import re

        from olmoflow.train.optim import OPTIMIZERS

        if self.optimizer not in OPTIMIZERS:
            raise unknown_name_error("train.optimizer", self.optimizer, OPTIMIZERS)
        if self.precision not in PRECISIONS:
            raise unknown_name_error("train.precision", self.precision, PRECISIONS)
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", self.stage):
            raise OlmoflowError(f"train.stage '{self.stage}' must be letters, digits, '_', '.' or "
                                "'-' (it names checkpoint directories, e.g. stage1)")
        for key in ("keep_every", "keep_last", "activation_checkpointing"):
            if getattr(self, key) < 0:
                raise OlmoflowError(f"train.{key} must be >= 0, got {getattr(self, key)}")
        if self.skip_step_sigma <= 0 or self.muon_lr <= 0 or not 0 <= self.muon_momentum < 1:
            raise OlmoflowError("train.skip_step_sigma and train.muon_lr must be > 0 and "
                                "train.muon_momentum in [0, 1)")


@dataclass
class EvalConfig:
    """Held-out evaluation: loss, perplexity and bits-per-byte over at most ``max_tokens`` tokens."""

    max_tokens: int | None = 200_000
    batch_size: int = 8
    sequence_length: int | None = None


@dataclass
class GenerateConfig:
    """Sampling for the ``generate`` stage."""

    prompts: list[str] = field(
        default_factory=lambda: ["def fibonacci(n):", "import os\n", "class Stack:"]
    )
    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: int | None = 50
    top_p: float | None = 0.95
    repetition_penalty: float = 1.0
    seed: int = 0


@dataclass
class ReleaseConfig:
    """The release bundle's name and license, shown in the model card."""

    name: str = "olmoflow-model"
    license: str = "apache-2.0"


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
    evaluate: EvalConfig = field(default_factory=EvalConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    release: ReleaseConfig = field(default_factory=ReleaseConfig)

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


CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        t = _field_types(cls)[f.name]
        if dataclasses.is_dataclass(t):
            keys += _all_keys(t, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except OlmoflowError as e:
                errors.append(e)
        raise errors[0]
    if origin is list:
        (inner,) = typing.get_args(tp) or (Any,)
        if isinstance(value, str | int | float):
            value = [value]
        if not isinstance(value, list):
            raise OlmoflowError(f"config key '{key}' expects a list, got {value!r}")
        return [_coerce(v, inner, key) for v in value]
    if origin is dict or tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-3" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if tp is bool and not isinstance(value, bool):
        raise OlmoflowError(f"config key '{key}' expects true/false, got {value!r}")
    if tp in (int, float, str) and (not isinstance(value, tp) or isinstance(value, bool)):
        raise OlmoflowError(f"config key '{key}' expects {tp.__name__}, got {value!r}")
    return value


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    if not isinstance(data, dict):
        raise OlmoflowError(f"config section '{prefix.rstrip('.') or '<root>'}' must be a mapping")
    hints = _field_types(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        if k not in names:
            # A misspelt section ("trian.max_steps=5") is named by its first full key, so the hint
            # is "train.max_steps" rather than whichever key is closest to the section's name.
            full = f"{prefix}{k}"
            while isinstance(v, dict) and v:
                sub, v = next(iter(v.items()))
                full += f".{sub}"
            hint = closest(full, _all_keys(RunConfig)) or closest(k, names)
            raise OlmoflowError(
                f"unknown config key '{full}'" + (f"; did you mean '{hint}'?" if hint else "")
            )
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            if v is None:
                raise OlmoflowError(f"config section '{prefix}{k}' is empty (null); give its keys "
                                    "or leave it out")
            kwargs[k] = _build(tp, v, f"{prefix}{k}.")
        else:
            kwargs[k] = _coerce(v, tp, f"{prefix}{k}")
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise OlmoflowError(f"config override '{key}': '{p}' is not a section")
    old = node.get(parts[-1])
    if isinstance(old, dict) and isinstance(value, dict):  # "train={max_steps: 1}" merges
        node[parts[-1]] = {**old, **value}
    else:
        node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``key=value``; the value is parsed as YAML (``3``, ``1e-3``, ``true``, ``[a, b]``)."""
    if "=" not in text:
        raise OlmoflowError(f"override '{text}' is not of the form key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def resolve_preset(name_or_path: str) -> Path:
    """Find a YAML config: an existing path, else ``configs/<name>.yaml`` (cwd first, then the repo)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    for base in (Path.cwd() / "configs", CONFIG_DIR):
        cand = base / f"{name_or_path}.yaml"
        if cand.is_file():
            return cand
    presets = sorted(q.stem for q in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.is_dir() else []
    hint = closest(p.stem, presets)
    raise OlmoflowError(
        f"config '{name_or_path}' not found (no such file, and not a preset"
        + (f"; did you mean '{hint}'?)" if hint else f"; presets: {', '.join(presets)})")
    )


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """A YAML config file's top-level mapping (empty file: ``{}``).

    Raises:
        OlmoflowError: invalid YAML (naming ``file:line``), or a top level that is not a mapping.
    """
    try:
        tree = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise OlmoflowError(f"{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(tree, dict):
        raise OlmoflowError(f"{path}: the top level must be a mapping of sections, "
                            f"got a {type(tree).__name__}")
    return tree


def load_config(name_or_path: str | None = "demo", overrides: list[str] | None = None,
                values: dict[str, Any] | None = None) -> RunConfig:
    """Load a YAML preset or file, apply dotted overrides, and return a validated RunConfig.

    ``overrides`` are ``key=value`` strings (values parsed as YAML); ``values`` maps dotted keys to
    Python values, applied last (what CLI flags such as ``--data`` set). A top-level
    ``resume_from`` (``olmoflow pretrain CONFIG resume_from=latest``, the form OLMo's docs use) is
    ``train.resume_from``: ``latest``, a checkpoint directory, or ``stepN``.

    Raises:
        OlmoflowError: missing file, invalid YAML, unknown key (with the closest valid key), or a
            value of the wrong type.
    """
    tree: dict[str, Any] = {}
    if name_or_path:
        tree = read_yaml_mapping(resolve_preset(name_or_path))
    for ov in overrides or []:
        key, value = parse_override(ov)
        _set_dotted(tree, key, value)
    for key, value in (values or {}).items():
        _set_dotted(tree, key, value)
    if "resume_from" in tree:  # OLMo's docs resume with a top-level key; it means train.resume_from
        _set_dotted(tree, "train.resume_from", tree.pop("resume_from"))
    return _build(RunConfig, tree)


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML text."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, allow_unicode=True)
