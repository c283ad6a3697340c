"""Post-training data: published SFT and preference formats to conversations, then to token ids.

Readers (one record at a time; the format is detected per record unless forced with
``format=``) turn each format into conversations, ``[{"role", "content"}, ...]`` with roles
``system``/``user``/``assistant`` (and ``environment``/``tool`` where the data has them):

SFT (:data:`SFT_FORMATS`):

- ``messages``: ``{"messages": [{"role", "content"}, ...]}`` (Tülu 3 / OLMo SFT mixtures,
  open-instruct);
- ``alpaca``: ``{"instruction", "input", "output"}`` (+ optional ``system`` and ``history``
  ``[[query, response], ...]`` as LLaMA-Factory reads them); the user turn is the instruction,
  a newline and the input when there is one (LLaMA-Factory's ``"\\n".join``);
- ``sharegpt``: ``{"conversations": [{"from", "value"}, ...]}`` with ``from`` in
  ``human``/``gpt``/``system`` (``user``/``assistant``/``observation`` also read), optional
  top-level ``system``;
- ``self_instruct``: ``{"instruction", "instances": [{"input", "output"}, ...]}``
  (yizhongw/self-instruct seed and user-oriented tasks): one conversation per instance;
- ``sep``: ``instruction [SEP] response`` lines (OLMo's instruction-tuning format): a line of a
  plain text file (or a string record) with exactly one ``" [SEP] "`` is read as a user turn and
  an assistant turn, loss on the response only (``format=sep`` reads ``{"text"}`` records so too);
- ``text``: ``{"text": ...}`` records or the lines of a plain text file, pretraining style
  (every token trained, EOS appended). A text record that contains ``[SEP]`` but is trained as
  text (a JSON ``text`` field, ``format=text``, or not exactly one ``" [SEP] "``) is counted
  (``stats.sep_as_text``) and warned about once.

Preference pairs (:data:`PREFERENCE_FORMATS`), each as ``(prompt turns, chosen turns, rejected
turns)``, the responses being the assistant turns after the shared prompt:

- ``hh_rlhf``: ``{"chosen", "rejected"}`` full dialogues ``"\\n\\nHuman: ...\\n\\nAssistant:
  ..."`` (Anthropic HH-RLHF). The prompt is the two strings' common prefix cut back to its last
  ``"\\n\\nAssistant:"`` (as TRL's ``hh-rlhf-helpful-base`` script does), so a response that
  itself contains ``"\\n\\nAssistant:"`` or ``"\\n\\nHuman:"`` stays whole;
- ``prompt``: ``{"prompt", "chosen", "rejected"}``, each a string or messages (a ``chosen`` list
  that repeats the prompt turns first, as UltraFeedback-binarized does, has them removed);
- ``messages``: ``{"chosen": [...], "rejected": [...]}`` message lists without a prompt: the
  prompt is their common leading turns;
- ``sharegpt``: ``{"conversations", "chosen": {"from", "value"}, "rejected": {...}}``
  (LLaMA-Factory ``dpo_en_demo``);
- ``stack_exchange``: ``{"question", "response_j", "response_k"}``, ``response_j`` preferred
  (lvwerra/stack-exchange-paired, torchtune's test copy).

Bad input — a malformed line, an unknown format or role, a conversation with no assistant turn,
a pair with an empty response, a conversation the template cannot render — is skipped, counted
in :class:`DataStats` and logged as a warning naming ``file:line``; under ``strict`` it raises
:class:`~olmoflow.errors.OlmoflowError` naming ``file:line`` instead. So is, each counted under
its own name, an example with nothing to train on (``no assistant tokens``: e.g. a ShareGPT
record whose only assistant turn is empty and comes first; for pairs ``no response tokens``) and
a pair whose chosen and rejected responses are the same (``identical chosen and rejected``,
as messages or as tokens: its DPO loss is ln 2 whatever the model).

Too-long examples (:func:`sft_examples`, :func:`preference_examples`) are never cut through an
assistant turn's end marker: ``on_too_long="drop"`` drops them, ``"truncate"`` removes whole
turns (SFT: from the end, so the kept conversation ends with a complete assistant turn and its
marker; pairs: the oldest prompt turns, never the responses) and drops the example when even the
shortest such conversation does not fit. Both are counted (``stats.truncated``,
``stats.dropped``). Plain ``text`` records have no turns: they are cut to ``max_length`` tokens
(``"truncate"``) or dropped, and counted the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from olmoflow.errors import OlmoflowError, closest
from olmoflow.eval.sources import guess_format, read_records
from olmoflow.posttrain.config import TOO_LONG
from olmoflow.posttrain.formats import (
    PREFERENCE_FORMATS,
    SEP_MARK,
    SFT_FORMATS,
    BadRecord,
    Message,
    to_conversations,
    to_pair,
)
from olmoflow.tokenizer.base import BaseTokenizer
from olmoflow.tokenizer.chat import ChatTemplate, render

log = logging.getLogger(__name__)



@dataclass
class DataStats:
    """Counts of one pass over the data.

    Attributes:
        read: records (conversations or pairs) seen, bad ones included.
        skipped: ``"file:line: why"`` for each bad record skipped.
        truncated: examples kept with turns (or text tokens) removed to fit ``max_length``.
        dropped: ``"file:line"`` of each example dropped for being too long.
        no_targets: ``"file:line"`` of each example skipped because it has no token to train on
            (an SFT conversation whose assistant turns render to no target, a pair whose
            response does); a batch of them would divide the loss by zero.
        no_targets_reason: how the summary names them (``"no assistant tokens"``, ``"no
            response tokens"``).
        identical: ``"file:line"`` of each preference pair skipped because its chosen and
            rejected responses are the same (its DPO loss is ln 2 whatever the model).
        sep_as_text: ``"file:line"`` of each ``text`` record trained as plain text although it
            contains ``[SEP]`` (not an ``instruction [SEP] response`` line); kept, warned about.
    """

    read: int = 0
    skipped: list[str] = field(default_factory=list)
    truncated: int = 0
    dropped: list[str] = field(default_factory=list)
    no_targets: list[str] = field(default_factory=list)
    no_targets_reason: str = "no assistant tokens"
    identical: list[str] = field(default_factory=list)
    sep_as_text: list[str] = field(default_factory=list)

    @property
    def kept(self) -> int:
        """Examples produced."""
        return (self.read - len(self.skipped) - len(self.dropped) - len(self.no_targets)
                - len(self.identical))

    def add(self, other: DataStats) -> None:
        """Add the counts of ``other`` (another file's pass) to these."""
        self.read += other.read
        self.truncated += other.truncated
        for name in ("skipped", "dropped", "no_targets", "identical", "sep_as_text"):
            getattr(self, name).extend(getattr(other, name))
        self.no_targets_reason = other.no_targets_reason

    def summary(self) -> str:
        """One line: read, kept, skipped (bad input, and each named reason that occurred),
        truncated, dropped; text records with ``[SEP]`` trained as plain text, if any."""
        named = [(self.no_targets, self.no_targets_reason),
                 (self.identical, "identical chosen and rejected")]
        extra = "".join(f", {len(v)} skipped: {why}" for v, why in named if v)
        sep = (f"; {len(self.sep_as_text)} text record(s) containing [SEP] trained as plain text"
               if self.sep_as_text else "")
        return (f"{self.read} read, {self.kept} kept, {len(self.skipped)} skipped (bad input)"
                f"{extra}, {self.truncated} truncated, {len(self.dropped)} dropped (too long)"
                f"{sep}")


@dataclass(frozen=True)
class Conversation:
    """One SFT example before tokenization: ``messages`` (a conversation) or ``text`` (plain
    text, every token trained); ``where`` is ``file:line``."""

    where: str
    messages: list[Message] | None = None
    text: str | None = None


@dataclass(frozen=True)
class PreferencePair:
    """One preference pair: the shared ``prompt`` turns and the ``chosen`` / ``rejected``
    assistant turns that follow it (usually one each)."""

    where: str
    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]


@dataclass(frozen=True)
class SFTExample:
    """Token ids and loss mask of one SFT example.

    Attributes:
        input_ids: ``[T]`` token ids, ``T <= max_length``.
        loss_mask: ``[T]`` 0/1; 1 on assistant content and each assistant turn's end marker
            (every token for ``text`` records).
        where: ``file:line`` of the record.
        turns_removed: whole turns removed from the end to fit (0 when it fitted); for ``text``,
            the number of tokens cut.
    """

    input_ids: list[int]
    loss_mask: list[int]
    where: str
    turns_removed: int = 0


@dataclass(frozen=True)
class PreferenceExample:
    """Token ids of one preference pair; the full sequences are ``prompt_ids + chosen_ids`` and
    ``prompt_ids + rejected_ids``.

    Attributes:
        prompt_ids: ``[P]`` the shared prompt, ending with the final assistant turn's header
            (what the model is conditioned on).
        chosen_ids, chosen_mask: ``[C]`` the chosen response and its 0/1 loss mask (1 on the
            response content and its end marker).
        rejected_ids, rejected_mask: ``[R]`` the same for the rejected response.
        where: ``file:line`` of the record.
        turns_removed: oldest prompt turns removed to fit ``max_length``.
    """

    prompt_ids: list[int]
    chosen_ids: list[int]
    chosen_mask: list[int]
    rejected_ids: list[int]
    rejected_mask: list[int]
    where: str
    turns_removed: int = 0


# ---------------------------------------------------------------------------------------------
# Bad input


def _bad(where: str, why: str, strict: bool, stats: DataStats) -> None:
    if strict:
        raise OlmoflowError(f"{where}: {why}")
    stats.skipped.append(f"{where}: {why}")
    log.warning("skipped %s: %s", where, why)


def _skip_as(where: str, bucket: list[str], why: str, strict: bool) -> None:
    """Skip an example for a named reason (counted in ``bucket``); under ``strict`` an error."""
    if strict:
        raise OlmoflowError(f"{where}: {why}")
    bucket.append(where)
    log.warning("skipped %s: %s", where, why)


def _note_sep_as_text(where: str, text: str, stats: DataStats) -> None:
    """Count (and warn once per pass about) a text record containing ``[SEP]`` that is trained
    as plain text: OLMo's ``instruction [SEP] response`` lines are read as pairs only with
    exactly one ``" [SEP] "``, from a plain line or under ``format=sep``."""
    if "[SEP]" not in text:
        return
    if not stats.sep_as_text:
        log.warning("%s: a text record contains '[SEP]' but is trained as plain text (loss on "
                    "every token); an 'instruction [SEP] response' pair needs exactly one "
                    "'%s' on a plain text line, or data.format=sep", where, SEP_MARK)
    stats.sep_as_text.append(where)


def _check_format(fmt: str | None, valid: Sequence[str], what: str) -> None:
    if fmt is not None and fmt not in valid:
        hint = closest(fmt, valid)
        raise OlmoflowError(f"unknown {what} format '{fmt}'"
                            + (f"; did you mean '{hint}'?" if hint else "")
                            + f" (one of {', '.join(valid)})")


# ---------------------------------------------------------------------------------------------
# Reading


def _paths_records(paths: Sequence[str | Path], strict: bool, stats: DataStats):
    """``(where, record)`` from files, the format from each name; malformed lines counted."""
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise OlmoflowError(f"{path}: no such data file")
        lines: list[str] = []
        yield from read_records([path], guess_format(path), strict=strict, skipped=lines)
        for s in lines:  # read_records already raised under strict
            stats.read += 1
            stats.skipped.append(s)
            log.warning("skipped %s", s)


def _is_path(s: Any) -> bool:
    return isinstance(s, Path) or (isinstance(s, str) and "\n" not in s and len(s) < 4096
                                   and Path(s).is_file())


_DATA_SUFFIXES = (".jsonl", ".json", ".gz", ".txt", ".csv", ".parquet")


def _is_dir_path(s: Any) -> bool:
    return (isinstance(s, Path) or (isinstance(s, str) and "\n" not in s and len(s) < 4096)) \
        and Path(s).is_dir()


def _looks_like_missing_file(s: Any) -> bool:
    # a one-line string naming a data file that is not there is a mistyped path, not a text
    # record: training on the path's own characters would be silently wrong
    return (isinstance(s, str) and "\n" not in s and " " not in s.strip()
            and s.strip().lower().endswith(_DATA_SUFFIXES) and not Path(s).exists())


def check_data_files(paths: Sequence[str | Path], key: str = "data.paths") -> None:
    """Check that each of ``paths`` (what a config names under ``key``) is a readable file.

    A config's paths are always files: without this, a mistyped name with no data suffix, or a
    directory, would be read as a one-line ``text`` record of the path's own characters.

    Raises:
        OlmoflowError: a path that does not exist or is a directory (the message names it and
            ``key``).
    """
    for p in paths:
        path = Path(p)
        if path.is_dir():
            raise OlmoflowError(f"{key}: '{path}' is a directory; name its data files "
                                f"(e.g. {path}/train.jsonl)")
        if not path.is_file():
            raise OlmoflowError(f"{key}: no such data file: {path}")


def split_sources(source: Any) -> list[tuple[str, Any]]:
    """``(name, source)`` per data file when ``source`` is a path or a list of paths (each file
    is then read, and checked for examples left, on its own), else one ``("the records",
    source)``."""
    if isinstance(source, str | Path):
        source = [source]
    if isinstance(source, list | tuple) and source and all(_is_path(s) for s in source):
        return [(str(p), [p]) for p in source]
    return [("the records", source)]


def nothing_left(name: str, what: str, stats: DataStats) -> OlmoflowError:
    """The one-line error for a data file (or source) that gave no example to train on."""
    return OlmoflowError(f"{name}: no {what} left to train on ({stats.summary()})")


def _records(source: Any, strict: bool, stats: DataStats) -> Iterator[tuple[str, Any]]:
    """Paths (a list of them, or one) are read as files; anything else is records.

    Raises:
        OlmoflowError: a string names a data file (``.jsonl``, ``.json``, ``.gz``, ...) that
            does not exist, or names a directory.
    """
    if isinstance(source, str | Path):
        source = [source]
    if not isinstance(source, Iterator):
        source = list(source)
        for s in source:
            if _looks_like_missing_file(s):
                raise OlmoflowError(f"no such data file: {s}")
            if _is_dir_path(s):
                raise OlmoflowError(f"'{s}' is a directory; name its data files")
        if source and all(_is_path(s) for s in source):
            return _paths_records(source, strict, stats)
    return _normalize(source)


def _normalize(records: Iterable[Any]) -> Iterator[tuple[str, Any]]:
    for i, r in enumerate(records, 1):
        if isinstance(r, Conversation | PreferencePair):
            yield r.where, r
        elif isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], str):
            yield r
        else:
            yield f"record {i}", r


