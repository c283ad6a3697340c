"""Config sections of the data path: collect, clean and tokenize."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CollectConfig:
    """Where documents come from.

    ``sources`` entries are ``"stdlib"`` (the running Python's standard library: module sources
    without test suites, plus the prose of ``pydoc_data.topics``), ``hf://name[:config]/split`` (a
    local Hugging Face dataset directory), or a file, directory or glob of ``.txt``, JSONL
    (``.jsonl``, ``.jsonl.gz``, ``.json.gz``, ``.jsonl.zst``), ``.parquet`` or WARC (``.warc``,
    ``.warc.gz``) files (see :mod:`olmoflow.data.readers`). ``strict`` turns skipped bad input
    (malformed lines, damaged files, empty files) into errors.
    """

    sources: list[str] = field(default_factory=lambda: ["stdlib"])
    text_field: str = "text"
    strict: bool = False
    max_documents: int | None = None


@dataclass
class CleanConfig:
    """Document filters: length bounds in characters (after stripping) and exact deduplication."""

    min_chars: int = 64
    max_chars: int = 1_000_000
    dedup: bool = True


@dataclass
class TokenizeConfig:
    """Token arrays and the held-out split (whole documents, chosen by a seeded hash of the id)."""

    heldout_fraction: float = 0.02
    heldout_max_documents: int = 200
