"""Text generation with a KV cache: greedy decoding and sampling (temperature, top-k, top-p),
a CTRL repetition penalty, EOS and stop strings, and a per-token hook for streaming. What to sample
is one :class:`~olmoflow.infer.sampling.SamplingParams` (or the ``transformers``-style keywords
that describe one).

Top-p follows Holtzman et al. 2020 ("nucleus sampling"): keep the smallest set of most likely
tokens whose probability mass reaches ``top_p``; the token that crosses the threshold is kept.
The repetition penalty follows Keskar et al. 2019 (CTRL) as in ``transformers``'
``RepetitionPenaltyLogitsProcessor``. Stop strings keep the stop string in the output, as
``transformers``' ``stop_strings`` does.

The decode loop is kept lean for batch-1 latency: it runs under ``torch.inference_mode`` (so the
model takes its inference path, see :meth:`olmoflow.model.olmo.Olmo.forward`), writes tokens into
one preallocated ``[B, T + n]`` tensor, and passes an attention mask to the prefill only, and only
when the prompts are padded (the KV cache remembers the pads: no per-step mask, no cumulative-sum
positions).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from olmoflow.infer.sampling import SamplingParams


def top_k_top_p_filter(
    logits: torch.Tensor, top_k: int | None, top_p: float | None,
) -> torch.Tensor:
    """Set filtered-out logits to -inf. ``logits [B, V]`` -> ``[B, V]``."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass *before* it already reaches top_p: the crossing token stays.
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: float,
) -> torch.Tensor:
    """CTRL repetition penalty. ``logits [B, V]``, ``seen [B, V]`` bool (token already in the
    prompt or the continuation) -> ``[B, V]``: seen logits > 0 are divided by ``penalty``, < 0
    multiplied by it (so ``penalty > 1`` always makes a seen token less likely)."""
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def sample_next(
    logits: torch.Tensor, *, do_sample: bool, temperature: float, top_k: int | None,
    top_p: float | None, generator: torch.Generator | None,
) -> torch.Tensor:
    """Pick the next token for each row. ``logits [B, V]`` -> ``[B]`` (long)."""
    if not do_sample or temperature == 0:
        # max(dim).indices is argmax (the first maximal index too) at about two thirds of its
        # cost on CPU for a [B, V] batch
        return logits.max(-1).indices
    logits = top_k_top_p_filter(logits.float() / temperature, top_k, top_p)
    return sample_categorical(logits.softmax(-1), generator)


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of ``probs [B, V]`` (rows summing to 1) -> ``[B]`` (long), by inverting
    the cumulative distribution: the first index whose cumulative probability exceeds a uniform
    draw. The same distribution as ``torch.multinomial``, at a twentieth of its cost on CPU (one
    cumulative sum and a binary search instead of its per-row setup), which matters when every
    decoding step of a batch of rollouts samples. A token of probability 0 (filtered by top-k or
    top-p) is never drawn: its cumulative value equals its predecessor's."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64,
                   device=probs.device) * total
    # u < total always (rand < 1), but rounding of the product must not reach the last value
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def _new_tokens(T: int, max_length: int | None, max_new_tokens: int | None) -> int | None:
    """``max_new_tokens`` from HF-style length arguments (None when neither is given)."""
    if max_new_tokens is None and max_length is not None:
        if max_length < T:
            raise ValueError(
                f"max_length={max_length} is shorter than the prompt ({T} tokens); "
                "max_length counts the prompt, use max_new_tokens to count new tokens only"
            )
        return max_length - T
    return max_new_tokens


