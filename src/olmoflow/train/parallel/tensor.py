"""Tensor parallelism (Megatron-LM style) for the OLMo decoder on DTensor's ``parallelize_module``.

The plan, per block (Shoeybi et al. 2019, "Megatron-LM"; Korthikanti et al. 2022 for sequence
parallelism; the same plan as torchtitan's Llama and OLMo-core's transformer):

- ``attention.w_q/w_k/w_v`` and ``feed_forward.w1/w3`` (gate, up): column-wise (output features
  sharded: each rank holds whole heads, ``n_heads / tp`` query and ``n_kv_heads / tp`` key/value
  heads, and ``mlp_hidden / tp`` of the MLP);
- ``attention.w_out`` and ``feed_forward.w2`` (down): row-wise, reduce-scattered back onto the
  sequence dimension;
- sequence parallelism: the residual stream between the projections is sharded over the
  sequence (``[B, T / tp, d]`` per rank), as are the block norms (``SequenceParallel``: the
  norm is per position; its weight is replicated and its gradient summed over the ranks); the
  attention and MLP inputs are all-gathered once each (``PrepareModuleInput``);
- QK-norm: OLMo normalises q over its full projected width ``n_heads * head_dim`` (and k over
  ``n_kv_heads * head_dim``), which column-wise sharding splits over ranks. :class:`ShardedRMSNorm`
  keeps the weight sharded like the projection and all-reduces the sum of squares (``[B, T, 1]``
  per call, not the activations), so every rank normalises by the statistics of the whole width
  and the result equals the unsharded model's;
- embedding: row-wise over the vocabulary (each rank looks up its vocabulary rows, the partial
  sums reduce-scattered onto the sequence); final norm sequence-parallel; LM head column-wise over
  the vocabulary, its output left sharded: :func:`vocab_parallel_lm_loss` computes cross-entropy
  and z-loss from the ``[N, V / tp]`` shards with three all-reduces of ``[N]`` numbers (max,
  sum of exponentials, target logit), never gathering the ``[N, V]`` logits.

References: PyTorch "Large Scale Transformer model training with Tensor Parallel" tutorial;
``torch.distributed.tensor.parallel``.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from olmoflow.model.layers import RMSNorm
from olmoflow.model.olmo import IGNORE_INDEX


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over a feature dimension that is sharded over the ranks of ``mesh`` (QK-norm under
    tensor parallelism): input ``[..., size / tp]`` (this rank's slice of the ``size`` features,
    in rank order) -> the same shape, equal to slicing ``RMSNorm(size)`` of the whole input.

    ``weight`` is a DTensor sharded like the features (``Shard(0)``); the sum of squares is
    all-reduced over the mesh (differentiable: its backward all-reduces the gradient), then
    ``x * rsqrt(sum / size + eps) * weight`` in fp32 as :class:`RMSNorm`. Replaces the module
    in place (:meth:`from_norm`), so the parameter keeps its name in state dicts.
    """

    def __init__(self, size: int, eps: float, mesh: DeviceMesh):
        nn.Module.__init__(self)
        self.eps, self.size, self.mesh = eps, size, mesh
        self.weight = nn.Parameter(torch.ones(size))

    @classmethod
    def from_norm(cls, norm: RMSNorm, mesh: DeviceMesh) -> ShardedRMSNorm:
        """A sharded copy of ``norm`` (its weight distributed ``Shard(0)`` over ``mesh``)."""
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.eps, out.size, out.mesh = norm.eps, norm.weight.shape[0], mesh
        out.weight = nn.Parameter(distribute_tensor(norm.weight.detach(), mesh, [Shard(0)]),
                                  requires_grad=norm.weight.requires_grad)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        dtype = x.dtype
        x32 = x.float()
        sum_sq = funcol.all_reduce(x32.square().sum(-1, keepdim=True), "sum", self.mesh)
        x32 = x32 * torch.rsqrt(sum_sq / self.size + self.eps)
        return (w.float() * x32).to(dtype)


