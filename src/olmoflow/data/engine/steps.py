"""The data engine's steps: their records (:data:`STEPS`), and how each builds its shard tasks,
runs them and sums their stats.

Each runner takes the :class:`~olmoflow.data.engine.Engine` and returns ``(StageResult, extra)``;
``extra`` goes into the step's manifest: ``shards`` (the files it wrote, in order, with their
source: what the next step reads) and ``errors`` (examples of bad input, ``file:line: reason``).
The shard jobs themselves live with their modules: ``ingest_shard`` (sources), ``tag_shard``
(taggers), dedup / decontam / mixer jobs, and :func:`~olmoflow.data.tokenize_shards.tokenize_shard`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from olmoflow.artifacts import StageResult, read_manifest
from olmoflow.data.engine.step import EngineView, Step
from olmoflow.data.engine.step_helpers import (
    error_examples,
    expand_paths,
    relative_shards,
    step_stats,
)
from olmoflow.data.taggers import import_plugins
from olmoflow.errors import OlmoflowError, unknown_name_error

if TYPE_CHECKING:  # the engine runs these steps; they only use the object it hands them
    from olmoflow.data.config import DataConfig
    from olmoflow.data.mixer import MixConfig
    from olmoflow.data.sources import SourceOptions

DOC_SUFFIX = ".jsonl.gz"


# ---- what each step depends on (its section) and checks before the run (its preflight) ----------


def _ingest_section(engine: EngineView) -> dict[str, Any]:
    cfg = engine.cfg
    srcs = [{"name": s.name, "paths": s.paths, "options": _asdict(s.options),
             "files": _source_stamps(s.name, s.paths, s.options)} for s in cfg.sources]
    return {"strict": cfg.strict, "sources": srcs}


def _ingest_preflight(engine: EngineView) -> None:
    """Sources are given, and none lies inside the output directory: ingest deletes the shards
    there that it did not write, and later steps would read their own output as input."""
    from olmoflow.run_dir import input_inside

    if not engine.cfg.sources:
        raise OlmoflowError("the config has no 'sources' to ingest")
    for i, src in enumerate(engine.cfg.sources):
        for entry in src.paths:
            if input_inside(entry, [engine.root]) is not None:
                raise OlmoflowError(
                    f"sources[{i}] ('{src.name}'): path '{entry}' lies inside the output "
                    f"directory '{engine.root}', whose files the engine replaces; move it out "
                    "of the output directory")


def _tag_section(engine: EngineView) -> dict[str, Any]:
    cfg = engine.cfg
    q = cfg.quality
    files = [p for p in cfg.plugins if p.endswith(".py")] + q.labeled
    files += [q.model] if q.model else []
    return {"strict": cfg.strict, "taggers": cfg.taggers, "quality": _asdict(q),
            "plugins": cfg.plugins, "files": _stamps(files)}


def _tag_preflight(engine: EngineView) -> None:
    from olmoflow.data.taggers import check_taggers

    cfg = engine.cfg
    if not cfg.taggers:
        raise OlmoflowError("the config lists no 'taggers'")
    import_plugins([str(Path(p).resolve()) if p.endswith(".py") else p for p in cfg.plugins])
    check_taggers(cfg.taggers)  # again, now that plugins may have registered more names
    if cfg.quality.labeled:
        expand_paths(cfg.quality.labeled)
    if cfg.quality.model and not Path(cfg.quality.model).exists():
        raise OlmoflowError(f"quality.model: no such file or directory '{cfg.quality.model}'")


def _section(key: str):
    """The section function of a step whose config is ``cfg.<key>`` (and ``strict``)."""
    def section(engine: EngineView) -> dict[str, Any]:
        return {"strict": engine.cfg.strict, key: _asdict(getattr(engine.cfg, key))}
    return section


def _mix_preflight(engine: EngineView) -> None:
    cfg = engine.cfg
    names = [s.name for s in cfg.sources]
    for src in cfg.mixer.weights:
        if names and src not in names:
            raise OlmoflowError(f"mixer.weights: {unknown_name_error('source', src, names)}")


def _tokenize_section(engine: EngineView) -> dict[str, Any]:
    t = _asdict(engine.cfg.tokenize)
    t.pop("workers")  # any worker count gives the same bytes
    if engine.cfg.tokenize.tokenizer:
        t["tokenizer_files"] = _stamps([engine.cfg.tokenize.tokenizer])
    return t


def _tokenize_preflight(engine: EngineView) -> None:
    from olmoflow.data.tokenize_shards import DTYPES

    t = engine.cfg.tokenize
    if t.dtype not in DTYPES:
        raise unknown_name_error("tokenize.dtype", t.dtype, DTYPES)
    if t.tokenizer and not Path(t.tokenizer).is_dir():
        raise OlmoflowError(f"tokenize.tokenizer: no such directory '{t.tokenizer}'")


def _quality_section(engine: EngineView) -> dict[str, Any]:
    q = engine.cfg.quality
    return {"labeled": _stamps(q.labeled), "options": q.options}


def _tokenizer_section(engine: EngineView) -> dict[str, Any]:
    t = engine.cfg.tokenize
    return {"implementation": t.implementation, "vocab_size": t.vocab_size,
            "min_frequency": t.min_frequency}


def content_hash(entries: list[Any]) -> str:
    """sha256 over the bytes of the files named (files or directories; manifests and hidden files
    left out). Goes into shard tasks whose job reads files besides its input (the tokenizer, the
    quality model, plugin code): the task's done-marker is named by a hash of the task, so a
    retrained tokenizer at the same path makes every shard run again instead of keeping token
    ids from the old one."""
    from olmoflow.artifacts import data_files, sha256_file, sha256_json

    files = sorted({str(f) for e in entries for f in data_files(e)})
    return sha256_json([[f, sha256_file(f)] for f in files])


def _asdict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)  # plain data: fingerprints and manifests are JSON


def _stamps(entries: list[str]) -> list[Any]:
    """``[path, sha256]`` of the files named (files, directories, globs; ``stdlib`` with the
    Python version, ``hf://`` as given), so an edited input invalidates the step even when its
    size and modification time stay the same: the main flow's rerun policy, content hashes."""
    import sys

    from olmoflow.artifacts import sha256_file

    out: list[Any] = []
    for e in entries:
        try:
            files = expand_paths([e])
        except OlmoflowError:
            out.append([e, None])
            continue
        for f in files:
            if f == "stdlib":
                out.append([f, sys.version])
            elif Path(f).is_file():
                out.append([f, sha256_file(f)])
            else:
                out.append([f])
    return out


def _source_stamps(name: str, paths: list[str], options: SourceOptions) -> list[Any]:
    """:func:`_stamps` of the files ingest reads for one source: the same plan as its tasks, so a
    link out of a source directory (skipped unless ``follow_symlinks``) is not hashed either;
    files by their real path, which is what is read."""
    import logging
    import sys

    from olmoflow.artifacts import sha256_file
    from olmoflow.data.sources import plan_inputs

    quiet = logging.getLogger("olmoflow.data.sources")
    was, quiet.disabled = quiet.disabled, True  # the step's own planning says it once
    try:
        inputs = plan_inputs(paths, label=name,
                             follow_symlinks=options.follow_symlinks)
    except OlmoflowError:
        return [[e, None] for e in paths]  # the step itself names the problem
    finally:
        quiet.disabled = was
    out: list[Any] = []
    for inp in inputs:
        if inp.path is None:
            out.append([inp.spec or "stdlib", sys.version if inp.format == "stdlib" else None])
        else:
            real = os.path.realpath(inp.path)
            out.append([real, sha256_file(real) if os.path.isfile(real) else None])
    return out


def _finish(engine: EngineView, step: str, tasks: list[dict[str, Any]],
            results: list[dict[str, Any]], shards: list[dict[str, str]],
            inputs: list[Path], extra_counts: dict[str, Any] | None = None
            ) -> tuple[StageResult, dict[str, Any]]:
    out = engine.step_dir(step)
    extra_counts = dict(extra_counts or {})
    errors = error_examples(results)
    if isinstance(extra_counts.get("errors"), list):  # a global step's own list of bad lines
        errors = (errors + extra_counts.pop("errors"))[:20]
    counts = {**step_stats(tasks, results), **extra_counts}
    outputs = [out / s["path"] for s in shards]
    return (StageResult(inputs=inputs, outputs=outputs, counts=counts),
            {"shards": shards, "errors": errors})


def _doc_shards(engine: EngineView) -> list[dict[str, str]]:
    return engine.shards("ingest")


def _rel(engine: EngineView, step: str, shard: dict[str, str]) -> str:
    return Path(shard["path"]).relative_to(engine.step_dir(step)).as_posix()


# ---- ingest --------------------------------------------------------------------------------------


def run_ingest(engine: EngineView):
    from olmoflow.data.sources import ingest_shard, ingest_tasks

    cfg, out = engine.cfg, engine.step_dir("ingest")
    if not cfg.sources:
        raise OlmoflowError("the config has no 'sources' to ingest")
    tasks = []
    for s in cfg.sources:
        tasks += ingest_tasks(s.name, s.paths, out, options=s.options, strict=cfg.strict)
    results = engine.run_jobs("ingest", ingest_shard, tasks)
    shards = [{"source": t["source"], "path": Path(o).relative_to(out).as_posix()}
              for t, r in zip(tasks, results) for o in r["outputs"]]
    shards.sort(key=lambda s: s["path"])  # corpus order, as dedup and the mixer list shards
    # Shards of sources or files no longer in the config would be read by the later steps.
    keep = {s["path"] for s in shards}
    for p in out.rglob("*.jsonl.gz"):
        if p.relative_to(out).as_posix() not in keep:
            p.unlink()
    # Real paths: a link's target is what was read, and what the lineage must lead back to.
    inputs = list(dict.fromkeys(Path(os.path.realpath(t["input"])) for t in tasks
                                if Path(t["input"]).is_file()))
    if not any(r.get("documents_out") for r in results):
        raise OlmoflowError(_no_documents(tasks, results))
    unverifiable = [u for r in results for u in r.get("unverifiable") or []]
    return _finish(engine, "ingest", tasks, results, shards, inputs,
                   {"unverifiable": unverifiable})


def _no_documents(tasks: list[dict[str, Any]], results: list[dict[str, Any]]) -> str:
    """Why ingest kept nothing: the bad input by kind and the first example, so that a wrong
    ``text_field`` or a folder of empty files is named now rather than as a puzzle in a later
    step."""
    kinds: dict[str, int] = {}
    for r in results:
        for k, n in (r.get("error_counts") or {}).items():
            kinds[k] = kinds.get(k, 0) + n
    first = next((e for r in results for e in r.get("errors") or []), None)
    what = ", ".join(f"{k} {n:,}" for k, n in sorted(kinds.items())) or "no records"
    return (f"ingest read no usable document from {len(tasks)} input file(s) ({what})"
            + (f"; first: {first}" if first else "")
            + "; check the source paths and options such as text_field")


# ---- tag -----------------------------------------------------------------------------------------


def quality_model(engine: EngineView) -> str | None:
    """The quality classifier the ``quality`` tagger uses: ``quality.model``, or the one the
    ``train-quality`` step trained from ``quality.labeled`` into ``DIR/quality``."""
    q = engine.cfg.quality
    if q.model:
        return str(Path(q.model).resolve())
    return str(engine.step_dir("train-quality")) if q.labeled else None


def run_train_quality(engine: EngineView):
    """Train the quality classifier on ``quality.labeled`` into ``DIR/quality`` (a part of the
    tag step: run before it, and again only when the labels or options change)."""
    from olmoflow.data.taggers.quality import MODEL_FILE, REPORT_FILE, train_quality

    q, out = engine.cfg.quality, engine.step_dir("train-quality")
    files = expand_paths(q.labeled)
    res = train_quality(files, out, **q.options)
    counts = {k: v for k, v in res.items() if k != "errors"}
    return (StageResult(inputs=[Path(f) for f in files],
                        outputs=[out / MODEL_FILE, out / REPORT_FILE], counts=counts), {})


def tag_with_plugins(task: dict[str, Any]) -> dict[str, Any]:
    """Shard job: import ``task["plugins"]`` (user taggers) in this worker, then
    :func:`olmoflow.data.taggers.tag_shard`."""
    from olmoflow.data.taggers import tag_shard

    import_plugins(task.get("plugins") or [])
    return tag_shard(task)


def run_tag(engine: EngineView):
    cfg, out = engine.cfg, engine.step_dir("tag")
    if not cfg.taggers:
        raise OlmoflowError("the config lists no 'taggers'")
    plugins = [str(Path(p).resolve()) if p.endswith(".py") else p for p in cfg.plugins]
    import_plugins(plugins)  # fail here, once, rather than in every worker
    model = quality_model(engine)
    taggers = with_quality_model(cfg.taggers, model)
    deps = content_hash([p for p in plugins if p.endswith(".py")] + ([model] if model else []))
    tasks = []
    for s in _doc_shards(engine):
        rel = _rel(engine, "ingest", s)
        tasks.append({"documents": s["path"], "source": s["source"], "output": str(out / rel),
                      "taggers": taggers, "strict": cfg.strict, "plugins": plugins,
                      "depends": deps})
    results = engine.run_jobs("tag", tag_with_plugins, tasks)
    from olmoflow.artifacts import data_files

    # The quality model (and plugin code) shape the attributes: inputs too, for the lineage.
    extra = data_files(model) if model else []
    extra += [Path(p) for p in plugins if p.endswith(".py")]
    return _finish(engine, "tag", tasks, results, relative_shards(out, tasks),
                   [Path(t["documents"]) for t in tasks] + extra)


def with_quality_model(taggers: list[Any], model: str | None) -> list[Any]:
    """The tagger specs with ``model`` set on a ``quality`` tagger that names none."""
    if model is None:
        return taggers
    out = []
    for spec in taggers:
        if spec == "quality":
            spec = {"quality": {"model": model}}
        elif isinstance(spec, dict) and "quality" in spec:
            opts = dict(spec["quality"] or {})
            opts.setdefault("model", model)
            spec = {**spec, "quality": opts}
        out.append(spec)
    return out


# ---- dedup and decontamination (map, reduce in the driver, map) ----------------------------------


def _run_global(engine: EngineView, step: str, run, cfg, extra_inputs: list[Path] | None = None):
    """A global step over every ingested shard: ``run(cfg, tasks, root, run_jobs, strict=)`` is
    :func:`olmoflow.data.dedup.run_dedup` or :func:`olmoflow.data.decontam.run_decontam` (their
    map phase, the reduce in this driver, and the attribute-writing phase). ``extra_inputs``: the
    files it reads besides the documents (the eval sets), listed in its manifest."""
    out = engine.step_dir(step)
    tasks = [{"input": s["path"], "source": s["source"],
              "output": str(out / _rel(engine, "ingest", s))} for s in _doc_shards(engine)]

    # The modules name their jobs after their attribute set ("decontam"); the markers belong to
    # the engine's step, where --force clears them.
    def run_jobs(_set: str, fn, jobs, **kw):
        return engine.run_jobs(step, fn, jobs, **kw)

    res = run(cfg, tasks, engine.root, run_jobs, strict=engine.cfg.strict)
    return _finish(engine, step, tasks, res["results"], relative_shards(out, tasks),
                   [Path(t["input"]) for t in tasks] + list(extra_inputs or []),
                   res.get("counts"))


def run_dedup(engine: EngineView):
    from olmoflow.data import dedup

    return _run_global(engine, "dedup", dedup.run_dedup, engine.cfg.dedup)


def run_decontaminate(engine: EngineView):
    from olmoflow.data import decontam

    cfg = engine.cfg.decontaminate
    evals = [Path(f) for f in cfg.eval_files() if Path(f).is_file()]
    return _run_global(engine, "decontaminate", decontam.run_decontam, cfg, evals)


# ---- mix -----------------------------------------------------------------------------------------


def attribute_sets(engine: EngineView) -> list[str]:
    """Attribute sets present for the mixer: those of the finished tag / dedup / decontam steps."""
    sets = []
    for step in ("tag", "dedup", "decontaminate"):
        if read_manifest(engine.step_dir(step)) is not None:
            sets.append(engine.step_dir(step).name)
    return sets


def attribute_files(engine: EngineView, options: MixConfig) -> list[Path]:
    """The attribute files the mixer read (those of the sets in ``options.attributes``), so the
    mix manifest, and the lineage through it, reach the tag, dedup and decontaminate steps."""
    wanted = set(options.attributes or [])
    files = []
    for step in ("tag", "dedup", "decontaminate"):
        if engine.step_dir(step).name in wanted and read_manifest(engine.step_dir(step)):
            files += [Path(s["path"]) for s in engine.shards(step) if Path(s["path"]).is_file()]
    return files


def mixer_options(engine: EngineView) -> MixConfig:
    """The mixer config with what dedup and decontaminate ask for merged in: their attribute
    sets, their ``exclude`` rules (dedup: every flagged copy; decontaminate with ``action:
    drop``: contaminated documents) and ``remove_spans`` (duplicate paragraphs). ``attributes``
    defaults to every attribute set the finished steps wrote."""
    from olmoflow.data import decontam, dedup
    from olmoflow.data.rules import parse_rule

    cfg = engine.cfg.mixer
    sets = attribute_sets(engine)
    merged = {"attributes": list(sets if cfg.attributes is None else cfg.attributes),
              "exclude": list(cfg.exclude), "remove_spans": list(cfg.remove_spans)}
    extra = []
    if "dedup" in sets:
        extra.append(dedup.mixer_rules(engine.cfg.dedup))
    if "decontam" in sets:
        extra.append(decontam.mixer_rules(engine.cfg.decontaminate))
    for rules in extra:
        for key in ("attributes", "exclude", "remove_spans"):
            for r in rules.get(key, []):
                item = parse_rule(r, f"mixer.{key}") if key == "exclude" else r
                if item not in merged[key]:
                    merged[key].append(item)
    return dataclasses.replace(cfg, **merged)


def run_mix(engine: EngineView):
    from olmoflow.data import mixer

    cfg, out = engine.cfg, engine.step_dir("mix")
    options = mixer_options(engine)
    summary = mixer.mix(engine.root, options, executor=cfg.executor, workers=cfg.workers,
                        strict=cfg.strict, progress=engine.progress)
    parts = sorted(Path(o) for o in summary.pop("outputs") if Path(o).is_relative_to(out))
    shards = [{"source": p.relative_to(out).parts[0], "path": p.relative_to(out).as_posix()}
              for p in parts]
    counts = dict(summary)
    counts["sources"] = counts.pop("per_source", {})
    counts["shards"] = len(parts)
    errors = counts.get("errors") or []
    counts["errors"] = len(errors)
    for sc in counts["sources"].values():
        sc["errors"] = len(sc.get("errors") or [])
    inputs = [Path(s["path"]) for s in _doc_shards(engine)] + attribute_files(engine, options)
    return (StageResult(inputs=inputs, outputs=parts, counts=counts),
            {"shards": shards, "errors": errors[:20]})


# ---- tokenize ------------------------------------------------------------------------------------


def tokenizer_dir(engine: EngineView) -> tuple[str, list[Path]]:
    """The tokenizer to use and the files it consists of: ``tokenize.tokenizer``, else the one
    the ``train-tokenizer`` step trained on the mixed documents into ``DIR/tokenizer``."""
    from olmoflow.artifacts import data_files

    t = engine.cfg.tokenize
    if t.tokenizer:
        d = Path(t.tokenizer).resolve()
        if not (d / "tokenizer.json").is_file() and t.implementation == "bpe":
            raise OlmoflowError(f"tokenize.tokenizer: no tokenizer.json in {d}")
        return str(d), data_files(d)
    out = engine.step_dir("train-tokenizer")
    return str(out), data_files(out)


def run_train_tokenizer(engine: EngineView):
    """Train a tokenizer of ``tokenize.implementation`` and ``vocab_size`` on the mixed documents
    into ``DIR/tokenizer`` with the main flow's trainer
    (:func:`olmoflow.tokenizer.train.train_tokenizer`); a part of the tokenize step when
    ``tokenize.tokenizer`` is not given."""
    from olmoflow.data.documents import document_texts
    from olmoflow.tokenizer.config import TokenizerConfig
    from olmoflow.tokenizer.train import train_tokenizer

    out = engine.step_dir("train-tokenizer")
    mixed = [Path(s["path"]) for s in engine.shards("mix")]
    res = train_tokenizer(TokenizerConfig(**_tokenizer_section(engine)), document_texts(mixed),
                          out, progress=engine.progress, files=mixed)
    return res, {}


def choose_heldout_parts(engine: EngineView, mixed: list[dict[str, str]]) -> list[list[int]]:
    """Per mixed shard, the positions of its held-out documents: the main flow's rule
    (:func:`olmoflow.data.tokenize.choose_heldout` on ``heldout_score(seed, id)``) over the whole
    corpus, so the split depends neither on sharding nor on the number of workers."""
    from olmoflow.data.documents import read_documents
    from olmoflow.data.tokenize import choose_heldout, heldout_score

    t = engine.cfg.tokenize
    scores, where = [], []
    for i, s in enumerate(mixed):
        for j, d in enumerate(read_documents(s["path"])):
            scores.append((heldout_score(t.seed, str(d["id"])), len(where)))
            where.append((i, j))
    parts: list[list[int]] = [[] for _ in mixed]
    for g in sorted(choose_heldout(scores, t.heldout_fraction, t.heldout_max_documents)):
        i, j = where[g]
        parts[i].append(j)
    return parts


def run_tokenize(engine: EngineView):
    from olmoflow.data.tokenize import SPLITS, check_heldout_config, check_token_dir, write_meta
    from olmoflow.data.tokenize_shards import load_tokenizer, resolve_dtype, tokenize_shard

    t, out = engine.cfg.tokenize, engine.step_dir("tokenize")
    mixed = engine.shards("mix")
    if not mixed:
        raise OlmoflowError(f"nothing to tokenize: the mixer kept no document (see 'olmoflow "
                            f"data report {engine.root}' for the rules that removed them)")
    check_heldout_config(t.heldout_fraction, t.heldout_max_documents)
    tok_dir, tok_files = tokenizer_dir(engine)
    tok = load_tokenizer(tok_dir, t.implementation)
    dtype = resolve_dtype(t.dtype, tok.vocab_size)
    heldout = choose_heldout_parts(engine, mixed)
    deps = content_hash(tok_files)
    tasks = []
    for s, held in zip(mixed, heldout):
        rel = _rel(engine, "mix", s).removesuffix(DOC_SUFFIX)
        tasks.append({"input": s["path"], "source": s["source"],
                      "parts": {sp: str(out / sp / f"{rel}.npy") for sp in SPLITS},
                      "heldout": held, "tokenizer": tok_dir, "implementation": t.implementation,
                      "dtype": t.dtype, "depends": deps})
    results = engine.run_jobs("tokenize", tokenize_shard, tasks, workers=t.workers)
    parts = [{sp: Path(x["parts"][sp]) for sp in SPLITS} for x in tasks]
    meta = write_meta(out, tok, dtype, parts, [r["splits"] for r in results],
                      tokenizer_dir=tok_dir, implementation=t.implementation,
                      heldout={"seed": t.seed, "fraction": t.heldout_fraction,
                               "max_documents": t.heldout_max_documents})
    mix_counts = (read_manifest(engine.step_dir("mix")) or {}).get("counts", {})
    checked = check_token_dir(out, expected_documents=mix_counts.get("documents_out"))
    split_counts = {f"{sp}_{k}": meta["splits"][sp][k] for sp in SPLITS
                    for k in ("tokens", "documents")}
    shards = [{"source": x["source"], "path": Path(x["parts"]["train"]).relative_to(out).as_posix()}
              for x in tasks]
    res, extra = _finish(engine, "tokenize", tasks, results, shards,
                         [Path(x["input"]) for x in tasks] + tok_files,
                         {"tokens": checked["tokens"], "dtype": dtype.name,
                          "vocab_size": tok.vocab_size, "tokenizer": tok_dir, **split_counts})
    res.outputs = [Path(o) for r in results for o in r["outputs"]] + [out / "meta.json"]
    return res, extra


# ---- the table -----------------------------------------------------------------------------------

_DOCS = ("ingest",)
#: Every step, in the order they run (a ``part_of`` step just before the step it is part of).
STEPS: tuple[Step, ...] = (
    Step("ingest", "documents", (), _ingest_section, run_ingest, _ingest_preflight),
    Step("train-quality", "quality", (), _quality_section, run_train_quality, part_of="tag",
         enabled=lambda cfg: bool(cfg.quality.labeled) and not cfg.quality.model),
    Step("tag", "attributes/tags", _DOCS, _tag_section, run_tag, _tag_preflight),
    Step("dedup", "attributes/dedup", _DOCS, _section("dedup"), run_dedup,
         work_dir="work/dedup"),
    Step("decontaminate", "attributes/decontam", _DOCS, _section("decontaminate"),
         run_decontaminate, work_dir="work/decontam"),
    Step("mix", "mixed", ("ingest", "tag", "dedup", "decontaminate"), _section("mixer"), run_mix,
         _mix_preflight, work_dir="work/mix"),
    Step("train-tokenizer", "tokenizer", ("mix",), _tokenizer_section, run_train_tokenizer,
         part_of="tokenize", enabled=lambda cfg: not cfg.tokenize.tokenizer),
    Step("tokenize", "tokens", ("mix",), _tokenize_section, run_tokenize, _tokenize_preflight),
)
#: By name.
STEP_TABLE: dict[str, Step] = {s.name: s for s in STEPS}
#: The steps a config's ``steps`` lists (and ``olmoflow data STEP`` runs), in order.
STEP_NAMES: tuple[str, ...] = tuple(s.name for s in STEPS if s.part_of is None)
#: Where each step writes (its manifest.json lies there).
STEP_DIRS: dict[str, str] = {s.name: s.directory for s in STEPS}


def parts(step: str, table: tuple[Step, ...] = STEPS) -> list[Step]:
    """The ``part_of`` steps of ``step`` in ``table``, in table order."""
    return [s for s in table if s.part_of == step]


def enabled_steps(cfg: DataConfig, wanted: list[str], table: tuple[Step, ...] = STEPS
                  ) -> list[Step]:
    """The steps of ``table`` that run for ``wanted`` (names of its steps that are no part of
    another), in table order: each wanted step, preceded by its enabled parts."""
    return [s for s in table
            if (s.part_of is None and s.name in wanted)
            or (s.part_of in wanted and (s.enabled is None or s.enabled(cfg)))]
