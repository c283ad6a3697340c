"""The mixer's rule syntax: a test on one attribute of a document.

A rule is ``{attribute, op, value[, aggregate][, name]}`` or the same as one string,
``"[aggregate(]attribute[)] op value"``, e.g. ``"gopher__word_count < 50"`` or
``"count(pii__email_address) > 0"``. The aggregate turns the attribute's spans
``[[start, end, score]]`` into one number: ``max`` (the default; for a document-level attribute,
its score), ``min``, ``sum``, ``count`` (number of spans), ``any`` (1 if a span has a non-zero
score) or ``frac`` (fraction of the text's characters covered by spans). An attribute with no
spans aggregates to 0. ``op`` is one of
``== != < <= > >=``; ``value`` a number (``true``/``false`` read as 1/0).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
from typing import Any

from olmoflow.errors import OlmoflowError, unknown_name_error

_OPS = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
        ">": operator.gt, ">=": operator.ge}
AGGREGATES = ("max", "min", "sum", "count", "any", "frac")
_RULE_KEYS = ("attribute", "op", "value", "aggregate", "name")
_RULE_RE = re.compile(
    r"^\s*(?:(?P<agg>\w+)\(\s*(?P<attr1>[\w.\-]+)\s*\)|(?P<attr2>[\w.\-]+))\s*"
    r"(?P<op>==|!=|<=|>=|<|>)\s*(?P<value>\S+)\s*$"
)


@dataclasses.dataclass(frozen=True)
class Rule:
    """A test on one attribute: ``aggregate(spans of attribute) op value``.

    ``name`` labels the rule in stats (default: its canonical text, e.g.
    ``"gopher__word_count < 50"``).
    """

    attribute: str
    op: str
    value: float
    aggregate: str = "max"
    name: str | None = None

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        attr = self.attribute if self.aggregate == "max" else f"{self.aggregate}({self.attribute})"
        value = int(self.value) if float(self.value).is_integer() else self.value
        return f"{attr} {self.op} {value}"

    def score(self, spans: list, text_len: int) -> float:
        """The aggregate of ``spans`` (``[[start, end, score], ...]``); 0 when there are none."""
        if not spans:
            return 0.0
        agg = self.aggregate
        if agg == "count":
            return float(len(spans))
        if agg == "frac":
            covered = sum(max(0, min(e, text_len) - max(s, 0)) for s, e, *_ in spans)
            return covered / text_len if text_len else 0.0
        scores = [float(sp[2]) for sp in spans]
        if agg == "max":
            return max(scores)
        if agg == "min":
            return min(scores)
        if agg == "sum":
            return math.fsum(scores)
        return 1.0 if any(scores) else 0.0  # "any"

    def holds(self, attributes: dict[str, list], text_len: int) -> bool:
        """Whether the rule is true for a document with these merged attributes."""
        return _OPS[self.op](self.score(attributes.get(self.attribute) or [], text_len),
                             self.value)


def parse_rule(obj: Any, where: str) -> Rule:
    """A :class:`Rule` from its config form (a mapping or a string); ``where`` names it in errors.

    Raises:
        OlmoflowError: unknown key, op or aggregate (with the closest valid one), or a bad value.
    """
    if isinstance(obj, str):
        m = _RULE_RE.match(obj)
        if not m:
            raise OlmoflowError(f"{where}: cannot parse rule '{obj}'; write it as '[aggregate(]"
                                "attribute[)] op value', e.g. 'gopher__word_count < 50'")
        obj = {"attribute": m["attr1"] or m["attr2"], "op": m["op"], "value": m["value"],
               **({"aggregate": m["agg"]} if m["agg"] else {})}
    if isinstance(obj, Rule):
        return obj
    if not isinstance(obj, dict):
        raise OlmoflowError(f"{where}: a rule must be a mapping or a string, got {obj!r}")
    for key in obj:
        if key not in _RULE_KEYS:
            raise OlmoflowError(f"{where}: {unknown_name_error('rule key', str(key), _RULE_KEYS)}")
    for key in ("attribute", "op", "value"):
        if key not in obj:
            raise OlmoflowError(f"{where}: rule needs '{key}' (keys: attribute, op, value, "
                                "[aggregate], [name])")
    op, agg = str(obj["op"]), str(obj.get("aggregate", "max"))
    if op not in _OPS:
        raise OlmoflowError(f"{where}: {unknown_name_error('op', op, _OPS)}")
    if agg not in AGGREGATES:
        raise OlmoflowError(f"{where}: {unknown_name_error('aggregate', agg, AGGREGATES)}")
    value = obj["value"]
    if isinstance(value, str):
        value = {"true": 1, "false": 0}.get(value.lower(), value)
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise OlmoflowError(f"{where}: rule value must be a number, got {obj['value']!r}") from None
    return Rule(str(obj["attribute"]), op, value, agg, obj.get("name"))
