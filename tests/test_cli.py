"""The ``olmoflow`` command in-process: bad input is one line on stderr and exit status 2 (never a
traceback), malformed data is skipped and counted (or named, with --strict), and reruns skip
complete stages but redo stages whose inputs changed or whose outputs were damaged on disk.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fuzzing import ROOT, mutated_data_file, mutated_yaml, rng_for, write_tiny_release

from olmoflow.cli import main


def doc_text(i: int) -> str:
    return (f"Document number {i} talks about the weather, the sea and the ships of the "
            "harbour. ") * 2


def write_jsonl(path: Path, rows: list, gz: bool = False) -> Path:
    data = "".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, *fragments: str) -> str:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    line = lines[0]
    assert line.startswith("olmoflow: error: "), line
    assert "Traceback" not in err
    for f in fragments:
        assert f in line, f"{f!r} not in {line!r}"
    return line


def manifest(run_dir: Path, stage_dir: str) -> dict:
    return json.loads((run_dir / stage_dir / "manifest.json").read_text())


def status_line(out: str, stage: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith(f"[{stage}] ")]
    assert len(lines) == 1, out
    return lines[0]


@pytest.fixture
def corpus(tmp_path) -> Path:
    """A small JSONL corpus of distinct documents."""
    return write_jsonl(tmp_path / "corpus.jsonl", [{"text": doc_text(i)} for i in range(8)])


# --- bad input: one line, exit 2 ---------------------------------------------------------------


def test_missing_data_path(tmp_path, capsys):
    missing = tmp_path / "nope" / "missing.jsonl"
    rc, _, err = cli(capsys, "collect", "tiny", "--data", str(missing), "--run-dir",
                     str(tmp_path / "run"), "--no-progress")
    assert_one_line_error(rc, err, str(missing), "no such file")


def test_unknown_config_key_names_the_closest(tmp_path, capsys):
    rc, _, err = cli(capsys, "collect", "tiny", "train.max_step=5", "--run-dir",
                     str(tmp_path / "run"), "--no-progress")
    assert_one_line_error(rc, err, "'train.max_step'", "'train.max_steps'")
    assert not (tmp_path / "run").exists(), "nothing runs on a bad config"


def test_unknown_section_and_wrong_type(tmp_path, capsys):
    rc, _, err = cli(capsys, "collect", "tiny", "trian.max_steps=5", "--run-dir",
                     str(tmp_path / "run"), "--no-progress")
    assert_one_line_error(rc, err, "trian", "train.max_steps")
    rc, _, err = cli(capsys, "collect", "tiny", "train.max_steps=lots", "--run-dir",
                     str(tmp_path / "run"), "--no-progress")
    assert_one_line_error(rc, err, "train.max_steps", "lots")


def test_unknown_preset(tmp_path, capsys):
    rc, _, err = cli(capsys, "collect", "tinyy", "--run-dir", str(tmp_path / "run"),
                     "--no-progress")
    assert_one_line_error(rc, err, "'tinyy'", "'tiny'")


def test_invalid_yaml_config_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  max_steps: [1,\n")
    rc, _, err = cli(capsys, "collect", str(bad), "--run-dir", str(tmp_path / "run"),
                     "--no-progress")
    assert_one_line_error(rc, err, str(bad), "invalid YAML")


def test_strict_malformed_line_names_file_and_line(tmp_path, capsys):
    data = write_jsonl(tmp_path / "a.jsonl", [{"text": doc_text(0)}, '{"text": "cut off\n',
                                              {"text": doc_text(1)}])
    rc, _, err = cli(capsys, "collect", "tiny", "--strict", "--data", str(data), "--run-dir",
                     str(tmp_path / "run"), "--no-progress")
    assert_one_line_error(rc, err, f"{data}:2", "malformed")
    assert not (tmp_path / "run" / "collect" / "manifest.json").exists()


def test_non_strict_malformed_lines_are_skipped_and_counted(tmp_path, capsys):
    data = write_jsonl(tmp_path / "a.jsonl", [
        {"text": doc_text(0)}, "{not json\n", {"text": doc_text(1)}, '["a list"]\n',
        {"no_text": 1}, {"text": doc_text(2)},
    ])
    run = tmp_path / "run"
    rc, out, err = cli(capsys, "collect", "tiny", "--data", str(data), "--run-dir", str(run),
                       "--no-progress")
    assert rc == 0, err
    counts = manifest(run, "collect")["counts"]
    assert counts["documents"] == 3
    assert counts["skipped_malformed"] == 3
    assert "skipped_malformed=3" in status_line(out, "collect")


def test_truncated_gzip_keeps_the_whole_members_before_the_damage(tmp_path, capsys):
    # Four gzip members of 50 documents, cut inside the third: a member is emitted only once its
    # CRC has been checked, so the first two members' documents survive, intact, and no document
    # of the cut member does.
    rows = [{"id": str(i), "text": doc_text(i) + os.urandom(200).hex()} for i in range(200)]
    members = [gzip.compress("".join(json.dumps(r) + "\n" for r in rows[k:k + 50]).encode())
               for k in range(0, 200, 50)]
    cut = len(members[0]) + len(members[1]) + len(members[2]) // 2
    src = tmp_path / "data"
    src.mkdir()
    (src / "damaged.jsonl.gz").write_bytes(b"".join(members)[:cut])
    write_jsonl(src / "fine.jsonl", [{"text": doc_text(1000)}])
    run = tmp_path / "run"
    rc, out, err = cli(capsys, "collect", "tiny", "collect.max_documents=null", "--data",
                       str(src), "--run-dir", str(run), "--no-progress")
    assert rc == 0, err
    counts = manifest(run, "collect")["counts"]
    assert counts["damaged_files"] == 1
    assert counts["documents"] == 100 + 1  # two whole members, and fine.jsonl
    assert "damaged_files=1" in status_line(out, "collect")
    with gzip.open(run / "collect" / "documents.jsonl.gz", "rt") as f:
        texts = [json.loads(line)["text"] for line in f]
    assert texts[:100] == [r["text"] for r in rows[:100]], "the members before the damage, intact"
    assert texts[-1] == doc_text(1000)


def test_truncated_gzip_with_strict_is_an_error(tmp_path, capsys):
    lines = (json.dumps({"text": doc_text(i) + os.urandom(100).hex()}).encode() + b"\n"
             for i in range(100))
    whole = gzip.compress(b"".join(lines))
    data = tmp_path / "damaged.jsonl.gz"
    data.write_bytes(whole[: len(whole) // 2])
    rc, _, err = cli(capsys, "collect", "tiny", "--strict", "--data", str(data), "--run-dir",
                     str(tmp_path / "run"), "--no-progress")
    assert_one_line_error(rc, err, str(data))


def test_corpus_empty_after_cleaning(tmp_path, capsys, corpus):
    run = tmp_path / "run"
    rc, out, err = cli(capsys, "run", "tiny", "clean.min_chars=100000", "--data", str(corpus),
                       "--run-dir", str(run), "--no-progress")
    line = assert_one_line_error(rc, err, "empty after cleaning", "min_chars")
    assert "8 too short" in line
    assert "[collect] ran" in out
    assert not (run / "clean" / "manifest.json").exists()
    assert not (run / "tokenizer").exists(), "the flow stops at the failing stage"


def test_stage_before_its_upstream_names_the_missing_stage(tmp_path, capsys):
    rc, _, err = cli(capsys, "clean", "tiny", "--run-dir", str(tmp_path / "run"), "--no-progress")
    assert_one_line_error(rc, err, "olmoflow collect")


def test_overrides_may_follow_options(tmp_path, capsys, corpus):
    run = tmp_path / "run"
    rc, _, err = cli(capsys, "collect", "tiny", "--data", str(corpus), "--run-dir", str(run),
                     "--no-progress", "collect.max_documents=3")
    assert rc == 0, err
    assert manifest(run, "collect")["counts"]["documents"] == 3


# --- reruns ---------------------------------------------------------------------------------------


def test_rerun_skips_complete_stages(tmp_path, capsys, corpus):
    run = tmp_path / "run"
    args = ("tiny", "--data", str(corpus), "--run-dir", str(run), "--no-progress")
    rc, out, _ = cli(capsys, "collect", *args)
    assert rc == 0 and status_line(out, "collect").startswith("[collect] ran")
    first = manifest(run, "collect")
    rc, out, _ = cli(capsys, "collect", *args)
    assert rc == 0 and status_line(out, "collect").startswith("[collect] skipped")
    assert manifest(run, "collect") == first, "a skipped stage leaves its manifest alone"
    rc, out, _ = cli(capsys, "collect", "--force", *args)
    assert rc == 0 and status_line(out, "collect").startswith("[collect] ran")


def test_changed_input_content_reruns_collect(tmp_path, capsys, corpus):
    run = tmp_path / "run"
    args = ("tiny", "--data", str(corpus), "--run-dir", str(run), "--no-progress")
    assert cli(capsys, "collect", *args)[0] == 0
    write_jsonl(corpus, [{"text": doc_text(i)} for i in range(9)])
    rc, out, _ = cli(capsys, "collect", *args)
    assert rc == 0 and status_line(out, "collect").startswith("[collect] ran")
    assert manifest(run, "collect")["counts"]["documents"] == 9
    rc, out, _ = cli(capsys, "collect", *args)
    assert status_line(out, "collect").startswith("[collect] skipped")


def test_same_size_edit_reruns_collect(tmp_path, capsys, corpus):
    run = tmp_path / "run"
    args = ("tiny", "--data", str(corpus), "--run-dir", str(run), "--no-progress")
    assert cli(capsys, "collect", *args)[0] == 0
    data = corpus.read_bytes()
    corpus.write_bytes(data.replace(b"weather", b"WEATHER"))  # same size, new content
    rc, out, _ = cli(capsys, "collect", *args)
    assert rc == 0 and status_line(out, "collect").startswith("[collect] ran")
    with gzip.open(run / "collect" / "documents.jsonl.gz", "rt") as f:
        assert "WEATHER" in f.read()


def test_same_size_edit_with_preserved_mtime_reruns_collect(tmp_path, capsys, corpus):
    run = tmp_path / "run"
    args = ("tiny", "--data", str(corpus), "--run-dir", str(run), "--no-progress")
    assert cli(capsys, "collect", *args)[0] == 0
    st = corpus.stat()
    corpus.write_bytes(corpus.read_bytes().replace(b"weather", b"WEATHER"))
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns))
    rc, out, _ = cli(capsys, "collect", *args)
    assert status_line(out, "collect").startswith("[collect] ran")


def test_damaged_stage_output_makes_the_stage_rerun(tmp_path, capsys, corpus):
    run = tmp_path / "run"
    args = ("tiny", "--data", str(corpus), "--run-dir", str(run), "--no-progress")
    for verb in ("collect", "clean"):
        assert cli(capsys, verb, *args)[0] == 0
    docs = run / "collect" / "documents.jsonl.gz"
    good = docs.read_bytes()

    docs.write_bytes(good[: len(good) // 2])  # truncated
    rc, out, _ = cli(capsys, "collect", *args)
    assert rc == 0 and status_line(out, "collect").startswith("[collect] ran")
    assert docs.read_bytes() == good, "collect is deterministic"
    # The rebuilt output is byte-identical, so the downstream stage is still complete.
    rc, out, _ = cli(capsys, "clean", *args)
    assert status_line(out, "clean").startswith("[clean] skipped")

    flipped = bytearray(good)  # same size, one byte changed
    flipped[len(flipped) // 2] ^= 0xFF
    docs.write_bytes(bytes(flipped))
    rc, out, _ = cli(capsys, "collect", *args)
    assert rc == 0 and status_line(out, "collect").startswith("[collect] ran")
    assert docs.read_bytes() == good

    docs.unlink()  # missing
    rc, out, _ = cli(capsys, "collect", *args)
    assert status_line(out, "collect").startswith("[collect] ran")

    (run / "clean" / "manifest.json").write_text("{ truncated")  # unreadable manifest
    rc, out, _ = cli(capsys, "clean", *args)
    assert rc == 0 and status_line(out, "clean").startswith("[clean] ran")


def test_changed_config_reruns_only_affected_stages(tmp_path, capsys, corpus):
    run = tmp_path / "run"
    args = ("--data", str(corpus), "--run-dir", str(run), "--no-progress")
    for verb in ("collect", "clean"):
        assert cli(capsys, verb, "tiny", *args)[0] == 0
    rc, out, _ = cli(capsys, "clean", "tiny", "clean.min_chars=40", *args)
    assert rc == 0 and status_line(out, "clean").startswith("[clean] ran")
    rc, out, _ = cli(capsys, "collect", "tiny", "clean.min_chars=40", *args)
    assert status_line(out, "collect").startswith("[collect] skipped")


# --- bad input a new user tried: one line and exit 2, or the right thing --------------------------


FAST = ("--no-progress", "train.max_steps=4", "train.checkpoint.save_interval=2",
        "train.num_threads=1")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One tiny trained run shared by the generate/latest checks."""
    tmp = tmp_path_factory.mktemp("qa")
    corpus = write_jsonl(tmp / "c.jsonl", [{"text": doc_text(i) * 4} for i in range(40)])
    from olmoflow.cli import main

    assert main(["run", "tiny", "--data", str(corpus), "--run-dir", str(tmp / "run"), *FAST]) == 0
    return tmp / "run"


