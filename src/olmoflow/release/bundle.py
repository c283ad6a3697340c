"""The release bundle: a Hugging Face model directory plus everything that made the model.

Layout (DESIGN.md, "Formats"): ``config.json``, ``model.safetensors``, ``generation_config.json``,
``tokenizer.json`` + ``tokenizer_config.json``, ``training_log.jsonl`` and ``plots/``, ``eval/``
(the held-out ``report.json`` and, when tasks were scored, ``results.jsonl``, ``report.md``,
``heatmap.png``, ``curves.png``), ``posttrain/<stage>/training_log.jsonl``, ``checkpoints/<name>/``
(every kept checkpoint of every training stage in Hugging Face layout) and ``checkpoints.csv``
(:mod:`olmoflow.release.checkpoints`), ``data_manifest.json`` (the manifests of the data back to
the raw sources, and each post-training stage's data files), ``config.yaml``, the environment
(``environment.json``, ``environment.txt``, ``requirements.lock``, ``Dockerfile``:
:mod:`olmoflow.release.environment`), a ``README.md`` model card, and last ``files.json``, the
sha256 of every other file (``olmoflow verify``), whose own sha256 is the release digest the card
states (:mod:`olmoflow.release.index`).

The bundle takes its own config section and the files it copies; which run directory and stages
they come from is the pipeline's business (``olmoflow.pipeline.stages.release``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from olmoflow.artifacts import (
    StageResult,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    data_files,
    environment,
    git_commit,
)
from olmoflow.errors import OlmoflowError
from olmoflow.release.card import model_card
from olmoflow.release.config import ReleaseConfig
from olmoflow.run_dir import RunDir

#: what the release copies from the evaluate stage's directory besides report.json, when there.
EVAL_FILES = ("results.jsonl", "report.md", "heatmap.png", "curves.png")


def final_task_scores(results: Path) -> list[dict[str, Any]]:
    """The rows of ``results.jsonl`` (one per checkpoint x task) of its last checkpoint by step,
    in file order: what the model card's scores table shows. Empty when the file is absent.

    Raises:
        OlmoflowError: the file is not JSON lines.
    """
    if not results.is_file():
        return []
    try:
        rows = [json.loads(ln) for ln in results.read_text().splitlines() if ln.strip()]
    except ValueError as e:
        raise OlmoflowError(f"{results}: not JSON lines ({e}); rerun 'olmoflow evaluate'") \
            from None
    if not rows:
        return []
    last = max((r.get("step", 0), r.get("checkpoint", "")) for r in rows)
    return [r for r in rows if (r.get("step", 0), r.get("checkpoint", "")) == last]


def _plots(runs: RunDir, stages: list[str], out: Path) -> list[Path]:
    """``olmoflow plot`` of each training stage's log into ``out/plots/<stage>/`` (a stage whose
    log has nothing to draw is left out)."""
    from olmoflow.train.plot import plot_run

    written = []
    for stage in stages:
        log = runs.training_log(stage)
        if log.is_file():
            try:
                written += plot_run(log, out / "plots" / stage)
            except OlmoflowError:  # a log without numbers to draw: nothing to show
                continue
    return written


def build_release(cfg: ReleaseConfig, model, tokenizer, out: Path, *, runs: RunDir,
                  training_stage: str, checkpoint: Path, tokenizer_dir: Path, eval_report: Path,
                  data_manifest: dict[str, Any], data_summary: dict[str, Any],
                  config_yaml: str, eval_dir: Path | None = None,
                  posttraining: list[dict[str, Any]] | None = None,
                  stage_tokenizers: dict[str, tuple[Any, Path]] | None = None) -> StageResult:
    """Write the release bundle of ``model`` into ``out``.

    Args:
        cfg: the ``release`` section (name and license for the model card).
        model: the :class:`olmoflow.model.olmo.Olmo` loaded from ``checkpoint``.
        tokenizer: its tokenizer (EOS and pad ids for ``generation_config.json``).
        runs: the run directory (checkpoint paths in ``checkpoints.csv`` are relative to it).
        training_stage: the stage that trained ``model``: its training log and its checkpoint
            index are copied.
        tokenizer_dir: the directory holding the tokenizer's files.
        eval_report: the evaluation's ``report.json``.
        data_manifest: written as ``data_manifest.json``.
        data_summary: what the model card says of the data (see
            :func:`olmoflow.release.card.model_card`).
        config_yaml: the resolved run config, written as ``config.yaml``.
        eval_dir: the evaluate stage's directory: its :data:`EVAL_FILES` that exist are copied
            into ``eval/`` and the final checkpoint's task scores go into the model card
            (default: the folder of ``eval_report``).
        posttraining: the post-training stages the model went through, in order: dicts with
            ``stage``, ``base``, ``steps``, ``final_loss``, ``data`` and ``log_path`` (their
            training log, copied as ``posttrain/<stage>/training_log.jsonl``).
        stage_tokenizers: ``{training stage: (tokenizer, its directory)}`` of every training stage
            whose kept checkpoints the bundle carries (:mod:`olmoflow.release.checkpoints`), in
            flow order; default: ``training_stage`` alone with ``tokenizer``.
    Returns:
        The stage result: the files read, the files written, ``files`` and ``checkpoint`` counts
        and the release ``digest`` (the sha256 of ``files.json``).
    Raises:
        OlmoflowError: the training log or the evaluation report is missing or unreadable.
    """
    from olmoflow.model.hf import save_hf_dir
    from olmoflow.release.checkpoints import checkpoints_table, release_checkpoints
    from olmoflow.release.environment import dockerfile, environment_record, requirements_lock
    from olmoflow.release.index import FILE_INDEX, write_file_index
    from olmoflow.tokenizer import copy_tokenizer_files

    log = runs.training_log(training_stage)
    for need in (log, eval_report):
        if not need.is_file():
            raise OlmoflowError(f"'{need}' is missing; the release copies it (rerun "
                                "'olmoflow run')")
    try:
        report = json.loads(eval_report.read_text())
    except ValueError as e:
        raise OlmoflowError(f"{eval_report}: not valid JSON ({e}); rerun 'olmoflow evaluate'") \
            from None
    files = save_hf_dir(model, out, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    files += copy_tokenizer_files(tokenizer_dir, out)
    atomic_write_bytes(out / "training_log.jsonl", log.read_bytes())
    atomic_write_json(out / "eval" / "report.json", report)
    eval_dir = Path(eval_report).parent if eval_dir is None else Path(eval_dir)
    copied = [eval_dir / n for n in EVAL_FILES if (eval_dir / n).is_file()]
    for src in copied:
        atomic_write_bytes(out / "eval" / src.name, src.read_bytes())
    scores = final_task_scores(eval_dir / "results.jsonl")
    atomic_write_json(out / "data_manifest.json", data_manifest)
    stage_tokenizers = stage_tokenizers or {training_stage: (tokenizer, tokenizer_dir)}
    stages = list(stage_tokenizers)
    kept = release_checkpoints(runs, stage_tokenizers, out, include=cfg.include_checkpoints)
    atomic_write_text(out / "checkpoints.csv", checkpoints_table(kept))
    files += [f for e in kept if e.path.startswith("checkpoints/")
              for f in sorted((out / e.path).rglob("*")) if f.is_file()]
    plots = _plots(runs, stages, out) if cfg.plots else []
    files += plots
    env = {**environment(), "olmoflow_git_commit": git_commit() or "unknown",
           "checkpoint": checkpoint.name}
    atomic_write_text(out / "environment.txt", "".join(f"{k}: {v}\n" for k, v in env.items()))
    record = environment_record()
    atomic_write_json(out / "environment.json", record)
    atomic_write_text(out / "requirements.lock", requirements_lock(record["packages"]))
    atomic_write_text(out / "Dockerfile", dockerfile(record))
    atomic_write_text(out / "config.yaml", config_yaml)
    post = []
    post_logs: list[Path] = []
    for p in posttraining or []:
        entry = {k: v for k, v in p.items() if k != "log_path"}
        src = Path(p["log_path"])
        if src.is_file():
            dst = out / "posttrain" / p["stage"] / "training_log.jsonl"
            atomic_write_bytes(dst, src.read_bytes())
            entry["log"] = dst.relative_to(out).as_posix()
            post_logs += [src]
            files.append(dst)
        post.append(entry)
    atomic_write_text(out / "README.md", model_card(
        cfg, model, report=report, data=data_summary, release_dir=out, scores=scores,
        heatmap="eval/heatmap.png" if (out / "eval" / "heatmap.png").is_file() else None,
        posttraining=post, checkpoints=kept, environment=record,
        weights_bytes=(out / "model.safetensors").stat().st_size))
    files += [out / n for n in ("training_log.jsonl", "eval/report.json", "data_manifest.json",
                                "checkpoints.csv", "environment.txt", "environment.json",
                                "requirements.lock", "Dockerfile", "config.yaml", "README.md")]
    files += [out / "eval" / src.name for src in copied]
    digest = write_file_index(out, files)  # last: the hashes of everything above
    files.append(out / FILE_INDEX)
    read = [f for e in kept for f in data_files(e.source)]
    return StageResult(inputs=[log, eval_report, *copied, *post_logs, *read], outputs=files,
                       counts={"files": len(files), "checkpoint": checkpoint.name,
                               "digest": digest})
