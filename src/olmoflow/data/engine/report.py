"""``olmoflow data report DIR``: what each step kept and removed, per rule and per source.

Reads the manifests the engine's steps wrote (:mod:`olmoflow.data.engine`), prints tables and
checks the accounting of every step that drops documents: documents in = documents kept + the sum
of documents removed per rule (per source too). A step that fails the check is flagged, so a
dropped document can never go unexplained silently. Histograms (document length, quality score,
language score; kept vs removed) are drawn as PNGs with matplotlib.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from olmoflow.artifacts import atomic_path, atomic_write_json, atomic_write_text, read_manifest
from olmoflow.data.engine.steps import STEP_DIRS, STEP_NAMES
from olmoflow.errors import OlmoflowError

REPORT_DIR = "reports"
#: Steps that write documents or tokens (shown per source; the others only write attributes).
DOCUMENT_STEPS = ("ingest", "mix", "tokenize")
#: Attribute-name prefixes of the scores drawn: D2's fastText quality tagger and language id.
QUALITY_PREFIX = "quality__"
LANGUAGE_PREFIX = "langid__"


def step_manifests(root: str | Path) -> dict[str, dict[str, Any]]:
    """``{step: manifest}`` for every step that has finished in the data run ``root``.

    Raises:
        OlmoflowError: ``root`` holds no finished step.
    """
    root = Path(root)
    out = {}
    for step in STEP_NAMES:
        m = read_manifest(root / STEP_DIRS[step])
        if m is not None:
            out[step] = m
    if not out:
        raise OlmoflowError(f"no finished data step in {root}; run 'olmoflow data run CONFIG'")
    return out


def accounting(counts: dict[str, Any]) -> int | None:
    """Documents in minus kept minus removed-per-rule (0 = every drop explained), or None when
    the counts say nothing about drops (no ``documents_in``/``documents_out``).

    Kept is ``documents_kept`` when a step writes copies (the mixer's weights > 1 repeat
    documents, so ``documents_out`` may exceed the documents kept), else ``documents_out``."""
    if "documents_in" not in counts or "documents_out" not in counts:
        return None
    kept = counts.get("documents_kept", counts["documents_out"])
    removed = sum(r.get("documents", 0) for r in (counts.get("removed") or {}).values())
    return counts["documents_in"] - kept - removed


def check_accounting(manifests: dict[str, dict[str, Any]]) -> list[str]:
    """Problems found: one line per step or (step, source) whose drops do not add up."""
    bad = []
    for step, m in manifests.items():
        c = m["counts"]
        gap = accounting(c)
        if gap:
            bad.append(f"{step}: {gap:+,} documents unexplained (in - kept - removed)")
        for src, sc in (c.get("sources") or {}).items():
            gap = accounting(sc)
            if gap:
                bad.append(f"{step} [{src}]: {gap:+,} documents unexplained")
    return bad


def _table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [[_fmt(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(header)]
    line = lambda r: "  ".join(v.ljust(w) if i == 0 else v.rjust(w)  # noqa: E731
                               for i, (v, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, cells)])


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1%}" if v <= 1 else f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def format_report(manifests: dict[str, dict[str, Any]]) -> str:
    """The report as text: steps, removed per rule, per source, and the accounting verdict."""
    out = []
    rows = []
    for step, m in manifests.items():
        c = m["counts"]
        removed = sum(r.get("documents", 0) for r in (c.get("removed") or {}).values())
        gap = accounting(c)
        rows.append([step, c.get("shards"), c.get("documents_in"), c.get("documents_out"),
                     removed if c.get("removed") else None, c.get("bytes_in"), c.get("bytes_out"),
                     c.get("tokens"), c.get("errors"),
                     "-" if gap is None else ("ok" if gap == 0 else f"{gap:+,}")])
    out.append("Steps")
    out.append(_table(["step", "shards", "docs in", "docs out", "removed", "bytes in",
                       "bytes out", "tokens", "bad input", "in=out+removed"], rows))
    def share_rows(key: str) -> list[list]:
        """Per step, each entry of ``counts[key]`` (removed per rule, flagged per attribute):
        documents, bytes and the share of the step's input documents."""
        rows = []
        for step, m in manifests.items():
            c = m["counts"]
            n_in = c.get("documents_in") or 0
            for name, r in (c.get(key) or {}).items():
                rows.append([step, name, r.get("documents", 0), r.get("bytes", 0),
                             r.get("documents", 0) / n_in if n_in else None])
        return rows

    rule_rows = share_rows("removed")
    if rule_rows:
        out += ["", "Removed per rule",
                _table(["step", "rule", "documents", "bytes", "% of in"], rule_rows)]
    flag_rows = share_rows("flagged")
    if flag_rows:
        out += ["", "Flagged per attribute (the mixer's rules decide what is removed)",
                _table(["step", "attribute", "documents", "bytes", "% of in"], flag_rows)]
    edit_rows = [[step, label, r.get("documents", 0), r.get("spans", 0)]
                 for step, m in manifests.items()
                 for label, r in (m["counts"].get("edited") or {}).items()]
    if edit_rows:
        out += ["", "Spans edited in kept documents",
                _table(["step", "edit", "documents", "spans"], edit_rows)]
    src_rows = []
    for step, m in manifests.items():
        if step not in DOCUMENT_STEPS:
            continue
        for src, sc in (m["counts"].get("sources") or {}).items():
            removed = ", ".join(f"{k} {v.get('documents', 0):,}"
                                for k, v in (sc.get("removed") or {}).items())
            src_rows.append([step, src, sc.get("documents_in"), sc.get("documents_out"),
                             sc.get("bytes_in"), sc.get("bytes_out"), sc.get("tokens"),
                             removed or "-"])
    if src_rows:
        out += ["", "Per source",
                _table(["step", "source", "docs in", "docs out", "bytes in", "bytes out",
                        "tokens", "removed by rule"], src_rows)]
    # Damaged and empty files remove no counted document (what a damaged file held past the
    # damage is unknown), so they appear only here, with the file and line of each example.
    bad_input = [(step, m["counts"].get("errors"), m.get("errors") or [])
                 for step, m in manifests.items() if m["counts"].get("errors")]
    if bad_input:
        out += ["", "Bad input (skipped and counted; the first examples, file:line)"]
        for step, n, examples in bad_input:
            out.append(f"{step}: {n:,} in all")
            out += [f"  {e}" for e in examples]
    unverifiable = [(step, u) for step, m in manifests.items()
                    for u in m["counts"].get("unverifiable") or []]
    if unverifiable:
        out += ["", "Unverifiable input (kept: no checksum to check it against damage)"]
        out += [f"{step}: {u}" for step, u in unverifiable]
    bad = check_accounting(manifests)
    out += ["", "Accounting: every dropped document is explained by a rule" if not bad
            else "Accounting: NOT explained:\n  " + "\n  ".join(bad)]
    return "\n".join(out)


