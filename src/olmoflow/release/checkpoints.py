"""The intermediate checkpoints of a release: every checkpoint a training stage kept, as OLMo
publishes its ``stage1-step1000-tokens4B`` revisions.

With ``release.include_checkpoints`` (the default) each kept checkpoint of each training stage
(pretraining, then the enabled post-training stages) is exported in Hugging Face layout to
``checkpoints/<name>/`` (weights, config, tokenizer: each loads on its own with
``Olmo.from_pretrained`` or ``transformers``). Without it the bundle references each checkpoint by
its path in the run directory and the sha256 of its ``checksums.json`` (which holds the sha256 of
every file of the checkpoint). Either way ``checkpoints.csv`` lists them from the stages' own
indexes (``<stage>/checkpoints.csv``, written as each checkpoint was saved): stage, step, tokens,
name, training loss, where it is, its size in the run directory (model and optimizer state) and
in the bundle (the weights alone), and the sha256 of each of its files.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from olmoflow.artifacts import sha256_file
from olmoflow.run_dir import RunDir

FIELDS = ("stage", "step", "tokens", "name", "loss", "path", "checkpoint_bytes", "export_bytes",
          "sha256")


@dataclass
class CheckpointEntry:
    """One kept checkpoint of one training stage, as ``checkpoints.csv`` lists it."""

    stage: str
    step: int
    tokens: int
    name: str
    loss: str
    source: Path  # the checkpoint directory in the run
    path: str = ""  # in the bundle (checkpoints/<name>) or, referenced, relative to the run
    checkpoint_bytes: int = 0
    export_bytes: int = 0
    sha256: str = ""  # "file=hash" pairs separated by spaces

    def row(self) -> list[str | int]:
        return [self.stage, self.step, self.tokens, self.name, self.loss, self.path,
                self.checkpoint_bytes, self.export_bytes, self.sha256]


def _dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def _hashes(d: Path, names: list[str] | None = None) -> str:
    files = sorted(p for p in d.rglob("*") if p.is_file()) if names is None else \
        [d / n for n in names]
    return " ".join(f"{p.relative_to(d).as_posix()}={sha256_file(p)}" for p in files)


def kept_checkpoints(runs: RunDir, stages: list[str]) -> list[CheckpointEntry]:
    """The checkpoints each of ``stages`` kept (its index's ``kept`` rows whose directory still
    exists), stage by stage, oldest first."""
    from olmoflow.train.checkpoint import read_index

    out = []
    for stage in stages:
        folder = runs.stage(stage)
        for row in read_index(folder):
            if row.get("status", "kept") != "kept" or not (folder / row["name"]).is_dir():
                continue
            out.append(CheckpointEntry(stage, int(row["step"]), int(row["tokens"] or 0),
                                       row["name"], row.get("loss") or "", folder / row["name"]))
    return out


def release_checkpoints(runs: RunDir, tokenizers: dict[str, tuple[Any, Path]], out: Path, *,
                        include: bool) -> list[CheckpointEntry]:
    """Export (``include``) or reference every kept checkpoint of the training stages
    ``tokenizers`` names (in its order; each with its ``(tokenizer, directory)``: a post-training
    stage's tokenizer may have grown) into the bundle at ``out``; returns the entries, their
    paths, sizes and hashes filled.

    Raises:
        OlmoflowError: a checkpoint that does not load or whose files changed since it was saved.
    """
    from olmoflow.model.load import load_model
    from olmoflow.release.export import write_model_dir
    from olmoflow.train.checkpoint_verify import verify_checkpoint

    entries = kept_checkpoints(runs, list(tokenizers))
    for e in entries:
        e.checkpoint_bytes = _dir_bytes(e.source)
        if include:
            dst = out / "checkpoints" / e.name
            tok, tok_dir = tokenizers[e.stage]  # load_model verifies its files first
            write_model_dir(load_model(e.source, tokenizer=tok).model, dst, tok_dir, tok=tok,
                            manifest={"command": "olmoflow release", "stage": e.stage,
                                      "source": str(e.source.resolve()), "source_kind": "step"})
            e.path = dst.relative_to(out).as_posix()
            e.export_bytes = _dir_bytes(dst)
            e.sha256 = _hashes(dst)
        else:
            verify_checkpoint(e.source)
            e.path = e.source.relative_to(runs.root).as_posix()
            checksums = e.source / "checksums.json"
            e.sha256 = _hashes(e.source, ["checksums.json"]) if checksums.is_file() else ""
    return entries


def checkpoints_table(entries: list[CheckpointEntry]) -> str:
    """``checkpoints.csv`` of the entries (header :data:`FIELDS`)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(FIELDS)
    for e in entries:
        w.writerow(e.row())
    return buf.getvalue()
