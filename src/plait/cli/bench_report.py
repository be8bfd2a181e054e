"""`plait bench`'s report: the results (plait.cli.bench.run_bench) as one table, then the profile's summary
when --profile ran. Rows in three groups: the job and its speed, the step's breakdown and memory, the start-up."""

from __future__ import annotations


def print_report(r: dict) -> None:
    from rich.table import Table

    from plait.engine.metrics import console

    table = Table(title=f"plait bench: {r['device']} ({r['device_type']}), torch {r['torch']}, commit {r['commit']}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("note")
    for row in [*_speed_rows(r), *_step_rows(r), *_startup_rows(r)]:
        table.add_row(*row)
    console.print(table)
    if r.get("profile"):
        from plait.core.profiling import describe

        console.print(describe(r["profile"]))


def _speed_rows(r: dict) -> list[tuple[str, str, str]]:
    """The model, the batch, compile, and how fast a step runs."""
    comp = r["compile"]
    return [
        ("model", f"{r['preset_params'] / 1e6:.1f}M", f"{r['n_layers']} layers x dim {r['dim']}, {r['precision']}"),
        (
            "batch",
            f"{r['global_batch_size']} x {r['seq_len']}",
            f"micro-batch {r['micro_batch_size']}, activation checkpointing {r['activation_checkpoint']}",
        ),
        ("compile", comp["mode"] if comp else "off", "regional (per block), static shapes" if comp else ""),
        ("tokens/s", f"{r['tokens_per_s']:,.0f}", f"{r['steps']} steps after {r['warmup']} warm-up"),
        (
            "step time",
            f"{r['step_time_s'] * 1e3:,.1f} ms",
            f"median (mean {r['step_time_mean_s'] * 1e3:,.1f} ms), whole step",
        ),
        ("MFU", f"{100 * r['mfu']:.2f}%", f"peak {r['peak_flops'] / 1e12:,.1f} TFLOP/s: {r['peak_source']}"),
    ]


def _step_rows(r: dict) -> list[tuple[str, str, str]]:
    """Where a synchronised step's time goes, the peak memory (and the planner's), the head."""
    rows = []
    b = r["breakdown_s"]
    for name, label in [
        ("data", "  data wait"),
        ("compute", "  forward+backward+norm"),
        ("communication_exposed", "  exposed communication"),
        ("optimizer", "  optimizer"),
    ]:
        share = 100 * b[name] / b["total"] if b["total"] else 0.0
        rows.append((label, f"{b[name] * 1e3:,.1f} ms", f"{share:.1f}% of the synchronised step"))
    mem = r["memory"]
    rows.append(("peak memory", f"{mem['mem_peak_gib']:.2f} GiB", r["memory_note"]))
    if "planner" in mem:
        plan = mem["planner"]
        rows.append((
            "  planner",
            f"{plan['allocated_gib']:.2f} GiB",
            f"predicted allocation (the CUDA peak's measure); {plan['total_gib']:.2f} GiB with slack and reserve",
        ))  # fmt: skip
    rows.append(("head", "fused" if r["fused_head"] else "plain", "output projection + loss (train.fused_head)"))
    return rows


def _startup_rows(r: dict) -> list[tuple[str, str, str]]:
    """The first step, the start-up's phases, and with compile its cost cold and warm."""
    fs, comp = r["first_step"], r["compile"]
    rows = [("first step", f"{fs['from_build_s']:.1f} s", f"{fs['from_process_start_s']:.1f} s from process start")]
    for name, value in r["startup_s"].items():
        if name != "total":
            rows.append((f"  start-up: {name.replace('_', ' ')}", f"{value:.2f} s", ""))
    if not comp:
        return rows
    rows.append((
        "  compile (first run)",
        f"{fs['compile_time_s']:.1f} s",
        f"FX-graph cache hits {fs['compile_fxgraph_cache_hit']}, misses {fs['compile_fxgraph_cache_miss']}; "
        f"recompiles {fs['compile_recompiles']}",
    ))  # fmt: skip
    warm = r.get("warm_start")
    if warm:
        rows.append((
            "  first step (warm)",
            f"{warm['from_build_s']:.1f} s",
            f"{warm['from_process_start_s']:.1f} s from process start; compile {warm['compile_time_s']:.1f} s, "
            f"FX-graph hits {warm['compile_fxgraph_cache_hit']}, AOTAutograd hits "
            f"{warm['compile_aotautograd_cache_hit']}",
        ))  # fmt: skip
        rows.append(("  warm / cold", f"{r['warm_over_cold']:.2f}", "first step from process start (goal <= 0.2)"))
    return rows
