"""The inference path of ``Olmo.forward`` (fused weights, no per-step masks; taken with a KV cache
under no_grad in eval mode) decodes what the plain path decodes, and its derived weights follow
the parameters."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_fp32_close, assert_greedy_agrees, forward_terms, fp32_rel
from torch import nn

from olmoflow.infer.generate import generate
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo

CONFIGS = {
    # as many key as query heads: the joint q/k norm and RoPE
    "mha": dict(n_heads=4, n_kv_heads=4, sliding_window=8),
    # grouped-query attention: separate q and k norms
    "gqa": dict(n_heads=4, n_kv_heads=2, sliding_window=8),
    # OLMo 3's full-attention layers: YaRN tables beside the sliding layers' plain RoPE
    "yarn": dict(n_heads=4, n_kv_heads=4, sliding_window=8, yarn_factor=4.0,
                 yarn_original_max_length=32),
}


def tiny(name: str) -> Olmo:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=4, mlp_hidden=96,
                      max_sequence_length=128, **CONFIGS[name])
    return Olmo(cfg).eval()


def cached_logits(model: Olmo, ids: torch.Tensor, prefill: int, *, fused: bool,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T, V]``: a prefill of ``prefill`` tokens, then one token per step (no_grad)."""
    model.fused_inference = fused
    try:
        with torch.no_grad():
            cache = model.new_cache(ids.shape[0], ids.shape[1])
            am = mask[:, :prefill] if mask is not None else None
            parts = [model(ids[:, :prefill], attention_mask=am, cache=cache).logits]
            for t in range(prefill, ids.shape[1]):
                parts.append(model(ids[:, t : t + 1], cache=cache).logits)
    finally:
        model.fused_inference = True
    return torch.cat(parts, 1)


def plain_generate(model: Olmo, ids: torch.Tensor, **kw) -> torch.Tensor:
    model.fused_inference = False
    try:
        return generate(model, ids, **kw)
    finally:
        model.fused_inference = True


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_inference_path_logits_and_greedy_tokens_match_plain_path(name):
    model = tiny(name)
    ids = torch.randint(0, 97, (2, 30))  # well past the sliding window of 8
    fast = cached_logits(model, ids, 11, fused=True)
    plain = cached_logits(model, ids, 11, fused=False)
    assert_fp32_close(fast, plain, forward_terms(model.config, ids.shape[1]), 2)

    prompt = ids[:, :12]
    out_fast = generate(model, prompt, max_new_tokens=24)
    out_plain = plain_generate(model, prompt, max_new_tokens=24)
    with torch.no_grad():
        logits = model(out_plain).logits
    atol = fp32_rel(forward_terms(model.config, out_plain.shape[1]), 2) * float(logits.abs().max())
    assert assert_greedy_agrees(out_fast, out_plain, logits, atol, 12) > 0


def test_left_padded_batch_matches_plain_path():
    model = tiny("mha")
    ids = torch.randint(0, 97, (3, 14))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[2, :9] = 0
    fast = cached_logits(model, ids, 14 - 4, fused=True, mask=mask)
    plain = cached_logits(model, ids, 14 - 4, fused=False, mask=mask)
    real = mask.bool()[:, :, None].expand_as(fast)  # pad positions' logits are meaningless
    assert_fp32_close(fast[real], plain[real], forward_terms(model.config, 14), 2)

    out_fast = generate(model, ids, attention_mask=mask, max_new_tokens=12)
    out_plain = plain_generate(model, ids, attention_mask=mask, max_new_tokens=12)
    for row in range(3):  # each row against its own unpadded full forward
        alone = out_plain[row][mask[row].bool().tolist() + [True] * 12][None]
        with torch.no_grad():
            logits = model(alone).logits
        atol = fp32_rel(forward_terms(model.config, alone.shape[1]), 2) * float(logits.abs().max())
        start = int(mask[row].sum())
        mine = out_fast[row][mask[row].bool().tolist() + [True] * 12][None]
        assert assert_greedy_agrees(mine, alone, logits, atol, start) > 0


