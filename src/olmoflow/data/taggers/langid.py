"""Language identification with py3langid (a maintained fork of langid.py, Lui & Baldwin 2012).

Why py3langid: it is pip-installable as a pure-Python wheel that *bundles* its model (97 languages,
no download at run time, works offline), depends only on numpy, and classifies ~2 MB/s on one core;
lingua-language-detector is more accurate on very short text but ships ~100 MB of models and is
slower on whole documents, which is what this tagger scores.

Attributes (``langid__<name>``, score = probability in [0, 1] from py3langid's normalized scores):

- ``langid__<lang>`` (document-level span) for the most likely language (ISO 639-1 code, e.g.
  ``langid__en``), and also for every language in the ``languages`` option (default ``["en"]``)
  even when it is not the top one, so a mixer rule like ``langid__en >= 0.5`` always has a value
  [low = not that language];
- with ``per_paragraph: true``, ``langid__paragraph_<lang>``: one span per paragraph (text between
  blank lines) whose most likely language is ``<lang>``, scored with its probability.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from olmoflow.data.taggers import Spans, Tagger, register_tagger
from olmoflow.errors import OlmoflowError

# A paragraph: a run of non-blank lines.
_PARAGRAPH = re.compile(r"[^\n]*\S[^\n]*(?:\n[^\n]*\S[^\n]*)*")


@functools.lru_cache(maxsize=1)
def _identifier():
    """The py3langid classifier, loaded once per process (~2 s: the model is decompressed)."""
    try:
        from py3langid.langid import MODEL_FILE, LanguageIdentifier
    except ImportError:
        raise OlmoflowError(
            "the langid tagger needs py3langid: pip install 'olmoflow[data]'"
        ) from None
    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


def language_scores(text: str) -> dict[str, float]:
    """``{language: probability}`` for every language py3langid knows, best first."""
    return dict(_identifier().rank(text))


@register_tagger("langid")
class LangIdTagger(Tagger):
    """Document (and optionally paragraph) language with its probability."""

    defaults = {"languages": ["en"], "per_paragraph": False}

    def tag(self, doc: dict[str, Any]) -> dict[str, Spans]:
        """``langid__<top language>`` and ``langid__<lang>`` for each configured language."""
        text = doc["text"]
        end = len(text)
        if not text.strip():
            return {self.attr(lang): [[0, end, 0.0]] for lang in self.options["languages"]}
        scores = language_scores(text)
        top = next(iter(scores))
        attrs: dict[str, Spans] = {self.attr(top): [[0, end, scores[top]]]}
        for lang in self.options["languages"]:
            attrs[self.attr(lang)] = [[0, end, scores.get(lang, 0.0)]]
        if self.options["per_paragraph"]:
            for m in _PARAGRAPH.finditer(text):
                lang, p = _identifier().classify(m.group())
                attrs.setdefault(self.attr(f"paragraph_{lang}"), []).append(
                    [m.start(), m.end(), float(p)]
                )
        return attrs
