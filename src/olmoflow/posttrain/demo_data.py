"""The demo's instruction data, made offline from Python source: docstring -> function pairs.

The demo pretrains on the Python standard library, so its SFT data comes from there too, with no
download: each documented function or method becomes one conversation (the ``messages`` format of
:mod:`olmoflow.posttrain.data`)::

    {"id": "stdlib/json/decoder.py::JSONDecoder.decode", "source": "docstrings",
     "messages": [
        {"role": "user", "content": "Write a Python function `decode(self, s, _w=WHITESPACE.match)`
                                     that: Return the Python representation of ``s`` ..."},
        {"role": "assistant", "content": "def decode(self, s, _w=WHITESPACE.match):\\n    obj, end
                                          = ..."}]}

the instruction being the first paragraph of the docstring and the answer the function's own
source (decorators included, dedented when it is a method) without its docstring, as in the
docstring -> code direction of CodeSearchNet (Husain et al. 2019) and CodeXGLUE's text-to-code.

Which files: the stdlib files the ``tokenize`` stage held out (:func:`heldout_stdlib_files`,
read from the held-out split's document index of a tokens directory), so the assistant answers are
code the base model never trained on. Without a tokens directory, :func:`stdlib_subset` applies
the tokenize stage's own rule (``heldout_score(seed, id) < fraction``, on the ``stdlib/<path>``
document ids) to every stdlib file: the same files, up to the ``heldout_max_documents`` cap and
the documents cleaning dropped. Note that an SFT model trained on these pairs has then seen the
held-out code, so its held-out BPB is no longer a clean held-out measure; pass ``split="train"``
to :func:`heldout_stdlib_files` (or ``invert=True`` to :func:`stdlib_subset`) to build from the
training files instead.
"""

from __future__ import annotations

import ast
import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from olmoflow.artifacts import atomic_write_text
from olmoflow.errors import OlmoflowError

SOURCE = "docstrings"
PROMPT = "Write a Python function `{name}({args})` that: {doc}"


@dataclass
class DemoDataStats:
    """Counts of one :func:`docstring_pairs` pass.

    Attributes:
        files: files given; syntax_errors / unreadable: of those, skipped (not Python 3 source
            this interpreter parses; not UTF-8 or not readable).
        documented: functions and methods with a docstring; of those, skipped as ``private``
            (a name starting with ``_``), ``too_short`` (no code, or under ``min_chars``),
            ``too_long`` (over ``max_chars``), ``inline_docstring`` (the docstring shares a line
            with code, so it cannot be cut out by lines); ``candidates`` is what is left, and
            ``kept`` the records returned (at most ``limit``).
    """

    files: int = 0
    syntax_errors: int = 0
    unreadable: int = 0
    documented: int = 0
    private: int = 0
    too_short: int = 0
    too_long: int = 0
    inline_docstring: int = 0
    candidates: int = 0
    kept: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def _name_of(f: str | Path | tuple[Path, str]) -> tuple[Path, str]:
    """``(path, id prefix)``: ``stdlib_files()`` pairs keep their ``stdlib/<path>`` name."""
    if isinstance(f, tuple):
        return Path(f[0]), str(f[1])
    return Path(f), Path(f).as_posix()


