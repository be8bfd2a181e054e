"""Is the default job's learning-rate schedule a good one? `plait train` as a new user runs it (preset tiny,
the bundled corpus, the default steps and batch), once per point of a grid of optimizer settings and seed,
scored by the held-out loss at the end; every point against the defaults, in the same run.

    python bench/schedule_sweep.py [--grid "optim.lr=1e-3,3e-3;optim.warmup_steps=30,100"] [--seeds 0]
        [--steps 400] [--eval-batches 32] [--extra "model.preset=small;..."]

--grid: settings separated by ';', each with its values separated by ','; every combination runs, of each
grid where '|' separates several (the defaults' point is always added). --extra: settings every run shares.
Printed, per point: the mean held-out loss over the seeds, its difference from the defaults' (negative:
better), and the seconds a run took; written to bench/results/schedule_sweep.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def points(grid: str) -> list[tuple[str, ...]]:
    """Every combination of the grid's settings ("a=1,2;b=3" -> ("a=1","b=3"), ("a=2","b=3")), of each grid
    where '|' separates several, the empty point (the defaults) first."""
    combos: list[tuple[str, ...]] = [()]
    for one in grid.split("|"):
        axes = []
        for part in filter(None, (p.strip() for p in one.split(";"))):
            key, values = part.split("=", 1)
            axes.append([f"{key.strip()}={v.strip()}" for v in values.split(",")])
        combos += [tuple(c) for c in itertools.product(*axes) if axes and tuple(c) not in combos]
    return combos


def held_out_loss(overrides: tuple[str, ...], extra: list[str], seed: int, steps: int, eval_batches: int, out: Path):
    from plait.api import train
    from plait.config import load_config

    name = f"s{seed}-" + "-".join(o.split(".")[-1] for o in overrides) if overrides else f"s{seed}-defaults"
    cfg = [*extra, f"train.steps={steps}", f"run.seed={seed}", f"eval.every_steps={steps}",
           f"eval.num_batches={eval_batches}", "sample.max_new_tokens=0", "log.tensorboard=false",
           "checkpoint.save_final=false", "checkpoint.every_steps=0", "log.every_steps=50", "lineage.enabled=false",
           f"run.out_dir={out}", f"run.name={name}", *overrides]  # fmt: skip
    start = time.perf_counter()
    final = train(load_config(None, cfg))
    return final["val_loss"], time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", default="optim.lr=1e-3,3e-3;optim.warmup_steps=30,100")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--eval-batches", type=int, default=32)
    ap.add_argument("--extra", default="")
    ap.add_argument("--out", default="bench/results/schedule_sweep.json")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    extra = [e.strip() for e in args.extra.split(";") if e.strip()]
    grid = points(args.grid)
    rows: list[dict] = []
    scratch = Path(tempfile.mkdtemp(prefix="plait-sweep-"))
    try:
        for i, point in enumerate(grid):
            losses, seconds = [], []
            for seed in seeds:
                loss, took = held_out_loss(point, extra, seed, args.steps, args.eval_batches, scratch)
                losses.append(loss)
                seconds.append(took)
                print(f"[{i + 1}/{len(grid)}] {' '.join(point) or 'defaults'} seed {seed}: {loss:.4f} ({took:.0f} s)",
                      flush=True)  # fmt: skip
            rows.append({"settings": list(point), "losses": losses, "mean": statistics.fmean(losses),
                         "seconds": statistics.fmean(seconds)})  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    base = rows[0]["mean"]
    print(f"\nheld-out loss after {args.steps} steps, seeds {args.seeds}{' with ' + args.extra if extra else ''}")
    print(f"{'settings':<48} {'loss':>8} {'vs defaults':>12} {'s/run':>7}")
    for r in sorted(rows, key=lambda r: r["mean"]):
        r["vs_defaults"] = r["mean"] - base
        label = " ".join(r["settings"]) or "(defaults)"
        print(f"{label:<48} {r['mean']:>8.4f} {r['vs_defaults']:>+12.4f} {r['seconds']:>7.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": args.steps, "seeds": seeds, "extra": extra, "rows": rows}, indent=1))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
