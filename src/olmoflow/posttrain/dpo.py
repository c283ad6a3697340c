"""Direct preference optimisation on the shared :class:`~olmoflow.train.trainer.Trainer`.

The pieces, in the order a DPO run uses them:

1. :func:`build_dpo_data` reads preference pairs (any format of :mod:`olmoflow.posttrain.data`)
   into a :class:`PreferenceDataset`: per pair, the sequences prompt + chosen and prompt +
   rejected with next-token labels on the response tokens only.
2. :class:`~olmoflow.posttrain.reference.ReferenceCache` computes the frozen reference model's
   summed response log-probabilities once, writes them with the run
   (``reference_logps.safetensors``) and
   reuses them while the reference weights, the pairs and the dtype are unchanged; the reference
   model is then freed, so training holds one model, as open-instruct's DPO does with its cached
   reference log-probs.
3. :class:`PreferenceLoader` yields global batches of pairs in a seeded order per epoch, each
   carrying its resume state, as :class:`olmoflow.train.loader.DataLoader` does for pretraining.
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

import hashlib
import logging
import math
from collections.abc import Iterable, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch

from olmoflow.errors import OlmoflowError, unknown_name_error
from olmoflow.model.olmo import IGNORE_INDEX
from olmoflow.posttrain.data import (
    DataStats,
    PreferenceExample,
    nothing_left,
    preference_examples,
    split_sources,
)
from olmoflow.posttrain.losses import DPO_LOSS_TYPES, dpo_loss
from olmoflow.posttrain.reference import (  # noqa: F401  (the cache is part of dpo's API)
    REFERENCE_FILE,
    REFERENCE_KEY_FILE,
    ReferenceCache,
    pair_logps,
    reference_logps,
    reference_sums_and_counts,
)
from olmoflow.tokenizer.base import BaseTokenizer
from olmoflow.tokenizer.chat import ChatTemplate
from olmoflow.train import distributed
from olmoflow.train.loader import ShuffledEpochs
from olmoflow.train.objectives import Batch, Objective

log = logging.getLogger(__name__)


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


class PreferenceLoader(ShuffledEpochs):
    """Global batches of ``batch_size`` pairs in a seeded order per epoch; exactly resumable.

    The order of epoch ``e`` is ``np.random.Generator(np.random.PCG64([seed, e]))``'s
    permutation of the pairs (as :class:`olmoflow.train.loader.DataLoader`); an epoch ends when
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
        idx = self.next_indices()
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
        tokenizer: prepared with :func:`~olmoflow.tokenizer.chat.add_chat_template`;
            its ``pad_token_id`` pads batches.
        max_length: the most tokens of prompt + the longer response (None: no limit).
        format, on_too_long, strict: as for :func:`~olmoflow.posttrain.data.preference_examples`.
        limit: keep at most this many pairs (the first ones; None: all).

    Returns:
        ``(dataset, stats)``; ``stats`` counts what was read, skipped, truncated and dropped.
    Raises:
        OlmoflowError: bad options; under ``strict`` bad input naming ``file:line``; a data file
            (or the records) giving no pair to train on, naming it with its counts.
    """
    if limit is not None and limit < 1:
        raise OlmoflowError(f"limit must be >= 1 (or None for every pair), got {limit}")
    stats = DataStats()
    kept: list[PreferenceExample] = []
    for name, source in split_sources(records):
        # Each file on its own: one that gives no pair to train on is named.
        own = DataStats()
        examples = preference_examples(source, template, tokenizer, max_length,
                                       on_too_long=on_too_long, format=format, strict=strict,
                                       stats=own)
        got = list(islice(examples, None if limit is None else limit - len(kept)))
        stats.add(own)
        if not got:
            raise nothing_left(name, "preference pairs", own)
        kept += got
        if limit is not None and len(kept) >= limit:
            break
    return PreferenceDataset(kept, max_length, tokenizer.pad_token_id), stats


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
        logps, counts = pair_logps(model, micro_batch["input_ids"][..., :T],
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
