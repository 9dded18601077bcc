"""GPU tests of triton_kernels.py: bf16 kernels against float64 references (forward and backward) and
torch.compile(fullgraph=True) tracing with no graph break and no recompile. Run on the device:
    python3 -m pytest -q tests/test_kernels_gpu.py

Tolerance: the kernels round to bf16 (2^-8 relative) at the record's rounding points, so relative errors (max abs error
over the largest reference value) land around 1e-3..1e-2; 2e-2 passes any legal summation order while a wrong
tile, mask or epilogue gives errors of order 1.
"""
import pytest
import torch
import triton
import triton.language as tl

import train_gpt as tg
import triton_kernels as tk
from _fp32_exact import rcp_fma_ulp_errors

pytestmark = pytest.mark.gpu
BF16_TOL = 2e-2
A_, B_, C_ = 23.0, 5.0, 7.5
S_G = 0.75 / 448  # the FP8 head's gradient scale at grad_scale 1


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any(), "NaN in the kernel output"
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def fp8_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


# ------------------------------------------------------------------------------------------------------------------
# Symmetric kernels (Polar Express shapes)
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, transposed", [((5, 768, 768), False), ((3, 768, 3072), False),
                                               ((3, 768, 3072), True), ((200, 136), False)])
def test_xxt_bf16(shape, transposed):
    g = gen(0)
    if transposed:  # Polar Express transposes the 3072x768 MLP matrices: a strided view
        A = torch.randn(shape[0], shape[2], shape[1], device="cuda", generator=g).bfloat16().mT
    else:
        A = torch.randn(*shape, device="cuda", generator=g).bfloat16()
    out = tk.xxt(A)
    assert out.dtype == torch.bfloat16 and out.shape == (*A.shape[:-1], A.shape[-2])
    assert rel_err(out, A.double() @ A.double().mT) < BF16_TOL
    assert torch.equal(out, out.mT), "not exactly symmetric"


@pytest.mark.parametrize("n_batch, m", [(5, 768), (3, 768), (1, 200)])
def test_ba_plus_cAA_bf16(n_batch, m):
    X = torch.randn(n_batch, m, 2 * m, device="cuda", generator=gen(1)).bfloat16()
    X = X / X.float().norm(dim=(-2, -1), keepdim=True).bfloat16()
    A = tk.xxt(X)
    for b, c in [(-22.48329292557795, 15.878769915207462), (-2.808917465908714, 0.5000178451051316)]:
        out = tk.ba_plus_cAA(A, b, c)
        A64 = A.double()
        assert rel_err(out, c * A64 @ A64 + b * A64) < BF16_TOL
        assert torch.equal(out, out.mT), "not exactly symmetric"


def test_ba_plus_cAA_scalars_do_not_recompile_the_kernel():
    A = tk.xxt(torch.randn(2, 256, 256, device="cuda").bfloat16() / 16)
    tk.ba_plus_cAA(A, 1.0, 2.0)
    cache = getattr(tk._sym_aat_kernel, "device_caches", None)
    sizes = None if cache is None else [len(v[0]) for v in cache.values()]
    out = tk.ba_plus_cAA(A, -3.0, 0.25)
    assert rel_err(out, 0.25 * A.double() @ A.double() - 3.0 * A.double()) < BF16_TOL
    if cache is not None:
        assert [len(v[0]) for v in cache.values()] == sizes, "new scalars compiled a new kernel"


# ------------------------------------------------------------------------------------------------------------------
# relu^2 MLP
# ------------------------------------------------------------------------------------------------------------------

def mlp_inputs(M: int, seed: int, lead=()):
    g = gen(seed)
    x = torch.randn(*lead, M, 768, device="cuda", generator=g).bfloat16().requires_grad_()
    c_fc = (torch.randn(3072, 768, device="cuda", generator=g) / 768 ** 0.5).bfloat16().requires_grad_()
    c_proj = (torch.randn(3072, 768, device="cuda", generator=g) / 3072 ** 0.5).bfloat16().requires_grad_()
    return x, c_fc, c_proj


@pytest.mark.parametrize("M, lead", [(2048, ()), (1000, ()), (512, (2,))])
def test_relu2_mlp_forward_backward_bf16(M, lead):
    x, c_fc, c_proj = mlp_inputs(M, 2, lead)
    out = tk.relu2_mlp_triton(x, c_fc, c_proj)
    grad = torch.randn_like(out)
    dx, dc_fc, dc_proj = torch.autograd.grad(out, (x, c_fc, c_proj), grad)
    x64, fc64, proj64, g64 = (t.detach().double() for t in (x, c_fc, c_proj, grad))
    x64 = x64.reshape(-1, 768)
    g64 = g64.reshape(-1, 768)
    pre = x64 @ fc64.T
    post = pre.clamp_min(0) ** 2
    dpre = 2 * (g64 @ proj64.T) * pre.clamp_min(0)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert rel_err(out.reshape(-1, 768), post @ proj64) < BF16_TOL
    assert rel_err(dx.reshape(-1, 768), dpre @ fc64) < BF16_TOL
    assert rel_err(dc_fc, dpre.T @ x64) < BF16_TOL
    assert rel_err(dc_proj, post.T @ g64) < BF16_TOL


@pytest.mark.parametrize("M", [3 * 1024 + 37, 49152])
@pytest.mark.parametrize("backward", [False, True])
def test_relu2_mlp_warp_specialized_kernel_is_bitwise_the_plain_pipeline(backward, M):
    """The trainer's kernel is warp-specialised (a loading warpgroup, two computing ones). That moves loads and
    stores between warps, never a sum: the outputs equal the single-role pipeline's bit for bit, every element written,
    partial last tiles included (M not a multiple of 128) and at the largest training micro-batch. triton 3.6 got
    this wrong for other tiles and for a descriptor load of pre, so the check runs at the trainer's tiles."""
    x, c_fc, _ = (t.detach() for t in mlp_inputs(M, 5))
    g = torch.randn_like(x)
    plain = tk._MLP_TILES[:4] + (8, 3)  # two warpgroups sharing every role
    outs = []
    for tiles, ws in ((tk._MLP_TILES, None), (plain, False)):
        pre = torch.full((M, 3072), float("nan"), device="cuda", dtype=torch.bfloat16)
        out = torch.full_like(pre, float("nan"))
        if backward:
            tk._launch_relu2_linear(x, c_fc, pre, torch.empty_like(pre), False, plain, False)
        tk._launch_relu2_linear(g if backward else x, c_fc, pre, out, backward, tiles, ws)
        outs.append((pre, out))
    for a, b in zip(*outs):
        assert not a.isnan().any(), "an element was not written"
        assert torch.equal(a, b)


