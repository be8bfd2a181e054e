"""AdamW with bfloat16 moments (optim.state_dtype = "bf16"): stochastic rounding, the update, and training in
one process, resumed, and under FSDP 2 with CPU offload."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from plait.engine.bf16_adamw import CHUNK, BF16StateAdamW, noise_buffer, round_to_bf16_

BF16_STATE_LOSS_RTOL = 5e-5
"""A run with bf16 moments against the same run with fp32 ones, and (bf16 moments both) FSDP 2 with CPU offload
against one process: each stored moment is off its fp32 value by under one bfloat16 spacing (2^-8 relative),
at random, so the updates differ by a fraction of a percent and the loss over 6 steps of the debug model by
far less (measured: 2.5e-6 and 1.4e-6 relative at most; 20x that here). Layouts cannot match bitwise: other
shard boundaries read the rounding noise at other offsets."""


def rounded(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x, dtype=torch.bfloat16)
    round_to_bf16_(out, x.clone(), noise_buffer(x.device)[: x.numel()].view(x.shape))
    return out


def test_stochastic_rounding_is_unbiased_and_exact_where_bf16_is():
    for value in (1.0 + 2**-9, -(3.0 + 2**-10), 1e-20 * (1 + 2**-11)):
        x = torch.full((1 << 20,), value)
        got = rounded(x).float()
        assert got.min().item() < value < got.max().item()  # rounded to both neighbours
        assert got.double().mean().item() == pytest.approx(value, rel=2**-8 / 100)  # unbiased: 1% of a spacing
    exact = torch.tensor([0.0, 1.0, -2.5, 2.0**127, float("inf"), 2.0**-126])
    assert torch.equal(rounded(exact).float(), exact)  # representable values are kept as they are


def test_round_to_nearest_stalls_a_second_moment_that_stochastic_rounding_keeps_moving():
    """v <- beta2 v + (1 - beta2) g^2 with beta2 = 0.999 and g^2 = 1, from v = 0.5, over 2,000 steps: in fp32 v
    reaches 0.932; stored round-to-nearest in bf16 it never leaves 0.5; stochastically rounded it follows."""
    beta2, steps = 0.999, 2000
    fp32 = 1 - 0.5 * beta2**steps
    nearest = torch.full((4096,), 0.5, dtype=torch.bfloat16)
    stochastic = nearest.clone()
    noise = noise_buffer(torch.device("cpu"))
    for step in range(steps):
        nearest = (nearest.float() * beta2 + (1 - beta2)).bfloat16()
        at = (step * 7919) % (noise.numel() - 4096)
        round_to_bf16_(stochastic, stochastic.float() * beta2 + (1 - beta2), noise[at : at + 4096])
    assert nearest.float().mean().item() == 0.5
    assert stochastic.float().mean().item() == pytest.approx(fp32, rel=2e-3)


def test_the_first_update_is_adamws_bitwise_and_the_moments_are_bf16():
    """At the first step the update is computed from fp32 moments before they are stored, so it equals torch's
    fused AdamW bitwise; a tensor longer than one chunk is updated whole."""
    torch.manual_seed(0)
    big = torch.randn(CHUNK + 1000)
    params = [torch.nn.Parameter(big.clone()), torch.nn.Parameter(torch.randn(64, 32))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, r in zip(params, ref, strict=True):
        p.grad = torch.randn_like(p)
        r.grad = p.grad.clone()
    ours = BF16StateAdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    theirs = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    ours.step()
    theirs.step()
    for p, r in zip(params, ref, strict=True):
        assert torch.equal(p, r)
        state = ours.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16 and state["step"].item() == 1
        assert torch.allclose(state["exp_avg"].float(), theirs.state[r]["exp_avg"], rtol=2**-7, atol=0)


@pytest.mark.slow
def test_bf16_moments_train_resume_bitwise_and_fsdp_with_offload_equals_one_process(data_dir, tmp_path):
    from parallel_harness import read_metrics, run_layouts
    from plait.api import train
    from plait.config import load_config
    from runs import debug_run

    def job(name: str, *extra: str) -> list[str]:
        return debug_run(data_dir, tmp_path, name, 6, "checkpoint.every_steps=3", *extra)

    train(load_config(None, job("fp32")))
    train(load_config(None, job("bf16", "optim.state_dtype=bf16")))
    fp32, bf16 = read_metrics(tmp_path / "fp32")["loss"], read_metrics(tmp_path / "bf16")["loss"]
    assert bf16 != fp32 and sorted(bf16) == sorted(fp32) == [1, 2, 3, 4, 5, 6]
    for step, loss in fp32.items():
        assert bf16[step] == pytest.approx(loss, rel=BF16_STATE_LOSS_RTOL), step
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "bf16", cut)
    shutil.rmtree(next((cut / "checkpoints").glob("step_*6")))
    lines = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("".join(x + "\n" for x in lines if json.loads(x).get("step", 0) <= 3))
    train(load_config(None, job("cut", "optim.state_dtype=bf16")))
    assert read_metrics(cut)["loss"] == bf16  # bitwise: the rounding noise is a function of the step
    base = [c for c in job("x", "optim.state_dtype=bf16") if not c.startswith("run.")]
    (got,) = run_layouts(2, [[*base, "parallel.dp_shard_degree=2", "parallel.cpu_offload=true"]])
    assert "error" not in got, got.get("error")
    for step, loss in bf16.items():
        assert got["loss"][step] == pytest.approx(loss, rel=BF16_STATE_LOSS_RTOL), step
