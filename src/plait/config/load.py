"""Building a config: defaults -> model preset (its shape, and for the large ones their published peak learning
rate) -> TOML file -> ``--section.key=value`` overrides (later wins), validated; and writing one back out (a
dict, TOML, the options' help)."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import tomllib
import typing
from functools import cache
from pathlib import Path
from typing import Any, Literal, cast

from plait.config.fields import convert, hints, type_name
from plait.config.recipes import PRESET_LR
from plait.config.sections import SECTIONS, Config
from plait.config.validate import a_or_an, validate
from plait.core.errors import ConfigError
from plait.model.args import ModelArgs
from plait.model.presets import PRESETS


def load_config(path: str | Path | None = None, overrides: list[str] | str | None = None) -> Config:
    """Build a validated Config from an optional TOML file and ``section.key=value`` overrides (a list of
    them, or one as a string)."""
    if isinstance(overrides, str):  # one override: not a sequence of one-character overrides
        overrides = [overrides]
    values: dict[str, dict[str, Any]] = {}
    if path is not None:
        values = _read_toml(Path(path))
    for item in overrides or []:
        key, value = _split_override(item)
        section, name = _split_key(key)
        values.setdefault(section, {})[name] = value  # a string: converted by the field's type below
    return validate(_build(values))


def _read_toml(path: Path) -> dict[str, dict[str, Any]]:
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; give a .toml file")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte {e.start}: {e.object[e.start : e.start + 1]!r}); "
            f"TOML files are UTF-8: save it as UTF-8"
        ) from None
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    for section, body in data.items():
        if not isinstance(body, dict):
            raise ConfigError(f"config file {str(path)!r}: {_outside_a_table(section)}")
        if section not in SECTIONS:
            raise ConfigError(f"config file {str(path)!r}: unknown section [{section}]{_suggest(section, SECTIONS)}")
        known = [*hints(SECTIONS[section]), *(["preset"] if section == "model" else [])]
        for name in body:
            if name not in known:
                hint = _suggest_setting(section, name, known)
                raise ConfigError(
                    f"config file {str(path)!r}: unknown setting '{section}.{name}' ([{section}] {name}){hint}"
                )
    return data


def _outside_a_table(key: str) -> str:
    """What is wrong with `key = value` above every [section] of a TOML file, and where it belongs."""
    if key in SECTIONS:
        return f"'{key}' must be a table ([{key}]), not a single value"
    owners = [section for section, kind in SECTIONS.items() if key in hints(kind)]
    if owners:
        return f"'{key}' is outside any section; did you mean it under [{owners[0]}] ({owners[0]}.{key})?"
    return f"'{key}' is outside any section, and no section has it{_suggest(key, SECTIONS)}"


def _split_override(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.steps=100)")
    key, value = item.split("=", 1)
    return key.strip().removeprefix("--"), value


def _split_key(key: str) -> tuple[str, str]:
    if key.count(".") != 1:
        raise ConfigError(f"setting {key!r} must be section.key, e.g. optim.lr")
    section, name = key.split(".")
    _check_section(section)
    return section, name


def _check_section(section: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section {section!r}{_suggest(section, SECTIONS)}")


def _suggest_setting(section: str, name: str, valid: list[str]) -> str:
    """A close name in the same section, else the same name in another section (train.lr -> optim.lr),
    always spelt in full as it is typed: section.key."""
    close = difflib.get_close_matches(name, valid, n=1)
    if close:
        return f"; did you mean '{section}.{close[0]}'?"
    elsewhere = [f"{other}.{name}" for other, kind in SECTIONS.items() if name in hints(kind)]
    if elsewhere:
        return f"; did you mean {' or '.join(repr(e) for e in elsewhere)}?"
    return f"; valid: {', '.join(f'{section}.{v}' for v in sorted(valid))}"


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(sorted(options))}"


def _build(values: dict[str, dict[str, Any]]) -> Config:
    cfg = Config()
    model = values.get("model")
    if isinstance(model, dict) and "preset" in model:  # first, whatever the sections' order: the rest wins
        preset = str(model["preset"])
        if preset not in PRESETS:
            close = difflib.get_close_matches(preset, list(PRESETS), n=1)
            hint = f"did you mean {close[0]!r}? valid" if close else "valid"
            raise ConfigError(f"model.preset={preset!r} is not a preset; {hint}: {', '.join(PRESETS)}")
        cfg.model = ModelArgs(**PRESETS[preset])
        cfg.optim.lr = PRESET_LR.get(preset, (cfg.optim.lr, ""))[0]
    for section, body in values.items():
        _check_section(section)
        if not isinstance(body, dict):
            raise ConfigError(f"config section '{section}' must be a table of settings, not {body!r:.40}")
        body = {k: v for k, v in body.items() if not (section == "model" and k == "preset")}
        target = getattr(cfg, section)
        known = hints(cast(type, type(target)))  # type[Any] is not seen as Hashable
        for name, raw in body.items():
            if name not in known:
                valid = list(known) + (["preset"] if section == "model" else [])
                raise ConfigError(f"unknown setting '{section}.{name}'{_suggest_setting(section, name, valid)}")
            setattr(target, name, convert(f"{section}.{name}", raw, known[name]))
    return cfg


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under dataclass fields (Python does not keep them, so read the source)."""
    docs: dict[str, str] = {}
    tree = ast.parse(inspect.getsource(cls))
    body = cast(ast.ClassDef, tree.body[0]).body  # the source of a class
    for node, nxt in zip(body, body[1:], strict=False):
        if not (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            continue  # no docstring under it
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def options_help() -> str:
    """Every option as `--section.key` with its type, default and docstring (the CLI prints this)."""
    default = Config()
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        if section == "model":
            lines.append(
                f"  --model.preset NAME  Start from a preset shape: {', '.join(PRESETS)}; the large ones also set "
                f"optim.lr to their model's published peak (plait.config.recipes). (tiny)"
            )
        docs = field_docs(cls)
        for name, typ in hints(cls).items():
            value = getattr(getattr(default, section), name)
            choices = typing.get_args(typ) if typing.get_origin(typ) is Literal else None
            kind = "|".join(choices) if choices else type_name(typ).split()[1]
            lines.append(f"  --{section}.{name} {kind.upper()}  {docs.get(name, '')} ({value!r})")
    return "\n".join(lines)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML: every section, every key (values are plain scalars)."""
    out = []
    for section, body in to_dict(cfg).items():
        out.append(f"[{section}]")
        out.extend(f"{key} = {_toml_value(value)}" for key, value in body.items())
        out.append("")
    return "\n".join(out)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float):
        return repr(value)
    return str(value)


def from_dict(data: dict[str, dict[str, Any]]) -> Config:
    """A validated config from {section: {key: value}} (as to_dict gives it, or a checkpoint holds it); keys
    not given keep their defaults."""
    if not isinstance(data, dict):
        raise ConfigError(f"from_dict takes {{section: {{key: value}}}}, not {a_or_an(type(data).__name__)}")
    return validate(_build(data))
