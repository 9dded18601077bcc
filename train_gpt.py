"""NanoGPT speedrun trainer: a GPT-2-small-class model trained on FineWeb to 3.28 validation loss.

Run on one node with `./run.sh` (torchrun over the GPUs found); `python train_gpt.py --preset=tiny ...` runs on a CPU.
The training math follows RECORD61 (see README). Sections, in reading order:
    1. hyperparameters   2. kernel glue   3. optimizer   4. attention backends   5. model
    6. data              7. schedules     8. logging, checkpoints, preflight     9. main()
Nothing happens at import: process groups, CUDA work, file reads and compiles all start in main().
"""
from __future__ import annotations

import copy
import dataclasses
import glob
import math
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import triton_kernels as tk

# =====================================================================================================================
# 1. Hyperparameters
# =====================================================================================================================

# The per-parameter optimizer table (spec §5.1). optim: "adam" | "normuon"; comms: "none" | "replicated" | "sharded".
# betas are Adam's (beta1, beta2); matrix_shape views a NorMuon bank as a stack of matrices; matrix_lr_muls cycles
# over the global matrix index of that stack (c_fc, c_proj alternate in the MLP bank, so c_proj gets 2x).
DEFAULT_PARAM_TABLE: dict[str, dict[str, Any]] = {
    "attn":           dict(optim="normuon", comms="sharded",    lr_mul=1.0,  wd_mul=1.0,   matrix_shape=(768, 768)),
    "mlp":            dict(optim="normuon", comms="sharded",    lr_mul=1.0,  wd_mul=1.0,   matrix_shape=(3072, 768),
                           matrix_lr_muls=(1.0, 2.0)),
    "scalars":        dict(optim="adam",    comms="replicated", lr_mul=5.0,  wd_mul=0.0,   betas=(0.9, 0.99)),
    "ve0":            dict(optim="adam",    comms="sharded",    lr_mul=75.0, wd_mul=5.0,   betas=(0.75, 0.95)),
    "ve1":            dict(optim="adam",    comms="sharded",    lr_mul=75.0, wd_mul=5.0,   betas=(0.75, 0.95)),
    "ve2":            dict(optim="adam",    comms="sharded",    lr_mul=75.0, wd_mul=5.0,   betas=(0.75, 0.95)),
    "smear_gate":     dict(optim="adam",    comms="replicated", lr_mul=0.01, wd_mul=0.0,   betas=(0.9, 0.99)),
    "skip_gate":      dict(optim="adam",    comms="replicated", lr_mul=0.05, wd_mul=0.0,   betas=(0.9, 0.99)),
    "attn_gate_bank": dict(optim="adam",    comms="replicated", lr_mul=1.0,  wd_mul=1.0,   betas=(0.9, 0.99)),
    "ve_gate_bank":   dict(optim="adam",    comms="replicated", lr_mul=1.0,  wd_mul=1.0,   betas=(0.9, 0.99)),
    "x0_lambdas":     dict(optim="adam",    comms="replicated", lr_mul=5.0,  wd_mul=0.0,   betas=(0.65, 0.95)),
    "lm_head":        dict(optim="adam",    comms="sharded",    lr_mul=1.0,  wd_mul=150.0, betas=(0.5, 0.95)),
    "embed":          dict(optim="adam",    comms="sharded",    lr_mul=1.0,  wd_mul=150.0, betas=(0.5, 0.95)),
}
# Launch reductions in this order (big banks first so their reduce-scatter starts earliest; lm_head before embed so
# the tied gradient fold happens before lm_head is reduced) ...
DEFAULT_SCATTER_ORDER = ("attn", "mlp", "scalars", "ve0", "ve1", "ve2", "smear_gate", "skip_gate", "attn_gate_bank",
                         "ve_gate_bank", "x0_lambdas", "lm_head", "embed")
# ... and do the update work in this one: small tensors while the big reductions are in flight, Polar Express last.
DEFAULT_WORK_ORDER = ("scalars", "smear_gate", "skip_gate", "attn_gate_bank", "ve_gate_bank", "x0_lambdas",
                      "ve0", "ve1", "ve2", "lm_head", "embed", "attn", "mlp")


