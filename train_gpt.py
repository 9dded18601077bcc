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
# Polar Express coefficients (a, b, c) for 5 iterations, designed with safety factor 2e-2 and cushion 2 (spec §5.5).
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# Matrices stored with more rows than this (the 3072x768 MLP ones) round a*X + B@X twice, like the record (§5.5).
POLAR_EXPRESS_SPLIT_ROWS = 1024
NORMUON_EPS = 1e-10                    # floor of the second moment and of the renormalised norm (§5.6)


def _fp32(x: float) -> float:
    """Round a Python (double) float to the nearest fp32 value; optimizer scalars are computed in double, then this."""
    return float(np.float32(x))


def polar_express(G: Tensor, split_final_product: bool) -> Tensor:
    """Approximate U·Vᵀ of G = U·S·Vᵀ for a batch (..., R, C) of matrices, in bf16 (spec §5.5).

    Five odd-polynomial iterations X <- a·X + (b·A + c·A²)·X with A = X·Xᵀ, on the short side (transposed when R > C,
    so A is the smaller Gram matrix). X is first scaled by its Frobenius norm (+2% safety) so every singular value
    lies in (0, 1), where the coefficients push it towards 1. split_final_product: round B@X to bf16 before adding
    a·X (two roundings, as the record does for the MLP matrices) instead of one fused GEMM with beta = a.
    """
    shape = G.shape
    X = G.bfloat16().reshape(-1, shape[-2], shape[-1])           # (n, R, C)
    if shape[-2] > shape[-1]:
        X = X.mT                                                 # (n, C, R): Gram matrices are C x C
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * (1 + 2e-2) + 1e-6)
    for a, b, c in POLAR_EXPRESS_COEFFS:
        A = tk.xxt(X)                                            # (n, m, m) bf16, exactly symmetric
        B = tk.ba_plus_cAA(A, b, c)                              # (n, m, m) bf16
        if split_final_product:
            X = (B @ X).float().add_(X, alpha=a).bfloat16()      # bf16(bf16(B@X) + a·X)
        else:
            X = torch.baddbmm(X, B, X, beta=a)                   # bf16(a·X + B@X), fp32 accumulation
    if shape[-2] > shape[-1]:
        X = X.mT
    return X.reshape(shape)


def adam_update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, beta1: float, beta2: float,
                eps: float, step_size: float | Tensor, decay: float | Tensor) -> None:
    """One Adam update of a slice in place, all arithmetic in fp32 (spec §5.3).

    step_size = fp32(lr·sqrt(1-beta2^t)/(1-beta1^t)) and decay = fp32(lr²·wd) come from adam_scalars(). eps is not
    bias corrected. Cautious decay only where the update and the weight agree in sign (strict >). A bf16 param
    takes the round-to-nearest of the fp32 result (no master copy).
    """
    g = grad.float()
    exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    p = param.float()
    u = exp_avg / (exp_avg_sq.sqrt() + eps) * step_size
    u = u + decay * p * (u * p > 0)
    param.copy_(p - u)


def adam_scalars(lr: float, t: int, beta1: float, beta2: float, wd: float) -> tuple[float, float]:
    """(step_size, decay) for adam_update: computed in double, rounded to fp32. lr includes lr_mul; decay uses lr²."""
    step_size = _fp32(lr * (math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)))
    decay = _fp32(lr * lr * wd)
    return step_size, decay


def variance_normalize_(O: Tensor, second_moment: Tensor, beta2: float) -> Tensor:
    """NorMuon's low-rank second moment (spec §5.6): O (n, R, C) bf16 -> O with each row (R >= C) or column scaled by
    1/sqrt(running mean of its squares), then the matrix rescaled to its previous Frobenius norm.

    second_moment is fp32 (n, R, 1) when R >= C, else (n, 1, C); updated in place. An all-zero O stays zero.
    """
    reduce_dim = -1 if O.size(-2) >= O.size(-1) else -2
    n_red = O.size(reduce_dim)
    r = O.float().square().mean(dim=reduce_dim, keepdim=True)                      # (n, R, 1) per-row mean square
    norm = (n_red * r.sum(dim=(-2, -1), keepdim=True)).sqrt()                       # (n, 1, 1) = ||O||_F
    second_moment.lerp_(r, 1 - beta2)
    d = second_moment.clamp_min(NORMUON_EPS).rsqrt()                                # (n, R, 1)
    norm_scaled = (n_red * r * d.square()).sum(dim=(-2, -1), keepdim=True).sqrt()  # ||diag(d) O||_F
    scale = d * norm / norm_scaled.clamp_min(NORMUON_EPS)
    return O * scale.bfloat16()


