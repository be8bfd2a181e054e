"""Chat templates rendered within limits: a template comes with a tokenizer directory from outside, so it is data.

Jinja's immutable sandbox (as transformers' apply_chat_template uses) bounds what a template may touch, not
how long it runs or how much it builds (STYLE 29); this environment bounds both, per render:

- time: RENDER_TIME_S of wall clock, checked at every loop iteration, call, filter, intercepted operator and
  printed piece (nested `range(99999)` loops stop there). Real templates (ChatML, Llama 3, Qwen 2.5, SmolLM2)
  render a conversation in well under a millisecond.
- size: MAX_CHARS characters for the rendered text and for any string, list or namespace value built on the
  way; the operations that multiply text (`*`, `+`, `%`, `**` and `*` on integers past MAX_INT_BITS,
  str.format widths, center/ljust/rjust/zfill/expandtabs, replace, join, and the filters center, indent,
  wordwrap, join, replace, batch, slice, format, sum, tojson's indent, and lipsum) are refused *before* they
  would build more (`'x' * 300000000` never allocates).
- depth: Python's recursion limit (a macro calling itself without end is refused, not a crash).
- memory: on Linux, the process's address space may grow by at most MAX_RENDER_BYTES while a template renders
  (RLIMIT_AS, restored after), so what the checks above do not foresee ends in a MemoryError, refused.
- text: a template of more than MAX_TEMPLATE_CHARS characters is refused before it is compiled.

A render past a limit raises RenderLimit (its message says which limit); the caller names the template.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from datetime import datetime
from typing import Any, cast

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_TIME_S = 2.0
MAX_CHARS = 1 << 23  # 8,388,608 characters: ~2M tokens in one conversation
MAX_INT_BITS = 4096
MAX_JSON_INDENT = 64
MAX_RENDER_BYTES = 1 << 30
MAX_TEMPLATE_CHARS = 1 << 20

_deadline: ContextVar[float] = ContextVar("plait_template_deadline", default=math.inf)


class RenderLimit(Exception):
    """A render went past one of the limits; the message says which."""


def _tick() -> None:
    if time.monotonic() > _deadline.get():
        raise RenderLimit(f"ran past the limit of {RENDER_TIME_S:g} s for one render (a loop that does not end?)")


def _refuse_size(n: int, what: str) -> None:
    if n > MAX_CHARS:
        raise RenderLimit(f"would build {what} of {n:,} characters, past the limit of {MAX_CHARS:,}")


def _sized(value: Any) -> Any:
    if isinstance(value, (str, list, tuple, dict)):
        _refuse_size(len(value), f"a {type(value).__name__}")
    elif isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise RenderLimit(f"would build an integer of {value.bit_length():,} bits, past the limit of {MAX_INT_BITS}")
    return value


# ------------------------------------------------------------------------------- estimates of what is built


def _arg(args: tuple, kwargs: dict, at: int, name: str, default: Any = 0) -> Any:
    return args[at] if len(args) > at else kwargs.get(name, default)


def _int(x: Any) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) else 0


def _length(x: Any) -> int:
    return len(x) if isinstance(x, (str, list, tuple, dict)) else len(str(x)) if isinstance(x, (int, float)) else 0


def _replaced(s: Any, old: Any, new: Any) -> int:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    return len(s) + (len(s) + 1 if not old else s.count(old)) * len(new)


def _joined(sep: Any, items: Any) -> int:
    if not isinstance(items, (list, tuple, str)):
        return 0
    return _length(sep) * len(items) + sum(_length(x) for x in items)


def _printf_size(fmt: str, values: Any) -> int:
    """A bound on what `fmt % values` builds: the text, the widths and precisions its specs name, its values."""
    specs = re.findall(r"%[-#0 +]*(\d{1,12}|\*)?(?:\.(\d{1,12}|\*))?", fmt)
    values = values if isinstance(values, tuple) else (values,)
    stars = any("*" in spec for spec in specs)  # widths taken from the values
    widths = sum(int(d) for spec in specs for d in spec if d.isdigit())
    return len(fmt) + widths + sum(_length(v) + (_int(v) if stars else 0) for v in values)


def _format_size(fmt: str, values: list) -> int:
    """A bound on what `fmt.format(*values)` builds: the text, the numbers in its fields, its values (and their
    integers where a field takes its width from one: `{:{}}`)."""
    fields = re.findall(r"\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}", fmt)
    nested = any(f.count("{") > 1 for f in fields)
    widths = sum(int(d) for f in fields for d in re.findall(r"\d{1,12}", f))
    return len(fmt) + widths + sum(_length(v) + (_int(v) if nested else 0) for v in values)


def _indented(text: Any, width: Any) -> int:
    lines = text.count("\n") + 1 if isinstance(text, str) else 0
    return _length(text) + lines * (len(width) if isinstance(width, str) else _int(width))


def _summed(items: Any, start: Any) -> int:
    """sum() of strings or lists copies its running total once per item."""
    if isinstance(start, (int, float)) or not isinstance(items, (list, tuple)):
        return 0
    return len(items) * sum(_length(x) for x in items)


_METHODS: dict[str, Callable[[Any, tuple, dict], int]] = {  # str method -> characters it would build
    "center": lambda s, a, k: _int(_arg(a, k, 0, "width")),
    "ljust": lambda s, a, k: _int(_arg(a, k, 0, "width")),
    "rjust": lambda s, a, k: _int(_arg(a, k, 0, "width")),
    "zfill": lambda s, a, k: _int(_arg(a, k, 0, "width")),
    "expandtabs": lambda s, a, k: len(s) * _int(_arg(a, k, 0, "tabsize", 8)),
    "replace": lambda s, a, k: _replaced(s, _arg(a, k, 0, "old", "x"), _arg(a, k, 1, "new", "")),
    "join": lambda s, a, k: _joined(s, _arg(a, k, 0, "iterable", ())),
    "format": lambda s, a, k: _format_size(s, [*a, *k.values()]),
    "format_map": lambda s, a, k: _format_size(s, list(dict(_arg(a, k, 0, "mapping", {})).values())),
}
_FILTERS: dict[str, Callable[[Any, tuple, dict], int]] = {  # filter -> characters (items) it would build
    "center": lambda v, a, k: _int(_arg(a, k, 0, "width", 80)),
    "indent": lambda v, a, k: _indented(v, _arg(a, k, 0, "width", 4)),
    "wordwrap": lambda v, a, k: _length(v) * (1 + _length(_arg(a, k, 2, "wrapstring", "\n"))),
    "join": lambda v, a, k: _joined(_arg(a, k, 0, "d", ""), list(v) if isinstance(v, (list, tuple)) else v),
    "replace": lambda v, a, k: _replaced(v, _arg(a, k, 0, "old", "x"), _arg(a, k, 1, "new", "")),
    "batch": lambda v, a, k: _length(v) + _int(_arg(a, k, 0, "linecount")),
    "slice": lambda v, a, k: _length(v) + _int(_arg(a, k, 0, "slices")),
    "format": lambda v, a, k: _printf_size(v, tuple(a) or tuple(k.values())) if isinstance(v, str) else 0,
    "sum": lambda v, a, k: _summed(v, _arg(a, k, 1, "start", 0)),
    "tojson": lambda v, a, k: MAX_CHARS + 1 if _int(_arg(a, k, 1, "indent")) > MAX_JSON_INDENT else 0,
}


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                _refuse_size(len(seq) * max(n, 0), f"a {type(seq).__name__}")
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise RenderLimit(f"would multiply integers past the limit of {MAX_INT_BITS} bits")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        if abs(left) > 1 and (left.bit_length() - 1) * right > MAX_INT_BITS:
            raise RenderLimit(f"would raise {left} to the power {right}, past the limit of {MAX_INT_BITS} bits")
    elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        _refuse_size(len(left) + len(right), f"a {type(left).__name__}")
    elif operator == "%" and isinstance(left, str):
        _refuse_size(_printf_size(left, right), "a formatted string")


# ------------------------------------------------------------------------------------------ the environment


class _Namespace(jinja2.utils.Namespace):
    """transformers' namespace: no underscore names; each value stored is within the size limits."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: B902 (Jinja's signature: namespace(self=...) works)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name, value in attrs.items():
            _Namespace._check(name, value)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name, value)
        _tick()
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any, value: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold underscore names ({name!r})")
        _sized(value)


