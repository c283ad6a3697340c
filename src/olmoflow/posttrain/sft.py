"""Supervised fine-tuning on the pretraining :class:`~olmoflow.train.trainer.Trainer`.

From :class:`~olmoflow.posttrain.data.SFTExample` objects (token ids + a loss mask per
conversation) to training batches, and the objective that trains on them:

- :func:`pack_examples` makes rows of ``sequence_length + 1`` tokens. With ``packing=True`` whole
  examples are packed by best-fit decreasing (:func:`olmoflow.train.packing.best_fit_decreasing`,
  as OLMo-core's packed fixed-length dataset and open-instruct's packed SFT do; Ding et al. 2024,
  "Fewer Truncations Improve Language Modeling"); with ``packing=False`` each row holds one
  example. The free tail of a row is padding. Every position carries the number of its example
  (its *document*; ``PAD_DOCUMENT`` on padding), so attention stays inside an example
  (intra-document masking) and labels never cross from one example to the next: a packed batch
  trains exactly what the same examples would train one per row.
- :class:`SFTLoader` yields :class:`~olmoflow.train.loader.Batch` objects in a seeded order per
  epoch, each carrying the loader's state after it (exact resume), as
  :class:`~olmoflow.train.loader.DataLoader` does for pretraining.
- :class:`SFTObjective`: next-token cross-entropy (+ z-loss) on the trained tokens only (assistant
  turns and their end markers), summed over the global batch and divided once by their count.
- :func:`processor_records` reads a user's own data processor classes (OLMo's
  ``data.processors``), and :func:`build_sft_data` puts files and processors through
  :func:`~olmoflow.posttrain.data.sft_examples` into one :class:`SFTDataset`.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from olmoflow.errors import OlmoflowError
from olmoflow.model.olmo import IGNORE_INDEX
from olmoflow.posttrain.data import (
    DataStats,
    SFTExample,
    check_data_files,
    nothing_left,
    sft_examples,
    split_sources,
)
from olmoflow.tokenizer.base import BaseTokenizer
from olmoflow.tokenizer.chat import ChatTemplate
from olmoflow.train import distributed
from olmoflow.train.loader import PAD_DOCUMENT, Batch, ShuffledEpochs
from olmoflow.train.objectives import LMObjective
from olmoflow.train.packing import best_fit_decreasing

__all__ = ["SFTDataset", "SFTLoader", "SFTObjective", "build_sft_data", "pack_examples",
           "processor_records", "sft_labels"]

PACKED, PADDED = "packed", "padded"  # SFTDataset.packing, recorded in the loader state


class SFTDataset:
    """Rows of ``sequence_length + 1`` tokens holding whole SFT examples (:func:`pack_examples`).

    The examples are stored once, concatenated; a row is put together when read, so memory is
    the data's size, not ``rows x (sequence_length + 1)``.

    Attributes:
        sequence_length: ``T``; a row has ``T + 1`` tokens (``T`` inputs, ``T`` targets).
        packing: ``"packed"`` or ``"padded"`` (one example per row).
        pad_token_id: the id written on padding (never trained, whatever its value).
        num_examples: examples placed in rows (each in exactly one row).
        real_tokens: example tokens in all rows (padding excluded).
    """

    def __init__(self, tokens: np.ndarray, mask: np.ndarray, offsets: np.ndarray,
                 bin_offsets: np.ndarray, bin_items: np.ndarray, sequence_length: int,
                 packing: str, pad_token_id: int, wheres: list[str]):
        self.tokens, self.mask, self.offsets = tokens, mask, offsets
        self.bin_offsets, self.bin_items = bin_offsets, bin_items
        self.sequence_length, self.packing = sequence_length, packing
        self.pad_token_id = pad_token_id
        self.wheres = wheres
        self.num_examples = len(offsets) - 1
        self.real_tokens = int(offsets[-1])
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return len(self.bin_offsets) - 1

    @property
    def packing_efficiency(self) -> float:
        """Share of row positions that hold example tokens (not padding), in ``[0, 1]``."""
        return self.real_tokens / max(len(self) * (self.sequence_length + 1), 1)

    def examples_of(self, i: int) -> list[int]:
        """Indices (into the examples given to :func:`pack_examples`) of row ``i``'s examples, in
        the order they sit in the row."""
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.bin_items[self.bin_offsets[i] : self.bin_offsets[i + 1]].tolist()

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row ``i`` as ``(ids, loss_mask, documents)``, each ``[T + 1]`` int64: the examples
        first, then ``pad_token_id`` / 0 / ``PAD_DOCUMENT``. ``documents`` holds each example's
        index into the examples given to :func:`pack_examples`."""
        n = self.sequence_length + 1
        ids = np.full(n, self.pad_token_id, dtype=np.int64)
        mask = np.zeros(n, dtype=np.int64)
        docs = np.full(n, PAD_DOCUMENT, dtype=np.int64)
        at = 0
        for e in self.examples_of(i):
            s, t = int(self.offsets[e]), int(self.offsets[e + 1])
            ids[at : at + t - s] = self.tokens[s:t]
            mask[at : at + t - s] = self.mask[s:t]
            docs[at : at + t - s] = e
            at += t - s
        return ids, mask, docs

    def fingerprint(self) -> str:
        """A short hash of the rows' contents (tokens, masks and which examples share a row): a
        resume over other data would silently train on something else."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for a in (self.tokens, self.mask, self.offsets, self.bin_offsets, self.bin_items):
                h.update(np.ascontiguousarray(a).tobytes())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def summary(self) -> str:
        """One line: examples, rows, packing efficiency."""
        return (f"{self.num_examples} examples in {len(self)} {self.packing} rows of "
                f"{self.sequence_length + 1} tokens, packing efficiency "
                f"{self.packing_efficiency:.1%}")


def pack_examples(examples: Sequence[SFTExample], sequence_length: int, *, packing: bool,
                  pad_token_id: int, seed: int = 0) -> SFTDataset:
    """Place whole examples into rows of ``sequence_length + 1`` tokens.

    ``packing=True``: best-fit decreasing (longest first, ties in an order drawn from ``seed``;
    each into the fullest row it still fits), so rows are few and full; the result depends only
    on the examples' lengths and ``seed``. ``packing=False``: one example per row, in input order.
    Examples are never cut here (:func:`~olmoflow.posttrain.data.sft_examples` with
    ``max_length=sequence_length + 1`` already cut or dropped the long ones). Examples of fewer
    than two tokens have no target and are left out.

    Args:
        examples: ``SFTExample`` objects (``input_ids`` and a 0/1 ``loss_mask`` of one length).
        sequence_length: ``T``, the model's input length; a row holds ``T + 1`` tokens.
        pad_token_id: id written on padding (padding is never trained, even when it equals EOS).
    Returns:
        An :class:`SFTDataset`; ``.packing_efficiency`` and ``len()`` report the packing.
    Raises:
        OlmoflowError: ``sequence_length < 1``; an example longer than ``sequence_length + 1``
            tokens or whose mask length differs from its ids (naming its ``file:line``).
    """
    T = int(sequence_length)
    if T < 1:
        raise OlmoflowError(f"sequence_length must be >= 1, got {sequence_length}")
    kept = []
    for ex in examples:
        n = len(ex.input_ids)
        if len(ex.loss_mask) != n:
            raise OlmoflowError(f"{ex.where}: {n} token ids but {len(ex.loss_mask)} loss-mask "
                                "entries")
        if n > T + 1:
            raise OlmoflowError(f"{ex.where}: {n} tokens do not fit a row of {T + 1} "
                                f"(sequence_length {T} + 1); make the examples with "
                                f"sft_examples(..., max_length={T + 1})")
        if n >= 2:
            kept.append(ex)
    lengths = np.array([len(ex.input_ids) for ex in kept], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.fromiter((t for ex in kept for t in ex.input_ids), dtype=np.int64,
                         count=int(offsets[-1]))
    if len(tokens) and (tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max):
        raise OlmoflowError(f"token ids must be in [0, 2**31), got [{tokens.min()}, "
                            f"{tokens.max()}]")
    mask = np.fromiter((m for ex in kept for m in ex.loss_mask), dtype=np.int64,
                       count=int(offsets[-1]))
    if packing:
        bin_offsets, bin_items = best_fit_decreasing(lengths, T + 1, seed)
    else:
        bin_offsets = np.arange(len(kept) + 1, dtype=np.int64)
        bin_items = np.arange(len(kept), dtype=np.int64)
    return SFTDataset(tokens.astype(np.int32), (mask != 0).astype(np.uint8), offsets, bin_offsets,
                      bin_items, T, PACKED if packing else PADDED, int(pad_token_id),
                      [ex.where for ex in kept])


def sft_labels(ids: np.ndarray, mask: np.ndarray, docs: np.ndarray) -> np.ndarray:
    """Targets of rows ``[..., T + 1]``: ``labels[t] = ids[t + 1]`` where token ``t + 1`` is
    trained (``mask``) and in the same document as token ``t``, else ``IGNORE_INDEX``.

    Decided by the mask and the documents only, never by comparing with the pad id: an
    end-of-turn token that is also the pad token is still trained. Returns ``[..., T]`` int64.
    """
    labels = np.array(ids[..., 1:], dtype=np.int64, copy=True)
    nxt = docs[..., 1:]
    keep = (mask[..., 1:] != 0) & (nxt == docs[..., :-1]) & (nxt != PAD_DOCUMENT)
    labels[~keep] = IGNORE_INDEX
    return labels


class SFTLoader(ShuffledEpochs):
    """Global batches of SFT rows in a seeded order per epoch; resumable from any ``Batch.state``.

    The order of epoch ``e`` is a permutation drawn from ``(seed, e)`` alone (as
    :class:`~olmoflow.train.loader.DataLoader`); an epoch ends when fewer rows than a batch remain
    (the remainder is dropped). ``next_batch()`` returns a :class:`~olmoflow.train.loader.Batch`
    with ``input_ids [B, T]``, ``labels [B, T]`` (:func:`sft_labels`), ``doc_ids [B, T]`` for
    intra-document attention (None for ``"padded"`` rows: one example per row needs only the
    causal mask, and the model keeps its fast path) and ``state``.

    Args:
        dataset: an :class:`SFTDataset`.
        batch_size: rows per global batch (``train.global_batch_size``).
        seed: the data-order seed.
    Raises:
        OlmoflowError: fewer rows than one batch.
    """

    def __init__(self, dataset: SFTDataset, batch_size: int, seed: int):
        if batch_size < 1:
            raise OlmoflowError(f"batch_size must be >= 1, got {batch_size}")
        if len(dataset) < batch_size:
            raise OlmoflowError(
                f"the SFT data holds {dataset.num_examples} examples in {len(dataset)} "
                f"{dataset.packing} rows of {dataset.sequence_length + 1} tokens, fewer than one "
                f"batch of {batch_size}; add data or lower train.global_batch_size")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.epoch = 0
        self.position = 0  # rows of this epoch already yielded
        self._order: np.ndarray | None = None


    def state_dict(self) -> dict[str, int | str]:
        d = self.dataset
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "instances": len(d), "packing": d.packing, "sequence_length": d.sequence_length,
                "fingerprint": d.fingerprint()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position (a ``state_dict()`` or a ``Batch.state``).

        Raises:
            OlmoflowError: the state was saved with another seed, packing, sequence_length,
                number of rows, or other data.
        """
        d = self.dataset
        # Positions index rows: over other rows they would silently skip or repeat data.
        if "packing" in state and state["packing"] != d.packing:
            raise OlmoflowError(f"the checkpoint was trained on {state['packing']} SFT rows, this "
                                f"run has {d.packing} rows; resume with the same packing setting")
        if "sequence_length" in state and int(state["sequence_length"]) != d.sequence_length:
            raise OlmoflowError(f"the checkpoint was trained with train.sequence_length="
                                f"{state['sequence_length']}, this run has {d.sequence_length}; "
                                "resume with the same train.sequence_length")
        if int(state.get("seed", self.seed)) != self.seed:
            raise OlmoflowError(f"the checkpoint's data order was drawn with seed {state['seed']}, "
                                f"this run has seed {self.seed}; resume with the same seed")
        if int(state.get("instances", len(d))) != len(d):
            raise OlmoflowError(f"the checkpoint's SFT loader had {state['instances']} rows, this "
                                f"run has {len(d)}; resume with the same data and settings")
        if state.get("fingerprint", d.fingerprint()) != d.fingerprint():
            raise OlmoflowError("the checkpoint was trained on other SFT data (same number of "
                                f"rows, other contents: {state['fingerprint']} vs "
                                f"{d.fingerprint()}); resume with the same data, tokenizer and "
                                "chat template")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = None

    def next_batch(self) -> Batch:
        """The next global batch; advances the cursor (and the epoch at its end)."""
        idx = self.next_indices()
        ids, mask, docs = (np.stack(a) for a in zip(*(self.dataset.row(i) for i in idx),
                                                     strict=True))
        labels = sft_labels(ids, mask, docs)
        doc_ids = (torch.from_numpy(np.ascontiguousarray(docs[:, :-1]))
                   if self.dataset.packing == PACKED else None)
        if doc_ids is None:
            # One example per row, right-padded: the columns after the batch's longest example
            # hold only padding (causal attention: they change no real position), so they go.
            real = (docs != PAD_DOCUMENT).sum(1).max()
            T = max(int(real) - 1, 1)
            ids, labels = ids[:, :T + 1], labels[:, :T]
        return Batch(torch.from_numpy(np.ascontiguousarray(ids[:, :-1])),
                     torch.from_numpy(labels), doc_ids, self.state_dict())

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()


