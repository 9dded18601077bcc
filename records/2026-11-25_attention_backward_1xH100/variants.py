"""Experiment: variants of the Triton attention backward (and forward loop structure)."""
import os
import sys

import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import triton_kernels as tk  # noqa: E402
from triton_kernels import _attn_block_ranges, _attn_query_block, document_bounds, _LOG2E  # noqa: E402


@triton.jit
def fwd_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, n0, rows, row_start, window, qk_scale,
             stride_kt, stride_vt, T, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = (cols < T)[:, None]
    k = tl.load(k_ptrs + n0 * stride_kt, mask=col_ok, other=0.0)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        keep = ((cols[None, :] >= row_start[:, None]) & (cols[None, :] <= rows[:, None])
                & (cols[None, :] >= rows[:, None] - window))
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    p = tl.exp2(s - m_new_safe[:, None])
    alpha = tl.exp2(m_i - m_new_safe)
    v = tl.load(v_ptrs + n0 * stride_vt, mask=col_ok, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, start_ptr, T, window, qk_scale,
               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
               stride_oh, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, SINGLE: tl.constexpr):
    qk_scale = tl.cast(qk_scale, tl.float32)
    m0 = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    rows, row_ok, row_start, b0, f0, f1, b1 = _attn_query_block(start_ptr, m0, T, window, BLOCK_M,
                                                                BLOCK_N)
    q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    cols0 = tl.arange(0, BLOCK_N)
    k_ptrs = k_ptr + cols0.to(tl.int64)[:, None] * stride_kt + h * stride_kh + d[None, :]
    v_ptrs = v_ptr + cols0.to(tl.int64)[:, None] * stride_vt + h * stride_vh + d[None, :]
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    if SINGLE:
        for n0 in range(b0, b1, BLOCK_N):
            acc, l_i, m_i = fwd_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, n0, rows, row_start,
                                     window, qk_scale, stride_kt, stride_vt, T, BLOCK_N, True)
    else:
        for n0 in range(b0, f0, BLOCK_N):
            acc, l_i, m_i = fwd_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, n0, rows, row_start,
                                     window, qk_scale, stride_kt, stride_vt, T, BLOCK_N, True)
        for n0 in range(f0, f1, BLOCK_N):
            acc, l_i, m_i = fwd_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, n0, rows, row_start,
                                     window, qk_scale, stride_kt, stride_vt, T, BLOCK_N, False)
        for n0 in range(f1, b1, BLOCK_N):
            acc, l_i, m_i = fwd_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, n0, rows, row_start,
                                     window, qk_scale, stride_kt, stride_vt, T, BLOCK_N, True)
    out = acc / l_i[:, None]
    tl.store(o_ptr + rows.to(tl.int64)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + h * T + rows, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def dkdv_step(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, m0, cols, col_end, window,
              qk_scale, stride_qt, stride_dot, T, BLOCK_M: tl.constexpr,
              MASKED: tl.constexpr, REORDER: tl.constexpr):
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    q = tl.load(q_ptrs + m0 * stride_qt, mask=row_ok[:, None], other=0.0)
    do = tl.load(do_ptrs + m0 * stride_dot, mask=row_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
    if REORDER:
        qk_t = tl.dot(k, tl.trans(q))
        dp_t = tl.dot(v, tl.trans(do))
        p_t = tl.exp2(qk_t * qk_scale - lse[None, :])
        if MASKED:
            keep = ((rows[None, :] >= cols[:, None]) & (rows[None, :] <= cols[:, None] + window)
                    & (rows[None, :] < col_end[:, None]))
            p_t = tl.where(keep, p_t, 0.0)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dv += tl.dot(p_t.to(do.dtype), do)
        dk += tl.dot(ds_t, q)
    else:
        p_t = tl.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])
        if MASKED:
            keep = ((rows[None, :] >= cols[:, None]) & (rows[None, :] <= cols[:, None] + window)
                    & (rows[None, :] < col_end[:, None]))
            p_t = tl.where(keep, p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do)
        ds_t = (p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])).to(q.dtype)
        dk += tl.dot(ds_t, q)
    return dk, dv


