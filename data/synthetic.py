"""Make FineWeb-shaped token shards without a download, for smoke tests, benchmarks and offline work.

    python data/synthetic.py --out DIR --train_shards 9 --shard_tokens 100000000
    python data/synthetic.py --out DIR --preset=bench      # the sizes of a named use; explicit size flags override them

writes DIR/fineweb_val_000000.bin and DIR/fineweb_train_000001.bin ... in the FineWeb shard format (data/shards.py:
1024-byte header with magic, version and token count, then uint16 tokens), so train_gpt.py reads them with
--train_files='DIR/fineweb_train_*.bin' --val_files='DIR/fineweb_val_*.bin'. The shards are made in a staging folder
inside DIR and moved into place once all are complete (replacing DIR's fineweb_*.bin of an earlier run): a failure or
Ctrl-C leaves DIR as it was.

What the data looks like:
  * documents start with BOS (50256) and nowhere else; their lengths (BOS included) are lognormal with a median of
    400 tokens, so about 5% are longer than the 2048-token training cap;
  * the other tokens come from a Zipf-like distribution over the 50256 non-BOS ids (a fixed random permutation decides
    which id gets which rank);
  * learnable structure: with probability --follow_prob a token is the fixed random successor of the previous token
    (a map drawn once from the seed) instead of a fresh draw, so a model's loss can fall well below the unigram
    entropy (printed at the end: the entropy of the unigram distribution and a rough bound with the successor known).
Everything is a function of --seed: shard k uses the seed sequence (seed, k), so shards can be built in parallel
(--workers processes) and the output does not depend on the worker count.
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
from typing import Iterator

import numpy as np

import shards    # data/shards.py: the shard format, staging of the output, one-line errors

BOS_ID = 50256
NUM_IDS = 50256                    # non-BOS ids 0..50255
MEDIAN_DOC_TOKENS = 400            # lognormal document lengths: median ...
DOC_LEN_SIGMA = 1.0                # ... and log-space spread (P(len > 2048) = P(z > ln(5.12)) ~ 5%)
MAX_DOC_TOKENS = 200_000
ZIPF_EXPONENT, ZIPF_OFFSET = 1.1, 2.7   # p(rank) ~ 1 / (rank + offset)^exponent
SAMPLE_TABLE_BITS = 22             # token sampling by lookup in a 2^22-entry inverse-CDF table
CHUNK_TOKENS = 1 << 23             # generate a shard in chunks to bound memory (int64 temporaries of this size)

# Shard sizes without --preset (9 train shards, as data/cached_fineweb10B.py fetches), and those of each --preset: the
# uses that recur in the README and bench/run.sh. A size flag given on the command line overrides them. 10,485,762 val
# tokens: the default validation scores 10,485,760 and needs at least that + 2. 6 train shards hold the ~1.45 x 339M
# tokens that the record schedule reads, and a shard more: its first stage cuts documents at 896 tokens, which discards
# more of each shard than the factor was measured with.
SIZE_DEFAULTS = dict(train_shards=9, shard_tokens=100_000_000, val_tokens=1 << 24)
PRESETS = {
    "tiny": dict(train_shards=1, shard_tokens=2_000_000, val_tokens=20_000),         # train_gpt.py --preset=tiny (CPU)
    "bench": dict(train_shards=1, shard_tokens=100_000_000, val_tokens=10_485_762),  # shortened schedules on GPUs
    "full": dict(train_shards=6, shard_tokens=100_000_000, val_tokens=10_485_762),   # the whole record schedule
}


class Vocabulary:
    """The fixed parts drawn from the base seed: the rank->id permutation, the sampling table and the successor map."""

    def __init__(self, seed: int):
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED]))
        probs = 1.0 / (np.arange(NUM_IDS) + ZIPF_OFFSET) ** ZIPF_EXPONENT
        self.probs = probs / probs.sum()                                       # by rank
        ids_by_rank = rng.permutation(NUM_IDS).astype(np.uint16)
        # table[j] = id whose CDF interval holds (j + 0.5) / 2^bits: uniform integers index it (quantised inverse CDF)
        cdf = np.cumsum(self.probs)
        points = (np.arange(1 << SAMPLE_TABLE_BITS) + 0.5) / (1 << SAMPLE_TABLE_BITS)
        self.table = ids_by_rank[np.minimum(np.searchsorted(cdf, points), NUM_IDS - 1)]  # (2^bits,) uint16
        self.successor = rng.integers(0, NUM_IDS, NUM_IDS).astype(np.uint16)    # (NUM_IDS,) id -> next id


def doc_lengths(rng: np.random.Generator, num_tokens: int) -> np.ndarray:
    """Lognormal document lengths (BOS included) covering num_tokens; the last one is cut at the end."""
    expected = int(num_tokens / (MEDIAN_DOC_TOKENS * np.exp(DOC_LEN_SIGMA ** 2 / 2))) + 16
    lengths = np.empty(0, dtype=np.int64)
    while lengths.sum() < num_tokens:
        draw = rng.lognormal(np.log(MEDIAN_DOC_TOKENS), DOC_LEN_SIGMA, expected)
        lengths = np.concatenate((lengths, np.clip(draw, 1, MAX_DOC_TOKENS).astype(np.int64)))
    lengths = lengths[:np.searchsorted(np.cumsum(lengths), num_tokens) + 1]
    lengths[-1] -= lengths.sum() - num_tokens
    return lengths


def _apply_successors(tokens: np.ndarray, fresh: np.ndarray, successor: np.ndarray) -> None:
    """In place: a non-fresh token becomes successor[previous token]. A run of k followers after a fresh token t is
    successor^1..k(t); apply the map in rounds, round d to the positions at least d steps after their fresh token."""
    positions = np.arange(len(tokens))
    last_fresh = np.maximum.accumulate(np.where(fresh, positions, 0))    # fresh[0] is True, so this is defined
    depth = positions - last_fresh                                        # (n,) steps since the last fresh token
    todo = np.flatnonzero(depth > 0)
    d = 1
    while len(todo):
        tokens[todo] = successor[tokens[todo - 1]]                       # previous positions are final after d - 1
        todo = todo[depth[todo] > d]
        d += 1


def make_tokens(vocab: Vocabulary, seed_words: list[int], num_tokens: int, follow_prob: float) -> np.ndarray:
    """One shard's tokens (uint16, num_tokens), deterministic in (vocabulary seed, seed_words)."""
    rng = np.random.default_rng(np.random.SeedSequence(seed_words))
    lengths = doc_lengths(rng, num_tokens)
    bos_positions = np.cumsum(lengths) - lengths                                        # (num_docs,) doc starts
    out = np.empty(num_tokens, dtype=np.uint16)
    for lo in range(0, num_tokens, CHUNK_TOKENS):
        hi = min(lo + CHUNK_TOKENS, num_tokens)
        chunk = vocab.table[rng.integers(0, 1 << SAMPLE_TABLE_BITS, hi - lo)]           # (c,) uint16 fresh draws
        fresh = rng.random(hi - lo) >= follow_prob                                      # (c,) bool
        starts = bos_positions[(bos_positions >= lo) & (bos_positions < hi)] - lo      # doc starts in the chunk
        fresh[0] = True                              # successor chains restart at chunk starts,
        fresh[np.minimum(starts + 1, hi - lo - 1)] = True   # and after every BOS (placed below) with a fresh draw
        _apply_successors(chunk, fresh, vocab.successor)
        chunk[starts] = BOS_ID
        out[lo:hi] = chunk
    return out


