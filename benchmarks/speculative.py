"""Does prompt-lookup speculative decoding speed up greedy decoding, and by how much?

Plain greedy decoding (``olmoflow.infer.generate.generate``) against prompt-lookup speculative
greedy decoding (``Olmo.generate(..., prompt_lookup_num_tokens=K)``) on the same prompts, batch 1,
eager, in one process: code-like prompts (the head of standard-library source files) and prose
(standard-library docstrings). For each set: new tokens/s of both, the speed ratio, the draft
acceptance rate, tokens per model forward, and how many outputs equal plain decoding's token for
token.

Usage:  python benchmarks/speculative.py [--model DIR] [--num-draft-tokens 10] [--new-tokens 128]
        [--prompt-chars 1200] [--repeats 3] [--threads N]

Weights: ``--model`` (a release or Hugging Face directory, with its tokenizer or, without a
``tokenizer.json``, over byte tokens), else a randomly initialised demo shape (vocab 8192,
d_model 256, 4 layers, 4 heads, MLP 768, window 128) over byte tokens (id = UTF-8 byte). Times are the best of ``--repeats`` interleaved passes over each
set after a warm-up. The last two lines are the headline: the speed ratio on code and the
acceptance rate.
"""

from __future__ import annotations

import argparse
import inspect
import time
from pathlib import Path

import torch

from olmoflow.infer.generate import generate
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo

DEMO = ModelConfig(vocab_size=8192, d_model=256, n_layers=4, n_heads=4, mlp_hidden=768,
                   sliding_window=128, max_sequence_length=4096)
CODE_MODULES = ("json.decoder", "collections", "argparse", "textwrap", "functools", "dataclasses")
PROSE_MODULES = ("json", "argparse", "unittest", "logging", "email", "sqlite3")


def texts(modules, chars: int, source: bool) -> list[str]:
    import importlib

    out = []
    for name in modules:
        mod = importlib.import_module(name)
        text = inspect.getsource(mod) if source else (mod.__doc__ or "")
        out.append(text[:chars])
    return out


class Bytes:
    """Byte tokens for a random-init model: id = UTF-8 byte."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def run_set(model, prompts: list[torch.Tensor], new: int, k: int, repeats: int) -> dict:
    def plain():
        return [generate(model, p, max_new_tokens=new) for p in prompts]

    def spec():
        return [model.generate(p, max_new_tokens=new, prompt_lookup_num_tokens=k,
                               return_stats=True) for p in prompts]

    # Interleaved passes, the best of each: a shared machine's load drifts between passes.
    plain(), spec()
    t_plain = t_spec = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        outs = plain()
        t_plain = min(t_plain, time.perf_counter() - t)
        t = time.perf_counter()
        spec_outs = spec()
        t_spec = min(t_spec, time.perf_counter() - t)
    tokens = sum(o.shape[1] - p.shape[1] for o, p in zip(outs, prompts))
    drafted = sum(s.drafted for _, s in spec_outs)
    accepted = sum(s.accepted for _, s in spec_outs)
    forwards = sum(s.forwards for _, s in spec_outs)
    emitted = sum(s.emitted for _, s in spec_outs)
    same = sum(torch.equal(o, so) for o, (so, _) in zip(outs, spec_outs))
    return {"plain": tokens / t_plain, "spec": tokens / t_spec, "ratio": t_plain / t_spec,
            "rate": accepted / drafted if drafted else 0.0,
            "per_forward": emitted / forwards if forwards else 0.0,
            "same": f"{same}/{len(prompts)}", "accepted": accepted, "drafted": drafted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-draft-tokens", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-chars", type=int, default=1200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model:
        from olmoflow import Tokenizer

        model = Olmo.from_pretrained(args.model).eval()
        # a directory without a tokenizer holds a byte-level model (vocab >= 256)
        has_tok = (Path(args.model) / "tokenizer.json").is_file()
        tok = Tokenizer.from_pretrained(args.model) if has_tok else Bytes()
        what = args.model + ("" if has_tok else ", byte tokens")
    else:
        torch.manual_seed(0)
        model, tok, what = Olmo(DEMO).eval(), Bytes(), "random-init demo shape, byte tokens"
    sets = {"code": texts(CODE_MODULES, args.prompt_chars, True),
            "prose": texts(PROSE_MODULES, args.prompt_chars, False)}
    print(f"model: {what}; batch 1, greedy, {args.new_tokens} new tokens, "
          f"prompt_lookup_num_tokens={args.num_draft_tokens}, threads {torch.get_num_threads()}")
    print(f"{'set':<6} {'plain tok/s':>12} {'lookup tok/s':>13} {'ratio':>6} {'accepted':>13} "
          f"{'rate':>6} {'tok/fwd':>8} {'same':>5}")
    results = {}
    for name, raw in sets.items():
        prompts = [torch.tensor([tok.encode(t)]) for t in raw if t]
        r = results[name] = run_set(model, prompts, args.new_tokens, args.num_draft_tokens,
                                    args.repeats)
        print(f"{name:<6} {r['plain']:>12.1f} {r['spec']:>13.1f} {r['ratio']:>5.2f}x "
              f"{r['accepted']:>6}/{r['drafted']:<6} {r['rate']:>6.1%} {r['per_forward']:>8.2f} "
              f"{r['same']:>5}")
    print(f"speed ratio (prompt lookup / plain, code): {results['code']['ratio']:.2f}x; "
          f"prose: {results['prose']['ratio']:.2f}x")
    print(f"acceptance rate: code {results['code']['rate']:.1%}, "
          f"prose {results['prose']['rate']:.1%}")


if __name__ == "__main__":
    main()
