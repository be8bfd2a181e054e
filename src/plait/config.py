"""The job configuration: nested typed dataclasses, TOML files, ``--section.key=value`` overrides, presets.

Resolution order (later wins): defaults -> model preset -> TOML file -> command-line overrides.
Every field's docstring is its ``--help`` text. ``validate`` runs before any worker starts and names the bad
setting together with a valid value.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import tomllib
import typing
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

from plait.errors import ConfigError
from plait.model.args import ModelArgs
from plait.model.presets import PRESETS


@dataclass
class RunConfig:
    name: str = "default"
    """Run name: outputs go to <out_dir>/<name>."""
    out_dir: str = "runs"
    """Directory holding all runs (metrics, TensorBoard events, checkpoints)."""
    seed: int = 0
    """Seed for weight initialisation and data order."""
    device: str = "auto"
    """'auto' (CUDA if present, else CPU), 'cpu', 'cuda' or 'cuda:N'."""
    overwrite: bool = False
    """Start afresh where a run already exists (the old one is moved to <name>.old-<time>, once every check
    has passed)."""
    break_lock: bool = False
    """Take over the run directory's lock (<out_dir>/<name>.lock, and checkpoint.dir's) even from a holder
    that still looks alive: for a holder you know is gone where plait cannot tell yet (on another machine,
    its heartbeat not yet expired). A holder whose process has ended, or whose heartbeat is older than 60 s,
    is taken over without it."""
    health_check_enabled: bool = True
    """Before training, check every device's arithmetic and the collectives of every mesh axis against known
    values (well under a second for one process); a failure stops the run naming the bad rank."""
    memory_check: bool = True
    """Before any worker starts, the planner's memory model (`plait plan`'s) for this layout against this
    machine: a run predicted not to fit its devices (or, on the CPU, the memory available) is refused naming
    what brings it down; one within 10% of the limit is warned about. false: start anyway."""


@dataclass
class DataConfig:
    source: str = "shakespeare"
    """'shakespeare' (the bundled corpus, prepared on first use) or a directory from `plait data prepare`."""
    cache_dir: str = "~/.cache/plait/data"
    """Where the bundled corpus is tokenised and cached."""
    seq_len: int = 256
    """Tokens per training sequence (fixed: static shapes, no recompiles)."""
    shuffle: bool = True
    """Shuffle the order of sequences each epoch (deterministically from run.seed)."""
    prefetch: int = 2
    """Batches prepared ahead by a background thread; 0 loads synchronously."""


@dataclass
class TrainConfig:
    steps: int = 400
    """Optimizer steps to train for."""
    global_batch_size: int = 16
    """Sequences per optimizer step, summed over all data-parallel ranks and micro-batches."""
    micro_batch_size: int = 0
    """Sequences per forward/backward on one rank; 0 means the whole local batch (no accumulation), or
    with a pipeline, the local batch split into one micro-batch per pipeline stage."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    """'auto' uses bf16 autocast where the device computes bf16 natively (CUDA), fp32 elsewhere."""
    fused_head: bool = True
    """Compute the output projection and the cross-entropy together, a chunk of tokens at a time, with the
    gradients taken in the same pass (plait.model.head): the (B, T, vocab) logits and their fp32 copies are
    never kept for backward (llama3-1b, 4 x 2,048 tokens: 6.3 GB), no matmul is recomputed. Every layout (under
    tensor parallelism the vocabulary stays split, as loss-parallel cross-entropy). false: logits, then
    cross-entropy. Applies to plait's model and loss (a Trainer given model= or loss= computes its own)."""
    loss_chunk_tokens: int = 0
    """Tokens per chunk of the fused head; 0: as many as keep a chunk near 268 M logits (512 MiB in bf16;
    plait.model.head.LOGITS_PER_CHUNK; llama3-1b: 2,048)."""


