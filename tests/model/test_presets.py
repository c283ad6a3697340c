"""Presets have the official OLMo 2/3 shapes and parameter counts; HF checkpoints written by
``transformers`` itself (sharded, bf16, transformers-5 ``rope_parameters``) load into ours exactly;
saved names never carry torch.compile / DDP prefixes."""

from __future__ import annotations

import json
import socket

import pytest
import torch
from tolerance import assert_fp32_close, forward_terms

from olmoflow.errors import OlmoflowError
from olmoflow.model.config import ModelConfig
from olmoflow.model.hf import hf_config, model_config_from_hf, save_hf_dir, to_hf_state_dict
from olmoflow.model.olmo import Olmo
from olmoflow.model.presets import format_info, get_preset, meta_param_counts

# Totals of the released checkpoints (sum of numel over their safetensors), which the closed form
# embeddings 2*V*d + L*(q,k,v,o + q/k norms + 2 block norms + SwiGLU 3*d*hidden) + final norm gives.
OFFICIAL = {
    "olmo2_1b": 1_484_916_736,    # allenai/OLMo-2-0425-1B
    "olmo2_7b": 7_298_617_344,    # allenai/OLMo-2-1124-7B
    "olmo2_13b": 13_716_198_400,  # allenai/OLMo-2-1124-13B
    "olmo2_32b": 32_234_279_936,  # allenai/OLMo-2-0325-32B
    "olmo3_7b": 7_298_617_344,    # same shape as OLMo 2 7B; windows add no parameters
    "olmo3_32b": 32_234_279_936,
}
LADDER = {"olmo3_14m": 14e6, "olmo3_60m": 60e6, "olmo3_190m": 190e6, "olmo3_370m": 370e6}


def closed_form(c: ModelConfig) -> int:
    d, hd, L = c.d_model, c.hd, c.n_layers
    q, kv = c.n_heads * hd, c.n_kv_heads * hd
    per_layer = (d * q + 2 * d * kv + q * d) + (q + kv) + 2 * d + 3 * d * c.mlp_hidden
    return 2 * c.vocab_size * d + L * per_layer + d


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_official_parameter_counts(name):
    cfg = get_preset(name)
    counts = meta_param_counts(cfg)  # built on meta: a 32B model costs no memory
    assert counts["total"] == OFFICIAL[name] == cfg.num_params() == closed_form(cfg)
    assert counts["non_embedding"] == cfg.num_params(include_embedding=False)
    assert cfg.vocab_size == 100_352 == cfg.padded_vocab_size(100_278)
    assert cfg.hd == 128


def test_official_shapes_and_attention_pattern():
    for name in ("olmo2_1b", "olmo2_7b", "olmo2_13b", "olmo2_32b"):
        c = get_preset(name)
        assert not c.sliding_window and c.yarn_factor is None
        assert all(c.is_full_attention(i) for i in range(c.n_layers))
    for name in ("olmo3_7b", "olmo3_32b"):
        c = get_preset(name)
        assert (c.sliding_window, c.yarn_factor, c.yarn_original_max_length,
                c.max_sequence_length) == (4096, 8.0, 8192, 65536)
        full = [i for i in range(c.n_layers) if c.is_full_attention(i)]
        assert full == list(range(3, c.n_layers, 4))  # every 4th; the last layer is one of them
    big = get_preset("olmo3_32b")
    assert (big.d_model, big.n_layers, big.n_heads, big.n_kv_heads, big.mlp_hidden) == (
        5120, 64, 40, 8, 27648)
    assert (get_preset("olmo2_13b").d_model, get_preset("olmo2_13b").mlp_hidden) == (5120, 13824)


@pytest.mark.parametrize("name", sorted(LADDER))
def test_ladder_names_count_non_embedding_parameters(name):
    c = get_preset(name)
    n = meta_param_counts(c)["non_embedding"]
    assert abs(n - LADDER[name]) / LADDER[name] < 0.05, n
    assert c.sliding_window == 4096 and c.hd == 64


