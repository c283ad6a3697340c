"""Training checkpoints: ``save_folder/stepN/`` with model + optimizer state through
``torch.distributed.checkpoint`` (so a run saved on N processes loads on M) and the trainer state.

A step directory is written under a temporary name and renamed when complete; ``latest`` (a text
file naming the newest complete step directory) is updated atomically after it. A crash mid-save
therefore never leaves a checkpoint that a resume would trust.
"""

from __future__ import annotations

import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from olmoflow.artifacts import atomic_write_text
from olmoflow.errors import OlmoflowError

LATEST = "latest"

# One process without init_process_group is a supported dcp mode, not a problem to warn about.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def rng_state() -> dict[str, Any]:
    """Every RNG state a training step can touch (Python, NumPy, torch CPU and CUDA)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(save_folder: Path, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, trainer_state: dict[str, Any],
                    config_yaml: str) -> Path:
    """Write ``save_folder/step{step}`` and point ``latest`` at it. Returns the directory."""
    save_folder = Path(save_folder)
    final = save_folder / f"step{step}"
    tmp = save_folder / f".step{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp / "model_and_optim"))
    torch.save({**trainer_state, "rng": rng_state()}, tmp / "trainer_state.pt")
    (tmp / "config.yaml").write_text(config_yaml)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    atomic_write_text(save_folder / LATEST, final.name + "\n")
    return final


def has_checkpoint(save_folder: Path) -> bool:
    """Whether ``resume_from="latest"`` would find a complete checkpoint in ``save_folder``."""
    try:
        resolve_checkpoint(save_folder, LATEST)
    except OlmoflowError:
        return False
    return True


def resolve_checkpoint(save_folder: Path, resume_from: str) -> Path:
    """``latest`` -> the newest complete step directory; otherwise a path (absolute or in the folder).

    Raises:
        OlmoflowError: nothing to resume from.
    """
    save_folder = Path(save_folder)
    if resume_from == LATEST:
        pointer = save_folder / LATEST
        if pointer.is_file() and (save_folder / pointer.read_text().strip() / "trainer_state.pt").is_file():
            return save_folder / pointer.read_text().strip()
        # The pointer is written last; without it, the newest complete step directory is latest.
        steps = [p for p in save_folder.glob("step*")
                 if p.name[4:].isdigit() and (p / "trainer_state.pt").is_file()]
        if not steps:
            raise OlmoflowError(f"resume_from=latest but '{save_folder}' has no complete checkpoint")
        return max(steps, key=lambda p: int(p.name[4:]))
    p = Path(resume_from)
    for cand in (p, save_folder / p):
        if (cand / "trainer_state.pt").is_file():
            return cand
    raise OlmoflowError(f"no checkpoint at '{resume_from}' (expected a stepN directory or 'latest')")


def load_checkpoint(path: Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore model, optimizer and RNG states from ``path``; return the trainer state."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(Path(path) / "model_and_optim"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    trainer_state = torch.load(Path(path) / "trainer_state.pt", weights_only=False)
    set_rng_state(trainer_state.pop("rng"))
    return trainer_state


def load_model(path: Path, model: torch.nn.Module) -> None:
    """Restore only the model weights from a step directory (evaluation, export, release)."""
    model_state = get_model_state_dict(model)
    state = {"model": model_state}
    dcp.load(state, checkpoint_id=str(Path(path) / "model_and_optim"))
    set_model_state_dict(model, state["model"])
