"""Starting workers: N local processes through torch's elastic agent, or a Slurm batch script.

`plait train --nproc N` validates the whole config and layout first, then runs the same entry point as
`torchrun --nproc-per-node N -m plait train` in each worker. Multi-node runs use torchrun's c10d
rendezvous; `plait launch slurm` writes a ready sbatch script for that.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
import time
import uuid
from pathlib import Path

from plait.cli.args import PlaitParser
from plait.core.errors import ConfigError, PlaitError
from plait.core.stop import EXIT_STOPPED

STOP_GRACE_S = 110  # seconds a stopping worker has for its last step and checkpoint; Slurm signals at 120


def default_nproc() -> int:
    """One process per visible GPU, else one."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


# Set by launch_local for its workers (with plait.parallel.env.RESTART_COUNT_ENV): where a worker that ends on
# an input or storage error (exit 2) leaves its one line for the launcher to print once, not once per rank.
ERROR_DIR_ENV = "PLAIT_WORKER_ERRORS"
INPUT_ERROR_EXIT = 2  # a restart cannot help: the same config, data and storage give the same error
REPORT_WAIT_S = 60


def report_to_launcher(message: str, code: int = INPUT_ERROR_EXIT) -> bool:
    """Leave a worker's last line (an error, exit 2, or a stop, exit 75) for launch_local, which prints it once
    for all ranks; False when this process was not started by it (then the caller prints the line itself)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder or not os.path.isdir(folder):
        return False
    path = os.path.join(folder, f"rank{os.environ.get('RANK', '0')}")
    with open(path + ".tmp", "w") as f:
        f.write(f"{code}\n{message}")
    os.replace(path + ".tmp", path)
    # A rank that ends silently (the main rank says why) gives the main rank time to say it: the agent
    # stops the whole group as soon as one worker exits.
    deadline = time.monotonic() + (0 if message else REPORT_WAIT_S)
    while not os.path.exists(os.path.join(folder, "rank0")) and time.monotonic() < deadline:
        time.sleep(0.05)
    return True


RAN_AGENT = [False]  # whether this process ran torch's elastic agent (plait.cli.main.exit_process)


def elastic_run(entrypoint, argv: list[str], nproc: int, *, max_restarts: int = 0, name: str = "plait") -> None:
    """Run entrypoint(argv) in nproc local workers under torch's elastic agent (c10d rendezvous on
    loopback); a failed worker raises ChildFailedError after max_restarts restarts of the group."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _quiet_elastic_logs()
    RAN_AGENT[0] = True
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"{name}-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
    )
    # On SIGTERM / SIGINT the agent forwards the signal and waits this long for the workers to finish their
    # step and write a checkpoint before it kills them (torch's default: 30 s).
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(STOP_GRACE_S))
    if hasattr(config, "shutdown_timeout") and config.shutdown_timeout is None:
        config.shutdown_timeout = int(os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
    from plait.core.hardware import threads_per_rank

    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc)))
    elastic_launch(config, entrypoint)(argv)