class SFTObjective(LMObjective):
    """Supervised fine-tuning: :class:`~olmoflow.train.objectives.LMObjective` on SFT batches.

    The loss is cross-entropy (+ z-loss) summed over the trained tokens of a micro-batch (labels
    not ``IGNORE_INDEX``: assistant content and end-of-turn markers) and divided by their count in
    the whole global batch, so every trained token weighs the same whatever the micro-batch size,
    the number of processes or how examples were packed (open-instruct's ``sum`` loss over a
    batch, normalised once). Its own ``name`` keeps a pretraining checkpoint from being resumed
    as an SFT run (start SFT from pretrained weights instead).

    Metrics: those of ``LMObjective`` plus ``assistant_tokens``, the trained tokens of the step's
    global batch.
    """

    name = "sft"

    def __init__(self) -> None:
        self._targets = 0  # the global batch's trained tokens, counted by normalizer()

    def normalizer(self, batch, dist: distributed.DistInfo) -> float:
        n_targets = distributed.all_reduce_sum(int((batch["labels"] != IGNORE_INDEX).sum()), dist)
        self._targets = int(n_targets)
        return n_targets / dist.world_size if dist.world_size > 1 else n_targets

    def step_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        return {**super().step_metrics(totals), "assistant_tokens": float(self._targets)}


