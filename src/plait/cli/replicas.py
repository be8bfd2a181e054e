"""`plait train --replicas R [--nproc N] [--max-restarts K]`: a fault-tolerant run of R replica groups on this
machine, and `plait lighthouse`: the quorum server of groups started as separate jobs (Slurm).

The launcher holds the run directory's lock, starts a lighthouse, and runs each group as its own
`plait train --nproc N --max-restarts K` (its own elastic agent: a group whose worker dies restarts alone and
heals from a live peer) with parallel.fault_tolerant=true, its replica_id, and its own run directory
<run>/replica_<i> (metrics, checkpoints). Each line a group prints is prefixed with its number. The run succeeds
when at least parallel.min_replicas groups finish; a group lost for good is named."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

from plait.core.errors import ConfigError, PlaitError


def replica_argv(
    args: list[str], i: int, replicas: int, lighthouse: str, cfg, nproc: int, max_restarts: int
) -> list[str]:
    """Group i's command line: the run's settings, then its own."""
    own = [
        "--parallel.fault_tolerant=true", f"--parallel.replica_id={i}", f"--parallel.lighthouse={lighthouse}",
        f"--run.out_dir={cfg.run_dir}", f"--run.name=replica_{i}", f"--parallel.start_replicas={replicas}",
    ]  # fmt: skip
    if cfg.checkpoint.dir:
        own.append(f"--checkpoint.dir={cfg.checkpoint.dir.rstrip('/')}/replica_{i}")
    launch = ["--nproc", str(nproc), "--max-restarts", str(max_restarts)]
    return [sys.executable, "-m", "plait", "train", *args, *own, *launch]


def launch_replicas(args: list[str], replicas: int, nproc: int, max_restarts: int) -> int:
    from plait.cli.launch import _validate_before_launch
    from plait.engine.runlock import RunLock
    from plait.parallel.replicas.lighthouse import require_torchft

    if replicas < 1:
        raise ConfigError(f"--replicas={replicas} must be at least 1 (the number of replica groups)")
    require_torchft()
    cfg = _validate_before_launch([*args, "--parallel.fault_tolerant=true", "--parallel.lighthouse=http://x:1"], nproc)
    if replicas < cfg.parallel.min_replicas:
        raise ConfigError(
            f"--replicas={replicas} is below parallel.min_replicas={cfg.parallel.min_replicas}: no step could commit"
        )
    with RunLock.for_run(cfg).acquire(break_lock=cfg.run.break_lock).held():
        lighthouse, address = _start_lighthouse(cfg.parallel.min_replicas)
        print(f"plait train: {replicas} replica groups of {nproc} process(es), lighthouse {address}", file=sys.stderr)
        late: set[int] = set()
        try:
            commands = [replica_argv(args, i, replicas, address, cfg, nproc, max_restarts) for i in range(replicas)]
            codes = _run_groups(commands, late, replicas * nproc)
        finally:
            lighthouse.terminate()
            lighthouse.wait()
    finished = [i for i, c in enumerate(codes) if c == 0]
    lost = {i: c for i, c in enumerate(codes) if c != 0 and i not in late}
    if len(finished) < cfg.parallel.min_replicas:
        raise PlaitError(
            f"the run did not finish: {len(finished)} group(s) finished, {cfg.parallel.min_replicas} needed "
            f"(parallel.min_replicas); lost: " + ", ".join(f"replica {i} (exit {c})" for i, c in lost.items())
        )
    if lost:
        print(
            "plait train: finished by replica group(s) " + ", ".join(map(str, finished)) + "; lost for good: "
            + ", ".join(f"replica {i} (exit {c})" for i, c in lost.items()), file=sys.stderr,
        )  # fmt: skip
    return 0


def _start_lighthouse(min_replicas: int) -> tuple[subprocess.Popen, str]:
    """`plait lighthouse` in a child process (its quorum log filtered like the groups'), and its address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "plait", "lighthouse", "--port", "0", "--min-replicas", str(min_replicas)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.decode(errors="replace")
        if "serving at " in line:
            address = line.split("serving at ", 1)[1].split(";", 1)[0].strip()
            threading.Thread(target=_pump, args=(proc, "lighthouse"), daemon=True).start()
            return proc, address
    raise PlaitError(f"the lighthouse did not start (exit {proc.wait()}): is torchft installed? pip install torchft")


FINISH_GRACE_S = 60
"""A group still running this long after another finished the run is stopped: it was restarting or behind, and
would otherwise train the rest of the run alone."""


def _run_groups(commands: list[list[str]], late: set[int], processes: int) -> list[int]:
    """Run the groups side by side, their lines prefixed, SIGINT / SIGTERM passed on to each; their exit codes
    (`late` gets the groups stopped after the run finished)."""
    from plait.core.hardware import threads_per_rank

    # the groups share this machine's cores: each process its share, not all of them (on the CPU R x nproc
    # processes each running all cores' threads ran ~3x slower here)
    env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
    env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(processes)))
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        for cmd in commands
    ]
    pumps = [threading.Thread(target=_pump, args=(p, i), daemon=True) for i, p in enumerate(procs)]
    for t in pumps:
        t.start()

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signum)

    saved = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    finished_at = None
    try:
        while any(p.poll() is None for p in procs):
            time.sleep(0.2)
            if finished_at is None and any(p.returncode == 0 for p in procs):
                finished_at = time.monotonic()
            if finished_at is not None and time.monotonic() - finished_at > FINISH_GRACE_S:
                for i, p in enumerate(procs):
                    if p.poll() is None:
                        print(f"plait train: replica {i} stopped: the run finished while it was restarting or behind",
                              file=sys.stderr)  # fmt: skip
                        late.add(i)
                        os.killpg(p.pid, signal.SIGTERM)
                finished_at = float("inf")
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    for t in pumps:
        t.join(timeout=5)
    return [p.returncode for p in procs]


TORCHFT_INFO = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+ \[INFO\] \[torchft")
"""torchft's own log of every quorum and commit (its Rust side writes INFO to stderr): shown with LOGLEVEL=INFO."""


def _pump(proc: subprocess.Popen, who: int | str) -> None:
    assert proc.stdout is not None
    quiet = os.environ.get("LOGLEVEL", "").upper() not in ("INFO", "DEBUG")
    prefix = f"[replica {who}]" if isinstance(who, int) else f"[{who}]"
    for raw in proc.stdout:
        line = raw.decode(errors="replace")
        if not (quiet and TORCHFT_INFO.match(line)):
            sys.stderr.write(f"{prefix} {line}")
            sys.stderr.flush()


def cmd_lighthouse(argv: list[str]) -> int:
    """`plait lighthouse [--port P] [--min-replicas N]`: serve a fault-tolerant run's quorums until stopped."""
    import argparse

    from plait.parallel.replicas.lighthouse import start_lighthouse

    parser = argparse.ArgumentParser(prog="plait lighthouse", description=cmd_lighthouse.__doc__)
    parser.add_argument("--port", type=int, default=29510, help="port to serve on (default 29510)")
    parser.add_argument("--min-replicas", type=int, default=1, help="groups a step needs (parallel.min_replicas)")
    a = parser.parse_args(argv)
    if not 0 <= a.port < 65536:
        raise ConfigError(f"--port={a.port} must be a port number, 1 to 65535 (0: any free one)")
    if a.min_replicas < 1:
        raise ConfigError(f"--min-replicas={a.min_replicas} must be at least 1")
    server, address = start_lighthouse(a.min_replicas, a.port)
    print(f"plait lighthouse: serving at {address}; set parallel.lighthouse={address} in each group", flush=True)
    stop = threading.Event()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0
