"""CPU tests of triton_kernels.py: the kernels under Triton's interpreter (in a subprocess), the references against
float64 formulas written from the math, and an sm_90 compile of every kernel (no fp64 anywhere, shared memory that
fits an H100)."""
import inspect
import os
import subprocess
import sys

import pytest
import torch

import triton_kernels as tk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
A_, B_, C_ = 23.0, 5.0, 7.5


def test_kernels_under_triton_interpreter():
    """Runs tests/_kernels_interp.py with TRITON_INTERPRET=1 (chosen at import, so it needs its own process)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join("tests", "_kernels_interp.py")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"interpreter tests failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


# ------------------------------------------------------------------------------------------------------------------
# References against float64 formulas
# ------------------------------------------------------------------------------------------------------------------

def test_sym_references_match_float64():
    A = torch.randn(3, 12, 20, dtype=torch.bfloat16)
    A64 = A.double()
    torch.testing.assert_close(tk.xxt_reference(A).double(), (A64 @ A64.mT).bfloat16().double(), rtol=1e-2, atol=1e-2)
    S = tk.xxt_reference(A[:, :, :12] / 4)
    S64 = S.double()
    out = tk.ba_plus_cAA_reference(S, -2.5, 1.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), (1.25 * S64 @ S64 - 2.5 * S64).bfloat16().double(), rtol=1e-2, atol=1e-2)


def test_relu2_mlp_reference_rounding_points_and_backward():
    """Forward: pre and post rounded to bf16; backward: the closed forms of the ReLU^2 MLP's gradient."""
    g = torch.Generator().manual_seed(0)
    M, D, H = 24, 16, 40
    x = torch.randn(M, D, generator=g).bfloat16().requires_grad_()
    c_fc = (torch.randn(H, D, generator=g) / 4).bfloat16().requires_grad_()
    c_proj = (torch.randn(H, D, generator=g) / 4).bfloat16().requires_grad_()
    out = tk.relu2_mlp_reference(x, c_fc, c_proj)
    pre = (x.double() @ c_fc.double().T).bfloat16()
    post = (pre.double().clamp_min(0) ** 2).bfloat16()
    # bf16 output of a fp32-accumulated matmul of exactly the float64 post: one bf16 rounding (2^-8 relative) plus
    # rare one-ulp flips of pre; 2e-2 of the largest output separates them from a missing square or relu.
    exact = post.double() @ c_proj.double()
    assert ((out.double() - exact).abs().max() / exact.abs().max()).item() < 2e-2
    grad = torch.randn(M, D, generator=g).bfloat16()
    dx, dc_fc, dc_proj = torch.autograd.grad(out, (x, c_fc, c_proj), grad)
    dpost = (grad.double() @ c_proj.double().T).bfloat16()
    dpre = (2 * dpost.double() * pre.double().clamp_min(0)).bfloat16().double()
    for name, got, want in [("dc_proj", dc_proj, post.double().T @ grad.double()),
                            ("dc_fc", dc_fc, dpre.T @ x.double()), ("dx", dx, dpre @ c_fc.double())]:
        assert got.dtype == torch.bfloat16, name
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 2e-2, name


def ce_loop_float64(logits, targets, weights):
    n, V = logits.shape
    losses = []
    for i in range(n):
        z = [A_ / (1 + torch.exp(torch.tensor(-(float(logits[i, c]) + B_) / C_, dtype=torch.float64)).item())
             for c in range(V)]
        lse = torch.logsumexp(torch.tensor(z, dtype=torch.float64), 0).item()
        loss = 0.0
        for k, w in enumerate(weights):
            if i + k < n and w > 0:
                loss += w * (lse - z[int(targets[i + k])])
        losses.append(loss)
    return torch.tensor(losses, dtype=torch.float64)