FP8_MICRO_BATCHES = sorted({tg.micro_batch_tokens(st.batch, tg.Hyperparameters().batch_slices)
                            for st in tg.Hyperparameters().stages})       # the training forwards that run FP8


@pytest.mark.parametrize("M", FP8_MICRO_BATCHES + [3 * 1024 + 37])
def test_relu2_mlp_fp8_forward_matches_its_reference_and_backward_is_bf16(M):
    """The FP8 kernel against the FP8 reference at the schedule's micro-batch sizes (and a partial last tile): the
    same e4m3 operands and q, only the summation differs (Hopper's fp8 accumulator); the backward is the bf16 one at
    the FP8 pre, as the reference's."""
    x, c_fc, c_proj = mlp_inputs(M, 12)
    out = tk.relu2_mlp_triton(x, c_fc, c_proj, fp8=True)
    ref = tk.relu2_mlp_reference(x, c_fc, c_proj, fp8=True)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < BF16_TOL
    assert rel_err(out, tk.relu2_mlp_reference(x, c_fc, c_proj)) > BF16_TOL / 4      # the FP8 rounding is there
    grad = torch.randn_like(out)
    for name, a, b in zip(("dx", "dc_fc", "dc_proj"), torch.autograd.grad(out, (x, c_fc, c_proj), grad),
                          torch.autograd.grad(ref, (x, c_fc, c_proj), grad)):
        assert rel_err(a, b) < BF16_TOL, name
    w8, s = tk.quantize_mlp_weight(c_fc.detach())
    x8, q = tk.quantize_mlp_input(x.detach(), s)
    pre, post = tk.relu2_mlp_fp8_fwd_triton(x8, w8, q.reshape(1))
    assert torch.equal(post, (pre.float().clamp_min(0) ** 2).bfloat16())
    assert rel_err(pre, (x8.double() @ w8.double().T) * q.item()) < BF16_TOL


def test_compiled_fp8_mlp_quantises_each_call_and_matches_eager():
    """Under torch.compile the quantisation runs inside the graph, per call: two calls with other inputs get their
    own scales."""
    x, c_fc, c_proj = (t.detach() for t in mlp_inputs(4096, 13))
    f = torch.compile(lambda x, a, b: tk.relu2_mlp_triton(x, a, b, fp8=True), fullgraph=True)
    for scale in (1.0, 0.01):
        assert rel_err(f(x * scale, c_fc, c_proj), tk.relu2_mlp_triton(x * scale, c_fc, c_proj, fp8=True)) < 1e-3


def test_relu2_mlp_kernel_rounding_points():
    """post = bf16(relu(pre)^2) from the stored bf16 pre, exactly; dpre = bf16(2 * bf16(g @ c_proj.T) * relu(pre))."""
    x, c_fc, c_proj = (t.detach() for t in mlp_inputs(1024, 3))
    pre, post = tk.relu2_mlp_fwd_triton(x, c_fc)
    assert rel_err(pre, x.double() @ c_fc.double().T) < BF16_TOL
    assert torch.equal(post, (pre.float().clamp_min(0) ** 2).bfloat16())
    g = torch.randn(1024, 768, device="cuda", generator=gen(4)).bfloat16()
    dpre = tk.relu2_mlp_bwd_triton(g, c_proj, pre)
    want = (2 * (g @ c_proj.T).float() * pre.float().clamp_min(0)).bfloat16()  # cuBLAS bf16(g @ c_proj.T)
    # Summation order may flip the bf16 rounding of g @ c_proj.T in rare elements; require near-total agreement.
    assert (dpre != want).float().mean().item() < 1e-2
    assert rel_err(dpre, want) < BF16_TOL


# ------------------------------------------------------------------------------------------------------------------
# Softcapped MTP cross entropy
# ------------------------------------------------------------------------------------------------------------------

def ce_float64(logits, targets, weights):
    """Record 61's eval loss in float64 (all targets in range): losses (n,)."""
    n, V = logits.shape
    z = A_ * torch.sigmoid((logits.double() + B_) / C_)
    lse = torch.logsumexp(z, dim=1)
    losses = torch.zeros(n, dtype=torch.float64, device=logits.device)
    for k, w in enumerate(weights.tolist()):
        if w > 0:
            losses[: n - k] += w * (lse[: n - k] - z[torch.arange(n - k, device=logits.device), targets[k:]])
    return losses


@pytest.mark.parametrize("weights", [[1.0], [1.0, 0.5, 0.25]])
def test_eval_ce_bf16(weights):
    """The eval loss (record 61's fp32 sigma) from bf16 logits at the vocabulary's size."""
    n, V = 1024, 50304
    g = gen(5)
    logits = (torch.randn(n, V, device="cuda", generator=g) * 10).bfloat16()
    targets = torch.randint(0, V, (n,), device="cuda", generator=g)
    w = torch.tensor(weights, device="cuda")
    losses = tk.softcapped_mtp_ce_triton(logits, targets, w)
    assert losses.dtype == torch.float32
    assert rel_err(losses, ce_float64(logits, targets, w)) < 1e-4  # fp32 math from the same bf16 logits


def _train_case(n, V, seed, scale=10.0):
    g = gen(seed)
    logits = (torch.randn(n, V, device="cuda", generator=g) * scale).bfloat16()
    return logits, torch.randint(0, V, (n,), device="cuda", generator=g)


