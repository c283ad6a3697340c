"""Pipeline parallelism on ``torch.distributed.pipelining``: the layer stack split into stages,
the 1F1B, interleaved 1F1B and GPipe schedules, the LM loss on the last stage.

Stages. ``pp x stages_per_rank`` contiguous runs of blocks (:func:`split_layers`); the first
stage also holds the embedding, the last the final norm and the LM head. Virtual stage ``s``
lives on pipeline rank ``s % pp`` (the looped placement of the interleaved schedule, Narayanan
et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM"). Each stage is an :class:`OlmoStage`: the model's own modules under their own
names (``blocks`` a ``ModuleDict`` keyed by the layer index), so a rank's parameters keep the
names of the whole model and ``torch.distributed.checkpoint`` files load under any layout.

Micro-batches are the trainer's: ``per-rank batch / train.micro_batch_size`` of them per step,
fed through the schedule. The loss is computed on the last stage from the logits: the summed
cross-entropy and z-loss of a micro-batch divided by the target-token count of the whole global
batch (the trainer's normaliser), and ``scale_grads=False``: the schedule's own division by the
number of micro-batches would count a token twice. So the gradient is the one-process gradient,
term for term: each micro-batch's backward is the same computation, accumulated in the same
order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.utils.checkpoint
from torch import nn

from olmoflow.errors import OlmoflowError
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo, lm_loss


def split_layers(cfg: ModelConfig, n_stages: int, split: str = "layers") -> list[list[int]]:
    """Contiguous runs of layer indices, one per stage, in order.

    ``layers``: equal counts (the first ``n_layers % n_stages`` stages one more). ``cost``: the
    split minimising the heaviest stage's training FLOPs per token, a block costing its matmul
    FLOPs and the last stage also the LM head's ``2 d V`` (the embedding lookup costs nothing).

    Raises:
        OlmoflowError: fewer layers than stages, or an unknown ``split``.
    """
    n = cfg.n_layers
    if n < n_stages:
        raise OlmoflowError(f"{n_stages} pipeline stages for {n} layers; at least one layer each")
    if split == "layers":
        base, extra = divmod(n, n_stages)
        sizes = [base + (i < extra) for i in range(n_stages)]
    elif split == "cost":
        sizes = _cost_split(n, n_stages, _block_flops(cfg), 2 * cfg.d_model * cfg.vocab_size)
    else:
        from olmoflow.errors import unknown_name_error

        raise unknown_name_error("train.parallel.pipeline_split", split, ("layers", "cost"))
    out, start = [], 0
    for size in sizes:
        out.append(list(range(start, start + size)))
        start += size
    return out


def _block_flops(cfg: ModelConfig) -> float:
    """Matmul FLOPs per token of one block's forward (the projections; attention scores are
    the same for every block of one window and do not move the split)."""
    d, q, kv, f = cfg.d_model, cfg.n_heads * cfg.hd, cfg.n_kv_heads * cfg.hd, cfg.mlp_hidden
    return 2 * (d * q + 2 * d * kv + q * d + 3 * d * f)


def _cost_split(n: int, stages: int, block: float, head: float) -> list[int]:
    """Stage sizes minimising the maximum stage cost (dynamic programming over cut points)."""
    best: dict[tuple[int, int], tuple[float, list[int]]] = {}

    def solve(start: int, k: int) -> tuple[float, list[int]]:
        if (start, k) in best:
            return best[(start, k)]
        left = n - start
        if k == 1:
            result = (left * block + head, [left])
        else:
            result = (math.inf, [])
            for size in range(1, left - k + 2):
                rest, sizes = solve(start + size, k - 1)
                cost = max(size * block, rest)
                if cost < result[0]:
                    result = (cost, [size, *sizes])
        best[(start, k)] = result
        return result

    return solve(0, stages)[1]


class OlmoStage(Olmo):
    """A pipeline stage of an :class:`~olmoflow.model.olmo.Olmo`: some of its blocks, plus the
    embedding on the first stage and the final norm and LM head on the last, sharing the
    model's modules (no copy). Also the container of every stage a rank holds, for its
    optimizer and checkpoints.

    ``forward``: first stage ``input_ids [B, T]``, others hidden states ``[B, T / s, d]``
    (``s`` = :attr:`sequence_shards`, the tensor-parallel degree under sequence parallelism);
    returns hidden states, or on the last stage the logits ``[B, T, V]`` (``V / tp`` under tensor
    parallelism). Causal attention over the whole sequence, no KV cache, no document masking.
    """

    def __init__(self, model: Olmo, layers: Sequence[int], *, first: bool, last: bool):
        nn.Module.__init__(self)
        self.config = model.config
        self.activation_checkpointing = model.activation_checkpointing
        self.fused_inference = False
        self.lm_loss_fn = model.lm_loss_fn
        self.sequence_shards = 1
        self.embeddings = model.embeddings if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.rope, self.rope_full = model.rope, model.rope_full

    def _windows(self) -> set[int | None]:
        return {b.window for b in self.blocks.values()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.embeddings is not None:
            T = x.shape[1]
            x = self.embeddings(x)
        else:
            T = x.shape[1] * self.sequence_shards
        positions, masks = self._dynamic_inputs(T, None, None, None, x.device)
        cos, sin, cos_full, sin_full = self._rope(positions, T, x.device, False)
        every = self.activation_checkpointing if self.training and torch.is_grad_enabled() else 0
        for block in self.blocks.values():
            full = block.window is None
            args = (x, cos_full if full else cos, sin_full if full else sin, None,
                    masks[block.window], None)
            if every and block.layer % every == 0:
                x = torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False)
            else:
                x = block(*args)
        if self.lm_head is None:
            return x
        return self.lm_head(self.norm(x))


def stage_layout(n_stages: int, pp: int) -> list[int]:
    """The pipeline rank of each virtual stage (looped: stage ``s`` on rank ``s % pp``)."""
    return [s % pp for s in range(n_stages)]


class Pipeline:
    """The stages one pipeline rank holds and the schedule that runs them.

    ``parts``: this rank's :class:`OlmoStage` modules (one, or ``stages_per_rank`` for the
    interleaved schedule); ``model``: one :class:`OlmoStage` over all of them (what the
    optimizer, gradient clipping and checkpoints see).
    """

    def __init__(self, parts: list[OlmoStage], indices: list[int], n_stages: int, model: OlmoStage,
                 group, schedule: str, n_microbatches: int, device: torch.device):
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        self.parts, self.model, self.n_stages = parts, model, n_stages
        self.has_first = 0 in indices
        self.has_last = n_stages - 1 in indices
        self.normalizer = 1.0
        self._terms: list[tuple[torch.Tensor, torch.Tensor]] = []
        stages = [PipelineStage(part, i, n_stages, device, group=group)
                  for part, i in zip(parts, indices)]
        kinds = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe,
                 "interleaved_1f1b": ScheduleInterleaved1F1B}
        cls = kinds[schedule]
        if cls is ScheduleInterleaved1F1B:
            self.schedule = cls(stages, n_microbatches, loss_fn=self._loss, scale_grads=False)
        else:
            self.schedule = cls(stages[0], n_microbatches, loss_fn=self._loss, scale_grads=False)
        self.n_microbatches = n_microbatches

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        fn = self.model.lm_loss_fn if self.model.lm_loss_fn is not None else lm_loss
        loss, ce, z = fn(logits, labels, self.model.config.z_loss, self.normalizer)
        self._terms.append((ce.detach(), z.detach()))
        return loss

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor,
             normalizer: float) -> dict[str, float]:
        """Forward and backward of this rank's slice ``input_ids, labels [b, T]`` in
        :attr:`n_microbatches` micro-batches; gradients accumulate in the parameters. Returns
        the summed ``ce_loss`` and ``z_loss`` of the micro-batches this rank's last stage saw
        (zeros on a rank without the last stage).

        Raises:
            OlmoflowError: the slice does not split into the micro-batches.
        """
        if input_ids.shape[0] % self.n_microbatches:
            raise OlmoflowError(f"a pipeline step of {input_ids.shape[0]} instances does not "
                                f"split into {self.n_microbatches} micro-batches")
        self.normalizer, self._terms = normalizer, []
        target = labels if self.has_last else None
        losses: list = [] if self.has_last else None
        if self.has_first:
            self.schedule.step(input_ids, target=target, losses=losses, return_outputs=False)
        else:
            self.schedule.step(target=target, losses=losses, return_outputs=False)
        # The schedule's first step also calls the loss once on the outputs of its shape
        # inference (uninitialised values, no backward): the micro-batches' terms are the last
        # n_microbatches.
        terms = self._terms[-self.n_microbatches:] if self.has_last else []
        self._terms = []
        ce = float(sum(t[0] for t in terms)) if terms else 0.0
        z = float(sum(t[1] for t in terms)) if terms else 0.0
        return {"ce_loss": ce, "z_loss": z}


def build_pipeline(model: Olmo, *, pp: int, pp_rank: int, stages_per_rank: int, split: str,
                   schedule: str, n_microbatches: int, group, device: torch.device,
                   wrap_part=None) -> Pipeline:
    """Split ``model`` into ``pp x stages_per_rank`` stages and keep this rank's.

    ``wrap_part(part)`` is applied to each of this rank's stages before the schedule is built
    (tensor parallelism and FSDP shard them there). The modules of other ranks' stages are
    dropped (their memory freed when ``model`` goes).
    """
    n_stages = pp * stages_per_rank
    runs = split_layers(model.config, n_stages, split)
    placement = stage_layout(n_stages, pp)
    indices = [s for s in range(n_stages) if placement[s] == pp_rank]
    parts = [OlmoStage(model, runs[s], first=s == 0, last=s == n_stages - 1) for s in indices]
    mine = sorted(i for s in indices for i in runs[s])
    container = OlmoStage(model, mine, first=0 in indices, last=n_stages - 1 in indices)
    if wrap_part is not None:
        for part in parts:
            wrap_part(part)
        # Tensor parallelism may have set the vocabulary-parallel loss on the last stage.
        container.lm_loss_fn = next((p.lm_loss_fn for p in parts if p.lm_head is not None),
                                    container.lm_loss_fn)
        for part in parts:
            container.sequence_shards = part.sequence_shards
    container.train(model.training)
    return Pipeline(parts, indices, n_stages, container, group, schedule, n_microbatches,
                    device)
