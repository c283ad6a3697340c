""":class:`OlmoflowLM`: answers evaluation requests with an olmoflow (or transformers) causal LM.

Tokenization follows lm-eval 0.4 (``TemplateLM._encode_pair``) and OLMES exactly: trailing
whitespace of the context moves to the continuation; the context is encoded alone and those are
the context tokens the model sees; the continuation's tokens are those of the whole
``context + continuation`` encoding after the context's length. When a merge crosses the boundary
(context ``"The year was 19"``, continuation ``"99"``: the whole encodes ``... "199" "9"``), the
model sees ``... "19"`` and scores ``"9"``, never a context token holding part of the answer. An
empty context is replaced by the EOS token, as lm-eval does when there is no BOS.

Speed, with the results of a plain per-request forward (within float tolerance):

- ``loglikelihood`` on an olmoflow :class:`~olmoflow.model.olmo.Olmo` runs each distinct context
  (by token ids: the choices of one question) once. Contexts, sorted by length, are prefilled
  left-padded into a KV cache; the cache rows are then copied once per continuation and all the
  continuations of the batch run in one forward over it. Only the positions that are scored go
  through the log-softmax. Other models (``transformers``) get a right-padded batched forward of
  ``context + continuation`` sorted by length (lm-eval's ``hf`` scheme).
- ``loglikelihood_rolling`` batches the windows of all texts, sorted by length.
- ``generate_until`` runs greedy decoding in left-padded batches sorted by prompt length
  (:func:`olmoflow.infer.generate.generate`), one batch per set of stop strings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from olmoflow.errors import OlmoflowError
from olmoflow.eval.perplexity import rolling_windows
from olmoflow.eval.requests import (
    GenerateRequest,
    LoglikelihoodRequest,
    LoglikelihoodResult,
    Request,
    RollingRequest,
    RollingResult,
)
from olmoflow.model.olmo import Olmo


class OlmoflowLM:
    """The harness's model: an olmoflow :class:`~olmoflow.model.olmo.Olmo` (or anything whose
    ``model(input_ids [B, T])`` returns an object with ``.logits [B, T, V]``) and its tokenizer.

    Args:
        model: the causal LM, in eval mode (put there by the constructor).
        tokenizer: an olmoflow tokenizer (``encode``, ``decode``, ``eos_token_id``).
        batch_size: sequences per forward pass: contexts per prefill, continuations per
            forward over their cache, windows, prompts.
        max_length: the longest sequence the model may see (its trained context); default
            ``model.config.max_sequence_length``. A request longer than this is an error, never
            a silent truncation.
        device: where inputs go (default: the model's device).

    Raises:
        OlmoflowError: no tokenizer; (from the request methods) a request longer than
            ``max_length``, or a continuation with no tokens.
    """

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 16,
                 max_length: int | None = None, device: str | torch.device | None = None):
        if tokenizer is None:
            raise OlmoflowError("evaluation needs the model's tokenizer (none was given)")
        if batch_size < 1:
            raise OlmoflowError(f"batch_size={batch_size} must be >= 1")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        cfg = getattr(model, "config", None)
        self.max_length = max_length or getattr(cfg, "max_sequence_length", None) \
            or getattr(cfg, "max_position_embeddings", 2048)
        self.device = device if device is not None else next(model.parameters()).device
        self.eos = tokenizer.eos_token_id
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad = pad if pad is not None else self.eos
        # The shared-prefix path needs olmoflow's cache API (left padding + attention_mask).
        self.cached = isinstance(model, Olmo)

    # --- tokenization -------------------------------------------------------------------
    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of ``context`` and of ``continuation`` (lm-eval's split, module doc).

        Raises:
            OlmoflowError: an empty continuation.
        """
        if not continuation:
            raise OlmoflowError(f"empty continuation after context {context[-40:]!r}")
        if not context:
            cont = self.tokenizer.encode(continuation)
            # lm-eval: a continuation that itself starts with the prefix token keeps it as context
            if cont and cont[0] == self.eos:
                return cont[:1], cont[1:]
            return [self.eos], cont
        # lm-eval moves trailing whitespace of the context into the continuation
        n_space = len(context) - len(context.rstrip())
        if n_space:
            context, continuation = context[:-n_space], context[-n_space:] + continuation
        whole = self.tokenizer.encode(context + continuation)
        ctx = self.tokenizer.encode(context)
        return ctx, whole[len(ctx):]

    def fits(self, request: Request) -> bool:
        """Whether ``request`` fits the model's context (``max_length``) as this scorer would run
        it: a loglikelihood request's tokens minus the last, a generation prompt with room for one
        new token; a rolling request always fits (it is windowed)."""
        if isinstance(request, LoglikelihoodRequest):
            ctx, cont = self.encode_pair(request.context, request.continuation)
            return len(ctx) + len(cont) - 1 <= self.max_length
        if isinstance(request, GenerateRequest):
            return len(self.tokenizer.encode(request.context) or [0]) < self.max_length
        return True

    def _logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids.to(self.device)).logits

    def _pairs(self, requests: Sequence[LoglikelihoodRequest]) -> list[tuple[list[int], list[int]]]:
        pairs = [self.encode_pair(r.context, r.continuation) for r in requests]
        for (ctx, cont), r in zip(pairs, requests):
            if not cont:
                raise OlmoflowError(f"continuation {r.continuation!r} has no tokens of its own")
            if len(ctx) + len(cont) - 1 > self.max_length:
                raise OlmoflowError(
                    f"a request of {len(ctx) + len(cont)} tokens exceeds the model's context of "
                    f"{self.max_length} (context {r.context[:40]!r}...); use fewer shots "
                    "(num_shots=N) or leave such documents out (too_long=skip)")
        return pairs

    # --- loglikelihood ------------------------------------------------------------------
    @torch.inference_mode()
    def loglikelihood(self, requests: Sequence[LoglikelihoodRequest]) -> list[LoglikelihoodResult]:
        """Summed log-probability of each continuation given its context (see module doc).

        Returns one :class:`LoglikelihoodResult` per request, in order.

        Raises:
            OlmoflowError: a request longer than ``max_length`` or a continuation without tokens.
        """
        pairs = self._pairs(requests)
        if not pairs:
            return []
        if self.cached:
            return self._loglikelihood_shared(pairs)
        return self._loglikelihood_plain(pairs)

    def _loglikelihood_plain(self, pairs) -> list[LoglikelihoodResult]:
        """One right-padded forward of ``(context + continuation)[:-1]`` per batch."""
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        out: list[LoglikelihoodResult | None] = [None] * len(pairs)
        for b0 in range(0, len(order), self.batch_size):
            idx = order[b0:b0 + self.batch_size]
            seqs = [(pairs[i][0] + pairs[i][1])[:-1] for i in idx]
            batch = _pad_right(seqs, self.pad)
            logits = self._logits(batch)
            rows, cols, targets = [], [], []
            for row, i in enumerate(idx):
                ctx, cont = pairs[i]
                rows += [row] * len(cont)
                cols += range(len(ctx) - 1, len(ctx) - 1 + len(cont))
                targets += cont
            lp, greedy = _score(logits[rows, cols], targets)
            _collect(out, idx, [len(pairs[i][1]) for i in idx], lp, greedy)
        return out  # type: ignore[return-value]

    def _loglikelihood_shared(self, pairs) -> list[LoglikelihoodResult]:
        """Each distinct context runs once; its continuations reuse its KV cache rows."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (ctx, _) in enumerate(pairs):
            groups.setdefault(tuple(ctx), []).append(i)
        # Longest contexts first (errors and peak memory show up at once), then by ids so that
        # equal-length contexts sit together deterministically.
        keys = sorted(groups, key=lambda c: (-len(c), c))
        out: list[LoglikelihoodResult | None] = [None] * len(pairs)
        for b0 in range(0, len(keys), self.batch_size):
            self._score_shared(keys[b0:b0 + self.batch_size], groups, pairs, out)
        return out  # type: ignore[return-value]

    def _score_shared(self, ctxs, groups, pairs, out) -> None:
        """Prefill the contexts ``ctxs`` (left-padded), then score all their continuations."""
        dev = self.device
        width = len(ctxs[0])  # the longest (sorted)
        ids = torch.full((len(ctxs), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(ctxs), width), dtype=torch.bool)
        for r, c in enumerate(ctxs):
            ids[r, width - len(c):] = torch.tensor(c)
            mask[r, width - len(c):] = True
        ids, mask = ids.to(dev), mask.to(dev)
        cache = self.model.new_cache(len(ctxs), width)
        # Left padding: the last column is every context's last token, which predicts the
        # first continuation token.
        first = self.model(ids, attention_mask=mask if not mask.all() else None, cache=cache,
                           last_logits_only=True).logits[:, -1]

        # (request, context row) pairs, sorted by continuation length so that each forward over
        # the cache pads little
        rows = sorted(((i, r) for r, c in enumerate(ctxs) for i in groups[c]),
                      key=lambda t: len(pairs[t[0]][1]))
        for b0 in range(0, len(rows), self.batch_size):
            chunk = rows[b0:b0 + self.batch_size]
            idx = [i for i, _ in chunk]
            src = torch.tensor([r for _, r in chunk], device=dev)
            conts = [pairs[i][1] for i in idx]
            # Scored positions: the first token from the prefill, the rest from the pass below.
            logits = [first[src]]
            targets = [[c[0] for c in conts]]
            rest = [c[:-1] for c in conts]  # the inputs that predict tokens 2.. of each
            w = max(len(c) for c in rest)
            if w:
                sub = self.model.new_cache(len(chunk), width + w)
                for layer in range(len(sub.k)):
                    sub.k[layer][:, :, :width] = cache.k[layer].index_select(0, src)
                    sub.v[layer][:, :, :width] = cache.v[layer].index_select(0, src)
                sub.length = width
                # Right padding after the continuation is harmless: causal queries never see it.
                am = torch.cat([mask.index_select(0, src),
                                torch.ones(len(chunk), w, dtype=torch.bool, device=dev)], 1)
                head = self.model.lm_head
                hidden = self.model(_pad_right(rest, self.pad).to(dev), attention_mask=am,
                                    cache=sub, return_hidden=True).logits
                rr, cc, tt = [], [], []
                for row, c in enumerate(conts):
                    rr += [row] * (len(c) - 1)
                    cc += range(len(c) - 1)
                    tt += c[1:]
                # the LM head on the scored positions only, not on the right padding
                logits.append(head(hidden[rr, cc]))
                targets.append(tt)
            lp, greedy = _score(torch.cat(logits), [t for ts in targets for t in ts])
            # _score's rows are [first token of every row] + [later tokens, row by row]
            n = len(chunk)
            per_lp = lp[:n].double()
            misses = (~greedy[:n]).long()
            owner = torch.tensor([row for row, c in enumerate(conts) for _ in c[1:]],
                                 dtype=torch.long)
            if len(owner):
                per_lp.index_add_(0, owner, lp[n:].double())
                misses.index_add_(0, owner, (~greedy[n:]).long())
            for row, i in enumerate(idx):
                out[i] = LoglikelihoodResult(float(per_lp[row]), bool(misses[row] == 0),
                                             len(conts[row]))

    # --- rolling ------------------------------------------------------------------------
    @torch.inference_mode()
    def loglikelihood_rolling(self, requests: Sequence[RollingRequest]) -> list[RollingResult]:
        """Log-probability of each whole text, every token scored once in windows of
        ``max_length`` (lm-eval's rolling windows, the first token after EOS); the windows of
        all texts are batched together."""
        texts = [[self.eos] + self.tokenizer.encode(r.text) for r in requests]
        windows = []  # (text, window tokens incl. the last target, n_scored)
        for t, ids in enumerate(texts):
            for begin, end, n_scored in rolling_windows(len(ids) - 1, self.max_length):
                windows.append((t, ids[begin:end + 1], n_scored))
        windows.sort(key=lambda w: -len(w[1]))
        totals = torch.zeros(len(texts), dtype=torch.float64)
        for b0 in range(0, len(windows), self.batch_size):
            chunk = windows[b0:b0 + self.batch_size]
            logits = self._logits(_pad_right([w[1][:-1] for w in chunk], self.pad))
            rr, cc, tt, owner = [], [], [], []
            for row, (t, win, n_scored) in enumerate(chunk):
                n_in = len(win) - 1
                rr += [row] * n_scored
                cc += range(n_in - n_scored, n_in)
                tt += win[-n_scored:]
                owner += [t] * n_scored
            lp, _ = _score(logits[rr, cc], tt)
            totals.index_add_(0, torch.tensor(owner), lp.double())
        return [RollingResult(float(totals[t]), len(ids) - 1, len(r.text.encode("utf-8")),
                              len(r.text.split()))
                for t, (ids, r) in enumerate(zip(texts, requests))]

    # --- generation ---------------------------------------------------------------------
    @torch.inference_mode()
    def generate_until(self, requests: Sequence[GenerateRequest]) -> list[str]:
        """Greedy continuation of each context, cut at the earliest stop string (EOS ends it
        too). Requests with the same stop strings run in left-padded batches sorted by prompt
        length; greedy decoding makes a row's tokens independent of its batch.

        Raises:
            OlmoflowError: a prompt that leaves no room to generate within ``max_length``.
        """
        prompts = [self.tokenizer.encode(r.context) or [self.eos] for r in requests]
        n_new = []
        for ids, r in zip(prompts, requests):
            n = min(r.max_new_tokens, self.max_length - len(ids))
            if n < 1:
                raise OlmoflowError(f"a prompt of {len(ids)} tokens leaves no room to generate "
                                    f"in the model's context of {self.max_length}")
            n_new.append(n)
        by_stop: dict[tuple[str, ...], list[int]] = {}
        for i, r in enumerate(requests):
            by_stop.setdefault(tuple(r.until), []).append(i)
        out: list[str] = [""] * len(requests)
        for until, idx in by_stop.items():
            idx = sorted(idx, key=lambda i: -len(prompts[i]))
            for b0 in range(0, len(idx), self.batch_size):
                chunk = idx[b0:b0 + self.batch_size]
                new = self._generate([prompts[i] for i in chunk], max(n_new[i] for i in chunk),
                                     list(until))
                for i, toks in zip(chunk, new):
                    toks = toks[:n_new[i]]
                    if self.eos in toks:
                        toks = toks[:toks.index(self.eos)]
                    out[i] = cut_at_stop(self.tokenizer.decode(toks), until)
        return out

    def _generate(self, prompts: list[list[int]], n_new: int, until: list[str]) -> list[list[int]]:
        """New token ids per prompt (left-padded greedy batch; rows that stopped are filled)."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        padded = not bool(mask.all())
        if self.cached:
            from olmoflow.infer.generate import generate

            seq = generate(self.model, ids, attention_mask=mask if padded else None,
                           max_new_tokens=n_new, do_sample=False, eos_token_id=self.eos,
                           pad_token_id=self.pad, stop_strings=until or None,
                           tokenizer=self.tokenizer)
        else:  # a transformers model: its own generate; stop strings are cut afterwards
            seq = self.model.generate(ids, attention_mask=mask, max_new_tokens=n_new,
                                      do_sample=False, eos_token_id=self.eos,
                                      pad_token_id=self.pad)
        return [row[width:] for row in seq.tolist()]


def _pad_right(seqs: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    """``[len(seqs), longest]`` long tensor, each row left-aligned and padded with ``pad``."""
    width = max(len(s) for s in seqs)
    batch = torch.full((len(seqs), width), pad, dtype=torch.long)
    for row, s in enumerate(seqs):
        if s:
            batch[row, :len(s)] = torch.tensor(s)
    return batch


def _score(logits: torch.Tensor, targets: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [N, V]`` (any dtype, any device) and ``N`` targets -> (fp32 log-probabilities
    ``[N]``, bool ``[N]`` target is the argmax), on the CPU."""
    logp = F.log_softmax(logits.float(), dim=-1)
    tgt = torch.tensor(list(targets), dtype=torch.long, device=logp.device)
    lp = logp.gather(1, tgt[:, None]).squeeze(1)
    return lp.cpu(), (logp.argmax(-1) == tgt).cpu()


def _collect(out, idx, lengths, lp, greedy) -> None:
    """Sum the flat per-token ``lp``/``greedy`` (rows of ``lengths`` tokens) into ``out[idx]``."""
    pos = 0
    for i, n in zip(idx, lengths):
        out[i] = LoglikelihoodResult(float(lp[pos:pos + n].sum()),
                                     bool(greedy[pos:pos + n].all()), n)
        pos += n


def cut_at_stop(text: str, until: Sequence[str]) -> str:
    """``text`` up to (not including) the earliest of the stop strings ``until``."""
    cut = min((i for s in until if s and (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def nats_to_bits(x: float) -> float:
    """Nats to bits."""
    return x / math.log(2)
