"""The data engine: a Dolma-style pipeline config and the step runner.

    ingest ─▶ tag ─▶ dedup ─▶ decontaminate ─▶ mix ─▶ tokenize

over a data run directory ``DIR`` (see docs/data.md)::

    DIR/documents/<source>/<shard>.jsonl.gz                 ingest (Dolma documents)
    DIR/attributes/<set>/<source>/<shard>.jsonl.gz          tag (set "tags"), dedup, decontam
    DIR/mixed/<source>/<shard>.jsonl.gz                     mix
    DIR/tokens/<source>/<shard>.{npy,csv.gz} + meta.json    tokenize
    DIR/<step dir>/manifest.json                            counts per rule and per source

Every step is split by shard and run by :func:`olmoflow.data.executor.run_shards` (a local
process pool, Ray tasks or serially); global steps (dedup, decontamination) map over shards,
reduce in the driver, then map again to write attributes. A step whose manifest matches its
fingerprint (its config and the fingerprints of the steps it reads) is skipped whole; inside a
step, finished shards are skipped by their done-markers (``DIR/.done/<step>/``).

The config is YAML; unknown keys are errors naming the closest valid key. The sections ``dedup``,
``decontamination`` and ``mixer`` are handed to their modules, which validate them.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from olmoflow.artifacts import is_complete, now, read_manifest, sha256_json, write_manifest
from olmoflow.config import coerce as _coerce, parse_override, read_yaml_mapping, set_dotted as _set_dotted
from olmoflow.data.executor import EXECUTORS, run_shards, sum_stats
from olmoflow.errors import OlmoflowError, closest, unknown_name_error

log = logging.getLogger(__name__)

STEPS = ("ingest", "tag", "dedup", "decontaminate", "mix", "tokenize")
DONE = ".done"
#: Where each step writes (its manifest.json lies there).
STEP_DIRS = {"ingest": "documents", "tag": "attributes/tags", "dedup": "attributes/dedup",
             "decontaminate": "attributes/decontam", "mix": "mixed", "tokenize": "tokens"}
MAX_ERROR_EXAMPLES = 20
#: Directories a step writes besides its own (the quality model, the trained tokenizer).
SIDE_DIRS = {"tag": ("quality",), "tokenize": ("tokenizer",)}


# ---- config ---------------------------------------------------------------------------------------


@dataclass
class SourceConfig:
    """One named source: files, directories or globs (relative to the current directory) read
    by the reader their suffix names (``.txt``, ``.jsonl[.gz|.zst]``, ``.json.gz``, ``.parquet``,
    ``.warc[.gz]``), ``stdlib``, or ``hf://name[:config]/split``. ``options`` go to the reader
    (e.g. ``text_field``, ``max_shard_bytes``)."""

    name: str = ""
    paths: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class QualityConfig:
    """Train the fastText quality classifier before tagging (when ``labeled`` is given): DCLM-style
    ``{text, label}`` JSONL files; the model goes to ``DIR/quality`` and the ``quality`` tagger
    uses it. ``options`` go to ``train_quality``."""

    labeled: list[str] = field(default_factory=list)
    model: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class TokenizeStepConfig:
    """Token arrays: ``tokenizer`` is a directory with ``tokenizer.json`` (e.g. from
    ``olmoflow train-tokenizer`` or an OLMo release); when None, a byte-level BPE of
    ``vocab_size`` is trained on the mixed documents into ``DIR/tokenizer``."""

    tokenizer: str | None = None
    implementation: str = "bpe"
    vocab_size: int = 8192
    min_frequency: int = 2
    dtype: str = "auto"
    workers: int | None = None


@dataclass
class DataConfig:
    """A data engine run (see the module docstring and docs/data.md)."""

    output: str = "runs/data"
    executor: str = "local"
    workers: int | None = None
    ray_address: str | None = None
    strict: bool = False
    steps: list[str] = field(default_factory=lambda: list(STEPS))
    sources: list[SourceConfig] = field(default_factory=list)
    quality: QualityConfig = field(default_factory=QualityConfig)
    taggers: list[Any] = field(default_factory=list)
    plugins: list[str] = field(default_factory=list)
    dedup: dict[str, Any] = field(default_factory=dict)
    decontamination: dict[str, Any] = field(default_factory=dict)
    mixer: dict[str, Any] = field(default_factory=dict)
    tokenize: TokenizeStepConfig = field(default_factory=TokenizeStepConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (for YAML, manifests and fingerprints)."""
        return dataclasses.asdict(self)


def _keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        out += _keys(t, f"{prefix}{f.name}.") if dataclasses.is_dataclass(t) else [prefix + f.name]
    return out


def _hints(cls: type) -> dict[str, Any]:
    import typing

    return typing.get_type_hints(cls)