def test_unknown_preset_names_the_closest():
    msg = r"unknown model preset 'olmo3_7m'; did you mean 'olmo3_"
    with pytest.raises(OlmoflowError, match=msg) as e:
        get_preset("olmo3_7m")
    assert "\n" not in str(e.value)
    with pytest.raises(OlmoflowError, match="did you mean 'olmo2_13b'"):
        get_preset("olmo2_13bb")
    assert get_preset("OLMo2-1B") == ModelConfig.olmo2_1b()  # case and dash insensitive
    assert ModelConfig.from_preset("olmo3_14m", n_layers=2).n_layers == 2
    with pytest.raises(OlmoflowError, match="n_layer"):
        get_preset("olmo3_14m", n_layer=2)


def test_format_info_table():
    text = format_info("olmo2_32b", get_preset("olmo2_32b"))
    assert "32,234,279,936" in text and "8 (GQA)" in text and "60.04 GiB" in text


@pytest.mark.parametrize("name", ["olmo2_1b", "olmo3_32b"])
def test_hf_config_round_trip_and_transformers_count(name):
    """Our config.json for a preset means the same model to transformers (counted on meta)."""
    transformers = pytest.importorskip("transformers")
    cfg = get_preset(name)
    d = hf_config(cfg)
    assert model_config_from_hf(d) == cfg
    hf_cfg = transformers.AutoConfig.for_model(**d)
    assert model_config_from_hf(json.loads(hf_cfg.to_json_string())) == cfg  # transformers 5 style
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    assert sum(p.numel() for p in hf.parameters()) == OFFICIAL[name]


# ---- loading checkpoints written by transformers ---------------------------------------------

transformers = pytest.importorskip("transformers",
                                   reason="transformers writes the reference checkpoints")


def _hf_olmo3(**kw):
    base = dict(vocab_size=96, hidden_size=80, intermediate_size=112, num_hidden_layers=8,
                num_attention_heads=10, num_key_value_heads=2, head_dim=8,  # 32B-style 5:1 GQA
                max_position_embeddings=128, sliding_window=12, rms_norm_eps=1e-6,
                rope_theta=500_000.0, pad_token_id=0, eos_token_id=1)
    base.update(kw)
    torch.manual_seed(0)
    model = transformers.Olmo3ForCausalLM(transformers.Olmo3Config(**base)).eval()
    with torch.no_grad():  # norms start at 1; perturb them so a misplaced norm cannot hide
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _assert_same_weights(ours: Olmo, hf) -> None:
    ref = to_hf_state_dict(ours.state_dict())
    theirs = hf.state_dict()
    assert ref.keys() == {k for k in theirs if "rotary" not in k}
    for k, v in ref.items():
        assert v.dtype == theirs[k].dtype and torch.equal(v, theirs[k]), k


@pytest.mark.parametrize("yarn", [False, True], ids=["olmo3", "olmo3-yarn"])
def test_load_sharded_transformers_checkpoint(tmp_path, yarn):
    scaling = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}
    hf = _hf_olmo3(**({"rope_scaling": scaling} if yarn else {}))
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in saved  # transformers 5 style, no rope_theta / rope_scaling
    ours = Olmo.from_pretrained(tmp_path)
    assert ours.config.n_kv_heads == 2 and ours.config.yarn_factor == (8.0 if yarn else None)
    _assert_same_weights(ours, hf)
    ids = torch.randint(0, 96, (2, 40))  # longer than the window (12)
    with torch.no_grad():  # two code paths of one math: the bound of tolerance.py
        assert_fp32_close(ours(ids).logits, hf(ids).logits, forward_terms(ours.config, 40), 2)


