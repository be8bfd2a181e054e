"""One run per run directory (plait.engine.runlock): a second run on a held directory is refused at once, before it
writes anything, and the first ends as if alone (bitwise); a lock whose holder died is taken over; elastic
restarts (plait's launcher and torchrun) are never refused; the same on S3 with a lease object. Real processes,
a real file system and a real S3-compatible server; the holders of other machines are lock files written as
such a machine would write them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from plait.config import load_config
from plait.core.errors import PlaitError
from plait.core.storage import location
from plait.engine import runlock
from plait.engine.checkpoint import list_checkpoints, load_model_weights
from plait.engine.core_callbacks import LockWatch
from plait.engine.runlock import LEASE_S, LOCK_ENV, RunLock, RunLocked, holder, identity
from runs import debug_run


@pytest.fixture(autouse=True)
def console():
    """The lock's messages on plait's console (stderr), as the `plait` commands set it up: importing plait
    configures no output, so without this the messages went to stderr only after another test had run one."""
    from plait.engine.metrics import use_console

    use_console()


STEPS = 30


def settings(data_dir: Path, out: Path, name: str, *extra: str) -> list[str]:
    return debug_run(data_dir, out, name, STEPS, "checkpoint.every_steps=10", *extra)


# A rank killed 2 steps after a save must find that save published when the group restarts: an asynchronous one
# may still be in flight then on a slow or busy machine (the restart would start from step 0, not resume).
SAVED_BEFORE_THE_KILL = "checkpoint.async_enabled=false"


def command(*settings_: str, nproc: int = 1, restarts: int = 0) -> list[str]:
    extra = ["--nproc", str(nproc), "--max-restarts", str(restarts)] if nproc > 1 or restarts else []
    return [sys.executable, "-m", "plait.cli", "train", *extra, *[f"--{s}" for s in settings_]]


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", LOCK_ENV)}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def logged(run_dir: Path) -> list[dict]:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.endswith("}")]


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 240
    while not any(r.get("step", 0) >= step and "train/loss" in r for r in logged(run_dir)):
        assert proc.poll() is None, f"the run ended before step {step}"
        assert time.monotonic() < deadline, f"no step {step} in 240 s"
        time.sleep(0.05)


def wait_for_checkpoint(ckpt_dir, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 240
    while not list_checkpoints(ckpt_dir):
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint was published"
        time.sleep(0.05)


def final_weights(ckpt_dir) -> dict[str, torch.Tensor]:
    from plait.engine.trainer import build_model

    ckpt = list_checkpoints(ckpt_dir)[-1]
    assert ckpt.name == f"step_{STEPS:08d}"
    model = build_model(load_config(None, ["model.preset=debug"]).model, torch.device("cpu"), seed=0)
    load_model_weights(model, ckpt)
    return model.state_dict()


def bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


# ------------------------------------------------------------------------------- holders seen from here


def write_holder(path: Path, **fields) -> bytes:
    """A lock file as another process (or machine) writes it."""
    holder = {**identity(), **fields}
    data = json.dumps(holder).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


ELSEWHERE = {"host": "node-7", "boot": "another-boot", "pid": 4242, "pid_start": 1}


def test_a_live_holder_on_another_machine_is_named_and_nothing_is_touched(tmp_path):
    lock = tmp_path / "runs" / "r.lock"
    data = write_holder(lock, **ELSEWHERE, command="plait train big.toml")
    with pytest.raises(RunLocked) as e:
        RunLock([lock]).acquire()
    text = str(e.value)
    assert "run directory" in text and "in use by another run: host node-7, pid 4242" in text
    assert "plait train big.toml" in text and "--run.break_lock=true" in text and "run.name" in text
    assert lock.read_bytes() == data and sorted(p.name for p in lock.parent.iterdir()) == ["r.lock"]


def test_an_expired_lease_is_taken_over_and_a_late_one_waited_out(tmp_path, capsys):
    lock = tmp_path / "r.lock"
    write_holder(lock, **ELSEWHERE, heartbeat=time.time() - 2 * LEASE_S)
    held = RunLock([lock]).acquire()
    assert json.loads(lock.read_text())["token"] == held.token
    assert "no heartbeat for 120 s" in capsys.readouterr().err
    held.release()
    assert not lock.exists()

    write_holder(lock, **ELSEWHERE, heartbeat=time.time() - LEASE_S + 2)  # late: 58 s without a heartbeat
    start = time.monotonic()
    held = RunLock([lock]).acquire()
    waited = time.monotonic() - start
    assert 1.0 < waited < 10.0, waited
    assert "waiting up to 60 s" in capsys.readouterr().err
    held.release()


def test_dead_zombie_and_reused_pids_on_this_machine_are_stale(tmp_path, capsys):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    lock = tmp_path / "r.lock"
    write_holder(lock, pid=child.pid, pid_start=holder._proc_stat(child.pid)[1])
    with pytest.raises(RunLocked, match="it is running on this machine"):
        RunLock([lock]).acquire()
    child.send_signal(signal.SIGKILL)
    time.sleep(0.3)  # killed, not reaped: a zombie
    assert holder._proc_stat(child.pid)[0] == "Z"
    RunLock([lock]).acquire().release()
    assert "its process has ended" in capsys.readouterr().err
    child.wait()
    write_holder(lock, pid=os.getppid(), pid_start=12345)  # a live PID now held by another process
    RunLock([lock]).acquire().release()


def test_unreadable_lock_files_are_judged_by_their_age(tmp_path):
    lock = tmp_path / "r.lock"
    lock.write_text("")  # being written this instant, or damaged
    with pytest.raises(RunLocked, match="unreadable lock file"):
        RunLock([lock]).acquire()
    old = time.time() - 2 * LEASE_S
    os.utime(lock, (old, old))
    RunLock([lock]).acquire().release()


def test_an_elastic_restart_of_the_same_job_takes_its_lock_over_silently(tmp_path, monkeypatch, capsys):
    lock = tmp_path / "r.lock"
    write_holder(lock, **ELSEWHERE, job="slurm-991", restart=0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "slurm-991")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    RunLock([lock]).acquire().release()
    assert "taking over" not in capsys.readouterr().err
    write_holder(lock, **ELSEWHERE, job="slurm-992", restart=0)  # another job: refused
    with pytest.raises(RunLocked):
        RunLock([lock]).acquire()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default id names no job
    write_holder(lock, **ELSEWHERE, job="", restart=0)
    with pytest.raises(RunLocked):
        RunLock([lock]).acquire()


def test_exactly_one_of_many_racing_processes_wins(tmp_path):
    lock = tmp_path / "r.lock"
    script = (
        "import sys, time; from plait.engine.runlock import RunLock, RunLocked\n"
        f"time.sleep(max(0.0, {time.time() + 6} - time.time()))\n"  # all start together (imports done)
        "try:\n    RunLock([sys.argv[1]]).acquire(); print('won'); time.sleep(2)\n"
        "except RunLocked: print('refused')\n"
    )
    run = [sys.executable, "-c", script, str(lock)]
    procs = [subprocess.Popen(run, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(6)]
    outcomes = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert outcomes == ["refused"] * 5 + ["won"], outcomes


def test_heartbeats_see_a_take_over_and_the_run_stops(tmp_path, capsys):
    lock = tmp_path / "r.lock"
    first = RunLock([lock]).acquire()
    before = json.loads(lock.read_text())["heartbeat"]
    time.sleep(0.01)
    first.heartbeat()
    assert json.loads(lock.read_text())["heartbeat"] > before and not first.lost
    lock.unlink()  # removed by hand: written again
    first.heartbeat()
    assert json.loads(lock.read_text())["token"] == first.token and "removed" in capsys.readouterr().err
    second = RunLock([lock]).acquire(break_lock=True)  # as if this process had been held up past its lease
    assert "run.break_lock=true" in capsys.readouterr().err
    first.heartbeat()
    assert "was taken over by" in first.lost

    class Run:
        lock = first

    with pytest.raises(PlaitError, match="it stops before step 7 so that two runs do not write one directory"):
        LockWatch(first).before_step(Run, 7)
    first.release()  # not its lock any more: left alone
    assert json.loads(lock.read_text())["token"] == second.token
    second.release()
    assert not lock.exists()


def test_a_heartbeat_from_the_future_names_the_clock_skew(tmp_path, capsys):
    """Another host's clock an hour ahead: the refusal says so (not 'last heartbeat 0 s ago'), and the lock
    file's own age judges that holder: unchanged past the lease, it is taken over, naming the skew again."""
    lock = tmp_path / "r.lock"
    write_holder(lock, **ELSEWHERE, heartbeat=time.time() + 3600)
    with pytest.raises(RunLocked) as e:
        RunLock([lock]).acquire()
    text = str(e.value)
    assert "3600 s in the future" in text and "clock of host node-7 is ahead" in text, text
    assert "0 s ago" not in text
    old = time.time() - 2 * LEASE_S
    os.utime(lock, (old, old))
    RunLock([lock]).acquire().release()
    err = " ".join(capsys.readouterr().err.split())
    assert "taking over the lock" in err and "is ahead of this machine's by at least 3600 s" in err, err


