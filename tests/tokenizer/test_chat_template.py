"""Chat templates: our renderer against ``transformers``' ``apply_chat_template`` on the same
Jinja strings, the loss mask, special tokens, embedding growth, and the HF export."""

from __future__ import annotations

import json

import pytest
import torch

from olmoflow.errors import OlmoflowError
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo, resize_token_embeddings
from olmoflow.tokenizer import BPETokenizer
from olmoflow.tokenizer.chat import (
    IM_END,
    IM_START,
    SEP,
    TEMPLATES,
    add_chat_template,
    get_template,
    render,
    template_of,
)

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world! The cat sat on the mat. What is 2+2? It is 4.\n\nSure thing (yes).",
    "def add(a, b):\n    return a + b\n# a docstring, user, assistant, system, environment",
    "emoji 😀 and café, naïve — 中文 text; functions get_weather(city=\"Boston\")",
]

SYSTEM_MULTI = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello world!"},
    {"role": "assistant", "content": "The cat sat."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4.\n\nSure thing 😀."},
]
NO_SYSTEM = [
    {"role": "user", "content": "def add(a, b):"},
    {"role": "assistant", "content": "    return a + b\n"},
]
PROMPT = [{"role": "user", "content": "What is 2+2?"}]
ENDS_WITH_USER = [*SYSTEM_MULTI, {"role": "user", "content": "café?"}]
TOOLS = [
    {"role": "system", "content": "You call tools.", "functions": '[{"name": "get_weather"}]'},
    {"role": "user", "content": "Weather in Boston?"},
    {"role": "assistant", "content": "", "function_calls": 'get_weather(city="Boston")'},
    {"role": "environment", "content": '{"temp": 20}'},
    {"role": "assistant", "content": "It is 20 degrees."},
]

CASES = [(SYSTEM_MULTI, False), (SYSTEM_MULTI, True), (NO_SYSTEM, False), (NO_SYSTEM, True),
         (PROMPT, True), (ENDS_WITH_USER, False), (ENDS_WITH_USER, True)]


def fresh_tokenizer() -> BPETokenizer:
    return BPETokenizer().train_from_texts(TEXTS * 8, vocab_size=320)


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def chat(request, tmp_path_factory):
    """``(name, our tokenizer, transformers tokenizer)``: ours prepared for the template and saved;
    theirs wraps the saved tokenizer.json with the template's Jinja string set by hand."""
    name = request.param
    tok = fresh_tokenizer()
    assert add_chat_template(tok, name) == len(TEMPLATES[name].special_tokens)
    d = tmp_path_factory.mktemp(f"tok-{name}")
    tok.save(d)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(d / "tokenizer.json"), eos_token=tok.eos_token,
        bos_token=tok.bos_token, pad_token=tok.pad_token)
    hf.chat_template = TEMPLATES[name].jinja
    return name, tok, hf


def hf_ids(hf, messages, gen) -> list[int]:
    return list(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen,
                                       return_dict=False))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_render_equals_apply_chat_template(chat, case):
    name, tok, hf = chat
    messages, gen = CASES[case]
    ids, mask = render(messages, name, tok, add_generation_prompt=gen, require_assistant=False)
    assert ids == hf_ids(hf, messages, gen)
    assert len(mask) == len(ids)


def test_olmo3_functions_and_environment_equal_transformers(tmp_path):
    name, tok = "olmo3", fresh_tokenizer()
    add_chat_template(tok, name)
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids, mask = render(TOOLS, name, tok)
    assert 'get_weather(city="Boston")' in masked_text(tok, ids, mask, 1)
    assert '{"temp": 20}' in masked_text(tok, ids, mask, 0)
    for gen in (False, True):
        assert render(TOOLS, name, tok, gen)[0] == hf_ids(hf, TOOLS, gen)


def masked_text(tok, ids, mask, keep: int) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if m == keep], skip_special_tokens=False)


