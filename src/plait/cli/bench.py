"""`plait bench`: measure one configuration in one process.

    plait bench [CONFIG.toml] [--section.key=value ...] [--steps N] [--warmup W] [--json PATH] [--no-warm-run]
                [--profile DIR]

The job is built exactly as `plait train` builds it (`build_trainable`, the prefetching loader, `train_step`),
then timed in three parts:

1. the first step, which includes compilation when compile.enabled (the "cold" start);
2. W warm-up steps, then N steps as training runs them, with one device synchronisation at the end of each
   step (on CUDA): tokens/s, step time (the median step; the mean is reported too) and MFU come from this pass;
3. N more steps timed phase by phase, synchronising the device at each boundary (which costs the overlap of
   host and device work, so these phases add up to a little more than pass 2's step): data wait (the time
   `next(loader)` blocks), forward + backward + gradient norm (until the first optimizer's step pre-hook),
   the optimizer (from that hook to the end of the step: AdamW, LR schedule, zero_grad).

Exposed communication is 0 by construction: one process runs no collectives. (Under FSDP on several GPUs it
would be the step time minus this single-process compute estimate; `plait bench` does not launch groups.)

With compile.enabled, the compile cache is a fresh temporary directory (unless compile.cache_dir is set), so
the first step is a true cold start; a second process then builds the same job on that cache and reports its
first step: the warm start a restarted job sees.

With --profile DIR, three more steps run under torch's profiler (plait.core.profiling): its table and Chrome trace
go to DIR, and the results gain where the device's time went by kind of kernel and how long it sat idle; the
model build's and the first step's host time are sampled too (DIR/startup_stacks.json: seconds per area,
Dynamo, AOTAutograd, Inductor, Triton, ..., and per stack).
"""

from __future__ import annotations

import time

_PROCESS_T0 = time.perf_counter()  # before torch is imported: time-to-first-step includes the imports

import contextlib  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from plait.config import Config  # noqa: E402
from plait.core.errors import ConfigError  # noqa: E402
from plait.engine.compile_cache import CompileMonitor  # noqa: E402

DESCRIPTION = """\
Measure a configuration in one process: the first step (with compilation when compile.enabled), then
warm-up steps and timed steps, reported as tokens/s, MFU against the device's dense peak, a step-time
breakdown (data wait / forward+backward / exposed communication / optimizer), peak memory, and, with
compile.enabled, the first step cold vs warm (a second process on the compile cache)."""