def normuon_direction_(grad: Tensor, momentum_buffer: Tensor, second_moment: Tensor, *, momentum: float,
                       beta2: float, split_final_product: bool) -> Tensor:
    """Momentum (§5.4), Polar Express (§5.5) and variance normalisation (§5.6) of one chunk; updates both buffers.

    grad (n, R, C) bf16, momentum_buffer (n, R, C) fp32 -> O (n, R, C) bf16.
    """
    G = grad.float()
    momentum_buffer.lerp_(G, 1 - momentum)   # weight < 0.5: M + (1-mu)(G - M)
    U = G.lerp(momentum_buffer, momentum)    # weight >= 0.5: torch evaluates M - (M - G)(1 - mu); Nesterov-style
    O = polar_express(U, split_final_product)
    return variance_normalize_(O, second_moment, beta2)


def cautious_update_with_mantissa_(param: Tensor, mantissa: Tensor, O: Tensor, *, lr: float | Tensor,
                                   wd: float | Tensor) -> None:
    """P <- (P - ((P·mask)·wd)·lr) - O·lr on the fp32 master P = (bf16 bits << 16) | mantissa (spec §5.8).

    param (n, R, C) bf16 and mantissa (n, R, C) uint16 are updated in place: the bf16 keeps the high 16 bits of the
    new master (truncation toward zero), the mantissa the low 16. mask = [O·P >= 0] (non-strict: entries with zero
    update are decayed too). lr is fp32, a scalar or (n, 1, 1) per matrix; wd is fp32.
    """
    high = param.view(torch.int16).to(torch.int32) << 16
    low = mantissa.view(torch.int16).to(torch.int32) & 0xFFFF
    P = (high | low).view(torch.float32)
    Og = O.float()
    mask = Og * P >= 0
    P_new = (P - ((P * mask) * wd) * lr) - Og * lr
    bits = P_new.view(torch.int32)
    param.view(torch.int16).copy_((bits >> 16).to(torch.int16))
    mantissa.view(torch.int16).copy_(((bits << 16) >> 16).to(torch.int16))   # low 16 bits, sign-extended to fit


def normuon_update(param: Tensor, grad: Tensor, momentum_buffer: Tensor, second_moment: Tensor, mantissa: Tensor, *,
                   momentum: float, beta2: float, lr: float | Tensor, wd: float | Tensor,
                   split_final_product: bool) -> None:
    """One NorMuon update of a chunk of matrices in place (spec §5.4-5.8). All tensors (n, R, C) except
    second_moment ((n, R, 1) or (n, 1, C)); lr (fp32 scalar or (n, 1, 1)) and wd from normuon_scalars()."""
    O = normuon_direction_(grad, momentum_buffer, second_moment, momentum=momentum, beta2=beta2,
                           split_final_product=split_final_product)
    cautious_update_with_mantissa_(param, mantissa, O, lr=lr, wd=wd)


def normuon_matrix_lr_scales(matrix_shape: Sequence[int], lr_mul: float, matrix_lr_muls: Sequence[float],
                             global_indices: Sequence[int]) -> list[float]:
    """(shape_mult·lr_mul)·matrix_mult for each matrix (double); shape_mult = sqrt(max(1, R/C)) of the stored shape,
    matrix_mult cycles over the GLOBAL matrix index of the bank (c_fc, c_proj alternate in the MLP bank, §5.7)."""
    R, C = matrix_shape
    shape_mult = math.sqrt(max(1.0, R / C))
    return [(shape_mult * lr_mul) * matrix_lr_muls[i % len(matrix_lr_muls)] for i in global_indices]


def normuon_scalars(muon_lr: float, lr_factor: float, wd: float, wd_mul: float) -> tuple[float, float]:
    """(base lr = muon_lr·s in double, wd = fp32(wd_mul·wd·(muon_lr·s))): decay uses the UN-multiplied lr (§5.8)."""
    lr = muon_lr * lr_factor
    return lr, _fp32(wd_mul * wd * lr)