@pytest.mark.parametrize("override, fragment", [
    ("train.max_steps=-1", "train.max_steps must be >= 1"),
    ("train.micro_batch_size=3", "not a multiple of train.micro_batch_size"),
    ("train.sequence_length=512", "exceeds model.max_sequence_length"),
    ("evaluate.sequence_length=100000", "exceeds model.max_sequence_length"),
    ("train=null", "config section 'train' is empty"),
    ("train.schedule.type=cosin", "did you mean 'cosine'"),
])
def test_config_errors_before_any_stage(tmp_path, capsys, override, fragment):
    rc, _, err = cli(capsys, "run", "tiny", "--run-dir", str(tmp_path / "r"), override,
                     "--no-progress")
    assert_one_line_error(rc, err, fragment)
    assert not (tmp_path / "r" / "collect").exists()  # nothing ran


def test_run_dir_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    rc, _, err = cli(capsys, "run", "tiny", "--run-dir", str(f), "--no-progress")
    assert_one_line_error(rc, err, "is not a directory")


def test_generate_edge_cases(run, capsys):
    rc, out, err = cli(capsys, "generate", "tiny", "--run-dir", str(run), "--prompt", "",
                       "--max-new-tokens", "5", "--no-progress")
    assert rc == 0, err
    rc, out, err = cli(capsys, "generate", "tiny", "--run-dir", str(run), "--prompt", "Hello",
                       "--max-new-tokens", "0", "--no-progress")
    assert rc == 0, err
    sample = json.loads((run / "generate" / "samples.jsonl").read_text().splitlines()[0])
    assert sample == {"prompt": "Hello", "completion": ""}
    assert "Generated text:\n--- prompt: 'Hello'\nHello" in out  # the stage's show hook
    rc, out, err = cli(capsys, "generate", "tiny", "--run-dir", str(run), "--prompt", "a",
                       "--prompt", "b", "--max-new-tokens", "2", "--no-progress")
    assert rc == 0, err
    prompts = [json.loads(ln)["prompt"] for ln in (run / "generate" / "samples.jsonl").open()]
    assert prompts == ["a", "b"] and "--- prompt: 'b'" in out
    rc, _, err = cli(capsys, "generate", "tiny", "--run-dir", str(run), "--prompt", "Hello",
                     "--max-new-tokens", "-5", "--no-progress")
    assert_one_line_error(rc, err, "max_new_tokens must be >= 0")


