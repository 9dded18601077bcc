"""Optimizer section of train_gpt.py: Polar Express, Adam and NorMuon updates, NorMuonAndAdam at world 1.

References here are written from the record's math in float64 (bf16 rounding emulated where the record rounds), never by
calling the code under test for the quantity being checked.
"""
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import train_gpt as tg

F64 = torch.float64


def bf(x: torch.Tensor) -> torch.Tensor:
    """Round to bf16 and back to float64 (an explicit rounding point of the record)."""
    return x.to(torch.bfloat16).to(F64)


@pytest.fixture
def one_thread():
    """float64 LAPACK calls (QR, SVD) run ~20x faster on one thread than on two busy cores; restore afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def f32(x):
    return x.to(torch.float32).to(F64) if isinstance(x, torch.Tensor) else float(np.float32(x))


# ---------------------------------------------------------------------------------------------------------------------
# Parameters with the record's structure, one per row of DEFAULT_PARAM_TABLE. The banks, the tied head and the tables
# take the small sizes the tests below reason about: D=32, H=128, V=96; 8 head-pair groups of Q/K, 4 V/O matrices
# (2 attention layers), 2 MLP slices of (c_fc, c_proj). Every other row's parameter has the shape and dtype it has in
# the tiny preset's model, so a new parameter (a new row) needs no edit here.
# ---------------------------------------------------------------------------------------------------------------------
D, H, V = 32, 128, 96
QK_ROWS = 16   # a head pair of Q or K: 2 * head_dim rows, fewer than D (per-column second moment)
SMALL_SHAPES = dict(qk=(8, QK_ROWS, D), vo=(4, D, D), mlp=(2, 2, H, D), lm_head=(D, V), bigram_embed=(V, D),
                    value_embeds=(2 * V, D))
SMALL_MATRICES = dict(qk=(QK_ROWS, D), vo=(D, D), mlp=(H, D))
TIED = ("lm_head", "embed")     # embed starts as the transposed copy of lm_head
TINY_MODEL = tg.build_model(tg.parse_args(["--preset=tiny"]), torch.device("meta"), "sdpa")
TINY_TABLE = {label: dict(row, matrix_shape=SMALL_MATRICES.get(label) or TINY_MODEL.bank_matrix_shapes[label])
              if row["optim"] == "normuon" else row for label, row in tg.DEFAULT_PARAM_TABLE.items()}
ADAM = [label for label, row in TINY_TABLE.items() if row["optim"] == "adam"]
NORMUON = [label for label, row in TINY_TABLE.items() if row["optim"] == "normuon"]
HP = dict(adam_lr=0.008, adam_eps=1e-10, adam_wd=0.005, muon_lr=0.023, muon_beta2=0.95, muon_wd=1.2)
CPU_OPS = tg.kernel_ops("fused", "cpu")   # off CUDA every op is its reference


def make_params(seed: int = 0) -> dict:
    """Random values, 0.05 n in bf16 and 0.5 n in fp32, in the table's order; embed the tied copy of lm_head."""
    g = torch.Generator().manual_seed(seed)
    tiny = dict(TINY_MODEL.named_parameters())
    params = {}
    for label in TINY_TABLE:
        if label == TIED[1]:
            continue
        shape, dtype = SMALL_SHAPES.get(label, tiny[label].shape), tiny[label].dtype
        scale = 0.05 if dtype == torch.bfloat16 else 0.5
        params[label] = nn.Parameter((torch.randn(tuple(shape), generator=g) * scale).to(dtype))
    params[TIED[1]] = nn.Parameter(params[TIED[0]].detach().mT.contiguous())
    return params


def make_grads(params: dict, seed: int) -> dict:
    """Gradients on a 1/256 grid with |g| <= 8/256: every sum and power-of-two average of a few is exact."""
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randint(-8, 9, p.shape, generator=g).to(F64) / 256).to(p.dtype) for k, p in params.items()}


def make_opt(params, world_size=1, rank=0, tied=TIED, table=TINY_TABLE, **kw):
    return tg.NorMuonAndAdam(params, table, rank=rank, world_size=world_size, tied=tied, ops=CPU_OPS, **HP, **kw)


def accumulate(params: dict, grads: dict) -> None:
    """What backward does: add into .grad (bf16 adds for bf16 params), or create it."""
    for k, p in params.items():
        p.grad = grads[k].clone() if p.grad is None else p.grad + grads[k]


# ---------------------------------------------------------------------------------------------------------------------
# Polar Express
# ---------------------------------------------------------------------------------------------------------------------

def composed_polynomial(s: np.ndarray) -> np.ndarray:
    for a, b, c in tg.POLAR_EXPRESS_COEFFS:
        s = a * s + b * s ** 3 + c * s ** 5
    return s


