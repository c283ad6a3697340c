"""A user's own tokenizer plugs into the whole flow through tokenizer.implementation."""

import json

import pytest

from olmoflow.cli import main
from olmoflow.errors import OlmoflowError
from olmoflow.tokenizer import BPETokenizer, tokenizer_class


def test_tokenizer_class_resolution():
    assert tokenizer_class("bpe") is BPETokenizer
    assert tokenizer_class("char_tokenizer:CharTokenizer").__name__ == "CharTokenizer"
    with pytest.raises(OlmoflowError, match="cannot be loaded"):
        tokenizer_class("no_such_module:Thing")
    with pytest.raises(OlmoflowError, match="not a BaseTokenizer"):
        tokenizer_class("json:JSONDecoder")
    with pytest.raises(OlmoflowError, match="did you mean 'bpe'"):
        tokenizer_class("bep")


def test_char_tokenizer_runs_the_whole_flow(tmp_path, capsys):
    run = tmp_path / "run"
    rc = main(["run", "tiny", "--run-dir", str(run), "--no-progress", "train.max_steps=4",
               "train.checkpoint.save_interval=2",
               "tokenizer.implementation=char_tokenizer:CharTokenizer"])
    assert rc == 0, capsys.readouterr().err
    assert json.loads((run / "tokenizer" / "chars.json").read_text())[0] == "<|endoftext|>"
    meta = json.loads((run / "tokens" / "meta.json").read_text())
    assert meta["vocab_size"] < 512  # characters, not the BPE preset's 512
    assert (run / "release" / "chars.json").is_file()
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["bpb"] > 0