@pytest.mark.parametrize("weights", [[1.0], [1.0, 0.5], [1.0, 0.5, 0.25], [1.0, 0.0, 0.5]])
def test_ce_reference_matches_double_loop(weights):
    """MTP terms past the buffer end are dropped (not renormalised); zero weights contribute nothing."""
    g = torch.Generator().manual_seed(len(weights))
    n, V = 5, 11
    logits = (torch.randn(n, V, generator=g) * 6).bfloat16()
    targets = torch.randint(0, V, (n,), generator=g)
    got = tk.softcapped_mtp_ce_reference(logits, targets, torch.tensor(weights))
    assert got.dtype == torch.float32 and got.shape == (n,)
    # fp32 math on 11 columns: ~1e-6 relative; 1e-5 is tight enough to catch any extra or missing term.
    torch.testing.assert_close(got.double(), ce_loop_float64(logits, targets, weights), rtol=1e-5, atol=1e-5)


def test_ce_reference_with_fewer_rows_than_weights():
    logits = torch.randn(2, 7).bfloat16()
    targets = torch.tensor([3, 5])
    got = tk.softcapped_mtp_ce_reference(logits, targets, torch.tensor([1.0, 0.5, 0.25]))
    torch.testing.assert_close(got.double(), ce_loop_float64(logits, targets, [1.0, 0.5, 0.25]), rtol=1e-5, atol=1e-5)


def train_grad_float64(logits, targets, weights, grad_rows):
    """The record's gradient of sum_r g_r loss_r in float64, written out with loops: S_w over all K weights (tail
    rule), T_c over the in-range offsets, sigma unrounded (float64 logits)."""
    n, V = logits.shape
    sig = torch.sigmoid(logits.double() / C_ + B_ / C_)
    z = A_ * sig
    p = torch.softmax(z, dim=1)
    want = torch.zeros(n, V, dtype=torch.float64)
    for i in range(n):
        t = torch.zeros(V, dtype=torch.float64)
        for k, w in enumerate(weights):
            if i + k < n:
                t[targets[i + k]] += w
        want[i] = float(grad_rows[i]) * (A_ / C_) * (sum(weights) * p[i] - t) * sig[i] * (1 - sig[i])
    return want


@pytest.mark.parametrize("weights", [[1.0, 0.5, 0.25], [1.0, 0.5], [1.0]])
def test_train_reference_gradient_is_the_records_formula_in_float64(weights):
    """The training loss without the FP8 head (use_fp8=False; --dtype=float64 on a CPU): its backward is the record's
    formula with the tail rule, not autograd's derivative of the loss (they differ on the last K-1 rows), and the
    incoming gradient passes through per row. In row blocks too."""
    g = torch.Generator().manual_seed(len(weights))
    n, V = 7, 13
    logits = (torch.randn(n, V, generator=g, dtype=torch.float64) * 6).requires_grad_()
    targets = torch.randint(0, V, (n,), generator=g)
    targets[4] = targets[3]  # two offsets of one row hitting the same column: T_c sums both weights
    grad_rows = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    want = train_grad_float64(logits.detach(), targets, weights, grad_rows)
    w = torch.tensor(weights, dtype=torch.float64)
    for rows in (None, 3):
        losses = tk.softcapped_mtp_ce_train_reference(logits, targets, w, rows=rows)
        (got,) = torch.autograd.grad(losses, logits, grad_rows)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    # the loss is record 61's (unrounded sigma in float64) and its own derivative differs on the tail rows only
    torch.testing.assert_close(losses, tk.softcapped_mtp_ce_reference(logits, targets, w), rtol=1e-12, atol=1e-12)
    (autograd,) = torch.autograd.grad(tk.softcapped_mtp_ce_reference(logits, targets, w), logits, grad_rows)
    tail = n - len(weights) + 1
    torch.testing.assert_close(got[:tail], autograd[:tail], rtol=1e-10, atol=1e-14)
    assert len(weights) == 1 or (got[tail:] - autograd[tail:]).abs().max() > 1e-3


