"""Taggers: per-document measurements written as Dolma attribute files.

A tagger reads one document and returns its attributes, each a list of ``[start, end, score]``
spans over the document's ``text`` (character offsets): a document-level value is the single span
``[0, len(text), value]``. Attribute names are ``<tagger>__<name>``. :func:`tag_shard` runs a list
of taggers over one documents shard and writes ``attributes/<set>/<source>/<shard>.jsonl.gz``,
line-aligned with it (line *i* of the attribute file belongs to line *i* of the documents file), as
Dolma does, so the mixer can join the two without an index.

Adding a tagger::

    from olmoflow.data.taggers import Tagger, register_tagger

    @register_tagger("shouting")
    class Shouting(Tagger):
        defaults = {"min_letters": 20}        # options a config may set

        def tag(self, doc):
            text = doc["text"]
            letters = [c for c in text if c.isalpha()]
            frac = sum(c.isupper() for c in letters) / max(len(letters), 1)
            return {self.attr("upper_fraction"): [[0, len(text), frac]]}

Built-in taggers (see each module's docstring for every attribute and which direction is "bad"):
``gopher`` (Rae et al. 2021 quality and repetition rules), ``c4`` (Raffel et al. 2020 rules),
``langid`` (py3langid), ``pii`` (emails, phone numbers, IP addresses), ``quality`` (a fastText
classifier trained by :func:`olmoflow.data.taggers.quality.train_quality`), ``code_license`` and
``code_secrets`` (source files).
"""

from __future__ import annotations

import gzip
import importlib
import json
import logging
import math
import re
import reprlib
import time
import zlib
from pathlib import Path
from typing import Any, ClassVar

from olmoflow.artifacts import atomic_open
from olmoflow.errors import OlmoflowError, unknown_name_error

log = logging.getLogger(__name__)

Spans = list[list[float]]
_REGISTRY: dict[str, type[Tagger]] = {}
_BUILTIN_MODULES = ("gopher", "c4", "langid", "pii", "quality", "code")
_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9]|_(?!_))*$")
# Write attribute lines in ~1 MiB blocks: one GzipFile.write per line is several times slower.
_BLOCK_BYTES = 1 << 20


class Tagger:
    """Base class of a tagger: subclass it, set ``defaults``, implement :meth:`tag`.

    ``defaults`` maps each option a config may set to its default; an unknown option raises
    :class:`OlmoflowError` naming the closest valid one. ``self.options`` holds the merged values.
    """

    name: ClassVar[str] = ""
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, **options: Any) -> None:
        self.check_options(options)
        self.options = {**self.defaults, **options}

    @classmethod
    def check_options(cls, options: dict[str, Any], where: str | None = None) -> None:
        """Check ``options`` against ``defaults`` without building the tagger (the config's load
        calls it, so a bad value is refused before any step runs): every key must be a default's,
        and a value must have its default's type (a bool for a bool, a finite number for a number,
        a string for a string, a list of the same kind for a list; a default of None takes
        anything). A subclass with further rules extends this.

        Raises:
            OlmoflowError: an unknown key (naming the closest) or a value of the wrong type, naming
                ``where`` (default ``taggers.<name>``) and the key.
        """
        where = where or f"taggers.{cls.name}"
        for key, value in options.items():
            if key not in cls.defaults:
                raise unknown_name_error(f"option of tagger '{cls.name}'", str(key), cls.defaults)
            want = _option_kind(cls.defaults[key])
            if want is not None and not _option_fits(value, cls.defaults[key]):
                raise OlmoflowError(f"config key '{where}.{key}' expects {want}, got "
                                    f"{reprlib.repr(value)}")  # bounded even when deep

    def attr(self, name: str) -> str:
        """The full attribute name ``<tagger>__<name>``."""
        return f"{self.name}__{name}"

    def tag(self, doc: dict[str, Any]) -> dict[str, Spans]:
        """Attributes of one Dolma document:
        ``{"<tagger>__<name>": [[start, end, score], ...]}``."""
        raise NotImplementedError


def _option_kind(default: Any) -> str | None:
    """How a message names the type of an option whose default is ``default`` (None: any)."""
    if default is None:
        return None
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, int | float):
        return "an integer" if isinstance(default, int) else "a finite number"
    if isinstance(default, list | tuple):
        return "a list like " + repr(list(default))[:60]
    return f"a {type(default).__name__}"


