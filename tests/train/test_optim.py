"""The knobs of the optimizer step: skip-step AdamW skips spikes and nothing else, Muon trains,
resume is bit-exact with each optimizer (in a fresh process), bf16 autocast keeps fp32 weights and
tracks fp32, and activation checkpointing recomputes blocks without changing the gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from resume_helpers import (
    SEQ,
    assert_resume_exact,
    build_model,
    make_trainer,
    read_metrics,
    resume_in_fresh_process,
    run_until_crash,
    tiny_model_config,
    train_config,
)
from tolerance import assert_fp32_close, forward_terms

from olmoflow.model.olmo import Block
from olmoflow.train.loader import DataLoader, InstanceDataset
from olmoflow.train.optim import OptimizerList, SkipStepAdamW, muon_params
from olmoflow.train.trainer import Trainer


def pattern_trainer(folder, **cfg_kw) -> Trainer:
    """A repeating token pattern: learnable in a few dozen steps."""
    arrays = [np.tile(np.arange(16, dtype=np.uint16), 40)]
    loader = DataLoader(InstanceDataset(arrays, SEQ), 4, seed=0)
    return Trainer(build_model(), train_config(**{"max_steps": 30, **cfg_kw}), loader, folder,
                   progress=False)


def weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# --- skip-step AdamW ------------------------------------------------------------------------------


def test_skip_step_decision_follows_the_rolling_history():
    opt = SkipStepAdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.1, sigma=3.0, window=8)
    assert not opt.observe(1e9, 1.0)  # no history yet: never skip on a value alone
    opt.losses, opt.grad_norms = [], []
    for i in range(3):
        assert not opt.observe(5.0 + 0.1 * (i % 2), 1.0 + 0.1 * (i % 2))
    assert not opt.observe(50.0, 1.0)  # 3 earlier values < window // 2: not enough history yet
    opt.losses, opt.grad_norms = [5.0, 5.1] * 4, [1.0, 1.1] * 4
    assert not opt.observe(5.2, 1.1)  # within mean + 3 std (std ~0.05)
    assert opt.observe(5.4, 1.0)  # the loss spikes
    assert opt.observe(5.0, 1.5)  # the grad norm spikes
    assert not opt.observe(4.0, 0.5)  # drops are not spikes
    assert opt.observe(math.nan, 1.0) and opt.observe(5.0, math.inf)  # non-finite: always skipped
    assert len(opt.losses) == len(opt.grad_norms) == 8  # the window; non-finite values left out
    assert all(math.isfinite(v) for v in opt.losses + opt.grad_norms)


def test_skip_step_adamw_skips_an_injected_spike_and_only_it(tmp_path):
    plain = pattern_trainer(tmp_path / "plain", max_steps=12)
    skip = pattern_trainer(tmp_path / "skip", max_steps=12, optimizer__type="skip_step_adamw",
                           optimizer__skip_step_window=8, optimizer__skip_step_sigma=6.0)
    assert isinstance(skip.optimizer, SkipStepAdamW)
    batches = [plain.loader.next_batch() for _ in range(12)]
    for b in batches[:10]:  # no spike: exactly AdamW, step for step
        mp = plain.train_step(b)
        ms = skip.train_step(b)
        assert ms["skipped"] == 0 and ms["loss"] == mp["loss"]
    for (n, a), b in zip(plain.model.named_parameters(), skip.model.parameters()):
        assert torch.equal(a, b), n

    # Step 11: the loss (and so every gradient) is scaled by 100, a spike in loss and grad norm.
    forward = skip.model.forward

    def spiking_forward(*args, **kw):
        out = forward(*args, **kw)
        out.loss, out.ce_loss, out.z_loss = out.loss * 100, out.ce_loss * 100, out.z_loss * 100
        return out

    before, moments = weights(skip.model), {p: {k: v.clone() for k, v in s.items()}
                                            for p, s in skip.optimizer.state.items()}
    skip.model.forward = spiking_forward
    m = skip.train_step(batches[10])
    skip.model.forward = forward
    assert m["skipped"] == 1 and m["loss"] > 50 * mp["loss"]
    after = weights(skip.model)
    assert all(torch.equal(before[n], after[n]) for n in before), "a skipped step moved weights"
    for p, s in skip.optimizer.state.items():
        assert all(torch.equal(v, moments[p][k]) for k, v in s.items()), "moments changed"
    m = skip.train_step(batches[11])  # the next step is normal
    assert m["skipped"] == 0
    assert any(not torch.equal(after[n], p) for n, p in skip.model.named_parameters())


# --- Muon -----------------------------------------------------------------------------------------


def test_muon_owns_the_hidden_matrices_and_trains(tmp_path):
    t = pattern_trainer(tmp_path, optimizer__type="muon", optimizer__lr=1e-2,
                        optimizer__muon_lr=0.02)
    assert isinstance(t.optimizer, OptimizerList)
    adamw, muon = t.optimizer.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    hidden = {id(p) for p in muon_params(t.model)}
    names = {id(p): n for n, p in t.model.named_parameters()}
    muon_names = sorted(names[id(p)] for g in muon.param_groups for p in g["params"])
    assert muon_names == sorted(names[i] for i in hidden)
    assert all(n.startswith("blocks.") and n.endswith(".weight") and "norm" not in n
               for n in muon_names)
    assert len(muon_names) == 2 * 7  # per block: q, k, v, o and the three MLP matrices
    adamw_names = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert {"embeddings.weight", "lm_head.weight", "norm.weight"} <= adamw_names
    assert not adamw_names & set(muon_names)
    t.fit()
    m = read_metrics(tmp_path)
    assert m[30]["loss"] < 0.5 * m[1]["loss"]
    # Muon's lr follows the same schedule, peaking at muon_lr.
    assert muon.param_groups[0]["lr"] == pytest.approx(m[30]["lr"] / 1e-2 * 0.02, rel=1e-12)


# --- exact resume with each optimizer, in a fresh process ---------------------------------------


@pytest.mark.parametrize("cfg_kw", [
    dict(optimizer__type="muon"),
    # a small window and sigma make skips happen on both sides of the resume
    dict(optimizer__type="skip_step_adamw", optimizer__skip_step_window=4,
         optimizer__skip_step_sigma=0.5),
], ids=["muon", "skip_step_adamw"])
def test_resume_in_a_fresh_process_is_bit_exact_with_each_optimizer(tmp_path, cfg_kw):
    straight = make_trainer(tmp_path / "straight", 27, 0.0, **cfg_kw)
    straight.fit()
    run_until_crash(tmp_path / "resumed", 27, 0.0, crash_at=13, **cfg_kw)
    resumed = resume_in_fresh_process(tmp_path / "resumed", 27, 0.0, **cfg_kw)
    assert_resume_exact(straight, tmp_path / "straight", resumed, tmp_path / "resumed", 10)
    if cfg_kw["optimizer__type"] == "skip_step_adamw":
        skipped = [s for s, r in read_metrics(tmp_path / "straight").items() if r["skipped"]]
        assert any(s <= 10 for s in skipped) and any(s > 10 for s in skipped), skipped


# --- precision ------------------------------------------------------------------------------------


def test_bf16_autocast_tracks_fp32_with_fp32_master_weights(tmp_path):
    runs = {}
    for precision in ("fp32", "bf16", "auto"):
        t = pattern_trainer(tmp_path / precision, max_steps=8, precision=precision)
        t.fit()
        assert all(p.dtype == torch.float32 for p in t.model.parameters())
        assert all(v.dtype == torch.float32 for s in t.optimizer.state.values()
                   for k, v in s.items() if k != "step")
        runs[precision] = [read_metrics(tmp_path / precision)[s]["loss"] for s in range(1, 9)]
    assert runs["auto"] == runs["fp32"]  # on CPU, auto means fp32
    assert runs["bf16"] != runs["fp32"]  # autocast really ran in bf16 ...
    # ... and tracks fp32. bf16 keeps 8 significant bits: each matmul input rounds by up to 2^-9
    # of itself (the sums stay fp32), and the errors, random in sign, largely average out over the
    # batch's tokens; 0.03 is 4 bf16 ulps (2^-7) of the loss, for 8 steps of drift.
    assert runs["bf16"] == pytest.approx(runs["fp32"], rel=4 * 2**-7)


# --- activation checkpointing ---------------------------------------------------------------------


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_checkpointing_recomputes_blocks_with_equal_gradients(tmp_path, dropout):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (4, SEQ), generator=g)
    labels = torch.randint(0, 64, (4, SEQ), generator=g)
    grads, calls = {}, {}
    for n in (0, 1, 2):
        model = build_model(n_layers=3, dropout=dropout)
        t = Trainer(model, train_config(activation_checkpointing=n), DataLoader(
            InstanceDataset([np.zeros(100, np.uint16)], SEQ), 4, seed=0), tmp_path, progress=False)
        counts = [0] * 3
        for i, block in enumerate(model.blocks):
            block.register_forward_pre_hook(
                lambda *_, i=i, counts=counts: counts.__setitem__(i, counts[i] + 1))
        model.train()
        torch.manual_seed(0)  # the same dropout masks in every run
        model(ids, labels).loss.backward()
        grads[n] = {k: p.grad.clone() for k, p in model.named_parameters()}
        calls[n] = counts
        assert t.model.activation_checkpointing == n
    # blocks 0 and 2 run again in backward
    assert calls == {0: [1, 1, 1], 1: [2, 2, 2], 2: [2, 1, 2]}
    # The recomputed forward is the same code on the same inputs, but backward reaches the
    # residual sums through another graph and may add their terms in another order: two fp32 ulps
    # per accumulated term of each gradient tensor's scale (tolerance.py).
    terms = forward_terms(tiny_model_config(n_layers=3), SEQ, tokens=4 * SEQ)
    for n in (1, 2):
        for k in grads[0]:
            assert_fp32_close(grads[n][k], grads[0][k], terms, 2, msg=k)
    assert isinstance(model.blocks[0], Block)
