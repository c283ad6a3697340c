"""The whole flow on real text: ``olmoflow run tiny`` on Project Gutenberg books, then the release
is checked the way a user would use it (the README's Python snippet, and ``transformers``).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from olmoflow.cli import main
from olmoflow.pipeline.stages import STAGES
from olmoflow.train.checkpoint import checkpoint_name

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
BOOKS = SHARED_DATA / "gutenberg"
MAX_STEPS = 20

pytestmark = pytest.mark.slow

RELEASE_FILES = ["config.json", "model.safetensors", "tokenizer.json", "training_log.jsonl",
                 "eval/report.json", "data_manifest.json", "checkpoints.csv", "README.md"]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_args(run_dir: Path) -> list[str]:
    # One thread: a tiny model on a shared CI box is far faster without OpenMP spinning.
    return ["run", "tiny", f"train.max_steps={MAX_STEPS}", "train.log_interval=1",
            "train.save_interval=10", "train.num_threads=1", "evaluate.max_tokens=2048",
            "--data", str(BOOKS), "--run-dir", str(run_dir), "--no-progress"]


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    """Run the whole flow once; returns ``(run_dir, stdout)``."""
    if not (BOOKS.is_dir() and any(BOOKS.glob("*.txt"))):
        pytest.skip(f"shared data not found: {BOOKS} (the e2e test needs ../shared/data/gutenberg)")
    run_dir = tmp_path_factory.mktemp("flow") / "run"
    threads = torch.get_num_threads()
    buf = io.StringIO()
    try:
        with redirect_stdout(buf):
            rc = main(run_args(run_dir))
    finally:
        torch.set_num_threads(threads)
    assert rc == 0, buf.getvalue()
    return run_dir, buf.getvalue()


@pytest.fixture(scope="module")
def release(flow) -> Path:
    return flow[0] / "release"


def test_every_stage_ran_and_has_a_hashed_manifest(flow):
    run_dir, out = flow
    for stage in STAGES:
        assert f"[{stage.name}] ran" in out, out
        d = run_dir / stage.dir
        m = json.loads((d / "manifest.json").read_text())
        assert m["stage"] == stage.name and m["fingerprint"] and m["finished"]
        assert m["outputs"], f"{stage.name} records no outputs"
        for rec in m["outputs"]:
            assert len(rec["sha256"]) == 64
            assert sha256(d / rec["path"]) == rec["sha256"], f"{stage.name}: {rec['path']}"
        for rec in m["inputs"]:
            assert len(rec["sha256"]) == 64
    assert (run_dir / "config.yaml").is_file()


def test_manifests_trace_back_to_the_raw_sources(release):
    data = json.loads((release / "data_manifest.json").read_text())
    assert {"collect", "clean", "train-tokenizer", "tokenize"} <= set(data)
    sources = {Path(r["path"]).name: r["sha256"] for r in data["collect"]["inputs"]}
    books = sorted(p.name for p in BOOKS.glob("*.txt"))
    assert sorted(sources) == books
    for name in books:
        assert sources[name] == sha256(BOOKS / name)
    tokens = data["tokenize"]["counts"]
    assert tokens["heldout_documents"] >= 1 and tokens["train_documents"] >= 1


def test_release_bundle_has_every_file(release, flow):
    for name in RELEASE_FILES:
        assert (release / name).is_file(), name
    config = json.loads((release / "config.json").read_text())
    assert config["model_type"] == "olmo3"
    log = (release / "training_log.jsonl").read_text()
    assert log == (flow[0] / "pretrain" / "metrics.jsonl").read_text()
    rows = (release / "checkpoints.csv").read_text().splitlines()
    assert rows[0] == "step,tokens,path,loss"
    assert [r.split(",")[0] for r in rows[1:]] == ["10", str(MAX_STEPS)]
    tokens = 8 * 64  # the tiny preset's global batch x sequence length
    assert [r.split(",")[2] for r in rows[1:]] == [
        f"pretrain/{checkpoint_name('stage1', s, s * tokens)}" for s in (10, MAX_STEPS)]
    assert "olmoflow-tiny" in (release / "README.md").read_text()


def test_training_loss_went_down_and_heldout_bpb_is_finite(release):
    log = [json.loads(ln) for ln in (release / "training_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, MAX_STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in log)
    assert log[0]["loss"] > log[-1]["loss"]
    report = json.loads((release / "eval" / "report.json").read_text())
    assert math.isfinite(report["bpb"]) and 0 < report["bpb"] < 16
    assert math.isfinite(report["loss"]) and report["loss"] < math.log(512) + 1


def test_python_api_snippet(release, capsys):
    from olmoflow import Olmo, Tokenizer

    model = Olmo.from_pretrained(release)
    tokenizer = Tokenizer.from_pretrained(release)
    inputs = tokenizer("The future of AI is", return_tensors="pt")
    outputs = model.generate(inputs.input_ids, max_length=50)
    print(tokenizer.decode(outputs[0]))

    assert outputs.shape == (1, 50)
    assert torch.equal(outputs[0, : inputs.input_ids.shape[1]], inputs.input_ids[0])
    text = capsys.readouterr().out
    assert text.startswith("The future of AI is") and len(text) > len("The future of AI is")
    with pytest.raises(ValueError, match="max_length"):
        model.generate(inputs.input_ids, max_length=inputs.input_ids.shape[1] - 1)


def test_transformers_loads_the_release_and_agrees(release):
    transformers = pytest.importorskip("transformers", reason="transformers is the parity reference")
    from olmoflow import Olmo, Tokenizer

    ours = Olmo.from_pretrained(release).eval()
    tokenizer = Tokenizer.from_pretrained(release)
    hf = transformers.AutoModelForCausalLM.from_pretrained(release).eval()
    assert type(hf).__name__ == "Olmo3ForCausalLM"

    # Longer than the sliding window (32), so both attention kinds are exercised.
    text = (BOOKS / "alice_in_wonderland_11.txt").read_text(encoding="utf-8-sig")[5000:6000]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :100]
    assert ids.shape[1] > 64
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=1e-4, rtol=1e-4)

    prompt = tokenizer("The future of AI is", return_tensors="pt").input_ids
    mine = ours.generate(prompt, max_length=50)
    theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_length=50,
                         do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    # transformers may stop at EOS (generation_config.json); compare what both produced.
    n = min(mine.shape[1], theirs.shape[1])
    assert n > prompt.shape[1]
    assert torch.equal(mine[:, :n], theirs[:, :n])


def test_rerun_skips_every_stage(flow, capsys):
    run_dir, _ = flow
    threads = torch.get_num_threads()
    try:
        rc = main(run_args(run_dir))
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert rc == 0
    for stage in STAGES:
        assert f"[{stage.name}] skipped" in out, out