class _VocabParallelCrossEntropyZLoss(torch.autograd.Function):
    """Summed cross-entropy and z-loss from vocabulary-sharded fp32 logits ``[N, V / tp]``.

    Forward: the global max, sum of exponentials and target logit are all-reduced over ``group``
    (``[N]`` each), so ``lse = max + log(sum exp)`` and ``ce = lse - logit[target]`` are those of
    the whole vocabulary. Backward is local (no collective): this shard's
    ``softmax * (g_ce + 2 c g_z lse) - onehot * g_ce``, as the unsharded
    :class:`~olmoflow.model.olmo._CrossEntropyZLoss`.
    """

    @staticmethod
    def forward(ctx, logits, labels, z_coef: float, scale, group, vocab_start: int):
        n_local = logits.shape[1]
        valid = labels != IGNORE_INDEX
        local_target = labels - vocab_start
        mine = valid & (local_target >= 0) & (local_target < n_local)
        local_target = torch.where(mine, local_target, 0)
        peak = logits.max(-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - peak[:, None]).exp_()
        sum_exp = exp.sum(-1)
        target_logit = torch.where(mine, logits.gather(1, local_target[:, None]).squeeze(1), 0.0)
        stats = torch.stack((sum_exp, target_logit))
        dist.all_reduce(stats, group=group)
        sum_exp, target_logit = stats
        lse = peak + sum_exp.log()
        validf = valid.to(logits.dtype)
        ce = ((lse - target_logit) * validf).sum() * scale
        z = z_coef * (lse.square() * validf).sum() * scale
        softmax = exp.div_(sum_exp[:, None])
        ctx.save_for_backward(softmax, local_target, mine, lse, validf, scale)
        ctx.z_coef = z_coef
        return ce, z

    @staticmethod
    def backward(ctx, g_ce, g_z):
        softmax, local_target, mine, lse, validf, scale = ctx.saved_tensors
        w_ce = g_ce * validf * scale
        coef = w_ce + (2 * ctx.z_coef * scale) * g_z * lse * validf
        grad = softmax.mul_(coef[:, None])
        grad.scatter_add_(1, local_target[:, None], -(w_ce * mine.to(w_ce.dtype))[:, None])
        return grad, None, None, None, None, None


def vocab_parallel_lm_loss(logits: torch.Tensor, labels: torch.Tensor, z_loss_coef: float,
                           normalizer: float | None = None, *, group: dist.ProcessGroup,
                           vocab_start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~olmoflow.model.olmo.lm_loss` on this rank's vocabulary shard of the logits.

    Args:
        logits: ``[..., V / tp]``, the columns ``vocab_start : vocab_start + V / tp`` of the full
            logits; labels: ``[...]`` full-vocabulary ids (``IGNORE_INDEX`` for no target),
            the same on every rank of ``group``.
        z_loss_coef, normalizer: as :func:`~olmoflow.model.olmo.lm_loss`.
    Returns:
        ``(loss, ce_loss, z_loss)`` scalars, equal on every rank of ``group`` and to the unsharded
        loss within fp32 rounding.
    """
    logits = logits.float().reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1)
    if normalizer is not None:
        scale = torch.tensor(1.0 / float(normalizer), device=logits.device)
    else:
        scale = 1.0 / (labels != IGNORE_INDEX).sum().clamp_min(1).to(logits.dtype)
    ce, z = _VocabParallelCrossEntropyZLoss.apply(logits, labels, float(z_loss_coef), scale,
                                                  group, int(vocab_start))
    return ce + z, ce, z


def block_plan() -> dict:
    """The ``parallelize_module`` plan of one :class:`~olmoflow.model.olmo.Block` (see the module
    docstring); QK-norm is handled by :class:`ShardedRMSNorm` separately."""
    gather = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                desired_input_layouts=(Replicate(), None, None))
    return {
        "attention": gather,
        "attention.w_q": ColwiseParallel(),
        "attention.w_k": ColwiseParallel(),
        "attention.w_v": ColwiseParallel(),
        "attention.w_out": RowwiseParallel(output_layouts=Shard(1)),
        "attention_norm": SequenceParallel(use_local_output=True),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward_norm": SequenceParallel(use_local_output=True),
    }


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard ``model`` (an :class:`~olmoflow.model.olmo.Olmo`, or a pipeline stage of one, whose
    ``embeddings`` / ``norm`` / ``lm_head`` may be None) over the 1-D tensor-parallel ``mesh``,
    in place; returns it.

    Parameters become DTensors (names unchanged, so ``torch.distributed.checkpoint`` files load
    under any other layout); the LM head's output stays vocabulary-sharded and
    ``model.lm_loss_fn`` becomes :func:`vocab_parallel_lm_loss` on this rank's shard. Forward
    shapes: ``input_ids [B, T]`` (the same on every rank of ``mesh``; ``T`` a multiple of
    ``tp`` for the sequence-parallel residual stream) -> logits ``[B, T, V / tp]``.
    """
    tp = mesh.size()
    blocks = model.blocks.values() if isinstance(model.blocks, nn.ModuleDict) else model.blocks
    for block in blocks:
        attn = block.attention
        attn.q_norm = ShardedRMSNorm.from_norm(attn.q_norm, mesh)
        attn.k_norm = ShardedRMSNorm.from_norm(attn.k_norm, mesh)
        parallelize_module(block, mesh, block_plan())
    root: dict = {}
    if getattr(model, "embeddings", None) is not None:
        root["embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if getattr(model, "norm", None) is not None:
        root["norm"] = SequenceParallel(use_local_output=True)
    if getattr(model, "lm_head", None) is not None:
        root["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                          use_local_output=True)
        vocab = model.lm_head.weight.shape[0]
        model.lm_loss_fn = functools.partial(vocab_parallel_lm_loss, group=mesh.get_group(),
                                             vocab_start=mesh.get_local_rank() * (vocab // tp))
    if root:
        parallelize_module(model, mesh, root)
    return model
