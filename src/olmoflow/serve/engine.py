"""Continuous batching over one Olmo model (Yu et al. 2022, "Orca"; vLLM's scheduler).

A background thread loops: drop aborted requests, admit waiting ones (FIFO) into free slots of a
:class:`~olmoflow.serve.slots.SlotKVCache` and prefill each alone, then run ONE decode step
``[n, 1]`` for every running sequence together, sample each row with its own settings and random
generator (the functions :func:`~olmoflow.infer.generate.generate` uses, on that row's ``[1, V]``
logits, so a request's tokens never depend on its neighbours), send events, and free the slots
of finished sequences at once. The thread sleeps on a condition variable when there is nothing
to do. Events go to per-request callbacks from the engine thread; :meth:`Engine.generate` wraps
them as an asyncio iterator.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from olmoflow.errors import OlmoflowError
from olmoflow.infer.generate import sample_next
from olmoflow.infer.sampling import SamplingParams
from olmoflow.serve.sequence import (
    Sequence,
    TokenLogprob,
    TokenTexts,
    masked_log_softmax,
    token_logprobs,
)
from olmoflow.serve.slots import SlotKVCache

__all__ = ["Engine", "EngineConfigError", "GenerationRequest", "QueueFull", "RequestOutput",
           "TokenLogprob"]

log = logging.getLogger(__name__)


class EngineConfigError(OlmoflowError, ValueError):
    """Engine settings out of range (a user's ``--max-context`` longer than the model's, ...):
    an :class:`OlmoflowError` for the CLI's one-line message, and a :class:`ValueError`."""


class QueueFull(OlmoflowError):
    """:meth:`Engine.submit` while ``max_queue`` requests already wait (a server answers 429)."""


@dataclass(frozen=True)
class GenerationRequest:
    """One request, already tokenized (the API applies the chat template).

    Attributes:
        request_id: unique among running and waiting requests.
        prompt_ids: the prompt's token ids (non-empty).
        sampling: max_new_tokens, temperature, top_k, top_p, repetition_penalty, seed (None: a
            random seed), stop strings.
        logprobs: None for none; ``k >= 0``: each new token's logprob plus the ``k`` most likely
            alternatives (OpenAI ``logprobs`` / ``top_logprobs``).
        prompt_logprobs: the logprob of each prompt token given the ones before (first: None),
            for ``echo=True`` with logprobs.
        stop_token_ids: more ids that end the sequence with ``"stop"`` (EOS always does).
        min_tokens: EOS and the stop ids cannot be picked before this many new tokens (vLLM's
            ``min_tokens``: their logits are set to -inf for picking; logprobs stay the model's).
        ignore_eos: EOS and the stop ids are never picked (vLLM's ``ignore_eos``): the sequence
            runs to ``max_new_tokens``, the context's end or a stop string.
    """

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: int | None = None
    prompt_logprobs: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False


