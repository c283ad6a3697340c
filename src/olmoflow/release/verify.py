"""``olmoflow verify DIR``: is a release what it says it is?

A release bundle ends with ``files.json``, written after every other file: the size and sha256 of
each file of the bundle (itself excepted). :func:`verify_release` re-hashes every file and names
each one that changed, is missing, or was added; then it follows ``data_manifest.json`` back
through the data stages' recorded inputs and outputs to the raw source files, re-hashing every
recorded file that still exists on this machine (a run's intermediate files or its sources may
have been deleted or never copied: those are counted, not failed), and checks referenced
checkpoints (``release.include_checkpoints=false``) against their own ``checksums.json``.

Hidden files (the runner's ``.fingerprint``, an interrupted write's temporary) are bookkeeping and
are not checked. It detects corruption and edits, not a forger who rewrites ``files.json`` to
match: for that, compare its sha256 with one published elsewhere (``sha256sum files.json``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from olmoflow.artifacts import atomic_write_json, sha256_file
from olmoflow.errors import OlmoflowError

FILE_INDEX = "files.json"
# The pipeline's record of the release stage, written by the runner after the bundle (so after
# files.json): checked through the hashes of the outputs it lists instead.
STAGE_MANIFEST = "manifest.json"


def write_file_index(out: Path, files: list[Path]) -> Path:
    """Write ``out/files.json``: ``{"files": {path relative to out: {"bytes", "sha256"}}}`` for
    each of ``files`` (the files of the bundle, all under ``out``); returns its path. Anything
    else found in ``out`` later is an added file to :func:`verify_release`."""
    index = {}
    for p in sorted({Path(f).resolve() for f in files}):
        rel = p.relative_to(Path(out).resolve()).as_posix()
        if rel != FILE_INDEX:
            index[rel] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    atomic_write_json(out / FILE_INDEX, {"files": index})
    return out / FILE_INDEX


@dataclass
class VerifyReport:
    """What :func:`verify_release` found. ``problems`` are one-line descriptions (a changed,
    missing or added file; a changed source); the counts say how much was checked."""

    release: Path
    checked: int = 0
    sources_checked: int = 0
    sources_absent: int = 0
    checkpoints_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _recorded_files(manifest: dict[str, Any], root: Path | None) -> dict[Path, str]:
    """Every file the data manifest records with a sha256, by path: each data stage's inputs
    (paths relative to the run directory ``root``) and outputs (relative to the stage's own
    directory), and the lineage's steps and raw files (absolute). Relative paths are dropped when
    the run directory is unknown (a release copied out of its run)."""
    from olmoflow.run_dir import RunDir

    found: dict[Path, str] = {}

    def add(path: Any, sha: Any, base: Path | None) -> None:
        if not isinstance(path, str) or not isinstance(sha, str):
            return
        p = Path(path)
        if not p.is_absolute():
            if base is None:
                return
            p = base / p
        found.setdefault(p, sha)

    for stage, m in manifest.items():
        if stage == "lineage" or not isinstance(m, dict):
            continue
        stage_dir = RunDir(root).stage(stage) if root is not None else None
        for rec in m.get("inputs") or []:
            add(rec.get("path"), rec.get("sha256"), root)
        for rec in m.get("outputs") or []:
            add(rec.get("path"), rec.get("sha256"), stage_dir)
    for lineage in manifest.get("lineage") or []:
        for step in lineage.get("steps") or []:
            d = Path(step["dir"]) if isinstance(step.get("dir"), str) else None
            for rec in step.get("inputs") or []:
                add(rec.get("path"), rec.get("sha256"), d.parent if d else None)
            for rec in step.get("outputs") or []:
                add(rec.get("path"), rec.get("sha256"), d)
        for rec in lineage.get("raw_files") or []:
            add(rec.get("path"), rec.get("sha256"), None)
    return found


def verify_release(release: str | Path) -> VerifyReport:
    """Check the bundle at ``release`` (see the module docstring).

    Raises:
        OlmoflowError: ``release`` is not a directory or has no readable ``files.json``.
    """
    release = Path(release)
    if not release.is_dir():
        raise OlmoflowError(f"'{release}' is not a directory")
    index = release / FILE_INDEX
    if not index.is_file():
        raise OlmoflowError(f"'{release}' has no {FILE_INDEX}: not a release bundle, or one made "
                            "before releases listed their files (rerun 'olmoflow release')")
    try:
        recorded = json.loads(index.read_text(encoding="utf-8"))["files"]
        assert isinstance(recorded, dict)
    except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError):
        raise OlmoflowError(f"{index}: not a file index ({{\"files\": {{path: {{\"bytes\", "
                            "\"sha256\"}}}); the bundle's own list is damaged") from None
    report = VerifyReport(release)
    # Hidden files are bookkeeping (the runner's .fingerprint, an interrupted write's temporary),
    # never part of a bundle.
    present = {rel for rel in (p.relative_to(release).as_posix() for p in release.rglob("*")
                               if p.is_file())
               if not any(part.startswith(".") for part in rel.split("/"))}
    present.discard(FILE_INDEX)
    stage_manifest = STAGE_MANIFEST in present and STAGE_MANIFEST not in recorded
    present.discard(STAGE_MANIFEST if stage_manifest else "")
    for rel in sorted(set(recorded) - present):
        report.problems.append(f"missing: {rel}")
    for rel in sorted(present - set(recorded)):
        report.problems.append(f"added: {rel} (not in {FILE_INDEX})")
    changed, hashes = set(), {}
    for rel in sorted(set(recorded) & present):
        report.checked += 1
        rec = recorded[rel] if isinstance(recorded[rel], dict) else {}
        got = hashes[rel] = sha256_file(release / rel)
        if got != rec.get("sha256"):
            changed.add(rel)
            size = (release / rel).stat().st_size
            report.problems.append(f"changed: {rel} (sha256 {got[:12]}..., {size} bytes; "
                                   f"recorded {str(rec.get('sha256', '?'))[:12]}..., "
                                   f"{rec.get('bytes', '?')} bytes)")
    if stage_manifest:
        _verify_stage_manifest(release, report, changed, hashes)
    if "data_manifest.json" not in changed:  # a changed manifest's records are not to be trusted
        _verify_sources(release, report)
    if "checkpoints.csv" not in changed:
        _verify_checkpoints(release, report)
    return report


def _verify_stage_manifest(release: Path, report: VerifyReport, changed: set[str],
                           hashes: dict[str, str]) -> None:
    """The runner's ``manifest.json`` must record the hashes the files have (files already named
    as changed aside): otherwise it was edited."""
    try:
        outputs = json.loads((release / STAGE_MANIFEST).read_text(encoding="utf-8"))["outputs"]
        records = {o["path"]: o["sha256"] for o in outputs}
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        report.problems.append(f"unreadable: {STAGE_MANIFEST} (not the release stage's manifest)")
        return
    for rel, sha in sorted(records.items()):
        p = release / rel
        if rel not in changed and p.is_file() and (hashes.get(rel) or sha256_file(p)) != sha:
            report.problems.append(f"changed: {STAGE_MANIFEST} (its sha256 of {rel} is not the "
                                   "file's)")
            return


def _run_root(release: Path) -> Path | None:
    """The run directory of a release still inside it (``RUN/release`` beside ``RUN/config.yaml``),
    else None."""
    from olmoflow.run_dir import RunDir

    resolved = release.resolve()
    if resolved == RunDir(resolved.parent).stage("release") and \
            (resolved.parent / "config.yaml").is_file():
        return resolved.parent
    return None


def _verify_sources(release: Path, report: VerifyReport) -> None:
    manifest_path = release / "data_manifest.json"
    if not manifest_path.is_file():
        return  # named as missing already
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        report.problems.append("unreadable: data_manifest.json (not JSON)")
        return
    for p, sha in sorted(_recorded_files(manifest, _run_root(release)).items()):
        if not p.is_file():
            report.sources_absent += 1
            continue
        report.sources_checked += 1
        if sha256_file(p) != sha:
            report.problems.append(f"source changed since the data was made: {p}")


def _verify_checkpoints(release: Path, report: VerifyReport) -> None:
    """Referenced checkpoints (a path in the run, not a folder in the bundle) that still exist
    are checked against their ``checksums.json``."""
    import csv

    from olmoflow.train.checkpoint_verify import verify_checkpoint

    table = release / "checkpoints.csv"
    root = _run_root(release)
    if not table.is_file() or root is None:
        return
    for row in csv.DictReader(table.read_text(encoding="utf-8").splitlines()):
        path = row.get("path") or ""
        if not path or path.startswith("checkpoints/"):
            continue  # exported into the bundle: files.json covers it
        ckpt = root / path
        if ckpt.is_dir():
            report.checkpoints_checked += 1
            try:
                verify_checkpoint(ckpt)
            except OlmoflowError as e:
                report.problems.append(f"checkpoint {path}: {e}")


def describe(r: VerifyReport) -> str:
    """The verdict: each problem on its own line, then a summary line."""
    lines = list(r.problems)
    lines.append(
        f"{'FAILED' if r.problems else 'OK'}: {r.checked} release files re-hashed, "
        f"{r.sources_checked} recorded data files re-hashed ({r.sources_absent} not on this "
        f"machine), {r.checkpoints_checked} referenced checkpoints checked; "
        f"{len(r.problems)} problem(s)")
    return "\n".join(lines)
