"""torch.compile: loss parity with eager, no recompilation after warm-up, the persistent compile cache, and the
refusals (compile + tensor parallel, zero-bubble, float8 where it cannot run).

Compiling is slow on two CPU cores (~30 s cold for the debug model), so the whole file compiles three times:
one cold single-process run, one restart on its cache, and one two-process launch (FSDP, FSDP + activation
checkpointing, pipeline). The single-process runs are fresh processes (`python -m plait.engine.trainer`), so the
restart measures what a restarted job sees and nothing leaks into the other tests' process.

Tolerances (relative, fp32), both 1e-5: Inductor fuses the element-wise work of a block (RMSNorm, rotary
embeddings, SwiGLU) and may reorder its reductions, which moves results by fp32 rounding only (observed: 1e-7
on the loss over 6 steps, 0 on the gradient norm). At lr 1e-3, as in tests/parallel/test_parallel.py, such rounding
stays at that size; a real compile bug (a wrong gradient, a stale weight) moves the loss by 1e-4 or more.
"""

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from parallel_harness import run_layouts
from plait.config import load_config
from plait.core.errors import ConfigError
from plait.core.torch_private import compile_with_tp_works, torch_version

LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-5
STEPS = 6


def base(data_dir: Path) -> list[str]:
    return [
        "model.preset=debug",
        "model.n_layers=2",
        f"data.source={data_dir}",
        "data.seq_len=32",
        "train.global_batch_size=8",
        f"train.steps={STEPS}",
        "optim.warmup_steps=2",
        "optim.lr=1e-3",
        "log.every_steps=1",
        "sample.max_new_tokens=0",
        "checkpoint.save_final=false",
        "log.tensorboard=false",
        "log.plot=false",
        "data.prefetch=0",
        "run.device=cpu",
    ]


def single(data_dir: Path) -> list[str]:
    """The single-process job: gradient accumulation (2 micro-batches of 4) and two evaluations."""
    return [*base(data_dir), "train.micro_batch_size=4", "eval.every_steps=3", "eval.num_batches=2"]


