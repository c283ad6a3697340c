"""The configuration mechanism: YAML files, dotted ``key=value`` overrides, dict -> dataclass.

Each package defines its own config sections beside the code they configure (``train.config``,
``data.config``, ...); :mod:`olmoflow.pipeline.config` composes them into a run's config, and the
data engine composes its own. Both go through :func:`from_dict`, so every config file obeys one set
of rules:

- an unknown key is an error naming the closest valid key (over the whole config, so a misspelt
  section still gets the right hint);
- a value of the wrong type is an error naming the key;
- a value out of range is an error naming its full dotted key: a section's ``__post_init__``
  raises :class:`ConfigValueError` with the field's name, and :func:`from_dict` puts the section's
  path in front (``sources[0].options.max_document_bytes must be ...``);
- a section may accept older spellings of its keys: a dataclass with a classmethod
  ``upgrade_keys(data, prefix) -> data`` rewrites its raw mapping before it is checked, and calls
  :func:`note_renamed` so the user sees one line naming the new key (:func:`note_equivalent` for
  another project's key, OLMo's, read as its exact equivalent).
"""

from __future__ import annotations

import dataclasses
import os
import reprlib
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from olmoflow.errors import OlmoflowError, closest

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 4, 120, 120


def shown(value: Any) -> str:
    """``repr(value)`` for an error message, bounded in length and depth (a value nested
    thousands deep must not overflow the stack while it is named)."""
    return _REPR.repr(value)

_NOTED: set[tuple[str, str]] = set()


class ConfigValueError(OlmoflowError):
    """A field of a config section holds a bad value: raised by a section's ``__post_init__``
    with the field's name (``key``, empty for the section as a whole) and the ``problem``;
    :func:`from_dict` re-raises it as one :class:`OlmoflowError` naming the full dotted key."""

    def __init__(self, key: str, problem: str) -> None:
        self.key, self.problem = key, problem
        super().__init__(self._text(key))

    def _text(self, where: str) -> str:
        # "x.ngram must be ..." reads as a sentence; "x.evals: unknown eval set ..." needs a colon.
        if not where:
            return self.problem
        verb = self.problem.split(" ", 1)[0]
        sep = " " if verb in ("must", "does", "needs", "expects", "is") else ": "
        return f"{where}{sep}{self.problem}"

    def at(self, prefix: str) -> OlmoflowError:
        """The error with the section's dotted ``prefix`` (``"dedup.minhash."``) in front."""
        return OlmoflowError(self._text(f"{prefix}{self.key}" if self.key else prefix.rstrip(".")))