def test_load_bf16_keeps_bf16_unless_asked(tmp_path):
    hf = _hf_olmo3().to(torch.bfloat16)
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    ours = Olmo.from_pretrained(tmp_path)
    assert ours.embeddings.weight.dtype == torch.bfloat16
    _assert_same_weights(ours, hf)
    as32 = Olmo.from_pretrained(tmp_path, dtype=torch.float32)
    assert as32.lm_head.weight.dtype == torch.float32
    assert torch.equal(as32.lm_head.weight, hf.lm_head.weight.float())


def test_load_olmo2_flat_rope_parameters(tmp_path):
    """OLMo 2 configs in transformers 5 carry a flat rope_parameters; its theta must be honoured."""
    torch.manual_seed(0)
    c = transformers.Olmo2Config(vocab_size=64, hidden_size=32, intermediate_size=48,
                                 num_hidden_layers=2, num_attention_heads=4, rope_theta=10_000.0,
                                 max_position_embeddings=64, pad_token_id=0, eos_token_id=1)
    hf = transformers.Olmo2ForCausalLM(c).eval()
    hf.save_pretrained(tmp_path)
    ours = Olmo.from_pretrained(tmp_path)
    assert ours.config.rope_theta == 10_000.0 and not ours.config.sliding_window
    ids = torch.randint(0, 64, (1, 30))
    with torch.no_grad():  # two code paths of one math: the bound of tolerance.py
        assert_fp32_close(ours(ids).logits, hf(ids).logits, forward_terms(ours.config, 30), 2)


def test_unsupported_or_broken_directories(tmp_path):
    hf = _hf_olmo3()
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(OlmoflowError, match="missing"):
        Olmo.from_pretrained(tmp_path)
    with pytest.raises(OlmoflowError, match="no config.json"):
        Olmo.from_pretrained(tmp_path / "nope")
    good = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(OlmoflowError, match="tie_word_embeddings"):
        model_config_from_hf(dict(good, tie_word_embeddings=True))
    # Weights that disagree with their config.json are refused by name, not by a torch traceback.
    ours = tmp_path / "ours"
    save_hf_dir(Olmo(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2,
                                 mlp_hidden=48)), ours)
    cfg = json.loads((ours / "config.json").read_text())
    (ours / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=64)))
    with pytest.raises(OlmoflowError, match=r"do not match its config.json: .*wrong shape "
                                            r"\['blocks.0.feed_forward.w1.weight'"):
        Olmo.from_pretrained(ours)
    # transformers' default Olmo3Config pattern for 5 layers leaves the last layer sliding; OLMo 3
    # (OLMo-core and ours) always makes the last layer full, so such a config is refused clearly.
    five = json.loads(transformers.Olmo3Config(num_hidden_layers=5).to_json_string())
    with pytest.raises(OlmoflowError, match="not an OLMo 3 pattern"):
        model_config_from_hf(five)


# ---- wrapper prefixes ------------------------------------------------------------------------


def _tiny() -> Olmo:
    torch.manual_seed(0)
    return Olmo(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                            mlp_hidden=48, max_sequence_length=64, sliding_window=8))


def _assert_clean_export(tmp_path, wrapped, bare):
    from safetensors import safe_open

    save_hf_dir(wrapped, tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert not any("_orig_mod" in k or "module." in k for k in keys), keys
    again = Olmo.from_pretrained(tmp_path)
    for k, v in bare.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


def test_torch_compile_state_dict_has_no_prefix(tmp_path):
    model = _tiny()
    compiled = torch.compile(model)  # an OptimizedModule; nothing compiles until it is called
    assert any(k.startswith("_orig_mod.") for k in compiled.state_dict())
    _assert_clean_export(tmp_path, compiled, model)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_state_dict_has_no_prefix(tmp_path):
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable or already initialised in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        model = _tiny()
        ddp = torch.nn.parallel.DistributedDataParallel(torch.compile(model))
        assert any(k.startswith("module._orig_mod.") for k in ddp.state_dict())
        _assert_clean_export(tmp_path, ddp, model)
    finally:
        dist.destroy_process_group()
