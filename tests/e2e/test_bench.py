"""`plait bench` on a tiny eager model: the JSON it writes, the table it prints, and its refusals.
(Its compile path, cold vs warm start, shares plait.engine.compile_cache with tests/parallel/test_compile.py.)"""

import json
import statistics

import pytest

from plait.cli import main


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A small prepared corpus (a 300-token vocabulary trains in well under a second)."""
    root = tmp_path_factory.mktemp("corpus")
    text = "First Citizen: Before we proceed any further, hear me speak.\nAll: Speak, speak.\n"
    for i in range(8):
        (root / f"doc{i}.txt").write_text(text * (20 + i))
    out = root / "prepared"
    assert main(["data", "prepare", str(root), "--out", str(out), "--vocab-size", "300"]) == 0
    return out


def test_bench_reports_throughput_mfu_breakdown_and_memory(data_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    vocab = json.loads((data_dir / "manifest.json").read_text())["vocab_size"]
    args = [
        "bench",
        "--model.preset=debug",
        "--model.n_layers=2",
        f"--model.vocab_size={vocab}",
        "--data.seq_len=32",
        "--train.global_batch_size=4",
        f"--data.source={data_dir}",
        "--run.device=cpu",
        "--steps",
        "3",
        "--warmup=1",
        f"--json={out}",
        f"--profile={tmp_path / 'profile'}",
    ]
    assert main(args) == 0
    r = json.loads(out.read_text())
    assert r["steps"] == 3 and r["warmup"] == 1 and r["seq_len"] == 32 and r["global_batch_size"] == 4
    assert r["tokens_per_s"] == pytest.approx(4 * 32 / r["step_time_s"])
    assert r["mfu"] == pytest.approx(r["flops_per_step"] / r["step_time_s"] / r["peak_flops"])
    assert 0 < r["mfu"] < 1 and r["peak_source"]
    b = r["breakdown_s"]
    assert b["communication_exposed"] == 0.0 and b["compute"] > 0 and b["optimizer"] > 0 and b["data"] >= 0
    assert r["memory"]["mem_peak_gib"] > 0
    plan = r["memory"]["planner"]  # the planner's prediction beside the measured peak
    assert 0 < plan["allocated_gib"] < plan["total_gib"]
    assert r["first_step"]["from_process_start_s"] >= r["first_step"]["from_build_s"] > 0
    assert r["compile"] is None and "warm_start" not in r
    assert r["precision"] == "fp32"
    prof = r["profile"]  # three more steps under torch's profiler, after every timed pass
    assert prof["steps"] == 3 and prof["wall_per_step_s"] > 0 and "aten::mm" in prof["top_cpu_ops_s_per_step"]
    assert {p.name for p in (tmp_path / "profile").iterdir()} == {
        "profile_table.txt",
        "trace.json.gz",
        "startup_stacks.json",
    }
    assert (
        set(prof["startup"]) == {"model_build", "first_step"}
        and "aten::mm" in (tmp_path / "profile" / "profile_table.txt").read_text()
    )
    printed = capsys.readouterr().err
    assert "tokens/s" in printed and "MFU" in printed and "exposed communication" in printed
    assert "profile (3 steps" in printed and "most CPU time: aten::" in printed


def test_cpu_peak_counts_the_widest_vector_unit():
    """MFU's denominator on a CPU: AVX-512 issues 64 fp32 FLOPs a cycle, not AVX2's 32 (counting 32 on an
    AVX-512 Xeon put the default job at 106% MFU); the figure must stay above a large matmul's measured rate
    on this machine's own flags and clock (within a turbo the kernel may not show: 50% above its reported
    clock; a 2-core AVX-512 VM: 301-331 GFLOP/s measured, 294 estimated, 147 when counted as AVX2)."""
    import time

    import torch

    from plait.core.hardware import _cpu_peak_fp32, cpu_peak

    assert cpu_peak({"sse2", "avx", "avx2", "fma", "avx512f"}, 2000.0, 4)[0] == 4 * 2e9 * 64
    assert cpu_peak({"avx", "avx2", "fma"}, 2000.0, 4)[0] == 4 * 2e9 * 32
    assert cpu_peak({"asimd"}, 3000.0, 1) == (3e9 * 16, "estimated fp32 peak: 1 core(s) x 3.00 GHz x 16 FLOPs/cycle "
                                              "(NEON: four 4-wide FMA units)")  # fmt: skip
    assert cpu_peak(set(), 1000.0, 1)[1].endswith("(assumed)")
    peak, _ = _cpu_peak_fp32()
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    start = time.perf_counter()
    a @ b
    assert 2 * 2048**3 / (time.perf_counter() - start) < 1.5 * peak


@pytest.mark.parametrize(
    "args,message",
    [
        (["--parallel.tp_degree=2"], "plait bench runs one process"),
        (["--steps", "many"], "argument --steps: invalid int value: 'many'"),
        (["--steps=0"], "need --steps >= 1"),
        ([f"--profile={__file__}"], "test_bench.py is a file; give a directory for the profile's files"),
    ],
)
def test_bench_refusals(args, message, capsys):
    assert main(["bench", "--model.preset=debug", *args]) == 2
    assert message in capsys.readouterr().err


def test_bench_help_lists_its_flags(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--steps N" in out and "--warmup W" in out and "--json PATH" in out and "--compile.enabled" in out


def _gpu_session():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "gpu_session.py"
    spec = importlib.util.spec_from_file_location("gpu_session", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.full
def test_gpu_session_steps_would_start_on_the_device(tmp_path):
    """The GPU sessions' runbook (bench/gpu_session.py) spends scarce device time: every plait step's settings
    validate, every script accepts its arguments, the test selection selects something, and each part's
    estimates fit one device call."""
    session = _gpu_session()
    parts = session.parts(tmp_path / "peers")
    assert sorted(parts) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    for number, steps in parts.items():
        assert session.check(steps, tmp_path) == [], f"part {number}"
        assert session.critical_path_s(steps) <= session.CALL_LIMIT_S, f"part {number}"
    # the check can fail: a setting plait refuses is reported with the step's name
    bad = session.plait_step("bad", "bench", ["--data.seq_len=32768"], [], 1)
    assert "bad: data.seq_len=32768 is longer than the model supports" in session.check([bad], tmp_path)[0]


def _bench_script(name: str):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_moe_peers_merge_into_one_table_against_the_faster_transformers_side(tmp_path, capsys):
    """bench/gpu_session.py part 6 runs each MoE side in its own step; --merge puts them in one table with
    each side's ratio to the faster of the two transformers sides, and refuses records of different devices."""
    peers = _bench_script("gpu_peers")

    def record(side, tokens, device="NVIDIA H200"):
        path = tmp_path / f"{side}.json"
        side_record = {"tokens_per_s": tokens, "mfu": 0.1, "peak_gib": 1.0, "first_step_s": 9.0}
        rec = {"device": device, "torch": "2.11", "moe_shape": "qwen3-moe-2.8b", "sides": {side: side_record}}
        path.write_text(json.dumps(rec))
        return path

    files = [record("plait-moe", 300.0), record("hf-moe-bf16", 200.0), record("hf-moe", 100.0)]
    assert peers.merge([*files, tmp_path / "absent.json"], tmp_path / "all.json") == 0
    rows = {line.split()[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines() if "x" in line}
    assert rows["plait-moe"] == "1.500x" and rows["hf-moe"] == "0.500x", rows
    assert set(json.loads((tmp_path / "all.json").read_text())["sides"]) == {"plait-moe", "hf-moe-bf16", "hf-moe"}
    assert peers.merge([*files, record("bare-moe", 1.0, device="NVIDIA H100")], tmp_path / "x.json") == 2
    assert "different devices" in capsys.readouterr().err


@pytest.mark.full
def test_moe_peers_run_on_the_cpu_with_plaits_parameter_count():
    """Every MoE side (plait, transformers' Qwen3-MoE and Mixtral in both precisions, the hand-written grouped
    loop) runs tiny and eager on this CPU, and each peer's model has exactly plait's parameter count."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "bench/gpu_peers.py", "--family", "moe", "--check"], cwd=root, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.stdout.count(" ok ") == 10, proc.stdout


def test_float8_loss_reads_each_recipes_gap_to_bf16_from_the_runs(tmp_path, capsys):
    """bench/float8_loss.py (gpu_session part 7) on runs' metrics.jsonl: each recipe's mean loss over the last
    WINDOW steps beside bf16's, the largest gap of the running means, the median tokens/s; a run with too few
    steps is named, not compared."""
    f8 = _bench_script("float8_loss")

    def run(name, losses, tokens_per_s):
        (tmp_path / name).mkdir()
        rows = [
            {"step": i + 1, "train/loss": loss, "train/tokens_per_s": tokens_per_s} for i, loss in enumerate(losses)
        ]
        rows.insert(3, {"step": 3, "val/loss": 9.0})  # other rows are skipped
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    base = [5.0 - 0.01 * i for i in range(60)]
    run("bf16", base, 100.0)
    run("float8-tensorwise", [x + (0.05 if 20 <= i < 40 else 0.02) for i, x in enumerate(base)], 150.0)
    run("float8-rowwise", base[:30], 120.0)
    assert f8.main(["--runs", str(tmp_path), "--json", str(tmp_path / "f8.json")]) == 0
    r = json.loads((tmp_path / "f8.json").read_text())["recipes"]
    assert r["bf16"]["gap_nats"] == 0 and r["bf16"]["tokens_per_s"] == 100.0
    tensorwise = r["float8-tensorwise"]
    assert tensorwise["gap_nats"] == pytest.approx(0.02) and tensorwise["tokens_per_s"] == 150.0
    assert tensorwise["gap_relative"] == pytest.approx(0.02 / statistics.fmean(base[-20:]))
    assert tensorwise["largest_running_gap_nats"] == pytest.approx(0.05)  # steps 21-40: one whole window
    assert "30 steps logged in both runs, 40 needed" in r["float8-rowwise"]["error"]
    assert (tmp_path / "f8.png").exists()
    assert "float8-tensorwise" in capsys.readouterr().out


def test_retrieval_quality_plain_runs_read_the_windows_of_the_retrieval_runs(data_dir):
    """bench/retrieval_quality.py compares a plain model with a retrieval model on the same windows, in training
    and validation: a retrieval window starts every seq_len + chunk tokens, and while `windows_every(chunk)` is
    active the token loader's windows do too (and only then)."""
    from types import SimpleNamespace

    import numpy as np

    from plait.data.loader import TokenDataset
    from plait.data.retrieval import RetrievalDataset

    quality = _bench_script("retrieval_quality")
    data = TokenDataset(data_dir, "train")
    seq_len, chunk = 16, 4
    plain, count = [data.sample(i, seq_len) for i in range(3)], data.num_samples(seq_len)
    with quality.windows_every(chunk):
        assert data.stride(seq_len) == RetrievalDataset.stride(SimpleNamespace(chunk=chunk), seq_len)
        windows = [data.sample(i, seq_len) for i in range(3)]
        assert data.num_samples(seq_len) < count  # fewer windows: chunk - 1 more tokens between them
    assert [data.sample(i, seq_len).tolist() for i in range(3)] == [w.tolist() for w in plain]  # restored
    stream = data.tokens(0, 3 * (seq_len + chunk) + 1)
    for i, window in enumerate(windows):
        start = i * (seq_len + chunk)
        np.testing.assert_array_equal(window, stream[start : start + seq_len + 1])


def test_schedule_sweep_runs_every_combination_of_each_grid_once_after_the_defaults():
    """bench/schedule_sweep.py's grid: ';' joins settings, ',' their values, '|' separate grids; the defaults'
    point comes first (every other is compared with it) and a point two grids share runs once."""
    sweep = _bench_script("schedule_sweep")
    assert sweep.points("") == [()]
    assert sweep.points("optim.lr=1e-3,2e-3;optim.warmup_steps=100|optim.lr=2e-3;optim.warmup_steps=100,30") == [
        (),
        ("optim.lr=1e-3", "optim.warmup_steps=100"),
        ("optim.lr=2e-3", "optim.warmup_steps=100"),
        ("optim.lr=2e-3", "optim.warmup_steps=30"),
    ]
