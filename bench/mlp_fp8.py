"""The FP8 up projection (training forward) against the bf16 one at the training micro-batches: the kernel alone over
candidate tiles, cuBLAS doing the matmul alone, the quantisation, the whole MLP compiled; and whether torch.compile
quantises bit for bit as eager does.

    python3 bench/mlp_fp8.py [--only=TEXT]

One CUDA GPU, a few minutes (each compiled row compiles). Rows of 16,384 / 32,768 / 49,152 tokens, model dim 768,
hidden 3072. GPU time is the median of triton.testing.do_bench, ms. Each FP8 tile variant's pre and post are compared
bit for bit with the trainer's tiles (_MLP_FP8_TILES, marked "<-"); "differs" marks a difference.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton_kernels as tk  # noqa: E402

ROWS = (16384, 32768, 49152)
D, HIDDEN = 768, 3072
# (BM, BN, BK, GROUP_M, warps, stages); 4 warps run warp-specialised (one loading warpgroup, two computing).
FP8_CANDIDATES = [tk._MLP_FP8_TILES, (128, 256, 128, 8, 4, 3), (128, 256, 128, 8, 4, 4), (128, 256, 64, 8, 4, 4),
                  (128, 128, 128, 8, 4, 4), (128, 256, 128, 8, 8, 3), (256, 128, 128, 8, 8, 3)]


def label(tiles) -> str:
    bm, bn, bk, group_m, warps, stages = tiles
    return f"{'ws ' if warps == 4 else ''}{bm}x{bn}x{bk} g{group_m} w{warps} s{stages}"


def inputs(M: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, D, device="cuda", generator=g).bfloat16()
    c_fc = (torch.randn(HIDDEN, D, device="cuda", generator=g) / D ** 0.5).bfloat16()
    c_proj = (torch.randn(HIDDEN, D, device="cuda", generator=g) / HIDDEN ** 0.5).bfloat16()
    return x, c_fc, c_proj


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) if a.dtype == torch.float8_e4m3fn \
        else int((a != b).sum())


def compiled_quantisation() -> None:
    """Eager against compiled quantize_mlp_weight / quantize_mlp_input, with inductor's default and with
    emulate_precision_casts (inductor otherwise drops the bf16 round trip of w / s inside a fused kernel)."""
    x, c_fc, c_proj = inputs(16384, 1)
    w8, s = tk.quantize_mlp_weight(c_fc)
    x8, q = tk.quantize_mlp_input(x, s)
    for emulate in (False, True):
        torch._dynamo.reset()
        with torch._inductor.config.patch(emulate_precision_casts=emulate):
            cw8, cs = torch.compile(tk.quantize_mlp_weight)(c_fc)
            cx8, cq = torch.compile(tk.quantize_mlp_input)(x, s)
            out = torch.compile(lambda x, a, b: tk.relu2_mlp_triton(x, a, b, fp8=True))(x, c_fc, c_proj)
        want = tk.relu2_mlp_triton(x, c_fc, c_proj, fp8=True)
        err = ((out.float() - want.float()).norm() / want.float().norm()).item()
        print(f"compiled, emulate_precision_casts={emulate}: w8 differs in {mismatches(cw8, w8)} of {w8.numel()}, "
              f"s {'equal' if torch.equal(cs, s) else 'differs'}; x8 differs in "
              f"{mismatches(cx8, x8)} of {x8.numel()}, q {'equal' if torch.equal(cq, q) else 'differs'}; "
              f"the whole MLP's output {'equal' if torch.equal(out, want) else f'differs, rel. error {err:.2e}'}")
    torch._dynamo.reset()


def kernel_rows(only: str) -> None:
    print(f"\n{'up projection alone (writes pre and post)':<44}" + "".join(f"{M:>10}" for M in ROWS))
    rows: dict[str, list[str]] = {}
    x, c_fc, _ = inputs(ROWS[-1], 1)      # a second of matmuls first: the first row is timed at full clocks
    do_bench(lambda: x @ c_fc.T, warmup=1000, rep=200)
    for M in ROWS:
        x, c_fc, _ = inputs(M, 2)
        w8, s = tk.quantize_mlp_weight(c_fc)
        x8, q = tk.quantize_mlp_input(x, s)
        q = q.reshape(1)
        one = torch.ones((), device="cuda")
        bf16 = do_bench(lambda: tk.relu2_mlp_fwd_triton(x, c_fc))
        rows.setdefault("bf16 kernel (_MLP_TILES)", []).append(f"{bf16:10.3f}")
        rows.setdefault("cuBLAS bf16 x @ c_fc.T (no epilogue)", []).append(f"{do_bench(lambda: x @ c_fc.T):10.3f}")
        scaled = lambda: torch._scaled_mm(x8, w8.T, scale_a=one, scale_b=q.reshape(()), out_dtype=torch.bfloat16)
        rows.setdefault("cuBLAS e4m3 _scaled_mm (no epilogue)", []).append(f"{do_bench(scaled):10.3f}")
        want = tk.relu2_mlp_fp8_fwd_triton(x8, w8, q)
        for tiles in FP8_CANDIDATES:
            name = "fp8 kernel " + label(tiles) + (" <-" if tiles == tk._MLP_FP8_TILES else "")
            if only and only not in name and not name.endswith("<-"):
                continue
            try:
                got = tk.relu2_mlp_fp8_fwd_triton(x8, w8, q, tiles=tiles)
                same = all(torch.equal(a, b) for a, b in zip(got, want))
                ms = do_bench(lambda: tk.relu2_mlp_fp8_fwd_triton(x8, w8, q, tiles=tiles))
                cell = f"{ms:10.3f}" + ("" if same else " differs")
            except Exception as e:  # a variant that does not fit or does not compile
                cell = f"{'ERR ' + type(e).__name__:>10}"
            rows.setdefault(name, []).append(cell)
        cw = torch.compile(tk.quantize_mlp_weight)
        cx = torch.compile(tk.quantize_mlp_input, dynamic=False)
        rows.setdefault("quantise c_fc (compiled)", []).append(f"{do_bench(lambda: cw(c_fc)):10.3f}")
        rows.setdefault("quantise x (compiled)", []).append(f"{do_bench(lambda: cx(x, s)):10.3f}")
        del x, x8
        torch.cuda.empty_cache()
    for name, cells in rows.items():
        print(f"{name:<44}" + "".join(cells))


def whole_mlp() -> None:
    print(f"\n{'whole MLP, compiled (quantisation inside)':<44}" + "".join(f"{M:>10}" for M in ROWS))
    for fp8 in (False, True):
        # Both passes share the lambda's code object: without a reset their 12 graphs (2 x 3 sizes x grad mode)
        # pass dynamo's recompile limit of 8 and the last rows time eager code.
        torch._dynamo.reset()
        f = torch.compile(lambda x, a, b: tk.relu2_mlp_triton(x, a, b, fp8=fp8), dynamic=False)
        fwd, fb = [], []
        for M in ROWS:
            x, c_fc, c_proj = (t.requires_grad_() for t in inputs(M, 3))
            g = torch.randn_like(x)
            with torch.no_grad():
                fwd.append(f"{do_bench(lambda: f(x, c_fc, c_proj)):10.3f}")
            fb.append(f"{do_bench(lambda: torch.autograd.grad(f(x, c_fc, c_proj), (x, c_fc, c_proj), g)):10.3f}")
        print(f"{('fp8' if fp8 else 'bf16') + ' forward':<44}" + "".join(fwd))
        print(f"{('fp8' if fp8 else 'bf16') + ' forward + backward':<44}" + "".join(fb))


def main(argv) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="time only the FP8 tile variants whose label contains this text")
    args = ap.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; ms per call")
    compiled_quantisation()
    kernel_rows(args.only)
    whole_mlp()


if __name__ == "__main__":
    main(sys.argv[1:])