def test_train_reference_rounds_sigma_to_bf16_only_for_bf16_logits():
    import _ce_transcription as tr
    g = torch.Generator().manual_seed(2)
    logits = tr.logits_clear_of_bf16_ties(5, 40, g, 6.0, torch.bfloat16)
    targets = torch.randint(0, 40, (5,), generator=g)
    weights = [1.0, 0.5, 0.25]
    for dtype, rounded in ((torch.bfloat16, True), (torch.float32, False)):
        losses, _ = tk.softcapped_mtp_ce_train_math(logits.to(dtype), targets, torch.tensor(weights))
        want = tr.ce_train(logits, targets, weights, rounded=rounded)["losses"]
        torch.testing.assert_close(losses.double(), want, rtol=1e-6, atol=1e-5)
        other = tr.ce_train(logits, targets, weights, rounded=not rounded)["losses"]
        assert (losses.double() - other).abs().max() > 1e-4


@pytest.mark.parametrize("grad_scale", [1.0, 0.5, 0.125])
def test_fp8_reference_gradient_is_the_transcribed_gradient_quantised(grad_scale):
    """The FP8 op's reference: losses of the bf16 logits and G8 = e5m2 of the transcription's fp32 gradient of
    grad_scale * sum(losses), both layouts, with the same payload for every grad_scale; in row blocks too."""
    import _ce_transcription as tr
    g = torch.Generator().manual_seed(11)
    n, V, weights = 9, 300, [1.0, 0.5, 0.25]
    logits = tr.logits_clear_of_bf16_ties(n, V, g, 8.0, torch.bfloat16)
    targets = torch.randint(0, V, (n,), generator=g)
    s_g = grad_scale * 0.75 / 448
    losses, g8, g8_t = tk.softcapped_mtp_ce_fp8_reference(logits, targets, torch.tensor(weights), grad_scale, s_g)
    want = tr.ce_train(logits, targets, weights)
    torch.testing.assert_close(losses.double(), want["losses"], rtol=1e-6, atol=1e-5)
    assert g8.dtype == g8_t.dtype == torch.float8_e5m2 and torch.equal(g8_t.float(), g8.float().T)
    tr.assert_e5m2_matches(g8.float(), tr.g_fp32(want, tr.fp8_grad_factor(grad_scale, s_g)), "reference G8")
    _, g8_one, _ = tk.softcapped_mtp_ce_fp8_reference(logits, targets, torch.tensor(weights), 1.0, 0.75 / 448)
    assert torch.equal(g8.view(torch.uint8), g8_one.view(torch.uint8))
    blocks = tk.softcapped_mtp_ce_fp8_reference(logits, targets, torch.tensor(weights), grad_scale, s_g, rows=4)
    assert torch.equal(blocks[0], losses) and torch.equal(blocks[1].view(torch.uint8), g8.view(torch.uint8))


def test_fp8_gradient_factor_is_the_records_constants():
    """The fp32 constants of the FP8 gradient's factor at W = 8: (1/C) A = 0x40444445, s_g = 0x3ADB6DB7,
    1/s_g = 0x44155555; 1/C and B/C."""
    import struct
    bits = lambda x: struct.unpack("I", struct.pack("f", x))[0]
    assert bits(tk.SOFTCAP_INV_C) == 0x3E088889 and bits(tk.SOFTCAP_B_DIV_C) == 0x3F2AAAAB
    assert bits(tk.SOFTCAP_INV_C_A) == 0x40444445 and bits(tk._f32(0.75 / 448)) == 0x3ADB6DB7
    assert bits(tk.fp8_grad_inverse_scale(0.75 / 448)) == 0x44155555


