"""The post-training stages: ``sft``, ``dpo`` and ``rl``, each the pretraining
:class:`~olmoflow.train.trainer.Trainer` with another objective and loader.

Each stage starts from its ``base`` (see :mod:`olmoflow.posttrain.config`): by default the final
checkpoint of the run's previous training stage. It adds its chat template to the base's tokenizer
(the embedding grows with the template's special tokens), trains, and writes OLMo-named
checkpoints (``sft/sft-step100-tokens1M``) whose ``config.yaml`` holds the model it trained (so
``export hf``, ``evaluate`` and the next stage load them as they load pretraining's), the
tokenizer it trained with (``<stage>/tokenizer/``, chat template included) and a manifest naming
the base checkpoint, every data file with its sha256, and the resolved config.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from olmoflow.artifacts import StageResult, data_files
from olmoflow.errors import OlmoflowError
from olmoflow.model.load import Loaded, load_model
from olmoflow.pipeline.config import RunConfig, dump_config
from olmoflow.pipeline.models import previous_model_stage
from olmoflow.pipeline.stage import PREVIOUS_MODEL, Makes, Stage, Trains
from olmoflow.pipeline.stages.common import TOKENIZER, stage_dir
from olmoflow.train.config import bookkeeping_keys

log = logging.getLogger(__name__)


#: a post-training stage's starting model: what the one loader read (model, tokenizer, path,
#: kind, and the files read, whose sha256 go into the manifest).
Base = Loaded


def load_base(cfg: RunConfig, stage: str, spec: str | None = None) -> Base:
    """The model ``<stage>.base`` (or ``spec``) names; see :mod:`olmoflow.posttrain.config`.

    Raises:
        OlmoflowError: no such checkpoint, directory or cached Hub id; the previous stage has no
            checkpoint yet (the message names it); weights that do not load.
    """
    import torch

    from olmoflow.train.checkpoint import resolve_checkpoint

    spec = getattr(cfg, stage).base if spec is None else spec
    if not spec:
        prev = previous_model_stage(cfg, stage)
        folder = stage_dir(cfg, prev)
        try:
            path = resolve_checkpoint(folder, "latest")
        except OlmoflowError:
            raise OlmoflowError(f"{stage}: no model to start from: '{folder}' has no checkpoint; "
                                f"run 'olmoflow {prev}' first or set {stage}.base to a "
                                "checkpoint, Hugging Face directory or Hub id") from None
    else:
        path = spec  # a checkpoint, a Hugging Face directory or a Hub id
    return load_model(path, implementation=cfg.tokenizer.implementation, dtype=torch.float32)


# Plain text, code, non-ASCII and whitespace runs: two tokenizers that agree on all of it (and on
# the vocabulary size and special ids) are the same for any practical purpose.
_TOKENIZER_PROBE = ("The quick brown fox, 1234 + 5678 = 6912.\n\ndef f(x):\n    return x  # ok\n"
                    "héllo wörld 你好 🦙 \t  spaces   end")


def check_same_tokenizer(base: Base, other: Base, key: str) -> None:
    """Check that ``other`` (a reference model) reads token ids as ``base`` does: a reference
    with another tokenizer would score the base's token ids as other text, silently.

    Raises:
        OlmoflowError: the vocabularies, special ids or the encoding of a probe text differ
            (the message names ``key`` and both paths).
    """
    a, b = base.tokenizer, other.tokenizer
    same = (a.vocab_size == b.vocab_size and a.eos_token_id == b.eos_token_id
            and a.pad_token_id == b.pad_token_id
            and a.encode(_TOKENIZER_PROBE) == b.encode(_TOKENIZER_PROBE))
    if not same:
        raise OlmoflowError(f"{key}: '{other.path}' has another tokenizer than the base "
                            f"'{base.path}' (vocabulary {b.vocab_size} vs {a.vocab_size}); the "
                            "reference must share the base's tokenizer")


def seed_stage(cfg: RunConfig) -> None:
    """Seed every RNG (Python, NumPy, torch, CUDA) from the run's seed, first thing in a
    post-training stage, as pretraining seeds its model: two runs of one config are then
    bit-identical with dropout (``model.dropout``, ``<stage>.lora.dropout``), whatever ran before
    in the process; a resumed run takes the RNG state from its checkpoint."""
    from olmoflow.train.checkpoint import seed_all

    seed_all(cfg.seed)


def say(stage: str, message: str) -> None:
    """One line of what a stage found in its input (data counts, LoRA sizes), as the stage
    lines of the runner print (rank 0 only under torchrun)."""
    from olmoflow.train.distributed import is_main

    if is_main():
        print(f"[{stage}] {message}", flush=True)


def prepare_chat(base: Base, template: str) -> int:
    """Add ``template`` to the base's tokenizer and grow the model's embedding to fit; returns
    the number of tokens added (0 when the base already had the template)."""
    from olmoflow.tokenizer.chat import add_chat_template

    added = add_chat_template(base.tokenizer, template, base.model)
    if added:
        log.info("added %d special token(s) for the '%s' chat template", added, template)
    return added


def trained_config_yaml(cfg: RunConfig, model: Any) -> str:
    """The run config with ``model`` replaced by the model actually trained (the base's shape and
    grown vocabulary), as each checkpoint's ``config.yaml`` records it."""
    from olmoflow.model.hf import unwrap_model

    return dump_config(dataclasses.replace(cfg, model=unwrap_model(model).config))


