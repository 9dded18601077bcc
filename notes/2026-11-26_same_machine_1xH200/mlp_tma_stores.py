"""Scratch benchmark: the shipped fused linear + ReLU^2 kernel (triton_kernels.py section 3) with its epilogue stored
through host-side tensor descriptors (TMA stores, which Triton pipelines: the wait for a store's shared-memory read
comes before the buffer is written again), loads unchanged; against the shipped kernel, one GPU.

    python3 notes/2026-11-26_same_machine_1xH200/mlp_tma_stores.py [--compile]

--compile compiles the variants for sm_90 on any machine and lists the TMA store waits Triton placed.

Unshipped experiment, kept as evidence (README.md, "The MLP kernel", 2): TMA epilogue stores in the shipped kernel
of that time; bitwise the same outputs, slower at every stage count (mlp_tma_stores.txt); not shipped.
Self-contained: the shipped kernel is copied in mlp_snapshot.py and the descriptor epilogue below, this folder.
"""
import re
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import mlp_snapshot as snapshot  # this folder's copy of the shipped kernel of that time


@triton.jit
def _epi(h, pre_desc, out_desc, m0, n0, BACKWARD: tl.constexpr):
    """The shipped epilogue's math, stored through descriptors (as bench/mlp_tiles.py's _tma_epilogue had it)."""
    hf = h.to(tl.float32)
    if BACKWARD:
        pre = pre_desc.load([m0, n0]).to(tl.float32)
        out_desc.store([m0, n0], (2.0 * hf * tl.maximum(pre, 0.0)).to(tl.bfloat16))
    else:
        pre_desc.store([m0, n0], h)
        r = tl.maximum(hf, 0.0)
        out_desc.store([m0, n0], (r * r).to(tl.bfloat16))


@triton.jit
def _k(a_ptr, b_ptr, pre_desc, out_desc, M, N, K, stride_am, stride_bn, BACKWARD: tl.constexpr, BLOCK_M: tl.constexpr,
       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, SPLIT: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_steps = K // BLOCK_K
    rk = tl.arange(0, BLOCK_K)
    stored = tl.program_id(0) - tl.num_programs(0)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = snapshot._grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        a_ptrs = a_ptr + (rows % M).to(tl.int64)[:, None] * stride_am + rk[None, :]
        b_ptrs = b_ptr + (cols % N).to(tl.int64)[:, None] * stride_bn + rk[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, k_steps):
            acc = tl.dot(tl.load(a_ptrs + k * BLOCK_K), tl.trans(tl.load(b_ptrs + k * BLOCK_K)), acc)
        stored += tl.num_programs(0)
        pid_m, pid_n = snapshot._grouped_tile(stored, num_pid_m, num_pid_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        h = acc.to(tl.bfloat16)
        if SPLIT:
            HALF: tl.constexpr = BLOCK_N // 2
            h0, h1 = tl.split(tl.permute(tl.reshape(h, (BLOCK_M, 2, HALF)), (0, 2, 1)))
            _epi(h0, pre_desc, out_desc, m0, n0, BACKWARD)
            _epi(h1, pre_desc, out_desc, m0, n0 + HALF, BACKWARD)
        else:
            _epi(h, pre_desc, out_desc, m0, n0, BACKWARD)

def launch(a, b, pre, out, backward, tiles, split):
    bm, bn, bk, g, warps, stages, flatten = tiles
    M, K = a.shape; N = b.shape[0]
    eb = [bm, bn // 2 if split else bn]
    pd = TensorDescriptor.from_tensor(pre, eb); od = TensorDescriptor.from_tensor(out, eb)
    grid = (min(snapshot._num_programs_persistent(a.device), triton.cdiv(M, bm) * triton.cdiv(N, bn)),)
    _k[grid](a, b, pd, od, M, N, K, a.stride(0), b.stride(0), BACKWARD=backward, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
             GROUP_M=g, FLATTEN=flatten, SPLIT=split, num_warps=warps, num_stages=stages)

if __name__ == "__main__" and "--compile" in sys.argv:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type
    h = torch.zeros(256, 3072, dtype=torch.bfloat16)
    for split in (False, True):
      for bwd in (False, True):
        eb = [128, 128 if split else 256]
        d = mangle_type(TensorDescriptor.from_tensor(h, eb))
        sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "pre_desc": d, "out_desc": d, "M": "i32", "N": "i32", "K": "i32",
               "stride_am": "i32", "stride_bn": "i32"}
        consts = dict(BACKWARD=bwd, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, FLATTEN=True, SPLIT=split)
        for c in consts: sig[c] = "constexpr"
        attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 7, 8)}
        k = triton.compile(ASTSource(fn=_k, signature=sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 8, "num_stages": 3})
        ttg = k.asm["ttgir"]
        waits = re.findall(r"async_tma_store_wait[^\n]*", ttg)
        print("split", split, "bwd", bwd, "shared", k.metadata.shared, "tma store waits:", waits[:4], "stores", ttg.count("async_tma_copy_local_to_global"))
        
if __name__ == "__main__" and "--compile" not in sys.argv:
    from triton.testing import do_bench
    print(torch.cuda.get_device_name(), triton.__version__)
    gen = torch.Generator(device="cuda").manual_seed(0)
    warm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(400): warm @ warm
    T = snapshot._MLP_TILES
    variants = [("shipped", lambda *a: snapshot._launch_relu2_linear(*a[:4], False, None),
                 lambda *a: snapshot._launch_relu2_linear(*a[:4], True, None))]
    for tiles in (T, (128, 256, 64, 8, 8, 4, True), (128, 256, 64, 8, 8, 2, True)):
        for split in (False, True):
            variants.append((f"tma-store {tiles[5]}st split={split}", lambda x, w, p, o, t=tiles, s=split: launch(x, w, p, o, False, t, s),
                             lambda x, w, p, o, t=tiles, s=split: launch(x, w, p, o, True, t, True)))
    for M in (32768, 49152):
        x = torch.randn(M, 768, device="cuda", generator=gen).bfloat16()
        g = torch.randn(M, 768, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(3072, 768, device="cuda", generator=gen) / 768 ** 0.5).bfloat16()
        ref = None
        for label, f, b in variants:
            pre, post, d = (torch.full((M, 3072), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(3))
            try:
                f(x, w, pre, post); b(g, w, pre, d); torch.cuda.synchronize()
                outs = (pre.clone(), post.clone(), d.clone())
                ref = ref or outs
                same = all(torch.equal(u, v) for u, v in zip(outs, ref))
                tf = min(do_bench(lambda: f(x, w, pre, post), warmup=25, rep=100, return_mode="median") for _ in range(2))
                tb = min(do_bench(lambda: b(g, w, pre, d), warmup=25, rep=100, return_mode="median") for _ in range(2))
                print(f"{M} {label:<32} fwd {tf:.4f} bwd {tb:.4f} {'same' if same else 'DIFFERS'}", flush=True)
            except Exception as e:
                print(f"{M} {label:<32} failed {type(e).__name__}: {str(e)[:200]}", flush=True)
