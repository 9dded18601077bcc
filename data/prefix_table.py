"""Build the prefix-token table that the prefix-token loss reads, from GPT-2's BPE ranks.

    python3 -m pip download --no-deps openai-whisper==20250625 -d /tmp/whisper     # nothing is installed
    python data/prefix_table.py /tmp/whisper/openai_whisper-20250625.tar.gz

Entry T of the table is the id of the longest proper prefix of token T's byte string that is itself a token, or -1
when there is none: for the 256 single bytes, for 50256 (<|endoftext|>, a special token outside the ranks) and for
the padding ids 50257 .. 50303 of the trainer's {entries:,}-row vocabulary. Prefixes are byte prefixes, so they may
cut a UTF-8 character in two. The table is written to --out (default: data/prefix_table.bin, the file the trainer
reads and the repository ships) as {entries:,} little-endian int32 entries, under a temporary name and renamed; a
table whose entries' sha256 (as int64) is not GPT-2's ({digest}...) is refused unless --other_vocab is given.

RANKS, GPT-2's byte strings and their ids (all routes give the same ranks as tiktoken's gpt2 encoding), one of:
  * the openai-whisper sdist (.tar.gz): its member whisper/assets/gpt2.tiktoken is read, without unpacking;
  * a .tiktoken ranks file: lines "base64(bytes) rank" (that member, or tiktoken's r50k_base.tiktoken);
  * GPT-2's encoder.json: token strings in GPT-2's printable byte alphabet -> ids (<|endoftext|> is left out);
  * tiktoken's cache folder ($TIKTOKEN_CACHE_DIR, else <tmp>/data-gym-cache) after tiktoken loaded gpt2 or r50k_base
    once: its cached r50k_base.tiktoken or encoder.json, named by the sha1 of its address, is read.
"""
from __future__ import annotations

import argparse
import base64
import binascii
import collections
import errno
import hashlib
import json
import os
import sys
import tarfile
import time

import numpy as np

import shards    # data/shards.py: the table's file (path, entries, digest), one-line errors
from tokenize_docs import GPT2_FILES

WHISPER_SDIST = "openai-whisper==20250625"
WHISPER_MEMBER = "whisper/assets/gpt2.tiktoken"
R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
SPECIAL_TOKENS = ("<|endoftext|>",)     # in encoder.json, not a BPE token (its id 50256 gets -1)
GET_RANKS = (f"get GPT-2's ranks with `python3 -m pip download --no-deps {WHISPER_SDIST} -d DIR` and pass "
             f"DIR/openai_whisper-20250625.tar.gz")

__doc__ = (__doc__ or "").format(entries=shards.PREFIX_TABLE_ENTRIES, digest=shards.PREFIX_TABLE_SHA256[:16])


def gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted: printable Latin-1 bytes stand for themselves, the
    other 68 bytes are U+0100 onwards in byte order (encoder.json spells every token with these characters)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {chr(b): b for b in printable}
    chars.update((chr(256 + n), b) for n, b in enumerate(others))
    return chars


def fail(where: str, problem: str) -> SystemExit:
    return SystemExit(f"error: {where}: {problem}; {GET_RANKS}")


def parse_tiktoken(data: bytes, where: str) -> dict[bytes, int]:
    """The ranks of a .tiktoken file: one "base64(bytes) rank" per line, blank lines skipped."""
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError
            token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
        except (ValueError, binascii.Error):
            shown = line[:40].decode("latin-1")
            raise fail(f"{where} line {line_no}", f"expected 'base64(bytes) rank', found {shown!r}") from None
        if token in ranks:
            raise fail(f"{where} line {line_no}", f"the byte string {token!r} appears twice")
        ranks[token] = rank
    return ranks


def parse_encoder_json(data: bytes, where: str) -> dict[bytes, int]:
    """The ranks of GPT-2's encoder.json, its token strings mapped back to bytes; special tokens left out."""
    try:
        encoder = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise fail(where, f"not valid JSON ({e})") from None
    if not isinstance(encoder, dict) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                for v in encoder.values()):
        raise fail(where, "expected a JSON object of token strings -> integer ids (GPT-2's encoder.json)")
    alphabet, ranks = gpt2_byte_alphabet(), {}
    for text, rank in encoder.items():
        if text in SPECIAL_TOKENS:
            continue
        strange = next((c for c in text if c not in alphabet), None)
        if strange is not None:
            raise fail(where, f"token {text!r} holds {strange!r}, which is not in GPT-2's byte alphabet")
        token = bytes(alphabet[c] for c in text)
        if token in ranks:
            raise fail(where, f"the byte string {token!r} appears twice")
        ranks[token] = rank
    return ranks


def parse(data: bytes, where: str) -> tuple[dict[bytes, int], str]:
    """(ranks, the format's name) of a .tiktoken file or an encoder.json, told apart by the JSON object's brace."""
    if data.lstrip()[:1] == b"{":
        return parse_encoder_json(data, where), "encoder.json"
    return parse_tiktoken(data, where), "tiktoken ranks"


def read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise fail(path, "no such file") from None
    except OSError as e:
        raise fail(path, f"cannot read it ({e.strerror or e})") from None


