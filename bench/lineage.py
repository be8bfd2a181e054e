"""Does the lineage slow training? The same run with the lineage on (every checkpoint hashed and recorded) and
off, checkpoints every few steps (asynchronous, as by default), in one process each, alternating.

The weights hash of a save is taken from the weights as the save begins (each rank digests its own shards:
`plait.core.digest`), so no checkpoint is read back and nothing is gathered; this measures what that costs the loop.
Reported: mean wall time per step over the run (saves included), the slowest step (a save step) and the ratio
on/off. Numbers go to bench/results/lineage.json.

    python bench/lineage.py [--steps 40] [--every 5] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ["model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=4", "model.vocab_size=4096"]


def one_run(out: Path, name: str, lineage: bool, steps: int, every: int) -> dict:
    args = [
        *MODEL,
        "data.seq_len=128",
        "train.global_batch_size=8",
        f"train.steps={steps}",
        "eval.every_steps=0",
        "log.every_steps=1",
        "log.tensorboard=false",
        "sample.max_new_tokens=0",
        "run.health_check_enabled=false",
        f"checkpoint.every_steps={every}",
        "checkpoint.keep_last=2",
        f"lineage.enabled={str(lineage).lower()}",
        f"run.out_dir={out}",
        f"run.name={name}",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "plait.cli", "train", *[f"--{a}" for a in args]], capture_output=True, text=True
    )
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time"] for r in rows if "train/loss" in r}
    deltas = [times[s] - times[s - 1] for s in sorted(times) if s - 1 in times and s > 2]  # after warm-up
    return {
        "mean_step_s": statistics.mean(deltas),
        "max_step_s": max(deltas),
        "median_step_s": statistics.median(deltas),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "lineage.json"))
    a = parser.parse_args()
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="plait-bench-lineage-") as tmp:
        for i in range(a.repeats):
            for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
                runs[mode].append(one_run(Path(tmp), f"{mode}{i}", mode == "on", a.steps, a.every))
    best = {m: min(r, key=lambda x: x["mean_step_s"]) for m, r in runs.items()}
    ratio = best["on"]["mean_step_s"] / best["off"]["mean_step_s"]
    print(f"model {' '.join(MODEL)}, {a.steps} steps, a checkpoint every {a.every}, best of {a.repeats}")
    print(f"{'lineage':8} {'mean step':>10} {'median':>10} {'slowest':>10}")
    for m in ("off", "on"):
        b = best[m]
        print(f"{m:8} {1e3 * b['mean_step_s']:8.1f}ms {1e3 * b['median_step_s']:8.1f}ms {1e3 * b['max_step_s']:8.1f}ms")
    print(f"on / off (mean step, saves included): {ratio:.3f}")
    result = {"machine": platform.processor() or platform.machine(), "runs": runs, "on_over_off": ratio, **vars(a)}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
