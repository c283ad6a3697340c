"""``olmoflow export gguf``: the file read back with gguf's own reader holds every weight of the
model under llama.cpp's ``olmo2`` names (exactly in f32, to f16 rounding in f16, within the Q8_0
error bound in q8_0), the hyper-parameters llama.cpp reads and the tokenizer's vocabulary; where
llama-cpp-python is installed, llama.cpp tokenizes as we do and its greedy tokens are ours; bad
input is one line on stderr."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from checks import cli, exits_with_one_line
from tolerance import assert_fp32_close, assert_greedy_agrees, forward_terms, fp32_rel

from olmoflow.cli import main
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo
from olmoflow.release.gguf_export import TENSOR_NAMES, gguf_name, write_gguf
from olmoflow.tokenizer import BPETokenizer
from olmoflow.tokenizer.chat import add_chat_template

gguf = pytest.importorskip("gguf", reason="the gguf package writes and reads the export")

TEXTS = [
    "Hello world! The cat sat on the mat. What is 2+2? It is 4.\n\nSure thing (yes).",
    "def add(a, b):\n    return a + b\n# user, assistant, system: be brief and helpful",
    "emoji 😀 and café, naïve — 中文 text; more words about cats and mats",
    "The quick brown fox jumps over the lazy dog. 1, 2, 3, 4, 5, 6, 7, 8, 9, 10.",
]
PROMPTS = ["The cat", "def add(a", "Hello world! The", "The quick brown fox"]


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory) -> tuple[Olmo, BPETokenizer, Path]:
    """An OLMo 2-shaped model (no sliding windows, GQA) trained 20 steps on :data:`TEXTS` so that
    greedy decoding is not decided by rounding, its BPE with the ``olmo3`` chat template (special
    tokens, vocabulary padded past the tokenizer's), and a Hugging Face directory of both."""
    torch.manual_seed(0)
    tok = BPETokenizer().train_from_texts(TEXTS * 8, vocab_size=320)
    model = Olmo(ModelConfig(vocab_size=tok.vocab_size, d_model=64, n_layers=2, n_heads=4,
                             n_kv_heads=2, mlp_hidden=128, max_sequence_length=128,
                             sliding_window=None))
    add_chat_template(tok, "olmo3", model=model)
    ids = [torch.tensor(tok.encode(t) + [tok.eos_token_id]) for t in TEXTS]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(20):
        for row in ids:
            model(row[None, :-1], labels=row[None, 1:]).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    d = tmp_path_factory.mktemp("gguf-release")
    model.save_pretrained(d, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tok.save(d)
    return model, tok, d


@pytest.fixture(scope="module")
def exported(olmo2, tmp_path_factory) -> dict[str, Path]:
    """The release exported once per dtype through the command line."""
    _, _, d = olmo2
    out = tmp_path_factory.mktemp("gguf-out")
    files = {}
    for dtype in ("f32", "f16", "q8_0"):
        files[dtype] = out / f"tiny-{dtype}.gguf"
        assert main(["export", "gguf", str(d), str(files[dtype]), "--dtype", dtype]) == 0
    return files


def field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def tensors(reader) -> dict[str, object]:
    return {t.name: t for t in reader.tensors}


def test_f32_every_tensor_metadata_and_vocab(olmo2, exported):
    model, tok, d = olmo2
    cfg = model.config
    r = gguf.GGUFReader(exported["f32"])
    ts = tensors(r)
    state = model.state_dict()
    assert sorted(ts) == sorted(gguf_name(k) for k in state)
    assert len(ts) == 11 * cfg.n_layers + 3
    for k, w in state.items():
        t = ts[gguf_name(k)]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, k
        assert list(t.shape) == list(reversed(w.shape)), k  # ggml's ne: fastest dimension first
        assert np.array_equal(t.data, w.numpy()), k  # no permutation: NEOX RoPE on both sides
    assert ts["blk.1.ffn_gate.weight"].data.tobytes() == \
        state["blocks.1.feed_forward.w1.weight"].numpy().tobytes()

    expected = {
        "general.architecture": "olmo2", "general.file_type": 0,
        "olmo2.block_count": cfg.n_layers, "olmo2.context_length": cfg.max_sequence_length,
        "olmo2.embedding_length": cfg.d_model, "olmo2.feed_forward_length": cfg.mlp_hidden,
        "olmo2.attention.head_count": cfg.n_heads, "olmo2.attention.head_count_kv": 2,
        "olmo2.attention.key_length": cfg.hd, "olmo2.attention.value_length": cfg.hd,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "dbrx",
        "tokenizer.ggml.eos_token_id": tok.eos_token_id,
        "tokenizer.ggml.padding_token_id": tok.pad_token_id,
        "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": tok.chat_template,
    }
    for key, value in expected.items():
        assert field(r, key) == value, key
    assert field(r, "olmo2.rope.freq_base") == pytest.approx(cfg.rope_theta)
    assert field(r, "olmo2.attention.layer_norm_rms_epsilon") == pytest.approx(cfg.rms_norm_eps)
    assert field(r, "olmo2.attention.sliding_window") is None
    assert field(r, "olmo2.rope.scaling.type") is None

    tokens = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == cfg.vocab_size > tok.vocab_size
    for text, i in tok.backend.get_vocab(with_added_tokens=True).items():
        assert tokens[i] == text, i
    special = {tok.eos_token_id, tok.pad_token_id, tok.backend.token_to_id("<|im_start|>")}
    for i in special:
        assert types[i] == gguf.TokenType.CONTROL, (i, tokens[i])
    assert types[5] == gguf.TokenType.NORMAL
    assert tokens[-1] == f"[PAD{cfg.vocab_size - 1}]" and types[-1] == gguf.TokenType.UNUSED
    merges = json.loads((d / "tokenizer.json").read_text())["model"]["merges"]
    assert field(r, "tokenizer.ggml.merges") == [m if isinstance(m, str) else " ".join(m)
                                                 for m in merges]


def test_f16_weights_within_f16_rounding(olmo2, exported):
    model, _, _ = olmo2
    ts = tensors(gguf.GGUFReader(exported["f16"]))
    for k, w in model.state_dict().items():
        t = ts[gguf_name(k)]
        if w.dim() == 1:  # norms stay f32, as llama.cpp's converter keeps them
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, k
            assert np.array_equal(t.data, w.numpy()), k
            continue
        assert t.tensor_type == gguf.GGMLQuantizationType.F16, k
        assert np.array_equal(t.data, w.half().numpy()), k  # round to nearest, both sides
        err = np.abs(t.data.astype(np.float32) - w.numpy())
        assert (err <= np.abs(w.numpy()) * 2.0 ** -11 + 2.0 ** -25).all(), k


def test_q8_0_weights_within_the_block_bound(olmo2, exported):
    model, _, _ = olmo2
    r = gguf.GGUFReader(exported["q8_0"])
    assert field(r, "general.file_type") == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    ts = tensors(r)
    for k, w in model.state_dict().items():
        t = ts[gguf_name(k)]
        if w.dim() == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, k
            continue
        assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0, k
        back = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType.Q8_0)
        x = w.numpy()
        assert back.shape == x.shape, k
        # Q8_0: blocks of 32, scale d = max|x| / 127 stored in f16, q = round(x / d): an element
        # is off by at most d / 2, plus |q| <= 127 times the f16 rounding of d.
        blocks = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
        bound = blocks * (0.5 + 127 * 2.0 ** -11) + 1e-12
        assert (np.abs(back - x).reshape(-1, 32) <= bound).all(), k
        assert np.abs(back - x).max() > 0, k  # it did quantize


def test_olmo3_sliding_windows_yarn_and_gpt2_split(tmp_path):
    torch.manual_seed(0)
    tok = BPETokenizer(pre_tokenizer="gpt2").train_from_texts(TEXTS * 4, vocab_size=300)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=3, n_heads=2,
                      mlp_hidden=64, max_sequence_length=64, sliding_window=8,
                      full_attention_every=2, yarn_factor=4.0, yarn_original_max_length=16)
    d = tmp_path / "olmo3"
    Olmo(cfg).save_pretrained(d, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tok.save(d)
    out = tmp_path / "olmo3.gguf"
    assert main(["export", "gguf", str(d), str(out), "--dtype", "f32"]) == 0
    r = gguf.GGUFReader(out)
    assert field(r, "general.architecture") == "olmo2"  # llama.cpp runs OLMo 3 as olmo2
    assert field(r, "olmo2.attention.sliding_window") == 8
    # layer 1 is every 2nd, layer 2 the last: full attention
    assert field(r, "olmo2.attention.sliding_window_pattern") == [True, False, False]
    assert field(r, "olmo2.rope.scaling.type") == "yarn"
    assert field(r, "olmo2.rope.scaling.factor") == pytest.approx(4.0)
    assert field(r, "olmo2.rope.scaling.original_context_length") == 16
    assert field(r, "tokenizer.ggml.pre") == "gpt-2"
    assert field(r, "tokenizer.chat_template") is None
    assert len(field(r, "tokenizer.ggml.tokens")) == tok.vocab_size


def test_a_step_checkpoint_exports_its_weights(olmo2, tmp_path, capsys):
    import yaml

    from olmoflow.train.checkpoint import save_checkpoint

    model, _, d = olmo2
    run = tmp_path / "run"
    opt = torch.optim.AdamW(model.parameters())
    step = save_checkpoint(run / "pretrain", 3, model, opt, {"step": 3, "tokens_seen": 30},
                           yaml.safe_dump({"model": model.config.to_dict()}))
    out = tmp_path / "step.gguf"
    rc, stdout, err = cli(capsys, "export", "gguf", str(run / "pretrain"), str(out), "--dtype",
                          "f32", "--tokenizer", str(d))
    assert rc == 0, err
    assert str(out) in stdout
    r = gguf.GGUFReader(out)
    assert field(r, "general.name") == "run"
    ts = tensors(r)
    for k, w in model.state_dict().items():
        assert np.array_equal(ts[gguf_name(k)].data, w.numpy()), k
    rc, _, err = cli(capsys, "export", "gguf", str(step), str(run / "pretrain" / "x.gguf"),
                     "--tokenizer", str(d))
    exits_with_one_line(rc, err, "inside the checkpoint folder")


def test_a_shape_llama_cpp_cannot_run_is_refused(tmp_path, capsys):
    tok = BPETokenizer().train_from_texts(TEXTS * 4, vocab_size=300)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, head_dim=32,
                      mlp_hidden=64, max_sequence_length=64, sliding_window=None)
    d = tmp_path / "wide-heads"
    Olmo(cfg).save_pretrained(d, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tok.save(d)
    rc, _, err = cli(capsys, "export", "gguf", str(d), str(tmp_path / "x.gguf"))
    exits_with_one_line(rc, err, "n_heads * head_dim = 2 * 32 != d_model 32")
    assert not (tmp_path / "x.gguf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # temp file removed


def test_bad_paths_are_one_line_errors(olmo2, exported, tmp_path, capsys):
    _, _, d = olmo2
    rc, _, err = cli(capsys, "export", "gguf", str(tmp_path / "nope"), str(tmp_path / "a.gguf"))
    exits_with_one_line(rc, err, "does not exist")
    rc, _, err = cli(capsys, "export", "gguf", str(d), str(tmp_path))
    exits_with_one_line(rc, err, "is a directory")
    rc, _, err = cli(capsys, "export", "gguf", str(d), str(d / "inside.gguf"))
    exits_with_one_line(rc, err, "must not be inside the checkpoint")
    (tmp_path / "file").write_text("x")
    rc, _, err = cli(capsys, "export", "gguf", str(d), str(tmp_path / "file" / "a.gguf"))
    exits_with_one_line(rc, err, "is a file, not a directory")
    rc, _, err = cli(capsys, "export", "gguf", str(d), str(tmp_path / "a.gguf"), "--dtype", "q4")
    exits_with_one_line(rc, err, "unknown GGUF dtype 'q4'", "f32, f16, q8_0")
    rc, _, err = cli(capsys, "export", "gguf", str(d), str(tmp_path / "a.gguf"), "--tokenizer",
                     str(tmp_path))
    exits_with_one_line(rc, err, "no tokenizer.json", "--tokenizer")
    rc, _, err = cli(capsys, "export", "gguf", str(tmp_path / "file"), str(tmp_path / "a.gguf"))
    exits_with_one_line(rc, err, "is not a directory")

    existing = tmp_path / "old.gguf"
    existing.write_bytes(b"old")
    rc, _, err = cli(capsys, "export", "gguf", str(d), str(existing))
    exits_with_one_line(rc, err, "exists", "--force")
    assert existing.read_bytes() == b"old"
    rc, _, err = cli(capsys, "export", "gguf", str(d), str(existing), "--force", "--dtype", "f32")
    assert rc == 0, err
    assert existing.read_bytes() == exported["f32"].read_bytes()  # deterministic, and replaced


def test_every_name_maps_one_to_one():
    names = [theirs for _, theirs in TENSOR_NAMES]
    assert len(set(names)) == len(names)
    olmo2_tensors = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.OLMO2]}
    for n in names:  # every name is one llama.cpp's olmo2 architecture declares
        assert n.replace("{i}", "{bid}").removesuffix(".weight") in olmo2_tensors, n
    with pytest.raises(KeyError):
        gguf_name("blocks.0.attention.w_qkv.weight")


