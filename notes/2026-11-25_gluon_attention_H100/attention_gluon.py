"""Scratch benchmark: the attention's forward and dK/dV kernels in Gluon, against the shipped Triton kernels
(triton_kernels.py section 8), one Hopper GPU.

    python3 notes/2026-11-25_gluon_attention_H100/attention_gluon.py [SHAPES] [--compile-only | --ncu-target]

Gluon (triton.experimental.gluon, in triton 3.6 through 3.9) is Triton's lower-level dialect: layouts, shared
memory, cp.async and Hopper's asynchronous warpgroup MMA are written out by hand. It can express what tl.dot
cannot, FlashAttention-3's intra-warpgroup pipelining:
  forward   block j+1's q k^T and block j-1's p v are issued before block j's softmax and waited for after it;
  dK/dV     q k^T and dO v^T are issued together, dV's product is issued before dS is formed, and the masks are
            applied only to the blocks that need them (a uniform branch per block, in one pipelined loop).
Key/value (forward) or query/dO (dK/dV) blocks come through a ring of shared-memory slots filled by cp.async, a
few blocks ahead. The contract and rounding points are the shipped kernels' (p and dS rounded to bf16, fp32
accumulation, base-2 log-sum-exp).

Prints per shape the GPU kernel time of the shipped kernel and of each Gluon config, and the relative difference
of the outputs. --compile-only compiles the kernels for sm_90 on any machine (no GPU) and prints registers and
spills from the ptxas that ships with triton. --ncu-target runs each kernel twice at the first shape, for
ncu_profile.sh (which profiles the second launches).

Unshipped experiment, kept as evidence (README.md): Gluon forwards (FlashAttention-3 overlaps, warp specialisation,
ping-pong) and a Gluon dK/dV kernel against the shipped Triton kernels on an H100; none beat them (bench.txt), not
taken. Self-contained within notes/: the shipped kernels and bench helpers it uses are the copy in
notes/2026-11-25_attention_experiments_H100/attention_snapshot.py.
"""
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "2026-11-25_attention_experiments_H100"))
import attention_snapshot as snapshot  # noqa: E402 (the copy of the shipped kernels and bench helpers)

# cp.async with a pointer tensor: async_load from triton 3.7, async_copy_global_to_shared before
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# a TMA tile load into shared memory, signalling an mbarrier: async_load from triton 3.7
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# a CTA-wide barrier: gl.barrier from triton 3.7, gl.thread_barrier before
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

DEFAULT_SHAPES = "49152:normal:1408,49152:paired:640,49152:normal:384,32768:normal:896,16384:normal:384"


@gluon.jit
def _issue_kv(k_ptr, v_ptr, k_smem, v_smem, slot, n0, n_end, T, h, stride_kt, stride_kh, stride_vt,
              stride_vh, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, LOAD: gl.constexpr):
    """cp.async of the key/value block at n0 into ring slot `slot` (rows past T or past the loop's end
    n_end come back zero or are skipped), as one commit group."""
    cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD))
    ok = gl.expand_dims((cols < T) & (n0 < n_end), 1) & gl.expand_dims(d < HEAD_DIM, 0)
    rows64 = gl.expand_dims(cols.to(gl.int64), 1)
    _async_load(
        k_smem.index(slot), k_ptr + rows64 * stride_kt + h * stride_kh + gl.expand_dims(d, 0), mask=ok)
    _async_load(
        v_smem.index(slot), v_ptr + rows64 * stride_vt + h * stride_vh + gl.expand_dims(d, 0), mask=ok)
    async_copy.commit_group()


