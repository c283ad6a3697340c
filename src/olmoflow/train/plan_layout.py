"""The 3D plan: memory, pipeline bubble, communication and an estimated step time per GPU for a
layout of ``gpus = dp * tp * pp`` (data x tensor x pipeline parallelism, as Megatron-LM and
OLMo-core lay them out), and the recommended layout, printed by ``olmoflow plan``.

Notation: ``L`` layers, ``d`` d_model, ``V`` vocab_size, ``b`` instances per micro-batch of ``s``
tokens, ``m`` micro-batches per optimizer step on one data-parallel rank
(``global_batch / (dp b)``), ``a`` bytes per activation element (2 under bf16), ``v`` stages per
rank (interleaved 1F1B). Ranks are ordered with tensor parallelism innermost, then data, then
pipeline (Megatron's and torchtitan's mesh order), so a TP group is ``tp`` neighbouring GPUs of a
node.

Memory per GPU (the heaviest pipeline stage; every term of :mod:`olmoflow.train.plan` split):

- parameters on one TP rank: the block matrices (q, k, v, o, w1, w2, w3) and the QK-norm weights
  ``/ tp``, the two block RMSNorms replicated; embedding and LM head vocab-sharded, ``V d / tp``
  each; the final norm replicated. A stage holds ``L / pp`` blocks; the first also the embedding,
  the last the final norm and LM head;
- weights, gradients, AdamW moments: ``4 + 4 + 8`` bytes per parameter of the stage, ``/ dp``
  under FSDP (ZeRO-3), ``/ shard_size`` under HSDP, whole under DDP; with ``cpu_offload`` the
  shards live in host memory (FSDP2's ``CPUOffloadPolicy``). Under pipeline parallelism the
  gradients are whole:
  ``torch.distributed.pipelining`` defers FSDP's gradient reduction to the step's last backward,
  so they accumulate unsharded;
- FSDP buffers (``p`` bytes per unsharded parameter: 2 when the trainer's FSDP2 mixed-precision
  policy gathers bf16, i.e. with tensor or pipeline parallelism or HSDP and bf16 training; else
  4): the unsharded parameters and gradients of the stage's root (embedding / LM head / final
  norm) and of two blocks, ``2 p (P_root + 2 P_block)``; under pipeline parallelism the whole
  stage's unsharded parameters, ``p P`` (the schedule does not reshard after a backward);
- activations: with sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation
  in Large Transformer Models", 2022) a block's per-token activations are split ``/ tp`` (the
  norms and residuals along the sequence, attention and MLP along heads and width) but for the
  attention's and MLP's inputs, saved all-gathered (``2 d`` per token, see
  :func:`~olmoflow.train.plan.tp_block_bytes_per_token`; measured). One micro-batch of a stage is
  ``b s`` times the per-token bytes of its ``L / pp`` blocks plus the embedding output (first
  stage) or the final norm and LM head inputs and the loss bookkeeping (last stage; the LM head's
  input is saved all-gathered, :func:`~olmoflow.train.plan.outside_bytes_per_token`).
  Micro-batches in flight on the first stage: ``min(m, pp)`` under 1F1B, ``min(m, pp + (pp - 1)
  / v)`` under interleaved 1F1B (Korthikanti et al. 2022, section 4.2.3: ``L (1 + (pp - 1) / (pp
  v))`` layers' worth), all ``m`` under GPipe; on the last stage one (1F1B), ``((v - 1) pp + 1) /
  v`` (interleaved) or ``m`` (GPipe). Activation checkpointing keeps the blocks' inputs per
  micro-batch in flight and one recomputed block at a time;
- LM head and loss (last stage, :func:`~olmoflow.train.plan.head_loss_bytes`): the fused,
  chunked head without tensor or pipeline parallelism; else the logits ``[b s, V / tp]``
  (vocab-parallel), ``8 V / tp`` bytes per token, for one micro-batch (``m`` under GPipe); the
  sdpa sliding-window masks and the 2 GB reserve as before.

Pipeline bubble (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", 2021): the idle fraction of a step is ``(pp - 1) / (m + pp - 1)`` for 1F1B and
GPipe and ``(pp - 1) / (v m + pp - 1)`` for interleaved 1F1B.

Communication, bytes sent by one GPU per optimizer step (a ring collective over ``n`` ranks sends
``(n - 1) / n`` of its tensor per GPU; an all-reduce is a reduce-scatter and an all-gather):

- TP with sequence parallelism: per block and micro-batch 2 all-gathers and 2 reduce-scatters of
  the ``[b, s, d]`` activations forward, as many backward, and the forward's again when the block
  is recomputed: ``m (tp - 1) / tp * b s d a * (8 L / pp + 4 c)`` with ``c`` checkpointed blocks
  per stage (the embedding's and LM head's own collectives, two per micro-batch, are left out);
- PP: each stage boundary sends the ``[b, s, d]`` activations forward and their gradient back per
  micro-batch, sequence-sharded so each TP rank sends ``1 / tp``; ``pp v - 1`` boundaries shared by
  ``pp`` stages: ``m * 2 (pp v - 1) / pp * b s d a / tp``;
- DP, ``P`` the largest stage's parameters on one TP rank: torch DDP (data parallelism alone)
  all-reduces the fp32 gradients once per step (``no_sync`` while accumulating), ``2 (dp - 1) / dp
  * 4 P``. FSDP2 (``fsdp``, ``hsdp``, and ``ddp`` next to tensor or pipeline parallelism, which
  is FSDP2 with shards of 1) over shard groups of ``S`` ranks and ``R = dp / S`` replicas
  all-gathers the parameters forward and backward and reduce-scatters the fp32 gradients for
  every micro-batch, then all-reduces the ``P / S`` shard over the replicas: ``m ((S - 1) / S *
  (2 p + 4) P + 2 (R - 1) / R * 4 P / S)``. Under pipeline parallelism the reductions happen once
  per step and a backward leaves its parameters gathered, so a stage gathers once per backward
  and once per warm-up forward: ``(m + min(m, pp)) (S - 1) / S * p P + (S - 1) / S * 4 P + 2 (R -
  1) / R * 4 P / S``.

Estimated step time (the cost the recommendation minimises; an estimate for ranking layouts, not
a measurement): training FLOPs (:func:`olmoflow.train.metrics.train_flops_per_token`, plus one
forward of every recomputed block) at ``ASSUMED_MFU`` of ``PEAK_FLOPS``, divided by ``1 - bubble``,
plus the TP and PP transfers (on the critical path) and the DP transfers that exceed the compute
time (DDP and FSDP overlap theirs with compute), at ``INTRA_NODE_BYTES_PER_S`` inside a node and
``INTER_NODE_BYTES_PER_S`` across nodes.

The recommendation (:func:`recommend`): of the layouts that fit (without activation checkpointing
when they can), with tensor parallelism inside a node (only ``tp <= gpus_per_node`` is tried
unless ``--tp`` asks), those within ``PIPELINE_MARGIN`` of the least estimated step time; of
these the fewest pipeline stages, then the fastest: a pipeline only when it is needed to fit or
clearly faster.
"""

