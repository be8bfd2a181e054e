"""`plait train --nproc N` end to end (torch's elastic agent, real gloo workers) and `plait launch slurm`."""

import json
import os
import subprocess
import sys

import pytest

from plait.data import ensure_prepared


def run_cli(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, "-m", "plait.cli", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600
    )


@pytest.mark.slow
def test_nproc_trains_a_pipeline_and_resumes(tmp_path):
    data = ensure_prepared("shakespeare", tmp_path / "cache", 4096)
    args = [
        "train",
        "--nproc",
        "2",
        "--model.preset=debug",
        f"--data.source={data}",
        "--data.seq_len=32",
        "--train.global_batch_size=4",
        "--train.steps=4",
        "--parallel.pp_degree=2",
        "--eval.every_steps=2",
        "--eval.num_batches=1",
        "--log.every_steps=1",
        f"--run.out_dir={tmp_path}",
        "--log.tensorboard=false",
        "--log.plot=false",
    ]
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pp=2" in result.stderr
    assert (tmp_path / "default" / "checkpoints" / "step_00000004").is_dir()
    # Resuming a finished run under another layout (one process) trains nothing and loads cleanly.
    single = [a for a in args[3:] if not a.startswith("--parallel.")]
    result = run_cli("train", *single, "--train.steps=6", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr
    steps = [json.loads(x)["step"] for x in (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 6


def test_bad_layout_is_refused_before_workers_start(tmp_path):
    result = run_cli("train", "--nproc", "2", "--model.preset=debug", "--parallel.tp_degree=3", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "= 3, but 2 processes run" in result.stderr or "not divisible" in result.stderr


def test_slurm_script(tmp_path):
    result = run_cli(
        "launch",
        "slurm",
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "configs/seed_3d.toml",
        "--parallel.pp_degree=2",
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --nodes=4" in result.stdout and "--nproc-per-node=8" in result.stdout
    assert "-m plait train configs/seed_3d.toml --parallel.pp_degree=2" in result.stdout
    bad = run_cli(
        "launch",
        "slurm",
        "--nodes",
        "1",
        "--gpus-per-node",
        "3",
        "configs/seed_3d.toml",
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    assert bad.returncode == 2 and "world size 3 is not divisible" in bad.stderr


@pytest.mark.parametrize("how", ["stops by itself", "SIGTERM to the script"])
def test_slurm_script_forwards_the_stop_and_requeues_on_exit_75(tmp_path, how):
    """The generated script run by bash with stand-ins for srun / torchrun / scontrol: a run that ends with
    exit 75 (stopped with a checkpoint), by itself or after Slurm's SIGTERM to the batch script (forwarded
    to the trainer, which then exits 75), gets `scontrol requeue JOB`; --partition and --account are set;
    --no-requeue leaves the job out of the queue."""
    import signal
    import time

    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    args = ["launch", "slurm", "--nodes", "1", "--gpus-per-node", "1", "--partition", "gpu", "--account", "ml"]
    for requeue in ("--requeue", "--no-requeue"):
        script = tmp_path / f"job{requeue}.sbatch"
        made = run_cli(*args, requeue, "--out", str(script), "--model.preset=debug", cwd=root)
        assert made.returncode == 0, made.stderr
        text = script.read_text()
        assert "#SBATCH --partition=gpu\n" in text and "#SBATCH --account=ml\n" in text
        assert ("#SBATCH --requeue" in text) == (requeue == "--requeue")
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        calls = tmp_path / "scontrol.calls"
        stand_ins = {
            "scontrol": f'echo "$@" >> {calls}; [ "$1" = show ] && echo node1; exit 0',
            "srun": 'exec "$@"',
            # the trainer: exits 75 at once, or on SIGTERM (finishing its step and checkpoint)
            "torchrun": "trap 'exit 75' TERM; " + ("exit 75" if how == "stops by itself" else "sleep 30 & wait"),
        }
        for name, body in stand_ins.items():
            (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
            (bin_dir / name).chmod(0o755)
        calls.unlink(missing_ok=True)
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42",
               "SLURM_JOB_NODELIST": "node1"}  # fmt: skip
        job = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if how == "SIGTERM to the script":
            time.sleep(1.0)
            job.send_signal(signal.SIGTERM)
        job.wait(timeout=30)
        assert job.returncode == 75
        requeued = "requeue 42" in (calls.read_text() if calls.exists() else "")
        assert requeued == (requeue == "--requeue"), (requeue, how)


@pytest.mark.slow
def test_random_lost_ranks_restart_and_end_bitwise_equal(tmp_path):
    """Kill a random rank at a random step, three times in one run (the i-th kill fires in elastic attempt
    i): the agent restarts the group each time, each attempt resumes from the newest complete checkpoint,
    no more than one checkpoint interval of finished steps is redone per kill, and the final weights equal
    an uninterrupted run's bit for bit. The seed is printed on failure; PLAIT_TEST_SEED replays it."""
    import random
    import re

    import torch

    seed = int(os.environ.get("PLAIT_TEST_SEED", random.SystemRandom().randrange(2**32)))
    rng = random.Random(seed)
    steps, every = 12, 2
    kills = [(rng.randrange(2), s) for s in sorted(rng.sample(range(2, steps + 1), 3))]
    spec = ",".join(f"{r}:{s}" for r, s in kills)
    why = f"seed {seed}, PLAIT_FAULT_KILL={spec}"

    data = ensure_prepared("shakespeare", tmp_path / "cache", 4096)
    args = [
        "train",
        "--nproc",
        "2",
        "--model.preset=debug",
        f"--data.source={data}",
        "--data.seq_len=32",
        "--train.global_batch_size=4",
        f"--train.steps={steps}",
        "--parallel.tp_degree=2",
        "--eval.every_steps=0",
        f"--checkpoint.every_steps={every}",
        "--checkpoint.keep_last=3",
        "--log.tensorboard=false",
        "--log.plot=false",
        "--sample.max_new_tokens=0",
        f"--run.out_dir={tmp_path}",
    ]
    clean = run_cli(*args, "--run.name=clean", cwd=tmp_path)
    assert clean.returncode == 0, clean.stderr[-3000:]
    os.environ["PLAIT_FAULT_KILL"] = spec
    try:
        faulty = run_cli(*args, "--run.name=faulty", "--max-restarts", str(len(kills)), cwd=tmp_path)
    finally:
        os.environ.pop("PLAIT_FAULT_KILL")
    assert faulty.returncode == 0, f"{why}\n{faulty.stderr[-3000:]}"
    for rank, step in kills:
        assert f"killing rank {rank} at step {step}" in faulty.stderr, why
    for i, (rank, _) in enumerate(kills, 1):  # plait's one line per restart, not the agent's traceback block
        assert f"worker rank {rank} failed (exit code 137); restarting the group ({i}/{len(kills)})" in faulty.stderr
    assert "Traceback" not in faulty.stderr and "ProcessExitedException" not in faulty.stderr, faulty.stderr[-3000:]
    found = re.findall(r"resumed from \S+\s+\(step (\d+)\)|restarted from step (0)", faulty.stderr)
    resumed = [int(a or b) for a, b in found]
    assert len(resumed) == len(kills), f"{why}: resumed at steps {resumed}"
    for (_, step), at in zip(kills, resumed, strict=True):
        redone = (step - 1) - at  # steps finished before the kill that the next attempt runs again
        assert 0 <= redone <= every, f"{why}: killed before step {step}, resumed from step {at}"

    def weights(run: str) -> dict:
        from plait.config import load_config
        from plait.engine.checkpoint import list_checkpoints, load_model_weights
        from plait.engine.trainer import build_model

        cfg = load_config(None, ["model.preset=debug"])
        model = build_model(cfg.model, torch.device("cpu"), seed=1)
        load_model_weights(model, list_checkpoints(tmp_path / run / "checkpoints")[-1])
        return model.state_dict()

    a, b = weights("clean"), weights("faulty")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), why


@pytest.mark.slow
def test_a_bad_fault_kill_spec_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PLAIT_FAULT_KILL", "1:5,x")
    bad = run_cli("train", "--nproc", "2", "--model.preset=debug", cwd=tmp_path)
    assert bad.returncode == 2 and "expected RANK:STEP" in bad.stderr
    monkeypatch.setenv("PLAIT_FAULT_KILL", "3:5")
    bad = run_cli("train", "--nproc", "2", "--model.preset=debug", cwd=tmp_path)
    assert bad.returncode == 2 and "names rank 3, but the run has 2 ranks" in bad.stderr


@pytest.mark.slow
def test_layout_auto_uses_the_planner(tmp_path):
    data = ensure_prepared("shakespeare", tmp_path / "cache", 4096)
    result = run_cli(
        "train",
        "--nproc",
        "2",
        "--layout",
        "auto",
        "--model.preset=debug",
        f"--data.source={data}",
        "--data.seq_len=32",
        "--train.global_batch_size=4",
        "--train.steps=2",
        "--eval.every_steps=0",
        "--sample.max_new_tokens=0",
        f"--run.out_dir={tmp_path}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "plait train --layout auto:" in result.stderr and "Best:" in result.stderr
    chosen = result.stderr.split("using: ")[1].splitlines()[0]
    assert "parallel.dp_shard_degree=" in chosen and "parallel.tp_degree=" in chosen
    bad = run_cli("train", "--layout", "fastest", cwd=tmp_path)
    assert bad.returncode == 2 and "only 'auto'" in bad.stderr
