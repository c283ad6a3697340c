"""The data engine's config (``olmoflow.data.config``): every bad value is refused when the
config loads, or before the first step runs, with one line naming the key, exit 2; good values
still load."""

from __future__ import annotations

import pytest
from test_cli import assert_one_line_error, cli

from olmoflow.data.config import load_data_config
from olmoflow.errors import OlmoflowError


def _one_line_exit_2(capsys, argv, *needles):
    rc, _, err = cli(capsys, *argv)
    assert_one_line_error(rc, err, *needles)


def _data_yaml(tmp_path, source: str, extra: str = "") -> str:
    path = tmp_path / "data.yaml"
    path.write_text(f"output: {tmp_path / 'engine'}\nexecutor: serial\nsteps: [ingest]\n"
                    f"sources: [{source}]\n{extra}")
    return str(path)


BAD_DATA = [
    ("{name: " + "s" * 256 + ", paths: [x]}", "", "sources[0].name"),
    ("{name: " + "é" * 128 + ", paths: [x]}", "", "sources[0].name"),  # 256 bytes
    ("{name: web, paths: [x], options: {max_shard_bytes: big}}", "",
     "sources[0].options.max_shard_bytes"),
    ("{name: web, paths: [x], options: {max_shard_bytes: 1.5}}", "",
     "sources[0].options.max_shard_bytes"),
    ("{name: web, paths: [x], options: {max_document_bytes: " + "9" * 40 + "}}", "",
     "sources[0].options.max_document_bytes"),
    ("{name: web, paths: [x], options: {max_document_bytes: [1]}}", "",
     "sources[0].options.max_document_bytes"),
    ("{name: web, paths: [x], options: {text_field: 3}}", "", "sources[0].options.text_field"),
    ("{name: web, paths: [x], options: {strict: 'yes'}}", "", "sources[0].options.strict"),
    ("{name: web, paths: [x], options: {follow_symlinks: 1}}", "",
     "sources[0].options.follow_symlinks"),
    ("{name: web, paths: [x], options: {html_extractor: [a]}}", "",
     "sources[0].options.html_extractor"),
    ("{name: web, paths: [x], options: {1: 2}}", "", "sources[0].options"),
    ("{name: web, paths: [x]}", "dedup: {1: 2}\n", "dedup"),
    ("{name: web, paths: [x]}", "mixer: {a: [{null: 1}]}\n", "mixer"),
    ("{name: web, paths: [x]}", "taggers: [{1: 2, name: x}]\n", "taggers"),
    ("{name: web, paths: [x]}", "quality: {options: {1.5: 2}}\n", "quality.options"),
    ("{name: web, paths: [x]}", "dedup: {min_paragraph_chars: x}\n",
     "dedup.min_paragraph_chars"),
    ("{name: web, paths: [x]}", "dedup: {exact: 'yes'}\n", "dedup.exact"),
    ("{name: web, paths: [x]}", "dedup: {minhash: {seed: " + "9" * 30 + "}}\n",
     "dedup.minhash.seed"),
    ("{name: web, paths: [x]}", "decontaminate: {ngram: x}\n", "decontaminate.ngram"),
    ("{name: web, paths: [x]}", "mixer: {seed: 1.5}\n", "mixer.seed"),
    ("{name: web, paths: [x]}", "mixer: {max_bytes: [1]}\n", "mixer.max_bytes"),
    ("{name: web, paths: [x]}", "tokenize: {min_frequency: -1}\n", "tokenize.min_frequency"),
    ("{name: web, paths: [x]}", "tokenize: {vocab_size: 0}\n", "tokenize.vocab_size"),
    ("{name: web, paths: [x]}", "tokenize: {heldout_fraction: .nan}\n",
     "tokenize.heldout_fraction"),
    ("{name: web, paths: [x]}", "tokenize: {heldout_max_documents: -1}\n",
     "tokenize.heldout_max_documents"),
]


@pytest.mark.parametrize("source,extra,key", BAD_DATA)
def test_a_bad_data_engine_value_is_refused_at_load(source, extra, key, tmp_path):
    with pytest.raises(OlmoflowError, match=key.replace(".", r"\.").replace("[", r"\[")):
        load_data_config(_data_yaml(tmp_path, source, extra))


@pytest.mark.parametrize("extra", ["dedup: {minhash: true, exact: false}\n",
                                   "dedup: {minhash: {threshold: 0.5, seed: 7}}\n",
                                   "mixer: {seed: 3, max_bytes: null}\n",
                                   "decontaminate: {ngram: 8}\n"])
def test_good_data_engine_values_still_load(extra, tmp_path):
    load_data_config(_data_yaml(tmp_path, "{name: web, paths: [x]}", extra))


def test_a_255_byte_source_name_loads(tmp_path):
    cfg = load_data_config(_data_yaml(tmp_path, "{name: " + "s" * 255 + ", paths: [x]}"))
    assert len(cfg.sources[0].name) == 255


@pytest.mark.parametrize("i", [0, 4, 10, 13])
def test_cli_bad_data_engine_value_is_one_line_exit_2(i, tmp_path, capsys):
    source, extra, key = BAD_DATA[i]
    _one_line_exit_2(capsys, ["data", "ingest", _data_yaml(tmp_path, source, extra),
                              "--no-progress"], key)
    assert not (tmp_path / "engine").exists()
