"""The whole flow on real text: ``olmoflow run tiny`` on Project Gutenberg books, then the release
is checked the way a user would use it (the README's Python snippet, and ``transformers``).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import shutil
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from tolerance import assert_fp32_close, assert_greedy_agrees, forward_terms, fp32_rel

from olmoflow.cli import main
from olmoflow.model.olmo import Olmo
from olmoflow.pipeline.config import load_config
from olmoflow.pipeline.stages import STAGES
from olmoflow.run_dir import RunDir
from olmoflow.train.checkpoint import checkpoint_name

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
BOOKS = SHARED_DATA / "gutenberg"
MAX_STEPS = 20

pytestmark = pytest.mark.slow

RELEASE_FILES = ["config.json", "model.safetensors", "tokenizer.json", "training_log.jsonl",
                 "eval/report.json", "data_manifest.json", "checkpoints.csv", "README.md",
                 "environment.json", "requirements.lock", "Dockerfile", "files.json",
                 "plots/pretrain/loss.png"]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_args(run_dir: Path) -> list[str]:
    # One thread: a tiny model on a shared CI box is far faster without OpenMP spinning.
    return ["run", "tiny", f"train.max_steps={MAX_STEPS}", "train.log.interval=1",
            "train.checkpoint.save_interval=10", "train.num_threads=1", "evaluate.max_tokens=2048",
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


def enabled_stages(run_dir: Path):
    """The stages of the tiny flow (post-training is off there: no data named)."""
    return STAGES.enabled(load_config(str(RunDir(run_dir).config)))


def test_every_stage_ran_and_has_a_hashed_manifest(flow):
    run_dir, out = flow
    assert {s.name for s in STAGES} - {s.name for s in enabled_stages(run_dir)} == {
        "sft", "dpo", "rl"}
    for stage in enabled_stages(run_dir):
        assert f"[{stage.name}] ran" in out, out
        d = RunDir(run_dir).stage(stage.name)
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
    # The lineage walks from the tokens the model trained on back to the same raw files.
    [lineage] = data["lineage"]
    assert Path(lineage["tokens"]).name == "tokens" and not lineage["warnings"]
    raw = {Path(r["path"]).name: r["sha256"] for r in lineage["raw_files"]}
    assert raw == sources
    assert {Path(s["dir"]).name for s in lineage["steps"]} >= {"tokens", "clean", "collect"}


def test_release_bundle_has_every_file(release, flow):
    for name in RELEASE_FILES:
        assert (release / name).is_file(), name
    config = json.loads((release / "config.json").read_text())
    assert config["model_type"] == "olmo3"
    log = (release / "training_log.jsonl").read_text()
    assert log == (flow[0] / "pretrain" / "metrics.jsonl").read_text()
    rows = list(csv.DictReader((release / "checkpoints.csv").read_text().splitlines()))
    assert [int(r["step"]) for r in rows] == [10, MAX_STEPS]
    tokens = 8 * 64  # the tiny preset's global batch x sequence length
    names = [checkpoint_name("stage1", s, s * tokens) for s in (10, MAX_STEPS)]
    assert [r["name"] for r in rows] == names
    assert [r["path"] for r in rows] == [f"checkpoints/{n}" for n in names]
    logged = {r["step"]: r["loss"] for r in map(json.loads, log.splitlines())}
    for row in rows:  # the loss pretraining recorded when it saved the checkpoint
        # 6 decimals: within half of 1e-6 of the logged float (the same number, rounded).
        assert float(row["loss"]) == pytest.approx(logged[int(row["step"])], abs=5e-7 + 1e-12)
        exported = release / row["path"]
        hashes = dict(pair.split("=") for pair in row["sha256"].split())
        assert hashes["model.safetensors"] == sha256(exported / "model.safetensors")
        assert int(row["checkpoint_bytes"]) > 2 * (exported / "model.safetensors").stat().st_size
    # an intermediate checkpoint loads on its own, and the final one is the released model
    first = Olmo.from_pretrained(release / rows[0]["path"])
    final = Olmo.from_pretrained(release / rows[-1]["path"])
    released = Olmo.from_pretrained(release)
    assert all(torch.equal(a, b) for a, b in zip(final.state_dict().values(),
                                                 released.state_dict().values()))
    assert not torch.equal(first.lm_head.weight, released.lm_head.weight)
    env = json.loads((release / "environment.json").read_text())
    assert env["packages"]["torch"] == torch.__version__ and "git_dirty" in env
    assert f"torch=={torch.__version__}" in (release / "requirements.lock").read_text()
    card = (release / "README.md").read_text()
    assert "x the weights" in card and "## Environment" in card and "olmoflow verify" in card
    assert "olmoflow-tiny" in (release / "README.md").read_text()


def test_verify_passes_and_names_each_tampered_file(flow, tmp_path, capsys):
    run_dir = flow[0]
    assert main(["verify", str(run_dir / "release")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK:") and "0 problem(s)" in out
    sources = int(out.split("release files re-hashed, ")[1].split(" ")[0])
    assert sources >= len(list(BOOKS.glob("*.txt")))  # followed back to the raw books

    def tampered(edit) -> str:
        copy = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        shutil.copytree(run_dir, copy)
        edit(copy)
        assert main(["verify", str(copy / "release")]) == 1
        return capsys.readouterr().out

    def flip_byte(path: Path, at: int = 1000) -> None:
        data = bytearray(path.read_bytes())
        data[at] ^= 1
        path.write_bytes(bytes(data))

    out = tampered(lambda c: flip_byte(c / "release" / "model.safetensors", 10_000))
    assert "changed: model.safetensors" in out and out.count("\n") == 2  # one problem, a summary

    def edit_log(c: Path) -> None:
        log = c / "release" / "training_log.jsonl"
        lines = log.read_text().splitlines()
        lines[3] = lines[3].replace('"step": 4', '"step": 40')
        log.write_text("\n".join(lines) + "\n")

    assert "changed: training_log.jsonl" in tampered(edit_log)
    out = tampered(lambda c: flip_byte(c / "release" / "data_manifest.json", 50))
    assert "changed: data_manifest.json" in out
    out = tampered(lambda c: (c / "release" / "checkpoints" / "extra.bin").write_bytes(b"x"))
    assert "added: checkpoints/extra.bin" in out
    out = tampered(lambda c: (c / "release" / "eval" / "report.json").unlink())
    assert "missing: eval/report.json" in out
    # the data the release traces back to: the run's cleaned documents, changed after the fact
    out = tampered(lambda c: flip_byte(c / "clean" / "documents.jsonl.gz", 20))
    assert "source changed since the data was made" in out and "clean" in out


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
    transformers = pytest.importorskip("transformers",
                                       reason="transformers is the parity reference")
    from olmoflow import Olmo, Tokenizer

    ours = Olmo.from_pretrained(release).eval()
    tokenizer = Tokenizer.from_pretrained(release)
    hf = transformers.AutoModelForCausalLM.from_pretrained(release).eval()
    assert type(hf).__name__ == "Olmo3ForCausalLM"

    # Longer than the sliding window (32), so both attention kinds are exercised.
    text = (BOOKS / "alice_in_wonderland_11.txt").read_text(encoding="utf-8-sig")[5000:6000]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :100]
    assert ids.shape[1] > 64
    # transformers orders the same math its own way: two ulps per accumulated term of the
    # logits' scale (tolerance.py).
    with torch.no_grad():
        assert_fp32_close(ours(ids).logits, hf(ids).logits, forward_terms(ours.config, 100), 2)

    prompt = tokenizer("The future of AI is", return_tensors="pt").input_ids
    mine = ours.generate(prompt, max_length=50)
    theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_length=50,
                         do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    # transformers may stop at EOS (generation_config.json); compare what both produced.
    n = min(mine.shape[1], theirs.shape[1])
    assert n > prompt.shape[1]
    # The same tokens wherever the logits' bound cannot flip greedy's argmax.
    with torch.no_grad():
        logits = ours(mine[:, :n]).logits
    atol = fp32_rel(forward_terms(ours.config, n), 2) * float(logits.abs().max())
    assert_greedy_agrees(theirs[:, :n], mine[:, :n], logits, atol, prompt.shape[1])


def test_rerun_skips_every_stage(flow, capsys):
    run_dir, _ = flow
    threads = torch.get_num_threads()
    try:
        rc = main(run_args(run_dir))
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert rc == 0
    for stage in enabled_stages(run_dir):
        assert f"[{stage.name}] skipped" in out, out


def test_a_run_on_data_engine_tokens_releases_a_manifest_back_to_the_raw_files(tmp_path, capsys):
    """``olmoflow data run`` then ``olmoflow run tiny train.data=<its tokens>``: the run makes no
    data of its own, and its release's data manifest follows tokens, mixed documents, attributes
    and ingested documents back to the raw source file, with its sha256."""
    import sysconfig

    import yaml

    from olmoflow.data.tokenize import open_token_dir

    std = Path(sysconfig.get_paths()["stdlib"])
    raw = tmp_path / "raw" / "code.jsonl"
    raw.parent.mkdir()
    with raw.open("w") as f:
        for i, p in enumerate(sorted(std.glob("*.py"))[:40]):
            text = p.read_text(errors="replace")[:3000]
            f.write(json.dumps({"id": f"doc{i}", "text": text}) + "\n")
    engine = tmp_path / "engine"
    (tmp_path / "data.yaml").write_text(yaml.safe_dump({
        "output": str(engine), "executor": "serial", "taggers": ["c4"],
        "steps": ["ingest", "tag", "dedup", "mix", "tokenize"],
        "sources": [{"name": "code", "paths": [str(raw)]}],
        "tokenize": {"vocab_size": 512, "heldout_fraction": 0.1}}))
    assert main(["data", "run", str(tmp_path / "data.yaml"), "--no-progress"]) == 0
    run = tmp_path / "run"
    threads = torch.get_num_threads()
    try:
        rc = main(["run", "tiny", f"train.data={engine / 'tokens'}", "train.max_steps=2",
                   "train.num_threads=1", "--run-dir", str(run), "--no-progress"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "[collect]" not in out and "[release] ran" in out
    assert not RunDir(run).stage("tokenize").exists()

    data = json.loads((RunDir(run).stage("release") / "data_manifest.json").read_text())
    [lineage] = data["lineage"]
    assert Path(lineage["tokens"]) == (engine / "tokens").resolve() and not lineage["warnings"]
    assert {Path(s["dir"]).name for s in lineage["steps"]} >= {"tokens", "mixed", "documents"}
    assert lineage["raw_files"] == [{"path": str(raw.resolve()), "bytes": raw.stat().st_size,
                                     "sha256": sha256(raw)}]
    release = RunDir(run).stage("release")
    card = (release / "README.md").read_text()
    assert "file(s)))" not in card  # one closing parenthesis per opened one
    assert f"{engine / 'tokens'}: 1 raw source file(s)" in card and "40 documents" in card
    # Trained, released and exported with the engine's tokenizer (the run has none of its own).
    engine_tokenizer = open_token_dir(engine / "tokens").tokenizer_dir / "tokenizer.json"
    assert (release / "tokenizer.json").read_bytes() == engine_tokenizer.read_bytes()
    shutil.rmtree(release)
    assert main(["export", "hf", str(RunDir(run).stage("pretrain")), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == engine_tokenizer.read_bytes()
