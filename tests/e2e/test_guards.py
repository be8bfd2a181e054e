"""Guards while training: skip / rollback / stop on a non-finite step, loss spikes, stragglers and the hang
watchdog. Unit tests need no process group; the policies run in one process and on two gloo ranks (FSDP),
and the watchdog through the real CLI, whose elastic agent restarts the hung group."""

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from parallel_harness import free_port, join_as_rank, start_ranks
from plait.config import load_config
from plait.core.errors import ConfigError, PlaitError
from plait.engine.checkpoint import TrainState
from plait.engine.metrics import MetricsLogger
from plait.features.faults import Faults
from plait.features.guards import _PHASES, Guard, SpikeDetector, describe_stack, find_straggler
from plait.parallel.env import DistEnv


def base(data_dir: Path, steps: int) -> list[str]:
    return [
        "model.preset=debug",
        f"data.source={data_dir}",
        "data.seq_len=32",
        "train.global_batch_size=4",
        f"train.steps={steps}",
        "optim.warmup_steps=2",
        "eval.every_steps=0",
        "log.every_steps=1",
        "log.tensorboard=false",
        "log.plot=false",
        "sample.max_new_tokens=0",
        "run.device=cpu",
        "lineage.enabled=false",  # not under test here
    ]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(records: list[dict]) -> dict[int, float]:
    """The last logged training loss of each step (a rolled-back run logs replayed steps again)."""
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


# ------------------------------------------------------------------------------------------ units


def test_spike_detector():
    spikes = SpikeDetector(window=4, num_std=3.0)
    for step, loss in enumerate([2.0, 2.1, 1.9, 2.0], start=1):
        assert spikes.score(5.0) is None  # the window is not full yet
        spikes.add(step, loss)
    assert spikes.score(2.15) is None and spikes.score(1.0) is None  # noise, and a drop, are no spike
    assert spikes.score(3.0) == pytest.approx((3.0 - 2.0) / 0.0707106, rel=1e-4)
    spikes.truncate(2)
    assert [s for s, _ in spikes.losses] == [1, 2] and spikes.score(9.0) is None


def test_find_straggler_charges_waiting_to_the_rank_that_caused_it():
    # Rank 1 spends 0.3 s on host work between steps; inside the step the others wait those 0.3 s for it.
    s = find_straggler(local_s=[0.01, 0.31, 0.01, 0.02], sync_s=[0.40, 0.10, 0.40, 0.39])
    assert s.rank == 1 and s.ratio == pytest.approx(0.41 / 0.11, rel=1e-6)
    even = find_straggler(local_s=[0.01, 0.012], sync_s=[0.10, 0.101])
    assert even.ratio < 1.1


def test_fault_variables(monkeypatch):
    monkeypatch.setenv("PLAIT_FAULT_NAN", "3:2")
    monkeypatch.setenv("PLAIT_FAULT_HANG", "1:4")
    monkeypatch.setenv("PLAIT_FAULT_SLOW_RANK", "0:0.25")
    f0, f1 = Faults(0), Faults(1)
    assert (f0.nan_step, f0.nan_left, f0.hang_step, f0.slow_s) == (3, 2, 0, 0.25)
    assert (f1.hang_step, f1.slow_s) == (4, 0.0)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted group: transient faults are gone
    assert Faults(1).hang_step == 0 and Faults(1).nan_left == 0
    monkeypatch.setenv("PLAIT_FAULT_NAN", "soon")
    with pytest.raises(ConfigError, match="PLAIT_FAULT_NAN='soon'"):
        Faults(0)


@pytest.mark.parametrize(
    "path, function, phase",
    [
        ("plait/engine/trainer.py", "_accumulate", "forward/backward"),
        ("plait/engine/validation.py", "evaluate", "eval"),
        ("plait/engine/checkpoint/manager.py", "save", "checkpoint"),
        ("plait/engine/checkpoint/load.py", "load_state", "checkpoint"),
        ("plait/data/samples.py", "__next__", "data"),
        ("plait/engine/trainer.py", "_loop", "between steps"),
        ("plait/features/health_collectives.py", "check_collectives", "health check"),
    ],
)
def test_describe_stack_names_the_phase(path, function, phase):
    """The watchdog reads the phase from the training thread's stack: here a thread blocked in a function
    that looks, to it, like the plait function where that phase runs (each entry of _PHASES names a real one)."""
    source = importlib.util.find_spec(path.removesuffix(".py").replace("/", ".")).origin
    assert re.search(rf"\bdef {function}\(", Path(source).read_text()), f"{path} has no {function}: update _PHASES"
    assert any(frag in path and (names is None or function in names) for frag, names, _ in _PHASES)
    code = f"def {function}(event):\n    event.wait()\n"
    namespace: dict = {}
    exec(compile(code, f"/site/{path}", "exec"), namespace)
    event = threading.Event()
    thread = threading.Thread(target=namespace[function], args=(event,))
    thread.start()
    try:
        time.sleep(0.05)
        found, where = describe_stack(sys._current_frames()[thread.ident])
    finally:
        event.set()
        thread.join()
    assert found == phase and "in wait" in where


