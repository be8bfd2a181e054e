"""`plait plan`: the planner's command line (a ranked table, the reasons, and --write / --json)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
from pathlib import Path

from plait.cli.args import PlaitParser
from plait.core.errors import ConfigError, PlaitError

SUFFIXES = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


def parse_tokens(text: str) -> int:
    """'4194304', '4M' (= 4 x 2^20: batch sizes are quoted in powers of two), '512k', '1.5M'."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)i?\s*", text)
    if not match:
        raise ConfigError(f"--global-batch-tokens={text!r} is not a number; e.g. 4194304 or 4M (= 4 x 2^20)")
    value = float(match.group(1)) * SUFFIXES[match.group(2).lower()]
    if value != int(value) or value < 1:
        raise ConfigError(f"--global-batch-tokens={text!r} must be a whole number of tokens, e.g. 4M")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    from plait.model import PRESETS
    from plait.planner.cluster import PRESETS as CLUSTERS

    p = PlaitParser(
        prog="plait plan",
        usage="plait plan (--model PRESET --global-batch-tokens N | --config CONFIG.toml) [options]",
        description="Choose a parallel layout (dp_replicate x dp_shard x cp x tp x pp, schedule, micro-batch, "
        "activation checkpointing, offload): predicted memory per rank, step time, MFU and tokens/s.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", choices=list(PRESETS), help="A model preset.")
    src.add_argument("--config", help="A plait TOML config: its model, data.seq_len and train.global_batch_size.")
    p.add_argument(
        "--cluster",
        default="h100",
        choices=[*CLUSTERS, "local"],
        help="Cluster preset ('local': measure this machine); default h100.",
    )
    p.add_argument("--nodes", type=int, help="Number of nodes; default 1.")
    p.add_argument("--devices-per-node", type=int, help="Accelerators per node (preset's value).")
    p.add_argument("--memory-gib", type=_finite_positive, help="Device memory, GiB.")
    p.add_argument("--peak-tflops", type=_finite_positive, help="Dense bf16 peak per device, TFLOP/s.")
    p.add_argument("--efficiency", type=_finite_positive, help="Achieved fraction of peak on large matmuls.")
    p.add_argument("--intra-bw", type=_finite_positive, help="Per-device bandwidth inside a node, GB/s.")
    p.add_argument("--inter-bw", type=_finite_positive, help="Per-device bandwidth between nodes, GB/s.")
    p.add_argument(
        "--intra-latency-us", type=_finite_positive, help="Collective hop latency inside a node, microseconds."
    )
    p.add_argument(
        "--inter-latency-us", type=_finite_positive, help="Collective hop latency between nodes, microseconds."
    )
    p.add_argument("--host-memory-gib", type=_finite_positive, help="CPU memory per node, GiB (for offload).")
    p.add_argument(
        "--global-batch-tokens",
        help="Tokens per optimizer step, e.g. 4M (= 4 x 2^20); required with --model (a --config has its own).",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        help="Tokens per sequence (default: the config's data.seq_len, or 8192 capped at the model's max_seq_len).",
    )
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="Compute precision.")
    p.add_argument("--top", type=int, default=10, help="Rows in the table.")
    p.add_argument("--write", metavar="PATH", help="Write the chosen layout as a plait TOML config.")
    p.add_argument("--overwrite", action="store_true", help="Let --write replace an existing file.")
    p.add_argument("--json", action="store_true", help="Print the plan as JSON instead of a table.")
    return p


def _finite_positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number above 0")
    return value


def _check_writable(path: str, overwrite: bool) -> None:
    """--write: refused before planning if it would replace a file without --overwrite, or cannot be made."""
    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"--write {path} is a directory; give a file path, e.g. {out / 'plan.toml'}")
    if out.exists() and not overwrite:
        raise ConfigError(f"--write {path} exists; choose another path or pass --overwrite")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"--write {path}: cannot create it under {parent} (not a writable directory)")


PLANNER_BLAS_THREADS = "1"
"""The planner's matrix products are small and many (plait.planner.cost.pipeline.peak_activations): BLAS's
threads spinning between them cost more CPU than the products (measured in docs/planner.md). Set before numpy
loads, unless the user set it."""


