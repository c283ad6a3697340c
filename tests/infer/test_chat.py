"""``olmoflow chat``: a scripted session over a tiny saved model, history kept within the context
window, the stream equal to one ``generate`` call, and one-line errors."""

from __future__ import annotations

import io

import pytest
import torch
from chat_models import chat_model, chat_tokenizer
from checks import scripted_input

from olmoflow.infer.chat import ChatSession, chat_main
from olmoflow.infer.generate import generate
from olmoflow.infer.sampling import SamplingParams
from olmoflow.model.config import ModelConfig
from olmoflow.model.load import trained_length
from olmoflow.model.olmo import Olmo
from olmoflow.tokenizer import BPETokenizer
from olmoflow.tokenizer.chat import add_chat_template, render

TEXTS = [
    "Hello world! The cat sat on the mat. What is 2+2? It is 4.\n\nSure thing (yes).",
    "def add(a, b):\n    return a + b\n# user, assistant, system: be brief and helpful",
    "emoji 😀 and café, naïve — 中文 text; more words about cats and mats",
]
WINDOW = 128
MEDIUM = "The cat sat on the mat. What is 2+2?"  # a few of these fill a 96-token window
LONG = "The cat sat on the mat. " * 30  # too long for the window alone


def tiny(template: str | None = "olmo3") -> tuple[Olmo, BPETokenizer]:
    torch.manual_seed(0)
    tok = BPETokenizer().train_from_texts(TEXTS * 8, vocab_size=320)
    model = Olmo(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=2,
                             mlp_hidden=64, max_sequence_length=WINDOW)).eval()
    if template is not None:
        add_chat_template(tok, template, model=model)
    return model, tok


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A release-like directory: HF model files, the tokenizer with its chat template, and a run
    config.yaml recording a training sequence length shorter than the model's window."""
    model, tok = tiny()
    d = tmp_path_factory.mktemp("release")
    model.save_pretrained(d, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tok.save(d)
    (d / "config.yaml").write_text("run_dir: runs/x\ntrain:\n  sequence_length: 96\n")
    return d


def test_the_chat_context_is_the_trained_length(release):
    from olmoflow.model.load import load_model

    loaded = load_model(release, device="cpu")
    model, tok, src, window = loaded.model, loaded.tokenizer, loaded.path, loaded.context_length
    assert src == release and window == 96 < model.config.max_sequence_length
    assert tok.chat_template is not None


def test_scripted_session(release):
    out = io.StringIO()
    rc = chat_main([str(release), "--seed", "0", "--max-new-tokens", "6", "--device", "cpu",
                    "--system", "be brief"],
                   input_fn=scripted_input(["hello", "/reset", "/reset", "/system",
                                      "/system Be brief.", "/sytem x", "", *[MEDIUM] * 4, LONG,
                                      "the cat", "/exit", "never read"]),
                   output=out)
    text = out.getvalue()
    assert rc == 0
    assert "template olmo3, context 96 tokens" in text.splitlines()[0]
    assert "[history cleared: 1 exchange(s) forgotten]\n[history cleared: 0 exchange(s)" in text
    assert "[system message removed]\n[system message set: Be brief.]" in text
    assert "unknown command /sytem; did you mean /system?" in text
    notes = [ln for ln in text.splitlines() if ln.startswith("[note] ")]
    assert len(notes) == 2  # history trimmed (said once), then the message that cannot fit
    assert "dropped the oldest" in notes[0] and "96-token context window" in notes[0]
    assert notes[1].startswith("[note] message not sent")
    assert text.count(">>>") == 0  # the prompt is input_fn's to show, not written to output
    # EOF (Ctrl-D) ends the chat like /exit
    assert chat_main([str(release), "--device", "cpu"], input_fn=scripted_input([]),
                     output=io.StringIO()) == 0


def test_stream_equals_one_generate_call():
    model, tok = tiny()
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, top_k=40, seed=7)
    s = ChatSession(model, tok, system="Be brief.", sampling=sp)
    for k, text in enumerate(["Hello world!", "What is 2+2?"]):
        pieces = list(s.reply(text))
        prompt = torch.tensor([s.last_prompt_ids])
        # reply k samples with seed + k
        full = generate(model, prompt, sampling=SamplingParams(
            max_new_tokens=24, temperature=1.0, top_k=40, seed=7 + k), tokenizer=tok)
        want = tok.decode(full[0, prompt.shape[1]:].tolist())
        assert "".join(pieces) == want
        assert all(pieces)
        assert s.history[-1] == {"role": "assistant", "content": want}
    # the prompt is the template's rendering of the whole conversation
    ids, _ = render([{"role": "system", "content": "Be brief."}, *s.history[:-1]], "olmo3", tok,
                    add_generation_prompt=True)
    assert ids == s.last_prompt_ids


