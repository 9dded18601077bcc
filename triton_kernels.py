"""Fused Triton kernels for the speedrun trainer, one section per operation.

Each section has the kernel(s), a launcher `X_triton` that checks its inputs (any device: the
interpreter on a CPU), the fused op the trainer calls (through torch.library, CUDA tensors) and a
plain-PyTorch reference `X_reference` with the same contract. Nothing here chooses between the two:
train_gpt.kernel_ops does, once per run (the references off CUDA, and wherever one was edited).
Importing this file does nothing: no device queries, no compiles. Nothing autotunes at start-up:
each launcher's tiles are fixed, chosen by a bench/ script (measurements: notes/kernels.md).

How the ops reach torch.compile: every kernel launch sits inside a `torch.library.triton_op`
(namespace `nanogpt_kernels`) and goes through `torch.library.wrap_triton` (via `wrap_triton`), so
`torch.compile(fullgraph=True)` traces through it with no graph break; the differentiable ops
wrap those in a `torch.autograd.Function`. Float scalars (b, c of `ba_plus_cAA`) are plain fp32
kernel arguments, so Triton never recompiles when they change; torch.compile bakes them into the
graph as constants, which is what Polar Express wants (its coefficient table is fixed).

Testing: the launchers also accept float32 tensors on the CPU, where they run under Triton's
interpreter (TRITON_INTERPRET=1, whose bf16 arithmetic is not faithful); float32 inputs give float32
outputs with the same rounding points (a bf16 rounding point becomes a no-op).
"""
from __future__ import annotations

import functools
import struct

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op
from torch.library import wrap_triton as _torch_wrap_triton
from triton.runtime.interpreter import InterpretedFunction

_LIB = "nanogpt_kernels"  # torch.library namespace of the ops below:
                          # torch.ops.nanogpt_kernels.<name>
_KERNEL_DTYPES = (torch.bfloat16, torch.float32)  # bf16 in training; float32 for interpreter tests


def wrap_triton(kernel):
    """torch.library.wrap_triton, except that a kernel under Triton's interpreter
    (TRITON_INTERPRET=1, the CPU tests) launches as it is: torch 2.13 does so itself, torch 2.11
    raises. Launchers call it by this name, which torch's scan for a triton_op's kernels matches.
    Under torch.compile (never interpreted) the type is not asked: dynamo cannot trace that check."""
    if not torch.compiler.is_compiling() and isinstance(kernel, InterpretedFunction):
        return kernel
    return _torch_wrap_triton(kernel)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the plain-PyTorch paths compute in: fp32 for bf16 and fp32 tensors (the
    kernels' accumulator), float64 for float64 ones (the trainer's --dtype=float64 CPU mode, whose
    point is that no step rounds to fp32)."""
    return torch.promote_types(dtype, torch.float32)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_dtype(name: str, t: Tensor) -> None:
    _check(t.dtype in _KERNEL_DTYPES,
           f"{name} has dtype {t.dtype}; pass bfloat16 (float32 only for interpreter tests)")


@functools.lru_cache(maxsize=None)
def _num_programs_persistent(device: torch.device) -> int:
    """Programs of a persistent kernel: one per SM on a GPU; a few on the CPU so the interpreter
    walks several tiles per program (the code path that matters)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 3


# bf16 through its bits: bf16 is the high half of an fp32, rounded to nearest even on the way back
# (NaN -> 0x7FFF, as CUDA's cvt.rn.bf16.f32 gives). The interpreter's own fp32->bf16 cast truncates;
# these helpers make the bf16 rounding points of sections 4-7 bit-exact there too, and cost a few
# integer operations on the GPU.

@triton.jit
def _load_as_fp32(ptrs, mask):
    """Load bf16 (through its bits: exact) or fp32 values as fp32; mask None: every pointer."""
    if mask is None:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    if ptrs.dtype.element_ty == tl.bfloat16:
        x = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x


@triton.jit
def _bf16_bits_rne(x):
    """fp32 -> bf16 bits (uint32 holding 16 bits), round to nearest even; NaN -> 0x7FFF (CUDA's
    canonical bf16 NaN)."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FFF, r)


@triton.jit
def _round_as(ptrs, x):
    """fp32 x rounded to the dtype ptrs point to (bf16: nearest even, via the bits), as fp32."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        x = (_bf16_bits_rne(x) << 16).to(tl.float32, bitcast=True)
    return x


