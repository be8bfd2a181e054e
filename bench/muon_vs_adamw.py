"""Muon against AdamW, measured to a loss: the steps and the wall time each needs to reach AdamW's final held-out
loss, each optimizer at its best peak learning rate from the same sweep, over seeds.

    python bench/muon_vs_adamw.py [--job default|small] [--lrs 1e-3,3e-3,1e-2] [--seeds 0,1,2] [--steps 400]
        [--eval-every 25] [--eval-batches 16] [--time-steps 30] [--out bench/results/muon_vs_adamw_default.json]
    python bench/muon_vs_adamw.py --control [--base bench/results/muon_vs_adamw_default.json]
        [--control-lrs 1e-3,1e-2] [--out bench/results/muon_vs_adamw_control.json]

The job is `plait train`'s default (preset tiny, the bundled corpus, 16 x 256 tokens a step, warm-up 100, cosine
to 10%), `small` (preset small, shorter, for a CPU), or `lora`: a LoRA fine-tune (rank 8 on q, k, v, o) of a base
trained first (the default job for --base-steps steps) on another text, the biographies of bench/facts.py (400
people): the adapters are the only matrices that train, under Muon in Muon's arm (plait.engine.muon.takes_muon
gives them to it) and under AdamW in AdamW's. Phase 1 sweeps the peak learning rate of both optimizers
with seed 0, scored by the held-out loss at the end; phase 2 runs the other seeds at each one's best. The target
is AdamW's mean final held-out loss; the steps to it are read off the seeds' mean held-out curve (every
--eval-every steps, interpolated linearly), and per seed for the spread. The wall time to it is those steps
times the median step time of each optimizer, timed separately (--time-steps steps, after the sweep) so that a
busy machine during the long runs does not skew it. Printed: a table of both, with the spread over seeds, and
the ratio; written to --out, with a plot of the curves beside it (.png).

--control adds the control that should not help as much: Muon without its orthogonalisation
(`optim.muon_ns_steps=0`: the same Nesterov momentum, scaled to the size of Muon's update, in its own direction),
at Muon's best peak and on the same seeds as the --base record, whose AdamW and Muon runs it reads rather than
reruns (the same job, steps and evaluation); any run the --base record holds is read, not rerun, so a control
record can be its own base. --control-lrs adds peaks for the control on the first seed, to tell a control that
does not help from one that is only tuned wrong. If Muon's gain is the orthogonalisation's, the control does not
share it. Its step is not timed (its wall-time columns are left empty): the question is steps and loss.

--runs FILE reads the runs FILE holds (this bench's record, or one with the held-out "curves" of a stopped sweep)
instead of running them again; --save-runs FILE writes the runs so far after each one, for a later --runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import host

JOBS = {
    "default": [],
    "small": ["model.preset=small", "train.global_batch_size=8", "data.seq_len=128", "optim.warmup_steps=20"],
    "lora": ["finetune.lora_rank=8", "train.global_batch_size=8", "data.seq_len=128", "optim.warmup_steps=10"],
}
ARMS = {"adamw": ["optim.name=adamw"], "muon": ["optim.name=muon"],
        "control": ["optim.name=muon", "optim.muon_ns_steps=0"]}  # fmt: skip
COLOURS = {"adamw": "tab:blue", "muon": "tab:orange", "control": "tab:green"}
QUIET = ["sample.max_new_tokens=0", "log.tensorboard=false", "log.plot=false", "checkpoint.save_final=false",
         "checkpoint.every_steps=0", "lineage.enabled=false", "log.every_steps=50"]  # fmt: skip


def lora_job(scratch: Path, args) -> list[str]:
    """The lora job's settings: a base trained first, and the facts' biographies prepared with its tokenizer."""
    import subprocess
    import sys

    from plait.api import train
    from plait.config import load_config
    from plait.data import ensure_prepared

    cfg = load_config(None, [])
    corpus = ensure_prepared("shakespeare", Path(cfg.data.cache_dir).expanduser(), cfg.model.vocab_size)
    train(load_config(None, [*QUIET, f"data.source={corpus}", f"train.steps={args.base_steps}", "run.seed=0",
                             "checkpoint.save_final=true", f"run.out_dir={scratch}", "run.name=base"]))  # fmt: skip
    facts, text = scratch / "facts", scratch / "facts-data"
    here = Path(__file__).parent
    subprocess.run([sys.executable, str(here / "facts.py"), "--out", str(facts), "--people", "400"], check=True)
    subprocess.run([sys.executable, "-m", "plait.cli", "data", "prepare", str(facts / "train.jsonl"), "--out",
                    str(text), "--tokenizer", str(corpus / "tokenizer.json")], check=True)  # fmt: skip
    return [*JOBS["lora"], f"finetune.init_from={scratch / 'base'}", f"data.source={text}"]


def run(job: list[str], name: str, arm: str, lr: float, seed: int, args, out: Path) -> dict:
    """One run's held-out curve {step: loss}, its final loss and its step times."""
    from plait.api import train
    from plait.config import load_config

    cfg = [*job, *QUIET, *ARMS[arm], f"optim.lr={lr}", f"run.seed={seed}", f"train.steps={args.steps}",
           f"eval.every_steps={args.eval_every}", f"eval.num_batches={args.eval_batches}",
           f"run.out_dir={out}", f"run.name={name}"]  # fmt: skip
    start = time.perf_counter()
    final = train(load_config(None, cfg))
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    curve = {r["step"]: r["val/loss"] for r in rows if "val/loss" in r}
    return {"curve": curve, "final": final["val_loss"], "seconds": time.perf_counter() - start}


