"""The training stages: pretraining."""

from __future__ import annotations

from pathlib import Path

from olmoflow.artifacts import StageResult, data_files
from olmoflow.pipeline.config import RunConfig, dump_config
from olmoflow.pipeline.stage import Makes, Stage, Trains
from olmoflow.pipeline.stages.common import (
    build_model,
    load_tokenizer,
    stage_dir,
    token_data_stamp,
    token_split,
)
from olmoflow.pipeline.stages.eval import in_loop_callback
from olmoflow.train.config import bookkeeping_keys


def pretrain_loader(cfg: RunConfig, tok):
    """``(dataset, loader, input paths)`` of the ``pretrain`` stage, built as it builds them (also
    by ``olmoflow reproduce`` and ``olmoflow data-order``, which must see the very same batches):
    the dataset ``train.packing`` names over the train split's token arrays, the seeded loader,
    and the files read (the arrays, and their document indexes when the packing or
    intra-document masking reads them).

    Raises:
        OlmoflowError: missing tokens, fewer instances than one batch.
    """
    from olmoflow.train.loader import DataLoader, build_dataset, index_path

    paths, dtype = token_split(cfg, "train")
    t = cfg.train
    dataset = build_dataset(t.packing, paths, dtype, t.sequence_length, cfg.seed,
                            t.intra_document_masking, pad_token_id=tok.pad_token_id)
    loader = DataLoader(dataset, t.global_batch_size, seed=cfg.seed,
                        intra_document_masking=t.intra_document_masking)
    if t.packing != "concat" or t.intra_document_masking:  # the document indexes are read too
        paths = paths + [index_path(p) for p in paths]
    return dataset, loader, paths


def pretrain_parts(cfg: RunConfig):
    """``(tokenizer, dataset, loader, model, input paths)`` of the ``pretrain`` stage: the
    run's tokenizer, :func:`pretrain_loader`, and the model (on the meta device and sharded under
    torchrun + FSDP).

    Raises:
        OlmoflowError: missing tokens or tokenizer, fewer instances than one batch.
    """
    from olmoflow.train.distributed import build_on_rank

    tok = load_tokenizer(cfg)
    dataset, loader, paths = pretrain_loader(cfg, tok)
    # Under torchrun + FSDP a model too big for every process is built on the meta device and
    # only this rank's shards are allocated; one process trains on the GPU when there is one.
    model = build_on_rank(lambda: build_model(cfg, tok.vocab_size),
                          cfg.train.parallel.method)
    return tok, dataset, loader, model, paths


def run_pretrain(cfg: RunConfig, progress: bool) -> StageResult:
    from olmoflow.train.trainer import METRICS, Trainer

    out = stage_dir(cfg, "pretrain")
    t = cfg.train
    tok, dataset, loader, model, paths = pretrain_parts(cfg)
    # In-loop evaluation loads its documents now: missing data fails before training starts.
    callbacks = [cb] if (cb := in_loop_callback(cfg, tok)) is not None else []
    trainer = Trainer(model, cfg.train, loader, out, config_yaml=dump_config(cfg),
                      progress=progress, callbacks=callbacks)
    summary = trainer.fit()
    final = Path(summary["checkpoint"])
    outputs = data_files(final) + [out / METRICS, out / "latest"]
    counts = {**summary, "parameters": model.num_params(), "instances": len(dataset),
              "packing_efficiency": round(dataset.packing_efficiency, 4),
              "epochs": round(summary["steps"] * t.global_batch_size / len(dataset), 3)}
    return StageResult(inputs=paths, outputs=outputs, counts=counts)


#: the pretraining stage's bookkeeping keys (see :data:`olmoflow.train.config.BOOKKEEPING_KEYS`).
TRAIN_BOOKKEEPING = bookkeeping_keys("train")

PRETRAIN = Stage("pretrain", run_pretrain, ("model", "train", "seed"), ("tokenize",),
                 ("parameters", "steps", "tokens", "final_loss", "packing_efficiency"),
                 help="pretrain the model", ignore=TRAIN_BOOKKEEPING, stamp=token_data_stamp,
                 trains=Trains(resume_key="train.checkpoint.resume_from",
                               resume_alias="resume_from"),
                 makes=Makes(sequence_length="train.sequence_length"))
