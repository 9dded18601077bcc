"""Time the attention backends of train_gpt.py at the record's training shapes (one GPU).

    python3 bench/attention.py                          # full grid (T in 16384, 32768, 49152)
    python3 bench/attention.py --seq_lens=16384         # one T
    python3 bench/attention.py --backends=triton --split   # also the time of each kernel (where the time goes)

For each available backend: forward (training mode, inputs require grad) and forward+backward, GPU kernel time
(gpu_ms: the profiler's kernel durations, so the Python launch cost of an uncompiled call is left out),
on packed FineWeb-like documents (lognormal lengths, median ~400 tokens, cut at 2048). Layouts per window stage
(short, long) in 128-token blocks: normal heads (T, 6, 128) with the short and the long window, and the paired
layout (2T, 3, 128) with cu_seqlens * 2 and the short window measured in doubled positions.
"vs ref" is the relative L2 distance of the
output from the first fused backend's (a sanity check; bf16 noise is ~1e-3).

The last lines weigh fwd+bwd by how the record uses attention: per layer stack 4 paired + 4 short + 2 long layers,
stage (1,3) at T=16384 for 575 steps, (3,7) at 32768 for 575, (5,11) at 49152 for 575, (6,13) at 49152 for 40;
the recommended "auto" order sorts backends by that total.
"""
import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import checks
import train_gpt as tg  # noqa: E402

STAGES = ((1, 3), (3, 7), (5, 11), (6, 13))      # (short, long) windows in blocks
BLOCK = 128                                      # tokens per window block
RECORD_STAGE_USE = {(1, 3): (16384, 575), (3, 7): (32768, 575), (5, 11): (49152, 575), (6, 13): (49152, 40)}
LAYERS_PER_KIND = {"paired": 4, "short": 4, "long": 2}   # the record's layer layout
SDPA_MAX_T = 16384                               # the dense-mask reference is only timed up to here


def fineweb_like_cu_seqlens(num_tokens: int, gen: torch.Generator, max_doc: int = 2048) -> tuple[torch.Tensor, list]:
    """int32 cu_seqlens padded with repeats of T to a multiple of 128 entries (as the loader pads), and the lengths."""
    lens = []
    while sum(lens) < num_tokens:
        length = math.exp(math.log(400.0) + torch.randn((), generator=gen).item())  # median 400, sigma 1
        lens.append(max(1, min(max_doc, int(length))))
    lens[-1] -= sum(lens) - num_tokens
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    cu += [num_tokens] * (-len(cu) % 128)
    return torch.tensor(cu, dtype=torch.int32), lens


def shape_case(spec: str) -> tuple[int, int, int, torch.Tensor, list]:
    """A "T:layout:window" spec of the tile and error benches -> (rows, heads, window, cu_seqlens, doc lengths) on the
    CPU, with the FineWeb-like documents of T tokens (seeded by T). normal: (T, 6, 128); paired: (2T, 3, 128), the
    documents (boundaries and lengths) doubled; the window is taken as given (in the layout's positions)."""
    parts = spec.split(":")
    if len(parts) != 3 or parts[1] not in ("normal", "paired") or not (parts[0].isdigit() and parts[2].isdigit()):
        raise ValueError(f"shape {spec!r} is not T:layout:window (layout normal or paired), e.g. 49152:normal:768")
    T, layout, window = int(parts[0]), parts[1], int(parts[2])
    cu, lens = fineweb_like_cu_seqlens(T, torch.Generator().manual_seed(T))
    if layout == "normal":
        return T, 6, window, cu, lens
    return 2 * T, 3, window, cu * 2, [2 * n for n in lens]


