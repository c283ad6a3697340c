"""What the stage functions share: the run's directories, its tokenizer, its trained model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from olmoflow.artifacts import MANIFEST, data_files
from olmoflow.errors import OlmoflowError
from olmoflow.pipeline.config import RunConfig
from olmoflow.run_dir import RunDir


def stage_dir(cfg: RunConfig, name: str) -> Path:
    """The directory stage ``name`` writes in this run."""
    return RunDir(cfg.run_dir).stage(name)


def need(cfg: RunConfig, name: str, filename: str) -> Path:
    """Path of an upstream artifact, or an error telling the user which stage to run first."""
    return RunDir(cfg.run_dir).need(name, filename)


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
