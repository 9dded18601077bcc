"""Time the key offset inside the q/k norm + rotary kernels against the shift as a compiled step after them.

    git worktree add /tmp/at-22973b9 22973b9   # the code it measured (PINNED_COMMIT): it imports its modules
    python3 notes/2026-11-27_key_offset_and_4x_full_H200/key_offset.py --repo=/tmp/at-22973b9 [--tokens=49152]

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

# The code this script measured. It imports that code from a checkout of this commit (--repo), never from the
# tree around it, whose names have moved on since.
PINNED_COMMIT = "22973b967e56228b450791f2a9f4e9468f47e319"


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
from triton.testing import do_bench  # noqa: E402

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
