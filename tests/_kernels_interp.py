"""Interpreter checks of triton_kernels.py (run by tests/test_kernels.py in a subprocess with TRITON_INTERPRET=1).

The interpreter's bf16 arithmetic is not faithful, so every kernel runs in its float32 test mode, where a bf16
rounding point becomes a no-op and the kernels must agree with float64 formulas to float32 accuracy.

Tolerances: an fp32 dot product of K terms, accumulated in any order, is within gamma_K * sum_i |x_i y_i| of the exact
value, gamma_K = K*u/(1-K*u) with u = 2^-24 (Higham, Accuracy and Stability, §3.1). The checks below use that bound
elementwise with a factor 2 of slack (plus one rounding of the result), so a wrong tile, mask or epilogue (errors of
order |x||y|) fails while any legal summation order passes.
"""
import os

import numpy as np
import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/test_kernels.py, which sets TRITON_INTERPRET=1", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import triton_kernels as tk  # noqa: E402
import _ce_transcription as tr  # noqa: E402
from _fp32_exact import rcp_fma_ulp_errors  # noqa: E402

U32 = 2.0 ** -24


def dot_error_bound(abs_products_sum: torch.Tensor, k: int) -> torch.Tensor:
    """2 * gamma_k * sum|x y| plus one fp32 rounding of the result (abs_products_sum in float64)."""
    return 2 * (k * U32 / (1 - k * U32)) * abs_products_sum + 2 * U32 * abs_products_sum + 1e-30


def assert_within(actual: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (actual.double() - exact).abs()
    worst = (err / bound).max().item()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    assert worst <= 1.0, f"{what}: error {worst:.3g}x the fp32 bound (max abs err {err.max().item():.3g})"


# ------------------------------------------------------------------------------------------------------------------
# Sections 1-2: symmetric kernels
# ------------------------------------------------------------------------------------------------------------------

SYM_TILES = [(16, 32, 16), (32, 16, 16), (16, 16, 32)]  # BM != BN both ways, and BK > K tail


@pytest.mark.parametrize("tiles", SYM_TILES)
@pytest.mark.parametrize("shape, transposed", [((37, 50), False), ((3, 40, 24), False), ((2, 33, 70), True)])
def test_xxt_matches_float64_and_is_exactly_symmetric(shape, transposed, tiles):
    g = torch.Generator().manual_seed(hash((shape, tiles)) % 2**31)
    if transposed:  # arbitrary strides: A is a transposed view of a (B, K, M) buffer
        A = torch.randn(shape[0], shape[2], shape[1], generator=g).mT
    else:
        A = torch.randn(*shape, generator=g)
    out = tk._launch_sym_aat(A, 0.0, 1.0, add_ba=False, tiles=tiles)
    A64 = A.double()
    k = A.shape[-1]
    assert out.shape == (*A.shape[:-1], A.shape[-2]) and out.dtype == A.dtype
    assert_within(out, A64 @ A64.mT, dot_error_bound(A64.abs() @ A64.abs().mT, k), "xxt")
    assert torch.equal(out, out.mT), "xxt output is not exactly symmetric"


def test_xxt_public_launcher_and_op():
    A = torch.randn(2, 20, 36)
    ref = A.double() @ A.double().mT
    bound = dot_error_bound(A.double().abs() @ A.double().abs().mT, 36)
    assert_within(tk.xxt_triton(A), ref, bound, "xxt_triton")
    assert_within(torch.ops.nanogpt_kernels.xxt(A), ref, bound, "torch.ops xxt")


@pytest.mark.parametrize("tiles", SYM_TILES)
@pytest.mark.parametrize("shape", [(45, 45), (2, 32, 32)])
def test_ba_plus_cAA_matches_float64(shape, tiles):
    g = torch.Generator().manual_seed(hash((shape, tiles, "ba")) % 2**31)
    X = torch.randn(*shape, generator=g)
    A = (X + X.mT) / 2  # symmetric, as in Polar Express
    b, c = -2.808917465908714, 0.5000178451051316
    out = tk._launch_sym_aat(A, b, c, add_ba=True, tiles=tiles)
    A64 = A.double()
    b32, c32 = float(torch.tensor(b)), float(torch.tensor(c))  # the kernel takes b, c as fp32
    exact = c32 * (A64 @ A64.mT) + b32 * A64
    bound = dot_error_bound(abs(c32) * (A64.abs() @ A64.abs().mT) + abs(b32) * A64.abs(), shape[-1] + 2)
    assert_within(out, exact, bound, "ba_plus_cAA")
    assert torch.equal(out, out.mT), "ba_plus_cAA output is not exactly symmetric"
    # The public launcher and the registered op take the scalars as runtime values: a second pair gives its result.
    out2 = torch.ops.nanogpt_kernels.ba_plus_cAA(A, 1.5, -0.25)
    exact2 = -0.25 * (A64 @ A64.mT) + 1.5 * A64
    assert_within(out2, exact2, dot_error_bound(0.25 * (A64.abs() @ A64.abs().mT) + 1.5 * A64.abs(), shape[-1] + 2),
                  "ba_plus_cAA second scalars")


def test_sym_launcher_rejects_bad_input():
    with pytest.raises(ValueError, match="square"):
        tk.ba_plus_cAA_triton(torch.randn(4, 6), 1.0, 1.0)
    with pytest.raises(ValueError, match="bfloat16"):
        tk.xxt_triton(torch.randn(4, 6, dtype=torch.float64))


# ------------------------------------------------------------------------------------------------------------------
# Section 3: relu^2 MLP
# ------------------------------------------------------------------------------------------------------------------

MLP_CASES = [  # (M, D, H, tiles=(BM, BN, BK, GROUP_M, warps, stages)); M and H not multiples of the tile,
    (37, 32, 80, (16, 32, 16, 2, 4, 2)),   # several tiles per program
    (64, 48, 64, (32, 32, 16, 1, 4, 2)),
    (21, 16, 40, (16, 16, 16, 3, 4, 2)),
]


@pytest.mark.parametrize("M, D, H, tiles", MLP_CASES)
def test_relu2_mlp_kernel_forward_and_backward_modes(M, D, H, tiles):
    g = torch.Generator().manual_seed(M * 1000 + H)
    x, c_fc, c_proj = (torch.randn(M, D, generator=g), torch.randn(H, D, generator=g) / D ** 0.5,
                       torch.randn(H, D, generator=g) / D ** 0.5)
    pre, post = tk.relu2_mlp_fwd_triton(x, c_fc, tiles=tiles)
    x64, w64 = x.double(), c_fc.double()
    assert_within(pre, x64 @ w64.T, dot_error_bound(x64.abs() @ w64.abs().T, D), "pre")
    # post is one fp32 rounding of relu(pre)^2, taken from the stored pre: exact equality.
    assert torch.equal(post, (pre.double().clamp_min(0) ** 2).float()), "post != round(relu(pre)^2)"

    grad = torch.randn(M, D, generator=g)
    dpre = tk.relu2_mlp_bwd_triton(grad, c_proj, pre, tiles=tiles)
    g64, p64 = grad.double(), c_proj.double()
    relu_pre = pre.double().clamp_min(0)
    exact = 2 * (g64 @ p64.T) * relu_pre
    bound = 2 * relu_pre * dot_error_bound(g64.abs() @ p64.abs().T, D) + 2 * U32 * exact.abs() + 1e-30
    assert_within(dpre, exact, bound, "dpre")
    assert (dpre[pre <= 0] == 0).all(), "dpre must vanish where pre <= 0"


@pytest.mark.parametrize("fp8", [False, True])
def test_relu2_mlp_autograd_matches_reference(fp8):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 19, 32, generator=g, requires_grad=True)  # (..., D): 38 rows
    c_fc = (torch.randn(96, 32, generator=g) / 6).requires_grad_()
    c_proj = (torch.randn(96, 32, generator=g) / 6).requires_grad_()
    out = tk.relu2_mlp_triton(x, c_fc, c_proj, fp8=fp8)
    ref = tk.relu2_mlp_reference(x.reshape(-1, 32), c_fc, c_proj, fp8=fp8).view(out.shape)
    grad_out = torch.randn(ref.shape, generator=g)
    grads = torch.autograd.grad(out, (x, c_fc, c_proj), grad_out)
    grads_ref = torch.autograd.grad(ref, (x, c_fc, c_proj), grad_out)
    # Both sides are fp32 with different summation orders; 1e-5 of the largest value is ~100 ulp of slack over
    # chains of two or three K<=96 dot products, while a wrong term would be off by O(1) of the scale.
    for name, a, b in [("out", out, ref), *zip(("dx", "dc_fc", "dc_proj"), grads, grads_ref)]:
        assert a.shape == b.shape, name
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5, name
    if fp8:   # the FP8 forward is another function than the bf16 one
        assert ((out - tk.relu2_mlp_triton(x, c_fc, c_proj)).abs().max() / out.abs().max()).item() > 1e-3


