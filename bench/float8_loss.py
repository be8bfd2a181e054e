"""float8 against bf16 over a training run: the loss curves of the same job (same seed, same batches) trained
in bf16, in float8 with tensorwise scaling and in float8 with rowwise scaling (compile.float8_recipe), and
each recipe's gap to bf16.

The runs are plait's own (`plait train`, one per recipe, named bf16 / float8-tensorwise / float8-rowwise under
one folder); this script reads their metrics.jsonl and prints, per recipe: the mean training loss over the
last WINDOW steps and its gap to bf16 (nats, and relative), the largest gap of the WINDOW-step running means
along the run, and the median tokens/s after the first WINDOW steps (the runs' own throughput, the same
machine one after the other). A plot of the curves goes beside the JSON.

    python bench/float8_loss.py --runs RUNS_DIR [--json PATH]     # after the runs
    python bench/float8_loss.py --commands [--runs RUNS_DIR]       # the three `plait train` commands
    python bench/float8_loss.py --dry-run                           # check arguments, run nothing

bench/gpu_session.py part 7 trains the three runs on llama3-1b (seq 2048, 8 sequences a step, 200 steps, the
bundled corpus: the numerics, not the model, are the subject) and then runs this script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {  # run name: the settings that differ
    "bf16": [],
    "float8-tensorwise": ["--compile.float8=true", "--compile.float8_recipe=tensorwise"],
    "float8-rowwise": ["--compile.float8=true", "--compile.float8_recipe=rowwise"],
}
JOB = [
    "--model.preset=llama3-1b",
    "--data.seq_len=2048",
    "--train.global_batch_size=8",
    "--train.micro_batch_size=4",
    "--train.mixed_precision=bf16",
    "--train.steps=200",
    "--compile.enabled=true",
    "--log.every_steps=1",
    "--log.plot=false",
    "--eval.every_steps=0",
    "--checkpoint.save_final=false",
    "--sample.max_new_tokens=0",
    "--run.device=cuda",
]
WINDOW = 20  # steps in a running mean: one batch's loss is noisy, the recipes' gap is what is measured


def train_command(name: str, runs: Path) -> list[str]:
    return ["-m", "plait.cli", "train", *JOB, *RUNS[name], f"--run.name={name}", f"--run.out_dir={runs}"]


def read(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if "train/loss" in r}


def running_means(losses: list[float]) -> list[float]:
    return [statistics.fmean(losses[i - WINDOW : i]) for i in range(WINDOW, len(losses) + 1)]


def compare(runs: Path) -> dict:
    """Each recipe's curve against bf16's on the steps both logged."""
    curves = {name: read(runs / name) for name in RUNS if (runs / name / "metrics.jsonl").exists()}
    if "bf16" not in curves:
        raise SystemExit(f"{runs / 'bf16'}: no metrics.jsonl; the bf16 run is the reference")
    base = curves["bf16"]
    out = {"window": WINDOW, "recipes": {}}
    for name, curve in curves.items():
        steps = sorted(set(curve) & set(base))
        if len(steps) < 2 * WINDOW:
            out["recipes"][name] = {"error": f"{len(steps)} steps logged in both runs, {2 * WINDOW} needed"}
            continue
        mine = [curve[s]["train/loss"] for s in steps]
        ref = [base[s]["train/loss"] for s in steps]
        final, final_ref = statistics.fmean(mine[-WINDOW:]), statistics.fmean(ref[-WINDOW:])
        gaps = [a - b for a, b in zip(running_means(mine), running_means(ref), strict=True)]
        speed = [curve[s]["train/tokens_per_s"] for s in steps[WINDOW:] if "train/tokens_per_s" in curve[s]]
        out["recipes"][name] = {
            "steps": len(steps),
            "final_loss": final,
            "gap_nats": final - final_ref,
            "gap_relative": (final - final_ref) / final_ref,
            "largest_running_gap_nats": max(gaps, key=abs),
            "tokens_per_s": statistics.median(speed) if speed else None,
            "losses": mine,
        }
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in result["recipes"].items():
        if "losses" in r:
            means = running_means(r["losses"])
            ax.plot(range(WINDOW, WINDOW + len(means)), means, label=f"{name} ({r['gap_nats']:+.4f} nats)")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss, {WINDOW}-step mean")
    ax.set_title(f"float8 against bf16 ({result.get('device', '')})")
    ax.legend()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "float8-loss")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "float8_loss.json")
    p.add_argument("--commands", action="store_true", help="print the three training commands and stop")
    p.add_argument("--dry-run", action="store_true", help="check the arguments and stop")
    a = p.parse_args(argv)
    if a.dry_run:
        return 0
    if a.commands:
        for name in RUNS:
            print(f"python -m {' '.join(train_command(name, a.runs)[1:])}")
        return 0
    result = compare(a.runs)
    import torch

    result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{'run':<20} {'steps':>5} {'loss (last ' + str(WINDOW) + ')':>16} {'gap, nats':>10} {'relative':>9} "
          f"{'largest gap':>12} {'tokens/s':>9}")  # fmt: skip
    for name, r in result["recipes"].items():
        if "error" in r:
            print(f"{name:<20} {r['error']}")
            continue
        speed = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
        print(
            f"{name:<20} {r['steps']:>5} {r['final_loss']:>16.4f} {r['gap_nats']:>+10.4f} "
            f"{r['gap_relative']:>+9.2%} {r['largest_running_gap_nats']:>+12.4f} {speed:>9}"
        )
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, a.json.with_suffix(".png"))
    print(f"written to {a.json} and {a.json.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
