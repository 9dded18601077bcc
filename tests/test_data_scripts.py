"""Tests of the scripts under data/: shards.py (the shard format, against the trainer's reader), cached_fineweb10B.py
(with a fake hub: no network), tokenize_docs.py and synthetic.py, including running each one as a script."""
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from _data_helpers import BOS, ROOT, load_script, read_shard, write_shard

shards = load_script("shards")
fineweb = load_script("cached_fineweb10B")
tok = load_script("tokenize_docs")
syn = load_script("synthetic")


def run_script(name, *args, timeout=300, cwd=None):
    return subprocess.run([sys.executable, os.path.join(ROOT, "data", f"{name}.py"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd or ROOT)


# ------------------------------------------------------------------------------------------------------------------
# --help of every script (run as scripts: each finds data/shards.py in its own folder)
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,expected", [
    ("cached_fineweb10B", ["467,927,040", "HF_ENDPOINT", "kjj0/fineweb10B-gpt2"]),
    ("tokenize_docs", ["--encoding", "--val_fraction", "--shard_tokens", ".jsonl", "blank_line"]),
    ("synthetic", ["--preset", "--train_shards", "--shard_tokens", "--val_tokens", "--seed", "median"]),
    ("prefix_table", ["RANKS", "--other_vocab", "openai-whisper==20250625", "gpt2.tiktoken", "encoder.json"]),
])
def test_help(name, expected):
    result = run_script(name, "--help")
    assert result.returncode == 0, result.stderr
    for text in ["usage:"] + expected:
        assert text in result.stdout


def test_default_shard_count_covers_the_record_run():
    # the record: 467,927,040 trained tokens; the record reads about 6-7 shards and asks for at least 9
    assert fineweb.TRAINED_TOKENS == 467_927_040
    assert fineweb.DEFAULT_TRAIN_SHARDS >= 9
    assert fineweb.DEFAULT_TRAIN_SHARDS * 100_000_000 >= 1.5 * 467_927_040
    assert f"the first {fineweb.DEFAULT_TRAIN_SHARDS} train shards" in run_script("cached_fineweb10B", "--help").stdout


# ------------------------------------------------------------------------------------------------------------------
# shards.py: what the data scripts write is what train_gpt.py reads
# ------------------------------------------------------------------------------------------------------------------

def test_shard_format_agrees_with_the_trainer(tmp_path):
    import checks
    import train_gpt as tg
    tokens = np.random.default_rng(0).integers(0, 2**16, 12_345).astype(np.uint16)
    tokens[:2] = BOS, 2**16 - 1                                 # the largest id survives too
    path = str(tmp_path / "fineweb_train_000001.bin")
    shards.write_shard(path, tokens)
    assert listing(tmp_path) == ["fineweb_train_000001.bin"]   # no temporary file left beside it
    assert checks.shard_num_tokens(path) == len(tokens)
    loaded = checks.read_tokens(path)[0]
    assert loaded.dtype == np.uint16 and np.array_equal(loaded, tokens)
    with open(path, "rb") as f:
        assert f.read(shards.SHARD_HEADER_BYTES)[12:] == bytes(shards.SHARD_HEADER_BYTES - 12)  # zeros after the count
    assert shards.check_shard(path) is None
    # a list of ints is written as uint16 too; an id that does not fit is refused, not wrapped
    shards.write_shard(path, [BOS, 1, 2])
    assert checks.read_tokens(path)[0].tolist() == [BOS, 1, 2]
    with pytest.raises(ValueError, match="0 .. 65535"):
        shards.write_shard(path, np.array([BOS, 70_000]))
    assert checks.read_tokens(path)[0].tolist() == [BOS, 1, 2]          # the refused write left the shard as it was


# ------------------------------------------------------------------------------------------------------------------
# cached_fineweb10B.py with a fake hub
# ------------------------------------------------------------------------------------------------------------------

def shard_bytes(n, seed=0):
    tokens = np.random.default_rng(seed).integers(0, 50257, n).astype("<u2")
    header = np.zeros(256, dtype="<i4")
    header[:3] = 20240520, 1, n
    return header.tobytes() + tokens.tobytes()


class FakeHub:
    """fetch(name, dest_dir) like hf_fetch; `script[name]` is a list of actions, one per call (the last repeats):
    "ok", "truncated", "interrupt" (writes half the file, then KeyboardInterrupt), "offline", "missing",
    "flaky" (ConnectionError)."""

    def __init__(self, script=None):
        self.script = script or {}
        self.calls = []

    def __call__(self, name, dest_dir):
        actions = self.script.get(name, ["ok"])
        action = actions[min(sum(c == name for c in self.calls), len(actions) - 1)]
        self.calls.append(name)
        data = shard_bytes(100, seed=len(name))
        path = os.path.join(dest_dir, name)
        if action == "offline":
            raise fineweb.Offline("cannot reach the hub")
        if action == "missing":
            raise fineweb.MissingUpstream("404")
        if action == "flaky":
            raise ConnectionError("reset by peer")
        with open(path, "wb") as f:
            if action == "interrupt":
                f.write(data[:600])
                raise KeyboardInterrupt
            f.write(data[:-2] if action == "truncated" else data)
        return path


