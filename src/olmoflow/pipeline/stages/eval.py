"""The evaluation stage: held-out loss, perplexity and bits-per-byte of the final checkpoint of
the model its record reads (the pretrained model, the first of the run's model chain), and the
downstream tasks of ``evaluate.tasks`` on that stage's checkpoints ``evaluate.checkpoints`` names
(results cached per checkpoint content and task, so a rerun scores only what is new); and the
in-loop evaluation the pretraining stage runs (``evaluate.in_loop``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from olmoflow.artifacts import StageResult, atomic_write_json
from olmoflow.errors import OlmoflowError
from olmoflow.pipeline.config import RunConfig
from olmoflow.pipeline.models import model_read_by
from olmoflow.pipeline.stage import FIRST_MODEL, Flag, Stage
from olmoflow.pipeline.stages.common import (
    final_tokenizer_dir,
    load_trained_model,
    model_inputs,
    stage_dir,
    token_split,
)
from olmoflow.run_dir import previous_output

#: the evaluation report, in the stage's directory (the release copies it).
REPORT = "report.json"
#: the folder of cached task results, in the stage's directory.
CACHE = "cache"


def task_defaults(cfg: RunConfig, limit: int | None):
    """The :class:`~olmoflow.eval.task.EvalSettings` a spec starts from: ``limit`` documents and
    the ``evaluate`` section's data folder, strictness and network permission."""
    from olmoflow.eval.task import EvalSettings

    e = cfg.evaluate
    return EvalSettings(limit=limit, data_dir=Path(e.data_dir).expanduser() if e.data_dir else None,
                        strict=e.strict, allow_network=e.allow_network)


def _heldout_tokens(cfg: RunConfig, max_tokens: int | None = None) -> np.ndarray:
    from olmoflow.train.loader import open_token_arrays

    paths, dtype = token_split(cfg, "heldout")
    arrays, n = [], 0
    for a in open_token_arrays(paths, dtype):
        if max_tokens is not None and n > max_tokens:
            break
        arrays.append(np.asarray(a))
        n += len(a)
    tokens = np.concatenate(arrays or [np.zeros(0)])
    return tokens if max_tokens is None else tokens[:max_tokens + 1]


def in_loop_callback(cfg: RunConfig, tokenizer: Any):
    """The pretraining stage's in-loop evaluation (``evaluate.in_loop``), or None when off.

    Raises:
        OlmoflowError: a task's data is missing, or there are no held-out tokens for ``bpb``.
    """
    il = cfg.evaluate.in_loop
    if not il.interval or not (il.tasks or il.bpb):
        return None
    from olmoflow.eval.in_loop import InLoopEval
    from olmoflow.eval.spec import resolve

    specs = resolve(il.tasks, task_defaults(cfg, il.limit)) if il.tasks else []
    heldout = _heldout_tokens(cfg, il.bpb_tokens) if il.bpb else None
    return InLoopEval(il.interval, specs, tokenizer, heldout=heldout, bpb_tokens=il.bpb_tokens,
                      sequence_length=cfg.eval_sequence_length,
                      batch_size=cfg.evaluate.batch_size)


def _tasks_and_checkpoints(cfg: RunConfig):
    """``evaluate.tasks`` resolved and ``evaluate.checkpoints`` looked up: done before the
    held-out evaluation, so a misspelt task or a missing checkpoint fails in a second, not
    after minutes of scoring.

    Raises:
        OlmoflowError: an unknown task, or a checkpoint that is not there.
    """
    from olmoflow.eval.checkpoints import select_checkpoints
    from olmoflow.eval.spec import resolve

    e = cfg.evaluate
    return (resolve(e.tasks, task_defaults(cfg, e.limit)),
            select_checkpoints(stage_dir(cfg, model_read_by(cfg, EVALUATE.name)), e.checkpoints))


