"""The mixer: documents + attribute sets → filtered, re-weighted, masked, size-limited documents.

Reads every documents shard ``DIR/documents/<source>/<shard>.jsonl.gz`` together with its
line-aligned attribute files ``DIR/attributes/<set>/<source>/<shard>.jsonl.gz`` (Dolma's layout,
as in Dolma's ``mixer``), and for each document, in this order:

1. ``include`` rules: the document is kept only if every one holds;
2. ``exclude`` rules: the first that holds drops the document;
3. the per-source sampling ``weight``: ``w < 1`` keeps a document when ``u < w``, ``w > 1`` writes
   ``floor(w)`` copies plus one more when ``u < w - floor(w)``, where
   ``u = int.from_bytes(blake2b(f"{seed}:{id}", digest_size=8), "big") / 2**64`` — a
   deterministic uniform number per (seed, id), so the same documents are chosen on every run and
   whatever the number of workers. Copy ``k >= 1`` gets the id ``f"{id}#{k}"``;
4. span edits: ``replace`` masks spans (``{pii__email_address: "|||EMAIL_ADDRESS|||"}``) and
   ``remove_spans`` deletes them (e.g. ``dedup__paragraphs``); a document left blank is dropped;
5. size limits: ``max_documents`` / ``max_bytes`` in total keep a prefix of the output in shard
   order; ``max_documents_per_shard`` / ``max_bytes_per_shard`` split the output into parts
   ``DIR/mixed/<source>/<shard>-NNNN.jsonl.gz``.

A rule is ``{attribute, op, value[, aggregate][, name]}`` or the same as one string,
``"[aggregate(]attribute[)] op value"``, e.g. ``"gopher__word_count < 50"`` or
``"count(pii__email_address) > 0"`` (see :mod:`olmoflow.data.rules`). The source of a document,
for weights and per-source stats, is its shard's directory under ``DIR/documents``.

Every dropped document is explained: the stats count documents and bytes per rule and per source,
and ``DIR/attributes/mixer/<source>/<shard>.jsonl.gz`` (when ``write_dropped``) holds, line-aligned
with the documents, ``{"id", "attributes": {"mixer__copies": [[0, len, copies]]}, "dropped_by"}``.
Invariant: ``documents_in == documents_kept + sum(removed[rule].documents)``.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from olmoflow.artifacts import atomic_open
from olmoflow.config import ConfigValueError, as_section, check_int64
from olmoflow.data.documents import encode_document
from olmoflow.data.executor import sum_stats
from olmoflow.data.rules import parse_rule
from olmoflow.data.shards import (
    ATTRIBUTES_DIR,
    DOCUMENTS_DIR,
    MAX_ERRORS_LISTED,
    MIXED_DIR,
    RunJobs,
    attribute_path,
    document_shards,
    input_signature,
    local_runner,
    read_records,
    shard_source,
    shard_stem,
    text_bytes,
    write_jsonl_gz,
)
from olmoflow.errors import OlmoflowError, closest, unknown_name_error

# ---------------------------------------------------------------------------------------------
# Config


@dataclasses.dataclass
class MixConfig:
    """The mixer's options, the data engine's ``mixer`` section (see the module docstring for
    what each does).

    ``attributes`` lists the attribute sets to read (directories under ``DIR/attributes``; None:
    in the data engine, every set its finished steps wrote, else none). ``include`` and
    ``exclude`` hold rules, each a string or a mapping (:func:`olmoflow.data.rules.parse_rule`),
    made :class:`Rule` objects here. ``replace`` maps an attribute to the text that replaces its
    spans; ``remove_spans`` lists attributes whose spans are deleted. Only spans with a score > 0
    are edited.

    Raises:
        ConfigValueError: a rule that does not parse, a negative or infinite weight, a size
            limit below 1, or an integer that does not fit in 64 bits.
    """

    attributes: list[str] | None = None
    include: list[Any] = dataclasses.field(default_factory=list)
    exclude: list[Any] = dataclasses.field(default_factory=list)
    weights: dict[str, float] = dataclasses.field(default_factory=dict)
    seed: int = 0
    replace: dict[str, str] = dataclasses.field(default_factory=dict)
    remove_spans: list[str] = dataclasses.field(default_factory=list)
    max_documents: int | None = None
    max_bytes: int | None = None
    max_documents_per_shard: int | None = None
    max_bytes_per_shard: int | None = None
    write_dropped: bool = True

    @classmethod
    def upgrade_keys(cls, data: dict[str, Any], prefix: str) -> dict[str, Any]:
        """One rule given as a mapping is a list of one rule."""
        for key in ("include", "exclude"):
            if isinstance(data.get(key), dict):
                data[key] = [data[key]]
        return data

    def __post_init__(self) -> None:
        check_int64(self)
        for key in ("include", "exclude"):
            rules = []
            for i, r in enumerate(getattr(self, key)):
                try:
                    rules.append(parse_rule(r, f"{key}[{i}]"))
                except OlmoflowError as e:  # parse_rule's message begins with its "where"
                    where, _, problem = str(e).partition(": ")
                    raise ConfigValueError(where, problem) from None
            setattr(self, key, rules)
        for src, w in self.weights.items():
            if isinstance(w, bool) or not isinstance(w, int | float) or not 0 <= w < math.inf:
                raise ConfigValueError(f"weights.{src}", f"must be a number >= 0, got {w!r}")
        self.weights = {src: float(w) for src, w in self.weights.items()}
        for attr, text in self.replace.items():
            if not isinstance(text, str):
                raise ConfigValueError(f"replace.{attr}", f"must be a string, got {text!r}")
        for key in ("max_documents", "max_bytes", "max_documents_per_shard", "max_bytes_per_shard"):
            v = getattr(self, key)
            if v is not None and v < 1:
                raise ConfigValueError(key, f"must be a positive integer, got {v!r}")

    def to_dict(self) -> dict[str, Any]:
        """Plain values (rules as mappings), for manifests and fingerprints."""
        return dataclasses.asdict(self)


def merge_settings(base: dict[str, Any] | None, *extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` mixer settings with the ``attributes``, ``include``, ``exclude`` and
    ``remove_spans`` of ``extra`` appended (duplicates dropped, order kept); e.g.
    ``merge_settings(cfg, dedup.mixer_rules(d), decontam.mixer_rules(c))``."""
    out = dict(base or {})
    for more in extra:
        for key in ("attributes", "include", "exclude", "remove_spans"):
            have = out.get(key) or []
            have = [have] if isinstance(have, str | dict) else list(have)
            for item in more.get(key) or []:
                if item not in have:
                    have.append(item)
            if have:
                out[key] = have
    return out


