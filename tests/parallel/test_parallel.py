"""Every supported layout reproduces the single-process run: 10 steps on real multi-process gloo groups.

Tolerances (relative, fp32), both 1e-5: a layout computes the same sums as one process in another order
(data parallelism averages per-rank means, tensor parallelism splits matmul reductions, FSDP reduce-scatters
gradients), so results move by fp32 rounding only. The oracle is run at lr 1e-3: at 3e-3 this tiny model has
loss spikes where the gradient norm is so sensitive that plain gradient accumulation in one process (a pure
reordering) already moves it by 1.5e-4. And with run.seed=1 (SEED): under seed 0 the tenth batch makes the
gradient norm hang on the order of fp32 sums. Measured on an Intel Xeon, one process with one intra-op thread
against two (the same weights: steps 1-9 bitwise equal) differs there by 3.3e-5, every multi-process layout by
1.6e-5 to 2.9e-5, which fails 1e-5 on that CPU and passed on AMD EPYC by chance. Under seed 1 one and two
threads agree bitwise at every step and the worst layout is 2.2e-7 off (the same Xeon): 45x inside 1e-5.
"""

from pathlib import Path

import pytest

from parallel_harness import read_metrics, run_layouts
from plait.config import load_config
from plait.core.errors import ConfigError
from plait.model import preset_args
from plait.parallel import ParallelDims, validate_layout
from plait.parallel.pipeline import split_layers

LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-5
STEPS = 10

SEED = 1
"""The oracle's seed (weights and data order): see the module's docstring."""


def base(data_dir: Path) -> list[str]:
    return [
        "model.preset=debug",
        "model.ffn_hidden_dim=96",  # selective recompute as two units per block at tp 2, as one region at tp 1
        f"data.source={data_dir}",
        "data.seq_len=32",
        "train.global_batch_size=8",
        f"train.steps={STEPS}",
        "optim.warmup_steps=2",
        "optim.lr=1e-3",
        f"run.seed={SEED}",
        "eval.every_steps=5",
        "eval.num_batches=2",
        "log.every_steps=1",
        "sample.max_new_tokens=0",
        "checkpoint.save_final=false",
        "log.tensorboard=false",
        "log.plot=false",
        "data.prefetch=0",
        "run.device=cpu",
    ]


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    from plait.api import train

    out = tmp_path_factory.mktemp("ref")
    train(load_config(None, [*base(data_dir), f"run.out_dir={out}", "run.name=ref"]))
    assert not list((out / "ref").glob("*.png"))  # log.plot=false (the jobs' pictures cost more than their steps)
    return read_metrics(out / "ref")


def check(name: str, got: dict, ref: dict) -> None:
    assert "error" not in got, got.get("error")
    assert sorted(got["loss"]) == list(range(1, STEPS + 1)), name
    for step in ref["loss"]:
        assert got["loss"][step] == pytest.approx(ref["loss"][step], rel=LOSS_RTOL), f"{name} loss @ {step}"
        assert got["grad_norm"][step] == pytest.approx(ref["grad_norm"][step], rel=GRAD_NORM_RTOL), (
            f"{name} grad norm @ {step}"
        )
    for step in ref["val_loss"]:
        assert got["val_loss"][step] == pytest.approx(ref["val_loss"][step], rel=LOSS_RTOL), f"{name} val @ {step}"


