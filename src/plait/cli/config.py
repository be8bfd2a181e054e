"""`plait config show [CONFIG] [--section.key=value ...]`: the resolved config as TOML."""

from __future__ import annotations

from plait.cli.args import PlaitParser, config_argv, config_parser, load_args, parse_config_args


def cmd_config(argv: list[str]) -> int:
    if not argv or argv[0] != "show":
        parser = PlaitParser(prog="plait config", description="Print the resolved config as TOML.")
        parser.add_argument("action", choices=["show"], help="show [CONFIG.toml] [--section.key=value ...]")
        parser.parse_args(argv[:1])  # help, or the usage error (exit 2)
    parser = config_parser("plait config show", "Print the resolved config as TOML: every section, every key.")
    a, settings = parse_config_args(parser, argv[1:])
    from plait.config import to_toml

    print(to_toml(load_args(config_argv(a.config, settings))), end="")
    return 0
