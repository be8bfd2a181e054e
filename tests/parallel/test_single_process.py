"""One code path at every world size: in a lone process every [parallel] setting takes effect, through the same
`parallelize` as on many ranks (a process group of one, a mesh of size 1), or is refused with the reason.

Activation memory is measured, not assumed: a dispatch mode records a weak reference to the storage of every
op output during the forward; the bytes still alive when the forward returns are what autograd (and
selective checkpointing's cache) keep for backward, whatever mechanism keeps them. Parameters and buffers are
not counted. The model is the debug preset at 4 layers, seq 64, batch 4, fp32 on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from plait.config import load_config
from plait.core.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ARGS = ["model.preset=debug", "model.n_layers=4", "data.seq_len=64", "train.global_batch_size=4", "run.device=cpu"]
# AC recomputes the same fp32 ops on the same inputs in the same order on the CPU: results are bitwise equal
# (observed: 0 difference); 1e-6 only absorbs a kernel that might pick another reduction order on recompute.
AC_RTOL = 1e-6


class _AliveCensus(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                self.refs.setdefault(st.data_ptr(), (StorageWeakRef(st), st.nbytes()))
        return out

    def alive_bytes(self, exclude: set[int]) -> int:
        return sum(n for ptr, (ref, n) in self.refs.items() if ptr not in exclude and not ref.expired())


def forward_backward(overrides: list[str]) -> dict:
    from plait.engine.trainer import build_trainable
    from plait.model.llama import canonical_name
    from plait.parallel.env import shutdown

    cfg = load_config(None, [*ARGS, *overrides])
    try:
        t = build_trainable(cfg, torch.device("cpu"))
        x = torch.randint(0, cfg.model.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
        fixed = {p.untyped_storage().data_ptr() for p in t.parameters()}
        fixed |= {b.untyped_storage().data_ptr() for b in t.model.buffers()}
        census = _AliveCensus()
        with census:
            loss = t.loss_fn(t.forward(x, x), x)  # the training step's forward (the fused head)
        alive = census.alive_bytes(fixed)
        loss.backward()
        grads = {canonical_name(n): p.grad.detach().clone() for n, p in t.model.named_parameters()}
        return {"t": t, "alive": alive, "loss": loss.item(), "grads": grads}
    finally:
        shutdown()


def test_activation_checkpointing_takes_effect_in_one_process():
    modes = ("none", "selective", "full")
    runs = {mode: forward_backward([f"parallel.activation_checkpoint={mode}"]) for mode in modes}
    none, selective, full = (runs[m]["alive"] for m in ("none", "selective", "full"))
    # full keeps each block's input only; selective keeps the matmul and attention outputs, not the
    # element-wise work; both also keep what the embedding and the fused head keep, which are not checkpointed
    # (the head: its input's and the output weight's gradients, computed in forward).
    assert full < selective < none, runs
    assert full < 0.5 * none and selective < 0.9 * none, {m: r["alive"] for m, r in runs.items()}
    for mode in ("selective", "full"):
        assert runs[mode]["loss"] == pytest.approx(runs["none"]["loss"], rel=AC_RTOL)
        for name, g in runs["none"]["grads"].items():
            torch.testing.assert_close(runs[mode]["grads"][name], g, rtol=AC_RTOL, atol=0, msg=f"{mode}: {name}")


def test_cpu_offload_applies_at_dp_1():
    """FSDP2 with its CPU offload policy wraps every block and the root although dp = 1; after a step the
    parameters, gradients and Adam moments are CPU shards. (On this CPU-only machine everything is on the CPU
    anyway: what is checked is that the offload policy is applied, not silently dropped.)"""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    from torch.distributed.tensor import DTensor

    from plait.engine.trainer import build_trainable, train_step
    from plait.parallel.env import shutdown

    cfg = load_config(None, [*ARGS, "parallel.cpu_offload=true"])
    try:
        t = build_trainable(cfg, torch.device("cpu"))
        wrapped = [t.model, *t.model.layers.values()]
        assert all(isinstance(m, FSDPModule) for m in wrapped)
        assert all(isinstance(m._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy) for m in wrapped)
        x = torch.randint(0, cfg.model.vocab_size, (4, 65))
        train_step(t, x[:, :-1], x[:, 1:])
        params = t.parameters()
        assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in params)
        moments = [v for s in t.optimizers[0].state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
        assert len(moments) == 2 * len(params) and all(m.device.type == "cpu" for m in moments)
    finally:
        shutdown()


def test_settings_that_need_more_processes_are_refused_in_one():
    from plait.engine.trainer import build_trainable
    from plait.parallel.env import shutdown

    for setting in ("parallel.tp_degree=2", "parallel.pp_degree=2", "parallel.dp_replicate_degree=2"):
        cfg = load_config(None, [*ARGS, setting])
        try:
            with pytest.raises(ConfigError, match=r"world size 1 is not divisible .* \(plait train --nproc 2\)"):
                build_trainable(cfg, torch.device("cpu"))
        finally:
            shutdown()


SHARDED_INIT = r"""
import json, sys
import torch, torch.distributed as dist
import plait.model.llama as llama
from plait.config import load_config
from plait.model import Transformer
from plait.parallel import Meshes, ParallelDims
from plait.parallel.parallelize import parallelize
from plait.parallel.materialize import init_local_shard
from plait.core.torch_private import init_fake_process_group, local_box
from plait.engine.trainer import build_model

