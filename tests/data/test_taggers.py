"""Taggers: the registry, the attribute files of tag_shard, and what each built-in tagger finds."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from engine_inputs import engine_config

from olmoflow.data.documents import write_documents
from olmoflow.data.taggers import (
    Tagger,
    get_tagger,
    read_attributes,
    register_tagger,
    tag_shard,
    tagger_names,
)
from olmoflow.data.taggers.gopher import _ngram_stats
from olmoflow.errors import OlmoflowError

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "web-crawl"

ENGLISH = (
    "The committee met on Tuesday to discuss the new budget for the library. Members agreed that "
    "the reading room needs better lighting and that the children's section should have more "
    "books. After a long debate, they voted to increase the funds for repairs. The mayor said "
    "she was pleased with the outcome and thanked everyone who came to the meeting. Work on the "
    "building will start next month and should be finished before the end of the year."
)


@register_tagger("shouting")
class Shouting(Tagger):
    """A user-defined tagger: the fraction of letters in upper case."""

    defaults = {"min_letters": 1}

    def tag(self, doc):
        text = doc["text"]
        letters = [c for c in text if c.isalpha()]
        frac = sum(c.isupper() for c in letters) / max(len(letters), self.options["min_letters"])
        return {self.attr("upper_fraction"): [[0, len(text), frac]]}


def _shard(tmp_path: Path, texts: list[str]) -> Path:
    path = tmp_path / "documents" / "web" / "0000.jsonl.gz"
    write_documents(path, [{"id": f"d{i}", "text": t, "source": "web"}
                           for i, t in enumerate(texts)])
    return path


def test_unknown_tagger_and_option_name_the_closest():
    with pytest.raises(OlmoflowError, match="did you mean 'gopher'"):
        get_tagger("gophr")
    with pytest.raises(OlmoflowError, match="did you mean 'min_doc_words'"):
        get_tagger("gopher", min_doc_word=10)
    with pytest.raises(OlmoflowError, match="bad tagger name"):
        register_tagger("Bad__Name")
    assert {"gopher", "c4", "langid", "pii", "quality", "code_license", "code_secrets",
            "shouting"} <= set(tagger_names())


def test_user_tagger_attributes_are_written_line_aligned(tmp_path):
    texts = ["HELLO THERE", "quiet words", ENGLISH]
    src = _shard(tmp_path, texts)
    out = tmp_path / "attributes" / "mine" / "web" / "0000.jsonl.gz"
    stats = tag_shard({"documents": str(src), "output": str(out), "taggers": ["shouting", "pii"]})
    assert stats["documents_in"] == stats["documents_out"] == 3 and stats["errors"] == []
    assert stats["outputs"] == [str(out)]
    records = read_attributes(out)
    assert [r["id"] for r in records] == ["d0", "d1", "d2"]
    fracs = [r["attributes"]["shouting__upper_fraction"][0][2] for r in records]
    assert fracs[0] == 1.0 and fracs[1] == 0.0 and 0 < fracs[2] < 0.1
    assert records[0]["attributes"]["shouting__upper_fraction"][0][:2] == [0, len(texts[0])]
    pii = {"pii__count", "pii__email_address", "pii__phone_number", "pii__ip_address"}
    assert all(pii <= set(r["attributes"]) for r in records), "every kind, found or not"


def test_tag_shard_is_deterministic_and_keeps_alignment_over_bad_lines(tmp_path):
    src = tmp_path / "docs.jsonl.gz"
    lines = [json.dumps({"id": "a", "text": ENGLISH, "source": "s"}), "{not json",
             json.dumps({"id": "b", "text": "Mail me at jo@example.org today.", "source": "s"})]
    with gzip.open(src, "wt") as f:
        f.write("\n".join(lines) + "\n")
    task = {"documents": str(src), "output": str(tmp_path / "a1.jsonl.gz"),
            "taggers": {"gopher": {}, "c4": {}, "pii": {}}}
    stats = tag_shard(task)
    assert stats["documents_in"] == 2 and stats["documents_out"] == 3
    assert len(stats["errors"]) == 1 and f"{src}:2:" in stats["errors"][0]
    records = read_attributes(task["output"])
    assert [r["id"] for r in records] == ["a", None, "b"] and records[1]["attributes"] == {}
    assert records[2]["attributes"]["pii__email_address"] == [[11, 25, 1.0]]
    tag_shard({**task, "output": str(tmp_path / "a2.jsonl.gz")})
    assert (tmp_path / "a1.jsonl.gz").read_bytes() == (tmp_path / "a2.jsonl.gz").read_bytes()
    with pytest.raises(OlmoflowError, match=":2: not a JSON document"):
        tag_shard({**task, "output": str(tmp_path / "a3.jsonl.gz"), "strict": True})
    assert not (tmp_path / "a3.jsonl.gz").exists()


def test_truncated_shard_keeps_the_lines_before_the_damage(tmp_path):
    src = _shard(tmp_path, [ENGLISH + f" Number {i}." for i in range(400)])
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    task = {"documents": str(cut), "output": str(tmp_path / "a.jsonl.gz"), "taggers": ["pii"]}
    stats = tag_shard(task)
    assert 0 < stats["documents_out"] < 400 and len(stats["errors"]) == 1
    assert "damaged file" in stats["errors"][0] and str(cut) in stats["errors"][0]
    ids = [r["id"] for r in read_attributes(task["output"])]
    assert ids == [f"d{i}" for i in range(len(ids))]
    with pytest.raises(OlmoflowError, match="damaged file"):
        tag_shard({**task, "output": str(tmp_path / "b.jsonl.gz"), "strict": True})


# --- Gopher ---------------------------------------------------------------------------------


def _reference_ngram_stats(words: list[str], n_chars: int) -> dict[str, float]:
    """datatrove 0.10.1's GopherRepetitionFilter n-gram measurements, on word lists."""
    out = {}
    for n in (2, 3, 4):
        grams = [" ".join(words[i:i + n]) for i in range(len(words) - n + 1)]
        if grams:
            top, count = Counter(grams).most_common(1)[0]
            out[f"top_{n}gram_char_frac"] = len(top) * count / n_chars
        else:
            out[f"top_{n}gram_char_frac"] = 0.0
    for n in range(5, 11):
        seen, repeated, idx = set(), 0, 0
        while idx < len(words) - n + 1:
            gram = "".join(words[idx:idx + n])
            if gram in seen:
                repeated += len(gram)
                idx += n
            else:
                seen.add(gram)
                idx += 1
        out[f"dup_{n}gram_char_frac"] = repeated / n_chars
    return out


