"""Prompts with ground truth and the verifiers that score responses (RL with verifiable rewards).

A :class:`RLPrompt` is a prompt (a conversation, or a plain text) plus the answer a correct
response must reach. Three sources:

- :func:`arithmetic_prompts`: generated two-digit addition / subtraction, seeded, with a held-out
  split that is disjoint from the training split by construction (a hash of the problem decides
  its split, whatever the seed), in the ``arithmetic`` eval task's operand ranges;
- :func:`read_prompts` on GSM8K JSONL (``question``, ``answer`` ending in ``#### N``) or on a
  user's JSONL in open-instruct's RLVR shape (``messages`` or ``prompt``, plus ``ground_truth``
  or ``answer``);
- any list of :class:`RLPrompt` built in Python.

:class:`Verifier` is the reward of open-instruct's math verifiers reduced to what our tasks need
(Lambert et al. 2024, Tülu 3 "RLVR"): extract the final number of the response (the "The answer
is N" of lm-eval's strict match, else the last number), compare it with the gold after
normalization (commas, ``$``, ``18.00`` = ``18``); 1.0 when correct, else 0.0, plus an optional
format bonus (off by default, as OLMo 3's RL ran).
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from olmoflow.errors import OlmoflowError, unknown_name_error
from olmoflow.eval.answers import extract_final_number, gsm8k_gold, normalize_number
from olmoflow.eval.sources import guess_format, read_records
from olmoflow.posttrain.config import ARITHMETIC_FORMS
from olmoflow.posttrain.data import DataStats

ARITHMETIC_SPLITS = ("train", "heldout")
# One problem in HELDOUT_EVERY goes to the held-out split.
HELDOUT_EVERY = 5


@dataclass(frozen=True)
class RLPrompt:
    """One RL prompt with its ground truth.

    Attributes:
        where: ``file:line`` (or ``arithmetic:train:17``) for messages and provenance.
        answer: the gold final answer as text (a number for math; normalized when compared).
        messages: the conversation to continue (``[{"role", "content"}, ...]``, no final
            assistant turn), or None.
        text: a plain prompt, or None. Exactly one of ``messages`` / ``text`` is set; a text
            prompt is encoded as is without a chat template, and as one user turn with one.
    Raises:
        OlmoflowError: neither or both of ``messages`` / ``text``.
    """

    where: str
    answer: str
    messages: tuple[Mapping[str, Any], ...] | None = None
    text: str | None = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.text is None):
            raise OlmoflowError(f"{self.where}: an RL prompt needs exactly one of messages / text")
        if self.messages is not None and not isinstance(self.messages, tuple):
            object.__setattr__(self, "messages", tuple(self.messages))

    def conversation(self) -> list[Mapping[str, Any]]:
        """The prompt as messages (a text prompt becomes one user turn)."""
        if self.messages is not None:
            return list(self.messages)
        return [{"role": "user", "content": self.text}]


# --------------------------------------------------------------------------------------------
# Sources


def _arithmetic_problem(rng: random.Random, max_operand: int, ops: str) -> tuple[int, str, int]:
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    op = rng.choice(ops)
    if op == "-":  # non-negative results, as the arithmetic eval task
        a, b = max(a, b), min(a, b)
    return a, op, b


def _heldout(a: int, op: str, b: int) -> bool:
    # A stable hash (not Python's salted hash()): the split is the same in every process.
    return zlib.crc32(f"{a}{op}{b}".encode()) % HELDOUT_EVERY == 0


def _split_size(max_operand: int, ops: str, heldout: bool) -> int:
    """How many distinct problems the split holds (counted when small, else a lower bound that
    the draw loop never gets near)."""
    if max_operand > 300:
        return (max_operand + 1) ** 2 // (2 * HELDOUT_EVERY)
    r = range(max_operand + 1)
    return sum(_heldout(a, op, b) == heldout for op in set(ops) for a in r for b in r
               if op == "+" or a >= b)


def arithmetic_prompt_text(a: int, op: str, b: int, form: str = "question") -> str:
    """The prompt of one problem: ``"What is 17 + 25?"`` (``question``), ``"17+25="``
    (``bare``, for base models) or ``">>> 17 + 25\\n"`` (``doctest``, the ``arithmetic`` eval
    task's own context)."""
    if form == "question":
        return f"What is {a} {op} {b}?"
    if form == "bare":
        return f"{a}{op}{b}="
    return f">>> {a} {op} {b}\n"


def arithmetic_prompts(n: int, *, seed: int = 0, split: str = "train", form: str = "question",
                       max_operand: int = 99, ops: str = "+-",
                       unique: bool = True) -> list[RLPrompt]:
    """``n`` generated arithmetic problems (text prompts; ``answer`` the exact result).

    Problems are drawn from ``random.Random(f"arithmetic-rl:{seed}")``; a problem belongs to the
    ``heldout`` split when the CRC32 of ``"a op b"`` is divisible by :data:`HELDOUT_EVERY`, else
    to ``train``, so the two splits never share a problem for any pair of seeds.

    Args:
        n: how many prompts.
        split: ``"train"`` or ``"heldout"``.
        form: one of :data:`ARITHMETIC_FORMS` (see :func:`arithmetic_prompt_text`).
        max_operand: operands are drawn from ``0..max_operand``.
        ops: the operators to draw from (``"+"``, ``"-"`` or both).
        unique: no problem twice (fails when the split has fewer than ``n`` problems).
    Raises:
        OlmoflowError: an unknown ``split`` / ``form``, bad ``ops``, or more unique problems asked
            for than the split holds.
    """
    if split not in ARITHMETIC_SPLITS:
        raise unknown_name_error("arithmetic split", split, ARITHMETIC_SPLITS)
    if form not in ARITHMETIC_FORMS:
        raise unknown_name_error("arithmetic form", form, ARITHMETIC_FORMS)
    if not ops or set(ops) - {"+", "-"}:
        raise OlmoflowError(f"arithmetic ops must be made of '+' and '-', got {ops!r}")
    if unique:
        size = _split_size(max_operand, ops, split == "heldout")
        if n > size:
            raise OlmoflowError(f"{n} unique arithmetic problems asked for, but the {split} split "
                                f"of operands 0..{max_operand} ({ops}) holds {size}; raise "
                                "max_operand")
    rng = random.Random(f"arithmetic-rl:{seed}")
    out: list[RLPrompt] = []
    seen: set[tuple[int, str, int]] = set()
    while len(out) < n:
        a, op, b = _arithmetic_problem(rng, max_operand, ops)
        if _heldout(a, op, b) != (split == "heldout") or (unique and (a, op, b) in seen):
            continue
        seen.add((a, op, b))
        c = a + b if op == "+" else a - b
        out.append(RLPrompt(f"arithmetic:{split}:{len(out) + 1}", str(c),
                            text=arithmetic_prompt_text(a, op, b, form)))
    return out


def _gold_text(value: Any, where: str) -> str:
    if isinstance(value, bool):
        raise ValueError("the ground truth is a boolean")
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, list) and len(value) == 1:  # open-instruct stores some as [gt]
        return _gold_text(value[0], where)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"the ground truth must be a non-empty string or number, got "
                         f"{type(value).__name__}")
    return value.strip()


