"""Time the fused linear + ReLU^2 kernel (triton_kernels.py section 3) at the training shapes, over candidate tiles,
beside cuBLAS doing the same matmul alone and, with --root, the kernel of another checkout: the basis of the
launcher's fixed tiles (_MLP_TILES, marked "<-"; the fastest is marked "*").

    python3 bench/mlp_tiles.py [--root=DIR] [--only=TEXT]

One CUDA GPU, about a minute. Rows of 16,384 / 32,768 / 49,152 tokens (the micro-batches of the three batch phases),
model dim 768, hidden 3072. "fwd" writes pre and post; "bwd" reads pre and writes dpre. GPU time is the median of
triton.testing.do_bench. Every variant's outputs are compared bit for bit with the first variant's (the checkout's
with --root, else the trainer's tiles); "differs" marks a difference, and stderr says in how many elements.
--root times that checkout's relu2_mlp_fwd_triton / relu2_mlp_bwd_triton as its trainer runs them (a baseline made
with `git worktree`); --only keeps the variants whose label contains TEXT (and the trainer's).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton_kernels as tk  # noqa: E402

ROWS = (16384, 32768, 49152)
D, HIDDEN = 768, 3072
# ((BM, BN, BK, GROUP_M, warps, stages), warp_specialize). Warp specialisation takes 4 warps (Triton makes them 12:
# one loading warpgroup, two computing); without it, 8 warps share the roles. 128 x 128 with 5 stages is left out:
# under triton 3.6 it came out wrong warp-specialised.
CANDIDATES = [(tk._MLP_TILES, True), ((128, 256, 64, 8, 4, 4), True), ((256, 128, 64, 8, 4, 3), True),
              ((128, 128, 64, 8, 4, 4), True), ((128, 256, 64, 4, 4, 3), True), ((128, 256, 64, 16, 4, 3), True),
              ((128, 256, 64, 8, 8, 3), False), ((128, 256, 64, 8, 8, 4), False)]


def load_kernels(root: str):
    spec = importlib.util.spec_from_file_location("baseline_triton_kernels", os.path.join(root, "triton_kernels.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def name(tiles, ws) -> str:
    bm, bn, bk, group_m, warps, stages = tiles
    return f"{'ws ' if ws else ''}{bm}x{bn}x{bk} g{group_m} w{warps} s{stages}"


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default="", help="also time the kernel of this checkout")
    ap.add_argument("--only", default="", help="time only the variants whose label contains this text")
    args = ap.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; ms per call")
    variants = []  # (label, fwd(x, w, pre, post), bwd(g, w, pre, dpre))
    for tiles, ws in CANDIDATES:
        label = name(tiles, ws) + (" <-" if (tiles, ws) == (tk._MLP_TILES, True) else "")
        if args.only and args.only not in label and not label.endswith("<-"):
            continue
        variants.append((label,
                         lambda x, w, pre, out, t=tiles, ws=ws: tk._launch_relu2_linear(x, w, pre, out, False, t, ws),
                         lambda g, w, pre, out, t=tiles, ws=ws: tk._launch_relu2_linear(g, w, pre, out, True, t, ws)))
    if args.root:
        base = load_kernels(args.root)

        # its launchers allocate their outputs (the caching allocator makes that free); the last call's results
        # are copied out once for the comparison
        def base_fwd(x, w, pre, out, keep=False):
            p, o = base.relu2_mlp_fwd_triton(x, w)
            if keep:
                pre.copy_(p), out.copy_(o)

        def base_bwd(g, w, pre, out, keep=False):
            d = base.relu2_mlp_bwd_triton(g, w, pre)
            if keep:
                out.copy_(d)
        variants.insert(0, (f"checkout {args.root}", base_fwd, base_bwd))

    gen = torch.Generator(device="cuda").manual_seed(0)
    warm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(400):  # ~1 s of matmuls first: the first rows were timed at idle clocks otherwise
        warm @ warm
    del warm
    rows = []
    for M in ROWS:
        x = torch.randn(M, D, device="cuda", generator=gen).bfloat16()
        g = torch.randn(M, D, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(HIDDEN, D, device="cuda", generator=gen) / D ** 0.5).bfloat16()
        flops = 2 * M * D * HIDDEN
        cublas = do_bench(lambda: x @ w.T, warmup=25, rep=100, return_mode="median")
        rows.append((M, "cuBLAS x @ w.T alone", cublas, float("nan"), flops, ""))
        ref = None
        for label, fwd, bwd in variants:
            keep = {"keep": True} if label.startswith("checkout") else {}
            pre, post, dpre = (torch.full((M, HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
                               for _ in range(3))
            try:
                fwd(x, w, pre, post, **keep)
                bwd(g, w, pre, dpre, **keep)
                torch.cuda.synchronize()
                outs = (pre.clone(), post.clone(), dpre.clone())
                if ref is None:
                    ref = outs
                same = all(torch.equal(a, b) for a, b in zip(outs, ref))
                if not same:
                    print(f"  {M} {label}: differs from the first variant in " + ", ".join(
                        f"{n} {int((a != b).sum())} elements" for n, a, b in zip(("pre", "post", "dpre"), outs, ref)),
                        file=sys.stderr, flush=True)
                # two rounds, the better median of each: one round's medians moved by up to 2x at 16k rows
                t_f = min(do_bench(lambda: fwd(x, w, pre, post), warmup=25, rep=100, return_mode="median")
                          for _ in range(2))
                t_b = min(do_bench(lambda: bwd(g, w, pre, dpre), warmup=25, rep=100, return_mode="median")
                          for _ in range(2))
                rows.append((M, label, t_f, t_b, flops, "" if same else "differs"))
            except Exception as e:  # noqa: BLE001 - one failed candidate must not end the table
                rows.append((M, label, float("nan"), float("nan"), flops, f"failed: {str(e).splitlines()[0][:80]}"))
            print(f"  {M} {label}: done", file=sys.stderr, flush=True)
    print(f"{'rows':>6} {'variant':<44} {'fwd ms':>8} {'bwd ms':>8} {'fwd TF/s':>9} {'bwd TF/s':>9}")
    for M in ROWS:
        mine = [r for r in rows if r[0] == M and not r[1].startswith(("cuBLAS", "checkout"))]
        best_f = min((r[2] for r in mine if r[2] == r[2]), default=None)
        best_b = min((r[3] for r in mine if r[3] == r[3]), default=None)
        for m, label, t_f, t_b, flops, note in (r for r in rows if r[0] == M):
            mark_f = "*" if t_f == best_f else " "
            mark_b = "*" if t_b == best_b else " "
            print(f"{m:>6} {label:<44} {t_f:>7.4f}{mark_f} {t_b:>7.4f}{mark_b} {flops / t_f / 1e9:>9.1f} "
                  f"{flops / t_b / 1e9:>9.1f} {note}")


if __name__ == "__main__":
    main(sys.argv[1:])
