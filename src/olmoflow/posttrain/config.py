"""Config sections of post-training (``sft``, ``dpo``, ``rl``), each beside its stage's code.

Every post-training stage names its starting model (``base``), its data, and its own ``train``
section (a full :class:`~olmoflow.train.config.TrainConfig`: optimizer, schedule, checkpoints,
batch sizes), with defaults of the kind open-instruct uses for each objective rather than
pretraining's. A key a user leaves out keeps the stage's default (the YAML is merged over it).

``base``: empty for the run's previous model (the last enabled training stage before this one:
``pretrain``, then ``sft``, then ``dpo``), else a checkpoint directory (``run/pretrain/stage1-
step450-tokens2M``, or its folder with a ``latest`` pointer), a Hugging Face directory or release,
or a Hub id (``allenai/OLMo-2-0425-1B``, resolved from the local Hugging Face cache unless network
access is allowed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from olmoflow.errors import OlmoflowError, unknown_name_error
from olmoflow.model.config import LORA_TARGET_ALIASES, LORA_TARGETS
from olmoflow.train.config import CheckpointConfig, OptimizerConfig, ScheduleConfig, TrainConfig

TOO_LONG = ("truncate", "drop")
GENERATORS = ("stdlib_docstrings",)
DPO_LOSS_TYPES = ("sigmoid", "length_normalized", "simpo")
GRPO_NORMALIZATIONS = ("token", "sequence", "constant")
ARITHMETIC_FORMS = ("question", "bare", "doctest")
RL_SOURCES = ("arithmetic", "gsm8k", "jsonl")
LORA_QUANTIZE = ("none", "8bit", "4bit")


def _check_template(name: str, key: str) -> None:
    from olmoflow.tokenizer.chat import ALIASES, TEMPLATES

    if name not in TEMPLATES and name not in ALIASES:
        raise unknown_name_error(key, name, [*TEMPLATES, *ALIASES])


def _check_positive(section: Any, prefix: str, keys: tuple[str, ...]) -> None:
    for key in keys:
        v = getattr(section, key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
            raise OlmoflowError(f"{prefix}.{key} must be > 0, got {v!r}")


@dataclass
class DataConfig:
    """``<stage>.data``: where a post-training stage's examples come from.

    ``paths``: JSONL / JSON / gzipped files in any of the formats of
    :mod:`olmoflow.posttrain.data` (detected per record unless ``format`` forces one).
    ``processors``: a user's own data classes, as OLMo's docs plug them in: ``{name: {class:
    module.Class, ...keyword arguments}}``, a class whose items are dicts with ``text`` or
    ``messages``. ``generate``: data the run builds itself (``stdlib_docstrings``: a held-out
    standard-library function's docstring as the instruction, its code as the response).
    ``limit``: the first N examples (null: all). ``on_too_long``: ``truncate`` (whole turns
    removed, never the end-of-turn marker) or ``drop``. ``strict``: a bad record is an error
    (file and line named) instead of skipped and counted.
    """

    paths: list[str] = field(default_factory=list)
    format: str | None = None
    processors: dict[str, dict[str, Any]] = field(default_factory=dict)
    generate: str | None = None
    limit: int | None = None
    on_too_long: str = "truncate"
    strict: bool = False

    def __post_init__(self) -> None:
        import os

        if self.on_too_long not in TOO_LONG:
            raise unknown_name_error("data.on_too_long", self.on_too_long, TOO_LONG)
        if self.generate is not None and self.generate not in GENERATORS:
            raise unknown_name_error("data.generate", self.generate, GENERATORS)
        if self.limit is not None and (isinstance(self.limit, bool) or self.limit < 1):
            raise OlmoflowError(f"data.limit must be >= 1 examples (or null: all), got "
                                f"{self.limit}")
        for name, spec in self.processors.items():
            if not isinstance(spec, dict) or not isinstance(spec.get("class"), str):
                raise OlmoflowError(f"data.processors.{name} needs a 'class: module.Class' entry")
        out = []
        for p in self.paths:
            if not str(p).strip():
                raise OlmoflowError("data.paths has an empty path")
            out.append(os.path.abspath(os.path.expanduser(str(p))))
        self.paths = out

    @property
    def given(self) -> bool:
        """Whether any data is named (the stage is part of the run only then)."""
        return bool(self.paths or self.processors or self.generate)


@dataclass
class LoraConfig:
    """``<stage>.lora``: train low-rank adapters instead of every weight (``r`` 0: off).

    ``targets`` are the projections adapted (``q k v o`` attention, ``gate up down`` MLP);
    ``quantize`` loads the frozen base in 8 or 4 bits (QLoRA, bitsandbytes on a GPU).
    """

    r: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["q", "k", "v", "o", "gate", "up", "down"])
    quantize: str = "none"

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or self.r < 0:
            raise OlmoflowError(f"lora.r must be >= 0 (0: off), got {self.r}")
        if self.quantize not in LORA_QUANTIZE:
            raise unknown_name_error("lora.quantize", self.quantize, LORA_QUANTIZE)
        if not 0 <= self.dropout < 1:
            raise OlmoflowError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.alpha, bool) or not self.alpha > 0:
            raise OlmoflowError(f"lora.alpha must be > 0 (the scale is alpha / r), got "
                                f"{self.alpha}")
        valid = tuple(LORA_TARGETS)
        if isinstance(self.targets, str):  # "lora.targets=q": one name, not its characters
            self.targets = [self.targets]
        if not self.targets:
            raise OlmoflowError(f"lora.targets must name at least one of {', '.join(valid)}")
        canon: list[str] = []
        for t in self.targets:
            # peft's names (q_proj) and our module names (w_q) as LoraSettings takes them
            name = t if t in LORA_TARGETS else LORA_TARGET_ALIASES.get(t)
            if name is None:
                raise unknown_name_error("lora.targets", t, valid)
            if name not in canon:
                canon.append(name)
        self.targets = canon

    @property
    def enabled(self) -> bool:
        return self.r > 0


def _train(lr: float, steps: int, batch: int, stage: str, warmup: int = 10,
           save_interval: int = 50) -> TrainConfig:
    """A stage's default ``train`` section: AdamW without weight decay, linear decay to zero after
    a short warmup (open-instruct's finetuning schedule), checkpoints named after the stage."""
    return TrainConfig(
        max_steps=steps, global_batch_size=batch, micro_batch_size=batch, sequence_length=1024,
        optimizer=OptimizerConfig(lr=lr, weight_decay=0.0),
        schedule=ScheduleConfig(type="linear", warmup_steps=warmup, min_lr_ratio=0.0),
        checkpoint=CheckpointConfig(save_interval=save_interval, stage=stage))


@dataclass
class SFTConfig:
    """``sft``: supervised fine-tuning on conversations (loss on assistant tokens only).

    ``template``: the chat template (``tulu``/``olmo2``, ``olmo3``, ``plain``) added to the
    tokenizer, the embedding growing with its special tokens. ``packing``: best-fit packing of
    whole examples with intra-document masking (false: one example per row, padded).
    ``train.sequence_length`` is the longest example; ``train.global_batch_size`` counts rows.
    """

    base: str = ""
    template: str = "tulu"
    data: DataConfig = field(default_factory=DataConfig)
    packing: bool = True
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=lambda: _train(2e-5, 100, 8, "sft"))

    def __post_init__(self) -> None:
        _check_template(self.template, "sft.template")
        if not isinstance(self.packing, bool):
            raise OlmoflowError(f"sft.packing must be true or false, got {self.packing!r}")


@dataclass
class DPOConfig:
    """``dpo``: direct preference optimisation on chosen/rejected pairs.

    ``loss``: ``sigmoid`` (Rafailov et al. 2023, with ``label_smoothing`` for cDPO),
    ``length_normalized`` (log-probabilities averaged per token, as OLMo 2/3 ran it with beta 5)
    or ``simpo`` (Meng et al. 2024; reference-free, margin ``simpo_gamma``). The reference model
    is ``reference`` (empty: the base), frozen; its log-probabilities are computed once and
    cached with the run. ``train.sequence_length`` bounds prompt + the longer response.
    """

    base: str = ""
    reference: str = ""
    template: str = "tulu"
    data: DataConfig = field(default_factory=DataConfig)
    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=lambda: _train(5e-7, 100, 8, "dpo"))

    def __post_init__(self) -> None:
        _check_template(self.template, "dpo.template")
        if self.loss not in DPO_LOSS_TYPES:
            raise unknown_name_error("dpo.loss", self.loss, DPO_LOSS_TYPES)
        _check_positive(self, "dpo", ("beta",))
        if self.simpo_gamma < 0:
            raise OlmoflowError(f"dpo.simpo_gamma must be >= 0 (SimPO's target reward margin), "
                                f"got {self.simpo_gamma}")
        if not 0 <= self.label_smoothing < 0.5:
            raise OlmoflowError(f"dpo.label_smoothing must be in [0, 0.5), got "
                                f"{self.label_smoothing}")


