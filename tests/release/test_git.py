"""``olmoflow release --git``: the release as a git repository, weights in Git LFS, one tag per
checkpoint; a clone of main passes ``olmoflow verify --digest`` and a clone of a tag is that
checkpoint's Hugging Face directory. Offline: git and git-lfs on local paths only."""

from __future__ import annotations

import csv
import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from olmoflow.cli import main
from olmoflow.errors import OlmoflowError
from olmoflow.model.olmo import Olmo
from olmoflow.release.git import git_release


def _git_lfs_missing() -> str | None:
    if shutil.which("git") is None:
        return "git is not installed"
    if subprocess.run(["git", "lfs", "version"], capture_output=True).returncode != 0:
        return "git-lfs is not installed"
    return None


MISSING = _git_lfs_missing()
pytestmark = pytest.mark.skipif(
    MISSING is not None, reason=f"{MISSING} (Debian: apt-get install git-lfs; 'make test' "
    "installs it when run as root)")


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def checkpoint_names(release: Path) -> list[str]:
    return [r["name"] for r in csv.DictReader((release / "checkpoints.csv").open())]


def release_git(run: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["release", str(run), "--git", "--no-progress"])
    out = capsys.readouterr()
    return rc, out.out + out.err


def files_of(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in d.rglob("*") if p.is_file() and not p.relative_to(d).as_posix()
            .startswith(".git")}


def test_release_git_is_a_repository_with_lfs_weights_and_a_tag_per_checkpoint(
        copy_run, tmp_path, capsys):
    release = copy_run / "release"
    before = files_of(release)
    rc, out = release_git(copy_run, capsys)
    assert rc == 0, out
    assert "[release] skipped" in out  # the bundle was complete: only the repository is new
    assert "is now a git repository" in out and "2 checkpoint tag(s)" in out
    assert files_of(release) == before  # the repository adds no file to the release
    names = checkpoint_names(release)
    assert git(release, "tag", "--list").splitlines() == sorted(names)
    # history: the checkpoints oldest first, then the release
    chain = git(release, "rev-list", "--first-parent", "main").splitlines()
    assert chain[1:] == [git(release, "rev-parse", f"{n}^{{commit}}") for n in reversed(names)]
    assert git(release, "status", "--porcelain", "--untracked-files=all") == ""
    lfs = set(git(release, "lfs", "ls-files", "--name-only").splitlines())
    assert lfs == {"model.safetensors", *(f"checkpoints/{n}/model.safetensors" for n in names)}
    pointer = git(release, "cat-file", "-p", "main:model.safetensors")
    assert pointer.startswith("version https://git-lfs.github.com/spec/v1")
    assert "manifest.json" in git(release, "ls-tree", "--name-only", "main").splitlines()
    assert ".fingerprint" not in git(release, "ls-tree", "--name-only", "main").splitlines()

    # a clone of main is the release: it verifies against the digest its card states
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(release), str(clone))
    digest = hashlib.sha256((release / "files.json").read_bytes()).hexdigest()
    capsys.readouterr()
    assert main(["verify", str(clone), "--digest", digest]) == 0, capsys.readouterr().out
    # a clone of a tag is that checkpoint's Hugging Face directory, weights smudged from LFS
    first = tmp_path / names[0]
    git(tmp_path, "clone", "-q", "--branch", names[0], str(release), str(first))
    assert files_of(first) == files_of(release / "checkpoints" / names[0])
    ours = Olmo.from_pretrained(first)
    theirs = Olmo.from_pretrained(release / "checkpoints" / names[0])
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(),
                                                 theirs.state_dict().values(), strict=True))

    # again: the repository is this release's, left as it is (the same commit)
    head = git(release, "rev-parse", "main")
    rc, out = release_git(copy_run, capsys)
    assert rc == 0 and "is already a git repository" in out, out
    assert git(release, "rev-parse", "main") == head


def test_the_same_release_gives_the_same_commits_after_an_interrupted_attempt(
        copy_run, tiny_run, tmp_path, capsys):
    rc, out = release_git(copy_run, capsys)
    assert rc == 0, out
    other = tmp_path / "other"
    shutil.copytree(tiny_run, other, symlinks=True)
    (other / "release" / ".git-partial").mkdir()  # an interrupted earlier attempt
    (other / "release" / ".git-partial" / "HEAD").write_text("junk")
    rc, out = release_git(other, capsys)
    assert rc == 0, out
    assert (git(copy_run / "release", "rev-parse", "main")
            == git(other / "release", "rev-parse", "main"))


def test_an_edited_repository_or_a_damaged_release_is_refused(copy_run, capsys):
    release = copy_run / "release"
    rc, out = release_git(copy_run, capsys)
    assert rc == 0, out
    git(release, "tag", "-d", checkpoint_names(release)[0])
    rc, out = release_git(copy_run, capsys)
    assert rc == 2 and out.count("\n") == 1, out
    assert "is not the repository of this release (tag" in out and "remove it" in out
    shutil.rmtree(release / ".git")
    # damaged after it was made (the runner would rebuild it; the library refuses it)
    (release / "training_log.jsonl").write_text("{}\n")
    with pytest.raises(OlmoflowError, match=r"does not pass olmoflow verify \(changed: "
                       r"training_log.jsonl"):
        git_release(release)
    assert not (release / ".git").exists() and not (release / ".git-partial").exists()


def test_without_git_the_release_is_no_repository(copy_run, capsys):
    rc = main(["release", str(copy_run), "--no-progress"])
    assert rc == 0 and not (copy_run / "release" / ".git").exists()