def e5m2_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many e5m2 values lie between a and b, counting one (e5m2 tensors of one sign pattern per element)."""
    ia, ib = (t.view(torch.uint8).int() for t in (a, b))
    signed = lambda i: torch.where(i >= 128, -(i - 128), i)                # sign-magnitude -> ordered integers
    return (signed(ia) - signed(ib)).abs()


@pytest.mark.parametrize("n, weights", [(256, [1.0, 0.5, 0.25]), (255, [1.0, 0.5]), (37, [1.0])])
def test_train_kernels_bf16_match_the_reference(n, weights):
    """Record 80's training loss and FP8 gradient on the GPU (tanh.approx for sigma, hardware bf16 and e5m2
    conversions) against the plain-PyTorch reference on the same bf16 logits (torch.sigmoid). tanh.approx's error
    (~2^-11 relative) moves some bf16 sigmas by one step, which moves the e5m2 values next to their rounding
    boundaries by one step: all elements within one step, and few of them apart. Printed: how many sigmas and G8
    values differ (the record has the same deviation from a correctly rounded sigma)."""
    V = 50304
    logits, targets = _train_case(n, V, 31)
    w = torch.tensor(weights, device="cuda")
    losses, g8, g8_t = tk.softcapped_mtp_ce_fp8_triton(logits, targets, w, 0.125, 0.125 * 0.75 / 448)
    ref_losses, ref_g8, _ = tk.softcapped_mtp_ce_fp8_reference(logits, targets, w, 0.125, 0.125 * 0.75 / 448)
    assert g8.dtype == g8_t.dtype == torch.float8_e5m2 and g8.shape == (n, V) and g8_t.shape == (V, n)
    assert torch.equal(fp8_bits(g8_t), fp8_bits(g8).t()), "the transposed layout is not the transpose"
    steps = e5m2_steps_apart(g8, ref_g8)
    print(f"\nG8 differs from the reference at {steps.bool().float().mean().item():.2e} of the elements")
    assert steps.max() <= 1 and steps.bool().float().mean() < 0.02
    assert (g8.float() != 0).float().mean() > 0.5  # the scale keeps most gradients above e5m2's underflow
    # per row: a moved sigma at a target moves its term by 23 * 2^-8 at most
    assert ((losses - ref_losses).abs() <= 0.1 * sum(weights) + 1e-3 * ref_losses.abs()).all()
    assert rel_err(losses, ref_losses) < 1e-3
    _, lse = tk.softcapped_mtp_ce_train_fwd_triton(logits, targets, w)
    q32, q32_t = tk.softcapped_mtp_ce_fp8_grad_triton(logits, targets, w, lse, 0.125, 0.125 * 0.75 / 448,
                                                      out_dtype=torch.float32)
    assert torch.equal(q32, g8.float()) and torch.equal(q32_t, g8_t.float()), \
        "the hardware e5m2 conversion is not the bits' rounding (_e5m2_rne)"


def test_train_kernels_with_the_prefix_term_match_the_reference():
    """Record 88's prefix term on the GPU at the vocabulary's width: losses and G8 against the reference with the same
    prefix targets (a third without one, some equal to a row's target), within the bf16-sigma tolerance above; with
    w_p = 0 the plain outputs bit for bit."""
    n, V = 256, 50304
    logits, targets = _train_case(n, V, 53)
    w = torch.tensor([1.0, 0.5, 0.25], device="cuda")
    prefix = torch.randint(0, V, (n,), device="cuda", generator=gen(54))
    prefix[::3] = -1
    prefix[1::5] = targets[1::5]
    w_p = torch.tensor([0.25], device="cuda")
    args = (logits, targets, w, 0.125, 0.125 * 0.75 / 448)
    losses, g8, g8_t = tk.softcapped_mtp_ce_fp8_triton(*args, prefix, w_p)
    ref_losses, ref_g8, _ = tk.softcapped_mtp_ce_fp8_reference(*args, prefix_targets=prefix, prefix_weight=w_p)
    steps = e5m2_steps_apart(g8, ref_g8)
    assert steps.max() <= 1 and steps.bool().float().mean() < 0.02
    assert torch.equal(fp8_bits(g8_t), fp8_bits(g8).t())
    assert ((losses - ref_losses).abs() <= 0.1 * (1.75 + 0.25) + 1e-3 * ref_losses.abs()).all()
    plain = tk.softcapped_mtp_ce_fp8_triton(*args)
    zero = tk.softcapped_mtp_ce_fp8_triton(*args, prefix, torch.zeros(1, device="cuda"))
    assert torch.equal(zero[0], plain[0]) and torch.equal(fp8_bits(zero[1]), fp8_bits(plain[1]))
    assert (losses - plain[0])[prefix >= 0].min() > 0


def test_train_fp8_gradient_saturates_in_hardware_as_in_the_bits():
    """With a tiny s_g many gradients pass 57344: the e5m2 output (hardware cvt.rn.satfinite) saturates exactly as
    the fp32 output's rounding through the bits does, and equals the reference's clamp-then-cast."""
    n, V = 512, 50304
    logits, targets = _train_case(n, V, 41)
    w = torch.tensor([1.0, 0.5, 0.25], device="cuda")
    _, lse = tk.softcapped_mtp_ce_train_fwd_triton(logits, targets, w)
    q8, _ = tk.softcapped_mtp_ce_fp8_grad_triton(logits, targets, w, lse, 1.0, 1e-8)
    q32, _ = tk.softcapped_mtp_ce_fp8_grad_triton(logits, targets, w, lse, 1.0, 1e-8, out_dtype=torch.float32)
    assert (q32.abs() == 57344).sum() > 1000 and torch.isfinite(q8.float()).all()
    assert torch.equal(q8.float(), q32)


def test_train_fp8_gradient_payload_is_the_same_for_every_grad_accum():
    logits, targets = _train_case(300, 50304, 43)
    w = torch.tensor([1.0, 0.5, 0.25], device="cuda")
    outs = [tk.softcapped_mtp_ce_fp8_triton(logits, targets, w, 1 / a, 0.75 / 448 / a)[1] for a in (1, 2, 4, 8)]
    assert all(torch.equal(fp8_bits(o), fp8_bits(outs[0])) for o in outs)


def test_train_fp8_gradient_past_2_31_elements():
    """43,000 rows x 50,304 pass 2**31 elements, where 32-bit offsets would wrap: the last rows (tail rule) and
    their transposed columns against the reference of those rows."""
    n, V = 43000, 50304
    logits, targets = _train_case(n, V, 47)
    w = torch.tensor([1.0, 0.5, 0.25], device="cuda")
    losses, g8, g8_t = tk.softcapped_mtp_ce_fp8_triton(logits, targets, w, 1.0, 0.75 / 448)
    ref_losses, ref_g8, _ = tk.softcapped_mtp_ce_fp8_reference(logits[-64:], targets[-64:], w, 1.0, 0.75 / 448)
    assert e5m2_steps_apart(g8[-64:], ref_g8).max() <= 1
    assert torch.equal(fp8_bits(g8_t[:, -64:]), fp8_bits(g8[-64:]).t())
    assert ((losses[-64:] - ref_losses).abs() <= 0.2 + 1e-3 * ref_losses.abs()).all()


def test_train_backward_without_fp8_bf16():
    """The plain training backward (use_fp8=False on a GPU): bf16 dlogits of the incoming gradient, against the
    reference's."""
    n, V = 512, 50304
    logits, targets = _train_case(n, V, 53)
    logits.requires_grad_(True)
    w = torch.tensor([1.0, 0.5, 0.25], device="cuda")
    losses = tk.softcapped_mtp_ce_train_triton(logits, targets, w)
    (d,) = torch.autograd.grad(losses.sum() / 8, logits)
    ref = tk.softcapped_mtp_ce_train_reference(logits, targets, w)
    (d_ref,) = torch.autograd.grad(ref.sum() / 8, logits)
    assert d.dtype == torch.bfloat16 and rel_err(d, d_ref) < BF16_TOL
    assert rel_err(losses, ref) < 1e-3


@triton.jit
def _rcp_fma_kernel(d_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tk._rcp_fma(tl.load(d_ptr + offs, mask=offs < n)), mask=offs < n)


def test_cross_entropy_reciprocal_on_the_fma_pipe():
    """The eval cross entropy's reciprocal of d = 1 + 2^t >= 1, on CUDA: within 0.501 ulp of 1/d up to 2^125, 0.6 ulp
    up to 2^126, 2^-126 above, NaN for NaN. Inputs: every 61st fp32 in [1, 4) (the error pattern repeats every
    binade), 2^20 randoms up to 2^127 and the edges."""
    first, last = torch.tensor([1.0, 4.0]).view(torch.int32).tolist()
    dense = torch.arange(first, last, 61, dtype=torch.int32).view(torch.float32)
    g = torch.Generator().manual_seed(0)
    rand = torch.exp2(torch.rand(2 ** 20, generator=g, dtype=torch.float64) * 127).float()
    edges = torch.tensor([1.0, 2.0 ** 126 * (1 - 2 ** -24), 2.0 ** 126, 2.0 ** 126 * (1 + 2 ** -23), 2.0 ** 127,
                          float("inf"), float("nan")])
    d = torch.cat([dense, rand, edges]).cuda()
    out = torch.empty_like(d)
    _rcp_fma_kernel[(triton.cdiv(d.numel(), 1024),)](d, out, d.numel(), BLOCK=1024)
    low, top = rcp_fma_ulp_errors(d, out)
    assert low <= 0.501 and top <= 0.6, (low, top)
    above = d > 2.0 ** 126
    assert above.sum() > 1000 and (out[above] == 2.0 ** -126).all()
    assert out[d.isnan()].isnan().all()


def test_compiled_fp8_quantiser_multiplies_by_the_reciprocal():
    """The trainer's compiled FP8 quantisers (train_gpt._quantize_act/_weight) see the scale as a constant and
    multiply by its fp32 reciprocal; the fused gradient quantiser does the same, so the FP8 head's math is one
    formula. If torch changes this, the message says which formula the compiled one follows."""
    x = (torch.randn(4096, 4096, device="cuda", generator=gen(22)) * 0.02).bfloat16()
    compiled = torch.compile(lambda t, s: tg.fp8_quantize(t, s, torch.float8_e5m2), dynamic=False, fullgraph=True)
    got = fp8_bits(compiled(x, S_G))
    lim = 57344.0
    recip = fp8_bits((x.float() * torch.tensor(1 / S_G, device="cuda")).clamp(-lim, lim).to(torch.float8_e5m2))
    div = fp8_bits((x.float() / S_G).clamp(-lim, lim).to(torch.float8_e5m2))
    assert torch.equal(got, recip), (f"compiled quantiser differs from x * fp32(1/s) at {int((got != recip).sum())} "
                                     f"elements and from IEEE x / s at {int((got != div).sum())}")
    assert torch.equal(fp8_bits(tg.fp8_quantize(x, S_G, torch.float8_e5m2)), recip)  # the eager formula too


# Post-only form (record 87) and the FP8 down projection (record 89)

@pytest.mark.parametrize("M", [3 * 1024 + 37, 16384])
def test_post_only_kernels_are_record_84s_forward_and_the_sqrt_backward(M):
    """The post-only forward writes record 84's post bit for bit (bf16 and FP8 up projections, with and without
    emission); the sqrt backward equals the reference's rule, bf16(2 bf16(g @ c_proj.T) sqrt(post)), but for rare
    one-ulp flips (cuBLAS's bf16(g @ c_proj.T) and the approximate root)."""
    x, c_fc, c_proj = (t.detach() for t in mlp_inputs(M, 21))
    _, post_old = tk.relu2_mlp_fwd_triton(x, c_fc)
    post = tk.relu2_mlp_post_fwd_triton(x, c_fc)
    assert torch.equal(post, post_old)
    x8, w8, q = tk._fp8_up_operands(x, c_fc)
    _, post8_old = tk.relu2_mlp_fp8_fwd_triton(x8, w8, q)
    assert torch.equal(tk.relu2_mlp_fp8_post_fwd_triton(x8, w8, q)[0], post8_old)
    assert torch.equal(tk.relu2_mlp_fp8_post_fwd_triton(x8, w8, q, torch.ones(1, device="cuda"))[0], post8_old)
    g = torch.randn(M, 768, device="cuda", generator=gen(22)).bfloat16()
    dpre = tk.relu2_mlp_sqrt_bwd_triton(g, c_proj, post)
    want = tk.relu2_sqrt_post_dpre_reference(g @ c_proj.T, post)
    assert (dpre != want).float().mean().item() < 1e-2 and rel_err(dpre, want) < BF16_TOL
    assert (dpre[post == 0] == 0).all()


@pytest.mark.parametrize("M", FP8_MICRO_BATCHES)
def test_fp8_emission_matches_the_reference_and_the_maxima_reduce_to_the_max(M):
    """post8 = e4m3(min(post * (1 / a), 448)) by the hardware conversion (Triton's division may flip a rare
    rounding), and the per-SM maxima reduce to exactly max(post): every entry of the buffer is written."""
    x, c_fc, _ = (t.detach() for t in mlp_inputs(M, 23))
    x8, w8, q = tk._fp8_up_operands(x, c_fc)
    a = torch.tensor([0.02], device="cuda")
    post, post8, amax = tk.relu2_mlp_fp8_post_fwd_triton(x8, w8, q, a)
    assert post8.dtype == torch.float8_e4m3fn and amax.shape == (tk._num_programs_persistent(x.device),)
    want = tk.quantize_post_reference(post, a)
    assert (fp8_bits(post8) != fp8_bits(want)).float().mean().item() < 1e-4
    assert amax.max().item() == post.float().max().item() and (amax > 0).all()
    for f in (tk.fp8_scales_from_partial_amax_triton, tk.fp8_scales_from_partial_amax_reference):
        assert f(amax[None], tk.FP8_DOWN_ACT_FACTOR).item() == tk.fp8_scales_from_partial_amax_reference(
            post.float().amax().reshape(1, 1), tk.FP8_DOWN_ACT_FACTOR).item()


def test_down_weight_quantiser_matches_its_reference_at_the_records_shapes():
    """12 slots of 3072 x 768 in 576 tiles each: W2_8 equals the reference's but for rare flips from the
    approximate division, and the next scales from the tile maxima equal the reference's exactly (a max)."""
    g = gen(24)
    w2 = (torch.randn(12, 3072, 768, device="cuda", generator=g) * 0.02).bfloat16()
    w2[11] = 0                                                     # the padding slot
    c = tk.fp8_bootstrap_weight_scales(w2)
    w8t, tile_amax = tk.quantize_down_weight_t_triton(w2, c)
    ref8t, ref_amax = tk.quantize_down_weight_t_reference(w2, c)
    assert w8t.shape == (12, 768, 3072) and tile_amax.shape == (12, 576)
    assert (fp8_bits(w8t) != fp8_bits(ref8t)).float().mean().item() < 1e-5
    f = tk.FP8_DOWN_WEIGHT_FACTOR
    assert torch.equal(tk.fp8_scales_from_partial_amax_triton(tile_amax, f),
                       tk.fp8_scales_from_partial_amax_reference(ref_amax, f))
    fused = tk.Fp8DownState(8, 11, 12, "cuda")
    plain = tk.Fp8DownState(8, 11, 12, "cuda")
    for s in (None, 0, 15, 16, 17):
        fused.refresh_weights(w2, tk.fp8_down_bootstraps(s), fused=True)
        plain.refresh_weights(w2, tk.fp8_down_bootstraps(s), fused=False)
        assert all(torch.equal(u, v) for u, v in zip(fused.state_dict().values(), plain.state_dict().values())), s


@pytest.mark.parametrize("M", FP8_MICRO_BATCHES)
def test_fp8_down_mlp_matches_its_reference_and_backward_is_the_post_only_one(M):
    """torch._scaled_mm with fast accumulation against the fp32-summed reference (bf16 tolerance), the amax, and
    gradients equal to the post-only MLP's (straight through the FP8 copies)."""
    x, c_fc, c_proj = mlp_inputs(M, 25)
    state = tk.Fp8DownState(8, 11, 12, "cuda")
    state.refresh_weights(torch.stack([c_proj.detach()] * 12), bootstrap=True, fused=True)
    state.act_scales[3, 5] = 0.01
    ops = state.down_operands(3, 5)
    out, amax = tk.relu2_mlp_fp8_down_triton(x, c_fc, c_proj, *ops)
    ref, ref_amax = tk.relu2_mlp_fp8_down_reference(x, c_fc, c_proj, *ops)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < BF16_TOL
    post = tk.relu2_mlp_fp8_post_fwd_triton(*tk._fp8_up_operands(x.detach(), c_fc.detach()))[0]
    assert amax.max().item() == post.float().max().item()
    assert abs(ref_amax.item() / amax.max().item() - 1) < 2 ** -7           # the reference sums in another order
    grad = torch.randn_like(out)
    post_only = tk.relu2_mlp_post_triton(x, c_fc, c_proj, fp8=True)
    for name, u, v in zip(("dx", "dc_fc", "dc_proj"), torch.autograd.grad(out, (x, c_fc, c_proj), grad),
                          torch.autograd.grad(post_only, (x, c_fc, c_proj), grad)):
        assert torch.equal(u, v), name
    state.update_act_scales(3, torch.stack([amax] * 11), fused=True)
    assert state.act_scales[3, 0].item() == tk.fp8_scales_from_partial_amax_reference(
        post.float().amax().reshape(1, 1), tk.FP8_DOWN_ACT_FACTOR).item()
    assert (state.act_scales[[0, 1, 2, 4, 5, 6, 7]] == 1).all(), "other slices' chains do not move"


# ------------------------------------------------------------------------------------------------------------------
# torch.compile: one graph, no break, no recompile
# ------------------------------------------------------------------------------------------------------------------

def compile_counters():
    from torch._dynamo.utils import counters
    return counters


def fresh_compile(fn):
    torch._dynamo.reset()
    compile_counters().clear()
    return torch.compile(fn, fullgraph=True)


def assert_one_graph():
    counters = compile_counters()
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    assert counters["stats"]["unique_graphs"] == 1, f"compiled {counters['stats']['unique_graphs']} graphs"


POLAR_COEFFS = [(-22.48329292557795, 15.878769915207462), (-2.808917465908714, 0.5000178451051316)]


def test_compile_symmetric_ops_two_scalar_pairs():
    def polar_like(X):
        outs = []
        for b, c in POLAR_COEFFS:  # two different (b, c) pairs through the same kernel in one graph
            A = tk.xxt(X)
            outs.append(tk.ba_plus_cAA(A, b, c))
        return outs

    compiled = fresh_compile(polar_like)
    for seed in (6, 7):  # second call with new data must reuse the graph
        X = torch.randn(5, 768, 768, device="cuda", generator=gen(seed)).bfloat16() / 768
        for out, (b, c) in zip(compiled(X), POLAR_COEFFS):
            A64 = tk.xxt(X).double()
            assert rel_err(out, c * A64 @ A64 + b * A64) < BF16_TOL
    assert_one_graph()


def test_compile_relu2_mlp_forward_backward():
    def step(x, c_fc, c_proj, grad):
        out = tk.relu2_mlp_triton(x, c_fc, c_proj)
        return (out * grad).sum()

    compiled = fresh_compile(step)
    for seed in (8, 9):
        x, c_fc, c_proj = mlp_inputs(1024, seed)
        grad = torch.randn(1024, 768, device="cuda", generator=gen(seed)).bfloat16()
        compiled(x, c_fc, c_proj, grad).backward()
        eager = [t.detach().clone().requires_grad_() for t in (x, c_fc, c_proj)]
        step(*eager, grad).backward()
        for got, want in zip((x, c_fc, c_proj), eager):
            assert rel_err(got.grad, want.grad) < BF16_TOL
    assert_one_graph()


def test_compile_fp8_down_mlp_one_graph():
    """The record-89 MLP with its scale update traces into one graph and matches eager."""
    state = tk.Fp8DownState(8, 11, 12, "cuda")

    def step(x, c_fc, c_proj, grad):
        out, amax = tk.relu2_mlp_fp8_down_triton(x, c_fc, c_proj, *state.down_operands(2, 0))
        state.update_act_scales(2, amax.expand(11, -1), fused=True)
        return (out * grad).sum()

    compiled = fresh_compile(step)
    for seed in (26, 27):
        x, c_fc, c_proj = mlp_inputs(2048, seed)
        state.refresh_weights(torch.stack([c_proj.detach()] * 12), bootstrap=True, fused=True)
        grad = torch.randn(2048, 768, device="cuda", generator=gen(seed)).bfloat16()
        before = state.act_scales.clone()
        compiled(x, c_fc, c_proj, grad).backward()
        after = state.act_scales.clone()
        state.act_scales.copy_(before)
        eager = [t.detach().clone().requires_grad_() for t in (x, c_fc, c_proj)]
        step(*eager, grad).backward()
        assert torch.equal(after, state.act_scales)
        for got, want in zip((x, c_fc, c_proj), eager):
            assert rel_err(got.grad, want.grad) < BF16_TOL
    assert_one_graph()


def test_compile_training_ce_ops_new_weight_values():
    """The FP8 training op and the plain training loss compile to one graph each that new weight values of the same
    length reuse, with the eager kernels' numbers."""
    def fp8_loss(logits, targets, w):
        return tk.softcapped_mtp_ce_fp8_triton(logits, targets, w, 0.125, 0.125 * S_G)

    compiled = fresh_compile(fp8_loss)
    n, V = 256, 50304
    for seed, weights in [(10, [1.0, 0.5, 0.25]), (11, [1.0, 0.25, 0.0625])]:  # same length, new values
        logits, targets = _train_case(n, V, seed)
        w = torch.tensor(weights, device="cuda")
        got, want = compiled(logits, targets, w), fp8_loss(logits, targets, w)
        assert torch.equal(got[0], want[0]) and all(torch.equal(fp8_bits(a), fp8_bits(b))
                                                    for a, b in zip(got[1:], want[1:]))
    assert_one_graph()

    def plain_loss(logits, targets, w):
        return tk.softcapped_mtp_ce_train_triton(logits, targets, w).sum() / 8

    compiled = fresh_compile(plain_loss)
    for seed, weights in [(12, [1.0, 0.5, 0.25]), (13, [1.0, 0.25, 0.0625])]:
        logits, targets = _train_case(n, V, seed)
        logits.requires_grad_(True)
        w = torch.tensor(weights, device="cuda")
        compiled(logits, targets, w).backward()
        (want,) = torch.autograd.grad(plain_loss(logits, targets, w), logits)
        assert torch.equal(logits.grad, want)
    assert_one_graph()


# ------------------------------------------------------------------------------------------------------------------
# Optimizer updates (triton_kernels.py sections 5-7): bitwise the eager code on the same CUDA tensors
# ------------------------------------------------------------------------------------------------------------------

def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.uint16: torch.int16}[t.dtype])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    diff = bits_of(got) != bits_of(want)
    assert not diff.any(), (f"{what}: {int(diff.sum())} of {diff.numel()} elements differ, e.g. "
                            f"{got[diff][:4].tolist()} vs {want[diff][:4].tolist()}")