def entropy_estimates(vocab: Vocabulary, follow_prob: float) -> tuple[float, float]:
    """(unigram entropy, approximate entropy of a token given the previous one) in nats."""
    p = vocab.probs
    unigram = float(-(p * np.log(p)).sum())
    f = follow_prob
    binary = -(f * np.log(f) + (1 - f) * np.log(1 - f)) if 0 < f < 1 else 0.0
    return unigram, float(binary + (1 - f) * unigram)


def _worker(seed: int, jobs: list[tuple[str, list[int], int, float]], conn) -> None:
    """A worker process: makes `jobs` in order, sending each path, or the exception that stopped it, to the parent.
    It starts with SIGINT blocked (see make_shards) and ignores it: the parent ends the workers on a Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        for path in make_shards(jobs, seed, 1):
            conn.send(path)
    except Exception as e:  # noqa: BLE001 (the parent reports it)
        conn.send(e)


def make_shards(jobs: list[tuple[str, list[int], int, float]], seed: int, workers: int) -> Iterator[str]:
    """Writes the shards of `jobs` (see shard_jobs) on `workers` processes, or in this one, yielding each path when it
    is complete. Closing the generator (on an error or Ctrl-C) ends the workers at once. Not a multiprocessing.Pool:
    its terminate() can hang when it kills a worker that holds the result queue's lock."""
    if workers == 1:
        vocab = Vocabulary(seed)
        for path, seed_words, num_tokens, follow_prob in jobs:
            shards.write_shard(path, make_tokens(vocab, seed_words, num_tokens, follow_prob))
            yield path
        return
    ctx = multiprocessing.get_context("spawn" if sys.platform == "darwin" else "fork")
    procs, readers, done = [], [], 0
    try:
        # Ctrl-C reaches the whole process group: the workers ignore it and the parent ends them. While they start,
        # SIGINT is blocked, not ignored: a Ctrl-C then waits and arrives as soon as the parent unblocks it (ignoring
        # it lost one that came while a fast worker had already written its first shard, and the run went on).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            for k in range(workers):
                reader, writer = ctx.Pipe(duplex=False)
                procs.append(ctx.Process(target=_worker, args=(seed, jobs[k::workers], writer), daemon=True))
                procs[-1].start()
                writer.close()
                readers.append(reader)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        while readers:
            for reader in multiprocessing.connection.wait(readers):
                try:
                    result = reader.recv()
                except EOFError:        # that worker has exited
                    readers.remove(reader)
                    continue
                if isinstance(result, Exception):
                    raise result
                done += 1
                yield result
        if done < len(jobs):
            raise SystemExit("error: a worker process ended before making its shards (killed, out of memory?); "
                             "try fewer --workers")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.join()


