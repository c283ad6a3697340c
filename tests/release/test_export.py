"""``olmoflow export hf`` and ``olmoflow model info``: a training step directory becomes a directory
that ``transformers`` loads (model and tokenizer) and that gives our logits; bad input is one line
on stderr and exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checks import cli, exits_with_one_line
from tolerance import assert_fp32_close, assert_greedy_agrees, forward_terms, fp32_rel

from olmoflow.cli import main

transformers = pytest.importorskip("transformers",
                                   reason="transformers is the consumer of the export")


# OLMo-style checkpoint names: 4 x 512 = 2048 tokens, rounded up to 3K (train.checkpoint)
STEP2, STEP4 = "stage1-step2-tokens2K", "stage1-step4-tokens3K"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A tiny pretraining run (4 steps of 512 tokens, checkpoints at steps 2 and 4): ~5 s."""
    run = tmp_path_factory.mktemp("run")
    rc = main(["run", "tiny", "--run-dir", str(run), "--no-progress", "train.max_steps=4",
               "train.checkpoint.save_interval=2"])
    assert rc == 0
    assert (run / "pretrain" / STEP4 / "model_and_optim").is_dir()
    return run


def test_model_info_prints_the_table(capsys):
    rc, out, _ = cli(capsys, "model", "info", "olmo2_7b")
    assert rc == 0
    for fragment in ("| d_model ", "4096", "11008", "7,298,617,344", "13.59 GiB", "100352"):
        assert fragment in out, fragment
    rc, out, _ = cli(capsys, "model", "list")
    assert rc == 0 and "olmo3_32b" in out and "32,234,279,936" in out


def test_model_info_unknown_preset(capsys):
    rc, _, err = cli(capsys, "model", "info", "olmo3_7bb")
    exits_with_one_line(rc, err, "unknown model preset 'olmo3_7bb'", "'olmo3_7b'")


def test_export_loads_in_transformers(tiny_run, tmp_path, capsys):
    from olmoflow.pipeline.config import load_config
    from olmoflow.pipeline.stages.common import load_trained_model
    from olmoflow.tokenizer import Tokenizer

    out = tmp_path / "hf"
    rc, stdout, err = cli(capsys, "export", "hf", str(tiny_run / "pretrain" / STEP4), str(out))
    assert rc == 0, err
    assert "exported" in stdout
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert not leftovers, "temporary dir left behind"

    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "Olmo3ForCausalLM"  # the tiny preset has sliding windows
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ours_tok = Tokenizer.from_pretrained(tiny_run / "tokenizer")
    text = "def main():\n    return 'hello world'  # 42"
    ids = ours_tok(text, return_tensors="pt").input_ids
    assert hf_tok(text, return_tensors="pt").input_ids.tolist() == ids.tolist()

    cfg = load_config(str(tiny_run / "pretrain" / STEP4 / "config.yaml"))
    model, _, ckpt = load_trained_model(cfg)
    assert ckpt.name == STEP4
    # transformers orders the same math its own way: two ulps per accumulated term of the
    # logits' scale (tolerance.py); greedy then picks the same tokens wherever that bound cannot
    # flip the argmax.
    with torch.no_grad():
        assert_fp32_close(hf(ids).logits, model(ids).logits,
                          forward_terms(model.config, ids.shape[1]), 2)
    gen = hf.generate(ids, do_sample=False, max_new_tokens=8, min_new_tokens=8)
    assert gen.shape == (1, ids.shape[1] + 8)
    ours = model.generate(ids, max_new_tokens=8)
    with torch.no_grad():
        logits = model(ours).logits
    atol = fp32_rel(forward_terms(model.config, ours.shape[1]), 2) * float(logits.abs().max())
    assert_greedy_agrees(gen, ours, logits, atol, ids.shape[1])
    manifest = json.loads((out / "export_manifest.json").read_text())
    assert manifest["source_kind"] == "step" and "model.safetensors" in manifest["files"]


def test_export_bf16_from_latest_and_reexport(tiny_run, tmp_path, capsys):
    """The run's checkpoint folder resolves through ``latest``; --dtype bfloat16 writes bf16."""
    out = tmp_path / "bf16"
    rc, _, err = cli(capsys, "export", "hf", str(tiny_run / "pretrain"), str(out),
                     "--dtype", "bfloat16")
    assert rc == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "olmo3"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert hf.lm_head.weight.dtype == torch.bfloat16
    # Re-exporting a Hugging Face directory (e.g. a release) keeps the weights bit-identical.
    again = tmp_path / "again"
    rc, _, err = cli(capsys, "export", "hf", str(out), str(again))
    assert rc == 0, err
    from olmoflow.model.olmo import Olmo

    a, b = Olmo.from_pretrained(out).state_dict(), Olmo.from_pretrained(again).state_dict()
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == torch.bfloat16 for k in a)



def test_export_from_the_latest_pointer_file(tiny_run, tmp_path, capsys):
    """``run_dir/pretrain/latest`` (the pointer file a user tab-completes to) exports the checkpoint
    it names, the same weights as the pretrain folder itself."""
    from olmoflow.model.load import resolve_source

    pretrain = tiny_run / "pretrain"
    assert resolve_source(pretrain / "latest") == resolve_source(pretrain)
    rc, _, err = cli(capsys, "export", "hf", str(pretrain / "latest"), str(tmp_path / "o"))
    assert rc == 0, err

def test_export_bad_inputs(tiny_run, tmp_path, capsys):
    step = str(tiny_run / "pretrain" / STEP2)
    rc, _, err = cli(capsys, "export", "hf", str(tmp_path / "missing"), str(tmp_path / "o"))
    exits_with_one_line(rc, err, "does not exist")
    rc, _, err = cli(capsys, "export", "hf", str(tiny_run / "collect"), str(tmp_path / "o"))
    exits_with_one_line(rc, err, "is not a checkpoint")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    rc, _, err = cli(capsys, "export", "hf", step, str(busy))
    exits_with_one_line(rc, err, "not empty", "--force")
    assert (busy / "keep.txt").read_text() == "x"
    rc, _, err = cli(capsys, "export", "hf", step, str(busy), "--force")
    assert rc == 0, err
    assert (busy / "config.json").is_file() and not (busy / "keep.txt").exists()
    rc, _, err = cli(capsys, "export", "hf", step, str(tmp_path / "o"), "--dtype", "fp8")
    exits_with_one_line(rc, err, "unknown dtype 'fp8'")
    rc, _, err = cli(capsys, "export", "hf", step, str(tmp_path / "o"),
                     "--tokenizer", str(tmp_path))
    exits_with_one_line(rc, err, "no tokenizer.json")
    assert not (tmp_path / "o").exists()


def test_export_never_writes_over_the_checkpoint_folder(tiny_run, tmp_path, capsys):
    """``--force`` onto the folder that holds a run's checkpoints (or a folder above it) would
    delete them: refused, and every checkpoint is still there."""
    folder = tiny_run / "pretrain"
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    for out in (folder, tiny_run, folder / "export"):
        rc, _, err = cli(capsys, "export", "hf", str(folder / STEP2), str(out), "--force")
        exits_with_one_line(rc, err, "checkpoint folder")
    (tmp_path / "file").write_text("x")
    rc, _, err = cli(capsys, "export", "hf", str(folder / STEP2), str(tmp_path / "file" / "o"))
    exits_with_one_line(rc, err, "is a file")
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before
