"""Training throughput and MFU (model FLOPs utilisation) of olmoflow's ``Trainer`` on GPUs.

What it runs: ``Trainer.train_step`` (the step ``Trainer.fit`` runs: lr schedule, accumulation
normalised by the global batch, gradient clipping, fused AdamW) on the ``olmo2_1b`` preset
(``--preset``), fed synthetic global batches of uniformly random token ids (seeded, made before
the timing starts), in bf16 (``train.precision=bf16``: autocast over fp32 master weights), with the
attention backend ``flash`` when ``flash_attn`` imports, else ``sdpa``, once eager and once with
``train.compile`` (each block through ``torch.compile``). With ``--tp 2`` it re-launches itself
under ``torchrun --nproc_per_node=2`` and trains with ``train.parallel.tensor_parallel=2`` and
``data_parallel=fsdp`` (FSDP's ``MixedPrecisionPolicy`` follows ``train.precision``); where this
olmoflow has no such field, or its Trainer leaves no parameter sharded over a ``tp`` mesh
dimension, it says so and exits 3. A row whose attention backend fell back to ``sdpa`` (the
model's one-time warning) is flagged ``[FELL BACK to sdpa]``.

How it measures: ``--warmup`` untimed steps first (they pay ``torch.compile`` and the allocator's
growth), then ``--steps`` timed ones, each bracketed by ``torch.cuda.synchronize()``; the table
reports the median step. Tokens/s = global batch tokens / median step seconds; MFU = tokens/s x
training FLOPs per token (:func:`olmoflow.train.metrics.train_flops_per_token`: 6 N + attention,
PaLM appendix B) / (peak FLOP/s x GPUs). The peak is the vendor's dense bf16 figure for a GPU in
:data:`PEAK_TFLOPS` (``--peak-tflops`` overrides), else a bf16 matmul measured here
(:func:`olmoflow.train.metrics.matmul_peak`, 8192^3), which is printed either way. Peak memory is
``torch.cuda.max_memory_allocated`` (GB = 1e9 bytes; the largest over ranks), next to the
memory plan (:func:`olmoflow.train.plan.memory_plan`) that sized the default micro-batch.

Usage:  python benchmarks/gpu_mfu.py [--steps 10] [--warmup 3] [--micro-batch N] [--seq 4096]
        [--attention auto|sdpa|flash|both] [--compile both|on|off] [--peak-tflops X] [--tp 2]
        [--json PATH]
        python benchmarks/gpu_mfu.py --smoke      (CPU: a 2-layer model, fp32, 1+2 steps)

``--smoke`` runs a tiny 2-layer shape on CPU in fp32 for a few steps, prints the same table with
MFU against a measured fp32 matmul peak, and what the GPU run would measure (shape, parameters,
FLOPs per token, micro-batch, sequence length, planned memory); ``--smoke --tp 2`` runs the
tensor-parallel path on two CPU processes (gloo). Without ``--smoke`` and without a GPU it exits
2. Exit codes: 0 measured; 1 every configuration failed (OOM); 2 bad arguments / no GPU / too few
GPUs; 3 tensor parallelism unavailable in this olmoflow.

The last line is ``MFU = X%`` of the best configuration, with the target (>= 45% on
H100/H200-class GPUs).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

# benchmarks/ is not a package; ``python benchmarks/gpu_mfu.py`` already has it on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_speed import peak_rss_gb  # noqa: E402

from olmoflow.errors import OlmoflowError  # noqa: E402
from olmoflow.model.config import ModelConfig, get_preset  # noqa: E402
from olmoflow.train.metrics import matmul_peak, train_flops_per_token  # noqa: E402
from olmoflow.train.plan import GB, memory_plan  # noqa: E402

# Vendors' dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, matched as whole words of
# torch.cuda.get_device_name(), first match wins (so the PCIe/NVL parts come before their SXM
# names). Datasheets: H100/H200 (SXM), A100, L40S, L4, B200.
PEAK_TFLOPS: list[tuple[str, float]] = [
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0),
    ("GH200", 989.0), ("H100", 989.0), ("H200", 989.0), ("H800", 989.0),
    ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L4", 121.0),
]
HOPPER_CLASS = r"(?<![A-Za-z0-9])G?H[128]00(?![0-9])"  # H100/H200/H800/GH200: the MFU target's
TARGET_MFU = 45.0  # percent, on H100/H200-class GPUs
SMOKE = ModelConfig(vocab_size=1024, d_model=128, n_layers=2, n_heads=2, mlp_hidden=384,
                    max_sequence_length=128)
PLAN_MARGIN = 0.85  # share of the GPU's memory the default micro-batch may plan to use
MAX_DEFAULT_MICRO_BATCH = 16
SEED = 0


def known_peak(device_name: str) -> tuple[str, float] | None:
    """``(table name, dense bf16 FLOP/s)`` of the first :data:`PEAK_TFLOPS` entry whose name occurs
    as whole words in ``device_name`` (e.g. ``"NVIDIA H100 80GB HBM3"`` -> H100, 989e12), else
    None."""
    for key, tflops in PEAK_TFLOPS:
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_name):
            return key, tflops * 1e12
    return None


def flash_imports() -> bool:
    """Whether ``import flash_attn`` succeeds (a wheel built for another torch fails here)."""
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return True


def tp_unavailable(tp: int) -> str | None:
    """Why ``train.parallel.tensor_parallel=tp`` cannot be configured in this olmoflow, or None.

    The config is built as a run would build it (``ParallelConfig(data_parallel="fsdp",
    tensor_parallel=tp)``), so a field that exists but rejects the value reports its own error."""
    from olmoflow.train.config import ParallelConfig

    try:
        ParallelConfig(data_parallel="fsdp", tensor_parallel=tp)
    except TypeError:
        names = ", ".join(f.name for f in dataclasses.fields(ParallelConfig))
        return (f"olmoflow.train.config.ParallelConfig has no field 'tensor_parallel' (fields: "
                f"{names}); train.parallel.tensor_parallel={tp} is not implemented in this tree")
    except OlmoflowError as e:
        return str(e)
    return None


def tp_applied(model: torch.nn.Module) -> bool:
    """Whether some parameter of ``model`` is a DTensor on a mesh with a ``tp`` dimension (what
    tensor parallelism leaves; plain FSDP shards over ``dp_shard`` only)."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
            return True
    return False


