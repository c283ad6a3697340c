"""Symbolic links out of a data directory: collect and the data engine's ingest skip them (with a
warning naming them and how to read them) unless asked to follow; what they do read is recorded,
and hashed into the ingest fingerprint, under its real path, once; nothing behind a skipped link
is hashed."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest

from olmoflow.cli import main
from olmoflow.data.engine import Engine, load_data_config
from olmoflow.errors import OlmoflowError


def _doc(text):
    return json.dumps({"text": text}) + "\n"


@pytest.fixture
def linked(tmp_path):
    """``data/`` with a file, a link to a file inside it, a link to a file outside it and a link
    to a directory outside it; the outside text must not reach the corpus unless asked."""
    data, secret = tmp_path / "data", tmp_path / "secret"
    (data / "sub").mkdir(parents=True)
    secret.mkdir()
    (data / "a.jsonl").write_text(_doc("inside a " * 10) + _doc("inside a2 " * 10))
    (data / "sub" / "b.jsonl").write_text(_doc("inside b " * 10))
    (data / "inlink.jsonl").symlink_to(data / "sub" / "b.jsonl")
    (secret / "s.jsonl").write_text(_doc("SECRET " * 10))
    (data / "out.jsonl").symlink_to(secret / "s.jsonl")
    (data / "outdir").symlink_to(secret, target_is_directory=True)
    return tmp_path


def _texts(path):
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["text"] for line in f]


def _collect(tmp, *args):
    run = tmp / "run"
    rc = main(["collect", "--run-dir", str(run), "--no-progress", *args])
    manifest = json.loads((run / "collect" / "manifest.json").read_text()) if rc == 0 else None
    return rc, run, manifest


def test_collect_skips_links_out_of_the_data_directory(linked, capsys, caplog):
    with caplog.at_level(logging.WARNING):
        rc, run, manifest = _collect(linked, "--data", str(linked / "data"))
    assert rc == 0, capsys.readouterr().err
    texts = _texts(run / "collect" / "documents.jsonl.gz")
    assert not any("SECRET" in t for t in texts)
    assert sum("inside b" in t for t in texts) == 1  # a link inside is fine, and read once
    assert manifest["counts"]["skipped_symlinks"] == 2  # out.jsonl and outdir/
    warnings = [r.getMessage() for r in caplog.records if "symbolic link" in r.getMessage()]
    assert len(warnings) == 1 and "skipped 2" in warnings[0]
    assert str(linked / "data" / "out.jsonl") in warnings[0]  # the first, sorted
    assert "--follow-symlinks" in warnings[0]
    paths = [i["path"] for i in manifest["inputs"]]
    assert not any("secret" in p for p in paths)


def test_collect_glob_skips_links_out_of_its_directory(linked, capsys):
    rc, run, manifest = _collect(linked, "--data", str(linked / "data" / "*.jsonl"))
    assert rc == 0, capsys.readouterr().err
    assert not any("SECRET" in t for t in _texts(run / "collect" / "documents.jsonl.gz"))
    assert manifest["counts"]["skipped_symlinks"] == 1


@pytest.mark.parametrize("how", ["flag", "config"])
def test_collect_follows_links_when_asked_and_records_real_paths(linked, capsys, how):
    ask = ["--follow-symlinks"] if how == "flag" else ["collect.follow_symlinks=true"]
    rc, run, manifest = _collect(linked, "--data", str(linked / "data"), *ask)
    assert rc == 0, capsys.readouterr().err
    texts = _texts(run / "collect" / "documents.jsonl.gz")
    assert sum("SECRET" in t for t in texts) == 1  # out.jsonl and outdir/s.jsonl: one file
    assert manifest["counts"]["skipped_symlinks"] == 0
    paths = [i["path"] for i in manifest["inputs"]]
    assert str((linked / "secret" / "s.jsonl").resolve()) in paths  # the target, not the link
    assert str(linked / "data" / "out.jsonl") not in paths


def test_collect_reads_a_linked_file_named_on_its_own(linked, capsys):
    rc, run, _ = _collect(linked, "--data", str(linked / "data" / "out.jsonl"),
                          "--data", str(linked / "data" / "a.jsonl"))
    assert rc == 0, capsys.readouterr().err
    assert any("SECRET" in t for t in _texts(run / "collect" / "documents.jsonl.gz"))


def test_a_directory_of_links_out_says_how_to_read_them(tmp_path, capsys):
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "s.jsonl").write_text(_doc("SECRET " * 10))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "s.jsonl").symlink_to(tmp_path / "secret" / "s.jsonl")
    rc, _, _ = _collect(tmp_path, "--data", str(tmp_path / "data"))
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "1 symbolic link(s) that lead outside it were skipped" in err
    assert "--follow-symlinks" in err


def test_ingest_skips_links_out_of_a_source_directory(linked, caplog):
    from olmoflow.data.sources import ingest_tasks

    with caplog.at_level(logging.WARNING):
        tasks = ingest_tasks("web", [str(linked / "data")], linked / "out")
    assert sorted(t["name"] for t in tasks) == ["web/a.jsonl", "web/inlink.jsonl"] or \
        sorted(t["name"] for t in tasks) == ["web/a.jsonl", "web/sub/b.jsonl"]
    assert not any("secret" in t["input"] for t in tasks)
    assert "skipped 2 symbolic link(s)" in caplog.text and "source 'web'" in caplog.text
    followed = ingest_tasks("web", [str(linked / "data")], linked / "out",
                            options={"follow_symlinks": True})
    assert len(followed) == 3 and all("follow_symlinks" not in t for t in followed)
    with pytest.raises(OlmoflowError,
                       match="config key 'options.follow_symlinks' expects true/false"):
        ingest_tasks("web", [str(linked / "data")], linked / "out",
                     options={"follow_symlinks": "yes"})


@pytest.mark.parametrize("follow", [False, True])
def test_data_ingest_front_door(linked, capsys, caplog, follow):
    cfg = linked / "data.yaml"
    cfg.write_text(f"output: {linked / 'engine'}\nexecutor: serial\nsteps: [ingest]\n"
                   f"sources: [{{name: web, paths: ['{linked / 'data'}']}}]\n")
    with caplog.at_level(logging.WARNING):
        rc = main(["data", "ingest", str(cfg), "--no-progress",
                   *(["--follow-symlinks"] if follow else [])])
    assert rc == 0, capsys.readouterr().err
    texts = [t for f in sorted((linked / "engine" / "documents").rglob("*.jsonl.gz"))
             for t in _texts(f)]
    assert any("inside a" in t for t in texts)
    assert any("SECRET" in t for t in texts) is follow
    assert ("symbolic link" in caplog.text) is not follow


# --- the ingest fingerprint and manifest: real paths, once ----------------------------------------


@pytest.fixture
def linked_files(tmp_path) -> Path:
    """``data/`` with a file, a link inside it and a link to a file outside it (no link to a
    directory)."""
    data, secret = tmp_path / "data", tmp_path / "secret"
    (data / "sub").mkdir(parents=True)
    secret.mkdir()
    (data / "a.jsonl").write_text(_doc("inside a " * 10))
    (data / "sub" / "b.jsonl").write_text(_doc("inside b " * 10))
    (data / "inlink.jsonl").symlink_to(data / "sub" / "b.jsonl")
    (secret / "s.jsonl").write_text(_doc("SECRET " * 10))
    (data / "out.jsonl").symlink_to(secret / "s.jsonl")
    return tmp_path


def _config(tmp: Path, extra: str = "", follow: bool = False) -> Path:
    opts = ", options: {follow_symlinks: true}" if follow else ""
    cfg = tmp / "data.yaml"
    cfg.write_text(f"output: {tmp / 'engine'}\nexecutor: serial\nsteps: [ingest]\n"
                   f"sources: [{{name: web, paths: ['{tmp / 'data'}']{opts}}}]\n{extra}")
    return cfg


def _fingerprint(cfg: Path) -> str:
    return Engine(load_data_config(cfg)).fingerprint("ingest")


@pytest.mark.parametrize("follow", [False, True])
def test_the_ingest_fingerprint_hashes_only_what_ingest_reads(linked_files, follow):
    cfg = _config(linked_files, follow=follow)
    before = _fingerprint(cfg)
    (linked_files / "secret" / "s.jsonl").write_text(_doc("CHANGED " * 10))  # behind the link out
    assert (_fingerprint(cfg) != before) is follow
    before = _fingerprint(cfg)
    (linked_files / "data" / "a.jsonl").write_text(_doc("edited a " * 10))
    assert _fingerprint(cfg) != before  # a file ingest does read still counts


def test_the_ingest_fingerprint_names_real_paths_once(linked_files):
    from olmoflow.data.engine.steps import STEP_TABLE

    engine = Engine(load_data_config(_config(linked_files)))
    files = STEP_TABLE["ingest"].section(engine)["sources"][0]["files"]
    paths = [f[0] for f in files]
    assert sorted(paths) == sorted({str((linked_files / "data" / p).resolve())
                                    for p in ("a.jsonl", "sub/b.jsonl")})


@pytest.mark.parametrize("follow", [False, True])
def test_ingest_records_the_real_paths_it_read(linked_files, capsys, follow):
    rc = main(["data", "ingest", str(_config(linked_files, follow=follow)), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    manifest = json.loads((linked_files / "engine" / "documents" / "manifest.json").read_text())
    paths = [i["path"] for i in manifest["inputs"]]
    assert len(paths) == len(set(paths))  # inlink.jsonl and sub/b.jsonl are one file
    assert not any(p.endswith(("inlink.jsonl", "out.jsonl")) for p in paths)  # no link names
    assert (str((linked_files / "secret" / "s.jsonl").resolve()) in paths) is follow
    assert str((linked_files / "data" / "sub" / "b.jsonl").resolve()) in paths
