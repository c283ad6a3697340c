"""How fast does olmoflow's ``Trainer`` train, next to a plain ``transformers`` training loop?

Both sides train the same model shape from the same initial weights (a Hugging Face directory
written once), on the same token batches in the same order (olmoflow's ``DataLoader`` over one
token file, seed 0), with the same global batch, AdamW settings (beta 0.9/0.95, eps 1e-8, weight
decay 0.1 on linear weights only), lr schedule (warmup + cosine, :func:`lr_at`), gradient
clipping (1.0) and number of steps:

- ours: ``Trainer.train_step`` (what ``Trainer.fit`` runs per step: lr schedule, accumulation
  normalised by the global batch, clipping, fused AdamW) on :class:`~olmoflow.model.olmo.Olmo`
  (the LM head and CE + z-loss run chunk by chunk over the tokens, never materialising the
  logits: :func:`~olmoflow.model.loss.linear_lm_loss`; the detailed log off, as in a default
  run);
- transformers: ``Olmo3ForCausalLM`` (sdpa attention, fp32) in the loop one writes by hand:
  ``model(input_ids, labels).loss.backward()``, clip, ``torch.optim.AdamW`` (its default foreach
  kernel), ``LambdaLR``; no z-loss (transformers has none).

Each side runs in its own subprocess, and the parent drives them in lockstep over pipes: one
step of one side, then one of the other (who goes first alternates), so a shared machine's
drifting load hits both alike. A step is timed in its process from fetching the batch to the end
of the optimizer step; the ``--warmup`` first steps are not timed. Tokens/s is one global batch
over the median step (the headline), and over the fastest step; tokens per CPU-second (process
time, all threads) is less sensitive to other processes. Peak memory is the child's peak
resident set size (``getrusage(RUSAGE_SELF).ru_maxrss``), shown whole and above the RSS after
imports (both children import torch, transformers and olmoflow first). MFU is tokens/s x training
FLOPs per token (:func:`train_flops_per_token`) over a matmul peak measured in the parent before,
during and after the steps (the best), with the same thread count. The final CE loss row checks
that both sides did the same work.

Usage:  python benchmarks/train_speed.py [--steps 20] [--warmup 2] [--threads N] [--compile]

``--compile`` runs ours with ``train.compile`` (each block through ``torch.compile``; its compile
time falls in the untimed warmup steps) against the same plain eager transformers loop.

The last line is ``ratio (ours/transformers) = X`` in median-step training tokens/s (> 1: ours is
faster).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

DEMO = dict(vocab_size=8192, d_model=256, n_layers=4, n_heads=4, mlp_hidden=768,
            sliding_window=128, max_sequence_length=4096)
LR, WARMUP_STEPS, SEED = 3e-3, 2, 0


def rss_gb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 1e9


def peak_rss_gb() -> float:
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit / 1e9


def loader(work: Path, args):
    from olmoflow.train.loader import DataLoader, InstanceDataset, open_token_arrays

    data = InstanceDataset(open_token_arrays([work / "tokens.npy"], np.uint16), args.seq)
    return DataLoader(data, args.batch, seed=SEED)


def ours_stepper(work: Path, args, total: int):
    """Our ``Trainer`` (its ``train_step``: lr schedule, accumulation, clipping, fused AdamW) fed
    by our ``DataLoader``, one global batch per call."""
    from olmoflow.model.olmo import Olmo
    from olmoflow.train.config import (
        CheckpointConfig,
        LogConfig,
        OptimizerConfig,
        ScheduleConfig,
        TrainConfig,
    )
    from olmoflow.train.trainer import Trainer

    model = Olmo.from_pretrained(work / "hf", dtype=torch.float32)
    cfg = TrainConfig(sequence_length=args.seq, global_batch_size=args.batch,
                      micro_batch_size=args.micro_batch, max_steps=total,
                      num_threads=args.threads, compile=args.compile,
                      optimizer=OptimizerConfig(lr=LR),
                      schedule=ScheduleConfig(warmup_steps=WARMUP_STEPS),
                      checkpoint=CheckpointConfig(save_interval=0), log=LogConfig(interval=1))
    data = loader(work, args)
    trainer = Trainer(model, cfg, data, Path(tempfile.mkdtemp(dir=work)), progress=False)
    model.train()

    def step() -> float:
        batch = data.next_batch()
        return trainer.train_step(batch)["ce_loss"]

    return step


def transformers_stepper(work: Path, args, total: int):
    """The plain loop: ``Olmo3ForCausalLM(input_ids, labels).loss.backward()``, clip, AdamW,
    LambdaLR, fed by the same ``DataLoader``."""
    import transformers

    from olmoflow.model.olmo import IGNORE_INDEX
    from olmoflow.train.schedule import lr_at

    model = transformers.AutoModelForCausalLM.from_pretrained(
        work / "hf", dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    decay = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    groups = [{"params": [p for p in model.parameters() if id(p) in decay], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if id(p) not in decay],
               "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(
        s, lr=LR, warmup_steps=WARMUP_STEPS, max_steps=total, min_lr_ratio=0.1,
        schedule="cosine") / LR)
    data = loader(work, args)

    def step() -> float:
        batch = data.next_batch()
        ids, labels = batch.input_ids, batch.labels
        n = int((labels != IGNORE_INDEX).sum())
        ce = 0.0
        for mb_ids, mb_labels in zip(ids.split(args.micro_batch), labels.split(args.micro_batch)):
            n_mb = int((mb_labels != IGNORE_INDEX).sum())
            # labels are already next-token aligned: shift_labels keeps transformers from shifting
            out = model(input_ids=mb_ids, labels=mb_labels, shift_labels=mb_labels)
            loss = out.loss * (n_mb / n)
            loss.backward()
            ce += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return ce

    return step


def child(side: str, work: Path, args) -> None:
    """Build one side, then run one training step per ``step`` line on stdin, answering with its
    wall and CPU seconds; ``done`` answers with the peak RSS and exits."""
    torch.set_num_threads(args.threads)
    import transformers  # (both sides pay the same imports before the RSS baseline)

    import olmoflow.train.trainer  # noqa: F401

    transformers.logging.set_verbosity_error()
    base = rss_gb()
    step = (ours_stepper if side == "ours" else transformers_stepper)(
        work, args, args.warmup + args.steps)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() == "done":
            print(json.dumps({"peak_rss_gb": peak_rss_gb(), "base_rss_gb": base}), flush=True)
            return
        t, c = time.perf_counter(), time.process_time()
        ce = step()
        print(json.dumps({"wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - c,
                          "ce_loss": ce}), flush=True)


class Child:
    """One side in its own process, driven step by step over a pipe."""

    def __init__(self, side: str, work: Path, args):
        cmd = [sys.executable, __file__, "--child", side, "--work", str(work), "--threads",
               str(args.threads), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--batch", str(args.batch), "--micro-batch", str(args.micro_batch),
               "--seq", str(args.seq)] + (["--compile"] if args.compile else [])
        self.side = side
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        self.ask(None)

    def ask(self, command: str | None) -> dict:
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            sys.exit(f"{self.side} child failed ({self.proc.wait()}):\n{self.proc.stderr.read()}")
        return json.loads(line)

    def close(self) -> dict:
        out = self.ask("done")
        self.proc.wait()
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed optimizer steps per side")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--batch", type=int, default=16, help="global batch (instances)")
    ap.add_argument("--micro-batch", type=int, default=16, help="micro-batch (instances)")
    ap.add_argument("--seq", type=int, default=256, help="sequence length (tokens)")
    ap.add_argument("--compile", action="store_true",
                    help="ours with train.compile (torch.compile per block; the warmup steps pay "
                         "the compile); transformers stays the plain eager loop")
    ap.add_argument("--child", choices=["ours", "transformers"], help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be >= 1 (the first step pays one-time costs)")
    if args.child:
        child(args.child, Path(args.work), args)
        return

    import transformers

    from olmoflow.model.config import ModelConfig
    from olmoflow.model.olmo import Olmo
    from olmoflow.train.metrics import matmul_peak, train_flops_per_token

    torch.set_num_threads(args.threads)
    steps: dict[str, list[dict]] = {"ours": [], "transformers": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        torch.manual_seed(SEED)
        model = Olmo(ModelConfig(**DEMO))
        model.save_pretrained(work / "hf")
        cfg = model.config
        n_tokens = (args.warmup + args.steps) * args.batch * (args.seq + 1) + 1
        rng = np.random.default_rng(SEED)
        rng.integers(0, cfg.vocab_size, n_tokens, dtype=np.uint16).tofile(work / "tokens.npy")
        print(f"model: {model.num_params():,} parameters (d_model {cfg.d_model}, {cfg.n_layers} "
              f"layers, {cfg.n_heads} heads, window {cfg.sliding_window}); batch {args.batch}x"
              f"{args.seq} (micro-batch {args.micro_batch}); {args.warmup}+{args.steps} steps per "
              f"side; ours {'compiled per block' if args.compile else 'eager'}; "
              f"torch {torch.__version__}, transformers {transformers.__version__}, "
              f"{args.threads} threads", flush=True)
        del model
        peaks = [matmul_peak("cpu", torch.float32, n=2048, repeats=5)]
        children = {side: Child(side, work, args) for side in steps}
        for i in range(args.warmup + args.steps):
            order = ("ours", "transformers") if i % 2 == 0 else ("transformers", "ours")
            for side in order:  # step by step, alternating who goes first
                res = children[side].ask("step")
                if i >= args.warmup:
                    steps[side].append(res)
            if i == args.warmup + args.steps // 2:
                peaks.append(matmul_peak("cpu", torch.float32, n=2048, repeats=5))
        memory = {side: c.close() for side, c in children.items()}
        peaks.append(matmul_peak("cpu", torch.float32, n=2048, repeats=5))

    peak, fpt, tokens = max(peaks), train_flops_per_token(cfg, args.seq), args.batch * args.seq
    best = {s: tokens / min(r["wall_s"] for r in steps[s]) for s in steps}
    med = {s: tokens / statistics.median(r["wall_s"] for r in steps[s]) for s in steps}
    cpu = {s: tokens / statistics.median(r["cpu_s"] for r in steps[s]) for s in steps}
    rows = [
        ("train tokens/s (median step)", med["ours"], med["transformers"], ".0f"),
        ("train tokens/s (fastest step)", best["ours"], best["transformers"], ".0f"),
        ("tokens per CPU-second (median)", cpu["ours"], cpu["transformers"], ".0f"),
        ("MFU (% of matmul peak, median step)", 100 * med["ours"] * fpt / peak,
         100 * med["transformers"] * fpt / peak, ".2f"),
        ("peak RSS (GB)", memory["ours"]["peak_rss_gb"], memory["transformers"]["peak_rss_gb"],
         ".3f"),
        ("peak RSS above imports (GB)",
         memory["ours"]["peak_rss_gb"] - memory["ours"]["base_rss_gb"],
         memory["transformers"]["peak_rss_gb"] - memory["transformers"]["base_rss_gb"], ".3f"),
        ("final CE loss", steps["ours"][-1]["ce_loss"], steps["transformers"][-1]["ce_loss"],
         ".4f"),
    ]
    print(f"\nmatmul peak (fp32 2048^3 torch.mm, {args.threads} threads, best of 3 x 5): "
          f"{peak / 1e9:.1f} GFLOP/s; train FLOPs/token {fpt / 1e6:.2f} M (6N + attention); "
          f"machine load average {os.getloadavg()[0]:.1f}\n")
    w = max(len(r[0]) for r in rows)
    print(f"| {'metric':<{w}} | {'ours':>10} | {'transformers':>12} | {'ratio':>6} |")
    print(f"|{'-' * (w + 2)}|{'-' * 12}|{'-' * 14}|{'-' * 8}|")
    for name, o, t, fmt in rows:
        print(f"| {name:<{w}} | {o:>10{fmt}} | {t:>12{fmt}} | {o / t:>6.2f} |")
    print(f"\nratio (ours/transformers) = {med['ours'] / med['transformers']:.2f}")


if __name__ == "__main__":
    main()