def _quiet_elastic_logs() -> None:
    """torch's elastic agent logs a worker's failure as a multi-line traceback of its own polling code (and
    each SIGTERM it sends) in front of plait's one line; plait says what failed and what happens next
    itself. LOGLEVEL=INFO (torch's own variable) brings the agent's logs back."""
    if os.environ.get("LOGLEVEL"):
        return
    import logging

    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def launch_local(nproc: int, argv: list[str], max_restarts: int, worker, env: dict[str, str] | None = None) -> int:
    """Run worker(argv) (`plait train` in the worker: given by the command line, which sits above this
    module) in nproc local workers, with `env` added to their environment (the run lock the launcher holds);
    restart the whole group up to max_restarts times when a worker dies (training then resumes from the
    newest checkpoint), but not after an input or storage error (exit 2), which a restart would only repeat:
    that error is printed once."""
    from plait.parallel.env import RESTART_COUNT_ENV

    # the workers' attempt number (set per attempt below) leaves with the launch: a later launch in this process
    # (the Python API, a test) must not start as a restart (no memory preflight, fault injection as attempt N)
    saved = {k: os.environ.get(k) for k in [*(env or {}), RESTART_COUNT_ENV]}
    os.environ.update(env or {})
    try:
        return _launch_local(nproc, argv, max_restarts, worker)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _launch_local(nproc: int, argv: list[str], max_restarts: int, worker) -> int:
    import tempfile

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from plait.parallel.env import RESTART_COUNT_ENV

    for attempt in range(max_restarts + 1):
        os.environ[RESTART_COUNT_ENV] = str(attempt)
        with tempfile.TemporaryDirectory(prefix="plait-errors-") as folder:
            os.environ[ERROR_DIR_ENV] = folder
            try:
                elastic_run(worker, argv, nproc)
                return 0
            except SignalException as e:  # the agent forwarded it to the workers, which saved and exited
                raise _stopped(e.sigval.name, _reports(folder)) from None
            except ChildFailedError as e:
                rank, failure = e.get_first_failure()
                reports = _reports(folder)
                if reports and {code for code, text in reports.values() if text} == {EXIT_STOPPED}:
                    raise _stopped("a signal", reports) from None  # the workers alone were signalled
                told = {rank: text for rank, (_, text) in reports.items()}
            finally:
                os.environ.pop(ERROR_DIR_ENV, None)
        why = f"worker rank {rank} {_ended(failure.exitcode)}"
        if told or failure.exitcode == INPUT_ERROR_EXIT:
            raise PlaitError(_one_report(told) or f"{why}: an input or storage error, not restarted; see above")
        if attempt < max_restarts:
            print(f"plait train: {why}; restarting the group ({attempt + 1}/{max_restarts})", file=sys.stderr)
    raise PlaitError(f"{why} after {max_restarts} restart(s); see its error above")


def _reports(folder: str) -> dict[int, tuple[int, str]]:
    """{rank: (exit code, its last line)} that workers left with report_to_launcher."""
    out = {}
    for p in Path(folder).glob("rank*"):
        if p.name[4:].isdigit():
            code, _, message = p.read_text().partition("\n")
            out[int(p.name[4:])] = (int(code) if code.isdigit() else INPUT_ERROR_EXIT, message)
    return out


def _stopped(signal_name: str, reports: dict[int, tuple[int, str]]) -> PlaitError:
    """What a stopped group says: the workers' own line (their checkpoint and how to resume, or why it could not
    be written), or, where none said anything, that no checkpoint was written by this stop."""
    from plait.core.stop import Stopped

    said = {rank: message for rank, (_, message) in reports.items()}
    if line := _one_report(said):
        codes = {code for code, message in reports.values() if message}
        return Stopped(line) if codes == {EXIT_STOPPED} else PlaitError(line)
    return Stopped(
        f"stopped by {signal_name} before the workers wrote a checkpoint (they were starting up, or did not reach "
        f"the end of a step in time); run the same command to start again (it resumes from the newest complete "
        f"checkpoint, if there is one)"
    )


def _one_report(told: dict[int, str]) -> str:
    """The workers' error lines, each different one once (with its ranks when they differ)."""
    by_message: dict[str, list[int]] = {}
    for rank in sorted(told):
        if told[rank]:  # "": a rank that ended silently
            by_message.setdefault(told[rank], []).append(rank)
    if len(by_message) <= 1:
        return next(iter(by_message), "")
    return "; ".join(f"rank {', '.join(map(str, ranks))}: {msg}" for msg, ranks in by_message.items())


def _ended(exitcode: int) -> str:
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-exitcode).name}"
    return f"failed (exit code {exitcode}{', hang watchdog' if exitcode == 124 else ''})"


