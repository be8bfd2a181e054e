"""Muon (optim.name = "muon"): torch.optim.Muon's update on one process, the same update in every layout, the
one rule of which parameters take it, and its state through checkpoints.

Parity tolerances are the layouts' AdamW ones (tests/parallel/test_parallel.py, relative 1e-5, fp32): the Newton-Schulz
iterations run in fp32 on the CPU (optim.muon_ns_dtype=auto), on whole matrices, so a layout changes only the
order of fp32 sums in the gradients, as under AdamW; the iteration is a polynomial of bounded degree, so it
carries those rounding differences through without growing them past the tolerance over ten steps.
"""

import pytest
import torch
from torch import nn

from parallel_harness import read_metrics, run_layouts
from plait.config import load_config
from plait.core.errors import ConfigError
from plait.engine.muon import Muon, describe, split_parameters, takes_muon
from plait.model import preset_args
from plait.model.build import empty_model
from test_parallel import base as dense_base
from test_parallel import check as dense_check


def muon(params, **kw) -> Muon:
    args = dict(lr=0.02, weight_decay=0.1, momentum=0.95, ns_steps=5, ns_dtype=torch.float32, adamw={})
    return Muon(params, [], **{**args, **kw})


def test_one_process_equals_torch_muon_bitwise():
    """torch.optim.Muon with Moonlight's scale is the reference: bf16 iterations as it runs them, bitwise."""
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(48, 32)), nn.Parameter(torch.randn(32, 80))]
    ref = [nn.Parameter(w.detach().clone()) for w in ours]
    mine = muon(ours, ns_dtype=torch.bfloat16)
    theirs = torch.optim.Muon(ref, lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        for a, b in zip(ours, ref, strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        mine.step()
        theirs.step()
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)


def test_a_stack_of_experts_is_orthogonalised_per_expert():
    torch.manual_seed(0)
    stack = nn.Parameter(torch.randn(3, 16, 24))
    apart = [nn.Parameter(stack.detach()[i].clone()) for i in range(3)]
    a, b = muon([stack]), muon(apart)
    stack.grad = torch.randn_like(stack)
    for i, m in enumerate(apart):
        m.grad = stack.grad[i].clone()
    a.step()
    b.step()
    for i, m in enumerate(apart):
        assert torch.equal(stack[i], m)


def test_the_update_is_orthogonal_and_scaled_to_adamw_rms():
    """After 5 iterations the singular values sit in torch's band (about 0.7-1.2), and the update's RMS is near
    0.2 (Moonlight's match of AdamW's), whatever the gradient's scale."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.zeros(64, 256))
    opt = muon([w], lr=1.0, weight_decay=0.0, momentum=0.0)
    w.grad = torch.randn(64, 256) * 1e-4
    opt.step()
    s = torch.linalg.svdvals(-w.detach() / (0.2 * 256**0.5))
    assert s.min() > 0.6 and s.max() < 1.25
    assert (-w.detach()).pow(2).mean().sqrt().item() == pytest.approx(0.2, rel=0.2)


@pytest.mark.parametrize("shape", [(64, 256), (256, 64)])
def test_zero_iterations_is_the_control_scaled_momentum_of_muons_size(shape):
    """optim.muon_ns_steps=0, the control for Muon's benefit: the update is G / ||G||_F times sqrt(min(A, B))
    (an orthogonal matrix's Frobenius norm) times Muon's scale, so its RMS is Muon's 0.2 and its direction G's."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.zeros(shape))
    opt = muon([w], lr=1.0, weight_decay=0.0, momentum=0.0, ns_steps=0)
    g = torch.randn(shape) * 1e-4
    w.grad = g.clone()
    opt.step()
    expected = -0.2 * max(shape) ** 0.5 * min(shape) ** 0.5 * g / g.norm()
    torch.testing.assert_close(w.detach(), expected, rtol=1e-5, atol=0)
    assert w.detach().pow(2).mean().sqrt().item() == pytest.approx(0.2, rel=1e-5)
    load_config(None, ["optim.name=muon", "optim.muon_ns_steps=0"])  # allowed


@pytest.mark.parametrize(("device", "setting", "dtype"), [
    ("cuda", "auto", torch.bfloat16), ("cpu", "auto", torch.float32), ("cuda", "fp32", torch.float32),
    ("cpu", "bf16", torch.bfloat16),
])  # fmt: skip
def test_the_iterations_run_in_bf16_on_a_gpu_and_fp32_on_a_cpu_unless_set(device, setting, dtype):
    """optim.muon_ns_dtype=auto: bf16 on CUDA (torch.optim.Muon's; the H200 figures of docs/optimizers.md), fp32
    on a CPU (the layouts' parity); a setting overrides it. Read off the optimizer a run builds for the device."""
    from plait.engine.optim import build_optimizer

    cfg = load_config(None, ["model.preset=debug", "optim.name=muon", f"optim.muon_ns_dtype={setting}"])
    model = empty_model(preset_args("debug"))
    opt = build_optimizer(model, cfg.optim, torch.device(device))
    assert opt.ns.keywords["dtype"] == dtype


def test_the_muon_step_never_waits_for_the_device():
    """No op of Muon's step reads a value back to the host (.item(), nonzero, a tensor's truth): on a GPU each
    would stall the step until the device catches up. Checked op by op under a dispatch mode, on the CPU."""
    from torch.utils._python_dispatch import TorchDispatchMode

    syncing = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "allclose"}
    seen: list[str] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(48, 32)), nn.Parameter(torch.randn(3, 16, 24))]
    opt = muon(params)
    for _ in range(2):  # the first step makes the buffers
        for p in params:
            p.grad = torch.randn_like(p)
        with Ops():
            opt.step()
    assert "mm" in seen and "addmm" in seen  # the mode sees the iteration's ops
    assert not syncing & set(seen), sorted(syncing & set(seen))


