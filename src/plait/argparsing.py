"""One argument-parser class for every `plait` command: each option's help ends with its default (when it has
one worth saying), and the subcommands of a command get the same class (argparse gives sub-parsers their
parent's class)."""

from __future__ import annotations

import argparse

from plait.errors import ConfigError


class _DefaultsFormatter(argparse.HelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        quiet = any(action.default is v for v in (None, False, argparse.SUPPRESS)) or not action.option_strings
        if quiet or "%(default)" in text:
            return text
        return f"{text} (default: %(default)s)".lstrip()


class PlaitParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        kwargs.setdefault("help", " ")  # argparse prints no help line (hence no default) for an empty help
        return super().add_argument(*args, **kwargs)


def split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    """[CONFIG] --a.b=1 --c.d 2 -> (CONFIG, ['a.b=1', 'c.d=2'])."""
    path, overrides, i = None, [], 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            if "=" in arg:
                overrides.append(arg[2:])
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                overrides.append(f"{arg[2:]}={args[i + 1]}")
                i += 1
            else:
                raise ConfigError(f"option {arg} needs a value: {arg}=VALUE")
        elif path is None:
            path = arg
        else:
            raise ConfigError(f"unexpected argument {arg!r}: give at most one config file, then --section.key=value")
        i += 1
    return path, overrides


def pop_option(args: list[str], flag: str) -> str | None:
    """Remove `--flag VALUE` / `--flag=VALUE` from args and return VALUE (None when absent)."""
    for i, arg in enumerate(args):
        if arg == flag or arg.startswith(flag + "="):
            value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
            del args[i : i + (1 if "=" in arg else 2)]
            return value
    return None


def pop_int(args: list[str], flag: str) -> int | None:
    """Remove `--flag N` / `--flag=N` from args and return N."""
    value = pop_option(args, flag)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{flag} expects an integer, got {value!r}") from None