@dataclass
class Hyperparameters:
    # ---- data ----
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"  # glob of training shards, read once in sorted order
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"      # glob of validation shards
    val_tokens: int = 10_485_760           # tokens scored per validation (the fixed prefix of the val stream)
    val_batch_size: int = 2_097_152        # global val tokens per val step (4*64*1024*8)
    train_max_seq_len: int = 2048          # training documents are cut to this many tokens
    tokens_per_doc_bound: int = 300        # cu_seqlens holds ceil128(N / this) entries; lower it for short-doc data
    batch_slices: int = 8                  # the global batch is cut into this many micro-batches (world_size * accum)
    train_bs_schedule: tuple = (131_072, 262_144, 393_216)  # global tokens per step in each third of the schedule
    # ---- steps and schedules ----
    num_scheduled_iterations: int = 1725   # steps of the lr / batch / window schedule
    num_extension_iterations: int = 40     # extra steps at the final lr with the extended window
    cooldown_frac: float = 0.5             # fraction of scheduled steps spent decaying lr to lr_min
    lr_peaks: tuple = (1.0, 1.52, 1.73)    # lr factor peak in each third (rises after the boundary step)
    lr_min: float = 0.1                    # lr factor at the end of cooldown and during the extension
    split_frac: float = 2 / 3              # untie embed / lm_head after step ceil(frac * scheduled) | 1
    momentum_min: float = 0.85             # NorMuon momentum at step 0 ...
    momentum_max: float = 0.95             # ... rising linearly to this ...
    momentum_warmup_steps: int = 300       # ... over this many steps,
    momentum_cooldown_steps: int = 50      # and falling by (max - min) over the last this-many steps
    mtp_weights_start: tuple = (1.0, 0.5, 0.25)  # multi-token-prediction weights; see mtp_weights()
    val_loss_every: int = 250              # validate every this many steps (0: only at the end)
    # ---- attention windows (in blocks of block_size tokens) ----
    block_size: int = 128                  # tokens per window block
    ws_long_schedule: tuple = (3, 7, 11)   # long window in each third of the schedule; short = long // 2
    ws_long_extension: int = 13            # long window during the extension steps
    ws_long_final_val: int = 20            # long window for the final validation (no YaRN update)
    # ---- model ----
    vocab_size: int = 50304                # 50257 GPT-2 ids padded to a multiple of 128
    model_dim: int = 768
    num_heads: int = 6
    head_dim: int = 128
    mlp_hidden: int = 3072
    num_layers: int = 11
    num_value_embeds: int = 3
    # layer layout, as data: per-layer attention kind (P paired heads, N normal, - none), which layers use the long
    # window (these also get the key offset), which value-embedding table each layer adds (-1 none)
    attn_layout: str = "PNPNNP-NNPN"
    long_window_layers: tuple = (3, 10)
    ve_layout: tuple = (1, 2, -1, -1, -1, -1, -1, -1, 0, 1, 2)
    skip_source_layer: int = 3             # its output is added (gated) to the input of skip_dest_layer
    skip_dest_layer: int = 6
    backout_layer: int = 7                 # backout_lambda * its output is subtracted after the last layer
    mlp_bank_pad: int = 1                  # unused MLP slices so the bank divides by 8 ranks (11 + 1 = 12)
    rope_base: float = 1024.0              # frequencies (1/base)^(j/(n-1)) on the rotated half of each head
    attn_scale: float = 0.1                # softmax scale at the start (YaRN grows it at window changes)
    yarn_alpha: float = 1.0
    yarn_beta: float = 32.0
    softcap: tuple = (23.0, 5.0, 7.5)      # z = A * sigmoid((logit + B) / C)
    fp8_scales: tuple = (100 / 448, 1.6 / 448, 0.75 / 448)  # x, w, grad scales of the FP8 LM head
    use_fp8: bool = True                   # FP8 LM head in training (CUDA only; the CPU emulates it)
    # ---- optimizer ----
    adam_lr: float = 0.008
    adam_eps: float = 1e-10
    adam_wd: float = 0.005
    muon_lr: float = 0.023
    muon_beta2: float = 0.95
    muon_wd: float = 1.2
    param_table: dict = field(default_factory=lambda: copy.deepcopy(DEFAULT_PARAM_TABLE))
    scatter_order: tuple = DEFAULT_SCATTER_ORDER
    work_order: tuple = DEFAULT_WORK_ORDER
    # ---- system ----
    preset: str = ""                       # "tiny": a few narrow layers for CPU tests and newcomers
    attn_backend: str = "auto"             # auto | flex | varlen | fa3 | sdpa
    compile: bool = True                   # torch.compile the model (ignored on CPU)
    warmup: bool = True                    # compile every schedule variant before the clock starts
    device: str = "auto"                   # auto | cuda | cpu
    seed: int = -1                         # -1: unseeded init, like the record; else torch.manual_seed(seed)
    run_id: str = ""                       # log name under logs/; empty: a random UUID
    log_dir: str = "logs"
    save_checkpoint: bool = False          # write logs/<run_id>/state_step<step>.pt at the end
    nonfinite_check_every: int = 25        # check the loss for NaN/inf every this many steps (no per-step sync)
    pg_timeout_s: int = 600                # a rank stuck this long in a collective ends the run
    max_steps: int = -1                    # stop after this many training steps (for smoke tests); -1: all

    # ---- derived ----
    @property
    def num_iterations(self) -> int:
        return self.num_scheduled_iterations + self.num_extension_iterations

    @property
    def split_step(self) -> int:
        return math.ceil(self.split_frac * self.num_scheduled_iterations) | 1


