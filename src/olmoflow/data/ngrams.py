"""Word n-gram hashing shared by deduplication and decontamination.

Text is normalized to lowercased ``\\w+`` words; each distinct word gets a 64-bit BLAKE2b hash
(memoized), and the hash of a run of ``n`` words is an order-sensitive combination of its word
hashes, computed for a whole document (or many texts) with numpy arithmetic, not a Python loop per
n-gram. Hashes are stable across processes and machines (no ``hash()`` randomization), so shard
jobs in any worker agree.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

WORD_RE = re.compile(r"\w+")
_MASK64 = (1 << 64) - 1
# Odd 64-bit multipliers for combining word hashes into n-gram hashes (splitmix64 constants).
_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def words(text: str) -> list[str]:
    """Normalized words: lowercased ``\\w+`` runs (Unicode-aware; punctuation is dropped)."""
    return WORD_RE.findall(text.lower())


def word_hashes(tokens: list[str], cache: dict[str, int] | None = None) -> np.ndarray:
    """64-bit hashes (BLAKE2b) of ``tokens``, shape ``(len(tokens),)``, dtype uint64.

    ``cache`` memoizes per word: word frequencies are Zipfian, so most lookups hit.
    """
    cache = {} if cache is None else cache
    for w in set(tokens).difference(cache):
        cache[w] = int.from_bytes(
            hashlib.blake2b(w.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")
    return np.fromiter(map(cache.__getitem__, tokens), dtype=np.uint64, count=len(tokens))


def unique_sorted(values: np.ndarray) -> np.ndarray:
    """The distinct values of a 1-d array, sorted (a sort and a diff: faster than np.unique's
    hash table on uint64)."""
    v = np.sort(values)
    return v[np.concatenate(([True], v[1:] != v[:-1]))] if len(v) else v


def ngram_hashes_many(token_lists: list[list[str]], n: int, cache: dict[str, int] | None = None
                      ) -> np.ndarray:
    """The n-gram hashes of many texts at once (no n-gram crosses two texts), concatenated.

    Equal to ``np.concatenate([ngram_hashes(word_hashes(t), n) for t in token_lists])`` but
    vectorized over all texts, which matters for the many short texts of an eval set.
    """
    lengths = np.array([len(t) for t in token_lists], dtype=np.int64)
    h = ngram_hashes(word_hashes([w for t in token_lists for w in t], cache), n)
    if not len(h):
        return h
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    ok = lengths >= n
    edges = np.zeros(len(h) + 1, dtype=np.int64)
    np.add.at(edges, offsets[ok], 1)
    np.add.at(edges, offsets[ok] + lengths[ok] - n + 1, -1)
    return h[np.cumsum(edges[:-1]) > 0]


def _fmix64(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(33))
    h = h * np.uint64(_MIX[1])
    h = h ^ (h >> np.uint64(29))
    h = h * np.uint64(_MIX[2])
    return h ^ (h >> np.uint64(32))


def ngram_hashes(word_h: np.ndarray, n: int) -> np.ndarray:
    """64-bit hashes of every run of ``n`` consecutive words, shape ``(max(0, len - n + 1),)``.

    ``h = fmix64(sum_k word_h[i + k] * M**(k + 1) mod 2**64)``: order-sensitive, vectorized over the
    document (n passes of numpy arithmetic, no Python loop per word).
    """
    m = len(word_h) - n + 1
    if m <= 0:
        return np.empty(0, dtype=np.uint64)
    acc = np.zeros(m, dtype=np.uint64)
    mult = np.uint64(1)
    for k in range(n):
        mult = np.uint64((int(mult) * _MIX[0]) & _MASK64)
        acc += word_h[k: k + m] * mult
    return _fmix64(acc)


def digest128(data: str) -> tuple[int, int]:
    """128-bit BLAKE2b of ``data`` as two 64-bit ints (low, high): an exact-duplicate key."""
    d = hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little")
