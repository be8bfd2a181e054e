"""A 30 s S3 outage while training reads its corpus from S3: the run waits it out and ends as the local run.

A real S3-compatible server on loopback (SeaweedFS, as the tests use) holds the prepared bundled corpus. The
same run trains twice in this process: reading the local directory, then reading s3:// with a 1 MiB block
cache (so every step reads from S3) and no prefetch. After step --at the server is killed, and --down
seconds later started again. Printed and written to bench/results/s3_data_outage.json: whether the losses
equal the local run's, the retries (warnings) the reads made, the longest step-to-step gap (the wait) and
the median step.

    python bench/s3_data_outage.py [--steps 40] [--at 10] [--down 30]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from plait import Callback  # noqa: E402
from plait.api import train  # noqa: E402
from plait.config import load_config  # noqa: E402
from plait.core.hardware import device_info  # noqa: E402
from plait.core.storage import copy_in, location  # noqa: E402
from plait.data import ensure_prepared  # noqa: E402
from s3_server import SeaweedS3  # noqa: E402  (the tests' loopback server)


class Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.retries = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.retries += "retrying in" in record.getMessage()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--at", type=int, default=10, help="the server is killed after this step")
    p.add_argument("--down", type=float, default=30.0, help="seconds the server stays down")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "s3_data_outage.json")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="plait-s3-data-") as tmp_dir:
        tmp = Path(tmp_dir)
        data = ensure_prepared("shakespeare", tmp / "cache", 4096)
        s3 = SeaweedS3(tmp / "s3")
        os.environ.update(s3.env())
        with s3:
            url = f"s3://{s3.bucket}/corpus"
            for f in data.iterdir():
                if f.is_file():
                    copy_in(f, location(url, s3.endpoint) / f.name)
            base = ["model.preset=debug", "data.seq_len=64", "train.global_batch_size=8", f"train.steps={a.steps}",
                    "eval.every_steps=0", "log.every_steps=1", "log.tensorboard=false", "sample.max_new_tokens=0",
                    "run.device=cpu", f"run.out_dir={tmp / 'runs'}", "checkpoint.save_final=false",
                    "data.prefetch=0", f"data.cache_dir={tmp / 'cache'}"]  # fmt: skip
            times: dict[int, float] = {}
            events: list[tuple[str, float]] = []

            class Watch(Callback):
                def after_step(self, run, step, result) -> None:
                    times[step] = time.perf_counter()
                    if step == a.at and run.cfg.run.name == "s3":
                        s3.stop()
                        events.append(("stopped", time.perf_counter()))

                        def back() -> None:
                            s3.start()
                            events.append(("restarted", time.perf_counter()))

                        threading.Timer(a.down, back).start()

            def losses(name: str) -> dict[int, float]:
                rows = (tmp / "runs" / name / "metrics.jsonl").read_text().splitlines()
                return {r["step"]: r["train/loss"] for r in map(json.loads, rows) if "train/loss" in r}

            train(load_config(None, [*base, f"data.source={data}", "run.name=local"]))
            counter = Count()
            logging.getLogger("plait.data").addHandler(counter)
            remote = [f"data.source={url}", f"checkpoint.s3_endpoint={s3.endpoint}", "data.remote_cache_mb=1"]
            started = time.perf_counter()
            train(load_config(None, [*base, *remote, "run.name=s3"]), callbacks=[Watch()])
            wall = time.perf_counter() - started
            steps = sorted(times)
            gap = [times[s] - times[s - 1] for s in steps if s - 1 in times]
            equal = losses("s3") == losses("local") and len(losses("s3")) == a.steps
    record = {
        "machine": f"{device_info(__import__('torch').device('cpu')).name} ({platform.machine()})",
        "steps": a.steps,
        "outage_after_step": a.at,
        "down_s": a.down,
        "events": [e for e, _ in events],
        "unreachable_s": round(events[-1][1] - events[0][1], 1) if len(events) == 2 else None,
        "losses_equal_local": equal,
        "retries_warned": counter.retries,
        "longest_step_gap_s": round(max(gap), 2),
        "median_step_s": round(statistics.median(gap), 3),
        "wall_s": round(wall, 1),
    }
    print(json.dumps(record, indent=1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
