"""Which data trained which step: the documents of one pretraining step's global batch.

OLMo lets users look up the batch of any training step (its data order is a function of the seed
and the token files). Here the batch of step ``N`` (counted from 1, as the training log counts) is
found from the run's own records: the newest kept checkpoint before step ``N`` stores the data
loader's cursor after its step (``trainer_state.pt``: epoch and position in that epoch's seeded
permutation); the loader, rebuilt over the same token files as the ``pretrain`` stage builds it,
restores that cursor and advances to step ``N``'s batch. Without an earlier checkpoint the cursor
starts at the beginning. Each instance of the batch is then mapped back, through the token
files' ``.csv.gz`` document indexes, to the documents it holds: their ids, sources, which of their
tokens, where in the instance, and the start of their text.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from olmoflow.errors import OlmoflowError


@dataclass(frozen=True)
class DocumentSpan:
    """One document (or a piece of one) inside one instance of a batch.

    Attributes:
        row: the instance's row in the global batch (0-based).
        instance: the instance's index in the dataset.
        doc_id: the document's id in its source (the token index's ``id`` column).
        source: the source it came from (the index's ``source`` column).
        doc_start, doc_end: the span of the document's own tokens in this instance, ``[start,
            end)``, counted from the document's first token.
        doc_tokens: the document's length in tokens.
        position: where the span starts in the instance (token offset, 0-based).
        text: the span's first characters, decoded.
    """

    row: int
    instance: int
    doc_id: str
    source: str
    doc_start: int
    doc_end: int
    doc_tokens: int
    position: int
    text: str


class _Documents:
    """The documents of a list of token files, as global offsets into their concatenation, with
    their ids and sources (the ``.csv.gz`` indexes, in the order :func:`open_documents` reads)."""

    def __init__(self, paths: list[Path], dtype: np.dtype):
        from olmoflow.data.tokenize import read_index
        from olmoflow.train.loader import index_path, open_documents

        self.arrays, self.starts, self.ends = open_documents(paths, dtype)
        # open_documents checked that each index tiles its array, so an empty array has no rows
        # and the rows line up with the documents it returned
        rows = [r for p in paths for r in read_index(index_path(p))]
        self.ids = [r[2] for r in rows]
        self.sources = [r[3] for r in rows]

    def overlapping(self, start: int, end: int) -> list[int]:
        """Documents holding any of the global token offsets ``[start, end)``."""
        first = int(np.searchsorted(self.ends, start, side="right"))
        last = int(np.searchsorted(self.starts, end, side="left"))
        return list(range(first, last))


def _advance(loader, batches: int) -> list[int]:
    """Move ``loader``'s cursor over ``batches`` batches and return the next batch's indices."""
    for _ in range(batches):
        loader.next_indices()
    return loader.next_indices()


def _anchor(save_folder: Path, step: int) -> tuple[int, dict[str, Any] | None]:
    """``(S, loader_state)`` of the newest checkpoint still on disk with ``S < step``; ``(0,
    None)`` when there is none (the cursor then starts at the beginning)."""
    from olmoflow.model.checkpoint_names import list_checkpoints, parse_checkpoint_name
    from olmoflow.train.checkpoint import read_trainer_state

    before = [p for p in list_checkpoints(save_folder) if parse_checkpoint_name(p.name) < step]
    if not before:
        return 0, None
    newest = before[-1]
    return parse_checkpoint_name(newest.name), read_trainer_state(newest)["data_loader"]


def trained_steps(save_folder: Path) -> int | None:
    """The last step the pretrain log records (``metrics.jsonl``), or None without a log."""
    import json

    log = save_folder / "metrics.jsonl"
    if not log.is_file():
        return None
    last = None
    for line in log.read_text(encoding="utf-8").splitlines():
        try:
            last = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return last


def step_batch(cfg, step: int, tok=None):
    """``(loader, indices)``: the pretrain data loader of run config ``cfg`` (its dataset built as
    the ``pretrain`` stage builds it) and the dataset indices of step ``step``'s global batch.
    ``tok`` is the run's tokenizer when the caller has it loaded already.

    Raises:
        OlmoflowError: ``step`` < 1 or past the steps the run trained; a checkpoint whose loader
            state does not fit the data (another seed, packing, sequence length or data).
    """
    from olmoflow.pipeline.stages.common import load_tokenizer, stage_dir
    from olmoflow.pipeline.stages.train import PRETRAIN, pretrain_loader

    if step < 1:
        raise OlmoflowError(f"--step must be >= 1 (steps count from 1), got {step}")
    folder = stage_dir(cfg, PRETRAIN.name)
    done = trained_steps(folder)
    if done is not None and step > done:
        raise OlmoflowError(f"the run trained {done} steps ({folder / 'metrics.jsonl'}); "
                            f"step {step} did not happen")
    _, loader, _ = pretrain_loader(cfg, tok if tok is not None else load_tokenizer(cfg))
    anchor, state = _anchor(folder, step)
    if state is not None:
        loader.load_state_dict(state)
    return loader, _advance(loader, step - 1 - anchor)


def step_documents(cfg, step: int, *, chars: int = 60) -> list[DocumentSpan]:
    """The documents of step ``step``'s global batch, row by row (see the module docstring).

    ``chars`` caps each span's text (0: no text).

    Raises:
        OlmoflowError: as :func:`step_batch`; missing or damaged token indexes.
    """
    from olmoflow.pipeline.stages.common import load_tokenizer, token_split
    from olmoflow.train.loader import PackedDataset

    tok = load_tokenizer(cfg)
    loader, indices = step_batch(cfg, step, tok)
    dataset = loader.dataset
    docs = _Documents(*token_split(cfg, "train"))
    L = dataset.sequence_length

    def span(row: int, inst: int, d: int, lo: int, hi: int, at: int) -> DocumentSpan:
        s = int(docs.starts[d])
        text = ""
        if chars:
            ids = dataset._slice(lo, min(hi, lo + chars * 4)).tolist()  # enough for chars
            text = tok.decode(ids)[:chars]
        return DocumentSpan(row, inst, docs.ids[d], docs.sources[d], lo - s, hi - s,
                            int(docs.ends[d]) - s, at, text)

    out: list[DocumentSpan] = []
    for row, inst in enumerate(indices):
        if isinstance(dataset, PackedDataset):
            at = 0
            for p in dataset._pieces(inst).tolist():
                lo, hi = int(dataset.piece_starts[p]), int(dataset.piece_ends[p])
                d = int(dataset.piece_document[p])
                out.append(span(row, inst, d, lo, hi, at))
                at += hi - lo
        else:
            start, end = inst * L, inst * L + L + 1
            for d in docs.overlapping(start, end):
                lo, hi = max(start, int(docs.starts[d])), min(end, int(docs.ends[d]))
                out.append(span(row, inst, d, lo, hi, lo - start))
    return out


def format_spans(spans: list[DocumentSpan]) -> str:
    """A table of the spans: row, instance, document id, source, tokens, position, text."""
    head = f"{'row':>4} {'instance':>8} {'position':>8}  {'tokens':<22} {'source':<10} id / text"
    lines = [head, "-" * len(head)]
    for s in spans:
        toks = f"[{s.doc_start}, {s.doc_end}) of {s.doc_tokens}"
        lines.append(f"{s.row:>4} {s.instance:>8} {s.position:>8}  {toks:<22} {s.source:<10} "
                     f"{s.doc_id}  {s.text!r}")
    return "\n".join(lines)


def spans_json(spans: list[DocumentSpan]) -> list[dict[str, Any]]:
    """The spans as plain dicts (``--json``)."""
    return [asdict(s) for s in spans]
