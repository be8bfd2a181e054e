"""The run's lineage, attached to the trainer as the ``Lineage`` callback: start, checkpoint, evaluation, end.

- ``RunLineage.start`` records the run (its parent: the checkpoint it resumes or the weights it starts from,
  registered on the way if the registry does not know them yet), its config, data fingerprint and code version.
  Under LoRA it also hashes the frozen base (every rank takes part: sharded weights are gathered one parameter
  at a time), the identity every adapter of the run refers to.
- ``checkpoint`` records each checkpoint once it is published (saves may be asynchronous) with the weights hash
  taken when its save began (``attach``: each rank digests its own shards, one small all-reduce; nothing is
  read back or gathered). A LoRA run also writes the adapter delta ``<run>/adapters/step_<N>.safetensors``
  (the LoRA tensors only, naming the base's hash) and records it.
- ``monitor`` runs ``eval.suite`` at each evaluation: results go to the metrics and the registry.
- ``finish`` records the last published checkpoints and marks the run finished. A run that dies stays
  'running' in the registry; ``plait lineage`` shows it as 'died' once its process is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from plait.config import Config, to_dict
from plait.core.errors import ConfigError, PlaitError
from plait.core.storage import Location, exists, location
from plait.engine.callbacks import Callback, RunState
from plait.lifecycle.lineage import Registry, code_version, data_fingerprint, process_info, registry_path
from plait.lifecycle.lora import lora_tensors, model_weights_hash, save_adapter, weights_hash

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from plait.lifecycle.evaluate import Suite
    from plait.model.llama import Transformer

_USER_DATA = {"source": "a dataset given to plait.Trainer(data=...)", "dir": None, "fingerprint": None}


class Lineage(Callback):
    """RunLineage attached to the trainer: start, each checkpoint, each evaluation (eval.suite), the end."""

    def __init__(self):
        self.lineage: RunLineage | None = None

    def on_start(self, run: RunState) -> None:
        self.lineage = RunLineage.start(run.cfg, run.env, run.t, run.data_dir, run.resumed_from, run.metrics)
        self.lineage.attach(run.checkpointer)

    def after_eval(self, run: RunState, step: int, val_loss: float) -> None:
        assert self.lineage is not None  # set by on_start
        self.lineage.monitor(step)  # eval.suite's behavioural assertions, if any

    def after_checkpoint(self, run: RunState, step: int, saved: dict[str, Any]) -> None:
        assert self.lineage is not None  # set by on_start
        self.lineage.checkpoint(step, saved, run.final)  # weights hash (and a LoRA run's adapter) of a save begun now

    def on_end(self, run: RunState, final: dict[str, Any]) -> None:
        assert self.lineage is not None  # set by on_start
        self.lineage.finish(final)


class RunLineage:
    def __init__(self, cfg: Config, t, is_main: bool, metrics=None):
        self.cfg, self.t, self.is_main, self.metrics = cfg, t, is_main, metrics
        self.registry: Registry | None = None
        self.run_id: str | None = None
        self.base_hash: str | None = None
        self.base_path: str | None = None
        self.lora = cfg.finetune.lora_rank > 0
        self.hashable = t.pipeline is None
        self.suite: Suite | None = None
        self.tokenizer: Tokenizer | None = None
        self._suite_copy: Transformer | None = None  # multi-process runs: the main rank's plain copy for the suite
        self._recorded: set[int] = set()  # steps whose checkpoints are in the registry
        self._hashes: dict[int, str] = {}  # step -> weights hash of a save begun, until it is recorded
        self.first_step = 1

    # ------------------------------------------------------------------------------------------------ start

    @classmethod
    def start(
        cls, cfg: Config, env, t, data_dir: Path | None, resume_from: Location | None, metrics=None
    ) -> RunLineage:
        self = cls(cfg, t, env.is_main, metrics)
        f = cfg.finetune
        resuming = resume_from is not None
        if resume_from is not None:  # resuming
            from plait.engine.checkpoint import step_of

            self.first_step = step_of(resume_from) + 1
        start_hash = None
        if self.hashable and cfg.lineage.enabled and (resuming or f.init_from):
            # The weights the run starts from, to find its parent: every rank takes part (sharded weights).
            start_hash = model_weights_hash(t.model, include_lora=resuming)
        if self.lora and self.hashable:
            self.base_hash = start_hash if start_hash and not resuming else model_weights_hash(t.model)
        if f.init_from:
            from plait.lifecycle.finetune import base_weights_ref, resolve_weights

            with contextlib.suppress(PlaitError):  # a resumed run need not still have its init_from
                where = resolve_weights(base_weights_ref(f.init_from))[1]
                self.base_path = str(where.resolve() if isinstance(where, Path) else where)
        if cfg.eval.suite:
            from plait.data import load_tokenizer
            from plait.lifecycle.evaluate import load_suite

            if data_dir is None:
                raise ConfigError(
                    f"eval.suite={cfg.eval.suite} needs plait's tokenizer; with your own data set eval.suite=''"
                )
            self.suite = load_suite(cfg.eval.suite)
            self.tokenizer = load_tokenizer(data_dir / "tokenizer.json")
        if not (self.is_main and cfg.lineage.enabled):
            return self
        self.registry = Registry(registry_path(cfg.run.out_dir, cfg.lineage.path))
        parent = self._parent(resume_from, start_hash)
        extra: dict[str, Any] = {**process_info(), "world_size": env.world_size}
        if resume_from is not None:
            extra["resumed_from"] = str(resume_from)
        if self.lora:
            extra["lora"] = dataclasses.asdict(f)
        data = data_fingerprint(data_dir, cfg.data.source) if data_dir is not None else _USER_DATA
        if cfg.model.retrieval_ids and data_dir is not None:  # the database it retrieves from
            from plait.data.retrieval import database_record

            data = {**data, "retrieval": database_record(data_dir)}
        self.run_id = self.registry.record(
            "run",
            name=cfg.run.name,
            path=cfg.run_dir,
            parent=parent,
            status="running",
            base_hash=self.base_hash if self.lora else None,
            config=to_dict(cfg),
            data=data,
            code=code_version(),
            extra=extra,
        )
        return self

    def _parent(self, resume_from: Location | None, start_hash: str | None) -> str | None:
        """The artifact this run continues: the checkpoint it resumes, else the weights of init_from (added to
        the registry if it does not know them, or knows other weights at that path)."""
        from plait.engine.checkpoint import META, read_meta

        reg = self.registry
        assert reg is not None
        if resume_from is not None:
            path = resume_from
        elif self.base_path is not None:
            path = location(self.base_path)
        else:
            return None
        known = reg.by_path(path)
        if known is not None and (start_hash is None or known.weights_hash in (None, start_hash)):
            return known.id
        if not exists(path / META):  # a Hugging Face directory
            kind, name, meta = "import", path.name, {"imported_from": {"path": str(path)}}
        else:
            meta = read_meta(path)
            run_name = path.parent.parent.name if path.parent.name == "checkpoints" else path.parent.name
            kind = "import" if meta.get("imported_from") else "checkpoint"
            name = run_name if kind == "import" else f"{run_name}/{path.name}"
        previous_run = reg.by_path(self.cfg.run_dir, kinds=("run",)) if resume_from is not None else None
        return reg.record(
            kind,
            name=name,
            path=path,
            parent=previous_run.id if previous_run and kind == "checkpoint" else None,  # it died before recording
            weights_hash=start_hash,
            config=meta.get("config"),
            extra={"imported_from": meta["imported_from"]} if "imported_from" in meta else {"registered_by": "run"},
        )

    # ------------------------------------------------------------------------------------------- checkpoint

    def attach(self, checkpointer) -> None:
        """Hash the weights of each save as it begins (every rank its own shards, one small all-reduce: no
        read-back, nothing gathered); the hash also goes into the checkpoint's plait.json."""
        if self.hashable and self.cfg.lineage.enabled and (self.lora or self.cfg.lineage.hash_checkpoints):
            checkpointer.describers.append(self._describe)

    def _describe(self, step: int, t) -> dict[str, Any]:
        digest = model_weights_hash(t.model, include_lora=True)
        if self.is_main:
            self._hashes[step] = digest
        return {"weights_hash": digest}

    def checkpoint(self, step: int, report: dict[str, Any], metrics: dict[str, Any] | None = None) -> None:
        """Called after every ``CheckpointManager.maybe_save`` with its report. A save that was published
        ('saved_step': now, or earlier when saves are asynchronous) is recorded; ``finish`` catches the last.
        Main rank only, no collectives: the weights are read back from the published checkpoint."""
        if self.is_main and "saved_step" in report:
            self._record_published(int(report["saved_step"]), metrics if int(report["saved_step"]) == step else None)

    def _record_published(self, step: int, metrics: dict[str, Any] | None) -> None:
        """Hash a published checkpoint's weights; a LoRA run also writes the adapter delta
        ``<run>/adapters/step_<N>.safetensors`` (the LoRA tensors only, naming the base's hash)."""
        from plait.engine.checkpoint import checkpoint_dir

        if step in self._recorded:
            return
        self._recorded.add(step)
        name = f"step_{step:08d}"
        path = checkpoint_dir(self.cfg) / name
        digest, model = self._hashes.pop(step, None), None
        if self.lora:  # the adapter file needs the LoRA tensors of that step: read back (they are small)
            from plait.lifecycle.models import load_model

            try:
                model = load_model(path).model
            except Exception as e:  # bookkeeping never stops training (e.g. S3 unreachable right now)
                from plait.engine.metrics import warn

                warn(
                    f"lineage: could not read back {path} for its adapter ({str(e)[:200]}); "
                    "recorded without the adapter file"
                )
        adapter_path = None
        if self.lora and model is not None:
            f = self.cfg.finetune
            adapter_path = save_adapter(
                model,
                self.cfg.run_dir / "adapters" / f"{name}.safetensors",
                base_hash=self.base_hash or "",
                rank=f.lora_rank,
                alpha=f.lora_alpha,
                targets=f.lora_targets,
                base_path=self.base_path,
                extra={"dropout": repr(float(f.lora_dropout))},
            )
        if self.registry is None:
            return
        ckpt_id = self.registry.record(
            "checkpoint",
            name=f"{self.cfg.run.name}/{name}",
            path=str(path),
            parent=self.run_id,
            weights_hash=digest,
            metrics={"step": step, **_scalars(metrics)},
        )
        if adapter_path is not None and model is not None:
            self.registry.record(
                "adapter",
                name=f"{self.cfg.run.name}/{name}/adapter",
                path=adapter_path,
                parent=ckpt_id,
                weights_hash=weights_hash(lora_tensors(model)),
                base_hash=self.base_hash,
                config={"finetune": dataclasses.asdict(self.cfg.finetune)},
                metrics={"step": step, **_scalars(metrics)},
                extra={"base_path": self.base_path},
            )

    # ---------------------------------------------------------------------------------------------- monitor

    def monitor(self, step: int) -> None:
        """Run the behavioural suite on the model being trained, log and record it. Under FSDP / TP every rank
        takes part in gathering the weights (one parameter at a time; pipeline stages over the pp axis) into
        a plain copy on the main rank, which runs the suite."""
        if self.suite is None:
            return
        model = self._suite_model()
        if model is None:  # not the main rank
            return
        from plait.engine.metrics import info
        from plait.lifecycle.evaluate import run_suite

        report = run_suite(model, self.tokenizer, self.suite)
        failed = sorted({r.test for r in report.results if not r.passed})
        info(
            f"monitor {self.suite.name} at step {step}: {report.passed} passed, {report.failed} failed"
            + (f" ({', '.join(failed)})" if failed else "")
        )
        if self.metrics is not None:
            self.metrics.log(step, {"passed": report.passed, "failed": report.failed}, prefix="monitor")
        if self.registry is not None and self.run_id is not None:
            self.registry.add_event(self.run_id, "monitor", report.to_dict(), step)

    def _suite_model(self):
        """The model to run the suite on: the trained one in a single process, else (main rank only) a plain
        fp32 CPU copy refreshed from the sharded weights. Every rank gathers its stage's parameters in the same
        order (DTensor collectives over the stage's own mesh); under a pipeline the first data-parallel /
        tensor-parallel rank of each stage then sends its stage over the pp axis to the main rank."""
        if self.t.pipeline is None and not self.t.fsdp and self.t.meshes.dims.world_size == 1:
            return self.t.model  # the trained model itself: plain tensors, all of it here
        from plait.lifecycle.lora import _full
        from plait.model.llama import canonical_name

        if self.is_main and self._suite_copy is None:
            from plait.interop.hf import empty_model
            from plait.lifecycle.lora import apply_lora_config

            self._suite_copy = empty_model(self.cfg.model, "cpu")
            if self.lora:
                apply_lora_config(self._suite_copy, self.cfg.finetune, self.cfg.run.seed)
        meshes = self.t.meshes
        sender = self.t.pipeline is not None and meshes.dp_rank == 0 and meshes.cp.get_local_rank() == 0
        sender = sender and meshes.tp.get_local_rank() == 0
        tensors: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for part in self.t.parts:
                for name, param in part.named_parameters():
                    full = _full(param)  # a collective for DTensors: every rank of the stage, same order
                    if self.is_main or sender:
                        tensors[canonical_name(name)] = full.to("cpu", copy=True)
        if sender:  # ranks (pp, dp 0, tp 0): one pp group, whose rank 0 is the main rank
            import torch.distributed as dist

            stages: list | None = [None] * meshes.dims.pp if self.is_main else None
            dist.gather_object(tensors, stages, group=meshes.pp.get_group(), group_dst=0)
            if self.is_main:
                assert stages is not None  # the main rank's list, filled by gather_object
                tensors = {k: v for stage in stages for k, v in stage.items()}
        if not self.is_main:
            return None
        assert self._suite_copy is not None  # made above on the main rank
        target = dict(self._suite_copy.named_parameters())
        missing = sorted(set(target) - set(tensors))
        if missing:
            raise PlaitError(f"eval.suite: the gathered model lacks {', '.join(missing[:4])}")
        with torch.no_grad():
            for name, param in target.items():
                param.copy_(tensors[name])
        return self._suite_copy

    # ----------------------------------------------------------------------------------------------- finish

    def finish(self, metrics: dict[str, Any] | None = None) -> None:
        """Record the checkpoints published since the last report (the final save), mark the run finished."""
        if not self.is_main:
            return
        from plait.engine.checkpoint import checkpoint_dir, list_checkpoints, step_of

        steps = [step_of(p) for p in list_checkpoints(checkpoint_dir(self.cfg))]
        for step in steps:
            if step >= self.first_step and step not in self._recorded:  # the final metrics are the last step's
                self._record_published(step, metrics if step == max(steps) else None)
        if self.registry is not None and self.run_id is not None:
            self.registry.update(self.run_id, status="finished", metrics=_scalars(metrics))


def _scalars(metrics: dict[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (metrics or {}).items() if isinstance(v, int | float | str | bool)}
