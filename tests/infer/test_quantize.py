"""8-bit inference (bitsandbytes, torchao) runs on CPU, shrinks the model and keeps its choices."""

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from olmoflow.errors import OlmoflowError
from olmoflow.infer.generate import generate
from olmoflow.infer.quantize import memory_footprint, quantize_model, top1_agreement
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo

RELEASE = Path(__file__).resolve().parents[2] / "runs" / "demo" / "release"
HELDOUT = RELEASE.parent / "tokens" / "heldout" / "part-00000.npy"
LIB = {"bnb": "bitsandbytes", "torchao": "torchao"}


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, mlp_hidden=256,
                      max_sequence_length=128)
    return Olmo(cfg).eval()


@pytest.mark.parametrize("method", ["bnb", "torchao"])
def test_quantized_tiny_model_runs_smaller_and_close(tiny, method):
    pytest.importorskip(LIB[method])
    q = quantize_model(copy.deepcopy(tiny), method)
    assert isinstance(q.lm_head, torch.nn.Linear) and q.lm_head.weight.dtype == torch.float32
    assert type(q.blocks[0].attention.w_q) is not torch.nn.Linear or \
        type(q.blocks[0].attention.w_q.weight) is not torch.nn.Parameter
    linear_bytes = sum(m.weight.numel() * 4 for n, m in tiny.named_modules()
                       if isinstance(m, torch.nn.Linear) and n != "lm_head")
    saved = memory_footprint(tiny) - memory_footprint(q)
    assert saved > 0.70 * linear_bytes  # int8 + per-row scales: ~4x smaller linears
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a, b = tiny(ids).logits, q(ids).logits
    assert torch.isfinite(b).all()
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    assert generate(q, ids, max_new_tokens=4).shape == (2, 36)


def test_unknown_method(tiny):
    with pytest.raises(ValueError, match="unknown quantization method"):
        quantize_model(copy.deepcopy(tiny), "fp4")


@pytest.mark.skipif(not (RELEASE / "model.safetensors").is_file() or not HELDOUT.is_file(),
                    reason="no demo release at runs/demo/release (make demo builds it)")
@pytest.mark.parametrize("method", ["bnb", "torchao"])
def test_demo_release_top1_agreement(method):
    pytest.importorskip(LIB[method])
    ref = Olmo.from_pretrained(RELEASE)
    tokens = torch.from_numpy(np.fromfile(HELDOUT, dtype=np.uint16)[:2048].astype(np.int64))
    q = quantize_model(copy.deepcopy(ref), method)
    assert memory_footprint(q) < 0.75 * memory_footprint(ref)
    assert top1_agreement(ref, q, tokens, sequence_length=256) >= 0.99


def test_from_pretrained_load_in_8bit(tmp_path):
    pytest.importorskip("bitsandbytes")
    from olmoflow.model.config import ModelConfig
    from olmoflow.model.olmo import Olmo

    torch.manual_seed(0)
    model = Olmo(ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=2, mlp_hidden=128,
                             max_sequence_length=64, sliding_window=16))
    model.save_pretrained(tmp_path / "m")
    q = Olmo.from_pretrained(tmp_path / "m", load_in_8bit=True, device_map="auto")
    assert type(q.blocks[0].attention.w_q).__name__ == "Linear8bitLt"
    assert type(q.lm_head) is torch.nn.Linear  # the head stays in full precision
    ids = torch.randint(0, 128, (1, 12))
    assert q.generate(ids, max_new_tokens=4).shape == (1, 16)


