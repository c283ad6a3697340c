"""The release stage: the Hugging Face model with everything that made it."""

from __future__ import annotations

from olmoflow.artifacts import StageResult
from olmoflow.pipeline.config import RunConfig
from olmoflow.pipeline.stage import Stage
from olmoflow.pipeline.stages.common import load_trained_model, stage_dir


def run_release(cfg: RunConfig, progress: bool) -> StageResult:
    from olmoflow.release.bundle import build_release

    model, tok, ckpt = load_trained_model(cfg)
    return build_release(cfg, model, tok, ckpt, stage_dir(cfg, "release"))


RELEASE = Stage("release", run_release, ("release",), ("pretrain", "evaluate"), ("files",),
                help="bundle the release: weights, logs, eval, data manifest, model card")
