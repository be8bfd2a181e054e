"""Golden loss curves: today's training compared with yesterday's, not only layouts with each other.

A few deterministic runs (one process, FSDP 2, TP 2 with SP, a 1F1B pipeline of 2, a mixture of experts with
EP 2, CP 2 with document masking, and compiled blocks) train 20 steps of the debug model on the bundled corpus,
one thread per rank. Their loss and gradient norm at every step, and their peak memory, are stored in
tests/golden/curves.json and checked here. A change that alters training (an init scale, RMSNorm's eps moved by
1%, a reduction order) fails this test; a change meant to alter it regenerates the curves on purpose:

    python tests/parallel/test_golden.py --write      # then review `git diff tests/golden/curves.json`

The runs use plait's own trainer in real gloo process groups (tests/parallel_harness.py).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parents[1] / "golden" / "curves.json"
STEPS = 20

LOSS_ATOL = 2e-6
"""Two float32 ulps of a loss near 8 (ulp 9.5e-7). The runs are deterministic on one machine and torch (CPU
kernels, one thread per rank, gloo's fixed reduction order): the same commit gives the same bits. A 1% change of
RMSNorm's eps moves the debug model's loss by 4e-6 to 1e-5 within 20 steps (test below), so the tolerance can
be no looser. Another CPU (other vector kernels) may differ by a few ulps: regenerate there, and say so."""
GRAD_NORM_RTOL = 1e-6
"""The gradient norm, relative: the same reasoning (RMSNorm's eps moved by 1% moves it by 3e-6)."""
MEM_RTOL = 0.3
"""Peak resident memory of rank 0 (the process's RSS on the CPU): it counts the interpreter and every library
imported, which another environment changes by tens of MB, so it guards against gross regressions (a leaked
copy of the model or of a batch), not against bytes."""

COMMON = [
    "model.preset=debug",
    "model.n_layers=2",
    "data.seq_len=32",
    "train.global_batch_size=8",
    f"train.steps={STEPS}",
    "optim.warmup_steps=2",
    "optim.lr=1e-3",
    "eval.every_steps=0",
    "log.every_steps=1",
    "sample.max_new_tokens=0",
    "checkpoint.save_final=false",
    "checkpoint.every_steps=0",
    "log.tensorboard=false",
    "log.plot=false",
    "data.prefetch=0",
    "run.device=cpu",
]
MOE = ["model.preset=moe-debug", "model.ffn_hidden_dim=0", "model.n_layers=2"]
CONFIGS: dict[str, tuple[int, list[str]]] = {  # name: (world size, overrides)
    "one process": (1, []),
    "compiled": (1, ["compile.enabled=true"]),
    "FSDP 2": (2, ["parallel.dp_shard_degree=2"]),
    "TP 2": (2, ["parallel.tp_degree=2", "parallel.dp_shard_degree=1"]),
    "PP 2": (2, ["parallel.pp_degree=2", "parallel.dp_shard_degree=1", "parallel.pp_schedule=1f1b"]),
    "MoE EP 2": (2, [*MOE, "parallel.dp_shard_degree=2", "parallel.ep_degree=2"]),
    "CP 2, document mask": (2, ["parallel.cp_degree=2", "parallel.dp_shard_degree=1", "data.document_mask=true"]),
}


def run_all(data_dir: Path) -> dict[str, dict]:
    """Every configuration's curves: {name: {loss: [...], grad_norm: [...], mem_peak_gib: float}}."""
    from parallel_harness import run_layouts

    curves: dict[str, dict] = {}
    for world in sorted({w for w, _ in CONFIGS.values()}):
        names = [n for n, (w, _) in CONFIGS.items() if w == world]
        jobs = [[*COMMON, f"data.source={data_dir}", *CONFIGS[n][1]] for n in names]
        for name, got in zip(names, run_layouts(world, jobs), strict=True):
            steps = range(1, STEPS + 1)
            curves[name] = {
                "loss": [got["loss"][s] for s in steps],
                "grad_norm": [got["grad_norm"][s] for s in steps],
                "mem_peak_gib": max(got["train/mem_peak_gib"].values()),
            }
    return curves


def differences(golden: dict, got: dict) -> list[str]:
    """What differs beyond the tolerances, one line each (empty: the curves hold)."""
    out = []
    for name, want in golden["curves"].items():
        have = got.get(name)
        if have is None:
            out.append(f"{name}: not run")
            continue
        for step, (a, b) in enumerate(zip(want["loss"], have["loss"], strict=True), 1):
            if abs(a - b) > LOSS_ATOL:
                out.append(f"{name}: step {step} loss {b!r}, golden {a!r} (|diff| {abs(a - b):.2e} > {LOSS_ATOL})")
                break
        for step, (a, b) in enumerate(zip(want["grad_norm"], have["grad_norm"], strict=True), 1):
            if not math.isclose(a, b, rel_tol=GRAD_NORM_RTOL):
                out.append(f"{name}: step {step} grad norm {b!r}, golden {a!r}")
                break
        if not math.isclose(want["mem_peak_gib"], have["mem_peak_gib"], rel_tol=MEM_RTOL):
            out.append(f"{name}: peak memory {have['mem_peak_gib']:.3f} GiB, golden {want['mem_peak_gib']:.3f}")
    return out


@pytest.fixture(scope="module")
def golden() -> dict:
    if not GOLDEN.is_file():
        pytest.fail(f"{GOLDEN} is missing: write it with `python tests/parallel/test_golden.py --write`")
    return json.loads(GOLDEN.read_text())


def test_training_follows_the_golden_curves(golden, data_dir):
    """Every configuration's 20 steps: loss and gradient norm within their tolerances, peak memory near."""
    assert set(golden["curves"]) == set(CONFIGS), "the stored curves are of other configurations: regenerate them"
    problems = differences(golden, run_all(data_dir))
    assert not problems, (
        "training changed:\n" + "\n".join(problems) + "\n(on purpose? python tests/parallel/test_golden.py --write)"
    )


def test_a_one_percent_change_of_rmsnorms_eps_fails_the_check(golden, data_dir):
    """The check can fail: the one-process run with RMSNorm's eps moved by 1% (1e-5 -> 1.01e-5) is caught."""
    from parallel_harness import run_layouts

    [got] = run_layouts(1, [[*COMMON, f"data.source={data_dir}", "model.norm_eps=1.01e-5"]])
    steps = range(1, STEPS + 1)
    moved = {"loss": [got["loss"][s] for s in steps], "grad_norm": [got["grad_norm"][s] for s in steps]}
    moved["mem_peak_gib"] = golden["curves"]["one process"]["mem_peak_gib"]
    only = {"curves": {"one process": golden["curves"]["one process"]}}
    assert differences(only, {"one process": moved}), "a 1% change of norm_eps went unnoticed"


def _write() -> None:
    """Run every configuration and store its curves (the one command that changes them on purpose)."""
    import tempfile

    import torch

    from plait.data import ensure_prepared

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = ensure_prepared("shakespeare", Path(tmp) / "shakespeare-cache", 4096)
        curves = run_all(data_dir)
    record = {
        "about": "tests/parallel/test_golden.py: 20 steps of each configuration; regenerate with "
        "`python tests/parallel/test_golden.py --write` and review the diff",
        "torch": torch.__version__,
        "configs": {name: {"world": w, "overrides": o} for name, (w, o) in CONFIGS.items()},
        "curves": curves,
    }
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {GOLDEN}: {', '.join(curves)}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/parallel/test_golden.py --write   (runs every configuration, stores its curves)")
    sys.path.insert(0, str(Path(__file__).parents[1]))  # parallel_harness, as under pytest
    _write()
