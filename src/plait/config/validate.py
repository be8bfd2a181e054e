"""Every check of a config that needs no data and no device, run before any worker starts: ConfigError on the
first, naming the setting and a valid value."""

from __future__ import annotations

import math

from plait.config.fields import convert, hints
from plait.config.sections import LORA_TARGETS, SECTIONS, Config, LogConfig
from plait.core.errors import ConfigError


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
    _validate_ranges(cfg)
    _validate_guard(cfg)
    _validate_model(cfg)
    _validate_data(cfg)
    _validate_keep_best(cfg)
    _validate_training(cfg)
    _validate_run(cfg)
    _validate_moe(cfg)
    _validate_finetune(cfg)
    _validate_compile(cfg)
    _validate_retrieval(cfg)
    return cfg


def _validate_retrieval(cfg: Config) -> None:
    """RETRO (model.retrieval_layers): blocks that exist, chunks that fit the sequence (the layouts it takes:
    plait.parallel.rules, tp_problem, cp_problem and pp_problem)."""
    m = cfg.model
    for name in ("retrieval_dim", "retrieval_refresh_steps"):  # the learned retriever's settings: no silent no-op
        if not m.retrieval_learned and getattr(m, name) != getattr(type(m)(), name):
            raise ConfigError(
                f"model.{name}={getattr(m, name)} sets the learned retriever, which is off: set "
                f"model.retrieval_learned=true too, or leave model.{name} at its default"
            )
    if not m.retrieval_layers.strip():
        for name, what in (("retrieval_copy", "copies from"), ("retrieval_pointer", "copies from"),
                           ("retrieval_learned", "learns the retriever that finds")):  # fmt: skip
            if getattr(m, name):
                raise ConfigError(
                    f"model.{name}=true {what} the neighbours of a retrieval model: set "
                    f"model.retrieval_layers too (e.g. '1'), or model.{name}=false"
                )
        return
    try:
        ids = m.retrieval_ids
    except ValueError:
        raise ConfigError(
            f"model.retrieval_layers={m.retrieval_layers!r} must list block indices, e.g. '1,3'"
        ) from None
    if not ids or ids[0] < 0 or ids[-1] >= m.n_layers:
        raise ConfigError(
            f"model.retrieval_layers={m.retrieval_layers!r} must name blocks 0 to {m.n_layers - 1} (model.n_layers="
            f"{m.n_layers}), e.g. '{m.n_layers // 2}'"
        )
    _positive("model", m, ["retrieval_chunk", "retrieval_k", "retrieval_encoder_layers"])
    if m.retrieval_learned:
        if not m.retrieval_pointer:
            raise ConfigError(
                "model.retrieval_learned=true learns the retriever through the pointer's likelihood, marginalised "
                "over the neighbours: set model.retrieval_pointer=true too, or model.retrieval_learned=false"
            )
        _positive("model", m, ["retrieval_dim", "retrieval_refresh_steps"])
    if cfg.data.seq_len % m.retrieval_chunk:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} is not a multiple of model.retrieval_chunk={m.retrieval_chunk}: a "
            f"sequence is retrieved for chunk by chunk"
        )
    if 2 * m.retrieval_chunk > m.max_seq_len:
        raise ConfigError(
            f"model.retrieval_chunk={m.retrieval_chunk}: a neighbour (2 chunks) must fit model.max_seq_len="
            f"{m.max_seq_len}"
        )


def _validate_ranges(cfg: Config) -> None:
    """Every count and rate in its range (positive, or zero where zero means off)."""
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


def _validate_guard(cfg: Config) -> None:
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


def _validate_model(cfg: Config) -> None:
    m, d = cfg.model, cfg.data
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


