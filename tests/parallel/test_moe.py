"""Mixture of experts: the MoE block against a per-token reference, the balancing loss and its gradient, the
routing statistics and loss-free balancing in a real run, and parity of the parallel layouts that support MoE
today (FSDP, HSDP, pipeline, context and expert parallel, activation checkpointing) with one process: loss,
gradient norm, balancing loss and load imbalance, within test_parallel's tolerances (fp32, 1e-5: reorderings
only; routing is discrete, so a flipped top-k pick would show as a jump far beyond them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from parallel_harness import read_metrics, run_layouts
from plait.config import load_config
from plait.core.errors import ConfigError
from plait.model.args import ModelArgs
from plait.model.llama import Transformer
from plait.model.moe import AuxLoss
from test_parallel import GRAD_NORM_RTOL, LOSS_RTOL, STEPS

SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=64, moe_experts=4)


def built(**overrides) -> Transformer:
    with torch.device("meta"):
        model = Transformer(ModelArgs(**{**SMALL, **overrides}))
    model.to_empty(device="cpu")
    model.init_weights(0)
    return model


@pytest.mark.parametrize(
    "overrides",
    [
        dict(moe_top_k=2, moe_hidden_dim=32),
        dict(moe_top_k=1, moe_shared_experts=2, moe_score="sigmoid"),
        dict(moe_top_k=3, moe_norm_topk=False),
    ],
    ids=["softmax top-2", "sigmoid top-1 + shared", "unnormalised top-3"],
)
def test_moe_block_equals_a_per_token_reference(overrides):
    moe = built(**overrides).layers["1"].feed_forward
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([0.0, 0.3, -0.2, 0.1]))  # picks experts, never weights them
        x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
        got = moe(x)
        tokens = x.view(-1, 64)
        logits = moe.router(tokens)
        scores = logits.softmax(-1) if moe.score == "softmax" else logits.sigmoid()
        picked = (scores + moe.expert_bias).topk(moe.top_k).indices
        weights = scores.gather(-1, picked)
        if moe.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        e = moe.experts
        rows = []
        for i, t in enumerate(tokens):
            y = sum(
                weights[i, j] * ((F.silu(t @ e.w1[k].t()) * (t @ e.w3[k].t())) @ e.w2[k].t())
                for j, k in enumerate(picked[i].tolist())
            )
            rows.append(y + (moe.shared(t) if moe.shared is not None else 0))
    torch.testing.assert_close(got.view(-1, 64), torch.stack(rows), atol=1e-6, rtol=0)


def test_grouped_matmuls_equal_the_loop(monkeypatch):
    """The grouped-GEMM path (torch._grouped_mm: what bf16 CUDA devices of capability 9.0+ take) run on the CPU
    against the per-expert loop, forward and backward, an expert without tokens included."""
    import plait.core.torch_private as tp

    moe = built(moe_top_k=2, moe_hidden_dim=32).layers["1"].feed_forward
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, -9.0]))  # expert 3 never picked
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))

    def run():
        moe.zero_grad()
        out = moe(x)
        (out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
        return out.detach(), [p.grad.clone() for p in moe.experts.parameters()]

    loop = run()
    monkeypatch.setattr(tp, "GROUPED_MM_ON_CPU", True)
    assert tp.grouped_mm_fits(x.view(-1, 64), moe.experts.w1, moe.experts.w2)
    grouped = run()
    torch.testing.assert_close(grouped[0], loop[0], atol=1e-6, rtol=0)
    for got, want in zip(grouped[1], loop[1], strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert loop[1][0][3].abs().sum() == 0  # the idle expert's gradient: zero, present


# bf16 under autocast: the stacked gate-and-up grouped GEMM and the loop's two matmuls round their products to
# bf16 alike (equal bit for bit on torch 2.13's CPU kernel); another kernel may sum in another order: 2 bf16
# ulps (2 x 2^-7) relative, and an absolute floor far below the outputs (~2e-3) and gradients (~6e-2) here.
BF16_GROUPED_RTOL, BF16_GROUPED_ATOL = 1.6e-2, 1e-5


def test_grouped_matmuls_under_autocast_equal_the_loop(monkeypatch):
    """Under bf16 autocast (one process on a GPU) the grouped path casts the fp32 weights and runs the gate and
    up projections as one stacked grouped GEMM: against the per-expert loop under the same autocast, forward
    and every weight's gradient, each in the weight's own dtype."""
    import plait.core.torch_private as tp

    moe = built(moe_top_k=2, moe_hidden_dim=32, moe_shared_experts=0).layers["1"].feed_forward
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0))

    def run():
        moe.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = moe(x)
        (out.float() * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
        return out.detach().float(), [p.grad.clone() for p in moe.experts.parameters()]

    loop = run()
    monkeypatch.setattr(tp, "GROUPED_MM_ON_CPU", True)
    calls = []
    import plait.model.moe as moe_module

    kernel = moe_module.grouped_mm
    monkeypatch.setattr(moe_module, "grouped_mm", lambda x, w, o: calls.append(tuple(w.shape)) or kernel(x, w, o))
    grouped = run()
    assert calls == [(4, 64, 64), (4, 32, 64)], calls  # gate | up stacked (E, dim, 2F), then down: 2 kernels
    torch.testing.assert_close(grouped[0], loop[0], atol=BF16_GROUPED_ATOL, rtol=BF16_GROUPED_RTOL)
    for got, want in zip(grouped[1], loop[1], strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=BF16_GROUPED_ATOL, rtol=BF16_GROUPED_RTOL)


def test_balance_loss_is_one_coefficient_when_balanced_and_adds_its_gradient():
    moe = built(moe_top_k=2, moe_aux_loss=0.5).layers["1"].feed_forward
    scores = torch.full((1, 4, 4), 0.25)
    picked = torch.tensor([[[0, 1], [2, 3], [0, 1], [2, 3]]])  # every expert twice of 8 picks
    assert moe._balance_loss(scores, picked).item() == pytest.approx(0.5)  # coef x sum_e (1)(1/4)
    skewed = torch.tensor([[[0, 1]] * 4])  # experts 0 and 1 take every pick: f = (2, 2, 0, 0)
    leaning = torch.tensor([0.4, 0.4, 0.1, 0.1]).expand(1, 4, 4)
    assert moe._balance_loss(leaning, skewed).item() == pytest.approx(0.5 * (2 * 0.4 * 2))
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    AuxLoss.apply(x * 2, (w**2).sum()).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    torch.testing.assert_close(w.grad, 2 * w.detach())  # d(aux)/dw arrives through the backward


def test_refused_settings_name_the_fix():
    def cfg(*overrides):
        return load_config(None, ["model.preset=moe-debug", *overrides])

    with pytest.raises(ConfigError, match=r"moe_top_k=9 must be in \[1, model.moe_experts=8\]"):
        cfg("model.moe_top_k=9")
    with pytest.raises(ConfigError, match="moe_score='relu'"):
        cfg("model.moe_score=relu")
    from plait.parallel import ParallelDims, validate_layout

    def layout(c):
        validate_layout(c, ParallelDims.from_config(c.parallel, 6, c.model))

    with pytest.raises(ConfigError, match=r"ep_degree=3 must divide model.moe_experts=8 .* in \[1, 2, 4, 8\]"):
        layout(cfg("parallel.ep_degree=3"))
    with pytest.raises(ConfigError, match="model is dense"):
        layout(load_config(None, ["parallel.ep_degree=2"]))
    with pytest.raises(ConfigError, match=r"ep_degree=4 must divide dp_shard x cp x tp = 2 .* in \[1, 2\]"):
        moe_ep = cfg("parallel.ep_degree=4", "parallel.dp_replicate_degree=2")
        validate_layout(moe_ep, ParallelDims.from_config(moe_ep.parallel, 4, moe_ep.model))
    with pytest.raises(ConfigError, match="compile.enabled=true with a mixture-of-experts model needs train.mixed"):
        cfg("compile.enabled=true", "train.mixed_precision=fp32")
    with pytest.raises(ConfigError, match="moe_dense_layers=4 leaves no MoE block"):
        cfg("model.moe_dense_layers=4")
    from plait.interop.hf import hf_family

    with pytest.raises(ConfigError, match="Mixtral's has no model.moe_shared_experts=1, model.moe_dense_layers=1"):
        hf_family(cfg().model)
    assert hf_family(cfg("model.moe_shared_experts=0", "model.moe_dense_layers=0").model) == "mixtral"


def test_flops_count_active_parameters():
    args = load_config(None, ["model.preset=moe-debug"]).model
    dense = ModelArgs(**{**vars(args), "moe_experts": 0})
    assert args.num_params() > args.num_params(active=True) > dense.num_params() - 3 * 64 * dense.hidden_dim * 3
    block = built(moe_top_k=2, moe_hidden_dim=32).layers["1"].feed_forward
    assert sum(p.numel() for p in block.parameters()) == 4 * 3 * 64 * 32 + 64 * 4


# --------------------------------------------------------------------------------------------- training


def base(data_dir: Path) -> list[str]:
    from test_parallel import base as dense_base

    return [*dense_base(data_dir), "model.preset=moe-debug", "model.ffn_hidden_dim=0"]


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    from plait.api import train

    out = tmp_path_factory.mktemp("ref")
    ref = [*base(data_dir), f"run.out_dir={out}", "run.name=ref", "checkpoint.every_steps=6", "log.plot=true"]
    train(load_config(None, ref))  # log.plot: its moe_load.png is checked
    return out / "ref"


def test_a_run_logs_routing_and_balances_without_a_loss(reference):
    got = read_metrics(reference)
    assert sorted(got["moe/load_imbalance"]) == list(range(1, STEPS + 1))
    assert all(v >= 1 for v in got["moe/load_imbalance"].values())
    assert all(0 < v < 1 for v in got["moe/aux_loss"].values())  # 0.01 x 3 blocks x ~1 when balanced
    import json

    rows = [json.loads(line) for line in (reference / "moe_load.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:  # tokens per expert of every MoE block (block 0 is dense): every token's top 2, all counted
        assert sorted(r["load"]) == ["1", "2", "3"] and all(sum(v) == 8 * 32 * 2 for v in r["load"].values())
    assert (reference / "moe_load.png").stat().st_size > 0
    from plait.engine.checkpoint import list_checkpoints
    from plait.engine.generate import load_for_generation

    (ckpt,) = list_checkpoints(reference / "checkpoints")
    model = load_for_generation(ckpt, "cpu")[0]
    bias = model.layers["1"].feed_forward.expert_bias
    updates = torch.round(bias / 1e-3)  # six steps of +-1e-3 (the checkpoint is step 6's)
    assert torch.allclose(bias, updates * 1e-3, atol=1e-6) and bias.abs().max() > 0
    assert (updates.abs() <= 6).all()  # six moves of +-1 (or 0 where an expert got exactly the mean)


def check(name: str, got: dict, ref: dict, steps=range(1, STEPS + 1)) -> None:
    assert "error" not in got, got.get("error")
    assert sorted(got["loss"]) == list(steps), name
    for key, rtol in (("loss", LOSS_RTOL), ("grad_norm", GRAD_NORM_RTOL), ("moe/aux_loss", LOSS_RTOL)):
        for step in steps:
            assert got[key][step] == pytest.approx(ref[key][step], rel=rtol), f"{name} {key} @ {step}"
    for step in steps:  # a ratio of integer counts: equal routing gives it exactly
        assert got["moe/load_imbalance"][step] == ref["moe/load_imbalance"][step], f"{name} load @ {step}"


LAYOUTS = {
    2: {
        "FSDP 2": ["parallel.dp_shard_degree=2"],
        "PP 2, full AC": ["parallel.pp_degree=2", "parallel.activation_checkpoint=full"],
        "DP 2, selective AC, accumulation": [
            "parallel.dp_replicate_degree=2",
            "parallel.dp_shard_degree=1",
            "parallel.activation_checkpoint=selective",
            "train.micro_batch_size=2",
        ],
        "EP 2": ["parallel.ep_degree=2"],
        # Under TP a mixture of experts runs on each rank's sequence shard, its gradients summed over tp.
        "TP 2": ["parallel.tp_degree=2"],
        # The sequence-wise balance loss from parts of sequences: routing counts summed over cp.
        "CP 2": ["parallel.cp_degree=2"],
    },
    4: {
        "EP 4": ["parallel.ep_degree=4"],
        "FSDP 2 x EP 2, selective AC, accumulation": [
            "parallel.ep_degree=2",
            "parallel.activation_checkpoint=selective",
            "train.micro_batch_size=1",
        ],
        "PP 2 x EP 2": ["parallel.pp_degree=2", "parallel.ep_degree=2"],
        "HSDP 2 x EP 2, full AC": [
            "parallel.dp_replicate_degree=2",
            "parallel.ep_degree=2",
            "parallel.activation_checkpoint=full",
        ],
        "TP 2 x EP 2": ["parallel.tp_degree=2", "parallel.ep_degree=2"],
        "TP 2 x FSDP 2, selective AC, accumulation": [
            "parallel.tp_degree=2",
            "parallel.activation_checkpoint=selective",
            "train.micro_batch_size=1",
        ],
        "PP 2 x TP 2 x EP 2 (the tp pair)": ["parallel.pp_degree=2", "parallel.tp_degree=2", "parallel.ep_degree=2"],
        "CP 2 x EP 4": ["parallel.cp_degree=2", "parallel.ep_degree=4"],
        "TP 2 x EP 4 (tp and dp ranks), full AC": [
            "parallel.tp_degree=2",
            "parallel.ep_degree=4",
            "parallel.activation_checkpoint=full",
        ],
        "HSDP 2 x 2": ["parallel.dp_replicate_degree=2", "parallel.dp_shard_degree=2"],
        "PP 2 x FSDP 2, interleaved": [
            "parallel.pp_degree=2",
            "parallel.dp_shard_degree=2",
            "parallel.pp_schedule=interleaved_1f1b",
            "parallel.pp_virtual_stages=2",
        ],
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_moe_layouts_match_single_process(world, data_dir, reference):
    jobs = {name: [*base(data_dir), *extra] for name, extra in LAYOUTS[world].items()}
    ref = read_metrics(reference)
    for name, got in zip(jobs, run_layouts(world, list(jobs.values())), strict=True):
        check(f"{name} (world {world})", got, ref)


@pytest.mark.slow
def test_resume_restores_the_routing_bias(data_dir, reference, tmp_path):
    """FSDP 2 resumes the one-process run's step-6 checkpoint (weights, optimizer, routing biases) and
    trains steps 7-10 as the uninterrupted run did."""
    ckpts = reference / "checkpoints"
    job = [*base(data_dir), "parallel.dp_shard_degree=2", "checkpoint.every_steps=0", f"checkpoint.dir={ckpts}"]
    job.append("checkpoint.adopt=true")  # the reference run's checkpoints, continued on purpose
    (got,) = run_layouts(2, [job])
    check("FSDP 2 resumed at step 6", got, read_metrics(reference), steps=range(7, STEPS + 1))


@pytest.mark.slow
def test_qk_norms_under_tensor_parallelism_match_single_process(data_dir, tmp_path):
    """Qwen3's per-head q/k norms under TP: each tp rank normalises its own heads with the whole weights, whose
    gradients FSDP sums over tp (ParallelDims.tp_whole); selective recompute as two units per block (the
    dense first block) and one region (the MoE blocks), and with expert parallelism and full AC."""
    from plait.api import train

    job = [*base(data_dir), "model.qk_norm=true"]
    train(load_config(None, [*job, f"run.out_dir={tmp_path}", "run.name=ref"]))
    ref = read_metrics(tmp_path / "ref")
    layouts = {
        "FSDP 2 x TP 2, selective AC": ["parallel.tp_degree=2", "parallel.activation_checkpoint=selective"],
        "TP 2 x EP 4, full AC": ["parallel.tp_degree=2", "parallel.ep_degree=4", "parallel.activation_checkpoint=full"],
    }
    for name, got in zip(layouts, run_layouts(4, [[*job, *extra] for extra in layouts.values()]), strict=True):
        check(f"q/k norms, {name}", got, ref)


@pytest.mark.slow
def test_checkpoints_reshard_across_expert_parallel_degrees(data_dir, reference, tmp_path):
    """The experts' shards follow the layout, not the checkpoint: EP 4 resumes the one-process run's step-6
    checkpoint, and one process resumes what EP 2 x FSDP 2 saved at step 6; both then train steps 7-10 as
    the uninterrupted run did."""
    from plait.api import train

    ref = read_metrics(reference)
    saved = tmp_path / "ep2-checkpoints"
    resume = [*base(data_dir), "checkpoint.every_steps=0", "checkpoint.adopt=true"]  # other runs' checkpoints
    ep4, ep2 = run_layouts(
        4,
        [
            [*resume, f"checkpoint.dir={reference / 'checkpoints'}", "parallel.ep_degree=4"],
            [*base(data_dir), "parallel.ep_degree=2", "checkpoint.every_steps=6", f"checkpoint.dir={saved}"],
        ],
    )
    check("EP 4 resumed at step 6", ep4, ref, steps=range(7, STEPS + 1))
    check("EP 2 x FSDP 2", ep2, ref)
    train(load_config(None, [*resume, f"checkpoint.dir={saved}", f"run.out_dir={tmp_path}", "run.name=one"]))
    check("one process resumed from EP 2", read_metrics(tmp_path / "one"), ref, steps=range(7, STEPS + 1))


def test_plait_safetensors_export_carries_the_routing_bias(tmp_path):
    """The routing bias decides which experts run: an export without it would compute another model."""
    from plait.interop import load_safetensors
    from plait.interop.hf import export_safetensors

    model = built(moe_top_k=2)
    with torch.no_grad():
        model.layers["0"].feed_forward.expert_bias.copy_(torch.tensor([0.5, -0.5, 0.25, 0.0]))
    loaded = load_safetensors(export_safetensors(model, tmp_path / "m.safetensors"))
    torch.testing.assert_close(loaded.layers["0"].feed_forward.expert_bias, model.layers["0"].feed_forward.expert_bias)
    x = torch.randint(0, 256, (2, 8))
    torch.testing.assert_close(loaded(x), model(x), atol=0, rtol=0)


def test_mixtral_export_refuses_routing_biases(tmp_path):
    """Mixtral's format has no routing bias: a model that balanced with one would route differently there."""
    from plait.core.errors import PlaitError
    from plait.interop import export_hf

    model = built(moe_top_k=2)
    with torch.no_grad():
        model.layers["1"].feed_forward.expert_bias[0] = 1e-3
    with pytest.raises(PlaitError, match=r"layers.1.feed_forward.expert_bias is not zero.*moe_bias_rate"):
        export_hf(model, tmp_path / "hf", tokenizer_path=None)
    assert not (tmp_path / "hf").exists()