@pytest.mark.slow
def test_watchdog_culprits_from_heartbeats():
    """The watchdog's verdict from the heartbeats in the job's store (a real TCPStore): a rank whose heartbeat
    stopped is named silent (never this rank itself: its own thread was busy reporting), a rank behind the
    others' step or outside a collective is named as a live culprit the reporting rank waits for."""
    import torch.distributed as dist

    from plait.features.guards import Watchdog

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    dog = Watchdog(rank=0, timeout_s=3600, world_size=1)
    try:
        dog.world_size, dog._store = 2, dist.PrefixStore("hb", store)
        dc10d = "torch/distributed/distributed_c10d.py:4394 in all_gather"
        rows, done = [], threading.Event()

        def beat():  # rank 1's heartbeat thread (and rank 0's own for the aged case)
            while not done.wait(0.1):
                for r, (age, step, where) in enumerate(rows):
                    store.set(f"hb/{r}", f"{time.time() - age:.3f} {step} {1000 + r} host{r} {where}")

        beater = threading.Thread(target=beat, daemon=True)
        beater.start()
        rows[:] = [(30, 7, dc10d), (30, 7, "plait/engine/trainer.py:10 in _accumulate")]  # both old: only rank 1 named
        time.sleep(0.3)
        text, silent, stalled = dog.culprits()
        assert silent == [(1, 1001, "host1")] and stalled == [] and "rank 1 (host1, pid 1001)" in text, text
        rows[:] = [(0, 7, dc10d), (0, 6, dc10d)]
        time.sleep(0.3)
        text, silent, stalled = dog.culprits()
        assert (silent, stalled) == ([], [1]) and "behind the others (step 7): rank 1 at step 6" in text, text
        rows[:] = [(0, 7, dc10d), (0, 7, "plait/engine/trainer.py:10 in _accumulate")]
        time.sleep(0.3)
        text, silent, stalled = dog.culprits()
        assert (silent, stalled) == ([], [1]) and "not in a collective" in text
        assert "rank 1 at plait/engine/trainer" in text
        done.set()
    finally:
        dog.stop()


def test_guard_spikes_warn_and_optionally_skip(tmp_path):
    env = DistEnv(0, 1, 0, torch.device("cpu"))
    for skip in (False, True):
        cfg = load_config(
            None, ["guard.spike_window=3", "guard.spike_num_std=4", "guard.hang_timeout_s=0", f"run.out_dir={tmp_path}"]
        )
        cfg.guard.spike_skip_enabled = skip
        metrics = MetricsLogger(tmp_path / f"skip{skip}", cfg.log, 10)
        guard = Guard(cfg, env, metrics=metrics)
        state = TrainState()
        decisions = []
        for step, loss in enumerate([3.0, 2.9, 2.95, 2.92, 9.0, 2.9], start=1):
            guard.before_step(step)
            decisions.append(guard.should_step(torch.tensor(loss), torch.tensor(1.0)))
            assert guard.after_step(step, state) is False
        guard.close()
        metrics.close()
        assert decisions == [True] * 4 + [not skip, True]
        records = [r for r in rows(tmp_path / f"skip{skip}") if r["step"] == 5]
        assert records[0]["guard/loss_spike" if not skip else "guard/skipped"] == 1
        assert guard.num_spikes == 1 and guard.num_skipped == int(skip)


# ------------------------------------------------------------------------------------------ one process


def test_skip_policy_drops_the_bad_step_and_finishes(data_dir, tmp_path, monkeypatch):
    from plait.api import train

    clean = train(load_config(None, [*base(data_dir, 5), f"run.out_dir={tmp_path}", "run.name=clean"]))
    monkeypatch.setenv("PLAIT_FAULT_NAN", "3")
    faulty = train(load_config(None, [*base(data_dir, 5), f"run.out_dir={tmp_path}", "run.name=skip"]))
    records = rows(tmp_path / "skip")
    skipped = [r for r in records if "guard/skipped" in r]
    assert [(r["step"], r["guard/reason"]) for r in skipped] == [(3, "non-finite")]
    assert skipped[0]["guard/loss"] != skipped[0]["guard/loss"]  # NaN, recorded as such
    assert max(r["step"] for r in records) == 5 and faulty["loss"] == faulty["loss"]
    # Steps 1-2 are the clean run's; the skipped update leaves the weights as they were, so later
    # losses differ from the clean run only through the batch that was dropped.
    assert [losses(records)[s] for s in (1, 2)] == [losses(rows(tmp_path / "clean"))[s] for s in (1, 2)]
    assert clean["loss"] != faulty["loss"]


