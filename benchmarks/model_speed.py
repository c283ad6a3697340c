"""How fast is olmoflow's ``Olmo`` next to ``transformers.Olmo3ForCausalLM`` on the same weights?

Side by side in one process on CPU (same threads, same inputs, same weights):

- train step: forward + backward + AdamW on a ``[16, 256]`` batch, tokens/s;
- prefill: a no-grad forward over ``[8, 256]`` returning all logits, tokens/s;
- decode: 128 greedy new tokens after a 32-token prompt, at batch 1 and batch 8, new tokens/s
  (ours: ``olmoflow.infer.generate.generate``, eager and, at batch 1, ``compile=True``;
  transformers: ``model.generate(do_sample=False, min_new_tokens=128)``);
- model FLOPs utilization (MFU) of the train step against a matmul peak measured in this run (a
  large fp32 ``torch.mm``). FLOPs per token follow nanoGPT's ``estimate_mfu`` (PaLM appendix B):
  ``6 N + 12 sum_layers(n_heads * head_dim * ctx)`` where N excludes the input embedding (a lookup,
  no FLOPs) and ctx is the sequence length, capped at the window on sliding-window layers.

Usage:  python benchmarks/model_speed.py [--model runs/demo/release] [--repeats 3] [--threads N]
        [--parts train,prefill,decode]

Weights: ``--model`` (a Hugging Face directory, default ``runs/demo/release`` when present), else a
randomly initialised demo shape (vocab 8192, d_model 256, 4 layers, 4 heads, MLP 768, window 128).
Each number is the best of ``--repeats`` timed runs after one warm-up. The table's ratio column is
ours / transformers in tokens/s (> 1: ours is faster); the last line is the headline ratio.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time
from pathlib import Path

import torch

from olmoflow.model.config import ModelConfig
from olmoflow.model.hf import save_hf_dir
from olmoflow.model.olmo import Olmo

DEMO = ModelConfig(vocab_size=8192, d_model=256, n_layers=4, n_heads=4, mlp_hidden=768,
                   sliding_window=128, max_sequence_length=4096)


def best_time(fn, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an ``[n, n] @ [n, n]`` fp32 matmul on this CPU with the current thread count."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / best_time(lambda: torch.mm(a, b), repeats)


def train_flops_per_token(cfg: ModelConfig, seq: int) -> float:
    """nanoGPT's estimate: ``6 N + 12 * sum over layers of n_heads * head_dim * ctx``."""
    n = cfg.num_params() - cfg.vocab_size * cfg.d_model  # the input embedding does no matmul
    attn = sum(12 * cfg.n_heads * cfg.hd * min(seq, cfg.window(i) or seq)
               for i in range(cfg.n_layers))
    return 6 * n + attn