def test_the_trainer_runs_every_reference_on_cpu():
    """Off CUDA the op table holds the references (the trainer runs unchanged without a GPU), whatever --kernels
    asks; the fused entries are torch.library ops for CUDA tensors."""
    import train_gpt as tg
    for kernels in ("fused", "torch", "mlp:fused,polar:fused"):
        ops = tg.kernel_ops(kernels, "cpu")
        assert (ops.xxt, ops.ba_plus_cAA, ops.relu2_mlp) == (tk.xxt_reference, tk.ba_plus_cAA_reference,
                                                             tk.relu2_mlp_post_reference), kernels
        assert (ops.relu2_mlp_fp8_down, ops.fp8_act_scales, ops.dc_correction, ops.fp8_down_fused) == (
            tk.relu2_mlp_fp8_down_reference, tk.fp8_scales_from_partial_amax_reference, tk.dc_correction_reference,
            False), kernels
        assert ops.mtp_ce is tk.softcapped_mtp_ce_chunked, kernels
        assert ops.mtp_ce_train.func is tk.softcapped_mtp_ce_train_reference, kernels
        assert ops.fp8_head_mtp_ce.keywords == dict(fused_head=False, fused_ce=False, rows=0), kernels


@pytest.mark.parametrize("n, weights", [(100, [1.0, 0.5, 0.25]), (70, [1.0, 0.0, 0.5]), (2, [1.0, 0.5, 0.25]),
                                        (33, [1.0]), (64, [0.0, -1.0])])
def test_ce_cpu_path_matches_reference_forward_and_backward(n, weights):
    """The eval CE op on CPU is the chunked path (rows in blocks of 32, so n=33/70/100 cross block edges and the
    MTP targets of a block's last rows live in the next block): same losses and bf16 gradient as the reference."""
    g = torch.Generator().manual_seed(n)
    V = 777
    logits = (torch.randn(n, V, generator=g) * 6).bfloat16().requires_grad_()
    targets = torch.randint(0, V, (n,), generator=g)
    targets[5 % n] = targets[4 % n]  # two offsets of one row on one column
    w, grad_rows = torch.tensor(weights), torch.rand(n, generator=g) + 0.5
    got = tk.softcapped_mtp_ce_chunked(logits, targets, w, rows=32)
    (got_grad,) = torch.autograd.grad(got, logits, grad_rows)
    want = tk.softcapped_mtp_ce_reference(logits, targets, w)
    (want_grad,) = torch.autograd.grad(want, logits, grad_rows)
    assert got.dtype == torch.float32 and got_grad.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    # both round an fp32 gradient to bf16; fp32 op-order differences may flip a rounding: at most one bf16 ulp
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=2 ** -7, atol=1e-6)
    with torch.no_grad():  # eval: the same op without autograd
        torch.testing.assert_close(tk.softcapped_mtp_ce_chunked(logits, targets, w, rows=32), want, rtol=1e-6, atol=1e-5)


# ------------------------------------------------------------------------------------------------------------------
# sm_90 compile of the real kernels (ptxas ships with triton; no GPU needed)
# ------------------------------------------------------------------------------------------------------------------

H100_MAX_SHARED = 232448  # bytes of dynamic shared memory per block on sm_90


