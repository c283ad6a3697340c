"""The memory plan: bytes per GPU to train an OLMo model under DDP or FSDP2, printed by
``olmoflow plan CONFIG --gpus N`` (:mod:`olmoflow.train.plan_report`, which also plans data x
tensor x pipeline layouts with :mod:`olmoflow.train.plan_layout`, built on the per-token counts
here).

Every term is a closed form in the model shape and the batch (P parameters, N data-parallel
ranks, b instances per micro-batch of s tokens; GB = 1e9 bytes):

- weights: fp32 master weights, ``4 P`` (``4 P / N`` sharded by FSDP);
- gradients: fp32, ``4 P`` (``/ N`` under FSDP; DDP's buckets alias them, no second copy);
- optimizer: AdamW's two fp32 moments, ``8 P`` (``/ N`` under FSDP);
- FSDP buffers: the unsharded fp32 parameters and gradients of the root (embeddings, LM head,
  final norm) and of two blocks (the one computing and the one prefetched), ``2 * 4 (P_root +
  2 P_block)``;
- activations: what autograd keeps for backward, ``b s`` times the per-token bytes of
  :func:`activation_bytes_per_token`, counted from this implementation's block (see below);
- LM head and loss (:func:`head_loss_bytes`): in training the model runs them fused, chunk by
  chunk (:func:`olmoflow.model.loss.linear_lm_loss`): the gradients wrt the head's input (``a d``
  bytes per token) and weight (fp32, ``4 V d``) and two fp32 ``[rows, V]`` chunk buffers, never
  the whole logits; where it cannot (tensor or pipeline parallelism) the ``[b s, V]`` logits and
  the fp32 log-softmax buffer the backward reuses for the gradient, ``8 V`` bytes per token;
- sliding-window masks: the ``sdpa`` backend's dense ``[s, s]`` masks, ``8 s^2`` (see
  :func:`attention_mask_bytes`);
- reserve: CUDA context, NCCL buffers and allocator slack, a flat 2 GB.

Activation elements saved per token in one block, counted with
``torch.autograd.graph.saved_tensors_hooks`` on this model in fp32 (tests/train/test_plan.py
checks the count against a measurement): ``6 d + 4 q + 4 kv + 4 f`` activations plus ``n_heads
+ 4`` fp32 statistics (attention log-sum-exp, the four RMSNorms' inverse RMS), with ``d =
d_model``, ``q = n_heads * head_dim``, ``kv = n_kv_heads * head_dim``, ``f = mlp_hidden``. Under
bf16 autocast the RMSNorm inputs (``q + kv + 2 d``) are upcast and kept in fp32 and the rest in
bf16. Outside the blocks: the embedding output, the final norm's input and the LM head's input,
``3 d`` (fp32), and 24 bytes of loss bookkeeping per token. A block under activation
checkpointing keeps only its input (``d``, the fp32 residual) and is recomputed during backward,
so one whole block's activations are live at a time on top. Compare Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models" (2022): ``34 s b h`` bytes per
layer (plus ``5 a s^2 b`` without fused attention), the analogous count for a GPT block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from olmoflow.errors import OlmoflowError
from olmoflow.model.config import ModelConfig

GB = 1e9
RESERVE_BYTES = 2 * GB
LOGITS_BYTES_PER_VOCAB = 8  # logits (kept by the caller) + fp32 log-softmax / gradient buffer
OUTSIDE_BYTES_PER_D = 12  # embedding output, final norm input, LM head input: 3 d in fp32
LOSS_BYTES_PER_TOKEN = 24  # the loss's int64 target, fp32 log-sum-exp and fp32 validity mask


def activation_dtype_bytes(precision: str) -> int:
    """Bytes of one activation element: 2 under bf16 autocast, 4 in fp32.

    ``auto`` means bf16, as the trainer does on GPU (the plan is for GPUs; the CPU finder passes
    ``fp32``).

    Raises:
        OlmoflowError: ``precision`` is not auto, bf16 or fp32.
    """
    if precision in ("auto", "bf16"):
        return 2
    if precision == "fp32":
        return 4
    raise OlmoflowError(f"precision '{precision}' is not one of: auto, bf16, fp32")


def block_elements_per_token(cfg: ModelConfig) -> tuple[int, int]:
    """``(activations, fp32 statistics)``: elements one block saves for backward per token."""
    d, q, kv, f = cfg.d_model, cfg.n_heads * cfg.hd, cfg.n_kv_heads * cfg.hd, cfg.mlp_hidden
    return 6 * d + 4 * q + 4 * kv + 4 * f, cfg.n_heads + 4


def block_bytes_per_token(cfg: ModelConfig, act_bytes: int) -> int:
    """Bytes one block keeps for backward per token (``act_bytes``: 2 bf16, 4 fp32)."""
    acts, stats = block_elements_per_token(cfg)
    upcast = cfg.n_heads * cfg.hd + cfg.n_kv_heads * cfg.hd + 2 * cfg.d_model  # RMSNorm inputs
    if act_bytes == 4:
        return 4 * (acts + stats)
    return act_bytes * (acts - upcast) + 4 * (upcast + stats)


def tp_block_bytes_per_token(cfg: ModelConfig, act_bytes: int, tp: int = 1) -> float:
    """Bytes one block keeps per token on one of ``tp`` tensor-parallel ranks with sequence
    parallelism: :func:`block_bytes_per_token` divided by ``tp``, except the attention's and the
    MLP's inputs, which the column-parallel projections save all-gathered over the whole sequence
    (``2 d`` per token; Megatron-LM saves them sharded and gathers again in backward, DTensor's
    ``PrepareModuleInput`` does not). Measured under ``tp=2`` in tests/train/test_plan.py."""
    block = block_bytes_per_token(cfg, act_bytes)
    if tp == 1:
        return float(block)
    gathered = 2 * cfg.d_model * act_bytes
    return (block - gathered) / tp + gathered


def outside_bytes_per_token(cfg: ModelConfig, tp: int = 1, first: bool = True,
                            last: bool = True) -> float:
    """Bytes kept per token outside the blocks on a pipeline stage that is the ``first`` (the
    embedding output) and/or the ``last`` (the final norm's and LM head's inputs, the loss
    bookkeeping): ``3 d`` fp32 and 24 bytes in one process. Under tensor parallelism the
    sequence-parallel tensors divide by ``tp``, the LM head's input is saved all-gathered."""
    d = cfg.d_model
    out = 4 * d / tp if first else 0.0
    if last:
        out += 4 * d / tp + 4 * d + LOSS_BYTES_PER_TOKEN
    return out


