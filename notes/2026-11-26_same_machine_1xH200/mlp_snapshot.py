"""A copy of the shipped fused linear + ReLU^2 kernel as mlp_gluon.py and mlp_tma_stores.py measured it
(triton_kernels.py section 3, identical from 52c0e16 until 05798f9 replaced it with a warp-specialised kernel,
../2026-11-26_mlp_warp_specialized_1xH200/): one role per program, the tile loop flattened into the K loop, pointer
loads and stores. For the experiment scripts in this folder.

Unshipped evidence, not run by CI. Self-contained: the scripts import this file from their own folder (Python puts a
script's folder first on sys.path), never triton_kernels.py or train_gpt.py. The kernel is verbatim; the launcher
drops the interpreter tiles and torch.library wrapping.
"""
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

# (BM, BN, BK, GROUP_M, warps, stages, flatten), the shipped tiles of that time
_MLP_TILES = (128, 256, 64, 8, 8, 3, True)


@functools.lru_cache(maxsize=None)
def _num_programs_persistent(device: torch.device) -> int:
    """Programs of a persistent kernel: one per SM."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile index -> (row block, column block) in grouped order: GROUP_M row blocks sweep the
    columns together, so their a rows stay in L2."""
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (tile // tiles_per_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % tiles_per_group) % group_rows, (tile % tiles_per_group) // group_rows


@triton.jit
def _relu2_linear_kernel(a_ptr, b_ptr, pre_ptr, out_ptr, M, N, K, stride_am, stride_bn, stride_pm,
                         stride_om, BACKWARD: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         FLATTEN: tl.constexpr):
    """Persistent a @ b.T with the relu^2 epilogues above; K must be a multiple of BLOCK_K (checked
    by the launcher)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_steps = K // BLOCK_K
    rk = tl.arange(0, BLOCK_K)
    # The epilogue keeps its own tile counter instead of reusing the loop's: in the flattened loop
    # the loads of the next tile are issued before this tile's epilogue runs.
    stored = tl.program_id(0) - tl.num_programs(0)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        a_ptrs = a_ptr + (rows % M).to(tl.int64)[:, None] * stride_am + rk[None, :]  # (BM, BK),
                                                                                     # wrapped rows
        b_ptrs = b_ptr + (cols % N).to(tl.int64)[:, None] * stride_bn + rk[None, :]  # (BN, BK)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, k_steps):
            acc = tl.dot(tl.load(a_ptrs + k * BLOCK_K), tl.trans(tl.load(b_ptrs + k * BLOCK_K)), acc)

        stored += tl.num_programs(0)
        pid_m, pid_n = _grouped_tile(stored, num_pid_m, num_pid_n, GROUP_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        pre_ptrs = pre_ptr + rows.to(tl.int64)[:, None] * stride_pm + cols[None, :]
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        h = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # bf16(acc), back in fp32
                                                             # for the epilogue math
        if BACKWARD:
            pre = tl.load(pre_ptrs, mask=mask, other=0.0).to(tl.float32)
            d = 2.0 * h * tl.maximum(pre, 0.0)
            tl.store(out_ptrs, d.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(pre_ptrs, h.to(pre_ptr.dtype.element_ty), mask=mask)
            r = tl.maximum(h, 0.0)
            tl.store(out_ptrs, (r * r).to(out_ptr.dtype.element_ty), mask=mask)


def _launch_relu2_linear(a: Tensor, b: Tensor, pre: Tensor, out: Tensor, backward: bool,
                         tiles: tuple | None) -> None:
    M, K = a.shape
    N = b.shape[0]
    bm, bn, bk, group_m, warps, stages, flatten = tiles or _MLP_TILES
    if K % bk:
        raise ValueError(f"relu2_mlp needs the model dim ({K}) to be a multiple of {bk} (the kernel's K-step)")
    grid = (min(_num_programs_persistent(a.device), triton.cdiv(M, bm) * triton.cdiv(N, bn)),)
    _relu2_linear_kernel[grid](
        a, b, pre, out, M, N, K, a.stride(0), b.stride(0), pre.stride(0), out.stride(0),
        BACKWARD=backward, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, FLATTEN=flatten,
        num_warps=warps, num_stages=stages)
