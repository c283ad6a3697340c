"""Optimizers for pretraining, chosen by ``train.optimizer``.

- ``adamw``: AdamW (Loshchilov & Hutter 2019) with OLMo's betas/eps, fused kernel when available.
- ``skip_step_adamw``: AdamW that skips the update of a step whose loss or gradient norm spikes
  above the recent history, as OLMo-core's ``SkipStepAdamW`` (used to train OLMo 2).
- ``muon``: Muon (Keller Jordan 2024; ``torch.optim.Muon``: momentum orthogonalised by
  Newton-Schulz) for the 2-D hidden matrices, AdamW for embeddings, the LM head and norms.

Weight decay follows OLMo 2: on linear weights, not on embeddings or norm weights.
The trainer sets every group's ``lr`` from the schedule each step (:func:`set_lr`): peak
``train.optimizer.lr``, or ``train.optimizer.muon_lr`` for Muon's groups (tagged ``muon: True``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from olmoflow.errors import OlmoflowError
from olmoflow.train.config import OPTIMIZERS, OptimizerConfig, TrainConfig
from olmoflow.train.schedule import lr_at

__all__ = ["OPTIMIZERS", "OptimizerList", "SkipStepAdamW", "build_optimizer", "muon_params",
           "param_groups", "set_lr"]


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


def _adamw(cls, groups, cfg: OptimizerConfig, **extra) -> torch.optim.AdamW:
    beta1, beta2 = cfg.betas
    kw = dict(lr=cfg.lr, betas=(beta1, beta2), eps=cfg.eps, **extra)
    try:
        return cls(groups, fused=True, **kw)
    except (RuntimeError, TypeError):  # no fused kernel for this device/dtype
        return cls(groups, foreach=True, **kw)


class SkipStepAdamW(torch.optim.AdamW):
    """AdamW that skips a step whose loss or grad norm is a spike (OLMo-core ``SkipStepAdamW``).

    Before :meth:`step`, the trainer calls :meth:`observe` with the step's loss and (pre-clipping)
    global grad norm. Once ``window // 2`` earlier steps (at least 2) are in the history, a value
    above ``mean + sigma * std`` of the last ``window`` earlier values (sample std) marks the step
    skipped: :meth:`step` then leaves weights, moments and AdamW's step count untouched. A
    non-finite loss or grad norm is always skipped and never enters the history. (OLMo-core skips
    on ``|z| > sigma``, drops too; only spikes upward are skipped here.)
    The history is part of the trainer state (:meth:`history_state`), so resume stays exact.
    """

    def __init__(self, params, *, sigma: float = 6.0, window: int = 128, **kw):
        super().__init__(params, **kw)
        self.sigma, self.window = float(sigma), int(window)
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.skip = False

    def _spike(self, value: float, history: list[float]) -> bool:
        if not math.isfinite(value):
            return True
        if len(history) < max(2, self.window // 2):
            return False
        mean = sum(history) / len(history)
        std = math.sqrt(sum((h - mean) ** 2 for h in history) / (len(history) - 1))
        return value > mean + self.sigma * std

    def observe(self, loss: float, grad_norm: float) -> bool:
        """Record this step's loss and grad norm; return whether :meth:`step` will skip."""
        self.skip = self._spike(loss, self.losses) or self._spike(grad_norm, self.grad_norms)
        for value, history in ((loss, self.losses), (grad_norm, self.grad_norms)):
            if math.isfinite(value):
                history.append(float(value))
                del history[: -self.window]
        return self.skip

    @torch.no_grad()
    def step(self, closure=None):
        """AdamW's step, or nothing when :meth:`observe` marked this step a spike."""
        if self.skip:
            self.skip = False
            return None
        return super().step(closure)

    def history_state(self) -> dict[str, list[float]]:
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms)}

    def load_history_state(self, state: dict[str, list[float]]) -> None:
        self.losses, self.grad_norms = list(state["losses"]), list(state["grad_norms"])


class OptimizerList:
    """Several torch optimizers stepped as one (Muon for hidden matrices + AdamW for the rest).

    ``param_groups`` and ``state`` are the concatenation of the members'; checkpoints save each
    member through ``torch.distributed.checkpoint`` (see :mod:`olmoflow.train.checkpoint`).
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    def step(self, closure=None) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def muon_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The 2-D hidden matrices Muon should own: weights of ``nn.Linear`` layers, except the output
    head (a module named ``lm_head``) and any weight shared with an embedding."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return [m.weight for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and m.weight.requires_grad and m.weight.ndim == 2
            and name.rsplit(".", 1)[-1] != "lm_head" and id(m.weight) not in embedding_ids]


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig):
    """The optimizer ``cfg.type`` names (``train.optimizer``, an
    :class:`~olmoflow.train.config.OptimizerConfig`).

    Returns a ``torch.optim.AdamW``, a :class:`SkipStepAdamW`, or for ``muon`` an
    :class:`OptimizerList` of ``[AdamW (embeddings, lm_head, norms), torch.optim.Muon (hidden
    matrices, lr ``muon_lr``, momentum ``muon_momentum``, Nesterov, 5 Newton-Schulz steps)]``.

    Raises:
        OlmoflowError: ``muon`` on FSDP-sharded parameters.
    """
    name = cfg.type
    if name == "muon":
        hidden = muon_params(model)
        if any(hasattr(p, "placements") for p in hidden):  # DTensor shards (FSDP2)
            raise OlmoflowError("train.optimizer=muon needs whole matrices (Newton-Schulz), not "
                                "DTensor shards (FSDP2 or tensor parallelism); use "
                                "train.parallel.data_parallel=ddp with tensor_parallel=1")
        hidden_ids = {id(p) for p in hidden}
        groups = [{**g, "params": [p for p in g["params"] if id(p) not in hidden_ids]}
                  for g in param_groups(model, cfg.weight_decay)]
        adamw = _adamw(torch.optim.AdamW, [g for g in groups if g["params"]], cfg)
        muon = torch.optim.Muon(hidden, lr=cfg.muon_lr, momentum=cfg.muon_momentum,
                                weight_decay=cfg.weight_decay, nesterov=True)
        optimizer = OptimizerList([adamw, muon])
    elif name == "skip_step_adamw":
        optimizer = _adamw(SkipStepAdamW, param_groups(model, cfg.weight_decay), cfg,
                           sigma=cfg.skip_step_sigma, window=cfg.skip_step_window)
    else:
        optimizer = _adamw(torch.optim.AdamW, param_groups(model, cfg.weight_decay), cfg)
    for g in optimizer.param_groups:
        g["muon"] = name == "muon" and "ns_steps" in g
    return optimizer


def set_lr(optimizer, step: int, cfg: TrainConfig) -> float:
    """Set every group's lr to the schedule's value at ``step`` (0-based) and return the lr of the
    ``train.optimizer.lr`` groups (what the metrics log as ``lr``); Muon's groups peak at
    ``train.optimizer.muon_lr``."""
    s, o = cfg.schedule, cfg.optimizer
    kw = {"warmup_steps": s.warmup_steps, "max_steps": cfg.max_steps,
          "min_lr_ratio": s.min_lr_ratio, "schedule": s.type}
    lr, muon_lr = lr_at(step, lr=o.lr, **kw), None
    for g in optimizer.param_groups:
        if g.get("muon"):
            muon_lr = muon_lr if muon_lr is not None else lr_at(step, lr=o.muon_lr, **kw)
        g["lr"] = muon_lr if g.get("muon") else lr
    return lr