@pytest.mark.parametrize("M, D, H, tiles", MLP_CASES)
def test_relu2_mlp_kernel_fp8_forward(M, D, H, tiles):
    """e4m3 operands: every product exact, the fp32 sum within the dot bound, times q read from memory, rounded
    once; post from the stored pre."""
    g = torch.Generator().manual_seed(M * 1000 + H + 1)
    x = torch.randn(M, D, generator=g)
    c_fc = torch.randn(H, D, generator=g) / D ** 0.5
    w8, s = tk.quantize_mlp_weight(c_fc)
    x8, q = tk.quantize_mlp_input(x, s)
    pre, post = tk.relu2_mlp_fp8_fwd_triton(x8, w8, q.reshape(1), torch.float32, tiles=tiles)
    a64, b64 = x8.double(), w8.double()
    exact = (a64 @ b64.T) * q.item()
    bound = dot_error_bound(a64.abs() @ b64.abs().T, D) * q.item() + 2 * U32 * exact.abs()
    assert_within(pre, exact, bound, "fp8 pre")
    assert torch.equal(post, (pre.double().clamp_min(0) ** 2).float()), "post != round(relu(pre)^2)"
    # q is read: another factor scales pre
    pre2, _ = tk.relu2_mlp_fp8_fwd_triton(x8, w8, 2 * q.reshape(1), torch.float32, tiles=tiles)
    assert torch.equal(pre2, 2 * pre)