@dataclass
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """Decay after warm-up: 'cosine', 'wsd' (warmup-stable-decay, linear decay at the end) or 'constant'."""
    warmup_steps: int = 30
    """Linear warm-up steps."""
    decay_fraction: float = 0.2
    """WSD only: fraction of all steps spent in the final decay."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to norms and embeddings)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""


@dataclass
class EvalConfig:
    every_steps: int = 100
    """Validation loss every N steps (and at the end); 0 disables."""
    num_batches: int = 8
    """Validation batches per evaluation."""
    suite: str = ""
    """A behavioural test suite (YAML; see `plait eval --help`) run as a monitor at every evaluation, its
    results logged and recorded in the lineage registry (one process only). Empty: none."""


@dataclass
class LogConfig:
    every_steps: int = 10
    """Write metrics every N steps."""
    tensorboard: bool = True
    """Write TensorBoard event files to <run>/tb."""
    wandb: bool = False
    """Also log to Weights & Biases (pip install wandb); files under <run>/wandb."""
    wandb_mode: str = "offline"
    """W&B mode: offline (sync later with `wandb sync <run>/wandb/offline-run-*`) or online."""
    wandb_project: str = "plait"
    """W&B project name."""
    mlflow: bool = False
    """Also log to MLflow (pip install mlflow-skinny): params, metrics, one run per plait run."""
    mlflow_uri: str = ""
    """MLflow tracking URI ('' = a local SQLite store, sqlite:///<run>/mlflow.db; or http://host:5000)."""
    progress: bool = True
    """Show a progress bar (off automatically when output is not a terminal)."""


@dataclass
class CheckpointConfig:
    every_steps: int = 100
    """Save a checkpoint every N steps (0: only at the end, on SIGTERM/SIGINT and by every_minutes)."""
    keep_last: int = 2
    """Number of most recent checkpoints kept."""
    save_final: bool = True
    """Save a checkpoint when training ends."""
    every_minutes: float = 30.0
    """Also save when this many minutes have passed since the last save (0: off); rank 0's clock decides."""
    keep_every: int = 0
    """Also keep, forever, the first checkpoint at or after each multiple of this step (the multiple itself,
    unless its save was deferred behind a slow one) (0: off)."""
    async_enabled: bool = True
    """Write checkpoints in the background: the loop waits only while the state is copied to CPU memory."""
    dir: str = ""
    """Where checkpoints go: a directory or s3://bucket/prefix ('' = <run.out_dir>/<run.name>/checkpoints)."""
    s3_endpoint: str = ""
    """S3 endpoint URL for s3:// checkpoints, e.g. http://127.0.0.1:8333 ('' = AWS, or $AWS_ENDPOINT_URL);
    credentials come from the usual AWS environment variables or profile."""


@dataclass
class ParallelConfig:
    dp_replicate_degree: int = 1
    """Data-parallel replicas (HSDP groups); model states are replicated across them."""
    dp_shard_degree: int = -1
    """FSDP shard group size (MiCS partition group); -1 uses what the other degrees leave of the world."""
    tp_degree: int = 1
    """Tensor (+ sequence) parallel degree."""
    cp_degree: int = 1
    """Context parallel degree: each sequence is split over this many ranks (load-balanced causal chunks),
    attention runs as an exact ring over them; data.seq_len must be divisible by 2 x cp_degree."""
    ep_degree: int = 1
    """Expert parallel degree (mixture-of-experts models): each MoE block's experts are split over this many
    ranks and tokens travel to their experts and back by all-to-all (dropless). The ep ranks are taken from
    the data- and context-parallel ranks of one FSDP shard group, so ep_degree must divide dp_shard x cp; the
    experts are FSDP-sharded over the rest of that group (and replicated over dp_replicate)."""
    pp_degree: int = 1
    """Pipeline stages (one per rank along the pp axis; see pp_virtual_stages)."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = "1f1b"
    """Pipeline schedule; 'interleaved_1f1b' and 'zero_bubble' use pp_virtual_stages model chunks per rank."""
    pp_virtual_stages: int = 1
    """Model chunks per pipeline rank (2+ for the interleaved and zero-bubble schedules)."""
    pp_split: Literal["layers", "cost"] = "cost"
    """How layers are divided between stages: equal layer counts, or balanced by estimated cost (the
    first and last stages also run the embedding and the output projection)."""
    fsdp_reshard_after_forward: bool = True
    """FSDP: free gathered parameters after forward (less memory, one more all-gather in backward)."""
    fsdp_reduce_every_micro_batch: bool = False
    """FSDP with gradient accumulation: reduce-scatter gradients after every micro-batch and accumulate them
    sharded (memory: no unsharded fp32 gradients held across micro-batches; traffic: one reduce-scatter per
    micro-batch) instead of once after the last. Under pipeline parallelism too (not with the zero-bubble
    schedule, which computes weight gradients apart from their backward)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2 offload)."""
    activation_checkpoint: Literal["none", "selective", "full"] = "none"
    """Recompute activations in backward: 'full' per block, 'selective' keeps matmul/attention outputs."""
    timeout_s: int = 900
    """Collectives that take longer than this raise instead of hanging. Above guard.hang_timeout_s, so that the
    hang watchdog reports a stalled rank (and which) before a collective times out on the ranks waiting for it."""


@dataclass
class GuardConfig:
    nonfinite_policy: Literal["skip", "rollback", "stop"] = "skip"
    """When the loss or gradient norm is NaN/inf: 'skip' the update, 'rollback' to the newest checkpoint and
    go on from there, or 'stop' the run."""
    max_consecutive_failures: int = 5
    """Give up with an error after this many failed steps in a row (non-finite, or skipped spikes)."""
    spike_window: int = 50
    """Loss spike detection compares each loss with the mean and spread of this many previous steps."""
    spike_num_std: float = 6.0
    """A loss above mean + spike_num_std x std of the window is a spike: a warning and a metric."""
    spike_skip_enabled: bool = False
    """Also skip the update of a step whose loss is a spike."""
    hang_timeout_s: int = 600
    """No step progress for this long: report the rank and what it was doing, dump Python stacks and exit
    non-zero (so an elastic agent restarts the group); must exceed the longest step, eval or save. 0: off."""
    straggler_ratio: float = 2.0
    """Every log interval, name a rank whose own time per step is more than this times its peers' median
    (one small all-gather); 0: off."""


LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


@dataclass
class FinetuneConfig:
    init_from: str = ""
    """Start from these weights: a plait checkpoint or run directory, or a Hugging Face model directory (the
    [model] settings must match it: start from its config.toml). Empty: initialise afresh or resume."""
    lora_rank: int = 0
    """LoRA adapter rank: freeze the base weights and train low-rank adapters; 0 trains every weight."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: an adapter's output is multiplied by lora_alpha / lora_rank."""
    lora_targets: str = "wq,wk,wv,wo"
    """Comma-separated linear layers that get adapters: wq, wk, wv, wo (attention), w1, w2, w3 (MLP)."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input while training."""


