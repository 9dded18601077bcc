"""CPU tests of the optimizer kernels (triton_kernels.py sections 5-7): the kernels under Triton's interpreter (in a
subprocess, tests/_optimizer_kernels_interp.py), the references against train_gpt's eager code, the exact fp32 FMA
the tests transcribe CUDA's eager Adam with, and the sm_90 PTX of the kernels: every fp32 operation rounds on its
own (no contraction, IEEE division and square root, no flush to zero) except the deliberate FMAs (Adam's two, one
per lerp of the momentum, one of the split product).
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import train_gpt as tg
import triton_kernels as tk
from _fp32_exact import fma32

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_optimizer_kernels_under_triton_interpreter():
    """Runs tests/_optimizer_kernels_interp.py with TRITON_INTERPRET=1 (chosen at import, so it needs its own
    process)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           os.path.join("tests", "_optimizer_kernels_interp.py")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"interpreter tests failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


# ------------------------------------------------------------------------------------------------------------------
# The exact fp32 FMA of the test transcriptions
# ------------------------------------------------------------------------------------------------------------------

def test_fma32_is_correctly_rounded():
    """Against the C library fma that Triton's interpreter uses, on random triples (with cancellation) and on a
    triple whose float64 sum lands exactly on an fp32 midpoint: a plain float64 evaluation rounds twice there."""
    interp = pytest.importorskip("triton._C.libtriton").interpreter
    g = torch.Generator().manual_seed(0)
    a = torch.randn(20000, generator=g) * torch.exp(torch.randn(20000, generator=g) * 4)
    b = torch.randn(20000, generator=g)
    c = torch.where(torch.arange(20000) % 2 == 0, -(a * b) * (1 + torch.randn(20000, generator=g) * 1e-6),
                    torch.randn(20000, generator=g))
    want = interp.fma_fp32(a.numpy(), b.numpy(), c.numpy())
    assert np.array_equal(fma32(a, b, c).numpy().view(np.int32), want.view(np.int32))
    # a*b = 2^-24 (1 + 2^-33) exactly; 1 + a*b rounds to 1 + 2^-24 in float64, a tie that fp32 breaks to 1.0, while
    # the exact sum is just above the tie: the correctly rounded result is 1 + 2^-23.
    a1, b1, c1 = (torch.tensor([x], dtype=torch.float32) for x in (2.0 ** -24 * (1 + 2.0 ** -11),
                                                                     1 - 2.0 ** -11 + 2.0 ** -22, 1.0))
    assert (a1.double() * b1.double() + c1.double()).float().item() == 1.0          # the double rounding
    assert fma32(a1, b1, c1).item() == 1 + 2.0 ** -23
    assert interp.fma_fp32(a1.numpy(), b1.numpy(), c1.numpy()).item() == 1 + 2.0 ** -23


# ------------------------------------------------------------------------------------------------------------------
# References: the same eager code as train_gpt (which keeps running it on CPU)
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_adam_reference_is_train_gpt_eager_update(dtype):
    g = torch.Generator().manual_seed(1)
    p = (torch.randn(40, 30, generator=g) * 0.1).to(dtype)
    grad = (torch.randn(40, 30, generator=g) * 1e-2).to(dtype)
    m, v = torch.randn(40, 30, generator=g) * 1e-3, torch.rand(40, 30, generator=g) * 1e-4
    kw = dict(beta1=0.75, beta2=0.95, eps=1e-10, step_size=0.01, decay=0.3)
    ours = [t.clone() for t in (p, m, v)]
    tk.adam_update_reference(ours[0], grad, ours[1], ours[2], **kw)
    theirs = [t.clone() for t in (p, m, v)]
    tg.adam_update(theirs[0], grad, theirs[1], theirs[2], **kw, ops=tg.kernel_ops("fused", "cpu"))
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert not torch.equal(ours[0], p)


@pytest.mark.parametrize("per_matrix_lr", [False, True])
def test_cautious_reference_is_train_gpt_eager_update(per_matrix_lr):
    g = torch.Generator().manual_seed(2)
    n, R, C = 3, 12, 20
    param = torch.randn(n, R, C, generator=g).bfloat16()
    mantissa = torch.randint(0, 1 << 16, (n, R, C), generator=g, dtype=torch.int32).to(torch.uint16)
    O = torch.randn(n, C, R, generator=g).bfloat16().mT
    O[:, :3] = 0
    lr = torch.tensor([0.25, 0.5, 0.125]).view(n, 1, 1) if per_matrix_lr else 0.0123
    results = []
    for fn in (lambda p, m: tk.cautious_update_with_mantissa_reference(p, m, O, lr, 0.9),
               lambda p, m: tg.kernel_ops("fused", "cpu").cautious_update(p, m, O, lr=lr, wd=0.9)):
        p, m = param.clone(), mantissa.clone()
        fn(p, m)
        results.append((p.view(torch.int16), m.view(torch.int16)))
    for p, m in results[1:]:
        assert torch.equal(p, results[0][0]) and torch.equal(m, results[0][1])
    assert not torch.equal(results[0][1], mantissa.view(torch.int16))