PRESETS: dict[str, dict[str, Any]] = {
    # Same kinds of layer as the record (paired, normal, long window + key offset, no-attention layer, skip, backout,
    # value embeddings), narrow enough that a step takes well under a second on a CPU.
    "tiny": dict(
        model_dim=128, num_heads=4, head_dim=32, mlp_hidden=512, num_layers=6,
        attn_layout="PNN-NP", long_window_layers=(1, 4), ve_layout=(1, 2, -1, -1, 0, 2),
        skip_source_layer=1, skip_dest_layer=3, backout_layer=4, mlp_bank_pad=2,
        batch_slices=2, train_bs_schedule=(2048, 3072, 4096), block_size=16, ws_long_schedule=(3, 7, 11),
        ws_long_extension=13, ws_long_final_val=20,
        val_batch_size=8192, val_tokens=16384, num_scheduled_iterations=60, num_extension_iterations=4,
        momentum_warmup_steps=10, momentum_cooldown_steps=4, val_loss_every=20, train_max_seq_len=512,
        tokens_per_doc_bound=100, compile=False, use_fp8=False, attn_backend="sdpa",
        param_table=dict(copy.deepcopy(DEFAULT_PARAM_TABLE),
                         attn=dict(DEFAULT_PARAM_TABLE["attn"], matrix_shape=(128, 128)),
                         mlp=dict(DEFAULT_PARAM_TABLE["mlp"], matrix_shape=(512, 128))),
    ),
}


def _parse_value(text: str, like: Any, name: str) -> Any:
    """Parse a command-line value into the type of the field's default."""
    try:
        if isinstance(like, bool):
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if isinstance(like, int):
            return int(text)
        if isinstance(like, float):
            return float(text)
        if isinstance(like, tuple):
            items = [t for t in text.split(",") if t.strip()]
            kind = type(like[0]) if like else float
            return tuple(kind(t) for t in items)
        if isinstance(like, str):
            return text
    except ValueError:
        raise SystemExit(f"error: --{name}={text!r} is not a valid {type(like).__name__}") from None
    raise SystemExit(f"error: --{name} cannot be set from the command line")


def parse_args(argv: Sequence[str]) -> Hyperparameters:
    """`--name=value` for any Hyperparameters field; `--preset=NAME` first applies a preset, then the rest."""
    fields = {f.name: f for f in dataclasses.fields(Hyperparameters)}
    pairs = []
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise SystemExit(f"error: expected --name=value, got {arg!r} (see the Hyperparameters class for names)")
        name, value = arg[2:].split("=", 1)
        name = name.replace("-", "_")
        if name not in fields:
            close = [n for n in fields if n.startswith(name[:4])]
            raise SystemExit(f"error: unknown option --{name}" + (f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""))
        pairs.append((name, value))
    hp = Hyperparameters()
    for name, value in pairs:
        if name == "preset":
            if value not in PRESETS and value != "":
                raise SystemExit(f"error: unknown --preset={value}; known presets: {', '.join(PRESETS)}")
            hp = dataclasses.replace(hp, preset=value, **copy.deepcopy(PRESETS.get(value, {})))
    for name, value in pairs:
        if name != "preset":
            setattr(hp, name, _parse_value(value, getattr(hp, name), name))
    return hp


# =====================================================================================================================
# 2. Kernel glue
# =====================================================================================================================
# The fused kernels live in triton_kernels.py (imported above as tk); each public op there runs its Triton kernel on
# CUDA tensors and its plain-PyTorch reference elsewhere, so this file never branches on the device for them.


# =====================================================================================================================
# 3. Optimizer: Polar Express, Adam and NorMuon updates, and NorMuonAndAdam
# =====================================================================================================================
# <<OPTIMIZER SECTION>>


