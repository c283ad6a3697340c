"""Post-training objectives: sequence log-probabilities, the DPO family, and GRPO.

Pure tensor math, no model or trainer state, so each formula is tested in isolation against the
reference implementations (TRL's ``DPOTrainer`` / ``CPOTrainer`` / ``GRPOTrainer``, open-instruct's
``dpo_norm``) and the papers:

- DPO: Rafailov et al. 2023, "Direct Preference Optimization"; conservative DPO (label smoothing)
  as in Mitchell 2023 / TRL's ``cDPO``.
- Length-normalized DPO: OLMo 2 / OLMo 3 / Tülu 3 (open-instruct ``dpo_loss_type=dpo_norm``; TRL
  ``loss_type="sigmoid_norm"``): the log-ratios are averaged per response token.
- SimPO: Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward".
- GRPO: Shao et al. 2024 (DeepSeekMath) group-relative advantages; the token-level clipped
  surrogate with separate low/high clip ranges of DAPO (Yu et al. 2025, "clip-higher"; OLMo 3 RL
  used 0.2 / 0.272); the k3 KL estimator (Schulman 2020, "Approximating KL divergence") as TRL
  adds it per token.

Units: log-probabilities are natural-log nats, summed over tokens unless stated otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from olmoflow.errors import OlmoflowError, unknown_name_error
from olmoflow.model.olmo import IGNORE_INDEX
from olmoflow.posttrain.config import DPO_LOSS_TYPES, GRPO_NORMALIZATIONS

ADVANTAGE_SCALES = ("std", "none")


# --------------------------------------------------------------------------------------------
# Log-probabilities


def token_logps(logits: torch.Tensor, labels: torch.Tensor,
                loss_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities of ``labels`` under ``logits``.

    Labels are **already shifted**, the convention of :meth:`olmoflow.model.olmo.Olmo.forward`:
    ``labels[b, t]`` is the token that position ``t`` predicts (``input_ids[b, t + 1]``), and
    ``IGNORE_INDEX`` (-100) marks positions without a target. (TRL's ``get_batch_logps`` takes
    unshifted labels and drops ``logits[:, -1]`` / ``labels[:, 0]`` itself; pass
    ``logits[:, :-1], input_ids[:, 1:]`` here for the same numbers.)

    Args:
        logits: ``[B, T, V]`` any float dtype; computed in fp32.
        labels: ``[B, T]`` long.
        loss_mask: optional ``[B, T]`` (bool / 0-1), ANDed with ``labels != IGNORE_INDEX``.
    Returns:
        ``(logps [B, T] fp32, mask [B, T] bool)``; ``logps`` is 0 where ``mask`` is False.
    Raises:
        ValueError: shapes disagree.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} must "
                         "agree on [B, T]")
    mask = labels != IGNORE_INDEX
    if loss_mask is not None:
        if loss_mask.shape != labels.shape:
            raise ValueError(f"loss_mask {tuple(loss_mask.shape)} must match labels "
                             f"{tuple(labels.shape)}")
        mask = mask & loss_mask.bool()
    logits = logits.float()
    target = labels.clamp_min(0).unsqueeze(-1)
    # log p = logit[target] - logsumexp(logits): no [B, T, V] log_softmax copy kept around.
    logp = logits.gather(-1, target).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return logp.masked_fill(~mask, 0.0), mask


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor,
                   loss_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probability of each sequence's target tokens (the DPO / SimPO input).

    Same conventions as :func:`token_logps` (labels already shifted, ``IGNORE_INDEX`` skipped).

    Returns:
        ``(sum_logps [B] fp32, n_tokens [B] long)``: nats summed over the counted tokens, and how
        many were counted (divide for the per-token average the length-normalized losses use).
    """
    logp, mask = token_logps(logits, labels, loss_mask)
    return logp.sum(-1), mask.sum(-1)


# --------------------------------------------------------------------------------------------
# DPO family


@dataclass
class DPOOutput:
    """Result of :func:`dpo_loss`.

    ``loss`` is the scalar mean over pairs (differentiable); ``losses [B]`` the per-pair losses;
    ``chosen_rewards`` / ``rejected_rewards [B]`` the implicit rewards, detached: ``beta *
    (policy - reference)`` log-ratios (per-token averaged for ``length_normalized``, as
    open-instruct logs ``dpo_norm``), and ``beta * average log-prob`` for SimPO (as TRL's CPO logs
    it). ``stats`` holds detached scalars named as TRL logs them.
    """

    loss: torch.Tensor
    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    stats: dict[str, torch.Tensor] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """The stats as Python floats (one device sync per value; call at logging time)."""
        return {k: float(v) for k, v in self.stats.items()}


