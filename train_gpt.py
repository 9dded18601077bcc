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
# Every backend computes the same thing (spec §3.5 step 6): packed documents q, k, v (T, H, D) bf16 with boundaries
# cu_seqlens = [0, c_1, ..., T, T, ...] (int32; trailing repeats are empty documents); query t of document
# [c_j, c_{j+1}) sees keys t' with c_j <= t' <= t and t - window <= t' (window + 1 keys at most, itself included);
# logits scale * <q_t, k_t'>, softmax in fp32, output (T, H, D) in q's dtype.
#   fa3    FlashAttention-3 `flash_attn_varlen_func` (Hopper), when the module `flash_attn_interface` is installed.
#   flex   torch flex_attention with a block mask built from cu_seqlens; fused only under torch.compile, CUDA only
#          for training (its CPU path has no backward; the CPU tests call it forward-only).
#   varlen torch.nn.attention.varlen.varlen_attn (FlashAttention-2 inside torch), CUDA only.
#   sdpa   a dense-mask reference (O(T^2) memory) for CPUs and tests.
ATTN_BACKENDS = ("flex", "varlen", "fa3", "sdpa")
# "auto" on CUDA takes the first available of these: FA3 (Hopper-native, the record's kernel), then flex and torch's
# FA2-based varlen, whose order is to be confirmed by `python3 bench/attention.py` on 1xH100 (it prints the order
# weighted by the record's use). Off CUDA "auto" means sdpa (the only backend with a CPU backward).
ATTN_AUTO_ORDER_CUDA = ("fa3", "flex", "varlen", "sdpa")
FLEX_BLOCK_SIZE = 128  # tokens per flex sparse block (q and kv); flex's kernel tiles (64 or 128) divide it


def _import_fa3() -> Any:
    """The FlashAttention-3 module, or None when it is not installed (or its CUDA library does not load)."""
    try:
        import flash_attn_interface
    except Exception:  # ImportError, or OSError from a .so built for another torch/CUDA
        return None
    return flash_attn_interface


