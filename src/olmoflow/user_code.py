"""Loading the code a config names: ``tokenizer.implementation`` and the data engine's ``plugins``.

Both run code, so a config that names a module or a file is trusted input, like the code itself.
Two spellings:

- a module on the Python path, ``package.module`` (installed, or on ``PYTHONPATH``). It is never
  taken from the current directory implicitly: ``python -m olmoflow`` puts the current directory
  first on ``sys.path`` (and ``python -c`` or a REPL puts ``''``), so a stray ``tokenizer.py`` in
  whatever directory the command runs in would otherwise be imported. Such a module is refused,
  and the message says how to name the file;
- a file named by its path, ``./my_tok.py`` or ``path/to/file.py`` (anything ending in ``.py`` or
  holding a ``/``; relative to the current directory): the user asked for that very file.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from olmoflow.errors import OlmoflowError


def is_file_spec(spec: str) -> bool:
    """Whether ``spec`` names a file (``.py``, or a path with a separator) rather than a module."""
    return spec.endswith(".py") or "/" in spec or os.sep in spec


def _implicit_dirs() -> set[Path]:
    """The directories Python put on ``sys.path`` for the current directory on its own: ``''``
    entries and, unless ``-P``/``PYTHONSAFEPATH``, ``sys.path[0]`` when it is the current
    directory (``python -m``). Entries the user listed in ``PYTHONPATH`` are theirs, not
    implicit."""
    try:
        cwd = Path.cwd().resolve()
    except OSError:  # the current directory was deleted: nothing resolves from it
        return set()
    explicit = {Path(p).resolve() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    dirs = set()
    if "" in sys.path:
        dirs.add(cwd)
    if sys.path and not sys.flags.safe_path and sys.path[0]:
        try:
            if Path(sys.path[0]).resolve() == cwd:
                dirs.add(cwd)
        except OSError:
            pass
    return dirs - explicit


def _roots(top: str) -> list[Path]:
    """The directories the top-level module ``top`` is (or would be) imported from."""
    module = sys.modules.get(top)
    if module is not None:
        file = getattr(module, "__file__", None)
        locations = list(getattr(module, "__path__", None) or [])
    else:
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            return []
        if spec is None:
            return []
        file = spec.origin if spec.has_location else None
        locations = list(spec.submodule_search_locations or [])
    if locations:  # a package (a namespace package has no file): its directory's parent
        return [Path(p).resolve().parent for p in locations]
    return [Path(file).resolve().parent] if file else []


def cwd_module_file(module: str) -> Path | None:
    """The file in the current directory that importing ``module`` would run only because Python
    put that directory on ``sys.path`` implicitly, or None."""
    top = module.partition(".")[0]
    implicit = _implicit_dirs()
    for root in _roots(top):
        if root in implicit:
            return root / (top if (root / top).is_dir() else f"{top}.py")
    return None


def import_module(module: str, example: str) -> ModuleType:
    """Import ``module`` by name, never from the current directory implicitly.

    ``example`` is how the config would name a file instead, ``{file}`` standing for the file's
    name (``"tokenizer.implementation=./{file}:MyTokenizer"``); messages quote it. The errors
    raised say only what went wrong: the caller puts the config key in front.

    Raises:
        OlmoflowError: the module would come from the current directory, or it cannot be
            imported (its error named, with a hint when a file of that name lies here).
    """
    top = module.partition(".")[0]
    found = cwd_module_file(module)
    if found is not None:
        how = (f"name the file by its path ({example.format(file=found.name)})"
               if found.suffix == ".py" else "put its directory on PYTHONPATH")
        raise OlmoflowError(f"'{top}' would be imported from the current directory ({found}), "
                            f"which is never done implicitly; to run it, {how}")
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any failure here is the user's module's
        hint = ""
        if isinstance(e, ModuleNotFoundError) and Path(f"{top}.py").is_file():
            hint = (" (a file in the current directory is not imported by module name; name it "
                    f"by its path: {example.format(file=top + '.py')})")
        raise OlmoflowError(f"{_one_line(e)}{hint}") from None


def load_file(path: str | os.PathLike) -> ModuleType:
    """Run the Python file ``path`` as a module (once per process: a second call returns the same
    module, so classes it defines stay the same objects). Relative paths are relative to the
    current directory. The errors raised say only what went wrong: the caller puts the config
    key in front.

    Raises:
        OlmoflowError: no such file, or the file fails to run (its error named).
    """
    file = Path(path).expanduser().resolve()
    name = f"olmoflow_user_{hashlib.sha1(str(file).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    if not file.is_file():
        raise OlmoflowError(f"no such file '{file}'")
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise OlmoflowError(f"'{file}' is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look a class's module up here
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - any failure here is the user's file's
        sys.modules.pop(name, None)
        raise OlmoflowError(_one_line(e)) from None
    return module


def _one_line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
