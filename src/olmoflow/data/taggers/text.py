"""Fast word and sentence splitting for the heuristic taggers (Gopher, C4).

The published filters were defined on top of a word tokenizer: datatrove 0.10.1 splits English with
``spacy.blank("en")`` (most of its run time), Dolma's Gopher tagger with ``str.split``. To keep
their decisions and run several times faster, :func:`split_words` is one compiled regex that
follows spaCy's English tokenizer rules: within a whitespace-free run, punctuation is split off only
where spaCy has a prefix, suffix or infix rule (``"end."`` -> ``end .``, ``well-known`` -> ``well -
known``, ``this.That`` -> ``this . That``, but ``Reading:[Read``, ``1(100%)`` and ``|x`` stay
whole); clitics are split (``don't`` -> ``don 't``: the same number and total length of tokens as
spaCy's ``do n't``); ellipses, dash runs, URLs, emoticons, ``US$`` and the abbreviations of spaCy's
English exceptions (``Mr.``, ``e.g.``, ``U.S.``) stay one token; a number is split from a unit
(``30mph`` -> ``30 mph``). On the 1,110 web-crawl documents of ``../shared/data`` the Gopher and C4
decisions built on it agree with datatrove's on >= 99.8% of documents (``benchmarks/data_speed.py``
measures it); the remaining differences are spaCy special cases not reproduced here (icon
characters as infixes, tokenizer exceptions such as ``gonna`` -> ``gon na``).

:func:`count_sentences` applies spaCy's ``Sentencizer`` rule to these tokens: a new sentence
starts at the first non-punctuation token after a token that is a sentence-final character
(``.``, ``!``, ``?`` and the other characters of spaCy's default list).
"""

from __future__ import annotations

import re
import unicodedata

# datatrove.utils.text.PUNCTUATION (+ its TERMINAL_PUNCTUATION): a word made only of these is a
# "symbol" and does not count as a word in the Gopher quality rules.
PUNCTUATION = (
    "!/—”:％１〈&(、━\\【#%「」，】；+^]~“《„';’{|∶´[=-`*．（–？！：$～«〉,><》)?）。…@_.\"}►»"
    + "".join(map(chr, (x for a, b in ((0, 9), (11, 13), (13, 32), (127, 160))
                        for x in range(a, b))))
    + "᪩？⁈𑩂．꩞𑅃﹗𑂾\u1b7d፧\U00010f87𑗐៙᰻"
)

# spaCy's Sentencizer.default_punct_chars: a token equal to one of these ends a sentence.
SENTENCE_PUNCT = frozenset(
    "!.?։؟۔܀܁܂߹।॥၊။።፧፨᙮᜵᜶᠃᠉᥄᥅᪨᪩᪪᪫᭚᭛᭞᭟᰻᰼᱾᱿‼‽⁇⁈⁉⸮⸼꓿꘎꘏꛳꛷꡶꡷꣎꣏꤯꧈꧉꩝꩞꩟꫰꫱꯫﹒﹖﹗！．？"
    "𐩖𐩗𑁇𑁈𑂾𑂿𑃀𑃁𑅁𑅂𑅃𑇅𑇆𑇍𑇞𑇟𑈸𑈹𑈻𑈼𑊩𑑋𑑌𑗂𑗃𑗉𑗊𑗋𑗌𑗍𑗎𑗏𑗐𑗑𑗒𑗓𑗔𑗕𑗖𑗗𑙁𑙂𑜼𑜽𑜾𑩂𑩃𑪛𑪜𑱁𑱂𖩮𖩯𖫵𖬷𖬸𖭄𛲟𝪈｡。"
)

# Multi-letter abbreviations that spaCy's English tokenizer keeps with their period.
_ABBREVIATIONS = (
    "Adm Ak Ala Apr Ariz Ark Aug Bros Calif Co Colo Conn Corp Dec Del Dr Feb Fla Ga Gen Gov Ia Id "
    "Ill Inc Ind Jan Jr Jul Jun Kan Kans Ky La Ltd Mar Mass Md Messrs Mich Minn Miss Mo Mont Mr "
    "Mrs Ms Mt Neb Nebr Nev Nov Oct Okla Ore Pa Ph.D Prof Rep Rev Sen Sep Sept St Tenn Va Wash "
    "Wis co vs"
).split()
# spaCy's char_classes.UNITS (Latin-script part) plus am/pm: split off a number they end.
_UNITS = (
    "km km² km³ m m² m³ dm dm² dm³ cm cm² cm³ mm mm² mm³ ha µm nm yd in ft kg g mg µg t lb oz "
    "m/s km/h kmh mph hPa Pa mbar mb MB kb KB gb GB tb TB T G M K am pm"
).split()
_UNITS_RE = "|".join(re.escape(u) for u in sorted(_UNITS, key=len, reverse=True))
_ABBREV_RE = "|".join(re.escape(a) for a in sorted(_ABBREVIATIONS, key=len, reverse=True))

