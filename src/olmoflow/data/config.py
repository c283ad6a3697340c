"""Config sections of the data path: the main flow's collect, clean and tokenize, and the data
engine's whole config (:class:`DataConfig`: sources, quality, taggers, dedup, decontaminate, mixer,
tokenize), parsed by the one parser of run configs (:func:`olmoflow.config.from_dict`). The
sections of dedup, decontaminate and the mixer live beside their code (:class:`DedupConfig`,
:class:`DecontamConfig`, :class:`MixConfig`) and check their values in ``__post_init__``."""

from __future__ import annotations

import dataclasses
import os
import reprlib
from dataclasses import dataclass, field
from typing import Any

from olmoflow.config import (
    ConfigValueError,
    all_keys,
    check_int64,
    from_dict,
    load_tree,
    note_renamed,
)
from olmoflow.data.decontam import DecontamConfig
from olmoflow.data.dedup import DedupConfig
from olmoflow.data.mixer import MixConfig
from olmoflow.data.read_base import SourceOptions
from olmoflow.errors import OlmoflowError, unknown_name_error

#: The longest directory name most file systems allow, in bytes (a source name becomes one).
NAME_MAX = 255


@dataclass
class CollectConfig:
    """Where documents come from.

    ``sources`` entries are ``"stdlib"`` (the running Python's standard library: module sources
    without test suites, plus the prose of ``pydoc_data.topics``), ``hf://name[:config]/split`` (a
    local Hugging Face dataset directory), or a file, directory or glob of ``.txt``, JSONL
    (``.jsonl``, ``.jsonl.gz``, ``.json.gz``, ``.jsonl.zst``), ``.parquet`` or WARC (``.warc``,
    ``.warc.gz``) files (see :mod:`olmoflow.data.readers`). ``strict`` turns skipped bad input
    (malformed lines, damaged files, empty files) into errors. A symbolic link in a directory or
    glob that leads outside it is skipped (counted, one warning) unless ``follow_symlinks``.
    """

    sources: list[str] = field(default_factory=lambda: ["stdlib"])
    text_field: str = "text"
    strict: bool = False
    max_documents: int | None = None
    follow_symlinks: bool = False


@dataclass
class CleanConfig:
    """Document filters: length bounds in characters (after stripping), the data engine's
    taggers and rules, and exact deduplication.

    ``taggers`` are the engine's (:mod:`olmoflow.data.taggers`: built-in ones or any registered
    with ``@register_tagger`` in a module of ``plugins``, which are imported when clean runs);
    ``exclude`` rules over their attributes, in the mixer's syntax (``"gopher__word_count < 50"``,
    :mod:`olmoflow.data.rules`), drop a document when one holds. None by default.

    Raises:
        OlmoflowError: ``min_chars`` below 0, ``max_chars`` below ``min_chars``, a rule that does
            not parse, or a built-in tagger's bad option.
    """

    min_chars: int = 64
    max_chars: int = 1_000_000
    dedup: bool = True
    taggers: list[Any] = field(default_factory=list)
    plugins: list[str] = field(default_factory=list)
    exclude: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        from olmoflow.data.rules import parse_rule
        from olmoflow.data.taggers import check_taggers

        rules = []
        for i, r in enumerate(self.exclude):
            try:
                rules.append(parse_rule(r, f"exclude[{i}]"))
            except OlmoflowError as e:  # parse_rule's message begins with its "where"
                where, _, problem = str(e).partition(": ")
                raise ConfigValueError(where, problem) from None
        self.exclude = rules
        try:
            check_taggers(self.taggers, known_only=True)  # plugins' names once they are imported
        except OlmoflowError as e:
            text = str(e)
            raise OlmoflowError(f"clean.{text}" if text.startswith("taggers")
                                else f"clean.taggers: {text}") from None
        # Checked when the config is loaded, before a rerun touches the stage's finished output.
        if self.min_chars < 0:
            raise OlmoflowError(f"clean.min_chars must be >= 0, got {self.min_chars}")
        if self.max_chars < self.min_chars:
            raise OlmoflowError(f"clean.max_chars ({self.max_chars}) is below clean.min_chars "
                                f"({self.min_chars})")