def checkpointed_blocks(n_layers: int, every: int) -> int:
    """How many blocks ``activation_checkpointing=every`` recomputes (blocks 0, every,
    2 every, ...)."""
    return 0 if every <= 0 else len(range(0, n_layers, every))


def activation_bytes_per_token(cfg: ModelConfig, act_bytes: int, checkpointing: int = 0) -> int:
    """Bytes autograd holds per token at the peak of backward, without the logits.

    ``checkpointing``: recompute every n-th block (0: none; 1: every block).
    """
    block = block_bytes_per_token(cfg, act_bytes)
    c = checkpointed_blocks(cfg.n_layers, checkpointing)
    outside = OUTSIDE_BYTES_PER_D * cfg.d_model + LOSS_BYTES_PER_TOKEN
    kept = (cfg.n_layers - c) * block + c * 4 * cfg.d_model
    recompute = block if c else 0  # one recomputed block is live during its backward
    return kept + recompute + outside


def attention_mask_bytes(cfg: ModelConfig, sequence_length: int) -> int:
    """Bytes of the dense ``[T, T]`` sliding-window masks the ``sdpa`` backend builds and keeps
    for backward (measured: 8 per entry, shared by the micro-batch's rows and the layers of one
    window); 0 without sliding windows or with a backend that takes the window as numbers."""
    if not cfg.sliding_window or cfg.attention_backend not in ("sdpa", "eager"):
        return 0
    return 8 * sequence_length * sequence_length