@dataclass
class LineageConfig:
    enabled: bool = True
    """Record the run, its checkpoints and adapters (parents, config, data, code, metrics, weight hashes)."""
    path: str = ""
    """The lineage registry (SQLite); empty: <run.out_dir>/lineage.sqlite."""
    hash_checkpoints: bool = True
    """Record each checkpoint's weights hash (the main rank reads the published checkpoint back once)."""


@dataclass
class CompileConfig:
    enabled: bool = False
    """torch.compile each transformer block (regional: one graph, reused by every block; static shapes).
    Off by default: the first step then compiles (~30 s on a CPU, ~1 min for a 1B model on a GPU) and CPUs
    gain little; on a GPU turn it on (see docs/performance.md)."""
    mode: Literal["default", "max-autotune-no-cudagraphs", "max-autotune"] = "default"
    """'default': quick compile, fused element-wise kernels; 'max-autotune-no-cudagraphs': also benchmarks
    matmul and attention kernel choices (minutes of compile, faster steps); 'max-autotune': also CUDA graphs
    (least launch overhead, more memory; not for FSDP, whose parameters move every step)."""
    strict: bool = False
    """Stop with an error, instead of a warning, when a compiled block recompiles after the first step."""
    cache_dir: str = ""
    """Persistent compile cache (Inductor and Triton caches plus one mega-cache file that a restarted or
    scaled-out job loads first); empty: <run.out_dir>/<run.name>/compile_cache."""
    float8: Literal["false", "true", "auto"] = "false"
    """Float8 matmuls in the transformer blocks through torchao. 'true': every block linear layer whose sizes
    are multiples of 16, refused where it cannot run (needs compile.enabled, torchao and an NVIDIA GPU of compute
    capability 8.9+: H100, H200, L4, L40S); 'auto': on where it can run and pays (the layers torchao's own
    heuristic expects to gain), off elsewhere, saying why at start-up. Under FSDP the float8 weights are
    all-gathered in float8."""


