"""Scale-out on ``torch.distributed``: the process group from the torchrun environment, DDP or
FSDP2 wrapping, the rank's slice of a global batch, and the reductions the trainer needs.

Launch with ``torchrun --nproc_per_node=N -m olmoflow pretrain CONFIG``. torchrun sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``;
:func:`init_from_env` reads them and joins the group (NCCL on CUDA, gloo on CPU). Without them
everything here is a no-op for one process, so the same code trains on a laptop.

The data-parallel contract (what makes N processes train exactly like one):

- every rank draws the same global batch (the loader's order depends on ``(seed, epoch)`` only)
  and keeps its contiguous slice of ``global_batch_size / world_size`` instances
  (:func:`shard_batch`);
- the loss is normalised by the target-token count of the WHOLE global batch (an all-reduce), times
  ``world_size`` because DDP and FSDP average gradients over ranks; the sum over ranks of the
  per-rank gradients is then the single-process gradient of the global batch;
- only rank 0 logs, prints and writes run files (:func:`is_main`); checkpoints go through
  ``torch.distributed.checkpoint``, whose files load on any number of ranks.

References: PyTorch DDP (Li et al., "PyTorch Distributed", VLDB 2020); FSDP2 ``fully_shard``
(PyTorch docs, "Getting Started with Fully Sharded Data Parallel (FSDP2)"), sharded per
transformer block and then at the root as in torchtitan and OLMo-core.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from olmoflow.errors import OlmoflowError
from olmoflow.train.config import DATA_PARALLEL

# Rank 0 may do minutes of single-process work (a data stage, a checkpoint hash) while the others
# wait at a barrier; NCCL's 10-minute default would kill such a run.
TIMEOUT_ENV = "OLMOFLOW_DIST_TIMEOUT_MIN"
DEFAULT_TIMEOUT_MIN = 60


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: ``rank`` of ``world_size``, ``local_rank`` of
    ``local_world_size`` on its node, and its compute ``device`` (``cuda:local_rank`` or cpu).

    ``group``: the process group the reductions below run over (None: all ranks). The
    data-parallel view of a tensor- or pipeline-parallel run (see
    :mod:`olmoflow.train.parallel.compose`) counts ``rank`` and ``world_size`` in data-parallel
    ranks and names their group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None
    group: object | None = None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs and writes run files."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


SHUTDOWN_BARRIER_S = 60  # how long a rank waits for its peers at exit


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise OlmoflowError(f"environment variable {name}={raw!r} is not an integer") from None


def current() -> DistInfo:
    """The :class:`DistInfo` of the initialised process group (one process if there is none)."""
    if not (dist.is_available() and dist.is_initialized()):
        # One process trains on the GPU when there is one (run_pretrain moves the model there).
        return DistInfo(device=torch.device("cuda", 0) if torch.cuda.is_available()
                        else torch.device("cpu"))
    backend = dist.get_backend()
    local_rank = _env_int("LOCAL_RANK", 0)
    device = (torch.device("cuda", local_rank) if backend == "nccl" and torch.cuda.is_available()
              else torch.device("cpu"))
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                    local_world_size=_env_int("LOCAL_WORLD_SIZE", dist.get_world_size()),
                    device=device, backend=backend)


def init_from_env() -> DistInfo:
    """Join the process group torchrun describes in the environment (idempotent).

    Backend: NCCL when CUDA is available (each process on ``cuda:LOCAL_RANK``), else gloo. Without
    ``WORLD_SIZE`` > 1 nothing is initialised and one-process :class:`DistInfo` is returned.

    Raises:
        OlmoflowError: the torchrun variables are incomplete or not integers, or LOCAL_RANK names
            a GPU this node does not have.
    """
    if dist.is_available() and dist.is_initialized():
        return current()
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return current()
    missing = [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise OlmoflowError(f"WORLD_SIZE={world} but {', '.join(missing)} not set; launch with "
                            "torchrun")
    local_rank = _env_int("LOCAL_RANK", 0)
    timeout = timedelta(minutes=_env_int(TIMEOUT_ENV, DEFAULT_TIMEOUT_MIN))
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise OlmoflowError(f"LOCAL_RANK={local_rank} but this node has "
                                f"{torch.cuda.device_count()} GPU(s); lower --nproc_per_node")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    atexit.register(shutdown)
    return current()


def shutdown() -> None:
    """Leave the process group (registered at exit by :func:`init_from_env`).

    The ranks first meet at a barrier, so none tears down its connections while another still
    uses them: rank 0 leaves last (it prints the summary and samples), and a gloo rank that
    destroyed its group under a peer still talking aborted at exit ("terminate called without an
    active exception", exit -6) after all the work was done. The barrier is bounded (gloo's
    monitored barrier) so a rank that died does not hold the others at exit.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=SHUTDOWN_BARRIER_S))
        else:
            dist.barrier()
    except Exception:  # a peer is gone: leave anyway
        pass
    dist.destroy_process_group()


