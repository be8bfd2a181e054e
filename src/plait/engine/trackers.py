"""Experiment trackers beside metrics.jsonl: TensorBoard, Weights & Biases, MLflow. Each gets the same scalars
at the same steps (`MetricsLogger.log`); chosen in [log]. The libraries are imported only when turned on."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Protocol

from plait.config import LogConfig


class Tracker(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoard:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run_dir / "tb"))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class WandB:
    """A W&B run in <run>/wandb (offline by default: nothing leaves the machine until `wandb sync`)."""

    def __init__(self, run_dir: Path, cfg: LogConfig, name: str, config: dict[str, Any] | None):
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self._run = wandb.init(
            project=cfg.wandb_project,
            name=name,
            dir=str(run_dir),
            mode="online" if cfg.wandb_mode == "online" else "offline",  # (validated: one of the two)
            config=config,
            reinit="finish_previous",
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


class MLflow:
    """One MLflow run per plait run (a local SQLite store, <run>/mlflow.db, unless log.mlflow_uri says where);
    the resolved config as flattened params."""

    def __init__(self, run_dir: Path, cfg: LogConfig, name: str, config: dict[str, Any] | None):
        from mlflow.tracking import MlflowClient

        self.uri = cfg.mlflow_uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        self._client = MlflowClient(tracking_uri=self.uri)
        experiment = self._client.get_experiment_by_name("plait")
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment("plait")
        self.run_id = self._client.create_run(experiment_id, run_name=name).info.run_id
        for key, value in _flat(config or {}).items():
            self._client.log_param(self.run_id, key, str(value)[:500])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value in scalars.items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def open_trackers(run_dir: Path, cfg: LogConfig, name: str, config: dict[str, Any] | None) -> list[Tracker]:
    trackers: list[Tracker] = []
    if cfg.tensorboard and _installed("tensorboard"):
        trackers.append(TensorBoard(run_dir))
    elif cfg.tensorboard:  # on by default: a lean install runs without it, and says so
        logging.getLogger("plait").warning(
            "log.tensorboard=true, but the tensorboard package is not installed: no TensorBoard files "
            "(pip install 'plait[tensorboard]', or log.tensorboard=false)"
        )
    if cfg.wandb:
        trackers.append(WandB(run_dir, cfg, name, config))
    if cfg.mlflow:
        trackers.append(MLflow(run_dir, cfg, name, config))
    return trackers