@dataclass
class SampleConfig:
    prompt: str = "OTHELLO."
    """Prompt of the sample printed after training (empty: no sample). The bundled corpus writes each speaker
    as 'NAME.' on a line of its own, so this starts a speech."""
    max_new_tokens: int = 120
    """Tokens to generate for the sample."""
    temperature: float = 0.8
    """Sampling temperature (0: greedy)."""
    top_k: int = 50
    """Keep only the k most likely tokens (0: off)."""
    top_p: float = 0.95
    """Nucleus sampling: keep the smallest set of tokens with this total probability (1.0: off)."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelArgs = field(default_factory=lambda: ModelArgs(**PRESETS["tiny"]))
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    lineage: LineageConfig = field(default_factory=LineageConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir).expanduser() / self.run.name


SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}


# ---------------------------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build a validated Config from an optional TOML file and ``section.key=value`` overrides."""
    values: dict[str, dict[str, Any]] = {}
    if path is not None:
        values = _read_toml(Path(path))
    for item in overrides or []:
        key, value = _split_override(item)
        section, name = _split_key(key)
        values.setdefault(section, {})[name] = value  # a string: converted by the field's type below
    return validate(_build(values))


def _read_toml(path: Path) -> dict[str, dict[str, Any]]:
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; give a .toml file")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte {e.start}: {e.object[e.start : e.start + 1]!r}); "
            f"TOML files are UTF-8: save it as UTF-8"
        ) from None
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    for section, body in data.items():
        _check_section(section)
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: '{section}' must be a table ([{section}]), not a single value")
    return data


def _split_override(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.steps=100)")
    key, value = item.split("=", 1)
    return key.strip().removeprefix("--"), value


def _split_key(key: str) -> tuple[str, str]:
    if key.count(".") != 1:
        raise ConfigError(f"setting {key!r} must be section.key, e.g. optim.lr")
    section, name = key.split(".")
    _check_section(section)
    return section, name


def _check_section(section: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section {section!r}{_suggest(section, SECTIONS)}")


def _suggest_setting(section: str, name: str, valid: list[str]) -> str:
    """A close name in the same section, else the same name in another section (train.lr -> optim.lr),
    always spelt in full as it is typed: section.key."""
    close = difflib.get_close_matches(name, valid, n=1)
    if close:
        return f"; did you mean '{section}.{close[0]}'?"
    elsewhere = [f"{other}.{name}" for other, kind in SECTIONS.items() if name in _hints(kind)]
    if elsewhere:
        return f"; did you mean {' or '.join(repr(e) for e in elsewhere)}?"
    return f"; valid: {', '.join(f'{section}.{v}' for v in sorted(valid))}"


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(sorted(options))}"


def _build(values: dict[str, dict[str, Any]]) -> Config:
    cfg = Config()
    for section, body in values.items():
        _check_section(section)
        if not isinstance(body, dict):
            raise ConfigError(f"config section '{section}' must be a table of settings, not {body!r:.40}")
        body = dict(body)
        if section == "model" and "preset" in body:
            preset = str(body.pop("preset"))
            if preset not in PRESETS:
                raise ConfigError(f"model.preset={preset!r} is not a preset; valid: {', '.join(PRESETS)}")
            cfg.model = ModelArgs(**PRESETS[preset])
        target = getattr(cfg, section)
        hints = _hints(type(target))
        for name, raw in body.items():
            if name not in hints:
                valid = list(hints) + (["preset"] if section == "model" else [])
                raise ConfigError(f"unknown setting '{section}.{name}'{_suggest_setting(section, name, valid)}")
            setattr(target, name, _convert(f"{section}.{name}", raw, hints[name]))
    return cfg


