"""The release stage: the Hugging Face model with everything that made it.

The glue between a run directory and :func:`olmoflow.release.bundle.build_release`: which
checkpoint, tokenizer, training log, evaluation report and data manifests go into the bundle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from olmoflow.artifacts import StageResult, file_record, read_manifest
from olmoflow.errors import OlmoflowError
from olmoflow.pipeline.config import RunConfig, dump_config
from olmoflow.pipeline.models import final_model_stage, first_model_stage, model_chain
from olmoflow.pipeline.stage import FINAL_MODEL, Flag, Stage, flow
from olmoflow.pipeline.stages.common import (
    data_dirs,
    final_tokenizer_dir,
    load_trained_model,
    model_inputs,
    need,
    stage_dir,
    stage_tokenizer,
    token_dirs,
)
from olmoflow.pipeline.stages.eval import EVALUATE, REPORT
from olmoflow.run_dir import RunDir

# What a data stage's manifest contributes to the release's data manifest.
_MANIFEST_KEYS = ("fingerprint", "config", "inputs", "outputs", "counts", "started", "finished")
# What a post-training stage's manifest counts of its data (and any "skipped_*" reason).
_DATA_COUNTS = ("examples", "pairs", "prompts", "heldout_prompts", "rows", "skipped", "truncated",
                "dropped")


def trained_on(cfg: RunConfig) -> list[Path]:
    """The tokens directories the model trained on: ``train.data``, else the run's own."""
    return [Path(d) for d in data_dirs(cfg)] or [stage_dir(cfg, "tokenize")]


def data_manifest(cfg: RunConfig) -> dict[str, Any]:
    """The release's ``data_manifest.json``.

    ``lineage``: for each tokens directory the model trained on, the chain of manifests back to
    every raw source file with its sha256 (:func:`olmoflow.data.lineage.data_lineage`); for a run
    that made its own tokens also, keyed by stage, the manifests of its data stages (the stages
    the pretrained model is made from: collect, clean, train-tokenizer, tokenize; configs, inputs
    and outputs with sha256, counts).
    ``posttrain``: the data each post-training stage read (:func:`posttrain_data`).
    """
    from olmoflow.data.lineage import data_lineage

    out: dict[str, Any] = {}
    if not data_dirs(cfg):
        runs = RunDir(cfg.run_dir)
        found = {s: read_manifest(runs.stage(s))
                 for s in flow().ancestors(first_model_stage(cfg))}
        out = {s: {k: m[k] for k in _MANIFEST_KEYS if k in m} for s, m in found.items() if m}
    out["lineage"] = [data_lineage(d) for d in trained_on(cfg)]
    out["posttrain"] = posttrain_data(cfg)
    return out


def _stage_data(cfg: RunConfig, stage: str) -> tuple[list[Path], dict[str, Any]]:
    """``(files, described)``: the data files post-training stage ``stage`` read (as its run
    function names them) and what it read that is not a file (a generator, processors)."""
    runs = RunDir(cfg.run_dir)
    section = getattr(cfg, stage)
    data = getattr(section, "data", None)
    if data is None:  # prompts: a file, or generated
        p = section.prompts
        return ([Path(p.path)] if p.path else []), ({} if p.path else {"generated": p.source})
    files = [Path(x) for x in data.paths]
    described: dict[str, Any] = {}
    if data.generate:  # built into the stage's directory (pipeline.stages.posttrain)
        files.append(runs.stage(stage) / "data" / f"{data.generate}.jsonl")
        described["generated"] = data.generate
    if data.processors:
        described["processors"] = data.processors
    return files, described


def posttrain_data(cfg: RunConfig) -> list[dict[str, Any]]:
    """The data of each enabled post-training stage, in flow order, from its manifest: ``stage``,
    ``files`` (each data file it read with ``path``, ``bytes`` and ``sha256`` as its manifest
    recorded them when the stage ran: paths relative to the run directory, or absolute),
    ``counts`` (examples, pairs or prompts kept, skipped, truncated, dropped) and, for data that
    is no file, ``generated`` (the generator's name) or ``processors``.

    A data file the manifest does not record (a relative path given from another working
    directory) is hashed as it is now.

    Raises:
        OlmoflowError: such a file no longer exists.
    """
    runs = RunDir(cfg.run_dir)
    out = []
    for stage in [s.name for s in model_chain(cfg)[1:]]:
        m = read_manifest(runs.stage(stage)) or {}
        inputs = {(runs.root / r["path"]).resolve(): r for r in m.get("inputs") or []}
        files, described = _stage_data(cfg, stage)
        records = []
        for f in files:
            rec = inputs.get(f.resolve())
            if rec is None:
                if not f.is_file():
                    raise OlmoflowError(f"{stage}: its data file '{f}' is gone and its manifest "
                                        f"does not record it; rerun 'olmoflow {stage} --force'")
                rec = file_record(f, runs.root)
            records.append({k: rec[k] for k in ("path", "bytes", "sha256")})
        counts = m.get("counts") or {}
        out.append({"stage": stage, "files": records, **described,
                    "counts": {k: v for k, v in counts.items()
                               if k in _DATA_COUNTS or k.startswith("skipped_")}})
    return out


