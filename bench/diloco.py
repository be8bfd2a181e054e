"""DiLoCo against synchronous replica groups at equal tokens: the final held-out loss and the bytes sent between
groups (issue 47's "Done when").

    python bench/diloco.py [--groups 3] [--seeds 0,1,2] [--steps 200] [--sync-every 10] [--outer-lrs 0.5,0.7,1.0]
        [--batch 8] [--seq-len 32] [--eval-every 40] [--eval-batches 48] [--out bench/results/diloco.json]

Every arm trains the debug model on the bundled corpus for the same steps with the same batch per group, so the
same tokens: `plait train --replicas G --nproc 1`, G groups of one process each, with
parallel.diloco_sync_every=0 (synchronous: the gradients averaged every step) or H (DiLoCo: H local steps, then
one average of the pseudo-gradients and an outer Nesterov step). A reference is one process with the groups'
total batch (train.global_batch_size = G x --batch, no replica groups), which the synchronous arm should match.

The outer learning rate is swept on the first seed for the first H (--outer-lrs; one value: no sweep), scored by
the final held-out loss, and the best one runs the other seeds. Each run's held-out loss is replica 0's val/loss
(every --eval-every steps, a multiple of each H, so it is taken at a round's end where all groups hold the same
weights); the reference evaluates --eval-batches / G batches of G x --batch sequences, the same held-out
sequences. The bytes are replicas/sent_mb at the end: the MiB one rank sent to the other groups in the run.

Runs go one at a time, each process with OMP_NUM_THREADS = cores / G, the reference too (the launcher would
give every group all the cores, and G groups on one small machine then oversubscribe it several times over).
Wall times are whole runs (start-up included) and are noisy where other work shares the machine. A fault-free
run should never fail a round, heal a group or leave one out: each run's log lines and replica records that say
so are kept in the JSON under "anomalies".
Printed: a table per arm, ratios against the synchronous arm; written to --out, with a plot beside it (.png).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import host

QUIET = ["model.preset=debug", "log.tensorboard=false", "log.plot=false", "sample.max_new_tokens=0",
         "run.health_check_enabled=false", "checkpoint.every_steps=0", "checkpoint.save_final=false",
         "lineage.enabled=false", "run.device=cpu", "log.every_steps=1"]  # fmt: skip
ANOMALIES = ("not committed", "healed", "failed", "left out", "quarantined", "Traceback")


def settings(args, name: str, seed: int, out: Path, batch: int, eval_batches: int) -> list[str]:
    return [*QUIET, f"data.seq_len={args.seq_len}", f"train.global_batch_size={batch}", f"train.steps={args.steps}",
            f"optim.warmup_steps={args.warmup}", f"run.seed={seed}", f"eval.every_steps={args.eval_every}",
            f"eval.num_batches={eval_batches}", f"run.out_dir={out}", f"run.name={name}"]  # fmt: skip


def launch(args, name: str, seed: int, out: Path, every: int = 0, outer_lr: float = 0.7) -> dict:
    """One run: G replica groups (every = H, 0: synchronous), or with every < 0 the one-process reference."""
    cores = os.cpu_count() or 1
    if every < 0:
        cmd = ["train", *[f"--{s}" for s in settings(args, name, seed, out, args.groups * args.batch,
                                                         args.eval_batches // args.groups)]]  # fmt: skip
    else:
        extra = [f"parallel.diloco_sync_every={every}", f"parallel.diloco_outer_lr={outer_lr}"]
        own = settings(args, name, seed, out, args.batch, args.eval_batches) + extra
        cmd = ["train", "--replicas", str(args.groups), "--nproc", "1", *[f"--{s}" for s in own]]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = str(max(1, cores // args.groups))  # the reference too: the same cores per rank
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "plait.cli", *cmd], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{name} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    got = read(out / name / ("replica_0" if every >= 0 else ""), args)
    groups = [read(out / name / f"replica_{i}", args) for i in range(args.groups)] if every >= 0 else [got]
    got["sent_mb_per_group"] = [g["sent_mb"] for g in groups]
    got["anomalies"] = [line for line in done.stderr.splitlines() if any(a in line for a in ANOMALIES)]
    got["anomalies"] += [f"group {i}: {g['odd']}" for i, g in enumerate(groups) if g["odd"]]
    got.update(seconds=seconds, every=every, outer_lr=outer_lr if every > 0 else None, seed=seed)
    return got


def read(run: Path, args) -> dict:
    """A run's held-out curve {step: loss}, its last sent_mb, its training span and any odd replica records."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    curve = {r["step"]: r["val/loss"] for r in rows if "val/loss" in r}
    reps = [r for r in rows if "replicas/samples" in r]
    odd = [
        {k: r.get(k) for k in ("step", "replicas/groups", "replicas/samples", "replicas/failed_attempts",
                               "replicas/healed", "replicas/excluded")}
        for r in reps
        if r["replicas/groups"] != args.groups or r.get("replicas/failed_attempts") or r.get("replicas/healed")
        or r.get("replicas/excluded")
    ]  # fmt: skip
    times = [r["time"] for r in rows if "train/loss" in r]
    return {"curve": curve, "final": curve[max(curve)], "sent_mb": reps[-1]["replicas/sent_mb"] if reps else 0.0,
            "train_span_s": times[-1] - times[0], "odd": odd[:10]}  # fmt: skip