@cache
def _hints(cls: type) -> dict[str, Any]:
    return {f.name: typing.get_type_hints(cls)[f.name] for f in dataclasses.fields(cls)}


def _convert(key: str, raw: Any, typ: Any) -> Any:
    """Convert a TOML value or a command-line string to the field's type, or say what was expected."""
    choices = typing.get_args(typ) if typing.get_origin(typ) is Literal else None
    base = str if choices else typ
    if choices and isinstance(raw, bool) and str(raw).lower() in choices:
        raw = str(raw).lower()  # a TOML true / false for a setting whose choices include them (compile.float8)
    try:
        if isinstance(raw, str) and base is not str:
            raw = _parse_string(raw, base)
        if base is bool and not isinstance(raw, bool):
            raise TypeError
        if base is float and isinstance(raw, int) and not isinstance(raw, bool):
            raw = float(raw)
        if not isinstance(raw, base) or (base is int and isinstance(raw, bool)):
            raise TypeError
    except (TypeError, ValueError):
        expected = f"one of {', '.join(map(repr, choices))}" if choices else _type_name(base)
        raise ConfigError(f"{key} expects {expected}, got {raw!r}") from None
    if choices and raw not in choices:
        raise ConfigError(f"{key}={raw!r} is not allowed; choose one of {', '.join(map(repr, choices))}")
    if base is float and not math.isfinite(raw):
        raise ConfigError(f"{key} must be a finite number, got {raw!r}")
    return raw


def _parse_string(raw: str, base: type) -> Any:
    if base is bool:
        low = raw.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ValueError
    return base(raw.strip())


def _type_name(t: type) -> str:
    return {int: "an integer", float: "a number", bool: "a boolean (true/false)", str: "a string"}.get(t, str(t))


# ------------------------------------------------------------------------------------------- validation


def _check_trackers(log: LogConfig) -> None:
    """Refuse a tracker whose library is missing now, before any worker starts."""
    import importlib.util

    if log.wandb_mode not in ("offline", "online"):
        raise ConfigError(f"log.wandb_mode={log.wandb_mode!r}: choose offline or online")
    for flag, module, package in (("wandb", "wandb", "wandb"), ("mlflow", "mlflow", "mlflow-skinny")):
        if getattr(log, flag) and importlib.util.find_spec(module) is None:
            raise ConfigError(f"log.{flag}=true needs the {module} package: pip install {package}; or log.{flag}=false")