def test_one_rule_picks_the_blocks_matrices_and_each_experts():
    dense = empty_model(preset_args("debug"))
    muon_names = [n for n, _ in split_parameters(dense)[0]]
    assert muon_names and all(".attention.w" in n or ".feed_forward.w" in n for n in muon_names)
    assert len(muon_names) == 7 * len(dense.layers)
    moe = empty_model(preset_args("moe-debug"))
    names = {n for n, _ in split_parameters(moe)[0]}
    assert any(n.endswith("experts.w1") for n in names) and not any("router" in n for n in names)
    for name in ("tok_embeddings.weight", "output.weight", "norm.weight", "layers.0.attention_norm.weight"):
        assert not takes_muon(name, torch.empty(4, 4) if "norm" not in name else torch.empty(4))
    assert takes_muon("layers.0.attention.wq.lora_A", torch.empty(4, 64))  # adapters too (docs/optimizers.md)
    assert "optimizer: Muon for 28 matrices" in describe([dense])


def test_settings_out_of_range_are_refused():
    with pytest.raises(ConfigError, match="optim.muon_momentum=1.0 must be in"):
        load_config(None, ["optim.name=muon", "optim.muon_momentum=1.0"])
    with pytest.raises(ConfigError, match="optim.muon_ns_steps=-1 must be in"):
        load_config(None, ["optim.name=muon", "optim.muon_ns_steps=-1"])
    with pytest.raises(ConfigError, match="state_dtype='bf16' is not supported yet"):
        load_config(None, ["optim.name=muon", "optim.state_dtype=bf16"])
    with pytest.raises(ConfigError, match="optim.name"):
        load_config(None, ["optim.name=lion"])


MUON = ["optim.name=muon"]

DENSE_LAYOUTS = {
    2: {
        "FSDP 2": ["parallel.dp_shard_degree=2"],
        "TP 2 (SP)": ["parallel.tp_degree=2"],
        "CP 2": ["parallel.cp_degree=2"],
        "PP 2 1f1b": ["parallel.pp_degree=2", "parallel.pp_schedule=1f1b"],
        "PP 2 interleaved": [
            "parallel.pp_degree=2",
            "parallel.pp_schedule=interleaved_1f1b",
            "parallel.pp_virtual_stages=2",
        ],
    },
    4: {
        "FSDP 4": ["parallel.dp_shard_degree=4"],
        "FSDP 4, accumulation": ["parallel.dp_shard_degree=4", "train.micro_batch_size=1"],
        "HSDP 2x2": ["parallel.dp_replicate_degree=2", "parallel.dp_shard_degree=2"],
        "FSDP 2 x TP 2": ["parallel.dp_shard_degree=2", "parallel.tp_degree=2"],
    },
}


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    from plait.api import train

    out = tmp_path_factory.mktemp("muon-ref")
    train(load_config(None, [*dense_base(data_dir), *MUON, f"run.out_dir={out}", "run.name=ref"]))
    return read_metrics(out / "ref")


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(DENSE_LAYOUTS))
def test_every_layout_takes_the_one_process_muon_step(world, data_dir, reference):
    assert max(reference["grad_norm"].values()) > 1.0  # train.grad_clip=1.0 clips: the layouts clip as one process
    jobs = {name: [*dense_base(data_dir), *MUON, *extra] for name, extra in DENSE_LAYOUTS[world].items()}
    for name, got in zip(jobs, run_layouts(world, list(jobs.values())), strict=True):
        dense_check(f"Muon, {name} (world {world})", got, reference)