# ---------------------------------------------------------------------------------------------
# Per-document operations


def sample_unit(seed: int, doc_id: str) -> float:
    """The deterministic uniform number in [0, 1) that sampling uses for a document."""
    digest = hashlib.blake2b(f"{seed}:{doc_id}".encode("utf-8", "surrogatepass"),
                             digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def copies_for(weight: float, seed: int, doc_id: str) -> int:
    """How many copies of a document a source weight asks for: ``floor(w) + (u < frac(w))``."""
    whole = math.floor(weight)
    frac = weight - whole
    return whole + (1 if frac > 0 and sample_unit(seed, doc_id) < frac else 0)


def apply_span_edits(text: str, edits: list[tuple[int, int, str, int]]) -> tuple[str, int]:
    """Replace spans of ``text``; return the new text and the number of regions edited.

    ``edits`` are ``(start, end, replacement, priority)`` with character offsets. Overlapping spans
    merge into one region, replaced by the replacement of its lowest-``priority`` span (ties: the
    earliest), so a removed paragraph that contains an e-mail address is removed, not masked.
    Spans are clipped to the text; empty ones are ignored.
    """
    n = len(text)
    spans = sorted((max(0, s), min(n, e), r, p) for s, e, r, p in edits if min(n, e) > max(0, s))
    if not spans:
        return text, 0
    out: list[str] = []
    pos = 0
    i = 0
    regions = 0
    while i < len(spans):
        start, end, repl, prio = spans[i]
        best = (prio, start, repl)
        i += 1
        while i < len(spans) and spans[i][0] < end:
            s, e, r, p = spans[i]
            end = max(end, e)
            best = min(best, (p, s, r))
            i += 1
        out.append(text[pos:start])
        out.append(best[2])
        pos = end
        regions += 1
    out.append(text[pos:])
    return "".join(out), regions


class _Parts:
    """Output parts ``<stem>-NNNN.jsonl.gz`` of one shard, each within the per-shard limits.

    Each part is renamed into place as soon as it is full, so an interrupted shard leaves only
    complete parts (the executor redoes the whole shard, and the driver removes stale parts).
    """

    def __init__(self, out_dir: Path, stem: str, max_docs: int | None, max_bytes: int | None):
        self.out_dir, self.stem = out_dir, stem
        self.max_docs, self.max_bytes = max_docs, max_bytes
        self.paths: list[str] = []
        self._cm = self._gz = None
        self._block: list[bytes] = []
        self._n = self._b = self._block_bytes = 0

    def write(self, doc: dict[str, Any], nbytes: int) -> None:
        full = self._gz is not None and (
            (self.max_docs is not None and self._n >= self.max_docs)
            or (self.max_bytes is not None and self._n > 0 and self._b + nbytes > self.max_bytes)
        )
        if self._gz is None or full:
            self._finish()
            path = self.out_dir / f"{self.stem}-{len(self.paths):04d}.jsonl.gz"
            self._cm = atomic_open(path, "wb")
            raw = self._cm.__enter__()
            self._gz = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6)
            self.paths.append(str(path))
            self._n = self._b = 0
        line = encode_document(doc)
        self._block.append(line)
        self._block_bytes += len(line)
        self._n += 1
        self._b += nbytes
        if self._block_bytes >= 1 << 20:
            self._flush()

    def _flush(self) -> None:
        self._gz.write(b"".join(self._block))
        self._block, self._block_bytes = [], 0

    def _finish(self) -> None:
        if self._gz is not None:
            self._flush()
            self._gz.close()
            self._cm.__exit__(None, None, None)
            self._cm = self._gz = None

    def close(self) -> None:
        self._finish()

    def abort(self, exc: BaseException) -> None:
        if self._cm is not None:
            self._cm.__exit__(type(exc), exc, exc.__traceback__)
            self._cm = self._gz = None