def test_ngram_measurements_equal_the_reference_definition():
    rng = random.Random(0)
    for trial in range(300):
        vocab = [f"w{i}" * rng.randint(1, 3) for i in range(rng.randint(1, 12))]
        words = [rng.choice(vocab) for _ in range(rng.randint(0, 120))]
        if trial % 3 == 0 and len(words) > 10:  # long exact repeats, the case that skips ahead
            words = words[:10] * rng.randint(2, 5) + words[10:]
        n_chars = sum(map(len, words)) + len(words)
        ours = _ngram_stats(words, n_chars)
        ref = _reference_ngram_stats(words, n_chars) if words else ours
        assert ours == pytest.approx(ref), (trial, words)


def test_gopher_rules_fire_on_the_documents_they_describe():
    g = get_tagger("gopher")
    _, fails = g.measure(ENGLISH)
    assert not fails["any"], {k for k, v in fails.items() if v}
    cases = {
        "short_doc": "Too short to keep.",
        "too_many_bullets": "\n".join(f"- item {i} of the list with the and of" for i in range(60)),
        "too_many_hashes": ENGLISH + " #tag" * 20,
        "few_stop_words": " ".join(f"word{i} alpha beta gamma" for i in range(30)),
        "dup_line_frac": "\n".join([ENGLISH] + ["Buy now and save with the deal of the day."] * 10),
        "top_2gram": ENGLISH + " click here" * 100,
    }
    for rule, text in cases.items():
        _, fails = g.measure(text)
        assert fails[rule] and fails["any"], rule
    attrs = g.tag({"text": cases["short_doc"]})
    assert attrs["gopher__fail_short_doc"] == [[0, 18, 1.0]]
    assert attrs["gopher__word_count"] == [[0, 18, 4]]


# --- C4 -------------------------------------------------------------------------------------


