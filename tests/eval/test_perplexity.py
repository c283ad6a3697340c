"""Held-out loss, perplexity and bits-per-byte on models whose answers we know in closed form, and
the windows that score every target exactly once (disjoint, or sliding with a stride)."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from olmoflow.errors import OlmoflowError
from olmoflow.eval.perplexity import evaluate_tokens, rolling_windows
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo

V = 16


def uniform(x):
    return torch.zeros(*x.shape, V)


def test_uniform_model_scores_log_vocab():
    tokens = np.random.default_rng(0).integers(1, V, size=1 + 4 * 32)
    token_bytes = np.full(V, 3)
    token_bytes[0] = 0  # a special token (EOS) carries no bytes
    tokens[::7] = 0
    r = evaluate_tokens(uniform, tokens, token_bytes, sequence_length=32, batch_size=3)
    assert r["tokens"] == 128
    assert r["loss"] == pytest.approx(math.log(V))
    assert r["perplexity"] == pytest.approx(V)
    targets = tokens[1:129]
    n_byte_tokens = int((targets != 0).sum())
    assert r["bytes"] == 3 * n_byte_tokens
    # every byte-bearing target costs log2(V) bits and stands for 3 bytes
    assert r["bpb"] == pytest.approx(math.log2(V) / 3)


def test_perfect_model_scores_zero_and_max_tokens_caps():
    tokens = np.arange(1 + 64) % V

    def oracle(x):  # puts all mass on the true next token (x + 1 mod V)
        return torch.nn.functional.one_hot((x + 1) % V, V).float() * 100

    r = evaluate_tokens(oracle, tokens, np.ones(V, dtype=int), sequence_length=16, max_tokens=32)
    assert r["tokens"] == 32
    assert r["loss"] < 1e-6 and r["bpb"] < 1e-6
    r = evaluate_tokens(oracle, tokens, np.ones(V, dtype=int), sequence_length=16, max_tokens=37)
    assert r["tokens"] == 37  # a cap that is not a multiple of the window is honoured exactly


def test_the_last_partial_window_is_scored():
    # 1,000 tokens in 512-token windows: 999 targets, not the 512 of the full windows alone
    tokens = np.random.default_rng(1).integers(0, V, size=1000)
    for stride in (None, 512, 100, 1):
        r = evaluate_tokens(uniform, tokens, np.ones(V), sequence_length=512, stride=stride,
                            batch_size=64)
        assert r["tokens"] == 999 and r["bytes"] == 999, stride
    # a stream shorter than one window is one window, not an error
    assert evaluate_tokens(uniform, tokens[:5], np.ones(V), sequence_length=16)["tokens"] == 4


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 31, 32, 33, 100])
@pytest.mark.parametrize("window, stride", [(1, None), (1, 1), (16, None), (16, 16), (16, 1),
                                            (16, 5), (16, 15), (7, 3)])
def test_windows_score_every_target_once_with_the_longest_context(n, window, stride):
    windows = rolling_windows(n, window, stride)
    scored = []
    s = window if stride is None else stride
    for begin, end, k in windows:
        assert 0 <= begin < end <= n and 1 <= k <= end - begin
        assert end - begin == min(window, n)  # every window is full length when the text allows
        for t in range(end - k + 1, end + 1):  # target t is predicted from tokens [begin, t)
            scored.append(t)
            assert t - begin >= min(t, window - s + 1)
        if (begin, end, k) != windows[0]:
            assert k <= s
    assert scored == list(range(1, n + 1))  # each target once, in order


def test_stride_equal_to_the_window_is_disjoint_windows():
    assert rolling_windows(40, 16, 16) == rolling_windows(40, 16) == [(0, 16, 16), (16, 32, 16),
                                                                      (24, 40, 8)]
    tokens = np.random.default_rng(2).integers(0, 64, size=41)
    model = _tiny_model()
    a = evaluate_tokens(_logits(model), tokens, np.ones(64), sequence_length=16)
    b = evaluate_tokens(_logits(model), tokens, np.ones(64), sequence_length=16, stride=16)
    # the same windows through the same code path: bit-exact
    assert (a["loss"], a["bpb"], a["tokens"]) == (b["loss"], b["bpb"], b["tokens"])
    assert (a["sequence_length"], a["stride"], b["stride"]) == (16, None, 16)


def _tiny_model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, mlp_hidden=64,
                      max_sequence_length=64, sliding_window=None)
    return Olmo(cfg).eval()


def _logits(model):
    return lambda x: model(x).logits


def _nll(model, ids: np.ndarray) -> torch.Tensor:
    """Per-target NLL of one forward over ``ids``: ``[len(ids) - 1]``."""
    x = torch.as_tensor(ids, dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(x[:, :-1]).logits.float()
    return F.cross_entropy(logits[0], x[0, 1:], reduction="none")


# Two code paths (batched windows and masks vs one plain forward) sum the same fp32 per-target
# NLLs in another order and may run the kernels at other batch shapes: a few fp32 ulps per term
# over tens of terms of a few nats each stays far below a relative 1e-5 on any CPU.
RTOL = 1e-5


@pytest.mark.parametrize("stride", [None, 1, 7])
@pytest.mark.parametrize("window", [40, 64])
def test_a_window_covering_the_text_equals_one_full_forward(window, stride):
    model = _tiny_model()
    tokens = np.random.default_rng(3).integers(0, 64, size=41)
    full = _nll(model, tokens)
    r = evaluate_tokens(_logits(model), tokens, np.ones(64), sequence_length=window, stride=stride)
    assert r["tokens"] == 40
    assert r["loss"] * r["tokens"] == pytest.approx(float(full.double().sum()), rel=RTOL)


@pytest.mark.parametrize("window, stride", [(16, None), (16, 4), (9, 1), (12, 12)])
def test_each_target_is_scored_with_the_context_its_window_gives(window, stride):
    # Independent reference: the window that scores target t ends at the first multiple-of-stride
    # step past the first window that reaches t, and starts `window` tokens before its end.
    model = _tiny_model()
    tokens = np.random.default_rng(4).integers(0, 64, size=51)
    n, s = 50, stride or window
    ref = 0.0
    for t in range(1, n + 1):
        end = window if t <= window else min(window + -(-(t - window) // s) * s, n)
        begin = max(0, end - window)
        ref += float(_nll(model, tokens[begin : end + 1])[t - 1 - begin])
    r = evaluate_tokens(_logits(model), tokens, np.ones(64), sequence_length=window,
                        stride=stride, batch_size=3)
    assert r["tokens"] == n
    assert r["loss"] * n == pytest.approx(ref, rel=RTOL)


def test_sliding_context_helps_a_model_that_needs_it():
    # A model that knows the next token only when it sees the token 3 places back: x[t] = x[t-3].
    period = 3
    tokens = np.tile(np.arange(period) + 1, 40)[:100]

    def lookback(x):
        logits = torch.zeros(*x.shape, V)
        known = x[:, : -(period - 1)]  # position j sees x[j-period+1]: the token after j
        logits[:, period - 1 :] = F.one_hot(known, V).float() * 20
        return logits

    disjoint = evaluate_tokens(lookback, tokens, np.ones(V), sequence_length=8)
    sliding = evaluate_tokens(lookback, tokens, np.ones(V), sequence_length=8, stride=4)
    assert disjoint["tokens"] == sliding["tokens"] == 99
    # disjoint: the first 2 targets of every window are blind; sliding: only those of the first
    assert sliding["loss"] < disjoint["loss"]
    assert sliding["loss"] * 99 == pytest.approx(2 * math.log(V), rel=1e-3)


def test_bad_input_is_an_error():
    with pytest.raises(ValueError, match="nothing to score"):
        evaluate_tokens(uniform, np.zeros(1, dtype=int), np.ones(V), sequence_length=16)
    with pytest.raises(ValueError, match="stride=17 must be between 1 and sequence_length=16"):
        evaluate_tokens(uniform, np.zeros(40, dtype=int), np.ones(V), sequence_length=16,
                        stride=17)
    with pytest.raises(ValueError, match="stride=0"):
        rolling_windows(10, 4, 0)


def test_config_rejects_bad_stride():
    from olmoflow.pipeline.config import load_config

    assert load_config("tiny", ["evaluate.stride=16"]).evaluate.stride == 16
    with pytest.raises(OlmoflowError, match=r"evaluate.stride=0 must be >= 1"):
        load_config("tiny", ["evaluate.stride=0"])
    with pytest.raises(OlmoflowError, match="evaluate.stride=32 exceeds evaluate.sequence_length"):
        load_config("tiny", ["evaluate.stride=32", "evaluate.sequence_length=16"])


def test_stage_report_names_window_stride_and_tokens(tmp_path, monkeypatch):
    """The evaluate stage's report.json / report.md say how the numbers were made."""
    import json

    from olmoflow.pipeline.config import load_config
    from olmoflow.pipeline.stages import eval as stage

    tokens = np.random.default_rng(5).integers(0, 64, size=150).astype(np.uint16)
    (tmp_path / "heldout.npy").write_bytes(tokens.tobytes())
    tok = SimpleNamespace(token_byte_lengths=lambda: np.ones(64, dtype=int))
    monkeypatch.setattr(stage, "load_trained_model",
                        lambda cfg, stage=None: (_tiny_model(), tok, tmp_path / "stage1-step1"))
    monkeypatch.setattr(stage, "token_split",
                        lambda cfg, split: ([tmp_path / "heldout.npy"], np.dtype(np.uint16)))
    monkeypatch.setattr(stage, "model_inputs", lambda cfg, ckpt, stage=None: [])
    cfg = load_config("tiny", [f"run_dir={tmp_path / 'run'}", "evaluate.stride=16"])
    stage.run_evaluate(cfg, progress=False)
    out = tmp_path / "run" / "eval"
    report = json.loads((out / "report.json").read_text())
    assert (report["sequence_length"], report["stride"], report["tokens"]) == (64, 16, 149)
    md = (out / "report.md").read_text()
    assert "| sequence_length | 64 |" in md and "| stride | 16 |" in md and "| tokens | 149 |" in md
    cfg = load_config("tiny", [f"run_dir={tmp_path / 'run'}", "evaluate.stride=65"])
    with pytest.raises(OlmoflowError, match="evaluate.stride=65 exceeds the evaluation window"):
        stage.run_evaluate(cfg, progress=False)
