"""Data, tensor and pipeline parallelism composed on one ``DeviceMesh`` (torchtitan's order):
pipeline split first, then tensor parallelism within each stage, then activation checkpointing
as configured, then FSDP2 over the data-parallel dimensions (each block, then each stage's root)
with its ``MixedPrecisionPolicy`` and optional CPU offload.

:func:`parallelize_model` returns a :class:`Parallelized`: the module the trainer optimises and
checkpoints, the :class:`~olmoflow.train.parallel.pipeline.Pipeline` when there is one, and the
data-parallel view of the process group (a :class:`~olmoflow.train.distributed.DistInfo` whose
rank and size count data-parallel ranks only, with their process group), which slices the
global batch and normalises the loss: tensor- and pipeline-parallel ranks of one
data-parallel rank see the same instances.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch
from torch import nn

from olmoflow.errors import OlmoflowError
from olmoflow.train.config import TrainConfig
from olmoflow.train.parallel.layout import Layout, build_mesh, check_layout, resolve_layout


@dataclass
class Parallelized:
    """What :func:`parallelize_model` built: ``model`` (for the optimizer, clipping and
    checkpoints), ``pipeline`` (None without pipeline parallelism), ``dp`` (the data-parallel
    view), ``pp_group`` (the pipeline-parallel process group, None without), ``layout`` and
    ``mesh``."""

    model: nn.Module
    pipeline: object | None
    dp: object
    pp_group: object | None
    layout: Layout
    mesh: object


def mixed_precision_policy(param_dtype: str, autocast: torch.dtype | None):
    """FSDP2's ``MixedPrecisionPolicy``: bf16 parameters for compute with fp32 gradient
    reductions when ``param_dtype`` is bf16 (``auto``: when ``train.precision`` autocasts to
    bf16); the sharded master weights and the optimizer stay fp32. None: full precision."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = param_dtype == "bf16" or (param_dtype == "auto" and autocast == torch.bfloat16)
    if not bf16:
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def fsdp_options(parallel, device: torch.device, autocast) -> dict:
    """The ``fully_shard`` keywords ``train.parallel`` asks for besides the mesh: ``mp_policy``
    (:func:`mixed_precision_policy`) and ``offload_policy`` (``cpu_offload``).

    Raises:
        OlmoflowError: ``cpu_offload`` on a CPU run (nothing to offload from).
    """
    kwargs: dict = {}
    policy = mixed_precision_policy(parallel.param_dtype, autocast)
    if policy is not None:
        kwargs["mp_policy"] = policy
    if parallel.cpu_offload:
        if device.type != "cuda":
            raise OlmoflowError("train.parallel.cpu_offload moves FSDP shards from GPU memory to "
                                "CPU memory; this run is on the CPU already: set it to false")
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs["offload_policy"] = CPUOffloadPolicy()
    return kwargs


def _shard(module: nn.Module, fsdp: dict) -> None:
    """FSDP2 on every block of ``module``, then on ``module`` itself (its embedding, final
    norm and LM head as one unit), as torchtitan and OLMo-core."""
    from torch.distributed.fsdp import fully_shard

    blocks = module.blocks.values() if isinstance(module.blocks, nn.ModuleDict) else module.blocks
    for block in blocks:
        fully_shard(block, **fsdp)
    fully_shard(module, **fsdp)


