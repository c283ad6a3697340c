"""The code sandbox against hostile programs: each is contained, scored as a failure, and the
next honest program still passes; model-written code that undoes the Python-level guard still
cannot touch the user's files (a read-only mount namespace)."""

import os
import socket
import time
from pathlib import Path

import pytest

from olmoflow.eval.sandbox import run_many, run_untrusted

T = 2.0  # seconds; every hostile program must be stopped well within a few of these


def honest_still_passes():
    r = run_untrusted("print(sum(range(10)))", timeout_s=T)
    assert r.passed, r
    assert r.stdout.strip() == "45"


def test_honest_program_passes_and_reports_output():
    r = run_untrusted("import math\nprint(math.factorial(5))\nassert True", timeout_s=T)
    assert r.passed and r.status == "passed" and r.returncode == 0 and r.reason == ""
    assert r.stdout == "120\n"


def test_failing_assert_and_early_exit_are_failures():
    r = run_untrusted("assert 1 + 1 == 3", timeout_s=T)
    assert r.status == "failed" and "AssertionError" in r.reason
    # exit status 0 before the asserts is not a pass
    r = run_untrusted("import sys\nsys.exit(0)\nassert False", timeout_s=T)
    assert r.returncode == 0 and not r.passed and "before the end" in r.reason


def test_infinite_loop_times_out():
    t0 = time.monotonic()
    r = run_untrusted("while True:\n    pass", timeout_s=1.0)
    assert r.status == "timeout" and not r.passed
    assert time.monotonic() - t0 < 4
    honest_still_passes()


@pytest.mark.parametrize("program", [
    "import os\nwhile True:\n    os.fork()",
    "import posix\nwhile True:\n    posix.fork()",
    "import subprocess\nsubprocess.Popen(['sleep', '100'])",
    "import multiprocessing\nmultiprocessing.Process(target=print).start()",
    "import os\nos.system('sleep 100')",
    "import os\nos.posix_spawn('/bin/sleep', ['sleep', '100'], {})",
])
def test_fork_bomb_and_process_spawning_are_contained(program):
    r = run_untrusted(program, timeout_s=T)
    assert not r.passed
    assert r.duration_s < T + 1
    honest_still_passes()


def test_orphans_are_killed_with_the_process_group():
    # without the guard a program can fork; its child must not outlive the run
    prog = "import os, time\npid = os.fork()\nif pid:\n    print(pid, flush=True)\ntime.sleep(60)"
    r = run_untrusted(prog, timeout_s=1.0, guard=False)
    assert r.status == "timeout"
    pid = int(r.stdout.split()[0])
    time.sleep(0.1)
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z", "X")  # dead (a zombie waits for init to reap it)


def test_huge_allocation_fails():
    r = run_untrusted("x = bytearray(10**11)", timeout_s=T, memory_mb=512)
    assert not r.passed and "MemoryError" in r.stderr
    honest_still_passes()


@pytest.mark.parametrize("attack", [
    "import os\nos.remove({p!r})",
    "import os\nos.unlink({p!r})",
    "import shutil\nshutil.rmtree({d!r})",
    "open({p!r}, 'w').close()",
    "open({p!r}, 'a').write('x')",
    "import pathlib\npathlib.Path({p!r}).unlink()",
    "import pathlib\npathlib.Path({p!r}).write_text('gone')",
    "import os\nos.truncate({p!r}, 0)",
    "import os\nos.rename({p!r}, {p!r} + '.moved')",
    "import os\nfd = os.open({p!r}, os.O_WRONLY | os.O_TRUNC)",
])
def test_files_outside_the_sandbox_survive(tmp_path, attack):
    d = tmp_path / "victim"
    d.mkdir()
    sentinel = d / "sentinel.txt"
    sentinel.write_text("keep me")
    r = run_untrusted(attack.format(p=str(sentinel), d=str(d)), timeout_s=T)
    assert not r.passed
    assert sentinel.read_text() == "keep me"
    honest_still_passes()


