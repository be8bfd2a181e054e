"""Run several training layouts in one multi-process gloo group (one launch per world size: starting
processes is the expensive part on two cores, and a process group cannot be re-created in one process).

Each job is a list of `section.key=value` overrides; every rank trains it with plait's own trainer and rank
0 returns the per-step losses and gradient norms from the run's metrics.jsonl.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import tempfile
import traceback
from pathlib import Path

import torch.multiprocessing as mp

# Ranks are forked from a server process that has imported plait and torch once (3 s of CPU per process
# otherwise, and tests start ~100 ranks). Each rank gets the test's environment and working directory as they
# are when it starts (a forked server would otherwise hand out its own, from when it started).
multiprocessing.set_forkserver_preload(["plait.api", "parallel_harness"])


def _as_started(rank: int, environ: dict, cwd: str, fn, *args) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    fn(rank, *args)


def start_ranks(fn, args: tuple, world: int):
    """fn(rank, *args) in `world` processes (torch.multiprocessing's context: join() raises a rank's error)."""
    args = (dict(os.environ), os.getcwd(), fn, *args)
    return mp.start_processes(_as_started, args=args, nprocs=world, join=False, start_method="forkserver")


def run_ranks(fn, args: tuple, world: int, timeout: float = 600) -> None:
    """fn(rank, *args) in `world` processes, waited for until every rank has ended (a rank's error is raised).
    (One join() returns when the first rank ends: a rank failing after it would go unnoticed.)"""
    ctx = start_ranks(fn, args, world)
    while not ctx.join(timeout=timeout):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out: dict[str, dict[int, float]] = {"loss": {}, "grad_norm": {}, "val_loss": {}}
    for r in rows:
        if "train/loss" in r:
            out["loss"][r["step"]] = r["train/loss"]
            out["grad_norm"][r["step"]] = r["train/grad_norm"]
        if "val/loss" in r:
            out["val_loss"][r["step"]] = r["val/loss"]
        for key in ("moe/aux_loss", "moe/load_imbalance", "train/mem_peak_gib"):  # MoE routing; the memory
            if key in r:
                out.setdefault(key, {})[r["step"]] = r[key]
    return out


def join_as_rank(rank: int, world: int, port: int) -> None:
    """In a spawned worker: the environment torchrun would give rank `rank` of `world` on this machine, and one
    intra-op thread (the ranks share the cores)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch

    torch.set_num_threads(1)


def _worker(rank: int, world: int, port: int, jobs: list[list[str]], out_dir: str) -> None:
    join_as_rank(rank, world, port)
    from plait.api import train
    from plait.config import load_config
    from plait.parallel.env import init_distributed, shutdown

    results = []
    try:
        env = init_distributed("cpu", 120)
        for i, overrides in enumerate(jobs):
            cfg = load_config(None, [*overrides, f"run.out_dir={out_dir}", f"run.name=job{i}"])
            try:
                train(cfg, env=env)
                results.append(read_metrics(Path(out_dir) / f"job{i}") if rank == 0 else None)
            except Exception:
                results.append({"error": traceback.format_exc()})
                raise
    finally:
        if rank == 0:
            Path(out_dir, "results.json").write_text(json.dumps(results))
        shutdown()


def run_layouts(world: int, jobs: list[list[str]], timeout: float = 900) -> list[dict]:
    """Train each job on `world` gloo processes; returns rank 0's metrics per job."""
    out_dir = tempfile.mkdtemp(prefix=f"plait-w{world}-")
    ctx = start_ranks(_worker, (world, free_port(), jobs, out_dir), world)
    try:
        while not ctx.join(timeout=timeout):
            pass
    except mp.ProcessRaisedException as e:
        results_path = Path(out_dir, "results.json")
        detail = results_path.read_text() if results_path.exists() else ""
        raise AssertionError(f"a worker failed: {e}\n{detail[-3000:]}") from None
    results = json.loads(Path(out_dir, "results.json").read_text())
    return [{k: {int(step): v for step, v in series.items()} for k, series in r.items()} for r in results]
