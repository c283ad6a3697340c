"""The OLMo 2 / OLMo 3 decoder, readable in one sitting.

Block ("reordered norm", OLMo 2): ``h = x + RMSNorm(Attn(x))``, ``out = h + RMSNorm(MLP(h))``;
no pre-norm, one final RMSNorm before an untied LM head, no biases. OLMo 3 adds sliding-window
attention on every layer but every 4th and the last, and YaRN on the full-attention layers.
See Team OLMo, "2 OLMo 2 Furious" (2024) and the OLMo 3 report (2025).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from olmoflow.errors import OlmoflowError
from olmoflow.model.attention import Attention, AttentionMask, AttentionWeights, KVCache
from olmoflow.model.config import ModelConfig
from olmoflow.model.layers import (
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    clear_inference_weights,
    derived_weights,
    fused_weight,
    inference_rms_norm,
)
from olmoflow.model.loss import IGNORE_INDEX as IGNORE_INDEX  # (its old home: still imported here)
from olmoflow.model.loss import fused_head_applies, linear_lm_loss, lm_loss


class BlockWeights(NamedTuple):
    """One block's part of :class:`InferenceWeights`: the attention's
    (:meth:`Attention.inference_weights`) and the MLP's (:meth:`SwiGLU.inference_weights`)
    derived weights, and the two block norms' weights (the parameters) and epsilons."""

    attention: AttentionWeights
    mlp: tuple[torch.Tensor | None, torch.Tensor | None]
    attention_norm: torch.Tensor
    attention_eps: float
    feed_forward_norm: torch.Tensor
    feed_forward_eps: float


@dataclass(frozen=True)
class InferenceWeights:
    """The derived weights of :meth:`Olmo.forward`'s inference path: one :class:`BlockWeights`
    per block and the LM head's ``[d_model, vocab]`` (None: use the module itself)."""

    blocks: tuple[BlockWeights, ...]
    lm_head: torch.Tensor | None


@dataclass
class OlmoOutput:
    """``logits [B, T, V]`` (None when not asked for: a training forward with labels, see
    :meth:`Olmo.forward`'s ``return_logits``; the hidden states ``[B, T, d_model]`` with
    ``return_hidden``); the losses are scalars (None without labels).

    ``loss = ce_loss + z_loss``, each already divided by the normalizer (see :meth:`Olmo.forward`).
    """

    logits: torch.Tensor | None
    loss: torch.Tensor | None = None
    ce_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None