def _option_fits(value: Any, default: Any) -> bool:
    """Whether ``value`` may stand where ``default`` does (see :meth:`Tagger.check_options`)."""
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int | float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if isinstance(default, int):
            return isinstance(value, int) and -2**63 <= value < 2**63
        return math.isfinite(value)
    if isinstance(default, list | tuple):
        if not isinstance(value, list | tuple):
            return False
        if not default:
            return True
        if all(isinstance(d, list | tuple) for d in default) or len(set(map(type, default))) == 1:
            return all(_option_fits(v, default[0]) for v in value)  # a list of like items
        # A record such as gopher's (n, fraction): the same length, each field of its type.
        return len(value) == len(default) and all(map(_option_fits, value, default))
    return isinstance(value, type(default))


def check_taggers(spec: Any, *, known_only: bool = False) -> None:
    """Check a config's ``taggers`` (shape, names and option values) without running anything.

    ``known_only``: leave names that are not registered yet to a later check (the config's load,
    before the ``plugins`` that may register them are imported); otherwise an unknown name is an
    error naming the closest.

    Raises:
        OlmoflowError: a malformed entry, an unknown tagger, or a bad option (key and value named).
    """
    _load_builtins()
    for i, (name, opts) in enumerate(_tagger_specs(spec)):
        if name not in _REGISTRY:
            if known_only:
                continue
            raise unknown_name_error("tagger", name, _REGISTRY)
        _REGISTRY[name].check_options(opts, f"taggers[{i}].{name}")


def register_tagger(name: str):
    """Class decorator: register a :class:`Tagger` subclass under ``name``.

    ``name`` is lowercase letters, digits and single underscores (``__`` separates the tagger from
    the attribute name). Registering a name twice replaces the earlier class, so a user can
    override a built-in.

    Raises:
        OlmoflowError: ``name`` is not a valid tagger name, or the class is not a Tagger.
    """
    if not _NAME.match(name):
        raise OlmoflowError(
            f"bad tagger name '{name}': use lowercase letters, digits and single underscores"
        )

    def wrap(cls: type[Tagger]) -> type[Tagger]:
        if not (isinstance(cls, type) and issubclass(cls, Tagger)):
            raise OlmoflowError(f"@register_tagger('{name}') must decorate a Tagger subclass")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def _load_builtins() -> None:
    for mod in _BUILTIN_MODULES:
        importlib.import_module(f"{__name__}.{mod}")


def tagger_names() -> list[str]:
    """Names of every registered tagger, sorted."""
    _load_builtins()
    return sorted(_REGISTRY)


def get_tagger(name: str, **options: Any) -> Tagger:
    """A new instance of the tagger registered as ``name``, with ``options`` over its defaults.

    Raises:
        OlmoflowError: no tagger has that name (the message names the closest), or an option is
            unknown, or the tagger cannot start (e.g. the quality model file is missing).
    """
    _load_builtins()
    if name not in _REGISTRY:
        raise unknown_name_error("tagger", name, _REGISTRY)
    return _REGISTRY[name](**options)


def make_taggers(spec: Any) -> list[Tagger]:
    """The taggers a config's ``taggers`` names (a name, a list of names or ``{name: {options}}``
    entries, or a mapping), each a new instance: what a tag shard job and ``clean`` run.

    Raises:
        OlmoflowError: a malformed entry, an unknown tagger (naming the closest) or option.
    """
    return [get_tagger(name, **opts) for name, opts in _tagger_specs(spec)]


def import_plugins(plugins: list[str]) -> None:
    """Import the user's modules that register taggers (``@register_tagger``): this runs their
    code. A ``.py`` path is a file (relative to the current directory, like ``sources`` paths);
    a dotted name is a module on the Python path, never taken from the current directory
    implicitly (see :mod:`olmoflow.user_code`). Imported once per process.

    Raises:
        OlmoflowError: a module that cannot be imported (its error named), or one that would be
            imported from the current directory only because Python put it on ``sys.path``.
    """
    from olmoflow import user_code

    for plugin in plugins:
        try:
            if plugin.endswith(".py"):
                user_code.load_file(plugin)
            else:
                user_code.import_module(plugin, "plugins: [./{file}]")
        except OlmoflowError as e:
            raise OlmoflowError(f"plugins: cannot import '{plugin}': {e}") from None


def _tagger_specs(spec: Any) -> list[tuple[str, dict[str, Any]]]:
    """Normalize a task's ``taggers``: a name, a list of names / one-key dicts, or a dict."""
    if isinstance(spec, str):
        return [(spec, {})]
    if isinstance(spec, dict):
        items = list(spec.items())
    elif isinstance(spec, (list, tuple)):
        items = []
        for s in spec:
            if isinstance(s, str):
                items.append((s, {}))
            elif isinstance(s, dict) and len(s) == 1:
                items.extend(s.items())
            else:
                raise OlmoflowError(f"bad tagger entry {s!r}: use a name or {{name: {{options}}}}")
    else:
        raise OlmoflowError(f"bad 'taggers' value {spec!r}: use a list of tagger names")
    out = []
    for name, opts in items:
        if opts is None:
            opts = {}
        if not isinstance(opts, dict):
            raise OlmoflowError(f"options of tagger '{name}' must be a mapping, got {opts!r}")
        out.append((str(name), dict(opts)))
    return out