def _add(table: dict[str, dict[str, int]], label: str, nbytes: int, key: str = "documents") -> None:
    rec = table.setdefault(label, {key: 0, "bytes": 0})
    rec[key] += 1
    rec["bytes"] += nbytes


def _aligned(task: dict[str, Any], errors: list[str]
             ) -> Iterator[tuple[dict[str, Any] | None, dict[str, list]]]:
    """Documents of a shard with their merged attributes, checking the files are line-aligned."""
    doc_path = task["documents"]
    readers = {p: read_records(p, strict=True) for p in task["attributes"].values()}
    for lineno, doc in read_records(doc_path, strict=task.get("strict", False), errors=errors):
        merged: dict[str, list] = {}
        for apath, it in readers.items():
            row = next(it, None)
            if row is None:
                raise OlmoflowError(f"attributes '{apath}' end before documents line {lineno} of "
                                    f"'{doc_path}'; rerun the step that wrote them")
            alineno, arow = row
            if doc is not None and arow is not None and arow.get("id") != doc.get("id"):
                raise OlmoflowError(
                    f"{apath}:{alineno}: id {arow.get('id')!r} is not the id {doc.get('id')!r} "
                    f"of documents line {lineno}; rerun the step that wrote these attributes")
            if arow is not None:
                merged.update(arow.get("attributes") or {})
        if doc is not None and not (isinstance(doc.get("text"), str)
                                    and isinstance(doc.get("id"), str)):
            msg = f"{doc_path}:{lineno}: document without a string 'id' and 'text'"
            if task.get("strict"):
                raise OlmoflowError(msg)
            if len(errors) < MAX_ERRORS_LISTED:
                errors.append(msg)
            doc = None
        yield doc, merged
    for apath, it in readers.items():
        if next(it, None) is not None:
            raise OlmoflowError(f"attributes '{apath}' have more lines than documents "
                                f"'{doc_path}'; rerun the step that wrote them")


