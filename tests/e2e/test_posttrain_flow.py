"""The post-training flow from the command line: ``olmoflow run tiny`` with SFT (on instruction
pairs the run builds from held-out standard-library files), DPO (on a small pair file) and GRPO
(generated arithmetic), then the release is checked the way a user would use it: its tokenizer
applies the same chat template in ``transformers``, it chats, and each stage's manifest traces
back to its base checkpoint and data."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from olmoflow.artifacts import data_files
from olmoflow.cli import main
from olmoflow.run_dir import RunDir

pytestmark = pytest.mark.slow

PAIRS = [
    {"prompt": f"What is {a} plus {b}?", "chosen": f"{a + b}", "rejected": f"{a + b + 7} maybe"}
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4), (6, 1), (8, 3)]
]


def args(run_dir: Path, pairs: Path) -> list[str]:
    return ["run", "tiny", "train.max_steps=10", "train.num_threads=1", "evaluate.max_tokens=1024",
            "sft.data.generate=stdlib_docstrings", "sft.data.limit=48", "sft.train.max_steps=4",
            "sft.train.sequence_length=128", "sft.train.global_batch_size=4",
            "sft.train.micro_batch_size=2", "sft.train.checkpoint.save_interval=2",
            "sft.train.optimizer.lr=1e-3", "sft.train.num_threads=1",
            f"dpo.data.paths=[{pairs}]", "dpo.train.max_steps=3", "dpo.train.sequence_length=96",
            "dpo.train.global_batch_size=4", "dpo.train.micro_batch_size=2",
            "dpo.train.optimizer.lr=1e-3", "dpo.train.num_threads=1",
            "rl.prompts.source=arithmetic", "rl.prompts.count=16", "rl.prompts.heldout=4",
            "rl.group_size=2", "rl.prompts_per_step=2", "rl.max_new_tokens=4",
            "rl.train.max_steps=2", "rl.train.global_batch_size=4", "rl.train.micro_batch_size=4",
            "rl.train.num_threads=1", "rl.eval_interval=2",
            "--run-dir", str(run_dir), "--no-progress"]


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    root = tmp_path_factory.mktemp("posttrain")
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    run_dir = root / "run"
    threads = torch.get_num_threads()
    buf = io.StringIO()
    try:
        with redirect_stdout(buf):
            rc = main(args(run_dir, pairs))
    finally:
        torch.set_num_threads(threads)
    assert rc == 0, buf.getvalue()
    return run_dir, pairs, buf.getvalue()


def manifest(run_dir: Path, stage: str) -> dict:
    return json.loads((RunDir(run_dir).stage(stage) / "manifest.json").read_text())


def test_each_post_training_stage_ran_from_the_one_before(flow):
    run_dir, pairs, out = flow
    for stage in ("pretrain", "sft", "dpo", "rl", "release"):
        assert f"[{stage}] ran" in out, out
    runs = RunDir(run_dir)
    for stage, before in (("sft", "pretrain"), ("dpo", "sft"), ("rl", "dpo")):
        m = manifest(run_dir, stage)
        latest = runs.stage(before) / (runs.stage(before) / "latest").read_text().strip()
        assert m["counts"]["base"] == str(latest)
        inputs = {r["path"]: r["sha256"] for r in m["inputs"]}
        for f in data_files(latest):  # every file of the base checkpoint, with its hash
            rel = f.relative_to(run_dir).as_posix()
            assert inputs[rel] == hashlib.sha256(f.read_bytes()).hexdigest()
        assert m["config"][stage]["train"]["max_steps"] == m["counts"]["steps"]
    dpo_inputs = [r["path"] for r in manifest(run_dir, "dpo")["inputs"]]
    assert any(p.endswith("pairs.jsonl") for p in dpo_inputs)
    sft = manifest(run_dir, "sft")
    assert any(p.endswith("stdlib_docstrings.jsonl") for p in (r["path"] for r in sft["inputs"]))
    # the pairs come from the files pretraining held out; each is trained on or counted
    built = (RunDir(run_dir).stage("sft") / "data" / "stdlib_docstrings.jsonl").read_text()
    heldout = {line.split(",")[2] for line in gzip.open(
        next((RunDir(run_dir).stage("tokenize") / "heldout").glob("*.csv.gz")), "rt")}
    records = [json.loads(line) for line in built.splitlines()]
    c = sft["counts"]
    assert c["examples"] > 0 and c["examples"] + c["dropped"] + c["skipped"] == len(records)
    assert {r["id"].split("::")[0] for r in records} <= heldout


def test_the_release_is_the_final_model_and_chat_ready(flow):
    from transformers import AutoTokenizer

    from olmoflow.tokenizer.bpe import BPETokenizer
    from olmoflow.tokenizer.chat import render, template_of

    run_dir, _, _ = flow
    rel = RunDir(run_dir).stage("release")
    assert json.loads((rel / "manifest.json").read_text())["counts"]["checkpoint"].startswith(
        "rl-step2")
    ours = BPETokenizer.load(rel)
    assert template_of(ours).name == "tulu"
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "def add(a, b):"},
                {"role": "assistant", "content": "return a + b"},
                {"role": "user", "content": "and subtract?"}]
    ids, _ = render(messages, "tulu", ours, add_generation_prompt=True, require_assistant=False)
    hf = AutoTokenizer.from_pretrained(rel)
    theirs = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
    assert list(theirs) == ids
    card = (rel / "README.md").read_text()
    assert "## Post-training" in card
    for stage in ("sft", "dpo", "rl"):
        assert f"| {stage} |" in card
        assert (rel / "posttrain" / stage / "training_log.jsonl").is_file()


def test_olmoflow_chat_talks_with_the_release(flow, capsys):
    run_dir, _, _ = flow
    from olmoflow.infer.chat import chat_main

    lines = iter(["def add(a, b):", "/reset", "/exit"])
    out = io.StringIO()
    rc = chat_main([str(RunDir(run_dir).stage("release")), "--seed", "0", "--max-new-tokens", "8"],
                   input_fn=lambda _prompt="": next(lines), output=out)
    text = out.getvalue()
    assert rc == 0, text
    assert "template tulu" in text and "history cleared: 1 exchange" in text


def test_the_data_manifest_hashes_every_post_training_stage_data(flow, tmp_path, capsys):
    import shutil

    run_dir, pairs, _ = flow
    rel = RunDir(run_dir).stage("release")
    post = json.loads((rel / "data_manifest.json").read_text())["posttrain"]
    assert [e["stage"] for e in post] == ["sft", "dpo", "rl"]
    sft, dpo, rl = post
    [gen] = sft["files"]  # the instruction pairs the run built
    assert sft["generated"] == "stdlib_docstrings" and gen["path"].startswith("sft/data/")
    assert gen["sha256"] == hashlib.sha256((run_dir / gen["path"]).read_bytes()).hexdigest()
    assert sft["counts"]["examples"] == manifest(run_dir, "sft")["counts"]["examples"] > 0
    [pair_file] = dpo["files"]
    assert Path(pair_file["path"]) == pairs.resolve()
    assert pair_file["sha256"] == hashlib.sha256(pairs.read_bytes()).hexdigest()
    assert dpo["counts"]["pairs"] == len(PAIRS) and dpo["counts"]["skipped"] == 0
    assert rl["files"] == [] and rl["generated"] == "arithmetic"
    assert rl["counts"] == {"prompts": 16, "heldout_prompts": 4}
    assert main(["verify", str(rel)]) == 0, capsys.readouterr().out
    # the preference pairs changed after the model was trained on them
    pairs.write_text(pairs.read_text().replace('"3"', '"4"', 1))
    try:
        assert main(["verify", str(rel)]) == 1
        out = capsys.readouterr().out
        assert f"source changed since the data was made: {pairs.resolve()}" in out, out
    finally:
        pairs.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    copy = tmp_path / "release"  # moved out of its run: the absolute paths are still followed
    shutil.copytree(rel, copy)
    assert main(["verify", str(copy)]) == 0, capsys.readouterr().out


def test_a_rerun_skips_every_stage(flow, capsys):
    run_dir, pairs, _ = flow
    threads = torch.get_num_threads()
    try:
        assert main(args(run_dir, pairs)) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for stage in ("pretrain", "sft", "dpo", "rl", "evaluate", "generate", "release"):
        assert f"[{stage}] skipped" in out, out
