"""The planner's answer and its reasons: a Plan (the layouts searched, their predictions, those that fit
ranked fastest first) and the words `plait plan` prints about it: each layout's name, the winner's step time
and memory by part, its near misses and why they are slower, and faster layouts that do not fit."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from plait.planner.cluster import Cluster, GiB
from plait.planner.cost import Layouts, Workload

TIE = 0.005
"""Step times closer than this fraction are a tie (the model is not that precise): less memory wins."""
TIME_PARTS = ("t_compute", "t_tp", "t_cp", "t_ep", "t_p2p", "t_bubble", "t_fsdp", "t_optimizer", "t_replicas")
PART_NAMES = {
    "t_compute": "compute",
    "t_tp": "TP communication",
    "t_cp": "context-parallel ring not hidden by attention",
    "t_ep": "expert-parallel all-to-all",
    "t_p2p": "pipeline send/recv",
    "t_bubble": "pipeline bubble",
    "t_fsdp": "FSDP/HSDP communication not hidden by compute",
    "t_optimizer": "optimizer step",
    "t_replicas": "averaging across fault-tolerant replica groups",
}


@dataclass
class Plan:
    """What the search answers: every layout it priced (layouts, with their predictions in metrics, one
    element per layout), those that fit in order, and the reasons in words."""

    work: Workload
    cluster: Cluster
    layouts: Layouts
    metrics: dict[str, np.ndarray]
    order: np.ndarray
    """Indices of the layouts that fit, fastest first."""
    searched: int
    seconds: float
    explanation: list[str] = field(default_factory=list)

    @property
    def best(self) -> int:
        return int(self.order[0])

    def record(self, i: int) -> dict:
        """One layout with its predictions, plain Python values (for tables and JSON)."""
        rec = self.layouts.row(i)
        for key in (
            "micro_batches",
            "step_time",
            "tokens_per_s",
            "mfu",
            "fits",
            "tp_cross_node",
            *TIME_PARTS,
        ):
            rec[key] = self.metrics[key][i].item()
        for key in ("total", "states", "activations", "buffers", "transient", "allocator", "host"):
            rec[f"mem_{key}_gib"] = self.metrics[f"mem_{key}"][i].item() / GiB
        return rec

    def top(self, n: int) -> list[int]:
        """The fastest layout of each distinct (dp_replicate, dp_shard, tp, pp, schedule, virtual)."""
        return distinct_layouts(self.layouts, self.order, n)


def rank_fastest(metrics: dict[str, np.ndarray], fits: np.ndarray) -> np.ndarray:
    """The layouts that fit (indices), fastest first; step times within TIE of each other count as equal and go
    to the leaner layout."""
    step = metrics["step_time"][fits]
    bucket = np.floor(step / (step.min() * TIE))
    return fits[np.lexsort((metrics["mem_total"][fits], step, bucket))]


def layout_name(rec: dict) -> str:
    parts = [f"dp {rec['dp_replicate']}x{rec['dp_shard']}", f"tp {rec['tp']}", f"pp {rec['pp']}"]
    if rec.get("cp", 1) > 1:
        parts.insert(1, f"cp {rec['cp']}")
    if rec.get("ep", 1) > 1:
        parts.insert(-1, f"ep {rec['ep']}")
    if rec["pp"] > 1:
        parts.append(rec["schedule"] + (f" v={rec['virtual']}" if rec["virtual"] > 1 else ""))
    parts.append(f"mb {rec['micro_batch']}")
    parts.append(f"AC {rec['ac']}")
    if rec["offload"]:
        parts.append("offload")
    if not rec["reshard"]:
        parts.append("no-reshard")
    if rec.get("sync_each"):
        parts.append("reduce every micro-batch")
    return ", ".join(parts)


LAYOUT_KEYS = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "schedule", "virtual")
STRATEGY_KEYS = ("cp", "tp", "pp", "ep", "schedule", "ac", "offload")


def distinct_layouts(lay: Layouts, indices: np.ndarray, n: int, keys=LAYOUT_KEYS) -> list[int]:
    """The first of `indices` for each distinct value of `keys`, up to n of them."""
    columns = [getattr(lay, k) for k in keys]
    seen, out = set(), []
    for i in indices:
        key = tuple(c[i] for c in columns)
        if key not in seen:
            seen.add(key)
            out.append(int(i))
            if len(out) == n:
                break
    return out


def _breakdown(rec: dict) -> str:
    parts = [f"{PART_NAMES[k].split(' not')[0]} {rec[k]:.3g}" for k in TIME_PARTS if rec[k] > 0.0005 * rec["step_time"]]
    return " + ".join(parts)


def memory_line(rec: dict) -> str:
    """A layout's predicted memory per device, with its parts."""
    return (
        f"{rec['mem_total_gib']:.1f} GiB (states {rec['mem_states_gib']:.1f}, activations "
        f"{rec['mem_activations_gib']:.1f}, buffers {rec['mem_buffers_gib']:.1f}, transient "
        f"{rec['mem_transient_gib']:.1f}, allocator+reserve {rec['mem_allocator_gib']:.1f})"
    )


