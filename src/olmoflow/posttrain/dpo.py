"""Direct preference optimisation on the shared :class:`~olmoflow.train.trainer.Trainer`.

The pieces, in the order a DPO run uses them:

1. :func:`build_dpo_data` reads preference pairs (any format of :mod:`olmoflow.posttrain.data`)
   into a :class:`PreferenceDataset`: per pair, the sequences prompt + chosen and prompt +
   rejected with next-token labels on the response tokens only.
2. :class:`ReferenceCache` computes the frozen reference model's summed response log-probabilities
   once (:func:`reference_logps`), writes them with the run (``reference_logps.safetensors``) and
   reuses them while the reference weights, the pairs and the dtype are unchanged; the reference
   model is then freed, so training holds one model, as open-instruct's DPO does with its cached
   reference log-probs.
3. :class:`PreferenceLoader` yields global batches of pairs in a seeded order per epoch, each
   carrying its resume state, as :class:`olmoflow.data.loader.DataLoader` does for pretraining.
4. :class:`DPOObjective` is the trainer's :class:`~olmoflow.train.objectives.Objective`: one
   forward over chosen and rejected concatenated (TRL's ``concatenated_forward``), the policy's
   summed sequence log-probabilities (:func:`~olmoflow.posttrain.losses.sequence_logps`) and
   :func:`~olmoflow.posttrain.losses.dpo_loss` (sigmoid DPO, length-normalised DPO, SimPO).

Label convention (that of :meth:`olmoflow.model.olmo.Olmo.forward`): a pair's sequence of ``L``
tokens is fed as ``input_ids = seq[:-1]`` with ``labels[t] = seq[t + 1]`` where the response's loss
mask is 1 at ``t + 1``, else ``IGNORE_INDEX``; batches are right-padded (causal attention: padding
after a sequence never changes its real positions) and labels are ``IGNORE_INDEX`` on padding.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch

from olmoflow.artifacts import atomic_path, atomic_write_json, sha256_file
from olmoflow.errors import OlmoflowError, unknown_name_error
from olmoflow.model.olmo import IGNORE_INDEX
from olmoflow.posttrain.chat_template import ChatTemplate
from olmoflow.posttrain.data import DataStats, PreferenceExample, preference_examples
from olmoflow.posttrain.losses import DPO_LOSS_TYPES, dpo_loss, sequence_logps
from olmoflow.tokenizer.base import BaseTokenizer
from olmoflow.train import distributed
from olmoflow.train.objectives import Batch, Objective

log = logging.getLogger(__name__)

REFERENCE_FILE = "reference_logps.safetensors"
REFERENCE_KEY_FILE = "reference_logps.json"
_CACHE_VERSION = 1  # bump when what the cached numbers mean changes

# ---------------------------------------------------------------------------------------------
# Data


class PreferenceDataset:
    """Tokenized preference pairs, ready to batch.

    Pair ``i`` is two sequences, ``prompt + chosen`` (row 0) and ``prompt + rejected`` (row 1).

    Args:
        examples: :class:`~olmoflow.posttrain.data.PreferenceExample` objects (in order; pair
            ``i`` is ``examples[i]``).
        max_length: the most tokens a sequence may have (None: no limit); the readers already
            fit pairs to it, so a longer one here is a caller's error.
        pad_token_id: the id written on padding (never a target, never attended to by a real
            position).

    Attributes:
        ref_logps: ``[N, 2]`` fp32 summed reference log-probabilities (chosen, rejected) once a
            :class:`ReferenceCache` attached them, else None.
        ref_counts: ``[N, 2]`` long response-token counts that go with them.

    Raises:
        OlmoflowError: no pairs; a sequence longer than ``max_length``; a response with no
            trained token; masks whose lengths differ from their ids.
    """

    def __init__(self, examples: Sequence[PreferenceExample], max_length: int | None = None,
                 pad_token_id: int = 0):
        if not examples:
            raise OlmoflowError("no preference pairs to train on (every record was skipped or "
                                "dropped; see the data stats)")
        self.max_length, self.pad_token_id = max_length, int(pad_token_id)
        self.wheres: list[str] = []
        self._seqs: list[tuple[np.ndarray, np.ndarray]] = []  # (ids [L], target mask [L]) x 2N
        for ex in examples:
            self.wheres.append(ex.where)
            prompt = list(ex.prompt_ids)
            for ids, mask, what in ((ex.chosen_ids, ex.chosen_mask, "chosen"),
                                    (ex.rejected_ids, ex.rejected_mask, "rejected")):
                if len(ids) != len(mask):
                    raise OlmoflowError(f"{ex.where}: the {what} ids ({len(ids)}) and loss mask "
                                        f"({len(mask)}) differ in length")
                seq = np.asarray(prompt + list(ids), dtype=np.int64)
                target = np.asarray([0] * len(prompt) + [int(m) for m in mask], dtype=bool)
                if max_length is not None and len(seq) > max_length:
                    raise OlmoflowError(f"{ex.where}: the {what} sequence has {len(seq)} tokens, "
                                        f"more than max_length={max_length}")
                # position 0 predicts nothing: a response token counts only after a prompt token
                if len(seq) < 2 or not target[1:].any():
                    raise OlmoflowError(f"{ex.where}: the {what} response has no trained token")
                self._seqs.append((seq, target))
        self.ref_logps: torch.Tensor | None = None
        self.ref_counts: torch.Tensor | None = None
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return len(self.wheres)

    def lengths(self) -> np.ndarray:
        """``[N, 2]`` tokens of each pair's two full sequences."""
        return np.array([len(s) for s, _ in self._seqs], dtype=np.int64).reshape(-1, 2)

    @property
    def num_tokens(self) -> int:
        """Tokens over all pairs (both sequences)."""
        return int(self.lengths().sum())

    def response_counts(self) -> torch.Tensor:
        """``[N, 2]`` long: trained response tokens of each pair's chosen and rejected."""
        return torch.tensor([int(t[1:].sum()) for _, t in self._seqs]).view(-1, 2)

    def fingerprint(self) -> str:
        """sha256 (hex) of every pair's token ids and target masks, in order: what the
        reference log-probabilities and a resume position depend on."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for seq, target in self._seqs:
                h.update(np.int64(len(seq)).tobytes())
                h.update(seq.tobytes())
                h.update(np.packbits(target).tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def collate(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The pairs ``indices`` as tensors, padded to their own longest sequence.

        Returns:
            ``input_ids [B, 2, T]`` and ``labels [B, 2, T]`` long (``T`` = longest sequence - 1;
            row 0 chosen, row 1 rejected), ``lengths [B, 2]`` (real input positions),
            ``index [B]`` (the pair numbers), and ``ref_logps [B, 2]`` fp32 when attached.
        """
        idx = [int(i) for i in indices]
        seqs = [self._seqs[2 * i + k] for i in idx for k in (0, 1)]
        T = max(len(s) for s, _ in seqs) - 1
        ids = np.full((len(seqs), T), self.pad_token_id, dtype=np.int64)
        labels = np.full((len(seqs), T), IGNORE_INDEX, dtype=np.int64)
        lengths = np.zeros(len(seqs), dtype=np.int64)
        for r, (seq, target) in enumerate(seqs):
            n = len(seq) - 1
            ids[r, :n] = seq[:-1]
            labels[r, :n] = np.where(target[1:], seq[1:], IGNORE_INDEX)
            lengths[r] = n
        B = len(idx)
        out = {"input_ids": torch.from_numpy(ids).view(B, 2, T),
               "labels": torch.from_numpy(labels).view(B, 2, T),
               "lengths": torch.from_numpy(lengths).view(B, 2),
               "index": torch.tensor(idx, dtype=torch.long)}
        if self.ref_logps is not None:
            out["ref_logps"] = self.ref_logps[idx]
        return out

    def attach_reference(self, sums: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """Attach the reference's summed log-probabilities ``[N, 2]`` (and token counts), so
        batches carry ``ref_logps``.

        Raises:
            OlmoflowError: shapes that do not match the ``N`` pairs.
        """
        if tuple(sums.shape) != (len(self), 2):
            raise OlmoflowError(f"reference log-probabilities of shape {tuple(sums.shape)} do not "
                                f"match {len(self)} pairs (expected [{len(self)}, 2])")
        self.ref_logps = sums.detach().float().cpu()
        self.ref_counts = (counts if counts is not None else self.response_counts()).long().cpu()


class PreferenceBatch(dict):
    """A global batch of pairs (a dict of tensors, see :meth:`PreferenceDataset.collate`) whose
    ``state`` is the loader's state right after it (what a checkpoint saves)."""

    state: dict[str, Any]


class PreferenceLoader:
    """Global batches of ``batch_size`` pairs in a seeded order per epoch; exactly resumable.

    The order of epoch ``e`` is ``np.random.Generator(np.random.PCG64([seed, e]))``'s
    permutation of the pairs (as :class:`olmoflow.data.loader.DataLoader`); an epoch ends when
    fewer than ``batch_size`` pairs remain (they are dropped, and the next epoch reshuffles).
    Each batch is padded to its own longest sequence, so ``T`` varies between batches.

    Raises:
        OlmoflowError: fewer pairs than one batch; ``batch_size < 1``.
    """

    def __init__(self, dataset: PreferenceDataset, batch_size: int, seed: int):
        if batch_size < 1:
            raise OlmoflowError(f"a preference batch needs at least one pair, got {batch_size}")
        if len(dataset) < batch_size:
            raise OlmoflowError(f"the preference data holds {len(dataset)} pairs, fewer than one "
                                f"batch of {batch_size}; add data or lower "
                                "train.global_batch_size")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, int(seed)
        self.epoch, self.position = 0, 0
        self._order: np.ndarray | None = None

    @property
    def batches_per_epoch(self) -> int:
        return len(self.dataset) // self.batch_size

    def order(self, epoch: int) -> np.ndarray:
        """The permutation of pair numbers for ``epoch``."""
        return np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(
            len(self.dataset))

    def state_dict(self) -> dict[str, Any]:
        """Plain data: ``epoch``, ``position`` (pairs of this epoch yielded), ``seed``, ``pairs``
        and ``data`` (the dataset's fingerprint)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "pairs": len(self.dataset), "data": self.dataset.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue right after the batch whose state this is.

        Raises:
            OlmoflowError: the state was saved with another seed, another number of pairs or
                other pairs (positions would silently skip or repeat data).
        """
        if int(state.get("seed", self.seed)) != self.seed:
            raise OlmoflowError(f"the checkpoint's pair order was drawn with seed "
                                f"{state['seed']}, this run has seed {self.seed}; resume with the "
                                "same seed")
        if int(state.get("pairs", len(self.dataset))) != len(self.dataset):
            raise OlmoflowError(f"the checkpoint's data loader had {state['pairs']} pairs, this "
                                f"run has {len(self.dataset)}; resume with the same preference "
                                "data and max_length")
        if state.get("data", self.dataset.fingerprint()) != self.dataset.fingerprint():
            raise OlmoflowError("the checkpoint was trained on other preference pairs (same "
                                "count, other tokens); resume with the same data, tokenizer and "
                                "chat template")
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None

    def next_batch(self) -> PreferenceBatch:
        """The next global batch (see :meth:`PreferenceDataset.collate`); advances the cursor."""
        if self.position + self.batch_size > self.batches_per_epoch * self.batch_size:
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self._order = self.order(self.epoch)
        idx = self._order[self.position:self.position + self.batch_size].tolist()
        self.position += self.batch_size
        batch = PreferenceBatch(self.dataset.collate(idx))
        batch.state = self.state_dict()
        return batch

    def __iter__(self):
        while True:
            yield self.next_batch()


def build_dpo_data(
    records: Sequence[str | Path] | Iterable[Any],
    template: str | ChatTemplate | None,
    tokenizer: BaseTokenizer,
    max_length: int | None,
    *,
    format: str | None = None,
    on_too_long: str = "truncate",
    strict: bool = False,
    limit: int | None = None,
) -> tuple[PreferenceDataset, DataStats]:
    """Read and tokenize preference pairs into a :class:`PreferenceDataset`.

    Args:
        records: data files or records, as :func:`~olmoflow.posttrain.data.read_pairs` takes.
        template: chat template name / object, or None for the tokenizer's own.
        tokenizer: prepared with :func:`~olmoflow.posttrain.chat_template.add_chat_template`;
            its ``pad_token_id`` pads batches.
        max_length: the most tokens of prompt + the longer response (None: no limit).
        format, on_too_long, strict: as for :func:`~olmoflow.posttrain.data.preference_examples`.
        limit: keep at most this many pairs (the first ones; None: all).

    Returns:
        ``(dataset, stats)``; ``stats`` counts what was read, skipped, truncated and dropped.
    Raises:
        OlmoflowError: bad options; under ``strict`` bad input naming ``file:line``; no pair
            left.
    """
    if limit is not None and limit < 1:
        raise OlmoflowError(f"limit must be >= 1 (or None for every pair), got {limit}")
    stats = DataStats()
    examples = preference_examples(records, template, tokenizer, max_length,
                                   on_too_long=on_too_long, format=format, strict=strict,
                                   stats=stats)
    kept = list(islice(examples, limit))
    if not kept:
        raise OlmoflowError(f"no preference pairs left to train on: {stats.summary()}")
    return PreferenceDataset(kept, max_length, tokenizer.pad_token_id), stats


# ---------------------------------------------------------------------------------------------
# The reference model's log-probabilities


def _concat_pairs(x: torch.Tensor) -> torch.Tensor:
    """``[b, 2, ...]`` -> ``[2b, ...]``: all chosen rows, then all rejected rows (TRL's
    ``concatenated_inputs`` order)."""
    return torch.cat([x[:, 0], x[:, 1]], dim=0)


def _pair_logps(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over a ``[b, 2, T]`` batch; ``(sums [b, 2] fp32, counts [b, 2])``."""
    b = input_ids.shape[0]
    logits = model(_concat_pairs(input_ids)).logits
    sums, counts = sequence_logps(logits, _concat_pairs(labels))
    return torch.stack([sums[:b], sums[b:]], 1), torch.stack([counts[:b], counts[b:]], 1)


def reference_sums_and_counts(model: torch.nn.Module, dataset: PreferenceDataset, *,
                              batch_size: int, device: str | torch.device = "cpu",
                              dtype: torch.dtype = torch.float32
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's summed response log-probabilities and response-token counts.

    The model runs in eval mode with gradients off (its ``training`` and ``requires_grad``
    flags are put back afterwards, so the policy itself may serve as the reference before
    training). Pairs are batched longest-first to pad little; the result is in pair order.

    Args:
        model: the frozen reference (an :class:`~olmoflow.model.olmo.Olmo`); moved to nothing,
            its parameters must already be on ``device``.
        dataset: the pairs.
        batch_size: pairs per forward (each forward holds ``2 * batch_size`` sequences).
        device: where the batches go.
        dtype: ``torch.float32``, or ``torch.bfloat16`` / ``torch.float16`` to run under
            autocast (log-probabilities are still summed in fp32).
    Returns:
        ``(sums [N, 2] fp32, counts [N, 2] long)`` on the CPU, column 0 chosen, 1 rejected.
    Raises:
        OlmoflowError: ``batch_size < 1``.
    """
    if batch_size < 1:
        raise OlmoflowError(f"reference batch_size must be >= 1, got {batch_size}")
    device = torch.device(device)
    n = len(dataset)
    sums = torch.zeros(n, 2, dtype=torch.float32)
    counts = torch.zeros(n, 2, dtype=torch.long)
    order = np.argsort(-dataset.lengths().max(1), kind="stable")
    flags = [p.requires_grad for p in model.parameters()]
    was_training = model.training
    model.eval()
    model.requires_grad_(False)
    amp = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else None)
    try:
        with torch.no_grad():
            for start in range(0, n, batch_size):
                idx = order[start:start + batch_size].tolist()
                batch = dataset.collate(idx)
                ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
                if amp is not None:
                    with amp:
                        s, c = _pair_logps(model, ids, labels)
                else:
                    s, c = _pair_logps(model, ids, labels)
                sums[idx], counts[idx] = s.float().cpu(), c.cpu()
    finally:
        for p, f in zip(model.parameters(), flags, strict=True):
            p.requires_grad_(f)
        model.train(was_training)
    return sums, counts


def reference_logps(model: torch.nn.Module, dataset: PreferenceDataset, *, batch_size: int,
                    device: str | torch.device = "cpu", average: bool = False,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[N, 2]`` fp32 reference log-probabilities of each pair's chosen and rejected response:
    summed over response tokens (nats), or with ``average`` the mean per response token (the
    length-normalised scores). See :func:`reference_sums_and_counts` for the arguments."""
    sums, counts = reference_sums_and_counts(model, dataset, batch_size=batch_size,
                                             device=device, dtype=dtype)
    return sums / counts.clamp_min(1) if average else sums


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class ReferenceCache:
    """The reference log-probabilities of a run, computed once and kept in ``directory``.

    Files: ``reference_logps.safetensors`` (tensors ``sums [N, 2]`` fp32 and ``counts [N, 2]``
    int64, read with ``safetensors`` only: no pickle) and ``reference_logps.json`` (the key and
    the tensor file's sha256), both written atomically, the JSON last. The key is the sha256 of
    the reference's identity (``reference_id``, given by the caller: e.g. the sha256 of its
    weights file or its checkpoint manifest), the pairs' token ids and masks, and ``dtype``.
    A cache whose key differs, or whose files are missing, unreadable, tampered with or of the
    wrong shape, is recomputed (with a warning for the damaged ones), never trusted.

    Args:
        directory: the run directory the files live in.
        reference_id: what identifies the reference weights.
        dtype: the dtype the reference runs in (see :func:`reference_sums_and_counts`).
    """

    def __init__(self, directory: str | Path, reference_id: str,
                 dtype: torch.dtype = torch.float32):
        self.directory = Path(directory)
        self.reference_id, self.dtype = str(reference_id), dtype

    @property
    def tensor_path(self) -> Path:
        return self.directory / REFERENCE_FILE

    @property
    def key_path(self) -> Path:
        return self.directory / REFERENCE_KEY_FILE

    def key(self, dataset: PreferenceDataset) -> str:
        """The cache key of ``dataset`` under this reference and dtype (hex sha256)."""
        blob = json.dumps({"version": _CACHE_VERSION, "reference": self.reference_id,
                           "pairs": dataset.fingerprint(), "n_pairs": len(dataset),
                           "dtype": str(self.dtype)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def load(self, dataset: PreferenceDataset) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(sums, counts)`` from the files when they are intact and their key matches, else
        None (a damaged cache is logged, not raised)."""
        if not self.key_path.is_file() or not self.tensor_path.is_file():
            return None
        from safetensors.torch import load_file

        try:
            meta = json.loads(self.key_path.read_text(encoding="utf-8"))
            if meta.get("key") != self.key(dataset):
                log.info("reference log-probabilities in %s are for another reference, data or "
                         "dtype: recomputing", self.directory)
                return None
            if sha256_file(self.tensor_path) != meta.get("sha256"):
                raise ValueError("its contents changed since it was written")
            tensors = load_file(str(self.tensor_path))
            sums, counts = tensors["sums"], tensors["counts"]
            n = len(dataset)
            if (tuple(sums.shape) != (n, 2) or tuple(counts.shape) != (n, 2)
                    or sums.dtype != torch.float32 or not torch.isfinite(sums).all()
                    or not torch.equal(counts, dataset.response_counts())):
                raise ValueError("its tensors do not fit the pairs")
        except Exception as e:  # any damage means: do not trust it, compute again
            log.warning("ignoring the damaged reference cache %s (%s: %s); recomputing",
                        self.tensor_path, type(e).__name__, e)
            return None
        return sums, counts

    def save(self, dataset: PreferenceDataset, sums: torch.Tensor, counts: torch.Tensor) -> None:
        """Write ``sums`` / ``counts`` ``[N, 2]`` under ``dataset``'s key (atomically)."""
        from safetensors.torch import save_file

        key = self.key(dataset)
        self.directory.mkdir(parents=True, exist_ok=True)
        with atomic_path(self.tensor_path) as tmp:
            save_file({"sums": sums.float().contiguous().cpu(),
                       "counts": counts.long().contiguous().cpu()}, str(tmp),
                      metadata={"key": key})
        atomic_write_json(self.key_path, {
            "key": key, "sha256": sha256_file(self.tensor_path), "reference": self.reference_id,
            "pairs": len(dataset), "data": dataset.fingerprint(), "dtype": str(self.dtype),
            "version": _CACHE_VERSION})

    def get(self, dataset: PreferenceDataset,
            reference: torch.nn.Module | Callable[[], torch.nn.Module], *, batch_size: int,
            device: str | torch.device = "cpu", attach: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached numbers when valid, else computed with ``reference`` and saved.

        Args:
            dataset: the pairs.
            reference: the reference model (on ``device``), or better a function that builds
                it: it is then called only on a cache miss, the model moved to ``device``, and
                dropped (memory released) right after computing.
            batch_size, device: as for :func:`reference_sums_and_counts`.
            attach: also :meth:`PreferenceDataset.attach_reference` them.
        Returns:
            ``(sums [N, 2] fp32, counts [N, 2] long)``.
        """
        cached = self.load(dataset)
        if cached is None:
            device = torch.device(device)
            built = not isinstance(reference, torch.nn.Module)
            model = reference().to(device) if built else reference
            cached = reference_sums_and_counts(model, dataset, batch_size=batch_size,
                                               device=device, dtype=self.dtype)
            del model
            if built:
                _free(device)
            if distributed.is_main():  # under torchrun every rank computes; one writes
                self.save(dataset, *cached)
        if attach:
            dataset.attach_reference(*cached)
        return cached


# ---------------------------------------------------------------------------------------------
# The objective


class DPOObjective(Objective):
    """The DPO family on preference batches (``[B, 2, T]``, from :class:`PreferenceLoader`).

    A micro-batch of ``b`` pairs runs as ONE forward of ``[2b, T]`` (chosen rows then rejected
    rows, TRL's ``concatenated_forward``); the policy's summed response log-probabilities go to
    :func:`~olmoflow.posttrain.losses.dpo_loss` with the batch's cached ``ref_logps`` (the
    length-normalised types divide by the response-token counts there). Each micro-batch loss is
    the SUM of its per-pair losses divided by the number of pairs in the global batch (divided by
    the world size under DDP/FSDP, as :class:`~olmoflow.train.objectives.LMObjective`), so
    accumulation gives the gradient of the global mean.

    Args:
        loss_type: one of :data:`~olmoflow.posttrain.losses.DPO_LOSS_TYPES`: ``"sigmoid"``
            (Rafailov et al. 2023), ``"length_normalized"`` (OLMo 2/3, Tülu 3's ``dpo_norm``),
            ``"simpo"`` (Meng et al. 2024; needs no reference).
        beta: inverse temperature (> 0).
        label_smoothing: conservative DPO's flip probability in ``[0, 0.5)``.
        simpo_gamma: SimPO's target reward margin (TRL's ``simpo_gamma``).

    Metrics (TRL's names, means over the global batch's pairs): ``loss``, ``rewards/chosen``,
    ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
    ``logps/rejected``.

    Raises:
        OlmoflowError: an unknown ``loss_type`` (naming the closest), ``beta <= 0``,
            ``label_smoothing`` outside ``[0, 0.5)``.
    """

    name = "dpo"
    METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected")

    def __init__(self, loss_type: str = "sigmoid", beta: float = 0.1,
                 label_smoothing: float = 0.0, simpo_gamma: float = 0.5):
        if loss_type not in DPO_LOSS_TYPES:
            raise unknown_name_error("DPO loss_type", loss_type, DPO_LOSS_TYPES)
        if not (beta > 0 and math.isfinite(beta)):
            raise OlmoflowError(f"DPO beta must be > 0, got {beta}")
        if not 0.0 <= label_smoothing < 0.5:
            raise OlmoflowError(f"DPO label_smoothing must be in [0, 0.5), got {label_smoothing}")
        self.loss_type, self.beta = loss_type, float(beta)
        self.label_smoothing, self.simpo_gamma = float(label_smoothing), float(simpo_gamma)

    @property
    def needs_reference(self) -> bool:
        """Whether batches must carry ``ref_logps`` (all but SimPO)."""
        return self.loss_type != "simpo"

    def prepare(self, raw: Any) -> Batch:
        """``input_ids`` / ``labels [B, 2, T]``, ``lengths [B, 2]`` and (unless SimPO)
        ``ref_logps [B, 2]`` from a :class:`PreferenceBatch` or mapping; the batch dimension is
        pairs, nothing is flattened here.

        Raises:
            OlmoflowError: a missing field or shapes that are not ``[B, 2, T]`` / ``[B, 2]``.
        """
        get = raw.get if hasattr(raw, "get") else (lambda k: getattr(raw, k, None))
        ids, labels = get("input_ids"), get("labels")
        if ids is None or labels is None:
            raise OlmoflowError("a preference batch needs input_ids and labels [B, 2, T]")
        if ids.dim() != 3 or ids.shape[1] != 2 or labels.shape != ids.shape:
            raise OlmoflowError(f"a preference batch has input_ids and labels [B, 2, T], got "
                                f"{tuple(ids.shape)} and {tuple(labels.shape)}")
        lengths = get("lengths")
        if lengths is None:
            lengths = torch.full(ids.shape[:2], ids.shape[2], dtype=torch.long)
        batch = {"input_ids": ids, "labels": labels, "lengths": lengths}
        if self.needs_reference:
            ref = get("ref_logps")
            if ref is None:
                raise OlmoflowError(f"DPO loss_type '{self.loss_type}' needs the reference "
                                    "log-probabilities in every batch: compute them with "
                                    "ReferenceCache(...).get(dataset, reference, ...) before "
                                    "training (or use loss_type 'simpo')")
            if tuple(ref.shape) != tuple(ids.shape[:2]):
                raise OlmoflowError(f"ref_logps must be [B, 2] = {tuple(ids.shape[:2])}, got "
                                    f"{tuple(ref.shape)}")
            batch["ref_logps"] = ref
        return batch

    def num_tokens(self, batch: Batch) -> int:
        """Real (unpadded) input tokens of both sequences of every pair."""
        return int(batch["lengths"].sum())

    def normalizer(self, batch: Batch, dist: distributed.DistInfo) -> float:
        """Pairs in the global batch (divided by the world size under DDP/FSDP)."""
        pairs = distributed.all_reduce_sum(int(batch["input_ids"].shape[0]), dist)
        return pairs / dist.world_size if dist.world_size > 1 else pairs

    def loss(self, model: torch.nn.Module, micro_batch: Batch,
             normalizer: float) -> tuple[torch.Tensor, dict[str, float]]:
        """Summed per-pair loss of the micro-batch / ``normalizer``; metrics summed over its
        pairs (``pairs`` counts them) so :meth:`step_metrics` can average."""
        b = micro_batch["input_ids"].shape[0]
        # Unpadded to this micro-batch's own longest sequence: less work, same numbers.
        T = int(micro_batch["lengths"].max())
        logps, counts = _pair_logps(model, micro_batch["input_ids"][..., :T],
                                    micro_batch["labels"][..., :T])
        ref = micro_batch.get("ref_logps")
        out = dpo_loss(logps[:, 0], logps[:, 1],
                       None if ref is None or not self.needs_reference else ref[:, 0],
                       None if ref is None or not self.needs_reference else ref[:, 1],
                       beta=self.beta, loss_type=self.loss_type,
                       label_smoothing=self.label_smoothing, gamma=self.simpo_gamma,
                       chosen_n_tokens=counts[:, 0], rejected_n_tokens=counts[:, 1])
        loss = out.losses.sum() / normalizer
        stats = torch.stack([out.losses.detach().sum()]
                            + [out.stats[k] * b for k in self.METRICS]).tolist()  # one sync
        metrics = {"dpo_loss_sum": stats[0], "pairs": float(b)}
        metrics.update(zip(self.METRICS, stats[1:], strict=True))
        return loss, metrics

    def step_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        pairs = max(totals.get("pairs", 0.0), 1e-12)
        out = {"loss": totals["dpo_loss_sum"] / pairs}
        out.update({k: totals[k] / pairs for k in self.METRICS})
        return out

    def state_dict(self) -> dict[str, Any]:
        """The loss settings (plain data), so a resume under other settings is noticed."""
        return {"loss_type": self.loss_type, "beta": self.beta,
                "label_smoothing": self.label_smoothing, "simpo_gamma": self.simpo_gamma}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Warn when the checkpoint was trained under other loss settings (this run's win)."""
        mine = self.state_dict()
        changed = {k: (state[k], mine[k]) for k in mine if k in state and state[k] != mine[k]}
        if changed:
            log.warning("resuming DPO with changed settings (checkpoint -> now): %s", changed)
