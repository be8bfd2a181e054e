"""Pictures of runs: loss (train and validation in one panel), gradient norm, learning rate and throughput
over steps, from ``metrics.jsonl``. `write_run_plot` writes ``<run>/loss.png`` (the trainer refreshes it at
evaluations, paced by `PlotRefresh`, and draws it at the end); `plot_runs` overlays several runs in one picture
(`plait plot RUN [RUN ...]`).

matplotlib's object API with the Agg canvas: no display, no global pyplot state."""

from __future__ import annotations

import json
import time
from pathlib import Path

from plait.core.errors import PlaitError

PANELS = (  # (title, {metric key: line label}, log scale): train and validation loss on one scale
    ("loss", {"train/loss": "train", "val/loss": "validation"}, False),
    ("gradient norm", {"train/grad_norm": ""}, False),
    ("learning rate", {"train/lr": ""}, False),
    ("tokens / s", {"train/tokens_per_s": ""}, False),
)


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl (a torn last line, from a run that is still writing, is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise PlaitError(f"{run_dir} has no metrics.jsonl: give a run directory (runs/NAME)")
    return read_jsonl(path)


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file that a run may still be appending to (a torn last line is skipped)."""
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float) and "step" in r]
    return [s for s, _ in pts], [v for _, v in pts]


def plot_runs(runs: dict[str, list[dict]], out: Path) -> Path:
    """One 2 x 2 figure (`figure`), written atomically (a viewer never sees half)."""
    if not can_draw():
        raise PlaitError(f"drawing needs matplotlib, which is not installed: {PLOT_EXTRA}")
    fig = figure(runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    tmp.replace(out)
    return out


def figure(runs: dict[str, list[dict]]):
    """The 2 x 2 panels of PANELS, every run's lines in each (train solid, validation dashed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7))
    FigureCanvasAgg(fig)
    # Fixed margins, wide enough for 7-character tick labels: matplotlib's constrained layout measures every
    # label's text first, which doubles the drawing's time (the trainer draws while the accelerator waits).
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.08, top=0.92, wspace=0.22, hspace=0.35)
    axes = fig.subplots(2, 2).flatten()
    for ax, (title, keys, log) in zip(axes, PANELS, strict=True):
        drawn, labelled = False, False
        for name, rows in runs.items():
            for key, what in keys.items():
                x, y = series(rows, key)
                if x:
                    label = " ".join(filter(None, (name if len(runs) > 1 else "", what))) or name
                    style = "--" if key.startswith("val/") else "-"
                    ax.plot(x, y, style, label=label, marker="o" if len(x) < 20 else None, markersize=3)
                    drawn, labelled = True, labelled or bool(what)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if log:
            ax.set_yscale("log")
        if not drawn:
            ax.text(0.5, 0.5, "not logged yet", ha="center", va="center", transform=ax.transAxes, color="grey")
        elif len(runs) > 1 or labelled:
            ax.legend(fontsize=8)
    if len(runs) == 1:
        fig.suptitle(next(iter(runs)))
    return fig


PLOT_EXTRA = "pip install 'plait[plot]'"


def can_draw() -> bool:
    """Whether matplotlib (the `plot` extra) is installed: runs draw loss.png only where it is."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def write_run_plot(run_dir: Path) -> Path | None:
    """<run>/loss.png from its metrics so far; None (and no file) when nothing was logged yet, or where
    matplotlib is not installed (the run says so when it starts). A mixture of experts' run also gets
    moe_load.png (`plot_expert_load`)."""
    if not can_draw():
        return None
    rows = read_metrics(run_dir)
    if not any("train/loss" in r for r in rows):
        return None
    if (Path(run_dir) / "moe_load.jsonl").is_file():
        plot_expert_load(Path(run_dir) / "moe_load.jsonl", Path(run_dir) / "moe_load.png")
    return plot_runs({Path(run_dir).name: rows}, Path(run_dir) / "loss.png")


# A refresh at an evaluation waits until drawing has taken at most this share of the time since the last one
# (drawing is host work the accelerator waits for; docs/measurements.md: loss plot: fixed margins) ...
PLOT_SHARE = 0.02
# ... and at least this long: a person watching loss.png sees it change about once a minute.
PLOT_REFRESH_S = 60.0


class PlotRefresh:
    """When a running job redraws its loss.png: at an evaluation once PLOT_REFRESH_S have passed since the
    last drawing and that drawing's cost is at most PLOT_SHARE of the time since (`due`); the trainer draws the
    final picture whatever this says. The run starts with a drawing just done, so a short run draws once."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.drawn_at, self.cost = clock(), 0.0

    def due(self) -> bool:
        since = self.clock() - self.drawn_at
        return since >= PLOT_REFRESH_S and self.cost <= PLOT_SHARE * since

    def draw(self, run_dir: Path) -> Path | None:
        start = self.clock()
        try:
            return write_run_plot(run_dir)
        finally:
            self.drawn_at = self.clock()
            self.cost = self.drawn_at - start


def plot_expert_load(path: Path, out: Path) -> Path | None:
    """From moe_load.jsonl (plait.engine.expert_balance.ExpertBalance): left, the last logged step's tokens per
    expert and block over the block's mean (a heatmap: 1 is balanced); right, each block's busiest expert over
    the mean, by step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in read_jsonl(path) if r.get("load")]
    if not rows:
        return None
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    heat, lines = fig.subplots(1, 2)
    last = rows[-1]
    blocks = list(last["load"])
    ratio = [[x / max(1e-9, sum(v) / len(v)) for x in v] for v in (last["load"][b] for b in blocks)]
    image = heat.imshow(ratio, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=heat, label="tokens / block mean")
    heat.set_yticks(range(len(blocks)), [f"block {b}" for b in blocks])
    heat.set_xlabel("expert")
    heat.set_title(f"expert load at step {last['step']}")
    for b in blocks:
        loads = [(r["step"], r["load"][b]) for r in rows if b in r["load"]]
        pts = [(step, max(v) / max(1e-9, sum(v) / len(v))) for step, v in loads]
        lines.plot([p[0] for p in pts], [p[1] for p in pts], label=f"block {b}")
    lines.set_title("busiest expert / mean")
    lines.set_xlabel("step")
    lines.grid(alpha=0.3)
    lines.legend(fontsize=7, ncol=2)
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    tmp.replace(out)
    return out
