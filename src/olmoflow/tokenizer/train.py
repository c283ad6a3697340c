"""The one tokenizer trainer: a tokenizer of ``tokenizer.implementation`` (byte-level BPE by
default) trained on texts. The main flow's ``train-tokenizer`` stage and the data engine's
tokenize step (when it is given no tokenizer) both call :func:`train_tokenizer`, each with the
texts of its documents (read by the caller: the tokenizer knows no document format)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from olmoflow.artifacts import StageResult, data_files
from olmoflow.errors import OlmoflowError
from olmoflow.tokenizer import BPETokenizer, tokenizer_class
from olmoflow.tokenizer.config import TokenizerConfig

# Compression is measured on the first documents up to this many bytes of text (in-sample: these
# documents were also trained on; it is a sanity number, not an evaluation).
SAMPLE_BYTES = 1 << 20


def train_tokenizer(
    cfg: TokenizerConfig, texts: Iterable[str], out_dir: Path, progress: bool = True, *,
    files: Sequence[Path] = (),
) -> StageResult:
    """Train a tokenizer of ``cfg.implementation`` on ``texts``; save it in ``out_dir``.

    Args:
        cfg: implementation, vocab size (special tokens included), min pair frequency, EOS and
            pad tokens, and the BPE's pre-tokenizer split.
        texts: the documents' texts, one per document, read once in order.
        out_dir: receives ``tokenizer.json``, ``tokenizer_config.json`` and
            ``special_tokens_map.json``.
        progress: show the trainer's progress bar.
        files: the files the texts were read from: the result's inputs, and what a user's
            tokenizer (not a :class:`BPETokenizer`) learns from through its ``train(files)``
            hook.

    Returns:
        StageResult with counts ``vocab_size`` (actual; may be below ``cfg.vocab_size`` on a tiny
        corpus), ``documents``, ``bytes`` (UTF-8 bytes of text trained on), ``sample_bytes``,
        ``sample_tokens`` and ``bytes_per_token`` (compression on the sample).

    Raises:
        OlmoflowError: no texts, or a vocab size too small for byte-level BPE.
    """
    paths = [Path(p) for p in files]
    out_dir = Path(out_dir)
    stats = {"documents": 0, "bytes": 0}
    sample: list[str] = []
    sample_bytes = 0

    def counted() -> Iterator[str]:
        nonlocal sample_bytes
        for text in texts:
            n = len(text.encode("utf-8"))
            stats["documents"] += 1
            stats["bytes"] += n
            if sample_bytes < SAMPLE_BYTES:
                sample.append(text)
                sample_bytes += n
            yield text

    cls = tokenizer_class(cfg.implementation)
    if issubclass(cls, BPETokenizer):
        tok = cls(eos_token=cfg.eos_token, pad_token=cfg.pad_token,
                  pre_tokenizer=cfg.pre_tokenizer)
        tok.train_from_texts(
            counted(), vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
            progress=progress,
        )
    else:  # a user's tokenizer learns through its _train(files) hook, from the documents files
        for _ in counted():
            pass  # counts and the compression sample
        tok = cls(eos_token=cfg.eos_token, pad_token=cfg.pad_token)
        if stats["documents"]:
            tok.train([str(p) for p in paths])
    if stats["documents"] == 0:
        where = ", ".join(str(p) for p in paths[:3]) + (", ..." if len(paths) > 3 else "")
        raise OlmoflowError("no documents to train the tokenizer on"
                            + (f" in {where}" if where else ""))
    outputs = tok.save(out_dir)
    sample_tokens = sum(len(ids) for ids in tok.encode_batch(sample))
    counts = {
        "vocab_size": tok.vocab_size,
        **stats,
        "sample_bytes": sample_bytes,
        "sample_tokens": sample_tokens,
        "bytes_per_token": round(sample_bytes / max(sample_tokens, 1), 4),
    }
    inputs = [f for p in paths for f in data_files(p)]
    return StageResult(inputs=inputs, outputs=outputs, counts=counts)