def one(runs: dict, key: str, args, seed: int, out: Path, every: int = 0, outer_lr: float = 0.7) -> None:
    name = key.replace(" ", "_")
    runs[key] = got = launch(args, name, seed, out, every, outer_lr)
    flag = f", {len(got['anomalies'])} anomalies" if got["anomalies"] else ""
    print(f"{key}: held-out {got['final']:.4f}, {got['sent_mb']:.1f} MiB sent, {got['seconds']:.0f} s{flag}",
          flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--sync-every", default="10", help="DiLoCo's H, comma-separated (the sweep uses the first)")
    ap.add_argument("--outer-lrs", default="0.5,0.7,1.0")
    ap.add_argument("--batch", type=int, default=8, help="sequences per group per step")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=40)
    ap.add_argument("--eval-batches", type=int, default=48)
    ap.add_argument("--out", default="bench/results/diloco.json")
    args = ap.parse_args()
    seeds, hs = [int(s) for s in args.seeds.split(",")], [int(h) for h in args.sync_every.split(",")]
    lrs = [float(x) for x in args.outer_lrs.split(",")]
    assert all(args.steps % h == 0 and args.eval_every % h == 0 for h in hs), "H must divide steps and eval-every"
    assert args.eval_batches % args.groups == 0, "--eval-batches must be a multiple of --groups"
    scratch = Path(tempfile.mkdtemp(prefix="plait-diloco-"))
    runs: dict[str, dict] = {}
    start = time.perf_counter()
    try:
        for seed in seeds:
            one(runs, f"reference s{seed}", args, seed, scratch, every=-1)
            one(runs, f"sync s{seed}", args, seed, scratch)
        for lr in lrs:
            one(runs, f"H{hs[0]} lr{lr:g} s{seeds[0]}", args, seeds[0], scratch, hs[0], lr)
        best = min(lrs, key=lambda lr: runs[f"H{hs[0]} lr{lr:g} s{seeds[0]}"]["final"])
        for h in hs:
            for seed in seeds if h != hs[0] else seeds[1:]:
                one(runs, f"H{h} lr{best:g} s{seed}", args, seed, scratch, h, best)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report(args, seeds, hs, best, runs, time.perf_counter() - start, Path(args.out))


def arms(hs: list[int], best: float) -> dict[str, str]:
    """Each arm's name and the prefix of its runs' keys."""
    return {"reference (1 process)": "reference", "synchronous": "sync",
            **{f"DiLoCo H={h}": f"H{h} lr{best:g}" for h in hs}}  # fmt: skip


