"""The chunked LM head + loss (olmoflow.model.loss.linear_lm_loss) equals the head followed by
lm_loss, in value and in gradients, and the model uses it in training only."""

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_fp32_close, forward_terms, fp32_rel

from olmoflow.model.config import ModelConfig
from olmoflow.model.loss import IGNORE_INDEX, linear_lm_loss, lm_loss
from olmoflow.model.olmo import Olmo

N, D, V = 203, 24, 300  # N not a multiple of the chunk sizes below: a ragged last chunk


def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g).requires_grad_()
    w = torch.nn.Parameter(torch.randn(V, D, generator=g) * 0.5)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::5] = IGNORE_INDEX
    return x, w, labels


def terms():
    """fp32 additions on the way to a gradient entry: the logits over D, the softmax over V, and
    the head's gradient sums over D (grad_x) or over the N tokens (grad_w)."""
    return D + V + N


@pytest.mark.parametrize("rows", [1, 64, 128, N, 1000])
@pytest.mark.parametrize("normalizer", [None, 777.0])
def test_chunked_loss_equals_plain_in_value_and_grads(rows, normalizer):
    x, w, labels = problem()
    want = lm_loss(F.linear(x, w), labels, 1e-2, normalizer)
    want_g = torch.autograd.grad(want[0], (x, w))
    got = linear_lm_loss(x, w, labels, 1e-2, normalizer, chunk_rows=rows)
    got_g = torch.autograd.grad(got[0], (x, w))
    for a, b in zip(got, want):
        assert_fp32_close(a, b, terms())
    assert got[2].item() > 0  # the z-loss term is on
    for a, b in zip(got_g, want_g):
        assert_fp32_close(a, b, terms(), 2)
    # the ignored positions get no gradient at all
    assert torch.equal(got_g[0][::5], torch.zeros_like(got_g[0][::5]))


def test_grads_through_ce_and_z_on_their_own_are_exact():
    """A loss that weighs ce and z on their own (not only through ``loss``) recomputes their
    gradients in backward: still equal to the plain path."""
    x, w, labels = problem(1)
    want = lm_loss(F.linear(x, w), labels, 1e-2)
    want_g = torch.autograd.grad(3 * want[0] + 2 * want[1] - 5 * want[2], (x, w))
    got = linear_lm_loss(x, w, labels, 1e-2, chunk_rows=64)
    got_g = torch.autograd.grad(3 * got[0] + 2 * got[1] - 5 * got[2], (x, w))
    for a, b in zip(got_g, want_g):
        assert_fp32_close(a, b, terms(), 4)
    got = linear_lm_loss(x, w, labels, 1e-2, chunk_rows=64)
    (g_z,) = torch.autograd.grad(got[2], (w,))
    want = lm_loss(F.linear(x, w), labels, 1e-2)
    (want_z,) = torch.autograd.grad(want[2], (w,))
    assert_fp32_close(g_z, want_z, terms(), 2)


def test_a_second_backward_raises():
    x, w, labels = problem()
    loss = linear_lm_loss(x, w, labels, 1e-2, chunk_rows=64)[0]
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already backpropagated once"):
        loss.backward()


def test_frozen_weight_and_no_grad():
    x, w, labels = problem(2)
    w.requires_grad_(False)
    got = linear_lm_loss(x, w, labels, 1e-3, chunk_rows=50)
    (gx,) = torch.autograd.grad(got[0], (x,))
    want = lm_loss(F.linear(x, w), labels, 1e-3)
    assert_fp32_close(gx, torch.autograd.grad(want[0], (x,))[0], terms(), 2)
    with torch.no_grad():
        loss, ce, z = linear_lm_loss(x, w, labels, 1e-3, chunk_rows=50)
    assert loss.grad_fn is None
    assert_fp32_close(ce, want[1], terms())


