"""The model card (``README.md``) of a release bundle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from olmoflow.release.config import ReleaseConfig
from olmoflow.release.index import PLACEHOLDER, digest_line

#: the ``[project.urls]`` keys taken as the project's page, in order of preference.
URL_KEYS = ("repository", "source", "homepage")


def project_url() -> str | None:
    """The project's URL as ``pyproject.toml`` gives it (``[project.urls]``: Repository, Source or
    Homepage): from the source checkout's ``pyproject.toml`` when olmoflow runs from one, else
    from the installed package's metadata; None when neither names one (the card then names
    olmoflow without a link)."""
    urls: dict[str, str] = {}
    pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
    try:
        import tomllib

        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
        if project.get("name") == "olmoflow":
            urls = {k.lower(): v for k, v in (project.get("urls") or {}).items()}
    except (ImportError, OSError, ValueError):  # Python 3.10, an installed package
        from importlib import metadata

        try:
            for entry in metadata.metadata("olmoflow").get_all("Project-URL") or []:
                key, _, value = entry.partition(",")
                urls[key.strip().lower()] = value.strip()
        except metadata.PackageNotFoundError:
            pass
    return next((urls[k] for k in URL_KEYS if urls.get(k)), None)


def _fmt(v: Any, digits: int = 4) -> str:
    return f"{v:.{digits}f}" if isinstance(v, float) else ("n/a" if v is None else str(v))


def scores_section(scores: list[dict[str, Any]], heatmap: str | None) -> str:
    """The card's downstream section: the final checkpoint's primary metric per task (value,
    standard error, documents, chance) and the tasks x checkpoints heatmap; empty without
    scores."""
    if not scores:
        return ""
    lines = [f"## Evaluation (downstream tasks, {scores[0].get('checkpoint', 'final')})", "",
             "| task | metric | value | stderr | n | chance |", "|---|---|---|---|---|---|"]
    for r in scores:
        lines.append(f"| {r.get('task')} | {r.get('primary_metric')} | {_fmt(r.get('value'))} | "
                     f"{_fmt(r.get('stderr'))} | {r.get('n')} | {_fmt(r.get('chance'), 3)} |")
    lines += ["", "Every checkpoint's scores are in `eval/results.jsonl` and `eval/report.md`; "
              "`eval/curves.png` draws them against training tokens."]
    if heatmap:
        lines += ["", f"![tasks x checkpoints]({heatmap})"]
    return "\n".join(lines) + "\n\n"


def model_card(cfg: ReleaseConfig, model, *, report: dict[str, Any], data: dict[str, Any],
               release_dir: Path, scores: list[dict[str, Any]] | None = None,
               heatmap: str | None = None,
               posttraining: list[dict[str, Any]] | None = None,
               checkpoints: list[Any] | None = None, weights_bytes: int | None = None,
               environment: dict[str, Any] | None = None) -> str:
    """The model card's Markdown: front matter (license, tags), the model's shape, its training
    data, its held-out evaluation, its downstream scores (with the heatmap), how to load it and
    how to verify it. The release digest is written as
    :data:`~olmoflow.release.index.PLACEHOLDER`, which
    :func:`~olmoflow.release.index.write_file_index` replaces once ``files.json`` exists.

    Args:
        model: the released :class:`olmoflow.model.olmo.Olmo`.
        report: the evaluation report (``loss``, ``perplexity``, ``bpb``; missing ones show NaN).
        data: what the card says of the data: ``documents``, ``bytes``, ``sources`` (a list),
            ``train_tokens``, ``heldout_tokens`` (missing ones show ``?``).
        release_dir: where the release lies, for the loading snippet.
        scores: the final checkpoint's rows of ``eval/results.jsonl`` (``task``,
            ``primary_metric``, ``value``, ``stderr``, ``n``, ``chance``); none: no section.
        heatmap: the heatmap's path relative to the card, embedded under the scores.
        posttraining: one entry per post-training stage the model went through, in order
            (``stage``, ``base``, ``steps``, ``final_loss``, ``data``, ``log``); none: a base
            model.
        checkpoints: the intermediate checkpoints
            (:class:`~olmoflow.release.checkpoints.CheckpointEntry`), with ``weights_bytes`` (the
            final ``model.safetensors``) for the sizes; none: no section.
        environment: the ``environment.json`` record; none: no section.
    """
    mc = model.config
    url = project_url()
    olmoflow = f"[olmoflow]({url})" if url else "olmoflow"
    arch = "OLMo 3" if mc.sliding_window else "OLMo 2"
    window = (f"{mc.sliding_window or 'none'} (full attention every "
              f"{mc.full_attention_every}th and the last layer)")
    nan = float("nan")
    return f"""---
license: {cfg.license}
library_name: transformers
tags: [olmo, olmoflow]
---
# {cfg.name}

A {model.num_params() / 1e6:.1f}M-parameter {arch}-architecture language model trained with
{olmoflow} from raw text to this directory. Every file here is traceable:
`data_manifest.json` follows the data back to its sources (and lists each post-training stage's
data files with their sha256), `config.yaml` is the resolved config,
`training_log.jsonl` the metrics of every logged step, `eval/report.json` the held-out evaluation.

## Model