from __future__ import annotations

from dataclasses import dataclass

from olmoflow.errors import OlmoflowError, unknown_name_error
from olmoflow.model.config import ModelConfig
from olmoflow.train.config import DATA_PARALLEL, PIPELINE_SCHEDULES
from olmoflow.train.plan import (
    GB,
    RESERVE_BYTES,
    attention_mask_bytes,
    checkpointed_blocks,
    head_loss_bytes,
    outside_bytes_per_token,
    tp_block_bytes_per_token,
)

LAYOUT_DATA_PARALLEL = DATA_PARALLEL  # ddp, fsdp, hsdp
GPUS_PER_NODE = 8
# The assumed machine of the step-time estimate: an H100 SXM node (dense bf16 peak, NVLink 4 per
# direction) with one 400 Gb/s NIC per GPU.
PEAK_FLOPS = 989e12
ASSUMED_MFU = 0.4
INTRA_NODE_BYTES_PER_S = 450e9
INTER_NODE_BYTES_PER_S = 50e9
PIPELINE_MARGIN = 0.1  # a deeper pipeline must be estimated this much faster to be preferred


@dataclass(frozen=True)
class Layout:
    """One way to place a run on ``dp * tp * pp`` GPUs.

    ``data_parallel``: ``ddp``, ``fsdp`` or ``hsdp`` (``shard_size`` ranks per shard group,
    ``dp / shard_size`` replicas); ``schedule``: ``1f1b``, ``interleaved_1f1b``
    (``stages_per_rank`` model chunks per GPU) or ``gpipe``; ``cpu_offload``: FSDP keeps the
    sharded states in host memory.
    """

    dp: int
    tp: int = 1
    pp: int = 1
    data_parallel: str = "fsdp"
    shard_size: int = 0
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    cpu_offload: bool = False

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def v(self) -> int:
        """Model chunks per GPU (1 unless the schedule is interleaved)."""
        return self.stages_per_rank if self.schedule == "interleaved_1f1b" else 1

    @property
    def shard(self) -> int:
        """Data-parallel ranks over which the states are sharded (1: replicated)."""
        if self.data_parallel == "fsdp":
            return self.dp
        return self.shard_size if self.data_parallel == "hsdp" else 1

    @property
    def name(self) -> str:
        """E.g. ``fsdp16 tp8 pp2``, ``hsdp64 (shard 8) tp1 pp1``, ``ddp2 tp2 pp4 v2``."""
        dp = f"{self.data_parallel}{self.dp}" if self.dp > 1 else "dp1"
        if self.data_parallel == "hsdp" and self.dp > 1:
            dp += f" (shard {self.shard_size})"
        s = f"{dp} tp{self.tp} pp{self.pp}"
        if self.pp > 1 and self.schedule != "1f1b":
            s += f" v{self.v}" if self.schedule == "interleaved_1f1b" else " gpipe"
        return s + (" offload" if self.cpu_offload else "")


