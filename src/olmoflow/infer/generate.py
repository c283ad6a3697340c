"""Text generation with a KV cache: greedy decoding and sampling (temperature, top-k, top-p).

Top-p follows Holtzman et al. 2020 ("nucleus sampling"): keep the smallest set of most likely
tokens whose probability mass reaches ``top_p``; the token that crosses the threshold is kept.
"""

from __future__ import annotations

import torch


def top_k_top_p_filter(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Set filtered-out logits to -inf. ``logits [B, V]`` -> ``[B, V]``."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass *before* it already reaches top_p: the crossing token stays.
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: torch.Tensor, *, do_sample: bool, temperature: float, top_k: int | None,
    top_p: float | None, generator: torch.Generator | None,
) -> torch.Tensor:
    """Pick the next token for each row. ``logits [B, V]`` -> ``[B]`` (long)."""
    if not do_sample or temperature == 0:
        return logits.argmax(-1)
    logits = top_k_top_p_filter(logits.float() / temperature, top_k, top_p)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    *,
    max_length: int | None = None,
    max_new_tokens: int | None = None,
    attention_mask: torch.Tensor | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    seed: int | None = None,
) -> torch.Tensor:
    """Continue ``input_ids [B, T]`` and return ``[B, T + n]`` (prompt included), as in HF.

    Args:
        max_length: total length including the prompt; max_new_tokens: tokens to add (takes
            precedence when both are given). Neither: 20 new tokens.
        attention_mask: ``[B, T]``, 0 on left padding (batched prompts of different lengths).
        do_sample: sample instead of greedy argmax; temperature/top_k/top_p shape the sampling.
        eos_token_id: a row stops after emitting it; finished rows are filled with
            ``pad_token_id`` (or EOS) until every row is done.
        seed: seeds a private generator so sampling is reproducible.
    Raises:
        ValueError: ``max_length`` shorter than the prompt, non-positive ``max_new_tokens``, or a
            temperature < 0.
    """
    B, T = input_ids.shape
    if max_new_tokens is None:
        if max_length is not None:
            if max_length < T:
                raise ValueError(
                    f"max_length={max_length} is shorter than the prompt ({T} tokens); "
                    "max_length counts the prompt, use max_new_tokens to count new tokens only"
                )
            max_new_tokens = max_length - T
        else:
            max_new_tokens = 20
    elif max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if max_new_tokens == 0:
        return input_ids
    generator = None
    if seed is not None:
        generator = torch.Generator(device=input_ids.device).manual_seed(seed)
    was_training = model.training
    model.eval()
    device = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    cache = model.new_cache(B, T + max_new_tokens)
    out = model(input_ids, attention_mask=attention_mask, cache=cache, last_logits_only=True)
    tokens = [input_ids]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    fill = pad_token_id if pad_token_id is not None else eos_token_id
    for step in range(max_new_tokens):
        nxt = sample_next(out.logits[:, -1], do_sample=do_sample, temperature=temperature,
                          top_k=top_k, top_p=top_p, generator=generator)
        if eos_token_id is not None:
            if fill is not None:
                nxt = torch.where(done, torch.full_like(nxt, fill), nxt)
            done |= nxt == eos_token_id
        tokens.append(nxt[:, None])
        if (eos_token_id is not None and done.all()) or step == max_new_tokens - 1:
            break
        attention_mask = torch.cat([attention_mask, torch.ones_like(nxt[:, None])], dim=1)
        out = model(nxt[:, None], attention_mask=attention_mask, cache=cache, last_logits_only=True)
    model.train(was_training)
    return torch.cat(tokens, dim=1)