def test_muon_trains_a_different_curve_than_adamw(data_dir, reference, tmp_path):
    """The setting takes effect: the same run under AdamW has other losses from step 2 on."""
    from plait.api import train

    train(load_config(None, [*dense_base(data_dir), f"run.out_dir={tmp_path}", "run.name=adamw"]))
    adamw = read_metrics(tmp_path / "adamw")
    assert adamw["loss"][1] == pytest.approx(reference["loss"][1], rel=1e-6)
    assert abs(adamw["loss"][5] - reference["loss"][5]) > 1e-3


MOE_LAYOUTS = {
    "EP 2": ["parallel.ep_degree=2"],
    "FSDP 2 (whole experts on each rank)": ["parallel.dp_shard_degree=2"],
}


@pytest.mark.slow
def test_a_mixture_of_experts_takes_the_one_process_muon_step_under_expert_parallelism(data_dir, tmp_path):
    """Each expert's matrices orthogonalised where they live, batched: EP 2 and FSDP 2 equal one process."""
    from plait.api import train
    from test_moe import base as moe_base
    from test_moe import check as moe_check

    train(load_config(None, [*moe_base(data_dir), *MUON, f"run.out_dir={tmp_path}", "run.name=ref"]))
    ref = read_metrics(tmp_path / "ref")
    jobs = {name: [*moe_base(data_dir), *MUON, *extra] for name, extra in MOE_LAYOUTS.items()}
    for name, got in zip(jobs, run_layouts(2, list(jobs.values())), strict=True):
        moe_check(f"Muon, MoE {name}", got, ref)


def test_the_planner_counts_one_buffer_the_matrices_in_flight_and_the_orthogonalisation():
    """Against AdamW at the same layout: states smaller by 4 bytes a block parameter, the step's peak holding a few
    whole matrices more, a longer optimizer step; and no offloaded layout offered (the run refuses it)."""
    from plait.planner import get_cluster, plan
    from plait.planner.cost import AC_MODES, Workload
    from plait.planner.cost.muon import muon_numel

    args = preset_args("llama3-1b")
    cluster = get_cluster("h100", nodes=1, devices_per_node=8)
    pins = {"tp": 1, "pp": 1, "dp_shard": 8, "dp_replicate": 1, "ac": AC_MODES.index("full"), "offload": False}
    adamw = plan(Workload(args, 4096, 64), cluster, pins=pins)
    muon = plan(Workload(args, 4096, 64, muon=True), cluster, pins=pins)
    a, m = adamw.record(adamw.best), muon.record(muon.best)
    matrices = muon_numel(args, 1, 8, 1)
    assert (a["mem_states_gib"] - m["mem_states_gib"]) * 2**30 == pytest.approx(4 * args.n_layers * matrices, rel=1e-6)
    assert m["t_optimizer"] > a["t_optimizer"]
    assert not any(muon.record(i)["offload"] for i in muon.top(50))
    with pytest.raises(ConfigError, match="optim.name='muon' with parallel.cpu_offload=true is refused"):
        from plait.parallel.dims import ParallelDims, validate_layout

        cfg = load_config(None, ["optim.name=muon", "parallel.cpu_offload=true"])
        validate_layout(cfg, ParallelDims.from_config(cfg.parallel, 1, cfg.model))


MUON_STEP_RTOL = 0.05
"""The planner's whole step against the H200's median, as plait's step-time anchors hold AdamW's (its AdamW step
for this job is within 0.5% of the card's)."""
MUON_EXTRA_RTOL = 0.15
"""Muon's optimizer step over AdamW's, planned (Newton-Schulz at the cluster's matmul rate, the element-wise
passes at its memory bandwidth) against measured (`plait bench`'s optimizer phase, synchronised): the
iteration's matmuls ran at 0.51 of the card's dense peak where the preset's efficiency says 0.58, so the plan is
low by about 9%. With the element-wise passes counted as one (20 bytes a parameter) it was 18% low."""