PROFILED_STEPS = 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _git_commit() -> str:
    """The checkout's short commit (with '+dirty' when it has changes), or '' outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True)
    except OSError:
        return ""
    if head.returncode:
        return ""
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _precision(cfg: Config, device: torch.device) -> str:
    from plait.core.hardware import uses_bf16

    bf16 = uses_bf16(cfg.train.mixed_precision, device)
    text = "bf16 autocast, fp32 master weights" if bf16 else "fp32"
    from plait.parallel.compile import float8_plan

    return text + (" + float8 matmuls in blocks (torchao)" if float8_plan(cfg.compile, device)[0] else "")


def run_bench(cfg: Config, steps: int, warmup: int, profile_dir: Path | None = None) -> dict:
    """Build and time the job in this process; returns the results (see the module docstring)."""
    from plait.core.hardware import resolve_device
    from plait.data import TokenLoader
    from plait.engine.trainer import build_trainable, train_step
    from plait.lifecycle.finetune import apply_finetune

    t_imports = time.perf_counter()
    device = resolve_device(cfg.run.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # the LR schedule spans exactly the measured steps (and the profiled ones)
    cfg.train.steps = 1 + warmup + 2 * steps + (PROFILED_STEPS if profile_dir is not None else 0)
    if cfg.data.sources:
        raise ConfigError(
            "plait bench times one corpus (data.source); it does not read a mixture: unset data.sources or set "
            "data.source to one of its directories"
        )
    dataset = _dataset(cfg)
    torch.manual_seed(cfg.run.seed)

    # with --profile, where the start-up's host time goes, phase by phase (plait.core.profiling.StackSampler)
    stacks: dict[str, dict] = {}
    sampled = (
        functools.partial(_sampled_into, stacks) if profile_dir is not None else lambda name: contextlib.nullcontext()
    )

    t_build = time.perf_counter()
    with sampled("model_build"):
        compiler = CompileMonitor.start(cfg, device, is_main=True)
        t = build_trainable(cfg, device, on_model=lambda parts: apply_finetune(cfg, parts))  # one process
        _sync(device)
    t_model = time.perf_counter()
    loader = TokenLoader(
        dataset,
        seq_len=cfg.data.seq_len,
        global_batch_size=cfg.train.global_batch_size,
        seed=cfg.run.seed,
        shuffle=cfg.data.shuffle,
        device=device,
        prefetch=cfg.data.prefetch,
    )
    built = time.perf_counter()
    try:
        first_step = _warm_up(t, loader, device, compiler, warmup, sampled)
        times, loss = _timed_steps(t, loader, device, compiler, steps, first_check=2 + warmup)
        # Pass 3: the same steps phase by phase.
        phases = _phase_breakdown(t, loader, device, steps, compiler, first_check=2 + warmup + steps)
        profile = None
        if profile_dir is not None:  # after every timed pass: the profiler's overhead touches no figure above
            from plait.core.profiling import profile_steps

            profile = profile_steps(lambda: train_step(t, *next(loader)), PROFILED_STEPS, device, profile_dir)
            (profile_dir / "startup_stacks.json").write_text(json.dumps(stacks, indent=1) + "\n")
            profile["startup"] = {phase: sampled_phase["areas_s"] for phase, sampled_phase in stacks.items()}
            profile["files"].append("startup_stacks.json")
    finally:
        loader.close()
    marks = dict(imports=t_imports, build=t_build, model=t_model, built=built, first_step=first_step)
    return _results(cfg, device, steps, warmup, times, loss, phases, profile, compiler, marks)


def _dataset(cfg: Config):
    """The train split of the one corpus timed (prepared first if it is not), with a RETRO model's neighbours."""
    from plait.data import TokenDataset, ensure_prepared

    data_dir = ensure_prepared(cfg.data.source, Path(cfg.data.cache_dir).expanduser(), cfg.model.vocab_size)
    if cfg.model.retrieval_ids:  # RETRO: windows with their chunks' neighbours (plait data retrieve)
        from plait.data.retrieval import RetrievalDataset

        m = cfg.model
        return RetrievalDataset(data_dir, "train", chunk=m.retrieval_chunk, k=m.retrieval_k)
    return TokenDataset(data_dir, "train")


def _warm_up(t, loader, device: torch.device, compiler: CompileMonitor, warmup: int, sampled) -> float:
    """The first step (compilation, where on) and `warmup` more; when the first step ended."""
    from plait.engine.trainer import train_step

    x, y = next(loader)
    with sampled("first_step"):
        train_step(t, x, y)
        _sync(device)
    compiler.check(1)
    first_step = time.perf_counter()
    for step in range(warmup):
        x, y = next(loader)
        train_step(t, x, y)
        compiler.check(2 + step)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return first_step


def _timed_steps(t, loader, device: torch.device, compiler: CompileMonitor, steps: int, first_check: int):
    """Pass 2: the loop as training runs it, one device sync per step, at its end (as a logged step has);
    (each step's time, the last loss)."""
    from plait.engine.trainer import train_step

    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = next(loader)
        result = train_step(t, x, y)
        _sync(device)
        times.append(time.perf_counter() - t0)
        compiler.check(first_check + step)
    return times, result.loss.item()


