"""What ``olmoflow plan CONFIG --gpus N`` prints: the DDP/FSDP memory table of
:mod:`olmoflow.train.plan`, then the data x tensor x pipeline layouts of
:mod:`olmoflow.train.plan_layout` and the recommended one with its reason."""

from __future__ import annotations

from dataclasses import replace

from olmoflow.errors import OlmoflowError
from olmoflow.model.config import ModelConfig
from olmoflow.train.plan import GB, format_plans, memory_plan
from olmoflow.train.plan_layout import (
    ASSUMED_MFU,
    GPUS_PER_NODE,
    INTER_NODE_BYTES_PER_S,
    INTRA_NODE_BYTES_PER_S,
    PEAK_FLOPS,
    PIPELINE_MARGIN,
    Layout,
    LayoutPlan,
    candidate_plans,
    fitting,
    layout_plan,
)


def _secs(x: float) -> str:
    return f"{x:,.1f}" if x >= 1 else f"{x:.2g}"


def _short(p: LayoutPlan) -> str:
    ckpt = " with ckpt" if p.checkpointing else ""
    return f"{p.layout.name}: {p.used.total / GB:,.1f} GB{ckpt}, est. {_secs(p.step_seconds)} s"


def recommendation(plans: list[LayoutPlan], gpu_memory_gb: float,
                   current: LayoutPlan | None = None,
                   gpus_per_node: int = GPUS_PER_NODE) -> str:
    """One line: the first of ``plans`` (sorted by
    :func:`~olmoflow.train.plan_layout.candidate_plans`) and why, against the run's ``current``
    layout when given (a tensor-parallel group wider than ``gpus_per_node`` is named as one
    that spans nodes)."""
    best = plans[0]
    name = best.layout.name
    if not best.fits:
        return (f"nothing fits {gpu_memory_gb:g} GB: the smallest is {name} at "
                f"{best.used.total / GB:,.1f} GB; use more GPUs, a smaller micro-batch or "
                "cpu_offload")
    ckpt = "with" if best.checkpointing else "without"
    why = [f"fits in {best.used.total / GB:,.1f} GB {ckpt} activation checkpointing, "
           f"est. {_secs(best.step_seconds)} s/step"]

    fastest = min(fitting(plans), key=lambda p: p.step_seconds)
    tried = [p for p in plans if p.layout.pp < best.layout.pp]
    if best.layout.pp == 1:
        why.append("no pipeline needed" + ("" if fastest is best else
                   f" (the fastest, {fastest.layout.name}, is est. "
                   f"{1 - fastest.step_seconds / best.step_seconds:.0%} faster)"))
    elif not tried:
        why.append(f"{best.layout.pp} pipeline stages as asked")
    elif not any(p.fits for p in tried):
        why.append(f"no layout with fewer than {best.layout.pp} pipeline stages fits")
    elif fastest is best:
        why.append(f"every layout with fewer pipeline stages is est. over "
                   f"{PIPELINE_MARGIN:.0%} slower")
    else:
        why.append(f"the fewest pipeline stages within {PIPELINE_MARGIN:.0%} of the fastest, "
                   f"{fastest.layout.name} (est. {_secs(fastest.step_seconds)} s)")
    if best.layout.tp > gpus_per_node:
        why.append(f"tensor parallelism across nodes (tp {best.layout.tp} > {gpus_per_node} "
                   "GPUs per node: its collectives run at the inter-node rate)")
    elif best.layout.tp > 1:
        why.append("tensor parallelism inside a node")
    if current is not None and current.layout.name != best.layout.name:
        why.append(f"vs the config's {_short(current)}")
    return f"recommended: {name}: " + "; ".join(why)


