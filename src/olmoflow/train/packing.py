"""Document packing for fixed-length training instances, and token-budget batching.

Best-fit packing follows OLMo-core's packed fixed-sequence-length dataset, itself after Ding et al.
2024, "Fewer Truncations Improve Language Modeling": whole documents (cut into chunks only when
longer than an instance) are placed into bins of ``sequence_length + 1`` tokens by the best-fit
decreasing heuristic, so far fewer documents are cut than when chunking one long token stream.

Chunks of a long document overlap by one token (``doc[k*T : k*T + T + 1]``): an instance of
``T + 1`` tokens has ``T`` targets (``labels = inst[1:]``), so with the overlap every token of a
document except its first is a target exactly once, as when the document is run alone.

Token-budget batching groups variable-length items (evaluation windows, SFT conversations) into
micro-batches whose padded size ``rows x longest`` stays within a token budget.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from olmoflow.errors import OlmoflowError

PACKINGS = ("concat", "best_fit")
# 'pack': the packing's RNG stream, apart from the (seed, epoch) orders
_PACKING_STREAM = 0x7061636B


def split_documents(starts: np.ndarray, ends: np.ndarray, sequence_length: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut documents ``[start, end)`` into pieces of at most ``sequence_length + 1`` tokens.

    Pieces of one document start every ``sequence_length`` tokens and overlap by one token, so each
    token but the document's first is a target in exactly one piece. Documents of fewer than two
    tokens have no target and give no piece.

    Returns:
        ``(piece_starts [P], piece_ends [P], piece_document [P])``, int64, documents in input order.
    """
    starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
    T = int(sequence_length)
    if T < 1:
        raise OlmoflowError(f"sequence_length must be >= 1, got {T}")
    lengths = ends - starts
    n_pieces = np.where(lengths >= 2, (lengths - 2) // T + 1, 0)
    doc = np.repeat(np.arange(len(starts), dtype=np.int64), n_pieces)
    # k-th piece of its document: position within the run of equal doc numbers.
    first = np.cumsum(n_pieces) - n_pieces
    k = np.arange(len(doc), dtype=np.int64) - np.repeat(first, n_pieces)
    piece_starts = starts[doc] + k * T
    piece_ends = np.minimum(piece_starts + T + 1, ends[doc])
    return piece_starts, piece_ends, doc


def best_fit_decreasing(
    lengths: np.ndarray, capacity: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Pack items into as few bins of ``capacity`` as the best-fit decreasing heuristic finds.

    Items are taken longest first (ties in an order drawn from ``seed``); each goes into the open
    bin with the least room that still fits it, or a new bin. The result depends only on
    ``(lengths, capacity, seed)``. Any-fit guarantee (tested): no two bins fit into one.

    Args:
        lengths: ``[P]`` item sizes, each in ``[1, capacity]``.
    Returns:
        ``(bin_offsets [n_bins + 1], bin_items [P])``: the items of bin ``b`` are
        ``bin_items[bin_offsets[b]:bin_offsets[b + 1]]``, in placement order.
    Raises:
        OlmoflowError: an item is empty or larger than ``capacity``.
    """
    lengths = np.asarray(lengths, np.int64)
    if len(lengths) and (lengths.min() < 1 or lengths.max() > capacity):
        raise OlmoflowError(f"item sizes must be in [1, {capacity}], got "
                            f"[{lengths.min()}, {lengths.max()}]")
    rng = np.random.Generator(np.random.PCG64([seed, _PACKING_STREAM]))
    order = rng.permutation(len(lengths))
    order = order[np.argsort(-lengths[order], kind="stable")]
    # Open bins by remaining room: buckets[r] holds the bins with r tokens free, and has_room[r]
    # says whether it is non-empty, so "least room >= L" is one argmax over a bool array.
    buckets: list[list[int]] = [[] for _ in range(capacity + 1)]
    has_room = np.zeros(capacity + 1, dtype=bool)
    bin_of = np.empty(len(lengths), dtype=np.int64)
    n_bins = 0
    smallest = int(lengths.min()) if len(lengths) else 1
    for item in order.tolist():
        size = int(lengths[item])
        room = size + int(has_room[size:].argmax())
        if has_room[room]:
            b = buckets[room].pop()
            has_room[room] = bool(buckets[room])
        else:
            b, room = n_bins, capacity
            n_bins += 1
        bin_of[item] = b
        left = room - size
        if left >= smallest:  # a bin with less room than the smallest item stays closed
            buckets[left].append(b)
            has_room[left] = True
    # Group items by bin, keeping placement order inside each bin.
    placed = order[np.argsort(bin_of[order], kind="stable")]
    counts = np.bincount(bin_of, minlength=n_bins) if len(lengths) else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return offsets, placed.astype(np.int64)


def token_budget_batches(lengths: Sequence[int], max_tokens: int, *, sort: bool = True,
                         pad_to_multiple_of: int = 1, seed: int | None = None) -> list[np.ndarray]:
    """Group variable-length items into micro-batches of at most ``max_tokens`` padded tokens.

    A micro-batch's size is ``rows x padded_length`` where ``padded_length`` is its longest item
    rounded up to a multiple of ``pad_to_multiple_of``. With ``sort`` (default) items are taken
    longest first, which keeps padding low; without it they stay in input order (streaming
    evaluation). Greedy: a micro-batch is closed when the next item would break the budget.

    Args:
        lengths: ``[N]`` item lengths in tokens.
        max_tokens: the budget per micro-batch, in tokens (padding included).
        seed: if given, the micro-batches are returned in an order drawn from it (so training does
            not see them sorted by length); the grouping itself does not depend on it.
    Returns:
        A list of int64 index arrays into ``lengths``; every item is in exactly one.
    Raises:
        OlmoflowError: ``max_tokens`` < 1, or an item longer than the budget on its own.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if max_tokens < 1 or pad_to_multiple_of < 1:
        raise OlmoflowError(f"max_tokens and pad_to_multiple_of must be >= 1, got {max_tokens} and "
                            f"{pad_to_multiple_of}")
    padded = -(-lengths // pad_to_multiple_of) * pad_to_multiple_of
    if len(lengths) and padded.max() > max_tokens:
        i = int(padded.argmax())
        raise OlmoflowError(f"item {i} has {lengths[i]} tokens (padded {padded[i]}), more than the "
                            f"micro-batch budget of {max_tokens} tokens; raise the budget or "
                            "truncate the item")
    order = np.argsort(-padded, kind="stable") if sort else np.arange(len(lengths))
    batches: list[np.ndarray] = []
    current: list[int] = []
    width = 0
    for i in order.tolist():
        w = max(width, int(padded[i]))
        if current and (len(current) + 1) * w > max_tokens:
            batches.append(np.array(current, dtype=np.int64))
            current, w = [], int(padded[i])
        current.append(i)
        width = w
    if current:
        batches.append(np.array(current, dtype=np.int64))
    if seed is not None:
        rng = np.random.Generator(np.random.PCG64([seed, _PACKING_STREAM + 1]))
        batches = [batches[j] for j in rng.permutation(len(batches))]
    return batches


def pad_batch(sequences: Sequence[Sequence[int]], pad_value: int, *, pad_to_multiple_of: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad sequences into one tensor, the collate step after :func:`token_budget_batches`.

    Returns:
        ``(ids [N, L], mask [N, L])``: LongTensor padded with ``pad_value`` and a bool mask that is
        True on real tokens; ``L`` is the longest length rounded up to ``pad_to_multiple_of``.
    """
    longest = max((len(s) for s in sequences), default=0)
    L = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    ids = torch.full((len(sequences), L), pad_value, dtype=torch.long)
    mask = torch.zeros((len(sequences), L), dtype=torch.bool)
    for r, s in enumerate(sequences):
        ids[r, : len(s)] = torch.as_tensor(np.asarray(s, dtype=np.int64))
        mask[r, : len(s)] = True
    return ids, mask