ADAM_GPU_KW = dict(beta1=0.5, beta2=0.95, eps=1e-10, step_size=0.0123, decay=0.005 * 150 * 0.0123 ** 2)


def adam_gpu_state(shape, dtype, seed):
    """Trainer-like magnitudes plus the edge cases: zero update (g = m = 0), zero gradient, p = +-0 with a -0
    update, subnormal second moments, a NaN and an infinite gradient."""
    g = gen(seed)
    p = (torch.randn(shape, device="cuda", generator=g) * 0.05).to(dtype)
    grad = (torch.randn(shape, device="cuda", generator=g) * 1e-3).to(dtype)
    m = torch.randn(shape, device="cuda", generator=g) * 1e-4
    v = torch.rand(shape, device="cuda", generator=g) * 1e-6
    fp, fg, fm, fv = (t.view(-1) for t in (p, grad, m, v))
    if fp.numel() < 16:
        return p, grad, m, v
    fg[:8] = 0
    fm[:4] = 0
    fp[4], fp[5] = 0.0, -0.0
    fg[4:6], fm[4:6] = -0.0, -0.0
    fv[6:8], fm[6:8] = 1e-39, 1e-30
    fg[8], fg[9] = float("nan"), float("inf")
    return p, grad, m, v


@pytest.mark.parametrize("shape, dtype", [((50304, 768), torch.bfloat16), ((768, 50304), torch.bfloat16),
                                          ((1000, 37), torch.float32), ((7,), torch.bfloat16)])