def test_normuon_references_are_train_gpt_eager_code():
    """The section-7 references (what train_gpt runs off CUDA and with --kernels=torch) give the same bits as the
    eager chains they replaced."""
    g = torch.Generator().manual_seed(3)
    grad = (torch.randn(3, 12, 20, generator=g) * 1e-3).bfloat16()
    M = torch.randn(3, 12, 20, generator=g) * 1e-3
    mu = 0.95
    M_old = M.clone()
    G = grad.to(torch.float32)
    M_old.lerp_(G, 1 - mu)
    X_old = G.lerp(M_old, mu).to(torch.bfloat16)
    M_new = M.clone()
    X_new = tk.normuon_momentum_reference(grad, M_new, mu)
    assert torch.equal(M_new, M_old) and torch.equal(X_new.view(torch.int16), X_old.view(torch.int16))
    Y = torch.randn(3, 12, 20, generator=g).bfloat16()
    X = torch.randn(3, 20, 12, generator=g).bfloat16().mT
    a = 4.042929935166739
    want = Y.to(torch.float32).add_(X, alpha=a).to(torch.bfloat16)
    got = tk.polar_split_product_reference(Y.clone(), X, a)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


# ------------------------------------------------------------------------------------------------------------------
# sm_90 PTX: where the kernels round (ptxas ships with triton; no GPU needed)
# ------------------------------------------------------------------------------------------------------------------

ADAM_SIG = {"param_ptr": "*bf16", "grad_ptr": "*bf16", "exp_avg_ptr": "*fp32", "exp_avg_sq_ptr": "*fp32",
            "n_elements": "i32", "beta1": "fp32", "beta2": "fp32", "one_minus_beta1": "fp32",
            "one_minus_beta2": "fp32", "eps": "fp32", "step_size": "fp32", "decay": "fp32"}
CAUTIOUS_SIG = {"param_ptr": "*bf16", "mantissa_ptr": "*u16", "o_ptr": "*bf16", "lr_ptr": "*fp32", "R": "i32",
                "C": "i32", "stride_on": "i32", "stride_or": "i32", "stride_oc": "i32", "lr_scalar": "fp32",
                "wd": "fp32"}


def sm90_ptx(kernel, signature, constexprs, num_warps, contiguous, aligned):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter replaces triton.jit; run without TRITON_INTERPRET")
    from test_kernels import compile_for_h100
    try:
        compiled = compile_for_h100(kernel, signature, constexprs, {"num_warps": num_warps, **tk._EXACT_FP_OPTIONS},
                                    contiguous, aligned)
    except (ImportError, FileNotFoundError, RuntimeError) as e:  # no CUDA backend / ptxas in this triton install
        if "ptxas" in str(e) or isinstance(e, (ImportError, FileNotFoundError)):
            pytest.skip(f"cannot compile for sm_90 here: {e}")
        raise
    assert "f64" not in compiled.asm["ttir"]
    assert compiled.metadata.shared <= 232448
    return compiled.asm["ptx"]


def count(ptx: str, instr: str) -> int:
    return len(re.findall(rf"^\s*(?:@!?%p\d+\s+)?{re.escape(instr)}\s", ptx, re.M))


def assert_each_fp32_op_rounds_on_its_own(ptx: str) -> None:
    """Only .rn arithmetic (ptxas may fuse a mul.f32 into an add.f32, never a mul.rn.f32), no approximate division or
    square root, no flushing of subnormals."""
    loose = re.findall(r"^\s*(?:@!?%p\d+\s+)?((?:mul|add|sub|fma|div|sqrt)\.f32)\s", ptx, re.M)
    assert not loose, f"fp32 operations without a rounding modifier: {sorted(set(loose))}"
    assert ".approx" not in ptx and "div.full" not in ptx and ".ftz" not in ptx


@pytest.mark.parametrize("dtypes", [("*bf16", "*bf16"), ("*fp32", "*fp32")])
def test_adam_kernel_ptx_rounds_like_eager(dtypes):
    sig = {**ADAM_SIG, "param_ptr": dtypes[0], "grad_ptr": dtypes[1]}
    ptx = sm90_ptx(tk._adam_kernel, sig, {"BLOCK": tk._ADAM_BLOCK}, tk._ADAM_WARPS, (),
                   ("param_ptr", "grad_ptr", "exp_avg_ptr", "exp_avg_sq_ptr", "n_elements"))
    assert_each_fp32_op_rounds_on_its_own(ptx)
    per_thread = tk._ADAM_BLOCK // (32 * tk._ADAM_WARPS)
    # per element: one IEEE square root and division, and exactly the two FMAs of the eager add_/addcmul_
    assert count(ptx, "sqrt.rn.f32") == count(ptx, "div.rn.f32") == per_thread
    assert count(ptx, "fma.rn.f32") == 2 * per_thread
    # 7 products: m*b1, g*g, v*b2, q*step_size, u*p, decay*p, (decay*p)*mask; then u + w and p - u
    assert count(ptx, "mul.rn.f32") == 7 * per_thread
    assert count(ptx, "add.rn.f32") == 2 * per_thread and count(ptx, "sub.rn.f32") == per_thread


