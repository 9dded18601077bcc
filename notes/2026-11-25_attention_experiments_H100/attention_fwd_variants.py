"""Scratch benchmark: variants of the Triton attention forward (triton_kernels.py section 8), one GPU.

    python3 notes/2026-11-25_attention_experiments_H100/attention_fwd_variants.py

Variants of one kernel, switched by constexprs, against the shipped forward at the same tiles:
  TMA  K and V tiles through tensor descriptors (tl.make_tensor_descriptor, Hopper's bulk tensor copies) instead
       of masked pointer loads; rows past T come back as zeros, as the masked loads give them.
  FMA  the row max taken on the unscaled logits (scaled once per row: the same number, since the scale is
       positive) and p = exp2(s * scale - m) as one fused multiply-add, instead of scaling every logit first.
Prints GPU kernel time per variant and whether the output equals the shipped kernel's (TMA alone must be
bitwise the same; FMA changes p's rounding, so its difference from the shipped output is printed).

Unshipped experiment, kept as evidence (README.md): TMA loads of K/V and a fused-multiply-add exp2 argument in the
forward; not taken (fwd_variants.txt: 3-6% off the forward). Self-contained: the shipped kernels it compares against
are copied in attention_snapshot.py, this folder.
"""
import sys

import torch
import triton
import triton.language as tl

import attention_snapshot as snapshot  # this folder's copy of the shipped kernels and bench helpers
from attention_snapshot import gpu_kernel_ms, gpu_shape_cases


@triton.jit
def _step(acc, l_i, m_i, q, k_src, v_src, n0, rows, row_start, window, qk_scale, stride_kt, stride_vt, T,
          BLOCK_N: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr, FMA: tl.constexpr):
    cols = n0 + tl.arange(0, BLOCK_N)
    if TMA:
        k = k_src.load([n0, 0])
    else:
        k = tl.load(k_src + n0 * stride_kt, mask=(cols < T)[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k))
    if not FMA:
        s = s * qk_scale
    if MASKED:
        keep = ((cols[None, :] >= row_start[:, None]) & (cols[None, :] <= rows[:, None])
                & (cols[None, :] >= rows[:, None] - window))
        s = tl.where(keep, s, float("-inf"))
    if FMA:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    if FMA:
        p = tl.exp2(s * qk_scale - m_new_safe[:, None])
    else:
        p = tl.exp2(s - m_new_safe[:, None])
    alpha = tl.exp2(m_i - m_new_safe)
    if TMA:
        v = v_src.load([n0, 0])
    else:
        v = tl.load(v_src + n0 * stride_vt, mask=(cols < T)[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, start_ptr, T, window, qk_scale, stride_qt, stride_qh,
                stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, HEAD_DIM: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr, FMA: tl.constexpr):
    qk_scale = tl.cast(qk_scale, tl.float32)
    m0 = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    rows, row_ok, row_start, b0, f0, f1, b1 = snapshot._attn_query_block(start_ptr, m0, T, window, BLOCK_M, BLOCK_N)
    q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if TMA:
        k_src = tl.make_tensor_descriptor(k_ptr + h * stride_kh, shape=[T, HEAD_DIM], strides=[stride_kt, 1],
                                          block_shape=[BLOCK_N, HEAD_DIM])
        v_src = tl.make_tensor_descriptor(v_ptr + h * stride_vh, shape=[T, HEAD_DIM], strides=[stride_vt, 1],
                                          block_shape=[BLOCK_N, HEAD_DIM])
    else:
        cols0 = tl.arange(0, BLOCK_N)
        k_src = k_ptr + cols0.to(tl.int64)[:, None] * stride_kt + h * stride_kh + d[None, :]
        v_src = v_ptr + cols0.to(tl.int64)[:, None] * stride_vt + h * stride_vh + d[None, :]
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    for n0 in range(b0, f0, BLOCK_N):
        acc, l_i, m_i = _step(acc, l_i, m_i, q, k_src, v_src, n0, rows, row_start, window, qk_scale, stride_kt,
                              stride_vt, T, BLOCK_N, True, TMA, FMA)
    for n0 in range(f0, f1, BLOCK_N):
        acc, l_i, m_i = _step(acc, l_i, m_i, q, k_src, v_src, n0, rows, row_start, window, qk_scale, stride_kt,
                              stride_vt, T, BLOCK_N, False, TMA, FMA)
    for n0 in range(f1, b1, BLOCK_N):
        acc, l_i, m_i = _step(acc, l_i, m_i, q, k_src, v_src, n0, rows, row_start, window, qk_scale, stride_kt,
                              stride_vt, T, BLOCK_N, True, TMA, FMA)
    out = acc / l_i[:, None]
    tl.store(o_ptr + rows.to(tl.int64)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + h * T + rows, m_i + tl.log2(l_i), mask=row_ok)


def forward(q, k, v, cu, window, scale, tiles, tma, fma):
    T, H, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device)
    start, _ = snapshot.document_bounds(cu, T)
    bm, bn, warps, stages = tiles
    _fwd_kernel[(triton.cdiv(T, bm), H)](
        q, k, v, out, lse, start, T, window, scale * snapshot._LOG2E, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn,
        TMA=tma, FMA=fma, num_warps=warps, num_stages=stages)
    return out, lse


DEFAULT_SHAPES = "49152:normal:1408,49152:normal:768,49152:paired:640,16384:normal:384"


def main() -> None:
    shapes = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_SHAPES
    cases = gpu_shape_cases(shapes, "a CUDA GPU (Hopper for the tensor descriptors)")
    device = torch.device("cuda")
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))
    tile_sets = [snapshot._ATTN_TILES["fwd"], (64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 2)]
    for spec, (T, H, window, cu, _) in cases:
        gen = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(T, H, 128, generator=gen).to(device, torch.bfloat16) for _ in range(3))
        cu, scale = cu.to(device), 0.12
        ref, ref_lse = snapshot.varlen_attention_fwd_triton(q, k, v, cu, window, scale)
        shipped = sum(gpu_kernel_ms(lambda: snapshot.varlen_attention_fwd_triton(q, k, v, cu, window, scale)).values())
        print(f"{spec}: shipped forward {shipped:.3f} ms (with its document_bounds)", flush=True)
        for tiles in tile_sets:
            for tma, fma in ((False, False), (True, False), (False, True), (True, True)):
                try:
                    out, lse = forward(q, k, v, cu, window, scale, tiles, tma, fma)
                    ms = gpu_kernel_ms(lambda: forward(q, k, v, cu, window, scale, tiles, tma, fma))
                    kernel = ms.get("_fwd_kernel", float("nan"))
                    diff = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    same = torch.equal(out, ref) and torch.equal(lse, ref_lse)
                    print(f"  tiles {tiles} TMA={int(tma)} FMA={int(fma)}: kernel {kernel:.3f} ms  "
                          f"bitwise shipped: {same}  rel diff {diff:.1e}", flush=True)
                except Exception as e:  # a tile set that does not compile on this Triton
                    print(f"  tiles {tiles} TMA={int(tma)} FMA={int(fma)}: failed: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]}", flush=True)


if __name__ == "__main__":
    main()