def test_generate_speculative_prompt_lookup(run, capsys):
    """generate.speculative=prompt_lookup: the greedy samples of plain decoding, the draft counts
    in the manifest and a log line; an unknown drafter is a one-line error."""
    args = ("generate", "tiny", "--run-dir", str(run), "--prompt", "def f(x):\n    return x",
            "--max-new-tokens", "24", "generate.temperature=0")
    rc, _, err = cli(capsys, *args, "--no-progress")
    assert rc == 0, err
    plain = (run / "generate" / "samples.jsonl").read_text()
    rc, out, err = cli(capsys, *args, "--speculative", "prompt_lookup",
                       "generate.num_draft_tokens=4")
    assert rc == 0, err
    assert (run / "generate" / "samples.jsonl").read_text() == plain
    counts = manifest(run, "generate")["counts"]
    assert counts["draft_tokens"] >= counts["accepted_draft_tokens"] >= 0
    assert "[generate] speculative decoding (prompt_lookup): " in out
    rc, _, err = cli(capsys, *args, "generate.speculative=prompt_lokup", "--no-progress")
    assert_one_line_error(rc, err, "did you mean 'prompt_lookup'")


def test_deleted_latest_pointer_is_repaired(run, capsys):
    (run / "pretrain" / "latest").unlink()
    data = ("--data", str(run.parent / "c.jsonl"))  # the fixture's corpus: same fingerprints
    rc, out, err = cli(capsys, "run", "tiny", "--run-dir", str(run), *data, *FAST)
    assert rc == 0, err
    # repaired from step4, not trained again
    assert "[collect] skipped" in out and "[pretrain] resumed" in out
    assert (run / "pretrain" / "latest").read_text().strip() == "stage1-step4-tokens3K"
    rc, _, err = cli(capsys, "evaluate", "tiny", "--run-dir", str(run), "--force", *FAST)
    assert rc == 0, err