@gluon.jit
def _block_keys(start_ptr, m0, T, window, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Key blocks [b0, b1) that query rows [m0, m0 + BLOCK_M) need, and their fully allowed part [f0, f1), as
    triton_kernels._attn_query_block computes them (indices clamped into [0, T), for a block past T)."""
    last = gl.minimum(m0 + BLOCK_M, T) - 1
    lo = gl.maximum(gl.load(start_ptr + gl.minimum(m0, T - 1)), m0 - window)
    full_lo = gl.maximum(gl.load(start_ptr + gl.maximum(last, 0)), last - window)
    b0 = (lo // BLOCK_N) * BLOCK_N
    b1 = ((last + BLOCK_N) // BLOCK_N) * BLOCK_N
    f0 = gl.minimum(gl.maximum(((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, b0), b1)
    f1 = gl.maximum(gl.minimum(((m0 + 1) // BLOCK_N) * BLOCK_N, b1), f0)
    return b0, b1, f0, f1


@gluon.jit
def _softmax_step(s, m_i, l_i, rows, row_start, n0, f0, f1, window, BLOCK_N: gl.constexpr, COL: gl.constexpr):
    """One key block's online-softmax step on the scaled logits s: (p, alpha, m_i, l_i). The mask runs only
    on blocks outside the fully allowed [f0, f1)."""
    if (n0 < f0) | (n0 >= f1):
        cols = n0 + gl.arange(0, BLOCK_N, layout=COL)
        keep = ((gl.expand_dims(cols, 0) >= gl.expand_dims(row_start, 1))
                & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
                & (gl.expand_dims(cols, 0) >= gl.expand_dims(rows, 1) - window))
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - gl.expand_dims(m_safe, 1))
    alpha = gl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _gluon_attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, start_ptr, T, window, qk_scale,
                           stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                           stride_ot, stride_oh, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                           BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
                           OVERLAP: gl.constexpr):
    """OVERLAP=False: the same loop with every product waited for right away (what tl.dot does)."""
    gl.static_assert(BLOCK_M == 16 * NUM_WARPS)  # each warpgroup owns 64 rows
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                      instr_shape=[16, HEAD_DIM, 16])
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])
    KV_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.bfloat16)
    Q_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.bfloat16)
    ROW: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    COL: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)

    qk_scale = qk_scale.to(gl.float32)
    m0 = gl.program_id(0) * BLOCK_M
    h = gl.program_id(1)

    b0, b1, f0, f1 = _block_keys(start_ptr, m0, T, window, BLOCK_M, BLOCK_N)
    n_blocks = (b1 - b0) // BLOCK_N

    rows = m0 + gl.arange(0, BLOCK_M, layout=ROW)
    row_ok = rows < T
    row_start = gl.load(start_ptr + rows, mask=row_ok, other=T)

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, HEAD_DIM], Q_SMEM)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], KV_SMEM)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], KV_SMEM)

    # q through registers into shared memory; the first STAGES - 1 key/value blocks in flight
    q_rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOAD))
    d_load = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD))
    q = gl.load(q_ptr + gl.expand_dims(q_rows.to(gl.int64), 1) * stride_qt + h * stride_qh
                + gl.expand_dims(d_load, 0), mask=gl.expand_dims(q_rows < T, 1), other=0.0)
    q_smem.store(q)
    for i in gl.static_range(STAGES - 1):
        _issue_kv(k_ptr, v_ptr, k_smem, v_smem, i, b0 + i * BLOCK_N, b1, T, h, stride_kt,
                  stride_kh, stride_vt, stride_vh, HEAD_DIM, BLOCK_N, LOAD)
    async_copy.wait_group(STAGES - 2)
    fence_async_shared()
    _cta_barrier()
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False)

    acc_tok = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, O_LAYOUT))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW)
    l_i = gl.zeros([BLOCK_M], gl.float32, ROW)
    for j in range(n_blocks):
        n0 = b0 + j * BLOCK_N
        # block j + 1's keys are in; the slot of block j - 1 is free (its p v was waited for)
        async_copy.wait_group(STAGES - 3)
        fence_async_shared()
        _cta_barrier()
        _issue_kv(k_ptr, v_ptr, k_smem, v_smem, (j + STAGES - 1) % STAGES,
                  n0 + (STAGES - 1) * BLOCK_N, b1, T, h, stride_kt, stride_kh, stride_vt,
                  stride_vh, HEAD_DIM, BLOCK_N, LOAD)
        if OVERLAP:
            if j + 1 < n_blocks:
                s_tok = warpgroup_mma(q_smem, k_smem.index((j + 1) % STAGES).permute((1, 0)), s_zero,
                                      use_acc=False, is_async=True)
            else:
                s_tok = warpgroup_mma_init(s_zero)
        else:
            s = warpgroup_mma(q_smem, k_smem.index(j % STAGES).permute((1, 0)), s_zero, use_acc=False)
        # block j's softmax, while block j + 1's q k^T and block j - 1's p v run
        p, alpha, m_i, l_i = _softmax_step(s * qk_scale, m_i, l_i, rows, row_start, n0, f0, f1, window, BLOCK_N,
                                           COL)
        if OVERLAP:
            acc, s = warpgroup_mma_wait(0, deps=[acc_tok, s_tok])
        else:
            acc = warpgroup_mma_wait(0, deps=[acc_tok])
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT)), 1)
        p_op = gl.convert_layout(p.to(gl.bfloat16), P_LAYOUT)
        if OVERLAP:
            acc_tok = warpgroup_mma(p_op, v_smem.index(j % STAGES), acc, is_async=True)
        else:
            acc_tok = warpgroup_mma_init(warpgroup_mma(p_op, v_smem.index(j % STAGES), acc))
    acc = warpgroup_mma_wait(0, deps=[acc_tok])
    async_copy.wait_group(0)

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_LAYOUT))
    out = gl.convert_layout((acc / gl.expand_dims(l_o, 1)).to(gl.bfloat16), LOAD)
    gl.store(o_ptr + gl.expand_dims(q_rows.to(gl.int64), 1) * stride_ot + h * stride_oh
             + gl.expand_dims(d_load, 0), out, mask=gl.expand_dims(q_rows < T, 1))
    gl.store(lse_ptr + h * T + rows, m_i + gl.log2(l_i), mask=row_ok)


def gluon_forward(q, k, v, cu_seqlens, window, scale, block_m=64, block_n=64, stages=3, maxnreg=None,
                  overlap=True):
    T, H, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device)
    start, _ = snapshot.document_bounds(cu_seqlens, T)
    _gluon_attn_fwd_kernel[(triton.cdiv(T, block_m), H)](
        q, k, v, out, lse, start, T, window, scale * snapshot._LOG2E, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), HEAD_DIM=D, BLOCK_M=block_m,
        BLOCK_N=block_n, STAGES=stages, NUM_WARPS=block_m // 16, OVERLAP=overlap, num_warps=block_m // 16,
        **({"maxnreg": maxnreg} if maxnreg else {}))
    return out, lse


@gluon.jit
def _ws_fwd_load(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, m0, b0, n_blocks, h,
                 HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Producer partition: q once, then each key/value block into the next free ring slot by TMA."""
    mbarrier.expect(q_bar, BLOCK_M * HEAD_DIM * 2)
    _tma_load(q_desc, [m0, h * HEAD_DIM], q_bar, q_smem)
    for j in range(n_blocks):
        slot = j % STAGES
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)   # passes at once on the first lap
        mbarrier.expect(ready.index(slot), 2 * BLOCK_N * HEAD_DIM * 2)
        _tma_load(k_desc, [b0 + j * BLOCK_N, h * HEAD_DIM], ready.index(slot), k_smem.index(slot))
        _tma_load(v_desc, [b0 + j * BLOCK_N, h * HEAD_DIM], ready.index(slot), v_smem.index(slot))


@gluon.jit
def _ws_fwd_compute(q_smem, k_smem, v_smem, q_bar, ready, empty, start_ptr, m0, T, window, qk_scale, b0, f0,
                    f1, n_blocks, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, OVERLAP: gl.constexpr):
    """Consumer partition (BLOCK_M / 64 warpgroups, 64 rows each): the online softmax over the ring.
    OVERLAP: block j+1's q k^T and block j-1's p v run during block j's softmax (needs STAGES >= 3: slots j-1,
    j and j+1 are in use at once)."""
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                      instr_shape=[16, HEAD_DIM, 16])
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    ROW: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    COL: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
    O_ROW: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    rows = m0 + gl.arange(0, BLOCK_M, layout=ROW)
    row_start = gl.load(start_ptr + rows, mask=rows < T, other=T)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, O_LAYOUT)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW)
    l_i = gl.zeros([BLOCK_M], gl.float32, ROW)
    mbarrier.wait(q_bar, 0)
    if OVERLAP:
        gl.static_assert(STAGES >= 3)
        mbarrier.wait(ready.index(0), 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False)
        acc_tok = warpgroup_mma_init(acc)
        for j in range(n_blocks):
            if j + 1 < n_blocks:
                nxt = (j + 1) % STAGES
                mbarrier.wait(ready.index(nxt), ((j + 1) // STAGES) & 1)
                s_tok = warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)
            else:
                s_tok = warpgroup_mma_init(s_zero)
            p, alpha, m_i, l_i = _softmax_step(s * qk_scale, m_i, l_i, rows, row_start, b0 + j * BLOCK_N, f0,
                                                 f1, window, BLOCK_N, COL)
            acc, s = warpgroup_mma_wait(0, deps=[acc_tok, s_tok])
            if j > 0:   # block j - 1's p v is done: its slot goes back to the producer
                mbarrier.arrive(empty.index((j - 1) % STAGES), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, O_ROW), 1)
            acc_tok = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), P_LAYOUT), v_smem.index(j % STAGES), acc,
                                    is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc_tok])
    else:
        for j in range(n_blocks):
            slot = j % STAGES
            mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
            s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False)
            p, alpha, m_i, l_i = _softmax_step(s * qk_scale, m_i, l_i, rows, row_start, b0 + j * BLOCK_N, f0,
                                                 f1, window, BLOCK_N, COL)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, O_ROW), 1)
            acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), P_LAYOUT), v_smem.index(slot), acc)
            # hand the slot back: one thread arrives, after a barrier of the partition that gluon inserts
            mbarrier.arrive(empty.index(slot), count=1)
    return acc, m_i, l_i


