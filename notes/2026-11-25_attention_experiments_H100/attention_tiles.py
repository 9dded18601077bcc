"""Time the Triton attention kernels (triton_kernels.py section 8) per fixed launch config at the
training shapes, against torch's varlen_attn, to choose the tiles (one GPU). Times are GPU kernel
time (bench/attention.py's gpu_ms).

On a checkout of the commit it was run with (PINNED_COMMIT), whose triton_kernels.py and bench/attention.py it
imports:

    git worktree add /tmp/at-461ec8b 461ec8b
    python3 notes/2026-11-25_attention_experiments_H100/attention_tiles.py --repo=/tmp/at-461ec8b   # the default shapes
    python3 notes/2026-11-25_attention_experiments_H100/attention_tiles.py --repo=/tmp/at-461ec8b \
        --shapes=49152:normal:768

Shapes are T:layout:window (normal: (T, 6, 128); paired: (2T, 3, 128) with cu_seqlens * 2), on the
FineWeb-like documents of bench/attention.py. Prints, per shape: varlen_attn's forward and
backward, then every forward config, the backward with every dQ config (first dK/dV config), and
with every dK/dV config (best dQ config). Backward times exclude the forward.
"""
import argparse
import os
import sys

# The code this script measured. It imports that code from a checkout of this commit (--repo), never from the
# tree around it, whose names have moved on since.
PINNED_COMMIT = "461ec8b1a26292cbd16698628a41b7e2eee902ac"


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
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

import torch  # noqa: E402

import attention as bench_attention  # noqa: E402  (bench/attention.py)
from attention import gpu_ms  # noqa: E402
import triton_kernels as tk  # noqa: E402

# (BLOCK_M, BLOCK_N, num_warps, num_stages); the shipped config first in each list
FWD = [(64, 32, 4, 3), (64, 32, 4, 2), (64, 32, 4, 4), (64, 32, 8, 3), (32, 32, 4, 3), (64, 64, 4, 3),
       (64, 64, 4, 2), (64, 64, 8, 3), (128, 32, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)]
DKDV = [(32, 64, 4, 3), (32, 64, 4, 2), (32, 64, 4, 4), (32, 64, 8, 3), (16, 64, 4, 3), (64, 64, 4, 3),
        (32, 128, 8, 3), (64, 128, 8, 3)]
DQ = [(64, 32, 4, 3), (64, 32, 4, 2), (64, 32, 4, 4), (64, 32, 8, 3), (32, 32, 4, 3), (64, 64, 4, 3),
      (128, 64, 8, 3), (128, 32, 4, 3)]
DEFAULT_SHAPES = "49152:normal:768,49152:normal:1408,49152:paired:640,16384:normal:384"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    args = parser.parse_args()
    try:
        shapes = [bench_attention.shape_case(spec) for spec in args.shapes.split(",")]
    except ValueError as e:
        sys.exit(f"error: --shapes: {e}")
    from torch.nn.attention.varlen import varlen_attn

    device, scale = torch.device("cuda"), 0.12
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}", flush=True)
    for shape, (seq, heads, window, cu, lens) in zip(args.shapes.split(","), shapes):
        cu = cu.to(device)
        gen = torch.Generator().manual_seed(0)
        q, k, v, g = (torch.randn(seq, heads, 128, generator=gen).to(device, torch.bfloat16)
                      for _ in range(4))
        flops = 4 * bench_attention.attended_pairs(lens, window) * heads * 128   # forward
        tflops = lambda ms, mult: mult * flops / (ms * 1e-3) / 1e12  # noqa: E731
        print(f"\n{shape}: forward {flops / 1e9:.1f} GFLOP useful", flush=True)

        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        run = lambda: varlen_attn(qg, kg, vg, cu, cu, 4096, 4096, scale=scale,  # noqa: E731
                                  window_size=(window, 0))
        fwd = gpu_ms(run)
        both = gpu_ms(lambda: torch.autograd.grad(run(), (qg, kg, vg), g))
        print(f"  varlen_attn          fwd {fwd:6.3f} ms ({tflops(fwd, 1):5.0f} TFLOP/s)"
              f"  bwd {both - fwd:6.3f} ms ({tflops(both - fwd, 2.5):5.0f})  total {both:6.3f}")

        best = (float("inf"), None)
        for cfg in FWD:
            try:
                ms = gpu_ms(lambda: tk.varlen_attention_fwd_triton(q, k, v, cu, window, scale,
                                                                   tiles=cfg))
            except Exception as e:  # out of shared memory / registers for this config
                print(f"  fwd  {cfg}: failed ({type(e).__name__})")
                continue
            best = min(best, (ms, cfg))
            print(f"  fwd  {cfg}: {ms:6.3f} ms ({tflops(ms, 1):5.0f} TFLOP/s)", flush=True)
        out, lse = tk.varlen_attention_fwd_triton(q, k, v, cu, window, scale, tiles=best[1])

        def bwd(cfg, dq_cfg):
            return gpu_ms(lambda: tk.varlen_attention_bwd_triton(
                g, q, k, v, out, lse, cu, window, scale, tiles=cfg, dq_tiles=dq_cfg))

        best_dq = (float("inf"), None)
        for cfg in DQ:  # the whole backward, with the first dK/dV config
            try:
                ms = bwd(DKDV[0], cfg)
            except Exception as e:  # out of shared memory / registers for this config
                print(f"  dq   {cfg}: failed ({type(e).__name__})")
                continue
            best_dq = min(best_dq, (ms, cfg))
            print(f"  bwd  dkdv {DKDV[0]} dq {cfg}: {ms:6.3f} ms", flush=True)
        for cfg in DKDV:  # the whole backward, with the best dQ config
            try:
                ms = bwd(cfg, best_dq[1])
            except Exception as e:
                print(f"  dkdv {cfg}: failed ({type(e).__name__})")
                continue
            print(f"  bwd  dkdv {cfg} dq {best_dq[1]}: {ms:6.3f} ms "
                  f"({tflops(ms, 2.5):5.0f} TFLOP/s)", flush=True)
        print(f"  best fwd {best[1]} {best[0]:.3f} ms; best dq {best_dq[1]}", flush=True)


if __name__ == "__main__":
    main()
