"""Damaged or odd Hugging Face model files (``model.safetensors``, ``config.json``,
``tokenizer.json``) are refused with one line naming the file, from ``Olmo.from_pretrained`` and
from ``olmoflow export hf`` (exit 2), and an edited config is checked against the weights' header
before any model is built."""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
from fuzzing import (
    CASES,
    Findings,
    dumps,
    mutate_bytes,
    mutate_json,
    odd_value,
    rng_for,
    write_tiny_release,
)

from olmoflow.cli import main
from olmoflow.errors import OlmoflowError
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo
from olmoflow.tokenizer import Tokenizer

CFG = ModelConfig(vocab_size=384, d_model=32, n_layers=2, n_heads=2, mlp_hidden=64,
                  max_sequence_length=64, sliding_window=None)


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    Olmo(CFG).save_pretrained(d)
    tok = Tokenizer().train_from_texts(["hello world, a tiny corpus"] * 20, vocab_size=300)
    tok.save(d)
    return d


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _weights(d: Path) -> bytes:
    return (d / "model.safetensors").read_bytes()


def _flip_header_byte(b: bytes) -> bytes:
    n = struct.unpack("<Q", b[:8])[0]
    header = b[8:8 + n]
    at = header.index(b'"shape":[') + len('"shape":[')  # the first digit of a shape
    return b[:8 + at] + b"9" + b[9 + at:]


def _bad_header_json(b: bytes) -> bytes:
    return b[:8] + b"[" + b[9:]  # the header's JSON no longer parses


