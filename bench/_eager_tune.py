import os, sys, time, glob
sys.path.insert(0, os.getcwd())
import torch, triton
import triton_kernels as tk
if len(sys.argv) > 1 and sys.argv[1] == "cache":
    from triton import knobs
    knobs.autotuning.cache = True
t = time.perf_counter()
for shape in [(10, 768, 768), (22, 768, 3072), (10, 768, 768), (2, 3072, 768)]:
    A = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    tk.xxt(A)
    tk.ba_plus_cAA(tk.xxt(A), 0.5, 1.0) if hasattr(tk, "ba_plus_cAA") else None
torch.cuda.synchronize()
d = os.environ["TRITON_CACHE_DIR"]
print(sys.argv[1:], f"{time.perf_counter() - t:.1f}s", "cache entries", len(os.listdir(d)), flush=True)
