"""A slot KV cache for ragged continuous-batching decode: one row per running sequence, each row
with its own length.

Storage per layer: keys and values ``[max_batch, n_kv_heads, max_context, head_dim]``. Running
sequences occupy rows ``0 .. n-1`` (kept compacted: when a sequence leaves, the last row moves into
its place), so a decode step over ``n`` rows reads the views ``k[:n, :, :Lmax]`` without a gather,
``Lmax`` being the longest row plus the new token. Each row's attention rule is a per-window key
mask ``[n, Lmax]`` (key ``j`` real, ``j <= own position``, and ``pos - j < window`` on sliding
layers); the queries are declared at slot ``Lmax - 1`` so the mask's causal part admits every key
and the key mask carries the whole rule. Prompts are stored from slot 0 (no left padding), so a
row's RoPE position equals its slot.

This follows the layout of vLLM's early "slot" (non-paged) cache and nanochat's engine: simple,
contiguous, memory ``2 * n_layers * max_batch * max_context * n_kv_heads * head_dim`` elements.
:meth:`Olmo.forward <olmoflow.model.olmo.Olmo.forward>` recognises the cache by ``ragged = True``
and asks it for positions and masks (:meth:`SlotKVCache.prepare`) and to advance the lengths
(:meth:`SlotKVCache.advance`).
"""

from __future__ import annotations

import torch

from olmoflow.model.attention import AttentionMask, KVCache


class SlotKVCache:
    """Per-row KV storage for up to ``max_batch`` sequences of up to ``max_context`` tokens.

    Args:
        n_layers, max_batch, n_kv_heads, max_context, head_dim: storage shape (see the module
            docstring).
        dtype, device: of the stored keys and values (the model's).

    Attributes:
        lengths: filled slots of each running row (Python ints, host side: shapes are decided
            on the host without a device sync).
        ragged: always True; :meth:`Olmo.forward` takes the ragged path for this cache.
    """

    ragged = True
    static = False

    def __init__(self, n_layers: int, max_batch: int, n_kv_heads: int, max_context: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        shape = (max_batch, n_kv_heads, max_context, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_batch, self.max_context = max_batch, max_context
        self.device = torch.device(device)
        self.lengths: list[int] = []
        # Per-step tensors built by prepare() and read by update() (one decode step at a time).
        self._rows: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None
        self._lmax = 0
        self._ones = torch.ones(1, max_context, dtype=torch.bool, device=device)

    @classmethod
    def for_model(cls, model, max_batch: int, max_context: int) -> SlotKVCache:
        """A cache shaped for ``model`` (an :class:`~olmoflow.model.olmo.Olmo`)."""
        c = model.config
        return cls(c.n_layers, max_batch, c.n_kv_heads, max_context, c.hd,
                   model.embeddings.weight.dtype, model.device)

    @property
    def n(self) -> int:
        """Rows in use (``0 .. n-1``)."""
        return len(self.lengths)

    def nbytes(self) -> int:
        """Bytes held by the key and value storage."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    # -- rows --------------------------------------------------------------------------------

    def add_row(self) -> int:
        """Claim the next free row (length 0) and return its index.

        Raises:
            RuntimeError: all ``max_batch`` rows are in use.
        """
        if self.n >= self.max_batch:
            raise RuntimeError(f"no free slot: {self.max_batch} rows in use")
        self.lengths.append(0)
        return self.n - 1

    def remove_row(self, row: int) -> int | None:
        """Free ``row``; the last row moves into its place (its keys and values are copied).

        Returns the old index of the moved row (``n - 1`` before the call), or None when
        ``row`` was the last one and nothing moved.
        """
        last = self.n - 1
        if not 0 <= row <= last:
            raise IndexError(f"row {row} is not in use (rows 0..{last})")
        if row == last:
            self.lengths.pop()
            return None
        length = self.lengths[last]
        for store in self.k + self.v:
            store[row, :, :length] = store[last, :, :length]
        self.lengths[row] = length
        self.lengths.pop()
        return last

    def row_cache(self, row: int) -> KVCache:
        """A dynamic batch-1 :class:`KVCache` whose keys and values are views of ``row``
        (zero copy): a prefill through it writes the prompt straight into the slot. Its length
        starts at the row's length; call :meth:`set_length` after the forward."""
        cache = KVCache(len(self.k), 1, 1, 0, 1, self.k[0].dtype, self.device)
        cache.k = [t[row : row + 1] for t in self.k]
        cache.v = [t[row : row + 1] for t in self.v]
        cache.key_padding = self._ones
        cache.max_length = self.max_context
        cache.length = self.lengths[row]
        return cache

    def set_length(self, row: int, length: int) -> None:
        """Record that ``row`` holds ``length`` filled slots (after a prefill)."""
        self.lengths[row] = length

    # -- the model's hook --------------------------------------------------------------------

    def prepare(self, T: int, windows, device: torch.device):
        """RoPE positions and masks of one decode step over every running row.

        Args:
            T: new tokens per row; must be 1 (prefill goes through :meth:`row_cache`).
            windows: the model's set of window sizes (None for full attention).
            device: where the input ids live.
        Returns:
            ``(positions [n, 1] long, {window: AttentionMask})``; each mask has queries at slot
            ``Lmax - 1`` and a key padding ``[n, Lmax]`` holding the per-row rule.
        Raises:
            ValueError: ``T != 1``, no running row, or a row already at ``max_context``.
        """
        if T != 1:
            raise ValueError(f"SlotKVCache decodes one token per row, got T={T}")
        if not self.lengths:
            raise ValueError("SlotKVCache.prepare with no running rows")
        lmax = max(self.lengths) + 1
        if lmax > self.max_context:
            raise ValueError(f"KV cache overflow: {lmax} positions > max_context "
                             f"{self.max_context}")
        pos = torch.tensor(self.lengths, dtype=torch.long, device=device)
        self._pos, self._lmax = pos, lmax
        self._rows = torch.arange(self.n, device=device)
        j = torch.arange(lmax, device=device)[None]
        dist = pos[:, None] - j  # [n, Lmax]: how far back key j is from each row's query
        causal = dist >= 0
        q_pos = torch.full((1,), lmax - 1, dtype=torch.long, device=device)
        masks = {}
        for w in windows:
            key_mask = causal if w is None else causal & (dist < w)
            masks[w] = AttentionMask(q_pos, lmax, None, key_padding=key_mask, aligned=False)
        return pos[:, None], masks

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               cache_position: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v [n, H_kv, 1, hd]`` at each row's length; return the views
        ``[n, H_kv, Lmax, hd]`` attention reads (``cache_position`` is unused: each row's slot is
        its own length, set by :meth:`prepare`)."""
        ks, vs = self.k[layer], self.v[layer]
        ks[self._rows, :, self._pos] = k[:, :, 0]
        vs[self._rows, :, self._pos] = v[:, :, 0]
        n = self.n
        return ks[:n, :, : self._lmax], vs[:n, :, : self._lmax]

    def advance(self, T: int) -> None:
        """Every running row grew by ``T`` tokens (called by the model after the blocks)."""
        self.lengths = [length + T for length in self.lengths]
