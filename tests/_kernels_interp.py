"""Interpreter checks of triton_kernels.py (run by tests/test_kernels.py in a subprocess with TRITON_INTERPRET=1).

The interpreter's bf16 arithmetic is not faithful, so every kernel runs in its float32 test mode, where a bf16
rounding point becomes a no-op and the kernels must agree with float64 formulas to float32 accuracy.

Tolerances: an fp32 dot product of K terms, accumulated in any order, is within gamma_K * sum_i |x_i y_i| of the exact
value, gamma_K = K*u/(1-K*u) with u = 2^-24 (Higham, Accuracy and Stability, §3.1). The checks below use that bound
elementwise with a factor 2 of slack (plus one rounding of the result), so a wrong tile, mask or epilogue (errors of
order |x||y|) fails while any legal summation order passes.
"""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/test_kernels.py, which sets TRITON_INTERPRET=1", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import triton_kernels as tk  # noqa: E402
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


def test_relu2_mlp_autograd_matches_reference():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 19, 32, generator=g, requires_grad=True)  # (..., D): 38 rows
    c_fc = (torch.randn(96, 32, generator=g) / 6).requires_grad_()
    c_proj = (torch.randn(96, 32, generator=g) / 6).requires_grad_()
    out = tk.relu2_mlp_triton(x, c_fc, c_proj)
    ref = tk.relu2_mlp_reference(x, c_fc, c_proj)
    grad_out = torch.randn(ref.shape, generator=g)
    grads = torch.autograd.grad(out, (x, c_fc, c_proj), grad_out)
    grads_ref = torch.autograd.grad(ref, (x, c_fc, c_proj), grad_out)
    # Both sides are fp32 with different summation orders; 1e-5 of the largest value is ~100 ulp of slack over
    # chains of two or three K<=96 dot products, while a wrong term would be off by O(1) of the scale.
    for name, a, b in [("out", out, ref), *zip(("dx", "dc_fc", "dc_proj"), grads, grads_ref)]:
        assert a.shape == b.shape, name
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5, name


