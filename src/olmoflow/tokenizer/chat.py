"""Chat templates: a conversation (``messages``) to token ids and a loss mask.

Any Jinja chat template renders, the way ``transformers``' ``apply_chat_template`` does
(:mod:`olmoflow.tokenizer.jinja`: the same sandboxed environment, with limits on time and size),
so a model imported with its own template can be fine-tuned, chatted with and served. Three
templates are named, the defaults, each carrying the exact Jinja string of the released models
so that the tokenizer saved with it (``chat_template.jinja`` + ``tokenizer_config.json``) works in
``transformers``:

- ``olmo3``: the OLMo 3 instruct template (``allenai/Olmo-3-7B-Instruct``): ChatML turns
  ``<|im_start|>role\\n...<|im_end|>\\n``, a default system turn when the conversation has none
  (``You are a helpful function-calling AI assistant. ...``), ``functions`` on system turns and
  ``function_calls`` on assistant turns as strings, ``environment`` (and ``tool``) turns. The last
  assistant turn ends with the EOS token, so :func:`add_chat_template` makes ``<|im_end|>`` the
  EOS, as the released tokenizer does: every assistant turn then ends with one ``<|im_end|>``.
- ``tulu``: the Tülu 3 / OLMo 2 instruct template (``allenai/OLMo-2-1124-7B-Instruct``):
  ``<|endoftext|>`` as BOS, then ``<|system|>\\n``, ``<|user|>\\n``, ``<|assistant|>\\n`` turns
  written as plain text, each assistant turn ending with EOS.
- ``plain``: ``instruction <|sep|> response <eos>`` per exchange (the ``instruction [SEP]
  response`` format, with ``<|sep|>`` as the separator token); a system message is prefixed to
  the text with a blank line.

A named template renders with its own code (no Jinja at run time): it lists pieces (special
tokens, inserted by id; text, tokenized in maximal runs between special tokens, exactly the runs
``transformers`` tokenizes), so the ids equal ``apply_chat_template``'s on the same messages
(tests compare them). The loss mask is 1 on each assistant turn's content and its end-of-turn
marker and 0 elsewhere (role headers, the newline after a turn, system, user and environment
turns). A token is trained when it starts inside a trained span of its run (a token straddling a
header and the content, only possible when the content starts with whitespace the header's last
characters merge with, is not).

Any other template (:meth:`ChatTemplate.from_jinja`) renders with Jinja to text, which is cut at
the tokenizer's added tokens (:meth:`~olmoflow.tokenizer.base.BaseTokenizer.added_tokens`,
inserted by id, as ``transformers`` matches them; an added token's ``lstrip``/``rstrip`` options
are not applied) and the text between them is tokenized, so the ids equal
``apply_chat_template``'s. Its loss mask comes from the template's ``{% generation %}``
blocks when it has them, token for token as ``transformers``' ``return_assistant_tokens_mask``;
otherwise from rendering prefixes of the conversation: assistant turn ``i`` is the text between
the rendering of ``messages[:i]`` with the generation prompt and that of ``messages[:i + 1]``
(its content, end-of-turn marker and whatever else the template writes for the turn), trained by
the same first-character rule as above.

Differences from ``transformers``, both deliberate: text that spells a special token
(``<|im_end|>`` inside a user message) is encoded as text, never as the token (see
:mod:`olmoflow.tokenizer.bpe`); and bad input (an unknown role, no assistant turn where training
needs one) raises :class:`~olmoflow.errors.OlmoflowError` where Jinja would silently skip it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from olmoflow.errors import OlmoflowError, closest, unknown_name_error
from olmoflow.tokenizer.base import BaseTokenizer
from olmoflow.tokenizer.jinja import compile_template, has_generation_blocks, render_jinja
from olmoflow.tokenizer.templates import (
    IM_END,
    IM_START,
    OLMO3_DEFAULT_SYSTEM,
    OLMO3_JINJA,
    OLMO3_NO_FUNCTIONS,
    PLAIN_JINJA,
    SEP,
    TULU_JINJA,
)


@dataclass(frozen=True)
class Piece:
    """One piece of a rendered conversation: a special token (by its string) or text; ``train``
    puts it under the loss."""

    text: str
    special: bool = False
    train: bool = False


Builder = Callable[[list[Mapping[str, Any]], bool, BaseTokenizer], list[Piece]]


CUSTOM = "custom"  # the name of a template that is not one of the named ones


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template: one of the named ones (:data:`TEMPLATES`), or any Jinja string
    (:meth:`from_jinja`, named ``custom``).

    Attributes:
        name: the registry name, or ``custom``.
        jinja: the Jinja string saved with the tokenizer, for ``transformers``.
        roles: the roles the template renders (None: whatever the template accepts).
        special_tokens: tokens :func:`add_chat_template` adds to the vocabulary.
        eos_token: the EOS the template's tokenizer uses (None keeps the tokenizer's).
        bos_is_eos: the template starts with a BOS that is the EOS token (OLMo 2).
        build: ``(messages, add_generation_prompt, tokenizer) -> pieces``, a named template in
            Python; None renders ``jinja`` (see the module docstring).
    """

    name: str
    jinja: str
    roles: tuple[str, ...] | None
    special_tokens: tuple[str, ...]
    eos_token: str | None
    bos_is_eos: bool
    build: Builder | None = None

    @classmethod
    def from_jinja(cls, source: str) -> ChatTemplate:
        """The template of a Jinja string: the named template whose string it is, else a
        ``custom`` one rendered with Jinja.

        Raises:
            OlmoflowError: not a string, or a Jinja syntax error (naming its line).
        """
        if not isinstance(source, str) or not source.strip():
            raise OlmoflowError(f"a chat template must be a non-empty Jinja string, got "
                                f"{str(source)[:40]!r}")
        for t in TEMPLATES.values():
            if t.jinja.strip() == source.strip():
                return t
        compile_template(source)  # a syntax error shows now, not at the first conversation
        return cls(CUSTOM, source, None, (), None, False)


