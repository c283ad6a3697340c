"""The stages of the flow, each a function ``(cfg, run_dir, progress) -> StageResult``.

A stage reads only the artifact directories of the stages before it (under ``run_dir``) and
writes only its own. Orchestration (fingerprints, skipping, manifests) lives in
:mod:`olmoflow.pipeline`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from olmoflow.artifacts import MANIFEST, StageResult, atomic_write_json, atomic_write_text, data_files
from olmoflow.config import RunConfig, dump_config
from olmoflow.errors import OlmoflowError


@dataclass(frozen=True)
class Stage:
    """A stage: its CLI verb, its directory under run_dir, the config sections and upstream
    stages that determine its output."""

    name: str
    dir: str
    sections: tuple[str, ...]
    upstream: tuple[str, ...]


STAGES = [
    Stage("collect", "collect", ("collect",), ()),
    Stage("clean", "clean", ("clean",), ("collect",)),
    Stage("train-tokenizer", "tokenizer", ("tokenizer",), ("clean",)),
    Stage("tokenize", "tokens", ("tokenize", "seed"), ("clean", "train-tokenizer")),
    Stage("pretrain", "pretrain", ("model", "train", "seed"), ("tokenize",)),
    Stage("evaluate", "eval", ("evaluate",), ("pretrain",)),
    Stage("generate", "generate", ("generate",), ("pretrain",)),
    Stage("release", "release", ("release",), ("pretrain", "evaluate")),
]
BY_NAME = {s.name: s for s in STAGES}


def stage_dir(cfg: RunConfig, name: str) -> Path:
    return Path(cfg.run_dir) / BY_NAME[name].dir


def need(cfg: RunConfig, name: str, filename: str) -> Path:
    """Path of an upstream artifact, or an error telling the user which stage to run first."""
    p = stage_dir(cfg, name) / filename
    if not p.exists():
        raise OlmoflowError(f"'{p}' is missing; run 'olmoflow {name}' (or 'olmoflow run') first")
    return p


def run_collect(cfg: RunConfig, progress: bool) -> StageResult:
    from olmoflow.data.sources import collect

    return collect(cfg.collect, stage_dir(cfg, "collect"), progress=progress)


def run_clean(cfg: RunConfig, progress: bool) -> StageResult:
    from olmoflow.data.clean import clean

    docs = need(cfg, "collect", "documents.jsonl.gz")
    return clean(cfg.clean, docs, stage_dir(cfg, "clean"), progress=progress)


def run_train_tokenizer(cfg: RunConfig, progress: bool) -> StageResult:
    from olmoflow.tokenizer.train import train_tokenizer

    docs = need(cfg, "clean", "documents.jsonl.gz")
    return train_tokenizer(cfg.tokenizer, docs, stage_dir(cfg, "train-tokenizer"), progress=progress)


def run_tokenize(cfg: RunConfig, progress: bool) -> StageResult:
    from olmoflow.data.tokenize import tokenize

    docs = need(cfg, "clean", "documents.jsonl.gz")
    tok_dir = need(cfg, "train-tokenizer", MANIFEST).parent
    result = tokenize(cfg.tokenize, docs, tok_dir, stage_dir(cfg, "tokenize"), seed=cfg.seed,
                      progress=progress, tokenizer=load_tokenizer(cfg))
    if not result.counts.get("heldout_documents"):
        # Held-out text is chosen by whole documents; fail here, before training, not at evaluate.
        raise OlmoflowError(
            f"the held-out split is empty: the corpus has {result.counts.get('train_documents', 0)} "
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


def load_tokenizer(cfg: RunConfig):
    """The run's trained tokenizer, of the class ``tokenizer.implementation`` names."""
    from olmoflow.tokenizer import tokenizer_class

    return tokenizer_class(cfg.tokenizer.implementation).load(need(cfg, "train-tokenizer", MANIFEST).parent)


def token_split(cfg: RunConfig, split: str) -> tuple[list[Path], np.dtype]:
    """The token arrays of ``split`` ("train" or "heldout") and their dtype."""
    meta = json.loads(need(cfg, "tokenize", "meta.json").read_text())
    paths = sorted((stage_dir(cfg, "tokenize") / split).glob("*.npy"))
    if not paths:
        raise OlmoflowError(f"no token arrays in '{stage_dir(cfg, 'tokenize') / split}'")
    return paths, np.dtype(meta["dtype"])


def build_model(cfg: RunConfig, tokenizer_vocab: int):
    """The model of ``cfg.model`` with its vocab padded from the tokenizer's (seeded init)."""
    from dataclasses import replace

    from olmoflow.model.olmo import Olmo

    mc = cfg.model
    if mc.vocab_size <= 0:
        mc = replace(mc, vocab_size=mc.padded_vocab_size(tokenizer_vocab))
    elif mc.vocab_size < tokenizer_vocab:
        raise OlmoflowError(f"model.vocab_size={mc.vocab_size} is smaller than the tokenizer's "
                            f"vocabulary ({tokenizer_vocab})")
    torch.manual_seed(cfg.seed)
    return Olmo(mc)


def model_inputs(cfg: RunConfig, ckpt: Path) -> list[Path]:
    """The files a model-consuming stage reads: the checkpoint's and the tokenizer's."""
    return data_files(ckpt) + data_files(stage_dir(cfg, "train-tokenizer"))