def step_seconds(job: list[str], optim: str, lr: float, steps: int, out: Path) -> float:
    """The median seconds of a training step (from the run's own step timer), no evaluation."""
    from plait.api import train
    from plait.config import load_config

    name = f"time-{optim}"
    cfg = [*job, *QUIET, *ARMS[optim], f"optim.lr={lr}", f"train.steps={steps}", "eval.every_steps=0",
           "log.every_steps=1",
           f"run.out_dir={out}", f"run.name={name}"]  # fmt: skip
    train(load_config(None, cfg))
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    rates = [r["train/tokens_per_s"] for r in rows if "train/tokens_per_s" in r][3:]  # the first steps warm up
    tokens = next(r["train/tokens"] for r in rows if "train/tokens" in r)  # after the first step: one step's
    return tokens / statistics.median(rates)


def one(runs: dict, job: list[str], arm: str, lr: float, seed: int, args, scratch: Path, phase: str) -> None:
    key = f"{arm} {lr:g} s{seed}"
    if key in runs:  # read from --runs, not rerun
        print(f"{phase}: {arm} lr {lr:g} seed {seed}: {runs[key]['final']:.4f} (read from {args.runs})", flush=True)
        return
    runs[key] = got = run(job, f"{arm}-{lr:g}-s{seed}", arm, lr, seed, args, scratch)
    print(f"{phase}: {arm} lr {lr:g} seed {seed}: {got['final']:.4f} ({got['seconds']:.0f} s)", flush=True)
    if args.save_runs:  # each finished run kept, so that a stopped sweep goes on with --runs
        Path(args.save_runs).write_text(json.dumps({"job": args.job, "steps": args.steps, "runs": runs}, indent=1))


def read_runs(path: str, args) -> dict:
    """The runs a record holds, keyed as `one` keys them: this bench's record ("runs") or a log's ("curves")."""
    record = json.loads(Path(path).read_text())
    if (record["job"], record["steps"]) != (args.job, args.steps):
        raise SystemExit(f"{path}: job {record['job']!r} with {record['steps']} steps, not {args.job!r} with "
                         f"{args.steps}: its runs are not this sweep's")  # fmt: skip
    if "runs" in record:
        return {k: {**r, "curve": {int(s): v for s, v in r["curve"].items()}} for k, r in record["runs"].items()}
    curves = {k: {int(s): v for s, v in c.items()} for k, c in record["curves"].items()}
    return {k: {"curve": c, "final": c[max(c)], "seconds": None} for k, c in curves.items()}


def mean_curve(curves: list[dict]) -> dict:
    """The seeds' mean held-out loss at each evaluated step."""
    return {s: statistics.fmean(c[s] for c in curves) for s in curves[0]}


def steps_to(curve: dict, target: float) -> float | None:
    """The first step the held-out curve reaches `target`, linear between evaluations (None: never)."""
    points = sorted((int(s), v) for s, v in curve.items())
    for (s0, v0), (s1, v1) in zip([(0, float("inf")), *points], points, strict=False):
        if v1 <= target:
            return s1 if v0 == float("inf") else s0 + (v0 - target) / (v0 - v1) * (s1 - s0)
    return None