LAYOUTS = {
    2: {
        "TP+SP": ["parallel.tp_degree=2"],
        "TP+SP, selective AC": ["parallel.tp_degree=2", "parallel.activation_checkpoint=selective"],
        "PP gpipe": ["parallel.pp_degree=2", "parallel.pp_schedule=gpipe"],
        "PP 1f1b, full AC": [
            "parallel.pp_degree=2",
            "parallel.pp_schedule=1f1b",
            "parallel.activation_checkpoint=full",
        ],
        "PP interleaved 1f1b": [
            "parallel.pp_degree=2",
            "parallel.pp_schedule=interleaved_1f1b",
            "parallel.pp_virtual_stages=2",
        ],
        "PP zero bubble": ["parallel.pp_degree=2", "parallel.pp_schedule=zero_bubble", "parallel.pp_virtual_stages=2"],
        "CP 2": ["parallel.cp_degree=2"],
        "CP 2, selective AC, accumulation": [
            "parallel.cp_degree=2",
            "parallel.activation_checkpoint=selective",
            "train.micro_batch_size=2",
        ],
    },
    4: {
        "DP": ["parallel.dp_replicate_degree=4", "parallel.dp_shard_degree=1"],
        "FSDP": ["parallel.dp_shard_degree=4"],
        "FSDP, full AC, accumulation": [
            "parallel.dp_shard_degree=4",
            "parallel.activation_checkpoint=full",
            "train.micro_batch_size=1",
        ],
        "HSDP 2x2": ["parallel.dp_replicate_degree=2", "parallel.dp_shard_degree=2"],
        "HSDP 2x2, accumulation, reduce every micro-batch": [
            "parallel.dp_replicate_degree=2",
            "parallel.dp_shard_degree=2",
            "train.micro_batch_size=1",
            "parallel.fsdp_reduce_every_micro_batch=true",
        ],
        "HSDP 2x2, selective AC": ["parallel.dp_replicate_degree=2", "parallel.activation_checkpoint=selective"],
        "FSDP+TP": ["parallel.dp_shard_degree=2", "parallel.tp_degree=2"],
        "FSDP+TP, full AC": ["parallel.tp_degree=2", "parallel.activation_checkpoint=full"],
        "FSDP+TP, selective AC (recompute units)": ["parallel.tp_degree=2", "parallel.activation_checkpoint=selective"],
        "PP+TP, selective AC (recompute units)": [
            "parallel.pp_degree=2",
            "parallel.tp_degree=2",
            "parallel.activation_checkpoint=selective",
        ],
        "PP+FSDP": ["parallel.pp_degree=2", "parallel.dp_shard_degree=2"],
        "PP+FSDP, reduce every micro-batch": [
            "parallel.pp_degree=2",
            "parallel.dp_shard_degree=2",
            "parallel.fsdp_reduce_every_micro_batch=true",
        ],
        "PP+TP": ["parallel.pp_degree=2", "parallel.tp_degree=2"],
        "FSDP, CPU offload": ["parallel.dp_shard_degree=4", "parallel.cpu_offload=true"],
        "CP 4": ["parallel.cp_degree=4"],
        "FSDP 2 x CP 2": ["parallel.dp_shard_degree=2", "parallel.cp_degree=2"],
        "HSDP 2 x CP 2, full AC": ["parallel.dp_replicate_degree=2", "parallel.cp_degree=2"]
        + ["parallel.activation_checkpoint=full"],
        "TP 2 x CP 2, selective AC (recompute units)": ["parallel.tp_degree=2", "parallel.cp_degree=2"]
        + ["parallel.activation_checkpoint=selective"],
        "PP 2 x CP 2": ["parallel.pp_degree=2", "parallel.cp_degree=2"],
        "PP 2 x CP 2, interleaved, selective AC": ["parallel.pp_degree=2", "parallel.cp_degree=2"]
        + [
            "parallel.pp_schedule=interleaved_1f1b",
            "parallel.pp_virtual_stages=2",
            "parallel.activation_checkpoint=selective",
        ],
    },
    8: {
        "pp2 x dp2 x tp2": ["parallel.pp_degree=2", "parallel.tp_degree=2"],
        "pp2 x dp2 x tp2, full AC, interleaved": [
            "parallel.pp_degree=2",
            "parallel.tp_degree=2",
            "parallel.activation_checkpoint=full",
            "parallel.pp_schedule=interleaved_1f1b",
            "parallel.pp_virtual_stages=2",
        ],
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_layouts_match_single_process(world, data_dir, reference):
    jobs = {name: [*base(data_dir), *extra] for name, extra in LAYOUTS[world].items()}
    results = run_layouts(world, list(jobs.values()))
    for name, got in zip(jobs, results, strict=True):
        check(f"{name} (world {world})", got, reference)


WINDOW_AND_BIAS = ["model.sliding_window=8", "model.qkv_bias=true"]  # a window of 8 over data.seq_len=32


@pytest.mark.slow
def test_sliding_window_and_qkv_bias_match_single_process(data_dir, tmp_path):
    """Mistral/Qwen2 attention under TP+SP (the window's mask is the same for every head, so it holds on each
    rank's share of the heads; attention sees the whole gathered sequence) and FSDP (the biases sharded as
    1-D parameters, initialised from their rows like any other)."""
    from plait.api import train

    train(load_config(None, [*base(data_dir), *WINDOW_AND_BIAS, f"run.out_dir={tmp_path}", "run.name=ref"]))
    reference = read_metrics(tmp_path / "ref")
    layouts = {"TP+SP": ["parallel.tp_degree=2"], "FSDP": ["parallel.dp_shard_degree=2"]}
    results = run_layouts(2, [[*base(data_dir), *WINDOW_AND_BIAS, *extra] for extra in layouts.values()])
    for name, got in zip(layouts, results, strict=True):
        check(f"{name} with a sliding window and q/k/v biases", got, reference)


QWEN3_ATTENTION = ["model.qk_norm=true", "model.attention_head_dim=32"]  # 32 != dim / n_heads = 16


@pytest.mark.slow
def test_qk_norm_and_own_head_size_match_single_process(data_dir, tmp_path):
    """Qwen3's attention (per-head q/k norms, a head size apart from dim / n_heads) under FSDP (the norm
    weights sharded like any 1-D parameter), context parallel (the norms are per token) and tensor parallel
    (each rank normalises its heads with the whole weights, whose gradients FSDP sums over tp: plait.parallel.dims
    tp_whole; selective recompute in units, whose regions then hold those FSDP modules)."""
    from plait.api import train

    train(load_config(None, [*base(data_dir), *QWEN3_ATTENTION, f"run.out_dir={tmp_path}", "run.name=ref"]))
    reference = read_metrics(tmp_path / "ref")
    layouts = {
        "FSDP": ["parallel.dp_shard_degree=2"],
        "CP": ["parallel.cp_degree=2"],
        "TP": ["parallel.tp_degree=2"],
        "TP, selective AC": ["parallel.tp_degree=2", "parallel.activation_checkpoint=selective"],
    }
    results = run_layouts(2, [[*base(data_dir), *QWEN3_ATTENTION, *extra] for extra in layouts.values()])
    for name, got in zip(layouts, results, strict=True):
        check(f"{name} with q/k norms and head size 32", got, reference)


# ------------------------------------------------------------------- refused before any worker starts


def layout(*overrides: str, world: int):
    cfg = load_config(None, ["model.preset=debug", "data.seq_len=32", "train.global_batch_size=8", *overrides])
    dims = ParallelDims.from_config(cfg.parallel, world)
    validate_layout(cfg, dims)
    return dims


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (["parallel.tp_degree=4"], 4, r"tp_degree=4 must divide model.n_heads=4 and model.n_kv_heads=2; choose"),
        (["parallel.tp_degree=3"], 3, r"tp_degree=3 must divide"),
        (["parallel.dp_replicate_degree=3"], 4, r"world size 4 is not divisible by dp_replicate x cp x tp x pp = 3"),
        (["parallel.dp_shard_degree=2"], 4, r"= 2, but 4 processes run"),
        (["parallel.pp_degree=8"], 8, r"model.n_layers=4 is fewer than the pipeline stages"),
        (
            ["parallel.pp_degree=2", "parallel.pp_virtual_stages=4", "parallel.pp_schedule=interleaved_1f1b"],
            2,
            r"fewer than the pipeline stages",
        ),
        (["parallel.pp_degree=2", "train.micro_batch_size=8"], 2, r"needs at least pp_degree=2 micro-batches"),
        (["parallel.pp_degree=2", "parallel.pp_virtual_stages=2"], 2, r"runs one stage per rank"),
        (["train.global_batch_size=6"], 4, r"global_batch_size=6 is not divisible by the data-parallel degree 4"),
        (["parallel.pp_degree=2", "model.tie_embeddings=true"], 2, r"cannot be pipelined"),
        (
            ["parallel.pp_degree=2", "parallel.pp_schedule=zero_bubble", "parallel.pp_virtual_stages=2"]
            + ["parallel.fsdp_reduce_every_micro_batch=true"],
            4,
            r"with pp_schedule='zero_bubble' is refused",
        ),
        (["parallel.tp_degree=2", "data.seq_len=33"], 2, r"seq_len=33 must be divisible by parallel.tp_degree"),
        (["parallel.fsdp_reduce_every_micro_batch=true"], 1, r"needs FSDP, which this layout does not use"),
        (["parallel.cp_degree=2", "data.seq_len=30"], 2, r"seq_len=30 must be divisible by 2 x parallel.cp_degree"),
        (["parallel.cp_degree=4", "data.seq_len=36"], 4, r"cp_degree in \[1, 2, 3\]"),
        (["parallel.cp_degree=2", "data.seq_len=33"], 2, r"cp_degree in \[1\]"),  # never an empty list
        (
            ["parallel.cp_degree=2", "parallel.tp_degree=4", "model.n_kv_heads=4", "data.seq_len=36"],
            8,
            r"seq_len / parallel.cp_degree",
        ),
        (["parallel.cp_degree=2", "model.sliding_window=8"], 2, r"sliding_window=8 with parallel.cp_degree=2"),
        (["parallel.cp_degree=0"], 1, r"cp_degree=0 must be at least 1"),
        (["parallel.cp_degree=3"], 4, r"not divisible by dp_replicate x cp x tp x pp = 3"),
        (["parallel.ep_degree=2"], 2, r"ep_degree=2 splits a mixture of experts, but this model is dense"),
    ],
)
def test_impossible_layouts_are_refused(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        layout(*overrides, world=world)


def test_zero_bubble_with_the_fused_head_is_refused_where_torch_cannot_run_it(monkeypatch):
    """torch 2.11's zero-bubble weight pass fails inside autograd on the fused head's custom Function (measured:
    RuntimeError "Attribute '_input_metadata' is invalid"); there the layout is refused before anything starts."""
    import plait.parallel.rules as rules

    zero_bubble = ("parallel.pp_degree=2", "parallel.pp_schedule=zero_bubble", "parallel.pp_virtual_stages=2")
    monkeypatch.setattr(rules, "weight_pass_takes_custom_functions", lambda: False)
    with pytest.raises(ConfigError, match="set train.fused_head=false, use pp_schedule='interleaved_1f1b'"):
        layout(*zero_bubble, world=2)
    layout(*zero_bubble, "train.fused_head=false", world=2)  # the plain head runs there


def test_the_planner_never_picks_a_schedule_this_torch_refuses(monkeypatch):
    """The same rule in the planner's search: where zero bubble cannot run with the fused head, `--layout auto`
    (plait.planner.search) does not offer it; with the plain head, or where torch runs it, it does."""
    import plait.parallel.rules as rules
    from plait.planner.cluster import get_cluster
    from plait.planner.cost import SCHEDULES, Workload
    from plait.planner.search import enumerate_layouts

    cluster = get_cluster("h100", nodes=1, devices_per_node=8)

    def schedules(fused_head: bool) -> set[str]:
        work = Workload(preset_args("llama3-8b"), 4096, 32, "bf16", fused_head)
        return {SCHEDULES[code] for code in set(enumerate_layouts(work, cluster).schedule.tolist())}

    monkeypatch.setattr(rules, "weight_pass_takes_custom_functions", lambda: True)
    assert "zero_bubble" in schedules(True)
    monkeypatch.setattr(rules, "weight_pass_takes_custom_functions", lambda: False)
    assert "zero_bubble" not in schedules(True) and "interleaved_1f1b" in schedules(True)
    assert "zero_bubble" in schedules(False)


def test_dp_shard_is_inferred():
    dims = layout("parallel.pp_degree=2", "parallel.tp_degree=2", world=16)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp) == (2, 1, 4, 2)