class Block(nn.Module):
    """One OLMo 2/3 transformer block (reordered norm). ``[B, T, d] -> [B, T, d]``."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.window = cfg.window(layer)
        self.attention = Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.hd, self.window,
                                   cfg.rms_norm_eps, cfg.attention_backend, cfg.dropout)
        self.attention_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.feed_forward = SwiGLU(cfg.d_model, cfg.mlp_hidden)
        self.feed_forward_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.dropout = cfg.dropout

    def forward(self, x, cos, sin, cache=None, mask=None, cache_position=None, inference=None):
        """``inference``: this block's :class:`BlockWeights` takes the no-grad KV-cache path
        (:meth:`Attention.inference_forward`, :meth:`SwiGLU.inference`; RoPE tables in that
        path's form), without dropout."""
        if inference is not None:
            a = self.attention.inference_forward(x, cos, sin, inference.attention,
                                                 layer=self.layer, cache=cache, mask=mask,
                                                 cache_position=cache_position)
            w = inference
            h = inference_rms_norm(a, w.attention_norm, w.attention_eps, residual=x)
            m = self.feed_forward.inference(h, w.mlp)
            return inference_rms_norm(m, w.feed_forward_norm, w.feed_forward_eps, residual=h)
        a = self.attention(x, cos, sin, layer=self.layer, cache=cache, mask=mask,
                           cache_position=cache_position)
        h = x + F.dropout(self.attention_norm(a), self.dropout, self.training)
        m = self.feed_forward(h)
        return h + F.dropout(self.feed_forward_norm(m), self.dropout, self.training)


class Olmo(nn.Module):
    """An OLMo 2 / OLMo 3 causal language model.

    ``forward(input_ids [B, T]) -> OlmoOutput`` with ``logits [B, T, vocab_size]``. Labels, when
    given, are aligned with the inputs (``labels[:, t]`` is the target after ``input_ids[:, t]``);
    the model does not shift them.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (> 0) before building the model")
        self.config = config
        # Recompute every n-th block (0, n, 2n, ...) in backward instead of storing its activations
        # (0: off). A training setting, not part of the architecture: the trainer sets it.
        self.activation_checkpointing = 0
        # The cached no-grad forward (generate, serving) runs the inference path over derived
        # weight copies (see forward); False runs the training forward's code there too.
        self.fused_inference = True
        # The loss over the LM head's output, ``fn(logits, labels, z_loss_coef, normalizer) ->
        # (loss, ce_loss, z_loss)``; None: :func:`lm_loss`. Tensor parallelism sets a
        # vocabulary-parallel loss here (the head's output is then this rank's vocabulary shard).
        self.lm_loss_fn = None
        self.embeddings = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.rope = RotaryEmbedding(config.hd, config.rope_theta,
                                    max_length=config.max_sequence_length)
        # OLMo 3 trained YaRN on the full-attention layers only; sliding layers keep plain RoPE.
        self.rope_full = (
            RotaryEmbedding(config.hd, config.rope_theta, config.yarn_factor,
                            config.yarn_original_max_length, max_length=config.max_sequence_length)
            if config.yarn_factor else self.rope
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """OLMo init: truncated normal (std ``init_std``, cut at +-3 std) for every linear and the
        embedding; norm weights 1."""
        std = self.config.init_std
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.trunc_normal_(m.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    @property
    def device(self) -> torch.device:
        return self.embeddings.weight.device

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def inference_weights(self) -> InferenceWeights:
        """The derived weights of the inference path (see :meth:`forward`), built on first use
        and kept beside the model until a parameter or submodule changes
        (:func:`~olmoflow.model.layers.derived_weights`) or :meth:`train` frees them. They cost
        a copy of the block projections and the LM head (the model's memory about once more
        on top of the embedding); :attr:`fused_inference` ``= False`` does without."""
        return derived_weights(self, self._build_inference_weights)

    def _build_inference_weights(self) -> InferenceWeights:
        blocks = tuple(
            BlockWeights(b.attention.inference_weights(), b.feed_forward.inference_weights(),
                         b.attention_norm.weight, b.attention_norm.eps,
                         b.feed_forward_norm.weight, b.feed_forward_norm.eps)
            for b in self.blocks)
        return InferenceWeights(blocks, fused_weight((self.lm_head,)))

    def train(self, mode: bool = True) -> Olmo:
        """:meth:`torch.nn.Module.train`; entering training also frees the inference path's
        derived weights (:func:`~olmoflow.model.layers.clear_inference_weights`): they would be
        stale after the first optimizer step, and training needs the memory."""
        if mode:
            clear_inference_weights(self)
        return super().train(mode)

    def new_cache(self, batch: int, max_length: int, *, static: bool = False) -> KVCache:
        """An empty KV cache for ``batch`` rows of up to ``max_length`` positions.

        ``static=True`` gives the fixed-shape cache for ``torch.compile``d decoding (see
        :class:`KVCache` and :meth:`forward`).
        """
        c = self.config
        return KVCache(c.n_layers, batch, c.n_kv_heads, max_length, c.hd,
                       self.embeddings.weight.dtype, self.device, static=static)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        cache_position: torch.Tensor | None = None,
        loss_normalizer: float | None = None,
        last_logits_only: bool = False,
        return_hidden: bool = False,
        return_logits: bool = False,
    ) -> OlmoOutput:
        """Run the decoder.

        Args:
            input_ids: ``[B, T]`` token ids.
            labels: ``[B, T]`` targets aligned with the inputs, ``IGNORE_INDEX`` where none.
            attention_mask: ``[B, start + T]`` 1 for real tokens, 0 for (left) padding, covering
                the cached positions too; positions for RoPE count real tokens only. With a cache
                the pads are remembered, so later calls may omit it (new tokens are real).
            doc_ids: ``[B, T]`` document number per position; tokens attend within their own
                document only (intra-document masking for packed sequences). Full forwards only
                (no cache, or a dynamic cache filled from empty).
            cache: a :class:`KVCache` to read and extend (prefill or decode), or a ragged
                cache (``ragged = True``: :class:`olmoflow.serve.slots.SlotKVCache`, one
                length per row) whose ``prepare`` gives the positions and masks.
            cache_position: static cache only: ``[T]`` long tensor of the slots this call writes;
                default ``cache.position + arange(T)``. The static path never turns a tensor into
                a Python number, so decode steps of the same shape reuse one compiled graph; omit
                ``attention_mask`` on those steps (its width would change every step).
            loss_normalizer: divide summed losses by this instead of this batch's target count.
            last_logits_only: compute logits for the last position only (decoding).
            return_hidden: skip the LM head: ``.logits`` holds the final-norm hidden states
                ``[B, T, d_model]``, for a caller that applies ``lm_head`` to the positions it
                needs only (evaluation scores continuation tokens, not padding). No labels.
            return_logits: with labels, return the logits too. Without it a training forward
                (autograd recording, a plain ``nn.Linear`` head, no :attr:`lm_loss_fn`) runs
                the head and the loss chunk by chunk (:func:`~olmoflow.model.loss.linear_lm_loss`:
                the ``[B, T, V]`` logits never exist) and ``.logits`` is None.

        With a cache, in eval mode, without labels and without autograd (``torch.no_grad`` or
        ``torch.inference_mode``; not while ``torch.compile`` traces) the forward takes the
        inference path, unless :attr:`fused_inference` is False: fused QKV and gate/up matmuls
        over transposed copies of the weights (:meth:`inference_weights`: built on first use,
        rebuilt when a weight changes, freed by :meth:`train`, never in the state dict), one
        norm and one RoPE call for q and k, fewer kernels per norm, RoPE tables sliced rather
        than gathered, and, for a decode step over a cache without padding, no mask at all. It
        equals the plain path within fp32 rounding; full forwards (training, evaluation,
        losses) never take it, so their numbers do not move.
        Raises:
            ValueError: ``attention_mask`` does not cover the cached positions; ``doc_ids`` not
                ``[B, T]`` or used while decoding; (dynamic cache) more than ``max_length``
                positions; ``cache_position`` without a static cache.
        """
        B, T = input_ids.shape
        dev = input_ids.device
        inference = (cache is not None and self.fused_inference and not self.training
                     and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
                     and labels is None)
        if doc_ids is not None and doc_ids.shape != input_ids.shape:
            raise ValueError(f"doc_ids {tuple(doc_ids.shape)} must match input_ids "
                             f"{tuple(input_ids.shape)}")
        if attention_mask is not None:
            attention_mask = attention_mask.bool()
        ragged = cache is not None and getattr(cache, "ragged", False)
        if ragged:  # per-row lengths (serve.slots.SlotKVCache): the cache builds the masks
            positions, masks = cache.prepare(T, self._windows(), dev)
        elif cache is not None and cache.static:
            cache_position, positions, masks = self._static_inputs(T, cache, cache_position,
                                                                   attention_mask, doc_ids)
        else:
            if cache_position is not None:
                raise ValueError("cache_position needs a static cache: "
                                 "model.new_cache(..., static=True)")
            positions, masks = self._dynamic_inputs(T, cache, attention_mask, doc_ids, dev,
                                                    inference)
        cos, sin, cos_full, sin_full = self._rope(positions, T, dev, inference)

        x = self.embeddings(input_ids)
        every = self.activation_checkpointing if self.training and torch.is_grad_enabled() else 0
        weights = self.inference_weights() if inference else None
        for block in self.blocks:
            full = block.window is None
            args = (x, cos_full if full else cos, sin_full if full else sin, cache,
                    masks[block.window], cache_position)
            if weights is not None:
                x = block(*args, weights.blocks[block.layer])
            elif every and cache is None and block.layer % every == 0:
                x = torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False)
            else:
                x = block(*args)
        if ragged:
            cache.advance(T)
        elif cache is not None:
            if cache.static:
                cache.position.copy_(cache_position[-1:] + 1)
            else:
                cache.length = cache.length + T
        if weights is not None:
            return OlmoOutput(self._inference_head(x, weights.lm_head, last_logits_only,
                                                   return_hidden))
        x = self.norm(x)
        if last_logits_only:
            x = x[:, -1:]
        if return_hidden:
            return OlmoOutput(x)
        if (labels is not None and not return_logits and self.lm_loss_fn is None
                and fused_head_applies(self.lm_head, x)):
            # Training: the head and the loss chunk by chunk, never the whole [B, T, V] logits.
            loss, ce, z = linear_lm_loss(x, self.lm_head.weight, labels, self.config.z_loss,
                                         loss_normalizer)
            return OlmoOutput(None, loss, ce, z)
        logits = self.lm_head(x)
        if labels is None:
            return OlmoOutput(logits)
        loss_fn = self.lm_loss_fn if self.lm_loss_fn is not None else lm_loss
        loss, ce, z = loss_fn(logits, labels, self.config.z_loss, loss_normalizer)
        return OlmoOutput(logits, loss, ce, z)

    def _windows(self) -> set[int | None]:
        return {b.window for b in self.blocks}

    def _inference_head(self, x, w_head, last_logits_only: bool, return_hidden: bool,
                        ) -> torch.Tensor:
        """The final norm and LM head of the inference path: ``[B, T, d]`` -> logits (or the
        normed hidden states), the last position only first when asked (the norm is per
        position, so slicing before it changes nothing)."""
        if last_logits_only and x.shape[1] > 1:
            x = x[:, -1:]
        x = inference_rms_norm(x, self.norm.weight, self.norm.eps)
        if return_hidden:
            return x
        return self.lm_head(x) if w_head is None else torch.matmul(x, w_head)

    def _rope(self, positions, T: int, dev, inference: bool):
        """``(cos, sin, cos_full, sin_full)`` for the sliding and the full-attention layers from
        ``positions [B|1, T]``; on the inference path the tables of
        :meth:`RotaryEmbedding.inference_tables` (``positions`` may then be an int ``start``)."""
        if inference:
            cos, sin = self.rope.inference_tables(positions, T, dev)
            if self.rope_full is self.rope:
                return cos, sin, cos, sin
            return (cos, sin, *self.rope_full.inference_tables(positions, T, dev))
        cos, sin = self.rope(positions)
        if self.rope_full is self.rope:
            return cos, sin, cos, sin
        return (cos, sin, *self.rope_full(positions))

    def _dynamic_inputs(self, T, cache, attention_mask, doc_ids, dev, inference=False):
        """RoPE positions ``[B|1, T]`` and one :class:`AttentionMask` per window, reading the
        filled prefix of a dynamic cache (or no cache). On the inference path over a cache that
        holds no padding: the int ``start`` and no masks (None: plain causal, see
        :meth:`Attention.inference_forward`), without a tensor op or a device read."""
        start = cache.length if cache is not None else 0
        key_padding = None
        if attention_mask is not None:
            if attention_mask.shape[1] != start + T:
                raise ValueError(
                    f"attention_mask must cover the cached positions too: [B, start + T] = "
                    f"[B, {start + T}], got {tuple(attention_mask.shape)}")
            positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -T:]
            key_padding = attention_mask
            if cache is not None:
                cache.key_padding[:, : start + T] = attention_mask
                cache.n_pad.copy_((~attention_mask).sum(-1))
                cache.padded = cache.padded or not bool(attention_mask.all())
        elif inference and not cache.padded and doc_ids is None:
            return start, dict.fromkeys(self._windows())
        else:
            positions = torch.arange(start, start + T, device=dev)[None]
            if cache is not None:
                positions = (positions - cache.n_pad[:, None]).clamp_min(0)
                key_padding = cache.key_padding[:, : start + T]
                if key_padding.all():
                    key_padding = None
        if doc_ids is not None and start:
            raise ValueError("doc_ids (intra-document masking) is for full forwards, not decoding")
        q_pos = torch.arange(start, start + T, device=dev)
        masks = {w: AttentionMask(q_pos, start + T, w, key_padding=key_padding, doc_ids=doc_ids)
                 for w in self._windows()}
        return positions, masks

    def _static_inputs(self, T, cache, cache_position, attention_mask, doc_ids):
        """Like :meth:`_dynamic_inputs` for a static cache, also returning the write slots
        ``cache_position [T]``: queries attend over all ``max_length`` slots, unwritten slots
        being masked by causality."""
        dev = cache.position.device
        if doc_ids is not None:
            raise ValueError(
                "doc_ids (intra-document masking) is not supported with a static KV cache")
        if cache_position is None:
            cache_position = cache.position + torch.arange(T, device=dev)
        elif cache_position.shape != (T,):
            raise ValueError(
                f"cache_position must be [T] = [{T}], got {tuple(cache_position.shape)}")
        if not torch.compiler.is_compiling() and int(cache_position[-1]) >= cache.max_length:
            raise ValueError(f"KV cache overflow: {int(cache_position[-1]) + 1} positions > "
                             f"max_length {cache.max_length}")
        if attention_mask is not None:
            S = attention_mask.shape[1]
            if S < T or S > cache.max_length:
                raise ValueError(
                    f"attention_mask must cover the cached positions too: got width {S} "
                    f"for {T} new tokens and max_length {cache.max_length}")
            cache.key_padding[:, :S] = attention_mask
            cache.n_pad.copy_((~attention_mask).sum(-1))
            positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -T:]
        else:
            positions = (cache_position[None] - cache.n_pad[:, None]).clamp_min(0)
        masks = {w: AttentionMask(cache_position, cache.max_length, w,
                                  key_padding=cache.key_padding, aligned=False)
                 for w in self._windows()}
        return cache_position, positions, masks

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """Sample continuations: ``[B, T] -> [B, T + n]``. Takes ``sampling=`` (a
        :class:`~olmoflow.infer.sampling.SamplingParams`) or the ``transformers``-style keywords;
        see :func:`olmoflow.infer.generate.generate` for the arguments and errors.

        Speculative decoding (:mod:`olmoflow.infer.speculative`): ``prompt_lookup_num_tokens=K``
        (``transformers``' name; ``max_matching_ngram_size``) or ``draft_model=`` (an Olmo with
        the same vocabulary; ``num_draft_tokens``), ``return_stats=True`` for the acceptance
        counts; the same greedy tokens and the same sampling distribution."""
        from olmoflow.infer.speculative import generate_or_speculate

        return generate_or_speculate(self, input_ids, **kwargs)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None,
                                      ) -> None:
        """Recompute every block's activations in backward instead of storing them (the
        ``transformers`` name for :attr:`activation_checkpointing`; OLMo's docs' last resort
        for out-of-memory): less activation memory for about one more forward per step.

        ``gradient_checkpointing_kwargs``: ``use_reentrant`` is accepted for compatibility (the
        non-reentrant checkpoint is always used: it works with frozen inputs, as under LoRA);
        ``every=n`` recomputes every n-th block only (default 1, all blocks).

        Raises:
            OlmoflowError: an unknown key, or ``every`` not a positive integer.
        """
        kwargs = dict(gradient_checkpointing_kwargs or {})
        every = kwargs.pop("every", 1)
        kwargs.pop("use_reentrant", None)
        if kwargs:
            raise OlmoflowError(f"unknown gradient_checkpointing_kwargs {sorted(kwargs)}; "
                                "valid: use_reentrant, every")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise OlmoflowError(f"gradient_checkpointing_kwargs every={every!r} must be a "
                                "positive integer")
        self.activation_checkpointing = every

    def gradient_checkpointing_disable(self) -> None:
        """Store activations again (:meth:`gradient_checkpointing_enable` undone)."""
        self.activation_checkpointing = 0

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype | None = None, device_map: str | None = None,
                        load_in_8bit: bool = False, quantization: str | None = None,
                        revision: str | None = None, cache_dir: str | Path | None = None,
                        allow_network: bool | None = None) -> Olmo:
        """Load a Hugging Face-format OLMo 2/3 directory (``config.json`` + safetensors), or a
        Hub id (``"allenai/OLMo-2-0425-1B"``) found in the local Hugging Face cache (see
        :func:`olmoflow.model.hub.resolve_pretrained` for ``revision``, ``cache_dir`` and
        ``allow_network``).

        ``Olmo.from_pretrained(dir, load_in_8bit=True, device_map="auto")`` works as in OLMo's
        docs (bitsandbytes int8; ``quantization="torchao"`` for torchao int8 weight-only).

        ``device_map="auto"`` places the model on the GPU when there is one, else the CPU. The
        model is built on the meta device and the loaded tensors are assigned in place (no second
        copy, no random init); weights keep their stored dtype (e.g. bf16) unless ``dtype`` is
        given. With 8-bit loading the LM head stays in full precision (see
        :func:`olmoflow.infer.quantize.quantize_model`). The model is returned in eval mode.

        Raises:
            OlmoflowError: a Hub id not in the local cache (network not allowed) or not on the
                Hub; the directory or its files are missing or damaged (a truncated or
                garbled ``model.safetensors``, a ``config.json`` that is not a JSON object of the
                expected keys and types), the config is not OLMo 2/3, the weights do not match the
                config (names or shapes, checked against the safetensors header before the model
                is built), or 8-bit loading was asked for without its library.
        """
        from olmoflow.model.hf import read_hf_dir
        from olmoflow.model.hub import resolve_pretrained

        path = resolve_pretrained(path, revision=revision, allow_network=allow_network,
                                  cache_dir=cache_dir)
        cfg, state = read_hf_dir(path, device=device)
        # a saved bitsandbytes int8 model: its int8 linears come back as saved
        int8 = {k.removesuffix(".SCB"): {} for k in state if k.endswith(".SCB")}
        for name, t in int8.items():
            for part in ("weight", "SCB", "bias"):
                if f"{name}.{part}" in state:
                    t[part] = state.pop(f"{name}.{part}")
            state.pop(f"{name}.weight_format", None)
        with torch.device("meta"):
            model = cls(cfg)
        shapes = {**{k: v.shape for k, v in state.items()},
                  **{f"{n}.{part}": v.shape for n, t in int8.items() for part, v in t.items()
                     if part != "SCB"}}
        expected = {k: p.shape for k, p in model.state_dict().items()}
        missing = sorted(set(expected) - set(shapes))
        unexpected = sorted(set(shapes) - set(expected))
        wrong = [k for k in expected if k in shapes and shapes[k] != expected[k]]
        if missing or unexpected or wrong:
            raise OlmoflowError(
                f"weights in '{path}' do not match its config.json: missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}, wrong shape {wrong[:3]}")
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        if int8:
            if quantization not in (None, "bnb"):
                raise OlmoflowError(f"'{path}' holds bitsandbytes int8 weights; it loads as they "
                                    f"are, not with quantization={quantization!r}")
            from olmoflow.infer.quantize import load_int8_linears
            from olmoflow.model.hf import int8_threshold_of

            try:
                load_int8_linears(model, int8, threshold=int8_threshold_of(path) or 0.0)
            except ImportError as e:
                raise OlmoflowError(f"'{path}' holds bitsandbytes int8 weights, which need "
                                    f"their library: {e} (pip install 'olmoflow[quant]')"
                                    ) from None
        model.load_state_dict(state, strict=not int8, assign=True)
        if device_map == "auto":
            model = model.to("cuda" if torch.cuda.is_available() else "cpu")
        elif device_map is not None:
            model = model.to(device_map)
        if (load_in_8bit or quantization) and not int8:
            from olmoflow.infer.quantize import quantize_model

            try:
                quantize_model(model, quantization or "bnb")
            except ImportError as e:
                raise OlmoflowError(f"8-bit loading needs its library: {e} "
                                    "(pip install 'olmoflow[quant]')") from None
        return model.eval()

    def resize_token_embeddings(self, new_vocab: int, **kwargs) -> int:
        """:func:`resize_token_embeddings` on this model (the ``transformers`` method name)."""
        return resize_token_embeddings(self, new_vocab, **kwargs)

    def save_pretrained(self, path: str | Path, **kwargs) -> None:
        """Write the model in Hugging Face format (``config.json``, ``model.safetensors``);
        ``kwargs`` go to :func:`olmoflow.model.hf.save_hf_dir`.

        A bitsandbytes int8 model (``load_in_8bit=True``) saves its int8 weights with their
        scales, as ``transformers`` does, and :meth:`from_pretrained` loads them back as they
        are (bit-identical outputs).

        Raises:
            OlmoflowError: the model was quantized with torchao (``quantization="torchao"``);
                nothing is created. Save the unquantized model and quantize when loading.
        """
        from olmoflow.model.hf import save_hf_dir

        if getattr(self, "lora_settings", None) is not None:
            raise OlmoflowError("the model has LoRA adapters: merge them first "
                                "(olmoflow.model.lora.merge_lora, or 'olmoflow merge-lora')")
        save_hf_dir(self, path, **kwargs)


@torch.no_grad()
def resize_token_embeddings(model: Olmo, new_vocab: int, *, init_ids: Iterable[int] = (),
                            mean_of: int | None = None) -> int:
    """Grow the embedding and the (untied) LM head so that ``new_vocab`` ids fit; return the
    model's vocab size afterwards.

    The size is ``new_vocab`` padded up to ``config.vocab_pad_multiple`` (as a fresh model would
    be); a model that is already large enough keeps its size (never shrinks), its padding rows
    taking the new ids. Each new row, and each row in ``init_ids`` (ids of tokens just added that
    fell in the old padding), is set to the mean of the first ``mean_of`` rows (default: all old
    rows) of its matrix, as ``transformers``' ``resize_token_embeddings`` does: a new token starts
    as the average token instead of noise, so the first steps' loss does not spike. Padding rows
    never trained should be left out of the mean: pass ``mean_of=old tokenizer vocab``.
    ``model.config.vocab_size`` is updated; the weights keep their dtype and device.

    Raises:
        OlmoflowError: ``new_vocab`` or ``mean_of`` out of range, or an id in ``init_ids`` at or
            past the resulting vocab size.
    """
    old = model.config.vocab_size
    if new_vocab < 1:
        raise OlmoflowError(f"new vocab size must be positive, got {new_vocab}")
    mean_of = old if mean_of is None else mean_of
    if not 1 <= mean_of <= old:
        raise OlmoflowError(f"mean_of={mean_of} must be in 1..{old} (the current vocab size)")
    size = max(old, model.config.padded_vocab_size(new_vocab))
    rows = sorted({int(i) for i in init_ids} | set(range(old, size)))
    if rows and (rows[0] < 0 or rows[-1] >= size):
        raise OlmoflowError(f"token id {rows[0] if rows[0] < 0 else rows[-1]} is outside the "
                            f"vocabulary 0..{size - 1}")
    for module in (model.embeddings, model.lm_head):
        w = module.weight
        if size > old:
            grown = torch.empty(size, w.shape[1], dtype=w.dtype, device=w.device)
            grown[:old] = w
            module.weight = nn.Parameter(grown, requires_grad=w.requires_grad)
        if rows:
            mean = module.weight[:mean_of].float().mean(0).to(module.weight.dtype)
            module.weight[rows] = mean
    model.embeddings.num_embeddings = size
    model.lm_head.out_features = size
    model.config = replace(model.config, vocab_size=size)
    return size
