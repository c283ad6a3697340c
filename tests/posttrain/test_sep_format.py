"""OLMo's ``instruction [SEP] response`` lines: read as an instruction/response pair (loss on the
response only), and a warning when a text record holding ``[SEP]`` is trained as plain text."""

from __future__ import annotations

import json
import logging

import pytest

from olmoflow.errors import OlmoflowError
from olmoflow.posttrain.data import DataStats, read_conversations, sft_examples
from olmoflow.tokenizer import BPETokenizer
from olmoflow.tokenizer.chat import add_chat_template, render

TEXTS = ["What is two plus two? It is four. The cat sat on the mat.",
         "def add(a, b):\n    return a + b\n# user, assistant, system: be brief"]
PAIR = [{"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "It is four."}]


@pytest.fixture(scope="module", params=["plain", "tulu"])
def chat(request):
    tok = BPETokenizer().train_from_texts(TEXTS * 8, vocab_size=300)
    add_chat_template(tok, request.param)
    return request.param, tok


def test_a_sep_line_is_an_instruction_response_pair(chat, tmp_path):
    template, tok = chat
    path = tmp_path / "seed.txt"
    path.write_text("What is two plus two? [SEP] It is four.\n")
    (ex,) = list(sft_examples([path], template, tok, 64))
    ids, mask = render(PAIR, template, tok)
    assert ex.input_ids == ids and ex.loss_mask == mask  # loss on the response only
    assert 0 < sum(mask) < len(mask)
    assert list(read_conversations([path]))[0].messages == PAIR


def test_format_sep_reads_text_records_and_checks_the_separator(tmp_path):
    path = tmp_path / "seed.jsonl"
    path.write_text(json.dumps({"text": "What is two plus two? [SEP] It is four."}) + "\n"
                    + json.dumps({"text": "no separator here"}) + "\n"
                    + json.dumps({"text": " [SEP] empty instruction"}) + "\n")
    stats = DataStats()
    convs = list(read_conversations([path], format="sep", stats=stats))
    assert [c.messages for c in convs] == [PAIR]
    assert [s.split(": ", 1)[0] for s in stats.skipped] == [f"{path}:2", f"{path}:3"]
    assert "exactly one ' [SEP] '" in stats.skipped[0]
    with pytest.raises(OlmoflowError, match=f"{path}:2: an 'instruction"):
        list(read_conversations([path], format="sep", strict=True))


def test_a_text_record_with_sep_trained_as_text_is_warned_about(tmp_path, caplog):
    lines = tmp_path / "lines.txt"
    lines.write_text("a [SEP] b [SEP] c\nplain text\nno spaces[SEP]around\n")
    records = tmp_path / "docs.jsonl"
    records.write_text(json.dumps({"text": "hello [SEP] world"}) + "\n")
    stats = DataStats()
    with caplog.at_level(logging.WARNING, logger="olmoflow.posttrain.data"):
        convs = list(read_conversations([lines, records], stats=stats))
        forced = list(read_conversations([lines], format="text", stats=DataStats()))
    assert all(c.text is not None for c in convs + forced)  # trained as text, as before
    assert stats.sep_as_text == [f"{lines}:1", f"{lines}:3", f"{records}:1"]
    assert "3 text record(s) containing [SEP] trained as plain text" in stats.summary()
    warned = [r.getMessage() for r in caplog.records if "[SEP]" in r.getMessage()]
    assert len(warned) == 2 and warned[0].startswith(f"{lines}:1: a text record contains")
