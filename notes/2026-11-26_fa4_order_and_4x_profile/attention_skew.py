"""How much more attention work the busiest rank gets than the mean, with the loader's packing of synthetic documents.

    python3 notes/2026-11-26_fa4_order_and_4x_profile/attention_skew.py      # from the repository root, ~10 s

Every rank holds the same number of tokens, so only attention's cost depends on the documents: a query sees the keys
of its own document inside the window. The cost model counts those (query, key) pairs for the layout's 8 short-window
and 2 long-window layers; it ignores the kernels' 128-token blocks.
"""
import sys

import numpy as np

sys.path.insert(0, "data")
import synthetic  # noqa: E402

MAX_SEQ_LEN, BLOCK = 2048, 128


def pairs(length: int, window: int) -> int:
    t = np.arange(length)
    return int(np.minimum(t, window).sum()) + length


lengths = np.minimum(synthetic.doc_lengths(np.random.default_rng(0), 300_000_000), MAX_SEQ_LEN)
cum = np.concatenate([[0], np.cumsum(lengths)])
for batch, ws_long in ((131_072, 3), (393_216, 11)):
    for world, accum in ((4, 2), (8, 1)):
        n, cursor, excess = batch // (world * accum), 0, []
        for _ in range(150):
            work = np.zeros(world)
            for _ in range(accum):
                cuts = [cursor]
                for _ in range(world):
                    cuts.append(int(np.searchsorted(cum, cum[cuts[-1]] + n, side="right")))
                for r in range(world):
                    segs = lengths[cuts[r]:cuts[r + 1]].copy()
                    segs[-1] = n + 1 - (segs.sum() - segs[-1])
                    work[r] += sum(8 * pairs(int(s), BLOCK * (ws_long // 2)) + 2 * pairs(int(s), BLOCK * ws_long)
                                   for s in segs)
                cursor = cuts[-1]
            excess.append(work.max() / work.mean() - 1)
        print(f"{batch} tokens, {world} GPUs x {accum} micro-batches: the busiest rank's attention is "
              f"{np.mean(excess):.1%} over the mean")
