"""The frozen reference model's log-probabilities for DPO, computed once and cached with the run.

:class:`ReferenceCache` writes them as ``reference_logps.safetensors`` (read back with
``safetensors`` only: no pickle) beside a small JSON key (the sha256 of the reference's identity,
the pairs' token ids and masks, the dtype), reuses them while the key matches and recomputes them
otherwise, or when the files are damaged. The reference model is freed afterwards, so training
holds one model, as open-instruct's DPO does with its cached reference log-probs.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from olmoflow.artifacts import atomic_path, atomic_write_json, sha256_file
from olmoflow.errors import OlmoflowError
from olmoflow.posttrain.losses import sequence_logps
from olmoflow.train import distributed

log = logging.getLogger(__name__)


class ReferencePairs(Protocol):
    """What the reference pass needs of the tokenized pairs (it is
    :class:`olmoflow.posttrain.dpo.PreferenceDataset`, which imports this module: stated here as
    a protocol, so the two modules do not need each other)."""

    def __len__(self) -> int: ...

    def lengths(self) -> np.ndarray:
        """``[N, 2]`` tokens of each pair's two sequences."""
        ...

    def response_counts(self) -> torch.Tensor:
        """``[N, 2]`` trained response tokens of each pair's chosen and rejected."""
        ...

    def fingerprint(self) -> str:
        """sha256 (hex) of the pairs' token ids and target masks."""
        ...

    def collate(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The pairs ``indices`` as a ``[b, 2, T]`` batch."""
        ...

    def attach_reference(self, sums: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """Keep the reference's ``[N, 2]`` sums (and counts) for the batches."""
        ...

REFERENCE_FILE = "reference_logps.safetensors"
REFERENCE_KEY_FILE = "reference_logps.json"
_CACHE_VERSION = 1  # bump when what the cached numbers mean changes




def _concat_pairs(x: torch.Tensor) -> torch.Tensor:
    """``[b, 2, ...]`` -> ``[2b, ...]``: all chosen rows, then all rejected rows (TRL's
    ``concatenated_inputs`` order)."""
    return torch.cat([x[:, 0], x[:, 1]], dim=0)


def pair_logps(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over a ``[b, 2, T]`` batch; ``(sums [b, 2] fp32, counts [b, 2])``."""
    b = input_ids.shape[0]
    logits = model(_concat_pairs(input_ids)).logits
    sums, counts = sequence_logps(logits, _concat_pairs(labels))
    return torch.stack([sums[:b], sums[b:]], 1), torch.stack([counts[:b], counts[b:]], 1)


def reference_sums_and_counts(model: torch.nn.Module, dataset: ReferencePairs, *,
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
                        s, c = pair_logps(model, ids, labels)
                else:
                    s, c = pair_logps(model, ids, labels)
                sums[idx], counts[idx] = s.float().cpu(), c.cpu()
    finally:
        for p, f in zip(model.parameters(), flags, strict=True):
            p.requires_grad_(f)
        model.train(was_training)
    return sums, counts


def reference_logps(model: torch.nn.Module, dataset: ReferencePairs, *, batch_size: int,
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

    def key(self, dataset: ReferencePairs) -> str:
        """The cache key of ``dataset`` under this reference and dtype (hex sha256)."""
        blob = json.dumps({"version": _CACHE_VERSION, "reference": self.reference_id,
                           "pairs": dataset.fingerprint(), "n_pairs": len(dataset),
                           "dtype": str(self.dtype)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def load(self, dataset: ReferencePairs) -> tuple[torch.Tensor, torch.Tensor] | None:
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

    def save(self, dataset: ReferencePairs, sums: torch.Tensor, counts: torch.Tensor) -> None:
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

    def get(self, dataset: ReferencePairs,
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
            attach: also :meth:`ReferencePairs.attach_reference` them.
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


