"""The generation settings of a Hugging Face directory, checked when it is loaded.

``config.json`` names the special token ids and ``generation_config.json`` the decoding defaults
that ``transformers``' ``generate`` and vLLM use. olmoflow takes its EOS, BOS and pad tokens from
the tokenizer and its sampling from its own options, so none of these values changes what it
generates; they are checked anyway, because a release must load as is in those tools, and a
value they would act on wrongly is a broken release. The rule follows ``transformers``:

- an error (one line naming the file and the field): a file that is not a JSON object; an
  ``eos_token_id`` that is not a token of the model's vocabulary (generation would never stop); a
  length (``max_new_tokens``, ``max_length``, ``min_new_tokens``, ``min_length``), ``num_beams``,
  ``repetition_penalty`` or ``do_sample`` of the wrong type or out of range; a sampling setting
  (``temperature``, ``top_p``, ``top_k``) out of range when ``do_sample`` is true;
- a warning (one line, the value ignored): a ``bos_token_id`` or ``pad_token_id`` outside the
  vocabulary (olmoflow's come from the tokenizer), and a sampling setting out of range while
  ``do_sample`` is false (``transformers`` ignores it then, with a warning, and so does olmoflow).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from olmoflow.errors import OlmoflowError

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# A length or count field: (minimum allowed value).
_COUNTS = {"max_new_tokens": 1, "max_length": 1, "min_new_tokens": 0, "min_length": 0,
           "num_beams": 1}
_TOKEN_FIELDS = ("eos_token_id", "bos_token_id", "pad_token_id")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _read_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when there is no such file.

    Raises:
        OlmoflowError: unreadable, not JSON, or not a JSON object.
    """
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        detail = "JSON nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise OlmoflowError(f"cannot read {path}: {detail}") from None
    if not isinstance(obj, dict):
        raise OlmoflowError(f"{path}: expected a JSON object of settings, found a "
                            f"{type(obj).__name__.replace('NoneType', 'null')}")
    return obj


def _token_problem(value: Any, vocab_size: int) -> str | None:
    """Why ``value`` is not a token id (or list of them) of a ``vocab_size`` vocabulary; None
    when it is one, or null."""
    if value is None:
        return None
    ids = value if isinstance(value, list) and value else [value]
    for i in ids:
        if not _is_int(i):
            return f"{i!r} is not an integer token id"
        if not 0 <= i < vocab_size:
            return (f"{i} is outside the model's vocabulary of {vocab_size} tokens "
                    f"(0..{vocab_size - 1})")
    return None


def _check_tokens(path: Path, obj: dict[str, Any], vocab_size: int, warnings: list[str]) -> None:
    for field in _TOKEN_FIELDS:
        if field not in obj:
            continue
        why = _token_problem(obj[field], vocab_size)
        if why is None:
            continue
        if field == "eos_token_id":  # a stop id that is no token: generation never stops
            raise OlmoflowError(f"{path}: {field}={obj[field]!r}: {why}; set it to the "
                                "tokenizer's EOS id")
        warnings.append(f"{path}: {field}={obj[field]!r}: {why}; ignored (olmoflow takes it "
                        "from the tokenizer)")


def _sampling_problem(field: str, v: Any) -> str | None:
    """Why sampling setting ``field`` = ``v`` is out of range, as ``transformers``' logits
    warpers say; None when it is fine (or null)."""
    if v is None:
        return None
    if field == "temperature":
        ok = _is_number(v) and v > 0
        want = "a number > 0"
    elif field == "top_p":
        ok = _is_number(v) and 0 < v <= 1
        want = "a number in (0, 1]"
    else:  # top_k; 0 means no top-k filtering
        ok = _is_int(v) and v >= 0
        want = "an integer >= 0"
    return None if ok else f"must be {want}"


def _check_generation(path: Path, obj: dict[str, Any], vocab_size: int,
                      warnings: list[str]) -> None:
    _check_tokens(path, obj, vocab_size, warnings)
    for field, low in _COUNTS.items():
        v = obj.get(field)
        if v is not None and not (_is_int(v) and v >= low):
            raise OlmoflowError(f"{path}: {field}={v!r} must be an integer >= {low} (or null)")
    penalty = obj.get("repetition_penalty")
    if penalty is not None and not (_is_number(penalty) and penalty > 0):
        raise OlmoflowError(f"{path}: repetition_penalty={penalty!r} must be a number > 0 "
                            "(1.0 is off)")
    sample = obj.get("do_sample")
    if sample is not None and not isinstance(sample, bool):
        raise OlmoflowError(f"{path}: do_sample={sample!r} must be true or false")
    for field in ("temperature", "top_p", "top_k"):
        why = _sampling_problem(field, obj.get(field))
        if why is None:
            continue
        if field == "temperature" and obj[field] == 0 and not sample:
            continue  # greedy decoding spelled as temperature 0
        if sample:
            raise OlmoflowError(f"{path}: {field}={obj[field]!r} {why} (do_sample is true)")
        warnings.append(f"{path}: {field}={obj[field]!r} {why}; ignored, as do_sample is false")


def check_hf_settings(directory: str | Path, vocab_size: int) -> list[str]:
    """Check the token ids of ``directory``'s ``config.json`` and the decoding settings of its
    ``generation_config.json`` (either may be absent) against a model of ``vocab_size`` tokens.

    Returns:
        The warnings (each one line, also logged), for values that are ignored safely.
    Raises:
        OlmoflowError: a value every tool would act on wrongly (see the module docstring),
            naming the file and the field.
    """
    directory = Path(directory)
    warnings: list[str] = []
    config = _read_object(directory / CONFIG_FILE)
    if config is not None:
        _check_tokens(directory / CONFIG_FILE, config, vocab_size, warnings)
    generation = _read_object(directory / GENERATION_CONFIG_FILE)
    if generation is not None:
        _check_generation(directory / GENERATION_CONFIG_FILE, generation, vocab_size, warnings)
    for w in warnings:
        log.warning(w)
    return warnings
