"""Time the attention's q/k norm + rotary block, compiled as the model compiles it, in equivalent formulations.

    git worktree add /tmp/at-f6fbf31 f6fbf31   # the code it measured (PINNED_COMMIT), whose train_gpt.py it imports
    python3 notes/2026-11-26_4xH200_record61_and_rotary_1xH200/qk_rotary.py --repo=/tmp/at-f6fbf31 [--tokens=49152]

One CUDA GPU, a minute or two. The block is GPT.attention's first part: q, k = rms(q), rms(k) per head, then the
half-truncated rotary, for a normal layer (table row = position) and a paired one (heads 2b, 2b+1 at rows 2t, 2t+1),
forward and backward through the qkv matmul's output. In a phase-3 profile inductor's kernels for it run at about
2.2 TB/s, half of what its residual + rms kernels reach (notes/2026-11-26_mlp_warp_specialized_1xH200): they are
looped reductions that read each row two or three times. The formulations below compute the same products and sums
in the same order, and differ only in how the pair swap is indexed, which is what inductor looks at when it decides
between a looped and a persistent reduction.

For each formulation and layer kind it prints the median ms of the forward and of forward + backward, the bandwidth
that implies (bytes of the unavoidable reads and writes), which reduction kinds inductor generated (per_ / red_
kernels), and how many elements of q, k and d(qkv) differ from the first formulation's (the trainer's).

Measured (notes/2026-11-26_4xH200_record61_and_rotary_1xH200): every formulation still loops, and unbind's faster
block alone did not carry into the model, where both unbind variants made a phase-3 step 5-6 ms slower and a
rotate-half layout was no faster. The trainer has since replaced the block with one Triton kernel pair
(triton_kernels.py section 9, `qk_norm_rotary`); these are the compiled formulations it replaced.
"""
from __future__ import annotations

import argparse
import os
import sys

# The code this script measured. It imports that code from a checkout of this commit (--repo), never from the
# tree around it, whose names have moved on since.
PINNED_COMMIT = "f6fbf318cd696b6f8d86c362c9c51ee3dfd9c2e5"


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
from triton.testing import do_bench  # noqa: E402

import train_gpt as tg  # noqa: E402


def rotary_flip(x, cos, sin):
    """The trainer's former apply_rotary: the pair swap as a flip of each pair."""
    half = x.shape[-1] // 2
    x_rot, x_pass = x[..., :half], x[..., half:]
    x_swapped = x_rot.unflatten(-1, (half // 2, 2)).flip(-1).flatten(-2)
    return torch.cat([x_rot * cos + x_swapped * sin, x_pass], dim=-1)


def rotary_select(x, cos, sin):
    """The swapped pair element chosen with where() from the pair's two elements, each read at a fixed offset."""
    half = x.shape[-1] // 2
    x_rot, x_pass = x[..., :half], x[..., half:]
    pairs = x_rot.unflatten(-1, (half // 2, 2))
    first = torch.arange(2, device=x.device) == 0
    swapped = torch.where(first, pairs[..., 1:], pairs[..., :1]).flatten(-2)
    return torch.cat([x_rot * cos + swapped * sin, x_pass], dim=-1)


def rotary_unbind(x, cos, sin):
    """Even and odd elements as separate tensors, stacked back: out[2m] = x[2m] c[2m] + x[2m+1] s[2m],
    out[2m+1] = x[2m+1] c[2m+1] + x[2m] s[2m+1]."""
    half = x.shape[-1] // 2
    x_rot, x_pass = x[..., :half], x[..., half:]
    a, b = x_rot.unflatten(-1, (half // 2, 2)).unbind(-1)
    c0, c1 = cos.unflatten(-1, (half // 2, 2)).unbind(-1)
    s0, s1 = sin.unflatten(-1, (half // 2, 2)).unbind(-1)
    return torch.cat([torch.stack([a * c0 + b * s0, b * c1 + a * s1], dim=-1).flatten(-2), x_pass], dim=-1)


FORMULATIONS = {"flip (trainer)": rotary_flip, "select": rotary_select, "unbind": rotary_unbind}


def block(rotary, paired: bool, H: int, hd: int):
    def run(qkv, cos_table, sin_table):
        T = qkv.shape[0]
        q, k, _ = qkv.view(T, 3, H, hd).unbind(1)
        q, k = tg.rms(q), tg.rms(k)
        if paired:
            cos = cos_table[: 2 * T].view(T, 1, 2, hd // 2)
            sin = sin_table[: 2 * T].view(T, 1, 2, hd // 2)
            q = rotary(q.view(T, H // 2, 2, hd), cos, sin).view(T, H, hd)
            k = rotary(k.view(T, H // 2, 2, hd), cos, sin).view(T, H, hd)
        else:
            cos, sin = cos_table[:T, None], sin_table[:T, None]
            q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        return q, k
    return run


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=49152, help="tokens per micro-batch (phase 3: 393,216 / 8)")
    args = ap.parse_args(argv)
    from torch._inductor.utils import run_and_get_code

    hp = tg.Hyperparameters()
    H, hd, D, T = hp.num_heads, hp.head_dim, hp.model_dim, args.tokens
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    omega = tg.rotary_base_omega(hd, hp.rope_base, device)
    cos_table, sin_table = tg.rotary_tables(omega, 2 * T)
    qkv = torch.randn(T, 3 * D, device=device, generator=gen).bfloat16().requires_grad_()
    grads = [torch.randn(T, H, hd, device=device, generator=gen).bfloat16() for _ in range(2)]
    # forward: read q and k, write both; backward: read the pre-norm q, k and both gradients, write two gradients
    fwd_bytes, bwd_bytes = 4 * T * D * 2, 6 * T * D * 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {T} tokens, {H} heads of {hd}")
    print(f"{'layer':<7} {'formulation':<16} {'fwd ms':>7} {'fwd+bwd ms':>10} {'fwd TB/s':>8} {'bwd TB/s':>8} "
          f"{'kernels':<22} differs (q, k, dqkv)")
    for paired in (False, True):
        first = None
        for name, rotary in FORMULATIONS.items():
            torch._dynamo.reset()
            compiled = torch.compile(block(rotary, paired, H, hd), fullgraph=True, dynamic=False)

            def fwd():  # the training graph's forward (it also saves what the backward reads)
                return compiled(qkv, cos_table, sin_table)

            def fwd_bwd():
                q, k = compiled(qkv, cos_table, sin_table)
                return (q, k, *torch.autograd.grad((q, k), qkv, grads))

            (q, k, dqkv), codes = run_and_get_code(fwd_bwd)
            kinds = sorted({kind for code in codes for kind in ("per", "red", "poi")
                            if f"def triton_{kind}_" in code})
            outs = (q.detach(), k.detach(), dqkv)
            if first is None:
                first = outs
            differs = ", ".join(str(int((a != b).sum())) for a, b in zip(outs, first))
            fwd()
            t_f, t_fb = (do_bench(fn, warmup=25, rep=100, return_mode="median") for fn in (fwd, fwd_bwd))
            t_b = t_fb - t_f
            print(f"{'paired' if paired else 'normal':<7} {name:<16} {t_f:>7.3f} {t_fb:>10.3f} "
                  f"{fwd_bytes / t_f / 1e9:>8.2f} {bwd_bytes / t_b / 1e9:>8.2f} {'/'.join(kinds):<22} {differs}")


if __name__ == "__main__":
    main(sys.argv[1:])
