"""triton_kernels.py section 10, the DC-MHA correction (dc_correction_*, dc_head_weights).

CPU: the reference against a dense float64 transcription written here from the math (explicit document and window
masks over all (query, key) pairs), forward and gradients, in float64 and float32; the published test vector; the
bf16 rounding points (w2 * A rounded, then the sum rounded once); the launchers' input checks; an sm_90 compile of
the kernels. The kernels under Triton's interpreter in float32 (the test_interp_* tests, run in a subprocess with
TRITON_INTERPRET=1 by test_kernels_under_triton_interpreter), both backward paths.
GPU (marked gpu): bf16 kernels against the float64 reference at the training micro-batch sizes, the deterministic
backward bit for bit reproducible, the atomic one close to it, and torch.compile(fullgraph=True) against eager.
"""
import inspect
import math
import os
import subprocess
import sys

import pytest
import torch

import triton_kernels as tk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRET, reason="run by test_kernels_under_triton_interpreter (TRITON_INTERPRET=1)")


def cu_seqlens_of(lens, pad=2, device="cpu"):
    """int32 boundaries of the documents `lens`, then `pad` repeats of T (the loader pads so)."""
    return torch.tensor([0] + list(lens) + [0] * pad, device=device).cumsum(0).to(torch.int32)


def padded_cu_seqlens(lens, device="cuda", capacity=256):
    """The loader's fixed-length boundaries (capacity documents), so compiled graphs keep one shape."""
    return cu_seqlens_of(lens, pad=capacity - len(lens), device=device)


def make_inputs(lens, H, D, dtype, seed, device="cpu"):
    """y, q, k, v (T, H, D) and w1 (normed), w2 (T, H), like the layer's: q, k of unit rms per head (QK-norm),
    w1 from raw gate values around 1."""
    g = torch.Generator(device=device).manual_seed(seed)
    T = sum(lens)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device)
    q, k = (torch.nn.functional.rms_norm(randn(T, H, D), (D,)) for _ in range(2))
    v, y = randn(T, H, D), 0.3 * randn(T, H, D)
    w1 = tk.dc_head_weights((1 + 0.3 * randn(T, H)).to(dtype))
    w2 = randn(T, H).to(dtype)
    return [t.to(dtype) for t in (y, q, k, v)] + [w1, w2]


def dc_float64(y, q, k, v, w1, w2, lens, scale, window):
    """The correction over all (query, key) pairs with explicit masks: key s is seen by query t iff both lie in one
    document, s <= t and t - s < window. float64, differentiable."""
    y, q, k, v, w1, w2 = (t.double() for t in (y, q, k, v, w1, w2))
    T = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    t, s = torch.arange(T)[:, None], torch.arange(T)[None, :]
    seen = (doc[:, None] == doc[None, :]) & (s <= t) & (t - s < window)               # (T, T)
    logits = scale * torch.einsum("thd,shd->hts", q, k)
    probs = torch.softmax(logits.masked_fill(~seen, float("-inf")), dim=-1)         # (H, T, T)
    mixed = torch.einsum("th,hts->ts", w1, probs)                                   # A (T, T)
    weights = w2.T[:, :, None] * mixed[None]                                        # C (H, T, T)
    return y + torch.einsum("hts,shd->thd", weights, v)


def grads_of(fn, inputs, grad):
    xs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*xs)
    return out.detach(), torch.autograd.grad(out, xs, grad)


NAMES = ("y", "q", "k", "v", "w1", "w2")

# (document lengths, window, H, D): documents shorter than the window (1 token too) and longer, an empty one (a
# repeated boundary), the record's window and shapes, and windows of 1 (each query sees itself only) and 7.
LAYOUTS = [([5, 150, 1, 60, 84], 112, 6, 128), ([250], 112, 2, 16), ([7, 1, 30, 0, 45], 7, 3, 16),
           ([3, 17, 20], 1, 2, 16)]


# ------------------------------------------------------------------------------------------------------------------
# The reference (CPU)
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lens, window, H, D", LAYOUTS)
def test_reference_is_the_dense_float64_transcription(lens, window, H, D):
    inputs = make_inputs(lens, H, D, torch.float64, seed=sum(lens) + window)
    cu, scale, T = cu_seqlens_of(lens), 0.3, sum(lens)
    grad = torch.randn(T, H, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got, got_g = grads_of(lambda *x: tk.dc_correction_reference(*x, cu, scale, window), inputs, grad)
    want, want_g = grads_of(lambda *x: dc_float64(*x, lens, scale, window), inputs, grad)
    assert got.dtype == torch.float64 and got.shape == (T, H, D)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(NAMES, got_g, want_g):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11, msg=lambda m: f"d{name}: {m}")
    assert (got - inputs[0]).abs().max() > 0.1, "no correction"


