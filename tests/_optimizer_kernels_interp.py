"""Interpreter checks of the optimizer kernels, triton_kernels.py sections 5-7 (run by tests/test_optimizer_kernels.py
in a subprocess with TRITON_INTERPRET=1).

Both kernels keep every value either in fp32 registers or as raw bits: bf16 and uint16 are loaded and stored as
integers (the interpreter's own fp32 -> bf16 cast truncates, so the kernels round to bf16 with integer operations),
and the interpreter's fp32 arithmetic is numpy's, correctly rounded per operation, with a true fma. So these tests use
real bf16/uint16 storage and compare BITS (signed zeros included):
  Adam: against tests/_fp32_exact.adam_cuda_order, the eager code in CUDA's operation order (exact fp32 fma), and
        against a float64 transcription within the rounding of fp32 arithmetic; against the CPU eager reference it
        differs by one ulp of exp_avg_sq where CPU rounds (value*g)*g instead of value*(g*g).
  Cautious: against the eager reference (bitwise: the same seven fp32 operations, no FMA anywhere) and a float64
        transcription.
  Momentum and split product: against an exact fp32 transcription of CUDA's lerp and add_(alpha) (one FMA each), and
        against the CPU eager reference within one ulp (whether the CPU's eager kernels fuse depends on the build).
"""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/test_optimizer_kernels.py, which sets TRITON_INTERPRET=1", allow_module_level=True)

import triton_kernels as tk  # noqa: E402
from _fp32_exact import adam_cuda_order, f32, fma32  # noqa: E402

F64 = torch.float64
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.uint16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.dtype])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    diff = bits(got) != bits(want)
    assert not diff.any(), (f"{what}: {int(diff.sum())} of {diff.numel()} elements differ, e.g. "
                            f"{got[diff][:4].tolist()} vs {want[diff][:4].tolist()}")


# ------------------------------------------------------------------------------------------------------------------
# Section 5: Adam
# ------------------------------------------------------------------------------------------------------------------

ADAM_KW = dict(beta1=0.9, beta2=0.95, eps=1e-10, step_size=0.0123, decay=0.3)


