"""Held-out loss, perplexity and bits-per-byte (BPB).

BPB makes models with different tokenizers comparable: the summed cross-entropy (nats) of the
targets, divided by ``ln 2`` and by the number of UTF-8 bytes those targets stand for. As in
nanochat, special tokens (EOS) count 0 bytes and are left out of BPB's numerator and denominator;
loss and perplexity are over every target token.

Every target of the stream (each token after the first) is scored exactly once, in windows of at
most ``sequence_length`` tokens laid out as lm-eval's ``get_rolling_token_windows`` does (the
windows of ``loglikelihood_rolling``; Hugging Face's "Perplexity of fixed-length models" guide
describes the same sliding scheme):

- the first window scores its ``sequence_length`` targets;
- each later window scores the next ``stride`` targets (fewer in the last one) and takes as its
  context the ``sequence_length - (scored targets)`` tokens before them, so every window but a
  stream shorter than one window is full length, and a target scored in a later window sees at
  least ``sequence_length - stride + 1`` tokens.

``stride=None`` (or ``stride == sequence_length``) gives disjoint windows: the last, partial one
scores the targets the full windows left and borrows its context from the window before it
(lm-eval's ``context_len=1``). A smaller stride costs ``sequence_length / stride`` times the
compute of disjoint windows for a lower, less context-starved loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F


def rolling_windows(n_targets: int, sequence_length: int,
                    stride: int | None = None) -> list[tuple[int, int, int]]:
    """The windows that score targets ``1..n_targets`` of a stream, each exactly once.

    Target ``t`` is token ``t``, predicted from tokens ``[begin, t)`` of its window.

    Args:
        n_targets: targets to score (the stream's length minus one).
        sequence_length: the most tokens one forward pass sees.
        stride: new targets per window after the first; None means ``sequence_length``
            (disjoint windows).
    Returns:
        ``(begin, end, n_scored)`` per window: the window feeds tokens ``[begin, end)`` and scores
        its last ``n_scored`` targets, tokens ``end - n_scored + 1 .. end``.
    Raises:
        ValueError: ``sequence_length < 1``, or ``stride`` outside ``1..sequence_length``.
    """
    if sequence_length < 1:
        raise ValueError(f"sequence_length={sequence_length} must be >= 1")
    stride = sequence_length if stride is None else stride
    if not 1 <= stride <= sequence_length:
        raise ValueError(f"stride={stride} must be between 1 and "
                         f"sequence_length={sequence_length}")
    windows = []
    done = 0  # targets 1..done are scored
    while done < n_targets:
        end = min(done + (stride if done else sequence_length), n_targets)
        windows.append((max(0, end - sequence_length), end, end - done))
        done = end
    return windows


@torch.no_grad()
def evaluate_tokens(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    tokens: np.ndarray,
    token_bytes: np.ndarray,
    *,
    sequence_length: int,
    stride: int | None = None,
    batch_size: int = 8,
    max_tokens: int | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, float | int | None]:
    """Score every target of a token stream once, in windows of at most ``sequence_length``.

    Windows are those of :func:`rolling_windows` (lm-eval's rolling windows); with ``stride``
    None they score disjoint runs of targets.

    Args:
        logits_fn: maps ``input_ids [B, T]`` to ``logits [B, T, V]`` (ours or a transformers model).
        tokens: 1-D token array (documents end in EOS).
        token_bytes: ``[V]`` UTF-8 bytes per token id, 0 for special tokens.
        sequence_length: tokens per window (the model's context in this evaluation).
        stride: targets scored per window after the first (sliding evaluation); None: disjoint.
        batch_size: windows per forward pass.
        max_tokens: score at most this many targets, the first ones (None: all).
    Returns:
        ``{"loss", "perplexity", "bpb", "tokens", "bytes", "sequence_length", "stride"}``; loss in
        nats per target token, ``tokens`` the targets scored (``len(tokens) - 1`` unless capped),
        ``stride`` as given (None: disjoint windows).
    Raises:
        ValueError: fewer than 2 tokens (nothing to score), or a bad window or stride.
    """
    n = len(tokens) - 1
    if max_tokens is not None:
        n = min(n, max_tokens)
    windows = rolling_windows(max(n, 0), sequence_length, stride)
    if not windows:
        raise ValueError(f"held-out data has {len(tokens)} token(s): nothing to score "
                         "(a target needs a token before it)")
    token_bytes_t = torch.as_tensor(token_bytes, dtype=torch.long)
    nll_sum, nll_bytes_sum, n_tok, n_bytes = 0.0, 0.0, 0, 0
    # Windows of one length share a batch; only a stream shorter than one window has a shorter one.
    for b0 in range(0, len(windows), batch_size):
        group = windows[b0 : b0 + batch_size]
        batch = torch.from_numpy(np.stack([np.asarray(tokens[b : e + 1], dtype=np.int64)
                                           for b, e, _ in group]))
        inputs, targets = batch[:, :-1].to(device), batch[:, 1:]
        logits = logits_fn(inputs).float().cpu()
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                              reduction="none").view(targets.shape)
        # keep each window's last n_scored positions: the targets no earlier window scored
        width = targets.shape[1]
        scored = torch.arange(width) >= width - torch.tensor([[k] for _, _, k in group])
        nll, targets = nll[scored], targets[scored]
        nbytes = token_bytes_t[targets]
        nll_sum += float(nll.sum())
        nll_bytes_sum += float(nll[nbytes > 0].sum())
        n_tok += nll.numel()
        n_bytes += int(nbytes.sum())
    loss = nll_sum / n_tok
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)),
            "bpb": nll_bytes_sum / (math.log(2) * max(n_bytes, 1)), "tokens": n_tok,
            "bytes": n_bytes, "sequence_length": sequence_length, "stride": stride}