def listing(folder):
    return sorted(os.listdir(folder))


def assert_one_error_line(err, *words):
    """A failure a user can cause: stderr is one `error: ...` line holding `words`, and no traceback."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for word in words:
        assert word in lines[0], err


def assert_clean_failure(result, code, *words):
    """The same for a script run in a subprocess, with its exit status."""
    assert result.returncode == code, result.stderr
    assert_one_error_line(result.stderr, *words)


def test_download_all(tmp_path):
    hub, sleeps = FakeHub(), []
    paths = fineweb.download(2, str(tmp_path), fetch=hub, sleep=sleeps.append, log=lambda s: None)
    names = ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    assert hub.calls == names and [os.path.basename(p) for p in paths] == names
    assert listing(tmp_path) == sorted(names)                      # no temporary folders left
    for name in names:
        assert (tmp_path / name).read_bytes() == shard_bytes(100, seed=len(name))
    assert sleeps == []


def test_download_says_a_line_per_shard_as_it_starts_and_ends(tmp_path, capsys):
    """The progress a download shows (./run.sh runs it): a line before each shard and one after each download."""
    write_shard(str(tmp_path / "fineweb_val_000000.bin"), [1, 2, 3])
    assert fineweb.main(["2", "--dir", str(tmp_path)], fetch=FakeHub()) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[1/3] fineweb_val_000000.bin: present and valid, skipped"
    for i, name in ((2, "fineweb_train_000001.bin"), (3, "fineweb_train_000002.bin")):
        at = lines.index(f"[{i}/3] {name}: downloading")
        assert re.fullmatch(rf"\[{i}/3\] {name}: done \(0 MB in \d+s\)", lines[at + 1]), lines
    assert lines[-1].startswith(f"3 shards ready in {tmp_path}")


def test_skip_valid_and_replace_invalid(tmp_path):
    write_shard(str(tmp_path / "fineweb_val_000000.bin"), [1, 2, 3])               # valid: kept
    write_shard(str(tmp_path / "fineweb_train_000001.bin"), [1, 2, 3], header_count=4)  # truncated: replaced
    write_shard(str(tmp_path / "fineweb_train_000002.bin"), [1, 2, 3], magic=5)    # wrong magic: replaced
    # a negative count whose size "fits" (1024 - 2 * 12 bytes, the header cut short): replaced
    (tmp_path / "fineweb_train_000003.bin").write_bytes(np.array([20240520, 1, -12], "<i4").tobytes() + bytes(988))
    assert shards.check_shard(str(tmp_path / "fineweb_train_000003.bin")) == "bad token count -12"
    hub = FakeHub()
    fineweb.download(3, str(tmp_path), fetch=hub, sleep=lambda s: None, log=lambda s: None)
    assert hub.calls == ["fineweb_train_000001.bin", "fineweb_train_000002.bin", "fineweb_train_000003.bin"]
    assert read_shard(str(tmp_path / "fineweb_val_000000.bin")) == [1, 2, 3]
    assert (tmp_path / "fineweb_train_000001.bin").read_bytes() == shard_bytes(100, seed=24)


def test_partial_download_is_retried_then_rejected(tmp_path):
    hub, sleeps = FakeHub({"fineweb_train_000001.bin": ["truncated", "ok"]}), []
    fineweb.download(1, str(tmp_path), fetch=hub, sleep=sleeps.append, log=lambda s: None)
    assert hub.calls.count("fineweb_train_000001.bin") == 2 and sleeps == [2.0]
    assert shards.check_shard(str(tmp_path / "fineweb_train_000001.bin")) is None
    hub = FakeHub({"fineweb_train_000002.bin": ["truncated"]})
    with pytest.raises(fineweb.DownloadError, match="invalid: truncated"):
        fineweb.download(2, str(tmp_path), fetch=hub, attempts=3, sleep=lambda s: None, log=lambda s: None)
    assert hub.calls == ["fineweb_train_000002.bin"] * 3
    assert "fineweb_train_000002.bin" not in listing(tmp_path)     # never under the final name
    assert not [e for e in listing(tmp_path) if e.startswith(".")]


def test_interrupted_download_leaves_no_partial_file(tmp_path, capsys):
    hub = FakeHub({"fineweb_train_000001.bin": ["interrupt"]})
    with pytest.raises(KeyboardInterrupt):
        fineweb.download(2, str(tmp_path), fetch=hub, sleep=lambda s: None, log=lambda s: None)
    assert listing(tmp_path) == ["fineweb_val_000000.bin"]        # the complete one stays; nothing partial
    assert fineweb.main(["2", "--dir", str(tmp_path)], fetch=hub) == 130
    assert_one_error_line(capsys.readouterr().err, "interrupted", "run again")
    assert listing(tmp_path) == ["fineweb_val_000000.bin"]
    # a folder left by a killed run is cleaned up by the next run, which completes
    os.makedirs(tmp_path / (fineweb.TEMP_PREFIX + "killed"))
    (tmp_path / (fineweb.TEMP_PREFIX + "killed") / "fineweb_train_000001.bin").write_bytes(b"partial")
    assert fineweb.main(["2", "--dir", str(tmp_path)], fetch=FakeHub()) == 0
    assert listing(tmp_path) == ["fineweb_train_000001.bin", "fineweb_train_000002.bin", "fineweb_val_000000.bin"]


def test_missing_upstream_is_not_retried(tmp_path, capsys):
    hub = FakeHub({"fineweb_train_000002.bin": ["missing"]})
    assert fineweb.main(["2", "--dir", str(tmp_path)], fetch=hub) == 1
    assert hub.calls == ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    assert_one_error_line(capsys.readouterr().err, "fineweb_train_000002.bin is not available", "103 train shards")
    assert listing(tmp_path) == ["fineweb_train_000001.bin", "fineweb_val_000000.bin"]     # complete ones: resumable


def test_offline_gives_up_with_advice(tmp_path, capsys, monkeypatch):
    hub = FakeHub({"fineweb_val_000000.bin": ["offline"]})
    sleeps = []
    monkeypatch.setattr(fineweb.time, "sleep", sleeps.append)
    assert fineweb.main(["1", "--dir", str(tmp_path), "--attempts", "3"], fetch=hub) == 1
    assert hub.calls == ["fineweb_val_000000.bin"] * 3 and sleeps == [2.0, 4.0]
    assert_one_error_line(capsys.readouterr().err, "HF_ENDPOINT", "data/synthetic.py", "copy")
    assert listing(tmp_path) == []


def test_transient_error_is_retried(tmp_path):
    hub = FakeHub({"fineweb_val_000000.bin": ["flaky", "flaky", "ok"]})
    fineweb.download(0, str(tmp_path), fetch=hub, attempts=3, sleep=lambda s: None, log=lambda s: None)
    assert listing(tmp_path) == ["fineweb_val_000000.bin"]


def test_hub_errors_are_classified(monkeypatch, tmp_path):
    import huggingface_hub
    from huggingface_hub import errors

    def raiser(exc):
        def fake(**kwargs):
            raise exc
        return fake

    # LocalEntryNotFoundError (cannot reach the hub) is a subclass of EntryNotFoundError: it must count as offline
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", raiser(errors.LocalEntryNotFoundError("no connection")))
    with pytest.raises(fineweb.Offline):
        fineweb.hf_fetch("fineweb_val_000000.bin", str(tmp_path))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", raiser(errors.EntryNotFoundError("404")))
    with pytest.raises(fineweb.MissingUpstream):
        fineweb.hf_fetch("fineweb_train_999999.bin", str(tmp_path))
    seen = {}

    def fake_ok(**kwargs):
        seen.update(kwargs)
        return "somewhere"
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_ok)
    assert fineweb.hf_fetch("fineweb_val_000000.bin", str(tmp_path)) == "somewhere"
    assert seen == dict(repo_id="kjj0/fineweb10B-gpt2", filename="fineweb_val_000000.bin", repo_type="dataset",
                        local_dir=str(tmp_path))


# ------------------------------------------------------------------------------------------------------------------
# tokenize_docs.py
# ------------------------------------------------------------------------------------------------------------------

def decode_docs(paths):
    """Documents (as str) in the shards, in order, decoded with the byte encoding (ids 0..255 are bytes)."""
    tokens = [t for p in paths for t in read_shard(p)]
    docs, current = [], None
    for t in tokens:
        if t == BOS:
            if current is not None:
                docs.append(bytes(current).decode("utf-8"))
            current = []
        else:
            current.append(t)
    docs.append(bytes(current).decode("utf-8"))
    return docs


def test_tokenize_script_round_trip(tmp_path):
    docs = [f"document {i}: caf\u00e9 \u2014 {'word ' * (i * 3)}end." for i in range(12)]
    (tmp_path / "a.txt").write_text(docs[0], encoding="utf-8")
    (tmp_path / "b.txt").write_text(docs[1], encoding="utf-8")
    with open(tmp_path / "c.jsonl", "w", encoding="utf-8") as f:
        for d in docs[2:]:
            f.write(json.dumps({"text": d, "id": 1}) + "\n\n")          # blank lines are skipped
    out = tmp_path / "out"
    result = run_script("tokenize_docs", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), str(tmp_path / "c.jsonl"),
                        "--out", str(out), "--encoding=bytes", "--val_docs=2", "--shard_tokens=300", "--prefix=demo",
                        cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    val = sorted(str(p) for p in out.glob("demo_val_*.bin"))
    train = sorted(str(p) for p in out.glob("demo_train_*.bin"))
    assert [os.path.basename(p) for p in val] == ["demo_val_000000.bin"]
    assert os.path.basename(train[0]) == "demo_train_000001.bin" and len(train) > 2
    assert decode_docs(val) == docs[:2] and decode_docs(train) == docs[2:]
    for p in train:
        tokens = read_shard(p)
        assert tokens[0] == BOS and len(tokens) <= 300                   # documents kept whole, shards capped
    assert "--train_files=" in result.stdout


def test_tokenize_splits_and_val_fraction(tmp_path):
    blocks = [f"block {i} " + "x" * i for i in range(8)]
    (tmp_path / "t.txt").write_text("\n\n".join(blocks[:4]) + "\n \n" + "\n\n\n".join(blocks[4:]), encoding="utf-8")
    enc = tok.get_encoding("bytes")
    res = tok.tokenize_to_shards([str(tmp_path / "t.txt")], str(tmp_path / "o"), enc, val_fraction=0.25,
                                 txt_split="blank_line", threads=1)
    # document i goes to val when floor((i+1)/4) > floor(i/4): i = 3 and 7
    assert decode_docs(res["val"]) == [blocks[3], blocks[7]]
    assert decode_docs(res["train"]) == [b for i, b in enumerate(blocks) if i not in (3, 7)]
    with pytest.raises(SystemExit, match="no documents went to validation"):
        tok.tokenize_to_shards([str(tmp_path / "t.txt")], str(tmp_path / "q"), enc, val_docs=0, threads=1)


def test_tokenize_long_document_is_split(tmp_path):
    (tmp_path / "long.txt").write_text("a" * 999, encoding="utf-8")
    (tmp_path / "short.txt").write_text("b", encoding="utf-8")
    res = tok.tokenize_to_shards([str(tmp_path / "short.txt"), str(tmp_path / "long.txt")], str(tmp_path / "o"),
                                 tok.get_encoding("bytes"), shard_tokens=400, val_docs=1, threads=1)
    sizes = [len(read_shard(p)) for p in res["train"]]
    assert sizes == [400, 400, 200] and res["train_tokens"] == 1000
    assert read_shard(res["val"][0]) == [BOS, ord("b")]


def test_tokenize_bad_inputs(tmp_path, monkeypatch):
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n', encoding="utf-8")
    with pytest.raises(SystemExit, match=r"bad.jsonl:1: .*--text_field"):
        tok.tokenize_to_shards([str(tmp_path / "bad.jsonl")], str(tmp_path / "o"), tok.get_encoding("bytes"))
    with pytest.raises(SystemExit, match="does not exist"):
        tok.tokenize_to_shards([str(tmp_path / "nope.txt")], str(tmp_path / "o"), tok.get_encoding("bytes"))
    import tiktoken

    def offline(name):
        raise ConnectionError("no network")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(SystemExit, match="--encoding=bytes"):
        tok.get_encoding("gpt2")


def test_bytes_encoding():
    enc = tok.get_encoding("bytes")
    text = "h\u00e9llo <|endoftext|>"
    assert enc.encode_ordinary(text) == list(text.encode("utf-8"))
    assert enc.eot_token == BOS


# ------------------------------------------------------------------------------------------------------------------
# synthetic.py
# ------------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vocab():
    return syn.Vocabulary(seed=3)


def test_synthetic_statistics(vocab):
    tokens = syn.make_tokens(vocab, [3, 1, 1], 2_000_000, 0.5)
    assert tokens.dtype == np.uint16 and len(tokens) == 2_000_000 and tokens[0] == BOS and tokens.max() <= BOS
    bos = np.flatnonzero(tokens == BOS)
    lengths = np.diff(bos, append=len(tokens))
    assert 330 <= np.median(lengths) <= 480                    # median ~400 tokens
    assert 0.02 <= (lengths > 2048).mean() <= 0.10             # a tail past the 2048 cap
    words = tokens[tokens != BOS]
    counts = np.sort(np.bincount(words, minlength=50256))[::-1]
    slope = np.log(counts[999] / counts[9]) / np.log(1000 / 10)
    assert -1.6 < slope < -0.6                                  # Zipf-like rank/frequency
    # learnable: the most frequent successor of each token (fit on the first half) predicts the second half far
    # better than the most frequent token overall
    prev, nxt = tokens[:-1].astype(np.int64), tokens[1:].astype(np.int64)
    keep = (prev != BOS) & (nxt != BOS)
    prev, nxt = prev[keep], nxt[keep]
    half = len(prev) // 2
    pairs = prev[:half] * 65536 + nxt[:half]
    uniq, cnt = np.unique(pairs, return_counts=True)
    order = np.lexsort((-cnt, uniq // 65536))
    first = np.unique(uniq[order] // 65536, return_index=True)[1]
    best_next = dict(zip((uniq[order][first] // 65536).tolist(), (uniq[order][first] % 65536).tolist()))
    guesses = np.array([best_next.get(p, -1) for p in prev[half:].tolist()])
    bigram_accuracy = (guesses == nxt[half:]).mean()
    unigram_accuracy = (nxt[half:] == np.bincount(nxt[:half]).argmax()).mean()
    assert bigram_accuracy > 0.35 and unigram_accuracy < 0.1


def test_synthetic_determinism(vocab):
    a = syn.make_tokens(vocab, [3, 1, 2], 300_000, 0.5)
    assert np.array_equal(a, syn.make_tokens(syn.Vocabulary(seed=3), [3, 1, 2], 300_000, 0.5))
    assert not np.array_equal(a, syn.make_tokens(vocab, [3, 1, 3], 300_000, 0.5))


def test_synthetic_presets(tmp_path):
    import checks
    import train_gpt as tg
    bench = dict(train_shards=1, shard_tokens=100_000_000, val_tokens=10_485_762)
    assert syn.resolve_sizes("bench", {}) == bench
    assert syn.resolve_sizes("bench", {"train_shards": 3, "val_tokens": None}) == {**bench, "train_shards": 3}
    assert syn.resolve_sizes("tiny", {}) == dict(train_shards=1, shard_tokens=2_000_000, val_tokens=20_000)
    assert syn.resolve_sizes("full", {}) == {**bench, "train_shards": 6}
    assert syn.resolve_sizes(None, {"val_tokens": 5}) == dict(train_shards=9, shard_tokens=100_000_000, val_tokens=5)
    # the val shard covers the validation of the trainer's defaults and of its tiny preset (+ 2: see synthetic.py)
    assert tg.parse_args([]).val_tokens + 2 <= bench["val_tokens"]
    assert tg.parse_args(["--preset=tiny"]).val_tokens + 2 <= syn.PRESETS["tiny"]["val_tokens"]
    # the full preset (bench/run.sh full) holds what the default schedule reads, so its data check passes quietly, and
    # one shard more (synthetic.py says why), not two
    full = syn.PRESETS["full"]
    needed = tg.train_tokens_needed(tg.parse_args([])) * checks.TRAIN_READ_FACTOR
    assert full["train_shards"] * full["shard_tokens"] >= needed > (full["train_shards"] - 2) * full["shard_tokens"]
    # through the command line: the preset's shard count, the explicit sizes
    out = tmp_path / "out"
    assert syn.main(["--out", str(out), "--preset=tiny", "--shard_tokens=1000", "--val_tokens=500", "--workers=1"]) == 0
    assert listing(out) == ["fineweb_train_000001.bin", "fineweb_val_000000.bin"]
    assert len(read_shard(str(out / "fineweb_train_000001.bin"))) == 1000
    assert len(read_shard(str(out / "fineweb_val_000000.bin"))) == 500


def test_synthetic_unknown_preset(tmp_path):
    result = run_script("synthetic", "--out", str(tmp_path / "out"), "--preset=huge")
    assert_clean_failure(result, 2, "--preset=huge", "tiny, bench, full")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_synthetic_script_is_worker_count_independent(tmp_path):
    args = ["--train_shards", "3", "--shard_tokens", "200000", "--val_tokens", "50000", "--seed", "9"]
    result = run_script("synthetic", "--out", str(tmp_path / "two"), "--workers", "2", *args, timeout=600)
    assert result.returncode == 0, result.stderr
    assert syn.main(["--out", str(tmp_path / "one"), "--workers", "1", *args]) == 0
    names = ["fineweb_train_000001.bin", "fineweb_train_000002.bin", "fineweb_train_000003.bin",
             "fineweb_val_000000.bin"]
    assert listing(tmp_path / "two") == names == listing(tmp_path / "one")
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    assert len(read_shard(str(tmp_path / "one" / "fineweb_val_000000.bin"))) == 50_000
    assert len(read_shard(str(tmp_path / "one" / "fineweb_train_000002.bin"))) == 200_000


# ------------------------------------------------------------------------------------------------------------------
# Failures a user can cause: one `error:` line, exit 2 (a bad option) / 1 (data, files) / 130 (Ctrl-C), no traceback,
# and no partial output (shards, temporary files, staging folders); an earlier run's shard set stays as it was
# ------------------------------------------------------------------------------------------------------------------

SYN_SMALL = ["--train_shards=3", "--shard_tokens=1000", "--val_tokens=500", "--workers=1"]


def text_inputs(folder, num_docs):
    """A .jsonl of num_docs short documents (about 25 tokens each with the bytes encoding)."""
    path = folder / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}: a few words"}) + "\n" for i in range(num_docs)),
                    encoding="utf-8")
    return path


def snapshot(folder):
    return {name: (folder / name).read_bytes() for name in listing(folder)}


@pytest.mark.parametrize("flag", ["--train_shards=-1", "--shard_tokens=0", f"--shard_tokens={2**31}",
                                  "--val_tokens=0", "--follow_prob=1.0", "--follow_prob=nan", "--seed=-1",
                                  "--workers=0"])
def test_synthetic_bad_option(tmp_path, capsys, flag):
    out = tmp_path / "out"
    assert syn.main(["--out", str(out), *SYN_SMALL, flag]) == 2
    assert_one_error_line(capsys.readouterr().err, flag)
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--shard_tokens=1", f"--shard_tokens={2**31}", "--val_fraction=0",
                                  "--val_fraction=1.5", "--val_docs=0", "--threads=0", "--prefix=", "--prefix=a/b"])
def test_tokenize_bad_option(tmp_path, capsys, flag):
    out = tmp_path / "out"
    assert tok.main([str(text_inputs(tmp_path, 4)), "--out", str(out), "--encoding=bytes", flag]) == 2
    assert_one_error_line(capsys.readouterr().err, flag.split("=")[0])
    assert not out.exists()


@pytest.mark.parametrize("case,args,words", [
    ("nope.txt", [], ["nope.txt", "does not exist"]),
    ("a.csv", [], ["a.csv", "only .txt and .jsonl"]),
    ("", [], ["no .txt or .jsonl files"]),                                  # a folder without inputs
    ("blank.jsonl", [], ["no documents in the input"]),
    ("bad.jsonl", [], ["bad.jsonl:2", "--text_field"]),
    ("docs.jsonl", ["--val_docs=41"], ["no documents left for training", "--val_docs"]),      # val > the data
    ("docs.jsonl", ["--val_fraction=0.01"], ["no documents went to validation", "--val_fraction"]),
])
def test_tokenize_bad_data(tmp_path, capsys, case, args, words):
    src = tmp_path / "src"
    src.mkdir()
    contents = {"a.csv": "a,b\n", "blank.jsonl": "\n  \n", "bad.jsonl": '{"text": "ok"}\n{"body": "x"}\n'}
    if case in contents:
        (src / case).write_text(contents[case], encoding="utf-8")
    if case == "docs.jsonl":
        text_inputs(src, 40)
    out = tmp_path / "out"
    assert tok.main([str(src / case), "--out", str(out), "--encoding=bytes", *args]) == 1
    assert_one_error_line(capsys.readouterr().err, *words)
    assert not out.exists()


def test_tokenize_skips_blank_documents(tmp_path):
    """An empty or blank .txt file (one document each, by default) and a blank .jsonl text are no documents."""
    (tmp_path / "a.txt").write_text("first document")
    (tmp_path / "b.txt").write_text("")
    (tmp_path / "c.txt").write_text(" \n\t\n")
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": "second"}) + "\n")
    result = tok.tokenize_to_shards([str(tmp_path)], str(tmp_path / "out"), tok.get_encoding("bytes"), val_docs=1,
                                    threads=1)
    assert result["docs"] == 2
    assert decode_docs(result["val"] + result["train"]) == ["first document", "second"]


def test_tokenize_read_error_names_the_file(tmp_path, capsys, monkeypatch):
    docs = text_inputs(tmp_path, 4)
    file_documents = tok.file_documents

    def failing(path, txt_split, text_field):
        yield from file_documents(path, txt_split, text_field)
        raise OSError(errno.EIO, "Input/output error")          # no filename, as a failing read raises it
    monkeypatch.setattr(tok, "file_documents", failing)
    out = tmp_path / "out"
    assert tok.main([str(docs), "--out", str(out), "--encoding=bytes", "--val_docs=1"]) == 1
    assert_one_error_line(capsys.readouterr().err, f"cannot read {docs}: Input/output error", "no shards were written")
    assert not out.exists()


@pytest.mark.parametrize("ext,line", [("txt", 3), ("jsonl", 2)])
def test_tokenize_not_utf8_half_way_keeps_the_earlier_set(tmp_path, ext, line):
    docs = text_inputs(tmp_path, 700)           # more than one encode batch: shards are written before the bad file
    out = tmp_path / "out"
    assert tok.main([str(docs), "--out", str(out), "--encoding=bytes", "--val_docs=2"]) == 0
    (out / "notes.txt").write_text("not a shard")
    before = snapshot(out)
    text = '{"text": "ok"}\n{"text": "caf\xe9"}\n' if ext == "jsonl" else "line one\nline two\ncaf\xe9\n"
    (tmp_path / f"z.{ext}").write_bytes(text.encode("latin-1"))
    result = run_script("tokenize_docs", str(docs), str(tmp_path / f"z.{ext}"), "--out", str(out), "--encoding=bytes",
                        "--val_docs=2", "--shard_tokens=2000", "--threads=1")
    assert_clean_failure(result, 1, f"z.{ext}:{line}:", "not UTF-8", "0xe9", "iconv")
    assert "wrote text_train_000002.bin" in result.stdout                  # it failed half-way
    assert snapshot(out) == before                                          # the earlier set, nothing else


@pytest.mark.parametrize("exc,code,words", [(OSError(errno.ENOSPC, "No space left on device"), 1,
                                             ["No space left on device", "no shards were written"]),
                                            (KeyboardInterrupt(), 130, ["interrupted", "no shards were written"])])
def test_tokenize_failure_half_way_leaves_nothing(tmp_path, capsys, monkeypatch, exc, code, words):
    write_shard = shards.write_shard

    def failing(path, tokens):                  # the 3rd shard fails (a full disk, Ctrl-C)
        if "_train_000002" in path:
            raise exc
        write_shard(path, tokens)
    monkeypatch.setattr(shards, "write_shard", failing)
    out = tmp_path / "out"
    assert tok.main([str(text_inputs(tmp_path, 40)), "--out", str(out), "--encoding=bytes", "--val_docs=2",
                     "--shard_tokens=100"]) == code
    captured = capsys.readouterr()
    assert_one_error_line(captured.err, *words)
    assert "wrote text_train_000001.bin" in captured.out
    assert not out.exists()                     # created by the run, so removed with its partial shards


@pytest.mark.parametrize("workers,exc,code,words", [
    (1, OSError(errno.ENOSPC, "No space left on device"), 1, ["No space left on device (free space, or choose another "
                                                              "--out)", "no shards were written"]),
    (2, OSError(errno.ENOSPC, "No space left on device"), 1, ["No space left on device", "no shards were written"]),
    (1, KeyboardInterrupt(), 130, ["interrupted", "no shards were written"])])
def test_synthetic_failure_half_way_keeps_the_earlier_set(tmp_path, capsys, monkeypatch, workers, exc, code, words):
    out = tmp_path / "out"
    assert syn.main(["--out", str(out), "--train_shards=1", "--shard_tokens=700", "--val_tokens=300",
                     "--workers=1"]) == 0
    (out / "notes.txt").write_text("not a shard")
    before = snapshot(out)
    make_tokens = syn.make_tokens

    def failing(vocab, seed_words, num_tokens, follow_prob):    # train shard 2 of 3 fails (in a worker if any)
        if seed_words[2] == 2:
            raise exc
        return make_tokens(vocab, seed_words, num_tokens, follow_prob)
    monkeypatch.setattr(syn, "make_tokens", failing)
    capsys.readouterr()
    assert syn.main(["--out", str(out), *SYN_SMALL, f"--workers={workers}"]) == code
    assert_one_error_line(capsys.readouterr().err, *words)
    assert snapshot(out) == before


def default_sigint() -> None:
    """In the child before exec: a shell starts background jobs with SIGINT ignored, and an ignored signal stays
    ignored across exec (Python then installs no KeyboardInterrupt handler), so a test run in the background would
    send a Ctrl-C nobody receives."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_synthetic_ctrl_c_with_workers_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "data", "synthetic.py"), "--out", str(out),
                             "--train_shards=4", "--shard_tokens=20000000", "--val_tokens=1000", "--workers=2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=default_sigint)
    try:
        # Ctrl-C, as a terminal sends it to the whole process group, once a worker has written the (small) val shard
        deadline = time.monotonic() + 60
        while not list(out.glob(".staging-*/fineweb_val_000000.bin")) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert_one_error_line(err, "interrupted")
    assert not out.exists()