def test_c4_rules_and_removed_line_spans():
    c4 = get_tagger("c4")
    js = "Please enable JavaScript in your browser to continue."
    policy = "By using this site you agree to our privacy policy today."
    text = "\n".join([ENGLISH, js, "Menu", policy, ENGLISH])
    attrs = c4.tag({"text": text})
    removed = [text[s:e] for s, e, _ in attrs["c4__line_removed"]]
    assert removed == [js, "Menu", policy]
    assert attrs["c4__lines_javascript"][0][2] == 1 and attrs["c4__lines_policy"][0][2] == 1
    assert attrs["c4__fail_any"][0][2] == 0.0 and attrs["c4__sentences"][0][2] == 10
    for rule, bad in {"lorem_ipsum": "Lorem ipsum dolor sit amet, consectetur.",
                      "curly_bracket": "The function body {return x;} ends here."}.items():
        a = c4.tag({"text": ENGLISH + "\n" + bad})
        assert a[f"c4__fail_{rule}"][0][2] == 1.0 and a["c4__fail_any"][0][2] == 1.0
    few = c4.tag({"text": "One sentence here. Two sentences here."})
    assert few["c4__fail_too_few_sentences"][0][2] == 1.0 and few["c4__sentences"][0][2] == 2


def test_decisions_agree_with_datatrove_on_web_crawl():
    pytest.importorskip("datatrove",
                        reason="datatrove not installed (pip install 'olmoflow[bench]')")
    pytest.importorskip("spacy", reason="spacy not installed (pip install 'olmoflow[bench]')")
    if not DATA.is_dir():
        pytest.skip(f"../shared/data absent: {DATA}")
    from datatrove.data import Document
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )

    texts = [json.loads(line)["text"] for line in open(DATA / "c4_demo.jsonl")][:60]
    texts += [json.loads(line)["text"] for line in open(DATA / "dclm_majority_data.jsonl")][:60]
    g, c4 = get_tagger("gopher"), get_tagger("c4")
    filters = {"quality": GopherQualityFilter(), "repetition": GopherRepetitionFilter(),
               "c4": C4QualityFilter()}
    disagree = Counter()
    for text in texts:
        _, gf = g.measure(text)
        c4_drop = c4.tag({"text": text})["c4__fail_any"][0][2] == 1.0
        ours_drop = {"quality": gf["quality"], "repetition": gf["repetition"], "c4": c4_drop}
        for name, f in filters.items():
            kept = f.filter(Document(text=text, id="x")) is True
            disagree[name] += kept == ours_drop[name]
    for name in filters:
        assert disagree[name] / len(texts) <= 0.02, (name, disagree[name], len(texts))


# --- language id, PII, code ------------------------------------------------------------------


def test_langid_tells_german_from_english():
    if not DATA.is_dir():
        pytest.skip(f"../shared/data absent: {DATA}")
    german = (DATA / "cs336_german.txt").read_text()
    lid = get_tagger("langid", per_paragraph=True)
    de = lid.tag({"text": german})
    assert de["langid__de"][0][2] > 0.9 and de["langid__en"][0][2] < 0.1
    en = lid.tag({"text": ENGLISH})
    assert en["langid__en"][0][2] > 0.9 and "langid__de" not in en
    mixed = ENGLISH + "\n\n" + german
    paras = lid.tag({"text": mixed})
    assert [mixed[s:e] for s, e, _ in paras["langid__paragraph_en"]] == [ENGLISH]
    assert [mixed[s:e] for s, e, _ in paras["langid__paragraph_de"]] == [german.strip()]


def test_pii_spans_cover_exactly_the_identifiers():
    text = ("Write to jane.doe+news@mail.example.co.uk or call (555) 123-4567 / +44 20 7946 0958. "
            "Server 192.168.1.20 is up; version 1.2.3.4.5 and the year 2023 are not PII, nor is "
            "300.1.1.1 or 12345.")
    attrs = get_tagger("pii").tag({"text": text})
    found = {k: [text[s:e] for s, e, _ in v] for k, v in attrs.items() if k != "pii__count"}
    assert found == {
        "pii__email_address": ["jane.doe+news@mail.example.co.uk"],
        "pii__phone_number": ["(555) 123-4567", "+44 20 7946 0958"],
        "pii__ip_address": ["192.168.1.20"],
    }
    assert attrs["pii__count"][0][2] == 4


