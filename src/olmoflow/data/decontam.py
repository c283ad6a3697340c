"""Decontamination: flag training documents that share a long n-gram with an evaluation set.

The method of GPT-3 (Brown et al. 2020, appendix C) and OLMo/Dolma's decontamination: text is
normalized to lowercased ``\\w+`` words (punctuation and markup such as WikiText's ``@-@`` drop
out), and a document is contaminated by an eval set when any run of ``ngram`` (default 13)
consecutive words also occurs in one of that set's texts.

The eval side is indexed once: every n-gram of every eval text becomes a 64-bit hash; the index is
the sorted array of distinct hashes plus, per hash, a bitmask of the eval sets it occurs in
(16 bytes per distinct n-gram: the seven built-in sets make 1.57 M n-grams, 25 MB). It is saved
to ``DIR/work/decontam/index.npz`` and reused while the eval files and settings are unchanged.
Documents are matched by ``np.searchsorted`` on their n-gram hashes, one shard job per shard, and
the attribute set ``decontam`` is written line-aligned with each shard:

- ``decontam__<eval set>``: spans ``[start, end, 1.0]`` over the matching words (merged);
- ``decontam__contaminated``: document-level, ``[[0, len, 1.0]]`` if any set matched, else 0.0.

``action: drop`` makes :func:`mixer_rules` exclude contaminated documents; ``action: tag`` only
records them. Eval texts shorter than ``ngram`` words (most answer choices) cannot match alone;
each item is also indexed as question + gold answer so the pair is caught.

Built-in eval sets (files under ``eval_dir``, the layout of ``../shared/data``): ``arc``
(ARC-Easy/Challenge dev+test), ``hellaswag`` (validation), ``piqa`` (dev), ``boolq`` (dev),
``openbookqa`` (dev+test), ``gsm8k`` (test), ``wikitext`` (WikiText-2 raw test). Others are
given as ``files: {name: {path: "x/*.jsonl", fields: [question, answer.text]}}`` (JSONL; fields
are dotted paths to strings or lists of strings) or ``{path: "x.txt"}`` (one text per line).
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from olmoflow.artifacts import atomic_open, atomic_write_json, sha256_file, sha256_json
from olmoflow.config import ConfigValueError, as_section, check_int64
from olmoflow.data.ngrams import (
    WORD_RE,
    ngram_hashes,
    ngram_hashes_many,
    unique_sorted,
    word_hashes,
    words,
)
from olmoflow.data.shards import (
    WORK_DIR,
    RunJobs,
    doc_level,
    flag_totals,
    input_signature,
    read_records,
    run_global_step,
    text_bytes,
    write_jsonl_gz,
)
from olmoflow.errors import OlmoflowError, unknown_name_error

ATTRIBUTE_SET = "decontam"
ACTIONS = ("drop", "tag")
MAX_SETS = 64  # one bit each in the index's uint64 masks

# ---------------------------------------------------------------------------------------------
# Eval set readers: each yields, per item, the list of texts to index.


def _jsonl(path: Path) -> Iterator[dict[str, Any]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _arc(root: Path) -> Iterator[list[str]]:
    for name in ("ARC-Easy-Dev", "ARC-Easy-Test", "ARC-Challenge-Dev", "ARC-Challenge-Test"):
        for obj in _jsonl(root / "arc" / f"{name}.jsonl"):
            q = obj["question"]
            choices = {c["label"]: c["text"] for c in q["choices"]}
            gold = choices.get(obj.get("answerKey"), "")
            yield [q["stem"], f"{q['stem']} {gold}", *choices.values()]


def _hellaswag(root: Path) -> Iterator[list[str]]:
    # llama.cpp text format: context, gold label, then the four endings; six lines per item.
    with gzip.open(root / "hellaswag" / "hellaswag_val_full.txt.gz", "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    for i in range(0, len(lines) - 5, 6):
        ctx, label, endings = lines[i], lines[i + 1], lines[i + 2: i + 6]
        gold = endings[int(label)] if label.strip().isdigit() and int(label) < 4 else ""
        yield [ctx, f"{ctx} {gold}", *endings]


def _piqa(root: Path) -> Iterator[list[str]]:
    labels = (root / "piqa" / "valid-labels.lst").read_text().split()
    for obj, label in zip(_jsonl(root / "piqa" / "valid.jsonl"), labels):
        gold = obj["sol2"] if label.strip() == "1" else obj["sol1"]
        yield [obj["goal"], f"{obj['goal']} {gold}", obj["sol1"], obj["sol2"]]


def _boolq(root: Path) -> Iterator[list[str]]:
    for obj in _jsonl(root / "boolq" / "val.jsonl"):
        yield [obj["question"], obj["passage"]]


_OBQA_CHOICE = re.compile(r"\(([A-D])\)\s*(.*?)\s*(?=\([A-D]\)|$)")


def _openbookqa(root: Path) -> Iterator[list[str]]:
    for name in ("Main-dev.tsv", "Main-test.tsv"):
        rows = (root / "openbookqa" / name).read_text(encoding="utf-8").splitlines()[1:]
        for row in rows:
            cols = row.split("\t")
            if len(cols) < 5:
                continue
            stem, choices = cols[1], dict(_OBQA_CHOICE.findall(cols[2]))
            gold = choices.get(cols[4].strip(), "")
            yield [stem, f"{stem} {gold}", *choices.values()]


_CALC = re.compile(r"<<[^>]*>>")


def _gsm8k(root: Path) -> Iterator[list[str]]:
    for obj in _jsonl(root / "gsm8k" / "test.jsonl"):
        yield [obj["question"], _CALC.sub("", obj["answer"])]


def _wikitext(root: Path) -> Iterator[list[str]]:
    text = (root / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    for line in text.split("\n"):
        if line.strip() and not line.strip().startswith("="):  # headings are too generic
            yield [line]


BUILTIN_EVALS: dict[str, Callable[[Path], Iterator[list[str]]]] = {
    "arc": _arc, "hellaswag": _hellaswag, "piqa": _piqa, "boolq": _boolq,
    "openbookqa": _openbookqa, "gsm8k": _gsm8k, "wikitext": _wikitext,
}


def _field(obj: Any, path: str) -> list[str]:
    for part in path.split("."):
        if isinstance(obj, list):
            return [t for o in obj for t in _field(o, part)]
        obj = obj.get(part) if isinstance(obj, dict) else None
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, list):
        return [o for o in obj if isinstance(o, str)]
    return []


def _custom(spec: dict[str, Any], name: str) -> Iterator[list[str]]:
    paths = sorted(glob.glob(str(spec["path"])))
    if not paths:
        raise OlmoflowError(f"decontam.files.{name}.path: no file matches '{spec['path']}'")
    for p in map(Path, paths):
        if p.name.endswith((".jsonl", ".jsonl.gz", ".json.gz")):
            fields = spec.get("fields") or ["text"]
            for obj in _jsonl(p):
                yield [t for f in fields for t in _field(obj, f)]
        else:
            for line in p.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    yield [line]


# ---------------------------------------------------------------------------------------------
# Config and index


@dataclasses.dataclass
class DecontamConfig:
    """The data engine's ``decontaminate`` section: ``ngram`` words per overlap; built-in
    ``evals`` read from ``eval_dir``; extra ``files``; ``action`` drop (the mixer excludes
    contaminated documents) or tag (recorded only).

    Raises:
        ConfigValueError: ``ngram`` below 1, an unknown action or eval set (naming the closest),
            a file set without ``path`` or with a taken name, no eval set, or more than 64.
    """

    ngram: int = 13
    evals: list[str] = dataclasses.field(default_factory=lambda: list(BUILTIN_EVALS))
    eval_dir: str = "../shared/data"
    files: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    action: str = "drop"

    def __post_init__(self) -> None:
        check_int64(self)
        if self.ngram < 1:
            raise ConfigValueError("ngram", f"must be a positive integer, got {self.ngram!r}")
        if self.action not in ACTIONS:
            raise ConfigValueError("action", unknown_name_error("action", self.action,
                                                                ACTIONS).args[0])
        for name in self.evals:
            if name not in BUILTIN_EVALS:
                raise ConfigValueError("evals", unknown_name_error("eval set", name,
                                                                   BUILTIN_EVALS).args[0])
        for name, spec in self.files.items():
            if not isinstance(spec, dict) or "path" not in spec:
                raise ConfigValueError(f"files.{name}", "needs a 'path' (and 'fields' for JSONL)")
            if name in self.evals or not re.fullmatch(r"\w+", name):
                raise ConfigValueError("files", f"eval set name '{name}' is taken or not a word")
        if not self.set_names():
            raise ConfigValueError("", "no eval sets; list some in 'evals' or 'files'")
        if len(self.set_names()) > MAX_SETS:
            raise ConfigValueError("", f"at most {MAX_SETS} eval sets")

    def set_names(self) -> list[str]:
        return [*self.evals, *self.files]

    def attributes(self) -> list[str]:
        """The attribute names written, in a fixed order."""
        return [f"{ATTRIBUTE_SET}__{n}" for n in self.set_names()] + [
            f"{ATTRIBUTE_SET}__contaminated"]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def eval_items(self, name: str) -> Iterator[list[str]]:
        """The texts of each item of eval set ``name``.

        Raises:
            OlmoflowError: a built-in set's files are missing under ``eval_dir``.
        """
        if name in self.files:
            yield from _custom(self.files[name], name)
            return
        try:
            yield from BUILTIN_EVALS[name](Path(self.eval_dir))
        except FileNotFoundError as e:
            raise OlmoflowError(f"eval set '{name}': no such file '{e.filename}' (set "
                                "decontaminate.eval_dir to the folder that holds the eval data; "
                                f"it is '{self.eval_dir}', relative to the current directory "
                                "unless absolute)") from None

    def eval_files(self) -> list[str]:
        root = Path(self.eval_dir)
        subdirs = {"wikitext": "wikitext-2-raw"}
        files = [str(p) for n in self.evals for p in sorted((root / subdirs.get(n, n)).glob("*"))]
        return files + sorted(p for s in self.files.values() for p in glob.glob(str(s["path"])))


def mixer_rules(cfg: DecontamConfig | dict[str, Any]) -> dict[str, Any]:
    """The mixer settings for ``cfg.action``: with ``drop``, exclude contaminated documents."""
    cfg = as_section(DecontamConfig, cfg, "decontaminate.")
    exclude = ([{"attribute": f"{ATTRIBUTE_SET}__contaminated", "op": "==", "value": 1}]
               if cfg.action == "drop" else [])
    return {"attributes": [ATTRIBUTE_SET], "exclude": exclude, "remove_spans": []}


@dataclasses.dataclass
class EvalIndex:
    """Sorted distinct n-gram hashes ``(m,)`` uint64 and their eval-set bitmasks ``(m,)`` uint64."""

    hashes: np.ndarray
    masks: np.ndarray
    names: list[str]
    ngram: int

    def save(self, path: str | os.PathLike) -> None:
        with atomic_open(path, "wb") as f:
            np.savez(f, hashes=self.hashes, masks=self.masks, names=np.array(self.names),
                     ngram=np.array(self.ngram))

    @classmethod
    def load(cls, path: str | os.PathLike) -> EvalIndex:
        z = np.load(path)
        return cls(z["hashes"], z["masks"], [str(n) for n in z["names"]], int(z["ngram"]))

    def match(self, hashes: np.ndarray) -> np.ndarray:
        """The bitmask of eval sets for each n-gram hash of ``hashes`` (0 = no match)."""
        if not len(self.hashes) or not len(hashes):
            return np.zeros(len(hashes), dtype=np.uint64)
        idx = np.minimum(np.searchsorted(self.hashes, hashes), len(self.hashes) - 1)
        return np.where(self.hashes[idx] == hashes, self.masks[idx], np.uint64(0))


def build_index(cfg: DecontamConfig | dict[str, Any]) -> tuple[EvalIndex, dict[str, Any]]:
    """Index every n-gram of the eval sets of ``cfg``; return it with per-set counts
    (``{set: {"items", "texts", "ngrams"}}``).

    Raises:
        OlmoflowError: an eval set's files are missing or unreadable.
    """
    cfg = as_section(DecontamConfig, cfg, "decontaminate.")
    cache: dict[str, int] = {}
    all_h, all_m, counts = [], [], {}
    for bit, name in enumerate(cfg.set_names()):
        n_items = 0
        token_lists: list[list[str]] = []
        try:
            for texts in cfg.eval_items(name):
                n_items += 1
                token_lists += [toks for toks in map(words, texts) if len(toks) >= cfg.ngram]
        except (ValueError, KeyError, IndexError, UnicodeDecodeError) as e:
            raise OlmoflowError(
                f"eval set '{name}': unreadable ({type(e).__name__}: {e})") from None
        h = unique_sorted(ngram_hashes_many(token_lists, cfg.ngram, cache))
        n_texts = len(token_lists)
        all_h.append(h)
        all_m.append(np.full(len(h), np.uint64(1) << np.uint64(bit), dtype=np.uint64))
        counts[name] = {"items": n_items, "texts": n_texts, "ngrams": int(len(h))}
    hashes = np.concatenate(all_h) if all_h else np.empty(0, np.uint64)
    masks = np.concatenate(all_m) if all_m else np.empty(0, np.uint64)
    order = np.argsort(hashes, kind="stable")
    hashes, masks = hashes[order], masks[order]
    start = np.flatnonzero(np.concatenate(([True], hashes[1:] != hashes[:-1]))) if len(hashes) \
        else np.empty(0, np.int64)
    uniq = hashes[start]
    merged = np.bitwise_or.reduceat(masks, start) if len(masks) else masks
    return EvalIndex(uniq, merged, cfg.set_names(), cfg.ngram), counts


def _spans(starts: np.ndarray, ends: np.ndarray, hit: np.ndarray, n: int) -> list[list[float]]:
    """Merged character spans of the n-grams starting at word positions ``hit``."""
    out: list[list[float]] = []
    for p in hit:
        s, e = int(starts[p]), int(ends[p + n - 1])
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e, 1.0])
    return out


def decontam_shard(task: dict[str, Any]) -> dict[str, Any]:
    """Shard job: write the ``decontam`` attributes of one documents shard.

    ``task``: ``documents``, ``index`` (an :class:`EvalIndex` ``.npz``), ``output``, ``strict``.

    Returns:
        ``documents_in``, ``bytes_in``, ``flagged`` ({attribute: {"documents", "bytes"}}),
        ``errors``, ``outputs``.
    """
    index = EvalIndex.load(task["index"])
    names = [f"{ATTRIBUTE_SET}__{n}" for n in index.names]
    flagged = {a: {"documents": 0, "bytes": 0} for a in [*names, f"{ATTRIBUTE_SET}__contaminated"]}
    stats = {"documents_in": 0, "bytes_in": 0}
    errors: list[str] = []
    cache: dict[str, int] = {}
    n = index.ngram

    def rows():
        for lineno, doc in read_records(task["documents"], strict=task.get("strict", False),
                                        errors=errors):
            if doc is None or not isinstance(doc.get("text"), str):
                if doc is not None:
                    msg = f"{task['documents']}:{lineno}: document without a string 'text'"
                    if task.get("strict"):
                        raise OlmoflowError(msg)
                    errors.append(msg)
                yield {"id": doc.get("id") if doc else None, "attributes": {}}
                continue
            text = doc["text"]
            nbytes = text_bytes(text)
            stats["documents_in"] += 1
            stats["bytes_in"] += nbytes
            masks = index.match(ngram_hashes(word_hashes(words(text), cache), n))
            attrs: dict[str, list] = {a: [] for a in names}
            any_set = int(np.bitwise_or.reduce(masks)) if len(masks) else 0
            if any_set:
                # Offsets come from the same lowercased string the words were taken from.
                lower = text.lower()
                pos = [(m.start(), m.end()) for m in WORD_RE.finditer(lower)]
                starts = np.array([min(p[0], len(text)) for p in pos])
                ends = np.array([min(p[1], len(text)) for p in pos])
                for bit, a in enumerate(names):
                    hit = np.flatnonzero(masks & np.uint64(1 << bit))
                    if len(hit):
                        attrs[a] = _spans(starts, ends, hit, n)
                        flagged[a]["documents"] += 1
                        flagged[a]["bytes"] += nbytes
                flagged[f"{ATTRIBUTE_SET}__contaminated"]["documents"] += 1
                flagged[f"{ATTRIBUTE_SET}__contaminated"]["bytes"] += nbytes
            attrs[f"{ATTRIBUTE_SET}__contaminated"] = doc_level(text, 1.0 if any_set else 0.0)
            yield {"id": doc["id"], "attributes": attrs}

    write_jsonl_gz(task["output"], rows())
    return {**stats, "flagged": flagged, "errors": errors, "outputs": [task["output"]]}


def run_decontam(cfg: DecontamConfig | dict[str, Any] | None, tasks: list[dict[str, Any]],
                 root: str | os.PathLike, run_jobs: RunJobs, *, strict: bool = False
                 ) -> dict[str, Any]:
    """Write the ``decontam`` attributes of the documents shards of ``tasks``.

    The eval index is built once into ``root/work/decontam/index.npz`` (with ``index.json``: the
    per-set counts and a fingerprint of the settings and eval files) and rebuilt only when that
    fingerprint changes.

    Args:
        cfg: a :class:`DecontamConfig` or its mapping.
        tasks: one per documents shard: ``{"input": documents path, "output": attribute file}``.
        root: the data run directory.
        run_jobs: ``run_jobs(step, fn, tasks, phase=...)`` (the engine's, or
            :func:`olmoflow.data.shards.local_runner`).
        strict: raise at the first bad line instead of counting it.

    Returns:
        ``{"results": per-task stats (with ``errors``, ``outputs``), "counts": documents_in,
        bytes_in, flagged per attribute (documents and bytes: the counts per eval set), index
        (per-set items, texts, n-grams), action}``.

    Raises:
        OlmoflowError: bad config, missing eval files, bad lines when ``strict``.
    """
    cfg = as_section(DecontamConfig, cfg, "decontaminate.")
    work = Path(root) / WORK_DIR / ATTRIBUTE_SET
    index_path, meta_path = work / "index.npz", work / "index.json"
    fingerprint = sha256_json({
        "ngram": cfg.ngram, "sets": cfg.set_names(), "files": cfg.files,
        "inputs": [[f, *input_signature(f)] for f in cfg.eval_files() if Path(f).is_file()],
    })
    meta = None
    if index_path.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("fingerprint") != fingerprint:
            meta = None
    if meta is None:
        index, counts = build_index(cfg)
        index.save(index_path)
        meta = {"fingerprint": fingerprint, "counts": counts}
        atomic_write_json(meta_path, meta)
    index_sha = sha256_file(index_path)
    jobs = [{
        "step": "decontam", "documents": str(t["input"]), "input_sig": input_signature(t["input"]),
        "index": str(index_path), "index_sha256": index_sha, "output": str(t["output"]),
        "strict": strict,
    } for t in tasks]
    results = run_jobs(ATTRIBUTE_SET, decontam_shard, jobs)
    flagged = flag_totals(cfg.attributes(), results)
    counts = {
        "documents_in": sum(r["documents_in"] for r in results),
        "bytes_in": sum(r["bytes_in"] for r in results),
        "flagged": flagged, "index": meta["counts"], "action": cfg.action,
    }
    return {"results": results, "counts": counts}


def decontaminate(
    data_dir: str | os.PathLike,
    cfg: DecontamConfig | dict[str, Any] | None = None,
    *,
    executor: str = "local",
    workers: int | None = None,
    strict: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Write ``DIR/attributes/decontam`` for every shard of ``DIR/documents``.

    :func:`run_decontam` over the Dolma layout with :func:`run_shards` (markers in
    ``DIR/work/decontam/done``).

    Returns:
        :func:`run_decontam`'s ``counts`` plus ``errors`` and ``outputs`` (the attribute files).

    Raises:
        OlmoflowError: bad config, missing eval files or documents, bad lines when ``strict``.
    """
    return run_global_step(data_dir, ATTRIBUTE_SET, run_decontam, cfg, executor=executor,
                           workers=workers, strict=strict, progress=progress)
