"""Run a data step's shard jobs in a local process pool, as Ray tasks, or serially, resumably.

A *shard job* is a top-level (picklable) function ``fn(task: dict) -> dict``. ``task`` holds plain
values (paths as ``str``, a config dict); the returned dict holds JSON-able stats, by convention::

    {"documents_in", "documents_out", "bytes_in", "bytes_out",
     "removed": {"<rule>": {"documents": n, "bytes": b}}, "errors": [...],
     "outputs": ["/abs/path/of/each/file/written", ...]}

A job writes its files atomically (:func:`olmoflow.artifacts.atomic_open`), so a file that exists
is complete. After a job returns, the driver writes a *done-marker* into ``done_dir``: the task, the
result, the size and mtime of the files it read (the task's ``input``, ``documents`` and
``attributes`` values) and the size of every output. On a rerun a task is skipped (its stored
result returned) when its marker is present, its inputs are unchanged and every output still
exists with its recorded size; otherwise it runs again.
A crash mid-shard leaves no marker, so a half-written shard is redone and finished ones are not.

Outputs are taken from ``result["outputs"]``, else from ``task["outputs"]`` / ``task["output"]``.
The marker's name is a hash of the task, so a changed config or input makes a fresh task.

Results come back in task order whatever the executor and the number of workers, so a step that
writes one output per task is byte-identical for ``serial``, ``local`` with any ``workers``, and
``ray`` (the same design as Dolma's and datatrove's per-file parallelism).
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from olmoflow.artifacts import atomic_write_json, sha256_file, sha256_json
from olmoflow.errors import OlmoflowError, unknown_name_error

log = logging.getLogger(__name__)

EXECUTORS = ("local", "ray", "serial")
MARKER_SUFFIX = ".done.json"
#: Task keys naming the files a job reads; their size and mtime are checked before a skip.
INPUT_KEYS = ("input", "documents", "attributes")
STAT_KEYS = ("documents_in", "documents_out", "bytes_in", "bytes_out", "tokens")

ShardJob = Callable[[dict[str, Any]], dict[str, Any]]


def plain(value: Any) -> Any:
    """``value`` with every config dataclass in it (a task's :class:`MixConfig`, its
    :class:`SourceOptions`, ...) turned into its fields' mapping (``dataclasses.asdict``), for
    JSON: task keys and done-markers."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def task_key(task: dict[str, Any]) -> str:
    """A stable name for a task: the first 24 hex digits of sha256 of its sorted-key JSON (config
    dataclasses in it as their fields' mappings, :func:`plain`)."""
    return sha256_json(plain(task))[:24]


def _outputs(task: dict[str, Any], result: dict[str, Any]) -> list[str]:
    outs = result.get("outputs")
    if outs is None:
        outs = task.get("outputs")
    if outs is None:
        outs = [task["output"]] if task.get("output") else []
    return [str(o) for o in outs]


def _input_stamps(task: dict[str, Any]) -> list[list[Any]]:
    """``[path, size, sha256]`` of the existing files a task reads (its :data:`INPUT_KEYS`
    values: a path, or a list / dict of paths), so a rewritten input makes a task stale, even one
    rewritten with the same size and modification time (content hashes: one rerun policy for
    both flows)."""
    out = []
    for key in INPUT_KEYS:
        v = task.get(key)
        paths = [v] if isinstance(v, str) else list(v.values()) if isinstance(v, dict) else \
            list(v) if isinstance(v, list) else []
        for p in paths:
            if isinstance(p, str) and os.path.isfile(p):
                out.append([p, os.stat(p).st_size, sha256_file(p)])
    return out


def marker_path(done_dir: Path, task: dict[str, Any]) -> Path:
    """Where the done-marker of ``task`` lives in ``done_dir``."""
    return Path(done_dir) / f"{task_key(task)}{MARKER_SUFFIX}"


