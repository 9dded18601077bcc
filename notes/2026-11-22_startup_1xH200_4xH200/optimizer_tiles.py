"""Time candidate tiles of the optimizer's symmetric-product kernel (triton_kernels.py sections 1-2:
X X^T and b*A + c*A A) at the shapes NorMuon's Polar Express gives it (the banks' matrices on 1 GPU
and one of 8 GPUs' shares), the basis of the launcher's fixed tiles (_sym_tiles, marked "<-" below;
the fastest is marked "*"). Autotuning instead compiled and timed every candidate at every start.

Usage: python3 notes/2026-11-22_startup_1xH200_4xH200/optimizer_tiles.py [--matrices=40,22,5,3]
"""
import os
import sys

import torch
import triton
from triton.testing import do_bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # notes/<folder>/ -> repository
sys.path.insert(0, ROOT)
import triton_kernels as tk  # noqa: E402


# (BM, BN, BK, warps, stages)
CANDIDATES = [(128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4),
              (128, 64, 64, 4, 4), (128, 256, 64, 8, 3)]


def main(argv):
    opts = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    batches = [int(b) for b in opts.get("matrices", "40,22,5,3").split(",")]
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}; ms per call (do_bench median)")
    shapes = [("xxt", 768, 768, False), ("xxt", 768, 3072, False), ("ba_plus_cAA", 768, 768, True)]
    names = [f"{bm}x{bn}x{bk}/{w}/{s}" for bm, bn, bk, w, s in CANDIDATES]
    print(f"{'kernel':<12} {'M':>5} {'K':>5} {'B':>3}  " + "  ".join(f"{n:>17}" for n in names))
    for name, M, K, add_ba in shapes:
        for B in batches:
            A = torch.randn(B, M, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
            times = []
            for bm, bn, bk, warps, stages in CANDIDATES:
                out = torch.empty(B, M, M, device="cuda", dtype=torch.bfloat16)
                grid = (triton.cdiv(M, bm) * triton.cdiv(M, bn), B)
                args = (A, out, M, K, *A.stride(), *out.stride(), 0.5, 1.0)

                def call():
                    tk._sym_aat_kernel[grid](*args, ADD_BA=add_ba, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                             num_warps=warps, num_stages=stages)
                times.append(do_bench(call, warmup=50, rep=200))
            chosen = CANDIDATES.index(tk._sym_tiles(M, K, B, A.device))
            cells = [f"{t:.4f}{'*' if t == min(times) else ' '}{'<-' if i == chosen else '  '}"
                     for i, t in enumerate(times)]
            print(f"{name:<12} {M:>5} {K:>5} {B:>3}  " + "  ".join(f"{c:>17}" for c in cells), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
