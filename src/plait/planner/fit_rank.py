"""One rank of `plait fit --ranks` in a process of its own (a fake process group and a memory peak are per
process): `python -m plait.planner.fit_rank REQUEST OUT`, started by `plait.planner.fit.in_subprocess` through
plait.core.subcommand. The request names the config ("config": a TOML path or null, "settings": its
'section.key=value' overrides), "world_size", "steps" and "rank"; the result is the rank's RankFit as JSON."""

from __future__ import annotations

import sys


def fit_one_rank(request: dict) -> dict:
    """Load the config as the command did and measure one rank, quietly (the parent says what runs)."""
    from plait.config import load_config
    from plait.planner.fit import fit_rank

    cfg = load_config(request["config"], request["settings"])
    return fit_rank(cfg, request["world_size"], request["rank"], request["steps"], quiet=True).to_json()


def main() -> int:
    from plait.core.subcommand import serve_rank

    return serve_rank("fit", fit_one_rank)


if __name__ == "__main__":
    sys.exit(main())
