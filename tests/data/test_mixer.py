"""The mixer: include/exclude rules and aggregates, sampling weights exactly by the documented hash,
span replacement with overlaps, size limits, the dropped-document record, and clear errors."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest

from olmoflow.config import from_dict
from olmoflow.data.documents import read_documents, write_documents
from olmoflow.data.mixer import MixConfig, apply_span_edits, mix, parse_rule
from olmoflow.data.shards import write_jsonl_gz
from olmoflow.errors import OlmoflowError


def make_run(root: Path, shards: dict[str, list[tuple[dict, dict]]]) -> None:
    """``shards``: ``"source/name" -> [(document, attributes)]``; writes documents + set "tags"."""
    for name, rows in shards.items():
        write_documents(root / "documents" / f"{name}.jsonl.gz", [d for d, _ in rows])
        write_jsonl_gz(root / "attributes" / "tags" / f"{name}.jsonl.gz",
                       [{"id": d["id"], "attributes": a} for d, a in rows])


def doc(i: int | str, text: str, source: str = "web") -> dict:
    return {"id": str(i), "text": text, "source": source}


def tagged(i: int, text: str, *, quality: float, bad: int, emails=(), source="web"):
    n = len(text)
    return doc(i, text, source), {
        "t__quality": [[0, n, quality]], "t__bad": [[0, n, float(bad)]],
        "pii__email": [[s, e, 1.0] for s, e in emails],
    }


def out_docs(root: Path) -> list[dict]:
    return [d for p in sorted((root / "mixed").rglob("*.jsonl.gz")) for d in read_documents(p)]


def dropped(root: Path) -> dict[str, str | None]:
    rows = [json.loads(x) for p in sorted((root / "attributes" / "mixer").rglob("*.gz"))
            for x in gzip.open(p, "rt")]
    return {r["id"]: r.get("dropped_by") for r in rows}


def corpus(n: int = 30) -> dict[str, list]:
    rows = []
    for i in range(n):
        text = f"doc {i} " + "word " * (i % 7) + f"mail me at u{i}@x.org now"
        at = text.index(f"u{i}@")
        rows.append(tagged(i, text, quality=(i % 10) / 10, bad=int(i % 4 == 0),
                           emails=[(at, at + len(f"u{i}@x.org"))] if i % 3 else []))
    return {"web/0000": rows[: n // 2], "web/0001": rows[n // 2:]}


def test_rules_include_then_exclude_and_every_drop_is_explained(tmp_path):
    make_run(tmp_path, corpus())
    cfg = {"attributes": ["tags"], "include": ["t__quality >= 0.3"],
           "exclude": [{"attribute": "t__bad", "op": "==", "value": 1},
                       "count(pii__email) > 0"]}
    stats = mix(tmp_path, cfg, executor="serial")
    expect = [i for i in range(30) if (i % 10) / 10 >= 0.3 and i % 4 and not i % 3]
    assert [d["id"] for d in out_docs(tmp_path)] == [str(i) for i in expect]
    why = dropped(tmp_path)
    for i in range(30):
        want = (None if i in expect else "include: t__quality >= 0.3" if (i % 10) < 3
                else "exclude: t__bad == 1" if i % 4 == 0 else "exclude: count(pii__email) > 0")
        assert why[str(i)] == want, i
    removed = stats["removed"]
    assert stats["documents_in"] == 30 == stats["documents_kept"] + sum(
        r["documents"] for r in removed.values())
    assert removed["include: t__quality >= 0.3"]["documents"] == 9
    assert stats["per_source"]["web"]["documents_out"] == len(expect)


@pytest.mark.parametrize("agg,op,value,expect", [
    ("max", ">", 0.95, {"b"}), ("min", "<", 0.2, {"a", "c"}), ("sum", ">=", 1.0, {"a", "b"}),
    ("count", "==", 0, {"c"}), ("any", "==", 1, {"a", "b"}), ("frac", ">", 0.5, {"a"}),
])
def test_aggregates(agg, op, value, expect):
    spans = {"a": [[0, 6, 0.9], [6, 8, 0.1]], "b": [[0, 1, 1.0]], "c": []}
    rule = parse_rule(f"{agg}(x__y) {op} {value}", "test")
    assert rule == parse_rule({"attribute": "x__y", "op": op, "value": value, "aggregate": agg},
                              "test")
    assert {k for k, s in spans.items() if rule.holds({"x__y": s}, 10)} == expect


def unit(seed: int, doc_id: str) -> float:
    d = hashlib.blake2b(f"{seed}:{doc_id}".encode(), digest_size=8).digest()
    return int.from_bytes(d, "big") / 2**64


def test_weights_sample_and_repeat_exactly_by_the_hash(tmp_path):
    shards = {f"{src}/0000": [(doc(f"{src}{i}", f"text {src} {i}", src), {"t__x": []})
                              for i in range(200)] for src in ("a", "b", "c", "d")}
    make_run(tmp_path, shards)
    seed = 17
    stats = mix(tmp_path, {"attributes": ["tags"], "seed": seed,
                           "weights": {"a": 0.3, "b": 2.5, "c": 0}}, executor="serial")
    ids = [d["id"] for d in out_docs(tmp_path)]
    want = [f"a{i}" for i in range(200) if unit(seed, f"a{i}") < 0.3]
    for i in range(200):
        n = 2 + (unit(seed, f"b{i}") < 0.5)
        want += [f"b{i}"] + [f"b{i}#{k}" for k in range(1, n)]
    want += [f"d{i}" for i in range(200)]
    assert ids == want
    assert 40 < sum(x.startswith("a") for x in ids) < 80  # the hash is roughly uniform
    per = stats["per_source"]
    assert per["c"]["removed"] == {"sampling: weight 0": {"documents": 200, "bytes": per["c"][
        "bytes_in"]}}
    assert per["b"]["copies_added"] == per["b"]["documents_out"] - 200
    assert stats["documents_in"] == stats["documents_kept"] + sum(
        r["documents"] for r in stats["removed"].values())


def test_span_edits_overlaps_and_priorities():
    text = "0123456789abcdef"
    assert apply_span_edits(text, [(2, 4, "<E>", 1)]) == ("01<E>456789abcdef", 1)
    # overlapping spans merge; the lowest priority (removal = 0) names the replacement
    assert apply_span_edits(text, [(2, 6, "<E>", 1), (4, 8, "", 0)]) == ("0189abcdef", 1)
    assert apply_span_edits(text, [(2, 6, "<E>", 1), (4, 8, "<P>", 2)]) == ("01<E>89abcdef", 1)
    # touching spans stay separate; out-of-range spans are clipped; empty ones ignored
    assert apply_span_edits(text, [(0, 2, "A", 1), (2, 4, "B", 1), (14, 99, "Z", 1),
                                   (5, 5, "X", 1)]) == ("AB456789abcdZ", 3)


def test_replace_and_remove_spans_in_the_mix(tmp_path):
    text = "Contact bob@x.org or 555-1234. BOILERPLATE\nReal content."
    e, p, b = text.index("bob"), text.index("555"), text.index("BOILER")
    attrs = {"pii__email": [[e, e + 9, 1.0]], "pii__phone": [[p, p + 8, 1.0], [0, 3, 0.0]],
             "dup__para": [[b, len("Contact bob@x.org or 555-1234. BOILERPLATE\n"), 1.0]]}
    make_run(tmp_path, {"web/0000": [(doc(1, text), attrs)]})
    stats = mix(tmp_path, {"attributes": ["tags"], "remove_spans": ["dup__para"],
                           "replace": {"pii__email": "|||EMAIL_ADDRESS|||",
                                       "pii__phone": "|||PHONE_NUMBER|||"}}, executor="serial")
    (out,) = out_docs(tmp_path)
    assert out["text"] == "Contact |||EMAIL_ADDRESS||| or |||PHONE_NUMBER|||. Real content."
    assert stats["edited"] == {"remove: dup__para": {"documents": 1, "spans": 1},
                               "replace: pii__email": {"documents": 1, "spans": 1},
                               "replace: pii__phone": {"documents": 1, "spans": 1}}
    assert stats["bytes_out"] == len(out["text"].encode())


def sized(n_shards: int, per: int) -> dict[str, list]:
    return {f"web/{s:04d}": [(doc(f"{s}-{i}", "x" * (10 + i)), {"t__x": []})
                             for i in range(per)] for s in range(n_shards)}


def test_total_limits_keep_a_prefix_in_corpus_order(tmp_path):
    make_run(tmp_path, sized(3, 4))
    stats = mix(tmp_path, {"attributes": ["tags"], "max_documents": 6}, executor="serial")
    assert [d["id"] for d in out_docs(tmp_path)] == ["0-0", "0-1", "0-2", "0-3", "1-0", "1-1"]
    assert stats["removed"] == {"limit: max_documents": {"documents": 6, "bytes": 12 + 13 + 46}}
    # bytes: 10+11+12+13 = 46 for shard 0, then 10 and 11 fit in 70, 12 would not
    stats = mix(tmp_path, {"attributes": ["tags"], "max_bytes": 70}, executor="serial")
    assert [d["id"] for d in out_docs(tmp_path)] == ["0-0", "0-1", "0-2", "0-3", "1-0", "1-1"]
    assert stats["bytes_out"] == 67 and stats["documents_kept"] == 6
    assert set(dropped(tmp_path).values()) == {None, "limit: max_bytes"}


def test_per_shard_limits_split_into_parts(tmp_path):
    make_run(tmp_path, sized(1, 7))
    mix(tmp_path, {"attributes": ["tags"], "max_documents_per_shard": 3}, executor="serial")
    parts = sorted((tmp_path / "mixed" / "web").glob("*.jsonl.gz"))
    assert [p.name for p in parts] == ["0000-0000.jsonl.gz", "0000-0001.jsonl.gz",
                                       "0000-0002.jsonl.gz"]
    assert [len(list(read_documents(p))) for p in parts] == [3, 3, 1]
    mix(tmp_path, {"attributes": ["tags"], "max_bytes_per_shard": 25}, executor="serial")
    parts = sorted((tmp_path / "mixed" / "web").glob("*.jsonl.gz"))  # stale parts removed
    sizes = [[len(d["text"]) for d in read_documents(p)] for p in parts]
    assert sizes == [[10, 11], [12, 13], [14], [15], [16]]  # each part <= 25 bytes


def test_unknown_names_are_one_line_errors_with_the_closest(tmp_path):
    make_run(tmp_path, corpus(4))
    with pytest.raises(OlmoflowError, match=r"mixer\.exclude\[0\]: unknown attribute 't__qualty'; "
                                            r"did you mean 't__quality'\?") as e:
        mix(tmp_path, {"attributes": ["tags"], "exclude": ["t__qualty < 0.5"]})
    assert "\n" not in str(e.value)
    with pytest.raises(OlmoflowError, match="did you mean 'tags'"):
        mix(tmp_path, {"attributes": ["tag"]})
    with pytest.raises(OlmoflowError, match="unknown source 'wbe'; did you mean 'web'"):
        mix(tmp_path, {"attributes": ["tags"], "weights": {"wbe": 2}})
    with pytest.raises(OlmoflowError, match="did you mean 'mixer.exclude'"):
        from_dict(MixConfig, {"exlude": []}, "mixer.")
    with pytest.raises(OlmoflowError, match="unknown op '=<'"):
        parse_rule({"attribute": "a", "op": "=<", "value": 1}, "mix.include[0]")
    with pytest.raises(OlmoflowError, match="did you mean 'sum'"):
        parse_rule("sun(a) > 1", "mix.include[0]")
    with pytest.raises(OlmoflowError, match="cannot parse rule"):
        parse_rule("a >", "mix.include[0]")


def test_an_attribute_written_only_where_it_fires_is_found(tmp_path):
    rows = [(doc(i, f"text {i}"), {"t__x": []} if i < 5 else {"t__x": [], "pii__rare": [[0, 4, 1]]})
            for i in range(6)]
    make_run(tmp_path, {"web/0000": rows})
    stats = mix(tmp_path, {"attributes": ["tags"], "replace": {"pii__rare": "|||R|||"}},
                executor="serial")
    assert [d["text"] for d in out_docs(tmp_path)][-1] == "|||R||| 5"
    assert stats["edited"] == {"replace: pii__rare": {"documents": 1, "spans": 1}}


def test_misaligned_attributes_are_an_error(tmp_path):
    rows = corpus(4)["web/0000"]
    make_run(tmp_path, {"web/0000": rows})
    write_jsonl_gz(tmp_path / "attributes/tags/web/0000.jsonl.gz",
                   [{"id": d["id"], "attributes": a} for d, a in reversed(rows)])
    with pytest.raises(OlmoflowError, match="is not the id"):
        mix(tmp_path, {"attributes": ["tags"]}, executor="serial")
    write_jsonl_gz(tmp_path / "attributes/tags/web/0000.jsonl.gz",
                   [{"id": d["id"], "attributes": a} for d, a in rows[:1]])
    with pytest.raises(OlmoflowError, match="end before documents line 2"):
        mix(tmp_path, {"attributes": ["tags"]}, executor="serial")


def test_same_bytes_on_rerun_and_weights_are_seeded(tmp_path):
    make_run(tmp_path, {"web/0000": [(doc(i, f"t{i}"), {"t__x": []}) for i in range(100)]})
    cfg = {"attributes": ["tags"], "weights": {"web": 0.5}}
    mix(tmp_path, cfg, executor="serial")
    first = (tmp_path / "mixed/web/0000-0000.jsonl.gz").read_bytes()
    mix(tmp_path, {**cfg, "seed": 1}, executor="serial")
    other = (tmp_path / "mixed/web/0000-0000.jsonl.gz").read_bytes()
    mix(tmp_path, cfg, executor="serial")
    assert (tmp_path / "mixed/web/0000-0000.jsonl.gz").read_bytes() == first != other
    n = len(list(read_documents(tmp_path / "mixed/web/0000-0000.jsonl.gz")))
    assert n == sum(unit(0, str(i)) < 0.5 for i in range(100))


def test_merge_settings_appends_step_rules_once():
    from olmoflow.data.dedup import mixer_rules as dedup_rules
    from olmoflow.data.mixer import merge_settings

    d = dedup_rules({"exact": True, "paragraphs": True})
    merged = merge_settings({"attributes": ["tags"], "exclude": ["t__bad == 1"]}, d, d)
    assert merged == {"attributes": ["tags", "dedup"],
                      "exclude": ["t__bad == 1",
                                  {"attribute": "dedup__exact", "op": "==", "value": 1}],
                      "remove_spans": ["dedup__paragraphs"]}
    from_dict(MixConfig, merged, "mixer.")  # valid as a mixer config


def test_bad_document_lines_are_counted_or_raise_with_strict(tmp_path):
    rows = corpus(4)["web/0000"]
    make_run(tmp_path, {"web/0000": rows})
    shard = tmp_path / "documents/web/0000.jsonl.gz"
    lines = gzip.open(shard, "rt").read().splitlines()
    lines[1] = "{broken"
    with gzip.open(shard, "wt") as f:
        f.write("\n".join(lines) + "\n")
    stats = mix(tmp_path, {"attributes": ["tags"]}, executor="serial")
    assert stats["documents_in"] == 1 and len(stats["errors"]) == 1
    assert "0000.jsonl.gz:2: not JSON" in stats["errors"][0]
    assert list(dropped(tmp_path)) == ["0", None]  # still line-aligned with the documents
    with pytest.raises(OlmoflowError, match=r"0000.jsonl.gz:2: not JSON"):
        mix(tmp_path, {"attributes": ["tags"], "seed": 3}, executor="serial", strict=True)
