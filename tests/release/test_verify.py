"""``olmoflow verify`` against forgeries: a release whose file changed, with every record a forger
can rewrite without the published digest rewritten to match, fails; so does a release file
replaced by a symbolic link. A good release passes, with and without ``--digest``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from olmoflow.cli import main
from olmoflow.release.index import PLACEHOLDER, stated_digest


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def run_dir(tiny_run) -> Path:
    return tiny_run


def verify(release: Path, capsys, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["verify", str(release), *extra])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def copy_release(run_dir: Path, tmp_path: Path) -> Path:
    """A copy of the run (so the release is still inside its run directory)."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, symlinks=True)
    return copy / "release"


def flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


def rewrite_index(release: Path, rel: str) -> None:
    """What a forger does after changing ``rel``: write its new hash into ``files.json``."""
    index = json.loads((release / "files.json").read_text())
    index["files"][rel] = {"bytes": (release / rel).stat().st_size,
                           "sha256": sha256(release / rel)}
    (release / "files.json").write_text(json.dumps(index, indent=2) + "\n")


def test_a_good_release_passes_and_states_its_digest(run_dir, capsys):
    release = run_dir / "release"
    digest = sha256(release / "files.json")
    assert stated_digest((release / "README.md").read_text()) == digest
    assert PLACEHOLDER not in (release / "README.md").read_text()
    m = json.loads((release / "manifest.json").read_text())
    assert m["counts"]["digest"] == digest  # what the release stage printed
    rc, out = verify(release, capsys)
    assert rc == 0 and out.startswith("OK:") and f"release digest {digest}" in out, out
    rc, out = verify(release, capsys, "--digest", digest)
    assert rc == 0 and "the one given" in out, out
    rc, out = verify(release, capsys, "--digest", "sha256:" + digest.upper())
    assert rc == 0, out


def test_a_digest_published_elsewhere_names_one_release(run_dir, capsys):
    other = "1" * 64
    rc, out = verify(run_dir / "release", capsys, "--digest", other)
    assert rc == 1 and f"not the given {other}" in out, out
    rc, out = verify(run_dir / "release", capsys, "--digest", "abc")
    assert rc == 2 and out.count("\n") == 1 and "--digest must be" in out, out


def test_rewritten_files_json_and_deleted_manifest_fail(run_dir, tmp_path, capsys):
    release = copy_release(run_dir, tmp_path)
    digest = sha256(release / "files.json")
    flip_byte(release / "model.safetensors", 10_000)
    rewrite_index(release, "model.safetensors")
    (release / "manifest.json").unlink()
    rc, out = verify(release, capsys)
    assert rc == 1, out
    assert "missing: manifest.json" in out
    assert "README.md states" in out  # the card's digest is not the rewritten index's
    rc, out = verify(release, capsys, "--digest", digest)
    assert rc == 1 and f"not the given {digest}" in out, out


def test_rewritten_files_json_with_the_manifest_kept_fails(run_dir, tmp_path, capsys):
    release = copy_release(run_dir, tmp_path)
    flip_byte(release / "model.safetensors", 10_000)
    rewrite_index(release, "model.safetensors")
    rc, out = verify(release, capsys)
    assert rc == 1, out
    assert "changed: files.json (manifest.json records" in out
    assert "changed: manifest.json (its sha256 of model.safetensors" in out


def test_a_forged_checkpoint_disagrees_with_its_other_records(run_dir, tmp_path, capsys):
    release = copy_release(run_dir, tmp_path)
    [first, _] = sorted((release / "checkpoints").iterdir())
    rel = f"checkpoints/{first.name}/model.safetensors"
    flip_byte(release / rel, 10_000)
    rewrite_index(release, rel)
    (release / "manifest.json").unlink()
    rc, out = verify(release, capsys)
    assert rc == 1, out
    assert f"checkpoints.csv (checkpoints/{first.name}) and files.json disagree" in out
    assert f"checkpoints/{first.name}/export_manifest.json and files.json disagree" in out
    # and with the checkpoint's own manifest deleted too, and dropped from files.json
    export = f"checkpoints/{first.name}/export_manifest.json"
    (release / export).unlink()
    index = json.loads((release / "files.json").read_text())
    del index["files"][export]
    (release / "files.json").write_text(json.dumps(index, indent=2))
    rc, out = verify(release, capsys)
    assert rc == 1 and f"missing: {export}" in out, out


def test_an_unlisted_checkpoint_folder_fails(run_dir, tmp_path, capsys):
    release = copy_release(run_dir, tmp_path)
    [first, _] = sorted((release / "checkpoints").iterdir())
    shutil.copytree(first, release / "checkpoints" / "stage1-step9-tokens9K")
    rc, out = verify(release, capsys)
    assert rc == 1 and "checkpoints/stage1-step9-tokens9K is not in checkpoints.csv" in out, out


def test_a_release_file_replaced_by_a_symlink_fails(run_dir, tmp_path, capsys):
    release = copy_release(run_dir, tmp_path)
    outside = tmp_path / "elsewhere" / "config.json"
    outside.parent.mkdir()
    shutil.copy(release / "config.json", outside)  # an identical copy: the hash still matches
    (release / "config.json").unlink()
    os.symlink(outside, release / "config.json")
    rc, out = verify(release, capsys)
    assert rc == 1 and f"symlink: config.json -> {outside}" in out, out
    # a linked folder too
    shutil.move(release / "eval", tmp_path / "elsewhere" / "eval")
    os.symlink(tmp_path / "elsewhere" / "eval", release / "eval")
    rc, out = verify(release, capsys)
    assert rc == 1 and "symlink: eval ->" in out, out


def test_an_edited_card_fails(run_dir, tmp_path, capsys):
    release = copy_release(run_dir, tmp_path)
    card = release / "README.md"
    card.write_text(card.read_text().replace("## Model", "## The best model"))
    rc, out = verify(release, capsys)
    assert rc == 1 and "changed: README.md" in out, out


def test_a_referenced_checkpoint_rewritten_with_its_checksums_fails(run_dir, tmp_path, capsys):
    """release.include_checkpoints=false: checkpoints.csv records the sha256 of each
    checkpoint's checksums.json, which a forger who rewrites a file and its checksums changes."""
    import csv

    from olmoflow.model.checkpoint_files import write_checksums

    run = copy_release(run_dir, tmp_path).parent
    capsys.readouterr()
    assert main(["release", str(run), "release.include_checkpoints=false", "--no-progress"]) == 0
    release = run / "release"
    rows = list(csv.DictReader((release / "checkpoints.csv").open()))
    assert rows and not any(r["path"].startswith("checkpoints/") for r in rows)
    rc, out = verify(release, capsys)
    assert rc == 0 and "2 referenced checkpoints checked" in out, out
    ckpt = run / rows[0]["path"]
    config = ckpt / "config.yaml"  # the checkpoint's own copy of its run config
    config.write_text(config.read_text() + "# edited\n")
    write_checksums(ckpt)  # the forger's own checksums
    rc, out = verify(release, capsys)
    assert rc == 1 and f"checkpoint {rows[0]['path']}: its checksums.json is not the one " \
        "checkpoints.csv records" in out, out