class RandomTokens:
    """Global batches of uniformly random token ids, ``input_ids``/``labels`` ``[B, T]`` (int64,
    labels the next token), made up front so that timing sees no sampling; ``next_batch`` cycles
    through ``n_batches`` of them. Every rank draws the same ones (seeded), as from the real
    loader."""

    def __init__(self, vocab_size: int, batch: int, seq: int, n_batches: int = 2, seed: int = SEED):
        g = torch.Generator().manual_seed(seed)
        self.batches = []
        for _ in range(n_batches):
            ids = torch.randint(0, vocab_size, (batch, seq + 1), generator=g)
            self.batches.append({"input_ids": ids[:, :-1].contiguous(),
                                 "labels": ids[:, 1:].contiguous()})
        self.i, self.epoch = 0, 0

    def next_batch(self) -> dict[str, torch.Tensor]:
        self.i += 1
        return self.batches[(self.i - 1) % len(self.batches)]


def plan_gb(cfg: ModelConfig, micro_batch: int, seq: int, precision: str, world: int = 1,
            data_parallel: str = "fsdp") -> float:
    """The memory plan's total per GPU (GB, no activation checkpointing)."""
    return memory_plan(cfg, world_size=world, data_parallel=data_parallel,
                       micro_batch_size=micro_batch, sequence_length=seq, precision=precision,
                       checkpointing=0).total(False) / GB


def default_micro_batch(cfg: ModelConfig, seq: int, gpu_bytes: float, world: int = 1,
                        data_parallel: str = "fsdp") -> int:
    """The largest micro-batch (instances of ``seq`` tokens) whose bf16 memory plan fits
    :data:`PLAN_MARGIN` of ``gpu_bytes``, between 1 and :data:`MAX_DEFAULT_MICRO_BATCH`."""
    plan = memory_plan(cfg, world_size=world, data_parallel=data_parallel, micro_batch_size=1,
                       sequence_length=seq, precision="bf16", checkpointing=0)
    return max(1, min(MAX_DEFAULT_MICRO_BATCH, plan.max_micro_batch(PLAN_MARGIN * gpu_bytes,
                                                                    False)))


