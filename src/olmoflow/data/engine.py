"""The data engine: a Dolma-style pipeline config and the step runner.

    ingest ─▶ tag ─▶ dedup ─▶ decontaminate ─▶ mix ─▶ tokenize

over a data run directory ``DIR`` (see docs/data.md)::

    DIR/documents/<source>/<shard>.jsonl.gz                 ingest (Dolma documents)
    DIR/attributes/<set>/<source>/<shard>.jsonl.gz          tag (set "tags"), dedup, decontam
    DIR/mixed/<source>/<shard>.jsonl.gz                     mix
    DIR/tokens/{train,heldout}/<source>/<shard>.{npy,csv.gz} + meta.json   tokenize
    DIR/<step dir>/manifest.json                            counts per rule and per source

Every step is split by shard and run by :func:`olmoflow.data.executor.run_shards` (a local
process pool, Ray tasks or serially); global steps (dedup, decontaminate) map over shards,
reduce in the driver, then map again to write attributes. A step whose manifest matches its
fingerprint (its config and the fingerprints of the steps it reads) is skipped whole; inside a
step, finished shards are skipped by their done-markers (``DIR/.done/<step>/``).

``DIR`` is olmoflow's once it carries the marker ``DIR/.olmoflow-data``: the engine deletes stale
shards and markers only there, and refuses a non-empty directory without it (an output made
before the marker existed is recognised and adopted, see :func:`legacy_output_problem`). A source
path inside ``DIR`` is refused (ingest would delete it as a stale shard). One process at a time
runs in ``DIR``: :meth:`Engine.run` holds its lock (``DIR/.olmoflow-lock``).

The config is YAML, parsed by :func:`olmoflow.config.from_dict` like run configs: unknown keys are
errors naming the closest valid key. Every section is a dataclass (``dedup``, ``decontaminate``
and ``mixer`` live beside their modules), checked when it is built; steps and shard jobs use the
dataclasses as they are. One name per idea: the step and its config section
are ``decontaminate``; the attribute set it writes (``attributes/decontam``, attributes
``decontam__<eval set>``, which mixer rules name) keeps its short name.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from olmoflow.artifacts import (
    directory_lock,
    hash_once,
    is_complete,
    now,
    read_manifest,
    sha256_json,
    write_manifest,
)
from olmoflow.data import steps as _steps
from olmoflow.data.config import (  # re-exported: the engine's config lives with the others
    STEP_DIRS,
    STEPS,
    DataConfig,
    QualityConfig,
    SourceConfig,
    TokenizeStepConfig,
    load_data_config,
    validate,
)
from olmoflow.data.executor import run_shards
from olmoflow.data.step_helpers import (  # re-exported for the steps' callers
    error_count,
    error_examples,
    expand_paths,
    relative_shards,
    step_stats,
)
from olmoflow.errors import OlmoflowError, unknown_name_error
from olmoflow.run_dir import (
    CONFIG_FILE,
    claim_directory,
    config_has_keys,
    input_inside,
    own_manifest_stage,
)

log = logging.getLogger(__name__)

DONE = ".done"
#: Directories a step writes besides its own (the quality model, the trained tokenizer).
SIDE_DIRS = {"tag": ("quality",), "tokenize": ("tokenizer",)}
#: A step's intermediate files (hashes, the eval index, the mixer's own done-markers), named
#: after the attribute set the step writes (``decontaminate`` -> ``decontam``).
WORK_DIRS = {"dedup": "work/dedup", "decontaminate": "work/decontam", "mix": "work/mix"}
#: The marker file that says a directory is a data engine output.
DATA_MARKER = ".olmoflow-data"


# ---- the step runner -----------------------------------------------------------------------------


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

    def clear_markers(self, step: str) -> None:
        """Forget what ``step`` has done, for ``--force``: its shards' done-markers and its
        intermediate files (``WORK_DIRS``: hashes, the eval index, the mixer's own markers), so
        every shard job runs again. Its side directories (the quality model, the tokenizer) are
        retrained by the step itself when forced."""
        import shutil

        shutil.rmtree(self.done_dir(step), ignore_errors=True)
        if step in WORK_DIRS:
            shutil.rmtree(self.root / WORK_DIRS[step], ignore_errors=True)

    def fingerprint(self, step: str) -> str:
        """sha256 of the step's config and the fingerprints of the steps before it."""
        upstream = [(s, (read_manifest(self.step_dir(s)) or {}).get("fingerprint"))
                    for s in _steps.UPSTREAM[step]]
        return sha256_json({"step": step, "config": _steps.step_config(self, step),
                            "upstream": upstream})

    # -- running --

    def run_step(self, step: str) -> StepOutcome:
        """Run one step (or skip it when its manifest is complete and current)."""
        out = self.step_dir(step)
        fp = self.fingerprint(step)
        t0 = time.perf_counter()
        if not self.force and is_complete(out, fp):
            return StepOutcome(step, True, 0.0, read_manifest(out)["counts"])
        started = now()
        work = [self.root / WORK_DIRS[step]] if step in WORK_DIRS else []
        remove_temporaries(out, self.done_dir(step), *work,
                           *[self.root / d for d in SIDE_DIRS.get(step, ())])
        if self.force:
            self.clear_markers(step)
        result, extra = _steps.RUNNERS[step](self)
        remove_stale(out, result.outputs)
        write_manifest(out, stage=f"data {step}", command=f"olmoflow data {step}",
                       config=_steps.step_config(self, step), fingerprint=fp,
                       inputs=result.inputs, outputs=result.outputs, counts=result.counts,
                       started=started, extra=extra)
        return StepOutcome(step, False, time.perf_counter() - t0, result.counts)

    def run(self, steps: list[str] | None = None,
            on_step: Callable[[StepOutcome], None] | None = None) -> list[StepOutcome]:
        """Run ``steps`` (default: the config's) in pipeline order; return their outcomes.

        Raises:
            OlmoflowError: an unknown step, a config section's error (before any step runs), a
                source inside the output, an output that is a file or a non-empty directory
                that is not a data engine output, one another process is running in (the
                message names it), or a step's error.
        """
        wanted = steps or self.cfg.steps
        for s in wanted:
            if s not in STEPS:
                raise unknown_name_error("step", s, STEPS)
        # Every section of the steps to run is checked before the first step starts: a typo in
        # the mixer must not surface only after hours of tagging.
        _steps.preflight(self, [s for s in STEPS if s in wanted])
        if "ingest" in wanted:
            self.check_sources()
        if self.root.exists() and not self.root.is_dir():
            raise OlmoflowError(f"output '{self.root}' is a file, not a directory")
        claim_directory(self.root, marker=DATA_MARKER, legacy=legacy_output_problem,
                        what="data output")
        # Each step's inputs are the outputs the step before it was checked against.
        with directory_lock(self.root, what="data output"), hash_once():
            return self._run_held(wanted, on_step)

    def check_sources(self) -> None:
        """Refuse source paths inside the output directory: ingest deletes the shards there
        that it did not write, and later steps would read their own output as input.

        Raises:
            OlmoflowError: the first such path, naming its source.
        """
        for i, src in enumerate(self.cfg.sources):
            for entry in src.paths:
                if input_inside(entry, [self.root]) is not None:
                    raise OlmoflowError(
                        f"sources[{i}] ('{src.name}'): path '{entry}' lies inside the output "
                        f"directory '{self.root}', whose files the engine replaces; move it "
                        "out of the output directory")

    def _run_held(self, wanted: list[str],
                  on_step: Callable[[StepOutcome], None] | None) -> list[StepOutcome]:
        """:meth:`run` once the output directory is claimed and locked."""
        from olmoflow.artifacts import atomic_write_text

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


#: What a data engine output holds besides its step directories (``STEP_DIRS``): the saved
#: config, the side and work directories of steps, and ``data report``'s directory.
_OUTPUT_EXTRAS = ("config.yaml", "work", "reports",
                  *sorted({d for ds in SIDE_DIRS.values() for d in ds}))


def legacy_output_problem(root: Path) -> str | None:
    """Why ``root`` (not empty, no marker) is not a data engine output that olmoflow made before
    it marked them; None when it is one, to be adopted.

    It is one when its ``config.yaml`` is a YAML mapping with the ``output`` and ``steps`` keys
    (the config the engine saves), at least one step directory has the engine's manifest (its
    ``stage`` is ``data <step>``), every other step directory that exists has one or has the
    step's done-markers, and every entry not hidden is one of these or a side directory of the
    engine (``work``, ``reports``, ``quality``, ``tokenizer``). Anything else makes it foreign.
    """
    if not config_has_keys(root / CONFIG_FILE, ("output", "steps")):
        return f"no data engine {CONFIG_FILE}"
    known = {d.split("/")[0] for d in STEP_DIRS.values()} | set(_OUTPUT_EXTRAS)
    for p in sorted(root.iterdir()):
        if p.name.startswith(".") or p.name == CONFIG_FILE:
            continue
        if p.name not in known or not p.is_dir() or p.is_symlink():
            return f"'{p.name}' is not a data engine directory"
    made = 0
    for step, d in STEP_DIRS.items():
        p = root / d
        if not p.exists():
            continue
        if own_manifest_stage(p) == f"data {step}":
            made += 1
        elif not (p.is_dir() and (root / DONE / step).is_dir()):
            return f"'{d}' is not a data engine step directory"
    return None if made else "no finished step"


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


__all__ = ["STEPS", "STEP_DIRS", "DataConfig", "Engine", "QualityConfig", "SourceConfig",
           "StepOutcome", "TokenizeStepConfig", "error_count", "error_examples", "expand_paths",
           "load_data_config", "relative_shards", "step_stats", "summary_line", "validate"]
