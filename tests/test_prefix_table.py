"""The prefix-token table: the shipped file is GPT-2's table (digest, sum, -1 entries, check rows), data/prefix_table.py
builds what a brute-force transcription of the definition gives from each kind of input it reads, bad input ends in
one `error:` line, and checks.load_prefix_table refuses any other file. No network and no GPT-2 ranks file needed."""
import base64
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from _data_helpers import DATA_DIR, ROOT, load_script

shards = load_script("shards")
pt = load_script("prefix_table")

SHIPPED = os.path.join(DATA_DIR, "prefix_table.bin")
GPT2_DIGEST = "05f2e6adcf3c87e2415b6f6590239f7fc324a13a2aa82c6323bff1bd4a9df136"   # sha256 of the int64 entries
GPT2_SUM = 548_403_601
# id -> the id of its longest proper byte-prefix token, worked out by hand from GPT-2's vocabulary
CHECK_ROWS = {0: -1, 13: -1, 198: -1, 220: -1, 256: 220, 257: 220, 262: 294, 318: 1312, 383: 536, 464: 817,
              1169: 400, 2068: 45567, 7586: 4772, 21831: 11511, 45567: 627, 50255: 17841, 447: 158, 564: 2343,
              1849: 126, 40345: 35098, 1135: 54, 50256: -1, 50257: -1, 50303: -1}

# A small vocabulary: ids with gaps, prefixes that cut UTF-8 characters (E2 80 99 is U+2019), a longest prefix that
# skips a non-token length, a token with no prefix token, and a token next to the special string's prefix.
SMALL = {b"a": 3, b"b": 0, b"\xe2": 7, b"\xe2\x80": 1, b"\xe2\x80\x99": 12, b"\xe2\x80\x99s": 4, b"ab": 9,
         b"abcd": 2, b"abcde": 15, b"xy": 6, b" ": 10, b" \xe2": 11, b" \xe2\x80\x99": 14, b"<|": 5, b"\xff\xfe": 16,
         b"\xff\xfe\xfd": 17}
SMALL_VOCAB = 22                 # ids 8, 13, 18, 19, 21 are no token; 20 is <|endoftext|> in the encoder.json
SPECIAL_ID = 20
CACHE_KEYS = {"tiktoken": "0ea1e91bbb3a60f729a8dc8f777fd2fc07cd8df4",      # sha1 of r50k_base.tiktoken's address
              "encoder.json": "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6"}  # sha1 of gpt2's encoder.json address


def brute_force_table(ranks, entries):
    """The definition read literally: among all tokens that are a shorter, non-empty prefix of T, the longest."""
    table = [-1] * entries
    for token, rank in ranks.items():
        prefixes = [(len(other), r) for other, r in ranks.items() if 0 < len(other) < len(token)
                    and token[:len(other)] == other]
        table[rank] = max(prefixes)[1] if prefixes else -1
    return table


def gpt2_characters():
    """GPT-2's bytes_to_unicode, as in its encoder.py: byte -> the character that spells it in encoder.json."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tiktoken_text(ranks):
    return "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()).encode()


def encoder_json_text(ranks):
    chars = gpt2_characters()
    encoder = {"".join(chars[b] for b in t): r for t, r in ranks.items()}
    encoder["<|endoftext|>"] = SPECIAL_ID
    return json.dumps(encoder).encode()


def write_input(tmp_path, route, ranks):
    """The ranks as RANKS of the given route: a file, tiktoken's cache folder or an sdist; returns its path."""
    if route in ("tiktoken", "encoder.json"):
        path = tmp_path / ("r.tiktoken" if route == "tiktoken" else "encoder.json")
        path.write_bytes(tiktoken_text(ranks) if route == "tiktoken" else encoder_json_text(ranks))
    elif route.startswith("cache"):
        path = tmp_path / "cache"
        path.mkdir()
        kind = route.partition(":")[2]
        (path / CACHE_KEYS[kind]).write_bytes(tiktoken_text(ranks) if kind == "tiktoken" else encoder_json_text(ranks))
        (path / "unrelated").write_bytes(b"not ranks")
    else:
        path = tmp_path / "openai_whisper-0.tar.gz"
        with tarfile.open(path, "w:gz") as archive:
            for name, data in (("openai_whisper-0/whisper/assets/multilingual.tiktoken", b"junk"),
                               ("openai_whisper-0/whisper/assets/gpt2.tiktoken", tiktoken_text(ranks))):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    return str(path)


