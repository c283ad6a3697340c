"""Malformed task files: a bad record is skipped, counted and warned about (naming file:line) by
default, and is an OlmoflowError naming file:line under ``strict``."""

from __future__ import annotations

import json
import logging

import pytest

from olmoflow.errors import OlmoflowError
from olmoflow.eval.registry import get_task
from olmoflow.eval.task import EvalSettings

GOOD = {"id": "ok", "question": {"stem": "Q?", "choices": [{"text": "a", "label": "A"},
                                                            {"text": "b", "label": "B"}]},
        "answerKey": "A"}


def _arc_file(tmp_path):
    missing = {"id": "m", "question": {"choices": GOOD["question"]["choices"]},
               "answerKey": "A"}
    bad_key = dict(GOOD, id="k", answerKey="D")
    lines = [json.dumps(GOOD), "{not json", json.dumps(missing), json.dumps(bad_key),
             json.dumps(dict(GOOD, id="ok2"))]
    p = tmp_path / "ARC-Easy-Test.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_bad_records_skipped_counted_and_warned(tmp_path, caplog):
    p = _arc_file(tmp_path)
    t = get_task("arc_easy", EvalSettings(num_shots=0, path=p))
    with caplog.at_level(logging.WARNING):
        docs = t.load()
    assert [d.id for d in docs] == ["ok", "ok2"]
    assert t.skipped == 3
    text = caplog.text
    assert f"{p}:2" in text and "not JSON" in text
    assert f"{p}:3" in text and "stem" in text
    assert f"{p}:4" in text and "'D' is not among the choices" in text
    # the count reaches the result
    from olmoflow.eval.harness import run_tasks
    from olmoflow.eval.requests import LoglikelihoodResult

    class LM:
        def loglikelihood(self, reqs):
            return [LoglikelihoodResult(-1.0, False, 1) for _ in reqs]

    (res,) = run_tasks(LM(), [get_task("arc_easy", EvalSettings(num_shots=0, path=p))])
    assert res.skipped == 3 and res.n == 2


@pytest.mark.parametrize("line,why", [(2, "not JSON")])
def test_strict_raises_naming_file_line(tmp_path, line, why):
    p = _arc_file(tmp_path)
    with pytest.raises(OlmoflowError, match=f"{p.name}:{line}: {why}"):
        get_task("arc_easy", EvalSettings(num_shots=0, path=p, strict=True)).load()


def test_strict_missing_field_and_bad_key(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps(GOOD) + "\n" + json.dumps(dict(GOOD, answerKey="Z")) + "\n")
    with pytest.raises(OlmoflowError, match=r"a\.jsonl:2: answer key 'Z'"):
        get_task("arc_easy", EvalSettings(num_shots=0, path=p, strict=True)).load()
    p.write_text(json.dumps({"id": "x", "answerKey": "A"}) + "\n")
    t = get_task("arc_easy", EvalSettings(num_shots=0, path=p))
    assert t.load() == [] and t.skipped == 1


def test_other_formats(tmp_path):
    # MMLU CSV with a short row; WinoGrande without a blank; SciQ JSON missing a field
    csv = tmp_path / "mmlu_anatomy_test.csv"
    csv.write_text("q1,a,b,c,d,A\nq2,a,b,c\nq3,a,b,c,d,E\n")
    t = get_task("mmlu_anatomy", EvalSettings(num_shots=0, path=csv))
    assert len(t.load()) == 1 and t.skipped == 2
    with pytest.raises(OlmoflowError, match=r"_test\.csv:2: expected 6 columns"):
        get_task("mmlu_anatomy", EvalSettings(num_shots=0, path=csv, strict=True)).load()
    w = tmp_path / "dev.jsonl"
    w.write_text(json.dumps({"sentence": "no blank here", "option1": "a", "option2": "b",
                             "answer": "1"}) + "\n"
                 + json.dumps({"sentence": "a _ b", "option1": "a", "option2": "b",
                               "answer": "3"}) + "\n")
    t = get_task("winogrande", EvalSettings(num_shots=0, path=w))
    assert t.load() == [] and t.skipped == 2
    s = tmp_path / "valid.json"
    s.write_text(json.dumps([{"question": "q", "distractor1": "a", "distractor2": "b",
                              "correct_answer": "d"}]))
    with pytest.raises(OlmoflowError, match=r"valid\.json:record 1: missing field 'distractor3'"):
        get_task("sciq", EvalSettings(num_shots=0, path=s, strict=True)).load()


def test_label_file_mismatch_and_missing(tmp_path):
    p = tmp_path / "valid.jsonl"
    p.write_text(json.dumps({"goal": "g", "sol1": "a", "sol2": "b"}) + "\n")
    with pytest.raises(OlmoflowError, match="valid-labels.lst is missing"):
        get_task("piqa", EvalSettings(num_shots=0, path=p)).load()
    (tmp_path / "valid-labels.lst").write_text("0\n1\n")
    with pytest.raises(OlmoflowError, match="2 labels for 1 records"):
        get_task("piqa", EvalSettings(num_shots=0, path=p)).load()


def test_hellaswag_text_bad_label_and_truncated(tmp_path):
    p = tmp_path / "hellaswag_val_full.txt"
    p.write_text("A: b. c\nx\n1\n2\n3\n4\nA: b. c\n0\n1\n2\n3\n4\nA: trunc\n")
    t = get_task("hellaswag", EvalSettings(num_shots=0, path=p))
    assert len(t.load()) == 1 and t.skipped == 2
    with pytest.raises(OlmoflowError, match=r"\.txt:1: label 'x' is not a number"):
        get_task("hellaswag", EvalSettings(num_shots=0, path=p, strict=True)).load()


def test_missing_data_names_split(tmp_path):
    with pytest.raises(OlmoflowError, match="split=test"):
        get_task("csqa", EvalSettings(split="test", data_dir=tmp_path)).load()

def test_one_line_that_is_not_utf8_is_one_bad_line(tmp_path):
    """A JSONL file with one undecodable line: that line is skipped and counted with its number
    (an error under strict), the rest of the file is read."""
    from olmoflow.eval.sources import read_records
    from olmoflow.posttrain.data import DataStats, read_conversations

    path = tmp_path / "mixed.jsonl"
    good = (b'{"messages": [{"role": "user", "content": "a"}, '
            b'{"role": "assistant", "content": "b"}]}\n')
    path.write_bytes(good + b'{"text": "\xff\xfe"}\n' + good)
    skipped: list[str] = []
    assert [w for w, _ in read_records([path], "jsonl", skipped=skipped)] == [
        f"{path}:1", f"{path}:3"]
    assert skipped == [f"{path}:2: not UTF-8 text (invalid start byte at byte 10 of the line)"]
    stats = DataStats()
    assert len(list(read_conversations([path], stats=stats))) == 2
    with pytest.raises(OlmoflowError, match=r"mixed.jsonl:2: not UTF-8"):
        list(read_records([path], "jsonl", strict=True))
