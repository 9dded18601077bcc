"""Time the FP8 matmul with a bf16 output (triton_kernels.py section 10) at the LM head's forward shapes, over
candidate tiles, beside torch._scaled_mm (cuBLAS) doing the same product: the basis of the launcher's fixed tiles
(_FP8_MM_TILES, marked "<-"; the fastest is marked "*").

    python3 bench/fp8_mm.py [--only=TEXT]

One CUDA GPU, about a minute. Rows of 16,384 / 32,768 / 49,152 tokens (the micro-batches of the three batch phases),
K = 768 (the model dim), N = 50,304 (the vocabulary), e4m3 operands with the head's x and w scales. GPU time is the
median of triton.testing.do_bench, the better of two rounds. Every variant's output is compared bit for bit with
torch._scaled_mm's ("same" / "differs in N elements, max |diff| D"), and its largest error against the float64
product is printed beside cuBLAS's.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt  # noqa: E402
import triton_kernels as tk  # noqa: E402

ROWS = (16384, 32768, 49152)
K, N = 768, 50304
# ((BM, BN, BK, GROUP_M, warps, stages), warp_specialize): warp specialisation takes 4 warps (one loading warpgroup,
# two computing); without it, 8 warps share the roles.
CANDIDATES = [(tk._FP8_MM_TILES, False, 1, False), ((128, 256, 128, 8, 4, 3), True, 1, False),
              ((128, 256, 128, 8, 4, 3), True, 2, False), ((128, 256, 128, 16, 4, 3), True, 2, False),
              ((128, 256, 128, 32, 4, 3), True, 1, False), ((128, 256, 128, 8, 4, 4), True, 2, False),
              ((128, 256, 128, 8, 8, 3), False, 2, False), ((128, 256, 128, 8, 8, 3), False, 2, True),
              ((128, 256, 128, 16, 8, 3), False, 2, True), ((128, 256, 128, 8, 8, 4), False, 2, True),
              ((256, 128, 128, 8, 8, 3), False, 2, True), ((128, 128, 128, 8, 4, 4), False, 1, True)]


def name(tiles, ws, split, flatten) -> str:
    bm, bn, bk, group_m, warps, stages = tiles
    return (f"{'ws ' if ws else ''}{'flat ' if flatten else ''}{bm}x{bn}x{bk} g{group_m} w{warps} s{stages}"
            f"{f' split{split}' if split > 1 else ''}")


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="time only the variants whose label contains this text")
    args = ap.parse_args(argv)
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
        exact = None
        flops = 2 * M * K * N

        def cublas():
            return torch._scaled_mm(a, b.t(), scale_a=torch.full((), s_x, **one),
                                    scale_b=torch.full((), s_w, **one), out_dtype=torch.bfloat16,
                                    use_fast_accum=True)
        ref = cublas()
        rows_exact = slice(0, 4096)  # the float64 product of a slice of rows bounds the memory
        exact = (a[rows_exact].double() @ b.double().T) * scale
        err_ref = (ref[rows_exact].double() - exact).abs().max().item()
        t = min(do_bench(cublas, warmup=25, rep=100, return_mode="median") for _ in range(2))
        print(f"{M:>6} {'torch._scaled_mm (cuBLAS)':<32} {t:>8.4f} {flops / t / 1e9:>8.1f} {err_ref:>9.3g}", flush=True)
        for tiles, ws, split, flatten in CANDIDATES:
            label = name(tiles, ws, split, flatten) + (
                " <-" if (tiles, ws, split, flatten) == (tk._FP8_MM_TILES, False, 1, False) else "")
            if args.only and args.only not in label and not label.endswith("<-"):
                continue
            out = None
            try:
                out = tk.fp8_mm_triton(a, b, scale, tiles, ws, split, flatten)
                torch.cuda.synchronize()
                diff = out.float() != ref.float()
                same = "same" if not diff.any() else (
                    f"differs in {int(diff.sum())} elements, max |diff| "
                    f"{(out.float() - ref.float()).abs().max().item():.3g}")
                err = (out[rows_exact].double() - exact).abs().max().item()
                t = min(do_bench(lambda: tk.fp8_mm_triton(a, b, scale, tiles, ws, split, flatten), warmup=25, rep=100,
                                 return_mode="median") for _ in range(2))
                print(f"{M:>6} {label:<32} {t:>8.4f} {flops / t / 1e9:>8.1f} {err:>9.3g}  {same}", flush=True)
            except Exception as e:  # noqa: BLE001 - one failed candidate must not end the table
                print(f"{M:>6} {label:<32} failed: {str(e).splitlines()[0][:100]}", flush=True)
            del out


if __name__ == "__main__":
    main(sys.argv[1:])
