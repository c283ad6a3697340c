"""The data engine deletes only in its own output: a directory it marked (or an output it made
before it marked them), never a source that lies inside it, and one process at a time."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from checks import one_line_error, tree
from engine_inputs import engine_config

from olmoflow.artifacts import LOCK_FILE
from olmoflow.cli import main
from olmoflow.data.documents import write_documents
from olmoflow.data.engine import DATA_MARKER

WORDS = "river stone tree alpha beta gamma delta lantern harbor meadow quartz violet".split()


def documents(path: Path, n: int = 20) -> Path:
    write_documents(path, [{"id": f"{path.stem}-{i}", "text": " ".join(WORDS[i % 5:] * 3),
                            "source": "web"} for i in range(n)])
    return path


def config(tmp_path: Path, output: Path, source: Path) -> Path:
    cfg = tmp_path / "data.yaml"
    cfg.write_text(f"output: {output}\nexecutor: serial\nsteps: [ingest]\n"
                   f"sources: [{{name: web, paths: ['{source}']}}]\n")
    return cfg


def data_run(cfg: Path, *extra: str) -> int:
    return main(["data", "run", str(cfg), "--no-progress", *extra])


@pytest.fixture
def source(tmp_path) -> Path:
    return documents(tmp_path / "in" / "web.jsonl.gz")


def test_a_source_inside_the_output_is_refused_not_deleted(tmp_path, source, capsys):
    out = tmp_path / "out"
    assert data_run(config(tmp_path, out, source)) == 0
    inside = documents(out / "documents" / "web" / "mine.jsonl.gz")
    capsys.readouterr()
    before = tree(out)
    assert data_run(config(tmp_path, out, inside)) == 2
    err = one_line_error(capsys)
    assert "sources[0] ('web')" in err and "inside the output directory" in err
    assert tree(out) == before


def test_a_non_empty_directory_that_is_not_an_output_is_refused(tmp_path, source, capsys):
    out = tmp_path / "mine"
    documents(out / "documents" / "web" / "00000.jsonl.gz")  # the user's own, same name as ours
    (out / "notes.txt").write_text("mine")
    before = tree(out)
    assert data_run(config(tmp_path, out, source)) == 2
    err = one_line_error(capsys)
    assert "data output" in err and DATA_MARKER in err and "new or empty directory" in err
    assert tree(out) == before


def test_an_output_made_before_the_marker_is_adopted(tmp_path, source, capsys):
    out = tmp_path / "out"
    cfg = config(tmp_path, out, source)
    assert data_run(cfg) == 0
    (out / DATA_MARKER).unlink()
    (out / LOCK_FILE).unlink()
    capsys.readouterr()
    assert data_run(cfg) == 0 and "skipped" in capsys.readouterr().out
    assert (out / DATA_MARKER).is_file()
    (out / DATA_MARKER).unlink()
    (out / "notes.txt").write_text("mine")
    before = tree(out)
    assert data_run(cfg, "--force") == 2
    assert "'notes.txt' is not a data engine directory" in one_line_error(capsys)
    assert tree(out) == before


HOLDER = textwrap.dedent("""
    import sys, time
    from olmoflow.artifacts import directory_lock
    with directory_lock(sys.argv[1], command="olmoflow data run other.yaml"):
        print("locked", flush=True)
        time.sleep(60)
""")


def test_a_second_data_run_on_one_output_gets_one_line_naming_the_holder(tmp_path, source,
                                                                         capsys):
    out = tmp_path / "out"
    cfg = config(tmp_path, out, source)
    assert data_run(cfg) == 0
    capsys.readouterr()
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        before = tree(out)
        assert data_run(cfg, "--force") == 2
        err = one_line_error(capsys)
        assert f"pid {proc.pid}" in err and "olmoflow data run other.yaml" in err
        assert tree(out) == before
    finally:
        proc.kill()
        proc.wait()
    assert data_run(cfg, "--force") == 0

def test_output_that_is_a_file_is_a_one_line_error(tmp_path, capsys):
    # `olmoflow data run CFG --output FILE` ended in a FileExistsError traceback.
    from olmoflow.cli import main

    target = tmp_path / "not_a_dir"
    target.write_text("precious")
    for out in (target, target / "sub"):
        assert main(["data", "run", str(engine_config(tmp_path)), "--output", str(out),
                     "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("olmoflow: error: ") and "\n" not in err and str(target) in err
    assert target.read_text() == "precious"