def test_a_run_whose_lock_was_taken_and_released_meanwhile_is_fenced(tmp_path, capsys):
    """Taken over (break_lock) and released while this run was held up: the lock file is gone, but the run
    that took it left word, so this run's next publish is refused and its heartbeat does not write it again."""
    from plait.core.publish import LockLost, check_fence

    lock = tmp_path / "r.lock"
    first = RunLock([lock]).acquire()
    check_fence(tmp_path / "r" / "checkpoints", "a checkpoint")  # its own: no error
    second = RunLock([lock]).acquire(break_lock=True)
    assert f"pid {os.getpid()}" in second.displaced()
    second.release()
    with pytest.raises(LockLost, match="was taken over by another run .* stops without publishing a checkpoint"):
        check_fence(tmp_path / "r" / "checkpoints", "a checkpoint")
    check_fence(tmp_path / "other", "elsewhere")  # another directory: not this lock's
    first.heartbeat()
    assert not lock.exists() and "taken over" in first.lost
    first.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # its word read: removed


def test_workers_run_under_their_launchers_lock_and_no_other(tmp_path, monkeypatch):
    lock = tmp_path / "r.lock"
    launcher = RunLock([lock]).acquire()
    monkeypatch.setenv(LOCK_ENV, launcher.token)
    worker = RunLock([lock]).acquire()
    worker.release()  # a worker never releases its launcher's lock
    assert json.loads(lock.read_text())["token"] == launcher.token
    monkeypatch.setenv(LOCK_ENV, "not-the-launchers")
    with pytest.raises(RunLocked, match="not held by this job's launcher"):
        RunLock([lock]).acquire()
    monkeypatch.delenv(LOCK_ENV)
    launcher.release()