def read_conversations(source: Sequence[str | Path] | Iterable[Any], *,
                       format: str | None = None, strict: bool = False,
                       stats: DataStats | None = None) -> Iterator[Conversation]:
    """:class:`Conversation` objects from data files or records.

    Args:
        source: file paths (``.jsonl``, ``.json``, ``.jsonl.gz``, other names read as plain
            text lines), or records: mappings, strings, ``(where, record)`` pairs or
            :class:`Conversation` objects (passed through).
        format: force one of :data:`SFT_FORMATS` (default: detected per record).
        strict: raise on bad input instead of skipping it.
        stats: counts to update (``read``, ``skipped``).

    Raises:
        OlmoflowError: unknown ``format``; a missing file; under ``strict``, bad input, naming
            ``file:line``.
    """
    _check_format(format, SFT_FORMATS, "SFT")
    stats = stats if stats is not None else DataStats()
    for where, rec in _records(source, strict, stats):
        if isinstance(rec, str) and not rec.strip():
            continue  # blank lines of a text file separate nothing
        if isinstance(rec, Conversation):
            stats.read += 1
            yield rec
            continue
        try:
            convs = to_conversations(rec, format)
        except BadRecord as e:
            stats.read += 1
            _bad(where, str(e), strict, stats)
            continue
        for k, c in enumerate(convs):
            stats.read += 1
            w = where if len(convs) == 1 else f"{where} instance {k + 1}"
            if isinstance(c, str):
                _note_sep_as_text(w, c, stats)
            yield (Conversation(w, text=c) if isinstance(c, str) else Conversation(w, messages=c))