@pytest.mark.parametrize("lens, window, H, D", LAYOUTS)
def test_float32_reference_matches_float64(lens, window, H, D):
    """float32 in, fp32 math: a few fp32 roundings per term; one key too many or too few moves a tensor by ~1e-2."""
    inputs = make_inputs(lens, H, D, torch.float32, seed=sum(lens) + 2 * window)
    cu, scale, T = cu_seqlens_of(lens), 0.3, sum(lens)
    grad = torch.randn(T, H, D, generator=torch.Generator().manual_seed(2))
    got, got_g = grads_of(lambda *x: tk.dc_correction_reference(*x, cu, scale, window), inputs, grad)
    want, want_g = grads_of(lambda *x: dc_float64(*x, lens, scale, window), inputs, grad.double())
    assert got.dtype == torch.float32
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6
    for name, a, b in zip(NAMES, got_g, want_g):   # dq, dk vanish at window 1 (one key: a constant softmax)
        assert a.dtype == torch.float32, name
        assert ((a.double() - b).norm() / max(b.norm(), grad.norm())).item() < 1e-5, name


def test_published_test_vector():
    """H = 6, D = 2, window 3, documents [0, 4) and [4, 6): the raw gate values normed into w1, the mixed
    probabilities A and the corrected output, float64, to the digits given."""
    T, H, D, window, scale = 6, 6, 2, 3, 0.1
    t, h, d = (torch.arange(n, dtype=torch.float64) for n in (T, H, D))
    q = torch.cos(0.7 * t[:, None, None] + 0.3 * h[None, :, None] + 1.1 * d[None, None, :])
    k = torch.sin(0.5 * t[:, None, None] - 0.2 * h[None, :, None] + 0.9 * d[None, None, :] + 0.4)
    v = 0.1 * (t[:, None, None] + 1) - 0.05 * h[None, :, None] + 0.2 * d[None, None, :]
    w1 = tk.dc_head_weights(1 + 0.1 * h[None, :] - 0.05 * t[:, None])
    w2 = (0.01 * (h + 1)).expand(T, H)
    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    torch.testing.assert_close(w1[0], torch.tensor([0.79263602, 0.87189962, 0.95116322, 1.03042682, 1.10969042,
                                                    1.18895403], dtype=torch.float64), rtol=0, atol=1e-8)
    a = tk.dc_mixed_probs(q, k, w1, cu, scale, window)       # slot i of row t: key t - 2 + i
    rows = {0: {0: 5.944770132882}, 2: {0: 2.058530260407, 1: 1.963338445698, 2: 1.913041166728},
            3: {1: 2.020252969888, 2: 1.958412828141, 3: 1.950299371975}, 4: {4: 5.922173077248}}
    for row, keys in rows.items():
        want = torch.zeros(window, dtype=torch.float64)
        for key, value in keys.items():
            want[key - row + window - 1] = value
        torch.testing.assert_close(a[row], want, rtol=0, atol=1e-11, msg=lambda m: f"A row {row}: {m}")
    out = tk.dc_correction_reference(torch.zeros(T, H, D, dtype=torch.float64), q, k, v, w1, w2, cu, scale, window)
    head0 = [(0.005944770133, 0.017834310399), (0.008877513239, 0.020757796925), (0.011724330652, 0.023594150398),
             (0.017716941912, 0.029574872252), (0.029610865386, 0.041455211541), (0.032509379648, 0.044338111295)]
    torch.testing.assert_close(out[:, 0], torch.tensor(head0, dtype=torch.float64), rtol=0, atol=1e-11)
    torch.testing.assert_close(out[3, 5], torch.tensor([0.017367173923, 0.088514755963], dtype=torch.float64),
                               rtol=0, atol=1e-11)


