"""DPO on the shared Trainer: batches and their labels, the seeded resumable loader, the cached
reference log-probabilities, the objective against the formula, accumulation, learning, exact
resume, and the shared preference data."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from chat_models import chat_model, chat_tokenizer
from tolerance import assert_fp32_close, forward_terms, fp32_rel

from olmoflow.config import from_dict
from olmoflow.errors import OlmoflowError
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import IGNORE_INDEX, Olmo
from olmoflow.pipeline.stages.posttrain import Base, check_same_tokenizer
from olmoflow.posttrain.data import preference_examples
from olmoflow.posttrain.dpo import (
    REFERENCE_FILE,
    REFERENCE_KEY_FILE,
    DPOObjective,
    PreferenceDataset,
    PreferenceLoader,
    ReferenceCache,
    build_dpo_data,
    reference_logps,
)
from olmoflow.posttrain.losses import sequence_logps
from olmoflow.tokenizer import BPETokenizer
from olmoflow.tokenizer.chat import add_chat_template
from olmoflow.train import distributed
from olmoflow.train.config import TrainConfig
from olmoflow.train.trainer import METRICS, Trainer

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
TEXTS = ["Hello world! The cat sat on the mat. What is 2+2? It is 4.\n\nSure thing (yes).",
         "def add(a, b):\n    return a + b\n# user, assistant, system, Human, Assistant"]
LN2 = math.log(2.0)

PAIRS = [
    {"prompt": "What is 2+2?", "chosen": "It is 4.", "rejected": "The cat sat on the mat."},
    {"prompt": "Say hello.", "chosen": "Hello world!", "rejected": "def add(a, b): return"},
    {"prompt": "Where did the cat sit?", "chosen": "On the mat.", "rejected": "It is 4, yes."},
    {"prompt": "Add a and b.", "chosen": "return a + b", "rejected": "Sure thing (yes). Hello!"},
    {"prompt": "Be brief.", "chosen": "Yes.", "rejected": "Sure thing, the cat sat on the mat."},
    {"prompt": "What is 2+2? Explain.", "chosen": "2+2 is 4.", "rejected": "Hello."},
    {"prompt": "Name an animal.", "chosen": "The cat.", "rejected": "def add"},
    {"prompt": "Greet me.", "chosen": "Hello world! Sure thing.", "rejected": "a + b"},
]


@pytest.fixture(scope="module")
def tok() -> BPETokenizer:
    t = BPETokenizer().train_from_texts(TEXTS * 8, vocab_size=300)
    add_chat_template(t, "tulu")
    return t


def tiny_model(tok, seed: int = 0, max_sequence_length: int = 128) -> Olmo:
    torch.manual_seed(seed)
    vocab = ModelConfig(vocab_pad_multiple=8).padded_vocab_size(tok.vocab_size)
    return Olmo(ModelConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=2, mlp_hidden=64,
                            max_sequence_length=max_sequence_length, sliding_window=None,
                            vocab_pad_multiple=8))


def data(tok, records=PAIRS, **kw):
    return build_dpo_data(records, "tulu", tok, 96, **kw)[0]


def dist1() -> distributed.DistInfo:
    return distributed.init_from_env()


def train_cfg(**kw) -> TrainConfig:
    tree = {"sequence_length": 96, "global_batch_size": 4, "micro_batch_size": 4,
            "max_steps": 6, "num_threads": 1, "precision": "fp32",
            "optimizer": {"lr": 1e-2, "weight_decay": 0.0},
            "schedule": {"type": "constant", "warmup_steps": 0},
            "checkpoint": {"save_interval": 3}, "log": {"interval": 1}}
    for k, v in kw.items():
        section, _, key = k.partition("__")
        if key:
            tree.setdefault(section, {})[key] = v
        else:
            tree[k] = v
    return from_dict(TrainConfig, tree, "train.")


def with_reference(tok, model, records=PAIRS, tmp=None):
    ds = data(tok, records)
    sums, counts = ReferenceCache(tmp, "ref").get(ds, model, batch_size=3) if tmp else (
        None, None)
    if sums is None:
        ds.attach_reference(reference_logps(model, ds, batch_size=3), ds.response_counts())
    return ds


# ---------------------------------------------------------------------------------------------
# Batches and the loader


def test_batches_hold_next_token_labels_on_responses_only(tok):
    ds = data(tok)
    lengths = ds.lengths()
    b = ds.collate([5, 0, 2])
    T = int(lengths[[5, 0, 2]].max()) - 1  # padded to this batch's own longest sequence
    assert b["input_ids"].shape == b["labels"].shape == (3, 2, T)
    assert b["index"].tolist() == [5, 0, 2] and "ref_logps" not in b
    counts = ds.response_counts()
    for r, i in enumerate([5, 0, 2]):
        for k in (0, 1):
            ids, labels, n = b["input_ids"][r, k], b["labels"][r, k], int(b["lengths"][r, k])
            assert n == lengths[i, k] - 1
            assert (labels[n:] == IGNORE_INDEX).all() and (ids[n:] == tok.pad_token_id).all()
            on = labels != IGNORE_INDEX
            assert int(on.sum()) == int(counts[i, k]) > 0
            # a target is the next input token; the prompt is never a target
            assert torch.equal(labels[:n - 1][on[:n - 1]], ids[1:n][on[:n - 1]])
            assert not on[: len(build_prompt(tok, i)) - 1].any()
    # the rendered pair is prompt + response: decoding the targets gives the response text
    got = tok.decode(b["labels"][1, 0][b["labels"][1, 0] != IGNORE_INDEX].tolist())
    assert PAIRS[0]["chosen"] in got


def build_prompt(tok, i):
    from olmoflow.posttrain.data import preference_examples

    return list(preference_examples([PAIRS[i]], "tulu", tok, 96))[0].prompt_ids


def test_loader_is_seeded_per_epoch_and_resumes_exactly(tok):
    ds = data(tok)
    loader = PreferenceLoader(ds, 3, seed=11)  # 8 pairs: 2 batches an epoch, 2 pairs dropped
    batches = [loader.next_batch() for _ in range(5)]
    want0 = np.random.Generator(np.random.PCG64([11, 0])).permutation(8)
    want1 = np.random.Generator(np.random.PCG64([11, 1])).permutation(8)
    got = [b["index"].tolist() for b in batches]
    assert got[:2] == [want0[:3].tolist(), want0[3:6].tolist()]
    assert got[2:4] == [want1[:3].tolist(), want1[3:6].tolist()] and loader.epoch == 2
    json.dumps(batches[2].state)  # plain data
    again = PreferenceLoader(ds, 3, seed=11)
    again.load_state_dict(batches[2].state)
    nxt = again.next_batch()
    assert nxt["index"].tolist() == got[3] and torch.equal(nxt["input_ids"],
                                                           batches[3]["input_ids"])
    with pytest.raises(OlmoflowError, match="seed 11"):
        PreferenceLoader(ds, 3, seed=12).load_state_dict(batches[2].state)
    fewer = data(tok, PAIRS[:7])
    with pytest.raises(OlmoflowError, match="8 pairs"):
        PreferenceLoader(fewer, 3, seed=11).load_state_dict(batches[2].state)
    other = data(tok, [PAIRS[1], *PAIRS[1:]])
    with pytest.raises(OlmoflowError, match="other preference pairs"):
        PreferenceLoader(other, 3, seed=11).load_state_dict(batches[2].state)
    with pytest.raises(OlmoflowError, match="fewer than one batch"):
        PreferenceLoader(ds, 9, seed=0)


def test_build_dpo_data_limit_and_errors(tok):
    ds, stats = build_dpo_data(PAIRS, "tulu", tok, 96, limit=3)
    assert len(ds) == 3 and stats.read == 3
    with pytest.raises(OlmoflowError, match="no preference pairs"):
        build_dpo_data(PAIRS, "tulu", tok, 4)  # nothing fits
    with pytest.raises(OlmoflowError, match="did you mean 'sigmoid'"):
        DPOObjective("sigmod")
    with pytest.raises(OlmoflowError, match="beta"):
        DPOObjective(beta=0)
    with pytest.raises(OlmoflowError, match="needs the reference"):
        DPOObjective().prepare(ds.collate([0, 1]))
    assert "ref_logps" not in DPOObjective("simpo").prepare(ds.collate([0, 1]))


# ---------------------------------------------------------------------------------------------
# The objective


def test_identical_chosen_and_rejected_give_exactly_ln2(tok):
    # The readers skip such pairs (they train nothing); the loss itself is checked on a dataset
    # made from the examples directly.
    model = tiny_model(tok)
    exs = [dataclasses.replace(e, rejected_ids=e.chosen_ids, rejected_mask=e.chosen_mask)
           for e in preference_examples(PAIRS[:4], "tulu", tok, 96)]
    ds = PreferenceDataset(exs, 96, tok.pad_token_id)
    ds.attach_reference(reference_logps(model, ds, batch_size=3), ds.response_counts())
    batch = DPOObjective().prepare(PreferenceLoader(ds, 4, seed=0).next_batch())
    for loss_type in ("sigmoid", "length_normalized"):
        obj = DPOObjective(loss_type, beta=0.5)
        loss, m = obj.loss(model, batch, obj.normalizer(batch, dist1()))
        assert loss.item() == pytest.approx(LN2, rel=0, abs=1e-7)
        assert m["rewards/margins"] == 0.0 and m["rewards/accuracies"] == 0.0


@pytest.mark.parametrize("loss_type", ["sigmoid", "length_normalized"])
def test_policy_equal_to_reference_gives_ln2_at_step0(tok, loss_type):
    model = tiny_model(tok)
    ds = with_reference(tok, model)  # the reference ran over other batches (other padding)
    obj = DPOObjective(loss_type, beta=5.0 if loss_type == "length_normalized" else 0.1)
    batch = obj.prepare(PreferenceLoader(ds, 8, seed=3).next_batch())
    loss, m = obj.loss(model, batch, obj.normalizer(batch, dist1()))
    cfg = model.config
    tol = obj.beta * fp32_rel(forward_terms(cfg, batch["input_ids"].shape[-1], tokens=40), 8)
    assert abs(loss.item() - LN2) <= tol
    assert abs(m["rewards/margins"]) <= 8 * tol


def direct_losses(model, batch, loss_type, beta, eps, gamma):
    """The formulas written out: separate forwards for chosen and rejected."""
    pc, nc = sequence_logps(model(batch["input_ids"][:, 0]).logits, batch["labels"][:, 0])
    pr, nr = sequence_logps(model(batch["input_ids"][:, 1]).logits, batch["labels"][:, 1])
    if loss_type == "simpo":
        d = pc / nc - pr / nr - gamma / beta
    else:
        rc, rr = batch["ref_logps"][:, 0], batch["ref_logps"][:, 1]
        d = (pc - rc) - (pr - rr)
        if loss_type == "length_normalized":
            d = (pc - rc) / nc - (pr - rr) / nr
    return -(1 - eps) * F.logsigmoid(beta * d) - eps * F.logsigmoid(-beta * d)


@pytest.mark.parametrize("loss_type,beta,eps", [("sigmoid", 0.5, 0.1),
                                                ("length_normalized", 5.0, 0.0),
                                                ("simpo", 2.0, 0.0)])
def test_loss_and_gradient_equal_the_formula(tok, loss_type, beta, eps):
    ref = tiny_model(tok, seed=1)  # a reference unlike the policy: d is far from 0
    ds = with_reference(tok, ref)
    model = tiny_model(tok, seed=0)
    obj = DPOObjective(loss_type, beta=beta, label_smoothing=eps, simpo_gamma=0.3)
    batch = obj.prepare(PreferenceLoader(ds, 6, seed=0).next_batch())
    loss, m = obj.loss(model, batch, obj.normalizer(batch, dist1()))
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want = direct_losses(model, batch, loss_type, beta, eps, 0.3).mean()
    want.backward()
    terms = forward_terms(model.config, batch["input_ids"].shape[-1], tokens=60)
    assert abs(loss.item() - want.item()) <= fp32_rel(terms, 16) * max(1.0, abs(want.item()))
    assert m["pairs"] == 6
    for g, p in zip(got, model.parameters(), strict=True):
        assert_fp32_close(g, p.grad, 4 * terms, ulps=16)


# ---------------------------------------------------------------------------------------------
# Through the Trainer


def capture_grads(trainer):
    """Record the accumulated gradients at each optimizer step."""
    grads, step = [], trainer.optimizer.step

    def wrapped(*a, **k):
        grads.append([p.grad.detach().clone() for p in trainer.model.parameters()])
        return step(*a, **k)

    trainer.optimizer.step = wrapped
    return grads


def test_micro_batches_accumulate_to_the_full_batch(tok, tmp_path):
    ref = tiny_model(tok, seed=1)
    ds = with_reference(tok, ref)
    runs = {}
    for mbs in (1, 4):
        model = tiny_model(tok, seed=0)
        # no clipping: the gradients themselves are compared
        t = Trainer(model, train_cfg(micro_batch_size=mbs, max_grad_norm=0.0),
                    PreferenceLoader(ds, 4, seed=0),
                    tmp_path / str(mbs), progress=False, objective=DPOObjective(beta=0.5))
        grads = capture_grads(t)
        m = t.train_step(t.loader.next_batch())
        runs[mbs] = (m, grads[0])
    (m1, g1), (m4, g4) = runs[1], runs[4]
    terms = forward_terms(ref.config, 60, tokens=60)
    for k in ("loss", "grad_norm", *DPOObjective.METRICS):
        assert m1[k] == pytest.approx(m4[k], rel=fp32_rel(terms, 16), abs=fp32_rel(terms, 16))
    for a, b in zip(g1, g4, strict=True):
        assert_fp32_close(a, b, 4 * terms, ulps=16)
    assert m1["grad_norm"] > 0


def test_training_prefers_chosen(tok, tmp_path):
    model = tiny_model(tok)
    ds = with_reference(tok, copy.deepcopy(model), PAIRS[:4], tmp=tmp_path / "ref")
    t = Trainer(model, train_cfg(max_steps=12, micro_batch_size=2), PreferenceLoader(ds, 4, 0),
                tmp_path / "run", progress=False, objective=DPOObjective(beta=0.5))
    t.fit()
    rows = [json.loads(ln) for ln in (tmp_path / "run" / METRICS).read_text().splitlines()]
    first, last = rows[0], rows[-1]
    assert abs(first["loss"] - LN2) < 1e-4 and abs(first["rewards/margins"]) < 1e-3
    assert last["rewards/accuracies"] == 1.0 and last["rewards/margins"] > 0.5
    assert last["loss"] < first["loss"] - 0.2
    assert last["rewards/chosen"] > last["rewards/rejected"]
    assert first["tokens"] == int(ds.lengths().sum() - 2 * len(ds))  # real input tokens


def test_resume_is_exact(tok, tmp_path):
    ref = tiny_model(tok, seed=1)
    ds = with_reference(tok, ref)

    def make(folder, **kw):
        return Trainer(tiny_model(tok, seed=0), train_cfg(max_steps=6, micro_batch_size=2, **kw),
                       PreferenceLoader(ds, 3, seed=5), folder, progress=False,
                       objective=DPOObjective(beta=0.5))

    straight = make(tmp_path / "a")
    straight.fit()
    first = make(tmp_path / "b")
    fetch, calls = first.loader.next_batch, []

    def crash():
        calls.append(1)
        if len(calls) == 4:  # after the checkpoint at step 3
            raise KeyError("crash")
        return fetch()

    first.loader.next_batch = crash
    with pytest.raises(KeyError):
        first.fit()
    resumed = make(tmp_path / "b", checkpoint__resume_from="latest")
    resumed.fit()
    read = lambda d: {r["step"]: r for r in map(json.loads, (d / METRICS).read_text()  # noqa: E731
                                                  .splitlines())}
    a, b = read(tmp_path / "a"), read(tmp_path / "b")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for s in range(1, 7):
        for k in ("loss", "grad_norm", "rewards/margins", "tokens", "epoch"):
            assert a[s][k] == b[s][k], (k, s)
    assert resumed.loader.state_dict() == straight.loader.state_dict()
    sa, sb = straight.model.state_dict(), resumed.model.state_dict()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


# ---------------------------------------------------------------------------------------------
# The reference cache


def test_reference_cache_computes_once_and_recomputes_on_change(tok, tmp_path, caplog):
    ref = tiny_model(tok, seed=1)
    calls = []

    def build():
        calls.append(1)
        return copy.deepcopy(ref)

    ds = data(tok)
    cache = ReferenceCache(tmp_path, "sha-a")
    sums, counts = cache.get(ds, build, batch_size=3)
    assert len(calls) == 1 and sums.shape == (8, 2) and sums.dtype == torch.float32
    assert torch.equal(counts, ds.response_counts()) and (sums < 0).all()
    assert torch.equal(ds.ref_logps, sums)
    # the numbers are the reference's, whatever the batching
    direct = reference_logps(ref, ds, batch_size=8)
    assert_fp32_close(sums, direct, forward_terms(ref.config, 60, tokens=20), ulps=8)
    avg = reference_logps(ref, ds, batch_size=8, average=True)
    torch.testing.assert_close(avg, direct / counts, rtol=1e-6, atol=0)
    assert ref.training and all(p.requires_grad for p in ref.parameters())  # flags restored

    again = data(tok)  # a new process: same pairs, same reference
    s2, _ = ReferenceCache(tmp_path, "sha-a").get(again, build, batch_size=3)
    assert len(calls) == 1 and torch.equal(s2, sums)
    ReferenceCache(tmp_path, "sha-b").get(again, build, batch_size=3)  # another reference
    assert len(calls) == 2
    ReferenceCache(tmp_path, "sha-b").get(data(tok, PAIRS[:6]), build, batch_size=3)  # other pairs
    assert len(calls) == 3
    # same lengths and masks, one token different
    edited = [{**PAIRS[0], "chosen": "It is 5."}, *PAIRS[1:6]]
    assert (data(tok, edited).lengths() == data(tok, PAIRS[:6]).lengths()).all()
    ReferenceCache(tmp_path, "sha-b").get(data(tok, edited), build, batch_size=3)
    assert len(calls) == 4
    ReferenceCache(tmp_path, "sha-b", dtype=torch.bfloat16).get(data(tok, PAIRS[:6]), build,
                                                                batch_size=3)
    assert len(calls) == 5
    meta = json.loads((tmp_path / REFERENCE_KEY_FILE).read_text())
    assert meta["pairs"] == 6 and meta["dtype"] == "torch.bfloat16"


def test_damaged_reference_cache_is_recomputed(tok, tmp_path):
    ref = tiny_model(tok, seed=1)
    calls = []

    def build():
        calls.append(1)
        return ref

    ds = data(tok)
    good, _ = ReferenceCache(tmp_path, "r").get(ds, build, batch_size=4)
    path, key = tmp_path / REFERENCE_FILE, tmp_path / REFERENCE_KEY_FILE
    damages = [
        lambda: path.write_bytes(b"\x00garbage"),  # not safetensors
        lambda: path.write_bytes(path.read_bytes()[:-5]),  # truncated
        lambda: key.write_text("{not json"),
        lambda: path.unlink(),
    ]
    for n, damage in enumerate(damages, start=2):
        damage()
        got, _ = ReferenceCache(tmp_path, "r").get(data(tok), build, batch_size=4)
        assert len(calls) == n and torch.equal(got, good)
    # other numbers under the right key (a tampered file) are not trusted either
    from safetensors.torch import save_file

    save_file({"sums": good * 2, "counts": ds.response_counts()}, str(path))
    got, _ = ReferenceCache(tmp_path, "r").get(data(tok), build, batch_size=4)
    assert len(calls) == 6 and torch.equal(got, good)


# ---------------------------------------------------------------------------------------------
# The shared preference data


@pytest.mark.parametrize("rel", ["hh-rlhf/helpful-base-test.jsonl.gz",
                                 "hh-rlhf/harmless-base-test.jsonl.gz",
                                 "preference/llamafactory_dpo_en_demo.json",
                                 "preference/torchtune_stack_exchange_paired_tiny.json"])
def test_shared_preference_data_loads_into_batches(tok, rel):
    path = SHARED / rel
    if not path.is_file():
        pytest.skip(f"{path} absent (the shared data copies are not on this machine)")
    # the test tokenizer's 300 tokens spend about one token per 2-3 characters
    ds, stats = build_dpo_data([path], "tulu", tok, 8192, limit=4)
    assert len(ds) == 4 and stats.kept >= 4 and not stats.skipped
    model = tiny_model(tok, max_sequence_length=8192)
    ds.attach_reference(reference_logps(model, ds, batch_size=4), ds.response_counts())
    obj = DPOObjective()
    batch = obj.prepare(PreferenceLoader(ds, 4, seed=0).next_batch())
    assert batch["input_ids"].shape[:2] == (4, 2) and batch["input_ids"].shape[2] < 8192
    assert (batch["labels"] != IGNORE_INDEX).sum() == ds.response_counts().sum()
    loss, _ = obj.loss(model, batch, obj.normalizer(batch, dist1()))
    assert abs(loss.item() - LN2) < 1e-3


# --- a reference with another tokenizer -----------------------------------------------------------


def _base(tok: BPETokenizer, path: str) -> Base:
    return Base(model=chat_model(tok), tokenizer=tok, path=Path(path), kind="hf", files=[])


def test_a_reference_with_another_tokenizer_is_refused():
    a, b = chat_tokenizer(300), chat_tokenizer(280)
    add_chat_template(a, "tulu")
    add_chat_template(b, "tulu")
    with pytest.raises(OlmoflowError, match="dpo.reference: '/ref' has another tokenizer"):
        check_same_tokenizer(_base(a, "/base"), _base(b, "/ref"), "dpo.reference")
    c = chat_tokenizer(300)
    add_chat_template(c, "tulu")
    check_same_tokenizer(_base(a, "/base"), _base(c, "/ref"), "dpo.reference")  # the same one
