"""Scratch benchmark: the Triton attention backward (triton_kernels.py section 8) with its per-step tiles loaded
through tensor descriptors (TMA), one GPU.

    python3 notes/2026-11-25_attention_experiments_H100/attention_bwd_variants.py

Copies of the dQ kernel (K and V tiles through descriptors) and the dK/dV kernel (Q and dO tiles through
descriptors), at the shipped tiles, timed against the shipped kernels; the gradients must be bitwise the same (rows
past T come back as zeros, as the masked loads give them).

Unshipped experiment, kept as evidence (README.md): TMA loads in the dQ and dK/dV kernels; not taken
(bwd_variants.txt: 0-5% slower). Self-contained: the shipped kernels it compares against are copied in
attention_snapshot.py, this folder.
"""
import sys

import torch
import triton
import triton.language as tl

import attention_snapshot as snapshot  # this folder's copy of the shipped kernels and bench helpers
from attention_snapshot import gpu_kernel_ms, gpu_shape_cases


@triton.jit
def _dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, end_ptr, dk_ptr, dv_ptr, T, window, qk_scale,
                 scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                 stride_gt, stride_gh, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)
    n0 = tl.program_id(0) * BLOCK_N
    h = tl.program_id(1)
    cols = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    col_ok = cols < T
    col_end = tl.load(end_ptr + cols, mask=col_ok, other=0)
    last = tl.minimum(n0 + BLOCK_N, T) - 1
    b0 = (n0 // BLOCK_M) * BLOCK_M
    b1 = tl.minimum(tl.load(end_ptr + last), last + window + 1)
    k = tl.load(k_ptr + cols.to(tl.int64)[:, None] * stride_kt + h * stride_kh + d[None, :], mask=col_ok[:, None],
                other=0.0)
    v = tl.load(v_ptr + cols.to(tl.int64)[:, None] * stride_vt + h * stride_vh + d[None, :], mask=col_ok[:, None],
                other=0.0)
    q_desc = tl.make_tensor_descriptor(q_ptr + h * stride_qh, shape=[T, HEAD_DIM], strides=[stride_qt, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    do_desc = tl.make_tensor_descriptor(do_ptr + h * stride_doh, shape=[T, HEAD_DIM], strides=[stride_dot, 1],
                                        block_shape=[BLOCK_M, HEAD_DIM])
    lse_ptr += h * T
    delta_ptr += h * T
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    for m0 in range(b0, b1, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < T
        q = q_desc.load([m0, 0])
        do = do_desc.load([m0, 0])
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
        s_t = tl.dot(k, tl.trans(q))
        dp_t = tl.dot(v, tl.trans(do))
        keep = ((rows[None, :] >= cols[:, None]) & (rows[None, :] <= cols[:, None] + window)
                & (rows[None, :] < col_end[:, None]))
        p_t = tl.where(keep, tl.exp2(s_t * qk_scale - lse[None, :]), 0.0)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dv += tl.dot(p_t.to(do.dtype), do)
        dk += tl.dot(ds_t, q)
    g_offs = cols.to(tl.int64)[:, None] * stride_gt + h * stride_gh + d[None, :]
    tl.store(dk_ptr + g_offs, (dk * scale).to(dk_ptr.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dv_ptr + g_offs, dv.to(dv_ptr.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _dq_step(dq, q, do, lse, delta, k_desc, v_desc, n0, rows, row_start, window, qk_scale, BLOCK_N: tl.constexpr,
             MASKED: tl.constexpr):
    cols = n0 + tl.arange(0, BLOCK_N)
    k = k_desc.load([n0, 0])
    v = v_desc.load([n0, 0])
    s = tl.dot(q, tl.trans(k))
    dp = tl.dot(do, tl.trans(v))
    p = tl.exp2(s * qk_scale - lse[:, None])
    if MASKED:
        keep = ((cols[None, :] >= row_start[:, None]) & (cols[None, :] <= rows[:, None])
                & (cols[None, :] >= rows[:, None] - window))
        p = tl.where(keep, p, 0.0)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k)


@triton.jit
def _dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, delta_ptr, start_ptr, dq_ptr, T, window, qk_scale, scale,
               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_ot,
               stride_oh, stride_gt, stride_gh, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)
    m0 = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    rows, row_ok, row_start, b0, f0, f1, b1 = snapshot._attn_query_block(start_ptr, m0, T, window, BLOCK_M, BLOCK_N)
    q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_qt + h * stride_qh + d[None, :], mask=row_ok[:, None],
                other=0.0)
    do = tl.load(do_ptr + rows.to(tl.int64)[:, None] * stride_dot + h * stride_doh + d[None, :],
                 mask=row_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + h * T + rows, mask=row_ok, other=0.0)
    o = tl.load(o_ptr + rows.to(tl.int64)[:, None] * stride_ot + h * stride_oh + d[None, :], mask=row_ok[:, None],
                other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(delta_ptr + h * T + rows, delta, mask=row_ok)
    k_desc = tl.make_tensor_descriptor(k_ptr + h * stride_kh, shape=[T, HEAD_DIM], strides=[stride_kt, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(v_ptr + h * stride_vh, shape=[T, HEAD_DIM], strides=[stride_vt, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    for n0 in range(b0, f0, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, k_desc, v_desc, n0, rows, row_start, window, qk_scale, BLOCK_N, True)
    for n0 in range(f0, f1, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, k_desc, v_desc, n0, rows, row_start, window, qk_scale, BLOCK_N, False)
    for n0 in range(f1, b1, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, k_desc, v_desc, n0, rows, row_start, window, qk_scale, BLOCK_N, True)
    tl.store(dq_ptr + rows.to(tl.int64)[:, None] * stride_gt + h * stride_gh + d[None, :],
             (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


def backward_tma(g, q, k, v, out, lse, cu, window, scale):
    T, H, D = q.shape
    dq, dk, dv = (torch.empty_like(q) for _ in range(3))
    start, end = snapshot.document_bounds(cu, T)
    delta = torch.empty((H, T), dtype=torch.float32, device=q.device)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1))
    bm, bn, warps, stages = snapshot._ATTN_TILES["dq"]
    _dq_kernel[(triton.cdiv(T, bm), H)](q, k, v, g, out, lse, delta, start, dq, T, window, scale * snapshot._LOG2E,
                                       scale, *strides, out.stride(0), out.stride(1), dq.stride(0), dq.stride(1),
                                       HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    bm, bn, warps, stages = snapshot._ATTN_TILES["dkdv"]
    _dkdv_kernel[(triton.cdiv(T, bn), H)](q, k, v, g, lse, delta, end, dk, dv, T, window, scale * snapshot._LOG2E,
                                         scale, *strides, dk.stride(0), dk.stride(1), HEAD_DIM=D, BLOCK_M=bm,
                                         BLOCK_N=bn, num_warps=warps, num_stages=stages)
    return dq, dk, dv


DEFAULT_SHAPES = "49152:normal:1408,49152:normal:768,49152:paired:640,16384:normal:384"


def main() -> None:
    shapes = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_SHAPES
    cases = gpu_shape_cases(shapes, "a CUDA GPU (Hopper for the tensor descriptors)")
    device = torch.device("cuda")
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))
    for spec, (T, H, window, cu, _) in cases:
        gen = torch.Generator().manual_seed(T)
        q, k, v, g = (torch.randn(T, H, 128, generator=gen).to(device, torch.bfloat16) for _ in range(4))
        cu, scale = cu.to(device), 0.12
        out, lse = snapshot.varlen_attention_fwd_triton(q, k, v, cu, window, scale)
        ref = snapshot.varlen_attention_bwd_triton(g, q, k, v, out, lse, cu, window, scale)
        got = backward_tma(g, q, k, v, out, lse, cu, window, scale)
        same = all(torch.equal(a, b) for a, b in zip(ref, got))
        shipped = gpu_kernel_ms(lambda: snapshot.varlen_attention_bwd_triton(g, q, k, v, out, lse, cu, window, scale))
        tma = gpu_kernel_ms(lambda: backward_tma(g, q, k, v, out, lse, cu, window, scale))
        print(f"{spec}: shipped dq {shipped['_attn_dq_kernel']:.3f} dkdv {shipped['_attn_dkdv_kernel']:.3f} ms; "
              f"TMA dq {tma['_dq_kernel']:.3f} dkdv {tma['_dkdv_kernel']:.3f} ms; bitwise same: {same}", flush=True)


if __name__ == "__main__":
    main()
