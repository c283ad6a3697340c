"""A run directory made in seconds, with a model saved in every form the loader reads.

:func:`saved_run` writes what a finished run holds for its readers (no data stages): the run's
``config.yaml`` (the ``tiny`` preset, vocabulary sized from the tokenizer), its tokenizer, one
pretraining checkpoint with checksums and ``latest``, and a release exported from it (with the
run's ``config.yaml``, as ``olmoflow release`` writes it).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

TEXTS = [
    "def main():\n    return 0\n\nimport os\nimport sys\nfor x in range(3):\n    print(x)\n",
    "The cat sat on the mat. What is 2+2? It is 4. Hello world, and more words about code.",
    "class Foo:\n    def bar(self, a, b):\n        return a + b  # add them\n",
]
#: the training sequence length the saved run records (the tiny preset's model has 256 positions)
TRAINED = 48


@dataclass
class SavedRun:
    """Where :func:`saved_run` put things, and the model it saved."""

    root: Path
    step: Path
    release: Path
    model: torch.nn.Module
    vocab: int


def saved_run(root: Path) -> SavedRun:
    """Write the run at ``root`` (see the module docstring)."""
    from olmoflow.artifacts import atomic_write_json
    from olmoflow.pipeline.config import dump_config, load_config
    from olmoflow.pipeline.stages.common import build_model
    from olmoflow.release.export import export_hf
    from olmoflow.run_dir import claim_directory
    from olmoflow.tokenizer import BPETokenizer
    from olmoflow.train.checkpoint import save_checkpoint

    cfg = load_config("tiny", values={"run_dir": str(root), "train.sequence_length": TRAINED})
    assert cfg.model.vocab_size == 0  # sized from the tokenizer when the model is built
    text = dump_config(cfg)
    claim_directory(root)  # olmoflow's run: its stages may rewrite their directories
    (root / "config.yaml").write_text(text)
    tok = BPETokenizer().train_from_texts(TEXTS * 4, vocab_size=300)
    tok.save(root / "tokenizer")
    atomic_write_json(root / "tokenizer" / "manifest.json", {"stage": "train-tokenizer"})
    model = build_model(cfg, tok.vocab_size).eval()
    optimizer = torch.optim.AdamW(model.parameters())
    step = save_checkpoint(root / "pretrain", 2, model, optimizer,
                           {"step": 2, "tokens_seen": 2 * TRAINED}, text)
    release = export_hf(step, root / "release")
    shutil.copyfile(root / "config.yaml", release / "config.yaml")
    return SavedRun(root, step, release, model, tok.vocab_size)


def copy_release(run: SavedRun, dest: Path) -> Path:
    """A copy of the run's release at ``dest`` (to damage without touching the shared one)."""
    shutil.copytree(run.release, dest)
    return dest
