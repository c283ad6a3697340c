"""Record formats of post-training data: one published SFT or preference record to messages.

The formats and their rules are described in :mod:`olmoflow.posttrain.data`, which reads files
with these functions and tokenizes the result. Functions here raise :class:`BadRecord` without a
location; the reader adds ``file:line``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from olmoflow.errors import closest

SFT_FORMATS = ("messages", "alpaca", "sharegpt", "self_instruct", "sep", "text")
PREFERENCE_FORMATS = ("hh_rlhf", "prompt", "messages", "sharegpt", "stack_exchange")
ROLES = ("system", "user", "assistant", "environment", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "observation": "environment"}
HH_ASSISTANT = "\n\nAssistant:"
# The separator of OLMo's ``instruction [SEP] response`` instruction-tuning lines.
SEP_MARK = " [SEP] "

Message = dict[str, Any]


class BadRecord(ValueError):
    """A record that cannot be used; the reader adds where it is (file:line)."""


def _str(rec: Mapping, key: str, *, allow_empty: bool = True) -> str:
    v = rec.get(key)
    if not isinstance(v, str):
        raise BadRecord(f"'{key}' must be a string, got {type(v).__name__}")
    if not allow_empty and not v.strip():
        raise BadRecord(f"'{key}' is empty")
    return v


def _check_messages(messages: Any, *, need_assistant: bool = True) -> list[Message]:
    """Validate a ``[{"role", "content"}]`` list (known roles, string content)."""
    if not isinstance(messages, list) or not messages:
        raise BadRecord("'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise BadRecord(f"message {i}: expected an object with a string 'role'")
        role = m["role"]
        if role not in ROLES:
            hint = closest(role, ROLES)
            raise BadRecord(f"message {i}: unknown role '{role}'"
                            + (f"; did you mean '{hint}'?" if hint
                               else f" (one of {', '.join(ROLES)})"))
        if not isinstance(m.get("content"), str):
            raise BadRecord(f"message {i} ({role}): 'content' must be a string")
        out.append(dict(m))
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise BadRecord("the conversation has no assistant turn (roles: "
                        + ", ".join(m["role"] for m in out) + ")")
    return out


def detect_sft_format(record: Any) -> str | None:
    """The SFT format of one record (see :data:`SFT_FORMATS`), or None when none matches."""
    if isinstance(record, str):
        return "sep" if record.count(SEP_MARK) == 1 else "text"
    if not isinstance(record, Mapping):
        return None
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instances" in record and "instruction" in record:
        return "self_instruct"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "text" in record:
        return "text"
    return None


def _sharegpt_turns(turns: Any, key: str = "conversations") -> list[Message]:
    if not isinstance(turns, list) or not turns:
        raise BadRecord(f"'{key}' must be a non-empty list of {{from, value}} objects")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, Mapping) or not isinstance(t.get("from"), str):
            raise BadRecord(f"{key}[{i}]: expected an object with a string 'from'")
        role = SHAREGPT_ROLES.get(t["from"])
        if role is None:
            hint = closest(t["from"], SHAREGPT_ROLES)
            raise BadRecord(f"{key}[{i}]: unknown role '{t['from']}'"
                            + (f"; did you mean '{hint}'?" if hint
                               else f" (one of {', '.join(SHAREGPT_ROLES)})"))
        if not isinstance(t.get("value"), str):
            raise BadRecord(f"{key}[{i}] ({t['from']}): 'value' must be a string")
        out.append({"role": role, "content": t["value"]})
    return out


def _system(rec: Mapping) -> list[Message]:
    s = rec.get("system")
    if s is None or s == "":
        return []
    if not isinstance(s, str):
        raise BadRecord("'system' must be a string")
    return [{"role": "system", "content": s}]


def _query(instruction: str, inp: Any) -> str:
    if inp is None or inp == "":
        return instruction
    if not isinstance(inp, str):
        raise BadRecord("'input' must be a string")
    return instruction + "\n" + inp


def to_conversations(record: Any, format: str | None = None) -> list[list[Message] | str]:
    """The conversations of one record (a list of messages each, or a string for ``text``).

    ``format`` forces one of :data:`SFT_FORMATS`; None detects it. Most formats give one
    conversation; ``self_instruct`` gives one per instance.

    Raises:
        BadRecord: the record does not fit the format (the caller adds ``file:line``).
    """
    fmt = format or detect_sft_format(record)
    if fmt is None:
        keys = ", ".join(sorted(record)) if isinstance(record, Mapping) else type(record).__name__
        raise BadRecord(f"unknown record format (keys: {keys}); expected one of "
                        f"{', '.join(SFT_FORMATS)}")
    if fmt in ("text", "sep"):
        text = record if isinstance(record, str) else (
            _str(record, "text") if isinstance(record, Mapping) else None)
        if not isinstance(text, str):
            raise BadRecord(f"a {fmt} record must be a string or have a string 'text'")
        if not text.strip():
            raise BadRecord("empty text")
        return [split_sep(text) if fmt == "sep" else text]
    if not isinstance(record, Mapping):
        raise BadRecord(f"expected a JSON object for format '{fmt}', got "
                        f"{type(record).__name__}")
    if fmt == "messages":
        return [_check_messages(record.get("messages"))]
    if fmt == "sharegpt":
        return [_check_messages(_system(record) + _sharegpt_turns(record.get("conversations")))]
    if fmt == "alpaca":
        msgs = _system(record)
        history = record.get("history") or []
        if not isinstance(history, list):
            raise BadRecord("'history' must be a list of [query, response] pairs")
        for i, h in enumerate(history):
            if not (isinstance(h, list | tuple) and len(h) == 2
                    and all(isinstance(x, str) for x in h)):
                raise BadRecord(f"history[{i}]: expected [query, response] strings")
            msgs += [{"role": "user", "content": h[0]}, {"role": "assistant", "content": h[1]}]
        msgs += [{"role": "user", "content": _query(_str(record, "instruction"),
                                                    record.get("input"))},
                 {"role": "assistant", "content": _str(record, "output", allow_empty=False)}]
        return [msgs]
    # self_instruct
    instruction = _str(record, "instruction")
    instances = record.get("instances")
    if not isinstance(instances, list) or not instances:
        raise BadRecord("'instances' must be a non-empty list of {input, output} objects")
    out: list[list[Message] | str] = []
    for i, inst in enumerate(instances):
        if not isinstance(inst, Mapping):
            raise BadRecord(f"instances[{i}]: expected an {{input, output}} object")
        try:
            out.append([{"role": "user", "content": _query(instruction, inst.get("input"))},
                        {"role": "assistant",
                         "content": _str(inst, "output", allow_empty=False)}])
        except BadRecord as e:
            raise BadRecord(f"instances[{i}]: {e}") from None
    return out


def split_sep(line: str) -> list[Message]:
    """An ``instruction [SEP] response`` line (OLMo's instruction-tuning format) as a user turn
    and an assistant turn; the line's end (newline) is not part of the response.

    Raises:
        BadRecord: not exactly one ``" [SEP] "``, or an empty instruction or response.
    """
    line = line.rstrip("\r\n")
    if line.count(SEP_MARK) != 1:
        raise BadRecord(f"an 'instruction [SEP] response' line needs exactly one '{SEP_MARK}', "
                        f"found {line.count(SEP_MARK)}")
    instruction, response = line.split(SEP_MARK)
    if not instruction.strip():
        raise BadRecord("the instruction before ' [SEP] ' is empty")
    if not response.strip():
        raise BadRecord("the response after ' [SEP] ' is empty")
    return [{"role": "user", "content": instruction}, {"role": "assistant", "content": response}]


def split_hh_rlhf(chosen: str, rejected: str) -> tuple[list[Message], str, str]:
    """Split an HH-RLHF pair into the shared prompt turns and the two final responses.

    The prompt is the strings' common prefix cut back to its last ``"\\n\\nAssistant:"``; its
    ``"\\n\\nHuman:"`` / ``"\\n\\nAssistant:"`` turns become user / assistant messages (content
    stripped of surrounding whitespace); each response is the rest of its string, stripped.

    Raises:
        BadRecord: the strings share no ``"\\n\\nAssistant:"`` turn, or the prompt does not
            start with a Human turn.
    """
    n = 0
    for a, b in zip(chosen, rejected, strict=False):
        if a != b:
            break
        n += 1
    cut = chosen[:n].rfind(HH_ASSISTANT)
    if cut < 0:
        raise BadRecord("chosen and rejected share no '\\n\\nAssistant:' turn")
    head = chosen[:cut]
    parts = re.split(r"\n\n(Human|Assistant):", head)
    if parts[0].strip() or len(parts) < 3:
        raise BadRecord("the prompt must start with a '\\n\\nHuman:' turn")
    prompt = [{"role": "user" if who == "Human" else "assistant", "content": text.strip()}
              for who, text in zip(parts[1::2], parts[2::2], strict=True)]
    k = cut + len(HH_ASSISTANT)
    return prompt, chosen[k:].strip(), rejected[k:].strip()


def detect_preference_format(record: Any) -> str | None:
    """The preference format of one record (see :data:`PREFERENCE_FORMATS`), or None."""
    if not isinstance(record, Mapping):
        return None
    if "question" in record and "response_j" in record:
        return "stack_exchange"
    if "conversations" in record:
        return "sharegpt"
    if "prompt" in record:
        return "prompt"
    c = record.get("chosen")
    if isinstance(c, str):
        return "hh_rlhf"
    if isinstance(c, list):
        return "messages"
    return None


def _responses(value: Any, key: str, prompt: list[Message]) -> list[Message]:
    """A response given as a string, a message, or messages (a leading copy of the prompt
    removed)."""
    if isinstance(value, str):
        msgs = [{"role": "assistant", "content": value}]
    elif isinstance(value, Mapping) and "from" in value:
        msgs = _sharegpt_turns([value], key)
    elif isinstance(value, Mapping):
        msgs = _check_messages([value], need_assistant=False)
    elif isinstance(value, list):
        msgs = (_sharegpt_turns(value, key) if value and isinstance(value[0], Mapping)
                and "from" in value[0] else _check_messages(value, need_assistant=False))
        if msgs[:len(prompt)] == prompt:
            msgs = msgs[len(prompt):]
    else:
        raise BadRecord(f"'{key}' must be a string, a message or a list of messages")
    return msgs


def to_pair(record: Any, format: str | None = None
            ) -> tuple[list[Message], list[Message], list[Message]]:
    """``(prompt, chosen, rejected)`` message lists of one preference record.

    Raises:
        BadRecord: an unknown format, a malformed field, an empty prompt or an empty response.
    """
    fmt = format or detect_preference_format(record)
    if fmt is None or not isinstance(record, Mapping):
        keys = ", ".join(sorted(record)) if isinstance(record, Mapping) else type(record).__name__
        raise BadRecord(f"unknown preference format (keys: {keys}); expected one of "
                        f"{', '.join(PREFERENCE_FORMATS)}")
    if fmt == "hh_rlhf":
        prompt, c, r = split_hh_rlhf(_str(record, "chosen"), _str(record, "rejected"))
        chosen = [{"role": "assistant", "content": c}]
        rejected = [{"role": "assistant", "content": r}]
    elif fmt == "stack_exchange":
        prompt = [{"role": "user", "content": _str(record, "question", allow_empty=False)}]
        chosen = [{"role": "assistant", "content": _str(record, "response_j")}]
        rejected = [{"role": "assistant", "content": _str(record, "response_k")}]
    elif fmt == "sharegpt":
        prompt = _system(record) + _sharegpt_turns(record.get("conversations"))
        chosen = _responses(record.get("chosen"), "chosen", prompt)
        rejected = _responses(record.get("rejected"), "rejected", prompt)
    elif fmt == "prompt":
        p = record.get("prompt")
        prompt = ([{"role": "user", "content": p}] if isinstance(p, str)
                  else _check_messages(p, need_assistant=False))
        chosen = _responses(record.get("chosen"), "chosen", prompt)
        rejected = _responses(record.get("rejected"), "rejected", prompt)
    else:  # messages: the prompt is the common leading turns
        c = _check_messages(record.get("chosen"), need_assistant=False)
        r = _check_messages(record.get("rejected"), need_assistant=False)
        n = 0
        while n < min(len(c), len(r)) and c[n] == r[n]:
            n += 1
        while n > 0 and c[n - 1]["role"] == "assistant":  # the responses start after a prompt
            n -= 1
        prompt, chosen, rejected = c[:n], c[n:], r[n:]
    if not prompt or not any(m["content"].strip() for m in prompt):
        raise BadRecord("the pair has an empty prompt")
    if prompt[-1]["role"] == "assistant":
        raise BadRecord("the prompt ends with an assistant turn; the responses must follow a "
                        "user turn")
    for name, resp in (("chosen", chosen), ("rejected", rejected)):
        if not resp or not any(m["role"] == "assistant" and (m["content"] or "").strip()
                               for m in resp):
            raise BadRecord(f"the {name} response is empty")
        if resp[0]["role"] != "assistant":
            raise BadRecord(f"the {name} response starts with a '{resp[0]['role']}' turn, not "
                            "an assistant turn")
    return prompt, chosen, rejected