# =====================================================================================================================
# 4. Attention backends
# =====================================================================================================================
# <<ATTENTION SECTION>>


# =====================================================================================================================
# 5. Model
# =====================================================================================================================
# <<MODEL SECTION>>


# =====================================================================================================================
# 6. Data
# =====================================================================================================================
# The data pipeline of spec §2. Shards are FineWeb's GPT-2 token files. Training batches are BOS aligned (every
# segment starts at a document start and is at most max_seq_len long); validation batches are a plain cut of the val
# stream. Every rank builds the joint batch of all ranks and keeps its own part, so no communication is needed and
# the tokens of an optimizer step do not depend on the world size (spec §2.3 note).

BOS_ID = 50256                          # GPT-2 <|endoftext|>; every FineWeb document starts with it
SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_BYTES = 20240520, 1, 1024  # header: 256 int32 words: magic, version, n
_QUICK_SCAN_TOKENS = 4_000_000          # the first batches come from this prefix of shard 0 while the rest loads

_GET_DATA_HINT = ("download FineWeb shards with `python data/cached_fineweb10B.py 9` (any N also fetches the val "
                  "shard), or for a smoke test make synthetic ones with `python data/synthetic.py --out DIR` and pass "
                  "--train_files='DIR/fineweb_train_*.bin' --val_files='DIR/fineweb_val_*.bin'")


class DataError(RuntimeError):
    """Missing or bad data, or options that do not fit the data; the message says what to run or change."""


def resolve_shards(pattern: str, kind: str) -> list[str]:
    """The shard files matching `pattern`, sorted; kind is "train" or "val" (for the error message)."""
    files = sorted(glob.glob(pattern))
    if files:
        return files
    option = "--train_files" if kind == "train" else "--val_files"
    folder = os.path.dirname(pattern) or "."
    problem = (f"the folder {folder!r} does not exist" if not glob.has_magic(folder) and not os.path.isdir(folder)
               else f"no file matches {pattern!r}")
    raise DataError(f"no {kind} shards: {problem} ({option}={pattern}); {_GET_DATA_HINT}")


def _read_header(f, path: str) -> int:
    """Check the header and the size of the open shard file `f`; return its token count n."""
    raw = f.read(SHARD_HEADER_BYTES)
    size = os.fstat(f.fileno()).st_size
    if len(raw) < SHARD_HEADER_BYTES:
        raise DataError(f"shard {path} is truncated: {size} bytes, less than the {SHARD_HEADER_BYTES}-byte header; "
                        f"delete it and download or generate it again")
    magic, version, n = (int(w) for w in np.frombuffer(raw, dtype="<i4", count=3))
    if magic != SHARD_MAGIC:
        raise DataError(f"shard {path} has bad magic {magic} (expected {SHARD_MAGIC}), so it is not a token shard; "
                        f"remove it or change --train_files/--val_files")
    if version != SHARD_VERSION:
        raise DataError(f"shard {path} has bad version {version} (expected {SHARD_VERSION}); make it again with "
                        f"data/tokenize.py or download it again with data/cached_fineweb10B.py")
    expected = SHARD_HEADER_BYTES + 2 * n
    if size != expected:
        raise DataError(f"shard {path} is truncated (or has trailing bytes): its header says {n} tokens, so expected "
                        f"{expected} bytes, found {size}; delete it and download or generate it again")
    return n


def shard_num_tokens(path: str) -> int:
    """The token count of a shard, after checking its magic, version and file size."""
    with open(path, "rb") as f:
        return _read_header(f, path)


