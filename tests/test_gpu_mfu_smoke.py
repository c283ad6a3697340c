"""benchmarks/gpu_mfu.py: its CPU smoke mode prints the MFU table and the GPU preview, a run
without a GPU stops with one line, and the peak table picks the right part."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_mfu.py"


def run_script(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                          timeout=120)


def load_module(monkeypatch):
    """The script as a module; the sys.path entry it adds (benchmarks/) goes when the test ends."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("gpu_mfu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_smoke_prints_table_preview_and_mfu_line():
    r = run_script("--smoke", "--steps", "2", "--warmup", "1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("| config"))
    for col in ("tokens/s", "step ms", "MFU %", "peak mem GB"):
        assert col in lines[header]
    row = [c.strip() for c in lines[header + 2].strip("|").split("|")]
    assert row[0] == "smoke fp32 sdpa eager (cpu)", row
    tokens_s, step_ms, mfu, mem = map(float, row[1:])
    assert tokens_s > 0 and step_ms > 0 and 0 < mfu < 100 and mem > 0, row
    # tokens/s is the batch (4 x 64 tokens) over the median step
    assert tokens_s == pytest.approx(4 * 64 / (step_ms / 1e3), rel=0.01), row
    out = r.stdout
    assert "olmo2_1b" in out and "1,484,916,736 parameters" in out  # the GPU run's model
    assert "train FLOPs/token: 9.287 G at sequence length 4096" in out
    assert re.search(r"H100 80 GB: micro-batch \d+ x 4096 tokens", out)
    assert re.search(r"memory plan \d+\.\d GB", out)
    m = re.fullmatch(r"MFU = (\d+\.\d+)% \(.*45% target.*\)", lines[-1])
    assert m and float(m.group(1)) == pytest.approx(mfu, abs=0.006), lines[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run on a machine with no GPU")
def test_without_gpu_exits_2_with_one_line(monkeypatch, capsys):
    mod = load_module(monkeypatch)  # in-process: one subprocess (the smoke run) is enough
    monkeypatch.setattr(sys, "argv", [str(SCRIPT)])
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exc:
        mod.main()
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0] and "--smoke" in lines[0], err
    assert out == ""


def test_known_peak_matches_whole_part_names(monkeypatch):
    mod = load_module(monkeypatch)
    assert mod.known_peak("NVIDIA H100 80GB HBM3") == ("H100", 989e12)
    assert mod.known_peak("NVIDIA H100 PCIe") == ("H100 PCIe", 756e12)
    assert mod.known_peak("NVIDIA H200") == ("H200", 989e12)
    assert mod.known_peak("NVIDIA A100-SXM4-80GB") == ("A100", 312e12)
    assert mod.known_peak("NVIDIA L40S") == ("L40S", 362e12)
    assert mod.known_peak("NVIDIA L40") is None  # not the L4's nor the L40S's figure
    assert mod.known_peak("NVIDIA H20") is None  # not the H200's