@gluon.jit
def _ws_fwd_kernel(q_desc, k_desc, v_desc, o_ptr, lse_ptr, start_ptr, T, window, qk_scale, stride_ot, stride_oh,
                   HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   NUM_WARPS: gl.constexpr, OVERLAP: gl.constexpr):
    """FlashAttention-3's layout of the forward: a producer warpgroup loads by TMA, the consumer warpgroups
    (64 query rows each) compute; registers move from the producer to the consumers."""
    gl.static_assert(BLOCK_M == 16 * NUM_WARPS)
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                      instr_shape=[16, HEAD_DIM, 16])
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])
    KV_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.bfloat16)
    Q_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.bfloat16)
    qk_scale = qk_scale.to(gl.float32)
    m0 = gl.program_id(0) * BLOCK_M
    h = gl.program_id(1)
    b0, b1, f0, f1 = _block_keys(start_ptr, m0, T, window, BLOCK_M, BLOCK_N)
    n_blocks = (b1 - b0) // BLOCK_N

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, HEAD_DIM], Q_SMEM)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], KV_SMEM)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], KV_SMEM)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()

    acc, m_i, l_i = gl.warp_specialize(
        [(_ws_fwd_compute, (q_smem, k_smem, v_smem, q_bar, ready, empty, start_ptr, m0, T, window, qk_scale,
                            b0, f0, f1, n_blocks, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, NUM_WARPS, OVERLAP)),
         (_ws_fwd_load, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, m0, b0, n_blocks,
                         h, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES))],
        [4], [24])

    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOAD))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD))
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_LAYOUT))
    out = gl.convert_layout((acc / gl.expand_dims(l_o, 1)).to(gl.bfloat16), LOAD)
    gl.store(o_ptr + gl.expand_dims(rows.to(gl.int64), 1) * stride_ot + h * stride_oh + gl.expand_dims(d, 0), out,
             mask=gl.expand_dims(rows < T, 1))
    lse_rows = m0 + gl.arange(0, BLOCK_M, layout=m_i.type.layout)
    gl.store(lse_ptr + h * T + lse_rows, m_i + gl.log2(l_i), mask=lse_rows < T)


