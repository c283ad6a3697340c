"""Data parallelism on CPU with gloo: 2 processes train exactly like 1 (DDP and FSDP2), and
checkpoints move between world sizes.

One ``torchrun --standalone --nproc_per_node=2`` launch of this file (as a script) runs every
2-process job; the 1-process runs happen in the test process. Every run trains the same tiny
model from the same seed on the same data and global batch (8 instances, micro-batches of 2),
6 steps with a checkpoint at step 3. Properties:

- DDP x2 and FSDP x2 log the single-process losses and gradient norms at every step (within one
  fp32 ulp per accumulated term: tolerance.py);
- a checkpoint saved by 1 process resumes on 2 (FSDP and DDP), and one saved by 2 (FSDP and
  DDP) resumes on 1, and steps 4-6 equal the uninterrupted single-process run (the same bound);
- only rank 0 writes the metrics log (one line per step, no duplicates);
- `olmoflow pretrain` (CLI -> pipeline -> stage) on 2 ranks writes one manifest with the
  single-process losses;
- a model built on the meta device gets its FSDP shards allocated and initialised and learns.

If FSDP2 on CPU/gloo were impossible these tests could not run; in torch 2.13 fully_shard on a
"cpu" DeviceMesh works with gloo (all-gather and reduce-scatter).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tolerance import forward_terms, fp32_rel

from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo
from olmoflow.pipeline.config import load_config
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
from olmoflow.train.trainer import METRICS, Trainer

VOCAB, SEQ, STEPS, SAVE, BATCH = 96, 16, 6, 3, 8
MODEL = dict(vocab_size=VOCAB, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, mlp_hidden=64,
             max_sequence_length=64, sliding_window=8)


def bounds(model: ModelConfig, seq: int, batch: int) -> dict[str, float]:
    """Relative bounds of a loss and a gradient norm of 2 processes against 1: each rank sums its
    half of the batch, then gloo sums the halves, another order of the same fp32 sums. The loss
    is within one ulp per accumulated term (tolerance.py), the gradient norm (back through the
    same sums) two. Later steps start from weights that differ by that rounding and stay far
    below the bound (observed: 1e-7 to 1e-6 relative; the bounds are about 1e-4)."""
    terms = forward_terms(model, seq, tokens=batch * seq)
    return {"loss": fp32_rel(terms), "grad_norm": fp32_rel(terms, 2)}


REL = bounds(ModelConfig(**MODEL), SEQ, BATCH)


def make_trainer(folder: Path, data_parallel: str = "ddp", resume_from: str | None = None,
                 meta: bool = False) -> Trainer:
    """What every process builds: same seed, same data, same global batch (``meta``: the model
    built on the meta device, FSDP then allocating and initialising only each rank's shards)."""
    rng = np.random.default_rng(0)
    # Tokens from a 12-symbol subset of the vocabulary: the loss falls fast from ln(96).
    data = InstanceDataset([rng.integers(0, 12, 40 * SEQ + 1).astype(np.uint16)], SEQ)
    cfg = TrainConfig(sequence_length=SEQ, global_batch_size=BATCH, micro_batch_size=2,
                      max_steps=STEPS, num_threads=1, optimizer=OptimizerConfig(lr=1e-2),
                      schedule=ScheduleConfig(warmup_steps=2), log=LogConfig(interval=1),
                      checkpoint=CheckpointConfig(save_interval=SAVE, resume_from=resume_from),
                      parallel=ParallelConfig(data_parallel=data_parallel))
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


def assert_same(run: Path, ref: Path, steps, rel: dict[str, float] = REL) -> None:
    a, b = metrics(run), metrics(ref)
    for s in steps:
        for key in ("loss", "grad_norm"):
            assert a[s][key] == pytest.approx(b[s][key], rel=rel[key], abs=0), (
                run.name, s, key, a[s][key], b[s][key])
        assert a[s]["tokens"] == b[s]["tokens"]
        assert a[s]["lr"] == pytest.approx(b[s]["lr"], abs=1e-12)


def _worker(spec: dict) -> None:
    """The 2-process half: each job trains (and saves) in its folder."""
    torch.set_num_threads(1)
    info = distributed.init_from_env()
    assert info.world_size == 2 and info.backend == "gloo", info
    for job in spec["jobs"]:
        make_trainer(Path(job["folder"]), job["data_parallel"], job.get("resume_from"),
                     job.get("meta", False)).fit()
    # What `torchrun -m olmoflow pretrain CONFIG` runs: the CLI, the pipeline, the stage.
    from olmoflow.cli import main

    assert main(spec["cli"]) == 0
    distributed.barrier()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dist")
    single = root / "single"
    make_trainer(single).fit()  # 1 process: the reference, and the checkpoint 1 -> 2 starts from
    for name in ("resume12_fsdp", "resume12_ddp"):
        shutil.copytree(single, root / name)
    # The tiny flow's data stages, once, in this process; pretrain then runs on 2 ranks.
    from olmoflow.cli import main

    flow = [f"--run-dir={root / 'flow2'}", "--no-progress", "train.max_steps=4",
            "train.log.interval=1", "train.num_threads=1", "train.parallel.data_parallel=fsdp"]
    for stage in ("collect", "clean", "train-tokenizer", "tokenize"):
        assert main([stage, "tiny", *flow]) == 0
    shutil.copytree(root / "flow2", root / "flow1")
    assert main(["pretrain", "tiny", *flow[1:], f"--run-dir={root / 'flow1'}"]) == 0
    jobs = [{"folder": str(root / "ddp"), "data_parallel": "ddp"},
            {"folder": str(root / "fsdp"), "data_parallel": "fsdp"},
            {"folder": str(root / "resume12_fsdp"), "data_parallel": "fsdp",
             "resume_from": f"step{SAVE}"},
            {"folder": str(root / "resume12_ddp"), "data_parallel": "ddp",
             "resume_from": f"step{SAVE}"},
            {"folder": str(root / "fsdp_meta"), "data_parallel": "fsdp", "meta": True}]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    # The script imports tolerance.py from tests/, which pytest, not the script, puts on sys.path.
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), *filter(None, [env.get("PYTHONPATH")])])
    # --standalone: a rendezvous on a free local port, so parallel test runs never collide.
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", __file__,
                           json.dumps({"jobs": jobs, "cli": ["pretrain", "tiny", *flow]})],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for src in ("fsdp", "ddp"):  # checkpoints saved by 2 processes, resumed by 1
        shutil.copytree(root / src, root / f"resume21_{src}")
        make_trainer(root / f"resume21_{src}", resume_from=f"step{SAVE}").fit()
    return root


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_processes_equal_one(runs, mode):
    assert sorted(metrics(runs / mode)) == list(range(1, STEPS + 1))
    assert_same(runs / mode, runs / "single", range(1, STEPS + 1))
    # The run learns: equality is not of two constant curves.
    m = metrics(runs / "single")
    assert m[STEPS]["loss"] < m[1]["loss"] - 0.05


