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
reduce in the driver, then map again to write attributes. The runner knows no step by name: each
is a :class:`~olmoflow.data.engine.step.Step` record (directory, upstream, config section,
preflight, run) in :data:`~olmoflow.data.engine.steps.STEPS`, the tokenizer and the quality
classifier it trains included (steps that are part of another). Each runs through the one rule
of recorded work (:func:`olmoflow.recorded.run_recorded`): a step whose manifest matches its
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from olmoflow.artifacts import directory_lock, hash_once, read_manifest
from olmoflow.data.config import (  # re-exported: the engine's config lives with the others
    DataConfig,
    QualityConfig,
    SourceConfig,
    TokenizeStepConfig,
    load_data_config,
    validate,
)
from olmoflow.data.engine.step import Step
from olmoflow.data.engine.step_helpers import (  # re-exported for the steps' callers
    error_count,
    error_examples,
    expand_paths,
    relative_shards,
    step_stats,
)
from olmoflow.data.engine.steps import STEP_DIRS, STEP_NAMES, STEPS, enabled_steps
from olmoflow.data.executor import run_shards
from olmoflow.errors import OlmoflowError, unknown_name_error
from olmoflow.recorded import fingerprint, run_recorded, upstream_fingerprint
from olmoflow.run_dir import CONFIG_FILE, claim_directory, config_has_keys, own_manifest_stage

log = logging.getLogger(__name__)

DONE = ".done"
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
        steps: the table of step records to run (default: the engine's,
            :data:`~olmoflow.data.engine.steps.STEPS`); a new step is a record in it, and the
            runner needs no change.
    """

    def __init__(self, cfg: DataConfig, *, progress: bool = False, force: bool = False,
                 steps: tuple[Step, ...] = STEPS) -> None:
        self.cfg = cfg
        self.root = Path(cfg.output).resolve()
        self.progress = progress
        self.force = force
        self.table = {s.name: s for s in steps}
        self.steps = tuple(steps)

    # -- helpers used by the steps --

    def step_dir(self, step: str) -> Path:
        """The directory a step writes (and holds its manifest)."""
        return self.root / self.table[step].directory

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

    def clear_markers(self, step: Step) -> None:
        """Forget what ``step`` has done, for ``--force``: its shards' done-markers and its
        intermediate files (its ``work_dir``: hashes, the eval index, the mixer's own markers),
        so every shard job runs again."""
        import shutil

        shutil.rmtree(self.done_dir(step.name), ignore_errors=True)
        if step.work_dir:
            shutil.rmtree(self.root / step.work_dir, ignore_errors=True)

    def fingerprint(self, step: str) -> str:
        """sha256 of the step's config section and the fingerprints of the steps it reads."""
        rec = self.table[step]
        return fingerprint(step, rec.section(self),
                           [(s, upstream_fingerprint(self.step_dir(s))) for s in rec.upstream])

    # -- running --

    def run_step(self, step: str) -> StepOutcome:
        """Run one step (or skip it when its manifest is complete and current) through the one
        rule of recorded work (:func:`olmoflow.recorded.run_recorded`)."""
        rec = self.table[step]
        out = self.step_dir(step)

        def prepare() -> None:
            work = [self.root / rec.work_dir] if rec.work_dir else []
            remove_temporaries(out, self.done_dir(step), *work)
            if self.force:
                self.clear_markers(rec)

        done = run_recorded(out, self.fingerprint(step), lambda: rec.run(self),
                            stage=f"data {step}", command=f"olmoflow data {rec.part_of or step}",
                            config=rec.section(self), force=self.force, prepare=prepare,
                            finish=lambda result: remove_stale(out, result.outputs))
        return StepOutcome(step, done.skipped, done.seconds, done.counts)

    def preflight(self, steps: list[str] | None = None) -> list[Step]:
        """The steps that run for ``steps`` (default: the config's; parts included, in order),
        each one's preflight passed. Every section of the steps to run is checked before the
        first step starts: a typo in the mixer must not surface only after hours of tagging.

        Raises:
            OlmoflowError: an unknown step (naming the closest), or a preflight's error.
        """
        names = [s.name for s in self.steps if s.part_of is None]
        wanted = steps or self.cfg.steps or names
        for s in wanted:
            if s not in names:
                raise unknown_name_error("step", s, names)
        run = enabled_steps(self.cfg, wanted, self.steps)
        for rec in run:
            if rec.preflight is not None:
                rec.preflight(self)
        return run

    def run(self, steps: list[str] | None = None,
            on_step: Callable[[StepOutcome], None] | None = None) -> list[StepOutcome]:
        """Run ``steps`` (default: the config's) in pipeline order; return their outcomes.

        Raises:
            OlmoflowError: an unknown step, a config section's error (before any step runs), a
                source inside the output, an output that is a file or a non-empty directory
                that is not a data engine output, one another process is running in (the
                message names it), or a step's error.
        """
        run = self.preflight(steps)
        if self.root.exists() and not self.root.is_dir():
            raise OlmoflowError(f"output '{self.root}' is a file, not a directory")
        claim_directory(self.root, marker=DATA_MARKER, legacy=legacy_output_problem,
                        what="data output")
        # Each step's inputs are the outputs the step before it was checked against.
        with directory_lock(self.root, what="data output"), hash_once():
            return self._run_held(run, on_step)

    def _run_held(self, run: list[Step],
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
        for rec in run:
            o = self.run_step(rec.name)
            if rec.part_of is None:  # a part of a step is reported with it
                outcomes.append(o)
                if on_step is not None:
                    on_step(o)
        return outcomes


#: What a data engine output holds besides its step directories: the saved config, the
#: directories of the steps that are parts of others (the quality model, the tokenizer), the
#: work directories of steps, and ``data report``'s directory.
_OUTPUT_EXTRAS = ("config.yaml", "work", "reports",
                  *sorted(s.directory for s in STEPS if s.part_of is not None))


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
    known = {STEP_DIRS[s].split("/")[0] for s in STEP_NAMES} | set(_OUTPUT_EXTRAS)
    for p in sorted(root.iterdir()):
        if p.name.startswith(".") or p.name == CONFIG_FILE:
            continue
        if p.name not in known or not p.is_dir() or p.is_symlink():
            return f"'{p.name}' is not a data engine directory"
    made = 0
    for step in STEP_NAMES:
        d = STEP_DIRS[step]
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


__all__ = ["DATA_MARKER", "STEPS", "STEP_DIRS", "STEP_NAMES", "DataConfig", "Engine",
           "QualityConfig", "SourceConfig", "Step", "StepOutcome", "TokenizeStepConfig",
           "error_count", "error_examples", "expand_paths", "legacy_output_problem",
           "load_data_config", "relative_shards", "step_stats", "summary_line", "validate"]