def _functions(tree: ast.Module) -> Iterable[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """``(qualified name, node)`` of module-level functions and of methods of classes (nested
    classes too), in source order. Functions inside functions are left out: they lean on the
    enclosing scope, so alone they are not a task one can state."""
    def walk(body: list[ast.stmt], prefix: str):
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield prefix + node.name, node
            elif isinstance(node, ast.ClassDef):
                yield from walk(node.body, f"{prefix}{node.name}.")
    yield from walk(tree.body, "")


def first_paragraph(docstring: str) -> str:
    """The first paragraph of a (cleaned, ``inspect.cleandoc``-style) docstring, its lines joined
    by single spaces."""
    para = docstring.strip().split("\n\n", 1)[0]
    return " ".join(line.strip() for line in para.splitlines() if line.strip())


def _is_blank_or_comment(text: str) -> bool:
    return not text.strip() or text.lstrip().startswith("#")


def function_source(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The source of ``node`` (``lines``: the file's lines, ends kept), decorators included,
    with its docstring's lines removed and the common indentation taken off (a method reads as
    a function). None when the docstring shares a line with other code."""
    doc = node.body[0]
    if doc.lineno == node.lineno:  # def f(): "doc"
        return None
    first, last = lines[doc.lineno - 1], lines[doc.end_lineno - 1]
    if first[: doc.col_offset].strip() or not _is_blank_or_comment(last[doc.end_col_offset:]):
        return None  # x = 1; "doc"  or  "doc"; x = 1
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    kept = lines[start - 1 : doc.lineno - 1] + lines[doc.end_lineno : node.end_lineno]
    # Take off the def's own indentation, not textwrap.dedent's common prefix: a string literal
    # whose continuation lines start at column 0 would leave a method indented.
    n = node.col_offset
    return "".join(ln[n:] if not ln[:n].strip() else ln for ln in kept).rstrip()


def _score(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big")


def docstring_pairs(
    files: Iterable[str | Path | tuple[Path, str]],
    *,
    limit: int | None = None,
    seed: int = 0,
    max_chars: int = 1500,
    min_chars: int = 40,
    stats: DemoDataStats | None = None,
) -> list[dict[str, Any]]:
    """Instruction records from the documented functions and methods of Python files.

    Args:
        files: ``.py`` paths, or ``(path, name)`` pairs as
            :func:`olmoflow.data.readers.stdlib_files` gives (``name`` starts the record ids).
        limit: keep at most this many records (None: all).
        seed: which records and in which order: records are sorted by a sha256 of
            ``f"{seed}:{id}"``, so the subset is the same whatever the order of ``files``, and a
            record's place depends only on its id.
        max_chars: skip functions whose answer (source without docstring) is longer.
        min_chars: skip functions whose answer is shorter (stubs such as ``pass`` or
            ``raise NotImplementedError``).
        stats: counts to update (see :class:`DemoDataStats`).

    Returns:
        ``[{"id", "source", "messages": [user, assistant]}, ...]`` (the module docstring shows
        one); ids are ``<file name>::<Class.>name``, with ``@<line>`` added when a name repeats.

    Raises:
        OlmoflowError: ``limit`` below 0, or ``min_chars`` / ``max_chars`` out of order.
    """
    if limit is not None and limit < 0:
        raise OlmoflowError(f"limit must be >= 0 or None, got {limit}")
    if not 0 <= min_chars <= max_chars:
        raise OlmoflowError(f"need 0 <= min_chars <= max_chars, got {min_chars} and {max_chars}")
    st = stats if stats is not None else DemoDataStats()
    records: dict[str, dict[str, Any]] = {}
    for f in files:
        path, name = _name_of(f)
        st.files += 1
        try:
            source = path.read_bytes().decode("utf-8-sig")
        except (OSError, UnicodeDecodeError):
            st.unreadable += 1
            continue
        try:
            tree = ast.parse(source, filename=str(path))
        except (SyntaxError, ValueError):  # ValueError: a NUL byte in the source
            st.syntax_errors += 1
            continue
        lines = source.splitlines(keepends=True)
        for qual, node in _functions(tree):
            doc = ast.get_docstring(node)
            if not doc or not first_paragraph(doc):
                continue
            st.documented += 1
            if node.name.startswith("_"):
                st.private += 1
                continue
            code = function_source(lines, node)
            if code is None:
                st.inline_docstring += 1
                continue
            if len(node.body) < 2 or len(code) < min_chars:  # a docstring and nothing else
                st.too_short += 1
                continue
            if len(code) > max_chars:
                st.too_long += 1
                continue
            rid = f"{name}::{qual}"
            if rid in records:  # a redefinition (if/else branches, overloads)
                rid = f"{rid}@{node.lineno}"
            prompt = PROMPT.format(name=node.name, args=ast.unparse(node.args),
                                   doc=first_paragraph(doc))
            records[rid] = {"id": rid, "source": SOURCE, "messages": [
                {"role": "user", "content": prompt}, {"role": "assistant", "content": code}]}
    st.candidates += len(records)
    order = sorted(records, key=lambda r: (_score(seed, r), r))
    out = [records[r] for r in (order if limit is None else order[:limit])]
    st.kept += len(out)
    return out


def write_demo_sft_data(
    out_path: str | Path,
    files: Iterable[str | Path | tuple[Path, str]],
    *,
    limit: int | None = None,
    seed: int = 0,
    max_chars: int = 1500,
    min_chars: int = 40,
) -> dict[str, int]:
    """Write :func:`docstring_pairs` of ``files`` to ``out_path`` as JSONL (one record a line,
    UTF-8, written atomically) and return the counts of :class:`DemoDataStats`.

    Raises:
        OlmoflowError: as :func:`docstring_pairs`; no record at all (the files hold no documented
            function that passes the filters); a write that fails for lack of room.
    """
    st = DemoDataStats()
    records = docstring_pairs(files, limit=limit, seed=seed, max_chars=max_chars,
                              min_chars=min_chars, stats=st)
    if not records:
        raise OlmoflowError(f"no instruction pairs from {st.files} file(s) for {out_path} "
                            f"({st.to_dict()}); give files with documented functions")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return st.to_dict()


# ---- which files ---------------------------------------------------------------------------


def heldout_stdlib_files(tokens_dir: str | Path, *, split: str = "heldout"
                         ) -> list[tuple[Path, str]]:
    """``(path, "stdlib/<path>")`` of the stdlib files in one split of a tokens directory: the
    document ids of its index files (``.csv.gz``) that name stdlib modules, found in the running
    Python's standard library (ids of another Python's files that this one lacks are left out).

    Raises:
        OlmoflowError: not a tokens directory (see :func:`olmoflow.data.tokenize.open_token_dir`)
            or an unknown split.
    """
    from olmoflow.data.readers import stdlib_files
    from olmoflow.data.tokenize import SPLITS, index_path, open_token_dir, read_index

    if split not in SPLITS:
        from olmoflow.errors import unknown_name_error

        raise unknown_name_error("token split", split, SPLITS)
    td = open_token_dir(tokens_dir)
    ids = {doc_id for p in (td.heldout if split == "heldout" else td.train)
           for _, _, doc_id, _ in read_index(index_path(p))}
    return [(path, name) for path, name in stdlib_files() if name in ids]


def stdlib_subset(*, seed: int = 42, fraction: float = 0.02, invert: bool = False
                  ) -> list[tuple[Path, str]]:
    """``(path, "stdlib/<path>")`` of the stdlib files the tokenize stage's rule holds out
    (``heldout_score(seed, "stdlib/<path>") < fraction``; ``seed`` is the run's ``seed``, 42 in
    the demo, and ``fraction`` its ``tokenize.heldout_fraction``), or with ``invert`` the others.
    Used when no tokens directory is at hand; see the module docstring for how it can differ.

    Raises:
        OlmoflowError: ``fraction`` outside [0, 1].
    """
    from olmoflow.data.readers import stdlib_files
    from olmoflow.data.tokenize import check_heldout_config, heldout_score

    check_heldout_config(fraction, 0)
    return [(p, n) for p, n in stdlib_files() if (heldout_score(seed, n) < fraction) != invert]