def read_ranks(path: str) -> tuple[dict[bytes, int], str]:
    """(ranks, where they came from) of RANKS: an sdist, a folder (tiktoken's cache), or a ranks file."""
    if os.path.isdir(path):
        keys = {hashlib.sha1(url.encode()).hexdigest(): name
                for name, url in (("r50k_base.tiktoken", R50K_URL), ("encoder.json", GPT2_FILES["encoder.json"]))}
        for key, name in keys.items():
            cached = os.path.join(path, key)
            if os.path.isfile(cached):
                ranks, kind = parse(read_file(cached), cached)
                return ranks, f"{cached} ({kind}, tiktoken's cached {name})"
        listed = ", ".join(f"{key} ({name})" for key, name in keys.items())
        raise fail(path, f"a folder, but not a tiktoken cache holding GPT-2's ranks: it lacks {listed}")
    if os.path.isfile(path) and tarfile.is_tarfile(path):
        try:
            with tarfile.open(path) as archive:
                member = next((m for m in archive.getmembers() if m.isfile() and m.name.endswith(WHISPER_MEMBER)),
                              None)
                if member is None:
                    raise fail(path, f"an archive without {WHISPER_MEMBER} (is it the {WHISPER_SDIST} sdist?)")
                data = archive.extractfile(member).read()
        except (tarfile.TarError, OSError, EOFError) as e:
            raise fail(path, f"cannot read the archive ({e})") from None
        where = f"{path}:{member.name}"
        ranks, kind = parse(data, where)
        return ranks, f"{where} ({kind})"
    ranks, kind = parse(read_file(path), path)
    return ranks, f"{path} ({kind})"


def check_ranks(ranks: dict[bytes, int], entries: int, where: str) -> None:
    """Token ids are distinct and fit the table; byte strings are not empty."""
    if not ranks:
        raise fail(where, "no tokens in it")
    if b"" in ranks:
        raise fail(where, "the empty byte string is a token")
    bad = next((r for r in ranks.values() if not 0 <= r < entries), None)
    if bad is not None:
        raise fail(where, f"token id {bad} does not fit the table of {entries:,} entries (ids 0 .. {entries - 1}; "
                          f"--vocab_size sets the size)")
    twice = next((r for r, n in collections.Counter(ranks.values()).items() if n > 1), None)
    if twice is not None:
        raise fail(where, f"token id {twice} is given to two byte strings")


def prefix_table(ranks: dict[bytes, int], entries: int) -> np.ndarray:
    """(entries,) int64: for each id, the id of its token's longest proper byte-prefix that is a token, else -1 (also
    for ids that are no token). Each token tries its prefixes from the longest down."""
    table = np.full(entries, -1, dtype=np.int64)
    for token, rank in ranks.items():
        for end in range(len(token) - 1, 0, -1):
            prefix = ranks.get(token[:end])
            if prefix is not None:
                table[rank] = prefix
                break
    return table


def write_table(path: str, table: np.ndarray) -> None:
    """The entries as little-endian int32, under a temporary name and renamed: a reader never sees a partial table."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(table.astype(shards.PREFIX_TABLE_DTYPE).tobytes())
        os.replace(tmp, path)
    except OSError as e:
        fix = shards.WRITE_FIXES.get(errno.errorcode.get(e.errno, ""), " (choose a writable --out)")
        raise SystemExit(f"error: cannot write {path}: {e.strerror or e}{fix}; the table was not written") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def main(argv: list[str] | None = None) -> int:
    parser = shards.ArgumentParser(prog="data/prefix_table.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ranks", metavar="RANKS", help="GPT-2's BPE ranks: an sdist, a .tiktoken file, an "
                        "encoder.json or tiktoken's cache folder (see above)")
    parser.add_argument("--out", default=shards.PREFIX_TABLE_PATH,
                        help="the table file to write (default: data/prefix_table.bin, the one the trainer reads)")
    parser.add_argument("--vocab_size", type=int, default=shards.PREFIX_TABLE_ENTRIES,
                        help=f"entries of the table (default {shards.PREFIX_TABLE_ENTRIES:,}, the trainer's padded "
                             f"vocabulary)")
    parser.add_argument("--other_vocab", action="store_true",
                        help="write a table that is not GPT-2's (other ranks or --vocab_size); the trainer refuses it")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        if args.vocab_size < 1:
            raise shards.UsageError(f"--vocab_size={args.vocab_size}: must be 1 or more")
        print(f"reading {args.ranks}", flush=True)
        ranks, source = read_ranks(args.ranks)
        check_ranks(ranks, args.vocab_size, args.ranks)
        print(f"{len(ranks):,} tokens from {source}; building the table of {args.vocab_size:,} entries", flush=True)
        table = prefix_table(ranks, args.vocab_size)
        digest = shards.prefix_table_digest(table)
        gpt2 = digest == shards.PREFIX_TABLE_SHA256
        if not gpt2 and not args.other_vocab:
            raise SystemExit(f"error: the table built from {args.ranks} is not GPT-2's (sha256 {digest[:16]}..., "
                             f"expected {shards.PREFIX_TABLE_SHA256[:16]}...), so it was not written: {GET_RANKS}, "
                             f"or pass --other_vocab to write it anyway")
        write_table(args.out, table)
    except shards.UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted; the table was not written", file=sys.stderr)
        return 130
    without, whose = int((table < 0).sum()), " (GPT-2's table)" if gpt2 else ""
    print(f"wrote {args.out}: {len(table):,} entries, {len(table) - without:,} with a prefix token and {without:,} "
          f"without (-1); sha256 {digest}{whose}; {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