# ---------------------------------------------------------------------------------------------
# Conversations -> token ids


def _check_too_long(on_too_long: str) -> None:
    if on_too_long not in TOO_LONG:
        hint = closest(on_too_long, TOO_LONG)
        raise OlmoflowError(f"on_too_long='{on_too_long}'"
                            + (f"; did you mean '{hint}'?" if hint else "")
                            + f" (one of {', '.join(TOO_LONG)})")


def _fit_conversation(messages: list[Message], template, tokenizer, max_length: int | None
                      ) -> tuple[list[int], list[int], int] | None:
    """Render ``messages``; when too long, the longest prefix that ends with an assistant turn
    and fits. ``(ids, mask, turns removed)``, or None when nothing fits."""
    ids, mask = render(messages, template, tokenizer)
    if max_length is None or len(ids) <= max_length:
        return ids, mask, 0
    for k in range(len(messages) - 1, 0, -1):
        if messages[k - 1]["role"] != "assistant":
            continue
        ids, mask = render(messages[:k], template, tokenizer)
        if len(ids) <= max_length:
            return ids, mask, len(messages) - k
    return None


def has_target(mask: Sequence[int]) -> bool:
    """Whether a token sequence with loss ``mask`` trains any token: a trained position after
    the first (the first token is never a target, it has nothing before it)."""
    return any(mask[1:])