# ---- histograms ----------------------------------------------------------------------------------


def _read_jsonl_gz(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a shard the manifests list; a missing or damaged one is a one-line error
    (the run directory changed since the steps ran), not a traceback."""
    try:
        with gzip.open(path, "rb") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)
    except (OSError, EOFError, ValueError) as e:
        raise OlmoflowError(f"cannot read '{path}' ({type(e).__name__}), which a step's manifest "
                            "lists; rerun 'olmoflow data run' on this directory") from None


def _shards(root: Path, step: str) -> list[Path]:
    m = read_manifest(root / STEP_DIRS[step]) or {}
    return [root / STEP_DIRS[step] / s["path"] for s in m.get("shards", [])]


def document_scores(root: str | Path) -> dict[str, dict[str, list[float]]]:
    """Per metric (``length``, ``quality``, ``language``) the values of kept and of removed
    documents: ``{"length": {"kept": [...], "removed": [...]}, ...}``.

    ``length`` is characters of text; ``quality`` the first ``quality__*`` document score;
    ``language`` the highest ``langid__*`` document score. Kept means the document's id is in
    the mixer's output (all documents count as kept before the mix step has run).
    """
    root = Path(root)
    kept_ids = None
    mixed = read_manifest(root / STEP_DIRS["mix"]) is not None
    if mixed:
        kept_ids = {d["id"] for p in _shards(root, "mix") for d in _read_jsonl_gz(p)}
    tag_shards = {p.relative_to(root / STEP_DIRS["tag"]).as_posix(): p
                  for p in _shards(root, "tag")}
    out = {k: {"kept": [], "removed": []} for k in ("length", "quality", "language")}
    for doc_path in _shards(root, "ingest"):
        rel = doc_path.relative_to(root / STEP_DIRS["ingest"]).as_posix()
        attrs = _read_jsonl_gz(tag_shards[rel]) if rel in tag_shards else None
        # The mixer's line-aligned record says whether this very line was kept; ids alone would
        # call both copies of a duplicated id kept when the mixer dropped one of them.
        decision = root / "attributes" / "mixer" / rel
        decisions = _read_jsonl_gz(decision) if mixed and decision.is_file() else None
        for doc in _read_jsonl_gz(doc_path):
            a = next(attrs)["attributes"] if attrs is not None else {}
            if decisions is not None:
                kept = "dropped_by" not in next(decisions)
            else:
                kept = kept_ids is None or doc["id"] in kept_ids
            side = "kept" if kept else "removed"
            out["length"][side].append(float(len(doc["text"])))
            q = sorted(k for k in a if k.startswith(QUALITY_PREFIX))
            if q and a[q[0]]:
                out["quality"][side].append(float(a[q[0]][0][2]))
            lang = [s[2] for k, v in a.items() if k.startswith(LANGUAGE_PREFIX)
                    and not k.startswith(LANGUAGE_PREFIX + "paragraph_") for s in v[:1]]
            if lang:
                out["language"][side].append(float(max(lang)))
    return out


def draw_histograms(scores: dict[str, dict[str, list[float]]], out_dir: str | Path) -> list[Path]:
    """One PNG per metric with values (kept and removed stacked); returns the files written.
    Metrics without values are skipped. Lengths are binned on a log10 scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"length": "document length (log10 characters)", "quality": "quality score "
              "(P(high quality))", "language": "language score (top language probability)"}
    written = []
    for metric, sides in scores.items():
        if not sides["kept"] and not sides["removed"]:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        data = sides
        if metric == "length":
            data = {k: [math.log10(max(v, 1.0)) for v in vs] for k, vs in sides.items()}
        ax.hist([data["kept"], data["removed"]], bins=40, stacked=True,
                label=[f"kept ({len(data['kept']):,})", f"removed ({len(data['removed']):,})"],
                color=["tab:blue", "tab:red"])
        ax.set_xlabel(titles[metric])
        ax.set_ylabel("documents")
        ax.legend()
        fig.tight_layout()
        path = Path(out_dir) / f"hist_{metric}.png"
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def report(root: str | Path, *, histograms: bool = True) -> tuple[str, list[Path]]:
    """Build the report of the data run ``root``: write ``reports/report.txt``,
    ``reports/report.json`` and the histograms; return the text and the files written.

    Raises:
        OlmoflowError: no finished step in ``root``.
    """
    root = Path(root)
    manifests = step_manifests(root)
    text = format_report(manifests)
    out_dir = root / REPORT_DIR
    files = [out_dir / "report.txt", out_dir / "report.json"]
    atomic_write_text(files[0], text + "\n")
    atomic_write_json(files[1], {"steps": {s: m["counts"] for s, m in manifests.items()},
                                 "unexplained": check_accounting(manifests)})
    if histograms and "ingest" in manifests:
        files += draw_histograms(document_scores(root), out_dir)
    return text, files