def test_polar_express_coefficients_have_their_designed_band():
    # The record's coefficients (typed here independently and checked digit by digit) are designed for
    # normalised singular values in [1e-3, 1]: the composed polynomial maps that interval into 1 +- 0.1411.
    assert tg.POLAR_EXPRESS_COEFFS == (
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323))
    lo, hi = band(1e-3)
    assert abs(lo - 0.858873) < 1e-5 and abs(hi - 1.141127) < 1e-5


def band(lowest: float) -> tuple[float, float]:
    # The composed polynomial is smooth (degree 3125) but oscillates: sample [lowest, 1] on a fine log grid. Between
    # grid points (ratio 1 + 7e-6) the value moves by at most |s f'(s)| * 7e-6 < 1e-4, far below the slack used below.
    s = np.geomspace(lowest, 1.0, 2_000_001)
    y = composed_polynomial(s)
    return float(y.min()), float(y.max())


@pytest.mark.parametrize("n, R, C, split", [(2, 768, 768, False), (1, 3072, 768, True), (3, 64, 96, False),
                                            (2, 256, 64, True), (1, 40, 40, True)])
def test_polar_express_orthogonalises_within_the_coefficient_band(n, R, C, split, one_thread):
    g = torch.Generator().manual_seed(R * 7 + C)
    m = min(R, C)
    U, _ = torch.linalg.qr(torch.randn(n, R, m, generator=g, dtype=F64))
    Vm, _ = torch.linalg.qr(torch.randn(n, C, m, generator=g, dtype=F64))
    # Singular values log-uniform over a factor 50: after the Frobenius normalisation they all lie in [1e-3, 1].
    s = torch.exp(torch.rand(n, m, generator=g, dtype=F64) * math.log(50.0))
    G = ((U * s[:, None, :]) @ Vm.mT).bfloat16()
    O = tg.polar_express(G, split, CPU_OPS)
    assert O.dtype == torch.bfloat16 and O.shape == G.shape
    O = O.to(F64)

    X = G.to(F64)
    Ux, Sx, Vhx = torch.linalg.svd(X, full_matrices=False)
    # The record's normaliser, with its bf16 roundings: bf16(bf16(bf16(||X||_F) * 1.02) + 1e-6).
    denom = bf(bf(bf(torch.linalg.matrix_norm(X)) * 1.02) + 1e-6)
    s_hat = (Sx / denom[:, None]).numpy()
    assert s_hat.min() >= 1e-3 and s_hat.max() < 1
    lo, hi = band(1e-3)

    # 1) Output singular values in the band. In exact arithmetic they are f(s_hat), inside [lo, hi]. In bf16 each
    #    iteration rounds its output (unit roundoff 2^-9 per entry); a rounding error matrix with independent signs
    #    has spectral norm about 2^-9 * (sqrt(R) + sqrt(C)) / sqrt(max(R, C)) <= 2^-8 ~ 0.004 relative to ||X||_2 ~ 1,
    #    and earlier roundings are damped by the later iterations (|p'| < 1 near 1). 0.01 leaves 2.5x margin.
    svals = torch.linalg.svdvals(O)
    assert svals.min() >= lo - 0.01 and svals.max() <= hi + 0.01, (svals.min(), svals.max(), lo, hi)

    # 2) Distance to the polar factor U·Vᵀ: exactly max_i |f(s_i) - 1| (<= 0.1411) in exact arithmetic; bf16 also
    #    rotates the singular vectors a little (the first iterations have large coefficients, so B carries absolute
    #    errors of ~22 * 2^-9 * |A|); 0.03 covers that (measured <= 0.013).
    polar = Ux @ Vhx
    dist2 = torch.linalg.matrix_norm(O - polar, ord=2)
    assert (dist2 <= float(np.abs(composed_polynomial(s_hat) - 1).max()) + 0.03).all(), dist2

    # 3) Closeness to the exact-arithmetic result U·f(S)·Vᵀ in Frobenius norm: catches a wrong coefficient, a
    #    missing iteration or a wrong normaliser (each moves this by > 0.1); bf16 noise measured <= 0.032 (split).
    exact = (Ux * torch.from_numpy(composed_polynomial(s_hat))[:, None, :]) @ Vhx
    rel = torch.linalg.matrix_norm(O - exact) / torch.linalg.matrix_norm(exact)
    assert (rel < 0.06).all(), rel


def polar_express_reference(U: torch.Tensor, split: bool) -> torch.Tensor:
    """Polar Express in float64 with the record's bf16 rounding points; U (n, R, C) -> bf16-valued float64."""
    X = bf(U.to(F64))
    transposed = X.shape[-2] > X.shape[-1]
    if transposed:
        X = X.mT
    X = bf(X / bf(bf(bf(torch.linalg.matrix_norm(X))[:, None, None] * 1.02) + 1e-6))
    for a, b, c in tg.POLAR_EXPRESS_COEFFS:
        A = bf(X @ X.mT)
        B = bf(f32(b) * A + f32(c) * (A @ A))
        X = bf(bf(B @ X) + a * X) if split else bf(a * X + B @ X)
    return X.mT if transposed else X