def sft_examples(
    records: Sequence[str | Path] | Iterable[Any],
    template: str | ChatTemplate | None,
    tokenizer: BaseTokenizer,
    max_length: int | None,
    *,
    on_too_long: str = "truncate",
    format: str | None = None,
    strict: bool = False,
    stats: DataStats | None = None,
) -> Iterator[SFTExample]:
    """Token ids and loss masks of SFT examples, in order.

    Conversations render with :func:`~olmoflow.tokenizer.chat.render` (loss on
    assistant content and end-of-turn markers only); ``text`` records are
    ``tokenizer.encode(text) + [eos]`` with every token trained, as pretraining does.

    Args:
        records: as :func:`read_conversations` takes (paths, records, or Conversations).
        template: chat template name / object, or None for the tokenizer's own.
        tokenizer: prepared with :func:`~olmoflow.tokenizer.chat.add_chat_template`.
        max_length: the most tokens per example (None: no limit).
        on_too_long: ``"truncate"``: remove whole turns from the end until the conversation,
            ending with a complete assistant turn and its marker, fits (dropped when even the
            first assistant turn does not; ``text`` is cut to ``max_length`` tokens);
            ``"drop"``: drop every too-long example. Counted in ``stats``.
        format, strict: as for :func:`read_conversations`; a conversation the template cannot
            render (a role it lacks) is bad input too.
        stats: counts to update.

    Yields:
        :class:`SFTExample` with ``len(input_ids) == len(loss_mask) <= max_length``.

    Raises:
        OlmoflowError: a bad ``on_too_long`` or ``format``; under ``strict``, bad input, naming
            ``file:line``.
    """
    _check_too_long(on_too_long)
    stats = stats if stats is not None else DataStats()
    for conv in read_conversations(records, format=format, strict=strict, stats=stats):
        if conv.text is not None:
            ids = tokenizer.encode(conv.text, add_eos=True)
            cut = 0
            if max_length is not None and len(ids) > max_length:
                if on_too_long == "drop":
                    stats.dropped.append(conv.where)
                    continue
                cut, ids = len(ids) - max_length, ids[:max_length]
                stats.truncated += 1
            if len(ids) < 2:  # one token predicts nothing
                _skip_as(conv.where, stats.no_targets, stats.no_targets_reason, strict)
                continue
            yield SFTExample(ids, [1] * len(ids), conv.where, cut)
            continue
        try:
            fit = _fit_conversation(conv.messages, template, tokenizer,
                                    None if on_too_long == "drop" else max_length)
        except OlmoflowError as e:
            _bad(conv.where, str(e), strict, stats)
            continue
        if fit is None or (max_length is not None and len(fit[0]) > max_length):
            stats.dropped.append(conv.where)
            continue
        ids, mask, removed = fit
        if not has_target(mask):
            _skip_as(conv.where, stats.no_targets, stats.no_targets_reason, strict)
            continue
        stats.truncated += removed > 0
        yield SFTExample(ids, mask, conv.where, removed)


