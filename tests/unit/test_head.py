"""The fused output head (plait.model.head): the output projection and cross-entropy a chunk of tokens at a
time, gradients taken in forward. Checked against the plain head (logits, then F.cross_entropy) in fp32 on
the CPU: values, gradients, training steps, what autograd keeps; under tensor parallelism the vocabulary-split
collectives are checked by every TP layout of tests/parallel/test_parallel.py (their reference is one process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plait.config import load_config
from plait.model.head import IGNORE_INDEX, LOGITS_PER_CHUNK, chunk_tokens, linear_cross_entropy
from plait.parallel.activations import SavedBytes

# Chunks reorder the fp32 sums of the loss and of the weight gradient (one matmul per chunk, summed): measured
# 1e-7 relative on the loss, 3e-7 on the gradients at these sizes; 1e-6 leaves room for another kernel's order.
FP32_RTOL = 1e-6


def _case(seed: int = 0, masked: bool = True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(3, 11, 24, generator=g, requires_grad=True)
    w = (torch.randn(97, 24, generator=g) / 5).requires_grad_()
    y = torch.randint(0, 97, (3, 11), generator=g)
    if masked:
        y[0, :4] = IGNORE_INDEX  # a prompt's tokens: not scored
        y[2] = IGNORE_INDEX  # a whole sequence unscored
    return h, w, y


def _plain(h, w, y):
    return F.cross_entropy((h @ w.t()).flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


@pytest.mark.parametrize("chunk", [0, 1, 5, 33, 1000])
def test_fused_head_equals_logits_then_cross_entropy(chunk):
    h, w, y = _case()
    ref = _plain(h, w, y)
    (ref * 0.37).backward()
    ref_h, ref_w = h.grad, w.grad
    h.grad = w.grad = None
    got = linear_cross_entropy(h, w, y, chunk)
    (got * 0.37).backward()  # the incoming gradient (TokenLoss's scale) multiplies what forward computed
    assert got.item() == pytest.approx(ref.item(), rel=FP32_RTOL)
    torch.testing.assert_close(h.grad, ref_h, rtol=FP32_RTOL, atol=1e-7)
    torch.testing.assert_close(w.grad, ref_w, rtol=FP32_RTOL, atol=1e-7)


def test_no_scored_token_gives_zero_loss_and_gradient():
    h, w, y = _case()
    y[:] = IGNORE_INDEX
    got = linear_cross_entropy(h, w, y, 4)
    got.backward()
    assert got.item() == 0 and h.grad.abs().max() == 0 and w.grad.abs().max() == 0


def test_a_frozen_output_gets_no_weight_gradient():
    """LoRA fine-tuning freezes the output: no weight-gradient matmul, no (V, dim) buffer kept."""
    h, w, y = _case()
    ref = _plain(h, w, y)
    ref.backward()
    ref_h = h.grad
    h.grad = w.grad = None
    w.requires_grad_(False)
    with SavedBytes() as kept:
        got = linear_cross_entropy(h, w, y, 5)
    got.backward()
    torch.testing.assert_close(h.grad, ref_h, rtol=FP32_RTOL, atol=1e-7)
    assert w.grad is None and kept.total == h.numel() * 4


def test_bf16_autocast_stays_close_to_fp32():
    h, w, y = _case(masked=False)
    ref = _plain(h, w, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(h, w, y, 8)
    assert got.dtype == torch.float32 and got.item() == pytest.approx(ref.item(), rel=2e-2)  # bf16 logits: 3 digits
    got.backward()
    assert h.grad.dtype == h.dtype and w.grad.dtype == w.dtype


def test_chunk_rule():
    assert chunk_tokens(8192, 128_256) == 2048  # llama3-1b, 4 x 2,048 tokens: 4 chunks of 512 MiB bf16 logits
    assert chunk_tokens(100, 10) == 100  # small: one chunk
    assert chunk_tokens(100, 10, requested=7) == 7
    n = chunk_tokens(100_000, 50_000)
    assert n * 50_000 <= LOGITS_PER_CHUNK * 1.01 and n < 100_000


def test_what_autograd_keeps_is_the_gradients_not_the_logits():
    """The plain head keeps (B, T, V) logits for backward (fp32 log-softmax and more); the fused head keeps the
    input gradient (B, T, dim) and the weight gradient (V, dim), nothing per vocabulary entry and token."""
    h, w, y = _case(masked=False)
    with SavedBytes() as plain:
        _plain(h, w, y)
    with SavedBytes() as fused:
        linear_cross_entropy(h, w, y, 4)
    assert plain.total >= 3 * 11 * 97 * 4  # at least one fp32 (B, T, V)
    assert fused.total == h.numel() * 4 + w.numel() * 4


def _steps(extra: list[str], steps: int = 4) -> list[tuple[float, float]]:
    from plait.engine.trainer import build_trainable, train_step
    from plait.parallel.env import shutdown

    cfg = load_config(
        None, ["model.preset=debug", "model.n_layers=2", "data.seq_len=16", "train.global_batch_size=4", *extra]
    )
    try:
        t = build_trainable(cfg, torch.device("cpu"))
        g = torch.Generator().manual_seed(0)
        out = []
        for _ in range(steps):
            x = torch.randint(0, cfg.model.vocab_size, (4, 17), generator=g)
            y = x[:, 1:].clone()
            y[0, :5] = IGNORE_INDEX
            r = train_step(t, x[:, :-1], y)
            out.append((r.loss.item(), r.grad_norm.item()))
        return out
    finally:
        shutdown()


def test_training_with_the_fused_head_equals_the_plain_head():
    plain = _steps(["train.fused_head=false"])
    for extra in (["train.loss_chunk_tokens=5"], ["train.micro_batch_size=2", "parallel.activation_checkpoint=full"]):
        fused = _steps(extra)
        for (a, b), (c, d) in zip(plain, fused, strict=True):
            assert c == pytest.approx(a, rel=1e-6) and d == pytest.approx(b, rel=1e-6), extra


def test_settings_are_checked():
    from plait.core.errors import ConfigError

    with pytest.raises(ConfigError, match="loss_chunk_tokens"):
        load_config(None, ["train.loss_chunk_tokens=-1"])


@pytest.mark.slow
def test_compiled_elementwise_equals_eager():
    h, w, y = _case()
    ref = linear_cross_entropy(h, w, y, 6)
    ref.backward()
    ref_h, ref_w = h.grad, w.grad
    h.grad = w.grad = None
    got = linear_cross_entropy(h, w, y, 6, compiled=True)
    got.backward()
    assert got.item() == pytest.approx(ref.item(), rel=FP32_RTOL)
    torch.testing.assert_close(h.grad, ref_h, rtol=FP32_RTOL, atol=1e-6)
    torch.testing.assert_close(w.grad, ref_w, rtol=FP32_RTOL, atol=1e-6)


@pytest.mark.parametrize("vocab_start", [0, 40])
def test_the_fusable_gradient_equals_the_scatter_one(vocab_start):
    """The compiled path's gradient (one-hot by comparison, one kernel) against the eager one (scatter), on a
    vocabulary shard: targets below, inside and above it, and unscored ones."""
    from plait.model.head import chunk_gradient, chunk_gradient_fusable

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 50, generator=g)
    targets = torch.randint(0, 130, (9,), generator=g)
    targets[[1, 4]] = IGNORE_INDEX
    targets[2], targets[3] = vocab_start, vocab_start + 49  # the shard's first and last entries
    lse = torch.logsumexp(logits, dim=1) + 0.3  # another rank's share of the softmax
    want = chunk_gradient(logits, lse, targets, vocab_start, torch.float32)
    got = chunk_gradient_fusable(logits, lse, targets, vocab_start, torch.float32)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-7)
    assert (want[[1, 4]] == 0).all() and (want[2, 0] < 0) and (want[3, 49] < 0)


PATTERN_PROBE = """
import torch, torch._inductor.config as config, torch._inductor.fx_passes.post_grad as post_grad
from plait.model.head import chunk_statistics
config.fx_graph_cache = False  # a cached graph skips the passes
seen = []
post_grad.prepare_softmax_extra_check = lambda match: seen.append(1) or False  # before the lazy registration
logits = torch.randn(8, 300, dtype=torch.bfloat16)
torch.compile(chunk_statistics, dynamic=False, fullgraph=True)(logits, torch.randint(0, 300, (8,)), 0)
print(len(seen))
"""


def test_the_log_sum_exp_is_written_as_inductors_online_softmax_pattern():
    """The compiled statistics must be one pass over the logits on a GPU: Inductor rewrites amax / sub / exp /
    sum into its online softmax when they match its pattern (keepdim reductions). The CPU has no such kernel,
    so the device check refuses it here, but only after the pattern matched: that call is what is counted."""
    import subprocess
    import sys

    import torch._inductor.fx_passes.post_grad as post_grad

    if not hasattr(post_grad, "prepare_softmax_extra_check"):
        pytest.skip("this torch has no online-softmax rewrite")
    proc = subprocess.run([sys.executable, "-c", PATTERN_PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "1", proc.stdout


def test_the_one_pass_eager_path_equals_statistics_then_gradient():
    """Where one rank holds the whole vocabulary, eager, the loss and its gradient come from one log-softmax;
    they equal the two-pass path that a split vocabulary uses (statistics, then the gradient), unscored tokens
    included, and a target far below the top logit (exp underflows in fp32) still has its finite loss."""
    from plait.model.head import chunk_gradient, chunk_loss_and_gradient, chunk_statistics

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(40, 97, generator=g) * 4
    y = torch.randint(0, 97, (40,), generator=g)
    y[:5] = IGNORE_INDEX
    logits[7, y[7]] = -200.0  # softmax gives 0 here; log-softmax gives about -200
    lse, picked = chunk_statistics(logits, y, 0)
    want_loss = torch.where(y != IGNORE_INDEX, lse - picked, 0.0).sum()
    want_grad = chunk_gradient(logits, lse, y, 0, torch.float32)
    losses, grad = chunk_loss_and_gradient(logits, y, grads=True)
    loss = losses.sum()
    assert torch.isfinite(loss) and loss.item() > 200
    torch.testing.assert_close(loss, want_loss, rtol=FP32_RTOL, atol=0)
    torch.testing.assert_close(grad, want_grad, rtol=FP32_RTOL, atol=1e-7)
    assert (grad[:5] == 0).all()
    no_grad_loss, none = chunk_loss_and_gradient(logits, y, grads=False)
    assert none is None and torch.equal(no_grad_loss, losses)
