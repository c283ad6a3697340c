"""``olmoflow verify DIR [--digest SHA]``: is a release what it says it is?

A release bundle ends with ``files.json`` (:mod:`olmoflow.release.index`), written after every
other file: the size and sha256 of each file of the bundle. :func:`verify_release` re-hashes every
file and names each one that changed, is missing, was added, or is a symbolic link (a release
holds its own files, so that it can be copied and published as it is). Every other record of a
file's hash in the bundle must agree with ``files.json`` and with the file: the release stage's
``manifest.json`` (written by the runner after ``files.json``, so it also records the hash of
``files.json``; a release without it is incomplete), ``checkpoints.csv``, and each exported
checkpoint's ``export_manifest.json``. The card states the release digest (the sha256 of
``files.json``), which must be the index's; ``--digest`` checks it against a digest published
elsewhere, the one check a forger who rewrites every record consistently cannot pass.

Then it follows ``data_manifest.json`` back through the data stages' recorded inputs and outputs
to the raw source files, re-hashing every recorded file that still exists on this machine (a
run's intermediate files or its sources may have been deleted or never copied: those are counted,
not failed), and checks referenced checkpoints (``release.include_checkpoints=false``) against
their own ``checksums.json`` and the sha256 ``checkpoints.csv`` records for it.

Hidden files and folders (the runner's ``.fingerprint``, an interrupted write's temporary, a git
repository's ``.git`` and ``.gitattributes``) are bookkeeping and are not checked.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from olmoflow.artifacts import sha256_file
from olmoflow.errors import OlmoflowError
from olmoflow.release.index import FILE_INDEX, indexed_sha256, parse_digest, stated_digest

# The pipeline's record of the release stage, written by the runner after the bundle (so after
# files.json): checked through the hashes of the outputs it lists instead.
STAGE_MANIFEST = "manifest.json"
#: each exported checkpoint's record of its files (written by release.export.write_model_dir).
EXPORT_MANIFEST = "export_manifest.json"
CHECKPOINTS_CSV = "checkpoints.csv"


@dataclass
class VerifyReport:
    """What :func:`verify_release` found. ``problems`` are one-line descriptions (a changed,
    missing, added or linked file; records that disagree; a changed source); the counts say how
    much was checked; ``digest`` is the sha256 of ``files.json``, ``digest_given`` the one
    checked against (None: none given)."""

    release: Path
    checked: int = 0
    sources_checked: int = 0
    sources_absent: int = 0
    checkpoints_checked: int = 0
    digest: str = ""
    digest_given: str | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _recorded_files(manifest: dict[str, Any], root: Path | None) -> dict[Path, str]:
    """Every file the data manifest records with a sha256, by path: each data stage's inputs
    (paths relative to the run directory ``root``) and outputs (relative to the stage's own
    directory), the lineage's steps and raw files (absolute), and the post-training stages' data
    files (relative to ``root``, or absolute). Relative paths are dropped when
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
        if stage in ("lineage", "posttrain") or not isinstance(m, dict):
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
    for entry in manifest.get("posttrain") or []:
        for rec in (entry.get("files") or []) if isinstance(entry, dict) else []:
            add(rec.get("path"), rec.get("sha256"), root)
    return found


def _read_index(index: Path) -> tuple[dict[str, Any], str | None]:
    """``(files, digest_stated_in)`` of ``files.json``.

    Raises:
        OlmoflowError: it is not a file index.
    """
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        recorded = data["files"]
        stated_in = data.get("digest_stated_in")
        assert isinstance(recorded, dict) and (stated_in is None or isinstance(stated_in, str))
    except (ValueError, KeyError, TypeError, AttributeError, AssertionError, UnicodeDecodeError):
        raise OlmoflowError(f"{index}: not a file index ({{\"files\": {{path: {{\"bytes\", "
                            "\"sha256\"}}}); the bundle's own list is damaged") from None
    return recorded, stated_in


