"""Hub ids in ``Olmo.from_pretrained``: resolved offline in a Hugging Face cache laid out as the
Hub's (``models--org--name/snapshots/<commit>``, ``refs/<revision>``); no network."""

from __future__ import annotations

import pytest
import torch

from olmoflow.errors import OlmoflowError
from olmoflow.model import hub
from olmoflow.model.config import ModelConfig
from olmoflow.model.hub import is_hub_id, network_allowed, resolve_pretrained
from olmoflow.model.olmo import Olmo

REPO = "allenai/OLMo-2-0425-1B"
MAIN = "a" * 40  # snapshots are named by full commit hashes
V2 = "b" * 40


def tiny(seed: int) -> Olmo:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, mlp_hidden=64,
                      max_sequence_length=64, sliding_window=None, vocab_pad_multiple=1)
    return Olmo(cfg).eval()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A Hub cache holding REPO at ``main`` (seed 0) and at tag ``v2`` (seed 1)."""
    monkeypatch.delenv(hub.ALLOW_NETWORK_ENV, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # belt and braces: nothing may reach the network
    root = tmp_path / "hf-cache"
    repo = root / "models--allenai--OLMo-2-0425-1B"
    for seed, commit, ref in [(0, MAIN, "main"), (1, V2, "v2")]:
        tiny(seed).save_pretrained(repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return root


def logits(model: Olmo) -> torch.Tensor:
    return model(torch.arange(8)[None]).logits


def test_hub_id_loads_from_the_local_cache(cache):
    model = Olmo.from_pretrained(REPO, cache_dir=cache)
    assert torch.equal(logits(model), logits(tiny(0)))
    assert resolve_pretrained(REPO, cache_dir=cache) == (
        cache / "models--allenai--OLMo-2-0425-1B" / "snapshots" / MAIN)


def test_hf_hub_cache_is_the_default_cache(cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert torch.equal(logits(Olmo.from_pretrained(REPO)), logits(tiny(0)))


@pytest.mark.parametrize("revision", ["v2", V2])
def test_revision_picks_the_snapshot(cache, revision):
    model = Olmo.from_pretrained(REPO, cache_dir=cache, revision=revision)
    assert torch.equal(logits(model), logits(tiny(1)))


def test_missing_id_is_a_one_line_error(cache):
    with pytest.raises(OlmoflowError, match="'allenai/OLMo-3-7B' is not a directory and was not "
                                            "found in the local Hugging Face cache") as e:
        Olmo.from_pretrained("allenai/OLMo-3-7B", cache_dir=cache)
    msg = str(e.value)
    assert "\n" not in msg and "allow_network=True" in msg and hub.ALLOW_NETWORK_ENV in msg
    with pytest.raises(OlmoflowError, match="at revision 'v3' is not a directory"):
        resolve_pretrained(REPO, cache_dir=cache, revision="v3")


def test_paths_are_returned_as_given(tmp_path, cache):
    d = tmp_path / "allenai"
    tiny(2).save_pretrained(d / "OLMo-2-0425-1B")
    assert resolve_pretrained(d / "OLMo-2-0425-1B") == d / "OLMo-2-0425-1B"
    missing = tmp_path / "nope"  # not a Hub id: the loader reports the missing directory
    assert resolve_pretrained(missing) == missing
    with pytest.raises(OlmoflowError):
        Olmo.from_pretrained(missing)


def test_network_only_when_allowed(cache, monkeypatch):
    import huggingface_hub

    seen = []

    def fake_download(repo_id, **kw):
        seen.append(kw["local_files_only"])
        raise OSError("no route to host")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    for allow in (None, False):
        with pytest.raises(OlmoflowError, match="not found in the local Hugging Face cache"):
            resolve_pretrained("org/model", allow_network=allow)
    monkeypatch.setenv(hub.ALLOW_NETWORK_ENV, "1")
    with pytest.raises(OlmoflowError, match="cannot download 'org/model' from the Hugging Face "
                                            "Hub: no route to host"):
        resolve_pretrained("org/model")
    with pytest.raises(OlmoflowError, match="not found in the local"):
        resolve_pretrained("org/model", allow_network=False)  # the argument wins over the env
    assert seen == [True, True, False, True]


def test_hub_id_form_and_env_parsing(monkeypatch):
    assert is_hub_id(REPO) and is_hub_id("org/name.v1")
    assert not any(is_hub_id(s) for s in ["/abs/path", "./rel/x", "a/b/c", "name", "../x",
                                          "a/..", "org/"])
    monkeypatch.setenv(hub.ALLOW_NETWORK_ENV, "true")
    assert network_allowed() and not network_allowed(False)
    monkeypatch.setenv(hub.ALLOW_NETWORK_ENV, "0")
    assert not network_allowed() and network_allowed(True)
