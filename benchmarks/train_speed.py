"""How fast does olmoflow's ``Trainer`` train, next to a plain ``transformers`` training loop?

Both sides train the same model shape from the same initial weights (a Hugging Face directory
written once), on the same token batches in the same order (olmoflow's ``DataLoader`` over one
token file, seed 0), with the same global batch, AdamW settings (beta 0.9/0.95, eps 1e-8, weight
decay 0.1 on linear weights only), lr schedule (warmup + cosine, :func:`lr_at`), gradient
clipping (1.0) and number of steps:

- ours: ``Trainer.fit()`` on :class:`~olmoflow.model.olmo.Olmo` (fused CE + z-loss, fused AdamW
  when available; the detailed log off, as in a default run);
- transformers: ``Olmo3ForCausalLM`` (sdpa attention, fp32) in the loop one writes by hand:
  ``model(input_ids, labels).loss.backward()``, clip, ``torch.optim.AdamW`` (its default foreach
  kernel), ``LambdaLR``; no z-loss (transformers has none).

Each side runs in its own subprocess, alternating (ours, theirs, ours, theirs, ...) for
``--rounds`` rounds so drifting load on a shared machine hits both; each keeps its best round.
Tokens/s counts the steps after ``--warmup`` untimed ones (ours: the log's ``elapsed_s``, which
stops before the final checkpoint is saved; theirs: a timer around the same steps). Peak memory is
the child's peak resident set size (``getrusage(RUSAGE_SELF).ru_maxrss``), shown whole and above
the RSS after imports (both children import torch, transformers and olmoflow first). MFU is
tokens/s x training FLOPs per token (:func:`train_flops_per_token`) over a matmul peak measured
in this run, in the parent, with the same thread count. The final CE loss row checks that both
sides did the same work.

Usage:  python benchmarks/train_speed.py [--steps 10] [--warmup 2] [--rounds 2] [--threads N]

The last line is ``ratio (ours/transformers) = X`` in training tokens/s (> 1: ours is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024) / 1e9


def loader(work: Path, args):
    from olmoflow.data.loader import DataLoader, InstanceDataset, open_token_arrays

    data = InstanceDataset(open_token_arrays([work / "tokens.npy"], np.uint16), args.seq)
    return DataLoader(data, args.batch, seed=SEED)


def child_ours(work: Path, args, total: int) -> dict:
    from olmoflow.config import TrainConfig
    from olmoflow.model.olmo import Olmo
    from olmoflow.train.loggers import read_log
    from olmoflow.train.trainer import METRICS, Trainer

    model = Olmo.from_pretrained(work / "hf", dtype=torch.float32)
    cfg = TrainConfig(sequence_length=args.seq, global_batch_size=args.batch,
                      micro_batch_size=args.micro_batch, max_steps=total, lr=LR,
                      warmup_steps=WARMUP_STEPS, save_interval=0, log_interval=1,
                      num_threads=args.threads)
    out = Path(tempfile.mkdtemp(dir=work))
    Trainer(model, cfg, loader(work, args), out, progress=False).fit()
    log = read_log(out / METRICS)
    t0, t1 = log[args.warmup - 1]["elapsed_s"], log[-1]["elapsed_s"]
    return {"seconds": t1 - t0, "ce_loss": log[-1]["ce_loss"]}


def child_transformers(work: Path, args, total: int) -> dict:
    import transformers

    from olmoflow.model.olmo import IGNORE_INDEX
    from olmoflow.train.schedule import lr_at

    model = transformers.AutoModelForCausalLM.from_pretrained(
        work / "hf", dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    decay = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    groups = [{"params": [p for p in model.parameters() if id(p) in decay], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if id(p) not in decay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(
        s, lr=LR, warmup_steps=WARMUP_STEPS, max_steps=total, min_lr_ratio=0.1,
        schedule="cosine") / LR)
    data = loader(work, args)
    start = None
    for step in range(total):
        if step == args.warmup:
            start = time.perf_counter()
        batch = data.next_batch()
        ids, labels = batch.input_ids, batch.labels
        n = int((labels != IGNORE_INDEX).sum())
        ce = 0.0
        for mb_ids, mb_labels in zip(ids.split(args.micro_batch), labels.split(args.micro_batch)):
            n_mb = int((mb_labels != IGNORE_INDEX).sum())
            # labels are already next-token aligned: shift_labels keeps transformers from shifting
            loss = model(input_ids=mb_ids, labels=mb_labels, shift_labels=mb_labels).loss * (n_mb / n)
            loss.backward()
            ce += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return {"seconds": time.perf_counter() - start, "ce_loss": ce}


def child(side: str, work: Path, args) -> None:
    torch.set_num_threads(args.threads)
    import transformers  # noqa: F401  (both sides pay the same imports before the baseline)

    import olmoflow.train.trainer  # noqa: F401

    transformers.logging.set_verbosity_error()
    base = rss_gb()
    total = args.warmup + args.steps
    res = (child_ours if side == "ours" else child_transformers)(work, args, total)
    res.update(tokens=args.steps * args.batch * args.seq, peak_rss_gb=peak_rss_gb(),
               base_rss_gb=base)
    print("RESULT " + json.dumps(res), flush=True)


def run_child(side: str, work: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--child", side, "--work", str(work), "--threads",
           str(args.threads), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--batch", str(args.batch), "--micro-batch", str(args.micro_batch), "--seq", str(args.seq)]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"{side} child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="timed optimizer steps per side and round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--batch", type=int, default=16, help="global batch (instances)")
    ap.add_argument("--micro-batch", type=int, default=16, help="micro-batch (instances)")
    ap.add_argument("--seq", type=int, default=256, help="sequence length (tokens)")
    ap.add_argument("--child", choices=["ours", "transformers"], help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (the first step pays one-time costs)")
    if args.child:
        child(args.child, Path(args.work), args)
        return

    import transformers

    from olmoflow.model.config import ModelConfig
    from olmoflow.model.olmo import Olmo
    from olmoflow.train.metrics import matmul_peak, train_flops_per_token

    torch.set_num_threads(args.threads)
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
              f"{args.seq} (micro-batch {args.micro_batch}); {args.warmup}+{args.steps} steps x "
              f"{args.rounds} rounds; torch {torch.__version__}, transformers "
              f"{transformers.__version__}, {args.threads} threads", flush=True)
        del model
        peak = matmul_peak("cpu", torch.float32, n=2048, repeats=5)
        results: dict[str, list[dict]] = {"ours": [], "transformers": []}
        for r in range(args.rounds):
            for side in ("ours", "transformers"):
                res = run_child(side, work, args)
                results[side].append(res)
                print(f"round {r + 1} {side:<12}: {res['tokens'] / res['seconds']:8.0f} tok/s, "
                      f"peak RSS {res['peak_rss_gb']:.2f} GB, final CE {res['ce_loss']:.4f}",
                      flush=True)

    fpt = train_flops_per_token(cfg, args.seq)

    def most(side: str, key: str) -> float:
        return max(r[key] for r in results[side])

    tok_s = {s: max(r["tokens"] / r["seconds"] for r in results[s]) for s in results}
    rows = [
        ("train tokens/s (best round)", tok_s["ours"], tok_s["transformers"], ".0f"),
        ("MFU (% of matmul peak)", 100 * tok_s["ours"] * fpt / peak,
         100 * tok_s["transformers"] * fpt / peak, ".2f"),
        ("peak RSS (GB, max over rounds)", most("ours", "peak_rss_gb"),
         most("transformers", "peak_rss_gb"), ".3f"),
        ("peak RSS above imports (GB)",
         max(r["peak_rss_gb"] - r["base_rss_gb"] for r in results["ours"]),
         max(r["peak_rss_gb"] - r["base_rss_gb"] for r in results["transformers"]), ".3f"),
        ("final CE loss (last round)", results["ours"][-1]["ce_loss"],
         results["transformers"][-1]["ce_loss"], ".4f"),
    ]
    print(f"\nmatmul peak (fp32 2048^3 torch.mm, {args.threads} threads): {peak / 1e9:.1f} GFLOP/s; "
          f"train FLOPs/token {fpt / 1e6:.2f} M (6N + attention)\n")
    w = max(len(r[0]) for r in rows)
    print(f"| {'metric':<{w}} | {'ours':>10} | {'transformers':>12} | {'ratio':>6} |")
    print(f"|{'-' * (w + 2)}|{'-' * 12}|{'-' * 14}|{'-' * 8}|")
    for name, o, t, fmt in rows:
        print(f"| {name:<{w}} | {o:>10{fmt}} | {t:>12{fmt}} | {o / t:>6.2f} |")
    print(f"\nratio (ours/transformers) = {tok_s['ours'] / tok_s['transformers']:.2f}")


if __name__ == "__main__":
    main()