def test_the_default_window_is_the_records_112_keys():
    """The record's window is 112 keys, the query itself included, and every entry point defaults to it: the
    reference at its default is the dense transcription at 112 keys, and tells it from 111 and 113 keys."""
    assert tk.DC_WINDOW == 112
    for fn in (tk.dc_correction_reference, tk.dc_mixed_probs, tk.dc_correction_fwd_triton,
               tk.dc_correction_bwd_triton, tk.dc_correction_triton):
        assert inspect.signature(fn).parameters["window"].default == 112, fn.__name__
    lens, H, D, scale = [300, 40], 2, 16, 0.3
    inputs = make_inputs(lens, H, D, torch.float64, seed=11)
    got = tk.dc_correction_reference(*inputs, cu_seqlens_of(lens), scale)
    torch.testing.assert_close(got, dc_float64(*inputs, lens, scale, 112), rtol=1e-12, atol=1e-12)
    for other in (111, 113):
        assert (got - dc_float64(*inputs, lens, scale, other)).abs().max() > 1e-4, other


def rounding_case(T, H, D, seed, device="cpu"):
    """Window 1 (each query sees itself: P = 1, A = sum_h w1) and v = 1, so out = round(y + round(w2 * A)). w1 on a
    1/64 grid makes A need more than bf16's 8 bits, and every product and sum is exact in fp32: the expected values
    are float64 ones rounded where the contract rounds."""
    g = torch.Generator(device=device).manual_seed(seed)
    w1 = (torch.randint(-128, 129, (T, H), generator=g, device=device) / 64).bfloat16()
    w2 = torch.randn(T, H, generator=g, device=device).bfloat16()
    a = w1.double().sum(1, keepdim=True)
    y = (torch.randn(T, H, 1, generator=g, device=device) * (w2.double() * a)[..., None]).expand(T, H, D)
    y = y.bfloat16().contiguous()
    q, k = (torch.randn(T, H, D, generator=g, device=device).bfloat16() for _ in range(2))
    v = torch.ones(T, H, D, device=device, dtype=torch.bfloat16)
    c = (w2.double() * a).bfloat16().double()[..., None]
    want = (y.double() + c).bfloat16()
    single = (y.double() + w2.double()[..., None] * a[..., None]).bfloat16()                # C not rounded
    a_rounded = (y.double() + (w2.double() * a.bfloat16().double()).bfloat16().double()[..., None]).bfloat16()
    return (y, q, k, v, w1, w2), want, single, a_rounded


def check_rounding_points(fn, device="cpu"):
    T, H, D = 64, 6, 16
    inputs, want, single, a_rounded = rounding_case(T, H, D, seed=3, device=device)
    cu = torch.tensor([0, 20, T], dtype=torch.int32, device=device)
    out = fn(*inputs, cu, 0.1, 1)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, want), f"{(out != want).sum().item()} of {out.numel()} differ"
    assert (want != single).any() and (want != a_rounded).any(), "the case does not tell the rounding points apart"


def test_bf16_reference_rounds_w2_times_a_then_the_sum():
    check_rounding_points(tk.dc_correction_reference)


def test_head_weights_are_an_rms_norm_over_the_heads_with_eps_1e_6():
    """bf16 in, fp32 math, one rounding: within half a bf16 ulp of the float64 formula. Rows of raw values near
    1e-3 (mean square 1e-6) tell eps 1e-6 from the trainer's rms eps."""
    g = torch.Generator().manual_seed(4)
    r1 = torch.randn(40, 6, generator=g) * torch.tensor([1.0, 1e-3]).repeat(20)[:, None]
    r1 = r1.bfloat16()
    got = tk.dc_head_weights(r1)
    x = r1.double()
    want = x / torch.sqrt(x.square().mean(1, keepdim=True) + 1e-6)
    assert got.dtype == torch.bfloat16 and got.shape == r1.shape
    assert ((got.double() - want).abs() <= 2 ** -8 * want.abs() + 1e-12).all()
    other_eps = x / torch.sqrt(x.square().mean(1, keepdim=True) + tk.RMS_EPS)
    assert ((other_eps - want).abs() > 2 ** -7 * want.abs()).any()
    torch.testing.assert_close(tk.dc_head_weights(x), want, rtol=1e-14, atol=0)


def test_zero_w2_leaves_y_and_only_w2_gets_a_gradient():
    """The record's init: w2 = 0 makes the output y exactly; of the inputs only y and w2 get gradients."""
    lens, H, D = [30, 50], 3, 16
    y, q, k, v, w1, w2 = make_inputs(lens, H, D, torch.bfloat16, seed=5)
    check_zero_w2(tk.dc_correction_reference, (y, q, k, v, w1, torch.zeros_like(w2)), cu_seqlens_of(lens))


