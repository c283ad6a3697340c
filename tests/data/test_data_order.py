"""``olmoflow data-order RUN --step N``: the documents it lists for a step are exactly the batch
the training loader yielded at that step, found from a kept checkpoint's loader cursor or from the
start, for both packings."""

from __future__ import annotations

import json

import numpy as np
import pytest

from olmoflow.cli import main
from olmoflow.data.tokenize import read_index, read_token_array
from olmoflow.pipeline.config import load_config
from olmoflow.pipeline.data_order import step_documents
from olmoflow.pipeline.runner import run_pipeline
from olmoflow.pipeline.stages.common import load_tokenizer, token_split
from olmoflow.train.loader import DataLoader, build_dataset, index_path

STEPS = 12
TRAIN = [f"train.max_steps={STEPS}", "train.num_threads=1", "train.sequence_length=32",
         "train.global_batch_size=4", "train.micro_batch_size=4",
         "train.checkpoint.save_interval=5", "train.checkpoint.keep_last=0", "train.log.interval=1"]


@pytest.fixture(scope="module", params=["concat", "best_fit"])
def run(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"order-{request.param}")
    cfg = load_config("tiny", [*TRAIN, f"train.packing={request.param}"], {"run_dir": str(d)})
    run_pipeline(cfg, stages=["collect", "clean", "train-tokenizer", "tokenize", "pretrain"],
                 progress=False)
    return cfg


def loader_batches(cfg, n: int) -> list:
    """The first ``n`` batches of a loader built from scratch, as the pretrain stage builds it."""
    t = cfg.train
    paths, dtype = token_split(cfg, "train")
    ds = build_dataset(t.packing, paths, dtype, t.sequence_length, cfg.seed,
                       t.intra_document_masking, pad_token_id=load_tokenizer(cfg).pad_token_id)
    loader = DataLoader(ds, t.global_batch_size, seed=cfg.seed)
    return [loader.next_batch() for _ in range(n)]


def document_tokens(cfg) -> dict[str, np.ndarray]:
    """Each document's tokens by id, read straight from the token files and their indexes."""
    paths, dtype = token_split(cfg, "train")
    out = {}
    for p in paths:
        arr = read_token_array(p, dtype)
        for start, end, doc_id, _source in read_index(index_path(p)):
            out[doc_id] = np.asarray(arr[start:end], dtype=np.int64)
    return out


@pytest.mark.parametrize("step", [1, 5, 6, 9, STEPS])  # before, at and after the checkpoints
def test_listed_documents_are_the_batch_of_that_step(run, step):
    batch = loader_batches(run, step)[-1]
    docs = document_tokens(run)
    spans = step_documents(run, step, chars=20)
    rows = sorted({s.row for s in spans})
    assert rows == list(range(batch.input_ids.shape[0]))
    for row in rows:
        mine = [s for s in spans if s.row == row]
        assert [s.position for s in mine] == sorted(s.position for s in mine)
        tokens = np.concatenate([docs[s.doc_id][s.doc_start:s.doc_end] for s in mine])
        T = batch.input_ids.shape[1]
        got = batch.input_ids[row].numpy()
        n = min(len(tokens), T)
        assert np.array_equal(tokens[:n], got[:n])  # best_fit pads the rest of a row
        assert all(s.source and s.doc_tokens >= s.doc_end > s.doc_start >= 0 for s in mine)


def test_command_prints_the_step_and_rejects_bad_steps(run, capsys):
    assert main(["data-order", run.run_dir, "--step", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["step"] == 3 and {d["row"] for d in data["documents"]} == {0, 1, 2, 3}
    assert main(["data-order", run.run_dir, "--step", "3"]) == 0
    assert "step 3: 4 instances" in capsys.readouterr().out
    assert main(["data-order", run.run_dir, "--step", str(STEPS + 1)]) == 2
    assert f"the run trained {STEPS} steps" in capsys.readouterr().err
    assert main(["data-order", run.run_dir, "--step", "0"]) == 2
    assert main(["data-order", run.run_dir + "-missing", "--step", "1"]) == 2
