"""The one model loader: every checkpoint form loads to the same weights, the trained length has
one definition, and bad paths are one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from saved_models import TRAINED, saved_run

from olmoflow.errors import OlmoflowError
from olmoflow.model import hub
from olmoflow.model.load import Loaded, load_model, resolve_source, trained_length


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return saved_run(tmp_path_factory.mktemp("load") / "run")


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:  # one fp32 value saved and read back, through dcp or safetensors: bit-exact
        assert torch.equal(sa[k], sb[k]), k


def hub_cache(run, root):
    """A Hugging Face cache holding the run's release as ``org/tiny`` at ``main``."""
    commit = "c" * 40
    repo = root / "models--org--tiny"
    shutil.copytree(run.release, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return root


def test_every_form_loads_the_same_weights(run, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv(hub.ALLOW_NETWORK_ENV, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing may reach the network
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache(run, tmp_path / "hf")))
    forms = {
        "step": (run.step, "step", run.step),
        "folder with latest": (run.root / "pretrain", "step", run.step),
        "the latest pointer": (run.root / "pretrain" / "latest", "step", run.step),
        "release": (run.release, "hf", run.release),
        "run directory": (run.root, "hf", run.release),
    }
    for name, (path, kind, src) in forms.items():
        loaded = load_model(path)
        assert isinstance(loaded, Loaded)
        assert (loaded.kind, loaded.path) == (kind, src), name
        same_weights(loaded.model, run.model)
        assert loaded.tokenizer.vocab_size == run.vocab, name
        assert not loaded.model.training, name
        assert loaded.trained_length == TRAINED, name
        assert loaded.tokenizer_dir is not None
        assert (loaded.tokenizer_dir / "tokenizer.json") in loaded.files, name
        assert all(f.is_file() for f in loaded.files)
    hub_loaded = load_model("org/tiny")
    assert hub_loaded.kind == "hf" and hub_loaded.path.parent.name == "snapshots"
    same_weights(hub_loaded.model, run.model)


def test_a_step_is_sized_from_its_tokenizer(run):
    """The run config says vocab_size 0: the model is built with the tokenizer's vocabulary
    padded, so the checkpoint's weights fit."""
    loaded = load_model(run.step)
    cfg = loaded.model.config
    assert cfg.vocab_size == cfg.padded_vocab_size(run.vocab) >= run.vocab
    assert loaded.tokenizer_dir == run.root / "tokenizer"


def test_a_given_tokenizer_object_and_dtype_and_device(run):
    first = load_model(run.step)
    again = load_model(run.step, tokenizer=first.tokenizer, dtype=torch.bfloat16, device="cpu")
    assert again.tokenizer is first.tokenizer and again.tokenizer_dir is None
    assert next(again.model.parameters()).dtype == torch.bfloat16
    hf = load_model(run.release, dtype=torch.bfloat16)
    assert next(hf.model.parameters()).dtype == torch.bfloat16


def test_the_context_is_the_trained_length_within_the_model(run):
    loaded = load_model(run.release)
    assert loaded.model.config.max_sequence_length == 256
    assert loaded.context_length == TRAINED


@pytest.mark.parametrize("yaml_text, want", [
    ("train:\n  sequence_length: 64\n", 64),
    # evaluate.sequence_length is where the run chose to score, not what the model trained on:
    # `eval run` used to take it as the trained length, chat did not
    ("train:\n  sequence_length: 64\nevaluate:\n  sequence_length: 32\n", 64),
    ("train:\n  sequence_length: 64\nevaluate:\n  sequence_length: 128\n", 64),
    # a post-training stage with data trained on its own, longer, windows; one without data
    # is not part of the run
    ("train:\n  sequence_length: 64\nsft:\n  data:\n    paths: [a.jsonl]\n  train:\n"
     "    sequence_length: 256\ndpo:\n  data:\n    paths: []\n  train:\n"
     "    sequence_length: 1024\n", 256),
    ("train:\n  sequence_length: 64\ndpo:\n  data:\n    generate: demo\n  train:\n"
     "    sequence_length: 96\n", 96),
    ("train:\n  sequence_length: true\n", None),
    ("evaluate:\n  sequence_length: 32\n", None),
    ("- not a mapping\n", None),
])
def test_the_trained_length(tmp_path, yaml_text, want):
    (tmp_path / "config.yaml").write_text(yaml_text)
    assert trained_length(tmp_path) == want


def test_no_config_yaml_means_no_trained_length(tmp_path):
    assert trained_length(tmp_path) is None


def test_eval_run_scores_at_the_trained_length(run, tmp_path, capsys):
    """A release whose run scored at evaluate.sequence_length=32: `eval run` used the 32 of the
    evaluate section as the model's context; it is the trained length, as chat's."""
    from checks import cli

    release = tmp_path / "release"
    shutil.copytree(run.release, release)
    tree = yaml.safe_load((release / "config.yaml").read_text())
    tree["evaluate"]["sequence_length"] = 32
    (release / "config.yaml").write_text(yaml.safe_dump(tree))
    rc, out, err = cli(capsys, "eval", "run", "--model", str(release), "--tasks", "copy_string",
                       "--limit", "2", "--out", str(tmp_path / "r.json"))
    assert rc == 0, err
    assert json.loads((tmp_path / "r.json").read_text())["max_length"] == TRAINED


def one_line_error(fn, *fragments):
    with pytest.raises(OlmoflowError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for f in fragments:
        assert f in msg, (f, msg)
    return msg


def test_bad_paths_are_one_line_errors(run, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv(hub.ALLOW_NETWORK_ENV, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    one_line_error(lambda: load_model(tmp_path / "missing"), "does not exist")
    (tmp_path / "file").write_text("x")
    one_line_error(lambda: load_model(tmp_path / "file"), "is not a directory")
    (tmp_path / "empty").mkdir()
    one_line_error(lambda: load_model(tmp_path / "empty"), "is not a checkpoint",
                   "no config.json", "model_and_optim")
    one_line_error(lambda: load_model("org/not-cached"), "'org/not-cached'",
                   "local Hugging Face cache", hub.ALLOW_NETWORK_ENV)
    one_line_error(lambda: load_model(run.step, tokenizer=tmp_path / "empty"),
                   "no tokenizer.json", "--tokenizer")
    one_line_error(lambda: load_model(run.step, device="nosuchdevice"),
                   "cannot use device 'nosuchdevice'")


def test_a_step_without_a_tokenizer_is_an_error(run, tmp_path):
    """Its vocabulary is sized from the tokenizer: the message lists where it looked."""
    step = tmp_path / "other" / "pretrain" / run.step.name
    shutil.copytree(run.step, step)
    one_line_error(lambda: load_model(step), "no tokenizer.json in", "tokenizer")


def test_a_release_without_a_tokenizer_loads_when_none_is_needed(run, tmp_path):
    d = tmp_path / "bare"
    d.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(run.release / name, d / name)
    one_line_error(lambda: load_model(d), "no tokenizer.json")
    loaded = load_model(d, need_tokenizer=False)
    assert loaded.tokenizer is None and loaded.tokenizer_dir is None
    same_weights(loaded.model, run.model)


def test_a_tokenizer_larger_than_the_model_is_an_error(run, tmp_path):
    from saved_models import TEXTS

    from olmoflow.tokenizer import BPETokenizer

    big = BPETokenizer().train_from_texts(TEXTS * 40 + [str(i) for i in range(2000)],
                                          vocab_size=1200)
    assert big.vocab_size > load_model(run.release).model.config.vocab_size
    big.save(tmp_path / "big")
    one_line_error(lambda: load_model(run.release, tokenizer=tmp_path / "big"),
                   "is smaller than the tokenizer's")


def test_a_changed_checkpoint_file_is_refused(run, tmp_path):
    step = tmp_path / "run" / "pretrain" / run.step.name
    shutil.copytree(run.root, tmp_path / "run", dirs_exist_ok=True)
    shard = next((step / "model_and_optim").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    one_line_error(lambda: load_model(step), f"checkpoint '{step}' cannot be read",
                   shard.name, "sha256")


def test_resolve_source_names_the_kind(run):
    assert resolve_source(run.step) == ("step", run.step)
    assert resolve_source(run.root / "pretrain" / "latest") == ("step", run.step)
    assert resolve_source(run.root) == ("hf", run.release)


def test_the_lm_eval_adapter_takes_every_form(run):
    """lm-eval's ``olmoflow`` model type reads through the one loader: a training checkpoint
    scores as its release does (it used to need a config.json)."""
    adapter = pytest.importorskip("olmoflow.eval.lm_eval_adapter",
                                  reason="lm-eval is an optional dependency")
    from olmoflow.eval.requests import LoglikelihoodRequest

    request = [LoglikelihoodRequest("def main():\n    return", " 0")]
    scores = []
    for path in (run.step, run.release):
        lm = adapter.OlmoflowLMEval(pretrained=str(path), device="cpu", max_length=TRAINED)
        same_weights(lm.scorer.model, run.model)
        scores.append(lm.scorer.loglikelihood(request)[0].logprob)
    assert scores[0] == scores[1]  # the same weights through the same code path
    with pytest.raises(OlmoflowError, match="no config.json"):
        adapter.OlmoflowLMEval(pretrained=str(run.root / "tokenizer"))


def test_loading_a_step_alone_warns_nothing(run):
    """A step checkpoint read by one process (export, diagnose, eval of a step) is a supported
    torch.distributed.checkpoint mode: the reader prints no warning about a missing process
    group (a fresh interpreter, so no filter installed by training code hides one)."""
    import subprocess
    import sys

    code = ("import sys; from olmoflow.model.load import load_model; "
            "print(load_model(sys.argv[1]).kind)")
    p = subprocess.run([sys.executable, "-c", code, str(run.step)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "step"
    assert "torch.distributed is disabled" not in p.stderr, p.stderr
