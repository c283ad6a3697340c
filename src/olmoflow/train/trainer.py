"""The training loop: gradient accumulation normalised over the whole global batch, bf16
autocast, activation checkpointing, gradient clipping, the optimizer ``train.optimizer`` names
(:mod:`olmoflow.train.optim`), OLMo-named checkpoints with exact resume, a JSONL metrics log and
in-loop callbacks (:mod:`olmoflow.train.callbacks`). What is optimised (the batch fields, the
normaliser, the loss) is an objective (:mod:`olmoflow.train.objectives`; language modelling by
default), so post-training objectives reuse this loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from olmoflow.artifacts import atomic_write_text
from olmoflow.errors import OlmoflowError, Terminated
from olmoflow.train import distributed
from olmoflow.train.callbacks import Callback
from olmoflow.train.checkpoint import (
    LATEST,
    check_save_folder,
    checkpoint_loss,
    load_checkpoint,
    read_trainer_state,
    remove_stale_leftovers,
    resolve_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from olmoflow.train.config import TrainConfig
from olmoflow.train.loader import DataLoader
from olmoflow.train.loggers import MetricWriters, open_writers
from olmoflow.train.metrics import TrainingMetrics
from olmoflow.train.objectives import LMObjective, Objective, check_plain
from olmoflow.train.optim import SkipStepAdamW, build_optimizer, set_lr
from olmoflow.train.precision import autocast_dtype
from olmoflow.train.schedule import lr_at

__all__ = ["METRICS", "Trainer", "autocast_dtype", "build_optimizer"]

METRICS = "metrics.jsonl"
# Global batches in a row without a target token after which the data is taken to have none.
MAX_EMPTY_BATCHES = 1000
log = logging.getLogger(__name__)


class Trainer:
    """Trains ``model`` on ``loader`` for ``cfg.max_steps`` optimizer steps of ``objective``.

    One step consumes one global batch (``cfg.global_batch_size`` instances, whatever the loader's
    ``next_batch()`` returns, made a dict of ``[B, ...]`` tensors by ``objective.prepare``) in
    micro-batches of ``cfg.micro_batch_size`` per process; every micro-batch loss is divided by
    the objective's global-batch normaliser (for :class:`LMObjective`, the target-token count), so
    accumulation gives the gradient of one big batch. Checkpoints
    (``save_folder/{stage}-step{N}-tokens{T}``, see :mod:`olmoflow.train.checkpoint`) are written
    every ``cfg.checkpoint.save_interval`` steps and at the end, pruned by ``keep_every`` /
    ``keep_last``, and hold the objective's state. ``callbacks`` run every ``interval`` steps and
    log ``eval/...`` metrics.

    Raises:
        OlmoflowError: ``activation_checkpointing`` or ``compile`` for a model that does not
            support it.
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, loader: DataLoader,
                 save_folder: Path, config_yaml: str = "", progress: bool = True,
                 objective: Objective | None = None, callbacks: list[Callback] | tuple = (),
                 resume_hint: str = "resume_from=latest"):
        # cfg is a TrainConfig, which already checked its values.
        self.model, self.cfg, self.loader = model, cfg, loader
        self.objective = objective if objective is not None else LMObjective()
        self.callbacks = list(callbacks)
        self.save_folder = Path(save_folder)
        self.config_yaml, self.progress = config_yaml, progress
        self.resume_hint = resume_hint  # the override named after Ctrl-C
        # Under torchrun: join the process group and lay the model out (train.parallel: DDP,
        # FSDP2, tensor and pipeline parallel) before the optimizer sees the parameters, which
        # fully_shard and parallelize_module replace by DTensor shards.
        self.dist = distributed.init_from_env()
        # train.auto_micro_batch may change it in fit()
        self.micro_batch_size = cfg.micro_batch_size
        if cfg.compile:  # per block, as torchtitan: before FSDP wraps them; keeps state-dict keys
            blocks = getattr(model, "blocks", None)
            if blocks is None:
                raise OlmoflowError("train.compile needs an olmoflow Olmo model, got "
                                    f"{type(model).__name__}")
            for block in blocks:
                block.compile()
        if cfg.activation_checkpointing:  # before the pipeline split: each stage copies it
            if not hasattr(model, "activation_checkpointing"):
                raise OlmoflowError(f"train.activation_checkpointing={cfg.activation_checkpointing}"
                                    f" needs an olmoflow Olmo model, got {type(model).__name__}")
            model.activation_checkpointing = cfg.activation_checkpointing
        # The data-parallel view (rank, size and group of the data-parallel ranks): it slices
        # the global batch and normalises the loss. The whole world without model parallelism.
        from olmoflow.train.parallel.layout import resolve_layout

        resolve_layout(cfg.parallel, self.dist.world_size)  # an integer data_parallel is checked
        self.dp, self.pipeline, self.pp_group = self.dist, None, None
        self.layout = None  # a parallel.layout.Layout under tensor/pipeline parallelism or HSDP
        if cfg.parallel.model_parallel or cfg.parallel.method == "hsdp":
            from olmoflow.train.parallel.compose import parallelize_model

            laid_out = parallelize_model(model, cfg, self.dist,
                                         autocast_dtype(cfg.precision, self.dist.device))
            self.model = model = laid_out.model
            self.dp, self.pipeline, self.pp_group = laid_out.dp, laid_out.pipeline, \
                laid_out.pp_group
            self.layout = laid_out.layout
        else:
            from olmoflow.train.parallel.compose import fsdp_options

            options = (fsdp_options(cfg.parallel, self.dist.device,
                                    autocast_dtype(cfg.precision, self.dist.device))
                       if cfg.parallel.method == "fsdp" and self.dist.world_size > 1 else None)
            self.model = model = distributed.parallelize(model, cfg.parallel.method, self.dist,
                                                         options)
        fsdp = (self.layout.dp > 1 if self.layout is not None
                else cfg.parallel.method == "fsdp" and self.dist.world_size > 1)
        if not fsdp and (cfg.parallel.param_dtype == "bf16" or cfg.parallel.cpu_offload):
            key = "param_dtype=bf16" if cfg.parallel.param_dtype == "bf16" else "cpu_offload"
            raise OlmoflowError(f"train.parallel.{key} is a setting of FSDP2, which this run does "
                                "not use (it needs data_parallel=fsdp or hsdp over more than one "
                                "data-parallel rank); for bf16 compute use train.precision=bf16")
        if cfg.parallel.model_parallel and not isinstance(self.objective, LMObjective):
            raise OlmoflowError(f"the '{self.objective.name}' objective reads whole-vocabulary "
                                "logits; train.parallel.tensor_parallel and pipeline_parallel > 1 "
                                "train language-modelling objectives (pretraining, SFT) only")
        if self.callbacks and cfg.parallel.model_parallel:
            raise OlmoflowError("in-loop evaluation runs the whole model in one process; under "
                                "train.parallel.tensor_parallel or pipeline_parallel > 1 turn it "
                                "off (evaluate.in_loop.interval=0) and evaluate the checkpoints "
                                "after training (olmoflow evaluate)")
        self.per_rank_batch = distributed.per_rank_batch(
            cfg.global_batch_size, 1 if cfg.auto_micro_batch else cfg.micro_batch_size, self.dp)
        self.optimizer = build_optimizer(model, cfg.optimizer)
        self.step, self.tokens_seen = 0, 0
        self.empty_batches = 0  # global batches skipped for having no target token
        self.last_loss: float | None = None
        # The detailed log (olmoflow.train.metrics): None when off, so steps pay nothing for it.
        detailed = cfg.log.detailed_interval
        self.metrics = (TrainingMetrics(model, detailed, peak_dtype=autocast_dtype(
            cfg.precision, next(model.parameters()).device)) if detailed else None)
        self.data_state: dict | None = None  # Batch.state of the last batch trained on
        # (step, dir) of the last checkpoint saved or loaded
        self.saved: tuple[int, Path] | None = None

    def lr(self, step: int) -> float:
        """The ``train.schedule`` value at optimizer step ``step`` (0-based), peak
        ``train.optimizer.lr``."""
        c, s = self.cfg, self.cfg.schedule
        return lr_at(step, lr=c.optimizer.lr, warmup_steps=s.warmup_steps, max_steps=c.max_steps,
                     min_lr_ratio=s.min_lr_ratio, schedule=s.type)

    def _schedule_state(self) -> dict[str, Any]:
        # Key names as in checkpoints written before the config was nested, so they compare equal.
        c, s = self.cfg, self.cfg.schedule
        return {"schedule": s.type, "lr": c.optimizer.lr, "muon_lr": c.optimizer.muon_lr,
                "warmup_steps": s.warmup_steps, "max_steps": c.max_steps,
                "min_lr_ratio": s.min_lr_ratio}

    def state(self) -> dict[str, Any]:
        """The trainer state a checkpoint holds besides model and optimizer tensors (RNG states are
        added by :func:`save_checkpoint`).

        Raises:
            OlmoflowError: the objective's state is not plain data.
        """
        objective = self.objective.state_dict()
        check_plain(objective, f"objective '{self.objective.name}' state")
        state = {"step": self.step, "tokens_seen": self.tokens_seen,
                 "data_loader": self.data_state or self.loader.state_dict(),
                 "scheduler": {**self._schedule_state(), "step": self.step},
                 "optimizer": {"name": self.cfg.optimizer.type},
                 "objective": {"name": self.objective.name, "state": objective}}
        if isinstance(self.optimizer, SkipStepAdamW):
            state["optimizer"]["skip_step_history"] = self.optimizer.history_state()
        if self.empty_batches:
            state["empty_batches"] = self.empty_batches
        return state

    def save(self) -> Path:
        """Write a checkpoint of this step (collective under torchrun); returns its directory."""
        c = self.cfg.checkpoint
        path = save_checkpoint(self.save_folder, self.step, self.model, self.optimizer,
                               self.state(), self.config_yaml, stage=c.stage, loss=self.last_loss,
                               keep_every=c.keep_every, keep_last=c.keep_last,
                               flat_optimizer=self.pipeline is not None)
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
        """Restore model, optimizer, RNG, step, data position, skip-step history and the
        objective's state; trim the metrics log to the checkpoint's step. Returns the checkpoint
        directory.

        Raises:
            OlmoflowError: no such checkpoint, its files changed since it was saved, or it was
                saved with another ``train.optimizer.type`` or another objective.
        """
        path = resolve_checkpoint(self.save_folder, resume_from)
        # Before anything of it is read: dcp unpickles .metadata.
        verify_checkpoint(path, collective=True)
        saved = read_trainer_state(path)
        saved_optimizer = saved.get("optimizer", {}).get("name", "adamw")
        want = self.cfg.optimizer.type
        adam_family = {"adamw", "skip_step_adamw"}  # the same state: switching between them is fine
        if saved_optimizer != want and {saved_optimizer, want} - adam_family:
            raise OlmoflowError(f"checkpoint '{path}' was trained with train.optimizer.type="
                                f"{saved_optimizer}, not {want}")
        saved_objective = saved.get("objective", {}).get("name", LMObjective.name)
        if saved_objective != self.objective.name:
            raise OlmoflowError(f"checkpoint '{path}' was trained with the '{saved_objective}' "
                                f"objective, not '{self.objective.name}'")
        state = load_checkpoint(path, self.model, self.optimizer, verify=False)  # verified above
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.empty_batches = int(state.get("empty_batches", 0))
        self.loader.load_state_dict(state["data_loader"])
        self.data_state = None
        history = state.get("optimizer", {}).get("skip_step_history")
        if history is not None and isinstance(self.optimizer, SkipStepAdamW):
            self.optimizer.load_history_state(history)
        if "objective" in state:
            self.objective.load_state_dict(state["objective"]["state"])
        saved = {k: v for k, v in state.get("scheduler", {}).items() if k != "step"}
        self.saved = (self.step, path)
        if saved and saved != self._schedule_state() and self.dist.is_main:
            log.warning("resuming %s with a changed lr schedule: %s -> %s", path.name, saved,
                        self._schedule_state())
        # The loss of the checkpoint's step is the run's final loss when no step is left to train
        # (a resume at max_steps): exact from the trainer state or the log line of that step, else
        # (older checkpoints, no log) rounded from checkpoints.csv.
        self.last_loss = state.get("loss")
        metrics = self.save_folder / METRICS
        if metrics.is_file() and self.dist.is_main:  # drop lines written after the checkpoint
            lines = [ln for ln in metrics.read_text().splitlines() if ln.strip()]
            kept = [ln for ln in lines if json.loads(ln)["step"] <= self.step]
            atomic_write_text(metrics, "".join(ln + "\n" for ln in kept))
            if self.last_loss is None:
                at_step = [r for ln in kept if (r := json.loads(ln))["step"] == self.step]
                self.last_loss = at_step[-1].get("loss") if at_step else None
        if self.last_loss is None:
            self.last_loss = checkpoint_loss(path)
        return path

    def train_step(self, batch: Any) -> dict[str, float]:
        """One optimizer step on a global batch; returns its metrics.

        ``batch`` is what the loader yields (or a dict of ``[B, ...]`` tensors), made a batch by
        ``objective.prepare``: for language modelling ``input_ids``, ``labels`` and, with
        intra-document masking, ``doc_ids`` (``[B, T]``). ``skipped`` is 1 when a skip-step
        optimizer dropped the update (loss/grad-norm spike). A global batch without any target
        (the objective's normaliser is 0: every label ignored) is not trained on: it returns
        None, the step does not advance, and :attr:`empty_batches` counts it.

        Raises:
            OlmoflowError: the batch's fields do not share one leading (batch) dimension.
        """
        model, cfg, objective = self.model, self.cfg, self.objective
        device = next(model.parameters()).device
        lr = set_lr(self.optimizer, self.step, cfg)
        amp = autocast_dtype(cfg.precision, device)
        fields = objective.prepare(batch)
        sizes = {k: v.shape[0] for k, v in fields.items()}
        if len(set(sizes.values())) != 1:
            raise OlmoflowError("the fields of a batch must share the batch dimension, got "
                                f"{sizes}")
        # Each rank takes its slice of the global batch. The objective's normaliser is global
        # (all-reduced) and divided by world_size, because DDP/FSDP average the ranks' gradients:
        # their sum is then the gradient of the whole global batch, as in one process.
        d, global_tokens = self.dp, objective.num_tokens(fields)
        fields = {k: distributed.shard_batch(v, d) for k, v in fields.items()}
        normalizer = objective.normalizer(fields, d)
        if normalizer == 0:
            # Nothing of the whole global batch is trained (the count is all-reduced: every rank
            # agrees): no forward, no update, no step; counted, and the data cursor moves on.
            self.empty_batches += 1
            if self.dist.is_main:
                log.warning("the global batch after step %d has no target token (nothing to "
                            "train: every label ignored); skipped without an update (%d so far)",
                            self.step, self.empty_batches)
            return None
        probe = self.metrics if "input_ids" in fields else None
        if probe is not None:
            ids = fields["input_ids"]
            # a preference batch is [B, 2, T]: the probe sees its sequences as rows
            probe.start_step(self.step + 1, ids.flatten(0, -2) if ids.dim() > 2 else ids,
                             fields.get("doc_ids"))
        autocast = torch.autocast(device.type, dtype=amp) if amp else contextlib.nullcontext()
        if self.pipeline is not None:
            totals = self._pipeline_step(fields, normalizer, device, autocast)
        else:
            totals = self._accumulate(fields, normalizer, device, autocast)
        if probe is not None:
            probe.after_backward()
        grad_norm = distributed.clip_grad_norm(model.parameters(), cfg.max_grad_norm or math.inf,
                                               self.pp_group)
        if d.world_size > 1:  # every rank sees the global loss (a skip-step decision is collective)
            totals = distributed.all_reduce_mean(totals, d)
        m = objective.step_metrics(totals)
        loss_value = m["loss"]
        skipped = (self.optimizer.observe(loss_value, grad_norm)
                   if isinstance(self.optimizer, SkipStepAdamW) else False)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += global_tokens
        self.last_loss = loss_value
        detail = probe.end_step(objective.num_tokens(fields)) if probe is not None else {}
        return {**m, "grad_norm": grad_norm, "lr": lr, "skipped": int(skipped), **detail}

    def _accumulate(self, fields, normalizer: float, device, autocast) -> dict[str, float]:
        """Forward and backward of this rank's slice in micro-batches of
        :attr:`micro_batch_size`; the summed metrics of the objective."""
        chunks = {k: v.split(self.micro_batch_size) for k, v in fields.items()}
        n_micro = len(next(iter(chunks.values())))
        totals: dict[str, float] = {}
        for i in range(n_micro):
            micro = {k: c[i].to(device) for k, c in chunks.items()}
            # DDP: reduce once per step
            with distributed.gradient_sync(self.model, i == n_micro - 1):
                with autocast:
                    loss, metrics = self.objective.loss(self.model, micro, normalizer)
                loss.backward()
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v
        return totals

    def _pipeline_step(self, fields, normalizer: float, device, autocast) -> dict[str, float]:
        """The pipeline schedule over this rank's slice (language modelling: the LM loss on
        the last stage); the cross-entropy and z-loss totals of the last stage, summed onto
        every pipeline rank.

        Raises:
            OlmoflowError: the batch asks for intra-document masking.
        """
        if "doc_ids" in fields:
            raise OlmoflowError("intra-document masking (doc_ids in the batch) is not supported "
                                "with train.parallel.pipeline_parallel > 1: the stages pass "
                                "hidden states only; train without it (train."
                                "intra_document_masking=false; for SFT sft.packing=false)")
        with autocast:
            totals = self.pipeline.step(fields["input_ids"].to(device),
                                        fields["labels"].to(device), normalizer)
        # Only the last stage saw the loss: its totals, summed over the pipeline ranks.
        t = torch.tensor([totals["ce_loss"], totals["z_loss"]], dtype=torch.float64,
                         device=device)
        torch.distributed.all_reduce(t, group=self.pp_group)
        return {"ce_loss": t[0].item(), "z_loss": t[1].item()}

    def run_callbacks(self) -> dict[str, float]:
        """Run the callbacks due after this step; their metrics as ``eval/<name>``.

        Under ``torch.no_grad`` and saved RNG states (torch, numpy, random), and the model is put
        back in train mode, so evaluation leaves the training numbers as they were."""
        due = [cb for cb in self.callbacks if cb.due(self.step)]
        if not due:
            return {}
        device = next(self.model.parameters()).device
        out: dict[str, float] = {}
        py_state, np_state = random.getstate(), np.random.get_state()
        try:
            devices = [device] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                for cb in due:
                    for k, v in (cb.on_step(self, self.step) or {}).items():
                        out[k if k.startswith("eval/") else f"eval/{k}"] = v
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
            self.model.train()
        return out

    def fit(self) -> dict[str, Any]:
        """Train until ``max_steps``.

        Ctrl-C stops at the next step boundary, saves a checkpoint and raises KeyboardInterrupt, so
        a resume continues exactly where the run stopped; a second Ctrl-C interrupts at once.
        SIGTERM (``kill``, Slurm's ``scancel`` and time limit, torchrun passing either on) stops
        and saves the same way and raises :class:`~olmoflow.errors.Terminated`; a second
        SIGTERM terminates at once.
        """
        cfg = self.cfg
        threads = torch.get_num_threads()
        # Processes on one node share its cores.
        check_save_folder(self.save_folder, METRICS)  # fail now, not at the first save
        if self.dist.is_main:  # what a killed save left: no save is under way yet
            remove_stale_leftovers(self.save_folder)
        torch.set_num_threads(cfg.num_threads
                              or max(1, (os.cpu_count() or 1) // self.dist.local_world_size))
        if cfg.checkpoint.resume_from:
            self.resume(cfg.checkpoint.resume_from)
        if cfg.auto_micro_batch:
            from olmoflow.train.batch_finder import auto_micro_batch

            self.micro_batch_size = auto_micro_batch(self)
        self.model.train()
        self.save_folder.mkdir(parents=True, exist_ok=True)
        log_file = (open_writers(self.save_folder, METRICS, cfg.log.loggers, self.config_yaml,
                                 self.step)
                    if self.dist.is_main else MetricWriters([]))  # only rank 0 logs
        # Installed after the writers open: a writer that fails to open leaves Ctrl-C as it was.
        stop: list[int] = []  # the signals received
        previous = _install_stop_handlers(stop)
        name = self.objective.name
        bar = tqdm(total=cfg.max_steps, initial=self.step,
                   desc="pretrain" if name == LMObjective.name else name, unit="step",
                   disable=not (self.progress and self.dist.is_main), dynamic_ncols=True)
        start, window_t, window_tokens = time.time(), time.time(), 0
        interrupted = False
        empty_run = 0  # global batches in a row without a target
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
                tokens_before = self.tokens_seen
                m = self.train_step(batch)
                self.data_state = getattr(batch, "state", None)
                if m is None:  # no target in the batch: nothing trained, the step not taken
                    empty_run += 1
                    if empty_run >= MAX_EMPTY_BATCHES:
                        raise OlmoflowError(
                            f"{empty_run} global batches in a row after step {self.step} have no "
                            "target token (every label ignored): the data has nothing to train "
                            "on")
                    continue
                empty_run = 0
                window_tokens += self.tokens_seen - tokens_before
                bar.update(1)
                evals = self.run_callbacks()
                m.update(evals)
                logged = cfg.log.interval > 0 and self.step % cfg.log.interval == 0
                detailed = "perf/step_s" in m  # a detailed step is always logged
                if logged or detailed or evals or self.step == cfg.max_steps:
                    now = time.time()
                    m.update(step=self.step, tokens=self.tokens_seen, epoch=self.loader.epoch,
                             tokens_per_s=window_tokens / max(now - window_t, 1e-9),
                             data_wait_s=data_s, elapsed_s=now - start,
                             micro_batch_size=self.micro_batch_size)
                    log_file.log(m, self.step)
                    bar.set_postfix(loss=f"{m['loss']:.3f}", lr=f"{m['lr']:.2e}",
                                    tok_s=f"{m['tokens_per_s']:.0f}")
                    window_t, window_tokens = now, 0
                every = cfg.checkpoint.save_interval
                if every and self.step % every == 0 and self.step < cfg.max_steps:
                    self.save()
        finally:
            torch.set_num_threads(threads)
            _restore_handlers(previous)
            bar.close()
            log_file.close()
        final = self._final_checkpoint()
        if interrupted:
            term = signal.SIGTERM in stop
            if self.dist.is_main:
                print(f"\n{'terminated (SIGTERM)' if term else 'interrupted'} at step {self.step}: "
                      f"saved {final}; run the same command again (or add {self.resume_hint}) "
                      "to resume", flush=True)
            raise Terminated(signal.SIGTERM) if term else KeyboardInterrupt
        # last_loss, not the last log line: a resume at max_steps trains and logs nothing.
        out = {"steps": self.step, "tokens": self.tokens_seen, "final_loss": self.last_loss,
               "checkpoint": str(final), "elapsed_s": time.time() - start}
        if self.empty_batches:
            out["empty_batches"] = self.empty_batches
        return out


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _install_stop_handlers(stop: list[int]) -> dict:
    """Make SIGINT and SIGTERM append their number to ``stop`` (the loop stops at the next step
    boundary and saves), each once: the handler then puts back the one it replaced, so the
    same signal again acts at once (a second Ctrl-C interrupts, a second SIGTERM kills).
    Main thread only (elsewhere nothing is installed); returns the replaced handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous: dict = {}

    def handler(signum, frame):
        stop.append(signum)
        _restore_handlers({signum: previous[signum]})

    for sig in _STOP_SIGNALS:
        previous[sig] = signal.signal(sig, handler)
    return previous


def _restore_handlers(previous: dict) -> None:
    """Put back the handlers :func:`_install_stop_handlers` replaced (None, set outside
    Python, becomes the default)."""
    for sig, handler in previous.items():
        if handler is None:
            handler = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        signal.signal(sig, handler)
