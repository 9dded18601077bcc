"""How much more attention work the busiest rank gets than the mean, with the loader's packing of synthetic documents.

    git worktree add /tmp/at-d2a67ef d2a67ef   # the code it measured (PINNED_COMMIT): it imports data/synthetic.py
    python3 notes/2026-11-26_fa4_order_and_4x_profile/attention_skew.py --repo=/tmp/at-d2a67ef      # ~10 s

Every rank holds the same number of tokens, so only attention's cost depends on the documents: a query sees the keys
of its own document inside the window. The cost model counts those (query, key) pairs for the layout's 8 short-window
and 2 long-window layers; it ignores the kernels' 128-token blocks.
"""
import os
import sys

# The code this script measured. It imports that code from a checkout of this commit (--repo), never from the
# tree around it, whose names have moved on since.
PINNED_COMMIT = "d2a67ef9a6d2586dc3dc16fd8016a2bc0c5a4aec"


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
sys.path.insert(0, os.path.join(ROOT, "data"))

import numpy as np  # noqa: E402

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