# ---------------------------------------------------------------------------------------------
# User data processors


def _processor_class(name: str, spec: Any, search_path: Path | None) -> type:
    """The class ``spec`` names: ``package.module.Class``, ``package.module:Class`` or
    ``path/to/file.py:Class`` (relative to ``search_path``, else the current directory)."""
    from olmoflow import user_code

    key = f"data.processors.{name}.class"
    if not isinstance(spec, str) or not spec.strip():
        raise OlmoflowError(f"{key} must name a class (your_module.YourProcessor), got {spec!r}")
    if ":" in spec:
        where, _, cls_name = spec.rpartition(":")
    else:
        where, _, cls_name = spec.rpartition(".")
    if not where or not cls_name:
        raise OlmoflowError(f"{key} '{spec}' must be module.Class or path/to/file.py:Class")
    try:
        if user_code.is_file_spec(where):
            file = Path(where).expanduser()
            if search_path is not None and not file.is_absolute():
                file = Path(search_path) / file
            module = user_code.load_file(file)
        else:
            added = search_path is not None and str(search_path) not in sys.path
            if added:  # the config's own directory: named explicitly, so not an implicit import
                sys.path.insert(0, str(search_path))
            try:
                module = user_code.import_module(where, f"{key}=./{{file}}:{cls_name}")
            finally:
                if added:
                    sys.path.remove(str(search_path))
    except OlmoflowError as e:
        raise OlmoflowError(f"{key} '{spec}' cannot be loaded: {e}") from None
    cls = getattr(module, cls_name, None)
    if not isinstance(cls, type):
        raise OlmoflowError(f"{key} '{spec}' cannot be loaded: '{where}' defines no class "
                            f"'{cls_name}'")
    return cls


