"""The check of each replica group's gradient before the groups' gradients are averaged: a contributor cannot
spoil the run.

Each participating replica group contributes its gradient; before the average, every contribution is judged
against the others from a few reduced numbers, and an offending one is left out of that step's average, named
(`Verdict`), and after repeated offences quarantined: left out, unjudged, for a while. It still receives the
average; it only stops contributing.

The rules, in order, on the groups that are not quarantined ("judged"):

1. Non-finite: a contribution with a NaN or an infinity (or a norm past float32's range) is left out. Always,
   whatever the number of groups.
2. Norm: with at least `MIN_JUDGED` finite contributions, one whose norm is over `exclude_ratio` times the
   median norm of the finite ones (itself included), or under 1/`exclude_ratio` of it, is left out; one over
   `ratio` times the median (but within `exclude_ratio`) is clipped to `ratio` x the median: its direction kept,
   its weight bounded (honest small-batch gradients spike that far early in training; a broken or scaled group is
   off by far more). A clip leaves the group in that step's average but counts towards its quarantine: an honest
   spike is rare (1 clip in 180 group-steps of the fault-free runs of bench/replicas_bad.py), a group whose
   noise is 10x its gradient is clipped nearly every step, and its noise, clipped to 4x, still outweighed two
   honest groups there. The median of all, not of the
   others: with three groups and one scaled by 100, an honest group's others would have for median the mean
   of an honest norm and the scaled one. The median holds while fewer than half the groups are outliers.
3. Direction: with at least `MIN_JUDGED` contributions left, each one's cosine with the sum of the OTHER
   admitted ones is computed. Where the groups agree (the median cosine, "agreement", is at least
   `min_agreement`), one whose cosine is below -`opposed_fraction` x agreement (it points against the others)
   is left out, and the sum is redone without it. With exactly three admitted, the others' sum of an honest group
   holds the flipped one and cancels: the rule compares pairs instead. The three pairwise dot products follow
   from the same reduced numbers (<g_a, S> - |g_a|^2 = <g_a, g_b> + <g_a, g_c>, three equations for three
   unknowns); where the best-agreeing pair's cosine is at least `min_agreement`, the third is left out if its
   cosine with each of the two is below -`opposed_fraction` x that agreement (two agree, and it opposes both).

With fewer than `MIN_JUDGED` finite contributions only non-finite ones are left out: two cannot outvote each
other. Limits, measured on a small MLP's honest gradients (tests/unit/test_contributions.py and the
constants' notes):
- Honest gradients of small batches disagree: once a model has learnt the easy part, their cosines with each
  other's sum spread around zero (down to -0.5 at a median of 0.2), so a direction is judged only where the
  median agreement is at least `min_agreement`. Below it a sign-flipped contribution is admitted: with four to
  eight groups a flip was caught in nearly every draw at 256 samples a group on the fresh model, in most until
  60 steps of training, and rarely after, or below 64 samples a group. Its harm there is of the size of one
  batch's noise.
- With three groups a flip is judged by pairs (above): caught where the two honest groups agree, which in the
  runs of bench/replicas_bad.py happens often enough early in training that a flipped group is quarantined
  (3 offences in 20 rounds) before the honest groups' gradients decorrelate.
- A noisy contribution whose norm stays within `ratio` and whose cosine is above the opposed bound is admitted:
  it adds variance, as a smaller batch would, not a bias. Noise that dominates the norm is a norm outlier.
- Each rule holds while fewer than half the judged groups offend (a median is its reference).

Communication, per step, over the participating groups (`replica_sum`) and inside each group (`group_sum`):
small reductions of a few floats per slot (3 per group for the sizes, 1 per group and 1 more for the
directions; inside the group 1 float and 2), each read back to the host (a device synchronisation); big: one
`replica_sum` of the gradient shard, and a second one on a step where a direction outlier is left out. Memory:
one buffer the size of the gradient shard, for the sum (the shard itself is needed for the direction check).
Every decision is taken from the reduced numbers, so every rank of every group takes the same one (it assumes,
as NCCL and gloo give, the same bits on every rank of one reduction).

Offences are counted by replica id over the rounds of averaging (one per call of `average`): after
`quarantine_after` offences within the last `window` rounds a group is quarantined for `quarantine_steps`
rounds. The history is part of the state a healing group receives (`state_dict`, `load_state_dict`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Reduce = Callable[[torch.Tensor], None]
"""Sums a tensor in place: over the ranks of this replica group (`group_sum`), or over the participating replica
groups at this group rank (`replica_sum`)."""

EXCLUDE_RATIO = 32.0
"""A norm this far from the median is left out (an offence). Honest language-model gradients of small groups
(8 sequences of 32 tokens) early in training were measured up to 12.4x the median (bench/diloco.py's smoke
run), and 4.7x at step 14 of its 200-step runs; scaled, overflowing or noise-dominated contributions of the
fault modes (x100) are far beyond."""
NORM_RATIO = 4.0
"""The norm a contribution is clipped to, as a multiple of the median. Honest gradients of different batches
mostly differ in norm by tens of percent: over 3,500 draws of a small MLP's gradients (3 to 8 groups, 8 to 256
samples a group, the model fresh to 300 steps trained) the largest ratio to the median was 2.5 (8 samples a
group; 1.6 from 64 samples), once 5.3 with 8 samples on a model trained longer. Clipped, such a spike still
counts with its direction; its weight is bounded."""
MIN_JUDGED = 3
"""Below three contributions a norm or a direction has no majority to be judged against."""
MIN_AGREEMENT = 0.5
"""The median cosine (of each group with the others' sum) from which a direction is judged. Below it the honest
groups disagree among themselves: a small MLP's honest cosines go down to -0.5 x the median at a median of 0.4
and to -1.8 x at 0.2."""
OPPOSED_FRACTION = 0.5
"""A group is a direction outlier when its cosine is below -OPPOSED_FRACTION x the agreement: at an agreement of
at least MIN_AGREEMENT the lowest honest one seen over 3,500 draws was -0.37 x (16 samples a group); a
sign-flipped one, from four groups on, lies at -0.7 x or below from 64 samples a group. A fraction of 0.25
catches no more flips in those draws, and admits less margin."""
QUARANTINE_AFTER = 3
"""Offences within WINDOW rounds that quarantine a group: one bad batch is a mishap, three a broken group."""
WINDOW = 20
"""Rounds over which offences are counted: long enough to see a group that keeps failing, short enough that
rare mishaps over a long run do not add up."""
QUARANTINE_STEPS = 100
"""Rounds a quarantined group is left out unjudged: long against the window, so that a group that keeps
failing spends most of its time out rather than offending anew every few rounds."""
EXACT_ID_LIMIT = 2**24
"""Replica ids travel in a float32 slot, exact up to 2**24."""
_NAN, _INF = 1.0, 2.0  # the non-finite flag's values


@dataclass
class Verdict:
    """What one round of averaging admitted and left out."""

    admitted: int
    """How many groups' contributions are in the average."""
    excluded: dict[int, str] = field(default_factory=dict)
    """Replica id -> why its contribution was left out (one short phrase with the numbers)."""
    quarantined: set[int] = field(default_factory=set)
    """Replica ids under quarantine after this round (those quarantined by it included)."""
    clipped: dict[int, str] = field(default_factory=dict)
    """Replica id -> why its admitted contribution was scaled down to the clip norm (it stays in the average; the
    clip counts towards quarantine)."""
    excluded_slots: set[int] = field(default_factory=set)
    """The participating slots of the left-out groups (their samples go back in the queue: plait.engine.ledger)."""

    def summary(self) -> str:
        """One line for the log."""
        total = self.admitted + len(self.excluded)
        line = f"contributions: {self.admitted} of {total} admitted"
        if self.excluded:
            line += "; left out: " + ", ".join(f"replica {r} ({why})" for r, why in sorted(self.excluded.items()))
        if self.clipped:
            line += "; clipped: " + ", ".join(f"replica {r} ({why})" for r, why in sorted(self.clipped.items()))
        if self.quarantined:
            line += "; quarantined: " + ", ".join(str(r) for r in sorted(self.quarantined))
        return line


@dataclass
class _Sizes:
    """Step 1's reduced numbers, per slot."""

    sq: list[float]  # squared norm of the group's gradient (0 where non-finite)
    flag: list[float]  # 0 finite, _NAN, _INF
    ids: list[int]  # replica id


class ContributionCheck:
    """The check, one per rank; every rank of every participating group calls `average` once per step, with the
    same settings and the same history (see the module docstring)."""

    def __init__(
        self,
        *,
        ratio: float = NORM_RATIO,
        exclude_ratio: float = EXCLUDE_RATIO,
        min_agreement: float = MIN_AGREEMENT,
        opposed_fraction: float = OPPOSED_FRACTION,
        quarantine_after: int = QUARANTINE_AFTER,
        window: int = WINDOW,
        quarantine_steps: int = QUARANTINE_STEPS,
    ):
        if not 1 < ratio <= exclude_ratio:
            raise ValueError(f"ratio={ratio}, exclude_ratio={exclude_ratio}: need 1 < ratio <= exclude_ratio")
        if quarantine_after < 1 or window < 1 or quarantine_steps < 0:
            raise ValueError(
                f"quarantine_after={quarantine_after}, window={window}, quarantine_steps={quarantine_steps}: "
                "the first two must be at least 1, the last at least 0"
            )
        self.ratio, self.min_agreement, self.opposed_fraction = ratio, min_agreement, opposed_fraction
        self.exclude_ratio = exclude_ratio
        self._clipped: dict[int, tuple[float, str]] = {}  # this round's clipped slots: scale, reason
        self.quarantine_after, self.window, self.quarantine_steps = quarantine_after, window, quarantine_steps
        self.round = 0  # rounds of averaging so far
        self.offences: dict[int, list[int]] = {}  # replica id -> rounds of its offences within the window
        self.quarantine: dict[int, int] = {}  # replica id -> first round it is judged again

    def average(
        self, flat: torch.Tensor, *, slot: int, slots: int, replica_id: int, group_sum: Reduce, replica_sum: Reduce
    ) -> Verdict:
        """Replace `flat` (this rank's shard of its group's flattened fp32 gradient) by the average of the
        admitted groups' contributions (their sum over their number; zeros where none is admitted). `slot` is
        this group's participating rank in [0, slots), `replica_id` its numeric id."""
        if not 0 <= slot < slots:
            raise ValueError(f"slot={slot} is outside [0, slots={slots})")
        if not 0 <= replica_id < EXACT_ID_LIMIT:
            raise ValueError(f"replica_id={replica_id} must be in [0, 2**24): it travels as a float32")
        sizes = _reduce_sizes(flat, slot, slots, replica_id, group_sum, replica_sum)
        excluded = self._judge_sizes(sizes)
        for s, (scale, _) in self._clipped.items():  # every rank knows the scales; each clips its own
            sizes.sq[s] *= scale * scale
            if s == slot:
                flat.mul_(scale)
        admitted = [s for s in range(slots) if s not in excluded]
        total = torch.empty_like(flat)
        if admitted:
            _sum_admitted(flat, total, slot in admitted, replica_sum)
            if len(admitted) >= MIN_JUDGED:
                dots, total_sq = _reduce_directions(flat, total, slot, slots, slot in admitted, group_sum, replica_sum)
                opposed = self._judge_directions(sizes.sq, dots, total_sq, admitted)
                if opposed:
                    excluded.update(opposed)
                    admitted = [s for s in admitted if s not in opposed]
                    _sum_admitted(flat, total, slot in admitted, replica_sum)
            flat.copy_(total).div_(len(admitted))
        else:
            flat.zero_()
        return self._record(sizes.ids, excluded, admitted=len(admitted))

    def _judge_sizes(self, sizes: _Sizes) -> dict[int, str]:
        """Slot -> reason, for the quarantined, non-finite and norm-outlier contributions (rules 1 and 2)."""
        out: dict[int, str] = {}
        for s, rid in enumerate(sizes.ids):
            if self.quarantine.get(rid, 0) > self.round:
                out[s] = f"quarantined until round {self.quarantine[rid]}"
            elif sizes.flag[s] == _NAN:
                out[s] = "NaN in its gradient"
            elif sizes.flag[s] == _INF:
                out[s] = "infinite gradient, or a norm past float32's range"
        judged = [s for s in range(len(sizes.ids)) if s not in out]
        self._clipped = {}
        if len(judged) < MIN_JUDGED:
            return out
        norms = {s: math.sqrt(sizes.sq[s]) for s in judged}
        median = statistics.median(norms.values())
        if median == 0:  # every group, or most, has a zero gradient: no scale to compare against
            return out
        for s, norm in norms.items():
            if norm > self.exclude_ratio * median:
                out[s] = f"norm {norm:.3g} is {norm / median:.3g}x the median {median:.3g}"
            elif norm * self.exclude_ratio < median:
                out[s] = f"norm {norm:.3g} is 1/{median / norm if norm else math.inf:.3g} of the median {median:.3g}"
            elif norm > self.ratio * median:
                why = f"norm {norm:.3g} is {norm / median:.3g}x the median {median:.3g}, clipped to {self.ratio:g}x"
                self._clipped[s] = (self.ratio * median / norm, why)
        return out

    def _judge_directions(
        self, sq: list[float], dots: list[float], total_sq: float, admitted: list[int]
    ) -> dict[int, str]:
        """Slot -> reason, for the direction outliers among the admitted (rule 3). A group's cosine with the
        others' sum O = S - g follows from |g|^2, <g, S> and |S|^2: <g, O> = <g, S> - |g|^2 and
        |O|^2 = |S|^2 - 2 <g, S> + |g|^2."""
        if len(admitted) == MIN_JUDGED:
            return self._judge_pairs(sq, dots, admitted)
        cosines: dict[int, float] = {}
        for s in admitted:
            others_sq = total_sq - 2 * dots[s] + sq[s]
            if sq[s] > 0 and others_sq > 0:
                cosines[s] = (dots[s] - sq[s]) / math.sqrt(sq[s] * others_sq)
        if len(cosines) < MIN_JUDGED:
            return {}
        agreement = statistics.median(cosines.values())
        if agreement < self.min_agreement:
            return {}
        bound = -self.opposed_fraction * agreement
        return {
            s: f"cosine {c:.2f} with the others' sum, against their median {agreement:.2f}"
            for s, c in cosines.items()
            if c < bound
        }

    def _judge_pairs(self, sq: list[float], dots: list[float], admitted: list[int]) -> dict[int, str]:
        """Rule 3 for exactly three: slot -> reason for the one that opposes both others where those two agree.
        With e_a = <g_a, S> - |g_a|^2 = d_ab + d_ac (and likewise for b and c), d_bc = (e_a + e_b + e_c) / 2 - e_a."""
        if any(sq[s] <= 0 for s in admitted):
            return {}
        side = {s: dots[s] - sq[s] for s in admitted}
        half = sum(side.values()) / 2
        cosine = {}
        for s in admitted:
            a, b = (o for o in admitted if o != s)
            cosine[frozenset((a, b))] = (half - side[s]) / math.sqrt(sq[a] * sq[b])
        pair = max(cosine, key=lambda k: cosine[k])
        agreement = cosine[pair]
        if agreement < self.min_agreement:
            return {}
        (odd,) = set(admitted) - pair
        against = [cosine[frozenset((odd, s))] for s in sorted(pair)]
        if max(against) >= -self.opposed_fraction * agreement:
            return {}
        shown = " and ".join(f"{c:.2f}" for c in against)
        return {odd: f"cosines {shown} with the other two, which agree at {agreement:.2f}"}

    def _record(self, ids: list[int], excluded: dict[int, str], *, admitted: int) -> Verdict:
        """Count this round's offences (a quarantined group's exclusion is none), quarantine the groups that reach
        `quarantine_after` within the window, forget what has expired, and make the verdict."""
        t = self.round
        marked = {**{s: why for s, (_, why) in self._clipped.items()}, **excluded}  # a clip counts towards quarantine
        for s, why in marked.items():
            rid = ids[s]
            if why.startswith("quarantined"):
                continue
            kept = [r for r in self.offences.get(rid, []) if r > t - self.window] + [t]
            if len(kept) >= self.quarantine_after:
                self.quarantine[rid] = t + 1 + self.quarantine_steps
                self.offences.pop(rid, None)
            else:
                self.offences[rid] = kept
        self.round = t + 1
        self.offences = {r: k for r, k in self.offences.items() if k[-1] > self.round - 1 - self.window}
        self.quarantine = {r: until for r, until in self.quarantine.items() if until > self.round}
        return Verdict(
            admitted=admitted, excluded={ids[s]: why for s, why in excluded.items()}, quarantined=set(self.quarantine),
            clipped={ids[s]: why for s, (_, why) in self._clipped.items() if s not in excluded},
            excluded_slots=set(excluded),
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """The history, as plain JSON (replica ids as strings: JSON's keys are)."""
        return {
            "round": self.round,
            "offences": {str(r): list(k) for r, k in sorted(self.offences.items())},
            "quarantine": {str(r): until for r, until in sorted(self.quarantine.items())},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt a peer's history (a healing group's); a malformed one raises ValueError naming the field and
        changes nothing."""
        if not isinstance(state, dict) or set(state) != {"round", "offences", "quarantine"}:
            keys = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"contribution state: expected the keys offences, quarantine, round; got {keys}")
        t = _count(state["round"], "round")
        offences = {
            _replica(r, "offences"): _rounds(k, f"offences[{r!r}]", before=t) for r, k in _items(state, "offences")
        }
        quarantine = {
            _replica(r, "quarantine"): _count(u, f"quarantine[{r!r}]") for r, u in _items(state, "quarantine")
        }
        self.round, self.offences, self.quarantine = t, offences, quarantine


def _reduce_sizes(
    flat: torch.Tensor, slot: int, slots: int, replica_id: int, group_sum: Reduce, replica_sum: Reduce
) -> _Sizes:
    """Step 1: each group's squared norm (its shards' sum), non-finite flag and id, in its slot of slots x 3
    floats. A NaN or an infinity anywhere makes the squared norm NaN or infinite, so one dot product tells."""
    local = torch.dot(flat, flat).reshape(1)
    group_sum(local)
    sq = float(local.item())
    flag = _NAN if math.isnan(sq) else _INF if math.isinf(sq) else 0.0
    stats = torch.zeros(slots, 3, dtype=torch.float32, device=flat.device)
    stats[slot] = torch.tensor([0.0 if flag else sq, flag, float(replica_id)], device=flat.device)
    replica_sum(stats)
    rows = stats.tolist()
    return _Sizes(sq=[r[0] for r in rows], flag=[r[1] for r in rows], ids=[int(r[2]) for r in rows])


def _sum_admitted(flat: torch.Tensor, total: torch.Tensor, admitted: bool, replica_sum: Reduce) -> None:
    """Step 2: `total` <- the sum of the admitted groups' shards (a left-out group adds zeros: every group joins
    every reduction)."""
    if admitted:
        total.copy_(flat)
    else:
        total.zero_()
    replica_sum(total)


def _reduce_directions(
    flat: torch.Tensor,
    total: torch.Tensor,
    slot: int,
    slots: int,
    admitted: bool,
    group_sum: Reduce,
    replica_sum: Reduce,
) -> tuple[list[float], float]:
    """Step 3: each admitted group's <g, S> in its slot, and |S|^2 in the last, from slot 0 only (so that every
    group reads the same bits, whatever order its own group_sum added its shards in)."""
    local = torch.stack([torch.dot(flat, total), torch.dot(total, total)])
    group_sum(local)
    dot, total_sq = local.tolist()
    stats = torch.zeros(slots + 1, dtype=torch.float32, device=flat.device)
    if admitted:
        stats[slot] = dot
    if slot == 0:
        stats[slots] = total_sq
    replica_sum(stats)
    values = stats.tolist()
    return values[:slots], values[slots]


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"contribution state: {name} must be a whole number >= 0, got {value!r}")
    return value


def _items(state: dict[str, Any], name: str) -> list[tuple[Any, Any]]:
    if not isinstance(state[name], dict):
        raise ValueError(f"contribution state: {name} must be a mapping of replica id to rounds")
    return list(state[name].items())


def _replica(key: Any, name: str) -> int:
    if not isinstance(key, str) or not key.isdigit() or int(key) >= EXACT_ID_LIMIT:
        raise ValueError(f"contribution state: {name} has a key {key!r} that is no replica id (0 to 2**24 - 1)")
    return int(key)


def _rounds(value: Any, name: str, *, before: int) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"contribution state: {name} must be a non-empty list of rounds")
    rounds = [_count(v, name) for v in value]
    if rounds != sorted(set(rounds)) or rounds[-1] >= before:
        raise ValueError(f"contribution state: {name} must be increasing rounds before round {before}, got {value}")
    return rounds