@dataclass(frozen=True)
class StageMemory:
    """Bytes per GPU of one pipeline stage, by component (as in
    :class:`~olmoflow.train.plan.MemoryPlan`)."""

    weights: float
    gradients: float
    optimizer: float
    fsdp_buffers: float
    activations: float
    logits: float
    attention_masks: float
    reserve: float = RESERVE_BYTES

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.fsdp_buffers
                + self.activations + self.logits + self.attention_masks + self.reserve)


@dataclass(frozen=True)
class LayoutPlan:
    """The plan of one :class:`Layout`: the heaviest stage's memory without and with activation
    checkpointing, whether either fits, the bubble, bytes sent per GPU per step (``comm_tp``,
    ``comm_pp``, ``comm_dp``) and the estimated step time in seconds (``checkpointing`` says which
    memory the estimate uses: the cheaper one that fits)."""

    layout: Layout
    micro_batch_size: int
    micro_batches: int
    memory: StageMemory
    memory_checkpointed: StageMemory
    gpu_bytes: float
    bubble: float
    comm_tp: float
    comm_pp: float
    comm_dp: float
    step_seconds: float
    checkpointing: bool

    @property
    def fits(self) -> bool:
        return self.used.total <= self.gpu_bytes

    @property
    def used(self) -> StageMemory:
        """The memory of the mode the plan picks: no checkpointing when that fits."""
        return self.memory_checkpointed if self.checkpointing else self.memory

    @property
    def comm(self) -> float:
        return self.comm_tp + self.comm_pp + self.comm_dp


