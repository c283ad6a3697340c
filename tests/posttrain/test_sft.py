"""SFT batches and objective: packing places whole examples and changes no loss or gradient,
labels stay inside an example's assistant tokens, accumulation and the normaliser, exact resume
through the Trainer, and user data processors."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_fp32_close, forward_terms, fp32_rel

from olmoflow.config import from_dict, set_dotted
from olmoflow.errors import OlmoflowError
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import IGNORE_INDEX, Olmo
from olmoflow.posttrain.data import SFTExample, sft_examples
from olmoflow.posttrain.sft import (
    SFTLoader,
    SFTObjective,
    build_sft_data,
    pack_examples,
    processor_records,
    sft_labels,
)
from olmoflow.tokenizer import BPETokenizer
from olmoflow.tokenizer.chat import add_chat_template
from olmoflow.train import distributed
from olmoflow.train.config import TrainConfig
from olmoflow.train.loader import PAD_DOCUMENT
from olmoflow.train.trainer import METRICS, Trainer

T = 64  # sequence_length: rows of 65 tokens
TEXTS = ["Hello world! The cat sat on the mat. What is 2+2? It is 4.\n\nSure thing (yes).",
         "def add(a, b):\n    return a + b\n# user, assistant, system, Human, Assistant"]
WORDS = "the cat sat on mat what is it sure thing yes hello world add return".split()


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok() -> BPETokenizer:
    t = BPETokenizer().train_from_texts(TEXTS * 8, vocab_size=300)
    add_chat_template(t, "olmo3")
    return t


def records(n: int, seed: int = 0) -> list[dict]:
    """Conversations of one or two exchanges and every third a plain ``text`` record (trained on
    every token, so its first token is a target candidate: a label crossing into it would show)."""
    rng = np.random.default_rng(seed)
    words = lambda lo, hi: " ".join(rng.choice(WORDS, rng.integers(lo, hi)))  # noqa: E731
    out = []
    for i in range(n):
        if i % 3 == 2:
            out.append({"text": words(3, 14)})
            continue
        msgs = [{"role": "system", "content": "Be brief."}]
        for _ in range(int(rng.integers(1, 3))):
            msgs += [{"role": "user", "content": words(1, 5)},
                     {"role": "assistant", "content": words(1, 6)}]
        out.append({"messages": msgs})
    return out


def examples(tok, n: int = 14, seed: int = 0) -> list[SFTExample]:
    exs = list(sft_examples(records(n, seed), "olmo3", tok, T + 1))
    assert len(exs) == n
    return exs


def tiny_model(tok, seed: int = 0) -> Olmo:
    torch.manual_seed(seed)
    return Olmo(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=2,
                            mlp_hidden=64, max_sequence_length=T, sliding_window=None))


def train_config(**kw) -> TrainConfig:
    base = dict(sequence_length=T, global_batch_size=4, micro_batch_size=2, max_steps=6,
                optimizer__lr=1e-2, schedule__warmup_steps=2, schedule__type="cosine",
                checkpoint__save_interval=3, log__interval=1, num_threads=1)
    tree: dict = {}
    for key, value in {**base, **kw}.items():
        set_dotted(tree, key.replace("__", "."), value)
    return from_dict(TrainConfig, tree, "train.")


def expected_labels(exs: list[SFTExample], ds, row: int) -> np.ndarray:
    """Row ``row``'s labels from the examples alone: within each example, token ``j + 1`` is the
    target at position ``j`` when its mask says so; nothing else is a target."""
    out = np.full(T, IGNORE_INDEX, dtype=np.int64)
    at = 0
    for e in ds.examples_of(row):
        ids, mask = exs[e].input_ids, exs[e].loss_mask
        for j in range(len(ids) - 1):
            if mask[j + 1]:
                out[at + j] = ids[j + 1]
        at += len(ids)
    return out


# ---------------------------------------------------------------------------------------------
# Packing and labels


def test_packing_places_every_example_once(tok):
    exs = examples(tok, 30)
    ds = pack_examples(exs, T, packing=True, pad_token_id=tok.pad_token_id)
    placed = [e for r in range(len(ds)) for e in ds.examples_of(r)]
    assert sorted(placed) == list(range(len(exs)))
    for r in range(len(ds)):
        used = sum(len(exs[e].input_ids) for e in ds.examples_of(r))
        assert used <= T + 1
        ids, mask, docs = ds.row(r)
        assert ids.shape == mask.shape == docs.shape == (T + 1,)
        assert (docs[used:] == PAD_DOCUMENT).all() and (mask[used:] == 0).all()
        assert list(ids[:used]) == [t for e in ds.examples_of(r) for t in exs[e].input_ids]
    real = sum(len(e.input_ids) for e in exs)
    assert ds.real_tokens == real
    assert ds.packing_efficiency == pytest.approx(real / (len(ds) * (T + 1)))
    padded = pack_examples(exs, T, packing=False, pad_token_id=tok.pad_token_id)
    assert len(padded) == len(exs) and len(ds) < len(exs)
    assert ds.packing_efficiency > padded.packing_efficiency
    assert [padded.examples_of(r) for r in range(len(padded))] == [[i] for i in range(len(exs))]
    # deterministic: the same examples and seed give the same rows
    again = pack_examples(exs, T, packing=True, pad_token_id=tok.pad_token_id)
    assert [again.examples_of(r) for r in range(len(again))] == placed_rows(ds)


def placed_rows(ds) -> list[list[int]]:
    return [ds.examples_of(r) for r in range(len(ds))]


def test_too_long_example_raises(tok):
    ex = SFTExample(list(range(T + 2)), [1] * (T + 2), "f.jsonl:3")
    with pytest.raises(OlmoflowError, match="f.jsonl:3"):
        pack_examples([ex], T, packing=True, pad_token_id=0)


@pytest.mark.parametrize("packing", [True, False])
def test_labels_stay_inside_examples(tok, packing):
    exs = examples(tok, 30)
    ds = pack_examples(exs, T, packing=packing, pad_token_id=tok.pad_token_id)
    loader = SFTLoader(ds, 2, seed=3)
    seen = 0
    for _ in range(loader.batches_per_epoch):
        b = loader.next_batch()
        rows = loader.order(0)[seen : seen + 2].tolist()
        seen += 2
        width = b.labels.shape[1]
        if not packing:  # padded rows are cut after the batch's longest example, not before
            longest = max(len(exs[ds.examples_of(r)[0]].input_ids) for r in rows)
            assert width == longest - 1
        for k, r in enumerate(rows):
            want = expected_labels(exs, ds, r)
            np.testing.assert_array_equal(b.labels[k].numpy(), want[:width])
            assert (want[width:] == IGNORE_INDEX).all()
            ids, _, docs = ds.row(r)
            np.testing.assert_array_equal(b.input_ids[k].numpy(), ids[:width])
            if packing:
                np.testing.assert_array_equal(b.doc_ids[k].numpy(), docs[:-1])
        if not packing:
            assert b.doc_ids is None
    # some text record starts right after another example in a packed row: its first token,
    # trained by its mask, is no target of the previous example's last token
    if packing:
        firsts = [r for r in range(len(ds)) for e in ds.examples_of(r)[1:]
                  if exs[e].loss_mask[0] == 1]
        assert firsts, "no packed row has a text record after another example"


def test_pad_is_never_trained_and_eot_is_when_pad_is_eos(tok, tmp_path):
    tok.save(tmp_path)
    same = BPETokenizer.load(tmp_path)
    same.set_special_tokens(pad=same.eos_token)  # <|im_end|>: the end of every assistant turn
    assert same.pad_token_id == same.eos_token_id
    exs = [e for e in examples(same, 14) if e.loss_mask[0] == 0]  # the conversations
    ds = pack_examples(exs, T, packing=True, pad_token_id=same.pad_token_id)
    b = SFTLoader(ds, len(ds), seed=0).next_batch()
    eot = same.eos_token_id
    n_eot = sum(sum(1 for t, m in zip(e.input_ids, e.loss_mask, strict=True) if t == eot and m)
                for e in exs)
    assert n_eot >= len(exs)
    assert int((b.labels == eot).sum()) == n_eot  # every assistant turn's end, and no pad
    assert int((b.labels != IGNORE_INDEX).sum()) == sum(sum(e.loss_mask[1:]) for e in exs)
    assert (b.input_ids == eot).sum() > n_eot  # the pads are there, with the EOS id


def test_user_tokens_change_no_label(tok):
    exs = examples(tok, 14)
    rng = np.random.default_rng(1)
    # every untrained token (system, user, headers) replaced by another id
    other = [SFTExample([int(rng.integers(0, tok.vocab_size)) if not m else t
                         for t, m in zip(e.input_ids, e.loss_mask, strict=True)],
                        e.loss_mask, e.where) for e in exs]
    changed = sum(a != b for e, o in zip(exs, other, strict=True)
                  for a, b in zip(e.input_ids, o.input_ids, strict=True))
    assert changed > 50
    a = pack_examples(exs, T, packing=True, pad_token_id=0)
    b = pack_examples(other, T, packing=True, pad_token_id=0)
    assert placed_rows(a) == placed_rows(b)
    la = SFTLoader(a, len(a), seed=0).next_batch().labels
    lb = SFTLoader(b, len(b), seed=0).next_batch().labels
    torch.testing.assert_close(la, lb, rtol=0, atol=0)
    # and the labels do see a changed trained token
    ids, mask, docs = a.row(0)
    mask2 = mask.copy()
    mask2[np.flatnonzero(mask)[0]] = 0
    assert not np.array_equal(sft_labels(ids, mask, docs), sft_labels(ids, mask2, docs))


# ---------------------------------------------------------------------------------------------
# Loss: packing, normalisation, accumulation


def loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    obj = SFTObjective()
    fields = obj.prepare(batch)
    n = obj.normalizer(fields, distributed.DistInfo())
    model.zero_grad(set_to_none=True)
    loss, _ = obj.loss(model, fields, n)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def test_packing_changes_no_loss_or_gradient(tok):
    exs = examples(tok, 20)
    packed = pack_examples(exs, T, packing=True, pad_token_id=tok.pad_token_id)
    padded = pack_examples(exs, T, packing=False, pad_token_id=tok.pad_token_id)
    assert len(packed) < len(padded)
    model = tiny_model(tok)
    bp = SFTLoader(packed, len(packed), seed=0).next_batch()
    bu = SFTLoader(padded, len(padded), seed=0).next_batch()
    assert bp.num_targets == bu.num_targets
    lp, gp = loss_and_grads(model, bp)
    lu, gu = loss_and_grads(model, bu)
    terms = forward_terms(model.config, T, tokens=bp.num_targets)
    bound = fp32_rel(terms) * abs(float(lu))
    assert abs(float(lp) - float(lu)) <= bound
    for k in gu:  # a gradient sums the loss's terms and every position's backward
        assert_fp32_close(gp[k], gu[k], terms=terms + T * bp.input_ids.shape[0], msg=k)
    # without intra-document masking the packed rows attend across examples: another loss
    # (measured: 2e-3 relative, against 1e-7 with it and a bound of 2e-4)
    lx = model(bp.input_ids, bp.labels, loss_normalizer=bp.num_targets).loss.detach()
    assert abs(float(lx) - float(lu)) > 5 * bound


def test_accumulation_and_global_normalizer(tok, tmp_path):
    exs = examples(tok, 16)
    ds = pack_examples(exs, T, packing=False, pad_token_id=tok.pad_token_id)
    batch = SFTLoader(ds, 4, seed=5).next_batch()
    counts = (batch.labels != IGNORE_INDEX).sum(1)
    assert len(set(counts.tolist())) > 1  # rows with different numbers of trained tokens
    out = {}
    for mbs in (1, 4):
        model = tiny_model(tok)
        if mbs == 1:  # the loss by hand: mean over the global batch's assistant tokens
            with torch.no_grad():
                logits = model(batch.input_ids).logits.float()
            ce = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(),
                                 ignore_index=IGNORE_INDEX, reduction="sum") / counts.sum()
        trainer = Trainer(model, train_config(global_batch_size=4, micro_batch_size=mbs),
                          SFTLoader(ds, 4, seed=5), tmp_path / f"m{mbs}", progress=False,
                          objective=SFTObjective())
        out[mbs] = trainer.train_step(batch)
    terms = forward_terms(tiny_model(tok).config, T, tokens=int(counts.sum()))
    for key in ("loss", "ce_loss", "grad_norm"):
        assert abs(out[1][key] - out[4][key]) <= fp32_rel(terms, 8) * abs(out[4][key]), key
    assert abs(out[1]["ce_loss"] - float(ce)) <= fp32_rel(terms, 4) * float(ce)
    # a mean of per-row means would differ
    per_row = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(),
                              ignore_index=IGNORE_INDEX, reduction="none").view(4, -1)
    assert abs(float((per_row.sum(1) / counts).mean()) - float(ce)) > 1e-4
    assert out[1]["assistant_tokens"] == out[4]["assistant_tokens"] == float(counts.sum())


# ---------------------------------------------------------------------------------------------
# Exact resume


class Crash(Exception):
    pass


def sft_trainer(tok, folder: Path, ds, crash_at: int | None = None, **cfg_kw) -> Trainer:
    cfg = train_config(**cfg_kw)
    loader = SFTLoader(ds, cfg.global_batch_size, seed=11)
    if crash_at is not None:
        fetch, calls = loader.next_batch, []

        def next_batch():
            calls.append(1)
            if len(calls) == crash_at:
                raise Crash
            return fetch()

        loader.next_batch = next_batch
    return Trainer(tiny_model(tok), cfg, loader, folder, progress=False, objective=SFTObjective())


def logged(folder: Path) -> dict[int, dict]:
    rows = [json.loads(ln) for ln in (folder / METRICS).read_text().splitlines() if ln.strip()]
    return {r["step"]: r for r in rows}


def test_exact_resume(tok, tmp_path):
    ds = pack_examples(examples(tok, 30), T, packing=True, pad_token_id=tok.pad_token_id)
    assert len(ds) // 4 < 6  # the run crosses an epoch
    straight = sft_trainer(tok, tmp_path / "a", ds)
    straight.fit()
    first = sft_trainer(tok, tmp_path / "b", ds, crash_at=5)  # checkpoint at 3, then steps 4
    with pytest.raises(Crash):
        first.fit()
    resumed = sft_trainer(tok, tmp_path / "b", ds, checkpoint__resume_from="latest")
    resumed.fit()
    a, b = logged(tmp_path / "a"), logged(tmp_path / "b")
    assert sorted(b) == list(range(1, 7))
    for step in range(1, 7):
        for key in ("loss", "grad_norm", "assistant_tokens"):
            assert a[step][key] == b[step][key], (step, key)
    for (k, p), q in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(),
                         strict=True):
        assert torch.equal(p, q), k


def test_loader_state_checks_and_resume(tok):
    ds = pack_examples(examples(tok, 30), T, packing=True, pad_token_id=tok.pad_token_id)
    loader = SFTLoader(ds, 2, seed=1)
    batches = [loader.next_batch() for _ in range(loader.batches_per_epoch + 2)]
    again = SFTLoader(ds, 2, seed=1)
    again.load_state_dict(batches[2].state)
    for b in batches[3:]:
        assert torch.equal(again.next_batch().input_ids, b.input_ids)
    with pytest.raises(OlmoflowError, match="seed 1.*seed 2"):
        SFTLoader(ds, 2, seed=2).load_state_dict(batches[0].state)
    padded = pack_examples(examples(tok, 30), T, packing=False, pad_token_id=tok.pad_token_id)
    with pytest.raises(OlmoflowError, match="packed SFT rows"):
        SFTLoader(padded, 2, seed=1).load_state_dict(batches[0].state)
    other = pack_examples(examples(tok, 30, seed=9), T, packing=True,
                          pad_token_id=tok.pad_token_id)
    state = dict(batches[0].state, instances=len(other))
    with pytest.raises(OlmoflowError, match="other SFT data"):
        SFTLoader(other, 2, seed=1).load_state_dict(state)
    with pytest.raises(OlmoflowError, match=r"holds 30 examples in \d+ packed rows"):
        SFTLoader(ds, len(ds) + 1, seed=1)


# ---------------------------------------------------------------------------------------------
# User processors


PROCESSOR = '''
class Chats:
    """A user's data processor: n records, conversations and plain text."""

    def __init__(self, n, word="cat"):
        self.n, self.word = n, word

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i % 2:
            return {"text": f"the {self.word} sat on the mat {i}"}
        return {"messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": f"what is {i}?"},
                             {"role": "assistant", "content": f"it is {self.word}."}]}