def mix_shard(task: dict[str, Any]) -> dict[str, Any]:
    """Shard job: mix one documents shard (see the module docstring).

    ``task``: ``documents`` (path), ``attributes`` ({set: path}), ``output_dir``, ``stem``,
    ``source``, ``config`` (a :class:`MixConfig`), ``dropped`` (path or None), ``quota``
    (``{"documents", "bytes"}`` left for this shard under the total limits, or None), ``dry_run``
    (count only, write nothing), ``strict``.

    Returns:
        Contract stats plus ``documents_kept`` (input documents with at least one copy written),
        ``copies_added``, ``edited`` (``{"remove: <attr>" | "replace: <attr>": {"documents",
        "spans"}}``), ``source`` and ``outputs``.

    Raises:
        OlmoflowError: attribute files not line-aligned with the documents; bad lines with strict.
    """
    cfg: MixConfig = task["config"]
    dry = bool(task.get("dry_run"))
    quota = task.get("quota") or {}
    q_docs, q_bytes = quota.get("documents"), quota.get("bytes")
    weight = cfg.weights.get(task["source"], 1.0)
    edits_of = [(a, "", 0) for a in cfg.remove_spans]
    edits_of += [(a, r, i + 1) for i, (a, r) in enumerate(cfg.replace.items())]
    stats: dict[str, Any] = {"source": task["source"], "documents_in": 0, "documents_kept": 0,
                             "documents_out": 0, "bytes_in": 0, "bytes_out": 0, "copies_added": 0}
    removed: dict[str, dict[str, int]] = {}
    edited: dict[str, dict[str, int]] = {}
    errors: list[str] = []
    parts = None if dry else _Parts(Path(task["output_dir"]), task["stem"],
                                    cfg.max_documents_per_shard, cfg.max_bytes_per_shard)
    dropped_rows: list[dict[str, Any]] = []
    limit_hit: str | None = None
    try:
        for doc, attrs in _aligned(task, errors):
            if doc is None:
                dropped_rows.append({"id": None, "attributes": {}, "dropped_by": "bad line"})
                continue
            text = doc["text"]
            n_chars, nbytes = len(text), text_bytes(text)
            stats["documents_in"] += 1
            stats["bytes_in"] += nbytes
            why = None
            for rule in cfg.include:
                if not rule.holds(attrs, len(text)):
                    why = f"include: {rule.label}"
                    break
            if why is None:
                for rule in cfg.exclude:
                    if rule.holds(attrs, len(text)):
                        why = f"exclude: {rule.label}"
                        break
            copies = 0
            if why is None:
                copies = copies_for(weight, cfg.seed, doc["id"]) if weight != 1.0 else 1
                if copies == 0:
                    why = f"sampling: weight {weight:g}"
            if why is None and edits_of:
                edits = []
                for attr, repl, prio in edits_of:
                    spans = [sp for sp in attrs.get(attr) or []
                             if float(sp[2]) > 0 and int(sp[1]) > int(sp[0])]
                    if spans:
                        rec = edited.setdefault(f"{'remove' if prio == 0 else 'replace'}: {attr}",
                                                {"documents": 0, "spans": 0})
                        rec["documents"] += 1
                        rec["spans"] += len(spans)
                        edits += [(int(sp[0]), int(sp[1]), repl, prio) for sp in spans]
                if edits:
                    text, _ = apply_span_edits(text, edits)
                    doc = {**doc, "text": text}
                if not text.strip():
                    why = "empty after span edits"
            out_bytes = text_bytes(text)
            written = 0
            if why is None:
                for k in range(copies):
                    if limit_hit is None:
                        if q_docs is not None and stats["documents_out"] + 1 > q_docs:
                            limit_hit = "limit: max_documents"
                        elif q_bytes is not None and stats["bytes_out"] + out_bytes > q_bytes:
                            limit_hit = "limit: max_bytes"
                    if limit_hit is not None:
                        break
                    if parts is not None:
                        parts.write(doc if k == 0 else {**doc, "id": f"{doc['id']}#{k}"},
                                    out_bytes)
                    written += 1
                    stats["documents_out"] += 1
                    stats["bytes_out"] += out_bytes
                if written == 0:
                    why = limit_hit
            if why is not None:
                _add(removed, why, nbytes)
            else:
                stats["documents_kept"] += 1
                stats["copies_added"] += written - 1
            row: dict[str, Any] = {"id": doc["id"], "attributes": {
                "mixer__copies": [[0, n_chars, written]]}}
            if why is not None:
                row["dropped_by"] = why
            dropped_rows.append(row)
    except BaseException as e:
        if parts is not None:
            parts.abort(e)
        raise
    outputs: list[str] = []
    if parts is not None:
        parts.close()
        outputs += parts.paths
        if task.get("dropped"):
            write_jsonl_gz(task["dropped"], dropped_rows)
            outputs.append(str(task["dropped"]))
    stats.update(removed=dict(sorted(removed.items())), edited=dict(sorted(edited.items())),
                 errors=errors, outputs=outputs)
    return stats


