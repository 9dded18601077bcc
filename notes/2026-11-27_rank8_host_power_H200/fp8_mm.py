"""Could a Triton kernel write the FP8 LM head's logits faster than torch._scaled_mm? Times a persistent FP8 matmul
with a bf16 output over candidate tiles, beside cuBLAS doing the same product, at the head's forward shapes.

    git worktree add /tmp/at-607bdec 607bdec   # the code it measured (PINNED_COMMIT): it imports its modules
    python3 notes/2026-11-27_rank8_host_power_H200/fp8_mm.py --repo=/tmp/at-607bdec [--only=TEXT]

One CUDA GPU, about half a minute. Rows of 16,384 / 32,768 / 49,152 tokens (the micro-batches of the three batch
phases), K = 768 (the model dim), N = 50,304 (the vocabulary), e4m3 operands made with the head's x and w scales. GPU
time is the median of triton.testing.do_bench, the better of two rounds. Each variant's output is compared bit for
bit with torch._scaled_mm's, and its largest error against the float64 product of the first 4,096 rows is printed
beside cuBLAS's. The kernel lives here, not in triton_kernels.py: at best it matched cuBLAS
(notes/2026-11-27_rank8_host_power_H200).
"""
from __future__ import annotations

import argparse
import os
import sys

# The code this script measured. It imports that code from a checkout of this commit (--repo), never from the
# tree around it, whose names have moved on since.
PINNED_COMMIT = "607bdec0d4b634d49f5924ea8acac0fd6e33fc33"


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
import triton.language as tl  # noqa: E402

import triton_kernels as tk  # noqa: E402

ROWS = (16384, 32768, 49152)
K, N = 768, 50304
# ((BM, BN, BK, GROUP_M, warps, stages), warp_specialize, split, flatten). Warp specialisation takes 4 warps (one
# loading warpgroup, two computing); without it, 8 warps share the roles. split=2 stores each tile as two halves;
# flatten pipelines the tile loop with its K loop (the next tile's loads start under this tile's stores). Under
# triton 3.6, warp specialisation with split stores failed to compile.
CANDIDATES = [((128, 256, 128, 8, 8, 3), False, 1, False), ((128, 256, 128, 8, 4, 3), True, 1, False),
              ((128, 256, 128, 32, 4, 3), True, 1, False), ((128, 128, 128, 8, 4, 4), True, 1, False),
              ((128, 256, 128, 8, 8, 3), False, 2, False), ((128, 256, 128, 8, 8, 3), False, 2, True),
              ((128, 256, 128, 16, 8, 3), False, 2, True), ((128, 256, 128, 8, 8, 4), False, 2, True),
              ((256, 128, 128, 8, 8, 3), False, 2, True), ((128, 128, 128, 8, 4, 4), False, 1, True)]
INTERPRETER_TILES = (16, 32, 16, 2, 4, 2)


