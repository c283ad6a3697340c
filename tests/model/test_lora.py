"""LoRA / QLoRA through peft: frozen base, merge back to a plain Olmo, Trainer checkpoints with
exact resume, merging a checkpoint into a Hugging Face directory, gradient checkpointing."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from tolerance import assert_fp32_close, forward_terms

from olmoflow.config import from_dict
from olmoflow.errors import OlmoflowError
from olmoflow.model.config import ModelConfig
from olmoflow.model.lora import (
    LoraSettings,
    apply_lora,
    is_lora,
    load_lora_state_dict,
    lora_report,
    lora_state_dict,
    merge_lora,
    merge_lora_files,
    parse_lora_settings,
    read_lora_settings,
    write_lora_settings,
)
from olmoflow.model.olmo import Olmo
from olmoflow.train.config import TrainConfig
from olmoflow.train.loader import DataLoader, InstanceDataset
from olmoflow.train.trainer import Trainer

pytest.importorskip("peft")

VOCAB, SEQ, D, HIDDEN, LAYERS = 64, 8, 32, 64, 2


def config() -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, d_model=D, n_layers=LAYERS, n_heads=2, mlp_hidden=HIDDEN,
                       max_sequence_length=64, sliding_window=None, vocab_pad_multiple=1)


def base_model(seed: int = 0) -> Olmo:
    torch.manual_seed(seed)
    return Olmo(config())


def randomize_adapters(model: Olmo, seed: int = 1) -> None:
    """B starts at zero (the adapted model equals the base): give it values, as training would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for k, v in lora_state_dict(model).items():
            if "lora_B" in k:
                v.copy_(torch.randn(v.shape, generator=g) * 0.05)


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


# --- settings ------------------------------------------------------------------------------------


def test_settings_canonical_names_and_errors():
    s = LoraSettings(targets=("q_proj", "w_k", "v", "gate_proj", "q"))
    assert s.targets == ("q", "k", "v", "gate")
    assert from_dict(LoraSettings, s.to_dict()) == s
    with pytest.raises(OlmoflowError, match="unknown LoRA target 'gaet'; did you mean 'gate'"):
        LoraSettings(targets=("gaet",))
    with pytest.raises(OlmoflowError, match="r must be a positive integer"):
        LoraSettings(r=0)
    with pytest.raises(OlmoflowError, match="did you mean '4bit'"):
        LoraSettings(quantize="4bits")
    with pytest.raises(OlmoflowError, match="x.json: unknown LoRA setting 'alpah'; did you mean "
                                            "'alpha'"):
        parse_lora_settings({"alpah": 4}, "x.json")


def test_settings_file_roundtrip_and_errors(tmp_path):
    s = LoraSettings(r=4, alpha=8, targets=("q", "v"))
    write_lora_settings(tmp_path, s)
    step = tmp_path / "sft-step3-tokens96"
    step.mkdir()
    assert read_lora_settings(step) == s  # found in the save folder above the step directory
    assert read_lora_settings(tmp_path / "lora.json") == s
    with pytest.raises(OlmoflowError, match="no lora.json in"):
        read_lora_settings(tmp_path / "elsewhere" / "step1")
    (tmp_path / "lora.json").write_text(json.dumps({"r": 4, "targts": ["q"]}))
    with pytest.raises(OlmoflowError, match=r"lora.json: unknown LoRA setting 'targts'; did you "
                                            r"mean 'targets'"):
        read_lora_settings(step)


# --- apply / report / merge ----------------------------------------------------------------------


def test_apply_freezes_the_base_and_starts_equal_to_it():
    model = base_model()
    base_params = model.num_params()
    x = tokens()
    reference = model(x).logits
    out = apply_lora(model, LoraSettings(r=4, targets=("q", "o", "down")))
    assert out is model and isinstance(out, Olmo) and is_lora(model)
    assert len(model.blocks) == LAYERS  # activation checkpointing and compile walk these
    assert torch.equal(model(x).logits, reference)  # B = 0: the update is exactly zero
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # q: D -> D, o: D -> D, down: HIDDEN -> D; each adapter has r * (in + out) parameters
    expected = LAYERS * 4 * ((D + D) + (D + D) + (HIDDEN + D))
    report = lora_report(model)
    assert report["trainable_params"] == expected
    assert report["total_params"] == base_params + expected
    assert report["trainable_share"] == pytest.approx(expected / (base_params + expected))
    assert report["trainable_bytes"] == 4 * expected  # fp32
    assert report["frozen_bytes"] == 4 * base_params
    assert report["param_bytes"] == 4 * (base_params + expected)
    assert "trainable%" in report["text"]
    with pytest.raises(OlmoflowError, match="already has LoRA adapters"):
        apply_lora(model, LoraSettings())


