"""olmoflow models inside lm-evaluation-harness: the ``olmoflow`` model type.

Importing this module registers :class:`OlmoflowLMEval` with lm-eval's model registry, so
``lm_eval.simple_evaluate(model="olmoflow", model_args="pretrained=DIR,max_length=256")`` runs
any lm-eval task on an olmoflow release / Hugging Face export directory, or any other form
:func:`olmoflow.model.load.load_model` reads (a training checkpoint, a Hub id), answered by the fast
:class:`~olmoflow.eval.scorer.OlmoflowLM`. :func:`main` is lm-eval's own command line with the
model registered (lm-eval 0.4 has no plugin discovery for model types).

The requests follow lm-eval's ``TemplateLM`` (tokenization split, empty context -> the prefix
token, rolling windows with ``context_len=1``) so that results match its ``hf`` backend on the
same weights. Two deliberate differences: a request longer than ``max_length`` is an error
instead of a silent left truncation, and generation is greedy only.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own model types, before ours joins the registry)
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from olmoflow.errors import OlmoflowError
from olmoflow.eval.requests import GenerateRequest, LoglikelihoodRequest, RollingRequest
from olmoflow.eval.scorer import OlmoflowLM

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's HFLM.max_gen_toks


def _int_or_none(value: Any, name: str) -> int | None:
    if value is None or value == "" or value == "auto":
        return None
    try:
        return int(str(value).split(":")[0])
    except ValueError:
        raise OlmoflowError(f"model_args {name}={value!r} is not an integer") from None


@register_model("olmoflow")
class OlmoflowLMEval(LM):
    """lm-eval ``LM`` backed by :class:`~olmoflow.eval.scorer.OlmoflowLM`.

    Args (lm-eval ``model_args``):
        pretrained: an olmoflow release or Hugging Face export directory (``config.json``,
            safetensors weights, ``tokenizer.json``), or a training checkpoint (see
            :func:`olmoflow.model.load.load_model`).
        batch_size: sequences per forward pass (default 16; ``auto`` means the default).
        max_length: the longest sequence the model sees (default: the config's
            ``max_position_embeddings``); pass the trained context, e.g. 256 for the demo.
        device: ``cpu``, ``cuda``, ``cuda:1``... (default: CUDA when available).
        dtype: ``float32`` / ``bfloat16`` / ``float16`` (default: as stored).
        model, tokenizer: an already built :class:`~olmoflow.model.olmo.Olmo` and tokenizer,
            instead of ``pretrained`` (Python use only).

    Raises:
        OlmoflowError: ``pretrained`` missing or not loadable, an unknown ``dtype``, a
            non-integer size, or (from the request methods) sampling asked for.
    """

    def __init__(self, pretrained: str | None = None, batch_size: Any = 16,
                 max_length: Any = None, device: str | None = None, dtype: str | None = None,
                 max_batch_size: Any = None, model: Any = None, tokenizer: Any = None,
                 **kwargs: Any):
        super().__init__()
        if kwargs:
            raise OlmoflowError(f"unknown olmoflow model_args: {', '.join(sorted(kwargs))} "
                                "(known: pretrained, batch_size, max_length, device, dtype)")
        import torch

        if device in (None, "", "auto"):
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if model is None:
            model, tokenizer = _load(pretrained, device, dtype)
        elif tokenizer is None:
            raise OlmoflowError("model= needs tokenizer= as well")
        else:
            model = model.to(device)
        self._device = torch.device(device)
        self.pretrained = str(pretrained) if pretrained is not None else None
        self.scorer = OlmoflowLM(model, tokenizer,
                                 batch_size=_int_or_none(batch_size, "batch_size") or 16,
                                 max_length=_int_or_none(max_length, "max_length"),
                                 device=self._device)

    @property
    def tokenizer_name(self) -> str:
        """Names the request cache (lm-eval ``use_cache``)."""
        return (self.pretrained or "olmoflow").replace("/", "__")

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    @property
    def batch_size(self) -> int:
        return self.scorer.batch_size

    def loglikelihood(self, requests: Sequence[Any], disable_tqdm: bool = False
                      ) -> list[tuple[float, bool]]:
        """``Instance.args = (context, continuation)`` -> ``(logprob, is_greedy)`` each."""
        reqs = [LoglikelihoodRequest(*r.args) for r in requests]
        out = [(r.logprob, r.is_greedy) for r in self.scorer.loglikelihood(reqs)]
        for r, o in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", r.args, o)
        return out

    def loglikelihood_rolling(self, requests: Sequence[Any], disable_tqdm: bool = False
                              ) -> list[float]:
        """``Instance.args = (text,)`` -> the text's summed log-probability each."""
        out = [r.logprob for r in self.scorer.loglikelihood_rolling(
            [RollingRequest(r.args[0]) for r in requests])]
        for r, o in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, o)
        return out

    def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[str]:
        """``Instance.args = (context, gen_kwargs)``; gen_kwargs ``until`` (str or list; EOS is
        always a stop), ``max_gen_toks`` (default 256); greedy only."""
        reqs = [_generate_request(*r.args) for r in requests]
        out = self.scorer.generate_until(reqs)
        for r, o in zip(requests, out):
            self.cache_hook.add_partial("generate_until", r.args, o)
        return out

    def get_model_info(self) -> dict:
        """Recorded by lm-eval next to the results."""
        m = self.scorer.model
        return {"model_num_parameters": sum(p.numel() for p in m.parameters()),
                "model_dtype": str(next(m.parameters()).dtype), "model_sha": ""}


def _load(pretrained: str | None, device: str, dtype: str | None):
    """``(model, tokenizer)`` of ``pretrained`` (any form :func:`olmoflow.model.load.load_model`
    reads)."""
    import torch

    from olmoflow.model.load import load_model

    if not pretrained:
        raise OlmoflowError("olmoflow model_args need pretrained=DIR (a release or HF export)")
    if dtype not in (None, "", "auto") and dtype not in DTYPES:
        raise OlmoflowError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    torch_dtype = getattr(torch, dtype) if dtype in DTYPES else None
    try:
        loaded = load_model(pretrained, device=device, dtype=torch_dtype)
    except OlmoflowError as e:
        raise OlmoflowError(f"pretrained={pretrained}: {e}") from None
    return loaded.model, loaded.tokenizer


def _generate_request(context: str, gen_kwargs: dict | None = None) -> GenerateRequest:
    kw = dict(gen_kwargs or {})
    until = kw.pop("until", None) or ()
    until = (until,) if isinstance(until, str) else tuple(until)
    n = int(kw.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
    if kw.pop("do_sample", False) or float(kw.pop("temperature", 0.0) or 0.0) > 0:
        raise OlmoflowError("the olmoflow lm-eval model decodes greedily; set do_sample: false "
                            "and temperature: 0 in the task's generation_kwargs")
    return GenerateRequest(context, until, n)


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's command line (``lm_eval run --model olmoflow --model_args pretrained=DIR ...``)
    with the ``olmoflow`` model type registered; ``argv`` defaults to ``sys.argv[1:]``."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    if argv is not None:
        sys.argv = [sys.argv[0] if sys.argv else "olmoflow-lm-eval", *argv]
    setup_logging()
    parser = HarnessCLI()
    parser.execute(parser.parse_args())


if __name__ == "__main__":
    main()