@triton.jit
def dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, end_ptr, dk_ptr, dv_ptr,
                T, window, qk_scale, scale, stride_qt, stride_qh, stride_kt, stride_kh,
                stride_vt, stride_vh, stride_dot, stride_doh, stride_gt, stride_gh,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                SINGLE: tl.constexpr, REORDER: tl.constexpr):
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)
    n0 = tl.program_id(0) * BLOCK_N
    h = tl.program_id(1)
    cols = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    col_ok = cols < T
    col_end = tl.load(end_ptr + cols, mask=col_ok, other=0)
    last = tl.minimum(n0 + BLOCK_N, T) - 1
    b0, f0, f1, b1 = _attn_block_ranges(
        n0, tl.minimum(tl.load(end_ptr + last), last + window + 1),
        last, tl.minimum(tl.load(end_ptr + n0), n0 + window + 1), BLOCK_M)
    k = tl.load(k_ptr + cols.to(tl.int64)[:, None] * stride_kt + h * stride_kh + d[None, :],
                mask=col_ok[:, None], other=0.0)
    v = tl.load(v_ptr + cols.to(tl.int64)[:, None] * stride_vt + h * stride_vh + d[None, :],
                mask=col_ok[:, None], other=0.0)
    rows0 = tl.arange(0, BLOCK_M)
    q_ptrs = q_ptr + rows0.to(tl.int64)[:, None] * stride_qt + h * stride_qh + d[None, :]
    do_ptrs = do_ptr + rows0.to(tl.int64)[:, None] * stride_dot + h * stride_doh + d[None, :]
    lse_ptr += h * T
    delta_ptr += h * T
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    if SINGLE:
        for m0 in range(b0, b1, BLOCK_M):
            dk, dv = dkdv_step(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, m0, cols,
                               col_end, window, qk_scale, stride_qt, stride_dot, T, BLOCK_M,
                               True, REORDER)
    else:
        for m0 in range(b0, f0, BLOCK_M):
            dk, dv = dkdv_step(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, m0, cols,
                               col_end, window, qk_scale, stride_qt, stride_dot, T, BLOCK_M,
                               True, REORDER)
        for m0 in range(f0, f1, BLOCK_M):
            dk, dv = dkdv_step(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, m0, cols,
                               col_end, window, qk_scale, stride_qt, stride_dot, T, BLOCK_M,
                               False, REORDER)
        for m0 in range(f1, b1, BLOCK_M):
            dk, dv = dkdv_step(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, m0, cols,
                               col_end, window, qk_scale, stride_qt, stride_dot, T, BLOCK_M,
                               True, REORDER)
    g_offs = cols.to(tl.int64)[:, None] * stride_gt + h * stride_gh + d[None, :]
    tl.store(dk_ptr + g_offs, (dk * scale).to(dk_ptr.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dv_ptr + g_offs, dv.to(dv_ptr.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def dq_step(dq, q, do, lse, delta, k_ptrs, v_ptrs, n0, rows, row_start, window, qk_scale,
            stride_kt, stride_vt, T, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
            REORDER: tl.constexpr):
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = (cols < T)[:, None]
    k = tl.load(k_ptrs + n0 * stride_kt, mask=col_ok, other=0.0)
    v = tl.load(v_ptrs + n0 * stride_vt, mask=col_ok, other=0.0)
    if REORDER:
        qk = tl.dot(q, tl.trans(k))
        dp = tl.dot(do, tl.trans(v))
        p = tl.exp2(qk * qk_scale - lse[:, None])
    else:
        p = tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
    if MASKED:
        keep = ((cols[None, :] >= row_start[:, None]) & (cols[None, :] <= rows[:, None])
                & (cols[None, :] >= rows[:, None] - window))
        p = tl.where(keep, p, 0.0)
    if REORDER:
        ds = p * (dp - delta[:, None])
    else:
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k)


@triton.jit
def dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, delta_ptr, start_ptr, dq_ptr, T, window,
              qk_scale, scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
              stride_vh, stride_dot, stride_doh, stride_gt, stride_gh,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              SINGLE: tl.constexpr, REORDER: tl.constexpr, DELTA: tl.constexpr):
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)
    m0 = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    rows, row_ok, row_start, b0, f0, f1, b1 = _attn_query_block(start_ptr, m0, T, window, BLOCK_M,
                                                                BLOCK_N)
    q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(do_ptr + rows.to(tl.int64)[:, None] * stride_dot + h * stride_doh + d[None, :],
                 mask=row_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + h * T + rows, mask=row_ok, other=0.0)
    if DELTA:
        # o shares grad_out's strides here (both (T, H, D) contiguous)
        o = tl.load(o_ptr + rows.to(tl.int64)[:, None] * stride_dot + h * stride_doh + d[None, :],
                    mask=row_ok[:, None], other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(delta_ptr + h * T + rows, delta, mask=row_ok)
    else:
        delta = tl.load(delta_ptr + h * T + rows, mask=row_ok, other=0.0)
    cols0 = tl.arange(0, BLOCK_N)
    k_ptrs = k_ptr + cols0.to(tl.int64)[:, None] * stride_kt + h * stride_kh + d[None, :]
    v_ptrs = v_ptr + cols0.to(tl.int64)[:, None] * stride_vt + h * stride_vh + d[None, :]
    dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    if SINGLE:
        for n0 in range(b0, b1, BLOCK_N):
            dq = dq_step(dq, q, do, lse, delta, k_ptrs, v_ptrs, n0, rows, row_start, window,
                         qk_scale, stride_kt, stride_vt, T, BLOCK_N, True, REORDER)
    else:
        for n0 in range(b0, f0, BLOCK_N):
            dq = dq_step(dq, q, do, lse, delta, k_ptrs, v_ptrs, n0, rows, row_start, window,
                         qk_scale, stride_kt, stride_vt, T, BLOCK_N, True, REORDER)
        for n0 in range(f0, f1, BLOCK_N):
            dq = dq_step(dq, q, do, lse, delta, k_ptrs, v_ptrs, n0, rows, row_start, window,
                         qk_scale, stride_kt, stride_vt, T, BLOCK_N, False, REORDER)
        for n0 in range(f1, b1, BLOCK_N):
            dq = dq_step(dq, q, do, lse, delta, k_ptrs, v_ptrs, n0, rows, row_start, window,
                         qk_scale, stride_kt, stride_vt, T, BLOCK_N, True, REORDER)
    tl.store(dq_ptr + rows.to(tl.int64)[:, None] * stride_gt + h * stride_gh + d[None, :],
             (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


def fwd(q, k, v, cu, window, scale, tiles, single):
    T, H, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device)
    start, _ = document_bounds(cu, T)
    bm, bn, w, s = tiles
    fwd_kernel[(triton.cdiv(T, bm), H)](
        q, k, v, out, lse, start, T, window, scale * _LOG2E, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, SINGLE=single, num_warps=w, num_stages=s)
    return out, lse


def bwd(g, q, k, v, out, lse, cu, window, scale, dkdv_tiles, dq_tiles, single, reorder, delta_in_dq):
    T, H, D = q.shape
    dq, dk, dv = (torch.empty_like(q) for _ in range(3))
    start, end = document_bounds(cu, T)
    if delta_in_dq:
        delta = torch.empty((H, T), dtype=torch.float32, device=q.device)
    else:
        delta = (g.to(torch.float32) * out.to(torch.float32)).sum(-1).T.contiguous()
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               g.stride(0), g.stride(1), dq.stride(0), dq.stride(1))
    (dkdv_single, dq_single) = single if isinstance(single, tuple) else (single, single)
    (dkdv_reorder, dq_reorder) = reorder if isinstance(reorder, tuple) else (reorder, reorder)
    bm, bn, w, s = dq_tiles
    dq_kernel[(triton.cdiv(T, bm), H)](
        q, k, v, g, out, lse, delta, start, dq, T, window, scale * _LOG2E, scale, *strides,
        HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, SINGLE=dq_single, REORDER=dq_reorder, DELTA=delta_in_dq,
        num_warps=w, num_stages=s)
    bm, bn, w, s = dkdv_tiles
    dkdv_kernel[(triton.cdiv(T, bn), H)](
        q, k, v, g, lse, delta, end, dk, dv, T, window, scale * _LOG2E, scale, *strides,
        HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, SINGLE=dkdv_single, REORDER=dkdv_reorder,
        num_warps=w, num_stages=s)
    return dq, dk, dv


def kernel_ms(fn, iters=20):
    """Per-kernel GPU ms per call (name -> ms) and the total."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    per = {}
    for e in prof.events():
        if e.device_type == cuda:
            per[e.name[:28]] = per.get(e.name[:28], 0.0) + e.time_range.elapsed_us() / iters / 1e3
    return sum(per.values()), per


SWEEP = [("sr", (True, False), (True, True), True, (64, 128, 8, 3), (64, 32, 4, 3))]
for t in [(64, 128, 8, 2), (32, 128, 8, 3), (32, 128, 8, 2), (64, 128, 8, 4), (32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 3)]:
    SWEEP.append((f"dkdv {t}", (True, False), (True, True), True, t, (64, 32, 4, 3)))
for t in [(64, 32, 4, 2), (64, 32, 4, 4), (32, 32, 4, 3), (64, 64, 4, 2), (128, 32, 8, 3), (32, 64, 4, 3), (64, 32, 8, 3)]:
    SWEEP.append((f"dq {t}", (True, False), (True, True), True, (64, 128, 8, 3), t))
SWEEP.append(("dq single", (True, True), (True, True), True, (64, 128, 8, 3), (64, 32, 4, 3)))

DQ0 = (64, 32, 4, 3)
SWEEP2 = [(f"dkdv {t}", (True, False), (True, True), True, t, DQ0)
          for t in [(32, 64, 4, 3), (32, 64, 4, 2), (32, 64, 4, 4), (16, 64, 4, 3), (16, 64, 4, 4),
                    (16, 64, 4, 2), (32, 64, 8, 3), (64, 64, 4, 2)]]
SWEEP2 += [("dkdv 3loops (32,64,4,3)", (False, False), (True, True), True, (32, 64, 4, 3), DQ0),
           ("dkdv noreorder (32,64,4,3)", (True, False), (False, True), True, (32, 64, 4, 3), DQ0),
           ("dq noreorder", (True, False), (True, False), True, (32, 64, 4, 3), DQ0)]


def main():
    import attention as ba
    from torch.nn.attention.varlen import varlen_attn
    dev, scale = torch.device("cuda"), 0.12
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(dev), flush=True)
    shapes = sys.argv[1] if len(sys.argv) > 1 else "49152:normal:768,49152:normal:1408,49152:paired:640,16384:normal:384,32768:normal:896"
    variants = {"1": SWEEP, "2": SWEEP2}[os.environ["SWEEP"]] if os.environ.get("SWEEP") else [  # name, single, reorder, delta_in_dq, dkdv tiles, dq tiles
        ("base", False, False, False, (64, 128, 8, 3), (64, 32, 4, 3)),
        ("delta", False, False, True, (64, 128, 8, 3), (64, 32, 4, 3)),
        ("reorder", False, True, True, (64, 128, 8, 3), (64, 32, 4, 3)),
        ("single", True, False, True, (64, 128, 8, 3), (64, 32, 4, 3)),
        ("single+reorder", True, True, True, (64, 128, 8, 3), (64, 32, 4, 3)),
        ("reorder dq64", False, True, True, (64, 128, 8, 3), (64, 64, 4, 3)),
        ("reorder dq128x64", False, True, True, (64, 128, 8, 3), (128, 64, 8, 3)),
        ("reorder dkdv s2", False, True, True, (64, 128, 8, 2), (64, 32, 4, 3)),
    ]
    for shape in shapes.split(","):
        T, layout, window = shape.split(":")
        T, window = int(T), int(window)
        cu, lens = ba.fineweb_like_cu_seqlens(T, torch.Generator().manual_seed(T))
        seq, heads = (T, 6) if layout == "normal" else (2 * T, 3)
        if layout == "paired":
            cu, lens = cu * 2, [2 * n for n in lens]
        cu = cu.to(dev)
        gen = torch.Generator().manual_seed(0)
        q, k, v, g = (torch.randn(seq, heads, 128, generator=gen).to(dev, torch.bfloat16) for _ in range(4))
        flops = 4 * ba.attended_pairs(lens, window) * heads * 128
        print(f"\n{shape}: fwd {flops/1e9:.1f} GFLOP useful", flush=True)
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        run = lambda: varlen_attn(qg, kg, vg, cu, cu, 4096, 4096, scale=scale, window_size=(window, 0))  # noqa
        f_ms, _ = kernel_ms(run)
        b_ms, per = kernel_ms(lambda: torch.autograd.grad(run(), (qg, kg, vg), g))
        print(f"  varlen fwd {f_ms:.3f} bwd {b_ms - f_ms:.3f} total {b_ms:.3f}", flush=True)
        ref_o, ref_lse = tk.varlen_attention_fwd_triton(q, k, v, cu, window, scale)
        ref = tk.varlen_attention_bwd_triton(g, q, k, v, ref_o, ref_lse, cu, window, scale)
        t, per = kernel_ms(lambda: tk.varlen_attention_bwd_triton(g, q, k, v, ref_o, ref_lse, cu, window, scale))
        tf, _ = kernel_ms(lambda: tk.varlen_attention_fwd_triton(q, k, v, cu, window, scale))
        print(f"  shipped fwd {tf:.3f} bwd {t:.3f} total {tf + t:.3f}  " +
              " ".join(f"{n}={ms:.3f}" for n, ms in per.items()), flush=True)
        for single in (False, True):
            tiles = (64, 32, 4, 3)
            o, lse = fwd(q, k, v, cu, window, scale, tiles, single)
            same = torch.equal(o, ref_o) and torch.equal(lse, ref_lse)
            ms, _ = kernel_ms(lambda: fwd(q, k, v, cu, window, scale, tiles, single))
            print(f"  fwd single={single} {ms:.3f} ms bitwise={same}", flush=True)
        for name, single, reorder, delta_in, dkdv_t, dq_t in variants:
            try:
                grads = bwd(g, q, k, v, ref_o, ref_lse, cu, window, scale, dkdv_t, dq_t, single, reorder, delta_in)
                err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(grads, ref))
                t, per = kernel_ms(lambda: bwd(g, q, k, v, ref_o, ref_lse, cu, window, scale, dkdv_t, dq_t,
                                               single, reorder, delta_in))
            except Exception as e:
                print(f"  {name}: failed {type(e).__name__} {e}"[:200], flush=True)
                continue
            print(f"  bwd {name:18s} {t:.3f} ms rel err {err:.1e}  " +
                  " ".join(f"{n}={ms:.3f}" for n, ms in per.items()), flush=True)


if __name__ == "__main__":
    main()