def is_main() -> bool:
    """Whether this process is rank 0 (always true without a process group)."""
    return current().is_main


def barrier() -> None:
    """Wait for every rank (no-op in one process)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s ``obj`` on every rank (picklable objects; identity in one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def per_rank_batch(global_batch_size: int, micro_batch_size: int, info: DistInfo) -> int:
    """Instances each rank takes from a global batch.

    Raises:
        OlmoflowError: the global batch does not split into ``world_size`` equal slices, each a
            whole number of micro-batches.
    """
    w = info.world_size
    if global_batch_size % w:
        raise OlmoflowError(f"train.global_batch_size={global_batch_size} is not divisible by the "
                            f"world size {w} (processes); each rank takes an equal slice")
    local = global_batch_size // w
    if local % micro_batch_size:
        raise OlmoflowError(f"train.global_batch_size={global_batch_size} over {w} processes gives "
                            f"{local} instances per rank, not a multiple of "
                            f"train.micro_batch_size={micro_batch_size}")
    return local


def shard_batch(batch: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """This rank's contiguous slice ``[B / world_size, ...]`` of a global batch ``[B, ...]``."""
    if info.world_size == 1:
        return batch
    n = batch.shape[0] // info.world_size
    return batch[info.rank * n:(info.rank + 1) * n]


def all_reduce_sum(value: float | int, info: DistInfo) -> float:
    """The sum of ``value`` over ranks (float64 on the wire; exact for counts below 2**53)."""
    if info.world_size == 1:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=info.device)
    dist.all_reduce(t, group=info.group)
    return t.item()


def all_reduce_mean(values: dict[str, float], info: DistInfo) -> dict[str, float]:
    """The mean over ranks of each value (one collective for the whole dict)."""
    if info.world_size == 1 or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=info.device)
    dist.all_reduce(t, group=info.group)
    return {k: v / info.world_size for k, v in zip(keys, t.tolist())}


def all_reduce_min(value: int, info: DistInfo) -> int:
    """The minimum of an integer over ranks (the micro-batch every rank can afford)."""
    if info.world_size == 1:
        return value
    t = torch.tensor([int(value)], dtype=torch.int64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=info.group)
    return int(t.item())


def to_float(t: torch.Tensor | float) -> float:
    """A Python float from a tensor or DTensor (FSDP2's ``clip_grad_norm_`` returns a DTensor)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return float(t)


def clip_grad_norm(parameters, max_norm: float, pp_group=None) -> float:
    """Clip the gradients of ``parameters`` to the global L2 norm ``max_norm`` (``inf``: measure
    only) and return the norm before clipping, as :func:`torch.nn.utils.clip_grad_norm_`.

    The norm covers the whole model: DTensor gradients (FSDP shards, tensor-parallel shards)
    count each element once (``full_tensor`` of the DTensor norm), and under pipeline
    parallelism each rank holds some stages' parameters only, so the squared norms are summed
    over ``pp_group`` (as torchtitan's ``clip_grad_norm_``).
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, 2.0, False, None)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    if pp_group is not None:
        total = total.float().square()
        dist.all_reduce(total, group=pp_group)
        total = total.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def parallelize(model: nn.Module, data_parallel: str, info: DistInfo,
                fsdp_options: dict | None = None) -> nn.Module:
    """Wrap ``model`` for data parallelism over the process group; unchanged in one process.

    ``ddp``: :class:`~torch.nn.parallel.DistributedDataParallel` (gradients all-reduced in buckets
    that alias the ``.grad`` tensors, so no second copy of the gradients). ``fsdp``: FSDP2
    ``fully_shard`` on every ``model.blocks[i]`` and then on the root, so parameters, gradients and
    optimizer states are sharded over ranks and one block is gathered at a time. Parameters must
    be identical on all ranks before the call (build the model from the same seed).
    ``fsdp_options``: more ``fully_shard`` keywords (``mp_policy``, ``offload_policy``: see
    :func:`olmoflow.train.parallel.compose.fsdp_options`).

    Raises:
        OlmoflowError: ``data_parallel`` is neither ``ddp`` nor ``fsdp``.
    """
    if data_parallel not in DATA_PARALLEL:
        from olmoflow.errors import unknown_name_error

        raise unknown_name_error("train.parallel.data_parallel", data_parallel, DATA_PARALLEL)
    meta = any(p.is_meta for p in model.parameters())
    if meta and (info.world_size == 1 or data_parallel == "ddp"):
        # Nothing to shard: the whole model is allocated (DDP broadcasts rank 0's values).
        model, meta = _materialize(model, info), False
    if info.world_size == 1:
        return model
    if not meta:
        model = model.to(info.device)
    if data_parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [info.device.index] if info.device.type == "cuda" else None
        return DDP(model, device_ids=ids, gradient_as_bucket_view=True)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    for block in getattr(model, "blocks", []):
        fully_shard(block, mesh=mesh, **(fsdp_options or {}))
    fully_shard(model, mesh=mesh, **(fsdp_options or {}))
    if meta:
        model = _materialize(model, info)  # only this rank's shards are ever allocated
    return model


