"""The planner's peak, as it is now, beside the GPU's measured one for each `plait fit` of bench/gpu_session.py
part 4 (the measured figures: a results folder's measured.json). Run on any machine: it imports no CUDA.

    python bench/fit_gpu_table.py bench/results/h200-2026-11-27-part4   # prints the table, writes fit_table.json
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu_session  # noqa: E402
from plait.config import load_config  # noqa: E402
from plait.planner.fit import predict_rank  # noqa: E402

GiB = 2**30


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, help="a results folder with measured.json")
    a = p.parse_args()
    measured = json.loads((a.folder / "measured.json").read_text())
    steps = {s.name: s for s in gpu_session.parts(gpu_session.ROOT / ".peers")[4]}
    rows = []
    for key, got in measured["fits"].items():
        argv = steps[key.split("@")[0]].argv
        world = int(argv[argv.index("--world-size") + 1])
        cfg = load_config(None, [x[2:] for x in argv if x.startswith("--") and "." in x.split("=")[0]])
        want = predict_rank(cfg, world, got["rank"], torch.device("cuda"))["peak"] / GiB
        rows.append(dict(fit=key, rank=got["rank"], measured_gib=got["peak_gib"], planner_gib=round(want, 2),
                         error=round((want - got["peak_gib"]) / got["peak_gib"], 4)))  # fmt: skip
        print(f"{key:26s} rank {got['rank']:5d}  measured {got['peak_gib']:6.2f} GiB  planner {want:6.2f}  "
              f"{rows[-1]['error']:+.1%}")  # fmt: skip
    (a.folder / "fit_table.json").write_text(json.dumps(dict(device=measured["device"], rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