def test_relu2_mlp_launcher_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 16 \\(the kernel.s K-step\\)"):
        tk.relu2_mlp_fwd_triton(torch.randn(8, 24), torch.randn(16, 24), tiles=(16, 16, 16, 1, 4, 2))
    with pytest.raises(ValueError, match="cast both"):
        tk.relu2_mlp_fwd_triton(torch.randn(8, 32), torch.randn(16, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="16 bytes apart"):  # rows 33 floats apart: no TMA descriptor
        tk.relu2_mlp_fwd_triton(torch.randn(8, 33)[:, :32], torch.randn(16, 32), tiles=(16, 16, 16, 1, 4, 2))


# Post-only form, FP8 emission, FP8 down projection's kernels

@pytest.mark.parametrize("M, D, H, tiles", MLP_CASES)
def test_relu2_mlp_post_only_forward_and_sqrt_backward(M, D, H, tiles):
    """The post-only forward writes record 84's post exactly; the backward is 2 * (g @ c_proj.T) * sqrt(post) within
    the dot bound (the interpreter's square root is correctly rounded) and vanishes where post is 0."""
    g = torch.Generator().manual_seed(M * 1000 + H + 2)
    x, c_fc, c_proj = (torch.randn(M, D, generator=g), torch.randn(H, D, generator=g) / D ** 0.5,
                       torch.randn(H, D, generator=g) / D ** 0.5)
    _, post_old = tk.relu2_mlp_fwd_triton(x, c_fc, tiles=tiles)
    post = tk.relu2_mlp_post_fwd_triton(x, c_fc, tiles=tiles)
    assert torch.equal(post, post_old)
    grad = torch.randn(M, D, generator=g)
    dpre = tk.relu2_mlp_sqrt_bwd_triton(grad, c_proj, post, tiles=tiles)
    g64, p64 = grad.double(), c_proj.double()
    root = post.double().sqrt()
    exact = 2 * (g64 @ p64.T) * root
    bound = 2 * root * dot_error_bound(g64.abs() @ p64.abs().T, D) + 4 * U32 * exact.abs() + 1e-30
    assert_within(dpre, exact, bound, "sqrt dpre")
    assert (dpre[post == 0] == 0).all() and (post == 0).any()
    # it reads post, not pre: the record-84 backward given post where it expects pre is another function
    assert not torch.equal(dpre, tk.relu2_mlp_bwd_triton(grad, c_proj, post, tiles=tiles))


def grouped_program_tiles(M, N, tiles, n_programs):
    """(row block, column block) of every tile each persistent program walks, as _grouped_tile orders them."""
    bm, bn, _, group_m = tiles[:4]
    num_m, num_n = -(-M // bm), -(-N // bn)
    per_group = group_m * num_n
    out = [[] for _ in range(n_programs)]
    for tile in range(num_m * num_n):
        first = (tile // per_group) * group_m
        rows = min(num_m - first, group_m)
        out[tile % n_programs].append((first + (tile % per_group) % rows, (tile % per_group) // rows))
    return out


@pytest.mark.parametrize("M, D, H, tiles", MLP_CASES)
def test_relu2_mlp_fp8_forward_emits_post8_and_per_program_maxima(M, D, H, tiles):
    """With an activation scale a the FP8 forward writes the same post, post8 = e4m3(min(post * fp32(1 / a), 448))
    (some saturated, some e4m3-subnormal, zeros) and one maximum of post per program over exactly its tiles."""
    g = torch.Generator().manual_seed(M * 1000 + H + 3)
    x = torch.randn(M, D, generator=g)
    c_fc = torch.randn(H, D, generator=g) / D ** 0.5
    x8, w8, q = tk._fp8_up_operands(x, c_fc)
    _, post_old = tk.relu2_mlp_fp8_fwd_triton(x8, w8, q, torch.float32, tiles=tiles)
    post_only, none8, none_max = tk.relu2_mlp_fp8_post_fwd_triton(x8, w8, q, None, torch.float32, tiles)
    assert torch.equal(post_only, post_old) and none8 is None and none_max is None
    a = (post_old.max() * (1.8 / 448) / 3).reshape(1)           # a forward three times louder than the last
    post, post8, amax = tk.relu2_mlp_fp8_post_fwd_triton(x8, w8, q, a, torch.float32, tiles)
    assert torch.equal(post, post_old) and post8.dtype == torch.float32
    want = tk.quantize_post_reference(post, a).float()
    assert torch.equal(post8, want)
    assert (post8 == 448).any() and ((post8 > 0) & (post8 < 2 ** -6)).any() and (post8 == 0).any()
    n_programs = tk._num_programs_persistent(x.device)
    walks = grouped_program_tiles(M, H, tiles, n_programs)
    bm, bn = tiles[:2]
    expected = [max(post[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].max().item() for i, j in walk) for walk in walks]
    assert amax.shape == (n_programs,) and amax.tolist() == expected and len(set(expected)) > 1


@triton.jit
def _e4m3_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, tk._e4m3_rne(x), mask=offs < n)


def test_e4m3_rounding_from_fp32_is_nearest_even_and_saturating():
    """_e4m3_rne against torch's e4m3 cast (nearest even, subnormals of 2^-9) where the cast is defined (|x| <= 448)
    and saturation at +-448 beyond it (inf included); NaN stays NaN."""
    g = torch.Generator().manual_seed(1)
    ties = torch.tensor([1.0625, 1.1875, 2 ** -9 * 0.5, 2 ** -9 * 1.5, 2 ** -9 * 2.5, 416.0 + 16, 2 ** -6 * 0.99])
    rand = torch.exp2(torch.rand(50_000, generator=g, dtype=torch.float64) * 24 - 15).float()
    x = torch.cat([ties, rand, torch.tensor([0.0, 448.0, 464.0, 465.0, 1e30, float("inf")])])
    x = torch.cat([x, -x, torch.tensor([float("nan")])])
    out = torch.empty_like(x)
    _e4m3_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    same = (out == want) | (out.isnan() & x.isnan())
    assert same.all(), (x[~same][:6].tolist(), out[~same][:6].tolist(), want[~same][:6].tolist())
    assert out[:5].tolist() == [1.0, 1.25, 0.0, 2 ** -8, 2 ** -8] and out[5].item() == 448.0


def test_scale_reduction_is_the_floored_max_times_the_factor():
    g = torch.Generator().manual_seed(2)
    partial = torch.rand(11, 700, generator=g) * 10.0 ** torch.randint(-3, 3, (11, 1), generator=g)
    partial[4] = 0                                                # a layer that saw only zeros: the floor
    partial = partial[:, 3:603]                                   # rows apart by more than their length
    for factor in (tk.FP8_DOWN_ACT_FACTOR, tk.FP8_DOWN_WEIGHT_FACTOR):
        got = tk.fp8_scales_from_partial_amax_triton(partial, factor)
        want = [float(np.float32(max(row.max().item(), np.float32(1e-12))) * np.float32(factor))
                for row in partial.double()]
        assert got.dtype == torch.float32 and got.tolist() == want
        assert torch.equal(got, tk.fp8_scales_from_partial_amax_reference(partial, factor))


def test_down_weight_quantise_transpose_writes_every_entry_and_tile_maxima():
    """w8t[s, d, h] = e4m3(clamp(w2[s, h, d] / c[s], +-448)) for every entry (shapes that are not multiples of the
    64 x 64 tile), each tile's max |w2| in tile order, and the reference's scales from either's maxima."""
    g = torch.Generator().manual_seed(3)
    S, H, D = 3, 150, 70
    w2 = torch.randn(S, H, D, generator=g) * 0.02
    scales = tk.fp8_bootstrap_weight_scales(w2) * torch.tensor([1.0, 0.8, 1.2])   # slot 1 clips
    w8t, tile_amax = tk.quantize_down_weight_t_triton(w2, scales, torch.float32)
    ref8t, ref_amax = tk.quantize_down_weight_t_reference(w2, scales)
    assert w8t.shape == (S, D, H) and torch.equal(w8t, ref8t.float())
    assert (w8t[1].abs() == 448).sum() > 1 and (w8t[0].abs() == 448).sum() >= 1
    t = tk._FP8_QUANT_TILE
    n_d = -(-D // t)
    want = [[w2[s, (i // n_d) * t:(i // n_d + 1) * t, (i % n_d) * t:(i % n_d + 1) * t].abs().max().item()
             for i in range(-(-H // t) * n_d)] for s in range(S)]
    assert tile_amax.tolist() == want
    f = tk.FP8_DOWN_WEIGHT_FACTOR
    assert torch.equal(tk.fp8_scales_from_partial_amax_triton(tile_amax, f),
                       tk.fp8_scales_from_partial_amax_reference(ref_amax, f))


@pytest.mark.parametrize("fp8", [False, True])
def test_post_only_autograd_matches_its_reference(fp8):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 19, 32, generator=g, requires_grad=True)
    c_fc = (torch.randn(96, 32, generator=g) / 6).requires_grad_()
    c_proj = (torch.randn(96, 32, generator=g) / 6).requires_grad_()
    out = tk.relu2_mlp_post_triton(x, c_fc, c_proj, fp8=fp8)
    ref = tk.relu2_mlp_post_reference(x.reshape(-1, 32), c_fc, c_proj, fp8=fp8).view(out.shape)
    grad_out = torch.randn(ref.shape, generator=g)
    # fp32 on both sides in different summation orders (as test_relu2_mlp_autograd_matches_reference)
    for name, a, b in [("out", out, ref), *zip(("dx", "dc_fc", "dc_proj"),
                                                torch.autograd.grad(out, (x, c_fc, c_proj), grad_out),
                                                torch.autograd.grad(ref, (x, c_fc, c_proj), grad_out))]:
        assert a.shape == b.shape and ((a - b).abs().max() / b.abs().max()).item() < 1e-5, name


def test_fp8_down_autograd_matches_its_reference():
    """The training MLP of record 89 by the kernels (interpreter; the product on the reference off CUDA) against
    its reference: the output, the gradients, and the slice's next activation scale from the programs' maxima."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(40, 32, generator=g, requires_grad=True)
    c_fc = (torch.randn(96, 32, generator=g) / 6).requires_grad_()
    c_proj = (torch.randn(96, 32, generator=g) / 6).requires_grad_()
    w8t, c, _ = tk.fp8_down_weight_refresh(c_proj.detach()[None], torch.ones(1), bootstrap=True, fused=False)
    w8t = w8t.float()
    a = torch.tensor([0.004])
    out, amax = tk.relu2_mlp_fp8_down_triton(x, c_fc, c_proj, a, c, w8t[0])
    ref, ref_amax = tk.relu2_mlp_fp8_down_reference(x, c_fc, c_proj, a, c, w8t[0])
    f = tk.FP8_DOWN_ACT_FACTOR
    assert torch.equal(tk.fp8_scales_from_partial_amax_triton(amax[None], f),
                       tk.fp8_scales_from_partial_amax_reference(ref_amax[None], f))
    grad_out = torch.randn(ref.shape, generator=g)
    for name, u, v in [("out", out, ref), *zip(("dx", "dc_fc", "dc_proj"),
                                                torch.autograd.grad(out, (x, c_fc, c_proj), grad_out),
                                                torch.autograd.grad(ref, (x, c_fc, c_proj), grad_out))]:
        assert u.shape == v.shape and ((u - v).abs().max() / v.abs().max()).item() < 1e-5, name


def test_fp8_down_launchers_reject_bad_input():
    x8 = torch.zeros(8, 32).to(torch.float8_e4m3fn)
    w8 = torch.zeros(16, 32).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="act_scale must be a 1-element float32"):
        tk.relu2_mlp_fp8_post_fwd_triton(x8, w8, torch.ones(1), torch.ones(2), torch.float32)
    with pytest.raises(ValueError, match=r"scales must be \(2,\) float32"):
        tk.quantize_down_weight_t_triton(torch.zeros(2, 64, 64), torch.ones(3))
    with pytest.raises(ValueError, match="unit column stride"):
        tk.fp8_scales_from_partial_amax_triton(torch.ones(4, 3).mT, 1.0)


# ------------------------------------------------------------------------------------------------------------------
# Section 4: softcapped multi-token cross entropy
# ------------------------------------------------------------------------------------------------------------------

A_, B_, C_ = 23.0, 5.0, 7.5


def ce_float64(logits, targets, weights):
    """Record 61's eval loss in float64, written as loops: (losses, lse, z), fp32 sigma unrounded, zero weights
    skipped."""
    n, V = logits.shape
    z = A_ * torch.sigmoid((logits.double() + B_) / C_)
    lse = torch.logsumexp(z, dim=1)
    losses = torch.zeros(n, dtype=torch.float64)
    for i in range(n):
        for k, w in enumerate(weights.tolist()):
            if i + k < n and w > 0 and 0 <= int(targets[i + k]) < V:
                losses[i] += w * (lse[i] - z[i, int(targets[i + k])])
    return losses, lse, z


CE_CASES = [  # (n_rows, n_cols, weights): n_cols not multiples of 1024; zero weight; fewer rows than weights
    (7, 1500, [1.0]),
    (6, 2500, [1.0, 0.5]),
    (5, 1100, [1.0, 0.5, 0.25]),
    (4, 300, [1.0, 0.0, 0.3]),
    (2, 1030, [1.0, 0.5, 0.25]),
    (3, 2048, [1.0, 0.5]),  # whole blocks only: the forward's masked tail block is empty
]


@triton.jit
def _rcp_fma_kernel(d_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tk._rcp_fma(tl.load(d_ptr + offs, mask=offs < n)), mask=offs < n)


def rcp_fma_inputs() -> torch.Tensor:
    """Every 61st fp32 in [1, 4) (the error pattern repeats every binade), randoms up to 2^126, and the edges."""
    first, last = torch.tensor([1.0, 4.0]).view(torch.int32).tolist()
    dense = torch.arange(first, last, 61, dtype=torch.int32).view(torch.float32)
    g = torch.Generator().manual_seed(0)
    rand = torch.exp2(torch.rand(100_000, generator=g, dtype=torch.float64) * 126).float()
    top = torch.exp2(125 + torch.rand(10_000, generator=g, dtype=torch.float64)).float()  # the guess is subnormal
    edges = torch.tensor([1.0, 2.0, 3.0, 1.0 + 2 ** -23, 2.0 - 2 ** -23, 2.0 ** 126, 2.0 ** 126 * (1 - 2 ** -24)])
    return torch.cat([dense, rand, top, edges])


def test_rcp_fma_is_within_half_an_ulp_and_clamps_above_2_126():
    """The reciprocal on the FMA pipe: within 0.501 ulp of 1/d for d in [1, 2^125] (almost always the correctly
    rounded value), 0.6 ulp up to 2^126, 2^-126 above 2^126 (inf too), NaN for NaN."""
    d = rcp_fma_inputs()
    out = torch.empty_like(d)
    _rcp_fma_kernel[(triton.cdiv(d.numel(), 1024),)](d, out, d.numel(), BLOCK=1024)
    low, top = rcp_fma_ulp_errors(d, out)
    assert low <= 0.501 and top <= 0.6, (low, top)
    big = torch.tensor([2.0 ** 127, 3e38, float("inf"), float("nan")])
    out = torch.empty_like(big)
    _rcp_fma_kernel[(1,)](big, out, 4, BLOCK=4)
    assert out[:3].tolist() == [2.0 ** -126] * 3 and out[3].isnan()


@pytest.mark.parametrize("n, V, weights", CE_CASES)
def test_eval_ce_forward_is_record_61s(n, V, weights):
    """The eval contract (unrounded fp32 sigma, zero weights skipped) against float64."""
    g = torch.Generator().manual_seed(n * 10000 + V)
    logits = torch.randn(n, V, generator=g) * 8
    targets = torch.randint(0, V, (n,), generator=g)
    targets[0] = V - 1  # last column (in the final, partial block)
    w = torch.tensor(weights)
    losses, lse = tk.softcapped_mtp_ce_fwd_triton(logits, targets, w)
    losses64, lse64, _ = ce_float64(logits, targets, w)
    # fp32 exp/log over V <= 2500 terms of size <= e^23: relative error a few 1e-7; 1e-5 leaves slack while any
    # missing/extra term (>= 0.25 * O(1) nats) or a bf16-rounded sigma (~1e-3 per score) would fail.
    torch.testing.assert_close(lse.double(), lse64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses.double(), losses64, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(tk.softcapped_mtp_ce_triton(logits, targets, w), losses)   # the eval op


@pytest.mark.parametrize("n, V, weights", CE_CASES + [(9, 700, [1.0, 0.5, 0.25]), (5, 300, [1.0, -0.5, 0.25])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_train_forward_matches_the_transcription(n, V, weights, dtype):
    """Record 80's training loss: bf16 sigma of fma(l, 1/C, B/C), lse over A*s, loss with A*s_y and no w_k > 0 test
    (a negative weight counts), offsets past the buffer's end dropped. bf16 logits are read through their bits
    (exact here)."""
    g = torch.Generator().manual_seed(n * 1000 + V + 7)
    logits = tr.logits_clear_of_bf16_ties(n, V, g, 8.0, dtype)
    targets = torch.randint(0, V, (n,), generator=g)
    targets[0] = V - 1
    losses, lse = tk.softcapped_mtp_ce_train_fwd_triton(logits, targets, torch.tensor(weights))
    want = tr.ce_train(logits, targets, weights)
    torch.testing.assert_close(lse.double(), want["lse"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses.double(), want["losses"], rtol=1e-5, atol=1e-4)
    unrounded = tr.ce_train(logits, targets, weights, rounded=False)
    assert (lse.double() - unrounded["lse"]).abs().max() > 1e-4, "the case cannot tell the bf16 sigma from fp32's"


FP8_GRAD_CASES = [  # (n, V, weights, tiles): tail rows T-2, T-1 at K=3 and T-1 at K=2; partial row tiles and column
    (9, 1100, [1.0, 0.5, 0.25], None),                  # blocks at the interpreter's tiles; whole rows per program
    (6, 300, [1.0, 0.5], None),
    (4, 300, [1.0, 0.0, 0.3], (8, 64, None, 2)),
    (2, 520, [1.0, 0.5, 0.25], (8, 64, None, 2)),
    (5, 700, [1.0], None),
]


def _fp8_case(n, V, weights, seed):
    g = torch.Generator().manual_seed(seed)
    logits = tr.logits_clear_of_bf16_ties(n, V, g, 8.0, torch.bfloat16)
    targets = torch.randint(0, V, (n,), generator=g)
    if n > 3:
        targets[n - 2] = targets[n - 3]          # two offsets of one row on one column: T_c sums both
    return logits, targets, torch.tensor(weights)


@pytest.mark.parametrize("n, V, weights, tiles", FP8_GRAD_CASES)
def test_fp8_grad_is_the_transcribed_gradient_quantised_from_fp32(n, V, weights, tiles):
    """G8 = e5m2(g), g = (((grad_scale (1/C) A) (1/s_g)) delta) s (1 - s) in fp32, S_w over all K weights (tail
    rule), straight from fp32 (no bf16 step), in both layouts; fp32 output (the e5m2 values) and e5m2 output agree."""
    logits, targets, w = _fp8_case(n, V, weights, n * 31 + V)
    grad_scale = 0.25
    s_g = grad_scale * 0.75 / 448
    _, lse = tk.softcapped_mtp_ce_train_fwd_triton(logits, targets, w)
    q, q_t = tk.softcapped_mtp_ce_fp8_grad_triton(logits, targets, w, lse, grad_scale, s_g,
                                                  out_dtype=torch.float32, tiles=tiles)
    want = tr.ce_train(logits, targets, weights)
    g32 = tr.g_fp32(want, tr.fp8_grad_factor(grad_scale, s_g))
    tr.assert_e5m2_matches(q, g32, "G8")
    assert q_t.shape == (V, n) and q_t.is_contiguous() and torch.equal(q_t, q.t())
    q8, q8_t = tk.softcapped_mtp_ce_fp8_grad_triton(logits, targets, w, lse, grad_scale, s_g, tiles=tiles)
    assert q8.dtype == q8_t.dtype == torch.float8_e5m2
    assert torch.equal(q8.float(), q) and torch.equal(q8_t.float(), q_t)
    # the tail rule matters here: the in-range-only S_w of record 61 gives other values on the last K-1 rows
    if len(weights) > 1 and n >= len(weights):
        tail = want["delta"].clone()
        for r in range(n - len(weights) + 1, n):
            tail[r] -= sum(weights[n - r:]) * torch.exp(A_ * want["s"][r] - want["lse"][r])
        other = tr.round_e5m2(tr.g_fp32(dict(want, delta=tail), tr.fp8_grad_factor(grad_scale, s_g)))
        assert (other[n - len(weights) + 1:] != q[n - len(weights) + 1:].double()).any()


def test_fp8_grad_payload_does_not_depend_on_grad_scale():
    """s_g = grad_scale * 0.75/448 and the factor grad_scale (1/C A) (1/s_g): the e5m2 bits are the same for
    grad_scale = 1, 1/2, 1/4, 1/8 (the world size only moves s_g)."""
    logits, targets, w = _fp8_case(6, 900, [1.0, 0.5, 0.25], 77)
    _, lse = tk.softcapped_mtp_ce_train_fwd_triton(logits, targets, w)
    outs = [tk.softcapped_mtp_ce_fp8_grad_triton(logits, targets, w, lse, 1 / a, 0.75 / 448 / a)[0]
            for a in (1, 2, 4, 8)]
    assert all(torch.equal(o.view(torch.uint8), outs[0].view(torch.uint8)) for o in outs)
    assert (outs[0].float() != 0).float().mean() > 0.5


def test_fp8_grad_saturates_at_57344():
    """A tiny s_g (1e-7) pushes gradients past e5m2's largest: they saturate to +-57344 (never inf)."""
    logits, targets, w = _fp8_case(5, 400, [1.0, 0.5, 0.25], 5)
    _, lse = tk.softcapped_mtp_ce_train_fwd_triton(logits, targets, w)
    q, _ = tk.softcapped_mtp_ce_fp8_grad_triton(logits, targets, w, lse, 1.0, 1e-7, out_dtype=torch.float32)
    want = tr.ce_train(logits, targets, w.tolist())
    g32 = tr.g_fp32(want, tr.fp8_grad_factor(1.0, 1e-7))
    assert (g32.abs() > 61440).sum() > 10 and (g32.abs() < 57344).sum() > 10
    tr.assert_e5m2_matches(q, g32, "saturated G8")
    big = g32.abs() > 61440                               # past the rounding boundary to e5m2's infinity
    assert torch.equal(q[big].double(), 57344 * g32[big].sign())


@triton.jit
def _e5m2_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, tk._e5m2_rne(x), mask=offs < n)


def test_e5m2_rounding_from_fp32_is_nearest_even_and_saturating():
    """_e5m2_rne against the float64 transcription: ties to even in the normal and subnormal ranges, underflow to
    +-0, saturation at +-57344 (also for inf), NaN stays NaN; and fp32 values a bf16 step would round differently."""
    g = torch.Generator().manual_seed(0)
    ties = torch.tensor([1.125, 1.375, 1.625, 1.875, 2 ** -16 * 0.5, 2 ** -16 * 1.5, 2 ** -16 * 2.5, 2 ** -16 * 3.5])
    edges = torch.tensor([0.0, 2 ** -14, 2 ** -14 * 0.99, 57344.0, 57345.0, 61439.0, 61440.0, 1e30,
                          float("inf"), 2 ** -17, 2 ** -17 * 1.01, 2 ** -126, 1.1249999])
    # 1 + 2^-3 + 2^-9: bf16 rounds it to 1.125 (a tie that e5m2 rounds down), fp32 to e5m2 rounds up
    double_rounding = torch.tensor([1.0 + 2 ** -3 + 2 ** -9, 1.0 + 2 ** -3 + 2 ** -12])
    rand = torch.exp2(torch.rand(50_000, generator=g, dtype=torch.float64) * 40 - 24).float()
    x = torch.cat([ties, edges, double_rounding, rand])
    x = torch.cat([x, -x, torch.tensor([float("nan")])])
    out = torch.empty_like(x)
    _e5m2_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    want = tr.round_e5m2(x.double())
    same = (out.double() == want) | (out.isnan() & want.isnan())
    assert same.all(), (x[~same][:6].tolist(), out[~same][:6].tolist(), want[~same][:6].tolist())
    assert out[:4].tolist() == [1.0, 1.5, 1.5, 2.0]
    assert out[len(ties) + len(edges)].item() == 1.25


def test_train_backward_without_fp8_is_the_records_formula():
    """The plain training backward: dlogits = (((g_row (1/C) A) delta) s) (1 - s), the incoming gradient per row
    (strided, as the gradient of a sum arrives), tail rule on the last rows, repeated targets; fp32 output."""
    logits, targets, w = _fp8_case(8, 1100, [1.0, 0.5, 0.25], 12)
    logits = logits.float()
    losses, lse = tk.softcapped_mtp_ce_train_fwd_triton(logits, targets, w)
    grad_rows = torch.full((1,), 0.125).expand(8)
    d = tk.softcapped_mtp_ce_train_bwd_triton(grad_rows, logits, targets, w, lse)
    want = tr.ce_train(logits, targets, w.tolist())
    exact = (0.125 * tr.INV_C_A) * want["delta"] * want["s"] * (1 - want["s"])
    assert d.shape == (8, 1100) and d.dtype == torch.float32
    # fp32 products of the float64 quantities: a few ulps, except where S_w p and T_c cancel (the target column);
    # an absolute floor of 1e-6 of the largest gradient covers that.
    torch.testing.assert_close(d.double(), exact, rtol=1e-5, atol=1e-6 * exact.abs().max().item())
    (d_op,) = torch.autograd.grad(tk.softcapped_mtp_ce_train_triton(logits.requires_grad_(), targets, w), logits,
                                  grad_rows)
    assert torch.equal(d_op, d)


def test_train_kernels_and_reference_agree_on_bf16_logits():
    """tk.softcapped_mtp_ce_fp8_triton and its plain-PyTorch reference (what a CPU and --kernels=ce:torch run):
    the same losses and G8, the latter up to an e5m2 step next to rounding boundaries; the reference in row blocks
    gives its own numbers again."""
    logits, targets, w = _fp8_case(9, 700, [1.0, 0.5, 0.25], 21)
    losses, g8, g8_t = tk.softcapped_mtp_ce_fp8_triton(logits, targets, w, 0.5, 0.5 * 0.75 / 448)
    ref_losses, ref_g8, ref_g8_t = tk.softcapped_mtp_ce_fp8_reference(logits, targets, w, 0.5, 0.5 * 0.75 / 448)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-4)
    assert (g8.float() != ref_g8.float()).float().mean() < 1e-3
    assert torch.equal(g8_t.float(), g8.float().T) and torch.equal(ref_g8_t.float(), ref_g8.float().T)
    blocks = tk.softcapped_mtp_ce_fp8_reference(logits, targets, w, 0.5, 0.5 * 0.75 / 448, rows=4)
    assert torch.equal(blocks[0], ref_losses) and torch.equal(blocks[1].float(), ref_g8.float())


def _prefix_case(n, V, weights, seed, dtype=torch.bfloat16):
    """An FP8 case with prefix targets: none (-1) on some rows, one equal to the row's next target (T_c of that
    column has both weights), the others random."""
    logits, targets, w = _fp8_case(n, V, weights, seed)
    g = torch.Generator().manual_seed(seed + 1)
    prefix = torch.randint(0, V, (n,), generator=g)
    prefix[::3] = -1
    prefix[1] = targets[2]                     # the same column as row 1's k = 1 target
    prefix[n - 1] = targets[n - 1]             # the same column as the last row's own target
    return logits.to(dtype), targets, w, prefix


@pytest.mark.parametrize("n, V, weights", [(7, 1100, [1.0, 0.5, 0.25]), (5, 300, [1.0, 0.5]), (4, 520, [1.0])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_train_forward_with_the_prefix_term_matches_the_transcription(n, V, weights, dtype):
    """Record 88's prefix term: loss_r + [tau_r >= 0] w_p (lse - A s_tau), after the offsets' terms."""
    logits, targets, w, prefix = _prefix_case(n, V, weights, n * 7 + V, dtype)
    w_p = torch.tensor([0.25])
    losses, lse = tk.softcapped_mtp_ce_train_fwd_triton(logits, targets, w, prefix, w_p)
    want = tr.ce_train(logits, targets, weights, prefix=prefix, w_p=0.25)
    torch.testing.assert_close(lse.double(), want["lse"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses.double(), want["losses"], rtol=1e-5, atol=1e-4)
    plain, _ = tk.softcapped_mtp_ce_train_fwd_triton(logits, targets, w)
    has = prefix >= 0
    assert torch.equal(losses[~has], plain[~has]) and ((losses - plain)[has] > 1e-3).all()


@pytest.mark.parametrize("n, V, weights, tiles", [(9, 1100, [1.0, 0.5, 0.25], None), (6, 300, [1.0, 0.5], None),
                                                  (5, 520, [1.0, 0.5, 0.25], (8, 64, None, 2))])
def test_fp8_grad_with_the_prefix_term_is_the_transcribed_gradient(n, V, weights, tiles):
    """S_w starts with w_p on rows that have a prefix target, T_tau gains w_p (also where tau is a target column of
    the row's offsets), both layouts; the bf16 training backward gets the same delta."""
    logits, targets, w, prefix = _prefix_case(n, V, weights, n * 13 + V)
    w_p = torch.tensor([0.25])
    grad_scale, s_g = 0.5, 0.5 * 0.75 / 448
    _, lse = tk.softcapped_mtp_ce_train_fwd_triton(logits, targets, w, prefix, w_p)
    q, q_t = tk.softcapped_mtp_ce_fp8_grad_triton(logits, targets, w, lse, grad_scale, s_g, out_dtype=torch.float32,
                                                  tiles=tiles, prefix_targets=prefix, prefix_weight=w_p)
    want = tr.ce_train(logits, targets, weights, prefix=prefix, w_p=0.25)
    tr.assert_e5m2_matches(q, tr.g_fp32(want, tr.fp8_grad_factor(grad_scale, s_g)), "G8 with the prefix term")
    assert torch.equal(q_t, q.t())
    without = tr.ce_train(logits, targets, weights)
    moved = tr.round_e5m2(tr.g_fp32(without, tr.fp8_grad_factor(grad_scale, s_g))) != q.double()
    assert moved[prefix >= 0].any() and not moved[prefix < 0].any()
    grad_rows = torch.full((1,), 0.125).expand(n)
    d = tk.softcapped_mtp_ce_train_bwd_triton(grad_rows, logits.float(), targets, w, lse, prefix, w_p)
    exact = (0.125 * tr.INV_C_A) * want["delta"] * want["s"] * (1 - want["s"])
    torch.testing.assert_close(d.double(), exact, rtol=1e-5, atol=1e-6 * exact.abs().max().item())


def test_a_zero_prefix_weight_changes_no_bit():
    """From step 847 on w_p = 0: the prefix branch still runs, and the losses and G8 are the plain ones bit for
    bit."""
    logits, targets, w, prefix = _prefix_case(8, 900, [1.0, 0.5], 5)
    plain = tk.softcapped_mtp_ce_fp8_triton(logits, targets, w, 0.5, 0.5 * 0.75 / 448)
    zero = tk.softcapped_mtp_ce_fp8_triton(logits, targets, w, 0.5, 0.5 * 0.75 / 448, prefix, torch.zeros(1))
    assert torch.equal(zero[0], plain[0])
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(zero[1:], plain[1:]))


def test_the_prefix_term_kernels_and_reference_agree():
    """The FP8 op with the prefix term against its plain-PyTorch reference (whole and in row blocks), and the
    differentiable training loss against the reference's autograd."""
    logits, targets, w, prefix = _prefix_case(9, 700, [1.0, 0.5, 0.25], 31)
    w_p = torch.tensor([0.25])
    args = (logits, targets, w, 0.5, 0.5 * 0.75 / 448)
    losses, g8, _ = tk.softcapped_mtp_ce_fp8_triton(*args, prefix, w_p)
    ref_losses, ref_g8, _ = tk.softcapped_mtp_ce_fp8_reference(*args, prefix_targets=prefix, prefix_weight=w_p)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-4)
    assert (g8.float() != ref_g8.float()).float().mean() < 1e-3
    blocks = tk.softcapped_mtp_ce_fp8_reference(*args, rows=4, prefix_targets=prefix, prefix_weight=w_p)
    assert torch.equal(blocks[0], ref_losses) and torch.equal(blocks[1].float(), ref_g8.float())
    x = logits.clone().requires_grad_()           # bf16: both round sigma to bf16
    grad_rows = torch.rand(9, generator=torch.Generator().manual_seed(2))
    (d,) = torch.autograd.grad(tk.softcapped_mtp_ce_train_triton(x, targets, w, prefix, w_p), x, grad_rows)
    (d_ref,) = torch.autograd.grad(tk.softcapped_mtp_ce_train_reference(x, targets, w, None, prefix, w_p), x,
                                   grad_rows)
    # both round an fp32 gradient to bf16; fp32 op-order differences may flip a rounding: at most one bf16 ulp
    torch.testing.assert_close(d.float(), d_ref.float(), rtol=2 ** -7, atol=1e-6)
    plain = tk.softcapped_mtp_ce_train_reference(x, targets, w)
    (d_plain,) = torch.autograd.grad(plain, x, grad_rows)
    assert (d_plain.float() - d_ref.float()).abs().max() > 1e-2


def test_ce_kernels_skip_out_of_range_targets():
    n, V = 6, 700
    g = torch.Generator().manual_seed(3)
    logits = tr.logits_clear_of_bf16_ties(n, V, g, 5.0)
    targets = torch.randint(0, V, (n,), generator=g)
    targets[2] = -100  # an ignore-style id: the forwards skip it, the gradient finds no column for it
    targets[3] = V  # one past the last column: skipped the same way
    w = torch.tensor([1.0, 0.5, 0.25])
    losses, _ = tk.softcapped_mtp_ce_fwd_triton(logits, targets, w)
    torch.testing.assert_close(losses.double(), ce_float64(logits, targets, w)[0], rtol=1e-5, atol=1e-4)
    losses, lse = tk.softcapped_mtp_ce_train_fwd_triton(logits, targets, w)
    want = tr.ce_train(logits, targets, w.tolist())
    torch.testing.assert_close(losses.double(), want["losses"], rtol=1e-5, atol=1e-4)
    q, _ = tk.softcapped_mtp_ce_fp8_grad_triton(logits, targets, w, lse, 1.0, 0.75 / 448, out_dtype=torch.float32)
    tr.assert_e5m2_matches(q, tr.g_fp32(want, tr.fp8_grad_factor(1.0, 0.75 / 448)), "G8")


def test_fp8_head_training_op_matches_the_cpu_path():
    """train_gpt's training op with both fused halves (the FP8 custom ops around the loss's kernels) against the CPU
    path of the same math (emulated head, reference loss). The logits differ by the accumulation order of the two
    heads, so tolerances are the FP8 operands'; a wrong layout, scale or transpose gives errors of order 1."""
    import train_gpt as tg
    tg.register_fp8_head_op()
    scales = (100 / 448, 1.6 / 448, 0.75 / 448)
    g = torch.Generator().manual_seed(8)
    h = tg.rms(torch.randn(24, 64, generator=g)).bfloat16().requires_grad_(True)
    w = (0.3 * torch.randn(64, 96, generator=g)).bfloat16().requires_grad_(True)
    targets = torch.randint(0, 96, (24,), generator=g)
    mtp = torch.tensor([1.0, 0.5, 0.25])
    fused = tg.fp8_head_mtp_ce(h, w, targets, mtp, 0.5, *scales, fused_head=True, fused_ce=True, rows=None)
    dh, dw = torch.autograd.grad(fused.sum() * 0.5, (h, w))
    ref = tg.fp8_head_mtp_ce(h, w, targets, mtp, 0.5, *scales, fused_head=False, fused_ce=False, rows=0)
    ref_dh, ref_dw = torch.autograd.grad(ref.sum() * 0.5, (h, w))
    torch.testing.assert_close(fused, ref, rtol=1e-3, atol=1e-3)
    for got, want in ((dh, ref_dh), (dw, ref_dw)):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()


def test_ce_launcher_rejects_bad_input():
    logits = torch.randn(4, 64)
    with pytest.raises(ValueError, match="int64"):
        tk.softcapped_mtp_ce_fwd_triton(logits, torch.zeros(4, dtype=torch.int32), torch.ones(1))
    with pytest.raises(ValueError, match="fp32"):
        tk.softcapped_mtp_ce_train_fwd_triton(logits, torch.zeros(4, dtype=torch.int64),
                                              torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        tk.softcapped_mtp_ce_fwd_triton(torch.randn(64, 4).T, torch.zeros(4, dtype=torch.int64), torch.ones(1))


# ------------------------------------------------------------------------------------------------------------------
# Section 7: varlen causal sliding-window attention
# ------------------------------------------------------------------------------------------------------------------

def attention_float64(q, k, v, doc_lens, window, scale):
    """Per document and head, from explicit index comparisons: out and the base-2 log-sum-exp, float64, with
    autograd (q, k, v may require grad)."""
    outs, lses, start = [], [], 0
    for n in doc_lens:
        if n == 0:
            continue
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = (j <= i) & (i - j <= window)
        qd, kd, vd = (x[start:start + n].double().transpose(0, 1) for x in (q, k, v))   # (H, n, D)
        logits = (scale * qd @ kd.mT).masked_fill(~allowed, float("-inf"))
        outs.append((torch.softmax(logits, -1) @ vd).transpose(0, 1))
        lses.append(torch.logsumexp(logits, -1) / torch.log(torch.tensor(2.0, dtype=torch.float64)))
        start += n
    return torch.cat(outs), torch.cat(lses, dim=1)


# (document lengths, window, tiles=(BM, BN, warps, stages), q/k/v as views of one qkv buffer, scale): documents
# shorter than a block and longer than the window, an empty document (repeated boundary), a window larger than every
# document, window 0 (each query sees itself only), and the paired layout's doubled positions (even lengths, 2x
# window). At scale 0.3 the logits have a std of ~1.7 (base 2); at 1.5, ~9, so the forward's running max keeps
# growing by large steps and its rescaling of the partial sums matters.
ATTN_CASES = [
    ([1, 70, 1, 1, 30, 50, 7], 5, (16, 32, 4, 1), False, 0.3),
    ([100, 0, 60], 1000, (32, 16, 4, 1), True, 0.3),
    ([3, 80, 77], 0, (16, 16, 4, 1), False, 0.3),
    ([40, 1, 120, 39], 37, (16, 32, 4, 1), True, 0.3),
    ([2 * n for n in (9, 40, 1, 30)], 2 * 13, (32, 32, 4, 1), False, 0.3),
    ([100, 0, 60], 1000, (32, 16, 4, 1), False, 1.5),
]


@pytest.mark.parametrize("lens, window, tiles, strided, scale", ATTN_CASES)
def test_varlen_attention_matches_float64(lens, window, tiles, strided, scale):
    g = torch.Generator().manual_seed(sum(lens) + window)
    T, H, D = sum(lens), 2, 16
    cu = torch.tensor([0] + lens + [0, 0]).cumsum(0).to(torch.int32)           # two trailing empty documents
    if strided:   # the model's layout: views into a (T, 3, H, D) projection, row stride 3HD
        q, k, v = torch.randn(T, 3, H, D, generator=g).unbind(1)
    else:
        q, k, v = (torch.randn(T, H, D, generator=g) for _ in range(3))
    grad = torch.randn(T, H, D, generator=g)
    out, lse = tk.varlen_attention_fwd_triton(q, k, v, cu, window, scale, tiles=tiles)
    out_in, grad_in = out, grad
    if strided:   # the backward reads out and grad through their own strides
        out_in, grad_in = torch.zeros(T, 2, H, D), torch.zeros(T, 3, H, D)
        out_in[:, 1], grad_in[:, 2] = out, grad
        out_in, grad_in = out_in[:, 1], grad_in[:, 2]
    dq, dk, dv = tk.varlen_attention_bwd_triton(grad_in, q, k, v, out_in, lse, cu, window, scale, tiles=tiles)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ref, ref_lse = attention_float64(q64, k64, v64, lens, window, scale)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    # fp32 kernels vs float64: the errors are a few fp32 roundings per term (measured ~1e-7 of the norms below at
    # scale 0.3; 7-8e-7 at 1.5, where the sharper softmax cancels more in dP - delta); one key too many or too few
    # per query moves a tensor by O(1e-2) or more. Gradients are compared against the incoming gradient's norm where
    # that is larger, since dq and dk vanish at window 0 (each query attends to itself only), and against their own
    # where they are larger (dq and dk grow with the scale).
    tol = 1e-6 if scale < 1 else 1e-5
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert ((lse.double() - ref_lse).abs() <= 1e-6 * (1 + ref_lse.abs())).all(), "lse"   # a few fp32 roundings
    for name, got, want, norm in [("out", out, ref, ref.norm()),
                                  *((n, x, w, torch.maximum(w.norm(), grad.norm()))
                                    for n, x, w in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads))]:
        assert got.shape == want.shape and got.dtype == torch.float32, name
        rel = ((got.double() - want).norm() / norm).item()
        assert rel < tol, f"{name}: relative error {rel:.2e}"


def test_varlen_attention_autograd_op_is_the_launchers():
    g = torch.Generator().manual_seed(3)
    lens, window, scale = [20, 45, 3, 60], 24, 0.2
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(sum(lens), 2, 16, generator=g).requires_grad_() for _ in range(3))
    grad = torch.randn(sum(lens), 2, 16, generator=g)
    out = tk.varlen_attention_triton(q, k, v, cu, window, scale)     # torch.ops.nanogpt_kernels, default tiles
    grads = torch.autograd.grad(out, (q, k, v), grad)
    out2, lse = tk.varlen_attention_fwd_triton(q.detach(), k.detach(), v.detach(), cu, window, scale)
    grads2 = tk.varlen_attention_bwd_triton(grad, q.detach(), k.detach(), v.detach(), out2, lse, cu, window, scale)
    assert torch.equal(out, out2)
    for a, b in zip(grads, grads2):
        assert torch.equal(a, b)


def test_varlen_attention_launcher_rejects_bad_input():
    q = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    for args, match in [((q.double(), q.double(), q.double(), cu, 4), "bfloat16"),
                        ((q, q, q[:9], cu, 4), "one shape"),
                        ((q, q, torch.randn(10, 2, 32)[..., ::2], cu, 4), "unit stride"),
                        ((q, q, q, cu.long(), 4), "int32"),
                        ((q, q, q, cu, -1), "window"),
                        ((torch.randn(10, 2, 24),) * 3 + (cu, 4), "power of two")]:
        with pytest.raises(ValueError, match=match):
            tk.varlen_attention_fwd_triton(*args, 0.1)