def train_in_subprocess(out: Path, name: str, overrides: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    args = [f"--{o}" for o in [*overrides, f"run.out_dir={out}", f"run.name={name}"]]
    proc = subprocess.run(
        [sys.executable, "-m", "plait", "train", *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return read_run(out / name) | {"stderr": proc.stderr}


def read_run(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/loss" in r]
    return {
        "loss": {r["step"]: r["train/loss"] for r in train},
        "grad_norm": {r["step"]: r["train/grad_norm"] for r in train},
        "val_loss": {r["step"]: r["val/loss"] for r in rows if "val/loss" in r},
        "compile": {k.removeprefix("train/compile_"): v for k, v in train[-1].items() if "compile_" in k},
    }


def check_parity(name: str, got: dict, ref: dict) -> None:
    assert "error" not in got, got.get("error")
    assert sorted(got["loss"]) == list(range(1, STEPS + 1)), name
    for step, loss in ref["loss"].items():
        assert got["loss"][step] == pytest.approx(loss, rel=LOSS_RTOL), f"{name} loss @ {step}"
        assert got["grad_norm"][step] == pytest.approx(ref["grad_norm"][step], rel=GRAD_NORM_RTOL), (
            f"{name} grad norm @ {step}"
        )
    for step, loss in ref["val_loss"].items():
        assert got["val_loss"][step] == pytest.approx(loss, rel=LOSS_RTOL), f"{name} val @ {step}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir) -> dict:
    """An eager run (in this process) and a cold compiled run (a fresh process) of the same job."""
    from plait.api import train

    out = tmp_path_factory.mktemp("compile")
    train(load_config(None, [*single(data_dir), f"run.out_dir={out}", "run.name=eager"]))
    eager = read_run(out / "eager")
    cold = train_in_subprocess(out, "cold", [*single(data_dir), "compile.enabled=true"])
    return {"out": out, "eager": eager, "cold": cold}


# ------------------------------------------------------------------------------------------ single process


@pytest.mark.slow
def test_compile_matches_eager_and_never_recompiles(runs):
    cold = runs["cold"]
    check_parity("compiled", cold, runs["eager"])
    stats = cold["compile"]
    # forward + backward of the one block graph all blocks share, then the evaluation (no_grad) forward; the
    # fused head's two element-wise kernels at the training chunk's shape, then at the evaluation's
    assert stats["compiles"] == 3 + 2 + 2 and stats["recompiles"] == 0, stats
    assert stats["fxgraph_cache_miss"] > 0 and stats["fxgraph_cache_hit"] == 0, stats  # truly cold
    assert "recompiled" not in cold["stderr"]
    assert (runs["out"] / "cold" / "compile_cache" / "mega_cache.bin").is_file()


@pytest.mark.full
@pytest.mark.slow
def test_restart_on_the_persistent_cache_compiles_less(runs, data_dir):
    """A second job on the first one's compile cache (a restart) finds every graph in it."""
    cache = runs["out"] / "cold" / "compile_cache"
    warm = train_in_subprocess(
        runs["out"], "warm", [*single(data_dir), "compile.enabled=true", f"compile.cache_dir={cache}"]
    )
    check_parity("warm", warm, runs["eager"])
    stats, cold = warm["compile"], runs["cold"]["compile"]
    assert stats["loaded_artifacts"] > 0 and stats["recompiles"] == 0, stats
    assert stats["fxgraph_cache_hit"] == 7 and stats["fxgraph_cache_miss"] == 0, stats
    assert stats["aotautograd_cache_hit"] > 0 and stats["aotautograd_cache_miss"] == 0, stats
    # Measured 5 s vs 32 s of compilation on two cores; a loose bound keeps a loaded machine from failing it.
    assert stats["time_s"] < 0.6 * cold["time_s"], (stats, cold)
    # The first job left Inductor's SIMD verdicts beside the cache for the next one (no dlopen probes).
    verdict = json.loads((cache / "cpu_vec_isa.json").read_text())
    assert verdict["passed"] and all(verdict["passed"].values()), verdict


def test_vec_isa_verdict_answers_the_probe(tmp_path, monkeypatch):
    """A matching verdict answers Inductor's dlopen probe for the ISAs that passed, without a child process;
    a verdict for another torch or machine is ignored."""
    from torch._inductor import cpu_vec_isa

    import plait.engine.compile_cache as pc

    isas = cpu_vec_isa.valid_vec_isa_list()
    if not isas:
        pytest.skip("no SIMD ISA candidates on this CPU")
    if not hasattr(cpu_vec_isa.VecISA, "_probe_load"):
        pytest.skip("this torch has no VecISA._probe_load to answer (torch 2.11): its probe runs as it is")
    monkeypatch.setattr(pc, "_KNOWN_ISAS", {})
    monkeypatch.setattr(cpu_vec_isa.VecISA, "_probe_load", lambda self, path: False)  # "the child failed"
    path = tmp_path / pc.VEC_ISA_FILE
    path.write_text(json.dumps({"key": {**pc._vec_isa_key(), "torch": "0.0"}, "passed": {"VecAVX2": True}}))
    pc._reuse_vec_isa_verdict(path)
    assert not cpu_vec_isa.VecISA._probe_load(isas[0], "x.so")  # another torch: not used
    name = type(isas[0]).__name__
    path.write_text(json.dumps({"key": pc._vec_isa_key(), "passed": {name: True}}))
    pc._reuse_vec_isa_verdict(path)
    assert cpu_vec_isa.VecISA._probe_load(isas[0], "x.so")


@pytest.mark.slow
def test_mega_cache_file_alone_fills_an_empty_cache(runs, tmp_path):
    """A scaled-out job's machine has no cache directory, only the mega-cache file and the signed manifest:
    checked out and loaded (in a fresh process, before any compile), it writes every graph of the first run
    into the local caches."""
    for name in ("mega_cache.bin", "plait-manifest.json"):
        shutil.copy(runs["out"] / "cold" / "compile_cache" / name, tmp_path / name)
    code = (
        "import sys; from pathlib import Path; from plait.engine.compile_cache import MegaCache, point_caches_at\n"
        "from plait.core.trusted_dir import TrustedDir\n"
        "d = Path(sys.argv[1]); w = d / 'work'; assert TrustedDir(d).checkout(w).loaded == 1\n"
        "point_caches_at(w); print(MegaCache(w / 'mega_cache.bin').load())"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Every Inductor graph and AOTAutograd entry the first run made (the block's forward, backward and evaluation
    # graphs, the fused head's kernels at the training and evaluation shapes: 7 + 5), saved at two points of
    # the first run (warm-up, first evaluation): both batches must come back.
    cold = runs["cold"]["compile"]
    assert cold["fxgraph_cache_miss"] == 7 and cold["aotautograd_cache_miss"] == 5, cold
    assert int(proc.stdout.split()[-1]) == cold["fxgraph_cache_miss"] + cold["aotautograd_cache_miss"]
    assert list((tmp_path / "work" / "inductor" / "fxgraph").rglob("*")), "no FX graph written to the fresh cache"


# ------------------------------------------------------------------------------------ untrusted caches


class _Exploit:
    """Unpickling this runs a shell command that creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_exploits(cache: Path, marker: Path) -> int:
    """Replace every file of a compile cache (but its manifest) by a crafted pickle; the mega-cache keeps
    plait's framing so that only the pickle inside could stop it. Returns the number of files planted."""
    import pickle

    from plait.engine.compile_cache import MegaCache

    payload = pickle.dumps(_Exploit(marker))
    files = [p for p in cache.rglob("*") if p.is_file() and p.name != "plait-manifest.json"]
    for p in files:
        if p.name == "mega_cache.bin":
            p.write_bytes(MegaCache.MAGIC + len(payload).to_bytes(8, "little") + payload)
        else:
            p.write_bytes(payload)
    # and files plait never wrote, where Inductor would look for graphs
    (cache / "inductor" / "fxgraph" / "zz" / "planted").mkdir(parents=True, exist_ok=True)
    (cache / "inductor" / "fxgraph" / "zz" / "planted" / "entry").write_bytes(payload)
    return len(files) + 1


@pytest.mark.full
@pytest.mark.slow
def test_tampered_shared_cache_runs_no_code(runs, data_dir, tmp_path):
    """A shared compile cache whose every file was replaced by a pickle that runs code (the signed manifest
    left in place): nothing is unpickled, the job compiles from scratch, matches eager, and says why."""
    cache = tmp_path / "shared_cache"
    shutil.copytree(runs["out"] / "cold" / "compile_cache", cache)
    marker = tmp_path / "pwned"
    assert plant_exploits(cache, marker) > 5
    run = train_in_subprocess(
        tmp_path, "victim", [*single(data_dir), "compile.enabled=true", f"compile.cache_dir={cache}"]
    )
    assert not marker.exists(), "a planted pickle was executed"
    check_parity("tampered cache", run, runs["eager"])
    stats = run["compile"]
    assert stats["fxgraph_cache_hit"] == 0 and stats["loaded_artifacts"] == 0, stats  # compiled from scratch
    assert "changed since plait signed it" in run["stderr"], run["stderr"][-2000:]
    assert (cache / "inductor" / "fxgraph" / "zz" / "planted" / "entry").exists()  # left there, not deleted


@pytest.mark.full
@pytest.mark.slow
def test_copied_run_with_a_foreign_cache_resumes_without_running_it(data_dir, tmp_path):
    """A run directory copied from someone else: its compile cache is signed with their key and every file
    is a crafted pickle. Resuming it with compile on runs none of them."""
    from plait.core.trusted_dir import TrustedDir

    train_in_subprocess(tmp_path, "copied", [*base(data_dir), "train.steps=2", "checkpoint.save_final=true"])
    cache = tmp_path / "copied" / "compile_cache"
    marker = tmp_path / "pwned"
    cache.mkdir()
    (cache / "inductor" / "fxgraph").mkdir(parents=True)
    (cache / "inductor" / "fxgraph" / "entry").write_bytes(b"x")
    (cache / "mega_cache.bin").write_bytes(b"x")
    plant_exploits(cache, marker)
    attacker = {**os.environ, "PLAIT_KEY_FILE": str(tmp_path / "attacker.key")}
    subprocess.run(  # the attacker signs the planted files with a key of their own
        [
            sys.executable,
            "-c",
            f"from plait.core.trusted_dir import TrustedDir; TrustedDir({str(cache)!r}).publish("
            f"__import__('pathlib').Path({str(cache)!r}))",
        ],
        env=attacker,
        check=True,
        timeout=120,
    )
    assert (cache / "plait-manifest.json").is_file() and TrustedDir(cache).checkout(tmp_path / "w").loaded == 0
    run = train_in_subprocess(tmp_path, "copied", [*base(data_dir), "train.steps=3", "compile.enabled=true"])
    assert not marker.exists(), "a planted pickle was executed"
    assert sorted(run["loss"]) == [1, 2, 3] and run["compile"]["fxgraph_cache_hit"] == 0, run["compile"]
    assert "signature does not match this user's key" in run["stderr"], run["stderr"][-2000:]


def test_trusted_dir_checks_every_file_before_copying_it(tmp_path, monkeypatch):
    """Unit rules of the signed store: only files whose bytes match the signed manifest are copied; paths
    outside the store, links, unsigned files and a key others can read are refused."""
    from plait.core.trusted_dir import MANIFEST, TrustedDir, user_key

    monkeypatch.setenv("PLAIT_KEY_FILE", str(tmp_path / "keys" / "k"))
    work, store = tmp_path / "work", TrustedDir(tmp_path / "store")
    (work / "a").mkdir(parents=True)
    (work / "a" / "one").write_bytes(b"1")
    (work / "two").write_bytes(b"2")
    (work / "x.lock").write_bytes(b"")
    assert store.publish(work) == 2
    assert oct((tmp_path / "keys" / "k").stat().st_mode & 0o777) == "0o600"
    got = store.checkout(tmp_path / "out1")
    assert got.loaded == 2 and not got.rejected and (tmp_path / "out1" / "a" / "one").read_bytes() == b"1"

    (store.root / "two").write_bytes(b"evil")  # changed after signing
    (store.root / "three").write_bytes(b"unsigned")
    (tmp_path / "outside").write_bytes(b"secret")
    (store.root / "a" / "link").symlink_to(tmp_path / "outside")
    got = store.checkout(tmp_path / "out2")
    assert got.loaded == 1 and got.rejected == ["two: changed since plait signed it"] and got.untrusted_files == 1
    assert sorted(p.name for p in (tmp_path / "out2").rglob("*") if p.is_file()) == ["one"]

    manifest = json.loads((store.root / MANIFEST).read_text())
    manifest["files"]["../outside"] = manifest["files"].pop("two")  # a forged entry breaks the signature
    (store.root / MANIFEST).write_text(json.dumps(manifest))
    got = store.checkout(tmp_path / "out3")
    assert got.loaded == 0 and "signature does not match" in got.rejected[0]
    assert not (tmp_path / "out3").exists()

    (store.root / MANIFEST).unlink()
    assert "no plait signature" in store.checkout(tmp_path / "out4").rejected[0]

    (tmp_path / "keys" / "k").chmod(0o644)
    key, why = user_key()
    assert key is None and "chmod 600" in why
    with pytest.warns(UserWarning, match="chmod 600"):
        assert store.publish(work) == 0


# ------------------------------------------------------------------------------------------- multi-process


COMPILED_LAYOUTS = {
    "FSDP": ["parallel.dp_shard_degree=2"],
    "PP 1f1b": ["parallel.pp_degree=2", "parallel.pp_schedule=1f1b"],
    "FSDP, full AC": ["parallel.dp_shard_degree=2", "parallel.activation_checkpoint=full"],
    "FSDP, selective AC": ["parallel.dp_shard_degree=2", "parallel.activation_checkpoint=selective"],
    "FSDP, CPU offload": ["parallel.dp_shard_degree=2", "parallel.cpu_offload=true"],
    "CP 2 (the ring attention: an opaque op in the graph)": ["parallel.cp_degree=2"],
}
CI_COMPILED = ("FSDP", "PP 1f1b")  # CI compiles these two; --full the rest (each job compiles for a minute)


@pytest.mark.slow
@pytest.mark.parametrize(
    "names",
    [
        pytest.param(CI_COMPILED, id="fsdp-pp"),
        pytest.param(
            tuple(n for n in COMPILED_LAYOUTS if n not in CI_COMPILED), id="ac-offload-cp", marks=pytest.mark.full
        ),
    ],
)
def test_compiled_parallel_layouts_match_eager(names, data_dir, tmp_path):
    """FSDP (plain, full AC, selective AC, CPU offload), a 1F1B pipeline and context parallelism, compiled (strict: any
    recompilation fails the job), against the eager single-process run of the same batches."""
    from plait.api import train

    train(load_config(None, [*base(data_dir), "eval.every_steps=0", f"run.out_dir={tmp_path}", "run.name=ref"]))
    ref = read_run(tmp_path / "ref")
    compiled = [*base(data_dir), "eval.every_steps=0", "compile.enabled=true", "compile.strict=true"]
    results = run_layouts(2, [[*compiled, *COMPILED_LAYOUTS[name]] for name in names])
    for name, got in zip(names, results, strict=True):
        check_parity(f"compiled {name}", got, ref)


# ------------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["parallel.pp_degree=2", "parallel.pp_schedule=zero_bubble", "parallel.pp_virtual_stages=2"],
            r"pp_schedule='zero_bubble' is refused",
        ),
        (["compile.mode=fast"], r"compile.mode='fast' is not allowed; choose one of 'default'"),
    ],
)
def test_unsupported_compile_combinations_are_refused(overrides, message):
    """By the config check, or (the layouts compiled blocks run in: rules.compile_problem) the layout check."""
    from plait.parallel import ParallelDims, validate_layout

    with pytest.raises(ConfigError, match=message):
        cfg = load_config(None, ["model.preset=debug", "compile.enabled=true", *overrides])
        validate_layout(cfg, ParallelDims.from_config(cfg.parallel, cfg.parallel.pp_degree, cfg.model))


@pytest.mark.parametrize("release,refused", [((2, 11), False), ((2, 12), True), ((2, 13), True)])
def test_compile_with_tp_is_refused_only_on_torch_releases_where_it_is_broken(monkeypatch, release, refused):
    from plait.core import torch_private

    monkeypatch.setattr(torch_private, "_torch_minor", lambda: release)
    from plait.parallel import ParallelDims, validate_layout

    cfg = load_config(None, ["model.preset=debug", "compile.enabled=true", "parallel.tp_degree=2"])
    dims = ParallelDims.from_config(cfg.parallel, 2, cfg.model)
    if refused:
        with pytest.raises(ConfigError, match=r"tp_degree=2 is refused on torch .*broken in it.*torch 2.11 compiles"):
            validate_layout(cfg, dims)
    else:
        validate_layout(cfg, dims)


@pytest.mark.slow
@pytest.mark.skipif(not compile_with_tp_works(), reason=f"torch {torch_version()} refuses compile with TP (above)")
def test_compiled_tensor_parallel_layouts_match_eager(data_dir, tmp_path):
    """Where this torch compiles TP (torch 2.11): TP 2 and FSDP 2 x TP 2, compiled and strict, against eager."""
    from plait.api import train

    train(load_config(None, [*base(data_dir), "eval.every_steps=0", f"run.out_dir={tmp_path}", "run.name=ref"]))
    ref = read_run(tmp_path / "ref")
    compiled = [*base(data_dir), "eval.every_steps=0", "compile.enabled=true", "compile.strict=true"]
    for world, extra in ((2, ["parallel.tp_degree=2"]), (4, ["parallel.tp_degree=2", "parallel.dp_shard_degree=2"])):
        check_parity(f"compiled {extra}", run_layouts(world, [[*compiled, *extra]])[0], ref)


def test_float8_is_refused_where_it_cannot_run(tmp_path):
    import torch

    from plait.engine.compile_cache import CompileMonitor

    with pytest.raises(ConfigError, match=r"compile.float8=true needs compile.enabled=true"):
        load_config(None, ["compile.float8=true"])
    cfg = load_config(None, ["compile.enabled=true", "compile.float8=true", f"run.out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"compute capability 8.9\+ .*set compile.float8=false") as e:
        CompileMonitor.start(cfg, torch.device("cpu"), is_main=True)
    assert "this run is on cpu" in str(e.value)
    try:
        import torchao  # noqa: F401
    except ImportError:
        assert "torchao is not installed (pip install torchao)" in str(e.value)


def test_float8_auto_is_off_where_it_cannot_run_or_does_not_pay_and_says_why(monkeypatch):
    import torch

    import plait.parallel.compile
    from plait.model.llama import TransformerBlock
    from plait.parallel.compile import float8_plan

    on = ["compile.enabled=true", "compile.float8=auto"]
    cpu = torch.device("cpu")
    assert float8_plan(load_config(None, on).compile, cpu)[0] is False
    assert "this run is on cpu, not an NVIDIA GPU" in float8_plan(load_config(None, on).compile, cpu)[1]
    assert float8_plan(load_config(None, ["compile.float8=auto"]).compile, cpu) == (False, "compile.enabled=false")
    assert float8_plan(load_config(None, ["compile.enabled=true"]).compile, cpu) == (False, "compile.float8=false")
    # torchao's heuristic on the shapes: the tiny preset gains nowhere, llama3-1b in its wide layers. (The
    # device check is lifted: the layers chosen are the same on any device.)
    pytest.importorskip("torchao", reason="the test extra installs torchao")
    monkeypatch.setattr(plait.parallel.compile, "_float8_problems", lambda device: [])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    wide = "attention.wq, attention.wo, feed_forward.w1, feed_forward.w2, feed_forward.w3"
    for preset, want in (("tiny", "no block layer is large enough to gain"), ("llama3-1b", wide)):
        cfg = load_config(None, [*on, f"model.preset={preset}"])
        with torch.device("meta"):
            block = TransformerBlock(cfg.model, 0)
        chosen, why = float8_plan(cfg.compile, cpu, block)
        assert chosen is (preset != "tiny") and want in why, why


def test_rowwise_float8_scales_each_row_and_keeps_an_outlier_row_from_costing_the_others(monkeypatch):
    """compile.float8_recipe=rowwise converts the blocks' linear layers with torchao's rowwise recipe (a scale
    per row, no float8 all-gather: torchao gathers tensorwise scales only), and it is what the recipe is for:
    with one token 100,000 times larger than the others (17 octaves: more than e4m3's normal range of 14),
    tensorwise scales every row by that token's amax and the others fall into e4m3's subnormals; rowwise keeps
    them (each row's error against fp32, torchao's matmuls emulated on the CPU; measured 0.035 rowwise, 0.34
    tensorwise). The recipe alone is refused where no float8 runs."""
    import torch

    pytest.importorskip("torchao", reason="the test extra installs torchao")
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    from plait.parallel.compile import apply_float8

    with pytest.raises(ConfigError, match=r"compile.float8_recipe=rowwise takes effect only with float8 matmuls"):
        load_config(None, ["compile.float8_recipe=rowwise"])
    cfg = load_config(None, ["compile.enabled=true", "compile.float8=true", "compile.float8_recipe=rowwise"])
    assert cfg.compile.float8_recipe == "rowwise"

    torch.manual_seed(0)
    plain = torch.nn.Sequential()
    plain.add_module("layers", torch.nn.ModuleDict({"0": torch.nn.Linear(256, 256, bias=False)}))
    x = torch.randn(64, 256)
    x[0] *= 1e5  # one outlier token
    want = plain.layers["0"](x)
    errors = {}
    for recipe in ("tensorwise", "rowwise"):
        model = copy.deepcopy(plain)
        apply_float8(model, "true", all_gather=True, recipe=recipe)  # FSDP asks; rowwise gathers in bf16
        layer = model.layers["0"]
        assert isinstance(layer, Float8Linear)
        granularity = layer.config.cast_config_input.scaling_granularity
        assert granularity == (ScalingGranularity.AXISWISE if recipe == "rowwise" else ScalingGranularity.TENSORWISE)
        assert layer.config.enable_fsdp_float8_all_gather == (recipe == "tensorwise")
        got = layer(x)
        errors[recipe] = ((got[1:] - want[1:]).norm(dim=1) / want[1:].norm(dim=1)).median().item()
    # e4m3 keeps 3 mantissa bits (2^-4 relative per element): about 0.035 of a row's norm at best
    assert errors["rowwise"] < 0.05 and errors["tensorwise"] > 0.2, errors


def test_a_toml_boolean_reads_as_the_choice_of_that_name(tmp_path):
    path = tmp_path / "f8.toml"
    path.write_text("[compile]\nenabled = true\nfloat8 = true\n")
    assert load_config(path, []).compile.float8 == "true"
    path.write_text("[compile]\nfloat8 = false\n")
    assert load_config(path, []).compile.float8 == "false"


FLOAT8_SCRIPT = r"""
import json, sys
import torch
import torch.distributed as dist

torch.compile = lambda fn, **kwargs: fn  # eager: float8 itself is under test here, not Inductor on a CPU
import plait.parallel.compile as pc

pc._float8_problems = lambda device: []  # torchao's float8 runs (emulated) on a CPU; users are refused
if sys.argv[1] == "bf16-all-gather":  # float8 matmuls, the weights all-gathered in their own dtype
    apply_float8 = pc.apply_float8
    pc.apply_float8 = lambda model, choice, all_gather, **kw: apply_float8(model, choice, all_gather=False, **kw)
from torch.distributed.tensor import DTensor
from torchao.float8.float8_linear import Float8Linear
from plait.config import load_config
from plait.parallel import Meshes, ParallelDims
from plait.engine.trainer import build_trainable, train_step

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
cfg = load_config(None, ["model.preset=debug", "run.device=cpu", "data.seq_len=32", "train.global_batch_size=8",
                         "compile.enabled=true", "compile.float8=true", f"parallel.dp_shard_degree={world}"])
dims = ParallelDims.from_config(cfg.parallel, world)
t = build_trainable(cfg, torch.device("cpu"), Meshes(dims.build_mesh("cpu"), dims))
wq = t.model.layers["0"].attention.wq
weight = wq.weight.to_local() if isinstance(wq.weight, DTensor) else wq.weight
g = torch.Generator().manual_seed(0)
steps, per = [], 8 // world
for _ in range(5):
    x = torch.randint(0, cfg.model.vocab_size, (8, 33), generator=g)
    mine = x[rank * per : (rank + 1) * per]
    r = train_step(t, mine[:, :-1], mine[:, 1:])
    steps.append([r.loss.item(), r.grad_norm.item()])
layers = sum(isinstance(m, Float8Linear) for m in t.model.modules())
if rank == 0:
    print(json.dumps(dict(layers=layers, weight=type(weight).__name__, steps=steps)))
dist.destroy_process_group()
"""

FLOAT8_DP_RTOL = 1e-2
"""float8 under data parallelism against one process with float8: torchao scales each activation and gradient
by the amax of the micro-batch it casts, and a data-parallel rank casts its own half of the batch, so the
quantisation differs (measured 8.5e-6 on the first loss, 1.3e-3 on its gradient norm)."""


@pytest.mark.full
@pytest.mark.slow
def test_float8_all_gather_under_fsdp_equals_gathering_in_high_precision(tmp_path):
    """compile.float8=true under FSDP 2 (gloo) all-gathers the blocks' weights in float8 (torchao's
    WeightWithDynamicFloat8CastTensor behind each shard) and trains exactly as FSDP 2 with float8 matmuls that
    gathers the weights in their own dtype (each weight's scale comes from the all-reduced amax of the whole
    weight: the same float8 weights), and as one process with float8 within FLOAT8_DP_RTOL. 5 steps; every
    block linear of the debug model is float8."""
    import os
    import subprocess
    import sys

    pytest.importorskip("torchao", reason="the test extra installs torchao")
    script = tmp_path / "float8.py"
    script.write_text(FLOAT8_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    runs = {}
    for world, gather in ((1, "float8-all-gather"), (2, "float8-all-gather"), (2, "bf16-all-gather")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
        done = subprocess.run([*cmd, str(script), gather], capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[world, gather] = json.loads(done.stdout.strip().splitlines()[-1])
    one, fsdp, plain = runs[1, "float8-all-gather"], runs[2, "float8-all-gather"], runs[2, "bf16-all-gather"]
    assert one["layers"] == fsdp["layers"] == plain["layers"] == 4 * 7  # wq wk wv wo w1 w2 w3 in the 4 blocks
    assert fsdp["weight"] == "WeightWithDynamicFloat8CastTensor" and plain["weight"] == "Tensor"
    assert fsdp["steps"] == plain["steps"]
    for (l1, g1), (l2, g2) in zip(one["steps"], fsdp["steps"], strict=True):
        assert l2 == pytest.approx(l1, rel=FLOAT8_DP_RTOL) and g2 == pytest.approx(g1, rel=FLOAT8_DP_RTOL)


@pytest.mark.parametrize("device,warmed", [("cuda", 1), ("cpu", 0)])
def test_triton_compile_workers_start_before_the_model_is_built_on_cuda(tmp_path, monkeypatch, device, warmed):
    """Until Inductor's worker pool is up, kernels compile one by one in the main process (measured cold start
    on an H200: 54 s of the first step outside Dynamo's compile time); plait starts the pool before the model
    is built, on CUDA only (the pool compiles Triton kernels; a CPU run would only pay its processes)."""
    import torch

    import plait.core.torch_private
    from plait.engine.compile_cache import CompileMonitor

    calls = []
    monkeypatch.setattr(plait.core.torch_private, "warm_compile_workers", lambda: calls.append(1))
    cfg = load_config(None, ["compile.enabled=true", f"run.out_dir={tmp_path}"])
    CompileMonitor.start(cfg, torch.device(device), is_main=True)
    assert len(calls) == warmed


def test_the_compile_worker_warm_up_reaches_torch(monkeypatch):
    """The one private call behind it exists in this torch and is what plait calls."""
    import torch._inductor.async_compile as async_compile

    import plait.core.torch_private

    calls = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: calls.append(1))
    plait.core.torch_private.warm_compile_workers()
    assert calls == [1]