@pytest.mark.parametrize("split", [False, True])
def test_polar_express_matches_rounded_transcription(split):
    g = torch.Generator().manual_seed(5)
    U = torch.randn(2, 48, 32, generator=g)
    ours = tg.polar_express(U, split, CPU_OPS).to(F64)
    ref = polar_express_reference(U.to(F64), split)
    # Same rounding points, different fp32-vs-float64 accumulation: a few entries land one bf16 ulp apart and the
    # iterations spread that a little; the relative Frobenius distance stays ~1e-3, far below the 5e-2 a wrong
    # rounding point (e.g. fused instead of split) or coefficient produces on these shapes.
    rel = torch.linalg.matrix_norm(ours - ref) / torch.linalg.matrix_norm(ref)
    assert (rel < 1e-2).all(), rel


# ---------------------------------------------------------------------------------------------------------------------
# Adam
# ---------------------------------------------------------------------------------------------------------------------

def adam_reference(p, g, m, v, *, t, lr, beta1, beta2, eps, wd):
    """Adam's update transcribed in float64; returns (p_new (float64, unrounded), m, v)."""
    p, g, m, v = (x.to(F64) for x in (p, g, m, v))
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    k = f32(lr * (math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)))
    lam = f32(lr * lr * wd)
    u = m / (torch.sqrt(v) + eps) * k
    u = u + lam * p * (u * p > 0)
    return p - u, m, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_adam_update_matches_float64_transcription(dtype):
    g = torch.Generator().manual_seed(1)
    shape = (64, 48)
    p = (torch.randn(shape, generator=g) * 0.1).to(dtype)
    grad = (torch.randn(shape, generator=g) * 1e-2).to(dtype)
    m = torch.randn(shape, generator=g) * 1e-3
    v = torch.rand(shape, generator=g) * 1e-4
    # Entries with zero gradient and zero first moment: the update is exactly 0, so the STRICT mask must leave them
    # undecayed (a >= mask would pull them toward 0 by decay * p, visible at this large decay).
    m[:8] = 0
    grad[:8] = 0
    t, lr, beta1, beta2, eps, wd = 3, 0.3, 0.75, 0.95, 1e-10, 0.005 * 150
    p0, m0 = p.clone(), m.to(F64)
    p_ref, m_ref, v_ref = adam_reference(p, grad, m, v, t=t, lr=lr, beta1=beta1, beta2=beta2, eps=eps, wd=wd)
    step_size, decay = tg.adam_scalars(lr, t, beta1, beta2, wd)
    tg.adam_update(p, grad, m, v, beta1=beta1, beta2=beta2, eps=eps, step_size=step_size, decay=decay, ops=CPU_OPS)
    # fp32 vs float64: a few fp32 ulps of the terms' magnitude (m ~ 1e-3, v ~ 1e-4), relative where they cancel.
    torch.testing.assert_close(m.to(F64), m_ref, rtol=2e-6, atol=3e-10)
    torch.testing.assert_close(v.to(F64), v_ref, rtol=2e-6, atol=3e-11)
    # The parameter is the nearest `dtype` value of the fp32 result: equal to the rounded float64 one except where
    # fp32 arithmetic lands across a rounding boundary (at most one ulp of `dtype`).
    # Allowed: one ulp of `dtype` at the result, plus the fp32 error of the update u = p0 - p_ref: a few ulps, and
    # the relative rounding error of m, which is larger where beta1*m and (1-beta1)*g cancel.
    u = (p0.to(F64) - p_ref).abs()
    m_rel = 2 ** -24 * (beta1 * m0.abs() + (1 - beta1) * grad.to(F64).abs()) / m_ref.abs().clamp_min(1e-30)
    tol = torch.finfo(dtype).eps * p_ref.abs() + u * (8 * 2 ** -24 + m_rel)
    assert ((p.to(F64) - p_ref).abs() <= tol).all()
    if dtype == torch.bfloat16:                          # fp32 noise is far below a bf16 ulp: nearly all exact
        assert (p.to(F64) == p_ref.to(dtype).to(F64)).float().mean() > 0.99
    assert (p[:8] == p_ref[:8].to(dtype)).all()           # undecayed rows kept their exact value


