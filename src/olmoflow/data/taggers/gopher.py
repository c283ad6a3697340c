"""The Gopher quality and repetition rules (Rae et al. 2021, "Scaling Language Models", Appendix A).

Definitions and thresholds follow datatrove 0.10.1's ``GopherQualityFilter`` and
``GopherRepetitionFilter`` (the published Table A1 values), so the keep/drop decisions match
theirs; words come from :func:`olmoflow.data.taggers.text.split_words` (a regex equivalent of
the spaCy English tokenizer datatrove uses). Every measurement is a document-level attribute
``gopher__<name>`` with the value as score; every rule also writes ``gopher__fail_<rule>``
(1.0 = the rule would drop the document, 0.0 = it passes), and ``gopher__fail_quality``,
``gopher__fail_repetition`` and ``gopher__fail_any`` aggregate them. Drop with a mixer rule like
``{"attribute": "gopher__fail_any", "op": "==", "value": 1}``.

Quality measurements ("bad" direction in brackets; words made only of punctuation are "symbols"):

- ``word_count``: non-symbol words [< 50 or > 100,000: rules ``short_doc``, ``long_doc``]
- ``mean_word_length``: mean length of non-symbol words [< 3 or > 10: ``short_words``,
  ``long_words``]
- ``hash_ratio``: ``#`` characters per word [> 0.1: ``too_many_hashes``]
- ``ellipsis_ratio``: ``...`` and ``…`` per word [> 0.1: ``too_many_ellipsis``]
- ``bullet_lines_ratio``: lines starting with ``•`` or ``-`` [> 0.9: ``too_many_bullets``]
- ``ellipsis_lines_ratio``: lines ending with ``...`` or ``…`` [> 0.3: ``too_many_end_ellipsis``]
- ``alpha_words_ratio``: words with an alphabetic character [< 0.8: ``few_alpha_words``]
- ``stop_words``: distinct stop words among the, be, to, of, and, that, have, with (case-sensitive,
  as datatrove) [< 2: ``few_stop_words``]

Repetition measurements (fractions of the document's characters unless noted):

- ``dup_para_frac`` (of paragraphs, split on 2+ newlines) [> 0.3], ``dup_para_char_frac`` [> 0.2]
- ``dup_line_frac`` (of lines, split on newlines) [> 0.3], ``dup_line_char_frac`` [> 0.2]
- ``top_{n}gram_char_frac`` for n = 2, 3, 4: characters of the most frequent word n-gram times its
  count [> 0.20, 0.18, 0.16]
- ``dup_{n}gram_char_frac`` for n = 5..10: characters in repeated word n-grams, counted without
  overlap [> 0.15, 0.14, 0.13, 0.12, 0.11, 0.10]

Rule names for repetition are the measurement names (``fail_dup_line_frac``, ``fail_top_2gram``,
``fail_dup_5gram``, ...); an empty document fails ``fail_empty``. The n-grams are compared as word
sequences (exactly), where datatrove compares the words' concatenation without spaces: the two
differ only when different word sequences concatenate to the same string.
"""

from __future__ import annotations

import re
from itertools import compress, repeat
from typing import Any

import numpy as np

from olmoflow.data.taggers import Spans, Tagger, register_tagger
from olmoflow.data.taggers.text import PUNCTUATION, split_words

STOP_WORDS = ("the", "be", "to", "of", "and", "that", "have", "with")
TOP_NGRAMS = ((2, 0.20), (3, 0.18), (4, 0.16))
DUP_NGRAMS = ((5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10))
_PARAGRAPH = re.compile(r"\n{2,}")
_LINES = re.compile(r"\n+")
_ALPHA = re.compile(r"[^\W\d_]")


def _duplicates(parts: list[str]) -> tuple[int, int]:
    """(number of elements seen before, their total characters), as datatrove's find_duplicates."""
    seen: set[str] = set()
    n = chars = 0
    for p in parts:
        if p in seen:
            n += 1
            chars += len(p)
        else:
            seen.add(p)
    return n, chars