def adam_inputs(shape, param_dtype, grad_dtype, seed):
    """Random state with edge cases first: zero gradient and moment (update exactly 0: the strict mask must not decay
    it), zero gradient only, p = +0 and -0 with a -0 update, and second moments in the subnormal range."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(shape, generator=g) * 0.1
    grad = torch.randn(shape, generator=g) * 1e-2
    m = torch.randn(shape, generator=g) * 1e-3
    v = torch.rand(shape, generator=g) * 1e-4
    flat = [t.view(-1) for t in (p, grad, m, v)]
    if flat[0].numel() >= 16:
        fp, fg, fm, fv = flat
        fg[0:4] = 0
        fm[0:4] = 0                      # u == 0 exactly
        fg[4:6] = 0                      # no gradient, moment decays
        fp[6], fp[7] = 0.0, -0.0         # u*p == 0: never decayed; with g = m = -0 the update is u = -0, and eager
        fg[6:8] = -0.0                   # gives -0 - (u + decay*p*0) = -0 - (-0) = +0 for p = -0 (a where() in place
        fm[6:8] = -0.0                   # of the multiply by the mask would keep -0)
        fv[8:10] = 1e-39                 # subnormal second moment (rows of tokens that stopped appearing)
        fm[8:10] = 1e-30
        fg[8:10] = 0
    return p.to(param_dtype), grad.to(grad_dtype), m, v


def run_adam(p, grad, m, v, block=None, op=False, **kw):
    kw = {**ADAM_KW, **kw}
    p, m, v = p.clone(), m.clone(), v.clone()
    if op:
        torch.ops.nanogpt_kernels.adam_update(p, grad, m, v, kw["beta1"], kw["beta2"], kw["eps"], kw["step_size"],
                                              kw["decay"])
    else:
        tk.adam_update_triton(p, grad, m, v, block=block, **kw)
    return p, m, v


ADAM_SHAPES = [((37, 13), 64), ((5,), 64), ((2, 64), 64), ((3, 50), 16), ((), 64)]  # tails, exact blocks, 0-dim


@pytest.mark.parametrize("shape, block", ADAM_SHAPES)
@pytest.mark.parametrize("param_dtype, grad_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                     (torch.bfloat16, torch.float32)])
def test_adam_kernel_is_bitwise_the_eager_update_in_cuda_order(shape, block, param_dtype, grad_dtype):
    p, grad, m, v = adam_inputs(shape, param_dtype, grad_dtype, seed=len(shape) * 100 + block)
    got = run_adam(p, grad, m, v, block=block)
    want = adam_cuda_order(p, grad, m, v, **ADAM_KW)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, want):
        assert_same_bits(a, b, name)
    if p.numel() >= 16:
        assert torch.equal(bits(got[0].view(-1)[:4]), bits(p.view(-1)[:4])), "a zero update was decayed"
        assert (got[2].view(-1)[8:10] < torch.finfo(torch.float32).tiny).all() and (got[2].view(-1)[8:10] > 0).all()
        assert not torch.equal(got[0], p), "nothing was updated"


def test_adam_kernel_matches_float64_transcription():
    """fp32 rounding only: m and v within a few ulps of their terms, the parameter within one ulp of the float64
    result plus the fp32 error of the update (as tests/test_optimizer.py bounds the eager code)."""
    p, grad, m, v = adam_inputs((41, 23), torch.float32, torch.float32, seed=5)
    pk, mk, vk = run_adam(p, grad, m, v)
    b1, b2, eps, k, lam = (ADAM_KW[x] for x in ("beta1", "beta2", "eps", "step_size", "decay"))
    g64, m64, v64, p64 = (t.to(F64) for t in (grad, m, v, p))
    m_ref = b1 * m64 + (1 - b1) * g64
    v_ref = b2 * v64 + (1 - b2) * g64 * g64
    u = m_ref / (v_ref.sqrt() + eps) * k
    u = u + lam * p64 * (u * p64 > 0)
    p_ref = p64 - u
    U = 2.0 ** -24
    assert ((mk.to(F64) - m_ref).abs() <= 2 * U * (b1 * m64.abs() + (1 - b1) * g64.abs()) + 1e-45).all()
    assert ((vk.to(F64) - v_ref).abs() <= 3 * U * (b2 * v64 + (1 - b2) * g64 * g64) + 1e-45).all()
    m_rel = U * (b1 * m64.abs() + (1 - b1) * g64.abs()) / m_ref.abs().clamp_min(1e-30)
    tol = U * p_ref.abs() + (p64 - p_ref).abs() * (8 * U + m_rel)
    assert ((pk.to(F64) - p_ref).abs() <= tol).all()


def test_adam_kernel_against_cpu_eager_differs_only_in_the_addcmul_rounding():
    """The CPU eager reference rounds value*g before its FMA: exp_avg_sq at most one ulp off, the parameter (fp32)
    within a few ulps of the update. exp_avg is allowed one ulp too: whether CPU eager fuses `self + alpha*other`
    depends on the CPU kernels ATen dispatches to (vec::fmadd is a true FMA with AVX2/AVX-512, two roundings in the
    generic build), and this verdict must not depend on the machine."""
    p, grad, m, v = adam_inputs((37, 13), torch.float32, torch.float32, seed=8)
    pk, mk, vk = run_adam(p, grad, m, v)
    pr, mr, vr = p.clone(), m.clone(), v.clone()
    tk.adam_update_reference(pr, grad, mr, vr, **ADAM_KW)
    assert ((bits(mk) - bits(mr)).abs() <= 1).all(), "exp_avg more than one ulp from the CPU eager value"
    assert ((bits(vk) - bits(vr)).abs() <= 1).all(), "exp_avg_sq more than one ulp from the CPU eager value"
    assert ((pk.double() - pr.double()).abs() <= 4 * 2 ** -24 * ((p - pr).double().abs() + pr.double().abs())).all()


def test_adam_registered_op_takes_new_scalars_each_call():
    """torch.ops.nanogpt_kernels.adam_update runs the kernel; scalars are runtime values, so a second set of them
    gives its own result."""
    p, grad, m, v = adam_inputs((9, 11), torch.bfloat16, torch.bfloat16, seed=3)
    for kw in ({}, dict(beta1=0.5, beta2=0.99, eps=1e-8, step_size=0.25, decay=1e-3)):
        got = run_adam(p, grad, m, v, op=True, **kw)
        want = adam_cuda_order(p, grad, m, v, **{**ADAM_KW, **kw})
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, want):
            assert_same_bits(a, b, name)


def test_adam_nan_gradient_gives_cuda_canonical_bf16_nan():
    """A NaN reaching a bf16 parameter is stored as 0x7FFF (what CUDA's cvt.rn.bf16.f32, hence eager copy_ on CUDA,
    writes); infinities and finite values round to nearest even."""
    p = torch.tensor([0.5, -0.25, 1.0, 3e38], dtype=torch.bfloat16)
    grad = torch.tensor([float("nan"), 0.0, float("inf"), 0.0])
    m = torch.tensor([0.0, 0.0, 0.0, -1e30])
    v = torch.zeros(4)
    got, _, _ = run_adam(p, grad, m, v, step_size=1.0, decay=0.0)
    assert bits(got)[0].item() == 0x7FFF and bits(got)[2].item() == 0x7FFF    # inf/inf -> NaN
    want, _, _ = adam_cuda_order(p, grad, m, v, **{**ADAM_KW, "step_size": 1.0, "decay": 0.0})
    assert_same_bits(got[[1, 3]], want[[1, 3]], "finite / overflowing entries")


def test_adam_launcher_rejects_bad_input():
    p, g, m, v = torch.zeros(4, 6), torch.zeros(4, 6), torch.zeros(4, 6), torch.zeros(4, 6)
    with pytest.raises(ValueError, match="contiguous"):
        tk.adam_update_triton(p, g.T.contiguous().T, m, v, **ADAM_KW)
    with pytest.raises(ValueError, match="shape"):
        tk.adam_update_triton(p, g, m[:3], v, **ADAM_KW)
    with pytest.raises(ValueError, match="float32"):
        tk.adam_update_triton(p, g, m, v.double(), **ADAM_KW)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        tk.adam_update_triton(p.half(), g, m, v, **ADAM_KW)


# ------------------------------------------------------------------------------------------------------------------
# Section 6: NorMuon cautious update with mantissa
# ------------------------------------------------------------------------------------------------------------------

def master64(param, mantissa):
    """The fp32 master as float64, from integer arithmetic on the bits alone."""
    hi = param.view(torch.int16).to(torch.int64) & 0xFFFF
    lo = mantissa.view(torch.int16).to(torch.int64) & 0xFFFF
    return ((hi << 16) | lo).to(torch.int32).view(torch.float32).to(F64)


def cautious_inputs(n, R, C, layout, seed):
    """bf16 param, uint16 mantissa and bf16 O with the mask's edge cases: O = 0 rows (decayed: the mask is >=),
    P = +0 / -0 / a subnormal master (param bits 0 with a mantissa), and both signs of O*P."""
    g = torch.Generator().manual_seed(seed)
    param = torch.randn(n, R, C, generator=g).bfloat16()
    mantissa = torch.randint(0, 1 << 16, (n, R, C), generator=g, dtype=torch.int32).to(torch.uint16)
    O = torch.randn(n, R, C, generator=g).bfloat16()
    O[:, :2] = 0
    param[:, 3, :4] = 0.0
    mantissa[:, 3, :2] = 0                                   # P = +0 (cols 0-1), subnormal P (cols 2-3)
    param[:, 4, :2] = -0.0
    mantissa[:, 4, :2] = 0                                   # P = -0
    if layout == "transposed":                              # NorMuon's MLP-bank O: a transposed view
        O = O.mT.contiguous().mT
    elif layout == "strided":                               # every other column of a wider buffer
        wide = torch.zeros(n, R, 2 * C, dtype=torch.bfloat16)
        wide[:, :, ::2] = O
        O = wide[:, :, ::2]
    return param, mantissa, O


CAUTIOUS_CASES = [  # (n, R, C, tile): R, C not multiples of the tile; a tile larger than the matrix
    (3, 19, 21, (8, 16)),
    (2, 16, 32, (8, 16)),
    (2, 7, 5, (8, 16)),
]


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
@pytest.mark.parametrize("per_matrix_lr", [False, True])
@pytest.mark.parametrize("n, R, C, tile", CAUTIOUS_CASES)
def test_cautious_kernel_is_bitwise_the_eager_update(n, R, C, tile, per_matrix_lr, layout):
    param, mantissa, O = cautious_inputs(n, R, C, layout, seed=R * 100 + C)
    lr = torch.tensor([0.25, 0.0123, 2.0][:n], dtype=torch.float32).view(n, 1, 1) if per_matrix_lr else 0.0123
    wd = 0.9
    P0 = master64(param, mantissa)
    p_k, m_k = param.clone(), mantissa.clone()
    tk.cautious_update_with_mantissa_triton(p_k, m_k, O, lr, wd, tile=tile)
    p_r, m_r = param.clone(), mantissa.clone()
    tk.cautious_update_with_mantissa_reference(p_r, m_r, O, lr, wd)
    assert_same_bits(p_k, p_r, "param")
    assert_same_bits(m_k, m_r, "mantissa")
    # Independent float64 transcription: the same formula, each fp32 operation within one rounding.
    O64 = O.to(F64)
    lr64 = lr.to(F64) if per_matrix_lr else float(torch.tensor(lr))
    wd64 = float(torch.tensor(wd))
    keep = (O64 * P0 >= 0).to(F64)
    P_ref = (P0 - ((P0 * keep) * wd64) * lr64) - O64 * lr64
    got = master64(p_k, m_k)
    U = 2.0 ** -24
    tol = 3 * U * (P0.abs() * (1 + wd64 * lr64) + (O64 * lr64).abs()) + U * got.abs()
    assert ((got - P_ref).abs() <= tol).all()
    decayed = (O64 == 0) & (P0 != 0)
    assert (got[decayed].abs() < P0[decayed].abs()).all(), "O = 0 entries must be decayed toward 0"


def test_cautious_registered_and_public_ops():
    n, R, C = 2, 12, 10
    param, mantissa, O = cautious_inputs(n, R, C, "contiguous", seed=1)
    lr = torch.tensor([0.5, 0.125]).view(n, 1, 1)
    for lr_arg, call in [(lr, lambda p, m: torch.ops.nanogpt_kernels.cautious_update_with_mantissa(p, m, O, lr, 0.0,
                                                                                                    0.3)),
                         (0.0625, lambda p, m: torch.ops.nanogpt_kernels.cautious_update_with_mantissa(p, m, O, None,
                                                                                                       0.0625, 0.3))]:
        p_k, m_k = param.clone(), mantissa.clone()
        call(p_k, m_k)
        p_r, m_r = param.clone(), mantissa.clone()
        tk.cautious_update_with_mantissa_reference(p_r, m_r, O, lr_arg, 0.3)
        assert_same_bits(p_k, p_r, "param")
        assert_same_bits(m_k, m_r, "mantissa")


def test_cautious_launcher_rejects_bad_input():
    p = torch.zeros(2, 4, 6, dtype=torch.bfloat16)
    m = torch.zeros(2, 4, 6, dtype=torch.uint16)
    O = torch.zeros(2, 4, 6, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous bf16"):
        tk.cautious_update_with_mantissa_triton(p.mT.contiguous().mT, m, O, 0.1, 0.1)
    with pytest.raises(ValueError, match="uint16"):
        tk.cautious_update_with_mantissa_triton(p, m.view(torch.int16), O, 0.1, 0.1)
    with pytest.raises(ValueError, match="O must be bf16"):
        tk.cautious_update_with_mantissa_triton(p, m, O.float(), 0.1, 0.1)
    with pytest.raises(ValueError, match="per-matrix lr"):
        tk.cautious_update_with_mantissa_triton(p, m, O, torch.ones(2, 1, 1, dtype=torch.float64), 0.1)
    with pytest.raises(ValueError, match="per-matrix lr"):
        tk.cautious_update_with_mantissa_triton(p, m, O, torch.ones(2), 0.1)


# ------------------------------------------------------------------------------------------------------------------
# Section 7: NorMuon's momentum and Polar Express's split product
# ------------------------------------------------------------------------------------------------------------------

def lerp_cuda_order(start: torch.Tensor, end: torch.Tensor, weight: float) -> torch.Tensor:
    """torch.lerp in fp32 as CUDA computes it: s + w(e - s) for |w| < 0.5, else e - (e - s)(1 - w), one FMA each."""
    w = f32(weight)
    if abs(float(w)) < 0.5:
        return fma32(w, end - start, start)
    return fma32(-(end - start), f32(1.0) - w, end)      # -(e - s): s - e would be +0 where e - s is +0


def momentum_inputs(shape, grad_dtype, seed):
    """Trainer-like gradients and momenta, with zeros and both signs of zero among them."""
    g = torch.Generator().manual_seed(seed)
    grad = (torch.randn(shape, generator=g) * 1e-3).to(grad_dtype)
    M = torch.randn(shape, generator=g) * 1e-3
    flat_g, flat_m = grad.view(-1), M.view(-1)
    if flat_g.numel() >= 8:
        flat_g[:4] = 0.0
        flat_m[:2] = 0.0
        flat_g[4], flat_m[4] = -0.0, -0.0
    return grad, M


@pytest.mark.parametrize("shape, block", [((3, 19, 21), 64), ((2, 8, 8), 64), ((5,), 16)])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("momentum", [0.95, 0.85, 0.3])   # 0.3: the other branch of both lerps
def test_momentum_kernel_is_bitwise_cuda_order(shape, block, grad_dtype, momentum):
    grad, M = momentum_inputs(shape, grad_dtype, seed=sum(shape) + block)
    M_k = M.clone()
    X_k = tk.normuon_momentum_triton(grad, M_k, momentum, block=block)
    G = grad.float()
    M_want = lerp_cuda_order(M, G, 1 - momentum)
    X_want = lerp_cuda_order(G, M_want, momentum).to(grad_dtype)
    assert_same_bits(M_k, M_want, "momentum buffer")
    assert_same_bits(X_k, X_want, "look-ahead X")
    assert not torch.equal(M_k, M)
    # the CPU eager reference: the same, give or take the FMA of the CPU build (whether ATen's CPU kernels fuse
    # depends on the build), so within one rounding of each lerp's product
    M_r = M.clone()
    X_r = tk.normuon_momentum_reference(grad, M_r, momentum)
    U = 2.0 ** -24
    assert ((M_k.double() - M_r.double()).abs() <= 4 * U * (M.double().abs() + G.double().abs())).all()
    X_bound = 2.0 ** -7 * X_k.double().abs() + 4 * U * (M_k.double().abs() + G.double().abs())
    assert ((X_k.double() - X_r.double()).abs() <= X_bound).all()
    # the public op, registered
    M_op = M.clone()
    assert_same_bits(torch.ops.nanogpt_kernels.normuon_momentum(grad, M_op, momentum), X_k, "op X")
    assert_same_bits(M_op, M_k, "op momentum buffer")


def test_momentum_kernel_matches_float64_transcription():
    """M' = mu M + (1 - mu) G and X = mu M' + (1 - mu) G within the rounding of the FMAs and of X's bf16."""
    grad, M = momentum_inputs((4, 33, 17), torch.float32, seed=11)
    mu = 0.95
    M_k = M.clone()
    X_k = tk.normuon_momentum_triton(grad, M_k, mu)
    G64, M64 = grad.to(F64), M.to(F64)
    M_ref = mu * M64 + (1 - mu) * G64
    X_ref = mu * M_ref + (1 - mu) * G64
    U = 2.0 ** -24
    assert ((M_k.to(F64) - M_ref).abs() <= 4 * U * (M64.abs() + G64.abs()) + 1e-45).all()
    assert ((X_k.to(F64) - X_ref).abs() <= 8 * U * (M64.abs() + G64.abs()) + 1e-45).all()


