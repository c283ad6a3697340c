"""The golden-loss guard (torchtitan's way of guarding refactors).

``olmoflow run tiny`` on the running Python's standard library, one thread, through the command
line exactly as a user runs it: every step's loss and grad norm, the held-out BPB and the sha256
of the released ``model.safetensors`` must equal ``tests/assets/golden_tiny.json``.

On the machine setup the file was recorded on (same CPU model, Python, torch and thread count)
the comparison is bit-exact: a refactor that changes one rounding anywhere fails it. Elsewhere
kernels differ between CPU models, so the losses are compared with a relative tolerance and the
weight hash is not compared. A different Python has a different standard library, hence another
corpus: the test skips there.

To record the file again (only when a change is meant to change the numbers, and say so in the
commit): ``OLMOFLOW_WRITE_GOLDEN=1 pytest tests/e2e/test_golden.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "golden_tiny.json"
ARGS = ["run", "tiny", "train.log_interval=1", "train.num_threads=1", "--no-progress"]
# Across CPU models: fp32 kernels that sum in another order drift by ulps per step; over 30 steps
# of a 2-layer model that stays far below this.
RTOL = 2e-3

pytestmark = pytest.mark.slow


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_setup() -> dict[str, str]:
    """What must match for bit-exact numbers: CPU model, architecture, Python and torch."""
    return {"cpu": _cpu_model(), "machine": platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__}


def run_tiny(run_dir: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "olmoflow", *ARGS, "--run-dir", str(run_dir)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(ln)
            for ln in (run_dir / "pretrain" / "metrics.jsonl").read_text().splitlines()
            if ln.strip()]
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    weights = (run_dir / "release" / "model.safetensors").read_bytes()
    return {
        "setup": machine_setup(),
        "steps": [{"step": r["step"], "loss": r["loss"], "grad_norm": r["grad_norm"]}
                  for r in rows],
        "bpb": report["bpb"],
        "model_safetensors_sha256": hashlib.sha256(weights).hexdigest(),
    }


def test_tiny_run_matches_golden_losses(tmp_path):
    got = run_tiny(tmp_path / "run")
    if os.environ.get("OLMOFLOW_WRITE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
        pytest.skip(f"recorded {GOLDEN}")
    want = json.loads(GOLDEN.read_text())
    if want["setup"]["python"] != got["setup"]["python"]:
        pytest.skip(f"golden losses were recorded on Python {want['setup']['python']}; the "
                    f"standard-library corpus of Python {got['setup']['python']} differs")
    assert [s["step"] for s in got["steps"]] == [s["step"] for s in want["steps"]]
    if got["setup"] == want["setup"]:
        assert got["steps"] == want["steps"]  # bit-exact, to full float64 repr
        assert got["bpb"] == want["bpb"]
        assert got["model_safetensors_sha256"] == want["model_safetensors_sha256"]
    else:
        for g, w in zip(got["steps"], want["steps"]):
            assert g["loss"] == pytest.approx(w["loss"], rel=RTOL), g["step"]
            assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=20 * RTOL), g["step"]
        assert got["bpb"] == pytest.approx(want["bpb"], rel=RTOL)