def data_sources(text: str) -> list[tuple[str, str, float]]:
    """data.sources parsed: (name, directory, weight) per source, weights as given (relative)."""
    out: list[tuple[str, str, float]] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        head, sep, weight = item.rpartition(":")
        name, eq, path = head.partition("=") if "=" in head.split("/")[0] else ("", "", head)
        try:
            value = float(weight) if sep else float("nan")
        except ValueError:
            value = float("nan")
        if not sep or not path or not math.isfinite(value):
            raise ConfigError(
                f"data.sources item {item!r} is not [NAME=]DIR:WEIGHT; e.g. data.sources='web=/data/web:0.7,"
                "code=/data/code:0.3'"
            )
        if value <= 0:
            raise ConfigError(f"data.sources item {item!r}: the weight {weight} must be positive (e.g. 0.2)")
        name = name.strip() or path.rstrip("/").rsplit("/", 1)[-1]
        if not name.replace("-", "_").replace(".", "_").isidentifier():
            raise ConfigError(
                f"data.sources item {item!r}: the name {name!r} must be letters, digits, '_', '-' or '.' (it names "
                "metrics); give one: NAME=DIR:WEIGHT"
            )
        if name in [n for n, _, _ in out]:
            raise ConfigError(f"data.sources names {name!r} twice: give each source its own name, NAME=DIR:WEIGHT")
        out.append((name, path.strip(), value))
    if not math.isfinite(sum(w for _, _, w in out)):  # each finite, yet 1e308 + 1e308 is inf: every share 0
        raise ConfigError(
            f"data.sources weights {', '.join(f'{w:g}' for _, _, w in out)} add up to more than a float holds: "
            "give relative weights of a finite sum, e.g. 0.7 and 0.3"
        )
    return out


def mixture_shares(text: str) -> dict[str, float]:
    """Each source's share of data.sources (weights normalised), by name."""
    sources = data_sources(text)
    total = sum(w for _, _, w in sources)
    return {n: w / total for n, _, w in sources}


def _validate_keep_best(cfg: Config) -> None:
    c, every = cfg.checkpoint, cfg.eval.every_steps
    if not c.keep_best:
        return
    if not every:
        raise ConfigError("checkpoint.keep_best=true keeps the best validation loss: set eval.every_steps (e.g. 100)")
    if c.every_steps % every:
        raise ConfigError(
            f"checkpoint.keep_best=true with checkpoint.every_steps={c.every_steps} and eval.every_steps={every}: "
            f"saved steps would have no validation loss; make checkpoint.every_steps a multiple of {every}"
        )


def _validate_data(cfg: Config) -> None:
    d = cfg.data
    if not d.sources:
        return
    if d.source != "shakespeare":
        raise ConfigError(
            f"data.source={d.source!r} and data.sources={d.sources!r} are both set: a run reads one directory "
            "(data.source) or a mixture (data.sources); unset one"
        )
    if not data_sources(d.sources):
        raise ConfigError(f"data.sources={d.sources!r} names no source; e.g. 'web=/data/web:0.7,code=/data/code:0.3'")


def _validate_muon(o) -> None:
    if not 0 <= o.muon_momentum < 1:
        raise ConfigError(f"optim.muon_momentum={o.muon_momentum} must be in [0, 1), e.g. 0.95")
    if not 0 <= o.muon_ns_steps <= 20:
        raise ConfigError(f"optim.muon_ns_steps={o.muon_ns_steps} must be in [0, 20], e.g. 5 (torch.optim.Muon's)")
    if o.name == "muon" and o.state_dtype == "bf16":
        raise ConfigError(
            "optim.name='muon' with optim.state_dtype='bf16' is not supported yet (Muon keeps one fp32 momentum "
            "buffer a matrix, a third of AdamW's states already); set optim.state_dtype='fp32'"
        )


