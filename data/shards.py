"""The token shard format, defined here once, and how the scripts in data/ write and check shards. train_gpt.py
imports the format's constants from here (from data.shards import ...) for the loader that reads shards
(tests/test_data_scripts.py checks that train_gpt.py reads what this writes). The prefix-token table's file is
defined here too: data/prefix_table.py writes it, checks.py's loader reads it.

numpy and the standard library only: a data script imports no torch and none of the trainer's files, so it starts in
well under a second.

Not a script. The scripts import it as `shards`: a script's folder is the first entry of sys.path. Code that imports
a script from elsewhere puts data/ on sys.path first; the trainer, from the repository root, imports it as data.shards
(data/ is a regular package for that).

Errors: every failure a user can cause ends in one `error: ...` line on stderr and no traceback. A bad option raises
UsageError (exit 2); a data problem raises SystemExit("error: ...") (exit 1, and a clean exit for callers of the
functions too); file-system errors (OSError) exit 1 and Ctrl-C exits 130.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import os
import re
import shutil
import sys
import tempfile
from typing import Callable, Iterator

import numpy as np

# The shard format, its one definition (train_gpt.py's reader imports these). A shard is a header of 256 little-endian
# int32 words: SHARD_MAGIC, SHARD_VERSION, the token count n, then zeros (1024 bytes); then n little-endian uint16
# tokens, nothing after them (its size is exactly SHARD_HEADER_BYTES + 2 * n).
SHARD_MAGIC = 20240520
SHARD_VERSION = 1
SHARD_HEADER_BYTES = 1024

MAX_SHARD_TOKENS = 2**31 - 1       # the header holds the token count as an int32
STAGING_PREFIX = ".staging-"       # a run's shards are written here, inside the output folder, until all are complete


# The prefix-token table's file, its one definition. Entry T (T < PREFIX_TABLE_ENTRIES, GPT-2's ids padded as the
# trainer's vocabulary) is the id of the longest proper byte-prefix of token T that is itself a token, -1 if none.
# The file holds the entries as little-endian int32 and nothing else; it is shipped in the repository.
PREFIX_TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prefix_table.bin")
PREFIX_TABLE_ENTRIES = 50304
PREFIX_TABLE_DTYPE = "<i4"
PREFIX_TABLE_SHA256 = "05f2e6adcf3c87e2415b6f6590239f7fc324a13a2aa82c6323bff1bd4a9df136"   # GPT-2's table


def prefix_table_digest(table: np.ndarray) -> str:
    """sha256 of a prefix-token table's entries as little-endian int64 (the file's int32 width does not enter it)."""
    return hashlib.sha256(np.asarray(table).astype("<i8").tobytes()).hexdigest()


def write_shard(path: str, tokens: np.ndarray) -> None:
    """Header + uint16 tokens, written under a temporary name and renamed, so a reader never sees a partial shard."""
    tokens = np.asarray(tokens)
    if len(tokens) > MAX_SHARD_TOKENS:
        raise ValueError(f"{path}: {len(tokens):,} tokens do not fit the header's int32 count")
    if tokens.dtype != np.uint16 and len(tokens) and not (0 <= tokens.min() and tokens.max() < 2**16):
        raise ValueError(f"{path}: token ids must be 0 .. 65535 (uint16)")     # a cast would wrap them silently
    header = np.zeros(SHARD_HEADER_BYTES // 4, dtype="<i4")
    header[:3] = SHARD_MAGIC, SHARD_VERSION, len(tokens)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(tokens.astype("<u2", copy=False).tobytes())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def check_shard(path: str) -> str | None:
    """None if `path` is a valid shard (magic, version, size = header + 2 bytes per token), else what is wrong."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = f.read(SHARD_HEADER_BYTES)
    except OSError as e:
        return f"cannot read it ({e})"
    if len(header) < 12:
        return f"only {size} bytes, shorter than the header"
    magic, version, n = (int.from_bytes(header[i:i + 4], "little", signed=True) for i in (0, 4, 8))
    if magic != SHARD_MAGIC:
        return f"bad magic {magic}"
    if version != SHARD_VERSION:
        return f"bad version {version}"
    if n < 0:
        return f"bad token count {n}"
    if size != SHARD_HEADER_BYTES + 2 * n:
        return f"truncated: expected {SHARD_HEADER_BYTES + 2 * n} bytes, found {size}"
    return None


