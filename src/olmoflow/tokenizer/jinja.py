"""Rendering a Jinja chat template the way ``transformers``' ``apply_chat_template`` does, with
limits.

The environment is ``transformers``' (``utils/chat_template_utils.py``): an
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``{% generation %}`` block that records the character span of what it renders
(``return_assistant_tokens_mask``), ``raise_exception`` and ``strftime_now`` as globals and its
``tojson`` filter (no HTML escaping, ``ensure_ascii=False``). So the text equals ``transformers``'
rendering of the same template and variables.

A template is code from the model's files, so rendering is bounded: the sandbox forbids
attribute access to internals and mutation of the inputs; on top of it every attribute and item
access, call, filter, loop step and output piece checks a deadline (:data:`MAX_SECONDS`) and every
string it builds (``+``, ``~``, ``*``, ``%``, filters, calls, the output) a size limit
(:data:`MAX_CHARS`); a ``**`` with a large exponent is refused, and runaway recursion stops at
Python's limit. Any failure, a ``raise_exception`` of the template's own included, is one
:class:`~olmoflow.errors.OlmoflowError` line.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

from olmoflow.errors import OlmoflowError

MAX_SECONDS = 5.0  # per rendering; a chat template renders in milliseconds
MAX_CHARS = 16 * 2**20  # characters of the rendered text and of any string built on the way
MAX_EXPONENT = 256
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

_state = threading.local()  # the limits and the rendered pieces of the rendering in progress


def _tick() -> None:
    deadline = getattr(_state, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise OlmoflowError(f"chat template: rendering took longer than {_state.seconds:g} s")


def _max() -> int:
    return getattr(_state, "max_chars", None) or MAX_CHARS  # constant folding runs outside


def _sized(value: Any) -> Any:
    if isinstance(value, str | list | tuple) and len(value) > _max():
        raise OlmoflowError(f"chat template: a value of {len(value)} items exceeds the "
                            f"{_max()}-character limit")
    return value


_WIDTH = re.compile(r"%[-+ #0]*(\d+)")


class _LimitedCodeGenerator(CodeGenerator):
    """``~`` (string concatenation) through the environment's size-checked join."""

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        self.write("environment.limited_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Environment(ImmutableSandboxedEnvironment):
    code_generator_class = _LimitedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def limited_concat(self, values: tuple) -> str:
        _tick()
        return _sized("".join(map(str, values)))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        if operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
            raise OlmoflowError(f"chat template: exponent {right} is over {MAX_EXPONENT}")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(n, int) \
                        and len(seq) * n > _max():
                    raise OlmoflowError(f"chat template: a repeated value of {len(seq) * n} "
                                        f"items exceeds the {_max()}-character limit")
        if operator == "%" and isinstance(left, str) and any(
                int(w) > _max() for w in _WIDTH.findall(left)):
            raise OlmoflowError("chat template: a format width exceeds the "
                                f"{_max()}-character limit")
        return _sized(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _tick()
        if any(isinstance(a, int) and not isinstance(a, bool) and a > _max()
               for a in (*args, *kwargs.values())) and isinstance(
                   getattr(__obj, "__self__", None), str):
            raise OlmoflowError("chat template: a string method argument exceeds the "
                                f"{_max()}-character limit")
        return _sized(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)


class _GenerationTracker(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body and records its span, as
    ``transformers``' ``AssistantTracker`` does (the start is the length of the top-level output
    so far)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_generation_support"), [], [],
                               body).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _generation_support(self, context: Any, caller: Any) -> str:
        rv = caller()
        spans = getattr(_state, "spans", None)
        if spans is not None:
            start = sum(len(b) for b in _state.blocks)
            spans.append((start, start + len(rv)))
        return rv


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _range(*args: int) -> Iterator[int]:
    for i in safe_range(*args):
        _tick()
        yield i


def _limited(fn: Any) -> Any:
    @functools.wraps(fn)  # keeps jinja's pass_context / pass_eval_context marks
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _tick()
        return _sized(fn(*args, **kwargs))

    return wrapper


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached by its text).

    Raises:
        OlmoflowError: a syntax error, naming its line.
    """
    env = _Environment(trim_blocks=True, lstrip_blocks=True,
                       extensions=[_GenerationTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {k: _limited(f) for k, f in env.filters.items()}
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       range=_range)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise OlmoflowError(f"chat template line {e.lineno}: {e.message}") from None


def has_generation_blocks(source: str) -> bool:
    """Whether the template marks assistant text with ``{% generation %}`` (the test
    ``transformers`` makes before ``return_assistant_tokens_mask``)."""
    return GENERATION_TAG.search(source) is not None


def render_jinja(source: str, variables: dict[str, Any], *, seconds: float = MAX_SECONDS,
                 max_chars: int = MAX_CHARS) -> tuple[str, list[tuple[int, int]]]:
    """Render chat template ``source`` with ``variables`` (``messages``, ``add_generation_prompt``,
    ``bos_token``, ...): ``(text, generation spans)``, the spans being the ``[start, end)``
    character ranges of the ``{% generation %}`` blocks.

    Raises:
        OlmoflowError: a syntax or rendering error (the template's ``raise_exception`` too),
            longer than ``seconds``, a text or value over ``max_chars`` characters, or recursion
            too deep.
    """
    template = compile_template(source)
    if getattr(_state, "blocks", None) is not None:
        raise OlmoflowError("chat template: a rendering is already in progress in this thread")
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    _state.blocks, _state.spans = blocks, spans
    _state.seconds, _state.max_chars = seconds, max_chars
    _state.deadline = time.monotonic() + seconds
    size = 0
    try:
        for block in template.generate(**variables):
            _tick()
            size += len(block)
            if size > max_chars:
                raise OlmoflowError(f"chat template: the rendered text exceeds {max_chars} "
                                    "characters")
            blocks.append(block)
        return "".join(blocks), spans
    except OlmoflowError:
        raise
    except jinja2.TemplateError as e:
        raise OlmoflowError(f"chat template: {e.message or type(e).__name__}") from None
    except RecursionError:
        raise OlmoflowError("chat template: recursion too deep") from None
    except MemoryError:
        raise OlmoflowError("chat template: out of memory while rendering") from None
    except Exception as e:  # a template's own error (a TypeError, a KeyError) is bad input
        raise OlmoflowError(f"chat template: {type(e).__name__}: {e}") from None
    finally:
        _state.blocks = _state.spans = _state.deadline = _state.max_chars = None
