"""Guards while training: bad steps, loss spikes, hangs and stragglers (config section ``guard``).

One `Guard` per run sits beside the loop: ``before_step`` and ``after_step`` around each step, and
``should_step`` inside `train_step`, between the global gradient norm and the optimizer, where it decides
whether the update is applied:

- a non-finite loss or gradient norm: skip the update, roll back to the newest checkpoint, or stop
  (guard.nonfinite_policy); N failed steps in a row end the run with an error;
- a loss spike (above mean + k std of a window of recent losses): a warning and a metric, optionally a skip;
- a hang: a watchdog thread per rank (plait.features.watchdog) notices no progress for guard.hang_timeout_s,
  reports the rank, its phase and the last collective it entered, dumps all Python stacks and exits non-zero
  (an elastic agent then restarts the group from the newest checkpoint);
- stragglers: every log interval each rank's own time per step is all-gathered and a rank over
  guard.straggler_ratio x its peers' median is named.

Every decision is made from values that are identical on all ranks (the loss and the gradient norm are
global, all-reduced in train_step), so all ranks skip, roll back or stop together.
Cost: one host sync per step (the loss and norm read in should_step); on CPU it is free, on a GPU it
keeps the host from queueing the next step's kernels before this step's backward has finished.
Fault injection for tests lives in plait.features.faults.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from plait.core.collectives import all_gather_single
from plait.core.errors import PlaitError
from plait.core.storage import Location
from plait.engine.callbacks import Callback, RunState
from plait.engine.checkpoint import TrainState
from plait.features.watchdog import _PHASES, HANG_EXIT_CODE, Watchdog, describe_stack  # noqa: F401 - importable here

# ------------------------------------------------------------------------------------------ loss spikes


class SpikeDetector:
    """Flags a loss above mean + num_std x std of the last `window` accepted losses (once the window is full)."""

    def __init__(self, window: int, num_std: float):
        self.losses: deque[tuple[int, float]] = deque(maxlen=window)
        self.num_std = num_std

    def score(self, loss: float) -> float | None:
        """How many standard deviations above the window's mean `loss` lies, if that makes it a spike."""
        if len(self.losses) < (self.losses.maxlen or 0):
            return None
        values = [v for _, v in self.losses]
        mean = statistics.fmean(values)
        std = max(statistics.pstdev(values, mean), 1e-4 * abs(mean), 1e-12)
        z = (loss - mean) / std
        return z if z > self.num_std else None

    def add(self, step: int, loss: float) -> None:
        self.losses.append((step, loss))

    def truncate(self, step: int) -> None:
        """Forget losses after `step` (a rollback replays them)."""
        while self.losses and self.losses[-1][0] > step:
            self.losses.pop()


# ------------------------------------------------------------------------------------------ stragglers


@dataclass
class Straggler:
    rank: int  # the rank with the largest ratio (named only when ratio > the threshold)
    ratio: float  # its own time per step / its peers' median
    own_s: list[float]  # every rank's own time per step


def find_straggler(local_s: list[float], sync_s: list[float]) -> Straggler:
    """Which rank makes the others wait, from per-rank mean step times split in two windows:

    local_s: between steps (data loading, host work, logging): no collective, so a slow rank's delay
    stays its own; sync_s: inside train_step, where every rank waits for the slowest at each collective, so
    a fast rank's sync time includes the slow rank's delay. The rank that waited least has the smallest
    sync_s; each rank's own time is its local time plus that minimum.
    Limitation: slowness *inside* the step (a slow GPU) is shared out by the collectives and not seen here.
    """
    base = min(sync_s)
    own = [x + base for x in local_s]
    ratios = []
    for r, mine in enumerate(own):
        peers = statistics.median(o for i, o in enumerate(own) if i != r)
        ratios.append(mine / max(peers, 1e-9))
    worst = max(range(len(own)), key=ratios.__getitem__)
    return Straggler(worst, ratios[worst], own)


# ------------------------------------------------------------------------------------------ the guard


