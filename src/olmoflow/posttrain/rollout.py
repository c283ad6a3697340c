"""GRPO rollouts from olmoflow's KV-cache decoder, and the loader that feeds them to the Trainer.

Layout of a rollout batch (``N = P * G`` rows, prompt-major: the ``G`` samples of prompt 0
first)::

    input_ids       [N, T]   pad pad p p p p | r r r EOS fill fill      (T = Tp + L)
    attention_mask  [N, T]   0   0   1 1 1 1 | 1 1 1 1   0    0
    response_mask   [N, T]   0   0   0 0 0 0 | 1 1 1 1   0    0

The prompt is left-padded to ``Tp`` tokens, as :func:`~olmoflow.infer.generate.generate` takes
batched prompts, and the response follows it in the same row, right-padded after the end of the
row's response (its EOS, a stop string, or ``max_new_tokens``). :class:`Rollouts` masks are
aligned with ``input_ids``; the training batch of :class:`RolloutLoader` holds them aligned with
the labels (shifted by one: ``mask[:, t]`` says whether ``input_ids[:, t + 1]`` is trained), the
convention of :func:`~olmoflow.posttrain.losses.token_logps`.

Sampling is seeded from ``(seed, position in the prompt stream)``, so a resumed run (same weights,
same loader state) draws the very same rollouts.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from olmoflow.errors import OlmoflowError
from olmoflow.infer.generate import generate
from olmoflow.infer.sampling import SamplingParams
from olmoflow.model.olmo import IGNORE_INDEX
from olmoflow.posttrain.losses import filter_equal_groups, group_advantages, token_logps
from olmoflow.posttrain.rewards import RLPrompt, Verifier
from olmoflow.tokenizer.chat import ChatTemplate, render
from olmoflow.train.callbacks import Callback

RewardFn = Callable[[str, RLPrompt], "float | tuple[float, bool]"]


@dataclass
class Rollouts:
    """``P`` prompts x ``G`` samples (see the module docstring for the layout).

    Attributes:
        input_ids: ``[P*G, T]`` long, left-padded prompt then response then fill.
        attention_mask: ``[P*G, T]`` bool, True on prompt tokens and response tokens (up to and
            including the row's EOS).
        response_mask: ``[P*G, T]`` bool, True on the response tokens only (aligned with
            ``input_ids``).
        prompt_length: ``Tp``, where every response starts.
        rewards: ``[P*G]`` fp32; correct: ``[P*G]`` bool (the verifier's verdict, for pass@k).
        texts: the decoded responses (special tokens skipped); prompts: the ``P`` prompts.
        group_size: ``G``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    prompt_length: int
    rewards: torch.Tensor
    correct: torch.Tensor
    texts: list[str]
    prompts: list[RLPrompt]
    group_size: int

    def label_mask(self) -> torch.Tensor:
        """``response_mask`` aligned with the labels: ``[P*G, T]``, ``out[:, t]`` = whether
        ``input_ids[:, t + 1]`` is a response token (the last column is False)."""
        out = torch.zeros_like(self.response_mask)
        out[:, :-1] = self.response_mask[:, 1:]
        return out

    def lengths(self) -> torch.Tensor:
        """``[P*G]`` response lengths in tokens (EOS included)."""
        return self.response_mask.sum(-1)

    def metrics(self) -> dict[str, float]:
        """``reward`` (mean), ``pass@1`` (fraction correct), ``pass@G`` (fraction of prompts with
        a correct sample, ``G`` the group size: ``pass@8``), ``response_length`` (mean tokens)."""
        g = self.correct.view(-1, self.group_size)
        return {"reward": float(self.rewards.mean()), "pass@1": float(g.float().mean()),
                f"pass@{self.group_size}": float(g.any(dim=1).float().mean()),
                "response_length": float(self.lengths().float().mean())}


def encode_prompt(prompt: RLPrompt, tokenizer: Any,
                  template: str | ChatTemplate | None = None) -> list[int]:
    """The token ids a response continues: with a ``template``, the conversation (a text prompt
    as one user turn) rendered with the generation prompt; without one, a text prompt as is and a
    conversation under the tokenizer's own template.

    Raises:
        OlmoflowError: a conversation with neither a template nor one on the tokenizer; an empty
            prompt.
    """
    if template is None and prompt.text is not None:
        ids = tokenizer.encode(prompt.text)
    else:
        ids, _ = render(prompt.conversation(), template, tokenizer, add_generation_prompt=True)
    if not ids:
        raise OlmoflowError(f"{prompt.where}: the prompt encodes to no tokens")
    return ids


def _left_pad(rows: Sequence[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = True
    return ids, mask


def _score(reward_fn: RewardFn, text: str, prompt: RLPrompt) -> tuple[float, bool]:
    out = reward_fn(text, prompt)
    if isinstance(out, tuple):
        return float(out[0]), bool(out[1])
    return float(out), float(out) > 0


def sample_rollouts(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[RLPrompt], *,
                    group_size: int, sampling: SamplingParams, seed: int | None = None,
                    template: str | ChatTemplate | None = None,
                    reward_fn: RewardFn | None = None,
                    eos_token_id: int | None = None) -> Rollouts:
    """Sample ``group_size`` responses to each prompt with :func:`~olmoflow.infer.generate.generate`
    (one batch of ``P * G`` rows, KV cache, the model in eval mode and put back as it was) and
    score them.

    Args:
        sampling: temperature / top-p / top-k / ``max_new_tokens`` / ``stop``; its ``seed`` is
            replaced by ``seed`` when given.
        seed: seeds the sampler; the same model, prompts and seed give the same rollouts.
        template: see :func:`encode_prompt`.
        reward_fn: ``(response_text, prompt) -> reward`` or ``(reward, correct)``; default
            :class:`~olmoflow.posttrain.rewards.Verifier` ``()``. A bare float counts as correct
            when > 0.
        eos_token_id: the end-of-turn id that ends a response (default the tokenizer's EOS; the
            ``olmo3`` template makes ``<|im_end|>`` the EOS).
    Raises:
        OlmoflowError: no prompts, ``group_size < 1``, or a prompt that cannot be encoded.
    """
    if not prompts:
        raise OlmoflowError("sample_rollouts needs at least one prompt")
    if group_size < 1:
        raise OlmoflowError(f"group_size must be >= 1, got {group_size}")
    reward_fn = reward_fn if reward_fn is not None else Verifier()
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    pad = tokenizer.pad_token_id
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = _left_pad([encode_prompt(p, tokenizer, template) for p in prompts],
                                        pad)
    prompt_ids = prompt_ids.repeat_interleave(group_size, 0).to(device)
    prompt_mask = prompt_mask.repeat_interleave(group_size, 0).to(device)
    sp = sampling if seed is None else replace(sampling, seed=seed)
    out, lengths = generate(model, prompt_ids, sampling=sp, attention_mask=prompt_mask,
                            eos_token_id=eos, pad_token_id=pad, tokenizer=tokenizer,
                            return_lengths=True)
    Tp = prompt_ids.shape[1]
    responses = out[:, Tp:]
    ends = lengths.tolist()
    L = responses.shape[1]
    resp_mask = torch.arange(L, device=device)[None] < torch.tensor(ends, device=device)[:, None]
    response_mask = torch.cat([torch.zeros_like(prompt_mask), resp_mask], dim=1)
    attention_mask = torch.cat([prompt_mask, resp_mask], dim=1)
    rows = responses.tolist()
    texts = [tokenizer.decode(r[:e], skip_special_tokens=True) for r, e in zip(rows, ends)]
    scored = [_score(reward_fn, t, prompts[i // group_size]) for i, t in enumerate(texts)]
    return Rollouts(out, attention_mask, response_mask, Tp,
                    torch.tensor([s[0] for s in scored], dtype=torch.float32),
                    torch.tensor([s[1] for s in scored], dtype=torch.bool), texts, list(prompts),
                    group_size)


def shifted_labels(input_ids: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor:
    """Labels for ``input_ids [N, T]``: ``labels[:, t] = input_ids[:, t + 1]`` where
    ``label_mask`` is set, else ``IGNORE_INDEX`` (the model's already-shifted convention)."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    return labels.masked_fill(~label_mask.bool(), IGNORE_INDEX)


def response_logps(model: torch.nn.Module, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor, label_mask: torch.Tensor,
                   temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities of the response tokens under ``model``, the logits divided by
    ``temperature`` as the sampler divided them (TRL and open-instruct do the same).

    Returns:
        ``(logps [N, T] fp32, logits [N, T, V])``, ``logps`` aligned with the labels and 0 off
        ``label_mask``; the gradient flows when enabled.
    """
    logits = model(input_ids, attention_mask=attention_mask).logits
    if temperature != 1.0:
        logits = logits / temperature
    logps, _ = token_logps(logits, shifted_labels(input_ids, label_mask), label_mask)
    return logps, logits


@dataclass
class RolloutBatch:
    """What :meth:`RolloutLoader.next_batch` returns: ``fields`` (the training batch, every
    tensor ``[N, ...]``), ``metrics`` (the step's rollout metrics, floats), ``state`` (the loader
    state right after this batch, for the Trainer's checkpoints), ``temperature`` (of the
    sampler, which the loss's log-probabilities must use too) and the :class:`Rollouts` the
    batch came from (the last draw)."""

    fields: dict[str, torch.Tensor]
    metrics: dict[str, float]
    state: dict[str, Any]
    temperature: float = 1.0
    rollouts: Rollouts | None = field(default=None, repr=False)


class RolloutLoader:
    """The Trainer's loader for GRPO: each :meth:`next_batch` samples fresh rollouts from the
    current policy.

    Per call: take the next ``prompts_per_step`` prompts (a seeded shuffle per epoch), sample
    ``group_size`` responses each (:func:`sample_rollouts`, seeded from ``(seed, position)``),
    score them, compute group advantages (:func:`~olmoflow.posttrain.losses.group_advantages`),
    drop groups whose rewards are all equal (``filter_equal``; if every group of a draw is equal,
    the next prompts are drawn, at most ``max_draws`` times, after which the last draw is kept
    unfiltered: zero advantages, no update), and compute the policy's log-probabilities of the
    sampled tokens (no grad, eval mode, then back to the mode it was in).

    The batch fields (``N`` kept rows): ``input_ids``, ``attention_mask`` ``[N, T]``,
    ``response_mask [N, T]`` (aligned with the labels), ``advantages [N]``, with ``old_logps``
    the sampling policy's ``old_logps [N, T]`` from a separate no-grad forward (without it the
    objective takes the training forward's own, detached: with one update per rollout batch the
    ratio is then exactly 1, as TRL's ``num_iterations=1``, and one forward is saved), and
    ``ref_logps [N, T]`` when a ``ref_model`` is given (needed for a KL term).

    Metrics (over every sample drawn for the step): ``rollout/reward``, ``rollout/pass@1``,
    ``rollout/pass@G`` (``G`` = ``group_size``: ``rollout/pass@8``), ``rollout/response_length``,
    ``rollout/filtered_frac`` (share of groups dropped), ``rollout/draws``.

    Args:
        model: the policy (the very module the Trainer trains).
        tokenizer: encodes prompts, decodes responses.
        prompts: the :class:`~olmoflow.posttrain.rewards.RLPrompt` list.
        prompts_per_step: ``P``; group_size: ``G`` (>= 2).
        sampling: a :class:`SamplingParams`, or a dict of its fields (a sampling temperature > 0
            is needed for groups to differ).
        seed: shuffle and sampling seed.
        template: see :func:`encode_prompt`.
        scale: advantage scaling, ``"std"`` (GRPO) or ``"none"`` (Dr. GRPO).
        filter_equal: drop equal-reward groups.
        reward_fn: see :func:`sample_rollouts`.
        ref_model: a frozen reference policy for ``ref_logps``.
        max_draws: draws per step before giving up on finding a group with varied rewards.
        autocast_dtype: run the log-probability forwards under this autocast dtype (the
            Trainer's precision), so ``old_logps`` match the training forward.
        old_logps: compute ``old_logps`` with a separate forward (see above).
    Raises:
        OlmoflowError: no prompts, ``prompts_per_step < 1``, ``group_size < 2``, a bad sampling
            dict.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, prompts: Sequence[RLPrompt], *,
                 prompts_per_step: int, group_size: int,
                 sampling: SamplingParams | dict[str, Any], seed: int = 0,
                 template: str | ChatTemplate | None = None, scale: str = "std",
                 filter_equal: bool = True, reward_fn: RewardFn | None = None,
                 ref_model: torch.nn.Module | None = None, max_draws: int = 4,
                 eos_token_id: int | None = None,
                 autocast_dtype: torch.dtype | None = None, old_logps: bool = False):
        if not prompts:
            raise OlmoflowError("RolloutLoader needs at least one prompt")
        if prompts_per_step < 1:
            raise OlmoflowError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        if group_size < 2:
            raise OlmoflowError(f"GRPO needs group_size >= 2 samples per prompt, got {group_size}")
        if isinstance(sampling, dict):
            try:
                sampling = SamplingParams(**sampling)
            except TypeError as e:
                raise OlmoflowError(f"bad rollout sampling settings: {e}") from None
        self.model, self.tokenizer, self.prompts = model, tokenizer, list(prompts)
        self.old_logps = old_logps
        self.prompts_per_step, self.group_size = prompts_per_step, group_size
        self.sampling, self.seed, self.template = sampling, seed, template
        self.scale, self.filter_equal, self.reward_fn = scale, filter_equal, reward_fn
        self.ref_model, self.max_draws = ref_model, max(1, max_draws)
        self.eos_token_id, self.autocast_dtype = eos_token_id, autocast_dtype
        self.epoch, self.position, self.draws = 0, 0, 0
        group_advantages(torch.zeros(group_size), group_size, scale=scale)  # check scale now

    @property
    def temperature(self) -> float:
        """The sampling temperature the log-probabilities use (1.0 for greedy sampling)."""
        return self.sampling.temperature or 1.0

    def state_dict(self) -> dict[str, Any]:
        """``epoch``, ``position`` (prompts taken this epoch), ``draws`` (rollout batches sampled
        so far) and ``seed``: plain data."""
        return {"epoch": self.epoch, "position": self.position, "draws": self.draws,
                "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the batch whose state this is.

        Raises:
            OlmoflowError: the state was saved with another seed.
        """
        if int(state.get("seed", self.seed)) != self.seed:
            raise OlmoflowError(f"the rollout loader state was saved with seed {state['seed']}, "
                                f"this run uses {self.seed}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.draws = int(state.get("draws", 0))

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(f"rollout-order:{self.seed}:{epoch}").shuffle(order)
        return order

    def _take(self) -> list[RLPrompt]:
        """The next ``prompts_per_step`` prompts, across the epoch boundary when needed."""
        out: list[RLPrompt] = []
        while len(out) < self.prompts_per_step:
            if self.position >= len(self.prompts):
                self.epoch, self.position = self.epoch + 1, 0
            order = self._order(self.epoch)
            k = min(self.prompts_per_step - len(out), len(order) - self.position)
            out += [self.prompts[i] for i in order[self.position:self.position + k]]
            self.position += k
        return out

    def _logps(self, model: torch.nn.Module, ids, attn, mask) -> torch.Tensor:
        was_training = model.training
        device = next(model.parameters()).device
        amp = (torch.autocast(device.type, dtype=self.autocast_dtype)
               if self.autocast_dtype is not None else contextlib.nullcontext())
        model.eval()
        try:
            with torch.no_grad(), amp:
                return response_logps(model, ids, attn, mask, self.temperature)[0].float()
        finally:
            model.train(was_training)

    def next_batch(self) -> RolloutBatch:
        """Sample, score and package the next training batch (see the class docstring)."""
        totals: dict[str, float] = {}
        n_groups = n_dropped = draws = 0
        for _ in range(self.max_draws):
            prompts = self._take()
            # The sampling seed names the draw, so a resumed loader re-draws the same rollouts.
            seed = (self.seed * 1_000_003 + self.draws) % (2**63)
            self.draws += 1
            draws += 1
            ro = sample_rollouts(self.model, self.tokenizer, prompts, group_size=self.group_size,
                                 sampling=self.sampling, seed=seed, template=self.template,
                                 reward_fn=self.reward_fn, eos_token_id=self.eos_token_id)
            for k, v in ro.metrics().items():
                totals[k] = totals.get(k, 0.0) + v
            keep = (filter_equal_groups(ro.rewards, self.group_size) if self.filter_equal
                    else torch.ones(len(ro.rewards), dtype=torch.bool))
            n_groups += len(prompts)
            n_dropped += int((~keep).sum()) // self.group_size
            if bool(keep.any()):
                break
        if not bool(keep.any()):  # nothing to learn from: keep the last draw, advantages 0
            keep = torch.ones_like(keep)
        advantages = group_advantages(ro.rewards, self.group_size, scale=self.scale)
        idx = keep.nonzero().squeeze(1).to(ro.input_ids.device)
        label_mask = ro.label_mask()
        fields = {"input_ids": ro.input_ids[idx], "attention_mask": ro.attention_mask[idx],
                  "response_mask": label_mask[idx], "advantages": advantages[idx.cpu()]}
        if self.old_logps:
            fields["old_logps"] = self._logps(self.model, fields["input_ids"],
                                              fields["attention_mask"], fields["response_mask"])
        if self.ref_model is not None:
            fields["ref_logps"] = self._logps(self.ref_model, fields["input_ids"],
                                              fields["attention_mask"], fields["response_mask"])
        metrics = {f"rollout/{k}": v / draws for k, v in totals.items()}
        metrics["rollout/filtered_frac"] = n_dropped / max(1, n_groups)
        metrics["rollout/draws"] = float(draws)
        fields = {k: v.cpu() for k, v in fields.items()}
        return RolloutBatch(fields, metrics, self.state_dict(), self.temperature, ro)


@torch.no_grad()
def heldout_pass_at_1(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[RLPrompt], *,
                      max_new_tokens: int, template: str | ChatTemplate | None = None,
                      reward_fn: RewardFn | None = None) -> float:
    """Greedy pass@1 on ``prompts``: the share answered correctly with one temperature-0 sample
    each (what a held-out reward curve plots)."""
    ro = sample_rollouts(model, tokenizer, prompts, group_size=1, template=template,
                         sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0),
                         reward_fn=reward_fn)
    return float(ro.correct.float().mean())


class HeldOutReward(Callback):
    """Every ``interval`` steps, :func:`heldout_pass_at_1` of the model being trained on held-out
    prompts, logged as ``eval/heldout_pass@1``."""

    def __init__(self, interval: int, tokenizer: Any, prompts: Sequence[RLPrompt], *,
                 max_new_tokens: int, template: str | ChatTemplate | None = None):
        super().__init__(interval)
        self.tokenizer, self.prompts, self.template = tokenizer, list(prompts), template
        self.max_new_tokens = max_new_tokens

    def on_step(self, trainer: Any, step: int) -> dict[str, float]:
        return {"heldout_pass@1": heldout_pass_at_1(
            trainer.model, self.tokenizer, self.prompts, max_new_tokens=self.max_new_tokens,
            template=self.template)}