def _walk(release: Path) -> tuple[set[str], dict[str, str], list[str]]:
    """``(files, links, others)`` under ``release``, hidden names left out (see the module
    docstring): the regular files, the symbolic links (never followed) with their targets, and
    anything else (a FIFO, a socket), as paths relative to ``release``."""
    files: set[str] = set()
    links: dict[str, str] = {}
    others: list[str] = []
    for root, dirs, names in os.walk(release):
        here = Path(root)
        rel_root = here.relative_to(release)
        for d in list(dirs):
            if d.startswith(".") or (here / d).is_symlink():
                dirs.remove(d)
                if not d.startswith("."):
                    links[(rel_root / d).as_posix()] = os.readlink(here / d)
        for n in names:
            if n.startswith("."):
                continue
            rel = (rel_root / n).as_posix()
            if (here / n).is_symlink():
                links[rel] = os.readlink(here / n)
            elif (here / n).is_file():
                files.add(rel)
            else:
                others.append(rel)
    return files, links, sorted(others)


def verify_release(release: str | Path, digest: str | None = None) -> VerifyReport:
    """Check the bundle at ``release`` (see the module docstring).

    Args:
        digest: the release digest published elsewhere (64 hex digits, ``sha256:`` allowed);
            the sha256 of ``files.json`` must be it.
    Raises:
        OlmoflowError: ``release`` is not a directory or has no readable ``files.json``; a
            ``digest`` that is not a sha256.
    """
    release = Path(release)
    given = parse_digest(digest) if digest is not None else None
    if not release.is_dir():
        raise OlmoflowError(f"'{release}' is not a directory")
    index = release / FILE_INDEX
    if not index.is_file():
        raise OlmoflowError(f"'{release}' has no {FILE_INDEX}: not a release bundle, or one made "
                            "before releases listed their files (rerun 'olmoflow release')")
    recorded, stated_in = _read_index(index)
    report = VerifyReport(release, digest=sha256_file(index), digest_given=given)
    present, links, others = _walk(release)
    present.discard(FILE_INDEX)
    for rel, target in sorted(links.items()):
        report.problems.append(f"symlink: {rel} -> {target} (a release holds its own files; "
                               "copy the file in its place)")
    report.problems += [f"not a regular file: {rel}" for rel in others]
    has_manifest = STAGE_MANIFEST in present and STAGE_MANIFEST not in recorded
    if STAGE_MANIFEST not in recorded:
        present.discard(STAGE_MANIFEST)
        if not has_manifest and STAGE_MANIFEST not in links:
            report.problems.append(f"missing: {STAGE_MANIFEST} (the release stage's record of "
                                   f"its files, written after {FILE_INDEX}; every release has "
                                   "one)")
    for rel in sorted(set(recorded) - present - set(links)):
        report.problems.append(f"missing: {rel}")
    for rel in sorted(present - set(recorded)):
        report.problems.append(f"added: {rel} (not in {FILE_INDEX})")
    changed, hashes = set(), {}
    for rel in sorted(set(recorded) & present):
        report.checked += 1
        rec = recorded[rel] if isinstance(recorded[rel], dict) else {}
        got = indexed_sha256(release / rel, rel == stated_in)
        hashes[rel] = got if rel != stated_in else sha256_file(release / rel)
        if got != rec.get("sha256"):
            changed.add(rel)
            size = (release / rel).stat().st_size
            report.problems.append(f"changed: {rel} (sha256 {got[:12]}..., {size} bytes; "
                                   f"recorded {str(rec.get('sha256', '?'))[:12]}..., "
                                   f"{rec.get('bytes', '?')} bytes)")
    _verify_digest(release, report, stated_in, present)
    if has_manifest:
        _verify_stage_manifest(release, report, recorded, changed, hashes)
    rows = _table_rows(release, report)
    if rows is not None:
        _verify_bundled_checkpoints(release, report, rows, recorded, present, changed)
        if CHECKPOINTS_CSV not in changed:
            _verify_checkpoints(release, report, rows)
    if "data_manifest.json" not in changed:  # a changed manifest's records are not to be trusted
        _verify_sources(release, report)
    return report


