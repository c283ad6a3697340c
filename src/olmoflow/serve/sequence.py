"""One running request's state in the serving engine: its sampler (settings, private random
generator, repetition-penalty memory), its logprobs, and its text with stop handling.

Text follows the OpenAI API and vLLM: the stop sequence is not returned, EOS and extra stop ids
end the sequence with ``"stop"`` without adding text, ``max_new_tokens`` ends it with
``"length"``. Pieces never split a UTF-8 character (:class:`~olmoflow.infer.streaming.
IncrementalDecoder`, after TGI's offsets), and text that could still grow into a stop string is
held back until it completes one (then dropped) or cannot any more (then released), as vLLM's
detokenizer does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from olmoflow.infer.generate import apply_repetition_penalty, sample_next
from olmoflow.infer.sampling import SamplingParams
from olmoflow.infer.streaming import IncrementalDecoder


@dataclass(frozen=True)
class TokenLogprob:
    """A token with its log-probability and the most likely alternatives at its position.

    ``logprob`` is the log-softmax of the raw (unscaled, vocab-masked) logits; ``token`` is the
    token decoded alone (may be partial UTF-8: use ``bytes``); ``top`` lists
    ``(id, text, bytes, logprob)`` most likely first (OpenAI's ``top_logprobs``).
    """

    token_id: int
    token: str
    bytes: list[int]
    logprob: float
    top: list[tuple[int, str, list[int], float]]


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: symbol -> byte (Radford et al. 2019,
    ``bytes_to_unicode``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenTexts:
    """Each id's text and raw bytes, cached: for a byte-level BPE tokenizer (``backend`` a
    ``tokenizers.Tokenizer`` with a ByteLevel decoder) the bytes come from the token's symbols,
    so a token holding part of a character still gets its exact bytes; otherwise (and for special
    tokens) from its decoded text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        backend = getattr(tokenizer, "backend", None)
        self._backend = None
        if backend is not None and type(getattr(backend, "decoder", None)).__name__ == "ByteLevel":
            self._backend = backend
            self._bytes = _byte_decoder()
            self._added = backend.get_added_tokens_decoder()

    def get(self, token_id: int) -> tuple[str, list[int]]:
        """``(text, bytes)`` of ``token_id``."""
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            raw = None
            if self._backend is not None and token_id not in self._added:
                symbols = self._backend.id_to_token(token_id)
                if symbols is not None and all(c in self._bytes for c in symbols):
                    raw = [self._bytes[c] for c in symbols]
            hit = (text, raw if raw is not None else list(text.encode("utf-8")))
            self._cache[token_id] = hit
        return hit


def token_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor | list[int], k: int,
                   texts: TokenTexts) -> list[TokenLogprob]:
    """One :class:`TokenLogprob` per row of ``logprobs [N, V]`` (already log-softmaxed) for the
    ids ``chosen [N]``, with the ``k`` most likely alternatives each (sorted, most likely
    first)."""
    chosen = torch.as_tensor(chosen, device=logprobs.device).long()
    lp = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
    if k > 0:
        vals, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
    out = []
    for r, tid in enumerate(chosen.tolist()):
        top = []
        if k > 0:
            for i, v in zip(ids[r], vals[r]):
                t, b = texts.get(i)
                top.append((i, t, b, v))
        t, b = texts.get(tid)
        out.append(TokenLogprob(tid, t, b, lp[r], top))
    return out