def save_tokenizer(tokenizer: Any, out: Path) -> list[Path]:
    """Write the stage's tokenizer (with its chat template) to ``out/tokenizer``."""
    return tokenizer.save(out / TOKENIZER)


def base_stamp(stage: str):
    """A fingerprint part for ``stage``: the identity of an explicit base (its files' sha256);
    with no base the previous stage's manifest is an upstream of the fingerprint already."""
    def stamp(cfg: RunConfig) -> Any:
        from olmoflow.artifacts import sha256_file
        from olmoflow.model.hub import resolve_pretrained

        section = getattr(cfg, stage)
        parts: dict[str, Any] = {}
        spec = section.base
        if spec:
            root = resolve_pretrained(spec)
            parts["base"] = [[str(f), sha256_file(f)] for f in data_files(root)]
        data = getattr(section, "data", None)
        if data is not None:
            parts["data"] = [[p, sha256_file(p)] for p in data.paths if Path(p).is_file()]
        if getattr(section, "reference", ""):
            root = resolve_pretrained(section.reference)
            parts["reference"] = [[str(f), sha256_file(f)] for f in data_files(root)]
        parts["previous"] = previous_model_stage(cfg, stage) if not spec else None
        return parts

    return stamp


def train_posttrain(cfg: RunConfig, stage: str, base: Base, loader: Any, objective: Any,
                    progress: bool, callbacks: list | None = None) -> tuple[dict, Path]:
    """Train ``base.model`` with ``objective`` on ``loader`` under ``<stage>.train``; returns the
    trainer's summary and the stage directory."""
    import torch

    from olmoflow.train.trainer import Trainer

    section = getattr(cfg, stage)
    out = stage_dir(cfg, stage)
    model = base.model
    if torch.cuda.is_available():  # before LoRA: a quantized base is made on its device
        model = model.to("cuda")
    lora = getattr(section, "lora", None)
    if lora is not None and lora.enabled:
        from olmoflow.model.lora import LoraSettings, apply_lora, lora_report, write_lora_settings

        settings = LoraSettings(r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                                targets=tuple(lora.targets),
                                quantize=None if lora.quantize == "none" else lora.quantize)
        # The adapters' random init from the run's seed: two runs of one config train alike.
        gpus = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=gpus):
            torch.manual_seed(cfg.seed)
            model = apply_lora(model, settings)
        # beside the checkpoints: every reader of them (export, release, the next stage) wraps,
        # loads and merges
        write_lora_settings(out, settings)
        say(stage, f"LoRA: {lora_report(model)['text']}")
    trainer = Trainer(model, section.train, loader, out,
                      config_yaml=trained_config_yaml(cfg, base.model), progress=progress,
                      objective=objective, callbacks=callbacks or [],
                      resume_hint=f"{stage}.train.checkpoint.resume_from=latest")
    return trainer.fit(), out