def head_loss_bytes(cfg: ModelConfig, tokens: int, act_bytes: int, tp: int = 1,
                    fused: bool = True) -> tuple[float, float]:
    """``(per micro-batch, fixed)`` bytes the LM head and the loss hold at the peak of a step on
    ``tokens`` tokens. ``fused`` (one process, DDP, FSDP: the model's chunked
    :func:`~olmoflow.model.loss.linear_lm_loss`): the input's gradient ``tokens * act_bytes *
    d``, and fixed the fp32 weight gradient ``4 V d`` and the two fp32 chunk buffers ``8 rows
    V``. Otherwise the ``[tokens, V / tp]`` logits and their log-softmax, ``8 V / tp`` per token."""
    v, d = cfg.vocab_size, cfg.d_model
    if not fused:
        return tokens * LOGITS_BYTES_PER_VOCAB * v / tp, 0.0
    from olmoflow.model.loss import CHUNK_LOGITS, CHUNK_MIN_ROWS

    rows = max(CHUNK_MIN_ROWS, CHUNK_LOGITS // v)  # a chunk's rows (fewer when tokens are)
    return float(tokens * act_bytes * d), float(4 * v * d + 8 * rows * v)


def saved_activation_bytes(cfg: ModelConfig, micro_batch_size: int, sequence_length: int,
                           act_bytes: int = 4, tp: int = 1) -> float:
    """Bytes of the tensors autograd saves in one forward (no checkpointing): blocks, the
    ``3 d`` outside them and the fp32 log-softmax ``V``, for
    ``[micro_batch_size, sequence_length]``, on one of ``tp`` tensor-parallel ranks (sequence
    parallel: :func:`tp_block_bytes_per_token`, :func:`outside_bytes_per_token`, the log-softmax
    ``/ tp``; one process: the fused head's two gradients instead, :func:`head_loss_bytes`). What
    ``saved_tensors_hooks`` sees; the plan adds the logits kept by the caller and the chunks."""
    per_token = (cfg.n_layers * tp_block_bytes_per_token(cfg, act_bytes, tp)
                 + outside_bytes_per_token(cfg, tp))
    tokens = micro_batch_size * sequence_length
    if tp == 1:  # the fused head saves its two gradients
        head = tokens * act_bytes * cfg.d_model + 4 * cfg.vocab_size * cfg.d_model
    else:  # the vocabulary-parallel loss saves the log-softmax of its shard
        head = tokens * 4 * cfg.vocab_size / tp
    rope_tables = (2 if cfg.yarn_factor else 1) * 2 * sequence_length * cfg.hd * 4  # fp32 cos, sin
    return (tokens * per_token + head + rope_tables
            + attention_mask_bytes(cfg, sequence_length))


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU to train ``params`` parameters on ``world_size`` ranks, by component.

    ``activations`` and ``activations_checkpointed`` are for one micro-batch of
    ``micro_batch_size`` x ``sequence_length`` tokens without / with activation checkpointing
    (``checkpointing`` = recompute every n-th block); ``logits`` likewise (the part of the LM
    head and loss that grows with the micro-batch; ``loss_buffers`` the part that does not).
    """

    data_parallel: str
    world_size: int
    params: int
    micro_batch_size: int
    sequence_length: int
    checkpointing: int
    weights: float
    gradients: float
    optimizer: float
    fsdp_buffers: float
    activations: float
    activations_checkpointed: float
    logits: float
    attention_masks: float = 0.0
    reserve: float = RESERVE_BYTES
    loss_buffers: float = 0.0

    @property
    def static(self) -> float:
        """Bytes that do not depend on the micro-batch size."""
        return (self.weights + self.gradients + self.optimizer + self.fsdp_buffers
                + self.attention_masks + self.reserve + self.loss_buffers)

    def total(self, checkpointed: bool) -> float:
        act = self.activations_checkpointed if checkpointed else self.activations
        return self.static + act + self.logits

    def per_instance(self, checkpointed: bool) -> float:
        """Bytes one more instance in the micro-batch adds."""
        act = self.activations_checkpointed if checkpointed else self.activations
        return (act + self.logits) / self.micro_batch_size

    def max_micro_batch(self, gpu_bytes: float, checkpointed: bool) -> int:
        """The largest micro-batch (instances) whose total fits in ``gpu_bytes`` (0: none)."""
        free = gpu_bytes - self.static
        return max(0, math.floor(free / self.per_instance(checkpointed)))


def memory_plan(cfg: ModelConfig, *, world_size: int, data_parallel: str, micro_batch_size: int,
                sequence_length: int, precision: str = "bf16",
                checkpointing: int = 1) -> MemoryPlan:
    """The :class:`MemoryPlan` per GPU (see the module docstring for every closed form).

    Args:
        cfg: the model shape (``vocab_size`` must be set).
        world_size: data-parallel ranks (GPUs); data_parallel: ``ddp`` or ``fsdp`` (``hsdp``,
            whose shard size this plan does not take, is counted replicated: an upper bound;
            :mod:`olmoflow.train.plan_layout` plans it).
        micro_batch_size, sequence_length: one micro-batch, in instances and tokens per instance.
        precision: activation precision: ``bf16``/``auto`` (2-byte activations) or ``fp32``.
        checkpointing: the activation-checkpointing setting the "checkpointed" column uses
            (recompute every n-th block; the other column has none).
    Raises:
        OlmoflowError: a non-positive size, an unknown ``data_parallel`` or ``precision``.
    """
    from olmoflow.train.config import DATA_PARALLEL

    if data_parallel not in DATA_PARALLEL:
        from olmoflow.errors import unknown_name_error

        raise unknown_name_error("data_parallel", data_parallel, DATA_PARALLEL)
    if world_size < 1 or micro_batch_size < 1 or sequence_length < 1 or cfg.vocab_size < 1:
        raise OlmoflowError("memory plan: world_size, micro_batch_size, sequence_length and "
                            "model.vocab_size must be >= 1")
    act_bytes = activation_dtype_bytes(precision)
    p = cfg.num_params()
    shard = world_size if data_parallel == "fsdp" else 1
    buffers = 0.0
    if data_parallel == "fsdp" and world_size > 1:
        non_emb = cfg.num_params(include_embedding=False)
        p_root = p - non_emb + cfg.d_model  # embeddings, LM head, final norm
        p_block = (non_emb - cfg.d_model) / cfg.n_layers
        buffers = 2 * 4 * (p_root + 2 * p_block)
    tokens = micro_batch_size * sequence_length
    head, head_fixed = head_loss_bytes(cfg, tokens, act_bytes)
    return MemoryPlan(
        data_parallel=data_parallel, world_size=world_size, params=p,
        micro_batch_size=micro_batch_size, sequence_length=sequence_length,
        checkpointing=checkpointing,
        weights=4 * p / shard, gradients=4 * p / shard, optimizer=8 * p / shard,
        fsdp_buffers=buffers,
        activations=tokens * activation_bytes_per_token(cfg, act_bytes, 0),
        activations_checkpointed=tokens * activation_bytes_per_token(cfg, act_bytes,
                                                                     max(1, checkpointing)),
        logits=head, loss_buffers=head_fixed,
        attention_masks=attention_mask_bytes(cfg, sequence_length),
    )


def _gb(x: float) -> str:
    return f"{x / GB:,.2f}"


def format_plans(plans: list[MemoryPlan], gpu_memory_gb: float, title: str = "") -> str:
    """A markdown table: one column per plan (e.g. DDP and FSDP), one row per component, the
    totals without/with activation checkpointing, whether each fits ``gpu_memory_gb`` and the
    largest micro-batch that does."""
    gpu = gpu_memory_gb * GB
    every = plans[0].checkpointing or 1
    ac = "every block" if every == 1 else f"every {every} blocks"
    p0 = plans[0]
    rows: list[tuple[str, list[str]]] = [
        ("weights (fp32 master)", [_gb(p.weights) for p in plans]),
        ("gradients (fp32)", [_gb(p.gradients) for p in plans]),
        ("AdamW moments (2 x fp32)", [_gb(p.optimizer) for p in plans]),
        ("FSDP unsharded buffers", [_gb(p.fsdp_buffers) for p in plans]),
        ("activations, no checkpointing", [_gb(p.activations) for p in plans]),
        (f"activations, checkpointing {ac}", [_gb(p.activations_checkpointed) for p in plans]),
        ("LM head + loss (fused, chunked)", [_gb(p.logits + p.loss_buffers) for p in plans]),
        ("sliding-window masks (sdpa)", [_gb(p.attention_masks) for p in plans]),
        ("reserve (CUDA context, NCCL, slack)", [_gb(p.reserve) for p in plans]),
        ("total, no checkpointing", [_gb(p.total(False)) for p in plans]),
        (f"total, checkpointing {ac}", [_gb(p.total(True)) for p in plans]),
        (f"fits {gpu_memory_gb:g} GB, no checkpointing",
         ["yes" if p.total(False) <= gpu else "no" for p in plans]),
        (f"fits {gpu_memory_gb:g} GB, checkpointing",
         ["yes" if p.total(True) <= gpu else "no" for p in plans]),
        ("largest micro-batch that fits, no ckpt",
         [str(p.max_micro_batch(gpu, False)) for p in plans]),
        ("largest micro-batch that fits, ckpt", [str(p.max_micro_batch(gpu, True)) for p in plans]),
    ]
    head = [f"{p.data_parallel.upper()} x{p.world_size} (GB)" for p in plans]
    w = max(len(r[0]) for r in rows)
    cw = max(max(len(h) for h in head), 10)
    lines = []
    if title:
        lines.append(title)
    lines.append(f"parameters {p0.params:,}; micro-batch {p0.micro_batch_size} x "
                 f"{p0.sequence_length} tokens; GB = 1e9 bytes")
    lines.append("")
    lines.append(f"| {'per GPU':<{w}} | " + " | ".join(f"{h:>{cw}}" for h in head) + " |")
    lines.append(f"|{'-' * (w + 2)}|" + "|".join("-" * (cw + 2) for _ in head) + "|")
    for name, vals in rows:
        lines.append(f"| {name:<{w}} | " + " | ".join(f"{v:>{cw}}" for v in vals) + " |")
    return "\n".join(lines)
