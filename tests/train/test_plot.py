"""``olmoflow plot RUN``: valid PNG files whose curves and heatmaps hold exactly the log's
numbers."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from olmoflow.cli import main
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo
from olmoflow.train.config import (
    CheckpointConfig,
    LogConfig,
    OptimizerConfig,
    ScheduleConfig,
    TrainConfig,
)
from olmoflow.train.loader import DataLoader, InstanceDataset
from olmoflow.train.loggers import read_log
from olmoflow.train.plot import figures, matrix
from olmoflow.train.trainer import METRICS, Trainer

VOCAB, SEQ, LAYERS, HEADS = 64, 16, 3, 2


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory whose pretrain/ holds a 6-step log, detailed every 2nd step."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("run")
    rng = np.random.default_rng(0)
    data = InstanceDataset([rng.integers(0, VOCAB, 30 * SEQ).astype(np.uint16)], SEQ)
    cfg = TrainConfig(sequence_length=SEQ, global_batch_size=4, micro_batch_size=4, max_steps=6,
                      num_threads=1, optimizer=OptimizerConfig(lr=1e-2),
                      schedule=ScheduleConfig(warmup_steps=1),
                      checkpoint=CheckpointConfig(save_interval=0),
                      log=LogConfig(interval=1, detailed_interval=2))
    torch.manual_seed(0)
    model = Olmo(ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=LAYERS, n_heads=HEADS,
                             mlp_hidden=64, max_sequence_length=64, sliding_window=None))
    Trainer(model, cfg, DataLoader(data, 4, seed=0), root / "pretrain", progress=False).fit()
    return root


def test_plot_cli_writes_valid_pngs(run_dir, capsys):
    assert main(["plot", str(run_dir)]) == 0
    out = run_dir / "pretrain" / "plots"
    names = {p.name for p in out.glob("*.png")}
    assert {"loss.png", "lr.png", "grad_norm.png", "throughput.png", "system.png",
            "heatmap_grad_norm.png", "heatmap_update_ratio.png", "heatmap_act_rms.png",
            "attention_heads.png"} <= names
    for p in out.glob("*.png"):
        with Image.open(p) as im:
            assert im.format == "PNG" and im.width > 300 and im.height > 200
            im.verify()
    assert "wrote" in capsys.readouterr().out
    assert not list(out.glob(".*.tmp"))  # written atomically, no leftovers


def test_plotted_data_equals_the_log(run_dir):
    records = read_log(run_dir / "pretrain" / METRICS)
    figs = figures(records)

    loss = figs["loss.png"].axes[0].lines[0]
    assert loss.get_label() == "loss"
    np.testing.assert_array_equal(loss.get_xydata(), [[r["step"], r["loss"]] for r in records])
    lr = figs["lr.png"].axes[0].lines[0]
    np.testing.assert_array_equal(lr.get_ydata(), [r["lr"] for r in records])

    detailed = [r for r in records if "grad_norm/layer.0" in r]
    assert [r["step"] for r in detailed] == [2, 4, 6]
    for kind in ("grad_norm", "update_ratio", "act_rms"):
        ax = figs[f"heatmap_{kind}.png"].axes[0]
        want = [[r[f"{kind}/layer.{i}"] for r in detailed] for i in range(LAYERS)]
        np.testing.assert_array_equal(ax.images[0].get_array(), want)
        assert [t.get_text() for t in ax.get_yticklabels()] == [f"layer.{i}" for i in range(LAYERS)]

    ax = figs["attention_heads.png"].axes[0]
    rows = [f"layer.{i}.head.{h}" for i in range(LAYERS) for h in range(HEADS)]
    assert [t.get_text() for t in ax.get_yticklabels()] == rows
    want = [[r[f"attn_entropy_norm/{row}"] for r in detailed] for row in rows]
    np.testing.assert_array_equal(ax.images[0].get_array(), want)


def test_matrix_orders_rows_numerically_and_marks_gaps():
    records = [{"step": 1, "x/layer.10": 1.0, "x/layer.2": 2.0},
               {"step": 2, "loss": 3.0},  # no x/ keys: not a column
               {"step": 3, "x/layer.2": 4.0}]
    steps, rows, values = matrix(records, "x", r"layer\.\d+")
    assert steps == [1, 3] and rows == ["layer.2", "layer.10"]
    assert values[0] == [2.0, 4.0] and values[1][0] == 1.0 and math.isnan(values[1][1])


def test_plot_errors_are_one_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "no training log" in capsys.readouterr().err
    bad = tmp_path / METRICS
    bad.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n{not json\n")
    assert main(["plot", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{bad}:2" in err and len(err.splitlines()) == 1