def report(args, seeds: list[int], hs: list[int], best: float, runs: dict, wall: float, out: Path) -> None:
    tokens = args.steps * args.groups * args.batch * args.seq_len  # every arm trains on these
    rows = {}
    for arm, prefix in arms(hs, best).items():
        each = [runs[f"{prefix} s{s}"] for s in seeds]
        finals = [r["final"] for r in each]
        sent = statistics.fmean(r["sent_mb"] for r in each)
        rows[arm] = {"finals": finals, "mean": statistics.fmean(finals), "min": min(finals), "max": max(finals),
                     "sd": statistics.stdev(finals) if len(finals) > 1 else 0.0, "sent_mb": sent,
                     "sent_mb_per_1k_tokens": sent / (tokens / 1000), "seconds": statistics.fmean(r["seconds"] for r
                     in each), "anomalies": sum(len(r["anomalies"]) for r in each)}  # fmt: skip
    sync = rows["synchronous"]
    for r in rows.values():
        r["bytes_vs_sync"] = r["sent_mb"] / sync["sent_mb"] if r["sent_mb"] else 0.0
        r["loss_minus_sync"] = r["mean"] - sync["mean"]
    print(f"\ndebug model, {args.groups} groups x {args.batch} x {args.seq_len} tokens, {args.steps} steps "
          f"({tokens:,} tokens every arm), seeds {seeds}; DiLoCo outer lr {best:g} (swept {args.outer_lrs} on seed "
          f"{seeds[0]}), bench wall time {wall:.0f} s")  # fmt: skip
    print(f"{'arm':<22} {'held-out (sd)':>16} {'min..max':>15} {'vs sync':>8} {'MiB/rank':>9} {'MiB/1k tok':>10} "
          f"{'bytes x':>8} {'wall s':>7}")  # fmt: skip
    for arm, r in rows.items():
        print(f"{arm:<22} {r['mean']:>9.4f} ({r['sd']:.4f}) {r['min']:>7.4f}..{r['max']:.4f} "
              f"{r['loss_minus_sync']:>+8.4f} {r['sent_mb']:>9.1f} {r['sent_mb_per_1k_tokens']:>10.4f} "
              f"{r['bytes_vs_sync']:>8.3f} {r['seconds']:>7.0f}")  # fmt: skip
    sweep = {f"{lr:g}": runs[k]["final"] for k in runs if k.startswith(f"H{hs[0]} lr") and k.endswith(f"s{seeds[0]}")
             for lr in [float(k.split()[1][2:])]}  # fmt: skip
    print(f"outer lr sweep (H={hs[0]}, seed {seeds[0]}): " + ", ".join(f"{k}: {v:.4f}" for k, v in sweep.items()))
    anomalies = {k: r["anomalies"] for k, r in runs.items() if r["anomalies"]}
    print(f"anomalies (failed rounds, heals, exclusions): {anomalies or 'none'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"model": "debug", "groups": args.groups, "batch_per_group": args.batch, "seq_len": args.seq_len,
              "steps": args.steps, "tokens": tokens, "seeds": seeds, "sync_every": hs, "outer_lr": best,
              "outer_lr_sweep": sweep, "rows": rows, "runs": runs, "bench_wall_s": wall, "anomalies": anomalies,
              "machine": host.describe(), "note": "wall times are whole runs (start-up included) on a machine shared "
              "with other work (another bench may have run at the same time): noisy"}  # fmt: skip
    out.write_text(json.dumps(record, indent=1))
    plot(rows, runs, arms(hs, best), seeds, tokens // args.steps, out.with_suffix(".png"), args)
    print(f"written to {out} and {out.with_suffix('.png')}")


def plot(rows: dict, runs: dict, names: dict, seeds: list[int], per_step: int, path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    colours = ["grey", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
    for (arm, prefix), colour in zip(names.items(), colours, strict=False):
        curves = [runs[f"{prefix} s{s}"]["curve"] for s in seeds]
        steps = sorted(int(k) for k in curves[0])
        values = [[c[k] if k in c else c[str(k)] for c in curves] for k in steps]
        x = [k * per_step for k in steps]
        style = "--" if prefix == "reference" else "-"
        ax.plot(x, [statistics.fmean(v) for v in values], style, color=colour, marker="o", markersize=3, label=arm)
        ax.fill_between(x, [min(v) for v in values], [max(v) for v in values], color=colour, alpha=0.2)
    ax.set(xlabel="tokens trained (all groups)", ylabel="held-out loss (nats/token)",
           title=f"{args.groups} groups, debug model, seeds {seeds} (band: min..max)")  # fmt: skip
    ax.legend()
    bars = [a for a in names if a != "reference (1 process)"]
    bx.bar(range(len(bars)), [rows[a]["sent_mb"] for a in bars], color=colours[1 : len(bars) + 1])
    for i, a in enumerate(bars):
        bx.text(i, rows[a]["sent_mb"], f"{rows[a]['sent_mb']:.0f} MiB\n({rows[a]['bytes_vs_sync']:.2f}x)",
                ha="center", va="bottom", fontsize=8)  # fmt: skip
    bx.set_xticks(range(len(bars)), [a.replace("DiLoCo ", "") for a in bars])
    bx.set(ylabel="MiB one rank sent to the other groups", title="bytes between groups (whole run)")
    bx.set_ylim(top=max(rows[a]["sent_mb"] for a in bars) * 1.2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