def test_relu2_mlp_launcher_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 16 \\(the kernel.s K-step\\)"):
        tk.relu2_mlp_fwd_triton(torch.randn(8, 24), torch.randn(16, 24), tiles=(16, 16, 16, 1, 4, 2))
    with pytest.raises(ValueError, match="cast both"):
        tk.relu2_mlp_fwd_triton(torch.randn(8, 32), torch.randn(16, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="16 bytes apart"):  # rows 33 floats apart: no TMA descriptor
        tk.relu2_mlp_fwd_triton(torch.randn(8, 33)[:, :32], torch.randn(16, 32), tiles=(16, 16, 16, 1, 4, 2))


# ------------------------------------------------------------------------------------------------------------------
# Section 4: softcapped multi-token cross entropy
# ------------------------------------------------------------------------------------------------------------------

A_, B_, C_ = 23.0, 5.0, 7.5


def ce_float64(logits, targets, weights):
    """The softcapped MTP cross entropy in float64, written as loops: (losses, lse, dz-free parts) for checking both
    kernels."""
    n, V = logits.shape
    z = A_ * torch.sigmoid((logits.double() + B_) / C_)
    lse = torch.logsumexp(z, dim=1)
    losses = torch.zeros(n, dtype=torch.float64)
    for i in range(n):
        for k, w in enumerate(weights.tolist()):
            if i + k < n and w > 0 and 0 <= int(targets[i + k]) < V:
                losses[i] += w * (lse[i] - z[i, int(targets[i + k])])
    return losses, lse, z


def ce_grad_float64(grad_rows, logits, targets, weights):
    n, V = logits.shape
    _, lse, z = ce_float64(logits, targets, weights)
    sig = z / A_
    p = torch.exp(z - lse[:, None])
    dlogits = torch.zeros(n, V, dtype=torch.float64)
    for i in range(n):
        s_w, t = 0.0, torch.zeros(V, dtype=torch.float64)
        for k, w in enumerate(weights.tolist()):
            if i + k < n:
                s_w += w
                if 0 <= int(targets[i + k]) < V:
                    t[int(targets[i + k])] += w
        dz = float(grad_rows[i]) * (s_w * p[i] - t)
        dlogits[i] = dz * z[i] * (1 - sig[i]) / C_
    return dlogits


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
def test_softcapped_mtp_ce_forward_and_backward(n, V, weights):
    g = torch.Generator().manual_seed(n * 10000 + V)
    logits = torch.randn(n, V, generator=g) * 8
    targets = torch.randint(0, V, (n,), generator=g)
    targets[0] = V - 1  # last column (in the final, partial block)
    w = torch.tensor(weights)
    losses, lse = tk.softcapped_mtp_ce_fwd_triton(logits, targets, w)
    losses64, lse64, _ = ce_float64(logits, targets, w)
    # fp32 exp/log over V <= 2500 terms of size <= e^23: relative error a few 1e-7; 1e-5 leaves slack for the
    # online rescaling while any missing/extra term (>= 0.25 * O(1) nats) would fail.
    torch.testing.assert_close(lse.double(), lse64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses.double(), losses64, rtol=1e-5, atol=1e-4)

    grad_rows = torch.rand(n, generator=g) + 0.5
    dlogits = tk.softcapped_mtp_ce_bwd_triton(grad_rows, logits, targets, w, lse)
    exact = ce_grad_float64(grad_rows, logits, targets, w)
    assert dlogits.shape == (n, V) and dlogits.dtype == logits.dtype
    # Per-element fp32 error is relative (~1e-6) except where S_w*p and T_c cancel (the target column); an absolute
    # floor of 1e-6 of the largest gradient covers that.
    torch.testing.assert_close(dlogits.double(), exact, rtol=1e-4, atol=1e-6 * exact.abs().max().item())


def test_softcapped_mtp_ce_backward_sums_the_weights_of_repeated_targets():
    """The backward's second kernel writes the target columns: a column that is the target of several offsets of one
    row gets all their weights (rows 1-3 share one target, so row 1 has it at offsets 0, 1 and 2), and a target in
    the last, partial block of columns is written too."""
    n, V = 8, 1500
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(n, V, generator=g) * 8
    targets = torch.randint(0, V, (n,), generator=g)
    targets[1:4] = 17
    targets[5] = V - 2
    w = torch.tensor([1.0, 0.5, 0.25])
    _, lse = tk.softcapped_mtp_ce_fwd_triton(logits, targets, w)
    grad_rows = torch.rand(n, generator=g) + 0.5
    dlogits = tk.softcapped_mtp_ce_bwd_triton(grad_rows, logits, targets, w, lse)
    exact = ce_grad_float64(grad_rows, logits, targets, w)
    torch.testing.assert_close(dlogits.double(), exact, rtol=1e-4, atol=1e-6 * exact.abs().max().item())
    tw = lambda row: sum(  # the weight at column 17: the case is the one described
        wk for k, wk in enumerate(w.tolist()) if row + k < n and targets[row + k] == 17)
    assert tw(1) == 1.75 and tw(3) == 1.0


def test_softcapped_mtp_ce_skips_out_of_range_targets_and_takes_strided_grad():
    n, V = 6, 700
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(n, V, generator=g) * 5
    targets = torch.randint(0, V, (n,), generator=g)
    targets[2] = -100  # an ignore-style id: forward skips it, backward finds no column for it
    targets[3] = V  # one past the last column: skipped the same way
    w = torch.tensor([1.0, 0.5, 0.25])
    losses, lse = tk.softcapped_mtp_ce_fwd_triton(logits, targets, w)
    torch.testing.assert_close(losses.double(), ce_float64(logits, targets, w)[0], rtol=1e-5, atol=1e-4)
    grad_rows = torch.full((1,), 0.125).expand(n)  # stride 0, like the gradient of a sum scaled by 1/A
    dlogits = tk.softcapped_mtp_ce_bwd_triton(grad_rows, logits, targets, w, lse)
    exact = ce_grad_float64(grad_rows, logits, targets, w)
    torch.testing.assert_close(dlogits.double(), exact, rtol=1e-4, atol=1e-6 * exact.abs().max().item())


def test_softcapped_mtp_ce_autograd_matches_reference():
    n, V = 6, 1200
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(n, V, generator=g) * 6).requires_grad_()
    targets = torch.randint(0, V, (n,), generator=g)
    w = torch.tensor([1.0, 0.5, 0.125])
    losses = tk.softcapped_mtp_ce_triton(logits, targets, w)
    ref = tk.softcapped_mtp_ce_reference(logits, targets, w)
    torch.testing.assert_close(losses, ref, rtol=1e-5, atol=1e-4)
    grad_rows = torch.rand(n, generator=g)
    (d,) = torch.autograd.grad(losses, logits, grad_rows)
    (d_ref,) = torch.autograd.grad(ref, logits, grad_rows)
    torch.testing.assert_close(d, d_ref, rtol=1e-4, atol=1e-6 * d_ref.abs().max().item())