# ---------------------------------------------------------------------------------------------
# Preference pairs


def read_pairs(source: Sequence[str | Path] | Iterable[Any], *, format: str | None = None,
               strict: bool = False, stats: DataStats | None = None
               ) -> Iterator[PreferencePair]:
    """:class:`PreferencePair` objects from data files or records (as
    :func:`read_conversations` takes them; ``format`` one of :data:`PREFERENCE_FORMATS`).

    Raises:
        OlmoflowError: unknown ``format``; a missing file; under ``strict``, bad input (an empty
            response, an unknown role, a malformed line...), naming ``file:line``.
    """
    _check_format(format, PREFERENCE_FORMATS, "preference")
    stats = stats if stats is not None else DataStats()
    for where, rec in _records(source, strict, stats):
        stats.read += 1
        if isinstance(rec, PreferencePair):
            yield rec
            continue
        try:
            prompt, chosen, rejected = to_pair(rec, format)
        except BadRecord as e:
            _bad(where, str(e), strict, stats)
            continue
        if _turns(chosen) == _turns(rejected):
            _skip_as(where, stats.identical, IDENTICAL, strict)
            continue
        yield PreferencePair(where, prompt, chosen, rejected)


IDENTICAL = "identical chosen and rejected"


def _turns(messages: list[Message]) -> list[tuple[Any, Any]]:
    return [(m.get("role"), m.get("content")) for m in messages]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _render_pair(prompt, chosen, rejected, template, tokenizer):
    """``(prompt_ids, chosen ids, chosen mask, rejected ids, rejected mask)``.

    The prompt ids are the rendered prompt with the generation prompt, cut back to where both
    full renderings still agree with it (BPE may merge the header's last characters with the
    response's first ones); the masks keep only the response's training positions."""
    gen, _ = render(prompt, template, tokenizer, add_generation_prompt=True,
                    require_assistant=False)
    c_ids, c_mask = render(prompt + chosen, template, tokenizer)
    r_ids, r_mask = render(prompt + rejected, template, tokenizer)
    p = min(_common(gen, c_ids), _common(gen, r_ids))
    return gen[:p], c_ids[p:], c_mask[p:], r_ids[p:], r_mask[p:]


