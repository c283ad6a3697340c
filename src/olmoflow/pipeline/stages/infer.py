"""The generate stage: sample text continuations from the model its record reads (the pretrained
model, the first of the run's model chain)."""

from __future__ import annotations

import json

import torch

from olmoflow.artifacts import StageResult, atomic_write_text
from olmoflow.pipeline.config import RunConfig
from olmoflow.pipeline.models import model_read_by
from olmoflow.pipeline.stage import FIRST_MODEL, Flag, Stage
from olmoflow.pipeline.stages.common import load_trained_model, model_inputs, stage_dir

SAMPLES = "samples.jsonl"


def run_generate(cfg: RunConfig, progress: bool) -> StageResult:
    # Raw-text continuations are what a pretrained model is for; a post-trained one answers
    # turns of its chat template (olmoflow chat) and may end its turn at once on a bare prefix.
    stage = model_read_by(cfg, GENERATE.name)
    model, tok, ckpt = load_trained_model(cfg, stage)
    g = cfg.generate
    samples = []
    speculative = g.speculative_kwargs()
    drafted = accepted = 0
    for i, prompt in enumerate(g.prompts):
        # An empty prompt starts a fresh document: the model's context is a document boundary.
        ids = torch.tensor([tok.encode(prompt) or [tok.eos_token_id]])
        out = model.generate(ids, sampling=g.sampling(i), eos_token_id=tok.eos_token_id,
                             vocab_size=tok.vocab_size, **speculative)
        if speculative:
            out, stats = out
            drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        samples.append({"prompt": prompt, "completion": tok.decode(out[0, ids.shape[1]:].tolist())})
    out_dir = stage_dir(cfg, GENERATE.name)
    atomic_write_text(out_dir / SAMPLES, "".join(json.dumps(s) + "\n" for s in samples))
    counts = {"samples": len(samples), "checkpoint": ckpt.name}
    if speculative:
        counts.update(draft_tokens=drafted, accepted_draft_tokens=accepted)
        if progress:
            rate = f"{accepted / drafted:.1%}" if drafted else "n/a"
            print(f"[generate] speculative decoding ({g.speculative}): {accepted}/{drafted} "
                  f"draft tokens accepted ({rate})", flush=True)
    return StageResult(inputs=model_inputs(cfg, ckpt, stage), outputs=[out_dir / SAMPLES],
                       counts=counts)


def show_samples(cfg: RunConfig) -> None:
    """Print the samples the generate stage wrote (nothing when it wrote none)."""
    path = stage_dir(cfg, GENERATE.name) / SAMPLES
    if not path.is_file():
        return
    print("\nGenerated text:")
    for line in path.read_text().splitlines():
        s = json.loads(line)
        print(f"--- prompt: {s['prompt']!r}\n{s['prompt']}{s['completion']}")


GENERATE = Stage(
    "generate", run_generate, ("generate",), (), ("samples",),
    help="sample text from the pretrained model", show=show_samples, reads=FIRST_MODEL,
    flags=(Flag("--prompt", "generate.prompts", "a prompt (repeatable)", repeat=True,
                forces_rerun=True),
           Flag("--max-new-tokens", "generate.max_new_tokens", "tokens to sample per prompt",
                type=int),
           Flag("--speculative", "generate.speculative",
                "speculative decoding: none or prompt_lookup "
                "(up to generate.num_draft_tokens per step)")))
