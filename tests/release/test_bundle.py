"""The release bundle's own parts: the checkpoints index it ships and its model card."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from types import SimpleNamespace

import tomllib

from olmoflow.release.card import model_card
from olmoflow.release.checkpoints import FIELDS, checkpoints_table, kept_checkpoints
from olmoflow.release.config import ReleaseConfig
from olmoflow.run_dir import RunDir
from olmoflow.train.checkpoint import INDEX, INDEX_FIELDS, TRAINER_STATE


def write_index(folder, rows):
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=INDEX_FIELDS, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    (folder / INDEX).write_text(buf.getvalue())


def test_checkpoints_csv_is_the_training_stages_index_of_kept_checkpoints(tmp_path):
    runs = RunDir(tmp_path / "run")
    folder = runs.stage("pretrain")
    rows = []
    for step, status in ((10, "pruned"), (20, "kept"), (30, "kept"), (40, "kept")):
        name = f"stage1-step{step}-tokens{step}"
        rows.append({"step": step, "tokens": step * 8, "name": name, "loss": f"{5 - step / 10:.6f}",
                     "saved_at": "2026-01-01T00:00:00+00:00", "status": status})
        if status == "kept" and step != 40:  # step 40: kept by the policy, deleted since
            (folder / name).mkdir(parents=True)
            # Not a loadable trainer state: the index is read, no checkpoint is unpickled.
            (folder / name / TRAINER_STATE).write_bytes(b"not a pickle")
    rows[2]["loss"] = ""  # a checkpoint saved without a recorded loss
    write_index(folder, rows)
    kept = kept_checkpoints(runs, ["pretrain", "sft"])  # sft: no index, no rows
    got = list(csv.reader(io.StringIO(checkpoints_table(kept))))
    assert got[0] == list(FIELDS)
    assert [r[:5] for r in got[1:]] == [["pretrain", "20", "160", "stage1-step20-tokens20",
                                         "3.000000"],
                                        ["pretrain", "30", "240", "stage1-step30-tokens30", ""]]
    assert [e.source for e in kept] == [folder / "stage1-step20-tokens20",
                                        folder / "stage1-step30-tokens30"]


def test_checkpoints_csv_of_a_stage_without_an_index_has_only_the_header(tmp_path):
    assert checkpoints_table(kept_checkpoints(RunDir(tmp_path), ["sft"])) == \
        ",".join(FIELDS) + "\n"


def test_model_card_shows_the_model_the_data_and_the_evaluation(tmp_path):
    mc = SimpleNamespace(sliding_window=32, full_attention_every=4, d_model=64, n_layers=2,
                         n_heads=4, n_kv_heads=2, mlp_hidden=128, vocab_size=512, rope_theta=5e5)
    model = SimpleNamespace(config=mc, num_params=lambda: 1_234_567)
    card = model_card(ReleaseConfig(name="my-model", license="mit"), model,
                      report={"loss": 2.5, "perplexity": 12.18, "bpb": 1.25},
                      data={"documents": 7, "bytes": 900, "sources": ["a.txt", "b/"],
                            "train_tokens": 800, "heldout_tokens": 80},
                      release_dir=tmp_path / "release")
    assert card.startswith("---\nlicense: mit\n") and "# my-model" in card
    assert "1.2M-parameter OLMo 3-architecture" in card
    assert "7 documents collected (900 bytes; sources:\na.txt, b/), tokenized into 800 " in card
    assert "| bits per byte | 1.2500 |" in card
    assert f'Olmo.from_pretrained("{tmp_path / "release"}")' in card
    unknown = model_card(ReleaseConfig(), model, report={}, data={}, release_dir=tmp_path)
    assert "? documents collected" in unknown and "| loss (nats/token) | nan |" in unknown


def _card(tmp_path) -> str:
    mc = SimpleNamespace(sliding_window=None, full_attention_every=4, d_model=64, n_layers=2,
                         n_heads=4, n_kv_heads=2, mlp_hidden=128, vocab_size=512, rope_theta=5e5)
    model = SimpleNamespace(config=mc, num_params=lambda: 1000)
    return model_card(ReleaseConfig(), model, report={}, data={}, release_dir=tmp_path)


def test_model_card_links_the_project_url_of_pyproject_or_none(tmp_path, monkeypatch):
    from olmoflow.release import card

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    urls = tomllib.loads(pyproject.read_text())["project"].get("urls", {})
    want = next((v for k, v in urls.items() if k.lower() in card.URL_KEYS), None)
    assert card.project_url() == want  # this checkout's own pyproject.toml
    text = _card(tmp_path)
    assert "](https://github.com/)" not in text  # never a placeholder link
    if want is None:
        assert "trained with\nolmoflow from raw text" in text
    monkeypatch.setattr(card, "project_url", lambda: "https://example.org/olmoflow")
    assert "[olmoflow](https://example.org/olmoflow) from raw text" in _card(tmp_path)
    monkeypatch.setattr(card, "project_url", lambda: None)
    assert "trained with\nolmoflow from raw text" in _card(tmp_path)
