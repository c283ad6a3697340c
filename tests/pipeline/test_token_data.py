"""``train.data``: a run trains and evaluates on tokens directories made elsewhere (by the data
engine or another run), with their tokenizer, and skips its own data stages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from olmoflow.data.engine import Engine, load_data_config
from olmoflow.errors import OlmoflowError
from olmoflow.pipeline.config import load_config
from olmoflow.pipeline.stages import STAGES
from olmoflow.pipeline.stages.common import (
    load_tokenizer,
    token_data_stamp,
    token_split,
    tokenizer_dir,
)

WORDS = "river stone water bank fish reed mud star orbit comet moon dust sky leaf root".split()


def engine_tokens(tmp: Path, name: str, vocab: int = 300) -> Path:
    (tmp / name).mkdir()
    src = tmp / name / "in.jsonl"
    src.write_text("".join(json.dumps({"text": " ".join(WORDS[i:] + WORDS[:i]) * 3}) + "\n"
                           for i in range(12)))
    cfg = tmp / name / "data.yaml"
    cfg.write_text(f"output: {tmp / name / 'run'}\nexecutor: serial\n"
                   "steps: [ingest, mix, tokenize]\n"
                   f"sources: [{{name: s, paths: ['{src}']}}]\n"
                   f"tokenize: {{vocab_size: {vocab}, min_frequency: 1, heldout_fraction: 0.2}}\n")
    Engine(load_data_config(cfg)).run()
    return tmp / name / "run" / "tokens"


def with_data(tmp: Path, dirs: list[Path]):
    cfg = load_config("tiny", [f"run_dir={tmp / 'run'}"])
    # Set as an attribute so the test holds whether or not TrainConfig declares the field yet.
    object.__setattr__(cfg.train, "data", [str(d) for d in dirs])
    return cfg


def test_train_data_uses_the_engine_tokens_and_their_tokenizer(tmp_path):
    tokens = engine_tokens(tmp_path, "a")
    cfg = with_data(tmp_path, [tokens])
    assert [s.name for s in STAGES if s.is_enabled(cfg)][:1] == ["pretrain"]
    assert not {"collect", "clean", "train-tokenizer", "tokenize"} & {
        s.name for s in STAGES if s.is_enabled(cfg)}
    assert tokenizer_dir(cfg) == tokens.parent / "tokenizer"
    assert load_tokenizer(cfg).vocab_size == json.loads((tokens / "meta.json").read_text())[
        "vocab_size"]
    train, dtype = token_split(cfg, "train")
    held, _ = token_split(cfg, "heldout")
    assert dtype.name == "uint16" and train and held
    assert all(p.is_relative_to(tokens / "train") for p in train)
    assert all(p.is_relative_to(tokens / "heldout") for p in held)
    # Two directories: their arrays concatenated, in the order given.
    twice, _ = token_split(with_data(tmp_path, [tokens, tokens]), "train")
    assert twice == train + train
    # Without train.data the run's own data stages are back.
    own = load_config("tiny", [f"run_dir={tmp_path / 'run'}"])
    assert [s.name for s in STAGES if s.is_enabled(own)][:4] == [
        "collect", "clean", "train-tokenizer", "tokenize"]
    assert token_data_stamp(own) == []


def test_the_stamp_follows_the_tokens_and_mixed_tokenizers_are_refused(tmp_path):
    a, b = engine_tokens(tmp_path, "a"), engine_tokens(tmp_path, "b", vocab=280)
    stamp = token_data_stamp(with_data(tmp_path, [a]))
    assert stamp and stamp != token_data_stamp(with_data(tmp_path, [b]))
    manifest = a / "manifest.json"
    m = json.loads(manifest.read_text())
    m["outputs"][0]["sha256"] = "0" * 64  # as if the tokens had been made again, differently
    manifest.write_text(json.dumps(m))
    assert token_data_stamp(with_data(tmp_path, [a])) != stamp
    with pytest.raises(OlmoflowError, match="another tokenizer"):
        token_split(with_data(tmp_path, [a, b]), "train")
    with pytest.raises(OlmoflowError, match="not a tokens directory"):
        load_tokenizer(with_data(tmp_path, [tmp_path / "a"]))
