"""How long `plait plan` takes, as a user runs it: a new process, imports included, CPU seconds (user + system,
all threads) and wall seconds, the median of --repeat runs.

    python bench/plan_speed.py                      # writes bench/results/plan_speed.json
    python bench/plan_speed.py --repeat 5 --json out.json

Workloads: Megatron-LM's 1T model (Llama-shaped, bench/planner_anchors.py) on 4,096 A100 at batch 4,096 x
2,048, and Llama 3 405B on 16,384 H100 at batch 2,048 x 8,192. Goal (issue "real size, proven on a device"):
the 1T plan in at most 2 s of CPU; measured there at 11-12 s before this benchmark existed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_CPU_S = 2.0

T1 = """[model]
dim = 25600
n_layers = 128
n_heads = 160
n_kv_heads = 160
vocab_size = 51200
ffn_hidden_dim = 68352
max_seq_len = 2048
[data]
seq_len = 2048
[train]
global_batch_size = 4096
"""

L405 = """[model]
preset = "llama3-405b"
[data]
seq_len = 8192
[train]
global_batch_size = 2048
"""

WORKLOADS = {  # name: (config, plan arguments)
    "1T on 4,096 A100": (T1, ["--cluster", "a100", "--nodes", "512"]),
    "Llama 3 405B on 16,384 H100": (L405, ["--cluster", "h100", "--nodes", "2048"]),
}


def one_run(config: Path, args: list[str]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one `plait plan` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "plait.cli", "plan", "--config", str(config), *args, "--json"],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"plait plan failed: {proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "plan_speed.json"))
    a = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (text, args) in WORKLOADS.items():
            config = Path(tmp) / "plan.toml"
            config.write_text(text)
            runs = [one_run(config, args) for _ in range(a.repeat)]
            cpu = statistics.median(r[0] for r in runs)
            wall = statistics.median(r[1] for r in runs)
            ratio = cpu / GOAL_CPU_S
            results[name] = {"cpu_s": round(cpu, 3), "wall_s": round(wall, 3), "cpu_over_goal": round(ratio, 3)}
            print(f"{name:32s} CPU {cpu:5.2f} s  wall {wall:5.2f} s  CPU / goal ({GOAL_CPU_S:.0f} s) {ratio:.2f}")
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or platform.platform()}"
    out = {"machine": machine, "goal_cpu_s": GOAL_CPU_S, "repeat": a.repeat, "results": results}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
