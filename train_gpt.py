"""NanoGPT speedrun trainer: a GPT-2-small-class model trained on FineWeb to 3.28 validation loss.

Run on one node with `./run.sh` (torchrun over the GPUs found); `python train_gpt.py --preset=tiny
...` runs on a CPU. The training math is that of record 89 of the modded-nanogpt speedrun
(docs/names.md maps the record's names to ours; docs/credits.md credits who introduced each idea;
the records this file trained before, 61, 80 and 84, are pinned in records/).
This file is the math and the loop, in reading order:
    1. knobs   2. model (attention, FP8 head and loss, GPT)   3. the op table   4. optimizer
    5. data   6. schedules   7. compiler settings   8. building a run   9. training: the step,
    validation, warmup and reset, the timed loop and its clock, main()
A copy of this file under any name runs itself (cp train_gpt.py my_idea.py; python3 my_idea.py
or TRAIN=my_idea.py ./run.sh): its log embeds the copy, its compile helpers load the copy.
Beside it, each imported with plain values passed down and never importing this file:
triton_kernels.py (tk: the fused kernels, each beside its plain-PyTorch reference; which of the two
runs each op is chosen once per run, kernel_ops), checks.py (the option, layout, table and data
checks, backend probing, the preflight), harness.py (options, the log, compile cache,
checkpoints, signals, exit codes) and compile_split.py (helper processes that compile the warmup's
graphs in parallel). A run's log holds this file, checks.py and triton_kernels.py in full.
Nothing happens at import.
"""
from __future__ import annotations

import bisect
import contextlib
import copy
import dataclasses
import functools
import gc
import hashlib
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Generator, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import checks
import compile_split
import harness
import triton_kernels as tk
from data.shards import SHARD_HEADER_BYTES
from harness import ConfigError, DataError

# ==================================================================================================
# 1. Knobs: the optimizer table, the schedule table, the options that change the math, presets
# ==================================================================================================

# The per-parameter optimizer table, one row per model parameter (GPT's attribute names). optim:
# "adam" | "normuon"; comms: "none" | "replicated" | "sharded"; betas are Adam's (beta1, beta2). A
# NorMuon bank is a stack of matrices of the shapes the model gives (GPT.bank_matrix_shapes);
# matrix_lr_muls cycles over a matrix's index in that stack (c_fc and c_proj alternate in the MLP
# bank, so c_proj gets 2x).
# The row order is the order in which the gradient reductions are launched: the big banks first, so
# their reduce-scatters start earliest. The order of the updates is derived from the rows
# (update_order).
DEFAULT_PARAM_TABLE: dict[str, dict[str, Any]] = {
    # Q/K per head pair, V/O per matrix, each orthogonalised alone (upstream record 80, PR #253)
    "qk":             dict(optim="normuon", comms="sharded",    lr_mul=1.0,  wd_mul=1.0),
    "vo":             dict(optim="normuon", comms="sharded",    lr_mul=1.0,  wd_mul=1.0),
    "mlp":            dict(optim="normuon", comms="sharded",    lr_mul=1.0,  wd_mul=1.0,   matrix_lr_muls=(1.0, 2.0)),
    "scalars":        dict(optim="adam",    comms="replicated", lr_mul=5.0,  wd_mul=0.0,   betas=(0.9, 0.99)),
    "smear_gate":     dict(optim="adam",    comms="replicated", lr_mul=0.01, wd_mul=0.0,   betas=(0.9, 0.99)),
    "ve_gate_bank":   dict(optim="adam",    comms="replicated", lr_mul=1.0,  wd_mul=1.0,   betas=(0.9, 0.99)),
    "lm_head":        dict(optim="adam",    comms="sharded",    lr_mul=1.0,  wd_mul=150.0, betas=(0.5, 0.95)),
    "bigram_embed":   dict(optim="adam",    comms="sharded",    lr_mul=75.0, wd_mul=5.0,   betas=(0.75, 0.95)),
    "post_lambdas":   dict(optim="adam",    comms="replicated", lr_mul=1.0,  wd_mul=0.0,   betas=(0.9, 0.95)),
    "resid_lambdas":  dict(optim="adam",    comms="replicated", lr_mul=5.0,  wd_mul=0.0,   betas=(0.9, 0.95)),
    "value_embeds":   dict(optim="adam",    comms="sharded",    lr_mul=75.0, wd_mul=5.0,   betas=(0.75, 0.95)),
    "embed":          dict(optim="adam",    comms="sharded",    lr_mul=1.0,  wd_mul=150.0, betas=(0.5, 0.95)),
    "mudd_w1":        dict(optim="adam",    comms="replicated", lr_mul=0.25, wd_mul=1.0,   betas=(0.9, 0.99)),
    "mudd_w2":        dict(optim="adam",    comms="replicated", lr_mul=0.25, wd_mul=1.0,   betas=(0.9, 0.99)),
    "mudd_b2":        dict(optim="adam",    comms="replicated", lr_mul=0.25, wd_mul=0.0,   betas=(0.9, 0.99)),
    # the per-token gates of record 85 (upstream PR #315)
    "mudd_gate_w1":   dict(optim="adam",    comms="replicated", lr_mul=0.1,  wd_mul=1.0,   betas=(0.9, 0.99)),
    "mudd_gate_w2":   dict(optim="adam",    comms="replicated", lr_mul=0.1,  wd_mul=1.0,   betas=(0.9, 0.99)),
    "mudd_gate_b2":   dict(optim="adam",    comms="replicated", lr_mul=0.1,  wd_mul=0.0,   betas=(0.9, 0.99)),
    "mudd_gate_scale": dict(optim="adam",   comms="replicated", lr_mul=0.1,  wd_mul=0.0,   betas=(0.9, 0.99)),
}


@dataclass(frozen=True)
class Stage:
    """One row of the schedule table: the scheduled steps are split evenly between the stages, in
    order (stage_starts); everything in a row takes effect at the stage's first step."""
    batch: int             # global tokens per step
    lr_peak: float         # lr factor until the cooldown starts (lr_factor)
    ws_long: int           # long attention window in blocks; the short one is half, rounded down
    mtp_start: tuple       # weights of the next 1, 2, ... tokens at the stage's first step, moving
    mtp_end: tuple         # linearly to these at its end (upstream record 65, PR #215)
    max_doc_len: int       # training documents are cut to this many tokens (record 72, PR #224)
    prefix_start: float = 0.0  # weight of the target's longest proper prefix token in the
    prefix_end: float = 0.0    # training loss, moving linearly like the MTP weights (upstream
                               # record 88, PR #337); a row without them has no prefix term


@dataclass
class Hyperparameters(harness.RunOptions):
    """Every option that changes what a run computes (resume must keep them; they key the compile
    cache). The run-control options (data paths, logging, checkpoints, devices, compiling) are the
    fields of harness.RunOptions, which this class extends: any field is --name=value."""
    # ---- data shapes ----
    val_tokens: int = 10_485_760           # tokens per validation (a fixed val prefix)
    val_batch_size: int = 2_097_152        # global val tokens per val step (4*64*1024*8)
    tokens_per_doc_bound: int = 300        # cu_seqlens holds ceil128(N / this) entries
    batch_slices: int = 8                  # micro-batches per global batch (world * accum)
    # ---- steps and schedules ----
    stages: tuple = (                      # schedule table (option, per stage: batch:lr_peak:
                                           # ws_long:a1/a2:b1/b2:max_doc_len:p_start:p_end)
        Stage(batch=131_072, lr_peak=1.0, ws_long=3, mtp_start=(1.0, 0.5, 0.25),
              mtp_end=(1.0, 0.5, 0.0), max_doc_len=896, prefix_start=0.25, prefix_end=0.25),
        Stage(batch=262_144, lr_peak=1.52, ws_long=7, mtp_start=(1.0, 0.5), mtp_end=(1.0, 0.0),
              max_doc_len=2048, prefix_start=0.25, prefix_end=0.0),
        Stage(batch=393_216, lr_peak=1.73, ws_long=11, mtp_start=(1.0,), mtp_end=(1.0,),
              max_doc_len=2048, prefix_start=0.0, prefix_end=0.0),
    )
    num_scheduled_iterations: int = 1270   # steps of the lr / batch / window schedule
    num_extension_iterations: int = 15     # extra steps at the last stage's values, lr_min and
                                           # the extended window
    cooldown_frac: float = 0.6             # fraction of scheduled steps spent decaying lr to lr_min
    lr_min: float = 0.15                   # lr factor at the end of cooldown and in the extension
    momentum_min: float = 0.85             # NorMuon momentum at step 0, rising linearly ...
    momentum_max: float = 0.95             # ... to this ...
    momentum_warmup_steps: int = 300       # ... over this many steps,
    momentum_cooldown_steps: int = 50      # falling by (max - min) over the last this-many steps
    # ---- attention windows (in blocks of block_size tokens) ----
    block_size: int = 128                  # tokens per window block
    ws_long_extension: int = 13            # long window during the extension steps
    ws_long_final_val: int = 20            # long window for the final validation (no YaRN update)
    # ---- model ----
    vocab_size: int = 50304                # 50257 GPT-2 ids padded to a multiple of 128
    model_dim: int = 768                   # residual width = num_heads * head_dim
    num_heads: int = 6                     # attention heads per layer (even for paired layers)
    head_dim: int = 128                    # channels per head (a multiple of 4: rotary pairs)
    mlp_hidden: int = 3072                 # MLP hidden width
    num_layers: int = 11                   # transformer layers (one layout entry each)
    num_value_embeds: int = 5              # value-embedding tables (vocab x model_dim each)
    bigram_vocab_size: int = 377_280       # rows of the bigram-hash embedding (7.5 x vocab), each
                                           # model_dim wide: hashes modulo rows - 1, the last row
                                           # is position 0's
    bigram_sign_rows: int = 8192           # fixed random +-1 rows, one per (previous id XOR id)
                                           # modulo this (a power of two), that sign each lookup
    attn_layout: str = "PNPNNP-NNPN"       # per layer: P paired heads, N normal, - no attention
    long_window_layers: tuple = (3, 10)    # layers with the long window (normal ones: key offset)
    ve_layout: tuple = (-1, 0, 1, -1, -1, -1, -1, -1, 2, 3, 4)  # value-embedding table per layer
    skip_source_layer: int = 3             # its output is added (gated) to the input of ...
    skip_dest_layer: int = 6               # ... this layer, in place of its attention sublayer
    cached_input_layer: int = 7            # attention of every later layer reads rms of its output
    mudd_hidden: int = 64                  # hidden width of the two MUDD blocks (last layer's
                                           # dynamic weights and the mix after it)
    mudd_scale: float = 0.1                # MUDD coefficients = this * (W2 gelu(W1 z) + b)
    mudd_gate_hidden: int = 64             # hidden width of the two per-token gate MLPs
    mudd_gate_scale: float = 0.1           # initial value of their learnable output scale s:
                                           # gates = bf16(s) * (W2 gelu(W1 z) + b)
    dc_window: int = 112                   # keys (itself included) of the last layer's DC softmax
    rope_base: float = 1024.0              # frequencies (1/base)^(j/(n-1)) on a head's first half
    attn_scale: float = 0.1                # softmax scale at the start (YaRN grows it)
    yarn_alpha: float = 1.0                # YaRN: frequencies turning fewer than alpha times over
    yarn_beta: float = 32.0                # the old window stretch fully, beta+ times not at all
    fp8_scales: tuple = (100 / 448, 1.6 / 448, 0.75 / 448)  # x, w, grad scales of the FP8 LM head
    use_fp8: bool = True                   # FP8 LM head in training (emulated off CUDA)
    fp8_mlp: bool = True                   # FP8 e4m3 forward of the MLP up projection in training
                                           # (emulated off CUDA; the backward stays bf16)
    dtype: str = "bfloat16"                # float32 / float64: the math without bf16 (CPU only);
                                           # auto: bf16 on GPUs and on CPUs with bf16 instructions,
                                           # else float32 (bf16 is emulated there, ~10x slower)
    # ---- optimizer ----
    adam_lr: float = 0.008                 # Adam base lr (times the row's lr_mul and the schedule)
    adam_eps: float = 1e-10                # Adam epsilon (not bias corrected)
    adam_wd: float = 0.005                 # Adam cautious weight decay (times wd_mul): lr^2 * wd
    muon_lr: float = 0.023                 # NorMuon base lr for the matrix banks
    muon_beta2: float = 0.9                # NorMuon second-moment decay (0.9: upstream record 78)
    muon_wd: float = 1.2                   # NorMuon cautious weight decay (times the row's wd_mul)
    param_table: dict = field(             # optimizer row per label
        default_factory=lambda: copy.deepcopy(DEFAULT_PARAM_TABLE))
    # ---- system ----
    preset: str = ""                       # "tiny": a few narrow layers for CPU tests and newcomers
    compile: bool = True                   # torch.compile the model (ignored on CPU)
    kernels: str = "fused"                 # fused | torch | op:torch,op:fused,... (KERNEL_OPS): on
                                           # CUDA, which ops run their plain-PyTorch reference
                                           # (fused: those edited; CPUs always do; kernel_ops)

    # ---- derived ----
    @property
    def num_iterations(self) -> int:
        return self.num_scheduled_iterations + self.num_extension_iterations

    @property
    def untie_step(self) -> int:
        """Untie embed and lm_head after this step: the first step of the last stage, made odd
        (an Adam step); 847 for the record. Past the last step of a short run: they stay tied."""
        return stage_starts(self.num_scheduled_iterations, len(self.stages))[-1] | 1


PRESETS: dict[str, dict[str, Any]] = {
    # Same kinds of layer as the record (paired, normal, long window + key offset, no-attention
    # layer, skip, cached input, value embeddings on paired and normal layers, the MUDD layer
    # last), narrow enough that a step takes well under a second on a CPU.
    "tiny": dict(
        model_dim=128, num_heads=4, head_dim=32, mlp_hidden=512, num_layers=6,
        attn_layout="PNN-PN", long_window_layers=(1, 5), ve_layout=(-1, -1, -1, -1, 0, 1),
        num_value_embeds=2, bigram_vocab_size=5 * 1024, bigram_sign_rows=256,
        skip_source_layer=1, skip_dest_layer=3, cached_input_layer=3, mudd_hidden=16,
        mudd_gate_hidden=16, dc_window=12, batch_slices=2, block_size=16,
        stages=(Stage(512, 1.0, 3, (1.0, 0.5, 0.25), (1.0, 0.5, 0.0), 128, 0.25, 0.25),
                Stage(768, 1.52, 7, (1.0, 0.5), (1.0, 0.0), 256, 0.25, 0.0),
                Stage(1024, 1.73, 11, (1.0,), (1.0,), 256, 0.0, 0.0)),
        ws_long_extension=13, ws_long_final_val=20,
        val_batch_size=2048, val_tokens=4096, num_scheduled_iterations=60,
        num_extension_iterations=4, momentum_warmup_steps=10, momentum_cooldown_steps=4,
        val_loss_every=20,
        tokens_per_doc_bound=100, compile=False, use_fp8=False, fp8_mlp=False, attn_backend="sdpa",
        warmup=False,
        dtype="auto",
    ),
}


def parse_args(argv: Sequence[str]) -> Hyperparameters:
    """The options from `--name=value` arguments (harness.parse_args; --help lists them)."""
    return harness.parse_args(argv, Hyperparameters(), PRESETS)


# ==================================================================================================
# 2. Model: attention, the FP8 head and its loss, the GPT
# ==================================================================================================
GATE_INPUT_DIM = 12                        # every sigmoid gate reads the
                                           # first 12 channels of its input
YARN_ATTN_SCALE_SLOPE = 0.2                # attn_scale *= 1 + slope * ln(new/old)
                                           # at each long-window change
RECORD_BANK_MULTIPLE = 8                   # the record pads its banks to shard over 8 GPUs
XSA_NORM_SQ_FLOOR = 1e-8                   # XSA divides by max(|v|^2, this)
# MUDD (multiway dynamic dense connections, upstream record 81, PR #259): two small per-token MLPs
# of raw residual streams give coefficients c = mudd_scale * (W2 gelu(W1 z) + b). Block 0 reads the
# last layer's input and sets that layer's value mix, VE gate (one per half of the heads) and all
# six residual weights; block 1 reads the last layer's output and mixes earlier streams into it.
# Streams: h0 = x0 (with layer 0's bigram), cached = cached_input_layer's output, last_in = the
# last layer's input, skip = skip_source_layer's output, ve = the first value-embedding table's
# row. Each coefficient starts (W2 = 0) at its bias times mudd_scale: the values below, which are
# the static weights' initial values (the VE gate at 2, the maximum of 2 sigmoid; the mix at -0.5
# of the cached stream, record 80's backout).
MUDD_LAYER_COEFFS = ("v_h0", "v_cached", "v_last_in", "x_h0", "x_cached", "x_last_in",
                     "ve_gate_lo", "ve_gate_hi", "attn_resid", "attn_post", "attn_x0",
                     "attn_bigram", "mlp_resid", "mlp_post")
MUDD_MIX_COEFFS = ("h0", "cached", "last_in", "ve", "skip")
MUDD_INITIAL = {"ve_gate_lo": 2.0, "ve_gate_hi": 2.0, "attn_resid": math.sqrt(1.1),
                "attn_post": 1.0, "attn_bigram": 0.05, "mlp_resid": math.sqrt(1.1),
                "mlp_post": 1.0}                                  # block 0; the rest start at 0
MUDD_MIX_INITIAL = {"cached": -0.5}                               # block 1

# ---- attention ------------------------------------------------------------------------------------
# Every backend computes the same thing: packed documents q, k, v (T, H, D) bf16 with boundaries
# cu_seqlens = [0, c_1, ..., T, T, ...] (int32; trailing repeats are empty documents); query t of
# document [c_j, c_{j+1}) sees keys t' with c_j <= t' <= t and t - window <= t' (window + 1 keys
# at most, itself included); logits scale * <q_t, k_t'>, softmax in fp32, output (T, H, D) in
# q's dtype. The backends (which are installed, which "auto" picks: checks.py):
#   triton  the project's own kernel (triton_kernels.py): skips every key block outside the window
#           and the document; CUDA only for training.
#   fa3     FlashAttention-3 `flash_attn_varlen_func` (Hopper), when installed.
#   fa4     FlashAttention-4 (`pip install flash-attn-4`), its forward and backward registered as
#           custom ops so they compile (checks.register_fa4_ops).
#   varlen  torch.nn.attention.varlen.varlen_attn (FlashAttention-2 inside torch), CUDA only: the
#           record's own kernel, the fallback and the reference point of speed claims.
#   sdpa    triton_kernels.varlen_attention_reference, a dense-mask definition (O(T^2) memory):
#           what CPUs run, and what every backend is tested against.

def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                     window: int, scale: float, backend: str) -> Tensor:
    """Causal sliding-window attention within packed documents (see the top of this section),
    (T, H, D) -> (T, H, D).
    max_seqlen is a launch hint for fa3/varlen and must be >= the longest document; window >= 0 in
    positions."""
    # Plain imports here (the probing with try/inspect lives in checks.py): this runs
    # inside the compiled model, where dynamo traces import statements but not inspect.signature.
    if backend == "triton":
        return tk.varlen_attention_triton(q, k, v, cu_seqlens, window, scale)
    # v is a view into the qkv projection; FlashAttention wants it contiguous, the Triton kernel
    # takes its strides.
    if backend == "fa3":
        import flash_attn_interface
        out = flash_attn_interface.flash_attn_varlen_func(
            q, k, v.contiguous(), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
            softmax_scale=scale, causal=True, window_size=(window, 0))
        return out[0] if isinstance(out, tuple) else out  # some FA3 builds also
                                                          # return the log-sum-exp
    if backend == "fa4":   # ops registered when the backend was resolved; FA4 copies only inputs
        # whose strides are not 16-byte aligned, so the view v goes in as it is (no extra copy)
        return torch.ops.nanogpt_fa4.fwd(q, k, v, cu_seqlens, max_seqlen, window, scale)[0]
    if backend == "varlen":
        from torch.nn.attention.varlen import varlen_attn
        # window_size=(left, right): keys t - left .. t + right; right = 0 makes it causal
        return varlen_attn(q, k, v.contiguous(), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                           scale=scale, window_size=(window, 0))
    if backend == "sdpa":
        return tk.varlen_attention_reference(q, k, v, cu_seqlens, window, scale)
    raise ValueError(f"unknown attention backend {backend!r}; "
                     "resolve --attn_backend with checks.resolve_attn_backend()")


