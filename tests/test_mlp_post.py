"""The post-only relu^2 MLP (the forward keeps post = bf16(relu(p)^2), p = bf16(pre); the backward rebuilds relu(p)
as sqrt(post)): its plain-PyTorch reference against the rule written out here in numpy float32 and bf16 emulation,
dpre = bf16(fp32(fp32(2q) * sqrt_fp32(fp32 post))), q = bf16(g @ W2^T), over every bf16 value of p, with the edge cases
the rule has (underflow of p^2, bf16-subnormal squares, overflow to inf, q = 0 at inf)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import triton_kernels as tk

BF16_MIN_NORMAL = 2.0 ** -126
BF16_MAX = float(torch.finfo(torch.bfloat16).max)


def all_bf16() -> torch.Tensor:
    """Every bf16 bit pattern except NaNs, as bf16."""
    bits = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16)
    values = bits.view(torch.bfloat16)
    return values[~values.isnan()]


def post_rule(p: torch.Tensor) -> torch.Tensor:
    """post = bf16(fp32(relu(p))^2) of bf16 p, in numpy float32 (a square of a bf16 is exact in fp32 until it
    overflows or underflows), rounded to bf16 by torch's cast."""
    r = np.maximum(p.float().numpy(), np.float32(0))
    with np.errstate(over="ignore"):
        return torch.from_numpy(r * r).bfloat16()


def dpre_rule(q: torch.Tensor, post: torch.Tensor) -> torch.Tensor:
    """dpre = bf16(fp32(fp32(2q) * sqrt(fp32 post))) in numpy float32 (sqrt correctly rounded)."""
    q32, post32 = q.float().numpy(), post.float().numpy()
    with np.errstate(invalid="ignore", over="ignore"):
        return torch.from_numpy((np.float32(2) * q32) * np.sqrt(post32)).bfloat16()


def record84_dpre(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return (2 * q.float() * p.float().clamp_min(0)).bfloat16()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16)) or bool(
        ((a.view(torch.int16) == b.view(torch.int16)) | (a.isnan() & b.isnan())).all())


def test_the_rounded_square_gives_back_every_bf16_whose_square_is_normal():
    """Exhaustive: bf16(sqrt(bf16(r^2))) = r for every bf16 r > 0 with bf16(r^2) normal and finite (2^-63 <= r <=
    ~1.8e19), though the unrounded root is off r by up to 2^-9 relative."""
    r = all_bf16()
    r = r[r > 0]
    post = post_rule(r)
    normal = (post.float() >= BF16_MIN_NORMAL) & post.isfinite()
    assert r[normal].min().item() == 2.0 ** -63 and 1.8e19 < r[normal].max().item() < 1.85e19
    root = post.double()[normal].sqrt()
    assert torch.equal(root.float().bfloat16(), r[normal])
    rel = (root / r[normal].double() - 1).abs().max().item()
    assert 1.7e-3 < rel <= 2.0 ** -9


def test_the_reference_backward_rule_over_every_bf16_pre():
    """The reference's dpre for every bf16 p (and q of both signs, q = 0, and a q that makes 2q overflow-free but
    large) is the rule's, bit for bit, NaNs where the rule has them."""
    p = all_bf16()
    post = post_rule(p)
    assert torch.equal(F.relu(p).square(), post), "the reference's forward post is the rule's"
    for qv in (1.0, -3.5, 0.0, -0.0, 0.0078125, 6.5e4):
        q = torch.full_like(p, qv)
        got = tk.relu2_sqrt_post_dpre_reference(q, post)
        assert got.dtype == torch.bfloat16 and same_bits(got, dpre_rule(q, post)), qv