def _check_pair(name: str, a: torch.Tensor, ref: torch.Tensor) -> None:
    if a.shape != ref.shape or a.dim() != 1:
        raise ValueError(f"{name} must be [B] like policy_chosen_logps {tuple(ref.shape)}, "
                         f"got {tuple(a.shape)}")


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None = None,
    ref_rejected_logps: torch.Tensor | None = None,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    gamma: float = 0.5,
    chosen_n_tokens: torch.Tensor | None = None,
    rejected_n_tokens: torch.Tensor | None = None,
) -> DPOOutput:
    """Preference loss on summed sequence log-probabilities (``[B]`` each, nats).

    With ``d`` the preference margin below, every type uses the conservative-DPO form
    ``loss = -(1 - eps) * logsigmoid(beta * d) - eps * logsigmoid(-beta * d)`` (``eps =
    label_smoothing``; 0 gives the plain Bradley-Terry loss), averaged over the batch:

    - ``"sigmoid"`` (DPO, Rafailov et al. 2023; TRL ``loss_type="sigmoid"``, its label-smoothed
      form TRL's cDPO): ``d = (pi_c - ref_c) - (pi_r - ref_r)``.
    - ``"length_normalized"`` (OLMo 2/3, Tülu 3; open-instruct ``dpo_norm``, TRL
      ``"sigmoid_norm"``): ``d = (pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r``, i.e. the
      log-ratios averaged per response token; OLMo ran it with ``beta = 5``.
    - ``"simpo"`` (Meng et al. 2024; TRL ``CPOTrainer`` ``loss_type="simpo"``): no reference,
      ``d = pi_c / n_c - pi_r / n_r - gamma / beta`` (``gamma`` the target reward margin).

    Identical chosen and rejected responses give ``d = 0`` and the loss ``ln 2`` for the first two.

    Args:
        policy_chosen_logps, policy_rejected_logps: ``[B]`` policy sums (carry the gradient).
        ref_chosen_logps, ref_rejected_logps: ``[B]`` reference sums (detached here: the
            reference is frozen); required except for SimPO, which must not get them.
        beta: inverse temperature (> 0).
        loss_type: one of :data:`DPO_LOSS_TYPES`.
        label_smoothing: probability that a label is flipped, in ``[0, 0.5)``.
        gamma: SimPO's reward margin (nats per token times beta; TRL's ``simpo_gamma``).
        chosen_n_tokens, rejected_n_tokens: ``[B]`` response token counts (from
            :func:`sequence_logps`), required by ``length_normalized`` and ``simpo``.
    Returns:
        :class:`DPOOutput` with stats ``rewards/chosen``, ``rewards/rejected``,
        ``rewards/accuracies`` (fraction of pairs with chosen reward > rejected),
        ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` (batch means).
    Raises:
        OlmoflowError: unknown ``loss_type`` (naming the closest), ``beta <= 0``,
            ``label_smoothing`` outside ``[0, 0.5)``.
        ValueError: missing or extra reference / token-count tensors, or shapes that disagree.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise unknown_name_error("DPO loss_type", loss_type, DPO_LOSS_TYPES)
    if not beta > 0:
        raise OlmoflowError(f"DPO beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise OlmoflowError(f"DPO label_smoothing must be in [0, 0.5), got {label_smoothing}")
    pc, pr = policy_chosen_logps, policy_rejected_logps
    _check_pair("policy_rejected_logps", pr, pc)
    has_ref = ref_chosen_logps is not None or ref_rejected_logps is not None
    if loss_type == "simpo":
        if has_ref:
            raise ValueError("SimPO is reference-free: do not pass ref_*_logps")
    elif ref_chosen_logps is None or ref_rejected_logps is None:
        raise ValueError(f"loss_type '{loss_type}' needs ref_chosen_logps and ref_rejected_logps")
    normalized = loss_type in ("length_normalized", "simpo")
    if normalized:
        if chosen_n_tokens is None or rejected_n_tokens is None:
            raise ValueError(f"loss_type '{loss_type}' needs chosen_n_tokens and "
                             "rejected_n_tokens")
        _check_pair("chosen_n_tokens", chosen_n_tokens, pc)
        _check_pair("rejected_n_tokens", rejected_n_tokens, pc)
        # An empty response would divide by zero; count it as one token (TRL clamps the same).
        nc = chosen_n_tokens.to(pc.dtype).clamp_min(1)
        nr = rejected_n_tokens.to(pc.dtype).clamp_min(1)

    if loss_type == "simpo":
        chosen_score, rejected_score = pc / nc, pr / nr
        d = chosen_score - rejected_score - gamma / beta
    else:
        _check_pair("ref_chosen_logps", ref_chosen_logps, pc)
        _check_pair("ref_rejected_logps", ref_rejected_logps, pc)
        chosen_score = pc - ref_chosen_logps.detach()
        rejected_score = pr - ref_rejected_logps.detach()
        if normalized:
            chosen_score, rejected_score = chosen_score / nc, rejected_score / nr
        d = chosen_score - rejected_score

    losses = -F.logsigmoid(beta * d)
    if label_smoothing:
        losses = (1 - label_smoothing) * losses - label_smoothing * F.logsigmoid(-beta * d)
    chosen_rewards = beta * chosen_score.detach()
    rejected_rewards = beta * rejected_score.detach()
    stats = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": pc.detach().mean(),
        "logps/rejected": pr.detach().mean(),
    }
    return DPOOutput(losses.mean(), losses, chosen_rewards, rejected_rewards, stats)


# --------------------------------------------------------------------------------------------
# GRPO


def _check_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N * G], got {tuple(rewards.shape)}")
    if group_size < 2:
        raise OlmoflowError(f"GRPO needs at least 2 samples per prompt (group_size), "
                            f"got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.view(-1, group_size)


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: str = "std",
                     eps: float = 1e-4) -> torch.Tensor:
    """GRPO's group-relative advantages (Shao et al. 2024, DeepSeekMath; TRL ``GRPOTrainer``).

    ``rewards`` holds ``N`` prompts' groups of ``G = group_size`` consecutive samples (prompt-major,
    the order TRL and our sampler produce). Each sample's advantage is its reward minus its group's
    mean, with ``scale="std"`` also divided by ``group std + eps`` (the unbiased, Bessel-corrected
    std, as TRL's ``scale_rewards="group"`` with its ``eps = 1e-4``); ``scale="none"`` is Dr. GRPO's
    unscaled form (Liu et al. 2025, TRL ``scale_rewards="none"``). A group whose rewards are all
    equal gets advantage 0 (see :func:`filter_equal_groups`).

    Args:
        rewards: ``[N * G]`` float rewards.
        group_size: ``G`` (>= 2).
        scale: one of :data:`ADVANTAGE_SCALES`.
        eps: added to the std before dividing.
    Returns:
        ``[N * G]`` fp32 advantages (no gradient).
    Raises:
        OlmoflowError: unknown ``scale``, ``group_size < 2``.
        ValueError: ``rewards`` not 1-D or not a multiple of ``group_size``.
    """
    if scale not in ADVANTAGE_SCALES:
        raise unknown_name_error("advantage scale", scale, ADVANTAGE_SCALES)
    g = _check_groups(rewards.detach().float(), group_size)
    adv = g - g.mean(dim=1, keepdim=True)
    if scale == "std":
        adv = adv / (g.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def filter_equal_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Which samples to train on: False for every sample of a group whose rewards are all equal.

    Such a group (all solved or all failed) has zero advantage and so contributes no policy
    gradient, only dilution of the token normalizer; open-instruct's ``grpo_fast`` and DAPO's
    dynamic sampling drop them before packing.

    Args:
        rewards: ``[N * G]``, prompt-major groups of ``group_size``.
    Returns:
        ``[N * G]`` bool keep-mask (index the batch with it; ``1 - keep.float().mean()`` is the
        fraction filtered, TRL's ``frac_reward_zero_std``).
    Raises:
        OlmoflowError / ValueError: as :func:`group_advantages`.
    """
    g = _check_groups(rewards.detach(), group_size)
    varied = g.amax(dim=1) != g.amin(dim=1)
    return varied.repeat_interleave(group_size)


@dataclass
class GRPOOutput:
    """Result of :func:`grpo_token_loss`: the scalar ``loss`` (differentiable) and detached scalar
    ``stats`` (TRL's names): ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
    ``clip_ratio/region_mean`` (fractions of response tokens), ``ratio/mean``, ``kl`` (mean k3 per
    token; only with a reference)."""

    loss: torch.Tensor
    stats: dict[str, torch.Tensor] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """The stats as Python floats (one device sync per value; call at logging time)."""
        return {k: float(v) for k, v in self.stats.items()}


def grpo_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.272,
    kl_coef: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    normalization: str = "token",
    normalizer: float | torch.Tensor | None = None,
    max_length: int | None = None,
) -> GRPOOutput:
    """The token-level clipped GRPO surrogate (TRL ``GRPOTrainer._compute_loss``, open-instruct).

    Per response token, with ``r = exp(logps - old_logps)`` and the sequence's advantage ``A``::

        l = -min(r * A, clamp(r, 1 - clip_low, 1 + clip_high) * A) + kl_coef * k3
        k3 = exp(ref - logps) - (ref - logps) - 1        (>= 0; TRL's per-token KL estimator)

    then reduced over the response tokens (``mask``) by ``normalization``:

    - ``"token"``: sum over every token of the batch / their count (or / ``normalizer``, the
      token count of the whole global batch under gradient accumulation). TRL ``loss_type="dapo"``
      (``"bnpo"`` without a normalizer); DAPO's token-level loss; what open-instruct uses.
    - ``"sequence"``: mean over each sequence's tokens, then over sequences. TRL
      ``loss_type="grpo"``, the original DeepSeekMath form (long responses weigh less per token).
    - ``"constant"``: sum / (``B * max_length``). TRL ``loss_type="dr_grpo"`` (Liu et al. 2025,
      "Understanding R1-Zero-Like Training"), no length bias.

    The clip ranges are asymmetric (DAPO's clip-higher; OLMo 3 used 0.2 / 0.272). Only ``logps``
    carries the gradient: ``old_logps`` and ``ref_logps`` are detached here.

    Args:
        logps: ``[B, T]`` current policy log-probs of the sampled tokens (from :func:`token_logps`).
        old_logps: ``[B, T]`` log-probs under the policy that sampled them.
        advantages: ``[B]`` per-sequence advantages (:func:`group_advantages`), or ``[B, T]``.
        mask: ``[B, T]`` 1 on response tokens that count.
        clip_low, clip_high: ratio clip range ``[1 - clip_low, 1 + clip_high]``.
        kl_coef: weight of the k3 KL to the reference (0: no KL term, the OLMo 3 default).
        ref_logps: ``[B, T]`` reference log-probs; required when ``kl_coef != 0``, and when given
            the KL is reported in ``stats`` even with ``kl_coef = 0``.
        normalization: one of :data:`GRPO_NORMALIZATIONS`.
        normalizer: ``"token"`` only: divide by this instead of this batch's token count.
        max_length: ``"constant"`` only: the maximum response length (TRL's
            ``max_completion_length``).
    Returns:
        :class:`GRPOOutput`. Clip fractions count tokens whose gradient the clip removes (TRL's
        definition): low = ``r < 1 - clip_low`` with ``A < 0``, high = ``r > 1 + clip_high`` with
        ``A > 0``.
    Raises:
        OlmoflowError: unknown ``normalization``; negative clip ranges.
        ValueError: shapes disagree; ``kl_coef != 0`` without ``ref_logps``; ``"constant"``
            without ``max_length``.
    """
    if normalization not in GRPO_NORMALIZATIONS:
        raise unknown_name_error("GRPO normalization", normalization, GRPO_NORMALIZATIONS)
    if clip_low < 0 or clip_high < 0:
        raise OlmoflowError(f"GRPO clip ranges must be >= 0, got low={clip_low} "
                            f"high={clip_high}")
    if logps.dim() != 2 or old_logps.shape != logps.shape or mask.shape != logps.shape:
        raise ValueError(f"logps {tuple(logps.shape)}, old_logps {tuple(old_logps.shape)} and "
                         f"mask {tuple(mask.shape)} must all be [B, T]")
    if advantages.shape not in (logps.shape[:1], logps.shape):
        raise ValueError(f"advantages must be [B] or [B, T], got {tuple(advantages.shape)}")
    if kl_coef and ref_logps is None:
        raise ValueError("kl_coef != 0 needs ref_logps")
    if ref_logps is not None and ref_logps.shape != logps.shape:
        raise ValueError(f"ref_logps {tuple(ref_logps.shape)} must match logps "
                         f"{tuple(logps.shape)}")
    if normalization == "constant" and max_length is None:
        raise ValueError("normalization 'constant' needs max_length")

    m = mask.to(logps.dtype)
    adv = advantages.detach().to(logps.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    ratio = torch.exp(logps - old_logps.detach())
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    kl = None
    if ref_logps is not None:
        delta = ref_logps.detach() - logps
        kl = torch.exp(delta) - delta - 1
        if kl_coef:
            per_token = per_token + kl_coef * kl

    total = (per_token * m).sum()
    n_tokens = m.sum()
    if normalization == "token":
        denom = n_tokens.clamp_min(1) if normalizer is None else normalizer
        loss = total / denom
    elif normalization == "sequence":
        loss = ((per_token * m).sum(-1) / m.sum(-1).clamp_min(1)).mean()
    else:
        loss = total / (logps.shape[0] * max_length)

    with torch.no_grad():
        count = n_tokens.clamp_min(1)

        def masked_mean(x: torch.Tensor) -> torch.Tensor:
            return (x.to(m.dtype) * m).sum() / count

        low = (ratio < 1 - clip_low) & (adv < 0)
        high = (ratio > 1 + clip_high) & (adv > 0)
        stats = {
            "clip_ratio/low_mean": masked_mean(low),
            "clip_ratio/high_mean": masked_mean(high),
            "clip_ratio/region_mean": masked_mean(low | high),
            "ratio/mean": masked_mean(ratio),
        }
        if kl is not None:
            stats["kl"] = masked_mean(kl)
    return GRPOOutput(loss, stats)
