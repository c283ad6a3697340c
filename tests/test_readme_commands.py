"""The commands README.md and docs/launch.md show, run as a user would (tiny settings, temp dirs).

Each test states that what the docs print or promise is what the command does: the documented
error line, the documented memory tables, and a whole flow under ``torchrun`` (the README's
scale-out line) ending with the same evaluation as one process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tolerance import forward_terms, fp32_rel

from olmoflow.pipeline.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _olmoflow(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "olmoflow", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_readme_error_example_is_what_the_cli_prints():
    """README's "Bad input" block: the exact command gives the exact line and exit status 2."""
    block = re.search(r"```\n\$ (olmoflow [^\n]+)\n(olmoflow: error: [^\n]+)\n```",
                      (ROOT / "README.md").read_text())
    assert block, "README lost its bad-input example"
    command, expected = block.groups()
    proc = _olmoflow(*command.split()[1:])
    assert proc.returncode == 2
    assert proc.stderr.strip() == expected
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("preset,gpus", [("olmo3_7b", 64), ("olmo3_32b", 128)])
def test_launch_md_memory_tables_match_olmoflow_plan(preset, gpus):
    """docs/launch.md's plan tables are exactly what `olmoflow plan PRESET --gpus N` prints."""
    doc = (ROOT / "docs" / "launch.md").read_text()
    tables = {int(m.group(1)): m.group(0).strip()
              for m in re.finditer(r"memory plan: (\d+) GPU\(s\).*?(?=```)", doc, re.S)}
    assert gpus in tables, f"docs/launch.md has no plan for {gpus} GPUs"
    proc = _olmoflow("plan", preset, "--gpus", str(gpus))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == tables[gpus]


def test_whole_flow_under_torchrun_matches_one_process(tmp_path):
    """`torchrun --nproc_per_node=2 -m olmoflow run tiny train.parallel.data_parallel=fsdp`
    finishes.

    Regression: evaluate/generate/release run on rank 0 alone while rank 1 waits; loading the
    checkpoint with a collective ``dcp.load`` deadlocked there. The two-process run must also give
    the one-process held-out loss and generated text.
    """
    args = ["run", "tiny", "train.parallel.data_parallel=fsdp", "train.max_steps=3",
            "train.checkpoint.save_interval=3", "--no-progress"]
    one = _olmoflow(*args, "--run-dir", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-2000:]
    # On a hang, SIGTERM to torchrun makes it stop its workers (each in a session of its own, which
    # a process-group kill would miss; they would wait an hour at a barrier). Output goes to a
    # file so that no pipe held by a worker can block the test.
    log = tmp_path / "torchrun.log"
    with open(log, "w") as out:
        two = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
             "-m", "olmoflow", *args, "--run-dir", str(tmp_path / "two")],
            cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT, text=True)
        try:
            two.wait(timeout=60)
        except subprocess.TimeoutExpired:
            two.send_signal(signal.SIGTERM)
            try:
                two.wait(timeout=30)
            except subprocess.TimeoutExpired:
                two.kill()
            pytest.fail("torchrun run tiny hung (a rank-0-only stage waiting on a collective?)")
    err = log.read_text()
    assert two.returncode == 0, err[-2000:]
    reports = [json.loads((tmp_path / d / "eval" / "report.json").read_text())
               for d in ("one", "two")]
    # The held-out loss of weights that 3 FSDP steps made, each summing the same fp32 terms as one
    # process in another order: two ulps per accumulated term of a step (tolerance.py), as for
    # the gradients that moved the weights.
    tiny = load_config("tiny")
    model = dataclasses.replace(tiny.model, vocab_size=tiny.tokenizer.vocab_size)
    seq = tiny.train.sequence_length
    rel = fp32_rel(forward_terms(model, seq, tokens=tiny.train.global_batch_size * seq), 2)
    assert reports[1]["loss"] == pytest.approx(reports[0]["loss"], rel=rel, abs=0)
    samples = [(tmp_path / d / "generate" / "samples.jsonl").read_text() for d in ("one", "two")]
    assert samples[0] == samples[1]
    assert (tmp_path / "two" / "release" / "model.safetensors").is_file()
