"""TensorBoard, Weights & Biases (offline) and MLflow (a local SQLite store) get the same metrics as
metrics.jsonl: each is read back with its own library (W&B's offline run file with its record format)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from plait.config import load_config
from plait.core.errors import ConfigError

wandb = pytest.importorskip("wandb")
pytest.importorskip("mlflow")


def _wandb_history(run_file: Path) -> list[dict]:
    """History rows of an offline W&B run: the file is a LevelDB-style log (32 KiB blocks of chunks: CRC,
    length, type full/first/middle/last) of protobuf Records after a 7-byte header."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos = run_file.read_bytes(), 32768, 7
    assert data[:4] == b":W&B", data[:8]
    records, pending = [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # block padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
    return rows


@pytest.mark.slow
def test_wandb_and_mlflow_record_what_tensorboard_and_jsonl_do(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from plait.api import train
    from plait.data import ensure_prepared

    monkeypatch.setenv("WANDB_DIR", str(tmp_path))  # nothing in the home directory
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    data = ensure_prepared("shakespeare", tmp_path / "cache", 4096)
    overrides = [
        "model.preset=debug",
        f"data.source={data}",
        "data.seq_len=32",
        "train.global_batch_size=4",
        "train.steps=4",
        "eval.every_steps=2",
        "eval.num_batches=1",
        "log.every_steps=1",
        "sample.max_new_tokens=0",
        "log.wandb=true",
        "log.mlflow=true",
        f"run.out_dir={tmp_path}",
        "run.name=tracked",
    ]
    train(load_config(None, overrides))
    run = tmp_path / "tracked"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    expected = {
        key: {r["step"]: r[key] for r in rows if key in r} for key in ("train/loss", "train/grad_norm", "val/loss")
    }
    assert sorted(expected["train/loss"]) == [1, 2, 3, 4] and sorted(expected["val/loss"]) == [2, 4]

    tb = EventAccumulator(str(run / "tb"))
    tb.Reload()
    for key, values in expected.items():
        assert {e.step: e.value for e in tb.Scalars(key)} == pytest.approx(values, rel=1e-6), key

    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    (mlrun,) = client.search_runs([client.get_experiment_by_name("plait").experiment_id])
    assert mlrun.info.run_name == "tracked" and mlrun.data.params["train.steps"] == "4"
    for key, values in expected.items():
        assert {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, key)} == values, key

    (run_file,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    history = _wandb_history(run_file)
    for key, values in expected.items():
        assert {h["_step"]: h[key] for h in history if key in h} == values, key


def test_tracker_settings_are_checked_before_training():
    with pytest.raises(ConfigError, match=r"log.wandb_mode='cloud': choose offline or online"):
        load_config(None, ["log.wandb=true", "log.wandb_mode=cloud"])