def test_secrets_outside_are_not_readable_and_home_is_the_sandbox(tmp_path):
    secret = tmp_path / ".ssh" / "id_rsa"
    secret.parent.mkdir()
    secret.write_text("PRIVATE KEY")
    r = run_untrusted(f"print(open({str(secret)!r}).read())", timeout_s=T)
    assert not r.passed and "PRIVATE KEY" not in r.stdout
    r = run_untrusted("import os\nprint(os.environ['HOME'])\nprint(sorted(os.environ))",
                      timeout_s=T)
    assert r.passed
    home = r.stdout.splitlines()[0]
    assert home != os.environ.get("HOME") and "olmoflow-sandbox-" in home
    assert not Path(home).exists()  # the working directory is deleted afterwards
    assert "PATH" in r.stdout and "USER" not in r.stdout


def test_network_is_blocked():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.3)
    port = server.getsockname()[1]
    try:
        for prog in [f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 1)",
                     f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))",
                     f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))",
                     f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}')"]:
            r = run_untrusted(prog, timeout_s=T)
            assert not r.passed, prog
        with pytest.raises(socket.timeout):
            server.accept()  # nobody ever connected
    finally:
        server.close()
    honest_still_passes()


def test_huge_file_is_stopped_by_the_size_limit():
    prog = "with open('big.bin', 'wb') as f:\n    while True:\n        f.write(b'x' * 2**20)"
    r = run_untrusted(prog, timeout_s=T, max_file_mb=4)
    assert not r.passed and r.status in ("failed", "killed")
    # endless printing is bounded the same way (stdout is a file)
    r = run_untrusted("while True:\n    print('y' * 1000)", timeout_s=T, max_file_mb=2)
    assert not r.passed and len(r.stdout) <= 2000
    honest_still_passes()


def test_run_many_keeps_order_and_isolates_failures():
    progs = [f"print({i})" if i % 3 else "raise ValueError" for i in range(9)]
    rs = run_many(progs, workers=2, timeout_s=T)
    assert [r.passed for r in rs] == [bool(i % 3) for i in range(9)]
    assert [r.stdout.strip() for r in rs if r.passed] == [str(i) for i in range(9) if i % 3]


# --- a completion that undoes the Python-level guard cannot touch the user's files ----------------


def _readonly_available() -> bool:
    r = run_untrusted("pass", readonly_fs="require", timeout_s=10)
    return r.returncode != 3


needs_ns = pytest.mark.skipif(not _readonly_available(),
                              reason="the kernel allows no mount namespace here (no privileges "
                              "and no user namespaces)")


BYPASSES = {
    # a fresh copy of the builtin posix module has its functions back
    "reimported posix": "import sys\ndel sys.modules['posix']\nimport posix\n"
                        "posix.unlink({victim!r})",
    "_io.FileIO": "import _io\nf = _io.FileIO({victim!r}, 'w')\nf.write(b'gone')\nf.close()",
    "the guard's closure": "for c in open.__closure__:\n"
                           "    v = c.cell_contents\n"
                           "    if getattr(v, '__name__', '') == 'open':\n"
                           "        v({victim!r}, 'w').write('gone')",
    "new file beside it": "import _io\n_io.FileIO({new!r}, 'w').close()",
    "rename": "import sys\ndel sys.modules['posix']\nimport posix\n"
              "posix.rename({victim!r}, {new!r})",
}


@needs_ns
@pytest.mark.parametrize("attack", sorted(BYPASSES))
def test_a_completion_that_undoes_the_guard_cannot_touch_the_users_files(tmp_path, attack):
    victim, new = tmp_path / "precious.txt", tmp_path / "planted.txt"
    victim.write_text("keep me")
    r = run_untrusted(BYPASSES[attack].format(victim=str(victim), new=str(new)), timeout_s=10)
    assert not r.passed
    assert "Read-only file system" in r.stderr
    assert victim.read_text() == "keep me" and not new.exists()


@needs_ns
def test_the_working_directory_stays_writable_and_remounting_is_refused():
    prog = ("open('a.txt', 'w').write('hi')\nimport os\nos.makedirs('d/e')\n"
            "assert open('a.txt').read() == 'hi'\n"
            "import sys\nfor m in ('ctypes', '_ctypes'):\n    sys.modules.pop(m, None)\n"
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "assert libc.mount(None, b'/', None, 32, None) != 0, 'remounted / writable'\n")
    r = run_untrusted(prog, timeout_s=10)
    assert r.passed, r.stderr


def test_readonly_off_leaves_the_working_directory_usable():
    r = run_untrusted("open('a.txt', 'w').write('x')\nprint(open('a.txt').read())",
                      readonly_fs=False, timeout_s=10)
    assert r.passed and r.stdout.strip() == "x"
