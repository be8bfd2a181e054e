"""plait.profiling's pieces: the kernel kinds of a device profile, the stack sampler of a cold start (samples
taken without the GIL, so native code holding it is seen too)."""

import threading
import time

import pytest

from plait.profiling import StackSampler, _thread_frames, kind_of


@pytest.mark.parametrize(
    "kernel,kind",
    [
        ("triton_poi_fused__to_copy_1", "triton (compiled)"),  # Inductor names kernels after their ops
        ("triton_red_fused_mm_amax_0", "triton (compiled)"),
        ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "matmul"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", "attention"),
        (
            "void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>",
            "multi-tensor (optimizer, clipping)",
        ),
        (
            "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda>",
            "copies and casts",
        ),
        ("Memcpy DtoD (Device -> Device)", "copies and casts"),
        ("ncclDevKernel_AllGather_RING_LL", "collectives"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "other eager"),
    ],
)
def test_kernel_kinds(kernel, kind):
    assert kind_of(kernel) == kind


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_the_sampler_counts_the_calling_threads_stack():
    other = threading.Thread(target=_spin, args=(0.6,))  # another busy thread: not counted
    with StackSampler(interval_s=0.05) as sampler:
        other.start()
        _spin(0.6)
        time.sleep(0.2)
    other.join()
    top = sampler.top()
    spun = sum(s for stack, s in top.items() if stack.startswith("test_profiling.py:_spin <- test_profiling.py:test_"))
    assert 0.4 <= spun <= 0.65, top
    assert not any("threading.py:run" in stack for stack in top), top  # the other thread's frames
    assert sampler.areas()["sampled"] == pytest.approx(sampler.samples * 0.05)


def test_a_faulthandler_dump_is_read_for_one_thread():
    dump = """0:00:00.250000)!
Thread 0x00007f0000000002 (most recent call first):
  File "/x/threading.py", line 1 in wait
Current thread 0x00007f0000000001 (most recent call first):
  File "/site-packages/torch/_inductor/codecache.py", line 9 in load
  File "/src/plait/train.py", line 3 in train_step
"""
    assert _thread_frames(dump, "0x00007f0000000001") == [
        ("/site-packages/torch/_inductor/codecache.py", "load"),
        ("/src/plait/train.py", "train_step"),
    ]
    sampler = StackSampler(interval_s=0.5)
    sampler._count(_thread_frames(dump, "0x00007f0000000001"))
    assert sampler.areas() == {"sampled": 0.5, "inductor": 0.5, "plait": 0.5}


def test_a_device_profile_is_described_in_one_line():
    from plait.profiling import describe

    summary = {
        "steps": 3,
        "wall_per_step_s": 0.5,
        "kernels_per_step": 6059.0,
        "device_busy_per_step_s": 0.49,
        "device_idle_share": 0.02,
        "device_s_per_step_by_kind": {"matmul": 0.322, "attention": 0.052},
    }
    assert describe(summary) == (
        "profile (3 steps, 6,059 kernels a step): device busy 490.0 of 500.0 ms a step, idle 2.0%; "
        "matmul 322.0 ms, attention 52.0 ms"
    )