def test_adam_update_is_bitwise_eager_cuda(shape, dtype):
    """Kernel, eager reference and train_gpt.adam_update (with a GPU run's op table: the kernel): same bits,
    NaNs included (CUDA writes a NaN to bf16 as 0x7FFF)."""
    import functools

    p, grad, m, v = adam_gpu_state(shape, dtype, 20)
    runs = {}
    train_gpt_update = functools.partial(tg.adam_update, ops=tg.kernel_ops("fused", "cuda"))
    for name, fn in [("kernel", tk.adam_update), ("eager", tk.adam_update_reference), ("train_gpt", train_gpt_update)]:
        state = [t.clone() for t in (p, m, v)]
        fn(state[0], grad, state[1], state[2], **ADAM_GPU_KW)
        runs[name] = state
    for name in ("kernel", "train_gpt"):
        for what, got, want in zip(("param", "exp_avg", "exp_avg_sq"), runs[name], runs["eager"]):
            assert_same_bits(got, want, f"{name} {what}")
    assert not torch.equal(runs["kernel"][0], p)


def test_adam_eager_cuda_rounds_like_the_kernel_comment_says():
    """Documents the order the kernel copies (tests/_fp32_exact.adam_cuda_order): add_(alpha) is one FMA, addcmul_
    rounds g*g and then one FMA. If a torch release changes this, the bitwise test above fails with it."""
    from _fp32_exact import adam_cuda_order
    p, grad, m, v = adam_gpu_state((4096, 257), torch.bfloat16, 21)
    grad.view(-1)[8:10] = 0    # finite values only: the transcription's bf16 NaN is the CPU's 0x7FC0
    want = adam_cuda_order(p, grad, m, v, **ADAM_GPU_KW)
    eager = [t.clone() for t in (p, m, v)]
    tk.adam_update_reference(eager[0], grad, eager[1], eager[2], **ADAM_GPU_KW)
    for what, got, w in zip(("param", "exp_avg", "exp_avg_sq"), eager, want):
        assert_same_bits(got, w, what)


