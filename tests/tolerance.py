"""Bounds for comparing two DIFFERENT fp32 code paths of the same math, on any CPU.

Two paths (accumulated micro-batches and one batch, a KV-cache decode and a full forward, DDP and
one process, our model and ``transformers``, ...) sum the same terms in another order: other GEMM
blocking, other reduction trees, another CPU's vector width. A sum of ``n`` fp32 terms is exact to
within about ``n`` units of rounding of the sum of their magnitudes (Higham, *Accuracy and Stability
of Numerical Algorithms*, 4.2: ``|error| <= gamma_{n-1} sum|x_i|``, ``gamma_n ~ n u``, ``u =
eps/2``), whatever the order, so ``n * eps * scale`` holds on every CPU where a bound in absolute
units (``1e-6``) holds only on the CPU it was tuned on. ``terms`` is the number of fp32 additions
on the way from the inputs to the compared value (the inner sizes of the matmuls and reductions it
goes through, added up), ``scale`` its magnitude. Two paths of the same code run twice need no
bound: they compare bit for bit.
"""

from __future__ import annotations

import torch

EPS32 = float(torch.finfo(torch.float32).eps)  # 2**-23 = 1.19e-7: one ulp at 1.0


def fp32_rel(terms: float, ulps: float = 1.0) -> float:
    """Relative bound for a value that accumulated ``terms`` fp32 additions: ``ulps`` ulps of its
    magnitude per term (``ulps * terms * eps32``)."""
    return ulps * terms * EPS32


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor, terms: float,
                      ulps: float = 1.0, msg: str | None = None) -> None:
    """``actual`` equals ``expected`` elementwise within :func:`fp32_rel` of the LARGEST magnitude
    in ``expected``: an element near zero is the difference of large terms, so its error is set by
    the tensor's scale, not its own value."""
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=0, atol=fp32_rel(terms, ulps) * scale,
                               msg=msg)


def forward_terms(cfg, positions: int, tokens: int = 0) -> int:
    """The fp32 additions on the way to one logit of an Olmo forward of ``cfg`` (a ModelConfig)
    over ``positions`` positions; with ``tokens`` > 0, to the mean loss over that many targets.

    Per block: the q/k/v projection, the QK-norm, the o projection, the two RMSNorms and w1/w3 over
    ``d_model`` (6), the scores over ``head_dim``, the softmax and weighted sum over ``positions``
    (2), w2 over ``mlp_hidden``; then the final norm and the LM head over ``d_model``;
    a loss adds the logsumexp over the vocabulary and the mean over its targets.
    """
    head_dim = getattr(cfg, "head_dim", None) or cfg.d_model // cfg.n_heads
    block = 6 * cfg.d_model + head_dim + 2 * positions + cfg.mlp_hidden
    terms = cfg.n_layers * block + 2 * cfg.d_model
    return terms + (cfg.vocab_size + tokens if tokens else 0)


def assert_greedy_agrees(actual: torch.Tensor, expected: torch.Tensor, logits: torch.Tensor,
                         atol: float, start: int) -> int:
    """Greedy continuations of two code paths agree token for token wherever greedy is decided.

    ``actual``, ``expected``: ``[B, T]`` prompts and continuations; ``logits``: ``[B, T, V]``, one
    path's full forward over ``expected``; ``atol``: the bound on the two paths' logits;
    ``start``: the prompt length. Where a step's top two logits are within ``2 * atol`` rounding
    may pick either token and the continuations may part there, so each row is compared up to its
    first such step (with a random tiny model that is almost always the whole row). Returns the
    number of generated tokens compared.
    """
    top = logits.float().topk(2, dim=-1).values
    decided = (top[..., 0] - top[..., 1]) > 2 * atol  # position t decides token t + 1
    compared = 0
    for b in range(expected.shape[0]):
        end = next((t for t in range(start, expected.shape[1]) if not decided[b, t - 1]),
                   expected.shape[1])
        assert torch.equal(actual[b, :end], expected[b, :end]), (b, actual[b], expected[b])
        compared += end - start
    assert compared > 0, "every first greedy step is a near-tie: choose another prompt"
    return compared
