"""Fault-tolerant runs' inputs met with one clear line and exit 2, before any group starts: `plait train
--replicas`, the parallel.fault_tolerant and DiLoCo settings, `plait lighthouse`, and the fault-injection variables
of bad replicas (the test suite's own surface). Each case runs the real command in this process (bad_inputs.judge:
exit 2, one line naming the setting, no traceback, nothing on disk changed)."""

from __future__ import annotations

import pytest

from bad_inputs import judge

pytestmark = pytest.mark.filterwarnings("ignore")
pytest.importorskip("torchft")

BASE = ["--model.preset=debug", "--train.steps=4", "--run.device=cpu"]

CASES = [
    # (name, argv after `plait`, words the one line must hold)
    ("no groups", ["train", "--replicas", "0", *BASE], "--replicas=0 must be at least 1"),
    ("negative groups", ["train", "--replicas", "-2", *BASE], "--replicas=-2 must be at least 1"),
    ("fewer groups than a step needs", ["train", "--replicas", "2", "--parallel.min_replicas=3", *BASE],
     "below parallel.min_replicas=3"),
    ("groups and HSDP replicas",
     ["train", "--replicas", "2", "--nproc", "2", "--parallel.dp_replicate_degree=2", *BASE],
     "the replica groups are the data-parallel replicas"),
    ("groups and a mixture", ["train", "--replicas", "2", "--data.sources=a=shakespeare:1", *BASE],
     "parallel.fault_tolerant=true reads plait's token stream"),
    ("groups and a rollback", ["train", "--replicas", "2", "--guard.nonfinite_policy=rollback", *BASE],
     "would roll one group back alone"),
    ("min_replicas zero", ["train", "--replicas", "2", "--parallel.min_replicas=0", *BASE],
     "parallel.min_replicas=0 must be at least 1"),
    ("DiLoCo without groups", ["train", "--parallel.diloco_sync_every=4", *BASE],
     "set parallel.fault_tolerant=true"),
    ("DiLoCo negative", ["train", "--replicas", "2", "--parallel.diloco_sync_every=-1", *BASE],
     "parallel.diloco_sync_every=-1 must be 0"),
    ("DiLoCo round across a checkpoint",
     ["train", "--replicas", "2", "--parallel.diloco_sync_every=3", "--checkpoint.every_steps=4", *BASE],
     "checkpoint.every_steps=4 must be a multiple of parallel.diloco_sync_every=3"),
    ("DiLoCo round across the end",
     ["train", "--replicas", "2", "--parallel.diloco_sync_every=3", "--checkpoint.every_steps=3", *BASE],
     "train.steps=4 must be a multiple of parallel.diloco_sync_every=3"),
    ("DiLoCo outer lr zero",
     ["train", "--replicas", "2", "--parallel.diloco_sync_every=2", "--parallel.diloco_outer_lr=0", *BASE],
     "parallel.diloco_outer_lr=0.0 must be above 0"),
    ("DiLoCo outer momentum one",
     ["train", "--replicas", "2", "--parallel.diloco_sync_every=2", "--parallel.diloco_outer_momentum=1", *BASE],
     "parallel.diloco_outer_momentum=1.0 must be in [0, 1)"),
    ("fault-tolerant with no lighthouse", ["train", "--parallel.fault_tolerant=true", *BASE],
     "needs a lighthouse at http://HOST:PORT"),
    ("a lighthouse that is no address",
     ["train", "--parallel.fault_tolerant=true", "--parallel.lighthouse=file:///etc/passwd", *BASE],
     "needs a lighthouse at http://HOST:PORT"),
    ("slurm groups with no lighthouse", ["launch", "slurm", "--nodes", "2", "--replicas", "3", *BASE],
     "--replicas needs --lighthouse"),
    ("slurm lighthouse with no groups", ["launch", "slurm", "--nodes", "2", "--lighthouse", "http://h:1", *BASE],
     "--lighthouse goes with --replicas"),
    ("lighthouse port out of range", ["lighthouse", "--port", "70000"], "--port=70000 must be a port number"),
    ("lighthouse no replicas", ["lighthouse", "--min-replicas", "0"], "--min-replicas=0 must be at least 1"),
]  # fmt: skip


@pytest.mark.parametrize("name,argv,words", CASES, ids=[c[0] for c in CASES])
def test_a_bad_fault_tolerant_setting_is_one_line(name, argv, words, tmp_path, capsys):
    judge(name, [*argv, *([f"--run.out_dir={tmp_path}/runs"] if argv[0] == "train" else [])], words, tmp_path, capsys)


@pytest.mark.parametrize(
    "spec",
    ["1", "1:wobble", "x:scale", "1:scale:big", "1:flip@soon"],
)
def test_a_bad_replica_fault_is_named(spec):
    from plait.core.errors import ConfigError
    from plait.features.faults import bad_replica

    with pytest.raises(ConfigError, match="PLAIT_FAULT_BAD_REPLICA"):
        bad_replica(spec)


def test_slurm_runs_each_group_as_a_task_of_a_job_array(tmp_path, capsys):
    from plait.cli import main

    argv = ["launch", "slurm", "--nodes", "2", "--replicas", "3", "--lighthouse", "http://login1:29510", *BASE]
    assert main([*argv, "--run.name=big"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --array=0-2" in script
    assert '--parallel.replica_id="$SLURM_ARRAY_TASK_ID" --run.name=big"/replica_$SLURM_ARRAY_TASK_ID"' in script
    assert "--parallel.lighthouse=http://login1:29510 --parallel.start_replicas=3" in script