def resolve_sampling(
    T: int,
    sampling: SamplingParams | None = None,
    *,
    max_length: int | None = None,
    max_new_tokens: int | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    stop_strings: Sequence[str] | None = None,
) -> SamplingParams:
    """The :class:`SamplingParams` of one call to :func:`generate` for a ``T``-token prompt:
    ``sampling`` itself, or the one the ``transformers``-style keywords describe (None: not given,
    their defaults apply; see :meth:`SamplingParams.from_hf_kwargs`).

    Raises:
        ValueError: both ``sampling`` and a sampling keyword; ``max_length`` shorter than the
            prompt; a :class:`~olmoflow.infer.sampling.SamplingError` for a value out of range.
    """
    hf = {"max_length": max_length, "max_new_tokens": max_new_tokens, "do_sample": do_sample,
          "temperature": temperature, "top_k": top_k, "top_p": top_p,
          "repetition_penalty": repetition_penalty, "seed": seed, "stop_strings": stop_strings}
    given = {k: v for k, v in hf.items() if v is not None}
    if sampling is not None:
        if given:
            raise ValueError(f"pass either sampling= or the keywords {', '.join(given)}, not both "
                             "(dataclasses.replace(sampling, ...) changes a field)")
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling= must be a SamplingParams, got {type(sampling).__name__}")
        return sampling
    n_new = _new_tokens(T, given.pop("max_length", None), given.pop("max_new_tokens", None))
    return SamplingParams.from_hf_kwargs(**({} if n_new is None else {"max_new_tokens": n_new}),
                                         **given)


def iter_tokens(
    model,
    input_ids: torch.Tensor,
    *,
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
    vocab_size: int | None = None,
    compile: bool | str = False,
) -> Iterator[torch.Tensor]:
    """Like :func:`generate`, but an iterator over the new tokens: one ``[B]`` long tensor per step.

    Arguments are checked eagerly (the errors of :func:`generate` are raised by this call, not by
    the first ``next``). The model is put in eval mode while iterating and restored afterwards.
    """
    B, T = input_ids.shape
    sp = resolve_sampling(
        T, sampling, max_length=max_length, max_new_tokens=max_new_tokens, do_sample=do_sample,
        temperature=temperature, top_k=top_k, top_p=top_p,
        repetition_penalty=repetition_penalty, seed=seed, stop_strings=stop_strings,
    )
    return _iter_tokens(model, input_ids, sp, attention_mask, eos_token_id, pad_token_id,
                        tokenizer, vocab_size, compile)


def decode_settings(input_ids, sp: SamplingParams, attention_mask, eos_token_id, pad_token_id,
                    tokenizer, vocab_size) -> tuple[int | None, int | None, list[str], int | None]:
    """The ``(eos_token_id, fill, stops, vocab_size)`` a decode loop over ``input_ids [B, T]``
    runs with: the tokenizer's EOS, pad and vocabulary size where not given, the id that fills
    finished rows (pad, else EOS) and the stop strings.

    Raises:
        ValueError: stop strings without a tokenizer, or on a batch without a fill id; an
            ``attention_mask`` whose shape is not ``input_ids``'.
    """
    B = input_ids.shape[0]
    if tokenizer is not None:  # a tokenizer knows its EOS and pad ids
        if eos_token_id is None:
            eos_token_id = getattr(tokenizer, "eos_token_id", None)
        if pad_token_id is None:
            pad_token_id = getattr(tokenizer, "pad_token_id", None)
    stops = list(sp.stop)
    if stops and tokenizer is None:
        raise ValueError("stop_strings need tokenizer= to decode the continuation")
    fill = pad_token_id if pad_token_id is not None else eos_token_id
    if stops and B > 1 and fill is None:
        raise ValueError("stop_strings on a batch need pad_token_id (or eos_token_id) to fill rows "
                         "that stopped")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} does not match input_ids "
                         f"{tuple(input_ids.shape)}")
    if vocab_size is None and tokenizer is not None and hasattr(tokenizer, "vocab_size"):
        vocab_size = tokenizer.vocab_size
    return eos_token_id, fill, stops, vocab_size


