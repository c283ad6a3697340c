"""Config section of evaluation (``evaluate``), with its in-loop part (``evaluate.in_loop``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from olmoflow.errors import OlmoflowError

CHECKPOINT_CHOICES = ("latest", "all")
# a checkpoint name (stage1-step150-tokens38K), stepN, or a bare step number
_CHECKPOINT = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9_.-]*-)?step\d+(?:-tokens\d+[KMB]?)?$|^\d+$")


def _check_limit(value: int | None, key: str) -> None:
    if value is not None and (isinstance(value, bool) or value < 1):
        raise OlmoflowError(f"{key}={value} must be >= 1 documents (or null: all)")


def _normalize_tasks(tasks: list[str], key: str) -> list[str]:
    """The specs in canonical form (see :func:`olmoflow.eval.spec.normalize`), their task names
    checked against the registry; a bad spec is one line naming ``key``. ``[]`` means no tasks;
    a value that is only commas and blanks (``","``, ``""``) is an error, not a silent ``[]``."""
    from olmoflow.eval.spec import check_names, normalize

    try:
        specs = normalize(tasks)
    except OlmoflowError as e:
        raise OlmoflowError(f"{key}: {e}") from None
    if tasks and not specs:
        raise OlmoflowError(f"{key}={tasks!r} names no task; give task specs such as arc_easy "
                            "(see 'olmoflow eval list'), or [] for none")
    if specs:
        check_names(specs, key)
    return specs


@dataclass
class InLoopConfig:
    """``evaluate.in_loop``: evaluation inside the training loop (:mod:`olmoflow.eval.in_loop`).

    Every ``interval`` optimizer steps (0: off) the model being trained scores ``tasks`` (specs,
    see :mod:`olmoflow.eval.spec`) on at most ``limit`` documents each, and, with ``bpb``, the
    bits-per-byte of the first ``bpb_tokens`` held-out tokens; the numbers are logged as
    ``eval/<task>/<metric>`` and ``eval/heldout/bpb`` in the training log.
    """

    interval: int = 0
    tasks: list[str] = field(default_factory=list)
    limit: int | None = 100
    bpb: bool = True
    bpb_tokens: int = 8192

    def __post_init__(self) -> None:
        p = "evaluate.in_loop"
        if isinstance(self.interval, bool) or self.interval < 0:
            raise OlmoflowError(f"{p}.interval={self.interval} must be >= 0 steps (0: off)")
        _check_limit(self.limit, f"{p}.limit")
        if not isinstance(self.bpb, bool):
            raise OlmoflowError(f"{p}.bpb must be true or false, got {self.bpb!r}")
        if self.bpb_tokens < 1:
            raise OlmoflowError(f"{p}.bpb_tokens={self.bpb_tokens} must be >= 1")
        self.tasks = _normalize_tasks(self.tasks, f"{p}.tasks")


@dataclass
class EvalConfig:
    """Held-out evaluation: loss, perplexity and bits-per-byte over at most ``max_tokens`` target
    tokens (None: the whole held-out split), every target scored once, in batches of
    ``batch_size`` windows of ``sequence_length`` tokens (None: ``train.sequence_length``).

    ``stride`` (None: disjoint windows) makes the evaluation sliding: each window after the first
    scores the next ``stride`` targets with the ``sequence_length - stride`` tokens before them as
    extra context, as lm-eval's ``loglikelihood_rolling`` and Hugging Face's fixed-length
    perplexity guide do (see :mod:`olmoflow.eval.perplexity`); it costs about
    ``sequence_length / stride`` times the compute.

    Downstream tasks: ``tasks`` are specs (``arc_easy``, ``hellaswag:limit=200``, ``all``; see
    :mod:`olmoflow.eval.spec`) scored on the ``checkpoints`` of pretraining: ``latest``, ``all``,
    or a comma list of checkpoint names or steps (``150,300`` or ``stage1-step450-tokens115K``).
    ``limit`` is the documents per task when a spec gives none (None: all); ``data_dir`` a folder
    of datasets in their published layout (before the copies that install with the project);
    ``strict`` makes a malformed document an error; ``allow_network`` lets a task download its
    data when no local copy is found. The same ``batch_size`` batches the tasks' requests.
    ``in_loop``: see :class:`InLoopConfig`.
    """

    max_tokens: int | None = 200_000
    batch_size: int = 8
    sequence_length: int | None = None
    stride: int | None = None
    tasks: list[str] = field(default_factory=list)
    limit: int | None = None
    data_dir: str | None = None
    strict: bool = False
    allow_network: bool = False
    checkpoints: str = "latest"
    in_loop: InLoopConfig = field(default_factory=InLoopConfig)

    @classmethod
    def upgrade_keys(cls, data: dict[str, Any], prefix: str) -> dict[str, Any]:
        """``checkpoints: 300`` and ``checkpoints: [150, 300]`` (YAML numbers and lists) are the
        comma list ``"150,300"``."""
        value = data.get("checkpoints")
        if isinstance(value, int) and not isinstance(value, bool):
            data["checkpoints"] = str(value)
        elif isinstance(value, list) and all(isinstance(v, str | int) for v in value):
            data["checkpoints"] = ",".join(str(v) for v in value)
        return data

    def __post_init__(self) -> None:
        for key in ("max_tokens", "batch_size", "sequence_length", "stride"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise OlmoflowError(f"evaluate.{key}={value} must be >= 1")
        if self.stride is not None and self.sequence_length is not None \
                and self.stride > self.sequence_length:
            raise OlmoflowError(f"evaluate.stride={self.stride} exceeds "
                                f"evaluate.sequence_length={self.sequence_length}")
        _check_limit(self.limit, "evaluate.limit")
        for key in ("strict", "allow_network"):
            if not isinstance(getattr(self, key), bool):
                raise OlmoflowError(f"evaluate.{key} must be true or false, got "
                                    f"{getattr(self, key)!r}")
        if self.data_dir is not None and not str(self.data_dir).strip():
            raise OlmoflowError("evaluate.data_dir is empty; give a folder or leave it out")
        self.checkpoints = check_checkpoints(self.checkpoints)
        self.tasks = _normalize_tasks(self.tasks, "evaluate.tasks")


def check_checkpoints(value: str) -> str:
    """``evaluate.checkpoints`` in canonical form (``latest``, ``all`` or ``a,b,c`` without
    blanks).

    Raises:
        OlmoflowError: an empty list or an entry that is no checkpoint name or step.
    """
    text = str(value).strip()
    if text in CHECKPOINT_CHOICES:
        return text
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise OlmoflowError("evaluate.checkpoints is empty; give latest, all, or a comma list of "
                            "checkpoint names or steps")
    for p in parts:
        if not _CHECKPOINT.match(p):
            raise OlmoflowError(f"evaluate.checkpoints entry '{p}' is not latest, all, a step "
                                "(150, step150) or a checkpoint name (stage1-step150-tokens38K)")
    return ",".join(parts)
