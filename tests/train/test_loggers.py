"""Training-log writers: TensorBoard event files and an offline Weights & Biases run hold the same
numbers as metrics.jsonl, at the same steps; writer names are checked with a hint."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from resume_helpers import parse_train_config
from tolerance import EPS32

from olmoflow.errors import OlmoflowError
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo
from olmoflow.pipeline.config import load_config
from olmoflow.train.loader import DataLoader, InstanceDataset
from olmoflow.train.loggers import read_log, scalars
from olmoflow.train.trainer import METRICS, Trainer

VOCAB, SEQ = 64, 16


@pytest.fixture(autouse=True)
def hermetic(tmp_path, monkeypatch):
    """One thread; W&B's settings, cache and data under the test's directory, never the network."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def train(folder, loggers: list[str], steps: int = 4, **cfg_kw) -> list[dict]:
    rng = np.random.default_rng(0)
    data = InstanceDataset([rng.integers(0, VOCAB, 20 * SEQ).astype(np.uint16)], SEQ)
    cfg = parse_train_config(**{**dict(
        sequence_length=SEQ, global_batch_size=2, micro_batch_size=2, max_steps=steps,
        optimizer__lr=1e-2, schedule__warmup_steps=1, checkpoint__save_interval=0,
        log__interval=1, num_threads=1, log__detailed_interval=2, log__loggers=loggers), **cfg_kw})
    torch.manual_seed(0)
    model = Olmo(ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, mlp_hidden=64,
                             max_sequence_length=64, sliding_window=None))
    Trainer(model, cfg, DataLoader(data, 2, seed=0), folder, config_yaml="train:\n  lr: 0.01\n",
            progress=False).fit()
    return read_log(folder / METRICS)


def test_tensorboard_events_hold_the_log(tmp_path):
    pytest.importorskip("tensorboard", reason="the loggers extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = train(tmp_path, ["tensorboard"])
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    detailed = log[1]
    assert set(scalars(detailed)) <= tags  # every number of a detailed line, including per-head
    for key in ("loss", "lr", "grad_norm/layer.1", "attn_entropy/layer.0.head.1", "perf/mfu"):
        want = [(r["step"], r[key]) for r in log if key in r]
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in want], key
        # TensorBoard stores float32: a float64 rounds to within half an fp32 ulp of itself.
        np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=EPS32)


def wandb_records(run_file):
    """Decode a W&B transaction log (``run-*.wandb``): a LevelDB-style log of 32 KiB blocks whose
    records (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last) hold protobuf
    ``Record`` messages, after a 7-byte header."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf, out = run_file.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer too small for a header: skip to the next block
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def test_wandb_offline_run_holds_the_log(tmp_path):
    pytest.importorskip("wandb", reason="the loggers extra is not installed")
    log = train(tmp_path, ["wandb"])
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (run_file,) = runs[0].glob("run-*.wandb")
    records = wandb_records(run_file)
    history = {}
    config = {}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            # keys holding "/" are stored split into nested_key
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in rec.history.item}
            history[rec.history.step.num] = items
        elif kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
    assert sorted(history) == [r["step"] for r in log]
    for r in log:
        got = history[r["step"]]
        for k, v in scalars(r).items():
            assert got[k] == pytest.approx(v, rel=1e-9), (r["step"], k)
    assert len(scalars(log[1])) > 50  # the detailed lines went through too
    assert config["train"] == {"lr": 0.01}  # the resolved config travels with the run


def test_unknown_writer_is_named_with_a_hint():
    with pytest.raises(OlmoflowError, match="did you mean 'tensorboard'"):
        load_config("demo", ["train.log.loggers=[tensorbaord]"])
    assert load_config("demo", ["train.log.loggers=wandb"]).train.log.loggers == ["wandb"]


def test_tensorboard_after_resume_shows_each_step_once(tmp_path):
    """A run stopped after step 4 and resumed from its step-2 checkpoint rewrites steps 3-4:
    TensorBoard hides the first run's events from step 3 on (purge_step), so every step shows
    once."""
    pytest.importorskip("tensorboard", reason="the loggers extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(tmp_path, ["tensorboard"], steps=4, checkpoint__save_interval=2)
    log = train(tmp_path, ["tensorboard"], steps=4, checkpoint__save_interval=2,
                checkpoint__resume_from="step2")
    assert [r["step"] for r in log] == [1, 2, 3, 4]  # the trainer trimmed its JSONL to match
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4]
    np.testing.assert_allclose([e.value for e in acc.Scalars("loss")], [r["loss"] for r in log],
                               rtol=EPS32)  # stored as float32 (see above)
