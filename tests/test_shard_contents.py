"""Shards that differ only inside: two nodes whose shards have the same names, sizes and headers but other tokens
would train on other data without a word, so every rank digests its shards' whole contents at start (sha256, cached
beside each shard while its size, mtime, ctime and inode stay) and the first rank whose digest differs from rank 0's is
refused, naming the shard. The digest, its cache, the error, the slow-start note and the check across two ranks."""
import hashlib
import os
import shutil
import socket
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import harness
import train_gpt as tg
from _shards import ROOT, make_dataset, run_gloo, write_shard

BOS = 50256


def _shard(path, n=400_000, seed=0):
    tokens = np.random.default_rng(seed).integers(0, 300, size=n)
    tokens[::200] = BOS
    return write_shard(path, tokens)


def _change_token(path, index, keep_mtime=False):
    """One token of the shard at `path` changed in place (same size and header), mtime kept if asked."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(1024 + 2 * index)
        old = int.from_bytes(f.read(2), "little")
        f.seek(1024 + 2 * index)
        f.write(((old + 1) % 300).to_bytes(2, "little"))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_the_contents_digest_catches_one_token_changed_anywhere(tmp_path, monkeypatch):
    """The whole file is hashed (what `sha256sum` prints), so a change anywhere is caught, past any sample too (an
    8 MB shard, more than 64 samples of 64 KiB cover): the first, second, middle and last token and 28 others. The
    size and the header, all the old check compared, stay the same."""
    monkeypatch.setattr(harness, "atomic_write", lambda *a: None)     # no cache: every call hashes
    path = _shard(tmp_path / "fineweb_train_000001.bin", n=4_000_000)
    n = 4_000_000
    size, head, digest, _ = harness.shard_digest(path)
    assert digest == _sha256(path) and size == os.path.getsize(path)
    indices = [0, 1, n // 2, n - 1, *np.random.default_rng(1).integers(0, n, size=28).tolist()]
    original = Path(path).read_bytes()
    for index in indices:
        _change_token(path, index)
        changed = harness.shard_digest(path)
        assert changed[:2] == (size, head) and changed[2] != digest, index
        assert changed[2] == _sha256(path), index
        Path(path).write_bytes(original)


def test_the_digest_cache_is_trusted_only_while_the_shard_is_unchanged(tmp_path, monkeypatch):
    """A rewrite with the same size, in place or by a rename over it, with its mtime set back (as cp -p, rsync -t
    or touch -r do), changes the ctime, so the cached digest is not used; a cache file that is not one is ignored."""
    monkeypatch.setattr(harness, "DIGEST_SETTLE_S", 0.0)     # the shard was written just now
    path = _shard(tmp_path / "fineweb_train_000001.bin")
    cache = tmp_path / ".fineweb_train_000001.bin.sha256"
    assert harness.digest_cache(path) == cache
    first = harness.shard_digest(path)
    assert first[3] == "hashed" and cache.is_file() and first[2] in cache.read_text()
    assert harness.shard_digest(path) == (*first[:3], "cached")

    _change_token(path, 300_000, keep_mtime=True)           # in place, same size and mtime
    again = harness.shard_digest(path)
    assert again[3] == "hashed" and again[2] == _sha256(path) != first[2]

    st = os.stat(path)                                       # a rename over it, same size and mtime
    other = tmp_path / "other.bin"
    shutil.copy(path, other)
    _change_token(other, 5)
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, path)
    replaced = harness.shard_digest(path)
    assert replaced[3] == "hashed" and replaced[2] == _sha256(path) != again[2]

    key = cache.read_text().split("\n")[1].rsplit(" ", 1)[0]
    for garbage in ("not a digest cache\n", f"nanogpt shard sha256 0\n{key} {'0' * 64}\n",
                    f"{harness.DIGEST_CACHE_FORMAT}\n{key} {'0' * 63}\n"):    # another format; a cut digest
        cache.write_text(garbage)
        assert harness.shard_digest(path) == (*replaced[:3], "hashed"), garbage
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []


def test_a_shard_changed_just_now_or_in_a_read_only_folder_is_digested_but_not_cached(tmp_path, monkeypatch):
    path = _shard(tmp_path / "fineweb_val_000000.bin", n=50_000)
    fresh = harness.shard_digest(path)          # written less than DIGEST_SETTLE_S ago: a change in the same
    assert fresh[2] == _sha256(path) and fresh[3] == "not cached"       # clock tick would keep its key
    assert not harness.digest_cache(path).exists()

    def refused(*args):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(harness, "DIGEST_SETTLE_S", 0.0)
    monkeypatch.setattr(harness, "atomic_write", refused)
    assert harness.shard_digest(path) == (*fresh[:3], "not cached")
    assert not harness.digest_cache(path).exists()


def test_node_facts_hold_every_shards_contents_digest(tmp_path):
    train, val = make_dataset(tmp_path / "d", train_tokens=20_000, val_tokens=2_000, n_train_shards=2)
    hp = tg.Hyperparameters(train_files=train, val_files=val)
    facts = harness.node_facts(hp, [ROOT / "train_gpt.py"], torch.device("cpu"), world_size=2)
    assert [x[3] for x in facts["shards"]["train"]] == [
        _sha256(tmp_path / "d" / f"fineweb_train_00000{k}.bin") for k in (1, 2)]
    assert facts["shards"]["val"][0][3] == _sha256(tmp_path / "d" / "fineweb_val_000000.bin")
    digests = facts["digests"]
    assert digests["shards"] == 3 and digests["cached"] + digests["hashed"] + digests["not cached"] == 3


def _facts(host, t2_digest="d2"):
    return {"host": host, "code": "c0", "options": {"seed": "0"}, "env": {"torch": "2.13.0"},
            "shards": {"train": [("t1.bin", 1224, "h1", "d1"), ("t2.bin", 1424, "h2", t2_digest)],
                       "val": [("v.bin", 1044, "h3", "d3")]}}


def test_a_rank_whose_shard_holds_other_tokens_is_named_with_the_shard():
    every = [_facts("a"), _facts("x"), _facts("b", "e" * 64), _facts("c", "f" * 64)]
    problem = harness.first_difference(every, "train_gpt.py")
    assert isinstance(problem, harness.DataError), problem
    assert str(problem) == (
        "rank 2 (host b) has another t2.bin: other tokens than rank 0's at the same size and header (sha256 "
        "eeeeeeeeeeeeeeee..., rank 0: d2...): give every node the same shards (--train_files): find the wrong copy "
        "with `sha256sum t2.bin`, delete it and fetch it again (data/cached_fineweb10B.py keeps a file whose size "
        "and header are valid)")
    assert harness.first_difference(every[:2], "train_gpt.py") is None


def test_a_slow_comparison_is_noted_for_rank_0s_log():
    def facts(host, seconds, hashed=10, not_cached=0):
        return {"host": host, "digests": {"seconds": seconds, "shards": 10, "cached": 10 - hashed - not_cached,
                                          "hashed": hashed, "not cached": not_cached}}
    assert harness.digests_note([facts("a", 0.3), facts("b", 0.9)]) is None
    assert harness.digests_note([facts("a", 0.3), facts("b", 2.96)]) == (
        "note: comparing the shards' contents across ranks took 3.0 s (rank 1, host b: 10 shards, 10 hashed); the "
        "digests are cached beside the shards (.<name>.sha256), so the next start reads those")
    assert harness.digests_note([facts("a", 1.5, hashed=0, not_cached=10), facts("b", 0.1)]).endswith(
        "(rank 0, host a: 10 shards, 10 hashed); 10 could not be cached (a read-only folder, or changed just now), "
        "so the next start hashes them again")


def test_rank_0s_log_head_has_the_note(tmp_path):
    log = harness.RunLogger(tmp_path / "run.txt")
    run = SimpleNamespace(rank=0, log=log, hp=tg.Hyperparameters(), node_note=None, digests_note="note: slow")
    harness.log_start(run, {"train_gpt.py": ""}, "train_gpt.py")
    log.close()
    assert "\nnote: slow\n" in (tmp_path / "run.txt").read_text()


TINY = ["--preset=tiny", "--model_dim=64", "--head_dim=16", "--mlp_hidden=256", "--val_loss_every=0", "--seed=0",
        "--num_scheduled_iterations=3", "--num_extension_iterations=0", "--warmup=false"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_node_whose_shard_holds_one_other_token_is_refused_at_start(tmp_path):
    """Two ranks, each reading its own folder's copy (another node's disk): byte-identical copies train; one token
    changed in the middle of one shard, with its name, size and header as before, is refused at start on both
    ranks, naming the rank, its host and the shard (exit 1, a data problem), before any log is written."""
    make_dataset(tmp_path / "d", train_tokens=200_000, val_tokens=20_000, n_train_shards=2)
    node2 = tmp_path / "node2"
    shutil.copytree(tmp_path / "d", node2 / "d")
    common = [*TINY, "--train_files=d/fineweb_train_*.bin", "--val_files=d/fineweb_val_*.bin",
              f"--log_dir={tmp_path}/logs"]
    same = run_gloo([*common, "--run_id=same"], 2, tmp_path, cwds={1: node2})
    assert [p.returncode for p in same] == [0, 0], [p.stderr[-2000:] for p in same]

    shard = node2 / "d" / "fineweb_train_000002.bin"
    tokens = np.fromfile(shard, dtype="<u2", offset=1024)
    middle = len(tokens) // 2 + int(tokens[len(tokens) // 2] == BOS)
    _change_token(shard, middle)
    ours = tmp_path / "d" / "fineweb_train_000002.bin"
    assert ours.stat().st_size == shard.stat().st_size and ours.read_bytes()[:1024] == shard.read_bytes()[:1024]
    results = run_gloo([*common, "--run_id=mixed"], 2, tmp_path, cwds={1: node2})
    assert [p.returncode for p in results] == [1, 1], [p.stderr[-2000:] for p in results]
    errors = [line for p in results for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    assert (f"rank 1 (host {socket.gethostname()}) has another fineweb_train_000002.bin: other tokens than rank 0's "
            f"at the same size and header (sha256 {_sha256(shard)[:16]}..., rank 0: {_sha256(ours)[:16]}...)"
            in errors[0]), errors
    assert "Traceback" not in results[0].stderr
    assert not (tmp_path / "logs" / "mixed.txt").exists()
