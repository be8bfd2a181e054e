"""A setting's type, and a value (a TOML value, a command-line string, a Python object) converted to it or
refused naming the setting and what it expects."""

from __future__ import annotations

import dataclasses
import math
import typing
from functools import cache
from typing import Any, Literal, cast

from plait.core.errors import ConfigError


@cache
def hints(cls: type) -> dict[str, Any]:
    every = typing.get_type_hints(cls)  # once: it evaluates every annotation of the class
    return {f.name: every[f.name] for f in dataclasses.fields(cls)}


def convert(key: str, raw: Any, typ: Any) -> Any:
    """Convert a TOML value or a command-line string to the field's type, or say what was expected."""
    choices = typing.get_args(typ) if typing.get_origin(typ) is Literal else None
    base = str if choices else typ
    if choices and isinstance(raw, bool) and str(raw).lower() in choices:
        raw = str(raw).lower()  # a TOML true / false for a setting whose choices include them (compile.float8)
    try:
        if isinstance(raw, str) and base is not str:
            raw = _parse_string(raw, base)
        if base is bool and not isinstance(raw, bool):
            raise TypeError
        if base is float and isinstance(raw, int) and not isinstance(raw, bool):
            raw = float(raw)
        if not isinstance(raw, base) or (base is int and isinstance(raw, bool)):
            raise TypeError
    except (TypeError, ValueError):
        expected = f"one of {', '.join(map(repr, choices))}" if choices else type_name(base)
        raise ConfigError(f"{key} expects {expected}, got {raw!r}") from None
    if choices and raw not in choices:
        raise ConfigError(f"{key}={raw!r} is not allowed; choose one of {', '.join(map(repr, choices))}")
    if base is float and not math.isfinite(cast(float, raw)):  # a float: checked above
        raise ConfigError(f"{key} must be a finite number, got {raw!r}")
    return raw


def _parse_string(raw: str, base: type) -> Any:
    if base is bool:
        low = raw.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ValueError
    return base(raw.strip())


def type_name(t: type) -> str:
    return {int: "an integer", float: "a number", bool: "a boolean (true/false)", str: "a string"}.get(t, str(t))
