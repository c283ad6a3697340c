"""Post-training data readers: each SFT and preference format on small files and the shared
copies, the HH-RLHF split, loss masks, too-long rules and bad input."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from chat_models import chat_tokenizer

from olmoflow.errors import OlmoflowError
from olmoflow.posttrain.data import (
    Conversation,
    DataStats,
    check_data_files,
    preference_examples,
    read_conversations,
    read_pairs,
    sft_examples,
)
from olmoflow.posttrain.formats import split_hh_rlhf, to_pair
from olmoflow.posttrain.sft import build_sft_data
from olmoflow.tokenizer import BPETokenizer
from olmoflow.tokenizer.chat import add_chat_template, render

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
TEXTS = ["Hello world! The cat sat on the mat. What is 2+2? It is 4.\n\nSure thing (yes).",
         "def add(a, b):\n    return a + b\n# user, assistant, system, Human, Assistant"]

CONV = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello world!"},
        {"role": "assistant", "content": "The cat sat."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "It is 4."}]


@pytest.fixture(scope="module")
def base_tok() -> BPETokenizer:
    return BPETokenizer().train_from_texts(TEXTS * 8, vocab_size=300)


@pytest.fixture(scope="module", params=["olmo3", "tulu", "plain"])
def chat(request, base_tok, tmp_path_factory):
    """(template name, a tokenizer prepared for it)."""
    d = tmp_path_factory.mktemp("tok")
    base_tok.save(d)
    tok = BPETokenizer.load(d)
    add_chat_template(tok, request.param)
    return request.param, tok


def write_jsonl(path: Path, records, extra_lines=()) -> Path:
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def convs(source, **kw) -> list:
    return [c.messages if c.text is None else c.text for c in read_conversations(source, **kw)]


# --- SFT formats ------------------------------------------------------------------------------


def test_each_sft_format_on_small_files(tmp_path):
    msgs = write_jsonl(tmp_path / "m.jsonl", [{"messages": CONV}])
    assert convs([msgs]) == [CONV]
    alpaca = tmp_path / "a.json"
    alpaca.write_text(json.dumps([
        {"instruction": "Add.", "input": "1 2", "output": "3"},
        {"instruction": "Say hi.", "input": "", "output": "hi", "system": "S",
         "history": [["q", "a"]]}]))
    assert convs([alpaca]) == [
        [{"role": "user", "content": "Add.\n1 2"}, {"role": "assistant", "content": "3"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
         {"role": "assistant", "content": "a"}, {"role": "user", "content": "Say hi."},
         {"role": "assistant", "content": "hi"}]]
    share = write_jsonl(tmp_path / "s.jsonl", [{"conversations": [
        {"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
        {"from": "gpt", "value": "A"}]}])
    assert convs([share]) == [[{"role": "system", "content": "S"},
                               {"role": "user", "content": "Q"},
                               {"role": "assistant", "content": "A"}]]
    si = write_jsonl(tmp_path / "si.jsonl", [{"id": "t0", "instruction": "Sort.", "instances": [
        {"input": "b a", "output": "a b"}, {"input": "", "output": "nothing"}]}])
    cs = list(read_conversations([si]))
    assert [c.messages for c in cs] == [
        [{"role": "user", "content": "Sort.\nb a"}, {"role": "assistant", "content": "a b"}],
        [{"role": "user", "content": "Sort."}, {"role": "assistant", "content": "nothing"}]]
    assert cs[1].where.endswith("si.jsonl:1 instance 2")
    txt = tmp_path / "t.txt"
    txt.write_text("first line\n\nsecond line\n")
    assert convs([txt]) == ["first line", "second line"]
    assert convs([write_jsonl(tmp_path / "t.jsonl", [{"text": "doc"}])]) == ["doc"]


def test_forced_format_and_bad_format_name(tmp_path):
    f = write_jsonl(tmp_path / "m.jsonl", [{"messages": CONV, "text": "x"}])
    assert convs([f], format="text") == ["x"]
    stats = DataStats()
    assert convs([f], format="alpaca", stats=stats) == []
    assert "m.jsonl:1" in stats.skipped[0] and "'instruction'" in stats.skipped[0]
    with pytest.raises(OlmoflowError, match="did you mean 'sharegpt'"):
        list(read_conversations([f], format="sharegtp"))
    with pytest.raises(OlmoflowError, match="did you mean 'sharegpt'"):
        list(read_pairs([f], format="sharegpt_"))


SHARED_SFT = [("instruct/llamafactory_alpaca_en_demo.json", 999),
              ("instruct/self_instruct_seed_tasks.jsonl", 175),
              ("instruct/self_instruct_user_oriented_instructions.jsonl", 252)]
SHARED_PAIRS = [("preference/llamafactory_dpo_en_demo.json", 300, 0, 0),
                ("preference/torchtune_stack_exchange_paired_tiny.json", 25, 0, 0),
                ("hh-rlhf/helpful-base-test.jsonl.gz", 2354, 4, 2),
                ("hh-rlhf/harmless-base-test.jsonl.gz", 2312, 4, 0)]


@pytest.mark.parametrize("rel,n", SHARED_SFT)
def test_shared_sft_files(rel, n):
    path = SHARED / rel
    if not path.is_file():
        pytest.skip(f"{path} absent (the shared data copies are not on this machine)")
    stats = DataStats()
    cs = list(read_conversations([path], stats=stats))
    assert len(cs) == n and stats.read == n and stats.skipped == []
    assert all(c.messages[-1]["role"] == "assistant" and c.messages[-1]["content"] for c in cs)


@pytest.mark.parametrize("rel,n,bad,same", SHARED_PAIRS)
def test_shared_preference_files(rel, n, bad, same):
    path = SHARED / rel
    if not path.is_file():
        pytest.skip(f"{path} absent (the shared data copies are not on this machine)")
    stats = DataStats()
    pairs = list(read_pairs([path], stats=stats))
    # the HH-RLHF test splits hold 4 pairs each with an empty (whitespace-only) response, and
    # helpful-base 2 whose chosen and rejected strings are the same (lines 722 and 2169)
    assert stats.read == n and len(pairs) == n - bad - same and len(stats.skipped) == bad
    assert len(stats.identical) == same and stats.kept == len(pairs)
    assert all("response is empty" in s and f"{path.name}:" in s for s in stats.skipped)
    for p in pairs:
        assert p.prompt[-1]["role"] == "user"
        assert p.chosen[0]["role"] == p.rejected[0]["role"] == "assistant"


def test_shared_files_tokenize(chat):
    name, tok = chat
    if not (SHARED / "preference").is_dir():
        pytest.skip(f"{SHARED} absent (the shared data copies are not on this machine)")
    recs = json.loads((SHARED / SHARED_SFT[0][0]).read_text())[:20]
    exs = list(sft_examples(recs, name, tok, 4096))
    assert len(exs) == 20 and all(sum(e.loss_mask) > 0 for e in exs)
    pairs = json.loads((SHARED / SHARED_PAIRS[0][0]).read_text())[:10]
    stats = DataStats()
    pex = list(preference_examples(pairs, name, tok, None, stats=stats))
    assert len(pex) == 10 and stats.skipped == []


# --- HH-RLHF split ----------------------------------------------------------------------------


def test_hh_rlhf_split_exact():
    chosen = ("\n\nHuman: Hi there\n\nAssistant: Hello! How can I help?\n\nHuman: Name a "
              "fruit.\n\nAssistant: An apple.\n\nHuman: thanks")
    rejected = ("\n\nHuman: Hi there\n\nAssistant: Hello! How can I help?\n\nHuman: Name a "
                "fruit.\n\nAssistant: An axe.")
    prompt, c, r = split_hh_rlhf(chosen, rejected)
    assert prompt == [{"role": "user", "content": "Hi there"},
                      {"role": "assistant", "content": "Hello! How can I help?"},
                      {"role": "user", "content": "Name a fruit."}]
    # the responses share "An a": the prompt still ends at the last shared Assistant marker,
    # and a response that runs on into another "Human:" turn stays whole
    assert c == "An apple.\n\nHuman: thanks" and r == "An axe."
    p2, c2, r2 = to_pair({"chosen": chosen, "rejected": rejected})
    assert p2 == prompt and c2 == [{"role": "assistant", "content": c}]
    assert r2 == [{"role": "assistant", "content": r}]


def test_each_preference_format(tmp_path):
    q = [{"role": "user", "content": "Q"}]
    yes, no = {"role": "assistant", "content": "yes"}, {"role": "assistant", "content": "no"}
    recs = [
        {"prompt": "Q", "chosen": "yes", "rejected": "no"},
        {"prompt": q, "chosen": [*q, yes], "rejected": [no]},
        {"chosen": [*q, yes], "rejected": [*q, no]},
        {"conversations": [{"from": "human", "value": "Q"}],
         "chosen": {"from": "gpt", "value": "yes"}, "rejected": {"from": "gpt", "value": "no"}},
        {"question": "Q", "response_j": "yes", "response_k": "no"},
        {"chosen": "\n\nHuman: Q\n\nAssistant: yes", "rejected": "\n\nHuman: Q\n\nAssistant: no"},
    ]
    f = write_jsonl(tmp_path / "p.jsonl", recs)
    pairs = list(read_pairs([f]))
    assert len(pairs) == len(recs)
    for p in pairs:
        assert (p.prompt, p.chosen, p.rejected) == (q, [yes], [no]), p.where


# --- token ids and masks ----------------------------------------------------------------------


def masked_text(tok, ids, mask, keep: int) -> str:
    return tok.decode([i for i, m in zip(ids, mask, strict=True) if m == keep],
                      skip_special_tokens=False)


def test_loss_mask_only_on_assistant_tokens_and_end_marker(chat):
    name, tok = chat
    (ex,) = sft_examples([{"messages": CONV}], name, tok, None)
    assert (ex.input_ids, ex.loss_mask) == tuple(render(CONV, name, tok))
    eos = tok.eos_token
    # olmo3's inner assistant turns end with <|im_end|>, the template's EOS
    assert masked_text(tok, ex.input_ids, ex.loss_mask, 1) == f"The cat sat.{eos}It is 4.{eos}"
    untrained = masked_text(tok, ex.input_ids, ex.loss_mask, 0)
    assert "The cat" not in untrained and "Hello world!" in untrained and "2+2" in untrained
    assert ex.input_ids[-1] == tok.eos_token_id and ex.loss_mask[-1] == 1


def test_text_records_train_every_token(chat):
    name, tok = chat
    (ex,) = sft_examples(["The cat sat."], name, tok, None)
    assert ex.input_ids == tok.encode("The cat sat.", add_eos=True)
    assert ex.loss_mask == [1] * len(ex.input_ids)


def test_too_long_truncates_whole_turns_or_drops(chat):
    name, tok = chat
    full, _ = render(CONV, name, tok)
    first, _ = render(CONV[:3], name, tok)
    stats = DataStats()
    (ex,) = sft_examples([{"messages": CONV}], name, tok, len(full) - 1, stats=stats)
    # the last exchange goes whole; the kept turn ends with its marker, trained
    assert (ex.input_ids, ex.turns_removed) == (first, 2)
    assert ex.input_ids[-1] in (tok.eos_token_id,) and ex.loss_mask[-1] == 1
    assert stats.truncated == 1 and stats.dropped == []
    stats = DataStats()
    assert list(sft_examples([{"messages": CONV}], name, tok, len(full) - 1,
                             on_too_long="drop", stats=stats)) == []
    assert stats.dropped == ["record 1"] and stats.truncated == 0 and stats.kept == 0
    stats = DataStats()
    assert list(sft_examples([{"messages": CONV}], name, tok, len(first) - 1, stats=stats)) == []
    assert stats.dropped == ["record 1"]
    (ex,) = sft_examples([{"messages": CONV}], name, tok, len(full), stats=stats)
    assert ex.turns_removed == 0
    text_ids = tok.encode("The cat sat on the mat.", add_eos=True)
    stats = DataStats()
    (ex,) = sft_examples(["The cat sat on the mat."], name, tok, 3, stats=stats)
    assert ex.input_ids == text_ids[:3] and ex.turns_removed == len(text_ids) - 3
    assert stats.truncated == 1
    with pytest.raises(OlmoflowError, match="did you mean 'truncate'"):
        list(sft_examples(["x"], name, tok, 3, on_too_long="truncat"))


def test_preference_examples_split_prompt_and_responses(chat):
    name, tok = chat
    prompt = CONV[:4]
    pair = {"prompt": prompt, "chosen": "It is 4.", "rejected": "The cat sat on the mat."}
    (ex,) = preference_examples([pair], name, tok)
    for resp, ids, mask in (("It is 4.", ex.chosen_ids, ex.chosen_mask),
                            ("The cat sat on the mat.", ex.rejected_ids, ex.rejected_mask)):
        full, full_mask = render([*prompt, {"role": "assistant", "content": resp}], name, tok)
        assert ex.prompt_ids + ids == full
        # only the final response and its end marker are trained (not the prompt's earlier
        # assistant turn)
        assert masked_text(tok, ids, mask, 1) == resp + tok.eos_token
        assert sum(mask) < sum(full_mask)
    n = len(ex.prompt_ids) + max(len(ex.chosen_ids), len(ex.rejected_ids))
    stats = DataStats()
    (short,) = preference_examples([pair], name, tok, n - 1, stats=stats)
    # the oldest exchange is removed whole; the system turn and the responses stay
    assert short.turns_removed == 2 and stats.truncated == 1
    assert short.chosen_ids == ex.chosen_ids[-len(short.chosen_ids):]
    assert "Be brief." in tok.decode(short.prompt_ids)
    assert "Hello world" not in tok.decode(short.prompt_ids)
    stats = DataStats()
    assert list(preference_examples([pair], name, tok, n - 1, on_too_long="drop",
                                    stats=stats)) == []
    assert stats.dropped == ["record 1"]
    assert list(preference_examples([pair], name, tok, 5, stats=stats)) == []


# --- bad input --------------------------------------------------------------------------------

BAD_SFT = [
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"messages": [{"role": "usr", "content": "hi"}, {"role": "assistant", "content": "x"}]},
     "unknown role 'usr'; did you mean 'user'"),
    ({"conversations": [{"from": "humman", "value": "hi"}, {"from": "gpt", "value": "x"}]},
     "unknown role 'humman'; did you mean 'human'"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
     "'content' must be a string"),
    ({"instruction": "x", "input": "", "output": ""}, "'output' is empty"),
    ({"foo": 1}, "unknown record format"),
]
BAD_PAIRS = [
    ({"prompt": "Q", "chosen": "yes", "rejected": "  "}, "rejected response is empty"),
    ({"chosen": "\n\nHuman: Q\n\nAssistant:", "rejected": "\n\nHuman: Q\n\nAssistant: no"},
     "chosen response is empty"),
    ({"question": "Q", "response_j": "", "response_k": "no"}, "chosen response is empty"),
    ({"chosen": "Q yes", "rejected": "Q no"}, "share no"),
    ({"prompt": "", "chosen": "a", "rejected": "b"}, "empty prompt"),
    ({"conversations": [{"from": "human", "value": "Q"}], "chosen": {"from": "gtp", "value": "a"},
      "rejected": {"from": "gpt", "value": "b"}}, "unknown role 'gtp'"),
]


@pytest.mark.parametrize("rec,why", BAD_SFT)
def test_bad_sft_record_skipped_or_strict(tmp_path, base_tok, rec, why):
    f = write_jsonl(tmp_path / "d.jsonl", [{"messages": CONV}, rec])
    stats = DataStats()
    assert len(list(read_conversations([f], stats=stats))) == 1
    assert stats.read == 2 and len(stats.skipped) == 1
    assert stats.skipped[0].startswith(f"{f}:2: ") and why in stats.skipped[0]
    with pytest.raises(OlmoflowError, match=f"d.jsonl:2: .*{why[:12]}"):
        list(read_conversations([f], strict=True))


@pytest.mark.parametrize("rec,why", BAD_PAIRS)
def test_bad_pair_skipped_or_strict(tmp_path, rec, why):
    good = {"prompt": "Q", "chosen": "a", "rejected": "b"}
    f = write_jsonl(tmp_path / "p.jsonl", [good, rec])
    stats = DataStats()
    assert len(list(read_pairs([f], stats=stats))) == 1
    assert len(stats.skipped) == 1 and stats.skipped[0].startswith(f"{f}:2: ")
    assert why in stats.skipped[0]
    with pytest.raises(OlmoflowError, match=f"p.jsonl:2: .*{why[:12]}"):
        list(read_pairs([f], strict=True))


def test_malformed_line_skipped_with_warning_or_strict(tmp_path, caplog):
    f = write_jsonl(tmp_path / "m.jsonl", [{"messages": CONV}], extra_lines=['{"messages": ['])
    gz = tmp_path / "m.jsonl.gz"
    gz.write_bytes(gzip.compress(f.read_bytes()))
    for path in (f, gz):
        stats = DataStats()
        with caplog.at_level("WARNING", logger="olmoflow.posttrain.data"):
            assert len(list(read_conversations([path], stats=stats))) == 1
        assert stats.read == 2 and stats.skipped[0].startswith(f"{path}:2: not JSON")
        assert f"{path}:2" in caplog.text
        with pytest.raises(OlmoflowError, match=f"{path.name}:2: not JSON"):
            list(read_conversations([path], strict=True))
    stats = DataStats()
    assert len(list(read_pairs([f], stats=stats))) == 0 and len(stats.skipped) == 2


def test_role_the_template_lacks_is_bad_input(chat):
    name, tok = chat
    conv = [{"role": "user", "content": "Q"}, {"role": "environment", "content": "{}"},
            {"role": "assistant", "content": "A"}]
    stats = DataStats()
    out = list(sft_examples([Conversation("f.jsonl:7", conv)], name, tok, None, stats=stats))
    if name == "olmo3":
        assert len(out) == 1 and stats.skipped == []
    else:
        assert out == [] and stats.skipped[0].startswith("f.jsonl:7: ")
        assert "unknown role 'environment'" in stats.skipped[0]
        with pytest.raises(OlmoflowError, match="f.jsonl:7: "):
            list(sft_examples([Conversation("f.jsonl:7", conv)], name, tok, None, strict=True))


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(OlmoflowError, match="no such data file"):
        list(read_conversations([tmp_path / "nope.jsonl"]))


def test_a_mistyped_data_path_is_an_error_not_a_text_record(tmp_path):
    from olmoflow.errors import OlmoflowError
    from olmoflow.posttrain.data import read_conversations

    with pytest.raises(OlmoflowError, match="no such data file"):
        list(read_conversations(str(tmp_path / "missing.jsonl")))
    with pytest.raises(OlmoflowError, match="no such data file"):
        list(read_conversations([str(tmp_path / "tulu_mix.json.gz")]))


# --- data paths that are not files ----------------------------------------------------------------


SHORT_CONV = {"messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "yo"}]}


def test_a_missing_path_without_a_data_suffix_is_an_error_not_a_text_record(tmp_path):
    missing = tmp_path / "mydata"  # no .jsonl: it used to be trained on as the text "…/mydata"
    with pytest.raises(OlmoflowError, match="sft.data.paths: no such data file"):
        check_data_files([missing], "sft.data.paths")
    with pytest.raises(OlmoflowError, match="no such data file"):
        build_sft_data([str(missing)], None, "tulu", chat_tokenizer(), 64)


def test_a_directory_path_is_an_error_naming_it(tmp_path):
    d = tmp_path / "convs"
    d.mkdir()
    with pytest.raises(OlmoflowError, match="is a directory"):
        check_data_files([d], "dpo.data.paths")
    with pytest.raises(OlmoflowError, match="is a directory"):
        list(read_conversations([str(d)]))
    with pytest.raises(OlmoflowError, match="is a directory"):
        build_sft_data([d], None, "tulu", chat_tokenizer(), 64)
    ok = tmp_path / "ok.jsonl"
    ok.write_text(json.dumps(SHORT_CONV) + "\n")
    check_data_files([ok])  # a file passes
    assert len(list(read_conversations([ok]))) == 1
