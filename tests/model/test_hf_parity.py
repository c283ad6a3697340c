"""Our OLMo equals transformers' Olmo2/Olmo3ForCausalLM on the same weights (fp32 logits)."""

import pytest
import torch
from tolerance import assert_fp32_close, forward_terms

from olmoflow.model.config import ModelConfig
from olmoflow.model.hf import hf_config, save_hf_dir
from olmoflow.model.olmo import Olmo

transformers = pytest.importorskip("transformers",
                                   reason="transformers is the reference for parity")


def _tiny(**kw):
    base = dict(vocab_size=128, d_model=64, n_layers=5, n_heads=4, n_kv_heads=2, mlp_hidden=96,
                max_sequence_length=256, sliding_window=16)
    base.update(kw)
    return ModelConfig(**base)


def _hf_model(tmp_path, model):
    save_hf_dir(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                           attn_implementation="eager")
    return hf.eval()


@pytest.mark.parametrize(
    "kw",
    [
        dict(),  # OLMo 3: sliding windows (16) shorter than the sequence, GQA
        dict(sliding_window=None),  # OLMo 2: full attention everywhere
        dict(yarn_factor=8.0, yarn_original_max_length=64),  # OLMo 3 + YaRN on full layers
    ],
    ids=["olmo3", "olmo2", "olmo3-yarn"],
)
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_logits_match_transformers(tmp_path, kw, backend):
    torch.manual_seed(0)
    model = Olmo(_tiny(attention_backend=backend, **kw)).eval()
    # Norm weights start at 1; perturb them so a wrong norm placement cannot hide.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    hf = _hf_model(tmp_path, model)
    expected = "Olmo3ForCausalLM" if kw.get("sliding_window", 16) else "Olmo2ForCausalLM"
    assert type(hf).__name__ == expected
    if kw.get("yarn_factor"):
        # transformers applies rope_scaling to full-attention layers only for OLMo 3, as OLMo 3
        # trained.
        assert hf.config.rope_parameters["sliding_attention"]["rope_type"] == "default"
        assert hf.config.rope_parameters["full_attention"]["rope_type"] == "yarn"
    ids = torch.randint(0, 128, (2, 70))  # longer than the sliding window
    with torch.no_grad():
        ours = model(ids).logits
        ref = hf(ids).logits
    # transformers orders the same math its own way (norms, RoPE, attention): two ulps per
    # accumulated term of the logits' scale (tolerance.py).
    assert_fp32_close(ours, ref, forward_terms(model.config, ids.shape[1]), 2)


def test_hf_config_layer_types():
    cfg = _tiny(n_layers=6)
    types = hf_config(cfg)["layer_types"]
    # every 4th layer and the last one are full attention
    assert types == (["sliding_attention"] * 3
                     + ["full_attention", "sliding_attention", "full_attention"])


def test_export_reimport_bit_identical(tmp_path):
    torch.manual_seed(1)
    model = Olmo(_tiny())
    save_hf_dir(model, tmp_path / "m")
    again = Olmo.from_pretrained(tmp_path / "m")
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_saved_keys_have_no_wrapper_prefixes(tmp_path):
    from safetensors import safe_open

    model = Olmo(_tiny())
    wrapped = torch.nn.Module()
    wrapped.module = model  # what DDP's state_dict keys look like
    state = {f"module._orig_mod.{k}": v for k, v in model.state_dict().items()}
    from olmoflow.model.hf import to_hf_state_dict

    keys = to_hf_state_dict(state).keys()
    assert all(not k.startswith(("module.", "_orig_mod.")) for k in keys)
    save_hf_dir(model, tmp_path / "m")
    with safe_open(tmp_path / "m" / "model.safetensors", "pt") as f:
        assert "model.embed_tokens.weight" in f.keys()