def check_zero_w2(fn, inputs, cu):
    grad = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(6)).to(inputs[0])
    out, grads = grads_of(lambda *x: fn(*x, cu, 0.12, tk.DC_WINDOW), inputs, grad)
    assert torch.equal(out, inputs[0])
    assert torch.equal(grads[0], grad)
    for name, g in zip(NAMES[1:5], grads[1:5]):
        assert torch.equal(g, torch.zeros_like(g)), name
    assert grads[5].abs().min() > 0


def test_logit_scale_is_the_fp32_product_of_fp32_operands():
    """The kernels scale the logits by fp32(fp32(c) * fp32(log2 e)) for exp2, as the record's kernel forms it. At
    record 89's third-stage attention scale that product and the double product rounded once differ by an ulp."""
    import numpy as np
    stage3 = 0.12751752379570258
    for c in (stage3, 0.12, 0.1, 0.3, *torch.rand(20, generator=torch.Generator().manual_seed(0)).tolist()):
        assert tk.dc_logit_scale(c) == float(np.float32(c) * np.float32(math.log2(math.e))), c
    assert tk.dc_logit_scale(stage3) != float(np.float32(stage3 * math.log2(math.e)))


def test_launchers_reject_bad_input():
    """The checks run before any launch, so they are testable without a GPU or the interpreter."""
    y, q, k, v, w1, w2 = make_inputs([10, 6], 2, 16, torch.float32, seed=7)
    cu = cu_seqlens_of([10, 6])
    fwd = tk.dc_correction_fwd_triton
    cases = [((y, q, k, v[:15], w1, w2, cu, 0.1), "one shape"),
             ((y, q.double(), k, v, w1, w2, cu, 0.1), "bfloat16"),
             ((y, q, k.bfloat16(), v, w1, w2, cu, 0.1), "k is torch.bfloat16"),
             ((y, q, torch.randn(16, 2, 32)[..., ::2], v, w1, w2, cu, 0.1), "unit stride"),
             ((y, q, k, v, w1[:, :1], w2, cu, 0.1), r"w1 must be a contiguous \(16, 2\)"),
             ((y, q, k, v, w1, torch.cat([w2, w2], 1)[:, :2], cu, 0.1), "w2 must be a contiguous"),
             ((y, q, k, v, w1, w2, cu.long(), 0.1), "int32"),
             ((y, q, k, v, w1, w2, cu, 0.1, 0), "window must be 1"),
             ((y, q, k, v, w1, w2, cu, 0.1, tk._DC_MAX_WINDOW + 1), "window must be 1"),
             (tuple(t[..., :12] if t.ndim == 3 else t for t in (y, q, k, v)) + (w1, w2, cu, 0.1), "power of two")]
    for args, words in cases:
        with pytest.raises(ValueError, match=words):
            fwd(*args)
    lse = torch.zeros(2, 16)
    with pytest.raises(ValueError, match="lse must be"):
        tk.dc_correction_bwd_triton(y, q, k, v, w1, w2, lse[:, :15], cu, 0.1)
    with pytest.raises(ValueError, match="one shape"):
        tk.dc_correction_bwd_triton(y[:15], q, k, v, w1, w2, lse, cu, 0.1)


def test_key_tile_holds_the_window_and_the_block():
    assert tk._dc_key_tile(16, tk.DC_WINDOW) == 128    # the record's shape: one 128-key tile
    for bm in (16, 32):
        for window in range(1, tk._DC_MAX_WINDOW + 1):
            bn = tk._dc_key_tile(bm, window)
            assert bn >= bm + window - 1 and bn & (bn - 1) == 0 and bn >= 16


# ------------------------------------------------------------------------------------------------------------------
# sm_90 compile (ptxas ships with triton; no GPU needed)
# ------------------------------------------------------------------------------------------------------------------