def _results(cfg: Config, device: torch.device, steps: int, warmup: int, times, loss, phases, profile, compiler,
             marks: dict[str, float]) -> dict:  # fmt: skip
    """The report's figures (see the module docstring)."""
    from plait.core.hardware import device_info, memory_stats

    step_time = statistics.median(times)  # robust to a step slowed by another process
    info = device_info(device)
    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
    flops_per_step = cfg.model.flops_per_token(cfg.data.seq_len) * tokens_per_step
    return {
        "device": info.name,
        "device_type": device.type,
        "peak_flops": info.peak_flops,
        "peak_source": info.peak_source,
        "preset_params": cfg.model.num_params(),
        "n_layers": cfg.model.n_layers,
        "dim": cfg.model.dim,
        "seq_len": cfg.data.seq_len,
        "global_batch_size": cfg.train.global_batch_size,
        "micro_batch_size": cfg.train.micro_batch_size or cfg.train.global_batch_size,
        "precision": _precision(cfg, device),
        "activation_checkpoint": cfg.parallel.activation_checkpoint,
        "compile": {"enabled": cfg.compile.enabled, "mode": cfg.compile.mode} if cfg.compile.enabled else None,
        "steps": steps,
        "warmup": warmup,
        "tokens_per_s": tokens_per_step / step_time,
        "step_time_s": step_time,
        "step_time_mean_s": statistics.mean(times),
        "mfu": flops_per_step / step_time / info.peak_flops,
        "flops_per_step": flops_per_step,
        "breakdown_s": phases,
        "breakdown_method": (
            "medians of per-step phases with the device synchronised at each boundary; data = time blocked in "
            "next(loader); compute = forward + backward + gradient norm; optimizer = optimizer step pre-hook to end "
            "of step; exposed communication = 0 (one process, no collectives)"
        ),
        "memory": memory_stats(device),
        "memory_note": "CUDA allocator peak over the timed steps"
        if device.type == "cuda"
        else "peak resident set of the process" + (" (compilation included)" if cfg.compile.enabled else ""),
        **_start_up(marks, compiler),
        "fused_head": cfg.train.fused_head,
        **({"profile": profile} if profile else {}),
        "final_loss": loss,
        "torch": torch.__version__,
        "commit": _git_commit(),
        "threads": torch.get_num_threads(),
        "load_avg_1m": os.getloadavg()[0],
    }


def _start_up(marks: dict[str, float], compiler: CompileMonitor) -> dict:
    """The first step's figures and the start-up's phases, from the moments `run_bench` marked."""
    return {
        "first_step": {
            "from_build_s": marks["first_step"] - marks["build"],
            "build_s": marks["built"] - marks["build"],
            "from_process_start_s": marks["first_step"] - _PROCESS_T0,
            **compiler.metrics(),
        },
        "startup_s": _startup_phases(
            _PROCESS_T0,
            marks["imports"],
            marks["build"],
            marks["model"],
            marks["built"],
            marks["first_step"],
            compiler.metrics(),
        ),
    }


@contextlib.contextmanager
def _sampled_into(stacks: dict, name: str):
    from plait.core.profiling import StackSampler

    with StackSampler() as sampler:
        yield
    stacks[name] = {"areas_s": sampler.areas(), "top_stacks_s": sampler.top(25)}


def _startup_phases(t0, imports, build, model, built, first_step, compiled: dict) -> dict:
    """Process start to the end of the first step, phase by phase: imports (torch, plait), data (the prepared
    corpus opened), model build (meta -> parallelize -> materialise -> optimizer), loader (its first batches
    prefetched), then the first step split into Dynamo's compile time (autotuning included) and the rest
    (the step's own work: kernels launched for the first time, the allocator growing, eager head and
    optimizer)."""
    compile_s = compiled.get("compile_time_s", 0.0) or 0.0
    step = first_step - built
    return {
        "imports": imports - t0,
        "data": build - imports,
        "model_build": model - build,
        "loader": built - model,
        "first_step_compile": min(compile_s, step),
        "first_step_other": max(step - compile_s, 0.0),
        "total": first_step - t0,
    }


def _phase_breakdown(t, loader, device: torch.device, steps: int, compiler: CompileMonitor, first_check: int):
    from plait.engine.trainer import train_step

    marks: dict[str, float] = {}

    def mark(name: str):
        def hook(*_args, **_kwargs):
            _sync(device)
            marks[name] = time.perf_counter()

        return hook

    handle = t.optimizers[0].register_step_pre_hook(mark("optimizer_start"))
    rows: dict[str, list[float]] = {"data": [], "compute": [], "communication_exposed": [], "optimizer": []}
    try:
        for step in range(steps):
            _sync(device)
            t0 = time.perf_counter()
            x, y = next(loader)
            _sync(device)
            t1 = time.perf_counter()
            train_step(t, x, y)
            _sync(device)
            t2 = time.perf_counter()
            compiler.check(first_check + step)
            rows["data"].append(t1 - t0)
            rows["compute"].append(marks["optimizer_start"] - t1)
            rows["communication_exposed"].append(0.0)
            rows["optimizer"].append(t2 - marks["optimizer_start"])
    finally:
        handle.remove()
    return {k: statistics.median(v) for k, v in rows.items()} | {
        "total": statistics.median([sum(r) for r in zip(*rows.values(), strict=True)])
    }


