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


# bench/attention_error.py: the float64 values computed one document at a time must be the contract's values, or
# every error it prints is measured against the wrong thing.

def test_exact_attention_by_document_is_the_dense_contract():
    import attention_error
    import triton_kernels as tk
    gen = torch.Generator().manual_seed(3)
    T, H, D, window, scale = 150, 2, 16, 23, 0.3
    cu = torch.tensor([0, 7, 60, 61, 150, 150, 150], dtype=torch.int32)    # a 1-token document, empty ones at the end
    q, k, v, g = (torch.randn(T, H, D, generator=gen, dtype=torch.float64) for _ in range(4))
    out, grads = attention_error.exact_attention(q, k, v, g, cu, window, scale)
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = tk.varlen_attention_reference(*qkv, cu, window, scale)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, torch.autograd.grad(ref, qkv, g)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_relative_errors_are_norm_ratios():
    import attention_error
    exact = {"out": torch.tensor([3.0, 4.0], dtype=torch.float64)}
    got = {"out": torch.tensor([3.0, 4.5], dtype=torch.bfloat16)}
    assert attention_error.relative_errors(got, exact) == pytest.approx({"out": 0.1}, rel=1e-12)


def test_shape_case_doubles_the_documents_of_the_paired_layout():
    rows, heads, window, cu, lens = bench_attention.shape_case("4096:normal:384")
    assert (rows, heads, window) == (4096, 6, 384) and sum(lens) == 4096 and int(cu[-1]) == 4096
    prows, pheads, pwindow, pcu, plens = bench_attention.shape_case("4096:paired:640")
    assert (prows, pheads, pwindow) == (8192, 3, 640)
    assert torch.equal(pcu, cu * 2) and plens == [2 * n for n in lens]
    with pytest.raises(ValueError, match="not T:layout:window"):
        bench_attention.shape_case("4096:pairs:640")


def test_gpu_shape_cases_exits_with_one_error_line(monkeypatch):
    monkeypatch.setattr(bench_attention.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as bad_spec:
        bench_attention.gpu_shape_cases("4096:normal:384,4096:pairs:640", "an H100")
    assert str(bad_spec.value).startswith("error: shape '4096:pairs:640'")
    with pytest.raises(SystemExit) as no_gpu:
        bench_attention.gpu_shape_cases("4096:normal:384", "an H100")
    assert str(no_gpu.value) == "error: this benchmark needs an H100; run it on the device"


def test_gpu_shape_cases_returns_each_spec_with_its_case(monkeypatch, capsys):
    monkeypatch.setattr(bench_attention.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_attention.torch.cuda, "get_device_name", lambda: "Test GPU")
    cases = bench_attention.gpu_shape_cases("4096:normal:384,4096:paired:640", "an H100")
    assert [spec for spec, _ in cases] == ["4096:normal:384", "4096:paired:640"]
    (rows, heads, window, cu, _), (prows, pheads, pwindow, pcu, _) = (case for _, case in cases)
    assert (rows, heads, window, prows, pheads, pwindow) == (4096, 6, 384, 8192, 3, 640)
    assert torch.equal(pcu, cu * 2)
    assert "Test GPU" in capsys.readouterr().out