def test_merge_gives_a_plain_olmo_with_the_same_logits():
    model = base_model()
    base_keys = list(model.state_dict())
    apply_lora(model, LoraSettings(r=4, alpha=32))
    randomize_adapters(model)
    x = tokens()
    wrapped = model(x).logits.detach()
    assert not torch.equal(wrapped, base_model()(x).logits)  # the adapters change the model
    merged = merge_lora(model)
    assert isinstance(merged, Olmo) and not is_lora(merged)
    assert list(merged.state_dict()) == base_keys
    assert all(p.requires_grad for p in merged.parameters())
    assert_fp32_close(merged(x).logits, wrapped, forward_terms(config(), SEQ))
    with pytest.raises(OlmoflowError, match="no LoRA adapters to merge"):
        merge_lora(merged)


def test_adapter_state_dict_roundtrip():
    model = apply_lora(base_model(), LoraSettings(r=4))
    randomize_adapters(model)
    state = {k: v.clone() for k, v in lora_state_dict(model).items()}
    assert state and all(".lora_" in k for k in state)
    assert sum(v.numel() for v in state.values()) == lora_report(model)["trainable_params"]
    other = apply_lora(base_model(), LoraSettings(r=4))
    load_lora_state_dict(other, state)
    x = tokens()
    assert torch.equal(other(x).logits, model(x).logits)
    with pytest.raises(OlmoflowError, match="do not match"):
        load_lora_state_dict(apply_lora(base_model(), LoraSettings(r=2)), state)


# --- training, checkpoints, merge-lora ----------------------------------------------------------


class Stop(Exception):
    pass


def lora_trainer(folder, *, max_steps=6, resume=None, settings=None, stop_at=None) -> Trainer:
    tree = {"sequence_length": SEQ, "global_batch_size": 4, "micro_batch_size": 2,
            "max_steps": max_steps, "optimizer": {"lr": 1e-2}, "schedule": {"warmup_steps": 1},
            "checkpoint": {"save_interval": 3, **({"resume_from": resume} if resume else {})},
            "log": {"interval": 1}, "num_threads": 1}
    cfg = from_dict(TrainConfig, tree, "train.")
    arrays = [np.tile(np.arange(16, dtype=np.uint16), 20)]
    loader = DataLoader(InstanceDataset(arrays, SEQ), cfg.global_batch_size, seed=3)
    if stop_at is not None:  # a run stopped while fetching the batch of step stop_at
        fetch, calls = loader.next_batch, []

        def next_batch():
            calls.append(1)
            if len(calls) == stop_at:
                raise Stop
            return fetch()

        loader.next_batch = next_batch
    model = apply_lora(base_model(), settings or LoraSettings(r=4, dropout=0.1))
    return Trainer(model, cfg, loader, folder, progress=False)


@pytest.mark.parametrize("quantize", [None, "4bit", "8bit"])
def test_trainer_trains_adapters_only_and_resumes_bit_exactly(tmp_path, quantize):
    if quantize:
        pytest.importorskip("bitsandbytes")
    settings = LoraSettings(r=4, dropout=0.1, quantize=quantize)
    straight = lora_trainer(tmp_path / "straight", settings=settings)
    base = {k: v.clone() for k, v in straight.model.state_dict().items()}
    straight.fit()
    after = straight.model.state_dict()
    for k, v in base.items():  # frozen base, moving adapters (lora_B starts at zero)
        assert torch.equal(after[k], v) == (".lora_" not in k), k
    with pytest.raises(Stop):
        lora_trainer(tmp_path / "resumed", stop_at=5, settings=settings).fit()
    assert "step3" in (tmp_path / "resumed" / "latest").read_text()
    resumed = lora_trainer(tmp_path / "resumed", resume="latest", settings=settings)
    resumed.fit()
    assert resumed.step == 6
    final = resumed.model.state_dict()
    assert list(final) == list(after)  # the wrapped model's keys are stable between runs
    for k in after:
        assert torch.equal(final[k], after[k]), k


