"""bench/attention.py's per-kernel split: profiler events summed by short kernel name (no GPU needed)."""
import sys
from types import SimpleNamespace

import pytest
import torch

from _shards import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import attention as bench_attention  # noqa: E402


def event(name: str, us: float, device=torch.autograd.DeviceType.CUDA):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(elapsed_us=lambda: us))


def test_kernel_times_sum_by_short_name_per_call():
    reduce = "void at::native::(anonymous namespace)::reduce_kernel<512, 1, at::native::ReduceOp<float, " \
             "at::native::func_wrapper_t<float, at::native::sum_functor<float, float, float>::operator()" \
             "(at::TensorIterator&)::{lambda(float, float)#1}> > >(at::native::ReduceOp<float> )"
    events = [event("_attn_dq_kernel", 300.0), event("_attn_dkdv_kernel", 400.0), event("_attn_dq_kernel", 340.0),
              event(reduce, 80.0), event("Memcpy DtoD (Device -> Device)", 10.0),
              event("aten::sum", 999.0, torch.autograd.DeviceType.CPU)]          # a CPU op: not GPU time
    times = bench_attention.kernel_times(events, iters=2)
    assert times == pytest.approx({"_attn_dq_kernel": 0.32, "_attn_dkdv_kernel": 0.2, "reduce_kernel": 0.04,
                     "Memcpy DtoD (Device -> Device)": 0.005}, rel=1e-12)


def test_short_kernel_name_keeps_the_function_name_only():
    f = bench_attention.short_kernel_name
    assert f("void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, "
             "2, 4, 2, false, false, cutlass::bfloat16_t>, true>(flash::Flash_bwd_params)") == \
        "flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel"
    assert f("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
             "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)") \
        == "vectorized_elementwise_kernel"
    assert f("nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNT") == "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNT"
    assert f("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD (Device -> Device)"