def test_adam_update_in_cpu_blocks_is_bitwise_the_whole_tensor_update(monkeypatch):
    """On a CPU, tensors above CPU_CHUNK_ELEMENTS are updated in row blocks (cache-sized): element-wise math, so the
    same bits as one whole-tensor update, including on a strided view like a rank's slice of an embedding table."""
    g = torch.Generator().manual_seed(3)
    table = (torch.randn(700, 192, generator=g) * 0.1).bfloat16()
    grad = (torch.randn(700, 192, generator=g) * 1e-2).bfloat16()
    m, v = torch.randn(700, 192, generator=g) * 1e-3, torch.rand(700, 192, generator=g) * 1e-4
    kw = dict(beta1=0.75, beta2=0.95, eps=1e-10, step_size=0.01, decay=0.3, ops=CPU_OPS)
    whole = [t.clone() for t in (table, grad, m, v)]
    monkeypatch.setattr(tg, "CPU_CHUNK_ELEMENTS", 10 ** 9)
    tg.adam_update(whole[0][:, 64:], whole[1][:, 64:], whole[2][:, 64:], whole[3][:, 64:], **kw)
    monkeypatch.setattr(tg, "CPU_CHUNK_ELEMENTS", 5000)   # blocks of 39 rows: 18 blocks, the last one short
    tg.adam_update(table[:, 64:], grad[:, 64:], m[:, 64:], v[:, 64:], **kw)
    for got, want in zip((table, m, v), (whole[0], whole[2], whole[3])):
        assert torch.equal(got, want)
    assert not torch.equal(table, (torch.randn(700, 192, generator=torch.Generator().manual_seed(3)) * 0.1).bfloat16())


# ---------------------------------------------------------------------------------------------------------------------
# NorMuon
# ---------------------------------------------------------------------------------------------------------------------

def variance_reference(O, Q, beta2):
    """NorMuon's variance normalisation in float64: O bf16-valued (n, R, C), Q (n, R, 1) or (n, 1, C)
    -> (O scaled, rounded to bf16; new Q)."""
    red = -1 if O.shape[-2] >= O.shape[-1] else -2
    n_red = O.shape[red]
    r = (O * O).mean(dim=red, keepdim=True)
    n = torch.sqrt(n_red * r.sum(dim=(-2, -1), keepdim=True))
    Q = Q + (1 - beta2) * (r - Q)
    d = 1 / torch.sqrt(torch.clamp(Q, min=1e-10))
    n2 = torch.sqrt((n_red * r * d * d).sum(dim=(-2, -1), keepdim=True))
    scale = d * n / torch.clamp(n2, min=1e-10)
    return bf(O * bf(scale)), Q


def master_bits(param: torch.Tensor, mantissa: torch.Tensor) -> torch.Tensor:
    """(bf16 bits << 16) | mantissa as int64, built with integer arithmetic only (independent of the code's views)."""
    high = param.view(torch.int16).to(torch.int64) & 0xFFFF
    low = mantissa.view(torch.int16).to(torch.int64) & 0xFFFF
    return (high << 16) | low


def master_value(param, mantissa) -> torch.Tensor:
    return master_bits(param, mantissa).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("R, C", [(48, 32), (32, 48)])
def test_variance_normalize_matches_float64(R, C):
    g = torch.Generator().manual_seed(R)
    O = torch.randn(3, R, C, generator=g).bfloat16() * 0.1
    O[2] = 0                                         # a zero matrix stays zero (scale 0, not NaN)
    Q = torch.rand(3, R, 1, generator=g) * 1e-2 if R >= C else torch.rand(3, 1, C, generator=g) * 1e-2
    O_ref, Q_ref = variance_reference(O.to(F64), Q.to(F64), 0.95)
    O_ours = tg.variance_normalize_(O, Q, 0.95)
    torch.testing.assert_close(Q.to(F64), Q_ref, rtol=1e-6, atol=0)
    # One bf16 rounding of the per-row scale and one of the product: at most one bf16 ulp from the float64 value.
    assert ((O_ours.to(F64) - O_ref).abs() <= 2 ** -7 * O_ref.abs()).all()
    assert (O_ours.to(F64) == O_ref).float().mean() > 0.97
    assert (O_ours[2] == 0).all()


def test_cautious_update_with_mantissa_matches_float64():
    g = torch.Generator().manual_seed(2)
    n, R, C = 3, 16, 8
    param = torch.randn(n, R, C, generator=g).bfloat16()
    mantissa = torch.randint(0, 1 << 16, (n, R, C), generator=g, dtype=torch.int32).to(torch.uint16)
    P = master_value(param, mantissa).to(F64)
    O = torch.randn(n, R, C, generator=g).bfloat16()
    O[:, :4] = 0                                      # zero update: the NON-strict mask still decays these
    lr = torch.tensor([0.25, 0.5, 0.125], dtype=torch.float32).view(n, 1, 1)
    wd = f32(0.9)
    CPU_OPS.cautious_update(param, mantissa, O, lr=lr, wd=wd)
    Og, lr64 = O.to(F64), lr.to(F64)
    mask = (Og * P >= 0).to(F64)
    P_ref = (P - ((P * mask) * wd) * lr64) - Og * lr64
    got = master_value(param, mantissa).to(F64)
    # fp32 arithmetic on the same formula: within a few fp32 ulps of the terms' magnitudes.
    assert ((got - P_ref).abs() <= 4 * 2 ** -24 * (P.abs() + (Og * lr64).abs())).all()
    assert (got[:, :4] != P[:, :4]).all()             # decayed
    # The visible bf16 is the truncation of the master: |bf16| <= |master| with the same sign, less than 1 ulp away.
    p64 = param.to(F64)
    assert ((p64.abs() <= got.abs()) & (p64 * got >= 0)).all()


