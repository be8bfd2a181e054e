"""One argument-parser class for every `plait` command: each option's help ends with its default (when it has
one worth saying), and the subcommands of a command get the same class (argparse gives sub-parsers their
parent's class)."""

from __future__ import annotations

import argparse


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