def test_the_edge_cases_of_the_rule():
    p = all_bf16()
    post = post_rule(p)
    q = torch.full_like(p, -1.5)
    d = tk.relu2_sqrt_post_dpre_reference(q, post)
    old = record84_dpre(q, p)
    # p <= 0 (both zeros): post = +0, dpre = -0 (the sign of q), as before
    nonpos = p <= 0
    assert (post[nonpos].view(torch.int16) == 0).all()
    assert (d[nonpos] == 0).all() and d[nonpos].signbit().all()
    # 0 < p < ~6.8e-21: p^2 rounds to 0 in bf16, dpre = 0 (record 84: 2 q p, not 0)
    tiny = (p > 0) & (post == 0)
    assert p[tiny].max().item() == pytest.approx(6.8e-21, rel=0.01) and (d[tiny] == 0).all() and (old[tiny] != 0).all()
    # bf16-subnormal squares (~6.8e-21 <= p < 2^-63 ~ 1.1e-19): inexact roots
    sub = (post > 0) & (post.float() < BF16_MIN_NORMAL)
    assert p[sub].min().item() == pytest.approx(6.8e-21, rel=0.05) and p[sub].max().item() < 2.0 ** -63
    assert (post[sub].float().sqrt().bfloat16() != p[sub]).any()
    # p > ~1.8e19: post = +inf, dpre = -inf, and NaN where q = 0 (record 84: finite)
    big = post.isinf()
    assert p[big].min().item() > 1.8e19 and (d[big] == float("-inf")).all()
    assert old[big & (p.float() < 1e30)].isfinite().all()
    assert tk.relu2_sqrt_post_dpre_reference(torch.zeros_like(p), post)[big].isnan().all()
    # everywhere in the normal range: within one bf16 ulp of record 84's dpre
    normal = (post.float() >= BF16_MIN_NORMAL) & post.isfinite()
    ulps = (d[normal].view(torch.int16).int() - old[normal].view(torch.int16).int()).abs()
    assert ulps.max().item() == 1


def test_about_one_eighth_of_dpre_entries_move_by_one_ulp():
    """With p ~ N(0, 0.7^2) and q ~ N(0, 1) (bf16), the sqrt(post) form differs from record 84's 2 q relu(p) by one
    bf16 ulp in ~12.5% of the positive-p entries, never more."""
    g = torch.Generator().manual_seed(0)
    n = 400_000
    p = (0.7 * torch.randn(n, generator=g)).bfloat16()
    q = torch.randn(n, generator=g).bfloat16()
    pos = p > 0
    d = tk.relu2_sqrt_post_dpre_reference(q, F.relu(p).square())[pos]
    old = record84_dpre(q, p)[pos]
    ulps = (d.view(torch.int16).int() - old.view(torch.int16).int()).abs()
    assert ulps.max().item() == 1
    assert abs(ulps.float().mean().item() - 0.125) < 0.01


@pytest.mark.parametrize("fp8", [False, True])
def test_post_only_reference_is_record_84s_forward_with_the_sqrt_backward(fp8):
    """The forward (and dc_proj) equal record 84's reference bit for bit; dx and dc_fc are the bf16 products of the
    rule's dpre, which moves some bits of record 84's."""
    g = torch.Generator().manual_seed(1)
    M, D, H = 48, 32, 96
    x = torch.randn(M, D, generator=g).bfloat16().requires_grad_()
    c_fc = (torch.randn(H, D, generator=g) / 4).bfloat16().requires_grad_()
    c_proj = (torch.randn(H, D, generator=g) / 4).bfloat16().requires_grad_()
    grad = torch.randn(M, D, generator=g).bfloat16()
    out = tk.relu2_mlp_post_reference(x, c_fc, c_proj, fp8=fp8)
    old = tk.relu2_mlp_reference(x, c_fc, c_proj, fp8=fp8)
    assert torch.equal(out, old)
    dx, dc_fc, dc_proj = torch.autograd.grad(out, (x, c_fc, c_proj), grad)
    old_dx, old_dc_fc, old_dc_proj = torch.autograd.grad(old, (x, c_fc, c_proj), grad)
    assert torch.equal(dc_proj, old_dc_proj)
    post = tk.relu2_up_post_reference(x.detach(), c_fc.detach(), fp8)
    dpre = dpre_rule(grad @ c_proj.detach().mT, post)
    assert torch.equal(dx, dpre @ c_fc.detach()) and torch.equal(dc_fc, dpre.mT @ x.detach())
    assert not torch.equal(dc_fc, old_dc_fc)
