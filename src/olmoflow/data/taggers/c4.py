"""The C4 rules (Raffel et al. 2020, "Exploring the Limits of Transfer Learning", section 2.2).

Follows datatrove 0.10.1's ``C4QualityFilter`` (itself following TensorFlow Datasets'
``c4_utils``) line by line, in its order: each line (``str.splitlines``, stripped) is dropped if a
word (whitespace-split) is longer than 1000 characters; Wikipedia citation markers (``[1]``,
``[edit]``, ``[citation needed]``) are removed; the line is dropped if it does not end in terminal
punctuation (``. ? ! " '``) or ends in an ellipsis, or has fewer than 3 words, or mentions
"javascript", or one of the cookie/terms-of-use phrases. A document is dropped if a line that
reaches those checks contains "lorem ipsum" or a curly bracket, or if its kept lines hold fewer
than 5 sentences (sentences split as spaCy's Sentencizer does, see
:func:`olmoflow.data.taggers.text.count_sentences`). The bad-words list rule of the paper is not
applied (datatrove does not either: it needs a download).

Document-level attributes (``c4__<name>``, value as score; "bad" direction in brackets):

- ``lines``: lines in the document; ``lines_kept``: lines C4 keeps [low]
- ``lines_long_word``, ``lines_no_terminal_punct``, ``lines_too_few_words``, ``lines_javascript``,
  ``lines_policy``: lines removed by each line rule, counted by the first rule that removes them
- ``sentences``: sentences in the kept lines [< 5 fails]
- ``has_lorem_ipsum``, ``has_curly_bracket``: 1.0 when present in a line that reaches the check
- ``fail_lorem_ipsum``, ``fail_curly_bracket``, ``fail_too_few_sentences`` and ``fail_any``:
  1.0 = the rule drops the document (what datatrove's filter decides), 0.0 = kept

Span attribute: ``c4__line_removed``: one ``[start, end, 1.0]`` span per line that C4 removes
(offsets of the line's text without its line break), so a mixer can delete them as C4 does.
"""

from __future__ import annotations

import re
from typing import Any

from olmoflow.data.taggers import Spans, Tagger, register_tagger
from olmoflow.data.taggers.text import SENTENCE_PUNCT, count_sentences

CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
END_PUNCTUATION = (".", "?", "!", '"', "'")
POLICY_SUBSTRINGS = (
    "terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies",
    "use cookies",
)
_INNER_END = re.compile("[" + re.escape("".join(sorted(SENTENCE_PUNCT))) + "]")
LINE_RULES = ("long_word", "no_terminal_punct", "too_few_words", "javascript", "policy")


def c4_measure(text: str, o: dict[str, Any]) -> tuple[dict[str, float], dict[str, bool], Spans]:
    """``(measurements, failures, removed_line_spans)`` of ``text`` under options ``o``."""
    removed = dict.fromkeys(LINE_RULES, 0)
    spans: Spans = []
    sentences = kept = 0
    lorem = curly = False
    pos = 0
    lines = text.splitlines()
    for raw_len, line0 in zip(map(len, text.splitlines(keepends=True)), lines):
        start, pos = pos, pos + raw_len
        line = line0.strip()
        words = line.split()
        why = None
        limit = o["max_word_length"]
        if limit != -1 and len(line) > limit and any(len(w) > limit for w in words):
            why = "long_word"
        else:
            if o["remove_citations"]:
                line = CITATION.sub("", line)
            if o["filter_no_terminal_punct"] and (
                not line.endswith(END_PUNCTUATION) or line.endswith("...")
            ):
                why = "no_terminal_punct"
            elif len(words) < o["min_words_per_line"]:
                why = "too_few_words"
            else:
                low = line.lower()
                if o["filter_lorem_ipsum"] and "lorem ipsum" in low:
                    lorem = True
                if o["filter_javascript"] and "javascript" in low:
                    why = "javascript"
                else:
                    if o["filter_curly_bracket"] and "{" in line:
                        curly = True
                    if o["filter_policy"] and any(p in low for p in POLICY_SUBSTRINGS):
                        why = "policy"
        if why is None:
            kept += 1
            # A line with no sentence-final character before its last is one sentence: skip
            # splitting it into words (most kept lines).
            sentences += count_sentences(line) if _INNER_END.search(line, 0, len(line) - 1) else 1
        else:
            removed[why] += 1
            spans.append([start, start + len(line0), 1.0])
    values = {
        "lines": len(lines), "lines_kept": kept,
        **{f"lines_{k}": v for k, v in removed.items()},
        "sentences": sentences,
        "has_lorem_ipsum": float(lorem), "has_curly_bracket": float(curly),
    }
    fails = {
        "lorem_ipsum": lorem, "curly_bracket": curly,
        "too_few_sentences": o["min_num_sentences"] != -1 and sentences < o["min_num_sentences"],
    }
    fails["any"] = any(fails.values())
    return values, fails, spans


@register_tagger("c4")
class C4Tagger(Tagger):
    """C4 line and document rules as attributes; options are datatrove's C4QualityFilter's."""

    defaults = {
        "remove_citations": True, "filter_no_terminal_punct": True, "min_num_sentences": 5,
        "min_words_per_line": 3, "max_word_length": 1000, "filter_lorem_ipsum": True,
        "filter_javascript": True, "filter_curly_bracket": True, "filter_policy": True,
    }

    def tag(self, doc: dict[str, Any]) -> dict[str, Spans]:
        """Document-level measurements and rule flags, plus ``c4__line_removed`` spans."""
        text = doc["text"]
        values, fails, spans = c4_measure(text, self.options)
        end = len(text)
        attrs = {self.attr(k): [[0, end, v]] for k, v in values.items()}
        for k, failed in fails.items():
            attrs[self.attr(f"fail_{k}")] = [[0, end, 1.0 if failed else 0.0]]
        attrs[self.attr("line_removed")] = spans
        return attrs
