"""The micro-batch finder: the largest fitting divisor of the per-rank batch, chosen by a memory
estimate on CPU (by trial on CUDA); the global batch and so the training result are unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tolerance import forward_terms, fp32_rel

from olmoflow.errors import OlmoflowError
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo
from olmoflow.pipeline.config import load_config
from olmoflow.train.batch_finder import (
    cuda_trial_fits,
    default_budget_bytes,
    divisors_desc,
    find_micro_batch,
)
from olmoflow.train.config import (
    CheckpointConfig,
    LogConfig,
    OptimizerConfig,
    ScheduleConfig,
    TrainConfig,
)
from olmoflow.train.loader import DataLoader, InstanceDataset
from olmoflow.train.plan import GB, activation_bytes_per_token, memory_plan
from olmoflow.train.trainer import METRICS, Trainer

VOCAB, SEQ, BATCH = 128, 32, 8
MODEL = dict(vocab_size=VOCAB, d_model=48, n_layers=2, n_heads=2, mlp_hidden=96,
             max_sequence_length=64, sliding_window=None)


def test_find_micro_batch_backs_off_through_divisors():
    tried = []

    def fits(m):
        tried.append(m)
        return m <= 5

    assert find_micro_batch(12, fits) == 4
    assert tried == [12, 6, 4]  # largest first, divisors only, stops at the first fit
    assert divisors_desc(12) == [12, 6, 4, 3, 2, 1]
    with pytest.raises(OlmoflowError, match="not even a micro-batch of 1"):
        find_micro_batch(4, lambda m: False)


def budget_for(micro_batch: float) -> float:
    """GB that the CPU estimate says fits ``micro_batch`` instances (and not one more)."""
    cfg = ModelConfig(**MODEL)
    plan = memory_plan(cfg, world_size=1, data_parallel="ddp", micro_batch_size=1,
                       sequence_length=SEQ, precision="fp32")
    per_instance = SEQ * (activation_bytes_per_token(cfg, 4, 0) + 8 * VOCAB)
    return (plan.static - plan.reserve + micro_batch * per_instance) / GB


def train(folder, **kw) -> tuple[list[dict], dict[str, torch.Tensor], Trainer]:
    rng = np.random.default_rng(0)
    data = InstanceDataset([rng.integers(0, 16, 30 * SEQ + 1).astype(np.uint16)], SEQ)
    cfg = TrainConfig(sequence_length=SEQ, global_batch_size=BATCH, max_steps=4, num_threads=1,
                      optimizer=OptimizerConfig(lr=1e-2), schedule=ScheduleConfig(warmup_steps=1),
                      checkpoint=CheckpointConfig(save_interval=0), log=LogConfig(interval=1),
                      **kw)
    torch.manual_seed(0)
    t = Trainer(Olmo(ModelConfig(**MODEL)), cfg, DataLoader(data, BATCH, seed=1), folder,
                progress=False)
    t.fit()
    rows = [json.loads(ln) for ln in (folder / METRICS).read_text().splitlines()]
    return rows, {k: v.clone() for k, v in t.model.state_dict().items()}, t


def test_small_budget_picks_smaller_micro_batch_same_training(tmp_path, capsys):
    ref, w_ref, _ = train(tmp_path / "fixed", micro_batch_size=BATCH)
    big, w_big, t_big = train(tmp_path / "big", micro_batch_size=1, auto_micro_batch=True,
                              memory_budget_gb=budget_for(BATCH + 0.5))
    small, w_small, t_small = train(tmp_path / "small", micro_batch_size=BATCH,
                                    auto_micro_batch=True, memory_budget_gb=budget_for(2.5))
    assert t_big.micro_batch_size == BATCH
    assert t_small.micro_batch_size == 2  # 2.5 fits 2 (4 does not); the divisors are 8, 4, 2, 1
    assert t_small.micro_batch_choice["accumulation_steps"] == 4
    assert "auto_micro_batch: micro-batch 2 instance(s)" in capsys.readouterr().out
    assert [r["micro_batch_size"] for r in small] == [2] * 4  # the choice is in the training log
    # ref and big run the same micro-batch of 8: the same sums, bit for bit. Accumulation over 4
    # micro-batches gives the gradient of one batch of 8 with the sums split in another order: a
    # loss is a mean over the batch's tokens of a forward through the blocks, within one ulp per
    # accumulated term of its magnitude (tolerance.py), a gradient norm goes back through them as
    # well (two). Later steps start from weights that differ by that rounding; observed: 2.5e-7
    # relative (2 ulps) on the loss, 2e-6 on the grad norm; the bounds are 1.7e-4 and 3.4e-4.
    terms = forward_terms(ModelConfig(**MODEL), SEQ, tokens=BATCH * SEQ)
    for a, b, c in zip(ref, big, small):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
        assert c["loss"] == pytest.approx(a["loss"], rel=fp32_rel(terms), abs=0)
        assert c["grad_norm"] == pytest.approx(a["grad_norm"], rel=fp32_rel(terms, 2), abs=0)
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.1
    # Per tensor: Adam's m / sqrt(v) turns float noise in near-zero gradient entries (w_k under
    # QK-norm) into updates of a few 1e-5 relative; a wrong gradient would be off by far more.
    for k in w_ref:
        assert (w_small[k] - w_ref[k]).norm() <= 2e-4 * w_ref[k].norm(), k


def test_budget_too_small_is_a_user_error(tmp_path):
    with pytest.raises(OlmoflowError, match="not even a micro-batch of 1"):
        train(tmp_path / "none", micro_batch_size=BATCH, auto_micro_batch=True,
              memory_budget_gb=budget_for(0.5))


def test_default_budget_is_this_process_and_free_ram():
    psutil = pytest.importorskip("psutil")
    b = default_budget_bytes(1)
    assert b >= psutil.virtual_memory().available * 0.9
    assert default_budget_bytes(2) < b


def test_config_validation():
    with pytest.raises(OlmoflowError, match="did you mean 'fsdp'"):
        load_config("tiny", ["train.parallel.data_parallel=fdsp"])
    with pytest.raises(OlmoflowError, match="memory_budget_gb must be > 0"):
        load_config("tiny", ["train.memory_budget_gb=0"])
    fsdp = load_config("tiny", ["train.parallel.data_parallel=fsdp"])
    assert fsdp.train.parallel.data_parallel == "fsdp"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA trial needs a GPU")
def test_cuda_trial_backs_off_on_out_of_memory():
    model = Olmo(ModelConfig(**MODEL)).cuda()
    free, _ = torch.cuda.mem_get_info()
    fits_small = cuda_trial_fits(model, sequence_length=SEQ, vocab_size=VOCAB, reserve_bytes=0,
                                 amp=torch.bfloat16)
    assert fits_small(4)
    assert all(p.grad is None for p in model.parameters())  # the trial leaves no gradients
    too_big = cuda_trial_fits(model, sequence_length=SEQ, vocab_size=VOCAB,
                              reserve_bytes=int(free * 1.5), amp=torch.bfloat16)
    assert not too_big(1)
    assert fits_small(4)  # memory was given back after the out-of-memory error