'''


def test_processor_records_train(tok, tmp_path):
    name = f"sft_proc_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(PROCESSOR)
    procs = {"mine": {"class": f"{name}.Chats", "n": 7, "word": "mat"}}
    recs = list(processor_records(procs, search_path=tmp_path))
    assert [w for w, _ in recs] == [f"mine[{i}]" for i in range(7)]
    assert recs[1][1]["text"].startswith("the mat")
    ds, stats = build_sft_data([], procs, "olmo3", tok, T, search_path=tmp_path)
    assert stats.kept == 7 and ds.num_examples == 7
    assert sorted(ds.wheres) == sorted(f"mine[{i}]" for i in range(7))
    # the same class by file path, with files read first and a limit
    f = tmp_path / "data.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in records(4)) + "\n")
    by_file = {"other": {"class": f"{name}.py:Chats", "n": 3}}
    ds2, stats2 = build_sft_data([f], by_file, "olmo3", tok, T, search_path=tmp_path, limit=6)
    assert ds2.num_examples == 6 and ds2.wheres[:4] == [f"{f}:{i}" for i in range(1, 5)]
    trainer = Trainer(tiny_model(tok), train_config(global_batch_size=2, micro_batch_size=2),
                      SFTLoader(ds, 2, seed=0), tmp_path / "run", progress=False,
                      objective=SFTObjective())
    m = trainer.train_step(trainer.loader.next_batch())
    assert np.isfinite(m["loss"]) and m["assistant_tokens"] > 0 and m["grad_norm"] > 0


@pytest.mark.parametrize("spec, match", [
    ("no_such_module_xyz.Chats", "No module named 'no_such_module_xyz'"),
    ("Chats", "must be module.Class"),
    (None, "must name a class"),
])
def test_bad_processor_class_is_one_line(spec, match):
    procs = {"mine": {"class": spec}}
    with pytest.raises(OlmoflowError, match=match) as e:
        list(processor_records(procs))
    assert "\n" not in str(e.value) and "data.processors.mine.class" in str(e.value)


def test_processor_without_class_key_or_failing(tmp_path):
    with pytest.raises(OlmoflowError, match="needs a 'class' key"):
        list(processor_records({"mine": {"n": 3}}))
    name = f"sft_proc_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(PROCESSOR)
    with pytest.raises(OlmoflowError, match="defines no class 'Missing'"):
        list(processor_records({"mine": {"class": f"{name}.Missing"}}, search_path=tmp_path))
    with pytest.raises(OlmoflowError, match=r"Chats\(\*\*\['bad'\]\) failed: TypeError"):
        list(processor_records({"mine": {"class": f"{name}.Chats", "bad": 1}},
                               search_path=tmp_path))