# ---------------------------------------------------------------------------------------------
# Driver


def attribute_names(data_dir: str | os.PathLike, attribute_set: str, shards: list[str],
                    full: bool = False) -> set[str]:
    """The attribute names a set holds: the keys of the first non-empty line of each shard's file,
    or (``full``) of every line, for taggers that write an attribute only where it has spans.

    Raises:
        OlmoflowError: the set or one of its shard files is missing.
    """
    root = Path(data_dir) / ATTRIBUTES_DIR
    if not (root / attribute_set).is_dir():
        have = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        hint = closest(attribute_set, have)
        raise OlmoflowError(
            f"no attribute set '{attribute_set}' under '{root}'"
            + (f"; did you mean '{hint}'?" if hint else f" (have: {', '.join(have) or 'none'})")
            + " Run the step that writes it (tag, dedup, decontaminate) first")
    names: set[str] = set()
    for shard in shards:
        path = attribute_path(data_dir, attribute_set, shard)
        if not path.is_file():
            raise OlmoflowError(f"missing attributes '{path}' for documents shard '{shard}'; "
                                f"rerun the step that writes attribute set '{attribute_set}'")
        for _, row in read_records(path, strict=True):
            if row and row.get("attributes"):
                names.update(row["attributes"])
                if not full:
                    break
    return names


def _check_names(cfg: MixConfig, data_dir: Path, shards: list[str]) -> None:
    used = [(f"mixer.include[{i}]", r.attribute) for i, r in enumerate(cfg.include)]
    used += [(f"mixer.exclude[{i}]", r.attribute) for i, r in enumerate(cfg.exclude)]
    used += [("mixer.replace", a) for a in cfg.replace]
    used += [("mixer.remove_spans", a) for a in cfg.remove_spans]
    names: set[str] = set()
    for aset in cfg.attributes:
        names |= attribute_names(data_dir, aset, shards)
    if any(attr not in names for _, attr in used):  # rare attributes: look at every line
        for aset in cfg.attributes:
            names |= attribute_names(data_dir, aset, shards, full=True)
    for where, attr in used:
        if attr not in names:
            hint = closest(attr, names)
            raise OlmoflowError(
                f"{where}: unknown attribute '{attr}'"
                + (f"; did you mean '{hint}'?" if hint else "")
                + f" (attribute sets read: {', '.join(cfg.attributes) or 'none'})")


def _quotas(cfg: MixConfig, counts: list[dict[str, Any]]) -> list[dict[str, int | None] | None]:
    """Split the total limits over shards in corpus order: a prefix of the output is kept."""
    left_docs, left_bytes = cfg.max_documents, cfg.max_bytes
    quotas: list[dict[str, int | None] | None] = []
    exhausted = False
    for c in counts:
        if exhausted:  # the boundary shard's prefix may stop short of its quota: nothing after it
            quotas.append({"documents": None if left_docs is None else 0,
                           "bytes": None if left_bytes is None else 0})
        elif ((left_docs is None or c["documents_out"] <= left_docs)
              and (left_bytes is None or c["bytes_out"] <= left_bytes)):
            quotas.append(None)
            left_docs = None if left_docs is None else left_docs - c["documents_out"]
            left_bytes = None if left_bytes is None else left_bytes - c["bytes_out"]
        else:
            quotas.append({"documents": left_docs, "bytes": left_bytes})
            exhausted = True
    return quotas


