"""Checkpoint cost: how long a save blocks the training loop (asynchronous vs synchronous), and how fast a
save writes compared with the disk itself, measured in the same run on the same filesystem.

One process, the `small` preset (~56M parameters) after one AdamW step, so a checkpoint holds the weights
and both Adam moments (~670 MB). Each round, in turn:
- raw: the same number of bytes written with os.write in 64 MiB chunks, then fsync (the disk's speed);
- sync: CheckpointManager.save with checkpoint.async_enabled=false (the loop waits for everything);
- async: CheckpointManager.save with async_enabled=true: the loop waits for the CPU copy (staging) only,
  then wait() for the background write and publish (timed separately).
A training step runs before each save, so every save writes new values. Medians over rounds are printed
with the ratios and written to bench/results/checkpoint.json. The main thread's CPU time during each blocked
window is recorded too: on a shared machine wall time also counts waiting for a core.

    python bench/checkpoint.py [--preset small] [--rounds 3] [--dir /tmp/...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from plait.config import load_config, to_dict
from plait.engine.checkpoint import CheckpointManager, TrainState, list_checkpoints
from plait.engine.trainer import build_trainable, train_step


class _Position:
    """The data position a checkpoint records (the bench feeds random tokens, not a loader)."""

    def state_dict(self) -> dict[str, int]:
        return {"samples_consumed": 0}


def raw_write(path: Path, num_bytes: int, chunk: memoryview) -> float:
    """Seconds to write num_bytes to a new file and fsync it."""
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = num_bytes
        while left > 0:
            left -= os.write(fd, chunk[: min(left, len(chunk))])
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory in /tmp)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "checkpoint.json"))
    a = p.parse_args()

    cfg = load_config(
        None, [f"model.preset={a.preset}", f"data.seq_len={a.seq_len}", f"train.global_batch_size={a.batch}"]
    )
    device = torch.device("cpu")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    t = build_trainable(cfg, device)
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        tokens = torch.randint(0, cfg.model.vocab_size, (a.batch, a.seq_len + 1), generator=gen)
        train_step(t, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    step()  # creates the Adam state
    root = Path(a.dir or tempfile.mkdtemp(prefix="plait-bench-ckpt-"))
    root.mkdir(parents=True, exist_ok=True)
    managers = {}
    for mode, enabled in (("sync", False), ("async", True)):
        ckpt_cfg = load_config(None, [f"checkpoint.async_enabled={str(enabled).lower()}", "checkpoint.keep_last=1"])
        managers[mode] = CheckpointManager(root / mode, ckpt_cfg.checkpoint, config=to_dict(cfg))

    keys = ("raw_s", "sync_blocked_s", "async_blocked_s", "async_write_s", "sync_blocked_cpu_s", "async_blocked_cpu_s")
    rows: dict[str, list[float]] = {k: [] for k in keys}
    num_bytes = 0
    chunk = None
    for r in range(a.rounds + 1):  # round 0 warms up (allocations, first-use costs) and is not counted
        step()
        start, cpu = time.perf_counter(), time.thread_time()
        report = managers["sync"].save(r + 1, t, loader=_Position(), state=TrainState(r + 1, 0))
        sync_s, sync_cpu = time.perf_counter() - start, time.thread_time() - cpu
        num_bytes = int(report["size_mb"] * 2**20)

        step()
        start, cpu = time.perf_counter(), time.thread_time()
        managers["async"].save(r + 1, t, loader=_Position(), state=TrainState(r + 1, 0))
        blocked, blocked_cpu = time.perf_counter() - start, time.thread_time() - cpu
        report = managers["async"].wait()
        write_s = time.perf_counter() - start - blocked

        if chunk is None:
            chunk = memoryview(np.full(64 * 2**20, 7, dtype=np.uint8).data)
        raw_s = raw_write(root / "raw.bin", num_bytes, chunk)
        print(
            f"round {r}{' (warm-up)' if r == 0 else ''}: {num_bytes / 1e6:.0f} MB | raw {raw_s:.2f} s | "
            f"sync save {sync_s:.2f} s | async blocked {blocked:.3f} s + background {write_s:.2f} s",
            flush=True,
        )
        if r == 0:
            continue
        for key, value in zip(rows, (raw_s, sync_s, blocked, write_s, sync_cpu, blocked_cpu), strict=True):
            rows[key].append(value)
    for manager in managers.values():
        manager.close()
    assert list_checkpoints(root / "async") and list_checkpoints(root / "sync")
    shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in rows.items()}
    gbps = {
        "raw": num_bytes / med["raw_s"] / 1e9,
        "sync_save": num_bytes / med["sync_blocked_s"] / 1e9,
        "async_save": num_bytes / (med["async_blocked_s"] + med["async_write_s"]) / 1e9,
        "async_staging": num_bytes / med["async_blocked_s"] / 1e9,
    }
    ratios = {
        "async_blocked_over_sync_blocked": med["async_blocked_s"] / med["sync_blocked_s"],
        "sync_save_over_raw_write": gbps["sync_save"] / gbps["raw"],
        "async_save_over_raw_write": gbps["async_save"] / gbps["raw"],
    }
    print(
        f"\n{a.preset}: {cfg.model.num_params() / 1e6:.1f}M parameters + AdamW = "
        f"{num_bytes / 1e6:.0f} MB per checkpoint\n"
        f"loop blocked: sync {med['sync_blocked_s']:.2f} s, async {med['async_blocked_s']:.3f} s "
        f"({ratios['async_blocked_over_sync_blocked']:.3f} of sync); main-thread CPU in that time: "
        f"{med['sync_blocked_cpu_s']:.2f} s vs {med['async_blocked_cpu_s']:.3f} s\n"
        f"throughput: raw disk {gbps['raw']:.2f} GB/s, sync save {gbps['sync_save']:.2f} GB/s "
        f"({ratios['sync_save_over_raw_write']:.2f} of raw), async save end to end {gbps['async_save']:.2f} GB/s "
        f"({ratios['async_save_over_raw_write']:.2f} of raw), staging {gbps['async_staging']:.2f} GB/s"
    )
    result = {
        "what": "checkpoint save: time the training loop is blocked (async vs sync) and write speed vs raw disk",
        "settings": {
            "preset": a.preset,
            "parameters": cfg.model.num_params(),
            "bytes_per_checkpoint": num_bytes,
            "rounds": a.rounds,
            "filesystem_dir": str(root),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
        "median_s": med,
        "per_round_s": rows,
        "gb_per_s": gbps,
        "ratios": ratios,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {a.out}")


if __name__ == "__main__":
    main()