def compile_for_h100(kernel, signature, constexprs, options, contiguous=(), aligned=()):
    """Compile `kernel` for sm_90 the way a launch would specialise it: `contiguous` int args equal 1 (Triton makes them
    constants), `aligned` pointers/ints divisible by 16."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton
    names = list(inspect.signature(kernel.fn).parameters)
    constexprs = {**constexprs, **{name: 1 for name in contiguous}}
    sig = {name: ("constexpr" if name in constexprs else signature[name]) for name in names}
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def _sm90_cases():
    sym_sig = {"a_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "K": "i32", "stride_ab": "i32", "stride_am": "i32",
               "stride_ak": "i32", "stride_ob": "i32", "stride_om": "i32", "stride_on": "i32", "b_coef": "fp32",
               "c_coef": "fp32"}
    mlp_sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "pre_ptr": "*bf16", "out_ptr": "*bf16", "scale_ptr": "*bf16",
               "post8_ptr": "*bf16", "act_scale_ptr": "*bf16", "amax_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
               "stride_am": "i32", "stride_bn": "i32", "stride_pm": "i32", "stride_om": "i32"}
    plain = {"STORE_PRE": True, "SQRT_POST": False, "EMIT_FP8": False}
    softcap = {"A": tk.SOFTCAP_A, "B": tk.SOFTCAP_B, "C": tk.SOFTCAP_C}
    cases = []
    for bm, bn, bk, warps, stages in (tk._SYM_SMALL_TILES, tk._SYM_LARGE_TILES):
        tiles = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
        cases.append(("sym", tk._sym_aat_kernel, sym_sig, {"ADD_BA": True, **tiles},
                      {"num_warps": warps, "num_stages": stages}, ("stride_ak", "stride_on"),
                      ("a_ptr", "out_ptr", "M", "K", "stride_ab", "stride_am", "stride_ob", "stride_om")))
    bm, bn, bk, group_m, warps, stages = tk._MLP_TILES
    # record 84's forward and backward, then the post-only forward and the sqrt(post) backward (record 87)
    for backward, store_pre, sqrt_post in ((False, True, False), (True, True, False), (False, False, False),
                                           (True, True, True)):
        tiles = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "WARP_SPECIALIZE": True}
        modes = {**plain, "STORE_PRE": store_pre, "SQRT_POST": sqrt_post}
        cases.append(("mlp", tk._relu2_linear_kernel, mlp_sig, {"BACKWARD": backward, "SCALED": False, **modes,
                                                                **tiles},
                      {"num_warps": warps, "num_stages": stages}, (), tuple(mlp_sig)))
    # the FP8 forward: e4m3 operands, the scale read from an fp32 pointer, its own tiles (8 warps: no warp
    # specialisation)
    bm, bn, bk, group_m, warps, stages = tk._MLP_FP8_TILES
    fp8_sig = {**mlp_sig, "a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
    cases.append(("mlp_fp8", tk._relu2_linear_kernel, fp8_sig,
                  {"BACKWARD": False, "SCALED": True, **plain, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                   "GROUP_M": group_m, "WARP_SPECIALIZE": True}, {"num_warps": warps, "num_stages": stages}, (),
                  tuple(k for k in fp8_sig if k != "scale_ptr")))
    # record 89's training forward: post only, post8 in e4m3, the delayed scale and the maxima in fp32
    bm, bn, bk, group_m, warps, stages = tk._MLP_FP8_EMIT_TILES
    emit_sig = {**fp8_sig, "post8_ptr": "*fp8e4nv", "act_scale_ptr": "*fp32", "amax_ptr": "*fp32"}
    cases.append(("mlp_fp8_emit", tk._relu2_linear_kernel, emit_sig,
                  {"BACKWARD": False, "SCALED": True, "STORE_PRE": False, "SQRT_POST": False, "EMIT_FP8": True,
                   "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "WARP_SPECIALIZE": True},
                  {"num_warps": warps, "num_stages": stages}, (),
                  tuple(k for k in emit_sig if k not in ("scale_ptr", "act_scale_ptr", "amax_ptr"))))
    cases.append(("fp8_reduce", tk._fp8_scale_reduce_kernel,
                  {"partial_ptr": "*fp32", "out_ptr": "*fp32", "n_cols": "i32", "stride_row": "i32", "factor": "fp32"},
                  {"BLOCK": tk._FP8_REDUCE_BLOCK}, {"num_warps": 4}, (), ("partial_ptr", "stride_row")))
    cases.append(("fp8_quant", tk._down_weight_quant_kernel,
                  {"w_ptr": "*bf16", "scale_ptr": "*fp32", "out_ptr": "*fp8e4nv", "amax_ptr": "*fp32", "H": "i32",
                   "D": "i32", "stride_ws": "i32", "stride_wh": "i32", "stride_os": "i32", "stride_od": "i32"},
                  {"BLOCK": tk._FP8_QUANT_TILE}, {"num_warps": tk._FP8_QUANT_WARPS}, (),
                  ("w_ptr", "out_ptr", "H", "D", "stride_ws", "stride_wh", "stride_os", "stride_od")))
    ce_fwd_sig = {"logits_ptr": "*bf16", "targets_ptr": "*i64", "weights_ptr": "*fp32", "losses_ptr": "*fp32",
                  "lse_ptr": "*fp32", "prefix_ptr": "*i64", "prefix_w_ptr": "*fp32", "n_rows": "i32", "n_cols": "i32",
                  "stride_row": "i32", "n_weights": "i32"}
    # record 61's eval loss, record 80's training loss, and with record 88's prefix term
    for train, prefix in ((False, False), (True, False), (True, True)):
        cases.append(("ce_fwd", tk._ce_fwd_kernel, ce_fwd_sig,
                      {**softcap, "TRAIN": train, "NATIVE": True, "PREFIX": prefix, "BLOCK": tk._CE_BLOCK},
                      {"num_warps": tk._CE_WARPS}, (), ("logits_ptr", "n_cols", "stride_row")))
    ce_grad_sig = {"grad_ptr": "*fp32", "stride_grad": "i32", "logits_ptr": "*bf16", "weights_ptr": "*fp32",
                   "lse_ptr": "*fp32", "prefix_ptr": "*i64", "prefix_w_ptr": "*fp32", "n_rows": "i32",
                   "n_cols": "i32", "stride_row": "i32", "n_weights": "i32", "post_scale": "fp32"}
    # the plain bf16 training backward (one layout) and the FP8 head's gradient (both layouts), as the launcher
    # pairs them, each without and with the prefix term
    for quantize, out, prefix in ((False, "*bf16", False), (True, "*fp8e5", False), (False, "*bf16", True),
                                  (True, "*fp8e5", True)):
        flags = {"A": tk.SOFTCAP_A, "QUANTIZE": quantize, "NATIVE": True, "TRANSPOSED": quantize, "PREFIX": prefix}
        rows, block, _, warps = tk._CE_GRAD_TILES[quantize]
        sig = {**ce_grad_sig, "out_ptr": out, "out_t_ptr": out, "cols_per_program": "i32"}
        cases.append(("ce_grad", tk._ce_grad_kernel, sig, {**flags, "BLOCK_R": rows, "BLOCK_C": block},
                      {"num_warps": warps}, ("stride_grad",),
                      ("logits_ptr", "out_ptr", "out_t_ptr", "n_rows", "n_cols", "cols_per_program")))
        cases.append(("ce_targets", tk._ce_targets_kernel,
                      {**ce_grad_sig, "out_ptr": out, "out_t_ptr": out, "targets_ptr": "*i64"},
                      flags, {"num_warps": 1}, ("stride_grad",), ("logits_ptr", "out_ptr", "n_cols")))
    strides = ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh")
    attn = {"fwd": (tk._attn_fwd_kernel, {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16",
                                          "lse_ptr": "*fp32", "start_ptr": "*i32", "stride_ot": "i32",
                                          "stride_oh": "i32"}),
            "dkdv": (tk._attn_dkdv_kernel, {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "do_ptr": "*bf16",
                                            "lse_ptr": "*fp32", "delta_ptr": "*fp32", "end_ptr": "*i32",
                                            "dk_ptr": "*bf16", "dv_ptr": "*bf16", "scale": "fp32"}),
            "dq": (tk._attn_dq_kernel, {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "do_ptr": "*bf16",
                                        "o_ptr": "*bf16", "lse_ptr": "*fp32", "delta_ptr": "*fp32",
                                        "start_ptr": "*i32", "dq_ptr": "*bf16", "scale": "fp32",
                                        "stride_ot": "i32", "stride_oh": "i32"})}
    for name, (kernel, sig) in attn.items():
        bm, bn, warps, stages = tk._ATTN_TILES[name]
        params = inspect.signature(kernel.fn).parameters
        sig = {**sig, "T": "i32", "window": "i32", "qk_scale": "fp32",
               **{s: "i32" for s in strides + ("stride_dot", "stride_doh", "stride_gt", "stride_gh") if s in params}}
        cases.append((f"attn_{name}", kernel, sig, {"HEAD_DIM": 128, "BLOCK_M": bm, "BLOCK_N": bn},
                      {"num_warps": warps, "num_stages": stages}, (), tuple(sig)))
    return cases


def test_ce_fp8_gradient_saturates_in_the_cast():
    """The e5m2 gradient relies on sm_90's saturating conversion straight from fp32 (cvt.rn.satfinite, RNE) for its
    rounding and the clamp to +-57344, so its loop has no min/max; the fp32 output of the tests rounds through the
    bits (_e5m2_rne), whose saturation is a min."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter replaces triton.jit; run without TRITON_INTERPRET")
    _, kernel, sig, consts, opts, contiguous, aligned = next(
        c for c in _sm90_cases() if c[0] == "ce_grad" and c[3]["QUANTIZE"])
    ptx = {}
    for out in ("*fp8e5", "*fp32"):
        try:
            ptx[out] = compile_for_h100(kernel, {**sig, "out_ptr": out, "out_t_ptr": out}, consts, opts, contiguous,
                                        aligned).asm["ptx"]
        except (ImportError, FileNotFoundError) as e:
            pytest.skip(f"cannot compile for sm_90 here: {e}")
    assert "cvt.rn.satfinite.e5m2x2.f32" in ptx["*fp8e5"] and "bf16" not in ptx["*fp8e5"].split("cvt.rn.satfinite")[1]
    assert "min.f32" not in ptx["*fp8e5"] and "max.f32" not in ptx["*fp8e5"]
    assert "min.f32" in ptx["*fp32"]