def parallelize_model(model: nn.Module, cfg: TrainConfig, info, autocast) -> Parallelized:
    """Lay ``model`` (an olmoflow :class:`~olmoflow.model.olmo.Olmo`, built whole from the seed
    on every rank) out over the world as ``cfg.parallel`` says (see the module docstring).

    Collective: every rank calls it with identical parameters.

    Raises:
        OlmoflowError: the layout does not fit the world size, the model or the batch
            (:func:`~olmoflow.train.parallel.layout.check_layout`), or the model is not an
            olmoflow Olmo.
    """
    from olmoflow.model.olmo import Olmo
    from olmoflow.train import distributed
    from olmoflow.train.parallel.pipeline import build_pipeline
    from olmoflow.train.parallel.tensor import apply_tensor_parallel

    parallel = cfg.parallel
    layout = resolve_layout(parallel, info.world_size)
    # FSDP2 warns when a wrapped module returns a view, in case the caller modifies it in place
    # (which would skip its pre-backward hook); the trainer and the loss never do.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    if not isinstance(model, Olmo):
        raise OlmoflowError("tensor and pipeline parallelism need an olmoflow Olmo model, got "
                            f"{type(model).__name__}")
    check_layout(layout, model.config, cfg)
    if layout.tp > 1:
        wrapped = sorted({type(m).__name__ for b in model.blocks for m in b.modules()
                          if isinstance(m, nn.Linear) and type(m) is not nn.Linear})
        if wrapped or getattr(model, "lora_settings", None) is not None:
            raise OlmoflowError("train.parallel.tensor_parallel > 1 shards plain linear layers; "
                                f"this model's are wrapped ({', '.join(wrapped) or 'LoRA'}): "
                                "train LoRA adapters with data or pipeline parallelism")
    # A model too big to build whole on every rank comes on the meta device (build_on_rank):
    # it is laid out first and only this rank's shards are allocated and initialised.
    meta = any(p.is_meta for p in model.parameters())
    if not meta:
        model = model.to(info.device)
    mesh, data_mesh = build_mesh(layout, info.device.type)
    tp_mesh = mesh["tp"] if layout.tp > 1 else None
    dp_mesh = None
    if layout.dp > 1:
        dp_mesh = (mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1
                   else mesh["dp_shard"])
    fsdp = ({"mesh": dp_mesh, **fsdp_options(parallel, info.device, autocast)}
            if dp_mesh is not None else None)
    if parallel.cpu_offload and fsdp is None:
        raise OlmoflowError("train.parallel.cpu_offload needs FSDP over more than one "
                            "data-parallel rank")

    def wrap(part: nn.Module) -> nn.Module:
        if tp_mesh is not None:
            apply_tensor_parallel(part, tp_mesh)
            part.sequence_shards = layout.tp
        if fsdp is not None:
            _shard(part, fsdp)
        return part

    dp_info = distributed.DistInfo(
        rank=data_mesh.get_local_rank(), world_size=layout.dp, local_rank=info.local_rank,
        local_world_size=info.local_world_size, device=info.device, backend=info.backend,
        group=data_mesh.get_group() if layout.dp > 1 else None)
    if layout.pp == 1:
        model = wrap(model)
        if meta:
            _materialize_shards(model, info, mesh, layout)
        return Parallelized(model, None, dp_info, None, layout, mesh)
    per_rank = cfg.global_batch_size // layout.dp
    pipeline = build_pipeline(
        model, pp=layout.pp, pp_rank=mesh["pp"].get_local_rank(),
        stages_per_rank=parallel.stages_per_rank, split=parallel.pipeline_split,
        schedule=parallel.pipeline_schedule, n_microbatches=per_rank // cfg.micro_batch_size,
        group=mesh["pp"].get_group(), device=info.device, wrap_part=wrap)
    if meta:
        _materialize_shards(pipeline.model, info, mesh, layout)
    return Parallelized(pipeline.model, pipeline, dp_info, mesh["pp"].get_group(), layout, mesh)


def _materialize_shards(model: nn.Module, info, mesh, layout: Layout) -> None:
    """Allocate and initialise this rank's shards of a laid-out meta-device model.

    On CPU each rank draws its shards from its own stream, seeded by its place in the mesh
    without the replica dimension: replicas (DDP, HSDP) draw the same values, so they start
    equal; shards draw different ones. (On CUDA, DTensor's random ops keep one stream over the
    shards.) The values differ from a model built whole from the seed (same distribution)."""
    from olmoflow.train import distributed

    pp, _, shard, tp = mesh.get_coordinate()
    place = (pp * layout.dp_shard + shard) * layout.tp + tp
    distributed._materialize(model, replace(info, rank=place))
