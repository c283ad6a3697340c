"""``olmoflow push DIR REPO``: a release to the Hugging Face Hub, as OLMo publishes its models.

The plan (:func:`push_plan`, made without the network): one branch per exported checkpoint
(``checkpoints/<name>/``, oldest first), named as the checkpoint (``stage1-step300-tokens1M``) and
holding its Hugging Face directory at the root, so ``from_pretrained(REPO,
revision="stage1-step300-tokens1M")`` loads it, as for OLMo's intermediate checkpoints; then
``main`` with the whole release (every file of ``files.json``, ``files.json`` and
``manifest.json``), so a download of ``main`` passes ``olmoflow verify --digest``. Each checkpoint
branch starts from the repository's first commit (the Hub's ``.gitattributes``, which stores
weights in LFS); a checkpoint's weights are uploaded once and shared by its branch and ``main``
(the Hub stores files by content). A branch's files that the plan does not name are deleted, so
each branch is exactly the plan.

:func:`push_release` runs the plan through ``huggingface_hub`` (the ``hub`` extra) with the
user's token (``HF_TOKEN`` or ``hf auth login``); it is the one olmoflow command that needs the
network, and it refuses a release that fails ``olmoflow verify``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from olmoflow.errors import OlmoflowError


@dataclass
class Branch:
    """One branch of the plan: its name, its files as ``(local path, path in the repository)``,
    and the commit message."""

    name: str
    files: list[tuple[Path, str]] = field(default_factory=list)
    message: str = ""

    @property
    def bytes(self) -> int:
        return sum(p.stat().st_size for p, _ in self.files)


def _files_under(d: Path) -> list[tuple[Path, str]]:
    """The regular files under ``d`` (hidden ones left out), relative to it, sorted."""
    out = []
    for p in sorted(d.rglob("*")):
        rel = p.relative_to(d).as_posix()
        if p.is_file() and not p.is_symlink() and not any(s.startswith(".")
                                                          for s in rel.split("/")):
            out.append((p, rel))
    return out


def push_plan(release: str | Path) -> list[Branch]:
    """The branches :func:`push_release` writes (see the module docstring), checkpoints first,
    ``main`` last.

    Raises:
        OlmoflowError: ``release`` has no ``files.json`` (not a release bundle).
    """
    import json

    from olmoflow.release.git import exported_checkpoints
    from olmoflow.release.index import FILE_INDEX
    from olmoflow.release.verify import STAGE_MANIFEST

    release = Path(release)
    try:
        listed = json.loads((release / FILE_INDEX).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise OlmoflowError(f"'{release}' has no readable {FILE_INDEX}: not a release bundle "
                            "(olmoflow release writes one)") from None
    plan = [Branch(r["name"], _files_under(release / r["path"]),
                   f"{r['name']}: {r['stage']} checkpoint, step {r['step']}, {r['tokens']} tokens")
            for r in exported_checkpoints(release)]
    names = sorted({*listed, FILE_INDEX, STAGE_MANIFEST})
    plan.append(Branch("main", [(release / n, n) for n in names],
                       f"release, digest {_digest(release)}"))
    return plan


def _digest(release: Path) -> str:
    from olmoflow.artifacts import sha256_file
    from olmoflow.release.index import FILE_INDEX

    return sha256_file(release / FILE_INDEX)


def describe_plan(repo_id: str, plan: list[Branch]) -> str:
    """One line per branch: name, files, size (MB = 1e6 bytes)."""
    lines = [f"{repo_id}: {len(plan)} branch(es)"]
    lines += [f"  {b.name}: {len(b.files)} files, {b.bytes / 1e6:.2f} MB" for b in plan]
    return "\n".join(lines)


def push_release(release: str | Path, repo_id: str, *, private: bool = False) -> list[Branch]:
    """Upload the release at ``release`` to the Hub repository ``repo_id`` (``org/name``),
    creating it (private when asked) if it does not exist; returns the plan it ran.

    Raises:
        OlmoflowError: a repository id that is not ``org/name``; a release that fails
            ``olmoflow verify``; ``huggingface_hub`` not installed; any failure of the Hub
            (network, authentication, permissions), in one line.
    """
    from olmoflow.model.hub import is_hub_id
    from olmoflow.release.verify import verify_release

    if not is_hub_id(repo_id):
        raise OlmoflowError(f"'{repo_id}' is not a Hub repository id (org/name)")
    release = Path(release)
    report = verify_release(release)
    if not report.ok:
        raise OlmoflowError(f"'{release}' does not pass olmoflow verify ({report.problems[0]}; "
                            f"{len(report.problems)} problem(s)); it is not pushed")
    plan = push_plan(release)
    try:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
    except ImportError:
        raise OlmoflowError("olmoflow push needs huggingface_hub: pip install 'olmoflow[hub]'"
                            ) from None
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        first = api.list_repo_commits(repo_id)[-1].commit_id  # the Hub's .gitattributes
        for b in plan:
            if b.name != "main":
                api.create_branch(repo_id, branch=b.name, revision=first, exist_ok=True)
            keep = {rel for _, rel in b.files} | {".gitattributes"}
            stale = [f for f in api.list_repo_files(repo_id, revision=b.name) if f not in keep]
            ops = [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(p))
                   for p, rel in b.files] + [CommitOperationDelete(path_in_repo=f) for f in stale]
            api.create_commit(repo_id, operations=ops, commit_message=b.message,
                              revision=b.name)
    except Exception as e:  # huggingface_hub raises many kinds: offline, 401/403, HTTP, httpx
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        hint = (" (log in with 'hf auth login' or set HF_TOKEN)"
                if "401" in first_line or "403" in first_line else "")
        raise OlmoflowError(f"push of '{release}' to '{repo_id}' failed: "
                            f"{type(e).__name__}: {first_line}{hint}") from None
    return plan