def test_rerun_replaces_the_earlier_shard_set(tmp_path):
    docs, out, enc = text_inputs(tmp_path, 40), tmp_path / "out", tok.get_encoding("bytes")
    first = tok.tokenize_to_shards([str(docs)], str(out), enc, shard_tokens=100, val_docs=2, threads=1)
    (out / "notes.txt").write_text("not a shard")
    (out / "other_train_000001.bin").write_bytes(b"another prefix")
    second = tok.tokenize_to_shards([str(docs)], str(out), enc, val_docs=2, threads=1)
    assert len(first["train"]) > 2 and len(second["train"]) == 1
    # the first run's train shards 2.. are gone (a glob would mix them in); other files stay
    assert listing(out) == ["notes.txt", "other_train_000001.bin", "text_train_000001.bin", "text_val_000000.bin"]
    assert decode_docs(second["val"] + second["train"]) == [f"document {i}: a few words" for i in range(40)]


@pytest.mark.parametrize("inside", [False, True])           # --out is a file / is under a file
@pytest.mark.parametrize("name,flag", [("synthetic", "--out"), ("tokenize_docs", "--out"),
                                       ("cached_fineweb10B", "--dir")])
def test_output_folder_cannot_be_created(tmp_path, name, flag, inside):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    target = blocker / "out" if inside else blocker
    if name == "tokenize_docs":
        args = [str(text_inputs(tmp_path, 4)), "--encoding=bytes"]
    else:
        args = SYN_SMALL if name == "synthetic" else ["1"]
    result = run_script(name, *args, flag, str(target))
    assert_clean_failure(result, 1, "cannot create", str(target), flag)
    assert set(listing(tmp_path)) - {"docs.jsonl"} == {"file"}
    assert blocker.read_text() == "not a folder"