def load_trained_model(cfg: RunConfig):
    """The model at the final pretraining checkpoint (``pretrain/latest``)."""
    from olmoflow.export import load_step_model
    from olmoflow.train.checkpoint import resolve_checkpoint

    tok = load_tokenizer(cfg)
    path = resolve_checkpoint(stage_dir(cfg, "pretrain"), "latest")
    return load_step_model(path, tok.vocab_size), tok, path


def run_pretrain(cfg: RunConfig, progress: bool) -> StageResult:
    from olmoflow.data.loader import DataLoader, build_dataset, index_path
    from olmoflow.train.distributed import build_on_rank
    from olmoflow.train.trainer import METRICS, Trainer

    out = stage_dir(cfg, "pretrain")
    tok = load_tokenizer(cfg)
    paths, dtype = token_split(cfg, "train")
    t = cfg.train
    dataset = build_dataset(t.packing, paths, dtype, t.sequence_length, cfg.seed,
                            t.intra_document_masking, pad_token_id=tok.pad_token_id)
    loader = DataLoader(dataset, t.global_batch_size, seed=cfg.seed,
                        intra_document_masking=t.intra_document_masking)
    if t.packing != "concat" or t.intra_document_masking:  # the document indexes are read too
        paths = paths + [index_path(p) for p in paths]
    # Under torchrun + FSDP a model too big for every process is built on the meta device and
    # only this rank's shards are allocated; one process trains on the GPU when there is one.
    model = build_on_rank(lambda: build_model(cfg, tok.vocab_size), t.data_parallel)
    trainer = Trainer(model, cfg.train, loader, out, config_yaml=dump_config(cfg), progress=progress)
    summary = trainer.fit()
    final = Path(summary["checkpoint"])
    outputs = data_files(final) + [out / METRICS, out / "latest"]
    counts = {**summary, "parameters": model.num_params(), "instances": len(dataset),
              "packing_efficiency": round(dataset.packing_efficiency, 4),
              "epochs": round(summary["steps"] * t.global_batch_size / len(dataset), 3)}
    return StageResult(inputs=paths, outputs=outputs, counts=counts)


def run_evaluate(cfg: RunConfig, progress: bool) -> StageResult:
    from olmoflow.data.loader import open_token_arrays
    from olmoflow.eval.perplexity import evaluate_tokens

    model, tok, ckpt = load_trained_model(cfg)
    paths, dtype = token_split(cfg, "heldout")
    tokens = np.concatenate([np.asarray(a) for a in open_token_arrays(paths, dtype)] or [np.zeros(0)])
    seq = cfg.eval_sequence_length
    try:
        report = evaluate_tokens(lambda x: model(x).logits, tokens, tok.token_byte_lengths(),
                                 sequence_length=seq, batch_size=cfg.evaluate.batch_size,
                                 max_tokens=cfg.evaluate.max_tokens)
    except ValueError as e:
        raise OlmoflowError(f"evaluate: {e}; lower evaluate.sequence_length") from None
    report = {"checkpoint": ckpt.name, "split": "heldout", "sequence_length": seq, **report}
    out = stage_dir(cfg, "evaluate")
    atomic_write_json(out / "report.json", report)
    md = ["| metric | value |", "|---|---|"] + [
        f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in report.items()
    ]
    atomic_write_text(out / "report.md", "# Held-out evaluation\n\n" + "\n".join(md) + "\n")
    return StageResult(inputs=paths + model_inputs(cfg, ckpt), outputs=[out / "report.json", out / "report.md"],
                       counts=report)


def run_generate(cfg: RunConfig, progress: bool) -> StageResult:
    model, tok, ckpt = load_trained_model(cfg)
    g = cfg.generate
    samples = []
    if g.max_new_tokens < 0:
        raise OlmoflowError(f"generate.max_new_tokens must be >= 0, got {g.max_new_tokens}")
    for i, prompt in enumerate(g.prompts):
        # An empty prompt starts a fresh document: the model's context is a document boundary.
        ids = torch.tensor([tok.encode(prompt) or [tok.eos_token_id]])
        out = model.generate(ids, max_new_tokens=g.max_new_tokens, do_sample=g.temperature > 0,
                             temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                             repetition_penalty=g.repetition_penalty,
                             eos_token_id=tok.eos_token_id, seed=g.seed + i,
                             vocab_size=tok.vocab_size)
        samples.append({"prompt": prompt, "completion": tok.decode(out[0, ids.shape[1]:].tolist())})
    out_dir = stage_dir(cfg, "generate")
    atomic_write_text(out_dir / "samples.jsonl", "".join(json.dumps(s) + "\n" for s in samples))
    return StageResult(inputs=model_inputs(cfg, ckpt), outputs=[out_dir / "samples.jsonl"],
                       counts={"samples": len(samples), "checkpoint": ckpt.name})


def run_release(cfg: RunConfig, progress: bool) -> StageResult:
    from olmoflow.release.bundle import build_release

    model, tok, ckpt = load_trained_model(cfg)
    return build_release(cfg, model, tok, ckpt, stage_dir(cfg, "release"))


RUNNERS = {
    "collect": run_collect, "clean": run_clean, "train-tokenizer": run_train_tokenizer,
    "tokenize": run_tokenize, "pretrain": run_pretrain, "evaluate": run_evaluate,
    "generate": run_generate, "release": run_release,
}
