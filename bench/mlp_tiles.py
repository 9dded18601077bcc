"""Time the fused linear + ReLU^2 kernel (triton_kernels.py section 3) at the training shapes, over candidate tiles,
beside cuBLAS doing the same matmul alone and, with --root, the kernel of another checkout: the basis of the
launcher's fixed tiles (_MLP_TILES, marked "<-"; the fastest is marked "*").

    python3 bench/mlp_tiles.py [--root=DIR] [--tma]

One CUDA GPU, about a minute. Rows of 16,384 / 32,768 / 49,152 tokens (the micro-batches of the three batch phases),
model dim 768, hidden 3072. "fwd" writes pre and post; "bwd" reads pre and writes dpre. GPU time is the median of
triton.testing.do_bench. Every variant's outputs are compared bit for bit with the first variant's (the checkout's
with --root; "differs" marks a difference).
--root times that checkout's relu2_mlp_fwd_triton / relu2_mlp_bwd_triton as its trainer runs them (a baseline made
with `git worktree`); --tma adds an experimental variant whose operands are loaded through on-device tensor
descriptors (TMA), defined here, to see what TMA would buy.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton_kernels as tk  # noqa: E402

ROWS = (16384, 32768, 49152)
D, HIDDEN = 768, 3072
# (BM, BN, BK, GROUP_M, warps, stages, flatten)
CANDIDATES = [(128, 256, 64, 8, 8, 3, True), (128, 256, 64, 8, 8, 3, False), (128, 256, 64, 8, 8, 4, True),
              (128, 256, 64, 8, 8, 4, False), (128, 256, 64, 8, 8, 2, True), (128, 128, 64, 8, 8, 4, True),
              (128, 128, 64, 8, 4, 4, True), (128, 128, 64, 8, 4, 5, True), (256, 128, 64, 8, 8, 3, True),
              (128, 256, 64, 4, 8, 3, True), (128, 256, 64, 16, 8, 3, True)]
# (tiles, programs per SM): two resident programs per SM, so that one's epilogue stores overlap the other's
# matmul; tiles that fit twice in shared memory (<= 113 KiB) and the register file
TWO_PER_SM = [((128, 128, 64, 8, 4, 3, False), 2), ((128, 128, 64, 8, 4, 3, True), 2),
              ((128, 128, 64, 8, 4, 2, True), 2), ((128, 128, 64, 8, 8, 3, False), 2),
              ((128, 128, 64, 8, 4, 3, False), 1)]
# (tiles, warp_specialize): on sm_90 triton 3.9 ignores warp_specialize here (the same shared memory, no
# setmaxnreg in the PTX), so only the plain loops are listed; the flag stays for later Triton versions
TMA_CANDIDATES = [((128, 256, 64, 8, 8, 3, True), False), ((128, 256, 64, 8, 8, 4, True), False),
                  ((128, 128, 64, 8, 4, 4, True), False)]


@triton.jit
def _relu2_linear_tma_kernel(a_ptr, b_ptr, pre_ptr, out_ptr, M, N, K, BACKWARD: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr):
    """The same math as tk._relu2_linear_kernel (contiguous operands), operands through tensor descriptors and the
    epilogue in two column halves."""
    HALF: tl.constexpr = BLOCK_N // 2
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    pre_desc = tl.make_tensor_descriptor(pre_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, HALF])
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, HALF])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    stored = tl.program_id(0) - tl.num_programs(0)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=FLATTEN, warp_specialize=WS):
        pid_m, pid_n = tk._grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K // BLOCK_K):
            a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            b = b_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        stored += tl.num_programs(0)
        pid_m, pid_n = tk._grouped_tile(stored, num_pid_m, num_pid_n, GROUP_M)
        h = acc.to(tl.bfloat16)
        h0, h1 = tl.split(tl.permute(tl.reshape(h, (BLOCK_M, 2, HALF)), (0, 2, 1)))
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        _tma_epilogue(h0, pre_desc, out_desc, m0, n0, BACKWARD)
        _tma_epilogue(h1, pre_desc, out_desc, m0, n0 + HALF, BACKWARD)


@triton.jit
def _tma_epilogue(h, pre_desc, out_desc, m0, n0, BACKWARD: tl.constexpr):
    hf = h.to(tl.float32)
    if BACKWARD:
        pre = pre_desc.load([m0, n0]).to(tl.float32)
        out_desc.store([m0, n0], (2.0 * hf * tl.maximum(pre, 0.0)).to(tl.bfloat16))
    else:
        pre_desc.store([m0, n0], h)
        r = tl.maximum(hf, 0.0)
        out_desc.store([m0, n0], (r * r).to(tl.bfloat16))


def launch_tma(a, b, pre, out, backward, tiles, ws):
    bm, bn, bk, group_m, warps, stages, flatten = tiles
    M, K = a.shape
    N = b.shape[0]
    grid = (min(tk._num_programs_persistent(a.device), triton.cdiv(M, bm) * triton.cdiv(N, bn)),)
    _relu2_linear_tma_kernel[grid](a, b, pre, out, M, N, K, BACKWARD=backward, BLOCK_M=bm, BLOCK_N=bn,
                                   BLOCK_K=bk, GROUP_M=group_m, FLATTEN=flatten, WS=ws, num_warps=warps,
                                   num_stages=stages)


def load_kernels(root: str):
    spec = importlib.util.spec_from_file_location("baseline_triton_kernels", os.path.join(root, "triton_kernels.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def name(tiles) -> str:
    bm, bn, bk, group_m, warps, stages, flatten = tiles
    return f"{bm}x{bn}x{bk} g{group_m} w{warps} s{stages}{' flat' if flatten else ''}"


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default="", help="also time the kernel of this checkout")
    ap.add_argument("--tma", action="store_true", help="also time the tensor-descriptor variant defined here")
    args = ap.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; ms per call")
    variants = []  # (label, fwd(x, w, pre, post), bwd(g, w, pre, dpre))
    for tiles in CANDIDATES:
        variants.append((name(tiles) + (" <-" if tiles == tk._MLP_TILES else ""),
                         lambda x, w, pre, out, t=tiles: tk._launch_relu2_linear(x, w, pre, out, False, t),
                         lambda g, w, pre, out, t=tiles: tk._launch_relu2_linear(g, w, pre, out, True, t)))
    sms = tk._num_programs_persistent(torch.device("cuda"))
    for tiles, per_sm in TWO_PER_SM:
        def with_programs(fn, n=per_sm * sms):
            def call(*a):
                saved = tk._num_programs_persistent
                tk._num_programs_persistent = lambda device: n
                try:
                    fn(*a)
                finally:
                    tk._num_programs_persistent = saved
            return call
        fwd = with_programs(lambda x, w, pre, out, t=tiles: tk._launch_relu2_linear(x, w, pre, out, False, t))
        bwd = with_programs(lambda g, w, pre, out, t=tiles: tk._launch_relu2_linear(g, w, pre, out, True, t))
        variants.append((f"{per_sm}/SM " + name(tiles), fwd, bwd))
    if args.tma:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        for tiles, ws in TMA_CANDIDATES:
            variants.append((f"tma{' ws' if ws else ''} " + name(tiles),
                             lambda x, w, pre, out, t=tiles, ws=ws: launch_tma(x, w, pre, out, False, t, ws),
                             lambda g, w, pre, out, t=tiles, ws=ws: launch_tma(g, w, pre, out, True, t, ws)))
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