def test_rollback_policy_replays_to_the_clean_trajectory(data_dir, tmp_path, monkeypatch):
    """NaN at step 7 with checkpoints every 4 steps: reload step 4, replay 5-8; the replayed losses equal the
    uninterrupted run's exactly (the checkpoint restores model, optimizer, schedule and data position)."""
    from plait.api import train

    args = [*base(data_dir, 8), f"run.out_dir={tmp_path}", "checkpoint.every_steps=4", "checkpoint.keep_last=5"]
    args.append("checkpoint.async_enabled=false")  # the step-4 save is surely published by step 7
    train(load_config(None, [*args, "run.name=clean"]))
    monkeypatch.setenv("PLAIT_FAULT_NAN", "7")
    train(load_config(None, [*args, "run.name=rollback", "guard.nonfinite_policy=rollback"]))
    records = rows(tmp_path / "rollback")
    rollbacks = [(r["step"], r["guard/rollback_to"]) for r in records if "guard/rollback_to" in r]
    assert rollbacks == [(7, 4)]
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]
    assert losses(records) == losses(rows(tmp_path / "clean"))


def test_stop_policy_and_giving_up(data_dir, tmp_path, monkeypatch):
    from plait.api import train

    with pytest.raises(ConfigError, match="set checkpoint.every_steps"):
        load_config(None, ["guard.nonfinite_policy=rollback", "checkpoint.every_steps=0"])  # on by default
    monkeypatch.setenv("PLAIT_FAULT_NAN", "2")
    with pytest.raises(PlaitError, match=r"loss is nan and gradient norm nan at step 2; lower optim.lr"):
        train(load_config(None, [*base(data_dir, 4), f"run.out_dir={tmp_path}", "guard.nonfinite_policy=stop"]))
    monkeypatch.setenv("PLAIT_FAULT_NAN", "2:10")  # every step from 2 on
    overrides = [*base(data_dir, 9), f"run.out_dir={tmp_path}", "run.name=giveup", "guard.max_consecutive_failures=3"]
    with pytest.raises(PlaitError, match=r"3 failed steps in a row \(the latest: step 4, non-finite"):
        train(load_config(None, overrides))


# ------------------------------------------------------------------------------------------ two ranks


def _worker(rank: int, world: int, port: int, jobs: list, out_dir: str) -> None:
    join_as_rank(rank, world, port)
    from plait.api import train
    from plait.parallel.env import init_distributed, shutdown

    results = []
    try:
        env = init_distributed("cpu", 120)
        for i, (overrides, fault_env) in enumerate(jobs):
            os.environ.update(fault_env)
            try:
                cfg = load_config(None, [*overrides, f"run.out_dir={out_dir}", f"run.name=job{i}"])
                train(cfg, env=env)
                run_dir = Path(out_dir) / f"job{i}"
                results.append({"error": None, "rows": rows(run_dir) if rank == 0 else None})
            except PlaitError as e:  # raised alike on every rank: the group stays usable
                results.append({"error": str(e), "rows": None})
            except Exception:
                results.append({"error": traceback.format_exc(), "rows": None})
                raise
            finally:
                for key in fault_env:
                    os.environ.pop(key)
    finally:
        if rank == 0:
            Path(out_dir, "results.json").write_text(json.dumps(results))
        shutdown()