def _dc_sm90_cases():
    strides = {s: "i32" for s in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
                                  "stride_yt", "stride_yh", "stride_ot", "stride_oh", "stride_gt", "stride_gh")}
    common = {"T": "i32", "window": "i32", "qk_scale": "fp32", "scale": "fp32", "start_ptr": "*i32",
              "end_ptr": "*i32", "lse_ptr": "*fp32", "rho_ptr": "*fp32", "a_ptr": "*fp32", "da_ptr": "*fp32", **strides}
    bf16 = ("q_ptr", "k_ptr", "v_ptr", "y_ptr", "g_ptr", "w1_ptr", "w2_ptr", "out_ptr", "dq_ptr", "dk_ptr", "dv_ptr",
            "dw1_ptr", "dw2_ptr")
    sig = {**common, **{n: "*bf16" for n in bf16}}
    consts = {"H": 6, "HEAD_DIM": 128}
    bm, warps, stages = tk._DC_TILES["fwd"]
    cases = [("fwd", tk._dc_fwd_kernel, {**consts, "BLOCK_M": bm, "BLOCK_N": tk._dc_key_tile(bm, tk.DC_WINDOW)},
              {"num_warps": warps, "num_stages": stages})]
    bm, warps, stages = tk._DC_TILES["dq"]
    for atomic in (False, True):
        cases.append((f"dq-atomic={atomic}", tk._dc_bwd_query_kernel,
                      {**consts, "BLOCK_M": bm, "BLOCK_N": tk._dc_key_tile(bm, tk.DC_WINDOW), "ATOMIC": atomic},
                      {"num_warps": warps, "num_stages": stages}))
    bm, bn, warps, stages = tk._DC_TILES["dkdv"]
    cases.append(("dkdv", tk._dc_bwd_key_kernel, {**consts, "BLOCK_M": bm, "BLOCK_N": bn},
                  {"num_warps": warps, "num_stages": stages}))
    out = []
    for name, kernel, c, opts in cases:
        params = inspect.signature(kernel.fn).parameters
        s = {n: t for n, t in sig.items() if n in params}
        out.append((name, kernel, s, c, opts, tuple(n for n in s if n.startswith("stride_") or n.endswith("_ptr"))))
    return out


def opcode(ptx_line):
    """The instruction of a PTX line, past a predicate guard (`@%p1 red.global...`); '' for none."""
    words = ptx_line.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


@pytest.mark.parametrize("fp64_scalars", [False, True])
@pytest.mark.parametrize("case", _dc_sm90_cases(), ids=lambda c: c[0])
def test_kernels_compile_for_h100(case, fp64_scalars):
    """No fp64 in the Triton IR, and a compile when inductor hands the float scalars over as fp64 (the kernels cast
    them); tensor-core products, shared memory that fits an H100, and atomics (bf16 adds) exactly in the atomic backward."""
    if INTERPRET:
        pytest.skip("the interpreter replaces triton.jit; run without TRITON_INTERPRET")
    from test_kernels import H100_MAX_SHARED, compile_for_h100
    name, kernel, sig, consts, opts, aligned = case
    if fp64_scalars:
        sig = {k: ("fp64" if v == "fp32" else v) for k, v in sig.items()}
    try:
        compiled = compile_for_h100(kernel, sig, consts, opts, (), aligned)
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(f"cannot compile for sm_90 here: {e}")
    ptx = compiled.asm["ptx"]
    if fp64_scalars:   # it compiles: no loop-carried value turned fp64 (which Triton rejects)
        return
    assert "f64" not in compiled.asm["ttir"], f"{name}: fp64 in the Triton IR"
    assert compiled.metadata.shared <= H100_MAX_SHARED, f"{name}: {compiled.metadata.shared} bytes of shared memory"
    assert "mma" in ptx, f"{name}: no tensor-core product"
    atomics = [line for line in ptx.splitlines() if opcode(line).startswith(("atom.", "red."))]
    if consts.get("ATOMIC"):
        assert atomics and all("bf16" in line for line in atomics), atomics[:3]
    else:
        assert not atomics, f"{name}: atomics in a deterministic kernel: {atomics[:3]}"


# ------------------------------------------------------------------------------------------------------------------
# The kernels under Triton's interpreter, float32
# ------------------------------------------------------------------------------------------------------------------

def test_kernels_under_triton_interpreter():
    """Runs this file's test_interp_* tests with TRITON_INTERPRET=1 (read at import, hence the subprocess)."""
    if INTERPRET:
        pytest.skip("already under the interpreter")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_interp_",
           os.path.join("tests", "test_dc.py")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"interpreter tests failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    last = proc.stdout.strip().splitlines()[-1]
    assert " passed" in last and "skipped" not in last, proc.stdout[-2000:]


def strided_copies(y, q, k, v):
    """y, q, k, v with the model's strides: q, k, v views of one (T, 3, H, D) projection, y a view of (T, 2, H, D)."""
    T, H, D = q.shape
    qkv = torch.stack([q, k, v], dim=1)
    y2 = torch.zeros(T, 2, H, D)
    y2[:, 1] = y
    return y2[:, 1], *qkv.unbind(1)


