"""The pretraining loop: gradient accumulation normalised over the whole global batch, bf16
autocast, activation checkpointing, gradient clipping, the optimizer ``train.optimizer`` names
(:mod:`olmoflow.train.optim`), OLMo-named checkpoints with exact resume, and a JSONL metrics log.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from olmoflow.artifacts import atomic_write_text
from olmoflow.data.loader import DataLoader
from olmoflow.errors import OlmoflowError
from olmoflow.model.olmo import IGNORE_INDEX
from olmoflow.train import distributed
from olmoflow.train.checkpoint import (
    LATEST,
    check_save_folder,
    load_checkpoint,
    read_trainer_state,
    resolve_checkpoint,
    save_checkpoint,
)
from olmoflow.train.loggers import MetricWriters, open_writers
from olmoflow.train.metrics import TrainingMetrics
from olmoflow.train.optim import SkipStepAdamW, build_optimizer, set_lr
from olmoflow.train.schedule import lr_at

METRICS = "metrics.jsonl"
log = logging.getLogger(__name__)


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``train.precision`` on ``device``: ``bf16`` -> bfloat16; ``auto`` ->
    bfloat16 on CUDA, none (fp32) elsewhere; ``fp32`` -> none. Weights stay fp32 either way."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


class Trainer:
    """Trains ``model`` on ``loader`` for ``cfg.max_steps`` optimizer steps.

    One step consumes one global batch (``cfg.global_batch_size`` instances) in micro-batches of
    ``cfg.micro_batch_size``; every micro-batch loss is divided by the global batch's target-token
    count, so accumulation gives the gradient of one big batch. Checkpoints
    (``save_folder/{stage}-step{N}-tokens{T}``, see :mod:`olmoflow.train.checkpoint`) are written
    every ``cfg.save_interval`` steps and at the end, and pruned by ``keep_every``/``keep_last``.

    Raises:
        OlmoflowError: ``activation_checkpointing`` for a model that does not support it.
    """

    def __init__(self, model: torch.nn.Module, cfg, loader: DataLoader, save_folder: Path,
                 config_yaml: str = "", progress: bool = True):
        # cfg is a TrainConfig, which already checked its values.
        self.model, self.cfg, self.loader = model, cfg, loader
        self.save_folder = Path(save_folder)
        self.config_yaml, self.progress = config_yaml, progress
        # Under torchrun: join the process group and wrap for DDP/FSDP2 (train.data_parallel)
        # before the optimizer sees the parameters, which fully_shard replaces by DTensor shards.
        self.dist = distributed.init_from_env()
        self.per_rank_batch = distributed.per_rank_batch(
            cfg.global_batch_size, 1 if cfg.auto_micro_batch else cfg.micro_batch_size, self.dist)
        self.micro_batch_size = cfg.micro_batch_size  # train.auto_micro_batch may change it in fit()
        if cfg.compile:  # per block, as torchtitan: before FSDP wraps them; keeps state-dict keys
            blocks = getattr(model, "blocks", None)
            if blocks is None:
                raise OlmoflowError(f"train.compile needs an olmoflow Olmo model, got {type(model).__name__}")
            for block in blocks:
                block.compile()
        self.model = model = distributed.parallelize(model, cfg.data_parallel, self.dist)
        self.optimizer = build_optimizer(model, cfg)
        self.step, self.tokens_seen = 0, 0
        self.last_loss: float | None = None
        # The detailed log (olmoflow.train.metrics): None when off, so steps pay nothing for it.
        self.metrics = (TrainingMetrics(model, cfg.detailed_log_interval, peak_dtype=autocast_dtype(
            cfg.precision, next(model.parameters()).device)) if cfg.detailed_log_interval else None)
        self.data_state: dict | None = None  # Batch.state of the last batch trained on
        self.saved: tuple[int, Path] | None = None  # (step, dir) of the last checkpoint saved or loaded
        inner = getattr(model, "module", model)  # a DDP wrapper holds the model as .module
        if cfg.activation_checkpointing:
            if not hasattr(inner, "activation_checkpointing"):
                raise OlmoflowError(f"train.activation_checkpointing={cfg.activation_checkpointing}"
                                    f" needs an olmoflow Olmo model, got {type(inner).__name__}")
            inner.activation_checkpointing = cfg.activation_checkpointing

    def lr(self, step: int) -> float:
        """The ``train.lr`` schedule's value at optimizer step ``step`` (0-based)."""
        c = self.cfg
        return lr_at(step, lr=c.lr, warmup_steps=c.warmup_steps, max_steps=c.max_steps,
                     min_lr_ratio=c.min_lr_ratio, schedule=c.schedule)

    def _schedule_state(self) -> dict[str, Any]:
        c = self.cfg
        return {"schedule": c.schedule, "lr": c.lr, "muon_lr": c.muon_lr,
                "warmup_steps": c.warmup_steps, "max_steps": c.max_steps,
                "min_lr_ratio": c.min_lr_ratio}

    def state(self) -> dict[str, Any]:
        """The trainer state a checkpoint holds besides model and optimizer tensors (RNG states are
        added by :func:`save_checkpoint`)."""
        state = {"step": self.step, "tokens_seen": self.tokens_seen,
                 "data_loader": self.data_state or self.loader.state_dict(),
                 "scheduler": {**self._schedule_state(), "step": self.step},
                 "optimizer": {"name": self.cfg.optimizer}}
        if isinstance(self.optimizer, SkipStepAdamW):
            state["optimizer"]["skip_step_history"] = self.optimizer.history_state()
        return state

    def save(self) -> Path:
        c = self.cfg
        path = save_checkpoint(self.save_folder, self.step, self.model, self.optimizer,
                               self.state(), self.config_yaml, stage=c.stage, loss=self.last_loss,
                               keep_every=c.keep_every, keep_last=c.keep_last)
        self.saved = (self.step, path)
        return path

    def _final_checkpoint(self) -> Path:
        """Save the end of the run, unless ``latest`` already is this very step (a stop right
        after a periodic save, or a resume at ``max_steps``): saving it again would delete the
        complete checkpoint before its copy is renamed in."""
        reuse = False
        if self.saved is not None and self.saved[0] == self.step and self.dist.is_main:
            path, pointer = self.saved[1], self.save_folder / LATEST
            reuse = (path.parent.resolve() == self.save_folder.resolve() and pointer.is_file()
                     and pointer.read_text().strip() == path.name)
        # Rank 0 decides for all: save_checkpoint is collective.
        if distributed.broadcast_object(reuse) and self.saved is not None:
            return self.saved[1]
        return self.save()

    def resume(self, resume_from: str) -> Path:
        """Restore model, optimizer, RNG, step, data position and skip-step history; trim the
        metrics log to the checkpoint's step. Returns the checkpoint directory.

        Raises:
            OlmoflowError: no such checkpoint, or it was saved with another ``train.optimizer``.
        """
        path = resolve_checkpoint(self.save_folder, resume_from)
        saved_optimizer = read_trainer_state(path).get("optimizer", {}).get("name", "adamw")
        adam_family = {"adamw", "skip_step_adamw"}  # the same state: switching between them is fine
        if saved_optimizer != self.cfg.optimizer and {saved_optimizer, self.cfg.optimizer} - adam_family:
            raise OlmoflowError(f"checkpoint '{path}' was trained with train.optimizer="
                                f"{saved_optimizer}, not {self.cfg.optimizer}")
        state = load_checkpoint(path, self.model, self.optimizer)
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.loader.load_state_dict(state["data_loader"])
        self.data_state = None
        history = state.get("optimizer", {}).get("skip_step_history")
        if history is not None and isinstance(self.optimizer, SkipStepAdamW):
            self.optimizer.load_history_state(history)
        saved = {k: v for k, v in state.get("scheduler", {}).items() if k != "step"}
        self.saved = (self.step, path)
        if saved and saved != self._schedule_state() and self.dist.is_main:
            log.warning("resuming %s with a changed lr schedule: %s -> %s", path.name, saved,
                        self._schedule_state())
        metrics = self.save_folder / METRICS
        if metrics.is_file() and self.dist.is_main:  # drop lines written after the checkpoint
            lines = [ln for ln in metrics.read_text().splitlines() if ln.strip()]
            kept = [ln for ln in lines if json.loads(ln)["step"] <= self.step]
            atomic_write_text(metrics, "".join(ln + "\n" for ln in kept))
        return path

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor,
                   doc_ids: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step on a global batch ``[B, T]``; returns its metrics. ``doc_ids [B, T]``
        (intra-document masking) keeps attention inside each document.

        ``skipped`` is 1 when a skip-step optimizer dropped the update (loss/grad-norm spike).
        """
        model, cfg = self.model, self.cfg
        device = next(model.parameters()).device
        lr = set_lr(self.optimizer, self.step, cfg)
        amp = autocast_dtype(cfg.precision, device)
        # Each rank takes its slice of the global batch. The normaliser is the GLOBAL target count
        # divided by world_size, because DDP/FSDP average the ranks' gradients: their sum is then
        # the gradient of the whole global batch, as in one process (train.distributed).
        d, global_tokens = self.dist, input_ids.numel()
        input_ids, labels = distributed.shard_batch(input_ids, d), distributed.shard_batch(labels, d)
        doc_ids = None if doc_ids is None else distributed.shard_batch(doc_ids, d)
        n_targets = distributed.all_reduce_sum(int((labels != IGNORE_INDEX).sum()), d)
        normalizer = n_targets / d.world_size if d.world_size > 1 else n_targets
        if self.metrics is not None:
            self.metrics.start_step(self.step + 1, input_ids, doc_ids)
        ce_total = z_total = 0.0
        mbs = self.micro_batch_size
        n_micro = len(input_ids.split(mbs))
        mb_docs = doc_ids.split(mbs) if doc_ids is not None else [None] * n_micro
        for i, (mb_ids, mb_labels, mb_doc) in enumerate(zip(input_ids.split(mbs),
                                                            labels.split(mbs), mb_docs)):
            docs = {} if mb_doc is None else {"doc_ids": mb_doc.to(device)}
            with distributed.gradient_sync(model, i == n_micro - 1):  # DDP: reduce once per step
                with (torch.autocast(device.type, dtype=amp) if amp else contextlib.nullcontext()):
                    out = model(mb_ids.to(device), mb_labels.to(device), loss_normalizer=normalizer,
                                **docs)
                out.loss.backward()
            ce_total += out.ce_loss.item()
            z_total += out.z_loss.item()
        if self.metrics is not None:
            self.metrics.after_backward()
        grad_norm = distributed.to_float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                        cfg.grad_clip or math.inf))
        if d.world_size > 1:  # every rank sees the global loss (a skip-step decision is collective)
            reduced = distributed.all_reduce_mean({"ce": ce_total, "z": z_total}, d)
            ce_total, z_total = reduced["ce"], reduced["z"]
        loss = ce_total + z_total
        skipped = (self.optimizer.observe(loss, grad_norm)
                   if isinstance(self.optimizer, SkipStepAdamW) else False)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += global_tokens
        self.last_loss = loss
        detail = self.metrics.end_step(input_ids.numel()) if self.metrics is not None else {}
        return {"loss": loss, "ce_loss": ce_total, "z_loss": z_total, "grad_norm": grad_norm,
                "lr": lr, "skipped": int(skipped), **detail}

    def fit(self) -> dict[str, Any]:
        """Train until ``max_steps``.

        Ctrl-C stops at the next step boundary, saves a checkpoint and raises KeyboardInterrupt, so
        a resume continues exactly where the run stopped; a second Ctrl-C interrupts at once.
        """
        cfg = self.cfg
        threads = torch.get_num_threads()
        # Processes on one node share its cores.
        check_save_folder(self.save_folder, METRICS)  # fail now, not at the first save
        torch.set_num_threads(cfg.num_threads
                              or max(1, (os.cpu_count() or 1) // self.dist.local_world_size))
        if cfg.resume_from:
            self.resume(cfg.resume_from)
        if cfg.auto_micro_batch:
            from olmoflow.train.batch_finder import auto_micro_batch

            self.micro_batch_size = auto_micro_batch(self)
        self.model.train()
        self.save_folder.mkdir(parents=True, exist_ok=True)
        log_file = (open_writers(self.save_folder, METRICS, cfg.loggers, self.config_yaml, self.step)
                    if self.dist.is_main else MetricWriters([]))  # only rank 0 logs
        # Installed after the writers open: a writer that fails to open leaves Ctrl-C as it was.
        stop = []
        previous = _install_sigint(lambda *_: (stop.append(True), _install_sigint(previous)))
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="pretrain", unit="step",
                   disable=not (self.progress and self.dist.is_main), dynamic_ncols=True)
        start, window_t, window_tokens, last = time.time(), time.time(), 0, {}
        interrupted = False
        try:
            while self.step < cfg.max_steps:
                # Under torchrun the ranks stop together, even when the signal reaches them a step
                # apart: a rank stopping alone would save (a collective) while the others train.
                if distributed.all_reduce_sum(len(stop), self.dist) > 0:
                    interrupted = True
                    break
                t_data = time.time()
                batch = self.loader.next_batch()
                data_s = time.time() - t_data
                m = self.train_step(batch.input_ids, batch.labels, batch.doc_ids)
                self.data_state = batch.state
                window_tokens += batch.input_ids.numel()
                bar.update(1)
                logged = cfg.log_interval > 0 and self.step % cfg.log_interval == 0
                detailed = "perf/step_s" in m  # a detailed step is always logged
                if logged or detailed or self.step == cfg.max_steps:
                    now = time.time()
                    m.update(step=self.step, tokens=self.tokens_seen, epoch=self.loader.epoch,
                             tokens_per_s=window_tokens / max(now - window_t, 1e-9),
                             data_wait_s=data_s, elapsed_s=now - start,
                             micro_batch_size=self.micro_batch_size)
                    log_file.log(m, self.step)
                    bar.set_postfix(loss=f"{m['loss']:.3f}", lr=f"{m['lr']:.2e}",
                                    tok_s=f"{m['tokens_per_s']:.0f}")
                    window_t, window_tokens, last = now, 0, m
                if cfg.save_interval and self.step % cfg.save_interval == 0 and self.step < cfg.max_steps:
                    self.save()
        finally:
            torch.set_num_threads(threads)
            _install_sigint(previous)
            bar.close()
            log_file.close()
        final = self._final_checkpoint()
        if interrupted:
            print(f"\ninterrupted at step {self.step}: saved {final}; run the same command again "
                  "(or add resume_from=latest) to resume", flush=True)
            raise KeyboardInterrupt
        return {"steps": self.step, "tokens": self.tokens_seen, "final_loss": last.get("loss"),
                "checkpoint": str(final), "elapsed_s": time.time() - start}


def _install_sigint(handler):
    """Set the SIGINT handler (main thread only) and return the previous one."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, handler if handler is not None else signal.default_int_handler)