def normuon_reference(param, grad, M, Q, mantissa, *, mu, beta2, lr, wd, split):
    """The whole NorMuon update in float64 with the bf16 rounding points; returns (master P', M, Q)."""
    P = master_value(param, mantissa).to(F64)
    G = grad.to(F64)
    M = M.to(F64)
    M = M + (1 - mu) * (G - M)
    U = M - (M - G) * (1 - mu)
    O = polar_express_reference(U, split)
    O, Q = variance_reference(O, Q.to(F64), beta2)
    mask = (O * P >= 0).to(F64)
    return (P - ((P * mask) * wd) * lr) - O * lr, M, Q


@pytest.mark.parametrize("R, C, split", [(64, 32, False), (32, 64, True)])
def test_normuon_update_matches_float64_transcription(R, C, split):
    g = torch.Generator().manual_seed(3 + R)
    n = 2
    param = (torch.randn(n, R, C, generator=g) * 0.05).bfloat16()
    mantissa = torch.randint(0, 1 << 16, (n, R, C), generator=g, dtype=torch.int32).to(torch.uint16)
    grad = (torch.randn(n, R, C, generator=g) * 1e-2).bfloat16()
    M = torch.randn(n, R, C, generator=g) * 1e-2
    Q = (torch.rand(n, R, 1, generator=g) if R >= C else torch.rand(n, 1, C, generator=g)) * 1e-3
    mu, beta2, lr, wd = 0.9, 0.95, 0.05, f32(1.2 * 0.023)
    P0 = master_value(param, mantissa).to(F64)
    P_ref, M_ref, Q_ref = normuon_reference(param, grad, M, Q, mantissa, mu=mu, beta2=beta2, lr=f32(lr), wd=wd,
                                            split=split)
    tg.normuon_update(param, grad, M, Q, mantissa, momentum=mu, beta2=beta2, lr=f32(lr), wd=wd,
                      two_roundings=split, ops=CPU_OPS)
    torch.testing.assert_close(M.to(F64), M_ref, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(Q.to(F64), Q_ref, rtol=0.05, atol=0)
    # The orthogonalised direction carries bf16 noise (a few % relative, see the Polar Express tests), so compare the
    # whole update P' - P in relative Frobenius norm; a wrong lr, decay, mask or sign moves it by far more.
    step_ours = master_value(param, mantissa).to(F64) - P0
    step_ref = P_ref - P0
    rel = torch.linalg.matrix_norm(step_ours - step_ref) / torch.linalg.matrix_norm(step_ref)
    assert (rel < 0.05).all(), rel


def test_mantissa_master_equals_fp32_trajectory_bit_for_bit():
    g = torch.Generator().manual_seed(4)
    n, R, C, steps = 2, 32, 16, 40
    param = (torch.randn(n, R, C, generator=g) * 0.05).bfloat16()
    mantissa = torch.zeros(n, R, C, dtype=torch.uint16)
    M, Q = torch.zeros(n, R, C), torch.zeros(n, R, 1)
    master = param.float()                            # separate fp32 master, starting from the same bf16 weights
    M_ref, Q_ref = M.clone(), Q.clone()
    lr = torch.tensor([1e-4, 4e-4], dtype=torch.float32).view(n, 1, 1)   # small: most updates are sub-bf16-ulp
    wd = f32(1.2 * 0.023)
    saw_truncation = False
    for step in range(steps):
        grad = (torch.randn(n, R, C, generator=g) * 1e-2).bfloat16()
        mu = 0.85 + 0.1 * step / steps
        U = CPU_OPS.normuon_momentum(grad, M_ref, mu)           # normuon_update's direction, step by step
        O = tg.variance_normalize_(tg.polar_express(U, False, CPU_OPS, dtype=grad.dtype), Q_ref, 0.95)
        Og = O.float()
        mask = Og * master >= 0
        master = (master - ((master * mask) * wd) * lr) - Og * lr
        tg.normuon_update(param, grad, M, Q, mantissa, momentum=mu, beta2=0.95, lr=lr, wd=wd,
                          two_roundings=False, ops=CPU_OPS)
        bits = master.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        assert torch.equal(master_bits(param, mantissa), bits), f"step {step}"
        saw_truncation |= bool((master.bfloat16() != param).any())       # round-to-nearest would differ here
    assert saw_truncation


# ---------------------------------------------------------------------------------------------------------------------
# NorMuonAndAdam at world size 1
# ---------------------------------------------------------------------------------------------------------------------

def test_class_adam_every_other_step_on_summed_grads_and_tied_head():
    params = make_params(0)
    init = {k: p.detach().clone() for k, p in params.items()}
    opt = make_opt(params)
    g0, g1 = make_grads(params, 10), make_grads(params, 11)
    accumulate(params, g0)
    opt.step(do_adam=False, lr_factor=1.0, momentum=0.85)
    for k in ADAM:                                                     # Adam untouched, gradients kept
        assert torch.equal(params[k].detach(), init[k]) and torch.equal(params[k].grad, g0[k]), k
    for k in NORMUON:
        assert params[k].grad is None and not torch.equal(params[k].detach(), init[k]), k
    accumulate(params, g1)
    s = 1.3
    opt.step(do_adam=True, lr_factor=s, momentum=0.86)
    assert all(p.grad is None for p in params.values())
    for k in ADAM:
        if k == "embed":
            continue                                                   # the tied copy: checked below
        row = TINY_TABLE[k]
        summed = g0[k] + g1[k]                                         # the bf16 sum of two steps
        if k == "lm_head":
            summed = summed + (g0["embed"] + g1["embed"]).mT           # the tied fold
        zeros = torch.zeros_like(summed, dtype=F64)
        p_ref, _, _ = adam_reference(init[k], summed, zeros, zeros, t=1, lr=0.008 * s * row["lr_mul"],
                                     beta1=row["betas"][0], beta2=row["betas"][1], eps=1e-10,
                                     wd=0.005 * row["wd_mul"])
        # a few fp32 roundings of the weight and of the step (the update may contract a multiply-add or not,
        # by CPU): relative to both, so a weight near zero is held to its step's rounding
        ulp = 4 * torch.finfo(params[k].dtype).eps * (p_ref.abs() + (p_ref - init[k].to(F64)).abs())
        assert ((params[k].detach().to(F64) - p_ref).abs() <= ulp).all(), k
    assert torch.equal(params["embed"].detach(), params["lm_head"].detach().mT)   # exact copy while tied
    assert opt.adam_t["lm_head"] == 1 and opt.adam_t["embed"] == 0 and opt.adam_t["scalars"] == 1
    # untie: embed takes lm_head's t and its moments, transposed
    opt.untie()
    assert not opt.tied_now and opt.adam_t["embed"] == 1
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt.buffers["embed"][name], opt.buffers["lm_head"][name].mT)
    with pytest.raises(ValueError, match="already separate"):
        opt.untie()