def _s(token: str, train: bool = False) -> Piece:
    return Piece(token, special=True, train=train)


def _t(text: str, train: bool = False) -> Piece:
    return Piece(text, train=train)


def _build_tulu(messages, gen, tok) -> list[Piece]:
    if tok.bos_token is None:
        raise OlmoflowError("chat template 'tulu' starts with a BOS token but the tokenizer has "
                            "none; call add_chat_template(tokenizer, 'tulu') first")
    out = [_s(tok.bos_token)]
    for i, m in enumerate(messages):
        last, role, content = i == len(messages) - 1, m["role"], m["content"]
        if role in ("system", "user"):
            out.append(_t(f"<|{role}|>\n{content}\n"))
        else:
            out += [_t("<|assistant|>\n"), _t(content, True), _s(tok.eos_token, True)]
            if not last:
                out.append(_t("\n"))
        if last and gen:
            out.append(_t("<|assistant|>\n"))
    return out


def _build_olmo3(messages, gen, tok) -> list[Piece]:
    out: list[Piece] = []
    if not any(m["role"] == "system" for m in messages):
        out += [_s(IM_START), _t("system\n" + OLMO3_DEFAULT_SYSTEM + OLMO3_NO_FUNCTIONS),
                _s(IM_END), _t("\n")]
    for i, m in enumerate(messages):
        last, role, content = i == len(messages) - 1, m["role"], m.get("content")
        if role == "system":
            fn = m.get("functions")
            out += [_s(IM_START), _t("system\n" + content)]
            if fn is not None:
                out.append(_t(f" <functions>{fn}</functions>"))
            out += [_s(IM_END), _t("\n")]
        elif role == "user":
            out += [_s(IM_START), _t("user\n" + content), _s(IM_END), _t("\n")]
        elif role == "assistant":
            out += [_s(IM_START), _t("assistant\n")]
            if content is not None:
                out.append(_t(content, True))
            if m.get("function_calls") is not None:
                out.append(_t(f"<function_calls>{m['function_calls']}</function_calls>", True))
            out += [_s(IM_END, True), _t("\n")] if not last else [_s(tok.eos_token, True)]
        else:  # environment, and tool as environment
            out += [_s(IM_START), _t("environment\n" + content), _s(IM_END), _t("\n")]
        if last and gen:
            out += [_s(IM_START), _t("assistant\n")]
    return out


