"""triton_kernels.py section 9, the fused q/k RMSNorm + rotary (qk_norm_rotary).

CPU: the reference against a float64 transcription of the trainer's unfused math (train_gpt.rms, then the rotary as
train_gpt.apply_rotary computed it before the fusion: a flip of each pair), the launchers' input checks,
an sm_90 compile of both kernels, and the kernels under Triton's interpreter in float32 (the test_interp_* tests, run
in a subprocess with TRITON_INTERPRET=1 by test_kernels_under_triton_interpreter).
GPU (marked gpu): bf16 kernels against the float64 reference, and torch.compile(fullgraph=True) against eager.

Tables: the trainer's (rotary_tables: sin[d^1] = -sin[d] within each pair) and random ones, on which a backward that
used -sin[d] for sin[d^1], or a row index off by one, would fail.
Key offset: k shifted as the trainer shifted it before the fusion (tk.shift_keys_by_one after the op), element by
element in key_offset_by_loop.
"""
import os
import subprocess
import sys

import pytest
import torch

import train_gpt as tg
import triton_kernels as tk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRET, reason="run by test_kernels_under_triton_interpreter (TRITON_INTERPRET=1)")


def make_inputs(T, H, hd, pos_mult, dtype, tables, seed, device="cpu"):
    """qkv (T, 3*H*hd) whose rows have scales spread over e^-2..e^2 (so the rms statistic matters), and tables with
    a few rows to spare beyond the pos_mult*T the op reads."""
    g = torch.Generator(device=device).manual_seed(seed)
    scale = torch.exp(torch.empty(T, 3 * H, 1, device=device).uniform_(-2, 2, generator=g))
    qkv = (torch.randn(T, 3 * H, hd, device=device, generator=g) * scale).reshape(T, 3 * H * hd).to(dtype)
    n_rows = pos_mult * T + 3
    if tables == "trainer":
        omega = tg.rotary_base_omega(hd, 1024.0, torch.device(device))
        cos, sin = tg.rotary_tables(omega, n_rows, dtype)
    else:
        cos, sin = (torch.empty(n_rows, hd // 2, device=device).uniform_(-1, 1, generator=g).to(dtype)
                    for _ in range(2))
    return qkv, cos, sin


def apply_rotary(x, cos, sin):
    """The trainer's unfused rotary: adjacent pairs of x's first half, out = x*cos + pairswap(x)*sin (the minus is in
    the sin table); the second half passes through."""
    half = x.shape[-1] // 2
    x_rot, x_pass = x[..., :half], x[..., half:]
    x_swapped = x_rot.unflatten(-1, (half // 2, 2)).flip(-1).flatten(-2)
    return torch.cat([x_rot * cos + x_swapped * sin, x_pass], dim=-1)


def trainer_qk(qkv, cos, sin, pos_mult, H, hd):
    """GPT.attention's q, k, v as the unfused trainer computed them (rms, then the rotary; paired layers view the
    heads in pairs and the tables as (T, 1, 2, hd/2))."""
    T = qkv.shape[0]
    q, k, v = qkv.view(T, 3, H, hd).unbind(1)
    q, k = tg.rms(q), tg.rms(k)
    if pos_mult == 2:
        c, s = cos[: 2 * T].view(T, 1, 2, hd // 2), sin[: 2 * T].view(T, 1, 2, hd // 2)
        q = apply_rotary(q.view(T, H // 2, 2, hd), c, s).view(T, H, hd)
        k = apply_rotary(k.view(T, H // 2, 2, hd), c, s).view(T, H, hd)
    else:
        c, s = cos[:T, None], sin[:T, None]
        q, k = apply_rotary(q, c, s), apply_rotary(k, c, s)
    return q, k, v


def key_offset_by_loop(k):
    """k (T, H, hd) with the key offset, one element at a time: dims [hd/2, hd) (the stationary half) of token t >= 1
    from token t - 1."""
    out = k.clone()
    hd = k.shape[-1]
    for t in range(1, k.shape[0]):
        for d in range(hd):
            if d >= hd // 2:
                out[t, :, d] = k[t - 1, :, d]
    return out


def grad_of(fn, qkv, grads):
    qkv = qkv.detach().clone().requires_grad_()
    outs = fn(qkv)
    (dqkv,) = torch.autograd.grad(outs, qkv, grads)
    return [o.detach() for o in outs], dqkv


def parts(dqkv, H, hd):
    """d(qkv) (T, 3*H*hd) -> its q, k and v parts, each (T, H, hd)."""
    return dqkv.view(dqkv.shape[0], 3, H, hd).unbind(1)


# ------------------------------------------------------------------------------------------------------------------
# The reference (CPU)
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tables", ["trainer", "random"])
@pytest.mark.parametrize("pos_mult, key_offset", [(1, False), (2, False), (1, True), (2, True)])
def test_reference_is_the_trainer_math_in_float64(pos_mult, key_offset, tables):
    T, H, hd = 29, 6, 32
    qkv, cos, sin = make_inputs(T, H, hd, pos_mult, torch.float64, tables, seed=pos_mult)
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(T, H, hd, generator=g, dtype=torch.float64) for _ in range(3)]
    got, got_d = grad_of(lambda x: tk.qk_norm_rotary_reference(x, cos, sin, pos_mult, key_offset), qkv, grads)

    def trainer(x):
        q, k, v = trainer_qk(x, cos, sin, pos_mult, H, hd)
        return q, key_offset_by_loop(k) if key_offset else k, v
    want, want_d = grad_of(trainer, qkv, grads)
    for name, a, b in zip("qkv", got, want):
        assert a.dtype == torch.float64 and a.shape == (T, H, hd) and a.is_contiguous() != (name == "v"), name
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(got_d, want_d, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got[0], tg.rms(qkv.view(T, 3, H, hd)[:, 0])), "nothing rotated"


@pytest.mark.parametrize("pos_mult", [1, 2])
def test_bf16_reference_is_the_float64_math_rounded_once(pos_mult):
    """bf16 in, fp32 math, one rounding: within half a bf16 ulp (2^-8 relative) of the exact value, plus fp32 error."""
    T, H, hd = 33, 4, 64
    qkv, cos, sin = make_inputs(T, H, hd, pos_mult, torch.bfloat16, "trainer", seed=11)
    got = tk.qk_norm_rotary_reference(qkv, cos, sin, pos_mult)
    exact = tk.qk_norm_rotary_reference(qkv.double(), cos.double(), sin.double(), pos_mult)
    for name, a, b in zip("qkv", got, exact):
        assert a.dtype == torch.bfloat16, name
        err = (a.double() - b).abs()
        assert (err <= 2 ** -8 * b.abs() + 1e-6).all(), f"{name}: max error {err.max().item():.3g}"
    assert torch.equal(got[2], qkv.view(T, 3, H, hd)[:, 2])


def check_v_is_a_view_with_its_gradient(fn):
    """A copy of v would be saved by attention beside qkv (which the backward keeps anyway): v must share qkv's
    memory and still receive its gradient."""
    T, H, hd = 7, 2, 16
    qkv, cos, sin = make_inputs(T, H, hd, 1, torch.float32, "random", seed=9)
    x = qkv.clone().requires_grad_()
    q, k, v = fn(x, cos, sin, 1)
    assert v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert torch.equal(v, qkv.view(T, 3, H, hd)[:, 2]) and q.is_contiguous() and k.is_contiguous()
    w = torch.randn(T, H, hd, generator=torch.Generator().manual_seed(1))
    (v * w + q).sum().backward()
    assert torch.equal(parts(x.grad, H, hd)[2], w)


def test_reference_v_is_a_view_of_qkv():
    check_v_is_a_view_with_its_gradient(tk.qk_norm_rotary_reference)


def test_launchers_reject_layouts_the_kernels_do_not_handle():
    """The checks run before any launch, so they are testable without a GPU or the interpreter."""
    qkv, cos, sin = make_inputs(8, 2, 16, 2, torch.float32, "random", seed=5)
    cases = [((qkv.T.contiguous().T, cos, sin, 1), "contiguous"),
             ((qkv[:, :-16], cos, sin, 1), "width"),
             ((qkv, cos[:15], sin[:15], 2), "rows"),
             ((qkv, cos, sin, 3), "pos_mult"),
             ((qkv.double(), cos, sin, 1), "dtype"),
             ((qkv, cos[:, :6], sin[:, :6], 1), "power of 2")]
    for args, words in cases:
        with pytest.raises(ValueError, match=words):
            tk.qk_norm_rotary_fwd_triton(*args)
    grads = [torch.zeros(8, 2, 16) for _ in range(3)]
    with pytest.raises(ValueError, match="dk must be a contiguous"):
        tk.qk_norm_rotary_bwd_triton(grads[0], grads[1].transpose(0, 1).contiguous().transpose(0, 1), grads[2],
                                     qkv, cos, sin, 1)


@pytest.mark.parametrize("kernel", ["fwd", "bwd"])
@pytest.mark.parametrize("pos_mult, key_offset", [(1, False), (2, False), (1, True)])
def test_kernels_compile_for_h100_without_fp64(kernel, pos_mult, key_offset):
    if INTERPRET:
        pytest.skip("the interpreter replaces triton.jit; run without TRITON_INTERPRET")
    from test_kernels import compile_for_h100
    names = (("qkv_ptr", "cos_ptr", "sin_ptr", "q_ptr", "k_ptr") if kernel == "fwd"
             else ("dq_ptr", "dk_ptr", "dv_ptr", "qkv_ptr", "cos_ptr", "sin_ptr", "dqkv_ptr"))
    sig = {**{n: "*bf16" for n in names}, "stride_tab": "i32", "n_rows": "i32", "H": "i32"}
    fn = tk._qk_rotary_fwd_kernel if kernel == "fwd" else tk._qk_rotary_bwd_kernel
    consts = {"POS_MULT": pos_mult, "KEY_OFFSET": key_offset, "HD": 128, "EPS": tk.RMS_EPS,
              "BLOCK_R": tk._QK_ROTARY_ELEMENTS // 128}
    try:
        compiled = compile_for_h100(fn, sig, consts, {"num_warps": tk._QK_ROTARY_WARPS}, (), tuple(sig))
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(f"cannot compile for sm_90 here: {e}")
    assert "f64" not in compiled.asm["ttir"]


# ------------------------------------------------------------------------------------------------------------------
# The kernels under Triton's interpreter, float32
# ------------------------------------------------------------------------------------------------------------------

def test_kernels_under_triton_interpreter():
    """Runs this file's test_interp_* tests with TRITON_INTERPRET=1 (read at import, hence the subprocess)."""
    if INTERPRET:
        pytest.skip("already under the interpreter")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_interp_",
           os.path.join("tests", "test_qk_rotary.py")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"interpreter tests failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    last = proc.stdout.strip().splitlines()[-1]
    assert " passed" in last and "skipped" not in last, proc.stdout[-2000:]


# (T, H, hd, rows per program, tables); T = 1 has no previous token for the key offset
INTERP_CASES = [(37, 4, 32, None, "random"), (37, 4, 32, 16, "trainer"), (5, 6, 128, None, "random"),
                (3, 2, 8, 1, "random"), (1, 2, 8, None, "random")]


@interp
@pytest.mark.parametrize("T, H, hd, rows, tables", INTERP_CASES)
@pytest.mark.parametrize("pos_mult, key_offset", [(1, False), (2, False), (1, True), (2, True)])
def test_interp_forward_and_backward_match_the_reference(T, H, hd, rows, tables, pos_mult, key_offset):
    qkv, cos, sin = make_inputs(T, H, hd, pos_mult, torch.float32, tables, seed=T * hd + pos_mult)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(T, H, hd, generator=g) for _ in range(3)]
    want, want_d = grad_of(lambda x: tk.qk_norm_rotary_reference(x, cos, sin, pos_mult, key_offset), qkv, grads)

    got = tk.qk_norm_rotary_fwd_triton(qkv, cos, sin, pos_mult, key_offset, rows=rows)
    assert len(got) == 2
    for name, a, b in zip("qk", got, want):
        assert a.dtype == torch.float32 and a.shape == (T, H, hd) and a.is_contiguous(), name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")

    got_d = tk.qk_norm_rotary_bwd_triton(*grads, qkv, cos, sin, pos_mult, key_offset, rows=rows)
    assert got_d.shape == qkv.shape and got_d.dtype == qkv.dtype
    for name, a, b in zip("qkv", parts(got_d, H, hd), parts(want_d, H, hd)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=lambda m: f"d{name}: {m}")
    assert torch.equal(parts(got_d, H, hd)[2], grads[2]), "dv is not an exact copy"


@interp
def test_interp_v_is_a_view_of_qkv():
    check_v_is_a_view_with_its_gradient(tk.qk_norm_rotary_triton)


@interp
@pytest.mark.parametrize("pos_mult", [1, 2])
def test_interp_autograd_function_with_strided_gradients(pos_mult):
    """Through the custom ops and the autograd.Function; the incoming gradients are transposed views (made contiguous
    by the backward), and only q and v are used, so k's gradient arrives as zeros."""
    T, H, hd = 11, 4, 16
    qkv, cos, sin = make_inputs(T, H, hd, pos_mult, torch.float32, "random", seed=21)
    wq, wv = (torch.randn(H, T, hd, generator=torch.Generator().manual_seed(s)).transpose(0, 1) for s in (2, 3))

    def loss(fn, x):
        q, k, v = fn(x, cos, sin, pos_mult)
        return (q * wq).sum() + (v * wv).sum()

    results = []
    for fn in (tk.qk_norm_rotary_triton, tk.qk_norm_rotary_reference):
        x = qkv.clone().requires_grad_()
        loss(fn, x).backward()
        results.append(x.grad)
    got_q, got_k, got_v = parts(results[0], H, hd)
    want_q, want_k, want_v = parts(results[1], H, hd)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5 * want_q.abs().max().item())
    assert torch.equal(got_k, torch.zeros_like(got_k)) and torch.equal(got_v, wv)


# ------------------------------------------------------------------------------------------------------------------
# GPU: bf16 against float64, and torch.compile
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("T, H, hd, tables", [(4096, 6, 128, "trainer"), (1000, 6, 128, "random"),
                                              (333, 4, 32, "trainer")])
@pytest.mark.parametrize("pos_mult, key_offset", [(1, False), (2, False), (1, True)])
def test_gpu_bf16_matches_float64(T, H, hd, tables, pos_mult, key_offset):
    qkv, cos, sin = make_inputs(T, H, hd, pos_mult, torch.bfloat16, tables, seed=T + pos_mult, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(4)
    grads = [torch.randn(T, H, hd, device="cuda", generator=g).bfloat16() for _ in range(3)]
    got, got_d = grad_of(lambda x: tk.qk_norm_rotary_triton(x, cos, sin, pos_mult, key_offset), qkv, grads)
    exact = tk.qk_norm_rotary_reference(qkv.double(), cos.double(), sin.double(), pos_mult, key_offset)
    if key_offset:  # k's gradient before the shift, as autograd forms it in bf16 (token 0 sums two terms)
        k0 = torch.zeros_like(grads[1], requires_grad=True)
        grads = [grads[0], *torch.autograd.grad(tk.shift_keys_by_one(k0), k0, grads[1]), grads[2]]
    _, exact_d = grad_of(lambda x: tk.qk_norm_rotary_reference(x, cos.double(), sin.double(), pos_mult),
                         qkv.double(), [t.double() for t in grads])
    # forward: one bf16 rounding of an fp32 value within a few fp32 ulps of the exact one: at most one bf16 ulp
    for name, a, b in zip("qkv", got, exact):
        assert a.dtype == torch.bfloat16 and a.shape == (T, H, hd) and a.is_contiguous() != (name == "v"), name
        err = (a.double() - b).abs()
        assert (err <= 2 ** -7 * b.abs() + 1e-5).all(), f"{name}: max error {err.max().item():.3g}"
    assert torch.equal(got[2], qkv.view(T, 3, H, hd)[:, 2])
    # backward: one bf16 rounding, plus fp32 cancellation in dn - n*mean(dn*n) (relative to the row's largest terms)
    assert got_d.dtype == torch.bfloat16 and got_d.shape == qkv.shape
    for name, a, b in zip("qkv", parts(got_d, H, hd), parts(exact_d, H, hd)):
        err = (a.double() - b).abs()
        bound = 2 ** -7 * b.abs() + 2 ** -16 * b.abs().amax(dim=-1, keepdim=True)
        assert (err <= bound).all(), f"d{name}: max error {err.max().item():.3g}, {(err / bound).max().item():.3g}x"
    assert torch.equal(parts(got_d, H, hd)[2], grads[2])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [4096, 1])
def test_gpu_key_offset_is_the_shift_after_the_op_bit_for_bit(T):
    """The kernels' key offset against shift_keys_by_one applied to their unshifted k, eager: the same k, and the same
    d(qkv), including token 0's sum of its own and token 1's gradient, which autograd rounds to bf16."""
    H, hd = 6, 128
    qkv, cos, sin = make_inputs(T, H, hd, 1, torch.bfloat16, "trainer", seed=T, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(6)
    grads = [torch.randn(T, H, hd, device="cuda", generator=g).bfloat16() for _ in range(3)]

    def shifted_after(x):
        q, k, v = tk.qk_norm_rotary_triton(x, cos, sin, 1)
        return q, tk.shift_keys_by_one(k), v
    got, got_d = grad_of(lambda x: tk.qk_norm_rotary_triton(x, cos, sin, 1, True), qkv, grads)
    want, want_d = grad_of(shifted_after, qkv, grads)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(got_d, want_d), f"max difference {(got_d - want_d).float().abs().max()}"


@pytest.mark.gpu
def test_gpu_compiled_is_eager():
    """Normal, key offset and paired layers in one compiled function: one graph, no break, no recompile on new data,
    and the same outputs and d(qkv) as eager. Each layer reads its own copy of qkv: summing three layers' d(qkv) in
    bf16 is rounded in a different order eager and compiled."""
    from torch._dynamo.utils import counters
    T, H, hd = 2048, 6, 128
    layers = ((1, False), (2, False), (1, True))

    def step(qkvs, cos, sin, w):
        total = 0
        for layer, (qkv, (pos_mult, key_offset)) in enumerate(zip(qkvs, layers)):
            q, k, v = tk.qk_norm_rotary_triton(qkv, cos, sin, pos_mult, key_offset)
            total = total + sum((t.float() * w[i]).sum() for i, t in enumerate((q, k, v))) * (layer + 1)
        return total

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True)
    for seed in (12, 13):
        qkv, cos, sin = make_inputs(T, H, hd, 2, torch.bfloat16, "trainer", seed=seed, device="cuda")
        w = torch.randn(3, T, H, hd, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
        results = []
        for fn in (compiled, step):
            xs = [qkv.clone().requires_grad_() for _ in layers]
            out = fn(xs, cos, sin, w)
            out.backward()
            results.append((out.detach(), [x.grad for x in xs]))
        (out_c, grads_c), (out_e, grads_e) = results
        torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-3)
        for layer, grad_c, grad_e in zip(layers, grads_c, grads_e):
            assert torch.equal(grad_c, grad_e), f"{layer}: max difference {(grad_c - grad_e).float().abs().max()}"
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, counters["stats"]["unique_graphs"]
