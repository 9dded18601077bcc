"""How far each attention backend's output and gradients are from float64, at the training shapes (one GPU).

    python3 bench/attention_error.py                     # this checkout's kernels and the other backends
    python3 bench/attention_error.py --root=/tmp/base    # the Triton kernels of another checkout (before/after)

Prints, per shape (T:layout:window, the documents of bench/attention.py) and backend, the relative L2 error
|got - exact| / |exact| of out, dq, dk, dv in bf16 against a float64 computation of the same inputs. The Triton
kernels come from ROOT/triton_kernels.py; a second run with --root gives the baseline's, so a kernel change can
be checked to round no worse than before (and than torch's varlen_attn). The exact values are computed document
by document (dense within a document, exact_attention), which keeps float64 memory small at T = 49k.
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SHAPES = "16384:normal:384,49152:normal:768,49152:normal:1408,49152:paired:640"


def exact_attention(q, k, v, grad_out, cu_seqlens, window: int, scale: float):
    """float64 out and (dq, dk, dv) of the attention contract (causal, `window` keys to the left, documents from
    cu_seqlens), computed one document at a time with a dense mask and autograd."""
    q, k, v, grad_out = (t.detach().double() for t in (q, k, v, grad_out))
    out, grads = torch.zeros_like(q), [torch.zeros_like(q) for _ in range(3)]
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e == s:
            continue
        pos = torch.arange(e - s, device=q.device)
        allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= pos[:, None] - window)
        qd, kd, vd = (t[s:e].clone().requires_grad_() for t in (q, k, v))
        logits = scale * torch.einsum("qhd,khd->hqk", qd, kd)
        p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        od = torch.einsum("hqk,khd->qhd", p, vd)
        out[s:e] = od.detach()
        for g, gd in zip(grads, torch.autograd.grad(od, (qd, kd, vd), grad_out[s:e])):
            g[s:e] = gd
    return out, tuple(grads)


def relative_errors(got: dict, exact: dict) -> dict:
    """{name: |got - exact| / |exact|} in float64."""
    return {name: ((got[name].double() - exact[name]).norm() / exact[name].norm()).item() for name in exact}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=os.path.dirname(HERE), help="checkout whose triton_kernels.py to use")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated T:layout:window")
    args = parser.parse_args()
    root = os.path.abspath(args.root)
    if not os.path.isfile(os.path.join(root, "triton_kernels.py")):
        sys.exit(f"error: no triton_kernels.py in --root={args.root}; give a checkout of this project")
    sys.path.insert(0, HERE)
    sys.path.insert(0, root)
    import triton_kernels as tk   # first: train_gpt, which attention imports, then uses ROOT's kernels too
    import attention as bench_attention
    try:
        shapes = [bench_attention.shape_case(spec) for spec in args.shapes.split(",")]
    except ValueError as e:
        sys.exit(f"error: --shapes: {e}")
    if not torch.cuda.is_available():
        sys.exit("error: bench/attention_error.py needs a CUDA GPU (the backends under test are GPU kernels)")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, Triton kernels from {tk.__file__}")
    backends = {"triton": lambda q, k, v, cu, w, s: tk.varlen_attention_triton(q, k, v, cu, w, s)}
    try:
        from torch.nn.attention.varlen import varlen_attn
        backends["varlen"] = lambda q, k, v, cu, w, s: varlen_attn(q, k, v, cu, cu, 4096, 4096, scale=s,
                                                                    window_size=(w, 0))
    except ImportError:
        pass
    scale = 0.12
    print("| shape | backend | out | dq | dk | dv |\n|---|---|---|---|---|---|")
    for shape, (seq, heads, window, cu, lens) in zip(args.shapes.split(","), shapes):
        cu = cu.cuda()
        gen = torch.Generator().manual_seed(0)
        q, k, v, g = ((torch.randn(seq, heads, 128, generator=gen) / 3).cuda().bfloat16() for _ in range(4))
        out, grads = exact_attention(q, k, v, g, cu, window, scale)
        exact = {"out": out, **dict(zip(("dq", "dk", "dv"), grads))}
        for name, fn in backends.items():
            qkv = [t.clone().requires_grad_() for t in (q, k, v)]
            o = fn(*qkv, cu, window, scale)
            got = {"out": o.detach(), **dict(zip(("dq", "dk", "dv"), torch.autograd.grad(o, qkv, g)))}
            errs = relative_errors(got, exact)
            print(f"| {shape} | {name} | " + " | ".join(f"{errs[n]:.3e}" for n in exact) + " |", flush=True)


if __name__ == "__main__":
    main()