@dataclass
class RequestOutput:
    """One event of a request; the last one has ``finish_reason`` set.

    ``text`` and ``token_ids`` are NEW since the previous event (whole UTF-8 characters; stop
    strings removed; text that might begin a stop string held back until known).
    ``num_generated_tokens`` counts every new token so far, the one that ended the sequence (EOS,
    stop id, the token completing a stop string) included, as vLLM's usage does.
    ``finish_reason``: None while running, ``"stop"``, ``"length"`` or ``"abort"``; ``error`` says
    why when the engine failed the request.
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob | None] | None
    num_prompt_tokens: int
    num_generated_tokens: int
    finish_reason: str | None
    error: str | None = None


Callback = Callable[[RequestOutput], None]


class Engine:
    """Continuous batching over one Olmo model: a background thread loops: admit waiting requests
    into free slots (prefill each), then one decode step for every running sequence together;
    finished / aborted sequences free their slot at once.

    Args:
        model: an :class:`~olmoflow.model.olmo.Olmo` (put in eval mode).
        tokenizer: with ``decode``, ``vocab_size`` and ``eos_token_id``.
        max_batch: sequences decoded together (slots of the KV cache).
        max_queue: waiting requests beyond which :meth:`submit` raises :class:`QueueFull`.
        max_context: prompt + new tokens per sequence; default the model's
            ``max_sequence_length``. KV memory is ``2 * n_layers * max_batch * max_context *
            n_kv_heads * head_dim`` elements, allocated at construction.
        device: default the model's.
    Raises:
        EngineConfigError: (a ValueError) ``max_batch`` < 1, ``max_queue`` < 0, or
            ``max_context`` outside ``1 .. max_sequence_length``.
    """

    def __init__(self, model, tokenizer, *, max_batch: int = 32, max_queue: int = 256,
                 max_context: int | None = None, device=None):
        if max_batch < 1 or max_queue < 0:
            raise EngineConfigError(f"max_batch must be >= 1 and max_queue >= 0, got "
                                    f"{max_batch}, {max_queue}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device) if device is not None else model.device
        self.max_batch, self.max_queue = max_batch, max_queue
        longest = model.config.max_sequence_length
        self.max_context = int(max_context or longest)
        if not 1 <= self.max_context <= longest:
            raise EngineConfigError(f"max_context must be in 1..{longest} (the model's "
                                    f"max_sequence_length), got {max_context}")
        self.vocab_size = int(getattr(tokenizer, "vocab_size", model.config.vocab_size))
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.cache = SlotKVCache.for_model(model, max_batch, self.max_context)
        self.texts = TokenTexts(tokenizer)
        self._cv = threading.Condition()
        self._waiting: collections.deque[tuple[Sequence, Callback]] = collections.deque()
        self._aborts: set[str] = set()
        self._ids: set[str] = set()  # waiting or running
        self._running: list[tuple[Sequence, Callback]] = []  # index == slot row
        self._thread: threading.Thread | None = None
        self._stopping = False  # the loop should exit
        self._stopped = False   # stop() was called and start() not since
        self._steps = 0
        self._generated = 0
        self._prefill_tokens = 0

    # -- public API --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop thread (idempotent; also after :meth:`stop`)."""
        with self._cv:
            self._stopped = False
            self._ensure_thread()

    def _ensure_thread(self) -> None:
        """Start the loop thread unless it runs or the engine was stopped (lock held)."""
        if not self._stopped and (self._thread is None or not self._thread.is_alive()):
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="olmoflow-engine",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Abort every request (each gets a final ``"abort"`` event) and join the thread.

        Raises:
            RuntimeError: called from the engine thread (an event callback): it cannot join
                itself; call :meth:`abort` there instead.
        """
        with self._cv:
            thread = self._thread
            if thread is threading.current_thread():
                raise RuntimeError("Engine.stop() from an event callback; use abort() there")
            self._stopping = self._stopped = True
            self._cv.notify_all()
        if thread is not None:
            thread.join()
        self._thread = None
        self._abort_all()

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def submit(self, request: GenerationRequest, callback: Callback) -> None:
        """Queue ``request``; ``callback`` receives its events from the engine thread (the last
        with ``finish_reason`` set). Thread-safe; starts the loop if needed. After
        :meth:`stop` (a server shutting down) the request ends at once with ``"abort"``.

        Raises:
            QueueFull: ``max_queue`` requests already wait.
            ValueError: empty prompt, a prompt id outside the model's vocabulary,
                prompt + ``max_new_tokens`` over ``max_context``, a negative ``min_tokens``, or
                a request id already waiting or running.
        """
        n = len(request.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        new = request.sampling.max_new_tokens
        if n + new > self.max_context:
            raise ValueError(f"prompt ({n} tokens) + max_new_tokens ({new}) = {n + new} is over "
                             f"the context of {self.max_context} tokens")
        V = self.model.config.vocab_size
        if any(not 0 <= int(t) < V for t in request.prompt_ids):
            raise ValueError(f"prompt token ids must be in 0..{V - 1}")
        if request.logprobs is not None and request.logprobs < 0:
            raise ValueError(f"logprobs must be None or >= 0, got {request.logprobs}")
        if request.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {request.min_tokens}")
        eos = {int(t) for t in request.stop_token_ids}
        if self.eos_token_id is not None:
            eos.add(int(self.eos_token_id))
        seq = Sequence(request, self.tokenizer, eos, self.vocab_size, self.max_context,
                       self.device)
        with self._cv:
            stopped = self._stopped
            if not stopped:
                if request.request_id in self._ids:
                    raise ValueError(f"request id '{request.request_id}' is already running")
                if len(self._waiting) >= self.max_queue:
                    raise QueueFull(f"{len(self._waiting)} requests already wait (max_queue "
                                    f"{self.max_queue}); retry later")
                self._ids.add(request.request_id)
                self._aborts.discard(request.request_id)
                self._waiting.append((seq, callback))
                self._ensure_thread()
                self._cv.notify_all()
        if stopped:
            seq.abort()
            self._emit(seq, callback)

    def abort(self, request_id: str) -> None:
        """Abort a waiting or running request: its slot is freed before the next step and a
        final ``"abort"`` event follows. Thread-safe, idempotent; unknown ids are ignored."""
        with self._cv:
            if request_id in self._ids:
                self._aborts.add(request_id)
                self._cv.notify_all()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Submit ``request`` and yield its events as they come (asyncio). If the consumer stops
        iterating (a client disconnect: ``CancelledError`` or ``aclose``), the request is
        aborted. Raises what :meth:`submit` raises, at the first iteration."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def callback(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, out)

        self.submit(request, callback)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finish_reason is not None
                yield out
        finally:
            if not finished:
                self.abort(request.request_id)

    def stats(self) -> dict:
        """``running``, ``waiting``, ``max_batch``, ``max_queue``, ``max_context``, ``steps``
        (decode steps so far), ``tokens_generated``, ``prompt_tokens`` (prefilled),
        ``kv_cache_bytes``."""
        with self._cv:
            return {"running": len(self._running), "waiting": len(self._waiting),
                    "max_batch": self.max_batch, "max_queue": self.max_queue,
                    "max_context": self.max_context, "steps": self._steps,
                    "tokens_generated": self._generated, "prompt_tokens": self._prefill_tokens,
                    "kv_cache_bytes": self.cache.nbytes()}

    # -- the loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while (not self._stopping and not self._waiting and not self._running
                       and not self._aborts):
                    self._cv.wait()
                if self._stopping:
                    return
                aborts, self._aborts = self._aborts, set()
                admitted = []
                while self._waiting and len(self._running) + len(admitted) < self.max_batch:
                    admitted.append(self._waiting.popleft())
                dropped = [w for w in self._waiting if w[0].request_id in aborts]
                for w in dropped:
                    self._waiting.remove(w)
            try:
                self._iteration(aborts, admitted, dropped)
            except Exception as e:  # a bug: fail what is running, keep serving
                log.exception("serving engine step failed")
                error = f"engine error: {type(e).__name__}: {e}"
                self._fail_running(error)
                for seq, cb in admitted + dropped:  # taken off the queue, not yet answered
                    if not seq.closed:
                        self._finish_failed(seq, cb, error)

    def _iteration(self, aborts: set[str], admitted, dropped) -> None:
        for seq, cb in dropped:
            seq.abort()
            self._emit(seq, cb)
        for i in reversed(range(len(self._running))):
            if self._running[i][0].request_id in aborts:
                seq, cb = self._running[i]
                seq.abort()
                self._free(i)
                self._emit(seq, cb)
        for seq, cb in admitted:
            if seq.request_id in aborts:
                seq.abort()
                self._emit(seq, cb)
                continue
            self._admit(seq, cb)
        if self._running:
            self._decode_step()

    @torch.inference_mode()
    def _admit(self, seq: Sequence, cb: Callback) -> None:
        """Prefill ``seq`` alone into a new slot row and pick its first token."""
        try:
            want_prompt_lp = seq.request.prompt_logprobs
            if seq.sp.max_new_tokens == 0 and not want_prompt_lp:
                seq.finish_reason = "length"
                self._emit(seq, cb)
                return
            row = self.cache.add_row()
            seq.row = row
            self._running.append((seq, cb))
            ids = torch.tensor([seq.prompt], dtype=torch.long, device=self.device)
            cache = self.cache.row_cache(row)
            logits = self.model(ids, cache=cache, last_logits_only=not want_prompt_lp).logits[0]
            self.cache.set_length(row, len(seq.prompt))
            self._prefill_tokens += len(seq.prompt)
            if want_prompt_lp:
                self._prompt_logprobs(seq, logits)
            if seq.sp.max_new_tokens == 0:
                seq.finish_reason = "length"
            else:
                self._sample([seq], logits[-1:])
            if seq.error is not None:
                raise RuntimeError(seq.error)
        except Exception as e:
            log.exception("prefill of request %s failed", seq.request_id)
            seq.finish_reason = "abort"
            self._finish_failed(seq, cb, f"prefill failed: {type(e).__name__}: {e}")
            return
        self._after_token(seq, cb)

    def _prompt_logprobs(self, seq: Sequence, logits: torch.Tensor) -> None:
        lp = masked_log_softmax(logits[:-1], self.vocab_size)
        k = seq.request.logprobs or 0
        seq.prompt_logprobs = [None] + token_logprobs(lp, seq.prompt[1:], k, self.texts)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Pick and append one token for each of ``seqs`` from its row of ``logits [n, V]``
        (raw; masked here in place). Plain greedy rows share one argmax (row by row the same
        result); every other row is sampled alone with its own settings and generator; the
        picks reach the host in one transfer. A row whose sampling fails is marked with its
        error and the others go on."""
        if self.vocab_size < logits.shape[-1]:
            logits[:, self.vocab_size:] = float("-inf")
        # Rows that may not end yet (min_tokens, ignore_eos) pick from a copy with their end
        # ids masked; the logprobs below are the model's own.
        blocked = [r for r, s in enumerate(seqs) if s.eos_blocked]
        choose = logits
        if blocked:
            choose = logits.clone()
            for r in blocked:
                choose[r, seqs[r].end_ids] = float("-inf")
        picks = torch.zeros(len(seqs), dtype=torch.long, device=logits.device)
        greedy = [r for r, s in enumerate(seqs) if s.plain_greedy]
        if greedy:
            rows = torch.tensor(greedy, device=logits.device)
            picks[rows] = sample_next(choose[rows], do_sample=False, temperature=0.0,
                                      top_k=None, top_p=None, generator=None)
        for r, seq in enumerate(seqs):
            if not seq.plain_greedy:
                try:
                    picks[r] = seq.pick(choose[r : r + 1])[0]
                except Exception as e:
                    log.exception("sampling for request %s failed", seq.request_id)
                    seq.error = f"sampling failed: {type(e).__name__}: {e}"
        want = [r for r, s in enumerate(seqs) if s.request.logprobs is not None and not s.error]
        lps: dict[int, TokenLogprob] = {}
        if want:
            rows = torch.tensor(want, device=logits.device)
            lp = torch.log_softmax(logits[rows].float(), dim=-1)
            k = max(seqs[r].request.logprobs for r in want)
            entries = token_logprobs(lp, picks[rows], k, self.texts)
            for r, entry in zip(want, entries):
                n = seqs[r].request.logprobs
                lps[r] = TokenLogprob(entry.token_id, entry.token, entry.bytes, entry.logprob,
                                      entry.top[:n])
        for r, (seq, tok) in enumerate(zip(seqs, picks.tolist())):
            if seq.error is None:
                seq.append(tok, lps.get(r))
                self._generated += 1

    @torch.inference_mode()
    def _decode_step(self) -> None:
        """One forward ``[n, 1]`` over every running row, then per-row sampling."""
        ids = torch.tensor([[s.last_token] for s, _ in self._running], dtype=torch.long,
                           device=self.device)
        try:
            logits = self.model(ids, cache=self.cache, last_logits_only=True).logits[:, -1]
        except Exception as e:
            log.exception("decode step failed")
            self._fail_running(f"decode step failed: {type(e).__name__}: {e}")
            return
        self._steps += 1
        self._sample([s for s, _ in self._running], logits)
        # Events after the whole step; finished rows are freed from the last down so the
        # compaction moves never touch a row still to be visited.
        for row in reversed(range(len(self._running))):
            seq, cb = self._running[row]
            if seq.error is not None:
                self._finish_failed(seq, cb, seq.error)
                continue
            if seq.finish_reason is not None:
                self._free(row)
            self._emit(seq, cb)

    def _after_token(self, seq: Sequence, cb: Callback) -> None:
        if seq.finish_reason is not None and seq.row is not None:
            self._free(self._row_of(seq))
        self._emit(seq, cb)

    def _row_of(self, seq: Sequence) -> int:
        for i, (s, _) in enumerate(self._running):
            if s is seq:
                return i
        raise RuntimeError(f"request {seq.request_id} holds no slot")

    def _free(self, row: int) -> None:
        """Release slot ``row``; the last running sequence moves into it."""
        seq, _ = self._running[row]
        moved = self.cache.remove_row(row)
        last = self._running.pop()
        if moved is not None:
            self._running[row] = last
            last[0].row = row
        seq.row = None

    def _emit(self, seq: Sequence, cb: Callback, error: str | None = None) -> None:
        text, ids, lps, prompt_lps = seq.take_event()
        done = seq.finish_reason is not None
        if not done and not text and not ids:
            return
        if done:
            seq.closed = True
            with self._cv:
                self._ids.discard(seq.request_id)
                self._aborts.discard(seq.request_id)
        out = RequestOutput(seq.request_id, text, ids, lps, prompt_lps, len(seq.prompt),
                            len(seq.output), seq.finish_reason, error)
        try:
            cb(out)
        except Exception:
            # A consumer that cannot take events (its event loop closed) is gone: stop its work.
            log.exception("callback of request %s failed; aborting it", seq.request_id)
            if not done:
                self.abort(seq.request_id)

    def _finish_failed(self, seq: Sequence, cb: Callback, error: str) -> None:
        if seq.row is not None:
            self._free(self._row_of(seq))
        seq.abort()
        self._emit(seq, cb, error)

    def _fail_running(self, error: str) -> None:
        for seq, cb in list(reversed(self._running)):
            self._finish_failed(seq, cb, error)

    def _abort_all(self) -> None:
        """After the thread has ended: abort what runs and what waits."""
        for seq, cb in list(reversed(self._running)):
            self._free(self._row_of(seq))
            seq.abort()
            self._emit(seq, cb)
        with self._cv:
            waiting = list(self._waiting)
            self._waiting.clear()
            self._aborts.clear()
        for seq, cb in waiting:
            seq.abort()
            self._emit(seq, cb)
