"""A prepared corpus on S3 (data.source=s3://...), against the real S3-compatible server on loopback: the run
reads it in place and trains and resumes bitwise as the same run reading the local copy; an outage of the
server mid-run costs retries and warnings, not the run; a missing corpus or refused credentials end the run
before training with one line (exit 2), the secret never printed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from plait.config import load_config
from plait.core.storage import copy_in, location
from runs import debug_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(s3, data_dir) -> str:
    """The bundled corpus, prepared, copied to s3://plait/corpus/shakespeare."""
    url = f"s3://{s3.bucket}/corpus/shakespeare"
    root = location(url, s3.endpoint)
    for f in Path(data_dir).iterdir():
        if f.is_file():
            copy_in(f, root / f.name)
    return url


def run(data_dir: Path, out: Path, name: str, source: str, *extra: str, callbacks=()) -> dict[int, float]:
    from plait.api import train

    cfg = [c for c in debug_run(data_dir, out, name, 8, *extra) if not c.startswith("data.source=")]
    cfg += [f"data.source={source}", f"data.cache_dir={out / 'cache'}"]
    train(load_config(None, cfg), callbacks=list(callbacks))
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def test_a_run_reading_s3_trains_and_resumes_as_the_same_run_reading_locally(s3, corpus, data_dir, tmp_path):
    remote = [f"checkpoint.s3_endpoint={s3.endpoint}", "data.remote_cache_mb=1", "checkpoint.every_steps=4"]
    local = run(data_dir, tmp_path, "local", str(data_dir), "checkpoint.every_steps=4")
    got = run(data_dir, tmp_path, "s3", corpus, *remote, "eval.every_steps=4", "data.prefetch=2")
    assert got == local
    shutil.rmtree(tmp_path / "s3" / "checkpoints" / "step_00000008")
    (tmp_path / "s3" / "metrics.jsonl").unlink()
    resumed = run(data_dir, tmp_path, "s3", corpus, *remote)
    assert resumed == {s: local[s] for s in range(5, 9)}
    # each rank's description of the corpus: the manifest (naming where the shards are) and the tokenizer
    mirrored = next((tmp_path / "cache" / "remote").glob("*/manifest.json"), None)
    assert mirrored is not None and json.loads(mirrored.read_text())["remote"]["url"] == corpus


def test_an_s3_outage_mid_run_costs_retries_and_warnings_not_the_run(s3, corpus, data_dir, tmp_path, capfd):
    """The server is killed after step 3 and back 4 s later; the next step's reads (a 1 MiB cache: every
    step reads) fail, wait and retry, and the run ends with the losses of the run reading locally."""
    from plait import Callback

    events = []

    class Outage(Callback):
        def after_step(self, run, step, result) -> None:
            if step == 3:
                s3.stop()
                events.append("stopped")
                threading.Timer(4.0, lambda: (s3.start(), events.append("restarted"))).start()

    local = run(data_dir, tmp_path, "local", str(data_dir))
    remote = [f"checkpoint.s3_endpoint={s3.endpoint}", "data.remote_cache_mb=1", "data.prefetch=0"]
    got = run(data_dir, tmp_path, "outage", corpus, *remote, callbacks=[Outage()])
    assert events == ["stopped", "restarted"]
    assert got == local
    err = capfd.readouterr().err
    assert "failed" in err and "retrying in" in err and corpus in err


def test_a_missing_corpus_or_refused_credentials_exit_2_before_training(s3, corpus, tmp_path):
    base = [sys.executable, "-m", "plait.cli", "train", "--model.preset=debug", "--data.seq_len=32",
            f"--run.out_dir={tmp_path}", "--run.device=cpu", f"--checkpoint.s3_endpoint={s3.endpoint}",
            f"--data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    missing = subprocess.run([*base, f"--data.source=s3://{s3.bucket}/no/such/corpus"], capture_output=True, text=True)
    assert missing.returncode == 2 and "has no manifest.json" in missing.stderr, missing.stderr[-800:]
    secret = "wrong-secret-do-not-print"
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": secret}
    refused = subprocess.run([*base, f"--data.source={corpus}"], capture_output=True, text=True, env=env)
    assert refused.returncode == 2 and "S3 refused access" in refused.stderr, refused.stderr[-800:]
    assert secret not in refused.stderr + refused.stdout and "Traceback" not in refused.stderr
    assert not any(tmp_path.rglob("checkpoints"))


def test_a_mixture_may_read_some_sources_from_s3(s3, corpus, data_dir, tmp_path):
    """The same corpus as two sources, one of them on S3: the run equals the one with both local."""
    from plait.api import train

    def mixed(name: str, first: str) -> dict[int, float]:
        cfg = [c for c in debug_run(data_dir, tmp_path, name, 4) if not c.startswith("data.source=")]
        cfg += [f"data.sources=a={first}:0.6,b={data_dir}:0.4", f"checkpoint.s3_endpoint={s3.endpoint}"]
        train(load_config(None, [*cfg, f"data.cache_dir={tmp_path / 'cache'}"]))
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}

    assert mixed("remote", corpus) == mixed("local", str(data_dir))


def test_prepare_reads_its_inputs_from_an_s3_prefix(s3, tmp_path):
    """`plait data prepare s3://bucket/prefix`: the prefix's supported objects by key (others skipped), each
    copied to a scratch file while read: the same shards as the same files prepared locally."""
    from plait.core.errors import ConfigError
    from plait.data.prepare import prepare

    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(3):
        lines = [json.dumps({"text": f"document {i}.{j}: " + "words of the shard " * (j % 7 + 1)}) for j in range(40)]
        (raw / f"part-{i}.jsonl").write_text("\n".join(lines) + "\n")
    url = f"s3://{s3.bucket}/raw/text"
    for f in raw.iterdir():
        copy_in(f, location(f"{url}/{f.name}", s3.endpoint))
    copy_in(raw / "part-0.jsonl", location(f"{url}/README.md", s3.endpoint))  # not a supported type: skipped
    local = prepare([raw], tmp_path / "local", vocab_size=300)
    remote = prepare([url], tmp_path / "remote", vocab_size=300, s3_endpoint=s3.endpoint, workers=2)
    assert remote["splits"] == local["splits"] and remote["tokenizer_sha256"] == local["tokenizer_sha256"]
    assert [s["path"] for s in remote["sources"]] == [f"{url}/part-{i}.jsonl" for i in range(3)]
    assert not list(Path(tempfile.gettempdir()).glob("plait-prepare-*-part-*")), "scratch copies left"
    with pytest.raises(ConfigError, match="holds no objects: check the bucket and prefix"):
        prepare([f"s3://{s3.bucket}/no/such/prefix"], tmp_path / "none", s3_endpoint=s3.endpoint)

    secret = "wrong-secret-do-not-print"
    cmd = [sys.executable, "-m", "plait.cli", "data", "prepare", url, "--out", str(tmp_path / "refused"),
           "--s3-endpoint", s3.endpoint]  # fmt: skip
    refused = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "AWS_SECRET_ACCESS_KEY": secret})
    assert refused.returncode == 2 and "S3 refused access" in refused.stderr, refused.stderr[-800:]
    assert secret not in refused.stderr + refused.stdout and not (tmp_path / "refused").exists()