def test_stage_split_balances_cost():
    args = preset_args("tiny")  # 4 layers; the output projection (4096 x 192) costs ~2 layers
    assert split_layers(args, 2, "layers") == [[0, 1], [2, 3]]
    assert split_layers(args, 2, "cost") == [[0, 1, 2], [3]]
    big = preset_args("llama3-8b")  # 32 layers; the 128k-vocabulary output costs ~1.8 layers (8192 tokens)
    stages = split_layers(big, 4, "cost", 8192)
    assert [len(s) for s in stages] == [9, 9, 9, 5] and sum(stages, []) == list(range(32))


# ----------------------------------------------------------------------------- loss over scored tokens


@pytest.fixture(scope="module")
def masked_data(data_dir, tmp_path_factory) -> Path:
    """Instruction data whose prompts (masked out of the loss) vary from a few tokens to most of a sequence,
    so micro-batches and data-parallel shards hold very different numbers of scored targets."""
    import json
    import random

    from plait.lifecycle.finetune import prepare_instructions

    root = tmp_path_factory.mktemp("masked")
    rng = random.Random(7)
    words = ["the", "king", "shall", "speak", "to", "all", "his", "lords", "hear", "war", "and", "peace"]
    records = [
        {
            "prompt": " ".join(rng.choice(words) for _ in range(rng.choice([1, 2, 12, 30]))),
            "response": " " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 6))) + ".",
        }
        for _ in range(300)
    ]
    (root / "inst.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    prepare_instructions([root / "inst.jsonl"], root / "data", tokenizer=data_dir / "tokenizer.json")
    return root / "data"


def test_an_all_masked_micro_batch_gives_no_nan():
    """A micro-batch without a scored target contributes 0 to the loss and its gradient (the mean
    cross-entropy of no tokens would be NaN), and the step's loss is the mean over the scored ones."""
    import torch

    from plait.engine.trainer import IGNORE_INDEX, TokenLoss, cross_entropy

    logits = torch.randn(2, 4, 10, requires_grad=True)
    targets = torch.randint(0, 10, (2, 4))
    targets[0] = IGNORE_INDEX  # the first micro-batch (row) has nothing to score
    assert torch.isnan(cross_entropy(logits[:1], targets[:1]))  # what a per-micro-batch mean would give
    meshes = type("M", (), {"dims": ParallelDims(1, 1, 1, 1)})()
    loss_fn = TokenLoss()
    loss_fn.for_step(targets, meshes, num_micro=1)
    total = loss_fn(logits[:1], targets[:1]) + loss_fn(logits[1:], targets[1:])
    total.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0].abs().sum() == 0
    assert total.item() == pytest.approx(cross_entropy(logits[1:], targets[1:]).item(), rel=1e-6)