def measure(mcfg: ModelConfig, args, *, compile_: bool, device: torch.device, precision: str,
            dist_info) -> dict:
    """Train ``args.warmup + args.steps`` steps of a fresh ``Olmo(mcfg)`` on ``device`` through
    ``Trainer.train_step``, on global batches of ``args.batch`` x ``args.seq`` random tokens.

    Returns ``{"step_s": [timed steps' seconds], "peak_gb", "loss" (last CE), "fallback" (the
    attention backend's fallback warning, or None)}``, or ``{"error": ...}`` on CUDA OOM (and
    with ``"no_tp": True`` when ``args.tp > 1`` but the Trainer applied no tensor parallelism).

    Raises:
        OlmoflowError: the Trainer rejects the config (e.g. a batch that does not divide).
    """
    from olmoflow.model.olmo import Olmo
    from olmoflow.train.config import (
        CheckpointConfig,
        LogConfig,
        ParallelConfig,
        ScheduleConfig,
        TrainConfig,
    )
    from olmoflow.train.trainer import Trainer

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    parallel = (ParallelConfig(data_parallel="fsdp", tensor_parallel=args.tp) if args.tp > 1
                else ParallelConfig(data_parallel="fsdp"))
    cfg = TrainConfig(sequence_length=args.seq, global_batch_size=args.batch,
                      micro_batch_size=args.micro_batch, max_steps=args.warmup + args.steps,
                      precision=precision, compile=compile_, parallel=parallel,
                      schedule=ScheduleConfig(warmup_steps=1),
                      checkpoint=CheckpointConfig(save_interval=0), log=LogConfig(interval=0))
    data = RandomTokens(mcfg.vocab_size, args.batch, args.seq)
    model = trainer = None
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        torch.manual_seed(SEED)  # the same initial weights on every rank
        with torch.device(device):
            model = Olmo(mcfg)
        with tempfile.TemporaryDirectory() as tmp:  # the trainer writes nothing without fit()
            trainer = Trainer(model, cfg, data, Path(tmp), progress=False)
            if args.tp > 1 and not tp_applied(trainer.model):
                return {"error": "tensor parallelism was not applied: the Trainer left no "
                                 "parameter sharded over a 'tp' mesh dimension", "no_tp": True}
            trainer.model.train()
            times, loss = [], float("nan")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for i in range(args.warmup + args.steps):
                    batch = data.next_batch()
                    sync()
                    t = time.perf_counter()
                    loss = trainer.train_step(batch)["ce_loss"]
                    sync()
                    if i >= args.warmup:
                        times.append(time.perf_counter() - t)
            for w in caught:  # still shown, after the timing
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
            fallback = next((str(w.message) for w in caught
                             if "attention backend" in str(w.message)), None)
        peak = torch.cuda.max_memory_allocated(device) / GB if cuda else peak_rss_gb()
        if dist_info.world_size > 1:
            import torch.distributed as dist

            t = torch.tensor([peak], device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            peak = float(t)
        return {"step_s": times, "peak_gb": peak, "loss": loss, "fallback": fallback}
    except torch.cuda.OutOfMemoryError:
        return {"error": f"OOM at micro-batch {args.micro_batch} (try --micro-batch "
                         f"{max(1, args.micro_batch // 2)})"}
    finally:
        del model, trainer
        gc.collect()
        if compile_:
            torch._dynamo.reset()  # the next configuration compiles its own model
        if cuda:
            torch.cuda.empty_cache()


def mfu_row(name: str, res: dict, tokens_per_step: int, fpt: float, peak: float) -> dict:
    """One table row from :func:`measure`'s result."""
    if "error" in res:
        return {"config": name, "error": res["error"]}
    med = statistics.median(res["step_s"])
    tps = tokens_per_step / med
    return {"config": name, "tokens_per_s": tps, "step_ms": 1e3 * med,
            "mfu_percent": 100 * tps * fpt / peak, "peak_memory_gb": res["peak_gb"],
            "ce_loss": res["loss"]}


def format_table(rows: list[dict]) -> str:
    """The markdown table: config, tokens/s, step ms, MFU %, peak memory GB."""
    w = max(len("config"), *(len(r["config"]) for r in rows))
    lines = [f"| {'config':<{w}} | {'tokens/s':>10} | {'step ms':>9} | {'MFU %':>6} | "
             f"{'peak mem GB':>11} |",
             f"|{'-' * (w + 2)}|{'-' * 12}|{'-' * 11}|{'-' * 8}|{'-' * 13}|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']:<{w}} | {r['error']} |")
        else:
            lines.append(f"| {r['config']:<{w}} | {r['tokens_per_s']:>10.0f} | "
                         f"{r['step_ms']:>9.1f} | {r['mfu_percent']:>6.2f} | "
                         f"{r['peak_memory_gb']:>11.2f} |")
    return "\n".join(lines)


def gpu_preview(preset: str, seq: int) -> str:
    """What the GPU run would measure (printed by ``--smoke``): the preset's shape, parameters,
    FLOPs per token, the default micro-batch and its memory plan on 80 GB and 141 GB GPUs."""
    cfg = get_preset(preset)
    fpt = train_flops_per_token(cfg, seq)
    n_all, n_mm = cfg.num_params(), cfg.num_params() - cfg.vocab_size * cfg.d_model
    lines = ["on a GPU it would measure (python benchmarks/gpu_mfu.py; --tp 2 on two GPUs):",
             f"  model: {preset}: d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads"
             f", MLP {cfg.mlp_hidden}, vocab {cfg.vocab_size}; {n_all:,} parameters "
             f"({n_mm:,} outside the input embedding)",
             f"  train FLOPs/token: {fpt / 1e9:.3f} G at sequence length {seq} (6 N + attention)",
             "  precision: bf16 autocast over fp32 weights; attention: "
             f"{'flash' if flash_imports() else 'flash when flash_attn imports, else sdpa'}; "
             "eager and train.compile"]
    for gpu, gb in (("H100 80 GB", 80.0), ("H200 141 GB", 141.0)):
        mb = default_micro_batch(cfg, seq, gb * GB)
        lines.append(f"  {gpu}: micro-batch {mb} x {seq} tokens = {mb * seq:,} tokens/step; "
                     f"memory plan {plan_gb(cfg, mb, seq, 'bf16'):.1f} GB; at the "
                     f"{TARGET_MFU:g}% target (989 TFLOP/s) "
                     f"{TARGET_MFU / 100 * 989e12 / fpt:,.0f} tokens/s")
    reason = tp_unavailable(2)
    lines.append("  tensor_parallel=2: " + ("available" if reason is None
                                             else f"UNAVAILABLE: {reason}"))
    return "\n".join(lines)


RC_FILE_ENV = "GPU_MFU_RC_FILE"  # where rank 0 leaves its exit status for the launcher


def relaunch_under_torchrun(tp: int) -> None:
    """Run this file with the same arguments under ``torchrun --standalone --nproc_per_node=tp``
    and exit with rank 0's status (torchrun itself says 1 for any failure)."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={tp}", str(Path(__file__).resolve()), *sys.argv[1:]]
    print("launching: python " + " ".join(cmd[1:]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rc_file = Path(tmp) / "rc"
        rc = subprocess.run(cmd, env={**os.environ, RC_FILE_ENV: str(rc_file)}).returncode
        if rc_file.is_file():
            rc = int(rc_file.read_text())
    sys.exit(rc)


def is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def flops(x: float) -> str:
    """``x`` FLOP/s as TFLOP/s, or GFLOP/s below 1 TFLOP/s (CPUs)."""
    return f"{x / 1e12:.1f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.1f} GFLOP/s"


def fail(msg: str, code: int = 2) -> None:
    """One ``gpu_mfu: error:`` line on stderr (rank 0 only), then exit ``code``."""
    if is_rank0():
        print(f"gpu_mfu: error: {msg}", file=sys.stderr)
    sys.exit(code)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true",
                    help="CPU smoke run: a 2-layer model in fp32 for 1+2 steps, and what the GPU "
                         "run would measure")
    ap.add_argument("--preset", default="olmo2_1b", help="model preset (GPU runs)")
    ap.add_argument("--steps", type=int, help="timed steps (default 10; smoke 2)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 3; smoke 1)")
    ap.add_argument("--seq", type=int, help="sequence length, tokens (default 4096; smoke 64)")
    ap.add_argument("--micro-batch", type=int, default=0,
                    help="micro-batch, instances (0: the largest the memory plan fits in "
                         f"{PLAN_MARGIN:.0%} of the GPU, at most {MAX_DEFAULT_MICRO_BATCH}; "
                         "smoke 4)")
    ap.add_argument("--batch", type=int, default=0,
                    help="global batch, instances (0: one micro-batch per data-parallel rank)")
    ap.add_argument("--attention", choices=["auto", "sdpa", "flash", "both"], default="auto",
                    help="auto: flash when flash_attn imports, else sdpa")
    ap.add_argument("--compile", choices=["both", "on", "off"],
                    help="train.compile off, on or both (default both; smoke off)")
    ap.add_argument("--peak-tflops", type=float, help="the peak MFU is measured against")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (2: under torchrun)")
    ap.add_argument("--json", help="also write the results here (JSON)")
    args = ap.parse_args()
    try:
        try:
            run(args)
        except OlmoflowError as e:
            fail((f"(train.parallel.tensor_parallel={args.tp}) " if args.tp > 1 else "") + str(e))
    except SystemExit as e:
        if os.environ.get(RC_FILE_ENV) and is_rank0():
            Path(os.environ[RC_FILE_ENV]).write_text(str(e.code if isinstance(e.code, int)
                                                         else 1))
        raise


def run(args) -> None:
    smoke = args.smoke
    args.steps = args.steps or (2 if smoke else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if smoke else 3)
    args.seq = args.seq or (64 if smoke else 4096)
    compile_modes = {"both": [False, True], "on": [True], "off": [False]}[
        args.compile or ("off" if smoke else "both")]
    if args.steps < 1 or args.warmup < 0 or args.seq < 1 or args.micro_batch < 0 or args.tp < 1:
        fail("--steps, --seq and --tp must be >= 1; --warmup and --micro-batch >= 0")
    get_preset(args.preset)  # a misspelt preset fails now, not after the smoke run
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        fail(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    if not smoke and not torch.cuda.is_available():
        fail(f"no CUDA GPU visible (torch {torch.__version__}); run with --smoke for the CPU "
             "smoke test")
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp > 1:
        # --smoke --tp 2 runs the same path on CPU processes (gloo)
        if not smoke and torch.cuda.device_count() < args.tp and world_env == 1:
            fail(f"--tp {args.tp} needs {args.tp} GPUs, found {torch.cuda.device_count()}")
        reason = tp_unavailable(args.tp)
        if reason is not None:
            if is_rank0():
                print(f"gpu_mfu: tensor parallelism unavailable: {reason}", file=sys.stderr)
            sys.exit(3)
        if world_env == 1:
            relaunch_under_torchrun(args.tp)

    from olmoflow.train import distributed

    info = distributed.init_from_env()
    say = print if info.is_main else (lambda *a, **k: None)
    dp = max(1, info.world_size // args.tp)
    if smoke:
        device, precision, mcfg = torch.device("cpu"), "fp32", SMOKE
        if info.world_size > 1:  # processes on one node share its cores, as in Trainer.fit
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.local_world_size))
        args.micro_batch = args.micro_batch or 4
        if args.seq > mcfg.max_sequence_length:
            mcfg = dataclasses.replace(mcfg, max_sequence_length=args.seq)
        # flash needs CUDA: auto picks sdpa; --attention flash shows the fallback being flagged
        backends = {"auto": ["sdpa"], "sdpa": ["sdpa"], "flash": ["flash"],
                    "both": ["sdpa", "flash"]}[args.attention]
    else:
        device, precision = info.device, "bf16"
        mcfg = get_preset(args.preset)
        if args.seq > mcfg.max_sequence_length:
            fail(f"--seq {args.seq} is longer than {args.preset}'s max_sequence_length "
                 f"{mcfg.max_sequence_length}")
        has_flash = flash_imports()
        if args.attention in ("flash", "both") and not has_flash:
            fail("--attention flash: flash_attn does not import here; use --attention sdpa")
        backends = {"auto": ["flash" if has_flash else "sdpa"], "sdpa": ["sdpa"],
                    "flash": ["flash"], "both": ["sdpa", "flash"]}[args.attention]
        if not args.micro_batch:
            gpu_bytes = torch.cuda.get_device_properties(device).total_memory
            args.micro_batch = default_micro_batch(mcfg, args.seq, gpu_bytes, info.world_size)
    args.batch = args.batch or args.micro_batch * dp
    if args.batch % (args.micro_batch * dp):
        fail(f"--batch {args.batch} is not a multiple of --micro-batch {args.micro_batch} x "
             f"{dp} data-parallel rank(s)")
    fpt, tokens = train_flops_per_token(mcfg, args.seq), args.batch * args.seq

    if smoke:
        device_name = f"CPU ({torch.get_num_threads()} threads)"
        measured = matmul_peak("cpu", torch.float32)
        peak_src = "measured fp32 1024^3 matmul"
        peak = args.peak_tflops * 1e12 if args.peak_tflops else measured
    else:
        device_name = torch.cuda.get_device_name(device)
        measured = matmul_peak(device, torch.bfloat16, n=8192, repeats=10)
        table = known_peak(device_name)
        if args.peak_tflops:
            peak, peak_src = args.peak_tflops * 1e12, "--peak-tflops"
        elif table:
            peak, peak_src = table[1], f"{table[0]} dense bf16 datasheet"
        else:
            peak, peak_src = measured, "measured bf16 8192^3 matmul (GPU not in the table)"
    gpus = info.world_size
    say(f"device: {device_name} x{gpus}; torch {torch.__version__}; peak {flops(peak)} per "
        f"device ({peak_src}; measured matmul {flops(measured)})")
    say(f"model: {args.preset if not smoke else 'smoke (2 layers, d_model 128)'}: "
        f"{mcfg.num_params():,} parameters; train FLOPs/token {fpt / 1e9:.4f} G; "
        f"{precision}; batch {args.batch} x {args.seq} tokens (micro-batch {args.micro_batch}); "
        f"{args.warmup} warmup + {args.steps} timed steps; median step"
        + ("; peak mem = the process's peak RSS" if smoke else ""))
    if not smoke:
        say(f"memory plan (olmoflow.train.plan, no checkpointing): "
            f"{plan_gb(mcfg, args.micro_batch, args.seq, precision, info.world_size):.1f} GB "
            f"per GPU of {torch.cuda.get_device_properties(device).total_memory / GB:.1f}")
    if args.tp > 1:
        say(f"parallel: tensor_parallel={args.tp} x data_parallel(fsdp)={dp} on "
            f"{info.world_size} {'CPU processes' if smoke else 'GPUs'}")
    say("", flush=True)

    rows, fallbacks = [], {}
    for backend in backends:
        for compile_ in compile_modes:
            name = (f"{'smoke' if smoke else args.preset} {precision} {backend} "
                    f"{'compiled' if compile_ else 'eager'}"
                    + (f" tp{args.tp}" if args.tp > 1 else "") + f" ({device.type})")
            res = measure(dataclasses.replace(mcfg, attention_backend=backend), args,
                          compile_=compile_, device=device, precision=precision, dist_info=info)
            if res.get("no_tp"):
                say(f"gpu_mfu: tensor parallelism unavailable: {res['error']}", file=sys.stderr)
                sys.exit(3)
            # attend() warns once per process and reason: later runs of the backend inherit it
            fallbacks[backend] = res.get("fallback") or fallbacks.get(backend)
            if fallbacks[backend]:
                name += " [FELL BACK to sdpa]"
                say(f"  {fallbacks[backend]}")
            rows.append(mfu_row(name, res, tokens, fpt, peak * gpus))
            say(f"  measured: {name}", flush=True)
    good = [r for r in rows if "error" not in r]
    best = max(good, key=lambda r: r["mfu_percent"]) if good else None
    say("\n" + format_table(rows) + "\n")
    if best is None:
        say("MFU = n/a (no configuration ran)")
    elif smoke:
        say(gpu_preview(args.preset, 4096) + "\n")
        say(f"MFU = {best['mfu_percent']:.2f}% ({best['config']}, against a measured CPU matmul "
            f"peak; the >= {TARGET_MFU:g}% target is for {args.preset} bf16 on H100/H200-class "
            "GPUs)")
    else:
        hopper = re.search(HOPPER_CLASS, device_name) is not None
        verdict = ("met" if best["mfu_percent"] >= TARGET_MFU else "NOT met") if hopper else \
            f"not applicable on {device_name}"
        say(f"MFU = {best['mfu_percent']:.2f}% ({best['config']}; target >= {TARGET_MFU:g}% on "
            f"H100/H200-class: {verdict})")
    if args.json and info.is_main:
        from olmoflow.artifacts import atomic_write_text

        atomic_write_text(args.json, json.dumps(
            {"device": device_name, "devices": gpus, "peak_flops": peak, "peak_source": peak_src,
             "measured_matmul_flops": measured, "preset": None if smoke else args.preset,
             "micro_batch": args.micro_batch, "global_batch": args.batch, "seq": args.seq,
             "flops_per_token": fpt, "rows": rows, "torch": torch.__version__}, indent=2) + "\n")
    sys.exit(0 if best is not None else 1)


if __name__ == "__main__":
    main()
