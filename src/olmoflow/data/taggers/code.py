"""Taggers for source files: license headers and secrets (keys, tokens) as spans.

``code_license`` (spans, character offsets):

- ``code_license__spdx``: each ``SPDX-License-Identifier: <expr>`` line, score 1.0;
- ``code_license__phrase``: each common license phrase (Apache, MIT, BSD, GPL/LGPL/AGPL, MPL,
  "All rights reserved", "Permission is hereby granted", ...), score 1.0;
- ``code_license__spdx_ids``: document-level, the number of distinct SPDX identifiers found.

``code_secrets`` (spans, score 1.0 except where noted; "bad" = present): ``aws_access_key``
(``AKIA``/``ASIA`` + 16 upper-case alphanumerics), ``aws_secret_key`` (a 40-character base64 value
assigned to a name containing ``aws`` and ``secret``), ``private_key`` (a whole ``-----BEGIN ...
PRIVATE KEY-----`` block), ``github_token`` (``ghp_``/``gho_``/``ghu_``/``ghs_``/``ghr_`` + 36, or
``github_pat_`` + 82 characters), ``slack_token``
(``xoxb-``/``xoxp-``/``xoxa-``/``xoxr-``/``xoxs-``),
and ``api_key``: a quoted value of 20+ characters assigned to a name like ``api_key``, ``token``,
``secret`` or ``password`` whose Shannon entropy is at least ``min_entropy`` bits per character
(default 3.5, as detect-secrets' high-entropy plugins use ~3-4.5); its score is the entropy.
The patterns follow the public rule sets of gitleaks and detect-secrets.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

from olmoflow.data.taggers import Spans, Tagger, register_tagger

SPDX = re.compile(r"SPDX-License-Identifier:[ \t]*([A-Za-z0-9.+\-() ]+?)[ \t]*(?:\*/|-->|$)", re.M)
LICENSE_PHRASES = re.compile(
    r"Licensed under the Apache License,? Version 2\.0"
    r"|Permission is hereby granted, free of charge"
    r"|THE SOFTWARE IS PROVIDED \"AS IS\""
    r"|Redistribution and use in source and binary forms"
    r"|GNU (?:Lesser |Affero )?General Public License"
    r"|This Source Code Form is subject to the terms of the Mozilla Public License"
    r"|MIT License|BSD (?:2|3)-Clause License|Apache License,? Version 2\.0"
    r"|All rights reserved"
    r"|Creative Commons Attribution",
    re.IGNORECASE,
)
SECRETS = {
    "aws_access_key": re.compile(r"(?<![A-Z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Z0-9])"),
    "aws_secret_key": re.compile(
        r"(?i)aws[\w.-]{0,20}secret[\w.-]{0,20}[\"']?\s*[:=]\s*[\"']?([A-Za-z0-9/+=]{40})(?![A-Za-z0-9/+=])"
    ),
    "private_key": re.compile(
        r"-----BEGIN (?:[A-Z]+ )*PRIVATE KEY(?: BLOCK)?-----[\s\S]*?"
        r"-----END (?:[A-Z]+ )*PRIVATE KEY(?: BLOCK)?-----"
    ),
    "github_token": re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36}|github_pat_[A-Za-z0-9_]{82})\b"),
    "slack_token": re.compile(r"\bxox[bpars]-[A-Za-z0-9-]{10,}\b"),
}
API_KEY = re.compile(
    r"(?i)[\w.-]*(?:api[_-]?key|secret|token|passw(?:or)?d|auth)[\w.-]*[\"']?\s*[:=]\s*"
    r"[\"']([A-Za-z0-9_\-+/=.]{20,})[\"']"
)


def shannon_entropy(s: str) -> float:
    """Shannon entropy of the characters of ``s``, in bits per character (0 for empty)."""
    if not s:
        return 0.0
    n = len(s)
    return -sum(c / n * math.log2(c / n) for c in Counter(s).values())


@register_tagger("code_license")
class CodeLicenseTagger(Tagger):
    """License headers in source files: SPDX identifiers and common license phrases."""

    def tag(self, doc: dict[str, Any]) -> dict[str, Spans]:
        """``code_license__spdx`` and ``__phrase`` spans, ``__spdx_ids`` document count."""
        text = doc["text"]
        spdx = [[m.start(), m.end(), 1.0] for m in SPDX.finditer(text)]
        ids = {m.group(1).strip() for m in SPDX.finditer(text)}
        attrs: dict[str, Spans] = {self.attr("spdx_ids"): [[0, len(text), len(ids)]]}
        if spdx:
            attrs[self.attr("spdx")] = spdx
        phrases = [[m.start(), m.end(), 1.0] for m in LICENSE_PHRASES.finditer(text)]
        if phrases:
            attrs[self.attr("phrase")] = phrases
        return attrs


@register_tagger("code_secrets")
class CodeSecretsTagger(Tagger):
    """Secrets in source files: cloud keys, private key blocks, tokens, high-entropy API keys."""

    defaults = {"min_entropy": 3.5}

    def tag(self, doc: dict[str, Any]) -> dict[str, Spans]:
        """One ``code_secrets__<kind>`` span list per kind found (see the module docstring)."""
        text = doc["text"]
        attrs: dict[str, Spans] = {}
        taken: list[tuple[int, int]] = []
        for kind, pattern in SECRETS.items():
            spans = []
            for m in pattern.finditer(text):
                s, e = m.span(m.lastindex or 0)
                spans.append([s, e, 1.0])
                taken.append((s, e))
            if spans:
                attrs[self.attr(kind)] = spans
        keys = []
        for m in API_KEY.finditer(text):
            s, e = m.span(1)
            h = shannon_entropy(m.group(1))
            if h >= self.options["min_entropy"] and not any(s < te and ts < e for ts, te in taken):
                keys.append([s, e, h])
        if keys:
            attrs[self.attr("api_key")] = keys
        return attrs
