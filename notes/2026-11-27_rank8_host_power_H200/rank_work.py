"""Each rank's attention work at given steps of a run, from the documents the loader gives it: which rank the data
makes the slowest. Every rank holds the same number of tokens, so only attention's cost depends on the documents.

    git worktree add /tmp/at-607bdec 607bdec   # the code it measured (PINNED_COMMIT): it imports train_gpt, harness
    python3 notes/2026-11-27_rank8_host_power_H200/rank_work.py --repo=/tmp/at-607bdec --ranks=4 --steps=36,37,56,57 \
        [train_gpt options]

No GPU: it runs the trainer's loader (train_gpt.train_batches) for every rank on the CPU, with the train shards, the
stages and --batch_slices of the options (NPROC/8 of each batch with --batch_slices=NPROC for bench/run.sh rank8's
run). The cost of a document of L tokens is its (query, key) pairs under the layer's window, summed over the
attention layers: H * pairs(L, w) for normal heads, H/2 * pairs(2L, w) for paired ones (two positions per token). A
line per step: each rank's work over the ranks' mean, in %, and the ranks in order of work. Compare with
bench/profile_step.py's rank lines (the order in which the ranks reached the step's first gradient reduction).
"""
from __future__ import annotations

import argparse
import os
import sys

# The code this script measured. It imports that code from a checkout of this commit (--repo), never from the
# tree around it, whose names have moved on since.
PINNED_COMMIT = "607bdec0d4b634d49f5924ea8acac0fd6e33fc33"


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
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402


def pairs(length: int, window: int) -> int:
    """(query, key) pairs of one causal document of `length` positions when a query sees at most `window` earlier
    keys and itself."""
    t = np.arange(length, dtype=np.int64)
    return int((np.minimum(t, window) + 1).sum())


def attention_work(doc_lens: list[int], ws_short: int, ws_long: int, hp) -> int:
    """The cost of a micro-batch's documents over the model's attention layers (windows in blocks)."""
    total = 0
    for i, kind in enumerate(hp.attn_layout):
        if kind == "-":
            continue
        window = (ws_long if i in hp.long_window_layers else ws_short) * hp.block_size
        for n in doc_lens:
            total += (hp.num_heads * pairs(n, window) if kind == "N"
                      else hp.num_heads // 2 * pairs(2 * n, window))
    return total


def doc_lengths(cu_seqlens: np.ndarray) -> list[int]:
    """Document lengths from a micro-batch's boundaries [0, c_1, ..., N, N, ...] (the padding repeats N)."""
    return [int(n) for n in np.diff(cu_seqlens) if n > 0]


def rank_work(hp, ranks: int, steps: list[int]) -> dict[int, list[int]]:
    """{step: [work of rank r for r in range(ranks)]}, each rank's micro-batches of the step summed."""
    import torch

    import harness
    import train_gpt as tg
    grad_accum = hp.batch_slices // ranks
    files = harness.resolve_shards(hp.train_files, "train")
    first = tg.schedule_at(0, hp).global_batch
    streams = [tg.train_batches(files, first, grad_accum, r, ranks, torch.device("cpu"), hp.train_max_seq_len,
                                hp.tokens_per_doc_bound) for r in range(ranks)]
    work, batch = {}, first
    for step in range(max(steps) + 1):
        sched = tg.schedule_at(step, hp)
        message = None
        if sched.global_batch != batch:   # as Trainer.advance_schedule tells the loader
            batch = sched.global_batch
            message = (batch, hp.train_max_seq_len, grad_accum)
        per_rank = [0] * ranks
        for _ in range(grad_accum):
            for r, stream in enumerate(streams):
                _, _, cu = stream.send(message) if message is not None else next(stream)
                if step in steps:
                    per_rank[r] += attention_work(doc_lengths(cu.numpy()), sched.ws_short, sched.ws_long, hp)
            message = None
        if step in steps:
            work[step] = per_rank
    for stream in streams:
        stream.close()
    return work


def main(argv: list[str]) -> int:
    import train_gpt as tg
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=8, help="processes of the run (its world size)")
    ap.add_argument("--steps", default="", help="comma-separated steps (0-based, as the trace names count them)")
    args, rest = ap.parse_known_args(argv)
    try:
        steps = [int(s) for s in args.steps.split(",") if s]
        if not steps or min(steps) < 0:
            raise ValueError
    except ValueError:
        print(f"error: --steps takes comma-separated step numbers from 0, got '{args.steps}'", file=sys.stderr)
        return 2
    hp = tg.parse_args(rest)
    if args.ranks < 1 or hp.batch_slices % args.ranks:
        print(f"error: --ranks={args.ranks} must divide --batch_slices={hp.batch_slices}", file=sys.stderr)
        return 2
    import harness
    try:
        work = rank_work(hp, args.ranks, steps)
    except harness.DataError as e:   # no shards, too few tokens, a batch the ranks cannot share
        print(f"error: {e}", file=sys.stderr)
        return 1
    for step, per_rank in work.items():
        mean = sum(per_rank) / len(per_rank)
        order = sorted(range(len(per_rank)), key=lambda r: per_rank[r])
        print(f"step {step}: " + "  ".join(f"rank{r} {100 * (w / mean - 1):+.1f}%" for r, w in enumerate(per_rank))
              + "  | least to most: " + " ".join(f"rank{r}" for r in order))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