def _build(cls: type, data: Any, prefix: str = "") -> Any:
    if not isinstance(data, dict):
        raise OlmoflowError(f"config section '{prefix.rstrip('.') or '<root>'}' must be a mapping")
    hints, kwargs = _hints(cls), {}
    names = [f.name for f in dataclasses.fields(cls)]
    for k, v in data.items():
        if k not in names:
            hint = closest(str(k), names)
            hint = f"{prefix}{hint}" if hint else closest(f"{prefix}{k}", _keys(DataConfig))
            raise OlmoflowError(f"unknown config key '{prefix}{k}'"
                                + (f"; did you mean '{hint}'?" if hint else ""))
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            kwargs[k] = _build(tp, v or {}, f"{prefix}{k}.")
        elif k == "sources":
            if not isinstance(v, list):
                raise OlmoflowError("config key 'sources' expects a list of {name, paths}")
            kwargs[k] = [_build(SourceConfig, s, f"sources[{i}].") for i, s in enumerate(v)]
        else:
            kwargs[k] = _coerce(v, tp, f"{prefix}{k}")
    return cls(**kwargs)


def validate(cfg: DataConfig) -> DataConfig:
    """Check choices and names; return ``cfg``.

    Raises:
        OlmoflowError: unknown executor or step, a source without name or paths, or two sources
            with the same name.
    """
    if cfg.executor not in EXECUTORS:
        raise unknown_name_error("executor", cfg.executor, EXECUTORS)
    for s in cfg.steps:
        if s not in STEPS:
            raise unknown_name_error("step", s, STEPS)
    seen = set()
    for i, s in enumerate(cfg.sources):
        if not s.name or not s.paths:
            raise OlmoflowError(f"sources[{i}] needs a 'name' and a list of 'paths'")
        if s.name in seen:
            raise OlmoflowError(f"two sources are named '{s.name}'")
        if "/" in s.name or s.name.startswith("."):
            raise OlmoflowError(f"source name '{s.name}' must be a plain directory name")
        seen.add(s.name)
    for n in (cfg.workers, cfg.tokenize.workers):
        if n is not None and n < 1:
            raise OlmoflowError(f"workers must be a positive integer, got {n}")
    return cfg


def load_data_config(path: str | os.PathLike, overrides: list[str] | None = None,
                     values: dict[str, Any] | None = None) -> DataConfig:
    """Load a data engine YAML config, apply dotted ``key=value`` overrides, validate it.

    Raises:
        OlmoflowError: a missing file, invalid YAML (file and line), an unknown key (with the
            closest valid key) or a bad value.
    """
    from olmoflow.config import CONFIG_DIR

    p = Path(path)
    if not p.is_file():
        presets = {q.stem: q for q in sorted((CONFIG_DIR / "data").glob("*.yaml"))}
        if str(path) not in presets:
            hint = closest(p.stem, presets)
            raise OlmoflowError(f"data config '{path}' not found (no such file, and not a preset "
                                "under configs/data/" + (f"; did you mean '{hint}'?)" if hint
                                                          else ")"))
        p = presets[str(path)]
    tree = read_yaml_mapping(p)
    for ov in overrides or []:
        _set_dotted(tree, *parse_override(ov))
    for k, v in (values or {}).items():
        _set_dotted(tree, k, v)
    return validate(_build(DataConfig, tree))


# ---- the step runner --------------------------------------------------------------------------------


@dataclass
class StepOutcome:
    """One line of ``olmoflow data run``'s summary."""

    step: str
    skipped: bool
    seconds: float
    counts: dict[str, Any]


