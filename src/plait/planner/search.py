"""Enumerate parallel layouts, price them all at once with cost.evaluate, and rank them: the answer, a Plan with
its explanation, is plait.planner.report's; here also the messages for a request no layout can serve.

The search space is every factorisation world = dp_replicate x dp_shard x cp x tp x pp that plait can run
(plait.parallel.rules: the rules validate_layout applies to a run), for a mixture of experts every expert
parallel degree (a divisor of dp_shard x cp x tp and of the expert count), times the micro-batch size, the
pipeline schedule and its virtual stages, the activation-checkpointing mode, CPU offload and FSDP's
reshard-after-forward. Layout columns are built with numpy, so ~10^6 candidates cost about a second.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time

import numpy as np

from plait.core.errors import ConfigError
from plait.parallel.rules import (
    batch_problem,
    compile_problem,
    cp_problem,
    ep_problem,
    fsdp_enabled,
    lora_problem,
    optimizer_problem,
    pipeline_problem,
    pp_problem,
    schedule_problem,
    tp_problem,
    tp_whole,
)
from plait.planner.cluster import Cluster, GiB
from plait.planner.cost import (
    AC_MODES,
    HOST_MEMORY_FRACTION,
    MEMORY_FRACTION,
    SCHEDULES,
    Layouts,
    Workload,
    evaluate,
)
from plait.planner.report import Plan, explain, layout_name, memory_line, rank_fastest

CP_MIN_LOCAL_TOKENS = 1024
"""Context parallel degrees are searched where each rank keeps at least this many tokens of a sequence: below
that the ring's hops have too little attention work to hide behind (and short sequences fit without it)."""
VIRTUAL_STAGES = (2, 3, 4, 5, 6, 8, 10, 12, 16)
"""Virtual stages per pipeline rank tried for the interleaved and zero-bubble schedules."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(work: Workload, cluster: Cluster) -> Layouts:
    """Every layout plait can run for this model, batch and cluster (empty if none)."""
    a, batch = work.model, work.global_batch
    base = _degrees(work, cluster)
    if not base:
        return Layouts(*(np.zeros(0, dtype=np.int64) for _ in range(13)))
    rows_a = np.asarray(base, dtype=np.int64)
    base_a, sched_a = rows_a[:, :7], rows_a[:, 7:]
    # Cross with AC mode x offload x reshard x reduce-every-micro-batch; the last two matter only with FSDP and
    # no pipeline (and the last only with more than one micro-batch).
    offloads = (0,) if optimizer_problem(work.muon, True) else (0, 1)  # rules.optimizer_problem
    extra = np.asarray(list(itertools.product(range(len(AC_MODES)), offloads, (1, 0), (0, 1))), dtype=np.int64)
    rows = np.repeat(np.arange(len(base_a)), len(extra))
    ex = np.tile(extra, (len(base_a), 1))
    lay = Layouts(
        dp_replicate=base_a[rows, 0],
        dp_shard=base_a[rows, 1],
        tp=base_a[rows, 2],
        pp=base_a[rows, 3],
        virtual=sched_a[rows, 1],
        schedule=sched_a[rows, 0],
        micro_batch=base_a[rows, 4],
        ac=ex[:, 0],
        offload=ex[:, 1].astype(bool),
        reshard=ex[:, 2].astype(bool),
        sync_each=ex[:, 3].astype(bool),
        cp=base_a[rows, 5],
        ep=base_a[rows, 6],
    )
    # reshard_after_forward is a choice only for FSDP without a pipeline; a pipeline keeps gathered weights
    # for the whole step (reshard=False), and without FSDP there is nothing to reshard.
    whole_tp = tp_whole(lay.tp, bool(a.moe_experts), a.qk_norm)
    fsdp = fsdp_enabled(lay.dp_replicate * lay.dp_shard * lay.cp, lay.ep, whole_tp, lay.offload)
    keep = np.where(lay.pp > 1, ~lay.reshard, np.where(fsdp, True, lay.reshard))
    # Reducing every micro-batch is a choice where FSDP accumulates: over micro-batches, or a pipeline's
    # (not zero bubble's: its weight gradients are computed apart from their backward).
    piped = lay.schedule != SCHEDULES.index("zero_bubble")
    over_micro_batches = batch // (lay.dp_replicate * lay.dp_shard) > lay.micro_batch
    accumulates = fsdp & np.where(lay.pp > 1, piped, over_micro_batches)
    keep &= accumulates | ~lay.sync_each
    return lay.take(np.nonzero(keep)[0])


def _degrees(work: Workload, cluster: Cluster) -> list[tuple[int, ...]]:
    """The layouts' degrees and pipeline schedules plait can run, as rows (dp_replicate, dp_shard, tp, pp,
    micro_batch, cp, ep, schedule, v), each checked by the runtime's rules (plait.parallel.rules)."""
    a, world, batch = work.model, cluster.world_size, work.global_batch
    tps = [t for t in divisors(world) if tp_problem(a, work.seq_len, t) is None]
    base: list[tuple[int, ...]] = []

    @functools.cache  # the same pipeline recurs for every FSDP split of its data-parallel ranks
    def pipeline_runs(pp: int, code: int, v: int, local: int, mb: int) -> bool:
        return pipeline_problem(a, pp, SCHEDULES[code], v, local, mb, work.fused_head) is None

    schedules = functools.cache(_schedules)  # the same for every tensor and context split of a pipeline degree
    for tp, cp in itertools.product(tps, _cp_degrees(work, world)):
        if world % (tp * cp) or cp_problem(a, work.seq_len, cp, tp):
            continue
        for pp in divisors(world // (tp * cp)):
            if pp_problem(a, pp):
                continue
            dp = world // (tp * cp * pp)
            if batch_problem(batch, dp, 0):
                continue
            local = batch // dp
            options = ((0, 1),) if pp == 1 else schedules(pp, a.n_layers, work.fused_head)
            runs = {mb: [o for o in options if not o[0] or pipeline_runs(pp, *o, local, mb)] for mb in divisors(local)}
            if lora_problem(work.lora_rank, tp, pp):
                continue
            for shard, mb in itertools.product(divisors(dp), divisors(local)):
                for ep in _ep_degrees(a, shard, cp, tp):
                    base += [
                        (dp // shard, shard, tp, pp, mb, cp, ep, code, v)
                        for code, v in runs[mb]
                        if not compile_problem(work.compiled, bool(a.moe_experts), tp, cp, pp, ep, SCHEDULES[code])
                    ]
    return base


def _ep_degrees(a, shard: int, cp: int, tp: int) -> list[int]:
    """Expert parallel degrees plait can run for this model in this layout (1 for a dense model)."""
    if not a.moe_experts:
        return [1]
    return [ep for ep in divisors(a.moe_experts) if ep_problem(a, ep, shard, cp, tp) is None]  # moe_tp = tp


def _cp_degrees(work: Workload, world: int) -> list[int]:
    """Context parallel degrees worth searching: 1, and those leaving each rank CP_MIN_LOCAL_TOKENS or more."""
    return [c for c in divisors(world) if c == 1 or work.seq_len // c >= CP_MIN_LOCAL_TOKENS]


def _schedules(pp: int, n_layers: int, fused_head: bool = True) -> tuple[tuple[int, int], ...]:
    """(schedule code, virtual stages) worth searching; none that this torch refuses (schedule_problem)."""
    out = [(1, 1), (2, 1)]
    for v in VIRTUAL_STAGES:
        if pp * v <= n_layers:
            out += [(code, v) for code in (3, 4) if schedule_problem(SCHEDULES[code], fused_head) is None]
    return tuple(out)


def plan(work: Workload, cluster: Cluster, *, hints: bool = True, pins: dict[str, int] | None = None) -> Plan:
    """Search, rank and explain. Raises ConfigError, with the smallest change that would help, when no
    layout is possible or none fits in memory. `pins` fixes layout columns (e.g. {"tp": 8, "pp": 4}: what a
    config's [parallel] section sets); the search covers the rest."""
    _check_request(work, cluster)
    start = time.perf_counter()
    lay = enumerate_layouts(work, cluster)
    if len(lay) == 0:
        raise ConfigError(_no_layout_message(work, cluster))
    if pins:
        keep = np.ones(len(lay), dtype=bool)
        for key, value in pins.items():
            keep &= getattr(lay, key) == value
        if not keep.any():
            pinned = ", ".join(f"{k}={v}" for k, v in pins.items())
            raise ConfigError(
                f"no layout plait can run has {pinned} (the config's [parallel] section) for this model, batch "
                f"and {cluster.world_size} devices; change or remove those settings to let the planner choose"
            )
        lay = lay.take(np.nonzero(keep)[0])
    metrics = evaluate(work, cluster, lay)
    fits = np.nonzero(metrics["fits"])[0]
    seconds = time.perf_counter() - start
    if len(fits) == 0:
        raise ConfigError(_no_fit_message(work, cluster, lay, metrics, hints))
    result = Plan(work, cluster, lay, metrics, rank_fastest(metrics, fits), len(lay), seconds)
    result.explanation = explain(result)
    return result


def _check_request(work: Workload, cluster: Cluster) -> None:
    a = work.model
    if work.seq_len > a.max_seq_len:
        raise ConfigError(
            f"--seq-len={work.seq_len} is longer than the model supports "
            f"(model.max_seq_len={a.max_seq_len}); "
            f"use --seq-len={a.max_seq_len} or raise model.max_seq_len"
        )
    if work.global_batch < 1:
        raise ConfigError("--global-batch-tokens must hold at least one sequence of --seq-len tokens")


# ---------------------------------------------------------------------------------------------- infeasible


def _no_layout_message(work: Workload, cluster: Cluster) -> str:
    """No factorisation divides the batch: name the nearest batch sizes that work."""
    a, world = work.model, cluster.world_size
    dps = set()
    for tp, cp in itertools.product(divisors(world), _cp_degrees(work, world)):
        if world % (tp * cp) or tp_problem(a, work.seq_len, tp) or cp_problem(a, work.seq_len, cp, tp):
            continue
        for pp in divisors(world // (tp * cp)):
            if not pp_problem(a, pp):
                dps.add(world // (tp * cp * pp))
    if not dps:
        return f"no tensor-parallel degree divides both the model's heads and the sequence length {work.seq_len}"
    smallest = min(dps)
    lower = work.global_batch // smallest * smallest
    upper = lower + smallest
    options = [b for b in (lower, upper) if b > 0]
    tokens = " or ".join(f"{b * work.seq_len:,} ({b} sequences)" for b in options)
    return (
        f"the global batch of {work.global_batch} sequences cannot be split evenly over {world} devices: "
        f"every "
        f"layout needs it divisible by its data-parallel degree, at least {smallest} here (world {world} / "
        f"the largest tp x cp x pp the model and sequence allow). Smallest change: --global-batch-tokens={tokens}"
    )


def _no_fit_message(work, cluster, lay, metrics, hints: bool) -> str:
    def record(i):
        rec = {**lay.row(i), "micro_batches": metrics["micro_batches"][i].item()}
        for key in ("total", "states", "activations", "buffers", "transient", "allocator", "host"):
            rec[f"mem_{key}_gib"] = metrics[f"mem_{key}"][i].item() / GiB
        return rec

    on_device = np.where(lay.offload, np.inf, metrics["mem_total"])
    rec = record(int(np.argmin(on_device)))
    lines = [
        f"no layout fits in {MEMORY_FRACTION:.0%} of {cluster.memory_gib:g} GiB per device (the rest is the "
        f"prediction's margin). The leanest, {layout_name(rec)}, needs "
        f"{memory_line(rec)}."
    ]
    offloaded = np.nonzero(lay.offload & (metrics["mem_total"] <= MEMORY_FRACTION * cluster.memory_gib * GiB))[0]
    if len(offloaded):
        host = record(int(offloaded[np.argmin(metrics["mem_host"][offloaded])]))
        per_node = host["mem_host_gib"] * cluster.devices_per_node
        lines.append(
            f"With CPU offload ({layout_name(host)}) the device needs {host['mem_total_gib']:.1f} GiB but "
            f"the host {per_node:,.0f} GiB per node, over {HOST_MEMORY_FRACTION:.0%} of its "
            f"{cluster.host_memory_gib:g} GiB."
        )
    if work.model.moe_experts and rec["mem_buffers_gib"] > rec["mem_states_gib"]:
        lines.append(
            f"Most of it is FSDP's gathered buffers: a mixture-of-experts block gathers its experts, "
            f"{work.model.moe_experts // rec['ep']} per rank at the leanest layout's ep={rec['ep']}; a larger "
            "ep (up to dp_shard x cp x tp) gathers fewer."
        )
    if not hints:
        return " ".join(lines)
    changes = [f"devices with at least {rec['mem_total_gib']:.0f} GiB"]
    for factor in (2, 4, 8, 16, 32, 64):
        bigger = Cluster(**{**vars(cluster), "nodes": cluster.nodes * factor})
        try:
            found = plan(work, bigger, hints=False)
        except ConfigError:
            continue
        r = found.record(found.best)
        changes.insert(0, f"--nodes={bigger.nodes} ({layout_name(r)}, {r['mem_total_gib']:.0f} GiB)")
        break
    if rec["mem_activations_gib"] > rec["mem_states_gib"] and work.seq_len > 256:
        changes.append(f"a shorter sequence (activations grow with --seq-len={work.seq_len})")
    lines.append("Smallest changes that would make it fit: " + "; or ".join(changes) + ".")
    return " ".join(lines)


def layout_config(result, base=None):
    """The chosen layout as a validated plait Config (the base config's other settings kept)."""
    from plait.config import Config, ParallelConfig, validate

    cfg = dataclasses.replace(base) if base is not None else Config()
    best = result.record(result.best)
    cfg.model = result.work.model
    cfg.data = dataclasses.replace(cfg.data, seq_len=result.work.seq_len)
    cfg.train = dataclasses.replace(
        cfg.train,
        global_batch_size=result.work.global_batch,
        micro_batch_size=best["micro_batch"],
        mixed_precision=result.work.compute_dtype,
    )
    values = dict(
        dp_replicate_degree=best["dp_replicate"],
        dp_shard_degree=best["dp_shard"],
        tp_degree=best["tp"],
        cp_degree=best["cp"],
        ep_degree=best["ep"],
        pp_degree=best["pp"],
        pp_schedule=best["schedule"] if best["pp"] > 1 else None,
        pp_virtual_stages=best["virtual"],
        activation_checkpoint=best["ac"],
        cpu_offload=best["offload"],
        fsdp_reshard_after_forward=best["reshard"],
        fsdp_reduce_every_micro_batch=best["sync_each"],
    )
    known = {f.name for f in dataclasses.fields(ParallelConfig)}
    cfg.parallel = dataclasses.replace(
        cfg.parallel, **{k: v for k, v in values.items() if k in known and v is not None}
    )
    return validate(cfg)