class RowEnds:
    """Which rows of a decoding batch have ended (EOS or a completed stop string), the one rule
    every decode loop applies to each new position's tokens.

    ``done`` is ``[B]`` bool; ``lengths`` (``[B]`` long, when given) gets each row's count of new
    tokens up to and including the one that ended it, ``n_new`` for a row that never ends.
    """

    def __init__(self, B: int, device, n_new: int, eos_token_id, fill, stops, tokenizer,
                 lengths: torch.Tensor | None = None):
        self.eos_token_id, self.fill, self.stops = eos_token_id, fill, stops
        self.tokenizer, self.lengths = tokenizer, lengths
        if lengths is not None:
            lengths.fill_(n_new)
        self.window = max((len(s.encode()) for s in stops), default=0) + 2  # tokens; each >= 1 byte
        self.generated: list[list[int]] = [[] for _ in range(B)]
        self.check = eos_token_id is not None or bool(stops)
        self.done = torch.zeros(B, dtype=torch.bool, device=device)

    def mark(self, nxt: torch.Tensor, i: int) -> tuple[torch.Tensor, bool]:
        """Take new position ``i``'s tokens ``nxt [B]``: returns the tokens to write (``fill`` for
        a row that had already ended) and whether every row has ended."""
        if not self.check:
            return nxt, False
        done = self.done
        if self.fill is not None:
            nxt = torch.where(done, torch.full_like(nxt, self.fill), nxt)
        before = done.clone() if self.lengths is not None else None
        if self.eos_token_id is not None:
            done.logical_or_(nxt == self.eos_token_id)
        if self.stops:
            done.logical_or_(_hit_stop(nxt, done, self.generated, self.stops, self.window,
                                       self.tokenizer))
        if before is not None:
            self.lengths[(done & ~before).to(self.lengths.device)] = i + 1
        return nxt, bool(done.all())


