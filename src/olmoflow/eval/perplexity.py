"""Held-out loss, perplexity and bits-per-byte (BPB).

BPB makes models with different tokenizers comparable: the summed cross-entropy (nats) of the
targets, divided by ``ln 2`` and by the number of UTF-8 bytes those targets stand for. As in
nanochat, special tokens (EOS) count 0 bytes and are left out of BPB's numerator and denominator;
loss and perplexity are over every target token.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F


@torch.no_grad()
def evaluate_tokens(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    tokens: np.ndarray,
    token_bytes: np.ndarray,
    *,
    sequence_length: int,
    batch_size: int = 8,
    max_tokens: int | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, float]:
    """Score a token stream in non-overlapping windows of ``sequence_length`` targets.

    Args:
        logits_fn: maps ``input_ids [B, T]`` to ``logits [B, T, V]`` (ours or a transformers model).
        tokens: 1-D token array (documents end in EOS).
        token_bytes: ``[V]`` UTF-8 bytes per token id, 0 for special tokens.
        max_tokens: score at most this many targets (None: all).
    Returns:
        ``{"loss", "perplexity", "bpb", "tokens", "bytes"}``; loss in nats per token.
    """
    n = len(tokens) - 1
    if max_tokens is not None:
        n = min(n, max_tokens)
    n_windows = n // sequence_length
    if n_windows == 0:
        raise ValueError(f"held-out data has {len(tokens)} tokens, fewer than one window of "
                         f"{sequence_length + 1}")
    token_bytes_t = torch.as_tensor(token_bytes, dtype=torch.long)
    nll_sum, nll_bytes_sum, n_tok, n_bytes = 0.0, 0.0, 0, 0
    for b0 in range(0, n_windows, batch_size):
        rows = [np.asarray(tokens[i * sequence_length : i * sequence_length + sequence_length + 1],
                           dtype=np.int64) for i in range(b0, min(b0 + batch_size, n_windows))]
        batch = torch.from_numpy(np.stack(rows))
        inputs, targets = batch[:, :-1].to(device), batch[:, 1:]
        logits = logits_fn(inputs).float().cpu()
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                              reduction="none")
        nbytes = token_bytes_t[targets.reshape(-1)]
        nll_sum += float(nll.sum())
        nll_bytes_sum += float(nll[nbytes > 0].sum())
        n_tok += nll.numel()
        n_bytes += int(nbytes.sum())
    loss = nll_sum / n_tok
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)),
            "bpb": nll_bytes_sum / (math.log(2) * max(n_bytes, 1)), "tokens": n_tok,
            "bytes": n_bytes}