def _verify_digest(release: Path, report: VerifyReport, stated_in: str | None,
                   present: set[str]) -> None:
    """The digest the card states, and the one given, must be the sha256 of ``files.json``."""
    if stated_in is not None and stated_in in present:
        try:
            stated = stated_digest((release / stated_in).read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            stated = None
        if stated is None:
            report.problems.append(f"changed: {stated_in} (states no release digest, and "
                                   f"{FILE_INDEX} says it does)")
        elif stated != report.digest:
            report.problems.append(f"digest: {stated_in} states {stated[:12]}..., but the sha256 "
                                   f"of {FILE_INDEX} is {report.digest[:12]}... ({FILE_INDEX} "
                                   "was rewritten after the release was made)")
    if report.digest_given is not None and report.digest_given != report.digest:
        report.problems.append(f"digest: the sha256 of {FILE_INDEX} is {report.digest}, not the "
                               f"given {report.digest_given}: this is not the release that "
                               "digest names")


def _verify_stage_manifest(release: Path, report: VerifyReport, recorded: dict[str, Any],
                           changed: set[str], hashes: dict[str, str]) -> None:
    """The runner's ``manifest.json`` must record the same files as ``files.json`` (and
    ``files.json`` itself) with the hashes they have (files already named as changed aside)."""
    try:
        m = json.loads((release / STAGE_MANIFEST).read_text(encoding="utf-8"))
        records = {o["path"]: o["sha256"] for o in m["outputs"]}
        assert m.get("stage", "release") == "release"
    except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError):
        report.problems.append(f"unreadable: {STAGE_MANIFEST} (not the release stage's manifest)")
        return
    for rel, sha in sorted(records.items()):
        if rel == FILE_INDEX:
            if sha != report.digest:
                report.problems.append(f"changed: {FILE_INDEX} ({STAGE_MANIFEST} records sha256 "
                                       f"{str(sha)[:12]}..., the file's is "
                                       f"{report.digest[:12]}...)")
        elif rel not in recorded:
            report.problems.append(f"{STAGE_MANIFEST} records {rel}, which {FILE_INDEX} does "
                                   "not list")
        elif rel not in changed and rel in hashes and hashes[rel] != sha:
            report.problems.append(f"changed: {STAGE_MANIFEST} (its sha256 of {rel} is not the "
                                   "file's)")
    for rel in sorted(set(recorded) - set(records)):
        report.problems.append(f"{FILE_INDEX} lists {rel}, which {STAGE_MANIFEST} does not "
                               "record")


def _parse_pairs(text: str) -> dict[str, str] | None:
    """``checkpoints.csv``'s ``sha256`` cell (``file=hash`` pairs separated by spaces) as a
    dict, or None when it is not that."""
    pairs = {}
    for item in text.split():
        name, sep, sha = item.partition("=")
        if not sep or not name or not sha:
            return None
        pairs[name] = sha
    return pairs


def _table_rows(release: Path, report: VerifyReport) -> list[dict[str, str]] | None:
    """The rows of ``checkpoints.csv``; None (a problem named) when it cannot be read, or
    absent (named as missing already)."""
    table = release / CHECKPOINTS_CSV
    if not table.is_file() or table.is_symlink():
        return None
    try:
        rows = list(csv.DictReader(table.read_text(encoding="utf-8").splitlines()))
    except (UnicodeDecodeError, csv.Error):
        rows = None
    if rows is None or any(r.get("path") is None or r.get("sha256") is None for r in rows):
        report.problems.append(f"unreadable: {CHECKPOINTS_CSV} (no path and sha256 columns)")
        return None
    return rows


