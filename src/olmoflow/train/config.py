"""Config section of training (``train``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from olmoflow.errors import OlmoflowError, unknown_name_error

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