def data_summary(cfg: RunConfig, manifest: dict[str, Any]) -> dict[str, Any]:
    """What the model card says of the data: documents, bytes, sources and token counts."""
    if not data_dirs(cfg):
        collect = manifest.get("collect", {}).get("counts", {})
        tokens = manifest.get("tokenize", {}).get("counts", {})
        return {"documents": collect.get("documents", "?"), "bytes": collect.get("bytes", "?"),
                "sources": list(cfg.collect.sources),
                "train_tokens": tokens.get("train_tokens", "?"),
                "heldout_tokens": tokens.get("heldout_tokens", "?")}
    dirs = token_dirs(cfg)
    splits = [d.meta["splits"] for d in dirs]

    def total(key: str, names: tuple[str, ...] = ("train", "heldout")) -> int:
        return sum(int(s.get(n, {}).get(key) or 0) for s in splits for n in names)

    return {"documents": total("documents"), "bytes": total("bytes"),
            "sources": [f"{d.root}: {_raw_summary(lin)}"
                        for d, lin in zip(dirs, manifest["lineage"], strict=True)],
            "train_tokens": total("tokens", ("train",)),
            "heldout_tokens": total("tokens", ("heldout",))}


def _raw_summary(lineage: dict) -> str:
    """``"7 raw source files, 16 evaluation files read for decontamination"``: raw files that only
    the decontamination step read are the eval sets checked against, not training text."""
    readers: dict[str, set] = {}
    for step in lineage["steps"]:
        for inp in step["inputs"]:
            if inp.get("made_by") is None:
                readers.setdefault(inp["path"], set()).add(step.get("stage"))
    reference = sum(1 for stages in readers.values() if stages == {"decontaminate"})
    text = f"{len(lineage['raw_files']) - reference} raw source file(s)"
    if reference:
        text += f", {reference} evaluation file(s) read for decontamination"
    return text


def posttraining_entries(cfg: RunConfig) -> list[dict[str, Any]]:
    """The enabled post-training stages, in order, as the release records them: where each
    started, on what data, for how many steps, to which loss (from its manifest), and its log."""
    runs = RunDir(cfg.run_dir)
    out = []
    for stage in [s.name for s in model_chain(cfg)[1:]]:
        counts = (read_manifest(runs.stage(stage)) or {}).get("counts", {})
        section = getattr(cfg, stage)
        data = getattr(section, "data", None)
        named = ([Path(p).name for p in data.paths] + ([data.generate] if data.generate else [])
                 if data is not None else [section.prompts.source])
        out.append({"stage": stage, "base": Path(counts.get("base", "?")).name,
                    "data": ", ".join(named), "steps": counts.get("steps", "?"),
                    "final_loss": counts.get("final_loss"),
                    "log_path": str(runs.training_log(stage))})
    return out


def run_release(cfg: RunConfig, progress: bool) -> StageResult:
    """Bundle the model the run ends with (:func:`final_model_stage`) with everything that made
    it: the training log of the pretrained model, every stage of the chain's checkpoints."""
    from olmoflow.release.bundle import build_release

    final = final_model_stage(cfg)
    model, tok, ckpt = load_trained_model(cfg, final)
    manifest = data_manifest(cfg)
    posttraining = posttraining_entries(cfg)
    result = build_release(
        cfg.release, model, tok, stage_dir(cfg, RELEASE.name), runs=RunDir(cfg.run_dir),
        training_stage=first_model_stage(cfg), checkpoint=ckpt,
        tokenizer_dir=final_tokenizer_dir(cfg, final),
        eval_report=need(cfg, EVALUATE.name, REPORT), data_manifest=manifest,
        data_summary=data_summary(cfg, manifest), config_yaml=dump_config(cfg),
        posttraining=posttraining, stage_tokenizers={
            s.name: (stage_tokenizer(cfg, s.name), final_tokenizer_dir(cfg, s.name))
            for s in model_chain(cfg)})
    result.inputs = model_inputs(cfg, ckpt, final) + result.inputs
    return result


def git_repository(cfg: RunConfig) -> None:
    """With ``release.git``: make the complete release a git repository
    (:func:`olmoflow.release.git.git_release`), once its manifest exists, and say so."""
    if not cfg.release.git:
        return
    from olmoflow.release.git import git_release

    print(f"[{RELEASE.name}] git: {git_release(stage_dir(cfg, RELEASE.name)).summary()}",
          flush=True)


RELEASE = Stage("release", run_release, ("release",), (EVALUATE.name,), ("files", "digest"),
                help="bundle the release: weights, logs, eval, data manifest, model card",
                ignore=("release.git",), finish=git_repository,
                flags=(Flag("--git", "release.git", switch=True,
                            help="make the release a git repository: weights in Git LFS, one "
                            "tag per checkpoint (release.git)"),),
                reads=FINAL_MODEL)