def result_of(summary: dict, out: Path, base: Base, inputs: list[Path], tokenizer_files: list[Path],
              counts: dict[str, Any]) -> StageResult:
    """The stage's manifest entries: base and data files in, final checkpoint, log, tokenizer
    out."""
    from olmoflow.train.trainer import METRICS

    final = Path(summary["checkpoint"])
    outputs = data_files(final) + [out / METRICS, out / "latest"] + tokenizer_files
    # what the stage keeps beside its checkpoints: LoRA settings, the cached reference
    outputs += [out / n for n in ("lora.json", "reference_logps.safetensors",
                                  "reference_logps.json") if (out / n).is_file()]
    return StageResult(inputs=base.files + inputs, outputs=outputs,
                       counts={"base": str(base.path), **summary, **counts})


def data_counts(stats: Any, kept: str) -> dict[str, int]:
    """What the manifest counts of a stage's data (a :class:`~olmoflow.posttrain.data.DataStats`):
    the examples kept (under the name ``kept``), skipped (bad input or nothing to train on:
    ``skipped_no_targets`` and ``skipped_identical`` say how many of them, when any), truncated
    and dropped."""
    named = {"skipped_no_targets": len(stats.no_targets),
             "skipped_identical": len(stats.identical)}
    out = {kept: stats.kept, "skipped": len(stats.skipped) + sum(named.values()),
           "truncated": stats.truncated, "dropped": len(stats.dropped)}
    return {**out, **{k: v for k, v in named.items() if v}}


def run_sft(cfg: RunConfig, progress: bool) -> StageResult:
    """Supervised fine-tuning of the base on ``sft.data``."""
    from olmoflow.posttrain.sft import SFTLoader, SFTObjective, build_sft_data

    seed_stage(cfg)
    s = cfg.sft
    if not s.data.given:
        raise OlmoflowError("sft: no data; set sft.data.paths (JSONL of messages, Alpaca, "
                            "ShareGPT or text records), sft.data.processors or sft.data.generate")
    from olmoflow.posttrain.data import check_data_files

    check_data_files(s.data.paths, "sft.data.paths")  # before the (slow) base load
    base = load_base(cfg, "sft")
    prepare_chat(base, s.template)
    out = stage_dir(cfg, "sft")
    paths = list(s.data.paths) + generated_data(cfg, "sft", out)
    dataset, stats = build_sft_data(
        paths, s.data.processors, s.template, base.tokenizer, s.train.sequence_length,
        format=s.data.format, on_too_long=s.data.on_too_long, strict=s.data.strict,
        packing=s.packing, limit=s.data.limit)
    say("sft", f"data: {stats.summary()}; {dataset.summary()}")
    loader = SFTLoader(dataset, s.train.global_batch_size, seed=cfg.seed)
    tok_files = save_tokenizer(base.tokenizer, out)
    summary, out = train_posttrain(cfg, "sft", base, loader, SFTObjective(), progress)
    return result_of(summary, out, base, [Path(p) for p in paths], tok_files,
                     {**data_counts(stats, "examples"), "rows": len(dataset),
                      "packing_efficiency": round(dataset.packing_efficiency, 4)})


