"""The demo's offline instruction data: docstring -> function pairs from Python files."""

from __future__ import annotations

import csv
import gzip
import json

import pytest

from olmoflow.errors import OlmoflowError
from olmoflow.posttrain.data import DataStats, read_conversations
from olmoflow.posttrain.demo_data import (
    DemoDataStats,
    docstring_pairs,
    first_paragraph,
    heldout_stdlib_files,
    stdlib_subset,
    write_demo_sft_data,
)

MODULE = '''\
"""A module docstring is not a function."""
import functools


def add(a, b=1, *rest, scale: float = 2.0, **kw):
    """Add two numbers
    and scale them.

    More detail that is not the first paragraph.
    """
    total = a + b + sum(rest)
    return total * scale


def stub(x):
    """A stub with nothing else."""


def _private(x):
    """Hidden helper."""
    return x * 2 + 1 + len(str(x))


def undocumented(x):
    return x


class Stack:
    """A class."""

    @functools.cache
    def peek(self, default=None):
        """Return the top item, or ``default`` when empty."""
        text = """
a string whose lines start at column 0
"""
        return self.items[-1] if self.items else default

    def outer(self):
        """Outer method with a nested function."""
        def inner():
            """Nested functions are left out."""
            return 1
        return inner() + len(self.items)
'''


@pytest.fixture
def pyfile(tmp_path):
    p = tmp_path / "mod.py"
    p.write_text(MODULE)
    return p


def by_name(records):
    return {r["id"].split("::")[1]: r["messages"] for r in records}


def test_pairs_from_a_file(pyfile):
    st = DemoDataStats()
    recs = by_name(docstring_pairs([pyfile], min_chars=10, stats=st))
    assert sorted(recs) == ["Stack.outer", "Stack.peek", "add"]
    user, assistant = recs["add"]
    assert user == {"role": "user", "content":
                    "Write a Python function `add(a, b=1, *rest, scale: float=2.0, **kw)` that: "
                    "Add two numbers and scale them."}
    assert assistant == {"role": "assistant", "content": (
        "def add(a, b=1, *rest, scale: float = 2.0, **kw):\n"
        "    total = a + b + sum(rest)\n"
        "    return total * scale")}
    peek = recs["Stack.peek"][1]["content"]
    # a method: decorator kept, dedented to column 0, docstring gone, the literal left intact
    assert peek.startswith("@functools.cache\ndef peek(self, default=None):\n    text = ")
    assert "Return the top item" not in peek and "\na string whose lines start" in peek
    assert recs["Stack.peek"][0]["content"].endswith(
        "that: Return the top item, or ``default`` when empty.")
    assert "def inner():" in recs["Stack.outer"][1]["content"]
    assert (st.files, st.documented, st.private, st.too_short, st.kept) == (1, 5, 1, 1, 3)
    compile(recs["add"][1]["content"], "add", "exec")  # the answer is valid Python


def test_length_filters(pyfile):
    st = DemoDataStats()
    assert docstring_pairs([pyfile], min_chars=10, max_chars=60, stats=st) == []
    assert st.too_long == 3
    with pytest.raises(OlmoflowError, match="min_chars"):
        docstring_pairs([pyfile], min_chars=10, max_chars=5)


def test_deterministic_subset_and_order(tmp_path, pyfile):
    other = tmp_path / "other.py"
    other.write_text("".join(
        f'def f{i}(x):\n    """Function {i}."""\n    return x + {i} * 1000000\n\n'
        for i in range(20)))
    a = docstring_pairs([pyfile, other], seed=1, min_chars=10)
    assert docstring_pairs([other, pyfile], seed=1, min_chars=10) == a  # file order is moot
    assert docstring_pairs([pyfile, other], seed=2, min_chars=10) != a
    five = docstring_pairs([pyfile, other], seed=1, min_chars=10, limit=5)
    assert five == a[:5]
    assert len({r["id"] for r in a}) == len(a) == 23


def test_bad_files_are_skipped_and_counted(tmp_path, pyfile):
    bad = tmp_path / "bad.py"
    bad.write_text("def broken(:\n    pass\n")
    binary = tmp_path / "bin.py"
    binary.write_bytes(b"\xff\xfe not utf-8 \x00")
    st = DemoDataStats()
    recs = docstring_pairs([bad, binary, pyfile, tmp_path / "gone.py"], min_chars=10, stats=st)
    assert len(recs) == 3
    assert (st.files, st.syntax_errors, st.unreadable) == (4, 1, 2)


def test_written_records_read_as_messages(tmp_path, pyfile):
    out = tmp_path / "sft" / "demo.jsonl"
    counts = write_demo_sft_data(out, [pyfile], min_chars=10)
    assert counts["kept"] == 3 and counts["files"] == 1
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3 and all(json.loads(x)["source"] == "docstrings" for x in lines)
    ds = DataStats()
    convs = list(read_conversations([out], format="messages", strict=True, stats=ds))
    assert len(convs) == 3 and not ds.skipped
    assert [m["role"] for m in convs[0].messages] == ["user", "assistant"]
    with pytest.raises(OlmoflowError, match="no instruction pairs"):
        write_demo_sft_data(tmp_path / "none.jsonl", [tmp_path / "gone.py"])
    assert not (tmp_path / "none.jsonl").exists()


def test_first_paragraph():
    assert first_paragraph("One\n  two.\n\nThree.") == "One two."
    assert first_paragraph("\n\n") == ""


def _tokens_dir(root, heldout_ids, train_ids):
    """A minimal tokens directory: meta.json and one index per split (arrays left empty)."""
    (root / "tokenizer").mkdir(parents=True)
    splits = {}
    for split, ids in (("heldout", heldout_ids), ("train", train_ids)):
        d = root / "tokens" / split
        d.mkdir(parents=True)
        (d / "part-00000.npy").write_bytes(b"\0\0" * len(ids))
        with gzip.open(d / "part-00000.csv.gz", "wt", newline="") as f:
            csv.writer(f).writerows([i, i + 1, doc, "stdlib"] for i, doc in enumerate(ids))
        splits[split] = {"files": [{"path": f"{split}/part-00000.npy",
                                    "index": f"{split}/part-00000.csv.gz",
                                    "tokens": len(ids)}]}
    (root / "tokens" / "meta.json").write_text(json.dumps(
        {"format": "olmoflow-tokens", "dtype": "uint16", "splits": splits,
         "tokenizer": {"path": "../tokenizer", "implementation": "bpe"}}))
    return root / "tokens"


def test_heldout_files_from_a_tokens_dir(tmp_path):
    d = _tokens_dir(tmp_path, ["stdlib/json/decoder.py", "pydoc_topics/assert", "stdlib/nope.py"],
                    ["stdlib/json/encoder.py"])
    got = heldout_stdlib_files(d)
    assert [n for _, n in got] == ["stdlib/json/decoder.py"] and got[0][0].is_file()
    assert [n for _, n in heldout_stdlib_files(d, split="train")] == ["stdlib/json/encoder.py"]
    with pytest.raises(OlmoflowError, match="heldout"):
        heldout_stdlib_files(d, split="heldot")


def test_stdlib_subset_follows_the_tokenize_rule():
    from olmoflow.data.tokenize import heldout_score

    held = stdlib_subset(seed=42, fraction=0.05)
    rest = stdlib_subset(seed=42, fraction=0.05, invert=True)
    assert held and rest and not {n for _, n in held} & {n for _, n in rest}
    assert all(heldout_score(42, n) < 0.05 for _, n in held)
    assert stdlib_subset(seed=42, fraction=0.05) == held