def cautious_gpu_state(n, R, C, transposed_o, seed):
    g = gen(seed)
    param = (torch.randn(n, R, C, device="cuda", generator=g) * 0.02).bfloat16()
    mantissa = torch.randint(0, 1 << 16, (n, R, C), device="cuda", generator=g, dtype=torch.int32).to(torch.uint16)
    if transposed_o:  # NorMuon hands over the MLP bank's O as a transposed view
        O = torch.randn(n, C, R, device="cuda", generator=g).bfloat16().mT
    else:
        O = torch.randn(n, R, C, device="cuda", generator=g).bfloat16()
    O[:, :2] = 0                                   # decayed (non-strict mask)
    param[:, 2, :8], mantissa[:, 2, :4] = 0.0, 0   # P = +0 and subnormal masters
    return param, mantissa, O


@pytest.mark.parametrize("n, R, C, transposed_o, per_matrix_lr", [
    (40, 768, 768, False, False), (24, 3072, 768, True, True), (3, 100, 37, False, True), (2, 65, 130, True, False)])
def test_cautious_update_with_mantissa_is_bitwise_eager_cuda(n, R, C, transposed_o, per_matrix_lr):
    param, mantissa, O = cautious_gpu_state(n, R, C, transposed_o, 22)
    lr = (torch.rand(n, 1, 1, device="cuda", generator=gen(23)) * 0.05) if per_matrix_lr else 0.0123
    wd = 0.023 * 1.2
    runs = {}
    for name, fn in [("kernel", lambda p, m: tk.cautious_update_with_mantissa(p, m, O, lr=lr, wd=wd)),
                     ("eager", lambda p, m: tk.cautious_update_with_mantissa_reference(p, m, O, lr, wd)),
                     ("train_gpt", lambda p, m: tg.kernel_ops("fused", "cuda").cautious_update(p, m, O, lr=lr,
                                                                                                  wd=wd))]:
        p, m = param.clone(), mantissa.clone()
        fn(p, m)
        runs[name] = (p, m)
    for name in ("kernel", "train_gpt"):
        assert_same_bits(runs[name][0], runs["eager"][0], f"{name} param")
        assert_same_bits(runs[name][1], runs["eager"][1], f"{name} mantissa")
    assert not torch.equal(bits_of(runs["kernel"][1]), bits_of(mantissa))