def check_int64(obj: Any) -> None:
    """Raise :class:`ConfigValueError` for the first integer field of the dataclass ``obj`` that
    does not fit in 64 bits (NumPy, the hashes and the C libraries take them as C integers)."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, int) and not isinstance(v, bool) and not -2**63 <= v < 2**63:
            raise ConfigValueError(f.name, f"does not fit in 64 bits, got {v}")


def note_renamed(old: str, new: str) -> None:
    """Tell the user once per process (under torchrun: on rank 0 only) that config key ``old`` is
    now spelt ``new``."""
    if (old, new) not in _NOTED:
        _NOTED.add((old, new))
        if os.environ.get("RANK", "0") != "0":
            return
        print(f"olmoflow: note: config key '{old}' is now '{new}'", file=sys.stderr)


def note_equivalent(theirs: str, ours: str, source: str = "OLMo") -> None:
    """Tell the user once per process (rank 0 only) that ``source``'s config key ``theirs`` was
    read as olmoflow's ``ours``, its exact equivalent."""
    if (theirs, ours) not in _NOTED:
        _NOTED.add((theirs, ours))
        if os.environ.get("RANK", "0") != "0":
            return
        print(f"olmoflow: note: {source}'s config key '{theirs}' is read as '{ours}'",
              file=sys.stderr)


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the dataclass ``cls`` (``train.optimizer.lr``, ...)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            keys += all_keys(t, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and return it; ints are accepted for floats,
    a scalar for a one-element list, and ``"1e-3"`` (YAML 1.1 reads it as a string) for a float.

    Raises:
        OlmoflowError: the value does not fit the type, or a mapping in it has a key that is not a
            string; the message names ``key``.
    """
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(value, tp):
        return value  # a section already built (a library caller's)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, key)
            except OlmoflowError as e:
                errors.append(e)
        raise errors[0]
    if origin is list:
        (inner,) = typing.get_args(tp) or (Any,)
        if isinstance(value, str | int | float):
            value = [value]
        if not isinstance(value, list):
            raise OlmoflowError(f"config key '{key}' expects a list, got {shown(value)}")
        return [coerce(v, inner, key) for v in value]
    if origin is tuple:
        args = typing.get_args(tp)
        if isinstance(value, str | int | float):
            value = [value]
        if not isinstance(value, list | tuple):
            raise OlmoflowError(f"config key '{key}' expects a list, got {shown(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, args[0], key) for v in value)
        if args and len(args) != len(value):
            raise OlmoflowError(f"config key '{key}' expects {len(args)} values, "
                                f"got {shown(value)}")
        return tuple(coerce(v, a, key) for v, a in zip(value, args or [Any] * len(value)))
    if origin is dict or tp is Any:
        if origin is dict and not isinstance(value, dict):
            raise OlmoflowError(f"config key '{key}' expects a mapping, got {shown(value)}")
        _check_string_keys(value, key)
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key + ".")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if tp is bool and not isinstance(value, bool):
        raise OlmoflowError(f"config key '{key}' expects true/false, got {shown(value)}")
    if tp in (int, float, str) and (not isinstance(value, tp) or isinstance(value, bool)):
        raise OlmoflowError(f"config key '{key}' expects {tp.__name__}, got {shown(value)}")
    return value


def _check_string_keys(value: Any, key: str) -> None:
    """Raise :class:`OlmoflowError` naming ``key`` if a mapping anywhere in ``value`` has a key
    that is not a string: YAML reads ``1: 2`` as an integer key, which breaks the sorted JSON of
    fingerprints and manifests later. Walked with a stack, so deep values cannot overflow it."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for k in node:
                if not isinstance(k, str):
                    raise OlmoflowError(f"config key '{key}' holds a mapping key {k!r} that is not "
                                        "a string; quote it")
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def from_dict(cls: type, data: Any, prefix: str = "", *, universe: list[str] | None = None) -> Any:
    """Build the dataclass ``cls`` from a mapping (nested dataclasses from nested mappings).

    Args:
        prefix: the dotted path of this section in the whole config (``"train."``), for messages.
        universe: every valid dotted key of the whole config, for closest-key hints (default: the
            keys of ``cls`` under ``prefix``).
    Raises:
        OlmoflowError: not a mapping, an unknown key (with the closest valid one), a wrong type, or
            whatever the dataclass's own ``__post_init__`` checks.
    """
    if universe is None:
        universe = all_keys(cls, prefix)
    if data is None:
        raise OlmoflowError(f"config section '{prefix.rstrip('.')}' is empty (null); give its keys "
                            "or leave it out")
    if not isinstance(data, dict):
        raise OlmoflowError(f"config section '{prefix.rstrip('.') or '<root>'}' must be a mapping, "
                            f"got {shown(data)}")
    upgrade = getattr(cls, "upgrade_keys", None)
    if upgrade is not None:
        data = upgrade(dict(data), prefix)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        if k not in names:
            # A misspelt section ("trian.max_steps=5") is named by its first full key, so the hint
            # is "train.max_steps" rather than whichever key is closest to the section's name.
            full = f"{prefix}{k}"
            while isinstance(v, dict) and v:
                sub, v = next(iter(v.items()))
                full += f".{sub}"
            hint = closest(full, universe) or closest(str(k), names)
            raise OlmoflowError(
                f"unknown config key '{full}'" + (f"; did you mean '{hint}'?" if hint else "")
            )
        tp = hints[k]
        if dataclasses.is_dataclass(tp) and isinstance(v, tp):
            kwargs[k] = v  # a section already built (a library caller's)
        elif dataclasses.is_dataclass(tp):
            default = _section_default(cls, k, tp)
            if default is not None and isinstance(v, dict):
                # A section whose parent gives it other defaults than its class (sft.train's
                # learning rate is not pretraining's): the keys given are merged over those.
                v = merge(dataclasses.asdict(default), upgrade_tree(tp, v, f"{prefix}{k}."))
            kwargs[k] = from_dict(tp, v, f"{prefix}{k}.", universe=universe)
        else:
            kwargs[k] = coerce(v, tp, f"{prefix}{k}")
    try:
        return cls(**kwargs)
    except ConfigValueError as e:
        raise e.at(prefix) from None


def as_section(cls: type, value: Any, prefix: str) -> Any:
    """``value`` if it already is a ``cls``, else :func:`from_dict` of it (None: the defaults):
    what a library function taking "a section or its mapping" calls.

    Raises:
        OlmoflowError: as :func:`from_dict`.
    """
    if isinstance(value, cls):
        return value
    return from_dict(cls, {} if value is None else value, prefix)


def _section_default(cls: type, name: str, tp: type) -> Any:
    """The default of the nested section ``name`` of ``cls`` when it differs from ``tp()``."""
    for f in dataclasses.fields(cls):
        if f.name == name and f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
            try:
                plain = tp()
            except TypeError:
                return None
            return None if default == plain else default
    return None


def upgrade_tree(cls: type, tree: Any, prefix: str = "") -> Any:
    """``tree`` with every section's older key spellings rewritten by its ``upgrade_keys`` (see the
    module docstring), recursively; what is not a mapping is returned as it is (``from_dict``
    reports it)."""
    if not isinstance(tree, dict):
        return tree
    upgrade = getattr(cls, "upgrade_keys", None)
    tree = upgrade(dict(tree), prefix) if upgrade is not None else dict(tree)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]) and isinstance(tree.get(f.name), dict):
            tree[f.name] = upgrade_tree(hints[f.name], tree[f.name], f"{prefix}{f.name}.")
    return tree