# (document lengths, window, H, D, strided, tiles): the record's window, H and D with a partial last query block;
# several blocks per document and documents shorter than a block; a window of 1; key-kernel blocks of 32 and 16
# keys with 16-row query blocks.
INTERP_CASES = [([3, 100, 47], 112, 6, 128, False, None),
                ([5, 40, 1, 30, 0, 61], 20, 3, 16, True, None),
                ([70, 9], 1, 2, 16, False, None),
                ([33, 90, 2], 37, 2, 32, True, {"dkdv": (16, 32, 1, 1)})]


@interp
@pytest.mark.parametrize("lens, window, H, D, strided, tiles", INTERP_CASES)
def test_interp_kernels_match_the_float64_reference(lens, window, H, D, strided, tiles):
    """fp32 kernels against the reference on float64 copies (the dense transcription, above): a few fp32 roundings
    per term, ~1e-7 of the norms; a key too many or too few moves a tensor by ~1e-2. Both backward paths."""
    T, scale = sum(lens), 1.2 / math.sqrt(D)    # logits of std ~1.2, as the record's 0.12 * sqrt(128) ~ 1.36
    inputs = make_inputs(lens, H, D, torch.float32, seed=T + window)
    cu = cu_seqlens_of(lens)
    grad = torch.randn(T, H, D, generator=torch.Generator().manual_seed(8))
    want, want_g = grads_of(lambda *x: tk.dc_correction_reference(*x, cu, scale, window),
                            [t.double() for t in inputs], grad.double())
    y, q, k, v = strided_copies(*inputs[:4]) if strided else inputs[:4]
    w1, w2 = inputs[4:]
    out, lse = tk.dc_correction_fwd_triton(y, q, k, v, w1, w2, cu, scale, window, tiles=tiles)
    assert out.shape == (T, H, D) and out.dtype == torch.float32 and out.is_contiguous()
    assert ((out.double() - want).norm() / want.norm()).item() < 1e-6
    for deterministic in (True, False):
        got_g = tk.dc_correction_bwd_triton(grad, q, k, v, w1, w2, lse, cu, scale, window, deterministic,
                                            tiles=tiles)
        for name, a, b in zip(NAMES[1:], got_g, want_g[1:]):
            assert a.shape == b.shape and a.dtype == torch.float32, name
            rel = ((a.double() - b).norm() / max(b.norm(), grad.norm())).item()   # dq, dk vanish at window 1
            assert rel < 1e-5, f"d{name} (deterministic={deterministic}): relative error {rel:.2e}"


@interp
def test_interp_autograd_function_is_the_launchers():
    """Through the custom ops and the autograd.Function: the same numbers as the launchers, y's gradient passed
    through, strided w1, w2 (slices of one gate output, as the model has them) made contiguous."""
    lens, H, D, window, scale = [20, 45, 3, 60], 2, 16, 24, 0.3
    y, q, k, v, w1, w2 = make_inputs(lens, H, D, torch.float32, seed=9)
    gates = torch.cat([w1, w2], dim=1)
    cu = cu_seqlens_of(lens)
    grad = torch.randn(sum(lens), H, D, generator=torch.Generator().manual_seed(10))
    for deterministic in (True, False):
        xs = [t.clone().requires_grad_() for t in (y, q, k, v, gates)]
        out = tk.dc_correction_triton(*xs[:4], xs[4][:, :H], xs[4][:, H:], cu, scale, window, deterministic)
        grads = torch.autograd.grad(out, xs, grad)
        out2, lse = tk.dc_correction_fwd_triton(y, q, k, v, w1, w2, cu, scale, window)
        grads2 = tk.dc_correction_bwd_triton(grad, q, k, v, w1, w2, lse, cu, scale, window, deterministic)
        assert torch.equal(out, out2)
        assert torch.equal(grads[0], grad)
        for a, b in zip(grads[1:4], grads2[:3]):
            assert torch.equal(a, b)
        assert torch.equal(grads[4], torch.cat(grads2[3:], dim=1))