@pytest.mark.parametrize("n, R, C, momentum", [(40, 768, 768, 0.95), (24, 3072, 768, 0.85), (3, 100, 37, 0.3)])
def test_normuon_momentum_is_bitwise_eager_cuda(n, R, C, momentum):
    """Kernel and eager lerps (CUDA's, contracted by nvcc) give the same bits, signed zeros included; 0.3 takes the
    other branch of both lerps."""
    g = gen(29)
    grad = (torch.randn(n, R, C, device="cuda", generator=g) * 1e-3).bfloat16()
    M = torch.randn(n, R, C, device="cuda", generator=g) * 1e-3
    grad.view(-1)[:4], M.view(-1)[:2] = 0.0, 0.0
    grad.view(-1)[4], M.view(-1)[4] = -0.0, -0.0
    runs = {}
    for name, fn in [("kernel", tk.normuon_momentum), ("eager", tk.normuon_momentum_reference)]:
        m = M.clone()
        runs[name] = (m, fn(grad, m, momentum))
    assert_same_bits(runs["kernel"][0], runs["eager"][0], "momentum buffer")
    assert_same_bits(runs["kernel"][1], runs["eager"][1], "look-ahead X")
    assert not torch.equal(runs["kernel"][0], M)


@pytest.mark.parametrize("n, R, C, transposed_x", [(24, 768, 3072, True), (24, 768, 3072, False),
                                                   (3, 100, 37, True)])