def ws_forward(q, k, v, cu_seqlens, window, scale, block_m=128, block_n=128, stages=2, overlap=False):
    """q, k, v (T, H, D) with heads packed (stride(1) == D): TMA reads them as (T, H * D) matrices."""
    T, H, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device)
    start, _ = snapshot.document_bounds(cu_seqlens, T)
    descs = []
    for t, rows in ((q, block_m), (k, block_n), (v, block_n)):
        assert t.stride(1) == D and t.stride(2) == 1
        flat = t.as_strided((T, H * D), (t.stride(0), 1))
        layout = gl.NVMMASharedLayout.get_default_for([rows, D], gl.bfloat16)
        descs.append(TensorDescriptor(flat, [T, H * D], [t.stride(0), 1], [rows, D], layout))
    _ws_fwd_kernel[(triton.cdiv(T, block_m), H)](
        *descs, out, lse, start, T, window, scale * snapshot._LOG2E, out.stride(0), out.stride(1), HEAD_DIM=D,
        BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, NUM_WARPS=block_m // 16, OVERLAP=overlap,
        num_warps=block_m // 16)
    return out, lse


@gluon.jit
def _wg_key_blocks(start_ptr, r0, T, window, b0, n_blocks, BLOCK_N: gl.constexpr):
    """The ring blocks [j_lo, j_hi) that a warpgroup's 64 rows from r0 need, inside the ring's walk over
    [b0, b0 + n_blocks * BLOCK_N), and its fully allowed keys [f0, f1); no blocks for rows past T."""
    c0, c1, f0, f1 = _block_keys(start_ptr, r0, T, window, 64, BLOCK_N)
    j_lo = gl.minimum((c0 - b0) // BLOCK_N, n_blocks)
    j_hi = gl.maximum(gl.minimum((c1 - b0) // BLOCK_N, n_blocks), j_lo)
    if r0 >= T:
        j_lo = n_blocks
        j_hi = n_blocks
    return j_lo, j_hi, f0, f1


@gluon.jit
def _wg_store(acc, m_i, l_i, rows, r0, o_ptr, lse_ptr, T, h, stride_ot, stride_oh, HEAD_DIM: gl.constexpr):
    """A consumer warpgroup's epilogue: its 64 rows of O and of the base-2 log-sum-exp."""
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    out_rows = r0 + gl.arange(0, 64, layout=gl.SliceLayout(1, LOAD))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD))
    l_safe = gl.where(l_i > 0, l_i, 1.0)   # rows past T
    o_row: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    out = gl.convert_layout((acc / gl.expand_dims(gl.convert_layout(l_safe, o_row), 1)).to(gl.bfloat16), LOAD)
    gl.store(o_ptr + gl.expand_dims(out_rows.to(gl.int64), 1) * stride_ot + h * stride_oh + gl.expand_dims(d, 0),
             out, mask=gl.expand_dims(out_rows < T, 1))
    gl.store(lse_ptr + h * T + rows, m_i + gl.log2(l_safe), mask=rows < T)


@gluon.jit
def _ws2_drain(ready, empty, j0, j1, STAGES: gl.constexpr):
    """Ring blocks [j0, j1) that this warpgroup does not use: wait for each and hand it straight back (waiting
    first keeps this warpgroup from arriving twice in one phase of the slot's empty barrier)."""
    for j in range(j0, j1):
        mbarrier.wait(ready.index(j % STAGES), (j // STAGES) & 1)
        mbarrier.arrive(empty.index(j % STAGES), count=1)


@gluon.jit
def _ws2_consumer(q_smem, k_smem, v_smem, q_bar, ready, empty, start_ptr, o_ptr, lse_ptr, r0, T, window, qk_scale,
                  b0, n_blocks, h, stride_ot, stride_oh, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr):
    """One warpgroup's 64 query rows from r0: its own key range and masks inside the ring's walk over the
    block's union range; writes its rows of O and the log-sum-exp."""
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HEAD_DIM, 16])
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    ROW: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    COL: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
    O_ROW: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    gl.static_assert(STAGES >= 3)
    j_lo, j_hi, f0, f1 = _wg_key_blocks(start_ptr, r0, T, window, b0, n_blocks, BLOCK_N)
    _ws2_drain(ready, empty, 0, j_lo, STAGES)

    rows = r0 + gl.arange(0, 64, layout=ROW)
    row_start = gl.load(start_ptr + rows, mask=rows < T, other=T)
    s_zero = gl.zeros([64, BLOCK_N], gl.float32, S_LAYOUT)
    acc = gl.zeros([64, HEAD_DIM], gl.float32, O_LAYOUT)
    m_i = gl.full([64], float("-inf"), gl.float32, ROW)
    l_i = gl.zeros([64], gl.float32, ROW)
    mbarrier.wait(q_bar, 0)
    if j_lo < j_hi:
        mbarrier.wait(ready.index(j_lo % STAGES), (j_lo // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(j_lo % STAGES).permute((1, 0)), s_zero, use_acc=False)
    else:
        s = s_zero
    acc_tok = warpgroup_mma_init(acc)
    for j in range(j_lo, j_hi):
        if j + 1 < j_hi:
            nxt = (j + 1) % STAGES
            mbarrier.wait(ready.index(nxt), ((j + 1) // STAGES) & 1)
            s_tok = warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        else:
            s_tok = warpgroup_mma_init(s_zero)
        p, alpha, m_i, l_i = _softmax_step(s * qk_scale, m_i, l_i, rows, row_start, b0 + j * BLOCK_N, f0, f1,
                                             window, BLOCK_N, COL)
        acc, s = warpgroup_mma_wait(0, deps=[acc_tok, s_tok])
        if j > j_lo:   # block j - 1's p v is done: its slot goes back to the producer
            mbarrier.arrive(empty.index((j - 1) % STAGES), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, O_ROW), 1)
        acc_tok = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), P_LAYOUT), v_smem.index(j % STAGES), acc,
                                is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc_tok])
    if j_lo < j_hi:
        mbarrier.arrive(empty.index((j_hi - 1) % STAGES), count=1)
    _ws2_drain(ready, empty, j_hi, n_blocks, STAGES)

    _wg_store(acc, m_i, l_i, rows, r0, o_ptr, lse_ptr, T, h, stride_ot, stride_oh, HEAD_DIM)


@gluon.jit
def _ws2_load(q_desc, k_desc, v_desc, q_smem0, q_smem1, k_smem, v_smem, q_bar, ready, empty, m0, b0, n_blocks, h,
              HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Producer: both warpgroups' q (64 rows each), then the union range's key/value blocks by TMA."""
    mbarrier.expect(q_bar, 2 * 64 * HEAD_DIM * 2)
    _tma_load(q_desc, [m0, h * HEAD_DIM], q_bar, q_smem0)
    _tma_load(q_desc, [m0 + 64, h * HEAD_DIM], q_bar, q_smem1)
    for j in range(n_blocks):
        slot = j % STAGES
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)   # passes at once on the first lap
        mbarrier.expect(ready.index(slot), 2 * BLOCK_N * HEAD_DIM * 2)
        _tma_load(k_desc, [b0 + j * BLOCK_N, h * HEAD_DIM], ready.index(slot), k_smem.index(slot))
        _tma_load(v_desc, [b0 + j * BLOCK_N, h * HEAD_DIM], ready.index(slot), v_smem.index(slot))


@gluon.jit
def _pp_consumer(q_smem, k_smem, v_smem, q_bar, ready, empty, turn, c, start_ptr, o_ptr, lse_ptr, r0, T, window,
                 qk_scale, b0, n_blocks, h, stride_ot, stride_oh, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr):
    """Consumer warpgroup c (0 or 1) with FlashAttention-3's ping-pong: in its turn it issues block j's q k^T and
    block j-1's p v, then passes the turn and does block j's softmax while the other warpgroup's products run.
    Both warpgroups take a turn at every block of the ring (their own blocks or not), so the turns stay paired."""
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HEAD_DIM, 16])
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    ROW: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    COL: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
    O_ROW: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    gl.static_assert(STAGES >= 2)
    j_lo, j_hi, f0, f1 = _wg_key_blocks(start_ptr, r0, T, window, b0, n_blocks, BLOCK_N)

    rows = r0 + gl.arange(0, 64, layout=ROW)
    row_start = gl.load(start_ptr + rows, mask=rows < T, other=T)
    s_zero = gl.zeros([64, BLOCK_N], gl.float32, S_LAYOUT)
    acc = gl.zeros([64, HEAD_DIM], gl.float32, O_LAYOUT)
    p = gl.zeros([64, BLOCK_N], gl.bfloat16, P_LAYOUT)
    m_i = gl.full([64], float("-inf"), gl.float32, ROW)
    l_i = gl.zeros([64], gl.float32, ROW)
    mbarrier.wait(q_bar, 0)
    for j in range(n_blocks):
        own = (j >= j_lo) & (j < j_hi)
        prev_own = (j - 1 >= j_lo) & (j - 1 < j_hi)
        mbarrier.wait(ready.index(j % STAGES), (j // STAGES) & 1)
        mbarrier.wait(turn.index(c), j & 1)
        if own:
            s_tok = warpgroup_mma(q_smem, k_smem.index(j % STAGES).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
        else:
            s_tok = warpgroup_mma_init(s_zero)
        if prev_own:
            acc_tok = warpgroup_mma(p, v_smem.index((j + STAGES - 1) % STAGES), acc, is_async=True)
        else:
            acc_tok = warpgroup_mma_init(acc)
        mbarrier.arrive(turn.index(1 - c), count=1)
        if own:
            s = warpgroup_mma_wait(1, deps=[s_tok])
            p_f, alpha, m_i, l_i = _softmax_step(s * qk_scale, m_i, l_i, rows, row_start, b0 + j * BLOCK_N, f0,
                                                   f1, window, BLOCK_N, COL)
        else:
            p_f = s_zero
            alpha = gl.full([64], 1.0, gl.float32, ROW)
        acc = warpgroup_mma_wait(0, deps=[acc_tok])
        if j > 0:   # block j - 1's products are done
            mbarrier.arrive(empty.index((j + STAGES - 1) % STAGES), count=1)
        if own:
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, O_ROW), 1)
            p = gl.convert_layout(p_f.to(gl.bfloat16), P_LAYOUT)
    if (n_blocks - 1 >= j_lo) & (n_blocks - 1 < j_hi):
        acc = warpgroup_mma(p, v_smem.index((n_blocks - 1) % STAGES), acc)
    if n_blocks > 0:
        mbarrier.arrive(empty.index((n_blocks - 1) % STAGES), count=1)

    _wg_store(acc, m_i, l_i, rows, r0, o_ptr, lse_ptr, T, h, stride_ot, stride_oh, HEAD_DIM)


@gluon.jit
def _ws2_fwd_kernel(q_desc, k_desc, v_desc, o_ptr, lse_ptr, start_ptr, T, window, qk_scale, stride_ot, stride_oh,
                    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr):
    """128 query rows per program as two consumer partitions of one warpgroup each (own key ranges, masks and
    epilogues) and a producer warpgroup; registers move to the consumers. PINGPONG: the consumers take turns
    with the tensor core (_pp_consumer, a pair of turn mbarriers); else they run independently."""
    KV_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.bfloat16)
    Q_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], gl.bfloat16)
    qk_scale = qk_scale.to(gl.float32)
    m0 = gl.program_id(0) * 128
    h = gl.program_id(1)
    last = gl.minimum(m0 + 128, T) - 1
    b0 = (gl.maximum(gl.load(start_ptr + m0), m0 - window) // BLOCK_N) * BLOCK_N
    n_blocks = ((last + BLOCK_N) // BLOCK_N) - b0 // BLOCK_N
    q_smem0 = gl.allocate_shared_memory(gl.bfloat16, [64, HEAD_DIM], Q_SMEM)
    q_smem1 = gl.allocate_shared_memory(gl.bfloat16, [64, HEAD_DIM], Q_SMEM)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], KV_SMEM)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], KV_SMEM)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)   # both consumers hand each slot back
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    fence_async_shared()
    if PINGPONG:
        mbarrier.arrive(turn.index(0), count=1)   # warpgroup 0 goes first
        gl.warp_specialize(
            [(_pp_consumer, (q_smem0, k_smem, v_smem, q_bar, ready, empty, turn, 0, start_ptr, o_ptr, lse_ptr, m0,
                             T, window, qk_scale, b0, n_blocks, h, stride_ot, stride_oh, HEAD_DIM, BLOCK_N, STAGES)),
             (_pp_consumer, (q_smem1, k_smem, v_smem, q_bar, ready, empty, turn, 1, start_ptr, o_ptr, lse_ptr,
                             m0 + 64, T, window, qk_scale, b0, n_blocks, h, stride_ot, stride_oh, HEAD_DIM, BLOCK_N,
                             STAGES)),
             (_ws2_load, (q_desc, k_desc, v_desc, q_smem0, q_smem1, k_smem, v_smem, q_bar, ready, empty, m0, b0,
                          n_blocks, h, HEAD_DIM, BLOCK_N, STAGES))],
            [4, 4], [240, 24])
    else:
        gl.warp_specialize(
            [(_ws2_consumer, (q_smem0, k_smem, v_smem, q_bar, ready, empty, start_ptr, o_ptr, lse_ptr, m0, T,
                              window, qk_scale, b0, n_blocks, h, stride_ot, stride_oh, HEAD_DIM, BLOCK_N, STAGES)),
             (_ws2_consumer, (q_smem1, k_smem, v_smem, q_bar, ready, empty, start_ptr, o_ptr, lse_ptr, m0 + 64, T,
                              window, qk_scale, b0, n_blocks, h, stride_ot, stride_oh, HEAD_DIM, BLOCK_N, STAGES)),
             (_ws2_load, (q_desc, k_desc, v_desc, q_smem0, q_smem1, k_smem, v_smem, q_bar, ready, empty, m0, b0,
                          n_blocks, h, HEAD_DIM, BLOCK_N, STAGES))],
            [4, 4], [240, 24])


def ws2_forward(q, k, v, cu_seqlens, window, scale, block_n=64, stages=4, pingpong=False):
    T, H, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device)
    start, _ = snapshot.document_bounds(cu_seqlens, T)
    descs = []
    for t, rows in ((q, 64), (k, block_n), (v, block_n)):
        assert t.stride(1) == D and t.stride(2) == 1
        flat = t.as_strided((T, H * D), (t.stride(0), 1))
        layout = gl.NVMMASharedLayout.get_default_for([rows, D], gl.bfloat16)
        descs.append(TensorDescriptor(flat, [T, H * D], [t.stride(0), 1], [rows, D], layout))
    _ws2_fwd_kernel[(triton.cdiv(T, 128), H)](
        *descs, out, lse, start, T, window, scale * snapshot._LOG2E, out.stride(0), out.stride(1), HEAD_DIM=D,
        BLOCK_N=block_n, STAGES=stages, PINGPONG=pingpong, num_warps=4)
    return out, lse




@gluon.jit
def _issue_qdo(q_ptr, do_ptr, q_smem, do_smem, slot, m0, m_end, T, h, stride_qt, stride_qh, stride_dot,
               stride_doh, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, LOAD: gl.constexpr):
    """cp.async of the query / output-gradient block at m0 into ring slot `slot`, one commit group."""
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOAD))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD))
    ok = gl.expand_dims((rows < T) & (m0 < m_end), 1) & gl.expand_dims(d < HEAD_DIM, 0)
    rows64 = gl.expand_dims(rows.to(gl.int64), 1)
    _async_load(q_smem.index(slot), q_ptr + rows64 * stride_qt + h * stride_qh + gl.expand_dims(d, 0), mask=ok)
    _async_load(do_smem.index(slot), do_ptr + rows64 * stride_dot + h * stride_doh + gl.expand_dims(d, 0),
                mask=ok)
    async_copy.commit_group()


@gluon.jit
def _gluon_attn_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, end_ptr, dk_ptr, dv_ptr,
                            T, window, qk_scale, scale, stride_qt, stride_qh, stride_kt, stride_kh,
                            stride_vt, stride_vh, stride_dot, stride_doh, stride_gt, stride_gh,
                            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            STAGES: gl.constexpr):
    """One (key block of BLOCK_N, head): dK, dV over the query blocks of BLOCK_M that see its keys."""
    gl.static_assert(BLOCK_N == 64)  # one warpgroup of 4 warps owns the block's 64 keys
    gl.static_assert(STAGES >= 4)
    ST_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    G_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HEAD_DIM, 16])
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=G_LAYOUT, k_width=2)
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    KV_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.bfloat16)
    QD_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.bfloat16)
    KEY: gl.constexpr = gl.SliceLayout(1, ST_LAYOUT)
    QRY: gl.constexpr = gl.SliceLayout(0, ST_LAYOUT)

    qk_scale = qk_scale.to(gl.float32)
    scale = scale.to(gl.float32)
    n0 = gl.program_id(0) * BLOCK_N
    h = gl.program_id(1)
    cols = n0 + gl.arange(0, BLOCK_N, layout=KEY)
    col_ok = cols < T
    col_end = gl.load(end_ptr + cols, mask=col_ok, other=0)
    last = gl.minimum(n0 + BLOCK_N, T) - 1
    b0 = (n0 // BLOCK_M) * BLOCK_M
    b1 = gl.minimum(gl.load(end_ptr + last), last + window + 1)  # past the block's last query
    n_blocks = (b1 - b0 + BLOCK_M - 1) // BLOCK_M
    # query blocks [f0, f1) are allowed everywhere: past the diagonal, inside the window of the
    # first key and before the first key's document end
    f0 = ((last + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    f1 = (gl.minimum(gl.load(end_ptr + n0), n0 + window + 1) // BLOCK_M) * BLOCK_M

    k_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, HEAD_DIM], KV_SMEM)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, HEAD_DIM], KV_SMEM)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, HEAD_DIM], QD_SMEM)
    do_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, HEAD_DIM], QD_SMEM)

    k_rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD))
    d_load = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD))
    k_rows64 = gl.expand_dims(k_rows.to(gl.int64), 1)
    k_ok = gl.expand_dims(k_rows < T, 1)
    k_smem.store(gl.load(k_ptr + k_rows64 * stride_kt + h * stride_kh + gl.expand_dims(d_load, 0),
                         mask=k_ok, other=0.0))
    v_smem.store(gl.load(v_ptr + k_rows64 * stride_vt + h * stride_vh + gl.expand_dims(d_load, 0),
                         mask=k_ok, other=0.0))
    for i in gl.static_range(STAGES - 2):
        _issue_qdo(q_ptr, do_ptr, q_smem, do_smem, i, b0 + i * BLOCK_M, b1, T, h, stride_qt, stride_qh,
                   stride_dot, stride_doh, HEAD_DIM, BLOCK_M, LOAD)
    lse_ptr += h * T
    delta_ptr += h * T
    st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ST_LAYOUT)
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, G_LAYOUT))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, G_LAYOUT))
    for j in range(n_blocks):
        m0 = b0 + j * BLOCK_M
        rows = m0 + gl.arange(0, BLOCK_M, layout=QRY)
        row_ok = rows < T
        lse = gl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        delta = gl.load(delta_ptr + rows, mask=row_ok, other=0.0)
        # block j is in; block j - 2's slot is free (its products were waited for last iteration)
        async_copy.wait_group(STAGES - 3)
        fence_async_shared()
        _cta_barrier()
        _issue_qdo(q_ptr, do_ptr, q_smem, do_smem, (j + STAGES - 2) % STAGES, m0 + (STAGES - 2) * BLOCK_M,
                   b1, T, h, stride_qt, stride_qh, stride_dot, stride_doh, HEAD_DIM, BLOCK_M, LOAD)
        slot = j % STAGES
        s_tok = warpgroup_mma(k_smem, q_smem.index(slot).permute((1, 0)), st_zero, use_acc=False,
                              is_async=True)
        dp_tok = warpgroup_mma(v_smem, do_smem.index(slot).permute((1, 0)), st_zero, use_acc=False,
                               is_async=True)
        s_t = warpgroup_mma_wait(1, deps=[s_tok])
        p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse, 0))
        if (m0 < f0) | (m0 >= f1):
            keep = ((gl.expand_dims(rows, 0) >= gl.expand_dims(cols, 1))
                    & (gl.expand_dims(rows, 0) <= gl.expand_dims(cols, 1) + window)
                    & (gl.expand_dims(rows, 0) < gl.expand_dims(col_end, 1)))
            p_t = gl.where(keep, p_t, 0.0)
        dv = warpgroup_mma(gl.convert_layout(p_t.to(gl.bfloat16), A_LAYOUT), do_smem.index(slot), dv,
                           is_async=True)
        dp_t = warpgroup_mma_wait(1, deps=[dp_tok])
        ds_t = (p_t * (dp_t - gl.expand_dims(delta, 0))).to(gl.bfloat16)
        dk = warpgroup_mma(gl.convert_layout(ds_t, A_LAYOUT), q_smem.index(slot), dk, is_async=True)
    dk, dv = warpgroup_mma_wait(0, deps=[dk, dv])
    async_copy.wait_group(0)
    g_offs = k_rows64 * stride_gt + h * stride_gh + gl.expand_dims(d_load, 0)
    gl.store(dk_ptr + g_offs, gl.convert_layout((dk * scale).to(gl.bfloat16), LOAD), mask=k_ok)
    gl.store(dv_ptr + g_offs, gl.convert_layout(dv.to(gl.bfloat16), LOAD), mask=k_ok)


def gluon_dkdv(grad_out, q, k, v, lse, delta, cu_seqlens, window, scale, block_m=32, stages=4):
    T, H, D = q.shape
    dk, dv = torch.empty_like(q), torch.empty_like(q)
    _, end = snapshot.document_bounds(cu_seqlens, T)
    _gluon_attn_dkdv_kernel[(triton.cdiv(T, 64), H)](
        q, k, v, grad_out, lse, delta, end, dk, dv, T, window, scale * snapshot._LOG2E, scale, q.stride(0),
        q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), grad_out.stride(0), grad_out.stride(1),
        dk.stride(0), dk.stride(1), HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=64, STAGES=stages, num_warps=4)
    return dk, dv


# (BLOCK_M, BLOCK_N, STAGES, maxnreg): BLOCK_M / 16 warps, so 128-row blocks are two warpgroups sharing each
# key/value slot; maxnreg=128 fits two of those programs on an SM
FWD_CONFIGS = [(64, 32, 3, None), (64, 64, 3, None), (64, 32, 4, None), (128, 32, 3, None), (128, 64, 3, None),
               (128, 32, 3, 128), (128, 64, 3, 128)]
SYNC_CONFIGS = [(64, 32, 3, None), (64, 64, 3, None)]   # the same kernel with OVERLAP=False
# (BLOCK_M, BLOCK_N, STAGES) of the warp-specialized forward: BLOCK_M / 16 consumer warps + a producer warpgroup
WS_CONFIGS = [(128, 128, 2, False), (128, 64, 2, False), (128, 128, 3, True), (128, 64, 3, True),
              (128, 64, 4, True), (128, 32, 4, True)]
# (BLOCK_N, STAGES) of the forward with one partition per consumer warpgroup
WS2_CONFIGS = [(64, 4), (64, 3), (64, 5), (32, 6)]
PP_CONFIGS = [(64, 4), (64, 5), (128, 2), (32, 6)]   # the same with ping-pong
# (BLOCK_M queries per step, STAGES): 64 keys per program, 4 warps
DKDV_CONFIGS = [(32, 4), (32, 5), (16, 4), (64, 4)]


def ptxas_usage(ptx: str) -> str:
    """Registers and spill stores of a PTX module, from the ptxas that ships with triton. Triton 3.9 writes a newer
    PTX version than its ptxas reads; the version line is lowered to the one ptxas names in its error."""
    import re
    import subprocess
    import tempfile
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    for _ in range(2):
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                           text=True)
        os.unlink(f.name)
        supported = re.search(r"Unsupported \.version \S+; current version is '([\d.]+)'", r.stderr)
        if not supported:
            break
        ptx = re.sub(r"^\.version \d+\.\d+", f".version {supported.group(1)}", ptx, flags=re.M)
    regs = re.findall(r"Used (\d+) registers", r.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", r.stderr)
    return f"{regs[0]} registers, {spills[0]} B spill stores" if regs and spills else r.stderr[-300:]


def compile_sm90(kernel, signature: dict, constexprs: dict, num_warps: int, maxnreg=None) -> str:
    """Compile a Gluon kernel for sm_90 as a launch with 16-aligned pointers, strides and T would: shared memory,
    wgmma waits in the PTX, registers and spills."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    names = kernel.arg_names
    sig = {n: "constexpr" if n in constexprs else signature.get(n, "i32") for n in names}  # strides: i32
    aligned = [n for n in names if n.endswith("_ptr") or n.startswith("stride") or n == "T"]  # not descriptors
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    try:
        k = triton.compile(GluonASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "maxnreg": maxnreg})
    except Exception as e:
        while e.__cause__ is not None:
            e = e.__cause__
        return f"failed: {type(e).__name__}: {str(e)[-2000:]}"
    return (f"shared {k.metadata.shared} B, {k.asm['ptx'].count('wgmma.wait_group')} wgmma waits, "
            f"{ptxas_usage(k.asm['ptx'])}")


def desc_types(q_rows: int, kv_rows: int) -> dict:
    """The signature types of q, k, v tensor descriptors with these block rows (head dim 128), as a launch
    specialises them."""
    from triton.runtime.jit import mangle_type
    types = {}
    for name, rows in (("q_desc", q_rows), ("k_desc", kv_rows), ("v_desc", kv_rows)):
        layout = gl.NVMMASharedLayout.get_default_for([rows, 128], gl.bfloat16)
        base = torch.zeros(256, 768, dtype=torch.bfloat16)
        types[name] = mangle_type(TensorDescriptor(base, [256, 768], [768, 1], [rows, 128], layout))
    return types


def compile_only() -> None:
    print(f"triton {triton.__version__}, sm_90 compiles", flush=True)
    ptrs = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "lse_ptr": "*fp32", "window": "i32", "T": "i32",
            "qk_scale": "fp32", "scale": "fp32"}
    fwd_sig = {**ptrs, "o_ptr": "*bf16", "start_ptr": "*i32"}
    for bm, bn, stages, maxnreg in FWD_CONFIGS:
        for overlap in (True, False) if (bm, bn, stages, maxnreg) in SYNC_CONFIGS else (True,):
            consts = {"HEAD_DIM": 128, "BLOCK_M": bm, "BLOCK_N": bn, "STAGES": stages, "NUM_WARPS": bm // 16,
                      "OVERLAP": overlap}
            print(f"forward BM={bm} BN={bn} stages={stages} maxnreg={maxnreg} overlap={overlap}: "
                  f"{compile_sm90(_gluon_attn_fwd_kernel, fwd_sig, consts, bm // 16, maxnreg)}", flush=True)
    for bm, bn, stages, overlap in WS_CONFIGS:
        consts = {"HEAD_DIM": 128, "BLOCK_M": bm, "BLOCK_N": bn, "STAGES": stages, "NUM_WARPS": bm // 16,
                  "OVERLAP": overlap}
        print(f"warp-specialized forward BM={bm} BN={bn} stages={stages} overlap={overlap}: "
              f"{compile_sm90(_ws_fwd_kernel, {**fwd_sig, **desc_types(bm, bn)}, consts, bm // 16)}", flush=True)
    for name, pingpong, configs in (("per-warpgroup partitions", False, WS2_CONFIGS), ("ping-pong", True, PP_CONFIGS)):
        for bn, stages in configs:
            consts = {"HEAD_DIM": 128, "BLOCK_N": bn, "STAGES": stages, "PINGPONG": pingpong}
            print(f"{name} forward BN={bn} stages={stages}: "
                  f"{compile_sm90(_ws2_fwd_kernel, {**fwd_sig, **desc_types(64, bn)}, consts, 4)}", flush=True)
    dkdv_sig = {**ptrs, "do_ptr": "*bf16", "delta_ptr": "*fp32", "end_ptr": "*i32", "dk_ptr": "*bf16",
                "dv_ptr": "*bf16"}
    for bm, stages in DKDV_CONFIGS:
        consts = {"HEAD_DIM": 128, "BLOCK_M": bm, "BLOCK_N": 64, "STAGES": stages}
        print(f"dK/dV BM={bm} stages={stages}: {compile_sm90(_gluon_attn_dkdv_kernel, dkdv_sig, consts, 4)}",
              flush=True)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def failure(e: Exception) -> str:
    return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def bench_shape(spec: str, T: int, H: int, window: int, cu: torch.Tensor, lens: list, device, bench_attention,
                gpu_kernel_ms) -> None:
    gen = torch.Generator().manual_seed(T)
    q, k, v, do = (torch.randn(T, H, 128, generator=gen).to(device, torch.bfloat16) for _ in range(4))
    cu, scale = cu.to(device), 0.12
    flops = 4 * bench_attention.attended_pairs(lens, window) * H * 128   # forward, unmasked pairs
    out, lse = snapshot.varlen_attention_fwd_triton(q, k, v, cu, window, scale)
    fwd = gpu_kernel_ms(lambda: snapshot.varlen_attention_fwd_triton(q, k, v, cu, window, scale))["_attn_fwd_kernel"]
    print(f"{spec}: triton forward {fwd:.3f} ms ({flops / fwd / 1e9:.0f} TFLOP/s)", flush=True)
    configs = [c + (True,) for c in FWD_CONFIGS] + [c + (False,) for c in SYNC_CONFIGS]
    for bm, bn, stages, maxnreg, overlap in configs:
        try:
            o, lse_g = gluon_forward(q, k, v, cu, window, scale, bm, bn, stages, maxnreg, overlap)
            t = gpu_kernel_ms(lambda: gluon_forward(q, k, v, cu, window, scale, bm, bn, stages, maxnreg,
                                                    overlap))["_gluon_attn_fwd_kernel"]
            print(f"  gluon forward BM={bm} BN={bn} stages={stages} maxnreg={maxnreg} overlap={overlap}: {t:.3f} ms "
                  f"({fwd / t:.2f}x)  out rel diff {rel_diff(o, out):.1e}  lse max diff "
                  f"{(lse_g - lse).abs().max().item():.1e}", flush=True)
        except Exception as e:
            print(f"  gluon forward BM={bm} BN={bn} stages={stages} maxnreg={maxnreg} overlap={overlap}: "
                  f"{failure(e)}", flush=True)
    for bm, bn, stages, overlap in WS_CONFIGS:
        try:
            o, lse_g = ws_forward(q, k, v, cu, window, scale, bm, bn, stages, overlap)
            t = gpu_kernel_ms(lambda: ws_forward(q, k, v, cu, window, scale, bm, bn, stages,
                                                 overlap))["_ws_fwd_kernel"]
            print(f"  warp-specialized forward BM={bm} BN={bn} stages={stages} overlap={overlap}: {t:.3f} ms "
                  f"({fwd / t:.2f}x)  "
                  f"out rel diff {rel_diff(o, out):.1e}  lse max diff {(lse_g - lse).abs().max().item():.1e}",
                  flush=True)
        except Exception as e:
            print(f"  warp-specialized forward BM={bm} BN={bn} stages={stages} overlap={overlap}: {failure(e)}",
                  flush=True)
    for name, pingpong, configs in (("per-warpgroup partitions", False, WS2_CONFIGS), ("ping-pong", True, PP_CONFIGS)):
        for bn, stages in configs:
            try:
                o, lse_g = ws2_forward(q, k, v, cu, window, scale, bn, stages, pingpong)
                t = gpu_kernel_ms(lambda: ws2_forward(q, k, v, cu, window, scale, bn, stages,
                                                      pingpong))["_ws2_fwd_kernel"]
                print(f"  {name} forward BN={bn} stages={stages}: {t:.3f} ms ({fwd / t:.2f}x)  "
                      f"out rel diff {rel_diff(o, out):.1e}  lse max diff {(lse_g - lse).abs().max().item():.1e}",
                      flush=True)
            except Exception as e:
                print(f"  {name} forward BN={bn} stages={stages}: {failure(e)}", flush=True)
    _, dk, dv = snapshot.varlen_attention_bwd_triton(do, q, k, v, out, lse, cu, window, scale)
    bwd = gpu_kernel_ms(lambda: snapshot.varlen_attention_bwd_triton(do, q, k, v, out, lse, cu, window, scale))
    print(f"  triton dQ {bwd['_attn_dq_kernel']:.3f} ms, dK/dV {bwd['_attn_dkdv_kernel']:.3f} ms", flush=True)
    delta = (out.float() * do.float()).sum(-1).transpose(0, 1).contiguous()   # the dQ kernel's, summed by torch
    for bm, stages in DKDV_CONFIGS:
        try:
            dk_g, dv_g = gluon_dkdv(do, q, k, v, lse, delta, cu, window, scale, bm, stages)
            t = gpu_kernel_ms(lambda: gluon_dkdv(do, q, k, v, lse, delta, cu, window, scale, bm,
                                                 stages))["_gluon_attn_dkdv_kernel"]
            print(f"  gluon dK/dV BM={bm} stages={stages}: {t:.3f} ms ({bwd['_attn_dkdv_kernel'] / t:.2f}x)  "
                  f"rel diff dK {rel_diff(dk_g, dk):.1e} dV {rel_diff(dv_g, dv):.1e}", flush=True)
        except Exception as e:
            print(f"  gluon dK/dV BM={bm} stages={stages}: {failure(e)}", flush=True)


