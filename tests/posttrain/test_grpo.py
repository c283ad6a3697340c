"""GRPO: rollouts from the KV-cache decoder (seeded, masks), the rollout loader (advantages,
equal-group filtering, exact resume under the Trainer) and the objective (equal to a direct
``grpo_token_loss`` call, accumulation-invariant, and it learns)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from chat_models import chat_model, chat_tokenizer
from tolerance import assert_fp32_close, forward_terms

from olmoflow.config import from_dict
from olmoflow.errors import OlmoflowError
from olmoflow.infer.sampling import SamplingParams
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo
from olmoflow.posttrain.grpo import GRPOObjective
from olmoflow.posttrain.losses import group_advantages, grpo_token_loss, token_logps
from olmoflow.posttrain.rewards import RLPrompt, arithmetic_prompts
from olmoflow.posttrain.rollout import RolloutLoader, sample_rollouts, shifted_labels
from olmoflow.tokenizer import BPETokenizer
from olmoflow.train.config import TrainConfig
from olmoflow.train.distributed import DistInfo
from olmoflow.train.trainer import METRICS, Trainer

SAMPLE = SamplingParams(max_new_tokens=4, temperature=1.0)


@pytest.fixture(scope="module")
def tok():
    # 256 byte symbols + EOS + pad: one token per character
    return BPETokenizer().train_from_texts(["0123456789+-="], vocab_size=258)


def tiny_model(seed: int = 0) -> Olmo:
    torch.manual_seed(seed)
    return Olmo(ModelConfig(vocab_size=258, d_model=32, n_layers=2, n_heads=2, mlp_hidden=64,
                            max_sequence_length=64, sliding_window=None, vocab_pad_multiple=1))


PROMPTS = [RLPrompt("a", "3", text="1+2="), RLPrompt("b", "30", text="10+20="),
           RLPrompt("c", "9", text="99-90="), RLPrompt("d", "5", text="5+0=")]


def ascii_start(text: str, prompt: RLPrompt) -> float:
    """Toy reward: the response starts with a 7-bit ASCII character (about half the tokens)."""
    return float(bool(text) and text[0] < "\x80" and text[0] != "\ufffd")


def test_rollouts_seeded_and_masks(tok):
    model = tiny_model()
    kw = dict(group_size=3, sampling=SAMPLE, reward_fn=ascii_start)
    a = sample_rollouts(model, tok, PROMPTS[:2], seed=7, **kw)
    assert torch.equal(a.input_ids, sample_rollouts(model, tok, PROMPTS[:2], seed=7,
                                                    **kw).input_ids)
    assert not torch.equal(a.input_ids, sample_rollouts(model, tok, PROMPTS[:2], seed=8,
                                                        **kw).input_ids)
    assert model.training  # generate put the mode back
    # Make the token row 0 drew second the end-of-turn id: the same seed draws the same tokens
    # until each row stops, so row 0 now ends after 2 tokens and the rest is fill.
    Tp = a.prompt_length
    eot = int(a.input_ids[0, Tp + 1])
    b = sample_rollouts(model, tok, PROMPTS[:2], seed=7, eos_token_id=eot, **kw)
    assert b.prompt_length == Tp == len("10+20=")
    resp = b.input_ids[:, Tp:]
    for row in range(b.input_ids.shape[0]):
        hits = (resp[row] == eot).nonzero()
        end = int(hits[0]) + 1 if len(hits) else resp.shape[1]
        assert b.lengths()[row] == end
        assert b.response_mask[row, Tp:Tp + end].all() and not b.response_mask[row, Tp + end:].any()
        assert not b.response_mask[row, :Tp].any()
        n_prompt = len(PROMPTS[row // 3].text)
        expect_attn = torch.zeros_like(b.attention_mask[row])
        expect_attn[Tp - n_prompt:Tp + end] = True  # left padding off, fill after the end off
        assert torch.equal(b.attention_mask[row], expect_attn)
        assert (b.input_ids[row, :Tp - n_prompt] == tok.pad_token_id).all()
        assert (resp[row, end:] == tok.pad_token_id).all()  # generate's fill
        assert torch.equal(resp[row, :end], a.input_ids[row, Tp:Tp + end])
        assert b.texts[row] == tok.decode(resp[row, :end].tolist())
    assert b.lengths()[0] == 2
    lm = b.label_mask()
    assert torch.equal(lm[:, :-1], b.response_mask[:, 1:]) and not lm[:, -1].any()
    assert b.rewards.tolist() == [ascii_start(t, None) for t in b.texts]


def test_loader_advantages_and_equal_group_filtering(tok):
    def reward(text, prompt):  # prompts 'a', 'c': constant (all-equal groups); others vary
        return 0.0 if prompt.where in ("a", "c") else ascii_start(text, prompt)

    model = tiny_model()
    loader = RolloutLoader(model, tok, PROMPTS, prompts_per_step=4, group_size=4,
                           sampling=SAMPLE, seed=1, reward_fn=reward, old_logps=True)
    batch = loader.next_batch()
    ro, f = batch.rollouts, batch.fields
    g = ro.rewards.view(4, 4)
    varied = (g.amax(1) != g.amin(1)).repeat_interleave(4)
    assert varied.sum() > 0  # the draw has something to learn from (fixed seed)
    assert f["input_ids"].shape[0] == int(varied.sum())
    assert torch.equal(f["input_ids"], ro.input_ids[varied])
    assert torch.allclose(f["advantages"], group_advantages(ro.rewards, 4)[varied])
    kept = {ro.prompts[i // 4].where for i in varied.nonzero().squeeze(1).tolist()}
    assert kept <= {"b", "d"}
    assert batch.metrics["rollout/filtered_frac"] == 1 - int(varied.sum()) / 16
    assert batch.metrics["rollout/reward"] == pytest.approx(float(ro.rewards.mean()))
    assert batch.state == {"epoch": 0, "position": 4, "draws": 1, "seed": 1}
    assert f["old_logps"].shape == f["input_ids"].shape
    assert (f["old_logps"][~f["response_mask"]] == 0).all()
    assert (f["old_logps"][f["response_mask"]] < 0).all()

    # Every group equal: draw again up to max_draws, then keep the last draw with zero advantages.
    flat = RolloutLoader(model, tok, PROMPTS, prompts_per_step=2, group_size=2, sampling=SAMPLE,
                         seed=1, reward_fn=lambda t, p: 1.0, max_draws=3)
    b = flat.next_batch()
    assert b.metrics["rollout/draws"] == 3 and b.metrics["rollout/filtered_frac"] == 1
    assert b.fields["input_ids"].shape[0] == 4 and (b.fields["advantages"] == 0).all()
    assert b.state["position"] == 2 and b.state["epoch"] == 1  # 3 x 2 prompts of 4 taken

    with pytest.raises(OlmoflowError, match="group_size >= 2"):
        RolloutLoader(model, tok, PROMPTS, prompts_per_step=1, group_size=1, sampling=SAMPLE)


def _batch(tok, kl: bool = False, seed: int = 0):
    model = tiny_model(seed)
    ref = tiny_model(seed + 1) if kl else None
    loader = RolloutLoader(model, tok, PROMPTS, prompts_per_step=4, group_size=4,
                           sampling=SamplingParams(max_new_tokens=5, temperature=0.7),
                           seed=seed, reward_fn=ascii_start, filter_equal=False, ref_model=ref,
                           old_logps=True)
    batch = loader.next_batch()
    # Move the "sampling policy" away from the current one so the ratio clips somewhere.
    g = torch.Generator().manual_seed(seed)
    m = batch.fields["response_mask"]
    batch.fields["old_logps"] = batch.fields["old_logps"] + torch.randn(
        m.shape, generator=g) * 0.3 * m
    return model, batch


def test_without_old_logps_the_ratio_is_exactly_one(tok):
    """One update per rollout batch: the training forward's own log-probabilities, detached, are
    the sampling policy's; the loss is -mean(advantage) over response tokens, nothing clips, and
    the gradient equals the one with old_logps from the separate forward (the same policy)."""
    model, batch = _batch(tok)
    batch.fields.pop("old_logps")
    f = batch.fields
    obj = GRPOObjective()
    fields = obj.prepare(batch)  # the batch's sampling temperature (0.7) comes along
    assert "old_logps" not in fields
    norm = obj.normalizer(fields, DistInfo())
    loss, metrics = obj.loss(model, fields, norm)
    mask = f["response_mask"]
    want = -(f["advantages"][:, None] * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    assert metrics["clip_frac"] == 0 and metrics["ratio/mean"] == pytest.approx(1.0)
    loss.backward()
    g1 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(f["input_ids"], attention_mask=f["attention_mask"]).logits / 0.7
    logps, _ = token_logps(logits, shifted_labels(f["input_ids"], mask), mask)
    ref = grpo_token_loss(logps, logps.detach(), f["advantages"], mask, clip_low=0.2,
                          clip_high=0.272)
    ref.loss.backward()
    for a, p in zip(g1, model.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kl", [False, True])
def test_objective_equals_direct_grpo_token_loss(tok, kl):
    model, batch = _batch(tok, kl)
    obj = GRPOObjective(kl_coef=0.05 if kl else 0.0)
    fields = obj.prepare(batch)
    norm = obj.normalizer(fields, DistInfo())
    loss, metrics = obj.loss(model, fields, norm)

    f, mask = batch.fields, batch.fields["response_mask"]
    logits = model(f["input_ids"], attention_mask=f["attention_mask"]).logits / 0.7
    logps, _ = token_logps(logits, shifted_labels(f["input_ids"], mask), mask)
    ref = grpo_token_loss(logps, f["old_logps"], f["advantages"], mask, clip_low=0.2,
                          clip_high=0.272, kl_coef=0.05 if kl else 0.0,
                          ref_logps=f.get("ref_logps"))
    assert norm == int(mask.sum())
    assert loss.item() == pytest.approx(ref.loss.item(), rel=1e-5, abs=1e-7)
    assert metrics["clip_frac"] == pytest.approx(float(ref.stats["clip_ratio/region_mean"]))
    assert 0 < metrics["clip_frac"] < 1
    if kl:
        assert metrics["kl"] == pytest.approx(float(ref.stats["kl"])) and metrics["kl"] > 0
    lf = logits.detach().float()
    ent = torch.logsumexp(lf, -1) - (lf.softmax(-1) * lf).sum(-1)
    assert metrics["entropy"] == pytest.approx(float(ent[mask].mean()), rel=1e-5)
    step = obj.step_metrics(metrics)
    assert step["rollout/pass@4"] == batch.metrics["rollout/pass@4"] and "loss" in step


@pytest.mark.parametrize("loss_type", ["token", "sequence", "constant"])
def test_gradient_accumulation_equals_one_batch(tok, loss_type):
    model, batch = _batch(tok, seed=3)
    obj = GRPOObjective(loss_type=loss_type, max_length=5)

    def grads(micro: int):
        model.zero_grad()
        fields = obj.prepare(batch)
        norm = obj.normalizer(fields, DistInfo())
        total = {}
        chunks = {k: v.split(micro) for k, v in fields.items()}
        for i in range(len(chunks["input_ids"])):
            loss, m = obj.loss(model, {k: c[i] for k, c in chunks.items()}, norm)
            loss.backward()
            total = {k: total.get(k, 0.0) + v for k, v in m.items()}
        return [p.grad.clone() for p in model.parameters()], obj.step_metrics(total)

    one, m1 = grads(16)
    acc, m4 = grads(4)
    # another summation order of the same terms: bounded relative to each gradient's scale
    terms = forward_terms(model.config, batch.fields["input_ids"].shape[1],
                          tokens=int(batch.fields["response_mask"].sum()))
    for a, b in zip(one, acc, strict=True):
        assert_fp32_close(b, a, 4 * terms, ulps=16)
    for k in ("loss", "entropy", "clip_frac"):
        assert m4[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-8)


def _trainer(tok, folder: Path, max_steps: int, resume: bool):
    model = tiny_model(5)
    loader = RolloutLoader(model, tok, PROMPTS, prompts_per_step=3, group_size=4,
                           sampling=SAMPLE, seed=2, reward_fn=ascii_start)
    cfg = from_dict(TrainConfig, {
        "sequence_length": 16, "global_batch_size": 12, "micro_batch_size": 4,
        "max_steps": max_steps, "num_threads": 1, "optimizer": {"lr": 3e-3},
        "schedule": {"type": "constant", "warmup_steps": 0}, "log": {"interval": 1},
        "checkpoint": {"save_interval": 2, "resume_from": "latest" if resume else None}},
        "train.")
    return Trainer(model, cfg, loader, folder, progress=False, objective=GRPOObjective())


def test_exact_resume_straight_vs_interrupted(tok, tmp_path):
    straight = _trainer(tok, tmp_path / "a", 4, False)
    straight.fit()
    _trainer(tok, tmp_path / "b", 2, False).fit()
    resumed = _trainer(tok, tmp_path / "b", 4, True)
    resumed.fit()
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    assert resumed.loader.state_dict() == straight.loader.state_dict()

    def rows(d):
        return [{k: v for k, v in json.loads(ln).items() if "_s" not in k and k != "tokens_per_s"}
                for ln in (d / METRICS).read_text().splitlines()]
    a, b = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert [r["step"] for r in b] == [1, 2, 3, 4] and a == b
    assert any(r["grad_norm"] > 0 for r in a)  # the steps did update the policy


def test_grpo_raises_the_reward(tok, tmp_path):
    """A few steps on a toy reward (start with an ASCII character, about half the tokens) raise
    the mean reward of the samples; with the advantage's sign flipped they would lower it."""
    torch.manual_seed(0)
    model = tiny_model(11)
    prompts = arithmetic_prompts(32, form="bare", max_operand=20)
    loader = RolloutLoader(model, tok, prompts, prompts_per_step=8, group_size=8,
                           sampling=SamplingParams(max_new_tokens=1, temperature=1.0), seed=0,
                           reward_fn=ascii_start)
    cfg = from_dict(TrainConfig, {
        "sequence_length": 16, "global_batch_size": 64, "micro_batch_size": 64,
        "max_steps": 12, "num_threads": 1, "optimizer": {"lr": 3e-2},
        "schedule": {"type": "constant", "warmup_steps": 0}, "log": {"interval": 1},
        "checkpoint": {"save_interval": 0}}, "train.")
    Trainer(model, cfg, loader, tmp_path, progress=False, objective=GRPOObjective()).fit()
    r = [json.loads(ln)["rollout/reward"] for ln in (tmp_path / METRICS).read_text().splitlines()]
    assert sum(r[-3:]) / 3 > sum(r[:3]) / 3 + 0.25, r

def test_rl_with_kl_coef_trains(tmp_path):
    """``rl.kl_coef > 0`` used to stop at the first step with an internal message ("build the
    RolloutLoader with ref_model="): the stage now gives the loader a frozen copy of the base."""
    from olmoflow.pipeline.config import load_config
    from olmoflow.pipeline.stages.posttrain import run_rl

    tok = chat_tokenizer()
    model = chat_model(tok)
    base = tmp_path / "base"
    model.save_pretrained(base, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tok.save(base)
    cfg = load_config("tiny", [
        f"run_dir={tmp_path / 'run'}", f"rl.base={base}", "rl.prompts.source=arithmetic",
        "rl.prompts.count=8", "rl.prompts.heldout=0", "rl.kl_coef=0.1", "rl.group_size=2",
        "rl.prompts_per_step=2", "rl.max_new_tokens=4", "rl.temperature=2.0",
        "rl.train.max_steps=2", "rl.train.global_batch_size=4", "rl.train.micro_batch_size=4",
        "rl.train.optimizer.lr=1e-2", "rl.eval_interval=0"])
    result = run_rl(cfg, progress=False)
    assert result.counts["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "rl" / "metrics.jsonl").open()]
    assert all("kl" in r for r in rows if "step" in r)
