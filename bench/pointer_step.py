"""What the pointer costs a step, and what the learned retriever adds to it: the knowledge walk-through's model
(README) with and without model.retrieval_pointer, and with the pointer and model.retrieval_learned (its index
never refreshed within the run, and refreshed every --refresh steps in the background), the same data and seed,
trained --steps steps each, alternating --repeat times; the median tokens/s after the first --skip logged steps
(each step logged), the wall time a step takes over the whole run (its start and the index builds included),
and the peak memory, each with its ratio to the model without the pointer. For the refreshed arm also the
median tokens/s of the steps taken while an index was being built (the install_lag steps after each snapshot)
and of the others.

    python bench/pointer_step.py DATA [--steps 60] [--repeat 2] [--refresh 10] [--arms ...]
        [--out bench/results/pointer_step.json]

DATA: a prepared directory with retrieval neighbours at chunk 16 (the walk-through's facts/train), its database
built with the lexical encoder (the learned retriever starts from it).
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
LEARNED = [*RETRO, "model.retrieval_pointer=true", "model.retrieval_learned=true"]


def run(data: str, extra: list[str], steps: int, out: Path, name: str) -> tuple[list[tuple[int, float]], float, float]:
    """((step, tokens/s) of each logged step, the peak memory in GiB, the run's seconds a step) of one run."""
    import time

    from plait.api import train
    from plait.config import load_config

    cfg = [f"data.source={data}", "model.vocab_size=2048", "data.seq_len=128", "train.global_batch_size=8",
           f"train.steps={steps}", "eval.every_steps=0", "log.every_steps=1", "log.tensorboard=false", "log.plot=false",
           "sample.max_new_tokens=0", "checkpoint.save_final=false", "checkpoint.every_steps=0",
           "lineage.enabled=false", f"run.out_dir={out}", f"run.name={name}", *extra]  # fmt: skip
    started = time.perf_counter()
    train(load_config(None, cfg))
    seconds = (time.perf_counter() - started) / steps
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    rates = [(r["step"], r["train/tokens_per_s"]) for r in rows if "train/tokens_per_s" in r]
    return rates, max(r.get("train/mem_peak_gib", 0.0) for r in rows), seconds


def main() -> int:
    from plait.engine.retrieval_refresh import install_lag

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--skip", type=int, default=2, help="logged steps left out at the start (warm-up)")
    p.add_argument("--refresh", type=int, default=10, help="the refreshed learned arm's model.retrieval_refresh_steps")
    p.add_argument("--arms", default="copy,copy + pointer,learned,learned + refresh")
    p.add_argument("--out", default="bench/results/pointer_step.json")
    a = p.parse_args()
    arms = {**ARMS, "learned": [*LEARNED, f"model.retrieval_refresh_steps={10 * a.steps}"],
            "learned + refresh": [*LEARNED, f"model.retrieval_refresh_steps={a.refresh}"]}  # fmt: skip
    arms = {arm: arms[arm] for arm in a.arms.split(",")}
    lag = install_lag(a.refresh)
    building = {s for start in range(a.refresh, a.steps + 1, a.refresh) for s in range(start + 1, start + lag + 1)}
    found: dict[str, dict] = {
        arm: {"rates": [], "peaks": [], "seconds": [], "building": [], "otherwise": []} for arm in arms
    }
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(a.repeat):
            for arm, extra in arms.items():
                rates, peak, seconds = run(a.data, extra, a.steps, Path(scratch), f"{arm.replace(' ', '')}-{i}")
                kept = [(s, r) for s, r in rates if s > a.skip]
                found[arm]["rates"] += [r for _, r in kept]
                found[arm]["building"] += [r for s, r in kept if s in building]
                found[arm]["otherwise"] += [r for s, r in kept if s not in building]
                found[arm]["peaks"].append(peak)
                found[arm]["seconds"].append(seconds)
    rows = {arm: {"tokens_per_s": statistics.median(f["rates"]), "peak_gib": max(f["peaks"]),
                  "run_seconds_per_step": statistics.median(f["seconds"])} for arm, f in found.items()}  # fmt: skip
    if "learned + refresh" in found:
        f = found["learned + refresh"]
        rows["learned + refresh"]["tokens_per_s_while_building"] = statistics.median(f["building"])
        rows["learned + refresh"]["tokens_per_s_otherwise"] = statistics.median(f["otherwise"])
    base = rows[next(iter(rows))]
    for arm, row in rows.items():
        row["step_time_ratio"] = base["tokens_per_s"] / row["tokens_per_s"]
        row["run_time_ratio"] = row["run_seconds_per_step"] / base["run_seconds_per_step"]
        row["peak_ratio"] = row["peak_gib"] / base["peak_gib"]
        print(f"{arm:<18} {row['tokens_per_s']:8.0f} tokens/s  step x{row['step_time_ratio']:.2f}  run x"
              f"{row['run_time_ratio']:.2f}  peak {row['peak_gib']:.3f} GiB (x{row['peak_ratio']:.2f})")  # fmt: skip
    if "learned + refresh" in rows:
        row = rows["learned + refresh"]
        print(f"learned + refresh: {row['tokens_per_s_while_building']:.0f} tokens/s while an index is built, "
              f"{row['tokens_per_s_otherwise']:.0f} otherwise")  # fmt: skip
    record = {"machine": host.describe(), "settings": vars(a), "rows": rows}
    Path(a.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