@pytest.mark.parametrize("quantize", [None, "4bit"])
def test_merge_lora_files_writes_a_loadable_hf_dir(tmp_path, quantize):
    if quantize:
        pytest.importorskip("bitsandbytes")
    settings = LoraSettings(r=4, alpha=8, targets=("q", "v", "up"), quantize=quantize)
    t = lora_trainer(tmp_path / "run", max_steps=3, settings=settings)
    t.fit()
    write_lora_settings(tmp_path / "run", settings)
    step = t.saved[1]
    x = tokens()
    wrapped = t.model.eval()(x).logits.detach()
    out = merge_lora_files(step, tmp_path / "hf", load_model=lambda: base_model(seed=5))
    assert (out / "config.json").is_file()
    back = Olmo.from_pretrained(out)
    assert set(back.state_dict()) == set(base_model().state_dict())
    # Another base was built: the checkpoint's weights replaced it. The files hold what merging
    # the live model gives.
    live = merge_lora(t.model).state_dict()
    for k, v in back.state_dict().items():
        assert_fp32_close(v, live[k], 2 * settings.r, msg=k)
    if quantize:  # bitsandbytes' kernels ran the wrapped model
        torch.testing.assert_close(back(x).logits, wrapped, rtol=0, atol=1e-4)
    else:
        assert_fp32_close(back(x).logits, wrapped, forward_terms(config(), SEQ))
    with pytest.raises(OlmoflowError, match="cannot load .* as a LoRA checkpoint"):
        merge_lora_files(step, tmp_path / "hf2", load_model=base_model,
                         settings=LoraSettings(r=2, targets=("q", "v", "up"), quantize=quantize))


# --- QLoRA ---------------------------------------------------------------------------------------


def test_qlora_without_bitsandbytes_is_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import raises ImportError
    with pytest.raises(OlmoflowError, match=r"quantize='4bit' \(QLoRA\) needs bitsandbytes") as e:
        apply_lora(base_model(), LoraSettings(quantize="4bit"))
    assert "\n" not in str(e.value)


def test_qlora_without_a_backend_for_the_device_is_a_one_line_error(monkeypatch):
    pytest.importorskip("bitsandbytes")
    import olmoflow.model.lora as lora

    def no_backend(*args):
        raise RuntimeError("no kernel for this device\nmore")

    monkeypatch.setattr(lora, "_quantized_linear", no_backend)
    with pytest.raises(OlmoflowError, match="cannot quantize on cpu here .no kernel for this "
                                            "device.; use a GPU") as e:
        apply_lora(base_model(), LoraSettings(quantize="8bit"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("quantize", ["4bit", "8bit"])
def test_qlora_trains_and_merges(quantize):
    pytest.importorskip("bitsandbytes")
    model = base_model()
    full = lora_report(model)["param_bytes"]
    apply_lora(model, LoraSettings(r=4, quantize=quantize))
    report = lora_report(model)
    assert report["frozen_bytes"] < full / 2  # 1 or 0.5 bytes per block weight, not 4
    x = tokens()
    model(x, x).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(".lora_" in n for n in grads)
    randomize_adapters(model)
    wrapped = model(x).logits.detach()
    keys = list(base_model().state_dict())
    merged = merge_lora(model)
    assert list(merged.state_dict()) == keys
    assert all(p.dtype == torch.float32 for p in merged.parameters())
    # the merged weights are the dequantized base plus the update: what the wrapped model ran
    # (bitsandbytes' own kernels compute it in another order)
    torch.testing.assert_close(merged(x).logits, wrapped, rtol=0, atol=1e-4)


# --- gradient checkpointing ----------------------------------------------------------------------


def loss_and_grads(model: Olmo) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    x = tokens(3)
    loss = model(x, x).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_same_loss_and_grads(lora):
    model = base_model().train()
    if lora:
        apply_lora(model, LoraSettings(r=4))
        randomize_adapters(model)
    calls = []
    model.blocks[0].feed_forward.register_forward_hook(lambda *a: calls.append(1))
    loss, grads = loss_and_grads(model)
    assert len(calls) == 1
    model.gradient_checkpointing_enable({"use_reentrant": False})
    assert model.activation_checkpointing == 1
    calls.clear()
    loss_ckpt, grads_ckpt = loss_and_grads(model)
    assert len(calls) == 2  # recomputed in backward
    terms = forward_terms(config(), SEQ, tokens=2 * SEQ)
    assert_fp32_close(loss_ckpt, loss, terms)
    assert grads.keys() == grads_ckpt.keys() and grads
    for n in grads:
        assert_fp32_close(grads_ckpt[n], grads[n], terms, msg=n)
    model.gradient_checkpointing_disable()
    calls.clear()
    loss_and_grads(model)
    assert model.activation_checkpointing == 0 and len(calls) == 1


def test_gradient_checkpointing_kwargs_errors():
    model = base_model()
    model.gradient_checkpointing_enable({"every": 2})
    assert model.activation_checkpointing == 2
    with pytest.raises(OlmoflowError, match="unknown gradient_checkpointing_kwargs"):
        model.gradient_checkpointing_enable({"preserve_rng": True})
    with pytest.raises(OlmoflowError, match="positive integer"):
        model.gradient_checkpointing_enable({"every": 0})