def quality_measurements(text: str, words: list[str]) -> dict[str, float]:
    """The Gopher quality measurements of ``text`` (see the module docstring)."""
    n_words = len(words)
    # map/compress keep the per-word work in C: this runs on every word of every document.
    non_symbol = list(map(bool, map(str.strip, words, repeat(PUNCTUATION, n_words))))
    n_non_symbol = sum(non_symbol)
    n_chars = sum(compress(map(len, words), non_symbol))
    lines = text.splitlines()
    n_lines = max(len(lines), 1)
    per_word = 1 / n_words if n_words else 0.0
    return {
        "word_count": n_non_symbol,
        "mean_word_length": n_chars / n_non_symbol if n_non_symbol else 0.0,
        "hash_ratio": text.count("#") * per_word,
        "ellipsis_ratio": (text.count("...") + text.count("…")) * per_word,
        "bullet_lines_ratio": sum(ln.lstrip().startswith(("•", "-")) for ln in lines) / n_lines,
        "ellipsis_lines_ratio": sum(ln.rstrip().endswith(("...", "…")) for ln in lines) / n_lines,
        "alpha_words_ratio": sum(map(bool, map(_ALPHA.search, words))) * per_word,
        "stop_words": len(set(STOP_WORDS).intersection(words)),
    }


def quality_failures(m: dict[str, float], o: dict[str, Any]) -> dict[str, bool]:
    """Which quality rules drop a document with measurements ``m`` under thresholds ``o``."""
    few = m["word_count"] < o["min_doc_words"]
    return {
        "short_doc": few,
        "long_doc": m["word_count"] > o["max_doc_words"],
        # datatrove skips the remaining rules once a rule fires; a document with no words has
        # already failed short_doc, so its ratios (0 here, undefined there) cannot disagree.
        "short_words": m["word_count"] > 0 and m["mean_word_length"] < o["min_avg_word_length"],
        "long_words": m["mean_word_length"] > o["max_avg_word_length"],
        "too_many_hashes": m["hash_ratio"] > o["max_symbol_word_ratio"],
        "too_many_ellipsis": m["ellipsis_ratio"] > o["max_symbol_word_ratio"],
        "too_many_bullets": m["bullet_lines_ratio"] > o["max_bullet_lines_ratio"],
        "too_many_end_ellipsis": m["ellipsis_lines_ratio"] > o["max_ellipsis_lines_ratio"],
        "few_alpha_words": m["alpha_words_ratio"] < o["min_alpha_words_ratio"],
        "few_stop_words": m["stop_words"] < o["min_stop_words"],
    }


def _ngram_stats(words: list[str], n_chars: int) -> dict[str, float]:
    """Top n-gram (n=2..4) and duplicated n-gram (n=5..10) character fractions.

    Word n-grams get exact integer ids level by level (id of an n-gram = the id of the pair
    (its (n-1)-gram prefix, its last word)), so each level is one numpy ``unique`` instead of
    building every n-gram string as datatrove does.
    """
    out = {f"top_{n}gram_char_frac": 0.0 for n, _ in TOP_NGRAMS}
    out.update({f"dup_{n}gram_char_frac": 0.0 for n, _ in DUP_NGRAMS})
    n_words = len(words)
    if n_words < 2 or n_chars == 0:
        return out
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    ids = np.fromiter(map(vocab.__getitem__, words), dtype=np.int64, count=n_words)
    cum = np.zeros(n_words + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, words), dtype=np.int64, count=n_words), out=cum[1:])
    v = len(vocab)
    level = ids
    for n in range(2, DUP_NGRAMS[-1][0] + 1):
        m = n_words - n + 1
        if m <= 0:
            break
        key = level[:m] * v + ids[n - 1 :]
        uniq, first, level, counts = np.unique(
            key, return_index=True, return_inverse=True, return_counts=True
        )
        chars = cum[n : n + m] - cum[:m]  # characters of each n-gram, without separators
        if n <= TOP_NGRAMS[-1][0]:
            top = counts.max()
            # Counter.most_common(1) breaks ties by first occurrence.
            at = first[counts == top].min()
            out[f"top_{n}gram_char_frac"] = float((chars[at] + n - 1) * top / n_chars)
        elif len(uniq) == m:
            break  # no repeated n-gram, hence none longer either: the rest stay 0
        else:
            out[f"dup_{n}gram_char_frac"] = _repeated_chars(level, first, chars, n) / n_chars
    return out