@pytest.mark.parametrize("n, V, weights", [(9, 1100, [1.0, 0.5, 0.25]), (4, 300, [1.0, 0.0, 0.3]), (2, 520, [1.0])])
def test_ce_backward_fp8_epilogue_is_the_bf16_gradient_scaled_and_clamped(n, V, weights):
    """The QUANTIZE epilogue (final FP8 cast skipped: out_dtype=float32) is bitwise clamp(bf16(dlogits) * fp32(1/s))
    of the plain backward's bf16 output, from bf16 logits (read and rounded through their bits, so
    exact here). The scale is tiny enough that some gradients saturate at +-57344."""
    g = torch.Generator().manual_seed(n * 7 + V)
    logits = (torch.randn(n, V, generator=g) * 8).bfloat16()
    targets = torch.randint(0, V, (n,), generator=g)
    w = torch.tensor(weights)
    _, lse = tk.softcapped_mtp_ce_fwd_triton(logits, targets, w)
    grad_rows = torch.rand(n, generator=g) + 0.5
    d = tk.softcapped_mtp_ce_bwd_triton(grad_rows, logits, targets, w, lse)
    assert d.dtype == torch.bfloat16
    exact = ce_grad_float64(grad_rows, logits, targets, w)
    torch.testing.assert_close(d.double(), exact, rtol=1e-2, atol=1e-6 * exact.abs().max().item())
    scale = 2e-6
    want = (d.float() * torch.tensor(1 / scale)).clamp(-57344.0, 57344.0)
    assert (want.abs() == 57344.0).any() and (want.abs() < 57344.0).any()
    # the interpreter's tiles (partial row tiles, column ranges and column blocks at these sizes), then whole rows
    # per program in 64-column blocks
    for tiles in (None, (8, 64, None, 2)):
        q, q_t = tk.softcapped_mtp_ce_bwd_fp8_triton(grad_rows, logits, targets, w, lse, scale,
                                                     out_dtype=torch.float32, tiles=tiles)
        assert torch.equal(q, want)
        assert q_t.shape == (V, n) and q_t.is_contiguous() and torch.equal(q_t, want.t())


def test_fp8_head_mtp_ce_matches_the_emulated_head_and_plain_loss():
    """train_gpt.FP8HeadMTPCE (the CUDA path: FP8 ops around the CE kernels, the gradient quantised inside the
    backward kernel) against the CPU path of the same math (emulated FP8 head, then the chunked loss). Tolerances are
    the FP8 operands' (the interpreter's e5m2 cast also mis-rounds e5m2 subnormals, a few tiny gradients); a wrong
    layout, scale or transpose gives errors of order 1."""
    import train_gpt as tg
    tg.register_fp8_head_op()
    scales = (100 / 448, 1.6 / 448, 0.75 / 448)
    g = torch.Generator().manual_seed(8)
    h = tg.rms(torch.randn(24, 64, generator=g)).bfloat16().requires_grad_(True)
    w = (0.05 * torch.randn(64, 96, generator=g)).bfloat16().requires_grad_(True)
    targets = torch.randint(0, 96, (24,), generator=g)
    mtp = torch.tensor([1.0, 0.5, 0.25])
    losses = tg.FP8HeadMTPCE.apply(h, w, targets, mtp, *scales)
    dh, dw = torch.autograd.grad(losses.sum() / 2, (h, w))
    ref = tk.softcapped_mtp_ce_chunked(tg.FP8HeadEmulated.apply(h, w, *scales), targets, mtp)
    ref_dh, ref_dw = torch.autograd.grad(ref.sum() / 2, (h, w))
    torch.testing.assert_close(losses, ref, rtol=1e-3, atol=1e-3)
    for got, want in ((dh, ref_dh), (dw, ref_dw)):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()


def test_ce_launcher_rejects_bad_input():
    logits = torch.randn(4, 64)
    with pytest.raises(ValueError, match="int64"):
        tk.softcapped_mtp_ce_fwd_triton(logits, torch.zeros(4, dtype=torch.int32), torch.ones(1))
    with pytest.raises(ValueError, match="fp32"):
        tk.softcapped_mtp_ce_fwd_triton(logits, torch.zeros(4, dtype=torch.int64), torch.ones(1, dtype=torch.float64))
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
