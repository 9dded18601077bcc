"""A copy of the shipped Triton attention (triton_kernels.py section 8, identical from 2eaa930 through 1a3f24e) and
of bench/attention.py's shape and timing helpers (unchanged since a59752b), for the experiment scripts in this folder.

Unshipped evidence, not run by CI. Self-contained: the scripts import this file from their own folder (Python puts a
script's folder first on sys.path), never triton_kernels.py, train_gpt.py or bench/. The kernels are verbatim, so
their names (which the profiler reports) and their outputs are the shipped ones of that time; the launchers drop the
input checks and torch.library wrapping.
"""
import math
import sys

import torch
import triton
import triton.language as tl
from torch import Tensor

_ATTN_TILES = {"fwd": (64, 32, 4, 3), "dkdv": (32, 64, 4, 3), "dq": (64, 32, 4, 3)}  # (BLOCK_M, BLOCK_N, warps, stages)
_LOG2E = 1.4426950408889634


# ---- the kernels, verbatim ----------------------------------------------------------------------------------------

@triton.jit
def _attn_block_ranges(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    """Aligned block starts for the three loops over [lo, hi): masked [b0, f0), full [f0, f1),
    masked [f1, b1). full_lo / full_hi are the unaligned bounds of the allowed-everywhere part."""
    b0 = (lo // BLOCK) * BLOCK
    b1 = tl.cdiv(hi, BLOCK) * BLOCK
    f0 = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK) * BLOCK, b0), b1)
    f1 = tl.maximum(tl.minimum((full_hi // BLOCK) * BLOCK, b1), f0)
    return b0, f0, f1, b1


@triton.jit
def _attn_query_block(start_ptr, m0, T, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The rows of the query block at m0, their document starts, and the three key loops' ranges
    (shared by the forward and the dQ kernel, which must visit the same keys)."""
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    row_start = tl.load(start_ptr + rows, mask=row_ok, other=T)
    last = tl.minimum(m0 + BLOCK_M, T) - 1
    b0, f0, f1, b1 = _attn_block_ranges(
        tl.maximum(tl.load(start_ptr + m0), m0 - window), last + 1,
        tl.maximum(tl.load(start_ptr + last), last - window), m0 + 1, BLOCK_N)
    return rows, row_ok, row_start, b0, f0, f1, b1


@triton.jit
def _attn_fwd_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, n0, rows, row_start, window, qk_scale,
                   stride_kt, stride_vt, T, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = (cols < T)[:, None]
    k = tl.load(k_ptrs + n0 * stride_kt, mask=col_ok, other=0.0)
    s = tl.dot(q, tl.trans(k)) * qk_scale                                   # (BM, BN), base 2
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
def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, start_ptr, T, window, qk_scale,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                     stride_oh, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """One (query block, head): o and the base-2 log-sum-exp of its rows."""
    # inductor may pass the float arguments as fp64 scalars; keep every product fp32
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
    for n0 in range(b0, f0, BLOCK_N):
        acc, l_i, m_i = _attn_fwd_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, n0, rows, row_start,
                                       window, qk_scale, stride_kt, stride_vt, T, BLOCK_N, True)
    for n0 in range(f0, f1, BLOCK_N):
        acc, l_i, m_i = _attn_fwd_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, n0, rows, row_start,
                                       window, qk_scale, stride_kt, stride_vt, T, BLOCK_N, False)
    for n0 in range(f1, b1, BLOCK_N):
        acc, l_i, m_i = _attn_fwd_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, n0, rows, row_start,
                                       window, qk_scale, stride_kt, stride_vt, T, BLOCK_N, True)
    out = acc / l_i[:, None]
    tl.store(o_ptr + rows.to(tl.int64)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + h * T + rows, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def _attn_dkdv_step(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, m0, cols, col_end, window,
                    qk_scale, stride_qt, stride_dot, T, BLOCK_M: tl.constexpr):
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    q = tl.load(q_ptrs + m0 * stride_qt, mask=row_ok[:, None], other=0.0)
    do = tl.load(do_ptrs + m0 * stride_dot, mask=row_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
    # the two products that need only the loads come first: the second is issued before the
    # first is waited for
    s_t = tl.dot(k, tl.trans(q))                                            # (BN, BM)
    dp_t = tl.dot(v, tl.trans(do))
    keep = ((rows[None, :] >= cols[:, None]) & (rows[None, :] <= cols[:, None] + window)
            & (rows[None, :] < col_end[:, None]))
    p_t = tl.where(keep, tl.exp2(s_t * qk_scale - lse[None, :]), 0.0)
    ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
    dv += tl.dot(p_t.to(do.dtype), do)
    dk += tl.dot(ds_t, q)
    return dk, dv


@triton.jit
def _attn_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, end_ptr, dk_ptr, dv_ptr,
                      T, window, qk_scale, scale, stride_qt, stride_qh, stride_kt, stride_kh,
                      stride_vt, stride_vh, stride_dot, stride_doh, stride_gt, stride_gh,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One (key block, head): dK and dV over every query that sees one of its keys, written with
    strides (stride_gt, stride_gh, 1)."""
    # inductor may pass the float arguments as fp64 scalars; keep every product fp32
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)
    n0 = tl.program_id(0) * BLOCK_N
    h = tl.program_id(1)
    cols = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    col_ok = cols < T
    col_end = tl.load(end_ptr + cols, mask=col_ok, other=0)
    last = tl.minimum(n0 + BLOCK_N, T) - 1
    b0 = (n0 // BLOCK_M) * BLOCK_M
    b1 = tl.minimum(tl.load(end_ptr + last), last + window + 1)  # past the block's last query
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
    for m0 in range(b0, b1, BLOCK_M):  # one loop, every block masked (see the header)
        dk, dv = _attn_dkdv_step(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, m0, cols,
                                 col_end, window, qk_scale, stride_qt, stride_dot, T, BLOCK_M)
    g_offs = cols.to(tl.int64)[:, None] * stride_gt + h * stride_gh + d[None, :]
    tl.store(dk_ptr + g_offs, (dk * scale).to(dk_ptr.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dv_ptr + g_offs, dv.to(dv_ptr.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _attn_dq_step(dq, q, do, lse, delta, k_ptrs, v_ptrs, n0, rows, row_start, window, qk_scale,
                  stride_kt, stride_vt, T, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = (cols < T)[:, None]
    k = tl.load(k_ptrs + n0 * stride_kt, mask=col_ok, other=0.0)
    v = tl.load(v_ptrs + n0 * stride_vt, mask=col_ok, other=0.0)
    s = tl.dot(q, tl.trans(k))                                              # (BM, BN)
    dp = tl.dot(do, tl.trans(v))
    p = tl.exp2(s * qk_scale - lse[:, None])
    if MASKED:
        keep = ((cols[None, :] >= row_start[:, None]) & (cols[None, :] <= rows[:, None])
                & (cols[None, :] >= rows[:, None] - window))
        p = tl.where(keep, p, 0.0)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k)


@triton.jit
def _attn_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, delta_ptr, start_ptr, dq_ptr, T,
                    window, qk_scale, scale, stride_qt, stride_qh, stride_kt, stride_kh,
                    stride_vt, stride_vh, stride_dot, stride_doh, stride_ot, stride_oh,
                    stride_gt, stride_gh, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """One (query block, head): delta = rowsum(dO * O) of its rows, stored for the dK/dV kernel,
    and dQ over the keys its rows see (the forward's ranges)."""
    # inductor may pass the float arguments as fp64 scalars; keep every product fp32
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
    o = tl.load(o_ptr + rows.to(tl.int64)[:, None] * stride_ot + h * stride_oh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(delta_ptr + h * T + rows, delta, mask=row_ok)
    cols0 = tl.arange(0, BLOCK_N)
    k_ptrs = k_ptr + cols0.to(tl.int64)[:, None] * stride_kt + h * stride_kh + d[None, :]
    v_ptrs = v_ptr + cols0.to(tl.int64)[:, None] * stride_vt + h * stride_vh + d[None, :]
    dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    for n0 in range(b0, f0, BLOCK_N):
        dq = _attn_dq_step(dq, q, do, lse, delta, k_ptrs, v_ptrs, n0, rows, row_start, window,
                           qk_scale, stride_kt, stride_vt, T, BLOCK_N, True)
    for n0 in range(f0, f1, BLOCK_N):
        dq = _attn_dq_step(dq, q, do, lse, delta, k_ptrs, v_ptrs, n0, rows, row_start, window,
                           qk_scale, stride_kt, stride_vt, T, BLOCK_N, False)
    for n0 in range(f1, b1, BLOCK_N):
        dq = _attn_dq_step(dq, q, do, lse, delta, k_ptrs, v_ptrs, n0, rows, row_start, window,
                           qk_scale, stride_kt, stride_vt, T, BLOCK_N, True)
    tl.store(dq_ptr + rows.to(tl.int64)[:, None] * stride_gt + h * stride_gh + d[None, :],
             (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


def document_bounds(cu_seqlens: Tensor, num_tokens: int) -> tuple[Tensor, Tensor]:
    """(start, end) int32 (T,): the document [start[t], end[t]) that holds token t. cu_seqlens may
    end in repeats of T and hold empty documents (repeated boundaries)."""
    t = torch.arange(num_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    doc = torch.searchsorted(cu_seqlens, t, right=True) - 1       # last boundary <= t
    return cu_seqlens[doc], cu_seqlens[doc + 1]


# ---- the launchers (the shipped ones without input checks, wrap_triton and the tiles override) ----------------------

def varlen_attention_fwd_triton(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int,
                                scale: float) -> tuple[Tensor, Tensor]:
    """-> out (T, H, D) in q's dtype, lse (H, T) fp32 (base 2, of the logits times scale * log2 e)."""
    T, H, D = q.shape
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device)
    start, _ = document_bounds(cu_seqlens, T)
    bm, bn, warps, stages = _ATTN_TILES["fwd"]
    _attn_fwd_kernel[(triton.cdiv(T, bm), H)](
        q, k, v, out, lse, start, T, window, scale * _LOG2E, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1), HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn,
        num_warps=warps, num_stages=stages)
    return out, lse


def varlen_attention_bwd_triton(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                cu_seqlens: Tensor, window: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv), each (T, H, D) contiguous in q's dtype, from the forward's out and lse."""
    T, H, D = q.shape
    dq, dk, dv = (torch.empty((T, H, D), dtype=q.dtype, device=q.device) for _ in range(3))
    start, end = document_bounds(cu_seqlens, T)
    delta = torch.empty((H, T), dtype=torch.float32, device=q.device)  # written by the dQ kernel
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               grad_out.stride(0), grad_out.stride(1))
    bm, bn, warps, stages = _ATTN_TILES["dq"]
    _attn_dq_kernel[(triton.cdiv(T, bm), H)](
        q, k, v, grad_out, out, lse, delta, start, dq, T, window, scale * _LOG2E, scale, *strides,
        out.stride(0), out.stride(1), dq.stride(0), dq.stride(1), HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn,
        num_warps=warps, num_stages=stages)
    bm, bn, warps, stages = _ATTN_TILES["dkdv"]
    _attn_dkdv_kernel[(triton.cdiv(T, bn), H)](
        q, k, v, grad_out, lse, delta, end, dk, dv, T, window, scale * _LOG2E, scale, *strides,
        dk.stride(0), dk.stride(1), HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    return dq, dk, dv


# ---- bench/attention.py's helpers, verbatim -------------------------------------------------------------------------

def fineweb_like_cu_seqlens(num_tokens: int, gen: torch.Generator, max_doc: int = 2048) -> tuple[torch.Tensor, list]:
    """int32 cu_seqlens padded with repeats of T to a multiple of 128 entries (as the loader pads), and the lengths."""
    lens = []
    while sum(lens) < num_tokens:
        length = math.exp(math.log(400.0) + torch.randn((), generator=gen).item())  # median 400, sigma 1
        lens.append(max(1, min(max_doc, int(length))))
    lens[-1] -= sum(lens) - num_tokens
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    cu += [num_tokens] * (-len(cu) % 128)
    return torch.tensor(cu, dtype=torch.int32), lens


def shape_case(spec: str) -> tuple[int, int, int, torch.Tensor, list]:
    """A "T:layout:window" spec of the tile and error benches -> (rows, heads, window, cu_seqlens, doc lengths) on the
    CPU, with the FineWeb-like documents of T tokens (seeded by T). normal: (T, 6, 128); paired: (2T, 3, 128), the
    documents (boundaries and lengths) doubled; the window is taken as given (in the layout's positions)."""
    parts = spec.split(":")
    if len(parts) != 3 or parts[1] not in ("normal", "paired") or not (parts[0].isdigit() and parts[2].isdigit()):
        raise ValueError(f"shape {spec!r} is not T:layout:window (layout normal or paired), e.g. 49152:normal:768")
    T, layout, window = int(parts[0]), parts[1], int(parts[2])
    cu, lens = fineweb_like_cu_seqlens(T, torch.Generator().manual_seed(T))
    if layout == "normal":
        return T, 6, window, cu, lens
    return 2 * T, 3, window, cu * 2, [2 * n for n in lens]


def gpu_shape_cases(shapes: str, needs: str) -> list[tuple[str, tuple]]:
    """[(spec, shape_case(spec))] of a comma-separated list of specs, for a benchmark that needs a CUDA GPU (`needs`
    says which); prints the versions and the GPU. A malformed spec, or a machine without CUDA, exits with one
    error line."""
    try:
        cases = [(spec, shape_case(spec)) for spec in shapes.split(",")]
    except ValueError as e:
        sys.exit(f"error: {e}")
    if not torch.cuda.is_available():
        sys.exit(f"error: this benchmark needs {needs}; run it on the device")
    import triton
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}", flush=True)
    return cases


def gpu_kernel_ms(fn, iters: int = 20) -> dict[str, float]:
    """GPU time of fn() per CUDA kernel it launches, in ms per call, from the profiler, by kernel name. Launch
    overhead on the CPU is left out: in the compiled model the CPU runs ahead of the GPU, and a Python launcher would
    otherwise dominate at small shapes."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return kernel_times(prof.events(), iters)


def kernel_times(events, iters: int) -> dict[str, float]:
    """ms per call of each CUDA kernel among profiler events, summed by short name (short_kernel_name)."""
    cuda = torch.autograd.DeviceType.CUDA
    times: dict[str, float] = {}
    for e in events:
        if e.device_type == cuda:
            name = short_kernel_name(e.name)
            times[name] = times.get(name, 0.0) + e.time_range.elapsed_us() / iters / 1e3
    return times


def short_kernel_name(name: str) -> str:
    """A kernel's name without its return type, namespaces, template and argument lists: `void at::native::
    (anonymous namespace)::reduce_kernel<512, 1, ...>(...)` -> `reduce_kernel`. Other names (Triton kernels,
    `Memcpy DtoD (Device -> Device)`) stay as they are."""
    if "::" not in name and "<" not in name:
        return name
    depth, cut = 0, []
    for ch in name:   # drop everything inside <...> and (...), nested
        depth += ch in "<("
        if depth == 0:
            cut.append(ch)
        depth -= ch in ">)" and depth > 0
    words = "".join(cut).split()
    return (words[-1] if words else name).split("::")[-1] or name


def attended_pairs(doc_lens: list, window: int) -> int:
    """Number of (query, key) pairs computed: a query at offset p in its document sees min(p, window) + 1 keys."""
    total = 0
    for n in doc_lens:
        m = min(n, window + 1)
        total += m * (m + 1) // 2 + (n - m) * (window + 1)
    return total