def _repeated_chars(level: np.ndarray, first: np.ndarray, chars: np.ndarray, n: int) -> float:
    """datatrove's find_all_duplicate: scan left to right, skip n words after each repeat.

    Only positions whose n-gram occurred earlier can be repeats; the new n-grams between two
    such positions are added to ``seen`` in one C-level ``update``.
    """
    candidates = np.flatnonzero(first[level] < np.arange(len(level))).tolist()
    inv = level.tolist()
    char_list = chars.tolist()
    seen: set[int] = set()
    total = idx = 0
    for c in candidates:
        if c < idx:
            continue  # inside the n words skipped after the previous repeat
        seen.update(inv[idx:c])
        if inv[c] in seen:
            total += char_list[c]
            idx = c + n
        else:
            seen.add(inv[c])
            idx = c + 1
    return float(total)


def repetition_measurements(text: str, words: list[str]) -> dict[str, float]:
    """The Gopher repetition measurements of ``text`` (see the module docstring)."""
    n_chars = len(text)
    if n_chars == 0:
        return {"dup_para_frac": 0.0, "dup_para_char_frac": 0.0, "dup_line_frac": 0.0,
                "dup_line_char_frac": 0.0, **_ngram_stats([], 0)}
    paragraphs = _PARAGRAPH.split(text.strip())
    p_dup, p_chars = _duplicates(paragraphs)
    lines = _LINES.split(text)
    l_dup, l_chars = _duplicates(lines)
    return {
        "dup_para_frac": p_dup / len(paragraphs),
        "dup_para_char_frac": p_chars / n_chars,
        "dup_line_frac": l_dup / len(lines),
        "dup_line_char_frac": l_chars / n_chars,
        **_ngram_stats(words, n_chars),
    }


def repetition_failures(m: dict[str, float], o: dict[str, Any], empty: bool) -> dict[str, bool]:
    """Which repetition rules drop a document with measurements ``m`` under thresholds ``o``."""
    fails = {"empty": empty}
    for key in ("dup_para_frac", "dup_para_char_frac", "dup_line_frac", "dup_line_char_frac"):
        fails[key] = m[key] > o[key]
    for n, limit in o["top_n_grams"]:
        fails[f"top_{n}gram"] = m.get(f"top_{n}gram_char_frac", 0.0) > limit
    for n, limit in o["dup_n_grams"]:
        fails[f"dup_{n}gram"] = m.get(f"dup_{n}gram_char_frac", 0.0) > limit
    return fails


@register_tagger("gopher")
class GopherTagger(Tagger):
    """Gopher quality + repetition measurements and rule outcomes as document-level attributes.

    Options are the published thresholds (datatrove's argument names); ``quality`` and
    ``repetition`` switch either half off.
    """

    defaults = {
        "quality": True, "repetition": True,
        "min_doc_words": 50, "max_doc_words": 100_000,
        "min_avg_word_length": 3, "max_avg_word_length": 10,
        "max_symbol_word_ratio": 0.1, "max_bullet_lines_ratio": 0.9,
        "max_ellipsis_lines_ratio": 0.3, "min_alpha_words_ratio": 0.8, "min_stop_words": 2,
        "dup_line_frac": 0.3, "dup_para_frac": 0.3,
        "dup_line_char_frac": 0.2, "dup_para_char_frac": 0.2,
        "top_n_grams": TOP_NGRAMS, "dup_n_grams": DUP_NGRAMS,
    }

    def measure(self, text: str) -> tuple[dict[str, float], dict[str, bool]]:
        """``(measurements, failures)`` of one text: each a flat ``{name: value}`` dict."""
        words = split_words(text)
        values: dict[str, float] = {}
        fails: dict[str, bool] = {}
        if self.options["quality"]:
            q = quality_measurements(text, words)
            qf = quality_failures(q, self.options)
            values.update(q)
            fails.update(qf)
            fails["quality"] = any(qf.values())
        if self.options["repetition"]:
            r = repetition_measurements(text, words)
            rf = repetition_failures(r, self.options, empty=not text)
            values.update(r)
            fails.update(rf)
            fails["repetition"] = any(rf.values())
        fails["any"] = fails.get("quality", False) or fails.get("repetition", False)
        return values, fails

    def tag(self, doc: dict[str, Any]) -> dict[str, Spans]:
        """Document-level spans ``[0, len(text), value]`` for every measurement and rule flag."""
        text = doc["text"]
        values, fails = self.measure(text)
        end = len(text)
        attrs = {self.attr(k): [[0, end, v]] for k, v in values.items()}
        for k, failed in fails.items():
            attrs[self.attr(f"fail_{k}")] = [[0, end, 1.0 if failed else 0.0]]
        return attrs
