"""Data lineage: from a tokens directory back to every raw source file, through the manifests.

Every step directory of either flow carries a ``manifest.json`` listing its inputs and outputs with
sha256 (:func:`olmoflow.artifacts.write_manifest`). An input that lies in another step's directory
(one with a manifest that lists it as an output) was made by that step, so following inputs
backwards walks the whole chain:

- data engine: ``tokens`` <- ``mixed`` (+ ``tokenizer``) <- ``attributes/*`` and ``documents``
  <- raw source files (and ``quality`` <- its labeled files);
- main flow: ``tokens`` <- ``clean`` (+ ``tokenizer``) <- ``collect`` <- raw source files.

An input that no step made is a raw file. The release records the result as its
``data_manifest.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from olmoflow.artifacts import MANIFEST, read_manifest
from olmoflow.errors import OlmoflowError

#: Manifest fields copied into each step's record.
STEP_FIELDS = ("stage", "command", "fingerprint", "started", "finished")


def _input_path(step_dir: Path, rec: dict[str, Any]) -> Path:
    """Where an input record points: manifests name inputs relative to the step directory's parent
    when they lie inside it, else by their path as given."""
    p = Path(rec["path"])
    return p if p.is_absolute() else step_dir.parent / p


def _producer(path: Path, cache: dict[Path, dict[str, Any] | None]) -> tuple[Path, dict] | None:
    """The step directory that wrote ``path`` (the nearest directory above it whose manifest lists
    it among its outputs) and that manifest; None for a raw file."""
    path = path.resolve()
    for d in path.parents:
        if d not in cache:
            cache[d] = read_manifest(d) if (d / MANIFEST).is_file() else None
        m = cache[d]
        if m is None:
            continue
        rel = path.relative_to(d).as_posix()
        if any(o.get("path") == rel for o in m.get("outputs", [])):
            return d, m
    return None


def data_lineage(tokens_dir: str | Path) -> dict[str, Any]:
    """Follow manifests from ``tokens_dir`` back to the raw files.

    Returns:
        ``{"tokens": str, "steps": [...], "raw_files": [...], "warnings": [...]}``. ``steps`` has
        one record per step directory reached (``tokens_dir`` first, then in the order found):
        ``dir``, the manifest's ``stage``, ``command``, ``fingerprint``, ``started``,
        ``finished``, ``counts``, and ``inputs``: ``[{path, bytes, sha256, made_by}]`` (absolute
        paths; ``made_by`` the producing step's directory, or None for a raw file). ``raw_files``
        are the inputs no step made, each once: ``{path, bytes, sha256}``, sorted by path.
        ``warnings`` names inputs whose recorded sha256 differs from what their producer's
        manifest says it wrote (a step rerun since its consumer ran).

    Raises:
        OlmoflowError: ``tokens_dir`` has no manifest (not a finished tokens step).
    """
    root = Path(tokens_dir).resolve()
    first = read_manifest(root)
    if first is None:
        raise OlmoflowError(f"'{tokens_dir}' has no {MANIFEST}: not a finished tokens directory "
                            "(run tokenize first)")
    cache: dict[Path, dict[str, Any] | None] = {root: first}
    steps: list[dict[str, Any]] = []
    raw: dict[str, dict[str, Any]] = {}
    warnings: list[str] = []
    queue, seen = [root], {root}
    while queue:
        d = queue.pop(0)
        m = cache[d] if d in cache else read_manifest(d)
        record: dict[str, Any] = {"dir": str(d), **{k: m.get(k) for k in STEP_FIELDS},
                                  "counts": m.get("counts", {}), "inputs": []}
        for rec in m.get("inputs", []):
            path = _input_path(d, rec)
            made = _producer(path, cache) if path.exists() else None
            entry = {"path": str(path.resolve() if path.exists() else path),
                     "bytes": rec.get("bytes"), "sha256": rec.get("sha256"),
                     "made_by": str(made[0]) if made else None}
            record["inputs"].append(entry)
            if made is None:
                raw.setdefault(entry["path"], {k: entry[k] for k in ("path", "bytes", "sha256")})
                continue
            producer, pm = made
            rel = path.resolve().relative_to(producer).as_posix()
            out = next(o for o in pm.get("outputs", []) if o.get("path") == rel)
            if out.get("sha256") != rec.get("sha256"):
                warnings.append(f"{entry['path']}: {d.name} read sha256 {rec.get('sha256')} but "
                                f"{producer.name} now records {out.get('sha256')}")
            if producer not in seen:
                seen.add(producer)
                queue.append(producer)
        steps.append(record)
    return {"tokens": str(root), "steps": steps,
            "raw_files": [raw[k] for k in sorted(raw)], "warnings": warnings}
