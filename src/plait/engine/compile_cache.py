"""The compile caches and the recompilation guard of a run (the compilation itself is plait.parallel.compile).

Recompilation guard. After the first training step nothing should compile again: the shapes never change.
`CompileMonitor.check` runs after every step and looks at the compilations Dynamo recorded since; any new one
is a recompilation, reported with Dynamo's guard-failure text (a warning, or an error with compile.strict).
The first evaluation compiles the blocks once more (no_grad changes the graph): `expect()` marks that.

Persistent cache. compile.cache_dir (default <run_dir>/compile_cache, beside the checkpoints; or an s3://
prefix the nodes of a job share, filled ahead of it by `plait compile`: plait.engine.precompile) keeps
Inductor's FX-graph and AOTAutograd caches, compiled kernels and torch's "mega-cache"
(`torch.compiler.save_cache_artifacts`: every compiled graph in one file, `mega_cache.bin`), so a restarted
job, or one scaled out to machines that get a copy of the directory, skips Inductor. Those files are pickles
and shared objects, so torch never reads that directory: each process compiles in a private directory of its
own (TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR point there before the first compile), filled first with
the cache files whose bytes match plait's signature, and the main rank signs and publishes what it compiled
back after warm-up (`plait.core.trusted_dir`). A cache plait did not sign is reported once and not loaded.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from plait.config import Config
from plait.core import torch_private
from plait.core.errors import ConfigError, PlaitError
from plait.core.storage import Location, location
from plait.core.trusted_dir import TrustedDir, private_dir
from plait.parallel.compile import check_float8_support

MEGA_CACHE_FILE = "mega_cache.bin"


# --------------------------------------------------------------------------------------------- cache


def cache_location(cfg: Config) -> Location:
    """compile.cache_dir: a directory, or an s3:// prefix (checkpoint.s3_endpoint and the AWS credential chain,
    as checkpoints), shared by a job's nodes; by default the run directory's compile_cache."""
    if not cfg.compile.cache_dir:
        return cfg.run_dir / "compile_cache"
    return location(cfg.compile.cache_dir, cfg.checkpoint.s3_endpoint)


def check_cache_access(cfg: Config) -> None:
    """An s3:// compile.cache_dir listed once with the job's credentials before anything compiles, so a wrong
    key is one line naming the bucket, not a traceback after the compile."""
    where = cache_location(cfg)
    if isinstance(where, Path):
        return
    from plait.core.storage import remote_key

    try:
        where.fs.find(remote_key(where))
    except PermissionError:
        bucket = where.url.removeprefix("s3://").split("/", 1)[0]
        raise ConfigError(
            f"S3 refused access to compile.cache_dir={where} (bucket {bucket}): check the credentials "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the AWS profile; they are not printed) and the endpoint "
            "(checkpoint.s3_endpoint)"
        ) from None


def point_caches_at(directory: Path) -> None:
    """Inductor and Triton read these variables when they first compile: set them before that."""
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str((directory / "inductor").resolve())
    os.environ["TRITON_CACHE_DIR"] = str((directory / "triton").resolve())
    _reuse_vec_isa_verdict(directory / VEC_ISA_FILE)


VEC_ISA_FILE = "cpu_vec_isa.json"
"""Inductor's verdict on this CPU's SIMD instruction sets. Every process that compiles for the CPU probes each
candidate ISA: a cached C++ build, then a child Python that dlopens it, a large part of a warm start
(docs/measurements.md, "compile cache: vector ISA verdicts").
The verdicts are kept beside the cache, keyed by torch version, machine, compiler and ISA list, and a
later process answers the dlopen probe from them (`VecISA._probe_load`, private: skipped where torch lacks
it). Not through config.cpp.vec_isa_ok: that setting is part of the FX-graph cache key, so setting it would
make every cached graph miss."""

_KNOWN_ISAS: dict[str, bool] = {}


def _vec_isa_key() -> dict:
    import platform

    return {
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cxx": os.environ.get("CXX", ""),
        "isas": [type(isa).__name__ for isa in torch_private.cpu_vec_isas()],
    }


def _reuse_vec_isa_verdict(path: Path) -> None:
    import json

    if not torch_private.vec_isa_probes_answerable():
        return  # nothing to answer: not even the verdict file is read
    with contextlib.suppress(OSError, ValueError):
        saved = json.loads(path.read_text())
        if saved.get("key") == _vec_isa_key():
            _KNOWN_ISAS.update({k: v for k, v in saved.get("passed", {}).items() if v is True})
    if _KNOWN_ISAS:
        torch_private.answer_vec_isa_probes(_KNOWN_ISAS)


def remember_vec_isa_verdict(directory: Path) -> None:
    """After compiling: record which candidate ISAs passed Inductor's probe (already run, and cached, in this
    process), for the next process on this cache."""
    import json

    path = directory / VEC_ISA_FILE
    if path.exists():
        return
    with contextlib.suppress(OSError):
        passed = {type(isa).__name__: bool(isa) for isa in torch_private.cpu_vec_isas()}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": _vec_isa_key(), "passed": passed}))
        tmp.replace(path)


class MegaCache:
    """The mega-cache file: what `torch.compiler.save_cache_artifacts()` returned at each save point of this
    process (warm-up, first evaluation), length-prefixed, loaded back with `load_cache_artifacts`.

    Why each save's blob is kept rather than the last one only: torch 2.13 appends every save of a process to
    one byte string, and its loader turns the appended batches into a dict keyed by artifact type, so a blob
    saved twice loads only its last batch. Each blob loaded in turn restores all of them. The blobs of the
    file this process loaded are kept too unless this process has recorded every key they held.
    """

    MAGIC = b"PLAITMC1"

    def __init__(self, path: Path):
        self.path = path
        self.loaded_blobs: list[bytes] = []
        self.loaded_keys: set[str] = set()
        self.blobs: list[bytes] = []

    def load(self) -> int:
        """Load the file, if any, into the local caches; returns the number of distinct artifacts."""
        if not self.path.is_file():
            return 0
        try:
            blobs = self._split(self.path.read_bytes())
            for blob in blobs:
                info = torch.compiler.load_cache_artifacts(blob)
                if info is not None:
                    self.loaded_keys |= _keys(info)
        except Exception as e:  # another torch version, a truncated copy: compile from scratch instead
            warnings.warn(f"compile cache {self.path} could not be loaded ({e}); compiling from scratch", stacklevel=2)
            return 0
        self.loaded_blobs = blobs
        return len(self.loaded_keys)

    def save(self) -> int:
        """Write everything compiled or found in the caches so far (atomically); returns the number of
        distinct artifacts the file holds."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return len(self.loaded_keys)
        data, info = saved
        self.blobs.append(data)
        keys = _keys(info)
        blobs = self.blobs if self.loaded_keys <= keys else self.loaded_blobs + self.blobs
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(self.MAGIC + b"".join(len(b).to_bytes(8, "little") + b for b in blobs))
        tmp.replace(self.path)
        return len(keys | self.loaded_keys)

    @classmethod
    def _split(cls, data: bytes) -> list[bytes]:
        if not data.startswith(cls.MAGIC):
            raise ValueError("not a plait mega-cache file")
        blobs, i = [], len(cls.MAGIC)
        while i < len(data):
            n = int.from_bytes(data[i : i + 8], "little")
            blobs.append(data[i + 8 : i + 8 + n])
            i += 8 + n
        return blobs