def split_inputs(n, R, C, layout, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(n, R, C, generator=g).to(dtype)
    if layout == "transposed":                             # the first iteration's X of the MLP bank
        x = torch.randn(n, C, R, generator=g).to(dtype).mT
    elif layout == "strided":
        x = torch.randn(n, R, 2 * C, generator=g).to(dtype)[:, :, ::2]
    else:
        x = torch.randn(n, R, C, generator=g).to(dtype)
    return y, x


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, R, C, tile", CAUTIOUS_CASES)
def test_split_product_kernel_is_bitwise_one_fma(n, R, C, tile, dtype, layout):
    y, x = split_inputs(n, R, C, layout, dtype, seed=R + C)
    a = 3.8916678022926607                                   # a Polar Express coefficient, not an fp32 value
    got = tk.polar_split_product_triton(y.clone(), x, a, tile=tile)
    want = fma32(f32(a), x.float(), y.float()).to(dtype)
    assert_same_bits(got, want, "split product")
    ref = tk.polar_split_product_reference(y.clone(), x, a)    # CPU eager: fused or not, by the build
    bound = (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -23) * got.double().abs() + 2.0 ** -23 * (
        y.double().abs() + abs(a) * x.double().abs())
    assert ((got.double() - ref.double()).abs() <= bound).all()
    op = y.clone()
    torch.ops.nanogpt_kernels.polar_split_product_(op, x, a)
    assert_same_bits(op, got, "registered op")


def test_section7_launchers_reject_bad_input():
    grad, M = torch.zeros(2, 4, 6), torch.zeros(2, 4, 6)
    with pytest.raises(ValueError, match="float32"):
        tk.normuon_momentum_triton(grad, M.double(), 0.95)
    with pytest.raises(ValueError, match="shape"):
        tk.normuon_momentum_triton(grad, M[:1], 0.95)
    with pytest.raises(ValueError, match="contiguous"):
        tk.normuon_momentum_triton(grad.mT, M.mT, 0.95)
    with pytest.raises(ValueError, match="bfloat16"):
        tk.normuon_momentum_triton(grad.half(), M, 0.95)
    y = torch.zeros(2, 4, 6)
    with pytest.raises(ValueError, match="contiguous"):
        tk.polar_split_product_triton(y.mT, y.mT, 1.0)
    with pytest.raises(ValueError, match="shape"):
        tk.polar_split_product_triton(y, y[:, :3], 1.0)
    with pytest.raises(ValueError, match="dtype"):
        tk.polar_split_product_triton(y, y.bfloat16(), 1.0)
