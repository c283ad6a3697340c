"""The evaluate stage across checkpoints: which checkpoints ``evaluate.checkpoints`` names, the
cache that makes a rerun score only what is new (a task, a checkpoint) and recomputes a damaged
entry rather than trusting it, the reports it writes, and the release that carries them. One tiny
pretraining (checkpoints at steps 2, 4 and 6) is shared by the module; the tasks are defined
here."""

from __future__ import annotations

import json
import math

import pytest
import torch

from olmoflow.artifacts import read_manifest
from olmoflow.errors import OlmoflowError
from olmoflow.eval.checkpoints import (
    Checkpoint,
    ResultCache,
    cache_key,
    content_hash,
    score_checkpoints,
    select_checkpoints,
)
from olmoflow.eval.registry import register_task
from olmoflow.eval.requests import LoglikelihoodRequest, LoglikelihoodResult
from olmoflow.eval.spec import resolve
from olmoflow.eval.task import Task
from olmoflow.pipeline.config import load_config
from olmoflow.pipeline.runner import run_pipeline, run_stage

BASE = ["collect.max_documents=30", "tokenizer.vocab_size=300", "train.max_steps=6",
        "train.checkpoint.save_interval=2", "train.num_threads=1", "evaluate.max_tokens=512"]
DOCS = [("import os\nimport", [" sys", " banana", " 42"], 0),
        ("def main():\n    return", [" None", " )(", " ]]"], 0),
        ("for i in range(10):\n   ", [" print(i)", " }}}", " ((("], 0),
        ("class Stack:\n    def", [" __init__(self):", " 123", " ,,"], 0)]


class _Toy(Task):
    description = "ranked choice over fixed code snippets"
    source = "written in the test"
    primary_metric = "acc_raw"
    chance = 1 / 3

    def load(self):
        docs = DOCS[self.offset:]
        return docs[:self.settings.limit] if self.settings.limit else docs

    def requests(self, doc):
        return [LoglikelihoodRequest(doc[0], c) for c in doc[1]]

    def score(self, doc, results):
        lp = [r.logprob for r in results]
        return {"acc_raw": float(max(range(len(lp)), key=lp.__getitem__) == doc[2]),
                "logprob_gold": lp[doc[2]]}


@register_task
class ToyA(_Toy):
    name, offset = "h4_ckpt_a", 0


@register_task
class ToyB(_Toy):
    name, offset = "h4_ckpt_b", 1


def config(root, *overrides):
    return load_config("tiny", [*BASE, f"run_dir={root}", *overrides])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt") / "run"
    threads = torch.get_num_threads()
    try:
        run_pipeline(config(root), stages=["collect", "clean", "train-tokenizer", "tokenize",
                                           "pretrain"], progress=False)
    finally:
        torch.set_num_threads(threads)
    return root


def evaluate(root, *overrides, force=False):
    status, _, counts = run_stage(config(root, *overrides), "evaluate", progress=False,
                                  force=force)
    return status, counts


def test_checkpoints_latest_all_or_a_list(run):
    folder = run / "pretrain"
    assert [c.step for c in select_checkpoints(folder, "all")] == [2, 4, 6]
    assert [c.step for c in select_checkpoints(folder, "latest")] == [6]
    named = select_checkpoints(folder, "all")[1].name
    assert [c.step for c in select_checkpoints(folder, f"6,step2,{named}")] == [2, 4, 6]
    ck = select_checkpoints(folder, "2")[0]
    assert ck.tokens == 2 * 8 * 64 and len(ck.content_hash) == 64
    with pytest.raises(OlmoflowError, match=r"no checkpoint '8' in .* \(it has: stage1-step2"):
        select_checkpoints(folder, "8")
    with pytest.raises(OlmoflowError, match="no complete checkpoint"):
        select_checkpoints(run / "tokens", "latest")


def test_cache_key_is_the_checkpoint_content_the_task_and_its_settings(run):
    a, b = select_checkpoints(run / "pretrain", "2,4")
    assert a.content_hash != b.content_hash == content_hash(b.path)
    (spec,) = resolve("h4_ckpt_a")
    (other,) = resolve("h4_ckpt_a:limit=2")
    keys = {cache_key(a.content_hash, spec, max_length=64),
            cache_key(b.content_hash, spec, max_length=64),
            cache_key(a.content_hash, other, max_length=64),
            cache_key(a.content_hash, spec, max_length=32),
            cache_key(a.content_hash, spec, max_length=64, tokenizer_hash="x")}
    assert len(keys) == 5
    assert cache_key(a.content_hash, spec, max_length=64) == \
        cache_key(a.content_hash, resolve("h4_ckpt_a")[0], max_length=64)


