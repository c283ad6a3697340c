"""The pretraining loop as properties of the whole system: gradient accumulation equals one big
batch, resume is bit-exact (losses, lr, weights, optimizer moments), the data loader visits every
instance once per epoch in a (seed, epoch)-determined order, and the lr schedules have their shape.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from resume_helpers import (
    SEQ,
    VOCAB,
    assert_resume_exact,
    build_model,
    dataset,
    make_trainer,
    read_metrics,
    resume_in_fresh_process,
    run_until_crash,
    tiny_model_config,
    token_arrays,
    train_config,
)
from tolerance import EPS32, assert_fp32_close, forward_terms, fp32_rel

from olmoflow.errors import OlmoflowError
from olmoflow.model.olmo import IGNORE_INDEX
from olmoflow.train.checkpoint import checkpoint_name
from olmoflow.train.loader import DataLoader, InstanceDataset
from olmoflow.train.schedule import lr_at
from olmoflow.train.trainer import Trainer

# --- gradient accumulation ------------------------------------------------------------------------


def uneven_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 10 tokens whose labels keep 3 and 7 targets: unequal micro-batch weights."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 10), generator=g)
    labels = torch.randint(0, VOCAB, (2, 10), generator=g)
    labels[0, 3:] = IGNORE_INDEX  # 3 targets
    labels[1, :3] = IGNORE_INDEX  # 7 targets
    assert (labels != IGNORE_INDEX).sum(1).tolist() == [3, 7]
    return ids, labels


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def accumulated_terms() -> int:
    """The fp32 additions behind the loss of ``uneven_batch`` (tolerance.py): a forward over its
    10 positions and the mean over its 20 positions' targets (an upper count: 10 are ignored). A
    gradient goes back through the same sums: twice as many."""
    return forward_terms(tiny_model_config(), 10, tokens=20)


def test_accumulation_with_global_normalizer_equals_one_batch():
    ids, labels = uneven_batch()
    model = build_model()
    model(ids, labels).loss.backward()  # one batch: mean over its 10 targets
    full = grads(model)

    model.zero_grad(set_to_none=True)
    n = int((labels != IGNORE_INDEX).sum())
    for i in range(2):
        model(ids[i : i + 1], labels[i : i + 1], loss_normalizer=n).loss.backward()
    accumulated = grads(model)

    model.zero_grad(set_to_none=True)
    for i in range(2):  # the classic mistake: mean per micro-batch, averaged over micro-batches
        (model(ids[i : i + 1], labels[i : i + 1]).loss / 2).backward()
    naive = grads(model)

    # Another order of the same sums (two micro-batches, then their sum): two ulps per term.
    terms = accumulated_terms()
    for name in full:
        assert_fp32_close(accumulated[name], full[name], terms, 2, msg=name)
    # The batch is uneven enough that per-micro-batch means give a different gradient: far outside
    # that bound (observed: 0.8 of the largest entry), so the check above can fail.
    assert max(float((naive[k] - full[k]).abs().max() / full[k].abs().max())
               for k in full) > 1000 * fp32_rel(terms, 2)


def one_trainer_step(micro_batch_size: int, tmp_path: Path, **cfg_kw):
    ids, labels = uneven_batch()
    model = build_model()
    cfg = train_config(global_batch_size=2, micro_batch_size=micro_batch_size, **cfg_kw)
    loader = DataLoader(dataset(4), 2, seed=0)  # unused by train_step; the Trainer needs one
    trainer = Trainer(model, cfg, loader, tmp_path / f"mb{micro_batch_size}", progress=False)
    captured = {}
    step = trainer.optimizer.step

    def capture_then_step(*a, **k):
        captured.update(grads(model))
        return step(*a, **k)

    trainer.optimizer.step = capture_then_step
    metrics = trainer.train_step({"input_ids": ids, "labels": labels})
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return metrics, captured, weights


@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
def test_train_step_micro_batches_match_one_batch(tmp_path, grad_clip):
    m1, g1, w1 = one_trainer_step(1, tmp_path, max_grad_norm=grad_clip)
    m2, g2, w2 = one_trainer_step(2, tmp_path, max_grad_norm=grad_clip)
    # Micro-batches of 1 and one of 2 sum the same terms in another order (tolerance.py).
    terms = accumulated_terms()
    for k, ulps in (("loss", 1), ("ce_loss", 1), ("z_loss", 1), ("grad_norm", 2)):
        assert m1[k] == pytest.approx(m2[k], rel=fp32_rel(terms, ulps), abs=0), k
    assert set(g1) == set(g2) == set(w1)
    lr = m2["lr"]
    for name in g1:
        assert_fp32_close(g1[name], g2[name], terms, 2, msg=name)
        # AdamW's first step moves a weight by lr * g / (|g| + eps): a gradient entry off by dg
        # moves it by up to lr * dg / (|g| + eps), at most 2 lr (a sign flip of a near-zero
        # entry); plus the rounding of w itself.
        dg = fp32_rel(terms, 2) * float(g2[name].abs().max())
        moved = lr * torch.clamp(dg / (g2[name].abs() + 1e-8), max=2.0)
        assert ((w1[name] - w2[name]).abs() <= moved + 2 * EPS32 * w2[name].abs()).all(), name
    # the step really moved the weights
    fresh = dict(build_model().named_parameters())
    assert any(not torch.equal(fresh[n], w1[n]) for n in w1)


def test_trainer_rejects_global_batch_not_multiple_of_micro_batch(tmp_path):
    with pytest.raises(OlmoflowError, match="micro_batch_size"):
        Trainer(build_model(), train_config(global_batch_size=4, micro_batch_size=3),
                DataLoader(dataset(8), 4, seed=0), tmp_path, progress=False)


# --- exact resume ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n_instances,dropout",
    [
        (27, 0.0),  # 6 batches of 4 per epoch (3 dropped): the stop falls mid-epoch
        (27, 0.1),  # dropout: the RNG state must be restored too
        (20, 0.0),  # 5 batches per epoch: step 10 ends epoch 1 exactly
    ],
    ids=["mid-epoch", "dropout", "epoch-end"],
)
def test_resume_in_a_fresh_process_is_bit_exact(tmp_path, n_instances, dropout):
    if n_instances == 20:
        assert 10 % DataLoader(dataset(20), 4, seed=7).batches_per_epoch == 0

    straight = make_trainer(tmp_path / "straight", n_instances, dropout)
    straight.fit()
    for step in range(1, 21):  # the straight run's lr is the schedule's, step by step
        assert read_metrics(tmp_path / "straight")[step]["lr"] == straight.lr(step - 1)

    # The interrupted run crashes while fetching the batch of step 13: its last checkpoint is
    # step 10 (save_interval=10) and its log holds steps 11 and 12, which a resume must drop.
    run_until_crash(tmp_path / "resumed", n_instances, dropout, crash_at=13)
    ten = checkpoint_name("stage1", 10, 10 * 4 * 8)
    assert (tmp_path / "resumed" / "latest").read_text().strip() == ten == "stage1-step10-tokens320"
    assert max(read_metrics(tmp_path / "resumed")) == 12

    resumed = resume_in_fresh_process(tmp_path / "resumed", n_instances, dropout)
    assert_resume_exact(straight, tmp_path / "straight", resumed, tmp_path / "resumed", 10)


def test_resume_from_an_old_style_step_directory(tmp_path):
    """A checkpoint directory named ``stepN`` (before OLMo-style names) still resumes."""
    run_until_crash(tmp_path, 27, 0.0, crash_at=13)
    new = tmp_path / "stage1-step10-tokens320"
    new.rename(tmp_path / "step10")
    (tmp_path / "latest").unlink()
    t = make_trainer(tmp_path, 27, 0.0, checkpoint__resume_from="latest", max_steps=11)
    t.fit()
    assert t.step == 11 and sorted(read_metrics(tmp_path)) == list(range(1, 12))


def test_resume_without_checkpoint_is_user_error(tmp_path):
    t = make_trainer(tmp_path / "empty", 27, 0.0, checkpoint__resume_from="latest")
    with pytest.raises(OlmoflowError, match="no complete checkpoint"):
        t.fit()


def test_training_reduces_loss(tmp_path):
    # A repeating pattern is learnable in a few steps.
    arrays = [np.tile(np.arange(16, dtype=np.uint16), 40)]
    loader = DataLoader(InstanceDataset(arrays, SEQ), 4, seed=0)
    t = Trainer(build_model(), train_config(max_steps=30, optimizer__lr=1e-2), loader, tmp_path,
                progress=False)
    summary = t.fit()
    m = read_metrics(tmp_path)
    assert m[30]["loss"] < 0.5 * m[1]["loss"]
    assert summary["steps"] == 30
    assert Path(summary["checkpoint"]).name == "stage1-step30-tokens960"


def test_log_interval_zero_logs_only_the_last_step(tmp_path):
    t = make_trainer(tmp_path, 27, 0.0, max_steps=4, log__interval=0, checkpoint__save_interval=0)
    t.fit()
    assert sorted(read_metrics(tmp_path)) == [4]
    assert (tmp_path / "latest").read_text().strip() == "stage1-step4-tokens128"


# --- data loader ----------------------------------------------------------------------------------


def test_instances_tile_the_token_stream():
    arrays = token_arrays(5 * SEQ + 1)
    ds = InstanceDataset(arrays, SEQ)
    stream = np.concatenate(arrays).astype(np.int64)
    assert len(ds) == 5 and ds.total_tokens == len(stream)
    for i in range(len(ds)):
        np.testing.assert_array_equal(ds[i], stream[i * SEQ : i * SEQ + SEQ + 1])
    with pytest.raises(IndexError):
        ds[5]


def instance_index(ds: InstanceDataset) -> dict[bytes, int]:
    index = {ds[i].tobytes(): i for i in range(len(ds))}
    assert len(index) == len(ds), "random data should make every instance distinct"
    return index


def epoch_of_batches(loader: DataLoader, ds: InstanceDataset) -> list[int]:
    index = instance_index(ds)
    seen = []
    for _ in range(loader.batches_per_epoch):
        b = loader.next_batch()
        ids, labels = b.input_ids, b.labels
        assert ids.shape == labels.shape == (loader.batch_size, ds.sequence_length)
        assert ids.dtype == labels.dtype == torch.long
        assert torch.equal(ids[:, 1:], labels[:, :-1])  # labels are the inputs shifted by one
        full = torch.cat([ids, labels[:, -1:]], dim=1).numpy()
        seen += [index[row.tobytes()] for row in full]
    return seen


def test_each_epoch_sees_every_instance_exactly_once():
    ds = dataset(24)
    loader = DataLoader(ds, 4, seed=3)
    e0 = epoch_of_batches(loader, ds)
    e1 = epoch_of_batches(loader, ds)
    assert sorted(e0) == sorted(e1) == list(range(24))
    assert e0 != e1, "each epoch reshuffles"
    assert loader.epoch == 1


def test_remainder_is_dropped_per_epoch():
    ds = dataset(26)
    loader = DataLoader(ds, 4, seed=3)
    assert loader.batches_per_epoch == 6
    e0 = epoch_of_batches(loader, ds)
    assert len(e0) == len(set(e0)) == 24
    e1 = epoch_of_batches(loader, ds)
    assert len(set(e1)) == 24 and loader.epoch == 1


def test_order_depends_only_on_seed_and_epoch():
    ds = dataset(24)
    a, b = DataLoader(ds, 4, seed=3), DataLoader(ds, 8, seed=3)
    torch.manual_seed(0)
    np.random.seed(0)
    o = a.order(1)
    torch.manual_seed(99)
    np.random.seed(99)
    np.testing.assert_array_equal(o, b.order(1))  # nor on batch size or global RNG state
    assert not np.array_equal(a.order(0), a.order(1))
    assert not np.array_equal(a.order(0), DataLoader(ds, 4, seed=4).order(0))
    # The batches follow order(epoch).
    ids = a.next_batch().input_ids
    first = [ds[int(i)] for i in a.order(0)[:4]]
    np.testing.assert_array_equal(ids.numpy(), np.stack(first)[:, :-1])


def test_state_dict_resumes_the_same_sequence():
    ds = dataset(20)
    ref = DataLoader(ds, 4, seed=5)
    # 13 batches cross two epoch boundaries (5 per epoch)
    batches = [(b.input_ids, b.labels) for b in (ref.next_batch() for _ in range(13))]
    for cut in (0, 3, 5, 7, 10):
        loader = DataLoader(ds, 4, seed=5)
        for _ in range(cut):
            loader.next_batch()
        state = json.loads(json.dumps(loader.state_dict()))  # survives serialization
        fresh = DataLoader(ds, 4, seed=5)
        fresh.load_state_dict(state)
        for i in range(cut, 13):
            b = fresh.next_batch()
            ids, labels = b.input_ids, b.labels
            assert torch.equal(ids, batches[i][0]) and torch.equal(labels, batches[i][1]), (cut, i)


def test_too_little_data_is_user_error():
    with pytest.raises(OlmoflowError, match="fewer than one batch"):
        DataLoader(dataset(3), 4, seed=0)


# --- schedules ---------------------------------------------------------------------------------


def test_warmup_is_linear():
    for schedule in ("cosine", "linear", "wsd", "constant"):
        kw = {"lr": 1.0, "warmup_steps": 10, "max_steps": 100, "schedule": schedule}
        lrs = [lr_at(s, **kw) for s in range(10)]
        assert lrs == pytest.approx([(s + 1) / 10 for s in range(10)])
        assert lr_at(10, **kw) == pytest.approx(1.0)


def test_cosine_reaches_min_at_max_steps():
    kw = dict(lr=2.0, warmup_steps=10, max_steps=100, min_lr_ratio=0.1, schedule="cosine")
    lrs = [lr_at(s, **kw) for s in range(10, 101)]
    assert lrs[0] == pytest.approx(2.0)
    assert all(x >= y for x, y in zip(lrs, lrs[1:])), "decay is monotone"
    assert lr_at(55, **kw) == pytest.approx(0.2 + 0.5 * 1.8)  # half-way: mid-point of the cosine
    assert lr_at(100, **kw) == pytest.approx(0.2)
    assert lr_at(150, **kw) == pytest.approx(0.2)  # stays at the floor past the end
    assert lr_at(99, **kw) > 0.2


def test_linear_decays_to_floor():
    kw = dict(lr=1.0, warmup_steps=0, max_steps=10, min_lr_ratio=0.0, schedule="linear")
    assert [lr_at(s, **kw) for s in range(11)] == pytest.approx([1 - s / 10 for s in range(11)])


def test_wsd_shape():
    kw = dict(lr=1.0, warmup_steps=10, max_steps=100, min_lr_ratio=0.1, schedule="wsd")
    lrs = [lr_at(s, **kw) for s in range(101)]
    assert lrs[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])  # warmup
    assert lrs[10:80] == pytest.approx([1.0] * 70)  # stable
    assert lrs[80:] == pytest.approx([1.0 - 0.9 * (s - 80) / 20 for s in range(80, 101)])  # decay
    assert lrs[100] == pytest.approx(0.1)


def test_constant_schedule():
    assert lr_at(500, lr=0.3, warmup_steps=10, max_steps=100, schedule="constant") == 0.3


def test_unknown_schedule_is_user_error():
    with pytest.raises(OlmoflowError, match="unknown train.schedule.type 'cosin'.*cosine"):
        lr_at(0, lr=1.0, warmup_steps=0, max_steps=10, schedule="cosin")


def test_schedule_values_are_finite_for_degenerate_configs():
    for schedule in ("cosine", "linear", "wsd"):
        for warmup, max_steps in ((0, 1), (5, 5), (10, 3)):
            for s in range(12):
                v = lr_at(s, lr=1.0, warmup_steps=warmup, max_steps=max_steps, schedule=schedule)
                assert math.isfinite(v) and 0 < v <= 1.0