def _iter_tokens(model, input_ids, sp: SamplingParams, attention_mask, eos_token_id,
                 pad_token_id, tokenizer, vocab_size, compile,
                 lengths: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
    eos_token_id, fill, stops, vocab_size = decode_settings(
        input_ids, sp, attention_mask, eos_token_id, pad_token_id, tokenizer, vocab_size)
    return _decode(model, input_ids, sp.max_new_tokens, attention_mask, sp.do_sample,
                   sp.temperature, sp.top_k, sp.top_p, sp.repetition_penalty, eos_token_id, fill,
                   stops, tokenizer, sp.seed, vocab_size, _compiled_decoder(model, compile),
                   lengths)


def _decode(model, input_ids, n_new, attention_mask, do_sample, temperature, top_k, top_p,
            penalty, eos_token_id, fill, stops, tokenizer, seed, vocab_size,
            compiled, lengths=None) -> Iterator[torch.Tensor]:
    B, T = input_ids.shape
    device = input_ids.device
    # lengths [B], when given: see RowEnds
    ends = RowEnds(B, device, n_new, eos_token_id, fill, stops, tokenizer, lengths)
    if n_new == 0:
        return
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    # The prompt's mask goes to the prefill only (the cache keeps it); None when nothing is
    # padded, which lets the model skip positions-from-mask and padding masks altogether.
    prompt_mask = None
    if attention_mask is not None and not bool(attention_mask.all()):
        prompt_mask = attention_mask.bool()
    seen = None
    was_training = model.training
    cache = None

    @torch.inference_mode()
    def step(i: int, nxt: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
        # Inference mode only around the compute: it must not leak to the caller between yields.
        nonlocal cache, seen
        if nxt is None:
            cache = (model.new_cache(B, T + n_new, static=True) if compiled is not None
                     else model.new_cache(B, T + n_new))
            logits = model(input_ids, attention_mask=prompt_mask, cache=cache,
                           last_logits_only=True).logits[:, -1]
            if penalty != 1.0:
                real = (attention_mask if attention_mask is not None
                        else torch.ones_like(input_ids)).int()
                counts = torch.zeros(B, logits.shape[-1], dtype=torch.int32, device=device)
                seen = counts.scatter_add_(1, input_ids, real) > 0
        else:
            if seen is not None:
                seen.scatter_(1, nxt[:, None], True)
            # No mask after the prefill: the cache remembers the pads (new tokens are real), so a
            # step builds no positions-from-mask and no per-step mask copy.
            if compiled is not None:  # static cache: same shapes every step, one compiled graph
                logits = compiled(nxt[:, None], cache=cache, last_logits_only=True).logits[:, -1]
            else:
                logits = model(nxt[:, None], cache=cache, last_logits_only=True).logits[:, -1]
        if vocab_size is not None and vocab_size < logits.shape[-1]:
            logits[:, vocab_size:] = float("-inf")
        if seen is not None:
            logits = apply_repetition_penalty(logits, seen, penalty)
        nxt = sample_next(logits, do_sample=do_sample, temperature=temperature, top_k=top_k,
                          top_p=top_p, generator=generator)
        return ends.mark(nxt, i)

    model.eval()
    try:
        nxt = None
        for i in range(n_new):
            nxt, all_done = step(i, nxt)
            yield nxt
            if all_done:
                break
    finally:
        model.train(was_training)


# Batch sizes a long-running caller pads its compiled decode steps to (see decode_bucket).
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def decode_bucket(rows: int, buckets: Sequence[int] = DECODE_BUCKETS) -> int:
    """The batch size a compiled decode step over ``rows`` live sequences should run at: the
    smallest of ``buckets`` that holds them.

    ``compile=True`` compiles with ``dynamic=False``: one graph per input shape, that is per
    (batch size, static cache length). A long-running server that batches a changing number of
    sequences therefore keeps one static cache per bucket (``model.new_cache(decode_bucket(n),
    max_context, static=True)``, the same ``max_context`` always), puts its ``n`` real rows
    first and fills the other rows with any token id (their keys and logits are never read), and
    drops those rows' logits: it compiles once per bucket, the first time the bucket is used
    (vLLM pads its CUDA-graph batch sizes the same way). ``torch.compile`` keeps at most
    ``torch._dynamo.config.recompile_limit`` graphs (8 by default) per compiled function before
    falling back to eager, so the buckets times the cache lengths used should stay below it.

    Raises:
        ValueError: ``rows < 1`` or more rows than the largest bucket.
    """
    if rows < 1:
        raise ValueError(f"decode_bucket needs at least one row, got {rows}")
    for b in sorted(buckets):
        if b >= rows:
            return b
    raise ValueError(f"{rows} rows exceed the largest decode bucket {max(buckets)}")


def _compiled_decoder(model, compile: bool | str):
    """``torch.compile(model)`` for decode steps, cached on the model per backend (one compiled
    wrapper: new shapes add graphs to it, see :func:`decode_bucket`); None when off."""
    if not compile:
        return None
    backend = "inductor" if compile is True else str(compile)
    # Kept beside the model, not on it: a compiled wrapper inside the module would break deepcopy.
    per_model = _COMPILED.setdefault(model, {})
    if backend not in per_model:
        per_model[backend] = torch.compile(model, backend=backend, dynamic=False)
    return per_model[backend]


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _hit_stop(nxt, done, generated, stops, window, tokenizer) -> torch.Tensor:
    """Rows whose continuation now contains a stop string. A match must involve the newest token
    (else an earlier step would have stopped), so only the last ``window`` tokens are decoded."""
    hit = torch.zeros_like(done)
    for row, (tok, finished) in enumerate(zip(nxt.tolist(), done.tolist())):
        if finished:
            continue
        generated[row].append(tok)
        tail = tokenizer.decode(generated[row][-window:], skip_special_tokens=True)
        if any(s in tail for s in stops):
            hit[row] = True
    return hit


def generate(
    model,
    input_ids: torch.Tensor,
    *,
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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Continue ``input_ids [B, T]`` and return ``[B, T + n]`` (prompt included), as in HF; with
    ``return_lengths``, also ``[B]`` long: each row's new tokens up to and including the one that
    ended it (its EOS, or the token completing a stop string), ``n`` for a row that ran to the
    limit (the rest of a row is fill).

    How to sample is given either as ``sampling=`` (a :class:`SamplingParams`, shared with the
    ``generate`` stage, evaluation and serving) or as ``transformers``-style keywords
    (``max_length``/``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
    ``repetition_penalty``, ``seed``, ``stop_strings``), not both. The two spellings give the same
    tokens: ``generate(m, ids, sampling=SamplingParams(max_new_tokens=8, temperature=0.7,
    seed=0))`` equals ``generate(m, ids, max_new_tokens=8, do_sample=True, temperature=0.7,
    seed=0)``.

    Args:
        sampling: the sampling settings; see :class:`SamplingParams` for each field.
        max_length: total length including the prompt; max_new_tokens: tokens to add (takes
            precedence when both are given). Neither: 20 new tokens.
        attention_mask: ``[B, T]``, 0 on left padding (batched prompts of different lengths).
        do_sample: sample instead of greedy argmax (default False); temperature (default 1.0),
            top_k, top_p shape the sampling.
        repetition_penalty: CTRL penalty (``transformers``' ``RepetitionPenaltyLogitsProcessor``)
            on every token already in the prompt (padding excluded) or the continuation; applied
            before temperature/top-k/top-p and to greedy decoding too. 1.0 (default) = off; ~1.2
            is common.
        eos_token_id: a row stops after emitting it; finished rows are filled with
            ``pad_token_id`` (or EOS) until every row is done.
        stop_strings: a row stops once the text of its continuation (``tokenizer.decode`` of the
            new ids, special tokens skipped) contains one of them. The stop string is KEPT in the
            output (the tokens up to and including the one completing it), as in ``transformers``;
            trim it from the decoded text yourself if unwanted.
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)``; needed by stop_strings.
            When given, its ``eos_token_id``/``pad_token_id`` are the defaults for those arguments.
        seed: seeds a private generator so sampling is reproducible.
        compile: decode with ``torch.compile(model)`` over a static-shape KV cache (True: the
            inductor backend; a string names another backend). The first call compiles (seconds);
            later calls with the same batch size and length reuse the graph (a server pads to
            a few batch sizes: :func:`decode_bucket`). Prefill stays eager.
        vocab_size: never emit ids at or above it. The embedding is padded past the tokenizer's
            vocabulary (to a multiple of 128, as OLMo does); those rows are never trained, so a
            barely trained model can pick them. Defaults to the vocabulary of ``tokenizer``.
        streamer: an object with ``put(tokens [B])`` called with each new step's tokens and
            ``end()`` called once at the end (e.g. :class:`olmoflow.infer.streaming.TextStreamer`).
    Raises:
        ValueError: ``sampling`` together with a sampling keyword, ``max_length`` shorter than the
            prompt, stop_strings without a tokenizer (or, on a batch, without a pad/EOS id to fill
            finished rows), and (as :class:`~olmoflow.infer.sampling.SamplingError`) a negative
            ``max_new_tokens``, a temperature < 0, a repetition_penalty <= 0, a top_k < 0 or a
            top_p outside (0, 1].
    """
    B, T = input_ids.shape
    sp = resolve_sampling(
        T, sampling, max_length=max_length, max_new_tokens=max_new_tokens, do_sample=do_sample,
        temperature=temperature, top_k=top_k, top_p=top_p,
        repetition_penalty=repetition_penalty, seed=seed, stop_strings=stop_strings,
    )
    lengths = torch.empty(B, dtype=torch.long) if return_lengths else None
    steps = _iter_tokens(model, input_ids, sp, attention_mask, eos_token_id, pad_token_id,
                         tokenizer, vocab_size, compile, lengths)
    out = torch.empty(B, T + sp.max_new_tokens, dtype=input_ids.dtype, device=input_ids.device)
    out[:, :T] = input_ids
    n = 0
    for n, nxt in enumerate(steps, start=1):
        out[:, T + n - 1] = nxt
        if streamer is not None:
            streamer.put(nxt)
    if streamer is not None:
        streamer.end()
    return (out[:, : T + n], lengths) if return_lengths else out[:, : T + n]
