"""Every manifest records the machine setup its numbers depend on: CPU model, GPUs (with CUDA),
torch's and numpy's math libraries, next to the library versions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from olmoflow import artifacts
from olmoflow.artifacts import cpu_model, environment, write_manifest


@pytest.fixture
def fresh_machine_record():
    """environment() reads the machine once per process: start and end each test unread."""
    artifacts._machine.cache_clear()
    yield
    artifacts._machine.cache_clear()


def test_environment_names_cpu_and_math_libraries(fresh_machine_record):
    env = environment()
    assert env["cpu"] == cpu_model() and env["cpu"] != ""
    assert env["cpu_count"].isdigit()
    assert env["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    config = torch.__config__.show()
    assert f"BLAS_INFO={env['torch_blas']}" in config
    assert f"LAPACK_INFO={env['torch_lapack']}" in config
    for lib in env["torch_math_libraries"].split("; "):
        assert lib in config
    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    assert env["numpy_blas"].startswith(blas["name"]) and "numpy_lapack" in env
    # The library versions are still there, and every value is one line (environment.txt).
    assert env["torch"] == torch.__version__ and env["numpy"] == np.__version__
    assert all(isinstance(v, str) and "\n" not in v for v in env.values())
    assert environment() == env  # deterministic within a process


def test_thread_variables_are_recorded_when_set(fresh_machine_record, monkeypatch):
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    env = environment()
    assert env["omp_num_threads"] == "3" and "mkl_num_threads" not in env


def test_gpu_model_recorded_when_cuda_is_there(fresh_machine_record, monkeypatch):
    names = ["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"]
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: names[i])
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    env = environment()
    assert env["gpu"] == "; ".join(names)
    assert env["torch_cuda"] == "12.8" and env["torch_cudnn"] == "91000"


def test_no_gpu_fields_without_cuda(fresh_machine_record, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not {"gpu", "torch_cuda", "torch_cudnn"} & set(environment())


@pytest.mark.parametrize("text, want", [
    ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R)  Gold 6338\n"
     "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Gold 6338\n", "Intel(R) Xeon(R) Gold 6338"),
    ("processor\t: 0\nBogoMIPS\t: 50.00\nHardware\t: BCM2835\n", "BCM2835"),
])
def test_cpu_model_from_cpuinfo(tmp_path, text, want):
    (tmp_path / "cpuinfo").write_text(text)
    assert cpu_model(str(tmp_path / "cpuinfo")) == want


def test_cpu_model_without_cpuinfo_is_never_empty(tmp_path):
    assert cpu_model(str(tmp_path / "absent"))


def test_manifest_records_the_machine(tmp_path, fresh_machine_record):
    out = tmp_path / "stage"
    out.mkdir()
    (out / "a.txt").write_text("x")
    m = write_manifest(out, stage="s", command="c", config={}, fingerprint="f", inputs=[],
                       outputs=[out / "a.txt"], counts={}, started=artifacts.now())
    assert artifacts.read_manifest(out)["environment"] == m["environment"] == environment()
    assert {"cpu", "cpu_count", "torch_blas", "torch_cpu_capability", "numpy_blas"} <= set(
        m["environment"])