def _materialize(model: nn.Module, info: DistInfo) -> nn.Module:
    """Allocate a meta-device model (or its FSDP shards) on ``info.device`` and initialise it with
    the model's ``reset_parameters()``, seeded from ``torch.initial_seed()``.

    On CUDA, DTensor's random ops draw every shard from one seeded stream (distinct values per
    shard); on CPU they draw locally, so each rank is seeded with ``seed + rank``. The values
    therefore differ from a model built in one process from the same seed (same distribution).
    """
    if not hasattr(model, "reset_parameters"):
        raise OlmoflowError(f"{type(model).__name__} was built on the meta device but has no "
                            "reset_parameters() to initialise it")
    seed = torch.initial_seed()
    model.to_empty(device=info.device)
    if info.device.type == "cpu":
        torch.manual_seed(seed + info.rank)
    with torch.no_grad():
        model.reset_parameters()
    torch.manual_seed(seed)
    return model


def available_ram_bytes() -> float:
    """Available RAM of this node (psutil)."""
    import psutil

    return float(psutil.virtual_memory().available)


def build_on_rank(build: Callable[[], nn.Module], data_parallel: str) -> nn.Module:
    """``build()`` the model the way this rank should hold it before :func:`parallelize`.

    On the meta device when :func:`init_on_meta` says the whole model is too big for the node's
    processes (FSDP then allocates only this rank's shards); else whole, and in one process moved
    to the GPU when there is one.
    """
    info = init_from_env()
    with torch.device("meta"):
        n_params = sum(p.numel() for p in build().parameters())
    if init_on_meta(n_params, data_parallel, info):
        with torch.device("meta"):
            return build()
    model = build()
    return model.to(info.device) if info.world_size == 1 else model


def init_on_meta(n_params: int, data_parallel: str, info: DistInfo) -> bool:
    """Whether to build the model on the meta device and allocate only this rank's FSDP shards.

    True under FSDP on several ranks when the node's processes could not all hold the whole fp32
    model at once (``4 * n_params * local_world_size`` over half the available RAM): a 32B model
    is 129 GB per process. Smaller models are built whole from the seed, so their initial weights
    are those of a one-process run.
    """
    if data_parallel != "fsdp" or info.world_size == 1:
        return False
    return 4 * n_params * info.local_world_size > 0.5 * available_ram_bytes()


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (FSDP2 keeps the module itself)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return model.module if isinstance(model, DDP) else model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Within the block, DDP backward passes all-reduce gradients only when ``enabled``.

    Gradient accumulation under DDP reduces once, after the last micro-batch (``no_sync()`` for
    the others). FSDP2 keeps reduce-scattering every micro-batch: skipping it would hold
    unsharded gradients, the memory FSDP exists to save (as torchtitan does). No-op otherwise.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    if enabled or not isinstance(model, DDP):
        yield
    else:
        with model.no_sync():
            yield