@pytest.mark.slow
def test_masked_loss_is_the_same_for_every_layout_and_micro_batch(masked_data, tmp_path):
    """Fine-tuning with masked targets: the loss is the mean over every scored token of the global batch, so
    one process (whole batch, or micro-batches of 1), FSDP 2 with micro-batches of 2 and TP 2 x PP 2 give the
    same losses and gradient norms (the fp32 tolerance of the other layouts)."""
    from plait.api import train

    job = [*base(masked_data), "eval.every_steps=0"]
    ref, per_row = tmp_path / "ref", "micro1"
    train(load_config(None, [*job, f"run.out_dir={tmp_path}", "run.name=ref"]))
    train(load_config(None, [*job, "train.micro_batch_size=1", f"run.out_dir={tmp_path}", f"run.name={per_row}"]))
    reference = read_metrics(ref)
    check("one process, micro-batches of 1", read_metrics(tmp_path / per_row), reference)
    (fsdp,) = run_layouts(2, [[*job, "parallel.dp_shard_degree=2", "train.micro_batch_size=2"]])
    check("FSDP 2, micro-batches of 2", fsdp, reference)
    (tp_pp,) = run_layouts(4, [[*job, "parallel.tp_degree=2", "parallel.pp_degree=2", "train.micro_batch_size=2"]])
    check("TP 2 x PP 2, micro-batches of 2", tp_pp, reference)


