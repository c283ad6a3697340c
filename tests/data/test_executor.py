"""The shard executor: results in task order, identical outputs for serial / process pool / Ray,
resume after a failure redoes only the unfinished shards, and a job's error reaches the caller."""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
import uuid
from pathlib import Path

import pytest

from olmoflow.artifacts import atomic_open
from olmoflow.data.executor import marker_path, run_shards, sum_stats
from olmoflow.errors import OlmoflowError


def reverse_job(task: dict) -> dict:
    """A real shard job: reverse every line of the input into a gzipped output, count calls."""
    calls = Path(task["calls"])
    calls.mkdir(parents=True, exist_ok=True)
    (calls / f"{Path(task['input']).name}.{uuid.uuid4().hex}").touch()
    if Path(task["poison"]).exists() and task["input"].endswith("3.txt"):
        raise OlmoflowError(f"{task['input']}: poisoned")
    lines = Path(task["input"]).read_text().splitlines()
    kept = [ln[::-1] for ln in lines if "drop" not in ln]
    with atomic_open(task["output"], "wb") as raw, \
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        gz.write("".join(k + "\n" for k in kept).encode())
    dropped = [ln for ln in lines if "drop" in ln]
    return {"documents_in": len(lines), "documents_out": len(kept), "pid": os.getpid(),
            "removed": {"drop": {"documents": len(dropped),
                                 "bytes": sum(len(d.encode()) for d in dropped)}},
            "outputs": [task["output"]]}


def make_tasks(tmp: Path, n: int = 6) -> list[dict]:
    inp = tmp / "in"
    inp.mkdir(parents=True, exist_ok=True)
    tasks = []
    for i in range(n):
        f = inp / f"shard{i}.txt"
        f.write_text("".join(f"line {i} {j} {'drop' if j % 3 == 0 else 'keep'}\n"
                             for j in range(10 + i)))
        tasks.append({"input": str(f), "output": str(tmp / "out" / f"shard{i}.jsonl.gz"),
                      "calls": str(tmp / "calls"), "poison": str(tmp / "POISON")})
    return tasks


def digest(tmp: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((tmp / "out").glob("*.gz"))}


def strip(results):
    return [{k: v for k, v in r.items() if k not in ("pid", "outputs")} for r in results]


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray", reason="ray not installed (pip install 'olmoflow[ray]')")
    from ray import cloudpickle

    # The job lives in this test module, which Ray workers cannot import by name.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    except Exception as e:  # noqa: BLE001 - any failure to start means "cannot test Ray here"
        pytest.skip(f"a local Ray instance cannot start here: {e}")
    yield ray
    ray.shutdown()


def test_local_pool_matches_serial_and_keeps_task_order(tmp_path):
    serial = run_shards(reverse_job, make_tasks(tmp_path / "a"), executor="serial")
    pooled = run_shards(reverse_job, make_tasks(tmp_path / "b"), executor="local", workers=2)
    assert strip(serial) == strip(pooled)
    assert [r["documents_in"] for r in pooled] == [10 + i for i in range(6)]
    assert os.getpid() not in {r["pid"] for r in pooled}  # the jobs ran in worker processes
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    total = sum_stats(pooled)
    assert total["documents_in"] == total["documents_out"] + total["removed"]["drop"]["documents"]


def test_resume_redoes_only_unfinished_shards(tmp_path):
    tasks = make_tasks(tmp_path)
    (tmp_path / "POISON").touch()
    done = tmp_path / "done"
    with pytest.raises(OlmoflowError, match="poisoned"):
        run_shards(reverse_job, tasks, executor="local", workers=2, done_dir=done)
    finished = [t for t in tasks if marker_path(done, t).exists()]
    assert tasks[3] not in finished and not Path(tasks[3]["output"]).exists()
    # A shard whose output vanished since it was marked done must be redone, too.
    Path(finished[0]["output"]).unlink()
    (tmp_path / "POISON").unlink()
    calls = tmp_path / "calls"
    for f in calls.iterdir():
        f.unlink()
    results = run_shards(reverse_job, tasks, executor="local", workers=2, done_dir=done)
    redone = sorted(f.name.split(".")[0] for f in calls.iterdir())
    expect = sorted(Path(t["input"]).stem for t in tasks
                    if t not in finished or t is finished[0])
    assert redone == expect
    assert all(Path(t["output"]).exists() for t in tasks)
    ref = run_shards(reverse_job, make_tasks(tmp_path / "ref"), executor="serial")
    assert strip(results) == strip(ref)
    assert digest(tmp_path) == digest(tmp_path / "ref")
    # A third run does nothing at all.
    for f in calls.iterdir():
        f.unlink()
    run_shards(reverse_job, tasks, executor="local", workers=2, done_dir=done)
    assert not list(calls.iterdir())
    # An input rewritten since its shard was done makes that shard (only) run again.
    Path(tasks[4]["input"]).write_text("changed line keep\n")
    results = run_shards(reverse_job, tasks, executor="local", workers=2, done_dir=done)
    assert [f.name.split(".")[0] for f in calls.iterdir()] == ["shard4"]
    assert results[4]["documents_in"] == 1


def test_bad_arguments_are_user_errors(tmp_path):
    with pytest.raises(OlmoflowError, match="did you mean 'local'"):
        run_shards(reverse_job, [], executor="locl")
    with pytest.raises(OlmoflowError, match="workers"):
        run_shards(reverse_job, [], workers=0)


def test_ray_matches_local(tmp_path, ray_local):
    local = run_shards(reverse_job, make_tasks(tmp_path / "a"), executor="local", workers=2)
    tasks = make_tasks(tmp_path / "b")
    (tmp_path / "b" / "POISON").touch()
    with pytest.raises(OlmoflowError, match="poisoned"):
        run_shards(reverse_job, tasks, executor="ray", done_dir=tmp_path / "done")
    (tmp_path / "b" / "POISON").unlink()
    remote = run_shards(reverse_job, tasks, executor="ray", done_dir=tmp_path / "done")
    assert strip(local) == strip(remote)
    assert digest(tmp_path / "a") == digest(tmp_path / "b")

DRIVER = textwrap.dedent("""
    import sys, time
    from olmoflow.data.executor import _pool
    pool = _pool(2)
    futures = [pool.submit(time.sleep, 600) for _ in range(2)]
    time.sleep(0.5)
    print(" ".join(str(p) for p in pool._processes), flush=True)
    time.sleep(600)
""")


@pytest.mark.skipif(sys.platform != "linux", reason="process checks use /proc")
def test_killing_the_driver_ends_its_pool_workers(tmp_path):
    # kill -9 of `olmoflow data run` (or the OOM killer) left the forkserver and every pool worker
    # running for good, each holding its memory, blocked on a queue nobody would write to again.
    proc = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True,
                            env={**os.environ,
                                 "PYTHONPATH": str(Path(__file__).parents[2] / "src")})
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 2 and all(Path(f"/proc/{p}").exists() for p in workers)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in workers):
        time.sleep(0.1)
    alive = [p for p in workers if Path(f"/proc/{p}").exists()]
    for p in alive:  # do not leave them behind if the test fails
        os.kill(p, signal.SIGKILL)
    assert not alive


# --- Ray: a local instance listens on the loopback address only -----------------------------------


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