SBATCH = """#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus}
#SBATCH --cpus-per-task={cpus}
#SBATCH --time={time}
#SBATCH --output=%x-%j.out
{extra}# Written by `plait launch slurm`. One torchrun agent per node; they meet at the first node (c10d
# rendezvous) and restart the group up to {restarts} times if a worker or node is lost.
#SBATCH --signal=B:TERM@120
# 120 s before the time limit (or on preemption) Slurm sends SIGTERM to this script, which forwards it to
# srun, srun to each torchrun agent, each agent to its workers: they finish their step, write a checkpoint
# and exit 75. {requeue_note}
set -euo pipefail
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export OMP_NUM_THREADS=1
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={grace}
srun torchrun \\
  --nnodes={nodes} --nproc-per-node={gpus} \\
  --rdzv-backend=c10d --rdzv-endpoint="$head_node:29500" --rdzv-id="$SLURM_JOB_ID" \\
  --max-restarts={restarts} \\
  -m plait train {args}{group} &
trainer=$!
trap 'kill -TERM "$trainer" 2>/dev/null || true' TERM
while kill -0 "$trainer" 2>/dev/null; do  # a trapped signal ends `wait` early: wait until the trainer ends
  wait "$trainer" || true
done
wait "$trainer" && status=0 || status=$?  # its own exit status (bash keeps it)
if [ "$status" -eq 75 ] && [ {requeue} -eq 1 ]; then
  scontrol requeue "$SLURM_JOB_ID"  # stopped with a checkpoint: back in the queue, resuming from it
fi
exit "$status"
"""