@pytest.mark.parametrize("args,words", [(["104"], ["104", "has 103", "0 .. 103"]), (["-1"], ["-1", "0 .. 103"]),
                                        (["2", "--attempts=0"], ["--attempts=0"])])
def test_fineweb_bad_counts(tmp_path, capsys, args, words):
    hub = FakeHub()
    assert fineweb.main([*args, "--dir", str(tmp_path / "d")], fetch=hub) == 2
    assert_one_error_line(capsys.readouterr().err, *words)
    assert hub.calls == [] and not (tmp_path / "d").exists()


@pytest.mark.parametrize("name,args,words", [
    ("cached_fineweb10B", ["2.5"], ["invalid int value: '2.5'"]), ("cached_fineweb10B", ["ten"], ["'ten'"]),
    ("cached_fineweb10B", ["1", "2"], ["unrecognized arguments: 2"]),
    ("synthetic", ["--train_shards=abc"], ["--train_shards", "'abc'"]),
    ("synthetic", ["--train_shards"], ["--train_shards", "expected one argument"]),
    ("tokenize_docs", ["--out"], ["--out"]),
    ("tokenize_docs", ["x.txt", "--val_docs=5", "--val_fraction=0.1"], ["--val_fraction", "--val_docs"])])
def test_usage_errors_are_one_line(tmp_path, name, args, words):
    """argparse's own errors (a type, a missing or extra argument, exclusive options) as every other failure: one
    `error:` line naming the script's --help, no usage block, exit 2, nothing written."""
    flag = "--dir" if name == "cached_fineweb10B" else "--out"
    result = run_script(name, *args, *([flag, str(tmp_path / "d")] if "--out" not in args else []))
    assert_clean_failure(result, 2, *words, f"see data/{name}.py --help")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("name", ["synthetic", "tokenize_docs"])
