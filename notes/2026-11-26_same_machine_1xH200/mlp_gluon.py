"""Scratch benchmark: the fused linear + ReLU^2 kernel (triton_kernels.py section 3) written in Gluon with a TMA-store
epilogue, against the shipped Triton kernel and cuBLAS, one Hopper GPU.

    python3 notes/2026-11-26_same_machine_1xH200/mlp_gluon.py [--compile-only]

Why: the shipped kernel runs at 65-75% of cuBLAS's matmul-only speed (notes/2026-11-25_mlp_kernel_flattened_1xH100).
Its epilogue stores 2 x 128 x 256 bf16 values per tile from registers, and no wgmma is issued until they are out. Here
every operand arrives by TMA into a ring of shared-memory slots signalled by mbarriers, the wgmma runs asynchronously
one step deep, and the epilogue writes its tile to shared memory and hands it to TMA stores that drain while the next
tile's matmul runs; the wait for them comes at the next epilogue. The math and rounding points are the shipped
kernel's: pre = bf16(acc), post = bf16(relu(pre)^2); backward d = bf16(2 * bf16(acc) * relu(pre)).

--compile-only compiles every config for sm_90 on any machine (no GPU) and prints shared memory, registers and spills.
--ncu-target launches, at 49,152 rows, cuBLAS's x @ w.T, the shipped forward and three Gluon forwards, twice each
(for ncu_profile.sh).

Unshipped experiment, kept as evidence (README.md, "The MLP kernel"): Gluon versions of the kernel (TMA-store
epilogue; warp-specialised "ws"; ping-pong "pp") against the shipped Triton kernel of that time and cuBLAS, bitwise
the same outputs. The TMA-store ones were slower; ws gained 6-8% on the backward and tied on the forward (H200); not
shipped. Self-contained: the shipped kernel is copied in mlp_snapshot.py, this folder.
"""
from __future__ import annotations

import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

import mlp_snapshot as snapshot  # this folder's copy of the shipped kernel of that time

# names that changed between triton 3.6 and 3.9
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

ROWS = (16384, 32768, 49152)
D, HIDDEN = 768, 3072
# (BM, BN, BK, STAGES, GROUP_M): shared memory = STAGES * (BM + BN) * BK * 2 + 2 * BM * BN * 2 bytes <= 227 KiB
# (block shapes must be powers of 2)
CONFIGS = [(128, 256, 32, 4, 8), (128, 256, 64, 2, 8), (128, 128, 64, 4, 8), (128, 256, 32, 4, 16),
           (128, 128, 64, 5, 8)]
# the warp-specialised kernel: one shared epilogue tile, so 128 x 256 x 64 fits 3 stages (208 KiB)
WS_CONFIGS = [(128, 256, 64, 3, 8), (128, 256, 32, 6, 8), (128, 256, 64, 3, 16), (128, 128, 64, 5, 8)]
# ping-pong: each consumer warpgroup owns a 128 x 128 tile and a 32 KiB epilogue tile; 32 KiB per ring stage
PP_CONFIGS = [(128, 128, 64, 4, 8), (128, 128, 64, 5, 8), (128, 128, 64, 5, 16), (128, 128, 32, 8, 8)]


