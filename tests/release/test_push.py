"""``olmoflow push``: the plan of branches and files is made and checked offline; without
huggingface_hub or without the network the push is a one-line error. The upload itself runs only
with ``OLMOFLOW_ALLOW_NETWORK=1`` and ``OLMOFLOW_TEST_HUB_REPO`` naming a repository of yours."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from olmoflow.cli import main
from olmoflow.model.hub import network_allowed
from olmoflow.release.push import push_plan

SRC = Path(__file__).resolve().parents[2] / "src"


def test_the_plan_is_one_branch_per_checkpoint_then_main(tiny_run):
    release = tiny_run / "release"
    rows = list(csv.DictReader((release / "checkpoints.csv").open()))
    plan = push_plan(release)
    assert [b.name for b in plan] == [r["name"] for r in rows] + ["main"]
    for b, row in zip(plan, rows):
        d = release / row["path"]
        assert {rel for _, rel in b.files} == {p.name for p in d.iterdir()}
        assert all(p == d / rel for p, rel in b.files)
        assert "model.safetensors" in {rel for _, rel in b.files}
    main_files = {rel for _, rel in plan[-1].files}
    listed = json.loads((release / "files.json").read_text())["files"]
    assert main_files == {*listed, "files.json", "manifest.json"}
    assert not any(rel.startswith(".") for rel in main_files)


def test_dry_run_prints_the_plan_without_huggingface_hub(tiny_run, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # not installed
    assert main(["push", str(tiny_run / "release"), "me/tiny", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("me/tiny: 3 branch(es)") and "dry run: nothing uploaded" in out
    assert main(["push", str(tiny_run / "release"), "me/tiny"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs huggingface_hub" in err and "olmoflow[hub]" in err


def test_a_bad_repository_id_or_release_is_one_line(tiny_run, tmp_path, capsys):
    assert main(["push", str(tiny_run / "release"), "not a repo"]) == 2
    assert "not a Hub repository id" in capsys.readouterr().err
    assert main(["push", str(tmp_path), "me/tiny", "--dry-run"]) == 2
    assert "no files.json" in capsys.readouterr().err


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"},
                                 # a closed port: refused at once, nothing leaves the machine
                                 {"HF_ENDPOINT": "http://127.0.0.1:9"}])
def test_without_the_network_the_push_is_one_line(tiny_run, env):
    run_env = {**os.environ, "PYTHONPATH": str(SRC), "HF_TOKEN": "hf_not_a_token", **env}
    done = subprocess.run([sys.executable, "-m", "olmoflow.cli", "push",
                           str(tiny_run / "release"), "me/tiny"],
                          env=run_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "push of" in done.stderr and "failed" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(not (network_allowed() and os.environ.get("OLMOFLOW_TEST_HUB_REPO")),
                    reason="uploads to the Hub: set OLMOFLOW_ALLOW_NETWORK=1 and "
                    "OLMOFLOW_TEST_HUB_REPO=org/name (a repository of yours; HF_TOKEN)")
def test_push_and_load_a_checkpoint_revision(tiny_run, tmp_path):
    from olmoflow.model.olmo import Olmo

    repo = os.environ["OLMOFLOW_TEST_HUB_REPO"]
    release = tiny_run / "release"
    assert main(["push", str(release), repo, "--private"]) == 0
    first = push_plan(release)[0].name
    ours = Olmo.from_pretrained(repo, revision=first, allow_network=True,
                                cache_dir=tmp_path / "hf")
    local = Olmo.from_pretrained(release / "checkpoints" / first)
    for a, b in zip(ours.state_dict().values(), local.state_dict().values(), strict=True):
        assert (a == b).all()
    from huggingface_hub import snapshot_download

    # real files, not the cache's links (a release holds its own files)
    main_dir = snapshot_download(repo, local_dir=tmp_path / "main")
    digest = json.loads((release / "manifest.json").read_text())["counts"]["digest"]
    assert main(["verify", str(main_dir), "--digest", digest]) == 0