@pytest.mark.parametrize("o_layout", ["contiguous", "transposed"])
def test_cautious_kernel_ptx_rounds_like_eager_and_loads_o_vectorised(o_layout):
    unit = "stride_oc" if o_layout == "contiguous" else "stride_or"
    other = "stride_or" if o_layout == "contiguous" else "stride_oc"
    bm, bn = tk._CAUTIOUS_TILE
    ptx = sm90_ptx(tk._cautious_mantissa_kernel, CAUTIOUS_SIG, {"LR_PER_MATRIX": True, "BLOCK_R": bm, "BLOCK_C": bn},
                   tk._CAUTIOUS_WARPS, (unit,), ("param_ptr", "mantissa_ptr", "o_ptr", "R", "C", "stride_on", other))
    assert_each_fp32_op_rounds_on_its_own(ptx)
    per_thread = bm * bn // (32 * tk._CAUTIOUS_WARPS)
    assert count(ptx, "fma.rn.f32") == 0
    # 5 products (O*P, P*mask, *wd, *lr, O*lr) and 2 differences per element
    assert count(ptx, "mul.rn.f32") == 5 * per_thread and count(ptx, "sub.rn.f32") == 2 * per_thread
    # O is read in 16-byte vectors whichever of its axes is contiguous (the MLP bank's O is a transposed view)
    assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx)
    assert not re.search(r"ld\.global(\.\w+)*\.(b16|u16)\s", ptx), "O loaded element by element"


MOMENTUM_SIG = {"grad_ptr": "*bf16", "m_ptr": "*fp32", "x_ptr": "*bf16", "n_elements": "i32", "w_m": "fp32",
                "w_x": "fp32"}
SPLIT_SIG = {"y_ptr": "*bf16", "x_ptr": "*bf16", "R": "i32", "C": "i32", "stride_xn": "i32", "stride_xr": "i32",
             "stride_xc": "i32", "a": "fp32"}


def test_momentum_kernel_ptx_rounds_like_eager():
    """The trainer's branches (mu > 0.5): per element the two lerps' differences and one FMA each, nothing else."""
    ptx = sm90_ptx(tk._normuon_momentum_kernel, MOMENTUM_SIG,
                   {"SMALL_M": True, "SMALL_X": False, "BLOCK": tk._MOMENTUM_BLOCK}, tk._MOMENTUM_WARPS, (),
                   ("grad_ptr", "m_ptr", "x_ptr", "n_elements"))
    assert_each_fp32_op_rounds_on_its_own(ptx)
    per_thread = tk._MOMENTUM_BLOCK // (32 * tk._MOMENTUM_WARPS)
    assert count(ptx, "fma.rn.f32") == 2 * per_thread
    assert count(ptx, "mul.rn.f32") == 0
    # g - m and m' - g per element, plus the one 1 - w of the look-ahead's weight
    assert count(ptx, "sub.rn.f32") + count(ptx, "add.rn.f32") == 2 * per_thread + 1


@pytest.mark.parametrize("x_layout", ["contiguous", "transposed"])
def test_split_product_kernel_ptx_is_one_fma_and_loads_x_vectorised(x_layout):
    unit = "stride_xc" if x_layout == "contiguous" else "stride_xr"
    other = "stride_xr" if x_layout == "contiguous" else "stride_xc"
    bm, bn = tk._SPLIT_TILE
    ptx = sm90_ptx(tk._split_product_kernel, SPLIT_SIG, {"BLOCK_R": bm, "BLOCK_C": bn}, tk._SPLIT_WARPS, (unit,),
                   ("y_ptr", "x_ptr", "R", "C", "stride_xn", other))
    assert_each_fp32_op_rounds_on_its_own(ptx)
    per_thread = bm * bn // (32 * tk._SPLIT_WARPS)
    assert count(ptx, "fma.rn.f32") == per_thread
    assert count(ptx, "mul.rn.f32") == count(ptx, "add.rn.f32") == count(ptx, "sub.rn.f32") == 0
    assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx)
    assert not re.search(r"ld\.global(\.\w+)*\.(b16|u16)\s", ptx), "X loaded element by element"
