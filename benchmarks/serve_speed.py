"""How fast does ``olmoflow serve`` answer concurrent clients next to ``transformers serve``?

Both servers run in turn as subprocesses on 127.0.0.1 over the same Hugging Face directory, and
each gets the same load from :func:`serve_common.run_load` at 1, 8 and 32 concurrent streaming
clients (``--concurrency``): the same prompts in the same order per client, the same
``max_tokens``, greedy. Reported per server and concurrency: requests/s, generated tokens/s (from
each response's ``usage``), tokens per request, p50 latency, p50 time to first token (TTFT).
Definitions as in vLLM's ``benchmarks/benchmark_serving.py`` (see ``serve_common``).

- ours: ``olmoflow serve DIR`` (continuous batching over the KV-cache engine);
- reference: ``transformers serve DIR`` (transformers' own OpenAI-compatible server, run offline
  on the local path), both without continuous batching (one request at a time on its inference
  thread) and with ``--continuous-batching`` (paged attention); the ratio lines compare ours with
  each and with the faster of the two at each concurrency. ``transformers serve`` runs here, so the
  fallback the plan allowed (``generate`` behind a small FastAPI app) is not needed.
- llama.cpp (``llama-cpp-python``'s OpenAI-compatible server, ``python -m llama_cpp.server``) on
  an f32 GGUF export of the same weights (``olmoflow export gguf``), when it imports here
  (``--llama-cpp auto``, the default); EOS is kept off with ``logit_bias`` so it generates the
  same number of tokens. Its Python server answers one request at a time.

Same number of tokens: the reference gets ``min_new_tokens = max_tokens`` (through the request's
``generation_config``, which ``transformers serve`` accepts), so it never stops at EOS; ours is sent
vLLM's ``min_tokens`` / ``ignore_eos`` extensions, which it ignores unless it supports them, so it
may stop early at EOS: the ``tok/req`` column shows it, and tokens/s is counted from ``usage``
either way. The greedy texts at 1 client are compared per prompt (same weights, same greedy
decoding: they should agree, up to where ours stopped at EOS).

Threads: each server runs with ``--threads`` torch threads (default 1, through
``OMP_NUM_THREADS``). On a CPU shared with other work, multi-threaded decoding collapses: OpenMP's
threads wait on each other at every small op while the scheduler runs someone else (measured here
at a load average of 12 on 2 cores: 64-token greedy decode of the demo model in one process, 2.2
tokens/s with 2 threads against 44 with 1, for transformers and olmoflow alike). One thread each
keeps the comparison about the servers; ``--threads 0`` uses torch's default.

Weights: ``--model`` (default ``runs/demo/release`` when present), else a randomly initialised
demo shape (d_model 256, 4 layers, 4 heads, MLP 768, window 128) with a byte-level BPE tokenizer
trained here on Python standard library sources, written to a temporary directory.

Usage:  python benchmarks/serve_speed.py [--model runs/demo/release] [--quick]
        [--duration 12] [--max-tokens 64] [--concurrency 1,8,32] [--reference both|plain|cb|none]
        [--threads 1] [--rounds 1] [--json FILE]
Default: about 5 minutes on 2 idle CPU cores (8 with a load average of 12); ``--quick`` (4 s
windows, 16 tokens, 20 s drain, the plain reference only) about 1.5 minutes (2 under that load).
A server that falls behind is cut off ``--drain`` seconds after each window: its requests still
running are cancelled and counted unfinished (the text chunks they had streamed still count in
tokens/s; latency and TTFT percentiles are over completed requests only, so they flatter a server
with unfinished ones).
The last lines are the ratios: ours@32 / ours@1 (target >= 6x) and ours / reference at each
concurrency, in tokens/s; then the CPU load average (others' work on a shared machine shows).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_common import (  # noqa: E402  (the benchmarks folder is not a package)
    MAX_CLIENTS,
    BenchError,
    LoadConfig,
    LoadReport,
    ServerProcess,
    fetch_model_name,
    free_port,
    llama_cpp_available,
    llama_cpp_serve_cmd,
    load_prompts,
    olmoflow_serve_cmd,
    run_load,
    transformers_serve_cmd,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "runs" / "demo" / "release"
TARGET_SCALING = 6.0


def build_random_model(out: Path) -> None:
    """Write a random demo-shape Olmo and a BPE tokenizer (trained on stdlib sources) to ``out``.

    The model's vocabulary is the tokenizer's, so neither server can emit an id it cannot decode.
    """
    import torch

    from olmoflow.model.config import ModelConfig
    from olmoflow.model.hf import save_hf_dir
    from olmoflow.model.olmo import Olmo
    from olmoflow.tokenizer import BPETokenizer

    src = Path(json.__file__).resolve().parents[1]  # the stdlib: text that is always here
    texts, size = [], 0
    for f in sorted(src.glob("*.py")):
        t = f.read_text(encoding="utf-8", errors="replace")
        texts.append(t)
        size += len(t)
        if size > 3_000_000:
            break
    tok = BPETokenizer().train_from_texts(texts, vocab_size=4096)
    torch.manual_seed(0)
    model = Olmo(ModelConfig(vocab_size=tok.vocab_size, d_model=256, n_layers=4, n_heads=4,
                             mlp_hidden=768, sliding_window=128, max_sequence_length=4096)).eval()
    save_hf_dir(model, out, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tok.save(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a Hugging Face OLMo directory with its tokenizer "
                                    "(default: runs/demo/release if present, else random)")
    ap.add_argument("--quick", action="store_true",
                    help="short run (~1.5 min): 4 s windows, 16 tokens, plain reference only")
    ap.add_argument("--duration", type=float, help="load window per point, s (default 12)")
    ap.add_argument("--max-tokens", type=int, help="new tokens per request (default 64)")
    ap.add_argument("--concurrency", default="1,8,32", help="client counts, comma-separated")
    ap.add_argument("--reference", choices=("both", "plain", "cb", "none"),
                    help="transformers serve without (plain) / with continuous batching "
                         "(default both; --quick: plain)")
    ap.add_argument("--llama-cpp", choices=("auto", "on", "off"), default="auto",
                    help="llama.cpp's server (llama-cpp-python) on a GGUF export as a reference: "
                         "auto (default) when it imports here, on (an error when it does not), "
                         "off")
    ap.add_argument("--serve-args", default="",
                    help="extra flags for `olmoflow serve` (e.g. '--max-batch 64')")
    ap.add_argument("--drain", type=float,
                    help="seconds after each window for requests in flight to finish; those "
                         "still running are cancelled and reported unfinished (default 30; "
                         "--quick: 20)")
    ap.add_argument("--device", default="cpu", help="both servers' device (default cpu)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads of each server (OMP_NUM_THREADS; default 1; "
                         "0: torch's default, one per core)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every server this many times, alternating, keeping each "
                         "point's best (2 steadies the numbers on a shared machine)")
    ap.add_argument("--json", metavar="FILE", help="also write all numbers to FILE")
    args = ap.parse_args(argv)
    args.duration = args.duration or (4.0 if args.quick else 12.0)
    args.max_tokens = args.max_tokens or (16 if args.quick else 64)
    args.reference = args.reference or ("plain" if args.quick else "both")
    args.drain = args.drain if args.drain is not None else (20.0 if args.quick else 30.0)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        ap.error(f"--concurrency must be integers separated by commas, got {args.concurrency!r}")
    if not all(1 <= c <= MAX_CLIENTS for c in args.concurrency):
        ap.error(f"--concurrency values must be in 1..{MAX_CLIENTS}")
    if (args.duration <= 0 or args.max_tokens < 1 or args.drain < 0 or args.threads < 0
            or args.rounds < 1):
        ap.error("--duration, --max-tokens and --rounds must be positive, --drain and "
                 "--threads >= 0")
    return args


def servers(args: argparse.Namespace, model_dir: Path,
            gguf: Path | None = None) -> list[tuple[str, object, dict]]:
    """``(name, command builder (port -> argv), extra request body)`` for each server to run
    (llama.cpp's when ``gguf`` is its exported file)."""
    ours_extra = {"min_tokens": args.max_tokens, "ignore_eos": True}
    gen_config = json.dumps({"max_new_tokens": args.max_tokens,
                             "min_new_tokens": args.max_tokens, "do_sample": False})
    ref_extra = {"generation_config": gen_config}
    extra_flags = shlex.split(args.serve_args)
    # The paged cache holds every client's sequence: the prompts are short (< 64 tokens).
    sizing = {"max_seqs": max(args.concurrency), "max_seq_tokens": 64 + args.max_tokens,
              "device": args.device}
    out = [("olmoflow",
            lambda p: olmoflow_serve_cmd(model_dir, p, extra_flags, device=args.device),
            ours_extra)]
    if args.reference in ("both", "plain"):
        out.append(("transformers",
                    lambda p: transformers_serve_cmd(model_dir, p, False, **sizing), ref_extra))
    if args.reference in ("both", "cb"):
        out.append(("transformers-cb",
                    lambda p: transformers_serve_cmd(model_dir, p, True, **sizing), ref_extra))
    if gguf is not None:
        eos = json.loads((model_dir / "config.json").read_text()).get("eos_token_id")
        bias = {"logit_bias": {str(eos): -1e9}} if isinstance(eos, int) else {}
        out.append(("llama.cpp", lambda p: llama_cpp_serve_cmd(
            gguf, p, n_ctx=1024, threads=args.threads or (os.cpu_count() or 1)), bias))
    return out


def export_gguf_for(args: argparse.Namespace, model_dir: Path, tmp: Path) -> Path | None:
    """The f32 GGUF file of ``model_dir`` for llama.cpp, or None (``--llama-cpp off``, or auto
    and llama-cpp-python's server does not import: said in one line).

    Raises:
        BenchError: ``--llama-cpp on`` and it does not import, or the export fails.
    """
    if args.llama_cpp == "off":
        return None
    why = llama_cpp_available()
    if why is not None:
        if args.llama_cpp == "on":
            raise BenchError(why)
        print(f"llama.cpp reference skipped: {why}", flush=True)
        return None
    from olmoflow.errors import OlmoflowError
    from olmoflow.release.gguf_export import export_gguf

    try:
        return export_gguf(model_dir, tmp / "model-f32.gguf", dtype="f32")
    except OlmoflowError as e:
        raise BenchError(f"cannot export {model_dir} to GGUF for llama.cpp: {e}") from None


def measure(name: str, build, extra: dict, args: argparse.Namespace,
            prompts: list[dict]) -> dict[int, LoadReport]:
    """Start one server, run every concurrency point against it, stop it."""
    port = free_port()
    t = time.perf_counter()
    out: dict[int, LoadReport] = {}
    env = ({"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
           if args.threads else None)
    health = "/v1/models" if name == "llama.cpp" else "/health"
    with ServerProcess(name, build(port), port, env=env, health_path=health) as srv:
        print(f"{name}: up in {time.perf_counter() - t:.1f} s", flush=True)
        model = fetch_model_name(srv.url)
        for i, c in enumerate(args.concurrency):
            cfg = LoadConfig(base_url=srv.url, clients=c, duration_s=args.duration,
                             max_tokens=args.max_tokens, prompts=prompts, model=model,
                             extra_body=extra, drain_s=args.drain, warmup=2 if i == 0 else 0)
            rep = asyncio.run(run_load(cfg))
            out[c] = rep
            s = rep.summary()
            print(f"  {c:>3} clients: {s['tokens_per_s']:8.1f} tok/s, {s['requests_ok']} ok, "
                  f"{s['errors']} errors, {s['unfinished']} unfinished, "
                  f"{s['elapsed_s']:.1f} s", flush=True)
            for m in s["first_errors"]:
                print(f"      error: {m}", flush=True)
    return out


def compare_texts(ours: LoadReport, ref: LoadReport) -> tuple[int, int, int]:
    """``(identical, ours a prefix of the reference's, prompts compared)`` over the greedy
    texts both servers returned for the same prompt."""
    a = {r.prompt_index: r.text for r in ours.ok}
    b = {r.prompt_index: r.text for r in ref.ok}
    common = sorted(set(a) & set(b))
    same = sum(a[i] == b[i] for i in common)
    prefix = sum(a[i] != b[i] and b[i].startswith(a[i]) for i in common)
    return same, prefix, len(common)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = tempfile.TemporaryDirectory(prefix="serve-speed-")
    try:
        if args.model:
            model_dir, where = Path(args.model), args.model
        elif (DEFAULT_MODEL / "config.json").is_file():
            model_dir, where = DEFAULT_MODEL, str(DEFAULT_MODEL.relative_to(ROOT))
        else:
            model_dir, where = Path(tmp.name), "random init (demo shape), stdlib-trained BPE"
            build_random_model(model_dir)
        if not all((model_dir / f).is_file() for f in ("config.json", "tokenizer.json")):
            raise BenchError(f"{model_dir} needs config.json and tokenizer.json")
        import torch
        import transformers

        prompts = load_prompts(None, "completions")
        gguf = export_gguf_for(args, model_dir, Path(tmp.name))
        load0 = os.getloadavg()[0]
        print(f"weights: {where}; max_tokens {args.max_tokens}, greedy; {args.duration:g} s "
              f"window per point; clients {args.concurrency}; torch {torch.__version__}, "
              f"transformers {transformers.__version__}, "
              f"{args.threads or torch.get_num_threads()} CPU thread(s) per server",
              flush=True)
        results: dict[str, dict[int, LoadReport]] = {}
        for r in range(args.rounds):
            if args.rounds > 1:
                print(f"round {r + 1} of {args.rounds}", flush=True)
            # Servers alternate round by round, each point keeping its best: on a shared machine
            # the load drifts, and measuring one server entirely first would hand it the drift.
            for name, build, extra in servers(args, model_dir, gguf):
                for c, rep in measure(name, build, extra, args, prompts).items():
                    best = results.setdefault(name, {}).get(c)
                    if best is None or rep.tokens_per_s > best.tokens_per_s:
                        results[name][c] = rep
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        tmp.cleanup()

    print()
    hdr = (f"| {'server':<15} | {'clients':>7} | {'req/s':>7} | {'tok/s':>8} | {'tok/req':>7} | "
           f"{'p50 latency':>11} | {'p50 TTFT':>9} | {'errors':>6} | {'unfinished':>10} |")
    print(hdr)
    print("|" + "|".join("-" * len(c) for c in hdr.split("|")[1:-1]) + "|")
    for name, by_c in results.items():
        for c, rep in by_c.items():
            s = rep.summary()
            tpr = f"{s['tokens_per_request']:.1f}" if s["tokens_per_request"] else "n/a"
            lat = f"{s['latency_p50_s']:.2f} s" if s["latency_p50_s"] is not None else "n/a"
            ttft = f"{s['ttft_p50_s']:.2f} s" if s["ttft_p50_s"] is not None else "n/a"
            print(f"| {name:<15} | {c:>7} | {s['requests_per_s']:>7.2f} | "
                  f"{s['tokens_per_s']:>8.1f} | {tpr:>7} | {lat:>11} | {ttft:>9} | "
                  f"{s['errors']:>6} | {s['unfinished']:>10} |")

    ours = results["olmoflow"]
    refs = {k: v for k, v in results.items() if k != "olmoflow"}
    print()
    c1 = args.concurrency[0]
    for name, by_c in refs.items():
        if c1 in by_c and c1 in ours:
            same, prefix, n = compare_texts(ours[c1], by_c[c1])
            print(f"greedy texts at {c1} client(s), ours vs {name}: {same}/{n} identical"
                  + (f", {prefix} where ours stopped early (EOS)" if prefix else ""))
    lo, hi = min(args.concurrency), max(args.concurrency)
    if lo in ours and hi in ours and ours[lo].tokens_per_s > 0:
        scale = ours[hi].tokens_per_s / ours[lo].tokens_per_s
        verdict = "met" if scale >= TARGET_SCALING else "NOT met"
        print(f"ratio ours@{hi} / ours@{lo} (tok/s) = {scale:.2f}x "
              f"(target >= {TARGET_SCALING:g}x: {verdict})")
    for c in args.concurrency:
        parts = []
        for name, by_c in refs.items():
            if by_c[c].tokens_per_s > 0:
                parts.append(f"{name} {ours[c].tokens_per_s / by_c[c].tokens_per_s:.2f}x")
        if len(refs) > 1:
            best = max(refs, key=lambda k: refs[k][c].tokens_per_s)
            if refs[best][c].tokens_per_s > 0:
                parts.append(f"faster reference ({best}) "
                             f"{ours[c].tokens_per_s / refs[best][c].tokens_per_s:.2f}x")
        if parts:
            print(f"ratio ours / reference at {c} clients (tok/s): " + ", ".join(parts))

    if args.json:
        Path(args.json).write_text(json.dumps(
            {"weights": where, "max_tokens": args.max_tokens, "duration_s": args.duration,
             "results": {n: {str(c): r.summary() for c, r in by_c.items()}
                         for n, by_c in results.items()}}, indent=2))
    load = os.getloadavg()[0]
    print(f"\nCPU load average (1 min) at the start {load0:.1f}, at the end {load:.1f} on "
          f"{os.cpu_count()} cores: above the core count, other work shared the CPUs and the "
          "numbers are noisier.")
    failed = any(r.errors for by_c in results.values() for r in by_c.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
