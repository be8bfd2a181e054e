"""Checks of a record plait reads from a file (a retrieval manifest, a PEFT adapter_config.json): parsed, then
each field checked for its kind and range before anything uses it. A failure is one ConfigError line naming
the file, the field, what it holds and what it should hold, then how to fix it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from plait.core.errors import ConfigError

_MISSING = object()


def first_line(error: BaseException, limit: int = 160) -> str:
    """An exception's message as one short line (numpy's and faiss's run over several)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_json_object(path: Path, fix: str) -> dict[str, Any]:
    """The JSON object in `path`; anything else (unreadable, not JSON, a list) is refused saying `fix`."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ConfigError(f"{path} cannot be read as JSON ({first_line(e)}): {fix}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} holds a JSON {_kind(value)}, not an object: {fix}")
    return value


class Record:
    """The fields of one JSON object read from `path`, each taken with its kind and range checked; `fix` ends
    every message (what rebuilds or corrects the file)."""

    def __init__(self, data: dict[str, Any], path: Path | str, fix: str, prefix: str = "") -> None:
        self.data, self.path, self.fix, self.prefix = data, path, fix, prefix

    def error(self, key: str, value: Any, want: str) -> ConfigError:
        shown = "missing" if value is _MISSING else f"{_short(value)} (a JSON {_kind(value)})"
        return ConfigError(f"{self.path}: {self.prefix}{key} is {shown}; it must be {want}: {self.fix}")

    def _get(self, key: str, default: Any) -> Any:
        value = self.data.get(key, default)
        if value is _MISSING:
            raise self.error(key, value, "present")
        return value

    def integer(self, key: str, minimum: int | None = None, default: Any = _MISSING) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
            raise self.error(key, value, "an integer" + (f" of at least {minimum}" if minimum is not None else ""))
        return value

    def number(self, key: str, *, positive: bool = False, below: float | None = None, default: Any = _MISSING):
        """A finite number (> 0 with positive; >= 0 and < below with below)."""
        value = self._get(key, default)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if ok and positive:
            ok = value > 0
        if ok and below is not None:
            ok = 0 <= value < below
        if not ok:
            want = "a positive number" if positive else f"a number from 0 to below {below:g}" if below else "a number"
            raise self.error(key, value, want)
        return float(value)

    def string(self, key: str, default: Any = _MISSING, *, empty: bool = True) -> str:
        value = self._get(key, default)
        if not isinstance(value, str) or (not empty and not value):
            raise self.error(key, value, "a string" if empty else "a non-empty string")
        return value

    def strings(self, key: str, default: Any = _MISSING) -> list[str]:
        """A list of strings (one string is a list of one)."""
        value = self._get(key, default)
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(key, self.data.get(key, default), "a string or a list of strings")
        return value

    def record(self, key: str, default: Any = _MISSING) -> Record:
        value = self._get(key, default)
        if not isinstance(value, dict):
            raise self.error(key, value, "a JSON object")
        return Record(value, self.path, self.fix, f"{self.prefix}{key}.")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {dict: "object", list: "list", str: "string", int: "integer", float: "number"}.get(type(value), "value")


def _short(value: Any, limit: int = 40) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
