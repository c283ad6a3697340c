"""The ``clean`` stage: length filters, the data engine's taggers and rules, and exact
deduplication over a documents file.

Rules run in this order on each document, and the first that fires names the removal:
too short, too long (stripped text length in characters), an ``exclude`` rule over the attributes
of the configured taggers (the engine's registry, plugins included, and the mixer's rule syntax:
a tagger registered once serves ``olmoflow data run`` and ``olmoflow run``), duplicate (the same
text, byte for byte, as an earlier kept document: the data engine's exact-dedup key,
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
from olmoflow.errors import OlmoflowError, closest

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
    docs: Iterator[dict[str, Any]], cfg: CleanConfig, counts: dict[str, Any],
    taggers: list[Any], seen_attributes: set[str],
) -> Iterator[dict[str, Any]]:
    """The documents that pass every rule; ``counts`` is updated as they stream through, and
    ``seen_attributes`` collects the attribute names the taggers wrote."""
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
        if cfg.exclude:
            attrs: dict[str, Any] = {}
            for t in taggers:
                attrs.update(t.tag(doc))
            seen_attributes.update(attrs)
            rule = next((r for r in cfg.exclude if r.holds(attrs, len(text))), None)
            if rule is not None:
                label = f"exclude: {rule.label}"
                counts["removed_by_rule"][label] = counts["removed_by_rule"].get(label, 0) + 1
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


def _empty_error(cfg: CleanConfig, counts: dict[str, Any]) -> OlmoflowError:
    return OlmoflowError(
        f"corpus is empty after cleaning: {counts['input_documents']} documents in, "
        f"{counts['removed_too_short']} too short (< min_chars={cfg.min_chars}), "
        f"{counts['removed_too_long']} too long (> max_chars={cfg.max_chars}), "
        f"{counts['removed_duplicate']} duplicates"
        + (f", {sum(counts['removed_by_rule'].values())} by clean.exclude rules"
           if counts.get("removed_by_rule") else "")
        + "; lower clean.min_chars or add data"
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
    counts: dict[str, Any] = dict.fromkeys(_COUNT_KEYS, 0)
    taggers = _taggers(cfg)
    if cfg.exclude:
        counts["removed_by_rule"] = {}
    names: set[str] = set()
    with tqdm(read_documents(in_path), desc="clean", unit="doc", disable=not progress) as docs:
        write_documents(out, _kept(iter(docs), cfg, counts, taggers, names))
    for i, rule in enumerate(cfg.exclude):
        if rule.attribute not in names and counts["input_documents"]:
            out.unlink(missing_ok=True)
            hint = closest(rule.attribute, names)
            raise OlmoflowError(f"clean.exclude[{i}]: unknown attribute '{rule.attribute}'"
                                + (f"; did you mean '{hint}'?" if hint else "")
                                + f" (the taggers wrote: {', '.join(sorted(names)) or 'none'})")
    if counts["documents"] == 0:
        out.unlink(missing_ok=True)
        raise _empty_error(cfg, counts)
    inputs = [in_path] + [Path(p).resolve() for p in cfg.plugins if p.endswith(".py")]
    return StageResult(inputs=inputs, outputs=[out], counts=counts)


def _taggers(cfg: CleanConfig) -> list[Any]:
    """The taggers ``cfg.exclude`` reads, with ``cfg.plugins`` imported first (their
    ``@register_tagger`` names); none without rules.

    Raises:
        OlmoflowError: a plugin that cannot be imported, an unknown tagger or option.
    """
    if not cfg.exclude:
        return []
    from olmoflow.data.taggers import import_plugins, make_taggers

    import_plugins(cfg.plugins)
    try:
        return make_taggers(cfg.taggers)
    except OlmoflowError as e:
        raise OlmoflowError(f"clean.taggers: {e}") from None