def validate(cfg: Config) -> Config:
    """Check every setting that can be checked without data or devices; raise ConfigError on the first."""
    _check_types(cfg)
    m, t, o, d = cfg.model, cfg.train, cfg.optim, cfg.data
    _positive("model", m, ["dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len"])
    _positive("train", t, ["steps", "global_batch_size"])
    _positive("data", d, ["seq_len"])
    _positive("optim", o, ["lr", "eps"])
    _non_negative("train", t, ["micro_batch_size", "grad_clip", "loss_chunk_tokens"])
    _non_negative("optim", o, ["warmup_steps", "weight_decay", "min_lr_ratio"])
    _non_negative("model", m, ["ffn_hidden_dim", "rope_scaling_factor", "sliding_window"])
    _non_negative("eval", cfg.eval, ["every_steps", "num_batches"])
    _non_negative("checkpoint", cfg.checkpoint, ["every_steps", "keep_last", "every_minutes", "keep_every"])
    _non_negative("data", d, ["prefetch"])
    _check_trackers(cfg.log)
    _non_negative("sample", cfg.sample, ["max_new_tokens", "temperature", "top_k"])
    _positive("log", cfg.log, ["every_steps"])
    _positive("guard", cfg.guard, ["max_consecutive_failures", "spike_num_std"])
    _non_negative("guard", cfg.guard, ["hang_timeout_s", "straggler_ratio"])
    if 0 < cfg.parallel.timeout_s <= cfg.guard.hang_timeout_s:
        raise ConfigError(
            f"guard.hang_timeout_s={cfg.guard.hang_timeout_s} must be below parallel.timeout_s="
            f"{cfg.parallel.timeout_s}: otherwise a collective times out first and the stalled rank is not named; "
            f"raise parallel.timeout_s (e.g. {2 * cfg.guard.hang_timeout_s}) or lower guard.hang_timeout_s"
        )
    if cfg.guard.spike_window < 2:
        raise ConfigError(f"guard.spike_window={cfg.guard.spike_window} must be at least 2, e.g. 50")
    if 0 < cfg.guard.straggler_ratio <= 1:
        raise ConfigError(f"guard.straggler_ratio={cfg.guard.straggler_ratio} must be above 1 (e.g. 2.0), or 0 for off")
    if cfg.guard.nonfinite_policy == "rollback" and not cfg.checkpoint.every_steps:
        raise ConfigError(
            "guard.nonfinite_policy='rollback' reloads the newest checkpoint: set checkpoint.every_steps (e.g. 100)"
        )
    _non_negative("model", m, ["attention_head_dim"])
    if m.dim % m.n_heads and not m.attention_head_dim:
        raise ConfigError(
            f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}; "
            f"choose n_heads in {_divisors(m.dim, limit=64)} (or set model.attention_head_dim)"
        )
    if m.head_dim % 2:
        raise ConfigError(
            f"the head size {m.head_dim} (model.attention_head_dim, or dim / n_heads) must be even for rotary "
            "embeddings"
        )
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_kv_heads={m.n_kv_heads} does not divide model.n_heads={m.n_heads}; "
            f"choose n_kv_heads in {_divisors(m.n_heads)}"
        )
    if d.seq_len > m.max_seq_len:
        raise ConfigError(
            f"data.seq_len={d.seq_len} is longer than the model supports (model.max_seq_len={m.max_seq_len});"
            f" lower data.seq_len or raise model.max_seq_len"
        )
    if not 0 < cfg.sample.top_p <= 1:
        raise ConfigError(f"sample.top_p={cfg.sample.top_p} must be in (0, 1]")
    if o.min_lr_ratio > 1:
        raise ConfigError(f"optim.min_lr_ratio={o.min_lr_ratio} must be at most 1")
    if not (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1):
        raise ConfigError(f"optim.beta1={o.beta1} and optim.beta2={o.beta2} must be in [0, 1), e.g. 0.9, 0.95")
    if not 0 < o.decay_fraction <= 1:
        raise ConfigError(f"optim.decay_fraction={o.decay_fraction} must be in (0, 1], e.g. 0.2")
    if t.micro_batch_size and t.global_batch_size % t.micro_batch_size:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not a multiple of "
            f"train.micro_batch_size={t.micro_batch_size}; choose micro_batch_size in "
            f"{_divisors(t.global_batch_size)}"
        )
    for name in ("dp_replicate_degree", "tp_degree", "pp_degree", "ep_degree"):
        if getattr(cfg.parallel, name) < 1:
            raise ConfigError(f"parallel.{name} must be at least 1")
    if cfg.parallel.dp_shard_degree == 0 or cfg.parallel.dp_shard_degree < -1:
        raise ConfigError("parallel.dp_shard_degree must be -1 (infer) or at least 1")
    if cfg.run.device != "auto" and not (cfg.run.device == "cpu" or cfg.run.device.startswith("cuda")):
        raise ConfigError(f"run.device={cfg.run.device!r} is not a device; use 'auto', 'cpu' or 'cuda'")
    name = cfg.run.name
    if not name or name in (".", "..") or any(c in name for c in "/\\\0") or name != name.strip():
        raise ConfigError(
            f"run.name={name!r} must be one directory name (not empty, '.' or '..', no '/' or '\\'), e.g. run.name=exp1"
        )
    _validate_moe(cfg)
    _validate_finetune(cfg)
    _validate_compile(cfg)
    return cfg