@dataclass
class RLPromptsConfig:
    """``rl.prompts``: prompts with verifiable answers (the ``rl`` stage is part of the run only
    when ``source`` is set).

    ``source``: ``arithmetic`` (generated two-number sums and differences, seeded; ``count``
    of them, a disjoint ``heldout`` set for the held-out reward; ``form``: ``question`` "What is
    a + b?", ``bare`` "a+b=", ``doctest`` ">>> a + b"), ``gsm8k`` (``path`` to GSM8K JSONL:
    ``question``, ``answer`` ending ``#### N``) or ``jsonl`` (``path``: ``prompt`` or ``messages``
    with ``answer``/``ground_truth``); the file's last ``heldout`` prompts are held out.
    ``chat``: prompts go through ``rl.template`` as a user turn (false: plain text, RL-Zero).
    """

    source: str | None = None
    path: str | None = None
    count: int = 2000
    heldout: int = 100
    form: str = "question"
    chat: bool = False

    def __post_init__(self) -> None:
        if self.form not in ARITHMETIC_FORMS:
            raise unknown_name_error("rl.prompts.form", self.form, ARITHMETIC_FORMS)
        if self.source is not None and self.source not in RL_SOURCES:
            raise unknown_name_error("rl.prompts.source", self.source, RL_SOURCES)
        if self.source in ("gsm8k", "jsonl") and not self.path:
            raise OlmoflowError(f"rl.prompts.source={self.source} needs rl.prompts.path")
        _check_positive(self, "rl.prompts", ("count",))
        if self.heldout < 0:
            raise OlmoflowError(f"rl.prompts.heldout must be >= 0, got {self.heldout}")

    @property
    def given(self) -> bool:
        """Whether prompts are named (the ``rl`` stage is part of the run only then)."""
        return self.source is not None


