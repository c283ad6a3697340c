"""The data loader as properties of the whole system: best-fit instances hold every target token
once, each epoch sees every instance once, labels never cross a document under masking, a packed
instance with intra-document masking gives the logits and loss of its documents run alone, a
``Batch.state`` resumes exactly, and the global batch is the same whatever the number of ranks."""

from __future__ import annotations

import csv
import gzip
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from tolerance import assert_fp32_close, forward_terms, fp32_rel

from olmoflow.errors import OlmoflowError
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import IGNORE_INDEX, Olmo
from olmoflow.train.config import (
    CheckpointConfig,
    LogConfig,
    OptimizerConfig,
    ScheduleConfig,
    TrainConfig,
)
from olmoflow.train.loader import (
    PAD_DOCUMENT,
    Batch,
    DataLoader,
    InstanceDataset,
    PackedDataset,
    build_dataset,
    open_documents,
)

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
STRIDE = 100_000  # token value = document * STRIDE + position: a target's document is readable


def write_part(path: Path, docs: list[np.ndarray], dtype=np.uint32) -> Path:
    """An OLMo token array and its ``start,end,id,source`` index, as ``tokenize`` writes them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(np.concatenate(docs).astype(dtype).tobytes() if docs else b"")
    with gzip.open(path.with_suffix(".csv.gz"), "wt", newline="") as f:
        w, at = csv.writer(f), 0
        for i, d in enumerate(docs):
            w.writerow([at, at + len(d), f"doc{i}", "test"])
            at += len(d)
    return path


def labelled_corpus(tmp_path: Path, lengths: list[int], parts: int = 2) -> list[Path]:
    """Documents whose tokens say (document, position), split over ``parts`` files."""
    docs = [np.arange(n) + d * STRIDE for d, n in enumerate(lengths)]
    cuts = np.array_split(np.arange(len(docs)), parts)
    return [write_part(tmp_path / f"part-{k}.npy", [docs[i] for i in idx])
            for k, idx in enumerate(cuts)]


def random_lengths(n: int, seq: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(1, 3 * seq, n).tolist()


def all_rows(loader: DataLoader, n_batches: int) -> list[Batch]:
    return [loader.next_batch() for _ in range(n_batches)]


# --- best-fit instances ---------------------------------------------------------------------------


def test_best_fit_instances_hold_every_target_once_and_never_cross_documents(tmp_path):
    seq = 16
    lengths = random_lengths(120, seq)
    paths = labelled_corpus(tmp_path, lengths)
    ds = PackedDataset.from_paths(paths, np.dtype(np.uint32), seq, seed=0, pad_token_id=7)
    loader = DataLoader(ds, 1, seed=0)  # batch of 1: one epoch is every instance
    targets = []
    for b in all_rows(loader, len(ds)):
        ids, labels = b.input_ids[0].numpy(), b.labels[0].numpy()
        ok = labels != IGNORE_INDEX
        assert (labels[ok] == ids[ok] + 1).all(), "a target is the next token of the same document"
        targets.append(labels[ok])
    expected = np.concatenate([np.arange(1, n) + d * STRIDE
                               for d, n in enumerate(lengths) if n > 1])
    np.testing.assert_array_equal(np.sort(np.concatenate(targets)), np.sort(expected))
    real = sum(lengths[d] for d in range(len(lengths)) if lengths[d] > 1)
    assert ds.real_tokens >= real and 0 < ds.packing_efficiency <= 1


def test_best_fit_each_epoch_sees_every_instance_exactly_once(tmp_path):
    seq = 16
    ds = PackedDataset.from_paths(labelled_corpus(tmp_path, random_lengths(200, seq)),
                                  np.dtype(np.uint32), seq, seed=1)
    loader = DataLoader(ds, 4, seed=1, intra_document_masking=True)
    index = {tuple(ds[i][:-1]): i for i in range(len(ds))}
    assert len(index) == len(ds)
    epochs = []
    for _ in range(2):
        seen = [index[tuple(row.tolist())] for b in all_rows(loader, loader.batches_per_epoch)
                for row in b.input_ids]
        assert len(seen) == len(set(seen)) == loader.batches_per_epoch * 4
        epochs.append(seen)
    assert epochs[0] != epochs[1] and loader.epoch == 1
    if len(ds) % 4 == 0:
        assert sorted(epochs[0]) == list(range(len(ds)))


def test_best_fit_instances_depend_on_data_and_seed_only(tmp_path):
    seq = 8
    paths = labelled_corpus(tmp_path, [5] * 40 + [3] * 40)
    make = lambda seed: PackedDataset.from_paths(paths, np.dtype(np.uint32), seq, seed)  # noqa: E731
    a, b, c = make(4), make(4), make(5)
    assert len(a) == len(b) and all(np.array_equal(a[i], b[i]) for i in range(len(a)))
    assert any(not np.array_equal(a[i], c[i]) for i in range(len(a)))


def test_padding_and_document_ids(tmp_path):
    seq = 10
    ds = PackedDataset.from_paths(labelled_corpus(tmp_path, [4, 3], parts=1), np.dtype(np.uint32),
                                  seq, seed=0, pad_token_id=9)
    assert len(ds) == 1 and ds.packing_efficiency == pytest.approx(7 / 11)
    np.testing.assert_array_equal(ds[0], [0, 1, 2, 3, STRIDE, STRIDE + 1, STRIDE + 2, 9, 9, 9, 9])
    np.testing.assert_array_equal(ds.documents(0), [0] * 4 + [1] * 3 + [PAD_DOCUMENT] * 4)
    b = DataLoader(ds, 1, seed=0, intra_document_masking=True).next_batch()
    np.testing.assert_array_equal(b.labels[0], [1, 2, 3, -100, STRIDE + 1, STRIDE + 2] + [-100] * 4)
    np.testing.assert_array_equal(b.doc_ids[0], [0] * 4 + [1] * 3 + [PAD_DOCUMENT] * 3)
    assert b.num_targets == 5
    assert DataLoader(ds, 1, seed=0).next_batch().doc_ids is None


# --- concat instances with intra-document masking -------------------------------------------------


def test_concat_masking_cuts_labels_at_document_boundaries(tmp_path):
    seq = 8
    lengths = random_lengths(30, seq, seed=2)
    paths = labelled_corpus(tmp_path, lengths, parts=3)
    plain = DataLoader(InstanceDataset.from_paths(paths, np.dtype(np.uint32), seq), 2, seed=0)
    masked = DataLoader(
        InstanceDataset.from_paths(paths, np.dtype(np.uint32), seq, documents=True),
        2, seed=0, intra_document_masking=True,
    )
    doc_of = lambda t: t // STRIDE  # noqa: E731
    crossings = 0
    for p, m in zip(all_rows(plain, plain.batches_per_epoch),
                    all_rows(masked, plain.batches_per_epoch)):
        assert torch.equal(p.input_ids, m.input_ids) and p.doc_ids is None
        assert torch.equal(p.input_ids[:, 1:], p.labels[:, :-1])
        cross = doc_of(p.labels) != doc_of(p.input_ids)
        crossings += int(cross.sum())
        assert torch.equal(m.labels, p.labels.masked_fill(cross, IGNORE_INDEX))
        # doc_ids change exactly where the tokens' documents do
        ids = m.input_ids
        assert torch.equal(m.doc_ids[:, 1:] != m.doc_ids[:, :-1],
                           doc_of(ids[:, 1:]) != doc_of(ids[:, :-1]))
    assert crossings > 0
    with pytest.raises(OlmoflowError, match="document index"):
        DataLoader(InstanceDataset.from_paths(paths, np.dtype(np.uint32), seq), 2, seed=0,
                   intra_document_masking=True)


def test_a_bad_index_is_a_user_error(tmp_path):
    p = write_part(tmp_path / "a.npy", [np.arange(5), np.arange(4)])
    p.write_bytes(np.arange(12, dtype=np.uint32).tobytes())  # 12 tokens, index covers 9
    with pytest.raises(OlmoflowError, match="do not tile the 12 tokens"):
        open_documents([p], np.dtype(np.uint32))
    with pytest.raises(OlmoflowError, match="did you mean 'best_fit'"):
        build_dataset("best-fit", [p], np.dtype(np.uint32), 8, 0)
    with pytest.raises(OlmoflowError, match="did you mean 'best_fit'"):
        TrainConfig(packing="bestfit")
    with pytest.raises(OlmoflowError, match="intra_document_masking must be true or false"):
        TrainConfig(intra_document_masking="yes")


# --- the model sees each document alone -----------------------------------------------------------


def tiny_model(vocab: int = 64) -> Olmo:
    """Sliding windows (6) shorter than the documents, and one full-attention layer."""
    torch.manual_seed(0)
    return Olmo(ModelConfig(vocab_size=vocab, d_model=32, n_layers=4, n_heads=4, mlp_hidden=64,
                            max_sequence_length=64, sliding_window=6)).eval()


def assert_logits_close(packed, alone, model, seq):
    """A document inside a masked pack and alone: other shapes, so other sums. Two ulps per
    accumulated term of the logits' scale (tolerance.py; two: the pack's masked softmax)."""
    assert_fp32_close(packed, alone, forward_terms(model.config, seq), 2)


def loss_rel(model, seq, targets):
    """The relative bound of the pack's mean loss against the documents' means, weighted."""
    return fp32_rel(forward_terms(model.config, seq, tokens=targets), 2)


def test_masked_packed_logits_and_loss_equal_documents_alone(tmp_path):
    vocab, seq = 64, 32
    model = tiny_model(vocab)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab, n) for n in [3, 7, 12, 20, 40, 5, 9, 2, 15, 31]]
    ds = PackedDataset.from_paths([write_part(tmp_path / "p.npy", docs, np.uint16)],
                                  np.dtype(np.uint16), seq, seed=0)
    loader = DataLoader(ds, len(ds), seed=0, intra_document_masking=True)
    b = loader.next_batch()
    with torch.no_grad():
        packed = model(b.input_ids, b.labels, doc_ids=b.doc_ids)
        crossed = model(b.input_ids).logits
        weighted_ce = weighted_loss = 0.0
        n_alone = n_later = 0
        for r in range(b.input_ids.shape[0]):
            d = b.doc_ids[r]
            for piece in d[d != PAD_DOCUMENT].unique().tolist():
                # The piece alone: its tokens, each predicting the next. Its last token has no
                # target, and is cut off when the piece ends the instance.
                s, e = int(ds.piece_starts[piece]), int(ds.piece_ends[piece])
                cols = (d == piece).nonzero().squeeze(1)[: e - s - 1]
                tokens = torch.from_numpy(ds._slice(s, e))[None]
                alone = model(tokens[:, :-1], tokens[:, 1:])
                assert_logits_close(packed.logits[r, cols], alone.logits[0], model, seq)
                n = e - s - 1
                weighted_ce += alone.ce_loss.item() * n
                weighted_loss += alone.loss.item() * n
                n_alone += n
                if cols[0] > 0:  # without the mask a later piece sees the pieces before it
                    assert not torch.allclose(crossed[r, cols], alone.logits[0], atol=1e-3)
                    n_later += 1
    assert n_alone == b.num_targets and n_later > 3
    rel = loss_rel(model, seq, n_alone)
    assert packed.ce_loss.item() == pytest.approx(weighted_ce / n_alone, rel=rel, abs=0)
    assert packed.loss.item() == pytest.approx(weighted_loss / n_alone, rel=rel, abs=0)


def test_masked_concat_logits_and_loss_equal_document_fragments_alone(tmp_path):
    vocab, seq = 64, 24
    model = tiny_model(vocab)
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, vocab, n) for n in rng.integers(2, 30, 16)]
    paths = [write_part(tmp_path / "p.npy", docs, np.uint16)]
    ds = InstanceDataset.from_paths(paths, np.dtype(np.uint16), seq, documents=True)
    b = DataLoader(ds, len(ds), seed=0, intra_document_masking=True).next_batch()
    with torch.no_grad():
        packed = model(b.input_ids, b.labels, doc_ids=b.doc_ids)
        total_ce, n_total, runs = 0.0, 0, 0
        for r in range(b.input_ids.shape[0]):
            for doc in b.doc_ids[r].unique().tolist():
                cols = (b.doc_ids[r] == doc).nonzero().squeeze(1)
                alone = model(b.input_ids[r, cols][None], b.labels[r, cols][None])
                assert_logits_close(packed.logits[r, cols], alone.logits[0], model, seq)
                n = int((b.labels[r, cols] != IGNORE_INDEX).sum())
                total_ce += alone.ce_loss.item() * n
                n_total += n
                runs += 1
    assert runs > 2 * b.input_ids.shape[0] and n_total == b.num_targets
    assert packed.ce_loss.item() == pytest.approx(total_ce / n_total,
                                                  rel=loss_rel(model, seq, n_total), abs=0)


# --- resume and ranks -----------------------------------------------------------------------------


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_batch_state_resumes_exactly(tmp_path, packing):
    seq, batch = 8, 4
    paths = labelled_corpus(tmp_path, random_lengths(40, seq, seed=3))
    make = lambda: DataLoader(build_dataset(packing, paths, np.dtype(np.uint32), seq, seed=5,  # noqa: E731
                                            intra_document_masking=True),
                              batch, seed=5, intra_document_masking=True)
    ref = make()
    n = 2 * ref.batches_per_epoch + 3  # crosses two epoch boundaries
    batches = all_rows(ref, n)
    per_epoch = ref.batches_per_epoch
    for cut in sorted({1, 2, per_epoch - 1, per_epoch, per_epoch + 1, n - 1}):
        fresh = make()
        # as a checkpoint has it
        fresh.load_state_dict(json.loads(json.dumps(batches[cut - 1].state)))
        for i in range(cut, n):
            b = fresh.next_batch()
            for name in ("input_ids", "labels", "doc_ids"):
                assert torch.equal(getattr(b, name), getattr(batches[i], name)), (cut, i, name)
            assert b.state == batches[i].state
    with pytest.raises(OlmoflowError, match="seed 5, this run has seed 6"):
        DataLoader(ref.dataset, batch, seed=6).load_state_dict(batches[0].state)
    other = build_dataset(packing, paths[:1], np.dtype(np.uint32), seq, seed=5,
                          intra_document_masking=True)
    with pytest.raises(OlmoflowError, match="instances, this run has"):
        DataLoader(other, 2, seed=5).load_state_dict(batches[0].state)


def test_global_batch_is_the_same_whatever_the_world_size(tmp_path):
    seq, batch = 8, 8
    paths = labelled_corpus(tmp_path, random_lengths(60, seq, seed=4))
    make = lambda: DataLoader(PackedDataset.from_paths(paths, np.dtype(np.uint32), seq, seed=2),  # noqa: E731
                              batch, seed=2, intra_document_masking=True)
    steps = make().batches_per_epoch + 2
    by_world = {}
    for world in (1, 2, 4):
        ranks = [make() for _ in range(world)]  # each process runs its own loader
        shards = [[r.next_batch().shard(rank, world) for rank, r in enumerate(ranks)]
                  for _ in range(steps)]
        fields = ("input_ids", "labels", "doc_ids")
        by_world[world] = [[torch.cat([getattr(s, f) for s in step]) for f in fields]
                           for step in shards]
    for world in (2, 4):
        for a, b in zip(by_world[1], by_world[world]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(OlmoflowError, match="cannot be split over 3 processes"):
        make().next_batch().shard(0, 3)
    with pytest.raises(OlmoflowError, match="rank 2 of 2"):
        make().next_batch().shard(2, 2)


# --- real text ------------------------------------------------------------------------------------


def test_best_fit_on_real_text(tmp_path):
    src = SHARED / "tinystories" / "tinystories_val_head.txt"
    if not src.is_file():
        pytest.skip(f"../shared/data absent: {src}")
    eos = 256
    paragraphs = [p for p in src.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    docs = [np.append(np.frombuffer(p.encode(), np.uint8), eos) for p in paragraphs]
    paths = [write_part(tmp_path / "p.npy", docs, np.uint16)]
    seq = 256
    packed = PackedDataset.from_paths(paths, np.dtype(np.uint16), seq, seed=0)
    concat = InstanceDataset.from_paths(paths, np.dtype(np.uint16), seq, documents=True)
    starts, ends = open_documents(paths, np.dtype(np.uint16))[1:]
    # A concat instance boundary at k*T cuts a document when s < k*T <= e - 2 (both halves have
    # targets); best fit cuts only the documents longer than an instance.
    cut_concat = int(((ends - 2) // seq > starts // seq).sum())
    cut_best_fit = int((ends - starts > seq + 1).sum())
    print(f"\nbest_fit on {len(docs)} TinyStories paragraphs, T={seq}: {len(packed)} instances, "
          f"packing efficiency {packed.packing_efficiency:.4f}; documents cut: {cut_best_fit} "
          f"(concat: {cut_concat} over {len(concat)} instances)")
    assert cut_best_fit < cut_concat / 2
    assert packed.packing_efficiency > 0.9
    loader = DataLoader(packed, 8, seed=0, intra_document_masking=True)
    b = loader.next_batch()
    ends = b.input_ids == eos
    assert (b.labels[:, :-1][ends[:, 1:]] == eos).all()  # EOS is a target of its own document
    assert (b.labels[ends] == IGNORE_INDEX).all()  # ... and predicts nothing after it


# --- the trainer ----------------------------------------------------------------------------------


def test_trainer_resumes_packed_masked_training_exactly(tmp_path):
    from olmoflow.train.trainer import METRICS, Trainer

    seq = 16
    paths = labelled_corpus(tmp_path / "data", random_lengths(60, seq, seed=6))
    cfg = TrainConfig(sequence_length=seq, global_batch_size=4, micro_batch_size=2, max_steps=6,
                      num_threads=1, packing="best_fit", intra_document_masking=True,
                      optimizer=OptimizerConfig(lr=1e-2), schedule=ScheduleConfig(warmup_steps=2),
                      checkpoint=CheckpointConfig(save_interval=3), log=LogConfig(interval=1))

    def trainer(folder, resume_from=None):
        torch.manual_seed(0)
        # Token values are capped into the vocab: the packing still comes from the index.
        ds = PackedDataset.from_paths(paths, np.dtype(np.uint32), seq, seed=1)
        for i, a in enumerate(ds.arrays):
            ds.arrays[i] = (np.asarray(a) % 61).astype(np.uint32)
        loader = DataLoader(ds, cfg.global_batch_size, seed=1, intra_document_masking=True)
        model = Olmo(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, mlp_hidden=64,
                                 max_sequence_length=64, sliding_window=None))
        run_cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, resume_from=resume_from))
        return Trainer(model, run_cfg, loader, folder, progress=False)

    straight = trainer(tmp_path / "a")
    straight.fit()
    assert (straight.data_state == straight.loader.state_dict()
            and straight.data_state["position"] == 24)
    first = trainer(tmp_path / "b")
    fetch, calls = first.loader.next_batch, []

    def crash():
        calls.append(1)
        if len(calls) == 5:
            raise KeyError("crash")
        return fetch()

    first.loader.next_batch = crash
    with pytest.raises(KeyError):
        first.fit()
    trainer(tmp_path / "b", resume_from="latest").fit()
    losses = [[json.loads(ln)["loss"] for ln in (tmp_path / d / METRICS).read_text().splitlines()]
              for d in ("a", "b")]
    assert len(losses[0]) == 6 and losses[0] == losses[1]

def test_loader_refuses_a_position_over_other_instances_of_the_same_count():
    """64 tokens make 7 instances at sequence_length 8 and at 9: the counts agree, the instances do
    not, so a position would silently skip or repeat data (was: resumed without a word)."""
    tokens = [np.arange(64, dtype=np.uint16)]
    eight, nine = InstanceDataset(tokens, 8), InstanceDataset(tokens, 9)
    assert len(eight) == len(nine) == 7
    state = DataLoader(eight, 2, seed=0).state_dict()
    with pytest.raises(OlmoflowError, match="train.sequence_length=8, this run has 9"):
        DataLoader(nine, 2, seed=0).load_state_dict(state)
    with pytest.raises(OlmoflowError, match="train.packing=best_fit, this run has concat"):
        DataLoader(eight, 2, seed=0).load_state_dict({**state, "packing": "best_fit"})
    old = {k: v for k, v in state.items() if k not in ("packing", "sequence_length")}
    DataLoader(eight, 2, seed=0).load_state_dict(old)  # checkpoints from before still resume
