"""GRPO on the shared Trainer: :class:`GRPOObjective`, the loss side of RL with verifiable rewards.

The loop is :class:`~olmoflow.train.trainer.Trainer`'s; the data is
:class:`~olmoflow.posttrain.rollout.RolloutLoader` (fresh rollouts from the current policy each
step); this objective turns a rollout batch into the token-level clipped surrogate of
:func:`~olmoflow.posttrain.losses.grpo_token_loss`, as open-instruct's ``grpo_fast`` trains OLMo 3
(DAPO's asymmetric clip 0.2 / 0.272, token-level normalisation ``loss_denominator="token"``, no
KL term by default; Yu et al. 2025; OLMo 3 report).

Usage::

    loader = RolloutLoader(model, tokenizer, prompts, prompts_per_step=16, group_size=8,
                           sampling=SamplingParams(max_new_tokens=64, temperature=1.0), seed=0)
    Trainer(model, cfg, loader, save_folder, objective=GRPOObjective()).fit()
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from olmoflow.errors import OlmoflowError, unknown_name_error
from olmoflow.posttrain.losses import GRPO_NORMALIZATIONS, grpo_token_loss
from olmoflow.posttrain.rollout import RolloutBatch, response_logps
from olmoflow.train import distributed
from olmoflow.train.objectives import Batch, Objective

REQUIRED = ("input_ids", "attention_mask", "response_mask", "advantages")


class GRPOObjective(Objective):
    """The GRPO policy loss over a rollout batch (see :class:`RolloutLoader` for the fields).

    Per micro-batch: the policy's log-probabilities of the response tokens (logits divided by
    the sampling temperature), then :func:`~olmoflow.posttrain.losses.grpo_token_loss`. The
    reduction is over the **global** batch, so gradient accumulation equals one big batch:

    - ``loss_type="token"`` (default; open-instruct's ``loss_denominator="token"``, TRL's
      ``"dapo"``): summed token losses / the global batch's response-token count;
    - ``"sequence"`` (DeepSeekMath's GRPO): per-sequence token means, summed / global sequences;
    - ``"constant"`` (Dr. GRPO): summed token losses / (global sequences x ``max_length``).

    Metrics: ``loss``, ``entropy`` (mean token entropy of the policy on response tokens, nats),
    ``clip_frac`` (share of response tokens whose gradient the clip removes) with its
    ``clip_ratio/low_mean`` / ``clip_ratio/high_mean`` parts, ``ratio/mean``, ``kl`` (k3 to the
    reference, when ``ref_logps`` are in the batch), and the loader's ``rollout/...`` metrics
    (reward, pass@1, pass@G, response length, filtered share).

    Args:
        clip_low, clip_high: ratio clip range ``[1 - clip_low, 1 + clip_high]`` (OLMo 3:
            0.2 / 0.272).
        loss_type: one of :data:`~olmoflow.posttrain.losses.GRPO_NORMALIZATIONS`.
        kl_coef: weight of the k3 KL to the reference (0 = none, as OLMo 3); > 0 needs the loader
            built with ``ref_model``.
        max_length: ``"constant"`` only: the maximum response length (the sampler's
            ``max_new_tokens``).
        temperature: divide logits by it; None takes the loader's sampling temperature.
    Raises:
        OlmoflowError: an unknown ``loss_type`` (naming the closest); negative clip ranges or
            ``kl_coef``; ``"constant"`` without ``max_length``.
    """

    name = "grpo"

    def __init__(self, *, clip_low: float = 0.2, clip_high: float = 0.272,
                 loss_type: str = "token", kl_coef: float = 0.0, max_length: int | None = None,
                 temperature: float | None = None):
        if loss_type not in GRPO_NORMALIZATIONS:
            raise unknown_name_error("GRPO loss_type", loss_type, GRPO_NORMALIZATIONS)
        if clip_low < 0 or clip_high < 0:
            raise OlmoflowError(f"GRPO clip ranges must be >= 0, got clip_low={clip_low} "
                                f"clip_high={clip_high}")
        if kl_coef < 0:
            raise OlmoflowError(f"GRPO kl_coef must be >= 0, got {kl_coef}")
        if loss_type == "constant" and not max_length:
            raise OlmoflowError("GRPO loss_type 'constant' needs max_length (the sampler's "
                                "max_new_tokens)")
        if temperature is not None and not temperature > 0:
            raise OlmoflowError(f"GRPO temperature must be > 0, got {temperature}")
        self.clip_low, self.clip_high = clip_low, clip_high
        self.loss_type, self.kl_coef, self.max_length = loss_type, kl_coef, max_length
        self.temperature = temperature
        self._temperature = temperature or 1.0
        self._rollout_metrics: dict[str, float] = {}
        self._global_tokens = 1.0

    def prepare(self, raw: Any) -> Batch:
        """The tensor fields of a :class:`~olmoflow.posttrain.rollout.RolloutBatch` (its metrics
        and temperature are kept for this step), or of a mapping with the same fields.

        Raises:
            OlmoflowError: a missing field; ``kl_coef > 0`` without ``ref_logps``.
        """
        if isinstance(raw, RolloutBatch):
            fields, self._rollout_metrics = dict(raw.fields), dict(raw.metrics)
            self._temperature = self.temperature or raw.temperature
        elif isinstance(raw, Mapping):
            fields, self._rollout_metrics = dict(raw), {}
            self._temperature = self.temperature or 1.0
        else:
            raise OlmoflowError(f"a GRPO batch must be a RolloutBatch or a dict of tensors, got "
                                f"{type(raw).__name__}")
        missing = [k for k in REQUIRED if k not in fields]
        if missing:
            raise OlmoflowError(f"a GRPO batch needs {', '.join(missing)} (has "
                                f"{', '.join(fields)})")
        if self.kl_coef and "ref_logps" not in fields:
            raise OlmoflowError("GRPO kl_coef > 0 needs ref_logps: build the RolloutLoader with "
                                "ref_model=")
        keep = (*REQUIRED, "old_logps", "ref_logps")
        return {k: v for k, v in fields.items() if k in keep}

    def num_tokens(self, batch: Batch) -> int:
        """Real (non-padding) tokens of the batch, prompts and responses."""
        return int(batch["attention_mask"].sum())

    def normalizer(self, batch: Batch, dist: distributed.DistInfo) -> float:
        """Global response tokens (``"token"``) or global sequences (the other types), divided
        by the world size (the ranks' gradients are averaged); 0 when the global batch has no
        response token at all (the trainer then skips it)."""
        n_tokens = distributed.all_reduce_sum(int(batch["response_mask"].sum()), dist)
        n_seqs = distributed.all_reduce_sum(int(batch["input_ids"].shape[0]), dist)
        ws = dist.world_size
        self._global_tokens = max(1, n_tokens) / ws
        if n_tokens == 0:
            return 0.0
        count = n_tokens if self.loss_type == "token" else n_seqs
        return max(1, count) / ws

    def loss(self, model: torch.nn.Module, micro_batch: Batch,
             normalizer: float) -> tuple[torch.Tensor, dict[str, float]]:
        mb = micro_batch
        mask = mb["response_mask"].bool()
        logps, logits = response_logps(model, mb["input_ids"], mb["attention_mask"], mask,
                                       self._temperature)
        ref = mb.get("ref_logps")
        kw: dict[str, Any] = {"normalization": self.loss_type}
        if self.loss_type == "token":
            kw["normalizer"] = normalizer
        elif self.loss_type == "constant":
            kw["max_length"] = self.max_length
        # Without the sampler's log-probabilities the policy is the one that sampled (one update
        # per rollout batch): the ratio is exactly 1 and only its gradient counts.
        old = mb["old_logps"] if "old_logps" in mb else logps.detach()
        out = grpo_token_loss(logps, old, mb["advantages"], mask,
                              clip_low=self.clip_low, clip_high=self.clip_high,
                              kl_coef=self.kl_coef, ref_logps=ref, **kw)
        loss = out.loss
        if self.loss_type != "token":  # per-micro-batch means -> a share of the global mean
            loss = loss * (mask.shape[0] / normalizer)
        with torch.no_grad():
            lf = logits.float()
            entropy = torch.logsumexp(lf, -1) - (lf.softmax(-1) * lf).sum(-1)
            n = mask.sum()
            w = float(n) / self._global_tokens  # this micro-batch's share of the global tokens
            metrics = {"loss": loss.item(),
                       "entropy": float((entropy * mask).sum()) / self._global_tokens,
                       "clip_frac": float(out.stats["clip_ratio/region_mean"]) * w,
                       "clip_ratio/low_mean": float(out.stats["clip_ratio/low_mean"]) * w,
                       "clip_ratio/high_mean": float(out.stats["clip_ratio/high_mean"]) * w,
                       "ratio/mean": float(out.stats["ratio/mean"]) * w}
            if "kl" in out.stats:
                metrics["kl"] = float(out.stats["kl"]) * w
        return loss, metrics

    def step_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        return {**totals, **self._rollout_metrics}
