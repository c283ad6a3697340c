"""How much does the BPE's pre-tokenizer split matter? cl100k (OLMo 2/3's) against GPT-2's.

Trains two byte-level BPE tokenizers of the config's vocab size on the same clean documents, one
per split (``tokenizer.pre_tokenizer``), and encodes every document with each. Prints bytes per
token on the whole corpus (in-sample: a sanity number, not an evaluation), and whether a few
whitespace tokens that matter for code and prose were learned.

Usage:  python benchmarks/tokenizer_split.py [--config demo] [key=value ...]

The collect and clean stages are reused from the config's run_dir when complete. The last line is
``ratio (cl100k/gpt2) = X`` for bytes per token: X > 1.0 means the cl100k split compresses better.
"""

from __future__ import annotations

import argparse
import time

from olmoflow.data.documents import read_documents
from olmoflow.pipeline.config import load_config
from olmoflow.pipeline.runner import run_pipeline
from olmoflow.pipeline.stages.common import stage_dir
from olmoflow.tokenizer import BPETokenizer

# Token texts whose presence the table reports (printed with escapes).
PROBES = ["\n\n", "\n    ", "    ", "        ", ".\n\n", ":\n"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="demo")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    run_pipeline(cfg, stages=["collect", "clean"], progress=False)
    texts = [d["text"] for d in read_documents(stage_dir(cfg, "clean") / "documents.jsonl.gz")]
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    t = cfg.tokenizer
    rows = {}
    for split in ("gpt2", "cl100k"):
        started = time.time()
        tok = BPETokenizer(eos_token=t.eos_token, pad_token=t.pad_token, pre_tokenizer=split)
        tok.train_from_texts(texts, vocab_size=t.vocab_size, min_frequency=t.min_frequency)
        n_tokens = sum(len(ids) for ids in tok.encode_batch(texts))
        vocab = tok.backend.get_vocab()
        # Byte-level token texts spell "\n" as "Ċ" and " " as "Ġ".
        has = [p.replace("\n", "Ċ").replace(" ", "Ġ") in vocab for p in PROBES]
        rows[split] = (n_bytes / n_tokens, n_tokens, has, time.time() - started)
    print(f"{len(texts)} documents, {n_bytes:,} bytes, vocab_size {t.vocab_size}")
    head = " ".join(f"{p!r:>12}" for p in PROBES)
    print(f"{'split':<8} {'bytes/token':>11} {'tokens':>10} {'seconds':>8} {head}")
    for split, (bpt, n, has, secs) in rows.items():
        marks = " ".join(f"{'yes' if h else 'no':>12}" for h in has)
        print(f"{split:<8} {bpt:>11.4f} {n:>10,} {secs:>8.1f} {marks}")
    print(f"ratio (cl100k/gpt2) = {rows['cl100k'][0] / rows['gpt2'][0]:.4f}")


if __name__ == "__main__":
    main()