# ---- llama.cpp itself (llama-cpp-python), where it is installed -------------------------------

def _llama(path: Path, n_ctx: int):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    # an f32 KV cache (llama.cpp's default is f16), so that the two differ by f32 rounding only
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=2,
                           logits_all=True, verbose=False, seed=0,
                           type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)


def _llama_logits(llm, ids: list[int]) -> torch.Tensor:
    """llama.cpp's logits ``[T, V]`` for every position of ``ids`` (a fresh evaluation)."""
    llm.reset()
    llm.eval(ids)
    return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))


def _greedy(next_logits, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(next_logits(ids).argmax()))
    return ids


def test_llama_cpp_tokens_and_greedy_decoding_match(olmo2, exported):
    model, tok, _ = olmo2
    llm = _llama(exported["f32"], n_ctx=128)
    for text in [*TEXTS, *PROMPTS]:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok.encode(text), text
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        with torch.no_grad():
            ours = _greedy(lambda s: model(torch.tensor([s])).logits[0, -1], ids, 12)
            logits = model(torch.tensor([ours])).logits
        theirs = _greedy(lambda s: _llama_logits(llm, s)[-1], ids, 12)
        # f32 weights and KV cache: the two differ by the rounding of another summation order
        atol = fp32_rel(forward_terms(model.config, len(ours))) * float(logits.abs().max())
        assert_fp32_close(_llama_logits(llm, ours), logits[0],
                          forward_terms(model.config, len(ours)))
        assert_greedy_agrees(torch.tensor([theirs]), torch.tensor([ours]), logits, atol=atol,
                             start=len(ids))