def bubble_fraction(pp: int, micro_batches: int, schedule: str = "1f1b",
                    stages_per_rank: int = 1) -> float:
    """The pipeline's idle fraction of a step (Narayanan et al. 2021): ``(pp - 1) / (m + pp - 1)``
    for 1F1B and GPipe, ``(pp - 1) / (v m + pp - 1)`` interleaved; 0 without a pipeline.

    Raises:
        OlmoflowError: an unknown ``schedule`` or a size < 1.
    """
    if schedule not in PIPELINE_SCHEDULES:
        raise unknown_name_error("train.parallel.pipeline_schedule", schedule, PIPELINE_SCHEDULES)
    if pp < 1 or micro_batches < 1 or stages_per_rank < 1:
        raise OlmoflowError("bubble: pipeline_parallel, micro-batches and stages_per_rank must "
                            "be >= 1")
    v = stages_per_rank if schedule == "interleaved_1f1b" else 1
    return (pp - 1) / (v * micro_batches + pp - 1)


def tp_param_counts(cfg: ModelConfig, tp: int) -> tuple[float, float, float, float]:
    """Parameters one tensor-parallel rank holds: ``(block, embedding, LM head, final norm)``."""
    d, q, kv = cfg.d_model, cfg.n_heads * cfg.hd, cfg.n_kv_heads * cfg.hd
    matrices = d * q + 2 * d * kv + q * d + 3 * d * cfg.mlp_hidden
    block = (matrices + q + kv) / tp + 2 * d  # QK-norms split with their heads; block norms whole
    vocab = cfg.vocab_size * d / tp
    return block, vocab, vocab, float(d)


def valid_sizes(cfg: ModelConfig, kind: str, limit: int, sequence_length: int = 0) -> list[int]:
    """The tensor- (``kind="tp"``: dividing n_heads, n_kv_heads, mlp_hidden, vocab_size and the
    sequence length when given) or pipeline-parallel (``"pp"``: dividing n_layers) sizes up to
    ``limit``."""
    if kind == "tp":
        dims = (cfg.n_heads, cfg.n_kv_heads, cfg.mlp_hidden, cfg.vocab_size, sequence_length or 1)
    else:
        dims = (cfg.n_layers,)
    return [k for k in range(1, limit + 1) if all(n % k == 0 for n in dims)]


def check_size(cfg: ModelConfig, flag: str, value: int, gpus: int, chunks: int = 1,
               sequence_length: int = 0) -> None:
    """Raise a one-line :class:`OlmoflowError` when ``--tp`` / ``--pp`` ``value`` cannot split the
    model or ``gpus``, naming what it does not divide and the closest valid size. A pipeline of
    ``chunks`` stages per rank (interleaved) needs ``n_layers`` to divide by ``value * chunks``;
    sequence parallelism needs ``sequence_length`` (when given) to divide by ``tp``."""
    kind = flag.lstrip("-")
    if value < 1:
        raise OlmoflowError(f"{flag} must be >= 1, got {value}")
    if kind == "tp":
        fields = {"model.n_heads": cfg.n_heads, "model.n_kv_heads": cfg.n_kv_heads,
                  "model.mlp_hidden": cfg.mlp_hidden, "model.vocab_size": cfg.vocab_size}
        if sequence_length:
            fields["train.sequence_length"] = sequence_length
        bad = next((k for k, n in fields.items() if n % value), None)
        valid = valid_sizes(cfg, "tp", gpus, sequence_length)
    else:
        fields = {"model.n_layers": cfg.n_layers}
        bad = "model.n_layers" if cfg.n_layers % (value * chunks) else None
        valid = [k for k in range(1, gpus + 1) if cfg.n_layers % (k * chunks) == 0]
    valid = [k for k in valid if gpus % k == 0]
    if bad is None and gpus % value == 0:
        return
    what = f"{bad}={fields[bad]}" if bad else f"--gpus {gpus}"
    if bad and kind == "pp" and chunks > 1:
        what += f" in {chunks} stages per rank"
    closest = min(valid, key=lambda k: (abs(k - value), k))
    raise OlmoflowError(f"{flag} {value} does not divide {what}; closest valid: {closest} "
                        f"(valid: {', '.join(map(str, valid))})")