def _validate_training(cfg: Config) -> None:
    t, o = cfg.train, cfg.optim
    if not 0 < cfg.sample.top_p <= 1:
        raise ConfigError(f"sample.top_p={cfg.sample.top_p} must be in (0, 1]")
    if o.min_lr_ratio > 1:
        raise ConfigError(f"optim.min_lr_ratio={o.min_lr_ratio} must be at most 1")
    if not (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1):
        raise ConfigError(f"optim.beta1={o.beta1} and optim.beta2={o.beta2} must be in [0, 1), e.g. 0.9, 0.95")
    if not 0 < o.decay_fraction <= 1:
        raise ConfigError(f"optim.decay_fraction={o.decay_fraction} must be in (0, 1], e.g. 0.2")
    _validate_muon(o)
    if t.micro_batch_size and t.global_batch_size % t.micro_batch_size:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not a multiple of "
            f"train.micro_batch_size={t.micro_batch_size}; choose micro_batch_size in "
            f"{_divisors(t.global_batch_size)}"
        )


def _validate_run(cfg: Config) -> None:
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
            f"the config given is {a_or_an(type(cfg).__name__)} ({cfg!r:.60}), not a plait.Config: give plait.Config() "
            f"(then set its fields), a TOML path, or plait.load_config(path, ['train.steps=100'])"
        )
    for section, cls in SECTIONS.items():
        body = getattr(cfg, section, None)
        if not isinstance(body, cls):
            raise ConfigError(
                f"config section '{section}' is {a_or_an(type(body).__name__)}, not a {cls.__name__}: set its fields "
                f"(cfg.{section}.key = value), or build the config with plait.config.from_dict"
            )
        for name, typ in hints(cls).items():
            setattr(body, name, convert(f"{section}.{name}", getattr(body, name), typ))


def a_or_an(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _validate_moe(cfg: Config) -> None:
    # How the experts split over ranks (parallel.ep_degree) is a layout rule: plait.parallel.rules.ep_problem.
    m = cfg.model
    _non_negative("model", m, ["moe_experts", "moe_hidden_dim", "moe_shared_experts", "moe_dense_layers"])
    _non_negative("model", m, ["moe_aux_loss", "moe_bias_rate"])
    if not m.moe_experts:
        return
    if not 1 <= m.moe_top_k <= m.moe_experts:
        raise ConfigError(f"model.moe_top_k={m.moe_top_k} must be in [1, model.moe_experts={m.moe_experts}]")
    if m.moe_score not in ("softmax", "sigmoid"):
        raise ConfigError(f"model.moe_score={m.moe_score!r}: choose 'softmax' or 'sigmoid'")
    if m.moe_dense_layers >= m.n_layers:
        raise ConfigError(
            f"model.moe_dense_layers={m.moe_dense_layers} leaves no MoE block of model.n_layers={m.n_layers}; "
            "lower it, or set model.moe_experts=0 for a dense model"
        )
    # Compiled MoE blocks run their experts as grouped matmuls (static shapes, offsets on the device; the
    # per-expert loop needs each expert's token count on the host, a graph break), which are bf16 kernels; the
    # device's side is checked when the blocks are compiled (plait.parallel.compile), the layouts they run in
    # by plait.parallel.rules.compile_problem.
    if cfg.compile.enabled and cfg.train.mixed_precision == "fp32":
        raise ConfigError(
            "compile.enabled=true with a mixture-of-experts model needs train.mixed_precision='bf16' (or 'auto' on "
            "a bf16 GPU): compiled experts run as grouped bf16 matmuls; set it, or compile.enabled=false"
        )


def _validate_compile(cfg: Config) -> None:
    """compile's own settings; the layouts compiled blocks run in: plait.parallel.rules.compile_problem."""
    c = cfg.compile
    if c.float8 == "true" and not c.enabled:
        raise ConfigError("compile.float8=true needs compile.enabled=true (torchao's float8 casts are fast compiled)")
    if c.float8_recipe != "tensorwise" and c.float8 == "false":
        raise ConfigError(
            f"compile.float8_recipe={c.float8_recipe} takes effect only with float8 matmuls: set compile.float8=true "
            "or auto (with compile.enabled=true), or leave compile.float8_recipe unset"
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
    # the layouts adapters train in: plait.parallel.rules.lora_problem


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
