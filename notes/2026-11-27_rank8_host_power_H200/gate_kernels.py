"""What inductor makes of one attention output gate, y * sigmoid(x[:, :12] @ w.T), as a GEMM (the trainer) and as fused
fp32 sums (gate_logits.diff), forward and backward at 49,152 tokens: GPU time per call and the kernels of each.

    python3 notes/2026-11-27_rank8_host_power_H200/gate_kernels.py      # one CUDA GPU, about a minute

Standalone (imports torch only), so that it can run against any checkout.
"""
import torch
from torch.profiler import ProfilerActivity, profile

T, D, H, HD, K = 49_152, 768, 6, 128, 12


def gemm_gate(u, w, y):
    return y * torch.sigmoid(u[:, :K] @ w.T)[..., None]


def fused_gate(u, w, y):
    logits = (u[:, :K].float()[:, None, :] * w.float()).sum(-1).to(u.dtype)
    return y * torch.sigmoid(logits)[..., None]


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    u = torch.randn(T, D, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(H, K, device="cuda", generator=g) * 0.3).bfloat16().requires_grad_()
    y = torch.randn(T, H, HD, device="cuda", generator=g).bfloat16().requires_grad_()
    grad = torch.randn(T, H, HD, device="cuda", generator=g).bfloat16()
    for name, fn in (("gemm", gemm_gate), ("fused", fused_gate)):
        compiled = torch.compile(fn, fullgraph=True)

        def step():
            compiled(u, w, y).backward(grad)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            step()
        end.record()
        torch.cuda.synchronize()
        print(f"{name}: forward + backward {start.elapsed_time(end) / 50 * 1000:.1f} us per call")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                step()
            torch.cuda.synchronize()
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]:
            if e.device_time_total > 0:
                print(f"    {e.device_time_total / 10:8.1f} us  {e.count // 10:2d}x  {e.key[:110]}")


if __name__ == "__main__":
    main()
