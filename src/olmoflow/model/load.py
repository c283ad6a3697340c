"""The one model loader: any checkpoint form -> model + tokenizer + trained length.

Every reader of a model (``evaluate`` and ``eval run``, the lm-eval adapter, ``generate``,
``chat``, ``serve``, ``diagnose``, ``export hf`` / ``gguf``, the post-training base, the release)
calls :func:`load_model`, as ``transformers.AutoModelForCausalLM.from_pretrained`` is one door for
every checkpoint form. Accepted forms (:func:`resolve_source`):

- a training step directory (``run_dir/pretrain/stage1-step450-tokens2M``, or the older
  ``stepN``: ``config.yaml`` + ``model_and_optim/``): its files are checked against their
  recorded sha256 first (:mod:`olmoflow.model.checkpoint_files`), the model is built from the
  ``model`` section of its ``config.yaml`` with the vocabulary sized from the tokenizer, and the
  checkpoint of a LoRA run (``lora.json`` beside it) is loaded wrapped and its adapters merged;
- a folder of checkpoints with a ``latest`` pointer (``run_dir/pretrain``), or the pointer itself;
- a Hugging Face directory (a release, an export): its ``config.json`` and
  ``generation_config.json`` are checked (:mod:`olmoflow.model.hf_settings`);
- a run directory that holds a release (``runs/demo``): its ``release/``;
- a Hub id (``allenai/OLMo-2-0425-1B``): its snapshot in the local Hugging Face cache, or
  downloaded where the user allows network access (:mod:`olmoflow.model.hub`).

The tokenizer comes from ``tokenizer`` when given; for a step directory, else from its stage's own
``tokenizer/`` (a post-training stage's, chat template included), the tokens directories its
config trained on (``train.data``), the run's tokenizer stage, else its release (the run directory
is the step directory's grandparent, laid out as :class:`olmoflow.run_dir.RunDir` says); for a
Hugging Face directory, from the directory itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from olmoflow.artifacts import data_files
from olmoflow.config import from_dict, read_yaml_mapping
from olmoflow.errors import OlmoflowError
from olmoflow.run_dir import RunDir

STEP, HF = "step", "hf"


def _is_step_dir(p: Path) -> bool:
    return (p / "model_and_optim").is_dir() and (p / "config.yaml").is_file()


def resolve_source(checkpoint: str | Path, *, allow_network: bool | None = None,
                   revision: str | None = None) -> tuple[str, Path]:
    """``("step", dir)`` for a training step directory, ``("hf", dir)`` for a Hugging Face one
    (see the module docstring for every form accepted). ``allow_network`` and ``revision`` apply
    to a Hub id (:func:`olmoflow.model.hub.resolve_pretrained`; None reads
    ``OLMOFLOW_ALLOW_NETWORK``).

    Raises:
        OlmoflowError: the path is missing (a Hub id: not cached, or not on the Hub), or is
            neither kind.
    """
    from olmoflow.model.hub import is_hub_id, resolve_pretrained

    p = Path(checkpoint)
    if not p.exists() and is_hub_id(str(checkpoint)):
        p = resolve_pretrained(str(checkpoint), revision=revision, allow_network=allow_network)
    if not p.exists():
        raise OlmoflowError(f"checkpoint '{p}' does not exist")
    if p.is_file() and p.name == "latest":  # run_dir/pretrain/latest: the pointer it holds
        p = p.parent
    if not p.is_dir():
        raise OlmoflowError(f"checkpoint '{p}' is not a directory (expected a checkpoint "
                            "directory such as run_dir/pretrain/stage1-step450-tokens2M)")
    if _is_step_dir(p):
        return STEP, p
    if (p / "latest").is_file():
        step = p / (p / "latest").read_text().strip()
        if _is_step_dir(step):
            return STEP, step
    if (p / "config.json").is_file():
        return HF, p
    run = RunDir.containing(p)
    # the run directory itself, not one of its stages: runs/demo/collect is no model
    if run is not None and run.root == p and (run.stage("release") / "config.json").is_file():
        return HF, run.stage("release")
    raise OlmoflowError(f"'{p}' is not a checkpoint: no config.json (a Hugging Face directory) "
                        "and no config.yaml with model_and_optim/ (a step directory such as "
                        "run_dir/pretrain/stage1-step450-tokens2M)")


def step_config(step: Path) -> dict:
    """The raw run config saved in a step directory (``config.yaml``)."""
    return read_yaml_mapping(step / "config.yaml")


def _trained_on_tokenizers(step: Path) -> list[Path]:
    """The tokenizer directories of the tokens directories a step was trained on (``train.data``
    in its config; none when it trained on its run's own tokens)."""
    from olmoflow.data.tokenize import open_token_dir

    train = step_config(step).get("train")
    data = train.get("data") if isinstance(train, dict) else None
    dirs = [data] if isinstance(data, str) else list(data or [])
    found = []
    for d in dirs:
        try:
            found.append(open_token_dir(d).tokenizer_dir)
        except OlmoflowError:  # moved or deleted since; the other candidates may still hold one
            continue
    return found


def find_tokenizer(kind: str, src: Path, tokenizer: str | Path | None = None) -> Path:
    """The directory holding ``tokenizer.json`` for ``src`` (the module docstring gives the
    order).

    Raises:
        OlmoflowError: none found (the message lists where it looked).
    """
    if tokenizer is not None:
        cands = [Path(tokenizer)]
    elif kind == STEP:
        runs = RunDir(src.resolve().parent.parent)
        # a post-training stage keeps its own tokenizer (chat template, added tokens) beside
        # its checkpoints
        cands = [src.parent / "tokenizer", *_trained_on_tokenizers(src),
                 runs.stage("train-tokenizer"), runs.stage("release")]
    else:
        cands = [src]
    for c in cands:
        if (c / "tokenizer.json").is_file():
            return c
    raise OlmoflowError(f"no tokenizer.json in {', '.join(repr(str(c)) for c in cands)}; "
                        "pass --tokenizer DIR")


def lora_settings_of(step: Path):
    """The :class:`~olmoflow.model.lora.LoraSettings` a LoRA run recorded beside its checkpoint
    (``lora.json``), or None for a checkpoint of every weight."""
    from olmoflow.model.lora import find_lora_settings, read_lora_settings

    return read_lora_settings(step) if find_lora_settings(step) is not None else None


def load_step_model(step: Path, tokenizer_vocab: int):
    """The :class:`Olmo` of a step directory: the shape of the ``model`` section of its
    ``config.yaml`` (vocab padded from ``tokenizer_vocab`` when it says 0), weights from
    ``model_and_optim/`` (built on meta, then materialised once on CPU in fp32). The checkpoint
    of a LoRA run (``lora.json`` beside it) is loaded into the wrapped model and its adapters
    merged, so the model returned is a plain :class:`Olmo`.

    Raises:
        OlmoflowError: the config has no valid model section, or the weights do not load.
    """
    from olmoflow.model.checkpoint_files import load_weights
    from olmoflow.model.config import ModelConfig
    from olmoflow.model.olmo import Olmo

    tree = step_config(step)
    if not isinstance(tree.get("model"), dict):
        raise OlmoflowError(f"{step / 'config.yaml'}: no 'model' section; not a checkpoint's "
                            "config")
    mc = from_dict(ModelConfig, tree["model"], "model.")
    if mc.vocab_size <= 0:
        mc = replace(mc, vocab_size=mc.padded_vocab_size(tokenizer_vocab))
    with torch.device("meta"):
        model = Olmo(mc)
    model = model.to_empty(device="cpu")
    lora = lora_settings_of(step)
    if lora is not None:  # a LoRA run's checkpoint holds the wrapped model: wrap, load, merge
        from olmoflow.model.lora import apply_lora

        model = apply_lora(model, replace(lora, quantize=None))
    try:
        load_weights(step, model)
    except Exception as e:  # dcp raises a variety of errors for damaged or mismatched checkpoints
        raise OlmoflowError(f"cannot load the weights of '{step}': "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if lora is not None:
        from olmoflow.model.lora import merge_lora

        model = merge_lora(model)
    return model.eval()


def trained_length(directory: str | Path) -> int | None:
    """The longest sequence the model of ``directory`` (a release, a step directory: whatever
    carries its run's ``config.yaml``) was trained on: the longest window of the stages of its
    chain that ran (:func:`olmoflow.run_dir.trained_lengths`: ``train.sequence_length``, and a
    post-training stage's ``<stage>.train.sequence_length`` when that stage has data, so an SFT
    checkpoint of a model pretrained on short windows counts its longer conversations); None
    without a readable ``config.yaml``.

    ``evaluate.sequence_length`` is not a trained length (it is where the run chose to score) and
    does not count.
    """
    from olmoflow.run_dir import trained_lengths

    cfg = Path(directory) / "config.yaml"
    if not cfg.is_file():
        return None
    try:
        data = read_yaml_mapping(cfg)
    except OlmoflowError:
        return None
    lengths = trained_lengths(data)
    return max(lengths) if lengths else None


@dataclass(frozen=True)
class Loaded:
    """What :func:`load_model` read.

    Attributes:
        model: the :class:`~olmoflow.model.olmo.Olmo`, in eval mode, on the device asked for.
        tokenizer: its tokenizer (a :class:`~olmoflow.tokenizer.base.BaseTokenizer`), or None
            when none was asked for and none was found (``need_tokenizer=False``).
        kind: ``"step"`` (a training checkpoint) or ``"hf"`` (a Hugging Face directory).
        path: the directory the weights were read from (a ``latest`` pointer, a run directory
            and a Hub id resolved).
        files: the files read, weights' and tokenizer's, sorted per directory (their sha256 go
            into manifests).
        tokenizer_dir: the directory the tokenizer was read from (None when the caller passed a
            loaded tokenizer, or there is none).
        trained_length: the longest sequence it was trained on (:func:`trained_length`), or
            None when its directory records none.
    """

    model: Any
    tokenizer: Any
    kind: str
    path: Path
    files: list[Path]
    tokenizer_dir: Path | None = None
    trained_length: int | None = None

    @property
    def context_length(self) -> int:
        """The context window to use: the model's ``max_sequence_length``, or the trained length
        when that is shorter (positions past it were never trained)."""
        window = self.model.config.max_sequence_length
        return min(window, self.trained_length) if self.trained_length else window


def _place(model: Any, device: str | torch.device | None, dtype: torch.dtype | None) -> Any:
    """``model`` in ``dtype`` (None: as loaded) on ``device`` (None: the CPU it was loaded on;
    ``"auto"``: CUDA when available).

    Raises:
        OlmoflowError: a device this torch cannot use.
    """
    if dtype is not None:
        model = model.to(dtype)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device is None:
        return model
    try:
        return model.to(device)
    except (RuntimeError, AssertionError, ValueError) as e:  # no such device / no CUDA build
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise OlmoflowError(f"cannot use device '{device}': {first}") from None


def load_model(path: str | Path, *, tokenizer: Any = None, device: str | torch.device | None = None,
               dtype: torch.dtype | None = None, implementation: str | None = None,
               need_tokenizer: bool = True, allow_network: bool | None = None,
               revision: str | None = None) -> Loaded:
    """Load the model at ``path`` in any form (the module docstring lists them) with its
    tokenizer.

    Args:
        path: a step directory, a folder of checkpoints or its ``latest``, a Hugging Face
            directory, a run directory with a release, or a Hub id.
        tokenizer: a directory with ``tokenizer.json``, or a loaded tokenizer to use as is
            (default: found beside the model, see :func:`find_tokenizer`).
        device: where the model goes (default: the CPU; ``"auto"``: CUDA when available).
        dtype: the weights' dtype (default: a step's fp32, a Hugging Face directory's as stored).
        implementation: the tokenizer implementation that reads the directory (a name
            :func:`olmoflow.tokenizer.tokenizer_class` knows; default the BPE tokenizer).
        need_tokenizer: False lets a Hugging Face directory without a tokenizer load (a step's
            vocabulary is sized from its tokenizer, so it always needs one).
        allow_network, revision: for a Hub id (see :func:`resolve_source`).
    Returns:
        A :class:`Loaded`.
    Raises:
        OlmoflowError: bad paths, no tokenizer, a tokenizer file that is not what it should be,
            damaged or changed weights, a model vocabulary smaller than the tokenizer's, bad
            generation settings (:func:`olmoflow.model.hf_settings.check_hf_settings`), or a
            device this torch cannot use.
    """
    from olmoflow.tokenizer import Tokenizer, tokenizer_class
    from olmoflow.tokenizer.base import BaseTokenizer

    kind, src = resolve_source(path, allow_network=allow_network, revision=revision)
    tok_dir: Path | None = None
    if isinstance(tokenizer, BaseTokenizer):
        tok = tokenizer
    else:
        try:
            tok_dir = find_tokenizer(kind, src, tokenizer)
        except OlmoflowError:
            if need_tokenizer or kind == STEP or tokenizer is not None:
                raise
        reader = tokenizer_class(implementation).load if implementation else \
            Tokenizer.from_pretrained
        tok = reader(tok_dir) if tok_dir is not None else None
    if kind == STEP:
        model = load_step_model(src, tok.vocab_size)
    else:
        from olmoflow.model.hf_settings import check_hf_settings
        from olmoflow.model.olmo import Olmo

        model = Olmo.from_pretrained(src, dtype=dtype)
        check_hf_settings(src, model.config.vocab_size)
    if tok is not None and model.config.vocab_size < tok.vocab_size:
        raise OlmoflowError(f"the model's vocab ({model.config.vocab_size}) is smaller than the "
                            f"tokenizer's ({tok.vocab_size}) in '{tok_dir or src}'")
    model = _place(model, device, dtype if kind == STEP else None).eval()
    files = data_files(src)
    if tok_dir is not None:
        read = set(files)  # a release directory holds the weights and the tokenizer both
        files += [f for f in data_files(tok_dir) if f not in read]
    return Loaded(model, tok, kind, src, files, tokenizer_dir=tok_dir,
                  trained_length=trained_length(src))