@gluon.jit
def _grouped(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """Tile index -> (row block, column block), grouped like the shipped _grouped_tile."""
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (tile // tiles_per_group) * GROUP_M
    group_rows = gl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % tiles_per_group) % group_rows, (tile % tiles_per_group) // group_rows


@gluon.jit
def _program_tiles(M, N, BM: gl.constexpr, BN: gl.constexpr):
    """Tile grid and this persistent program's share: tiles first_tile, first_tile + step_tiles, ..."""
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    first_tile = gl.program_id(0)
    step_tiles = gl.num_programs(0)
    my_tiles = (num_pid_m * num_pid_n - first_tile + step_tiles - 1) // step_tiles
    return num_pid_m, num_pid_n, first_tile, step_tiles, my_tiles


@gluon.jit
def _issue(a_desc, b_desc, a_smem, b_smem, ready, it, total, first_tile, step_tiles, num_pid_m, num_pid_n,
           KSTEPS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """TMA loads of this program's flattened (tile, k) iteration `it` into ring slot it % STAGES (none past total)."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    slot = it % STAGES
    pid_m, pid_n = _grouped(first_tile + (it // KSTEPS) * step_tiles, num_pid_m, num_pid_n, GROUP_M)
    k0 = (it % KSTEPS) * BK
    ok = it < total
    mbarrier.expect(ready.index(slot), (BM + BN) * BK * 2, ok)
    _tma_load(a_desc, [pid_m * BM, k0], ready.index(slot), a_smem.index(slot), ok)
    _tma_load(b_desc, [pid_n * BN, k0], ready.index(slot), b_smem.index(slot), ok)


@gluon.jit
def _k_step(a_desc, b_desc, a_smem, b_smem, ready, acc, it, total, first_tile, step_tiles, num_pid_m, num_pid_n,
            use_acc, KSTEPS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """Wait for iteration it's operands, issue its wgmma, wait for the previous one, and refill that one's slot with
    iteration it + STAGES - 1."""
    slot = it % STAGES
    mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
    tok = warpgroup_mma(a_smem.index(slot), b_smem.index(slot).permute((1, 0)), acc, use_acc=use_acc, is_async=True)
    acc = warpgroup_mma_wait(1, deps=[tok])
    _issue(a_desc, b_desc, a_smem, b_smem, ready, it + STAGES - 1, total, first_tile, step_tiles, num_pid_m,
           num_pid_n, KSTEPS, GROUP_M, STAGES)
    return acc


@gluon.jit
def _relu2_linear_gluon_kernel(a_desc, b_desc, pre_desc, out_desc, M, N, K, epilogue, BACKWARD: gl.constexpr,
                               GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                 instr_shape=[16, BN, 16])
    KSTEPS = K // BK
    num_pid_m, num_pid_n, first_tile, step_tiles, my_tiles = _program_tiles(M, N, BM, BN)
    total = my_tiles * KSTEPS

    a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], a_desc.layout)
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], b_desc.layout)
    c0 = gl.allocate_shared_memory(gl.bfloat16, [BM, BN], pre_desc.layout)   # pre (forward out / backward in)
    c1 = gl.allocate_shared_memory(gl.bfloat16, [BM, BN], out_desc.layout)   # post / dpre
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    pre_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    mbarrier.init(pre_bar, count=1)
    fence_async_shared()
    for i in gl.static_range(STAGES - 1):
        _issue(a_desc, b_desc, a_smem, b_smem, ready, i, total, first_tile, step_tiles, num_pid_m, num_pid_n,
               KSTEPS, GROUP_M, STAGES)

    for t in range(my_tiles):
        pid_m, pid_n = _grouped(first_tile + t * step_tiles, num_pid_m, num_pid_n, GROUP_M)
        m0 = pid_m * BM
        n0 = pid_n * BN
        if BACKWARD:   # this tile's pre, in flight during the matmul (the last epilogue is done reading c0)
            mbarrier.expect(pre_bar, BM * BN * 2)
            _tma_load(pre_desc, [m0, n0], pre_bar, c0)
        it = t * KSTEPS
        acc = _k_step(a_desc, b_desc, a_smem, b_smem, ready, gl.zeros([BM, BN], gl.float32, ACC), it, total,
                      first_tile, step_tiles, num_pid_m, num_pid_n, False, KSTEPS, GROUP_M, STAGES)
        for kk in range(1, KSTEPS):
            acc = _k_step(a_desc, b_desc, a_smem, b_smem, ready, acc, it + kk, total, first_tile, step_tiles,
                          num_pid_m, num_pid_n, True, KSTEPS, GROUP_M, STAGES)
        acc = warpgroup_mma_wait(0, deps=[acc])
        if epilogue:
            _epilogue(acc, c0, c1, pre_bar, pre_desc, out_desc, m0, n0, t, BACKWARD, ACC)
    tma.store_wait(0)


@gluon.jit
def _epilogue(acc, c0, c1, pre_bar, pre_desc, out_desc, m0, n0, t, BACKWARD: gl.constexpr, ACC: gl.constexpr):
    h = acc.to(gl.bfloat16)
    tma.store_wait(0)   # the last tile's stores have read their shared memory (only the issuing thread waits)
    _cta_barrier()
    if BACKWARD:
        mbarrier.wait(pre_bar, t & 1)
        pre = c0.load(ACC).to(gl.float32)
        c1.store((2.0 * h.to(gl.float32) * gl.maximum(pre, 0.0)).to(gl.bfloat16))
    else:
        c0.store(h)
        r = gl.maximum(h.to(gl.float32), 0.0)
        c1.store((r * r).to(gl.bfloat16))
    fence_async_shared()
    _cta_barrier()
    if not BACKWARD:
        _tma_store(pre_desc, [m0, n0], c0)
    _tma_store(out_desc, [m0, n0], c1)


# ---- warp-specialised: a TMA producer warpgroup and one 8-warp consumer partition -------------------------------

@gluon.jit
def _store_through(c_smem, value, desc, m0, n0):
    """value -> the shared tile -> a TMA store, once the tile's last store has read it."""
    tma.store_wait(0)   # only the issuing thread has pending stores: the barrier makes the others wait too
    _cta_barrier()
    c_smem.store(value)
    fence_async_shared()
    _cta_barrier()
    _tma_store(desc, [m0, n0], c_smem)


@gluon.jit
def _prefetch_tile(c_smem, bar, desc, m0, n0):
    """A TMA load of desc's tile at (m0, n0) into the shared tile, once its last store has read it."""
    tma.store_wait(0)
    _cta_barrier()
    mbarrier.expect(bar, c_smem.type.shape[0] * c_smem.type.shape[1] * 2)
    _tma_load(desc, [m0, n0], bar, c_smem)


@gluon.jit
def _tile_mainloop(a_smem, b_smem, ready, empty, acc, t, KSTEPS, STAGES: gl.constexpr):
    """Tile t's wgmmas from the ring, one step deep; each slot goes back to the producer once its product is done,
    except the last (the caller hands it back after waiting for the last product)."""
    for kk in range(KSTEPS):
        it = t * KSTEPS + kk
        slot = it % STAGES
        mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
        tok = warpgroup_mma(a_smem.index(slot), b_smem.index(slot).permute((1, 0)), acc, use_acc=kk > 0,
                            is_async=True)
        acc = warpgroup_mma_wait(1, deps=[tok])
        if kk > 0:
            mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
    return acc


@gluon.jit
def _shared_tile_epilogue(acc, c_smem, pre_bar, phase, pre_desc, out_desc, m0, n0, BACKWARD: gl.constexpr,
                          ACC: gl.constexpr):
    """Forward: pre, then post, through the one shared tile. Backward: pre (loaded into the tile by TMA at the
    tile's start) read back, dpre stored through the same tile."""
    h = acc.to(gl.bfloat16)
    if BACKWARD:
        mbarrier.wait(pre_bar, phase)
        pre = c_smem.load(ACC).to(gl.float32)
        _store_through(c_smem, (2.0 * h.to(gl.float32) * gl.maximum(pre, 0.0)).to(gl.bfloat16), out_desc, m0, n0)
    else:
        _store_through(c_smem, h, pre_desc, m0, n0)
        r = gl.maximum(h.to(gl.float32), 0.0)
        _store_through(c_smem, (r * r).to(gl.bfloat16), out_desc, m0, n0)

@gluon.jit
def _ws_producer(a_desc, b_desc, a_smem, b_smem, ready, empty, total, first_tile, step_tiles, num_pid_m, num_pid_n,
                 KSTEPS, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """Every (tile, k) operand pair of this program into the next free ring slot."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    for it in range(total):
        slot = it % STAGES
        mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)   # passes at once on the first lap
        pid_m, pid_n = _grouped(first_tile + (it // KSTEPS) * step_tiles, num_pid_m, num_pid_n, GROUP_M)
        k0 = (it % KSTEPS) * BK
        mbarrier.expect(ready.index(slot), (BM + BN) * BK * 2)
        _tma_load(a_desc, [pid_m * BM, k0], ready.index(slot), a_smem.index(slot))
        _tma_load(b_desc, [pid_n * BN, k0], ready.index(slot), b_smem.index(slot))


@gluon.jit
def _ws_consumer(a_smem, b_smem, c_smem, ready, empty, pre_bar, pre_desc, out_desc, my_tiles, first_tile,
                 step_tiles, num_pid_m, num_pid_n, KSTEPS, BACKWARD: gl.constexpr, GROUP_M: gl.constexpr,
                 STAGES: gl.constexpr, NUM_WARPS: gl.constexpr):
    """The matmul of each tile from the ring (wgmma one step deep, each slot handed back when its product is done),
    then the epilogue through one shared tile and TMA stores that drain during the next tile."""
    BM: gl.constexpr = c_smem.type.shape[0]
    BN: gl.constexpr = c_smem.type.shape[1]
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                 instr_shape=[16, BN, 16])
    acc = gl.zeros([BM, BN], gl.float32, ACC)
    for t in range(my_tiles):
        pid_m, pid_n = _grouped(first_tile + t * step_tiles, num_pid_m, num_pid_n, GROUP_M)
        m0 = pid_m * BM
        n0 = pid_n * BN
        if BACKWARD:   # this tile's pre into the shared tile, once the last tile's dpre store has read it
            _prefetch_tile(c_smem, pre_bar, pre_desc, m0, n0)
        acc = _tile_mainloop(a_smem, b_smem, ready, empty, acc, t, KSTEPS, STAGES)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index((t * KSTEPS + KSTEPS - 1) % STAGES), count=1)
        _shared_tile_epilogue(acc, c_smem, pre_bar, t & 1, pre_desc, out_desc, m0, n0, BACKWARD, ACC)
    tma.store_wait(0)


@gluon.jit
def _relu2_linear_ws_kernel(a_desc, b_desc, pre_desc, out_desc, M, N, K, BACKWARD: gl.constexpr,
                            GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    KSTEPS = K // BK
    num_pid_m, num_pid_n, first_tile, step_tiles, my_tiles = _program_tiles(M, N, BM, BN)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], a_desc.layout)
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], b_desc.layout)
    c_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, BN], pre_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    pre_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(pre_bar, count=1)
    fence_async_shared()
    gl.warp_specialize(
        [(_ws_consumer, (a_smem, b_smem, c_smem, ready, empty, pre_bar, pre_desc, out_desc, my_tiles, first_tile,
                         step_tiles, num_pid_m, num_pid_n, KSTEPS, BACKWARD, GROUP_M, STAGES, NUM_WARPS)),
         (_ws_producer, (a_desc, b_desc, a_smem, b_smem, ready, empty, my_tiles * KSTEPS, first_tile, step_tiles,
                         num_pid_m, num_pid_n, KSTEPS, GROUP_M, STAGES))],
        [4], [24])


# ---- ping-pong: two consumer warpgroups take alternate tiles; one's epilogue runs during the other's matmul -----

@gluon.jit
def _pp_consumer(a_smem, b_smem, c_smem, ready, empty, turn, pre_bar, pre_desc, out_desc, c, my_tiles, first_tile,
                 step_tiles, num_pid_m, num_pid_n, KSTEPS, BACKWARD: gl.constexpr, GROUP_M: gl.constexpr,
                 STAGES: gl.constexpr):
    """Consumer c (one warpgroup) computes this program's tiles c, c + 2, ...: it waits for its turn, issues the
    tile's wgmmas from the shared ring, passes the turn to the other consumer once the last one is issued, then
    runs its epilogue through its own shared tile while the other consumer's matmul runs. Taking turns keeps the
    ring's slots consumed in order, so each slot's mbarrier phase stays unambiguous."""
    BM: gl.constexpr = c_smem.type.shape[0]
    BN: gl.constexpr = c_smem.type.shape[1]
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    acc = gl.zeros([BM, BN], gl.float32, ACC)
    j = 0
    for t in range(c, my_tiles, 2):
        pid_m, pid_n = _grouped(first_tile + t * step_tiles, num_pid_m, num_pid_n, GROUP_M)
        m0 = pid_m * BM
        n0 = pid_n * BN
        if BACKWARD:
            _prefetch_tile(c_smem, pre_bar, pre_desc, m0, n0)
        mbarrier.wait(turn.index(c), j & 1)
        acc = _tile_mainloop(a_smem, b_smem, ready, empty, acc, t, KSTEPS, STAGES)
        mbarrier.arrive(turn.index(1 - c), count=1)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index((t * KSTEPS + KSTEPS - 1) % STAGES), count=1)
        _shared_tile_epilogue(acc, c_smem, pre_bar, j & 1, pre_desc, out_desc, m0, n0, BACKWARD, ACC)
        j += 1
    tma.store_wait(0)


@gluon.jit
def _relu2_linear_pp_kernel(a_desc, b_desc, pre_desc, out_desc, M, N, K, BACKWARD: gl.constexpr,
                            GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    KSTEPS = K // BK
    num_pid_m, num_pid_n, first_tile, step_tiles, my_tiles = _program_tiles(M, N, BM, BN)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], a_desc.layout)
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], b_desc.layout)
    c0 = gl.allocate_shared_memory(gl.bfloat16, [BM, BN], pre_desc.layout)
    c1 = gl.allocate_shared_memory(gl.bfloat16, [BM, BN], pre_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pre_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
        mbarrier.init(pre_bars.index(i), count=1)
    fence_async_shared()
    mbarrier.arrive(turn.index(0), count=1)   # consumer 0 goes first
    gl.warp_specialize(
        [(_pp_consumer, (a_smem, b_smem, c0, ready, empty, turn, pre_bars.index(0), pre_desc, out_desc, 0, my_tiles,
                         first_tile, step_tiles, num_pid_m, num_pid_n, KSTEPS, BACKWARD, GROUP_M, STAGES)),
         (_pp_consumer, (a_smem, b_smem, c1, ready, empty, turn, pre_bars.index(1), pre_desc, out_desc, 1, my_tiles,
                         first_tile, step_tiles, num_pid_m, num_pid_n, KSTEPS, BACKWARD, GROUP_M, STAGES)),
         (_ws_producer, (a_desc, b_desc, a_smem, b_smem, ready, empty, my_tiles * KSTEPS, first_tile, step_tiles,
                         num_pid_m, num_pid_n, KSTEPS, GROUP_M, STAGES))],
        [4, 4], [240, 24])


def _desc(t: torch.Tensor, block: list) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def launch(a, b, pre, out, backward, cfg, epilogue=1, kind="plain"):
    """kind: "plain" (_relu2_linear_gluon_kernel; epilogue=0 skips its epilogue), "ws" or "pp"."""
    bm, bn, bk, stages, group_m = cfg
    M, K = a.shape
    N = b.shape[0]
    grid = (min(snapshot._num_programs_persistent(a.device), triton.cdiv(M, bm) * triton.cdiv(N, bn)),)
    args = [_desc(a, [bm, bk]), _desc(b, [bn, bk]), _desc(pre, [bm, bn]), _desc(out, [bm, bn]), M, N, K]
    consts = dict(BACKWARD=backward, GROUP_M=group_m, STAGES=stages)
    if kind == "plain":
        _relu2_linear_gluon_kernel[grid](*args, epilogue, **consts, NUM_WARPS=8, num_warps=8)
    elif kind == "ws":
        _relu2_linear_ws_kernel[grid](*args, **consts, NUM_WARPS=8, num_warps=8)
    else:
        _relu2_linear_pp_kernel[grid](*args, **consts, num_warps=4)


def name(cfg) -> str:
    bm, bn, bk, stages, group_m = cfg
    return f"gluon {bm}x{bn}x{bk} s{stages} g{group_m}"


def ptxas_usage(ptx: str) -> str:
    """Registers and spill stores of a PTX module, from the ptxas that ships with triton. Triton 3.9 writes a newer
    PTX version than its ptxas reads; the version line is lowered to the one ptxas names in its error. (A copy of
    ../2026-11-25_gluon_attention_H100/attention_gluon.py's.)"""
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


def compile_only() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    print(f"triton {triton.__version__}, sm_90 compiles", flush=True)
    x = torch.zeros(256, D, dtype=torch.bfloat16)
    w = torch.zeros(HIDDEN, D, dtype=torch.bfloat16)
    h = torch.zeros(256, HIDDEN, dtype=torch.bfloat16)
    kernels = [(_relu2_linear_gluon_kernel, cfg, "") for cfg in CONFIGS]
    kernels += [(_relu2_linear_ws_kernel, cfg, "ws ") for cfg in WS_CONFIGS]
    kernels += [(_relu2_linear_pp_kernel, cfg, "pp ") for cfg in PP_CONFIGS]
    for kernel, cfg, tag in kernels:
        bm, bn, bk, stages, group_m = cfg
        for backward in (False, True):
            sig = {"a_desc": mangle_type(_desc(x, [bm, bk])), "b_desc": mangle_type(_desc(w, [bn, bk])),
                   "pre_desc": mangle_type(_desc(h, [bm, bn])), "out_desc": mangle_type(_desc(h, [bm, bn])),
                   "M": "i32", "N": "i32", "K": "i32", "epilogue": "i32", "BACKWARD": "constexpr",
                   "GROUP_M": "constexpr", "STAGES": "constexpr", "NUM_WARPS": "constexpr"}
            sig = {n: sig[n] for n in kernel.arg_names}
            consts = {n: v for n, v in {"BACKWARD": backward, "GROUP_M": group_m, "STAGES": stages,
                                        "NUM_WARPS": 8}.items() if n in kernel.arg_names}
            warps = 4 if kernel is _relu2_linear_pp_kernel else 8
            try:
                k = triton.compile(GluonASTSource(fn=kernel, signature=sig, constexprs=consts),
                                   target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
                res = f"shared {k.metadata.shared} B, {ptxas_usage(k.asm['ptx'])}"
            except Exception as e:  # noqa: BLE001
                while e.__cause__ is not None:
                    e = e.__cause__
                res = f"failed: {type(e).__name__}: {str(e)[-1500:]}"
            print(f"{tag}{name(cfg)} {'bwd' if backward else 'fwd'}: {res}", flush=True)

def ncu_target() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    M = 49152
    x = torch.randn(M, D, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(HIDDEN, D, device="cuda", generator=gen) / D ** 0.5).bfloat16()
    pre, post = (torch.empty(M, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    runs = [lambda: torch.mm(x, w.T, out=pre),   # cuBLAS, the matmul alone
            lambda: snapshot._launch_relu2_linear(x, w, pre, post, False, None),
            lambda: launch(x, w, pre, post, False, CONFIGS[0]),
            lambda: launch(x, w, pre, post, False, CONFIGS[1]),
            lambda: launch(x, w, pre, post, False, CONFIGS[1], 0)]
    for run in runs:
        run()
        run()
    torch.cuda.synchronize()


def main(argv) -> None:
    if "--compile-only" in argv:
        compile_only()
        return
    if "--ncu-target" in argv:
        ncu_target()
        return
    from triton.testing import do_bench
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; ms per call "
          "(median of do_bench, the better of two rounds)")
    variants = [("triton (shipped) " + "x".join(map(str, snapshot._MLP_TILES[:3])),
                 lambda x, w, pre, out: snapshot._launch_relu2_linear(x, w, pre, out, False, None),
                 lambda g, w, pre, out: snapshot._launch_relu2_linear(g, w, pre, out, True, None))]
    for cfg in CONFIGS:
        variants.append((name(cfg), lambda x, w, pre, out, c=cfg: launch(x, w, pre, out, False, c),
                         lambda g, w, pre, out, c=cfg: launch(g, w, pre, out, True, c)))
    for cfg in WS_CONFIGS:
        variants.append(("ws " + name(cfg), lambda x, w, pre, out, c=cfg: launch(x, w, pre, out, False, c, kind="ws"),
                         lambda g, w, pre, out, c=cfg: launch(g, w, pre, out, True, c, kind="ws")))
    for cfg in PP_CONFIGS:
        variants.append(("pp " + name(cfg), lambda x, w, pre, out, c=cfg: launch(x, w, pre, out, False, c, kind="pp"),
                         lambda g, w, pre, out, c=cfg: launch(g, w, pre, out, True, c, kind="pp")))
    for cfg in CONFIGS[:3]:   # the matmul alone: what the epilogue costs
        variants.append((name(cfg) + " no epi", lambda x, w, pre, out, c=cfg: launch(x, w, pre, out, False, c, 0),
                         lambda g, w, pre, out, c=cfg: launch(g, w, pre, out, True, c, 0)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    warm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(400):
        warm @ warm
    del warm
    print(f"{'rows':>6} {'variant':<34} {'fwd ms':>8} {'bwd ms':>8} {'fwd TF/s':>9} {'bwd TF/s':>9}  vs shipped")
    for M in ROWS:
        x = torch.randn(M, D, device="cuda", generator=gen).bfloat16()
        g = torch.randn(M, D, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(HIDDEN, D, device="cuda", generator=gen) / D ** 0.5).bfloat16()
        flops = 2 * M * D * HIDDEN
        t = min(do_bench(lambda: x @ w.T, warmup=25, rep=100, return_mode="median") for _ in range(2))
        print(f"{M:>6} {'cuBLAS x @ w.T alone':<34} {t:>8.4f} {'':>8} {flops / t / 1e9:>9.1f}", flush=True)
        ref = None
        for label, fwd, bwd in variants:
            pre, post, dpre = (torch.full((M, HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
                               for _ in range(3))
            try:
                fwd(x, w, pre, post)
                ref_pre = ref[0] if ref is not None else pre
                bwd(g, w, ref_pre.clone(), dpre)
                torch.cuda.synchronize()
                outs = (pre.clone(), post.clone(), dpre.clone())
                if ref is None:
                    ref = outs
                same = ["=" if torch.equal(a, b) else f"{(a.float() - b.float()).abs().max().item():.2e}"
                        for a, b in zip(outs, ref)]
                t_f = min(do_bench(lambda: fwd(x, w, pre, post), warmup=25, rep=100, return_mode="median")
                          for _ in range(2))
                t_b = min(do_bench(lambda: bwd(g, w, ref[0], dpre), warmup=25, rep=100, return_mode="median")
                          for _ in range(2))
                note = "pre/post/dpre " + "/".join(same)
                print(f"{M:>6} {label:<34} {t_f:>8.4f} {t_b:>8.4f} {flops / t_f / 1e9:>9.1f} {flops / t_b / 1e9:>9.1f}"
                      f"  {note}", flush=True)
            except Exception as e:  # noqa: BLE001 - one failed candidate must not end the table
                print(f"{M:>6} {label:<34} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
