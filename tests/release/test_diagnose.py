"""Weight diagnosis: planted NaNs, outliers and a zeroed layer are each found and nothing else is;
``--reinit`` re-draws exactly the flagged tensors; exit codes and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from olmoflow.cli import main as cli_main
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo
from olmoflow.release.diagnose import DiagnoseSettings, diagnose_model, reinit_flagged
from olmoflow.scripts.diagnose_weights import main as diagnose_main
from olmoflow.tokenizer import BPETokenizer

NAN = "blocks.0.attention.w_q.weight"
OUTLIERS = "blocks.1.feed_forward.w1.weight"
ZEROED = "blocks.2.attention.w_out.weight"


def small_model() -> Olmo:
    torch.manual_seed(0)
    return Olmo(ModelConfig(vocab_size=320, d_model=32, n_layers=4, n_heads=2, mlp_hidden=64))


@torch.no_grad()
def plant(model: Olmo) -> None:
    """One NaN, 10% of a tensor at 50 init stds, and a whole projection zeroed."""
    p = dict(model.named_parameters())
    p[NAN].view(-1)[7] = float("nan")
    w = p[OUTLIERS].view(-1)
    idx = torch.randperm(w.numel(), generator=torch.Generator().manual_seed(1))[: w.numel() // 10]
    w[idx] = 50 * model.config.init_std
    p[ZEROED].zero_()


def flagged(reports) -> set[str]:
    return {r.name for r in reports if r.flagged}


def test_a_healthy_model_has_nothing_flagged():
    reports = diagnose_model(small_model())
    assert flagged(reports) == set()
    linear = next(r for r in reports if r.name == NAN)
    assert linear.rms / linear.init_rms == pytest.approx(1.0, abs=0.1)  # as initialised
    norm = next(r for r in reports if r.name == "norm.weight")
    assert norm.rms == norm.init_rms == 1.0


def test_each_planted_anomaly_is_found_and_nothing_else():
    model = small_model()
    plant(model)
    reports = {r.name: r for r in diagnose_model(model)}
    assert flagged(reports.values()) == {NAN, OUTLIERS, ZEROED}
    assert reports[NAN].nan == 1 and reports[NAN].inf == 0
    assert "1 NaN" in reports[NAN].reasons[0]
    assert reports[OUTLIERS].outliers == reports[OUTLIERS].numel // 10
    assert reports[ZEROED].dead_rows == reports[ZEROED].shape[0]
    assert any("siblings" in r for r in reports[ZEROED].reasons)
    # the planted outliers hide behind the plain std (k=6 of it is ~95 init stds), not the MAD
    assert reports[OUTLIERS].anomaly_share == pytest.approx(0.1, abs=0.001)


def test_below_the_threshold_is_counted_not_flagged():
    model = small_model()
    with torch.no_grad():
        w = dict(model.named_parameters())[OUTLIERS].view(-1)
        w[:10] = 50 * model.config.init_std  # 10 of 2048: 0.5%
    r = {x.name: x for x in diagnose_model(model)}[OUTLIERS]
    assert r.outliers == 10 and not r.flagged
    assert flagged(diagnose_model(model, DiagnoseSettings(threshold=0.001))) == {OUTLIERS}


def test_reinit_redraws_only_the_flagged_tensors():
    model = small_model()
    plant(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = sorted(flagged(diagnose_model(model)))
    reinit_flagged(model, names, init_std=model.config.init_std, seed=0)
    after = model.state_dict()
    for k in before:
        if k in names:
            assert torch.isfinite(after[k]).all() and not torch.equal(after[k], before[k])
        else:
            assert torch.equal(after[k], before[k]), k
    assert flagged(diagnose_model(model)) == set()


@pytest.fixture()
def planted_dir(tmp_path):
    model = small_model()
    plant(model)
    tok = BPETokenizer().train_from_texts(["the cat sat on the mat " * 20], vocab_size=300)
    d = tmp_path / "planted"
    model.save_pretrained(d, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tok.save(d)
    return d


def test_command_exit_codes_json_and_reinit(planted_dir, tmp_path, capsys):
    out, report = tmp_path / "fixed", tmp_path / "report.json"
    assert cli_main(["diagnose", str(planted_dir), "--json", str(report),
                     "--reinit", str(out)]) == 1
    text = capsys.readouterr().out
    assert "3 flagged" in text and NAN in text and ZEROED in text
    data = json.loads(report.read_text())
    assert sorted(data["flagged"]) == sorted([NAN, OUTLIERS, ZEROED])
    assert len(data["tensors"]) == len(list(small_model().parameters()))
    old, new = (load_file(d / "model.safetensors") for d in (planted_dir, out))
    changed = {k for k in old if not torch.equal(old[k], new[k])}
    assert len(changed) == 3 and old.keys() == new.keys()
    manifest = json.loads((out / "export_manifest.json").read_text())
    assert sorted(manifest["reinitialised"]) == sorted(data["flagged"])
    assert (out / "tokenizer.json").is_file()
    assert diagnose_main([str(out)]) == 0  # the re-initialised model is clean


def test_module_entry_point_and_bad_input(planted_dir, tmp_path, capsys):
    r = subprocess.run([sys.executable, "-m", "olmoflow.scripts.diagnose_weights",
                        str(planted_dir), "--all"], capture_output=True, text=True)
    assert r.returncode == 1 and "embeddings.weight" in r.stdout  # --all lists every tensor
    assert diagnose_main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err
    assert diagnose_main([str(planted_dir), "--threshold", "2"]) == 2
    assert diagnose_main([str(planted_dir), "--reinit", str(planted_dir)]) == 2  # own folder
    card = planted_dir / "config.json"  # an existing file is never overwritten without --force
    before = card.read_bytes()
    assert diagnose_main([str(planted_dir), "--json", str(card)]) == 2
    assert card.read_bytes() == before