def test_ce_kernels_special_functions():
    """Eval: two bare exponentials per score (ex2.approx.ftz; tl.exp would bring ex2.approx.f32 with a compare and
    two multiplies per element) and _rcp_fma's FMAs for the reciprocal, no rcp and no division on the
    special-function unit, which bounds the forward. Training: the record's tanh.approx.f32 for sigma, its
    bf16 rounding as one cvt.rn.bf16.f32, one bare exponential, and no rcp or division either."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter replaces triton.jit; run without TRITON_INTERPRET")
    for name, kernel, sig, consts, opts, contiguous, aligned in _sm90_cases():
        if not name.startswith("ce_"):
            continue
        try:
            ptx = compile_for_h100(kernel, sig, consts, opts, contiguous, aligned).asm["ptx"]
        except (ImportError, FileNotFoundError) as e:
            pytest.skip(f"cannot compile for sm_90 here: {e}")
        train = consts.get("TRAIN", name != "ce_fwd")
        assert "ex2.approx.ftz.f32" in ptx and "ex2.approx.f32" not in ptx, name
        assert "rcp." not in ptx and "div." not in ptx, name
        assert "fma.rn.f32" in ptx, name
        if train:
            assert "tanh.approx.f32" in ptx and "cvt.rn.bf16.f32" in ptx and "min.NaN.f32" not in ptx, name
        else:
            assert "tanh.approx" not in ptx and "min.NaN.f32" in ptx, name


def test_fp8_down_kernels_round_in_the_hardware_conversion():
    """The post-only backward takes Triton's approximate square root (sqrt.approx, what the record runs); the FP8
    emission and the weight quantiser store e4m3 by sm_90's saturating RNE conversion from fp32 (no bf16 step), and
    the quantiser divides by the scale with div.full.f32, the record's fp32 division."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter replaces triton.jit; run without TRITON_INTERPRET")
    ptx = {}
    for name, kernel, sig, consts, opts, contiguous, aligned in _sm90_cases():
        key = "sqrt" if consts.get("SQRT_POST") else name
        if key in ("sqrt", "mlp_fp8_emit", "fp8_quant"):
            try:
                ptx[key] = compile_for_h100(kernel, sig, consts, opts, contiguous, aligned).asm["ptx"]
            except (ImportError, FileNotFoundError) as e:
                pytest.skip(f"cannot compile for sm_90 here: {e}")
    assert "sqrt.approx" in ptx["sqrt"] and "sqrt.rn" not in ptx["sqrt"]
    for key in ("mlp_fp8_emit", "fp8_quant"):
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx[key] and "bf16" not in ptx[key].split("cvt.rn.satfinite")[1], key
    assert "div.full.f32" in ptx["fp8_quant"] and "div.rn.f32" not in ptx["fp8_quant"]