def ncu_target(spec: str, bench_attention) -> None:
    """Each profiled kernel once (after a first call that compiles it): ncu_profile.sh."""
    T, H, window, cu, _ = bench_attention.shape_case(spec)
    gen = torch.Generator().manual_seed(T)
    q, k, v, do = (torch.randn(T, H, 128, generator=gen).cuda().bfloat16() for _ in range(4))
    cu, scale = cu.cuda(), 0.12
    out, lse = snapshot.varlen_attention_fwd_triton(q, k, v, cu, window, scale)
    delta = (out.float() * do.float()).sum(-1).transpose(0, 1).contiguous()
    runs = [lambda: snapshot.varlen_attention_fwd_triton(q, k, v, cu, window, scale),
            lambda: gluon_forward(q, k, v, cu, window, scale, 64, 32, 3),
            lambda: ws_forward(q, k, v, cu, window, scale, 128, 64, 4, True),
            lambda: ws2_forward(q, k, v, cu, window, scale, 64, 4),
            lambda: snapshot.varlen_attention_bwd_triton(do, q, k, v, out, lse, cu, window, scale),
            lambda: gluon_dkdv(do, q, k, v, lse, delta, cu, window, scale, 32, 4)]
    for run in runs:   # compile everything first: ncu counts kernel launches, not compiles
        run()
    torch.cuda.synchronize()
    for run in runs:
        run()
    torch.cuda.synchronize()


def main() -> None:
    if "--compile-only" in sys.argv:
        compile_only()
        return
    import attention_snapshot as bench_attention   # bench/attention.py's helpers, copied
    from attention_snapshot import gpu_kernel_ms
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    needs = "a Hopper GPU (sm_90), or --compile-only"
    cases = bench_attention.gpu_shape_cases(args[0] if args else DEFAULT_SHAPES, needs)
    if torch.cuda.get_device_capability() != (9, 0):
        sys.exit(f"error: this benchmark needs {needs}; run it on the device")
    if "--ncu-target" in sys.argv:
        ncu_target(cases[0][0], bench_attention)
        return
    device = torch.device("cuda")
    for spec, (T, H, window, cu, lens) in cases:
        bench_shape(spec, T, H, window, cu, lens, device, bench_attention, gpu_kernel_ms)


if __name__ == "__main__":
    main()