def _read_tokens(path: str, max_tokens: int | None = None, out: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """(tokens uint16, n): all n tokens of a checked shard, or only its first max_tokens; read into `out` if given."""
    with open(path, "rb") as f:
        n = _read_header(f, path)
        count = n if max_tokens is None else min(n, max_tokens)
        tokens = np.empty(count, dtype=np.uint16) if out is None else out[:count]
        got = f.readinto(memoryview(tokens).cast("B"))
    if got != 2 * count:
        raise DataError(f"shard {path}: read {got} of {2 * count} token bytes (did the file change while it was "
                        f"read?); download or generate it again")
    return tokens, n


def load_shard(path: str, pin_memory: bool = False) -> Tensor:
    """All tokens of a checked shard as a uint16 tensor (n,); page-locked if pin_memory (for fast copies to a GPU)."""
    tokens = torch.empty(shard_num_tokens(path), dtype=torch.uint16, pin_memory=pin_memory)
    _read_tokens(path, out=tokens.numpy())
    return tokens


def max_num_docs(num_tokens: int, tokens_per_doc_bound: int) -> int:
    """Fixed length of cu_seqlens for a batch of num_tokens: floor(N / bound) rounded up to a multiple of 128, at
    least 128. A fixed length keeps the compiled attention shapes static."""
    return max(128, -(-(num_tokens // tokens_per_doc_bound) // 128) * 128)


def _check_doc_capacity(num_seqs: int, num_tokens: int, tokens_per_doc_bound: int, what: str) -> None:
    """num_seqs sequences need num_seqs + 1 boundaries in cu_seqlens; fail loudly rather than overflow."""
    capacity = max_num_docs(num_tokens, tokens_per_doc_bound)
    if num_seqs + 1 > capacity:
        fits = num_tokens // (num_seqs + 1)
        raise DataError(
            f"{what} of {num_tokens} tokens holds {num_seqs} sequences, but cu_seqlens has room for {capacity - 1}: "
            f"--tokens_per_doc_bound={tokens_per_doc_bound} assumes documents average more tokens than these do. "
            f"Lower it: --tokens_per_doc_bound={fits} fits this batch, {max(1, fits // 2)} leaves headroom")


class _Background:
    """fn() in a daemon thread. result() joins and returns its value or re-raises its exception in the caller."""

    def __init__(self, fn: Callable[[], Any]):
        self._value, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # noqa: BLE001 (handed to the consumer by result() and raise_if_failed())
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def raise_if_failed(self) -> None:
        if self.done() and self._error is not None:
            raise self._error

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class _ShardIndex:
    """A training shard's tokens (uint16) and its sorted BOS positions. For the quick index of a prefix
    (complete=False) the last document's end is unknown, so that document is left out of doc_lens."""

    def __init__(self, path: str, tokens: np.ndarray, complete: bool):
        self.path, self.tokens, self.complete = path, tokens, complete
        self.bos = np.flatnonzero(tokens == BOS_ID)                               # (num_docs,) int64
        doc_lens = np.diff(self.bos, append=len(tokens))                          # (num_docs,)
        self.doc_lens = doc_lens if complete else doc_lens[:-1]                   # (usable_docs,)
        self._cum_by_cap: dict[int, np.ndarray] = {}

    def cum_lens(self, cap: int) -> np.ndarray:
        """(usable_docs + 1,) int64; entry j = tokens in the first j documents when each is cut to `cap`."""
        if cap not in self._cum_by_cap:
            self._cum_by_cap[cap] = np.concatenate(([0], np.cumsum(np.minimum(self.doc_lens, cap))))
        return self._cum_by_cap[cap]


class _TrainShards:
    """The training shards in order. While one is in use, a background thread reads and indexes the next. The first
    starts from a quick index of its first _QUICK_SCAN_TOKENS tokens while a thread indexes all of it; the quick
    document list is a prefix of the full one, so which index built a batch does not change the batch."""

    def __init__(self, files: list[str]):
        self.files, self.shard = files, 0
        tokens, n = _read_tokens(files[0], _QUICK_SCAN_TOKENS)
        self.current = _ShardIndex(files[0], tokens, complete=len(tokens) == n)
        self.tokens_done = 0                       # tokens in the shards used up so far
        self._full_current = None if self.current.complete else _Background(lambda: self._load(0))
        self._next = None
        if self._full_current is None:
            self._prefetch()

    def _load(self, k: int) -> _ShardIndex:
        return _ShardIndex(self.files[k], _read_tokens(self.files[k])[0], complete=True)

    def _prefetch(self) -> None:
        k = self.shard + 1
        self._next = _Background(lambda: self._load(k)) if k < len(self.files) else None

    def _take_full_current(self) -> None:
        self.current, self._full_current = self._full_current.result(), None
        self._prefetch()

    def poll(self) -> None:
        """Re-raise a failure of a background load now; switch to the full index of shard 0 once it is ready."""
        for task in (self._full_current, self._next):
            if task is not None:
                task.raise_if_failed()
        if self._full_current is not None and self._full_current.done():
            self._take_full_current()

    def extend(self) -> bool:
        """The current index cannot supply a batch. Returns False after waiting for the full index of a shard that
        was only partly indexed (keep the cursor), True after moving to the next shard (cursor back to 0)."""
        if self._full_current is not None:
            self._take_full_current()
            return False
        self.tokens_done += len(self.current.tokens)
        if self._next is None:
            raise DataError(
                f"training data ran out after reading all {len(self.files)} shards ({self.tokens_done:,} tokens) "
                f"matched by --train_files (first: {self.files[0]}); download more: python data/cached_fineweb10B.py "
                f"{len(self.files) + 2} (or make more synthetic shards, or train fewer steps)")
        self.current, self.shard = self._next.result(), self.shard + 1
        self._prefetch()
        return True


def _plan_joint_batch(cum_lens: np.ndarray, cursor: int, tokens_per_rank: int, world_size: int) -> list[int] | None:
    """Document cursors [c_0 = cursor, ..., c_W]: rank r takes documents c_r .. c_{r+1}-1; None if the shard runs out.
    The loop of spec §2.3 keeps adding capped documents while collected <= N, so a rank takes the fewest documents
    whose capped lengths sum past N (the last one is then cut to make exactly N + 1): one binary search per rank."""
    cursors = [cursor]
    for _ in range(world_size):
        end = int(np.searchsorted(cum_lens, cum_lens[cursors[-1]] + tokens_per_rank, side="right"))
        if end >= len(cum_lens):
            return None
        cursors.append(end)
    return cursors


def _micro_batch_tokens(global_batch: int, grad_accum: int, world_size: int) -> int:
    """N = per-rank tokens of one micro-batch (spec §2.2)."""
    if global_batch <= 0 or grad_accum <= 0 or global_batch % (grad_accum * world_size) != 0:
        raise DataError(f"the global batch of {global_batch} tokens does not divide into world_size * grad_accum = "
                        f"{world_size} * {grad_accum} micro-batches; change --train_bs_schedule or --batch_slices "
                        f"(= processes * accumulation steps), or the number of processes")
    return global_batch // (grad_accum * world_size)


def _to_device(array: np.ndarray, dtype: type, device: torch.device) -> Tensor:
    """Host array -> tensor of numpy `dtype` (np.int32 / np.int64) on `device`; numpy does the cast (torch's uint16
    casts are slow). On CUDA the data goes through a fresh pinned buffer and a non-blocking copy; the caching host
    allocator does not reuse that buffer before the copy has run."""
    if device.type != "cuda":
        return torch.from_numpy(array.astype(dtype))
    host = torch.empty(array.shape, dtype=torch.from_numpy(np.empty(0, dtype)).dtype, pin_memory=True)
    host.numpy()[...] = array
    return host.to(device, non_blocking=True)


def train_batches(files: list[str], global_batch: int, grad_accum: int, rank: int, world_size: int,
                  device: torch.device, max_seq_len: int, tokens_per_doc_bound: int,
                  ) -> Generator[tuple[Tensor, Tensor, Tensor], tuple[int, int, int] | None, None]:
    """BOS-aligned training micro-batches of `rank` (spec §2.3, §2.4). Each request yields
    (inputs int32 (N,), targets int64 (N,), cu_seqlens int32 (max_num_docs(N),)) on device, N = global_batch/(A*W).
    With each request send None or (global_batch, max_seq_len, grad_accum); a triple applies to the batch it gets.
    The arguments are checked now; the first shard is read on the first request (inside the timed region, spec §1)."""
    if not files:
        raise DataError(f"no training shards given; {_GET_DATA_HINT}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    _micro_batch_tokens(global_batch, grad_accum, world_size)
    return _train_batch_stream(list(files), global_batch, grad_accum, rank, world_size, device, max_seq_len,
                               tokens_per_doc_bound)


def _train_batch_stream(files: list[str], global_batch: int, grad_accum: int, rank: int, world_size: int,
                        device: torch.device, max_seq_len: int, tokens_per_doc_bound: int):
    tokens_per_rank = _micro_batch_tokens(global_batch, grad_accum, world_size)
    shards = _TrainShards(files)
    cursor = 0                                   # index of the next unused document of the current shard
    message = None
    while True:
        if message is not None:                  # applies to the batch answering it (spec §2.4)
            global_batch, max_seq_len, grad_accum = message
            tokens_per_rank = _micro_batch_tokens(global_batch, grad_accum, world_size)
        shards.poll()
        while (cursors := _plan_joint_batch(shards.current.cum_lens(max_seq_len), cursor, tokens_per_rank,
                                            world_size)) is None:
            if shards.extend():                  # abandon the partial batch; restart it from the next shard's start
                cursor = 0
        shard = shards.current
        first, end = cursors[rank], cursors[rank + 1]
        cursor = cursors[-1]                     # commit after all ranks are planned
        # This rank's segments: documents first..end-1 cut to max_seq_len, the last one cut so that the segments
        # hold exactly N + 1 tokens (its final token is only a target).
        seg_lens = np.minimum(shard.doc_lens[first:end], max_seq_len)                    # (m,)
        seg_lens[-1] = tokens_per_rank + 1 - (seg_lens.sum() - seg_lens[-1])
        _check_doc_capacity(len(seg_lens), tokens_per_rank, tokens_per_doc_bound, "a training micro-batch")
        buf = np.concatenate([shard.tokens[s:s + n] for s, n in zip(shard.bos[first:end].tolist(),
                                                                     seg_lens.tolist())])  # (N+1,) uint16
        # Boundaries [0, l1, l1+l2, ..., N] padded with N; the last segment lent its last token as the final target.
        cu_seqlens = np.full(max_num_docs(tokens_per_rank, tokens_per_doc_bound), tokens_per_rank, dtype=np.int32)
        cu_seqlens[0] = 0
        cu_seqlens[1:len(seg_lens)] = np.cumsum(seg_lens[:-1])
        message = yield (_to_device(buf[:-1], np.int32, device), _to_device(buf[1:], np.int64, device),
                         _to_device(cu_seqlens, np.int32, device))


def val_batches(files: list[str], val_batch_size: int, val_tokens: int, grad_accum: int, rank: int, world_size: int,
                device: torch.device, tokens_per_doc_bound: int) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """The validation forwards of `rank` (spec §2.5): grad_accum * val_tokens / val_batch_size batches of
    (inputs int32 (N_val,), targets int64 (N_val,), cu_seqlens int32 (max_num_docs(N_val),)), N_val =
    val_batch_size / (A * W). Not BOS aligned: every call scores the same first val_tokens tokens of the val stream.
    The arguments and the shard sizes are checked now, so a shortage fails before the first forward."""
    if not files:
        raise DataError(f"no validation shards given; {_GET_DATA_HINT}")
    if val_batch_size <= 0 or val_batch_size % (grad_accum * world_size) != 0:
        raise DataError(f"--val_batch_size={val_batch_size} does not divide into world_size * grad_accum = "
                        f"{world_size} * {grad_accum} forwards; change --val_batch_size or --batch_slices")
    if val_tokens <= 0 or val_tokens % val_batch_size != 0:
        raise DataError(f"--val_tokens={val_tokens} is not a multiple of --val_batch_size={val_batch_size}; change "
                        f"one of them")
    tokens_per_rank = val_batch_size // (grad_accum * world_size)
    step_tokens = world_size * tokens_per_rank     # the global cursor advances this much per forward
    num_forwards = grad_accum * val_tokens // val_batch_size
    # Place every forward now from the shard sizes. As in the record, a forward moves to the start of the next shard
    # when pos + W*N_val + 1 >= shard length (so a forward ending exactly at the shard end moves too); shards too
    # short for one forward are skipped (the record would fail on them).
    sizes = [shard_num_tokens(path) for path in files]
    placements, shard, pos = [], 0, 0                                     # (shard index, cursor) per forward
    for _ in range(num_forwards):
        if pos + step_tokens + 1 >= sizes[shard]:
            shard, pos = shard + 1, 0
            while shard < len(files) and step_tokens + 1 > sizes[shard]:
                shard += 1
            if shard == len(files):
                raise DataError(
                    f"the val shards ({len(files)} files, {sum(sizes):,} tokens; first {files[0]}) cannot hold "
                    f"{num_forwards} forwards of {step_tokens:,} tokens: scoring --val_tokens={val_tokens:,} needs a "
                    f"shard of at least {val_tokens + 2:,} tokens (each forward reads one look-ahead token, and one "
                    f"that does not fit moves to the next shard). Lower --val_tokens (a multiple of "
                    f"--val_batch_size={val_batch_size:,}) or add val shards")
        placements.append((shard, pos))
        pos += step_tokens
    return _val_batch_stream(files, placements, tokens_per_rank, rank, device, tokens_per_doc_bound)


def _val_batch_stream(files: list[str], placements: list[tuple[int, int]], tokens_per_rank: int, rank: int,
                      device: torch.device, tokens_per_doc_bound: int):
    for shard, pos in placements:
        start = pos + rank * tokens_per_rank     # ranks overlap by one token: the look-ahead target
        buf = np.fromfile(files[shard], dtype=np.uint16, count=tokens_per_rank + 1,
                          offset=SHARD_HEADER_BYTES + 2 * start)                           # (N_val+1,) uint16
        if len(buf) != tokens_per_rank + 1:
            raise DataError(f"val shard {files[shard]} shrank while being read; download or generate it again")
        inputs = buf[:-1]
        bos = np.flatnonzero(inputs == BOS_ID)                                             # (m,) positions
        # [0, b_1, b_2, ...] padded with N_val: the partial document before b_1 is its own sequence (empty if
        # inputs[0] is a BOS), and val documents are not cut to a maximum length.
        _check_doc_capacity(len(bos) + 1, tokens_per_rank, tokens_per_doc_bound, "a validation forward")
        cu_seqlens = np.full(max_num_docs(tokens_per_rank, tokens_per_doc_bound), tokens_per_rank, dtype=np.int32)
        cu_seqlens[0] = 0
        cu_seqlens[1:len(bos) + 1] = bos
        yield (_to_device(inputs, np.int32, device), _to_device(buf[1:], np.int64, device),
               _to_device(cu_seqlens, np.int32, device))


# =====================================================================================================================
# 7. Schedules: pure functions of the step (spec §6)
# =====================================================================================================================

def schedule_third(step: int, num_scheduled: int) -> int:
    """0, 1 or 2: which third of the schedule `step` is in (steps past the schedule stay in the last)."""
    return min(int(3 * (step / num_scheduled)), 2)


def global_batch_size(step: int, num_scheduled: int, bs_schedule: Sequence[int]) -> int:
    return bs_schedule[schedule_third(step, num_scheduled)]


def window_sizes(step: int, num_scheduled: int, ws_long_schedule: Sequence[int], ws_long_extension: int) -> tuple[int, int]:
    """(short, long) attention windows in blocks; short is half the long one, rounded down."""
    ws_long = ws_long_extension if step >= num_scheduled else ws_long_schedule[schedule_third(step, num_scheduled)]
    return ws_long // 2, ws_long


def lr_factor(step: int, num_scheduled: int, peaks: Sequence[float], lr_min: float, cooldown_frac: float) -> float:
    """Multiplier on every base lr: a per-third peak, then a linear cooldown to lr_min, then lr_min."""
    if step > num_scheduled:
        return lr_min
    x = step / num_scheduled
    peak = peaks[2] if x > 2 / 3 else peaks[1] if x > 1 / 3 else peaks[0]
    if x >= 1 - cooldown_frac:
        w = (1 - x) / cooldown_frac
        return peak * w + lr_min * (1 - w)
    return peak


def muon_momentum(step: int, num_iterations: int, lo: float, hi: float, warmup: int, cooldown: int) -> float:
    """NorMuon momentum: lo -> hi over `warmup` steps, hi, then down by (hi - lo) over the last `cooldown` steps."""
    if step < warmup:
        return lo + (hi - lo) * step / warmup
    if step > num_iterations - cooldown:
        return hi - (hi - lo) * (step - (num_iterations - cooldown)) / cooldown
    return hi


def mtp_weights(step: int, num_scheduled: int, start: Sequence[float]) -> tuple[float, ...]:
    """Multi-token-prediction weights: three targets fading to two over the first third, to one over the second."""
    x = step / num_scheduled
    if x < 1 / 3:
        return (start[0], start[1], start[2] * (1 - 3 * x))
    if x < 2 / 3:
        return (start[0], start[1] * (2 - 3 * x))
    return (start[0],)


@dataclass(frozen=True)
class StepSchedule:
    step: int
    global_batch: int            # tokens per optimizer step over all ranks and micro-steps
    ws_short: int                # windows in blocks
    ws_long: int
    lr_factor: float
    momentum: float
    mtp_weights: tuple
    do_adam: bool                # Adam steps on odd steps only, on the sum of two steps' gradients


def schedule_at(step: int, hp: Hyperparameters) -> StepSchedule:
    ns = hp.num_scheduled_iterations
    ws_short, ws_long = window_sizes(step, ns, hp.ws_long_schedule, hp.ws_long_extension)
    return StepSchedule(
        step=step,
        global_batch=global_batch_size(step, ns, hp.train_bs_schedule),
        ws_short=ws_short, ws_long=ws_long,
        lr_factor=lr_factor(step, ns, hp.lr_peaks, hp.lr_min, hp.cooldown_frac),
        momentum=muon_momentum(step, hp.num_iterations, hp.momentum_min, hp.momentum_max,
                               hp.momentum_warmup_steps, hp.momentum_cooldown_steps),
        mtp_weights=mtp_weights(step, ns, hp.mtp_weights_start),
        do_adam=step % 2 == 1,
    )


# <<MAIN SECTION>>
