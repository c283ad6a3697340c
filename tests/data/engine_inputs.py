"""Small inputs for data-engine tests: a JSONL writer and a one-source engine config."""

from __future__ import annotations

import json
from pathlib import Path

GOOD = [{"text": f"document number {i} says something about the weather today.", "n": i}
        for i in range(3)]


def jsonl(path: Path, rows: list, garbage: int = 0) -> Path:
    """``rows`` as JSON lines, then ``garbage`` lines that are not JSON."""
    lines = [json.dumps(r) for r in rows] + [f"garbage line {i}" for i in range(garbage)]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def engine_config(tmp: Path, extra: str = "", steps: str = "[ingest]",
                  paths: str | None = None) -> Path:
    """``tmp/data.yaml``: one source ``web`` (by default ``tmp/in/a.jsonl``: :data:`GOOD` and 30
    garbage lines), the pii tagger, output ``tmp/run``, the serial executor."""
    src = tmp / "in"
    src.mkdir(exist_ok=True)
    if paths is None:
        jsonl(src / "a.jsonl", GOOD, garbage=30)
        paths = f"[{src / 'a.jsonl'}]"
    cfg = tmp / "data.yaml"
    cfg.write_text(f"output: {tmp / 'run'}\nexecutor: serial\nsteps: {steps}\n"
                   f"sources: [{{name: web, paths: {paths}}}]\ntaggers: [pii]\n{extra}")
    return cfg


def shouting_plugin(name: str) -> str:
    """The source of a plugin file registering tagger ``name``: one span per document scoring the
    share of its letters that are upper case (attribute ``<name>__upper_fraction``)."""
    return f'''
from olmoflow.data.taggers import Tagger, register_tagger


@register_tagger("{name}")
class Shouting(Tagger):
    def tag(self, doc):
        text = doc["text"]
        letters = [c for c in text if c.isalpha()]
        frac = sum(c.isupper() for c in letters) / max(len(letters), 1)
        return {{self.attr("upper_fraction"): [[0, len(text), frac]]}}
'''