def prompt_from_record(rec: Any, where: str) -> RLPrompt:
    """One :class:`RLPrompt` from a record: GSM8K (``question`` + ``answer`` with ``####``), or
    open-instruct's RLVR shape (``messages`` or ``prompt``, plus ``ground_truth`` or ``answer``).
    A trailing assistant turn of ``messages`` (the reference solution) is dropped.

    Raises:
        ValueError: a record of neither shape (the message says which key is missing).
    """
    if not isinstance(rec, Mapping):
        raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    if "question" in rec and isinstance(rec.get("answer"), str) and "####" in rec["answer"]:
        if not isinstance(rec["question"], str) or not rec["question"].strip():
            raise ValueError("'question' must be a non-empty string")
        return RLPrompt(where, gsm8k_gold(rec["answer"]), text=rec["question"])
    gold_key = next((k for k in ("ground_truth", "answer") if k in rec), None)
    if gold_key is None:
        raise ValueError("no 'ground_truth' or 'answer' key (keys: "
                         f"{', '.join(map(str, rec)) or 'none'})")
    gold = _gold_text(rec[gold_key], where)
    if isinstance(rec.get("messages"), list):
        messages = list(rec["messages"])
        if messages and isinstance(messages[-1], Mapping) and messages[-1].get("role") == \
                "assistant":
            messages = messages[:-1]
        if not messages or not all(isinstance(m, Mapping) and isinstance(m.get("role"), str)
                                   and isinstance(m.get("content"), str) for m in messages):
            raise ValueError("'messages' must be a non-empty list of {role, content} objects")
        if not any(m["content"].strip() for m in messages):
            # nothing to answer: every response would be scored against no question
            raise ValueError("the prompt is empty (every message's content is blank)")
        return RLPrompt(where, gold, messages=tuple(dict(m) for m in messages))
    prompt = rec.get("prompt", rec.get("question"))
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("no 'messages' list or non-empty 'prompt' string")
    return RLPrompt(where, gold, text=prompt)


