"""Data pipeline speed: synthetic shard generation, shard read + BOS index, and train-loader throughput.

    python bench/loader.py                      # 100M-token shard, world size 8, 49,152 tokens per rank (worst case)
    python bench/loader.py --device cuda        # include the pinned-memory, non-blocking copy to the GPU

Generates one synthetic shard of --shard_tokens in a temporary folder (timed: that is data/synthetic.py's work for
one shard, on one core), then times the loader for one rank of --world_size at the record's largest per-rank batch,
over the whole shard: the first request (it reads and indexes the quick prefix of shard 0) and the steady state.
Prints a table at the end.
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "data")]    # as data/'s scripts see it: shards from their folder
import shards  # noqa: E402
import synthetic as syn  # noqa: E402
import checks
import train_gpt as tg  # noqa: E402
import harness  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shard_tokens", type=int, default=100_000_000)
    parser.add_argument("--world_size", type=int, default=8)
    parser.add_argument("--tokens_per_rank", type=int, default=49_152)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dir", default="", help="work folder (default: a temporary one, removed at the end)")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir or None) as tmp:
        path = os.path.join(tmp, "fineweb_train_000001.bin")
        t0 = time.perf_counter()
        vocab = syn.Vocabulary(seed=0)
        t1 = time.perf_counter()
        tokens = syn.make_tokens(vocab, [0, 1, 1], args.shard_tokens, 0.5)
        t2 = time.perf_counter()
        shards.write_shard(path, tokens)
        t3 = time.perf_counter()
        del tokens
        rows.append(("synthetic: vocabulary (once per process)", f"{t1 - t0:.2f} s", ""))
        rows.append((f"synthetic: make {args.shard_tokens / 1e6:.0f}M tokens (1 core)", f"{t2 - t1:.2f} s",
                     f"{args.shard_tokens / (t2 - t1) / 1e6:.1f}M tok/s"))
        rows.append(("synthetic: write shard", f"{t3 - t2:.2f} s", ""))

        t0 = time.perf_counter()
        index = tg._ShardIndex(path, checks.read_tokens(path)[0], complete=True)
        t1 = time.perf_counter()
        index.cum_lens(2048)
        t2 = time.perf_counter()
        rows.append(("loader: read + BOS-index whole shard (background)", f"{t1 - t0:.3f} s",
                     f"{len(index.bos):,} docs"))
        rows.append(("loader: capped cumulative lengths", f"{(t2 - t1) * 1e3:.1f} ms", ""))
        del index

        global_batch = args.tokens_per_rank * args.world_size
        gen = tg.train_batches([path], global_batch, 1, args.rank, args.world_size, device, 2048, 300)
        t0 = time.perf_counter()
        first = next(gen)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        times = []                          # per request, while the whole shard loads in the background too
        try:
            while True:
                start = time.perf_counter()
                batch = next(gen)
                times.append(time.perf_counter() - start)
        except tg.DataError:                # the shard is used up
            pass
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        assert first[0].numel() == args.tokens_per_rank and times and batch[0].device.type == device.type
        rows.append((f"loader: first request (quick index of {tg._QUICK_INDEX_TOKENS / 1e6:.0f}M tokens)",
                     f"{(t1 - t0) * 1e3:.1f} ms", ""))
        label = f"W={args.world_size}, N={args.tokens_per_rank:,}, {device.type}"
        for name, per_batch in [("mean over the shard", (t2 - t1) / len(times)), ("median", float(np.median(times)))]:
            rows.append((f"loader: {name}, {label}", f"{per_batch * 1e3:.2f} ms/batch",
                         f"{args.tokens_per_rank / per_batch / 1e6:.1f}M tok/s per rank ({len(times)} batches)"))
    print(f"\n{'what':58s} {'time':>16s}  rate")
    for what, t, rate in rows:
        print(f"{what:58s} {t:>16s}  {rate}")
    print(f"(torch {torch.__version__}, numpy {np.__version__}, {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
