"""Byte-level BPE on the Hugging Face ``tokenizers`` library.

The pipeline is lossless: no normalizer, a pre-tokenizer that only cuts text into pieces and maps
bytes to GPT-2's byte symbols, and a ByteLevel decoder, so ``decode(encode(t)) == t`` for any text.
Training seeds the vocabulary with all 256 byte symbols, so no input is ever unknown.

The split (``pre_tokenizer``) of a new tokenizer is OLMo 2/3's (the dolma2 tokenizer's, itself
cl100k's): ``Split(CL100K_PATTERN, "isolated")`` then ``ByteLevel(use_regex=False)``, exactly the
``pre_tokenizer`` of dolma2's ``tokenizer.json``. ``pre_tokenizer="gpt2"`` gives the older
``ByteLevel(use_regex=True)`` (GPT-2's regex). Training and encoding go through the same
pre-tokenizer, saved in ``tokenizer.json``: a loaded tokenizer encodes with the split it was saved
with, so tokenizers trained before cl100k became the default encode exactly as before.

Special tokens in user text: the literal string ``<|endoftext|>`` (or ``<|pad|>``) inside a
document is encoded as ordinary text, never as the special id (``tokenizers``'
``encode_special_tokens``), so a document cannot forge a document boundary and every text
round-trips. Only olmoflow itself inserts EOS (``add_eos``). ``transformers``' tokenizer on the
saved files gives the same ids for every text without such literals.

Files (the Hugging Face layout, so ``AutoTokenizer.from_pretrained(dir)`` loads them):
``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``, and with a chat
template ``chat_template.jinja`` (also under ``chat_template`` in ``tokenizer_config.json``;
``transformers`` prefers the ``.jinja`` file, and so does :meth:`BPETokenizer.from_pretrained`).
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as _HFTokenizer

from olmoflow.artifacts import atomic_write_json, atomic_write_text
from olmoflow.errors import OlmoflowError, unknown_name_error
from olmoflow.tokenizer.base import DEFAULT_EOS, DEFAULT_PAD, BaseTokenizer
from olmoflow.tokenizer.config import PRE_TOKENIZERS

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

log = logging.getLogger(__name__)

# cl100k's split as the ``tokenizers`` library (Oniguruma) spells it in the tokenizer.json of
# dolma2 and of Llama 3 (tiktoken's current copy is a later, possessive spelling of it).
# Alternatives in order: English contractions; a letter run with at most one leading character
# that is neither a letter, a digit nor a newline (" the", "_name", "(x"); 1-3 digits; a
# punctuation run with an optional leading space and the newlines after it (".\n\n");
# whitespace ending in newlines ("\n\n", "  \n"); a whitespace run that leaves its last space
# to the next word; any other whitespace.
CL100K_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    """The byte-level pre-tokenizer called ``name`` (one of :data:`PRE_TOKENIZERS`): ``cl100k``
    (OLMo 2/3's split on :data:`CL100K_PATTERN`, then bytes to symbols) or ``gpt2`` (GPT-2's
    ByteLevel regex). Neither adds a prefix space, so both are lossless.

    Raises:
        OlmoflowError: an unknown name.
    """
    if name == "cl100k":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(CL100K_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if name == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raise unknown_name_error("tokenizer.pre_tokenizer", name, PRE_TOKENIZERS)


def pre_tokenizer_name(tok: _HFTokenizer) -> str | None:
    """Which of :data:`PRE_TOKENIZERS` ``tok`` splits with, or None for any other pre-tokenizer
    (a foreign model's). Compared on the serialized form, as saved in ``tokenizer.json``."""
    if tok.pre_tokenizer is None:
        return None
    # Only the pre-tokenizer is serialized; a whole 100k-token vocabulary would take a while.
    saved = json.loads(tok.pre_tokenizer.__getstate__())
    for name in PRE_TOKENIZERS:
        if saved == json.loads(build_pre_tokenizer(name).__getstate__()):
            return name
    return None


class BPETokenizer(BaseTokenizer):
    """Byte-level BPE tokenizer.

    Args:
        tokenizer: a trained ``tokenizers.Tokenizer``; None for an untrained one (call
            :meth:`train_from_texts` or :meth:`train` before encoding).
        vocab_size: target vocabulary size for training, the special tokens included. A small
            corpus may yield fewer tokens (no pair left with ``min_frequency`` occurrences).
        min_frequency: a pair is merged only if it occurs at least this often.
        eos_token, pad_token, model_max_length, bos_token: see :class:`BaseTokenizer`.
        pre_tokenizer: the split training uses, ``"cl100k"`` (default) or ``"gpt2"`` (see
            :func:`build_pre_tokenizer`). A trained ``tokenizer`` encodes with its own
            pre-tokenizer whatever this says; :meth:`from_pretrained` sets it to the saved one's
            name when it is one of these.

    Raises:
        OlmoflowError: an unknown ``pre_tokenizer``.
    """

    def __init__(
        self,
        tokenizer: _HFTokenizer | None = None,
        *,
        vocab_size: int = 8192,
        min_frequency: int = 2,
        eos_token: str = DEFAULT_EOS,
        pad_token: str = DEFAULT_PAD,
        model_max_length: int = 1_000_000,
        pre_tokenizer: str = "cl100k",
        bos_token: str | None = None,
    ) -> None:
        super().__init__(eos_token, pad_token, model_max_length, bos_token)
        if pre_tokenizer not in PRE_TOKENIZERS:
            raise unknown_name_error("tokenizer.pre_tokenizer", pre_tokenizer, PRE_TOKENIZERS)
        self.pre_tokenizer = pre_tokenizer
        self._tok = tokenizer
        if tokenizer is not None:
            tokenizer.encode_special_tokens = True  # see the module docstring
        self.train_vocab_size = vocab_size
        self.min_frequency = min_frequency
        self._byte_lengths: np.ndarray | None = None

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying ``tokenizers.Tokenizer``. Raises OlmoflowError if untrained."""
        if self._tok is None:
            raise OlmoflowError("tokenizer is not trained; train it or use from_pretrained")
        return self._tok

    # ---- training -------------------------------------------------------------------------------

    def train_from_texts(
        self,
        texts: Iterable[str],
        vocab_size: int | None = None,
        min_frequency: int | None = None,
        length: int | None = None,
        progress: bool = False,
    ) -> BPETokenizer:
        """Train a fresh vocabulary on ``texts`` (any iterable, consumed once), split by
        ``self.pre_tokenizer``; returns self.

        ``length`` (number of texts, if known) only drives the progress bar.

        Raises:
            OlmoflowError: ``vocab_size`` too small to hold the 256 byte symbols and the specials.
        """
        vocab_size = self.train_vocab_size if vocab_size is None else vocab_size
        min_frequency = self.min_frequency if min_frequency is None else min_frequency
        specials = [self.eos_token, self.pad_token]
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        if vocab_size < len(alphabet) + len(specials):
            raise OlmoflowError(
                f"tokenizer vocab_size {vocab_size} is too small; byte-level BPE needs at least "
                f"{len(alphabet) + len(specials)} (256 bytes + {len(specials)} special tokens)"
            )
        # No unk token and no normalizer: every byte has a symbol and text is kept exactly.
        tok = _HFTokenizer(models.BPE())
        tok.pre_tokenizer = build_pre_tokenizer(self.pre_tokenizer)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=specials,  # ids 0 (EOS) and 1 (pad)
            initial_alphabet=alphabet,
            show_progress=progress,
        )
        tok.train_from_iterator(texts, trainer=trainer, length=length)
        tok.encode_special_tokens = True  # see the module docstring
        self._tok = tok
        self._byte_lengths = None
        self.train_vocab_size, self.min_frequency = vocab_size, min_frequency
        return self

    def _train(self, files: list[str]) -> None:
        """Train on files: ``.jsonl``/``.jsonl.gz`` are read as documents (their ``text``), any
        other file is one UTF-8 text."""
        self.train_from_texts(_iter_file_texts(files))

    # ---- hooks ----------------------------------------------------------------------------------

    def _tokenize(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], add_eos: bool = False) -> list[list[int]]:
        """Encode many texts at once; ``tokenizers`` spreads the work over threads in Rust."""
        encs = self.backend.encode_batch_fast(list(texts), add_special_tokens=False)
        if not add_eos:
            return [e.ids for e in encs]
        eos = self.eos_token_id
        return [e.ids + [eos] for e in encs]

    def _decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of ``text`` and each token's character span (``tokenizers``' offsets)."""
        enc = self.backend.encode(text, add_special_tokens=False)
        return enc.ids, [tuple(o) for o in enc.offsets]

    def _add_special_tokens(self, tokens: list[str]) -> int:
        # normalized=False: matched on raw text by transformers, as the dolma2 specials are.
        n = self.backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                             for t in tokens])
        self.backend.encode_special_tokens = True  # see the module docstring
        self._byte_lengths = None
        return n

    def _vocab_size(self) -> int:
        # max id + 1 rather than the count: added tokens may leave holes in the id range.
        return max(self.backend.get_vocab(with_added_tokens=True).values()) + 1

    def _token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def added_tokens(self) -> list[str]:
        """The added tokens of ``tokenizer.json`` (special or not), which ``transformers``
        matches in a chat template's text before tokenizing the rest."""
        return [t.content for _, t in sorted(self.backend.get_added_tokens_decoder().items())]

    def _token_byte_lengths(self) -> np.ndarray:
        if self._byte_lengths is None:
            self._byte_lengths = _byte_lengths(self.backend, self.vocab_size)
        return self._byte_lengths

    # ---- files ----------------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike) -> list[Path]:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``
        (and ``chat_template.jinja`` when the tokenizer has a chat template) into ``directory``
        (atomically, each); return their paths."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        atomic_write_text(d / TOKENIZER_FILE, self.backend.to_str(pretty=True))
        special = {"eos_token": self.eos_token, "pad_token": self.pad_token}
        if self.bos_token is not None:
            special = {"bos_token": self.bos_token, **special}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            **special,
            "unk_token": None,
            "model_max_length": self.model_max_length,
            # transformers would otherwise "clean up" spaces before punctuation on decode.
            "clean_up_tokenization_spaces": False,
        }
        files = [d / TOKENIZER_FILE, d / CONFIG_FILE, d / SPECIAL_MAP_FILE]
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
            atomic_write_text(d / CHAT_TEMPLATE_FILE, self.chat_template)
            files.append(d / CHAT_TEMPLATE_FILE)
        else:
            # transformers prefers the .jinja file: a stale one would outlive the template.
            (d / CHAT_TEMPLATE_FILE).unlink(missing_ok=True)
        atomic_write_json(d / CONFIG_FILE, config)
        atomic_write_json(d / SPECIAL_MAP_FILE, special)
        return files

    @classmethod
    def load(cls, directory: str | os.PathLike) -> BPETokenizer:
        """Same as :meth:`from_pretrained`."""
        return cls.from_pretrained(directory)

    @classmethod
    def from_pretrained(cls, path_or_dir: str | os.PathLike) -> BPETokenizer:
        """Load a directory holding ``tokenizer.json`` (ours, or a Hugging Face model directory
        such as an OLMo release), or a ``tokenizer.json`` file itself.

        EOS and pad tokens come from ``tokenizer_config.json`` / ``special_tokens_map.json`` when
        present, else ``<|endoftext|>`` / ``<|pad|>``; a model without a pad token pads with EOS.
        A BOS token is kept when the config names one that is in the vocabulary. The chat
        template is ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``
        (a string, or the ``default`` entry of a list of named templates), else None.

        Raises:
            OlmoflowError: the path or ``tokenizer.json`` is missing or unreadable, its token ids
                run far past its number of tokens, the EOS token is not in the vocabulary, or
                ``tokenizer_config.json`` / ``special_tokens_map.json`` is not a JSON object or
                names a special token that is not a string (the file and the key named). A
                ``model_max_length`` that is not a positive number is ignored with a warning.
        """
        p = Path(path_or_dir)
        if not p.exists():
            raise OlmoflowError(f"tokenizer path not found: {p}")
        file = p / TOKENIZER_FILE if p.is_dir() else p
        d = file.parent
        if not file.is_file():
            raise OlmoflowError(f"no {TOKENIZER_FILE} in tokenizer directory {d}")
        try:
            tok = _HFTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise OlmoflowError(f"cannot read tokenizer {file}: {first}") from None
        _check_ids(tok, file)
        config: dict[str, Any] = {}
        for name in (SPECIAL_MAP_FILE, CONFIG_FILE):  # tokenizer_config.json wins
            config.update(_read_json(d / name))
        eos = _token_str(config.get("eos_token")) or DEFAULT_EOS
        pad = _token_str(config.get("pad_token")) or DEFAULT_PAD
        if tok.token_to_id(eos) is None:
            raise OlmoflowError(f"eos token {eos!r} is not in the vocabulary of {file}")
        if tok.token_to_id(pad) is None:
            pad = eos  # common for released models without a pad token
        max_len = config.get("model_max_length")
        if max_len is not None and not (isinstance(max_len, int | float)
                                        and not isinstance(max_len, bool) and max_len > 0):
            log.warning("%s: model_max_length=%s is not a positive number; ignored",
                        d / CONFIG_FILE, _short(max_len))
        bos = _token_str(config.get("bos_token"))
        if bos is not None and tok.token_to_id(bos) is None:
            bos = None
        out = cls(tok, eos_token=eos, pad_token=pad, bos_token=bos)
        out.chat_template = _read_chat_template(d, config)
        out.pre_tokenizer = pre_tokenizer_name(tok) or out.pre_tokenizer
        if isinstance(max_len, int):
            out.model_max_length = max_len
        return out