def _in_flight(layout: Layout, m: int, first: bool) -> float:
    """Micro-batches whose activations a stage holds at its peak (see the module docstring)."""
    pp, v = layout.pp, layout.v
    if pp == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "1f1b":
        return float(min(m, pp)) if first else 1.0
    # Megatron's interleaved warm-up: 2 (pp - rank - 1) + (v - 1) pp chunks of L / (pp v) layers
    if first:
        return float(min(m, pp + (pp - 1) / v))
    return float(min(m, ((v - 1) * pp + 1) / v))


def _stage_memory(cfg: ModelConfig, layout: Layout, *, first: bool, last: bool, mb: int, seq: int,
                  m: int, act_bytes: int, param_bytes: int,
                  checkpointing: int) -> tuple[StageMemory, float]:
    """(memory, parameters on one GPU) of the first and/or last stage; ``checkpointing``: recompute
    every n-th block (0: none); ``param_bytes``: of an unsharded FSDP parameter."""
    tp, pp, d = layout.tp, layout.pp, cfg.d_model
    layers = cfg.n_layers // pp
    block, emb, head, norm = tp_param_counts(cfg, tp)
    root = (emb if first else 0.0) + (head + norm if last else 0.0)
    params = layers * block + root
    offloaded = layout.cpu_offload and layout.data_parallel != "ddp"  # an FSDP2 feature
    sharded = 0.0 if offloaded else params / layout.shard
    grads = params if pp > 1 else sharded
    buffers = 0.0
    if _uses_fsdp2(layout) and (layout.shard > 1 or param_bytes < 4):
        buffers = param_bytes * params if pp > 1 else 2 * param_bytes * (root + 2 * block)

    block_act = tp_block_bytes_per_token(cfg, act_bytes, tp)
    c = checkpointed_blocks(layers, checkpointing)
    kept = (layers - c) * block_act + c * 4 * d / tp  # a checkpointed block keeps its fp32 input
    outside = outside_bytes_per_token(cfg, tp, first, last)
    tokens = mb * seq
    acts = tokens * (_in_flight(layout, m, first) * (kept + outside) + (block_act if c else 0.0))
    logits = 0.0
    if last:  # fused head in one piece; else logits (pipeline loss, vocabulary-parallel loss)
        held = m if layout.schedule == "gpipe" and pp > 1 else 1
        per_mb, fixed = head_loss_bytes(cfg, tokens, act_bytes, tp, fused=tp == 1 and pp == 1)
        logits = held * per_mb + fixed
    mem = StageMemory(weights=4 * sharded, gradients=4 * grads, optimizer=8 * sharded,
                      fsdp_buffers=buffers, activations=acts, logits=logits,
                      attention_masks=float(attention_mask_bytes(cfg, seq)))
    return mem, params


def _uses_fsdp2(layout: Layout) -> bool:
    """Whether the trainer wraps this layout in FSDP2 (every data-parallel layout but torch DDP
    alone; ``ddp`` next to tensor or pipeline parallelism is FSDP2 with shards of one)."""
    if layout.dp == 1:
        return False
    return layout.data_parallel != "ddp" or layout.tp > 1 or layout.pp > 1


def _dp_comm(layout: Layout, params: float, m: int, param_bytes: int) -> list[tuple[float, int]]:
    """``(bytes, span in ranks)`` of each data-parallel collective group per step (module
    docstring)."""
    dp, tp, pp = layout.dp, layout.tp, layout.pp
    if dp == 1:
        return []
    if not _uses_fsdp2(layout):
        return [(2 * (dp - 1) / dp * 4 * params, tp * dp)]
    s = layout.shard
    r = dp // s
    frac = (s - 1) / s
    if pp == 1:
        shard = m * frac * (2 * param_bytes + 4) * params
        replicas = m * 2 * (r - 1) / r * 4 * params / s
    else:
        shard = (m + min(m, pp)) * frac * param_bytes * params + frac * 4 * params
        replicas = 2 * (r - 1) / r * 4 * params / s
    return [(shard, tp * s), (replicas, tp * dp)]


