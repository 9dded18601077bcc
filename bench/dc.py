"""Time the DC-MHA correction kernels (triton_kernels.py section 10) at the training micro-batches (one GPU).

    python3 bench/dc.py                        # T in 16384, 32768, 49152
    python3 bench/dc.py --seq_lens=49152 --split

Per T, on packed FineWeb-like documents (bench/attention.py's, cut at 2048; the correction's cost hardly depends on
them), 6 heads of 128, window 112: GPU kernel time (profiler) of the forward, the backward deterministic and by bf16
atomics (the record's way), and, for scale, the layer's attention without DC (the Triton backend at the long window
of the stage that runs at that T) forward and forward+backward. The backward times include the zeroing of dk, dv
(atomic path) and the document-bound lookup. "atomic vs det" is the relative L2 distance of the atomic backward's
dk, dv from the deterministic one's (bf16 noise is ~1e-3). The last line weighs the deterministic path's extra
time over the run by the steps at each T.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import attention as bench_attention  # noqa: E402
import triton_kernels as tk  # noqa: E402

H, D, SCALE = 6, 128, 0.12
# (T, long window in positions, training steps at that T) of record 89's stages (batch 131072 / 262144 / 393216
# over 8 GPUs: steps 0-422, 423-846, 847-1284)
STAGE_USE = {16384: (3 * 128, 423), 32768: (7 * 128, 424), 49152: (11 * 128, 438)}


def inputs(T: int, gen: torch.Generator):
    def randn(*shape):
        return torch.randn(*shape, generator=gen).cuda()
    q, k = (torch.nn.functional.rms_norm(randn(T, H, D), (D,)).bfloat16() for _ in range(2))
    v, y, grad = (randn(T, H, D).bfloat16() for _ in range(3))
    w1 = tk.dc_head_weights((1 + 0.3 * randn(T, H)).bfloat16())
    w2 = (0.1 * randn(T, H)).bfloat16()
    return y, q, k, v, w1, w2, grad


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq_lens", default="16384,32768,49152", help="comma-separated T per GPU")
    parser.add_argument("--split", action="store_true", help="also print each backward's time per kernel")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench/dc.py needs a CUDA GPU; run it on the device")
    import triton
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}", flush=True)
    rows = []
    for T in [int(t) for t in args.seq_lens.split(",")]:
        gen = torch.Generator().manual_seed(T)
        cu, lens = bench_attention.fineweb_like_cu_seqlens(T, gen)
        cu = cu.cuda()
        y, q, k, v, w1, w2, grad = inputs(T, gen)
        out, lse = tk.dc_correction_fwd_triton(y, q, k, v, w1, w2, cu, SCALE)   # compiles
        fwd_ms = bench_attention.gpu_ms(lambda: tk.dc_correction_fwd_triton(y, q, k, v, w1, w2, cu, SCALE))
        bwd = {}
        grads = {}
        for deterministic in (True, False):
            def backward():
                return tk.dc_correction_bwd_triton(grad, q, k, v, w1, w2, lse, cu, SCALE,
                                                   deterministic=deterministic)
            grads[deterministic] = backward()
            per_kernel = bench_attention.gpu_kernel_ms(backward)
            bwd[deterministic] = sum(per_kernel.values())
            if args.split:
                print(f"  T={T} backward deterministic={deterministic} per kernel (ms): " + ", ".join(
                    f"{name} {ms:.3f}" for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])))
        diff = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                   for a, b in zip(grads[False][1:3], grads[True][1:3]))
        window = STAGE_USE.get(T, (3 * 128, 0))[0]
        qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))

        def attention():
            return tk.varlen_attention_triton(qa, ka, va, cu, window, SCALE)
        attention().backward(grad)   # compiles
        attn_fwd = bench_attention.gpu_ms(attention)
        attn_fwdbwd = bench_attention.gpu_ms(lambda: torch.autograd.grad(attention(), (qa, ka, va), grad))
        rows.append((T, fwd_ms, bwd[True], bwd[False], window, attn_fwd, attn_fwdbwd, diff))
        print(f"T={T}: {len(lens)} documents; dc fwd {fwd_ms:.3f} ms, bwd deterministic {bwd[True]:.3f} ms, "
              f"bwd atomic {bwd[False]:.3f} ms; attention (window {window}) fwd {attn_fwd:.3f} ms, "
              f"fwd+bwd {attn_fwdbwd:.3f} ms; atomic vs det {diff:.1e}", flush=True)
        del y, q, k, v, w1, w2, grad, out, lse, grads, qa, ka, va
        torch.cuda.empty_cache()

    print("\n| T | dc fwd ms | dc bwd det ms | dc bwd atomic ms | attn window | attn fwd ms | attn fwd+bwd ms "
          "| atomic vs det |")
    print("|---|---|---|---|---|---|---|---|")
    for T, fwd_ms, det, atomic, window, attn_fwd, attn_fwdbwd, diff in rows:
        print(f"| {T} | {fwd_ms:.3f} | {det:.3f} | {atomic:.3f} | {window} | {attn_fwd:.3f} | {attn_fwdbwd:.3f} "
              f"| {diff:.1e} |")
    extra = [(STAGE_USE[T][1], det - atomic) for T, _, det, atomic, *_ in rows if T in STAGE_USE]
    if len(extra) == len(STAGE_USE):
        print(f"\ndeterministic minus atomic backward over the run, per GPU: "
              f"{sum(steps * ms for steps, ms in extra) / 1e3:.3f} s")


if __name__ == "__main__":
    main()
