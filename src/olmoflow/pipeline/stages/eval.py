"""The evaluation stage: held-out loss, perplexity and bits-per-byte."""

from __future__ import annotations

import numpy as np

from olmoflow.artifacts import StageResult, atomic_write_json, atomic_write_text
from olmoflow.errors import OlmoflowError
from olmoflow.pipeline.config import RunConfig
from olmoflow.pipeline.stage import Stage
from olmoflow.pipeline.stages.common import (
    load_trained_model,
    model_inputs,
    stage_dir,
    token_split,
)

#: the evaluation report, in the stage's directory (the release copies it).
REPORT = "report.json"


def run_evaluate(cfg: RunConfig, progress: bool) -> StageResult:
    """Evaluate the final checkpoint on the held-out split; write ``report.json`` and
    ``report.md``.

    Raises:
        OlmoflowError: the held-out split has nothing to score, or ``evaluate.stride`` exceeds
            the evaluation window.
    """
    from olmoflow.data.loader import open_token_arrays
    from olmoflow.eval.perplexity import evaluate_tokens

    model, tok, ckpt = load_trained_model(cfg)
    paths, dtype = token_split(cfg, "heldout")
    arrays = [np.asarray(a) for a in open_token_arrays(paths, dtype)]
    tokens = np.concatenate(arrays or [np.zeros(0)])
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
    out = stage_dir(cfg, "evaluate")
    atomic_write_json(out / REPORT, report)
    md = ["| metric | value |", "|---|---|"] + [
        f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |"
        for k, v in report.items()
    ]
    atomic_write_text(out / "report.md", "# Held-out evaluation\n\n" + "\n".join(md) + "\n")
    return StageResult(inputs=paths + model_inputs(cfg, ckpt),
                       outputs=[out / REPORT, out / "report.md"], counts=report)


EVALUATE = Stage("evaluate", run_evaluate, ("evaluate",), ("pretrain",),
                 ("loss", "perplexity", "bpb"), help="held-out loss, perplexity and bits-per-byte")
