"""`plait fit` over the layouts tests/e2e/test_fit.py holds to the planner, as a table: each rank's measured peak
(the CUDA allocator's on a GPU; live tensor bytes op by op on the CPU) beside the planner's prediction.

    python bench/fit_table.py                          # this machine (CPU unless --device cuda)
    python bench/fit_table.py --json bench/results/fit_cpu.json

Prints a markdown table (docs/planner.md, "Checked by plait fit") and writes the numbers to --json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def layouts() -> dict[str, tuple[int, list[str], list[str]]]:
    """name -> (world size, model settings, layout settings): the test's own table, read from tests/e2e/test_fit.py."""
    spec = importlib.util.spec_from_file_location("test_fit", ROOT / "tests" / "test_fit.py")
    assert spec is not None and spec.loader is not None
    test = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(test)
    table = {name: (world, test.MODEL, s) for name, (world, s) in test.LAYOUTS.items()}
    for schedule, s in test.PIPELINES.items():
        table[f"FSDP 4 x PP 2, {schedule}"] = (8, test.MODEL, [*s, "--ranks", "extremes"])
    return table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "fit_cpu.json"))
    a = p.parse_args()
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (world, model, settings) in layouts().items():
            out = Path(tmp) / "fit.json"
            cmd = [sys.executable, "-m", "plait.cli", "fit", *model, *settings, "--world-size", str(world)]
            start = time.perf_counter()
            proc = subprocess.run([*cmd, "--steps", "2", "--json", str(out), "--quiet"], capture_output=True, text=True)
            if proc.returncode or not out.exists():
                rows.append(f"| {name} | {world} | - | failed: {proc.stderr.strip()[-200:]} | | |")
                continue
            ranks = json.loads(out.read_text())
            results[name] = {"world_size": world, "seconds": round(time.perf_counter() - start, 1), "ranks": ranks}
            for r in ranks:
                m, pr = r["measured"], r["predicted"]
                error = (pr["peak"] - m["peak"]) / m["peak"]
                got, want = m["peak"] / 2**20, pr["peak"] / 2**20
                rows.append(f"| {name} | {world} | {r['rank']} | {got:.2f} | {want:.2f} | {error:+.1%} |")
            print(rows[-1], flush=True)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs ({platform.processor() or platform.platform()})"
    table = "\n".join(
        [
            "| layout | world | rank | measured peak MiB | planner MiB | planner vs measured |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )
    print(f"\n{machine}\n\n{table}")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"machine": machine, "results": results}, indent=1) + "\n")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