def _check_types(cfg: Config) -> None:
    """A Config whose every section is its dataclass and every field its type (a Config built or edited in
    Python is checked as the command line's strings are): ConfigError naming the setting and what it expects."""
    if isinstance(cfg, type):
        raise ConfigError(f"the config given is the class {cfg.__name__} itself: give an instance, plait.Config()")
    if isinstance(cfg, dict):
        raise ConfigError(
            "the config given is a dict: turn it into one with plait.config.from_dict({'train': {'steps': 100}}), "
            "or use plait.load_config(None, ['train.steps=100'])"
        )
    if not isinstance(cfg, Config):
        raise ConfigError(
            f"the config given is {_a(type(cfg).__name__)} ({cfg!r:.60}), not a plait.Config: give plait.Config() "
            f"(then set its fields), a TOML path, or plait.load_config(path, ['train.steps=100'])"
        )
    for section, cls in SECTIONS.items():
        body = getattr(cfg, section, None)
        if not isinstance(body, cls):
            raise ConfigError(
                f"config section '{section}' is {_a(type(body).__name__)}, not a {cls.__name__}: set its fields "
                f"(cfg.{section}.key = value), or build the config with plait.config.from_dict"
            )
        for name, typ in _hints(cls).items():
            setattr(body, name, _convert(f"{section}.{name}", getattr(body, name), typ))


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _validate_moe(cfg: Config) -> None:
    m, p = cfg.model, cfg.parallel
    _non_negative("model", m, ["moe_experts", "moe_hidden_dim", "moe_shared_experts", "moe_dense_layers"])
    _non_negative("model", m, ["moe_aux_loss", "moe_bias_rate"])
    if p.ep_degree > 1 and not m.moe_experts:
        raise ConfigError(
            f"parallel.ep_degree={p.ep_degree} splits a mixture of experts, but this model is dense "
            "(model.moe_experts=0); set parallel.ep_degree=1, or choose an MoE model (e.g. model.preset=moe-debug)"
        )
    if not m.moe_experts:
        return
    if m.moe_experts % p.ep_degree:
        ok = [d for d in range(1, m.moe_experts + 1) if m.moe_experts % d == 0]
        raise ConfigError(
            f"parallel.ep_degree={p.ep_degree} must divide model.moe_experts={m.moe_experts} (each ep rank holds "
            f"an equal share of the experts); choose ep_degree in {ok}"
        )
    if not 1 <= m.moe_top_k <= m.moe_experts:
        raise ConfigError(f"model.moe_top_k={m.moe_top_k} must be in [1, model.moe_experts={m.moe_experts}]")
    if m.moe_score not in ("softmax", "sigmoid"):
        raise ConfigError(f"model.moe_score={m.moe_score!r}: choose 'softmax' or 'sigmoid'")
    if m.moe_dense_layers >= m.n_layers:
        raise ConfigError(
            f"model.moe_dense_layers={m.moe_dense_layers} leaves no MoE block of model.n_layers={m.n_layers}; "
            "lower it, or set model.moe_experts=0 for a dense model"
        )
    if cfg.compile.enabled:  # the tokens per expert change every step: a compiled block would recompile
        raise ConfigError(
            f"compile.enabled=true with a mixture-of-experts model (model.moe_experts={m.moe_experts}) is not "
            "supported yet (each expert's token count changes every step); set compile.enabled=false"
        )