def test_llama_cpp_runs_olmo3_windows_and_yarn_as_we_do(tmp_path):
    torch.manual_seed(1)
    tok = BPETokenizer().train_from_texts(TEXTS * 4, vocab_size=300)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2,
                      mlp_hidden=128, max_sequence_length=64, sliding_window=6,
                      full_attention_every=2, yarn_factor=4.0, yarn_original_max_length=8,
                      init_std=0.3)
    model = Olmo(cfg).eval()
    out = write_gguf(model, tok, _saved(tok, tmp_path), tmp_path / "olmo3.gguf", dtype="f32")
    ids = tok.encode(TEXTS[0])[:40]
    theirs = _llama_logits(_llama(out, n_ctx=64), ids)
    with torch.no_grad():
        ours = model(torch.tensor([ids])).logits[0]
        # the same weights one key wider a window, and without YaRN: what a mismatch would give
        wider = _with(model, sliding_window=7)(torch.tensor([ids])).logits[0]
        no_yarn = _with(model, yarn_factor=None)(torch.tensor([ids])).logits[0]
    assert_fp32_close(theirs, ours, forward_terms(cfg, len(ids)))
    diff = float((theirs - ours).abs().max())
    assert diff < float((wider - ours).abs().max()) / 100, diff
    assert diff < float((no_yarn - ours).abs().max()) / 100, diff


def _saved(tok, tmp_path: Path) -> Path:
    d = tmp_path / "tok"
    tok.save(d)
    return d


def _with(model: Olmo, **changes) -> Olmo:
    from dataclasses import replace

    other = Olmo(replace(model.config, **changes)).eval()
    other.load_state_dict(model.state_dict())
    return other