def format_layouts(plans: list[LayoutPlan], gpu_memory_gb: float, limit: int = 12,
                   current: LayoutPlan | None = None,
                   gpus_per_node: int = GPUS_PER_NODE) -> str:
    """A markdown table of ``plans`` (at most ``limit`` rows; 0: all) and the recommendation
    (against ``current``, the run's own layout, when given)."""
    fit = f"fits {gpu_memory_gb:g} GB"
    head = ["layout (data x tensor x pipeline)", "memory/GPU (GB)", fit, "bubble",
            "comm/step (GB)", "est. step (s)"]
    rows = []
    shown = plans if limit <= 0 else plans[:limit]
    for p in shown:
        ok = ("yes, ckpt" if p.checkpointing else "yes") if p.fits else "no"
        rows.append([p.layout.name, f"{p.used.total / GB:,.2f}", ok, f"{100 * p.bubble:.1f}%",
                     f"{p.comm / GB:,.1f}", _secs(p.step_seconds)])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["| " + " | ".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}"
                               for i, (h, w) in enumerate(zip(head, widths))) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}"
                                       for i, (c, w) in enumerate(zip(r, widths))) + " |")
    if len(shown) < len(plans):
        lines.append(f"({len(plans) - len(shown)} more layouts: --all lists them)")
    best = plans[0]
    b = best.used
    lines += ["", recommendation(plans, gpu_memory_gb, current, gpus_per_node),
              f"  per GPU (GB): states {(b.weights + b.gradients + b.optimizer) / GB:,.2f}, FSDP "
              f"buffers {b.fsdp_buffers / GB:,.2f}, activations {b.activations / GB:,.2f}, logits "
              f"{b.logits / GB:,.2f}; {best.micro_batches} micro-batch(es) of "
              f"{best.micro_batch_size}; comm/step (GB): TP {best.comm_tp / GB:,.1f}, PP "
              f"{best.comm_pp / GB:,.1f}, DP {best.comm_dp / GB:,.1f}"]
    return "\n".join(lines)


def layouts_section(cfg: ModelConfig, gpus: int, gpu_memory_gb: float, *, show_all: bool = False,
                    current: Layout | None = None, **kw) -> str:
    """The ``olmoflow plan`` text for 3D layouts: a caption and :func:`format_layouts` of
    :func:`~olmoflow.train.plan_layout.candidate_plans` (``kw``), compared with the run's own
    layout ``current``."""

    plans = candidate_plans(cfg, gpus, gpu_memory_gb=gpu_memory_gb, **kw)
    gpn = kw.get("gpus_per_node", GPUS_PER_NODE)
    plan_kw = {k: v for k, v in kw.items() if k in (
        "global_batch_size", "micro_batch_size", "sequence_length", "precision", "param_dtype",
        "checkpointing", "gpus_per_node")}
    now = None
    if current is not None:
        try:
            now = layout_plan(cfg, current, gpu_memory_gb=gpu_memory_gb, **plan_kw)
        except OlmoflowError:
            now = None  # the run's own layout does not apply to this many GPUs
    caption = (f"3D layouts on {gpus} GPU(s), {gpn} per node (tensor parallel with sequence "
               f"parallelism; est. step: {ASSUMED_MFU:.0%} of {PEAK_FLOPS / 1e12:g} TFLOP/s, "
               f"{INTRA_NODE_BYTES_PER_S / 1e9:g} GB/s in a node, "
               f"{INTER_NODE_BYTES_PER_S / 1e9:g} GB/s across; see olmoflow.train.plan_layout)")
    return caption + "\n\n" + format_layouts(plans, gpu_memory_gb, 0 if show_all else 12, now,
                                             gpn)


