"""The language-model loss: cross-entropy on fp32 logits plus z-loss.

Two ways to the same numbers (within fp32 rounding):

- :func:`lm_loss` over logits someone already has (``[..., V]``), one pass over the vocabulary
  (:class:`_CrossEntropyZLoss`);
- :func:`linear_lm_loss` over the final hidden states and the LM head's weight, for training: the
  head and the loss run chunk by chunk over the tokens, each chunk's gradients wrt the hidden
  states and the weight are computed in the forward (the "fused linear cross-entropy" of
  Liger-Kernel, Hsu et al. 2024, and of Wijmans et al. 2024, "Cut your losses in large-vocabulary
  language models"), and the ``[N, V]`` logits never exist as a whole.

The loss is PaLM's (Chowdhery et al. 2022): per target token ``ce = lse - logit[target]`` and
``z = z_coef * lse**2`` with ``lse = logsumexp(logits)``, summed over the targets and divided by a
normalizer; OLMo uses ``z_coef = 1e-5``.
"""

from __future__ import annotations

import torch
from torch import nn

IGNORE_INDEX = -100

# Tokens per chunk of :func:`linear_lm_loss`: about CHUNK_LOGITS logits (fp32, 4 bytes each), so
# that the two chunk buffers (the logits and their log-softmax) stay in a CPU's last-level cache
# at small vocabularies, but at least CHUNK_MIN_ROWS, so that the head's matmuls keep enough rows
# to run at speed at large ones (OLMo's 100k).
CHUNK_LOGITS = 1 << 22
CHUNK_MIN_ROWS = 128


class _CrossEntropyZLoss(torch.autograd.Function):
    """Summed cross-entropy and z-loss over ``[N, V]`` fp32 logits in one pass over the vocabulary.

    Forward: one ``log_softmax``; ``lse = logit[target] - logp[target]``. Backward writes the
    gradient straight into the saved ``logp`` buffer: ``softmax * (g_ce + 2 c g_z lse) - onehot *
    g_ce``, instead of autograd's separate dense gradients for the CE and the z-loss terms.
    (The graph can be backpropagated once, as in any training step.)
    """

    @staticmethod
    def forward(ctx, logits, labels, z_coef: float, scale: torch.Tensor):
        logp = torch.log_softmax(logits, dim=-1)
        valid = (labels != IGNORE_INDEX).to(logits.dtype)
        target = labels.clamp_min(0)[:, None]
        logp_t = logp.gather(1, target).squeeze(1)
        lse = logits.gather(1, target).squeeze(1) - logp_t
        ce = -(logp_t * valid).sum() * scale
        z = z_coef * (lse.square() * valid).sum() * scale
        ctx.save_for_backward(logp, target, lse, valid, scale)
        ctx.z_coef = z_coef
        return ce, z

    @staticmethod
    def backward(ctx, g_ce, g_z):
        logp, target, lse, valid, scale = ctx.saved_tensors
        w_ce = g_ce * valid * scale
        coef = w_ce + (2 * ctx.z_coef * scale) * g_z * lse * valid
        return _logits_grad_(logp, target, w_ce[:, None], coef[:, None]), None, None, None


def _logits_grad_(logp: torch.Tensor, target: torch.Tensor, a: torch.Tensor,
                  coef: torch.Tensor) -> torch.Tensor:
    """The gradient wrt the logits, ``softmax * coef - onehot(target) * a``, written into
    ``logp`` (``[n, V]`` fp32 log-softmax, consumed) and returned: ``a [n, 1]`` is the weight of
    each row's CE term, ``coef [n, 1] = a + 2 z_coef (z weight) lse`` adds the z-loss's."""
    return logp.exp_().mul_(coef).scatter_add_(1, target, -a)


def _scale(labels: torch.Tensor, normalizer: float | None, device) -> torch.Tensor:
    """``1 / normalizer``, or ``1 / (this call's target count)``, as an fp32 0-dim tensor (no device
    sync, no torch.compile graph break). A normalizer of 0 (a global batch without a target, whose
    sums are 0) scales by 0: the loss and its gradient are 0, never a division by zero."""
    if normalizer is not None:
        n = float(normalizer)
        return torch.tensor(1.0 / n if n else 0.0, device=device)
    return 1.0 / (labels != IGNORE_INDEX).sum().clamp_min(1).to(torch.float32)


def lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, z_loss_coef: float, normalizer: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cross-entropy on fp32 logits plus z-loss (PaLM, Chowdhery et al. 2022; OLMo uses 1e-5).

    Args:
        logits: ``[..., V]``; labels: ``[...]`` with ``IGNORE_INDEX`` for positions without a
            target.
        z_loss_coef: weight of ``logsumexp(logits)**2``.
        normalizer: divide the summed losses by this (the number of target tokens in the whole
            global batch, for gradient accumulation); None divides by this call's target count;
            0 (no target anywhere) gives a loss of 0.
    Returns:
        ``(loss, ce_loss, z_loss)`` scalars, ``loss = ce_loss + z_loss``.
    """
    logits = logits.float().reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1)
    scale = _scale(labels, normalizer, logits.device)
    ce, z = _CrossEntropyZLoss.apply(logits, labels, float(z_loss_coef), scale)
    return ce + z, ce, z


def _chunked_pass(x, weight, labels, z_coef: float, scale, g_ce, g_z, want_x: bool,
                  want_w: bool, rows: int):
    """The LM head and the loss over ``x [N, d]`` and ``weight [V, d]``, ``rows`` tokens at a
    time: ``(ce_sum, z_sum, grad_x, grad_w)``, the sums fp32 0-dim and not yet scaled.

    The gradients (None unless ``want_x`` / ``want_w``) are those of ``scale * (g_ce * ce_sum +
    g_z * z_sum)``: per chunk, ``dlogits = softmax * (a + b lse) - onehot(target) * a`` with ``a =
    valid * scale * g_ce`` and ``b = 2 z_coef valid * scale * g_z``, then ``grad_x = dlogits @ W``
    and ``grad_w += dlogits^T @ x``. Matmuls in ``x``'s dtype, the softmax in fp32, ``grad_w``
    accumulated in fp32.
    """
    N, V = x.shape[0], weight.shape[0]
    dev, fp32 = x.device, x.dtype == torch.float32
    wt = weight.t()
    logits_buf = torch.empty(min(rows, N), V, dtype=torch.float32, device=dev)
    logp_buf = torch.empty_like(logits_buf)
    valid = (labels != IGNORE_INDEX).to(torch.float32)
    target = labels.clamp_min(0)[:, None]
    logp_t = torch.empty(N, 1, dtype=torch.float32, device=dev)
    lse = torch.empty(N, 1, dtype=torch.float32, device=dev)
    grads = want_x or want_w
    if grads:
        a = valid * scale * g_ce
        b = (2 * z_coef) * (valid * scale * g_z)
    grad_x = torch.empty_like(x) if want_x else None
    grad_w = None
    for s in range(0, N, rows):
        e = min(N, s + rows)
        xc, tc = x[s:e], target[s:e]
        if fp32:
            logits = torch.mm(xc, wt, out=logits_buf[: e - s])
        else:
            logits = logits_buf[: e - s].copy_(torch.mm(xc, wt))
        logp = torch.log_softmax(logits, -1, out=logp_buf[: e - s])
        torch.gather(logp, 1, tc, out=logp_t[s:e])
        torch.gather(logits, 1, tc, out=lse[s:e]).sub_(logp_t[s:e])
        if not grads:
            continue
        ac = a[s:e, None]
        grad = _logits_grad_(logp, tc, ac, torch.addcmul(ac, b[s:e, None], lse[s:e]))
        if not fp32:
            grad = grad.to(x.dtype)
        if want_x:
            torch.mm(grad, weight, out=grad_x[s:e])
        if want_w and grad_w is None:  # the first chunk writes it: no zero fill
            grad_w = torch.mm(grad.t(), xc) if fp32 else torch.mm(grad.t(), xc).float()
        elif want_w:
            if fp32:
                grad_w.addmm_(grad.t(), xc)
            else:
                grad_w += torch.mm(grad.t(), xc)
    if want_w and grad_w is None:  # no rows at all
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=dev)
    logp_t, lse = logp_t.squeeze(1), lse.squeeze(1)
    ce_sum = -(logp_t * valid).sum()
    z_sum = (lse.square() * valid).sum()
    return ce_sum, z_sum, grad_x, (None if grad_w is None else grad_w.to(weight.dtype))


class _LinearCrossEntropyZLoss(torch.autograd.Function):
    """``(loss, ce, z)`` of ``x [N, d] @ weight [V, d]^T`` by :func:`_chunked_pass`, the
    gradients of ``loss`` computed in the forward; backward scales them by the upstream gradient.

    A gradient reaching ``ce`` or ``z`` on their own (not through ``loss``) is exact too: backward
    runs the chunks once more for it, from the saved inputs. The precomputed gradients are scaled
    in place and handed over, so the graph can be backpropagated once (as in any training step;
    a second backward raises).
    """

    @staticmethod
    def forward(ctx, x, weight, labels, z_coef: float, scale, rows: int, grads: bool):
        want_x, want_w = (grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1])
        ce_sum, z_sum, gx, gw = _chunked_pass(x, weight, labels, z_coef, scale, 1.0, 1.0,
                                              want_x, want_w, rows)
        ctx.save_for_backward(x, weight, labels, scale)
        # Plain tensors made without autograd (no graph to keep alive): kept on ctx, not saved,
        # so that backward can hand them over and drop them.
        ctx.grads = (gx, gw)
        ctx.z_coef, ctx.rows = z_coef, rows
        ctx.set_materialize_grads(False)
        ce, z = ce_sum * scale, z_coef * z_sum * scale
        return ce + z, ce, z

    @staticmethod
    def backward(ctx, g_loss, g_ce, g_z):
        x, weight, labels, scale = ctx.saved_tensors
        if ctx.grads is None:
            raise RuntimeError("linear_lm_loss: the graph was already backpropagated once")
        (gx, gw), ctx.grads = ctx.grads, None
        want_x, want_w = ctx.needs_input_grad[:2]
        grad_x = gx.mul_(g_loss) if want_x and g_loss is not None else None
        grad_w = gw.mul_(g_loss) if want_w and g_loss is not None else None
        if g_ce is not None or g_z is not None:
            zero = torch.zeros((), dtype=torch.float32, device=x.device)
            _, _, rx, rw = _chunked_pass(
                x, weight, labels, ctx.z_coef, scale, zero if g_ce is None else g_ce,
                zero if g_z is None else g_z, want_x, want_w, ctx.rows)
            if rx is not None:
                grad_x = rx if grad_x is None else grad_x + rx
            if rw is not None:
                grad_w = rw if grad_w is None else grad_w + rw
        return grad_x, grad_w, None, None, None, None, None


def linear_lm_loss(
    x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, z_loss_coef: float,
    normalizer: float | None = None, chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`lm_loss` of ``F.linear(x, weight)`` without materialising the logits.

    The tokens go through the LM head and the loss ``chunk_rows`` at a time (default: about
    :data:`CHUNK_LOGITS` logits, at least :data:`CHUNK_MIN_ROWS` rows). With autograd recording,
    each chunk's gradients wrt ``x`` and ``weight`` are computed right away and its logits
    dropped, so training holds ``O(chunk_rows * V)`` logits instead of ``O(N * V)`` (plus
    ``grad_x`` and ``grad_w``, the size of ``x`` and ``weight``, until backward). Under autocast
    the matmuls run in the autocast dtype, as ``F.linear`` would. Equal to :func:`lm_loss` over
    ``F.linear(x, weight)`` within fp32 rounding (the chunks sum ``grad_w`` in another order).
    The forward costs the backward's two matmuls too; a backward through ``loss`` then costs
    two scalings (a gradient through ``ce_loss`` or ``z_loss`` alone, the chunks once more).

    Args:
        x: ``[..., d]`` hidden states (the final norm's output).
        weight: ``[V, d]`` the LM head's weight (no bias).
        labels: ``[...]`` targets, ``IGNORE_INDEX`` where none.
        z_loss_coef, normalizer: as :func:`lm_loss`.
        chunk_rows: tokens per chunk.
    Returns:
        ``(loss, ce_loss, z_loss)`` scalars, ``loss = ce_loss + z_loss``.
    Raises:
        ValueError: ``x``'s last dimension is not ``weight``'s, ``labels`` does not have one
            entry per row of ``x``, or ``chunk_rows < 1``.
    """
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x [..., {x.shape[-1]}] does not match the weight [V, {weight.shape[1]}]")
    x2, labels = x.reshape(-1, x.shape[-1]), labels.reshape(-1)
    if labels.shape[0] != x2.shape[0]:
        raise ValueError(f"labels {labels.shape[0]} for {x2.shape[0]} rows of x")
    rows = (chunk_rows if chunk_rows is not None
            else max(CHUNK_MIN_ROWS, CHUNK_LOGITS // weight.shape[0]))
    if rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        x2, weight = x2.to(dtype), weight.to(dtype)
    elif weight.dtype != x2.dtype:
        raise ValueError(f"x is {x2.dtype} but the weight is {weight.dtype}")
    scale = _scale(labels, normalizer, x.device)
    with torch.autocast(dev, enabled=False):
        return _LinearCrossEntropyZLoss.apply(x2, weight, labels, float(z_loss_coef), scale,
                                              rows, torch.is_grad_enabled())


def fused_head_applies(head: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``head(x)`` followed by :func:`lm_loss` may run as :func:`linear_lm_loss` here: a
    training forward (autograd recording, not traced by ``torch.compile``) through a plain
    ``nn.Linear`` without bias or hooks whose weight is a plain ``nn.Parameter`` (not a DTensor,
    not quantized) of ``x``'s dtype. Otherwise the module is called, for its hooks or its own
    forward (LoRA, tensor parallelism, quantization)."""
    w = getattr(head, "weight", None)
    return (torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and type(head) is nn.Linear and head.bias is None and type(w) is nn.Parameter
            and (w.requires_grad or x.requires_grad) and w.dtype == x.dtype
            and w.device == x.device
            and not (head._forward_hooks or head._forward_pre_hooks)
            and not _global_module_hooks())


def _global_module_hooks() -> bool:
    m = nn.modules.module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks)