# Slack for ids past the number of tokens: a released vocabulary may leave a few ids unused, but
# never more than it uses (the vocab size is the largest id + 1, and sizes every table).
_MAX_UNUSED_IDS = 1024


def _check_ids(tok: _HFTokenizer, file: Path) -> None:
    """Refuse a vocabulary whose largest id is far past its number of tokens (one id of 2^31 - 1
    would make a 2-billion-entry vocabulary and tables to match)."""
    ids = tok.get_vocab(with_added_tokens=True).values()
    if not ids:
        raise OlmoflowError(f"tokenizer {file} has an empty vocabulary")
    top = max(ids)
    if top >= 2 * len(ids) + _MAX_UNUSED_IDS:
        raise OlmoflowError(f"tokenizer {file} has token id {top} but only {len(ids)} tokens; "
                            "ids must number the vocabulary from 0")


def _iter_file_texts(files: list[str]) -> Iterable[str]:
    """The texts of training files: each line's ``text`` of a ``.jsonl``/``.jsonl.gz`` file
    (Dolma documents; read here, so the tokenizer needs no data package), the whole of any
    other file.

    Raises:
        OlmoflowError: a JSONL line that is not an object with a string ``text``, or a damaged
            gzip file, naming the file and line.
    """
    for f in files:
        if not f.endswith((".jsonl", ".jsonl.gz")):
            yield Path(f).read_text(encoding="utf-8")
            continue
        n = 0
        try:
            with (gzip.open(f, "rb") if f.endswith(".gz") else open(f, "rb")) as lines:
                for line in lines:  # a damaged gzip raises here, reading line n + 1
                    n += 1
                    if not line.strip():
                        continue
                    text = json.loads(line).get("text")
                    if not isinstance(text, str):
                        raise ValueError("no string 'text' field")
                    yield text
        except (OSError, EOFError, zlib.error, ValueError, AttributeError, RecursionError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            line_no = n + 1 if isinstance(e, OSError | EOFError | zlib.error) else n
            raise OlmoflowError(f"{f}:{line_no}: cannot read training text ({why})") from None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise OlmoflowError(f"cannot read {path}: {e}") from None
    except RecursionError:  # json's decoder recurses per nesting level
        raise OlmoflowError(f"cannot read {path}: JSON nested too deeply") from None
    if not isinstance(obj, dict):  # transformers cannot read it either
        kind = "null" if obj is None else type(obj).__name__
        raise OlmoflowError(f"{path}: expected a JSON object of tokenizer settings, found a "
                            f"{kind}")
    for key in _TOKEN_KEYS:
        value = obj.get(key)
        content = value.get("content") if isinstance(value, dict) else value
        if value is not None and not isinstance(content, str):
            raise OlmoflowError(f"{path}: {key}={_short(value)} is not a token (expected a "
                                "string, an AddedToken object with a 'content' string, or null)")
    return obj


# The special tokens a tokenizer config names; olmoflow reads EOS, pad and BOS from them.
_TOKEN_KEYS = ("eos_token", "pad_token", "bos_token", "unk_token")


def _short(value: Any) -> str:
    """``value`` as JSON, cut to one short line for an error message."""
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 60 else text[:57] + "..."



def _read_chat_template(d: Path, config: dict[str, Any]) -> str | None:
    """The chat template saved in ``d``: ``chat_template.jinja`` wins, as in ``transformers``."""
    f = d / CHAT_TEMPLATE_FILE
    if f.is_file():
        try:
            return f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise OlmoflowError(f"cannot read {f}: {e}") from None
    value = config.get("chat_template")
    where = d / CONFIG_FILE
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...], as transformers saves
        named = {}
        for i, t in enumerate(value):
            if not (isinstance(t, dict) and isinstance(t.get("name"), str)
                    and isinstance(t.get("template"), str)):
                raise OlmoflowError(f"{where}: chat_template[{i}]={_short(t)} is not a "
                                    "{\"name\": ..., \"template\": ...} entry of strings")
            named[t["name"]] = t["template"]
        if "default" not in named:
            # transformers refuses such a template list unless told which one to use
            log.warning("%s: chat_template names %s but no 'default'; no chat template is used",
                        where, ", ".join(map(repr, named)) or "no template")
        value = named.get("default")
    elif value is not None and not isinstance(value, str):
        raise OlmoflowError(f"{where}: chat_template={_short(value)} must be a Jinja string or "
                            "a list of {\"name\": ..., \"template\": ...} entries")
    return value if isinstance(value, str) and value else None


