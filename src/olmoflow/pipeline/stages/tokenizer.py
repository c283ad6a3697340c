"""The tokenizer stage: train the run's tokenizer on its clean documents."""

from __future__ import annotations

from olmoflow.artifacts import StageResult
from olmoflow.pipeline.config import RunConfig
from olmoflow.pipeline.stage import Stage
from olmoflow.pipeline.stages.common import need, own_data, stage_dir


def run_train_tokenizer(cfg: RunConfig, progress: bool) -> StageResult:
    from olmoflow.data.documents import document_texts
    from olmoflow.tokenizer.train import train_tokenizer

    docs = need(cfg, "clean", "documents.jsonl.gz")
    return train_tokenizer(cfg.tokenizer, document_texts([docs]),
                           stage_dir(cfg, "train-tokenizer"), progress=progress, files=[docs])


TRAIN_TOKENIZER = Stage("train-tokenizer", run_train_tokenizer, ("tokenizer",), ("clean",),
                        ("vocab_size", "bytes_per_token"), help="train the BPE tokenizer",
                        enabled=own_data, directory="tokenizer")