def test_class_normuon_lr_multipliers_by_global_matrix_index():
    # The MLP bank (2 slices x (c_fc, c_proj)) viewed as 4 matrices of 128x32: shape multiplier sqrt(128/32) = 2 for
    # all, x2 more on odd global index (c_proj). Compare the class's step with normuon_update on each matrix at the
    # lr written out by hand.
    params = make_params(1)
    mlp0 = params["mlp"].detach().clone().view(4, H, D)
    opt = make_opt(params)
    grads = make_grads(params, 12)
    accumulate(params, grads)
    s = 0.7
    opt.step(do_adam=False, lr_factor=s, momentum=0.9)
    wd = f32(1.0 * 1.2 * (0.023 * s))
    for i in range(4):
        p = mlp0[i:i + 1].clone()
        lr = f32(2.0 * (2.0 if i % 2 else 1.0) * (0.023 * s))
        tg.normuon_update(p, grads["mlp"].view(4, H, D)[i:i + 1], torch.zeros(1, H, D), torch.zeros(1, H, 1),
                          torch.zeros(1, H, D, dtype=torch.uint16), momentum=0.9, beta2=0.95, lr=lr, wd=wd,
                          two_roundings=False, ops=CPU_OPS)
        assert torch.equal(params["mlp"].detach().view(4, H, D)[i], p[0]), i
    assert opt.buffers["mlp"]["second_moment"].shape == (4, H, 1)
    assert opt.buffers["vo"]["second_moment"].shape == (4, D, 1)


def test_class_normuon_orthogonalises_each_qk_group_alone_with_per_column_moments():
    # The qk bank (8 head-pair groups of 16x32, rows < cols) and the vo bank (4 of 32x32): the class's step equals
    # normuon_update on each matrix alone, and the qk second moment is per column (n, 1, cols).
    params = make_params(4)
    init = {k: params[k].detach().clone() for k in ("qk", "vo")}
    opt = make_opt(params)
    assert opt.buffers["qk"]["second_moment"].shape == (8, 1, D)
    assert opt.buffers["vo"]["second_moment"].shape == (4, D, 1)
    grads = make_grads(params, 13)
    accumulate(params, grads)
    s = 0.9
    opt.step(do_adam=False, lr_factor=s, momentum=0.9)
    wd = f32(1.0 * 1.2 * (0.023 * s))
    lr = f32(1.0 * (0.023 * s))                                     # shape multiplier 1: rows <= cols
    for k, (R, C) in (("qk", (QK_ROWS, D)), ("vo", (D, D))):
        moment = (1, 1, C) if R < C else (1, R, 1)
        for i in range(init[k].shape[0]):
            p = init[k][i:i + 1].clone()
            tg.normuon_update(p, grads[k][i:i + 1], torch.zeros(1, R, C), torch.zeros(moment),
                              torch.zeros(1, R, C, dtype=torch.uint16), momentum=0.9, beta2=0.95, lr=lr, wd=wd,
                              two_roundings=False, ops=CPU_OPS)
            assert torch.equal(params[k].detach()[i], p[0]), (k, i)
    # a whole-bank orthogonalisation (one 128x32 matrix of the 8 groups) would give another update
    whole = init["qk"].view(1, 8 * QK_ROWS, D).clone()
    tg.normuon_update(whole, grads["qk"].view(1, 8 * QK_ROWS, D), torch.zeros(1, 8 * QK_ROWS, D),
                      torch.zeros(1, 8 * QK_ROWS, 1), torch.zeros(1, 8 * QK_ROWS, D, dtype=torch.uint16),
                      momentum=0.9, beta2=0.95, lr=lr, wd=wd, two_roundings=False, ops=CPU_OPS)
    assert not torch.equal(whole.view(8, QK_ROWS, D), params["qk"].detach())