def run_script(*args):
    return subprocess.run([sys.executable, os.path.join(DATA_DIR, "prefix_table.py"), *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def read_table(path):
    """A table file read by hand: little-endian int32 entries, nothing else."""
    raw = open(path, "rb").read()
    assert len(raw) % 4 == 0
    return np.frombuffer(raw, dtype="<i4").astype(np.int64)


def int64_digest(values):
    return hashlib.sha256(b"".join(int(v).to_bytes(8, "little", signed=True) for v in values)).hexdigest()


def one_error_line(stderr):
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr
    return lines[0]


# ------------------------------------------------------------------------------------------------------------------
# The shipped table
# ------------------------------------------------------------------------------------------------------------------

def test_the_shipped_table_is_gpt2s():
    table = read_table(SHIPPED)
    assert len(table) == 50304
    assert int64_digest(table) == GPT2_DIGEST
    assert int(table.sum()) == GPT2_SUM
    # -1: the 256 single bytes (ids 0..255), <|endoftext|> (50256) and the padding ids 50257..50303
    assert np.flatnonzero(table < 0).tolist() == list(range(256)) + list(range(50256, 50304))
    assert (table >= -1).all() and (table < 50256).all()
    assert shards.PREFIX_TABLE_SHA256 == GPT2_DIGEST and shards.PREFIX_TABLE_ENTRIES == 50304
    assert shards.prefix_table_digest(table) == GPT2_DIGEST
    assert os.path.samefile(shards.PREFIX_TABLE_PATH, SHIPPED)


def test_the_shipped_table_holds_the_check_rows():
    table = read_table(SHIPPED)
    assert {t: int(table[t]) for t in CHECK_ROWS} == CHECK_ROWS


def test_the_loader_gives_the_shipped_table():
    import torch
    import checks
    table = checks.load_prefix_table()
    assert table.dtype == torch.int64 and table.shape == (50304,) and table.device.type == "cpu"
    assert table.tolist() == read_table(SHIPPED).tolist()


# ------------------------------------------------------------------------------------------------------------------
# The loader refuses any other file
# ------------------------------------------------------------------------------------------------------------------

def _corrupted(raw):
    table = np.frombuffer(raw, dtype="<i4").copy()
    table[40345] = 35097                               # one entry off by one
    return table.tobytes()


@pytest.mark.parametrize("make,words", [
    (None, "is missing"),
    (lambda raw: raw[:-4], "has 201212 bytes, not 201216"),
    (lambda raw: raw + b"\0\0\0\0", "has 201220 bytes, not 201216"),
    (lambda raw: np.frombuffer(raw, dtype="<i4").astype("<i8").tobytes(), "has 402432 bytes"),
    (_corrupted, "is not GPT-2's"),
    (lambda raw: np.full(50304, -1, dtype="<i4").tobytes(), "is not GPT-2's"),
])
def test_the_loader_refuses_a_missing_or_other_table(tmp_path, make, words):
    import checks
    from harness import DataError
    path = tmp_path / "prefix_table.bin"
    if make is not None:
        path.write_bytes(make(open(SHIPPED, "rb").read()))
    with pytest.raises(DataError) as e:
        checks.load_prefix_table(str(path))
    message = str(e.value)
    assert words in message and str(path) in message and "python3 data/prefix_table.py" in message
    assert "\n" not in message


# ------------------------------------------------------------------------------------------------------------------
# The script on a small vocabulary, from each kind of input
# ------------------------------------------------------------------------------------------------------------------

def test_the_small_vocabulary_covers_the_cases():
    expected = brute_force_table(SMALL, SMALL_VOCAB)
    assert expected[2] == 9 and expected[14] == 11 and expected[6] == -1 and expected[16] == -1   # skips, none
    assert expected[12] == 1 and expected[1] == 7                                              # cut characters
    assert all(expected[t] == -1 for t in (8, 13, 18, 19, 20, 21))                           # no token


def test_the_table_is_the_definition_in_memory():
    assert pt.prefix_table(SMALL, SMALL_VOCAB).tolist() == brute_force_table(SMALL, SMALL_VOCAB)


@pytest.mark.parametrize("fmt", ["tiktoken", "encoder.json"])
def test_each_format_reads_every_byte(fmt):
    """All 256 single bytes (in a shuffled id order) and SMALL's strings come back as the very byte strings."""
    order = np.random.default_rng(0).permutation(256).tolist()
    ranks = {bytes([b]): 100 + order[b] for b in range(256)} | SMALL
    text = tiktoken_text(ranks) if fmt == "tiktoken" else encoder_json_text(ranks)
    assert pt.parse(text, "ranks") == (ranks, "tiktoken ranks" if fmt == "tiktoken" else "encoder.json")


@pytest.mark.parametrize("route", ["tiktoken", "encoder.json", "cache:tiktoken", "cache:encoder.json", "sdist"])
def test_the_script_builds_the_definition(tmp_path, route):
    ranks_path = write_input(tmp_path, route, SMALL)
    out = tmp_path / "table.bin"
    result = run_script(ranks_path, f"--out={out}", f"--vocab_size={SMALL_VOCAB}", "--other_vocab")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    table = read_table(out)
    assert table.tolist() == brute_force_table(SMALL, SMALL_VOCAB)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("table")) == ["table.bin"]  # no temp file
    last = result.stdout.strip().splitlines()[-1]
    without = sum(v < 0 for v in table)
    assert last.startswith(f"wrote {out}: {SMALL_VOCAB} entries, {SMALL_VOCAB - without} with a prefix token and "
                           f"{without} without (-1); sha256 {int64_digest(table)};")
    assert "GPT-2" not in last


def test_the_script_refuses_a_table_that_is_not_gpt2s(tmp_path):
    ranks_path = write_input(tmp_path, "tiktoken", SMALL)
    out = tmp_path / "table.bin"
    result = run_script(ranks_path, f"--out={out}", f"--vocab_size={SMALL_VOCAB}")
    assert result.returncode == 1
    line = one_error_line(result.stderr)
    assert "is not GPT-2's" in line and "--other_vocab" in line and "pip download" in line
    assert not out.exists()


# ------------------------------------------------------------------------------------------------------------------
# Bad input: one `error:` line naming the fix, nothing written
# ------------------------------------------------------------------------------------------------------------------

def _archive_without_member(tmp_path):
    path = tmp_path / "other.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        info = tarfile.TarInfo("pkg/README")
        archive.addfile(info, io.BytesIO(b""))
    return str(path)


BAD_INPUTS = {
    "missing": (lambda p: str(p / "nowhere.tiktoken"), "no such file"),
    "not ranks": (lambda p: _write(p, b"IQ== 0\nnot a rank line at all\n"), "line 2: expected 'base64(bytes) rank'"),
    "bad base64": (lambda p: _write(p, b"IQ== 0\n!!!! 1\n"), "line 2: expected 'base64(bytes) rank'"),
    "bad rank": (lambda p: _write(p, b"IQ== zero\n"), "line 1: expected 'base64(bytes) rank'"),
    "same bytes twice": (lambda p: _write(p, b"IQ== 0\nIQ== 1\n"), "line 2: the byte string b'!' appears twice"),
    "same id twice": (lambda p: _write(p, b"IQ== 0\nIg== 0\n"), "token id 0 is given to two byte strings"),
    "id too large": (lambda p: _write(p, b"IQ== 0\nIg== 22\n"), "token id 22 does not fit the table of 22 entries"),
    "negative id": (lambda p: _write(p, b"IQ== -1\n"), "token id -1 does not fit"),
    "empty": (lambda p: _write(p, b"\n\n"), "no tokens in it"),
    "empty token": (lambda p: _write(p, b'{"": 0}'), "the empty byte string is a token"),
    "bad json": (lambda p: _write(p, b'{"a": 0,'), "not valid JSON"),
    "json not ids": (lambda p: _write(p, b'{"a": "0"}'), "expected a JSON object of token strings -> integer ids"),
    "json bad char": (lambda p: _write(p, '{"a": 0, "a\u4e00": 1}'.encode()), "not in GPT-2's byte alphabet"),
    "folder": (lambda p: str(p), "a folder, but not a tiktoken cache"),
    "archive": (_archive_without_member, "an archive without whisper/assets/gpt2.tiktoken"),
}


def _write(folder, data):
    path = folder / "ranks"
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_error_line(tmp_path, capsys, case):
    make, words = BAD_INPUTS[case]
    folder = tmp_path / "in"
    folder.mkdir()
    out = tmp_path / "table.bin"
    assert pt.main([make(folder), f"--out={out}", "--vocab_size=22", "--other_vocab"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert words in line and "pip download --no-deps openai-whisper==20250625" in line, line
    assert not out.exists()


def test_an_unwritable_out_is_one_error_line(tmp_path, capsys):
    ranks_path = write_input(tmp_path, "tiktoken", SMALL)
    out = tmp_path / "no" / "such" / "folder" / "table.bin"
    assert pt.main([ranks_path, f"--out={out}", f"--vocab_size={SMALL_VOCAB}", "--other_vocab"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert f"cannot write {out}" in line and "--out" in line and "not written" in line
    assert not out.parent.exists()


def test_a_bad_vocab_size_is_a_usage_error(tmp_path, capsys):
    ranks_path = write_input(tmp_path, "tiktoken", SMALL)
    assert pt.main([ranks_path, "--vocab_size=0"]) == 2
    assert "--vocab_size=0: must be 1 or more" in one_error_line(capsys.readouterr().err)
