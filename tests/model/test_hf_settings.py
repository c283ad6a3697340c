"""The token ids of ``config.json`` and the decoding settings of ``generation_config.json``,
checked when a Hugging Face directory is loaded, and the tokenizer's JSON files: errors for what
every tool would act on wrongly, warnings for what is safely ignored (as ``transformers`` does)."""

from __future__ import annotations

import json
import logging

import pytest

from olmoflow.errors import OlmoflowError
from olmoflow.model.hf_settings import check_hf_settings

VOCAB = 100


def write(tmp_path, config=None, generation=None):
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_what_olmoflow_writes_passes(tmp_path):
    write(tmp_path, {"eos_token_id": 0, "pad_token_id": 1, "bos_token_id": None},
          {"eos_token_id": 0, "pad_token_id": 1, "do_sample": False})
    assert check_hf_settings(tmp_path, VOCAB) == []
    assert check_hf_settings(tmp_path / "nothing-there", VOCAB) == []


@pytest.mark.parametrize("config, generation, fragment", [
    ({"eos_token_id": 99999999}, None, "config.json: eos_token_id=99999999: 99999999 is outside"),
    ({"eos_token_id": [0, 100]}, None, "eos_token_id=[0, 100]: 100 is outside"),
    ({"eos_token_id": "0"}, None, "eos_token_id='0': '0' is not an integer token id"),
    ({"eos_token_id": True}, None, "is not an integer token id"),
    (None, {"eos_token_id": -1}, "generation_config.json: eos_token_id=-1"),
    (None, {"max_new_tokens": "many"}, "max_new_tokens='many' must be an integer >= 1"),
    (None, {"max_new_tokens": 0}, "max_new_tokens=0 must be an integer >= 1"),
    (None, {"max_length": 2.5}, "max_length=2.5"),
    (None, {"num_beams": 0}, "num_beams=0"),
    (None, {"repetition_penalty": 0}, "repetition_penalty=0 must be a number > 0"),
    (None, {"do_sample": "yes"}, "do_sample='yes' must be true or false"),
    (None, {"do_sample": True, "temperature": -1}, "temperature=-1 must be a number > 0"),
    (None, {"do_sample": True, "temperature": 0}, "temperature=0 must be a number > 0"),
    (None, {"do_sample": True, "top_p": 1.5}, "top_p=1.5 must be a number in (0, 1]"),
    (None, {"do_sample": True, "top_k": -3}, "top_k=-3 must be an integer >= 0"),
    ([1, 2], None, "config.json: expected a JSON object of settings, found a list"),
    (None, "greedy", "generation_config.json: expected a JSON object of settings, found a str"),
])
def test_an_error_names_the_file_and_the_field(tmp_path, config, generation, fragment):
    write(tmp_path, config, generation)
    with pytest.raises(OlmoflowError) as e:
        check_hf_settings(tmp_path, VOCAB)
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("config, generation, fragment", [
    (None, {"temperature": -1}, "temperature=-1 must be a number > 0; ignored, as do_sample is "
                                "false"),
    (None, {"do_sample": False, "top_p": 7}, "top_p=7"),
    ({"pad_token_id": 100}, None, "config.json: pad_token_id=100"),
    ({"bos_token_id": -1}, None, "bos_token_id=-1"),
])
def test_a_value_safely_ignored_is_one_warning(tmp_path, caplog, config, generation, fragment):
    write(tmp_path, config, generation)
    with caplog.at_level(logging.WARNING, logger="olmoflow.model.hf_settings"):
        said = check_hf_settings(tmp_path, VOCAB)
    assert len(said) == 1 and fragment in said[0] and "ignored" in said[0], said
    assert [r.getMessage() for r in caplog.records] == said


def test_greedy_temperature_zero_is_fine(tmp_path):
    write(tmp_path, None, {"temperature": 0, "do_sample": False, "top_k": 0, "top_p": 1.0})
    assert check_hf_settings(tmp_path, VOCAB) == []


# ---- the tokenizer's files ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from olmoflow.tokenizer import BPETokenizer

    d = tmp_path_factory.mktemp("tok")
    BPETokenizer().train_from_texts(["hello world, the cat sat on the mat"] * 20,
                                    vocab_size=280).save(d)
    return d


def damaged(tokenizer_dir, tmp_path, name, value):
    import shutil

    d = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, d)
    (d / name).write_text(json.dumps(value))
    return d


@pytest.mark.parametrize("name, value, fragment", [
    ("tokenizer_config.json", ["eos_token"], "tokenizer_config.json: expected a JSON object of "
                                             "tokenizer settings, found a list"),
    ("special_tokens_map.json", "x", "special_tokens_map.json: expected a JSON object"),
    ("tokenizer_config.json", {"eos_token": 5}, "tokenizer_config.json: eos_token=5 is not a "
                                                "token"),
    ("tokenizer_config.json", {"pad_token": {"content": ["x"]}}, "pad_token="),
])
def test_a_tokenizer_file_that_is_not_settings_is_an_error(tokenizer_dir, tmp_path, name, value,
                                                           fragment):
    from olmoflow.tokenizer import BPETokenizer

    d = damaged(tokenizer_dir, tmp_path, name, value)
    with pytest.raises(OlmoflowError) as e:
        BPETokenizer.from_pretrained(d)
    assert fragment in str(e.value) and str(d) in str(e.value) and "\n" not in str(e.value)


def test_a_bad_model_max_length_is_ignored_with_a_warning(tokenizer_dir, tmp_path, caplog):
    from olmoflow.tokenizer import BPETokenizer

    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    d = damaged(tokenizer_dir, tmp_path, "tokenizer_config.json",
                {**config, "model_max_length": "long"})
    with caplog.at_level(logging.WARNING, logger="olmoflow.tokenizer.bpe"):
        tok = BPETokenizer.from_pretrained(d)
    assert tok.vocab_size > 0
    assert [r.getMessage() for r in caplog.records] == [
        f"{d / 'tokenizer_config.json'}: model_max_length=\"long\" is not a positive number; "
        "ignored"]
