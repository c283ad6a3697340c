"""The release bundle: a Hugging Face model directory plus everything that made the model.

Layout (DESIGN.md, "Formats"): ``config.json``, ``model.safetensors``, ``generation_config.json``,
``tokenizer.json`` + ``tokenizer_config.json``, ``training_log.jsonl``, ``eval/report.json``,
``data_manifest.json`` (the manifests of the data stages, back to the raw sources),
``checkpoints.csv``, ``environment.txt``, ``config.yaml`` and a ``README.md`` model card.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from olmoflow.artifacts import (
    StageResult,
    atomic_write_json,
    atomic_write_text,
    environment,
    git_commit,
    read_manifest,
)
from olmoflow.pipeline.config import RunConfig, dump_config
from olmoflow.model.hf import save_hf_dir
from olmoflow.tokenizer import copy_tokenizer_files
from olmoflow.train.checkpoint import list_checkpoints

DATA_STAGES = ("collect", "clean", "train-tokenizer", "tokenize")


def _checkpoints_csv(run_dir: Path) -> str:
    """A row per intermediate checkpoint: step, tokens seen, its path relative to the run
    directory, and the training loss logged at that step (empty when that step was not logged)."""
    pretrain = run_dir / "pretrain"
    losses = {}
    log = pretrain / "metrics.jsonl"
    if log.is_file():
        for line in log.read_text().splitlines():
            m = json.loads(line)
            losses[m["step"]] = m["loss"]
    rows = ["step,tokens,path,loss"]
    for p in list_checkpoints(pretrain):  # both name forms: stage1-step10-tokens6K and step10
        state = torch.load(p / "trainer_state.pt", weights_only=False)
        loss = losses.get(state["step"])
        rows.append(f"{state['step']},{state['tokens_seen']},{p.relative_to(run_dir).as_posix()},"
                    f"{'' if loss is None else f'{loss:.6f}'}")
    return "\n".join(rows) + "\n"


def _model_card(cfg: RunConfig, model, report: dict, data: dict) -> str:
    mc = model.config
    collect = data.get("collect", {}).get("counts", {})
    tokens = data.get("tokenize", {}).get("counts", {})
    arch = "OLMo 3" if mc.sliding_window else "OLMo 2"
    return f"""---
license: {cfg.release.license}
library_name: transformers
tags: [olmo, olmoflow]
---
# {cfg.release.name}

A {model.num_params() / 1e6:.1f}M-parameter {arch}-architecture language model trained with
[olmoflow](https://github.com/) from raw text to this directory. Every file here is traceable:
`data_manifest.json` follows the data back to its sources, `config.yaml` is the resolved config,
`training_log.jsonl` the metrics of every logged step, `eval/report.json` the held-out evaluation.

## Model

| field | value |
|---|---|
| d_model | {mc.d_model} |
| n_layers | {mc.n_layers} |
| n_heads / n_kv_heads | {mc.n_heads} / {mc.n_kv_heads} |
| MLP hidden | {mc.mlp_hidden} |
| vocab (padded) | {mc.vocab_size} |
| sliding window | {mc.sliding_window or "none"} (full attention every {mc.full_attention_every}th and the last layer) |
| RoPE theta | {mc.rope_theta:g} |

## Training data

{collect.get('documents', '?')} documents collected ({collect.get('bytes', '?')} bytes; sources:
{', '.join(cfg.collect.sources)}), tokenized into {tokens.get('train_tokens', '?')} training tokens
and {tokens.get('heldout_tokens', '?')} held-out tokens.

## Evaluation (held-out)

| metric | value |
|---|---|
| loss (nats/token) | {report.get('loss', float('nan')):.4f} |
| perplexity | {report.get('perplexity', float('nan')):.2f} |
| bits per byte | {report.get('bpb', float('nan')):.4f} |

## Use

```python
from olmoflow import Olmo, Tokenizer
model = Olmo.from_pretrained("{cfg.run_dir}/release")
tokenizer = Tokenizer.from_pretrained("{cfg.run_dir}/release")
inputs = tokenizer("def fibonacci(n):", return_tensors="pt")
print(tokenizer.decode(model.generate(inputs.input_ids, max_length=50)[0]))
```

The directory also loads in `transformers` (`AutoModelForCausalLM`, `AutoTokenizer`).
"""


def build_release(cfg: RunConfig, model, tokenizer, checkpoint: Path, out: Path) -> StageResult:
    """Write the release bundle for ``model`` (loaded from ``checkpoint``) into ``out``."""
    run_dir = Path(cfg.run_dir)
    files = save_hf_dir(model, out, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    tok_dir = run_dir / "tokenizer"
    files += copy_tokenizer_files(tok_dir, out)
    metrics = run_dir / "pretrain" / "metrics.jsonl"
    shutil.copyfile(metrics, out / "training_log.jsonl")
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    atomic_write_json(out / "eval" / "report.json", report)
    data = {s: read_manifest(run_dir / d) for s, d in
            (("collect", "collect"), ("clean", "clean"), ("train-tokenizer", "tokenizer"),
             ("tokenize", "tokens"))}
    data = {k: {kk: v[kk] for kk in ("fingerprint", "config", "inputs", "outputs", "counts",
                                     "started", "finished")} for k, v in data.items() if v}
    atomic_write_json(out / "data_manifest.json", data)
    atomic_write_text(out / "checkpoints.csv", _checkpoints_csv(run_dir))
    env = {**environment(), "olmoflow_git_commit": git_commit() or "unknown",
           "checkpoint": checkpoint.name}
    atomic_write_text(out / "environment.txt", "".join(f"{k}: {v}\n" for k, v in env.items()))
    atomic_write_text(out / "config.yaml", dump_config(cfg))
    atomic_write_text(out / "README.md", _model_card(cfg, model, report, data))
    files += [out / n for n in ("training_log.jsonl", "eval/report.json", "data_manifest.json",
                                "checkpoints.csv", "environment.txt", "config.yaml", "README.md")]
    return StageResult(inputs=[checkpoint / "trainer_state.pt"], outputs=files,
                       counts={"files": len(files), "checkpoint": checkpoint.name})