def test_the_planners_muon_step_is_the_h200s_on_llama3_1b():
    """llama3-1b compiled on one H200 at 16 x 2048 tokens a step, AdamW then Muon in one device call
    (bench/gpu_session.py part 8, 2026-11-30; the records in bench/results): the planner's step and optimizer
    times for the same job against the measured ones."""
    import json
    from pathlib import Path

    from plait.planner import get_cluster
    from plait.planner.cost import Layouts, Workload, evaluate

    records = Path(__file__).resolve().parents[2] / "bench" / "results" / "h200-2026-11-30-part8"
    measured = {name: json.loads((records / f"muon-1b-{name}-b16.json").read_text()) for name in ("adamw", "muon")}
    cluster = get_cluster("h200", devices_per_node=1)
    predicted = {
        name: evaluate(Workload(preset_args("llama3-1b"), 2048, 16, muon=name == "muon"), cluster,
                       Layouts.single(micro_batch=4))
        for name in ("adamw", "muon")
    }  # fmt: skip
    for name, r in measured.items():
        step = float(predicted[name]["step_time"][0])
        assert step == pytest.approx(r["step_time_s"], rel=MUON_STEP_RTOL), (name, step, r["step_time_s"])
    extra = {
        "planned": float(predicted["muon"]["t_optimizer"][0] - predicted["adamw"]["t_optimizer"][0]),
        "measured": measured["muon"]["breakdown_s"]["optimizer"] - measured["adamw"]["breakdown_s"]["optimizer"],
    }
    assert extra["planned"] == pytest.approx(extra["measured"], rel=MUON_EXTRA_RTOL), extra


@pytest.mark.slow
def test_muon_state_resumes_bitwise_reshards_and_another_optimizer_is_refused(data_dir, reference, tmp_path):
    """One momentum buffer per Muon matrix, in the checkpoint (no exp_avg for them); the one-process run cut at
    step 6 resumes to the same losses bitwise; FSDP 4's step-6 checkpoint resumes under FSDP 2 x TP 2 and continues
    with the uninterrupted run's losses (the layouts' tolerance); an AdamW checkpoint is refused by a Muon run
    unless checkpoint.fresh_optimizer=true asks for fresh states."""
    import json
    import shutil

    from torch.distributed.checkpoint import FileSystemReader

    from plait.api import train
    from plait.engine.checkpoint import list_checkpoints

    def job(name: str, *extra: str) -> list[str]:
        return [*dense_base(data_dir), *MUON, f"run.out_dir={tmp_path}", f"run.name={name}", *extra]

    train(load_config(None, job("whole", "checkpoint.every_steps=6")))
    (ckpt,) = list_checkpoints(tmp_path / "whole" / "checkpoints")
    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    assert "optim.layers.0.attention.wq.weight.momentum_buffer" in keys
    assert not any(k.startswith("optim.layers.0.attention.wq.weight.exp_avg") for k in keys)
    assert "optim.tok_embeddings.weight.exp_avg" in keys  # AdamW's, for the embedding
    whole = read_metrics(tmp_path / "whole")
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "whole", cut)
    lines = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("".join(x + "\n" for x in lines if json.loads(x).get("step", 0) <= 6))
    train(load_config(None, job("cut", "checkpoint.every_steps=0")))
    assert read_metrics(cut)["loss"] == whole["loss"]  # bitwise

    saved = tmp_path / "fsdp4"
    save = [*dense_base(data_dir), *MUON, "parallel.dp_shard_degree=4", "checkpoint.every_steps=6",
            f"checkpoint.dir={saved}"]  # fmt: skip
    resume = [*dense_base(data_dir), *MUON, "parallel.dp_shard_degree=2", "parallel.tp_degree=2",
              "checkpoint.every_steps=0", f"checkpoint.dir={saved}", "checkpoint.adopt=true"]  # fmt: skip
    _, resumed = run_layouts(4, [save, resume])
    assert "error" not in resumed, resumed.get("error")
    assert sorted(resumed["loss"]) == list(range(7, 11))
    for step, loss in resumed["loss"].items():
        assert loss == pytest.approx(reference["loss"][step], rel=1e-5), step  # test_parallel's LOSS_RTOL

    adamw = [*dense_base(data_dir), "checkpoint.every_steps=6", f"run.out_dir={tmp_path}", "run.name=adamw"]
    train(load_config(None, adamw))
    switch = [c for c in adamw if c != "checkpoint.every_steps=6"] + ["optim.name=muon", "checkpoint.every_steps=0"]
    with pytest.raises(ConfigError, match="was trained with optim.name='adamw' and this run has optim.name='muon'"):
        train(load_config(None, switch))
    train(load_config(None, [*switch, "checkpoint.fresh_optimizer=true"]))  # resumes at step 6 with fresh states
    assert sorted(read_metrics(tmp_path / "adamw")["loss"])[-1] == 10