@pytest.mark.parametrize("eos", ["<|im_end|>", "<|endoftext|>"])
def test_reply_stops_at_end_of_turn(eos):
    """The reply ends at the template's end of turn even when the tokenizer's EOS is another
    token (an OLMo 3 tokenizer whose EOS was left at <|endoftext|>)."""
    model, tok = tiny()
    end = tok.token_to_id("<|im_end|>")
    tok.set_special_tokens(eos=eos)
    calls = []

    def end_turn(module, args, out):  # make the end-of-turn token the only likely one
        calls.append(1)
        out.logits.fill_(0.0)
        out.logits[..., end] = 10.0

    model.register_forward_hook(end_turn)
    s = ChatSession(model, tok, sampling=SamplingParams(max_new_tokens=10))
    assert list(s.reply("hello")) == []
    assert len(calls) == 1  # the prompt's forward only: no step after the end of turn
    assert s.history == [{"role": "user", "content": "hello"},
                         {"role": "assistant", "content": ""}]


def test_history_is_trimmed_to_the_window():
    model, tok = tiny()
    notes = []
    s = ChatSession(model, tok, system="be brief",
                    sampling=SamplingParams(max_new_tokens=8, temperature=0.0),
                    max_context=80, on_notice=notes.append)
    sent = ["The cat sat on the mat. " * 2, "What is 2+2? It is 4.", "Hello world! " * 3,
            "more words about cats", "def add(a, b): return a + b"]
    for text in sent:
        list(s.reply(text))
        assert len(s.last_prompt_ids) + 8 <= 80
        assert s.history[-2]["content"] == text  # the newest message is always kept
        assert s.messages()[0] == {"role": "system", "content": "be brief"}
    assert len(s.history) < 2 * len(sent)
    trimmed = [n for n in notes if "dropped the oldest" in n]
    assert len(trimmed) == 1  # said once
    s.reset()
    assert s.history == [] and s.system == "be brief"


def test_message_too_long_is_a_notice():
    model, tok = tiny()
    s = ChatSession(model, tok, system="be brief", sampling=SamplingParams(max_new_tokens=8),
                    max_context=64)
    list(s.reply("hi"))
    before = [dict(m) for m in s.history]
    assert len(before) == 2
    assert list(s.reply("The cat sat on the mat. " * 20)) == []
    assert "message not sent" in s.notices[-1] and "\n" not in s.notices[-1]
    assert s.history == before  # the conversation goes on as if it was never typed
    list(s.reply("hi again"))
    assert s.history[-2]["content"] == "hi again"


def test_max_new_tokens_must_leave_room():
    model, tok = tiny()
    with pytest.raises(Exception, match="leaves no room"):
        ChatSession(model, tok, sampling=SamplingParams(max_new_tokens=WINDOW))


def test_no_template_falls_back_to_plain():
    model, tok = tiny(template=None)
    s = ChatSession(model, tok, sampling=SamplingParams(max_new_tokens=4))
    assert s.template.name == "plain"
    assert "'plain'" in s.notices[0]
    list(s.reply("hello"))
    assert tok.decode(s.last_prompt_ids, skip_special_tokens=False).endswith("hello<|sep|>")


