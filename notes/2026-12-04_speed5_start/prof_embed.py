import sys, torch
sys.path.insert(0, ".")
import train_gpt as tg
import triton_kernels as tk
from torch.profiler import profile, ProfilerActivity
V, D, BIG = 50304, 768, 377_280
dev = torch.device("cuda")
tables = [torch.zeros(r, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for r in (V, 5 * V, BIG)]
off = torch.arange(5, device=dev, dtype=torch.int32) * V
def lookups(f, i):
    return f(i, tables[0]).float() + f(i[:, None] + off, tables[1]).float().sum(1) + f(tg.bigram_ids(i, BIG), tables[2]).float()
w = 1.0 / torch.arange(1, V + 1, dtype=torch.float64)
T = 16384
inputs = torch.multinomial(w, T, replacement=True).to(dev, torch.int32)
g = torch.randn(T, D, device=dev)
for name, f in (("sorted", tk.embedding_triton), ("dense", tk.embedding_reference)):
    c = torch.compile(lambda i, f=f: lookups(f, i), dynamic=False, fullgraph=True)
    def step():
        for t in tables: t.grad = None
        c(inputs).backward(g)
    for _ in range(3): step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        for _ in range(5): step()
        torch.cuda.synchronize()
    print("=====", name, flush=True)
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70), flush=True)
