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