def test_attention_kernels_compile_with_fp64_scales():
    """inductor may hand the kernels' float arguments over as fp64 scalars; the kernels cast them, so no loop-carried
    value turns fp64 (which Triton rejects: it failed to compile inside the model before the casts)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter replaces triton.jit; run without TRITON_INTERPRET")
    for name, kernel, sig, consts, opts, contiguous, aligned in _sm90_cases():
        if name.startswith("attn_"):
            sig = {k: ("fp64" if v == "fp32" else v) for k, v in sig.items()}
            try:
                compile_for_h100(kernel, sig, consts, opts, contiguous, aligned)
            except (ImportError, FileNotFoundError) as e:
                pytest.skip(f"cannot compile for sm_90 here: {e}")


@pytest.mark.parametrize("case", _sm90_cases(), ids=lambda c: f"{c[0]}-{'-'.join(str(v) for v in c[3].values())}")
def test_kernels_compile_for_h100_without_fp64(case):
    """The original CE kernel turned a loop carry into fp64 under torch.compile; no kernel here may contain fp64,
    the matmul kernels must use Hopper's wgmma with a pipelined K loop, and shared memory must fit an H100."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter replaces triton.jit; run without TRITON_INTERPRET")
    name, kernel, sig, consts, opts, contiguous, aligned = case
    try:
        compiled = compile_for_h100(kernel, sig, consts, opts, contiguous, aligned)
    except (ImportError, FileNotFoundError, RuntimeError) as e:  # no CUDA backend / ptxas in this triton install
        if "ptxas" in str(e) or isinstance(e, (ImportError, FileNotFoundError)):
            pytest.skip(f"cannot compile for sm_90 here: {e}")
        raise
    assert "f64" not in compiled.asm["ttir"], f"{name}: fp64 in the Triton IR"
    assert compiled.metadata.shared <= H100_MAX_SHARED, f"{name}: {compiled.metadata.shared} bytes of shared memory"
    if name in ("sym", "mlp") or name.startswith("attn_"):
        assert "wgmma" in compiled.asm["ptx"], f"{name}: no wgmma in the PTX"
    if name in ("sym", "mlp"):
        stages = opts["num_stages"]
        tile_bytes = 2 * consts["BLOCK_K"] * (consts["BLOCK_M"] + consts["BLOCK_N"])
        assert compiled.metadata.shared >= (stages - 1) * tile_bytes, f"{name}: K loop not pipelined"
    if name == "mlp":
        # warp-specialised: a TMA-loading warpgroup beside the two computing ones, registers moved between them
        assert compiled.metadata.num_warps == 3 * opts["num_warps"], f"{name}: not warp-specialised"
        assert "setmaxnreg" in compiled.asm["ptx"] and "cp.async.bulk.tensor" in compiled.asm["ptx"], name


def test_sym_tiles_follow_the_measured_rule(monkeypatch):
    """notes/2026-11-22_startup_1xH200_4xH200/optimizer_tiles.py on an H200: 128x128 tiles win only for X X^T of
    768 x 3072 matrices when their 128x128 tiles fill the SMs; 64x64 everywhere else."""
    monkeypatch.setattr(tk, "_num_programs_persistent", lambda device: 132)
    gpu = torch.device("cuda")
    assert tk._sym_tiles(768, 3072, 40, gpu) == tk._SYM_LARGE_TILES
    assert tk._sym_tiles(768, 3072, 4, gpu) == tk._SYM_LARGE_TILES        # 36 tiles each: 144 >= 132
    assert tk._sym_tiles(768, 3072, 3, gpu) == tk._SYM_SMALL_TILES        # 108 < 132
    assert tk._sym_tiles(768, 768, 40, gpu) == tk._SYM_SMALL_TILES        # short rows
    assert tk._sym_tiles(768, 2047, 40, gpu) == tk._SYM_SMALL_TILES
