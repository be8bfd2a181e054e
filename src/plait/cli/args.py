"""One argument-parser class for every `plait` command: each option's help ends with its default (when it has
one worth saying), and the subcommands of a command get the same class (argparse gives sub-parsers their
parent's class). Commands that take a config (train, bench, doctor, config show) parse their own options with
it too; every `--section.key[=value]` (an option whose name has a dot) is a config setting (`config_parser`,
`parse_config_args`). Descriptions and epilogs are printed as written."""

from __future__ import annotations

import argparse
import difflib
import os
import re
from pathlib import Path

from plait.core.errors import ConfigError


class _DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
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

    def error(self, message: str):
        """argparse's usage error, with the nearest known flag for each unknown one (`--promt`: `--prompt`)."""
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            hints = {flag: h for flag in unknown.group(1).split() if (h := self.flag_hint(flag))}
            if len(hints) == 1:
                message += f"; did you mean {next(iter(hints.values()))}?"
            elif hints:
                message += "; " + "; ".join(f"{flag}: did you mean {h}?" for flag, h in hints.items())
        super().error(message)

    def flag_hint(self, arg: str) -> str:
        """The flag of this parser nearest an unknown `--promt[=x]` (`--prompt`), else ''."""
        if not arg.startswith("--"):
            return ""
        flag = arg.split("=", 1)[0]
        parsers = [self]
        for action in self._actions:  # a command's subcommands (argparse reports their unknown flags here)
            if isinstance(action, argparse._SubParsersAction):
                parsers += list(action.choices.values())
        known = [s for p in parsers for a in p._actions for s in a.option_strings if s.startswith("--")]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.7)
        return close[0] if close else ""


def check_input(flag: str, path: str | None, give: str) -> None:
    """A path a command reads (a model, a run, a suite, a data directory), checked before the heavy imports:
    one that does not exist is refused naming it, what to give and, where a sibling is close, that sibling.
    An s3:// reference is checked where it is read."""
    if not path or "://" in str(path):
        return
    where = Path(path).expanduser()
    if where.exists():
        return
    said = f"{flag} {path}" if flag else str(path)
    parent = where.parent if where.parent.is_dir() else None
    close = difflib.get_close_matches(where.name, os.listdir(parent), n=1, cutoff=0.7) if parent else []
    hint = f"; did you mean {Path(path).parent / close[0]}?" if close else ""
    raise ConfigError(f"{said} does not exist: give {give}{hint}")


def check_output_file(flag: str, path: str | None, example: str) -> None:
    """A file a command will write (--json, --out FILE), checked before any work: not a directory, and its
    folder either one that can be written or one that can be made (the nearest existing folder is writable)."""
    if not path:
        return
    where = Path(path).expanduser()
    if where.is_dir():
        raise ConfigError(f"{flag} {path} is a directory; give a file path, e.g. {where / example}")
    check_output_dir(flag, str(where.parent), what="the folder of")


def check_output_dir(flag: str, path: str | None, what: str = "") -> None:
    """A directory a command will create or fill (--out DIR, run.out_dir), checked before any work: where it
    exists it is a directory, where it does not the nearest existing folder above it is one and is writable."""
    if not path:
        return
    where = Path(path).expanduser().absolute()
    said = f"{flag} {path}" if not what else f"{flag}: {what} {path}"
    if where.exists() and not where.is_dir():
        raise ConfigError(f"{said} is a file, not a directory; give a directory")
    above = where
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise ConfigError(f"{said} cannot be made: {above} is a file, not a directory")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ConfigError(f"{said} cannot be written: {above} is not writable by this user")


def _take_settings(argv: list[str], is_setting) -> tuple[list[str], list[str]]:
    """(the settings as 'name=value', the other arguments): --name=value or --name value where is_setting(name)."""
    settings: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if not name or not is_setting(name):
            rest.append(arg)
        elif "=" in arg:
            settings.append(arg[2:])
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            settings.append(f"{name}={argv[i + 1]}")
            i += 1
        else:
            raise ConfigError(f"option {arg} needs a value: {arg}=VALUE")
        i += 1
    return settings, rest


def split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    """[CONFIG] --a.b=1 --c.d 2 -> (CONFIG, ['a.b=1', 'c.d=2']): a command line that is a config and nothing else."""
    settings, rest = _take_settings(args, lambda name: True)
    if len(rest) > 1:
        raise ConfigError(f"unexpected argument {rest[1]!r}: give at most one config file, then --section.key=value")
    return (rest[0] if rest else None), settings


def config_parser(prog: str, description: str) -> PlaitParser:
    """A parser for a command that takes [CONFIG.toml] and --section.key=value settings besides its own
    options (add them); its help ends with every config setting, its type and default."""
    from plait.config import options_help

    epilog = (
        "Settings resolve in this order (later wins): defaults, model preset, CONFIG.toml, --section.key=value.\n"
        "Config settings (type, help, default):\n" + options_help()
    )
    usage = "%(prog)s [CONFIG.toml] [--section.key=value ...] [options]"
    parser = PlaitParser(prog=prog, description=description, epilog=epilog, usage=usage)
    parser.add_argument("config", nargs="?", metavar="CONFIG.toml", help="a TOML config file")
    return parser


def parse_config_args(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the command's own options, the config settings as 'section.key=value'): every --a.b=v / --a.b v is a
    setting, the rest goes to the parser (a usage error exits 2, as argparse does)."""
    settings, own = _take_settings(argv, lambda name: "." in name)
    return parser.parse_args(own), settings


def config_argv(config: str | None, settings: list[str]) -> list[str]:
    """The command line that gives the same config again (for launched workers and warm-start runs)."""
    return ([config] if config else []) + [f"--{s}" for s in settings]


def load_args(args: list[str]):
    """The validated Config of a command line's [CONFIG.toml] [--section.key=value ...]."""
    from plait.config import load_config

    path, overrides = split_config_args(args)
    return load_config(path, overrides)
