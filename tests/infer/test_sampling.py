"""SamplingParams: one description of sampling, for generate, the generate stage and later
callers."""

import dataclasses
import re

import numpy as np
import pytest
import torch

from olmoflow.config import from_dict
from olmoflow.errors import OlmoflowError
from olmoflow.infer.config import GenerateConfig
from olmoflow.infer.generate import generate, iter_tokens
from olmoflow.infer.sampling import SamplingError, SamplingParams
from olmoflow.infer.streaming import stream_generate


@pytest.mark.parametrize(("field", "value", "message"), [
    ("max_new_tokens", -1, "SamplingParams.max_new_tokens must be >= 0"),
    ("max_new_tokens", 2.5, "SamplingParams.max_new_tokens must be >= 0 (an integer), got 2.5"),
    ("temperature", -0.1, "SamplingParams.temperature must be >= 0"),
    ("temperature", True, "SamplingParams.temperature"),
    ("top_k", -1, "SamplingParams.top_k must be None/null or an integer >= 0"),
    ("top_p", 0.0, "SamplingParams.top_p must be None/null or in (0, 1]"),
    ("top_p", 1.5, "SamplingParams.top_p must be None/null or in (0, 1]"),
    ("repetition_penalty", 0.0, "SamplingParams.repetition_penalty must be > 0"),
    ("seed", "7", "SamplingParams.seed must be None/null or an integer"),
    ("stop", "\n", "SamplingParams.stop must be a list of non-empty strings"),
    ("stop", ["ok", ""], "SamplingParams.stop must be a list of non-empty strings"),
])
def test_invalid_settings_name_the_field_in_one_line(field, value, message):
    with pytest.raises(SamplingError, match=re.escape(message)) as info:
        SamplingParams(**{field: value})
    assert "\n" not in str(info.value)
    # The CLI prints OlmoflowErrors on one line; Python callers may catch ValueError, as with HF.
    assert isinstance(info.value, OlmoflowError) and isinstance(info.value, ValueError)


def test_defaults_are_greedy_and_do_sample_follows_temperature():
    assert SamplingParams() == SamplingParams(max_new_tokens=20, temperature=0.0)
    assert not SamplingParams().do_sample
    assert SamplingParams(temperature=0.7).do_sample
    assert SamplingParams(top_k=0, top_p=1.0, seed=np.int64(3)).seed == 3  # edges that are valid


def test_stop_list_becomes_a_tuple_and_the_params_stay_hashable():
    sp = SamplingParams(stop=["\n\n", "###"])
    assert sp.stop == ("\n\n", "###") and hash(sp) == hash(SamplingParams(stop=("\n\n", "###")))
    assert sp.to_dict()["stop"] == ["\n\n", "###"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.temperature = 1.0


def test_hf_keywords_map_to_params():
    assert SamplingParams.from_hf_kwargs(do_sample=False, temperature=0.7) == SamplingParams()
    assert SamplingParams.from_hf_kwargs(do_sample=True, temperature=0.7).temperature == 0.7
    with pytest.raises(SamplingError, match="temperature"):  # checked even when greedy
        SamplingParams.from_hf_kwargs(temperature=-1.0)


def test_greedy_sampling_param_equals_keywords(model):
    ids = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(1))
    kw = generate(model, ids, max_new_tokens=12, repetition_penalty=1.3)
    sp = generate(model, ids, sampling=SamplingParams(max_new_tokens=12, repetition_penalty=1.3))
    assert torch.equal(kw, sp) and kw.shape == (2, 17)
    # A temperature with do_sample=False is greedy too, as in transformers.
    assert torch.equal(kw, generate(model, ids, max_new_tokens=12, temperature=0.5,
                                    repetition_penalty=1.3))


def test_seeded_sampling_param_equals_keywords(model):
    ids = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=16, temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.1,
              seed=5)
    a = generate(model, ids, do_sample=True, **kw)
    b = generate(model, ids, sampling=SamplingParams(**kw))
    assert torch.equal(a, b)
    other = generate(model, ids, sampling=SamplingParams(**{**kw, "seed": 6}))
    assert not torch.equal(a, other)  # the seed is used: the comparison above can fail
    steps = torch.stack(list(iter_tokens(model, ids, sampling=SamplingParams(**kw))), 1)
    assert torch.equal(steps, a[:, 5:])


def test_max_length_and_stop_strings_map_to_params(bpe, scripted):
    row = bpe.encode("one two STOP three four")
    prompt = torch.zeros(1, 1, dtype=torch.long)
    a = generate(scripted([row], bpe.vocab_size), prompt, max_length=1 + len(row),
                 stop_strings=["STOP"], tokenizer=bpe)
    b = generate(scripted([row], bpe.vocab_size), prompt, tokenizer=bpe,
                 sampling=SamplingParams(max_new_tokens=len(row), stop=("STOP",)))
    assert torch.equal(a, b) and bpe.decode(b[0, 1:]) == "one two STOP"
    sp = SamplingParams(max_new_tokens=len(row), stop=("STOP",))
    text = "".join(stream_generate(scripted([row], bpe.vocab_size), bpe, prompt[0], sampling=sp))
    assert text == "one two STOP"


def test_sampling_and_keywords_together_is_an_error(model):
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="either sampling= or the keywords max_new_tokens, seed"):
        generate(model, ids, sampling=SamplingParams(), max_new_tokens=4, seed=1)
    with pytest.raises(TypeError, match="SamplingParams"):
        generate(model, ids, sampling={"temperature": 0.5})


def test_generate_config_builds_params_with_a_seed_per_prompt():
    g = from_dict(GenerateConfig, {"temperature": 0.6, "top_k": 40, "seed": 10}, "generate.")
    assert g.sampling(0) == SamplingParams(max_new_tokens=64, temperature=0.6, top_k=40,
                                           top_p=0.95, seed=10)
    assert g.sampling(2).seed == 12


@pytest.mark.parametrize(("key", "value"), [("temperature", -1.0), ("top_p", 0.0),
                                            ("max_new_tokens", -5)])
def test_generate_config_errors_name_the_yaml_key(key, value):
    with pytest.raises(OlmoflowError, match=f"^generate.{key} must be"):
        from_dict(GenerateConfig, {key: value}, "generate.")
