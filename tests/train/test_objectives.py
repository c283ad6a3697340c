"""The trainer's seams: an objective written here trains through the same Trainer (with exact
resume of its own state), and callbacks run in the loop without changing the training numbers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from resume_helpers import SEQ, build_model, dataset, read_metrics, tiny_model_config, train_config
from tolerance import forward_terms, fp32_rel

from olmoflow.errors import OlmoflowError
from olmoflow.model.olmo import IGNORE_INDEX
from olmoflow.train import distributed
from olmoflow.train.callbacks import Callback
from olmoflow.train.loader import DataLoader
from olmoflow.train.objectives import LMObjective, Objective
from olmoflow.train.trainer import Trainer


class WeightedCE(Objective):
    """A toy objective: cross-entropy from the logits (the model computes no loss), each sequence
    weighted by a per-row field ``[B]`` derived from its first token, normalised by the global
    weighted target count. It keeps a running count and loss sum as its state."""

    name = "weighted_ce"

    def __init__(self):
        self.micro_batches = 0
        self.loss_sum = torch.zeros((), dtype=torch.float64)

    def prepare(self, raw) -> dict[str, torch.Tensor]:
        weights = 1.0 + (raw.input_ids[:, 0] % 3).float()  # [B]: 1, 2 or 3
        return {"input_ids": raw.input_ids, "labels": raw.labels, "weights": weights}

    def normalizer(self, batch, dist) -> float:
        per_row = (batch["labels"] != IGNORE_INDEX).sum(1).float() * batch["weights"]
        return distributed.all_reduce_sum(float(per_row.sum()), dist)

    def loss(self, model, micro_batch, normalizer):
        logits = model(micro_batch["input_ids"]).logits.float()
        ce = F.cross_entropy(logits.flatten(0, 1), micro_batch["labels"].flatten(),
                             ignore_index=IGNORE_INDEX, reduction="none").view(logits.shape[:2])
        loss = (ce * micro_batch["weights"][:, None]).sum() / normalizer
        self.micro_batches += 1
        self.loss_sum += loss.detach().double()
        return loss, {"weighted_ce": loss.item()}

    def step_metrics(self, totals):
        return {"loss": totals["weighted_ce"], **totals}

    def state_dict(self):
        return {"micro_batches": self.micro_batches, "loss_sum": self.loss_sum.clone()}

    def load_state_dict(self, state):
        self.micro_batches = state["micro_batches"]
        self.loss_sum = state["loss_sum"].clone()


class Crash(Exception):
    pass


def trainer(folder: Path, objective: Objective | None = None, callbacks=(), dropout: float = 0.0,
            crash_at: int | None = None, **cfg_kw) -> Trainer:
    cfg = train_config(**{"max_steps": 12, "checkpoint__save_interval": 5, **cfg_kw})
    loader = DataLoader(dataset(27), cfg.global_batch_size, seed=7)
    if crash_at is not None:  # fail while fetching the batch of step crash_at
        fetch, calls = loader.next_batch, []

        def next_batch():
            calls.append(1)
            if len(calls) == crash_at:
                raise Crash
            return fetch()

        loader.next_batch = next_batch
    return Trainer(build_model(seed=0, dropout=dropout), cfg, loader, folder, progress=False,
                   objective=objective, callbacks=list(callbacks))


def weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def assert_same_weights(a: Trainer, b: Trainer) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


# --- a test-defined objective ---------------------------------------------------------------------


def test_toy_objective_trains_through_the_trainer_and_differs_from_lm(tmp_path):
    toy = trainer(tmp_path / "toy", WeightedCE())
    toy.fit()
    lm = trainer(tmp_path / "lm")
    lm.fit()
    m_toy, m_lm = read_metrics(tmp_path / "toy"), read_metrics(tmp_path / "lm")
    assert "weighted_ce" in m_toy[1] and "ce_loss" not in m_toy[1]
    assert m_toy[12]["loss"] < m_toy[1]["loss"]  # it learns
    assert m_toy[1]["loss"] != m_lm[1]["loss"]  # another loss, on the same first batch
    # 4 instances in micro-batches of 2: two micro-batches per step
    assert toy.objective.micro_batches == 2 * 12
    assert toy.state()["objective"]["name"] == "weighted_ce"


def test_toy_objective_accumulation_equals_one_batch(tmp_path):
    """The objective's normaliser is global: micro-batches of 1 give the step of one batch of 4."""
    one = trainer(tmp_path / "one", WeightedCE(), micro_batch_size=4, max_steps=3)
    one.fit()
    four = trainer(tmp_path / "four", WeightedCE(), micro_batch_size=1, max_steps=3)
    four.fit()
    a, b = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "four")
    # The same sums in another order (tolerance.py): one ulp per accumulated term of the loss,
    # two of the gradient norm (back through the same sums).
    terms = forward_terms(tiny_model_config(), SEQ, tokens=4 * SEQ)
    for step in (1, 2, 3):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=fp32_rel(terms), abs=0)
        assert b[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"],
                                                     rel=fp32_rel(terms, 2), abs=0)
    assert four.objective.micro_batches == 4 * one.objective.micro_batches


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["plain", "dropout"])
def test_toy_objective_resume_is_bit_exact(tmp_path, dropout):
    straight = trainer(tmp_path / "straight", WeightedCE(), dropout=dropout)
    straight.fit()
    with pytest.raises(Crash):  # checkpoint at step 5 (and 10); crashes fetching step 8
        trainer(tmp_path / "resumed", WeightedCE(), dropout=dropout, crash_at=8).fit()
    torch.manual_seed(999)  # resume must restore every RNG, not inherit this one
    np.random.seed(999)
    resumed = trainer(tmp_path / "resumed", WeightedCE(), dropout=dropout,
                      checkpoint__resume_from="latest")
    resumed.fit()
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert sorted(a) == sorted(b) == list(range(1, 13))
    for step in range(6, 13):
        for key in ("loss", "weighted_ce", "grad_norm", "lr", "tokens"):
            assert b[step][key] == a[step][key], (step, key)
    assert_same_weights(straight, resumed)
    sa, sb = straight.objective.state_dict(), resumed.objective.state_dict()
    assert sa["micro_batches"] == sb["micro_batches"] == 24
    assert torch.equal(sa["loss_sum"], sb["loss_sum"])