def test_failed_first_stage_leaves_no_run_dir(tmp_path, capsys):
    run = tmp_path / "nothing"
    rc, _, err = cli(capsys, "generate", "tiny", "--run-dir", str(run), "--prompt", "hi",
                     "--no-progress")
    assert_one_line_error(rc, err, "run 'olmoflow")
    assert not run.exists()


# --- seeded fuzzing (tests/fuzzing.py): the real exit path, in child processes --------------------


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory) -> Path:
    return write_tiny_release(tmp_path_factory.mktemp("release"))


def test_fuzz_the_real_command(tmp_path, release_dir):
    """A few generated inputs through ``python -m olmoflow``, run side by side: exit 0, or exit 2
    with exactly one error line and no traceback."""
    r = rng_for("subprocess")
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    bad_release = tmp_path / "bad_release"
    shutil.copytree(release_dir, bad_release)
    weights = (bad_release / "model.safetensors").read_bytes()
    (bad_release / "model.safetensors").write_bytes(weights[: r.randrange(8, len(weights) // 2)])
    yaml = tmp_path / "bad.yaml"
    yaml.write_bytes(mutated_yaml(r, (ROOT / "configs" / "tiny.yaml").read_text()) + b"\n1: 2\n")
    commands = [
        ["collect", "--data", str(mutated_data_file(r, inputs, 0)), "--run-dir",
         str(tmp_path / "run"), "--no-progress", "--strict"],
        ["plan", str(yaml), "--gpus", "1"],
        ["export", "hf", str(bad_release), str(tmp_path / "export")],
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "olmoflow", *argv], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv in commands]
    for argv, p in zip(commands, procs):
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            pytest.fail(f"hang: {argv}")
        assert p.returncode in (0, 2), (argv, p.returncode, err)
        assert "Traceback" not in err, (argv, err)
        if p.returncode == 2:
            errors = [ln for ln in err.splitlines() if ln.startswith("olmoflow: error: ")]
            assert len(errors) == 1 and err.strip().endswith(errors[0]), (argv, err)
    assert procs[2].returncode == 2 and not (tmp_path / "export").exists()


def test_run_dir_without_config_reads_the_runs_own_config(tmp_path, capsys):
    """``olmoflow VERB --run-dir DIR`` with no CONFIG on a run made with another preset: the
    run's saved config.yaml, never the demo preset run in its place over the run's record."""
    data = write_jsonl(tmp_path / "docs.jsonl", [{"text": doc_text(i)} for i in range(12)])
    run = tmp_path / "run"
    args = ("--data", str(data), "--run-dir", str(run), "--no-progress")
    rc, _, err = cli(capsys, "collect", "tiny", *args)
    assert rc == 0, err
    saved = (run / "config.yaml").read_text()
    assert "d_model: 64" in saved  # tiny's model, not the demo's
    rc, out, err = cli(capsys, "collect", *args)
    assert rc == 0, err
    assert status_line(out, "collect").startswith("[collect] skipped"), out
    assert (run / "config.yaml").read_text() == saved
    rc, out, err = cli(capsys, "collect", "collect.max_documents=5", *args)
    assert rc == 0, err
    assert "documents=5" in status_line(out, "collect")
    assert "d_model: 64" in (run / "config.yaml").read_text()


def test_a_release_given_as_the_run_is_named(tmp_path, capsys):
    """``olmoflow generate RELEASE``: a release holds a config.yaml too, but it is not a run; the
    error says so and names the run it came from, not "not empty and not olmoflow's"."""
    release = tmp_path / "run" / "release"
    release.mkdir(parents=True)
    for name in ("config.yaml", "config.json", "files.json"):
        (release / name).write_text("{}\n")
    rc, _, err = cli(capsys, "generate", str(release), "--no-progress")
    assert_one_line_error(rc, err, "is a release or model directory, not a run directory",
                          str(tmp_path / "run"))
    assert sorted(p.name for p in release.iterdir()) == ["config.json", "config.yaml",
                                                          "files.json"]