def _heaviest(cfg: ModelConfig, layout: Layout, checkpointing: int,
              **kw) -> tuple[StageMemory, float]:
    """The memory of the stage using the most (the first or the last: a middle one holds less
    than the first) and the most parameters a stage holds (the busiest in data parallelism)."""
    stages = [(True, True)] if layout.pp == 1 else [(True, False), (False, True)]
    plans = [_stage_memory(cfg, layout, first=f, last=la, checkpointing=checkpointing, **kw)
             for f, la in stages]
    return max(plans, key=lambda p: p[0].total)[0], max(p[1] for p in plans)


def _bandwidth(span: int, gpus_per_node: int) -> float:
    """Bytes/s of a group of ``span`` consecutive ranks: NVLink inside a node, the NIC across."""
    return INTRA_NODE_BYTES_PER_S if span <= gpus_per_node else INTER_NODE_BYTES_PER_S


def layout_plan(cfg: ModelConfig, layout: Layout, *, global_batch_size: int, micro_batch_size: int,
                sequence_length: int, gpu_memory_gb: float = 80.0, precision: str = "bf16",
                param_dtype: str = "auto", checkpointing: int = 1,
                gpus_per_node: int = GPUS_PER_NODE) -> LayoutPlan:
    """The :class:`LayoutPlan` of ``layout`` (every closed form is in the module docstring).

    Args:
        global_batch_size: instances per optimizer step; each of the ``dp`` ranks takes
            ``global_batch_size / dp`` in micro-batches of ``min(micro_batch_size, that)``.
        precision, param_dtype: ``train.precision`` and ``train.parallel.param_dtype``.
        checkpointing: the activation-checkpointing setting used when the run does not fit
            without it (recompute every n-th block; 0 means every block).
    Raises:
        OlmoflowError: an invalid layout (a size that does not divide the model, an unknown
            method or schedule), a batch that does not split over ``dp`` and micro-batches, or
            fewer micro-batches than pipeline stages.
    """
    from olmoflow.train.metrics import train_flops_per_token
    from olmoflow.train.plan import activation_dtype_bytes

    if layout.data_parallel not in LAYOUT_DATA_PARALLEL:
        raise unknown_name_error("data_parallel", layout.data_parallel, LAYOUT_DATA_PARALLEL)
    bubble_fraction(layout.pp, 1, layout.schedule, max(1, layout.stages_per_rank))  # validates
    check_size(cfg, "--tp", layout.tp, layout.gpus, sequence_length=sequence_length)
    check_size(cfg, "--pp", layout.pp, layout.gpus, layout.v)
    if layout.data_parallel == "hsdp" and (layout.shard_size < 1 or layout.dp % layout.shard_size):
        raise OlmoflowError(f"--shard-size {layout.shard_size} does not divide the {layout.dp} "
                            f"data-parallel ranks of {layout.dp * layout.tp * layout.pp} GPUs "
                            f"at tp{layout.tp} pp{layout.pp}")
    if global_batch_size % layout.dp:
        raise OlmoflowError(f"train.global_batch_size={global_batch_size} is not divisible by "
                            f"the {layout.dp} data-parallel ranks of {layout.name}")
    per_rank = global_batch_size // layout.dp
    mb = min(micro_batch_size, per_rank)
    if per_rank % mb:
        raise OlmoflowError(f"{per_rank} instances per data-parallel rank do not split into "
                            f"micro-batches of train.micro_batch_size={mb}")
    m = per_rank // mb
    if m < layout.pp:
        raise OlmoflowError(f"{layout.name}: {m} micro-batches per step, fewer than the "
                            f"{layout.pp} pipeline stages")
    act_bytes = activation_dtype_bytes(precision)
    bf16 = param_dtype == "bf16" or (param_dtype == "auto" and act_bytes == 2)
    compose = layout.tp > 1 or layout.pp > 1 or layout.data_parallel == "hsdp"
    param_bytes = 2 if bf16 and compose else 4
    kw = dict(mb=mb, seq=sequence_length, m=m, act_bytes=act_bytes, param_bytes=param_bytes)
    every = checkpointing or 1
    mem, params = _heaviest(cfg, layout, 0, **kw)
    mem_ckpt, _ = _heaviest(cfg, layout, every, **kw)
    gpu = gpu_memory_gb * GB
    use_ckpt = mem.total > gpu
    bubble = bubble_fraction(layout.pp, m, layout.schedule, max(1, layout.stages_per_rank))

    tp, pp = layout.tp, layout.pp
    layers = cfg.n_layers // pp
    c = checkpointed_blocks(layers, every) if use_ckpt else 0
    act = mb * sequence_length * cfg.d_model * act_bytes
    comm_tp = m * (tp - 1) / tp * act * (8 * layers + 4 * c)
    comm_pp = m * 2 * (pp * layout.v - 1) / pp * act / tp
    dp_parts = _dp_comm(layout, params, m, param_bytes)
    comm_dp = sum(b for b, _ in dp_parts)

    tokens_per_gpu = global_batch_size * sequence_length / layout.gpus
    flops = train_flops_per_token(cfg, sequence_length) * tokens_per_gpu * (1 + c / layers / 3)
    compute = flops / (PEAK_FLOPS * ASSUMED_MFU)
    dp_time = sum(b / _bandwidth(span, gpus_per_node) for b, span in dp_parts)
    step = (compute / (1 - bubble) + comm_tp / _bandwidth(tp, gpus_per_node)
            + comm_pp / _bandwidth(layout.gpus, gpus_per_node) + max(0.0, dp_time - compute))
    return LayoutPlan(layout=layout, micro_batch_size=mb, micro_batches=m, memory=mem,
                      memory_checkpointed=mem_ckpt, gpu_bytes=gpu, bubble=bubble, comm_tp=comm_tp,
                      comm_pp=comm_pp, comm_dp=comm_dp, step_seconds=step, checkpointing=use_ckpt)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def rank_key(plan: LayoutPlan, gpus_per_node: int = GPUS_PER_NODE) -> tuple:
    """The order of layouts: those that fit first, tensor parallelism inside a node before across
    nodes, then the least estimated step time; layouts that do not fit by their memory."""
    if not plan.fits:
        return (1, plan.used.total)
    return (0, plan.layout.tp > gpus_per_node, plan.step_seconds)


