"""Download the GPT-2-tokenized FineWeb 10B shards that train_gpt.py reads by default.

    python data/cached_fineweb10B.py        # val + the first {default} train shards (enough for the record run)
    python data/cached_fineweb10B.py 103    # all of them (10.3B tokens)

Fetches fineweb_val_000000.bin and fineweb_train_000001.bin .. fineweb_train_<N>.bin from the Hugging Face dataset
repo {repo} into --dir (default: fineweb10B/ next to this script, which is where train_gpt.py looks). Each shard is
100M tokens (about 200 MB); the repo has 103 train shards.

Why {default} by default: the record run trains on 467,927,040 tokens (575 steps x 131,072 + 575 x 262,144 + 615 x
393,216). The loader reads more than it trains on: documents are cut at 2048 tokens and the rest is dropped, each
rank's last document is cut and its remainder dropped, each rank reads one look-ahead token per micro-step, and the
tail of every shard that cannot hold a whole batch is skipped. The record reads about 6-7 shards; allowing for {waste}%
waste gives ceil(467,927,040 x {factor} / 100,000,000) = {base} shards, plus {spare} spare because running out of data
mid-run loses the run.

Files already present and valid (magic, version and size = 1024 + 2 x tokens) are skipped; invalid ones are replaced.
A download goes to a temporary folder inside --dir, is checked, and is then renamed into place, so an interrupted
download (Ctrl-C, a killed process, a lost connection) never leaves a partial file under a shard's name. Transient
failures are retried with backoff. Offline? Set HF_ENDPOINT to a reachable mirror, copy the .bin files into --dir by
hand, or make synthetic shards for a smoke test with data/synthetic.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Callable

import shards    # data/shards.py: the shard format, its check, UsageError

REPO_ID = "kjj0/fineweb10B-gpt2"
UPSTREAM_TRAIN_SHARDS = 103
TRAINED_TOKENS = 575 * 131_072 + 575 * 262_144 + 615 * 393_216    # = 467,927,040
SHARD_TOKENS = 100_000_000
WASTE_ALLOWANCE = 0.5              # tokens read but not trained on, as a fraction of TRAINED_TOKENS (see the docstring)
SPARE_SHARDS = 1
DEFAULT_TRAIN_SHARDS = math.ceil(TRAINED_TOKENS * (1 + WASTE_ALLOWANCE) / SHARD_TOKENS) + SPARE_SHARDS  # = 9
TEMP_PREFIX = ".download-"         # temporary folders inside --dir; left-overs of a killed run are removed next time

__doc__ = (__doc__ or "").format(default=DEFAULT_TRAIN_SHARDS, repo=REPO_ID, waste=round(100 * WASTE_ALLOWANCE),
                         factor=1 + WASTE_ALLOWANCE, base=DEFAULT_TRAIN_SHARDS - SPARE_SHARDS, spare=SPARE_SHARDS)


class MissingUpstream(Exception):
    """The file does not exist upstream (or the repo cannot be accessed): retrying will not help."""


class Offline(Exception):
    """The hub could not be reached."""


def hf_fetch(filename: str, dest_dir: str) -> str:
    """Download `filename` of the dataset repo into dest_dir with huggingface_hub; returns the local path.
    Hub errors are translated to MissingUpstream / Offline; others propagate and count as transient."""
    from huggingface_hub import errors, hf_hub_download
    try:
        return hf_hub_download(repo_id=REPO_ID, filename=filename, repo_type="dataset", local_dir=dest_dir)
    except getattr(errors, "LocalEntryNotFoundError", ()) as e:     # raised when the hub cannot be reached
        raise Offline(str(e)) from e
    except (getattr(errors, "EntryNotFoundError", ()), getattr(errors, "RepositoryNotFoundError", ()),
            getattr(errors, "RevisionNotFoundError", ()), getattr(errors, "GatedRepoError", ())) as e:
        raise MissingUpstream(f"{type(e).__name__}: {e}") from e


def shard_names(num_train: int) -> list[str]:
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{k:06d}.bin" for k in range(1, num_train + 1)]


def offline_help(out_dir: str) -> str:
    return (f"the hub is unreachable. Set HF_ENDPOINT to a reachable mirror and run again, or copy the fineweb_*.bin "
            f"files into {out_dir} by hand, or for a smoke test make synthetic shards: python data/synthetic.py "
            f"--out DIR (then train with --train_files='DIR/fineweb_train_*.bin' --val_files='DIR/fineweb_val_*.bin')")


class DownloadError(Exception):
    """A shard could not be downloaded; the message says what to do."""


def fetch_shard(name: str, out_dir: str, fetch: Callable[[str, str], str], attempts: int,
                sleep: Callable[[float], None], log: Callable[[str], None]) -> None:
    """Put a valid `name` into out_dir: download into a temporary folder, check, rename. Retries transient failures."""
    final = os.path.join(out_dir, name)
    last_error = ""
    for attempt in range(1, attempts + 1):
        try:
            tmp_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=out_dir)
        except OSError as e:    # e.g. /proc, a read-only or full file system
            raise DownloadError(f"cannot write into the download folder {out_dir}: {e.strerror}; choose a writable "
                                f"--dir with free space") from None
        try:
            path = fetch(name, tmp_dir)
            problem = shards.check_shard(path)
            if problem is None:
                os.replace(path, final)
                return
            last_error = f"the downloaded file is invalid: {problem}"
        except MissingUpstream as e:
            raise DownloadError(f"{name} is not available from {REPO_ID} ({e}). The repo has "
                                f"{UPSTREAM_TRAIN_SHARDS} train shards: ask for at most that many; if it is gone, "
                                f"point HF_ENDPOINT at a mirror or copy the files into {out_dir}") from None
        except Offline as e:
            last_error = f"offline ({e})"
        except Exception as e:  # noqa: BLE001 (network stacks raise many types; all are retried)
            last_error = f"{type(e).__name__}: {e}"
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)   # also on KeyboardInterrupt: only the temp folder held data
        if attempt < attempts:
            delay = 2.0 ** attempt
            log(f"  {name}: attempt {attempt}/{attempts} failed ({last_error}); retrying in {delay:.0f}s")
            sleep(delay)
    hint = offline_help(out_dir) if last_error.startswith("offline") else (
        "check the connection and run again (present shards are kept); " + offline_help(out_dir))
    raise DownloadError(f"could not download {name} after {attempts} attempts: {last_error}. {hint}")


def log_now(line: str) -> None:
    """A progress line, shown at once even when stdout is a pipe (./run.sh | tee out.txt)."""
    print(line, flush=True)


def download(num_train: int, out_dir: str, fetch: Callable[[str, str], str] = hf_fetch, attempts: int = 3,
             sleep: Callable[[float], None] | None = None, log: Callable[[str], None] = log_now) -> list[str]:
    """Make out_dir hold valid copies of the val shard and train shards 1..num_train; returns their paths. Says one
    line per shard before it (present, replaced or downloading) and one after each download (its size and time).
    fetch, sleep and log are injectable for tests (no network)."""
    sleep = sleep or time.sleep
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:        # e.g. a file in the way: NotADirectoryError, FileExistsError
        raise DownloadError(f"cannot create the download folder {out_dir}: {e.strerror}; choose another --dir") \
            from None
    for entry in os.listdir(out_dir):                    # temp folders left by a killed run
        if entry.startswith(TEMP_PREFIX):
            shutil.rmtree(os.path.join(out_dir, entry), ignore_errors=True)
    names = shard_names(num_train)
    for i, name in enumerate(names, 1):
        final = os.path.join(out_dir, name)
        if os.path.isdir(final):
            raise DownloadError(f"{final} is a folder where a shard goes: move it away or choose another --dir")
        if os.path.exists(final):
            problem = shards.check_shard(final)
            if problem is None:
                log(f"[{i}/{len(names)}] {name}: present and valid, skipped")
                continue
            log(f"[{i}/{len(names)}] {name}: present but invalid ({problem}); replacing it")
            os.remove(final)
        else:
            log(f"[{i}/{len(names)}] {name}: downloading")
        t0 = time.perf_counter()
        fetch_shard(name, out_dir, fetch, attempts, sleep, log)
        log(f"[{i}/{len(names)}] {name}: done ({os.path.getsize(final) / 1e6:.0f} MB in "
            f"{time.perf_counter() - t0:.0f}s)")
    return [os.path.join(out_dir, name) for name in names]


def main(argv: list[str] | None = None, fetch: Callable[[str, str], str] = hf_fetch) -> int:
    parser = shards.ArgumentParser(prog="data/cached_fineweb10B.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("num_train_shards", nargs="?", type=int, default=DEFAULT_TRAIN_SHARDS,
                        help=f"train shards to fetch (default {DEFAULT_TRAIN_SHARDS}, see above; at most "
                             f"{UPSTREAM_TRAIN_SHARDS})")
    parser.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "fineweb10B"),
                        help="destination folder (default: fineweb10B/ next to this script)")
    parser.add_argument("--attempts", type=int, default=3, help="tries per file before giving up (default 3)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    # every failure a user can cause ends in one `error:` line: 2 for a bad option, 1 for the download or the disk
    try:
        if not 0 <= args.num_train_shards <= UPSTREAM_TRAIN_SHARDS:
            raise shards.UsageError(f"asked for {args.num_train_shards} train shards; {REPO_ID} has "
                                    f"{UPSTREAM_TRAIN_SHARDS}: ask for 0 .. {UPSTREAM_TRAIN_SHARDS} (0: the val "
                                    f"shard only)")
        if args.attempts < 1:
            raise shards.UsageError(f"--attempts={args.attempts}: must be 1 or more")
        if fetch is hf_fetch and importlib.util.find_spec("huggingface_hub") is None:
            raise DownloadError("the huggingface_hub package is missing: pip install huggingface_hub (or pip install "
                                "-r requirements.txt)")
        paths = download(args.num_train_shards, args.dir, fetch=fetch, attempts=args.attempts)
    except shards.UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except DownloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:        # the disk (full, a folder in the way, ...): network errors are DownloadErrors
        print(f"error: {e}; complete shards are kept: fix that and run again to resume", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted: complete shards are kept, partial downloads were removed; run again to resume",
              file=sys.stderr)
        return 130
    print(f"{len(paths)} shards ready in {args.dir} ({time.perf_counter() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
