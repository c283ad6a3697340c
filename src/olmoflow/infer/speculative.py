"""Speculative decoding: draft a few tokens cheaply, verify them in ONE forward of the model.

Two drafters:

- prompt lookup (Saxena 2023, "prompt lookup decoding"; ``transformers``'
  ``prompt_lookup_num_tokens``): the last ``n``-gram of the sequence (``n`` from
  ``max_matching_ngram_size`` down to 1) is looked up in the sequence itself, and the tokens
  that followed its earliest earlier occurrence are the draft. No second model; it shines on
  code and on answers that quote the prompt.
- a draft model: any :class:`~olmoflow.model.olmo.Olmo` with the same vocabulary decodes the
  draft autoregressively over its own KV cache.

Verification feeds ``[last token, draft_1 .. draft_k]`` to the model over its KV cache; logits at
position ``j`` are the model's distribution ``p_j`` for the token after draft ``j``. Greedy: the
longest prefix of the draft equal to the argmax is accepted, plus the argmax after it (the
correction, or a bonus token when all drafts are accepted), so the output equals plain greedy
decoding wherever fp32 rounding cannot flip an argmax (the verify forward sums in another order
than a one-token step). Sampling follows the rejection rule of Leviathan et al. 2023 / Chen et
al. 2023: draft ``x`` drawn from ``q`` is accepted with probability ``min(1, p(x) / q(x))``; at the
first rejection a token is drawn from ``norm(max(0, p - q))``; after ``k`` acceptances a bonus
token from ``p_k``. Each emitted token then follows ``p`` exactly. Prompt lookup's draft is a
point mass (``q(x) = 1``): accept with probability ``p(x)``, else draw from ``p`` without ``x``.

The draft length follows ``transformers``' "heuristic" schedule for assistant models: two more
after a block whose drafts were all accepted, one fewer otherwise, between 1 and the ``K`` asked
for, so a text that stops repeating costs short verify blocks only.

Rejected positions are rolled back by setting the (dynamic) cache's fill length back: entries past
it are never read and are overwritten by the next write. Sliding-window layers keep the whole
history in that cache (see :class:`~olmoflow.model.attention.KVCache`), so the rollback is exact
for them too.

Batches: the dynamic cache has one length for all rows, so every row advances by the same
``n + 1`` tokens, ``n`` the fewest drafts accepted by a row still decoding. A row that accepted
more keeps only its first ``n``; its token at ``n`` is then its accepted draft, which (by the rule
above, or by equality under greedy) is a valid draw from ``p_n``: truncating at a point that does
not depend on the row's own draws leaves its output distribution unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from olmoflow.errors import OlmoflowError
from olmoflow.infer.generate import (
    RowEnds,
    apply_repetition_penalty,
    decode_settings,
    generate,
    resolve_sampling,
    sample_categorical,
    top_k_top_p_filter,
)
from olmoflow.infer.sampling import SamplingParams

log = logging.getLogger(__name__)

# transformers' defaults: prompt_lookup_num_tokens is what the user passes, the n-gram is 2.
DEFAULT_MAX_NGRAM = 2
DEFAULT_DRAFT_TOKENS = 5


@dataclass
class SpeculativeStats:
    """What speculation did in one call, summed over the rows still decoding at each step.

    Attributes:
        drafted: draft tokens proposed.
        accepted: draft tokens kept (in a batch, the fewest any live row accepted, per row).
        forwards: forwards of the model after the prefill (one per verify block).
        emitted: new tokens written, summed over live rows (accepted drafts + one per forward).
    """

    drafted: int = 0
    accepted: int = 0
    forwards: int = 0
    emitted: int = 0

    @property
    def acceptance_rate(self) -> float:
        """``accepted / drafted`` (0.0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens emitted per row per model forward after the prefill (1.0 = plain decoding)."""
        return self.emitted / self.forwards if self.forwards else 0.0

    def summary(self) -> str:
        """One line for a log: drafted, accepted, the rate, tokens per forward."""
        return (f"speculative decoding: {self.accepted}/{self.drafted} draft tokens accepted "
                f"({self.acceptance_rate:.1%}), {self.tokens_per_forward:.2f} tokens per forward")


def prompt_lookup_draft(seq: torch.Tensor, num_tokens: int, max_ngram: int) -> torch.Tensor:
    """The prompt-lookup draft for one row: ``seq [L]`` long -> ``[m]`` long, ``m <= num_tokens``
    (empty when nothing matches). For ``n`` from ``max_ngram`` down to 1, the earliest earlier
    occurrence of the last ``n`` tokens whose continuation is non-empty gives the draft (the
    tokens after it), as ``transformers``' ``PromptLookupCandidateGenerator``."""
    L = seq.shape[0]
    for n in range(min(max_ngram, L - 1), 0, -1):
        # windows starting at 0 .. L - n - 1: the last window (the n-gram itself) is excluded
        windows = seq[: L - 1].unfold(0, n, 1)
        hits = (windows == seq[L - n:]).all(-1).nonzero()
        if hits.numel():
            start = int(hits[0, 0]) + n
            return seq[start: start + num_tokens]
    return seq[:0]


class _PromptLookup:
    """Drafts from each row's own tokens; the draft is a point mass (no ``q``)."""

    def __init__(self, num_tokens: int, max_ngram: int):
        self.num_tokens, self.max_ngram = num_tokens, max_ngram

    def prefill(self, input_ids, prompt_mask) -> None:
        pass

    def propose(self, rows: list[torch.Tensor], seq: torch.Tensor, k: int, fill: int):
        drafts = [prompt_lookup_draft(r, k, self.max_ngram) for r in rows]
        m = max((d.shape[0] for d in drafts), default=0)
        out = torch.full((len(rows), m), fill, dtype=seq.dtype, device=seq.device)
        for b, d in enumerate(drafts):
            out[b, : d.shape[0]] = d
        return out, None

    def rollback(self, length: int) -> None:
        pass


class _DraftModel:
    """Drafts with a second model over its own dynamic KV cache; ``q`` is its distribution
    (the same temperature, top-k and top-p as the target, no repetition penalty)."""

    def __init__(self, draft, num_tokens: int, B: int, max_length: int, sp: SamplingParams,
                 vocab_size, generator):
        self.model, self.num_tokens, self.sp = draft, num_tokens, sp
        self.vocab_size, self.generator = vocab_size, generator
        self.cache = draft.new_cache(B, max_length)

    def prefill(self, input_ids, prompt_mask) -> None:
        self.model(input_ids, attention_mask=prompt_mask, cache=self.cache, last_logits_only=True)

    def propose(self, rows, seq: torch.Tensor, k: int, fill: int):
        if k == 0:
            return seq[:, :0], None
        pending = seq[:, self.cache.length:]  # the tokens the draft has not read yet (1 or 2)
        drafts, qs = [], []
        for _ in range(k):
            logits = self.model(pending, cache=self.cache, last_logits_only=True).logits[:, -1]
            if self.vocab_size is not None and self.vocab_size < logits.shape[-1]:
                logits[:, self.vocab_size:] = float("-inf")
            if self.sp.do_sample:
                q = _probs(logits, self.sp)
                nxt = sample_categorical(q, self.generator)
                qs.append(q)
            else:
                nxt = logits.max(-1).indices
            drafts.append(nxt)
            pending = nxt[:, None]
        return torch.stack(drafts, 1), (torch.stack(qs, 1) if qs else None)

    def rollback(self, length: int) -> None:
        # The draft read [.., last, d_1 .. d_{k-1}]; what it read past `length` is rejected.
        self.cache.length = min(self.cache.length, length)


def _probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Sampling distribution of ``logits [N, V]`` under ``sp`` (temperature, top-k, top-p), as
    :func:`~olmoflow.infer.generate.sample_next` samples it."""
    return top_k_top_p_filter(logits.float() / sp.temperature, sp.top_k, sp.top_p).softmax(-1)


def check_draft_model(model, draft_model) -> None:
    """Refuse a draft model whose vocabulary (logit width) differs from the target's.

    Raises:
        OlmoflowError: the two sizes, in one line.
    """
    vt = getattr(getattr(model, "config", None), "vocab_size", None)
    vd = getattr(getattr(draft_model, "config", None), "vocab_size", None)
    if vd is None or vt != vd:
        raise OlmoflowError(f"draft model vocabulary ({vd}) differs from the model's ({vt}): a "
                            "draft model must use the same tokenizer")


# The generate keywords that select speculative decoding.
SPECULATIVE_KEYS = frozenset({"prompt_lookup_num_tokens", "max_matching_ngram_size",
                              "draft_model", "num_draft_tokens", "return_stats"})


def generate_or_speculate(model, input_ids: torch.Tensor, **kwargs):
    """``Olmo.generate``'s body: :func:`speculative_generate` when a keyword of
    :data:`SPECULATIVE_KEYS` is given (None or False counts as not given), else
    :func:`olmoflow.infer.generate.generate`. Arguments, results and errors are theirs."""
    kwargs = {k: v for k, v in kwargs.items()
              if not (k in SPECULATIVE_KEYS and (v is None or v is False))}
    if SPECULATIVE_KEYS.isdisjoint(kwargs):
        return generate(model, input_ids, **kwargs)
    return speculative_generate(model, input_ids, **kwargs)


def speculative_generate(
    model,
    input_ids: torch.Tensor,
    *,
    prompt_lookup_num_tokens: int | None = None,
    max_matching_ngram_size: int | None = None,
    draft_model: Any = None,
    num_draft_tokens: int | None = None,
    sampling: SamplingParams | None = None,
    max_length: int | None = None,
    max_new_tokens: int | None = None,
    attention_mask: torch.Tensor | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    stop_strings: Sequence[str] | None = None,
    tokenizer: Any = None,
    seed: int | None = None,
    streamer: Any = None,
    vocab_size: int | None = None,
    compile: bool | str = False,
    return_lengths: bool = False,
    return_stats: bool = False,
):
    """:func:`olmoflow.infer.generate.generate` with speculative decoding: the same arguments,
    outputs and errors, plus the drafter.

    Args:
        prompt_lookup_num_tokens: draft up to this many tokens by prompt lookup (the module
            docstring); ``transformers``' name.
        max_matching_ngram_size: the longest n-gram looked up (default 2, as ``transformers``).
        draft_model: draft with this model instead (an Olmo with the model's vocabulary size).
        num_draft_tokens: tokens the draft model proposes per block (default 5).
        return_stats: also return a :class:`SpeculativeStats` (last in the tuple, after the
            lengths when ``return_lengths``).

    Returns ``[B, T + n]`` as ``generate``; with ``return_lengths`` and/or ``return_stats`` a tuple.

    Raises:
        ValueError: both or neither drafter, a draft length < 1, an n-gram size < 1, ``compile``
            (the verify block changes width, which the static compiled step cannot take), a
            ragged cache model; the errors of ``generate``.
        OlmoflowError: a draft model with another vocabulary size.
    """
    B, T = input_ids.shape
    sp = resolve_sampling(
        T, sampling, max_length=max_length, max_new_tokens=max_new_tokens, do_sample=do_sample,
        temperature=temperature, top_k=top_k, top_p=top_p,
        repetition_penalty=repetition_penalty, seed=seed, stop_strings=stop_strings,
    )
    if (prompt_lookup_num_tokens is None) == (draft_model is None):
        raise ValueError("speculative decoding needs exactly one of prompt_lookup_num_tokens= "
                         "and draft_model=")
    if compile:
        raise ValueError("compile= does not combine with speculative decoding: the verify block "
                         "changes width every step; drop one of them")
    if draft_model is not None:
        check_draft_model(model, draft_model)
        k = DEFAULT_DRAFT_TOKENS if num_draft_tokens is None else num_draft_tokens
        name = "num_draft_tokens"
    else:
        k, name = prompt_lookup_num_tokens, "prompt_lookup_num_tokens"
        if num_draft_tokens is not None:
            raise ValueError("num_draft_tokens= is for draft_model=; prompt lookup drafts "
                             "prompt_lookup_num_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {k!r}")
    ngram = DEFAULT_MAX_NGRAM if max_matching_ngram_size is None else max_matching_ngram_size
    if isinstance(ngram, bool) or not isinstance(ngram, int) or ngram < 1:
        raise ValueError(f"max_matching_ngram_size must be an integer >= 1, got {ngram!r}")

    eos_token_id, fill, stops, vocab_size = decode_settings(
        input_ids, sp, attention_mask, eos_token_id, pad_token_id, tokenizer, vocab_size)

    stats = SpeculativeStats()
    lengths = torch.empty(B, dtype=torch.long) if return_lengths else None
    out = torch.empty(B, T + sp.max_new_tokens, dtype=input_ids.dtype, device=input_ids.device)
    out[:, :T] = input_ids
    steps = _speculative_decode(model, input_ids, out, sp, attention_mask, eos_token_id, fill,
                                stops, tokenizer, vocab_size, lengths, stats, k, ngram,
                                draft_model)
    n = 0
    for nxt in steps:
        n += 1
        if streamer is not None:
            streamer.put(nxt)
    if streamer is not None:
        streamer.end()
    if stats.drafted:
        log.info(stats.summary())
    result = (out[:, : T + n],)
    if return_lengths:
        result += (lengths,)
    if return_stats:
        result += (stats,)
    return result[0] if len(result) == 1 else result


def _speculative_decode(model, input_ids, out, sp: SamplingParams, attention_mask, eos_token_id,
                        fill, stops, tokenizer, vocab_size, lengths, stats: SpeculativeStats,
                        k: int, ngram: int, draft_model) -> Iterator[torch.Tensor]:
    """Write new tokens into ``out [B, T + n_new]`` (prompt already there) and yield each
    position's ``[B]`` tokens, as ``generate``'s decode loop does (the same EOS, fill, stop-string
    and ``lengths`` rules)."""
    n_new = sp.max_new_tokens
    B, T = input_ids.shape
    device = input_ids.device
    ends = RowEnds(B, device, n_new, eos_token_id, fill, stops, tokenizer, lengths)
    if n_new == 0:
        return
    generator = (torch.Generator(device=device).manual_seed(sp.seed) if sp.seed is not None
                 else None)
    prompt_mask = None
    if attention_mask is not None and not bool(attention_mask.all()):
        prompt_mask = attention_mask.bool()
    # Rows' own tokens for prompt lookup: the real ones (left pads excluded).
    starts = ([0] * B if prompt_mask is None
              else (~prompt_mask).sum(-1).tolist())
    done = ends.done
    pad_draft = fill if fill is not None else 0
    penalty = sp.repetition_penalty
    seen = None
    was_training = model.training
    if draft_model is not None:
        drafter = _DraftModel(draft_model, k, B, T + n_new, sp, vocab_size, generator)
    else:
        drafter = _PromptLookup(k, ngram)
    cache = model.new_cache(B, T + n_new)

    def logits_fix(logits: torch.Tensor) -> torch.Tensor:
        if vocab_size is not None and vocab_size < logits.shape[-1]:
            logits[..., vocab_size:] = float("-inf")
        return logits

    model.eval()
    draft_was_training = draft_model.training if draft_model is not None else False
    if draft_model is not None:
        draft_model.eval()
    try:
        with torch.inference_mode():
            logits = model(input_ids, attention_mask=prompt_mask, cache=cache,
                           last_logits_only=True).logits[:, -1]
            drafter.prefill(input_ids, prompt_mask)
            logits = logits_fix(logits)
        if penalty != 1.0:  # outside inference mode: `seen` is updated in place between yields
            real = (attention_mask if attention_mask is not None
                    else torch.ones_like(input_ids)).int()
            counts = torch.zeros(B, logits.shape[-1], dtype=torch.int32, device=device)
            seen = counts.scatter_add_(1, input_ids, real) > 0
            logits = apply_repetition_penalty(logits, seen, penalty)
        with torch.inference_mode():
            if sp.do_sample:
                nxt = sample_categorical(_probs(logits, sp), generator)
            else:
                nxt = logits.max(-1).indices
        nxt, all_done = ends.mark(nxt, 0)
        out[:, T] = nxt
        pos = T + 1  # tokens written to out; the cache holds pos - 1 of them
        k_now = k  # drafts asked for this block
        yield out[:, T].clone()
        while not all_done and pos < T + n_new:
            with torch.inference_mode():
                block, m = _verify_block(model, cache, drafter, out, pos, starts, k_now,
                                         T + n_new - pos - 1, pad_draft, done, sp, penalty,
                                         seen, logits_fix, generator, stats)
            if m:  # transformers' "heuristic" schedule: longer after a block accepted whole
                k_now = min(k, k_now + 2) if block.shape[1] == m + 1 else max(1, k_now - 1)
            for tok in block.unbind(1):
                i = pos - T
                if seen is not None:  # the plain loop marks a token seen once it is fed
                    seen.scatter_(1, out[:, pos - 1: pos], True)
                tok, all_done = ends.mark(tok, i)
                out[:, pos] = tok
                pos += 1
                yield out[:, pos - 1].clone()
                if all_done:
                    break
    finally:
        model.train(was_training)
        if draft_model is not None:
            draft_model.train(draft_was_training)


def _verify_block(model, cache, drafter, out, pos, starts, k, budget, pad_draft, done,
                  sp: SamplingParams, penalty, seen, logits_fix, generator,
                  stats: SpeculativeStats) -> tuple[torch.Tensor, int]:
    """One draft-and-verify step: returns the ``[B, n + 1]`` tokens every row emits next and the
    number of drafts verified, and leaves the cache (and the drafter's) holding exactly the
    tokens before the last emitted one.

    ``budget``: the most drafts that fit before ``max_new_tokens`` (one emitted token stays for
    the correction)."""
    B = out.shape[0]
    k_step = max(0, min(k, budget))
    rows = [out[b, starts[b]: pos] for b in range(B)]
    if k_step:
        drafts, q = drafter.propose(rows, out[:, :pos], k_step, pad_draft)
    else:
        drafts, q = out[:, :0], None
    m = drafts.shape[1]
    L = cache.length
    inp = torch.cat([out[:, pos - 1: pos], drafts], 1)
    logits = logits_fix(model(inp, cache=cache).logits)  # [B, m + 1, V]
    if seen is not None:  # position j has seen the drafts before it
        cols, s = [], seen.clone()
        s.scatter_(1, out[:, pos - 1: pos], True)
        for j in range(m + 1):
            if j:
                s = s.clone().scatter_(1, drafts[:, j - 1: j], True)
            cols.append(apply_repetition_penalty(logits[:, j], s, penalty))
        logits = torch.stack(cols, 1)
    live = ~done
    if sp.do_sample:
        p = _probs(logits.reshape(B * (m + 1), -1), sp).view(B, m + 1, -1)
        if m:
            px = p[:, :m].gather(-1, drafts[..., None]).squeeze(-1)  # [B, m]
            qx = (q.gather(-1, drafts[..., None]).squeeze(-1) if q is not None
                  else torch.ones_like(px))
            u = torch.rand(B, m, generator=generator, device=px.device, dtype=px.dtype)
            ok = u * qx < px  # u < p / q, without dividing by a q of 0
        else:
            ok = torch.zeros(B, 0, dtype=torch.bool, device=p.device)
        a = _leading_true(ok)  # [B] accepted per row
        # each row's own token at position a: the residual at a rejection, p_m for a bonus
        pa = p[torch.arange(B), a]
        rejected = a < m
        if rejected.any():
            if q is not None:
                qa = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[torch.arange(B), a]
            else:
                qa = torch.zeros_like(pa)
                idx = a.clamp_max(m - 1)
                qa[rejected] = torch.nn.functional.one_hot(
                    drafts[torch.arange(B), idx], pa.shape[-1]).to(pa.dtype)[rejected]
            resid = torch.where(rejected[:, None], (pa - qa).clamp_min(0), pa)
            own = sample_categorical(resid / resid.sum(-1, keepdim=True), generator)
        else:
            own = sample_categorical(pa, generator)
        n = int(a[live].min()) if bool(live.any()) else 0
        nth = own if n == m else torch.where(a == n, own, drafts[:, n])
        block = torch.cat([drafts[:, :n], nth[:, None]], 1)
    else:
        target = logits.max(-1).indices  # [B, m + 1]
        a = _leading_true(drafts == target[:, :m])
        n = int(a[live].min()) if bool(live.any()) else 0
        block = target[:, : n + 1]
    cache.length = L + n + 1
    drafter.rollback(L + n + 1)
    n_live = int(live.sum())
    stats.drafted += m * n_live
    stats.accepted += n * n_live
    stats.forwards += 1
    stats.emitted += (n + 1) * n_live
    return block, m


def _leading_true(ok: torch.Tensor) -> torch.Tensor:
    """``ok [B, m]`` bool -> ``[B]`` long: how many leading entries of each row are True."""
    if ok.shape[1] == 0:
        return torch.zeros(ok.shape[0], dtype=torch.long, device=ok.device)
    return ok.long().cumprod(1).sum(1)
