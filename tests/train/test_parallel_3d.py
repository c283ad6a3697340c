"""Tensor and pipeline parallelism, alone and composed with FSDP2, train like one process
(CPU, gloo).

Two torchrun launches of this file (as a script) run the multi-process jobs: 2 processes for
tp=2, pp=2 (1F1B) and pp=2 x 2 virtual stages (interleaved 1F1B); 4 processes for tp=2 x dp=2,
pp=2 x dp=2 and tp=2 x pp=2, and for checkpoints moved between layouts. The one-process
reference runs in the test process. Every job trains the same tiny OLMo 3 model (sliding-window
and full-attention layers, GQA, QK-norm, z-loss) from the same seed on the same data and global
batch (8 instances of 16 tokens, micro-batches of 2) for 10 steps, with a checkpoint at step 5.

Properties:

- each layout logs the one-process losses and gradient norms at every step within 1e-5
  (relative): tensor parallelism splits the matmul sums and the norms' statistics into
  per-rank partial sums, pipeline parallelism runs the same micro-batches through the same
  blocks in stages; only rounding differs;
- a checkpoint saved under tp=2 x dp=2 resumes under dp=4 (FSDP), one saved under pp=2 (1F1B)
  resumes under pp=2 interleaved (each rank then holds other layers), and one saved under tp=2 x
  pp=2 resumes in one process; steps 6-10 equal the uninterrupted one-process run (same bound);
- activation checkpointing composes with them (tp=2 x pp=2 runs with it);
- bad layouts are one-line errors (the pure-config checks are tested without processes).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from olmoflow.errors import OlmoflowError
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo
from olmoflow.train import distributed
from olmoflow.train.config import (
    CheckpointConfig,
    LogConfig,
    OptimizerConfig,
    ParallelConfig,
    ScheduleConfig,
    TrainConfig,
)
from olmoflow.train.loader import DataLoader, InstanceDataset
from olmoflow.train.parallel.compose import fsdp_options
from olmoflow.train.parallel.layout import check_layout, resolve_layout
from olmoflow.train.parallel.pipeline import split_layers
from olmoflow.train.trainer import METRICS, Trainer

VOCAB, SEQ, STEPS, SAVE, BATCH = 128, 16, 10, 5, 8
MODEL = dict(vocab_size=VOCAB, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, mlp_hidden=64,
             max_sequence_length=64, sliding_window=8)
REL = 1e-5

TWO = {
    "tp2": {"tensor_parallel": 2},
    "pp2": {"pipeline_parallel": 2},
    "pp2_interleaved": {"pipeline_parallel": 2, "pipeline_schedule": "interleaved_1f1b",
                        "stages_per_rank": 2},
}
# FSDP2's MixedPrecisionPolicy: bf16 parameters for compute, fp32 reductions and master weights.
MIXED = {"fsdp2_bf16_params": {"data_parallel": "fsdp", "param_dtype": "bf16"}}
FOUR = {
    "tp2_dp2": {"tensor_parallel": 2, "data_parallel": "fsdp"},
    "pp2_dp2": {"pipeline_parallel": 2, "data_parallel": "fsdp"},
    "tp2_pp2": {"tensor_parallel": 2, "pipeline_parallel": 2},
}
# (folder, layout, checkpoint folder copied in first): steps 6-10 resumed under another layout
RESUMES = {"tp2_dp2_to_dp4": ("tp2_dp2", {"data_parallel": "fsdp"})}
# On 2 processes: saved by 1F1B (rank 0 holds layers 0-1), resumed interleaved (layers 0 and 2).
RESUMES_TWO = {"pp2_to_interleaved": ("pp2", TWO["pp2_interleaved"])}


def make_trainer(folder: Path, parallel: dict | None = None, resume_from: str | None = None,
                 meta: bool = False, **train) -> Trainer:
    """What every process builds: same seed, same data, same global batch (``train``: more
    TrainConfig keys, ones that do not change the math; ``meta``: the model built on the meta
    device, each rank then allocating and initialising its own shards)."""
    rng = np.random.default_rng(0)
    data = InstanceDataset([rng.integers(0, 12, 40 * SEQ + 1).astype(np.uint16)], SEQ)
    cfg = TrainConfig(sequence_length=SEQ, global_batch_size=BATCH, micro_batch_size=2,
                      max_steps=STEPS, num_threads=1, optimizer=OptimizerConfig(lr=1e-2),
                      schedule=ScheduleConfig(warmup_steps=2), log=LogConfig(interval=1),
                      checkpoint=CheckpointConfig(save_interval=SAVE, resume_from=resume_from),
                      parallel=ParallelConfig(**(parallel or {})), **train)
    torch.manual_seed(0)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = Olmo(ModelConfig(**MODEL))
    return Trainer(model, cfg, DataLoader(data, cfg.global_batch_size, seed=5), folder,
                   config_yaml="x: 1\n", progress=False)


def metrics(folder: Path) -> dict[int, dict]:
    rows = [json.loads(ln) for ln in (folder / METRICS).read_text().splitlines() if ln.strip()]
    by_step = {r["step"]: r for r in rows}
    assert len(by_step) == len(rows), f"{folder.name}: a step was logged twice"
    return by_step


def assert_same(run: Path, ref: Path, steps) -> None:
    a, b = metrics(run), metrics(ref)
    for s in steps:
        for key in ("loss", "ce_loss", "z_loss", "grad_norm"):
            assert a[s][key] == pytest.approx(b[s][key], rel=REL, abs=0), (
                run.name, s, key, a[s][key], b[s][key])
        assert a[s]["tokens"] == b[s]["tokens"]
        assert a[s]["lr"] == pytest.approx(b[s]["lr"], abs=1e-12)


def _worker(spec: dict) -> None:
    """The multi-process half: each job trains (and saves) in its folder, in order; a job with
    ``copy_from`` first starts from that earlier job's step-SAVE checkpoint."""
    torch.set_num_threads(1)
    info = distributed.init_from_env()
    assert info.world_size == spec["world"] and info.backend == "gloo", info
    for job in spec["jobs"]:
        if "copy_from" in job:
            if info.is_main:
                _copy_until(Path(job["copy_from"]), Path(job["folder"]))
            distributed.barrier()
        make_trainer(Path(job["folder"]), job["parallel"], job.get("resume_from"),
                     job.get("meta", False), **job.get("train", {})).fit()
    distributed.barrier()


