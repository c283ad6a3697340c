"""The parallel layout: how ``world_size`` processes split into data x tensor x pipeline parallel
ranks, the checks that the model and the batch divide as the layout needs, and the one
``DeviceMesh`` everything is built on.

Mesh dimensions, outermost first (torchtitan's and OLMo-core's order, so tensor-parallel ranks
are neighbours on a node and talk over the fastest links): ``pp`` (pipeline stages),
``dp_replicate`` (HSDP replicas, or DDP replicas), ``dp_shard`` (FSDP shards within a
replica), ``tp`` (tensor parallel). The data-parallel ranks are ``dp_replicate x dp_shard``:
they take different slices of the global batch; tensor- and pipeline-parallel ranks of one
data-parallel rank see the same slice.
"""

from __future__ import annotations

from dataclasses import dataclass

from olmoflow.errors import OlmoflowError
from olmoflow.model.config import ModelConfig
from olmoflow.train.config import ParallelConfig, TrainConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class Layout:
    """Degrees of one layout (their product is the world size) and the data-parallel method:
    ``dp = dp_replicate x dp_shard``; ``method`` is ``ddp`` (replicate only), ``fsdp`` (shard
    only) or ``hsdp`` (both)."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    method: str

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    def describe(self) -> str:
        """``dp=2 (fsdp) x tp=2 x pp=1``."""
        return f"dp={self.dp} ({self.method}) x tp={self.tp} x pp={self.pp}"


def resolve_layout(parallel: ParallelConfig, world_size: int) -> Layout:
    """The :class:`Layout` ``parallel`` asks for on ``world_size`` processes.

    The data-parallel degree is ``world_size / (tp x pp)`` unless ``data_parallel`` names it;
    ``hsdp`` shards over ``shard_size`` ranks (default: all data-parallel ranks, i.e. FSDP) and
    replicates over the rest.

    Raises:
        OlmoflowError: the degrees do not multiply to ``world_size``, or ``shard_size`` does not
            divide the data-parallel degree.
    """
    p = "train.parallel"
    tp, pp = parallel.tensor_parallel, parallel.pipeline_parallel
    if world_size % (tp * pp):
        hint = (f"; launch {tp * pp} or a multiple of processes with torchrun "
                f"--nproc_per_node=N" if world_size < tp * pp else "")
        raise OlmoflowError(f"{p}.tensor_parallel={tp} x pipeline_parallel={pp} does not divide "
                            f"the world size {world_size} (processes){hint}")
    dp = world_size // (tp * pp)
    if parallel.degree is not None and parallel.degree != dp:
        raise OlmoflowError(f"{p}: data_parallel={parallel.degree} x tensor_parallel={tp} x "
                            f"pipeline_parallel={pp} = {parallel.degree * tp * pp}, not the world "
                            f"size {world_size}")
    method = parallel.method
    if method == "ddp":
        return Layout(dp, 1, tp, pp, method)
    if method == "fsdp":
        return Layout(1, dp, tp, pp, method)
    shard = parallel.shard_size or dp
    if dp % shard:
        raise OlmoflowError(f"{p}.shard_size={shard} does not divide the data-parallel degree "
                            f"{dp}")
    return Layout(dp // shard, shard, tp, pp, method)


def check_layout(layout: Layout, model: ModelConfig, train: TrainConfig) -> None:
    """Check that the model and the batch divide as ``layout`` needs, before anything is built.

    Tensor parallel: query heads, key/value heads (whole heads per rank), the MLP width, the
    (padded) vocabulary (embedding and LM head are vocabulary-sharded) and the sequence length
    (sequence parallelism shards it) divide by ``tp``. Pipeline parallel: at least one layer per
    stage, a language-modelling run without the per-layer probe or the micro-batch finder, and
    at least as many micro-batches per step as stages in flight.

    Raises:
        OlmoflowError: the first thing that does not divide, named with its config key.
    """
    p = "train.parallel"
    tp, pp = layout.tp, layout.pp
    if tp > 1:
        for key, value in (("n_heads", model.n_heads), ("n_kv_heads", model.n_kv_heads),
                           ("mlp_hidden", model.mlp_hidden), ("vocab_size", model.vocab_size)):
            if value % tp:
                pad = (" (the tokenizer's vocabulary padded to model.vocab_pad_multiple)"
                       if key == "vocab_size" else "")
                raise OlmoflowError(f"{p}.tensor_parallel={tp} does not divide model.{key}="
                                    f"{value}{pad}; each rank holds an equal share")
        if train.sequence_length % tp:
            raise OlmoflowError(f"{p}.tensor_parallel={tp} does not divide train.sequence_length="
                                f"{train.sequence_length} (sequence parallelism shards it)")
    if train.compile and tp > 1:
        raise OlmoflowError("train.compile is not supported with "
                            f"{p}.tensor_parallel > 1 yet (compiled blocks over DTensor "
                            "shards); set train.compile=false")
    if train.log.detailed_interval and (tp > 1 or pp > 1):
        raise OlmoflowError("train.log.detailed_interval (per-layer metrics) needs "
                            f"{p}.tensor_parallel=1 and pipeline_parallel=1; set it to 0")
    if train.auto_micro_batch and (tp > 1 or pp > 1):
        raise OlmoflowError("train.auto_micro_batch is for data parallelism only; set "
                            "train.micro_batch_size under tensor or pipeline parallelism")
    if pp == 1:
        return
    stages = pp * train.parallel.stages_per_rank
    if model.n_layers < stages:
        raise OlmoflowError(f"{p}: {stages} pipeline stages (pipeline_parallel={pp} x "
                            f"stages_per_rank={train.parallel.stages_per_rank}) for "
                            f"model.n_layers={model.n_layers}; at least one layer per stage")
    if train.intra_document_masking:
        raise OlmoflowError("train.intra_document_masking is not supported with "
                            f"{p}.pipeline_parallel > 1 (the stages pass hidden states only); "
                            "set it to false")
    per_rank = train.global_batch_size // layout.dp
    micro = per_rank // train.micro_batch_size
    if micro < pp:
        raise OlmoflowError(f"{p}.pipeline_parallel={pp} needs at least {pp} micro-batches per "
                            f"step, got train.global_batch_size={train.global_batch_size} / "
                            f"{layout.dp} data-parallel ranks / micro_batch_size="
                            f"{train.micro_batch_size} = {micro}")


def build_mesh(layout: Layout, device_type: str):
    """``(mesh, dp_mesh)``: the 4-D ``DeviceMesh`` ``(pp, dp_replicate, dp_shard, tp)`` over all
    ranks and its flattened data-parallel dimension (the ranks that take different slices of
    the batch and whose loss counts are summed). Collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_DIMS)
    dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    # A norm over DTensors sharded on (dp_shard, tp) reduces once over this flattened group
    # instead of once per dimension (the gradient norm of FSDP x TP).
    mesh["dp_shard", "tp"]._flatten("dp_shard_tp")
    return mesh, dp_mesh
