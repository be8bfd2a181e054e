"""plait.core.profiling's pieces: the kernel kinds of a device profile, the stack sampler of a cold start (samples
weighted by wall time, so native code holding the GIL is counted where it ran)."""

import threading
import time

import pytest

from plait.core.profiling import StackSampler, kind_of


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


def _hold_the_gil(seconds: float) -> None:
    """Native code that keeps the GIL: sum() over a range runs in C without letting another thread in."""
    n = 2_000_000
    start = time.perf_counter()
    sum(range(n))
    n = int(n * seconds / max(time.perf_counter() - start, 1e-6))
    sum(range(n))


def test_the_sampler_counts_the_calling_threads_stack():
    other = threading.Thread(target=_spin, args=(0.6,))  # another busy thread: not counted
    with StackSampler(interval_s=0.05) as sampler:
        other.start()
        _spin(0.6)
        time.sleep(0.2)
    other.join()
    top = sampler.top()
    spun = sum(s for stack, s in top.items() if stack.startswith("test_profiling.py:_spin <- test_profiling.py:test_"))
    assert 0.4 <= spun <= 0.8, top
    assert not any("threading.py:run" in stack for stack in top), top  # the other thread's frames
    assert sampler.areas()["sampled"] == pytest.approx(sum(sampler.seconds.values()))


def test_the_sampler_counts_native_code_that_holds_the_gil():
    """While sum() holds the GIL the sampler thread waits; the seconds it waited go to the stack that called
    the native code (a sample count would have seen one sample for the whole call)."""
    with StackSampler(interval_s=0.05) as sampler:
        start = time.perf_counter()
        _hold_the_gil(1.0)
        held = time.perf_counter() - start
    there = sum(s for stack, s in sampler.top().items() if stack.startswith("test_profiling.py:_hold_the_gil"))
    assert held > 0.5 and there >= 0.8 * held, (held, sampler.top())
    assert sampler.samples < held / 0.05 / 2  # few samples: the GIL was held, yet the time is all there


def test_a_device_profile_is_described_in_one_line():
    from plait.core.profiling import describe

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