@triton.jit
def _store_from_fp32(ptrs, x, mask):
    """Store fp32 values to a bf16 (round to nearest even, via the bits) or fp32 tensor."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        bits = _bf16_bits_rne(x).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        tl.store(ptrs, bits, mask=mask)
    else:
        tl.store(ptrs, x, mask=mask)


# ==================================================================================================
# 1. Symmetric X @ X.T  (Polar Express.1); its epilogue flag also serves section 2
#    (symmetric-matmul kernel upstream: @byronxu99, record 27)
# ==================================================================================================
# Only tiles with at least one element on or below the diagonal are computed; each stores its
# lower-triangle elements (row >= col) as themselves and the strictly-lower ones again at the
# mirrored position. Every output element is therefore written exactly once, from one fp32 dot
# product, so the output is exactly symmetric whatever the tile shapes (also when BM != BN and tiles
# straddle the diagonal) and whatever the summation order inside tl.dot.

# Fixed tiles (BM, BN, BK, warps, stages), no autotuning, so start-up compiles and times nothing:
# 64x64 suits every shape Polar Express gives the kernel except long rows (K >= _SYM_LARGE_MIN_K,
# X X^T of the MLP's 768 x 3072 matrices) with enough 128x128 tiles to fill every SM.
# (measurements: notes/kernels.md#xxt)
_SYM_SMALL_TILES = (64, 64, 64, 4, 4)
_SYM_LARGE_TILES = (128, 128, 64, 8, 3)
_SYM_LARGE_MIN_K = 2048


def _sym_tiles(M: int, K: int, n_batch: int, device: torch.device) -> tuple[int, ...]:
    """The tiles for n_batch (M, K) inputs: 128x128 for long rows whose tiles fill every SM."""
    bm = _SYM_LARGE_TILES[0]
    if K >= _SYM_LARGE_MIN_K and (M + bm - 1) // bm * ((M + bm - 1) // bm) * n_batch >= \
            _num_programs_persistent(device):
        return _SYM_LARGE_TILES
    return _SYM_SMALL_TILES


@triton.jit
def _sym_aat_kernel(a_ptr, out_ptr, M, K, stride_ab, stride_am, stride_ak, stride_ob, stride_om,
                    stride_on, b_coef, c_coef, ADD_BA: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[bi] = A[bi] @ A[bi].T (ADD_BA=False) or c*(A@A.T) + b*A (ADD_BA=True, A square); grid
    (tiles, batch)."""
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    num_pid_n = tl.cdiv(M, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    row0 = pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    # Skip tiles strictly above the diagonal: their smallest column exceeds their largest row.
    if col0 > row0 + BLOCK_M - 1:
        return
    a_base = a_ptr + batch * stride_ab
    rk = tl.arange(0, BLOCK_K)
    # Rows past M wrap to valid rows (no load masks); their results are masked at the store.
    rm = (row0 + tl.arange(0, BLOCK_M)) % M
    rn = (col0 + tl.arange(0, BLOCK_N)) % M
    a_ptrs = a_base + rm[:, None] * stride_am + rk[None, :] * stride_ak  # (BM, BK)
    b_ptrs = a_base + rn[:, None] * stride_am + rk[None, :] * stride_ak  # (BN, BK)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Full K tiles without masks (keeps the loop pipelined and loads vectorised), then one masked
    # tail tile.
    for _ in range(0, K // BLOCK_K):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_ak
    k_left = K % BLOCK_K
    if k_left != 0:
        a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=rk[None, :] < k_left, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)

    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    in_bounds = (rows[:, None] < M) & (cols[None, :] < M)
    # Tiles wholly below the diagonal need no triangle mask (keeps their stores vectorised).
    if row0 >= col0 + BLOCK_N - 1:
        keep = in_bounds
        keep_mirror = in_bounds
    else:
        keep = in_bounds & (rows[:, None] >= cols[None, :])
        keep_mirror = in_bounds & (rows[:, None] > cols[None, :])
    if ADD_BA:
        a_tile = tl.load(a_base + rows[:, None] * stride_am + cols[None, :] * stride_ak, mask=keep,
                         other=0.0)
        acc = c_coef * acc + b_coef * a_tile.to(tl.float32)
    out = acc.to(out_ptr.dtype.element_ty)
    o_base = out_ptr + batch * stride_ob
    tl.store(o_base + rows[:, None] * stride_om + cols[None, :] * stride_on, out, mask=keep)
    tl.store(o_base + cols[:, None] * stride_om + rows[None, :] * stride_on, tl.trans(out),
             mask=tl.trans(keep_mirror))


# Interpreter tiles (CPU tests): small, with BM != BN so straddling tiles and the K tail are
# exercised.
_SYM_INTERPRETER_TILES = (16, 32, 16)


def _launch_sym_aat(A: Tensor, b: float, c: float, add_ba: bool,
                    tiles: tuple[int, int, int] | None) -> Tensor:
    """Shared launcher of sections 1 and 2: A (M, K) or (B, M, K), any strides -> new contiguous
    (..., M, M).

    tiles=(BM, BN, BK) fixes the tiles (tests); None: _sym_tiles on CUDA, _SYM_INTERPRETER_TILES
    elsewhere."""
    _check(A.ndim in (2, 3), f"expected A of shape (M, K) or (B, M, K), got {tuple(A.shape)}")
    _check_dtype("A", A)
    A3 = A if A.ndim == 3 else A.unsqueeze(0)
    n_batch, M, K = A3.shape
    _check(M > 0 and K > 0 and n_batch > 0, f"A has an empty dimension: {tuple(A.shape)}")
    if add_ba:
        _check(M == K, f"ba_plus_cAA needs square (..., M, M) matrices, got {tuple(A.shape)}")
    out = torch.empty((n_batch, M, M), dtype=A.dtype, device=A.device)
    args = (A3, out, M, K, *A3.stride(), *out.stride(), float(b), float(c))
    if tiles is None and A.is_cuda:
        bm, bn, bk, warps, stages = _sym_tiles(M, K, n_batch, A.device)
        launch = dict(num_warps=warps, num_stages=stages)
    else:
        (bm, bn, bk), launch = tiles or _SYM_INTERPRETER_TILES, {}
    grid = (triton.cdiv(M, bm) * triton.cdiv(M, bn), n_batch)
    wrap_triton(_sym_aat_kernel)[grid](*args, ADD_BA=add_ba, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                       **launch)
    return out if A.ndim == 3 else out.squeeze(0)


def xxt_triton(A: Tensor) -> Tensor:
    """Triton A @ A.mT for A (M, K) or (B, M, K) (bf16; float32 for tests), any strides; exactly
    symmetric."""
    return _launch_sym_aat(A, 0.0, 1.0, add_ba=False, tiles=None)


def xxt_reference(A: Tensor) -> Tensor:
    """A @ A.mT for (M, K) or (B, M, K), fp32 accumulation (float64 for float64 A), one cast to A's
    dtype."""
    Af = A.to(acc_dtype(A.dtype))
    return (Af @ Af.mT).to(A.dtype)


@triton_op(f"{_LIB}::xxt", mutates_args=())
def _xxt_op(A: Tensor) -> Tensor:
    return xxt_triton(A)


def xxt(A: Tensor) -> Tensor:
    """A @ A.mT by the Triton kernel, as the torch.library op torch.compile traces (CUDA)."""
    return torch.ops.nanogpt_kernels.xxt(A)


# ==================================================================================================
# 2. b*A + c*A@A for symmetric A  (Polar Express.2)
# ==================================================================================================
# Same kernel as section 1 with ADD_BA=True: the epilogue loads fp32(A) at the tile, forms c*acc +
# b*A in fp32 and rounds once. For symmetric A, A @ A.T == A @ A.


def ba_plus_cAA_triton(A: Tensor, b: float, c: float) -> Tensor:
    """Triton c*(A @ A.mT) + b*A for square symmetric A (..., M, M); b, c are fp32 runtime
    scalars."""
    return _launch_sym_aat(A, b, c, add_ba=True, tiles=None)


def ba_plus_cAA_reference(A: Tensor, b: float, c: float) -> Tensor:
    """c * (A @ A.mT) + b * A for square symmetric A, fp32 math (float64 for float64 A), one cast to
    A's dtype."""
    Af = A.to(acc_dtype(A.dtype))
    return (c * (Af @ Af.mT) + b * Af).to(A.dtype)


@triton_op(f"{_LIB}::ba_plus_cAA", mutates_args=())
def _ba_plus_cAA_op(A: Tensor, b: float, c: float) -> Tensor:
    return ba_plus_cAA_triton(A, b, c)


def ba_plus_cAA(A: Tensor, b: float, c: float) -> Tensor:
    """c*(A @ A.mT) + b*A by the Triton kernel, as its torch.library op (CUDA)."""
    return torch.ops.nanogpt_kernels.ba_plus_cAA(A, b, c)


# ==================================================================================================
# 3. Fused linear + relu^2 MLP  (ReLU^2 upstream record 5; fused kernel @andrewbriand, @jrauvola,
#    record 59; FP8 forward upstream record 84, PR #306)
# ==================================================================================================
# One persistent kernel computes acc = a @ b.T (a (M, K), b (N, K), both row-major) tile by tile and
# applies one of two epilogues:
#   forward  (BACKWARD=False): pre = bf16(acc) and post = bf16(relu(pre)^2), relu^2 taken from the
#                              bf16 pre;
#   backward (BACKWARD=True):  d = bf16(2 * bf16(acc) * relu(pre)), pre read back from the forward.
# The c_proj matmuls stay on cuBLAS.
# FP8 forward (training): a and b are e4m3 (quantize_mlp_input, quantize_mlp_weight) and the fp32
# accumulator is multiplied by the dequantisation factor q, read from device memory, before the
# same epilogue: pre = bf16(acc * q). e4m3 products are exact; the sum uses Hopper's fp8
# accumulator (Triton's default there). The backward stays bf16, at the FP8 forward's pre and post
# (a straight-through estimator).
# Post-only mode (record 87, PR #322): the forward stores no pre (STORE_PRE=False) and the backward
# reads post instead, rebuilding relu(pre) as sqrt(post) (SQRT_POST): d = bf16(2 * bf16(acc) *
# sqrt(post)), Triton's approximate fp32 square root. bf16(sqrt(bf16(r^2))) = r for every bf16 r
# whose square is a normal bf16, but the unrounded root is off by up to 2^-9 relative, so d is one
# bf16 ulp away from the stored-pre form in about 1/8 of the entries (notes/kernels.md#relu2-mlp).
# FP8 emission (record 89, PR #342; EMIT_FP8, training): the forward also writes post8 =
# e4m3(min(post * (1 / a), 448)) for the FP8 down projection, a its delayed activation scale read
# from memory, and each program's maximum of post (one fp32 per program, reduced in section 3b).
#
# Warp specialisation (`tl.range(warp_specialize=True)`, operands loaded by TMA descriptors) splits
# each 4-warp program on sm_90 into a producer warpgroup that issues the loads and two consumer
# warpgroups that run wgmma and the epilogue, so loads for the next tile overlap this tile's stores.
# Triton ignores the flag with 8 warps, a flattened loop, or in the interpreter. pre is read and
# the outputs written by pointer: a warp-specialised descriptor load of pre gave wrong values.
# Tiles (BM, BN, BK, GROUP_M, warps, stages), fixed: 128 x 256 is the largest tile whose fp32
# accumulator fits the two consumers' registers; a 64 K-step makes 48 KiB stages, 3 of them fit in
# shared memory. The GPU tests compare these tiles with warp_specialize=False bit for bit. The grid
# is persistent (one program per SM, tiles in grouped order: no wave tails, b's rows reused in L2).
# (measurements: notes/kernels.md#relu2-mlp)
_MLP_TILES = (128, 256, 64, 8, 4, 3)
# FP8 operands take half the bytes: a 128 K-step, 4 stages of 48 KiB, 8 warps (the record's).
_MLP_FP8_TILES = (128, 256, 128, 8, 8, 4)
# Emitting post8 and the maxima as well: 3 stages, as the record (its epilogue holds more).
_MLP_FP8_EMIT_TILES = (128, 256, 128, 8, 8, 3)
# Interpreter tiles for CPU tests: small, several tiles per persistent program.
_MLP_INTERPRETER_TILES = (16, 32, 16, 2, 4, 2)
E4M3_MAX = 448.0                       # largest finite float8_e4m3fn
E4M3_INV_MAX = 0.0022321429569274187   # fp32(1/448): the record multiplies by it to divide by 448
FP8_AMAX_FLOOR = 1e-12                 # an all-zero tensor still gets a finite scale


@triton.jit
def _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile index -> (row block, column block) in grouped order: GROUP_M row blocks sweep the
    columns together, so their a rows stay in L2."""
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (tile // tiles_per_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % tiles_per_group) % group_rows, (tile % tiles_per_group) // group_rows


@triton.jit
def _e4m3_rne(x):
    """fp32 x rounded to e4m3 (nearest even, saturating to +-448, NaN stays NaN), as fp32 (exact):
    what sm_90's cvt.rn.satfinite.e4m3x2.f32 gives, through the bits, for the interpreter and the
    fp32 outputs of tests."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag = bits & 0x7FFFFFFF
    # normal e4m3 (|x| >= 2^-6): keep 3 of fp32's 23 mantissa bits, nearest even
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # subnormal (|x| < 2^-6): multiples of 2^-9, fp32's spacing at 2^14, so 2^14 + |x| rounds to
    # them (nearest even), and the subtraction is exact
    a = mag.to(tl.float32, bitcast=True)
    r = tl.where(a < 0.015625, (a + 16384.0) - 16384.0, normal)
    r = tl.minimum(r, 448.0)
    r = (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, r)


@triton.jit
def _store_e4m3(ptrs, x, mask):
    """Store fp32 x as e4m3: into an e4m3 tensor by the hardware's saturating conversion, into an
    fp32 one (tests) as _e4m3_rne's exact values."""
    if ptrs.dtype.element_ty == tl.float8e4nv:
        tl.store(ptrs, x.to(tl.float8e4nv), mask=mask)
    else:
        tl.store(ptrs, _e4m3_rne(x).to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _relu2_linear_kernel(a_ptr, b_ptr, pre_ptr, out_ptr, scale_ptr, post8_ptr, act_scale_ptr,
                         amax_ptr, M, N, K, stride_am, stride_bn, stride_pm, stride_om,
                         BACKWARD: tl.constexpr, SCALED: tl.constexpr, STORE_PRE: tl.constexpr,
                         SQRT_POST: tl.constexpr, EMIT_FP8: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Persistent a @ b.T with the relu^2 epilogues above; K must be a multiple of BLOCK_K and the
    operands TMA-aligned (both checked by the launcher). SCALED: acc * scale_ptr[0] first (FP8).
    pre_ptr: the forward's pre (STORE_PRE), the backward's saved activation (pre, or post with
    SQRT_POST). EMIT_FP8 (forward): post8 at out's strides, amax_ptr[program] = max of post."""
    # Rows past M (the last row block) load as zeros and are not stored.
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_bn, 1],
                                       block_shape=[BLOCK_N, BLOCK_K])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    if EMIT_FP8:
        inv_act_scale = 1.0 / tl.load(act_scale_ptr)
        post_max = 0.0
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0),
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K // BLOCK_K):
            a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            b = b_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        if SCALED:
            acc = acc * tl.load(scale_ptr)

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        pre_ptrs = pre_ptr + rows.to(tl.int64)[:, None] * stride_pm + cols[None, :]
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        h = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # bf16(acc), back in fp32
                                                             # for the epilogue math
        if BACKWARD:
            saved = tl.load(pre_ptrs, mask=mask, other=0.0).to(tl.float32)
            if SQRT_POST:
                d = 2.0 * h * tl.sqrt(saved)
            else:
                d = 2.0 * h * tl.maximum(saved, 0.0)
            tl.store(out_ptrs, d.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            if STORE_PRE:
                tl.store(pre_ptrs, h.to(pre_ptr.dtype.element_ty), mask=mask)
            r = tl.maximum(h, 0.0)
            post = (r * r).to(out_ptr.dtype.element_ty)
            tl.store(out_ptrs, post, mask=mask)
            if EMIT_FP8:
                post = tl.where(mask, post.to(tl.float32), 0.0)
                post8_ptrs = post8_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
                _store_e4m3(post8_ptrs, tl.minimum(post * inv_act_scale, 448.0), mask)
                post_max = tl.maximum(post_max, tl.max(tl.max(post, axis=1), axis=0))
    if EMIT_FP8:
        tl.store(amax_ptr + tl.program_id(0), post_max)


def _descriptor_scratch(size: int, alignment: int, stream: int | None) -> Tensor:
    """Global memory for the tensor descriptors a kernel builds on the device (a few hundred bytes
    per launch; Triton asks its allocator at each launch)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _launch_relu2_linear(a: Tensor, b: Tensor, pre: Tensor | None, out: Tensor, backward: bool,
                         tiles: tuple | None, warp_specialize: bool | None = None,
                         scale: Tensor | None = None, *, sqrt_post: bool = False,
                         post8: Tensor | None = None, act_scale: Tensor | None = None,
                         amax: Tensor | None = None) -> None:
    """warp_specialize: None = on CUDA (False: the single-role pipeline, for tests and benches).
    scale: the FP8 forward's (1,) fp32 dequantisation factor (a and b e4m3). pre: None = a forward
    that stores post only; in the backward the saved activation, post with sqrt_post. post8,
    act_scale (1,) fp32 and amax (one fp32 per program): the forward's FP8 emission."""
    M, K = a.shape
    N = b.shape[0]
    fp8 = scale is not None
    emit = post8 is not None
    bm, bn, bk, group_m, warps, stages = tiles or (
        (_MLP_FP8_EMIT_TILES if emit else _MLP_FP8_TILES if fp8 else _MLP_TILES) if a.is_cuda
        else _MLP_INTERPRETER_TILES)
    _check(K % bk == 0, f"relu2_mlp needs the model dim ({K}) to be a multiple of {bk} (the "
                        "kernel's K-step)")
    # TMA reads rows that start on 16-byte boundaries. Storage starts are aligned (torch's
    # allocators), and data_ptr() does not exist while torch.compile traces with fake tensors.
    _check(all(t.storage_offset() * t.element_size() % 16 == 0
               and t.stride(0) * t.element_size() % 16 == 0 for t in (a, b)),
           "relu2_mlp reads its operands by TMA: they must start on a 16-byte boundary, their rows "
           "a multiple of 16 bytes apart (a bf16 model dim that is a multiple of 8)")
    _check(not (backward and (pre is None or emit)), "the relu2_mlp backward reads the saved pre "
                                                     "(or post) and emits no FP8 copy")
    if a.is_cuda:
        # The launch asks this context's allocator for the descriptors' scratch. Set it here, in
        # whatever thread launches (autograd runs the backward in its own); compiled graphs launch
        # through inductor, which sets its own.
        triton.set_allocator(_descriptor_scratch)
    launch = dict(num_warps=warps, num_stages=stages) if a.is_cuda else {}
    grid = (min(_num_programs_persistent(a.device), triton.cdiv(M, bm) * triton.cdiv(N, bn)),)
    if emit:
        _check(post8.shape == out.shape and post8.stride() == out.stride()
               and act_scale is not None and act_scale.numel() == 1
               and act_scale.dtype == torch.float32 and amax is not None
               and amax.shape == grid and amax.dtype == torch.float32,
               f"the FP8 emission needs post8 laid out as post, a 1-element fp32 act_scale and a "
               f"({grid[0]},) fp32 amax (one entry per program)")
    saved = out if pre is None else pre  # a dummy pointer where nothing is stored or read
    wrap_triton(_relu2_linear_kernel)[grid](
        a, b, saved, out, scale if fp8 else saved, post8 if emit else saved,
        act_scale if emit else saved, amax if emit else saved, M, N, K, a.stride(0), b.stride(0),
        saved.stride(0), out.stride(0), BACKWARD=backward, SCALED=fp8,
        STORE_PRE=pre is not None and not backward, SQRT_POST=sqrt_post, EMIT_FP8=emit,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m,
        WARP_SPECIALIZE=a.is_cuda if warp_specialize is None else warp_specialize, **launch)


def _check_mlp_operands(x: Tensor, w: Tensor, x_name: str, w_name: str) -> None:
    _check(x.ndim == 2 and w.ndim == 2 and x.shape[1] == w.shape[1],
           f"expected {x_name} (M, D) and {w_name} (H, D), got {tuple(x.shape)} and "
           f"{tuple(w.shape)}")
    _check_dtype(x_name, x)
    _check(x.dtype == w.dtype,
           f"{x_name} is {x.dtype} but {w_name} is {w.dtype}; cast both to bfloat16")
    _check(x.device == w.device, f"{x_name} is on {x.device} but {w_name} on {w.device}")
    _check(x.stride(1) == 1 and w.is_contiguous(),
           f"{x_name} needs unit stride along D and {w_name} must be contiguous; "
           "call .contiguous() first")


def relu2_mlp_fwd_triton(x: Tensor, c_fc: Tensor, tiles: tuple | None = None
                         ) -> tuple[Tensor, Tensor]:
    """x (M, D), c_fc (H, D) -> pre = bf16(x @ c_fc.T), post = bf16(relu(pre)^2), each (M, H).

    tiles=(BM, BN, BK, GROUP_M, warps, stages) fixes the tiles (tests, bench/mlp_tiles.py);
    None: _MLP_TILES on CUDA, _MLP_INTERPRETER_TILES elsewhere."""
    _check_mlp_operands(x, c_fc, "x", "c_fc")
    pre = torch.empty((x.shape[0], c_fc.shape[0]), dtype=x.dtype, device=x.device)
    post = torch.empty_like(pre)
    _launch_relu2_linear(x, c_fc, pre, post, backward=False, tiles=tiles)
    return pre, post


def relu2_mlp_fp8_fwd_triton(x8: Tensor, w8: Tensor, q: Tensor, out_dtype: torch.dtype = torch.bfloat16,
                             tiles: tuple | None = None) -> tuple[Tensor, Tensor]:
    """The FP8 forward: x8 (M, D) and w8 (H, D) e4m3 (quantize_mlp_input, quantize_mlp_weight), q
    (1,) fp32 on their device -> pre = bf16(x8 @ w8.T * q), post = bf16(relu(pre)^2), each (M, H)
    in out_dtype (bf16; float32 for interpreter tests)."""
    _check(x8.ndim == 2 and w8.ndim == 2 and x8.shape[1] == w8.shape[1],
           f"expected x8 (M, D) and w8 (H, D), got {tuple(x8.shape)} and {tuple(w8.shape)}")
    _check(x8.dtype == w8.dtype == torch.float8_e4m3fn,
           f"x8 and w8 must be float8_e4m3fn, got {x8.dtype} and {w8.dtype}")
    _check(q.shape == (1,) and q.dtype == torch.float32 and q.device == x8.device == w8.device,
           "q must be a (1,) float32 tensor on the operands' device")
    _check(x8.stride(1) == 1 and w8.is_contiguous(), "x8 needs unit stride along D and w8 must "
                                                     "be contiguous")
    pre = torch.empty((x8.shape[0], w8.shape[0]), dtype=out_dtype, device=x8.device)
    post = torch.empty_like(pre)
    _launch_relu2_linear(x8, w8, pre, post, backward=False, tiles=tiles, scale=q)
    return pre, post


def relu2_mlp_bwd_triton(g: Tensor, c_proj: Tensor, pre: Tensor, tiles: tuple | None = None
                         ) -> Tensor:
    """g (M, D), c_proj (H, D), pre (M, H) from the forward -> dpre = bf16(2 * bf16(g @ c_proj.T) *
    relu(pre))."""
    _check_mlp_operands(g, c_proj, "g", "c_proj")
    _check(pre.shape == (g.shape[0], c_proj.shape[0]) and pre.dtype == g.dtype
           and pre.stride(1) == 1,
           f"pre must be the forward's ({g.shape[0]}, {c_proj.shape[0]}) {g.dtype} output, "
           f"got {tuple(pre.shape)} {pre.dtype}")
    dpre = torch.empty_like(pre, memory_format=torch.contiguous_format)
    _launch_relu2_linear(g, c_proj, pre, dpre, backward=True, tiles=tiles)
    return dpre


@triton_op(f"{_LIB}::relu2_mlp_fwd", mutates_args=())
def _relu2_mlp_fwd_op(x: Tensor, c_fc: Tensor) -> tuple[Tensor, Tensor]:
    return relu2_mlp_fwd_triton(x, c_fc)


@triton_op(f"{_LIB}::relu2_mlp_fp8_fwd", mutates_args=())
def _relu2_mlp_fp8_fwd_op(x8: Tensor, w8: Tensor, q: Tensor, out_dtype: torch.dtype
                          ) -> tuple[Tensor, Tensor]:
    return relu2_mlp_fp8_fwd_triton(x8, w8, q, out_dtype)


@triton_op(f"{_LIB}::relu2_mlp_bwd", mutates_args=())
def _relu2_mlp_bwd_op(g: Tensor, c_proj: Tensor, pre: Tensor) -> Tensor:
    return relu2_mlp_bwd_triton(g, c_proj, pre)


class _Relu2MLPFunction(torch.autograd.Function):
    """Autograd of the fused MLP: saves x, c_fc, c_proj, pre, post; the backward kernel gives dpre
    in one pass. fp8: the forward's up projection in e4m3 (the backward is the same)."""

    @staticmethod
    def forward(ctx, x: Tensor, c_fc: Tensor, c_proj: Tensor, fp8: bool) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (M, D)
        if fp8:
            w8, s = quantize_mlp_weight(c_fc)
            x8, q = quantize_mlp_input(x2, s)
            pre, post = torch.ops.nanogpt_kernels.relu2_mlp_fp8_fwd(x8, w8, q.reshape(1), x.dtype)
        else:
            pre, post = torch.ops.nanogpt_kernels.relu2_mlp_fwd(x2, c_fc)  # (M, H) each
        out = post @ c_proj  # (M, D), cuBLAS
        ctx.save_for_backward(x2, c_fc, c_proj, pre, post)
        ctx.x_shape = x.shape
        return out.view(*x.shape[:-1], c_proj.shape[1])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x2, c_fc, c_proj, pre, post = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()  # (M, D)
        dc_proj = post.mT @ g  # (H, D)
        dpre = torch.ops.nanogpt_kernels.relu2_mlp_bwd(g, c_proj, pre)  # (M, H)
        dc_fc = dpre.mT @ x2  # (H, D)
        dx = dpre @ c_fc  # (M, D)
        return dx.view(ctx.x_shape), dc_fc, dc_proj, None


def relu2_mlp_triton(x: Tensor, c_fc: Tensor, c_proj: Tensor, fp8: bool = False) -> Tensor:
    """relu(x @ c_fc.T)^2 @ c_proj, x (..., D), differentiable, by the Triton kernels (CUDA; a CPU
    only under the interpreter); fp8: the up projection's forward in e4m3."""
    return _Relu2MLPFunction.apply(x, c_fc, c_proj, fp8)


def _to_e4m3(x: Tensor) -> Tensor:
    """Nearest e4m3 of x, saturating at +-448 (the scales keep every value within rounding of
    448, where saturating and plain casts agree; casts differ above it)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _round_to(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x rounded to dtype (nearest, ties to even), kept in x's dtype. From fp32 to bf16 it rounds
    by integer arithmetic: inside a fused kernel torch.compile drops a .to(bf16).to(fp32) round
    trip (inductor's emulate_precision_casts is off by default) but keeps integer operations, so
    compiled and eager code round alike. Finite x."""
    if not (dtype == torch.bfloat16 and x.dtype == torch.float32):
        return x.to(dtype).to(x.dtype)
    bits = x.view(torch.int32)
    return ((bits + (0x7FFF + ((bits >> 16) & 1))) & -0x10000).view(torch.float32)


def quantize_mlp_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """The FP8 copy of an up projection w (H, D): w8 = e4m3(bf16(w / s)) with the per-matrix scale
    s = bf16(max|w| * fp32(1/448)), returned as a 0-d fp32 (the record rounds twice: to bf16,
    then to e4m3). Recomputed at every forward: the weights change only at optimizer steps, so
    this equals the record's refresh after each of them (done eagerly there: _round_to keeps the
    bf16 roundings under torch.compile)."""
    acc = acc_dtype(w.dtype)
    amax = w.abs().amax().clamp_min(FP8_AMAX_FLOOR)
    s = _round_to(amax.to(acc) * E4M3_INV_MAX, w.dtype)
    return _to_e4m3(_round_to(w.to(acc) / s, w.dtype)), s


def quantize_mlp_input(x: Tensor, w_scale: Tensor) -> tuple[Tensor, Tensor]:
    """The FP8 MLP input of one micro-batch x (M, D): x8 = e4m3(x * r), r = 448 * fp32(1 / max|x|)
    (one scale per call), and the product's dequantisation factor q = (w_scale * max|x|) *
    fp32(1/448), 0-d fp32."""
    acc = acc_dtype(x.dtype)
    amax = x.abs().amax().clamp_min(FP8_AMAX_FLOOR).to(acc)
    return _to_e4m3(x.to(acc) * (E4M3_MAX * (1 / amax))), (w_scale * amax) * E4M3_INV_MAX


class _Relu2MLPFP8Reference(torch.autograd.Function):
    """The FP8 forward in plain PyTorch (e4m3 values multiplied in the accumulation dtype: every
    product exact, the sum in another order than the GPU's), and the bf16 backward of
    relu2_mlp_reference at its pre and post."""

    @staticmethod
    def forward(ctx, x: Tensor, c_fc: Tensor, c_proj: Tensor) -> Tensor:
        acc = acc_dtype(x.dtype)
        w8, s = quantize_mlp_weight(c_fc)
        x8, q = quantize_mlp_input(x, s)
        pre = ((x8.to(acc) @ w8.to(acc).mT) * q).to(x.dtype)
        post = F.relu(pre).square()
        ctx.save_for_backward(x, c_fc, c_proj, pre, post)
        return post @ c_proj

    @staticmethod
    def backward(ctx, g: Tensor):
        x, c_fc, c_proj, pre, post = ctx.saved_tensors
        acc = acc_dtype(g.dtype)
        dpre = (2 * (g @ c_proj.mT).to(acc) * F.relu(pre).to(acc)).to(g.dtype)
        return dpre @ c_fc, dpre.mT @ x, post.mT @ g


def relu2_mlp_reference(x: Tensor, c_fc: Tensor, c_proj: Tensor, fp8: bool = False) -> Tensor:
    """relu(x @ c_fc.T)^2 @ c_proj with bf16 rounding of pre and post; x (M, D), c_fc and c_proj
    (H, D); fp8: the up projection's forward in e4m3 (_Relu2MLPFP8Reference).

    Autograd gives the backward the kernels compute: the square's gradient is g_post *
    (2 * relu(pre)), one rounding."""
    if fp8:
        return _Relu2MLPFP8Reference.apply(x, c_fc, c_proj)
    pre = x @ c_fc.mT
    post = F.relu(pre).square()
    return post @ c_proj


# Post-only form (record 87): the forward keeps post alone, the backward rebuilds relu(pre) as
# sqrt(post). Its reference is beside the launchers; record 84's functions above are unchanged.

def relu2_mlp_post_fwd_triton(x: Tensor, c_fc: Tensor, tiles: tuple | None = None) -> Tensor:
    """x (M, D), c_fc (H, D) -> post = bf16(relu(bf16(x @ c_fc.T))^2) (M, H); no pre is stored."""
    _check_mlp_operands(x, c_fc, "x", "c_fc")
    post = torch.empty((x.shape[0], c_fc.shape[0]), dtype=x.dtype, device=x.device)
    _launch_relu2_linear(x, c_fc, None, post, backward=False, tiles=tiles)
    return post


def _check_fp8_up_operands(x8: Tensor, w8: Tensor, q: Tensor) -> None:
    _check(x8.ndim == 2 and w8.ndim == 2 and x8.shape[1] == w8.shape[1],
           f"expected x8 (M, D) and w8 (H, D), got {tuple(x8.shape)} and {tuple(w8.shape)}")
    _check(x8.dtype == w8.dtype == torch.float8_e4m3fn,
           f"x8 and w8 must be float8_e4m3fn, got {x8.dtype} and {w8.dtype}")
    _check(q.shape == (1,) and q.dtype == torch.float32 and q.device == x8.device == w8.device,
           "q must be a (1,) float32 tensor on the operands' device")
    _check(x8.stride(1) == 1 and w8.is_contiguous(), "x8 needs unit stride along D and w8 must "
                                                     "be contiguous")


def relu2_mlp_fp8_post_fwd_triton(x8: Tensor, w8: Tensor, q: Tensor,
                                  act_scale: Tensor | None = None,
                                  out_dtype: torch.dtype = torch.bfloat16,
                                  tiles: tuple | None = None
                                  ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The FP8 up projection storing post only: x8, w8 e4m3, q (1,) fp32 as
    relu2_mlp_fp8_fwd_triton -> (post, post8, amax). act_scale (1,) fp32, the delayed activation
    scale a: post8 = e4m3(min(post * (1 / a), 448)) (M, H) (e4m3; fp32 when out_dtype is fp32, for
    interpreter tests) and amax (P,) fp32, each program's max of post (reduce with
    fp8_scales_from_partial_amax); without it (None, None)."""
    _check_fp8_up_operands(x8, w8, q)
    post = torch.empty((x8.shape[0], w8.shape[0]), dtype=out_dtype, device=x8.device)
    if act_scale is None:
        _launch_relu2_linear(x8, w8, None, post, backward=False, tiles=tiles, scale=q)
        return post, None, None
    _check(act_scale.numel() == 1 and act_scale.dtype == torch.float32
           and act_scale.device == x8.device, "act_scale must be a 1-element float32 tensor on "
                                              "the operands' device")
    bm, bn = (tiles or (_MLP_FP8_EMIT_TILES if x8.is_cuda else _MLP_INTERPRETER_TILES))[:2]
    n_programs = min(_num_programs_persistent(x8.device),
                     triton.cdiv(post.shape[0], bm) * triton.cdiv(post.shape[1], bn))
    post8 = torch.empty_like(post, dtype=torch.float32 if out_dtype == torch.float32
                             else torch.float8_e4m3fn)
    amax = torch.empty(n_programs, dtype=torch.float32, device=x8.device)
    _launch_relu2_linear(x8, w8, None, post, backward=False, tiles=tiles, scale=q, post8=post8,
                         act_scale=act_scale.reshape(1), amax=amax)
    return post, post8, amax


def relu2_mlp_sqrt_bwd_triton(g: Tensor, c_proj: Tensor, post: Tensor,
                              tiles: tuple | None = None) -> Tensor:
    """g (M, D), c_proj (H, D), post (M, H) from the forward -> dpre = bf16(2 * bf16(g @ c_proj.T)
    * sqrt(post)), Triton's approximate square root (not correctly rounded)."""
    _check_mlp_operands(g, c_proj, "g", "c_proj")
    _check(post.shape == (g.shape[0], c_proj.shape[0]) and post.dtype == g.dtype
           and post.stride(1) == 1,
           f"post must be the forward's ({g.shape[0]}, {c_proj.shape[0]}) {g.dtype} output, "
           f"got {tuple(post.shape)} {post.dtype}")
    dpre = torch.empty_like(post, memory_format=torch.contiguous_format)
    _launch_relu2_linear(g, c_proj, post, dpre, backward=True, tiles=tiles, sqrt_post=True)
    return dpre


@triton_op(f"{_LIB}::relu2_mlp_post_fwd", mutates_args=())
def _relu2_mlp_post_fwd_op(x: Tensor, c_fc: Tensor) -> Tensor:
    return relu2_mlp_post_fwd_triton(x, c_fc)


@triton_op(f"{_LIB}::relu2_mlp_fp8_post_fwd", mutates_args=())
def _relu2_mlp_fp8_post_fwd_op(x8: Tensor, w8: Tensor, q: Tensor, out_dtype: torch.dtype
                               ) -> Tensor:
    return relu2_mlp_fp8_post_fwd_triton(x8, w8, q, None, out_dtype)[0]


@triton_op(f"{_LIB}::relu2_mlp_fp8_emit_fwd", mutates_args=())
def _relu2_mlp_fp8_emit_fwd_op(x8: Tensor, w8: Tensor, q: Tensor, act_scale: Tensor,
                               out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    return relu2_mlp_fp8_post_fwd_triton(x8, w8, q, act_scale, out_dtype)


@triton_op(f"{_LIB}::relu2_mlp_sqrt_bwd", mutates_args=())
def _relu2_mlp_sqrt_bwd_op(g: Tensor, c_proj: Tensor, post: Tensor) -> Tensor:
    return relu2_mlp_sqrt_bwd_triton(g, c_proj, post)


def _fp8_up_operands(x2: Tensor, c_fc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The FP8 up projection's operands of one call: x8, w8 and the (1,) dequantisation factor."""
    w8, s = quantize_mlp_weight(c_fc)
    x8, q = quantize_mlp_input(x2, s)
    return x8, w8, q.reshape(1)


def _relu2_mlp_post_backward(ctx, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The post-only backward by the kernels: dx, dc_fc, dc_proj from the saved x2, c_fc, c_proj,
    post (bf16 weights: straight through any FP8 forward)."""
    x2, c_fc, c_proj, post = ctx.saved_tensors
    g = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()  # (M, D)
    dc_proj = post.mT @ g  # (H, D)
    dpre = torch.ops.nanogpt_kernels.relu2_mlp_sqrt_bwd(g, c_proj, post)  # (M, H)
    return (dpre @ c_fc).view(ctx.x_shape), dpre.mT @ x2, dc_proj


class _Relu2MLPPostFunction(torch.autograd.Function):
    """Autograd of the post-only MLP (bf16 down projection): saves x, c_fc, c_proj, post."""

    @staticmethod
    def forward(ctx, x: Tensor, c_fc: Tensor, c_proj: Tensor, fp8: bool) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (M, D)
        if fp8:
            post = torch.ops.nanogpt_kernels.relu2_mlp_fp8_post_fwd(*_fp8_up_operands(x2, c_fc),
                                                                    x.dtype)
        else:
            post = torch.ops.nanogpt_kernels.relu2_mlp_post_fwd(x2, c_fc)  # (M, H)
        ctx.save_for_backward(x2, c_fc, c_proj, post)
        ctx.x_shape = x.shape
        return (post @ c_proj).view(*x.shape[:-1], c_proj.shape[1])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        return *_relu2_mlp_post_backward(ctx, grad_out), None


def relu2_mlp_post_triton(x: Tensor, c_fc: Tensor, c_proj: Tensor, fp8: bool = False) -> Tensor:
    """relu2_mlp_triton's function in the post-only form (record 87): the same forward, the
    backward through sqrt(post); fp8: the up projection's forward in e4m3."""
    return _Relu2MLPPostFunction.apply(x, c_fc, c_proj, fp8)


def relu2_up_post_reference(x: Tensor, c_fc: Tensor, fp8: bool) -> Tensor:
    """post = bf16(relu(pre)^2) of the up projection, pre = bf16(x @ c_fc.T) or the FP8 pre of
    _Relu2MLPFP8Reference; x (M, D)."""
    if fp8:
        acc = acc_dtype(x.dtype)
        w8, s = quantize_mlp_weight(c_fc)
        x8, q = quantize_mlp_input(x, s)
        pre = ((x8.to(acc) @ w8.to(acc).mT) * q).to(x.dtype)
    else:
        pre = x @ c_fc.mT
    return F.relu(pre).square()


def relu2_sqrt_post_dpre_reference(q: Tensor, post: Tensor) -> Tensor:
    """dpre = round(2q * sqrt(post)) computed in the accumulation dtype, q = round(g @ c_proj.T):
    the post-only backward's rule (a correctly rounded root: the kernel's approximate one differs
    by a few fp32 ulp, rarely one ulp after rounding)."""
    acc = acc_dtype(q.dtype)
    return (2 * q.to(acc) * post.to(acc).sqrt()).to(q.dtype)


class _Relu2MLPPostReference(torch.autograd.Function):
    """The post-only MLP in plain PyTorch: relu2_up_post_reference's post, post @ c_proj, and the
    backward through relu2_sqrt_post_dpre_reference."""

    @staticmethod
    def forward(ctx, x: Tensor, c_fc: Tensor, c_proj: Tensor, fp8: bool) -> Tensor:
        post = relu2_up_post_reference(x, c_fc, fp8)
        ctx.save_for_backward(x, c_fc, c_proj, post)
        return post @ c_proj

    @staticmethod
    def backward(ctx, g: Tensor):
        x, c_fc, c_proj, post = ctx.saved_tensors
        dpre = relu2_sqrt_post_dpre_reference(g @ c_proj.mT, post)
        return dpre @ c_fc, dpre.mT @ x, post.mT @ g, None


def relu2_mlp_post_reference(x: Tensor, c_fc: Tensor, c_proj: Tensor, fp8: bool = False
                             ) -> Tensor:
    """relu2_mlp_post_triton's contract in plain PyTorch; x (M, D), c_fc and c_proj (H, D)."""
    return _Relu2MLPPostReference.apply(x, c_fc, c_proj, fp8)


# ==================================================================================================
# 3b. FP8 down projection with delayed scaling  (record 89, PR #342)
# ==================================================================================================
# Training forwards compute the down projection as bf16(a * c * sum_k post8[t, k] * W2_8[k, n]):
#   post8 = e4m3(min(post * (1 / a), 448)), emitted by the relu^2 kernel (section 3), a the layer's
#           activation scale: 1.80 x the max of post in the previous training forward of the same
#           batch slice, / 448 (values above 1.8x that max saturate at 448);
#   W2_8  = e4m3(clamp(W2 / c, +-448)), stored transposed (slots, D, H), refreshed after every
#           optimizer step: c is 1.12 x the max |W2| of the previous refresh / 448, except in the
#           bootstrap (init, warmup, the reset, and after steps 0-15), where it is the current
#           bf16(bf16(max |W2|) / 448).
# One activation chain per batch slice (not per rank, as the record has it), so the math does not
# depend on the world size. Backward and eval: bf16, as in section 3's post-only form.
# Two Triton kernels: the scale reduction (per row of partial maxima, fp32(max(m, 1e-12) * h/448))
# and the weight quantise + transpose in 64 x 64 tiles with each tile's max |W2|.
FP8_DOWN_ACT_FACTOR = 0.004017857369035482      # fp32(1.80 / 448): activation headroom 1.80
FP8_DOWN_WEIGHT_FACTOR = 0.0024999999441206455  # fp32(1.12 / 448): weight headroom 1.12
FP8_DOWN_BOOTSTRAP_STEPS = 16     # optimizer steps 0..15 are followed by a bootstrap refresh
_FP8_REDUCE_BLOCK = 256           # partial maxima per loop step of the reduction (one program/row)
_FP8_QUANT_TILE = 64              # the weight quantiser's square tile (576 per 3072 x 768 slot)
_FP8_QUANT_WARPS = 4


@triton.jit
def _fp8_scale_reduce_kernel(partial_ptr, out_ptr, n_cols, stride_row, factor,
                             BLOCK: tl.constexpr):
    """out[row] = fp32(max(max_j partial[row, j], 1e-12) * factor); one program per row."""
    row_ptr = partial_ptr + tl.program_id(0).to(tl.int64) * stride_row
    m = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = tl.maximum(m, tl.load(row_ptr + cols, mask=cols < n_cols, other=0.0))
    amax = tl.maximum(tl.max(m, axis=0), 1e-12)
    tl.store(out_ptr + tl.program_id(0), amax * tl.cast(factor, tl.float32))


def fp8_scales_from_partial_amax_triton(partial: Tensor, factor: float) -> Tensor:
    """partial (L, P) fp32 maxima (of |W2| tiles or of post per program), factor = fp32(h / 448)
    -> (L,) fp32 scales fp32(max(max_j partial[l, j], 1e-12) * factor). A max: exact, any order."""
    _check(partial.ndim == 2 and partial.dtype == torch.float32 and partial.stride(1) == 1,
           f"partial must be (rows, maxima) float32 with unit column stride, got "
           f"{tuple(partial.shape)} {partial.dtype}")
    out = torch.empty(partial.shape[0], dtype=torch.float32, device=partial.device)
    launch = dict(num_warps=4) if partial.is_cuda else {}
    wrap_triton(_fp8_scale_reduce_kernel)[(partial.shape[0],)](
        partial, out, partial.shape[1], partial.stride(0), factor, BLOCK=_FP8_REDUCE_BLOCK,
        **launch)
    return out


def fp8_scales_from_partial_amax_reference(partial: Tensor, factor: float) -> Tensor:
    """fp8_scales_from_partial_amax_triton's contract in plain PyTorch."""
    f = torch.tensor(factor, dtype=torch.float32, device=partial.device)
    return partial.amax(dim=1).clamp_min(FP8_AMAX_FLOOR) * f


@triton.jit
def _down_weight_quant_kernel(w_ptr, scale_ptr, out_ptr, amax_ptr, H, D, stride_ws, stride_wh,
                              stride_os, stride_od, BLOCK: tl.constexpr):
    """One BLOCK x BLOCK tile of slot program_id(1): out[s, d, h] = e4m3(clamp(w[s, h, d] / c[s],
    +-448)) (transposed), amax[s, tile] = max |w| over the tile."""
    tile = tl.program_id(0)
    slot = tl.program_id(1).to(tl.int64)
    n_tiles_d = tl.cdiv(D, BLOCK)
    h = (tile // n_tiles_d) * BLOCK + tl.arange(0, BLOCK)
    d = (tile % n_tiles_d) * BLOCK + tl.arange(0, BLOCK)
    mask = (h[:, None] < H) & (d[None, :] < D)
    w = _load_as_fp32(w_ptr + slot * stride_ws + h.to(tl.int64)[:, None] * stride_wh + d[None, :],
                      mask)
    q = tl.minimum(tl.maximum(w / tl.load(scale_ptr + slot), -448.0), 448.0)
    out_ptrs = out_ptr + slot * stride_os + d.to(tl.int64)[:, None] * stride_od + h[None, :]
    _store_e4m3(out_ptrs, tl.trans(q), tl.trans(mask))
    tl.store(amax_ptr + slot * tl.num_programs(0) + tile,
             tl.max(tl.max(tl.abs(w), axis=1), axis=0))


def quantize_down_weight_t_triton(w2: Tensor, scales: Tensor, out_dtype: torch.dtype =
                                  torch.float8_e4m3fn) -> tuple[Tensor, Tensor]:
    """w2 (S, H, D) bf16 down projections (stored as used, post @ w2[s]), scales (S,) fp32 ->
    (w8t, tile_amax): w8t (S, D, H) = e4m3(clamp(w2 / scales, +-448)) transposed (out_dtype e4m3;
    fp32 for interpreter tests), each slot a column-major (H, D) operand for torch._scaled_mm;
    tile_amax (S, n_tiles) fp32, the max |w2| of each 64 x 64 tile (fp8_scales_from_partial_amax)."""
    _check(w2.ndim == 3 and w2.stride(2) == 1, f"w2 must be (slots, H, D) with unit stride along D, "
                                               f"got {tuple(w2.shape)}")
    _check_dtype("w2", w2)
    _check(scales.shape == (w2.shape[0],) and scales.dtype == torch.float32
           and scales.device == w2.device, f"scales must be ({w2.shape[0]},) float32 on "
                                           f"{w2.device}")
    S, H, D = w2.shape
    n_tiles = triton.cdiv(H, _FP8_QUANT_TILE) * triton.cdiv(D, _FP8_QUANT_TILE)
    w8t = torch.empty(S, D, H, dtype=out_dtype, device=w2.device)
    tile_amax = torch.empty(S, n_tiles, dtype=torch.float32, device=w2.device)
    launch = dict(num_warps=_FP8_QUANT_WARPS) if w2.is_cuda else {}
    wrap_triton(_down_weight_quant_kernel)[(n_tiles, S)](
        w2, scales, w8t, tile_amax, H, D, w2.stride(0), w2.stride(1), w8t.stride(0),
        w8t.stride(1), BLOCK=_FP8_QUANT_TILE, **launch)
    return w8t, tile_amax


def quantize_down_weight_t_reference(w2: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """quantize_down_weight_t_triton's contract in plain PyTorch; its amax has one column (a
    whole slot), which reduces to the same scale."""
    q = (w2.float() / scales[:, None, None]).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn).mT.contiguous(), w2.float().abs().amax(dim=(1, 2))[:, None]


def fp8_bootstrap_weight_scales(w2: Tensor) -> Tensor:
    """The bootstrap weight scales of w2 (S, H, D): fp32(bf16(bf16(max(max|w2[s]|, 1e-12)) / 448))
    (the record's eager bf16 arithmetic, here by integer rounding so it survives torch.compile;
    the quotient can sit up to 2^-8 below max/448, and then the largest entries clip to 448)."""
    amax = w2.abs().amax(dim=(1, 2)).float().clamp_min(FP8_AMAX_FLOOR)
    return _round_to(_round_to(amax, torch.bfloat16) / E4M3_MAX, torch.bfloat16)


def fp8_down_bootstraps(step: int | None) -> bool:
    """Whether the weight refresh after optimizer step `step` bootstraps (None: at init, in
    warmup and after the reset, which always do)."""
    return step is None or step < FP8_DOWN_BOOTSTRAP_STEPS


def fp8_down_weight_refresh(w2: Tensor, next_scales: Tensor, bootstrap: bool, fused: bool
                            ) -> tuple[Tensor, Tensor, Tensor]:
    """One refresh of the FP8 down weights: w2 (S, H, D), next_scales (S,) the scales the previous
    refresh set aside -> (w8t (S, D, H) e4m3, used (S,), next (S,)): bootstrap replaces
    next_scales by fp8_bootstrap_weight_scales(w2); w8t = w2 quantised by them, which become the
    used scales; next = 1.12 x this w2's max / 448, for the next refresh. fused: the Triton
    quantiser and reduction (CUDA), else the references."""
    used = fp8_bootstrap_weight_scales(w2) if bootstrap else next_scales.clone()
    if fused:
        w8t, tile_amax = quantize_down_weight_t_triton(w2, used)
        return w8t, used, fp8_scales_from_partial_amax_triton(tile_amax, FP8_DOWN_WEIGHT_FACTOR)
    w8t, amax = quantize_down_weight_t_reference(w2, used)
    return w8t, used, fp8_scales_from_partial_amax_reference(amax, FP8_DOWN_WEIGHT_FACTOR)


def quantize_post_reference(post: Tensor, act_scale: Tensor) -> Tensor:
    """post8 = e4m3(min(fp32(post) * fp32(1 / a), 448)) of post >= 0 (M, H), act_scale a
    1-element fp32: the relu^2 kernel's FP8 emission (its 1 / a is Triton's division, within
    2 ulp; correctly rounded here)."""
    inv = 1 / act_scale.reshape(())
    return (post.float() * inv).clamp_max(E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_clipped_count(x: Tensor, scale: Tensor) -> Tensor:
    """How many entries of x the FP8 quantisation by `scale` clips (|x / scale| > 448): the record
    saturates silently; this is for logs and tests."""
    return ((x.float() / scale.reshape(-1, *[1] * (x.ndim - 1))).abs() > E4M3_MAX).sum()


def fp8_down_matmul_reference(post8: Tensor, w8t: Tensor, act_scale: Tensor, weight_scale: Tensor,
                              out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """post8 (M, H) and w8t (D, H) e4m3 (or their fp32 values), 1-element fp32 scales ->
    round(sum_k post8[m, k] * w8t[n, k] * fp32(a * c)) (M, D): exact e4m3 products, an fp32 sum
    (in another order than the GPU's fast accumulation), the scales' product as _scaled_mm's
    epilogue forms it."""
    scale = act_scale.reshape(()) * weight_scale.reshape(())
    return ((post8.float() @ w8t.float().mT) * scale).to(out_dtype)


def fp8_down_matmul(post8: Tensor, w8t: Tensor, act_scale: Tensor, weight_scale: Tensor,
                    out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """The down projection's FP8 product: on CUDA torch._scaled_mm (post8 row-major, w8t's slot
    read as the column-major (H, D) operand, tensor-wise scales, fast accumulation, bf16 out); off
    CUDA fp8_down_matmul_reference (no FP8 GEMM there)."""
    if not post8.is_cuda:
        return fp8_down_matmul_reference(post8, w8t, act_scale, weight_scale, out_dtype)
    # cuBLAS reads each scale from a 16-byte aligned address (pytorch#159957), which the state's
    # one-element slices are not: the product is a fresh tensor, and the epilogue forms the same
    # fp32(acc * fp32(a * c)) from it and 1.
    scale = act_scale.reshape(()) * weight_scale.reshape(())
    return torch._scaled_mm(post8, w8t.mT, scale_a=scale, scale_b=torch.ones_like(scale),
                            out_dtype=out_dtype, use_fast_accum=True)


class _Relu2MLPFP8DownFunction(torch.autograd.Function):
    """Autograd of the record-89 training MLP by the kernels: FP8 up projection, post-only relu^2
    kernel emitting post8 and its maxima, FP8 down product; the bf16 post-only backward."""

    @staticmethod
    def forward(ctx, x: Tensor, c_fc: Tensor, c_proj: Tensor, act_scale: Tensor,
                weight_scale: Tensor, w8t: Tensor) -> tuple[Tensor, Tensor]:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (M, D)
        post, post8, amax = torch.ops.nanogpt_kernels.relu2_mlp_fp8_emit_fwd(
            *_fp8_up_operands(x2, c_fc), act_scale, x.dtype)
        out = fp8_down_matmul(post8, w8t, act_scale, weight_scale, x.dtype)  # (M, D)
        ctx.save_for_backward(x2, c_fc, c_proj, post)
        ctx.x_shape = x.shape
        ctx.mark_non_differentiable(amax)
        return out.view(*x.shape[:-1], c_proj.shape[1]), amax

    @staticmethod
    def backward(ctx, grad_out: Tensor, grad_amax: Tensor | None):
        return *_relu2_mlp_post_backward(ctx, grad_out), None, None, None


def relu2_mlp_fp8_down_triton(x: Tensor, c_fc: Tensor, c_proj: Tensor, act_scale: Tensor,
                              weight_scale: Tensor, w8t: Tensor) -> tuple[Tensor, Tensor]:
    """The training MLP of record 89 by the kernels: x (..., D), c_fc and c_proj (H, D) bf16,
    act_scale and weight_scale 1-element fp32 (this slice's a and this layer's c), w8t (D, H) e4m3
    (this layer's slot of Fp8DownState.weights8) -> (out (..., D), amax (P,) fp32 per-program
    maxima of post, for Fp8DownState.update_act_scales). Differentiable in x, c_fc, c_proj."""
    return _Relu2MLPFP8DownFunction.apply(x, c_fc, c_proj, act_scale, weight_scale, w8t)


class _Relu2MLPFP8DownReference(torch.autograd.Function):
    """relu2_mlp_fp8_down_triton's contract in plain PyTorch (the amax has one entry)."""

    @staticmethod
    def forward(ctx, x: Tensor, c_fc: Tensor, c_proj: Tensor, act_scale: Tensor,
                weight_scale: Tensor, w8t: Tensor) -> tuple[Tensor, Tensor]:
        post = relu2_up_post_reference(x, c_fc, fp8=True)
        post8 = quantize_post_reference(post, act_scale)
        out = fp8_down_matmul_reference(post8, w8t, act_scale, weight_scale, x.dtype)
        ctx.save_for_backward(x, c_fc, c_proj, post)
        amax = post.float().amax().reshape(1)
        ctx.mark_non_differentiable(amax)
        return out, amax

    @staticmethod
    def backward(ctx, g: Tensor, grad_amax: Tensor | None):
        x, c_fc, c_proj, post = ctx.saved_tensors
        dpre = relu2_sqrt_post_dpre_reference(g @ c_proj.mT, post)
        return dpre @ c_fc, dpre.mT @ x, post.mT @ g, None, None, None


def relu2_mlp_fp8_down_reference(x: Tensor, c_fc: Tensor, c_proj: Tensor, act_scale: Tensor,
                                 weight_scale: Tensor, w8t: Tensor) -> tuple[Tensor, Tensor]:
    """relu2_mlp_fp8_down_triton's contract in plain PyTorch; x (M, D)."""
    return _Relu2MLPFP8DownReference.apply(x, c_fc, c_proj, act_scale, weight_scale, w8t)


def owned_slices(rank: int, world_size: int, n_slices: int) -> list[int]:
    """The batch slices rank `rank` runs, in micro-step order: b = m * world_size + rank."""
    return list(range(rank, n_slices, world_size))


class Fp8DownState(torch.nn.Module):
    """The FP8 down projection's delayed-scaling state (persistent fp32 buffers, 1.0 at init):
    act_scales (n_slices, n_layers), one chain per batch slice, advanced only by that slice's
    training forwards; weight_scales (n_slots,), the c the forwards use; next_weight_scales
    (n_slots,), the c set aside for the next refresh. weights8 (n_slots, D, H) e4m3 is derived
    (not saved): refresh_weights builds it, rebuild_weights8 rebuilds it after a load.
    At W > 1 each rank advances only its owned_slices' rows, so each rank's state file holds its own
    rows current (a resume runs at the writers' process count; the trainer refuses others)."""

    def __init__(self, n_slices: int, n_layers: int, n_slots: int,
                 device: torch.device | str | None = None):
        super().__init__()
        ones = dict(dtype=torch.float32, device=device)
        self.register_buffer("act_scales", torch.ones(n_slices, n_layers, **ones))
        self.register_buffer("weight_scales", torch.ones(n_slots, **ones))
        self.register_buffer("next_weight_scales", torch.ones(n_slots, **ones))
        self.register_buffer("weights8", None, persistent=False)

    @torch.no_grad()
    def reset(self) -> None:
        """The warmup reset: every scale back to 1.0 (follow it by a bootstrap refresh)."""
        for t in (self.act_scales, self.weight_scales, self.next_weight_scales):
            t.fill_(1.0)

    @torch.no_grad()
    def refresh_weights(self, w2: Tensor, bootstrap: bool, fused: bool = False) -> None:
        """After every optimizer step (bootstrap = fp8_down_bootstraps(step)), at init and after
        the reset (bootstrap): fp8_down_weight_refresh of w2 (n_slots, H, D)."""
        _check(w2.ndim == 3 and w2.shape[0] == self.weight_scales.shape[0],
               f"w2 must be ({self.weight_scales.shape[0]}, H, D), got {tuple(w2.shape)}")
        w8t, used, nxt = fp8_down_weight_refresh(w2, self.next_weight_scales, bootstrap, fused)
        self.weight_scales.copy_(used)
        self.next_weight_scales.copy_(nxt)
        self._store_weights8(w8t)

    @torch.no_grad()
    def rebuild_weights8(self, w2: Tensor, fused: bool = False) -> None:
        """weights8 from w2 and the current weight_scales, no scale changed (after a load)."""
        quantize = quantize_down_weight_t_triton if fused else quantize_down_weight_t_reference
        self._store_weights8(quantize(w2, self.weight_scales)[0])

    def _store_weights8(self, w8t: Tensor) -> None:
        # in place once allocated: a compiled forward keeps reading the same tensor
        w = self.weights8
        if w is not None and w.shape == w8t.shape and w.dtype == w8t.dtype and w.device == w8t.device:
            w.copy_(w8t)
        else:
            self.weights8 = w8t

    def down_operands(self, slice_index: int, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        """(act_scale (1,), weight_scale (1,), w8t (D, H)) of one layer's forward on one slice."""
        _check(self.weights8 is not None, "Fp8DownState has no FP8 weights yet: call "
                                          "refresh_weights (or rebuild_weights8 after a load)")
        return (self.act_scales[slice_index, layer:layer + 1],
                self.weight_scales[layer:layer + 1], self.weights8[layer])

    @torch.no_grad()
    def update_act_scales(self, slice_index: int, partial_amax: Tensor,
                          fused: bool = False) -> None:
        """After the last layer's MLP of a training forward on slice slice_index: partial_amax
        (n_layers, P) fp32, each layer's maxima of post -> that slice's row of act_scales."""
        _check(partial_amax.ndim == 2 and partial_amax.shape[0] == self.act_scales.shape[1],
               f"partial_amax must be ({self.act_scales.shape[1]}, P), got "
               f"{tuple(partial_amax.shape)}")
        reduce = (fp8_scales_from_partial_amax_triton if fused
                  else fp8_scales_from_partial_amax_reference)
        self.act_scales[slice_index].copy_(reduce(partial_amax, FP8_DOWN_ACT_FACTOR))


# ==================================================================================================
# 4. Fused softcapped multi-token cross entropy  (softcap upstream records 9, 18, 54; MTP record 53;
#    fused loss @soren_dunn_ and Locus, record 60; training gradient in the forward with bf16 sigma,
#    record 79, PR #251)
# ==================================================================================================
# Two contracts share the kernels.
# Eval (record 61's, unchanged since): z = A*sigmoid((l+B)/C) in fp32, the loss only (TRAIN=False).
# Training (record 80's): sigma of u = fma(l, fp32(1/C), fp32(B/C)), rounded to bf16
# (s = bf16(sigma)) before everything else; lse over A*s; loss_r = sum_k w_k (lse - A*s_y) over the
# offsets whose target row exists (no w_k > 0 test). The logit gradient
# g = (((k*delta)*s)*(1-s)), delta = S_w*p - T_c, p = exp(A*s - lse), S_w the sum of ALL K weights
# (the record's tail rule: on the last K-1 rows of a buffer the gradient keeps the weights of
# the offsets that have no target there), k = (g_row * fp32(1/C)*A) * post in fp32, left to right.
# The FP8 head's op runs it in the forward (g_row = grad_scale, post = 1/s_g) and writes
# G8 = e5m2(g) straight from fp32 (nearest even, saturating to +-57344, NaN stays NaN) in both
# layouts its matmuls read (torch._scaled_mm wants both operands K-major: (T, V) and (V, T)), in
# tiles of 32 rows x 128 columns, so each column's 32 bytes of the transposed store leave as one
# run; the plain training backward (no FP8 head) takes g_row = the incoming gradient, post = 1, and
# writes g in the logits' dtype.
# Passes: the forward kernel streams each row once in blocks of 1024 columns (8 bf16 per thread with
# 4 warps); the gradient kernel streams the logits once more and writes every column without the
# target term -T_c (it compares no column with any target); a second small kernel then rewrites the
# n_rows * K target elements in full. The FP8 op runs all three in the forward, so its backward
# reads only G8 and the logits are not kept.
# Every score A*sigma lies in [0, A], so exp(A*sigma - A) can neither overflow nor vanish (it is at
# least e^-A): the sum needs no running maximum, and each lane keeps its own partial sum until one
# reduction after the last block, lse = A + log(sum). The record shifts by the row maximum of the
# unrounded A*sigma instead; lse is shift invariant, so that is a rounding-level difference.
# Special functions. Eval: sigma = 1/(1 + 2^t), t = l*k1 + k0 one FMA (k1 = -log2(e)/C,
# k0 = -B log2(e)/C), the reciprocal as FMAs (_rcp_fma: an integer guess and Newton steps;
# FlashAttention-4 likewise moves part of its exponentials to the FMA pipe), since the
# special-function unit, much narrower than the FMA pipe, bounds the loop. Training on CUDA:
# sigma = 0.5 + 0.5*tanh.approx(u/2), the record's own instruction (one special-function op,
# relative error about 2^-11; sigma is rounded to 8 bits right after, which hides most of it), so
# sigma is the record's bit for bit wherever u is; elsewhere (the interpreter) 1/(1 + e^-u), the
# same function. Both: e^(A s - c) = 2^(s A log2(e) - c log2(e)) one FMA into
# tl.exp2, the bare flush-to-zero ex2.approx.ftz.f32 (tl.exp would add a compare and two multiplies
# to produce subnormals, which cannot occur here: the exponent is at least -(A + log V) log2(e) >
# -50), where the record computes exp(A s - c) with fast math; 1/C and 1/s_g are correctly rounded
# fp32 where the record takes approximate reciprocals. These change fp32 roundings only
# (tests/_kernels_interp.py holds the outputs to a float64 transcription).
# The softcap constants are tl.constexpr and every loop carry starts as an explicit fp32 tensor, so
# no Python float can promote a carried value to fp64.
# (measurements: notes/kernels.md#cross-entropy)

SOFTCAP_A, SOFTCAP_B, SOFTCAP_C = 23.0, 5.0, 7.5


def _f32(x: float) -> float:
    """x rounded to the nearest fp32 (ties to even), as a Python float. The product of two fp32
    values is exact in a Python float, so _f32(a * b) is their correctly rounded fp32 product."""
    return struct.unpack("f", struct.pack("f", x))[0]


# The record's fp32 softcap constants, correctly rounded (the record's fast-math reciprocals are
# within 1 ulp): 1/C = 0x3E088889, B/C = fp32(B * (1/C)) = 0x3F2AAAAB, (1/C)*A = 0x40444445.
SOFTCAP_INV_C = _f32(1 / SOFTCAP_C)
SOFTCAP_B_DIV_C = _f32(SOFTCAP_B * SOFTCAP_INV_C)
SOFTCAP_INV_C_A = _f32(SOFTCAP_INV_C * SOFTCAP_A)
E5M2_MAX = 57344.0  # the largest finite e5m2 value: the gradient quantiser saturates there
_CE_BLOCK = 1024
_CE_WARPS = 4
# The gradient's launch (BLOCK_R rows, BLOCK_C columns, columns per program or None for the whole
# row, warps): one layout streams a row per program like the forward; both layouts take tiles of
# rows, so that each column's e5m2 values of BLOCK_R rows are one contiguous run of the transposed
# output (see the header).
_CE_GRAD_TILES = {False: (1, _CE_BLOCK, None, _CE_WARPS), True: (32, 128, 1024, 4)}
_CE_GRAD_INTERPRETER_TILES = {False: _CE_GRAD_TILES[False], True: (4, 32, 64, 1)}
_LOG2E = 1.4426950408889634  # log2(e); section 8 scales the attention logits by it too
_LOG2E_JIT = tl.constexpr(_LOG2E)  # the same, readable inside kernels
_INV_C_JIT = tl.constexpr(SOFTCAP_INV_C)
_B_DIV_C_JIT = tl.constexpr(SOFTCAP_B_DIV_C)
_INV_C_A_JIT = tl.constexpr(SOFTCAP_INV_C_A)
_E5M2_MAX_JIT = tl.constexpr(E5M2_MAX)


@triton.jit
def _rcp_fma(d):
    """1/d for d >= 1 on the FMA pipe: an integer guess (relative error at most 0.051) and three
    Newton steps r += r (1 - d r), each of which squares the error: within 0.501 ulp of 1/d up to
    2^125 and 0.6 ulp in the binade above, whose guess is subnormal (tests/_kernels_interp.py,
    tests/test_kernels_gpu.py), the same on CUDA and in the interpreter. d above 2^126 counts as
    2^126; NaN stays NaN."""
    d = tl.minimum(d, 8.507059173023462e37, propagate_nan=tl.PropagateNan.ALL)
    r = (0x7EF311C3 - d.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    for _ in tl.static_range(3):
        r = tl.fma(r, tl.fma(-d, r, 1.0), r)
    return r


@triton.jit
def _ce_sigmoid(logit, B: tl.constexpr, C: tl.constexpr):
    """Eval: sigmoid((logit + B) / C) = 1 / (1 + 2^(logit * k1 + k0)) in fp32."""
    k1: tl.constexpr = -_LOG2E_JIT / C
    k0: tl.constexpr = -_LOG2E_JIT * B / C
    return _rcp_fma(1.0 + tl.exp2(tl.fma(logit, k1, k0)))


@triton.jit
def _round_bf16(x, NATIVE: tl.constexpr):
    """fp32 x rounded to bf16 (nearest even), as fp32. NATIVE (CUDA): the hardware conversion, one
    instruction where the rounding through the bits takes about eight; off: through the bits, exact
    in the interpreter too. The two agree on every non-NaN value."""
    if NATIVE:
        return x.to(tl.bfloat16).to(tl.float32)
    else:
        return (_bf16_bits_rne(x) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _ce_sigma_bf16(logit, NATIVE: tl.constexpr):
    """Training: s = bf16(sigma(u)), u = fma(logit, 1/C, B/C): on CUDA
    sigma = 0.5 + 0.5 tanh.approx(u/2) as the record computes it, elsewhere 1/(1 + e^-u)."""
    u = tl.fma(logit, _INV_C_JIT, _B_DIV_C_JIT)
    if NATIVE:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [0.5 * u],
                                      dtype=tl.float32, is_pure=True, pack=1)
        sigma = tl.fma(t, 0.5, 0.5)
    else:
        sigma = 1.0 / (1.0 + tl.exp(-u))
    return _round_bf16(sigma, NATIVE)


@triton.jit
def _ce_score_sigma(logit, TRAIN: tl.constexpr, NATIVE: tl.constexpr, B: tl.constexpr,
                    C: tl.constexpr):
    """The sigma each contract scores with: bf16-rounded (training) or fp32 (eval)."""
    if TRAIN:
        return _ce_sigma_bf16(logit, NATIVE)
    else:
        return _ce_sigmoid(logit, B, C)


@triton.jit
def _ce_exp_score(sig, A: tl.constexpr, c_log2e):
    """e^(A sigma - c) = 2^(sigma A log2(e) - c log2(e)), given c log2(e)."""
    a_log2e: tl.constexpr = A * _LOG2E_JIT
    return tl.exp2(tl.fma(sig, a_log2e, -c_log2e))


@triton.jit
def _ce_fwd_kernel(logits_ptr, targets_ptr, weights_ptr, losses_ptr, lse_ptr, prefix_ptr,
                   prefix_w_ptr, n_rows, n_cols, stride_row, n_weights, A: tl.constexpr,
                   B: tl.constexpr, C: tl.constexpr, TRAIN: tl.constexpr, NATIVE: tl.constexpr,
                   PREFIX: tl.constexpr, BLOCK: tl.constexpr):
    """One row's lse and loss. TRAIN: record 80's (bf16 sigma, no w_k > 0 test); else record 61's
    eval loss (fp32 sigma; zero weights skipped). PREFIX: plus the prefix term (training only)."""
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    offs = tl.arange(0, BLOCK)
    a_log2e: tl.constexpr = A * _LOG2E_JIT
    lane_sum = tl.zeros([BLOCK], dtype=tl.float32)
    whole = n_cols - n_cols % BLOCK
    for start in range(0, whole, BLOCK):  # whole blocks: no masks
        logit = _load_as_fp32(row_ptr + start + offs, None)
        lane_sum += _ce_exp_score(_ce_score_sigma(logit, TRAIN, NATIVE, B, C), A, a_log2e)
    cols = whole + offs
    logit = _load_as_fp32(row_ptr + cols, cols < n_cols)
    exp_score = _ce_exp_score(_ce_score_sigma(logit, TRAIN, NATIVE, B, C), A, a_log2e)
    lane_sum += tl.where(cols < n_cols, exp_score, 0.0)
    lse = A + tl.log(tl.sum(lane_sum, axis=0))
    tl.store(lse_ptr + row, lse)
    loss = tl.zeros([], dtype=tl.float32)
    for k in range(0, n_weights):
        has_target = row + k < n_rows
        target = tl.load(targets_ptr + row + k, mask=has_target, other=-1)
        w = tl.load(weights_ptr + k)
        ok = has_target & (target >= 0) & (target < n_cols)
        if not TRAIN:
            ok = ok & (w > 0)
        logit_t = _load_as_fp32(row_ptr + target, ok)
        z_t = A * _ce_score_sigma(logit_t, TRAIN, NATIVE, B, C)
        loss += tl.where(ok, w * (lse - z_t), 0.0)
    if PREFIX:
        tau = tl.load(prefix_ptr + row)
        ok = (tau >= 0) & (tau < n_cols)
        z_p = A * _ce_score_sigma(_load_as_fp32(row_ptr + tau, ok), TRAIN, NATIVE, B, C)
        loss += tl.where(ok, tl.load(prefix_w_ptr) * (lse - z_p), 0.0)
    tl.store(losses_ptr + row, loss)


@triton.jit
def _e5m2_rne(x):
    """fp32 x rounded to e5m2 straight from fp32 (nearest even, saturating to +-57344, NaN stays
    NaN), as fp32 (exact): what sm_90's cvt.rn.satfinite.e5m2x2.f32 gives, through the bits, so
    that the interpreter (whose own e5m2 cast mis-rounds subnormals) and fp32 test outputs get it
    too."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag = bits & 0x7FFFFFFF
    # normal e5m2 (|x| >= 2^-14): keep 2 of fp32's 23 mantissa bits, nearest even
    normal = ((mag + 0xFFFFF + ((mag >> 21) & 1)) & 0x7FE00000).to(tl.float32, bitcast=True)
    # subnormal (|x| < 2^-14): multiples of 2^-16, fp32's spacing at 128, so 128 + |x| rounds to
    # them (nearest even), and the subtraction is exact
    a = mag.to(tl.float32, bitcast=True)
    r = tl.where(a < 6.103515625e-05, (a + 128.0) - 128.0, normal)
    r = tl.minimum(r, _E5M2_MAX_JIT)
    r = (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, r)


@triton.jit
def _ce_grad_out(g, out_ptr, QUANTIZE: tl.constexpr, NATIVE: tl.constexpr):
    """What the gradient kernels store, in out_ptr's dtype. QUANTIZE: e5m2(g) from fp32 (on CUDA
    into an e5m2 tensor: the saturating hardware conversion, one instruction per two values, checked
    by tests/test_kernels.py; otherwise _e5m2_rne, e.g. into fp32 for tests). Else g rounded to
    the output's dtype (bf16: nearest even)."""
    out_ty: tl.constexpr = out_ptr.dtype.element_ty
    if QUANTIZE:
        if NATIVE and out_ty == tl.float8e5:
            return g.to(tl.float8e5)
        else:
            return _e5m2_rne(g).to(out_ty)
    else:
        if out_ty == tl.bfloat16:
            return _round_bf16(g, NATIVE).to(tl.bfloat16)
        else:
            return g.to(out_ty)


@triton.jit
def _ce_row_factor(g_row, post_scale):
    """k = (g_row * fp32(1/C)*A) * post per row, in fp32, the gradient's first factors in the
    record's order."""
    return (g_row.to(tl.float32) * _INV_C_A_JIT) * tl.cast(post_scale, tl.float32)


@triton.jit
def _ce_prefix_start(prefix_ptr, prefix_w_ptr, rows, row_ok, n_cols, PREFIX: tl.constexpr):
    """(tau, S_w's first term) of rows: the prefix target (-1: none) and w_p where it exists, else
    0 (and -1, 0 without PREFIX)."""
    if PREFIX:
        tau = tl.load(prefix_ptr + rows, mask=row_ok, other=-1)
        return tau, tl.where((tau >= 0) & (tau < n_cols), tl.load(prefix_w_ptr), 0.0)
    else:
        return tl.full(rows.shape, -1, tl.int64), tl.zeros(rows.shape, dtype=tl.float32)


@triton.jit
def _ce_sum_w(weights_ptr, n_weights, first):
    """S_w: `first` (the prefix weight or 0), then every weight in k order (the tail rule: also
    where the offset has no target row)."""
    sum_w = first.to(tl.float32)
    for k in range(0, n_weights):
        sum_w += tl.load(weights_ptr + k)
    return sum_w


@triton.jit
def _ce_grad(logit, k, sum_w, t_weight, lse, A: tl.constexpr, NATIVE: tl.constexpr):
    """g = (((k delta) s) (1 - s)), delta = S_w p - T_c, p = e^(A s - lse), s = bf16(sigma), in
    fp32 left to right as the record (the FMA of delta is a contraction it allows too)."""
    s = _ce_sigma_bf16(logit, NATIVE)
    p = _ce_exp_score(s, A, lse * _LOG2E_JIT)
    delta = tl.fma(sum_w, p, -t_weight)
    return ((k * delta) * s) * (1.0 - s)


@triton.jit
def _ce_grad_kernel(grad_ptr, stride_grad, logits_ptr, weights_ptr, lse_ptr, out_ptr, out_t_ptr,
                    prefix_ptr, prefix_w_ptr, n_rows, n_cols, stride_row, n_weights,
                    cols_per_program, post_scale, A: tl.constexpr, QUANTIZE: tl.constexpr,
                    NATIVE: tl.constexpr, TRANSPOSED: tl.constexpr, PREFIX: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The training gradient of BLOCK_R rows x cols_per_program columns (a multiple of BLOCK_C),
    without the target term T_c (_ce_targets_kernel writes those elements afterwards), stored by
    _ce_grad_out. TRANSPOSED: the same values also into out_t, (n_cols, n_rows) contiguous."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    g_row = tl.load(grad_ptr + rows * stride_grad, mask=row_ok, other=0.0)
    k = _ce_row_factor(g_row, post_scale)[:, None]
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)[:, None]
    _, first_w = _ce_prefix_start(prefix_ptr, prefix_w_ptr, rows, row_ok, n_cols, PREFIX)
    sum_w = _ce_sum_w(weights_ptr, n_weights, first_w)[:, None]
    offs = tl.arange(0, BLOCK_C)
    first = tl.program_id(1) * cols_per_program
    for start in range(first, tl.minimum(first + cols_per_program, n_cols), BLOCK_C):
        cols = start + offs
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        logit = _load_as_fp32(logits_ptr + rows64[:, None] * stride_row + cols[None, :], mask)
        out = _ce_grad_out(_ce_grad(logit, k, sum_w, 0.0, lse, A, NATIVE), out_ptr, QUANTIZE,
                           NATIVE)
        tl.store(out_ptr + rows64[:, None] * n_cols + cols[None, :], out, mask=mask)
        if TRANSPOSED:
            tl.store(out_t_ptr + cols.to(tl.int64)[:, None] * n_rows + rows[None, :], tl.trans(out),
                     mask=tl.trans(mask))


@triton.jit
def _ce_targets_kernel(grad_ptr, stride_grad, logits_ptr, targets_ptr, weights_ptr, lse_ptr,
                       out_ptr, out_t_ptr, prefix_ptr, prefix_w_ptr, n_rows, n_cols, stride_row,
                       n_weights, post_scale, A: tl.constexpr, QUANTIZE: tl.constexpr,
                       NATIVE: tl.constexpr, TRANSPOSED: tl.constexpr, PREFIX: tl.constexpr):
    """One row's target columns in full: T_c = the weights of every offset whose target row exists
    and is c, then w_p where c is the prefix target. A column that is the target of several offsets
    (or also the prefix target) is written once per offset, the same value. PREFIX: the prefix
    target's column too (j = n_weights)."""
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    k = _ce_row_factor(tl.load(grad_ptr + row * stride_grad), post_scale)
    lse = tl.load(lse_ptr + row)
    tau, first_w = _ce_prefix_start(prefix_ptr, prefix_w_ptr, row, True, n_cols, PREFIX)
    sum_w = _ce_sum_w(weights_ptr, n_weights, first_w)
    n_columns = n_weights
    if PREFIX:
        n_columns += 1
    for j in range(0, n_columns):
        is_prefix = j >= n_weights
        has_target = (row + j < n_rows) & (j < n_weights)
        target = tl.where(is_prefix, tau, tl.load(targets_ptr + row + j, mask=has_target, other=-1))
        ok = (has_target | is_prefix) & (target >= 0) & (target < n_cols)
        t_weight = tl.zeros([], dtype=tl.float32)
        for i in range(0, n_weights):
            has_i = row + i < n_rows
            target_i = tl.load(targets_ptr + row + i, mask=has_i, other=-1)
            t_weight += tl.where(has_i & (target_i == target), tl.load(weights_ptr + i), 0.0)
        if PREFIX:
            t_weight += tl.where(tau == target, first_w, 0.0)
        col = tl.where(ok, target, 0).to(tl.int64)
        logit = _load_as_fp32(logits_ptr + row64 * stride_row + col, ok)
        out = _ce_grad_out(_ce_grad(logit, k, sum_w, t_weight, lse, A, NATIVE), out_ptr, QUANTIZE,
                           NATIVE)
        tl.store(out_ptr + row64 * n_cols + col, out, mask=ok)
        if TRANSPOSED:
            tl.store(out_t_ptr + col * n_rows + row64, out, mask=ok)


def _check_ce_inputs(logits: Tensor, targets: Tensor, mtp_weights: Tensor) -> None:
    _check(logits.ndim == 2,
           f"logits must be (n_rows, n_cols), got {tuple(logits.shape)}; flatten the batch first")
    _check_dtype("logits", logits)
    _check(logits.stride(1) == 1,
           "logits rows must be contiguous (stride 1 along the vocabulary); call .contiguous()")
    _check(targets.shape == (logits.shape[0],) and targets.dtype == torch.int64,
           f"targets must be int64 of shape ({logits.shape[0]},), got {targets.dtype} "
           f"{tuple(targets.shape)}")
    _check(mtp_weights.ndim == 1 and mtp_weights.dtype == torch.float32
           and mtp_weights.shape[0] >= 1,
           f"mtp_weights must be a non-empty fp32 vector, got {mtp_weights.dtype} "
           f"{tuple(mtp_weights.shape)}")
    _check(targets.is_contiguous() and mtp_weights.is_contiguous(),
           "targets and mtp_weights must be contiguous")
    _check(logits.device == targets.device == mtp_weights.device,
           "logits, targets and mtp_weights must be on the same device; "
           "move mtp_weights to the logits' device")


def _check_prefix(logits: Tensor, prefix_targets: Tensor | None,
                  prefix_weight: Tensor | None) -> bool:
    """Whether the loss has the prefix term (both given), after checking them."""
    _check((prefix_targets is None) == (prefix_weight is None),
           "give prefix_targets and prefix_weight together, or neither")
    if prefix_targets is None:
        return False
    _check(prefix_targets.shape == (logits.shape[0],) and prefix_targets.dtype == torch.int64
           and prefix_targets.is_contiguous(),
           f"prefix_targets must be contiguous int64 of shape ({logits.shape[0]},) (one per row, -1 "
           f"for none), got {prefix_targets.dtype} {tuple(prefix_targets.shape)}")
    _check(prefix_weight.shape == (1,) and prefix_weight.dtype == torch.float32,
           f"prefix_weight must be a (1,) fp32 tensor, got {prefix_weight.dtype} "
           f"{tuple(prefix_weight.shape)}")
    _check(prefix_targets.device == prefix_weight.device == logits.device,
           "prefix_targets and prefix_weight must be on the logits' device")
    return True


def _launch_ce_fwd(logits: Tensor, targets: Tensor, mtp_weights: Tensor, train: bool,
                   prefix_targets: Tensor | None = None, prefix_weight: Tensor | None = None
                   ) -> tuple[Tensor, Tensor]:
    _check_ce_inputs(logits, targets, mtp_weights)
    prefix = _check_prefix(logits, prefix_targets, prefix_weight)
    n_rows, n_cols = logits.shape
    losses = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if n_rows > 0:
        wrap_triton(_ce_fwd_kernel)[(n_rows,)](
            logits, targets, mtp_weights, losses, lse,
            prefix_targets if prefix else targets, prefix_weight if prefix else mtp_weights,
            n_rows, n_cols, logits.stride(0), mtp_weights.shape[0], A=SOFTCAP_A, B=SOFTCAP_B,
            C=SOFTCAP_C, TRAIN=train, NATIVE=logits.is_cuda, PREFIX=prefix, BLOCK=_CE_BLOCK,
            num_warps=_CE_WARPS)
    return losses, lse


def softcapped_mtp_ce_fwd_triton(logits: Tensor, targets: Tensor,
                                 mtp_weights: Tensor) -> tuple[Tensor, Tensor]:
    """Eval (record 61): logits (n, V) bf16 (fp32 for tests), targets (n,) int64, mtp_weights (K,)
    fp32 -> (losses (n,), lse (n,)) fp32."""
    return _launch_ce_fwd(logits, targets, mtp_weights, train=False)


def softcapped_mtp_ce_train_fwd_triton(logits: Tensor, targets: Tensor, mtp_weights: Tensor,
                                       prefix_targets: Tensor | None = None,
                                       prefix_weight: Tensor | None = None
                                       ) -> tuple[Tensor, Tensor]:
    """Training (record 80, bf16 sigma also for fp32 test logits): the same contract; with
    prefix_targets (n,) int64 (-1: none) and prefix_weight (1,) fp32 w_p, each row's loss also has
    [tau >= 0] w_p (lse - A s_tau) (record 88)."""
    return _launch_ce_fwd(logits, targets, mtp_weights, True, prefix_targets, prefix_weight)


def _launch_ce_grad(grad_rows: Tensor, logits: Tensor, targets: Tensor, mtp_weights: Tensor,
                    lse: Tensor, out: Tensor, out_t: Tensor | None, post_scale: float,
                    quantize: bool, tiles: tuple | None, prefix_targets: Tensor | None = None,
                    prefix_weight: Tensor | None = None) -> None:
    """Every column, then the target columns (in this order on the stream: the second kernel
    overwrites what the first wrote there). out_t: the transposed layout as well, or None."""
    _check_ce_inputs(logits, targets, mtp_weights)
    prefix = _check_prefix(logits, prefix_targets, prefix_weight)
    n_rows, n_cols = logits.shape
    _check(grad_rows.shape == (n_rows,) and lse.shape == (n_rows,) and lse.dtype == torch.float32
           and lse.is_contiguous(),
           "grad_rows and lse must be (n_rows,), lse fp32 contiguous from the forward")
    if n_rows == 0:
        return
    transposed = out_t is not None
    rows, block, span, warps = tiles or (
        _CE_GRAD_TILES if logits.is_cuda else _CE_GRAD_INTERPRETER_TILES)[transposed]
    span = triton.cdiv(span or n_cols, block) * block  # columns per program, whole blocks
    args = (grad_rows, grad_rows.stride(0), logits)
    common = (lse, out, out if out_t is None else out_t, prefix_targets if prefix else targets,
              prefix_weight if prefix else mtp_weights, n_rows, n_cols, logits.stride(0),
              mtp_weights.shape[0])
    flags = dict(A=SOFTCAP_A, QUANTIZE=quantize, NATIVE=logits.is_cuda, TRANSPOSED=transposed,
                 PREFIX=prefix)
    wrap_triton(_ce_grad_kernel)[(triton.cdiv(n_rows, rows), triton.cdiv(n_cols, span))](
        *args, mtp_weights, *common, span, post_scale, BLOCK_R=rows, BLOCK_C=block,
        num_warps=warps, **flags)
    wrap_triton(_ce_targets_kernel)[(n_rows,)](*args, targets, mtp_weights, *common, post_scale,
                                               num_warps=1, **flags)


def softcapped_mtp_ce_train_bwd_triton(grad_losses: Tensor, logits: Tensor, targets: Tensor,
                                       mtp_weights: Tensor, lse: Tensor,
                                       prefix_targets: Tensor | None = None,
                                       prefix_weight: Tensor | None = None) -> Tensor:
    """The training loss's backward without the FP8 head: grad_losses (n,) (any stride, e.g. an
    expanded 1/A), the forward's inputs and lse -> dlogits (n, V) in logits' dtype, g_row = the
    incoming gradient."""
    dlogits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    _launch_ce_grad(grad_losses, logits, targets, mtp_weights, lse, dlogits, None, 1.0, False,
                    None, prefix_targets, prefix_weight)
    return dlogits


def fp8_grad_inverse_scale(s_g: float) -> float:
    """1/s_g as the gradient factor takes it: the correctly rounded fp32 reciprocal of fp32(s_g)."""
    return _f32(1 / _f32(s_g))


def softcapped_mtp_ce_fp8_grad_triton(logits: Tensor, targets: Tensor, mtp_weights: Tensor,
                                      lse: Tensor, grad_scale: float, s_g: float,
                                      out_dtype: torch.dtype = torch.float8_e5m2,
                                      tiles: tuple | None = None,
                                      prefix_targets: Tensor | None = None,
                                      prefix_weight: Tensor | None = None
                                      ) -> tuple[Tensor, Tensor]:
    """The FP8 head's logit gradient of grad_scale * sum(losses), quantised: G8 = e5m2(g) with
    g_row = grad_scale, post = 1/s_g, in both layouts (G8 (n, V), G8^T (V, n)), each contiguous.
    out_dtype=float32 holds the same e5m2 values in fp32 (tests). tiles = (BLOCK_R, BLOCK_C,
    columns per program or None for all, warps) overrides the launch (tests, bench/ce.py)."""
    out = torch.empty(logits.shape, dtype=out_dtype, device=logits.device)
    out_t = torch.empty(logits.shape[::-1], dtype=out_dtype, device=logits.device)
    grad_rows = torch.full((1,), grad_scale, dtype=torch.float32,
                           device=logits.device).expand(logits.shape[0])
    _launch_ce_grad(grad_rows, logits, targets, mtp_weights, lse, out, out_t,
                    fp8_grad_inverse_scale(s_g), True, tiles, prefix_targets, prefix_weight)
    return out, out_t


def softcapped_mtp_ce_fp8_triton(logits: Tensor, targets: Tensor, mtp_weights: Tensor,
                                 grad_scale: float, s_g: float,
                                 prefix_targets: Tensor | None = None,
                                 prefix_weight: Tensor | None = None
                                 ) -> tuple[Tensor, Tensor, Tensor]:
    """The FP8 head's training loss, all in the forward: (losses (n,) fp32, G8 (n, V), G8^T (V, n)
    e5m2) from the bf16 logits, which are not needed afterwards (prefix: as the forward's)."""
    losses, lse = softcapped_mtp_ce_train_fwd_triton(logits, targets, mtp_weights, prefix_targets,
                                                     prefix_weight)
    g8, g8_t = softcapped_mtp_ce_fp8_grad_triton(logits, targets, mtp_weights, lse, grad_scale, s_g,
                                                 prefix_targets=prefix_targets,
                                                 prefix_weight=prefix_weight)
    return losses, g8, g8_t


@triton_op(f"{_LIB}::softcapped_mtp_ce_fwd", mutates_args=())
def _softcapped_mtp_ce_fwd_op(logits: Tensor, targets: Tensor,
                              mtp_weights: Tensor) -> tuple[Tensor, Tensor]:
    return softcapped_mtp_ce_fwd_triton(logits, targets, mtp_weights)


@triton_op(f"{_LIB}::softcapped_mtp_ce_train_fwd", mutates_args=())
def _softcapped_mtp_ce_train_fwd_op(logits: Tensor, targets: Tensor, mtp_weights: Tensor,
                                    prefix_targets: Tensor | None = None,
                                    prefix_weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return softcapped_mtp_ce_train_fwd_triton(logits, targets, mtp_weights, prefix_targets,
                                              prefix_weight)


@triton_op(f"{_LIB}::softcapped_mtp_ce_train_bwd", mutates_args=())
def _softcapped_mtp_ce_train_bwd_op(grad_losses: Tensor, logits: Tensor, targets: Tensor,
                                    mtp_weights: Tensor, lse: Tensor,
                                    prefix_targets: Tensor | None = None,
                                    prefix_weight: Tensor | None = None) -> Tensor:
    return softcapped_mtp_ce_train_bwd_triton(grad_losses, logits, targets, mtp_weights, lse,
                                              prefix_targets, prefix_weight)


@triton_op(f"{_LIB}::softcapped_mtp_ce_fp8", mutates_args=())
def _softcapped_mtp_ce_fp8_op(logits: Tensor, targets: Tensor, mtp_weights: Tensor,
                              grad_scale: float, s_g: float, prefix_targets: Tensor | None = None,
                              prefix_weight: Tensor | None = None
                              ) -> tuple[Tensor, Tensor, Tensor]:
    return softcapped_mtp_ce_fp8_triton(logits, targets, mtp_weights, grad_scale, s_g,
                                        prefix_targets, prefix_weight)


def softcapped_mtp_ce_triton(logits: Tensor, targets: Tensor, mtp_weights: Tensor) -> Tensor:
    """Eval: per-row softcapped multi-token CE of record 61 by the Triton kernel, forward only
    (CUDA; a CPU only under the interpreter)."""
    return torch.ops.nanogpt_kernels.softcapped_mtp_ce_fwd(logits, targets, mtp_weights)[0]


class _SoftcappedMTPCETrainFunction(torch.autograd.Function):
    """Autograd of the fused training loss without the FP8 head: saves lse, logits, targets and
    weights; returns dlogits in the logits' dtype."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, mtp_weights: Tensor,
                prefix_targets: Tensor | None, prefix_weight: Tensor | None) -> Tensor:
        losses, lse = torch.ops.nanogpt_kernels.softcapped_mtp_ce_train_fwd(
            logits, targets, mtp_weights, prefix_targets, prefix_weight)
        ctx.save_for_backward(logits, targets, mtp_weights, lse, prefix_targets, prefix_weight)
        return losses

    @staticmethod
    def backward(ctx, grad_losses: Tensor):
        logits, targets, mtp_weights, lse, prefix_targets, prefix_weight = ctx.saved_tensors
        dlogits = torch.ops.nanogpt_kernels.softcapped_mtp_ce_train_bwd(
            grad_losses, logits, targets, mtp_weights, lse, prefix_targets, prefix_weight)
        return dlogits, None, None, None, None


def softcapped_mtp_ce_train_triton(logits: Tensor, targets: Tensor, mtp_weights: Tensor,
                                   prefix_targets: Tensor | None = None,
                                   prefix_weight: Tensor | None = None) -> Tensor:
    """Per-row training loss (record 80; prefix: record 88's term) of logits without the FP8 head,
    differentiable, by the Triton kernels."""
    return _SoftcappedMTPCETrainFunction.apply(logits, targets, mtp_weights, prefix_targets,
                                               prefix_weight)


def softcap(logits: Tensor) -> Tensor:
    """z = A * sigmoid((logit + B) / C), in fp32 (float64 for float64 logits): the scores the eval
    loss sees."""
    return SOFTCAP_A * torch.sigmoid((logits.to(acc_dtype(logits.dtype)) + SOFTCAP_B) / SOFTCAP_C)


def softcapped_mtp_ce_reference(logits: Tensor, targets: Tensor, mtp_weights: Tensor) -> Tensor:
    """Eval (record 61): per-row loss
    sum_k [row+k < m][w_k > 0] w_k (lse_row - z[row, targets[row+k]]), z = A*sigmoid((l+B)/C).

    logits (n, V) bf16, targets (m,) int64 with m >= n (targets past row n - 1 are look-ahead: a
    block of rows also sees the targets of the rows after it), mtp_weights (K,) fp32 -> losses (n,)
    fp32 (float64 for float64 logits).
    """
    n, m = logits.shape[0], targets.shape[0]
    acc = acc_dtype(logits.dtype)
    z = softcap(logits)
    lse = torch.logsumexp(z, dim=-1)
    losses = torch.zeros(n, dtype=acc, device=logits.device)
    for k in range(mtp_weights.shape[0]):
        rows = min(n, m - k)
        if rows <= 0:
            break
        w = mtp_weights[k]
        zt = z[:rows].gather(1, targets[k:k + rows, None]).squeeze(1)
        term = torch.where(w > 0, w * (lse[:rows] - zt), torch.zeros_like(zt))
        losses = losses + F.pad(term, (0, n - rows))
    return losses


_CE_REFERENCE_BLOCK = 1 << 27   # logits per block of the chunked references: their fp32
                                # temporaries stay near 512 MiB each


def softcapped_mtp_ce_chunked(logits: Tensor, targets: Tensor, mtp_weights: Tensor,
                              rows: int | None = None) -> Tensor:
    """softcapped_mtp_ce_reference, for logits too large for its (n, V) fp32 temporaries a block of
    `rows` rows at a time (default: _CE_REFERENCE_BLOCK logits), each block recomputed in the
    backward (activation checkpointing): the reference's numbers in bounded memory."""
    from torch.utils.checkpoint import checkpoint
    rows = rows or max(1, _CE_REFERENCE_BLOCK // max(1, logits.shape[-1]))
    if logits.shape[0] <= rows:
        return softcapped_mtp_ce_reference(logits, targets, mtp_weights)
    K = mtp_weights.shape[0]
    return torch.cat([checkpoint(softcapped_mtp_ce_reference, logits[r:r + rows],
                                 targets[r:r + rows + K - 1], mtp_weights, use_reentrant=False)
                      for r in range(0, logits.shape[0], rows)])


def _softcap_constants(dtype: torch.dtype) -> tuple[float, float, float]:
    """(1/C, B/C, (1/C)*A) of the training softcap: the record's fp32 values, or the exact quotients
    in float64 (the trainer's --dtype=float64 mode, where no step rounds to fp32)."""
    if dtype == torch.float64:
        return 1 / SOFTCAP_C, SOFTCAP_B / SOFTCAP_C, SOFTCAP_A / SOFTCAP_C
    return SOFTCAP_INV_C, SOFTCAP_B_DIV_C, SOFTCAP_INV_C_A


def softcapped_mtp_ce_train_math(logits: Tensor, targets: Tensor, mtp_weights: Tensor,
                                 row_factor: Tensor | float | None = None,
                                 prefix_targets: Tensor | None = None,
                                 prefix_weight: Tensor | None = None
                                 ) -> tuple[Tensor, Tensor | None]:
    """Record 80's training loss per row and, given row_factor, its logit gradient,
    in plain PyTorch with the kernels' rounding points.

    logits (n, V), targets (m,) int64 with m >= n (look-ahead, as softcapped_mtp_ce_reference),
    mtp_weights (K,), row_factor (n, 1), 0-d or a float -> losses (n,) and
    g = (((row_factor delta) s) (1 - s)) (n, V) (None without row_factor), in fp32 (float64 for
    float64 logits). s = sigma(l (1/C) + B/C), rounded to bf16 for bf16 logits (the record's
    rounding; fp32 and float64 logits keep it); lse = logsumexp(A s);
    loss_r = sum_k w_k (lse - A s_y) over the offsets whose target row exists and lies in [0, V)
    (no w_k > 0 test); delta = S_w p - T_c with S_w the sum of all K weights (the tail rule: on a
    buffer's last K-1 rows the gradient has terms their loss lacks, as upstream's) and T_c the
    weights of the offsets whose target is c; p = e^(A s - lse). The record's row
    factor is (grad_scale (1/C) A) (1/s_g) for the FP8 head; without it, g_row (1/C) A.
    prefix_targets (n,) int64 (-1: none) and prefix_weight (1,) w_p add record 88's prefix term:
    loss_r += [tau_r in [0, V)] w_p (lse - A s_tau) after the offsets, w_p first in S_w, and w_p
    last in T_tau.
    """
    acc = acc_dtype(logits.dtype)
    inv_c, b_div_c, _ = _softcap_constants(acc)
    sigma = torch.sigmoid(logits.to(acc) * inv_c + b_div_c)
    s = sigma.bfloat16().to(acc) if logits.dtype == torch.bfloat16 else sigma
    z = SOFTCAP_A * s
    lse = torch.logsumexp(z, dim=-1)
    n, m, V = logits.shape[0], targets.shape[0], logits.shape[1]
    w = mtp_weights.to(acc)
    losses = torch.zeros(n, dtype=acc, device=logits.device)
    t_c = None if row_factor is None else torch.zeros_like(z)
    for k in range(w.shape[0]):
        rows = min(n, m - k)
        if rows <= 0:
            break
        y = targets[k:k + rows]
        valid = (y >= 0) & (y < V)
        y = y.clamp(0, V - 1)[:, None]
        z_y = z[:rows].gather(1, y).squeeze(1)
        losses = losses + F.pad(torch.where(valid, w[k] * (lse[:rows] - z_y), 0.0), (0, n - rows))
        if t_c is not None:
            t_c[:rows].scatter_add_(1, y, torch.where(valid, w[k], 0.0)[:, None])
    first_w = 0.0                                   # S_w's first term: w_p where tau exists
    if prefix_targets is not None:
        tau = prefix_targets[:n]
        has = (tau >= 0) & (tau < V)
        tau = tau.clamp(0, V - 1)[:, None]
        w_p = prefix_weight.to(acc).reshape(())
        losses = losses + torch.where(has, w_p * (lse - z.gather(1, tau).squeeze(1)), 0.0)
        first_w = torch.where(has, w_p, 0.0)[:, None]
        if t_c is not None:
            t_c.scatter_add_(1, tau, first_w)
    if row_factor is None:
        return losses, None
    sum_w = first_w + w[0]
    for k in range(1, w.shape[0]):
        sum_w = sum_w + w[k]
    delta = sum_w * torch.exp(z - lse[:, None]) - t_c
    return losses, ((row_factor * delta) * s) * (1 - s)


def _row_blocks(logits: Tensor, targets: Tensor, K: int, rows: int | None,
                prefix_targets: Tensor | None = None):
    """(first row, logits block, its targets with the K - 1 look-ahead, its prefix targets or None)
    per block of `rows` rows (None: all at once; 0: _CE_REFERENCE_BLOCK logits a block, to bound
    the fp32 temporaries)."""
    n = logits.shape[0]
    if rows == 0:
        rows = max(1, _CE_REFERENCE_BLOCK // max(1, logits.shape[-1]))
    rows = rows or max(1, n)
    for r in range(0, n, rows):
        yield (r, logits[r:r + rows], targets[r:r + rows + K - 1],
               None if prefix_targets is None else prefix_targets[r:r + rows])


class _SoftcappedMTPCETrainReference(torch.autograd.Function):
    """softcapped_mtp_ce_train_math's losses, whose backward is its gradient with
    row_factor = g_row (1/C) A (the incoming gradient passes through), in the logits' dtype."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, mtp_weights: Tensor, rows: int | None,
                prefix_targets: Tensor | None, prefix_weight: Tensor | None) -> Tensor:
        ctx.save_for_backward(logits, targets, mtp_weights, prefix_targets, prefix_weight)
        ctx.rows = rows
        K = mtp_weights.shape[0]
        blocks = _row_blocks(logits, targets, K, rows, prefix_targets)
        return torch.cat([softcapped_mtp_ce_train_math(lb, tb, mtp_weights, None, pb,
                                                       prefix_weight)[0]
                          for _, lb, tb, pb in blocks])

    @staticmethod
    def backward(ctx, grad_losses: Tensor):
        logits, targets, mtp_weights, prefix_targets, prefix_weight = ctx.saved_tensors
        acc = acc_dtype(logits.dtype)
        factor = grad_losses.to(acc)[:, None] * _softcap_constants(acc)[2]
        K = mtp_weights.shape[0]
        blocks = _row_blocks(logits, targets, K, ctx.rows, prefix_targets)
        dlogits = torch.cat([
            softcapped_mtp_ce_train_math(lb, tb, mtp_weights, factor[r:r + lb.shape[0]], pb,
                                         prefix_weight)[1]
            for r, lb, tb, pb in blocks])
        return dlogits.to(logits.dtype), None, None, None, None, None


def softcapped_mtp_ce_train_reference(logits: Tensor, targets: Tensor, mtp_weights: Tensor,
                                      rows: int | None = None,
                                      prefix_targets: Tensor | None = None,
                                      prefix_weight: Tensor | None = None) -> Tensor:
    """softcapped_mtp_ce_train_triton's contract in plain PyTorch (rows: see _row_blocks)."""
    return _SoftcappedMTPCETrainReference.apply(logits, targets, mtp_weights, rows, prefix_targets,
                                                prefix_weight)


def fp8_grad_row_factor(grad_scale: float, s_g: float) -> float:
    """The FP8 head's gradient factor (grad_scale (1/C) A) (1/s_g), rounded to fp32 after each
    product as the kernels form it. With s_g = grad_scale * s_g(W = 8) and grad_scale a power of
    two, it is the same number for every grad_scale: G8's payload does not depend on grad_accum."""
    return _f32(_f32(_f32(grad_scale) * SOFTCAP_INV_C_A) * fp8_grad_inverse_scale(s_g))


def softcapped_mtp_ce_fp8_reference(logits: Tensor, targets: Tensor, mtp_weights: Tensor,
                                    grad_scale: float, s_g: float, rows: int | None = None,
                                    prefix_targets: Tensor | None = None,
                                    prefix_weight: Tensor | None = None
                                    ) -> tuple[Tensor, Tensor, Tensor]:
    """softcapped_mtp_ce_fp8_triton's contract in plain PyTorch (rows: see _row_blocks): the
    losses, and G8 = e5m2(g) from fp32 (nearest even, clamped to +-57344 first so that overflow
    saturates; NaN stays NaN) in both layouts."""
    factor = fp8_grad_row_factor(grad_scale, s_g)
    losses, g8 = [], []
    K = mtp_weights.shape[0]
    for _, lb, tb, pb in _row_blocks(logits, targets, K, rows, prefix_targets):
        loss, g = softcapped_mtp_ce_train_math(lb, tb, mtp_weights, factor, pb, prefix_weight)
        losses.append(loss)
        g8.append(g.float().clamp(-E5M2_MAX, E5M2_MAX).to(torch.float8_e5m2))
    g8 = torch.cat(g8)
    return torch.cat(losses).float(), g8, g8.t().contiguous()


# ==================================================================================================
# 5. Fused Adam update  (train_gpt.adam_update)
# ==================================================================================================
# One pass over param, grad, exp_avg and exp_avg_sq in place of ~12 eager kernels, each a full
# read/write of the 50304x768 tables. Every eager operation is one fp32 operation here, in the eager
# order, so the result is bitwise the eager update as PyTorch runs it on CUDA:
#   m = fma(g, 1-beta1, m*beta1)     add_(g, alpha=...) is `self + alpha*other`, one FMA (nvcc
#                                    contracts it; the CPU kernel calls vec::fmadd)
#   v = fma(1-beta2, g*g, v*beta2)   CUDA's addcmul_ rounds g*g, then one FMA; the CPU kernel does
#                                    fma(value*g, g, self), an ulp of v apart on a small share of the
#                                    elements; the kernel follows CUDA
#   u = div_rn(m, sqrt_rn(v) + eps) * step_size    IEEE division and square root (tl.sqrt and `/`
#                                                  are the approximate PTX instructions)
#   u = u + (decay*p) * [u*p > 0];  param = round(p - u)
# Scalars: 1-beta1 and 1-beta2 are computed in Python double and rounded to fp32 when passed, as
# torch rounds an alpha/value Scalar; all seven are fp32 runtime arguments (no recompiles).
# enable_fp_fusion=False: no a*b+c is fused except the two explicit tl.fma (checked on the sm_90
# PTX by tests/test_optimizer_kernels.py). torch.compile drops that launch option for user-defined
# kernels (triton_kernel_wrap.py pops backend options) and passes Python floats as fp64, hence the
# casts in the kernels; a compiled caller is an fp32 rounding apart (tests/test_kernels_gpu.py
# bounds it), so train_gpt calls these ops eagerly.
# Tiles: a flat BLOCK of 1024 elements per program with 4 warps, 8 consecutive elements per thread
# (one 16-byte access per bf16 tensor, two per fp32 one): a pure stream, and a 50304x768 table's
# ~37k programs leave no tail worth a persistent loop. (measurements: notes/kernels.md#adam)

# Launch options of sections 5-7: no FMA contraction, so every fp32 operation rounds where the eager
# code rounds.
_EXACT_FP_OPTIONS = {"enable_fp_fusion": False}
_ADAM_BLOCK = 1024
_ADAM_WARPS = 4
_ADAM_INTERPRETER_BLOCK = 64  # CPU tests: several blocks and a partial last one on small tensors
_ADAM_PARAM_DTYPES = (torch.bfloat16, torch.float32)


@triton.jit
def _adam_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, n_elements, beta1, beta2,
                 one_minus_beta1, one_minus_beta2, eps, step_size, decay, BLOCK: tl.constexpr):
    """In place: exp_avg, exp_avg_sq (fp32) and param (bf16/fp32) from grad (bf16/fp32); flat
    contiguous tensors."""
    # Python floats arrive as fp32 from a launch but as fp64 from torch.compile's wrapper: round
    # them here (RNE, the same fp32 values) so the arithmetic below is fp32 either way.
    beta1, beta2 = tl.cast(beta1, tl.float32), tl.cast(beta2, tl.float32)
    one_minus_beta1, one_minus_beta2 = (tl.cast(one_minus_beta1, tl.float32),
                                        tl.cast(one_minus_beta2, tl.float32))
    eps, step_size, decay = (tl.cast(eps, tl.float32), tl.cast(step_size, tl.float32),
                             tl.cast(decay, tl.float32))
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    g = _load_as_fp32(grad_ptr + offs, mask)
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)
    m = tl.fma(g, one_minus_beta1, m * beta1)
    v = tl.fma(one_minus_beta2, g * g, v * beta2)
    tl.store(exp_avg_ptr + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
    p = _load_as_fp32(param_ptr + offs, mask)
    u = tl.div_rn(m, tl.sqrt_rn(v) + eps) * step_size
    u = u + decay * p * (u * p > 0).to(tl.float32)  # strict: a zero update is not decayed
    _store_from_fp32(param_ptr + offs, p - u, mask)


def adam_update_triton(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
                       beta1: float, beta2: float, eps: float, step_size: float, decay: float,
                       block: int | None = None) -> None:
    """Triton Adam update in place (any shape, all four contiguous and of one shape): param and grad
    bf16 or fp32, exp_avg and exp_avg_sq fp32. block fixes the elements per program (tests); None
    picks the CUDA/interpreter one."""
    # The optimizer launches this for every Adam tensor each step: one cheap test, the messages only
    # on failure.
    ok = (param.dtype in _ADAM_PARAM_DTYPES and grad.dtype in _ADAM_PARAM_DTYPES
          and exp_avg.dtype == exp_avg_sq.dtype == torch.float32
          and all(t.shape == param.shape and t.is_contiguous() and t.device == param.device
                  for t in (param, grad, exp_avg, exp_avg_sq)))
    if not ok:
        tensors = dict(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
        for name, t in tensors.items():
            _check(t.shape == param.shape,
                   f"{name} has shape {tuple(t.shape)} but param {tuple(param.shape)}")
            _check(t.is_contiguous(), f"{name} must be contiguous (the kernel walks the flat "
                                      "tensor); call .contiguous()")
            _check(t.device == param.device, f"{name} is on {t.device} but param on {param.device}")
        for name in ("param", "grad"):
            _check(tensors[name].dtype in _ADAM_PARAM_DTYPES,
                   f"{name} has dtype {tensors[name].dtype}; use bfloat16 or float32")
        for name in ("exp_avg", "exp_avg_sq"):
            _check(tensors[name].dtype == torch.float32,
                   f"{name} has dtype {tensors[name].dtype}; Adam state is float32")
    n = param.numel()
    if n == 0:
        return
    block = block or (_ADAM_BLOCK if param.is_cuda else _ADAM_INTERPRETER_BLOCK)
    wrap_triton(_adam_kernel)[(triton.cdiv(n, block),)](
        param, grad, exp_avg, exp_avg_sq, n, float(beta1), float(beta2), float(1 - beta1),
        float(1 - beta2), float(eps), float(step_size), float(decay), BLOCK=block,
        num_warps=_ADAM_WARPS, **_EXACT_FP_OPTIONS)


def adam_update_reference(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *,
                          beta1: float, beta2: float, eps: float, step_size: float,
                          decay: float) -> None:
    """The eager Adam math (the moments' dtype sets the precision): the kernel's contract."""
    g = grad.to(exp_avg.dtype)
    exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    p = param.to(exp_avg.dtype)
    u = exp_avg / (exp_avg_sq.sqrt() + eps) * step_size
    u = u + decay * p * (u * p > 0)
    param.copy_(p - u)


@triton_op(f"{_LIB}::adam_update", mutates_args={"param", "exp_avg", "exp_avg_sq"})
def _adam_update_op(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
                    beta1: float, beta2: float, eps: float, step_size: float, decay: float) -> None:
    adam_update_triton(param, grad, exp_avg, exp_avg_sq, beta1, beta2, eps, step_size, decay)


def adam_update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *,
                beta1: float, beta2: float, eps: float, step_size: float, decay: float) -> None:
    """One Adam update in place by the Triton kernel, as its torch.library op (CUDA)."""
    torch.ops.nanogpt_kernels.adam_update(param, grad, exp_avg, exp_avg_sq, beta1, beta2, eps,
                                          step_size, decay)


# ==================================================================================================
# 6. Fused NorMuon cautious update with mantissa  (train_gpt.cautious_update_with_mantissa_)
# ==================================================================================================
# The fp32 master P = (bf16 bits << 16) | mantissa is assembled, updated and split again in
# registers:
#   P' = (P - ((P * [O*P >= 0]) * wd) * lr) - O * lr      (non-strict mask: entries with O = 0 or
#                                                         P = 0 are decayed)
# then param <- high 16 bits of P' (truncation), mantissa <- low 16 bits. The eager code rounds
# after every product and difference, so the kernel does the same seven fp32 operations with FMA
# contraction disabled (as in section 5, and likewise lost under torch.compile): bitwise the eager
# update on CPU and CUDA. Loads and stores are bit moves, exact in the interpreter too.
# lr is one fp32 scalar (LR_PER_MATRIX=False) or an fp32 (n, 1, 1) tensor read once per program.
# O may have any strides: the MLP bank's O arrives as a transposed view (Polar Express works on the
# short side), so the grid is (tiles of one matrix, matrices) and Triton, seeing which axis of O
# has unit stride, loads it coalesced and converts the layout through shared memory. 32x64 tiles,
# 4 warps: 128-byte rows of param and mantissa, 64-byte runs down a column of a transposed O.
# (measurements: notes/kernels.md#cautious-update)

_CAUTIOUS_TILE = (32, 64)
_CAUTIOUS_WARPS = 4
_CAUTIOUS_INTERPRETER_TILE = (8, 16)  # CPU tests: several tiles with partial ones at the edges


@triton.jit
def _matrix_tile(R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's BLOCK_R x BLOCK_C tile of a stack of (R, C) matrices, grid (tiles per matrix,
    matrices): (matrix index (int64), rows, cols, in-bounds mask, offsets into a contiguous stack).
    Also used by section 7."""
    pid = tl.program_id(0)
    mat = tl.program_id(1).to(tl.int64)
    tiles_c = tl.cdiv(C, BLOCK_C)
    rows = (pid // tiles_c) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (pid % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    return mat, rows, cols, mask, mat * R * C + rows[:, None] * C + cols[None, :]


@triton.jit
def _cautious_mantissa_kernel(param_ptr, mantissa_ptr, o_ptr, lr_ptr, R, C, stride_on, stride_or,
                              stride_oc, lr_scalar, wd, LR_PER_MATRIX: tl.constexpr,
                              BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """In place on param (n, R, C) bf16 and mantissa (n, R, C) uint16 (both contiguous) from O
    (n, R, C) bf16 (any strides); grid (tiles per matrix, n)."""
    mat, rows, cols, mask, offs = _matrix_tile(R, C, BLOCK_R, BLOCK_C)
    o_offs = mat * stride_on + rows[:, None] * stride_or + cols[None, :] * stride_oc
    high = tl.load(param_ptr + offs, mask=mask, other=0.0).to(tl.uint16, bitcast=True).to(tl.uint32)
    low = tl.load(mantissa_ptr + offs, mask=mask, other=0).to(tl.uint32)
    P = ((high << 16) | low).to(tl.float32, bitcast=True)
    O = _load_as_fp32(o_ptr + o_offs, mask)
    if LR_PER_MATRIX:
        lr = tl.load(lr_ptr + mat)
    else:
        lr = tl.cast(lr_scalar, tl.float32)  # fp64 when launched from torch.compile (see section 5)
    wd = tl.cast(wd, tl.float32)
    keep = (O * P >= 0).to(tl.float32)
    new = (P - ((P * keep) * wd) * lr) - O * lr
    bits = new.to(tl.uint32, bitcast=True)
    tl.store(param_ptr + offs, (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    tl.store(mantissa_ptr + offs, (bits & 0xFFFF).to(tl.uint16), mask=mask)


def cautious_update_with_mantissa_triton(param: Tensor, mantissa: Tensor, O: Tensor,
                                         lr: float | Tensor, wd: float,
                                         tile: tuple[int, int] | None = None) -> None:
    """Triton cautious update in place: param (n, R, C) bf16 and mantissa (n, R, C) uint16, both
    contiguous; O (n, R, C) bf16, any strides; lr a float or an fp32 (n, 1, 1) tensor; wd a float.
    tile=(BLOCK_R, BLOCK_C) fixes the tile (tests)."""
    per_matrix = isinstance(lr, Tensor)
    ok = (param.ndim == 3 and param.dtype == torch.bfloat16 and param.is_contiguous()
          and mantissa.shape == param.shape and mantissa.dtype == torch.uint16
          and mantissa.is_contiguous()
          and O.shape == param.shape and O.dtype == torch.bfloat16
          and mantissa.device == param.device == O.device
          and (not per_matrix or (lr.shape == (param.shape[0], 1, 1) and lr.dtype == torch.float32
                                  and lr.is_contiguous() and lr.device == param.device)))
    if not ok:  # messages only on failure (launched for every NorMuon chunk each step)
        _check(param.ndim == 3 and param.dtype == torch.bfloat16 and param.is_contiguous(),
               f"param must be a contiguous bf16 (n, R, C) stack, got {param.dtype} "
               f"{tuple(param.shape)}")
        _check(mantissa.shape == param.shape and mantissa.dtype == torch.uint16
               and mantissa.is_contiguous(),
               f"mantissa must be contiguous uint16 of param's shape {tuple(param.shape)}, "
               f"got {mantissa.dtype} {tuple(mantissa.shape)}")
        _check(O.shape == param.shape and O.dtype == torch.bfloat16,
               f"O must be bf16 of param's shape {tuple(param.shape)}, got {O.dtype} "
               f"{tuple(O.shape)}")
        _check(mantissa.device == param.device == O.device,
               "param, mantissa and O must be on one device")
        _check(False, f"a per-matrix lr must be a contiguous fp32 ({param.shape[0]}, 1, 1) tensor "
                      f"on {param.device}, got {lr.dtype} {tuple(lr.shape)} on {lr.device}")
    n, R, C = param.shape
    if param.numel() == 0:
        return
    block_r, block_c = tile or (_CAUTIOUS_TILE if param.is_cuda else _CAUTIOUS_INTERPRETER_TILE)
    grid = (triton.cdiv(R, block_r) * triton.cdiv(C, block_c), n)
    wrap_triton(_cautious_mantissa_kernel)[grid](
        param, mantissa, O, lr if per_matrix else mantissa, R, C, *O.stride(),
        0.0 if per_matrix else float(lr), float(wd), LR_PER_MATRIX=per_matrix, BLOCK_R=block_r,
        BLOCK_C=block_c, num_warps=_CAUTIOUS_WARPS, **_EXACT_FP_OPTIONS)


def cautious_step(P: Tensor, O: Tensor, lr: float | Tensor, wd: float | Tensor) -> Tensor:
    """(P - ((P·mask)·wd)·lr) - O·lr with mask = [O·P >= 0]: cautious weight decay, then the step
    (NorMuon's element-wise update of a master P in its own dtype)."""
    mask = O * P >= 0
    return (P - ((P * mask) * wd) * lr) - O * lr


def cautious_update_with_mantissa_reference(param: Tensor, mantissa: Tensor, O: Tensor,
                                            lr: float | Tensor, wd: float) -> None:
    """cautious_step on the fp32 master P = (bf16 bits << 16) | mantissa, written back as its high
    and low 16 bits: the kernel's contract."""
    high = param.view(torch.int16).to(torch.int32) << 16
    low = mantissa.view(torch.int16).to(torch.int32) & 0xFFFF
    P = (high | low).view(torch.float32)
    bits = cautious_step(P, O.float(), lr, wd).view(torch.int32)
    param.view(torch.int16).copy_((bits >> 16).to(torch.int16))
    mantissa.view(torch.int16).copy_(((bits << 16) >> 16).to(torch.int16))


@triton_op(f"{_LIB}::cautious_update_with_mantissa", mutates_args={"param", "mantissa"})
def _cautious_update_with_mantissa_op(param: Tensor, mantissa: Tensor, O: Tensor,
                                      lr_per_matrix: Tensor | None, lr: float, wd: float) -> None:
    cautious_update_with_mantissa_triton(param, mantissa, O,
                                         lr if lr_per_matrix is None else lr_per_matrix, wd)


def cautious_update_with_mantissa(param: Tensor, mantissa: Tensor, O: Tensor, *, lr: float | Tensor,
                                  wd: float) -> None:
    """NorMuon's cautious update of the bf16 + mantissa master in place by the Triton kernel, as its
    torch.library op (CUDA). lr: a float or an fp32 (n, 1, 1) tensor."""
    per_matrix = lr if isinstance(lr, Tensor) else None
    torch.ops.nanogpt_kernels.cautious_update_with_mantissa(
        param, mantissa, O, per_matrix, 0.0 if per_matrix is not None else float(lr), wd)


# ==================================================================================================
# 7. NorMuon's element-wise steps: momentum, and Polar Express's split final product
#    (train_gpt.normuon_direction_, train_gpt.polar_express)
# ==================================================================================================
# Two eager chains that made several passes over a bank each, as one pass each:
#   momentum       G = fp32(grad); M.lerp_(G, 1 - mu); X = bf16(G.lerp(M, mu)): reads grad and M,
#                  writes M and X (eager: four kernels).
#   split product  Y = bf16(fp32(Y) + a * X) with Y = bf16(B @ X), in place on Y: the record's two
#                  roundings of a*X + B@X for the MLP matrices (eager: three kernels, the add
#                  reading the first iteration's transposed X element by element).
# Rounding: torch computes lerp(s, e, w) in fp32 as s + w*(e - s) for |w| < 0.5, else as
# e - (e - s)*(1 - w), and add_(X, alpha=a) as self + a*X, each one FMA (nvcc contracts it; the CPU
# kernels call fmadd). The kernels compute exactly those FMAs, contraction off otherwise, so they
# are bitwise the eager code on CUDA (tests/test_kernels_gpu.py) and an exact fp32 transcription in
# the interpreter (tests/_optimizer_kernels_interp.py). Whether a lerp weight is below 0.5 is a
# constexpr: the momentum schedule never crosses it, so a run compiles each kernel once.
# Tiles: the momentum is a flat stream like Adam's; the split product walks (R, C) tiles like the
# cautious update, since the first iteration's X is a transposed view.
# (measurements: notes/kernels.md#normuon-elementwise)

_MOMENTUM_BLOCK = 1024
_MOMENTUM_WARPS = 4
_MOMENTUM_INTERPRETER_BLOCK = 64
_SPLIT_TILE = (32, 64)
_SPLIT_WARPS = 4
_SPLIT_INTERPRETER_TILE = (8, 16)


@triton.jit
def _lerp_fp32(start, end, weight, SMALL: tl.constexpr):
    """torch.lerp(start, end, weight) as CUDA computes it in fp32: one FMA on either branch."""
    if SMALL:
        return tl.fma(weight, end - start, start)
    else:
        # e - (e - s)(1 - w) as (e - s)(w - 1) + e: w - 1 is exactly -(1 - w), and negating the
        # difference instead would not do: Triton's -x is 0 - x, which turns a -0 into +0
        return tl.fma(end - start, weight - 1.0, end)


@triton.jit
def _normuon_momentum_kernel(grad_ptr, m_ptr, x_ptr, n_elements, w_m, w_x, SMALL_M: tl.constexpr,
                             SMALL_X: tl.constexpr, BLOCK: tl.constexpr):
    """In place on m (fp32); x = lerp(g, m', w_x) in x's dtype; flat contiguous tensors."""
    w_m, w_x = tl.cast(w_m, tl.float32), tl.cast(w_x, tl.float32)  # fp64 from torch.compile
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    g = _load_as_fp32(grad_ptr + offs, mask)
    m = _lerp_fp32(tl.load(m_ptr + offs, mask=mask, other=0.0), g, w_m, SMALL_M)
    tl.store(m_ptr + offs, m, mask=mask)
    _store_from_fp32(x_ptr + offs, _lerp_fp32(g, m, w_x, SMALL_X), mask)


def normuon_momentum_triton(grad: Tensor, momentum_buffer: Tensor, momentum: float,
                            block: int | None = None) -> Tensor:
    """Triton momentum step: momentum_buffer (fp32, in place) and the returned X (grad's dtype), both
    of grad's shape and contiguous. block fixes the elements per program (tests)."""
    ok = (grad.dtype in _KERNEL_DTYPES and momentum_buffer.dtype == torch.float32
          and momentum_buffer.shape == grad.shape and grad.is_contiguous()
          and momentum_buffer.is_contiguous() and grad.device == momentum_buffer.device)
    if not ok:  # messages only on failure (launched for every NorMuon chunk each step)
        _check_dtype("grad", grad)
        _check(momentum_buffer.dtype == torch.float32,
               f"momentum_buffer has dtype {momentum_buffer.dtype}; NorMuon's momentum is float32")
        _check(momentum_buffer.shape == grad.shape,
               f"momentum_buffer has shape {tuple(momentum_buffer.shape)} but grad "
               f"{tuple(grad.shape)}")
        _check(grad.is_contiguous() and momentum_buffer.is_contiguous(),
               "grad and momentum_buffer must be contiguous (the kernel walks the flat tensors)")
        _check(False, f"grad is on {grad.device} but momentum_buffer on {momentum_buffer.device}")
    x = torch.empty_like(grad)
    n = grad.numel()
    if n == 0:
        return x
    block = block or (_MOMENTUM_BLOCK if grad.is_cuda else _MOMENTUM_INTERPRETER_BLOCK)
    w_m, w_x = 1 - momentum, momentum
    wrap_triton(_normuon_momentum_kernel)[(triton.cdiv(n, block),)](
        grad, momentum_buffer, x, n, float(w_m), float(w_x), SMALL_M=abs(w_m) < 0.5,
        SMALL_X=abs(w_x) < 0.5, BLOCK=block, num_warps=_MOMENTUM_WARPS, **_EXACT_FP_OPTIONS)
    return x


def normuon_momentum_reference(grad: Tensor, momentum_buffer: Tensor, momentum: float) -> Tensor:
    """The eager math: momentum_buffer <- lerp(M, G, 1 - mu) in place; returns lerp(G, M, mu) (the
    Nesterov-style look-ahead) in grad's dtype, G = grad in the buffer's dtype."""
    G = grad.to(momentum_buffer.dtype)
    momentum_buffer.lerp_(G, 1 - momentum)
    return G.lerp(momentum_buffer, momentum).to(grad.dtype)


@triton_op(f"{_LIB}::normuon_momentum", mutates_args={"momentum_buffer"})
def _normuon_momentum_op(grad: Tensor, momentum_buffer: Tensor, momentum: float) -> Tensor:
    return normuon_momentum_triton(grad, momentum_buffer, momentum)


def normuon_momentum(grad: Tensor, momentum_buffer: Tensor, momentum: float) -> Tensor:
    """NorMuon's momentum step by the Triton kernel, as its torch.library op (CUDA)."""
    return torch.ops.nanogpt_kernels.normuon_momentum(grad, momentum_buffer, momentum)


@triton.jit
def _split_product_kernel(y_ptr, x_ptr, R, C, stride_xn, stride_xr, stride_xc, a,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """In place on y (n, R, C) contiguous: y = fma(a, x, y) in y's dtype, x (n, R, C) any strides;
    grid (tiles per matrix, n)."""
    mat, rows, cols, mask, offs = _matrix_tile(R, C, BLOCK_R, BLOCK_C)
    x = _load_as_fp32(x_ptr + mat * stride_xn + rows[:, None] * stride_xr + cols[None, :] * stride_xc,
                      mask)
    y = _load_as_fp32(y_ptr + offs, mask)
    _store_from_fp32(y_ptr + offs, tl.fma(tl.cast(a, tl.float32), x, y), mask)


def polar_split_product_triton(y: Tensor, x: Tensor, a: float,
                               tile: tuple[int, int] | None = None) -> Tensor:
    """Triton split product in place: y (n, R, C) contiguous, x of y's shape and dtype, any strides;
    returns y. tile=(BLOCK_R, BLOCK_C) fixes the tile (tests)."""
    ok = (y.ndim == 3 and y.dtype in _KERNEL_DTYPES and y.is_contiguous() and x.shape == y.shape
          and x.dtype == y.dtype and x.device == y.device)
    if not ok:
        _check(y.ndim == 3 and y.is_contiguous(),
               f"y must be a contiguous (n, R, C) stack, got {tuple(y.shape)} "
               f"strides {y.stride()}")
        _check_dtype("y", y)
        _check(x.shape == y.shape and x.dtype == y.dtype,
               f"x must have y's shape {tuple(y.shape)} and dtype {y.dtype}, got {x.dtype} "
               f"{tuple(x.shape)}")
        _check(False, f"x is on {x.device} but y on {y.device}")
    n, R, C = y.shape
    if y.numel():
        block_r, block_c = tile or (_SPLIT_TILE if y.is_cuda else _SPLIT_INTERPRETER_TILE)
        wrap_triton(_split_product_kernel)[(triton.cdiv(R, block_r) * triton.cdiv(C, block_c), n)](
            y, x, R, C, *x.stride(), float(a), BLOCK_R=block_r, BLOCK_C=block_c,
            num_warps=_SPLIT_WARPS, **_EXACT_FP_OPTIONS)
    return y


def polar_split_product_reference(y: Tensor, x: Tensor, a: float) -> Tensor:
    """The eager math, y = round(fp32(y) + a*x) in place (float64 tensors: in float64)."""
    return y.copy_(y.to(acc_dtype(y.dtype)).add_(x, alpha=a))


@triton_op(f"{_LIB}::polar_split_product_", mutates_args={"y"})
def _polar_split_product_op(y: Tensor, x: Tensor, a: float) -> None:
    polar_split_product_triton(y, x, a)


def polar_split_product_(y: Tensor, x: Tensor, a: float) -> Tensor:
    """Polar Express's split final product y <- round(y + a*x), y = bf16(B @ X), in place by the
    Triton kernel, as its torch.library op (CUDA). Returns y."""
    torch.ops.nanogpt_kernels.polar_split_product_(y, x, a)
    return y


# ==================================================================================================
# 8. Varlen causal sliding-window attention  (train_gpt.varlen_attention, backend "triton")
# ==================================================================================================
# The contract of train_gpt section 2: q, k, v (T, H, D) hold documents packed back to back, with
# boundaries cu_seqlens; query t of document [s, e) sees keys max(s, t - window) .. t (window + 1
# keys at most, itself included); softmax(scale * q.k) in fp32; output (T, H, D) in q's dtype.
#
# Work. The grid runs over fixed query (or key) blocks of the packed sequence, not per document, so
# the launch needs no host-side document list. Each token's document bounds come from cu_seqlens
# (start[t], end[t], int32, non-decreasing in t). A query block [m0, m0 + BM) needs keys from
# max(start[m0], m0 - window) to its last row (start[] is non-decreasing, so the first row's bound
# covers every row). A key block is "full" when every (row, key) pair is allowed: key >=
# start[last row], key >= last row - window, key <= first row; full blocks skip the mask, the left
# edge and the diagonal apply it per element. A key block [n0, n0 + BN) symmetrically needs queries
# from n0 to min(end[last key], last key + window + 1).
# Forward: FlashAttention's online softmax in base 2 (scale folded with log2(e)), p rounded to v's
# dtype for p @ v, and the base-2 log-sum-exp per row saved. Backward: p recomputed from it; one
# kernel per query block computes delta = rowsum(dO * O) in fp32 (it loads dO anyway) and dQ, then
# one kernel per key block computes dK and dV reading delta. No atomics: deterministic gradients.
# Loops: the forward and dQ kernels run three loops (masked left edge, unmasked middle, masked
# diagonal); the dK/dV kernel's loops are a few blocks long, so it runs one loop that masks every
# block, since each loop fills and drains its own software pipeline. Triton waits for a dot whose
# result is not an accumulator right after issuing it, so the next block's q k^T cannot overlap this
# block's softmax; several programs per SM overlap one another instead (rejected alternatives:
# notes/kernels.md#attention).
# Rows with no allowed key yet (a block left of their document) keep max = -inf; the masked step
# substitutes 0 for it so exp2 gives 0, not NaN. Every real row sees itself, so its final sum >= 1.
# The interpreter runs the same kernels with small tiles in float32 (p and dS then stay fp32, so
# the result is exact attention up to fp32 summation order).

# Fixed tiles (BLOCK_M, BLOCK_N, num_warps, num_stages), chosen by
# notes/2026-11-25_attention_experiments_H100/attention_tiles.py; the
# same configs won at every training shape, so nothing is autotuned. Small tiles win: with windows
# and documents of a few hundred tokens a small block wastes less on masked pairs, and the short
# loops leave little to pipeline. (measurements: notes/kernels.md#attention)
_ATTN_TILES = {"fwd": (64, 32, 4, 3), "dkdv": (32, 64, 4, 3), "dq": (64, 32, 4, 3)}
_ATTN_INTERPRETER_TILES = (16, 32, 4, 1)  # CPU tests: BM != BN, several blocks per program


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


def _check_attention_inputs(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor,
                            window: int) -> None:
    _check(q.ndim == 3 and q.shape == k.shape == v.shape,
           f"expected q, k, v of one shape (T, H, D), got {tuple(q.shape)}, {tuple(k.shape)}, "
           f"{tuple(v.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_dtype(name, t)
        _check(t.dtype == q.dtype and t.device == q.device,
               f"{name} is {t.dtype} on {t.device}, q is {q.dtype} on {q.device}")
        _check(t.stride(2) == 1, f"{name} needs unit stride along D; call .contiguous() first")
    D = q.shape[2]
    _check(D >= 16 and D & (D - 1) == 0, f"head dim {D} must be a power of two >= 16")
    _check(cu_seqlens.dtype == torch.int32 and cu_seqlens.ndim == 1
           and cu_seqlens.device == q.device,
           f"cu_seqlens must be a 1-D int32 tensor on {q.device}")
    _check(window >= 0, f"window must be >= 0, got {window}")
    # block offsets (block start x row stride) are int32 in the kernels
    _check(max(t.shape[0] * t.stride(0) for t in (q, k, v)) < 2**31,
           "q, k, v span 2^31 elements or more; split the batch")


def _attn_launch_config(t: Tensor, kernel: str, tiles: tuple[int, int, int, int] | None,
                        H: int) -> tuple[tuple[int, int], dict]:
    """The grid over (blocks of T, heads) and the launch options of a kernel ("fwd", "dq" walk query
    blocks, "dkdv" key blocks) for tiles = (BLOCK_M, BLOCK_N, num_warps, num_stages): the given
    ones, the fixed GPU tiles, or the interpreter's on the CPU.
    The launches below name their kernel in wrap_triton(...) itself: torch finds a triton_op's
    kernels by that pattern in its source and keys its compile caches on their text."""
    bm, bn, warps, stages = tiles or (_ATTN_TILES[kernel] if t.is_cuda else _ATTN_INTERPRETER_TILES)
    grid = (triton.cdiv(t.shape[0], bn if kernel == "dkdv" else bm), H)
    return grid, dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)


def varlen_attention_fwd_triton(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int,
                                scale: float, tiles: tuple[int, int, int, int] | None = None
                                ) -> tuple[Tensor, Tensor]:
    """-> out (T, H, D) in q's dtype, lse (H, T) fp32 (base 2, of the logits times scale * log2 e).

    tiles=(BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the launch (tests, benchmarks)."""
    _check_attention_inputs(q, k, v, cu_seqlens, window)
    T, H, D = q.shape
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    start, _ = document_bounds(cu_seqlens, T)
    args = (q, k, v, out, lse, start, T, window, scale * _LOG2E, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1))
    grid, options = _attn_launch_config(q, "fwd", tiles, H)
    wrap_triton(_attn_fwd_kernel)[grid](*args, HEAD_DIM=D, **options)
    return out, lse


def varlen_attention_bwd_triton(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                lse: Tensor, cu_seqlens: Tensor, window: int, scale: float,
                                tiles: tuple[int, int, int, int] | None = None,
                                dq_tiles: tuple[int, int, int, int] | None = None
                                ) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv), each (T, H, D) contiguous in q's dtype, from the forward's out and
    lse. tiles overrides the dK/dV kernel's launch, and the dQ kernel's unless dq_tiles is
    given."""
    _check_attention_inputs(q, k, v, cu_seqlens, window)
    for name, t in (("grad_out", grad_out), ("out", out)):
        _check(t.shape == q.shape and t.stride(2) == 1,
               f"{name} must be {tuple(q.shape)} with unit stride along D")
    T, H, D = q.shape
    dq, dk, dv = (torch.empty((T, H, D), dtype=q.dtype, device=q.device) for _ in range(3))
    if T == 0:
        return dq, dk, dv
    start, end = document_bounds(cu_seqlens, T)
    delta = torch.empty((H, T), dtype=torch.float32, device=q.device)  # written by the dQ kernel
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               grad_out.stride(0), grad_out.stride(1))
    grid, options = _attn_launch_config(q, "dq", dq_tiles or tiles, H)
    wrap_triton(_attn_dq_kernel)[grid](
        q, k, v, grad_out, out, lse, delta, start, dq, T, window, scale * _LOG2E, scale, *strides,
        out.stride(0), out.stride(1), dq.stride(0), dq.stride(1), HEAD_DIM=D, **options)
    grid, options = _attn_launch_config(q, "dkdv", tiles, H)
    wrap_triton(_attn_dkdv_kernel)[grid](
        q, k, v, grad_out, lse, delta, end, dk, dv, T, window, scale * _LOG2E, scale, *strides,
        dk.stride(0), dk.stride(1), HEAD_DIM=D, **options)
    return dq, dk, dv


@triton_op(f"{_LIB}::varlen_attention_fwd", mutates_args=())
def _varlen_attention_fwd_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int,
                             scale: float) -> tuple[Tensor, Tensor]:
    return varlen_attention_fwd_triton(q, k, v, cu_seqlens, window, scale)


@triton_op(f"{_LIB}::varlen_attention_bwd", mutates_args=())
def _varlen_attention_bwd_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                             lse: Tensor, cu_seqlens: Tensor, window: int, scale: float
                             ) -> tuple[Tensor, Tensor, Tensor]:
    return varlen_attention_bwd_triton(grad_out, q, k, v, out, lse, cu_seqlens, window, scale)


class _VarlenAttentionFunction(torch.autograd.Function):
    """Autograd of the Triton attention: saves q, k, v, out and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int,
                scale: float) -> Tensor:
        out, lse = torch.ops.nanogpt_kernels.varlen_attention_fwd(q, k, v, cu_seqlens, window,
                                                                  scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.window, ctx.scale = window, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = torch.ops.nanogpt_kernels.varlen_attention_bwd(
            grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, ctx.window, ctx.scale)
        return dq, dk, dv, None, None, None


def varlen_attention_triton(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int,
                            scale: float) -> Tensor:
    """Differentiable Triton attention (CUDA; CPU only under the interpreter, in float32)."""
    return _VarlenAttentionFunction.apply(q, k, v, cu_seqlens, window, scale)


def varlen_attention_reference(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int,
                               scale: float) -> Tensor:
    """The contract with a dense (T, T) mask: O(T^2) memory, for CPUs and tests. Softmax in fp32
    (float64 inputs stay float64); output in q's dtype."""
    T = q.shape[0]
    start, _ = document_bounds(cu_seqlens, T)
    pos = torch.arange(T, device=q.device)
    allowed = ((pos[None, :] >= start[:, None]) & (pos[None, :] <= pos[:, None])
               & (pos[None, :] >= pos[:, None] - window))                     # (T_q, T_k)
    qh, kh, vh = (t.transpose(0, 1).to(acc_dtype(q.dtype)) for t in (q, k, v))  # (H, T, D)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=scale)
    return out.transpose(0, 1).to(q.dtype)


# ==================================================================================================
# 9. Fused q/k RMSNorm + rotary  (GPT.attention's QK-norm and half-truncated rotary)
# ==================================================================================================
# qkv (T, 3*H*hd), the qkv matmul's output, is rows of hd elements (token t, part q/k/v, head h).
# The forward kernel normalises each q and k row (fp32 statistics, eps 2^-23, no gain) and rotates
# its first half in adjacent pairs at table row POS_MULT*t + h % POS_MULT (1: normal layers; 2:
# paired layers, rows 2t, 2t+1 for even/odd heads): out[d] = n[d]*cos[d] + n[d^1]*sin[d] for
# d < hd/2 (the minus is in the sin table), n[d] after. v stays a view of qkv: attention saves the v
# it gets, and a copy would be memory beside the qkv this op's backward keeps anyway. The
# autograd.Function returns the view (a custom op may not), so v's gradient reaches the backward
# kernel, which writes all of d(qkv) in one pass. Pair partners come from a split and join of the
# row's (hd/2, 2) view, in registers: a gathered load of column d^1 compiled to scalar loads, well
# below a copy's bandwidth.
# Rounding: fp32 throughout, one rounding at the store. The compiled formulation this replaced also
# rounded the normed row to bf16 before rotating; a fused pass has no reason to, and one rounding is
# closer to the exact value (tested against a float64 transcription of the former formulation).
# Backward, from the saved qkv (not q, k): dn[d] = g[d]*cos[d] + g[d^1]*sin[d^1] (the rotation's
# transpose) for d < hd/2, dn = g after, then dx = r*(dn - n*mean(dn*n)).
# Key offset (KEY_OFFSET, normal long-window layers; tk.shift_keys_by_one): k's stationary half
# (dims hd/2..hd) takes the previous token's values (token 0 keeps its own). The forward stores
# that half of row (t, h) at row (t + 1, h), and token 0's at its own row too; the backward loads
# it from row t + 1, and token 0 adds its own, rounded to the gradient's dtype as autograd's sum
# of the two uses was. So each row is normalised once and the outputs are bitwise the former
# compiled shift's.
# Grid (blocks of BLOCK_R (t, h) rows, part): parts q and k forward; the backward's part 2 copies
# dv. Tiles: 16 rows of hd=128 and 4 warps, picked by timing (notes/2026-11-26_speed3_H200); the
# tiles set the fp32 sums' order.

RMS_EPS = 2.0 ** -23  # the eps of QK-norm and of every train_gpt.rms() (fp32 epsilon)
_QK_ROTARY_ELEMENTS = 2048
_QK_ROTARY_WARPS = 4
_QK_ROTARY_INTERPRETER_ROWS = 8  # CPU tests: several blocks and a partial last one


@triton.jit
def _qk_rotary_rows(n_rows, H, part, POS_MULT: tl.constexpr, HD: tl.constexpr,
                    BLOCK_R: tl.constexpr):
    """This program's BLOCK_R (t, h) rows of qkv's `part` (0 q, 1 k, 2 v): row offsets into qkv
    and into a (T, H, HD) tensor, the row mask, the table row offsets (in rows) and whether the
    row is token 0's, each (BLOCK_R, 1)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]  # t * H + h
    t, h = rows // H, rows % H
    qkv_row = ((t * 3 + part) * H + h).to(tl.int64) * HD
    tab_row = (t * POS_MULT + h % POS_MULT).to(tl.int64)
    return qkv_row, rows.to(tl.int64) * HD, rows < n_rows, tab_row, t == 0


@triton.jit
def _qk_rotary_normed(qkv_ptr, cos_ptr, sin_ptr, qkv_row, mask, tab_row, stride_tab,
                      HD: tl.constexpr, EPS: tl.constexpr):
    """fp32 n = x * r of these q or k rows, r, the rotating-half mask and the rows' cos and sin."""
    cols = tl.arange(0, HD)[None, :]
    x = _load_as_fp32(qkv_ptr + qkv_row + cols, mask)
    r = tl.rsqrt(tl.sum(x * x, axis=1) / HD + EPS)[:, None]
    rot = cols < HD // 2
    tab = tab_row * stride_tab + cols
    c = _load_as_fp32(cos_ptr + tab, mask & rot)
    return x * r, r, rot, c, _load_as_fp32(sin_ptr + tab, mask & rot)


@triton.jit
def _swap_pairs(x, BLOCK_R: tl.constexpr, HD: tl.constexpr):
    """(BLOCK_R, HD) -> the same with the elements of each adjacent pair (2m, 2m+1) swapped."""
    even, odd = tl.split(tl.reshape(x, (BLOCK_R, HD // 2, 2)))
    return tl.reshape(tl.join(odd, even), (BLOCK_R, HD))


@triton.jit
def _shifted_half(part, HD: tl.constexpr):
    """(1, HD): the columns the key offset moves, a head's stationary second half, in part k only
    (the comparison with part broadcast first: the interpreter rejects a mask that combines a
    block with a scalar's)."""
    cols = tl.arange(0, HD)[None, :]
    return (cols >= HD // 2) & (cols * 0 + part == 1)


@triton.jit
def _qk_rotary_fwd_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, stride_tab, n_rows, H,
                          POS_MULT: tl.constexpr, KEY_OFFSET: tl.constexpr, HD: tl.constexpr,
                          EPS: tl.constexpr, BLOCK_R: tl.constexpr):
    part = tl.program_id(1)
    qkv_row, out_row, mask, tab_row, first = _qk_rotary_rows(n_rows, H, part, POS_MULT, HD,
                                                             BLOCK_R)
    n, r, rot, c, s = _qk_rotary_normed(qkv_ptr, cos_ptr, sin_ptr, qkv_row, mask, tab_row,
                                        stride_tab, HD, EPS)
    out = tl.where(rot, n * c + _swap_pairs(n, BLOCK_R, HD) * s, n)
    offs, keep = out_row + tl.arange(0, HD)[None, :], mask
    out_ptr = q_ptr
    if part == 1:
        out_ptr = k_ptr
    if KEY_OFFSET:
        late = _shifted_half(part, HD)
        _store_from_fp32(out_ptr + offs, out, keep & late & first)
        offs = tl.where(late, offs + H * HD, offs)
        keep = keep & (offs < n_rows * HD)
    _store_from_fp32(out_ptr + offs, out, keep)


@triton.jit
def _qk_rotary_bwd_kernel(dq_ptr, dk_ptr, dv_ptr, qkv_ptr, cos_ptr, sin_ptr, dqkv_ptr, stride_tab,
                          n_rows, H, POS_MULT: tl.constexpr, KEY_OFFSET: tl.constexpr,
                          HD: tl.constexpr, EPS: tl.constexpr, BLOCK_R: tl.constexpr):
    part = tl.program_id(1)
    qkv_row, out_row, mask, tab_row, first = _qk_rotary_rows(n_rows, H, part, POS_MULT, HD,
                                                             BLOCK_R)
    cols = tl.arange(0, HD)[None, :]
    if part == 2:
        _store_from_fp32(dqkv_ptr + qkv_row + cols, _load_as_fp32(dv_ptr + out_row + cols, mask),
                         mask)
    else:
        n, r, rot, c, s = _qk_rotary_normed(qkv_ptr, cos_ptr, sin_ptr, qkv_row, mask, tab_row,
                                            stride_tab, HD, EPS)
        g_ptr = dq_ptr
        if part == 1:
            g_ptr = dk_ptr
        offs, keep = out_row + cols, mask
        if KEY_OFFSET:
            late = _shifted_half(part, HD)
            own = _load_as_fp32(dk_ptr + offs, keep & late & first)
            offs = tl.where(late, offs + H * HD, offs)
            keep = keep & (offs < n_rows * HD)
        g = _load_as_fp32(g_ptr + offs, keep)
        if KEY_OFFSET:
            g = tl.where(late & first, _round_as(dk_ptr, g + own), g)
        dn = tl.where(rot, g * c + _swap_pairs(g * s, BLOCK_R, HD), g)
        dx = r * (dn - n * (tl.sum(dn * n, axis=1) / HD)[:, None])
        _store_from_fp32(dqkv_ptr + qkv_row + cols, dx, mask)


def _check_qk_rotary_inputs(qkv: Tensor, cos: Tensor, sin: Tensor, pos_mult: int
                            ) -> tuple[int, int]:
    """-> (H, hd) after checking the layout the kernels assume."""
    _check(qkv.ndim == 2 and cos.ndim == 2 and cos.shape == sin.shape, "expected qkv (T, 3*H*hd) "
           f"and cos, sin (rows, hd/2), got {[tuple(t.shape) for t in (qkv, cos, sin)]}")
    for name, t in (("qkv", qkv), ("cos", cos), ("sin", sin)):
        _check_dtype(name, t)
        _check(t.device == qkv.device, f"{name} is on {t.device} but qkv on {qkv.device}")
    hd = 2 * cos.shape[1]
    H = qkv.shape[1] // (3 * hd)
    _check(hd >= 4 and hd & (hd - 1) == 0,
           f"head dim {hd} (2 x the tables' width) must be a power of 2, at least 4")
    _check(H >= 1 and qkv.shape[1] == 3 * H * hd,
           f"qkv's width {qkv.shape[1]} is not 3 * heads * {hd} (2 x the tables' width)")
    _check(qkv.is_contiguous() and cos.stride(1) == 1 and sin.stride() == cos.stride(),
           "qkv must be contiguous and cos, sin have unit column stride (one row stride for both); "
           "call .contiguous()")
    _check(pos_mult in (1, 2), f"pos_mult must be 1 (normal layer) or 2 (paired), got {pos_mult}")
    _check(cos.shape[0] >= pos_mult * qkv.shape[0],
           f"the tables have {cos.shape[0]} rows; {pos_mult} x {qkv.shape[0]} tokens are needed")
    return H, hd


def _qk_rotary_launch(qkv: Tensor, H: int, hd: int, parts: int, rows: int | None
                      ) -> tuple[tuple, dict]:
    """Grid over `parts` of qkv and launch options; rows (a power of 2) overrides the rows per
    program."""
    block_r = rows or (max(1, _QK_ROTARY_ELEMENTS // hd) if qkv.is_cuda
                       else _QK_ROTARY_INTERPRETER_ROWS)
    n_rows = qkv.shape[0] * H
    return (triton.cdiv(n_rows, block_r), parts), dict(n_rows=n_rows, H=H, HD=hd, EPS=RMS_EPS,
                                                   BLOCK_R=block_r, num_warps=_QK_ROTARY_WARPS)


def qk_norm_rotary_fwd_triton(qkv: Tensor, cos: Tensor, sin: Tensor, pos_mult: int,
                              key_offset: bool = False, rows: int | None = None
                              ) -> tuple[Tensor, Tensor]:
    """qkv (T, 3*H*hd), tables (>= pos_mult*T, hd/2) -> q, k normed and rotated (k shifted by
    key_offset), each (T, H, hd) contiguous in qkv's dtype. rows fixes the rows per program
    (tests)."""
    H, hd = _check_qk_rotary_inputs(qkv, cos, sin, pos_mult)
    q, k = (qkv.new_empty((qkv.shape[0], H, hd)) for _ in range(2))
    if qkv.shape[0] > 0:
        grid, options = _qk_rotary_launch(qkv, H, hd, 2, rows)
        wrap_triton(_qk_rotary_fwd_kernel)[grid](qkv, cos, sin, q, k, cos.stride(0),
                                                 POS_MULT=pos_mult, KEY_OFFSET=key_offset,
                                                 **options)
    return q, k


def qk_norm_rotary_bwd_triton(dq: Tensor, dk: Tensor, dv: Tensor, qkv: Tensor, cos: Tensor,
                              sin: Tensor, pos_mult: int, key_offset: bool = False,
                              rows: int | None = None) -> Tensor:
    """Gradients of q, k, v (each (T, H, hd) contiguous) and the forward's inputs -> d(qkv), with
    qkv's shape and dtype, written in one pass."""
    H, hd = _check_qk_rotary_inputs(qkv, cos, sin, pos_mult)
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        _check(t.shape == (qkv.shape[0], H, hd) and t.is_contiguous() and t.dtype == qkv.dtype,
               f"{name} must be a contiguous ({qkv.shape[0]}, {H}, {hd}) {qkv.dtype} tensor, got "
               f"{tuple(t.shape)} {t.dtype}")
    dqkv = torch.empty_like(qkv)
    if qkv.shape[0] > 0:
        grid, options = _qk_rotary_launch(qkv, H, hd, 3, rows)
        wrap_triton(_qk_rotary_bwd_kernel)[grid](dq, dk, dv, qkv, cos, sin, dqkv, cos.stride(0),
                                                 POS_MULT=pos_mult, KEY_OFFSET=key_offset,
                                                 **options)
    return dqkv


@triton_op(f"{_LIB}::qk_norm_rotary_fwd", mutates_args=())
def _qk_norm_rotary_fwd_op(qkv: Tensor, cos: Tensor, sin: Tensor, pos_mult: int,
                           key_offset: bool) -> tuple[Tensor, Tensor]:
    return qk_norm_rotary_fwd_triton(qkv, cos, sin, pos_mult, key_offset)


@triton_op(f"{_LIB}::qk_norm_rotary_bwd", mutates_args=())
def _qk_norm_rotary_bwd_op(dq: Tensor, dk: Tensor, dv: Tensor, qkv: Tensor, cos: Tensor,
                           sin: Tensor, pos_mult: int, key_offset: bool) -> Tensor:
    return qk_norm_rotary_bwd_triton(dq, dk, dv, qkv, cos, sin, pos_mult, key_offset)


class _QKNormRotaryFunction(torch.autograd.Function):
    """Autograd of the fused q/k norm + rotary: saves only qkv and the tables, and returns v as a
    view of qkv so that its gradient reaches the one backward kernel."""

    @staticmethod
    def forward(ctx, qkv: Tensor, cos: Tensor, sin: Tensor, pos_mult: int, key_offset: bool):
        q, k = torch.ops.nanogpt_kernels.qk_norm_rotary_fwd(qkv, cos, sin, pos_mult, key_offset)
        ctx.save_for_backward(qkv, cos, sin)
        ctx.pos_mult, ctx.key_offset = pos_mult, key_offset
        return q, k, qkv.view(q.shape[0], 3, *q.shape[1:])[:, 2]

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor):
        qkv, cos, sin = ctx.saved_tensors
        dqkv = torch.ops.nanogpt_kernels.qk_norm_rotary_bwd(
            dq.contiguous(), dk.contiguous(), dv.contiguous(), qkv, cos, sin, ctx.pos_mult,
            ctx.key_offset)
        return dqkv, None, None, None, None


def qk_norm_rotary_triton(qkv: Tensor, cos: Tensor, sin: Tensor, pos_mult: int,
                          key_offset: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """q, k normed and rotated (contiguous; k shifted by key_offset) and v (a view), each (T, H, hd),
    from qkv (T, 3*H*hd), differentiable, by the Triton kernels (CUDA; a CPU only under the
    interpreter, in float32)."""
    return _QKNormRotaryFunction.apply(qkv, cos, sin, pos_mult, key_offset)


def shift_keys_by_one(k: Tensor) -> Tensor:
    """Key offset (@classiclarryd, upstream record 49; the whole stationary half since upstream
    record 62, PR #201): dims [hd/2, hd) of every head, where rotary does not turn, take the values
    of the previous packed position (position 0 keeps its own; document boundaries are ignored).
    k (T, H, hd)."""
    half = k.shape[-1] // 2
    k_prev = torch.cat([k[:1], k[:-1]], dim=0)
    return torch.cat([k[..., :half], k_prev[..., half:]], dim=-1)


def qk_norm_rotary_reference(qkv: Tensor, cos: Tensor, sin: Tensor, pos_mult: int,
                             key_offset: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """q, k = rotary(rms(q)), rotary(rms(k)) in acc_dtype, rounded once, head h of token t at table
    row pos_mult*t + h % pos_mult, each (T, H, hd) contiguous in qkv's dtype, then k shifted by
    shift_keys_by_one if key_offset; v a view of qkv."""
    T, half = qkv.shape[0], cos.shape[1]
    hd = 2 * half
    H = qkv.shape[1] // (3 * hd)
    acc = acc_dtype(qkv.dtype)
    pos = torch.arange(T, device=qkv.device)[:, None]
    table_rows = pos_mult * pos + torch.arange(H, device=qkv.device) % pos_mult  # (T, H)
    c, s = cos[table_rows].to(acc), sin[table_rows].to(acc)                        # (T, H, hd/2)

    def norm_rotate(x: Tensor) -> Tensor:
        x = x.to(acc)
        n = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + RMS_EPS)
        n_rot, n_pass = n[..., :half], n[..., half:]
        n_swapped = n_rot.unflatten(-1, (half // 2, 2)).flip(-1).flatten(-2)
        return torch.cat([n_rot * c + n_swapped * s, n_pass], dim=-1).to(qkv.dtype)

    q, k, v = qkv.view(T, 3, H, hd).unbind(1)
    k = norm_rotate(k)
    return norm_rotate(q), shift_keys_by_one(k) if key_offset else k, v



# ==================================================================================================
# 10. DC-MHA correction  (lightweight dynamically composed attention on one layer; @Lisennlp, record 85)
# ==================================================================================================
# The contract: q, k, v, y (T, H, D) hold documents packed back to back (cu_seqlens); y is the layer's
# attention output. Query t sees K(t) = {s : t - window < s <= t, s in t's document}: `window` keys
# at most, itself included (section 8's window counts one more). Per head a softmax of
# scale * <q_t, k_s> over K(t), fp32: P_h(t, s), its own normaliser (not the attention's). Mixed over
# the heads with w1 (T, H), already normed by dc_head_weights: A(t, s) = sum_h w1[t, h] P_h(t, s),
# fp32, one A for all heads. Per head C_h(t, s) = w2[t, h] * A(t, s) rounded to v's dtype (the
# product is rounded, not A), then out = y + sum_s C_h(t, s) v_s, fp32 sum, rounded once.
# Backward: the exact gradient of the unrounded forward, except that dv uses the rounded C;
# dy = grad. With dM_h(t, s) = <grad_t, v_s>: dw2 = sum_s A dM_h, dA = sum_h w2 dM_h,
# dw1 = sum_s dA P_h, rho = w1 dw1, dS_h = P_h (w1 dA - rho), dq = scale sum_s dS_h k_s,
# dk = scale sum_t dS_h q_t, dv = sum_t C_h grad_t.
#
# Work. One query block of BLOCK_M rows needs keys m0 - window + 1 .. m0 + BLOCK_M - 1: one key tile
# of BLOCK_N = next power of two >= BLOCK_M + window - 1 (128 for 16 rows and window 112), so every
# program is one masked tile per head, no loop. Forward (per query block, all heads, since A mixes
# them): P_h from the scores in base 2 (scale folded with log2 e), A, then C_h @ v_h; it saves the
# base-2 log-sum-exp per (head, row). Backward, first kernel (per query block, all heads): A again
# from the saved lse, then dM_h, dw2, dA, then P_h once more (recomputed, not kept: six tiles would
# crowd the registers), dw1, rho, dS_h and dq (one writer each). dk and dv sum over the ~8 query
# blocks whose tile holds a key. deterministic=True: the first kernel stores A and dA (T x window,
# fp32) and rho, and a second kernel per (key block, head) sums dk, dv over the queries that see its
# keys in a fixed order. deterministic=False (the record's way): the first kernel adds its tile's dk,
# dv to zeroed tensors with atomics in dk's dtype (bf16 adds, order unfixed: not reproducible bit for
# bit), and there is no second kernel.
# The interpreter runs the kernels in float32 with small tiles (then C and dS stay fp32).

DC_WINDOW = 112     # keys per query of the DC correction, itself included (record 85)
DC_W1_EPS = 1e-6    # eps of the RMS norm of w1 over the heads (not RMS_EPS)
# Fixed tiles, not yet timed (bench/dc.py): "fwd", "dq" (the first backward kernel): (BLOCK_M, warps,
# stages); "dkdv": (BLOCK_M, BLOCK_N, warps, stages) of the key-block kernel.
_DC_TILES = {"fwd": (16, 4, 2), "dq": (16, 8, 1), "dkdv": (32, 64, 4, 2)}
_DC_INTERPRETER_TILES = {"fwd": (16, 1, 1), "dq": (16, 1, 1), "dkdv": (16, 16, 1, 1)}
_DC_MAX_WINDOW = 128  # one key tile per query block holds the whole window: larger ones would spill


def dc_logit_scale(scale: float) -> float:
    """The kernels' exp2 scale of the DC logits: fp32(fp32(scale) * fp32(log2 e)), the product the
    record's kernel forms in fp32 (a product in double, then rounded, can differ by one ulp)."""
    return _f32(_f32(scale) * _f32(_LOG2E))


@triton.jit
def _dc_query_tile(start_ptr, m0, T, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The rows of the query block at m0, the key tile's columns (m0 - window + 1 ...), which of
    them lie in [0, T), and which (row, key) pairs are in K(row)."""
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = m0 - window + 1 + tl.arange(0, BLOCK_N)
    row_ok = rows < T
    col_ok = (cols >= 0) & (cols < T)
    row_start = tl.load(start_ptr + rows, mask=row_ok, other=T)
    valid = (row_ok[:, None] & (cols[None, :] >= row_start[:, None])
             & (cols[None, :] <= rows[:, None]) & (cols[None, :] > rows[:, None] - window))
    return rows, tl.where(col_ok, cols, 0), row_ok, col_ok, valid


@triton.jit
def _dc_rows(ptr, rows, row_ok, h, stride_t, stride_h, HEAD_DIM: tl.constexpr):
    """Head h of the given rows of a (T, H, D) tensor with unit stride along D, (rows, D), as
    stored; masked rows read 0."""
    d = tl.arange(0, HEAD_DIM)
    return tl.load(ptr + rows.to(tl.int64)[:, None] * stride_t + h * stride_h + d[None, :],
                   mask=row_ok[:, None], other=0.0)


@triton.jit
def _dc_probs(q_ptr, k_ptr, lse_ptr, h, rows, cols, row_ok, col_ok, valid, T, qk_scale,
              stride_qt, stride_qh, stride_kt, stride_kh, HEAD_DIM: tl.constexpr):
    """P_h of the tile recomputed from the saved base-2 log-sum-exp (0 outside K), and k."""
    q = _dc_rows(q_ptr, rows, row_ok, h, stride_qt, stride_qh, HEAD_DIM)
    k = _dc_rows(k_ptr, cols, col_ok, h, stride_kt, stride_kh, HEAD_DIM)
    lse = tl.load(lse_ptr + h * T + rows, mask=row_ok, other=0.0)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    return tl.where(valid, tl.exp2(s - lse[:, None]), 0.0), k


@triton.jit
def _dc_fwd_kernel(q_ptr, k_ptr, v_ptr, y_ptr, w1_ptr, w2_ptr, start_ptr, out_ptr, lse_ptr, T,
                   window, qk_scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                   stride_vh, stride_yt, stride_yh, stride_ot, stride_oh, H: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One query block, all heads: out = y + C @ v and the base-2 log-sum-exp per (head, row)."""
    # inductor may pass the float arguments as fp64 scalars; keep every product fp32
    qk_scale = tl.cast(qk_scale, tl.float32)
    m0 = tl.program_id(0) * BLOCK_M
    rows, cols, row_ok, col_ok, valid = _dc_query_tile(start_ptr, m0, T, window, BLOCK_M, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for h in tl.static_range(H):
        q = _dc_rows(q_ptr, rows, row_ok, h, stride_qt, stride_qh, HEAD_DIM)
        k = _dc_rows(k_ptr, cols, col_ok, h, stride_kt, stride_kh, HEAD_DIM)
        s = tl.where(valid, tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
        m = tl.where(row_ok, tl.max(s, 1), 0.0)        # rows past T have no key
        p = tl.exp2(s - m[:, None])
        l_sum = tl.where(row_ok, tl.sum(p, 1), 1.0)    # >= 1 on real rows: they see themselves
        tl.store(lse_ptr + h * T + rows, m + tl.log2(l_sum), mask=row_ok)
        w1 = _load_as_fp32(w1_ptr + rows * H + h, row_ok)
        a += w1[:, None] * (p / l_sum[:, None])
    for h in tl.static_range(H):
        v = _dc_rows(v_ptr, cols, col_ok, h, stride_vt, stride_vh, HEAD_DIM)
        w2 = _load_as_fp32(w2_ptr + rows * H + h, row_ok)
        c = (w2[:, None] * a).to(v.dtype)                 # the rounding point of C
        y = _load_as_fp32(y_ptr + rows.to(tl.int64)[:, None] * stride_yt + h * stride_yh
                          + d[None, :], row_ok[:, None])
        _store_from_fp32(out_ptr + rows.to(tl.int64)[:, None] * stride_ot + h * stride_oh
                         + d[None, :], y + tl.dot(c, v), row_ok[:, None])


@triton.jit
def _dc_bwd_query_kernel(q_ptr, k_ptr, v_ptr, g_ptr, w1_ptr, w2_ptr, lse_ptr, start_ptr, dq_ptr,
                         dw1_ptr, dw2_ptr, a_ptr, da_ptr, rho_ptr, dk_ptr, dv_ptr, T, window,
                         qk_scale, scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                         stride_vh, stride_gt, stride_gh, H: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ATOMIC: tl.constexpr):
    """One query block, all heads: dw1, dw2 and dq; dk, dv by atomics (ATOMIC) or A, dA, rho for
    the key-block kernel. Gradients have the (T, H, D) contiguous layout, dw1 and dw2 (T, H)."""
    # inductor may pass the float arguments as fp64 scalars; keep every product fp32
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)
    m0 = tl.program_id(0) * BLOCK_M
    rows, cols, row_ok, col_ok, valid = _dc_query_tile(start_ptr, m0, T, window, BLOCK_M, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    col_offs = cols.to(tl.int64)[:, None] * (H * HEAD_DIM) + d[None, :]   # into dk, dv
    a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for h in tl.static_range(H):
        p, _ = _dc_probs(q_ptr, k_ptr, lse_ptr, h, rows, cols, row_ok, col_ok, valid, T, qk_scale,
                         stride_qt, stride_qh, stride_kt, stride_kh, HEAD_DIM)
        a += _load_as_fp32(w1_ptr + rows * H + h, row_ok)[:, None] * p
    da = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for h in tl.static_range(H):
        g = _dc_rows(g_ptr, rows, row_ok, h, stride_gt, stride_gh, HEAD_DIM)
        v = _dc_rows(v_ptr, cols, col_ok, h, stride_vt, stride_vh, HEAD_DIM)
        dm = tl.dot(g, tl.trans(v))                                       # (BM, BN)
        w2 = _load_as_fp32(w2_ptr + rows * H + h, row_ok)
        _store_from_fp32(dw2_ptr + rows * H + h, tl.sum(a * dm, 1), row_ok)
        da += w2[:, None] * dm
        if ATOMIC:
            c = (w2[:, None] * a).to(g.dtype)
            tl.atomic_add(dv_ptr + col_offs + h * HEAD_DIM, tl.dot(tl.trans(c), g),
                          mask=col_ok[:, None], sem="relaxed")
    for h in tl.static_range(H):
        p, k = _dc_probs(q_ptr, k_ptr, lse_ptr, h, rows, cols, row_ok, col_ok, valid, T, qk_scale,
                         stride_qt, stride_qh, stride_kt, stride_kh, HEAD_DIM)
        w1 = _load_as_fp32(w1_ptr + rows * H + h, row_ok)
        dw1 = tl.sum(da * p, 1)
        _store_from_fp32(dw1_ptr + rows * H + h, dw1, row_ok)
        rho = w1 * dw1
        ds = (p * (w1[:, None] * da - rho[:, None])).to(k.dtype)
        _store_from_fp32(dq_ptr + rows.to(tl.int64)[:, None] * (H * HEAD_DIM) + h * HEAD_DIM
                         + d[None, :], tl.dot(ds, k) * scale, row_ok[:, None])
        if ATOMIC:
            q = _dc_rows(q_ptr, rows, row_ok, h, stride_qt, stride_qh, HEAD_DIM)
            tl.atomic_add(dk_ptr + col_offs + h * HEAD_DIM, tl.dot(tl.trans(ds), q) * scale,
                          mask=col_ok[:, None], sem="relaxed")
        else:
            tl.store(rho_ptr + h * T + rows, rho, mask=row_ok)
    if not ATOMIC:
        band = rows.to(tl.int64)[:, None] * window + (rows[:, None] - cols[None, :])  # (t, t - s)
        tl.store(a_ptr + band, a, mask=valid)
        tl.store(da_ptr + band, da, mask=valid)


@triton.jit
def _dc_bwd_key_kernel(q_ptr, k_ptr, g_ptr, w1_ptr, w2_ptr, lse_ptr, rho_ptr, a_ptr, da_ptr,
                       end_ptr, dk_ptr, dv_ptr, T, window, qk_scale, scale, stride_qt, stride_qh,
                       stride_kt, stride_kh, stride_gt, stride_gh, H: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One (key block, head): dk and dv over every query that sees one of its keys, in a fixed
    order, from the first kernel's A, dA and rho."""
    # inductor may pass the float arguments as fp64 scalars; keep every product fp32
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)
    n0 = tl.program_id(0) * BLOCK_N
    h = tl.program_id(1)
    cols = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    col_ok = cols < T
    col_end = tl.load(end_ptr + cols, mask=col_ok, other=0)   # 0: no query sees a key past T
    last = tl.minimum(n0 + BLOCK_N, T) - 1
    b0 = (n0 // BLOCK_M) * BLOCK_M
    b1 = tl.minimum(tl.load(end_ptr + last), last + window)   # past the block's last query
    k = _dc_rows(k_ptr, cols, col_ok, h, stride_kt, stride_kh, HEAD_DIM)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    for m0 in range(b0, b1, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < T
        q = _dc_rows(q_ptr, rows, row_ok, h, stride_qt, stride_qh, HEAD_DIM)
        g = _dc_rows(g_ptr, rows, row_ok, h, stride_gt, stride_gh, HEAD_DIM)
        lse = tl.load(lse_ptr + h * T + rows, mask=row_ok, other=0.0)
        rho = tl.load(rho_ptr + h * T + rows, mask=row_ok, other=0.0)
        w1 = _load_as_fp32(w1_ptr + rows * H + h, row_ok)
        w2 = _load_as_fp32(w2_ptr + rows * H + h, row_ok)
        keep = ((rows[None, :] >= cols[:, None]) & (rows[None, :] < cols[:, None] + window)
                & (rows[None, :] < col_end[:, None]))                     # (BN, BM): s in K(t)
        band = rows.to(tl.int64)[None, :] * window + (rows[None, :] - cols[:, None])
        a_t = tl.load(a_ptr + band, mask=keep, other=0.0)
        da_t = tl.load(da_ptr + band, mask=keep, other=0.0)
        p_t = tl.where(keep, tl.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :]), 0.0)
        c_t = (w2[None, :] * a_t).to(g.dtype)
        ds_t = (p_t * (w1[None, :] * da_t - rho[None, :])).to(q.dtype)
        dv += tl.dot(c_t, g)
        dk += tl.dot(ds_t, q)
    offs = cols.to(tl.int64)[:, None] * (H * HEAD_DIM) + h * HEAD_DIM + d[None, :]
    _store_from_fp32(dk_ptr + offs, dk * scale, col_ok[:, None])
    _store_from_fp32(dv_ptr + offs, dv, col_ok[:, None])


def _check_dc_inputs(y: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor,
                     cu_seqlens: Tensor, window: int) -> None:
    _check(q.ndim == 3 and q.shape == k.shape == v.shape == y.shape,
           f"expected y, q, k, v of one shape (T, H, D), got {tuple(y.shape)}, {tuple(q.shape)}, "
           f"{tuple(k.shape)}, {tuple(v.shape)}")
    T, H, D = q.shape
    named = (("y", y), ("q", q), ("k", k), ("v", v), ("w1", w1), ("w2", w2))
    for name, t in named:
        _check_dtype(name, t)
    for name, t in named:
        _check(t.dtype == q.dtype and t.device == q.device,
               f"{name} is {t.dtype} on {t.device}, q is {q.dtype} on {q.device}")
        _check(t.stride(-1) == 1, f"{name} needs unit stride along its last dim; call .contiguous()")
    for name, t in (("w1", w1), ("w2", w2)):
        _check(t.shape == (T, H) and t.is_contiguous(),
               f"{name} must be a contiguous ({T}, {H}) tensor (per token and head), got "
               f"{tuple(t.shape)}")
    _check(D >= 16 and D & (D - 1) == 0, f"head dim {D} must be a power of two >= 16")
    _check(cu_seqlens.dtype == torch.int32 and cu_seqlens.ndim == 1
           and cu_seqlens.device == q.device,
           f"cu_seqlens must be a 1-D int32 tensor on {q.device}")
    _check(1 <= window <= _DC_MAX_WINDOW,
           f"window must be 1 .. {_DC_MAX_WINDOW} keys (one key tile per query block), got {window}")
    # block offsets (block start x row stride) are int32 in the kernels
    _check(max(t.shape[0] * t.stride(0) for t in (y, q, k, v)) < 2**31,
           "y, q, k, v span 2^31 elements or more; split the batch")


def _dc_tiles(t: Tensor, kernel: str, tiles: dict | None) -> tuple:
    """A kernel's tiles: tiles[kernel] if given, else the fixed GPU ones or the interpreter's."""
    if tiles and kernel in tiles:
        return tiles[kernel]
    return (_DC_TILES if t.is_cuda else _DC_INTERPRETER_TILES)[kernel]


def _dc_key_tile(block_m: int, window: int) -> int:
    """BLOCK_N of a query block's one key tile: the window before its first row and its rows."""
    return max(16, triton.next_power_of_2(block_m + window - 1))


def dc_correction_fwd_triton(y: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor,
                             cu_seqlens: Tensor, scale: float, window: int = DC_WINDOW,
                             tiles: dict | None = None) -> tuple[Tensor, Tensor]:
    """-> out (T, H, D) contiguous in y's dtype, lse (H, T) fp32 (base 2, of the logits times
    scale * log2 e). tiles overrides _DC_TILES' entries (tests, benchmarks)."""
    _check_dc_inputs(y, q, k, v, w1, w2, cu_seqlens, window)
    T, H, D = q.shape
    out = torch.empty((T, H, D), dtype=y.dtype, device=y.device)
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    start, _ = document_bounds(cu_seqlens, T)
    bm, warps, stages = _dc_tiles(q, "fwd", tiles)
    wrap_triton(_dc_fwd_kernel)[(triton.cdiv(T, bm),)](
        q, k, v, y, w1, w2, start, out, lse, T, window, dc_logit_scale(scale), q.stride(0),
        q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), y.stride(0), y.stride(1),
        out.stride(0), out.stride(1), H=H, HEAD_DIM=D, BLOCK_M=bm,
        BLOCK_N=_dc_key_tile(bm, window), num_warps=warps, num_stages=stages)
    return out, lse


def dc_correction_bwd_triton(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor,
                             w2: Tensor, lse: Tensor, cu_seqlens: Tensor, scale: float,
                             window: int = DC_WINDOW, deterministic: bool = True,
                             tiles: dict | None = None
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) (T, H, D) contiguous and (dw1, dw2) (T, H), in q's dtype, from the
    forward's lse; y's gradient is grad itself. deterministic=False: dk, dv by atomic adds in q's
    dtype (the record's way; not reproducible bit for bit)."""
    _check_dc_inputs(grad, q, k, v, w1, w2, cu_seqlens, window)
    T, H, D = q.shape
    _check(lse.shape == (H, T) and lse.dtype == torch.float32 and lse.is_contiguous(),
           f"lse must be the forward's contiguous ({H}, {T}) float32 tensor, got "
           f"{tuple(lse.shape)} {lse.dtype}")
    grads_like = dict(dtype=q.dtype, device=q.device)
    dq = torch.empty((T, H, D), **grads_like)
    dk, dv = ((torch.empty if deterministic else torch.zeros)((T, H, D), **grads_like)
              for _ in range(2))
    dw1, dw2 = (torch.empty((T, H), **grads_like) for _ in range(2))
    if T == 0:
        return dq, dk, dv, dw1, dw2
    start, end = document_bounds(cu_seqlens, T)
    fp32 = dict(dtype=torch.float32, device=q.device)
    if deterministic:   # written by the first kernel where (t, s) is in K, read only there
        a, da, rho = torch.empty((T, window), **fp32), torch.empty((T, window), **fp32), \
            torch.empty((H, T), **fp32)
    else:               # unused: the kernel's ATOMIC branch never touches them
        a = da = rho = lse
    bm, warps, stages = _dc_tiles(q, "dq", tiles)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1))
    wrap_triton(_dc_bwd_query_kernel)[(triton.cdiv(T, bm),)](
        q, k, v, grad, w1, w2, lse, start, dq, dw1, dw2, a, da, rho, dk, dv, T, window,
        dc_logit_scale(scale), scale, *strides, v.stride(0), v.stride(1), grad.stride(0),
        grad.stride(1), H=H, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=_dc_key_tile(bm, window),
        ATOMIC=not deterministic, num_warps=warps, num_stages=stages)
    if deterministic:
        bm, bn, warps, stages = _dc_tiles(q, "dkdv", tiles)
        wrap_triton(_dc_bwd_key_kernel)[(triton.cdiv(T, bn), H)](
            q, k, grad, w1, w2, lse, rho, a, da, end, dk, dv, T, window,
            dc_logit_scale(scale), scale, *strides, grad.stride(0), grad.stride(1), H=H,
            HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    return dq, dk, dv, dw1, dw2


@triton_op(f"{_LIB}::dc_correction_fwd", mutates_args=())
def _dc_correction_fwd_op(y: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor,
                          cu_seqlens: Tensor, scale: float, window: int) -> tuple[Tensor, Tensor]:
    return dc_correction_fwd_triton(y, q, k, v, w1, w2, cu_seqlens, scale, window)


@triton_op(f"{_LIB}::dc_correction_bwd", mutates_args=())
def _dc_correction_bwd_op(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor,
                          lse: Tensor, cu_seqlens: Tensor, scale: float, window: int,
                          deterministic: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return dc_correction_bwd_triton(grad, q, k, v, w1, w2, lse, cu_seqlens, scale, window,
                                    deterministic)


class _DCCorrectionFunction(torch.autograd.Function):
    """Autograd of the DC correction kernels: saves q, k, v, w1, w2 and the log-sum-exp."""

    @staticmethod
    def forward(ctx, y: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor,
                cu_seqlens: Tensor, scale: float, window: int, deterministic: bool) -> Tensor:
        out, lse = torch.ops.nanogpt_kernels.dc_correction_fwd(y, q, k, v, w1, w2, cu_seqlens,
                                                               scale, window)
        ctx.save_for_backward(q, k, v, w1, w2, lse, cu_seqlens)
        ctx.scale, ctx.window, ctx.deterministic = scale, window, deterministic
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, w1, w2, lse, cu_seqlens = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk, dv, dw1, dw2 = torch.ops.nanogpt_kernels.dc_correction_bwd(
            grad, q, k, v, w1, w2, lse, cu_seqlens, ctx.scale, ctx.window, ctx.deterministic)
        return grad, dq, dk, dv, dw1, dw2, None, None, None, None


def dc_correction_triton(y: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor,
                         cu_seqlens: Tensor, scale: float, window: int = DC_WINDOW,
                         deterministic: bool = True) -> Tensor:
    """Differentiable DC correction by the Triton kernels (CUDA; a CPU only under the interpreter,
    in float32): y, q, k, v (T, H, D) with unit stride along D, w1 (dc_head_weights) and w2
    (T, H) -> y + correction, (T, H, D) contiguous in y's dtype."""
    return _DCCorrectionFunction.apply(y, q, k, v, w1.contiguous(), w2.contiguous(), cu_seqlens,
                                       scale, window, deterministic)


def dc_head_weights(r1: Tensor) -> Tensor:
    """w1 of the DC correction from its raw gate values r1 (T, H): r1 over its RMS across the heads
    (eps DC_W1_EPS, no gain) in acc_dtype, rounded to r1's dtype. Shared by both paths."""
    return F.rms_norm(r1.to(acc_dtype(r1.dtype)), (r1.shape[-1],), eps=DC_W1_EPS).to(r1.dtype)


def dc_window_mask(cu_seqlens: Tensor, num_tokens: int, window: int) -> Tensor:
    """(T, window) bool: whether slot i of query t, the key s = t - window + 1 + i, is in K(t)
    (s <= t and s > t - window by construction; s in t's document implies s >= 0)."""
    start, _ = document_bounds(cu_seqlens, num_tokens)
    t = torch.arange(num_tokens, device=cu_seqlens.device)[:, None]
    return t - window + 1 + torch.arange(window, device=cu_seqlens.device) >= start[:, None]


def _dc_windows(x: Tensor, window: int) -> Tensor:
    """x (T, H, D) -> (T, H, D, window), a view: [t, ..., i] = x[t - window + 1 + i], zeros before
    position 0."""
    return F.pad(x, (0, 0, 0, 0, window - 1, 0)).unfold(0, window, 1)


def dc_mixed_probs(q: Tensor, k: Tensor, w1: Tensor, cu_seqlens: Tensor, scale: float,
                   window: int = DC_WINDOW) -> Tensor:
    """A (T, window) in acc_dtype, slot i of row t for the key t - window + 1 + i: the heads'
    softmaxes over K(t) of scale * <q_t, k_s>, mixed with w1 (T, H); 0 outside K(t)."""
    acc = acc_dtype(q.dtype)
    allowed = dc_window_mask(cu_seqlens, q.shape[0], window)[:, None, :]          # (T, 1, window)
    logits = scale * torch.einsum("thd,thdi->thi", q.to(acc), _dc_windows(k.to(acc), window))
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)   # (T, H, window)
    return torch.einsum("th,thi->ti", w1.to(acc), probs)


def dc_correction_reference(y: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor,
                            cu_seqlens: Tensor, scale: float, window: int = DC_WINDOW) -> Tensor:
    """The contract in plain PyTorch (autograd gives the backward), O(T * window * H * D) memory
    in the backward: the mixed probabilities A, C = w2 * A rounded to v's dtype, then
    y + sum_s C v_s in acc_dtype, rounded once to y's dtype."""
    acc = acc_dtype(q.dtype)
    a = dc_mixed_probs(q, k, w1, cu_seqlens, scale, window)                      # (T, window)
    c = (w2.to(acc)[:, :, None] * a[:, None, :]).to(v.dtype).to(acc)            # (T, H, window)
    correction = torch.einsum("thi,thdi->thd", c, _dc_windows(v.to(acc), window))
    return (y.to(acc) + correction).to(y.dtype)