@dataclass
class TokenizeConfig:
    """Token arrays and the held-out split (whole documents, chosen by a seeded hash of the id).

    Raises:
        OlmoflowError: ``heldout_fraction`` outside [0, 1] (NaN included), or
            ``heldout_max_documents`` below 0.
    """

    heldout_fraction: float = 0.02
    heldout_max_documents: int = 200

    def __post_init__(self) -> None:
        # Checked when the config is loaded, before a rerun touches the stage's finished output;
        # written so that NaN fails too.
        if not 0.0 <= self.heldout_fraction <= 1.0:
            raise OlmoflowError(
                f"tokenize.heldout_fraction must be in [0, 1], got {self.heldout_fraction}")
        if self.heldout_max_documents < 0:
            raise OlmoflowError(f"tokenize.heldout_max_documents must be >= 0, got "
                                f"{self.heldout_max_documents}")


# ---- the data engine -----------------------------------------------------------------------------


@dataclass
class SourceConfig:
    """One named source: files, directories or globs (relative to the current directory) read
    by the reader their suffix names (``.txt``, ``.jsonl[.gz|.zst]``, ``.json.gz``, ``.parquet``,
    ``.warc[.gz]``), ``stdlib``, or ``hf://name[:config]/split``. ``options`` go to the reader
    (:class:`~olmoflow.data.read_base.SourceOptions`: e.g. ``text_field``, ``max_shard_bytes``),
    but for ``follow_symlinks``: true reads the files behind symbolic links that lead out of a
    source directory, which are skipped otherwise."""

    name: str = ""
    paths: list[str] = field(default_factory=list)
    options: SourceOptions = field(default_factory=SourceOptions)


@dataclass
class QualityConfig:
    """Train the fastText quality classifier before tagging (when ``labeled`` is given): DCLM-style
    ``{text, label}`` JSONL files; the model goes to ``DIR/quality`` and the ``quality`` tagger
    uses it. ``options`` go to ``train_quality``."""

    labeled: list[str] = field(default_factory=list)
    model: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class TokenizeStepConfig:
    """Token arrays: ``tokenizer`` is a directory with ``tokenizer.json`` (e.g. from
    ``olmoflow train-tokenizer`` or an OLMo release); when None, a tokenizer of
    ``implementation`` and ``vocab_size`` is trained on the mixed documents into
    ``DIR/tokenizer`` (the main flow's trainer). The held-out split follows the main flow's rule:
    whole documents with ``heldout_score(seed, id) < heldout_fraction``, at most
    ``heldout_max_documents``.

    Raises:
        ConfigValueError: ``vocab_size`` below 1, ``min_frequency`` or ``heldout_max_documents``
            below 0, ``heldout_fraction`` outside [0, 1] (NaN included), ``workers`` below 1.
    """

    tokenizer: str | None = None
    implementation: str = "bpe"
    vocab_size: int = 8192
    min_frequency: int = 2
    dtype: str = "auto"
    workers: int | None = None
    seed: int = 0
    heldout_fraction: float = 0.02
    heldout_max_documents: int = 200

    def __post_init__(self) -> None:
        check_int64(self)
        if self.vocab_size < 1:
            raise ConfigValueError("vocab_size", f"must be at least 1, got {self.vocab_size}")
        if self.min_frequency < 0:
            raise ConfigValueError("min_frequency", f"must be >= 0, got {self.min_frequency}")
        if not 0.0 <= self.heldout_fraction <= 1.0:  # written so that NaN fails too
            raise ConfigValueError("heldout_fraction", "must be in [0, 1], got "
                                                       f"{self.heldout_fraction}")
        if self.heldout_max_documents < 0:
            raise ConfigValueError("heldout_max_documents", "must be >= 0, got "
                                                            f"{self.heldout_max_documents}")
        if self.workers is not None and self.workers < 1:
            raise ConfigValueError("workers", f"must be a positive integer, got {self.workers}")


