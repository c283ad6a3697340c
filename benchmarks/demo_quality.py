"""Does the demo model learn as well as transformers' OLMo 3, given the same time?

Trains olmoflow's ``Olmo`` (through our ``Trainer``) and ``transformers.Olmo3ForCausalLM`` of the
same shape, from the same initial weights, on the same token stream in the same order, for the same
wall-clock budget, one after the other in this process. Both follow the same learning-rate schedule
as a function of elapsed time (warmup, then cosine), the same AdamW settings and gradient clipping.
Then both are scored on the same held-out tokens with the same bits-per-byte function.

Usage:  python benchmarks/demo_quality.py [--minutes 5] [--config demo] [key=value ...]

The data stages (collect -> tokenize) are reused from the config's run_dir when complete. The last
line is ``ratio (ours/transformers) = X`` for held-out BPB: X <= 1.0 means ours is no worse.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from olmoflow.eval.perplexity import evaluate_tokens
from olmoflow.model.hf import hf_config, to_hf_state_dict
from olmoflow.model.olmo import IGNORE_INDEX
from olmoflow.pipeline.config import load_config
from olmoflow.pipeline.runner import run_pipeline
from olmoflow.pipeline.stages.common import build_model, load_tokenizer, token_split
from olmoflow.train.loader import DataLoader, InstanceDataset, open_token_arrays
from olmoflow.train.schedule import lr_at
from olmoflow.train.trainer import Trainer, build_optimizer

NOMINAL_STEPS = 10_000  # the time budget is mapped onto this many schedule steps


def timed_lr(cfg, started: float, budget_s: float) -> float:
    """The config's schedule evaluated at the elapsed fraction of the time budget."""
    frac = min(1.0, (time.time() - started) / budget_s)
    s = cfg.schedule
    warm = s.warmup_steps / max(cfg.max_steps, 1)  # keep the config's warmup fraction
    return lr_at(int(frac * NOMINAL_STEPS), lr=cfg.optimizer.lr,
                 warmup_steps=int(warm * NOMINAL_STEPS), max_steps=NOMINAL_STEPS,
                 min_lr_ratio=s.min_lr_ratio, schedule=s.type)


def train_ours(model, cfg, loader, budget_s, workdir):
    trainer = Trainer(model, cfg, loader, workdir, progress=False)
    started = time.time()
    trainer.lr = lambda step: timed_lr(cfg, started, budget_s)
    losses = []
    while time.time() - started < budget_s:
        batch = loader.next_batch()
        losses.append(trainer.train_step(batch)["loss"])
    return trainer.step, trainer.tokens_seen, time.time() - started, losses


def train_transformers(model, cfg, loader, budget_s):
    """A plain transformers training loop: model(input_ids, labels) -> loss, backward, AdamW."""
    opt = build_optimizer(model, cfg.optimizer)
    started, steps, tokens, losses = time.time(), 0, 0, []
    while time.time() - started < budget_s:
        batch = loader.next_batch()
        ids, labels = batch.input_ids, batch.labels
        for g in opt.param_groups:
            g["lr"] = timed_lr(cfg, started, budget_s)
        n_targets = int((labels != IGNORE_INDEX).sum())
        total = 0.0
        for mb_ids, mb_labels in zip(ids.split(cfg.micro_batch_size),
                                     labels.split(cfg.micro_batch_size)):
            n_mb = int((mb_labels != IGNORE_INDEX).sum())
            # HF's loss is the mean over this micro-batch; reweight to the global batch's mean.
            loss = (model(input_ids=mb_ids, labels=mb_labels, shift_labels=mb_labels).loss
                    * (n_mb / n_targets))
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps, tokens = steps + 1, tokens + ids.numel()
        losses.append(total)
    return steps, tokens, time.time() - started, losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="training budget per model")
    ap.add_argument("--config", default="demo")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    cfg = load_config(args.config, args.overrides)
    run_pipeline(cfg, stages=["collect", "clean", "train-tokenizer", "tokenize"], progress=False)
    tok = load_tokenizer(cfg)
    train_paths, dtype = token_split(cfg, "train")
    heldout = torch.cat([torch.from_numpy(a.astype("int64")) for a in
                         open_token_arrays(token_split(cfg, "heldout")[0], dtype)]).numpy()
    budget = args.minutes * 60

    def loader():
        data = InstanceDataset(open_token_arrays(train_paths, dtype), cfg.train.sequence_length)
        return DataLoader(data, cfg.train.global_batch_size, seed=cfg.seed)

    ours = build_model(cfg, tok.vocab_size)
    hf = transformers.Olmo3ForCausalLM(transformers.Olmo3Config(**{
        k: v for k, v in hf_config(ours.config).items()
        if k not in ("architectures", "model_type", "torch_dtype")}))
    hf.load_state_dict(to_hf_state_dict(ours.state_dict()))  # same initial weights

    def score(fn):
        return evaluate_tokens(fn, heldout, tok.token_byte_lengths(),
                               sequence_length=cfg.train.sequence_length,
                               batch_size=cfg.evaluate.batch_size,
                               max_tokens=cfg.evaluate.max_tokens)

    rows = []
    print(f"training each model for {args.minutes:g} min on {os.cpu_count()} threads ...",
          flush=True)
    res = train_ours(ours, cfg.train, loader(), budget, os.path.join(cfg.run_dir, "bench_tmp"))
    ours.eval()
    with torch.no_grad():
        rows.append(("olmoflow Olmo", ours.num_params(), *res, score(lambda x: ours(x).logits)))
    hf.train()
    res = train_transformers(hf, cfg.train, loader(), budget)
    hf.eval()
    with torch.no_grad():
        rows.append((f"transformers {transformers.__version__} Olmo3ForCausalLM",
                     sum(p.numel() for p in hf.parameters()), *res,
                     score(lambda x: hf(input_ids=x).logits)))

    head = (f"{'model':<42} {'params':>9} {'steps':>6} {'tokens':>10} {'tok/s':>7} "
            f"{'train loss':>10} {'held-out loss':>13} {'BPB':>7}")
    print("\n" + head + "\n" + "-" * len(head))
    for name, params, steps, tokens, secs, losses, ev in rows:
        last = sum(losses[-10:]) / max(len(losses[-10:]), 1)
        print(f"{name:<42} {params:>9,} {steps:>6} {tokens:>10,} {tokens / secs:>7.0f} "
              f"{last:>10.4f} {ev['loss']:>13.4f} {ev['bpb']:>7.4f}")
    ratio = rows[0][-1]["bpb"] / rows[1][-1]["bpb"]
    print(f"held-out tokens scored: {rows[0][-1]['tokens']:,} ({rows[0][-1]['bytes']:,} bytes)")
    print(f"ratio (ours/transformers) = {ratio:.4f}")


if __name__ == "__main__":
    main()
