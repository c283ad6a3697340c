"""Builders shared by the trainer tests, and the fresh process of the resume tests.

Run as a script (``python resume_helpers.py SPEC_JSON``) this module is the second half of a
stopped run in a new process: it builds model, loader and trainer from the spec exactly as the
first process did, resumes from ``latest``, trains to ``max_steps`` and saves its weights, every
optimizer-state tensor and its position to ``spec["out"]``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from olmoflow.config import from_dict, set_dotted
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo
from olmoflow.train.config import TrainConfig
from olmoflow.train.loader import DataLoader, InstanceDataset
from olmoflow.train.trainer import METRICS, Trainer

VOCAB = 64
SEQ = 8


def tiny_model_config(**kw) -> ModelConfig:
    base = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, mlp_hidden=64,
                max_sequence_length=64, sliding_window=None)
    return ModelConfig(**{**base, **kw})


def build_model(seed: int = 0, **kw) -> Olmo:
    torch.manual_seed(seed)
    return Olmo(tiny_model_config(**kw))


def parse_train_config(**kw) -> TrainConfig:
    """A TrainConfig through the config parser; a key ``section__key`` is ``train.section.key``
    (``checkpoint__save_interval=2``), so a spec stays a flat, JSON-friendly dict."""
    tree: dict = {}
    for key, value in kw.items():
        set_dotted(tree, key.replace("__", "."), value)
    return from_dict(TrainConfig, tree, "train.")


def train_config(**kw) -> TrainConfig:
    """The trainer tests' config: :func:`parse_train_config` of these defaults and ``kw``."""
    base = dict(sequence_length=SEQ, global_batch_size=4, micro_batch_size=2, max_steps=20,
                optimizer__lr=1e-2, schedule__warmup_steps=3, schedule__type="cosine",
                checkpoint__save_interval=10, log__interval=1, num_threads=1)
    return parse_train_config(**{**base, **kw})


def token_arrays(n_tokens: int, n_arrays: int = 3, seed: int = 0) -> list[np.ndarray]:
    """Random token arrays of uneven sizes that add up to ``n_tokens``."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, n_tokens), n_arrays - 1, replace=False))
    tokens = rng.integers(0, VOCAB, n_tokens).astype(np.uint16)
    return [a for a in np.split(tokens, cuts)]


def dataset(n_instances: int, seq: int = SEQ) -> InstanceDataset:
    """A dataset of exactly ``n_instances`` instances of ``seq + 1`` tokens."""
    ds = InstanceDataset(token_arrays(n_instances * seq + 1), seq)
    assert len(ds) == n_instances
    return ds


def read_metrics(folder: Path) -> dict[int, dict]:
    text = (Path(folder) / METRICS).read_text()
    rows = [json.loads(ln) for ln in text.splitlines() if ln.strip()]
    by_step = {r["step"]: r for r in rows}
    assert len(by_step) == len(rows), "a step was logged twice"
    return by_step


def make_trainer(folder: Path, n_instances: int, dropout: float, **cfg_kw) -> Trainer:
    """Fresh model, loader and trainer: what a new process would build."""
    loader = DataLoader(dataset(n_instances), train_config(**cfg_kw).global_batch_size, seed=7)
    model = build_model(seed=0, dropout=dropout)
    return Trainer(model, train_config(**cfg_kw), loader, folder, config_yaml="x: 1\n",
                   progress=False)


def optimizer_state(trainer: Trainer) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor of the optimizer state (AdamW moments and step, Muon momentum) by parameter."""
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    out = {names[id(p)]: {k: v.detach().clone() for k, v in st.items() if torch.is_tensor(v)}
           for p, st in trainer.optimizer.state.items()}
    assert len(out) == len(names)
    return out


class Crash(Exception):
    pass


def run_until_crash(folder: Path, n_instances: int, dropout: float, crash_at: int, **cfg_kw):
    """Train, crashing while fetching the batch of step ``crash_at`` (after the checkpoint at
    ``save_interval`` and a few logged steps a resume must drop)."""
    first = make_trainer(folder, n_instances, dropout, **cfg_kw)
    fetch = first.loader.next_batch
    calls = []

    def crash():
        calls.append(1)
        if len(calls) == crash_at:
            raise Crash
        return fetch()

    first.loader.next_batch = crash
    try:
        first.fit()
    except Crash:
        return first
    raise AssertionError(f"the run did not reach step {crash_at}")


def resume_in_fresh_process(folder: Path, n_instances: int, dropout: float, **cfg_kw) -> dict:
    """Resume ``folder`` from ``latest`` in a new Python process; return what it saved."""
    out = Path(folder) / "fresh_process_result.pt"
    spec = {"folder": str(folder), "n_instances": n_instances, "dropout": dropout,
            "cfg": cfg_kw, "out": str(out)}
    proc = subprocess.run([sys.executable, __file__, json.dumps(spec)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


def _child(spec: dict) -> None:
    torch.set_num_threads(1)
    # A fresh process starts from other global RNG states; resume must restore them.
    torch.manual_seed(12345)
    np.random.seed(12345)
    t = make_trainer(Path(spec["folder"]), spec["n_instances"], spec["dropout"],
                     **{**spec["cfg"], "checkpoint__resume_from": "latest"})
    t.fit()
    torch.save({"weights": t.model.state_dict(), "optimizer": optimizer_state(t), "step": t.step,
                "tokens_seen": t.tokens_seen, "loader": t.loader.state_dict()}, spec["out"])


def assert_resume_exact(straight: Trainer, straight_dir: Path, resumed: dict, resumed_dir: Path,
                        resume_step: int) -> None:
    """Losses, grad norms, lr, epochs and tokens of every step after ``resume_step``, final
    weights, every optimizer tensor and the loader position are bit-identical."""
    a, b = read_metrics(straight_dir), read_metrics(resumed_dir)
    n = straight.cfg.max_steps
    assert sorted(a) == sorted(b) == list(range(1, n + 1))
    for step in range(resume_step + 1, n + 1):
        for key in ("loss", "lr", "grad_norm", "epoch", "tokens", "skipped"):
            assert b[step][key] == a[step][key], f"{key} differs at step {step}"
    assert resumed["step"] == straight.step == n
    assert resumed["tokens_seen"] == straight.tokens_seen
    assert resumed["loader"] == straight.loader.state_dict()
    sa = straight.model.state_dict()
    assert sa.keys() == resumed["weights"].keys()
    for k in sa:
        assert torch.equal(sa[k], resumed["weights"][k]), f"weight {k} differs"
    oa, ob = optimizer_state(straight), resumed["optimizer"]
    assert oa.keys() == ob.keys()
    for name in oa:
        assert oa[name].keys() == ob[name].keys() and oa[name], name
        for k in oa[name]:
            assert torch.equal(oa[name][k], ob[name][k]), f"optimizer {k} of {name} differs"


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