def _keys(info) -> set[str]:
    return {f"{kind}:{key}" for kind, keys in info.artifacts.items() for key in keys}


# ------------------------------------------------------------------------------------ recompile guard


def _key(m) -> tuple:
    return (m.compile_id, m.start_time_us, m.co_name)


@dataclass
class CompileMonitor:
    """Counts compilations and recompilations of one training run, keeps the mega-cache file current and
    reports cache hits. A disabled monitor (compile.enabled=false) does nothing."""

    enabled: bool = False
    strict: bool = False
    is_writer: bool = False
    loaded_artifacts: int = 0
    compiles: int = 0  # compilations expected: first step, first evaluation
    recompiles: int = 0  # compilations after warm-up: each one a bug or a config change
    compile_time_s: float = 0.0  # Dynamo + AOTAutograd + Inductor time, all compilations
    first_step_s: float = 0.0  # from set-up to the end of the first step: what a restart waits for
    saved_artifacts: int = 0
    mega_cache: MegaCache | None = None
    store: TrustedDir | None = None  # compile.cache_dir: signed by the main rank after each save point
    reasons: list[str] = field(default_factory=list)
    _seen: set = field(default_factory=set)
    _counters0: dict = field(default_factory=dict)
    _start: float = 0.0
    _checks: int = 0
    _expected: set = field(default_factory=set)

    @classmethod
    def start(cls, cfg: Config, device: torch.device, is_main: bool) -> CompileMonitor:
        """Set up before the model is built: float8 support, this process's private cache directory filled
        with what verifies in compile.cache_dir, Inductor's compile workers (on CUDA: started now, not at the
        first compilation), the mega-cache file."""
        if not cfg.compile.enabled:
            return cls()
        if cfg.compile.float8 == "true":
            check_float8_support(device)
        store = TrustedDir(cache_location(cfg))
        work = private_dir("plait-compile-")
        report = store.checkout(work)
        if report.rejected and is_main:
            more = f" and {len(report.rejected) - 3} more" if len(report.rejected) > 3 else ""
            warnings.warn(
                f"compile cache {store.root}: not loaded where plait cannot vouch for it "
                f"({'; '.join(report.rejected[:3])}{more}); those files can run code, so they are left unread "
                f"and compiled again ({report.loaded} signed files loaded)",
                stacklevel=2,
            )
        point_caches_at(work)
        if device.type == "cuda":  # Triton's compile workers come up while the model builds (torch_private)
            torch_private.warm_compile_workers()
        mega_cache = MegaCache(work / MEGA_CACHE_FILE)
        monitor = cls(enabled=True, strict=cfg.compile.strict, is_writer=is_main, mega_cache=mega_cache, store=store)
        monitor._seen = {_key(m) for m in torch_private.compilation_metrics()}
        monitor._counters0 = torch_private.compile_cache_counters()
        monitor._start = time.perf_counter()
        monitor.loaded_artifacts = mega_cache.load()
        return monitor

    def _new(self) -> list:
        new = [m for m in torch_private.compilation_metrics() if _key(m) not in self._seen]
        self._seen.update(_key(m) for m in new)
        self.compile_time_s += sum((m.duration_us or 0) for m in new) / 1e6
        return new

    def check(self, step: int) -> None:
        """After a training step: the first step's compilations are the warm-up; any later one is a
        recompilation, warned about (or an error with compile.strict) with Dynamo's reason."""
        if not self.enabled:
            return
        new = self._new()
        self._checks += 1
        if self._checks == 1:
            self.first_step_s = time.perf_counter() - self._start
            self.compiles += len(new)
            self._save()
            return
        if new:
            self._recompiled(new, f"step {step}")

    def phase_done(self, phase: str) -> None:
        """After a phase outside the training step (evaluation: no_grad and eval mode change the graph): the
        compilations since the last check are expected the first time `phase` runs, recompilations later."""
        if not self.enabled:
            return
        new = self._new()
        if phase in self._expected:
            self._recompiled(new, phase)
        else:
            self._expected.add(phase)
            self.compiles += len(new)
            if new:
                self._save()

    def _recompiled(self, new: list, where: str) -> None:
        if not new:
            return
        self.recompiles += len(new)
        reasons = sorted({(m.recompile_reason or f"new frame {m.co_name}").splitlines()[0] for m in new})
        self.reasons.extend(reasons)
        message = (
            f"torch.compile recompiled {len(new)} time(s) at {where} although shapes are static; "
            f"guard failure: {'; '.join(reasons)}"
        )
        if self.strict:
            raise PlaitError(f"{message} (compile.strict=true; set it false to only warn)")
        warnings.warn(message, stacklevel=3)

    def _save(self) -> None:
        if self.is_writer and self.mega_cache is not None:
            self.saved_artifacts = self.mega_cache.save()
            remember_vec_isa_verdict(self.mega_cache.path.parent)
            if self.store is not None:
                self.store.publish(self.mega_cache.path.parent)

    def cache_hits(self) -> dict[str, int]:
        now = torch_private.compile_cache_counters()
        return {k: now[k] - self._counters0.get(k, 0) for k in now}

    def metrics(self) -> dict[str, float]:
        """compile_* values for the metrics log ({} when compilation is off)."""
        if not self.enabled:
            return {}
        return {
            "compile_time_s": self.compile_time_s,
            "compile_first_step_s": self.first_step_s,
            "compile_compiles": self.compiles,
            "compile_recompiles": self.recompiles,
            "compile_loaded_artifacts": self.loaded_artifacts,
            **{f"compile_{k}": v for k, v in self.cache_hits().items()},
        }