# Where spaCy's English infix rules split a whitespace-free run (after a word character): an
# ellipsis, an operator between digits, a period between lower and upper case, a comma between
# letters, a dash or one of : < > = / before a letter; a clitic apostrophe ("don't", "it's").
_INFIX = (
    r"(?:\.\.|…|(?<=\d)[-+*^](?=[\d-])"
    r"|(?<=[a-zß-öø-ÿ'\"”“‘’])\.(?=[A-ZÀ-ÖØ-Þ'\"”“‘’])"
    r"|(?<=[^\W\d_]),(?=[^\W\d_])|(?:-+|–|—|~)(?=[^\W\d_])|[:<>=/](?=[^\W\d_]))"
)
# Symbols that are not among spaCy's English prefixes/suffixes (its punctuation, quotes, brackets,
# currency signs, ellipses, % = + § and long dashes) stay attached to the word they touch: "|x",
# "・A", "-5", "a/" (a hyphen or slash is split off only as an infix, before a letter).
_SPLIT_OFF = re.escape(
    "…,:;!?¿؟¡()[]{}<>_#*&。？！，、；：～·।،۔؛٪'\"”“`‘´’‚„»«「」『』（）〔〕【】《》〈〉⟦⟧"
    "$£€¥฿₽﷼₴₠₡₢₣₤₥₦₧₨₩₪₫₭₮₯₰₱₲₳₵₶₷₸₹₺₻₼₾₿%=+§—–."
)
_GLUE = rf"[^\w\s{_SPLIT_OFF}]"
# Each special case starts with a one-character lookahead, so ordinary words skip it cheaply
# (1.5x faster than trying every alternative at every token).
_TOKEN = re.compile(
    rf"""
      (?=[hw])(?:https?://|www\.)[^\s<>"']*[^\s<>"'.,;:!?)\]}}]  # a URL stays one token
    | (?=[A-Zcv])(?<!\w)(?:{_ABBREV_RE})\.(?!\w)           # Mr. Inc. vs.
    | (?=[^\W\d_]\.)(?<![\w.])(?:[^\W\d_]\.){{2,}}(?!\w)    # U.S. e.g. a.m.
    | (?=[a-z]\.)(?<![\w.])[a-z]\.(?!\w)                   # spaCy's single-letter exceptions: b.
    | (?=[:;8])(?<![\w|@^~])(?::[()D]|;\)|8\))(?![\w|@^~]) # emoticons :) :( :D ;) 8)
    | (?=[Cc]an)[Cc]an(?=not\b)                            # cannot -> can not
    | (?=(?:US|C|A)\$)(?:US|C|A)\$                         # US$ C$ A$ are one token
    | (?=\d)\d+(?:[.,]\d+)*(?=(?:{_UNITS_RE})(?!\w))       # 30mph -> 30 mph
    | (?:(?<!\w){_GLUE}+)?\w+(?:(?!{_INFIX})[^\w\s'’]+\w+)*(?:(?!{_INFIX}){_GLUE})*
                                # inner punctuation sticks unless it is a spaCy infix
      (?:(?<![A-Z][A-Z])(?<=[A-Z])\.(?![\w.]))?            # I. X. keep their period
    | ['’](?:[sStT]|re|ve|ll|[dDmM])\b                     # clitics: 's 't 're
    | \.{{2,}} | -{{2,}}                                   # ... and -- stay whole
    | [^\w\s]                                              # any other symbol, one per token
    """,
    re.VERBOSE,
)


def split_words(text: str) -> list[str]:
    """Split ``text`` into word and punctuation tokens, approximating spaCy's English tokenizer.

    Returns the tokens in order, whitespace dropped (as datatrove's ``strip_strings`` does).
    """
    return _TOKEN.findall(text)


def _is_punct(token: str) -> bool:
    # spaCy's Lexeme.is_punct: every character is in a Unicode punctuation category (P*).
    return all(unicodedata.category(c)[0] == "P" for c in token)


def count_sentences(text: str) -> int:
    """Number of sentences in ``text`` by spaCy's Sentencizer rule over :func:`split_words` tokens.

    Returns 0 for text without tokens, else 1 + the number of sentence starts after the first.
    """
    tokens = split_words(text)
    if not tokens:
        return 0
    n, seen_end = 1, False
    for tok in tokens:
        if tok in SENTENCE_PUNCT:
            seen_end = True
        elif seen_end and not _is_punct(tok):
            n += 1
            seen_end = False
    return n
