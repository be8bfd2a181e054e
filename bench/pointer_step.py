"""What the pointer costs a step: the knowledge walk-through's model (README) with and without
model.retrieval_pointer, the same data and seed, trained --steps steps each, alternating --repeat times; the
median tokens/s after the first --skip logged steps, and the peak memory, with the ratio to the model without.

    python bench/pointer_step.py DATA [--steps 60] [--repeat 2] [--out bench/results/pointer_step.json]

DATA: a prepared directory with retrieval neighbours at chunk 16 (the walk-through's facts/train).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import host  # bench/host.py: the machine line

RETRO = ["model.retrieval_layers=2,3", "model.retrieval_encoder_layers=1", "model.retrieval_chunk=16",
         "model.retrieval_copy=true"]  # fmt: skip
ARMS = {"copy": RETRO, "copy + pointer": [*RETRO, "model.retrieval_pointer=true"]}


def run(data: str, extra: list[str], steps: int, out: Path, name: str) -> tuple[list[float], float]:
    """(tokens/s of each logged step, the peak memory in GiB) of one run."""
    from plait.api import train
    from plait.config import load_config

    cfg = [f"data.source={data}", "model.vocab_size=2048", "data.seq_len=128", "train.global_batch_size=8",
           f"train.steps={steps}", "eval.every_steps=0", "log.every_steps=5", "log.tensorboard=false", "log.plot=false",
           "sample.max_new_tokens=0", "checkpoint.save_final=false", "checkpoint.every_steps=0",
           "lineage.enabled=false", f"run.out_dir={out}", f"run.name={name}", *extra]  # fmt: skip
    train(load_config(None, cfg))
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    rates = [r["train/tokens_per_s"] for r in rows if "train/tokens_per_s" in r]
    return rates, max(r.get("train/mem_peak_gib", 0.0) for r in rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--skip", type=int, default=2, help="logged steps left out at the start (warm-up)")
    p.add_argument("--out", default="bench/results/pointer_step.json")
    a = p.parse_args()
    found: dict[str, dict] = {arm: {"rates": [], "peaks": []} for arm in ARMS}
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(a.repeat):
            for arm, extra in ARMS.items():
                rates, peak = run(a.data, extra, a.steps, Path(scratch), f"{arm.replace(' ', '')}-{i}")
                found[arm]["rates"] += rates[a.skip :]
                found[arm]["peaks"].append(peak)
    rows = {arm: {"tokens_per_s": statistics.median(f["rates"]), "peak_gib": max(f["peaks"])}
            for arm, f in found.items()}  # fmt: skip
    base = rows["copy"]
    for arm, row in rows.items():
        row["step_time_ratio"] = base["tokens_per_s"] / row["tokens_per_s"]
        row["peak_ratio"] = row["peak_gib"] / base["peak_gib"]
        print(f"{arm:<16} {row['tokens_per_s']:8.0f} tokens/s  step x{row['step_time_ratio']:.2f}  "
              f"peak {row['peak_gib']:.3f} GiB (x{row['peak_ratio']:.2f})")  # fmt: skip
    Path(a.out).write_text(json.dumps({"machine": host.describe(), "settings": vars(a), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
