"""Communication volume per training step: bytes each rank sends, measured, against the analytic volume.

Every layout trains plait's real step (`build_trainable` + `train_step`) on multi-process gloo groups, one launch
per world size (2, 4, 8 processes). After one uncounted warm-up step (FSDP lazy init, pipeline shape inference,
optimizer state), `--steps` steps run under a counter, and each rank reports bytes sent per step.

How traffic is counted. A `TorchDispatchMode` sees every collective at the dispatcher, below all Python APIs:
FSDP2 calls `dist.all_gather_single` / `reduce_scatter_single` / `all_reduce` (-> `c10d._allgather_base_`,
`c10d._reduce_scatter_base_`, `c10d.allreduce_`), DTensor redistribution and loss-parallel call functional
collectives (`_c10d_functional.*`), pipelining calls `batch_isend_irecv` (-> `c10d.send` / `c10d.recv_`).
(`CommDebugMode` would miss the P2P ops.) A call is converted to bytes sent by one rank with the ring formulas,
N the group size:  all-gather out_bytes (N-1)/N,  reduce-scatter in_bytes (N-1)/N,  all-reduce 2 bytes (N-1)/N,
send bytes.  The group of each call is named by the mesh axis it belongs to (pp, dp_replicate, dp_shard, cp, tp; FSDP's
dp_shard_cp under context parallelism). Context parallelism's ring attention sends from inside a torch op
(plait.parallel.context): the counter runs that op's body under itself to see its sends, and the analytic
count is the planner's own (plait.planner.cost.ring_bytes), so this bench checks the planner's ring model.
Scalar collectives (gradient-norm partial sums, the logged loss) are listed apart and not in the ratio.

Independently, `/proc/self/io` `wchar` (bytes the process wrote, sockets included: gloo writes with writev) gives
what actually went on the wire. On gloo a reduce-scatter is done as an all-reduce, so its wire bytes are twice
the ring formula; the wire column shows that.

    python bench/comm.py [--steps 2] [--seq-len 32] [--batch 8] [--worlds 2 4 8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import tempfile
import traceback
import warnings
from collections import defaultdict
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

LAYOUTS: dict[int, dict[str, list[str]]] = {
    2: {
        "TP 2": ["parallel.tp_degree=2"],
        "PP 2 (1f1b)": ["parallel.pp_degree=2", "parallel.pp_schedule=1f1b"],
        "CP 2": ["parallel.cp_degree=2"],
        "CP 2, full AC": ["parallel.cp_degree=2", "parallel.activation_checkpoint=full"],
    },
    4: {
        "DP 4": ["parallel.dp_replicate_degree=4", "parallel.dp_shard_degree=1"],
        "FSDP 4": ["parallel.dp_shard_degree=4"],
        # gradient accumulation: one reduce-scatter after the last micro-batch, or one after each
        "FSDP 4, m=2": ["parallel.dp_shard_degree=4", "train.micro_batch_size=1"],
        "FSDP 4, m=2, reduce every micro-batch": [
            "parallel.dp_shard_degree=4",
            "train.micro_batch_size=1",
            "parallel.fsdp_reduce_every_micro_batch=true",
        ],
        "HSDP 2x2": ["parallel.dp_replicate_degree=2", "parallel.dp_shard_degree=2"],
        "FSDP 2 + TP 2": ["parallel.dp_shard_degree=2", "parallel.tp_degree=2"],
        "PP 2 + FSDP 2": ["parallel.pp_degree=2", "parallel.dp_shard_degree=2"],
        # under a pipeline plait keeps FSDP2's blocks gathered: the volume does not grow with m
        "PP 2 + FSDP 2, m=4": ["parallel.pp_degree=2", "parallel.dp_shard_degree=2", "train.micro_batch_size=1"],
        "PP 2 + FSDP 2, m=4, no reshard": [
            "parallel.pp_degree=2",
            "parallel.dp_shard_degree=2",
            "train.micro_batch_size=1",
            "parallel.fsdp_reshard_after_forward=false",
        ],  # fmt: skip
        "CP 4": ["parallel.cp_degree=4"],
        "FSDP 2 x CP 2": ["parallel.dp_shard_degree=2", "parallel.cp_degree=2"],
        "TP 2 x CP 2": ["parallel.tp_degree=2", "parallel.cp_degree=2"],
    },
    8: {
        "PP 2 x FSDP 2 x TP 2": ["parallel.pp_degree=2", "parallel.dp_shard_degree=2", "parallel.tp_degree=2"],
    },
}
MOE = ["model.preset=moe-debug"]  # 8 experts, top 2, a shared expert, a dense first block
MOE_LAYOUTS: dict[int, dict[str, list[str]]] = {
    2: {
        "MoE, EP 2": [*MOE, "parallel.ep_degree=2"],
        "MoE, EP 2, selective AC": [*MOE, "parallel.ep_degree=2", "parallel.activation_checkpoint=selective"],
        "MoE, EP 2, full AC": [*MOE, "parallel.ep_degree=2", "parallel.activation_checkpoint=full"],
        "MoE, TP 2 x EP 2": [*MOE, "parallel.tp_degree=2", "parallel.ep_degree=2"],
    },
    4: {
        "MoE, FSDP 4 x EP 2": [*MOE, "parallel.ep_degree=2"],
        "MoE, FSDP 4 x EP 4, m=2": [*MOE, "parallel.ep_degree=4", "train.micro_batch_size=1"],
    },
}
for _world, _layouts in MOE_LAYOUTS.items():
    LAYOUTS.setdefault(_world, {}).update(_layouts)

BYTES = 4  # fp32 parameters, gradients and activations (mixed_precision=fp32)
RING = "all-gather: out (N-1)/N; reduce-scatter: in (N-1)/N; all-reduce: 2 x bytes (N-1)/N; send: bytes"


# ----------------------------------------------------------------------------------------- the counter

_C10D = {  # op name -> (kind, how to read its tensors)
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "barrier": "barrier",
}
_FUNCTIONAL = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_out": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
    "isend": "send",
    "irecv": "recv",
}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, list | tuple):
        return sum(_nbytes(t) for t in x)
    return 0


def ring_bytes(kind: str, in_bytes: int, out_bytes: int, n: int) -> float:
    """Bytes one rank sends for one call under the ring algorithm (the table's model)."""
    if kind == "send":
        return float(in_bytes)
    if n <= 1 or kind in ("recv", "barrier"):
        return 0.0
    f = (n - 1) / n
    return {
        "all_gather": out_bytes * f,
        "reduce_scatter": in_bytes * f,
        "all_reduce": 2 * in_bytes * f,
        "all_to_all": in_bytes * f,
        "broadcast": float(in_bytes),  # an upper bound: only the root's ring neighbour chain sends
    }[kind]


class CommCounter(TorchDispatchMode):
    """Counts collectives and P2P ops by (kind, mesh axis, forward/backward/after, bulk/scalar)."""

    def __init__(self, axis_of_group: dict[str, str]):
        super().__init__()
        self.axis_of_group = axis_of_group
        self.phase = "step"
        self.records: dict[tuple[str, str, str, str], list[float]] = defaultdict(lambda: [0, 0.0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is not torch.Tensor and issubclass(t, torch.Tensor) for t in types):
            return NotImplemented  # let DTensor desugar into plain-tensor collectives, then count those
        if isinstance(func, torch._ops.OpOverload) and func.namespace == "plait":
            from plait.parallel import context, experts

            body = {
                "ring_attention": context.ring_forward,
                "ring_attention_backward": context.ring_backward,
                "expert_all_to_all": experts.all_to_all_forward,
            }
            with self:  # the ring attention's op sends from inside: run its body under the counter
                return body[func._schema.name.split("::")[-1]](*args, **kwargs)
        out = func(*args, **kwargs)
        if isinstance(func, torch._ops.OpOverload):
            ns, name = func.namespace, func._schema.name.split("::")[-1]
            kind = _C10D.get(name) if ns == "c10d" else _FUNCTIONAL.get(name) if ns == "_c10d_functional" else None
            if kind is not None:
                self._record(func, kind, args, kwargs)
        return out

    def _phase(self) -> str:
        if self.phase == "fwd/bwd":
            return "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        return self.phase

    def _record(self, func, kind, args, kwargs) -> None:
        import torch.distributed as dist

        bound = dict(zip([a.name for a in func._schema.arguments], args, strict=False)) | kwargs
        group = bound["process_group"] if "process_group" in bound else bound["group_name"]
        if isinstance(group, str):
            group = torch._C._distributed_c10d._resolve_process_group(group)
        elif not isinstance(group, dist.ProcessGroup):  # the dispatcher hands c10d ops a boxed ScriptObject
            group = dist.ProcessGroup.unbox(group)
        n = dist.get_world_size(group)
        ranks = ",".join(map(str, dist.get_process_group_ranks(group)))
        # by name, else by members (torch may build a second group of the same ranks for a mesh axis)
        axis = self.axis_of_group.get(group.group_name) or self.axis_of_group.get(f"ranks {ranks}", f"?{ranks}")
        if kind == "all_to_all" and bound.get("input_split_sizes"):  # uneven: exactly what leaves this rank
            x, splits = bound["input"], list(bound["input_split_sizes"])
            row = x[0].numel() * x.element_size() if len(x) else 0
            sent = (sum(splits) - splits[dist.get_rank(group)]) * row
            rec = self.records[(kind, axis, self._phase(), "scalar" if sent <= 8 else "bulk")]
            rec[0] += 1
            rec[1] += sent
            return
        if "output_tensor" in bound:  # c10d single-tensor collectives
            in_b, out_b = _nbytes(bound["input_tensor"]), _nbytes(bound["output_tensor"])
        elif "output_tensors" in bound or "outputs" in bound or "output_lists" in bound:
            outs = bound.get("output_tensors", bound.get("outputs", bound.get("output_lists")))
            ins = bound.get("input_tensors", bound.get("inputs", bound.get("input_list")))
            in_b, out_b = _nbytes(ins), _nbytes(outs)
        else:  # c10d allreduce_/send/recv_ (tensors) and functional ops (input / inputs / tensor)
            t = bound.get("tensors", bound.get("input", bound.get("inputs", bound.get("tensor"))))
            in_b = _nbytes(t)
            out_b = in_b * n if kind == "all_gather" else in_b // n if kind == "reduce_scatter" else in_b
        scalar = max(in_b, out_b) <= 8
        rec = self.records[(kind, axis, self._phase(), "scalar" if scalar else "bulk")]
        rec[0] += 1
        rec[1] += ring_bytes(kind, in_b, out_b, n)


def wire_bytes() -> int:
    """Bytes this process has written (files, pipes and sockets): gloo's TCP sends land here."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


# ----------------------------------------------------------------------------------------- the model


def _tp_local_shapes(args, layer_ids: list[int], first: bool, last: bool, tp: int) -> dict[str, list[tuple]]:
    """Parameter shapes per FSDP group after tensor parallelism (plait's plan: colwise shards dim 0, rowwise dim 1,
    the embedding and output the vocabulary, norms replicated)."""
    d, hd, h, kv, hid, v = args.dim, args.head_dim, args.n_heads, args.n_kv_heads, args.hidden_dim, args.vocab_size
    groups: dict[str, list[tuple]] = {}
    for i in layer_ids:
        groups[f"layers.{i}"] = [
            (d,), (h * hd // tp, d), (kv * hd // tp, d), (kv * hd // tp, d), (d, h * hd // tp),
            (d,), (hid // tp, d), (d, hid // tp), (hid // tp, d),
        ]  # fmt: skip
    root = ([(v // tp, d)] if first else []) + ([(d,), (v // tp, d)] if last else [])
    if root:
        groups["root"] = root
    return groups


def _fsdp_groups(args, dims, layer_ids: list[int], first: bool, last: bool) -> dict[str, tuple[list[tuple], int, str]]:
    """FSDP groups of one stage: name -> (parameter shapes, shard group size, mesh axis). A mixture-of-experts
    block (plait.parallel.fsdp._shard_moe): attention and norms with the block; its router, shared
    expert and (without expert parallelism) experts with it too, or in a group of their own over the token
    ranks (dp_shard x cp x tp: "tokens") under TP; expert-parallel experts (E / ep each) over ep_shard."""
    ns = dims.dp_shard * dims.cp
    shard_axis = "dp_shard" if dims.cp == 1 else "cp" if dims.dp_shard == 1 else "dp_shard_cp"
    dense = _tp_local_shapes(args, layer_ids, first, last, dims.tp)
    groups = {name: (shapes, ns, shard_axis) for name, shapes in dense.items()}
    d, e, f = args.dim, args.moe_experts, args.expert_hidden_dim
    fs = f * args.moe_shared_experts
    moe_tp = dims.tp if args.moe_experts else 1
    for i in layer_ids:
        if not args.is_moe_layer(i):
            continue
        block = groups[f"layers.{i}"][0][:6]  # attention_norm, wq, wk, wv, wo, ffn_norm
        rest = [(e, d)] + ([(fs, d), (d, fs), (fs, d)] if fs else [])
        experts = [(e // dims.ep, f, d), (e // dims.ep, d, f), (e // dims.ep, f, d)]
        local = rest + (experts if dims.ep == 1 else [])
        if moe_tp > 1:
            groups[f"layers.{i}"] = (block, ns, shard_axis)
            groups[f"layers.{i}.moe"] = (local, ns * moe_tp, "tokens")
        else:
            groups[f"layers.{i}"] = (block + local, ns, shard_axis)
        if dims.ep > 1:
            groups[f"layers.{i}.experts"] = (experts, ns * moe_tp // dims.ep, "ep_shard")
    return groups


def _padded(shapes: list[tuple], n: int) -> int:
    """Elements of a group's all-gather output: FSDP2 pads each parameter's dim 0 to a multiple of the shard size."""
    return sum(math.ceil(s[0] / n) * n * math.prod(s[1:]) for s in shapes)


def schedule_order(schedule: str, stage: int, num_stages: int, m: int) -> list[tuple[str, int]]:
    """The (F|B, micro-batch) order torch.distributed.pipelining runs on one stage (1F1B: min(m, p - s) warm-up
    forwards, then alternate B and F, then the remaining B)."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"no analytic order for {schedule}")
    warm = min(m, num_stages - stage)
    order, f, b = [("F", i) for i in range(warm)], warm, 0
    while b < m:
        order.append(("B", b))
        b += 1
        if f < m:
            order.append(("F", f))
            f += 1
    return order


def analytic(
    cfg, dims, pp_rank: int, routing: dict | None = None, aliases: dict[str, str] | None = None
) -> dict[tuple[str, str], float]:
    """Bytes this rank sends per step, by (kind, axis), from the model shape and the layout alone; for expert
    parallelism also from `routing`, this rank's routed copies per step (see `routed_bytes`): what an
    all-to-all moves depends on where the router sends each token. `aliases`: the name the counter gives a
    mixture-of-experts group ("ep", "ep_shard", "tokens") where it has the ranks of a mesh axis (torch
    builds one group per set of ranks, so it goes by the axis's name)."""
    from plait.parallel.pipeline import split_layers
    from plait.planner.cost import ring_bytes as cp_ring_bytes

    a, p, t = cfg.model, cfg.parallel, cfg.train
    vol: dict[tuple[str, str], float] = defaultdict(float)

    aliases = aliases or {}

    def add(kind: str, axis: str, nbytes: float, n: int, times: int = 1) -> None:
        if times and (n > 1 or kind == "send"):
            vol[(kind, aliases.get(axis, axis))] += times * ring_bytes(kind, nbytes, nbytes, n)

    num_stages = dims.pp * p.pp_virtual_stages
    layout = split_layers(a, num_stages, p.pp_split, cfg.data.seq_len)  # as the pipeline splits it
    local = t.global_batch_size // dims.dp
    if dims.pp > 1:
        m = local // t.micro_batch_size if t.micro_batch_size else num_stages
    else:
        m = local // t.micro_batch_size if t.micro_batch_size else 1
    tokens = local // m * cfg.data.seq_len // dims.cp  # this rank's tokens of one micro-batch
    act = tokens * a.dim * BYTES  # one micro-batch's (b, T, dim) activations
    for s in range(pp_rank, num_stages, dims.pp):
        first, last = s == 0, s == num_stages - 1
        ids = layout[s]
        # tensor + sequence parallel: per micro-batch and pass, 2 all-gathers and 2 reduce-scatters of (b, T, dim)
        # per block; the embedding reduce-scatters its vocabulary-partial output (its backward all-gathers);
        # the output projection all-gathers its input (backward: reduce-scatter); loss-parallel cross-entropy
        # all-reduces the max, the sum of exponentials and the target logit of each token (b * T floats each).
        # Between pipeline stages each TP rank hands on its sequence shard: no TP traffic at stage boundaries.
        # Sequence-parallel norm weights get partial gradients: one all-reduce of dim floats each.
        # A mixture-of-experts block runs on its sequence shard: only its attention's two of each.
        moe_ids = [i for i in ids if a.moe_experts and a.is_moe_layer(i)]
        if dims.tp > 1:
            n = dims.tp
            add("all_gather", "tp", act, n, m * (len(ids) * 4 - len(moe_ids) * 2))
            add("reduce_scatter", "tp", act, n, m * (len(ids) * 4 - len(moe_ids) * 2))
            if first:
                add("reduce_scatter", "tp", act, n, m)  # embedding fwd
                add("all_gather", "tp", act, n, m)  # embedding bwd
            if last:
                add("all_gather", "tp", act, n, m)  # output-projection input fwd
                add("reduce_scatter", "tp", act, n, m)  # output-projection input bwd
                add("all_reduce", "tp", tokens * BYTES, n, 3 * m)
            add("all_reduce", "tp", a.dim * BYTES, n, 2 * len(ids) + (1 if last else 0))
        # pipeline: one (b, T/tp, dim) message per micro-batch forward to the next stage and backward to the
        # previous (each TP rank sends its own sequence shard)
        if dims.pp > 1:
            add("send", "pp", act / dims.tp, 2, m * ((not last) + (not first)))
        # context parallel: the planner's count of the ring attention's hops (plait.planner.cost.ring_bytes),
        # per block and micro-batch
        if dims.cp > 1:
            fwd, bwd = cp_ring_bytes(a, BYTES, tokens, dims.tp, dims.cp, p.activation_checkpoint == "full")
            add("send", "cp", float(fwd + bwd), dims.cp, m * len(ids))
        # expert parallelism, per MoE block: each forward exchanges the routing counts (E int64s), then the
        # routed copies go to their experts and back (dispatch and combine: `routing`'s bytes), and again in
        # backward (their gradients); full AC recomputes the forward's exchanges, selective AC keeps the
        # all-to-alls' outputs (only the counts go again). Under TP or CP the balancing loss sums each
        # sequence's routing counts (micro-batch x E floats) over the ranks that hold parts of it.
        recompute = p.activation_checkpoint != "none"
        if dims.ep > 1 and moe_ids:
            add("all_to_all", "ep", a.moe_experts * 8, dims.ep, m * len(moe_ids) * (1 + recompute))
            passes = 2 + (p.activation_checkpoint == "full")
            vol[("all_to_all", aliases.get("ep", "ep"))] += passes * (routing["sent"] + routing["received"])
        split = dims.cp * (dims.tp if a.moe_experts else 1)
        if split > 1 and moe_ids and a.moe_aux_loss:
            axis = "tp" if dims.cp == 1 else "cp" if dims.tp == 1 else "cp_tp"
            add("all_reduce", axis, local // m * a.moe_experts * 4, split, m * len(moe_ids) * (1 + recompute))
        # FSDP2: a state machine per parameter group (each block, and the stage's root: embedding / norm / output)
        if dims.fsdp_enabled:
            r = dims.dp_replicate
            groups = _fsdp_groups(a, dims, ids, first, last)
            last_block = f"layers.{ids[-1]}"
            # as apply_fsdp: the root and the last block stay gathered after forward, and no block reshards
            # under a pipeline (it would be gathered again for every micro-batch)
            reshard = {
                g: p.fsdp_reshard_after_forward
                and dims.pp == 1
                and g != "root"
                and g.split(".")[:2] != last_block.split(".")
                for g in groups
            }
            if dims.pp > 1:
                order = schedule_order(p.pp_schedule, s, num_stages, m)
            else:  # gradient accumulation: forward and backward of each micro-batch in turn
                order = [op for i in range(m) for op in (("F", i), ("B", i))]
            reduces = m if dims.pp == 1 and p.fsdp_reduce_every_micro_batch else 1
            for g, (shapes, ns, shard_axis) in groups.items():
                full = _padded(shapes, ns) * BYTES
                gathered, gathers = False, 0
                for op, _ in order:
                    if not gathered:
                        gathers += 1
                        gathered = True
                    if op == "F" and reshard[g]:
                        gathered = False
                    if op == "B" and dims.pp == 1:  # reshard after backward (pipelining defers it to the end)
                        gathered = False
                add("all_gather", shard_axis, full, ns, gathers)
                add("reduce_scatter", shard_axis, full, ns, reduces)
                add("all_reduce", "dp_replicate", full / ns, r, reduces)
    return dict(vol)


# ----------------------------------------------------------------------------------------- the workers


def _axis_names(meshes) -> dict[str, str]:
    import torch.distributed as dist

    names = {dist.group.WORLD.group_name: "world"}
    names[meshes.batch.get_group().group_name] = "batch"
    for axis in ("pp", "dp_replicate", "dp_shard", "cp", "tp"):
        names[meshes.world.get_group(axis).group_name] = axis
    if meshes.dims.cp > 1:
        names.setdefault(meshes.loss.get_group().group_name, "loss")
        if meshes.fsdp.ndim == 1:
            names.setdefault(meshes.fsdp.get_group().group_name, "dp_shard_cp")
    if meshes.dims.ep > 1:
        names.setdefault(meshes.ep.get_group().group_name, "ep")
        names.setdefault(meshes.experts_fsdp.get_group().group_name, "ep_shard")
    if meshes.dims.moe_tp > 1:
        names.setdefault(meshes.tokens.get_group().group_name, "tokens")
    for name, axis in list(names.items()):
        group = torch._C._distributed_c10d._resolve_process_group(name)
        names.setdefault("ranks " + ",".join(map(str, dist.get_process_group_ranks(group))), axis)
    return names


def routed_bytes(t, meshes, row_bytes: int, steps: int) -> dict[str, float]:
    """Per step, over this rank's MoE blocks: bytes of the routed copies it sends to experts on other ranks
    (its picks of experts it does not hold) and of those other ranks send to its experts (their picks of its
    experts), from each block's routing counts (MoE.load), gathered over the ep group."""
    import torch.distributed as dist

    from plait.engine.expert_balance import moe_layers

    layers = moe_layers(t.parts)
    mine = torch.stack([m.load for m in layers])  # (blocks, experts): this rank's picks
    everyone = [torch.empty_like(mine) for _ in range(meshes.dims.ep)]
    dist.all_gather(everyone, mine, group=meshes.ep.get_group())
    rank, local = meshes.ep.get_local_rank(), mine.shape[1] // meshes.dims.ep
    own = slice(rank * local, (rank + 1) * local)
    sent = mine.sum() - mine[:, own].sum()
    received = sum(other[:, own].sum() for s, other in enumerate(everyone) if s != rank)
    return {"sent": float(sent) * row_bytes / steps, "received": float(received) * row_bytes / steps}


def planner_a2a(cfg, dims, t) -> float:
    """Bytes per step the planner's model (plait.planner.cost.a2a_bytes: balanced routing) has this rank send in
    expert parallelism's all-to-alls: per MoE block and micro-batch, dispatch and combine in forward and in
    backward (and the forward again under full AC), each with its count exchange (recomputed under any AC)."""
    from plait.engine.expert_balance import moe_layers
    from plait.planner.cost import a2a_bytes

    p, local = cfg.parallel, cfg.train.global_batch_size // dims.dp
    m = local // cfg.train.micro_batch_size if cfg.train.micro_batch_size else max(1, dims.pp * p.pp_virtual_stages)
    tokens = local // m * cfg.data.seq_len // dims.cp // dims.moe_tp
    counts = float(a2a_bytes(cfg.model, BYTES, 0, dims.ep))
    routed = float(a2a_bytes(cfg.model, BYTES, tokens, dims.ep)) - counts
    passes, forwards = 2 + (p.activation_checkpoint == "full"), 1 + (p.activation_checkpoint != "none")
    return len(moe_layers(t.parts)) * m * (2 * passes * routed + forwards * counts)


def _run_layout(name: str, overrides: list[str], world: int, steps: int) -> dict:
    import torch.distributed as dist

    import plait.engine.trainer as train_mod
    from plait.config import load_config
    from plait.engine.trainer import build_trainable, train_step
    from plait.parallel import Meshes, ParallelDims, validate_layout

    cfg = load_config(None, overrides)
    dims = ParallelDims.from_config(cfg.parallel, world, cfg.model)
    validate_layout(cfg, dims)
    meshes = Meshes(dims.build_mesh("cpu"), dims)
    torch.manual_seed(cfg.run.seed)
    t = build_trainable(cfg, torch.device("cpu"), meshes)
    local = cfg.train.global_batch_size // dims.dp
    gen = torch.Generator().manual_seed(1000 + meshes.dp_rank)
    batches = [
        torch.randint(0, cfg.model.vocab_size, (local, cfg.data.seq_len + 1), generator=gen) for _ in range(steps + 1)
    ]
    train_step(t, batches[0][:, :-1], batches[0][:, 1:])  # warm-up: lazy init, shape inference, optimizer state
    from plait.engine.expert_balance import moe_layers

    for layer in moe_layers(t.parts):  # the counted steps' routing, from here
        layer.load.zero_()
    counter = CommCounter(_axis_names(meshes))
    clip = train_mod.clip_grad_norm

    def counted_clip(*a, **k):
        counter.phase = "grad-norm"
        try:
            return clip(*a, **k)
        finally:
            counter.phase = "after"

    dist.barrier()
    train_mod.clip_grad_norm = counted_clip
    try:
        w0 = wire_bytes()
        with counter:
            for b in batches[1:]:
                counter.phase = "fwd/bwd"
                train_step(t, b[:, :-1], b[:, 1:])
        wire = (wire_bytes() - w0) / steps
    finally:
        train_mod.clip_grad_norm = clip
    pp_rank = meshes.pp.get_local_rank()
    routing = routed_bytes(t, meshes, cfg.model.dim * BYTES, steps) if dims.ep > 1 else None
    rows = [
        {"kind": k, "axis": ax, "phase": ph, "class": c, "calls": v[0] / steps, "bytes": v[1] / steps}
        for (k, ax, ph, c), v in sorted(counter.records.items())
    ]
    names = _axis_names(meshes)
    aliases = {}
    for alias, mesh in (("ep", "ep"), ("ep_shard", "experts_fsdp"), ("tokens", "tokens")):
        if (dims.ep > 1 or alias == "tokens") and (dims.moe_tp > 1 or alias != "tokens"):
            group = getattr(meshes, mesh).get_group()
            ranks = "ranks " + ",".join(map(str, dist.get_process_group_ranks(group)))
            aliases[alias] = names.get(group.group_name) or names.get(ranks, alias)
    volume = analytic(cfg, dims, pp_rank, routing, aliases)
    expect = [{"kind": k, "axis": ax, "bytes": v} for (k, ax), v in sorted(volume.items())]
    mine = {"rank": dist.get_rank(), "pp_rank": pp_rank, "rows": rows, "analytic": expect, "wire": wire}
    if dims.ep > 1:  # the planner's all-to-all bytes, which assume balanced routing, beside the measured ones
        mine["planner_a2a"] = planner_a2a(cfg, dims, t)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    del t
    return {"layout": name, "world": world, "dims": vars(dims), "textbook": textbook(cfg, dims), "ranks": everyone}


def _worker(rank: int, world: int, port: int, jobs: list[tuple[str, list[str]]], out: str, steps: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's own deprecation notices
    from plait.parallel.env import init_distributed, shutdown

    results = []
    try:
        init_distributed("cpu", 300)
        for name, overrides in jobs:
            try:
                results.append(_run_layout(name, overrides, world, steps))
            except Exception:
                results.append({"layout": name, "world": world, "error": traceback.format_exc()})
                raise
    finally:
        if rank == 0:
            Path(out).write_text(json.dumps(results))
        shutdown()


def launch(world: int, jobs: list[tuple[str, list[str]]], steps: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(Path(tempfile.mkdtemp(prefix=f"plait-comm-w{world}-")) / "results.json")
    try:
        mp.start_processes(_worker, args=(world, port, jobs, out, steps), nprocs=world, start_method="spawn")
    except mp.ProcessRaisedException as e:
        print(f"world {world}: a worker failed: {e}", file=sys.stderr)
    return json.loads(Path(out).read_text()) if Path(out).exists() else []


# ----------------------------------------------------------------------------------------- the report


def textbook(cfg, dims) -> float | None:
    """The one-line formulas (Psi = parameter bytes, A = (B, T, dim) activation bytes), for the single-axis layouts."""
    psi = cfg.model.num_params() * BYTES
    local = cfg.train.global_batch_size // dims.dp
    act = local * cfg.data.seq_len * cfg.model.dim * BYTES
    one = [name for name, n in (("pp", dims.pp), ("dp", dims.dp), ("tp", dims.tp)) if n > 1]
    if one == ["dp"] and dims.dp_shard == 1:  # DP: ring all-reduce of the gradients
        return 2 * psi * (dims.dp - 1) / dims.dp
    if one == ["dp"]:  # FSDP: all-gather (forward), all-gather (backward), reduce-scatter; HSDP: + replica all-reduce
        ns, r = dims.dp_shard, dims.dp_replicate
        return 3 * psi * (ns - 1) / ns + 2 * psi / ns * (r - 1) / r
    if one == ["tp"]:  # TP+SP: 2 all-gathers + 2 reduce-scatters of A per block and pass
        return 8 * cfg.model.n_layers * act * (dims.tp - 1) / dims.tp
    if one == ["pp"]:  # one A per micro-batch and direction; an end stage sends in one direction only
        return act
    return None


def summarise(result: dict) -> dict:
    """Per rank: measured bulk bytes, analytic bytes, scalars, wire bytes; per (kind, axis) breakdown."""
    ranks = []
    for r in result["ranks"]:
        bulk: dict[tuple[str, str], float] = defaultdict(float)
        calls: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
        scalars = 0.0
        for row in r["rows"]:
            if row["class"] == "scalar":
                scalars += row["bytes"]
            elif row["kind"] != "recv":  # bytes received are the peer's sends
                bulk[(row["kind"], row["axis"])] += row["bytes"]
                calls[(row["kind"], row["axis"])][row["phase"]] += row["calls"]
        expect = {(e["kind"], e["axis"]): e["bytes"] for e in r["analytic"]}
        keys = sorted(set(bulk) | set(expect))
        measured, predicted = sum(bulk.values()), sum(expect.values())
        # gloo runs a reduce-scatter as an all-reduce of the input: twice the ring reduce-scatter's bytes
        wire_model = measured + sum(v for (k, _), v in bulk.items() if k == "reduce_scatter") + scalars
        a2a = sum(v for (k, _), v in bulk.items() if k == "all_to_all")
        ranks.append({
            "rank": r["rank"], "pp_rank": r["pp_rank"], "measured": measured, "analytic": predicted,
            "a2a_measured": a2a, "a2a_planner": r.get("planner_a2a"),
            "ratio": measured / predicted if predicted else float("nan"), "scalars": scalars,
            "wire": r["wire"], "wire_model": wire_model,
            "by_kind_axis": [{"kind": k, "axis": ax, "calls": dict(calls.get((k, ax), {})),
                              "measured": bulk.get((k, ax), 0.0), "analytic": expect.get((k, ax), 0.0)}
                             for k, ax in keys],
        })  # fmt: skip
    return {"layout": result["layout"], "world": result["world"], "dims": result["dims"],
            "textbook": result.get("textbook"), "ranks": ranks}  # fmt: skip


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.4f}"


def _stages(s: dict) -> list[dict]:
    """Ranks of one pipeline stage are symmetric: the first rank of each stage."""
    out, seen = [], set()
    for r in s["ranks"]:
        if r["pp_rank"] not in seen:
            seen.add(r["pp_rank"])
            out.append(r)
    return out


def report(summaries: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    table = Table(title="Bytes sent per rank per training step (MB = 1e6 B), debug model, fp32, gloo")
    for col in ("layout", "rank (stage)", "textbook MB", "analytic MB", "measured MB", "measured / analytic",
                "wire model MB", "wire MB", "wire / model", "scalars B"):  # fmt: skip
        table.add_column(col, justify="left" if col == "layout" else "right")
    for s in summaries:
        for r in _stages(s):
            table.add_row(
                s["layout"], f"{r['rank']} ({r['pp_rank']})", _mb(s["textbook"]), _mb(r["analytic"]),
                _mb(r["measured"]), f"{r['ratio']:.4f}", _mb(r["wire_model"]), _mb(r["wire"]),
                f"{r['wire'] / r['wire_model']:.3f}" if r["wire_model"] else "-", f"{r['scalars']:.0f}",
            )  # fmt: skip
    console.print(table)
    detail = Table(
        title="Breakdown by collective and mesh axis. Calls per step f/b/n: f = outside autograd's backward (forward, "
        "P2P, pipelining's deferred gradient reduction), b = inside autograd's backward, n = in clip_grad_norm"
    )
    for col in ("layout", "rank", "collective @ axis", "calls f/b/n", "measured MB", "analytic MB"):
        detail.add_column(col, justify="left" if col in ("layout", "collective @ axis") else "right")
    for s in summaries:
        for r in _stages(s):
            for x in r["by_kind_axis"]:
                c = x["calls"]
                detail.add_row(
                    s["layout"], str(r["rank"]), f"{x['kind']} @ {x['axis']}",
                    f"{c.get('forward', 0):g}/{c.get('backward', 0):g}/{c.get('grad-norm', 0):g}",
                    _mb(x["measured"]), _mb(x["analytic"]),
                )  # fmt: skip
        detail.add_section()
    console.print(detail)
    console.print(f"Ring model (bytes one rank sends per call, N = group size): {RING}.")
    console.print(
        "textbook: 2Psi(N-1)/N (DP), 3Psi(N-1)/N (+ 2(Psi/N)(R-1)/R across R replicas: HSDP), "
        "8 L A (N-1)/N (TP+SP blocks only), A per direction (PP); analytic: exact per module and "
        "schedule; wire: /proc/self/io wchar; wire model: ring bytes with gloo's reduce-scatter "
        "as an all-reduce, plus scalars. Scalars (grad-norm partial sums, the loss) are not in the ratio."
    )
    worst = max((abs(r["ratio"] - 1) for s in summaries for r in s["ranks"]), default=float("nan"))
    console.print(f"worst |measured / analytic - 1| over all layouts and ranks: {worst:.4f} (goal <= 0.05)")
    for s in summaries:
        for r in s["ranks"]:
            if r.get("a2a_planner"):
                console.print(
                    f"{s['layout']}, rank {r['rank']}: all-to-all {_mb(r['a2a_measured'])} MB measured (analytic from "
                    f"its routing: equal above), planner's balanced-routing estimate {_mb(r['a2a_planner'])} MB "
                    f"(measured / planner {r['a2a_measured'] / r['a2a_planner']:.3f})",
                    highlight=False,
                )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2, help="counted steps per layout (after one warm-up step)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="global batch size")
    p.add_argument("--worlds", type=int, nargs="+", default=sorted(LAYOUTS))
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "comm.json"))
    a = p.parse_args()
    base = ["model.preset=debug", f"data.seq_len={a.seq_len}", f"train.global_batch_size={a.batch}",
            "train.mixed_precision=fp32", "run.device=cpu"]  # fmt: skip
    summaries, errors = [], []
    for world in a.worlds:
        jobs = [(name, [*base, *extra]) for name, extra in LAYOUTS[world].items()]
        for res in launch(world, jobs, a.steps):
            if "error" in res:
                errors.append(res)
                print(f"{res['layout']}: {res['error']}", file=sys.stderr)
            else:
                summaries.append(summarise(res))
    report(summaries)
    import plait

    result = {
        "what": "bytes sent per rank per training step, counted at the dispatcher, ring-algorithm model",
        "ring_model": RING,
        "settings": {"preset": "debug", "seq_len": a.seq_len, "global_batch": a.batch, "steps": a.steps,
                     "precision": "fp32", "backend": "gloo", "torch": torch.__version__,
                     "plait": getattr(plait, "__version__", "?")},
        "layouts": summaries,
        "errors": [e["layout"] for e in errors],
    }  # fmt: skip
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {a.out}")


if __name__ == "__main__":
    main()
