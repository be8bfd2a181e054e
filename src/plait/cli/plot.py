"""`plait plot RUN [RUN ...]`: the loss, validation loss, learning rate and throughput of runs in one PNG."""

from __future__ import annotations

from pathlib import Path

from plait.cli.args import PlaitParser
from plait.core.errors import ConfigError
from plait.engine.plot import plot_runs, read_metrics


def cmd_plot(argv: list[str]) -> int:
    p = PlaitParser(
        prog="plait plot",
        description="Overlay the loss, validation loss, learning rate and throughput of runs in one PNG.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (runs/NAME)")
    p.add_argument("--out", default="plot.png", help="the PNG to write")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    a = p.parse_args(argv)
    out = Path(a.out)
    if out.suffix.lower() != ".png":
        raise ConfigError(f"--out {a.out}: the picture is a PNG; give a path ending in .png")
    if out.exists() and not a.overwrite:
        raise ConfigError(f"--out {a.out} exists; choose another path or pass --overwrite")
    runs = {}
    for run in a.runs:
        name = Path(run).name
        runs[name if name not in runs else run] = read_metrics(Path(run))
    print(f"wrote {plot_runs(runs, out)}")
    return 0
