"""GPU time of the embedding tables record 80 added: the bigram hash table and the five value-embedding tables.

    python3 bench/tables.py [--iters=20]

On one GPU, with CUDA events, the median of --iters runs of each piece at the record's shapes:
    hash        the bigram ids of one micro-batch (train_gpt.bigram_ids, on the device)
    lookup      forward and backward of the bigram lookup and the five value-embedding lookups of one micro-batch,
                compiled as the model compiles them (the backward writes a dense gradient of each table)
    adam        one Adam update of both tables' rows on this rank: all of them (1 GPU) and an eighth (8 GPUs)
and, for comparison, the five value-embedding tables looked up one by one, and record 61's three value-embedding
tables (50304 rows each) under the same lookup and Adam.
The per-step cost: A micro-steps of hash + lookup, and an Adam update every other step (W = 8 / A GPUs).
"""
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt as tg  # noqa: E402

V, D = 50304, 768
BIGRAM_ROWS = 5 * V


def median_ms(fn, iters: int, warmup: int = 3) -> float:
    times = []
    for i in range(warmup + iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def lookups(tables: list[torch.Tensor], ids: list[torch.Tensor]) -> torch.Tensor:
    """The sum of every lookup's rows (so one backward reaches every table)."""
    out = F.embedding(ids[0], tables[0]).float()
    for t, i in zip(tables[1:], ids[1:]):
        rows = F.embedding(i, t).float()
        out = out + (rows.sum(1) if rows.dim() == 3 else rows)
    return out


def main() -> None:
    iters = 20
    for arg in sys.argv[1:]:
        if arg.startswith("--iters="):
            iters = int(arg.split("=", 1)[1])
        else:
            raise SystemExit(f"error: unknown argument {arg!r}; usage: bench/tables.py [--iters=N]")
    device = torch.device("cuda")
    ops = tg.kernel_ops("fused", "cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    compiled = torch.compile(lookups, dynamic=False)
    rows = []
    for T in (16_384, 32_768, 49_152):
        inputs = torch.randint(0, V, (T,), device=device, dtype=torch.int32, generator=gen)
        grad_out = torch.randn(T, D, device=device, generator=gen)
        hash_ms = median_ms(lambda: tg.bigram_ids(inputs, BIGRAM_ROWS), iters)
        for name, n_tables in (("record 80", 2), ("record 80, a lookup per VE table", 2), ("record 61", 3)):
            if name.startswith("record 80"):
                tables = [torch.zeros(BIGRAM_ROWS, D, device=device, dtype=torch.bfloat16, requires_grad=True),
                          torch.zeros(5 * V, D, device=device, dtype=torch.bfloat16, requires_grad=True)]
                big = tg.bigram_ids(inputs, BIGRAM_ROWS)
                if name == "record 80":   # as GPT.final_hidden: one lookup of the five tables' rows
                    ids = [big, inputs[:, None] + torch.arange(5, device=device, dtype=inputs.dtype) * V]
                    tabs = tables
                else:
                    ids = [big] + [inputs + j * V for j in range(5)]
                    tabs = [tables[0]] + [tables[1]] * 5
            else:
                tables = [torch.zeros(V, D, device=device, dtype=torch.bfloat16, requires_grad=True)
                          for _ in range(n_tables)]
                ids, tabs = [inputs] * n_tables, tables

            def fwd_bwd():
                for t in tables:
                    t.grad = None
                compiled(tabs, ids).backward(grad_out)
            lookup_ms = median_ms(fwd_bwd, iters)
            adam = {}
            for world in (1, 8):
                shards = [t.detach()[: t.shape[0] // world] for t in tables]
                grads = [torch.randn_like(s) for s in shards]
                state = [(torch.zeros_like(s, dtype=torch.float32), torch.zeros_like(s, dtype=torch.float32))
                         for s in shards]

                def step():
                    for s, g, (m, v) in zip(shards, grads, state):
                        tg.adam_update(s, g, m, v, beta1=0.75, beta2=0.95, eps=1e-10, step_size=1e-3,
                                       decay=1e-5, ops=ops)
                adam[world] = median_ms(step, iters)
            rows.append((T, name, hash_ms if name.startswith("record 80") else 0.0, lookup_ms, adam[1], adam[8]))
    print("| micro-batch | tables | hash ms | lookup fwd+bwd ms | adam ms (1 GPU) | adam ms (8 GPUs) |")
    print("|---|---|---|---|---|---|")
    for T, name, h, lk, a1, a8 in rows:
        print(f"| {T} | {name} | {h:.3f} | {lk:.3f} | {a1:.3f} | {a8:.3f} |")


if __name__ == "__main__":
    main()