def _import_torch_varlen() -> Callable | None:
    """torch's varlen_attn if this torch has it with sliding-window and scale arguments (torch >= 2.11), else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    import inspect
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn if "window_size" in params and "scale" in params else None


def _import_flex() -> Any:
    try:
        from torch.nn.attention import flex_attention
    except ImportError:
        return None
    return flex_attention


def available_attn_backends(device: torch.device) -> list[str]:
    """Backends that can run on `device`, in ATTN_BACKENDS order."""
    on_cuda = torch.device(device).type == "cuda"
    usable = {
        "flex": on_cuda and _import_flex() is not None,  # on CPU flex runs forward only (no backward in torch 2.13)
        "varlen": on_cuda and _import_torch_varlen() is not None,
        "fa3": on_cuda and _import_fa3() is not None,
        "sdpa": True,
    }
    return [name for name in ATTN_BACKENDS if usable[name]]


def resolve_attn_backend(name: str, device: torch.device) -> str:
    """Turn --attn_backend into a backend that runs on `device`: "auto" picks the fastest available one."""
    available = available_attn_backends(device)
    if name == "auto":
        if torch.device(device).type != "cuda":
            return "sdpa"
        return next(b for b in ATTN_AUTO_ORDER_CUDA if b in available)
    if name not in ATTN_BACKENDS:
        raise ValueError(f"unknown --attn_backend={name!r}; choose auto or one of {', '.join(ATTN_BACKENDS)}")
    if name not in available:
        raise ValueError(f"--attn_backend={name} cannot run on {device} here (fa3 needs the flash_attn_interface "
                         f"module and CUDA; varlen needs torch >= 2.11 and CUDA; flex needs CUDA); available: "
                         f"{', '.join(available)}; pass one of these or --attn_backend=auto")
    return name


def document_ids(cu_seqlens: Tensor, num_tokens: int) -> Tensor:
    """(num_tokens,) index j of the document [c_j, c_{j+1}) holding each packed position (cu_seqlens' dtype).
    searchsorted(right=True) counts the boundaries <= t, so repeated boundaries (empty documents) are skipped."""
    positions = torch.arange(num_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens, positions, right=True) - 1


def _blocks_to_ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """(n_q, n_kv) bool block matrix -> flex's (1, 1, n_q) int32 counts and (1, 1, n_q, n_kv) int32 kv-block indices,
    the selected blocks first in ascending order (the rest of each row is ignored by the kernel)."""
    counts = blocks.sum(dim=-1, dtype=torch.int32)
    indices = torch.sort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).indices.to(torch.int32)
    return counts[None, None], indices[None, None]


def flex_document_block_mask(cu_seqlens: Tensor, num_tokens: int, window: int, block_size: int) -> Any:
    """BlockMask for same-document & causal & sliding-window attention over `num_tokens` packed positions.

    Built from two numbers per q block instead of evaluating the mask on all T^2 pairs (create_block_mask's way).
    Query q may see the key interval [lo(q), q], lo(q) = max(document start of q, q - window); lo is nondecreasing
    in q and lo(q) <= q, so the keys seen by a q block [first, last] are exactly [lo(first), last] and the keys seen by
    every query of the block are [lo(last), first]. Hence kv block j is
        used by q block i  iff  j <= i and j's last key >= lo(first),
        full (all pairs allowed, mask_mod skipped) iff j < i and j's first key >= lo(last).
    """
    from torch.nn.attention.flex_attention import BlockMask
    doc_id = document_ids(cu_seqlens, num_tokens)                                 # (T,)
    doc_start = cu_seqlens[doc_id]                                                # (T,) first position of t's document

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc_id[q_idx] == doc_id[kv_idx]) & (kv_idx <= q_idx) & (q_idx - kv_idx <= window)

    num_blocks = -(-num_tokens // block_size)
    block = torch.arange(num_blocks, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    first_q = block * block_size
    last_q = torch.clamp(first_q + block_size - 1, max=num_tokens - 1)
    lo_first = torch.maximum(doc_start[first_q], first_q - window)               # (n,) lowest key any query sees
    lo_last = torch.maximum(doc_start[last_q], last_q - window)                  # (n,) lowest key all queries see
    q_blk, kv_blk = block[:, None], block[None, :]
    used = (kv_blk <= q_blk) & ((kv_blk + 1) * block_size - 1 >= lo_first[:, None])   # (n, n)
    full = (kv_blk < q_blk) & (kv_blk * block_size >= lo_last[:, None])               # (n, n), a subset of used
    kv_num, kv_idx = _blocks_to_ordered(used & ~full)
    full_num, full_idx = _blocks_to_ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                    seq_lengths=(num_tokens, num_tokens))


def _flex_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int, scale: float) -> Tensor:
    from torch.nn.attention.flex_attention import flex_attention
    if q.is_cuda and not torch.compiler.is_compiling():
        # Outside torch.compile flex falls back to an unfused path that materialises (H, T, T) scores.
        raise ValueError("--attn_backend=flex runs fused only inside torch.compile; use --compile=True, or "
                         "--attn_backend=varlen/fa3 for eager CUDA runs")
    block_mask = flex_document_block_mask(cu_seqlens, q.size(0), window, FLEX_BLOCK_SIZE)
    # (T, H, D) -> (1, H, T, D) views; flex reads strides, and its output keeps q's stride order, so the transpose
    # back is a free view onto a (T, H, D)-contiguous buffer.
    out = flex_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                         block_mask=block_mask, scale=scale)
    return out[0].transpose(0, 1)


def _sdpa_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int, scale: float) -> Tensor:
    num_tokens = q.size(0)
    doc_id = document_ids(cu_seqlens, num_tokens)
    pos = torch.arange(num_tokens, device=q.device)
    allowed = ((doc_id[:, None] == doc_id[None, :]) & (pos[None, :] <= pos[:, None])
               & (pos[:, None] - pos[None, :] <= window))                          # (T_q, T_k) bool
    # fp32 inputs make the softmax fp32 whatever kernel SDPA picks; (H, T, D) layout
    out = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                         v.transpose(0, 1).float(), attn_mask=allowed, scale=scale)
    return out.transpose(0, 1).to(q.dtype)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, window: int, scale: float,
                     backend: str) -> Tensor:
    """Causal sliding-window attention within packed documents (see the top of this section), (T, H, D) -> (T, H, D).
    max_seqlen is a launch hint for fa3/varlen and must be >= the longest document; window >= 0 in positions."""
    # Plain imports here (the probing with try/inspect lives in available_attn_backends): this runs inside the
    # compiled model, where dynamo traces import statements but not inspect.signature.
    if backend == "fa3":
        import flash_attn_interface
        out = flash_attn_interface.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                                          softmax_scale=scale, causal=True, window_size=(window, 0))
        return out[0] if isinstance(out, tuple) else out  # some FA3 builds also return the log-sum-exp
    if backend == "varlen":
        from torch.nn.attention.varlen import varlen_attn
        # window_size=(left, right): keys t - left .. t + right; right = 0 makes it causal
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale,
                           window_size=(window, 0))
    if backend == "flex":
        return _flex_varlen_attention(q, k, v, cu_seqlens, window, scale)
    if backend == "sdpa":
        return _sdpa_varlen_attention(q, k, v, cu_seqlens, window, scale)
    raise ValueError(f"unknown attention backend {backend!r}; resolve --attn_backend with resolve_attn_backend()")


# =====================================================================================================================
# 5. Model
# =====================================================================================================================
# <<MODEL SECTION>>


# =====================================================================================================================
# 6. Data
# =====================================================================================================================
# <<DATA SECTION>>


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