def test_a_folder_in_the_way_of_a_shard_changes_nothing(tmp_path, name):
    """A rename cannot replace a folder: found before any shard moves, so the earlier set stays whole (the second
    run's shards differ from the first's, so a half-moved set would show)."""
    out = tmp_path / "out"
    if name == "synthetic":
        first, second, blocked = SYN_SMALL, [*SYN_SMALL, "--seed=1"], "fineweb_train_000002.bin"
    else:
        tokenize = ["--encoding=bytes", "--val_docs=2", "--shard_tokens=100"]
        first = [str(text_inputs(tmp_path, 40)), *tokenize]
        (tmp_path / "more").mkdir()
        second = [str(text_inputs(tmp_path / "more", 41)), *tokenize]
        blocked = "text_train_000002.bin"
    assert run_script(name, *first, "--out", str(out)).returncode == 0
    os.remove(out / blocked)
    (out / blocked).mkdir()
    files = lambda: {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}   # noqa: E731
    before = files()
    result = run_script(name, *second, "--out", str(out))
    assert_clean_failure(result, 1, str(out / blocked), "is a folder", "no shards were written")
    assert files() == before and (out / blocked).is_dir() and not list(out.glob(".staging-*"))


def test_fineweb_a_folder_in_the_way_of_a_shard(tmp_path, capsys):
    (tmp_path / "fineweb_train_000001.bin").mkdir()
    hub = FakeHub()
    assert fineweb.main(["1", "--dir", str(tmp_path)], fetch=hub) == 1
    assert_one_error_line(capsys.readouterr().err, "fineweb_train_000001.bin is a folder", "--dir")
    assert listing(tmp_path) == ["fineweb_train_000001.bin", "fineweb_val_000000.bin"]   # the val shard came first


@pytest.mark.parametrize("name,flag", [("synthetic", "--out"), ("tokenize_docs", "--out"),
                                       ("cached_fineweb10B", "--dir")])
def test_an_output_folder_that_takes_no_files(tmp_path, name, flag):
    """/proc exists but takes no new files: the error names the folder and the flag, not a temporary name."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux's /proc")
    args = {"synthetic": SYN_SMALL, "tokenize_docs": [str(text_inputs(tmp_path, 4)), "--encoding=bytes"],
            "cached_fineweb10B": ["1"]}[name]
    result = run_script(name, *args, flag, "/proc")
    assert_clean_failure(result, 1, "cannot write into", "/proc", flag)
    assert ".staging-" not in result.stderr and ".download-" not in result.stderr


def test_fineweb_without_huggingface_hub(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)          # imports fail as if it were not installed
    assert fineweb.main(["1", "--dir", str(tmp_path / "d")]) == 1
    assert_one_error_line(capsys.readouterr().err, "huggingface_hub", "pip install")
    assert not (tmp_path / "d").exists()
