"""Publishing a checkpoint is crash-safe: a process that dies between any two steps of a save (its shards and
DCP metadata written, then each step of Publisher.PUBLISH_STEPS, then retention) leaves the newest complete
checkpoint loadable and verified, the previous one or the new one, and never a published one that is broken;
the next run resumes from it and cleans up what the crash left. The same holds for an error raised at each of
those points (the save is reported, the run goes on).

The crash points are read from Publisher.PUBLISH_STEPS, so a step added to publishing is crashed after too. A
tiny model (one 8x8 linear layer) in one process: each crash is a forked child of one helper process that ends
with os._exit, as a lost machine would, and the checks run here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from plait.config import CheckpointConfig
from plait.core.errors import PlaitError
from plait.engine.checkpoint import CheckpointManager, TrainState, checkpoint_problems, scan_checkpoints, step_of
from plait.engine.checkpoint.publisher import Publisher

CRASH_POINTS = ["shards", *Publisher.PUBLISH_STEPS, "retain"]
"""After what the process dies: DCP's shards and metadata written (before publishing), each publishing step,
retention (the save over)."""

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

HELPER = (  # the helper process: this module's crash_each
    f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
    f"from {Path(__file__).stem} import crash_each; crash_each(sys.argv[1:])"
)


class Loader:
    """A data position: samples consumed."""

    def __init__(self, position: int = 0):
        self.position = position

    def state_dict(self) -> dict:
        return {"samples_consumed": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["samples_consumed"]


def trainable(step: int) -> SimpleNamespace:
    """The run at `step`, the same in every process: its weights, an Adam state, an LR schedule."""

    def weights() -> torch.nn.Module:
        torch.manual_seed(0)
        layer = torch.nn.Linear(8, 8)
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(step)
        return layer

    model = weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()  # an Adam state to save
    with torch.no_grad():
        for p, q in zip(model.parameters(), weights().parameters(), strict=True):
            p.copy_(q)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return SimpleNamespace(parts=[model], optimizers=[opt], schedulers=[sched], model=model)


def manager(root: Path) -> CheckpointManager:
    return CheckpointManager(root, CheckpointConfig(async_enabled=False, keep_last=1, every_minutes=0.0))


def save(m: CheckpointManager, step: int) -> dict[str, float]:
    return m.save(step, trainable(step), loader=Loader(10 * step), state=TrainState(step, 100 * step))


def method_of(point: str) -> str:
    """The publisher's method after which (before which, for "shards": publishing begins) the crash comes."""
    return "publish" if point == "shards" else point


def crash_each(cases: list[str]) -> None:
    """In the helper process: for each 'point=directory', a forked child saves step 2, then step 4, and dies
    at that point of the second save (os._exit, as a lost machine would); its exit code is printed."""
    for case in cases:
        point, root = case.split("=", 1)
        pid = os.fork()
        if pid == 0:
            m = manager(Path(root))
            save(m, 2)
            name = method_of(point)
            done = getattr(m.publisher, name)

            def then_crash(*args, name=name, done=done) -> None:
                if name != "publish":
                    done(*args)
                os._exit(137)

            setattr(m.publisher, name, then_crash)
            save(m, 4)
            os._exit(0)  # not reached: the crash point was never passed
        _, status = os.waitpid(pid, 0)
        print(point, os.waitstatus_to_exitcode(status), flush=True)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> dict[str, tuple[int, Path]]:
    """Each crash point: (the exit code of the process that crashed there, its checkpoint directory)."""
    base = tmp_path_factory.mktemp("crashes")
    roots = {point: base / point for point in CRASH_POINTS}
    done = subprocess.run(
        [sys.executable, "-c", HELPER, *(f"{p}={r}" for p, r in roots.items())],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    codes = dict(line.split() for line in done.stdout.splitlines())
    return {point: (int(codes[point]), roots[point]) for point in CRASH_POINTS}


def newest_verified(root: Path) -> int:
    """The step of the newest complete checkpoint, after checking that none is broken and that it verifies."""
    complete, damaged = scan_checkpoints(root)
    assert damaged == [], damaged  # nothing published half-way
    assert complete and {step_of(c) for c in complete} <= {2, 4}, complete
    assert checkpoint_problems(complete[-1]) == ""
    return step_of(complete[-1])


def resumes_and_cleans_up(root: Path, step: int) -> None:
    """A new run on the directory loads `step` exactly (weights, optimizer, counters, data position), saves
    on, and leaves nothing but its own checkpoint (keep_last=1)."""
    m = manager(root)  # removes the crashed save's unfinished files
    t = trainable(0)
    loader, state = Loader(), TrainState()
    m.load(root / f"step_{step:08d}", t, loader=loader, state=state)
    want = trainable(step)
    for a, b in zip(t.model.state_dict().values(), want.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    got, wanted = (x.optimizers[0].state_dict()["state"][0]["exp_avg"] for x in (t, want))
    assert torch.equal(got, wanted)
    assert (state.step, state.tokens, loader.position) == (step, 100 * step, 10 * step)
    assert save(m, 6)["saved_step"] == 6
    m.close()
    assert sorted(p.name for p in root.iterdir()) == ["step_00000006"]


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_crash_at_each_point_of_publishing_leaves_a_complete_checkpoint(crashed, point):
    code, root = crashed[point]
    assert code == 137, f"the save never passed {point!r}"
    step = newest_verified(root)
    if point == "shards":
        assert step == 2  # nothing of step 4 published
    if CRASH_POINTS.index(point) >= len(Publisher.PUBLISH_STEPS):  # after the last publishing step
        assert step == 4
    assert json.loads((root / f"step_{step:08d}" / "plait.json").read_text())["train_state"]["step"] == step
    resumes_and_cleans_up(root, step)


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_an_error_at_each_point_of_publishing_leaves_a_complete_checkpoint(tmp_path, point):
    """An error instead of a crash: the save is reported (saved or failed), training would go on, and the
    directory holds the previous checkpoint or the new one, complete."""
    m = manager(tmp_path)
    save(m, 2)
    name = method_of(point)
    done = getattr(m.publisher, name)

    def then_fail(*args):
        if name != "publish":
            done(*args)
        raise PlaitError(f"injected after {point}")

    setattr(m.publisher, name, then_fail)
    report = save(m, 4)
    assert report.get("saved_step") == 4 or report.get("failed_step") == 4, report
    m.close()
    step = newest_verified(tmp_path)
    if "saved_step" in report:
        assert step == 4
    resumes_and_cleans_up(tmp_path, step)


def test_every_publishing_step_is_a_method_of_the_publisher():
    """A step named in PUBLISH_STEPS exists (so the crash points above are real)."""
    assert all(callable(getattr(Publisher, name, None)) for name in Publisher.PUBLISH_STEPS)