def processor_records(processors: Mapping[str, Mapping[str, Any]], *,
                      search_path: str | Path | None = None) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` from the user's data processors, OLMo's ``data.processors``.

    Each entry ``{name: {"class": "your_module.YourProcessor", **kwargs}}`` names a class; it is
    imported (this runs the user's code, see :mod:`olmoflow.user_code`: a module on the Python
    path, never from the current directory implicitly, or ``path/to/file.py:Class``), built with
    ``kwargs``, and read as a sequence: ``len(p)`` records ``p[i]``, each a dict with ``messages``
    or ``text`` (any SFT format :func:`~olmoflow.posttrain.data.read_conversations` reads).
    ``where`` is ``"name[i]"``; the pairs go straight into
    :func:`~olmoflow.posttrain.data.sft_examples`.

    Args:
        processors: name -> ``{"class": ..., **kwargs}``, in the order to read them.
        search_path: a directory to find the modules and relative ``.py`` files in (the config
            file's directory), besides the Python path.
    Raises:
        OlmoflowError: a missing or bad ``class``, a class that does not load or fails to build,
            an instance without ``__len__``/``__getitem__``, or a record that fails to load
            (naming ``name[i]``); one line each.
    """
    root = None if search_path is None else Path(search_path).expanduser().resolve()
    for name, entry in processors.items():
        if not isinstance(entry, Mapping) or "class" not in entry:
            raise OlmoflowError(f"data.processors.{name} needs a 'class' key naming the processor "
                                "class (class: your_module.YourProcessor)")
        kwargs = {k: v for k, v in entry.items() if k != "class"}
        cls = _processor_class(name, entry["class"], root)
        try:
            proc = cls(**kwargs)
        except Exception as e:  # noqa: BLE001 - any failure here is the user's class's
            raise OlmoflowError(f"data.processors.{name}: {cls.__name__}(**{sorted(kwargs)}) "
                                f"failed: {_one_line(e)}") from None
        if not (hasattr(proc, "__len__") and hasattr(proc, "__getitem__")):
            raise OlmoflowError(f"data.processors.{name}: a {cls.__name__} has no __len__ and "
                                "__getitem__; a processor is a sequence of records")
        try:
            n = int(len(proc))
        except Exception as e:  # noqa: BLE001
            raise OlmoflowError(f"data.processors.{name}: len() failed: {_one_line(e)}") from None
        for i in range(n):
            try:
                record = proc[i]
            except Exception as e:  # noqa: BLE001
                raise OlmoflowError(f"{name}[{i}]: {cls.__name__}[{i}] failed: "
                                    f"{_one_line(e)}") from None
            yield f"{name}[{i}]", record


def _one_line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def build_sft_data(
    paths: Sequence[str | Path],
    processors: Mapping[str, Mapping[str, Any]] | None,
    template: str | ChatTemplate | None,
    tokenizer: BaseTokenizer,
    sequence_length: int,
    *,
    format: str | None = None,
    on_too_long: str = "truncate",
    strict: bool = False,
    packing: bool = True,
    limit: int | None = None,
    seed: int = 0,
    search_path: str | Path | None = None,
) -> tuple[SFTDataset, DataStats]:
    """SFT rows from data files and user processors: read, render, fit, pack.

    Files are read first, in order, then each processor (:func:`processor_records`); every
    conversation renders with ``template`` (:func:`~olmoflow.posttrain.data.sft_examples`,
    ``max_length = sequence_length + 1``, so a fitted example fills at most one row) and the
    examples are placed by :func:`pack_examples`.

    Args:
        paths: data files (``.jsonl``, ``.json``, ``.jsonl.gz``, text); may be empty.
        processors: ``data.processors`` entries, or None.
        template, tokenizer: the chat template and a tokenizer prepared for it
            (:func:`~olmoflow.tokenizer.chat.add_chat_template`); its ``pad_token_id``
            fills the rows' tails.
        sequence_length: the model's input length ``T``.
        format, on_too_long, strict: as for ``sft_examples`` (``format`` applies to files only;
            processor records are detected per record).
        packing: pack several examples per row (True) or one per row.
        limit: keep at most this many examples (the first ones), or None for all.
        seed: the packing's tie-breaking seed.
        search_path: where processor modules and relative files are found (see
            :func:`processor_records`).
    Returns:
        ``(dataset, stats)``; ``stats.summary()`` and ``dataset.summary()`` are one line each.
    Raises:
        OlmoflowError: no data at all; a path that is missing or a directory; a data file (or
            the processors) giving no example to train on, naming it with its counts; what
            ``sft_examples`` and ``processor_records`` raise.
    """
    if limit is not None and limit < 1:
        raise OlmoflowError(f"limit must be >= 1 or None, got {limit}")
    if isinstance(paths, str | Path):
        paths = [paths]
    check_data_files(paths)
    stats = DataStats()
    kw = dict(on_too_long=on_too_long, strict=strict)
    examples: list[SFTExample] = []
    sources: list[tuple[str, Any, str | None]] = []
    if paths:
        sources += [(name, src, format) for name, src in split_sources(list(paths))]
    if processors:
        sources.append(("data.processors",
                        processor_records(processors, search_path=search_path), None))
    if not sources:
        raise OlmoflowError("no SFT data: give data files or data.processors")
    full = False
    for name, source, fmt in sources:
        # Each file on its own: one that gives nothing to train on is named (a wrong format, or
        # every example empty or too long), not hidden among the others.
        own = DataStats()
        before = len(examples)
        for ex in sft_examples(source, template, tokenizer, sequence_length + 1, format=fmt,
                               stats=own, **kw):
            examples.append(ex)
            if limit is not None and len(examples) >= limit:
                full = True
                break
        stats.add(own)
        if len(examples) == before:
            raise nothing_left(name, "example", own)
        if full:
            break
    return pack_examples(examples, sequence_length, packing=packing,
                         pad_token_id=tokenizer.pad_token_id, seed=seed), stats