# ------------------------------------------------------------------------------------------------ compile

# Compiled against eager, both bf16 through the same grouped kernel: Inductor fuses the SwiGLU, the casts and
# the router's softmax where eager rounds to bf16 after each op (bf16 keeps 8 bits), and a router score that
# rounds the other way can flip one of the 512 top-k picks of a step. Measured (10 steps, 2-core CPU): losses
# within 2e-5, balancing losses within 1.1e-3, gradient norms within 2.7e-3; a lost balancing term or a wrong
# expert's weights would be off by far more.
COMPILED_MOE_LOSS_RTOL = 1e-3
COMPILED_MOE_AUX_RTOL = 5e-3
COMPILED_MOE_GRAD_NORM_RTOL = 1e-2


@pytest.mark.full
def test_compiled_moe_blocks_match_eager_in_bf16(data_dir, tmp_path, monkeypatch):
    """compile.enabled with an MoE model (one process, bf16): the experts as grouped matmuls with their offsets
    on the device (no host sync, static shapes), strict (any recompilation fails), against the same run eager.
    On the CPU torch._grouped_mm runs only where a test asks (GROUPED_MM_ON_CPU); without it the build says why."""
    from plait.api import train
    from plait.core import torch_private

    bf16 = [*base(data_dir), "train.mixed_precision=bf16", f"run.out_dir={tmp_path}"]
    compiled = [*bf16, "run.name=compiled", "compile.enabled=true", "compile.strict=true"]
    with pytest.raises(ConfigError, match=r"needs grouped bf16 matmuls .* not on cpu"):
        train(load_config(None, compiled))
    monkeypatch.setattr(torch_private, "GROUPED_MM_ON_CPU", True)
    train(load_config(None, [*bf16, "run.name=eager"]))
    train(load_config(None, [*compiled, "run.overwrite=true"]))
    eager, got = read_metrics(tmp_path / "eager"), read_metrics(tmp_path / "compiled")
    for step in eager["loss"]:
        assert got["loss"][step] == pytest.approx(eager["loss"][step], rel=COMPILED_MOE_LOSS_RTOL)
        assert got["grad_norm"][step] == pytest.approx(eager["grad_norm"][step], rel=COMPILED_MOE_GRAD_NORM_RTOL)
        assert got["moe/aux_loss"][step] == pytest.approx(eager["moe/aux_loss"][step], rel=COMPILED_MOE_AUX_RTOL)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.mixed_precision=fp32"], r"needs train.mixed_precision='bf16'"),
        (
            ["parallel.ep_degree=2", "parallel.dp_shard_degree=2"],
            r"ep_degree=2 is not supported yet \(the all",
        ),
        (["parallel.pp_degree=2"], r"parallel.pp_degree=2 is not supported yet"),
    ],
)
def test_compiled_moe_refuses_what_it_does_not_support_yet(overrides, message):
    """By the config check (precision), or the layout check (rules.compile_problem: what the planner knows too)."""
    from plait.parallel import ParallelDims, validate_layout

    with pytest.raises(ConfigError, match=message):
        cfg = load_config(
            None, ["model.preset=moe-debug", "compile.enabled=true", "train.mixed_precision=bf16", *overrides]
        )
        world = cfg.parallel.pp_degree * max(cfg.parallel.dp_shard_degree, 1)
        validate_layout(cfg, ParallelDims.from_config(cfg.parallel, world, cfg.model))


@pytest.mark.full
@pytest.mark.slow
def test_compiled_moe_under_fsdp_matches_eager_fsdp(data_dir, monkeypatch):
    """FSDP 2 in bf16 (the experts' gathered weights bf16: the grouped kernel without autocast's casts),
    compiled and strict against the same layout eager, on two gloo processes."""
    monkeypatch.setenv("PLAIT_GROUPED_MM_ON_CPU", "1")
    fsdp = [*base(data_dir), "train.mixed_precision=bf16", "parallel.dp_shard_degree=2", "eval.every_steps=0"]
    eager, got = run_layouts(2, [fsdp, [*fsdp, "compile.enabled=true", "compile.strict=true"]])
    assert "error" not in got, got.get("error")
    for step in eager["loss"]:
        assert got["loss"][step] == pytest.approx(eager["loss"][step], rel=COMPILED_MOE_LOSS_RTOL)
        assert got["grad_norm"][step] == pytest.approx(eager["grad_norm"][step], rel=COMPILED_MOE_GRAD_NORM_RTOL)
        assert got["moe/aux_loss"][step] == pytest.approx(eager["moe/aux_loss"][step], rel=COMPILED_MOE_AUX_RTOL)
