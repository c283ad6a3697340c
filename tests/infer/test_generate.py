"""Sampling extensions: CTRL repetition penalty (matches transformers), stop strings, no leaks."""

import pytest
import torch
from tolerance import assert_greedy_agrees, forward_terms, fp32_rel

from olmoflow.infer.generate import apply_repetition_penalty, generate, iter_tokens


def greedy_logits(model, seq, penalty: float = 1.0) -> tuple[torch.Tensor, float]:
    """The logits greedy decoding chose from at each position of ``seq`` [B, T] (one full
    forward, then the repetition penalty of the tokens seen so far), and the bound on two code
    paths' logits: two ulps per accumulated term of their scale (tolerance.py)."""
    with torch.no_grad():
        logits = model(seq).logits
    if penalty != 1.0:
        for t in range(seq.shape[1]):
            seen = torch.zeros_like(logits[:, t], dtype=torch.bool).scatter_(1, seq[:, : t + 1],
                                                                             True)
            logits[:, t] = apply_repetition_penalty(logits[:, t], seen, penalty)
    rel = fp32_rel(forward_terms(model.config, seq.shape[1]), 2)
    return logits, rel * float(logits.abs().max())


def test_repetition_penalty_formula_matches_transformers():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    logits, ids = torch.randn(2, 11), torch.randint(0, 11, (2, 6))
    seen = torch.zeros(2, 11, dtype=torch.bool).scatter_(1, ids, True)
    ref = tf.RepetitionPenaltyLogitsProcessor(1.7)(ids, logits.clone())
    torch.testing.assert_close(apply_repetition_penalty(logits, seen, 1.7), ref)


def test_repetition_penalty_greedy_matches_transformers(model, tmp_path):
    tf = pytest.importorskip("transformers")
    model.save_pretrained(tmp_path)
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 61, (1, 7), generator=torch.Generator().manual_seed(1))
    ours = generate(model, ids, max_new_tokens=20, repetition_penalty=1.5)
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                      min_new_tokens=20, repetition_penalty=1.5, pad_token_id=0)
    assert ref.shape == ours.shape
    assert_greedy_agrees(ref, ours, *greedy_logits(model, ours, 1.5), ids.shape[1])
    assert not torch.equal(ours, generate(model, ids, max_new_tokens=20))  # the penalty matters


def test_repetition_penalty_ignores_left_padding(model):
    ids = torch.tensor([[3, 3, 9, 4]])
    padded = torch.tensor([[7, 7, 3, 3, 9, 4]])  # 7 is a pad: it must not be penalised
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    a = generate(model, ids, max_new_tokens=10, repetition_penalty=1.3)[0, 4:]
    b = generate(model, padded, attention_mask=mask, max_new_tokens=10,
                 repetition_penalty=1.3)[0, 6:]
    alone = torch.cat([ids[0], a])[None]  # padded is another shape: compare where decided
    assert_greedy_agrees(torch.cat([ids[0], b])[None], alone, *greedy_logits(model, alone, 1.3),
                         ids.shape[1])


def test_stop_strings_keep_the_stop_and_fill(bpe, scripted):
    row0 = bpe.encode("one two STOP three four five six")
    row1 = bpe.encode("a b c d e f g h i j k l m n o p q r s")
    n = max(len(row0), len(row1))
    model = scripted([row0, row1], bpe.vocab_size)
    out = generate(model, torch.zeros(2, 1, dtype=torch.long), max_new_tokens=n,
                   stop_strings=["STOP", "never"], tokenizer=bpe, pad_token_id=bpe.pad_token_id)
    text0 = bpe.decode(out[0, 1:])  # pads are special tokens: skipped
    assert text0 == "one two STOP"  # kept, as in transformers; nothing after it
    assert bpe.decode(out[1, 1:]) == bpe.decode(row1[: out.shape[1] - 1])
    single = generate(scripted([row0], bpe.vocab_size), torch.zeros(1, 1, dtype=torch.long),
                      max_new_tokens=n, stop_strings=["STOP"], tokenizer=bpe)
    assert bpe.decode(single[0, 1:]) == "one two STOP" and single.shape[1] < 1 + n


