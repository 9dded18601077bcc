"""Test helpers for the data pipeline: a shard writer, a pure-Python reference of the training and validation
batch rules, and an importer of the scripts under data/."""
import importlib
import os
import struct
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.path.join(ROOT, "data")
BOS = 50256


def load_script(name: str):
    """Import data/<name>.py as its scripts see it: as when a script runs, its folder goes first on sys.path, where
    the scripts find their shared module `shards` (the trainer imports the same file as data.shards)."""
    if DATA_DIR not in sys.path:
        sys.path.insert(0, DATA_DIR)
    return importlib.import_module(name)


def write_shard(path, tokens, magic=20240520, version=1, header_count=None, extra_bytes=b""):
    """Write a shard by hand with struct (independent of the code under test); the fields can be made wrong."""
    tokens = [int(t) for t in tokens]
    n = len(tokens) if header_count is None else header_count
    header = struct.pack("<3i", magic, version, n) + bytes(1024 - 12)
    with open(path, "wb") as f:
        f.write(header + struct.pack(f"<{len(tokens)}H", *tokens) + extra_bytes)
    return path


def read_shard(path):
    """Tokens of a shard read with struct: (list of ints)."""
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<i", data[8:12])[0]
    return list(struct.unpack(f"<{n}H", data[1024:1024 + 2 * n]))


def labelled_docs(rng, num_docs, first_label, median=60, sigma=1.0, max_len=4000):
    """Token list of num_docs documents; document d is [BOS, label, label, ...] with label = first_label + d, so a
    segment's document can be read off its tokens. Lengths (BOS included) are lognormal, at least 2."""
    tokens = []
    for d in range(num_docs):
        length = int(min(max(2, rng.lognormal(np.log(median), sigma)), max_len))
        tokens += [BOS] + [(first_label + d) % 50000] * (length - 1)
    return tokens


def ref_max_num_docs(n, bound):
    size = 128
    while size < n // bound:
        size += 128
    return size


class RefTrainLoader:
    """The training batch rule transcribed literally, in pure Python, over in-memory shards (lists of ints)."""

    def __init__(self, shards):
        self.shards = shards
        self.k = 0
        self.i = 0

    def bos_positions(self):
        return [p for p, t in enumerate(self.shards[self.k]) if t == BOS]

    def next_batch(self, n, world_size, cap, bound):
        """Per rank: (inputs, targets, cu_seqlens) as lists."""
        while True:
            tokens, P = self.shards[self.k], self.bos_positions()
            i, per_rank, exhausted = self.i, [], False
            for _ in range(world_size):
                collected, segments = 0, []
                while collected <= n:
                    if i >= len(P):
                        exhausted = True
                        break
                    s = P[i]
                    nxt = P[i + 1] if i + 1 < len(P) else len(tokens)
                    e = min(nxt, s + cap, s + (n + 1 - collected))
                    segments.append((s, e))
                    collected += e - s
                    i += 1
                if exhausted:
                    break
                assert collected == n + 1
                per_rank.append(segments)
            if not exhausted:
                self.i = i
                return [self._build(tokens, segs, n, bound) for segs in per_rank]
            self.k += 1
            self.i = 0
            if self.k == len(self.shards):
                raise EOFError("reference ran out of shards")

    @staticmethod
    def _build(tokens, segments, n, bound):
        buf = []
        for s, e in segments:
            buf += tokens[s:e]
        lengths = [e - s for s, e in segments]
        lengths[-1] -= 1
        cu = [0]
        for length in lengths:
            cu.append(cu[-1] + length)
        cu += [n] * (ref_max_num_docs(n, bound) - len(cu))
        return buf[:n], buf[1:n + 1], cu


def ref_val_batches(shards, val_batch_size, val_tokens, grad_accum, rank, world_size, bound):
    """The validation batch rule transcribed literally (shards: lists of ints)."""
    n_val = val_batch_size // (grad_accum * world_size)
    k, pos, out = 0, 0, []
    for _ in range(grad_accum * val_tokens // val_batch_size):
        if pos + world_size * n_val + 1 >= len(shards[k]):
            k, pos = k + 1, 0
        buf = shards[k][pos + rank * n_val: pos + rank * n_val + n_val + 1]
        inputs = buf[:-1]
        cu = [0] + [p for p, t in enumerate(inputs) if t == BOS]
        cu += [n_val] * (ref_max_num_docs(n_val, bound) - len(cu))
        out.append((inputs, buf[1:], cu))
        pos += world_size * n_val
    return out
