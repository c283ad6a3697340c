"""A checkpoint is loaded only as it was saved: its trainer state is plain data read with
``torch.load(weights_only=True)`` (a pickled object in it is refused and never runs), and every file
is checked against the sha256 recorded at save time before anything is unpickled (dcp reads
``.metadata`` with pickle). Checkpoints of older olmoflow versions (RNG states as NumPy/Python
tuples, no checksums) still load, with one warning.
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from checks import tree
from resume_helpers import build_model, dataset, make_trainer, read_metrics, train_config
from test_cli import assert_one_line_error, cli, doc_text, write_jsonl

from olmoflow.errors import OlmoflowError
from olmoflow.model.checkpoint_files import CHECKSUMS
from olmoflow.model.checkpoint_files import load_weights as load_model
from olmoflow.train.checkpoint import (
    LATEST,
    TRAINER_STATE,
    list_checkpoints,
    read_trainer_state,
    resolve_checkpoint,
    rng_state,
    set_rng_state,
    write_checksums,
)
from olmoflow.train.loader import DataLoader
from olmoflow.train.trainer import Trainer

KW = dict(max_steps=4, checkpoint__save_interval=2)


class Payload:
    """What an attacker pickles: unpickling it calls ``exec``, which writes ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def craft_trainer_state(ckpt: Path, marker: Path, *, rehash: bool) -> None:
    """Replace the trainer state of ``ckpt`` by one that runs code when unpickled; ``rehash``:
    and record its sha256, as an attacker who knows the format would."""
    state = read_trainer_state(ckpt)
    torch.save({**state, "extra": Payload(marker)}, ckpt / TRAINER_STATE)
    if rehash:
        write_checksums(ckpt)


def saved_run(folder: Path, dropout: float = 0.0) -> Path:
    """A 4-step run saved at steps 2 and 4: its newest checkpoint."""
    make_trainer(folder, 27, dropout, **KW).fit()
    return resolve_checkpoint(folder, LATEST)


def resume(folder: Path, resume_from: str = "latest", dropout: float = 0.0, max_steps: int = 4):
    return make_trainer(folder, 27, dropout, **{**KW, "max_steps": max_steps},
                        checkpoint__resume_from=resume_from).fit()


def test_the_trainer_state_is_plain_data(tmp_path):
    ckpt = saved_run(tmp_path)
    state = torch.load(ckpt / TRAINER_STATE, weights_only=True)  # no allow-listed globals
    assert isinstance(state["rng"]["python"]["state"], torch.Tensor)
    assert isinstance(state["rng"]["numpy"]["key"], torch.Tensor)
    recorded = json.loads((ckpt / CHECKSUMS).read_text())["files"]
    assert TRAINER_STATE in recorded and "model_and_optim/.metadata" in recorded
    assert "config.yaml" in recorded and CHECKSUMS not in recorded


@pytest.mark.parametrize("rehash", [True, False], ids=["checksums-rewritten", "checksums-kept"])
def test_a_pickled_object_in_the_trainer_state_is_refused_and_never_runs(tmp_path, rehash):
    ckpt = saved_run(tmp_path / "run")
    marker = tmp_path / "marker"
    craft_trainer_state(ckpt, marker, rehash=rehash)
    with pytest.raises(OlmoflowError) as e:
        resume(tmp_path / "run")
    msg = str(e.value)
    assert "\n" not in msg and f"checkpoint '{ckpt}' cannot be read" in msg
    assert ("pickled Python object, exec" in msg if rehash
            else f"{TRAINER_STATE}: changed" in msg), msg
    assert not marker.exists()  # was: the payload ran on resume


