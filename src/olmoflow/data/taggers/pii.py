"""PII: email addresses, phone numbers and IP addresses as spans (after Dolma's ``pii_regex``).

Attributes (spans, score 1.0, character offsets of the match): ``pii__email_address``,
``pii__phone_number``, ``pii__ip_address``; plus ``pii__count`` (document-level: the number of
spans found). The mixer masks the spans as ``|||EMAIL_ADDRESS|||``, ``|||PHONE_NUMBER|||`` and
``|||IP_ADDRESS|||`` (the replacement strings Dolma uses; see :data:`MASKS`).

The regular expressions follow Dolma's: an email is ``local@domain.tld``; a phone number is a
North-American 10-digit number with optional country code, parentheses and ``-``/``.``/space
separators, or an international ``+CC`` number of 8 to 15 digits; an IP address is an IPv4
dotted quad whose four parts are 0-255, not inside a longer run of digits and dots (so version
numbers like ``1.2.3.4.5`` are not matched).
"""

from __future__ import annotations

import re
from typing import Any

from olmoflow.data.taggers import Spans, Tagger, register_tagger

EMAIL = re.compile(
    r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]*@(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)+"
    r"[A-Za-z]{2,}(?![\w-])"
)
PHONE = re.compile(
    r"(?<![\w+])(?:"
    r"(?:\+?1[-. ]?)?(?:\(\d{3}\)|\d{3})[-. ]?\d{3}[-. ]?\d{4}"  # (555) 123-4567, 555.123.4567
    r"|\+\d{1,3}(?:[-. ]?\(?\d{1,4}\)?){2,5}"  # +44 20 7946 0958
    r")(?![\w])"
)
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
IP = re.compile(rf"(?<![\d.]){_OCTET}(?:\.{_OCTET}){{3}}(?![\d]|\.\d)")
MASKS = {
    "email_address": "|||EMAIL_ADDRESS|||",
    "phone_number": "|||PHONE_NUMBER|||",
    "ip_address": "|||IP_ADDRESS|||",
}
_PATTERNS = (("email_address", EMAIL), ("ip_address", IP), ("phone_number", PHONE))


def _digits(s: str) -> int:
    return sum(c.isdigit() for c in s)


@register_tagger("pii")
class PiiTagger(Tagger):
    """Spans of emails, phone numbers and IPv4 addresses (score 1.0)."""

    def tag(self, doc: dict[str, Any]) -> dict[str, Spans]:
        """``pii__<kind>`` spans for every kind (empty when none is found), and ``pii__count``."""
        text = doc["text"]
        attrs: dict[str, Spans] = {}
        taken: list[tuple[int, int]] = []
        total = 0
        for kind, pattern in _PATTERNS:
            spans = []
            for m in pattern.finditer(text):
                s, e = m.span()
                if kind == "phone_number" and not 8 <= _digits(m.group()) <= 15:
                    continue
                # A match inside an earlier kind (digits of an IP or an email) is not counted twice.
                if any(s < te and ts < e for ts, te in taken):
                    continue
                spans.append([s, e, 1.0])
            # Written even when empty, so a mixer rule or replacement may name every kind
            # whether or not this corpus has one.
            attrs[self.attr(kind)] = spans
            taken.extend((s, e) for s, e, _ in spans)
            total += len(spans)
        attrs[self.attr("count")] = [[0, len(text), total]]
        return attrs