def generated_data(cfg: RunConfig, stage: str, out: Path) -> list[str]:
    """The files of ``<stage>.data.generate`` (built into the stage directory), or none."""
    gen = getattr(cfg, stage).data.generate
    if gen is None:
        return []
    from olmoflow.posttrain.demo_data import (
        heldout_stdlib_files,
        stdlib_subset,
        write_demo_sft_data,
    )

    # The files pretraining held out: instructions about code the model has not trained on.
    tokens = stage_dir(cfg, "tokenize")
    files = (heldout_stdlib_files(tokens) if (tokens / "meta.json").is_file() else
             stdlib_subset(seed=cfg.seed, fraction=cfg.tokenize.heldout_fraction))
    path = out / "data" / f"{gen}.jsonl"
    counts = write_demo_sft_data(path, files, seed=cfg.seed, limit=getattr(cfg, stage).data.limit,
                                 max_chars=4 * getattr(cfg, stage).train.sequence_length)
    say(stage, f"built {path.name}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    return [str(path)]


def posttrain_stage(name: str, run, help: str, headline: tuple[str, ...], *,
                    data: str = "", windows: bool = True) -> Stage:
    """The record of post-training stage ``name``: the run's config section ``name`` (its
    ``base``, ``train`` and data), trained from the model before it in the chain, with its own
    tokenizer (chat template) beside its checkpoints.

    Args:
        run: ``(cfg, progress) -> StageResult``.
        data: the dotted key of the data that makes the stage part of a run (default
            ``<name>.data``); its value's ``given`` says whether it is set.
        windows: it trains on windows of ``<name>.train.sequence_length`` (False: RL, whose
            windows are its prompts and ``max_new_tokens``).
    """
    data = data or f"{name}.data"

    def enabled(cfg: RunConfig) -> bool:
        node: Any = cfg
        for part in data.split("."):
            node = getattr(node, part)
        return bool(node.given)

    return Stage(name, run, (name, "seed", "tokenizer.implementation"), (), headline, help=help,
                 ignore=bookkeeping_keys(f"{name}.train"), stamp=base_stamp(name),
                 enabled=enabled, trains=Trains(resume_key=f"{name}.train.checkpoint.resume_from"),
                 makes=Makes(sequence_length=f"{name}.train.sequence_length" if windows else None,
                             data=data, own_tokenizer=True),
                 reads=PREVIOUS_MODEL)


def run_dpo(cfg: RunConfig, progress: bool) -> StageResult:
    """Preference tuning of the base on ``dpo.data`` against a frozen reference whose
    log-probabilities are computed once and cached in the stage directory."""
    import torch

    from olmoflow.artifacts import sha256_file, sha256_json
    from olmoflow.posttrain.dpo import (
        DPOObjective,
        PreferenceLoader,
        ReferenceCache,
        build_dpo_data,
    )

    seed_stage(cfg)
    d = cfg.dpo
    if not d.data.given:
        raise OlmoflowError("dpo: no data; set dpo.data.paths (HH-RLHF chosen/rejected, "
                            "prompt/chosen/rejected, ShareGPT or stack-exchange pairs)")
    from olmoflow.posttrain.data import check_data_files

    check_data_files(d.data.paths, "dpo.data.paths")
    base = load_base(cfg, "dpo")
    prepare_chat(base, d.template)
    out = stage_dir(cfg, "dpo")
    paths = list(d.data.paths)
    dataset, stats = build_dpo_data(
        paths, d.template, base.tokenizer, d.train.sequence_length, format=d.data.format,
        on_too_long=d.data.on_too_long, strict=d.data.strict, limit=d.data.limit)
    say("dpo", f"data: {stats.summary()}")
    reference_files: list[Path] = []
    if d.loss != "simpo":  # SimPO is reference-free
        ref = base if not d.reference else load_base(cfg, "dpo", d.reference)
        if ref is not base:
            prepare_chat(ref, d.template)
            check_same_tokenizer(base, ref, "dpo.reference")
        reference_files = ref.files
        # the reference is named by its files' content: a base retrained at the same path is
        # another reference
        identity = sha256_json([sha256_file(f) for f in ref.files])
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        ReferenceCache(out, identity).get(dataset, ref.model,
                                          batch_size=d.train.micro_batch_size, device=device)
        if ref is not base:
            del ref  # its weights are not needed again
    loader = PreferenceLoader(dataset, d.train.global_batch_size, seed=cfg.seed)
    objective = DPOObjective(loss_type=d.loss, beta=d.beta, label_smoothing=d.label_smoothing,
                             simpo_gamma=d.simpo_gamma)
    tok_files = save_tokenizer(base.tokenizer, out)
    summary, out = train_posttrain(cfg, "dpo", base, loader, objective, progress)
    return result_of(summary, out, base, [Path(p) for p in paths] + reference_files, tok_files,
                     data_counts(stats, "pairs"))


def rl_prompts(cfg: RunConfig) -> tuple[list, list]:
    """``(train, held-out)`` prompts of ``rl.prompts``: generated arithmetic (two disjoint
    splits), or a GSM8K / RLVR file whose last ``heldout`` prompts are held out."""
    from olmoflow.posttrain.data import DataStats
    from olmoflow.posttrain.rewards import arithmetic_prompts, read_prompts

    p = cfg.rl.prompts
    if p.source == "arithmetic":
        return (arithmetic_prompts(p.count, seed=cfg.seed, split="train", form=p.form),
                arithmetic_prompts(p.heldout, seed=cfg.seed, split="heldout", form=p.form)
                if p.heldout else [])
    stats = DataStats()
    prompts = read_prompts(p.path, strict=False, stats=stats)
    if stats.skipped:
        say("rl", f"prompts: {len(stats.skipped)} bad record(s) skipped, first: "
                  f"{stats.skipped[0]}")
    held = prompts[len(prompts) - p.heldout:] if p.heldout else []
    train = prompts[:len(prompts) - len(held)][:p.count]
    if not train:
        raise OlmoflowError(f"rl.prompts.path={p.path}: no prompts left to train on "
                            f"({len(prompts)} read, {len(held)} held out)")
    return train, held


def run_rl(cfg: RunConfig, progress: bool) -> StageResult:
    """GRPO with verifiable rewards from the base (RL-Zero when the base is a pretrained model
    with no SFT and ``rl.prompts.chat`` is false: prompts are plain text)."""
    from olmoflow.infer.sampling import SamplingParams
    from olmoflow.posttrain.grpo import GRPOObjective
    from olmoflow.posttrain.rollout import HeldOutReward, RolloutLoader
    from olmoflow.train.precision import autocast_dtype

    seed_stage(cfg)
    r = cfg.rl
    base = load_base(cfg, "rl")
    template = None
    if r.prompts.chat:
        prepare_chat(base, r.template)
        template = r.template
    out = stage_dir(cfg, "rl")
    train_prompts, heldout = rl_prompts(cfg)
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ref_model = None
    if r.kl_coef > 0:
        # The KL term's reference is the base as it starts: a frozen copy, on the device the
        # policy trains on (the policy moves there in train_posttrain).
        import copy

        ref_model = copy.deepcopy(base.model).eval().requires_grad_(False).to(device)
    loader = RolloutLoader(
        base.model, base.tokenizer, train_prompts, prompts_per_step=r.prompts_per_step,
        group_size=r.group_size, seed=cfg.seed, template=template,
        sampling=SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                top_p=r.top_p),
        scale="std" if r.scale_rewards else "none", ref_model=ref_model,
        autocast_dtype=autocast_dtype(r.train.precision, device))
    objective = GRPOObjective(clip_low=r.clip_low, clip_high=r.clip_high, kl_coef=r.kl_coef,
                              loss_type=r.loss_type, max_length=r.max_new_tokens)
    callbacks = ([HeldOutReward(r.eval_interval, base.tokenizer, heldout,
                                max_new_tokens=r.max_new_tokens, template=template)]
                 if heldout and r.eval_interval else [])
    tok_files = save_tokenizer(base.tokenizer, out)
    summary, out = train_posttrain(cfg, "rl", base, loader, objective, progress, callbacks)
    inputs = [Path(r.prompts.path)] if r.prompts.path else []
    return result_of(summary, out, base, inputs, tok_files,
                     {"prompts": len(train_prompts), "heldout_prompts": len(heldout)})


#: the post-training stages, in chain order: a new objective is its module (with its config
#: section), its section in :class:`~olmoflow.pipeline.config.RunConfig` and one row here.
POSTTRAIN = (
    posttrain_stage("sft", run_sft, "supervised fine-tuning on conversations (sft.data)",
                    ("examples", "steps", "final_loss")),
    posttrain_stage("dpo", run_dpo, "preference tuning (DPO, length-normalized DPO, SimPO) on "
                    "dpo.data", ("pairs", "steps", "final_loss")),
    posttrain_stage("rl", run_rl, "RL with verifiable rewards (GRPO) on rl.prompts",
                    ("prompts", "steps", "final_loss"), data="rl.prompts", windows=False),
)