@interp
def test_interp_every_launch_takes_the_fp32_logit_scale(monkeypatch):
    """The forward and both backward paths' launches scale the logits by dc_logit_scale(scale), and the kernels
    use the value it returns."""
    lens, H, D, window, scale = [30, 17], 2, 16, 24, 0.3
    y, q, k, v, w1, w2 = make_inputs(lens, H, D, torch.float32, seed=11)
    cu = cu_seqlens_of(lens)
    grad = torch.randn(sum(lens), H, D, generator=torch.Generator().manual_seed(12))
    real, asked = tk.dc_logit_scale, []

    def spy(c):
        asked.append(c)
        return real(c)
    monkeypatch.setattr(tk, "dc_logit_scale", spy)
    out, lse = tk.dc_correction_fwd_triton(y, q, k, v, w1, w2, cu, scale, window)
    assert asked == [scale]
    for deterministic, launches in ((True, 2), (False, 1)):
        asked.clear()
        tk.dc_correction_bwd_triton(grad, q, k, v, w1, w2, lse, cu, scale, window, deterministic)
        assert asked == [scale] * launches, deterministic
    monkeypatch.setattr(tk, "dc_logit_scale", lambda c: 2 * real(c))
    doubled, _ = tk.dc_correction_fwd_triton(y, q, k, v, w1, w2, cu, scale, window)
    expected = tk.dc_correction_reference(*(t.double() for t in (y, q, k, v, w1, w2)), cu, 2 * scale, window)
    assert not torch.equal(doubled, out)
    assert ((doubled.double() - expected).norm() / expected.norm()).item() < 1e-5


@interp
def test_interp_zero_w2_leaves_y_and_only_w2_gets_a_gradient():
    lens, H, D = [30, 50], 3, 16
    y, q, k, v, w1, w2 = make_inputs(lens, H, D, torch.float32, seed=5)
    check_zero_w2(tk.dc_correction_triton, (y, q, k, v, w1, torch.zeros_like(w2)), cu_seqlens_of(lens))


# ------------------------------------------------------------------------------------------------------------------
# GPU: bf16 against float64 at the training micro-batch sizes, determinism, torch.compile
# ------------------------------------------------------------------------------------------------------------------

MICRO_BATCHES = (16384, 32768, 49152)   # tokens per GPU in the three batch stages


def fineweb_like_lens(T, seed):
    """Document lengths summing to T: lognormal, median ~400, cut at 2048 (as the loader caps them)."""
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < T:
        lens.append(max(1, min(2048, int(math.exp(math.log(400.0) + torch.randn((), generator=g).item())))))
    lens[-1] -= sum(lens) - T
    return [n for n in lens if n > 0]


def reference_by_documents(inputs, grad, lens, scale, window, group=4096):
    """The float64 reference and its gradients, a few documents at a time (the correction never crosses a document
    boundary), so its O(T * window * H * D) backward fits at any T."""
    outs, grads, start = [], [[] for _ in inputs], 0
    groups, current = [], []
    for n in lens:
        if current and sum(current) + n > group:
            groups.append(current)
            current = []
        current.append(n)
    groups.append(current)
    for docs in groups:
        n = sum(docs)
        part = [t[start:start + n].double() for t in inputs]
        cu = cu_seqlens_of(docs, pad=0, device=grad.device)
        out, g = grads_of(lambda *x: tk.dc_correction_reference(*x, cu, scale, window), part,
                          grad[start:start + n].double())
        outs.append(out)
        for acc, gi in zip(grads, g):
            acc.append(gi)
        start += n
    return torch.cat(outs), [torch.cat(g) for g in grads]


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("T", MICRO_BATCHES)
def test_gpu_bf16_matches_float64(T):
    """The record's shapes (6 heads of 128, window 112, scale 0.12, q and k QK-normed). bf16 noise: C, dS and the
    outputs are rounded to bf16 (relative 2^-9 each); 4e-3 of the norm is a few times that, while one key too many
    or too few per query, or a wrong head, moves a tensor by 1e-2 or more."""
    H, D, scale, window = 6, 128, 0.12, tk.DC_WINDOW
    lens = fineweb_like_lens(T, seed=T)
    inputs = make_inputs(lens, H, D, torch.bfloat16, seed=T, device="cuda")
    cu = padded_cu_seqlens(lens)
    grad = torch.randn(T, H, D, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).bfloat16()
    want, want_g = reference_by_documents(inputs, grad, lens, scale, window)
    for deterministic in (True, False):
        out, got_g = grads_of(lambda *x: tk.dc_correction_triton(*x, cu, scale, window, deterministic), inputs, grad)
        assert out.dtype == torch.bfloat16 and out.shape == (T, H, D)
        assert rel(out, want) < 4e-3, rel(out, want)
        assert rel(out - inputs[0], want - inputs[0].double()) < 8e-3, "the correction alone"
        assert torch.equal(got_g[0], grad)
        for name, a, b in zip(NAMES[1:], got_g[1:], want_g[1:]):
            assert a.dtype == torch.bfloat16, name
            assert rel(a, b) < 1e-2, f"d{name} (deterministic={deterministic}): {rel(a, b):.2e}"