def test_the_cli_refuses_a_crafted_checkpoint_with_one_line(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": doc_text(i) * 4} for i in range(40)])
    args = ["tiny", "--data", str(corpus), "--run-dir", str(tmp_path / "run"), "--no-progress",
            "train.max_steps=2", "train.num_threads=1"]
    for verb in ("collect", "clean", "train-tokenizer", "tokenize", "pretrain"):
        assert cli(capsys, verb, *args)[0] == 0
    pretrain = tmp_path / "run" / "pretrain"
    marker = tmp_path / "marker"
    craft_trainer_state(resolve_checkpoint(pretrain, LATEST), marker, rehash=True)
    rc, _, err = cli(capsys, "pretrain", *args, "train.max_steps=3", "resume_from=latest")
    assert_one_line_error(rc, err, "pickled Python object, exec")
    assert not marker.exists()


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def shard(ckpt: Path) -> Path:
    return next((ckpt / "model_and_optim").glob("*.distcp"))


TAMPER = {
    # name: (change, the file the error names, what it says)
    "shard byte": (lambda c: flip_byte(shard(c)), "__0_0.distcp", "sha256 differs"),
    "metadata byte": (lambda c: flip_byte(c / "model_and_optim" / ".metadata"),
                      "model_and_optim/.metadata", "sha256 differs"),
    "trainer_state byte": (lambda c: flip_byte(c / TRAINER_STATE), TRAINER_STATE,
                           "sha256 differs"),
    "config edited": (lambda c: (c / "config.yaml").write_text("x: 22\n"), "config.yaml",
                      "bytes"),
    "shard deleted": (lambda c: shard(c).unlink(), "__0_0.distcp", "missing"),
    "file added": (lambda c: (c / "model_and_optim" / "__9_0.distcp").write_bytes(b"x"),
                   "model_and_optim/__9_0.distcp", f"not in {CHECKSUMS}"),
    "odd name added": (lambda c: (c / "a\nb").write_bytes(b"x"), "'a\\nb'", "added"),
    "link added": (lambda c: (c / "extra").symlink_to(c / "config.yaml"), "extra",
                   "symbolic link"),
    "checksums garbled": (lambda c: (c / CHECKSUMS).write_text("{"), CHECKSUMS, ""),
}


@pytest.mark.parametrize("tamper", list(TAMPER))
def test_a_changed_checkpoint_is_refused_naming_the_file(tmp_path, tamper):
    change, name, why = TAMPER[tamper]
    ckpt = saved_run(tmp_path)
    older = list_checkpoints(tmp_path)[0]
    change(ckpt)
    with pytest.raises(OlmoflowError) as e:
        resume(tmp_path, max_steps=6)
    msg = str(e.value)
    assert "\n" not in msg and f"checkpoint '{ckpt}' cannot be read" in msg
    assert name in msg and why in msg and f"resume_from={older.name}" in msg, msg
    # export, evaluate, generate and release load the weights through load_model: refused too.
    with pytest.raises(OlmoflowError, match="cannot be read"):
        load_model(ckpt, build_model())
    # The untouched older one still resumes.
    assert resume(tmp_path, older.name)["steps"] == 4


def to_old_format(ckpt: Path) -> None:
    """Make ``ckpt`` what olmoflow wrote before: RNG states as the tuples of random/np.random
    (a pickled NumPy array) and no checksums."""
    state = torch.load(ckpt / TRAINER_STATE, weights_only=True)
    py, npy = state["rng"]["python"], state["rng"]["numpy"]
    state["rng"]["python"] = (py["version"], tuple(py["state"].tolist()), py["gauss_next"])
    state["rng"]["numpy"] = (npy["bit_generator"], npy["key"].numpy().astype(np.uint32),
                             npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    torch.save(state, ckpt / TRAINER_STATE)
    (ckpt / CHECKSUMS).unlink()


@pytest.mark.parametrize("old", [False, True], ids=["current", "older-olmoflow"])
def test_an_untouched_checkpoint_resumes_bit_exactly(tmp_path, old, caplog):
    straight = make_trainer(tmp_path / "straight", 27, 0.1, **KW)
    straight.fit()
    crashed = tmp_path / "resumed"
    make_trainer(crashed, 27, 0.1, **{**KW, "max_steps": 2}).fit()
    if old:
        to_old_format(resolve_checkpoint(crashed, LATEST))
    with caplog.at_level(logging.WARNING, logger="olmoflow.train.checkpoint"):
        resumed = make_trainer(crashed, 27, 0.1, **KW, checkpoint__resume_from="latest")
        resumed.fit()
    warned = [r.getMessage() for r in caplog.records if CHECKSUMS in r.getMessage()]
    assert len(warned) == (1 if old else 0), warned
    a, b = read_metrics(tmp_path / "straight"), read_metrics(crashed)
    assert [a[s]["loss"] for s in (3, 4)] == [b[s]["loss"] for s in (3, 4)]
    for k, v in straight.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k


@pytest.mark.parametrize("old", [False, True], ids=["current", "older-olmoflow"])
def test_every_rng_state_round_trips(tmp_path, old):
    random.gauss(0, 1)  # a cached Gaussian in both generators: the odd fields must survive
    np.random.randn()
    state = rng_state()
    torch.save(state, tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    if old:
        py, npy = state["python"], state["numpy"]
        state["python"] = (py["version"], tuple(py["state"].tolist()), py["gauss_next"])
        state["numpy"] = (npy["bit_generator"], npy["key"].numpy().astype(np.uint32),
                          npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    want = (random.gauss(0, 1), random.random(), np.random.randn(), np.random.rand(),
            torch.rand(3).tolist())
    set_rng_state(state)
    assert (random.gauss(0, 1), random.random(), np.random.randn(), np.random.rand(),
            torch.rand(3).tolist()) == want


def test_save_records_checksums_as_its_last_file(tmp_path, monkeypatch):
    """A save killed before the checksums are written leaves only the hidden temporary: the
    checksum list is written last, just before the rename."""
    from olmoflow.train import checkpoint

    seen = []
    real = checkpoint.write_checksums

    def spy(path):
        seen.append(sorted(p.name for p in Path(path).iterdir()))
        real(path)

    monkeypatch.setattr(checkpoint, "write_checksums", spy)
    ckpt = saved_run(tmp_path)
    assert seen and all(CHECKSUMS not in names for names in seen)
    assert set(seen[-1]) | {CHECKSUMS} == set(os.listdir(ckpt))


# --- a damaged or mismatched checkpoint is a user error; the complete ones stay as they were


def _two_checkpoints(folder: Path) -> tuple[Path, Path]:
    make_trainer(folder, 27, 0.0, max_steps=4, checkpoint__save_interval=2).fit()
    older, newest = list_checkpoints(folder)
    assert resolve_checkpoint(folder, LATEST) == newest
    return older, newest


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


DAMAGE = {
    "shard deleted": lambda c: next((c / "model_and_optim").glob("*.distcp")).unlink(),
    "shard truncated": lambda c: _truncate(next((c / "model_and_optim").glob("*.distcp")), 1000),
    "metadata deleted": lambda c: (c / "model_and_optim" / ".metadata").unlink(),
    "trainer_state truncated": lambda c: _truncate(c / "trainer_state.pt", 100),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_latest_is_a_user_error_naming_the_previous_one(tmp_path, damage):
    older, newest = _two_checkpoints(tmp_path)
    kept = tree(older)
    DAMAGE[damage](newest)  # was: FileNotFoundError / EOFError / RuntimeError / AssertionError
    t = make_trainer(tmp_path, 27, 0.0, max_steps=6, checkpoint__save_interval=2,
                     checkpoint__resume_from="latest")
    with pytest.raises(OlmoflowError) as e:
        t.fit()
    msg = str(e.value)
    assert f"checkpoint '{newest}' cannot be read" in msg and f"resume_from={older.name}" in msg
    assert "\n" not in msg and "Traceback" not in msg
    assert tree(older) == kept and (tmp_path / LATEST).read_text().strip() == newest.name
    # ... and the one it names resumes.
    t = make_trainer(tmp_path, 27, 0.0, max_steps=3, checkpoint__save_interval=0,
                     checkpoint__resume_from=older.name)
    t.fit()
    assert t.step == 3


def test_a_checkpoint_of_another_model_shape_is_a_user_error(tmp_path):
    _, newest = _two_checkpoints(tmp_path)
    before = tree(tmp_path)
    cfg = train_config(max_steps=6, checkpoint__resume_from="latest")
    wider = Trainer(build_model(d_model=48), cfg, DataLoader(dataset(27), 4, seed=7), tmp_path,
                    progress=False)
    with pytest.raises(OlmoflowError,
                       match=r"cannot be read \(model_and_optim: ValueError: Size mismatch"):
        wider.fit()  # was: ValueError traceback
    assert tree(tmp_path) == before
