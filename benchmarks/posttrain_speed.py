"""How fast does olmoflow post-train (SFT, DPO, GRPO) next to TRL on the same work?

One small OLMo model (d_model 256, 4 layers, a byte-level BPE vocabulary trained on the fly from
the data, the ``tulu`` chat template), written once as a Hugging Face directory: ours loads it
with ``Olmo.from_pretrained``, TRL with ``transformers.AutoModelForCausalLM`` (``Olmo3ForCausalLM``,
sdpa attention). fp32 on the CPU, the same AdamW (beta 0.9/0.95, eps 1e-8, no weight decay,
constant lr), gradient clipping 1.0, global batch, sequence length and number of steps:

1. **SFT**: our ``Trainer`` + ``SFTObjective`` on ``SFTLoader`` rows (``build_sft_data``: the
   alpaca demo conversations, loss on assistant tokens only) against TRL ``SFTTrainer`` on the
   very same rows in the same order (our reader's ids and loss masks as ``labels``, sequential
   sampling), so both sides train the same batches. Packing on by default on both: ours packs
   rows of ``--seq + 1`` tokens by best-fit decreasing with per-example attention (``doc_ids``);
   TRL gets those rows padding-free (``padding_free=True``, what its ``bfd`` packing feeds the
   model: one flattened sequence per batch, position ids restarting per example, so sdpa masks
   attention per example). ``--no-packing``: one example per row on both (TRL pads each batch to
   its longest row, ours to ``--seq + 1``). Our loss adds OLMo's z-loss (1e-5 logsumexp^2, about
   7e-4 here), so ours reads that much higher at step 1; TRL also computes its per-step token
   accuracy and entropy metrics, as it does by default.
2. **DPO** (sigmoid, beta 0.1): ours (a ``PreferenceDataset`` of the pairs
   ``preference_examples`` reads from HH-RLHF helpful-base, ``ReferenceCache``,
   ``PreferenceLoader``, ``DPOObjective``) against TRL ``DPOTrainer`` with
   ``precompute_ref_log_probs=True`` on the same tokenized pairs in the same order (its own
   tokenization is skipped, sequential sampling over our loader's order), so both train the same
   batches. Pairs whose response masks are not all ones are left out, since TRL trains every
   response token. Both compute the reference log-probabilities once before training: that pass
   is timed apart (the ``reference pass`` row) and excluded from the steps.
3. **GRPO**: one iteration = rollouts of ``P`` arithmetic prompts x ``G`` samples
   (``--max-new-tokens``, temperature 1, our :class:`~olmoflow.posttrain.rewards.Verifier` as the
   reward on both sides) + one update (token-level loss, clip 0.2/0.272, no KL). Ours:
   ``RolloutLoader`` (KV-cache decoding, equal-reward groups kept so both sides train every
   group) + ``GRPOObjective``; TRL: ``GRPOTrainer`` with ``use_vllm=False`` (``transformers``
   ``generate``), ``loss_type="dapo"``, ``beta=0``. The same prompts, each side in its own
   shuffled order. The ``rollout`` row is the part of an iteration spent sampling, scoring and
   (ours) computing the old log-probabilities.

Each side runs in its own subprocess (the parent builds the model and tokenizer first), driven in
lockstep over pipes: one step of one side, then one of the other (who goes first alternates), so a
shared machine's drifting load hits both alike. A step is timed inside its training loop (our
``Trainer.fit`` through a callback, TRL's ``Trainer.train`` through a ``TrainerCallback``) from
the end of the previous step to the end of this one: fetching or generating the batch, forward,
backward, optimizer step and the loop's own logging. The ``--warmup`` first steps are not timed.

Usage:  python benchmarks/posttrain_speed.py [--steps 8] [--warmup 2] [--quick] [--threads 1]

The last lines are the ratios, ``ratio (ours/TRL) = X`` per task, in median-step speed (> 1:
ours is faster); targets: >= 1.5x for SFT and DPO, >= 2x for GRPO.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# OLMOFLOW_SHARED_DATA=/nowhere runs on generated data, as on a machine without the copies
SHARED = Path(os.environ.get("OLMOFLOW_SHARED_DATA", ROOT.parent / "shared" / "data"))
ALPACA = SHARED / "instruct" / "llamafactory_alpaca_en_demo.json"
HH = SHARED / "hh-rlhf" / "helpful-base-test.jsonl.gz"
MODEL = dict(d_model=256, n_layers=4, n_heads=4, mlp_hidden=768, sliding_window=128,
             max_sequence_length=4096)
TEMPLATE, LR, SEED, VOCAB = "tulu", 1e-4, 0, 4096
TASKS = ("sft", "dpo", "grpo")
TARGETS = {"sft": 1.5, "dpo": 1.5, "grpo": 2.0}


# ---------------------------------------------------------------------------------------------
# Data, the same for both sides (files when present, generated otherwise)


def sft_source(work: Path) -> Path:
    if ALPACA.is_file():
        return ALPACA
    rows = [{"messages": [{"role": "user", "content": f"Add {a} and {b}, then explain."},
                          {"role": "assistant", "content": f"{a} plus {b} is {a + b}. " * 8}]}
            for a in range(40) for b in range(0, 40, 3)]
    path = work / "sft.jsonl"
    if not path.is_file():  # written once, by the parent, before the children read it
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dpo_source(work: Path) -> Path:
    if HH.is_file():
        return HH
    rows = [{"prompt": f"What is {a} + {b}?", "chosen": f"It is {a + b}. " * 6,
             "rejected": f"Perhaps {a + b + 1}, or not. " * 5}
            for a in range(30) for b in range(0, 30, 2)]
    path = work / "pairs.jsonl"
    if not path.is_file():
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def corpus(work: Path) -> list[str]:
    """Texts to train the tokenizer on: the SFT and DPO sources."""
    texts: list[str] = []
    src = sft_source(work)
    if src.suffix == ".json":
        texts += [" ".join(str(v) for v in r.values()) for r in json.loads(src.read_text())]
    else:
        texts += src.read_text().splitlines()
    src = dpo_source(work)
    opener = gzip.open if src.suffix == ".gz" else open
    with opener(src, "rt", encoding="utf-8") as f:
        texts += [line for _, line in zip(range(2000), f)]
    return texts


def sft_examples_for(work: Path, tok, args):
    from olmoflow.posttrain.data import sft_examples

    return list(sft_examples([sft_source(work)], TEMPLATE, tok, args.seq + 1))


def dpo_pairs(work: Path, tok, args):
    """The first pairs whose response masks are all ones (what TRL trains), enough for the run."""
    from olmoflow.posttrain.data import preference_examples

    need = args.dpo_batch * (args.warmup + args.steps)
    out = []
    for ex in preference_examples([dpo_source(work)], TEMPLATE, tok, args.seq):
        if all(ex.chosen_mask) and all(ex.rejected_mask):
            out.append(ex)
        if len(out) == need:
            break
    return out


def rl_prompts(args):
    from olmoflow.posttrain.rewards import arithmetic_prompts

    return arithmetic_prompts(args.prompts * (args.warmup + args.steps), seed=SEED)


# ---------------------------------------------------------------------------------------------
# The lockstep protocol (child side)


class Pipe:
    """Commands in on stdin, one JSON answer per command out on a private copy of stdout (the
    libraries' prints go to stderr, so they never mix with the answers)."""

    def __init__(self):
        self.out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def read(self) -> str:
        line = sys.stdin.readline()
        if not line:
            sys.exit(0)  # the parent went away
        return line.strip()

    def expect(self, command: str) -> None:
        got = self.read()
        if got != command:
            raise RuntimeError(f"expected {command!r} from the parent, got {got!r}")

    def send(self, obj: dict) -> None:
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()


class Clock:
    """Times one step of a loop it does not own: ``begin`` after the parent's ``step`` command,
    ``lap`` at the end of the step (answers the parent and waits for the next command unless
    this was the last step)."""

    def __init__(self, pipe: Pipe, total: int):
        self.pipe, self.total, self.steps = pipe, total, 0
        self.t = self.c = 0.0

    def begin(self) -> None:
        self.pipe.expect("step")
        self.t, self.c = time.perf_counter(), time.process_time()

    def lap(self, **extra) -> None:
        wall, cpu = time.perf_counter() - self.t, time.process_time() - self.c
        self.steps += 1
        self.pipe.send({"wall_s": wall, "cpu_s": cpu, **extra})
        if self.steps < self.total:
            self.begin()


def optimizer_config():
    from olmoflow.train.config import OptimizerConfig, ScheduleConfig

    return (OptimizerConfig(lr=LR, weight_decay=0.0, betas=[0.9, 0.95], eps=1e-8),
            ScheduleConfig(type="constant", warmup_steps=0))


def ours_task(task: str, work: Path, args, pipe: Pipe) -> dict:
    """Build our side of ``task``, report ready, train in lockstep; returns its summary."""
    from olmoflow.model.olmo import IGNORE_INDEX, Olmo
    from olmoflow.tokenizer import BPETokenizer
    from olmoflow.train.callbacks import Callback
    from olmoflow.train.config import CheckpointConfig, LogConfig, TrainConfig
    from olmoflow.train.trainer import Trainer

    total = args.warmup + args.steps
    model = Olmo.from_pretrained(work / "hf", dtype=torch.float32)
    tok = BPETokenizer.load(work / "hf")
    info: dict = {}
    if task == "sft":
        from olmoflow.posttrain.sft import SFTLoader, SFTObjective, build_sft_data

        # the examples sft_examples_for gives TRL, packed into rows of seq + 1 tokens
        data, _ = build_sft_data([sft_source(work)], None, TEMPLATE, tok, args.seq,
                                 packing=args.packing, seed=SEED)
        loader, objective = SFTLoader(data, args.batch, seed=SEED), SFTObjective()
        batch = args.batch
        info["data"] = data.summary()

        def count(b):
            info["doc_ids"] = b.doc_ids is not None
            return int((b.labels != IGNORE_INDEX).sum())
    elif task == "dpo":
        from olmoflow.posttrain.dpo import (
            DPOObjective,
            PreferenceDataset,
            PreferenceLoader,
            ReferenceCache,
        )

        data = PreferenceDataset(dpo_pairs(work, tok, args), args.seq, tok.pad_token_id)
        t = time.perf_counter()
        ReferenceCache(work / "ours-ref", "bench").get(data, model, batch_size=args.dpo_batch)
        info["ref_s"] = time.perf_counter() - t
        loader, objective = PreferenceLoader(data, args.dpo_batch, seed=SEED), DPOObjective()
        batch = args.dpo_batch
        info["data"] = f"{len(data)} pairs, {data.num_tokens} tokens"

        def count(b):
            return int(b["lengths"].sum())
    else:
        from olmoflow.infer.sampling import SamplingParams
        from olmoflow.posttrain.grpo import GRPOObjective
        from olmoflow.posttrain.rollout import RolloutLoader

        batch = args.prompts * args.group
        loader = RolloutLoader(model, tok, rl_prompts(args), prompts_per_step=args.prompts,
                               group_size=args.group, seed=SEED, filter_equal=False, max_draws=1,
                               sampling=SamplingParams(max_new_tokens=args.max_new_tokens,
                                                       temperature=1.0))
        objective = GRPOObjective(loss_type="token")

        def count(b):
            return int(b.fields["response_mask"].sum())

    opt, schedule = optimizer_config()
    cfg = TrainConfig(sequence_length=args.seq, global_batch_size=batch, micro_batch_size=batch,
                      max_steps=total, num_threads=args.threads, precision="fp32",
                      optimizer=opt, schedule=schedule,
                      checkpoint=CheckpointConfig(save_interval=0), log=LogConfig(interval=1))
    counted: list[int] = []
    fetch: list[float] = []

    class Counting:
        """The loader, counting each batch's tokens and timing its fetch (for GRPO: the
        rollouts); the Trainer uses only these four names."""

        def next_batch(self):
            t = time.perf_counter()
            b = loader.next_batch()
            fetch.append(time.perf_counter() - t)
            counted.append(count(b))
            return b

        def state_dict(self):
            return loader.state_dict()

        def load_state_dict(self, state):
            loader.load_state_dict(state)

        @property
        def epoch(self):
            return loader.epoch

    clock = Clock(pipe, total)

    class Lockstep(Callback):
        def on_step(self, trainer, step):
            clock.lap(loss=trainer.last_loss, tokens=counted[-1], rollout_s=fetch[-1])

    trainer = Trainer(model, cfg, Counting(), work / f"ours-{task}", progress=False,
                      objective=objective, callbacks=[Lockstep(1)])
    pipe.send({"ready": True, **info})
    clock.begin()
    trainer.fit()
    return info


def trl_task(task: str, work: Path, args, pipe: Pipe) -> dict:
    """Build TRL's side of ``task``, report ready, train in lockstep; returns its summary."""
    import datasets
    import transformers
    import trl

    datasets.disable_progress_bars()
    total = args.warmup + args.steps
    hf = work / "hf"
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32,
                                                              attn_implementation="sdpa")
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    common = dict(max_steps=total, learning_rate=LR, lr_scheduler_type="constant",
                  warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
                  adam_epsilon=1e-8, max_grad_norm=1.0, gradient_accumulation_steps=1,
                  bf16=False, fp16=False, use_cpu=True, report_to=[], logging_steps=1,
                  save_strategy="no", disable_tqdm=True, seed=SEED, dataloader_num_workers=0,
                  output_dir=str(work / f"trl-{task}"))
    info: dict = {}
    counted: list[int] = []
    from olmoflow.tokenizer import BPETokenizer

    tok = BPETokenizer.load(hf)
    if task == "sft":
        from olmoflow.posttrain.sft import SFTLoader, pack_examples

        # Our rows (the same packing, seed and order as our side), read sequentially, so both
        # sides train the very same batches. Labels in transformers' convention (unshifted,
        # -100 off the loss mask); packed rows go padding-free, which is what TRL's bfd packing
        # feeds the model: one flattened sequence per batch, position ids restarting per example.
        examples = sft_examples_for(work, tok, args)
        data = pack_examples(examples, args.seq, packing=args.packing,
                             pad_token_id=tok.pad_token_id, seed=SEED)
        rows = []
        for r in SFTLoader(data, args.batch, seed=SEED).order(0).tolist():
            exs = [examples[i] for i in data.examples_of(r)]
            rows.append({"input_ids": [t for e in exs for t in e.input_ids],
                         "labels": [t if m else -100 for e in exs
                                    for t, m in zip(e.input_ids, e.loss_mask)],
                         "seq_lengths": [len(e.input_ids) for e in exs]})
        config = trl.SFTConfig(per_device_train_batch_size=args.batch, max_length=None,
                               packing=False, padding_free=args.packing,
                               train_sampling_strategy="sequential", **common)
        base, kwargs = trl.SFTTrainer, {}
        info["data"] = f"the same {len(rows)} rows, padding-free: {args.packing}"

        def count(inputs):
            return int((inputs["labels"][..., 1:] != -100).sum())
    elif task == "dpo":
        from olmoflow.posttrain.dpo import PreferenceDataset, PreferenceLoader

        pairs = dpo_pairs(work, tok, args)
        # our loader's pair order, read sequentially: both sides train the very same batches
        order = PreferenceLoader(PreferenceDataset(pairs, args.seq, tok.pad_token_id),
                                 args.dpo_batch, seed=SEED).order(0)
        rows = [{"prompt_ids": pairs[i].prompt_ids, "chosen_ids": pairs[i].chosen_ids,
                 "rejected_ids": pairs[i].rejected_ids} for i in order.tolist()]
        config = trl.DPOConfig(per_device_train_batch_size=args.dpo_batch, max_length=None,
                               train_sampling_strategy="sequential",
                               precompute_ref_log_probs=True,
                               precompute_ref_batch_size=args.dpo_batch, beta=0.1,
                               loss_type=["sigmoid"], **common)
        base, kwargs = trl.DPOTrainer, {}
        info["data"] = f"{len(rows)} pairs"

        def count(inputs):  # input positions, as ours counts them (the last token is no input)
            return int(inputs["attention_mask"].sum()) - inputs["attention_mask"].shape[0]
    else:
        from olmoflow.posttrain.rewards import Verifier

        verifier = Verifier()
        rows = [{"prompt": p.text, "answer": p.answer} for p in rl_prompts(args)]

        def reward(prompts, completions, answer, **_):
            return [float(verifier.correct(c, a)) for c, a in zip(completions, answer)]

        config = trl.GRPOConfig(per_device_train_batch_size=args.prompts * args.group,
                                num_generations=args.group,
                                max_completion_length=args.max_new_tokens, temperature=1.0,
                                beta=0.0, loss_type="dapo", epsilon=0.2, epsilon_high=0.272,
                                scale_rewards="group", use_vllm=False, **common)
        base, kwargs = trl.GRPOTrainer, {"reward_funcs": [reward]}

        def count(inputs):
            return int(inputs["completion_mask"].sum())

    rollout: list[float] = []

    class Bench(base):
        def _generate_and_score_completions(self, *a, **kw):
            t = time.perf_counter()
            out = super()._generate_and_score_completions(*a, **kw)
            rollout.append(time.perf_counter() - t)
            return out

        def compute_loss(self, model, inputs, *a, **kw):
            counted.append(count(inputs))
            return super().compute_loss(model, inputs, *a, **kw)

        def _prepare_dataset(self, dataset, *a, **kw):
            if task == "dpo":  # already tokenized by our reader: the same ids as ours
                return dataset
            return super()._prepare_dataset(dataset, *a, **kw)

        def _precompute_ref_logps(self, *a, **kw):
            t = time.perf_counter()
            out = super()._precompute_ref_logps(*a, **kw)
            info["ref_s"] = info.get("ref_s", 0.0) + time.perf_counter() - t
            return out

    clock, losses = Clock(pipe, total), []

    class Lockstep(transformers.TrainerCallback):
        def on_train_begin(self, *_, **__):
            clock.begin()

        def on_log(self, _args, state, control, logs=None, **__):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

        def on_step_end(self, *_, **__):
            # the loss of this step is logged after on_step_end: send the one before
            clock.lap(tokens=counted[-1], loss=losses[-1] if losses else None,
                      rollout_s=rollout[-1] if rollout else 0.0)

    trainer = Bench(model=model, args=config, train_dataset=datasets.Dataset.from_list(rows),
                    processing_class=tokenizer, callbacks=[Lockstep()], **kwargs)
    pipe.send({"ready": True, **info})
    trainer.train()
    info["losses"] = losses
    return info


