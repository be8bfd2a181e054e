"""Pipeline schedules in the memory model: how a model's layers split over the pipeline ranks, the order of
each rank's forwards and backwards (as torch.distributed.pipelining runs them), the moments that can be a
rank's peak and how many micro-batches each stage holds then (held_chunks), and the peak over those moments
for every layout at once (peak_activations). Zero bubble's leftovers after its weight passes too."""

from __future__ import annotations

import functools

import numpy as np

from plait.model.args import ModelArgs, split_layers
from plait.planner.cost.counts import distinct
from plait.planner.cost.layouts import SCHEDULES


def split_stages(a: ModelArgs, seq_len: int, pp, virtual):
    """Layers on the first and on the last pipeline rank, as the runtime splits them (model.args.split_layers,
    'cost': FLOPs balanced, the output projection on the last stage); a rank holds stages r, r + p, ... of the
    p x v. Returns (n_first, n_last, edge_first, edge_last) arrays: the ranks' layers, and those of the
    model's first and last stage among them; with pp = 1 all are L (one rank holds everything)."""
    (pps, vs), inverse = distinct(pp, virtual)
    out = np.full((4, *np.shape(pps)), a.n_layers, np.int64)
    for i, (p, v) in enumerate(zip(np.ravel(pps).tolist(), np.ravel(vs).tolist(), strict=True)):
        if p == 1:
            continue
        stages = split_layers(a, p * v, "cost", seq_len)
        at = (slice(None), i) if inverse is not None else slice(None)
        out[at] = (
            sum(len(stages[s]) for s in range(0, p * v, p)),
            sum(len(stages[s]) for s in range(p - 1, p * v, p)),
            len(stages[0]),
            len(stages[-1]),
        )
    return tuple(out[:, inverse]) if inverse is not None else tuple(out)


_F, _B, _I, _W = 0, 1, 2, 3  # forward, full backward, input gradient, weight gradient