def test_full_forwards_keep_the_plain_numerics():
    # Training, evaluation and losses run without a cache: bit for bit the same either way.
    model = tiny("mha")
    ids = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        a = model(ids).logits
        model.fused_inference = False
        b = model(ids).logits
        model.fused_inference = True
    assert torch.equal(a, b)


def test_derived_weights_follow_the_parameters():
    model = tiny("gqa")
    ids = torch.randint(0, 97, (1, 16))
    with torch.no_grad():
        w = model.inference_weights()
        assert model.inference_weights() is w  # cached while nothing changes
        # an in-place write (as an optimizer step or load_state_dict does)
        model.blocks[1].attention.w_q.weight.mul_(1.5)
        assert model.inference_weights() is not w
        # a replaced parameter
        lm = model.lm_head
        lm.weight = nn.Parameter(lm.weight * 0.5)
    fast = cached_logits(model, ids, 8, fused=True)
    plain = cached_logits(model, ids, 8, fused=False)
    assert_fp32_close(fast, plain, forward_terms(model.config, 16), 2)
    w = model.inference_weights()
    model.train()  # frees them
    model.eval()
    assert model.inference_weights() is not w


def test_derived_weights_stay_out_of_the_state_dict(tmp_path):
    model = tiny("mha")
    keys = list(model.state_dict())
    generate(model, torch.randint(0, 97, (1, 5)), max_new_tokens=3)
    assert list(model.state_dict()) == keys
    model.save_pretrained(tmp_path)
    again = Olmo.from_pretrained(tmp_path)
    assert list(again.state_dict()) == keys


class ScaledLinear(nn.Linear):
    """A wrapped projection (as LoRA or a quantized linear is): not fused, called as itself."""

    def forward(self, x):
        return super().forward(x) * 1.25


def test_wrapped_linears_are_called_as_modules():
    model = tiny("mha")
    attn, mlp = model.blocks[0].attention, model.blocks[2].feed_forward
    for owner, name in ((attn, "w_k"), (mlp, "w2"), (model, "lm_head")):
        old = getattr(owner, name)
        new = ScaledLinear(old.in_features, old.out_features, bias=False)
        new.weight = old.weight
        setattr(owner, name, new)
    w = model.inference_weights()
    assert w.blocks[0].attention.qkv is None and w.blocks[2].mlp[1] is None
    assert w.lm_head is None and w.blocks[1].attention.qkv is not None
    ids = torch.randint(0, 97, (2, 16))
    fast = cached_logits(model, ids, 6, fused=True)
    plain = cached_logits(model, ids, 6, fused=False)
    assert_fp32_close(fast, plain, forward_terms(model.config, 16), 2)


def test_grad_mode_and_training_take_the_plain_path():
    model = tiny("mha")
    ids = torch.randint(0, 97, (1, 6))
    cache = model.new_cache(1, 6)
    out = model(ids, cache=cache)  # autograd on: the plain, differentiable path
    out.logits.sum().backward()
    assert model.blocks[0].attention.w_q.weight.grad is not None


def test_bf16_inference_path_runs_close_to_plain():
    model = tiny("mha").to(torch.bfloat16)
    ids = torch.randint(0, 97, (2, 16))
    fast = cached_logits(model, ids, 6, fused=True).float()
    plain = cached_logits(model, ids, 6, fused=False).float()
    # bf16 keeps 8 bits of mantissa: the two paths' roundings part at a few 1e-3 of the scale
    scale = float(plain.abs().max())
    torch.testing.assert_close(fast, plain, rtol=0, atol=0.05 * scale)


def test_decode_bucket():
    from olmoflow.infer.generate import decode_bucket

    assert [decode_bucket(n) for n in (1, 2, 3, 5, 8, 9, 64)] == [1, 2, 4, 8, 8, 16, 64]
    assert decode_bucket(3, buckets=(8, 4)) == 4
    for bad in (0, 65):
        with pytest.raises(ValueError, match="row"):
            decode_bucket(bad)