@pytest.mark.gpu
def test_gpu_deterministic_backward_is_reproducible_and_atomic_is_close():
    T, H, D, scale = 32768, 6, 128, 0.12
    lens = fineweb_like_lens(T, seed=2)
    y, q, k, v, w1, w2 = make_inputs(lens, H, D, torch.bfloat16, seed=2, device="cuda")
    cu = padded_cu_seqlens(lens)
    grad = torch.randn(T, H, D, device="cuda").bfloat16()
    out, lse = tk.dc_correction_fwd_triton(y, q, k, v, w1, w2, cu, scale)
    out2, lse2 = tk.dc_correction_fwd_triton(y, q, k, v, w1, w2, cu, scale)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    runs = [tk.dc_correction_bwd_triton(grad, q, k, v, w1, w2, lse, cu, scale) for _ in range(3)]
    for other in runs[1:]:
        for name, a, b in zip(NAMES[1:], runs[0], other):
            assert torch.equal(a, b), f"d{name} differs between runs"
    atomic = tk.dc_correction_bwd_triton(grad, q, k, v, w1, w2, lse, cu, scale, deterministic=False)
    for name, a, b in zip(NAMES[1:], atomic, runs[0]):
        # dq, dw1, dw2: one writer each on both paths (the same formulas, compiled apart: at most rare one-ulp
        # flips); dk, dv: bf16 adds of ~8 partial sums against one fp32 sum
        assert rel(a, b.double()) < (2e-3 if name in ("q", "w1", "w2") else 1e-2), name


@pytest.mark.gpu
def test_gpu_kernel_rounding_points():
    """Window 1 and v = 1 (rounding_case): the kernel's output is the float64 value rounded where the contract
    rounds, bit for bit: C = bf16(w2 * A), then bf16(y + C)."""
    check_rounding_points(lambda *x: tk.dc_correction_triton(*x), device="cuda")


@pytest.mark.gpu
def test_gpu_zero_w2_leaves_y_and_only_w2_gets_a_gradient():
    lens, H, D = fineweb_like_lens(16384, seed=3), 6, 128
    y, q, k, v, w1, w2 = make_inputs(lens, H, D, torch.bfloat16, seed=3, device="cuda")
    check_zero_w2(tk.dc_correction_triton, (y, q, k, v, w1, torch.zeros_like(w2)),
                  padded_cu_seqlens(lens))


@pytest.mark.gpu
def test_gpu_compiled_is_eager():
    """The correction inside a compiled function (with dc_head_weights and slices of one gate tensor, as the model
    will call it): one graph, no break, no recompile on new data, the output and gradients of eager."""
    from torch._dynamo.utils import counters
    T, H, D, scale = 16384, 6, 128, 0.12

    def layer(y, q, k, v, gates, cu):
        w1 = tk.dc_head_weights(gates[:, :H])
        return tk.dc_correction_triton(y, q, k, v, w1, gates[:, H:], cu, scale)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, fullgraph=True)
    for seed in (4, 5):
        lens = fineweb_like_lens(T, seed)
        y, q, k, v, _, w2 = make_inputs(lens, H, D, torch.bfloat16, seed=seed, device="cuda")
        gates = torch.cat([(1 + 0.3 * torch.randn(T, H, device="cuda")).bfloat16(), w2], dim=1)
        cu = padded_cu_seqlens(lens)
        grad = torch.randn(T, H, D, device="cuda").bfloat16()
        results = [grads_of(lambda *x: fn(*x, cu), (y, q, k, v, gates), grad) for fn in (compiled, layer)]
        (out_c, grads_c), (out_e, grads_e) = results
        # the kernels are the same; inductor may sum the six heads' squares of the rms norm in another order,
        # flipping a rare bf16 ulp of w1
        assert rel(out_c, out_e.double()) < 1e-3
        for name, a, b in zip(("y", "q", "k", "v", "gates"), grads_c, grads_e):
            assert rel(a, b.double()) < 1e-3, f"d{name}: {rel(a, b.double()):.2e}"
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, counters["stats"]["unique_graphs"]