def _torchrun(n: int, spec: dict) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={n}", __file__, json.dumps({**spec, "world": n})],
                          capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("par3d")
    make_trainer(root / "single").fit()  # the reference
    two = [{"folder": str(root / n), "parallel": p} for n, p in {**TWO, **MIXED}.items()]
    two.append({"folder": str(root / "tp2_meta"), "parallel": TWO["tp2"], "meta": True})
    for name, (src, parallel) in RESUMES_TWO.items():
        two.append({"folder": str(root / name), "parallel": parallel,
                    "resume_from": f"step{SAVE}", "copy_from": str(root / src)})
    _torchrun(2, {"jobs": two})
    jobs = [{"folder": str(root / n), "parallel": p} for n, p in FOUR.items()]
    # Activation checkpointing recomputes the same forward in backward: the same numbers.
    jobs[list(FOUR).index("tp2_pp2")]["train"] = {"activation_checkpointing": 1}
    for name, (src, parallel) in RESUMES.items():  # after the job that saved the checkpoint
        jobs.append({"folder": str(root / name), "parallel": parallel,
                     "resume_from": f"step{SAVE}", "copy_from": str(root / src)})
    _torchrun(4, {"jobs": jobs})
    # Saved by tp=2 x pp=2 on 4 processes, resumed by one.
    _copy_until(root / "tp2_pp2", root / "tp2_pp2_to_one")
    make_trainer(root / "tp2_pp2_to_one", resume_from=f"step{SAVE}").fit()
    return root


def _copy_until(src: Path, dst: Path) -> None:
    """A copy of run ``src`` as it was at the step-SAVE checkpoint (its later checkpoints
    removed, so a resume from ``latest`` could not pick them either)."""
    shutil.copytree(src, dst)
    for d in dst.iterdir():
        if d.is_dir() and f"-step{SAVE}-" not in d.name:
            shutil.rmtree(d)


@pytest.mark.parametrize("name", [*TWO, *FOUR])
def test_layout_equals_one_process(runs, name):
    assert sorted(metrics(runs / name)) == list(range(1, STEPS + 1))
    assert_same(runs / name, runs / "single", range(1, STEPS + 1))
    m = metrics(runs / "single")
    assert m[STEPS]["loss"] < m[1]["loss"] - 0.05  # it learns: not two flat curves


@pytest.mark.parametrize("name", [*RESUMES, *RESUMES_TWO, "tp2_pp2_to_one"])
def test_checkpoint_moves_between_layouts(runs, name):
    assert sorted(metrics(runs / name)) == list(range(1, STEPS + 1))
    assert_same(runs / name, runs / "single", range(SAVE + 1, STEPS + 1))
    assert f"-step{STEPS}-" in (runs / name / "latest").read_text()


def test_fsdp_bf16_parameters(runs):
    """bf16 compute parameters: the loss follows the fp32 run within bf16 rounding (8 bits of
    mantissa, a few parts in a thousand per matmul) and learns; it is not the fp32 run."""
    a, ref = metrics(runs / "fsdp2_bf16_params"), metrics(runs / "single")
    for s in range(1, STEPS + 1):
        assert a[s]["loss"] == pytest.approx(ref[s]["loss"], rel=2e-2)
    assert any(abs(a[s]["loss"] / ref[s]["loss"] - 1) > 1e-5 for s in a)
    assert a[STEPS]["loss"] < a[1]["loss"] - 0.05