def test_a_rerun_scores_only_new_checkpoints_and_tasks(run):
    status, c = evaluate(run, "evaluate.tasks=[h4_ckpt_a]", "evaluate.checkpoints=2,4")
    assert (status, c["scored"], c["cached"], c["checkpoints"]) == ("ran", 2, 0, 2)
    status, c = evaluate(run, "evaluate.tasks=[h4_ckpt_a]", "evaluate.checkpoints=2,4")
    assert status == "skipped" and c["scored"] == 2  # complete: the stage does not run at all
    status, c = evaluate(run, "evaluate.tasks=[h4_ckpt_a]", "evaluate.checkpoints=all")
    assert (status, c["scored"], c["cached"]) == ("ran", 1, 2)  # only step 6 is new
    status, c = evaluate(run, "evaluate.tasks=[h4_ckpt_a,h4_ckpt_b]", "evaluate.checkpoints=all")
    assert (status, c["scored"], c["cached"], c["tasks"]) == ("ran", 3, 3, 2)  # only task b
    status, c = evaluate(run, "evaluate.tasks=[h4_ckpt_a,h4_ckpt_b]", "evaluate.checkpoints=all",
                         force=True)
    assert (status, c["scored"], c["cached"]) == ("ran", 0, 6)
    # in-loop settings are not the stage's business: no rerun
    status, _ = evaluate(run, "evaluate.tasks=[h4_ckpt_a,h4_ckpt_b]", "evaluate.checkpoints=all",
                         "evaluate.in_loop.interval=3")
    assert status == "skipped"

    out = run / "eval"
    rows = [json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["step"], r["task"]) for r in rows] == [
        (s, t) for s in (2, 4, 6) for t in ("h4_ckpt_a", "h4_ckpt_b")]
    r = rows[-1]
    assert r["n"] == 3 and r["primary_metric"] == "acc_raw" and r["value"] == r["metrics"][
        "acc_raw"] and r["tokens"] == 6 * 8 * 64 and r["checkpoint"].startswith("stage1-step6")
    assert math.isclose(r["chance"], 1 / 3) and set(r["metrics"]) == {"acc_raw", "logprob_gold"}
    report = json.loads((out / "report.json").read_text())
    assert {"loss", "perplexity", "bpb", "checkpoint", "tokens"} <= set(report)
    md = (out / "report.md").read_text()
    assert md.startswith("# Held-out evaluation") and "| task | metric | step 2 | step 4 | " \
        "step 6 |" in md and "## Final checkpoint (stage1-step6" in md
    for png in ("heatmap.png", "curves.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    recorded = {o["path"] for o in read_manifest(out)["outputs"]}
    assert {"report.json", "report.md", "results.jsonl", "heatmap.png", "curves.png"} <= recorded
    inputs = {i["path"] for i in read_manifest(out)["inputs"]}
    assert sum("step2" in p for p in inputs) and sum("step6" in p for p in inputs)


def test_cached_scores_are_those_of_the_checkpoint_scored_directly(run):
    from olmoflow.eval.harness import run_tasks
    from olmoflow.eval.scorer import OlmoflowLM
    from olmoflow.model.load import load_step_model
    from olmoflow.tokenizer import Tokenizer

    evaluate(run, "evaluate.tasks=[h4_ckpt_a]", "evaluate.checkpoints=4")
    (row,) = [json.loads(ln) for ln in (run / "eval" / "results.jsonl").read_text().splitlines()]
    ck = select_checkpoints(run / "pretrain", "4")[0]
    tok = Tokenizer.from_pretrained(run / "tokenizer")
    lm = OlmoflowLM(load_step_model(ck.path, tok.vocab_size), tok, batch_size=3, max_length=64)
    (res,) = run_tasks(lm, [ToyA()])
    assert row["value"] == res.primary
    assert row["metrics"]["logprob_gold"] == pytest.approx(res.metrics["logprob_gold"],
                                                           rel=1e-5, abs=1e-4)


def test_the_release_carries_the_reports_and_the_card_shows_the_scores(run):
    evaluate(run, "evaluate.tasks=[h4_ckpt_a,h4_ckpt_b]", "evaluate.checkpoints=all")
    cfg = config(run, "evaluate.tasks=[h4_ckpt_a,h4_ckpt_b]", "evaluate.checkpoints=all")
    run_stage(cfg, "release", progress=False)
    rel = run / "release"
    for name in ("report.json", "results.jsonl", "report.md", "heatmap.png", "curves.png"):
        assert (rel / "eval" / name).read_bytes() == (run / "eval" / name).read_bytes(), name
    card = (rel / "README.md").read_text()
    assert "## Evaluation (downstream tasks, stage1-step6" in card
    assert "| h4_ckpt_b | acc_raw |" in card and "![tasks x checkpoints](eval/heatmap.png)" in card
    recorded = {o["path"] for o in read_manifest(rel)["outputs"]}
    assert {"eval/heatmap.png", "eval/results.jsonl"} <= recorded


def test_a_data_file_edited_in_place_is_scored_again(run, tmp_path):
    """The cache key carries the data's signature: the same path= with other contents (a new
    mtime or size) is another key, so an edited dataset never gets stale cached scores."""
    import os

    (a,) = select_checkpoints(run / "pretrain", "2")
    data = tmp_path / "dev.jsonl"
    data.write_text('{"x": 1}\n')
    (spec,) = resolve(f"h4_ckpt_a:path={data}")
    before = cache_key(a.content_hash, spec, max_length=64)
    assert cache_key(a.content_hash, resolve(f"h4_ckpt_a:path={data}")[0],
                     max_length=64) == before
    data.write_text('{"x": 2}\n')
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert cache_key(a.content_hash, spec, max_length=64) != before
    (folder,) = resolve(f"h4_ckpt_a:path={tmp_path}")
    key = cache_key(a.content_hash, folder, max_length=64)
    (tmp_path / "more.jsonl").write_text("{}\n")
    assert cache_key(a.content_hash, folder, max_length=64) != key


# --- a damaged cache file is recomputed, a missing checkpoint named before any scoring ------------


HOSTILE_DOCS = [("1 + 1 =", [" 2", " 3"], 0), ("2 + 2 =", [" 5", " 4"], 1)]


@register_task
class HostileToy(Task):
    name = "hostile_toy"
    description = "two fixed questions"
    source = "written in the test"
    primary_metric = "acc"
    chance = 0.5

    def load(self):
        return list(HOSTILE_DOCS)

    def requests(self, doc):
        return [LoglikelihoodRequest(doc[0], c) for c in doc[1]]

    def score(self, doc, results):
        best = max(range(len(results)), key=lambda i: results[i].logprob)
        return {"acc": float(best == doc[2])}


class CountingLM:
    """Prefers the continuation " 2" or " 4"; counts the requests it scores."""

    def __init__(self):
        self.calls = 0

    def loglikelihood(self, requests):
        self.calls += len(requests)
        return [LoglikelihoodResult(-1.0 if r.continuation in (" 2", " 4") else -5.0, True, 1)
                for r in requests]

    def loglikelihood_rolling(self, requests):
        raise AssertionError("not used")

    def generate_until(self, requests):
        raise AssertionError("not used")


def _score(tmp_path, lm):
    ckpt = Checkpoint(tmp_path / "stage1-step2-tokens1K", 2, 1000, "c" * 64)
    specs = resolve(["hostile_toy"])
    cache = ResultCache(tmp_path / "cache")
    rows, scored = score_checkpoints([ckpt], specs, lambda c: lm, cache, max_length=64)
    return rows, scored, cache_key(ckpt.content_hash, specs[0], max_length=64), cache


def _damage_truncated(d):
    return json.dumps(d)[:40]


def _damage_missing_value(d):
    return json.dumps({k: v for k, v in d.items() if k != "value"})


def _damage_edited_value(d):
    return json.dumps({**d, "value": 0.123})


def _damage_wrong_types(d):
    return json.dumps({**d, "value": "abc", "metrics": [1], "n": None})


def _damage_version_only(d):
    return json.dumps({"version": d["version"]})


def _damage_binary(d):
    return "\udcff\x00" * 10


@pytest.mark.parametrize("damage", [_damage_truncated, _damage_missing_value,
                                    _damage_edited_value, _damage_wrong_types,
                                    _damage_version_only, _damage_binary])
def test_a_damaged_cache_file_is_recomputed_not_trusted(tmp_path, damage):
    from olmoflow.eval.report import write_reports

    lm = CountingLM()
    rows, scored, key, _ = _score(tmp_path, lm)
    assert scored == 1 and rows[0]["value"] == 1.0 and lm.calls == 4
    path = tmp_path / "cache" / f"{key}.json"
    good = json.loads(path.read_text())
    path.write_bytes(damage(good).encode("utf-8", "surrogateescape"))
    again = CountingLM()
    rows2, scored2, _, _ = _score(tmp_path, again)
    assert scored2 == 1 and again.calls == 4  # scored again, not read from the damaged file
    assert rows2[0]["value"] == 1.0
    # and the cache file is whole again: the same result (its timing and so its checksum may
    # differ), which the next run trusts
    def timeless(d):
        return {k: v for k, v in d.items() if k not in ("seconds", "sha256")}

    assert timeless(json.loads(path.read_text())) == timeless(good)
    write_reports(rows2, tmp_path / "out")  # the reports read every field of a row
    # an intact file is still a hit
    third = CountingLM()
    assert _score(tmp_path, third)[1] == 0 and third.calls == 0


def test_a_missing_checkpoint_fails_before_the_heldout_evaluation(tmp_path, monkeypatch):
    from olmoflow.pipeline.config import load_config
    from olmoflow.pipeline.stages import eval as stage

    def boom(cfg):
        raise AssertionError("the model was loaded before the checkpoints were checked")

    monkeypatch.setattr(stage, "load_trained_model", boom)
    for name in ("stage1-step2-tokens1K", "stage1-step4-tokens2K"):
        d = tmp_path / "run" / "pretrain" / name
        d.mkdir(parents=True)
    cfg = load_config("tiny", [f"run_dir={tmp_path / 'run'}", "evaluate.tasks=[hostile_toy]",
                               "evaluate.checkpoints=999"])
    with pytest.raises(OlmoflowError, match="checkpoint"):
        stage.run_evaluate(cfg, progress=False)