# what to do when the file system refuses a write
WRITE_FIXES = {"ENOSPC": " (free space, or choose another --out)", "EDQUOT": " (free space, or choose another --out)",
               "EROFS": " (choose a writable --out)", "EACCES": " (choose a writable --out)",
               "EPERM": " (choose a writable --out)", "EFBIG": " (raise the file size limit, ulimit -f)"}


class UsageError(Exception):
    """A bad command-line option value: the message names the flag and what it must be."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one `error:` line (no usage block), exit 2, as every other failure here."""

    def error(self, message: str):
        print(f"error: {message}; see {self.prog} --help", file=sys.stderr)
        raise SystemExit(2)


def run_main(main: Callable[[list[str] | None], int], argv: list[str] | None) -> int:
    """main(argv), with the failures a user can cause turned into one `error:` line and an exit status. shard_set
    has already removed any partial output when these reach here."""
    try:
        return main(argv)
    except UsageError as e:
        message, status = str(e), 2
    except SystemExit as e:     # a data problem: SystemExit("error: ..."); argparse's exits (--help, usage) pass
        if not isinstance(e.code, str):
            raise
        message, status = e.code.removeprefix("error: "), 1
    except OSError as e:        # disk full, unreadable input, ...
        where = f"{e.filename}: " if e.filename else ""
        fix = WRITE_FIXES.get(errno.errorcode.get(e.errno, ""), "")
        message, status = (f"{where}{e.strerror or e}{fix}; no shards were written (partial output was removed)",
                           1)
    except MemoryError:
        message, status = "out of memory; use a smaller --shard_tokens (or fewer --workers)", 1
    except KeyboardInterrupt:
        message, status = "interrupted; no shards were written (partial output was removed)", 130
    print(f"error: {message}", file=sys.stderr)
    return status


@contextlib.contextmanager
def shard_set(out_dir: str, prefix: str) -> Iterator[str]:
    """Yields a staging folder inside out_dir to write a run's shards into. When the block completes, the shards are
    moved into out_dir, where they become its whole <prefix>_{train,val}_NNNNNN.bin set: older shards of that pattern
    that the new set does not overwrite are removed, as a training glob would mix them in; other files are left alone.
    When the block fails (an error, Ctrl-C), the staging folder is removed and out_dir is as before (and is removed if
    this run created it), so a partial set is never visible."""
    created = not os.path.isdir(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:        # e.g. a file in the way: NotADirectoryError, FileExistsError
        raise SystemExit(f"error: cannot create the output folder {out_dir}: {e.strerror}; choose another --out") \
            from None
    complete, staging = False, ""
    try:
        try:
            staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out_dir)
        except OSError as e:    # e.g. /proc, a read-only or full file system
            fix = WRITE_FIXES.get(errno.errorcode.get(e.errno, ""), " (choose a writable --out)")
            raise SystemExit(f"error: cannot write into the output folder {out_dir}: {e.strerror}{fix}") from None
        yield staging
        new = sorted(os.listdir(staging))
        pattern = re.compile(rf"{re.escape(prefix)}_(train|val)_\d{{6}}\.bin")
        stale = sorted(name for name in os.listdir(out_dir) if pattern.fullmatch(name) and name not in new)
        # Checked before the first move, so that a set is never half replaced: a rename cannot replace a folder.
        in_the_way = [name for name in new if os.path.isdir(os.path.join(out_dir, name))
                      and not os.path.islink(os.path.join(out_dir, name))]
        if in_the_way:
            raise SystemExit(f"error: {os.path.join(out_dir, in_the_way[0])} is a folder where a shard of this run "
                             f"goes: move it away or choose another --out; no shards were written")
        for name in new:
            os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
        for name in stale:
            os.remove(os.path.join(out_dir, name))
        if stale:
            print(f"removed {len(stale)} shard(s) of an earlier run that this run does not replace: {stale[0]}"
                  + (f" .. {stale[-1]}" if len(stale) > 1 else ""))
        complete = True
    finally:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
        if created and not complete:
            with contextlib.suppress(OSError):
                os.rmdir(out_dir)       # only if empty: something else may have been put there meanwhile