def plan_config(run_cfg, gpus: int, gpu_memory_gb: float = 80.0, *, tp: int | None = None,
                pp: int | None = None, data_parallel: str | None = None,
                shard_size: int | None = None, gpus_per_node: int = 8,
                show_all: bool = False) -> str:
    """``olmoflow plan``: the DDP and FSDP plans of a run config on ``gpus`` GPUs, then its 3D
    layouts (:mod:`olmoflow.train.plan_layout`) with the recommended one, as text.

    A model ``vocab_size`` of 0 (taken from the tokenizer at pretrain time) is planned as the
    vocabulary the run will have: that of the ``train.data`` tokens' tokenizer when given, else
    ``tokenizer.vocab_size``, padded to ``model.vocab_pad_multiple``. The activation-checkpointing
    column uses
    ``train.activation_checkpointing`` (every block when it is 0). ``tp``, ``pp``,
    ``data_parallel`` and ``shard_size`` fix that part of the layouts tried (None: all valid);
    the pipeline schedule, stages per rank and CPU offload come from ``train.parallel`` when it
    has them.

    Raises:
        OlmoflowError: ``gpus`` < 1, ``gpu_memory_gb`` <= 0, a batch that does not split, or a
            ``tp`` / ``pp`` that does not divide the model (one line, naming the closest valid).
    """

    if gpus < 1:
        raise OlmoflowError(f"--gpus must be >= 1, got {gpus}")
    if not 0 < gpu_memory_gb < float("inf"):
        raise OlmoflowError(f"--gpu-memory-gb must be a number of GB > 0, got {gpu_memory_gb}")
    if gpus_per_node < 1:
        raise OlmoflowError(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
    mc = run_cfg.model
    if mc.vocab_size <= 0:
        mc = replace(mc, vocab_size=mc.padded_vocab_size(_tokenizer_vocab(run_cfg)))
    t = run_cfg.train
    if t.global_batch_size % gpus:
        raise OlmoflowError(f"train.global_batch_size={t.global_batch_size} is not divisible by "
                            f"--gpus {gpus}; each GPU takes an equal slice")
    per_rank = t.global_batch_size // gpus
    mb = min(t.micro_batch_size, per_rank)
    plans = [memory_plan(mc, world_size=gpus, data_parallel=dp, micro_batch_size=mb,
                         sequence_length=t.sequence_length, precision=t.precision,
                         checkpointing=t.activation_checkpointing or 1)
             for dp in ("ddp", "fsdp")]
    accum = per_rank // mb if per_rank % mb == 0 else None
    title = (f"memory plan: {gpus} GPU(s) of {gpu_memory_gb:g} GB; global batch "
             f"{t.global_batch_size} x {t.sequence_length} tokens = {per_rank} per GPU"
             + (f" = {accum} micro-batch(es) of {mb}" if accum else ""))
    par = t.parallel
    schedule = getattr(par, "pipeline_schedule", "1f1b")
    v = getattr(par, "stages_per_rank", None) or (2 if schedule == "interleaved_1f1b" else 1)
    offload = bool(getattr(par, "cpu_offload", False))
    now_tp = getattr(par, "tensor_parallel", 1) or 1
    now_pp = getattr(par, "pipeline_parallel", 1) or 1
    method = getattr(par, "method", par.data_parallel)
    current = None
    if gpus % (now_tp * now_pp) == 0:
        now_dp = gpus // (now_tp * now_pp)
        if getattr(par, "degree", None) in (None, now_dp):  # else the config is for other GPUs
            current = Layout(dp=now_dp, tp=now_tp, pp=now_pp, data_parallel=method,
                             shard_size=getattr(par, "shard_size", None) or now_dp,
                             schedule=schedule if now_pp > 1 else "1f1b", stages_per_rank=v,
                             cpu_offload=offload)
    layouts = layouts_section(
        mc, gpus, gpu_memory_gb, show_all=show_all, current=current, tp=tp, pp=pp,
        data_parallel=data_parallel, shard_size=shard_size, schedule=schedule,
        stages_per_rank=v, cpu_offload=offload, gpus_per_node=gpus_per_node,
        global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
        sequence_length=t.sequence_length, precision=t.precision,
        param_dtype=getattr(par, "param_dtype", "auto"),
        checkpointing=t.activation_checkpointing or 1)
    return format_plans(plans, gpu_memory_gb, title) + "\n\n" + layouts


def _tokenizer_vocab(run_cfg) -> int:
    """The vocabulary size the run's tokenizer has (``train.data``) or will have (``tokenizer``)."""
    from olmoflow.data.tokenize import open_token_dir

    sizes = [open_token_dir(d).meta.get("vocab_size") for d in run_cfg.train.data]
    return max([v for v in sizes if isinstance(v, int)], default=run_cfg.tokenizer.vocab_size)
