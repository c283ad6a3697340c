"""The data stages of the one-machine flow: collect, clean and tokenize."""

from __future__ import annotations

import sys
from typing import Any

from olmoflow.artifacts import MANIFEST, StageResult, sha256_file
from olmoflow.errors import OlmoflowError
from olmoflow.pipeline.config import RunConfig
from olmoflow.pipeline.stage import Stage
from olmoflow.pipeline.stages.common import need, own_data, stage_dir


def run_collect(cfg: RunConfig, progress: bool) -> StageResult:
    from olmoflow.data.sources import collect

    return collect(cfg.collect, stage_dir(cfg, "collect"), progress=progress)


def run_clean(cfg: RunConfig, progress: bool) -> StageResult:
    from olmoflow.data.clean import clean

    docs = need(cfg, "collect", "documents.jsonl.gz")
    return clean(cfg.clean, docs, stage_dir(cfg, "clean"), progress=progress)


def run_tokenize(cfg: RunConfig, progress: bool) -> StageResult:
    from olmoflow.data.tokenize import tokenize
    from olmoflow.tokenizer import tokenizer_class

    docs = need(cfg, "clean", "documents.jsonl.gz")
    tok_dir = need(cfg, "train-tokenizer", MANIFEST).parent
    impl = cfg.tokenizer.implementation
    # The run's own tokenizer, even when train.data points training at other tokens.
    result = tokenize(cfg.tokenize, docs, tok_dir, stage_dir(cfg, "tokenize"), seed=cfg.seed,
                      progress=progress, tokenizer=tokenizer_class(impl).load(tok_dir),
                      implementation=impl)
    if not result.counts.get("heldout_documents"):
        # Held-out text is chosen by whole documents; fail here, before training, not at evaluate.
        raise OlmoflowError(
            "the held-out split is empty: the corpus has "
            f"{result.counts.get('train_documents', 0)} "
            "document(s) and held-out documents are whole documents; give at least 2 documents "
            "(e.g. a directory of .txt files or a .jsonl file)"
        )
    seq = cfg.eval_sequence_length
    if result.counts["heldout_tokens"] < seq + 1:
        raise OlmoflowError(
            f"the held-out split has {result.counts['heldout_tokens']} tokens, fewer than one "
            f"evaluation window of {seq + 1}; raise tokenize.heldout_fraction (or "
            "tokenize.heldout_max_documents), add data, or lower evaluate.sequence_length"
        )
    return result


def source_stamp(cfg: RunConfig) -> list[Any]:
    """Identity of the sources: the content hash of every file collect reads (an edit that keeps
    the size and the modification time still reruns collect), and the Python version for the
    stdlib."""
    from olmoflow.data.sources import source_files

    sources = cfg.collect.sources
    stamp: list[Any] = [["stdlib", sys.version]] if "stdlib" in sources else []
    files = source_files(sources, cfg.collect.follow_symlinks)
    return stamp + [[str(f), sha256_file(f)] for f in files]


COLLECT = Stage("collect", run_collect, ("collect",), (),
                ("documents", "bytes", "skipped_malformed", "damaged_files"),
                help="read the sources into Dolma documents", stamp=source_stamp, enabled=own_data)
def plugin_stamp(cfg: RunConfig) -> list[Any]:
    """The content hash of each plugin file of ``clean.plugins`` (their taggers shape what
    clean keeps: an edited plugin reruns it)."""
    from pathlib import Path

    return [[p, sha256_file(p) if Path(p).is_file() else None]
            for p in cfg.clean.plugins if p.endswith(".py")]


CLEAN = Stage("clean", run_clean, ("clean",), ("collect",),
              ("documents", "removed_too_short", "removed_too_long", "removed_duplicate"),
              help="length filters, the data engine's taggers and rules, exact deduplication",
              stamp=plugin_stamp, enabled=own_data)
TOKENIZE = Stage("tokenize", run_tokenize, ("tokenize", "seed"), ("clean", "train-tokenizer"),
                 ("train_tokens", "heldout_tokens", "train_documents", "heldout_documents"),
                 help="token arrays and the held-out split", enabled=own_data, directory="tokens")
