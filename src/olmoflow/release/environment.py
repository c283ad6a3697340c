"""The environment a release was made in, and the files that rebuild it.

``environment.json`` records what shapes the numbers (:func:`olmoflow.artifacts.environment`:
Python, platform, CPU, torch's math libraries, CUDA and GPUs when present, thread settings), the
git commit of the olmoflow source and whether its tree had uncommitted changes, and every
installed Python distribution with its version. ``requirements.lock`` pins those distributions
(``name==version``, one per line, olmoflow itself excepted: it is the source at the commit), and
``Dockerfile`` rebuilds the environment from them on the same Python minor version, with the
torch build named (CPU or the CUDA version) so the right wheel index is used.
"""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from olmoflow.artifacts import environment, git_commit


def installed_packages() -> dict[str, str]:
    """Every installed distribution of this interpreter, ``{name: version}``, sorted by name
    (lower case; the first of duplicate names found on ``sys.path`` wins, as ``import`` does)."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = (dist.metadata.get("Name") or "").strip()
        if name and name.lower() not in found:
            found[name.lower()] = dist.version
    return dict(sorted(found.items()))


def git_dirty() -> bool | None:
    """Whether the olmoflow source tree has uncommitted changes to tracked files; None outside a
    git checkout."""
    src = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(src), "status", "--porcelain",
                              "--untracked-files=no"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


def environment_record() -> dict[str, Any]:
    """The release's ``environment.json``: ``machine`` (:func:`environment`), ``git_commit``,
    ``git_dirty``, ``python_executable`` and ``packages``."""
    return {"machine": environment(), "git_commit": git_commit(), "git_dirty": git_dirty(),
            "python_executable": sys.executable, "packages": installed_packages()}


def requirements_lock(packages: dict[str, str]) -> str:
    """``requirements.lock``: ``name==version`` per installed distribution except olmoflow (the
    source itself, installed from its checkout) and the installers pip/setuptools/wheel."""
    skip = {"olmoflow", "pip", "setuptools", "wheel"}
    lines = [f"{name}=={version}" for name, version in packages.items() if name not in skip]
    return ("# The Python packages of the environment that made this release (pip install -r).\n"
            + "\n".join(lines) + "\n")


def dockerfile(record: dict[str, Any]) -> str:
    """A ``Dockerfile`` that rebuilds the environment: the same Python minor version, torch first
    from the index of its build (CPU, or the CUDA version it was built with), then
    ``requirements.lock``, then olmoflow from its source at the recorded commit (the build context
    is an olmoflow checkout; the comment says which commit and whether it was dirty)."""
    machine = record.get("machine", {})
    py = ".".join(str(machine.get("python", "3.11")).split(".")[:2])
    torch_version = record.get("packages", {}).get("torch", "")
    cuda = machine.get("torch_cuda")
    index = (f"https://download.pytorch.org/whl/cu{cuda.replace('.', '')}" if cuda
             else "https://download.pytorch.org/whl/cpu")
    torch_line = (f"RUN pip install --no-cache-dir torch=={torch_version.split('+')[0]} "
                  f"--index-url {index}\n" if torch_version else "")
    commit = record.get("git_commit") or "unknown"
    dirty = " (the tree had uncommitted changes)" if record.get("git_dirty") else ""
    return f"""# Rebuilds the environment this release was made in.
# Build from an olmoflow checkout at commit {commit}{dirty}, with this release's
# requirements.lock copied into it:
#   git checkout {commit} && cp RELEASE/requirements.lock . && docker build -t olmoflow-env .
FROM python:{py}-slim
WORKDIR /olmoflow
{torch_line}COPY requirements.lock .
RUN pip install --no-cache-dir -r requirements.lock
COPY . .
RUN pip install --no-cache-dir --no-deps -e .
ENTRYPOINT ["olmoflow"]
"""