@dataclass
class DataConfig:
    """A data engine run (see the module docstring and docs/data.md)."""

    output: str = "runs/data"
    executor: str = "local"
    workers: int | None = None
    ray_address: str | None = None
    strict: bool = False
    steps: list[str] | None = None  # None: every step, in order (the records of data.engine)
    sources: list[SourceConfig] = field(default_factory=list)
    quality: QualityConfig = field(default_factory=QualityConfig)
    taggers: list[Any] = field(default_factory=list)
    plugins: list[str] = field(default_factory=list)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    decontaminate: DecontamConfig = field(default_factory=DecontamConfig)
    mixer: MixConfig = field(default_factory=MixConfig)
    tokenize: TokenizeStepConfig = field(default_factory=TokenizeStepConfig)

    @classmethod
    def upgrade_keys(cls, data: dict[str, Any], prefix: str) -> dict[str, Any]:
        """Accept the section's old name: ``decontamination`` is ``decontaminate`` (the step's
        name; its attribute set on disk stays ``decontam``)."""
        if "decontamination" in data:
            note_renamed(f"{prefix}decontamination", f"{prefix}decontaminate")
            old = data.pop("decontamination")
            if "decontaminate" in data:
                raise OlmoflowError("the config has both 'decontamination' and 'decontaminate'; "
                                    "keep 'decontaminate'")
            data["decontaminate"] = old
        return data

    def to_dict(self) -> dict[str, Any]:
        """Plain values (for YAML, manifests and fingerprints)."""
        return dataclasses.asdict(self)


def validate(cfg: DataConfig) -> DataConfig:
    """Check what spans fields or needs the registries (the sections checked their own values
    when :func:`olmoflow.config.from_dict` built them); return ``cfg``.

    Raises:
        OlmoflowError: unknown executor, a source without name or paths, two sources
            with the same name, a name that is no plain directory name (or over 255 bytes), or a
            tagger or quality option that is unknown or of the wrong type.
    """
    from olmoflow.data.executor import EXECUTORS

    if cfg.executor not in EXECUTORS:
        raise unknown_name_error("executor", cfg.executor, EXECUTORS)
    seen = set()
    for i, s in enumerate(cfg.sources):
        if not s.name or not s.paths:
            raise OlmoflowError(f"sources[{i}] needs a 'name' and a list of 'paths'")
        if s.name in seen:
            raise OlmoflowError(f"two sources are named '{s.name}'")
        if "/" in s.name or "\0" in s.name or s.name.startswith("."):
            raise OlmoflowError(f"source name '{s.name}' must be a plain directory name")
        # The name becomes a directory: past the file system's name limit, ingest fails midway.
        if len(os.fsencode(s.name)) > NAME_MAX:
            raise OlmoflowError(f"sources[{i}].name is {len(os.fsencode(s.name))} bytes long; a "
                                f"directory name holds at most {NAME_MAX}")
        seen.add(s.name)
    if cfg.workers is not None and cfg.workers < 1:
        raise OlmoflowError(f"workers must be a positive integer, got {cfg.workers}")
    from olmoflow.data.taggers import check_taggers
    from olmoflow.data.taggers.quality import check_train_options

    # Plugins are imported (their code run) only when a step starts: their taggers' names and
    # options are checked then; built-in ones now.
    check_taggers(cfg.taggers, known_only=True)
    if not isinstance(cfg.quality.options, dict):
        raise OlmoflowError(f"config key 'quality.options' expects a mapping, got "
                            f"{reprlib.repr(cfg.quality.options)}")
    check_train_options(cfg.quality.options)
    return cfg


def load_data_config(path: str | os.PathLike, overrides: list[str] | None = None,
                     values: dict[str, Any] | None = None) -> DataConfig:
    """Load a data engine YAML config (a file, or a preset name under ``configs/data/``), apply
    dotted ``key=value`` overrides, validate it. Parsed by :func:`olmoflow.config.from_dict`, the
    parser of run configs, so unknown keys and bad values get the same messages.

    Raises:
        OlmoflowError: a missing file, invalid YAML (file and line), an unknown key (with the
            closest valid key) or a bad value.
    """
    tree = load_tree(str(path), overrides, values, subdir="data", schema=DataConfig)
    universe = all_keys(DataConfig)
    sources = tree.pop("sources", [])
    if not isinstance(sources, list):
        raise OlmoflowError("config key 'sources' expects a list of {name, paths}")
    cfg = from_dict(DataConfig, tree, universe=universe)
    # Each source is named by its position, so a typo points at the entry that has it.
    cfg.sources = [from_dict(SourceConfig, s, f"sources[{i}].",
                             universe=all_keys(SourceConfig, f"sources[{i}]."))
                   for i, s in enumerate(sources)]
    return validate(cfg)