def test_polar_split_product_is_bitwise_eager_cuda(n, R, C, transposed_x):
    """Every coefficient a of Polar Express: the kernel's FMA is eager CUDA's add_(X, alpha=a)."""
    g = gen(30)
    y = torch.randn(n, R, C, device="cuda", generator=g).bfloat16()
    x = (torch.randn(n, C, R, device="cuda", generator=g).bfloat16().mT if transposed_x
         else torch.randn(n, R, C, device="cuda", generator=g).bfloat16())
    for a, _, _ in tg.POLAR_EXPRESS_COEFFS:
        got = tk.polar_split_product_(y.clone(), x, a)
        assert_same_bits(got, tk.polar_split_product_reference(y.clone(), x, a), f"a={a}")


def test_normuon_glue_scalars_do_not_recompile_the_kernels():
    """The momentum (scheduled per step) and Polar Express's a are runtime fp32 arguments."""
    grad = torch.randn(2, 64, 64, device="cuda").bfloat16()
    M = torch.zeros(2, 64, 64, device="cuda")
    y, x = grad.clone(), grad.clone()
    tk.normuon_momentum(grad, M, 0.85)
    tk.polar_split_product_(y, x, 2.5)
    caches = [getattr(k, "device_caches", None) for k in (tk._normuon_momentum_kernel, tk._split_product_kernel)]
    sizes = [None if c is None else [len(e[0]) for e in c.values()] for c in caches]
    tk.normuon_momentum(grad, M, 0.93)
    tk.polar_split_product_(y, x, 3.25)
    for c, size in zip(caches, sizes):
        if c is not None:
            assert [len(e[0]) for e in c.values()] == size, "new scalars compiled a new kernel"


def test_optimizer_scalars_do_not_recompile_the_kernels():
    p, grad, m, v = adam_gpu_state((512, 768), torch.bfloat16, 24)
    param, mantissa, O = cautious_gpu_state(2, 256, 256, False, 25)
    tk.adam_update(p, grad, m, v, **ADAM_GPU_KW)
    tk.cautious_update_with_mantissa(param, mantissa, O, lr=0.01, wd=0.02)
    caches = [getattr(k, "device_caches", None) for k in (tk._adam_kernel, tk._cautious_mantissa_kernel)]
    sizes = [None if c is None else [len(x[0]) for x in c.values()] for c in caches]
    tk.adam_update(p, grad, m, v, beta1=0.9, beta2=0.99, eps=1e-8, step_size=0.5, decay=0.0)
    tk.cautious_update_with_mantissa(param, mantissa, O, lr=0.03, wd=0.0)
    for c, s in zip(caches, sizes):
        if c is not None:
            assert [len(x[0]) for x in c.values()] == s, "new scalars compiled a new kernel"


def master_of(param: torch.Tensor, mantissa: torch.Tensor) -> torch.Tensor:
    """The fp32 master (bf16 bits << 16) | mantissa."""
    return ((bits_of(param).int() << 16) | (bits_of(mantissa).int() & 0xFFFF)).view(torch.float32)


def test_compile_optimizer_ops_one_graph():
    """Both ops trace into one graph with no break. torch.compile does not pass enable_fp_fusion=False on to
    user-defined kernels, so the compiled kernels may contract a product into an add: within an fp32 rounding of
    eager, not necessarily bitwise (train_gpt runs them eagerly)."""
    def step(p, grad, m, v, param, mantissa, O, lr):
        tk.adam_update(p, grad, m, v, **ADAM_GPU_KW)
        tk.cautious_update_with_mantissa(param, mantissa, O, lr=lr, wd=0.0276)

    compiled = fresh_compile(step)
    lr = torch.rand(4, 1, 1, device="cuda", generator=gen(26)) * 0.05
    for seed in (27, 28):
        p, grad, m, v = adam_gpu_state((1024, 768), torch.bfloat16, seed)
        grad.view(-1)[8:10] = 0
        param, mantissa, O = cautious_gpu_state(4, 768, 256, True, seed)
        eager = [t.clone() for t in (p, m, v, param, mantissa)]
        P0 = master_of(param, mantissa).double()
        step(eager[0], grad, eager[1], eager[2], eager[3], eager[4], O, lr)
        compiled(p, grad, m, v, param, mantissa, O, lr)
        assert_same_bits(m, eager[1], "exp_avg")
        assert_same_bits(v, eager[2], "exp_avg_sq")
        assert ((bits_of(p).int() - bits_of(eager[0]).int()).abs() <= 1).all()   # one bf16 rounding apart at most
        master, master_eager = master_of(param, mantissa), master_of(eager[3], eager[4])
        # a contracted product skips one fp32 rounding of a term: within 2^-23 of the terms' magnitudes
        terms = P0.abs() * (1 + 0.0276 * lr.double()) + (O.double() * lr.double()).abs()
        assert ((master.double() - master_eager.double()).abs() <= 2 ** -23 * terms).all()
        print(f"compiled vs eager: param bits equal {torch.equal(bits_of(p), bits_of(eager[0]))}, master bits "
              f"equal {torch.equal(bits_of(master), bits_of(master_eager))}")
    assert_one_graph()