def test_the_python_api_is_refused_on_a_held_directory_before_anything_is_written(data_dir, tmp_path):
    import plait

    cfg = load_config(None, settings(data_dir, tmp_path, "api"))
    holder = RunLock.for_run(cfg).acquire()
    try:
        trainer = plait.Trainer(cfg)
        with pytest.raises(RunLocked, match="in use by another run"):
            trainer.fit()
        assert not (tmp_path / "api").exists()
    finally:
        holder.release()
    trainer.fit()  # free now: the same Trainer trains
    rows = [r for r in logged(tmp_path / "api") if "train/loss" in r]
    assert len(rows) == STEPS and len({r["run_id"] for r in rows}) == 1
    cfg.train.steps = STEPS + 5
    trainer.fit()  # a second fit() continues from the checkpoint, as a new run (another run id)
    rows = [r for r in logged(tmp_path / "api") if "train/loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 6)) and len({r["run_id"] for r in rows}) == 2


# ------------------------------------------------------------------------------------------ real runs


@pytest.fixture(scope="module")
def alone(data_dir, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The final weights of the run trained alone: what the first of two runs on one directory must end with."""
    out = tmp_path_factory.mktemp("alone")
    done = subprocess.run(
        command(*settings(data_dir, out, "alone")), capture_output=True, text=True, env=environment(), cwd=out
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return final_weights(out / "alone" / "checkpoints")


def two_runs(first: list[str], second: list[str], cwd: Path, run_dir: Path) -> subprocess.CompletedProcess:
    """Start `first` (held up 0.1 s a step, its numbers unchanged), then `second` on the same directory once
    the first has trained a few steps; the second must end while the first still runs."""
    proc = subprocess.Popen(
        first, env=environment(PLAIT_FAULT_SLOW_RANK="0:0.1"), cwd=cwd, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for_step(run_dir, 3, proc)
        start = time.monotonic()
        refused = subprocess.run(second, capture_output=True, text=True, env=environment(), cwd=cwd, timeout=120)
        refused.elapsed = time.monotonic() - start
        assert proc.poll() is None, "the first run ended before the second was refused"
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert f"pid {proc.pid}" in refused.stderr
    return refused


@pytest.mark.slow
def test_a_second_run_on_a_held_directory_exits_2_at_once_and_the_first_is_as_if_alone(data_dir, tmp_path, alone):
    first = command(*settings(data_dir, tmp_path, "shared"))
    second = command(*settings(data_dir, tmp_path, "shared", "optim.lr=1e-4"))
    refused = two_runs(first, second, tmp_path, tmp_path / "shared")
    assert refused.returncode == 2 and refused.elapsed < 30, (refused.elapsed, refused.stderr[-2000:])
    line = one_line(refused.stderr)
    assert "run directory" in line and "is in use by another run" in line and "--run.break_lock=true" in line
    assert bitwise_equal(final_weights(tmp_path / "shared" / "checkpoints"), alone)
    rows = logged(tmp_path / "shared")
    steps = [r["step"] for r in rows if "train/loss" in r]
    assert steps == list(range(1, STEPS + 1)) and len({r["run_id"] for r in rows}) == 1  # the first run's alone
    assert "lr = 0.003" in (tmp_path / "shared" / "config.toml").read_text()  # not the second's 1e-4
    assert not (tmp_path / "shared.lock").exists()  # released at the end


@pytest.mark.slow
def test_a_lock_whose_holder_was_killed_is_taken_over_and_the_run_resumes(data_dir, tmp_path):
    args = command(*settings(data_dir, tmp_path, "killed"))
    proc = subprocess.Popen(args, env=environment(PLAIT_FAULT_SLOW_RANK="0:0.05"), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    wait_for_checkpoint(tmp_path / "killed" / "checkpoints", proc)
    proc.kill()
    proc.wait()
    assert (tmp_path / "killed.lock").exists()
    done = subprocess.run(args, capture_output=True, text=True, env=environment(), cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    text = " ".join(done.stderr.split())
    assert f"taking over the lock {tmp_path / 'killed.lock'} from host" in text and "its process has ended" in text
    assert "resumed from" in text and not (tmp_path / "killed.lock").exists()


@pytest.mark.slow
def test_launchers_hold_the_lock_across_restarts_and_refuse_a_second_launch(data_dir, tmp_path):
    """`plait train --nproc 2 --max-restarts 2` with a worker killed at step 12: the launcher holds the lock
    (its pid in the lock file) while the group restarts and resumes; a second launch on the directory meanwhile
    is refused before any worker starts."""
    base = settings(data_dir, tmp_path, "group", "parallel.tp_degree=2", SAVED_BEFORE_THE_KILL)
    args = command(*base, nproc=2, restarts=2)
    proc = subprocess.Popen(args, env=environment(PLAIT_FAULT_KILL="1:12"), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_for_step(tmp_path / "group", 3, proc)
        assert json.loads((tmp_path / "group.lock").read_text())["pid"] == proc.pid
        again = subprocess.run(args, capture_output=True, text=True, env=environment(), cwd=tmp_path, timeout=120)
        assert again.returncode == 2 and f"pid {proc.pid}" in one_line(again.stderr)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "restarting the group (1/2)" in err and "resumed from" in err and "taking over" not in err
    assert not (tmp_path / "group.lock").exists()


@pytest.mark.slow
def test_torchrun_restarts_take_the_lock_over_from_their_earlier_attempt(data_dir, tmp_path):
    """Under torchrun the main rank holds the lock; killed (with the lock still on disk), the agent restarts
    the group, whose new main rank takes it over as the same job's next attempt: no warning, no refusal."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    args = [f"--{s}" for s in settings(data_dir, tmp_path, "tr", SAVED_BEFORE_THE_KILL)]
    done = subprocess.run(
        [*torchrun, "--max-restarts", "1", "-m", "plait", "train", *args], capture_output=True, text=True,
        env=environment(PLAIT_FAULT_KILL="0:12"), cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "killing rank 0 at step 12" in done.stderr and "resumed from" in done.stderr
    assert "taking over" not in done.stderr and "in use by another run" not in done.stderr
    assert not (tmp_path / "tr.lock").exists()


# ------------------------------------------------------------------------------------------------- S3


def on_s3(s3, prefix: str) -> list[str]:
    return [f"checkpoint.dir=s3://{s3.bucket}/{prefix}", f"checkpoint.s3_endpoint={s3.endpoint}"]


@pytest.mark.slow
def test_s3_checkpoint_directories_are_leased_to_one_run(data_dir, tmp_path, alone, s3):
    """Two runs of different names sharing one s3:// checkpoint.dir: the second is refused at once naming the
    lease's holder; the first ends bitwise equal to the run alone. Then a run there killed mid-way leaves its
    lease behind, and the next run takes it over and resumes."""
    first = command(*settings(data_dir, tmp_path, "a", *on_s3(s3, "shared")))
    second = command(*settings(data_dir, tmp_path, "b", *on_s3(s3, "shared")))
    refused = two_runs(first, second, tmp_path, tmp_path / "a")
    assert refused.returncode == 2, refused.stderr[-3000:]
    line = one_line(refused.stderr)
    assert f"checkpoint directory s3://{s3.bucket}/shared is in use by another run" in line
    assert "checkpoint.dir" in line
    assert bitwise_equal(final_weights(location(f"s3://{s3.bucket}/shared", s3.endpoint)), alone)
    assert f"shared/{runlock.LOCK_FILE}" not in s3.keys("shared/")  # released
    assert not (tmp_path / "b").exists()  # the refused run wrote nothing

    killed = command(*settings(data_dir, tmp_path, "k", *on_s3(s3, "killed")))
    proc = subprocess.Popen(killed, env=environment(PLAIT_FAULT_SLOW_RANK="0:0.05"), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    wait_for_checkpoint(location(f"s3://{s3.bucket}/killed", s3.endpoint), proc)
    proc.kill()
    proc.wait()
    assert f"killed/{runlock.LOCK_FILE}" in s3.keys("killed/")
    done = subprocess.run(killed, capture_output=True, text=True, env=environment(), cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    text = " ".join(done.stderr.split())
    assert "taking over the lock" in text and "its process has ended" in text and "resumed from" in text


@pytest.mark.full
@pytest.mark.slow
def test_s3_a_killed_worker_of_nproc_2_restarts_and_resumes(data_dir, tmp_path, s3):
    args = command(*settings(data_dir, tmp_path, "g", *on_s3(s3, "group")), nproc=2, restarts=2)
    # killed 8 steps of 0.1 s after step 10's save began: it is on the server by then
    done = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=600,
                          env=environment(PLAIT_FAULT_KILL="1:18", PLAIT_FAULT_SLOW_RANK="0:0.1"))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "restarting the group (1/2)" in done.stderr and "(step 10)" in done.stderr, done.stderr[-3000:]
    assert s3.keys("group/") and f"group/{runlock.LOCK_FILE}" not in s3.keys("group/")


# ------------------------------------------------------------------------------------ fencing, real runs


def published(ckpt_dir: Path) -> dict[str, bytes]:
    """Each published checkpoint's plait.json: what a run that lost its lock must leave exactly as it is."""
    return {c.name: (c / "plait.json").read_bytes() for c in list_checkpoints(ckpt_dir)}


def config_of(ckpt: Path) -> dict:
    return json.loads((ckpt / "plait.json").read_text())["config"]


def lost_its_lock(proc: subprocess.Popen) -> str:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert "was taken over by" in last and "two runs do not write one directory" in last, err[-3000:]
    return err


@pytest.mark.slow
def test_break_lock_on_a_live_holder_fences_it_before_its_next_publish(data_dir, tmp_path):
    """--run.break_lock=true on a run mid-way: the holder finds out at its next publish (or heartbeat), stops
    with exit 2 and publishes nothing more; the new holder's checkpoints are left exactly as it wrote them."""
    run_dir, ckpt_dir = tmp_path / "fenced", tmp_path / "fenced" / "checkpoints"
    first = command(*settings(data_dir, tmp_path, "fenced"))
    proc = subprocess.Popen(first, env=environment(PLAIT_FAULT_SLOW_RANK="0:0.5"), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_for_step(run_dir, 3, proc)
        second = command(*settings(data_dir, tmp_path, "fenced", "run.break_lock=true", "log.every_steps=5"))
        done = subprocess.run(second, capture_output=True, text=True, env=environment(), cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "run.break_lock=true" in " ".join(done.stderr.split())
        theirs = published(ckpt_dir)
        lost_its_lock(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert published(ckpt_dir) == theirs and f"step_{STEPS:08d}" in theirs
    assert config_of(ckpt_dir / f"step_{STEPS:08d}")["log"]["every_steps"] == 5  # the second run's
    assert not (tmp_path / "fenced.lock").exists()


@pytest.mark.slow
def test_a_stopped_holder_taken_over_after_its_lease_publishes_nothing_when_continued(data_dir, tmp_path):
    """A holder paused (SIGSTOP) past its lease is taken over by the next run (its heartbeat is aged here as
    the lease's 60 s would age it); the new run finishes and releases the lock; continued (SIGCONT), the old
    holder stops with exit 2 before publishing, and nothing of the new run's is deleted or replaced."""
    run_dir, ckpt_dir, lock = tmp_path / "paused", tmp_path / "paused" / "checkpoints", tmp_path / "paused.lock"
    args = settings(data_dir, tmp_path, "paused")
    proc = subprocess.Popen(command(*args), env=environment(PLAIT_FAULT_SLOW_RANK="0:0.2"), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_for_step(run_dir, 12, proc)
        proc.send_signal(signal.SIGSTOP)
        holder = json.loads(lock.read_text())
        lock.write_text(json.dumps({**holder, "heartbeat": time.time() - 2 * LEASE_S}))
        second = command(*args, "log.every_steps=5")
        done = subprocess.run(second, capture_output=True, text=True, env=environment(), cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        text = " ".join(done.stderr.split())
        assert "taking over the lock" in text and "its process is stopped" in text, text
        theirs = published(ckpt_dir)
        proc.send_signal(signal.SIGCONT)
        lost_its_lock(proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
    assert published(ckpt_dir) == theirs and config_of(ckpt_dir / f"step_{STEPS:08d}")["log"]["every_steps"] == 5
    assert not lock.exists() and not list(tmp_path.glob(".paused.lock.displaced-*"))
