"""Fixed-length training instances from OLMo token arrays, shuffled deterministically.

The token arrays of a split are read as one stream (documents already end in EOS) and cut into
instances of ``sequence_length + 1`` tokens with a stride of ``sequence_length``, so each token is
a target exactly once: ``input = inst[:-1]``, ``labels = inst[1:]``. The order of instances in
epoch ``e`` is a permutation drawn from ``(seed, e)`` alone, so it does not depend on the number of
processes, and the loader's position is part of its state (``state_dict``) for exact resume.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from olmoflow.data.tokenize import read_token_array
from olmoflow.errors import OlmoflowError


def open_token_arrays(paths: list[Path], dtype: np.dtype) -> list[np.ndarray]:
    """Memory-map OLMo token arrays (raw little-endian, no header), leaving out empty ones."""
    arrays = [read_token_array(p, dtype) for p in paths]
    return [a for a in arrays if len(a)]


class InstanceDataset:
    """Instances of ``sequence_length + 1`` tokens over the concatenation of token arrays.

    ``dataset[i]`` -> ``np.ndarray[int64]`` of length ``sequence_length + 1``.
    """

    def __init__(self, arrays: list[np.memmap], sequence_length: int):
        self.arrays = arrays
        self.sequence_length = sequence_length
        sizes = np.array([len(a) for a in arrays], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)])
        self.total_tokens = int(self.offsets[-1])
        self.num_instances = max(0, (self.total_tokens - 1) // sequence_length)

    def __len__(self) -> int:
        return self.num_instances

    def _slice(self, start: int, end: int) -> np.ndarray:
        out = []
        a = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while start < end:
            lo = start - int(self.offsets[a])
            hi = min(end, int(self.offsets[a + 1])) - int(self.offsets[a])
            out.append(np.asarray(self.arrays[a][lo:hi], dtype=np.int64))
            start = int(self.offsets[a]) + hi
            a += 1
        return np.concatenate(out) if len(out) > 1 else out[0]

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_instances:
            raise IndexError(i)
        s = i * self.sequence_length
        return self._slice(s, s + self.sequence_length + 1)


class DataLoader:
    """Batches of instances in a seeded order per epoch; resumable from ``state_dict()``.

    Each yielded batch is ``(input_ids [B, T], labels [B, T])`` LongTensors. An epoch ends when too
    few instances remain for a full batch (the remainder is dropped, as in OLMo-core), and the next
    epoch reshuffles with ``(seed, epoch)``.
    """

    def __init__(self, dataset: InstanceDataset, batch_size: int, seed: int):
        if len(dataset) < batch_size:
            raise OlmoflowError(
                f"the training data holds {len(dataset)} instances of {dataset.sequence_length + 1} "
                f"tokens, fewer than one batch of {batch_size}; add data or lower "
                "train.global_batch_size / train.sequence_length"
            )
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.epoch = 0
        self.position = 0  # instances of this epoch already yielded
        self._order: np.ndarray | None = None

    @property
    def batches_per_epoch(self) -> int:
        return len(self.dataset) // self.batch_size

    def order(self, epoch: int) -> np.ndarray:
        """The permutation of instance indices for ``epoch``."""
        rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
        return rng.permutation(len(self.dataset))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position. Raises OlmoflowError if it was saved with another seed."""
        if int(state.get("seed", self.seed)) != self.seed:
            raise OlmoflowError(
                f"the checkpoint's data order was drawn with seed {state['seed']}, this run has seed "
                f"{self.seed}; resume with the same seed"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = None

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next global batch; advances the cursor (and the epoch at its end)."""
        if self.position + self.batch_size > self.batches_per_epoch * self.batch_size:
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self._order = self.order(self.epoch)
        idx = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        batch = torch.from_numpy(np.stack([self.dataset[int(i)] for i in idx]))
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()