llama.INIT_BLOCK_ELEMENTS = 1000  # blocks of a few rows: shard edges fall inside blocks
overrides = sys.argv[1].split()
cfg = load_config(None, ["model.preset=debug", "run.device=cpu", "data.seq_len=32", *overrides])
single = build_model(cfg.model, torch.device("cpu"), cfg.run.seed)
full = {llama.canonical_name(k): v for k, v in single.named_parameters()}
checked = 0
for rank in (0, 3, 6, 7):
    init_fake_process_group(8, rank)
    dims = ParallelDims.from_config(cfg.parallel, 8)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    parallelize(model, Meshes.build(dims, "cpu"), cfg, torch.device("cpu"))
    model.to_empty(device=torch.device("cpu"))
    model.init_weights(cfg.run.seed, assign=init_local_shard)
    for name, p in model.named_parameters():
        shape, offset = local_box(p)
        want = full[llama.canonical_name(name)][tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        assert torch.equal(p.to_local(), want), (rank, name, offset, shape)
        checked += 1
    dist.destroy_process_group()
assert checked == 4 * len(full), (checked, len(full))
print(checked)
"""


def test_initial_values_do_not_depend_on_the_threads_that_draw_them(monkeypatch):
    """init_rows draws its blocks on several threads at once: the values are those of one thread, bitwise,
    for a whole parameter and for rows that start and stop inside blocks."""
    import plait.model.llama as llama

    monkeypatch.setattr(llama, "INIT_BLOCK_ELEMENTS", 640)  # 10 rows of 64 a block: 13 blocks
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = llama.init_rows((128, 64), 0.02, 7, 0, 128)
        torch.set_num_threads(4)
        assert torch.equal(llama.init_rows((128, 64), 0.02, 7, 0, 128), serial)
        assert torch.equal(llama.init_rows((128, 64), 0.02, 7, 15, 93), serial[15:93])
    finally:
        torch.set_num_threads(threads)
    assert serial.abs().max() <= 0.06 and 0.015 < serial.std() < 0.02  # N(0, 0.02) cut at 3 sigma


@pytest.mark.parametrize(
    "layout",
    [
        "parallel.dp_shard_degree=8",
        "parallel.dp_shard_degree=4 parallel.tp_degree=2",
        "parallel.dp_replicate_degree=2 parallel.dp_shard_degree=2 parallel.tp_degree=2",
    ],
)
def test_each_rank_draws_only_its_shards_with_the_single_process_values(layout):
    """Start-up independent of the full model: each rank draws only its shards' rows, and the values are
    those of the single-process model cut at the shard's box, bitwise, under FSDP, FSDP x TP (FSDP's strided
    shards over TP) and HSDP x TP (four ranks of a fake group of 8 each)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SHARDED_INIT, layout], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 0


def test_a_training_step_never_waits_for_the_device(monkeypatch):
    """train_step reads nothing back to the host (no .item(), .tolist(), bool() of a tensor): on a GPU each would
    stall the CPU until the queued kernels ran. The step's one host sync is the guard's, after it."""
    from plait.config import load_config
    from plait.engine.trainer import build_trainable, train_step

    cfg = load_config(None, ["model.preset=debug", "data.seq_len=16", "train.global_batch_size=4"])
    t = build_trainable(cfg, torch.device("cpu"))
    reads: list[str] = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    x = torch.randint(0, cfg.model.vocab_size, (4, 16))
    result = train_step(t, x, torch.roll(x, -1, 1))
    monkeypatch.undo()
    assert reads == [], f"train_step read {reads} back to the host"
    assert torch.isfinite(result.loss) and result.stepped


def test_a_process_that_trains_again_and_again_keeps_its_excepthook(data_dir, tmp_path):
    """torch's init_process_group wraps sys.excepthook to prefix tracebacks with "[rank0]: " and never unwraps it;
    plait puts back the hook it found, so a notebook (or a test suite) that trains twice prints no stacked
    prefixes: the hook after a run and a `plait fit`-style fake group is the one before."""
    import sys

    from plait.cli import main
    from plait.parallel.dims import ParallelDims
    from plait.parallel.env import one_rank_of
    from runs import debug_run

    before = sys.excepthook
    for i in range(2):
        assert main(["train", *(f"--{s}" for s in debug_run(data_dir, tmp_path, f"r{i}", 1))]) == 0
        assert sys.excepthook is before
    with one_rank_of(ParallelDims(dp_replicate=1, dp_shard=4, tp=1, pp=1), 0, torch.device("cpu")):
        assert sys.excepthook is not before  # torch's wrapper, while the group lives
    assert sys.excepthook is before
