"""Nothing a run directory holds runs code, whichever command reads it.

The attacker of these tests controls every file of a run directory that reaches the user (copied from a
colleague, downloaded, a shared disk): checkpoints, their plait.json (so hashes in it prove nothing), the
compile cache and its manifest. Each crafted file carries a pickle whose ``__reduce__`` creates a marker file;
every command that reads a run is pointed at it, with compile on where the command compiles. The marker must
never appear, and each command ends with its own one-line answer (exit 0 or 2), never a traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from plait.cli import main

pytestmark = pytest.mark.slow


class _Exploit:
    """Unpickling this runs a shell command that creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _args(data_dir: Path, out: Path, name: str, steps: int) -> list[str]:
    return [
        "--model.preset=debug",
        "--model.n_layers=2",
        f"--data.source={data_dir}",
        "--data.seq_len=32",
        "--train.global_batch_size=8",
        f"--train.steps={steps}",
        "--optim.warmup_steps=1",
        "--log.tensorboard=false",
        "--log.plot=false",
        "--sample.max_new_tokens=0",
        "--eval.every_steps=0",
        "--compile.enabled=true",
        f"--run.out_dir={out}",
        f"--run.name={name}",
    ]


def _cli(*argv: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "plait.cli", *argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=600
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A trained run (2 steps, compiled: checkpoint + signed compile cache), this user's key, clean env."""
    from plait.data import ensure_prepared

    root = tmp_path_factory.mktemp("untrusted")
    data_dir = ensure_prepared("shakespeare", root / "cache", 4096)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["PLAIT_KEY_FILE"] = str(root / "user.key")
    done = _cli("train", *_args(data_dir, root, "good", 2), env=env, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (root / "good" / "compile_cache" / "plait-manifest.json").is_file()
    return {"root": root, "data": data_dir, "env": env}


def _copy(world, name: str) -> Path:
    run = world["root"] / name
    shutil.copytree(world["root"] / "good", run)
    return run


def _rehash(step: Path) -> None:
    """What an attacker does after changing .metadata: plait.json's hash made to match again."""
    meta = json.loads((step / "plait.json").read_text())
    meta["dcp_metadata_sha256"] = hashlib.sha256((step / ".metadata").read_bytes()).hexdigest()
    (step / "plait.json").write_text(json.dumps(meta))


def _crafted_metadata(step: Path, marker: Path) -> None:
    (step / ".metadata").write_bytes(pickle.dumps(_Exploit(marker)))
    _rehash(step)


def _crafted_records(step: Path, marker: Path) -> None:
    """Every record of the checkpoint an object whose unpickling runs the command (DCP writes objects as
    pickled byte records), under the names the model expects; plait.json rehashed."""
    import torch.distributed.checkpoint as dcp

    from plait.core.storage import parse_metadata

    names = list(parse_metadata((step / ".metadata").read_bytes()).state_dict_metadata)
    for f in step.glob("*.distcp"):
        f.unlink()
    (step / ".metadata").unlink()
    dcp.save({n: _Exploit(marker) for n in names}, checkpoint_id=str(step), no_dist=True)
    _rehash(step)


CHECKPOINT_ATTACKS = {"metadata": _crafted_metadata, "records": _crafted_records}


def _commands(run: Path, world) -> dict[str, list[str]]:
    out = world["root"] / f"{run.name}-out"
    return {
        "train (resume, compile on)": ["train", *_args(world["data"], world["root"], run.name, 3)],
        "generate": ["generate", str(run), "--max-new-tokens", "4"],
        "eval": ["eval", str(run), "--data", str(world["data"]), "--batches", "1", "--seq-len", "32"],
        "ckpt inspect": ["ckpt", "inspect", str(run)],
        "ckpt export hf": ["ckpt", "export", str(run), "--format", "hf", "--out", str(out / "hf")],
        "ckpt export safetensors": ["ckpt", "export", str(run), "--format", "safetensors", "--out", str(out / "st")],
        "compress quantize": ["compress", "quantize", str(run), "--out", str(out / "q"), "--batches", "1"],
        "finetune merge": ["finetune", "merge", str(run), "--out", str(out / "m")],
        "lineage show": ["lineage", "show", str(run)],
    }


@pytest.mark.parametrize("attack", sorted(CHECKPOINT_ATTACKS))
def test_crafted_checkpoints_run_no_code_in_any_command(world, attack, capsys):
    """Every command that reads a checkpoint, on one whose metadata or records are crafted pickles (and whose
    plait.json hash was updated to match): no code runs, each command ends with one line, never a traceback."""
    run = _copy(world, f"ckpt-{attack}")
    marker = world["root"] / f"pwned-{attack}"
    steps = sorted((run / "checkpoints").glob("step_*"))
    assert steps, "the trained run has no checkpoint"
    for step in steps:
        CHECKPOINT_ATTACKS[attack](step, marker)
    outcomes = {}
    for what, argv in _commands(run, world).items():
        if what.startswith("train"):  # a fresh process: compile on, as a user would run it
            done = _cli(*argv, env=world["env"], cwd=world["root"])
            code, err = done.returncode, done.stderr
        else:
            code = main(argv)
            err = capsys.readouterr().err
        assert not marker.exists(), f"{what}: a crafted pickle in the checkpoint ran"
        assert "Traceback" not in err, f"{what}:\n{err[-3000:]}"
        assert code in (0, 2), f"{what}: exit {code}\n{err[-3000:]}"
        outcomes[what] = (code, err.strip().splitlines()[-1] if err.strip() else "")
    refused = {w: line for w, (code, line) in outcomes.items() if code == 2}
    # every command that reads the checkpoint refuses it, naming why (lineage show reads the registry only)
    for what in (w for w in outcomes if w != "lineage show"):
        assert what in refused, f"{what} accepted a crafted checkpoint: {outcomes[what]}"
        assert any(w in refused[what] for w in ("not allowed in checkpoint metadata", "damaged", "pickled")), (
            what,
            refused[what],
        )
    with capsys.disabled():
        print(json.dumps(outcomes))


def test_crafted_compile_cache_runs_no_code_in_train_or_bench(world):
    """The run's compile cache replaced by crafted pickles and re-signed by the attacker's own key: `plait
    train` (resume, compile on) and `plait bench` (compile on, that cache) compile afresh, and say why."""
    from test_compile import plant_exploits

    run = _copy(world, "cached")
    cache = run / "compile_cache"
    marker = world["root"] / "pwned-cache"
    attacker = {**world["env"], "PLAIT_KEY_FILE": str(world["root"] / "attacker.key")}

    def plant() -> None:  # train re-signs the cache with the user's key after compiling: plant again each time
        assert plant_exploits(cache, marker) > 3
        sign = f"from plait.core.trusted_dir import TrustedDir as T; from pathlib import Path; T(Path({str(cache)!r}))"
        signed = subprocess.run(
            [sys.executable, "-c", f"{sign}.publish(Path({str(cache)!r}))"],
            env=attacker,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert signed.returncode == 0, signed.stderr

    plant()
    train = _cli("train", *_args(world["data"], world["root"], run.name, 3), env=world["env"], cwd=world["root"])
    assert not marker.exists(), "train: a crafted pickle in the compile cache ran"
    assert train.returncode == 0 and "Traceback" not in train.stderr, train.stderr[-3000:]
    assert "signature does not match this user's key" in train.stderr, train.stderr[-3000:]
    plant()
    bench_args = [a for a in _args(world["data"], world["root"], "bench", 2) if not a.startswith("--run.")]
    bench = _cli(
        "bench",
        *bench_args,
        f"--compile.cache_dir={cache}",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--no-warm-run",
        env=world["env"],
        cwd=run,
    )
    assert not marker.exists(), "bench: a crafted pickle in the compile cache ran"
    assert bench.returncode == 0 and "Traceback" not in bench.stderr, bench.stderr[-3000:]
    assert "signature does not match this user's key" in bench.stderr, bench.stderr[-3000:]
