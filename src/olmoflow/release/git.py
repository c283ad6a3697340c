"""A release as a git repository (``olmoflow release --git``), versioned as OLMo publishes its
models: weights under Git LFS, one tag per intermediate checkpoint named as OLMo names its Hub
revisions (``stage1-step1000-tokens4B``).

The repository lives in the release directory itself (``.git``, ``.gitattributes``: hidden, so
``olmoflow verify`` leaves them out). Its history is the training run: one commit per exported
checkpoint (``checkpoints/<name>/``), oldest first, whose tree is that checkpoint's Hugging Face
directory at the root, tagged with its name; then ``main``, whose tree is the whole release. So
``git clone --branch stage1-step300-tokens1M DIR`` gives a directory ``from_pretrained`` loads as
that checkpoint, and a clone of ``main`` passes ``olmoflow verify``. Git LFS tracks the weights
(:data:`LFS_PATTERNS`) of the model and of every checkpoint; a checkpoint's weights are one LFS
object, shared by its tag and ``main``.

The repository is assembled in ``.git-partial`` and renamed to ``.git`` when complete; commits
carry the release's time (its manifest's ``finished``), so the same release and identity give
the same commit ids. A release that is already a complete repository of its own files is left
as it is.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from olmoflow.artifacts import atomic_write_text
from olmoflow.errors import OlmoflowError

#: the files Git LFS stores: model weights in every format a release or its checkpoints hold.
LFS_PATTERNS = ("*.safetensors", "*.gguf", "*.bin", "*.pt", "*.pth")
PARTIAL = ".git-partial"
# The runner's bookkeeping and interrupted writes are hidden files; .gitattributes is the
# repository's own.
EXCLUDE = ".*\n!.gitattributes\n"


@dataclass
class GitRelease:
    """The repository :func:`git_release` wrote (or found): its ``main`` commit, the tags (one
    per exported checkpoint, oldest first), the files Git LFS stores, and whether it was there
    already."""

    path: Path
    commit: str
    tags: list[str] = field(default_factory=list)
    lfs_files: list[str] = field(default_factory=list)
    existed: bool = False

    def summary(self) -> str:
        """One line for the user."""
        state = "is already" if self.existed else "is now"
        tags = f"{len(self.tags)} checkpoint tag(s)" + (f" ({self.tags[0]} .. {self.tags[-1]})"
                                                        if self.tags else "")
        return (f"'{self.path}' {state} a git repository: main {self.commit[:12]}, {tags}, "
                f"{len(self.lfs_files)} file(s) in Git LFS; clone it with git clone "
                f"(git-lfs installed)")


def require_git_lfs() -> None:
    """Raises OlmoflowError naming what is missing when git or git-lfs is not installed."""
    if shutil.which("git") is None:
        raise OlmoflowError("release.git needs git, which is not installed (Debian: apt-get "
                            "install git git-lfs)")
    try:
        subprocess.run(["git", "lfs", "version"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        raise OlmoflowError("release.git needs git-lfs, which is not installed (Debian: apt-get "
                            "install git-lfs; elsewhere https://git-lfs.com)") from None


class _Git:
    """git on one repository (``git_dir``) and work tree, with a fixed identity and date."""

    def __init__(self, git_dir: Path, work_tree: Path, when: str | None) -> None:
        self.git_dir, self.work_tree = git_dir, work_tree
        self.env = {**os.environ, "GIT_DIR": str(git_dir), "GIT_WORK_TREE": str(work_tree)}
        for k in ("GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_ALTERNATE_OBJECT_DIRECTORIES"):
            self.env.pop(k, None)
        for role in ("AUTHOR", "COMMITTER"):
            self.env.setdefault(f"GIT_{role}_NAME", _config("user.name") or "olmoflow")
            self.env.setdefault(f"GIT_{role}_EMAIL", _config("user.email") or "olmoflow@localhost")
            if when:
                self.env.setdefault(f"GIT_{role}_DATE", when)

    def __call__(self, *args: str, work_tree: Path | None = None, index: Path | None = None,
                 stdin: str | None = None) -> str:
        env = dict(self.env)
        if work_tree is not None:
            env["GIT_WORK_TREE"] = str(work_tree)
        if index is not None:
            env["GIT_INDEX_FILE"] = str(index)
        try:
            done = subprocess.run(["git", *args], env=env, cwd=env["GIT_WORK_TREE"], input=stdin,
                                  capture_output=True, text=True, check=True)
        except subprocess.CalledProcessError as e:
            detail = " ".join((e.stderr or e.stdout or "").split())[:300]
            raise OlmoflowError(f"git {args[0]} failed in '{self.work_tree}': {detail}") from None
        return done.stdout.strip()


def _config(key: str) -> str:
    try:
        return subprocess.run(["git", "config", "--global", key], capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return ""


def exported_checkpoints(release: Path) -> list[dict[str, str]]:
    """The rows of ``checkpoints.csv`` whose checkpoint is in the bundle (``checkpoints/...``),
    in its order (flow order, oldest first); none without the file."""
    table = release / "checkpoints.csv"
    if not table.is_file():
        return []
    rows = csv.DictReader(table.read_text(encoding="utf-8").splitlines())
    return [r for r in rows if (r.get("path") or "").startswith("checkpoints/")]


def _finished(release: Path) -> str | None:
    try:
        return json.loads((release / "manifest.json").read_text(encoding="utf-8"))["finished"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def git_release(release: str | Path) -> GitRelease:
    """Make the release at ``release`` a git repository (see the module docstring).

    Returns:
        What was written, or found when it already is the repository of these files.
    Raises:
        OlmoflowError: git or git-lfs missing; the release fails ``olmoflow verify`` (a repository
            of a damaged release would publish the damage); a ``.git`` there that is not this
            release's (changed files or missing tags: the message says to remove it).
    """
    from olmoflow.release.verify import verify_release

    release = Path(release)
    require_git_lfs()
    report = verify_release(release)
    if not report.ok:
        raise OlmoflowError(f"'{release}' does not pass olmoflow verify ({report.problems[0]}; "
                            f"{len(report.problems)} problem(s)); a repository of it would "
                            "publish them")
    names = [r["name"] for r in exported_checkpoints(release)]
    if (release / ".git").exists():
        return _existing(release, names)
    partial = release / PARTIAL
    shutil.rmtree(partial, ignore_errors=True)  # an interrupted earlier attempt
    git = _Git(partial, release, _finished(release))
    git("init", "-q", "-b", "main")
    git("config", "--unset", "core.worktree")  # the directory may be moved or copied
    git("lfs", "install", "--local")
    attributes = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS)
    atomic_write_text(release / ".gitattributes", attributes)
    # the checkpoints' trees are added from their own folders, where no .gitattributes lies
    (partial / "info").mkdir(exist_ok=True)
    (partial / "info" / "attributes").write_text(attributes)
    (partial / "info" / "exclude").write_text(EXCLUDE)
    attributes_blob = git("hash-object", "-w", str(release / ".gitattributes"))
    parent: list[str] = []
    index = partial / "checkpoint-index"
    for row in exported_checkpoints(release):
        index.unlink(missing_ok=True)
        git("add", "-A", ".", work_tree=release / row["path"], index=index)
        git("update-index", "--add", "--cacheinfo", f"100644,{attributes_blob},.gitattributes",
            index=index)
        tree = git("write-tree", index=index)
        commit = git("commit-tree", tree, *parent, stdin=(
            f"{row['name']}: {row['stage']} checkpoint, step {row['step']}, "
            f"{row['tokens']} tokens\n"))
        git("tag", row["name"], commit)
        parent = ["-p", commit]
    index.unlink(missing_ok=True)
    git("add", "-A", ".")
    tree = git("write-tree")
    commit = git("commit-tree", tree, *parent, stdin=(
        f"release, digest {report.digest}\n\nThe sha256 of files.json; check a clone with "
        f"olmoflow verify DIR --digest {report.digest}\n"))
    git("update-ref", "refs/heads/main", commit)
    lfs = git("lfs", "ls-files", "--name-only").splitlines()
    os.replace(partial, release / ".git")
    return GitRelease(release, commit, names, lfs)


def _existing(release: Path, names: list[str]) -> GitRelease:
    """The repository already at ``release/.git``, when it is this release's."""
    git = _Git(release / ".git", release, None)
    dirty = git("status", "--porcelain", "--untracked-files=all")
    tags = git("tag", "--list").splitlines()
    missing = [n for n in names if n not in tags]
    if dirty or missing:
        what = (f"{len(dirty.splitlines())} file(s) differ from its last commit" if dirty
                else f"tag {missing[0]} is missing")
        raise OlmoflowError(f"'{release / '.git'}' is not the repository of this release ({what});"
                            " remove it and rerun to write it again")
    lfs = git("lfs", "ls-files", "--name-only").splitlines()
    return GitRelease(release, git("rev-parse", "HEAD"), names, lfs, existed=True)