def _read_lines(path: Path, errors: list[str], strict: bool):
    """Yield ``(line_number, raw_bytes)`` of a (gzipped) JSONL file; damage ends the file early."""
    opener = gzip.open if path.name.endswith(".gz") else open
    n = 0
    try:
        with opener(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                yield n, raw
    except (EOFError, OSError, zlib.error) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        msg = f"{path}:{n + 1}: damaged file ({why})"
        if strict:
            raise OlmoflowError(msg) from None
        log.warning(msg)
        errors.append(msg)


def tag_shard(task: dict[str, Any]) -> dict[str, Any]:
    """Shard job: tag every document of one documents shard and write its attribute file.

    ``task`` keys: ``documents`` (path of a Dolma ``.jsonl[.gz]`` shard), ``output`` (the attribute
    file to write, ``.jsonl.gz``), ``taggers`` (a list of names, or ``{name: {options}}``),
    optional ``strict`` (raise at the first bad line instead of counting it).

    The output has one line per non-blank line of the documents file (blank lines are skipped, as
    every documents reader does), ``{"id", "attributes"}``; a line that is not a usable document
    gets ``{"id": null, "attributes": {}}`` so alignment holds, and is counted in ``errors`` with
    its file and line. A damaged gzip stream ends the shard there (counted too). The file is
    written atomically and deterministically (gzip mtime 0), so reruns and any number of workers
    give identical bytes.

    Returns the executor's stats: ``documents_in``, ``documents_out`` (attribute lines written),
    ``bytes_in`` (UTF-8 bytes of text), ``errors``, ``outputs``, plus ``seconds`` per tagger.

    Raises:
        OlmoflowError: unknown tagger or option; with ``strict``, the first bad line.
    """
    src, out = Path(task["documents"]), Path(task["output"])
    strict = bool(task.get("strict", False))
    if not src.is_file():
        raise OlmoflowError(f"no such documents shard: '{src}'")
    taggers = make_taggers(task["taggers"])
    seconds = dict.fromkeys((t.name for t in taggers), 0.0)
    errors: list[str] = []
    stats = {"documents_in": 0, "documents_out": 0, "bytes_in": 0}
    block: list[bytes] = []
    size = 0
    with (
        atomic_open(out, "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz,
    ):
        for lineno, line in _read_lines(src, errors, strict):
            if not line.strip():
                continue  # readers skip blank lines too; keep the same line count as them
            doc, why = _parse(line)
            record: dict[str, Any] = {"id": None, "attributes": {}}
            if doc is None:
                msg = f"{src}:{lineno}: {why}"
                if strict:
                    raise OlmoflowError(msg)
                log.warning(msg)
                errors.append(msg)
            else:
                stats["documents_in"] += 1
                stats["bytes_in"] += len(doc["text"].encode("utf-8", "replace"))
                record["id"] = doc.get("id")
                attrs = record["attributes"]
                for t in taggers:
                    t0 = time.perf_counter()
                    attrs.update(t.tag(doc))
                    seconds[t.name] += time.perf_counter() - t0
            data = _encode(record)
            block.append(data)
            size += len(data)
            stats["documents_out"] += 1
            if size >= _BLOCK_BYTES:
                gz.write(b"".join(block))
                block, size = [], 0
        gz.write(b"".join(block))
    return {**stats, "errors": errors, "outputs": [str(out)], "seconds": seconds}


def _encode(record: dict[str, Any]) -> bytes:
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate in an id: escaped JSON is still valid UTF-8
        return (json.dumps(record, ensure_ascii=True) + "\n").encode("ascii")


def _parse(line: bytes) -> tuple[dict[str, Any] | None, str]:
    try:
        doc = json.loads(line)
    except ValueError as e:
        return None, f"not a JSON document ({getattr(e, 'msg', e)})"
    if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
        return None, "not a document (no string 'text' field)"
    return doc, ""


def read_attributes(path: str | Path) -> list[dict[str, Any]]:
    """All records of an attribute file written by :func:`tag_shard`, in line order."""
    with gzip.open(path, "rb") as f:
        return [json.loads(line) for line in f if line.strip()]


__all__ = [
    "Spans", "Tagger", "get_tagger", "import_plugins", "make_taggers", "read_attributes",
    "register_tagger", "tag_shard",
    "tagger_names",
]