PLANNER_MALLOC = {-3: 32 << 20, -1: 1 << 30, -2: 64 << 20}
"""glibc's malloc settings for `plait plan` (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_TOP_PAD): the cost model
allocates and frees arrays of a few MB (one value per layout) by the thousand, which glibc by default maps and
unmaps, or trims, each time: a page fault per 4 KiB touched again. Kept in the process instead (measured in
docs/planner.md, bench/plan_speed.py)."""


def _keep_freed_memory() -> None:
    """PLANNER_MALLOC where the C library is glibc (elsewhere nothing changes)."""
    if not hasattr(os, "confstr") or "glibc" not in (os.confstr("CS_GNU_LIBC_VERSION") or ""):
        return
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt  # this process's own symbols: glibc's
        for option, value in PLANNER_MALLOC.items():
            mallopt(option, value)
    except (OSError, AttributeError):
        return


def cmd_plan(argv: list[str]) -> int:
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, PLANNER_BLAS_THREADS)  # a process of its own: nothing else shares them
    _keep_freed_memory()
    from plait.planner.search import plan

    a = build_parser().parse_args(argv)
    if a.write:
        _check_writable(a.write, a.overwrite)
    base, model = _model_of(a)
    seq, tokens = _batch_of(a, base, model)
    for name in ("nodes", "devices_per_node", "top"):
        value = getattr(a, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={value} must be at least 1")
    cluster = _cluster_of(a)
    work = _workload(model, seq, tokens, a.precision, base)
    pins = config_pins(a.config, base, cluster.world_size) if base is not None else {}
    result = plan(work, cluster, pins=pins)
    if a.json:
        print(json.dumps(to_json(result, a.top), indent=2))
    else:
        print_plan(result, a.top)
    if a.write:
        path = write_config(a.write, result, base)
        if not a.json:
            print(f"wrote {path}: train with `plait train {path}`")
    return 0


def _model_of(a):
    """(the --config's Config or None, the model's arguments): from --config, else the --model preset."""
    from plait.config import Config, load_config
    from plait.model import preset_args

    base: Config | None = None
    if a.config:
        base = load_config(a.config)
        model = base.model
    elif a.model:
        model = preset_args(a.model)
    else:
        raise ConfigError("give the model: --model PRESET (e.g. --model llama3-8b) or --config CONFIG.toml")
    return base, model


def _batch_of(a, base, model) -> tuple[int, int]:
    """(tokens per sequence, tokens per step): the flags, else the config's, refused unless the step is a
    whole number of sequences."""
    seq = a.seq_len or (base.data.seq_len if base else min(8192, model.max_seq_len))
    if seq < 1:
        raise ConfigError(f"--seq-len={seq} must be positive, e.g. 4096")
    if a.global_batch_tokens is not None:
        tokens = parse_tokens(a.global_batch_tokens)
    elif base is not None:
        tokens = base.train.global_batch_size * seq
    else:
        raise ConfigError("give --global-batch-tokens, e.g. --global-batch-tokens=4M (4 x 2^20 tokens per step)")
    if tokens % seq:
        lower, upper = tokens // seq * seq, (tokens // seq + 1) * seq
        nearest = " or ".join(f"{t:,}" for t in (lower, upper) if t > 0)
        raise ConfigError(
            f"--global-batch-tokens={tokens:,} is not a whole number of {seq}-token sequences; use {nearest}"
        )
    return seq, tokens


def _cluster_of(a):
    """The --cluster preset with the flags that override it (in the cost model's units: FLOP/s, B/s, s)."""
    from plait.planner.cluster import get_cluster

    cluster = get_cluster(
        a.cluster,
        nodes=a.nodes,
        devices_per_node=a.devices_per_node,
        memory_gib=a.memory_gib,
        peak_flops=a.peak_tflops and a.peak_tflops * 1e12,
        efficiency=a.efficiency,
        intra_bw=a.intra_bw and a.intra_bw * 1e9,
        inter_bw=a.inter_bw and a.inter_bw * 1e9,
        intra_latency=a.intra_latency_us and a.intra_latency_us * 1e-6,
        inter_latency=a.inter_latency_us and a.inter_latency_us * 1e-6,
        host_memory_gib=a.host_memory_gib,
    )
    if cluster.efficiency > 1:
        raise ConfigError(f"--efficiency={cluster.efficiency} is a fraction of peak: at most 1, e.g. 0.55")
    return cluster


def _workload(model, seq: int, tokens: int, precision: str, base):
    """What one step computes; with a config, what its run would do: its head, optimizer states, compile and
    adapters."""
    from plait.planner.cost import Workload

    work = Workload(model, seq, tokens // seq, precision)
    if base is not None:
        work = dataclasses.replace(
            work,
            fused_head=base.train.fused_head,
            moment_bytes=2 if base.optim.state_dtype == "bf16" else 4,
            compiled=base.compile.enabled,
            lora_rank=base.finetune.lora_rank,
            muon=base.optim.name == "muon",
            replica_groups=max(base.parallel.start_replicas, 2) if base.parallel.fault_tolerant else 1,
            sync_every=max(base.parallel.diloco_sync_every, 1),
        )
    return work


PIN_COLUMNS = (
    ("dp_replicate_degree", "dp_replicate"),
    ("tp_degree", "tp"),
    ("pp_degree", "pp"),
    ("cp_degree", "cp"),
    ("ep_degree", "ep"),
)
"""[parallel] degrees a config pins as they are: (its key, the planner's column)."""


def config_pins(path: str, base, world_size: int) -> dict[str, int]:
    """The layout columns a config's [parallel] section sets explicitly: the plan keeps them. A set that no
    layout can have (the product of the degrees against the world, a degree the model refuses) is refused
    with the runtime's own reason (plait.parallel.rules)."""
    import tomllib

    with open(path, "rb") as f:
        document = tomllib.load(f)
    written, train = document.get("parallel") or {}, document.get("train") or {}
    pins = _written_pins(written, train, base)
    _check_pins(path, pins, written, base, world_size)
    return pins


def _written_pins(written: dict, train: dict, base) -> dict[str, int]:
    """The planner's columns (name -> index or value) of the settings the config's file writes (`written`,
    its [parallel] table; `train`, its [train] table), with the values the loaded config `base` gives them."""
    from plait.planner.cost import AC_MODES, SCHEDULES

    p = base.parallel
    pins: dict[str, int] = {}
    for key, column in PIN_COLUMNS:
        if key in written:
            pins[column] = getattr(p, key)
    if "dp_shard_degree" in written and p.dp_shard_degree != -1:
        pins["dp_shard"] = p.dp_shard_degree
    if "activation_checkpoint" in written:
        pins["ac"] = AC_MODES.index(p.activation_checkpoint)
    if "cpu_offload" in written:
        pins["offload"] = int(p.cpu_offload)
    if "pp_schedule" in written and p.pp_degree > 1:
        pins["schedule"] = SCHEDULES.index(p.pp_schedule)
    if "pp_virtual_stages" in written and p.pp_degree > 1:
        pins["virtual"] = p.pp_virtual_stages
    if "fsdp_reshard_after_forward" in written:
        pins["reshard"] = int(p.fsdp_reshard_after_forward)
    if "fsdp_reduce_every_micro_batch" in written:
        pins["sync_each"] = int(p.fsdp_reduce_every_micro_batch)
    if train.get("micro_batch_size"):
        pins["micro_batch"] = base.train.micro_batch_size
    return pins


def _check_pins(path: str, pins: dict[str, int], written: dict, base, world_size: int) -> None:
    """Refuse pins no layout can have: degrees whose product does not divide the world, or a degree the model
    cannot take."""
    from plait.parallel.rules import cp_problem, pp_problem, stages_problem, tp_problem

    fixed = pins.get("dp_replicate", 1) * pins.get("tp", 1) * pins.get("pp", 1) * pins.get("dp_shard", 1)
    fixed *= pins.get("cp", 1)
    if world_size % fixed:
        degrees = " x ".join(f"{k}={v}" for k, v in pins.items() if k in ("dp_replicate", "dp_shard", "cp", "tp", "pp"))
        raise ConfigError(
            f"{path} [parallel]: {degrees} = {fixed} does not divide the {world_size} devices planned for; "
            f"change those degrees or --nodes / --devices-per-node"
        )
    # The runtime's own reason for a pinned degree the model cannot take, e.g. "parallel.tp_degree=3 must divide
    # model.n_heads=32": only the rules of the pinned degrees alone; those of the whole layout (the batch over
    # the data-parallel ranks, the micro-batches) hold for the layouts the search still covers, or it says so.
    p, m, seq, tp = base.parallel, base.model, base.data.seq_len, pins.get("tp", 1)
    problem = (
        (
            ("pp_schedule" in written or "pp_virtual_stages" in written)
            and stages_problem(p.pp_schedule, p.pp_virtual_stages)
        )
        or ("tp" in pins and tp_problem(m, seq, tp))
        or ("cp" in pins and cp_problem(m, seq, pins["cp"], tp))
        or ("pp" in pins and pp_problem(m, pins["pp"]))
    )
    if problem:
        raise ConfigError(problem)


def to_json(result, top: int) -> dict:
    return {
        "model_params": result.work.model.num_params(),
        "cluster": dataclasses.asdict(result.cluster),
        "seq_len": result.work.seq_len,
        "global_batch": result.work.global_batch,
        "searched": result.searched,
        "search_seconds": result.seconds,
        "best": result.record(result.best),
        "top": [result.record(i) for i in result.top(top)],
        "explanation": result.explanation,
    }


PLAN_COLUMNS = (
    "#", "dp rep", "dp shard", "cp", "tp", "pp", "ep", "schedule", "mb", "m", "AC", "offload", "GiB/rank",
    "step s", "tokens/s", "MFU", "bubble", "exposed comm",
)  # fmt: skip
"""The table's columns: the layout (mb: sequences per micro-batch, m: micro-batches per step), then its
predicted memory, time and where the time goes."""


def print_plan(result, top: int) -> None:
    """The plan as a person reads it: what was planned for, the `top` layouts as a table, the reasons, and the
    best layout in full."""
    from rich.console import Console

    from plait.planner.search import layout_name

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # a pipe or a file: do not wrap the table at 80 columns
    w, c = result.work, result.cluster
    console.print(
        f"[bold]plait plan[/]: {w.model.num_params() / 1e9:,.1f}B parameters, seq {w.seq_len}, "
        f"{w.global_batch} sequences ({w.tokens:,} tokens) per step, {w.compute_dtype}; {c.describe()}. "
        f"Searched {result.searched:,} layouts in {result.seconds:.2f} s."
    )
    console.print(_plan_table(result, top))
    for line in result.explanation:
        console.print(line, highlight=False)
    console.print(f"Best layout in full: {layout_name(result.record(result.best))}", highlight=False)


def _plan_table(result, top: int):
    """The `top` layouts, best first, one row each."""
    from rich.table import Table

    table = Table(show_lines=False)
    for col in PLAN_COLUMNS:
        table.add_column(col, justify="right" if col not in ("schedule", "AC") else "left")
    for rank, i in enumerate(result.top(top), 1):
        table.add_row(str(rank), *_plan_row(result.record(i)))
    return table


def _plan_row(r: dict) -> list[str]:
    """One layout's cells after its rank, from its record (plait.planner.report)."""
    sched = "-" if r["pp"] == 1 else r["schedule"] + (f" v{r['virtual']}" if r["virtual"] > 1 else "")
    comm = r["t_tp"] + r["t_cp"] + r["t_ep"] + r["t_p2p"] + r["t_fsdp"]
    return [
        *(str(r[k]) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")),
        sched,
        str(r["micro_batch"]),
        str(r["micro_batches"]),
        r["ac"],
        "yes" if r["offload"] else "",
        f"{r['mem_total_gib']:.1f}",
        f"{r['step_time']:.3g}",
        f"{r['tokens_per_s']:,.0f}",
        f"{r['mfu']:.1%}",
        f"{r['t_bubble'] / r['step_time']:.0%}",
        f"{comm / r['step_time']:.0%}",
    ]


def write_config(path: str, result, base=None) -> Path:
    from plait.config import to_toml
    from plait.planner.search import layout_config

    out = Path(path)
    cfg = layout_config(result, base)
    best = result.record(result.best)
    header = (
        f"# Written by `plait plan`: {best['tokens_per_s']:,.0f} tokens/s, MFU {best['mfu']:.1%}, "
        f"{best['mem_total_gib']:.1f} GiB per rank predicted on {result.cluster.world_size} devices "
        f"({result.cluster.name}).\n"
    )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(header + to_toml(cfg))
    except OSError as e:
        raise PlaitError(f"--write {path} could not be written: {e.strerror or e}") from None
    return out
