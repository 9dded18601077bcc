"""Exact fp32 transcriptions for the optimizer-kernel tests (tests/test_optimizer_kernels.py, its interpreter half,
tests/test_kernels_gpu.py), and the ulp error of the cross entropy's reciprocal.

PyTorch gives no fp32 fused multiply-add, and eager Adam on CUDA rounds twice where an FMA is involved only once, so
`fma32` builds one from float64: the product of two fp32 values is exact in float64, the sum's float64 rounding
error is recovered exactly (Knuth's TwoSum), and that error decides the one case where rounding float64 -> fp32
would be a second rounding that changes the result (the float64 sum sitting exactly halfway between two fp32
values). Valid for finite results in the fp32 normal range and their neighbourhood (the tests use no other);
infinities and NaNs propagate as in IEEE arithmetic.
"""
import numpy as np
import torch

F32 = torch.float32


def fma32(a, b, c) -> torch.Tensor:
    """Correctly rounded fp32 a*b + c for fp32 tensors or Python floats (floats are rounded to fp32 first)."""
    device = next((t.device for t in (a, b, c) if isinstance(t, torch.Tensor)), None)
    a, b, c = (torch.as_tensor(t, dtype=F32, device=device) for t in (a, b, c))
    a, b, c = (t.double() for t in torch.broadcast_tensors(a, b, c))
    p = a * b                                    # exact: 24 + 24 significant bits
    s = p + c                                    # rounded once (float64)
    bv = s - p
    err = (p - (s - bv)) + (c - bv)              # TwoSum: s + err == p + c exactly
    f = s.float().double()                       # round to nearest even fp32
    d = s - f                                    # exact (f is within one fp32 ulp of s)
    other = f + 2 * d                            # the fp32 neighbour on s's other side, if s is a midpoint
    midpoint = (d != 0) & (other.float().double() == other)
    toward_other = midpoint & (err != 0) & ((err > 0) == (d > 0))
    out = torch.where(toward_other, other, f).float()
    return torch.where(torch.isfinite(s), out, s.float())


def sqrt32(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root. torch's CPU sqrt is not: with the AVX512 kernels it was off by an ulp in
    16% of fp32 (and 1% of float64) values on an AMD EPYC, where the same code passed on other CI machines. numpy's
    float64 sqrt is IEEE's, and rounding it to fp32 is exact rounding (53 >= 2 * 24 + 2 bits)."""
    exact = torch.from_numpy(np.asarray(np.sqrt(x.detach().cpu().double().numpy())))
    return exact.float().to(x.device)


def div32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 a / b, through float64 like sqrt32 (the same argument), whatever the CPU kernels do."""
    return (a.double() / b.double()).float()


def f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=F32)  # a 0-dim CPU tensor: combines with tensors on any device


def adam_cuda_order(param, grad, exp_avg, exp_avg_sq, *, beta1, beta2, eps, step_size, decay):
    """train_gpt.adam_update as PyTorch runs it on CUDA, one fp32 rounding per operation: returns (param', m', v').

    add_(g, alpha) is self + alpha*other in one FMA; addcmul_ is self + value*(g*g) with g*g rounded, then one FMA
    (the CPU kernel's FMA is (value*g)*g + self instead). Scalars are rounded to fp32 (torch's opmath for fp32)."""
    g = grad.to(F32)
    m = fma32(g, 1 - beta1, exp_avg * f32(beta1))
    v = fma32(1 - beta2, g * g, exp_avg_sq * f32(beta2))
    p = param.to(F32)
    u = div32(m, sqrt32(v) + f32(eps)) * f32(step_size)
    u = u + f32(decay) * p * (u * p > 0)
    return (p - u).to(param.dtype), m, v


def rcp_fma_ulp_errors(d: torch.Tensor, out: torch.Tensor) -> tuple[float, float]:
    """The largest error of out = 1/d in ulps of 1/d, for d <= 2^125 and for 2^125 < d <= 2^126."""
    d = d.double().cpu()
    exact = 1 / d
    err = (out.double().cpu() - exact).abs() / torch.from_numpy(np.spacing(exact.float().numpy())).double()
    low, top = d <= 2.0 ** 125, (d > 2.0 ** 125) & (d <= 2.0 ** 126)
    assert low.sum() > 1000 and top.sum() > 10
    return err[low].max().item(), err[top].max().item()