def child(side: str, work: Path, args) -> None:
    """One side for every task: ``setup TASK``, its steps, ``finish``; ``quit`` ends."""
    pipe = Pipe()
    torch.set_num_threads(args.threads)
    os.environ["TQDM_DISABLE"] = "1"
    import transformers

    transformers.logging.set_verbosity_error()
    if side == "trl":
        import trl  # noqa: F401  (imports before the first task, outside any timing)
    import olmoflow.train.trainer  # noqa: F401

    pipe.send({"ready": True})
    run = ours_task if side == "ours" else trl_task
    while (command := pipe.read()) != "quit":
        info = run(command.split()[1], work, args, pipe)
        pipe.expect("finish")
        pipe.send(info)


# ---------------------------------------------------------------------------------------------
# The parent


class Child:
    """One side in its own process, driven command by command over a pipe."""

    def __init__(self, side: str, work: Path, args):
        cmd = [sys.executable, __file__, "--child", side, "--work", str(work)] + args.forward
        self.side, self.log = side, open(work / f"{side}.log", "w+")
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1",
               "TRANSFORMERS_VERBOSITY": "error", "HF_DATASETS_OFFLINE": "1",
               "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env)
        self.ask(None)

    def ask(self, command: str | None) -> dict:
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            sys.exit(f"{self.side} child failed ({self.proc.wait()}):\n"
                     f"{self.log.read()[-6000:]}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait()


def prepare(work: Path, args) -> str:
    """Tokenizer (trained on the data, tulu template) and model, one HF directory for both."""
    from olmoflow.model.config import ModelConfig
    from olmoflow.model.olmo import Olmo
    from olmoflow.tokenizer.chat import add_chat_template
    from olmoflow.tokenizer import BPETokenizer

    tok = BPETokenizer().train_from_texts(corpus(work), vocab_size=VOCAB)
    add_chat_template(tok, TEMPLATE)
    torch.manual_seed(SEED)
    vocab = -(-tok.vocab_size // 128) * 128
    model = Olmo(ModelConfig(vocab_size=vocab, **MODEL))
    model.save_pretrained(work / "hf")
    tok.save(work / "hf")
    return (f"model: {model.num_params():,} parameters (d_model {MODEL['d_model']}, "
            f"{MODEL['n_layers']} layers, window {MODEL['sliding_window']}, vocab {vocab})")


def run_task(task: str, children: dict[str, Child], args) -> dict:
    ready = {s: c.ask(f"setup {task}") for s, c in children.items()}
    steps: dict[str, list[dict]] = {s: [] for s in children}
    for i in range(args.warmup + args.steps):
        order = ("ours", "trl") if i % 2 == 0 else ("trl", "ours")
        for side in order:
            res = children[side].ask("step")
            steps[side].append(res)
    done = {s: c.ask("finish") for s, c in children.items()}
    return {"ready": ready, "steps": steps, "done": done}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per task and side")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--quick", action="store_true", help="a small smoke run")
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated subset")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per side (default 1: steadiest on a shared CPU)")
    ap.add_argument("--batch", type=int, default=8, help="SFT rows per step")
    ap.add_argument("--dpo-batch", type=int, default=4, help="DPO pairs per step")
    ap.add_argument("--seq", type=int, default=256, help="sequence length (tokens)")
    ap.add_argument("--no-packing", dest="packing", action="store_false",
                    help="SFT one example per row on both sides")
    ap.add_argument("--prompts", type=int, default=4, help="GRPO prompts per iteration (P)")
    ap.add_argument("--group", type=int, default=4, help="GRPO samples per prompt (G)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="GRPO completion length")
    ap.add_argument("--child", choices=["ours", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup, args.seq = min(args.steps, 3), 1, min(args.seq, 128)
        args.max_new_tokens = min(args.max_new_tokens, 16)
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be >= 1 (the first step pays one-time costs)")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if set(tasks) - set(TASKS):
        ap.error(f"--tasks takes {', '.join(TASKS)}")
    if args.child:
        child(args.child, Path(args.work), args)
        return
    args.forward = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--threads",
                    str(args.threads), "--batch", str(args.batch), "--dpo-batch",
                    str(args.dpo_batch), "--seq", str(args.seq), "--prompts", str(args.prompts),
                    "--group", str(args.group), "--max-new-tokens", str(args.max_new_tokens)
                    ] + ([] if args.packing else ["--no-packing"])

    import transformers
    import trl

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print(f"{prepare(work, args)}; data: {sft_source(work).name}, {dpo_source(work).name}, "
              f"arithmetic prompts; SFT {args.batch}x{args.seq} packing "
              f"{'on' if args.packing else 'off'}, DPO {args.dpo_batch} pairs <= {args.seq} "
              f"tokens, GRPO {args.prompts}x{args.group} samples x {args.max_new_tokens} tokens; "
              f"{args.warmup}+{args.steps} steps per task and side; torch {torch.__version__}, "
              f"transformers {transformers.__version__}, trl {trl.__version__}, "
              f"{args.threads} thread(s)", flush=True)
        children = {side: Child(side, work, args) for side in ("ours", "trl")}
        results = {}
        for task in tasks:
            results[task] = run_task(task, children, args)
            print(f"{task}: done ({time.perf_counter() - start:.0f} s)", flush=True)
        for c in children.values():
            c.close()
    report(results, args, time.perf_counter() - start)


def report(results: dict, args, elapsed: float) -> None:
    rows, ratios, notes = [], [], []
    for task, r in results.items():
        timed = {s: r["steps"][s][args.warmup:] for s in ("ours", "trl")}
        med = {s: statistics.median(x["wall_s"] for x in timed[s]) for s in timed}
        cpu = {s: statistics.median(x["cpu_s"] for x in timed[s]) for s in timed}
        tokens = {s: statistics.mean(x["tokens"] for x in timed[s]) for s in timed}
        first = {s: r["steps"][s][0].get("loss") for s in timed}
        if trl_losses := r["done"]["trl"].get("losses"):
            first["trl"] = trl_losses[0]
        first = {s: float("nan") if v is None else v for s, v in first.items()}
        if task == "grpo":
            rows.append(("GRPO s/iteration (median)", med["ours"], med["trl"], ".3f", True))
        else:
            rows.append((f"{task.upper()} steps/s (median step)", 1 / med["ours"],
                         1 / med["trl"], ".3f", False))
        unit = "iterations" if task == "grpo" else "steps"
        rows.append((f"{task.upper()} {unit} per CPU-second (median)", 1 / cpu["ours"],
                     1 / cpu["trl"], ".3f", False))
        what = {"sft": "trained tokens", "dpo": "real tokens", "grpo": "response tokens"}[task]
        rows.append((f"{task.upper()} {what}/step (mean)", tokens["ours"], tokens["trl"], ".0f",
                     None))
        if task == "grpo":
            rows.append(("GRPO rollout s/iteration (median; generate, score, logps)",
                         *(statistics.median(x["rollout_s"] for x in timed[s]) for s in timed),
                         ".3f", True))
        if task == "dpo":
            rows.append(("DPO reference pass s (before training)",
                         r["ready"]["ours"].get("ref_s", float("nan")),
                         r["ready"]["trl"].get("ref_s", float("nan")), ".2f", True))
        rows.append((f"{task.upper()} loss, step 1", first["ours"], first["trl"], ".4f", None))
        ratios.append((task, med["trl"] / med["ours"]))
        if "data" in r["ready"]["ours"]:
            notes.append(f"{task}: ours {r['ready']['ours']['data']}; TRL "
                         f"{r['ready']['trl'].get('data', '?')}")
        if task == "sft" and args.packing and not r["done"]["ours"].get("doc_ids", True):
            notes.append("sft: NOTE our SFTLoader gave no doc_ids on packed rows: attention "
                         "crossed example boundaries (less work than TRL's per-example mask)")
    print(f"\nwall time {elapsed:.0f} s; machine load average {os.getloadavg()[0]:.1f}")
    for n in notes:
        print(n)
    w = max(len(r[0]) for r in rows)
    print(f"\n| {'metric':<{w}} | {'ours':>9} | {'TRL':>9} | {'ratio':>6} |")
    print(f"|{'-' * (w + 2)}|{'-' * 11}|{'-' * 11}|{'-' * 8}|")
    for name, o, t, fmt, lower_better in rows:
        ratio = "" if lower_better is None else f"{(t / o if lower_better else o / t):.2f}"
        print(f"| {name:<{w}} | {o:>9{fmt}} | {t:>9{fmt}} | {ratio:>6} |")
    print("\nratio = ours speed / TRL speed (> 1: ours faster); targets "
          + ", ".join(f"{t} >= {TARGETS[t]}x" for t, _ in ratios))
    for task, ratio in ratios:
        met = "met" if ratio >= TARGETS[task] else "NOT met"
        print(f"{task}: ratio (ours/TRL) = {ratio:.2f}  (target {TARGETS[task]}x {met})")


if __name__ == "__main__":
    main()