class Engine:
    """Runs the steps of a :class:`DataConfig` over ``cfg.output``.

    Args:
        cfg: the validated config.
        progress: show per-step progress bars.
        force: redo steps (and shards) even when complete.
    """

    def __init__(self, cfg: DataConfig, *, progress: bool = False, force: bool = False) -> None:
        self.cfg = cfg
        self.root = Path(cfg.output).resolve()
        self.progress = progress
        self.force = force

    # -- helpers used by the steps --

    def step_dir(self, step: str) -> Path:
        """The directory a step writes (and holds its manifest)."""
        return self.root / STEP_DIRS[step]

    def done_dir(self, step: str) -> Path:
        """Where the done-markers of ``step``'s shards go."""
        return self.root / DONE / step

    def run_jobs(self, step: str, fn: Callable, tasks: list[dict[str, Any]], *,
                 phase: str = "", workers: int | None = None) -> list[dict[str, Any]]:
        """``run_shards`` with this run's executor, workers and done-markers."""
        done = self.done_dir(step) / phase if phase else self.done_dir(step)
        return run_shards(fn, tasks, executor=self.cfg.executor,
                          workers=workers or self.cfg.workers, done_dir=done,
                          desc=f"{step}{'/' + phase if phase else ''}",
                          ray_address=self.cfg.ray_address, progress=self.progress)

    def shards(self, step: str) -> list[dict[str, str]]:
        """The shards a finished step wrote, in order: ``[{"source", "path"}]`` (absolute)."""
        m = read_manifest(self.step_dir(step))
        if m is None:
            raise OlmoflowError(f"step '{step}' has not run in {self.root}; run "
                                f"'olmoflow data {step}' (or 'data run') first")
        return [{"source": s["source"], "path": str(self.step_dir(step) / s["path"])}
                for s in m.get("shards", [])]

    def fingerprint(self, step: str) -> str:
        """sha256 of the step's config and the fingerprints of the steps before it."""
        from olmoflow.data import steps as _steps

        upstream = [(s, (read_manifest(self.step_dir(s)) or {}).get("fingerprint"))
                    for s in _steps.UPSTREAM[step]]
        return sha256_json({"step": step, "config": _steps.step_config(self, step),
                            "upstream": upstream})

    # -- running --

    def run_step(self, step: str) -> StepOutcome:
        """Run one step (or skip it when its manifest is complete and current)."""
        from olmoflow.data import steps as _steps

        out = self.step_dir(step)
        fp = self.fingerprint(step)
        t0 = time.perf_counter()
        if not self.force and is_complete(out, fp):
            return StepOutcome(step, True, 0.0, read_manifest(out)["counts"])
        started = now()
        remove_temporaries(out, self.done_dir(step), self.root / "work" / step,
                           *[self.root / d for d in SIDE_DIRS.get(step, ())])
        if self.force:  # the mixer keeps its own done-markers under DIR/work/mix
            import shutil

            shutil.rmtree(self.done_dir(step), ignore_errors=True)
            shutil.rmtree(self.root / "work" / step / "done", ignore_errors=True)
        result, extra = _steps.RUNNERS[step](self)
        remove_stale(out, result.outputs)
        write_manifest(out, stage=f"data {step}", command=f"olmoflow data {step}",
                       config=_steps.step_config(self, step), fingerprint=fp,
                       inputs=result.inputs, outputs=result.outputs, counts=result.counts,
                       started=started, extra=extra)
        return StepOutcome(step, False, time.perf_counter() - t0, result.counts)

    def run(self, steps: list[str] | None = None,
            on_step: Callable[[StepOutcome], None] | None = None) -> list[StepOutcome]:
        """Run ``steps`` (default: the config's) in pipeline order; return their outcomes."""
        wanted = steps or self.cfg.steps
        for s in wanted:
            if s not in STEPS:
                raise unknown_name_error("step", s, STEPS)
        from olmoflow.artifacts import atomic_write_text
        from olmoflow.data import steps as _steps

        # Every section of the steps to run is checked before the first step starts: a typo in
        # the mixer must not surface only after hours of tagging.
        _steps.preflight(self, [s for s in STEPS if s in wanted])
        if self.root.exists() and not self.root.is_dir():
            raise OlmoflowError(f"output '{self.root}' is a file, not a directory")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OlmoflowError(f"cannot create output directory '{self.root}': "
                                f"{e.strerror or e}") from None
        if self.cfg.executor == "ray":  # connect once, to the configured cluster if any
            from olmoflow.data.executor import ray_init

            ray_init(self.cfg.workers, self.cfg.ray_address)
        # Saved so that `olmoflow data STEP DIR` and `data report DIR` find the run's config.
        atomic_write_text(self.root / "config.yaml",
                          yaml.safe_dump(self.cfg.to_dict(), sort_keys=False, allow_unicode=True))
        outcomes = []
        for s in STEPS:
            if s in wanted:
                o = self.run_step(s)
                outcomes.append(o)
                if on_step is not None:
                    on_step(o)
        return outcomes


#: The data files a step writes into its directory (anything else there is left alone).
DATA_SUFFIXES = (".jsonl.gz", ".npy", ".csv.gz")


def remove_stale(step_dir: Path, outputs: list[Path]) -> list[Path]:
    """Delete the data files in ``step_dir`` that this run of the step did not write (shards of a
    source or file since removed from the config); return them. Otherwise a glob over
    ``DIR/mixed`` or ``DIR/tokens`` would still feed removed data to training."""
    keep = {Path(o).resolve() for o in outputs}
    gone = []
    for p in sorted(step_dir.rglob("*")):
        if (p.is_file() and p.name.endswith(DATA_SUFFIXES) and not p.name.startswith(".")
                and p.resolve() not in keep):
            p.unlink()
            gone.append(p)
    if gone:
        log.info("%s: removed %d stale file(s) of an earlier run", step_dir, len(gone))
    return gone