def _why_slower(rec: dict, best: dict) -> str:
    """The component that grew most against the winner, in words."""
    deltas = {k: rec[k] - best[k] for k in TIME_PARTS}
    key = max(deltas, key=lambda k: deltas[k])
    d = deltas[key]
    what = PART_NAMES[key]
    if key == "t_bubble":
        what += f" (pp={rec['pp']} with {rec['micro_batches']} micro-batches"
        what += f", v={rec['virtual']})" if rec["virtual"] > 1 else ")"
    elif key == "t_tp":
        what += " across nodes" if rec["tp_cross_node"] else f" (tp={rec['tp']})"
    elif key == "t_compute":
        if rec["ac"] != best["ac"]:
            what += f" (AC {rec['ac']} recomputes)"
        elif rec["tp"] != best["tp"] or rec["micro_batch"] != best["micro_batch"]:
            what += " (smaller matmuls per device)"
        elif rec["pp"] != best["pp"]:
            what += " (uneven pipeline stages)"
    elif key == "t_ep":
        what += f" (ep={rec['ep']})"
    elif key == "t_optimizer" and rec["offload"]:
        what += " on the CPU (offload)"
    return f"{what} +{d:.3g} s"


def explain(p: Plan, near: int = 4) -> list[str]:
    best = p.record(p.best)
    lines = [
        f"Best: {layout_name(best)}: {best['tokens_per_s']:,.0f} tokens/s, MFU {best['mfu']:.1%}, step "
        f"{best['step_time']:.3g} s = {_breakdown(best)}; memory {memory_line(best)} of "
        f"{p.cluster.memory_gib:g} GiB."
    ]
    close = p.metrics["step_time"][p.order] <= best["step_time"] * (1 + 2 * TIE)
    if close.sum() > 1:
        lines.append(
            f"{close.sum() - 1} other layout(s) within {2 * TIE:.0%} (other dp_replicate x dp_shard splits, "
            f"micro-batch sizes...): a tie within the model's precision, broken by lower memory."
        )
    for i in distinct_layouts(p.layouts, p.order, near + 1, STRATEGY_KEYS)[1:]:
        rec = p.record(i)
        slower = rec["step_time"] / best["step_time"] - 1
        lines.append(f"Near miss: {layout_name(rec)}: {slower:+.1%} step time: {_why_slower(rec, best)}.")
    # Faster layouts that do not fit: what stops them.
    faster = np.nonzero(~p.metrics["fits"] & (p.metrics["step_time"] < best["step_time"]))[0]
    faster = faster[np.argsort(p.metrics["step_time"][faster])]
    for i in distinct_layouts(p.layouts, faster, 3, STRATEGY_KEYS):
        rec = p.record(i)
        gain = 1 - rec["step_time"] / best["step_time"]
        if rec["mem_total_gib"] > p.cluster.memory_gib:
            why = f"needs {memory_line(rec)} > {p.cluster.memory_gib:g} GiB"
        else:
            why = f"needs {rec['mem_host_gib']:.0f} GiB of host memory per device for offload"
        lines.append(f"Out of memory: {layout_name(rec)} would be {gain:.1%} faster but {why}.")
    return lines
