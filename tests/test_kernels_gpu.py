"""GPU tests of triton_kernels.py: bf16 kernels against float64 references (forward and backward) and
torch.compile(fullgraph=True) tracing with no graph break and no recompile. Run on the device:
    python3 -m pytest -q tests/test_kernels_gpu.py

Tolerance: the kernels round to bf16 (2^-8 relative) at the spec's rounding points, so relative errors (max abs error
over the largest reference value) land around 1e-3..1e-2; 2e-2 passes any legal summation order while a wrong
tile, mask or epilogue gives errors of order 1.
"""
import pytest
import torch

import triton_kernels as tk

pytestmark = pytest.mark.gpu
BF16_TOL = 2e-2
A_, B_, C_ = 23.0, 5.0, 7.5


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any(), "NaN in the kernel output"
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


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
    out = tk.relu2_mlp(x, c_fc, c_proj)
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

def ce_float64(logits, targets, weights, grad_rows):
    """Spec §8.4 in float64 (all targets in range): losses (n,) and dlogits (n, V)."""
    n, V = logits.shape
    sig = torch.sigmoid((logits.double() + B_) / C_)
    z = A_ * sig
    lse = torch.logsumexp(z, dim=1)
    losses = torch.zeros(n, dtype=torch.float64, device=logits.device)
    s_w = torch.zeros(n, dtype=torch.float64, device=logits.device)
    t = torch.zeros(n, V, dtype=torch.float64, device=logits.device)
    for k, w in enumerate(weights.tolist()):
        rows = torch.arange(n - k, device=logits.device)
        zt = z[rows, targets[k:]]
        if w > 0:
            losses[: n - k] += w * (lse[: n - k] - zt)
        s_w[: n - k] += w
        t[rows, targets[k:]] += w
    dz = grad_rows.double()[:, None] * (s_w[:, None] * torch.exp(z - lse[:, None]) - t)
    return losses, dz * z * (1 - sig) / C_


@pytest.mark.parametrize("weights", [[1.0], [1.0, 0.5], [1.0, 0.5, 0.25], [1.0, 0.5, 0.0]])
def test_softcapped_mtp_ce_bf16(weights):
    n, V = 1024, 50304
    g = gen(5)
    logits = (torch.randn(n, V, device="cuda", generator=g) * 10).bfloat16().requires_grad_()
    targets = torch.randint(0, V, (n,), device="cuda", generator=g)
    w = torch.tensor(weights, device="cuda")
    losses = tk.softcapped_mtp_ce(logits, targets, w)
    grad_rows = torch.full((n,), 1 / 8, device="cuda")
    (dlogits,) = torch.autograd.grad(losses, logits, grad_rows)
    want_losses, want_d = ce_float64(logits.detach(), targets, w, grad_rows)
    assert losses.dtype == torch.float32 and dlogits.dtype == torch.bfloat16
    assert rel_err(losses, want_losses) < 1e-4  # fp32 math from the same bf16 logits
    assert rel_err(dlogits, want_d) < BF16_TOL
    # The sum's gradient arrives expanded (stride 0): same result.
    (d_sum,) = torch.autograd.grad(tk.softcapped_mtp_ce(logits, targets, w).sum() / 8, logits)
    assert rel_err(d_sum, want_d) < BF16_TOL


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
        out = tk.relu2_mlp(x, c_fc, c_proj)
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


def test_compile_softcapped_mtp_ce_new_weight_values():
    def loss_fn(logits, targets, w):
        return tk.softcapped_mtp_ce(logits, targets, w).sum() / 8

    compiled = fresh_compile(loss_fn)
    n, V = 256, 50304
    for seed, weights in [(10, [1.0, 0.5, 0.25]), (11, [1.0, 0.25, 0.0625])]:  # same length, new values
        g = gen(seed)
        logits = (torch.randn(n, V, device="cuda", generator=g) * 10).bfloat16().requires_grad_()
        targets = torch.randint(0, V, (n,), device="cuda", generator=g)
        w = torch.tensor(weights, device="cuda")
        loss = compiled(logits, targets, w)
        loss.backward()
        want_losses, want_d = ce_float64(logits.detach(), targets, w, torch.full((n,), 1 / 8, device="cuda"))
        assert abs(loss.item() - want_losses.sum().item() / 8) <= 1e-4 * abs(want_losses.sum().item() / 8)
        assert rel_err(logits.grad, want_d) < BF16_TOL
    assert_one_graph()
