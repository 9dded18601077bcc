"""Tokenize text into token shards in the FineWeb format that train_gpt.py reads.

    python data/tokenize_docs.py corpus/ --out data/mytext --encoding gpt2
    python data/tokenize_docs.py books/*.txt --txt_split blank_line --val_docs 50 --out data/books

Inputs (files, or folders searched recursively for these):
  * .txt   one document per file (--txt_split file, the default) or one per block of text between blank lines
           (--txt_split blank_line);
  * .jsonl one JSON object per line; the document is its --text_field (default "text").
Blank documents (empty or only whitespace) are skipped.
Every document becomes BOS (50256, <|endoftext|>) followed by its tokens. Documents are kept whole within a shard
(a shard closes early when the next document does not fit); only a document longer than --shard_tokens is split.

Outputs in --out: <prefix>_val_000000.bin (and _000001... if the val split is larger than a shard) and
<prefix>_train_000001.bin, _000002.bin, ...: a 1024-byte header (magic, version, token count; data/shards.py) and
uint16 tokens. The shards are made in a staging folder inside --out and moved into place once all are complete
(replacing the <prefix>_*.bin shards of an earlier run): a failure or Ctrl-C leaves --out as it was. Train on them with
--train_files='OUT/<prefix>_train_*.bin' --val_files='OUT/<prefix>_val_*.bin' (and --val_tokens no larger than the
val shard's tokens minus 2, a multiple of --val_batch_size).

Validation split: --val_docs K puts the first K documents in val; otherwise --val_fraction F (default 0.01) puts
document i in val when floor((i+1)*F) > floor(i*F), i.e. every 1/F-th document, spread evenly and deterministic.

Encodings: gpt2 (tiktoken; its BPE files are downloaded once into tiktoken's cache, so it needs the network or a
folder holding them as TIKTOKEN_CACHE_DIR; offline, one error line names the folder and the files it lacks) or bytes
(offline: ids 0..255 are the UTF-8 bytes, 50256 is <|endoftext|>).
"""
import argparse
import glob
import json
import os
import re
import sys
import time
from typing import Iterable, Iterator

import numpy as np

import shards    # data/shards.py: the shard format, staging of the output, one-line errors

BOS_ID = 50256
ENCODE_BATCH_DOCS = 512           # documents handed to tiktoken per call (it encodes a batch on several threads)
# GPT-2's pre-tokenizer pattern; with the bytes encoding it only groups bytes before they are mapped one by one.
_GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


# tiktoken's gpt2 encoding is two files, downloaded once into tiktoken's cache folder under the sha1 of their address
# (tiktoken_ext/openai_public.py gpt2, tiktoken/load.py read_file_cached)
GPT2_FILES = {"vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
              "encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json"}


def tiktoken_cache_dir() -> str:
    """The folder tiktoken caches its downloads in, as tiktoken/load.py picks it: $TIKTOKEN_CACHE_DIR, else
    $DATA_GYM_CACHE_DIR, else <the temporary folder>/data-gym-cache ("" turns the cache off)."""
    import tempfile
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return os.environ[var]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def gpt2_unavailable(e: BaseException) -> str:
    """The one error line for a gpt2 encoding tiktoken could not load (offline: not cached, no download): what is
    missing where, and the fixes."""
    import hashlib
    first = (f"{type(e).__name__}: {e}".strip().splitlines() or [""])[0]
    cause = first if len(first) <= 120 else first[:117] + "..."
    cache = tiktoken_cache_dir()
    if not cache:
        return (f"error: cannot load tiktoken's gpt2 encoding ({cause}): TIKTOKEN_CACHE_DIR is empty, which turns "
                f"tiktoken's cache off; set it to a folder holding the cached files, or use --encoding=bytes "
                f"(offline, byte-level ids)")
    missing = [f"{key} ({name})" for name, key in ((name, hashlib.sha1(url.encode()).hexdigest())
                                                   for name, url in GPT2_FILES.items())
               if not os.path.isfile(os.path.join(cache, key))]
    if not missing:
        return (f"error: cannot load tiktoken's gpt2 encoding ({cause}) although its cache {cache} holds its files; "
                f"delete them and run this once with the network on, or use --encoding=bytes (offline, byte-level ids)")
    return (f"error: cannot load tiktoken's gpt2 encoding ({cause}): it is downloaded once into tiktoken's cache, "
            f"and {cache} lacks {' and '.join(missing)}; run this once with the network on, or set "
            f"TIKTOKEN_CACHE_DIR to a folder holding those files (copied from a machine's filled cache), or use "
            f"--encoding=bytes (offline, byte-level ids)")


def get_encoding(name: str):
    """A tiktoken Encoding: "gpt2" (needs its BPE files) or "bytes" (256 byte tokens + <|endoftext|> = 50256)."""
    import tiktoken
    if name == "bytes":
        return tiktoken.Encoding(name="bytes", pat_str=_GPT2_PATTERN,
                                 mergeable_ranks={bytes([i]): i for i in range(256)},
                                 special_tokens={"<|endoftext|>": BOS_ID})
    if name != "gpt2":
        raise SystemExit(f"error: unknown --encoding={name}; use gpt2 or bytes")
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # noqa: BLE001 (network errors come in many types)
        raise SystemExit(gpt2_unavailable(e)) from None