def gpu_shape_cases(shapes: str, needs: str) -> list[tuple[str, tuple]]:
    """[(spec, shape_case(spec))] of a comma-separated list of specs, for a benchmark that needs a CUDA GPU (`needs`
    says which); prints the versions and the GPU. A malformed spec, or a machine without CUDA, exits with one
    error line."""
    try:
        cases = [(spec, shape_case(spec)) for spec in shapes.split(",")]
    except ValueError as e:
        sys.exit(f"error: {e}")
    if not torch.cuda.is_available():
        sys.exit(f"error: this benchmark needs {needs}; run it on the device")
    import triton
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}", flush=True)
    return cases


def gpu_kernel_ms(fn, iters: int = 20) -> dict[str, float]:
    """GPU time of fn() per CUDA kernel it launches, in ms per call, from the profiler, by kernel name. Launch
    overhead on the CPU is left out: in the compiled model the CPU runs ahead of the GPU, and a Python launcher would
    otherwise dominate at small shapes."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return kernel_times(prof.events(), iters)


def kernel_times(events, iters: int) -> dict[str, float]:
    """ms per call of each CUDA kernel among profiler events, summed by short name (short_kernel_name)."""
    cuda = torch.autograd.DeviceType.CUDA
    times: dict[str, float] = {}
    for e in events:
        if e.device_type == cuda:
            name = short_kernel_name(e.name)
            times[name] = times.get(name, 0.0) + e.time_range.elapsed_us() / iters / 1e3
    return times


def short_kernel_name(name: str) -> str:
    """A kernel's name without its return type, namespaces, template and argument lists: `void at::native::
    (anonymous namespace)::reduce_kernel<512, 1, ...>(...)` -> `reduce_kernel`. Other names (Triton kernels,
    `Memcpy DtoD (Device -> Device)`) stay as they are."""
    if "::" not in name and "<" not in name:
        return name
    depth, cut = 0, []
    for ch in name:   # drop everything inside <...> and (...), nested
        depth += ch in "<("
        if depth == 0:
            cut.append(ch)
        depth -= ch in ">)" and depth > 0
    words = "".join(cut).split()
    return (words[-1] if words else name).split("::")[-1] or name


def gpu_ms(fn, iters: int = 20) -> float:
    """GPU time of fn() in ms per call: its kernels' summed durations (gpu_kernel_ms)."""
    return sum(gpu_kernel_ms(fn, iters).values())


def attended_pairs(doc_lens: list, window: int) -> int:
    """Number of (query, key) pairs computed: a query at offset p in its document sees min(p, window) + 1 keys."""
    total = 0
    for n in doc_lens:
        m = min(n, window + 1)
        total += m * (m + 1) // 2 + (n - m) * (window + 1)
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq_lens", default="16384,32768,49152", help="comma-separated T per GPU")
    parser.add_argument("--backends", default="", help="comma-separated subset (default: all available)")
    parser.add_argument("--split", action="store_true",
                        help="also print each backend's forward+backward time per kernel")
    args = parser.parse_args()

    device = torch.device("cuda")
    backends = [b for b in checks.available_attn_backends(device) if not args.backends or b in args.backends.split(",")]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}, backends: {backends}", flush=True)
    scale, head_dim = 0.12, 128
    rows = []  # (T, layout, window, backend, fwd_ms, fwdbwd_ms, tflops, rel_diff)
    for T in [int(t) for t in args.seq_lens.split(",")]:
        gen = torch.Generator().manual_seed(T)
        cu, doc_lens = fineweb_like_cu_seqlens(T, gen)
        print(f"T={T}: {len(doc_lens)} documents, mean length {T / len(doc_lens):.0f}", flush=True)
        configs = {}  # (layout, window) -> (seq, heads, cu, max_seqlen, doc lens); deduplicated across stages
        for short, long in STAGES:
            configs[("normal", short * BLOCK)] = (T, 6, cu, 2048, doc_lens)
            configs[("normal", long * BLOCK)] = (T, 6, cu, 2048, doc_lens)
            configs[("paired", short * BLOCK)] = (2 * T, 3, cu * 2, 4096, [2 * n for n in doc_lens])
        for (layout, window), (seq, heads, cu_l, max_seqlen, lens) in sorted(configs.items()):
            cu_dev = cu_l.to(device)
            q, k, v, grad = (torch.randn(seq, heads, head_dim, generator=gen).to(device, torch.bfloat16)
                             for _ in range(4))
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            flops_fwd = 4 * attended_pairs(lens, window) * heads * head_dim   # QK^T and PV, 2 FLOPs per MAC
            ref_out = None
            for backend in backends:
                if backend == "sdpa" and seq > SDPA_MAX_T:
                    continue
                fn = tg.varlen_attention
                attn = lambda: fn(q, k, v, cu_dev, max_seqlen, window, scale, backend)
                t0 = time.time()
                out = attn()
                out.backward(grad)  # the first call also compiles Triton kernels
                torch.cuda.synchronize()
                first_s = time.time() - t0
                out = out.detach().float()
                rel = 0.0 if ref_out is None else ((out - ref_out).norm() / ref_out.norm()).item()
                if ref_out is None and backend != "sdpa":
                    ref_out = out
                fwd_ms = gpu_ms(attn)
                per_kernel = gpu_kernel_ms(lambda: torch.autograd.grad(attn(), (q, k, v), grad))
                fwdbwd_ms = sum(per_kernel.values())
                tflops = 3.5 * flops_fwd / (fwdbwd_ms * 1e-3) / 1e12  # backward ~2.5x forward
                rows.append((T, layout, window, backend, fwd_ms, fwdbwd_ms, tflops, rel))
                print(f"  {layout:6s} window {window:5d} {backend:6s} fwd {fwd_ms:7.3f} ms  fwd+bwd {fwdbwd_ms:7.3f} ms"
                      f"  {tflops:6.1f} TFLOP/s  vs ref {rel:.1e}  (first call {first_s:.1f} s)", flush=True)
                if args.split:
                    print("    per kernel (ms): " + ", ".join(
                        f"{name} {ms:.3f}" for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])))
            del q, k, v, grad, out, ref_out
        torch.cuda.empty_cache()

    print("\n| T | layout | window | backend | fwd ms | fwd+bwd ms | TFLOP/s | vs ref |")
    print("|---|---|---|---|---|---|---|---|")
    for T, layout, window, backend, fwd_ms, fwdbwd_ms, tflops, rel in rows:
        print(f"| {T} | {layout} | {window} | {backend} | {fwd_ms:.3f} | {fwdbwd_ms:.3f} | {tflops:.1f} | {rel:.1e} |")

    # Record-weighted attention time (fwd+bwd, seconds over the run, one GPU's share) per backend.
    timing = {(T, layout, window, backend): fb for T, layout, window, backend, _, fb, _, _ in rows}
    totals = {}
    for backend in backends:
        total, complete = 0.0, True
        for (short, long), (T, steps) in RECORD_STAGE_USE.items():
            for kind, window, layout in (("paired", short, "paired"), ("short", short, "normal"),
                                         ("long", long, "normal")):
                ms = timing.get((T, layout, window * BLOCK, backend))
                if ms is None:
                    complete = False
                    continue
                total += steps * LAYERS_PER_KIND[kind] * ms / 1e3
        if complete:
            totals[backend] = total
    if totals:
        print("\nrecord-weighted attention fwd+bwd per GPU over the run: "
              + ", ".join(f"{b} {s:.2f} s" for b, s in sorted(totals.items(), key=lambda kv: kv[1])))
        order = sorted(totals, key=totals.get)
        order += [b for b in checks.ATTN_AUTO_ORDER_CUDA if b not in order]  # untimed at some T (sdpa) or unavailable
        print(f"recommended ATTN_AUTO_ORDER_CUDA = {tuple(order)}")
    else:
        print("\n(record-weighted totals need all three T; run without --seq_lens)")


if __name__ == "__main__":
    main()