@pytest.mark.slow
def test_two_ranks_refuse_skip_rollback_and_name_the_straggler(data_dir, tmp_path):
    """Four jobs on one two-rank FSDP group: a bad rank refuses to start; skip drops step 3 on both ranks
    while rank 1, 0.5 s slow per step, is named a straggler; rollback (asynchronous saves) equals the clean
    run."""
    fsdp = [*base(data_dir, 6), "log.every_steps=2", "checkpoint.every_steps=2", "checkpoint.keep_last=5"]
    jobs = [
        (fsdp, {"PLAIT_FAULT_BAD_RANK": "1"}),
        ([*fsdp, "guard.straggler_ratio=1.5"], {"PLAIT_FAULT_NAN": "3", "PLAIT_FAULT_SLOW_RANK": "1:0.5"}),
        ([*fsdp, "guard.nonfinite_policy=rollback"], {"PLAIT_FAULT_NAN": "5"}),
        (fsdp, {}),
    ]
    ctx = start_ranks(_worker, (2, free_port(), jobs, str(tmp_path)), 2)
    try:
        while not ctx.join(timeout=600):
            pass
    except mp.ProcessRaisedException as e:
        detail = (tmp_path / "results.json").read_text() if (tmp_path / "results.json").exists() else ""
        raise AssertionError(f"a worker failed: {e}\n{detail[-3000:]}") from None
    refused, skip, rollback, clean = json.loads((tmp_path / "results.json").read_text())

    assert refused["error"].startswith("health check failed, training not started: rank 1 ")
    assert "matmul differs" in refused["error"] and "plait doctor --nproc 2" in refused["error"]

    assert skip["error"] is None, skip["error"]
    assert [r["step"] for r in skip["rows"] if "guard/skipped" in r] == [3]
    stragglers = [r for r in skip["rows"] if "guard/straggler_rank" in r]
    assert [r["step"] for r in stragglers] == [2, 4, 6]  # log steps after the first interval (step 1)
    assert all(r["guard/straggler_rank"] == 1 and r["guard/straggler_ratio"] > 1.5 for r in stragglers), stragglers

    assert rollback["error"] is None and clean["error"] is None, (rollback["error"], clean["error"])
    # Saves are asynchronous here: the step-4 checkpoint may still be in flight at step 5, and then the
    # newest published one, step 2, is the one to go back to.
    targets = [(r["step"], r["guard/rollback_to"]) for r in rollback["rows"] if "guard/rollback_to" in r]
    assert targets in ([(5, 4)], [(5, 2)])
    assert losses(rollback["rows"]) == losses(clean["rows"])
    assert all(r["guard/straggler_rank"] == -1 for r in clean["rows"] if "guard/straggler_rank" in r)


# ------------------------------------------------------------------------------------------ the watchdog


BEATING = """
import sys, time
import plait.features.watchdog as watchdog
exec(sys.argv[3])  # (the test's way to switch the suspension check off and see it fail)
dog = watchdog.Watchdog(rank=0, timeout_s=6, world_size=1)
print("watching", flush=True)
end, step = time.monotonic() + float(sys.argv[1]), 0
while time.monotonic() < end:
    step += 1
    dog.beat(step)
    for _ in range(40 if step < int(sys.argv[2]) else 120):  # 4 s without a beat (from step argv[2] on, 12 s)
        time.sleep(0.1)
dog.stop()
print("finished", step)
"""