def _launch_parser():
    """`plait launch`'s parser and its `slurm` subcommand's."""
    parser = PlaitParser(prog="plait launch", description="Launch plait on a cluster.")
    sub = parser.add_subparsers(dest="target", required=True)
    p = sub.add_parser("slurm", help="Print (or write) an sbatch script running `plait train` on N nodes.")
    p.add_argument("--nodes", type=int, required=True, help="Nodes of the job (one torchrun agent each).")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (training processes) per node.")
    p.add_argument("--cpus-per-task", type=int, default=64, help="CPU cores per node for its processes.")
    p.add_argument("--time", default="24:00:00", help="Slurm time limit (the run stops 120 s before it).")
    p.add_argument("--partition", help="Slurm partition (#SBATCH --partition); default: the cluster's.")
    p.add_argument("--account", help="Slurm account to charge (#SBATCH --account); default: yours.")
    p.add_argument(
        "--requeue",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Put the job back in the queue when the run stopped with a checkpoint (exit 75: time limit or "
        "preemption); it resumes from it.",
    )
    p.add_argument("--max-restarts", type=int, default=3, help="torchrun restarts after a lost worker or node.")
    p.add_argument(
        "--replicas", type=int, metavar="R",
        help="fault-tolerant: R replica groups as a job array, each of --nodes (needs --lighthouse)",
    )  # fmt: skip
    p.add_argument("--lighthouse", metavar="URL", help="the run's lighthouse, http://HOST:PORT (`plait lighthouse`)")
    p.add_argument("--name", default="plait", help="Slurm job name.")
    p.add_argument("--out", help="Write the script here instead of printing it.")
    p.add_argument(
        "--gpu",
        metavar="MODEL",
        help="the nodes' GPU (a `plait plan` cluster preset: a100, h100, h200, trn1): the run's memory is checked "
        "against it now, before the job waits in the queue",
    )
    return parser, p


def cmd_launch(argv: list[str]) -> int:
    parser, p = _launch_parser()
    a, train_args = p.parse_known_args(argv[1:]) if argv[:1] == ["slurm"] else parser.parse_known_args(argv)
    if a.nodes < 1 or a.gpus_per_node < 1:
        raise ConfigError("--nodes and --gpus-per-node must be at least 1")
    train_args, extra_lines = _replica_array(a, train_args)
    cfg = _validate_before_launch(train_args, a.nodes * a.gpus_per_node)
    print(_check_memory_on(a.gpu, cfg, a.nodes, a.gpus_per_node), file=sys.stderr)
    extra = "".join(f"#SBATCH --{k}={v}\n" for k, v in (("partition", a.partition), ("account", a.account)) if v)
    extra += "#SBATCH --requeue\n" if a.requeue else ""
    extra += extra_lines
    note = "The job is then requeued and resumes from it." if a.requeue else "Submit the script again to resume."
    script = SBATCH.format(
        extra=extra,
        requeue=int(a.requeue),
        requeue_note=note,
        name=a.name,
        nodes=a.nodes,
        gpus=a.gpus_per_node,
        cpus=a.cpus_per_task,
        time=a.time,
        restarts=a.max_restarts,
        grace=STOP_GRACE_S,
        args=" ".join(shlex.quote(x) for x in train_args),
        group=(
            f' --parallel.replica_id="$SLURM_ARRAY_TASK_ID" --run.name={shlex.quote(cfg.run.name)}'
            '"/replica_$SLURM_ARRAY_TASK_ID"'
            if a.replicas
            else ""
        ),
    )
    if a.out:
        if os.path.exists(a.out):
            raise ConfigError(f"--out {a.out} exists; choose another path")
        with open(a.out, "w") as f:
            f.write(script)
        print(f"wrote {a.out}: submit with sbatch {a.out}")
    else:
        print(script, end="")
    return 0


def _replica_array(a, train_args: list[str]) -> tuple[list[str], str]:
    """With --replicas R: each group a task of a job array (its own nodes, restarts and requeue), all meeting at
    the lighthouse; the train arguments with the group's settings (its number from SLURM_ARRAY_TASK_ID)."""
    if a.replicas is None:
        if a.lighthouse:
            raise ConfigError("--lighthouse goes with --replicas R (a fault-tolerant run of R replica groups)")
        return train_args, ""
    if a.replicas < 1:
        raise ConfigError(f"--replicas={a.replicas} must be at least 1 (the number of replica groups)")
    if not a.lighthouse:
        raise ConfigError(
            "--replicas needs --lighthouse http://HOST:PORT: start one where every node reaches it "
            "(`plait lighthouse --port 29510`) and name it"
        )
    group = [
        "--parallel.fault_tolerant=true", f"--parallel.lighthouse={a.lighthouse}",
        f"--parallel.start_replicas={a.replicas}",
    ]  # fmt: skip
    lines = (
        f"#SBATCH --array=0-{a.replicas - 1}\n# Fault-tolerant: each array task is one replica group (its number is "
        "SLURM_ARRAY_TASK_ID); a lost group restarts or is requeued alone and heals from a live one.\n"
    )
    return [*train_args, *group], lines


def _check_memory_on(gpu: str | None, cfg, nodes: int, gpus_per_node: int) -> str:
    """Refuse (ConfigError) a Slurm run predicted not to fit the nodes' GPU; else the line to print."""
    from plait.planner.cluster import PRESETS
    from plait.planner.preflight import GiB, Machine, check_memory

    if not cfg.run.memory_check:
        return "memory: not checked (run.memory_check=false)"
    if gpu is None:
        return (
            "memory: not checked before submitting (the GPU is unknown here; --gpu h100 checks it now); "
            "each worker checks it when the job starts"
        )
    if gpu not in PRESETS:
        raise ConfigError(f"--gpu={gpu!r} is not a known GPU; choose one of {', '.join(PRESETS)}")
    spec = PRESETS[gpu]
    machine = Machine(int(spec.memory_gib * GiB), int(spec.host_memory_gib * GiB), gpu.upper(), bf16_native=True)
    note = check_memory(cfg, nodes * gpus_per_node, gpus_per_node, machine)
    return note or f"memory: checked, the run fits on {gpu.upper()} ({spec.memory_gib:g} GiB per GPU)"


def _validate_before_launch(train_args: list[str], world_size: int):
    """Load and check the config and the parallel layout for world_size processes (no worker started)."""
    from plait.cli.args import split_config_args
    from plait.config import load_config
    from plait.parallel.dims import ParallelDims, validate_layout

    path, overrides = split_config_args(train_args)
    cfg = load_config(path, overrides)
    validate_layout(cfg, ParallelDims.from_config(cfg.parallel, world_size, cfg.model))
    from plait.core.storage import RemotePath
    from plait.engine.checkpoint import checkpoint_dir, list_checkpoints

    if isinstance(where := checkpoint_dir(cfg), RemotePath):
        list_checkpoints(where)  # an unreachable object store is said now, once, before any worker starts
    if cfg.data.source == "shakespeare":
        from plait.data.prepare import check_cache_dir

        check_cache_dir(cfg.data.cache_dir)
    from plait.config.validate import data_sources
    from plait.data.remote import is_remote_source, mirror

    for source in [cfg.data.source, *(path for _, path, _ in data_sources(cfg.data.sources))]:
        if is_remote_source(source):  # a missing corpus or refused credentials: said now, before any worker
            mirror(source, cfg.checkpoint.s3_endpoint, cfg.data.cache_dir)
    return cfg
