"""Scratch benchmark: the Triton attention kernels (triton_kernels.py section 8) with a register cap (Triton's
`maxnreg` launch option), so that one more program fits on each SM, one GPU.

    python3 notes/2026-11-25_attention_experiments_H100/attention_maxnreg.py

At the shipped tiles an H100 SM holds 3 forward programs (160 registers per thread, 64 KB shared memory) and 2 dQ
programs (178 registers, 80 KB) or 2 dK/dV programs (225 registers, 82 KB); sm_90 has 64K registers and 227 KB of
shared memory per SM. The variants: the forward at 2 stages (48 KB) capped at 128 registers (4 programs), the dQ
kernel at 2 stages (64 KB) capped at 168 (3 programs), and the dK/dV kernel at 2 stages capped at 168 (3 programs,
with spills). Same kernels, same arguments: the results must be bitwise the shipped ones.

Unshipped experiment, kept as evidence (README.md): a register cap (maxnreg) that fits one more program per SM; not
taken (maxnreg.txt: no gain). Self-contained: the shipped kernels it compares against are copied in
attention_snapshot.py, this folder.
"""
import sys

import torch
import triton

import attention_snapshot as snapshot  # this folder's copy of the shipped kernels and bench helpers
from attention_snapshot import gpu_kernel_ms, gpu_shape_cases


def run(q, k, v, g, cu, window, scale, cfg):
    """Forward then backward with cfg = {kernel: (BLOCK_M, BLOCK_N, warps, stages, maxnreg or None)}."""
    T, H, D = q.shape
    start, end = snapshot.document_bounds(cu, T)
    out = torch.empty_like(q)
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device)

    def opts(name):
        bm, bn, warps, stages, maxnreg = cfg[name]
        extra = {} if maxnreg is None else {"maxnreg": maxnreg}
        return bm, bn, dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **extra)

    bm, bn, o = opts("fwd")
    snapshot._attn_fwd_kernel[(triton.cdiv(T, bm), H)](
        q, k, v, out, lse, start, T, window, scale * snapshot._LOG2E, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), HEAD_DIM=D, **o)
    dq, dk, dv = (torch.empty_like(q) for _ in range(3))
    delta = torch.empty((H, T), dtype=torch.float32, device=q.device)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1))
    bm, bn, o = opts("dq")
    snapshot._attn_dq_kernel[(triton.cdiv(T, bm), H)](
        q, k, v, g, out, lse, delta, start, dq, T, window, scale * snapshot._LOG2E, scale, *strides, out.stride(0),
        out.stride(1), dq.stride(0), dq.stride(1), HEAD_DIM=D, **o)
    bm, bn, o = opts("dkdv")
    snapshot._attn_dkdv_kernel[(triton.cdiv(T, bn), H)](
        q, k, v, g, lse, delta, end, dk, dv, T, window, scale * snapshot._LOG2E, scale, *strides, dk.stride(0),
        dk.stride(1), HEAD_DIM=D, **o)
    return out, lse, dq, dk, dv


SHIPPED = {name: (*snapshot._ATTN_TILES[name], None) for name in ("fwd", "dq", "dkdv")}
VARIANTS = {
    "shipped": SHIPPED,
    "fwd 2 stages": {**SHIPPED, "fwd": (64, 32, 4, 2, None)},
    "fwd 2 stages, 128 regs": {**SHIPPED, "fwd": (64, 32, 4, 2, 128)},
    "dq 2 stages": {**SHIPPED, "dq": (64, 32, 4, 2, None)},
    "dq 2 stages, 168 regs": {**SHIPPED, "dq": (64, 32, 4, 2, 168)},
    "dq 3 stages, 168 regs": {**SHIPPED, "dq": (64, 32, 4, 3, 168)},
    "dkdv 2 stages, 168 regs": {**SHIPPED, "dkdv": (32, 64, 4, 2, 168)},
}


DEFAULT_SHAPES = "49152:normal:1408,49152:normal:768,49152:paired:640,16384:normal:384"


def main() -> None:
    shapes = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_SHAPES
    cases = gpu_shape_cases(shapes, "a CUDA GPU (an H100 or H200)")
    device = torch.device("cuda")
    for spec, (T, H, window, cu, _) in cases:
        gen = torch.Generator().manual_seed(T)
        q, k, v, g = (torch.randn(T, H, 128, generator=gen).to(device, torch.bfloat16) for _ in range(4))
        cu, scale = cu.to(device), 0.12
        ref = run(q, k, v, g, cu, window, scale, SHIPPED)
        print(f"{spec}:", flush=True)
        for name, cfg in VARIANTS.items():
            got = run(q, k, v, g, cu, window, scale, cfg)
            same = all(torch.equal(a, b) for a, b in zip(ref, got))
            ms = gpu_kernel_ms(lambda: run(q, k, v, g, cu, window, scale, cfg))
            fwd, dq, dkdv = (ms[n] for n in ("_attn_fwd_kernel", "_attn_dq_kernel", "_attn_dkdv_kernel"))
            print(f"  {name:24s} fwd {fwd:.3f}  dq {dq:.3f}  dkdv {dkdv:.3f}  sum {fwd + dq + dkdv:.3f} ms  "
                  f"bitwise shipped: {same}", flush=True)


if __name__ == "__main__":
    main()
