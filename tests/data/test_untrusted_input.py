"""Input that should not be trusted blindly: symbolic links out of a data directory, plugin
modules found only because they lie in the current directory, and a local Ray instance that
would listen on every network interface."""

from __future__ import annotations

import gzip
import json
import logging
import sys
import types

import pytest

from olmoflow.cli import main
from olmoflow.errors import OlmoflowError

# ---- Ray: a local instance listens on the loopback address only -------------------------------


@pytest.fixture
def fake_ray(monkeypatch):
    """A stand-in ``ray`` module recording what ``ray.init`` was called with (and whether Ray
    would keep a loopback node address at that moment): no cluster starts."""
    constants = types.ModuleType("ray._private.ray_constants")
    constants.ENABLE_RAY_CLUSTER = True
    worker = types.SimpleNamespace(_global_node=None)
    private = types.ModuleType("ray._private")
    private.ray_constants, private.worker = constants, worker
    ray = types.ModuleType("ray")
    ray._private = private
    ray.calls = []

    def init(**kwargs):
        ray.calls.append({**kwargs, "cluster_mode": constants.ENABLE_RAY_CLUSTER})
        worker._global_node = types.SimpleNamespace(
            node_ip_address=kwargs.get("_node_ip_address", "192.0.2.2"))

    ray.init = init
    ray.is_initialized = lambda: bool(ray.calls)
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray._private", private)
    monkeypatch.setitem(sys.modules, "ray._private.ray_constants", constants)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return ray


def test_local_ray_binds_to_loopback_without_dashboard(fake_ray, caplog):
    from olmoflow.data.executor import ray_init

    with caplog.at_level(logging.WARNING):
        ray_init(workers=3)
    (call,) = fake_ray.calls
    assert call["_node_ip_address"] == "127.0.0.1"
    assert call["include_dashboard"] is False and call["num_cpus"] == 3
    # Ray resolves 127.0.0.1 to the routable address unless its single-machine mode is on.
    assert call["cluster_mode"] is False
    assert fake_ray._private.ray_constants.ENABLE_RAY_CLUSTER is True  # restored afterwards
    assert "listens on" not in caplog.text
    ray_init(workers=3)  # connected: a no-op
    assert len(fake_ray.calls) == 1


@pytest.mark.parametrize("where", ["argument", "environment"])
def test_a_given_ray_address_is_used_as_is(fake_ray, monkeypatch, where):
    from olmoflow.data.executor import ray_init

    if where == "environment":
        monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    ray_init(workers=2, address="ray://head:10001" if where == "argument" else None)
    (call,) = fake_ray.calls
    assert call["address"] == "ray://head:10001"
    assert "_node_ip_address" not in call and call["cluster_mode"] is True
    assert call["include_dashboard"] is False


# ---- data-engine plugins: a module name never resolves from the current directory -------------

PLUGIN = """
import pathlib
pathlib.Path("RAN").write_text(__name__)
"""


@pytest.fixture
def m_cwd(tmp_path, monkeypatch):
    """The current directory as ``python -m olmoflow`` sees it (first on ``sys.path``)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.delenv("PYTHONPATH", raising=False)
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_a_plugin_module_in_the_current_directory_is_refused(m_cwd):
    from olmoflow.data.steps import import_plugins

    (m_cwd / "my_taggers.py").write_text(PLUGIN)
    with pytest.raises(OlmoflowError, match=r"plugins: cannot import 'my_taggers': .*current "
                                            r"directory.*plugins: \[\./my_taggers\.py\]"):
        import_plugins(["my_taggers"])
    assert not (m_cwd / "RAN").exists()
    import_plugins([str(m_cwd / "my_taggers.py")])  # named as a file: the user's choice
    assert (m_cwd / "RAN").exists()


# ---- symbolic links out of a data directory ----------------------------------------------------


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
    with pytest.raises(OlmoflowError, match="config key 'options.follow_symlinks' expects true/false"):
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
