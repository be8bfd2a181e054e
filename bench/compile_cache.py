"""Time to first step with a warm compile cache vs a cold one (goal: warm / cold <= 0.2).

Each start is a fresh process (`plait bench --steps 1 --warmup 0`, compile.enabled=true), so nothing is
shared in memory; only the compile cache directory differs:

- cold: an empty cache directory (a first job);
- warm: the directory the cold start left behind (a restarted job: Inductor's FX-graph and AOTAutograd
  caches, the compiled kernels, and the mega-cache file);
- mega-cache only: an empty directory holding just the cold start's mega_cache.bin (a job scaled out to a
  machine without the cache directory). On a GPU that file also carries the Triton kernels; on a CPU the C++
  kernels are rebuilt from their cached source with g++, which is most of a CPU compile.

Time to first step is measured from the start of the benchmark module (imports of torch included) to the end
of the first optimizer step; "compile" is what Dynamo reports for all compilations. Results go to
bench/results/compile_cache.json.

    python bench/compile_cache.py [--preset tiny] [--seq-len 256] [--batch 16] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def start(cache: Path, a: argparse.Namespace, out: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "plait.cli",
        "bench",
        f"--model.preset={a.preset}",
        f"--data.seq_len={a.seq_len}",
        f"--train.global_batch_size={a.batch}",
        f"--run.device={a.device}",
        "--compile.enabled=true",
        f"--compile.mode={a.mode}",
        f"--compile.cache_dir={cache}",
        "--steps=1",
        "--warmup=0",
        "--no-warm-run",
        "--quiet",
        f"--json={out}",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"plait bench failed:\n{proc.stderr[-3000:]}")
    r = json.loads(out.read_text())
    fs = r["first_step"]
    return {
        "first_step_from_process_start_s": fs["from_process_start_s"],
        "first_step_from_build_s": fs["from_build_s"],
        "compile_time_s": fs["compile_time_s"],
        "fxgraph_cache_hit": fs["compile_fxgraph_cache_hit"],
        "fxgraph_cache_miss": fs["compile_fxgraph_cache_miss"],
        "aotautograd_cache_hit": fs["compile_aotautograd_cache_hit"],
        "loaded_artifacts": fs["compile_loaded_artifacts"],
        "process_wall_s": wall,
        "steady_step_s": r["step_time_s"],
        "device": r["device"],
        "commit": r["commit"],
        "torch": r["torch"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--mode", default="default")
    p.add_argument("--device", default="auto")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "compile_cache.json"))
    a = p.parse_args()

    runs: dict[str, list[dict]] = {"cold": [], "warm": [], "mega_cache_only": []}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="plait-compile-cache-") as tmp:
        for i in range(a.repeats):
            cold, only = Path(tmp) / f"cold{i}", Path(tmp) / f"only{i}"
            runs["cold"].append(start(cold, a, Path(tmp) / "r.json"))
            runs["warm"].append(start(cold, a, Path(tmp) / "r.json"))
            only.mkdir()
            shutil.copy(cold / "mega_cache.bin", only / "mega_cache.bin")
            runs["mega_cache_only"].append(start(only, a, Path(tmp) / "r.json"))
            load.append(os.getloadavg()[0])

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    key = "first_step_from_process_start_s"
    result = {
        "device": runs["cold"][0]["device"],
        "preset": a.preset,
        "seq_len": a.seq_len,
        "batch": a.batch,
        "mode": a.mode,
        "runs": runs,
        "warm_over_cold": med("warm", key) / med("cold", key),
        "mega_cache_only_over_cold": med("mega_cache_only", key) / med("cold", key),
        "warm_over_cold_compile_time": med("warm", "compile_time_s") / med("cold", "compile_time_s"),
        "warm_over_cold_from_build": med("warm", "first_step_from_build_s") / med("cold", "first_step_from_build_s"),
        "goal": 0.2,
        "load_avg_1m": load,
        "commit": runs["cold"][0]["commit"],
        "torch": runs["cold"][0]["torch"],
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['device']}  {a.preset}  seq {a.seq_len} x batch {a.batch}  compile.mode={a.mode}")
    for kind in runs:
        print(
            f"  {kind:16s} first step {med(kind, key):6.1f} s from process start "
            f"({med(kind, 'first_step_from_build_s'):5.1f} s from build; compile {med(kind, 'compile_time_s'):5.1f} s; "
            f"FX-graph hits {runs[kind][0]['fxgraph_cache_hit']}, misses {runs[kind][0]['fxgraph_cache_miss']})"
        )
    print(
        f"warm / cold = {result['warm_over_cold']:.2f} (goal <= 0.2; compile time alone "
        f"{result['warm_over_cold_compile_time']:.2f})   mega-cache only / cold = "
        f"{result['mega_cache_only_over_cold']:.2f}   load average {', '.join(f'{x:.1f}' for x in load)}"
    )


if __name__ == "__main__":
    main()
