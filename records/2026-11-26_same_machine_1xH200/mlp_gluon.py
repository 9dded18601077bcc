"""Scratch benchmark: the fused linear + ReLU^2 kernel (triton_kernels.py section 3) written in Gluon with a TMA-store
epilogue, against the shipped Triton kernel and cuBLAS, one Hopper GPU.

    python3 records/2026-11-26_same_machine_1xH200/mlp_gluon.py [--compile-only]

Why: the shipped kernel runs at 65-75% of cuBLAS's matmul-only speed (records/2026-11-25_mlp_kernel_flattened_1xH100).
Its epilogue stores 2 x 128 x 256 bf16 values per tile from registers, and no wgmma is issued until they are out. Here
every operand arrives by TMA into a ring of shared-memory slots signalled by mbarriers, the wgmma runs asynchronously
one step deep, and the epilogue writes its tile to shared memory and hands it to TMA stores that drain while the next
tile's matmul runs; the wait for them comes at the next epilogue. The math and rounding points are the shipped
kernel's: pre = bf16(acc), post = bf16(relu(pre)^2); backward d = bf16(2 * bf16(acc) * relu(pre)).

--compile-only compiles every config for sm_90 on any machine (no GPU) and prints shared memory, registers and spills.
--ncu-target launches, at 49,152 rows, cuBLAS's x @ w.T, the shipped forward and three Gluon forwards, twice each
(for ncu_profile.sh).
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))   # the repository root
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "2026-11-25_gluon_attention_H100"))
import triton_kernels as tk  # noqa: E402

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


@gluon.jit
def _grouped(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """Tile index -> (row block, column block), grouped like tk._grouped_tile."""
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (tile // tiles_per_group) * GROUP_M
    group_rows = gl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % tiles_per_group) % group_rows, (tile % tiles_per_group) // group_rows


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
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    first_tile = gl.program_id(0)
    step_tiles = gl.num_programs(0)
    my_tiles = (num_pid_m * num_pid_n - first_tile + step_tiles - 1) // step_tiles
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


def _desc(t: torch.Tensor, block: list) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def launch(a, b, pre, out, backward, cfg, epilogue=1):
    bm, bn, bk, stages, group_m = cfg
    M, K = a.shape
    N = b.shape[0]
    grid = (min(tk._num_programs_persistent(a.device), triton.cdiv(M, bm) * triton.cdiv(N, bn)),)
    _relu2_linear_gluon_kernel[grid](_desc(a, [bm, bk]), _desc(b, [bn, bk]), _desc(pre, [bm, bn]),
                                     _desc(out, [bm, bn]), M, N, K, epilogue, BACKWARD=backward, GROUP_M=group_m,
                                     STAGES=stages, NUM_WARPS=8, num_warps=8)


def name(cfg) -> str:
    bm, bn, bk, stages, group_m = cfg
    return f"gluon {bm}x{bn}x{bk} s{stages} g{group_m}"


def compile_only() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    from attention_gluon import ptxas_usage
    print(f"triton {triton.__version__}, sm_90 compiles", flush=True)
    x = torch.zeros(256, D, dtype=torch.bfloat16)
    w = torch.zeros(HIDDEN, D, dtype=torch.bfloat16)
    h = torch.zeros(256, HIDDEN, dtype=torch.bfloat16)
    for cfg in CONFIGS:
        bm, bn, bk, stages, group_m = cfg
        for backward in (False, True):
            sig = {"a_desc": mangle_type(_desc(x, [bm, bk])), "b_desc": mangle_type(_desc(w, [bn, bk])),
                   "pre_desc": mangle_type(_desc(h, [bm, bn])), "out_desc": mangle_type(_desc(h, [bm, bn])),
                   "M": "i32", "N": "i32", "K": "i32", "epilogue": "i32", "BACKWARD": "constexpr", "GROUP_M": "constexpr",
                   "STAGES": "constexpr", "NUM_WARPS": "constexpr"}
            consts = {"BACKWARD": backward, "GROUP_M": group_m, "STAGES": stages, "NUM_WARPS": 8}
            try:
                k = triton.compile(GluonASTSource(fn=_relu2_linear_gluon_kernel, signature=sig, constexprs=consts),
                                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
                res = f"shared {k.metadata.shared} B, {ptxas_usage(k.asm['ptx'])}"
            except Exception as e:  # noqa: BLE001
                while e.__cause__ is not None:
                    e = e.__cause__
                res = f"failed: {type(e).__name__}: {str(e)[-1500:]}"
            print(f"{name(cfg)} {'bwd' if backward else 'fwd'}: {res}", flush=True)


def ncu_target() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    M = 49152
    x = torch.randn(M, D, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(HIDDEN, D, device="cuda", generator=gen) / D ** 0.5).bfloat16()
    pre, post = (torch.empty(M, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    runs = [lambda: torch.mm(x, w.T, out=pre),   # cuBLAS, the matmul alone
            lambda: tk._launch_relu2_linear(x, w, pre, post, False, None),
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
    variants = [("triton (shipped) " + "x".join(map(str, tk._MLP_TILES[:3])),
                 lambda x, w, pre, out: tk._launch_relu2_linear(x, w, pre, out, False, None),
                 lambda g, w, pre, out: tk._launch_relu2_linear(g, w, pre, out, True, None))]
    for cfg in CONFIGS:
        variants.append((name(cfg), lambda x, w, pre, out, c=cfg: launch(x, w, pre, out, False, c),
                         lambda g, w, pre, out, c=cfg: launch(g, w, pre, out, True, c)))
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
