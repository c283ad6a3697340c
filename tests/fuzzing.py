"""Seeded fuzzing of everything a user (or an attacker) hands olmoflow: data files, run configs,
``key=value`` overrides, data-engine configs, ``tokenizer.json`` files and release directories.
The mutations and the rule live here; each family is a test beside the module it protects
(data/test_collect.py, data/test_sources.py, test_config.py, data/test_data_config.py,
tokenizer/test_bpe.py, model/test_damaged_files.py, test_cli.py: the tests named ``test_fuzz_*``).

For every generated input the outcome must be one of two: success with output that holds up, or
an :class:`~olmoflow.errors.OlmoflowError` (the CLI's one line and exit 2). Never a traceback,
never a hang (each case runs under a deadline), and a failing rerun never deletes the finished
output of the run before it. Most cases run in this process, through ``olmoflow.cli.main`` or
the function the CLI calls; a few run the real command in child processes for the real exit path.

The seed is fixed so a failure reproduces; ``OLMOFLOW_FUZZ_SEED`` picks another one and
``OLMOFLOW_FUZZ_CASES`` the number of cases per family (a failure names the seed and the case).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import random
import signal
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from olmoflow.cli import main
from olmoflow.errors import OlmoflowError

SEED = int(os.environ.get("OLMOFLOW_FUZZ_SEED", "1234"))


CASES = int(os.environ.get("OLMOFLOW_FUZZ_CASES", "200"))


ROOT = Path(__file__).resolve().parents[1]


DEADLINE_S = 20.0  # one case; the slowest legitimate one takes well under a second


# Values of every wrong kind: types, ranges, specials, sizes.
VALUES: list[Any] = [
    "", " ", "x", "nan", "inf", "-inf", "null", "true", "0", "-1", "1e309", "ü", "\u202e",
    0, 1, -1, 2, 3, 7, 10**6, 2**31 - 1, 2**31, 2**63, -2**63 - 1, 10**30, 0.5, -0.5, 1e-320,
    float("nan"), float("inf"), float("-inf"), True, False, None, [], {}, [1, 2], {"a": 1},
    [[[]]], "x" * 400, {"1": {"2": 3}},
]


# The same as override text (parsed as YAML by the CLI).
OVERRIDE_VALUES = ["", "nan", ".nan", ".inf", "-.inf", "-1", "0", "1", "2", "0.5", "-0.5",
                   "1e309", "99999999999999999999999999", "2147483647", "9223372036854775808",
                   "true", "false", "null", "~", "[]", "{}", "[1, 2]", "{a: 1}", "abc", "'1'",
                   "x" * 400, "[[[[[[]]]]]]", "!!binary aGk=", "&a 1", "*a", "{", "[", ":",
                   "'", "\"", "-", "1:2", "0x10", "1_000", "2e5", "\t"]


class Hang(Exception):
    """A case ran past its deadline."""


@contextlib.contextmanager
def deadline(seconds: float = DEADLINE_S) -> Iterator[None]:
    """Raise :class:`Hang` in the block after ``seconds`` (SIGALRM: this is the main thread)."""
    def ring(signum, frame):
        raise Hang(f"no result after {seconds} s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Findings:
    """The cases of one family that broke the rule, reported together at the end."""

    def __init__(self, family: str, cases: int = CASES):
        self.family, self.cases = family, cases
        self.bad, self.counts = [], {"ok": 0, "error": 0}

    def outcome(self, case: int, what: str, fn: Callable[[], Any]) -> tuple[str, Any]:
        """Run ``fn``: ``("ok", value)``, ``("error", message)`` for a one-line OlmoflowError;
        anything else (a traceback, a hang, a multi-line message) is recorded as a finding."""
        try:
            with deadline():
                value = fn()
        except OlmoflowError as e:
            msg = str(e)
            if not msg or "\n" in msg or "Traceback" in msg:
                self.add(case, what, f"not one line: {msg!r}")
            self.counts["error"] += 1
            return "error", msg
        except BaseException as e:  # a traceback the user would see, or a Rust panic
            if isinstance(e, KeyboardInterrupt):
                raise
            self.add(case, what, "".join(traceback.format_exception(e)[-3:]))
            return "crash", None
        self.counts["ok"] += 1
        return "ok", value

    def add(self, case: int, what: str, problem: str) -> None:
        self.bad.append(f"[seed {SEED} case {case}] {what[:300]}\n    {problem.strip()[:1200]}")

    def check(self) -> None:
        assert not self.bad, (f"{self.family}: {len(self.bad)} of {self.cases} cases broke the "
                              f"rule ({self.counts}):\n" + "\n".join(self.bad[:8]))
        # A family whose every case fails (or passes) exercises nothing: the mutations are off.
        assert self.counts["ok"] and self.counts["error"], (self.family, self.counts)


def rng_for(family: str) -> random.Random:
    return random.Random(f"{SEED}:{family}")


def run_cli(capsys, argv: list[str]) -> tuple[int, str]:
    """``olmoflow ARGV`` in this process: (exit status, stderr). A non-OlmoflowError escapes."""
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's usage errors
        rc = e.code if isinstance(e.code, int) else 2
    return rc, capsys.readouterr().err


def one_line(err: str) -> bool:
    """Whether ``err`` ends in exactly one ``olmoflow: error:`` line, with at most warnings (from
    the logging set up when pytest does not capture it) before it and no traceback."""
    lines = err.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("olmoflow: error: ")]
    return (len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in err
            and all(ln.startswith(("WARNING: ", "INFO: ", "olmoflow: note: "))
                    for ln in lines[:-1]))


def mutate_bytes(r: random.Random, data: bytes) -> bytes:
    """One random damage: truncate, flip, insert, delete or repeat a span, or add bad UTF-8."""
    if not data:
        return bytes(r.randrange(256) for _ in range(r.randrange(1, 16)))
    i = r.randrange(len(data))
    op = r.randrange(7)
    if op == 0:
        return data[:i]
    if op == 1:
        return data[:i] + bytes([data[i] ^ (1 << r.randrange(8))]) + data[i + 1:]
    if op == 2:
        return data[:i] + bytes(r.randrange(256) for _ in range(r.randrange(1, 8))) + data[i:]
    if op == 3:
        return data[:i] + data[i + r.randrange(1, 64):]
    if op == 4:
        return data[:i] + data[i:i + 64] * r.randrange(2, 5) + data[i:]
    if op == 5:
        return data[:i] + r.choice([b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\x00", b"\xef\xbb\xbf",
                                    b"\r", b"\x1b[2J"]) + data[i:]
    return b""


def deep(r: random.Random, n: int | None = None) -> Any:
    n = n if n is not None else r.choice([10, 100, 900, 1000, 5000])
    value: Any = "x"
    for _ in range(n):
        value = [value] if r.random() < 0.5 else {"k": value}
    return value


def odd_value(r: random.Random) -> Any:
    return deep(r) if r.random() < 0.05 else r.choice(VALUES)


def dumps(obj: Any) -> str:
    """JSON with NaN/Infinity allowed; a too-deep object becomes text that nests as deep."""
    try:
        return json.dumps(obj, allow_nan=True)
    except (RecursionError, ValueError):
        return "[" * 20000 + "]" * 20000


def good_docs(r: random.Random) -> list[dict[str, Any]]:
    words = "sea ship harbour wind rain stone tree river lantern meadow".split()
    return [{"id": f"d{i}", "text": " ".join(r.choice(words) for _ in range(r.randrange(8, 40))),
             "metadata": {"url": f"http://x/{i}"}} for i in range(r.randrange(1, 6))]


def mutated_data_file(r: random.Random, folder: Path, case: int) -> Path:
    """A JSONL (maybe gzipped) file with structural and byte-level damage."""
    docs: list[Any] = good_docs(r)
    for _ in range(r.randrange(0, 3)):
        op = r.randrange(6)
        j = r.randrange(len(docs)) if docs else 0
        if op == 0 and docs and isinstance(docs[j], dict):
            docs[j] = {**docs[j], "text": odd_value(r)}
        elif op == 1 and docs:
            docs[j] = odd_value(r)
        elif op == 2 and docs and isinstance(docs[j], dict):
            docs[j] = {**docs[j], r.choice(["id", "metadata", "source", "added"]): odd_value(r)}
        elif op == 3:
            docs.insert(j, {"text": deep(r)})
        elif op == 4 and docs and isinstance(docs[j], dict):
            docs[j].pop("text", None)
        else:
            docs.insert(j, {"text": "ok " * 5, "x": r.choice(VALUES)})
    lines = [dumps(d) for d in docs]
    text = r.choice(["\n", "\r\n"]).join(lines) + r.choice(["\n", "", "\n\n"])
    data = text.encode("utf-8", "surrogatepass")
    gz = r.random() < 0.4
    if r.random() < 0.5 and not gz:
        data = mutate_bytes(r, data)
    if gz:
        data = gzip.compress(data, mtime=0)
        if r.random() < 0.7:
            data = mutate_bytes(r, data)
    path = folder / f"case{case:04d}.jsonl{'.gz' if gz else ''}"
    path.write_bytes(data)
    return path


def mutated_yaml(r: random.Random, text: str) -> bytes:
    lines = text.splitlines()
    for _ in range(r.randrange(1, 4)):
        i = r.randrange(len(lines))
        op = r.randrange(10)
        line = lines[i]
        if op == 0:
            del lines[i]
        elif op == 1:
            lines.insert(i, line)  # a duplicated key
        elif op == 2 and ":" in line:
            key = line.split(":", 1)[0]
            lines[i] = f"{key}: {r.choice(OVERRIDE_VALUES)}"
        elif op == 3 and ":" in line:
            key = line.split(":", 1)[0]
            # PyYAML takes ~0.7 s to reach its recursion limit (about 1,000 deep): rarely that.
            n = r.choice([5, 50, 300]) if r.random() < 0.95 else 1200
            lines[i] = f"{key}: " + "[" * n + "]" * n
        elif op == 4:
            lines.insert(i, r.choice(["1: 2", "  1: 2", "  3.5: x", "null: 1", "  ? [a]\n  : 1",
                                      "true: 1"]))
        elif op == 5:
            lines[i] = line.lstrip() if line.startswith(" ") else "  " + line
        elif op == 6:
            lines.insert(i, r.choice(["  bogus_key: 1", "bogus_section: {a: 1}", "model: 3",
                                      "train: []", "!!python/object/apply:os.system ['true']",
                                      "x: !!python/name:os.system", "<<: {a: 1}", "---", "..."]))
        elif op == 7:
            lines[i] = line + r.choice([" #", " &anchor", " *nope", " ]", " {", " '", ": :"])
        elif op == 8:
            lines.insert(i, "deep: " + "{a: " * 150 + "1" + "}" * 150)
        else:
            lines[i] = line.replace(":", "", 1)
    data = "\n".join(lines).encode()
    return mutate_bytes(r, data) if r.random() < 0.2 else data


def json_paths(obj: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every path into a JSON tree (capped per container, so huge vocabularies stay cheap)."""
    yield prefix
    if isinstance(obj, dict):
        for k in list(obj)[:40]:
            yield from json_paths(obj[k], (*prefix, k))
    elif isinstance(obj, list):
        for i in range(min(len(obj), 5)):
            yield from json_paths(obj[i], (*prefix, i))


def mutate_json(r: random.Random, obj: Any) -> Any:
    """Delete, retype or add one thing somewhere in ``obj`` (a copy)."""
    obj = json.loads(json.dumps(obj))
    path = r.choice(list(json_paths(obj))[1:] or [()])
    if not path:
        return odd_value(r)
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    last = path[-1]
    op = r.randrange(4)
    if op == 0:
        del parent[last]
    elif op == 1:
        parent[last] = odd_value(r)
    elif op == 2 and isinstance(parent, dict):
        parent[r.choice(["x", "", "vocab", "type", "id", "0"])] = odd_value(r)
    else:
        parent[last] = r.choice([2**31 - 1, -1, 10**6, 2**64, 1.5, "x", None, []])
    return obj


def write_tiny_release(d: Path) -> Path:
    """A release directory (``config.json``, ``model.safetensors``) of a seeded 2-layer Olmo."""
    import torch

    from olmoflow.model.config import ModelConfig
    from olmoflow.model.hf import save_hf_dir
    from olmoflow.model.olmo import Olmo

    torch.manual_seed(0)
    model = Olmo(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, mlp_hidden=64,
                             max_sequence_length=64, sliding_window=8))
    save_hf_dir(model, d, eos_token_id=1)
    return d