def _verify_bundled_checkpoints(release: Path, report: VerifyReport,
                                rows: list[dict[str, str]], recorded: dict[str, Any],
                                present: set[str], changed: set[str]) -> None:
    """Each exported checkpoint (``checkpoints/<name>/``) is listed in ``checkpoints.csv`` and has
    its ``export_manifest.json``; the sha256 of each of its files in both must be the one
    ``files.json`` records (which the file's own hash was checked against)."""
    listed = set()
    for row in rows:
        path = row["path"].rstrip("/")
        if not path.startswith("checkpoints/"):
            continue
        listed.add(path)
        inside = {rel[len(path) + 1:]: rec for rel, rec in recorded.items()
                  if rel.startswith(path + "/")}
        sha = {n: rec.get("sha256") if isinstance(rec, dict) else None
               for n, rec in inside.items()}
        if not (release / path).is_dir():
            report.problems.append(f"missing: {path}/ (listed in {CHECKPOINTS_CSV})")
            continue
        pairs = _parse_pairs(row["sha256"])
        if pairs is None:
            report.problems.append(f"unreadable: {CHECKPOINTS_CSV} (the sha256 of {path} is not "
                                   "file=hash pairs)")
        else:
            _agree(report, f"{CHECKPOINTS_CSV} ({path})", path, pairs, sha)
        export = f"{path}/{EXPORT_MANIFEST}"
        if export not in present:
            report.problems.append(f"missing: {export} (each exported checkpoint records the "
                                   "sha256 of its files there)")
            continue
        try:
            files = json.loads((release / export).read_text(encoding="utf-8"))["files"]
            assert isinstance(files, dict)
        except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError):
            if export not in changed:
                report.problems.append(f"unreadable: {export} (no files record)")
            continue
        _agree(report, export, path, files, {n: s for n, s in sha.items()
                                             if n != EXPORT_MANIFEST})
    folder = release / "checkpoints"
    if folder.is_dir() and not folder.is_symlink():
        for d in sorted(folder.iterdir()):
            rel = f"checkpoints/{d.name}"
            if d.is_dir() and not d.name.startswith(".") and rel not in listed:
                report.problems.append(f"{rel} is not in {CHECKPOINTS_CSV}")


def _agree(report: VerifyReport, who: str, path: str, theirs: dict[str, Any],
           index: dict[str, Any]) -> None:
    """The hashes ``who`` records for the files of ``path`` must be those ``files.json`` records
    (``index``), file for file."""
    for n in sorted(set(theirs) | set(index)):
        if n not in index:
            report.problems.append(f"{who} records {path}/{n}, which {FILE_INDEX} does not list")
        elif n not in theirs:
            report.problems.append(f"{who} does not record {path}/{n}, which {FILE_INDEX} lists")
        elif theirs[n] != index[n]:
            report.problems.append(f"{who} and {FILE_INDEX} disagree on the sha256 of {path}/{n} "
                                   f"({str(theirs[n])[:12]}... against {str(index[n])[:12]}...)")


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


def _verify_checkpoints(release: Path, report: VerifyReport,
                        rows: list[dict[str, str]]) -> None:
    """Referenced checkpoints (a path in the run, not a folder in the bundle) that still exist
    are checked against their ``checksums.json``, whose sha256 must be the one
    ``checkpoints.csv`` records."""
    from olmoflow.model.checkpoint_files import CHECKSUMS, verify_checkpoint

    root = _run_root(release)
    if root is None:
        return
    for row in rows:
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
                continue
            want = (_parse_pairs(row.get("sha256") or "") or {}).get(CHECKSUMS)
            if (ckpt / CHECKSUMS).is_file() and want != sha256_file(ckpt / CHECKSUMS):
                report.problems.append(f"checkpoint {path}: its {CHECKSUMS} is not the one "
                                       f"{CHECKPOINTS_CSV} records")


def describe(r: VerifyReport) -> str:
    """The verdict: each problem on its own line, then a summary line."""
    lines = list(r.problems)
    lines.append(
        f"{'FAILED' if r.problems else 'OK'}: {r.checked} release files re-hashed, "
        f"{r.sources_checked} recorded data files re-hashed ({r.sources_absent} not on this "
        f"machine), {r.checkpoints_checked} referenced checkpoints checked; "
        f"{len(r.problems)} problem(s); release digest {r.digest} (sha256 of {FILE_INDEX}"
        f"{', the one given' if r.digest_given == r.digest else ''})")
    return "\n".join(lines)