def _count_reduce_scatters(rank: int, world: int, port: int, reduce_each: bool, out_dir: str) -> None:
    """One step of PP 2 x FSDP 2 with 4 micro-batches per rank; the reduce-scatters FSDP issued."""
    import json

    import torch
    import torch.distributed as dist

    from parallel_harness import join_as_rank
    from plait.engine.trainer import build_trainable, train_step
    from plait.parallel import Meshes
    from plait.parallel.env import init_distributed, shutdown

    join_as_rank(rank, world, port)
    calls = [0]

    def counting(collective):
        def call(*args, **kwargs):
            calls[0] += 1
            return collective(*args, **kwargs)

        return call

    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):  # FSDP2's, by torch version
        if hasattr(dist, name):  # it calls them through the module attribute
            setattr(dist, name, counting(getattr(dist, name)))
    env = init_distributed("cpu", 120)
    try:
        overrides = ["model.preset=debug", "data.seq_len=32", "train.global_batch_size=8", "run.device=cpu"]
        overrides += ["parallel.pp_degree=2", "parallel.dp_shard_degree=2", "train.micro_batch_size=1"]
        cfg = load_config(None, [*overrides, f"parallel.fsdp_reduce_every_micro_batch={str(reduce_each).lower()}"])
        dims = ParallelDims.from_config(cfg.parallel, world)
        t = build_trainable(cfg, env.device, Meshes.build(dims, "cpu"))
        tokens = torch.randint(0, cfg.model.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
        train_step(t, tokens[:, :-1], tokens[:, 1:])
        Path(out_dir, f"{reduce_each}-{rank}.json").write_text(json.dumps(calls[0]))
    finally:
        shutdown()


@pytest.mark.slow
def test_reduce_every_micro_batch_under_a_pipeline_reduces_after_each_backward(tmp_path):
    """parallel.fsdp_reduce_every_micro_batch under a pipeline takes effect: FSDP reduce-scatters each of the
    4 micro-batches' gradients (4x the reduce-scatters of the end-of-step reduction torch's schedule does
    otherwise); its losses equal the single process's (LAYOUTS: "PP+FSDP, reduce every micro-batch")."""
    from parallel_harness import free_port, run_ranks

    for reduce_each in (False, True):
        run_ranks(_count_reduce_scatters, (4, free_port(), reduce_each, str(tmp_path)), 4, timeout=300)
    for rank in range(4):
        once = int((tmp_path / f"False-{rank}.json").read_text())
        each = int((tmp_path / f"True-{rank}.json").read_text())
        assert once > 0 and each == 4 * once, (rank, once, each)


ROOT_UNITS = r"""
import sys
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from plait.config import load_config
from plait.parallel import Meshes, ParallelDims
from plait.core.torch_private import init_fake_process_group
from plait.engine.trainer import build_trainable

init_fake_process_group(4)
cfg = load_config(None, ["model.preset=debug", "run.device=cpu", "data.seq_len=32", *sys.argv[1].split()])
dims = ParallelDims.from_config(cfg.parallel, 4)
t = build_trainable(cfg, torch.device("cpu"), Meshes.build(dims, "cpu"))
model = t.parts[0]
x = torch.randint(0, cfg.model.vocab_size, (2, 32))
out = t.forward(x, x)  # the fused head's summed loss, or the plain head's logits
loss = out.sum()

def gathered(module):  # FSDP registers the unsharded weight while gathered (a DTensor over tp alone under TP)
    w = module.weight
    return not isinstance(w, DTensor) or w.device_mesh.mesh_dim_names == ("tp",)

between = [gathered(model.tok_embeddings), gathered(model.output), gathered(model.norm)]
loss.backward()
grads = [m.weight.grad is not None for m in (model.tok_embeddings, model.output)]
print(" ".join(str(int(b)) for b in between + grads))
dist.destroy_process_group()
"""


@pytest.mark.parametrize(
    "overrides, between",
    [
        ("", "0 0 1"),  # fused head: neither the embedding nor the output is held from forward to backward
        ("parallel.tp_degree=2", "0 0 1"),
        ("train.fused_head=false", "0 1 1"),  # the plain head's backward needs the output weight at once
        ("model.tie_embeddings=true", "1 1 1"),  # one parameter in both: the root keeps it
        ("parallel.fsdp_reshard_after_forward=false", "1 1 1"),
    ],
)
def test_embedding_and_output_are_not_kept_gathered_between_forward_and_backward(overrides, between):
    """Under FSDP (4 ranks of a fake process group) the embedding, and the output under the fused head, are
    units of their own, gathered for their forward only (plait.parallel.fsdp._shard_embedding_and_head): after forward,
    before backward, their weights are sharded again while the root (final norm) stays gathered; their
    gradients still arrive. Parity with one process: test_layouts_match_single_process."""
    import subprocess
    import sys

    shard = 2 if "tp_degree" in overrides else 4
    cmd = [sys.executable, "-c", ROOT_UNITS, f"parallel.dp_shard_degree={shard} {overrides}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-5:] == [*between.split(), "1", "1"]
