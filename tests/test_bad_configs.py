"""Bad configs and overrides are refused at load with one line naming the key or file, exit 2:
never a traceback later, never a run that is silently wrong."""

from __future__ import annotations

import pytest
from test_cli import assert_one_line_error, cli

from olmoflow.data.config import load_data_config
from olmoflow.errors import OlmoflowError
from olmoflow.pipeline.config import load_config

BAD_OVERRIDES = [
    ("model.n_kv_heads=0", "model.n_kv_heads"),
    ("model.n_kv_heads=-2", "model.n_kv_heads"),
    ("model.vocab_pad_multiple=0", "model.vocab_pad_multiple"),
    ("model.full_attention_every=0", "model.full_attention_every"),
    ("model.head_dim=-4", "model.head_dim"),
    ("model.dropout=2", "model.dropout"),
    ("model.dropout=1", "model.dropout"),
    ("model.dropout=-0.1", "model.dropout"),
    ("model.dropout=.nan", "model.dropout"),
    ("model.rope_theta=.nan", "model.rope_theta"),
    ("model.rope_theta=.inf", "model.rope_theta"),
    ("model.rope_theta=0", "model.rope_theta"),
    ("model.rms_norm_eps=-1", "model.rms_norm_eps"),
    ("model.rms_norm_eps=0", "model.rms_norm_eps"),
    ("model.rms_norm_eps=.nan", "model.rms_norm_eps"),
    ("tokenizer.min_frequency=-1", "tokenizer.min_frequency"),
]


@pytest.mark.parametrize("override,key", BAD_OVERRIDES)
def test_a_bad_override_is_refused_at_load(override, key):
    with pytest.raises(OlmoflowError, match=key.replace(".", r"\.")):
        load_config("tiny", [override])


@pytest.mark.parametrize("override", ["model.dropout=0.1", "model.rms_norm_eps=1e-5",
                                      "model.n_kv_heads=1", "tokenizer.min_frequency=0"])
def test_good_values_still_load(override):
    load_config("tiny", [override])


def _one_line_exit_2(capsys, argv, *needles):
    rc, _, err = cli(capsys, *argv)
    assert_one_line_error(rc, err, *needles)


@pytest.mark.parametrize("override,key", [BAD_OVERRIDES[0], BAD_OVERRIDES[9],
                                          BAD_OVERRIDES[-1]])
def test_cli_bad_override_is_one_line_exit_2(override, key, tmp_path, capsys):
    _one_line_exit_2(capsys, ["pretrain", "tiny", "--run-dir", str(tmp_path / "run"), override],
                     key)
    assert not (tmp_path / "run").exists()


YAML_FILES = {
    "invalid_utf8": (b"train:\n  max_steps: 3 \xff\xfe\n", "cannot read"),
    "int_key": (b"1: 2\n", "unknown config key '1'"),
    "nested_int_key": (b"model:\n  1: 2\n", "unknown config key 'model.1'"),
    "deep_flow": (b"a: " + b"[" * 10_000 + b"]" * 10_000 + b"\n", "nested too deeply"),
    "deep_block": (b"".join(b"  " * i + b"k%d:\n" % i for i in range(10_000))
                   + b"  " * 10_000 + b"x: 1\n", "nested too deeply"),
}


@pytest.mark.parametrize("name", sorted(YAML_FILES))
@pytest.mark.parametrize("loader", [load_config, load_data_config])
def test_a_bad_yaml_file_is_refused(name, loader, tmp_path):
    text, needle = YAML_FILES[name]
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(text)
    with pytest.raises(OlmoflowError, match=needle) as e:
        loader(str(path))
    assert "\n" not in str(e.value)
    if "nested" not in name and "int_key" not in name:
        assert str(path) in str(e.value)


@pytest.mark.parametrize("name", ["deep_flow", "invalid_utf8"])
def test_cli_bad_yaml_is_one_line_exit_2(name, tmp_path, capsys):
    text, needle = YAML_FILES[name]
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(text)
    _one_line_exit_2(capsys, ["pretrain", str(path), "--run-dir", str(tmp_path / "run")],
                     str(path), needle)
    _one_line_exit_2(capsys, ["data", "ingest", str(path), "--no-progress"], str(path), needle)


def test_a_deep_override_value_is_refused():
    with pytest.raises(OlmoflowError, match="override 'train.data': .*nested too deeply"):
        load_config("tiny", ["train.data=" + "[" * 10_000 + "]" * 10_000])


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
