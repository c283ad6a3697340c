"""The eager training forward's own backward passes (RMSNorm, RoPE in olmoflow.model.layers)
equal autograd's through the plain formulas."""

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_fp32_close

from olmoflow.model.layers import RotaryEmbedding, apply_rotary, rms_norm, rotate_half


def plain_rotary(x, cos, sin):
    cos, sin = cos[:, None], sin[:, None]
    x32 = x.float()
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)


@pytest.mark.parametrize("yarn", [None, 8.0])
def test_rotary_forward_and_backward_equal_the_plain_formula(yarn):
    rope = RotaryEmbedding(16, 500_000.0, yarn, 32, max_length=64)
    cos, sin = rope(torch.arange(40))
    g = torch.Generator().manual_seed(0)
    # q as the attention makes it: a [B, H, T, hd] view of [B, T, H, hd]
    x = torch.randn(2, 40, 3, 16, generator=g).transpose(1, 2).requires_grad_()
    up = torch.randn(2, 3, 40, 16, generator=g)
    want = plain_rotary(x, cos, sin)
    (want_g,) = torch.autograd.grad(want, x, up)
    got = apply_rotary(x, cos, sin)
    assert got.grad_fn is not None and got.stride() == x.stride()
    (got_g,) = torch.autograd.grad(got, x, up)
    # one product and one sum per entry, maybe fused (one rounding less)
    assert_fp32_close(got, want, 2)
    assert_fp32_close(got_g, want_g, 2)
    with torch.no_grad():
        assert_fp32_close(apply_rotary(x, cos, sin), want, 2)


def test_rotary_bf16_returns_bf16_grads():
    rope = RotaryEmbedding(8, 10_000.0, max_length=16)
    cos, sin = rope(torch.arange(10))
    x = torch.randn(1, 2, 10, 8).bfloat16().requires_grad_()
    out = apply_rotary(x, cos, sin)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert x.grad.dtype == torch.bfloat16
    ref = x.detach().clone().requires_grad_()
    plain_rotary(ref, cos, sin).float().square().sum().backward()
    torch.testing.assert_close(x.grad.float(), ref.grad.float(), rtol=2e-2, atol=2e-2)


def test_rms_norm_forward_and_backward_equal_torch():
    g = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(4, 9, 64, generator=g)).requires_grad_()
    w = torch.nn.Parameter(1 + 0.2 * torch.randn(64, generator=g))
    up = torch.randn(4, 9, 64, generator=g)
    want = F.rms_norm(x, (64,), w, 1e-6)
    want_gx, want_gw = torch.autograd.grad(want, (x, w), up)
    got = rms_norm(x, w, 1e-6)
    assert_fp32_close(got, want, 64, 2)  # |x|^2 from vector_norm, rounded once more
    with torch.no_grad():  # the same numbers without autograd (frozen models, evaluation)
        assert torch.equal(rms_norm(x, w, 1e-6), got)
    gx, gw = torch.autograd.grad(got, (x, w), up)
    # the sums over the 64 features (grad_x) and the 36 positions (grad_w), another order
    assert_fp32_close(gx, want_gx, 64, 4)
    assert_fp32_close(gw, want_gw, 36, 4)
    # a frozen weight (LoRA) or a frozen input: the other gradient alone
    w.requires_grad_(False)
    (gx2,) = torch.autograd.grad(rms_norm(x, w, 1e-6), (x,), up)
    assert torch.equal(gx2, gx)
    w.requires_grad_(True)
    (gw2,) = torch.autograd.grad(rms_norm(x.detach(), w, 1e-6), (w,), up)
    assert torch.equal(gw2, gw)