def test_loss_mask_is_assistant_content_and_end_of_turn(chat):
    name, tok, _ = chat
    ids, mask = render(SYSTEM_MULTI, name, tok)
    eot = tok.eos_token  # olmo3 makes <|im_end|> the EOS; the others end turns with EOS
    assistant = [m["content"] for m in SYSTEM_MULTI if m["role"] == "assistant"]
    assert masked_text(tok, ids, mask, 1) == "".join(a + eot for a in assistant)
    # Exactly one end-of-turn marker per assistant turn, each trained.
    eot_id = tok.eos_token_id
    trained_eot = [i for i, m in zip(ids, mask) if m and i == eot_id]
    assert len(trained_eot) == len(assistant)
    untrained = masked_text(tok, ids, mask, 0)
    assert "Be brief." in untrained and "What is 2+2?" in untrained
    assert ids[-1] == eot_id and mask[-1] == 1


def test_bos_exactly_where_the_format_has_one(chat):
    name, tok, _ = chat
    ids, _ = render(SYSTEM_MULTI, name, tok)
    n_assistant = sum(m["role"] == "assistant" for m in SYSTEM_MULTI)
    if name == "tulu":  # OLMo 2: BOS is the EOS token, once in front
        assert tok.bos_token == tok.eos_token and ids[0] == tok.bos_token_id
        assert ids.count(tok.eos_token_id) == 1 + n_assistant
    else:
        assert tok.bos_token is None
    if name == "olmo3":  # <|im_end|> (the EOS) closes every turn; no BOS
        assert tok.eos_token == IM_END
        assert ids.count(tok.token_to_id(IM_START)) == len(SYSTEM_MULTI)
        assert ids.count(tok.eos_token_id) == len(SYSTEM_MULTI)
    if name == "plain":
        assert ids.count(tok.token_to_id(SEP)) == 2
        assert ids.count(tok.eos_token_id) == n_assistant


def test_generation_prompt_ends_with_the_assistant_header():
    tok = fresh_tokenizer()
    add_chat_template(tok, "olmo3")
    ids, mask = render(PROMPT, "olmo3", tok, add_generation_prompt=True)
    assert tok.decode(ids, skip_special_tokens=False).endswith(
        "<|im_end|>\n<|im_start|>assistant\n")
    assert not any(mask)


def test_special_tokens_added_once_and_saved(tmp_path):
    tok = fresh_tokenizer()
    before = tok.vocab_size
    assert tok.add_special_tokens([IM_START, IM_END, IM_START]) == 2
    assert tok.add_special_tokens([IM_START]) == 0
    assert tok.vocab_size == before + 2
    assert tok.token_byte_lengths()[tok.token_to_id(IM_END)] == 0
    # Text spelling a special token stays text; only render inserts the id.
    assert tok.token_to_id(IM_END) not in tok.encode("a <|im_end|> b")
    add_chat_template(tok, "olmo3")
    tok.save(tmp_path)
    assert (tmp_path / "chat_template.jinja").read_text() == TEMPLATES["olmo3"].jinja
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == TEMPLATES["olmo3"].jinja and config["eos_token"] == IM_END
    back = BPETokenizer.load(tmp_path)
    assert template_of(back).name == "olmo3" and back.eos_token == IM_END
    assert render(SYSTEM_MULTI, None, back) == render(SYSTEM_MULTI, "olmo3", tok)
    back.chat_template = None
    back.save(tmp_path)  # no template: no stale .jinja left for transformers to prefer
    assert not (tmp_path / "chat_template.jinja").exists()


def tiny_model(vocab: int, pad_multiple: int) -> Olmo:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=2, mlp_hidden=64,
                      max_sequence_length=64, sliding_window=None, vocab_pad_multiple=pad_multiple)
    return Olmo(cfg).eval()


