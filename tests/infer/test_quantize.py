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


@pytest.mark.parametrize("load, lib, kind", [
    ({"load_in_8bit": True}, "bitsandbytes", "bitsandbytes Int8Params"),
    ({"quantization": "torchao"}, "torchao", "torchao Int8Tensor"),
])
def test_saving_a_quantized_model_is_refused_before_anything_is_created(tmp_path, load, lib,
                                                                         kind):
    """int8 weights with their scales have no place in the Hugging Face OLMo format: one line
    naming the way out, and no (empty) directory left behind."""
    pytest.importorskip(lib, reason=f"{lib} is not installed (pip install 'olmoflow[quant]')")
    torch.manual_seed(0)
    model = Olmo(ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=2, mlp_hidden=128,
                             max_sequence_length=64, sliding_window=16))
    model.save_pretrained(tmp_path / "m")
    q = Olmo.from_pretrained(tmp_path / "m", **load)
    out = tmp_path / "out" / "q"
    with pytest.raises(OlmoflowError) as err:
        q.save_pretrained(out)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"cannot save a quantized model (blocks.0.attention.w_q.weight is a "
                          f"{kind}): save the unquantized model and quantize when loading it")
    assert not (tmp_path / "out").exists()
    # the message's way out works: the unquantized model saves, and quantizes again at load
    model.save_pretrained(out)
    assert type(Olmo.from_pretrained(out, **load).blocks[0].attention.w_q).__name__ == \
        type(q.blocks[0].attention.w_q).__name__