def _build_plain(messages, gen, tok) -> list[Piece]:
    out: list[Piece] = []
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "system":
            out.append(_t(content + "\n\n"))
        elif role == "user":
            out += [_t(content), _s(SEP)]
        else:
            out += [_t(content, True), _s(tok.eos_token, True)]
    return out  # the prompt already ends with the separator: no generation prompt to add


TEMPLATES: dict[str, ChatTemplate] = {
    t.name: t for t in (
        ChatTemplate("olmo3", OLMO3_JINJA, ("system", "user", "assistant", "environment", "tool"),
                     (IM_START, IM_END), IM_END, False, _build_olmo3),
        ChatTemplate("tulu", TULU_JINJA, ("system", "user", "assistant"), (), None, True,
                     _build_tulu),
        ChatTemplate("plain", PLAIN_JINJA, ("system", "user", "assistant"), (SEP,), None, False,
                     _build_plain),
    )
}
# Another name users know the Tülu template by.
ALIASES = {"olmo2": "tulu"}


def get_template(template: str | ChatTemplate) -> ChatTemplate:
    """The :class:`ChatTemplate` named ``template`` (``olmo3``, ``tulu`` or its alias ``olmo2``,
    ``plain``), or ``template`` itself.

    Raises:
        OlmoflowError: an unknown name, with the closest one.
    """
    if isinstance(template, ChatTemplate):
        return template
    name = ALIASES.get(template, template)
    if name not in TEMPLATES:
        raise unknown_name_error("chat template", str(template), [*TEMPLATES, *ALIASES])
    return TEMPLATES[name]


def template_of(tokenizer: BaseTokenizer) -> ChatTemplate:
    """The template the tokenizer carries (:meth:`ChatTemplate.from_jinja` of its
    ``chat_template``): a named one when its Jinja string is one of theirs, else ``custom``.

    Raises:
        OlmoflowError: the tokenizer has no chat template, or one that does not compile.
    """
    jinja = tokenizer.chat_template
    if jinja is None:
        raise OlmoflowError("the tokenizer has no chat template; pass one of "
                            f"{', '.join(TEMPLATES)} or call add_chat_template(tokenizer, NAME)")
    return ChatTemplate.from_jinja(jinja)


def add_chat_template(tokenizer: BaseTokenizer, template: str | ChatTemplate,
                      model: Any = None) -> int:
    """Make ``tokenizer`` (and ``model``) ready for ``template``; return how many tokens were added.

    Adds the template's special tokens (``<|im_start|>``/``<|im_end|>`` for ``olmo3``, ``<|sep|>``
    for ``plain``, none for a ``custom`` template), sets the template's EOS (``olmo3``:
    ``<|im_end|>``) and BOS (``tulu``: the EOS token, as OLMo 2 does), and stores the Jinja string
    as ``tokenizer.chat_template`` (saved with the tokenizer). With a ``model`` (an
    :class:`~olmoflow.model.olmo.Olmo`, or anything with its ``resize_token_embeddings(n,
    init_ids=, mean_of=)`` and ``config.vocab_size``), its embedding and LM head grow to fit, the
    new tokens' rows starting from the mean of the rows of the tokens the tokenizer had before.

    Raises:
        OlmoflowError: an unknown template name, or a tokenizer that cannot add tokens.
    """
    t = get_template(template)
    before = tokenizer.vocab_size
    n = tokenizer.add_special_tokens(t.special_tokens)
    if t.eos_token is not None:
        tokenizer.set_special_tokens(eos=t.eos_token)
    if t.bos_is_eos:
        tokenizer.set_special_tokens(bos=tokenizer.eos_token)
    tokenizer.chat_template = t.jinja
    if model is not None:
        new_ids = [i for i in (tokenizer.token_to_id(s) for s in t.special_tokens)
                   if i is not None and i >= before]
        model.resize_token_embeddings(tokenizer.vocab_size, init_ids=new_ids,
                                      mean_of=min(before, model.config.vocab_size))
    return n


