"""The micro-batch finder (``train.auto_micro_batch: true``): the largest micro-batch that divides
the per-rank batch and fits in memory. The global batch is unchanged (more micro-batches, i.e.
more gradient-accumulation steps), so the gradient is the same: only speed and memory change.

- On CUDA it tries: one forward + backward of a random micro-batch at the full sequence length,
  with the optimizer's moments reserved when they do not exist yet, backing off to the next
  smaller divisor on ``torch.cuda.OutOfMemoryError`` (as PyTorch Lightning's batch-size finder
  and Hugging Face Accelerate's ``find_executable_batch_size`` do, but keeping the global batch).
- On CPU it estimates: the closed forms of :mod:`olmoflow.train.plan` (weights, gradients, AdamW
  moments, activations of this model's blocks) against ``train.memory_budget_gb``, by default
  what this process holds plus the available RAM (psutil), shared by the processes on the node.

Trials run under a forked RNG and leave no gradients behind, so a run with the finder is the
same run (same losses) as one given the chosen micro-batch by hand.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable

import torch

from olmoflow.errors import OlmoflowError
from olmoflow.train import distributed
from olmoflow.train.plan import GB, activation_bytes_per_token, memory_plan
from olmoflow.train.precision import autocast_dtype

log = logging.getLogger(__name__)


def divisors_desc(n: int) -> list[int]:
    """The divisors of ``n`` >= 1, largest first (the micro-batches that tile ``n`` instances)."""
    return sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True)


def find_micro_batch(per_rank_batch: int, fits: Callable[[int], bool]) -> int:
    """The largest divisor ``m`` of ``per_rank_batch`` with ``fits(m)``; tries largest first.

    Raises:
        OlmoflowError: not even a micro-batch of 1 fits.
    """
    for m in divisors_desc(per_rank_batch):
        if fits(m):
            return m
    raise OlmoflowError("train.auto_micro_batch: not even a micro-batch of 1 instance fits in "
                        "memory; shorten train.sequence_length, turn on "
                        "train.activation_checkpointing, use more processes with "
                        "train.parallel.data_parallel=fsdp, or raise train.memory_budget_gb")


def default_budget_bytes(local_world_size: int = 1) -> float:
    """This process's share of the node's memory: its resident size plus the available RAM
    divided among the ``local_world_size`` processes (psutil; /proc/meminfo as a fallback)."""
    try:
        import psutil

        held, available = psutil.Process().memory_info().rss, psutil.virtual_memory().available
    except ImportError:  # psutil is a dependency, but /proc/meminfo does on Linux
        held, available = 0, _meminfo_available()
    return held + available / max(1, local_world_size)


def _meminfo_available() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    raise OlmoflowError("cannot tell the available RAM (no psutil, no /proc/meminfo); set "
                        "train.memory_budget_gb")


def cpu_estimate_fits(model_cfg, *, sequence_length: int, budget_bytes: float, world_size: int,
                      data_parallel: str, act_bytes: int,
                      checkpointing: int) -> Callable[[int], bool]:
    """``fits(m)``: weights + gradients + AdamW moments (sharded under FSDP) + activations and
    logits of an ``m x sequence_length`` micro-batch <= ``budget_bytes`` (plan closed forms; no
    GPU reserve)."""
    plan = memory_plan(model_cfg, world_size=world_size, data_parallel=data_parallel,
                       micro_batch_size=1, sequence_length=sequence_length,
                       precision="fp32" if act_bytes == 4 else "bf16")
    static = plan.static - plan.reserve  # no CUDA context on CPU
    per_instance = sequence_length * (activation_bytes_per_token(model_cfg, act_bytes,
                                                                 checkpointing)
                                      + 8 * model_cfg.vocab_size)
    return lambda m: static + m * per_instance <= budget_bytes


def cuda_trial_fits(model: torch.nn.Module, *, sequence_length: int, vocab_size: int,
                    reserve_bytes: int, amp: torch.dtype | None) -> Callable[[int], bool]:
    """``fits(m)``: a forward + backward of ``[m, sequence_length]`` random tokens succeeds while
    ``reserve_bytes`` (the optimizer state still to come) are held; False on CUDA out-of-memory.
    RNG states are restored and gradients dropped after each try."""
    device = next(model.parameters()).device

    def fits(m: int) -> bool:
        ok = True
        with torch.random.fork_rng(devices=[device]):
            try:
                reserve = torch.empty(reserve_bytes, dtype=torch.uint8, device=device)
                gen = torch.Generator(device=device).manual_seed(0)
                ids = torch.randint(0, vocab_size, (m, sequence_length), device=device,
                                    generator=gen)
                with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                    out = model(ids, ids)
                out.loss.backward()
                torch.cuda.synchronize(device)
                del reserve, ids, out
            except torch.cuda.OutOfMemoryError:
                ok = False
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        return ok

    return fits


def auto_micro_batch(trainer) -> int:
    """The finder for a :class:`~olmoflow.train.trainer.Trainer`: the micro-batch to train with
    (the minimum over ranks), printed by rank 0.

    Raises:
        OlmoflowError: the model is not an olmoflow ``Olmo`` on CPU (no shape to estimate from),
            or nothing fits.
    """
    cfg, info = trainer.cfg, trainer.dist
    per_rank = trainer.per_rank_batch
    inner = distributed.unwrap(trainer.model)
    device = next(inner.parameters()).device
    amp = autocast_dtype(cfg.precision, device)
    model_cfg = getattr(inner, "config", None)
    if device.type == "cuda":
        # DDP: try on the inner module, so a failing rank never leaves a collective half done.
        # FSDP2 (its own module) needs its collectives; every rank tries the same sizes in order.
        optimizers = getattr(trainer.optimizer, "optimizers", [trainer.optimizer])  # Muon + AdamW
        moments_missing = not any(len(s) for o in optimizers for s in o.state.values())
        shard = info.world_size if cfg.parallel.method == "fsdp" else 1
        n_params = sum(p.numel() for p in inner.parameters())
        reserve = int(8 * n_params / shard) if moments_missing else 0
        vocab = getattr(model_cfg, "vocab_size", None)  # ModelConfig, or a transformers config
        if not vocab:
            raise OlmoflowError("train.auto_micro_batch needs the model's vocab_size "
                                "(model.config)")
        fits = cuda_trial_fits(inner, sequence_length=cfg.sequence_length, vocab_size=vocab,
                               reserve_bytes=reserve, amp=amp)
        how = "tried forward+backward on " + str(device)
    else:
        if model_cfg is None or not hasattr(model_cfg, "mlp_hidden"):
            raise OlmoflowError("train.auto_micro_batch on CPU estimates from the model shape and "
                                f"needs an olmoflow Olmo model, got {type(inner).__name__}")
        budget = (cfg.memory_budget_gb * GB if cfg.memory_budget_gb
                  else default_budget_bytes(info.local_world_size))
        fits = cpu_estimate_fits(model_cfg, sequence_length=cfg.sequence_length,
                                 budget_bytes=budget, world_size=info.world_size,
                                 data_parallel=cfg.parallel.method,
                                 act_bytes=2 if amp is not None else 4,
                                 checkpointing=cfg.activation_checkpointing)
        how = f"estimated against a {budget / GB:.3g} GB budget"
    m = distributed.all_reduce_min(find_micro_batch(per_rank, fits), info)
    trainer.micro_batch_choice = {"micro_batch_size": m, "per_rank_batch": per_rank,
                                  "accumulation_steps": per_rank // m, "how": how}
    if info.is_main:
        msg = (f"auto_micro_batch: micro-batch {m} instance(s) x {cfg.sequence_length} tokens, "
               f"{per_rank // m} accumulation step(s) per rank (per-rank batch {per_rank}; {how})")
        print(msg, flush=True)
        log.info(msg)
    return m