def remove_temporaries(*dirs: Path) -> int:
    """Delete the hidden ``.<name>.<random>.tmp`` files that writers killed mid-write (kill -9, a
    lost node) left in ``dirs``; return how many. Run before a step redoes its shards, when no
    writer of this run directory is active."""
    n = 0
    for d in dirs:
        if d.is_dir():
            for p in d.rglob(".*.tmp"):
                if p.is_file():
                    p.unlink(missing_ok=True)
                    n += 1
    return n


def step_stats(tasks: list[dict[str, Any]], results: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest counts of a step: totals (:func:`sum_stats`), ``sources`` (the same per
    ``task["source"]``), ``shards``, and ``errors`` as a count (examples go in the manifest's
    ``errors`` field)."""
    total = sum_stats(results)
    by_source: dict[str, list[dict[str, Any]]] = {}
    for t, r in zip(tasks, results):
        by_source.setdefault(t.get("source", ""), []).append(r)
    total["sources"] = {}
    for s, rs in sorted(by_source.items()):
        st = sum_stats(rs)
        st["errors"] = error_count(rs)
        total["sources"][s] = st
    total["shards"] = len(results)
    total["errors"] = error_count(results)
    return total


def error_count(results: list[dict[str, Any]]) -> int:
    """Bad input lines the shards saw. A shard that reports ``error_counts`` (by kind) lists only
    the first few examples in ``errors``, so its count comes from there, not from the list."""
    n = 0
    for r in results:
        counts = r.get("error_counts")
        n += sum(counts.values()) if isinstance(counts, dict) else len(r.get("errors") or [])
    return n


def error_examples(results: list[dict[str, Any]]) -> list[Any]:
    """The first few errors the shards reported (``file:line: reason``), for the manifest."""
    out: list[Any] = []
    for r in results:
        out.extend(r.get("errors") or [])
        if len(out) >= MAX_ERROR_EXAMPLES:
            break
    return out[:MAX_ERROR_EXAMPLES]


def relative_shards(base: Path, tasks: list[dict[str, Any]], key: str = "output"
                    ) -> list[dict[str, str]]:
    """``[{"source", "path"}]`` of task outputs, relative to ``base`` (the step's directory)."""
    return [{"source": t["source"], "path": Path(t[key]).relative_to(base).as_posix()}
            for t in tasks]


def expand_paths(entries: list[str]) -> list[str]:
    """Files named by ``entries`` (files, directories, globs; ``stdlib`` and ``hf://`` kept as
    they are), sorted within each entry, as absolute paths.

    Raises:
        OlmoflowError: an entry that matches nothing.
    """
    out: list[str] = []
    for e in entries:
        if e == "stdlib" or e.startswith("hf://"):
            out.append(e)
            continue
        p = Path(e).expanduser()
        if p.is_dir():
            found = sorted(str(f.resolve()) for f in p.rglob("*")
                           if f.is_file() and not f.name.startswith("."))
        elif p.is_file():
            found = [str(p.resolve())]
        else:
            found = sorted(str(Path(f).resolve()) for f in glob.glob(e, recursive=True)
                           if Path(f).is_file())
        if not found:
            raise OlmoflowError(f"source path '{e}' matches no file")
        out.extend(found)
    return out


def summary_line(o: StepOutcome) -> str:
    """``tag        done  12.3s  in 1,234 docs 5.6 MB  out ...`` — one line per step."""
    c = o.counts
    parts = [f"{o.step:<14}", "skipped (done)" if o.skipped else f"{o.seconds:7.1f}s"]
    if "documents_in" in c:
        parts.append(f"in {c['documents_in']:,} docs")
    if "documents_out" in c:
        parts.append(f"out {c['documents_out']:,} docs")
    if c.get("bytes_out") is not None:
        parts.append(f"{c['bytes_out'] / 1e6:.2f} MB")
    removed = c.get("removed") or {}
    if removed:
        n = sum(r["documents"] for r in removed.values())
        parts.append(f"removed {n:,} ({len(removed)} rules)")
    flagged = [f"{k.split('__', 1)[-1]} {v['documents']:,}"
               for k, v in (c.get("flagged") or {}).items() if v.get("documents")]
    if "flagged" in c:
        parts.append("flagged " + (", ".join(flagged) if flagged else "none"))
    if c.get("tokens"):
        parts.append(f"{c['tokens']:,} tokens")
    if c.get("errors"):
        parts.append(f"{c['errors']:,} bad input")
    return "  ".join(parts)


__all__ = ["DataConfig", "Engine", "STEPS", "SourceConfig", "StepOutcome", "load_data_config",
           "step_stats", "summary_line"]