def _validate_compile(cfg: Config) -> None:
    c, p = cfg.compile, cfg.parallel
    if c.float8 == "true" and not c.enabled:
        raise ConfigError("compile.float8=true needs compile.enabled=true (torchao's float8 casts are fast compiled)")
    if c.enabled and p.tp_degree > 1:
        # Seen with torch 2.13 (shared/TORCH-ON-CPU.md): per-block compile under FSDP2 + TP gives silently wrong
        # gradients (loss off by 2e-3 after 4 steps); TP alone crashes in backward; whole-model compile fails.
        raise ConfigError(
            f"compile.enabled=true with parallel.tp_degree={p.tp_degree} is refused: torch.compile with tensor "
            "parallelism is broken in torch 2.13 (FSDP2 + TP trains on silently wrong gradients; TP alone fails in "
            "backward with \"'Tensor' object has no attribute '_local_tensor'\"); set parallel.tp_degree=1 or "
            "compile.enabled=false"
        )
    if c.enabled and p.pp_degree > 1 and p.pp_schedule == "zero_bubble":
        raise ConfigError(
            "compile.enabled=true with parallel.pp_schedule='zero_bubble' is refused: zero-bubble splits each "
            "stage's backward into separate input- and weight-gradient passes, not verified through compiled "
            "blocks (plait's compile tests run 1f1b); use pp_schedule='1f1b', or compile.enabled=false"
        )


def _validate_finetune(cfg: Config) -> None:
    f = cfg.finetune
    _non_negative("finetune", f, ["lora_rank"])
    if not f.lora_rank:
        return
    _positive("finetune", f, ["lora_alpha"])
    if not 0 <= f.lora_dropout < 1:
        raise ConfigError(f"finetune.lora_dropout={f.lora_dropout} must be in [0, 1), e.g. 0.05")
    targets = [t.strip() for t in f.lora_targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if not targets or unknown:
        raise ConfigError(
            f"finetune.lora_targets={f.lora_targets!r} must name layers from {', '.join(LORA_TARGETS)}, "
            f"e.g. 'wq,wk,wv,wo'"
        )
    if not f.init_from:
        raise ConfigError(
            f"finetune.lora_rank={f.lora_rank} adapts a trained model: set finetune.init_from to its checkpoint, "
            f"run directory or Hugging Face directory"
        )
    if cfg.parallel.tp_degree > 1 or cfg.parallel.pp_degree > 1:
        raise ConfigError(
            "finetune.lora_rank > 0 runs on one process or data parallel (DDP/FSDP/HSDP): set "
            "parallel.tp_degree=1 and parallel.pp_degree=1"
        )


def _positive(section: str, obj, names: list[str]) -> None:
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise ConfigError(f"{section}.{name}={value} must be positive")


def _non_negative(section: str, obj, names: list[str]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 0:
            raise ConfigError(f"{section}.{name}={value} must not be negative")


def _divisors(n: int, limit: int | None = None) -> str:
    divs = [k for k in range(1, n + 1) if n % k == 0 and (limit is None or k <= limit)]
    return "{" + ", ".join(map(str, divs)) + "}"


# ------------------------------------------------------------------------------------- help and output


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under dataclass fields (Python does not keep them, so read the source)."""
    docs: dict[str, str] = {}
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    for node, nxt in zip(body, body[1:], strict=False):
        documented = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and documented:
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def options_help() -> str:
    """Every option as `--section.key` with its type, default and docstring (the CLI prints this)."""
    default = Config()
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        if section == "model":
            lines.append(f"  --model.preset NAME  Start from a preset shape: {', '.join(PRESETS)}. (tiny)")
        docs = field_docs(cls)
        for name, typ in _hints(cls).items():
            value = getattr(getattr(default, section), name)
            choices = typing.get_args(typ) if typing.get_origin(typ) is Literal else None
            kind = "|".join(choices) if choices else _type_name(typ).split()[1]
            lines.append(f"  --{section}.{name} {kind.upper()}  {docs.get(name, '')} ({value!r})")
    return "\n".join(lines)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML: every section, every key (values are plain scalars)."""
    out = []
    for section, body in to_dict(cfg).items():
        out.append(f"[{section}]")
        out.extend(f"{key} = {_toml_value(value)}" for key, value in body.items())
        out.append("")
    return "\n".join(out)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float):
        return repr(value)
    return str(value)


def from_dict(data: dict[str, dict[str, Any]]) -> Config:
    """A validated config from {section: {key: value}} (as to_dict gives it, or a checkpoint holds it); keys
    not given keep their defaults."""
    if not isinstance(data, dict):
        raise ConfigError(f"from_dict takes {{section: {{key: value}}}}, not {_a(type(data).__name__)}")
    return validate(_build(data))
