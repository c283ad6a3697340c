"""The pretraining loop: AdamW, warmup + decay schedule, gradient accumulation normalised over the
whole global batch, gradient clipping, periodic checkpoints, exact resume and a JSONL metrics log.
"""

from __future__ import annotations

import json
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
from olmoflow.model.olmo import IGNORE_INDEX
from olmoflow.train.checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint
from olmoflow.train.schedule import lr_at

METRICS = "metrics.jsonl"


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on the weights of linear layers; none on embeddings and norm weights
    (OLMo 2). Decided by module type, so it also groups a transformers model correctly."""
    decay_ids = {id(m.weight) for m in model.modules()
                 if isinstance(m, torch.nn.Linear) and m.weight.requires_grad}
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if id(p) in decay_ids else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter 2019) with OLMo's betas/eps; fused kernel when available."""
    kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    try:
        return torch.optim.AdamW(param_groups(model, cfg.weight_decay), fused=True, **kw)
    except (RuntimeError, TypeError):  # no fused kernel for this device/dtype
        return torch.optim.AdamW(param_groups(model, cfg.weight_decay), foreach=True, **kw)


class Trainer:
    """Trains ``model`` on ``loader`` for ``cfg.max_steps`` optimizer steps.

    One step consumes one global batch (``cfg.global_batch_size`` instances) in micro-batches of
    ``cfg.micro_batch_size``; every micro-batch loss is divided by the global batch's target-token
    count, so accumulation gives the gradient of one big batch. Checkpoints go to
    ``save_folder/stepN`` every ``cfg.save_interval`` steps and at the end.
    """

    def __init__(self, model: torch.nn.Module, cfg, loader: DataLoader, save_folder: Path,
                 config_yaml: str = "", progress: bool = True):
        # cfg is a TrainConfig, which already checked that micro-batches tile the global batch.
        self.model, self.cfg, self.loader = model, cfg, loader
        self.save_folder = Path(save_folder)
        self.config_yaml, self.progress = config_yaml, progress
        self.optimizer = build_optimizer(model, cfg)
        self.step, self.tokens_seen = 0, 0

    def lr(self, step: int) -> float:
        c = self.cfg
        return lr_at(step, lr=c.lr, warmup_steps=c.warmup_steps, max_steps=c.max_steps,
                     min_lr_ratio=c.min_lr_ratio, schedule=c.schedule)

    def state(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen,
                "data_loader": self.loader.state_dict()}

    def save(self) -> Path:
        return save_checkpoint(self.save_folder, self.step, self.model, self.optimizer,
                               self.state(), self.config_yaml)

    def resume(self, resume_from: str) -> Path:
        """Restore model, optimizer, RNG, step and data position; trims the metrics log to match."""
        path = resolve_checkpoint(self.save_folder, resume_from)
        state = load_checkpoint(path, self.model, self.optimizer)
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.loader.load_state_dict(state["data_loader"])
        log = self.save_folder / METRICS
        if log.is_file():  # drop lines written after the checkpoint we resume from
            lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
            kept = [ln for ln in lines if json.loads(ln)["step"] <= self.step]
            atomic_write_text(log, "".join(ln + "\n" for ln in kept))
        return path

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """One optimizer step on a global batch ``[B, T]``; returns its metrics."""
        model, cfg = self.model, self.cfg
        device = next(model.parameters()).device
        for g in self.optimizer.param_groups:
            g["lr"] = self.lr(self.step)
        n_targets = int((labels != IGNORE_INDEX).sum())
        ce_total = z_total = 0.0
        for mb_ids, mb_labels in zip(input_ids.split(cfg.micro_batch_size),
                                     labels.split(cfg.micro_batch_size)):
            out = model(mb_ids.to(device), mb_labels.to(device), loss_normalizer=n_targets)
            out.loss.backward()
            ce_total += out.ce_loss.item()
            z_total += out.z_loss.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += input_ids.numel()
        return {"loss": ce_total + z_total, "ce_loss": ce_total, "z_loss": z_total,
                "grad_norm": float(grad_norm), "lr": self.optimizer.param_groups[0]["lr"]}

    def fit(self) -> dict[str, Any]:
        """Train until ``max_steps``.

        Ctrl-C stops at the next step boundary, saves a checkpoint and raises KeyboardInterrupt, so
        a resume continues exactly where the run stopped; a second Ctrl-C interrupts at once.
        """
        cfg = self.cfg
        threads = torch.get_num_threads()
        torch.set_num_threads(cfg.num_threads or os.cpu_count() or 1)
        if cfg.resume_from:
            self.resume(cfg.resume_from)
        self.model.train()
        self.save_folder.mkdir(parents=True, exist_ok=True)
        stop = []
        previous = _install_sigint(lambda *_: (stop.append(True), _install_sigint(previous)))
        log = open(self.save_folder / METRICS, "a", buffering=1)
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="pretrain", unit="step",
                   disable=not self.progress, dynamic_ncols=True)
        start, window_t, window_tokens, last = time.time(), time.time(), 0, {}
        try:
            while self.step < cfg.max_steps and not stop:
                t_data = time.time()
                input_ids, labels = self.loader.next_batch()
                data_s = time.time() - t_data
                m = self.train_step(input_ids, labels)
                window_tokens += input_ids.numel()
                bar.update(1)
                logged = cfg.log_interval > 0 and self.step % cfg.log_interval == 0
                if logged or self.step == cfg.max_steps:
                    now = time.time()
                    m.update(step=self.step, tokens=self.tokens_seen, epoch=self.loader.epoch,
                             tokens_per_s=window_tokens / max(now - window_t, 1e-9),
                             data_wait_s=data_s, elapsed_s=now - start)
                    log.write(json.dumps(m) + "\n")
                    bar.set_postfix(loss=f"{m['loss']:.3f}", lr=f"{m['lr']:.2e}",
                                    tok_s=f"{m['tokens_per_s']:.0f}")
                    window_t, window_tokens, last = now, 0, m
                if cfg.save_interval and self.step % cfg.save_interval == 0 and self.step < cfg.max_steps:
                    self.save()
        finally:
            torch.set_num_threads(threads)
            _install_sigint(previous)
            bar.close()
            log.close()
        final = self.save()
        if stop:
            print(f"\ninterrupted at step {self.step}: saved {final}; "
                  "resume with train.resume_from=latest", flush=True)
            raise KeyboardInterrupt
        return {"steps": self.step, "tokens": self.tokens_seen, "final_loss": last.get("loss"),
                "checkpoint": str(final), "elapsed_s": time.time() - start}


def _install_sigint(handler):
    """Set the SIGINT handler (main thread only) and return the previous one."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, handler if handler is not None else signal.default_int_handler)
