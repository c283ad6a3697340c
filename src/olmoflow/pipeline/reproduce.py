"""``olmoflow reproduce RUN --from CHECKPOINT --steps K``: replay training steps and compare them
with the run's own log, bit for bit.

The checkpoint is loaded into the trainer exactly as a resume loads it (model, optimizer moments,
RNG states, data-loader cursor, schedule position), with the config it was trained with (its own
``config.yaml``; ``key=value`` overrides change a setting on purpose), and the same number of CPU
threads as the run used (``train.num_threads``, else the core count): matmul reductions can
depend on it. Then ``K`` optimizer steps run on the same batches. For every step the original
``pretrain/metrics.jsonl`` logged, the replayed ``loss``, ``ce_loss``, ``z_loss``, ``grad_norm``,
``lr``, ``skipped`` and ``tokens`` must equal the logged values exactly (JSON keeps a float's
every bit); the first step where one differs is reported with both values and the difference.

Nothing of the run is written: the replay's trainer works in a temporary folder and saves no
checkpoint. In-loop evaluations are not replayed (they run in eval mode without gradients and do
not change the training state). Pretraining only: post-training stages log other quantities.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from olmoflow.errors import OlmoflowError

COMPARED = ("loss", "ce_loss", "z_loss", "grad_norm", "lr", "skipped", "tokens")


@dataclass(frozen=True)
class Divergence:
    """The first logged value the replay does not reproduce."""

    step: int
    key: str
    logged: float
    replayed: float

    @property
    def abs_diff(self) -> float:
        return abs(self.replayed - self.logged)

    @property
    def rel_diff(self) -> float:
        return self.abs_diff / abs(self.logged) if self.logged else math.inf


@dataclass
class Replay:
    """What :func:`reproduce` did: the checkpoint's step, the steps replayed, the log steps
    compared, and the first divergence (None: every compared value is bit-identical)."""

    checkpoint: Path
    start: int
    steps: int
    compared: list[int]
    divergence: Divergence | None

    @property
    def exact(self) -> bool:
        return self.divergence is None


def read_log(path: Path) -> dict[int, dict[str, Any]]:
    """The lines of a ``metrics.jsonl`` by step (a later line for the same step wins, as after a
    resume that rewrote it).

    Raises:
        OlmoflowError: the file is missing or a line is not a JSON object with a step.
    """
    if not path.is_file():
        raise OlmoflowError(f"no training log at {path}: nothing to compare a replay with")
    out: dict[int, dict[str, Any]] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out[int(row["step"])] = row
        except (ValueError, KeyError, TypeError):
            raise OlmoflowError(f"{path}:{n}: not a JSON object with a 'step'") from None
    return out


def _first_difference(step: int, logged: dict[str, Any], got: dict[str, Any]) -> Divergence | None:
    for key in COMPARED:
        if key in logged and key in got and float(logged[key]) != float(got[key]):
            return Divergence(step, key, float(logged[key]), float(got[key]))
    return None


def reproduce(run: str | Path, checkpoint: str, steps: int,
              overrides: list[str] | None = None) -> Replay:
    """Replay ``steps`` pretraining steps of run directory ``run`` from ``checkpoint`` (a
    checkpoint directory, its name in ``run/pretrain``, ``latest`` or ``stepN``) and compare them
    with the run's log. ``overrides`` (``key=value``) change the replay's config.

    Raises:
        OlmoflowError: not a run directory; no such checkpoint or a damaged one; ``steps`` < 1;
            no logged step within the replayed ones; bad overrides.
    """
    from olmoflow.model.checkpoint_names import parse_checkpoint_name
    from olmoflow.pipeline.config import load_config
    from olmoflow.pipeline.stages.train import PRETRAIN, pretrain_parts
    from olmoflow.run_dir import RunDir, require_run_dir
    from olmoflow.train.checkpoint import resolve_checkpoint
    from olmoflow.train.trainer import Trainer

    run = Path(run)
    require_run_dir(run)
    if steps < 1:
        raise OlmoflowError(f"--steps must be >= 1, got {steps}")
    folder = RunDir(run).stage(PRETRAIN.name)
    ckpt = resolve_checkpoint(folder, checkpoint)
    start = parse_checkpoint_name(ckpt.name)
    log = read_log(folder / "metrics.jsonl")
    wanted = [s for s in sorted(log) if start < s <= start + steps]
    if not wanted:
        after = [s for s in log if s > start]
        hint = ("replay more steps" if after else
                "it is the last logged step; replay from an earlier checkpoint")
        raise OlmoflowError(f"the log {folder / 'metrics.jsonl'} has no step in ({start}, "
                            f"{start + steps}] after {ckpt.name}: nothing to compare; {hint}")
    cfg = load_config(str(ckpt / "config.yaml"), list(overrides or []), {"run_dir": str(run)})
    train = replace(cfg.train, checkpoint=replace(cfg.train.checkpoint, resume_from=str(ckpt),
                                                  save_interval=0))
    tok, _, loader, model, _ = pretrain_parts(cfg)
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="olmoflow-reproduce-") as tmp:
        trainer = Trainer(model, train, loader, Path(tmp), progress=False)
        torch.set_num_threads(train.num_threads or max(1, (os.cpu_count() or 1)
                                                       // trainer.dist.local_world_size))
        try:
            trainer.resume(str(ckpt))
            logged_mbs = log[wanted[0]].get("micro_batch_size")
            if train.auto_micro_batch and logged_mbs:  # the size the run found, not a new search
                trainer.micro_batch_size = int(logged_mbs)
            model.train()
            divergence = None
            for _ in range(wanted[-1] - start):
                m = trainer.train_step(loader.next_batch())
                m["tokens"] = trainer.tokens_seen
                if trainer.step in log:
                    divergence = _first_difference(trainer.step, log[trainer.step], m)
                    if divergence is not None:
                        break
        finally:
            torch.set_num_threads(threads)
    compared = [s for s in wanted if divergence is None or s <= divergence.step]
    return Replay(ckpt, start, trainer.step - start, compared, divergence)


def describe(r: Replay) -> str:
    """The verdict in a few lines."""
    head = (f"replayed steps {r.start + 1}..{r.start + r.steps} from {r.checkpoint.name}; "
            f"{len(r.compared)} logged step(s) compared ({', '.join(COMPARED)})")
    if r.exact:
        return f"{head}\nreproduced exactly: every compared value is bit-identical"
    d = r.divergence
    return (f"{head}\nfirst divergence at step {d.step}: {d.key} logged {d.logged!r}, replayed "
            f"{d.replayed!r} (difference {d.abs_diff:.3g}, relative {d.rel_diff:.3g})")
