"""Does our GRPO really learn? Held-out reward of a small Olmo before and during GRPO.

A small Olmo (d_model 128, 2 layers) on a byte-level tokenizer (BPE with no merges: one token per
character) learns generated arithmetic (``a + b`` / ``a - b``, operands 0..``--max-operand``):

1. a brief warm start, stopped early on purpose so the model is mediocre:
   - default: SFT with the ``plain`` chat template on ``a+b=`` -> ``c`` (loss on the answer and
     its EOS only);
   - ``--from-base`` (RL-Zero): LM pretraining on raw ``a+b=c`` documents (no template), then RL
     on bare ``a+b=`` prompts;
2. GRPO with olmoflow's Trainer + RolloutLoader + GRPOObjective (the same code path for both
   starts): ``--prompts`` prompts x ``--group`` samples per step at temperature 1, OLMo 3's clip
   0.2 / 0.272, token-level loss, no KL.

Every ``--eval-every`` steps: greedy pass@1 on ``--n-eval`` held-out problems (a split disjoint
from the training problems by construction). Prints a table (step, train reward, held-out
reward), writes ``grpo_curve.json`` and ``grpo_curve.png`` to ``--out`` (default
``$TMPDIR/grpo_curve``); the last line is the held-out gain in points (target >= +15).

Usage:  python benchmarks/grpo_curve.py [--from-base] [--steps 400] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from olmoflow.artifacts import atomic_write_json
from olmoflow.config import from_dict
from olmoflow.infer.sampling import SamplingParams
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import IGNORE_INDEX, Olmo
from olmoflow.tokenizer.chat import add_chat_template, render
from olmoflow.posttrain.grpo import GRPOObjective
from olmoflow.posttrain.rewards import arithmetic_prompts
from olmoflow.posttrain.rollout import HeldOutReward, RolloutLoader, heldout_pass_at_1
from olmoflow.tokenizer import BPETokenizer
from olmoflow.train.config import TrainConfig
from olmoflow.train.trainer import Trainer


def build_tokenizer(template: str | None) -> BPETokenizer:
    # vocab 258 = 256 byte symbols + EOS + pad: no merge fits, so every character is one token.
    tok = BPETokenizer().train_from_texts(["0123456789 +-=?What is"], vocab_size=258)
    if template:
        add_chat_template(tok, template)
    return tok


def build_model(vocab_size: int, seed: int) -> Olmo:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab_size, d_model=128, n_layers=2, n_heads=4, mlp_hidden=512,
                      max_sequence_length=64, sliding_window=None)
    return Olmo(cfg)


def warm_start_examples(tok, prompts, template):
    """``(ids, labels)`` per prompt: the prompt and its gold answer, loss on the answer and EOS
    (SFT), or on every token (base LM: the document is the prompt text and the answer)."""
    out = []
    for p in prompts:
        if template:
            messages = [{"role": "user", "content": p.text},
                        {"role": "assistant", "content": p.answer}]
            ids, mask = render(messages, template, tok)
        else:
            ids = tok.encode(p.text + p.answer, add_eos=True)
            mask = [1] * len(ids)
        labels = [t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:])] + [IGNORE_INDEX]
        out.append((ids, labels))
    return out


def warm_start(model, examples, steps, batch, lr, seed):
    """Plain AdamW on padded batches (the warm start only sets up a mediocre policy)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    for _ in range(steps):
        idx = torch.randint(len(examples), (batch,), generator=g).tolist()
        width = max(len(examples[i][0]) for i in idx)
        ids = torch.zeros(batch, width, dtype=torch.long)
        labels = torch.full((batch, width), IGNORE_INDEX, dtype=torch.long)
        for r, i in enumerate(idx):
            a, b = examples[i]
            ids[r, :len(a)] = torch.tensor(a)
            labels[r, :len(b)] = torch.tensor(b)
        loss = model(ids, labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def heldout_reward(model, tok, prompts, template, max_new_tokens) -> float:
    """Greedy pass@1 on ``prompts`` (one sample each, temperature 0)."""
    return heldout_pass_at_1(model, tok, prompts, max_new_tokens=max_new_tokens,
                             template=template)


class HeldOut(HeldOutReward):
    """Held-out greedy pass@1 every ``interval`` steps, also kept in ``log`` for the plot."""

    def __init__(self, interval, tok, prompts, template, max_new_tokens, log):
        super().__init__(interval, tok, prompts, max_new_tokens=max_new_tokens, template=template)
        self.log = log

    def on_step(self, trainer, step):
        m = super().on_step(trainer, step)
        self.log[step] = m["heldout_pass@1"]
        return {"heldout": m["heldout_pass@1"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from-base", action="store_true",
                    help="RL-Zero: warm start by LM pretraining on raw text, no chat template")
    ap.add_argument("--steps", type=int, default=400, help="GRPO steps")
    ap.add_argument("--warm-steps", type=int, default=None, help="warm-start steps")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per GRPO step")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--lr", type=float, default=3e-4, help="GRPO peak learning rate")
    ap.add_argument("--max-operand", type=int, default=49)
    ap.add_argument("--n-train", type=int, default=3000, help="training problems")
    ap.add_argument("--n-eval", type=int, default=500, help="held-out problems")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "grpo_curve")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    base = args.from_base
    template = None if base else "plain"
    form = "bare"  # "17+25=": few tokens per problem, so the CPU warm start is quick
    warm_steps = args.warm_steps if args.warm_steps is not None else (1000 if base else 300)
    tok = build_tokenizer(template)
    model = build_model(tok.vocab_size, args.seed)
    train = arithmetic_prompts(args.n_train, seed=args.seed, form=form,
                               max_operand=args.max_operand)
    heldout = arithmetic_prompts(args.n_eval, seed=args.seed + 1, split="heldout", form=form,
                                 max_operand=args.max_operand)
    n_new = len(str(2 * args.max_operand)) + 1  # the answer and its EOS

    t0 = time.time()
    warm_loss = warm_start(model, warm_start_examples(tok, train, template), warm_steps, 64,
                           3e-3, args.seed)
    warm_s = time.time() - t0
    start = heldout_reward(model, tok, heldout, template, n_new)
    print(f"warm start ({'LM on raw text' if base else 'SFT, plain template'}): {warm_steps} "
          f"steps, loss {warm_loss:.3f}, {warm_s:.0f}s; held-out pass@1 {start:.3f}", flush=True)

    loader = RolloutLoader(model, tok, train, prompts_per_step=args.prompts,
                           group_size=args.group, template=template, seed=args.seed,
                           sampling=SamplingParams(max_new_tokens=n_new, temperature=1.0))
    n = args.prompts * args.group
    cfg = from_dict(TrainConfig, {
        "sequence_length": 32, "global_batch_size": n, "micro_batch_size": n,
        "max_steps": args.steps, "num_threads": args.threads, "max_grad_norm": 1.0,
        "optimizer": {"lr": args.lr, "weight_decay": 0.0},
        "schedule": {"type": "constant", "warmup_steps": 0},
        "checkpoint": {"save_interval": 0}, "log": {"interval": 1}}, "train.")
    curve: dict[int, float] = {0: start}
    with tempfile.TemporaryDirectory() as d:
        trainer = Trainer(model, cfg, loader, Path(d), progress=False,
                          objective=GRPOObjective(),
                          callbacks=[HeldOut(args.eval_every, tok, heldout, template, n_new,
                                             curve)])
        t1 = time.time()
        trainer.fit()
        rl_s = time.time() - t1
        rows = [json.loads(ln) for ln in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    train_reward = {r["step"]: r["rollout/reward"] for r in rows}

    print(f"\nGRPO: {args.steps} steps x {args.prompts} prompts x {args.group} samples, "
          f"{rl_s:.0f}s ({rl_s / max(1, args.steps):.2f} s/step)")
    print(f"{'step':>6} {'train reward':>13} {'held-out':>9}")
    for step in sorted(curve):
        tr = train_reward.get(step)
        print(f"{step:>6} {'-' if tr is None else f'{tr:.3f}':>13} {curve[step]:>9.3f}")
    final = curve[max(curve)]
    best = max(curve.values())
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"from_base": base, "args": {k: str(v) for k, v in vars(args).items()},
              "warm_start": {"steps": warm_steps, "loss": warm_loss, "seconds": warm_s},
              "grpo_seconds": rl_s, "heldout": {str(k): v for k, v in sorted(curve.items())},
              "train_reward": {str(k): v for k, v in sorted(train_reward.items())},
              "heldout_start": start, "heldout_final": final, "heldout_best": best}
    atomic_write_json(args.out / "grpo_curve.json", result)
    _plot(args.out / "grpo_curve.png", curve, train_reward, base)
    print(f"wrote {args.out}/grpo_curve.json and grpo_curve.png")
    print(f"held-out pass@1: {start:.3f} -> {final:.3f}  gain = {100 * (final - start):+.1f} "
          "points")


def _plot(path: Path, curve, train_reward, base) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    steps = sorted(train_reward)
    ax.plot(steps, [train_reward[s] for s in steps], alpha=0.4, label="train reward (sampled)")
    ks = sorted(curve)
    ax.plot(ks, [curve[k] for k in ks], marker="o", label="held-out pass@1 (greedy)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1)
    ax.set_title(f"GRPO on arithmetic ({'RL-Zero from base LM' if base else 'after brief SFT'})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
