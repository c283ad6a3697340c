"""Config section of training (``train``), nested as OLMo-core's: one section per part of the
trainer it builds (``optimizer``, ``schedule``, ``checkpoint``, ``parallel``, ``log``).

The tuples of valid names live here and the implementation modules import them from here
(``optim.py``, ``schedule.py``, ``distributed.py``, ``loggers.py``), so reading a config never
imports the trainer and the imports point one way.

Older flat spellings (``train.lr``, ``train.save_interval``, ``train.schedule: cosine``, ...) are
still read: :meth:`TrainConfig.upgrade_keys` moves each to its new place with a one-line note.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from olmoflow.config import note_equivalent, note_renamed
from olmoflow.errors import OlmoflowError, unknown_name_error

OPTIMIZERS = ("adamw", "skip_step_adamw", "muon")
SCHEDULES = ("cosine", "linear", "wsd", "constant")
DATA_PARALLEL = ("ddp", "fsdp", "hsdp")
PIPELINE_SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe")
PIPELINE_SPLITS = ("layers", "cost")
PARAM_DTYPES = ("auto", "fp32", "bf16")
LOGGERS = ("tensorboard", "wandb")
PRECISIONS = ("auto", "fp32", "bf16")


def _check_finite(section: Any, prefix: str) -> None:
    """NaN and infinity are never valid config numbers."""
    for f in fields(section):
        v = getattr(section, f.name)
        if isinstance(v, float) and not math.isfinite(v):
            raise OlmoflowError(f"{prefix}.{f.name} must be a finite number, got {v}")


def _check_non_negative(section: Any, prefix: str, keys: tuple[str, ...], why: str = "") -> None:
    for key in keys:
        if getattr(section, key) < 0:
            raise OlmoflowError(f"{prefix}.{key} must be >= 0{why}, got {getattr(section, key)}")


@dataclass
class OptimizerConfig:
    """``train.optimizer``: which optimizer and its numbers (see :mod:`olmoflow.train.optim`).

    ``type``: ``adamw`` | ``skip_step_adamw`` (skip a step whose loss or grad norm is more than
    ``skip_step_sigma`` standard deviations above the last ``skip_step_window`` steps) | ``muon``
    (Muon for the 2-D hidden matrices at ``muon_lr``; AdamW keeps ``lr`` for the rest). ``lr`` is
    the peak learning rate of the schedule; ``betas`` are AdamW's (beta1, beta2).
    """

    type: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    skip_step_sigma: float = 6.0
    skip_step_window: int = 128
    muon_lr: float = 0.02
    muon_momentum: float = 0.95

    @classmethod
    def upgrade_keys(cls, data: dict[str, Any], prefix: str) -> dict[str, Any]:
        """Read OLMo's optimizer keys, exact equivalents: ``name`` is ``type`` (OLMo's
        ``adamw``; another name is the usual unknown-type error), ``learning_rate`` is ``lr``."""
        for theirs, ours in (("name", "type"), ("learning_rate", "lr")):
            if theirs in data:
                note_equivalent(f"optimizer.{theirs}", f"{prefix}{ours}")
                data[ours] = data.pop(theirs)
        return data

    def __post_init__(self) -> None:
        p = "train.optimizer"
        if self.type not in OPTIMIZERS:
            raise unknown_name_error(f"{p}.type", self.type, OPTIMIZERS)
        _check_finite(self, p)
        if self.lr <= 0:
            raise OlmoflowError(f"{p}.lr must be > 0, got {self.lr}")
        _check_non_negative(self, p, ("weight_decay",))
        if len(self.betas) != 2 or not all(0 <= b < 1 and math.isfinite(b) for b in self.betas):
            raise OlmoflowError(f"{p}.betas must be two numbers in [0, 1) (beta1, beta2), "
                                f"got {self.betas}")
        if self.eps <= 0:
            raise OlmoflowError(f"{p}.eps must be > 0, got {self.eps}")
        if self.skip_step_window < 2:  # the spike test needs a mean and a std of >= 2 earlier steps
            raise OlmoflowError(f"{p}.skip_step_window must be >= 2 steps, got "
                                f"{self.skip_step_window}")
        if self.skip_step_sigma <= 0 or self.muon_lr <= 0 or not 0 <= self.muon_momentum < 1:
            raise OlmoflowError(f"{p}.skip_step_sigma and {p}.muon_lr must be > 0 and "
                                f"{p}.muon_momentum in [0, 1)")


@dataclass
class ScheduleConfig:
    """``train.schedule``: the learning-rate schedule over ``train.max_steps`` optimizer steps
    (see :mod:`olmoflow.train.schedule`): linear warmup over ``warmup_steps``, then ``type``
    (``cosine`` | ``linear`` | ``wsd`` | ``constant``) down to ``min_lr_ratio`` x the peak lr."""

    type: str = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1

    @classmethod
    def upgrade_keys(cls, data: dict[str, Any], prefix: str) -> dict[str, Any]:
        """OLMo's ``scheduler.name`` has no exact equivalent (its warmup starts elsewhere and its
        decay ends at ``alpha_f``): the error names the keys that set the schedule here."""
        if "name" in data:
            name = data["name"]
            ours = next((t for t in SCHEDULES if isinstance(name, str) and name.startswith(t)),
                        None)
            hint = f"{prefix}type={ours}" if ours else f"{prefix}type"
            raise OlmoflowError(
                f"scheduler.name={name!r} is OLMo's scheduler, which olmoflow does not read as "
                f"such: set {hint} (one of {', '.join(SCHEDULES)}), with {prefix}warmup_steps "
                f"and {prefix}min_lr_ratio for OLMo's t_warmup and alpha_f")
        return data

    def __post_init__(self) -> None:
        p = "train.schedule"
        if self.type not in SCHEDULES:
            raise unknown_name_error(f"{p}.type", self.type, SCHEDULES)
        _check_finite(self, p)
        _check_non_negative(self, p, ("warmup_steps",))
        if not 0 <= self.min_lr_ratio <= 1:
            raise OlmoflowError(f"{p}.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass
class CheckpointConfig:
    """``train.checkpoint``: when checkpoints are written and which are kept
    (see :mod:`olmoflow.train.checkpoint`).

    ``save_interval`` steps between saves (0: only at the end); directories are named OLMo's way,
    ``{stage}-step{N}-tokens{T}``; ``keep_every`` keeps the steps that are a multiple of it forever
    and ``keep_last`` the newest K of the others (0: off / keep all); ``resume_from`` is ``latest``,
    ``stepN`` or a checkpoint directory.
    """

    save_interval: int = 500
    keep_every: int = 0
    keep_last: int = 0
    stage: str = "stage1"
    resume_from: str | None = None

    @classmethod
    def upgrade_keys(cls, data: dict[str, Any], prefix: str) -> dict[str, Any]:
        """OLMo's ``reset_trainer_state`` (here, as :data:`OLMO_TRAIN_KEYS` places it): ``true`` is
        what a post-training stage always does from its ``base`` (weights only, a fresh trainer),
        so it is read as that; anything else has no equivalent and the error names the key that
        does the job (``resume_from`` continues a trainer state, ``<stage>.base`` starts from
        weights)."""
        if "reset_trainer_state" not in data:
            return data
        value = data.pop("reset_trainer_state")
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        # a post-training stage's section is ``<stage>.train.checkpoint``, pretraining's
        # ``train.checkpoint``
        stage = prefix.split(".", 1)[0]
        posttrain = bool(prefix) and stage != "train"
        if posttrain and value is True:
            note_equivalent("reset_trainer_state: true", f"{stage}.base (weights only, a fresh "
                            "trainer: what a post-training stage always does)")
            return data
        if posttrain:
            raise OlmoflowError(
                f"reset_trainer_state={shown}: a post-training stage starts from {stage}.base "
                f"with a fresh trainer; to continue a checkpoint's trainer state set "
                f"{prefix}resume_from (latest or a checkpoint directory)")
        raise OlmoflowError(
            f"reset_trainer_state={shown} has no equivalent in pretraining: "
            f"{prefix}resume_from continues a checkpoint with its whole trainer state; to start "
            "from trained weights with a fresh trainer, post-train from them (sft.base)")

    def __post_init__(self) -> None:
        p = "train.checkpoint"
        _check_non_negative(self, p, ("save_interval", "keep_every", "keep_last"), " (0: off)")
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", self.stage):
            raise OlmoflowError(f"{p}.stage '{self.stage}' must be letters, digits, '_', '.' or "
                                "'-' (it names checkpoint directories, e.g. stage1)")


@dataclass
class ParallelConfig:
    """``train.parallel``: how processes under torchrun share the model, OLMo-core's names (see
    :mod:`olmoflow.train.distributed` and :mod:`olmoflow.train.parallel`).

    ``data_parallel``: the data-parallel method, ``ddp`` | ``fsdp`` (FSDP2, ZeRO-3: parameters,
    gradients and optimizer states sharded) | ``hsdp`` (FSDP within groups of ``shard_size``
    ranks, replicated across groups); or an integer, OLMo-core's form, the data-parallel degree
    (sharded with FSDP), checked against the world size. ``tensor_parallel`` and
    ``pipeline_parallel`` are degrees; ``world size = data x tensor x pipeline``.
    ``pipeline_schedule``: ``1f1b`` | ``interleaved_1f1b`` (``stages_per_rank`` >= 2 virtual
    stages per rank) | ``gpipe``; ``pipeline_split``: ``layers`` (equal layer counts) or ``cost``
    (balanced by FLOPs, the LM head and loss counted on the last stage). ``param_dtype``: the
    FSDP ``MixedPrecisionPolicy`` parameter dtype (``auto``: bf16 when ``train.precision`` gives
    bf16, reductions in fp32, fp32 master weights); ``cpu_offload``: FSDP2 offload of
    parameters, gradients and optimizer states to CPU memory (ZeRO-3 offload).
    ``context_parallel`` is accepted for OLMo-core configs and must be 1.
    """

    data_parallel: str | int = "ddp"
    shard_size: int | None = None
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    pipeline_schedule: str = "1f1b"
    stages_per_rank: int = 1
    pipeline_split: str = "layers"
    context_parallel: int = 1
    param_dtype: str = "auto"
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        p = "train.parallel"
        dp = self.data_parallel
        if isinstance(dp, bool) or not isinstance(dp, str | int):
            raise OlmoflowError(f"{p}.data_parallel must be one of {', '.join(DATA_PARALLEL)} or "
                                f"a degree (an integer), got {dp!r}")
        if isinstance(dp, int) and dp < 1:
            raise OlmoflowError(f"{p}.data_parallel degree must be >= 1, got {dp}")
        if isinstance(dp, str) and dp not in DATA_PARALLEL:
            raise unknown_name_error(f"{p}.data_parallel", dp, DATA_PARALLEL)
        for key in ("tensor_parallel", "pipeline_parallel", "stages_per_rank", "context_parallel"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise OlmoflowError(f"{p}.{key} must be an integer >= 1, got {v!r}")
        if self.shard_size is not None and (isinstance(self.shard_size, bool)
                                            or not isinstance(self.shard_size, int)
                                            or self.shard_size < 1):
            raise OlmoflowError(f"{p}.shard_size must be an integer >= 1 (or null), got "
                                f"{self.shard_size!r}")
        if self.shard_size is not None and self.method != "hsdp":
            raise OlmoflowError(f"{p}.shard_size is for data_parallel=hsdp, not {dp}")
        if self.context_parallel != 1:
            raise OlmoflowError(f"{p}.context_parallel={self.context_parallel} is not supported "
                                "(ring attention is not implemented); use 1")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise unknown_name_error(f"{p}.pipeline_schedule", self.pipeline_schedule,
                                     PIPELINE_SCHEDULES)
        if self.pipeline_split not in PIPELINE_SPLITS:
            raise unknown_name_error(f"{p}.pipeline_split", self.pipeline_split, PIPELINE_SPLITS)
        interleaved = self.pipeline_schedule == "interleaved_1f1b"
        if interleaved and self.stages_per_rank < 2 and self.pipeline_parallel > 1:
            raise OlmoflowError(f"{p}.pipeline_schedule=interleaved_1f1b needs "
                                f"{p}.stages_per_rank >= 2, got {self.stages_per_rank}")
        if not interleaved and self.stages_per_rank != 1:
            raise OlmoflowError(f"{p}.stages_per_rank={self.stages_per_rank} needs "
                                f"{p}.pipeline_schedule=interleaved_1f1b "
                                f"(got {self.pipeline_schedule})")
        if self.param_dtype not in PARAM_DTYPES:
            raise unknown_name_error(f"{p}.param_dtype", self.param_dtype, PARAM_DTYPES)
        if not isinstance(self.cpu_offload, bool):
            raise OlmoflowError(f"{p}.cpu_offload must be true or false, got "
                                f"{self.cpu_offload!r}")
        if self.cpu_offload and self.method == "ddp":
            raise OlmoflowError(f"{p}.cpu_offload offloads FSDP shards: it needs data_parallel="
                                "fsdp or hsdp, not ddp")

    @property
    def method(self) -> str:
        """The data-parallel method: ``ddp``, ``fsdp`` or ``hsdp`` (an integer degree: fsdp)."""
        return "fsdp" if isinstance(self.data_parallel, int) else self.data_parallel

    @property
    def degree(self) -> int | None:
        """The data-parallel degree when given as an integer, else None (world / (tp x pp))."""
        return self.data_parallel if isinstance(self.data_parallel, int) else None

    @property
    def model_parallel(self) -> bool:
        """Whether tensor or pipeline parallelism is on."""
        return self.tensor_parallel > 1 or self.pipeline_parallel > 1


@dataclass
class LogConfig:
    """``train.log``: the metrics log (``metrics.jsonl``, see :mod:`olmoflow.train.metrics`):
    a line every ``interval`` steps, per-layer/per-head metrics every ``detailed_interval`` steps
    (0: off), and extra writers ``loggers`` (``tensorboard``, ``wandb`` offline)."""

    interval: int = 10
    detailed_interval: int = 0
    loggers: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        p = "train.log"
        _check_non_negative(self, p, ("interval", "detailed_interval"), " (0: off)")
        for name in self.loggers:
            if name not in LOGGERS:
                raise unknown_name_error(f"{p}.loggers entry", name, LOGGERS)


# ``train.parallel`` keys that say how processes share the work, not what is computed: a run
# saved under one layout resumes under another (torch.distributed.checkpoint reshards), equal
# within fp32 rounding. ``param_dtype`` is not among them: bf16 parameters change the numbers.
LAYOUT_KEYS = tuple(f"parallel.{k}" for k in (
    "data_parallel", "shard_size", "tensor_parallel", "pipeline_parallel", "pipeline_schedule",
    "stages_per_rank", "pipeline_split", "context_parallel", "cpu_offload"))

#: ``TrainConfig`` keys that change how a run is kept, logged or laid out on the machine, not the
#: weights it makes: a stage leaves them out of its fingerprint, so changing one resumes an
#: interrupted run (and leaves a complete one complete) instead of deleting its checkpoints and
#: training again from step 0.
BOOKKEEPING_KEYS = ("checkpoint.resume_from", "checkpoint.save_interval", "checkpoint.keep_every",
                    "checkpoint.keep_last", "num_threads", "log.interval", "log.detailed_interval",
                    "log.loggers", *LAYOUT_KEYS)


def bookkeeping_keys(section: str) -> tuple[str, ...]:
    """:data:`BOOKKEEPING_KEYS` under the dotted key ``section`` of a train section
    (``"sft.train"`` -> ``"sft.train.log.interval"``, ...)."""
    return tuple(f"{section}.{k}" for k in BOOKKEEPING_KEYS)


# Old flat ``train.<key>`` -> its place now (a dotted path under ``train``).
RENAMED = {
    "lr": "optimizer.lr", "weight_decay": "optimizer.weight_decay", "eps": "optimizer.eps",
    "skip_step_sigma": "optimizer.skip_step_sigma",
    "skip_step_window": "optimizer.skip_step_window", "muon_lr": "optimizer.muon_lr",
    "muon_momentum": "optimizer.muon_momentum",
    "warmup_steps": "schedule.warmup_steps", "min_lr_ratio": "schedule.min_lr_ratio",
    "save_interval": "checkpoint.save_interval", "keep_every": "checkpoint.keep_every",
    "keep_last": "checkpoint.keep_last", "stage": "checkpoint.stage",
    "resume_from": "checkpoint.resume_from", "data_parallel": "parallel.data_parallel",
    "log_interval": "log.interval", "detailed_log_interval": "log.detailed_interval",
    "loggers": "log.loggers", "grad_clip": "max_grad_norm", "batch_size": "global_batch_size",
}
# OLMo's trainer keys (its top-level config keys) with an exact equivalent in ``train``:
# instances per optimizer step, instances per device and micro-batch.
OLMO_TRAIN_KEYS = {"global_train_batch_size": "global_batch_size",
                   "device_train_microbatch_size": "micro_batch_size"}


def _max_duration_steps(value: Any, prefix: str) -> Any:
    """OLMo's ``max_duration`` as ``max_steps``: a number of steps is the same thing (``1000``,
    ``"1000"``); epochs (``"2ep"``) and tokens (``"2e12T"``) are not, and the error says what to
    set."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, int) and not isinstance(value, bool):
        note_equivalent("max_duration", f"{prefix}max_steps")
        return value
    text = str(value).strip()
    unit = ("epochs" if text.endswith("ep") else "tokens" if text.endswith("T") else None)
    how = (f"steps = epochs x examples / {prefix}global_batch_size" if unit == "epochs" else
           f"steps = tokens / ({prefix}global_batch_size x {prefix}sequence_length)"
           if unit == "tokens" else "a number of optimizer steps")
    raise OlmoflowError(f"max_duration={value!r}" + (f" counts {unit}" if unit else "")
                        + f"; olmoflow counts optimizer steps: set {prefix}max_steps ({how})")


