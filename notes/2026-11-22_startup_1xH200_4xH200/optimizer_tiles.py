"""Time candidate tiles of the optimizer's symmetric-product kernel (triton_kernels.py sections 1-2:
X X^T and b*A + c*A A) at the shapes NorMuon's Polar Express gives it (the banks' matrices on 1 GPU
and one of 8 GPUs' shares), the basis of the launcher's fixed tiles (_sym_tiles, marked "<-" below;
the fastest is marked "*"). Autotuning instead compiled and timed every candidate at every start.

Usage, on a checkout of the commit it was run with (PINNED_COMMIT), whose triton_kernels.py it imports:

    git worktree add /tmp/at-a21b0ff a21b0ff
    python3 notes/2026-11-22_startup_1xH200_4xH200/optimizer_tiles.py --repo=/tmp/at-a21b0ff [--matrices=40,22,5,3]
"""
import os
import sys

# The code this script measured. It imports that code from a checkout of this commit (--repo), never from the
# tree around it, whose names have moved on since.
PINNED_COMMIT = "a21b0ffc28ecac6da5c9373e3b58862ef62d0b21"


def pinned_checkout() -> str:
    """The checkout of PINNED_COMMIT that --repo=PATH (or --repo PATH) names, taken out of sys.argv; without one, one
    error line that names the commit to check out. Nothing heavier than os and sys is imported before it."""
    argv, repo = sys.argv[1:], None
    for i, arg in enumerate(argv):
        if arg == "--repo" or arg.startswith("--repo="):
            repo = arg[len("--repo="):] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            sys.argv[1:] = argv[:i] + argv[i + (1 if "=" in arg else 2):]
            break
    if repo is None or not os.path.isfile(os.path.join(repo, "train_gpt.py")):
        short = PINNED_COMMIT[:7]
        found = "no --repo" if repo is None else f"--repo={repo} holds no train_gpt.py"
        sys.exit(f"error: {os.path.basename(__file__)} runs on a checkout of {PINNED_COMMIT} ({found}): "
                 f"git worktree add /tmp/at-{short} {short}, then pass --repo=/tmp/at-{short}")
    return os.path.abspath(repo)


ROOT = pinned_checkout()  # the checkout's root
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

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