def test_meta_device_init_under_tensor_parallel(runs):
    """A model built on the meta device gets its tensor-parallel shards allocated and
    initialised on each rank: a fresh model's loss (about ln V) and training that learns."""
    meta, ref = metrics(runs / "tp2_meta"), metrics(runs / "single")
    assert abs(meta[1]["loss"] - ref[1]["loss"]) < 0.05
    assert meta[1]["loss"] != ref[1]["loss"]  # other random values than the one-process init
    assert meta[STEPS]["loss"] < meta[1]["loss"] - 0.05


def test_layout_checks():
    """Degrees that do not divide the world, the heads or the layers are one-line errors."""
    cfg = ModelConfig(**MODEL)
    train = TrainConfig(sequence_length=SEQ, global_batch_size=BATCH, micro_batch_size=2)
    with pytest.raises(OlmoflowError, match="does not divide the world size 6"):
        resolve_layout(ParallelConfig(tensor_parallel=4), 6)
    with pytest.raises(OlmoflowError, match="data_parallel=4 x tensor_parallel=2"):
        resolve_layout(ParallelConfig(data_parallel=4, tensor_parallel=2), 4)
    assert resolve_layout(ParallelConfig(data_parallel=2, tensor_parallel=2), 4).dp == 2
    with pytest.raises(OlmoflowError, match="data_parallel=4 x tensor_parallel=1"):
        resolve_layout(ParallelConfig(data_parallel=4), 2)  # an integer degree is checked alone
    with pytest.raises(OlmoflowError, match="world size 1 .*torchrun --nproc_per_node"):
        resolve_layout(ParallelConfig(pipeline_parallel=2), 1)
    with pytest.raises(OlmoflowError, match="train.compile is not supported"):
        check_layout(resolve_layout(ParallelConfig(tensor_parallel=2), 2), cfg,
                     TrainConfig(sequence_length=SEQ, global_batch_size=BATCH,
                                 micro_batch_size=2, compile=True))
    hsdp = resolve_layout(ParallelConfig(data_parallel="hsdp", shard_size=2), 8)
    assert (hsdp.dp_replicate, hsdp.dp_shard) == (4, 2)
    with pytest.raises(OlmoflowError, match="model.n_kv_heads=2"):
        check_layout(resolve_layout(ParallelConfig(tensor_parallel=4), 4), cfg, train)
    with pytest.raises(OlmoflowError, match="at least one layer per stage"):
        check_layout(resolve_layout(ParallelConfig(pipeline_parallel=8), 8), cfg, train)
    with pytest.raises(OlmoflowError, match="at least 4 micro-batches"):
        check_layout(resolve_layout(ParallelConfig(pipeline_parallel=4), 4), cfg,
                     TrainConfig(sequence_length=SEQ, global_batch_size=4, micro_batch_size=2))
    with pytest.raises(OlmoflowError, match="closest|did you mean|valid"):
        ParallelConfig(pipeline_schedule="1f1")
    with pytest.raises(OlmoflowError, match="stages_per_rank >= 2"):
        ParallelConfig(pipeline_parallel=2, pipeline_schedule="interleaved_1f1b")
    with pytest.raises(OlmoflowError, match="context_parallel"):
        ParallelConfig(context_parallel=2)
    with pytest.raises(OlmoflowError, match="needs data_parallel=fsdp or hsdp"):
        ParallelConfig(cpu_offload=True)
    with pytest.raises(OlmoflowError, match="on the CPU already"):
        fsdp_options(ParallelConfig(data_parallel="fsdp", cpu_offload=True),
                     torch.device("cpu"), None)
    policy = fsdp_options(ParallelConfig(data_parallel="fsdp"), torch.device("cuda"),
                          torch.bfloat16)["mp_policy"]
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert fsdp_options(ParallelConfig(data_parallel="fsdp", param_dtype="fp32"),
                        torch.device("cuda"), torch.bfloat16) == {}


def test_split_layers():
    cfg = ModelConfig(**{**MODEL, "n_layers": 10})
    assert [len(r) for r in split_layers(cfg, 4)] == [3, 3, 2, 2]
    # The LM head (2 d V per token) weighs on the last stage: the cost split gives it fewer
    # blocks than the others.
    big_vocab = ModelConfig(**{**MODEL, "n_layers": 10, "vocab_size": 4096})
    sizes = [len(r) for r in split_layers(big_vocab, 2, "cost")]
    assert sum(sizes) == 10 and sizes[1] < sizes[0]
    assert sum(split_layers(cfg, 3, "cost"), []) == list(range(10))


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
