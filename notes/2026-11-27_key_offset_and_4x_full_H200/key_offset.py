"""Time the key offset inside the q/k norm + rotary kernels against the shift as a compiled step after them.

    python3 notes/2026-11-27_key_offset_and_4x_full_H200/key_offset.py [--tokens=49152]

One CUDA GPU, about a minute. A key-offset layer (normal, long window) takes a quarter of each half of k from the
previous token. Until the kernels did it (triton_kernels.py section 9, KEY_OFFSET), the trainer applied
tk.shift_keys_by_one to the kernel's k and inductor compiled the shift and its backward as kernels of their own. For
each of three variants, compiled as the model compiles them, this prints the forward and the forward + backward
through qkv (incoming gradients for q, k and v, as attention gives them): the kernels without any shift, the kernels
then the compiled shift, the kernels with the shift inside. Two measures of each: the median wall ms per call
(do_bench), which at these sizes can be the host's time to launch rather than the GPU's, and the GPU's kernel ms per
call, summed from a profiler trace (bench/attention.py's gpu_kernel_ms). It checks that the last two variants give
the same q, k and d(qkv) bit for bit.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from triton.testing import do_bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # notes/<folder>/ -> repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
import train_gpt as tg  # noqa: E402
import triton_kernels as tk  # noqa: E402
from attention import gpu_kernel_ms  # noqa: E402  (bench/attention.py)


def variant(name: str):
    def run(qkv, cos, sin):
        if name == "no shift":
            return tk.qk_norm_rotary_triton(qkv, cos, sin, 1)
        if name == "compiled shift after":
            q, k, v = tk.qk_norm_rotary_triton(qkv, cos, sin, 1)
            return q, tk.shift_keys_by_one(k), v
        return tk.qk_norm_rotary_triton(qkv, cos, sin, 1, key_offset=True)
    return run


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=49152, help="tokens per micro-batch (phase 3: 393,216 / 8)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("error: key_offset.py times CUDA kernels and found no GPU; run it on the device")
    hp = tg.Hyperparameters()
    H, hd, D, T = hp.num_heads, hp.head_dim, hp.model_dim, args.tokens
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    cos, sin = tg.rotary_tables(tg.rotary_base_omega(hd, hp.rope_base, device), T)
    qkv = torch.randn(T, 3 * D, device=device, generator=gen).bfloat16().requires_grad_()
    grads = [torch.randn(T, H, hd, device=device, generator=gen).bfloat16() for _ in range(3)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {T} tokens, {H} heads of {hd}")
    print(f"{'variant':<22} {'fwd ms':>7} {'fwd+bwd ms':>10} {'GPU fwd ms':>10} {'GPU fwd+bwd ms':>14}")
    results = {}
    for name in ("no shift", "compiled shift after", "shift in the kernels"):
        torch._dynamo.reset()
        compiled = torch.compile(variant(name), fullgraph=True, dynamic=False)

        def fwd():
            return compiled(qkv, cos, sin)

        def fwd_bwd():
            q, k, v = compiled(qkv, cos, sin)
            return (q, k, *torch.autograd.grad((q, k, v), qkv, grads))

        q, k, dqkv = fwd_bwd()
        results[name] = (q.detach(), k.detach(), dqkv)
        t_f, t_fb = (do_bench(fn, warmup=25, rep=200, return_mode="median") for fn in (fwd, fwd_bwd))
        k_f, k_fb = (sum(gpu_kernel_ms(fn).values()) for fn in (fwd, fwd_bwd))
        print(f"{name:<22} {t_f:>7.3f} {t_fb:>10.3f} {k_f:>10.3f} {k_fb:>14.3f}")
    same = [torch.equal(a, b) for a, b in zip(results["compiled shift after"], results["shift in the kernels"])]
    print("compiled shift after == shift in the kernels, bit for bit (q, k, d(qkv)):", same)
    if not all(same):
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