class _Generation(jinja2.ext.Extension):
    """transformers' {% generation %} ... {% endgeneration %} marks of an assistant's text: rendered as their
    body (plait.data.chat locates the assistant turns by rendering, so the marks are not needed)."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _LimitedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _Generation])
        self.filters = {name: _limited_filter(name, f) for name, f in self.filters.items()}
        self.filters["tojson"] = _limited_filter("tojson", _tojson)

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        self.globals.update(
            raise_exception=raise_exception,
            strftime_now=lambda fmt: datetime.now().strftime(fmt),
            dict=lambda *args, **kwargs: dict(*args, **kwargs),
            namespace=_Namespace,
        )
        lipsum = cast(Callable[..., str], self.globals["lipsum"])
        self.globals["lipsum"] = lambda n=5, html=True, min=20, max=100: lipsum(
            _capped(n * max * 12, n), html, min, max
        )

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        """Every `for` iterates through limited_iter: a loop is never outside the time limit."""
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.EnvironmentAttribute("limited_iter"), [loop.iter], [], None, None,
                                   lineno=loop.lineno)  # fmt: skip
        return tree

    def limited_iter(self, iterable: Any) -> Iterator[Any]:
        for item in iterable:
            _tick()
            yield item

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        _tick()
        _check_binop(operator, left, right)
        return _sized(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's signature)
        _tick()
        for value in (*args, *kwargs.values()):
            _sized(value)
        method = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
        target = getattr(method, "__self__", None)
        if isinstance(target, str) and getattr(method, "__name__", "") in _METHODS:
            _refuse_size(_METHODS[method.__name__](target, args, kwargs), f"a string (str.{method.__name__})")
        return _sized(super().call(__context, __obj, *args, **kwargs))


def _capped(n: int, value: Any) -> Any:
    _refuse_size(n, "a text")
    return value


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson: no HTML escaping, json.dumps' options."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _limited_filter(name: str, f: Callable) -> Callable:
    """A filter that checks the clock, refuses to build past MAX_CHARS (estimated first where it multiplies
    text) and checks what it built."""
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # a context/environment argument first
    estimate = _FILTERS.get(name)

    @functools.wraps(f)
    def limited(*args: Any, **kwargs: Any) -> Any:
        _tick()
        if estimate is not None and len(args) > skip:
            _refuse_size(estimate(args[skip], args[skip + 1 :], kwargs), f"a value (the {name} filter)")
        return _sized(f(*args, **kwargs))

    return limited


# ------------------------------------------------------------------------------------------- rendering


def compile_template(text: str) -> jinja2.Template:
    """The template, compiled in the limited sandbox (TemplateSyntaxError or RenderLimit if it cannot be)."""
    if len(text) > MAX_TEMPLATE_CHARS:
        raise RenderLimit(f"has {len(text):,} characters, past the limit of {MAX_TEMPLATE_CHARS:,} for a template")
    try:
        return _LimitedEnvironment().from_string(text)
    except RecursionError:
        raise RenderLimit("nests its blocks deeper than Python's recursion limit") from None


def render_limited(template: jinja2.Template, **variables: Any) -> str:
    """template.render(**variables) within the limits of this module (RenderLimit past one)."""
    token = _deadline.set(time.monotonic() + RENDER_TIME_S)
    pieces, size = [], 0
    try:
        with memory_window():
            for piece in template.generate(**variables):
                size += len(piece)
                _refuse_size(size, "a conversation")
                _tick()
                pieces.append(piece)
    except RecursionError:
        raise RenderLimit("recursed deeper than Python's recursion limit (a macro that calls itself?)") from None
    except MemoryError:
        raise RenderLimit(f"needed more than {MAX_RENDER_BYTES >> 20:,} MiB of memory for one render") from None
    finally:
        _deadline.reset(token)
    return "".join(pieces)


_in_window: ContextVar[bool] = ContextVar("plait_template_memory_window", default=False)


@contextlib.contextmanager
def memory_window() -> Iterator[None]:
    """While it is open, the process's address space may grow by at most MAX_RENDER_BYTES (RLIMIT_AS; Linux),
    restored after; nothing where the limit cannot be read or set. The renders of one conversation share
    one window (setting it costs ~40 us, a ChatML render ~20 us); a window inside another is the outer one."""
    if _in_window.get():
        yield
        return
    before = _lower_address_space(MAX_RENDER_BYTES)
    token = _in_window.set(True)
    try:
        yield
    finally:
        _in_window.reset(token)
        if before is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, before)


def _lower_address_space(extra: int) -> tuple[int, int] | None:
    """Lowers RLIMIT_AS to the address space used now plus `extra`; the limits before (None if unchanged)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        with open("/proc/self/statm") as f:
            ceiling = int(f.read().split()[0]) * resource.getpagesize() + extra
        if hard != resource.RLIM_INFINITY:
            ceiling = min(ceiling, hard)
        if soft != resource.RLIM_INFINITY and soft <= ceiling:
            return None
        resource.setrlimit(resource.RLIMIT_AS, (ceiling, hard))
        return soft, hard
    except (ImportError, OSError, ValueError):
        return None
