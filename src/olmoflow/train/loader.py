"""Fixed-length training instances from OLMo token arrays, shuffled deterministically.

Two ways to make instances of ``sequence_length + 1`` tokens (``train.packing``), as in OLMo-core:

- ``concat`` (:class:`InstanceDataset`): the token arrays of a split are read as one stream
  (documents already end in EOS) and cut with a stride of ``sequence_length``, so each token is a
  target exactly once: ``input = inst[:-1]``, ``labels = inst[1:]``.
- ``best_fit`` (:class:`PackedDataset`): whole documents from the ``.csv.gz`` indexes, chunked only
  when longer than an instance, packed by best-fit decreasing (:mod:`olmoflow.train.packing`);
  the free tail of an instance is padding with no targets.

The instance set depends only on the data and the seed; the order of instances in epoch ``e`` is a
permutation drawn from ``(seed, e)`` alone, so neither depends on the number of processes. Each
:class:`Batch` carries the loader's state after it (nanochat), so a checkpoint stores the position
right after the last batch it trained on.

Labels never cross a document boundary when ``intra_document_masking`` is on (the EOS closing a
document is its last target; the next document's first token is no target, as when each document
runs alone), nor ever in ``best_fit`` instances, whose neighbouring pieces are unrelated.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from olmoflow.data.tokenize import read_index, read_token_array
from olmoflow.errors import OlmoflowError, unknown_name_error
from olmoflow.model.olmo import IGNORE_INDEX
from olmoflow.train.packing import PACKINGS, best_fit_decreasing, split_documents

PAD_DOCUMENT = -1  # document number of padding positions


def open_token_arrays(paths: list[Path], dtype: np.dtype) -> list[np.ndarray]:
    """Memory-map OLMo token arrays (raw little-endian, no header), leaving out empty ones."""
    arrays = [read_token_array(p, dtype) for p in paths]
    return [a for a in arrays if len(a)]


def index_path(npy_path: Path) -> Path:
    """The ``.csv.gz`` document index next to a token array."""
    return Path(npy_path).with_suffix(".csv.gz")


def open_documents(
    paths: list[Path], dtype: np.dtype
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Token arrays and their documents as offsets into the arrays' concatenation.

    Returns:
        ``(arrays, starts [D], ends [D])``; empty arrays are left out.
    Raises:
        OlmoflowError: a missing or malformed index, or one whose documents do not tile its array.
    """
    arrays, starts, ends, offset = [], [], [], 0
    for p in paths:
        a = read_token_array(p, dtype)
        rows = read_index(index_path(p))
        s = np.array([r[0] for r in rows], dtype=np.int64)
        e = np.array([r[1] for r in rows], dtype=np.int64)
        if len(s) and (s[0] != 0 or e[-1] != len(a) or (s[1:] != e[:-1]).any() or (e <= s).any()):
            raise OlmoflowError(f"{index_path(p)}: its documents do not tile the {len(a)} tokens "
                                f"of {p}; rerun 'olmoflow tokenize'")
        if not len(s) and len(a):
            raise OlmoflowError(f"{index_path(p)} lists no documents for the {len(a)} tokens "
                                f"of {p}")
        if len(a):
            arrays.append(a)
            starts.append(s + offset)
            ends.append(e + offset)
            offset += len(a)
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)  # noqa: E731
    return arrays, cat(starts), cat(ends)


