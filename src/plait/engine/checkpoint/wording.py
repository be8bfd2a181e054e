"""How checkpoint problems are worded: one line, the innermost error, a few names of many, sizes in MiB."""

from __future__ import annotations

import re


def mb(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"


def some(items: list[str], n: int = 4) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}".rstrip(": ")


ERROR_LINE = re.compile(r"^\s*(?:[\w.]+\.)?(\w*(?:Error|Exception|Interrupt)): (.+)$")


def short(e: BaseException) -> str:
    """The innermost error line of an exception (DCP's carry whole per-rank tracebacks in their text)."""
    lines = [m for line in str(e).splitlines() if (m := ERROR_LINE.match(line))]
    if not lines:
        return one_line(e)
    name, text = lines[-1].groups()
    return f"{name}: {text.strip()}"


def warn(message: str) -> None:
    from plait.engine.metrics import warn

    warn(message)