# A string where a section is now (``train.optimizer: muon``) names its type.
SECTION_TYPES = {"optimizer": "optimizer.type", "schedule": "schedule.type"}


@dataclass
class TrainConfig:
    """Training: batch sizes in instances of ``sequence_length`` tokens, lengths in optimizer steps.

    One optimizer step takes a global batch of ``global_batch_size`` instances in micro-batches of
    ``micro_batch_size`` per process (``auto_micro_batch`` finds the largest that fits, within
    ``memory_budget_gb`` on CPU). ``max_grad_norm`` clips the global gradient norm (0: off).
    ``precision``: ``auto`` (bf16 autocast on GPU, fp32 on CPU) | ``fp32`` | ``bf16``.
    ``activation_checkpointing`` recomputes every n-th block in backward (0: off); ``compile``
    compiles each block. ``packing``: ``concat`` (chunk the token stream) | ``best_fit`` (whole
    documents); ``intra_document_masking`` keeps attention inside documents. ``data``: token
    directories to train on instead of the run's own ``tokens/`` (empty: the run's own).
    """

    sequence_length: int = 256
    global_batch_size: int = 16
    micro_batch_size: int = 16
    max_steps: int = 1000
    max_grad_norm: float = 1.0
    precision: str = "auto"
    activation_checkpointing: int = 0
    compile: bool = False
    auto_micro_batch: bool = False
    memory_budget_gb: float | None = None
    packing: str = "concat"
    intra_document_masking: bool = False
    num_threads: int | None = None
    data: list[str] = field(default_factory=list)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    log: LogConfig = field(default_factory=LogConfig)

    @classmethod
    def upgrade_keys(cls, data: dict[str, Any], prefix: str) -> dict[str, Any]:
        """Move the old flat keys (``lr``, ``save_interval``, ``schedule: cosine``, ``beta1``, ...)
        to their nested places, noting each rename once; a flat key wins over the nested one (it
        was given later, e.g. as an override of a nested preset). ``batch_size`` (OLMo's
        finetuning form) is the global batch; without a ``micro_batch_size`` it is one
        micro-batch too. OLMo's trainer keys with an exact equivalent are read as it, with a
        note (:data:`OLMO_TRAIN_KEYS`, ``max_duration`` given in steps).

        Raises:
            OlmoflowError: ``max_duration`` in epochs or tokens (naming ``max_steps``).
        """
        for theirs, ours in OLMO_TRAIN_KEYS.items():
            if theirs in data:
                note_equivalent(theirs, f"{prefix}{ours}")
                data[ours] = data.pop(theirs)
        if "max_duration" in data:
            data["max_steps"] = _max_duration_steps(data.pop("max_duration"), prefix)
        if "batch_size" in data and "micro_batch_size" not in data:
            data["micro_batch_size"] = data["batch_size"]
        for key, where in SECTION_TYPES.items():
            if key in data and not isinstance(data[key], dict):
                note_renamed(f"{prefix}{key}", f"{prefix}{where}")
                _put(data, where, data.pop(key))
        for key, where in RENAMED.items():
            if key in data:
                note_renamed(f"{prefix}{key}", f"{prefix}{where}")
                _put(data, where, data.pop(key))
        for i, key in enumerate(("beta1", "beta2")):
            if key in data:
                note_renamed(f"{prefix}{key}", f"{prefix}optimizer.betas")
                opt = _section(data, "optimizer")
                betas = list(opt.get("betas", OptimizerConfig().betas))
                if len(betas) == 2:
                    betas[i] = data.pop(key)
                opt["betas"] = betas
        return data

    def __post_init__(self) -> None:
        p = "train"
        _check_finite(self, p)
        if self.sequence_length < 1 or self.global_batch_size < 1 or self.micro_batch_size < 1:
            raise OlmoflowError(f"{p}.sequence_length, global_batch_size and micro_batch_size "
                                "must be >= 1")
        if self.max_steps < 1:
            raise OlmoflowError(f"{p}.max_steps must be >= 1, got {self.max_steps}")
        if self.global_batch_size % self.micro_batch_size:
            raise OlmoflowError(f"{p}.global_batch_size={self.global_batch_size} is not a multiple "
                                f"of {p}.micro_batch_size={self.micro_batch_size}")
        _check_non_negative(self, p, ("max_grad_norm",), " (0: off)")
        _check_non_negative(self, p, ("activation_checkpointing",))
        if self.num_threads is not None and self.num_threads < 0:
            raise OlmoflowError(f"{p}.num_threads must be >= 1 (or 0/null: one share of the "
                                f"cores), got {self.num_threads}")
        if self.precision not in PRECISIONS:
            raise unknown_name_error(f"{p}.precision", self.precision, PRECISIONS)
        for key in ("compile", "auto_micro_batch", "intra_document_masking"):
            if not isinstance(getattr(self, key), bool):
                raise OlmoflowError(f"{p}.{key} must be true or false, got "
                                    f"{getattr(self, key)!r}")
        if self.memory_budget_gb is not None and not self.memory_budget_gb > 0:
            raise OlmoflowError(f"{p}.memory_budget_gb must be > 0 GB (or null: available RAM), "
                                f"got {self.memory_budget_gb}")
        # Imported here: train.packing imports torch, which reading a config does not need.
        from olmoflow.train.packing import PACKINGS

        if self.packing not in PACKINGS:
            raise unknown_name_error(f"{p}.packing", self.packing, PACKINGS)
        self.data = _absolute_paths(self.data, f"{p}.data")