@pytest.mark.parametrize("pad_multiple", [1, 128])
def test_embedding_grows_with_mean_rows(pad_multiple):
    tok = fresh_tokenizer()
    old_vocab = tok.vocab_size
    model = tiny_model(ModelConfig(vocab_pad_multiple=pad_multiple)
                       .padded_vocab_size(old_vocab), pad_multiple)
    old_rows = model.embeddings.weight.detach().clone()
    x = torch.tensor([[3, 5, 7, 11]])
    before = model(x).logits
    add_chat_template(tok, "olmo3", model)
    size = model.config.vocab_size
    assert size >= tok.vocab_size and size % pad_multiple == 0
    assert model.embeddings.weight.shape[0] == model.lm_head.weight.shape[0] == size
    new = [tok.token_to_id(IM_START), tok.token_to_id(IM_END)]
    for w, old in ((model.embeddings.weight, old_rows), (model.lm_head.weight, None)):
        mean = (old if old is not None else w)[:old_vocab].mean(0)
        for i in new:
            torch.testing.assert_close(w[i], mean, rtol=1e-5, atol=1e-6)
    # The old tokens' rows and logits are unchanged.
    torch.testing.assert_close(model.embeddings.weight[:old_vocab], old_rows[:old_vocab],
                               rtol=0, atol=0)
    torch.testing.assert_close(model(x).logits[..., :old_vocab], before[..., :old_vocab],
                               rtol=0, atol=0)
    # A conversation runs through the grown model.
    ids, _ = render(SYSTEM_MULTI, "olmo3", tok)
    assert model(torch.tensor([ids[:64]])).logits.shape[-1] == size


def test_resize_bad_arguments():
    model = tiny_model(40, 1)
    with pytest.raises(OlmoflowError, match="outside the vocabulary"):
        resize_token_embeddings(model, 40, init_ids=[40])
    with pytest.raises(OlmoflowError, match="mean_of"):
        resize_token_embeddings(model, 48, mean_of=41)
    assert resize_token_embeddings(model, 30) == 40  # never shrinks


def test_export_carries_the_template(tmp_path):
    from olmoflow.release.export import export_hf

    tok = fresh_tokenizer()
    model = tiny_model(tok.vocab_size, 128)
    add_chat_template(tok, "olmo3", model)
    src = tmp_path / "sft"
    model.save_pretrained(src, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tok.save(src)
    out = export_hf(src, tmp_path / "export", dtype="bfloat16")
    assert (out / "chat_template.jinja").is_file()
    hf = transformers.AutoTokenizer.from_pretrained(out)
    for messages, gen in CASES + [(TOOLS, False)]:
        ours, _ = render(messages, None, BPETokenizer.load(out), gen, require_assistant=False)
        assert ours == hf_ids(hf, messages, gen)
    # The re-export converted the weights instead of copying the source's over them.
    lm = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert lm.lm_head.weight.dtype == torch.bfloat16
    assert lm.config.vocab_size == model.config.vocab_size


def test_bad_input_is_one_line_error():
    tok = fresh_tokenizer()
    with pytest.raises(OlmoflowError, match="did you mean 'tulu'") as e:
        get_template("tullu")
    assert "\n" not in str(e.value)
    with pytest.raises(OlmoflowError, match="lacks"):
        render(SYSTEM_MULTI, "olmo3", tok)  # tokens not added yet
    with pytest.raises(OlmoflowError, match="no chat template"):
        render(SYSTEM_MULTI, None, tok)
    add_chat_template(tok, "olmo3")
    bad_role = [{"role": "usr", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(OlmoflowError, match="message 0: unknown role 'usr'.*did you mean 'user'"):
        render(bad_role, "olmo3", tok)
    with pytest.raises(OlmoflowError, match="no assistant turn"):
        render(PROMPT, "olmo3", tok)
    with pytest.raises(OlmoflowError, match="no messages"):
        render([], "olmo3", tok, add_generation_prompt=True)
    with pytest.raises(OlmoflowError, match="'content' must be a string"):
        render([{"role": "user", "content": 3}], "olmo3", tok, True)
    with pytest.raises(OlmoflowError, match="unknown role 'environment'"):
        render(TOOLS, "tulu", tok)
    assert render(PROMPT, "olmo3", tok, add_generation_prompt=True)[0]
