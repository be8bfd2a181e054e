"""Fault-tolerant replica groups (parallel.fault_tolerant, torchft) end to end: `plait train --replicas 3` on the
CPU, each group one process, a real lighthouse and real gloo groups between them.

The oracle is one process replaying the run: every committed step records which samples it trained on (the
groups taking part and the first sample: engine.replicas), and one process given those same batches takes the
same steps (the average over groups of each group's mean is the mean over their samples). A lost group, its
heal and a bad group are checked against it and against each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runs import debug_run

pytest.importorskip("torchft")

# Each step's loss against the replay's: the groups sum their gradients in another order than one process's
# backward over the whole batch (fp32 rounding, ~1e-7 relative per step, grown by 12 steps of AdamW).
LOSS_TOL = 2e-4
GROUP_BATCH = 8  # train.global_batch_size of tests/runs.debug_run: each group's batch per step


def launch(tmp_path: Path, data_dir: Path, name: str, steps: int, *extra: str, env: dict | None = None):
    settings = [f"--{s}" for s in debug_run(data_dir, tmp_path, name, steps, "run.health_check_enabled=false")]
    cmd = [sys.executable, "-m", "plait.cli", "train", "--replicas", "3", "--nproc", "1", *settings, *extra]
    clean = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return subprocess.run(cmd, capture_output=True, text=True, env={**clean, **(env or {})}, timeout=900)


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run: Path) -> dict[int, float]:
    """Each logged step's loss, the earlier attempts' (previous-*, see schedule) included."""
    earlier: dict[int, float] = {}
    for moved in sorted(run.glob("previous-*")):
        earlier.update(losses(moved))
    return earlier | {r["step"]: r["train/loss"] for r in records(run) if "train/loss" in r}


def schedule(run: Path) -> dict[int, tuple[int, int]]:
    """Each committed step's (first sample, samples) as the group recorded it (a group restarted without a
    checkpoint of its own moved its earlier metrics to previous-*: they count too)."""
    earlier = {}
    for moved in sorted(run.glob("previous-*")):
        earlier.update(schedule(moved))
    return earlier | _schedule(run)


def _schedule(run: Path) -> dict[int, tuple[int, int]]:
    return {
        r["step"]: (r["replicas/first_sample"], r["replicas/samples"]) for r in records(run) if "replicas/samples" in r
    }


def replay(tmp_path: Path, data_dir: Path, steps: dict[int, tuple[int, int]], monkeypatch) -> dict[int, float]:
    """One process taking each recorded step's samples as one batch: the run without replicas."""
    import plait.engine.trainer as trainer
    from plait.api import train
    from plait.config import load_config
    from plait.engine.replicas import Replicas

    class Replay(Replicas):
        def __init__(self, loader, state):
            self.loader, self.state = loader, state

        def start_step(self) -> None:
            first, samples = steps[self.state.step + 1]
            self.loader.place(first, dp_rank=0, dp_degree=1, global_batch_size=samples)

    monkeypatch.setattr(
        trainer, "build_replicas", lambda cfg, env, meshes, t, loader, state, own: Replay(loader, state)
    )
    train(load_config(None, debug_run(data_dir, tmp_path, "replay", max(steps), "run.health_check_enabled=false")))
    return losses(tmp_path / "replay")


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    from plait.engine.checkpoint import list_checkpoints
    from plait.engine.checkpoint.weights import load_checkpoint_model

    return load_checkpoint_model(list_checkpoints(run / "checkpoints")[-1]).state_dict()


def step_gaps(run: Path) -> list[float]:
    times = [r["time"] for r in records(run) if "train/loss" in r]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


STEPS = 40  # with SLOW_S a step, the run outlasts a group's restart (~5-10 s on two busy cores)
SLOW_S = "0.3"  # every group's step takes this much longer (PLAIT_FAULT_SLOW_RANK on each group's rank 0)


