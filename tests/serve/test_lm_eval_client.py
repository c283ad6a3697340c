"""lm-eval's ``local-completions`` model pointed at the server (echo + logprobs on token-id
prompts, as its loglikelihood requests are) gives the loglikelihoods of a direct forward."""

from __future__ import annotations

import pytest
import torch
from serving import MODEL_NAME

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
for _extra in ("aiohttp", "requests", "tenacity", "tqdm"):  # lm-eval's [api] extra
    pytest.importorskip(_extra, reason=f"lm-eval's API models need {_extra} (lm-eval[api])")


def test_local_completions_loglikelihood_equals_a_forward(server, release_dir, tiny_model):
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    model, tok = tiny_model
    lm = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model=MODEL_NAME,
                             tokenizer=str(release_dir), tokenizer_backend="huggingface",
                             max_length=server.engine.max_context, max_retries=1,
                             num_concurrent=1)
    pairs = [("The cat sat on the", " mat."), ("def add(a, b):\n    return", " a + b"),
             ("The quick brown fox jumps over the", " lazy dog."), ("emoji 😀 and", " café")]
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
                for i, pair in enumerate(pairs)]
    got = lm.loglikelihood(requests, disable_tqdm=True)
    for (context, continuation), (ll, greedy) in zip(pairs, got, strict=True):
        ctx, cont = lm._encode_pair(context, continuation)
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logits = model(ids).logits[0, :, : tok.vocab_size].float()
        lp = torch.log_softmax(logits[len(ctx) - 1 : -1], -1)
        want = lp.gather(-1, torch.tensor(cont)[:, None])[:, 0]
        assert ll == pytest.approx(float(want.sum()), abs=1e-3)
        assert greedy == bool((lp.argmax(-1) == torch.tensor(cont)).all())