@pytest.mark.parametrize("name", ["resume12_fsdp", "resume12_ddp", "resume21_fsdp", "resume21_ddp"])
def test_checkpoint_moves_between_world_sizes(runs, name):
    assert sorted(metrics(runs / name)) == list(range(1, STEPS + 1))
    assert_same(runs / name, runs / "single", range(SAVE + 1, STEPS + 1))
    latest = (runs / name / "latest").read_text().strip()
    assert f"-step{STEPS}-" in latest


def test_torchrun_pretrain_stage(runs):
    """`olmoflow pretrain` on 2 ranks: one manifest, one log line per step, the 1-process losses."""
    two, one = runs / "flow2" / "pretrain", runs / "flow1" / "pretrain"
    assert sorted(metrics(two)) == [1, 2, 3, 4]
    tiny = load_config("tiny")  # its model's vocab_size comes from the tokenizer it trains
    model = dataclasses.replace(tiny.model, vocab_size=tiny.tokenizer.vocab_size)
    rel = bounds(model, tiny.train.sequence_length, tiny.train.global_batch_size)
    assert_same(two, one, range(1, 5), rel)
    manifest = json.loads((two / "manifest.json").read_text())
    assert manifest["counts"]["steps"] == 4 and manifest["counts"]["tokens"] == 4 * 8 * 64
    assert manifest["counts"]["final_loss"] == pytest.approx(metrics(one)[4]["loss"],
                                                             rel=rel["loss"], abs=0)


def test_meta_device_init_under_fsdp(runs):
    """A model built on the meta device gets its shards allocated and initialised by FSDP: a sane
    start (the loss of a fresh model, about ln V) and training that learns."""
    meta, ref = metrics(runs / "fsdp_meta"), metrics(runs / "single")
    assert abs(meta[1]["loss"] - ref[1]["loss"]) < 0.05
    assert meta[1]["loss"] != ref[1]["loss"]  # other random values than the one-process init
    assert meta[STEPS]["loss"] < meta[1]["loss"] - 0.05


def test_two_process_checkpoint_is_complete(runs):
    """The 2-process save is one checkpoint: rank 0's trainer state and both ranks' shards."""
    ckpts = sorted(p.name for p in (runs / "fsdp").iterdir() if "-step" in p.name)
    assert len(ckpts) == 2 and not list((runs / "fsdp").glob(".*.tmp"))
    shards = list((runs / "fsdp" / ckpts[0] / "model_and_optim").glob("*.distcp"))
    assert len(shards) == 2


def test_batch_split_errors():
    info = distributed.DistInfo(rank=1, world_size=3)
    with pytest.raises(Exception, match="not divisible by the world size 3"):
        distributed.per_rank_batch(8, 2, info)
    with pytest.raises(Exception, match="3 instances per rank, not a multiple"):
        distributed.per_rank_batch(9, 2, info)
    x = torch.arange(9).view(9, 1)
    assert distributed.shard_batch(x, info).flatten().tolist() == [3, 4, 5]


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