@pytest.mark.slow
def test_a_lost_group_drops_out_heals_from_a_peer_and_the_run_equals_one_process(tmp_path, data_dir, monkeypatch):
    """Group 2 is killed (as a lost machine: a hard exit) at step 5: groups 0 and 1 step on without a restart,
    group 2's own agent restarts it and it heals from a live peer (no checkpoint read), and every group ends with
    the same weights, bitwise. One process replaying the committed steps' samples gives each step's loss."""
    result = launch(
        tmp_path, data_dir, "ft", STEPS, "--max-restarts", "1",
        env={"PLAIT_FAULT_REPLICA_KILLS": "2:5", "PLAIT_FAULT_SLOW_RANK": f"0:{SLOW_S}"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    err = result.stderr
    assert "fault injection: killing rank 0 at step 5" in err
    assert "[replica 2] replica 2: healed from a live peer" in err, err[-4000:]
    for survivor in (0, 1):
        assert f"[replica {survivor}] plait train: worker rank 0 failed" not in err  # no restart of theirs
    run = tmp_path / "ft"
    got = [losses(run / f"replica_{i}") for i in range(3)]
    plans = [schedule(run / f"replica_{i}") for i in range(3)]
    plan = {step: each for p in plans for step, each in p.items()}  # a group that joined late healed past the start
    assert sorted(plan) == list(range(1, STEPS + 1))  # every step committed once
    for g, p in zip(got, plans, strict=True):  # where two groups took a step, they took the same one
        assert all(plan[s] == p[s] and g[s] == got[0].get(s, g[s]) for s in p)
    sizes = {samples for _, samples in plan.values()}
    assert 3 * GROUP_BATCH in sizes and sizes <= {GROUP_BATCH, 2 * GROUP_BATCH, 3 * GROUP_BATCH}
    # it ran as 3 groups, and as 2 while group 2 restarted, unless the group was back before the lighthouse gave
    # it up (its heartbeat's 5 s): the others then waited for it at the next quorum, which it joined by healing
    firsts = [plan[s][0] for s in sorted(plan)]
    assert firsts == [sum(plan[s][1] for s in sorted(plan) if s < step) for step in sorted(plan)]  # none twice
    weights = [final_weights(run / f"replica_{i}") for i in range(3)]
    for other in weights[1:]:
        assert all(torch.equal(weights[0][k], other[k]) for k in weights[0]), "the groups ended apart"
    gaps = step_gaps(run / "replica_0")
    print(f"longest step-to-step gap of a survivor: {max(gaps):.1f} s (median {sorted(gaps)[len(gaps) // 2]:.2f} s)")
    assert max(gaps) < 30  # the survivors noticed the loss at once (gloo: connection closed), not at a timeout
    expected = replay(tmp_path, data_dir, plan, monkeypatch)
    merged = {s: loss for g in got for s, loss in g.items()}
    for step, loss in merged.items():
        assert abs(loss - expected[step]) < LOSS_TOL, (step, loss, expected[step])


@pytest.mark.slow
def test_a_bad_group_is_named_and_left_out(tmp_path, data_dir):
    """Group 1 sends its gradient sign-flipped and x100 from step 2 on: the check leaves it out by name each
    step (then quarantines it), and the loss falls as without it; the same run without the check climbs."""
    bad = {"PLAIT_FAULT_BAD_REPLICA": "1:flip:100@2"}
    checked = launch(tmp_path, data_dir, "checked", 10, env=bad)
    assert checked.returncode == 0, checked.stderr[-4000:]
    assert "left out: replica 1 (norm" in checked.stderr and "quarantined: 1" in checked.stderr
    run = tmp_path / "checked" / "replica_0"
    excluded = {
        r["step"]: (r["replicas/groups"], r["replicas/excluded"])
        for i in range(3) for r in records(tmp_path / "checked" / f"replica_{i}") if "replicas/samples" in r
    }  # fmt: skip
    assert excluded[1][1] == "" and all(excluded[s][1] == "1" for s in range(2, 11) if excluded[s][0] == 3)
    assert sum(excluded[s][0] == 3 for s in range(2, 11)) >= 6  # (a group that started late healed into step 2 or 3)
    logged = {
        r["step"]: r
        for i in range(3)
        for r in records(tmp_path / "checked" / f"replica_{i}")
        if "replicas/samples" in r
    }
    # the left-out group's shares went back in the queue: every sample handed out was trained once or waits there
    fresh, trained = (sum(r[f"replicas/{k}"] for r in logged.values()) for k in ("samples", "trained"))
    assert trained == fresh - logged[10]["replicas/pending"] and trained < fresh
    assert sum(r["replicas/retrained"] for r in logged.values()) > 0  # and later steps trained them
    unchecked = launch(tmp_path, data_dir, "unchecked", 10, "--parallel.contribution_check=false", env=bad)
    assert unchecked.returncode == 0, unchecked.stderr[-4000:]
    with_check, without = losses(run), losses(tmp_path / "unchecked" / "replica_0")
    print(
        f"loss at step 10: {with_check[10]:.3f} with the check, {without[10]:.3f} without (step 1: {with_check[1]:.3f})"
    )
    assert with_check[10] < with_check[1] - 0.2  # it learns
    assert without[10] > with_check[10] + 0.5  # the flipped group's ascent wins without the check


@pytest.mark.slow
def test_diloco_groups_talk_once_a_round_and_a_round_a_group_left_is_undone(tmp_path, data_dir):
    """DiLoCo with H = 4: the groups send nothing to each other inside a round and average once at its end, so
    every group holds the same weights at each round's end. Group 2 is lost in round 2: the others' round is not
    committed (weights back to its start, its samples to the next round), group 2 heals at a round's start, and
    all end bitwise equal."""
    result = launch(
        tmp_path, data_dir, "diloco", 24, "--max-restarts", "1", "--parallel.diloco_sync_every=4",
        "--checkpoint.every_steps=8",
        env={"PLAIT_FAULT_REPLICA_KILLS": "2:6", "PLAIT_FAULT_SLOW_RANK": f"0:{SLOW_S}"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    err = result.stderr
    assert "[replica 0] replica 0: the round ending at step 8 was not committed" in err, err[-4000:]
    assert "[replica 2] replica 2: healed from a live peer" in err
    run = tmp_path / "diloco"
    sent = {r["step"]: r["replicas/sent_mb"] for r in records(run / "replica_0") if "replicas/sent_mb" in r}
    inside = [s for s in sent if s % 4 and s - 1 in sent]
    assert inside and all(sent[s] == sent[s - 1] for s in inside)  # nothing crosses inside a round
    assert all(sent[s] > sent[s - 1] for s in sent if s % 4 == 0 and s - 1 in sent)  # one average at its end
    weights = [final_weights(run / f"replica_{i}") for i in range(3)]
    for other in weights[1:]:
        assert all(torch.equal(weights[0][k], other[k]) for k in weights[0]), "the groups ended apart"


def check_accounting(run: Path, groups: int, steps: int) -> dict[int, tuple[int, int]]:
    """Every step committed once, the same by every group that took it, its samples right after the last's."""
    plans = [schedule(run / f"replica_{i}") for i in range(groups)]
    plan = {step: each for p in plans for step, each in p.items()}
    assert sorted(plan) == list(range(1, steps + 1))
    assert all(plan[s] == p[s] for p in plans for s in p)
    firsts = [plan[s][0] for s in sorted(plan)]
    assert firsts == [sum(plan[s][1] for s in sorted(plan) if s < step) for step in sorted(plan)]
    weights = [final_weights(run / f"replica_{i}") for i in range(groups)]
    for other in weights[1:]:
        assert all(torch.equal(weights[0][k], other[k]) for k in weights[0]), "the groups ended apart"
    return plan


@pytest.mark.full
def test_ten_random_kills_in_one_run_lose_no_step_and_no_sample(tmp_path, data_dir):
    """Ten kills drawn at random over the three groups in one run: it completes, each step committed once by the
    groups alive at it, every sample trained once, and the groups end bitwise equal."""
    import random

    rng, steps = random.Random(47), 70
    kills = sorted(rng.sample(range(4, steps - 8), 10))
    spec = ",".join(f"{rng.randrange(3)}:{s}" for s in kills)
    result = launch(
        tmp_path, data_dir, "kills", steps, "--max-restarts", "10",
        env={"PLAIT_FAULT_REPLICA_KILLS": spec, "PLAIT_FAULT_SLOW_RANK": f"0:{SLOW_S}"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    fired = result.stderr.count("fault injection: killing rank 0")
    plan = check_accounting(tmp_path / "kills", 3, steps)
    failed = max(r.get("replicas/failed_attempts", 0) for r in records(tmp_path / "kills" / "replica_0"))
    print(f"kills {spec}: {fired} fired, {failed} step attempts failed on group 0, {len(plan)} steps committed")
    assert fired >= 8  # (a kill drawn for a group after its own last step does not fire)


LAYOUTS = {"fsdp": ["--parallel.dp_shard_degree=2"], "tp": ["--parallel.tp_degree=2"], "pp": ["--parallel.pp_degree=2"]}


@pytest.mark.full
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_groups_of_two_ranks_heal_their_shards_in_each_layout(tmp_path, data_dir, layout):
    """Two groups, each of 2 processes in a layout of its own (FSDP, TP with SP, a 2-stage pipeline): group 1 is
    lost and heals rank by rank from group 0's (DTensor shards, or its stage's parameters); both end bitwise
    equal, every step and sample accounted for."""
    settings = [f"--{s}" for s in debug_run(data_dir, tmp_path, layout, 60, "run.health_check_enabled=false")]
    settings += ["--guard.straggler_ratio=0", *LAYOUTS[layout]]  # (the injected slowness is rank 0's alone)
    cmd = [
        sys.executable,
        "-m",
        "plait.cli",
        "train",
        "--replicas",
        "2",
        "--nproc",
        "2",
        "--max-restarts",
        "1",
        *settings,
    ]
    clean = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env = {**clean, "PLAIT_FAULT_REPLICA_KILLS": "1:6", "PLAIT_FAULT_SLOW_RANK": f"0:{SLOW_S}"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "[replica 1] replica 1: healed from a live peer" in result.stderr, result.stderr[-4000:]
    check_accounting(tmp_path / layout, 2, 60)


@pytest.mark.full
def test_diloco_resumes_bitwise_from_its_round_checkpoints(tmp_path, data_dir):
    """DiLoCo groups stopped at a round's checkpoint (step 8) and launched again to step 12 end with the weights
    of groups that ran the 12 steps at once: the inner and outer optimizers' states and the data position
    come back from each group's checkpoint."""
    diloco = ["--parallel.diloco_sync_every=4", "--checkpoint.every_steps=4", "--optim.schedule=constant"]
    # (a constant LR after warm-up: a cosine's shape would follow train.steps, which the two launches differ in)
    assert launch(tmp_path, data_dir, "once", 12, *diloco).returncode == 0
    first = launch(tmp_path, data_dir, "twice", 8, *diloco)
    assert first.returncode == 0, first.stderr[-3000:]
    again = launch(tmp_path, data_dir, "twice", 12, *diloco)
    assert again.returncode == 0 and "resumed from" in again.stderr, again.stderr[-3000:]
    once, twice = final_weights(tmp_path / "once" / "replica_0"), final_weights(tmp_path / "twice" / "replica_1")
    assert all(torch.equal(once[k], twice[k]) for k in once)
