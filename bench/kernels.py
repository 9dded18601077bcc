"""Benchmark the fused Triton kernels against their eager and torch.compile'd references at the training shapes.

    python3 bench/kernels.py [--out bench_kernels.txt]

Needs one CUDA GPU (~4 minutes on an H100, compiles included). It first measures two ceilings (a large bf16 matmul
in TFLOP/s, a large device-to-device copy in GB/s), then prints ONE table: op, shape, ms for kernel / eager reference
/ compiled reference, the kernel's achieved TFLOP/s (matmul ops) or GB/s (cross entropy), and that as a fraction of
the ceiling. Timings are triton.testing.do_bench medians. Each row is guarded: a failure prints an error row and the
rest continue. Compiled references use dynamic shapes (one compile per op and weight count, to fit the time budget).

FLOP and byte counts:
  xxt, ba_plus_cAA   GEMM-equivalent 2*B*M*M*K (the kernel computes only the lower triangle, so it can beat the ceiling)
  mlp fwd            2 matmuls of 2*M*768*3072; fwd+bwd: 6 of them; "mlp fwd fp8 | bf16 kernel": the FP8 forward in
                     the kernel column, the bf16 kernel in the eager column (the FP8 one must be faster)
  ce fwd             reads the bf16 logits once (n*V*2 bytes); fwd+bwd: + read again and write bf16 dlogits
  adam               per element reads bf16 param and grad, fp32 exp_avg and exp_avg_sq, writes all but grad: 22 bytes
  cautious           per element reads bf16 param, uint16 mantissa, bf16 O, writes param and mantissa: 10 bytes
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton_kernels as tk  # noqa: E402

TIME_BUDGET_S = 220  # after this, compiled-reference timings are skipped so the script ends in ~4 minutes


def bench_ms(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def measure_ceilings() -> tuple[float, float]:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    tflops = 2 * n ** 3 / bench_ms(lambda: a @ b) / 1e9
    del a, b
    src = torch.empty(2 ** 30, device="cuda", dtype=torch.uint8)  # 1 GiB
    dst = torch.empty_like(src)
    gbps = 2 * src.numel() / bench_ms(lambda: dst.copy_(src)) / 1e6
    del src, dst
    torch.cuda.empty_cache()
    return tflops, gbps


class Table:
    def __init__(self, tflops_ceiling: float, gbps_ceiling: float):
        self.ceil = {"TFLOP/s": tflops_ceiling, "GB/s": gbps_ceiling}
        self.rows: list[str] = []
        self.start = time.time()

    def over_budget(self) -> bool:
        return time.time() - self.start > TIME_BUDGET_S

    def add(self, op: str, shape: str, unit: str, amount: float, kernel, eager, compiled) -> None:
        """amount: FLOPs (unit TFLOP/s) or bytes (unit GB/s) of one call; kernel/eager/compiled: zero-arg callables."""
        try:
            cells = []
            for i, fn in enumerate((kernel, eager, compiled)):
                if i == 2 and self.over_budget():
                    cells.append("skip")
                    continue
                try:
                    cells.append(f"{bench_ms(fn):.3f}")
                except Exception as e:  # an eager OOM must not hide the kernel's number
                    cells.append(f"ERR:{type(e).__name__}")
                    torch.cuda.empty_cache()
            ms = float(cells[0])
            rate = amount / ms / (1e9 if unit == "TFLOP/s" else 1e6)
            row = f"{op:<18}{shape:<26}{cells[0]:>9} /{cells[1]:>9} /{cells[2]:>9}  {rate:8.1f} {unit:<8}" \
                  f"{rate / self.ceil[unit]:6.2f}"
        except Exception as e:
            row = f"{op:<18}{shape:<26}ERROR {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
            traceback.print_exc()
            torch.cuda.empty_cache()
        print(row, flush=True)
        self.rows.append(row)

    def render(self) -> str:
        head = (f"ceilings: bf16 matmul {self.ceil['TFLOP/s']:.0f} TFLOP/s, D2D copy {self.ceil['GB/s']:.0f} GB/s "
                f"({torch.cuda.get_device_name()}, torch {torch.__version__})\n"
                f"{'op':<18}{'shape':<26}{'ms: kernel /    eager / compiled':>31}  {'achieved':>17} {'frac':>5}")
        return "\n".join([head, *self.rows])


def bench_polar(table: Table) -> None:
    xxt_c = torch.compile(tk.xxt_reference, dynamic=True)
    ba_c = torch.compile(tk.ba_plus_cAA_reference, dynamic=True)
    b, c = -2.808917465908714, 0.5000178451051316
    for n_batch, K in [(5, 768), (3, 3072)]:
        X = torch.randn(n_batch, 768, K, device="cuda").bfloat16() / K ** 0.5
        table.add("xxt", f"{n_batch}x768x{K}", "TFLOP/s", 2 * n_batch * 768 * 768 * K,
                  lambda: tk.xxt(X), lambda: tk.xxt_reference(X), lambda: xxt_c(X))
    for n_batch in (5, 3):
        A = tk.xxt(torch.randn(n_batch, 768, 768, device="cuda").bfloat16() / 28)
        table.add("ba_plus_cAA", f"{n_batch}x768x768", "TFLOP/s", 2 * n_batch * 768 ** 3,
                  lambda: tk.ba_plus_cAA(A, b, c), lambda: tk.ba_plus_cAA_reference(A, b, c), lambda: ba_c(A, b, c))


def bench_mlp(table: Table) -> None:
    def fwd_bwd(fn):
        def run(x, c_fc, c_proj, g):
            return torch.autograd.grad(fn(x, c_fc, c_proj), (x, c_fc, c_proj), g)
        return run

    ref_c = torch.compile(tk.relu2_mlp_reference, dynamic=True)
    ref_fp8_c = torch.compile(lambda x, a, b: tk.relu2_mlp_reference(x, a, b, fp8=True), dynamic=True)
    ref_fb_c = torch.compile(fwd_bwd(tk.relu2_mlp_reference), dynamic=True)
    kern_fb, ref_fb = fwd_bwd(tk.relu2_mlp_triton), fwd_bwd(tk.relu2_mlp_reference)
    c_fc = (torch.randn(3072, 768, device="cuda") / 28).bfloat16().requires_grad_()
    c_proj = (torch.randn(3072, 768, device="cuda") / 55).bfloat16().requires_grad_()
    for M in (16384, 32768, 49152):
        x = torch.randn(M, 768, device="cuda").bfloat16().requires_grad_()
        g = torch.randn(M, 768, device="cuda").bfloat16()
        flops = 2 * 2 * M * 768 * 3072
        with torch.no_grad():
            table.add("mlp fwd", f"{M}x768->3072", "TFLOP/s", flops, lambda: tk.relu2_mlp_triton(x, c_fc, c_proj),
                      lambda: tk.relu2_mlp_reference(x, c_fc, c_proj), lambda: ref_c(x, c_fc, c_proj))
        table.add("mlp fwd+bwd", f"{M}x768->3072", "TFLOP/s", 3 * flops, lambda: kern_fb(x, c_fc, c_proj, g),
                  lambda: ref_fb(x, c_fc, c_proj, g), lambda: ref_fb_c(x, c_fc, c_proj, g))
        # the FP8 forward (its quantisation of weights and input included) against the bf16 kernel in the
        # "reference" column: it must beat it at every micro-batch of the schedule
        with torch.no_grad():
            table.add("mlp fwd fp8 | bf16 kernel", f"{M}x768->3072", "TFLOP/s", flops,
                      lambda: tk.relu2_mlp_triton(x, c_fc, c_proj, fp8=True),
                      lambda: tk.relu2_mlp_triton(x, c_fc, c_proj), lambda: ref_fp8_c(x, c_fc, c_proj))
        del x, g
        torch.cuda.empty_cache()


def bench_ce(table: Table) -> None:
    def fwd_bwd(fn):
        def run(logits, targets, w, g):
            return torch.autograd.grad(fn(logits, targets, w), logits, g)
        return run

    ref_c = torch.compile(tk.softcapped_mtp_ce_reference, dynamic=True)
    # fwd+bwd: the training loss without the FP8 head (the eval kernel has no backward)
    ref_fb_c = torch.compile(fwd_bwd(tk.softcapped_mtp_ce_train_reference), dynamic=True)
    kern_fb, ref_fb = fwd_bwd(tk.softcapped_mtp_ce_train_triton), fwd_bwd(tk.softcapped_mtp_ce_train_reference)
    V = 50304
    for n in (16384, 32768, 49152):
        logits = (torch.randn(n, V, device="cuda") * 10).bfloat16().requires_grad_()
        targets = torch.randint(0, V, (n,), device="cuda")
        g = torch.full((n,), 1 / 8, device="cuda")
        for weights in ([1.0], [1.0, 0.5], [1.0, 0.5, 0.25]):
            w = torch.tensor(weights, device="cuda")
            shape = f"{n}x{V} K={len(weights)}"
            with torch.no_grad():
                table.add("ce fwd", shape, "GB/s", n * V * 2, lambda: tk.softcapped_mtp_ce_triton(logits, targets, w),
                          lambda: tk.softcapped_mtp_ce_reference(logits, targets, w), lambda: ref_c(logits, targets, w))
            table.add("ce fwd+bwd", shape, "GB/s", 3 * n * V * 2, lambda: kern_fb(logits, targets, w, g),
                      lambda: ref_fb(logits, targets, w, g), lambda: ref_fb_c(logits, targets, w, g))
        del logits, targets, g
        torch.cuda.empty_cache()


def bench_optimizer(table: Table) -> None:
    """The optimizer's element-wise updates at the trainer's shapes (one GPU: no sharding). Each call updates its
    state in place, so repeated calls keep changing the numbers; the work per call is the same."""
    adam_c = torch.compile(tk.adam_update_reference, dynamic=True)
    kw = dict(beta1=0.5, beta2=0.95, eps=1e-10, step_size=0.008, decay=0.008 ** 2 * 0.75)
    for shape in ((50304, 768), (768, 50304)):  # embed and lm_head: bf16 tables, fp32 moments
        p = (torch.randn(shape, device="cuda") * 0.05).bfloat16()
        g = (torch.randn(shape, device="cuda") * 1e-3).bfloat16()
        m, v = torch.zeros(shape, device="cuda"), torch.zeros(shape, device="cuda")
        table.add("adam", f"{shape[0]}x{shape[1]} bf16", "GB/s", 22 * p.numel(),
                  lambda: tk.adam_update(p, g, m, v, **kw), lambda: tk.adam_update_reference(p, g, m, v, **kw),
                  lambda: adam_c(p, g, m, v, **kw))
        del p, g, m, v
        torch.cuda.empty_cache()
    cautious_c = torch.compile(tk.cautious_update_with_mantissa_reference, dynamic=True)
    # attn bank: 10 layers x 4 (768, 768) matrices, one lr; mlp bank: 24 (3072, 768) matrices, lr per matrix
    # (c_fc and c_proj multipliers alternate), O a transposed view as Polar Express returns it for tall matrices
    for n, R, C in ((40, 768, 768), (24, 3072, 768)):
        param = (torch.randn(n, R, C, device="cuda") * 0.02).bfloat16()
        mantissa = torch.randint(0, 1 << 16, (n, R, C), device="cuda", dtype=torch.int32).to(torch.uint16)
        O = (torch.randn(n, C, R, device="cuda").bfloat16().mT if R > C
             else torch.randn(n, R, C, device="cuda").bfloat16())
        lr = (torch.tensor([0.02, 0.04] * (n // 2), device="cuda").view(n, 1, 1) if R > C else 0.02)
        wd = 0.0276
        table.add("cautious", f"{n}x{R}x{C}{' O.mT' if R > C else ''}", "GB/s", 10 * param.numel(),
                  lambda: tk.cautious_update_with_mantissa(param, mantissa, O, lr=lr, wd=wd),
                  lambda: tk.cautious_update_with_mantissa_reference(param, mantissa, O, lr, wd),
                  lambda: cautious_c(param, mantissa, O, lr, wd))
        del param, mantissa, O
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA GPU; run it on the device")
    torch._dynamo.config.cache_size_limit = 64
    tflops, gbps = measure_ceilings()
    table = Table(tflops, gbps)
    print(table.render(), flush=True)
    for section in (bench_polar, bench_mlp, bench_ce, bench_optimizer):
        try:
            section(table)
        except Exception as e:  # setup failure of a whole section (e.g. OOM allocating inputs)
            row = f"{section.__name__:<18}ERROR {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
            traceback.print_exc()
            print(row, flush=True)
            table.rows.append(row)
            torch.cuda.empty_cache()
    text = table.render() + f"\ntotal {time.time() - table.start:.0f} s\n"
    print("\n" + text)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
