"""Time the FP8 head's cross entropy kernels at the training shapes: the loss's forward, and the gradient kernels that
write the e5m2 gradient in both layouts the head's FP8 matmuls need (since record 80's loss both run in the training
forward; a checkout from before runs them as forward and backward).

    python3 bench/ce.py [--root=DIR] [--tiles=R:C:COLS:WARPS,...] [--digest]

One CUDA GPU, about a minute. --root imports triton_kernels.py from another checkout (a baseline made with
`git worktree` or `git archive`), so before and after run the same script; run each in its own process. A backward
that returns one layout is timed with the transpose that checkout's trainer makes: triton_kernels.transpose_bytes
where it exists, else torch.compile's; one that returns both layouts is timed alone. Rows of 16,384 / 32,768 / 49,152
tokens (the micro-batches of the three batch phases on one GPU), vocabulary 50,304, three MTP weights; GPU time is
the median of triton.testing.do_bench. --digest also prints a SHA-256 of each shape's outputs (losses, lse and both
gradient layouts), so that the runs of two checkouts show whether a change kept every bit.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

ROWS = (16384, 32768, 49152)
VOCAB = 50304
S_G = 0.75 / 448  # the FP8 head's gradient scale


def parse_tiles(text: str) -> list[tuple]:
    """Parse R:C:COLS:WARPS,... into the backward's launch tuples (BLOCK_R, BLOCK_C, columns per program or None for
    the whole row, warps)."""
    tiles = []
    for spec in filter(None, text.split(",")):
        parts = spec.split(":")
        if len(parts) != 4 or not all(p.isdigit() for p in parts) or 0 in (int(parts[0]), int(parts[1]),
                                                                            int(parts[3])):
            raise ValueError(f"{spec!r} is not R:C:COLS:WARPS with positive R, C, WARPS (COLS 0: the whole row), "
                             "e.g. 32:128:1024:4")
        rows, block, cols, warps = (int(p) for p in parts)
        tiles.append((rows, block, cols or None, warps))
    return tiles


def digest(*tensors) -> str:
    """The first 16 hex digits of a SHA-256 over the tensors' bytes, in order."""
    import torch
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent),
                    help="folder of triton_kernels.py")
    ap.add_argument("--tiles", default="",
                    help="also time the two-layout backward at these launches: BLOCK_R:BLOCK_C:columns per "
                         "program (0: the whole row):warps, comma-separated")
    ap.add_argument("--digest", action="store_true",
                    help="print a SHA-256 of each shape's outputs (compare two checkouts bit for bit)")
    args = ap.parse_args(argv)
    try:
        candidates = parse_tiles(args.tiles)
    except ValueError as e:
        print(f"error: --tiles: {e}", file=sys.stderr)
        return 2
    sys.path.insert(0, args.root)
    import torch
    from triton.testing import do_bench
    import triton_kernels as tk

    def ms(fn) -> float:
        return do_bench(fn, warmup=25, rep=100, return_mode="median")

    transpose = torch.compile(lambda q: q.t().contiguous(), dynamic=False, fullgraph=True)

    # the second layout as the trainer of that checkout makes it
    second_layout = getattr(tk, "transpose_bytes", transpose)

    new_loss = hasattr(tk, "softcapped_mtp_ce_fp8_grad_triton")   # record 80's loss (this checkout on)
    forward = tk.softcapped_mtp_ce_train_fwd_triton if new_loss else tk.softcapped_mtp_ce_fwd_triton

    def backward(grad, logits, targets, w, lse, tiles=None):
        if new_loss:
            return tk.softcapped_mtp_ce_fp8_grad_triton(logits, targets, w, lse, 1 / 8, S_G / 8, tiles=tiles)
        out = tk.softcapped_mtp_ce_bwd_fp8_triton(grad, logits, targets, w, lse, S_G, **(
            {"tiles": tiles} if tiles else {}))
        return out if isinstance(out, tuple) else (out, second_layout(out))

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, kernels from {args.root}")
    print(f"{'rows':>7} {'fwd ms':>8} {'bwd+both layouts ms':>20} {'total':>8}")
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.tensor([1.0, 0.5, 0.25], device="cuda")
    for n in ROWS:
        logits = (torch.randn(n, VOCAB, device="cuda", generator=g) * 10).bfloat16()
        targets = torch.randint(0, VOCAB, (n,), device="cuda", generator=g)
        grad = torch.full((1,), 1 / 8, device="cuda").expand(n)
        _, lse = forward(logits, targets, w)
        fwd = ms(lambda: forward(logits, targets, w))
        bwd = ms(lambda: backward(grad, logits, targets, w, lse))
        print(f"{n:>7} {fwd:8.3f} {bwd:20.3f} {fwd + bwd:8.3f}", flush=True)
        if args.digest:
            outputs = (*forward(logits, targets, w), *backward(grad, logits, targets, w, lse))
            print(f"{'':>7} sha256 of losses, lse, both gradient layouts: {digest(*outputs)}", flush=True)
        for tiles in candidates:
            t = ms(lambda: backward(grad, logits, targets, w, lse, tiles))
            print(f"{'':>7} two-layout backward {tiles}: {t:.3f} ms", flush=True)
        del logits
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
