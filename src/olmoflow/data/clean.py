"""The ``clean`` stage: length filters and exact deduplication over a documents file.

Rules run in this order on each document, and the first that fires names the removal:
too short, too long (stripped text length in characters), duplicate (the same text, byte for byte,
as an earlier kept document: the data engine's exact-dedup key,
:func:`olmoflow.data.dedup.exact_key`). Kept documents are written unchanged and in their original
order, so cleaning a cleaned file changes nothing. This is the one-machine front door; the data
engine's ``dedup`` step does the same exact deduplication (and more) over shards.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from olmoflow.artifacts import StageResult
from olmoflow.data.config import CleanConfig
from olmoflow.data.dedup import exact_key
from olmoflow.data.documents import DOCUMENTS, read_documents, write_documents
from olmoflow.errors import OlmoflowError

_COUNT_KEYS = (
    "input_documents", "documents", "removed_too_short", "removed_too_long", "removed_duplicate",
    "bytes",
)


def _check_config(cfg: CleanConfig) -> None:
    if cfg.min_chars < 0:
        raise OlmoflowError(f"clean.min_chars must be >= 0, got {cfg.min_chars}")
    if cfg.max_chars < cfg.min_chars:
        raise OlmoflowError(
            f"clean.max_chars ({cfg.max_chars}) is below clean.min_chars ({cfg.min_chars})"
        )


def _kept(
    docs: Iterator[dict[str, Any]], cfg: CleanConfig, counts: dict[str, int]
) -> Iterator[dict[str, Any]]:
    """The documents that pass every rule; ``counts`` is updated as they stream through."""
    seen: set[tuple[int, int]] = set()
    for doc in docs:
        counts["input_documents"] += 1
        text = doc["text"]
        n_chars = len(text.strip())
        if n_chars < cfg.min_chars:
            counts["removed_too_short"] += 1
            continue
        if n_chars > cfg.max_chars:
            counts["removed_too_long"] += 1
            continue
        if cfg.dedup:
            key = exact_key(text)
            if key in seen:
                counts["removed_duplicate"] += 1
                continue
            seen.add(key)
        counts["documents"] += 1
        counts["bytes"] += len(text.encode("utf-8"))
        yield doc


def _empty_error(cfg: CleanConfig, counts: dict[str, int]) -> OlmoflowError:
    return OlmoflowError(
        f"corpus is empty after cleaning: {counts['input_documents']} documents in, "
        f"{counts['removed_too_short']} too short (< min_chars={cfg.min_chars}), "
        f"{counts['removed_too_long']} too long (> max_chars={cfg.max_chars}), "
        f"{counts['removed_duplicate']} duplicates; lower clean.min_chars or add data"
    )


def clean(cfg: CleanConfig, in_path: Path, out_dir: Path, progress: bool = True) -> StageResult:
    """Filter the documents of ``in_path`` into ``out_dir/documents.jsonl.gz``.

    Drops documents whose stripped text is shorter than ``cfg.min_chars`` or longer than
    ``cfg.max_chars`` characters, then (when ``cfg.dedup``) exact duplicates of the text, keeping
    the first copy. Order is preserved. Counts: ``input_documents``, ``documents`` (kept),
    ``removed_too_short``, ``removed_too_long``, ``removed_duplicate``, ``bytes`` (UTF-8 bytes of
    the kept text).

    Raises:
        OlmoflowError: bad bounds, ``in_path`` missing or damaged, or no document left.
    """
    _check_config(cfg)
    in_path, out = Path(in_path), Path(out_dir) / DOCUMENTS
    if not in_path.is_file():
        raise OlmoflowError(f"no such file: '{in_path}' (run collect first)")
    counts = dict.fromkeys(_COUNT_KEYS, 0)
    with tqdm(read_documents(in_path), desc="clean", unit="doc", disable=not progress) as docs:
        write_documents(out, _kept(iter(docs), cfg, counts))
    if counts["documents"] == 0:
        out.unlink(missing_ok=True)
        raise _empty_error(cfg, counts)
    return StageResult(inputs=[in_path], outputs=[out], counts=counts)
