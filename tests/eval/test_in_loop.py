"""In-loop evaluation: a trainer callback that scores tasks and held-out BPB every k steps. It must
not change training (losses bit-identical with and without it, dropout on), and a run stopped and
resumed logs the same eval values at the same steps as one that ran straight through."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from olmoflow.config import from_dict
from olmoflow.eval.in_loop import InLoopEval
from olmoflow.eval.registry import register_task
from olmoflow.eval.requests import GenerateRequest, LoglikelihoodRequest
from olmoflow.eval.spec import resolve
from olmoflow.eval.task import Task
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo
from olmoflow.train.config import TrainConfig
from olmoflow.train.loader import DataLoader, InstanceDataset
from olmoflow.train.trainer import METRICS, Trainer

SEQ, STEPS, EVERY = 16, 8, 2
TEXTS = ["the cat sat on the mat and the dog sat on the log", "one two three four five six",
         "def add(a, b):\n    return a + b", "import os\nprint(os.getcwd())",
         "red green blue yellow black white", "a b c d e f g h i j k l m n o p"]


@register_task
class LoopMC(Task):
    name = "h4_loop_mc"
    description = "which word follows"
    primary_metric = "acc_raw"
    chance = 0.5
    DOCS = [("the cat sat on the", [" mat", " six"], 0), ("one two three", [" four", " dog"], 0),
            ("red green", [" blue", " return"], 0)]

    def load(self):
        return self.DOCS[:self.settings.limit]

    def requests(self, doc):
        return [LoglikelihoodRequest(doc[0], c) for c in doc[1]]

    def score(self, doc, results):
        lp = [r.logprob for r in results]
        return {"acc_raw": float(lp[0] >= lp[1]), "logprob": lp[doc[2]]}


@register_task
class LoopGen(Task):
    name = "h4_loop_gen"
    description = "continue a line greedily"
    output_type = "generate"
    primary_metric = "exact_match"

    def load(self):
        return [("one two", " three"), ("a b c", " d")][:self.settings.limit]

    def requests(self, doc):
        return [GenerateRequest(doc[0], until=("\n",), max_new_tokens=3)]

    def score(self, doc, results):
        return {"exact_match": float(results[0].strip() == doc[1].strip()),
                "chars": float(len(results[0]))}


@pytest.fixture(scope="module")
def tok():
    from olmoflow.tokenizer import BPETokenizer

    return BPETokenizer().train_from_texts(TEXTS * 4, vocab_size=300)


def tokens(tok, texts) -> np.ndarray:
    ids = [i for t in texts for i in tok.encode(t) + [tok.eos_token_id]]
    return np.asarray(ids, dtype=np.uint16)


def make_trainer(folder, tok, *, callback: bool, **train):
    torch.manual_seed(0)
    model = Olmo(ModelConfig(vocab_size=tok.vocab_size + (-tok.vocab_size) % 64, d_model=32,
                             n_layers=2, n_heads=2, mlp_hidden=64, max_sequence_length=64,
                             sliding_window=None, dropout=0.1))
    stream = np.concatenate([tokens(tok, TEXTS)] * 6)
    loader = DataLoader(InstanceDataset([stream], SEQ), 4, seed=7)
    cfg = from_dict(TrainConfig, {"sequence_length": SEQ, "global_batch_size": 4,
                                  "micro_batch_size": 2, "max_steps": STEPS, "num_threads": 1,
                                  "optimizer": {"lr": 1e-2}, "schedule": {"warmup_steps": 2},
                                  "checkpoint": {"save_interval": 4}, "log": {"interval": 1},
                                  **train}, "train.")
    cbs = []
    if callback:
        specs = resolve("h4_loop_mc,h4_loop_gen:limit=1")
        cbs = [InLoopEval(EVERY, specs, tok, heldout=tokens(tok, TEXTS[::-1]), bpb_tokens=40,
                          sequence_length=SEQ, batch_size=2)]
    return Trainer(model, cfg, loader, folder, config_yaml="x: 1\n", progress=False,
                   callbacks=cbs)


def log(folder) -> dict[int, dict]:
    rows = [json.loads(ln) for ln in (folder / METRICS).read_text().splitlines() if ln.strip()]
    return {r["step"]: r for r in rows}


def evals(rows: dict[int, dict]) -> dict[int, dict]:
    return {s: {k: v for k, v in r.items() if k.startswith("eval/")} for s, r in rows.items()
            if any(k.startswith("eval/") for k in r)}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tok):
    folder = tmp_path_factory.mktemp("straight")
    trainer = make_trainer(folder, tok, callback=True)
    trainer.fit()
    return folder, trainer


def test_in_loop_eval_leaves_training_bit_identical(straight, tok, tmp_path):
    folder, _ = straight
    plain = tmp_path / "plain"
    make_trainer(plain, tok, callback=False).fit()
    with_eval, without = log(folder), log(plain)
    assert sorted(with_eval) == sorted(without) == list(range(1, STEPS + 1))
    for s in without:
        assert (with_eval[s]["loss"], with_eval[s]["grad_norm"]) == \
            (without[s]["loss"], without[s]["grad_norm"]), s
    got = evals(with_eval)
    assert sorted(got) == [2, 4, 6, 8] and not evals(without)
    assert set(got[8]) == {"eval/h4_loop_mc/acc_raw", "eval/h4_loop_mc/logprob",
                           "eval/h4_loop_gen/exact_match", "eval/h4_loop_gen/chars",
                           "eval/heldout/bpb", "eval/heldout/loss"}
    assert got[2]["eval/heldout/bpb"] != got[8]["eval/heldout/bpb"]  # the model it sees trains


def test_the_logged_values_are_those_of_the_model_at_that_step(straight):
    _, trainer = straight
    again = trainer.callbacks[0].evaluate(trainer.model)  # the model after the last step
    assert {f"eval/{k}": v for k, v in again.items()} == evals(log(straight[0]))[STEPS]


def test_a_stopped_and_resumed_run_logs_the_same_eval_values(straight, tok, tmp_path):
    folder = tmp_path / "resumed"
    first = make_trainer(folder, tok, callback=True)
    fetch, calls = first.loader.next_batch, []

    def stop_after_step_5():
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("stop")
        return fetch()

    first.loader.next_batch = stop_after_step_5
    with pytest.raises(RuntimeError, match="stop"):
        first.fit()
    assert max(log(folder)) == 5  # the checkpoint is at step 4: step 5 is trained again
    make_trainer(folder, tok, callback=True, checkpoint={"save_interval": 4,
                                                         "resume_from": "latest"}).fit()
    assert evals(log(folder)) == evals(log(straight[0]))


def test_the_pretrain_stage_builds_the_callback_from_the_config(tmp_path, tok):
    from olmoflow.pipeline.config import load_config
    from olmoflow.pipeline.stages.eval import in_loop_callback

    cfg = load_config("tiny", [f"run_dir={tmp_path}"])
    assert in_loop_callback(cfg, tok) is None  # interval 0: off
    cfg = load_config("tiny", [f"run_dir={tmp_path}", "evaluate.in_loop.interval=3",
                               "evaluate.in_loop.tasks=[h4_loop_mc,h4_loop_gen:limit=1]",
                               "evaluate.in_loop.limit=2", "evaluate.in_loop.bpb=false"])
    cb = in_loop_callback(cfg, tok)
    assert cb.interval == 3 and cb.heldout is None and cb.sequence_length == 64
    assert [(r.label, r.settings.limit) for r in cb.specs] == [("h4_loop_mc", 2),
                                                               ("h4_loop_gen", 1)]
    assert [len(t.docs) for t in cb.tasks] == [2, 1]  # loaded once, before training
