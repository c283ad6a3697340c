"""train.compile: torch.compile per block trains like eager, and its checkpoints are plain ones."""

from __future__ import annotations

import pytest
import torch
from resume_helpers import (
    SEQ,
    build_model,
    make_trainer,
    read_metrics,
    tiny_model_config,
    train_config,
)
from tolerance import forward_terms, fp32_rel

from olmoflow.model.checkpoint_files import load_weights as load_model
from olmoflow.train.checkpoint import resolve_checkpoint


def test_compiled_blocks_train_like_eager_and_save_plain_checkpoints(tmp_path):
    eager = make_trainer(tmp_path / "eager", 16, 0.0, max_steps=3, checkpoint__save_interval=0)
    eager.fit()
    compiled = make_trainer(tmp_path / "compiled", 16, 0.0, max_steps=3,
                            checkpoint__save_interval=0, compile=True)
    assert all(hasattr(b, "_compiled_call_impl") and b._compiled_call_impl is not None
               for b in compiled.model.blocks), "every block is compiled"
    compiled.fit()
    a, b = read_metrics(tmp_path / "eager"), read_metrics(tmp_path / "compiled")
    # Fused kernels sum in another order and vectorise exp/rsqrt with their own roundings: within
    # two fp32 ulps per accumulated term of the loss (tolerance.py); the training is the same.
    cfg = train_config()
    rel = fp32_rel(forward_terms(tiny_model_config(), SEQ, tokens=cfg.global_batch_size * SEQ), 2)
    for step in (1, 2, 3):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=rel, abs=0), step
    # The checkpoint loads into a plain (uncompiled) model: no "_orig_mod." in its keys.
    plain = build_model(seed=1)
    load_model(resolve_checkpoint(tmp_path / "compiled", "latest"), plain)
    for name, p in compiled.model.named_parameters():
        assert "_orig_mod" not in name
        torch.testing.assert_close(dict(plain.named_parameters())[name], p.detach(), rtol=0, atol=0)