class _TokenStream:
    """The concatenation of token arrays, read by global offsets without copying it whole."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = arrays
        sizes = np.array([len(a) for a in arrays], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.total_tokens = int(self.offsets[-1])

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


class InstanceDataset(_TokenStream):
    """``concat`` instances: ``sequence_length + 1`` tokens every ``sequence_length`` tokens of the
    stream. ``dataset[i]`` -> ``np.ndarray[int64]`` of length ``sequence_length + 1``.

    ``doc_starts`` (global offsets of the documents, from :func:`open_documents`) is needed only for
    intra-document masking.
    """

    packing = "concat"  # the train.packing that makes these instances
    cuts_labels_at_documents = False  # the stream's neighbours are the documents' own order
    packing_efficiency = 1.0  # no padding

    def __init__(self, arrays: list[np.ndarray], sequence_length: int,
                 doc_starts: np.ndarray | None = None):
        super().__init__(arrays)
        self.sequence_length = sequence_length
        self.doc_starts = None if doc_starts is None else np.asarray(doc_starts, np.int64)
        self.num_instances = max(0, (self.total_tokens - 1) // sequence_length)

    @classmethod
    def from_paths(cls, paths: list[Path], dtype: np.dtype, sequence_length: int,
                   documents: bool = False) -> InstanceDataset:
        """From token files; ``documents`` also reads their indexes (for intra-document masking)."""
        if not documents:
            return cls(open_token_arrays(paths, dtype), sequence_length)
        arrays, starts, _ = open_documents(paths, dtype)
        return cls(arrays, sequence_length, doc_starts=starts)

    def __len__(self) -> int:
        return self.num_instances

    @property
    def has_documents(self) -> bool:
        """Whether :meth:`documents` works (the dataset was given the document index)."""
        return self.doc_starts is not None

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_instances:
            raise IndexError(i)
        s = i * self.sequence_length
        return self._slice(s, s + self.sequence_length + 1)

    def documents(self, i: int) -> np.ndarray:
        """``[T + 1]`` document number (global) of each token of instance ``i``."""
        if self.doc_starts is None:
            raise OlmoflowError("intra-document masking needs the document index: build the "
                                "dataset with InstanceDataset.from_paths(..., documents=True)")
        s = i * self.sequence_length
        pos = np.arange(s, s + self.sequence_length + 1, dtype=np.int64)
        return np.searchsorted(self.doc_starts, pos, side="right") - 1


class PackedDataset(_TokenStream):
    """``best_fit`` instances: document pieces packed into bins of ``sequence_length + 1`` tokens.

    ``dataset[i]`` -> ``np.ndarray[int64]`` of ``sequence_length + 1`` tokens, its pieces first and
    ``pad_token_id`` after; :meth:`documents` numbers each position's piece (``PAD_DOCUMENT`` on
    padding). Which pieces share an instance depends only on the data and ``seed``.

    Args:
        arrays: token arrays; ``starts``/``ends`` ``[D]``: documents as offsets into their
            concatenation (:func:`open_documents`).
    Raises:
        OlmoflowError: no document has two or more tokens.
    """

    packing = "best_fit"
    cuts_labels_at_documents = True
    has_documents = True

    def __init__(self, arrays: list[np.ndarray], starts: np.ndarray, ends: np.ndarray,
                 sequence_length: int, seed: int, pad_token_id: int = 0):
        super().__init__(arrays)
        self.sequence_length, self.seed, self.pad_token_id = sequence_length, seed, pad_token_id
        self.piece_starts, self.piece_ends, self.piece_document = split_documents(
            starts, ends, sequence_length)
        if not len(self.piece_starts):
            raise OlmoflowError("no document has two or more tokens: nothing to train on")
        lengths = self.piece_ends - self.piece_starts
        self.bin_offsets, self.bin_pieces = best_fit_decreasing(lengths, sequence_length + 1, seed)
        self.real_tokens = int(lengths.sum())

    @classmethod
    def from_paths(cls, paths: list[Path], dtype: np.dtype, sequence_length: int, seed: int,
                   pad_token_id: int = 0) -> PackedDataset:
        arrays, starts, ends = open_documents(paths, dtype)
        return cls(arrays, starts, ends, sequence_length, seed, pad_token_id)

    def __len__(self) -> int:
        return len(self.bin_offsets) - 1

    @property
    def packing_efficiency(self) -> float:
        """Fraction of instance tokens that are real (not padding)."""
        return self.real_tokens / max(len(self) * (self.sequence_length + 1), 1)

    def _pieces(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.bin_pieces[self.bin_offsets[i] : self.bin_offsets[i + 1]]

    def __getitem__(self, i: int) -> np.ndarray:
        out = np.full(self.sequence_length + 1, self.pad_token_id, dtype=np.int64)
        at = 0
        for p in self._pieces(i).tolist():
            s, e = int(self.piece_starts[p]), int(self.piece_ends[p])
            out[at : at + e - s] = self._slice(s, e)
            at += e - s
        return out

    def documents(self, i: int) -> np.ndarray:
        """``[T + 1]`` piece number (global) of each position of instance ``i``, -1 on padding."""
        out = np.full(self.sequence_length + 1, PAD_DOCUMENT, dtype=np.int64)
        at = 0
        for p in self._pieces(i).tolist():
            n = int(self.piece_ends[p] - self.piece_starts[p])
            out[at : at + n] = p
            at += n
        return out


def build_dataset(packing: str, paths: list[Path], dtype: np.dtype, sequence_length: int, seed: int,
                  intra_document_masking: bool = False, pad_token_id: int = 0):
    """The dataset ``train.packing`` names. Raises OlmoflowError on an unknown packing."""
    if packing == "concat":
        return InstanceDataset.from_paths(paths, dtype, sequence_length,
                                          documents=intra_document_masking)
    if packing == "best_fit":
        return PackedDataset.from_paths(paths, dtype, sequence_length, seed, pad_token_id)
    raise unknown_name_error("train.packing", packing, PACKINGS)


@dataclass(frozen=True)
class Batch:
    """A global batch of instances, as the loader yields it.

    Attributes:
        input_ids: ``[B, T]`` LongTensor.
        labels: ``[B, T]`` LongTensor, the next token, or ``IGNORE_INDEX`` where there is no target
            (padding; document boundaries under intra-document masking or best-fit packing).
        doc_ids: ``[B, T]`` LongTensor of document numbers (pass to the model for intra-document
            masking), or None when masking is off.
        state: the loader's ``state_dict()`` right after this batch: resuming from it continues with
            the next batch.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    doc_ids: torch.Tensor | None
    state: dict[str, int]

    @property
    def num_targets(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def shard(self, rank: int, world_size: int) -> Batch:
        """Rank ``rank``'s contiguous rows of the global batch (data parallelism).

        Raises:
            OlmoflowError: a rank outside ``[0, world_size)``, or rows that do not divide evenly.
        """
        B = self.input_ids.shape[0]
        if not 0 <= rank < world_size:
            raise OlmoflowError(f"no rank {rank} of {world_size} processes")
        if B % world_size:
            raise OlmoflowError(f"a global batch of {B} instances cannot be split over "
                                f"{world_size} processes; make train.global_batch_size a "
                                "multiple of it")
        rows = slice(rank * B // world_size, (rank + 1) * B // world_size)
        return Batch(self.input_ids[rows], self.labels[rows],
                     None if self.doc_ids is None else self.doc_ids[rows], self.state)


class ShuffledEpochs:
    """The cursor every loader of global batches shares: ``batch_size`` items of
    ``len(self.dataset)`` per batch, in a permutation drawn from ``(seed, epoch)`` only
    (``np.random.PCG64([seed, epoch])``), the remainder of an epoch dropped (as OLMo-core); its
    state is ``epoch`` and ``position`` (items of this epoch already yielded), so a loader resumes
    by restoring those two and clearing ``_order``.

    A subclass sets ``dataset``, ``batch_size``, ``seed``, ``epoch``, ``position`` and ``_order``
    (None) and calls :meth:`next_indices` for each batch.
    """

    dataset: Any
    batch_size: int
    seed: int
    epoch: int
    position: int
    _order: np.ndarray | None

    @property
    def batches_per_epoch(self) -> int:
        return len(self.dataset) // self.batch_size

    def order(self, epoch: int) -> np.ndarray:
        """The permutation of item indices for ``epoch``."""
        rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
        return rng.permutation(len(self.dataset))

    def next_indices(self) -> list[int]:
        """The items of the next batch; advances the cursor (and the epoch at its end)."""
        if self.position + self.batch_size > self.batches_per_epoch * self.batch_size:
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self._order = self.order(self.epoch)
        idx = self._order[self.position : self.position + self.batch_size].tolist()
        self.position += self.batch_size
        return idx


class DataLoader(ShuffledEpochs):
    """Global batches of instances in a seeded order per epoch; resumable from any ``Batch.state``.

    An epoch ends when too few instances remain for a full batch (the remainder is dropped, as in
    OLMo-core), and the next epoch reshuffles with ``(seed, epoch)``.

    Args:
        dataset: an :class:`InstanceDataset` or :class:`PackedDataset`.
        batch_size: instances per global batch.
        intra_document_masking: yield ``doc_ids`` and cut labels at document boundaries.
    Raises:
        OlmoflowError: fewer instances than one batch.
    """

    def __init__(self, dataset: InstanceDataset | PackedDataset, batch_size: int, seed: int,
                 intra_document_masking: bool = False):
        if len(dataset) < batch_size:
            raise OlmoflowError(
                f"the training data holds {len(dataset)} instances of "
                f"{dataset.sequence_length + 1} tokens, fewer than one batch of {batch_size}; "
                "add data or lower train.global_batch_size / train.sequence_length"
            )
        if intra_document_masking and not dataset.has_documents:
            raise OlmoflowError("intra-document masking needs the document index: build the "
                                "dataset with InstanceDataset.from_paths(..., documents=True)")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.intra_document_masking = intra_document_masking
        self.epoch = 0
        self.position = 0  # instances of this epoch already yielded
        self._order: np.ndarray | None = None


    def state_dict(self) -> dict[str, int | str]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "instances": len(self.dataset), "packing": self.dataset.packing,
                "sequence_length": self.dataset.sequence_length}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position (a ``state_dict()`` or a ``Batch.state``).

        Raises:
            OlmoflowError: the state was saved with another seed, train.packing,
                train.sequence_length or over another number of instances.
        """
        # Positions index instances: over other instances they would silently skip or repeat data.
        for key in ("packing", "sequence_length"):
            if key in state and state[key] != getattr(self.dataset, key):
                raise OlmoflowError(f"the checkpoint was trained with train.{key}={state[key]}, "
                                    f"this run has {getattr(self.dataset, key)}; resume with the "
                                    f"same train.{key}")
        if int(state.get("seed", self.seed)) != self.seed:
            raise OlmoflowError(
                f"the checkpoint's data order was drawn with seed {state['seed']}, this run has "
                f"seed {self.seed}; resume with the same seed"
            )
        if int(state.get("instances", len(self.dataset))) != len(self.dataset):
            raise OlmoflowError(
                f"the checkpoint's data loader had {state['instances']} instances, this run has "
                f"{len(self.dataset)}; resume with the same data, train.sequence_length and "
                "train.packing"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = None

    def next_batch(self) -> Batch:
        """The next global batch; advances the cursor (and the epoch at its end)."""
        idx = self.next_indices()
        tokens = np.stack([self.dataset[i] for i in idx])
        labels = tokens[:, 1:].copy()
        masking = self.intra_document_masking
        docs = None
        if masking or self.dataset.cuts_labels_at_documents:
            docs = np.stack([self.dataset.documents(i) for i in idx])
            labels[(docs[:, 1:] != docs[:, :-1]) | (docs[:, 1:] == PAD_DOCUMENT)] = IGNORE_INDEX
        return Batch(torch.from_numpy(np.ascontiguousarray(tokens[:, :-1])),
                     torch.from_numpy(labels),
                     torch.from_numpy(np.ascontiguousarray(docs[:, :-1])) if masking else None,
                     self.state_dict())

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()