def _done_result(done_dir: Path, task: dict[str, Any]) -> dict[str, Any] | None:
    """The stored result of a finished task whose outputs all still exist, else None."""
    try:
        marker = json.loads(marker_path(done_dir, task).read_text())
    except (OSError, ValueError):
        return None
    if marker.get("inputs", []) != _input_stamps(task):
        return None
    for rec in marker.get("outputs", []):
        p = Path(rec["path"])
        if not p.is_file() or p.stat().st_size != rec["bytes"]:
            return None
    return marker.get("result")


def _mark_done(done_dir: Path, task: dict[str, Any], result: dict[str, Any]) -> None:
    outs = []
    for o in _outputs(task, result):
        p = Path(o)
        if not p.is_file():
            raise RuntimeError(f"shard job reported output {p} but did not write it")
        outs.append({"path": o, "bytes": p.stat().st_size})
    atomic_write_json(marker_path(done_dir, task),
                      {"task": plain(task), "result": result, "inputs": _input_stamps(task),
                       "outputs": outs, "finished": time.time()})


def _check_result(task: dict[str, Any], result: Any) -> dict[str, Any]:
    if not isinstance(result, dict):
        raise TypeError(f"shard job returned {type(result).__name__}, not dict, for task {task}")
    return result


def default_workers() -> int:
    """``os.cpu_count()`` (1 when unknown)."""
    return os.cpu_count() or 1


