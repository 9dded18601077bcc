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
FLT_EPS = torch.finfo(torch.float32).eps  # 2^-23: the eps of every rms() (spec §3.4), F.rms_norm's own fp32 default
GATE_INPUT_DIM = 12                        # every sigmoid gate reads the first 12 channels of its input (spec §3.1)
YARN_ATTN_SCALE_SLOPE = 0.2                # attn_scale *= 1 + slope * ln(new/old) at each long-window change (spec §4)


@dataclass
class ModelConfig:
    """Everything the GPT needs; field names equal the Hyperparameters names where they overlap (see its comments)."""
    vocab_size: int
    model_dim: int
    num_heads: int
    head_dim: int
    mlp_hidden: int
    num_layers: int
    num_value_embeds: int
    attn_layout: str              # one char per layer: P paired heads, N normal, - no attention
    long_window_layers: tuple     # layers using the long window (normal ones also get the key offset)
    ve_layout: tuple              # per layer: value-embedding table index, or -1
    skip_source_layer: int
    skip_dest_layer: int
    backout_layer: int
    mlp_bank_pad: int             # unused MLP slices at the end of the bank (for even sharding)
    block_size: int               # tokens per window block
    rope_base: float
    attn_scale: float             # softmax scale after reset_rotary()
    yarn_alpha: float
    yarn_beta: float
    softcap: tuple                # (A, B, C): z = A * sigmoid((logit + B) / C)
    fp8_scales: tuple             # (s_x, s_w, s_g) of the FP8 LM head
    use_fp8: bool                 # FP8 LM head in training (CUDA: the custom op; CPU: its plain-PyTorch emulation)
    attn_backend: str             # resolved backend name, passed through to varlen_attention
    rotary_max_len: int           # packed positions the rotary tables cover: max(train, val) micro-batch tokens

    def validate(self) -> None:
        """Raise ValueError naming the option to change for layouts the model cannot build."""
        L = self.num_layers
        if self.num_heads * self.head_dim != self.model_dim:
            raise ValueError(f"num_heads * head_dim = {self.num_heads * self.head_dim} must equal model_dim = "
                             f"{self.model_dim}; change --num_heads, --head_dim or --model_dim")
        if self.head_dim % 4 or self.model_dim < GATE_INPUT_DIM:
            raise ValueError(f"--head_dim={self.head_dim} must be a multiple of 4 (rotary pairs on its first half) "
                             f"and --model_dim >= {GATE_INPUT_DIM} (gate inputs)")
        if len(self.attn_layout) != L or set(self.attn_layout) - set("PN-"):
            raise ValueError(f"--attn_layout={self.attn_layout!r} needs one of P, N, - per layer ({L} layers)")
        if "P" in self.attn_layout and self.num_heads % 2:
            raise ValueError(f"paired-head layers need an even --num_heads (got {self.num_heads}); "
                             "or remove P from --attn_layout")
        if len(self.ve_layout) != L or any(not -1 <= j < self.num_value_embeds for j in self.ve_layout):
            raise ValueError(f"--ve_layout={self.ve_layout} needs one entry per layer ({L}), each -1 or a table "
                             f"index below --num_value_embeds={self.num_value_embeds}")
        if any(j >= 0 and self.attn_layout[i] == "-" for i, j in enumerate(self.ve_layout)):
            raise ValueError("--ve_layout puts a value embedding on a layer without attention (- in --attn_layout)")
        if any(not 0 <= i < L for i in self.long_window_layers):
            raise ValueError(f"--long_window_layers={self.long_window_layers} must be layer indices below {L}")
        if not 0 <= self.skip_source_layer < self.skip_dest_layer < L or not 0 <= self.backout_layer < L:
            raise ValueError("need 0 <= --skip_source_layer < --skip_dest_layer < num_layers and "
                             "0 <= --backout_layer < num_layers")
        if tuple(self.softcap) != (tk.SOFTCAP_A, tk.SOFTCAP_B, tk.SOFTCAP_C):
            raise ValueError(f"--softcap={self.softcap} differs from the fused loss kernel's constants in "
                             "triton_kernels.py (SOFTCAP_A/B/C); change both together")
        if self.rotary_max_len < 1:
            raise ValueError("rotary_max_len must be the largest micro-batch in tokens (train or val)")