def run_steps(params, opt, seeds_and_flags):
    for seed, do_adam in seeds_and_flags:
        accumulate(params, make_grads(params, seed))
        opt.step(do_adam=do_adam, lr_factor=1.1, momentum=0.9)


def test_state_dict_round_trip_is_exact():
    params = make_params(2)
    opt = make_opt(params)
    run_steps(params, opt, [(20, False), (21, True)])
    opt.untie()
    run_steps(params, opt, [(22, False)])
    saved_params = {k: p.detach().clone() for k, p in params.items()}
    saved_grads = {k: p.grad.clone() for k, p in params.items() if p.grad is not None}
    sd = opt.state_dict()
    run_steps(params, opt, [(23, True), (24, False)])
    after = {k: p.detach().clone() for k, p in params.items()}
    after_state = opt.state_dict()
    # restore into a FRESH optimizer (tied at construction: the flag must come from the state) and replay
    for k, p in params.items():
        p.data.copy_(saved_params[k])
        p.grad = saved_grads[k].clone() if k in saved_grads else None
    opt2 = make_opt(params)
    opt2.load_state_dict(sd)
    assert not opt2.tied_now
    run_steps(params, opt2, [(23, True), (24, False)])
    for k, p in params.items():
        assert torch.equal(p.detach(), after[k]), k
    assert opt2.adam_t == after_state["adam_t"]
    for label, buf in after_state["buffers"].items():
        for name, t in buf.items():
            assert torch.equal(opt2.buffers[label][name], t), (label, name)


@pytest.mark.parametrize("case, match", [
    ("missing", "'mudd_gate_scale' has no row"),
    ("unknown", "'ghost' names no model parameter"),
    ("bank", "mlp bank has 4 matrices, not divisible by world_size 3"),
    ("adam_rows", "bigram_embed has 96 rows.*world_size 5"),
    ("shape", "matrix_shape=\\(64, 32\\)"),
    ("optim", "optim='sgd'"),
])
def test_bad_tables_raise_naming_the_problem(case, match):
    params = make_params(3)
    table = {k: dict(v) for k, v in TINY_TABLE.items()}
    kw = {}
    world_size = 1
    if case == "missing":
        del table["mudd_gate_scale"]
    elif case == "unknown":
        table["ghost"] = dict(table["bigram_embed"])
    elif case == "bank":
        table = dict(table, qk=dict(table["qk"], comms="replicated"), vo=dict(table["vo"], comms="replicated"))
        world_size = 3
    elif case == "adam_rows":
        table = {k: dict(v, comms="replicated") if k not in ("bigram_embed",) else v for k, v in table.items()}
        world_size = 5
    elif case == "shape":
        table["mlp"]["matrix_shape"] = (64, 32)
        params["mlp"] = nn.Parameter(torch.zeros(2, 2, H, 48, dtype=torch.bfloat16))
    elif case == "optim":
        table["smear_gate"]["optim"] = "sgd"
    with pytest.raises(ValueError, match=match):
        make_opt(params, world_size=world_size, rank=0, table=table, **kw)


