"""plait from Python: `plait.Trainer` is the training loop (plait.engine.trainer.Trainer) with plait's standard
features attached as callbacks, the same that `plait train` runs:

    import plait
    cfg = plait.load_config("configs/x.toml", ["train.steps=100"])      # or plait.Config(), then edit it
    plait.Trainer(cfg, callbacks=[MyCallback()]).fit()                 # plait's model on cfg.data.source
    plait.Trainer(cfg, model=MyModel, data=my_samples, loss=my_loss).fit()   # your model, data and loss
    loaded = plait.load_model("runs/default")     # a run as it trained (a LoRA run: base + adapters), or an HF
    loaded.model, loaded.tokenizer                # directory, an adapter file, an export, a quantized directory

Run it under `torchrun --nproc-per-node N` (or as one process) for the layout of cfg.parallel; see
examples/custom_model.py for a model of your own under FSDP.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from plait.config import Config, from_dict, load_config, validate
from plait.core.errors import ArgumentError
from plait.engine.callbacks import Callback
from plait.engine.trainer import Trainer as TrainingLoop
from plait.engine.trainer import check_arguments
from plait.features.guards import Guards
from plait.features.health import HealthCheck
from plait.features.report import EndReport
from plait.lifecycle.finetune import Finetune
from plait.lifecycle.models import load_model
from plait.lifecycle.retrieval import DatabaseRecord, database_retriever
from plait.lifecycle.tracking import Lineage

__all__ = ["Callback", "Config", "Trainer", "default_callbacks", "load_config", "load_model", "train"]


def default_callbacks(cfg: Config) -> list[Callback]:
    """plait's standard features of a run, in their order: the callbacks named by PLAIT_CALLBACKS (if set), the
    health check, fine-tuning (finetune.*), the lineage record, the guards and hang watchdog (guard.*), a
    retrieval model's database record in its checkpoints, and the end-of-run report. Each does nothing its
    settings do not ask for."""
    del cfg  # each reads its own section when the run starts
    return [
        *callbacks_from_environment(),
        HealthCheck(),
        Finetune(),
        Lineage(),
        Guards(),
        DatabaseRecord(),
        EndReport(retriever=database_retriever),
    ]


def callbacks_from_environment() -> list[Callback]:
    """The callbacks PLAIT_CALLBACKS names, for `plait train` and its workers (which take no Python objects):
    a comma-separated list of MODULE:FACTORY, each called with no argument and returning a Callback or a list
    of them; e.g. the test suite's fault injection, `plait.features.faults:from_environment`."""
    spec = os.environ.get("PLAIT_CALLBACKS", "").strip()
    found: list[Callback] = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        module, _, name = entry.partition(":")
        try:
            made = getattr(importlib.import_module(module), name)()
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            why = f"expected MODULE:FACTORY that makes callbacks ({e})"
            raise ArgumentError(f"PLAIT_CALLBACKS entry {entry!r}: {why}") from None
        made = made if isinstance(made, list) else [made]
        if not all(isinstance(c, Callback) for c in made):
            kinds = ", ".join(sorted({type(c).__name__ for c in made}))
            raise ArgumentError(f"PLAIT_CALLBACKS entry {entry!r}: made {kinds}, not plait.Callback objects")
        found += made
    return found


class Trainer(TrainingLoop):
    """plait.engine.trainer.Trainer with default_callbacks(cfg) before yours (standard=False: yours only).
    cfg: a Config, a TOML path, a {section: {key: value}} dict, or None for the defaults."""

    def __init__(
        self, cfg: Config | str | Path | None = None, *, callbacks: Iterable[Callback] = (), standard: bool = True, **kw
    ):
        if isinstance(cfg, str | Path) or cfg is None:
            cfg = load_config(cfg)
        cfg = from_dict(cfg) if isinstance(cfg, dict) else validate(cfg)
        if not isinstance(standard, bool):
            raise ArgumentError(f"standard= takes True (plait's standard callbacks first) or False, got {standard!r}")
        callbacks = check_arguments(kw.get("model"), None, None, None, None, callbacks, kw.get("env"))
        super().__init__(cfg, callbacks=[*(default_callbacks(cfg) if standard else []), *callbacks], **kw)
        if self.model_fn is None:  # plait's model, which the planner predicts
            _check_memory(cfg, self.given_env)


def _check_memory(cfg: Config, env) -> None:
    """Before anything is built: refused (ConfigError) if the planner predicts the run will not fit this
    machine, a line on stderr if it nearly does (plait.planner.preflight). Not repeated in the workers of
    `plait train --nproc`, whose launcher checked once for all of them."""
    from plait.parallel.env import RESTART_COUNT_ENV
    from plait.planner.preflight import check_memory

    if RESTART_COUNT_ENV in os.environ:
        return
    world = env.world_size if env is not None else int(os.environ.get("WORLD_SIZE", "1"))
    note = check_memory(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if note and (env.rank if env is not None else int(os.environ.get("RANK", "0"))) == 0:
        print(note, file=sys.stderr)


def train(cfg: Config, *, callbacks: Iterable[Callback] = (), env=None) -> dict[str, float]:
    """`plait train` in this process: train as configured (with plait's standard features); returns the final
    metrics. env: a process group already set up (left up), else one from the torchrun environment."""
    return Trainer(cfg, callbacks=callbacks, env=env).fit()
