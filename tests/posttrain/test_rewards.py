"""RL prompts and verifiers: GSM8K / RLVR records, the generated arithmetic splits, and the
final-answer reward on the cases math answers come in (commas, $, negatives, decimals)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from olmoflow.errors import OlmoflowError
from olmoflow.posttrain.data import DataStats
from olmoflow.posttrain.rewards import (
    RLPrompt,
    Verifier,
    answers_match,
    arithmetic_prompts,
    read_prompts,
)

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"


def gsm(answer: str) -> RLPrompt:
    return read_prompts([{"question": "q?", "answer": f"Work it out.\n#### {answer}"}])[0]


@pytest.mark.parametrize("gold, response", [
    ("1,000", "So she pays 500 + 500 = 1000 dollars. The answer is $1,000."),
    ("1000", "The answer is 1,000"),
    ("$18", "It costs 18.00 dollars in all, 18"),
    ("-5", "The temperature drops to -5"),
    ("3.5", "Each gets 7/2 = 3.50"),
    ("0.25", "The answer is .25"),
    ("42", "21 * 2 = 42\nThe answer is 42."),
])
def test_correct_answers_get_reward_one(gold, response):
    reward, ok = Verifier()(response, gsm(gold))
    assert ok and reward == 1.0


@pytest.mark.parametrize("gold, response", [
    ("42", "The answer is 41."),
    ("42", "I cannot tell."),
    ("-5", "It drops to 5"),
    ("3.5", "3.6"),
    ("1,000", "The answer is 100 and then 0"),
    ("18", "The answer is 18 then 19 and the answer is 20"),  # the last "answer is" counts
    ("42", ""),
])
def test_wrong_answers_get_zero(gold, response):
    reward, ok = Verifier()(response, gsm(gold))
    assert not ok and reward == 0.0


def test_format_reward_off_by_default_and_added_when_on():
    p = gsm("7")
    assert Verifier()("The answer is 7", p) == (1.0, True)
    assert Verifier(format_weight=0.1)("The answer is 7", p) == (1.1, True)
    assert Verifier(format_weight=0.1)("The answer is 8", p) == (pytest.approx(0.1), False)
    assert Verifier(format_weight=0.1)("7", p) == (1.0, True)


def test_text_answers_and_match_helper():
    p = RLPrompt("x", "Paris", text="Capital of France?")
    assert Verifier()("Let me think.\nparis.", p)[1]
    assert not Verifier()("London", p)[1]
    assert answers_match("1e3", "1000") and not answers_match(None, "1")


def test_arithmetic_prompts_seeded_correct_and_heldout_disjoint():
    a = arithmetic_prompts(50, seed=3)
    assert a == arithmetic_prompts(50, seed=3) and a != arithmetic_prompts(50, seed=4)
    for p in a:  # "What is 17 + 25?" -> its true value
        x, op, y = p.text.removeprefix("What is ").rstrip("?").split()
        assert int(p.answer) == (int(x) + int(y) if op == "+" else int(x) - int(y)) >= 0
    train = {p.text for s in range(3) for p in arithmetic_prompts(300, seed=s, max_operand=30)}
    held = {p.text for s in range(3) for p in arithmetic_prompts(100, seed=s, split="heldout",
                                                                max_operand=30)}
    assert train and held and not train & held
    assert arithmetic_prompts(1, form="bare")[0].text.endswith("=")
    assert arithmetic_prompts(1, form="doctest")[0].text.startswith(">>> ")
    with pytest.raises(OlmoflowError, match="holds"):
        arithmetic_prompts(10_000, max_operand=9)
    with pytest.raises(OlmoflowError, match="did you mean 'heldout'"):
        arithmetic_prompts(1, split="held")


def test_read_prompts_formats_and_bad_lines(tmp_path):
    f = tmp_path / "rl.jsonl"
    lines = [
        json.dumps({"question": "Tom has 2 apples...", "answer": "2 + 3 = 5\n#### 5"}),
        json.dumps({"messages": [{"role": "user", "content": "2+2?"},
                                 {"role": "assistant", "content": "4"}], "ground_truth": "4"}),
        json.dumps({"prompt": "3*3=", "answer": 9}),
        "{not json",
        json.dumps({"prompt": "no answer here"}),
        json.dumps({"prompt": "x", "ground_truth": ["12"]}),
    ]
    f.write_text("\n".join(lines) + "\n")
    stats = DataStats()
    ps = read_prompts(f, stats=stats)
    assert [p.answer for p in ps] == ["5", "4", "9", "12"]
    assert ps[0].text.startswith("Tom") and ps[0].where == f"{f}:1"
    assert ps[1].messages == ({"role": "user", "content": "2+2?"},)  # the solution is dropped
    assert stats.read == 6 and len(stats.skipped) == 2
    assert sorted(s.split(":")[1] for s in stats.skipped) == ["4", "5"]
    assert any(s.startswith(f"{f}:5: no 'ground_truth' or 'answer'") for s in stats.skipped)
    with pytest.raises(OlmoflowError, match=rf"{f.name}:4"):
        read_prompts(f, strict=True)
    g = tmp_path / "bad.jsonl"
    g.write_text(lines[0] + "\n" + lines[4] + "\n")
    with pytest.raises(OlmoflowError, match=r"bad.jsonl:2: no 'ground_truth' or 'answer' key"):
        read_prompts(g, strict=True)
    with pytest.raises(OlmoflowError, match="no such prompt file"):
        read_prompts(tmp_path / "missing.jsonl")


def test_gsm8k_shared_data():
    path = SHARED / "gsm8k" / "test.jsonl"
    if not path.is_file():
        pytest.skip(f"shared data not found: {path}")
    ps = read_prompts(path, strict=True, limit=50)
    assert len(ps) == 50
    first = json.loads(path.read_text().splitlines()[0])
    solution = first["answer"]  # the reference solution itself earns the reward
    assert Verifier()(solution.replace("####", "The answer is"), ps[0]) == (1.0, True)

def test_a_prompt_directory_is_named_as_a_directory(tmp_path):
    with pytest.raises(OlmoflowError, match="is a directory"):
        read_prompts(tmp_path, stats=DataStats())