def test_resume_under_another_objective_is_refused(tmp_path):
    trainer(tmp_path, max_steps=5).fit()
    with pytest.raises(OlmoflowError, match="'lm' objective, not 'weighted_ce'"):
        trainer(tmp_path, WeightedCE(), max_steps=6, checkpoint__resume_from="latest").fit()


def test_objective_state_must_be_plain_data(tmp_path):
    class Opaque(WeightedCE):
        def state_dict(self):
            return {"thing": object()}

    t = trainer(tmp_path, Opaque(), max_steps=1)
    with pytest.raises(OlmoflowError, match="objective 'weighted_ce' state.thing holds a object"):
        t.fit()


def test_lm_objective_prepares_loader_batches_and_mappings():
    lm = LMObjective()
    batch = DataLoader(dataset(8), 4, seed=0).next_batch()
    fields = lm.prepare(batch)
    assert sorted(fields) == ["input_ids", "labels"]  # no doc_ids without intra-document masking
    mapping = {"input_ids": batch.input_ids, "labels": batch.labels}
    assert lm.prepare(mapping).keys() == fields.keys()
    with pytest.raises(OlmoflowError, match="needs input_ids and labels"):
        lm.prepare({"input_ids": batch.input_ids})


def test_fields_must_share_the_batch_dimension(tmp_path):
    class Ragged(WeightedCE):
        def prepare(self, raw):
            return {**super().prepare(raw), "weights": torch.ones(3)}

    t = trainer(tmp_path, Ragged())
    with pytest.raises(OlmoflowError, match="share the batch dimension"):
        t.train_step(t.loader.next_batch())


# --- callbacks ------------------------------------------------------------------------------------


class Probe(Callback):
    """An in-loop evaluation that does what evaluations do: eval mode, random numbers, a forward."""

    def __init__(self, interval: int):
        super().__init__(interval)
        self.steps: list[int] = []

    def on_step(self, trainer, step):
        self.steps.append(step)
        trainer.model.eval()
        ids = torch.randint(0, 64, (2, 8))  # draws from the global RNG that dropout also uses
        np.random.rand()
        loss = trainer.model(ids, ids).loss
        return {"probe_loss": loss.item(), "eval/already_prefixed": float(step)}


def test_callback_fires_every_n_steps_and_changes_no_training_number(tmp_path):
    plain = trainer(tmp_path / "plain", dropout=0.1, log__interval=4)
    plain.fit()
    probe, never = Probe(3), Probe(0)
    probed = trainer(tmp_path / "probed", dropout=0.1, log__interval=4, callbacks=[probe, never])
    np_before = np.random.get_state()[1].copy()
    probed.fit()
    assert np.array_equal(np.random.get_state()[1], np_before)  # the probe's draw was undone
    assert probe.steps == [3, 6, 9, 12] and never.steps == []
    a, b = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "probed")
    assert sorted(a) == [4, 8, 12]
    assert sorted(b) == [3, 4, 6, 8, 9, 12]  # a callback's metrics get a line at its step
    for step in (3, 6, 9, 12):
        assert np.isfinite(b[step]["eval/probe_loss"]) and b[step]["eval/already_prefixed"] == step
    assert "eval/probe_loss" not in b[4] and "eval/probe_loss" not in b[8]
    for step in (4, 8, 12):
        for key in ("loss", "grad_norm", "lr"):
            assert a[step][key] == b[step][key], (step, key)
    assert_same_weights(plain, probed)
    assert probed.model.training


def test_callback_fires_at_the_right_steps_after_a_resume(tmp_path):
    first = Probe(3)
    with pytest.raises(Crash):  # checkpoint at 5; crashes fetching step 8
        trainer(tmp_path, callbacks=[first], crash_at=8).fit()
    assert first.steps == [3, 6]
    again = Probe(3)
    t = trainer(tmp_path, callbacks=[again], checkpoint__resume_from="latest")
    t.fit()
    assert again.steps == [6, 9, 12]  # from step 6, the first after the checkpoint at 5
    m = read_metrics(tmp_path)
    assert [s for s in sorted(m) if "eval/probe_loss" in m[s]] == [3, 6, 9, 12]


def test_callback_interval_must_not_be_negative():
    with pytest.raises(ValueError, match="interval must be >= 0"):
        Callback(-1)
