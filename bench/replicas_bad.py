"""A bad replica group against the contribution check: is it named and left out, and does the loss curve stay
within the fault-free run's seed-to-seed spread; and without the check, what does the same fault do.

    python bench/replicas_bad.py [--modes scale:100,noise:10,noise:100,flip:1,flip:100,nan] [--seeds 0,1,2]
        [--steps 60] [--bad-from 5] [--eval-batches 16] [--out bench/results/replicas_bad.json]
        [--resume bench/results/replicas_bad.json]

Each run is `plait train --replicas 3 --nproc 1` of the debug model on the bundled corpus (tests/runs.py's short
run: 8 sequences of 32 tokens per group and step, warm-up 2, cosine), one at a time. Runs: fault-free (check on);
and per mode, group 1's gradient made bad from step --bad-from on (PLAIT_FAULT_BAD_REPLICA=1:MODE:SIZE@STEP,
plait.features.faults), once with the check (the default) and once with --parallel.contribution_check=false;
each over the seeds (run.seed). And per mode, the check at equal samples ("equal"): a group left out costs the step
its share, which goes back in the queue (plait.engine.ledger), so at --steps the run has trained a third fewer
samples; this run takes the steps that train as many samples as the fault-free run with the honest groups alone
(--bad-from - 1 + (--steps - --bad-from + 1) x 3/2: the honest groups' compute is the fault-free run's), its
cosine schedule over them. Its samples trained are counted (replicas/trained) and reported.

The curves are train/loss: every group logs the same one, the committed step's loss averaged over the groups'
batches (the bad group's batch loss is honest: only its gradient is made bad). The "final" loss is the held-out loss
after the last step (--eval-batches batches, the same for every run): a train loss of the last steps is one batch's,
and a run that leaves a group out has moved on to other batches than the fault-free run by then. A run that stops
early (a NaN without the check: every step non-finite, the guard gives up after guard.max_consecutive_failures) has
no final loss; its last step is reported. A run that fails to start (no step logged: e.g. a busy machine's port or
timeout) is tried once more, and --resume reruns only the missing or unstarted runs of an earlier --out (the wall
time adds up). Named and left out: replicas/excluded, per step from --bad-from on where group 1 took part
(replicas/groups is 3), read from every group's metrics; and clipped (replicas/clipped: a norm 4x to 32x the median
is scaled down to 4x and kept); any other id left out or clipped anywhere (or anything in a fault-free run) is a
false positive.

Printed: a table per mode; written to --out, with a plot of the loss curves (mean over seeds, band min..max) beside
it (.png).
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

RUN = ["model.preset=debug", "data.seq_len=32", "train.global_batch_size=8", "optim.warmup_steps=2",
       "log.every_steps=1", "log.tensorboard=false", "log.plot=false",
       "sample.max_new_tokens=0", "data.prefetch=0", "run.device=cpu", "run.health_check_enabled=false",
       "checkpoint.save_final=false", "checkpoint.every_steps=0", "lineage.enabled=false"]  # fmt: skip
BAD = 1  # the bad group's replica id


def equal_steps(args, groups: int = 3) -> int:
    """The steps in which the honest groups alone train the fault-free run's samples (see the docstring)."""
    return args.bad_from - 1 + -(-(args.steps - args.bad_from + 1) * groups // (groups - 1))


def launch(
    data: Path,
    scratch: Path,
    name: str,
    seed: int,
    args,
    fault: str = "",
    check: bool = True,
    groups: int = 3,
    length: int = 0,
) -> dict:
    """One run of `groups` groups: its loss per step, each step's (groups, excluded) and samples trained, the
    check's reasons (from the log), its exit status and wall time."""
    steps_n = length or args.steps
    settings = [*RUN, f"data.source={data}", f"train.steps={steps_n}", f"run.seed={seed}",
                f"eval.every_steps={steps_n}", f"eval.num_batches={args.eval_batches}",
                f"run.out_dir={scratch}", f"run.name={name}"]  # fmt: skip
    if not check:
        settings.append("parallel.contribution_check=false")
    flags = [f"--{s}" for s in settings]
    cmd = [sys.executable, "-m", "plait.cli", "train", "--replicas", str(groups), "--nproc", "1", *flags]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PLAIT_CALLBACKS"] = "plait.features.faults:from_environment"
    if fault:
        env["PLAIT_FAULT_BAD_REPLICA"] = f"{BAD}:{fault}@{args.bad_from}"
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    seconds = time.perf_counter() - start
    loss: dict[int, float] = {}
    val: dict[int, float] = {}
    steps: dict[int, tuple[int, str]] = {}
    trained: dict[int, int] = {}
    for i in range(groups):
        path = scratch / name / f"replica_{i}" / "metrics.jsonl"
        for r in [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []:
            if "train/loss" in r:
                loss[r["step"]] = r["train/loss"]
            if "val/loss" in r:
                val[r["step"]] = r["val/loss"]
            if "replicas/groups" in r:
                steps[r["step"]] = (r["replicas/groups"], r.get("replicas/excluded", ""), r.get("replicas/clipped", ""))
                trained[r["step"]] = r["replicas/trained"]
    shutil.rmtree(scratch / name, ignore_errors=True)
    first_error = next((line for line in done.stderr.splitlines() if "error:" in line), "")
    verdicts = {}  # step -> the check's line ("contributions: 2 of 3 admitted; left out: replica 1 (why)")
    for line in done.stderr.splitlines():
        if "left out:" in line and ", step " in line:
            step, _, why = line.partition(", step ")[2].partition(": ")
            verdicts.setdefault(int(step), why)
    return {"rc": done.returncode, "seconds": seconds, "loss": {s: loss[s] for s in sorted(loss)}, "val": val,
            "steps": {s: steps[s] for s in sorted(steps)}, "error": first_error[:300], "train_steps": steps_n,
            "trained": {s: trained[s] for s in sorted(trained)},
            "verdicts": dict(sorted(verdicts.items())[:30])}  # fmt: skip


def final(run: dict, args) -> float | None:
    """The held-out loss after the last step; None for a run that did not reach it."""
    return run["val"].get(run.get("train_steps", args.steps))


def exclusions(run: dict, args, bad: int | None) -> dict:
    """Of the steps from --bad-from on where the bad group took part: how many left it out, and how many only
    clipped it (its norm bounded, still in the average); and the steps that left out or clipped another group
    (false positives; with no bad group, any). A run without the check has neither (its steps say nothing)."""
    only = [str(bad)]
    steps = run["steps"].items()
    bad_steps = [(ex, cl) for s, (g, ex, cl) in steps if bad is not None and s >= args.bad_from and g == 3]
    named = sum(ex.split(",") == only for ex, _ in bad_steps)
    clipped = sum(cl.split(",") == only and not ex for ex, cl in bad_steps)
    false = sorted(s for s, (_, ex, cl) in steps if any(x and (bad is None or x.split(",") != only) for x in (ex, cl)))
    return {"bad_steps": len(bad_steps), "named": named, "clipped": clipped, "false_positive_steps": false}


def one(
    runs: dict, key: str, data: Path, scratch: Path, seed: int, args, fault="", check=True, groups=3, steps=0
) -> None:
    """Run `key` unless --resume brought it; a run that failed to start (no step logged) is tried once more."""
    if runs.get(key, {}).get("loss"):
        return
    name = key.replace(" ", "_").replace(":", "-")
    got = launch(data, scratch, name, seed, args, fault, check, groups, steps)
    if not got["loss"] and got["rc"]:
        print(f"{key}: failed to start (rc {got['rc']}: {got['error'] or 'no error line'}); once more", flush=True)
        got = launch(data, scratch, name, seed, args, fault, check, groups, steps)
    runs[key] = got
    f = final(got, args)
    stop = f"final {f:.3f}" if f is not None else f"stopped at step {max(got['loss'], default=0)} (rc {got['rc']})"
    ex = exclusions(got, args, BAD if fault else None)
    print(f"{key}: {stop}, left out on {ex['named']}/{ex['bad_steps']} bad steps, clipped on {ex['clipped']}, "
          f"false positives "
          f"{len(ex['false_positive_steps'])} ({got['seconds']:.0f} s)", flush=True)  # fmt: skip


def resumed(path: str) -> tuple[dict, float]:
    """The runs and wall time of an earlier --out (JSON's keys are strings: the steps are made ints again)."""
    if not path:
        return {}, 0.0
    record = json.loads(Path(path).read_text())
    runs = {
        key: {**r, "loss": {int(s): v for s, v in r["loss"].items()},
              "steps": {int(s): (*v, "")[:3] for s, v in r["steps"].items()},
              "trained": {int(s): v for s, v in r.get("trained", {}).items()}
              or {int(s): v[0] * 8 for s, v in r["steps"].items()},  # runs of before the ledger left none out
              "val": {int(s): v for s, v in r["val"].items()}}
        for key, r in record["runs"].items()
    }  # fmt: skip
    return runs, record["wall_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="scale:100,noise:10,noise:100,flip:1,flip:100,nan")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--bad-from", type=int, default=5)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--out", default="bench/results/replicas_bad.json")
    ap.add_argument("--resume", default="", help="an earlier --out: keep its runs, run those missing or not started")
    args = ap.parse_args()
    from plait.data import ensure_prepared

    modes, seeds, out = args.modes.split(","), [int(s) for s in args.seeds.split(",")], Path(args.out)
    scratch = Path(tempfile.mkdtemp(prefix="plait-replicas-bad-"))
    data = ensure_prepared("shakespeare", scratch / "corpus", 4096)
    runs, before = resumed(args.resume)
    start = time.perf_counter() - before
    try:
        for seed in seeds:
            one(runs, f"fault-free s{seed}", data, scratch, seed, args)
        for seed in seeds:  # the honest groups alone: what a run that leaves the bad group out can reach
            one(runs, f"two groups s{seed}", data, scratch, seed, args, groups=2)
        for seed in seeds:  # ... and at the steps of the equal-samples runs: what those can reach
            one(runs, f"two groups equal s{seed}", data, scratch, seed, args, groups=2, steps=equal_steps(args))
        for mode in modes:
            for check in (True, False):
                for seed in seeds:
                    key = f"{mode} {'check' if check else 'nocheck'} s{seed}"
                    one(runs, key, data, scratch, seed, args, mode, check)
            for seed in seeds:
                one(runs, f"{mode} equal s{seed}", data, scratch, seed, args, mode, steps=equal_steps(args))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report(args, modes, seeds, runs, out, time.perf_counter() - start)


def spread(values: list[float | None]) -> dict:
    got = [v for v in values if v is not None]
    if not got:
        return {"mean": None, "sd": None, "min": None, "max": None, "finished": 0}
    sd = statistics.stdev(got) if len(got) > 1 else 0.0
    return {"mean": statistics.fmean(got), "sd": sd, "min": min(got), "max": max(got), "finished": len(got)}


def report(args, modes: list[str], seeds: list[int], runs: dict, out: Path, wall: float) -> None:
    free = spread([final(runs[f"fault-free s{s}"], args) for s in seeds])
    free["samples"] = statistics.fmean(sum(runs[f"fault-free s{s}"]["trained"].values()) for s in seeds)
    two = spread([final(runs[f"two groups s{s}"], args) for s in seeds])
    two_equal = spread([final(runs[f"two groups equal s{s}"], args) for s in seeds])
    free_fp = sum(len(exclusions(runs[f"fault-free s{s}"], args, None)["false_positive_steps"]) for s in seeds)
    rows = {}
    for mode in modes:
        row: dict = {}
        for arm in ("check", "nocheck", "equal"):
            each = [runs[f"{mode} {arm} s{s}"] for s in seeds]
            ex = [exclusions(r, args, BAD) for r in each]
            row[arm] = {**spread([final(r, args) for r in each]),
                        "named": sum(e["named"] for e in ex), "bad_steps": sum(e["bad_steps"] for e in ex),
                        "clipped": sum(e["clipped"] for e in ex),
                        "false_positive_steps": sum(len(e["false_positive_steps"]) for e in ex),
                        "last_step": [max(r["loss"], default=0) for r in each],
                        "samples": statistics.fmean(sum(r["trained"].values()) for r in each),
                        "rc": [r["rc"] for r in each]}  # fmt: skip
        c = row["check"]["mean"]
        row["check_within_spread"] = c is not None and free["min"] <= c <= free["max"]
        row["check_minus_free"] = None if c is None else c - free["mean"]
        row["check_within_two_group_spread"] = c is not None and two["min"] <= c <= two["max"]
        e = row["equal"]["mean"]
        row["equal_minus_free"] = None if e is None else e - free["mean"]
        row["equal_within_spread"] = e is not None and free["min"] <= e <= free["max"]
        row["equal_not_above_spread"] = e is not None and e <= free["max"]
        row["equal_within_two_group_spread"] = e is not None and two_equal["min"] <= e <= two_equal["max"]
        n = row["nocheck"]["mean"]
        row["nocheck_minus_free"] = None if n is None or row["nocheck"]["finished"] < len(seeds) else n - free["mean"]
        rows[mode] = row
    table(args, seeds, free, two, two_equal, free_fp, rows, wall)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"steps": args.steps, "equal_steps": equal_steps(args), "bad_from": args.bad_from,
              "eval_batches": args.eval_batches, "seeds": seeds,
              "groups": 3, "bad_replica": BAD, "fault_free": {**free, "false_positive_steps": free_fp},
              "two_groups": two, "two_groups_equal_steps": two_equal, "rows": rows, "wall_s": wall, "runs": runs,
              "machine": host.describe()}  # fmt: skip
    out.write_text(json.dumps(record, indent=1))
    plot(runs, modes, seeds, out.with_suffix(".png"), args)
    print(f"written to {out} and {out.with_suffix('.png')}")


def table(
    args, seeds: list[int], free: dict, two: dict, two_equal: dict, free_fp: int, rows: dict, wall: float
) -> None:
    print(f"\n3 groups x 1 process, debug model, {args.steps} steps ({equal_steps(args)} at equal samples), group "
          f"{BAD} bad from step {args.bad_from}, seeds {seeds}; final = held-out loss after the last step "
          f"({args.eval_batches} batches); samples = sequences trained (in an admitted share); "
          f"wall {wall:.0f} s")  # fmt: skip
    print(f"fault-free: {free['mean']:.3f} +- {free['sd']:.3f} (min {free['min']:.3f}, max {free['max']:.3f}), "
          f"{free['samples']:.0f} samples; steps with a group left out or clipped: {free_fp}")  # fmt: skip
    print(f"2 honest groups alone (16 sequences a step, as the check leaves): {two['mean']:.3f} +- {two['sd']:.3f} "
          f"(min {two['min']:.3f}, max {two['max']:.3f}); at {equal_steps(args)} steps {two_equal['mean']:.3f} +- "
          f"{two_equal['sd']:.3f} (min {two_equal['min']:.3f}, max {two_equal['max']:.3f})")  # fmt: skip
    print(f"{'mode':<10} {'left out/bad':>13} {'clip':>4} {'f+':>3} {'check':>6} {'- free':>7} {'samples':>7} "
          f"{'equal':>6} {'- free':>7} {'samples':>7} {'within':>6} {'no check':>9} {'- free':>7}")  # fmt: skip
    for mode, r in rows.items():
        c, n, e = r["check"], r["nocheck"], r["equal"]
        if n["finished"] < len(seeds):
            nf, nd = f"stop@{max(n['last_step'])}", "-"
        else:
            nf, nd = f"{n['mean']:.3f}", f"{r['nocheck_minus_free']:+.3f}"

        def num(x: float | None, fmt: str) -> str:
            return "-" if x is None else format(x, fmt)

        within = "yes" if r["equal_within_spread"] else "below" if r["equal_not_above_spread"] else "no"
        print(f"{mode:<10} {c['named']:>6}/{c['bad_steps']:<6} {c['clipped']:>4} "
              f"{c['false_positive_steps'] + e['false_positive_steps']:>3} {num(c['mean'], '.3f'):>6} "
              f"{num(r['check_minus_free'], '+.3f'):>7} {c['samples']:>7.0f} {num(e['mean'], '.3f'):>6} "
              f"{num(r['equal_minus_free'], '+.3f'):>7} {e['samples']:>7.0f} {within:>6} {nf:>9} {nd:>7}")  # fmt: skip


def curve(run: dict) -> tuple[list[int], list[float]]:
    """A run's train loss against the samples trained up to each step (a left-out share counts when retrained)."""
    total, xs, ys = 0, [], []
    for step in sorted(run["loss"]):
        total += run["trained"].get(step, 0)
        if run["loss"][step] == run["loss"][step]:  # finite (NaN != NaN)
            xs.append(total)
            ys.append(run["loss"][step])
    return xs, ys


def plot(runs: dict, modes: list[str], seeds: list[int], path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(len(modes), 3)
    rows = -(-len(modes) // cols)
    fig, grid = plt.subplots(rows, cols, figsize=(4 * cols, 3.4 * rows), sharey=True, sharex=True, squeeze=False)
    axes = list(grid.flat)
    for spare in axes[len(modes) :]:
        spare.set_visible(False)
    arms = (("fault-free", "fault-free {s}", "tab:grey"),
            (f"check, {args.steps} steps", "{m} check {s}", "tab:blue"),
            (f"check, {equal_steps(args)} steps (equal samples)", "{m} equal {s}", "tab:purple"),
            ("without check", "{m} nocheck {s}", "tab:red"))  # fmt: skip
    for ax, mode in zip(axes, modes, strict=False):
        for label, key, colour in arms:
            for i, s in enumerate(seeds):
                xs, ys = curve(runs[key.format(m=mode, s=f"s{s}")])
                ax.plot(xs, ys, color=colour, label=label if i == 0 else None, linewidth=0.8, alpha=0.7)
        held = []
        for label, key, _ in arms:
            got = [final(runs[key.format(m=mode, s=f"s{s}")], args) for s in seeds]
            held.append(f"{label.split(',')[0]}{' =' if 'equal' in key else ''}: " + (
                "stopped" if None in got else f"{statistics.fmean(got):.3f}"))  # fmt: skip
        ax.text(0.97, 0.97, "held-out at the end\n" + "\n".join(held), transform=ax.transAxes, fontsize=7,
                ha="right", va="top")  # fmt: skip
        ax.set(title=f"group {BAD}: {mode}", xlabel="sequences trained")
    axes[0].set(ylabel="train loss (each seed)")
    axes[0].set_ylim(top=9.5)
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"A bad replica group among 3 (from step {args.bad_from}), seeds {seeds}: loss by samples trained")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