class NorMuonAndAdam:
    """One optimizer for every parameter, configured per label by a table (spec §5).

    NorMuon (Polar Express + low-rank variance normalisation, fp32 master kept as bf16 + a 16-bit mantissa) updates
    the matrix banks every step; Adam updates everything else on odd steps only, on the sum of two steps' gradients.
    Communication per label is "replicated" (all-reduce the gradient, every rank updates the whole tensor),
    "sharded" (reduce-scatter along dim 0 of the tensor, or of the bank's matrix view for NorMuon, update this rank's
    slice, all-gather it back) or "none" (no communication at all).

    Comm ordering. A step launches every reduction up front, asynchronously, in `scatter_order`, then walks
    `work_order`: wait for a label's reduction, update its slice, launch its all-gather. The two orders differ because
    the collectives run one after another on a single comm stream while the updates run on the compute stream: the
    big NorMuon banks are reduced first, and their Polar Express work comes last in work order, so the cheap Adam
    updates run (and their large embedding gathers start) while the bank reductions are still arriving, and the long
    Polar Express compute hides every gather launched before it; only the last bank's gather is exposed. These
    orders are performance choices (measured in the record), not math. Two orderings ARE correctness constraints
    while embed and lm_head are tied: (1) the gradient fold lm_head.grad += embed.gradᵀ happens before lm_head's
    reduction is launched (it is done right there, and embed itself is never reduced while tied); (2) the weight
    copy embed <- lm_headᵀ happens after lm_head's all-gather has completed (step() waits for it first).

    Use: after backward, step(do_adam=, lr_factor=, momentum=) (clears the gradients it consumed), and untie()
    right after the step at which embed and lm_head separate. rank and world_size only do the sharding arithmetic;
    the collectives use the default process group (none is needed when world_size is 1).
    """

    def __init__(self, named_params: dict[str, nn.Parameter], param_table: dict[str, dict], scatter_order: Sequence[str],
                 work_order: Sequence[str], *, adam_lr: float, adam_eps: float, adam_wd: float, muon_lr: float,
                 muon_beta2: float, muon_wd: float, rank: int, world_size: int,
                 tied: tuple[str, str] | None = ("lm_head", "embed")):
        self.params = dict(named_params)
        self.table = {label: dict(row) for label, row in param_table.items()}
        self.scatter_order, self.work_order = tuple(scatter_order), tuple(work_order)
        self.adam_lr, self.adam_eps, self.adam_wd = adam_lr, adam_eps, adam_wd
        self.muon_lr, self.muon_beta2, self.muon_wd = muon_lr, muon_beta2, muon_wd
        self.rank, self.world_size = rank, world_size
        self.tied = tuple(tied) if tied is not None else None
        self._validate()
        self._tied_now = self.tied is not None
        self.adam_t = {label: 0 for label, row in self.table.items() if row["optim"] == "adam"}
        self.buffers: dict[str, dict[str, Tensor]] = {}
        self._lr_scales: dict[str, Tensor | float] = {}
        for label, p in self.params.items():
            row = self.table[label]
            local = self._local(label, p.detach())
            if row["optim"] == "adam":
                self.buffers[label] = dict(exp_avg=torch.zeros_like(local, dtype=torch.float32),
                                           exp_avg_sq=torch.zeros_like(local, dtype=torch.float32))
                continue
            n, R, C = local.shape
            moment_shape = (n, R, 1) if R >= C else (n, 1, C)
            self.buffers[label] = dict(
                momentum=torch.zeros_like(local, dtype=torch.float32),
                second_moment=torch.zeros(moment_shape, dtype=torch.float32, device=p.device),
                mantissa=torch.zeros_like(local, dtype=torch.uint16))
            first = self.rank * n if self._is_sharded(label) else 0
            scales = normuon_matrix_lr_scales((R, C), row["lr_mul"], row.get("matrix_lr_muls", (1.0,)),
                                              range(first, first + n))
            # One scale for the whole chunk stays a Python float; mixed ones live on the device in double, so the
            # per-step lr = fp32(scale·(muon_lr·s)) is the same IEEE double product as on the host, with no copy.
            self._lr_scales[label] = (scales[0] if len(set(scales)) == 1 else
                                      torch.tensor(scales, dtype=torch.float64, device=p.device).view(n, 1, 1))

    # ---- validation -------------------------------------------------------------------------------------------
    def _validate(self) -> None:
        for label in self.params:
            if label not in self.table:
                raise ValueError(f"parameter {label!r} has no row in the optimizer table: add it to param_table "
                                 f"(DEFAULT_PARAM_TABLE in train_gpt.py)")
        for label in self.table:
            if label not in self.params:
                raise ValueError(f"param_table row {label!r} names no model parameter (parameters: "
                                 f"{', '.join(self.params)}): remove the row or fix its name")
        for name, order in (("scatter_order", self.scatter_order), ("work_order", self.work_order)):
            for label in order:
                if label not in self.table:
                    raise ValueError(f"{name} names {label!r}, which is not a parameter label: remove it from "
                                     f"--{name}")
                if order.count(label) > 1:
                    raise ValueError(f"{name} lists {label!r} {order.count(label)} times: list every label exactly "
                                     f"once in --{name}")
            missing = [label for label in self.table if label not in order]
            if missing:
                raise ValueError(f"{name} is missing {', '.join(map(repr, missing))}: list every label exactly once "
                                 f"in --{name}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} / world_size {self.world_size} is not a valid process placement")
        for label, row in self.table.items():
            p = self.params[label]
            if row.get("optim") not in ("adam", "normuon"):
                raise ValueError(f"param_table[{label!r}] optim={row.get('optim')!r}: use 'adam' or 'normuon'")
            if row.get("comms") not in ("none", "replicated", "sharded"):
                raise ValueError(f"param_table[{label!r}] comms={row.get('comms')!r}: use 'none', 'replicated' or "
                                 f"'sharded'")
            for key in ("lr_mul", "wd_mul"):
                if not isinstance(row.get(key), (int, float)):
                    raise ValueError(f"param_table[{label!r}] needs a number {key}=")
            if row["optim"] == "adam":
                betas = row.get("betas")
                if betas is None or len(betas) != 2 or not all(0 <= b < 1 for b in betas):
                    raise ValueError(f"param_table[{label!r}] is an Adam row and needs betas=(beta1, beta2) in [0, 1)")
                if row["comms"] == "sharded" and p.shape[0] % self.world_size:
                    raise ValueError(f"{label} has {p.shape[0]} rows in dim 0 of {tuple(p.shape)}, not divisible by "
                                     f"world_size {self.world_size}: set param_table[{label!r}] comms='replicated' "
                                     f"or use a world size that divides {p.shape[0]}")
                continue
            shape = row.get("matrix_shape")
            if shape is None or len(shape) != 2 or p.numel() % (shape[0] * shape[1]) or p.shape[-1] != shape[1]:
                raise ValueError(f"{label} of shape {tuple(p.shape)} cannot be viewed as a stack of "
                                 f"matrix_shape={shape} matrices: fix param_table[{label!r}]['matrix_shape'] "
                                 f"(rows, cols) to match the bank")
            if p.dtype != torch.bfloat16:
                raise ValueError(f"NorMuon parameter {label} is {p.dtype}; its fp32 master is bf16 + a 16-bit "
                                 f"mantissa, so store it in bf16 or make it an Adam row")
            if not row.get("matrix_lr_muls", (1.0,)):
                raise ValueError(f"param_table[{label!r}] matrix_lr_muls is empty: give at least one multiplier")
            n_matrices = p.numel() // (shape[0] * shape[1])
            if row["comms"] == "sharded" and n_matrices % self.world_size:
                fix = ("add padding layers (--mlp_bank_pad)" if label == "mlp" else "change the layer count")
                raise ValueError(f"{label} bank has {n_matrices} matrices, not divisible by world_size "
                                 f"{self.world_size}: {fix} or use a world size that divides {n_matrices}")
        if self.tied is not None:
            head, embed = self.tied
            for label in (head, embed):
                if label not in self.table or self.table[label]["optim"] != "adam":
                    raise ValueError(f"tied=({head!r}, {embed!r}): {label!r} must be an Adam parameter label; "
                                     f"pass tied=None to train them separately")
            if self.params[head].shape != self.params[embed].shape[::-1] or self.params[head].dim() != 2:
                raise ValueError(f"tied {head} {tuple(self.params[head].shape)} is not the transpose of {embed} "
                                 f"{tuple(self.params[embed].shape)}: store {head} as (model_dim, vocab)")

    # ---- layout helpers ---------------------------------------------------------------------------------------
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

    # ---- communication (overridable, e.g. to time the compute alone) -------------------------------------------
    def _launch_reduce(self, label: str, grad: Tensor):
        """Start averaging `grad` over ranks; returns (work or None, the tensor that will hold this rank's slice)."""
        if self._is_replicated(label):
            return dist.all_reduce(grad, op=dist.ReduceOp.AVG, async_op=True), self._bank_view(label, grad)
        if self._is_sharded(label):
            full = self._bank_view(label, grad)
            chunk = full.new_empty((full.shape[0] // self.world_size, *full.shape[1:]))
            return dist.reduce_scatter_tensor(chunk, full, op=dist.ReduceOp.AVG, async_op=True), chunk
        return None, self._bank_view(label, grad)

    def _launch_gather(self, label: str):
        """Start all-gathering this rank's updated slice into the full parameter (in place); None if not sharded."""
        if not self._is_sharded(label):
            return None
        full = self._bank_view(label, self.params[label].detach())
        return dist.all_gather_into_tensor(full, self._local(label, full), async_op=True)

    # ---- the step ---------------------------------------------------------------------------------------------
    @property
    def tied_now(self) -> bool:
        return self._tied_now

    @torch.no_grad()
    def step(self, *, do_adam: bool, lr_factor: float, momentum: float) -> None:
        """Reduce, update and gather every label due this step (NorMuon always, Adam when do_adam), spec §5.2.

        lr_factor: the schedule's factor on every base lr; momentum: NorMuon's momentum for this step. Clears .grad
        of what it consumed; Adam gradients are kept on the other steps so the next backward adds to them.
        """
        due = [label for label in self.scatter_order
               if (do_adam or self.table[label]["optim"] == "normuon") and self._steps_now(label)]
        pending = {}
        for label in due:
            p = self.params[label]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self._tied_now and label == self.tied[0] and self.params[self.tied[1]].grad is not None:
                p.grad.add_(self.params[self.tied[1]].grad.mT)       # tied fold, before lm_head's reduction
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
            step_size, decay = adam_scalars(self.adam_lr * lr_factor * row["lr_mul"], self.adam_t[label], beta1,
                                            beta2, self.adam_wd * row["wd_mul"])
            adam_update(param, grad, buf["exp_avg"], buf["exp_avg_sq"], beta1=beta1, beta2=beta2, eps=self.adam_eps,
                        step_size=step_size, decay=decay)
            return
        lr, wd = normuon_scalars(self.muon_lr, lr_factor, self.muon_wd, row["wd_mul"])
        scale = self._lr_scales[label]
        lr_eff = _fp32(scale * lr) if isinstance(scale, float) else (scale * lr).float()
        normuon_update(param, grad, buf["momentum"], buf["second_moment"], buf["mantissa"], momentum=momentum,
                       beta2=self.muon_beta2, lr=lr_eff, wd=wd,
                       split_final_product=row["matrix_shape"][0] > POLAR_EXPRESS_SPLIT_ROWS)

    # ---- untying and state --------------------------------------------------------------------------------------
    @torch.no_grad()
    def untie(self) -> None:
        """Separate embed from lm_head after the split step (spec §5.11): embed takes lm_head's Adam t, and its
        moments are lm_head's, gathered to the full (D, V), transposed to (V, D) and re-sliced to embed's shard."""
        if not self._tied_now:
            raise ValueError("untie() called twice: embed and lm_head are already separate")
        head, embed = self.tied
        self.adam_t[embed] = self.adam_t[head]
        for name in ("exp_avg", "exp_avg_sq"):
            src = self.buffers[head][name]                                         # (D/W or D, V)
            if self._is_sharded(head):
                full = src.new_empty((src.shape[0] * self.world_size, *src.shape[1:]))
                dist.all_gather_into_tensor(full, src)
            else:
                full = src
            self.buffers[embed][name].copy_(self._local(embed, full.mT))          # (V/W or V, D)
        self._tied_now = False

    def state_dict(self) -> dict:
        """A snapshot (cloned tensors) of this rank's optimizer state: Adam t, every buffer, the tied flag."""
        return dict(tied_now=self._tied_now, rank=self.rank, world_size=self.world_size, adam_t=dict(self.adam_t),
                    buffers={label: {name: t.clone() for name, t in buf.items()}
                             for label, buf in self.buffers.items()})

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        if (sd["rank"], sd["world_size"]) != (self.rank, self.world_size):
            raise ValueError(f"optimizer state was saved by rank {sd['rank']} of {sd['world_size']}, this is rank "
                             f"{self.rank} of {self.world_size}: resume with the same --nproc_per_node")
        if set(sd["buffers"]) != set(self.buffers):
            raise ValueError(f"optimizer state labels {sorted(sd['buffers'])} differ from the table's "
                             f"{sorted(self.buffers)}: load it with the param_table it was saved with")
        for label, buf in self.buffers.items():
            for name, t in buf.items():
                src = sd["buffers"][label][name]
                if src.shape != t.shape or src.dtype != t.dtype:
                    raise ValueError(f"optimizer state {label}.{name} is {tuple(src.shape)} {src.dtype}, expected "
                                     f"{tuple(t.shape)} {t.dtype}: load it with the model config it was saved with")
                t.copy_(src)
        self.adam_t = dict(sd["adam_t"])
        self._tied_now = bool(sd["tied_now"])


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
