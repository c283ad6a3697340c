"""Out-of-range generation settings in a release, seen the same by every reader (``chat``,
``serve``, ``eval run``, ``generate``): a one-line error naming the file and the field, or, for a
value that is safely ignored, a one-line warning. They used to start without a word."""

from __future__ import annotations

import io
import json
import logging
import shutil

import pytest
from checks import scripted_input
from saved_models import saved_run

from olmoflow.cli import main
from olmoflow.infer.chat import chat_main

# (file, field (None: the whole file), value, the error's fragment or None for a warning)
CASES = {
    "eos out of the vocabulary": ("config.json", "eos_token_id", 99999999, "eos_token_id=99999999"),
    "max_new_tokens not a number": ("generation_config.json", "max_new_tokens", "many",
                                    "max_new_tokens='many'"),
    # the release says do_sample: false, so transformers ignores its temperature: so do we
    "negative temperature, greedy": ("generation_config.json", "temperature", -1, None),
    "tokenizer config a list": ("tokenizer_config.json", None, ["eos_token", "<|endoftext|>"],
                                "expected a JSON object"),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return saved_run(tmp_path_factory.mktemp("settings") / "run")


def damage(directory, file, field, value):
    path = directory / file
    if field is None:
        path.write_text(json.dumps(value))
        return path
    obj = json.loads(path.read_text())
    obj[field] = value
    path.write_text(json.dumps(obj))
    return path


@pytest.fixture(params=list(CASES))
def case(request, run, tmp_path):
    """``(release copy with one file damaged, the damaged file, field, error fragment)``."""
    file, field, value, fragment = CASES[request.param]
    release = tmp_path / "release"
    shutil.copytree(run.release, release)
    return release, damage(release, file, field, value), field, fragment


def check(rc, err, caplog, path, field, fragment, *, ok_rc=0):
    """A one-line error naming ``path`` and ``fragment``; or, for a warning case (``fragment``
    None), exit ``ok_rc`` and one warning naming the file and the field."""
    if fragment is not None:
        assert rc == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert str(path) in lines[0] and fragment in lines[0], lines[0]
        return
    assert rc == ok_rc, err
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
            and str(path) in r.getMessage()]
    assert len(said) == 1 and f"{field}=" in said[0] and "ignored" in said[0], said
    assert "\n" not in said[0]


def test_chat(case, caplog):
    release, path, field, fragment = case
    err = io.StringIO()
    rc = chat_main([str(release), "--device", "cpu"], input_fn=scripted_input([]),
                   output=io.StringIO(), errors=err)
    check(rc, err.getvalue(), caplog, path, field, fragment)


def test_serve(case, caplog, capsys):
    release, path, field, fragment = case
    # A context past the model's positions is refused once the model is loaded: the command
    # ends there instead of serving (every check of the files has run by then).
    rc = main(["serve", str(release), "--port", "0", "--device", "cpu",
               "--max-context", "100000"])
    err = capsys.readouterr().err
    if fragment is None:
        assert "--max-context 100000" in err
    check(rc, err, caplog, path, field, fragment, ok_rc=2)


def test_eval_run(case, caplog, capsys):
    release, path, field, fragment = case
    rc = main(["eval", "run", "--model", str(release), "--tasks", "copy_string", "--limit", "1"])
    err = capsys.readouterr().err
    check(rc, "\n".join(x for x in err.splitlines() if not x.startswith("WARNING:")), caplog,
          path, field, fragment)


def test_generate_reads_the_runs_tokenizer_config(run, tmp_path, capsys):
    """``generate`` reads the run's checkpoint: of the files above only the tokenizer's applies
    (a checkpoint carries no config.json or generation_config.json)."""
    copy = tmp_path / "run"
    shutil.copytree(run.root, copy)
    path = damage(copy / "tokenizer", "tokenizer_config.json", None, ["x"])
    rc = main(["generate", str(copy), "--prompt", "def", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "expected a JSON object" in lines[0], err