WEIGHTS = {
    "truncated": lambda b: b[: len(b) // 2],
    "truncated_in_header": lambda b: b[:20],
    "flipped_shape": _flip_header_byte,
    "bad_header_json": _bad_header_json,
    "garbage": lambda b: b"\x00garbage" * 7,
    "empty": lambda b: b"",
    "header_size_huge": lambda b: struct.pack("<Q", 1 << 60) + b[8:],
}


@pytest.mark.parametrize("kind", sorted(WEIGHTS))
def test_damaged_safetensors_is_one_line_naming_the_file(good_dir, tmp_path, kind):
    d = _copy(good_dir, tmp_path / "m")
    (d / "model.safetensors").write_bytes(WEIGHTS[kind](_weights(good_dir)))
    with pytest.raises(OlmoflowError) as e:
        Olmo.from_pretrained(d)
    msg = str(e.value)
    assert "\n" not in msg and str(d) in msg, msg


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


CONFIGS = {
    "missing_vocab": lambda c: {k: v for k, v in c.items() if k != "vocab_size"},
    "missing_heads": lambda c: {k: v for k, v in c.items() if k != "num_attention_heads"},
    "string_layers": lambda c: {**c, "num_hidden_layers": "2"},
    "zero_heads": lambda c: {**c, "num_attention_heads": 0},
    "float_hidden": lambda c: {**c, "hidden_size": 32.5},
    "list_config": lambda c: [c],
    "string_config": lambda c: "olmo",
    "rope_scaling_string": lambda c: {**c, "rope_scaling": "yarn"},
    "rope_parameters_nested_bad": lambda c: {**c, "rope_parameters": {"full_attention": 5}},
    "yarn_factor_text": lambda c: {**c, "rope_scaling": {"rope_type": "yarn", "factor": "x"}},
    "eps_text": lambda c: {**c, "rms_norm_eps": "tiny"},
    "huge_positions": lambda c: {**c, "max_position_embeddings": 10**15},
    "layer_types_int": lambda c: {**c, "model_type": "olmo3", "sliding_window": 4,
                                  "layer_types": 7},
    "more_layers": lambda c: {**c, "num_hidden_layers": 3},
    "wider": lambda c: {**c, "intermediate_size": 65},
}


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_odd_config_is_one_line_naming_the_file(good_dir, tmp_path, kind):
    d = _copy(good_dir, tmp_path / "m")
    (d / "config.json").write_text(json.dumps(CONFIGS[kind](_config(good_dir))))
    with pytest.raises(OlmoflowError) as e:
        Olmo.from_pretrained(d)
    msg = str(e.value)
    assert "\n" not in msg and str(d) in msg, msg


def test_config_that_is_not_json(good_dir, tmp_path):
    d = _copy(good_dir, tmp_path / "m")
    (d / "config.json").write_bytes(b"\xff{not json")
    with pytest.raises(OlmoflowError, match="config.json' is not valid JSON"):
        Olmo.from_pretrained(d)


def test_a_million_layers_is_refused_before_building(good_dir, tmp_path):
    d = _copy(good_dir, tmp_path / "m")
    (d / "config.json").write_text(json.dumps({**_config(good_dir),
                                               "num_hidden_layers": 10**6}))
    start = time.monotonic()
    with pytest.raises(OlmoflowError, match="num_hidden_layers=1000000 but the weights hold 2"):
        Olmo.from_pretrained(d)
    assert time.monotonic() - start < 5


def test_an_integer_weight_dtype_is_refused(good_dir, tmp_path):
    d = _copy(good_dir, tmp_path / "m")
    b = _weights(good_dir)
    n = struct.unpack("<Q", b[:8])[0]
    header = b[8:8 + n].replace(b'"F32"', b'"I32"', 1)  # same size: still a valid file
    (d / "model.safetensors").write_bytes(b[:8] + header + b[8 + n:])
    with pytest.raises(OlmoflowError, match="has dtype I32, not a float type"):
        Olmo.from_pretrained(d)


def test_the_good_directory_still_loads(good_dir):
    model = Olmo.from_pretrained(good_dir)
    assert model.config.n_layers == 2 and model.config.vocab_size == 384


def test_tokenizer_with_a_huge_id_is_refused(good_dir, tmp_path):
    d = _copy(good_dir, tmp_path / "m")
    tok = json.loads((d / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab[next(iter(vocab))] = 2**31 - 1
    (d / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(OlmoflowError, match=r"token id 2147483647 but only \d+ tokens"):
        Tokenizer.from_pretrained(d)


def test_export_hf_of_a_damaged_directory_exits_2(good_dir, tmp_path, capsys):
    d = _copy(good_dir, tmp_path / "m")
    (d / "model.safetensors").write_bytes(_weights(good_dir)[:100])
    rc = main(["export", "hf", str(d), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "model.safetensors" in lines[0], err
    assert not (tmp_path / "out").exists()


# --- seeded fuzzing (tests/fuzzing.py): release directories ---------------------------------------


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory) -> Path:
    return write_tiny_release(tmp_path_factory.mktemp("release"))


def test_fuzz_release_directories(tmp_path, release_dir):
    """Damaged release directories (``config.json`` mutations, truncated or altered
    ``model.safetensors``) loaded as ``Olmo.from_pretrained`` does for generate, export and
    evaluation: a model that loads runs a forward pass of the right shape."""
    from olmoflow.model.olmo import Olmo

    r, found = rng_for("release"), Findings("release directory")
    config = json.loads((release_dir / "config.json").read_text())
    weights = (release_dir / "model.safetensors").read_bytes()
    header = int.from_bytes(weights[:8], "little") + 8
    torch.set_num_threads(1)
    for case in range(CASES):
        d = tmp_path / f"case{case:04d}"
        shutil.copytree(release_dir, d)
        op = r.randrange(8)
        if op < 4:
            (d / "config.json").write_text(dumps(mutate_json(r, config)))
        elif op == 4:
            key = r.choice(["num_hidden_layers", "hidden_size", "num_attention_heads",
                            "num_key_value_heads", "intermediate_size", "vocab_size",
                            "max_position_embeddings", "rope_theta", "rms_norm_eps",
                            "sliding_window", "layer_types", "architectures", "torch_dtype"])
            (d / "config.json").write_text(dumps({**config, key: odd_value(r)}))
        elif op == 5:
            (d / "model.safetensors").write_bytes(weights[:r.randrange(len(weights))])
        elif op == 6:  # damage inside the JSON header, where names, shapes and offsets live
            i = r.randrange(8, header)
            (d / "model.safetensors").write_bytes(
                weights[:i] + bytes([r.randrange(32, 127)]) + weights[i + 1:])
        else:
            (d / "model.safetensors").write_bytes(mutate_bytes(r, weights[:header]) +
                                                  weights[header:])

        def load_and_run(d: Path = d) -> None:
            model = Olmo.from_pretrained(d)
            with torch.no_grad():
                out = model(torch.tensor([[1, 2, 3]]))
            logits = out if torch.is_tensor(out) else out.logits
            if tuple(logits.shape[:2]) != (1, 3):
                raise AssertionError(f"logits of shape {tuple(logits.shape)}")

        found.outcome(case, f"op {op} in {d}: {(d / 'config.json').read_text()[:300]}",
                      load_and_run)
    found.check()