| field | value |
|---|---|
| d_model | {mc.d_model} |
| n_layers | {mc.n_layers} |
| n_heads / n_kv_heads | {mc.n_heads} / {mc.n_kv_heads} |
| MLP hidden | {mc.mlp_hidden} |
| vocab (padded) | {mc.vocab_size} |
| sliding window | {window} |
| RoPE theta | {mc.rope_theta:g} |

## Training data

{data.get('documents', '?')} documents collected ({data.get('bytes', '?')} bytes; sources:
{', '.join(map(str, data.get('sources', []))) or '?'}), tokenized into \
{data.get('train_tokens', '?')} training tokens
and {data.get('heldout_tokens', '?')} held-out tokens.

## Evaluation (held-out)

| metric | value |
|---|---|
| loss (nats/token) | {report.get('loss', nan):.4f} |
| perplexity | {report.get('perplexity', nan):.2f} |
| bits per byte | {report.get('bpb', nan):.4f} |

{scores_section(scores or [], heatmap)}{posttraining_section(posttraining or [], release_dir)}\
{checkpoints_section(checkpoints or [], weights_bytes)}{environment_section(environment)}## Use

```python
from olmoflow import Olmo, Tokenizer
model = Olmo.from_pretrained("{release_dir}")
tokenizer = Tokenizer.from_pretrained("{release_dir}")
inputs = tokenizer("def fibonacci(n):", return_tensors="pt")
print(tokenizer.decode(model.generate(inputs.input_ids, max_length=50)[0]))
```

The directory also loads in `transformers` (`AutoModelForCausalLM`, `AutoTokenizer`).

## Verify

{digest_line()}

`olmoflow verify {release_dir} --digest {PLACEHOLDER}` re-hashes every file against `files.json`
(written last), checks that every record of a file's hash in the release agrees with it, and
follows `data_manifest.json` back to the raw sources that still exist; a changed, missing, added
or linked file is named and the exit status is 1. The digest names every file of the release:
compare it with the one published with the model.
"""


def _size(n: int | None) -> str:
    if not n:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def checkpoints_section(entries: list[Any], weights_bytes: int | None) -> str:
    """The card's checkpoints section: each kept checkpoint's stage, step, tokens, loss, where it
    is, and its size as trained (weights, optimizer moments, trainer state) next to the exported
    weights, with how many times the weights a training checkpoint is."""
    if not entries:
        return ""
    rows = "".join(f"| {e.stage} | {e.step} | {e.tokens:,} | {e.loss or '-'} | `{e.path}` | "
                   f"{_size(e.checkpoint_bytes)} | {_size(e.export_bytes)} |\n" for e in entries)
    ratio = ""
    sizes = [e.checkpoint_bytes for e in entries if e.checkpoint_bytes]
    if sizes and weights_bytes:
        mean = sum(sizes) // len(sizes)
        ratio = (f"A training checkpoint is {mean / weights_bytes:.1f}x the weights "
                 f"({_size(mean)} against {_size(weights_bytes)}): it also holds the optimizer's "
                 "two moments per parameter and the trainer state, which exact resume needs.")
    exported = any(e.path.startswith("checkpoints/") for e in entries)
    where = ("Each is exported in Hugging Face layout under `checkpoints/<name>/` and loads on "
             "its own." if exported else "They are referenced in the run directory by path and "
             "the sha256 of their `checksums.json` (`release.include_checkpoints=false`).")
    return f"""## Intermediate checkpoints

Every checkpoint the training stages kept, named as OLMo names its revisions; `checkpoints.csv`
lists them with the sha256 of each file. {where}

| stage | step | tokens | loss | path | as trained | exported |
|---|---|---|---|---|---|---|
{rows}
{ratio}

"""


def environment_section(record: dict[str, Any] | None) -> str:
    """The card's environment section: Python, torch, the machine, the olmoflow commit, and the
    files that rebuild the environment."""
    if not record:
        return ""
    m = record.get("machine", {})
    gpu = m.get("gpu") or "none (CPU)"
    commit = record.get("git_commit") or "unknown"
    dirty = " (with uncommitted changes)" if record.get("git_dirty") else ""
    return f"""## Environment

Python {m.get('python', '?')}, torch {m.get('torch', '?')} on {m.get('cpu', '?')}
({m.get('cpu_count', '?')} cores), GPU: {gpu}; olmoflow at commit `{commit}`{dirty};
{len(record.get('packages', {}))} Python packages, all in `environment.json`.
`requirements.lock` pins them and `Dockerfile` rebuilds the environment.

"""


def posttraining_section(stages: list[dict[str, Any]], release_dir: Path) -> str:
    """The card's post-training section: each stage's base, data, steps and final loss, and how to
    chat with the model (its chat template is in ``tokenizer_config.json``)."""
    if not stages:
        return ""
    rows = "".join(f"| {s['stage']} | {s.get('base', '?')} | {s.get('data', '?')} | "
                   f"{s.get('steps', '?')} | {_fmt(s.get('final_loss'))} | {s.get('log', '')} |\n"
                   for s in stages)
    return f"""## Post-training

The pretrained model was then post-trained, stage by stage; each stage's training log is in the
file named.

| stage | started from | data | steps | final loss | log |
|---|---|---|---|---|---|
{rows}
The tokenizer carries the chat template (`chat_template.jinja`): chat with
`olmoflow chat {release_dir}`, or in `transformers` with `tokenizer.apply_chat_template(messages,
add_generation_prompt=True)`.

"""