def test_bad_shapes_raise():
    x, w, labels = problem()
    with pytest.raises(ValueError, match="does not match the weight"):
        linear_lm_loss(x[:, :5], w, labels, 0.0)
    with pytest.raises(ValueError, match="labels 10 for 203 rows"):
        linear_lm_loss(x, w, labels[:10], 0.0)
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        linear_lm_loss(x, w, labels, 0.0, chunk_rows=0)


def test_no_full_logits_are_saved_for_backward():
    """What autograd keeps between forward and backward: nothing of the logits' size."""
    x, w, labels = problem()
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t,
                                                  lambda t: t):
        loss = linear_lm_loss(x, w, labels, 1e-2, chunk_rows=32)[0]
    loss.backward()
    assert max(sizes) < N * V // 4, sizes
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t,
                                                  lambda t: t):
        lm_loss(F.linear(x, w), labels, 1e-2)
    assert max(sizes) == N * V  # the plain path keeps them: the check above can fail


def tiny(**kw):
    torch.manual_seed(0)
    return Olmo(ModelConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, mlp_hidden=64,
                            max_sequence_length=64, sliding_window=8, **kw))


def test_model_training_forward_is_chunked_and_equals_the_plain_path():
    model = tiny().train()
    ids = torch.randint(0, 128, (3, 20))
    labels = torch.randint(0, 128, (3, 20))
    labels[0, :4] = IGNORE_INDEX
    out = model(ids, labels, loss_normalizer=50.0)
    assert out.logits is None  # the chunked path: no [B, T, V] logits
    out.loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.lm_loss_fn = lm_loss  # the seam: the head module, then this loss over its logits
    ref = model(ids, labels, loss_normalizer=50.0)
    assert ref.logits is not None
    ref.loss.backward()
    t = forward_terms(model.config, 20, tokens=60)
    for k in ("loss", "ce_loss", "z_loss"):
        assert getattr(out, k).item() == pytest.approx(getattr(ref, k).item(), rel=fp32_rel(t),
                                                       abs=1e-12)
    for n, p in model.named_parameters():
        # the backward retraces the forward: its sums once more (tolerance.py), then the
        # head's gradient sum over the 60 tokens
        assert_fp32_close(got[n], p.grad, 2 * t + 60, 2, msg=n)


def test_callers_that_need_logits_still_get_them():
    model = tiny().train()
    ids = torch.randint(0, 128, (2, 10))
    with torch.no_grad():  # evaluation with labels: logits and loss both
        out = model(ids, ids)
    assert out.logits is not None and out.logits.shape == (2, 10, 128)
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    try:  # a hook on the head: the module is called, its output returned
        out = model(ids, ids)
    finally:
        hook.remove()
    assert seen == [(2, 10, 128)] and out.logits is not None
    assert model(ids, ids).logits is None
    both = model(ids, ids, return_logits=True)  # asked for: the head module, then lm_loss
    assert both.logits.shape == (2, 10, 128) and both.loss.grad_fn is not None


def test_bf16_model_trains_through_the_chunked_path():
    model = tiny().to(torch.bfloat16).train()
    ids = torch.randint(0, 128, (2, 16))
    out = model(ids, ids)
    assert out.logits is None
    out.loss.backward()
    got = model.lm_head.weight.grad.float()
    model.zero_grad()
    model.lm_loss_fn = lm_loss
    ref = model(ids, ids)
    ref.loss.backward()
    want = model.lm_head.weight.grad.float()
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-2)
    # bf16 matmuls round at 2**-8; the chunks round grad_w in another place
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * float(want.abs().max()))


def test_autocast_runs_the_head_in_the_autocast_dtype():
    x, w, labels = problem(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_lm_loss(x, w, labels, 1e-3, chunk_rows=64)
        want = lm_loss(F.linear(x, w), labels, 1e-3)
    gx, gw = torch.autograd.grad(got[0], (x, w))
    wx, ww = torch.autograd.grad(want[0], (x, w))
    assert gx.dtype == gw.dtype == torch.float32
    assert got[0].item() == pytest.approx(want[0].item(), rel=1e-2)
    for a, b in ((gx, wx), (gw, ww)):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2 * float(b.abs().max()))