# ---- the model's pieces ----------------------------------------------------------------------------

def bank_padding(slices: int, matrices_per_slice: int, multiple: int) -> int:
    """Unused slices to append so that (slices + pad) * matrices_per_slice is a multiple of
    `multiple`."""
    return -slices % (multiple // math.gcd(multiple, matrices_per_slice))


@dataclass(frozen=True)
class LayerPlan:
    """One layer's wiring, derived from the layout options once (layer_plan; the forward never names
    a layer index)."""
    index: int
    attn: str            # "P" paired heads, "N" normal, "" none
    attn_slot: int       # attention layer l: qk groups [H*l, H*l + H), vo 2l, 2l+1 (-1: none)
    long_window: bool
    key_offset: bool     # normal long-window layers only (the paired path never shifts keys)
    ve_table: int        # value-embedding table (-1: none)
    ve_slot: int         # slice of ve_gate_bank (-1: none)
    reads_cached: bool   # attention reads rms of cached_input_layer's output, not of x
    skip_dest: bool      # the gated skip is added here, before the attention sublayer (if any)
    skip_source: bool    # its output is the skip (and the post gate's input)
    cached_input: bool   # rms of its output is the attention input of every later layer
    xsa: bool            # removes its output's projection on its own value, per token and head
    mudd: bool           # the last layer: MUDD block 0 sets its VE gate and residual weights
    dc: bool             # the last layer: the DC correction of its attention output
    # Its columns in the outputs of the MUDD gate `gate` (0: pre, reads x0; 1: post, reads the
    # skip source's output), -1 where it has none (mudd_gate_columns):
    gate: int
    xsa_col: int         # XSA strengths, one per head
    out_gate_col: int    # output gate, one per head
    inject_col: int      # x0 gate, then bigram gate (layer 0's forms the residual it starts from)
    skip_col: int        # the skip's gate
    dc_col: int          # DC weights w1 (raw) per head, then w2 per head


def layer_plan(hp: Hyperparameters) -> tuple[LayerPlan, ...]:
    """Every layer's wiring from the layout options, and its gate columns (mudd_gate_columns)."""
    plan, attn_slot, ve_slot = [], 0, 0
    L, H = len(hp.attn_layout), hp.num_heads
    for i, kind in enumerate(hp.attn_layout):
        has_attn, has_ve = kind != "-", hp.ve_layout[i] >= 0
        long_window = has_attn and i in hp.long_window_layers
        reads_cached, mudd = has_attn and i > hp.cached_input_layer, i == L - 1
        plan.append(dict(index=i, attn=kind if has_attn else "",
                         attn_slot=attn_slot if has_attn else -1,
                         long_window=long_window, key_offset=long_window and kind == "N",
                         ve_table=hp.ve_layout[i], ve_slot=ve_slot if has_ve else -1,
                         reads_cached=reads_cached, skip_dest=i == hp.skip_dest_layer,
                         skip_source=i == hp.skip_source_layer,
                         cached_input=i == hp.cached_input_layer,
                         # record 85 (PR #315): XSA only where the input is not the cached one,
                         # output gates on the long-window layers, DC on the last
                         xsa=kind == "N" and not reads_cached and not mudd, mudd=mudd, dc=mudd,
                         gate=0 if i <= hp.skip_source_layer else 1))
        attn_slot += has_attn
        ve_slot += has_ve
    cols = mudd_gate_columns(plan, H)
    return tuple(LayerPlan(**p, **c) for p, c in zip(plan, cols))


def mudd_gate_columns(plan: Sequence[dict], H: int) -> list[dict[str, int]]:
    """Per layer, its first column of each kind in its gate's outputs (-1: none). Each gate lists,
    over the layers it serves in layer order: the XSA strengths (H each), the output gates (H
    each, long-window attention layers), the x0/bigram pairs (every layer with an attention
    sublayer but the MUDD one, and layer 0, whose bigram gate forms the first residual), the skip
    gate, then the DC weights (2H). This is record 85's layout (pre 26 columns, post 41)."""
    cols = [dict(xsa_col=-1, out_gate_col=-1, inject_col=-1, skip_col=-1, dc_col=-1) for _ in plan]
    for g in (0, 1):
        n = 0
        for key, width, wants in (
                ("xsa_col", H, lambda p: p["xsa"]),
                ("out_gate_col", H, lambda p: p["long_window"]),
                ("inject_col", 2, lambda p: (p["attn"] != "" or p["index"] == 0) and not p["mudd"]),
                ("skip_col", 1, lambda p: p["skip_dest"]),
                ("dc_col", 2 * H, lambda p: p["dc"])):
            for p, c in zip(plan, cols):
                if p["gate"] == g and wants(p):
                    c[key], n = n, n + width
    return cols


def mudd_gate_widths(plan: Sequence[LayerPlan], H: int) -> tuple[int, int]:
    """The number of outputs each gate has: one past its last column."""
    ends = [0, 0]
    for p in plan:
        for col, width in ((p.xsa_col, H), (p.out_gate_col, H), (p.inject_col, 2),
                           (p.skip_col, 1), (p.dc_col, 2 * H)):
            if col >= 0:
                ends[p.gate] = max(ends[p.gate], col + width)
    return ends[0], ends[1]


# Initial value of each kind of gate column (the bias is this / mudd_gate_scale; W2 starts at 0):
# no XSA, output gates 0.25, no x0 injection, bigram 0.05, skip 0.5, DC w1 1 and w2 0 (record 85).
MUDD_GATE_INITIAL = {"xsa": 0.0, "out_gate": 0.25, "x0": 0.0, "bigram": 0.05, "skip": 0.5,
                     "dc_w1": 1.0, "dc_w2": 0.0}


def mudd_gate_initial_values(plan: Sequence[LayerPlan], H: int) -> list[list[float]]:
    """Per gate, each column's initial value (MUDD_GATE_INITIAL), in column order."""
    values = [[0.0] * w for w in mudd_gate_widths(plan, H)]
    for p in plan:
        g = values[p.gate]
        for col, kinds in ((p.xsa_col, ["xsa"] * H), (p.out_gate_col, ["out_gate"] * H),
                           (p.inject_col, ["x0", "bigram"]), (p.skip_col, ["skip"]),
                           (p.dc_col, ["dc_w1"] * H + ["dc_w2"] * H)):
            if col >= 0:
                g[col: col + len(kinds)] = [MUDD_GATE_INITIAL[k] for k in kinds]
    return values


def largest_micro_batch(hp: Hyperparameters) -> int:
    """Tokens of the largest training or validation micro-batch (what the rotary tables cover)."""
    return max(*(micro_batch_tokens(st.batch, hp.batch_slices) for st in hp.stages),
               micro_batch_tokens(hp.val_batch_size, hp.batch_slices))


def rms(x: Tensor) -> Tensor:
    """x / sqrt(mean(x^2) + tk.RMS_EPS) over the last dim, no gain; fp32 statistics, result in x's
    dtype."""
    return F.rms_norm(x, (x.shape[-1],), eps=tk.RMS_EPS)


def weighted_sum(*terms: tuple[Tensor, Tensor]) -> Tensor:
    """sum of scale * tensor over (0-d scale, tensor) pairs, in the accumulation dtype of the
    tensors' dtype, rounded once to it. The reference's whole-graph compile evaluates each residual
    update (rho*x + pi*a + chi*x0 + beta*Bg) in fp32 and rounds once when it stores x; eager bf16
    would round after every product and sum."""
    dtype = terms[0][1].dtype
    acc = tk.acc_dtype(dtype)
    total = None
    for scale, t in terms:
        term = scale.to(acc) * t.to(acc)
        total = term if total is None else total + term
    return total.to(dtype)


BIGRAM_HASH_CUR, BIGRAM_HASH_PREV = 36313, 27191   # multipliers of the current and previous id


def bigram_ids(inputs: Tensor, table_size: int) -> Tensor:
    """(T,) bigram-hash rows of the tokens `inputs` (T,) (upstream record 62, PR #201):
    b_t = floormod(int32(36313 x_t) XOR int32(27191 p_{t-1}), M), M = table_size - 1, with
    the sentinel M as b_0 and as p_0 (p_t = x_t for t >= 1), as records 80 and 84 compute them. The
    sentinel replacing x_0 as position 1's previous token looks accidental upstream but changes
    the numbers, so it is kept: b_1 depends on x_1 only, through a product that wraps. A BOS
    hashes with the previous document's last token, as upstream intends. int64 arithmetic
    emulates the int32 wrap on any device. Same dtype as inputs."""
    M = table_size - 1
    x = inputs.long()
    T = x.shape[0]
    sentinel = x.new_full((1,), M)
    prev = torch.cat([sentinel, x[1:]])[: max(T - 1, 0)]             # p_0 .. p_{T-2}

    def int32(v: Tensor) -> Tensor:   # two's complement wrap of an int64 into [-2^31, 2^31)
        return (v + 2**31) % 2**32 - 2**31

    h = torch.remainder(int32(BIGRAM_HASH_CUR * x[1:]) ^ int32(BIGRAM_HASH_PREV * prev), M)
    return torch.cat([sentinel[:T], h]).to(inputs.dtype)


def bigram_sign_index(inputs: Tensor, rows: int) -> Tensor:
    """(T,) rows of the sign table for the tokens `inputs` (T,): (x_{t-1} XOR x_t) mod rows, and
    row 0 at position 0 whatever the tokens (upstream record 83, PR #299). Ids are non-negative and
    rows a power of two, so this is the XOR's low bits. Same dtype as inputs."""
    x = inputs.long()
    return torch.cat([x[:1] * 0, torch.remainder(x[1:] ^ x[:-1], rows)]).to(inputs.dtype)


def remove_self_value(y: Tensor, v: Tensor, tau: Tensor) -> Tensor:
    """XSA (upstream record 82, PR #264; per token since record 85, PR #315; this algebraic form
    since record 86, PR #317): y - tau <y, v> / max(|v|^2, 1e-8) v per (token, head), v the value
    the attention read; y, v (T, H, hd), tau (T, H) in y's dtype. fp32 from the operands, rounded
    once (the compiled reference's one pointwise chain)."""
    acc = tk.acc_dtype(y.dtype)
    vf, yf = v.to(acc), y.to(acc)
    along = (yf * vf).sum(-1, keepdim=True) / (vf * vf).sum(-1, keepdim=True).clamp_min(
        XSA_NORM_SQ_FLOOR)                                                        # (T, H, 1)
    return (yf - tau.to(acc)[..., None] * along * vf).to(y.dtype)


def dc_weights(raw_w1: Tensor, w2: Tensor) -> tuple[Tensor, Tensor]:
    """The DC correction's per-(token, head) weights from their gate columns (T, H): w1 is the raw
    column over its rms across the heads (tk.dc_head_weights), w2 is used raw (upstream record
    85, PR #315)."""
    return tk.dc_head_weights(raw_w1), w2


def rotary_base_omega(head_dim: int, base: float, device: torch.device) -> Tensor:
    """(head_dim,) fp32 angular frequencies: [f0, f0, f1, f1, ..., 0 x head_dim/2],
    f_j = (1/base)^(j/(n-1)).

    Half-truncated RoPE (@YouJiacheng upstream): n = head_dim/4 frequencies on adjacent pairs of the
    first half; the second half is stationary.
    """
    n = head_dim // 4
    freqs = (1.0 / base) ** torch.linspace(0, 1, n, dtype=torch.float32, device=device)
    return torch.cat([freqs.repeat_interleave(2), freqs.new_zeros(head_dim // 2)])


def rotary_tables(omega: Tensor, num_positions: int,
                  dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor]:
    """(num_positions, head_dim/2) cos and sign-flipped sin of theta = p * omega (fp32) for the
    rotating half, in `dtype` (the model's: bf16).

    The odd columns of sin are negated so that the rotation is x*cos + pairswap(x)*sin
    (clockwise; tk.qk_norm_rotary_reference). The stationary half (omega = 0: cos 1, sin 0) is left
    out: the rotation passes it through unchanged.
    """
    half = omega.shape[0] // 2
    theta = torch.outer(torch.arange(num_positions, dtype=torch.float32, device=omega.device),
                        omega[:half])
    cos, sin = theta.cos().to(dtype), theta.sin().to(dtype)
    sin[:, 1::2] *= -1
    return cos, sin


# ---- FP8 LM head and the training loss -----------------------------------------------------------

def fp8_quantize(x: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
    """Saturating cast of x/scale to an FP8 dtype: overflow clamps to +-max, not NaN. The division
    is x * fp32(1/scale), which is what torch.compile on CUDA makes of a division by a constant;
    written so, the eager and compiled quantisers agree bit for bit."""
    limit = torch.finfo(dtype).max  # 448 for e4m3fn, 57344 for e5m2
    return (x.float() * (1.0 / scale)).clamp(-limit, limit).to(dtype)


def fp8_scale_product(a: float, b: float) -> float:
    """The fp32 product of two scales, as torch._scaled_mm forms scale_a * scale_b."""
    return float(torch.tensor(a, dtype=torch.float32) * torch.tensor(b, dtype=torch.float32))


def fp8_head_emulated(h: Tensor, w: Tensor, s_x: float,
                      s_w: float) -> tuple[Tensor, Tensor, Tensor]:
    """Plain-PyTorch FP8 LM head, torch.ops.nanogpt.fp8_head's contract with dequantised fp32
    matmuls (CPU path and GPU test reference): h (T, D) bf16, w (D, V) bf16 -> logits (T, V) bf16
    = (s_x*s_w) e4m3(h/s_x) @ e4m3(w/s_w), X8^T (D, T) (a view here), W8 (D, V)."""
    x8, w8 = (fp8_quantize(h, s_x, torch.float8_e4m3fn),
              fp8_quantize(w, s_w, torch.float8_e4m3fn))
    return (x8.float() @ w8.float() * fp8_scale_product(s_x, s_w)).bfloat16(), x8.t(), w8


def fp8_head_backward_emulated(g8: Tensor, g8_t: Tensor, x8_t: Tensor, w8: Tensor, s_x: float,
                               s_w: float, s_g: float) -> tuple[Tensor, Tensor]:
    """torch.ops.nanogpt.fp8_head_backward's contract with dequantised fp32 matmuls: dh (T, D) bf16
    = (s_g*s_w) G8 @ W8^T, dW (D, V) fp32 = (s_x*s_g) X8^T @ G8 (g8_t unused: one layout is
    enough here)."""
    g = g8.float()
    dh = (g @ w8.float().T * fp8_scale_product(s_g, s_w)).bfloat16()
    return dh, x8_t.float() @ g * fp8_scale_product(s_x, s_g)


# One compiled helper per role (distinct code objects, so each keeps its own small compile cache):
# each quantiser reads its input once and writes the FP8 tensor in both layouts torch._scaled_mm
# needs (K-major for both operands).
# The gradient is quantised inside the loss's kernel (tk.softcapped_mtp_ce_fp8), which writes both
# layouts too.
def _quantize_act(h: Tensor, s: float) -> tuple[Tensor, Tensor]:
    q = fp8_quantize(h, s, torch.float8_e4m3fn)
    return q, q.t().contiguous()


def _quantize_weight(w: Tensor, s: float) -> tuple[Tensor, Tensor]:
    q = fp8_quantize(w, s, torch.float8_e4m3fn)
    return q, q.t().contiguous()


_FP8_HELPERS: dict[str, Callable] = {}


def _fp8_helper(fn: Callable, x: Tensor) -> Callable:
    """fn compiled on first CUDA use (the ops' bodies are opaque to the model's compile, and eager
    would make several passes over the tensor); eager on other devices, where the ops only run in
    tests."""
    if not x.is_cuda:
        return fn
    if fn.__name__ not in _FP8_HELPERS:
        _FP8_HELPERS[fn.__name__] = torch.compile(fn, dynamic=False, fullgraph=True)
    return _FP8_HELPERS[fn.__name__]


def _fp8_head_forward_impl(h: Tensor, w: Tensor, s_x: float,
                           s_w: float) -> tuple[Tensor, Tensor, Tensor]:
    """logits (T, V) bf16 = (s_x*s_w) e4m3(h/s_x) @ e4m3(w/s_w), fast accumulation; also X8^T
    (D, T), W8 (D, V)."""
    x8, x8_t = _fp8_helper(_quantize_act, h)(h, s_x)
    w8, w8_t = _fp8_helper(_quantize_weight, w)(w, s_w)
    fp32_here = dict(dtype=torch.float32, device=h.device)
    logits = torch._scaled_mm(x8, w8_t.t(), scale_a=torch.full((), s_x, **fp32_here),
                              scale_b=torch.full((), s_w, **fp32_here),
                              out_dtype=torch.bfloat16, use_fast_accum=True)
    return logits, x8_t, w8


def _fp8_head_backward_impl(g8: Tensor, g8_t: Tensor, x8_t: Tensor, w8: Tensor, s_x: float,
                            s_w: float, s_g: float) -> tuple[Tensor, Tensor]:
    """dh (T, D) bf16 = (s_g*s_w) G8 @ W8^T; dW (D, V) fp32 = (s_x*s_g) X8^T @ G8, from
    G8 (T, V) e5m2 and its transpose G8^T (V, T); no fast accumulation."""
    fp32_here = dict(dtype=torch.float32, device=g8.device)
    sx, sw, sg = (torch.full((), s, **fp32_here) for s in (s_x, s_w, s_g))
    dh = torch._scaled_mm(g8, w8.t(), scale_a=sg, scale_b=sw, out_dtype=torch.bfloat16,
                          use_fast_accum=False)
    dw = torch._scaled_mm(x8_t, g8_t.t(), scale_a=sx, scale_b=sg, out_dtype=torch.float32,
                          use_fast_accum=False)
    return dh, dw


def register_fp8_head_op() -> None:
    """Register torch.ops.nanogpt.fp8_head and fp8_head_backward once per process; later calls (or a
    second copy of this module, e.g. __main__ and train_gpt) reuse the registered ops. They are
    opaque to torch.compile and have no autograd of their own: FP8HeadMTPCE calls them."""
    if hasattr(torch.ops.nanogpt, "fp8_head"):
        return
    fwd = torch.library.custom_op("nanogpt::fp8_head", mutates_args=())(_fp8_head_forward_impl)
    bwd = torch.library.custom_op("nanogpt::fp8_head_backward",
                                  mutates_args=())(_fp8_head_backward_impl)

    @fwd.register_fake
    def _(h, w, s_x, s_w):
        T, D, V = h.shape[0], h.shape[1], w.shape[1]
        return (h.new_empty(T, V), h.new_empty(D, T, dtype=torch.float8_e4m3fn),
                w.new_empty(D, V, dtype=torch.float8_e4m3fn))

    @bwd.register_fake
    def _(g8, g8_t, x8_t, w8, s_x, s_w, s_g):
        return (g8.new_empty(g8.shape[0], x8_t.shape[0], dtype=torch.bfloat16),
                w8.new_empty(w8.shape, dtype=torch.float32))


class FP8HeadMTPCE(torch.autograd.Function):
    """The training head and loss as one op: h (T, D) bf16, w (D, V) bf16 -> per-row
    MTP losses (T,) fp32. FP8 head: @YouJiacheng, upstream record 19; fused loss: @soren_dunn_ and
    Locus, record 60; the gradient in the forward, record 79 (PR #251); s_g scaled by grad_scale,
    record 65.

    Forward: the FP8 logits (fused_head: torch.ops.nanogpt.fp8_head, else fp8_head_emulated), then
    the loss and its logit gradient already quantised, G8 = e5m2(g) in both layouts the backward's
    FP8 matmuls read (fused_ce: tk.softcapped_mtp_ce_fp8's kernels, else its reference;
    rows: the reference's row blocks). The logits are not kept: the backward needs only G8, the
    same bytes as the bf16 logits the unfused head would save. The e5m2 payload of g is the same for
    every grad_scale (s_g = grad_scale * s_g_w8 carries the 1/grad_accum), so results do not
    depend on the world size.
    Backward: dh = (s_g*s_w) G8 @ W8^T bf16, dW = (s_x*s_g) X8^T @ G8 fp32 (autograd casts it to
    the bf16 parameter). CONTRACT (the record's): the gradient returned is that of
    grad_scale * sum(losses); the incoming gradient is not read, so the caller must back-propagate
    exactly grad_scale * losses.sum() (the trainer's (loss / grad_accum).backward() with
    grad_scale = 1/grad_accum). Checked where that is free (checks.check_loss_gradient: CPU tensors
    outside a compile); on a GPU the check would cost a device sync per micro-step, and scaling G8
    by an incoming gradient would need it before quantising, i.e. a backward pass over the logits.
    """

    @staticmethod
    def forward(ctx, h: Tensor, w: Tensor, targets: Tensor, mtp_weights: Tensor, grad_scale: float,
                s_x: float, s_w: float, s_g_w8: float, fused_head: bool, fused_ce: bool,
                rows: int | None, prefix_targets: Tensor | None,
                prefix_weight: Tensor | None) -> Tensor:
        s_g = grad_scale * s_g_w8
        head = torch.ops.nanogpt.fp8_head if fused_head else fp8_head_emulated
        logits, x8_t, w8 = head(h, w, s_x, s_w)
        if fused_ce:
            losses, g8, g8_t = torch.ops.nanogpt_kernels.softcapped_mtp_ce_fp8(
                logits, targets, mtp_weights, grad_scale, s_g, prefix_targets, prefix_weight)
        else:
            losses, g8, g8_t = tk.softcapped_mtp_ce_fp8_reference(
                logits, targets, mtp_weights, grad_scale, s_g, rows, prefix_targets, prefix_weight)
        ctx.save_for_backward(g8, g8_t, x8_t, w8)
        ctx.args = (grad_scale, s_x, s_w, s_g, fused_head)
        return losses

    @staticmethod
    def backward(ctx, grad_losses: Tensor):
        g8, g8_t, x8_t, w8 = ctx.saved_tensors
        grad_scale, s_x, s_w, s_g, fused_head = ctx.args
        if grad_losses.device.type == "cpu" and not torch.compiler.is_compiling():
            checks.check_loss_gradient(grad_losses, grad_scale)
        head_backward = (torch.ops.nanogpt.fp8_head_backward if fused_head
                         else fp8_head_backward_emulated)
        dh, dw = head_backward(g8, g8_t, x8_t, w8, s_x, s_w, s_g)
        return dh, dw, *(None,) * 11  # dw is fp32; autograd casts it to the bf16 parameter's dtype


def fp8_head_mtp_ce(h: Tensor, w: Tensor, targets: Tensor, mtp_weights: Tensor,
                    grad_scale: float, s_x: float, s_w: float, s_g: float,
                    prefix_targets: Tensor | None = None, prefix_weight: Tensor | None = None, *,
                    fused_head: bool, fused_ce: bool, rows: int | None) -> Tensor:
    """Per-row training losses (T,) fp32 of the FP8 head h @ w (FP8HeadMTPCE; s_g: the gradient
    scale at grad_scale 1; prefix: the loss kernels' prefix term). kernel_ops binds the keywords."""
    return FP8HeadMTPCE.apply(h, w, targets, mtp_weights, grad_scale, s_x, s_w, s_g, fused_head,
                              fused_ce, rows, prefix_targets, prefix_weight)


# ---- GPT -----------------------------------------------------------------------------------------

class GPT(nn.Module):
    """The record's GPT: its parameters in labelled tensors (the banks and the tables), its layer
    wiring from the model options of Hyperparameters (hp).

    Rotary state (omega, bf16 tables, attn_scale) is one object shared by normal and paired layers:
    the record's two rotary objects always receive the same resets and YaRN updates, so they always
    hold the same values. The tables cover 2 * rotary_max_len angle positions: normal layers read
    rows [0, T), paired layers read rows 2t and 2t+1 for token t, i.e. rows [0, 2T) viewed as
    (T, 2, head_dim/2).
    ops: the run's kernel or reference per op (kernel_ops); attn_backend: a resolved backend name
    (varlen_attention). rotary_max_len (the positions the rotary tables cover) and bank_multiple
    (the banks hold a multiple of this many matrices, padded with unused ones, to shard evenly over
    any world size dividing it) are derived from hp unless given (tests build small tables).
    """

    def __init__(self, hp: Hyperparameters, device: torch.device, ops: KernelOps,
                 attn_backend: str = "sdpa", rotary_max_len: int | None = None,
                 bank_multiple: int | None = None):
        super().__init__()
        self.rotary_max_len = rotary_max_len or largest_micro_batch(hp)
        self.bank_multiple = bank_multiple or math.lcm(RECORD_BANK_MULTIPLE, hp.batch_slices)
        checks.check_model_layout(hp, GATE_INPUT_DIM)
        self.hp, self.ops, self.attn_backend = hp, ops, attn_backend
        D, H, L, hd, V = hp.model_dim, hp.num_heads, hp.num_layers, hp.head_dim, hp.vocab_size
        self.plan = layer_plan(hp)
        n_attn = sum(p.attn != "" for p in self.plan)
        n_ve = sum(p.ve_slot >= 0 for p in self.plan)

        def param(t: Tensor) -> nn.Parameter:
            return nn.Parameter(t)

        # Banks (upstream record 80, PR #253): qk holds one (2*hd, D) matrix per (attention layer
        # l, Q or K, adjacent head pair j): Q rows of heads 2j, 2j+1 at H*l + j, K rows at
        # H*l + H/2 + j, so that the optimizer orthogonalises each pair on its own; vo holds W_v at
        # 2l and W_o at 2l + 1; mlp slice j = [c_fc, c_proj] (2, hidden, D) of layer j. Unused pad
        # matrices at the end make each bank shard evenly (self.bank_multiple) and stay zero; the
        # random draws fill only the real matrices (the mlp pad's c_fc as far as the record's
        # 8-GPU padding, which it draws), so every initial weight is the same on any world size.
        # Draw order as the record's kept draws (it matters only when seeded): lm_head,
        # value_embeds, qk, vo, mlp, the bigram signs, mudd_w1, mudd_gate_w1 (the record also draws
        # values it overwrites, which are not drawn here).
        # Built in fp32 on `device`, then cast to bf16. With --dtype=float32/float64 the bf16
        # tensors are that dtype instead and the fp32 ones at least fp32.
        weight_dtype = getattr(torch, hp.dtype)
        like_weights = dict(dtype=weight_dtype, device=device)
        like_scalars = dict(dtype=tk.acc_dtype(weight_dtype), device=device)
        # drawn into bf16
        lm_head = torch.empty(D, V, dtype=torch.bfloat16, device=device).normal_(0.0, 0.005)
        # bf16(0.01 n), n drawn in bf16 (upstream record 65, PR #215): random, untied tables
        value_embeds = 0.01 * torch.randn(hp.num_value_embeds * V, D, dtype=torch.bfloat16,
                                          device=device)
        bound = 0.5 * math.sqrt(3) * D ** -0.5      # Q, K, V, O all U(+-bound) (upstream record
                                                    # 64, PR #214), as c_fc
        n_qk = H * n_attn
        qk = torch.zeros(n_qk + bank_padding(n_qk, 1, self.bank_multiple), 2 * hd, D,
                         device=device)
        qk[:n_qk].uniform_(-bound, bound)
        vo = torch.zeros(2 * n_attn + bank_padding(2 * n_attn, 1, self.bank_multiple), D, D,
                         device=device)
        vo[: 2 * n_attn].uniform_(-bound, bound)
        mlp = torch.zeros(L + bank_padding(L, 2, self.bank_multiple), 2, hp.mlp_hidden, D,
                          device=device)
        drawn = L + bank_padding(L, 2, RECORD_BANK_MULTIPLE)
        mlp[:drawn, 0].uniform_(-bound, bound)                       # c_fc; c_proj stays zero
        # +-1 from the signs of normals (sign(0) = 0 has probability 0; it counts as +1 here)
        signs = torch.randn(hp.bigram_sign_rows, D, device=device)
        signs = torch.where(signs < 0, -1.0, 1.0)
        # MUDD's first layers: PyTorch's default Linear init, U(+-1/sqrt(fan_in))
        mudd_w1 = torch.empty(2, hp.mudd_hidden, D, device=device)
        for block in mudd_w1:
            block.uniform_(-D ** -0.5, D ** -0.5)
        mudd_b2 = torch.zeros(2, len(MUDD_LAYER_COEFFS))
        for j, name in enumerate(MUDD_LAYER_COEFFS):
            mudd_b2[0, j] = MUDD_INITIAL.get(name, 0.0) / hp.mudd_scale
        for j, name in enumerate(MUDD_MIX_COEFFS):
            mudd_b2[1, j] = MUDD_MIX_INITIAL.get(name, 0.0) / hp.mudd_scale
        # the per-token gates (record 85, PR #315): the same init as MUDD's, biases from the
        # columns' initial values (mudd_gate_initial_values), one row per gate padded to the wider
        self.gate_widths = mudd_gate_widths(self.plan, H)
        mudd_gate_w1 = torch.empty(2, hp.mudd_gate_hidden, D, device=device)
        for block in mudd_gate_w1:
            block.uniform_(-D ** -0.5, D ** -0.5)
        mudd_gate_b2 = torch.zeros(2, max(self.gate_widths))
        for g, values in enumerate(mudd_gate_initial_values(self.plan, H)):
            mudd_gate_b2[g, : len(values)] = torch.tensor(values) / hp.mudd_gate_scale
        scalars = torch.cat([
            torch.tensor([0.5, 1.0]).repeat(L),                      # SA lambdas (qkv, o) per layer
            torch.tensor([0.0, -1.5]),                               # smear, skip lambdas
        ]).to(**like_scalars)
        self.qk = param(qk.to(weight_dtype))
        self.vo = param(vo.to(weight_dtype))
        self.mlp = param(mlp.to(weight_dtype))
        self.scalars = param(scalars)  # (2L+2,) fp32
        self.smear_gate = param(torch.zeros(1, GATE_INPUT_DIM, **like_weights))
        self.ve_gate_bank = param(torch.zeros(n_ve, H, GATE_INPUT_DIM, **like_weights))
        lm_head = lm_head.to(weight_dtype)
        self.lm_head = param(lm_head)                                # (D, V): stored transposed,
                                                                     # logits = h @ lm_head
        # bigram-hash embedding (upstream record 62, PR #201), zero at the start; model_dim wide
        # since record 85 (PR #315)
        self.bigram_embed = param(torch.zeros(hp.bigram_vocab_size, D, **like_weights))
        # per-sublayer residual weights, [:, 0] attention, [:, 1] MLP (upstream record 77, PR #241)
        self.post_lambdas = param(torch.ones(L, 2, **like_scalars))
        self.resid_lambdas = param(torch.full((L, 2), math.sqrt(1.1), **like_scalars))
        self.value_embeds = param(value_embeds.to(weight_dtype))              # table j: rows [j*V, (j+1)*V)
        self.embed = param(lm_head.T.contiguous())                   # tied copy until the
                                                                     # optimizer splits them
        # MUDD blocks 0 and 1 (MUDD_LAYER_COEFFS, MUDD_MIX_COEFFS); block 1 uses the first
        # len(MUDD_MIX_COEFFS) rows of w2 and b2
        self.mudd_w1 = param(mudd_w1.to(weight_dtype))               # (2, hidden, D)
        self.mudd_w2 = param(torch.zeros(2, len(MUDD_LAYER_COEFFS), hp.mudd_hidden,
                                         **like_weights))
        self.mudd_b2 = param(mudd_b2.to(**like_weights))
        # the gates: [0] pre (reads x0), [1] post (reads the skip source's output); the pre gate
        # uses the first gate_widths[0] rows of w2 and b2
        self.mudd_gate_w1 = param(mudd_gate_w1.to(weight_dtype))     # (2, gate hidden, D)
        self.mudd_gate_w2 = param(torch.zeros(2, max(self.gate_widths), hp.mudd_gate_hidden,
                                              **like_weights))
        self.mudd_gate_b2 = param(mudd_gate_b2.to(**like_weights))
        self.mudd_gate_scale = param(torch.tensor(hp.mudd_gate_scale, **like_scalars))  # 0-d
        # the fixed signs: state (saved and broadcast with the weights), never trained
        self.register_buffer("bigram_signs", signs.to(weight_dtype))

        # the first row of each value-embedding table a layer reads, in table order (the forward's
        # one lookup of all of them)
        self.ve_tables = tuple(sorted({p.ve_table for p in self.plan if p.ve_table >= 0}))
        self.register_buffer("ve_row_offsets", torch.tensor([j * V for j in self.ve_tables],
                                                            dtype=torch.int32, device=device),
                             persistent=False)
        # each target's prefix-token target (-1: none; record 88), the prefix table's first V
        # entries: a constant of the tokeniser, filled by load_prefix_table, so not state
        self.register_buffer("prefix_table", torch.full((V,), -1, dtype=torch.int64, device=device),
                             persistent=False)
        self.register_buffer("rotary_omega", torch.zeros(hd, device=device), persistent=False)
        self.register_buffer("rotary_cos", torch.empty(2 * self.rotary_max_len, hd // 2, **like_weights),
                             persistent=False)
        self.register_buffer("rotary_sin", torch.empty(2 * self.rotary_max_len, hd // 2, **like_weights),
                             persistent=False)
        self.attn_scale = hp.attn_scale
        self.reset_rotary()
        # the FP8 down projection's delayed scales (record 89): a chain of activation scales per
        # batch slice and layer, weight scales per bank slot; state, saved with the weights
        self.fp8_down = (tk.Fp8DownState(hp.batch_slices, L, self.mlp.shape[0], device)
                         if hp.fp8_mlp else None)
        self.refresh_fp8_down(None)
        if hp.use_fp8:
            register_fp8_head_op()
        if self.attn_backend == "fa4":
            checks.import_fa4()

    @property
    def bank_matrix_shapes(self) -> dict[str, tuple[int, int]]:
        """The matrices the optimizer orthogonalises: qk's head-pair groups (2*hd, D), vo's W_v, W_o
        (D, D); mlp's c_fc, c_proj (hidden, D)."""
        hp = self.hp
        return {"qk": (2 * hp.head_dim, hp.model_dim), "vo": (hp.model_dim, hp.model_dim),
                "mlp": (hp.mlp_hidden, hp.model_dim)}

    # ---- rotary state ----

    @torch.no_grad()
    @torch.no_grad()
    def refresh_fp8_down(self, step: int | None) -> None:
        """The FP8 down weights and their scales from the current c_proj bank: after optimizer
        step `step`, or at init, after a warmup step and after the reset (None): bootstrapping
        there and for the first tk.FP8_DOWN_BOOTSTRAP_STEPS steps (tk.fp8_down_bootstraps)."""
        if self.fp8_down is not None:
            self.fp8_down.refresh_weights(self.mlp[:, 1].contiguous(), tk.fp8_down_bootstraps(step),
                                          self.ops.fp8_down_fused)

    @torch.no_grad()
    def rebuild_fp8_down(self) -> None:
        """The FP8 down weights of the loaded c_proj bank and scales (after load_state_dict)."""
        if self.fp8_down is not None:
            self.fp8_down.rebuild_weights8(self.mlp[:, 1].contiguous(), self.ops.fp8_down_fused)

    def reset_rotary(self) -> None:
        """Base frequencies, rebuilt tables, attn_scale back to its initial value (at construction
        and after warmup)."""
        self.rotary_omega.copy_(rotary_base_omega(self.hp.head_dim, self.hp.rope_base,
                                                  self.rotary_omega.device))
        self._rebuild_rotary_tables()
        self.attn_scale = self.hp.attn_scale

    @torch.no_grad()
    def apply_yarn(self, old_ws_long: int, new_ws_long: int) -> None:
        """YaRN (@classiclarryd, upstream record 31) for a long window going old -> new (blocks):
        frequencies turning fewer than alpha times over the old window are scaled by old/new, those
        turning beta+ times are kept, a linear ramp between; compounds."""
        hp, omega = self.hp, self.rotary_omega
        ratio = old_ws_long / new_ws_long
        turns = (hp.block_size * old_ws_long) * omega / (2 * math.pi)
        ramp = ((turns - hp.yarn_alpha) / (hp.yarn_beta - hp.yarn_alpha)).clamp(0, 1)
        omega.mul_(ratio + ramp * (1 - ratio))
        self._rebuild_rotary_tables()
        self.attn_scale *= 1 + YARN_ATTN_SCALE_SLOPE * math.log(new_ws_long / old_ws_long)

    def _rebuild_rotary_tables(self) -> None:
        cos, sin = rotary_tables(self.rotary_omega, self.rotary_cos.shape[0], self.rotary_cos.dtype)
        self.rotary_cos.copy_(cos)  # in place: compiled graphs keep reading the same buffers
        self.rotary_sin.copy_(sin)

    # ---- forward ----

    def forward(self, inputs: Tensor, targets: Tensor, cu_seqlens: Tensor, ws_short: int,
                ws_long: int, mtp_weights: Tensor, max_seqlen: int,
                grad_scale: float = 1.0, prefix_weight: Tensor | None = None,
                act_scales: Tensor | None = None) -> Tensor:
        """inputs (T,) int32, targets (T,) int64. Training: the summed MTP loss (fp32 scalar), whose
        backward the caller runs on grad_scale * loss (the FP8 head's gradient is formed for exactly
        that, FP8HeadMTPCE), plus each row's prefix-token term of weight prefix_weight ((1,) fp32;
        None: no term); eval: mean CE. act_scales: this batch slice's row of the FP8 down
        projection's activation scales (L,), which the training forward advances (None: slice 0's)."""
        h = self.final_hidden(inputs, cu_seqlens, ws_short, ws_long, max_seqlen,
                              act_scales)  # (T, D) bf16
        if self.training:
            prefix = ({} if prefix_weight is None else   # tau_r of the immediate target y_r
                      dict(prefix_targets=self.prefix_table[targets], prefix_weight=prefix_weight))
            if self.hp.use_fp8:
                return self.ops.fp8_head_mtp_ce(h, self.lm_head, targets, mtp_weights, grad_scale,
                                                *self.hp.fp8_scales, **prefix).sum()
            return self.ops.mtp_ce_train(h @ self.lm_head, targets, mtp_weights, **prefix).sum()
        # Mean next-token CE of the softcapped bf16-head logits, through the fused kernel with the
        # single weight 1: it softcaps in fp32 (as the reference's compiled eval does) and never
        # materialises fp32 (T, V) tensors, which at 262,144 val tokens per rank would not fit next
        # to the 26 GB of bf16 logits.
        next_token_only = torch.ones(1, dtype=torch.float32, device=h.device)
        return self.ops.mtp_ce(h @ self.lm_head, targets, next_token_only).mean()

    @torch.no_grad()
    def logits(self, inputs: Tensor, cu_seqlens: Tensor, ws_short: int, ws_long: int,
               max_seqlen: int) -> Tensor:
        """(T, V) fp32 softcapped scores of the next token at every position (what the loss scores;
        for sampling)."""
        return tk.softcap(self.final_hidden(inputs, cu_seqlens, ws_short, ws_long, max_seqlen)
                          @ self.lm_head)

    def final_hidden(self, inputs: Tensor, cu_seqlens: Tensor, ws_short: int, ws_long: int,
                     max_seqlen: int, act_scales: Tensor | None = None) -> Tensor:
        """The normed final residual h (T, D) bf16 that the LM head reads; in training with the
        FP8 down projection it advances act_scales (forward)."""
        hp, T = self.hp, inputs.shape[0]
        if T > self.rotary_max_len:
            raise ValueError(f"micro-batch of {T} tokens exceeds "
                             f"rotary_max_len={self.rotary_max_len}; build the model with "
                             "rotary_max_len = the largest train/val micro-batch")
        L, D, H, weight_dtype = hp.num_layers, hp.model_dim, hp.num_heads, self.embed.dtype
        sa_lambdas = self.scalars[: 2 * L].view(L, 2)
        smear_lambda, skip_lambda = self.scalars[2 * L: 2 * L + 2].unbind()
        # The per-sublayer weights are rounded to the weights' dtype (bf16) each forward, as the
        # record's are: rho = 1.046875 at the start, not sqrt(1.1).
        resid = self.resid_lambdas.to(weight_dtype)                                    # (L, 2)
        post = self.post_lambdas.to(weight_dtype)                                      # (L, 2)
        # value embeddings (@KoszarskyB, upstream record 14): table j at rows [j*V, (j+1)*V),
        # (T, D) bf16 each. One lookup of every table's row: its backward writes one dense
        # gradient of the whole parameter, where a lookup per table would write one each and sum
        # them (bench/tables.py).
        ve_rows = F.embedding(inputs[:, None] + self.ve_row_offsets, self.value_embeds)  # (T, n, D)
        ve = {table: ve_rows[:, k] for k, table in enumerate(self.ve_tables)}
        # The bigram row, signed by the sign table's row of the token pair (exact: a sign flip).
        bigram = (F.embedding(bigram_ids(inputs, hp.bigram_vocab_size), self.bigram_embed)
                  * self.bigram_signs[bigram_sign_index(inputs, hp.bigram_sign_rows)])  # (T, D)

        # Token smear (@classiclarryd, upstream record 34): e'_t = e_t + smear_lambda * sigmoid(e_t[:12] . w) * e_{t-1}, across
        # document boundaries.
        e = F.embedding(inputs, self.embed)  # (T, D) bf16
        # (T-1, 1) bf16
        smear = smear_lambda * torch.sigmoid(e[1:, :GATE_INPUT_DIM] @ self.smear_gate.T)
        x0 = rms(torch.cat([e[:1], e[1:] + smear * e[:-1]]))
        # The gates' outputs (T, width), per token: the pre gate's now, the post gate's after the
        # skip source. x0 stays itself (record 85): layer 0's bigram goes into the first
        # residual h0, which the MUDD layer and the mix after it read, not into the x0 injections.
        gates = [self.mudd_gate(0, x0), None]
        one = x0.new_ones(())
        h0 = weighted_sum((one, x0), (self.gate_column(gates, self.plan[0], "bigram"), bigram))
        x = h0

        # The banks as one view per matrix. Indexing the bank per layer instead costs a backward
        # kernel that reads every layer's gradient for every element of the bank; unbind's
        # backward stacks each matrix's gradient once. The same numbers either way.
        qk_banks = self.qk.unbind(0)                     # (2*hd, D) per head pair of Q or K
        vo_banks = self.vo.unbind(0)                     # W_v, W_o of attention layer l: 2l, 2l+1
        mlp_banks = self.mlp.flatten(0, 1).unbind(0)     # c_fc, c_proj of layer j at 2j, 2j + 1
        fp8 = self.training and hp.fp8_mlp               # FP8 up projection (upstream record 84)
        # and FP8 down projection (record 89): this slice's activation scales, the previous
        # training forward's maxima of post; each layer's maxima of post for the next one
        down = self.fp8_down if fp8 else None
        if down is not None and act_scales is None:
            act_scales = down.act_scales[0]
        post_amax = []
        streams = {"h0": h0}                             # what MUDD mixes
        cached_u = None
        for p in self.plan:
            i = p.index
            if p.skip_dest:  # U-net skip (@brendanh0gan, upstream record 11), gated per token
                skip_gate = torch.sigmoid(skip_lambda) * self.gate_column(gates, p, "skip").to(
                    tk.acc_dtype(weight_dtype))                                          # (T, 1)
                x = weighted_sum((one, x), (skip_gate, streams["skip"]))
            c = None
            if p.mudd:
                streams["last_in"] = x
                c = self.mudd_coefficients(0, x, MUDD_LAYER_COEFFS)
            if p.attn:
                # layers after cached_input_layer read its normed output (upstream record 77,
                # PR #241)
                u = cached_u if p.reads_cached else rms(x)
                l = p.attn_slot
                w_qkv = torch.cat([*qk_banks[H * l: H * (l + 1)], vo_banks[2 * l]])  # (3D, D)
                window = (ws_long if p.long_window else ws_short) * hp.block_size          # tokens
                a = self.attention(p, w_qkv, vo_banks[2 * l + 1], u,
                                   self.value_extra(p, u, ve.get(p.ve_table), c, streams),
                                   self.gate_column(gates, p, "xsa"),
                                   self.gate_column(gates, p, "out_gate"),
                                   self.gate_column(gates, p, "dc"), sa_lambdas[i], cu_seqlens,
                                   max_seqlen, window)
            if c is not None:
                # the last layer's residual weights are MUDD's, per token (T, 1)
                acc = tk.acc_dtype(weight_dtype)
                x = weighted_sum((1 + c["x_last_in"].to(acc), x), (c["x_h0"], h0),
                                 (c["x_cached"], streams["cached"]))
                x = weighted_sum((c["attn_resid"], x), (c["attn_post"], a), (c["attn_x0"], h0),
                                 (c["attn_bigram"], bigram))
                mlp_weights = (c["mlp_resid"], c["mlp_post"])
            else:
                if p.attn:
                    # x0 and the bigram embedding are injected with the attention output, gated
                    # per token (upstream records 62, 77, 85); layer 0's bigram is in h0 already
                    injections = [(self.gate_column(gates, p, "x0"), x0)] + (
                        [(self.gate_column(gates, p, "bigram"), bigram)] if i else [])
                    x = weighted_sum((resid[i, 0], x), (post[i, 0], a), *injections)
                mlp_weights = (resid[i, 1], post[i, 1])
            if down is None:
                mlp_out = self.ops.relu2_mlp(rms(x), mlp_banks[2 * i], mlp_banks[2 * i + 1], fp8)
            else:
                mlp_out, amax = self.ops.relu2_mlp_fp8_down(
                    rms(x), mlp_banks[2 * i], mlp_banks[2 * i + 1], act_scales[i: i + 1],
                    down.weight_scales[i: i + 1], down.weights8[i])
                post_amax.append(amax)
            x = weighted_sum((mlp_weights[0], x), (mlp_weights[1], mlp_out))
            if p.skip_source:
                streams["skip"] = x
                gates[1] = self.mudd_gate(1, x)
            if p.cached_input:
                streams["cached"] = x
                cached_u = rms(x)
        if down is not None:   # a <- 1.80 max(post) / 448 per layer, for this slice's next forward
            with torch.no_grad():
                act_scales.copy_(self.ops.fp8_act_scales(torch.stack(post_amax),
                                                         tk.FP8_DOWN_ACT_FACTOR))
        # MUDD block 1: earlier streams mixed into the last layer's output (at the start: minus
        # half the cached stream, record 80's backout)
        streams["ve"] = ve[self.ve_tables[0]]
        c = self.mudd_coefficients(1, x, MUDD_MIX_COEFFS)
        x = weighted_sum((x.new_ones(()), x), *((c[name], streams[name]) for name in MUDD_MIX_COEFFS))
        return rms(x)

    def mudd_gate(self, gate: int, z: Tensor) -> Tensor:
        """Gate `gate` (0 pre, 1 post; upstream record 85, PR #315) on z (T, D), not normed:
        bf16(s) * (W2 gelu(W1 z) + b), its gate_widths[gate] outputs (T, width) in z's dtype (bf16
        matmuls; bias and scale in fp32 from bf16 operands, rounded once)."""
        n, acc = self.gate_widths[gate], tk.acc_dtype(z.dtype)
        hidden = F.gelu(z @ self.mudd_gate_w1[gate].T)                             # (T, hidden)
        out = hidden @ self.mudd_gate_w2[gate, :n].T                               # (T, n)
        scale = self.mudd_gate_scale.to(z.dtype).to(acc)       # rounded as the weights are
        return ((out.to(acc) + self.mudd_gate_b2[gate, :n].to(acc)) * scale).to(z.dtype)

    def gate_column(self, gates: list, p: LayerPlan, kind: str) -> Any:
        """Layer p's gate values of one kind from the gates' outputs (mudd_gate_columns), per token:
        "x0", "bigram", "skip" (T, 1); "xsa" (T, H) as bf16(tanh(alpha)); "out_gate" (T, H) raw;
        "dc" the pair (w1, w2) (T, H) of dc_weights. None where the layer has none."""
        H = self.hp.num_heads
        col = {"x0": p.inject_col, "bigram": p.inject_col, "skip": p.skip_col, "xsa": p.xsa_col,
               "out_gate": p.out_gate_col, "dc": p.dc_col}[kind]
        if col < 0:
            return None
        g = gates[p.gate]
        if kind in ("x0", "skip"):
            return g[:, col: col + 1]
        if kind == "bigram":
            return g[:, col + 1: col + 2]
        if kind == "xsa":
            return torch.tanh(g[:, col: col + H])
        if kind == "out_gate":
            return g[:, col: col + H]
        return dc_weights(g[:, col: col + H], g[:, col + H: col + 2 * H])

    def mudd_coefficients(self, block: int, z: Tensor, names: Sequence[str]) -> dict[str, Tensor]:
        """MUDD block `block` on the raw residual z (T, D): mudd_scale * (W2 gelu(W1 z) + b), one
        (T, 1) column per name, in z's dtype (bf16 matmuls; bias and scale in fp32, rounded once)."""
        n, acc = len(names), tk.acc_dtype(z.dtype)
        hidden = F.gelu(z @ self.mudd_w1[block].T)                                 # (T, hidden)
        out = hidden @ self.mudd_w2[block, :n].T                                   # (T, n)
        coeffs = ((out.to(acc) + self.mudd_b2[block, :n].to(acc)) * self.hp.mudd_scale).to(z.dtype)
        return {name: coeffs[:, j: j + 1] for j, name in enumerate(names)}

    def value_extra(self, p: LayerPlan, u: Tensor, ve: Tensor | None,
                    c: dict[str, Tensor] | None, streams: dict[str, Tensor]) -> Tensor | None:
        """What a layer adds to its values (T, D), in the accumulation dtype: the gated value
        embedding, and on the MUDD layer its mix of earlier streams; None for nothing."""
        hp = self.hp
        T, H, hd = u.shape[0], hp.num_heads, hp.head_dim
        acc = tk.acc_dtype(u.dtype)
        if c is not None:
            # MUDD's gate, one per half of the heads, and its value mix (record 81)
            gate = torch.cat([c["ve_gate_lo"], c["ve_gate_hi"]], 1).repeat_interleave(H // 2, 1)
            mix = sum(c[f"v_{name}"].to(acc) * streams[name].to(acc)
                      for name in ("h0", "cached", "last_in"))                  # (T, D)
        elif ve is not None:
            # 2 sigmoid of half u, half the VE row (upstream record 70, PR #218; paired layers
            # too since record 81): elementwise per (token, head), so adding it before the paired
            # interleave equals adding it after
            half = GATE_INPUT_DIM // 2
            gate_in = torch.cat([u[:, :half], ve[:, :half]], -1)
            gate = 2 * torch.sigmoid(gate_in @ self.ve_gate_bank[p.ve_slot].T)        # (T, H)
            mix = 0
        else:
            return None
        return (gate.to(acc)[..., None] * ve.to(acc).view(T, H, hd)).view(T, hp.model_dim) + mix

    def attention(self, p: LayerPlan, w_qkv: Tensor, w_o: Tensor, u: Tensor,
                  v_extra: Tensor | None, xsa_tau: Tensor | None, out_gate: Tensor | None,
                  dc: tuple[Tensor, Tensor] | None, sa_lambda: Tensor, cu_seqlens: Tensor,
                  max_seqlen: int, window: int) -> Tensor:
        """One attention sublayer. w_qkv (3D, D) = [W_q; W_k; W_v], w_o (D, D); u: the normed input
        (T, D) bf16 -> (T, D) bf16. v_extra (T, D), fp32: added to the values (rounded once);
        then on the attention output, each where given: dc (w1, w2) (T, H), the DC correction;
        xsa_tau (T, H), XSA; out_gate (T, H), a per-token, per-head factor."""
        hp = self.hp
        T, D, H, hd = u.shape[0], hp.model_dim, hp.num_heads, hp.head_dim
        lambda_qkv, lambda_o = sa_lambda.unbind()
        qkv = u @ (lambda_qkv * w_qkv).T   # weights scaled and rounded to bf16 first
        # QK-norm per head, then half-truncated rotary on the first half of each head in adjacent
        # pairs, one pass over qkv (triton_kernels.py section 9). Normal layers rotate token t's
        # heads at angle position t. Paired heads (@classiclarryd, upstream record 58): heads 2b,
        # 2b+1 of token t rotate at angle positions 2t, 2t+1. Key offset layers take the
        # stationary half of k from the previous token (tk.shift_keys_by_one), in the same pass.
        q, k, v = self.ops.qk_norm_rotary(qkv, self.rotary_cos, self.rotary_sin,
                                          2 if p.attn == "P" else 1, p.key_offset)
        if v_extra is not None:
            v = (v.to(v_extra.dtype) + v_extra.view(T, H, hd)).to(v.dtype)
        if p.attn == "P":
            # Row-major reinterpretation as 2T positions of H/2 heads: position 2t slot g = head g
            # of token t, position 2t+1 slot g = head g + H/2. Lengths, offsets and the window are
            # in doubled positions.
            q2, k2, v2 = (t.reshape(2 * T, H // 2, hd) for t in (q, k, v))
            y = varlen_attention(q2, k2, v2, cu_seqlens * 2, max_seqlen * 2, window,
                                 self.attn_scale, self.attn_backend)
            y = y.reshape(T, H, hd)
        else:
            y = varlen_attention(q, k, v, cu_seqlens, max_seqlen, window,
                                 self.attn_scale, self.attn_backend)
        if dc is not None:   # the last layer's DC correction (record 85), its own local window
            y = self.ops.dc_correction(y, q, k, v, *dc, cu_seqlens, self.attn_scale, hp.dc_window)
        if xsa_tau is not None:
            y = remove_self_value(y, v, xsa_tau)
        if out_gate is not None:   # raw, unbounded (record 85; was a sigmoid gate on every layer)
            y = y * out_gate[..., None]
        return y.reshape(T, D) @ (lambda_o * w_o).T


# ==================================================================================================
# 3. The op table: each switchable op's fused kernel or its plain-PyTorch reference
# ==================================================================================================

# --kernels: the plain-PyTorch definitions each fused op's kernels were last checked against (the GPU
# tests, tests/test_kernels_gpu.py), with a digest of their code then: only the code the op's fused
# path does not run, so that an edit of one runs exactly when the reference does (kernel_ops).
# fp8_quantize is in none: both paths of the FP8 head run it (the fused head's compiled
# quantisers), and the loss's kernels and reference quantise the gradient themselves.
# After checking the kernel again, update the digest.
KERNEL_REFERENCES = {
    "qk": ((tk.qk_norm_rotary_reference, tk.shift_keys_by_one), "fae18133f82d6f5e"),
    "mlp": ((tk.relu2_mlp_post_reference, tk._Relu2MLPPostReference,
             tk.relu2_mlp_fp8_down_reference, tk._Relu2MLPFP8DownReference,
             tk.fp8_scales_from_partial_amax_reference), "0af3420a7de413dd"),
    "ce": ((tk.softcap, tk.softcapped_mtp_ce_reference, tk.softcapped_mtp_ce_train_math,
            tk._SoftcappedMTPCETrainReference, tk.softcapped_mtp_ce_fp8_reference),
           "26fe2830ae022c3f"),
    "fp8": ((fp8_head_emulated, fp8_head_backward_emulated), "c83cd459639d05d1"),
    "adam": ((tk.adam_update_reference,), "941fc473b01c2c49"),
    "normuon": ((tk.normuon_momentum_reference, tk.cautious_step,
                 tk.cautious_update_with_mantissa_reference), "2ddb60702546e03c"),
    "polar": ((tk.xxt_reference, tk.ba_plus_cAA_reference, tk.polar_split_product_reference),
              "72bf46270921669e"),
    "dc": ((tk.dc_correction_reference, tk.dc_mixed_probs, tk.dc_window_mask, tk._dc_windows),
           "0a2e81af64c6cbba"),
}
KERNEL_OPS = tuple(KERNEL_REFERENCES)     # the ops --kernels switches


@dataclass(frozen=True)
class KernelOps:
    """What runs each switchable op (KERNEL_OPS) this run: its fused kernel or its plain-PyTorch
    reference, of one contract (triton_kernels.py); chosen once by kernel_ops, passed to GPT and
    NorMuonAndAdam."""
    qk_norm_rotary: Callable        # qk: (qkv, cos, sin, pos_mult, key_offset) -> q, k, v
    relu2_mlp: Callable             # mlp: (x, c_fc, c_proj, fp8) -> (T, D), post-only (record 87)
    relu2_mlp_fp8_down: Callable    # mlp: (x, c_fc, c_proj, a, c, w8t) -> (T, D), amax (record 89)
    fp8_act_scales: Callable        # mlp: (partial amax (L, P), factor) -> (L,) fp32
    fp8_down_fused: bool            # mlp: Fp8DownState's weight refresh by the kernels
    mtp_ce: Callable                # ce: eval (logits, targets, mtp_weights) -> per-row losses
    mtp_ce_train: Callable          # ce: training without the FP8 head, same signature
    fp8_head_mtp_ce: Callable       # fp8 and ce: (h, w, targets, mtp_weights, grad_scale, s_x,
                                    # s_w, s_g) -> per-row training losses
    adam_update: Callable           # adam: in place, keyword scalars
    normuon_momentum: Callable      # normuon: (grad, momentum_buffer, momentum) -> U
    cautious_update: Callable       # normuon: (param, mantissa, O, lr=, wd=) in place
    xxt: Callable                   # polar: A -> A @ A.mT
    ba_plus_cAA: Callable           # polar: (A, b, c) -> b*A + c*A@A
    polar_split_product: Callable   # polar: (y, x, a) -> y = round(y + a*x) in place
    dc_correction: Callable         # dc: (y, q, k, v, w1, w2, cu_seqlens, scale, window) -> y'


def kernel_ops(kernels: str, device_type: str, edited: Collection[str] | None = None) -> KernelOps:
    """The run's op table: per op the kernel if checks.fused_ops names it, else the reference.
    edited: the ops whose reference was edited (default: checks.edited_references finds them)."""
    if edited is None:
        edited = checks.edited_references(KERNEL_REFERENCES)
    fused = checks.fused_ops(kernels, device_type, edited, KERNEL_OPS)

    def pick(op: str, kernel: Callable, reference: Callable) -> Callable:
        return kernel if op in fused else reference
    # A CPU computes the losses a block of rows at a time (the same numbers in bounded memory;
    # rows=0: blocks of tk._CE_REFERENCE_BLOCK logits); CUDA compiles the references whole.
    rows = None if device_type == "cuda" else 0
    mtp_ce = pick("ce", tk.softcapped_mtp_ce_triton, tk.softcapped_mtp_ce_reference
                  if device_type == "cuda" else tk.softcapped_mtp_ce_chunked)
    return KernelOps(
        qk_norm_rotary=pick("qk", tk.qk_norm_rotary_triton, tk.qk_norm_rotary_reference),
        relu2_mlp=pick("mlp", tk.relu2_mlp_post_triton, tk.relu2_mlp_post_reference),
        relu2_mlp_fp8_down=pick("mlp", tk.relu2_mlp_fp8_down_triton,
                                tk.relu2_mlp_fp8_down_reference),
        fp8_act_scales=pick("mlp", tk.fp8_scales_from_partial_amax_triton,
                            tk.fp8_scales_from_partial_amax_reference),
        fp8_down_fused="mlp" in fused, mtp_ce=mtp_ce,
        mtp_ce_train=pick("ce", tk.softcapped_mtp_ce_train_triton,
                          functools.partial(tk.softcapped_mtp_ce_train_reference, rows=rows)),
        fp8_head_mtp_ce=functools.partial(fp8_head_mtp_ce, fused_head="fp8" in fused,
                                          fused_ce="ce" in fused, rows=rows),
        adam_update=pick("adam", tk.adam_update, tk.adam_update_reference),
        normuon_momentum=pick("normuon", tk.normuon_momentum, tk.normuon_momentum_reference),
        cautious_update=pick("normuon", tk.cautious_update_with_mantissa,
                             tk.cautious_update_with_mantissa_reference),
        xxt=pick("polar", tk.xxt, tk.xxt_reference),
        ba_plus_cAA=pick("polar", tk.ba_plus_cAA, tk.ba_plus_cAA_reference),
        polar_split_product=pick("polar", tk.polar_split_product_,
                                 tk.polar_split_product_reference),
        dc_correction=pick("dc", tk.dc_correction_triton, tk.dc_correction_reference))


# ==================================================================================================
# 4. Optimizer: Polar Express, Adam and NorMuon updates, and NorMuonAndAdam
# ==================================================================================================
# Polar Express coefficients (a, b, c) for 5 iterations, designed with safety factor 2e-2 and
# cushion 2.
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# Matrices stored with more rows than this (the 3072x768 MLP ones) round a*X + B@X twice, like the
# record.
POLAR_EXPRESS_TWO_ROUNDINGS_ROWS = 1024
CPU_CHUNK_ELEMENTS = 1 << 16          # CPU only: element-wise updates run
                                      # in blocks this size (cache-resident)
NORMUON_EPS = 1e-10                    # floor of the second moment and of the renormalised norm


def _fp32(x: float) -> float:
    """Round a Python (double) float to the nearest fp32 value; optimizer scalars are computed in
    double, then this."""
    return float(np.float32(x))


def polar_express(G: Tensor, two_roundings: bool, ops: KernelOps,
                  dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Approximate U·Vᵀ of G = U·S·Vᵀ for a batch (..., R, C) of matrices, in bf16: Polar Express
    (Amsel, Persson, Musco, Gower 2025; in the speedrun @varunneal, upstream record 38).

    Five odd-polynomial iterations X <- a·X + (b·A + c·A²)·X with A = X·Xᵀ, on the short
    side (transposed when R > C, so A is the smaller Gram matrix). X is first scaled by its
    Frobenius norm (+2% safety) so every singular value lies in (0, 1), where the coefficients push
    it towards 1. two_roundings: round B@X to bf16 before adding a·X (two roundings, as the
    record does for the MLP matrices) instead of one fused GEMM with beta = a.
    dtype: the precision of the iteration; bf16 in training, float32/float64 for parameters stored
    in that (--dtype). ops: the Gram products and the split product (kernels or references).
    """
    shape = G.shape
    X = G.to(dtype).reshape(-1, shape[-2], shape[-1])       # (n, R, C)
    if shape[-2] > shape[-1]:
        X = X.mT                                            # (n, C, R): Gram matrices are C x C
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * (1 + 2e-2) + 1e-6)
    for a, b, c in POLAR_EXPRESS_COEFFS:
        A = ops.xxt(X)                                      # (n, m, m) bf16, exactly symmetric
        B = ops.ba_plus_cAA(A, b, c)                        # (n, m, m) bf16
        if two_roundings:
            X = ops.polar_split_product(B @ X, X, a)        # bf16(bf16(B@X) + a·X)
        else:
            X = torch.baddbmm(X, B, X, beta=a)              # bf16(a·X + B@X), fp32 accumulation
    if shape[-2] > shape[-1]:
        X = X.mT
    return X.reshape(shape)


def adam_update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *,
                beta1: float, beta2: float, eps: float, step_size: float | Tensor,
                decay: float | Tensor, ops: KernelOps) -> None:
    """One Adam update of a slice in place, all arithmetic in fp32.

    step_size = fp32(lr·sqrt(1-beta2^t)/(1-beta1^t)) and decay = fp32(lr²·wd) come from
    adam_scalars(). eps is not bias corrected. Cautious decay only where the update and the weight
    agree in sign (strict >). A bf16 param takes the round-to-nearest of the fp32 result
    (no master copy). The moments' dtype sets the precision: fp32, or float64 for a float64
    parameter (--dtype=float64). ops.adam_update: the fused Triton pass (floats only), bitwise its
    reference as PyTorch runs it on CUDA, or the reference.
    """
    if param.device.type == "cpu" and param.dim() > 0 and param.numel() > CPU_CHUNK_ELEMENTS:
        # Element-wise math, so row blocks give the same bits; each block's temporaries stay in the
        # CPU's cache.
        rows = max(1, CPU_CHUNK_ELEMENTS * param.shape[0] // param.numel())
        for p, g, m, v in zip(*(t.split(rows) for t in (param, grad, exp_avg, exp_avg_sq))):
            adam_update(p, g, m, v, beta1=beta1, beta2=beta2, eps=eps, step_size=step_size,
                        decay=decay, ops=ops)
        return
    ops.adam_update(param, grad, exp_avg, exp_avg_sq, beta1=beta1, beta2=beta2, eps=eps,
                    step_size=step_size, decay=decay)


def adam_scalars(lr: float, t: int, beta1: float, beta2: float, wd: float) -> tuple[float, float]:
    """(step_size, decay) for adam_update: computed in double, rounded to fp32. lr includes lr_mul;
    decay uses lr²."""
    step_size = _fp32(lr * (math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)))
    decay = _fp32(lr * lr * wd)
    return step_size, decay


def variance_normalize_(O: Tensor, second_moment: Tensor, beta2: float) -> Tensor:
    """NorMuon's low-rank second moment (@li_zichong, upstream record 41): O (n, R, C) bf16 -> O with each row (R >= C) or column
    scaled by 1/sqrt(running mean of its squares), then the matrix rescaled to its previous
    Frobenius norm.

    second_moment is fp32 (n, R, 1) when R >= C, else (n, 1, C); updated in place. An all-zero O
    stays zero. The statistics are computed in second_moment's dtype (float64 with --dtype=float64).
    """
    reduce_dim = -1 if O.size(-2) >= O.size(-1) else -2
    n_red = O.size(reduce_dim)
    # (n, R, 1) per-row mean square
    r = O.to(second_moment.dtype).square().mean(dim=reduce_dim, keepdim=True)
    norm = (n_red * r.sum(dim=(-2, -1), keepdim=True)).sqrt()     # (n, 1, 1) = ||O||_F
    second_moment.lerp_(r, 1 - beta2)
    d = second_moment.clamp_min(NORMUON_EPS).rsqrt()              # (n, R, 1)
    norm_scaled = (n_red * r * d.square()).sum(dim=(-2, -1), keepdim=True).sqrt()  # ||diag(d) O||_F
    scale = d * norm / norm_scaled.clamp_min(NORMUON_EPS)
    return O * scale.to(O.dtype)


def normuon_update(param: Tensor, grad: Tensor, momentum_buffer: Tensor, second_moment: Tensor,
                   mantissa: Tensor | None, *, momentum: float, beta2: float, lr: float | Tensor,
                   wd: float | Tensor, two_roundings: bool, ops: KernelOps) -> None:
    """One NorMuon update of a chunk of matrices in place: momentum, Polar Express and variance
    normalisation give the direction O, then the cautious step (@varunneal, upstream record 43) on
    the fp32 master P = (bf16 bits << 16) | mantissa (@classiclarryd, record 57).

    All tensors (n, R, C) except second_moment ((n, R, 1) or (n, 1, C)); grad bf16 (float32/64
    grads: all in their dtype), momentum_buffer fp32; both buffers are updated. lr (fp32 scalar or
    (n, 1, 1)) and wd come from normuon_scalars(). P <- (P - ((P·mask)·wd)·lr) - O·lr with
    mask = [O·P >= 0] (non-strict: entries with zero update are decayed too); the bf16 keeps the
    high 16 bits of the new master (truncation toward zero), the mantissa the low 16. mantissa is
    None for a float32/float64 parameter (--dtype), which is its own master. ops: the momentum
    step, Polar Express's products and the cautious step (kernels or references)."""
    # M <- lerp(M, G, 1 - mu); U = lerp(G, M, mu) (Nesterov-style), in grad's dtype
    U = ops.normuon_momentum(grad, momentum_buffer, momentum)
    O = polar_express(U, two_roundings, ops, dtype=grad.dtype)
    O = variance_normalize_(O, second_moment, beta2)
    if mantissa is None:
        param.copy_(tk.cautious_step(param, O, lr, wd))
    else:
        ops.cautious_update(param, mantissa, O, lr=lr, wd=wd)


def normuon_matrix_lr_scales(matrix_shape: Sequence[int], lr_mul: float,
                             matrix_lr_muls: Sequence[float],
                             global_indices: Sequence[int]) -> list[float]:
    """(shape_mult·lr_mul)·matrix_mult for each matrix (double); shape_mult = sqrt(max(1, R/C)) of
    the stored shape, matrix_mult cycles over the GLOBAL matrix index of the bank (c_fc, c_proj
    alternate in the MLP bank)."""
    R, C = matrix_shape
    shape_mult = math.sqrt(max(1.0, R / C))
    return [(shape_mult * lr_mul) * matrix_lr_muls[i % len(matrix_lr_muls)] for i in global_indices]


def normuon_scalars(muon_lr: float, lr_factor: float, wd: float,
                    wd_mul: float) -> tuple[float, float]:
    """(base lr = muon_lr·s in double, wd = fp32(wd_mul·wd·(muon_lr·s))): decay uses the
    UN-multiplied lr."""
    lr = muon_lr * lr_factor
    return lr, _fp32(wd_mul * wd * lr)


def update_order(table: dict[str, dict]) -> tuple[str, ...]:
    """The order of the updates: replicated Adam rows first (small, their all-reduces land first),
    then sharded Adam rows (their all-gathers start while the banks are still reducing), then
    NorMuon (the long Polar Express work hides every gather launched before it); the table's order
    within each group."""
    return tuple(sorted(table, key=lambda label: (table[label]["optim"] == "normuon",
                                                  table[label]["comms"] == "sharded")))


def reduce_scatter(out: Tensor, full: Tensor, **kw: Any) -> Any:
    """dist.reduce_scatter_tensor under the name torch 2.13 gives it (the old name warns there)."""
    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, full, **kw)


def all_gather(full: Tensor, part: Tensor, **kw: Any) -> Any:
    """dist.all_gather_into_tensor under the name torch 2.13 gives it (the old name warns there)."""
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(full, part, **kw)


class NorMuonAndAdam:
    """One optimizer for every parameter, configured per label by a table (@chrisjmccormick,
    upstream record 61; Muon: Keller Jordan).

    NorMuon (Polar Express + low-rank variance normalisation, fp32 master kept as bf16 + a 16-bit
    mantissa) updates the matrix banks every step; Adam updates everything else on odd steps only,
    on the sum of two steps' gradients.
    Communication per label is "replicated" (all-reduce the gradient, every rank updates the whole
    tensor), "sharded" (reduce-scatter along dim 0 of the tensor, or of the bank's matrix view for
    NorMuon, update this rank's slice, all-gather it back) or "none" (no communication at all).

    Comm ordering. A step launches every reduction up front, asynchronously, in the table's row
    order, then walks update_order(table): wait for a label's reduction, update its slice, launch
    its all-gather. The two orders differ because the collectives run one after another on a single
    comm stream while the updates run on the compute stream: the big NorMuon banks are reduced
    first, and their Polar Express work comes last, so the cheap Adam updates run (and their large
    embedding gathers start) while the bank reductions are still arriving, and the long Polar
    Express compute hides every gather launched before it; only the last bank's gather is exposed.
    These orders are performance choices (measured in the record), not math. Two orderings ARE
    correctness constraints while embed and lm_head are tied: (1) the gradient fold
    lm_head.grad += embed.gradᵀ happens before lm_head's reduction is launched (it is done right
    there, and embed itself is never reduced while tied); (2) the weight copy embed <- lm_headᵀ
    happens after lm_head's all-gather has completed (step() waits for it first).

    Use: after backward, step(do_adam=, lr_factor=, momentum=) (clears the gradients it consumed),
    and untie() right after the step at which embed and lm_head separate. rank and world_size only
    do the sharding arithmetic; the collectives use the default process group (none is needed when
    world_size is 1).
    """

    def __init__(self, named_params: dict[str, nn.Parameter], param_table: dict[str, dict], *,
                 adam_lr: float, adam_eps: float, adam_wd: float, muon_lr: float,
                 muon_beta2: float, muon_wd: float, rank: int, world_size: int,
                 ops: KernelOps, tied: tuple[str, str] | None = ("lm_head", "embed")):
        self.params = dict(named_params)
        self.table = {label: dict(row) for label, row in param_table.items()}
        self.scatter_order, self.work_order = tuple(self.table), update_order(self.table)
        self.adam_lr, self.adam_eps, self.adam_wd = adam_lr, adam_eps, adam_wd
        self.muon_lr, self.muon_beta2, self.muon_wd = muon_lr, muon_beta2, muon_wd
        self.rank, self.world_size = rank, world_size
        self.ops = ops                       # kernel or reference per op (kernel_ops)
        self.tied = tuple(tied) if tied is not None else None
        checks.check_param_table(self.params, self.table, rank, world_size, self.tied)
        self._tied_now = self.tied is not None
        self.adam_t = {label: 0 for label, row in self.table.items() if row["optim"] == "adam"}
        self.buffers: dict[str, dict[str, Tensor]] = {}
        self._lr_scales: dict[str, Tensor | float] = {}
        for label, p in self.params.items():
            row = self.table[label]
            local = self._local(label, p.detach())
            acc = tk.acc_dtype(p.dtype)     # fp32 state; float64 for a float64
                                            # parameter (--dtype=float64)
            if row["optim"] == "adam":
                self.buffers[label] = dict(exp_avg=torch.zeros_like(local, dtype=acc),
                                           exp_avg_sq=torch.zeros_like(local, dtype=acc))
                continue
            n, R, C = local.shape
            moment_shape = (n, R, 1) if R >= C else (n, 1, C)
            self.buffers[label] = dict(momentum=torch.zeros_like(local, dtype=acc),
                                       second_moment=torch.zeros(moment_shape, dtype=acc,
                                                                 device=p.device))
            if p.dtype == torch.bfloat16:   # the low 16 bits of the fp32 master
                                            # (wider dtypes are their own master)
                self.buffers[label]["mantissa"] = torch.zeros_like(local, dtype=torch.uint16)
            first = self.rank * n if self._is_sharded(label) else 0
            scales = normuon_matrix_lr_scales((R, C), row["lr_mul"],
                                              row.get("matrix_lr_muls", (1.0,)),
                                              range(first, first + n))
            # One scale for the whole chunk stays a Python float; mixed ones live on the device in
            # double, so the per-step lr = fp32(scale·(muon_lr·s)) is the same IEEE double product
            # as on the host, with no copy.
            self._lr_scales[label] = (scales[0] if len(set(scales)) == 1 else
                                      torch.tensor(scales, dtype=torch.float64,
                                                   device=p.device).view(n, 1, 1))

    # ---- layout helpers --------------------------------------------------------------------------
    def _is_sharded(self, label: str) -> bool:
        return self.table[label]["comms"] == "sharded" and self.world_size > 1

    def _is_replicated(self, label: str) -> bool:
        return self.table[label]["comms"] == "replicated" and self.world_size > 1

    def _bank_view(self, label: str, t: Tensor) -> Tensor:
        """NorMuon tensors as (n_matrices, R, C); Adam tensors unchanged."""
        row = self.table[label]
        return t.view(-1, *row["matrix_shape"]) if row["optim"] == "normuon" else t

    def _local(self, label: str, t: Tensor) -> Tensor:
        """This rank's slice along dim 0 of the bank view (the whole view unless sharded)."""
        t = self._bank_view(label, t)
        if not self._is_sharded(label):
            return t
        chunk = t.shape[0] // self.world_size
        return t[self.rank * chunk:(self.rank + 1) * chunk]

    def _steps_now(self, label: str) -> bool:
        return not (self._tied_now and label == self.tied[1])

    # ---- communication (overridable, e.g. to time the compute alone) -----------------------------
    def _launch_reduce(self, label: str, grad: Tensor):
        """Start averaging `grad` over ranks; returns (work or None, the tensor that will hold this
        rank's slice)."""
        if self._is_replicated(label):
            return (dist.all_reduce(grad, op=dist.ReduceOp.AVG, async_op=True),
                    self._bank_view(label, grad))
        if self._is_sharded(label):
            full = self._bank_view(label, grad)
            chunk = full.new_empty((full.shape[0] // self.world_size, *full.shape[1:]))
            return (reduce_scatter(chunk, full, op=dist.ReduceOp.AVG, async_op=True),
                    chunk)
        return None, self._bank_view(label, grad)

    def _launch_gather(self, label: str):
        """Start all-gathering this rank's updated slice into the full parameter (in place); None if
        not sharded."""
        if not self._is_sharded(label):
            return None
        full = self._bank_view(label, self.params[label].detach())
        return all_gather(full, self._local(label, full), async_op=True)

    # ---- the step --------------------------------------------------------------------------------
    @property
    def tied_now(self) -> bool:
        return self._tied_now

    @torch.no_grad()
    def step(self, *, do_adam: bool, lr_factor: float, momentum: float) -> None:
        """Reduce, update and gather every label due this step (NorMuon always, Adam when do_adam).

        lr_factor: the schedule's factor on every base lr; momentum: NorMuon's momentum for this
        step. Clears .grad of what it consumed; Adam gradients are kept on the other steps so the
        next backward adds to them.
        """
        due = [label for label in self.scatter_order
               if (do_adam or self.table[label]["optim"] == "normuon") and self._steps_now(label)]
        pending = {}
        for label in due:
            p = self.params[label]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if (self._tied_now and label == self.tied[0]
                    and self.params[self.tied[1]].grad is not None):
                # tied fold, before lm_head's reduction
                p.grad.add_(self.params[self.tied[1]].grad.mT)
            pending[label] = self._launch_reduce(label, p.grad)
        gathers = {}
        for label in self.work_order:
            if label not in pending:
                continue
            work, grad = pending.pop(label)
            if work is not None:
                work.wait()
            self._update(label, grad, lr_factor, momentum)
            gathers[label] = self._launch_gather(label)
        if self._tied_now and do_adam:
            head, embed = self.tied
            if gathers.get(head) is not None:
                gathers.pop(head).wait()
            self.params[embed].detach().copy_(self.params[head].detach().mT)
        for work in gathers.values():
            if work is not None:
                work.wait()
        for label, p in self.params.items():
            if do_adam or self.table[label]["optim"] == "normuon":
                p.grad = None

    def _update(self, label: str, grad: Tensor, lr_factor: float, momentum: float) -> None:
        row, buf = self.table[label], self.buffers[label]
        param = self._local(label, self.params[label].detach())
        if row["optim"] == "adam":
            self.adam_t[label] += 1
            beta1, beta2 = row["betas"]
            step_size, decay = adam_scalars(self.adam_lr * lr_factor * row["lr_mul"],
                                            self.adam_t[label], beta1, beta2,
                                            self.adam_wd * row["wd_mul"])
            adam_update(param, grad, buf["exp_avg"], buf["exp_avg_sq"], beta1=beta1, beta2=beta2,
                        eps=self.adam_eps, step_size=step_size, decay=decay, ops=self.ops)
            return
        lr, wd = normuon_scalars(self.muon_lr, lr_factor, self.muon_wd, row["wd_mul"])
        scale = self._lr_scales[label]
        lr_eff = _fp32(scale * lr) if isinstance(scale, float) else (scale * lr).float()
        # mu as an fp32 value, so both lerp weights, 1 - mu and mu, are exact fp32 numbers (upstream
        # record 74, PR #233)
        normuon_update(param, grad, buf["momentum"], buf["second_moment"], buf.get("mantissa"),
                       momentum=_fp32(momentum), beta2=self.muon_beta2, lr=lr_eff, wd=wd,
                       two_roundings=row["matrix_shape"][0] > POLAR_EXPRESS_TWO_ROUNDINGS_ROWS,
                       ops=self.ops)

    # ---- untying and state -----------------------------------------------------------------------
    @torch.no_grad()
    def untie(self) -> None:
        """Separate embed from lm_head after the split step: embed takes lm_head's Adam t, and its
        moments are lm_head's, gathered to the full (D, V), transposed to (V, D) and re-sliced to
        embed's shard."""
        if not self._tied_now:
            raise ValueError("untie() called twice: embed and lm_head are already separate")
        head, embed = self.tied
        self.adam_t[embed] = self.adam_t[head]
        for name in ("exp_avg", "exp_avg_sq"):
            src = self.buffers[head][name]                                         # (D/W or D, V)
            if self._is_sharded(head):
                full = src.new_empty((src.shape[0] * self.world_size, *src.shape[1:]))
                all_gather(full, src)
            else:
                full = src
            self.buffers[embed][name].copy_(self._local(embed, full.mT))          # (V/W or V, D)
        self._tied_now = False

    def state_dict(self) -> dict:
        """A snapshot (cloned tensors) of this rank's optimizer state: Adam t, every buffer, the
        tied flag."""
        return dict(tied_now=self._tied_now, rank=self.rank, world_size=self.world_size,
                    adam_t=dict(self.adam_t),
                    buffers={label: {name: t.clone() for name, t in buf.items()}
                             for label, buf in self.buffers.items()})

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        if (sd["rank"], sd["world_size"]) != (self.rank, self.world_size):
            raise ValueError(f"optimizer state was saved by rank {sd['rank']} of "
                             f"{sd['world_size']}, this is rank {self.rank} of {self.world_size}: "
                             "resume with the same --nproc_per_node")
        if set(sd["buffers"]) != set(self.buffers):
            raise ValueError(f"optimizer state labels {sorted(sd['buffers'])} differ from the "
                             f"table's {sorted(self.buffers)}: load it with the param_table it was "
                             "saved with")
        for label, buf in self.buffers.items():
            for name, t in buf.items():
                src = sd["buffers"][label][name]
                if src.shape != t.shape or src.dtype != t.dtype:
                    raise ValueError(f"optimizer state {label}.{name} is {tuple(src.shape)} "
                                     f"{src.dtype}, expected {tuple(t.shape)} {t.dtype}: load it "
                                     "with the model config it was saved with")
                t.copy_(src)
        self.adam_t = dict(sd["adam_t"])
        self._tied_now = bool(sd["tied_now"])


# ==================================================================================================
# 5. Data
# ==================================================================================================
# The data pipeline. Shards are FineWeb's GPT-2 token files, read and checked here. Training batches are BOS aligned (every
# segment starts at a document start and is at most the stage's max_doc_len long); validation batches are a
# plain cut of the val stream. Every rank builds the joint batch of all ranks and keeps its own
# part, so no communication is needed and the tokens of an optimizer step do not depend on the world
# size.

# Shards (their format: data/shards.py; their checks: checks.py) are read whole by a background
# thread, or at an offset for validation.


                            # lets go of the GIL between chunks


class Background:
    """fn() in a daemon thread. result() joins and returns its value or re-raises its exception in
    the caller."""

    def __init__(self, fn: Callable[[], Any]):
        self._value, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # noqa: BLE001 (handed to the consumer
                                    # by result() and raise_if_failed())
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


# ---- batches ------------------------------------------------------------------------------------

BOS_ID = 50256                          # GPT-2 <|endoftext|>; every FineWeb document starts with it
_QUICK_INDEX_TOKENS = 6_000_000         # a shard's first batches come from this prefix
                                        # while the rest loads (upstream record 65)

def micro_batch_tokens(global_batch: int, batch_slices: int) -> int:
    """Per-rank tokens per micro-step: the global batch cut into batch_slices, whatever the world
    size."""
    return global_batch // batch_slices


def max_num_docs(num_tokens: int, tokens_per_doc_bound: int) -> int:
    """Fixed length of cu_seqlens for a batch of num_tokens: floor(N / bound) rounded up to a
    multiple of 128, at least 128. A fixed length keeps the compiled attention shapes static."""
    return max(128, -(-(num_tokens // tokens_per_doc_bound) // 128) * 128)


class _ShardIndex:
    """A training shard's tokens (uint16) and its sorted BOS positions. For the quick index of a
    prefix (complete=False) the last document's end is unknown, so that document is left out of
    doc_lens."""

    def __init__(self, path: str, tokens: np.ndarray, complete: bool,
                 vocab_size: int | None = None):
        self.path, self.tokens, self.complete = path, tokens, complete
        if vocab_size is not None:
            checks.check_token_ids(tokens, vocab_size, path)
        checks.check_document_start(tokens, path, BOS_ID, prefix=not complete)
        self.bos = np.flatnonzero(tokens == BOS_ID)              # (num_docs,) int64
        doc_lens = np.diff(self.bos, append=len(tokens))         # (num_docs,)
        self.doc_lens = doc_lens if complete else doc_lens[:-1]  # (usable_docs,)
        self._cum_by_cap: dict[int, np.ndarray] = {}

    def cum_lens(self, cap: int) -> np.ndarray:
        """(usable_docs + 1,) int64; entry j = tokens in the first j documents when each is cut to
        `cap`."""
        if cap not in self._cum_by_cap:
            self._cum_by_cap[cap] = np.concatenate(([0], np.cumsum(np.minimum(self.doc_lens, cap))))
        return self._cum_by_cap[cap]


class _TrainShards:
    """The training shards in order. While one is in use, a background thread reads and indexes the
    next. A shard whose full index is not ready when it is reached (the first one always) starts
    from a quick index of its first _QUICK_INDEX_TOKENS tokens while a thread indexes all of it
    (upstream record 65); the quick document list is a prefix of the full one, and a batch the
    quick list cannot supply waits for the full one, so which index built a batch does not change
    the batch (upstream instead skips the rest of the shard there: a race it does not expect to
    hit)."""

    def __init__(self, files: list[str], vocab_size: int | None, first: int = 0):
        self.files, self.shard, self.vocab_size = files, first, vocab_size
        self.tokens_done = 0                       # tokens in the shards used up
                                                   # so far (for the error message)
        self._next = None
        self._start(first, None)

    def _start(self, k: int, full: Background | None) -> None:
        """Make shard k current: its full index if `full` (its background load) has finished, else
        the quick index of its first tokens while `full` (started now if None) finishes."""
        self.shard, self._full_current, self._next = k, None, None
        if full is not None and full.done():
            self.current = full.result()
        else:
            tokens, n = checks.read_tokens(self.files[k], _QUICK_INDEX_TOKENS)
            self.current = _ShardIndex(self.files[k], tokens, complete=len(tokens) == n,
                                       vocab_size=self.vocab_size)
            if not self.current.complete:
                self._full_current = full or Background(lambda: self._load(k))
                return
        self._prefetch()

    def _load(self, k: int) -> _ShardIndex:
        return _ShardIndex(self.files[k], checks.read_tokens(self.files[k])[0], complete=True,
                           vocab_size=self.vocab_size)

    def _prefetch(self) -> None:
        k = self.shard + 1
        self._next = Background(lambda: self._load(k)) if k < len(self.files) else None

    def _take_full_current(self) -> None:
        self.current, self._full_current = self._full_current.result(), None
        self._prefetch()

    def poll(self) -> None:
        """Re-raise a failure of a background load now; switch to the full index of the current
        shard once it is ready."""
        for task in (self._full_current, self._next):
            if task is not None:
                task.raise_if_failed()
        if self._full_current is not None and self._full_current.done():
            self._take_full_current()

    def extend(self) -> bool:
        """The current index cannot supply a batch. Returns False after waiting for the full index
        of a shard that was only partly indexed (keep the cursor), True after moving to the next
        shard (cursor back to 0)."""
        if self._full_current is not None:
            self._take_full_current()
            return False
        self.tokens_done += len(self.current.tokens)
        if self._next is None:
            raise DataError(
                f"training data ran out after reading all {len(self.files)} shards "
                f"({self.tokens_done:,} tokens) matched by --train_files (first: {self.files[0]}); "
                f"download more: python data/cached_fineweb10B.py {len(self.files) + 2} (or make "
                "more synthetic shards, or train fewer steps)")
        self._start(self.shard + 1, self._next)
        return True


def _plan_joint_batch(cum_lens: np.ndarray, cursor: int, tokens_per_rank: int,
                      world_size: int) -> list[int] | None:
    """Document cursors [c_0 = cursor, ..., c_W]: rank r takes documents c_r .. c_{r+1}-1;
    None if the shard runs out.
    The record's loader keeps adding capped documents while collected <= N, so a rank takes the
    fewest documents whose capped lengths sum past N (the last one is then cut to make exactly
    N + 1): one binary search per rank."""
    cursors = [cursor]
    for _ in range(world_size):
        end = int(np.searchsorted(cum_lens, cum_lens[cursors[-1]] + tokens_per_rank, side="right"))
        if end >= len(cum_lens):
            return None
        cursors.append(end)
    return cursors


def _to_device(array: np.ndarray, dtype: type, device: torch.device) -> Tensor:
    """Host array -> tensor of numpy `dtype` on `device`; numpy does the cast (torch's uint16 casts
    are slow). On CUDA the data goes through a fresh pinned buffer and a non-blocking copy (from
    pageable memory the driver would first wait for the stream, and the host with it); the caching
    host allocator does not reuse that buffer before the copy has run."""
    if device.type != "cuda":
        return torch.from_numpy(array.astype(dtype))
    host = torch.empty(array.shape, dtype=torch.from_numpy(np.empty(0, dtype)).dtype,
                       pin_memory=True)
    host.numpy()[...] = array
    return host.to(device, non_blocking=True)


@dataclass
class TrainPosition:
    """Where the training stream stands: the shard in use and its next unused document. The stream
    updates it after every batch; a checkpoint stores it, and a stream started from it continues
    with the same batches."""
    shard: int = 0
    cursor: int = 0
    over_upstream_capacity: int = 0    # micro-batches so far (all ranks) with more segments than
                                       # record 80's cu_seqlens holds (checks.py counts them)


def train_batches(files: list[str], global_batch: int, grad_accum: int, rank: int, world_size: int,
                  device: torch.device, max_doc_len: int, tokens_per_doc_bound: int,
                  vocab_size: int | None = None, position: TrainPosition | None = None,
                  ) -> Generator[tuple[Tensor, Tensor, Tensor], tuple[int, int, int] | None, None]:
    """BOS-aligned training micro-batches of `rank`. Each request yields
    (inputs int32 (N,), targets int64 (N,), cu_seqlens int32 (max_num_docs(N),)) on device,
    N = global_batch/(A*W).
    Documents are cut to max_doc_len tokens.
    With each request send None or (global_batch, max_doc_len, grad_accum); a triple applies to the
    batch it gets.
    The arguments are checked now; the first shard is read on the first request (inside the timed
    region, as in the record).
    With vocab_size, every shard's token ids are checked when it is loaded (in the loading thread,
    off the GPU's critical path): an id past the embedding fails with the shard and position instead
    of a device-side assert.
    The stream starts at `position` (default: the first document) and keeps it up to date."""
    if not files:
        raise DataError(f"no training shards given; {harness.DATA_HINT}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    position = position if position is not None else TrainPosition()
    if not 0 <= position.shard < len(files):
        raise DataError(f"the stream position is in shard {position.shard}, but --train_files "
                        f"matches {len(files)} shards: give the shards the run started with")
    checks.check_batch_split(global_batch, grad_accum, world_size)
    return _train_batch_stream(list(files), global_batch, grad_accum, rank, world_size, device,
                               max_doc_len, tokens_per_doc_bound, vocab_size, position)


def _train_batch_stream(files: list[str], global_batch: int, grad_accum: int, rank: int,
                        world_size: int, device: torch.device, max_doc_len: int,
                        tokens_per_doc_bound: int, vocab_size: int | None,
                        position: TrainPosition):
    tokens_per_rank = micro_batch_tokens(global_batch, grad_accum * world_size)
    shards = _TrainShards(files, vocab_size, first=position.shard)
    cursor = position.cursor                     # index of the next unused
                                                 # document of the current shard
    message = None
    while True:
        if message is not None:                  # applies to the batch answering it
            global_batch, max_doc_len, grad_accum = message
            checks.check_batch_split(global_batch, grad_accum, world_size)
            tokens_per_rank = micro_batch_tokens(global_batch, grad_accum * world_size)
        shards.poll()
        while (cursors := _plan_joint_batch(shards.current.cum_lens(max_doc_len), cursor,
                                            tokens_per_rank, world_size)) is None:
            if shards.extend():                  # abandon the partial batch; restart
                                                 # it from the next shard's start
                cursor = 0
        shard = shards.current
        first, end = cursors[rank], cursors[rank + 1]
        cursor = cursors[-1]                     # commit after all ranks are planned
        position.shard, position.cursor = shards.shard, cursor
        position.over_upstream_capacity += checks.over_upstream_capacity(tokens_per_rank,
                                                                         np.diff(cursors))
        # This rank's segments: documents first..end-1 cut to max_doc_len, the last one cut so that
        # the segments hold exactly N + 1 tokens (its final token is only a target).
        seg_lens = np.minimum(shard.doc_lens[first:end], max_doc_len)                    # (m,)
        seg_lens[-1] = tokens_per_rank + 1 - (seg_lens.sum() - seg_lens[-1])
        doc_capacity = max_num_docs(tokens_per_rank, tokens_per_doc_bound)
        checks.check_doc_capacity(len(seg_lens), tokens_per_rank, doc_capacity,
                                  tokens_per_doc_bound, "a training micro-batch",
                                  shard.doc_lens[first:end], max_doc_len)
        # (N+1,) uint16
        buf = np.concatenate([shard.tokens[s:s + n] for s, n in zip(shard.bos[first:end].tolist(),
                                                                     seg_lens.tolist())])
        # Boundaries [0, l1, l1+l2, ..., N] padded with N; the last segment lent its last token as
        # the final target.
        cu_seqlens = np.full(doc_capacity, tokens_per_rank, dtype=np.int32)
        cu_seqlens[0] = 0
        cu_seqlens[1:len(seg_lens)] = np.cumsum(seg_lens[:-1])
        message = yield (_to_device(buf[:-1], np.int32, device),
                         _to_device(buf[1:], np.int64, device),
                         _to_device(cu_seqlens, np.int32, device))


def val_batches(files: list[str], val_batch_size: int, val_tokens: int, grad_accum: int, rank: int,
                world_size: int, device: torch.device, tokens_per_doc_bound: int,
                vocab_size: int | None = None
                ) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """The validation forwards of `rank`: grad_accum * val_tokens / val_batch_size batches of
    (inputs int32 (N_val,), targets int64 (N_val,), cu_seqlens int32 (max_num_docs(N_val),)),
    N_val = val_batch_size / (A * W). Not BOS aligned: every call scores the same first val_tokens
    tokens of the val stream.
    The arguments and the shard sizes are checked now, so a shortage fails before the first
    forward."""
    if not files:
        raise DataError(f"no validation shards given; {harness.DATA_HINT}")
    if val_batch_size <= 0 or val_batch_size % (grad_accum * world_size) != 0:
        raise DataError(f"--val_batch_size={val_batch_size} does not divide into "
                        f"world_size * grad_accum = {world_size} * {grad_accum} forwards; "
                        "change --val_batch_size or --batch_slices")
    if val_tokens <= 0 or val_tokens % val_batch_size != 0:
        raise DataError(f"--val_tokens={val_tokens} is not a multiple of "
                        f"--val_batch_size={val_batch_size}; change one of them")
    tokens_per_rank = val_batch_size // (grad_accum * world_size)
    step_tokens = world_size * tokens_per_rank     # the global cursor advances
                                                   # this much per forward
    num_forwards = grad_accum * val_tokens // val_batch_size
    # Place every forward now from the shard sizes. As in the record, a forward moves to the start
    # of the next shard when pos + W*N_val + 1 >= shard length (so a forward ending exactly at the
    # shard end moves too); shards too short for one forward are skipped (the record would fail on
    # them).
    sizes = [checks.shard_num_tokens(path) for path in files]
    placements, shard, pos = [], 0, 0  # (shard index, cursor) per forward
    for _ in range(num_forwards):
        if pos + step_tokens + 1 >= sizes[shard]:
            shard, pos = shard + 1, 0
            while shard < len(files) and step_tokens + 1 > sizes[shard]:
                shard += 1
            if shard == len(files):
                raise DataError(
                    f"the val shards ({len(files)} files, {sum(sizes):,} tokens; first {files[0]}) "
                    f"cannot hold {num_forwards} forwards of {step_tokens:,} tokens: scoring "
                    f"--val_tokens={val_tokens:,} needs a shard of at least {val_tokens + 2:,} "
                    "tokens (each forward reads one look-ahead token, and one that does not fit "
                    "moves to the next shard). Lower --val_tokens (a multiple of "
                    f"--val_batch_size={val_batch_size:,}) or add val shards")
        placements.append((shard, pos))
        pos += step_tokens
    return _val_batch_stream(files, placements, tokens_per_rank, rank, device, tokens_per_doc_bound,
                             vocab_size)


def _val_batch_stream(files: list[str], placements: list[tuple[int, int]], tokens_per_rank: int,
                      rank: int, device: torch.device, tokens_per_doc_bound: int,
                      vocab_size: int | None):
    for shard, pos in placements:
        start = pos + rank * tokens_per_rank     # ranks overlap by one token: the look-ahead target
        with checks.open_shard(files[shard]) as f:
            f.seek(SHARD_HEADER_BYTES + 2 * start)
            buf = np.fromfile(f, dtype=np.uint16, count=tokens_per_rank + 1)   # (N_val+1,) uint16
        if len(buf) != tokens_per_rank + 1:
            raise DataError(f"val shard {files[shard]} shrank while being read; "
                            "download or generate it again")
        if vocab_size is not None:
            checks.check_token_ids(buf, vocab_size, files[shard], first=start)
        inputs = buf[:-1]
        bos = np.flatnonzero(inputs == BOS_ID)                                 # (m,) positions
        # [0, b_1, b_2, ...] padded with N_val: the partial document before b_1 is its own sequence
        # (empty if inputs[0] is a BOS), and val documents are not cut to a maximum length.
        doc_capacity = max_num_docs(tokens_per_rank, tokens_per_doc_bound)
        checks.check_doc_capacity(len(bos) + 1, tokens_per_rank, doc_capacity, tokens_per_doc_bound,
                                  "a validation forward")
        cu_seqlens = np.full(doc_capacity, tokens_per_rank,
                             dtype=np.int32)
        cu_seqlens[0] = 0
        cu_seqlens[1:len(bos) + 1] = bos
        yield (_to_device(inputs, np.int32, device), _to_device(buf[1:], np.int64, device),
               _to_device(cu_seqlens, np.int32, device))


# ==================================================================================================
# 6. Schedules: pure functions of the step
# ==================================================================================================

def stage_starts(num_scheduled: int, num_stages: int) -> list[int]:
    """The first step of each stage: 0, then round(num_scheduled * c) for c the running double sum
    1/n, 1/n + 1/n, ... (Python round; upstream record 65, PR #215): [0, 423, 847] for the record."""
    starts, c = [0], 0.0
    for _ in range(num_stages - 1):
        c += 1 / num_stages
        starts.append(round(num_scheduled * c))
    return starts


def stage_index(step: int, num_scheduled: int, num_stages: int) -> int:
    """The stage of `step`: the last one starting at or before it (steps past the schedule stay in
    the last stage)."""
    return bisect.bisect_right(stage_starts(num_scheduled, num_stages), step) - 1


def global_batch_size(step: int, num_scheduled: int, stages: Sequence[Stage]) -> int:
    return stages[stage_index(step, num_scheduled, len(stages))].batch


def doc_len_cap(step: int, num_scheduled: int, stages: Sequence[Stage]) -> int:
    """The stage's cut of training documents (also the attention's max_seqlen hint)."""
    return stages[stage_index(step, num_scheduled, len(stages))].max_doc_len


def batch_segments(num_steps: int, num_scheduled: int,
                   stages: Sequence[Stage]) -> list[tuple[int, int, int]]:
    """(first step, end step, global batch) of the runs of steps 0..num_steps-1 that share a batch
    size: one per stage (steps past the schedule stay in the last), empty ones left out."""
    starts = stage_starts(num_scheduled, len(stages))
    ends = [min(end, num_steps) for end in (*starts[1:], num_steps)]
    return [(a, b, st.batch) for a, b, st in zip(starts, ends, stages) if a < b]


def tokens_before(step: int, segments: Sequence[tuple[int, int, int]]) -> int:
    """Global tokens trained by steps 0..step-1 (batch_segments' runs of steps)."""
    return sum(batch * (min(end, step) - start) for start, end, batch in segments if start < step)


def window_sizes(step: int, num_scheduled: int, stages: Sequence[Stage],
                 ws_long_extension: int) -> tuple[int, int]:
    """(short, long) attention windows in blocks; short is half the long one, rounded down."""
    if step >= num_scheduled:
        ws_long = ws_long_extension
    else:
        ws_long = stages[stage_index(step, num_scheduled, len(stages))].ws_long
    return ws_long // 2, ws_long


def lr_factor(step: int, num_scheduled: int, stages: Sequence[Stage], lr_min: float,
              cooldown_frac: float) -> float:
    """Multiplier on every base lr: the stage's peak until the cooldown starts at
    int(num_scheduled * (1 - cooldown_frac)) (508 for the record), then the line from that peak to
    lr_min at the end of the schedule, then lr_min. The peak is the step's own stage's, so it jumps
    where a stage starts inside the cooldown (847: up to 1.0271). Upstream records 65 and 72."""
    cooldown_start = int(num_scheduled * (1 - cooldown_frac))
    peak = stages[stage_index(step, num_scheduled, len(stages))].lr_peak
    if step < cooldown_start:
        return peak
    t = min(1.0, (step - cooldown_start) / (num_scheduled - cooldown_start))
    return peak * (1 - t) + lr_min * t


def muon_momentum(step: int, num_iterations: int, lo: float, hi: float, warmup: int,
                  cooldown: int) -> float:
    """NorMuon momentum (double; the optimizer rounds it to fp32): lo -> hi over `warmup` steps,
    hi, then down by (hi - lo) over the last `cooldown` steps. The operations in upstream's order,
    which decides the last bit."""
    if step < warmup:
        return lo + (step / warmup) * (hi - lo)
    if step > num_iterations - cooldown:
        return hi - ((step - (num_iterations - cooldown)) / cooldown) * (hi - lo)
    return hi


def mtp_weights(step: int, num_scheduled: int, stages: Sequence[Stage]) -> tuple[float, ...]:
    """The multi-token-prediction weights (double): the stage's start weights moving linearly to its
    end weights, a + (b - a) * t with t = (step - start) / (end - start); past the schedule, the
    last stage's end weights (t = 1). Upstream record 65, PR #215."""
    if step >= num_scheduled:
        return tuple(float(b) for b in stages[-1].mtp_end)
    starts = stage_starts(num_scheduled, len(stages))
    k = stage_index(step, num_scheduled, len(stages))
    end = starts[k + 1] if k + 1 < len(stages) else num_scheduled
    t = (step - starts[k]) / (end - starts[k])
    return tuple(a + (b - a) * t for a, b in zip(stages[k].mtp_start, stages[k].mtp_end))


def prefix_weight(step: int, num_scheduled: int, stages: Sequence[Stage]) -> float:
    """The prefix-token loss weight (double), moving like the MTP weights (mtp_weights): 0.25 in
    stage 1, 0.25 -> 0 over stage 2, then 0 for the record. Upstream record 88, PR #337."""
    if step >= num_scheduled:
        return float(stages[-1].prefix_end)
    starts = stage_starts(num_scheduled, len(stages))
    k = stage_index(step, num_scheduled, len(stages))
    end = starts[k + 1] if k + 1 < len(stages) else num_scheduled
    t = (step - starts[k]) / (end - starts[k])
    a, b = stages[k].prefix_start, stages[k].prefix_end
    return a + (b - a) * t


def schedule_changes(hp: Hyperparameters) -> list[int]:
    """The steps after 0 where the batch size, the windows, the document cap or the number of MTP
    weights can change (every stage start and the end of the schedule): between two of them only
    the per-step values (lr, momentum, MTP weights) move, so a plan needs schedule_at at these
    steps alone."""
    ns = hp.num_scheduled_iterations
    return sorted(s for s in {*stage_starts(ns, len(hp.stages))[1:], ns}
                  if 0 < s < hp.num_iterations)


def validates_at(step: int, num_iterations: int, every: int) -> bool:
    """Whether the loop validates before `step` (at step num_iterations: after the last step):
    every `every` steps from 0 (0: never) and at the end; 0, 250, ..., 1250 and 1285 for the
    record."""
    return step == num_iterations or (every > 0 and step % every == 0)


def validations_left(done: int, num_iterations: int, every: int) -> int:
    """How many validations come after `done` steps (validates_at of the steps done..num_iterations:
    the multiples of `every` among them, and the last)."""
    if every <= 0 or done >= num_iterations:
        return int(done <= num_iterations)
    return (num_iterations - 1) // every - (done - 1) // every + 1    # floor division: done = 0 too


@dataclass(frozen=True)
class StepSchedule:
    step: int
    global_batch: int            # tokens per optimizer step over all ranks and micro-steps
    ws_short: int                # windows in blocks
    ws_long: int
    lr_factor: float
    momentum: float
    mtp_weights: tuple           # doubles; the model gets them as fp32 (Trainer.mtp_weights)
    prefix_weight: float         # double; the loss gets it as fp32 (Trainer.prefix_weight)
    max_doc_len: int             # training documents are cut to this (and max_seqlen hint)
    do_adam: bool                # Adam on odd steps, on two steps' gradients (upstream record 39)


def schedule_at(step: int, hp: Hyperparameters) -> StepSchedule:
    ns = hp.num_scheduled_iterations
    ws_short, ws_long = window_sizes(step, ns, hp.stages, hp.ws_long_extension)
    return StepSchedule(
        step=step,
        global_batch=global_batch_size(step, ns, hp.stages),
        ws_short=ws_short, ws_long=ws_long,
        lr_factor=lr_factor(step, ns, hp.stages, hp.lr_min, hp.cooldown_frac),
        momentum=muon_momentum(step, hp.num_iterations, hp.momentum_min, hp.momentum_max,
                               hp.momentum_warmup_steps, hp.momentum_cooldown_steps),
        mtp_weights=mtp_weights(step, ns, hp.stages),
        prefix_weight=prefix_weight(step, ns, hp.stages),
        max_doc_len=doc_len_cap(step, ns, hp.stages),
        do_adam=step % 2 == 1,
    )


# ==================================================================================================
# 7. Compiler settings: what changes graphs or rounding
# ==================================================================================================

def configure_compiler() -> None:
    """The process-wide torch.compile settings of a compiled run."""
    from torch import _dynamo
    from torch._functorch import config as functorch_config
    _dynamo.config.recompile_limit = 64   # every window / batch-size / YaRN variant is its own graph
    # The model's autograd Functions (the FP8 head with its loss, the Triton ops) are traced whole,
    # backward included, so their graphs are as cacheable as any. Without this torch does not put a
    # graph that contains one in its autograd cache: every start traces and partitions each
    # training graph again.
    functorch_config.autograd_cache_allow_custom_autograd_functions = True
    # A training graph's backward is compiled with its forward instead of at its first backward
    # (the same code, compiled earlier): in the compile split, a process then holds its GPU turn
    # only while it runs the graph (GpuTurns).
    functorch_config.force_non_lazy_backward_lowering = True
    # torch's on-disk caches key a graph by its ops, and a Triton op of triton_kernels.py is one op
    # there, although its launch code (tiles, arguments) is compiled into the graph. After an edit
    # of that file the caches could hand back graphs of the old code, so its text is in every key.
    tag = harness.kernels_cache_tag(Path(tk.__file__).read_text())
    other = [t for t in torch.compiler.config.cache_key_tag.split("|")
             if t and not t.startswith("triton_kernels:")]
    torch.compiler.config.cache_key_tag = "|".join([*other, tag])
    # Residual sums as mm + add, without the copy torch's addmm makes (unfuse_residual_addmm).
    from torch._inductor import config as inductor_config
    inductor_config.post_grad_custom_post_pass = _residual_matmul_pass()


def unfuse_residual_addmm(graph: torch.fx.Graph) -> int:
    """Rewrite each addmm(C, A, B) of a half-precision matrix C into add(mm(A, B), C) in a
    post-grad graph; returns how many were rewritten.

    Inductor turns `C + A @ B` into one addmm when the sum feeds a reduction (the residual stream
    `x + y @ W_o.T` before an RMS norm; the backward's `du = dqkv @ W + gate terms`). For a matrix
    C, torch's addmm first copies C into the output and then runs a GEMM that reads it back: 24
    copies of a (T, D) tensor per micro-batch. Unfused, the add runs inside the
    element-wise kernel that reads the sum anyway.
    The stored sums are the same numbers: cuBLAS's bf16 addmm rounds A @ B to bf16 before adding C
    (bitwise mm + add; tests/test_model_gpu.py checks it). What
    changes is that a norm fused with the add reads the fp32 sum before its bf16 rounding, as
    inductor does for every intermediate inside a fused kernel. On a CPU addmm rounds once, but
    CPU runs are not compiled.
    A 1-D bias (F.linear's), alpha or beta leave the node alone."""
    aten = torch.ops.aten
    rewritten = 0
    for node in list(graph.nodes):
        if node.target is not aten.addmm.default or node.kwargs or len(node.args) != 3:
            continue
        c, a, b = node.args
        out = node.meta.get("val")
        c_val, a_val, b_val = (getattr(n, "meta", {}).get("val") for n in (c, a, b))
        if not (all(isinstance(t, Tensor) for t in (out, c_val, a_val, b_val))
                and c_val.dtype in (torch.bfloat16, torch.float16)
                and tuple(c_val.shape) == tuple(out.shape)):
            continue
        with graph.inserting_before(node):
            mm = graph.call_function(aten.mm.default, (a, b))
            mm.meta["val"] = aten.mm.default(a_val, b_val)
            total = graph.call_function(aten.add.Tensor, (mm, c))
            total.meta["val"] = out
        node.replace_all_uses_with(total)
        graph.erase_node(node)
        rewritten += 1
    return rewritten


def _residual_matmul_pass() -> Any:
    """unfuse_residual_addmm as inductor's post-grad pass; its uuid (the function's source) is
    part of torch's compile-cache keys."""
    import hashlib
    import inspect
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class ResidualMatmulPass(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            unfuse_residual_addmm(graph)

        def uuid(self) -> str:
            return hashlib.sha256(inspect.getsource(unfuse_residual_addmm).encode()).hexdigest()

    return ResidualMatmulPass()


# ==================================================================================================
# 8. Building a run, and the values its checks read (checks.py)
# ==================================================================================================

def slices_for(hp: Hyperparameters, world_size: int) -> Hyperparameters:
    """The options as world_size processes run them. Up to --batch_slices processes share the slices
    (accumulating the rest): the same math on any such count. More processes (16, 32, 64 GPUs) each
    take one slice of the batch cut world_size ways: a slice cannot be split between processes
    without cutting its documents, whose attention would then miss keys. The global batch and the
    schedule stay; what differs is where documents are cut (at world_size boundaries instead of
    batch_slices) and the banks' unused padding."""
    if 0 < hp.batch_slices < world_size and world_size % hp.batch_slices == 0:
        return dataclasses.replace(hp, batch_slices=world_size)
    return hp


def resolve_dtype(hp: Hyperparameters, device_type: str) -> Hyperparameters:
    """The options with --dtype=auto made concrete for the device: bf16 on GPUs (and on the meta
    device, which only sizes things) and on CPUs with bf16 instructions, float32 on other CPUs."""
    if hp.dtype != "auto":
        return hp
    native = device_type != "cpu" or checks.cpu_runs_bf16_natively()
    return dataclasses.replace(hp, dtype="bfloat16" if native else "float32")


def dtype_note(asked: Hyperparameters, hp: Hyperparameters) -> list[str]:
    """The log line that says what --dtype=auto chose on a CPU, when it chose float32."""
    if asked.dtype != "auto" or hp.dtype == "bfloat16":
        return []
    forced = checks.cpu_bf16_override()      # the probe's override, named where it decided
    why = (f"NANOGPT_CPU_BF16={forced} is set" if forced else
           "this CPU has no bf16 instructions (AMX or AVX512-BF16)")
    return [f"note: {why}, so --dtype=auto trains in {hp.dtype}, faster here than emulated bf16; "
            "--dtype=bfloat16 runs the GPUs' precision"]


def build_model(hp: Hyperparameters, device: torch.device, attn_backend: str,
                ops: KernelOps | None = None) -> nn.Module:
    """The GPT of hp on device (--dtype=auto resolved for it); ops: the run's op table (None: the
    one --kernels, the device and the edited references give, kernel_ops)."""
    hp = resolve_dtype(hp, device.type)
    return GPT(hp, device, ops or kernel_ops(hp.kernels, device.type), attn_backend)


def fill_prefix_table(model: nn.Module, table: Tensor) -> None:
    """The model's prefix targets from the table (checks.load_prefix_table): its first V entries,
    where the vocabulary (V) is the table's ids or a subset; else a ConfigError."""
    V = model.prefix_table.shape[0]
    if V > table.shape[0]:
        raise harness.ConfigError(f"--vocab_size={V} is larger than the prefix-token table's "
                                  f"{table.shape[0]} ids (data/prefix_table.py); use at most "
                                  f"{table.shape[0]}")
    model.prefix_table.copy_(table[:V])


def build_optimizer(hp: Hyperparameters, model: nn.Module, rank: int, world_size: int) -> Any:
    table = {label: dict(row, **({"matrix_shape": model.bank_matrix_shapes[label]}
                                 if label in model.bank_matrix_shapes else {}))
             for label, row in hp.param_table.items()}
    return NorMuonAndAdam(dict(model.named_parameters()), table,
                          adam_lr=hp.adam_lr, adam_eps=hp.adam_eps, adam_wd=hp.adam_wd,
                          muon_lr=hp.muon_lr, muon_beta2=hp.muon_beta2, muon_wd=hp.muon_wd,
                          rank=rank, world_size=world_size, ops=model.ops)


def validate_hyperparameters(hp: Hyperparameters, world_size: int) -> None:
    """Every option checked once, right after parsing (checks.check_options), then the layout and
    the optimizer table by the model's and the optimizer's own checks, built on the meta device (no
    memory); each error names the option (or GPU count) to change."""
    checks.check_options(hp, world_size, KERNEL_OPS, BOS_ID)
    try:
        build_optimizer(hp, build_model(hp, torch.device("meta"), "sdpa"), world_size - 1,
                        world_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def train_tokens_needed(hp: Hyperparameters) -> int:
    """Tokens that carry a loss over the whole run (365,690,880 for the record)."""
    return tokens_before(hp.num_iterations, batch_segments(hp.num_iterations,
                                                           hp.num_scheduled_iterations, hp.stages))


def mlp_kernel_step(hp: Hyperparameters, device: torch.device) -> int | None:
    """The fused MLP kernel's step through the model dim (its FP8 forward's where that runs), or
    None where the reference runs."""
    edited = checks.edited_references(KERNEL_REFERENCES)
    fused = "mlp" in checks.fused_ops(hp.kernels, device.type, edited, KERNEL_OPS)
    return (tk._MLP_FP8_TILES if hp.fp8_mlp else tk._MLP_TILES)[2] if fused else None


def memory_parts(hp: Hyperparameters, world_size: int) -> dict[str, int]:
    """checks.memory_parts for the last rank's model and optimizer, built on the meta device (no
    memory), so every parameter and optimizer buffer is counted as the run will allocate it.
    ConfigError for options check_options refuses (the memory check tries smaller sizes)."""
    checks.check_options(hp, world_size, KERNEL_OPS, BOS_ID)
    meta = build_model(hp, torch.device("meta"), "sdpa")
    opt = build_optimizer(hp, meta, world_size - 1, world_size)
    return checks.memory_parts(hp, dict(meta.named_parameters()), opt.buffers)


def preflight(hp: Hyperparameters, world_size: int, device: torch.device,
              rank: int = 0) -> list[str]:
    """checks.preflight on this run's values (data, schedule, memory), then a walk through every
    validation batch this rank will read; returns the notes for the log."""
    hp = resolve_dtype(hp, device.type)
    caps = {(micro_batch_tokens(st.batch, hp.batch_slices), st.max_doc_len) for st in hp.stages}
    _, val_files, notes = checks.preflight(
        hp, world_size, device, trained_tokens=train_tokens_needed(hp), bos_id=BOS_ID,
        doc_rooms={(n, cap): max_num_docs(n, hp.tokens_per_doc_bound) - 1 for n, cap in caps},
        memory=lambda asked: memory_parts(asked, world_size),
        mlp_k_step=mlp_kernel_step(hp, device))
    for _ in val_batches(val_files, hp.val_batch_size, hp.val_tokens, hp.batch_slices // world_size,
                         rank, world_size, torch.device("cpu"), hp.tokens_per_doc_bound,
                         hp.vocab_size):
        pass
    return notes


# ==================================================================================================
# 9. Training: the step, validation, warmup and reset, the timed loop, main()
# ==================================================================================================

def variant_starts(hp: Hyperparameters) -> list[int]:
    """The first step of each compiled variant of the model: step 0 and every change of the
    windows, batch size, document cap (the max_seqlen hint, an int the graphs specialise on) or
    number of MTP weights (each is its own pair of graphs)."""
    def shape(step: int) -> tuple:
        sc = schedule_at(step, hp)
        return sc.ws_short, sc.ws_long, sc.global_batch, sc.max_doc_len, len(sc.mtp_weights)
    return [0] + [s for s in schedule_changes(hp) if shape(s) != shape(s - 1)]


def warmup_steps(hp: Hyperparameters) -> list[int]:
    """Steps that exercise every compiled variant: the start, both sides of every variant change,
    and the split."""
    steps = ({0, 1, 2, hp.untie_step, hp.untie_step - 1}
             | {t + d for t in variant_starts(hp)[1:] for d in (-1, 0, 1)})
    return sorted(s for s in steps if 0 <= s < hp.num_iterations)


def replay_yarn(model: nn.Module, hp: Hyperparameters, steps_done: int) -> int:
    """Bring the model's rotary state (not in its state dict) to where training left it after
    `steps_done` steps: from the reset, every long-window change in order, as the run made them.
    Returns the last step's long window."""
    ws_long = schedule_at(0, hp).ws_long
    model.reset_rotary()
    for step in schedule_changes(hp):     # the window changes only there
        if step >= steps_done:
            break
        new = schedule_at(step, hp).ws_long
        if new != ws_long:
            model.apply_yarn(ws_long, new)
            ws_long = new
    return ws_long


def snapshot_state(model: nn.Module, opt: Any) -> dict[str, Any]:
    """A detached copy of everything a step changes (used to undo the warmup, and in states)."""
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": copy.deepcopy(opt.state_dict())}


def meta_state(hp: Hyperparameters, rank: int, world_size: int) -> dict[str, Any]:
    """snapshot_state of this rank's model and optimizer built on the meta device (no memory): the
    names, shapes and dtypes a state this code resumes must hold."""
    model = build_model(hp, torch.device("meta"), "sdpa")
    return snapshot_state(model, build_optimizer(hp, model, rank, world_size))


class Trainer:
    """The schedule state (windows, batch size, document cap) and the step/validation routines
    shared by warmup and the timed loop."""

    def __init__(self, hp: Hyperparameters, model: nn.Module, compiled: Callable, opt: Any,
                 device: torch.device, rank: int, world_size: int, train_files: list[str],
                 val_files: list[str]):
        self.hp, self.model, self.compiled, self.opt = hp, model, compiled, opt
        self.device, self.rank, self.world_size = device, rank, world_size
        self.train_files, self.val_files = train_files, val_files
        self.grad_accum = hp.batch_slices // world_size
        self.reset_schedule_state()

    def reset_schedule_state(self, steps_done: int = 0,
                             position: TrainPosition | None = None) -> None:
        """The state after `steps_done` steps: the long window and YaRN state of the last step, the
        next step's batch size and document cap, and a data stream from `position`."""
        hp = self.hp
        self.ws_long = replay_yarn(self.model, hp, steps_done)
        # The stream starts with the next step's batch size and cap (sending them would do the
        # same).
        sched = schedule_at(min(steps_done, hp.num_iterations - 1), hp)
        self.global_batch, self.max_doc_len = sched.global_batch, sched.max_doc_len
        self.position = position if position is not None else TrainPosition()
        self.loader = train_batches(self.train_files, self.global_batch, self.grad_accum, self.rank,
                                    self.world_size, self.device, self.max_doc_len,
                                    hp.tokens_per_doc_bound, hp.vocab_size, self.position)

    def state(self, steps_done: int, train_ms: float) -> dict[str, Any]:
        """This rank's part of everything the rest of the run depends on after `steps_done` steps
        (copies)."""
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        # Adam's gradients add up over the steps between its updates (NorMuon's are consumed every
        # step).
        grads = {name: p.grad.detach().clone() for name, p in self.model.named_parameters()
                 if p.grad is not None}
        return {"step": steps_done, **snapshot_state(self.model, self.opt), "grads": grads,
                "train_time_ms": train_ms, "loader": dataclasses.asdict(self.position), "rng": rng}

    def restore(self, state: dict[str, Any]) -> None:
        """The inverse of state(): weights, optimizer, schedule and YaRN state, data position,
        random generators."""
        self.model.load_state_dict(state["model"])
        self.model.rebuild_fp8_down()
        self.opt.load_state_dict(state["optimizer"])
        for name, p in self.model.named_parameters():
            p.grad = state["grads"][name].to(p.device) if name in state["grads"] else None
        torch.set_rng_state(state["rng"]["cpu"])
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        self.reset_schedule_state(state["step"], TrainPosition(**state["loader"]))

    def advance_schedule(self, sched: StepSchedule) -> tuple | None:
        """Apply YaRN at a window change; return the loader's message for this step's
        micro-batches where the batch size or the document cap changes (423 and 847 for the
        record), else None."""
        if sched.ws_long != self.ws_long:
            self.model.apply_yarn(self.ws_long, sched.ws_long)
            self.ws_long = sched.ws_long
        if (sched.global_batch, sched.max_doc_len) != (self.global_batch, self.max_doc_len):
            self.global_batch, self.max_doc_len = sched.global_batch, sched.max_doc_len
            return (sched.global_batch, sched.max_doc_len, self.grad_accum)
        return None

    def train_loss(self, batch: tuple[Tensor, Tensor, Tensor], sched: StepSchedule,
                   mtp: Tensor, prefix: Tensor, micro_step: int) -> Tensor:
        """One training micro-batch's summed loss (the forward; the caller runs the backward, of
        loss / grad_accum: the grad_scale passed to the model), its prefix term of weight `prefix`
        (prefix_weight). No segment is longer than the stage's document cap: the attention's
        max_seqlen hint. The micro-step's batch slice owns its FP8 activation scales (so they do
        not depend on the world size)."""
        inputs, targets, cu_seqlens = batch
        down = self.model.fp8_down
        act_scales = (None if down is None else
                      down.act_scales[micro_step * self.world_size + self.rank])
        return self.compiled(inputs, targets, cu_seqlens, sched.ws_short, sched.ws_long, mtp,
                             sched.max_doc_len, 1 / self.grad_accum, prefix, act_scales)

    def val_loss(self, batch: tuple[Tensor, Tensor, Tensor], ws_short: int,
                 ws_long: int) -> Tensor:
        """One validation batch's mean loss (the model in eval mode, no grad)."""
        inputs, targets, cu_seqlens = batch
        next_token_only = torch.ones(1, device=self.device)
        return self.compiled(inputs, targets, cu_seqlens, ws_short, ws_long, next_token_only,
                             self.hp.val_batch_size // self.hp.batch_slices)

    def val_batches(self) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        hp = self.hp
        return val_batches(self.val_files, hp.val_batch_size, hp.val_tokens, self.grad_accum,
                           self.rank, self.world_size, self.device, hp.tokens_per_doc_bound)

    def compile_alone(self, step: int, phase: str) -> None:
        """Compile the graphs of `step`'s variant for "val" (one validation forward) or "train" (one
        training micro-batch forward and backward) without the other ranks: no optimizer step, no
        collective, so that ranks can compile different variants at once. The weights stay as they
        are; gradients accumulate and the rotary state moves to `step`: reset both afterwards
        (reset_schedule_state, grads to None)."""
        hp, sched = self.hp, schedule_at(step, self.hp)
        replay_yarn(self.model, hp, step + 1)    # the rotary state and attention scale of `step`
        if phase == "val":
            self.model.eval()
            with torch.no_grad():
                self.val_loss(next(iter(self.val_batches())), sched.ws_short, sched.ws_long)
            self.model.train()
            return
        batches = train_batches(self.train_files, sched.global_batch, self.grad_accum, self.rank,
                                self.world_size, self.device, sched.max_doc_len,
                                hp.tokens_per_doc_bound, hp.vocab_size, TrainPosition())
        loss = self.train_loss(next(batches), sched, self.mtp_weights(sched),
                               self.prefix_weight(sched), 0)
        (loss / self.grad_accum).backward()
        batches.close()

    def mtp_weights(self, sched: StepSchedule) -> Tensor:
        """The step's MTP weights on the device, copied as the batches are (_to_device)."""
        return _to_device(np.array(sched.mtp_weights), np.float32, self.device)

    def prefix_weight(self, sched: StepSchedule) -> Tensor:
        """The step's prefix-token loss weight, a 1-element fp32 tensor on the device (as the MTP
        weights)."""
        return _to_device(np.array([sched.prefix_weight]), np.float32, self.device)

    def train_step(self, sched: StepSchedule, message: tuple | None) -> Tensor:
        """A micro-steps of forward/backward, then the optimizer step; returns this rank's summed
        loss (on device)."""
        hp, mtp, prefix = self.hp, self.mtp_weights(sched), self.prefix_weight(sched)
        total = torch.zeros((), device=self.device)
        for m in range(self.grad_accum):
            loss = self.train_loss(self.loader.send(message), sched, mtp, prefix, m)
            (loss / self.grad_accum).backward()
            total += loss.detach()
        # a label for bench/profile_step.py; free otherwise
        with torch.profiler.record_function("optimizer_step"):
            self.opt.step(do_adam=sched.do_adam, lr_factor=sched.lr_factor, momentum=sched.momentum)
        if sched.step == hp.untie_step:
            self.opt.untie()
        self.model.refresh_fp8_down(sched.step)
        return total

    def mean_train_loss(self, summed: Tensor, sched: StepSchedule) -> float:
        """train_step's summed loss as a per-token mean over every rank's tokens of the step."""
        mean = summed.detach() / (sched.global_batch // self.world_size)
        if self.world_size > 1:
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        return mean.item()

    @torch.no_grad()
    def validate(self, ws_short: int, ws_long: int, max_batches: int | None = None,
                 stop: Callable[[], int] | None = None) -> float:
        """The mean validation loss over every rank's batches (a whole validation shows progress on
        a slow machine). stop: asked before each batch (every rank asks at the same batches, as the
        loop's step boundaries: Run.vote_to_stop); a signal it returns abandons the validation
        (harness.Interrupted, agreed), so a stop asked for during it waits for no more batches."""
        hp, rank = self.hp, self.rank
        self.model.eval()
        total, count = torch.zeros((), device=self.device), 0
        batches = self.grad_accum * hp.val_tokens // hp.val_batch_size
        progress = harness.Progress(rank, "validation", batches)
        for batch in self.val_batches():
            if stop is not None and (signum := stop()):
                self.model.train()
                raise harness.stopped(signum, "during a validation")
            total += self.val_loss(batch, ws_short, ws_long)
            count += 1
            progress.tick(count)
            if max_batches is not None and count >= max_batches:
                break
        loss = total / count
        if self.world_size > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        self.model.train()
        return loss.item()


def compile_model(model: nn.Module) -> Callable:
    """The model under torch.compile with this file's compiler settings (one graph per variant)."""
    configure_compiler()
    return torch.compile(model, dynamic=False, fullgraph=True)


def code_files() -> list[Path]:
    """What a run's log embeds and every rank checks is the same: this file (under whatever name it
    runs), its checks, its kernels and the run machinery (whose console progress a validation
    ticks)."""
    here = Path(__file__).resolve()
    return [here, here.with_name("checks.py"), Path(tk.__file__).resolve(),
            Path(harness.__file__).resolve()]


def prepare_training(run: harness.Run, argv_text: str,
                     notes: Sequence[str] = ()) -> tuple[Trainer, harness.Checkpointer]:
    """Log the run's head and check it (options against a resumed state, then data and memory),
    build the model and optimizer, compile."""
    hp, device = run.hp, run.device
    sources = {path.name: path.read_text() for path in code_files()}
    attn_backend = checks.resolve_attn_backend(hp.attn_backend, device)
    edited = checks.edited_references(KERNEL_REFERENCES)
    ops = kernel_ops(hp.kernels, device.type, edited)
    train_files, val_files, checkpointer = harness.begin_run(run, sources, argv_text, attn_backend)
    if run.resumed is not None:   # another recipe's tensors are refused before anything is built
        harness.check_state_layout(run.resumed, meta_state(hp, run.rank, run.world_size), hp,
                                   next(iter(sources)))
    preflight_notes = preflight(hp, run.world_size, device, run.rank)
    switch_notes = checks.kernel_switch_lines(hp.kernels, device.type, edited, KERNEL_REFERENCES)
    harness.accept_run(run, sources, attn_backend, [*preflight_notes, *notes, *switch_notes])
    if hp.seed >= 0:
        torch.manual_seed(hp.seed)
    prefix_table = checks.load_prefix_table()   # the tokeniser's, read once, before the clock
    model = build_model(hp, device, attn_backend, ops)
    fill_prefix_table(model, prefix_table)
    if run.world_size > 1:    # every rank starts from rank 0's draws (weights and the bigram signs)
        for t in model.state_dict().values():
            dist.broadcast(t, 0)
    opt = build_optimizer(hp, model, run.rank, run.world_size)
    compiled = model
    if run.compiling:
        if hp.compile_cache:
            harness.open_compile_cache(run, hp, attn_backend, list(sources.values()))
        compiled = compile_model(model)
    trainer = Trainer(hp, model, compiled, opt, device, run.rank, run.world_size, train_files,
                      val_files)
    run.sync()
    run.log(f"phase:startup time:{run.since_start_ms():.0f}ms")
    return trainer, checkpointer


def warmup_and_reset(trainer: Trainer, run: harness.Run) -> None:
    """Compile every variant on real batches (warmup_steps), then restore the exact initial state,
    and check it."""
    t0 = time.perf_counter()
    hp, model, opt = trainer.hp, trainer.model, trainer.opt
    initial = snapshot_state(model, opt)
    steps, variants = warmup_steps(hp), variant_starts(hp)
    compile_log = harness.CompileLog(run.compiling, harness.eager_autotuners(tk))
    helper_task = dict(script=Path(__file__).resolve(), module=__name__, hp=hp,
                       device=str(trainer.device), attn_backend=model.attn_backend,
                       rank=trainer.rank, world_size=trainer.world_size,
                       train_files=trainer.train_files, val_files=trainer.val_files)
    with compile_log.recording():
        # the compile split, when it pays: this rank's share alone, its helpers' at the same time
        for step, phase in compile_split.own_share(run, variants, compile_log, t0, helper_task,
                                                   model):
            trainer.compile_alone(step, phase)
        trainer.reset_schedule_state()
        run.log(f"warmup: compiling on steps {steps}")
        for i, step in enumerate(steps):
            sched = schedule_at(step, hp)
            batch_change = trainer.advance_schedule(sched)
            with compile_log.during(step, "val"):
                trainer.validate(sched.ws_short, sched.ws_long, max_batches=1)
            with compile_log.during(step, "train"):
                trainer.train_step(sched, batch_change)
            elapsed = time.perf_counter() - t0
            run.log(f"  warmup {i + 1}/{len(steps)} step {step} done at {elapsed:.1f}s, about "
                    f"{harness.duration(elapsed / (i + 1) * (len(steps) - i - 1))} left")
    run.log_table(compile_log.report(time.perf_counter() - t0))
    model.load_state_dict(initial["model"])
    opt.load_state_dict(initial["optimizer"])
    if model.fp8_down is not None:   # the record's reset: every scale 1, then a bootstrap refresh
        model.fp8_down.reset()
        model.refresh_fp8_down(None)
    for p in model.parameters():
        p.grad = None
    if not harness.states_equal(snapshot_state(model, opt), initial):
        raise RuntimeError("the state after the warmup reset differs from the initial state "
                           "(a bug: report it)")
    trainer.reset_schedule_state()
    run.sync()
    run.log(f"phase:warmup time:{1000 * (time.perf_counter() - t0):.0f}ms "
            "(state reset and checked)")


class TrainClock:
    """train_time: it runs during training steps only. Starting and pausing wait for the GPU, so the
    time of queued work lands on the side of the pause it was queued on."""

    def __init__(self, ms: float, device: torch.device):
        self.ms, self.device, self.t0 = ms, device, None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        self.t0 = time.perf_counter()

    def pause(self) -> float:
        self._sync()
        self.ms, self.t0 = self.now_ms(), None
        return self.ms

    @contextlib.contextmanager
    def paused(self, restart: bool = True) -> Iterator[float]:
        """An untimed region: the time so far (paused), then the clock runs again if restart."""
        yield self.pause()
        if restart:
            self.start()

    def now_ms(self) -> float:
        """The time so far without waiting for the GPU (step lines, the NaN guard's states)."""
        return self.ms + (1000 * (time.perf_counter() - self.t0) if self.t0 is not None else 0.0)


def validate_in_loop(run: harness.Run, trainer: Trainer, checkpointer: harness.Checkpointer,
                     sched: StepSchedule, step: int, train_ms: float, saving: bool) -> float:
    """A validation of the timed loop (the clock paused), logged. The final one (after the last
    step) first saves the final state and takes a stop asked for, since no step boundary follows."""
    hp, total = trainer.hp, trainer.hp.num_iterations
    last, saved = step == total, ""
    if last:
        if saving:
            with run.long_timeout():
                saved = f"; the final state is saved: {checkpointer.save(trainer.state(step, train_ms))}"
        run.stops.defer = False
        if signum := run.agreed_signal():
            raise harness.stopped(signum, f"before the final validation{saved}")
    tv = time.perf_counter()
    try:
        val_loss = trainer.validate(sched.ws_short, hp.ws_long_final_val if last else sched.ws_long,
                                    stop=None if last else run.vote_to_stop)
    except harness.Interrupted as e:
        if last:
            raise harness.stopped(e.signum, f"during the final validation{saved}", e.agreed) from e
        if not e.agreed:
            raise
        # A mid-run validation abandoned at a vote every rank took: the stop a step boundary
        # would take, with the state of the step just finished, well inside torchrun's grace.
        if saving:
            saved = (f"; the state after step {step} is saved: "
                     f"--resume={checkpointer.save(trainer.state(step, train_ms))}")
        raise harness.stopped(e.signum, f"after step {step} of {total}{saved}") from e
    run.log(f"step:{step}/{total} val_loss:{val_loss:.4f} train_time:{train_ms:.0f}ms "
            f"step_avg:{train_ms / max(step, 1):.2f}ms")
    run.log(f"phase:validation time:{1000 * (time.perf_counter() - tv):.0f}ms", console=False)
    if not math.isfinite(val_loss):
        raise harness.diverged(f"the validation loss is {val_loss} at step {step}", None)
    return val_loss


def timed_loop(run: harness.Run, trainer: Trainer, checkpointer: harness.Checkpointer,
               start: int, train_ms: float) -> dict[str, Any]:
    """Steps start..num_iterations, timed as the record times them: the clock runs during the steps
    only, and pauses (waiting for the GPU) for every validation and saved state. Between steps: the
    loss's finiteness (every --nonfinite_check_every steps, where the first bad step recorded on the
    GPU is read), the step line, a periodic state, and a stop that a signal asked for (taken at a
    step boundary every rank agrees on). Returns the run's summary."""
    hp, total = trainer.hp, trainer.hp.num_iterations
    segments = batch_segments(total, hp.num_scheduled_iterations, hp.stages)
    saving = hp.save_checkpoint or hp.checkpoint_every > 0
    finite = harness.FiniteWatch(hp.nonfinite_check_every, total, run.device,
                                 trainer.state(start, train_ms) if saving else None)
    profiler = harness.StepProfiler(hp, run)
    clock, val_loss = TrainClock(train_ms, run.device), float("nan")
    val_seconds = []                     # each validation's wall time, for the console's ETA
    run.log(f"phase:process_start_to_timed_loop time:{run.since_start_ms():.0f}ms")
    run.stops.defer = True               # a signal now stops the run at the next step boundary
    run.stops.where = None               # (a second one at once: the callers below say where)
    run.shorten_timeout()                # the ranks now run in lockstep: --loop_timeout_s
    if start < total:                    # (the resume of a final state only validates: no clock)
        clock.start()
    for step in range(start, total + 1):
        last = step == total
        sched = schedule_at(min(step, total - 1), hp)
        batch_change = trainer.advance_schedule(sched) if not last else None   # and YaRN
        if validates_at(step, total, hp.val_loss_every):
            with clock.paused(restart=not last) as ms:
                tv = time.perf_counter()
                val_loss = validate_in_loop(run, trainer, checkpointer, sched, step, ms, saving)
                val_seconds.append(time.perf_counter() - tv)
            if last:
                break
        profiler.before_step(step)
        loss = trainer.train_step(sched, batch_change)     # each micro-batch's forward and
        done = step + 1                                    # backward, then the optimizer step
        profiler.after_step(done)
        finite.record(done, loss)                          # on the GPU: no sync
        if finite.due(done):
            finite.raise_if_bad(checkpointer)
            finite.passed(trainer.state(done, clock.now_ms()) if saving else None)
        train_loss = (trainer.mean_train_loss(loss, sched)
                      if hp.train_loss_every and done % hp.train_loss_every == 0 else None)
        val_left = (sum(val_seconds) / len(val_seconds) if val_seconds and done < total else 0.0) \
            * validations_left(done, total, hp.val_loss_every)
        run.log_step(done, total, clock.now_ms(), tokens_before(done, segments),
                     tokens_before(total, segments), train_loss, val_left)
        if hp.checkpoint_every and done % hp.checkpoint_every == 0 and done < total:
            with clock.paused() as ms, run.long_timeout():
                checkpointer.save(trainer.state(done, ms), periodic=True)
        # A stop is voted on at every boundary: free with one process; with several a 4-byte
        # all-reduce read at the next boundary (harness.StopVote), so every rank stops after one step.
        if done < total and (signum := run.vote_to_stop()):
            with clock.paused(restart=False) as ms:
                saved = (f"; the state after step {done} is saved: "
                         f"--resume={checkpointer.save(trainer.state(done, ms))}" if saving else "")
            raise harness.stopped(signum, f"after step {done} of {total}{saved}")
    if note := checks.upstream_capacity_note(trainer.position.over_upstream_capacity):
        run.log(note)
    return run.finish(val_loss, clock.ms)


def train(hp: Hyperparameters, argv_text: str, stops: harness.StopSignals | None = None,
          resume_notes: Sequence[str] = ()) -> dict[str, Any]:
    """The whole run: checks, setup, warmup and reset, then the timed loop. Returns a summary
    (final val loss, train time). resume_notes: the line naming the options a resume took from its
    state (harness.resume_options), for the log."""
    world_size = harness.launch_environment()[1]
    with harness.same_on_every_rank():
        asked = hp
        hp = resolve_dtype(slices_for(hp, world_size), harness.device_type(hp))
        validate_hyperparameters(hp, world_size)
    notes = [*resume_notes, *dtype_note(asked, hp)]
    if hp.batch_slices != asked.batch_slices:
        notes.append(f"note: {hp.batch_slices} processes, more than --batch_slices="
                     f"{asked.batch_slices}: each takes one slice of the batch cut {hp.batch_slices} "
                     f"ways, so documents are cut where {asked.batch_slices} slices would not cut "
                     "them (the record's exact math needs at most 8 processes; docs/multi-node.md)")
    run = harness.open_run(hp, stops or harness.StopSignals(),
                           [*code_files(), Path(compile_split.__file__)])
    with run.failures_logged():
        trainer, checkpointer = prepare_training(run, argv_text, notes)
        if hp.warmup:
            run.stops.where = harness.IN_WARMUP
            warmup_and_reset(trainer, run)
            run.stops.where = harness.BEFORE_TRAINING
            if run.compile_cache is not None and run.rank == 0:   # compiled: keep it for next time
                run.log(harness.save_compile_cache(*run.compile_cache))
        gc.collect()    # the warmup's garbage, collected before the clock starts
        start, train_ms = 0, 0.0
        if run.resumed is not None:  # the saved state replaces the initial one
            trainer.restore(run.resumed)
            start, train_ms = run.resumed["step"], run.resumed["train_time_ms"]
            run.log(f"resumed from {run.resumed['path']} after step {start} of {hp.num_iterations} "
                    f"(train_time so far {train_ms:.0f}ms)")
        return timed_loop(run, trainer, checkpointer, start, train_ms)


def dry_run(hp: Hyperparameters, resume_notes: Sequence[str] = ()) -> None:
    """--dry_run: every check a run makes before it builds or compiles anything, printed as a
    checklist; the first failing check raises as in a real run. resume_notes: as train's."""
    with harness.same_on_every_rank():
        hp = resolve_dtype(slices_for(hp, harness.launch_environment()[1]), harness.device_type(hp))
        validate_hyperparameters(hp, harness.launch_environment()[1])
    rank, world_size, _, device = harness.setup_distributed(hp)
    harness.dry_run_checks(hp, rank, world_size, device, checks.available_attn_backends(device),
                           checks.resolve_attn_backend(hp.attn_backend, device),
                           code_files()[0].name, resume_notes,
                           meta_state(hp, rank, world_size) if hp.resume else None)
    harness.dry_run_notes(rank, preflight(hp, world_size, device, rank))


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: --help, a dry run or a run, with one `error:` line and an exit code for
    every failure (harness.command_line)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if harness.asks_for_help(argv):
        print(harness.help_text(Hyperparameters(), PRESETS, Path(__file__).name))
        return 0
    with harness.command_line(argv) as outcome:
        with harness.same_on_every_rank():
            hp = parse_args(argv)
        hp, resume_notes = harness.resume_options(hp, argv, PRESETS)   # the state's options
        if hp.dry_run:
            dry_run(hp, resume_notes)
        else:
            train(hp, " ".join(argv), outcome.stops, resume_notes)
    return outcome.code


if __name__ == "__main__":
    # This file runs as a module named after it (train_gpt, or a copy's own name), the name under
    # which compile_split.py's helpers load it by path: torch's compile caches key graphs by the
    # module names of the model's classes.
    sys.exit(compile_split.load_script(__file__).main())