def _check(messages: Sequence[Any], t: ChatTemplate, need_assistant: bool) -> list[Mapping]:
    """Validate the conversation for ``t``; the messages as a list."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise OlmoflowError(f"messages must be a list of {{'role', 'content'}} objects, "
                            f"got {type(messages).__name__}")
    if not messages:
        raise OlmoflowError("the conversation has no messages")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise OlmoflowError(f"message {i}: expected an object with a string 'role', got "
                                f"{str(m)[:60]!r}")
        role = m["role"]
        if t.build is None:  # a custom template decides what it renders
            continue
        if role not in t.roles:
            hint = closest(role, t.roles)
            raise OlmoflowError(f"message {i}: unknown role '{role}' for chat template '{t.name}'"
                                + (f"; did you mean '{hint}'?" if hint
                                   else f"; valid: {', '.join(t.roles)}"))
        content = m.get("content")
        may_be_none = t.name == "olmo3" and role == "assistant"
        if not (isinstance(content, str) or (content is None and may_be_none)):
            raise OlmoflowError(f"message {i} ({role}): 'content' must be a string, got "
                                f"{type(content).__name__}")
        if m.get("tool_calls") is not None:
            raise OlmoflowError(f"message {i}: structured 'tool_calls' are not supported; give "
                                "the calls as a 'function_calls' string")
        for key in ("functions", "function_calls"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise OlmoflowError(f"message {i}: '{key}' must be a string")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise OlmoflowError("the conversation has no assistant turn to train on (roles: "
                            f"{', '.join(m['role'] for m in messages)})")
    return list(messages)


def render(
    messages: Sequence[Mapping[str, Any]],
    template: str | ChatTemplate | None,
    tokenizer: BaseTokenizer,
    add_generation_prompt: bool = False,
    *,
    require_assistant: bool | None = None,
) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of a conversation under a chat template.

    Args:
        messages: ``[{"role": ..., "content": ...}, ...]`` (OLMo / Tülu ``messages`` format;
            ``olmo3`` also reads ``functions`` and ``function_calls`` strings).
        template: a template name, a :class:`ChatTemplate` (a ``custom`` one from
            :meth:`ChatTemplate.from_jinja`), or None for the tokenizer's own
            (:func:`template_of`).
        tokenizer: prepared with :func:`add_chat_template` (it must hold the template's tokens).
        add_generation_prompt: end with the header of a new assistant turn (for generation).
        require_assistant: refuse a conversation without an assistant turn; default: when not
            ``add_generation_prompt`` (training needs one, a prompt does not).

    Returns:
        ``(input_ids, loss_mask)``, equal-length lists of ints; ``loss_mask[i]`` is 1 when
        ``input_ids[i]`` is assistant content or an assistant turn's end-of-turn marker (for a
        custom template with ``{% generation %}`` blocks: what they enclose). The ids equal
        ``transformers``' ``apply_chat_template`` with ``template.jinja`` on a tokenizer loaded
        from the same files.

    Raises:
        OlmoflowError: an unknown template name or role, a malformed message, no assistant turn
            where one is required, a tokenizer missing the template's special tokens, or (custom
            templates) a rendering error or limit (:func:`olmoflow.tokenizer.jinja.render_jinja`).
    """
    t = template_of(tokenizer) if template is None else get_template(template)
    need = (not add_generation_prompt) if require_assistant is None else require_assistant
    checked = _check(messages, t, need)
    if t.build is None:
        return _render_custom(checked, t, tokenizer, add_generation_prompt)
    pieces = t.build(checked, add_generation_prompt, tokenizer)
    ids: list[int] = []
    mask: list[int] = []
    run: list[Piece] = []
    for p in [*pieces, None]:
        if p is not None and not p.special:
            run.append(p)
            continue
        _encode_run(run, tokenizer, ids, mask)
        run = []
        if p is not None:
            i = tokenizer.token_to_id(p.text)
            if i is None:
                raise OlmoflowError(f"chat template '{t.name}' needs token {p.text!r}, which the "
                                    f"tokenizer lacks; call add_chat_template(tokenizer, "
                                    f"'{t.name}') first")
            ids.append(i)
            mask.append(int(p.train))
    return ids, mask