def shard_jobs(out_dir: str, train_shards: int, shard_tokens: int, val_tokens: int, seed: int,
               follow_prob: float) -> list[tuple[str, list[int], int, float]]:
    """(path, seed words, tokens, follow_prob) for the val shard and train shards 1..train_shards."""
    jobs = [(os.path.join(out_dir, "fineweb_val_000000.bin"), [seed, 1, 0], val_tokens, follow_prob)]
    for k in range(1, train_shards + 1):
        jobs.append((os.path.join(out_dir, f"fineweb_train_{k:06d}.bin"), [seed, 1, k], shard_tokens, follow_prob))
    return jobs


def resolve_sizes(preset: str | None, given: dict[str, int | None]) -> dict[str, int]:
    """train_shards, shard_tokens and val_tokens: the value in `given` unless it is None, else the preset's (or the
    default without a preset)."""
    if preset is not None and preset not in PRESETS:
        raise shards.UsageError(f"--preset={preset}: unknown; use one of {', '.join(PRESETS)}")
    base = SIZE_DEFAULTS if preset is None else PRESETS[preset]
    return {name: base[name] if given.get(name) is None else given[name] for name in SIZE_DEFAULTS}


def main(argv: list[str] | None = None) -> int:
    return shards.run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    parser = shards.ArgumentParser(prog="data/synthetic.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output folder (created if missing); its fineweb_*.bin shards "
                        "of an earlier run are replaced by this run's, and only once all of them are complete")
    parser.add_argument("--preset", default=None, help="shard sizes of a named use: "
                        + "; ".join(f"{name}: " + ", ".join(f"--{k}={v}" for k, v in sizes.items())
                                    for name, sizes in PRESETS.items())
                        + ". A size flag given too overrides the preset's value")
    parser.add_argument("--train_shards", type=int, default=None, help="number of train shards (default 9, like the "
                        "FineWeb download for the full run, or the preset's)")
    parser.add_argument("--shard_tokens", type=int, default=None, help="tokens per train shard (default 1e8, like "
                        "FineWeb, or the preset's)")
    parser.add_argument("--val_tokens", type=int, default=None, help="tokens in the val shard (default 2^24, or the "
                        "preset's; the default validation scores 10,485,760 and needs at least that + 2)")
    parser.add_argument("--seed", type=int, default=0, help="base seed; the output is a function of it")
    parser.add_argument("--follow_prob", type=float, default=0.5, help="probability that a token is the fixed "
                        "successor of the previous one (the learnable part)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="parallel processes (default: "
                        "all cores); does not change the output")
    args = parser.parse_args(argv)
    vars(args).update(resolve_sizes(args.preset, {name: getattr(args, name) for name in SIZE_DEFAULTS}))
    max_tokens = shards.MAX_SHARD_TOKENS
    for bad, message in ((args.train_shards < 0, f"--train_shards={args.train_shards}: must be 0 or more"),
                         (not 1 <= args.shard_tokens <= max_tokens,
                          f"--shard_tokens={args.shard_tokens}: must be 1 .. {max_tokens:,} (the header's int32)"),
                         (not 1 <= args.val_tokens <= max_tokens,
                          f"--val_tokens={args.val_tokens}: must be 1 .. {max_tokens:,} (the header's int32)"),
                         (not 0 <= args.follow_prob < 1, f"--follow_prob={args.follow_prob}: must be in [0, 1)"),
                         (args.seed < 0, f"--seed={args.seed}: must be 0 or more"),
                         (args.workers < 1, f"--workers={args.workers}: must be 1 or more")):
        if bad:
            raise shards.UsageError(message)
    print(f"{args.train_shards} train shard(s) of {args.shard_tokens:,} tokens and a val shard of "
          f"{args.val_tokens:,}" + (f" (--preset={args.preset})" if args.preset else ""), flush=True)
    t0 = time.perf_counter()
    with shards.shard_set(args.out, "fineweb") as staging:
        jobs = shard_jobs(staging, args.train_shards, args.shard_tokens, args.val_tokens, args.seed,
                          args.follow_prob)
        total, done = sum(job[2] for job in jobs), 0
        # closing() ends the workers on a failure or Ctrl-C before shard_set removes their files
        with contextlib.closing(make_shards(jobs, args.seed, min(args.workers, len(jobs)))) as results:
            for path in results:
                done += next(job[2] for job in jobs if job[0] == path)
                rate = done / max(time.perf_counter() - t0, 1e-9)
                print(f"wrote {os.path.basename(path)}  ({done:,}/{total:,} tokens, {rate / 1e6:.1f}M tokens/s)",
                      flush=True)
    unigram, conditional = entropy_estimates(Vocabulary(args.seed), args.follow_prob)
    print(f"done in {time.perf_counter() - t0:.1f}s: {len(jobs)} shards in {args.out}; unigram entropy "
          f"{unigram:.2f} nats, about {conditional:.2f} with the successor structure learned")
    print(f"train with: --train_files='{args.out}/fineweb_train_*.bin' --val_files='{args.out}/fineweb_val_*.bin'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
