"""The job configuration's sections: one typed dataclass each, every field's docstring its `--help` text."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from plait.model.args import LORA_TARGETS, ModelArgs  # noqa: F401 (LORA_TARGETS: plait.config hands it out)
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
    """'shakespeare' (the bundled corpus, prepared on first use), a directory from `plait data prepare`, or
    such a directory on S3 (s3://bucket/prefix), read in place."""
    sources: str = ""
    """A weighted mixture of prepared directories (local or s3://) instead of data.source: comma-separated
    [NAME=]DIR:WEIGHT,
    e.g. 'web=/data/web:0.7,code=/data/code:0.2,books=/data/books:0.1' (NAME defaults to the directory's
    name; weights are relative). Every global batch holds each source's share to within one sequence, in an
    order drawn from run.seed; each source's tokens seen and validation loss are reported."""
    cache_dir: str = "~/.cache/plait/data"
    """Where the bundled corpus is tokenised and cached."""
    document_mask: bool = False
    """Attend each document of a packed sequence alone (the EOS token ends one; positions restart at 0 after
    it), as Llama 3 trains: one process, DDP, FSDP/HSDP, TP+SP, CP, EP and pipelines, eager or compiled. A
    document longer than seq_len is cut at the window's end, each piece attended alone."""
    remote_cache_mb: int = 256
    """A corpus on S3 (data.source=s3://bucket/prefix, with checkpoint.s3_endpoint and the AWS_* credentials):
    MiB of 1 MiB blocks each split keeps in memory, least recently used out first."""
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
    name: Literal["adamw", "muon"] = "adamw"
    """'adamw', or 'muon': orthogonalised momentum for the blocks' matrices, each expert's and LoRA adapters',
    AdamW (these same settings) for embeddings, head, norms, biases and routers (plait.engine.muon). lr and
    weight_decay carry over from AdamW (Moonlight's RMS match)."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """Decay after warm-up: 'cosine', 'wsd' (warmup-stable-decay, linear decay at the end) or 'constant'."""
    warmup_steps: int = 100
    """Linear warm-up steps (100: the default job's held-out loss was lower than with 30 at every peak tried;
    docs/measurements.md: optim: the default schedule)."""
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
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov), as torch.optim.Muon's default."""
    muon_ns_steps: int = 5
    """Muon's Newton-Schulz iterations per step, as torch.optim.Muon's default. 0 is the control, not Muon: the
    momentum un-orthogonalised, scaled to Muon's update size (plait.parallel.orthogonal.newton_schulz)."""
    muon_ns_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Muon's Newton-Schulz arithmetic: 'auto' is bf16 on a GPU (as torch.optim.Muon) and fp32 on a CPU."""
    state_dtype: Literal["fp32", "bf16"] = "fp32"
    """AdamW's two moments: 'fp32', or 'bf16' with stochastic rounding (plait.engine.bf16_adamw): 12 bytes a
    parameter instead of 16, for runs whose states do not fit (llama3-8b with CPU offload on a 128 GiB host)."""


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
    plot: bool = True
    """Draw <run>/loss.png (loss, gradient norm, LR, throughput; a mixture of experts also moe_load.png):
    redrawn at evaluations at most once a minute and within 2% of the time, and at the end. Needs matplotlib
    (the `plot` extra)."""
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
    keep_best: bool = False
    """Also keep the checkpoint with the lowest validation loss (among those saved at a step with an
    evaluation: every_steps a multiple of eval.every_steps)."""
    async_enabled: bool = True
    """Write checkpoints in the background: the loop waits only while the state is copied to CPU memory."""
    dir: str = ""
    """Where checkpoints go: a directory or s3://bucket/prefix ('' = <run.out_dir>/<run.name>/checkpoints)."""
    s3_endpoint: str = ""
    """S3 endpoint URL for s3:// checkpoints, e.g. http://127.0.0.1:8333 ('' = AWS, or $AWS_ENDPOINT_URL);
    credentials come from the usual AWS environment variables or profile."""
    adopt: bool = False
    """Continue the run whose checkpoints are in checkpoint.dir although it had another run.name (without
    this, a checkpoint.dir holding another run's checkpoints is refused, naming that run)."""
    fresh_optimizer: bool = False
    """Resume the weights, the step, the data position and the LR schedule, but start the optimizer's states
    afresh: to switch optim.name (a checkpoint of another optimizer is refused without it)."""


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
    fault_tolerant: bool = False
    """This job is one replica group of a fault-tolerant run (torchft): groups average their gradients over the
    groups alive at each step, a lost group drops out while the others step on, and a restarted one heals from a
    live peer (no checkpoint read). `plait train --replicas R` starts R groups and their lighthouse; inside a
    group every layout works, across groups dp_replicate_degree stays 1 (the groups are the replicas)."""
    replica_id: int = 0
    """This group's number in a fault-tolerant run (set by `plait train --replicas`; one per job under Slurm)."""
    lighthouse: str = ""
    """The torchft lighthouse of a fault-tolerant run, http://HOST:PORT: `plait train --replicas` starts one and
    sets it; several jobs (Slurm) name the one started by `plait lighthouse`."""
    min_replicas: int = 1
    """A fault-tolerant step commits only where at least this many groups took part in it."""
    start_replicas: int = 0
    """A fault-tolerant launch's first step (fresh or resumed) waits (up to 2 minutes) for this many groups, so
    that none starts alone (`plait train --replicas R` sets R); 0: the first step takes the groups that are
    there. A group restarted alone does not wait: it heals from the others."""
    diloco_sync_every: int = 0
    """Fault-tolerant runs: average across the groups every this many steps (DiLoCo, low-communication: each
    group steps alone in between, then the groups average their weights' change and an outer Nesterov step
    applies it: plait.engine.diloco); 0 or 1: every step (synchronous)."""
    diloco_outer_lr: float = 0.7
    """DiLoCo's outer learning rate (the paper's 0.7)."""
    diloco_outer_momentum: float = 0.9
    """DiLoCo's outer Nesterov momentum (the paper's 0.9)."""
    contribution_check: bool = True
    """Fault-tolerant runs: check each group's gradient against the others' before averaging (non-finite, a norm
    or direction far from the rest: plait.parallel.replicas.contributions) and leave an offender out, by name;
    repeated offenders are quarantined, and a norm 4x to 32x the median is clipped to 4x. Needs 3 or more groups
    to compare (with 2, only non-finite values)."""


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
    Off by default: the first step then compiles (tens of seconds; docs/measurements.md, "compile: first
    step") and CPUs gain little; on a GPU turn it on (see docs/performance.md)."""
    mode: Literal["default", "max-autotune-no-cudagraphs", "max-autotune"] = "default"
    """'default': quick compile, fused element-wise kernels; 'max-autotune-no-cudagraphs': also benchmarks
    matmul and attention kernel choices (minutes of compile, faster steps); 'max-autotune': also CUDA graphs
    (least launch overhead, more memory; not for FSDP, whose parameters move every step)."""
    strict: bool = False
    """Stop with an error, instead of a warning, when a compiled block recompiles after the first step."""
    cache_dir: str = ""
    """Persistent compile cache (Inductor and Triton caches plus one mega-cache file that a restarted or
    scaled-out job loads first), signed by plait and checked before torch reads it: a directory, or an
    s3://bucket/prefix (checkpoint.s3_endpoint and credentials) shared by a job's nodes; `plait compile` fills
    it ahead of the job; empty: <run.out_dir>/<run.name>/compile_cache."""
    float8: Literal["false", "true", "auto"] = "false"
    """Float8 matmuls in the transformer blocks through torchao. 'true': every block linear layer whose sizes
    are multiples of 16, refused where it cannot run (needs compile.enabled, torchao and an NVIDIA GPU of compute
    capability 8.9+: H100, H200, L4, L40S); 'auto': on where it can run and pays (the layers torchao's own
    heuristic expects to gain for compile.float8_recipe), off elsewhere, saying why at start-up. Under FSDP the
    float8 weights are all-gathered in float8 (tensorwise)."""
    float8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """How compile.float8 scales: 'tensorwise', one scale per tensor (the fastest; under FSDP the weights are
    all-gathered in float8); 'rowwise', one scale per row of each operand, rounded to a power of 2 (torchao's
    rowwise recipe: closer to bf16, more work per matmul; the weights are all-gathered in bf16, as torchao's
    float8 all-gather takes tensorwise scales only). compile.float8=auto picks the layers by this recipe's own
    heuristic. Takes effect only with compile.float8=true or auto."""


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


_SECTION_TYPES = typing.get_type_hints(Config)  # once: it evaluates every annotation
SECTIONS: dict[str, type] = {f.name: _SECTION_TYPES[f.name] for f in dataclasses.fields(Config)}