def _token_str(value: Any) -> str | None:
    """A token from a HF config: a string, or an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _byte_lengths(tok: _HFTokenizer, vocab_size: int) -> np.ndarray:
    """UTF-8 bytes each id stands for; 0 for special tokens (and for unused ids)."""
    lengths = np.zeros(vocab_size, dtype=np.int32)
    added = tok.get_added_tokens_decoder()
    byte_level = type(tok.decoder).__name__ == "ByteLevel"
    # Each char of a byte-level token is one byte (GPT-2's bytes-to-unicode map).
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    ids, tokens = [], []
    for token, i in tok.get_vocab(with_added_tokens=True).items():
        if i in added:
            a = added[i]
            # Non-special added tokens are matched in raw text, so their content is the text.
            lengths[i] = 0 if a.special else len(a.content.encode("utf-8"))
        elif byte_level:
            lengths[i] = sum(1 if c in alphabet else len(c.encode("utf-8")) for c in token)
        else:
            ids.append(i)
            tokens.append(token)
    if ids:
        # Not byte-level (e.g. a sentencepiece-style model): measure each token's decoded text.
        # Approximate for byte-fallback pieces, which decode to U+FFFD on their own.
        texts = tok.decode_batch([[i] for i in ids], skip_special_tokens=False)
        for i, t in zip(ids, texts):
            lengths[i] = len(t.encode("utf-8"))
    return lengths