def train_step_fn(model, ids, labels, hf: bool):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, foreach=True)
    model.train()

    def step():
        if hf:  # transformers shifts labels itself; pass the aligned ones as shift_labels
            loss = model(input_ids=ids, labels=labels, shift_labels=labels).loss
        else:
            loss = model(ids, labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model",
                    help="a Hugging Face OLMo directory (default: runs/demo/release if present)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--parts", default="train,prefill,decode",
                    help="comma-separated subset of train,prefill,decode to measure")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if not parts <= {"train", "prefill", "decode"}:
        ap.error(f"--parts: unknown {sorted(parts - {'train', 'prefill', 'decode'})}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    src = Path(args.model) if args.model else Path("runs/demo/release")
    tmp = tempfile.TemporaryDirectory()
    if (src / "config.json").is_file():
        ours = Olmo.from_pretrained(src, dtype=torch.float32)
        where = str(src)
    else:
        ours = Olmo(DEMO).eval()
        save_hf_dir(ours, tmp.name)
        src, where = Path(tmp.name), "random init (demo shape)"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, attn_implementation="sdpa").eval()
    cfg = ours.config
    V = cfg.vocab_size
    print(f"weights: {where}; {type(theirs).__name__}; {ours.num_params():,} parameters; "
          f"d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, window "
          f"{cfg.sliding_window}; torch {torch.__version__}, "
          f"transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads")

    from olmoflow.infer.generate import generate

    rows: list[tuple[str, float, float, str]] = []  # metric, ours, theirs, unit
    R = args.repeats

    # --- prefill --------------------------------------------------------------------------------
    ids = torch.randint(0, V, (8, 256))
    with torch.no_grad():
        t_o, t_t = float("inf"), float("inf")
        for _ in range(2 if "prefill" in parts else 0):  # alternated, as below
            t_o = min(t_o, best_time(lambda: ours(ids), R))
            t_t = min(t_t, best_time(lambda: theirs(input_ids=ids, use_cache=False), R))
    if "prefill" in parts:
        rows.append(("prefill b8x256 (tok/s)", ids.numel() / t_o, ids.numel() / t_t, ""))

    # --- decode ---------------------------------------------------------------------------------
    n_new = args.new_tokens
    same = {}
    for b in (1, 8) if "decode" in parts else ():
        prompt = torch.randint(0, V, (b, 32))
        mask = torch.ones_like(prompt)
        out_o, out_t = {}, {}

        # This iteration's prompt and outputs are bound as defaults: each closure runs in its own
        # iteration, and the binding says so.
        def run_ours(prompt=prompt, out_o=out_o):
            out_o["x"] = generate(ours, prompt, max_new_tokens=n_new)

        def run_theirs(prompt=prompt, mask=mask, out_t=out_t):
            with torch.no_grad():
                out_t["x"] = theirs.generate(prompt, attention_mask=mask, do_sample=False,
                                             max_new_tokens=n_new, min_new_tokens=n_new,
                                             pad_token_id=0)

        t_o, t_t = float("inf"), float("inf")
        for _ in range(2):  # alternated, as for the train step below
            t_o = min(t_o, best_time(run_ours, R))
            t_t = min(t_t, best_time(run_theirs, R))
        assert out_o["x"].shape == out_t["x"].shape == (b, 32 + n_new)
        same[b] = (out_o["x"] == out_t["x"]).float().mean().item()
        rows.append((f"decode b{b} x{n_new} (new tok/s)", b * n_new / t_o, b * n_new / t_t, ""))
        if b == 1:
            # The same decode with torch.compile over a static-shape cache; the warm-up call of
            # best_time absorbs the compilation (~10 s here), as a server would before serving.
            def run_compiled(prompt=prompt, out_o=out_o):
                out_o["c"] = generate(ours, prompt, max_new_tokens=n_new, compile=True)

            t_c = float("inf")
            for _ in range(2):
                t_c = min(t_c, best_time(run_compiled, R))
            assert torch.equal(out_o["c"], out_o["x"])  # compiled decode emits the same tokens
            rows.append((f"decode b1 x{n_new} compiled (new tok/s)", n_new / t_c, n_new / t_t, ""))

    # --- train step (last: it changes the weights; each side trains its own copy) --------------
    if "train" in parts:
        ids = torch.randint(0, V, (16, 256))
        labels = torch.randint(0, V, (16, 256))
        # Alternate the two sides (o, t, o, t) and keep each one's best: on a shared machine the
        # load drifts, and timing one side entirely before the other would hand the drift to one
        # of them.
        step_o = train_step_fn(copy.deepcopy(ours), ids, labels, hf=False)
        step_t = train_step_fn(copy.deepcopy(theirs), ids, labels, hf=True)
        t_o, t_t = float("inf"), float("inf")
        for _ in range(2):
            t_o = min(t_o, best_time(step_o, R))
            t_t = min(t_t, best_time(step_t, R))
        rows.insert(0, ("train step b16x256 (tok/s)", ids.numel() / t_o, ids.numel() / t_t, ""))

        peak = matmul_peak()
        fpt = train_flops_per_token(cfg, 256)
        mfu_o = rows[0][1] * fpt / peak
        mfu_t = rows[0][2] * fpt / peak
        rows.insert(1, ("train MFU (% of matmul peak)", 100 * mfu_o, 100 * mfu_t, "%"))
        print(f"\nmatmul peak (fp32 2048^3 torch.mm): {peak / 1e9:.1f} GFLOP/s; train FLOPs/token "
              f"{fpt / 1e6:.1f} M (6N + attention)")
    if same:
        print(f"greedy decode: same tokens as transformers: b1 {same[1]:.0%}, b8 {same[8]:.0%}\n")
    w = max(len(r[0]) for r in rows)
    print(f"| {'metric':<{w}} | {'ours':>10} | {'transformers':>12} | {'ratio':>6} |")
    print(f"|{'-' * (w + 2)}|{'-' * 12}|{'-' * 14}|{'-' * 8}|")
    for name, o, t, _ in rows:
        print(f"| {name:<{w}} | {o:>10.1f} | {t:>12.1f} | {o / t:>6.2f} |")
    head = next((r for r in rows if r[0].startswith("decode b1")), None)
    if head is not None:
        print(f"\nratio (ours/transformers) decode b1 = {head[1] / head[2]:.2f}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