def test_comm_orders_derived_from_the_table_are_the_records():
    # Record 89's two orders of its 19 parameters, written out (upstream's names: qk_bank, vo_bank, mlp_bank,
    # _mudd_gate_scale): gradient reductions launched big banks first, in the table's order; updates of the small
    # replicated Adam rows first, then the sharded Adam rows, then the NorMuon banks. Within the Adam groups the record
    # interleaves them (mudd_w1 and mudd_gate_w1 between the sharded tables); ours keeps the table's order inside each
    # group (not math). Still required: lm_head before embed. A row the record does not have (a new idea's) may sit
    # anywhere: the record's rows keep these orders.
    record_scatter = ("qk", "vo", "mlp", "scalars", "smear_gate", "ve_gate_bank", "lm_head", "bigram_embed",
                      "post_lambdas", "resid_lambdas", "value_embeds", "embed", "mudd_w1", "mudd_w2", "mudd_b2",
                      "mudd_gate_w1", "mudd_gate_w2", "mudd_gate_b2", "mudd_gate_scale")
    record_work = ("scalars", "smear_gate", "ve_gate_bank", "mudd_b2", "mudd_gate_b2", "mudd_gate_scale",
                   "post_lambdas", "resid_lambdas", "mudd_w2", "mudd_gate_w2", "value_embeds", "bigram_embed",
                   "mudd_w1", "mudd_gate_w1", "lm_head", "embed", "qk", "vo", "mlp")
    sharded_adam = ("value_embeds", "bigram_embed", "lm_head", "embed")
    opt = make_opt(make_params(0))
    assert sorted(opt.scatter_order) == sorted(opt.work_order) == sorted(TINY_TABLE)
    assert tuple(label for label in opt.scatter_order if label in record_scatter) == record_scatter
    work = tuple(label for label in opt.work_order if label in record_work)
    n_rep = len(record_work) - len(sharded_adam) - 3
    assert set(work[:n_rep]) == set(record_work) - set(sharded_adam) - {"qk", "vo", "mlp"}
    assert set(work[n_rep:n_rep + 4]) == set(sharded_adam) and work[-3:] == record_work[-3:]
    assert work.index("lm_head") < work.index("embed")
    # a new replicated Adam row joins the first group, whatever its place in the table
    table = dict(TINY_TABLE, **{"new": dict(TINY_TABLE["scalars"])})
    unsharded_adam = [k for k, row in TINY_TABLE.items() if row["optim"] == "adam" and row["comms"] != "sharded"]
    assert tg.update_order(table).index("new") == len(unsharded_adam)


def test_adam_updates_the_0d_gate_scale_with_0d_state():
    """The MUDD gates' learnable scale (record 85) is a 0-d fp32 parameter: its Adam moments are 0-d, an odd step
    updates it as Adam's float64 transcription says, and a state round trip keeps it (no chunking or flattening)."""
    params = make_params(2)
    opt = make_opt(params)
    p = params["mudd_gate_scale"]
    assert p.dim() == 0 and p.dtype == torch.float32
    assert all(t.dim() == 0 and t.dtype == torch.float32 for t in opt.buffers["mudd_gate_scale"].values())
    init = p.detach().clone()
    grads = make_grads(params, 5)
    grads["mudd_gate_scale"] = torch.tensor(0.75, dtype=torch.float32)
    accumulate(params, grads)
    opt.step(do_adam=True, lr_factor=1.0, momentum=0.85)
    row = TINY_TABLE["mudd_gate_scale"]
    zero = torch.zeros((), dtype=F64)
    want, m, v = adam_reference(init, torch.tensor(0.75), zero, zero, t=1, lr=0.008 * row["lr_mul"],
                                beta1=row["betas"][0], beta2=row["betas"][1], eps=1e-10, wd=0.005 * row["wd_mul"])
    assert p.dim() == 0 and p.item() == pytest.approx(want.item(), rel=1e-6) and p.item() != init.item()
    assert opt.buffers["mudd_gate_scale"]["exp_avg"].item() == pytest.approx(m.item(), rel=1e-6)
    assert opt.buffers["mudd_gate_scale"]["exp_avg_sq"].item() == pytest.approx(v.item(), rel=1e-6)
    sd = opt.state_dict()
    again = make_opt(params)
    again.load_state_dict(sd)
    assert all(torch.equal(again.buffers["mudd_gate_scale"][k], t) and t.dim() == 0
               for k, t in opt.buffers["mudd_gate_scale"].items())


def test_momentum_lerp_weights_are_formed_from_fp32_mu():
    # Upstream record 74 holds mu as fp32 and forms 1 - mu_f in fp32 (exact): at mu = 0.95 the buffer's weight is
    # 0.050000011920929, not fp32(1 - 0.95) = 0.050000000745058. From a zero buffer the first step gives M = w * G.
    R, C = 8, 16
    g = torch.Generator().manual_seed(3)
    bank = nn.Parameter((torch.randn(2, R, C, generator=g) * 0.05).bfloat16())
    table = {"m": dict(optim="normuon", comms="none", lr_mul=1.0, wd_mul=1.0, matrix_shape=(R, C))}
    opt = tg.NorMuonAndAdam({"m": bank}, table, rank=0, world_size=1, tied=None, ops=CPU_OPS, **HP)
    bank.grad = (torch.randn(2, R, C, generator=g) * 3).bfloat16()
    grad = bank.grad.float()
    opt.step(do_adam=False, lr_factor=1.0, momentum=0.95)
    w_fp32_mu = torch.tensor(1.0, dtype=torch.float32) - torch.tensor(0.95, dtype=torch.float32)
    assert float(w_fp32_mu) == 0.050000011920928955
    assert torch.equal(opt.buffers["m"]["momentum"], grad * w_fp32_mu)
    assert not torch.equal(grad * w_fp32_mu, grad * torch.tensor(1 - 0.95, dtype=torch.float32))