def masked_log_softmax(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``log_softmax`` in fp32 of ``logits [N, V]`` with ids ``>= vocab_size`` masked out."""
    logits = logits.float()
    if vocab_size < logits.shape[-1]:
        logits = logits.clone()
        logits[:, vocab_size:] = float("-inf")
    return torch.log_softmax(logits, dim=-1)


class Sequence:
    """The state of one request from admission to its last event.

    Args:
        request: a :class:`~olmoflow.serve.engine.GenerationRequest`.
        tokenizer: decodes the text.
        eos_ids: ids that end the sequence with ``"stop"`` (EOS, the request's stop ids).
        vocab_size: ids ``>= vocab_size`` are never sampled (the model's padding rows).
        max_context: the sequence ends with ``"length"`` when prompt + output reach it.
        device: for the random generator and the ``seen`` vector.
    """

    def __init__(self, request, tokenizer, eos_ids: set[int], vocab_size: int,
                 max_context: int, device: torch.device):
        self.request = request
        sp: SamplingParams = request.sampling
        self.sp = sp
        self.prompt = list(request.prompt_ids)
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.device = device
        seed = sp.seed if sp.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        # The generator of generate(): same device, same seed, one draw per sampled token.
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.seen: torch.Tensor | None = None
        self.output: list[int] = []
        self.decoder = IncrementalDecoder(tokenizer, self.prompt)
        self.text = ""          # text decoded so far (whole characters), stop search space
        self.emitted = 0        # characters of ``text`` already sent
        self.finish_reason: str | None = None
        self.stop_at: int | None = None  # end of the returned text when a stop string matched
        self.max_stop = max((len(s) for s in sp.stop), default=0)
        self.row: int | None = None       # slot row while running
        self.pending_ids: list[int] = []  # not yet sent in an event
        self.pending_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.first_event = True
        self.error: str | None = None     # why the engine failed this request
        self.closed = False               # the final event was sent

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def last_token(self) -> int:
        return self.output[-1]

    # -- sampling ----------------------------------------------------------------------------

    @property
    def eos_blocked(self) -> bool:
        """Whether EOS and the stop ids may not be picked now (``ignore_eos``, or fewer new
        tokens than ``min_tokens``)."""
        r = self.request
        return bool(self.eos_ids) and (r.ignore_eos or len(self.output) < r.min_tokens)

    @property
    def end_ids(self) -> list[int]:
        """The ids that end the sequence (EOS and the request's stop ids), sorted."""
        return sorted(self.eos_ids)

    @property
    def plain_greedy(self) -> bool:
        """Argmax decoding without a repetition penalty: rows like this are picked together."""
        return not self.sp.do_sample and self.sp.repetition_penalty == 1.0

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Choose the next token from this row's ``logits [1, V]`` (ids ``>= vocab_size``
        already at -inf): repetition penalty, then :func:`~olmoflow.infer.generate.sample_next`
        with this request's own settings and generator, in the order
        :func:`~olmoflow.infer.generate.generate` uses, so the token equals the one generate()
        would pick. Returns ``[1]`` long (on the logits' device: no sync here)."""
        sp = self.sp
        if sp.repetition_penalty != 1.0:
            if self.seen is None:
                self.seen = torch.zeros(1, logits.shape[-1], dtype=torch.bool,
                                        device=logits.device)
                self.seen[0, torch.tensor(self.prompt, device=logits.device)] = True
            logits = apply_repetition_penalty(logits, self.seen, sp.repetition_penalty)
        return sample_next(logits, do_sample=sp.do_sample, temperature=sp.temperature,
                           top_k=sp.top_k, top_p=sp.top_p, generator=self.generator)

    # -- text and stopping -------------------------------------------------------------------

    def append(self, tok: int, logprob: TokenLogprob | None = None) -> None:
        """Add the new token ``tok``; sets :attr:`finish_reason` when it ends the sequence."""
        self.output.append(tok)
        self.pending_ids.append(tok)
        if self.seen is not None:
            self.seen[0, tok] = True
        if logprob is not None:
            self.pending_logprobs.append(logprob)
        if tok in self.eos_ids:
            self._finish("stop")
            return
        self.text += self.decoder.push(tok)
        if self.sp.stop and self._find_stop():
            return
        if len(self.output) >= self.sp.max_new_tokens or \
                len(self.prompt) + len(self.output) >= self.max_context:
            self._finish("length")

    def _find_stop(self) -> bool:
        """Search the unsent text for a stop string (a stop never starts in sent text: text
        that could begin one is held back)."""
        tail = self.text[self.emitted:]
        best = None
        for s in self.sp.stop:
            i = tail.find(s)
            if i >= 0 and (best is None or i < best):
                best = i
        if best is None:
            return False
        self.stop_at = self.emitted + best
        self.finish_reason = "stop"
        return True

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.text += self.decoder.flush()
        if self.sp.stop:
            self._find_stop()  # the flushed bytes may complete a stop string
            self.finish_reason = reason if self.stop_at is None else "stop"

    def abort(self) -> None:
        """End with ``"abort"`` (unsent text is dropped)."""
        self.finish_reason = "abort"
        self.stop_at = self.emitted

    def _sendable_end(self) -> int:
        """How far into :attr:`text` an event may send now."""
        if self.stop_at is not None:
            return self.stop_at
        if self.finish_reason is not None or not self.sp.stop:
            return len(self.text)
        # Hold back the longest suffix that is a proper prefix of some stop string.
        tail = self.text[self.emitted:]
        for n in range(min(len(tail), self.max_stop - 1), 0, -1):
            suffix = tail[-n:]
            if any(s.startswith(suffix) for s in self.sp.stop):
                return len(self.text) - n
        return len(self.text)

    def take_event(self) -> tuple[str, list[int], list[TokenLogprob] | None,
                                  list[TokenLogprob | None] | None]:
        """The new text, ids, logprobs and (first event only) prompt logprobs since the last
        event; marks them sent."""
        end = max(self._sendable_end(), self.emitted)
        text = self.text[self.emitted:end]
        self.emitted = end
        ids, self.pending_ids = self.pending_ids, []
        lps = None
        if self.request.logprobs is not None:
            lps, self.pending_logprobs = self.pending_logprobs, []
        prompt_lps = None
        if self.first_event:
            prompt_lps = self.prompt_logprobs
            self.first_event = False
        return text, ids, lps, prompt_lps