def summary(values: list[float | None]) -> tuple[float | None, float | None]:
    got = [v for v in values if v is not None]
    if len(got) < len(values) or not got:
        return None, None
    return statistics.fmean(got), (statistics.stdev(got) if len(got) > 1 else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", choices=sorted(JOBS), default="default")
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--time-steps", type=int, default=30)
    ap.add_argument("--base-steps", type=int, default=200, help="the lora job: the base's training steps")
    ap.add_argument("--out", default="")
    ap.add_argument("--control", action="store_true", help="add the control to the --base record's runs")
    ap.add_argument("--base", default="bench/results/muon_vs_adamw_default.json")
    ap.add_argument("--control-lrs", default="", help="more peaks for the control, on the first seed only")
    ap.add_argument("--runs", default="", help="a record whose runs of the same job and steps are read, not rerun")
    ap.add_argument("--save-runs", default="", help="write the runs so far here after each run (for --runs)")
    args = ap.parse_args()
    if args.control:
        return control(args)
    job, lrs = JOBS[args.job], [float(x) for x in args.lrs.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out or f"bench/results/muon_vs_adamw_{args.job}.json")
    scratch = Path(tempfile.mkdtemp(prefix="plait-muon-"))
    runs: dict[str, dict] = read_runs(args.runs, args) if args.runs else {}
    try:
        if args.job == "lora":
            job = lora_job(scratch, args)
        for optim in ("adamw", "muon"):
            for lr in lrs:
                one(runs, job, optim, lr, seeds[0], args, scratch, "sweep")
        best = {o: min(lrs, key=lambda lr, o=o: runs[f"{o} {lr:g} s{seeds[0]}"]["final"]) for o in ("adamw", "muon")}
        for optim, lr in best.items():
            for seed in seeds[1:]:
                one(runs, job, optim, lr, seed, args, scratch, "seed")
        timing = {o: step_seconds(job, o, best[o], args.time_steps, scratch) for o in ("adamw", "muon")}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report(args, seeds, runs, best, timing, out)


def control(args) -> None:
    """The control arm (un-orthogonalised, Muon-sized momentum) at Muon's best peak on the --base record's seeds,
    with that record's AdamW and Muon runs read, not rerun."""
    base = json.loads(Path(args.base).read_text())
    args.job, args.steps = base["job"], base["steps"]
    seeds, rows = base["seeds"], base["rows"]
    runs = {k: {**r, "curve": {int(s): v for s, v in r["curve"].items()}} for k, r in base["runs"].items()}
    best = {o: rows[o]["lr"] for o in ("adamw", "muon")} | {"control": rows["muon"]["lr"]}
    timing = {o: rows[o]["step_seconds"] for o in ("adamw", "muon")} | {"control": None}
    out = Path(args.out or "bench/results/muon_vs_adamw_control.json")
    scratch = Path(tempfile.mkdtemp(prefix="plait-muon-"))
    wanted = [(best["control"], seed) for seed in seeds]
    wanted += [(float(lr), seeds[0]) for lr in args.control_lrs.split(",") if lr and float(lr) != best["control"]]
    try:
        job = JOBS[args.job]
        for lr, seed in wanted:
            if f"control {lr:g} s{seed}" in runs:  # a record that holds it already: read, not rerun
                continue
            if args.job == "lora" and job is JOBS["lora"]:
                args.base_steps = base.get("base_steps", args.base_steps)
                job = lora_job(scratch, args)  # the same base and data as the record's, made again
            one(runs, job, "control", lr, seed, args, scratch, "control")
            got, ref = runs[f"control {lr:g} s{seed}"]["curve"], runs[f"muon {best['muon']:g} s{seeds[0]}"]["curve"]
            assert sorted(got) == sorted(ref), "evaluated at other steps than the base: set --eval-every"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    sweep = {f"{lr:g}": runs[f"control {lr:g} s{seeds[0]}"]["final"] for lr in sorted({lr for lr, _ in wanted})}
    print(f"control, seed {seeds[0]}, final held-out loss by peak lr: {sweep}")
    report(args, seeds, runs, best, timing, out, base=args.base, extra={"control_sweep_seed0": sweep})


def report(
    args, seeds: list[int], runs: dict, best: dict, timing: dict, out: Path, base: str = "", extra: dict | None = None
) -> None:
    finals = {o: [runs[f"{o} {best[o]:g} s{s}"]["final"] for s in seeds] for o in best}
    target = statistics.fmean(finals["adamw"])
    rows = {}
    for o in best:
        curves = [runs[f"{o} {best[o]:g} s{s}"]["curve"] for s in seeds]
        per_seed = [steps_to(c, target) for c in curves]  # None where that seed never reached the seeds' mean
        mean = steps_to(mean_curve(curves), target)
        rows[o] = {"lr": best[o], "finals": finals[o], "steps_to_target": mean, "per_seed": per_seed,
                   "steps_sd": summary(per_seed)[1], "step_seconds": timing[o],
                   "wall_to_target_s": None if mean is None or timing[o] is None else mean * timing[o]}  # fmt: skip
    print(f"\n{args.job} job, {args.steps} steps, seeds {seeds}; target: AdamW's final held-out loss {target:.4f}")
    head = f"{'optimizer':<8} {'best lr':>8} {'final loss (sd)':>18} {'steps to target':>16} {'per seed':>20}"
    print(f"{head} {'s/step':>7} {'wall s':>7}")
    for o, r in rows.items():
        steps = "never" if r["steps_to_target"] is None else f"{r['steps_to_target']:.0f}"
        per_seed = ",".join("-" if v is None else f"{v:.0f}" for v in r["per_seed"])
        wall = "-" if r["wall_to_target_s"] is None else f"{r['wall_to_target_s']:.0f}"
        step_s = "-" if r["step_seconds"] is None else f"{r['step_seconds']:.3f}"
        sd = statistics.stdev(r["finals"]) if len(r["finals"]) > 1 else 0.0
        print(f"{o:<8} {r['lr']:>8g} {statistics.fmean(r['finals']):>11.4f} ({sd:.4f}) {steps:>16} {per_seed:>20} "
              f"{step_s:>7} {wall:>7}")  # fmt: skip
    a, m = rows["adamw"], rows["muon"]
    ratios = {}
    if a["steps_to_target"] and m["steps_to_target"]:
        ratios = {"steps": a["steps_to_target"] / m["steps_to_target"],
                  "wall": a["wall_to_target_s"] / m["wall_to_target_s"],
                  "step_time": m["step_seconds"] / a["step_seconds"]}  # fmt: skip
        print(f"AdamW / Muon: {ratios['steps']:.2f}x the steps, {ratios['wall']:.2f}x the wall time to the target; "
              f"a Muon step takes {ratios['step_time']:.2f}x an AdamW step")  # fmt: skip
    if "control" in rows and a["steps_to_target"] and rows["control"]["steps_to_target"]:
        ratios["control_steps"] = a["steps_to_target"] / rows["control"]["steps_to_target"]
        print(f"AdamW / control: {ratios['control_steps']:.2f}x the steps to the target")
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"job": args.job, "steps": args.steps, "seeds": seeds, "target": target, "rows": rows, "ratios": ratios,
              "runs": runs, "machine": host.describe()} | ({"base": base} if base else {}) | (extra or {})  # fmt: skip
    if args.job == "lora":
        record["base_steps"] = args.base_steps
    out.write_text(json.dumps(record, indent=1))
    plot(runs, best, seeds, target, out.with_suffix(".png"), args.job)
    print(f"written to {out} and {out.with_suffix('.png')}")


def plot(runs: dict, best: dict, seeds: list[int], target: float, path: Path, job: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for o in best:
        colour = COLOURS[o]
        for i, s in enumerate(seeds):
            curve = sorted((int(k), v) for k, v in runs[f"{o} {best[o]:g} s{s}"]["curve"].items())
            label = f"{o} lr {best[o]:g}" if i == 0 else None
            ax.plot(*zip(*curve, strict=True), color=colour, alpha=0.8, label=label)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="AdamW's final (target)")
    arms = "Muon vs AdamW" + (" vs control (no orthogonalisation)" if "control" in best else "")
    title = f"{arms}, {job} job, seeds {seeds}"
    ax.set(xlabel="step", ylabel="held-out loss", title=title)
    ax.set_ylim(top=min(ax.get_ylim()[1], target + 1.5))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