def read_prompts(source: str | Path | Sequence[str | Path] | Iterable[Any], *,
                 strict: bool = False, stats: DataStats | None = None,
                 limit: int | None = None) -> list[RLPrompt]:
    """RL prompts from files (``.jsonl``/``.json``, gzipped too) or from records in memory.

    Each record goes through :func:`prompt_from_record` (GSM8K or RLVR shape, detected per
    record). A bad record (unparsable line, missing key) raises under ``strict``, else is skipped
    and counted in ``stats.skipped`` as ``"file:line: why"``.

    Args:
        source: a path, a list of paths, or an iterable of records (dicts or ``(where, rec)``).
        strict: fail on the first bad record.
        stats: counts to fill (``read``, ``skipped``).
        limit: keep the first ``limit`` prompts.
    Raises:
        OlmoflowError: a missing file; a bad record under ``strict``, naming ``file:line`` and the
            missing key; no prompt at all (naming the file). A prompt whose messages are all blank
            is a bad record.
    """
    stats = stats if stats is not None else DataStats()
    out: list[RLPrompt] = []
    for where, rec in _iter_records(source, strict, stats):
        stats.read += 1
        try:
            out.append(prompt_from_record(rec, where))
        except (ValueError, OlmoflowError) as e:
            if strict:
                raise OlmoflowError(f"{where}: {e}") from None
            stats.skipped.append(f"{where}: {e}")
            continue
        if limit is not None and len(out) >= limit:
            break
    if not out:
        named = (f"{source}: " if isinstance(source, str | Path) else
                 f"{', '.join(map(str, source))}: " if isinstance(source, Sequence) and source
                 and all(isinstance(s, str | Path) for s in source) else "")
        raise OlmoflowError(f"{named}no RL prompts left to train on ({stats.summary()})"
                            + (f"; first problem: {stats.skipped[0]}" if stats.skipped else ""))
    return out


def _iter_records(source: Any, strict: bool, stats: DataStats):
    paths: list[Path] | None = None
    if isinstance(source, str | Path):
        paths = [Path(source)]
    elif isinstance(source, Sequence) and source and all(isinstance(s, str | Path)
                                                         for s in source):
        paths = [Path(s) for s in source]
    if paths is None:
        for i, r in enumerate(source, 1):
            yield r if isinstance(r, tuple) and len(r) == 2 else (f"record {i}", r)
        return
    for p in paths:
        if p.is_dir():
            raise OlmoflowError(f"{p}: is a directory, not a prompt file (JSONL)")
        if not p.is_file():
            raise OlmoflowError(f"{p}: no such prompt file")
        skipped: list[str] = []
        yield from read_records([p], guess_format(p), strict=strict, skipped=skipped)
        stats.read += len(skipped)  # unparsable lines (read_records raised under strict)
        stats.skipped.extend(skipped)


# --------------------------------------------------------------------------------------------
# Verifiers


def answers_match(predicted: str | None, gold: str) -> bool:
    """Whether an extracted answer equals the gold one: equal after
    :func:`~olmoflow.eval.answers.normalize_number` (``1,000`` = ``1000``, ``$5`` = ``5``,
    ``18.00`` = ``18``), or numerically within 1e-6 relative; a non-numeric gold compares
    case-insensitively."""
    if predicted is None:
        return False
    p, g = normalize_number(predicted), normalize_number(gold)
    if p == g:
        return True
    try:
        pf, gf = float(p), float(g)
    except ValueError:
        return p.strip().lower() == g.strip().lower()
    return abs(pf - gf) <= 1e-6 * max(1.0, abs(gf))


@dataclass(frozen=True)
class Verifier:
    """Final-answer reward: ``1.0`` when the response's final number equals the prompt's answer,
    else ``0.0``; plus ``format_weight`` when the response matches ``format_pattern`` (off by
    default: OLMo 3's RLVR rewards correctness only).

    A non-numeric gold answer is compared with the response's last line (stripped, any case).
    """

    format_weight: float = 0.0
    format_pattern: str = r"[Tt]he answer is"

    def correct(self, response: str, answer: str) -> bool:
        """Whether ``response`` reaches ``answer`` (see :func:`answers_match`)."""
        gold = normalize_number(answer)
        try:
            float(gold)
        except ValueError:  # a text answer: the last non-empty line of the response
            lines = [ln for ln in response.strip().splitlines() if ln.strip()]
            return bool(lines) and answers_match(lines[-1].strip(), answer)
        return answers_match(extract_final_number(response), answer)

    def __call__(self, response: str, prompt: RLPrompt) -> tuple[float, bool]:
        """``(reward, correct)`` of one response to ``prompt``."""
        ok = self.correct(response, prompt.answer)
        reward = 1.0 if ok else 0.0
        if self.format_weight and re.search(self.format_pattern, response):
            reward += self.format_weight
        return reward, ok
