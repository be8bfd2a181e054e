"""torch APIs that are not public, each behind a function here, so a torch upgrade that moves one breaks one
place (and its test), not the callers. Nothing else in plait imports a private torch module or name, reads a
`_`-attribute of torch, or passes torch a `_`-keyword: tests/unit/test_layers.py reads the source to hold that. The
private API of the libraries beside torch (torchao, s3fs) is kept here too, at the end, for the same reason.

Longer than the house's 450 lines on purpose: the rule is one module for all of them, so that a torch upgrade
is checked by reading one file; each function is a few lines."""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, cast


def local_box(dtensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's shard of a DTensor: the box of the global tensor it holds,
    for any placements, FSDP2's strided shards on top of tensor parallelism included. torch's own helper
    for this is what DCP uses to place shards in a checkpoint."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(dtensor.shape, dtensor.device_mesh, dtensor.placements)


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """A process group of `world_size` ranks in this one process whose collectives do nothing: shapes,
    placements and each rank's shards are real, values are not. For sizing a layout with no cluster."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def sac_cached_tensors(caching_mode) -> list:
    """The tensors selective activation checkpointing keeps for backward in one region: the outputs its
    policy saved, held in the cache of the first dispatch mode create_selective_checkpoint_contexts returns."""
    import torch
    from torch.utils._pytree import tree_leaves

    # per op: outputs by invocation (torch >= 2.12: a dict of them; torch 2.11: a list)
    entries = [list(v.values()) if isinstance(v, dict) else list(v) for v in caching_mode.storage.values()]
    return [leaf.val for leaf in tree_leaves(entries) if isinstance(getattr(leaf, "val", None), torch.Tensor)]


def reducing_pipeline_stage():
    """A PipelineStage class whose FSDP-sharded stage reduce-scatters its gradients after every micro-batch's
    backward and accumulates them sharded, instead of keeping them unsharded (fp32, the whole stage) until
    the end of the step. torch's stage turns FSDP's gradient sync off before each micro-batch's backward
    (PipelineStage.backward_maybe_with_nosync) and reduces once at the end (perform_reduce_grad, which finds
    nothing left to reduce here: FSDP's post-backward is idempotent); this one turns it on for a full backward.
    Schedules that split backward into input and weight parts (zero bubble) are not covered: refused where
    the layout is checked."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._backward import stage_backward

    class ReducingStage(PipelineStage):
        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
            if backward_type != "full" or not isinstance(self.submod, FSDPModule):
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            self.submod.set_is_last_backward(False)  # the end-of-step reduction still finalises
            self.submod.set_reshard_after_backward(False)
            self.submod.set_requires_gradient_sync(True)
            grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
            return grads, None

    return ReducingStage


def _receive_buffers_on_meta(infos) -> None:
    """bounded_receive_stage: each receive buffer back to a meta tensor of its shape (the template for its next)."""
    import torch

    for info in infos:
        buffer = getattr(info, "buffer", None)  # root arguments (first stage) have none
        if isinstance(buffer, torch.Tensor) and buffer.device.type != "meta":
            info.buffer = torch.empty_like(buffer, device="meta").requires_grad_(buffer.requires_grad)


def _receive_buffers_on_device(infos, device) -> None:
    """bounded_receive_stage: each receive buffer made on the device, just before its receive is posted."""
    import torch

    for info in infos:
        buffer = getattr(info, "buffer", None)
        if isinstance(buffer, torch.Tensor) and buffer.device.type == "meta":
            info.buffer = torch.empty_like(buffer, device=device).requires_grad_(buffer.requires_grad)


def _let_go(loss) -> None:
    """The last stage's losses stay in the schedule until the step ends (_internal_losses). After their backward,
    the graph behind one has no saved tensors left but still holds the stage's input (the leaf its AccumulateGrad
    node refers to), so every micro-batch's received input would live to the end of the step: detached in place,
    the graph goes."""
    import torch

    if isinstance(loss, torch.Tensor) and loss.grad_fn is not None and loss._base is None:
        loss.detach_()


def bounded_receive_stage(stage_class):
    """A pipeline stage class whose receive buffers exist only while their micro-batch is in flight. torch's
    stage makes one buffer per micro-batch and direction when it first runs (`args_recv_info` /
    `grad_recv_info`, a `_RecvInfo.buffer` each) and keeps all of them for good: 2 m activations' worth on a
    middle stage, however few micro-batches the schedule has in flight. Here a buffer is made just before its
    receive is posted (get_fwd_recv_ops / get_bwd_recv_ops) and the stage lets go of it once the micro-batch's
    forward / backward has run; autograd and the stage's forward cache hold what backward still needs, so the
    memory lives exactly as long as the micro-batch does. Between uses each buffer is a meta tensor of the same
    shape, dtype and requires_grad, the template for the next one. The last stage's loss of a micro-batch is
    detached once its backward is done (see _let_go)."""
    base: Any = stage_class  # a class known at run time only

    class BoundedStage(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.plait_losses: dict = {}  # zero bubble: losses whose weight pass is still to come

        def _prepare_forward_infra(self, *args, **kwargs):
            out = super()._prepare_forward_infra(*args, **kwargs)
            for infos in self.args_recv_info.values():
                _receive_buffers_on_meta(infos)
            return out

        def _prepare_backward_infra(self, *args, **kwargs):
            out = super()._prepare_backward_infra(*args, **kwargs)
            for infos in self.grad_recv_info.values():
                _receive_buffers_on_meta(infos)
            return out

        def get_fwd_recv_ops(self, fwd_chunk_id):
            _receive_buffers_on_device(self.args_recv_info[fwd_chunk_id], self.device)
            return super().get_fwd_recv_ops(fwd_chunk_id)

        def get_bwd_recv_ops(self, bwd_chunk_id):
            if self.has_backward and not self.is_last:
                _receive_buffers_on_device(self.grad_recv_info[bwd_chunk_id], self.device)
            return super().get_bwd_recv_ops(bwd_chunk_id)

        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            _receive_buffers_on_meta(self.args_recv_info[fwd_chunk_id])
            return out

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            out = super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
            if bwd_chunk_id in self.grad_recv_info:
                _receive_buffers_on_meta(self.grad_recv_info[bwd_chunk_id])
            if full_backward:
                _let_go(loss)
            else:  # zero bubble: the weight pass of the first stage walks the graph from the loss again
                self.plait_losses[bwd_chunk_id] = loss
            return out

        def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
            out = super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
            _let_go(self.plait_losses.pop(bwd_chunk_id, None))
            return out

    BoundedStage.__name__ = f"Bounded{stage_class.__name__}"
    return BoundedStage


def flatten_mesh(mesh, name: str):
    """The axes of `mesh` (a slice of the world mesh) merged into one axis called `name`: DeviceMesh._flatten,
    which also registers the name on the world mesh."""
    return mesh._flatten(name)


def merge_inner_axes(mesh, outer: str, inner: tuple[str, ...], name: str):
    """A 2-D mesh (outer, name) with the `inner` axes of the world mesh merged into one called `name`
    (HSDP over dp_replicate x (dp_shard x cp)). torch >= 2.10 unflattens a flattened mesh; older torch slices the
    flattened axis off the world mesh (which newer torch deprecates)."""
    flat = mesh[(outer, *inner)]._flatten(f"{outer}_{name}")
    if hasattr(flat, "_unflatten"):
        return flat._unflatten(0, (mesh[outer].size(), flat.size() // mesh[outer].size()), (outer, name))
    mesh[inner]._flatten(name)
    return mesh[outer, name]


def unflatten_mesh(flat, sizes: tuple[int, ...], names: tuple[str, ...]):
    """A flattened 1-D mesh (`flatten_mesh`) split again into axes of the given sizes and names: sub-meshes of
    the same world mesh, so FSDP2 can shard a parameter that is already a DTensor on one of them
    (DeviceMesh._unflatten, torch >= 2.10)."""
    return flat._unflatten(0, sizes, names)


_COUNTED_MODES: dict[type, type] = {}


def count_only_saved_ops(modes, saved) -> None:
    """Selective activation checkpointing's two dispatch modes (from create_selective_checkpoint_contexts)
    changed in place to count and cache only the ops in `saved`; every other op runs as it is, in forward
    and in the recompute. torch matches the recompute to the forward op by op (an invocation counter per op),
    so a region that contains an FSDP2-sharded module (expert-parallel experts: plait.parallel.fsdp)
    fails in backward: FSDP's hooks run a different number of record_function, all-gather and copy ops in the
    recompute than in forward (pytorch/pytorch#196862 makes torch skip those; not in torch 2.13). The ops
    left uncounted are ones the policy recomputes anyway, so only the bookkeeping changes. Eager mode only."""
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

    for mode in modes:
        base = type(mode)
        if base not in (_CachingTorchDispatchMode, _CachedTorchDispatchMode):
            raise TypeError(f"not a selective-checkpoint mode: {base.__name__}")
        if base not in _COUNTED_MODES:

            def dispatch(self, func, types, args=(), kwargs=None, _base=base):
                if func not in self.plait_saved:
                    return func(*args, **(kwargs or {}))
                return _base.__torch_dispatch__(self, func, types, args, kwargs)

            _COUNTED_MODES[base] = type(f"SavedOnly{base.__name__}", (base,), {"__torch_dispatch__": dispatch})
        mode.__class__ = _COUNTED_MODES[base]
        mode.plait_saved = saved


# torch._grouped_mm on the CPU: only where tests ask (this flag, or PLAIT_GROUPED_MM_ON_CPU=1 in the processes a
# test starts, read at each call: a test's workers may have imported plait before it set the variable); plait's
# CPU default is one matmul per expert.
GROUPED_MM_ON_CPU = False
"""Tests set this to run `grouped_mm` on the CPU too (where torch has it, fp32, forward and backward), to check
the path CUDA takes against the exact loop."""


def grouped_mm_fits(x, *weights, dtype=None) -> bool:
    """Whether torch._grouped_mm runs `x` against these stacked weights here, all in `dtype` (their own dtype
    when not given): grouped_mm_runs for their device and widths."""
    return grouped_mm_runs(x.device, dtype or x.dtype, *(t.shape[-1] for t in (x, *weights)))


def grouped_mm_runs(device, dtype, *widths: int) -> bool:
    """Whether torch._grouped_mm runs here on operands of these last-dimension widths: bf16 on a CUDA device of
    compute capability 9.0 or newer (H100), rows 16-byte aligned (torch's requirement); on the CPU only where
    tests ask (GROUPED_MM_ON_CPU). Elsewhere the caller loops over the groups."""
    import torch

    if not hasattr(torch, "_grouped_mm"):
        return False
    size = torch.empty((), dtype=dtype).element_size()
    aligned = all(w * size % 16 == 0 for w in widths)
    if device.type == "cpu":
        asked = GROUPED_MM_ON_CPU or os.environ.get("PLAIT_GROUPED_MM_ON_CPU") == "1"
        return asked and aligned and dtype in (torch.float32, torch.bfloat16)
    return (
        device.type == "cuda"
        and dtype == torch.bfloat16
        and torch.cuda.get_device_capability(device) >= (9, 0)
        and aligned
    )


def grouped_mm(x, weight, offsets):
    """Rows offsets[g-1]:offsets[g] of x (N, K) times weight[g] (G, K, M): one kernel for every group
    (torch._grouped_mm; offsets int32, cumulative)."""
    import torch

    return torch._grouped_mm(x, weight, offs=offsets)


def in_backward() -> bool:
    """Whether autograd's backward is running on this thread (an activation-checkpoint recompute is: its
    forward must not count statistics a second time)."""
    import torch

    return torch._C._current_graph_task_id() != -1


def quiet_shape_inference(stage_class, quiet):
    """A pipeline stage class whose shape inference (the extra forward, and backward, torch's stage runs on its
    first step to learn the shapes it sends: `_forward_metadata_inference` / `_backward_metadata_inference`
    in torch >= 2.12, `_shape_inference` before) runs inside `quiet(submodule)`, a context manager: model
    statistics (MoE routing counts) must not count those passes."""

    def wrapped(name):
        def method(self, *args, **kwargs):
            with quiet(self.submod):
                return getattr(super(Stage, self), name)(*args, **kwargs)

        return method

    names = ("_forward_metadata_inference", "_backward_metadata_inference", "_shape_inference")
    members = {name: wrapped(name) for name in names if hasattr(stage_class, name)}
    Stage = type(f"Quiet{stage_class.__name__}", (stage_class,), members)
    return Stage


# ------------------------------------------------------------------ distributed checkpoint (DCP) internals


def dcp_stream_extension() -> type:
    """DCP's base class for a transform of every record's byte stream on save and load
    (torch.distributed.checkpoint._extension, EXPERIMENTAL in torch)."""
    from torch.distributed.checkpoint._extension import StreamTransformExtension

    return StreamTransformExtension


def dcp_storage_writer(cls, path, extensions: list, **kwargs):
    """A DCP writer of class `cls` (FileSystemWriter, FsspecWriter or a subclass) that passes every record
    through `extensions` (the writers' private `_extensions` argument)."""
    return cls(path, _extensions=extensions, **kwargs)


def dcp_storage_reader(cls, path, extensions: list[type]):
    """A DCP reader of class `cls` that undoes the `extensions` classes' transforms on load (as
    FileSystemReader's private `_extension_registry` argument does; FsspecReader does not take it)."""
    from torch.distributed.checkpoint._extension import ExtensionRegistry
    from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms

    registry = ExtensionRegistry()
    for extension in extensions:
        registry.register(extension)
    reader = cls(path)
    reader.transforms = _StorageReaderTransforms(registry)
    return reader


def fsspec_storage() -> tuple[type, type]:
    """DCP's (FsspecWriter, FsspecReader): checkpoints on any fsspec filesystem (S3 here)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return FsspecWriter, FsspecReader


def dcp_metadata_path(reader) -> str:
    """Where a DCP filesystem reader finds the checkpoint's global metadata file."""
    return reader._get_metadata_path()


class LabelledRecords:
    """Mixed into a DCP filesystem reader: each record's stream it opens names where it comes from
    (`plait_where`: '<file> at byte <offset>'), for the messages of a record that fails its checksum."""

    def _slice_file(self, file, sinfo):
        view = cast(Any, super())._slice_file(file, sinfo)  # a mixin: the reader after it in the MRO has it
        view.plait_where = f"{sinfo.relative_path} at byte {sinfo.offset}"
        return view


# -------------------------------------------------------------------------------- kernels and autograd


def checkpoint_wrapper(module, **kwargs):
    """torch's activation-checkpoint wrapper module (torch.distributed.algorithms._checkpoint)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(module, **kwargs)


@contextlib.contextmanager
def highest_fp32_matmuls():
    """True fp32 matmuls (no TF32) inside, and afterwards every fp32-precision setting of torch.backends exactly as
    before. torch.set_float32_matmul_precision("highest") also writes 'ieee' into the per-backend settings
    (torch >= 2.9: cuda.matmul, mkldnn.matmul, initially 'none'), and Inductor keys its FX-graph cache on them:
    restoring the old precision by name would leave the process's cache keys changed."""
    import torch

    b = torch.backends
    owners = [b, b.cuda.matmul, b.cudnn, b.mkldnn]
    owners += [getattr(o, n) for o in (b.cudnn, b.mkldnn) for n in ("conv", "rnn", "matmul") if hasattr(o, n)]
    saved = [(o, o.fp32_precision) for o in owners if hasattr(o, "fp32_precision")]
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)
        for owner, value in saved:
            with contextlib.suppress(RuntimeError, ValueError, AttributeError):
                owner.fp32_precision = value


def is_checkpoint_wrapper(module) -> bool:
    """Whether a module is torch's activation-checkpoint wrapper (checkpoint_wrapper's)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return isinstance(module, CheckpointWrapper)


def attention_kernel_ops() -> list:
    """The ATen kernels scaled_dot_product_attention dispatches to (flash, memory-efficient and cuDNN on CUDA,
    flash on the CPU) and grouped matmul, where this torch has them: the ops whose outputs selective activation
    checkpointing keeps."""
    import torch

    aten = torch.ops.aten
    names = (
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_grouped_mm",
    )
    return [getattr(aten, name).default for name in names if hasattr(aten, name)]


def cpu_flash_attention(q, k, v, causal: bool):
    """torch's CPU flash attention kernel: (output, log-sum-exp of each query row) for (B, H, T, hd) inputs."""
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)


def cpu_flash_attention_backward(dout, q, k, v, out, lse, causal: bool):
    """(dq, dk, dv) of cpu_flash_attention, given its output and log-sum-exp."""
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)


def foreach_norm(tensors: list, dtype) -> list:
    """The 2-norm of each tensor, accumulated in `dtype`, in one call per device and dtype group."""
    import torch

    return list(torch._foreach_norm(tensors, 2, dtype=dtype))


def local_tensor(t):
    """A DTensor's local shard as a plain tensor, outside autograd (a saved-tensor hook's view); else `t`."""
    return getattr(t, "_local_tensor", t)


def view_base(t):
    """The tensor `t` is a view of (e.g. the weight behind weight.t() inside F.linear), or `t` itself."""
    return t._base if t._base is not None else t


def version_counter(t) -> int:
    """The tensor's in-place version counter: it changes whenever the tensor is written in place."""
    return t._version


def swap_parameters(swaps) -> None:
    """Set each (module, name, parameter) as that module's parameter in place, without the checks and hooks
    of setattr (a whole tensor stands in for a sharded one while a module resets itself, then goes back)."""
    for module, name, param in swaps:
        module._parameters[name] = param


# ------------------------------------------------------------------------------ collectives' recorder


def flight_recorder_entries() -> list[dict]:
    """torch.distributed's flight recorder: the collectives this process entered, oldest first (empty where
    it records none)."""
    import pickle

    import torch

    # the recorder's own dump, made by torch in this process from its ring buffer (not a file from elsewhere)
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace")  # noqa: B009 - not in torch's type stubs
    return pickle.loads(dump(True, False, False)).get("entries") or []


# ------------------------------------------------------------------------------------ Dynamo and Inductor


def compile_cache_counters() -> dict[str, int]:
    """Inductor's FX-graph cache and AOTAutograd's cache hits and misses in this process so far."""
    from torch._dynamo.utils import counters

    return {
        "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
        "aotautograd_cache_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "aotautograd_cache_miss": counters["aot_autograd"]["autograd_cache_miss"],
    }


def warm_compile_workers() -> None:
    """Start Inductor's pool of Triton compile workers now. torch starts it at the first compilation, and until
    its workers are up (a process that imports torch, then its workers) every kernel compiles in the main
    process, one after another (`AsyncCompile.use_process_pool` is false while the pool is not ready). Called
    before the model is built, the pool comes up while the model builds. torch's own guard applies: nothing
    where Triton is not installed or TORCH_WARM_POOL=0."""
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()


def compilation_metrics() -> list:
    """Dynamo's record of recent compilations (frames and lazily compiled backward graphs), oldest first."""
    from torch._dynamo.utils import get_compilation_metrics

    return get_compilation_metrics()


def cpu_vec_isas() -> list:
    """Inductor's candidate SIMD instruction sets for this CPU (each true where it passed Inductor's probe)."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    return valid_vec_isa_list()


def vec_isa_probes_answerable() -> bool:
    """Whether this torch's Inductor has the dlopen probe answer_vec_isa_probes answers (torch 2.11 does not)."""
    from torch._inductor import cpu_vec_isa

    return hasattr(cpu_vec_isa.VecISA, "_probe_load")


def answer_vec_isa_probes(known: dict[str, bool]) -> bool:
    """Inductor's dlopen probe of a candidate ISA (`VecISA._probe_load`) answered from `known` (ISA class name ->
    passed) where it says True, else probed as before. False where this torch has no such probe."""
    from torch._inductor import cpu_vec_isa

    probe = getattr(cpu_vec_isa.VecISA, "_probe_load", None)
    if probe is None:
        return False
    probe = getattr(probe, "plait_probe", probe)  # answered already: wrap torch's own probe, once

    def known_or_probe(self, output_path: str) -> bool:
        return known.get(type(self).__name__, False) or probe(self, output_path)

    setattr(known_or_probe, "plait_probe", probe)  # noqa: B010 - a function's attribute
    setattr(cpu_vec_isa.VecISA, "_probe_load", known_or_probe)  # noqa: B010 - replaces the method
    return True


def reusable_stager(pinned: bool):
    """DCP's DefaultStager for every asynchronous save of a run: tensors copied to CPU buffers that are kept and
    reused from save to save (pinned where a GPU copies into them). torch 2.11 closes the stager's inner
    state-dict copier after every stage (DefaultStager._stage), which empties its table of copy functions: the
    next save fails in DCP with `KeyError: <class 'type'>`, and the buffers are dropped each time. Here that
    per-save close does nothing, and the stager's own close() (at the end of the run) closes it for real."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(pinned, False, False, False))
    inner = getattr(stager, "_state_dict_stager", None)
    if inner is not None:
        inner_close, outer_close = inner.close, stager.close

        def close() -> None:
            setattr(inner, "close", inner_close)  # noqa: B010
            outer_close()

        setattr(inner, "close", lambda: None)  # noqa: B010 - replaces the method
        setattr(stager, "close", close)  # noqa: B010
    return stager


@functools.cache
def torch_version() -> str:
    """The installed torch's version, without importing torch (read once: the planner asks per layout): from
    torch/version.py, found without running it (the package metadata's scan of site-packages costs ~30 ms of
    a plan), else from the metadata."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = os.path.join(folder, "version.py")
            found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", _read_text(path), re.MULTILINE)
            if found:
                return found.group(1)
    from importlib.metadata import version

    return version("torch")


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


def _torch_minor() -> tuple[int, int]:
    major, minor = (int(x) for x in torch_version().split(".")[:2])
    return major, minor


# torch releases on which per-block torch.compile under tensor parallelism trains as eager does: compiled TP 2
# and FSDP 2 x TP 2 equal the eager single process (loss and gradient norm, 6 steps) on real gloo groups
# (tests/parallel/test_compile.py, run in a torch 2.11 environment on 2026-11-27). Not torch 2.12 or 2.13 (both tried
# the same day): TP alone fails in backward (DTensor's NestedRedistribute: "'Tensor' object has no attribute
# '_local_tensor'"), and on 2.13 FSDP2 + TP trains on wrong gradients.
COMPILE_WITH_TP_WORKS = {(2, 11)}


def compile_with_tp_works() -> bool:
    """Whether this torch compiles plait's blocks under tensor parallelism correctly (COMPILE_WITH_TP_WORKS)."""
    return _torch_minor() in COMPILE_WITH_TP_WORKS


def weight_pass_takes_custom_functions() -> bool:
    """Whether torch's zero-bubble weight pass (pipelining's stage_backward_weight) can start from the node of a
    custom autograd Function, such as plait's fused head. torch 2.11 cannot: autograd.grad reads
    `node._input_metadata`, which a custom Function's node refuses ("legacy access pattern"); torch 2.13 can."""
    return _torch_minor() >= (2, 12)


@contextlib.contextmanager
def watch_allocations(on_tensor, on_resize):
    """While active: on_tensor(t) for every plain tensor an aten op returns (the inner tensors of a subclass
    such as DTensor), and on_resize(storage, old_nbytes, new_nbytes) for every UntypedStorage.resize_, which
    is how FSDP2 allocates and frees its gathered parameters. A dispatch mode (torch.utils._python_dispatch):
    tensors made inside compiled code or inside one op are not seen."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
    from torch.utils._pytree import tree_leaves

    def visit(t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            for name in names:
                visit(getattr(t, name))
        else:
            on_tensor(t)

    class _Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for leaf in tree_leaves(out):
                visit(leaf)
            return out

    original = torch.UntypedStorage.resize_

    def resize_(storage, size):
        before = storage.nbytes()
        result = original(storage, size)
        on_resize(storage, before, storage.nbytes())
        return result

    setattr(torch.UntypedStorage, "resize_", resize_)  # noqa: B010 - a method patched for the duration
    try:
        with _Watch():
            yield
    finally:
        setattr(torch.UntypedStorage, "resize_", original)  # noqa: B010


def unanimous_static_stage(stage_class):
    """A pipeline stage class for stages given their input and output examples (static metadata) on a fake
    process group. torch >= 2.12 has the stages agree on static metadata by a vote passed from stage to stage
    over point-to-point messages (`_warmup_forward_vote` / `_warmup_backward_result`); a fake group moves no
    data, so every vote would read the zeros of its receive buffer and fall back to exchanging metadata
    objects, which cannot cross it either. Here the vote is taken as unanimous. torch < 2.12 has no vote: the
    examples alone skip its shape inference."""
    import torch

    def unanimous(self, *args, **kwargs):
        return torch.ones(1, dtype=torch.int32, device=self.device)

    names = ("_warmup_forward_vote", "_warmup_backward_result")
    members = {name: unanimous for name in names if hasattr(stage_class, name)}
    return type(f"Static{stage_class.__name__}", (stage_class,), members)


def is_fake_group(group) -> bool:
    """Whether a process group is the fake one (`init_fake_process_group`): its collectives move nothing."""
    import torch.distributed as dist

    return dist.get_backend(group) == "fake"


# ------------------------------------------------------------------------------ DTensor placements


def sharded_dim(placement) -> int | None:
    """The tensor dimension a placement splits (Shard, and FSDP2's strided shard over tensor parallelism, which
    torch 2.13 does not count as a Shard), or None (Replicate, Partial)."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    if isinstance(placement, Shard | _StridedShard):
        return placement.dim
    return None


def shifted_placement(placement, by: int):
    """The same placement of a tensor with `by` new leading dimensions (a stack of such tensors)."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    if isinstance(placement, _StridedShard):
        return _StridedShard(placement.dim + by, split_factor=placement.split_factor)
    if isinstance(placement, Shard):
        return Shard(placement.dim + by)
    return placement


# ------------------------------------------------------------------------------ beside torch: torchao, s3fs


def float8_auto_filter(recipe: str):
    """torchao's own heuristic of the linear layers float8 pays for, under `recipe` (module, fqn) -> bool."""
    from torchao.float8 import _auto_filter_for_recipe

    return _auto_filter_for_recipe(recipe, filter_fqns=[])


async def s3_get_object(fs, bucket: str, key: str) -> dict:
    """One GET of an object through s3fs's client (body, ETag and LastModified of one version together)."""
    return await fs._call_s3("get_object", Bucket=bucket, Key=key)
