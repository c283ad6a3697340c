"""The generate stage: sample from the trained model."""

from __future__ import annotations

import json

import torch

from olmoflow.artifacts import StageResult, atomic_write_text
from olmoflow.pipeline.config import RunConfig
from olmoflow.pipeline.stage import Stage
from olmoflow.pipeline.stages.common import load_trained_model, model_inputs, stage_dir


def run_generate(cfg: RunConfig, progress: bool) -> StageResult:
    model, tok, ckpt = load_trained_model(cfg)
    g = cfg.generate
    samples = []
    for i, prompt in enumerate(g.prompts):
        # An empty prompt starts a fresh document: the model's context is a document boundary.
        ids = torch.tensor([tok.encode(prompt) or [tok.eos_token_id]])
        out = model.generate(ids, sampling=g.sampling(i), eos_token_id=tok.eos_token_id,
                             vocab_size=tok.vocab_size)
        samples.append({"prompt": prompt, "completion": tok.decode(out[0, ids.shape[1]:].tolist())})
    out_dir = stage_dir(cfg, "generate")
    atomic_write_text(out_dir / "samples.jsonl", "".join(json.dumps(s) + "\n" for s in samples))
    return StageResult(inputs=model_inputs(cfg, ckpt), outputs=[out_dir / "samples.jsonl"],
                       counts={"samples": len(samples), "checkpoint": ckpt.name})


GENERATE = Stage("generate", run_generate, ("generate",), ("pretrain",), ("samples",),
                 help="sample text from the trained model")