@dataclass
class RLConfig:
    """``rl``: reinforcement learning with verifiable rewards (GRPO, Shao et al. 2024, as
    open-instruct runs it for OLMo 3): ``group_size`` samples per prompt from the current policy,
    ``prompts_per_step`` prompts per optimizer step, advantage = reward minus the group mean
    (divided by the group's std unless ``scale_rewards`` is false), groups of equal rewards
    dropped, a token-level objective clipped to ``[1 - clip_low, 1 + clip_high]`` normalised as
    ``loss_type`` says (``token``: over the global batch's response tokens, open-instruct's
    default), no KL term unless ``kl_coef`` > 0; held-out greedy pass@1 every ``eval_interval``
    steps. Starting from a base model with no SFT, it is RL-Zero.
    """

    base: str = ""
    template: str = "tulu"
    prompts: RLPromptsConfig = field(default_factory=RLPromptsConfig)
    group_size: int = 8
    prompts_per_step: int = 8
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.272
    kl_coef: float = 0.0
    scale_rewards: bool = True
    loss_type: str = "token"
    eval_interval: int = 10
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=lambda: _train(1e-6, 100, 64, "rl", warmup=0))

    def __post_init__(self) -> None:
        _check_template(self.template, "rl.template")
        _check_positive(self, "rl", ("group_size", "prompts_per_step", "max_new_tokens",
                                     "temperature", "top_p"))
        if self.group_size < 2:
            raise OlmoflowError(f"rl.group_size must be >= 2 (advantages compare samples of one "
                                f"prompt), got {self.group_size}")
        if not 0 <= self.clip_low < 1 or self.clip_high < 0 or self.kl_coef < 0:
            raise OlmoflowError("rl.clip_low must be in [0, 1), rl.clip_high and rl.kl_coef >= 0")
        if self.loss_type not in GRPO_NORMALIZATIONS:
            raise unknown_name_error("rl.loss_type", self.loss_type, GRPO_NORMALIZATIONS)
        if self.eval_interval < 0:
            raise OlmoflowError(f"rl.eval_interval must be >= 0 (0: off), got "
                                f"{self.eval_interval}")