def _section(data: dict[str, Any], name: str) -> dict[str, Any]:
    """The raw mapping of sub-section ``name`` (a copy, so a shared preset tree is not changed)."""
    sub = data.get(name)
    sub = dict(sub) if isinstance(sub, dict) else {}
    data[name] = sub
    return sub


def _put(data: dict[str, Any], where: str, value: Any) -> None:
    """Set the dotted key ``where`` (``optimizer.lr`` or ``max_grad_norm``) in the raw mapping."""
    if "." in where:
        section, key = where.split(".", 1)
        _section(data, section)[key] = value
    else:
        data[where] = value


def _absolute_paths(paths: list[str], key: str) -> list[str]:
    """``paths`` made absolute against the current directory, so a run's fingerprint and its saved
    config name the same directories from wherever they are read again.

    Raises:
        OlmoflowError: an empty path, or one directory named twice (it would be trained on twice).
    """
    out: list[str] = []
    for raw in paths:
        if not str(raw).strip():
            raise OlmoflowError(f"{key} has an empty path; give token directories (or leave it "
                                "out to train on the run's own tokens)")
        path = os.path.abspath(os.path.expanduser(str(raw)))
        if path in out:
            raise OlmoflowError(f"{key} names '{raw}' twice; each token directory is read once "
                                "per epoch already")
        out.append(path)
    return out