def fitting(plans: list[LayoutPlan], gpus_per_node: int = GPUS_PER_NODE) -> list[LayoutPlan]:
    """The layouts the recommendation chooses from: those that fit, with tensor parallelism
    inside a node when one of those fits."""
    fit = [p for p in plans if p.fits]
    return [p for p in fit if p.layout.tp <= gpus_per_node] or fit


def recommend(plans: list[LayoutPlan], gpus_per_node: int = GPUS_PER_NODE) -> LayoutPlan:
    """The layout to use: of the :func:`fitting` ones, the fastest (estimated) with the fewest
    pipeline stages whose fastest is within ``PIPELINE_MARGIN`` of the fastest of all (a
    pipeline only when it is needed to fit or clearly pays for its bubble and its complexity);
    when none fits, the smallest."""
    fit = fitting(plans, gpus_per_node)
    if not fit:
        return min(plans, key=lambda p: p.used.total)
    fastest = min(p.step_seconds for p in fit)
    near = [p for p in fit if p.step_seconds <= fastest * (1 + PIPELINE_MARGIN)]
    return min(near, key=lambda p: (p.layout.pp, p.step_seconds))


def candidate_plans(cfg: ModelConfig, gpus: int, *, tp: int | None = None, pp: int | None = None,
                    data_parallel: str | None = None, shard_size: int | None = None,
                    schedule: str = "1f1b", stages_per_rank: int = 1, cpu_offload: bool = False,
                    gpus_per_node: int = GPUS_PER_NODE, **plan_kw) -> list[LayoutPlan]:
    """One :class:`LayoutPlan` per valid ``(tp, pp)``, with its best data-parallel method (and HSDP
    shard size): the recommended one (:func:`recommend`) first, then the others by
    :func:`rank_key`.

    ``tp`` / ``pp`` / ``data_parallel`` / ``shard_size`` fix that part of the layout (None: try
    every valid value; TP up to ``gpus_per_node``); a ``shard_size`` alone implies HSDP.
    ``plan_kw`` goes to :func:`layout_plan`.

    Raises:
        OlmoflowError: a fixed ``tp`` or ``pp`` that does not divide the model or ``gpus``, an
            unknown method (or a degree given as one), a shard size with a method other than
            HSDP, or no layout whose batch splits.
    """
    if data_parallel is not None and data_parallel not in LAYOUT_DATA_PARALLEL:
        if str(data_parallel).isdigit():
            raise OlmoflowError(f"--data-parallel takes a method ({', '.join(LAYOUT_DATA_PARALLEL)}"
                                f"), not a degree ('{data_parallel}'): the data-parallel degree "
                                "is --gpus / (--tp x --pp)")
        raise unknown_name_error("--data-parallel", data_parallel, LAYOUT_DATA_PARALLEL)
    if shard_size:  # a shard group exists under HSDP only
        if data_parallel is None:
            data_parallel = "hsdp"
        elif data_parallel != "hsdp":
            raise OlmoflowError(f"--shard-size {shard_size} is for --data-parallel hsdp, not "
                                f"{data_parallel}")
    v = stages_per_rank if schedule == "interleaved_1f1b" else 1
    seq = plan_kw.get("sequence_length", 0)
    if tp is not None:
        check_size(cfg, "--tp", tp, gpus, sequence_length=seq)
    if pp is not None:
        check_size(cfg, "--pp", pp, gpus, v)
    tps = [tp] if tp else [k for k in valid_sizes(cfg, "tp", min(gpus, gpus_per_node), seq)
                           if gpus % k == 0]
    out: list[LayoutPlan] = []
    errors: list[str] = []
    for t in tps:
        pps = [pp] if pp else [k for k in _divisors(gpus // t) if cfg.n_layers % (k * v) == 0]
        for p in pps:
            dp = gpus // (t * p)
            methods = [data_parallel] if data_parallel else list(LAYOUT_DATA_PARALLEL)
            options = []
            for method in methods:
                if dp == 1 and method != (data_parallel or "ddp"):
                    continue  # one data-parallel rank: every method is the same
                sizes = [0]
                if method == "hsdp":
                    sizes = ([shard_size] if shard_size else
                             [s for s in _divisors(dp) if 1 < s < dp])
                for s in sizes:
                    lay = Layout(dp=dp, tp=t, pp=p, data_parallel=method, shard_size=s,
                                 schedule=schedule if p > 1 else "1f1b", stages_per_rank=v,
                                 cpu_offload=cpu_offload and method != "ddp")
                    try:
                        options.append(layout_plan(cfg, lay, gpus_per_node=gpus_per_node,
                                                   **plan_kw))
                    except OlmoflowError as e:
                        errors.append(str(e))
            if options:
                out.append(min(options, key=lambda pl: rank_key(pl, gpus_per_node)))
    if not out:
        raise OlmoflowError(errors[0] if errors else f"no layout splits the model over {gpus} GPUs")
    best = recommend(out, gpus_per_node)
    return [best] + sorted((p for p in out if p is not best),
                           key=lambda pl: rank_key(pl, gpus_per_node))