def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``: mappings merge key by key, anything else in ``top`` replaces."""
    out = dict(base)
    for k, v in top.items():
        out[k] = merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """Set ``a.b.c = value`` in a nested mapping, creating sections; a mapping merges into one."""
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise OlmoflowError(f"config override '{key}': '{p}' is not a section")
    old = node.get(parts[-1])
    if isinstance(old, dict) and isinstance(value, dict):  # "train={max_steps: 1}" merges
        node[parts[-1]] = {**old, **value}
    else:
        node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``key=value``; the value is parsed as YAML (``3``, ``1e-3``, ``true``, ``[a, b]``).

    Raises:
        OlmoflowError: no ``=``, or a value nested too deeply to parse.
    """
    if "=" not in text:
        raise OlmoflowError(f"override '{text}' is not of the form key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw
    except RecursionError:
        # PyYAML composes nodes recursively: a value nested thousands deep exhausts the stack.
        raise OlmoflowError(f"override '{key.strip()}': the value is nested too deeply") from None
    return key.strip(), value


def resolve_preset(name_or_path: str, subdir: str = "") -> Path:
    """Find a YAML config: an existing path, else ``configs/<subdir>/<name>.yaml`` (under the
    current directory first, then the repository's).

    Raises:
        OlmoflowError: neither exists; names the closest preset.
    """
    p = Path(name_or_path)
    if p.is_file():
        return p
    for base in (Path.cwd() / "configs" / subdir, CONFIG_DIR / subdir):
        cand = base / f"{name_or_path}.yaml"
        if cand.is_file():
            return cand
    where = CONFIG_DIR / subdir
    presets = sorted(q.stem for q in where.glob("*.yaml")) if where.is_dir() else []
    hint = closest(p.stem, presets)
    raise OlmoflowError(
        f"config '{name_or_path}' not found (no such file, and not a preset"
        + (f"; did you mean '{hint}'?)" if hint else f"; presets: {', '.join(presets)})")
    )


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """A YAML config file's top-level mapping (empty file: ``{}``).

    Raises:
        OlmoflowError: invalid YAML (naming ``file:line``), nested too deeply, not UTF-8, or a top
            level that is not a mapping.
    """
    text = ""
    try:
        text = Path(path).read_text()
        tree = yaml.safe_load(text)
        if tree is None:  # an empty file (or only comments); `[]`, `0`, `false` are not mappings
            tree = {}
    except yaml.reader.ReaderError as e:  # a control character: no mark, a character position
        line = text.count("\n", 0, e.position) + 1
        raise OlmoflowError(f"{path}:{line}: invalid YAML (character {e.character!r}: "
                            f"{' '.join(str(e.reason).split())})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        # One line whatever PyYAML says: its messages may span several.
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise OlmoflowError(f"{where}: invalid YAML ({problem})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise OlmoflowError(f"{path}: cannot read ({e})") from None
    except RecursionError:
        # PyYAML composes nodes recursively: nesting thousands deep exhausts the stack.
        raise OlmoflowError(f"{path}: invalid YAML (nested too deeply)") from None
    if not isinstance(tree, dict):
        raise OlmoflowError(f"{path}: the top level must be a mapping of sections, "
                            f"got a {type(tree).__name__}")
    return tree


def load_tree(name_or_path: str | None, overrides: list[str] | None = None,
              values: dict[str, Any] | None = None, subdir: str = "",
              schema: type | None = None,
              reroot: Callable[[str], str] | None = None) -> dict[str, Any]:
    """The raw config mapping: a YAML file or preset, then ``key=value`` overrides (values parsed
    as YAML), then ``values`` (dotted key -> Python value, what CLI flags set), in that order: a
    later value wins.

    With ``schema`` (the root dataclass), the file and each override are brought to the current
    key spellings (:func:`upgrade_tree`) before they are merged, so an old spelling and a new one
    of the same key never both survive: ``train.lr=1e-3 train.optimizer.lr=5e-3`` is 5e-3, and an
    old-style file still takes new-style overrides.

    ``reroot`` maps a dotted key to where it belongs (a finetuning config's top-level ``train``
    is ``sft.train``): applied to the file's top-level keys and to every override's key, before
    anything is upgraded or merged.
    """
    def upgraded(tree: dict[str, Any]) -> dict[str, Any]:
        return upgrade_tree(schema, tree) if schema is not None else tree

    tree: dict[str, Any] = {}
    if name_or_path:
        raw = read_yaml_mapping(resolve_preset(name_or_path, subdir))
        if reroot is not None:
            moved: dict[str, Any] = {}
            for key, value in raw.items():
                if not isinstance(key, str):  # YAML's ``1: 2``: from_dict names it as it is
                    moved[key] = value
                    continue
                part: dict[str, Any] = {}
                set_dotted(part, reroot(key), value)
                moved = merge(moved, part)
            raw = moved
        tree = upgraded(raw)
    pairs = [parse_override(ov) for ov in overrides or []] + list((values or {}).items())
    if reroot is not None:
        pairs = [(reroot(k), v) for k, v in pairs]
    for key, value in pairs:
        if schema is None:
            set_dotted(tree, key, value)
            continue
        part: dict[str, Any] = {}
        set_dotted(part, key, value)
        tree = merge(tree, upgraded(part))
    return tree


def to_yaml(obj: Any) -> str:
    """A config dataclass as YAML text, in field order."""
    return yaml.safe_dump(dataclasses.asdict(obj), sort_keys=False, allow_unicode=True)
