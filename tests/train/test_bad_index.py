"""A hand-edited or damaged ``checkpoints.csv`` never stops a save: the index is rebuilt from the
checkpoints on disk (with a warning) and ``latest`` points at the new checkpoint."""

from __future__ import annotations

import logging

import pytest
import torch

from olmoflow.train.checkpoint import INDEX, LATEST, read_index, save_checkpoint


def _save(folder, step):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return save_checkpoint(folder, step, model, opt, {"step": step, "tokens_seen": step * 10},
                           "model: {}\n", loss=1.5)


DAMAGED = {
    "missing_columns": "step,loss\n1,1.5\n",
    "garbage_row": "step,tokens,name,loss,saved_at,status\n1,10,stage1-step1-tokens10,1.5,,kept\n"
                   "\x00garbage,,\n",
    "wrong_step": "step,tokens,name,loss,saved_at,status\nX,10,stage1-step1-tokens10,1.5,,kept\n",
    "extra_fields": "step,tokens,name,loss,saved_at,status\n"
                    "1,10,stage1-step1-tokens10,1.5,,kept,9\n",
    "not_utf8": b"\xff\xfe\x00step\n",
}


@pytest.mark.parametrize("kind", sorted(DAMAGED))
def test_damaged_index_is_rebuilt_and_the_save_goes_on(tmp_path, kind, caplog):
    _save(tmp_path, 1)
    body = DAMAGED[kind]
    if isinstance(body, bytes):
        (tmp_path / INDEX).write_bytes(body)
    else:
        (tmp_path / INDEX).write_text(body)
    with caplog.at_level(logging.WARNING, logger="olmoflow.train.checkpoint"):
        final = _save(tmp_path, 2)
    assert (tmp_path / LATEST).read_text().strip() == final.name
    rows = read_index(tmp_path)
    assert [(r["step"], r["tokens"], r["name"], r["status"]) for r in rows] == [
        ("1", "10", "stage1-step1-tokens10", "kept"), ("2", "20", "stage1-step2-tokens20", "kept")]
    assert float(rows[0]["loss"]) == 1.5
    assert any("checkpoints.csv is damaged" in r.getMessage() for r in caplog.records)


def test_read_index_leaves_out_lines_that_are_not_rows(tmp_path):
    (tmp_path / INDEX).write_text("step,tokens,name,loss,saved_at,status\n"
                                  "3,30,stage1-step3-tokens30,,,kept\nrubbish\n")
    assert [r["name"] for r in read_index(tmp_path)] == ["stage1-step3-tokens30"]


def test_a_good_index_is_kept_without_a_warning(tmp_path, caplog):
    _save(tmp_path, 1)
    with caplog.at_level(logging.WARNING, logger="olmoflow.train.checkpoint"):
        _save(tmp_path, 2)
    assert not [r for r in caplog.records if r.name == "olmoflow.train.checkpoint"]
    assert [r["step"] for r in read_index(tmp_path)] == ["1", "2"]