@triton.jit
def _fp8_mm_kernel(a_ptr, b_ptr, out_ptr, M, N, K, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                   SPLIT: tl.constexpr, FLATTEN: tl.constexpr):
    """Persistent out = bf16(fp32(a @ b.T) * scale), a (M, K) and b (N, K) K-major, every load and store by TMA
    (out-of-range rows and columns load as zeros and are not stored); K a multiple of BLOCK_K."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[N, 1],
                                         block_shape=[BLOCK_M, BLOCK_N // SPLIT])
    scale = tl.cast(scale, tl.float32)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0),
                         warp_specialize=WARP_SPECIALIZE, flatten=FLATTEN):
        pid_m, pid_n = tk._grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K // BLOCK_K):
            a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            b = b_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        out = (acc * scale).to(out_ptr.dtype.element_ty)
        if SPLIT == 2:   # two (BLOCK_M, BLOCK_N / 2) stores: half the shared memory for the staging buffer
            left, right = out.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1).split()
            out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], left)
            out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], right)
        else:
            out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], out)


def fp8_mm(a: torch.Tensor, b: torch.Tensor, scale: float, tiles: tuple, warp_specialize: bool = False,
           split: int = 1, flatten: bool = False) -> torch.Tensor:
    """a (M, K), b (N, K), contiguous, e4m3 (float32 holding e4m3 values under the interpreter) -> bf16(a @ b.T *
    fp32(scale)) (M, N) (float32 for float32 inputs). K must be a multiple of tiles' BK, and K and N make whole
    16-byte rows."""
    M, k_dim = a.shape
    n_dim = b.shape[0]
    bm, bn, bk, group_m, warps, stages = tiles
    if k_dim % bk or (k_dim * a.element_size()) % 16:
        raise ValueError(f"K ({k_dim}) must be a multiple of {bk} and make whole 16-byte rows")
    out = torch.empty((M, n_dim), dtype=torch.float32 if a.dtype == torch.float32 else torch.bfloat16,
                      device=a.device)
    if (n_dim * out.element_size()) % 16:
        raise ValueError(f"N ({n_dim}) must make whole 16-byte output rows")
    if a.is_cuda:
        triton.set_allocator(tk._descriptor_scratch)
    launch = dict(num_warps=warps, num_stages=stages) if a.is_cuda else {}
    grid = (min(tk._num_programs_persistent(a.device), triton.cdiv(M, bm) * triton.cdiv(n_dim, bn)),)
    _fp8_mm_kernel[grid](a, b, out, M, n_dim, k_dim, scale, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m,
                         WARP_SPECIALIZE=warp_specialize and a.is_cuda, SPLIT=split, FLATTEN=flatten and a.is_cuda,
                         **launch)
    return out


def name(tiles, ws, split, flatten) -> str:
    bm, bn, bk, group_m, warps, stages = tiles
    return (f"{'ws ' if ws else ''}{'flat ' if flatten else ''}{bm}x{bn}x{bk} g{group_m} w{warps} s{stages}"
            f"{f' split{split}' if split > 1 else ''}")


def main(argv):
    from triton.testing import do_bench

    import train_gpt
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="time only the variants whose label contains this text")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: fp8_mm.py times CUDA kernels and found no GPU; run it on a GPU machine", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; ms per call")
    s_x, s_w = train_gpt.Hyperparameters().fp8_scales[:2]
    scale = train_gpt.fp8_scale_product(s_x, s_w)
    one = dict(dtype=torch.float32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    warm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(400):  # ~1 s of matmuls first: the first rows were timed at idle clocks otherwise
        warm @ warm
    del warm
    print(f"{'rows':>6} {'variant':<32} {'ms':>8} {'TFLOP/s':>8} {'max err':>9}  vs cuBLAS")
    for M in ROWS:
        h = torch.randn(M, K, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(N, K, device="cuda", generator=gen) * 0.02).bfloat16()
        a = train_gpt.fp8_quantize(h, s_x, torch.float8_e4m3fn)
        b = train_gpt.fp8_quantize(w, s_w, torch.float8_e4m3fn)
        flops = 2 * M * K * N

        def cublas():
            return torch._scaled_mm(a, b.t(), scale_a=torch.full((), s_x, **one), scale_b=torch.full((), s_w, **one),
                                    out_dtype=torch.bfloat16, use_fast_accum=True)
        ref = cublas()
        first = slice(0, 4096)  # the float64 product of these rows only, to bound the memory
        exact = (a[first].double() @ b.double().T) * scale
        err_ref = (ref[first].double() - exact).abs().max().item()
        t = min(do_bench(cublas, warmup=25, rep=100, return_mode="median") for _ in range(2))
        print(f"{M:>6} {'torch._scaled_mm (cuBLAS)':<32} {t:>8.4f} {flops / t / 1e9:>8.1f} {err_ref:>9.3g}", flush=True)
        for tiles, ws, split, flatten in CANDIDATES:
            label = name(tiles, ws, split, flatten)
            if args.only and args.only not in label:
                continue
            out = None
            try:
                out = fp8_mm(a, b, scale, tiles, ws, split, flatten)
                torch.cuda.synchronize()
                diff = out.float() != ref.float()
                same = "same" if not diff.any() else (
                    f"differs in {int(diff.sum())} elements, max |diff| {(out.float() - ref.float()).abs().max():.3g}")
                err = (out[first].double() - exact).abs().max().item()
                t = min(do_bench(lambda: fp8_mm(a, b, scale, tiles, ws, split, flatten), warmup=25, rep=100,
                                 return_mode="median") for _ in range(2))
                print(f"{M:>6} {label:<32} {t:>8.4f} {flops / t / 1e9:>8.1f} {err:>9.3g}  {same}", flush=True)
            except Exception as e:  # noqa: BLE001 - one failed candidate must not end the table
                print(f"{M:>6} {label:<32} failed: {str(e).splitlines()[0][:100]}", flush=True)
            del out
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