def _small(tmp_path) -> Path:
    torch.manual_seed(0)
    model = Olmo(ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=2, mlp_hidden=128,
                             max_sequence_length=64, sliding_window=16))
    model.save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def test_an_int8_model_saves_its_int8_weights_and_loads_back_bit_identically(tmp_path):
    """As transformers saves a bitsandbytes int8 model: int8 weights, fp32 row scales (SCB) and
    quantization_config; loaded back as saved, never re-quantized."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed "
                        "(pip install 'olmoflow[quant]')")
    import json

    from safetensors import safe_open

    q = Olmo.from_pretrained(_small(tmp_path), load_in_8bit=True)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        logits = q(ids).logits
    q.save_pretrained(tmp_path / "q8")
    config = json.loads((tmp_path / "q8" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "bitsandbytes"
    assert config["quantization_config"]["load_in_8bit"] is True
    assert config["quantization_config"]["llm_int8_skip_modules"] == ["lm_head"]
    with safe_open(str(tmp_path / "q8" / "model.safetensors"), framework="pt") as st:
        w = st.get_tensor("model.layers.0.self_attn.q_proj.weight")
        scb = st.get_tensor("model.layers.0.self_attn.q_proj.SCB")
        assert w.dtype == torch.int8 and scb.dtype == torch.float32 and scb.shape == (64,)
        assert st.get_tensor("lm_head.weight").dtype == torch.float32  # the head stays float
    assert (tmp_path / "q8" / "model.safetensors").stat().st_size < \
        0.5 * (tmp_path / "m" / "model.safetensors").stat().st_size
    back = Olmo.from_pretrained(tmp_path / "q8")  # no load_in_8bit needed: the config says so
    assert type(back.blocks[0].attention.w_q).__name__ == "Linear8bitLt"
    assert type(back.lm_head) is torch.nn.Linear
    with torch.inference_mode():
        assert torch.equal(back(ids).logits, logits)  # the same path twice: bit for bit
    ours, theirs = q.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert torch.equal(back.generate(ids, max_new_tokens=4), q.generate(ids, max_new_tokens=4))
    back.save_pretrained(tmp_path / "again")  # and saving it again writes the same bytes
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == \
        (tmp_path / "q8" / "model.safetensors").read_bytes()
    # asked for torchao on int8 weights: one line, not a second quantization
    with pytest.raises(OlmoflowError, match="holds bitsandbytes int8 weights"):
        Olmo.from_pretrained(tmp_path / "q8", quantization="torchao")


def test_a_damaged_int8_directory_is_one_line(tmp_path):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    import json

    from safetensors.torch import load_file, save_file

    Olmo.from_pretrained(_small(tmp_path), load_in_8bit=True).save_pretrained(tmp_path / "q8")
    weights = tmp_path / "q8" / "model.safetensors"
    state = load_file(str(weights))
    del state["model.layers.1.mlp.up_proj.SCB"]  # int8 data without its scales
    save_file(state, str(weights))
    with pytest.raises(OlmoflowError) as err:
        Olmo.from_pretrained(tmp_path / "q8")
    assert "\n" not in str(err.value) and "model.layers.1.mlp.up_proj.weight" in str(err.value)
    assert "needs its SCB scales" in str(err.value)
    cfg = tmp_path / "q8" / "config.json"
    raw = json.loads(cfg.read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    cfg.write_text(json.dumps(raw))
    with pytest.raises(OlmoflowError, match="quantization_config 'gptq' is not supported"):
        Olmo.from_pretrained(tmp_path / "q8")


def test_saving_a_torchao_model_is_refused_before_anything_is_created(tmp_path):
    """torchao's int8 tensor subclasses have no safetensors layout transformers reads: one line
    naming the way out, and no (empty) directory left behind."""
    pytest.importorskip("torchao",
                        reason="torchao is not installed (pip install 'olmoflow[quant]')")
    model_dir = _small(tmp_path)
    q = Olmo.from_pretrained(model_dir, quantization="torchao")
    out = tmp_path / "out" / "q"
    with pytest.raises(OlmoflowError) as err:
        q.save_pretrained(out)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("cannot save a quantized model (blocks.0.attention.w_q.weight is a "
                          "torchao Int8Tensor): save the unquantized model and quantize when "
                          "loading it")
    assert not (tmp_path / "out").exists()
    # the message's way out works: the unquantized model quantizes again at load
    assert type(Olmo.from_pretrained(model_dir, quantization="torchao").blocks[0].attention.w_q
                ).__name__ == type(q.blocks[0].attention.w_q).__name__


def test_transformers_loads_a_saved_int8_model_with_the_same_int8_weights(tmp_path):
    """The layout is transformers' own: its bitsandbytes loader reads the directory as 8-bit,
    with our int8 weights, and computes the same logits (another code path: a bound)."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    transformers = pytest.importorskip("transformers")
    from tolerance import assert_fp32_close, forward_terms

    q = Olmo.from_pretrained(_small(tmp_path), load_in_8bit=True)
    q.save_pretrained(tmp_path / "q8")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q8").eval()
    proj = hf.model.layers[0].self_attn.q_proj
    assert type(proj).__name__ == "Linear8bitLt" and proj.weight.dtype == torch.int8
    assert torch.equal(proj.weight.data, q.blocks[0].attention.w_q.weight.data)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ours, theirs = q(ids).logits, hf(ids).logits
    # both run bitsandbytes' int8 matmuls on the same int8 inputs; the rest is fp32 in two codes
    assert_fp32_close(theirs, ours, forward_terms(q.config, 12))