def test_return_lengths_counts_each_row_up_to_what_ended_it(bpe, scripted):
    """A row ended by a stop string, one ended by EOS and one that runs to the limit: the lengths
    cover exactly the tokens before the fill, the ending token included."""
    row0 = bpe.encode("one two STOP three four five six")
    row1 = bpe.encode("a b") + [bpe.eos_token_id] + bpe.encode(" c d e f g h i j")
    row2 = bpe.encode("k l m n o p q r s t u v w x y z")
    n = min(map(len, (row0, row1, row2)))
    model = scripted([row0, row1, row2], bpe.vocab_size)
    out, lengths = generate(model, torch.zeros(3, 1, dtype=torch.long), max_new_tokens=n,
                            stop_strings=["STOP"], tokenizer=bpe, eos_token_id=bpe.eos_token_id,
                            pad_token_id=bpe.pad_token_id, return_lengths=True)
    stop_end = next(k for k in range(1, n + 1) if "STOP" in bpe.decode(row0[:k]))
    assert lengths.tolist() == [stop_end, len(bpe.encode("a b")) + 1, out.shape[1] - 1]
    for r, k in enumerate(lengths.tolist()):
        assert (out[r, 1 + k:] == bpe.pad_token_id).all()


def test_stop_string_split_inside_a_character(bpe, scripted):
    ids = bpe.encode("ab 😀 cd 😀 ef")
    out = generate(scripted([ids], bpe.vocab_size), torch.zeros(1, 1, dtype=torch.long),
                   max_new_tokens=len(ids), stop_strings=["😀 c"], tokenizer=bpe)
    assert bpe.decode(out[0, 1:]) == "ab 😀 c"


def test_argument_errors(model):
    ids = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model, ids, stop_strings=["x"])
    with pytest.raises(ValueError, match="pad_token_id"):
        generate(model, ids, stop_strings=["x"], tokenizer=object())
    with pytest.raises(ValueError, match="repetition_penalty"):
        generate(model, ids, repetition_penalty=0.0)
    with pytest.raises(ValueError, match="temperature"):
        iter_tokens(model, ids, temperature=-1.0)  # eager, before any step


def test_iterator_does_not_leak_inference_mode_or_eval(model):
    model.train()
    steps = iter_tokens(model, torch.ones(1, 3, dtype=torch.long), max_new_tokens=3)
    first = next(steps)
    assert not torch.is_inference_mode_enabled() and not model.training
    rest = list(steps)
    assert len(rest) == 2 and first.shape == (1,)
    assert model.training
    model.eval()


def test_tokenizer_supplies_eos_and_pad_defaults(bpe, scripted):
    row0 = bpe.encode("one two STOP three")
    row1 = bpe.encode("a b c d e f")
    out = generate(scripted([row0, row1], bpe.vocab_size), torch.zeros(2, 1, dtype=torch.long),
                   max_new_tokens=max(len(row0), len(row1)), stop_strings=["STOP"], tokenizer=bpe)
    assert bpe.decode(out[0, 1:]) == "one two STOP"
    stopped_at = len(bpe.encode("one two STOP")) + 1
    assert (out[0, stopped_at:] == bpe.pad_token_id).all()  # filled with the tokenizer's pad id


def test_compiled_static_cache_decode_matches_eager(model):
    # aot_eager keeps the test fast on CPU; the code path (static cache, compiled decode) is the
    # same.
    prompts = torch.randint(0, model.config.vocab_size, (2, 7))
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0  # left padding in row 1
    eager = generate(model, prompts, attention_mask=mask, max_new_tokens=12)
    compiled = generate(model, prompts, attention_mask=mask, max_new_tokens=12, compile="aot_eager")
    # The static cache attends over all its slots (masked), the dynamic one over the filled
    # ones: other sums, so the same tokens wherever the logits' bound cannot flip the argmax.
    with torch.no_grad():
        logits = model(eager, attention_mask=torch.cat([mask, torch.ones(2, 12, dtype=mask.dtype)],
                                                       1)).logits
    atol = fp32_rel(forward_terms(model.config, eager.shape[1]), 2) * float(logits.abs().max())
    assert_greedy_agrees(compiled, eager, logits, atol, prompts.shape[1])
    again = generate(model, prompts, attention_mask=mask, max_new_tokens=12, compile="aot_eager")
    assert torch.equal(again, eager)  # the cached compiled module is reused


def test_model_still_deepcopies_after_compiled_decode(model):
    import copy

    generate(model, torch.randint(0, 61, (1, 4)), max_new_tokens=2, compile="aot_eager")
    clone = copy.deepcopy(model)
    assert torch.equal(clone.lm_head.weight, model.lm_head.weight)