def _rank_actions(schedule: str, p: int, v: int, m: int, r: int) -> tuple[np.ndarray, np.ndarray]:
    """The compute actions of pipeline rank r in the order torch.distributed.pipelining runs them, as two
    arrays: op (_F, _B, _I or _W) and local stage index.

    GPipe: all forwards, then all backwards. 1F1B: min(m, p - r) warm-up forwards, then one backward and one
    forward in turn. Interleaved 1F1B and zero bubble (torch's ``_get_1f1b_rank_ops``): warm-up forwards
    ((v - 1) p + k (p - 1 - r) with k = 2, resp. 1), then forward + backward pairs, walking the local stages
    round by round; zero bubble splits each backward into I and a W that lags r backward ops behind."""
    if schedule in ("gpipe", "1f1b"):
        warm = m if schedule == "gpipe" else min(m, p - r)
        seq = [_F] * warm + [_B, _F] * (m - warm) + [_B] * warm
        return np.array(seq), np.zeros(len(seq), dtype=np.int64)
    zero_bubble = schedule == "zero_bubble"
    per_round = m // max(1, m // p)
    total = m * v
    warm = min(total, (v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - r))
    op = np.arange(total + warm)  # warm-up (F), steady (F, then B), cool-down (B); W after B once op >= warm + r
    fwd_stage = (op // per_round) % v
    bwd_stage = v - 1 - ((op - warm) // per_round) % v
    lag_stage = v - 1 - ((op - r - warm) // per_round) % v  # W at op is for the backward of op - r
    ops = np.broadcast_to(np.array([_F, _I if zero_bubble else _B, _W]), (len(op), 3))
    stages = np.stack([fwd_stage, bwd_stage, lag_stage], 1)
    valid = np.stack([op < total, op >= warm, zero_bubble & (op - warm >= r)], 1)
    ops, stages = ops[valid], stages[valid]
    if zero_bubble:  # the weight gradients still owed after the last backward, oldest first
        late = np.arange(total + warm - min(r, total), total + warm)
        ops = np.concatenate([ops, np.full_like(late, _W)])
        stages = np.concatenate([stages, v - 1 - ((late - warm) // per_round) % v])
    return ops, stages


STEADY_MICRO_BATCHES = 4
"""A longer steady state only repeats moments. 1F1B and interleaved 1F1B: the distinct moments of m
micro-batches (a multiple of p) are those of 4 p from 3 p on. Zero bubble: they are too, but for the weight
gradients done, which grow by p each period in the moments that follow the steady state, so those of k p
(k > 5) are 4 p's plus (k - 4) times the growth from 4 p to 5 p (tests/unit/test_planner.py walks them all)."""

GPIPE_LINEAR_FROM = 3
"""GPipe's moments (all forwards, then the backwards' first two) hold m, m - 1 and m - 2 micro-batches: from
this many micro-batches on, those of m are 3's plus (m - 3) times the growth from 3 to 4, for any m (walked in
tests/unit/test_planner.py)."""


@functools.lru_cache(maxsize=4096)
def held_chunks(schedule: str, p: int, v: int, m: int, r: int) -> tuple[np.ndarray, np.ndarray]:
    """How rank r's memory stacks up over its schedule, at the moments that can be its peak. One row per
    moment, five groups of v columns (one per local stage): the micro-batches whose forward is done and whose
    backward (zero bubble: weight gradient) is not; those whose zero-bubble weight gradient is done; 1 where
    the stage's gradients exist (its first backward has run); 1 for the stage whose backward starts now (its
    gradients before their reduction: FSDP's fresh ones); 1 for the stage whose backward, not its first, just
    ended (a gradient made whole and being added to the kept one). The moments: the end of each run of
    forwards, and the start and end of each backward that follows one, and of each stage's first two.
    Returned apart, (forward ends, moments in backward): the rank's peak is the largest row, weighted by
    what each column's unit costs (peak_activations), with what the moment works in (rank_memory)."""
    steady = STEADY_MICRO_BATCHES * p
    if schedule == "gpipe" and m > GPIPE_LINEAR_FROM + 1:
        return _extrapolated(schedule, p, v, GPIPE_LINEAR_FROM, 1, m, r)
    if m > steady and m % p == 0:
        if schedule in ("1f1b", "interleaved_1f1b"):
            return held_chunks(schedule, p, v, steady, r)
        if schedule == "zero_bubble" and m > steady + p:
            return _extrapolated(schedule, p, v, steady, p, m, r)
    return walk_held_chunks(schedule, p, v, m, r)


def _extrapolated(schedule: str, p: int, v: int, base: int, period: int, m: int, r: int) -> tuple:
    """held_chunks at m micro-batches from those at base and base + period, where each period adds the same."""
    at, later = held_chunks(schedule, p, v, base, r), held_chunks(schedule, p, v, base + period, r)
    return tuple(b + (x - b) * ((m - base) // period) for b, x in zip(at, later, strict=True))


def walk_held_chunks(schedule: str, p: int, v: int, m: int, r: int) -> tuple[np.ndarray, np.ndarray]:
    """held_chunks by walking every action of the schedule."""
    ops, stages = _rank_actions(schedule, p, v, m, r)
    n = len(ops)
    time = np.arange(n)
    makes_grads = (ops == _B) | (ops == _W)  # the input-gradient pass (zero bubble) makes none
    held_step = (ops == _F).astype(np.int64) - makes_grads
    # each stage's first and second backward (n where it has none): its gradients exist from the first on
    grad_ops = np.nonzero(makes_grads)[0]
    first_at, second_at = np.full(v, n), np.full(v, n)
    seen, at = np.unique(stages[grad_ops], return_index=True)
    first_at[seen] = grad_ops[at]
    rest = grad_ops[grad_ops != first_at[stages[grad_ops]]]
    seen, at = np.unique(stages[rest], return_index=True)
    second_at[seen] = rest[at]
    first = time == first_at[stages]
    follows_forward = np.append(False, ops[:-1] == _F)
    peak = np.nonzero((ops == _F) & (np.append(ops[1:], _B) != _F))[0]
    backward = np.nonzero(makes_grads & (follows_forward | first | (time == second_at[stages])))[0]
    none, ended = np.full(len(backward), -1), np.where(first[backward], -1, stages[backward])
    # moments as (time after which, stage starting its backward, stage ending a later backward, in backward):
    # forward ends, then backward starts and ends in time order
    ends = len(peak) + 2 * len(backward)
    at = np.concatenate([peak, np.stack([backward - 1, backward], axis=1).ravel()])
    start = np.concatenate([np.full(len(peak), -1), np.stack([stages[backward], none], axis=1).ravel()])
    later = np.concatenate([np.full(len(peak), -1), np.stack([none, ended], axis=1).ravel()])
    keep = _distinct_moments(at, start, later, np.arange(ends) >= len(peak), held_step, first, stages)
    at, start, later = at[keep], start[keep], later[keep]
    # held, then done, per stage after each kept moment: each action's step summed into the first moment at
    # or after it, then accumulated over the moments (cheaper than accumulating over every action)
    chosen = np.sort(at)
    into = np.searchsorted(chosen, time) * 2 * v + stages
    size = (len(chosen) + 1) * 2 * v
    counts = np.bincount(into, held_step, size) + np.bincount(into + v, ops == _W, size)
    counts = np.cumsum(counts.reshape(-1, 2 * v)[:-1], axis=0)[np.searchsorted(chosen, at)]
    rows = np.zeros((len(at), 5 * v))
    rows[:, : 2 * v] = counts
    rows[:, 2 * v : 3 * v] = at[:, None] >= first_at
    rows[np.nonzero(start >= 0)[0], 3 * v + start[start >= 0]] = 1
    rows[np.nonzero(later >= 0)[0], 4 * v + later[later >= 0]] = 1
    in_backward = keep >= len(peak)
    return rows[~in_backward], rows[in_backward]


_HASH_WEIGHTS = np.random.default_rng(0).integers(1, 2**63, size=(2, 4, 1024), dtype=np.uint64) | np.uint64(1)


def _distinct_moments(at, start, later, in_backward, held_step, first, stages) -> np.ndarray:
    """Which of a schedule's moments (after action ``at``, a stage starting its backward or -1, one ending a
    later backward or -1; forward ends, then moments in backward, each in time order) can be a peak, in
    order: a steady state repeats its moments, and the planner weighs each for every layout. Of moments alike
    but for their count of weight gradients done (which only grows, and costs bytes >= 0), only the last can
    be the largest. Alike: equal in two 64-bit hashes, linear in a moment's columns, so that a sum over the
    actions makes them (a false match: odds of 2**-128 per pair)."""
    w = _HASH_WEIGHTS[:, :, : int(stages.max(initial=0)) + 1]
    steps = held_step.astype(np.uint64) * w[:, 0, stages] + first.astype(np.uint64) * w[:, 1, stages]
    key = np.cumsum(steps, axis=1)[:, at] + np.where(start >= 0, w[:, 2, start], 0)
    key += np.where(later >= 0, w[:, 3, later], 0) + in_backward * _HASH_WEIGHTS[:, 3, -1:]
    order = np.argsort(key[0], kind="stable")  # equal keys stay in time order
    h1, h2 = key[0, order], key[1, order]
    latest = np.append(h1[1:] != h1[:-1], True)  # the last of each run of equals
    if np.any(~latest[:-1] & (h2[1:] != h2[:-1])):  # the first hash matched where the second did not: odds 2**-64
        _, latest = np.unique(np.ascontiguousarray(key[:, ::-1].T).view(np.dtype((np.void, 16))), return_index=True)
        return np.sort(len(at) - 1 - latest)
    return np.sort(order[latest])


def peak_activations(schedule, pp, virtual, m, rank_is_last: bool, weight) -> dict[str, np.ndarray]:
    """Per layout (pp > 1), at the end of a forward ('f') and in a backward ('b'), at the schedule's largest
    such moment (held_chunks): the activations ('acts_f', 'acts_b'), sum over local stages s of held(s) x
    bytes(s) + done(s) x residue(s), and the gradients then ('grads_f', 'grads_b'), those of the stages whose
    backward has begun plus a backward's fresh ones. ``weight(idx)`` returns, shaped (5, 2, layouts), the
    bytes and residue of one micro-batch, its kept gradients, the fresh ones at a backward's start and at a
    later backward's end, of the rank's edge stage (the model's first stage on the first pipeline rank, its
    last on the last: the local stage 0, resp. v - 1) and of each of its other local stages, for the layouts
    ``idx``. 0 where pp = 1."""
    out = {k: np.zeros(len(pp), dtype=np.float64) for k in ("acts_f", "grads_f", "acts_b", "grads_b")}
    piped = np.nonzero(pp > 1)[0]
    if not len(piped):
        return out
    columns = [np.asarray(x, dtype=np.int64)[piped] for x in (schedule, pp, virtual, m)]
    groups, group = distinct(*columns)  # the distinct (schedule, pp, v, m), and each layout's
    assert group is not None  # noqa: S101  # the columns are 1-D arrays, never scalars
    # Layouts of one group often have the same units (what tells them apart, e.g. how the data-parallel ranks
    # split into replicas and shards, changes no activation or gradient here): each distinct column is priced
    # once and its result shared.
    units = weight(piped).reshape(10, -1)  # row 2 u: unit u of the edge stage; 2 u + 1: of another stage
    first, inverse = _alike_columns(units, group)
    order = np.argsort(group[first], kind="stable")  # the distinct columns, group by group
    first, of = first[order], group[first[order]]
    inverse = np.argsort(order)[inverse]
    units = units[:, first]
    present, starts = np.unique(of, return_index=True)
    found = {k: np.zeros(len(first)) for k in out}
    for g, a, z in zip(present, starts, [*starts[1:], len(first)], strict=True):
        sched, p, v, mb = (int(x[g]) for x in groups)
        rows, forwards = _moment_weights(SCHEDULES[sched], p, v, mb, rank_is_last)
        kept, made = rows[:, :4] @ units[:4, a:z], rows[:, 4:] @ units[4:, a:z]  # (moments, layouts)
        total, at_col = kept + made, np.arange(z - a)
        for moment, span in (("f", slice(0, forwards)), ("b", slice(forwards, len(rows)))):
            at = np.argmax(total[span], axis=0) + span.start
            found[f"acts_{moment}"][a:z], found[f"grads_{moment}"][a:z] = kept[at, at_col], made[at, at_col]
    for k, x in found.items():
        out[k][piped] = x[inverse]
    return out


@functools.lru_cache(maxsize=4096)
def _moment_weights(schedule: str, p: int, v: int, m: int, rank_is_last: bool) -> tuple[np.ndarray, int]:
    """held_chunks' moments of the first or the last pipeline rank (forward ends, then moments in backward)
    as weights of peak_activations' units: per unit, its edge stage's column and the sum of its other
    stages' (those stages have equal units), shaped (moments, 10); and how many are forward ends."""
    forward_ends, in_backward = held_chunks(schedule, p, v, m, p - 1 if rank_is_last else 0)
    rows = np.concatenate([forward_ends, in_backward]).reshape(-1, 5, v)
    edge = rows[:, :, -1 if rank_is_last else 0]
    weights = np.stack([edge, rows.sum(axis=2) - edge], axis=2).reshape(-1, 10)
    return weights, len(forward_ends)


def _alike_columns(units: np.ndarray, group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first, inverse) of the distinct (group, column of units) pairs: an index of each, and each column's.
    Alike: equal in two 64-bit hashes, linear in the values' bits with their high half folded into the low
    (a false match: odds of about 2**-128 per pair, as in _distinct_moments; on one, the columns are sorted
    themselves); equal values with other bits (0.0 and -0.0) are merely priced apart."""
    bits = np.ascontiguousarray(units).view(np.uint64)  # (values, layouts)
    w = _HASH_WEIGHTS[:, 1, : len(bits) + 1]
    key = group.astype(np.uint64) * w[:, :1]
    for i, row in enumerate(bits):  # row by row: no (values, layouts) temporary
        mixed = row ^ (row >> np.uint64(32))  # values apart by a power of 2 differ in high bits only: fold them
        key += mixed * w[:, i + 1 : i + 2]
    order = np.argsort(key[0])
    h1, h2 = key[0, order], key[1, order]
    starts = np.append(True, h1[1:] != h1[:-1])
    if np.any(~starts & (h2 != np.roll(h2, 1))):  # the first hash matched where the second did not: odds 2**-64
        rows = np.column_stack([group.astype(np.uint64), bits.T])  # both uint64: no cast through float
        _, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
        return first, inverse.ravel()
    inverse = np.empty(len(order), dtype=np.int64)
    inverse[order] = np.cumsum(starts) - 1
    return order[starts], inverse


ZERO_BUBBLE_LAST_MARGIN = 1.15
"""Zero bubble's last pipeline rank keeps more than ``zero_bubble_residue`` accounts for: with one stage per
rank the weight passes of the last stage wait, and each waiting micro-batch holds the fused head's output-weight
gradient (V x dim) it computed in forward. Measured 0-14% above the model on the last rank
(tests/parallel/test_plan_vs_runtime.py), so its activations are taken 15% larger: a zero-bubble layout the planner
calls fitting must fit. The first rank's prediction is exact."""


def zero_bubble_residue(a: ModelArgs, e: int, tp, layers, has_head, fused: bool = True) -> np.ndarray:
    """Bytes per token one micro-batch of a stage keeps after its zero-bubble weight gradient, until the step
    ends (measured: tests/parallel/test_plan_vs_runtime.py). torch's input-gradient pass runs with retain_graph=True
    and the weight pass only visits the nodes next to the weights, so what those do not need stays saved: per
    layer the attention's q, k, v (h wide each after the GQA repeat), output and logsumexp; for the final
    stage also the fused head's input gradient (e h / tp), or the plain head's fp32 log-softmax, logits and
    the output matmul's input. Norms (plait.model.norm.RMSNormFunction: one node with the weight's gradient)
    are visited by the weight pass, which frees what they keep."""
    h = a.dim
    layer = (4 * e * h + 4 * a.n_heads) / tp
    head = e * h / tp if fused else (4 * a.vocab_size + e * a.vocab_size) / tp + e * h
    return layers * layer + np.where(has_head, head, 0)