def preference_examples(
    records: Sequence[str | Path] | Iterable[Any],
    template: str | ChatTemplate | None,
    tokenizer: BaseTokenizer,
    max_length: int | None = None,
    *,
    on_too_long: str = "truncate",
    format: str | None = None,
    strict: bool = False,
    stats: DataStats | None = None,
) -> Iterator[PreferenceExample]:
    """Token ids of preference pairs (DPO / SimPO inputs), in order.

    Each pair renders as two conversations, prompt + chosen and prompt + rejected, with
    :func:`~olmoflow.tokenizer.chat.render`; the shared prompt ids are split off, so a
    response's ids and mask cover only its final assistant turn(s) and their end marker (earlier
    assistant turns of the prompt are context, not trained).

    Args:
        records: paths or records, as :func:`read_pairs` takes them.
        template, tokenizer: as for :func:`sft_examples`.
        max_length: the most tokens of ``prompt + the longer response`` (None: no limit).
        on_too_long: ``"truncate"``: remove the oldest prompt turns (a leading system turn is
            kept) so the prompt starts at a later user turn, until the pair fits; dropped when
            even the last user turn and the responses do not fit. ``"drop"``: drop it. The
            responses are never cut. Counted in ``stats``.
        format, strict, stats: as for :func:`read_pairs`.

    Yields:
        :class:`PreferenceExample` objects.

    Raises:
        OlmoflowError: a bad ``on_too_long`` or ``format``; under ``strict``, bad input naming
            ``file:line``.
    """
    _check_too_long(on_too_long)
    stats = stats if stats is not None else DataStats()
    stats.no_targets_reason = "no response tokens"
    for pair in read_pairs(records, format=format, strict=strict, stats=stats):
        head = [m for m in pair.prompt[:1] if m["role"] == "system"]
        body = pair.prompt[len(head):]
        starts = [i for i, m in enumerate(body) if i == 0 or m["role"] == "user"]
        if on_too_long == "drop":
            starts = starts[:1]
        out = None
        try:
            for i in starts:
                r = _render_pair(head + body[i:], pair.chosen, pair.rejected, template,
                                 tokenizer)
                if max_length is None or len(r[0]) + max(len(r[1]), len(r[3])) <= max_length:
                    out = (r, i)
                    break
        except OlmoflowError as e:
            _bad(pair.where, str(e), strict, stats)
            continue
        if out is None:
            stats.dropped.append(pair.where)
            continue
        (p, c, cm, rj, rm), removed = out
        if c == rj:  # different text, the same tokens: nothing to prefer either
            _skip_as(pair.where, stats.identical, IDENTICAL + " (the same tokens)", strict)
            continue
        # position 0 of prompt + response predicts nothing
        if not (has_target([0] * len(p) + cm) and has_target([0] * len(p) + rm)):
            _skip_as(pair.where, stats.no_targets, stats.no_targets_reason, strict)
            continue
        stats.truncated += removed > 0
        yield PreferenceExample(p, c, cm, rj, rm, pair.where, removed)