def _score_tasks(cfg: RunConfig, tok: Any, out: Path, progress: bool, specs: list[Any],
                 ckpts: list[Any]):
    """Score ``specs`` on ``ckpts`` (see :func:`_tasks_and_checkpoints`); returns (rows,
    scored)."""
    import torch

    from olmoflow.eval.checkpoints import ResultCache, directory_hash, score_checkpoints
    from olmoflow.eval.scorer import OlmoflowLM
    from olmoflow.model.load import load_model

    e = cfg.evaluate
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def load(ckpt):
        model = load_model(ckpt.path, tokenizer=tok, device=device).model
        return OlmoflowLM(model, tok, batch_size=e.batch_size, max_length=cfg.eval_sequence_length)

    # a rerun's previous output is set aside by the runner: its cached results are still good
    cache = ResultCache(out / CACHE, [previous_output(out) / CACHE])
    rows, scored = score_checkpoints(
        ckpts, specs, load, cache, max_length=cfg.eval_sequence_length,
        tokenizer_hash=directory_hash(final_tokenizer_dir(cfg, model_read_by(cfg, EVALUATE.name))),
        log=(lambda m: print(f"[evaluate] {m}", flush=True)) if progress else None)
    return rows, scored


def run_evaluate(cfg: RunConfig, progress: bool) -> StageResult:
    """Evaluate the final checkpoint on the held-out split (``report.json``); score
    ``evaluate.tasks`` on the chosen checkpoints (``results.jsonl``, ``heatmap.png``,
    ``curves.png``); ``report.md`` holds both.

    Raises:
        OlmoflowError: the held-out split has nothing to score, ``evaluate.stride`` exceeds the
            evaluation window, a checkpoint named in ``evaluate.checkpoints`` is not there, or a
            task's data is missing.
    """
    from olmoflow.eval.perplexity import evaluate_tokens
    from olmoflow.eval.report import write_reports

    planned = _tasks_and_checkpoints(cfg) if cfg.evaluate.tasks else None
    scored_stage = model_read_by(cfg, EVALUATE.name)  # the checkpoints scored are its
    model, tok, ckpt = load_trained_model(cfg, scored_stage)
    paths, _ = token_split(cfg, "heldout")
    tokens = _heldout_tokens(cfg)
    seq, stride = cfg.eval_sequence_length, cfg.evaluate.stride
    if stride is not None and stride > seq:
        # evaluate.sequence_length may be unset (the training length): checked once it is known
        raise OlmoflowError(f"evaluate.stride={stride} exceeds the evaluation window of {seq} "
                            "tokens (evaluate.sequence_length, else train.sequence_length)")
    try:
        report = evaluate_tokens(lambda x: model(x).logits, tokens, tok.token_byte_lengths(),
                                 sequence_length=seq, stride=stride,
                                 batch_size=cfg.evaluate.batch_size,
                                 max_tokens=cfg.evaluate.max_tokens)
    except ValueError as e:
        raise OlmoflowError(f"evaluate: {e}") from None
    # the window, the stride and the count of scored targets travel with the numbers
    report = {"checkpoint": ckpt.name, "split": "heldout", **report}
    out = stage_dir(cfg, EVALUATE.name)
    atomic_write_json(out / REPORT, report)
    inputs = list(paths) + model_inputs(cfg, ckpt, scored_stage)
    counts: dict[str, Any] = dict(report)
    rows: list[dict] = []
    if planned is not None:
        del model  # one model in memory at a time
        specs, ckpts = planned
        rows, scored = _score_tasks(cfg, tok, out, progress, specs, ckpts)
        for c in ckpts:
            inputs += model_inputs(cfg, c.path, scored_stage)
        counts.update(tasks=len({r["task"] for r in rows}), checkpoints=len(ckpts),
                      scored=scored, cached=len(rows) - scored)
    outputs = [out / REPORT] + write_reports(rows, out, heldout=report)
    return StageResult(inputs=list(dict.fromkeys(inputs)), outputs=outputs, counts=counts)


EVALUATE = Stage(
    "evaluate", run_evaluate, ("evaluate",), (),
    ("loss", "perplexity", "bpb", "tasks", "checkpoints", "scored"),
    help="held-out loss, perplexity and bits-per-byte; downstream tasks across checkpoints",
    directory="eval", reads=FIRST_MODEL,
    # in-loop evaluation runs inside pretraining: it changes nothing this stage makes
    ignore=("evaluate.in_loop",),
    flags=(Flag("--tasks", "evaluate.tasks", "task specs, e.g. arc_easy,hellaswag:limit=100 or "
                "all (repeatable)", repeat=True),
           Flag("--checkpoints", "evaluate.checkpoints",
                "latest, all, or a comma list of checkpoint names or steps"),
           Flag("--limit", "evaluate.limit", "documents per task (when a spec gives none)",
                type=int)))