def _encode_run(run: list[Piece], tok: BaseTokenizer, ids: list[int], mask: list[int]) -> None:
    """Encode consecutive text pieces as one text, as ``transformers`` does between special
    tokens; a token is trained when its first character lies in a trained piece."""
    text = "".join(p.text for p in run)
    if not text:
        return
    try:
        run_ids, offsets = tok.encode_with_offsets(text)
    except NotImplementedError:  # a tokenizer without offsets: encode piece by piece
        for p in run:
            piece_ids = tok.encode(p.text)
            ids += piece_ids
            mask += [int(p.train)] * len(piece_ids)
        return
    trained = [False] * (len(text) + 1)
    pos = 0
    for p in run:
        if p.train:
            trained[pos:pos + len(p.text)] = [True] * len(p.text)
        pos += len(p.text)
    ids += run_ids
    mask += [int(trained[start]) for start, _ in offsets]


# ---- custom (Jinja) templates ----------------------------------------------------------------

# Replaces the first character of a special token spelled inside a message when telling the
# template's own special tokens from those (a private-use character: same length, never special).
_DISARM = "\ue000"
_PROBE = "olmoflow end-of-turn probe"


def _render_text(messages: Sequence[Any], t: ChatTemplate, tok: BaseTokenizer,
                 gen: bool) -> tuple[str, list[tuple[int, int]]]:
    """``t.jinja`` rendered with the variables ``transformers`` passes (the tokenizer's special
    tokens by their names, no tools or documents)."""
    names = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": tok.pad_token}
    return render_jinja(t.jinja, {"messages": list(messages), "tools": None, "documents": None,
                                  "add_generation_prompt": gen,
                                  **{k: v for k, v in names.items() if v is not None}})


def _specials(tok: BaseTokenizer) -> re.Pattern[str] | None:
    """The tokenizer's added tokens, longest first (``tokenizers`` matches the longest)."""
    tokens = sorted(set(tok.added_tokens()), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, tokens))) if tokens else None


def _strings(value: Any) -> Any:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def _disarm(value: Any, pattern: re.Pattern[str]) -> Any:
    if isinstance(value, str):
        return pattern.sub(lambda m: _DISARM + m.group()[1:], value)
    if isinstance(value, Mapping):
        return {k: _disarm(v, pattern) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_disarm(v, pattern) for v in value]
    return value


def _special_cuts(messages: list[Mapping], t: ChatTemplate, tok: BaseTokenizer, gen: bool,
                  text: str) -> list[tuple[int, int, int]]:
    """``(start, end, id)`` of each special token the template wrote into ``text``. A special
    token spelled inside a message stays text: the template is rendered a second time with such
    spellings disarmed, and only the tokens found there count."""
    pattern = _specials(tok)
    if pattern is None:
        return []
    found = [(m.start(), m.end(), m.group()) for m in pattern.finditer(text)]
    if found and any(pattern.search(s) for s in _strings(messages)):
        second, _ = _render_text(_disarm(messages, pattern), t, tok, gen)
        found = [(m.start(), m.end(), m.group()) for m in pattern.finditer(second)]
        if len(second) != len(text) or any(text[a:b] != s for a, b, s in found):
            raise OlmoflowError("a message spells one of the tokenizer's special tokens, and this "
                                "chat template moves or changes message text, so it cannot stay "
                                "text; remove the special token from the message")
    return [(a, b, int(tok.token_to_id(s))) for a, b, s in found]