def test_dir_without_model_is_one_line_error(tmp_path, capsys):
    err = io.StringIO()
    assert chat_main([str(tmp_path)], input_fn=scripted_input([]), errors=err) == 2
    msg = err.getvalue()
    assert msg.count("\n") == 1 and str(tmp_path) in msg and msg.startswith("olmoflow chat:")
    err = io.StringIO()
    assert chat_main([str(tmp_path / "missing")], errors=err) == 2
    assert "does not exist" in err.getvalue()


def test_bad_sampling_is_one_line_error(release):
    err = io.StringIO()
    assert chat_main([str(release), "--top-p", "1.5"], errors=err) == 2
    assert "top_p" in err.getvalue() and err.getvalue().count("\n") == 1


def test_ctrl_c_stops_the_reply_not_the_chat(release):
    """Ctrl-C while a reply streams stops that reply; the chat goes on with it in the history."""
    armed = []

    class Interrupting(io.StringIO):
        def write(self, s):
            if armed and not s.startswith("["):  # the first piece of the reply
                armed.clear()
                raise KeyboardInterrupt
            return super().write(s)

    lines = iter(["hello", "/reset"])

    def input_fn(prompt):
        line = next(lines, None)
        if line is None:
            raise KeyboardInterrupt  # Ctrl-C at the prompt leaves
        armed.append(line == "hello")
        if line != "hello":
            armed.clear()
        return line

    out = Interrupting()
    rc = chat_main([str(release), "--device", "cpu", "--system", "hi", "--temperature", "0",
                    "--max-new-tokens", "8"], input_fn=input_fn, output=out)
    assert rc == 0
    assert " [stopped]\n[history cleared: 1 exchange(s) forgotten]" in out.getvalue()


# --- a tulu-templated release: messages not sent, bad options, the trained length -----------------


@pytest.fixture(scope="module")
def tulu_release(tmp_path_factory):
    tok = chat_tokenizer()
    model = chat_model(tok, window=128)
    add_chat_template(tok, "tulu", model=model)
    d = tmp_path_factory.mktemp("release")
    model.save_pretrained(d, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tok.save(d)
    (d / "config.yaml").write_text("train:\n  sequence_length: 96\n")
    return d


def test_a_message_not_sent_is_not_also_an_empty_reply(tulu_release):
    out = io.StringIO()
    rc = chat_main([str(tulu_release), "--seed", "0", "--max-new-tokens", "4", "--device", "cpu"],
                   input_fn=scripted_input(["hi", "cat " * 200]), output=out)
    text = out.getvalue()
    assert rc == 0 and text.count("[note] message not sent") == 1
    sent, not_sent = text.split("message not sent", 1)
    assert "\n" in sent.split("leave\n", 1)[1]  # "hi" was sent and answered (or said no reply)
    assert "[no reply" not in not_sent


def test_max_new_tokens_zero_is_a_one_line_error(tulu_release):
    err = io.StringIO()
    assert chat_main([str(tulu_release), "--max-new-tokens", "0", "--device", "cpu"],
                     input_fn=scripted_input([]), output=io.StringIO(), errors=err) == 2
    assert "--max-new-tokens must be >= 1" in err.getvalue()
    assert err.getvalue().count("\n") == 1


def test_the_context_of_a_post_trained_checkpoint_is_its_stages_length(tmp_path):
    """A model pretrained on 64-token windows, then fine-tuned on 256-token conversations: chat
    used to cut it to 64 tokens (pretraining's train.sequence_length)."""
    (tmp_path / "config.yaml").write_text(
        "train:\n  sequence_length: 64\n"
        "sft:\n  data:\n    paths: [a.jsonl]\n  train:\n    sequence_length: 256\n"
        "dpo:\n  data:\n    paths: []\n  train:\n    sequence_length: 1024\n")
    assert trained_length(tmp_path) == 256  # dpo has no data: not part of the run
    (tmp_path / "config.yaml").write_text("train:\n  sequence_length: 64\n")
    assert trained_length(tmp_path) == 64