class Guard:
    """Bad-step policy, spike detection, hang watchdog and straggler report of one run (see the module
    docstring). metrics: where its warnings and straggler figures are logged (None: said on the console only;
    no straggler report)."""

    def __init__(self, cfg, env, *, metrics=None):
        self.cfg, self.g = cfg, cfg.guard
        self.rank, self.world_size, self.device, self.is_main = env.rank, env.world_size, env.device, env.is_main
        self.metrics = metrics
        self.spikes = SpikeDetector(self.g.spike_window, self.g.spike_num_std)
        self.watchdog = Watchdog(env.rank, self.g.hang_timeout_s, env.world_size) if self.g.hang_timeout_s > 0 else None
        self.num_skipped = self.num_rollbacks = self.num_spikes = 0
        self.step = 0
        self._failures = 0  # failed steps in a row
        self._failed_at = 0  # the newest failed step: a success from there on resets the count
        self._verdict: str | None = None  # why this step's update is withheld
        self._values = (math.nan, math.nan)  # this step's loss and gradient norm
        self._spike: float | None = None
        # straggler clocks: time between steps (local) and inside them (sync), summed over a log interval
        self._mark = time.perf_counter()
        self._local_s = self._sync_s = 0.0
        self._num_timed = 0
        self._first_interval = True

    def before_step(self, step: int) -> None:
        self.step, self._verdict, self._spike = step, None, None
        if self.watchdog:
            self.watchdog.beat(step)
        now = time.perf_counter()
        self._local_s += now - self._mark
        self._mark = now

    def should_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Called by train_step between the global gradient norm and the optimizer: apply the update?"""
        values = torch.stack([loss.detach().float().reshape(()), grad_norm.detach().float().reshape(())])
        self._values = loss_v, norm_v = tuple(values.tolist())  # the one host sync of a step
        if not (math.isfinite(loss_v) and math.isfinite(norm_v)):
            if self.g.nonfinite_policy == "stop":
                raise PlaitError(
                    f"loss is {loss_v} and gradient norm {norm_v} at step {self.step}; lower optim.lr "
                    f"(now {self.cfg.optim.lr}), or set guard.nonfinite_policy=skip or rollback"
                )
            return self._fail("non-finite")
        self._spike = self.spikes.score(loss_v)
        if self._spike is not None:
            self.num_spikes += 1
            if self.g.spike_skip_enabled:
                return self._fail("spike")
        return True

    def _fail(self, reason: str) -> bool:
        self._verdict = reason
        self._failures += 1
        self._failed_at = max(self._failed_at, self.step)
        if self._failures >= self.g.max_consecutive_failures:
            loss_v, norm_v = self._values
            raise PlaitError(
                f"{self._failures} failed steps in a row (the latest: step {self.step}, {reason} loss {loss_v} "
                f"gradient norm {norm_v}; guard.max_consecutive_failures={self.g.max_consecutive_failures}): "
                f"giving up. Lower optim.lr (now {self.cfg.optim.lr}), check the data, or resume from an earlier "
                f"checkpoint"
            )
        return False

    @property
    def verdict(self) -> str | None:
        """Why this step's update is withheld ("non-finite", "spike"), or None."""
        return self._verdict

    def after_step(self, step: int, state: TrainState, roll_back: Callable[[], Location | None] | None = None) -> bool:
        """Account for the step just run; True when the run was rolled back with roll_back (the trainer's
        run.roll_back: state then holds the checkpoint's step, and the loop goes on from there)."""
        now = time.perf_counter()
        self._sync_s += now - self._mark
        self._num_timed += 1
        if self.watchdog:
            self.watchdog.beat(step)
        loss_v, norm_v = self._values
        rolled_back = False
        if self._verdict is None:
            self.spikes.add(step, loss_v)
            if step >= self._failed_at:
                self._failures = 0
            if self._spike is not None:
                window = self.g.spike_window
                message = f"loss {loss_v:.4f} is a spike, {self._spike:.1f} std above the last {window} steps' mean"
                self._warn(step, message, {"loss_spike": 1, "spike_std": self._spike})
        elif self._verdict == "non-finite" and self.g.nonfinite_policy == "rollback":
            rolled_back = self._rollback(step, state, roll_back)
        else:
            self._skip(step)
        if not rolled_back:
            self._report_stragglers(step)
        self._mark = time.perf_counter()
        return rolled_back

    def _skip(self, step: int, why: str = "") -> None:
        self.num_skipped += 1
        loss_v, norm_v = self._values
        detail = f"loss {loss_v:.4f} spike ({self._spike:.1f} std)" if self._verdict == "spike" else f"loss {loss_v}"
        self._warn(
            step,
            f"{detail}, gradient norm {norm_v}: update skipped{why} ({self.num_skipped} so far)",
            {
                "skipped": 1,
                "reason": self._verdict,
                "loss": loss_v,
                "grad_norm": norm_v,
                "num_skipped": self.num_skipped,
            },
        )

    def _rollback(self, step: int, state: TrainState, roll_back) -> bool:
        path = roll_back() if roll_back is not None else None
        if path is None:
            self._skip(step, " (no checkpoint to roll back to yet)")
            return False
        self.spikes.truncate(state.step)
        self.num_rollbacks += 1
        loss_v, norm_v = self._values
        self._warn(
            step,
            f"loss {loss_v}, gradient norm {norm_v}: rolled back to {path.name} (step {state.step}); "
            f"{self.num_rollbacks} rollback(s) so far",
            {"rollback_to": state.step, "loss": loss_v, "grad_norm": norm_v, "num_rollbacks": self.num_rollbacks},
        )
        return True

    def _report_stragglers(self, step: int) -> None:
        """Every log interval: one all-gather of (local, sync) mean step times over the world; the main rank
        writes guard/straggler_* metrics and names a rank over guard.straggler_ratio x its peers' median."""
        total = self.cfg.train.steps
        if self.world_size == 1 or not self.g.straggler_ratio or self.metrics is None:
            return
        if not self.metrics.should_log(step, total):
            return
        n = max(1, self._num_timed)
        mine = torch.tensor([self._local_s / n, self._sync_s / n], dtype=torch.float64, device=self.device)
        out = torch.empty(self.world_size * 2, dtype=torch.float64, device=self.device)
        all_gather_single(out, mine)
        first, self._first_interval = self._first_interval, False
        self._local_s = self._sync_s = 0.0
        self._num_timed = 0
        if first:  # the first step builds lazily and warms caches, unevenly across ranks
            return
        local_s, sync_s = out.view(-1, 2).T.tolist()
        s = find_straggler(local_s, sync_s)
        named = s.ratio > self.g.straggler_ratio
        self.metrics.log(
            step,
            {
                "straggler_rank": s.rank if named else -1,
                "straggler_ratio": s.ratio,
                "slowest_rank": s.rank,
                "rank_step_s_max": max(s.own_s),
                "rank_step_s_median": statistics.median(s.own_s),
            },
            prefix="guard",
        )
        if named and self.is_main:
            peers = statistics.median(o for i, o in enumerate(s.own_s) if i != s.rank)
            self._print(
                step,
                f"straggler: rank {s.rank} takes {s.ratio:.1f}x its peers' time per step "
                f"({s.own_s[s.rank]:.3f} s vs {peers:.3f} s median, measured outside collectives)",
            )

    def _warn(self, step: int, message: str, values: dict) -> None:
        if self.metrics is not None:
            self.metrics.log(step, values, prefix="guard")
        if self.is_main:
            self._print(step, message)

    def _print(self, step: int, message: str) -> None:
        from plait.engine.metrics import warn

        warn(f"guard: step {step}: {message}")

    def close(self) -> None:
        """Stop the watchdog and summarise what the guard did."""
        if self.watchdog:
            self.watchdog.stop()
        if self.is_main and (self.num_skipped or self.num_rollbacks or self.num_spikes):
            from plait.engine.metrics import info

            info(
                f"guard: {self.num_skipped} step(s) skipped, {self.num_rollbacks} rollback(s), "
                f"{self.num_spikes} loss spike(s)"
            )


class Guards(Callback):
    """The run's Guard (bad steps, spikes, hang watchdog, stragglers) attached to the trainer."""

    def __init__(self):
        self.guard: Guard | None = None

    def on_start(self, run: RunState) -> None:
        self.guard = Guard(run.cfg, run.env, metrics=run.metrics)

    def before_step(self, run: RunState, step: int) -> None:
        assert self.guard is not None  # noqa: S101  # on_start built it
        self.guard.before_step(step)

    def should_step(self, run: RunState, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        assert self.guard is not None  # noqa: S101  # on_start built it
        if not self.guard.should_step(loss, grad_norm):
            run.withhold_step(f"guard: {self.guard.verdict}")

    def after_step(self, run: RunState, step: int, result) -> None:
        assert self.guard is not None  # noqa: S101  # on_start built it
        self.guard.after_step(step, run.state, roll_back=run.roll_back)

    def close(self, run: RunState) -> None:
        if self.guard is not None:
            self.guard.close()