def mix(
    data_dir: str | os.PathLike,
    cfg: MixConfig | dict[str, Any] | None = None,
    *,
    executor: str = "local",
    workers: int | None = None,
    strict: bool = False,
    progress: bool = False,
    run_jobs: RunJobs | None = None,
) -> dict[str, Any]:
    """Mix ``DIR/documents`` with its attribute sets into ``DIR/mixed`` (see the module docstring).

    Shard jobs run through ``run_jobs(step, fn, tasks, phase=...)`` (the data engine's), else
    :func:`olmoflow.data.shards.local_runner` with ``executor`` and ``workers``.

    Returns:
        Summed stats (:func:`olmoflow.data.executor.sum_stats` keys plus ``documents_kept``,
        ``copies_added``, ``edited``), ``per_source`` (the same per source), and ``outputs``.

    Raises:
        OlmoflowError: bad config, an unknown attribute in a rule (closest name suggested), an
            unknown source in ``weights``, missing or misaligned attribute files.
    """
    cfg = as_section(MixConfig, cfg, "mixer.")
    if cfg.attributes is None:
        cfg = dataclasses.replace(cfg, attributes=[])
    data_dir = Path(data_dir)
    shards = document_shards(data_dir)
    sources = sorted({shard_source(s) for s in shards})
    for src in cfg.weights:
        if src not in sources:
            err = unknown_name_error("source", src, sources)
            raise OlmoflowError(f"mixer.weights: {err.args[0]}")
    _check_names(cfg, data_dir, shards)
    out_dir = data_dir / MIXED_DIR
    tasks = [{
        "step": "mix",
        "documents": str(data_dir / DOCUMENTS_DIR / shard),
        "input_sig": input_signature(data_dir / DOCUMENTS_DIR / shard),
        "attributes": {a: str(attribute_path(data_dir, a, shard)) for a in cfg.attributes},
        "attribute_sigs": [input_signature(attribute_path(data_dir, a, shard))
                           for a in cfg.attributes],
        "output_dir": str(out_dir),
        "stem": shard_stem(shard),
        "source": shard_source(shard),
        "config": cfg,
        "dropped": str(attribute_path(data_dir, "mixer", shard)) if cfg.write_dropped else None,
        "quota": None,
        "strict": strict,
    } for shard in shards]
    run_jobs = run_jobs or local_runner(data_dir, executor, workers, progress)
    if cfg.max_documents is not None or cfg.max_bytes is not None:
        counts = run_jobs("mix", mix_shard, [{**t, "dry_run": True} for t in tasks],
                          phase="count")
        for t, q in zip(tasks, _quotas(cfg, counts)):
            t["quota"] = q
    results = run_jobs("mix", mix_shard, tasks)
    outputs = [o for r in results for o in r.get("outputs", [])]
    keep = set(outputs)
    for shard in shards:  # parts left by an earlier run that wrote more of them
        stem = Path(shard_stem(shard))
        for p in (out_dir / stem.parent).glob(f"{stem.name}-[0-9][0-9][0-9][0-9].jsonl.gz"):
            if str(p) not in keep:
                p.unlink()
    summary = _summarize(results)
    per_source: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        per_source.setdefault(r["source"], []).append(r)
    summary["per_source"] = {s: _summarize(rs) for s, rs in sorted(per_source.items())}
    summary["outputs"] = outputs
    return summary


def _summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    out = sum_stats(results)
    out.setdefault("removed", {})
    for key in ("documents_kept", "copies_added"):
        out[key] = sum(r.get(key, 0) for r in results)
    edited: dict[str, dict[str, int]] = {}
    for r in results:
        for label, rec in (r.get("edited") or {}).items():
            acc = edited.setdefault(label, {"documents": 0, "spans": 0})
            acc["documents"] += rec["documents"]
            acc["spans"] += rec["spans"]
    out["edited"] = dict(sorted(edited.items()))
    return out