@dataclass(frozen=True)
class LayerPlan:
    """One layer's wiring, derived from the ModelConfig layout once (forward never names a layer index)."""
    index: int
    attn: str            # "P" paired heads, "N" normal, "" none
    attn_slot: int       # slice of the attn bank and attn_gate_bank (-1: no attention)
    long_window: bool
    key_offset: bool     # normal long-window layers only (the paired path never shifts keys)
    ve_table: int        # value-embedding table (-1: none)
    ve_slot: int         # slice of ve_gate_bank (-1: none)


def rms(x: Tensor) -> Tensor:
    """x / sqrt(mean(x^2) + 2^-23) over the last dim, no gain; fp32 statistics, result in x's dtype."""
    return F.rms_norm(x, (x.shape[-1],), eps=FLT_EPS)


def rotary_base_omega(head_dim: int, base: float, device: torch.device) -> Tensor:
    """(head_dim,) fp32 angular frequencies: [f0, f0, f1, f1, ..., 0 x head_dim/2], f_j = (1/base)^(j/(n-1)).

    Half-truncated RoPE: n = head_dim/4 frequencies on adjacent pairs of the first half; the second half is stationary.
    """
    n = head_dim // 4
    freqs = (1.0 / base) ** torch.linspace(0, 1, n, dtype=torch.float32, device=device)
    return torch.cat([freqs.repeat_interleave(2), freqs.new_zeros(head_dim // 2)])


def rotary_tables(omega: Tensor, num_positions: int) -> tuple[Tensor, Tensor]:
    """bf16 (num_positions, head_dim/2) cos and sign-flipped sin of theta = p * omega (fp32) for the rotating half.

    The odd columns of sin are negated so that apply_rotary is x*cos + pairswap(x)*sin (clockwise rotation).
    The stationary half (omega = 0: cos 1, sin 0) is left out; apply_rotary passes it through unchanged.
    """
    half = omega.shape[0] // 2
    theta = torch.outer(torch.arange(num_positions, dtype=torch.float32, device=omega.device), omega[:half])
    cos, sin = theta.cos().bfloat16(), theta.sin().bfloat16()
    sin[:, 1::2] *= -1
    return cos, sin


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate adjacent pairs (2m, 2m+1) of x's first half clockwise; cos/sin broadcast to x[..., :head_dim/2].

    out[2m] = cos*x[2m] + sin*x[2m+1];  out[2m+1] = cos*x[2m+1] - sin*x[2m]   (the minus lives in the sin table).
    """
    half = x.shape[-1] // 2
    x_rot, x_pass = x[..., :half], x[..., half:]
    x_swapped = x_rot.unflatten(-1, (half // 2, 2)).flip(-1).flatten(-2)
    return torch.cat([x_rot * cos + x_swapped * sin, x_pass], dim=-1)


def shift_keys_by_one(k: Tensor) -> Tensor:
    """Key offset: the second quarter of each half of every head (dims [hd/4, hd/2), [3hd/4, hd)) takes the values of
    the previous packed position (position 0 keeps its own; document boundaries are ignored). k (T, H, hd)."""
    T, H, hd = k.shape
    k_prev = torch.cat([k[:1], k[:-1]], dim=0)
    quarters_now = k.view(T, H, 2, 2, hd // 4)
    quarters_prev = k_prev.view(T, H, 2, 2, hd // 4)
    return torch.stack([quarters_now[:, :, :, 0], quarters_prev[:, :, :, 1]], dim=3).view(T, H, hd)


# ---- FP8 LM head (spec §3.8) ----------------------------------------------------------------------------------------

def fp8_quantize(x: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
    """Saturating cast of x/scale (computed in fp32) to an FP8 dtype: overflow clamps to +-max, not NaN."""
    limit = torch.finfo(dtype).max  # 448 for e4m3fn, 57344 for e5m2
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def fp8_scale_product(a: float, b: float) -> float:
    """The fp32 product of two scales, as torch._scaled_mm forms scale_a * scale_b."""
    return float(torch.tensor(a, dtype=torch.float32) * torch.tensor(b, dtype=torch.float32))


class FP8HeadEmulated(torch.autograd.Function):
    """Plain-PyTorch FP8 LM head: the custom op's math with dequantised fp32 matmuls (CPU path and GPU test reference).

    h (T, D) bf16, w (D, V) bf16 -> logits (T, V) bf16; saves only the quantised X8, W8 like the op.
    """

    @staticmethod
    def forward(ctx, h: Tensor, w: Tensor, s_x: float, s_w: float, s_g: float) -> Tensor:
        x8, w8 = fp8_quantize(h, s_x, torch.float8_e4m3fn), fp8_quantize(w, s_w, torch.float8_e4m3fn)
        ctx.save_for_backward(x8, w8)
        ctx.scales = (s_x, s_w, s_g)
        return (x8.float() @ w8.float() * fp8_scale_product(s_x, s_w)).bfloat16()

    @staticmethod
    def backward(ctx, grad: Tensor):
        x8, w8 = ctx.saved_tensors
        s_x, s_w, s_g = ctx.scales
        g8 = fp8_quantize(grad, s_g, torch.float8_e5m2).float()
        dh = (g8 @ w8.float().T * fp8_scale_product(s_g, s_w)).bfloat16()
        dw = x8.float().T @ g8 * fp8_scale_product(s_x, s_g)  # fp32; autograd casts it to the bf16 parameter
        return dh, dw, None, None, None


# One compiled quantiser per role (distinct code objects, so each keeps its own small compile cache): each reads its
# input once and writes the FP8 tensor in both layouts torch._scaled_mm needs (K-major for both operands).
def _quantize_act(h: Tensor, s: float) -> tuple[Tensor, Tensor]:
    q = fp8_quantize(h, s, torch.float8_e4m3fn)
    return q, q.t().contiguous()


def _quantize_weight(w: Tensor, s: float) -> tuple[Tensor, Tensor]:
    q = fp8_quantize(w, s, torch.float8_e4m3fn)
    return q, q.t().contiguous()


def _quantize_grad(g: Tensor, s: float) -> tuple[Tensor, Tensor]:
    q = fp8_quantize(g, s, torch.float8_e5m2)
    return q, q.t().contiguous()


_FP8_QUANTIZERS: dict[str, Callable] = {}


def _fp8_quantizer(fn: Callable, x: Tensor) -> Callable:
    """fn compiled on first CUDA use (the op's body is opaque to the model's compile, and eager would make 4 passes
    over a (T, V) gradient); eager on other devices, where the op only runs in tests."""
    if not x.is_cuda:
        return fn
    if fn.__name__ not in _FP8_QUANTIZERS:
        _FP8_QUANTIZERS[fn.__name__] = torch.compile(fn, dynamic=False, fullgraph=True)
    return _FP8_QUANTIZERS[fn.__name__]


def _fp8_head_forward_impl(h: Tensor, w: Tensor, s_x: float, s_w: float, s_g: float) -> tuple[Tensor, Tensor, Tensor]:
    """logits (T, V) bf16 = (s_x*s_w) e4m3(h/s_x) @ e4m3(w/s_w), fast accumulation; also X8^T (D, T), W8 (D, V)."""
    x8, x8_t = _fp8_quantizer(_quantize_act, h)(h, s_x)
    w8, w8_t = _fp8_quantizer(_quantize_weight, w)(w, s_w)
    one = dict(dtype=torch.float32, device=h.device)
    logits = torch._scaled_mm(x8, w8_t.t(), scale_a=torch.full((), s_x, **one), scale_b=torch.full((), s_w, **one),
                              out_dtype=torch.bfloat16, use_fast_accum=True)
    return logits, x8_t, w8


def _fp8_head_backward_impl(grad: Tensor, x8_t: Tensor, w8: Tensor, s_x: float, s_w: float,
                            s_g: float) -> tuple[Tensor, Tensor]:
    """dh (T, D) bf16 = (s_g*s_w) G8 @ W8^T; dW (D, V) fp32 = (s_x*s_g) X8^T @ G8; G8 = e5m2(G/s_g); no fast accum."""
    g8, g8_t = _fp8_quantizer(_quantize_grad, grad)(grad.contiguous(), s_g)
    one = dict(dtype=torch.float32, device=grad.device)
    sx, sw, sg = (torch.full((), s, **one) for s in (s_x, s_w, s_g))
    dh = torch._scaled_mm(g8, w8.t(), scale_a=sg, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=False)
    dw = torch._scaled_mm(x8_t, g8_t.t(), scale_a=sx, scale_b=sg, out_dtype=torch.float32, use_fast_accum=False)
    return dh, dw


def register_fp8_head_op() -> None:
    """Register torch.ops.nanogpt.fp8_head (+ _backward) once per process; later calls (or a second copy of this
    module, e.g. __main__ and train_gpt) reuse the registered op."""
    if hasattr(torch.ops.nanogpt, "fp8_head"):
        return
    fwd = torch.library.custom_op("nanogpt::fp8_head", mutates_args=())(_fp8_head_forward_impl)
    bwd = torch.library.custom_op("nanogpt::fp8_head_backward", mutates_args=())(_fp8_head_backward_impl)

    @fwd.register_fake
    def _(h, w, s_x, s_w, s_g):
        T, D, V = h.shape[0], h.shape[1], w.shape[1]
        return (h.new_empty(T, V), h.new_empty(D, T, dtype=torch.float8_e4m3fn),
                w.new_empty(D, V, dtype=torch.float8_e4m3fn))

    @bwd.register_fake
    def _(grad, x8_t, w8, s_x, s_w, s_g):
        return grad.new_empty(x8_t.shape[1], x8_t.shape[0]), w8.new_empty(w8.shape, dtype=torch.float32)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output[1], output[2])
        ctx.scales = inputs[2:]

    def backward(ctx, grad_logits, _grad_x8, _grad_w8):
        x8_t, w8 = ctx.saved_tensors
        dh, dw = torch.ops.nanogpt.fp8_head_backward(grad_logits, x8_t, w8, *ctx.scales)
        return dh, dw, None, None, None  # dw is fp32; autograd casts it to the bf16 parameter's dtype

    fwd.register_autograd(backward, setup_context=setup_context)


def fp8_head(h: Tensor, w: Tensor, s_x: float, s_w: float, s_g: float) -> Tensor:
    """FP8 LM head logits (T, V) bf16: the custom op on CUDA (register_fp8_head_op() first), the emulation elsewhere."""
    if h.is_cuda:
        return torch.ops.nanogpt.fp8_head(h, w, s_x, s_w, s_g)[0]
    return FP8HeadEmulated.apply(h, w, s_x, s_w, s_g)


# ---- GPT ------------------------------------------------------------------------------------------------------------

class GPT(nn.Module):
    """The RECORD61 GPT (spec §3-4), parameters in 13 labelled tensors (banks), layer wiring from the ModelConfig.

    Rotary state (omega, bf16 tables, attn_scale) is one object shared by normal and paired layers: the spec's two
    rotary objects always receive the same resets and YaRN updates, so they always hold the same values. The tables
    cover 2 * rotary_max_len angle positions: normal layers read rows [0, T), paired layers read rows 2t and 2t+1
    for token t, i.e. rows [0, 2T) viewed as (T, 2, head_dim/2).
    """

    def __init__(self, cfg: ModelConfig, device: torch.device):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        D, H, L, hd, V = cfg.model_dim, cfg.num_heads, cfg.num_layers, cfg.head_dim, cfg.vocab_size
        self.plan = self._layer_plan(cfg)
        n_attn = sum(p.attn != "" for p in self.plan)
        n_ve = sum(p.ve_slot >= 0 for p in self.plan)

        def param(t: Tensor) -> nn.Parameter:
            return nn.Parameter(t)

        # Banks: attn slice i = [W_q; W_k; W_v; W_o] (4D, D) of the i-th attention layer; mlp slice j = [c_fc, c_proj]
        # (2, hidden, D) of layer j (pad slices unused). Built in fp32 on `device`, then cast to bf16 (spec §3.1).
        attn = torch.zeros(n_attn, 4 * D, D, device=device)
        bound = math.sqrt(3) * D ** -0.5
        attn[:, : 3 * D].uniform_(-bound, bound)                     # QKV; the O rows stay zero
        mlp = torch.zeros(L + cfg.mlp_bank_pad, 2, cfg.mlp_hidden, D, device=device)
        mlp[:, 0].uniform_(-0.5 * bound, 0.5 * bound)                # c_fc; c_proj stays zero
        lm_head = torch.empty(D, V, dtype=torch.bfloat16, device=device).normal_(0.0, 0.005)  # drawn into bf16
        scalars = torch.cat([
            torch.full((L,), 1.1),                                   # residual lambdas r_i
            torch.tensor([0.5, 1.0]).repeat(L),                      # SA lambdas (qkv, o) per layer
            torch.tensor([0.0, 0.5, -1.5]),                          # smear, backout, skip lambdas
        ]).to(device)
        gate = dict(dtype=torch.bfloat16, device=device)
        self.attn = param(attn.bfloat16())
        self.mlp = param(mlp.bfloat16())
        self.lm_head = param(lm_head)                                # (D, V): stored transposed, logits = h @ lm_head
        self.embed = param(lm_head.T.contiguous())                   # tied copy until the optimizer splits them
        self.ve_names = tuple(f"ve{j}" for j in range(cfg.num_value_embeds))
        for name in self.ve_names:
            self.register_parameter(name, param(torch.zeros(V, D, **gate)))
        self.attn_gate_bank = param(torch.zeros(n_attn, H, GATE_INPUT_DIM, **gate))
        self.ve_gate_bank = param(torch.zeros(n_ve, H, GATE_INPUT_DIM, **gate))
        self.smear_gate = param(torch.zeros(1, GATE_INPUT_DIM, **gate))
        self.skip_gate = param(torch.zeros(1, GATE_INPUT_DIM, **gate))
        self.x0_lambdas = param(torch.zeros(L, device=device))
        self.scalars = param(scalars)  # (3L+3,) fp32; the reference's sharding padding is dropped (vestigial)

        self.register_buffer("rotary_omega", torch.zeros(hd, device=device), persistent=False)
        self.register_buffer("rotary_cos", torch.empty(2 * cfg.rotary_max_len, hd // 2, **gate), persistent=False)
        self.register_buffer("rotary_sin", torch.empty(2 * cfg.rotary_max_len, hd // 2, **gate), persistent=False)
        self.attn_scale = cfg.attn_scale
        self.reset_rotary()
        if cfg.use_fp8:
            register_fp8_head_op()

    @staticmethod
    def _layer_plan(cfg: ModelConfig) -> tuple[LayerPlan, ...]:
        plan, attn_slot, ve_slot = [], 0, 0
        for i, kind in enumerate(cfg.attn_layout):
            has_attn, has_ve = kind != "-", cfg.ve_layout[i] >= 0
            long_window = has_attn and i in cfg.long_window_layers
            plan.append(LayerPlan(index=i, attn=kind if has_attn else "", attn_slot=attn_slot if has_attn else -1,
                                  long_window=long_window, key_offset=long_window and kind == "N",
                                  ve_table=cfg.ve_layout[i], ve_slot=ve_slot if has_ve else -1))
            attn_slot += has_attn
            ve_slot += has_ve
        return tuple(plan)

    def labelled_params(self) -> dict[str, nn.Parameter]:
        names = ("attn", "mlp", "lm_head", "embed", *self.ve_names, "attn_gate_bank", "ve_gate_bank", "smear_gate",
                 "skip_gate", "x0_lambdas", "scalars")
        return {name: getattr(self, name) for name in names}

    # ---- rotary state (spec §4) ----

    @torch.no_grad()
    def reset_rotary(self) -> None:
        """Base frequencies, rebuilt tables, attn_scale back to its initial value (at construction and after warmup)."""
        self.rotary_omega.copy_(rotary_base_omega(self.cfg.head_dim, self.cfg.rope_base, self.rotary_omega.device))
        self._rebuild_rotary_tables()
        self.attn_scale = self.cfg.attn_scale

    @torch.no_grad()
    def apply_yarn(self, old_ws_long: int, new_ws_long: int) -> None:
        """YaRN for a long window going old -> new (blocks): frequencies turning fewer than alpha times over the old
        window are scaled by old/new, those turning beta+ times are kept, a linear ramp between; compounds."""
        cfg, omega = self.cfg, self.rotary_omega
        ratio = old_ws_long / new_ws_long
        turns = (cfg.block_size * old_ws_long) * omega / (2 * math.pi)
        ramp = ((turns - cfg.yarn_alpha) / (cfg.yarn_beta - cfg.yarn_alpha)).clamp(0, 1)
        omega.mul_(ratio + ramp * (1 - ratio))
        self._rebuild_rotary_tables()
        self.attn_scale *= 1 + YARN_ATTN_SCALE_SLOPE * math.log(new_ws_long / old_ws_long)

    def _rebuild_rotary_tables(self) -> None:
        cos, sin = rotary_tables(self.rotary_omega, self.rotary_cos.shape[0])
        self.rotary_cos.copy_(cos)  # in place: compiled graphs keep reading the same buffers
        self.rotary_sin.copy_(sin)

    # ---- forward (spec §3.4-3.10) ----

    def forward(self, inputs: Tensor, targets: Tensor, cu_seqlens: Tensor, ws_short: int, ws_long: int,
                mtp_weights: Tensor, max_seqlen: int) -> Tensor:
        """inputs (T,) int32, targets (T,) int64. Training: the summed MTP loss (fp32 scalar); eval: mean CE."""
        h = self.final_hidden(inputs, cu_seqlens, ws_short, ws_long, max_seqlen)  # (T, D) bf16
        if self.training:
            if self.cfg.use_fp8:
                logits = fp8_head(h, self.lm_head, *self.cfg.fp8_scales)
            else:
                logits = h @ self.lm_head
            return tk.softcapped_mtp_ce(logits, targets, mtp_weights).sum()
        # Mean next-token CE of the softcapped bf16-head logits (spec §3.10), through the fused kernel with the single
        # weight 1: it softcaps in fp32 (as the reference's compiled eval does) and never materialises fp32 (T, V)
        # tensors, which at 262,144 val tokens per rank would not fit next to the 26 GB of bf16 logits.
        next_token_only = torch.ones(1, dtype=torch.float32, device=h.device)
        return tk.softcapped_mtp_ce(h @ self.lm_head, targets, next_token_only).mean()

    def final_hidden(self, inputs: Tensor, cu_seqlens: Tensor, ws_short: int, ws_long: int,
                     max_seqlen: int) -> Tensor:
        """The normed final residual h (T, D) bf16 that the LM head reads."""
        cfg, T = self.cfg, inputs.shape[0]
        if T > cfg.rotary_max_len:
            raise ValueError(f"micro-batch of {T} tokens exceeds rotary_max_len={cfg.rotary_max_len}; build the model "
                             "with rotary_max_len = the largest train/val micro-batch")
        L = cfg.num_layers
        resid_lambdas, sa_lambdas = self.scalars[:L], self.scalars[L: 3 * L].view(L, 2)
        smear_lambda, backout_lambda, skip_lambda = self.scalars[3 * L: 3 * L + 3].unbind()
        ve = [F.embedding(inputs, getattr(self, name)) for name in self.ve_names]  # (T, D) bf16 each

        # Token smear: e'_t = e_t + smear_lambda * sigmoid(e_t[:12] . w) * e_{t-1}, across document boundaries.
        e = F.embedding(inputs, self.embed)                                              # (T, D) bf16
        smear = smear_lambda * torch.sigmoid(e[1:, :GATE_INPUT_DIM] @ self.smear_gate.T)  # (T-1, 1) bf16
        x = x0 = rms(torch.cat([e[:1], e[1:] + smear * e[:-1]]))

        skip_saved = backout_saved = None
        for p in self.plan:
            i = p.index
            if i == cfg.skip_dest_layer:  # U-net skip, added before the lambda mix, per-token gate
                skip_scale = torch.sigmoid(skip_lambda) * 2                               # fp32 0-d
                x = x + skip_scale * torch.sigmoid(x0[:, :GATE_INPUT_DIM] @ self.skip_gate.T) * skip_saved
            if i == 0:  # the first layer, where x is still x0: one scale (r_0 + x0_lambda_0), summed in fp32
                x = (resid_lambdas[0] + self.x0_lambdas[0]) * x
            else:
                x = resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            if p.attn:
                window = (ws_long if p.long_window else ws_short) * cfg.block_size          # tokens
                x = x + self.attention(p, rms(x), ve[p.ve_table] if p.ve_table >= 0 else None, sa_lambdas[i],
                                       cu_seqlens, max_seqlen, window)
            x = x + tk.relu2_mlp(rms(x), self.mlp[i, 0], self.mlp[i, 1])
            if i == cfg.skip_source_layer:
                skip_saved = x
            if i == cfg.backout_layer:
                backout_saved = x
        x = x - backout_lambda * backout_saved
        return rms(x)

    def attention(self, p: LayerPlan, u: Tensor, ve: Tensor | None, sa_lambda: Tensor, cu_seqlens: Tensor,
                  max_seqlen: int, window: int) -> Tensor:
        """One attention sublayer (spec §3.5, paired heads §3.6). u = rms(x) (T, D) bf16 -> (T, D) bf16."""
        cfg = self.cfg
        T, D, H, hd = u.shape[0], cfg.model_dim, cfg.num_heads, cfg.head_dim
        bank = self.attn[p.attn_slot]                                    # (4D, D): [W_q; W_k; W_v; W_o]
        lambda_qkv, lambda_o = sa_lambda.unbind()
        qkv = u @ (lambda_qkv * bank[: 3 * D]).T                         # weights scaled and rounded to bf16 first
        q, k, v = qkv.view(T, 3, H, hd).unbind(1)                        # (T, H, hd) each
        q, k = rms(q), rms(k)                                            # QK-norm per head
        gate_in = u[:, :GATE_INPUT_DIM]
        if p.attn == "P":
            # Heads 2b, 2b+1 rotate at angle positions 2t, 2t+1: table rows [0, 2T) viewed as (T, 1, 2, hd/2).
            cos = self.rotary_cos[: 2 * T].view(T, 1, 2, hd // 2)
            sin = self.rotary_sin[: 2 * T].view(T, 1, 2, hd // 2)
            q = apply_rotary(q.view(T, H // 2, 2, hd), cos, sin).view(T, H, hd)
            k = apply_rotary(k.view(T, H // 2, 2, hd), cos, sin).view(T, H, hd)
        else:
            cos, sin = self.rotary_cos[:T, None], self.rotary_sin[:T, None]  # (T, 1, hd/2): angle = packed position
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            if p.key_offset:
                k = shift_keys_by_one(k)
        if ve is not None:
            # Elementwise per (token, head), so adding it before the paired interleave equals adding it after.
            ve_gate = 2 * torch.sigmoid(gate_in @ self.ve_gate_bank[p.ve_slot].T)  # (T, H)
            v = v + ve_gate[..., None] * ve.view(T, H, hd)
        if p.attn == "P":
            # Row-major reinterpretation as 2T positions of H/2 heads: position 2t slot g = head g of token t,
            # position 2t+1 slot g = head g + H/2. Lengths, offsets and the window are in doubled positions.
            q, k, v = (t.reshape(2 * T, H // 2, hd) for t in (q, k, v))
            y = varlen_attention(q, k, v, cu_seqlens * 2, max_seqlen * 2, window, self.attn_scale, cfg.attn_backend)
            y = y.reshape(T, H, hd)
        else:
            y = varlen_attention(q, k, v.contiguous(), cu_seqlens, max_seqlen, window, self.attn_scale,
                                 cfg.attn_backend)
        y = y * torch.sigmoid(gate_in @ self.attn_gate_bank[p.attn_slot].T)[..., None]  # per-head output gate
        return y.reshape(T, D) @ (lambda_o * bank[3 * D:]).T


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