def release_device() -> None:
    """Give back what the finished cold run still holds: its process group of one, Dynamo's compiled graphs
    (they keep references to the model), and the CUDA caching allocator's blocks."""
    import gc

    from plait.parallel.env import shutdown

    shutdown()
    torch.compiler.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def warm_start(cfg_args: list[str], cache_dir: str) -> dict:
    """Run the same job's first step in a fresh process on `cache_dir`: what a restarted job waits for."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "warm.json"
        cmd = [
            sys.executable,
            "-m",
            "plait.cli",
            "bench",
            *cfg_args,
            f"--compile.cache_dir={cache_dir}",
            "--steps=1",
            "--warmup=0",
            "--no-warm-run",
            f"--json={out}",
            "--quiet",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"the warm-start run failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())["first_step"]


def cmd_bench(argv: list[str]) -> int:
    """`plait bench`: its own flags, then the config like `plait train`."""
    from plait.cli.args import config_argv, config_parser, parse_config_args

    parser = config_parser("plait bench", DESCRIPTION)
    parser.add_argument("--steps", type=int, default=20, metavar="N", help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, metavar="W", help="untimed steps after the first")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--no-warm-run", action="store_true", help="skip the warm-start process (compile cache)")
    parser.add_argument("--quiet", action="store_true", help="print nothing (with --json)")
    parser.add_argument(
        "--profile", metavar="DIR", help="also profile 3 steps: table, Chrome trace and device time by kernel kind"
    )
    a, settings = parse_config_args(parser, argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("plait bench runs one process; start it without torchrun")
    steps, warmup, json_path, no_warm, quiet = a.steps, a.warmup, a.json, a.no_warm_run, a.quiet
    if steps < 1 or warmup < 0:
        raise ConfigError(f"need --steps >= 1 and --warmup >= 0 (got {steps}, {warmup})")
    if a.profile and Path(a.profile).exists() and not Path(a.profile).is_dir():
        raise ConfigError(f"--profile {a.profile} is a file; give a directory for the profile's files, e.g. prof/")
    if json_path and Path(json_path).is_dir():
        raise ConfigError(f"--json {json_path} is a directory; give a file path, e.g. {Path(json_path) / 'bench.json'}")

    from plait.config import load_config

    path, overrides = a.config, settings
    cfg = load_config(path, overrides)
    if cfg.parallel.pp_degree * cfg.parallel.tp_degree * cfg.parallel.dp_replicate_degree > 1:
        raise ConfigError("plait bench runs one process: leave the [parallel] degrees at 1")
    from plait.planner.preflight import check_memory, planned_gib

    note = check_memory(cfg, 1, 1)
    if note and not quiet:
        print(note, file=sys.stderr)
    tmp = None
    if cfg.compile.enabled and not cfg.compile.cache_dir:
        tmp = tempfile.TemporaryDirectory(prefix="plait-bench-cache-")  # a true cold start
        cfg.compile.cache_dir = tmp.name
    try:
        results = run_bench(cfg, steps, warmup, Path(a.profile) if a.profile else None)
        results["memory"]["planner"] = planned_gib(cfg)
        release_device()  # the warm run is another process: it must find the device as empty as this one did
        if cfg.compile.enabled and not no_warm:
            cfg_args = config_argv(path, [o for o in overrides if not o.startswith("compile.cache_dir")])
            warm = warm_start(cfg_args, cfg.compile.cache_dir)
            results["warm_start"] = warm
            results["warm_over_cold"] = warm["from_process_start_s"] / results["first_step"]["from_process_start_s"]
    finally:
        if tmp is not None:
            tmp.cleanup()
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(results, indent=1) + "\n")
    if not quiet:
        from plait.cli.bench_report import print_report

        print_report(results)
    return 0


if __name__ == "__main__":
    sys.exit(cmd_bench(sys.argv[1:]))