def input_files(paths: Iterable[str]) -> list[str]:
    """Files named on the command line, and the .txt/.jsonl files under named folders (sorted)."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(f for ext in ("txt", "jsonl") for f in glob.glob(os.path.join(path, "**", f"*.{ext}"),
                                                                             recursive=True))
            if not found:
                raise SystemExit(f"error: no .txt or .jsonl files under {path}")
            files.extend(found)
        elif not os.path.isfile(path):
            raise SystemExit(f"error: input {path} does not exist")
        elif not path.endswith((".txt", ".jsonl")):
            raise SystemExit(f"error: {path}: only .txt and .jsonl inputs are supported")
        else:
            files.append(path)
    return files


def iter_documents(files: list[str], txt_split: str, text_field: str) -> Iterator[str]:
    """Document texts in input order (see the module docstring for what a document is); blank ones are skipped."""
    for path in files:
        try:
            yield from (text for text in file_documents(path, txt_split, text_field) if text.strip())
        except UnicodeDecodeError:
            raise SystemExit(not_utf8_error(path)) from None
        except OSError as e:    # a read error; its exception does not name the file
            raise SystemExit(f"error: cannot read {path}: {e.strerror or e}; fix or leave out that input; no "
                             f"shards were written") from None


def file_documents(path: str, txt_split: str, text_field: str) -> Iterator[str]:
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[text_field]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise SystemExit(f"error: {path}:{line_no}: expected a JSON object with a string "
                                     f"{text_field!r} field ({type(e).__name__}); see --text_field") from None
                if not isinstance(text, str):
                    raise SystemExit(f"error: {path}:{line_no}: field {text_field!r} is not a string")
                yield text
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if txt_split == "file":
            yield text
        else:
            # blocks separated by one or more blank lines (lines holding only whitespace)
            yield from (block.strip("\n") for block in re.split(r"\n\s*\n", text) if block.strip())


def not_utf8_error(path: str) -> str:
    """The error for a file that is not UTF-8, naming its first bad line. The text reader decodes in chunks, so its
    error does not say the line; lines decode on their own (a newline byte is never inside a UTF-8 character)."""
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                return (f"error: {path}:{line_no}: not UTF-8 text (byte 0x{line[e.start]:02x} at column "
                        f"{e.start + 1}); convert the file to UTF-8 (e.g. with iconv) or leave it out")
    return f"error: {path}: not UTF-8 text; convert the file to UTF-8 (e.g. with iconv) or leave it out"


class ShardWriter:
    """Collects documents into shards of at most shard_tokens and writes each one atomically."""

    def __init__(self, out_dir: str, prefix: str, split: str, first_index: int, shard_tokens: int):
        self.out_dir, self.prefix, self.split = out_dir, prefix, split
        self.next_index, self.shard_tokens = first_index, shard_tokens
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.paths: list[str] = []
        self.total_tokens = 0

    def add(self, doc: np.ndarray) -> None:
        if self.pending_tokens + len(doc) > self.shard_tokens and self.pending:
            self.flush()
        while len(doc) > self.shard_tokens:          # a document longer than a shard is split
            self.pending.append(doc[:self.shard_tokens])
            self.pending_tokens += self.shard_tokens
            self.flush()
            doc = doc[self.shard_tokens:]
        self.pending.append(doc)
        self.pending_tokens += len(doc)

    def flush(self) -> None:
        if not self.pending:
            return
        tokens = np.concatenate(self.pending)
        path = os.path.join(self.out_dir, f"{self.prefix}_{self.split}_{self.next_index:06d}.bin")
        shards.write_shard(path, tokens)
        print(f"wrote {os.path.basename(path)} ({len(tokens):,} tokens)", flush=True)
        self.paths.append(path)
        self.total_tokens += len(tokens)
        self.next_index += 1
        self.pending, self.pending_tokens = [], 0


def is_val_doc(index: int, val_docs: int | None, val_fraction: float) -> bool:
    if val_docs is not None:
        return index < val_docs
    return int((index + 1) * val_fraction) > int(index * val_fraction)


def tokenize_to_shards(paths: list[str], out_dir: str, encoding, *, shard_tokens: int = 100_000_000,
                       val_docs: int | None = None, val_fraction: float = 0.01, prefix: str = "text",
                       txt_split: str = "file", text_field: str = "text", threads: int = 4) -> dict:
    """Tokenize the documents of `paths` into val and train shards in out_dir; returns
    {"val": [paths], "train": [paths], "val_tokens": n, "train_tokens": n, "docs": n}. Nothing appears in out_dir
    unless all shards are complete (see shards.shard_set)."""
    if txt_split not in ("file", "blank_line"):
        raise shards.UsageError(f"--txt_split={txt_split}: use file or blank_line")
    if not 2 <= shard_tokens <= shards.MAX_SHARD_TOKENS:
        raise shards.UsageError(f"--shard_tokens={shard_tokens}: must be 2 .. {shards.MAX_SHARD_TOKENS:,} (the "
                                 f"header's int32)")
    files = input_files(paths)
    with shards.shard_set(out_dir, prefix) as staging:
        writers = {"val": ShardWriter(staging, prefix, "val", 0, shard_tokens),
                   "train": ShardWriter(staging, prefix, "train", 1, shard_tokens)}
        docs = iter_documents(files, txt_split, text_field)
        num_docs, t0 = 0, time.perf_counter()
        while batch := [text for _, text in zip(range(ENCODE_BATCH_DOCS), docs)]:
            for ids in encoding.encode_ordinary_batch(batch, num_threads=threads):
                doc = np.empty(len(ids) + 1, dtype=np.uint16)
                doc[0] = BOS_ID
                doc[1:] = ids
                writers["val" if is_val_doc(num_docs, val_docs, val_fraction) else "train"].add(doc)
                num_docs += 1
            if num_docs % (ENCODE_BATCH_DOCS * 64) == 0:
                done = sum(w.total_tokens + w.pending_tokens for w in writers.values())
                print(f"{num_docs:,} documents, {done:,} tokens, "
                      f"{done / (time.perf_counter() - t0) / 1e6:.2f}M tokens/s", flush=True)
        for writer in writers.values():
            writer.flush()
        if not num_docs:
            raise SystemExit(f"error: no documents in the input ({len(files)} files, all empty or blank); give "
                             f"files that hold text")
        if not writers["val"].paths:
            raise SystemExit(f"error: no documents went to validation ({num_docs} documents in all); raise "
                             f"--val_fraction or set --val_docs")
        if not writers["train"].paths:
            raise SystemExit(f"error: no documents left for training ({num_docs} documents in all); lower "
                             f"--val_docs or --val_fraction")
    final = {split: [os.path.join(out_dir, os.path.basename(p)) for p in w.paths] for split, w in writers.items()}
    return {"val": final["val"], "train": final["train"], "docs": num_docs,
            "val_tokens": writers["val"].total_tokens, "train_tokens": writers["train"].total_tokens}


def main(argv: list[str] | None = None) -> int:
    return shards.run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    parser = shards.ArgumentParser(prog="data/tokenize_docs.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help=".txt / .jsonl files, or folders holding them")
    parser.add_argument("--out", required=True, help="output folder (created if missing); its <prefix>_*.bin shards "
                        "of an earlier run are replaced by this run's, and only once all of them are complete")
    parser.add_argument("--encoding", default="gpt2", choices=("gpt2", "bytes"), help="tokenizer (default gpt2)")
    parser.add_argument("--prefix", default="text", help="output name prefix (default text)")
    parser.add_argument("--shard_tokens", type=int, default=100_000_000, help="max tokens per shard (default 1e8)")
    split = parser.add_mutually_exclusive_group()
    split.add_argument("--val_fraction", type=float, default=0.01, help="share of documents for val (default 0.01)")
    split.add_argument("--val_docs", type=int, default=None, help="put the first K documents in val instead")
    parser.add_argument("--txt_split", default="file", choices=("file", "blank_line"),
                        help="a .txt file is one document (file) or one per blank-line-separated block")
    parser.add_argument("--text_field", default="text", help="the JSON field holding a .jsonl document's text")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="tokenizer threads")
    args = parser.parse_args(argv)
    for bad, message in ((not 0 < args.val_fraction < 1,
                          f"--val_fraction={args.val_fraction}: must be between 0 and 1 (exclusive)"),
                         (args.val_docs is not None and args.val_docs < 1,
                          f"--val_docs={args.val_docs}: must be 1 or more"),
                         (args.threads < 1, f"--threads={args.threads}: must be 1 or more"),
                         (not args.prefix or "/" in args.prefix,
                          f"--prefix={args.prefix!r}: must be a non-empty file name part, without '/'")):
        if bad:
            raise shards.UsageError(message)
    result = tokenize_to_shards(args.inputs, args.out, get_encoding(args.encoding), shard_tokens=args.shard_tokens,
                                val_docs=args.val_docs, val_fraction=args.val_fraction, prefix=args.prefix,
                                txt_split=args.txt_split, text_field=args.text_field, threads=args.threads)
    print(f"{result['docs']:,} documents: {result['train_tokens']:,} train tokens in {len(result['train'])} shards, "
          f"{result['val_tokens']:,} val tokens in {len(result['val'])}")
    print(f"train with: --train_files='{args.out}/{args.prefix}_train_*.bin' "
          f"--val_files='{args.out}/{args.prefix}_val_*.bin' (--val_tokens at most {result['val_tokens'] - 2:,}, "
          f"a multiple of --val_batch_size)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