def _render_custom(messages: list[Mapping], t: ChatTemplate, tok: BaseTokenizer,
                   gen: bool) -> tuple[list[int], list[int]]:
    """:func:`render` for a template without a Python builder (see the module docstring)."""
    text, spans = _render_text(messages, t, tok, gen)
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    pos = 0
    for start, end, i in [*_special_cuts(messages, t, tok, gen, text), (len(text), len(text), -1)]:
        if start > pos:
            try:
                run_ids, run_offsets = tok.encode_with_offsets(text[pos:start])
            except NotImplementedError:
                raise OlmoflowError(f"{type(tok).__name__} gives no token offsets "
                                    "(encode_with_offsets), which a custom chat template's loss "
                                    "mask needs") from None
            ids += run_ids
            offsets += [(a + pos, b + pos) for a, b in run_offsets]
        if i >= 0:
            ids.append(i)
            offsets.append((start, end))
        pos = end
    if has_generation_blocks(t.jinja):
        return ids, _generation_mask(spans, offsets, len(text))
    return ids, _prefix_mask(messages, t, tok, text, offsets)


def _generation_mask(spans: list[tuple[int, int]], offsets: list[tuple[int, int]],
                     n_chars: int) -> list[int]:
    """``transformers``' ``assistant_masks``: for each ``{% generation %}`` span, the tokens from
    the one holding its first character to the one holding its last."""
    owner: list[int | None] = [None] * n_chars
    for k, (a, b) in enumerate(offsets):
        for c in range(a, b):
            if owner[c] is None:
                owner[c] = k
    mask = [0] * len(offsets)
    for start, end in spans:
        first = owner[start] if 0 <= start < n_chars else None
        last = owner[end - 1] if 0 <= end - 1 < n_chars else None
        if first is None:  # as transformers: a span past the text ends the mask
            break
        for k in range(first, last + 1 if last else len(offsets)):
            mask[k] = 1
    return mask


def _prefix_mask(messages: list[Mapping], t: ChatTemplate, tok: BaseTokenizer, text: str,
                 offsets: list[tuple[int, int]]) -> list[int]:
    """Assistant turn ``i`` is what rendering ``messages[:i + 1]`` adds to ``messages[:i]`` with
    the generation prompt; a token is trained when its first character is."""
    trained = [False] * (len(text) + 1)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        try:
            before = _render_text(messages[:i], t, tok, True)[0]
        except OlmoflowError:
            if i:
                raise
            before = ""  # a template that cannot render an empty conversation
        after = _render_text(messages[:i + 1], t, tok, False)[0]
        if not text.startswith(before):
            raise OlmoflowError(f"chat template: message {i} renders differently once later "
                                "turns follow, so its loss mask cannot be found from prefixes; "
                                "mark assistant text with {% generation %} blocks")
        end = len(before)
        while end < min(len(after), len(text)) and after[end] == text[end]:
            end += 1
        trained[len(before):end] = [True] * (end - len(before))
    return [int(trained[a]) for a, _ in offsets]


def end_of_turn_ids(template: str | ChatTemplate, tokenizer: BaseTokenizer) -> tuple[int, ...]:
    """The ids that end an assistant reply: EOS, and the special token the template writes right
    after an assistant turn's content (``<|im_end|>`` for ChatML templates such as ``olmo3``),
    found by rendering a probe conversation.

    Raises:
        OlmoflowError: an unknown template name.
    """
    t = get_template(template)
    out = [tokenizer.eos_token_id]
    probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE},
             {"role": "user", "content": "u"}]
    pattern = _specials(tokenizer)
    try:
        text, _ = _render_text(probe, t, tokenizer, False)
    except OlmoflowError:  # a template that refuses the probe: EOS alone
        return tuple(out)
    at = text.find(_PROBE)
    m = pattern.search(text, at + len(_PROBE)) if pattern is not None and at >= 0 else None
    if m is not None and not text[at + len(_PROBE):m.start()].strip():
        out.append(int(tokenizer.token_to_id(m.group())))
    return tuple(dict.fromkeys(out))
