"""A job's compile cache filled ahead of it (`plait compile`, plait.engine.precompile), in a directory or on S3
(plait.core.trusted_dir with an s3:// root): what the job's ranks load is what plait signed, nothing else."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from plait.core.storage import location
from plait.core.trusted_dir import MANIFEST, TrustedDir


@pytest.fixture
def key(tmp_path, monkeypatch):
    monkeypatch.setenv("PLAIT_KEY_FILE", str(tmp_path / "user.key"))
    return tmp_path / "user.key"


def test_a_signed_cache_on_s3_checks_out_and_what_changed_there_is_not_read(s3, key, tmp_path, monkeypatch):
    """publish -> S3 -> checkout gives the same bytes; an object changed on S3, one added there, or a store
    signed with another key is not copied (and is reported)."""
    src = tmp_path / "compiled"
    (src / "inductor" / "ab").mkdir(parents=True)
    (src / "inductor" / "ab" / "graph.bin").write_bytes(b"graph" * 100)
    (src / "mega_cache.bin").write_bytes(b"mega")
    store = TrustedDir(location(f"s3://{s3.bucket}/cache", s3.endpoint))
    assert store.publish(src) == 2
    assert store.publish(src) == 2  # again: unchanged objects are not written twice, the manifest is

    out = tmp_path / "out"
    report = store.checkout(out)
    assert report.loaded == 2 and not report.rejected and report.untrusted_files == 0
    assert (out / "inductor" / "ab" / "graph.bin").read_bytes() == b"graph" * 100

    client = s3.client()
    client.put_object(Bucket=s3.bucket, Key="cache/mega_cache.bin", Body=b"evil")  # changed after signing
    client.put_object(Bucket=s3.bucket, Key="cache/planted.so", Body=b"evil")  # never signed
    again = store.checkout(tmp_path / "again")
    assert again.loaded == 1 and again.untrusted_files == 1
    assert any("mega_cache.bin: changed since plait signed it" in r for r in again.rejected), again.rejected
    assert not (tmp_path / "again" / "mega_cache.bin").exists() and not (tmp_path / "again" / "planted.so").exists()

    monkeypatch.setenv("PLAIT_KEY_FILE", str(tmp_path / "other.key"))  # another user's key: nothing at all
    foreign = store.checkout(tmp_path / "foreign")
    assert foreign.loaded == 0 and "signature does not match" in foreign.rejected[0]
    assert json.loads(client.get_object(Bucket=s3.bucket, Key=f"cache/{MANIFEST}")["Body"].read())["files"]


@pytest.mark.full
@pytest.mark.slow
def test_plait_compile_fills_an_s3_cache_a_two_rank_job_then_loads_without_compiling(s3, data_dir, tmp_path, key):
    """`plait compile --world-size 2` (rank 0 on a fake group of 2, the job's shapes) publishes into an s3://
    compile.cache_dir; a second `plait compile` finds everything there; `plait train --nproc 2` (real gloo
    ranks, FSDP 2, compiled blocks, an evaluation) loads every graph: no Inductor cache miss, no recompilation."""
    settings = [
        "--model.preset=debug",
        f"--data.source={data_dir}",
        "--data.seq_len=64",
        "--train.global_batch_size=4",
        "--parallel.dp_shard_degree=2",
        "--compile.enabled=true",
        f"--compile.cache_dir=s3://{s3.bucket}/compiled",
        f"--checkpoint.s3_endpoint={s3.endpoint}",
        "--eval.every_steps=3",
        "--eval.num_batches=1",
        f"--run.out_dir={tmp_path}",
        "--run.name=job",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "OMP_NUM_THREADS")}
    cmd = [sys.executable, "-m", "plait.cli"]
    first = subprocess.run([*cmd, "compile", *settings, "--world-size", "2", "--json", str(tmp_path / "c.json")],
                           capture_output=True, text=True, env=env, timeout=900)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    compiled = json.loads((tmp_path / "c.json").read_text())[0]
    assert compiled["graphs"] >= 4 and compiled["misses"] > 0 and compiled["artifacts"] > 0, compiled
    assert compiled["store"] == f"s3://{s3.bucket}/compiled", compiled
    second = subprocess.run([*cmd, "compile", *settings, "--world-size", "2"], capture_output=True, text=True,
                            env=env, timeout=900)  # fmt: skip
    assert "nothing new: every graph was in the cache" in second.stdout, second.stdout + second.stderr[-2000:]

    job = [*cmd, "train", "--nproc", "2", *settings, "--train.steps=3", "--sample.max_new_tokens=0"]
    run = subprocess.run(job, capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "train/compile_fxgraph_cache_hit" in r][-1]
    assert last["train/compile_loaded_artifacts"] > 0, last
    assert last["train/compile_fxgraph_cache_hit"] > 0 and last["train/compile_fxgraph_cache_miss"] == 0, last
    assert last["train/compile_recompiles"] == 0, last


def _compile_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "PLAIT_RUN_LOCK")}
    return subprocess.run([sys.executable, "-m", "plait.cli", "compile", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)  # fmt: skip


def test_plait_compile_takes_the_run_lock_of_the_run_directory_it_writes_into(tmp_path):
    """A run training in runs/job holds its lock; `plait compile` on that run (the cache in its directory, as
    by default) turns compiling on for itself and says so, then is refused in one line naming the holder,
    exit 2, before it compiles or writes anything."""
    from plait.config import load_config
    from plait.engine.runlock import RunLock

    settings = ["--model.preset=debug", f"--run.out_dir={tmp_path}", "--run.name=job"]
    cfg = load_config(None, [s.removeprefix("--") for s in settings])
    with RunLock.for_run(cfg).acquire().held():  # this process stands in for the training run
        done = _compile_cli(*settings, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert "compiling with compile.enabled=true" in lines[0], lines
    assert len(lines) == 2 and lines[1].startswith("plait compile: error: run"), lines
    assert f"pid {os.getpid()}" in lines[1] and "in use by another run" in lines[1], lines
    assert not (tmp_path / "job" / "compile_cache").exists()


def test_plait_compile_with_a_cache_of_its_own_takes_no_run_lock(tmp_path):
    from plait.config import load_config
    from plait.engine.precompile_rank import in_run_dir

    base = [f"run.out_dir={tmp_path}", "run.name=job"]
    assert in_run_dir(load_config(None, base))
    assert in_run_dir(load_config(None, [*base, f"compile.cache_dir={tmp_path / 'job' / 'cc'}"]))
    assert not in_run_dir(load_config(None, [*base, f"compile.cache_dir={tmp_path / 'shared'}"]))
    assert not in_run_dir(load_config(None, [*base, "compile.cache_dir=s3://bucket/cache"]))


@pytest.mark.slow
def test_plait_compile_as_the_readme_shows_it_needs_no_compile_setting(tmp_path):
    """`plait compile` on a config without compile.enabled compiles (and says it turned compiling on), with
    a heartbeat while it compiles; its lock is released at the end (a second one runs, finding every graph)."""
    settings = ["--model.preset=debug", "--data.seq_len=32", "--train.global_batch_size=2",
                f"--run.out_dir={tmp_path}", "--run.name=job"]  # fmt: skip
    first = _compile_cli(*settings, "--json", str(tmp_path / "c.json"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "compiling with compile.enabled=true" in first.stderr
    compiled = json.loads((tmp_path / "c.json").read_text())[0]
    assert compiled["graphs"] >= 4 and compiled["misses"] > 0, compiled
    assert compiled["store"] == str(tmp_path / "job" / "compile_cache")
    assert not (tmp_path / "job.lock").exists()
    second = _compile_cli(*settings)
    assert "nothing new: every graph was in the cache" in second.stdout, second.stdout + second.stderr[-2000:]
