"""Muon's step against AdamW's on one GPU, from the `plait bench` records of bench/gpu_session.py parts 8 and 9
(llama3-1b compiled, bf16 autocast, seq 2048, micro-batch 4, each pair in one device call): the step time, its
forward+backward and optimizer parts, and Muon's ratio, per global batch; a plot of the parts.

    python bench/muon_gpu.py [--runs bench/results/h200-2026-11-30-part8,bench/results/h200-2026-11-30-part9]
        [--out bench/results/muon_gpu_h200.json]

A record named muon-1b-{adamw,muon}-b{BATCH}.json in a folder pairs with the other optimizer's of the same batch
in the same folder (the same call). Prints a table; writes --out and the plot beside it (.png).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

RUNS = "bench/results/h200-2026-11-30-part8,bench/results/h200-2026-11-30-part9"
NAME = re.compile(r"muon-1b-(adamw|muon)-b(\d+)(?:-\w+)?\.json")


def pairs(folders: list[Path]) -> list[dict]:
    rows = []
    for folder in folders:
        found: dict[int, dict[str, dict]] = {}
        for path in sorted(folder.glob("muon-1b-*.json")):
            m = NAME.fullmatch(path.name)
            if m:
                found.setdefault(int(m.group(2)), {})[m.group(1)] = json.loads(path.read_text())
        for batch, sides in sorted(found.items()):
            if set(sides) != {"adamw", "muon"}:
                continue
            row = {"call": folder.name, "batch": batch, "tokens": batch * sides["adamw"]["seq_len"]}
            for name, r in sides.items():
                b = r["breakdown_s"]
                row[name] = {
                    "step_s": r["step_time_s"],
                    "tokens_per_s": r["tokens_per_s"],
                    "compute_s": b["compute"],
                    "optimizer_s": b["optimizer"],
                    "peak_gib": r["memory"]["mem_peak_gib"],
                    "device": r["device"],
                }
            row["muon_over_adamw"] = row["adamw"]["tokens_per_s"] / row["muon"]["tokens_per_s"]
            row["optimizer_extra_s"] = row["muon"]["optimizer_s"] - row["adamw"]["optimizer_s"]
            row["compute_extra_s"] = row["muon"]["compute_s"] - row["adamw"]["compute_s"]
            rows.append(row)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Muon's extra time a step as a share of AdamW's step, in its two parts, against the 5% goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    x = range(len(rows))
    opt = [100 * r["optimizer_extra_s"] / r["adamw"]["step_s"] for r in rows]
    fwd = [100 * r["compute_extra_s"] / r["adamw"]["step_s"] for r in rows]
    ax.bar(x, opt, color="tab:orange", label="optimizer (Newton-Schulz, momentum)")
    ax.bar(x, fwd, bottom=opt, color="tab:orange", alpha=0.45, label="forward+backward")
    for i, r in enumerate(rows):
        ax.text(i, opt[i] + fwd[i], f"{r['muon_over_adamw']:.3f}x", ha="center", va="bottom", fontsize=8)
    ax.axhline(5, color="grey", linestyle="--", linewidth=1, label="goal: 5%")
    ax.set_xticks(list(x), [f"{r['batch']} x 2048\n({r['call'][-5:]})" for r in rows], fontsize=8)
    ax.set_ylabel("Muon's step over AdamW's, % of AdamW's")
    ax.set_xlabel("global batch (device call)")
    ax.set_title(f"llama3-1b compiled, one {rows[0]['adamw']['device']}: a fixed ~95 ms a step", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=RUNS, help="comma-separated folders of gpu_session results")
    ap.add_argument("--out", type=Path, default=Path("bench/results/muon_gpu_h200.json"))
    a = ap.parse_args()
    folders = [Path(f) for f in a.runs.split(",") if f]
    missing = [str(f) for f in folders if not f.is_dir()]
    if missing:
        print(f"bench/muon_gpu.py: no such folder: {', '.join(missing)}", file=sys.stderr)
        return 2
    rows = pairs(folders)
    if not rows:
        print(f"bench/muon_gpu.py: no AdamW/Muon pair in {a.runs}", file=sys.stderr)
        return 2
    print(f"{'call':<24} {'batch':>9} {'AdamW s':>8} {'Muon s':>8} {'Muon/AdamW':>11} {'+optimizer':>11} "
          f"{'+fwd+bwd':>9}")  # fmt: skip
    for r in rows:
        print(f"{r['call']:<24} {r['batch']:>4}x2048 {r['adamw']['step_s']:>8.3f} {r['muon']['step_s']:>8.3f} "
              f"{r['muon_over_adamw']:>11.3f} {1e3 * r['optimizer_extra_s']:>8.1f} ms "
              f"{1e3 * r['compute_extra_s']:>6.1f} ms")  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    plot(rows, a.out.with_suffix(".png"))
    print(f"written to {a.out} and {a.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