def test_code_taggers_find_licenses_and_secrets():
    src = (
        "// SPDX-License-Identifier: Apache-2.0\n"
        "// Licensed under the Apache License, Version 2.0\n"
        'aws_key = "AKIAIOSFODNN7EXAMPLE"\n'
        'token = "ghp_' + "a1B2" * 9 + '"\n'
        'api_key = "Zx81kQ_pL0vR7tYw2mN5cB9dF3gH6jK4"\n'
        'password = "aaaaaaaaaaaaaaaaaaaaaaaa"\n'
        "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA\n-----END RSA PRIVATE KEY-----\n"
    )
    lic = get_tagger("code_license").tag({"text": src})
    assert [src[s:e] for s, e, _ in lic["code_license__spdx"]] == [
        "SPDX-License-Identifier: Apache-2.0"
    ]
    assert lic["code_license__spdx_ids"][0][2] == 1 and lic["code_license__phrase"]
    sec = get_tagger("code_secrets").tag({"text": src})
    found = {k: [src[s:e] for s, e, _ in v] for k, v in sec.items()}
    assert found["code_secrets__aws_access_key"] == ["AKIAIOSFODNN7EXAMPLE"]
    assert found["code_secrets__github_token"] == ["ghp_" + "a1B2" * 9]
    assert found["code_secrets__api_key"] == ["Zx81kQ_pL0vR7tYw2mN5cB9dF3gH6jK4"]  # not "aaaa..."
    assert found["code_secrets__private_key"][0].startswith("-----BEGIN RSA PRIVATE KEY-----")
    assert get_tagger("code_secrets").tag({"text": ENGLISH}) == {}

def test_editing_a_plugin_tagger_retags_every_shard(tmp_path):
    # The tag step reran after a plugin file changed (its fingerprint holds the file's stamp),
    # but every shard was skipped by its done-marker, which named the plugin by path only: the
    # attributes kept the old code's scores.
    plugin = tmp_path / "mine.py"
    code = ("from olmoflow.data.taggers import Tagger, register_tagger\n\n"
            "@register_tagger('mine')\nclass Mine(Tagger):\n    def tag(self, doc):\n"
            "        return {self.attr('score'): [[0, len(doc['text']), %s]]}\n")
    cfg = engine_config(tmp_path, steps="[ingest, tag]",
                 extra=f"plugins: [{plugin}]\n").read_text().replace("[pii]", "[mine]")
    (tmp_path / "data.yaml").write_text(cfg)
    cli = [sys.executable, "-c", "import sys; from olmoflow.cli import main; "
           "sys.exit(main(sys.argv[1:]))", "data", "run", str(tmp_path / "data.yaml"),
           "--no-progress"]
    scores = []
    for value in (1.0, 2.0):
        plugin.write_text(code % value)
        subprocess.run(cli, check=True, capture_output=True)
        from olmoflow.data.taggers import read_attributes

        rows = read_attributes(next((tmp_path / "run" / "attributes" / "tags").rglob("*.gz")))
        scores.append({r["attributes"]["mine__score"][0][2] for r in rows})
    assert scores == [{1.0}, {2.0}]


# --- data-engine plugins: a module name never resolves from the current directory -----------------


PLUGIN = """
import pathlib
pathlib.Path("RAN").write_text(__name__)
"""


@pytest.fixture
def m_cwd(tmp_path, monkeypatch):
    """The current directory as ``python -m olmoflow`` sees it (first on ``sys.path``)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.delenv("PYTHONPATH", raising=False)
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_a_plugin_module_in_the_current_directory_is_refused(m_cwd):
    from olmoflow.data.taggers import import_plugins

    (m_cwd / "my_taggers.py").write_text(PLUGIN)
    with pytest.raises(OlmoflowError, match=r"plugins: cannot import 'my_taggers': .*current "
                                            r"directory.*plugins: \[\./my_taggers\.py\]"):
        import_plugins(["my_taggers"])
    assert not (m_cwd / "RAN").exists()
    import_plugins([str(m_cwd / "my_taggers.py")])  # named as a file: the user's choice
    assert (m_cwd / "RAN").exists()