def run_shards(
    fn: ShardJob,
    tasks: Iterable[dict[str, Any]],
    *,
    executor: str = "local",
    workers: int | None = None,
    done_dir: str | os.PathLike | None = None,
    desc: str = "shards",
    ray_address: str | None = None,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Run ``fn(task)`` for every task and return the results in task order.

    Args:
        fn: a top-level shard job (picklable by reference).
        tasks: dicts of plain values and config dataclasses (picklable; hashed, the dataclasses
            as their fields, to name done-markers).
        executor: ``"local"`` (a process pool with the ``forkserver`` start method, safe when torch
            is loaded), ``"ray"`` (Ray tasks, one CPU each) or ``"serial"`` (in this process).
        workers: processes (local) or CPUs for a local Ray instance; default ``os.cpu_count()``.
            With one worker or one pending task, ``local`` runs in this process (same results).
        done_dir: where done-markers go; None disables resuming (every task runs).
        desc: a tag for logs and the progress bar.
        ray_address: a Ray cluster address; default ``$RAY_ADDRESS``, else a local instance.
        progress: show a tqdm bar.

    Returns:
        One result dict per task, in task order (stored results for skipped tasks).

    Raises:
        OlmoflowError: unknown executor, bad ``workers``, or Ray not installed / not reachable;
            and whatever a job raises (the first failure in task order; finished tasks keep their
            markers, so a rerun resumes after the fix).
    """
    tasks = list(tasks)
    if executor not in EXECUTORS:
        raise unknown_name_error("executor", executor, EXECUTORS)
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise OlmoflowError(f"workers must be a positive integer, got {workers!r}")
    workers = workers or default_workers()
    done = Path(done_dir) if done_dir is not None else None

    results: list[dict[str, Any] | None] = [None] * len(tasks)
    pending: list[int] = []
    for i, task in enumerate(tasks):
        stored = _done_result(done, task) if done is not None else None
        if stored is not None:
            results[i] = stored
        else:
            pending.append(i)
    if len(pending) < len(tasks):
        log.info("%s: %d of %d shards already done, skipped", desc, len(tasks) - len(pending),
                 len(tasks))

    def finish(i: int, result: Any) -> None:
        result = _check_result(tasks[i], result)
        if done is not None:
            _mark_done(done, tasks[i], result)
        results[i] = result

    bar = None
    if progress and pending:
        from tqdm import tqdm

        bar = tqdm(total=len(tasks), initial=len(tasks) - len(pending), desc=desc, unit="shard")
    try:
        if executor == "ray":
            _run_ray(fn, tasks, pending, finish, workers, ray_address, bar)
        elif executor == "serial" or workers == 1 or len(pending) <= 1:
            for i in pending:
                finish(i, fn(tasks[i]))
                if bar is not None:
                    bar.update(1)
        else:
            _run_pool(fn, tasks, pending, finish, workers, bar)
    finally:
        if bar is not None:
            bar.close()
    return results  # type: ignore[return-value]


_POOLS: dict[int, cf.ProcessPoolExecutor] = {}


@atexit.register
def _shutdown_pools() -> None:
    # A kept pool left to interpreter teardown has its manager thread's callback run after
    # the modules it needs are gone ("Exception ignored ... weakref_cb"); close it first.
    for pool in _POOLS.values():
        pool.shutdown(wait=True, cancel_futures=True)
    _POOLS.clear()


def _pool(workers: int) -> cf.ProcessPoolExecutor:
    """A process pool of ``workers`` processes, kept for the next step of the same run.

    Workers start from a ``forkserver`` that has imported olmoflow (and so torch) once: a fresh
    spawn per worker and per step would pay that import (seconds) every time, and per-process
    caches (the language-id model, the tokenizer) survive from one step to the next.
    """
    pool = _POOLS.get(workers)
    if pool is not None and not getattr(pool, "_broken", False):
        return pool
    ctx = multiprocessing.get_context("forkserver")
    with contextlib.suppress(ValueError, RuntimeError):  # the forkserver may already run
        ctx.set_forkserver_preload(["olmoflow.data.executor"])
    for old in _POOLS.values():
        old.shutdown(wait=False, cancel_futures=True)
    _POOLS.clear()
    _POOLS[workers] = pool = cf.ProcessPoolExecutor(
        max_workers=workers, mp_context=ctx, initializer=init_worker,
        initargs=(os.getpid(),))
    return pool


def init_worker(driver_pid: int) -> None:
    """Pool worker initializer: :func:`exit_with_driver`, and a quiet exit on Ctrl-C.

    Ctrl-C reaches every process of the terminal's group; the driver reports it in one line
    ("olmoflow: interrupted"), while each worker would print a KeyboardInterrupt traceback of
    its own. A worker stops at once instead (its half-written shard is a temporary file that the
    next run removes and redoes).
    """
    import signal

    signal.signal(signal.SIGINT, lambda *_: os._exit(130))
    exit_with_driver(driver_pid)


def exit_with_driver(driver_pid: int) -> None:
    """Pool worker initializer: end this worker when the driver process ends.

    A worker blocks on the pool's call queue, whose write end it holds itself, so when the driver
    is killed (kill -9, the OOM killer) nothing would ever wake it: the workers and their
    forkserver would stay, each holding its memory, until someone kills them by hand. A daemon
    thread waits for the driver (a pidfd on Linux, else a poll every second) and exits.
    """
    import threading

    def wait() -> None:
        try:
            import select

            fd = os.pidfd_open(driver_pid)
            select.select([fd], [], [])  # readable once the driver has exited
        except (AttributeError, OSError):  # no pidfd (macOS, old kernels): poll
            while True:
                try:
                    os.kill(driver_pid, 0)
                except ProcessLookupError:
                    break
                except PermissionError:
                    pass
                time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=wait, name="exit-with-driver", daemon=True).start()


def shutdown_pools() -> None:
    """Stop the kept worker processes (they also stop when the interpreter exits)."""
    for pool in _POOLS.values():
        pool.shutdown(wait=True, cancel_futures=True)
    _POOLS.clear()


def _run_pool(fn, tasks, pending, finish, workers, bar) -> None:
    futures = {_pool(workers).submit(fn, tasks[i]): i for i in pending}
    failed: dict[int, BaseException] = {}
    try:
        for fut in cf.as_completed(futures):
            if fut.cancelled():
                continue
            i = futures[fut]
            exc = fut.exception()
            if exc is not None:
                failed[i] = exc
                for f in futures:
                    f.cancel()
                continue
            finish(i, fut.result())
            if bar is not None:
                bar.update(1)
    except BaseException:
        for f in futures:
            f.cancel()
        raise
    if failed:
        raise failed[min(failed)]


#: The address a local Ray instance binds to: this machine only.
RAY_LOCAL_IP = "127.0.0.1"


def ray_init(workers: int | None = None, address: str | None = None) -> None:
    """Connect to Ray once per process: ``address`` (or ``$RAY_ADDRESS``) for a cluster, else
    start a local instance with ``workers`` CPUs and no dashboard, bound to 127.0.0.1 so that
    nothing else on the network can reach it (Ray's own default listens on every interface).
    A no-op when connected.

    Raises:
        OlmoflowError: Ray is not installed (``pip install 'olmoflow[ray]'``).
    """
    try:
        import ray
    except ImportError:
        raise OlmoflowError("executor 'ray' needs Ray: pip install 'olmoflow[ray]'") from None
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        return
    with _ray_loopback():
        ray.init(num_cpus=workers or default_workers(), include_dashboard=False,
                 log_to_driver=False, logging_level=logging.WARNING,
                 _node_ip_address=RAY_LOCAL_IP)
    node_ip = getattr(getattr(ray._private.worker, "_global_node", None), "node_ip_address",
                      RAY_LOCAL_IP)
    if node_ip != RAY_LOCAL_IP:
        log.warning("the local Ray instance listens on %s, not only on %s: this Ray version "
                    "did not keep the loopback address", node_ip, RAY_LOCAL_IP)


@contextlib.contextmanager
def _ray_loopback():
    """Let Ray keep 127.0.0.1 as the node address while it starts.

    Ray (2.x on Linux) replaces a loopback ``_node_ip_address`` by the machine's routable
    address, and its servers listen on every interface unless the node address is 127.0.0.1.
    ``ENABLE_RAY_CLUSTER`` off is the single-machine mode Ray uses on macOS and Windows, where
    the loopback address is kept; it is only read while the node address is resolved.
    """
    try:
        from ray._private import ray_constants
    except ImportError:  # a Ray without the constant: the warning after init says so
        yield
        return
    old = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if old is None:
            del ray_constants.ENABLE_RAY_CLUSTER
        else:
            ray_constants.ENABLE_RAY_CLUSTER = old


def _run_ray(fn, tasks, pending, finish, workers, address, bar) -> None:
    ray_init(workers, address)
    import ray

    remote = ray.remote(num_cpus=1, max_retries=0)(fn)
    refs = {remote.remote(tasks[i]): i for i in pending}
    waiting = list(refs)
    failed: dict[int, BaseException] = {}
    while waiting:
        ready, waiting = ray.wait(waiting, num_returns=1)
        i = refs[ready[0]]
        try:
            result = ray.get(ready[0])
        except ray.exceptions.RayTaskError as e:
            # Re-raise the job's own exception (an OlmoflowError stays one) in task order.
            cause = getattr(e, "cause", None)
            failed[i] = cause if isinstance(cause, BaseException) else e
            for r in waiting:
                ray.cancel(r)
            waiting = []
            continue
        finish(i, result)
        if bar is not None:
            bar.update(1)
    if failed:
        raise failed[min(failed)]


def sum_stats(results: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Add up shard stats: the :data:`STAT_KEYS` counters, ``removed`` per rule (documents and
    bytes), and the concatenated ``errors``. Keys missing from every result are left out."""
    total: dict[str, Any] = {}
    removed: dict[str, dict[str, int]] = {}
    errors: list[Any] = []
    for r in results:
        for k in STAT_KEYS:
            if k in r:
                total[k] = total.get(k, 0) + r[k]
        for rule, rec in (r.get("removed") or {}).items():
            acc = removed.setdefault(rule, {"documents": 0, "bytes": 0})
            acc["documents"] += rec.get("documents", 0)
            acc["bytes"] += rec.get("bytes", 0)
        errors.extend(r.get("errors") or [])
    if removed:
        total["removed"] = dict(sorted(removed.items()))
    if errors:
        total["errors"] = errors
    return total