def _stop_for(seconds: float, *argv: str) -> subprocess.Popen:
    """A BEATING process, stopped (SIGSTOP) 3 s after its watchdog starts for `seconds`, then continued."""
    proc = subprocess.Popen([sys.executable, "-c", BEATING, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    assert proc.stdout.readline() == "watching\n"  # (importing plait can take seconds on a busy machine)
    time.sleep(3)
    proc.send_signal(signal.SIGSTOP)
    time.sleep(seconds)
    proc.send_signal(signal.SIGCONT)
    return proc


def test_a_stopped_process_is_not_a_hang_but_a_stalled_one_is():
    """SIGSTOP for 15 s (a paused VM, a suspended laptop) freezes the watchdog with the training: on SIGCONT
    the run goes on (exit 0), where before the watchdog counted the 15 s as the training's and ended it (as
    it does here with the check switched off). A process whose training thread goes 12 s without a beat,
    timeout 6 s, is a hang: exit HANG_EXIT_CODE."""
    from plait.features.guards import HANG_EXIT_CODE

    hung = subprocess.Popen([sys.executable, "-c", BEATING, "20", "2", ""], stderr=subprocess.PIPE, text=True)
    assert hung.wait(timeout=120) == HANG_EXIT_CODE and "made no progress" in hung.stderr.read()
    stopped = _stop_for(15, "20", "1000", "")
    assert stopped.wait(timeout=120) == 0 and "finished" in stopped.stdout.read()
    unchecked = _stop_for(15, "20", "1000", "watchdog.SUSPENDED_S = float('inf')")
    assert unchecked.wait(timeout=120) == HANG_EXIT_CODE


@pytest.mark.slow
def test_hang_watchdog_reports_exits_and_the_group_restarts(data_dir, tmp_path):
    """Rank 1 hangs in forward at step 3: its watchdog names the rank and phase, dumps the stacks and exits
    non-zero; the elastic agent restarts both workers, which resume from the step-2 checkpoint and finish."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PLAIT_FAULT_HANG"] = "1:3"
    args = [f"--{o}" for o in base(data_dir, 4)]
    args += ["--checkpoint.every_steps=2", "--guard.hang_timeout_s=3", "--parallel.timeout_s=60"]
    result = subprocess.run(
        [sys.executable, "-m", "plait.cli", "train", "--nproc", "2", "--max-restarts", "1", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={
            **env,
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *filter(None, [env.get("PYTHONPATH")])]),
        },
        timeout=600,
    )
    err = result.stderr
    assert result.returncode == 0, err[-4000:]
    assert "fault injection: rank 1 hangs in forward" in err
    reports = [line for line in err.splitlines() if "hang watchdog: rank" in line]
    report = next((line for line in reports if "hang watchdog: rank 1" in line), None)
    assert report is not None, reports  # the waiting rank 0 lets rank 1 report its own stack before exiting
    assert (
        "in step 3, phase forward/backward, at plait/features/faults.py" in report and "exiting with code 124" in report
    )
    assert "last collective entered: gloo:" in report  # from the flight recorder
    peer = next((line for line in err.splitlines() if "hang watchdog: rank 0" in line), None)
    if peer is not None:  # unless the agent stopped it first: rank 0 waits in a collective for rank 1
        assert "in step 3, phase" in peer and "last collective entered: gloo:" in peer, peer
        assert "not in a collective while the others wait in one: rank 1 at plait/features/faults.py" in peer, peer
    assert "Most recent call first" in err or "most recent call first" in err  # faulthandler's stacks
    assert "resumed from" in err and "step_00000002" in err
    metrics = rows(tmp_path / "runs" / "default")
    assert max(r["step"] for r in metrics) == 4
    print(peer or "(rank 0 was stopped first)", report, sep="\n")


def _workers(root_pid: int) -> list[int]:
    """The training workers the elastic agent in root_pid spawned (multiprocessing spawn children), by pid."""
    out = []
    for task in Path(f"/proc/{root_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            with contextlib.suppress(OSError):
                if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                    out.append(int(child))
    return sorted(out)


@pytest.mark.full
@pytest.mark.slow
def test_a_stopped_rank_is_named_killed_and_the_group_resumes(data_dir, tmp_path):
    """SIGSTOP one worker of `plait train --nproc 2` mid-run: it cannot beat, step or answer SIGTERM. The other
    rank's watchdog names it (its heartbeat stopped) within 2 x guard.hang_timeout_s, kills it (same machine),
    and the elastic agent restarts the group, which resumes training within 1.5 x hang_timeout_s of the
    report and finishes."""
    hang = 10
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    args = [f"--{o}" for o in base(data_dir, 60)]
    args += ["--checkpoint.every_steps=5", f"--guard.hang_timeout_s={hang}", "--parallel.timeout_s=120"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "plait.cli", "train", "--nproc", "2", "--max-restarts", "1", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: [lines.append((time.monotonic(), x)) for x in proc.stderr], daemon=True)
    reader.start()
    metrics = tmp_path / "runs" / "default" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and '"step": 12,' in metrics.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = _workers(proc.pid)
    assert len(workers) == 2, workers
    victim = workers[-1]  # which rank it is, the report says (heartbeats carry the pid)
    os.kill(victim, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        assert proc.wait(timeout=400) == 0, "".join(x for _, x in lines)[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(OSError):
            os.kill(victim, signal.SIGKILL)
    reader.join(timeout=10)
    named = re.compile(rf"[Tt]he stalled rank: rank (\d) \([^,]+, pid {victim}\) has sent no heartbeat")
    report = next(((t, x) for t, x in lines if "hang watchdog: rank" in x and named.search(x)), None)
    reports = "".join(x for _, x in lines if "hang watchdog" in x)
    assert report is not None, (reports or "no watchdog report") + "\n" + "".join(x for _, x in lines)[-3000:]
    rank = named.search(report[1]).group(1)
    assert report[0] - stopped <= 2 * hang, f"named {report[0] - stopped:.1f} s after the stop"
    assert any(f"killed stalled rank {rank} (pid {victim})" in x for _, x in lines)
    resumed = next(t for t, x in lines if "resumed from" in x and t > report[0])
    assert resumed - report[0] <= 1.5 * hang, f"resumed {resumed - report[0]:.1f} s after the report"
    print(f"named after {report[0] - stopped:.1f} s, resumed {resumed - report[0]:.1f} s after the report")
