"""An S3 outage in the middle of a run: how long does the training loop wait for storage?

A real S3-compatible server on loopback (SeaweedFS, as the tests use) holds the checkpoints; `plait train`
saves every 5 steps. Just after the first published checkpoint the server is killed, and 30 s later started
again. Every step is logged with its wall time, so the gaps between consecutive steps show any wait: the goal
is no gap above 1 s plus the step time (the loop waits only for the copy to CPU memory, never for storage).
Then the same command runs again with more steps and must resume from the run's newest checkpoint.

Printed: the longest step-to-step gap inside the outage and outside it, the median step, the saves deferred,
failed and published, and whether the resumed run started from the final checkpoint. Written to
bench/results/s3_outage.json.

    python bench/s3_outage.py [--steps 400] [--every 5] [--down 30] [--out bench/results/s3_outage.json] [--slack 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from plait.core.hardware import device_info  # noqa: E402
from s3_server import SeaweedS3  # noqa: E402  (the tests' loopback server)


def step_times(metrics: Path) -> dict[int, float]:
    """{step: wall time it was logged} of the training steps in a run's metrics.jsonl."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]
    return {r["step"]: r["time"] for r in rows if "train/loss" in r}


def gaps(times: dict[int, float], window: tuple[float, float]) -> dict[str, float]:
    """The longest gap between consecutive steps that overlaps the window / does not, and the median one."""
    inside, outside = [], []
    for step in sorted(times):
        if step - 1 in times:
            gap = times[step] - times[step - 1]
            (inside if times[step] >= window[0] and times[step - 1] <= window[1] else outside).append(gap)
    return {
        "longest_gap_in_outage_s": max(inside, default=0.0),
        "longest_gap_outside_s": max(outside, default=0.0),
        "median_step_s": statistics.median(inside + outside),
        "steps_in_outage": len(inside),
    }


def command(s3: SeaweedS3, data: str, out: Path, steps: int, every: int) -> list[str]:
    settings = [
        "model.preset=debug",
        f"data.source={data}",
        "data.seq_len=128",
        "train.global_batch_size=16",
        f"train.steps={steps}",
        "eval.every_steps=0",
        "log.every_steps=1",
        "log.tensorboard=false",
        "sample.max_new_tokens=0",
        "run.device=cpu",
        f"run.out_dir={out}",
        "run.name=outage",
        f"checkpoint.dir=s3://{s3.bucket}/outage",
        f"checkpoint.s3_endpoint={s3.endpoint}",
        f"checkpoint.every_steps={every}",
        "checkpoint.keep_last=3",
    ]
    return [sys.executable, "-m", "plait.cli", "train", *[f"--{s}" for s in settings]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--every", type=int, default=5, help="checkpoint.every_steps")
    p.add_argument("--down", type=float, default=30.0, help="seconds the server is down")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "s3_outage.json"))
    p.add_argument("--slack", type=float, default=1.0, help="goal: no gap in the outage above this + the median step")
    a = p.parse_args()
    from plait.data import ensure_prepared

    with tempfile.TemporaryDirectory(prefix="plait-outage-") as tmp:
        work = Path(tmp)
        data = str(ensure_prepared("shakespeare", work / "cache", 4096))
        s3 = SeaweedS3(work / "s3")
        env = {**os.environ, **s3.env(), "OMP_NUM_THREADS": "1"}
        s3.start()
        try:
            metrics = work / "outage" / "metrics.jsonl"
            window: list[float] = []

            def outage() -> None:
                while not (metrics.exists() and "checkpoint/saved_step" in metrics.read_text()):
                    time.sleep(0.01)
                s3.stop()
                window.append(time.time())
                print(f"server down at {time.strftime('%X')} for {a.down:.0f} s", file=sys.stderr)
                time.sleep(a.down)
                s3.start()
                window.append(time.time())
                print(f"server up at {time.strftime('%X')}", file=sys.stderr)

            helper = threading.Thread(target=outage, daemon=True)
            helper.start()
            started = time.time()
            run = subprocess.run(command(s3, data, work, a.steps, a.every), env=env, capture_output=True, text=True)
            helper.join(timeout=a.down + 60)
            if run.returncode != 0 or len(window) != 2:
                print(run.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"the run failed (exit {run.returncode}) or the outage did not happen inside it")
            rows = [json.loads(line) for line in metrics.read_text().splitlines()]
            saves = [r for r in rows if any(k.startswith("checkpoint/") for k in r)]
            result = {
                **gaps(step_times(metrics), (window[0], window[1])),
                "saves_published": sum("checkpoint/saved_step" in r for r in saves),
                "saves_deferred": sum("checkpoint/deferred_step" in r for r in saves),
                "saves_failed": sum("checkpoint/failed_step" in r for r in saves),
                "longest_blocked_s": max(r.get("checkpoint/blocked_s", 0.0) for r in saves),
                "run_s": time.time() - started,
            }
            resumed = subprocess.run(
                command(s3, data, work, a.steps + 10, a.every), env=env, capture_output=True, text=True
            )
            result["resumed_from_final"] = f"(step {a.steps})" in resumed.stderr and resumed.returncode == 0
        finally:
            s3.stop()
    limit = a.slack + result["median_step_s"]
    result.update(
        goal_s=limit,
        met=result["longest_gap_in_outage_s"] <= limit,
        steps=a.steps,
        every=a.every,
        down_s=a.down,
        machine=f"{device_info(torch.device('cpu')).name}, {os.cpu_count()} cores, {platform.machine()}",
        date=time.strftime("%Y-%m-%d"),
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'S3 outage of ' + str(int(a.down)) + ' s, saves every ' + str(a.every) + ' steps':<44}")
    print(f"  longest step-to-step gap in the outage   {result['longest_gap_in_outage_s']:7.3f} s")
    goal = f"goal: {a.slack:g} s + the median step"
    print(f"  {goal:<41}{limit:7.3f} s   {'met' if result['met'] else 'NOT MET'}")
    print(f"  longest gap outside the outage           {result['longest_gap_outside_s']:7.3f} s")
    print(f"  median step                              {result['median_step_s']:7.3f} s")
    print(f"  longest time a save held the loop        {result['longest_blocked_s']:7.3f} s")
    print(
        f"  saves: {result['saves_published']} published, {result['saves_deferred']} deferred, "
        f"{result['saves_failed']} failed; resumed from the final checkpoint: {result['resumed_from_final']}"
    )
    print(f"written to {a.out}")
    return 0 if result["met"] and result["resumed_from_final"] else 1


if __name__ == "__main__":
    sys.exit(main())
