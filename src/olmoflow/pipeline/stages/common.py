"""What the stage functions share: the run's directories, its tokenizer, its trained model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from olmoflow.artifacts import MANIFEST, data_files
from olmoflow.errors import OlmoflowError
from olmoflow.pipeline.config import RunConfig
from olmoflow.pipeline.models import final_model_stage
from olmoflow.pipeline.stage import flow
from olmoflow.run_dir import RunDir

if TYPE_CHECKING:
    from olmoflow.data.tokenize import TokenDir


#: the directory under a stage's own where a stage whose record says ``own_tokenizer`` saves its
#: tokenizer (chat template, added tokens).
TOKENIZER = "tokenizer"


def stage_dir(cfg: RunConfig, name: str) -> Path:
    """The directory stage ``name`` writes in this run."""
    return RunDir(cfg.run_dir).stage(name)


def need(cfg: RunConfig, name: str, filename: str) -> Path:
    """Path of an upstream artifact, or an error telling the user which stage to run first."""
    return RunDir(cfg.run_dir).need(name, filename)


def data_dirs(cfg: RunConfig) -> list[str]:
    """The tokens directories ``train.data`` names (made by either flow); empty: the run's own."""
    return list(getattr(cfg.train, "data", None) or [])


def own_data(cfg: RunConfig) -> bool:
    """Whether the run makes its own tokens (collect .. tokenize are part of it): ``train.data``
    names none."""
    return not data_dirs(cfg)


def token_dirs(cfg: RunConfig) -> list[TokenDir]:
    """The tokens directories the run trains and evaluates on: those of ``train.data``, else the
    run's own ``tokens/``.

    Raises:
        OlmoflowError: a directory that is not a tokens directory (naming what is missing), or
            directories made with different tokenizers or dtypes.
    """
    from olmoflow.data.tokenize import open_token_dir

    external = data_dirs(cfg)
    if not external:
        need(cfg, "tokenize", "meta.json")  # the message names the stage to run first
        return [open_token_dir(stage_dir(cfg, "tokenize"), cfg.tokenizer.implementation)]
    dirs = [open_token_dir(d) for d in external]
    first, key = dirs[0], _tokenizer_key(dirs[0])
    for d in dirs[1:]:
        if _tokenizer_key(d) != key:
            raise OlmoflowError(f"train.data: '{d.root}' was tokenized with another tokenizer than "
                                f"'{first.root}' ({d.tokenizer_dir} vs {first.tokenizer_dir}); "
                                "one run trains on one tokenizer's ids")
        if d.dtype != first.dtype:
            raise OlmoflowError(f"train.data: '{d.root}' holds {d.dtype.name} tokens but "
                                f"'{first.root}' holds {first.dtype.name}")
    return dirs


def _tokenizer_key(d: TokenDir) -> tuple[str, str]:
    """What makes two tokenizers the same: the implementation and the content of its files."""
    from olmoflow.artifacts import sha256_file, sha256_json

    files = data_files(d.tokenizer_dir)
    return d.implementation, sha256_json([[f.relative_to(d.tokenizer_dir).as_posix(),
                                           sha256_file(f)] for f in files])


def tokenizer_dir(cfg: RunConfig) -> Path:
    """The directory of the run's tokenizer: that of the ``train.data`` tokens, else the run's own
    ``tokenizer/``."""
    if data_dirs(cfg):
        return token_dirs(cfg)[0].tokenizer_dir
    return need(cfg, "train-tokenizer", MANIFEST).parent


def load_tokenizer(cfg: RunConfig):
    """The run's tokenizer: the one that made the ``train.data`` tokens (of the implementation
    their ``meta.json`` records), else the run's trained one (``tokenizer.implementation``)."""
    if data_dirs(cfg):
        return token_dirs(cfg)[0].load_tokenizer(trusted=cfg.tokenizer.implementation)
    from olmoflow.tokenizer import tokenizer_class

    return tokenizer_class(cfg.tokenizer.implementation).load(tokenizer_dir(cfg))


def token_split(cfg: RunConfig, split: str) -> tuple[list[Path], np.dtype]:
    """The token arrays of ``split`` ("train" or "heldout") and their dtype: every directory of
    ``train.data`` in order, their arrays concatenated, else the run's own ``tokens/``.

    Raises:
        OlmoflowError: see :func:`token_dirs`; or no tokens in the split.
    """
    dirs = token_dirs(cfg)
    if len(dirs) == 1:
        return dirs[0].split(split), dirs[0].dtype
    paths = [p for d in dirs for p in (d.train if split == "train" else d.heldout)]
    if not paths:
        raise OlmoflowError(f"train.data: no {split} tokens in any of "
                            f"{', '.join(str(d.root) for d in dirs)}")
    return paths, dirs[0].dtype


def token_data_stamp(cfg: RunConfig) -> list[Any]:
    """Identity of the ``train.data`` tokens for a training stage's fingerprint (the run's own
    tokens are an upstream stage instead): per directory its manifest's fingerprint and output
    hashes, or, without a manifest, the sha256 of each of its files. Empty without ``train.data``.
    """
    from olmoflow.artifacts import read_manifest, sha256_file

    stamp: list[Any] = []
    for d in data_dirs(cfg):
        m = read_manifest(Path(d))
        if m is not None:
            stamp.append([d, m.get("fingerprint"), [[o["path"], o["sha256"]] for o in
                                                    m.get("outputs", [])]])
        else:
            stamp.append([d, [[str(f), sha256_file(f)] for f in data_files(d)]])
    return stamp


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


def model_inputs(cfg: RunConfig, ckpt: Path, stage: str | None = None) -> list[Path]:
    """The files a model-consuming stage reads: the checkpoint's and the tokenizer's (that of
    training stage ``stage``; default the run's final one)."""
    return data_files(ckpt) + data_files(final_tokenizer_dir(cfg, stage))


def final_tokenizer_dir(cfg: RunConfig, stage: str | None = None) -> Path:
    """The tokenizer of the model of training stage ``stage`` (default: the run's final one,
    :func:`final_model_stage`): a post-training stage's own (chat template, added tokens), else
    the run's."""
    stage = stage or final_model_stage(cfg)
    makes = flow()[stage].makes
    if makes is not None and makes.own_tokenizer:
        return stage_dir(cfg, stage) / TOKENIZER
    return tokenizer_dir(cfg)


def stage_tokenizer(cfg: RunConfig, stage: str):
    """The tokenizer of training stage ``stage``'s model (:func:`final_tokenizer_dir`), loaded
    with the run's ``tokenizer.implementation``."""
    from olmoflow.tokenizer import tokenizer_class

    makes = flow()[stage].makes
    if makes is None or not makes.own_tokenizer:
        return load_tokenizer(cfg)
    return tokenizer_class(cfg.tokenizer.implementation).load(final_tokenizer_dir(cfg, stage))


def load_trained_model(cfg: RunConfig, stage: str | None = None):
    """The model at the final checkpoint (``latest``) of training stage ``stage`` (default: the
    run's last enabled one, :func:`final_model_stage`), with that stage's tokenizer, read by
    the one loader (:func:`olmoflow.model.load.load_model`); ``(model, tokenizer, path)``."""
    from olmoflow.model.load import load_model
    from olmoflow.train.checkpoint import resolve_checkpoint

    stage = stage or final_model_stage(cfg)
    tok = stage_tokenizer(cfg, stage)
    path = resolve_checkpoint(stage_dir(cfg, stage), "latest")
    return load_model(path, tokenizer=tok).model, tok, path
