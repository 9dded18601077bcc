"""NanoGPT speedrun trainer: a GPT-2-small-class model trained on FineWeb to 3.28 validation loss.

Run on one node with `./run.sh` (torchrun over the GPUs found);
`python train_gpt.py --preset=tiny ...` runs on a CPU.
The training math is that of record 61 of the modded-nanogpt speedrun (README, Provenance).
Sections, in reading order:
    1. hyperparameters   2. attention backends   3. model   4. optimizer   5. data   6. schedules
    7. configuration checks, preflight, logging, checkpoints   8. training and main()
The fused kernels live in triton_kernels.py (imported as tk): each public op there runs its Triton
kernel on CUDA tensors and its plain-PyTorch reference elsewhere, so this file never branches on
the device for them.
Nothing happens at import: process groups, CUDA work, file reads and compiles all start in main().

Where to change what:
    an option's default          Hyperparameters (section 1); any field is also --name=value on
                                 the command line
    schedule (batch, lr peak, windows, MTP weights per stage)   the `stages` table (section 1); how
                                 a row becomes a step's values: the pure functions of section 6
                                 (lr cooldown, momentum there too)
    layer layout                 attn_layout, long_window_layers, ve_layout, skip/backout layers
                                 (section 1 fields); the banks pad themselves to shard on 8 GPUs
    the forward pass             GPT.final_hidden and GPT.attention (section 3)
    the activation (ReLU^2)      triton_kernels.py relu2_mlp_reference, run with --kernels=torch
                                 (the default fused Triton kernel hard-codes ReLU^2: port the edit
                                 there to keep its speed)
    the loss (softcapped MTP CE) triton_kernels.py softcap (its constants) and
                                 softcapped_mtp_ce_reference, run with --kernels=torch (the fused
                                 kernels and the CPU path compute the same closed form)
    a new parameter              register it in GPT.__init__ and use it in the forward pass; give it
                                 a row in DEFAULT_PARAM_TABLE (section 1), whose order is the order
                                 of the gradient reductions
    optimizer math               the pure functions at the top of section 4 (the element-wise steps
                                 are triton_kernels.py adam_update_reference,
                                 normuon_momentum_reference, polar_split_product_reference);
                                 --kernels=torch runs them as written on a GPU too, where the
                                 default runs fused kernels of the same math
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import glob
import math
import os
import re
import sys
import textwrap
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

# ==================================================================================================
# 1. Hyperparameters
# ==================================================================================================

# The per-parameter optimizer table, one row per model parameter (GPT's attribute names). optim:
# "adam" | "normuon"; comms: "none" | "replicated" | "sharded"; betas are Adam's (beta1, beta2). A
# NorMuon bank is a stack of matrices of the shapes the model gives (GPT.bank_matrix_shapes);
# matrix_lr_muls cycles over a matrix's index in that stack (c_fc and c_proj alternate in the MLP
# bank, so c_proj gets 2x).
# The row order is the order in which the gradient reductions are launched: the big banks first, so
# their reduce-scatters start earliest. The order of the updates is derived from the rows
# (NorMuonAndAdam.update_order).
DEFAULT_PARAM_TABLE: dict[str, dict[str, Any]] = {
    "attn":           dict(optim="normuon", comms="sharded",    lr_mul=1.0,  wd_mul=1.0),
    "mlp":            dict(optim="normuon", comms="sharded",    lr_mul=1.0,  wd_mul=1.0,   matrix_lr_muls=(1.0, 2.0)),
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


@dataclass(frozen=True)
class Stage:
    """One row of the schedule table: the scheduled steps are split evenly between the stages, in
    order."""
    batch: int             # global tokens per step
    lr_peak: float         # lr factor before the cooldown (from the
                           # step after the stage starts; see lr_factor)
    ws_long: int           # long attention window in blocks; the
                           # short one is half of it, rounded down
    mtp_weights: tuple     # multi-token-prediction weights of the next 1, 2, ... tokens; the last
                           # of several fades linearly to 0 over the stage


@dataclass
class Hyperparameters:
    # ---- data ----
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"  # glob of training shards,
                                                              # read once in sorted order
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"      # glob of validation shards
    val_tokens: int = 10_485_760           # tokens scored per validation (the
                                           # fixed prefix of the val stream)
    val_batch_size: int = 2_097_152        # global val tokens per val step (4*64*1024*8)
    train_max_seq_len: int = 2048          # training documents are cut to this many tokens
    tokens_per_doc_bound: int = 300        # cu_seqlens holds ceil128(N / this)
                                           # entries; lower it for short-doc data
    batch_slices: int = 8                  # the global batch is cut into this many
                                           # micro-batches (world_size * accum)
    # ---- steps and schedules ----
    stages: tuple = (                      # the schedule table, one Stage per
                                           # row (batch, lr peak, windows, MTP)
        Stage(batch=131_072, lr_peak=1.0, ws_long=3, mtp_weights=(1.0, 0.5, 0.25)),
        Stage(batch=262_144, lr_peak=1.52, ws_long=7, mtp_weights=(1.0, 0.5)),
        Stage(batch=393_216, lr_peak=1.73, ws_long=11, mtp_weights=(1.0,)),
    )
                                           # on the command line: batch:lr_peak:ws_long:w1/w2/...
                                           # per stage, comma-separated
    num_scheduled_iterations: int = 1725   # steps of the lr / batch / window schedule
    num_extension_iterations: int = 40     # extra steps at the final lr with the extended window
    cooldown_frac: float = 0.5             # fraction of scheduled steps spent decaying lr to lr_min
    lr_min: float = 0.1                    # lr factor at the end of cooldown
                                           # and during the extension
    split_frac: float = 2 / 3              # untie embed / lm_head after step
                                           # ceil(frac * scheduled) | 1
    momentum_min: float = 0.85             # NorMuon momentum at step 0 ...
    momentum_max: float = 0.95             # ... rising linearly to this ...
    momentum_warmup_steps: int = 300       # ... over this many steps,
    momentum_cooldown_steps: int = 50      # and falling by (max - min)
                                           # over the last this-many steps
    val_loss_every: int = 250              # validate every this many steps (0: only at the end)
    val_loss_target: float = 3.28          # the final summary line says
                                           # whether the run reached this loss
    train_loss_every: int = 0              # end every this-many-th step line with the step's train
                                           # loss (its weighted multi-token loss per token, averaged
                                           # over ranks): one sync each; 0: never
    dry_run: bool = False                  # run every check that comes before compiling
                                           # (options, environment, data, memory, output
                                           # folders), print them as a checklist, and exit
    # ---- attention windows (in blocks of block_size tokens) ----
    block_size: int = 128                  # tokens per window block
    ws_long_extension: int = 13            # long window during the extension steps
    ws_long_final_val: int = 20            # long window for the final validation (no YaRN update)
    # ---- model ----
    vocab_size: int = 50304                # 50257 GPT-2 ids padded to a multiple of 128
    model_dim: int = 768                   # residual width = num_heads * head_dim
    num_heads: int = 6                     # attention heads per layer (paired
                                           # layers need an even count)
    head_dim: int = 128                    # channels per head (a multiple of 4: rotary pairs on
                                           # its first half)
    mlp_hidden: int = 3072                 # MLP hidden width
    num_layers: int = 11                   # transformer layers (the layouts
                                           # below have one entry per layer)
    num_value_embeds: int = 3              # value-embedding tables (vocab x model_dim each)
    # layer layout, as data: per-layer attention kind (P paired heads, N normal, - none), which
    # layers use the long window (these also get the key offset), which value-embedding table each
    # layer adds (-1 none)
    attn_layout: str = "PNPNNP-NNPN"
    long_window_layers: tuple = (3, 10)
    ve_layout: tuple = (1, 2, -1, -1, -1, -1, -1, -1, 0, 1, 2)
    skip_source_layer: int = 3             # its output is added (gated) to
                                           # the input of skip_dest_layer
    skip_dest_layer: int = 6               # the layer whose input receives the skip
    backout_layer: int = 7                 # backout_lambda * its output is
                                           # subtracted after the last layer
    rope_base: float = 1024.0              # frequencies (1/base)^(j/(n-1))
                                           # on the rotated half of each head
    attn_scale: float = 0.1                # softmax scale at the start (YaRN
                                           # grows it at window changes)
    yarn_alpha: float = 1.0                # YaRN: frequencies turning fewer than
                                           # alpha times over the old window
    yarn_beta: float = 32.0                # are stretched fully, beta+ times
                                           # not at all, a linear ramp between
    fp8_scales: tuple = (100 / 448, 1.6 / 448, 0.75 / 448)  # x, w, grad scales of the FP8 LM head
    use_fp8: bool = True                   # FP8 LM head in training (CUDA
                                           # only; the CPU emulates it)
    dtype: str = "bfloat16"                # weights and activations; float32 / float64 (CPU,
                                           # --use_fp8=false) run the same math without bf16
                                           # rounding, for exact cross-checks of code paths
    # ---- optimizer ----
    adam_lr: float = 0.008                 # Adam base lr (times the table's
                                           # lr_mul and the schedule's factor)
    adam_eps: float = 1e-10                # Adam epsilon (not bias corrected)
    adam_wd: float = 0.005                 # Adam cautious weight decay (times
                                           # the table's wd_mul), decay = lr^2 * wd
    muon_lr: float = 0.023                 # NorMuon base lr for the matrix banks
    muon_beta2: float = 0.95               # NorMuon second-moment decay
                                           # of the variance normalisation
    muon_wd: float = 1.2                   # NorMuon cautious weight decay
                                           # (times the table's wd_mul)
    param_table: dict = field(             # optimizer row per label
        default_factory=lambda: copy.deepcopy(DEFAULT_PARAM_TABLE))
    # ---- system ----
    preset: str = ""                       # "tiny": a few narrow layers for CPU tests and newcomers
    attn_backend: str = "auto"             # auto | triton | flex | varlen | fa3 | fa4 | sdpa
    compile: bool = True                   # torch.compile the model (ignored on CPU)
    compile_cache: str = "~/.cache/nanogpt_speedrun/compile_cache.bin"  # the compiled code,
                                           # saved after a warmup that compiled and loaded at start
                                           # when made by the same code, torch, triton and GPU
                                           # model: copy it to a new node to skip most compiling
                                           # (README); empty: off
    kernels: str = "fused"                 # fused: the Triton kernels on CUDA (on a
                                           # CPU, a chunked loss); torch: the plain-PyTorch
                                           # definitions of every fused op, on any device
                                           # (compiled with the model on a GPU), so an edit
                                           # to them takes effect (README: Tweaking)
    warmup: bool = True                    # compile every schedule variant before the clock starts
    compile_split: bool = True             # each GPU's processes first compile their share of
                                           # the variants alone; the warmup then loads the rest
                                           # from torch's on-disk caches, shared on a node
    compile_helpers: int = -1              # helper processes per GPU that compile a share of
                                           # the split beside its rank (-1: auto, 3 on one
                                           # GPU, 1 on two, none on more or when the compile
                                           # cache file was loaded; 0: none)
    device: str = "auto"                   # auto | cuda | cpu
    seed: int = -1                         # -1: unseeded init, like the record;
                                           # else torch.manual_seed(seed)
    run_id: str = ""                       # log name under logs/; empty: a random UUID
    log_dir: str = "logs"                  # folder of the log (<run_id>.txt)
                                           # and checkpoints (<run_id>/)
    save_checkpoint: bool = False          # write logs/<run_id>/state_step<step>.pt
                                           # at the end (or when stopped)
    checkpoint_every: int = 0              # also every this many steps (0: never),
                                           # keeping the newest checkpoint_keep;
    checkpoint_keep: int = 2               # any of these states (and a stopped run's) continues
                                           # with --resume
    resume: str = ""                       # a state_step<step>.pt file, or a run's folder
                                           # (its newest state): continue that run bit for bit (same
                                           # processes and math options, checked)
    nonfinite_check_every: int = 25        # check the loss for NaN/inf every this many steps
                                           # (no per-step sync); 0: off
    pg_timeout_s: int = 600                # a rank stuck this long in a collective ends the run
    profile_steps: str = ""                # "a:b[,c:d...]": profile steps a..b-1 (...) with
                                           # torch.profiler into the log dir, one trace per range
                                           # (bench/profile_step.py reads them)
    debug: bool = False                    # on an error, print the Python
                                           # traceback too (the log always has it)

    # ---- derived ----
    @property
    def num_iterations(self) -> int:
        return self.num_scheduled_iterations + self.num_extension_iterations

    @property
    def split_step(self) -> int:
        return math.ceil(self.split_frac * self.num_scheduled_iterations) | 1


PRESETS: dict[str, dict[str, Any]] = {
    # Same kinds of layer as the record (paired, normal, long window + key offset, no-attention
    # layer, skip, backout, value embeddings), narrow enough that a step takes well under a second
    # on a CPU.
    "tiny": dict(
        model_dim=128, num_heads=4, head_dim=32, mlp_hidden=512, num_layers=6,
        attn_layout="PNN-NP", long_window_layers=(1, 4), ve_layout=(1, 2, -1, -1, 0, 2),
        skip_source_layer=1, skip_dest_layer=3, backout_layer=4,
        batch_slices=2, block_size=16,
        stages=(Stage(512, 1.0, 3, (1.0, 0.5, 0.25)), Stage(768, 1.52, 7, (1.0, 0.5)),
                Stage(1024, 1.73, 11, (1.0,))),
        ws_long_extension=13, ws_long_final_val=20,
        val_batch_size=2048, val_tokens=4096, num_scheduled_iterations=60,
        num_extension_iterations=4, momentum_warmup_steps=10, momentum_cooldown_steps=4,
        val_loss_every=20, train_max_seq_len=256,
        tokens_per_doc_bound=100, compile=False, use_fp8=False, attn_backend="sdpa", warmup=False,
    ),
}


class ConfigError(ValueError):
    """A bad option or an environment that cannot run it; the message names what to change."""


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
        if isinstance(like, tuple) and like and isinstance(like[0], Stage):
            return tuple(_parse_stage(row) for row in text.split(","))
        if isinstance(like, tuple):
            items = [t for t in text.split(",") if t.strip()]
            kind = type(like[0]) if like else float
            return tuple(kind(t) for t in items)
        if isinstance(like, str):
            return text
    except ValueError:
        kind = "true or false" if isinstance(like, bool) else (
            "batch:lr_peak:ws_long:w1/w2/... per stage, comma-separated" if name == "stages" else
            f"comma-separated {type(like[0]).__name__}s" if isinstance(like, tuple) and like
            else f"a{'n' if type(like).__name__[0] in 'aeiou' else ''} {type(like).__name__}")
        raise ConfigError(f"--{name}={text!r} is not {kind} (default: {_show(like)})") from None
    raise ConfigError(f"--{name} cannot be set from the command line; "
                      "edit Hyperparameters in train_gpt.py")


def _parse_stage(text: str) -> Stage:
    batch, lr_peak, ws_long, weights = text.split(":")       # a ValueError unless
                                                             # there are 4 fields
    return Stage(int(batch), float(lr_peak), int(ws_long),
                 tuple(float(w) for w in weights.split("/")))


def _show(value: Any) -> str:
    """A value as it is typed on the command line."""
    if isinstance(value, Stage):
        return (f"{value.batch}:{value.lr_peak}:{value.ws_long}:"
                f"{'/'.join(str(w) for w in value.mtp_weights)}")
    if isinstance(value, tuple):
        return ",".join(_show(v) for v in value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def did_you_mean(name: str, names: Sequence[str]) -> list[str]:
    """Near misses (difflib) and names that contain `name` as a word or a substring: --lr finds
    --muon_lr, --adam_lr."""
    import difflib
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    related = [n for n in names if name in n.split("_") or (len(name) >= 3 and name in n)]
    related.sort(key=lambda n: n.split("_")[-1] != name)   # --lr: the learning rates before
                                                           # --lr_min
    return list(dict.fromkeys(close + related))[:6]


def help_text() -> str:
    """Usage and every Hyperparameters field with its type, default and comment, read from the
    class's source (so the help cannot drift from the code): `# ---- group ----` lines start a
    group, comment-only lines continue the comment of the field above."""
    import inspect
    defaults = Hyperparameters()
    lines = ["usage: python3 train_gpt.py [--name=value ...]        "
             "(on GPUs: ./run.sh [--name=value ...])",
             "",
             "Trains the speedrun GPT. Every option is a Hyperparameters field in train_gpt.py, "
             "set as --name=value;",
             "booleans take true/false (a bare --name means true), tuples take comma-separated "
             "values.",
             "--preset=NAME applies a preset first, whatever its position; the other options then "
             "override it.",
             "presets (--preset=NAME sets these fields):"]
    for name, preset in PRESETS.items():
        sets = " ".join(f"--{k}={_show(v)}" for k, v in preset.items() if not isinstance(v, dict))
        lines += textwrap.wrap(sets, 116, initial_indent=f"  {name}: ", subsequent_indent="    ")
    lines += ["",
             "exit codes: 0 done, 1 data, 2 options or environment, 3 loss not finite, "
             "4 another rank failed, 130 interrupted (README: When something is wrong)."]
    for src in inspect.getsource(Hyperparameters).splitlines()[1:]:
        text, indent = src.strip(), len(src) - len(src.lstrip())
        if text.startswith("# ----") and text.endswith("----"):
            if "derived" in text:
                break
            lines += ["", text.strip("# -") + ":"]
        elif text.startswith("#"):       # aligned with the trailing comments:
                                         # continues the field above
            lines.append(("      " if indent > 4 else "  ") + text.lstrip("# "))
        elif ":" in text and hasattr(defaults, text.split(":")[0]):
            name = text.split(":")[0]
            value = getattr(defaults, name)
            comment = text.split("#", 1)[1].strip() if "#" in text else ""
            shown = ("a table: edit DEFAULT_PARAM_TABLE" if isinstance(value, dict)
                     else f"default {_show(value)}")
            lines.append(f"  --{name}  [{type(value).__name__}, {shown}]  {comment}".rstrip())
    return "\n".join(lines)


# Options of earlier versions that became part of another: what to write instead.
_STAGES = (f"a column of --stages (batch:lr_peak:ws_long:w1/w2/... per stage; the default is "
           f"{_show(Hyperparameters.stages)})")
MOVED_OPTIONS = {
    "train_bs_schedule": "the batches are " + _STAGES,
    "lr_peaks": "the lr peaks are " + _STAGES,
    "ws_long_schedule": "the long windows are " + _STAGES,
    "mtp_weights_start": "the MTP weights are " + _STAGES,
    "mlp_bank_pad": "the banks pad themselves (to a multiple of 8 matrices); drop the option",
    "scatter_order": "the reductions follow the rows of DEFAULT_PARAM_TABLE; drop the option",
    "work_order": "the update order is derived from DEFAULT_PARAM_TABLE; drop the option",
    "softcap": "the softcap is SOFTCAP_A/B/C in triton_kernels.py; drop the option",
}


def parse_args(argv: Sequence[str]) -> Hyperparameters:
    """`--name=value` for any Hyperparameters field; `--preset=NAME` first applies a preset, then
    the rest.
    A bare `--name` sets a boolean field to true. Raises ConfigError naming the option."""
    fields = {f.name: f for f in dataclasses.fields(Hyperparameters)}
    defaults = Hyperparameters()
    pairs = []
    for arg in argv:
        if not arg.startswith("--"):
            raise ConfigError(f"expected --name=value, got {arg!r}; "
                              "python3 train_gpt.py --help lists the options")
        name, eq, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        if name in MOVED_OPTIONS:
            raise ConfigError(f"--{name} is gone: {MOVED_OPTIONS[name]}")
        if name not in fields:
            close = did_you_mean(name, list(fields))
            raise ConfigError(f"unknown option --{name}"
                              + (f"; did you mean {', '.join('--' + c for c in close)}?"
                                 if close else "; python3 train_gpt.py --help lists them"))
        if not eq:
            if not isinstance(getattr(defaults, name), bool):
                raise ConfigError(f"--{name} needs a value: write --{name}=VALUE "
                                  f"(no space; default {_show(getattr(defaults, name))})")
            value = "true"
        pairs.append((name, value))
    hp = defaults
    for name, value in pairs:
        if name == "preset":
            if value not in PRESETS and value != "":
                raise ConfigError(f"unknown --preset={value}; known presets: {', '.join(PRESETS)}")
            hp = dataclasses.replace(hp, preset=value, **copy.deepcopy(PRESETS.get(value, {})))
    for name, value in pairs:
        if name != "preset":
            setattr(hp, name, _parse_value(value, getattr(hp, name), name))
    return hp


def hyperparameters_from_dict(saved: dict) -> Hyperparameters:
    """The Hyperparameters a checkpoint stored with dataclasses.asdict (stage rows as dicts); names
    that are not options (any more) are dropped."""
    known = {f.name for f in dataclasses.fields(Hyperparameters)}
    values = {k: v for k, v in saved.items() if k in known}
    if "stages" in values:
        values["stages"] = tuple(Stage(**row) for row in values["stages"])
    return Hyperparameters(**values)


# ==================================================================================================
# 2. Attention backends
# ==================================================================================================
# Every backend computes the same thing: packed documents q, k, v (T, H, D) bf16 with boundaries
# cu_seqlens = [0, c_1, ..., T, T, ...] (int32; trailing repeats are empty documents); query t of
# document [c_j, c_{j+1}) sees keys t' with c_j <= t' <= t and t - window <= t' (window + 1 keys
# at most, itself included); logits scale * <q_t, k_t'>, softmax in fp32, output (T, H, D) in
# q's dtype.
#   triton the project's own kernel (triton_kernels.py section 8): skips every key block outside
#          the window and the document; CUDA only for training.
#   fa3    FlashAttention-3 `flash_attn_varlen_func` (Hopper), when the module
#          `flash_attn_interface` is installed.
#   fa4    FlashAttention-4 (`pip install flash-attn-4`, module flash_attn.cute; Hopper and
#          Blackwell), its forward and backward wrapped as custom ops so they compile.
#   flex   torch flex_attention with a block mask built from cu_seqlens; fused only under
#          torch.compile, CUDA only for training (its CPU path has no backward; the CPU tests call
#          it forward-only).
#   varlen torch.nn.attention.varlen.varlen_attn (FlashAttention-2 inside torch), CUDA only.
#   sdpa   a dense-mask reference (O(T^2) memory) for CPUs and tests.
ATTN_BACKENDS = ("triton", "flex", "varlen", "fa3", "fa4", "sdpa")
# "auto" on CUDA takes the first available of these. triton before varlen: whole training runs on
# an H100, both in one call, took 0.954 / 0.958 / 0.955 of varlen's ms/step at 131k / 262k / 393k
# tokens with it (records/2026-11-25_backends_profile_1xH100). fa4 (optional) before both: its
# forward + backward alone, weighted over a run, took 9.9 s per GPU on an H100 against triton's
# 11.5 s and varlen's 16.5 s, and 8.8 / 11.3 / 15.8 s on an H200; whole H200 runs took 600 / 615
# ms per phase-3 step with fa4 / triton (README, attention table). FA3 (the record's kernel,
# Hopper-native) stays first when installed; it was not measured here.
# varlen comes before flex because it measured faster in the full model
# (records/2026-11-21_synthetic_smoke). Off CUDA "auto" means sdpa (the only CPU backward).
ATTN_AUTO_ORDER_CUDA = ("fa3", "fa4", "triton", "varlen", "flex", "sdpa")
FLEX_BLOCK_SIZE = 128  # tokens per flex sparse block (q and kv);
                       # flex's kernel tiles (64 or 128) divide it


def _import_fa3() -> Any:
    """The FlashAttention-3 module, or None when it is not installed (or its CUDA library does not
    load)."""
    try:
        import flash_attn_interface
    except Exception:  # ImportError, or OSError from a .so built for another torch/CUDA
        return None
    return flash_attn_interface


def _import_fa4() -> Any:
    """FlashAttention-4's interface module with the nanogpt_fa4 ops registered, or None when it is
    not installed (or does not load)."""
    try:
        from flash_attn.cute import interface
    except Exception:  # ImportError, or a CUDA / CuTe DSL library that does not load
        return None
    register_fa4_ops(interface)
    return interface


def register_fa4_ops(fa4: Any) -> None:
    """torch.ops.nanogpt_fa4.fwd / .bwd: FA4's internal varlen forward and backward as custom ops
    with fake implementations and autograd. Its public flash_attn_varlen_func is an
    autograd.Function full of host-side Python (caches, device queries) that dynamo cannot trace.
    The arguments are what that function passes for causal=True, window_size=(window, 0)."""
    if hasattr(torch.ops.nanogpt_fa4, "fwd"):
        return

    @torch.library.custom_op("nanogpt_fa4::fwd", mutates_args=())
    def fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, window: int,
            scale: float) -> tuple[Tensor, Tensor]:
        # return_lse=True: the public wrapper gets the lse only because its inputs require grad,
        # which they do not inside a custom op
        res = fa4._flash_attn_fwd(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                  max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                                  softmax_scale=scale, causal=True, window_size_left=window,
                                  window_size_right=0, softcap=0.0, num_splits=1, pack_gqa=None,
                                  return_lse=True)
        return res[0], res[1]         # out (T, H, D); lse (H, T) fp32; later fields vary by version

    @fwd.register_fake
    def _(q, k, v, cu_seqlens, max_seqlen, window, scale):
        return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)

    @torch.library.custom_op("nanogpt_fa4::bwd", mutates_args=())
    def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
            cu_seqlens: Tensor, max_seqlen: int, window: int, scale: float
            ) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = fa4._flash_attn_bwd(q, k, v, out, dout, lse, scale, True, 0.0,
                                         window_size_left=window, window_size_right=0,
                                         cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                         seqused_q=None, seqused_k=None, max_seqlen_q=max_seqlen,
                                         max_seqlen_k=max_seqlen, deterministic=False, dlse=None)
        return dq.contiguous(), dk.contiguous(), dv.contiguous()

    @bwd.register_fake
    def _(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, window, scale):
        return tuple(torch.empty_like(t, memory_format=torch.contiguous_format)
                     for t in (q, k, v))

    def setup_context(ctx, inputs, output):
        q, k, v, cu_seqlens, max_seqlen, window, scale = inputs
        ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens)
        ctx.args = (max_seqlen, window, scale)

    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = torch.ops.nanogpt_fa4.bwd(dout.contiguous(), q, k, v, out, lse, cu_seqlens,
                                               *ctx.args)
        return dq, dk, dv, None, None, None, None

    fwd.register_autograd(backward, setup_context=setup_context)


def _import_torch_varlen() -> Callable | None:
    """torch's varlen_attn if this torch has it with sliding-window and scale arguments
    (torch >= 2.11), else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    import inspect
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn if "window_size" in params and "scale" in params else None


def _import_flex() -> Any:
    """torch's flex_attention module, with the block-table op it needs registered; None on a torch
    without flex."""
    try:
        from torch.nn.attention import flex_attention
    except ImportError:
        return None
    register_flex_block_tables_op()
    return flex_attention


def available_attn_backends(device: torch.device) -> list[str]:
    """Backends that can run on `device`, in ATTN_BACKENDS order."""
    on_cuda = torch.device(device).type == "cuda"
    usable = {
        "triton": on_cuda,
        "flex": on_cuda and _import_flex() is not None,  # on CPU flex runs forward only
                                                         # (no backward in torch 2.13)
        "varlen": on_cuda and _import_torch_varlen() is not None,
        "fa3": on_cuda and _import_fa3() is not None,
        "fa4": on_cuda and _import_fa4() is not None,
        "sdpa": True,
    }
    return [name for name in ATTN_BACKENDS if usable[name]]


def resolve_attn_backend(name: str, device: torch.device) -> str:
    """Turn --attn_backend into a backend that runs on `device`: "auto" picks the fastest available
    one."""
    available = available_attn_backends(device)
    if name == "auto":
        if torch.device(device).type != "cuda":
            return "sdpa"
        return next(b for b in ATTN_AUTO_ORDER_CUDA if b in available)
    if name not in ATTN_BACKENDS:
        raise ValueError(f"unknown --attn_backend={name!r}; "
                         f"choose auto or one of {', '.join(ATTN_BACKENDS)}")
    if name not in available:
        raise ValueError(f"--attn_backend={name} cannot run on {device} here (fa3 needs the "
                         "flash_attn_interface module and CUDA; fa4 the flash-attn-4 package and "
                         "CUDA; varlen needs torch >= 2.11 and CUDA; triton and flex need CUDA); "
                         f"available: {', '.join(available)}; pass one of these or "
                         "--attn_backend=auto")
    return name


def document_ids(cu_seqlens: Tensor, num_tokens: int) -> Tensor:
    """(num_tokens,) int64 index j of the document [c_j, c_{j+1}) holding each packed position.
    searchsorted(right=True) counts the boundaries <= t, so repeated boundaries (empty documents)
    are skipped."""
    positions = torch.arange(num_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens, positions, right=True) - 1


def _blocks_to_ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """(n_q, n_kv) bool block matrix -> flex's (1, 1, n_q) int32 counts and (1, 1, n_q, n_kv) int32
    kv-block indices, the selected blocks first in ascending order (the rest of each row is ignored
    by the kernel)."""
    counts = blocks.sum(dim=-1, dtype=torch.int32)
    indices = torch.sort(blocks.to(torch.int8), dim=-1, descending=True,
                         stable=True).indices.to(torch.int32)
    return counts[None, None], indices[None, None]


def _flex_block_tables_impl(cu_seqlens: Tensor, num_tokens: int, window: int, block_size: int
                            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The tensors of flex_document_block_mask: doc_id (T,) and the partial / full kv-block counts
    and indices.

    Built from two numbers per q block instead of evaluating the mask on all T^2 pairs
    (create_block_mask's way).
    Query q may see the key interval [lo(q), q], lo(q) = max(document start of q, q - window); lo is
    nondecreasing in q and lo(q) <= q, so the keys seen by a q block [first, last] are exactly
    [lo(first), last] and the keys seen by every query of the block are [lo(last), first]. Hence kv
    block j is
        used by q block i  iff  j <= i and j's last key >= lo(first),
        full (all pairs allowed, mask_mod skipped) iff j < i and j's first key >= lo(last).
    """
    doc_id = document_ids(cu_seqlens, num_tokens)  # (T,)
    doc_start = cu_seqlens[doc_id]                 # (T,) first position of t's document
    num_blocks = -(-num_tokens // block_size)
    block = torch.arange(num_blocks, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    first_q = block * block_size
    last_q = torch.clamp(first_q + block_size - 1, max=num_tokens - 1)
    lo_first = torch.maximum(doc_start[first_q], first_q - window)  # (n,) lowest key any query sees
    lo_last = torch.maximum(doc_start[last_q], last_q - window)  # (n,) lowest key all queries see
    q_blk, kv_blk = block[:, None], block[None, :]
    used = (kv_blk <= q_blk) & ((kv_blk + 1) * block_size - 1 >= lo_first[:, None])  # (n, n)
    full = (kv_blk < q_blk) & (kv_blk * block_size >= lo_last[:, None])  # (n, n), a subset of used
    return (doc_id, *_blocks_to_ordered(used & ~full), *_blocks_to_ordered(full))


def register_flex_block_tables_op() -> None:
    """torch.ops.nanogpt.flex_block_tables: _flex_block_tables_impl as an opaque op. Inside
    torch.compile, inductor's flex lowering (torch 2.11) rejects block-mask tensors computed by
    fused in-graph kernels ("convert FlexibleLayout to FixedLayout first"); a custom op's outputs
    are fixed buffers. Registered once per process."""
    if hasattr(torch.ops.nanogpt, "flex_block_tables"):
        return
    op = torch.library.custom_op("nanogpt::flex_block_tables",
                                 mutates_args=())(_flex_block_tables_impl)

    @op.register_fake
    def _(cu_seqlens, num_tokens, window, block_size):
        n = -(-num_tokens // block_size)
        counts, indices = cu_seqlens.new_empty(1, 1, n), cu_seqlens.new_empty(1, 1, n, n)
        return (cu_seqlens.new_empty(num_tokens, dtype=torch.int64), counts, indices,
                counts.clone(), indices.clone())


def flex_document_block_mask(cu_seqlens: Tensor, num_tokens: int, window: int,
                             block_size: int) -> Any:
    """BlockMask for same-document & causal & sliding-window attention over `num_tokens` packed
    positions."""
    from torch.nn.attention.flex_attention import BlockMask
    if not torch.compiler.is_compiling():  # (dynamo cannot trace the registration: compiled
        register_flex_block_tables_op()    # callers resolve the backend first, which registers it
                                           # through _import_flex)
    doc_id, kv_num, kv_idx, full_num, full_idx = torch.ops.nanogpt.flex_block_tables(
        cu_seqlens, num_tokens, window, block_size)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc_id[q_idx] == doc_id[kv_idx]) & (kv_idx <= q_idx) & (q_idx - kv_idx <= window)

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=mask_mod, seq_lengths=(num_tokens, num_tokens))


def _flex_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int,
                           scale: float) -> Tensor:
    from torch.nn.attention.flex_attention import flex_attention
    if q.is_cuda and not torch.compiler.is_compiling():
        # Outside torch.compile flex falls back to an unfused path that materialises (H, T, T)
        # scores.
        raise ValueError("--attn_backend=flex runs fused only inside torch.compile; "
                         "use --compile=True, or --attn_backend=varlen/fa3 for eager CUDA runs")
    block_mask = flex_document_block_mask(cu_seqlens, q.size(0), window, FLEX_BLOCK_SIZE)
    # (T, H, D) -> (1, H, T, D) head-major copies: the layout that compiled and trained on torch
    # 2.11 (plain views were not tried again after the block-table fix); the output goes back to
    # (T, H, D) as a view.
    qh, kh, vh = (t.transpose(0, 1).contiguous()[None] for t in (q, k, v))
    out = flex_attention(qh, kh, vh, block_mask=block_mask, scale=scale)
    return out[0].transpose(0, 1)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                     window: int, scale: float, backend: str) -> Tensor:
    """Causal sliding-window attention within packed documents (see the top of this section),
    (T, H, D) -> (T, H, D).
    max_seqlen is a launch hint for fa3/varlen and must be >= the longest document; window >= 0 in
    positions."""
    # Plain imports here (the probing with try/inspect lives in available_attn_backends): this runs
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
        # whose strides are not 16-byte aligned, so the view v goes in as it is (its copy cost an
        # inductor kernel of 1.5 ms per phase-3 step on an H200)
        return torch.ops.nanogpt_fa4.fwd(q, k, v, cu_seqlens, max_seqlen, window, scale)[0]
    if backend == "varlen":
        from torch.nn.attention.varlen import varlen_attn
        # window_size=(left, right): keys t - left .. t + right; right = 0 makes it causal
        return varlen_attn(q, k, v.contiguous(), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                           scale=scale, window_size=(window, 0))
    if backend == "flex":
        return _flex_varlen_attention(q, k, v, cu_seqlens, window, scale)
    if backend == "sdpa":
        return tk.varlen_attention_reference(q, k, v, cu_seqlens, window, scale)
    raise ValueError(f"unknown attention backend {backend!r}; "
                     "resolve --attn_backend with resolve_attn_backend()")


# ==================================================================================================
# 3. Model
# ==================================================================================================
FLT_EPS = torch.finfo(torch.float32).eps  # 2^-23: the eps of every rms(),
                                          # F.rms_norm's own fp32 default
GATE_INPUT_DIM = 12                        # every sigmoid gate reads the
                                           # first 12 channels of its input
YARN_ATTN_SCALE_SLOPE = 0.2                # attn_scale *= 1 + slope * ln(new/old)
                                           # at each long-window change


@dataclass
class ModelConfig:
    """Everything the GPT needs; field names equal the Hyperparameters names where they overlap
    (see its comments)."""
    vocab_size: int
    model_dim: int
    num_heads: int
    head_dim: int
    mlp_hidden: int
    num_layers: int
    num_value_embeds: int
    attn_layout: str              # one char per layer: P paired heads, N normal, - no attention
    long_window_layers: tuple     # layers using the long window (normal
                                  # ones also get the key offset)
    ve_layout: tuple              # per layer: value-embedding table index, or -1
    skip_source_layer: int
    skip_dest_layer: int
    backout_layer: int
    block_size: int               # tokens per window block
    rope_base: float
    attn_scale: float             # softmax scale after reset_rotary()
    yarn_alpha: float
    yarn_beta: float
    fp8_scales: tuple             # (s_x, s_w, s_g) of the FP8 LM head
    use_fp8: bool                 # FP8 LM head in training (CUDA: the custom
                                  # op; CPU: its plain-PyTorch emulation)
    attn_backend: str             # resolved backend name, passed through to varlen_attention
    rotary_max_len: int           # packed positions the rotary tables cover:
                                  # max(train, val) micro-batch tokens
    dtype: str = "bfloat16"       # weights and activations: bf16 (the record),
                                  # or float32 / float64 on a CPU
    kernels: str = "fused"        # "torch": the MLP and loss by their
                                  # plain-PyTorch definitions (--kernels)
    bank_multiple: int = 8        # each bank holds a multiple of this many matrices (padded
                                  # with unused slices), so the optimizer shards it evenly over any
                                  # world size that divides this

    def validate(self) -> None:
        """Raise ValueError naming the option to change for layouts the model cannot build."""
        L = self.num_layers
        if self.num_heads * self.head_dim != self.model_dim:
            raise ValueError(f"num_heads * head_dim = {self.num_heads * self.head_dim} must equal "
                             f"model_dim = {self.model_dim}; change --num_heads, --head_dim or "
                             "--model_dim")
        if self.head_dim % 4 or self.model_dim < GATE_INPUT_DIM:
            raise ValueError(f"--head_dim={self.head_dim} must be a multiple of 4 (rotary pairs "
                             f"on its first half) and --model_dim >= {GATE_INPUT_DIM} "
                             "(gate inputs)")
        if len(self.attn_layout) != L or set(self.attn_layout) - set("PN-"):
            raise ValueError(f"--attn_layout={self.attn_layout!r} needs one of P, N, - per layer "
                             f"({L} layers)")
        if "P" in self.attn_layout and self.num_heads % 2:
            raise ValueError(f"paired-head layers need an even --num_heads (got {self.num_heads}); "
                             "or remove P from --attn_layout")
        if len(self.ve_layout) != L or any(not -1 <= j < self.num_value_embeds
                                           for j in self.ve_layout):
            raise ValueError(f"--ve_layout={self.ve_layout} needs one entry per layer ({L}), "
                             "each -1 or a table index below "
                             f"--num_value_embeds={self.num_value_embeds}")
        if any(j >= 0 and self.attn_layout[i] == "-" for i, j in enumerate(self.ve_layout)):
            raise ValueError("--ve_layout puts a value embedding on a layer without attention "
                             "(- in --attn_layout)")
        if any(not 0 <= i < L for i in self.long_window_layers):
            raise ValueError(f"--long_window_layers={self.long_window_layers} must be layer "
                             f"indices below {L}")
        if (not 0 <= self.skip_source_layer < self.skip_dest_layer < L
                or not 0 <= self.backout_layer < L):
            raise ValueError("need 0 <= --skip_source_layer < --skip_dest_layer < num_layers and "
                             "0 <= --backout_layer < num_layers")
        if self.dtype not in ("bfloat16", "float32", "float64"):
            raise ValueError(f"--dtype={self.dtype}: use bfloat16 (training), float32 or float64 "
                             "(CPU checks)")
        if self.use_fp8 and self.dtype != "bfloat16":
            raise ValueError("the FP8 LM head reads bf16 weights: use --use_fp8=false with "
                             f"--dtype={self.dtype}")
        if self.rotary_max_len < 1:
            raise ValueError("rotary_max_len must be the largest micro-batch in tokens "
                             "(train or val)")


def bank_padding(slices: int, matrices_per_slice: int, multiple: int) -> int:
    """Unused slices to append so that (slices + pad) * matrices_per_slice is a multiple of
    `multiple`."""
    return -slices % (multiple // math.gcd(multiple, matrices_per_slice))


@dataclass(frozen=True)
class LayerPlan:
    """One layer's wiring, derived from the ModelConfig layout once (forward never names a layer
    index)."""
    index: int
    attn: str            # "P" paired heads, "N" normal, "" none
    attn_slot: int       # slice of the attn bank and attn_gate_bank (-1: no attention)
    long_window: bool
    key_offset: bool     # normal long-window layers only (the paired path never shifts keys)
    ve_table: int        # value-embedding table (-1: none)
    ve_slot: int         # slice of ve_gate_bank (-1: none)


def rms(x: Tensor) -> Tensor:
    """x / sqrt(mean(x^2) + 2^-23) over the last dim, no gain; fp32 statistics, result in x's
    dtype."""
    return F.rms_norm(x, (x.shape[-1],), eps=FLT_EPS)


def rotary_base_omega(head_dim: int, base: float, device: torch.device) -> Tensor:
    """(head_dim,) fp32 angular frequencies: [f0, f0, f1, f1, ..., 0 x head_dim/2],
    f_j = (1/base)^(j/(n-1)).

    Half-truncated RoPE: n = head_dim/4 frequencies on adjacent pairs of the first half; the second
    half is stationary.
    """
    n = head_dim // 4
    freqs = (1.0 / base) ** torch.linspace(0, 1, n, dtype=torch.float32, device=device)
    return torch.cat([freqs.repeat_interleave(2), freqs.new_zeros(head_dim // 2)])


def rotary_tables(omega: Tensor, num_positions: int,
                  dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor]:
    """(num_positions, head_dim/2) cos and sign-flipped sin of theta = p * omega (fp32) for the
    rotating half, in `dtype` (the model's: bf16).

    The odd columns of sin are negated so that apply_rotary is x*cos + pairswap(x)*sin
    (clockwise rotation).
    The stationary half (omega = 0: cos 1, sin 0) is left out; apply_rotary passes it through
    unchanged.
    """
    half = omega.shape[0] // 2
    theta = torch.outer(torch.arange(num_positions, dtype=torch.float32, device=omega.device),
                        omega[:half])
    cos, sin = theta.cos().to(dtype), theta.sin().to(dtype)
    sin[:, 1::2] *= -1
    return cos, sin


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate adjacent pairs (2m, 2m+1) of x's first half clockwise; cos/sin broadcast to
    x[..., :head_dim/2].

    out[2m] = cos*x[2m] + sin*x[2m+1];  out[2m+1] = cos*x[2m+1] - sin*x[2m]
    (the minus lives in the sin table).
    The swap is a flip of each pair: unbinding the pairs and stacking them back is the same math
    and faster in a standalone benchmark, but made a compiled phase-3 step slower, and a
    rotate-half layout of the same dims was no faster (bench/qk_rotary.py).
    """
    half = x.shape[-1] // 2
    x_rot, x_pass = x[..., :half], x[..., half:]
    x_swapped = x_rot.unflatten(-1, (half // 2, 2)).flip(-1).flatten(-2)
    return torch.cat([x_rot * cos + x_swapped * sin, x_pass], dim=-1)


def shift_keys_by_one(k: Tensor) -> Tensor:
    """Key offset: the second quarter of each half of every head (dims [hd/4, hd/2), [3hd/4, hd))
    takes the values of the previous packed position (position 0 keeps its own; document boundaries
    are ignored). k (T, H, hd)."""
    T, H, hd = k.shape
    k_prev = torch.cat([k[:1], k[:-1]], dim=0)
    quarters_now = k.view(T, H, 2, 2, hd // 4)
    quarters_prev = k_prev.view(T, H, 2, 2, hd // 4)
    return torch.stack([quarters_now[:, :, :, 0], quarters_prev[:, :, :, 1]], dim=3).view(T, H, hd)


# ---- FP8 LM head ---------------------------------------------------------------------------------

def fp8_quantize(x: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
    """Saturating cast of x/scale to an FP8 dtype: overflow clamps to +-max, not NaN. The division
    is x * fp32(1/scale), which is what torch.compile on CUDA makes of a division by a constant;
    written so, the eager, compiled and fused (the cross entropy's backward kernel) quantisers agree
    bit for bit."""
    limit = torch.finfo(dtype).max  # 448 for e4m3fn, 57344 for e5m2
    return (x.float() * (1.0 / scale)).clamp(-limit, limit).to(dtype)


def fp8_scale_product(a: float, b: float) -> float:
    """The fp32 product of two scales, as torch._scaled_mm forms scale_a * scale_b."""
    return float(torch.tensor(a, dtype=torch.float32) * torch.tensor(b, dtype=torch.float32))


class FP8HeadEmulated(torch.autograd.Function):
    """Plain-PyTorch FP8 LM head: the custom op's math with dequantised fp32 matmuls (CPU path and
    GPU test reference).

    h (T, D) bf16, w (D, V) bf16 -> logits (T, V) bf16; saves only the quantised X8, W8 like the op.
    """

    @staticmethod
    def forward(ctx, h: Tensor, w: Tensor, s_x: float, s_w: float, s_g: float) -> Tensor:
        x8, w8 = (fp8_quantize(h, s_x, torch.float8_e4m3fn),
                  fp8_quantize(w, s_w, torch.float8_e4m3fn))
        ctx.save_for_backward(x8, w8)
        ctx.scales = (s_x, s_w, s_g)
        return (x8.float() @ w8.float() * fp8_scale_product(s_x, s_w)).bfloat16()

    @staticmethod
    def backward(ctx, grad: Tensor):
        x8, w8 = ctx.saved_tensors
        s_x, s_w, s_g = ctx.scales
        g8 = fp8_quantize(grad, s_g, torch.float8_e5m2).float()
        dh = (g8 @ w8.float().T * fp8_scale_product(s_g, s_w)).bfloat16()
        dw = x8.float().T @ g8 * fp8_scale_product(s_x, s_g)  # fp32; autograd casts it
                                                              # to the bf16 parameter
        return dh, dw, None, None, None


# One compiled helper per role (distinct code objects, so each keeps its own small compile cache):
# each quantiser reads its input once and writes the FP8 tensor in both layouts torch._scaled_mm
# needs (K-major for both operands).
# The gradient is quantised inside the cross entropy's backward kernel (FP8HeadMTPCE below), which
# writes both layouts too.
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
    one = dict(dtype=torch.float32, device=h.device)
    logits = torch._scaled_mm(x8, w8_t.t(), scale_a=torch.full((), s_x, **one),
                              scale_b=torch.full((), s_w, **one),
                              out_dtype=torch.bfloat16, use_fast_accum=True)
    return logits, x8_t, w8


def _fp8_head_backward_impl(g8: Tensor, g8_t: Tensor, x8_t: Tensor, w8: Tensor, s_x: float,
                            s_w: float, s_g: float) -> tuple[Tensor, Tensor]:
    """dh (T, D) bf16 = (s_g*s_w) G8 @ W8^T; dW (D, V) fp32 = (s_x*s_g) X8^T @ G8, from
    G8 = e5m2(G/s_g) (T, V) and its transpose G8^T (V, T); no fast accumulation."""
    one = dict(dtype=torch.float32, device=g8.device)
    sx, sw, sg = (torch.full((), s, **one) for s in (s_x, s_w, s_g))
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
    """Per-row softcapped MTP losses of the FP8 head's logits (CUDA; register_fp8_head_op() first).

    Forward: the FP8 logits, then the cross entropy's forward kernel. Backward: one kernel reads the
    logits once and writes the logit gradient already quantised to e5m2 (half the bytes of the bf16
    gradient that an FP8 head behind a separate loss would receive, store and quantise in another
    pass; the bf16 rounding is kept inside the kernel, so the numbers are the same), in both layouts:
    (T, V) for the input gradient's FP8 matmul and (V, T) for the weight gradient's (both operands
    K-major)."""

    @staticmethod
    def forward(ctx, h: Tensor, w: Tensor, targets: Tensor, mtp_weights: Tensor, s_x: float,
                s_w: float, s_g: float) -> Tensor:
        logits, x8_t, w8 = torch.ops.nanogpt.fp8_head(h, w, s_x, s_w)
        losses, lse = torch.ops.nanogpt_kernels.softcapped_mtp_ce_fwd(logits, targets, mtp_weights)
        ctx.save_for_backward(logits, targets, mtp_weights, lse, x8_t, w8)
        ctx.scales = (s_x, s_w, s_g)
        return losses

    @staticmethod
    def backward(ctx, grad_losses: Tensor):
        logits, targets, mtp_weights, lse, x8_t, w8 = ctx.saved_tensors
        s_x, s_w, s_g = ctx.scales
        g8, g8_t = torch.ops.nanogpt_kernels.softcapped_mtp_ce_bwd_fp8(
            grad_losses, logits, targets, mtp_weights, lse, s_g)
        dh, dw = torch.ops.nanogpt.fp8_head_backward(g8, g8_t, x8_t, w8, s_x, s_w, s_g)
        return dh, dw, None, None, None, None, None  # dw is fp32; autograd casts it
                                                     # to the bf16 parameter's dtype


def fp8_head_mtp_ce(h: Tensor, w: Tensor, targets: Tensor, mtp_weights: Tensor, s_x: float,
                    s_w: float, s_g: float) -> Tensor:
    """Per-row MTP losses (T,) fp32 of the FP8 LM head's logits: FP8HeadMTPCE on CUDA, the emulated
    head and the plain loss elsewhere (the same math)."""
    if h.is_cuda:
        return FP8HeadMTPCE.apply(h, w, targets, mtp_weights, s_x, s_w, s_g)
    return tk.softcapped_mtp_ce(FP8HeadEmulated.apply(h, w, s_x, s_w, s_g), targets, mtp_weights)


# ---- GPT -----------------------------------------------------------------------------------------

class GPT(nn.Module):
    """The record's GPT, parameters in 13 labelled tensors (banks), layer wiring from the
    ModelConfig.

    Rotary state (omega, bf16 tables, attn_scale) is one object shared by normal and paired layers:
    the record's two rotary objects always receive the same resets and YaRN updates, so they always
    hold the same values. The tables cover 2 * rotary_max_len angle positions: normal layers read
    rows [0, T), paired layers read rows 2t and 2t+1 for token t, i.e. rows [0, 2T) viewed as
    (T, 2, head_dim/2).
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

        # Banks: attn slice i = [W_q; W_k; W_v; W_o] (4D, D) of the i-th attention layer; mlp slice
        # j = [c_fc, c_proj] (2, hidden, D) of layer j. Unused pad slices at the end make each bank
        # shard evenly (cfg.bank_multiple): the attn pad stays zero; the mlp pad's c_fc is drawn, as
        # the record draws its whole 12-slice bank.
        # Built in fp32 on `device`, then cast to bf16. With --dtype=float32/float64 the bf16
        # tensors are that dtype instead and the fp32 ones at least fp32.
        wdt = getattr(torch, cfg.dtype)
        fdt = tk.acc_dtype(wdt)
        attn = torch.zeros(n_attn + bank_padding(n_attn, 4, cfg.bank_multiple), 4 * D, D,
                           device=device)
        bound = math.sqrt(3) * D ** -0.5
        attn[:n_attn, : 3 * D].uniform_(-bound, bound)               # QKV; the O rows stay zero
        mlp = torch.zeros(L + bank_padding(L, 2, cfg.bank_multiple), 2, cfg.mlp_hidden, D,
                          device=device)
        mlp[:, 0].uniform_(-0.5 * bound, 0.5 * bound)                # c_fc; c_proj stays zero
        # drawn into bf16
        lm_head = torch.empty(D, V, dtype=torch.bfloat16, device=device).normal_(0.0, 0.005)
        scalars = torch.cat([
            torch.full((L,), 1.1),                                   # residual lambdas r_i
            torch.tensor([0.5, 1.0]).repeat(L),                      # SA lambdas (qkv, o) per layer
            torch.tensor([0.0, 0.5, -1.5]),                          # smear, backout, skip lambdas
        ]).to(device, fdt)
        gate = dict(dtype=wdt, device=device)
        self.attn = param(attn.to(wdt))
        self.mlp = param(mlp.to(wdt))
        lm_head = lm_head.to(wdt)
        self.lm_head = param(lm_head)                                # (D, V): stored transposed,
                                                                     # logits = h @ lm_head
        self.embed = param(lm_head.T.contiguous())                   # tied copy until the
                                                                     # optimizer splits them
        self.ve_names = tuple(f"ve{j}" for j in range(cfg.num_value_embeds))
        for name in self.ve_names:
            self.register_parameter(name, param(torch.zeros(V, D, **gate)))
        self.attn_gate_bank = param(torch.zeros(n_attn, H, GATE_INPUT_DIM, **gate))
        self.ve_gate_bank = param(torch.zeros(n_ve, H, GATE_INPUT_DIM, **gate))
        self.smear_gate = param(torch.zeros(1, GATE_INPUT_DIM, **gate))
        self.skip_gate = param(torch.zeros(1, GATE_INPUT_DIM, **gate))
        self.x0_lambdas = param(torch.zeros(L, device=device, dtype=fdt))
        self.scalars = param(scalars)  # (3L+3,) fp32; the reference's sharding
                                       # padding is dropped (vestigial)

        self.register_buffer("rotary_omega", torch.zeros(hd, device=device), persistent=False)
        self.register_buffer("rotary_cos", torch.empty(2 * cfg.rotary_max_len, hd // 2, **gate),
                             persistent=False)
        self.register_buffer("rotary_sin", torch.empty(2 * cfg.rotary_max_len, hd // 2, **gate),
                             persistent=False)
        self.attn_scale = cfg.attn_scale
        self.reset_rotary()
        if cfg.use_fp8:
            register_fp8_head_op()
        if cfg.attn_backend == "flex":
            _import_flex()
        if cfg.attn_backend == "fa4":
            _import_fa4()

    @staticmethod
    def _layer_plan(cfg: ModelConfig) -> tuple[LayerPlan, ...]:
        plan, attn_slot, ve_slot = [], 0, 0
        for i, kind in enumerate(cfg.attn_layout):
            has_attn, has_ve = kind != "-", cfg.ve_layout[i] >= 0
            long_window = has_attn and i in cfg.long_window_layers
            plan.append(LayerPlan(index=i, attn=kind if has_attn else "",
                                  attn_slot=attn_slot if has_attn else -1,
                                  long_window=long_window, key_offset=long_window and kind == "N",
                                  ve_table=cfg.ve_layout[i], ve_slot=ve_slot if has_ve else -1))
            attn_slot += has_attn
            ve_slot += has_ve
        return tuple(plan)

    @property
    def bank_matrix_shapes(self) -> dict[str, tuple[int, int]]:
        """The matrices the optimizer orthogonalises: attn's W_q, W_k, W_v, W_o (D, D); mlp's c_fc,
        c_proj (H, D)."""
        return {"attn": (self.cfg.model_dim, self.cfg.model_dim),
                "mlp": (self.cfg.mlp_hidden, self.cfg.model_dim)}

    # ---- rotary state ----

    @torch.no_grad()
    def reset_rotary(self) -> None:
        """Base frequencies, rebuilt tables, attn_scale back to its initial value (at construction
        and after warmup)."""
        self.rotary_omega.copy_(rotary_base_omega(self.cfg.head_dim, self.cfg.rope_base,
                                                  self.rotary_omega.device))
        self._rebuild_rotary_tables()
        self.attn_scale = self.cfg.attn_scale

    @torch.no_grad()
    def apply_yarn(self, old_ws_long: int, new_ws_long: int) -> None:
        """YaRN for a long window going old -> new (blocks): frequencies turning fewer than alpha
        times over the old window are scaled by old/new, those turning beta+ times are kept, a
        linear ramp between; compounds."""
        cfg, omega = self.cfg, self.rotary_omega
        ratio = old_ws_long / new_ws_long
        turns = (cfg.block_size * old_ws_long) * omega / (2 * math.pi)
        ramp = ((turns - cfg.yarn_alpha) / (cfg.yarn_beta - cfg.yarn_alpha)).clamp(0, 1)
        omega.mul_(ratio + ramp * (1 - ratio))
        self._rebuild_rotary_tables()
        self.attn_scale *= 1 + YARN_ATTN_SCALE_SLOPE * math.log(new_ws_long / old_ws_long)

    def _rebuild_rotary_tables(self) -> None:
        cos, sin = rotary_tables(self.rotary_omega, self.rotary_cos.shape[0], self.rotary_cos.dtype)
        self.rotary_cos.copy_(cos)  # in place: compiled graphs keep reading the same buffers
        self.rotary_sin.copy_(sin)

    # ---- forward ----

    def forward(self, inputs: Tensor, targets: Tensor, cu_seqlens: Tensor, ws_short: int,
                ws_long: int, mtp_weights: Tensor, max_seqlen: int) -> Tensor:
        """inputs (T,) int32, targets (T,) int64. Training: the summed MTP loss (fp32 scalar); eval:
        mean CE."""
        h = self.final_hidden(inputs, cu_seqlens, ws_short, ws_long, max_seqlen)  # (T, D) bf16
        # the plain definitions: FP8 emulated, reference loss
        if self.training and self.cfg.kernels == "torch":
            fp8 = self.cfg.use_fp8
            logits = (FP8HeadEmulated.apply(h, self.lm_head, *self.cfg.fp8_scales) if fp8
                      else h @ self.lm_head)
            return tk.softcapped_mtp_ce_reference(logits, targets, mtp_weights).sum()
        if self.training:
            if self.cfg.use_fp8:
                losses = fp8_head_mtp_ce(h, self.lm_head, targets, mtp_weights,
                                         *self.cfg.fp8_scales)
            else:
                losses = tk.softcapped_mtp_ce(h @ self.lm_head, targets, mtp_weights)
            return losses.sum()
        # Mean next-token CE of the softcapped bf16-head logits, through the fused kernel with the
        # single weight 1: it softcaps in fp32 (as the reference's compiled eval does) and never
        # materialises fp32 (T, V) tensors, which at 262,144 val tokens per rank would not fit next
        # to the 26 GB of bf16 logits.
        next_token_only = torch.ones(1, dtype=torch.float32, device=h.device)
        loss = (tk.softcapped_mtp_ce_reference if self.cfg.kernels == "torch"
                else tk.softcapped_mtp_ce)
        return loss(h @ self.lm_head, targets, next_token_only).mean()

    @torch.no_grad()
    def logits(self, inputs: Tensor, cu_seqlens: Tensor, ws_short: int, ws_long: int,
               max_seqlen: int) -> Tensor:
        """(T, V) fp32 softcapped scores of the next token at every position (what the loss scores;
        for sampling)."""
        return tk.softcap(self.final_hidden(inputs, cu_seqlens, ws_short, ws_long, max_seqlen)
                          @ self.lm_head)

    def final_hidden(self, inputs: Tensor, cu_seqlens: Tensor, ws_short: int, ws_long: int,
                     max_seqlen: int) -> Tensor:
        """The normed final residual h (T, D) bf16 that the LM head reads."""
        cfg, T = self.cfg, inputs.shape[0]
        if T > cfg.rotary_max_len:
            raise ValueError(f"micro-batch of {T} tokens exceeds "
                             f"rotary_max_len={cfg.rotary_max_len}; build the model with "
                             "rotary_max_len = the largest train/val micro-batch")
        L = cfg.num_layers
        resid_lambdas, sa_lambdas = self.scalars[:L], self.scalars[L: 3 * L].view(L, 2)
        smear_lambda, backout_lambda, skip_lambda = self.scalars[3 * L: 3 * L + 3].unbind()
        # (T, D) bf16 each
        ve = [F.embedding(inputs, getattr(self, name)) for name in self.ve_names]

        # Token smear: e'_t = e_t + smear_lambda * sigmoid(e_t[:12] . w) * e_{t-1}, across
        # document boundaries.
        e = F.embedding(inputs, self.embed)  # (T, D) bf16
        # (T-1, 1) bf16
        smear = smear_lambda * torch.sigmoid(e[1:, :GATE_INPUT_DIM] @ self.smear_gate.T)
        x = x0 = rms(torch.cat([e[:1], e[1:] + smear * e[:-1]]))

        # The banks as one view per slice. Indexing the bank per layer instead costs a backward
        # kernel that reads every layer's gradient for every element of the bank
        # (records/2026-11-22_bank_unbind_1xH200); unbind's backward stacks each slice's gradient
        # once. The same numbers either way.
        attn_banks = self.attn.unbind(0)                 # (4D, D) per attention layer
        mlp_banks = self.mlp.flatten(0, 1).unbind(0)     # c_fc, c_proj of layer j at 2j, 2j + 1
        mlp = tk.relu2_mlp_reference if cfg.kernels == "torch" else tk.relu2_mlp
        skip_saved = backout_saved = None
        for p in self.plan:
            i = p.index
            if i == cfg.skip_dest_layer:  # U-net skip, added before the lambda mix, per-token gate
                skip_scale = torch.sigmoid(skip_lambda) * 2                               # fp32 0-d
                x = x + (skip_scale * torch.sigmoid(x0[:, :GATE_INPUT_DIM] @ self.skip_gate.T)
                         * skip_saved)
            if i == 0:  # the first layer, where x is still x0: one
                        # scale (r_0 + x0_lambda_0), summed in fp32
                x = (resid_lambdas[0] + self.x0_lambdas[0]) * x
            else:
                x = resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            if p.attn:
                window = (ws_long if p.long_window else ws_short) * cfg.block_size          # tokens
                x = x + self.attention(p, attn_banks[p.attn_slot], rms(x),
                                       ve[p.ve_table] if p.ve_table >= 0 else None, sa_lambdas[i],
                                       cu_seqlens, max_seqlen, window)
            x = x + mlp(rms(x), mlp_banks[2 * i], mlp_banks[2 * i + 1])
            if i == cfg.skip_source_layer:
                skip_saved = x
            if i == cfg.backout_layer:
                backout_saved = x
        x = x - backout_lambda * backout_saved
        return rms(x)

    def attention(self, p: LayerPlan, bank: Tensor, u: Tensor, ve: Tensor | None, sa_lambda: Tensor,
                  cu_seqlens: Tensor, max_seqlen: int, window: int) -> Tensor:
        """One attention sublayer. bank (4D, D) = [W_q; W_k; W_v; W_o]; u = rms(x) (T, D) bf16 ->
        (T, D) bf16."""
        cfg = self.cfg
        T, D, H, hd = u.shape[0], cfg.model_dim, cfg.num_heads, cfg.head_dim
        lambda_qkv, lambda_o = sa_lambda.unbind()
        qkv = u @ (lambda_qkv * bank[: 3 * D]).T   # weights scaled and rounded to bf16 first
        q, k, v = qkv.view(T, 3, H, hd).unbind(1)  # (T, H, hd) each
        q, k = rms(q), rms(k)                      # QK-norm per head
        gate_in = u[:, :GATE_INPUT_DIM]
        if p.attn == "P":
            # Heads 2b, 2b+1 rotate at angle positions 2t, 2t+1: table rows [0, 2T) viewed as
            # (T, 1, 2, hd/2).
            cos = self.rotary_cos[: 2 * T].view(T, 1, 2, hd // 2)
            sin = self.rotary_sin[: 2 * T].view(T, 1, 2, hd // 2)
            q = apply_rotary(q.view(T, H // 2, 2, hd), cos, sin).view(T, H, hd)
            k = apply_rotary(k.view(T, H // 2, 2, hd), cos, sin).view(T, H, hd)
        else:
            # (T, 1, hd/2): angle = packed position
            cos, sin = self.rotary_cos[:T, None], self.rotary_sin[:T, None]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            if p.key_offset:
                k = shift_keys_by_one(k)
        if ve is not None:
            # Elementwise per (token, head), so adding it before the paired interleave equals adding
            # it after.
            ve_gate = 2 * torch.sigmoid(gate_in @ self.ve_gate_bank[p.ve_slot].T)  # (T, H)
            v = v + ve_gate[..., None] * ve.view(T, H, hd)
        if p.attn == "P":
            # Row-major reinterpretation as 2T positions of H/2 heads: position 2t slot g = head g
            # of token t, position 2t+1 slot g = head g + H/2. Lengths, offsets and the window are
            # in doubled positions.
            q, k, v = (t.reshape(2 * T, H // 2, hd) for t in (q, k, v))
            y = varlen_attention(q, k, v, cu_seqlens * 2, max_seqlen * 2, window, self.attn_scale,
                                 cfg.attn_backend)
            y = y.reshape(T, H, hd)
        else:
            y = varlen_attention(q, k, v, cu_seqlens, max_seqlen, window,
                                 self.attn_scale, cfg.attn_backend)
        # per-head output gate
        y = y * torch.sigmoid(gate_in @ self.attn_gate_bank[p.attn_slot].T)[..., None]
        return y.reshape(T, D) @ (lambda_o * bank[3 * D:]).T


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
POLAR_EXPRESS_SPLIT_ROWS = 1024
CPU_CHUNK_ELEMENTS = 1 << 16          # CPU only: element-wise updates run
                                      # in blocks this size (cache-resident)
NORMUON_EPS = 1e-10                    # floor of the second moment and of the renormalised norm


def _fp32(x: float) -> float:
    """Round a Python (double) float to the nearest fp32 value; optimizer scalars are computed in
    double, then this."""
    return float(np.float32(x))


def polar_express(G: Tensor, split_final_product: bool, dtype: torch.dtype = torch.bfloat16,
                  fused: bool = True) -> Tensor:
    """Approximate U·Vᵀ of G = U·S·Vᵀ for a batch (..., R, C) of matrices, in bf16.

    Five odd-polynomial iterations X <- a·X + (b·A + c·A²)·X with A = X·Xᵀ, on the short
    side (transposed when R > C, so A is the smaller Gram matrix). X is first scaled by its
    Frobenius norm (+2% safety) so every singular value lies in (0, 1), where the coefficients push
    it towards 1. split_final_product: round B@X to bf16 before adding a·X (two roundings, as the
    record does for the MLP matrices) instead of one fused GEMM with beta = a.
    dtype: the precision of the iteration; bf16 in training, float32/float64 for parameters stored
    in that (--dtype).
    fused=False (--kernels=torch): the Gram products and the split product by their plain-PyTorch
    definitions, also on CUDA.
    """
    shape = G.shape
    xxt, ba_plus_cAA, split_product_ = (
        (tk.xxt, tk.ba_plus_cAA, tk.polar_split_product_) if fused
        else (tk.xxt_reference, tk.ba_plus_cAA_reference, tk.polar_split_product_reference))
    X = G.to(dtype).reshape(-1, shape[-2], shape[-1])       # (n, R, C)
    if shape[-2] > shape[-1]:
        X = X.mT                                            # (n, C, R): Gram matrices are C x C
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * (1 + 2e-2) + 1e-6)
    for a, b, c in POLAR_EXPRESS_COEFFS:
        A = xxt(X)                                          # (n, m, m) bf16, exactly symmetric
        B = ba_plus_cAA(A, b, c)                            # (n, m, m) bf16
        if split_final_product:
            X = split_product_(B @ X, X, a)                 # bf16(bf16(B@X) + a·X)
        else:
            X = torch.baddbmm(X, B, X, beta=a)              # bf16(a·X + B@X), fp32 accumulation
    if shape[-2] > shape[-1]:
        X = X.mT
    return X.reshape(shape)


def adam_update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *,
                beta1: float, beta2: float, eps: float, step_size: float | Tensor,
                decay: float | Tensor, fused: bool = True) -> None:
    """One Adam update of a slice in place, all arithmetic in fp32.

    step_size = fp32(lr·sqrt(1-beta2^t)/(1-beta1^t)) and decay = fp32(lr²·wd) come from
    adam_scalars(). eps is not bias corrected. Cautious decay only where the update and the weight
    agree in sign (strict >). A bf16 param takes the round-to-nearest of the fp32 result
    (no master copy). The moments' dtype sets the precision: fp32, or float64 for a float64
    parameter (--dtype=float64). fused=False (--kernels=torch): the eager math on CUDA too.
    """
    if (fused and param.is_cuda and not isinstance(step_size, Tensor)
            and not isinstance(decay, Tensor)):
        # One fused Triton pass (triton_kernels.py section 5), bitwise its eager reference as
        # PyTorch runs it on CUDA.
        tk.adam_update(param, grad, exp_avg, exp_avg_sq, beta1=beta1, beta2=beta2, eps=eps,
                       step_size=step_size, decay=decay)
        return
    if param.device.type == "cpu" and param.dim() > 0 and param.numel() > CPU_CHUNK_ELEMENTS:
        # Element-wise math, so row blocks give the same bits; each block's temporaries stay in the
        # CPU's cache (the whole-table temporaries do not, which slowed the tiny preset's Adam
        # steps).
        rows = max(1, CPU_CHUNK_ELEMENTS * param.shape[0] // param.numel())
        for p, g, m, v in zip(*(t.split(rows) for t in (param, grad, exp_avg, exp_avg_sq))):
            adam_update(p, g, m, v, beta1=beta1, beta2=beta2, eps=eps, step_size=step_size,
                        decay=decay)
        return
    # The eager math lives beside its kernel (one definition): m, v moments, then the cautious decay
    # and the step.
    tk.adam_update_reference(param, grad, exp_avg, exp_avg_sq, beta1=beta1, beta2=beta2, eps=eps,
                             step_size=step_size, decay=decay)


def adam_scalars(lr: float, t: int, beta1: float, beta2: float, wd: float) -> tuple[float, float]:
    """(step_size, decay) for adam_update: computed in double, rounded to fp32. lr includes lr_mul;
    decay uses lr²."""
    step_size = _fp32(lr * (math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)))
    decay = _fp32(lr * lr * wd)
    return step_size, decay


def variance_normalize_(O: Tensor, second_moment: Tensor, beta2: float) -> Tensor:
    """NorMuon's low-rank second moment: O (n, R, C) bf16 -> O with each row (R >= C) or column
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


def normuon_direction_(grad: Tensor, momentum_buffer: Tensor, second_moment: Tensor, *,
                       momentum: float, beta2: float, split_final_product: bool,
                       fused: bool = True) -> Tensor:
    """Momentum, Polar Express and variance normalisation of one chunk; updates both buffers.

    grad (n, R, C) bf16, momentum_buffer (n, R, C) fp32 -> O (n, R, C) bf16 (float32/64 grads: all
    in their dtype).
    """
    # M <- lerp(M, G, 1 - mu); U = lerp(G, M, mu) (Nesterov-style), in grad's dtype
    momentum_step = tk.normuon_momentum if fused else tk.normuon_momentum_reference
    U = momentum_step(grad, momentum_buffer, momentum)
    O = polar_express(U, split_final_product, dtype=grad.dtype, fused=fused)
    return variance_normalize_(O, second_moment, beta2)


def cautious_update_with_mantissa_(param: Tensor, mantissa: Tensor, O: Tensor, *,
                                   lr: float | Tensor, wd: float | Tensor,
                                   fused: bool = True) -> None:
    """P <- (P - ((P·mask)·wd)·lr) - O·lr on the fp32 master P = (bf16 bits << 16) | mantissa.

    param (n, R, C) bf16 and mantissa (n, R, C) uint16 are updated in place: the bf16 keeps the high
    16 bits of the new master (truncation toward zero), the mantissa the low 16. mask = [O·P >= 0]
    (non-strict: entries with zero update are decayed too). lr is fp32, a scalar or (n, 1, 1) per
    matrix; wd is fp32.
    """
    if fused and param.is_cuda and not isinstance(wd, Tensor):
        # One fused Triton pass (triton_kernels.py section 6), bitwise the eager code below.
        tk.cautious_update_with_mantissa(param, mantissa, O, lr=lr, wd=wd)
        return
    high = param.view(torch.int16).to(torch.int32) << 16
    low = mantissa.view(torch.int16).to(torch.int32) & 0xFFFF
    P = (high | low).view(torch.float32)
    bits = _cautious_step(P, O.float(), lr, wd).view(torch.int32)
    param.view(torch.int16).copy_((bits >> 16).to(torch.int16))
    # low 16 bits, sign-extended to fit
    mantissa.view(torch.int16).copy_(((bits << 16) >> 16).to(torch.int16))


def _cautious_step(P: Tensor, O: Tensor, lr: float | Tensor, wd: float | Tensor) -> Tensor:
    """(P - ((P·mask)·wd)·lr) - O·lr with mask = [O·P >= 0]: cautious weight decay, then the
    step."""
    mask = O * P >= 0
    return (P - ((P * mask) * wd) * lr) - O * lr


def normuon_update(param: Tensor, grad: Tensor, momentum_buffer: Tensor, second_moment: Tensor,
                   mantissa: Tensor | None, *, momentum: float, beta2: float, lr: float | Tensor,
                   wd: float | Tensor, split_final_product: bool, fused: bool = True) -> None:
    """One NorMuon update of a chunk of matrices in place. All tensors (n, R, C) except
    second_moment ((n, R, 1) or (n, 1, C)); lr (fp32 scalar or (n, 1, 1)) and wd from
    normuon_scalars().
    mantissa is None for a float32/float64 parameter (--dtype), which is its own master."""
    O = normuon_direction_(grad, momentum_buffer, second_moment, momentum=momentum, beta2=beta2,
                           split_final_product=split_final_product, fused=fused)
    if mantissa is None:
        param.copy_(_cautious_step(param, O, lr, wd))
    else:
        cautious_update_with_mantissa_(param, mantissa, O, lr=lr, wd=wd, fused=fused)


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


class NorMuonAndAdam:
    """One optimizer for every parameter, configured per label by a table.

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
                 tied: tuple[str, str] | None = ("lm_head", "embed"), fused: bool = True):
        self.params = dict(named_params)
        self.table = {label: dict(row) for label, row in param_table.items()}
        self.scatter_order, self.work_order = tuple(self.table), update_order(self.table)
        self.adam_lr, self.adam_eps, self.adam_wd = adam_lr, adam_eps, adam_wd
        self.muon_lr, self.muon_beta2, self.muon_wd = muon_lr, muon_beta2, muon_wd
        self.rank, self.world_size = rank, world_size
        self.fused = fused            # False (--kernels=torch): the updates' plain-PyTorch
                                      # definitions, also on CUDA
        self.tied = tuple(tied) if tied is not None else None
        self._validate()
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

    # ---- validation ------------------------------------------------------------------------------
    def _validate(self) -> None:
        for label in self.params:
            if label not in self.table:
                raise ValueError(f"parameter {label!r} has no row in the optimizer table: "
                                 "add it to param_table (DEFAULT_PARAM_TABLE in train_gpt.py)")
        for label in self.table:
            if label not in self.params:
                raise ValueError(f"param_table row {label!r} names no model parameter (parameters: "
                                 f"{', '.join(self.params)}): remove the row or fix its name")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} / world_size {self.world_size} is not a valid "
                             "process placement")
        for label, row in self.table.items():
            p = self.params[label]
            if row.get("optim") not in ("adam", "normuon"):
                raise ValueError(f"param_table[{label!r}] optim={row.get('optim')!r}: "
                                 "use 'adam' or 'normuon'")
            if row.get("comms") not in ("none", "replicated", "sharded"):
                raise ValueError(f"param_table[{label!r}] comms={row.get('comms')!r}: "
                                 "use 'none', 'replicated' or 'sharded'")
            for key in ("lr_mul", "wd_mul"):
                if not isinstance(row.get(key), (int, float)):
                    raise ValueError(f"param_table[{label!r}] needs a number {key}=")
            if row["optim"] == "adam":
                betas = row.get("betas")
                if betas is None or len(betas) != 2 or not all(0 <= b < 1 for b in betas):
                    raise ValueError(f"param_table[{label!r}] is an Adam row and needs "
                                     "betas=(beta1, beta2) in [0, 1)")
                if row["comms"] == "sharded" and p.shape[0] % self.world_size:
                    raise ValueError(f"{label} has {p.shape[0]} rows in dim 0 of {tuple(p.shape)}, "
                                     f"not divisible by world_size {self.world_size}: "
                                     f"set param_table[{label!r}] comms='replicated' "
                                     f"or use a world size that divides {p.shape[0]}")
                continue
            shape = row.get("matrix_shape")
            if (shape is None or len(shape) != 2 or p.numel() % (shape[0] * shape[1])
                    or p.shape[-1] != shape[1]):
                raise ValueError(f"{label} of shape {tuple(p.shape)} cannot be viewed as a stack "
                                 f"of matrix_shape={shape} matrices: fix "
                                 f"param_table[{label!r}]['matrix_shape'] (rows, cols) to match "
                                 "the bank")
            if p.dtype not in (torch.bfloat16, torch.float32, torch.float64):
                raise ValueError(f"NorMuon parameter {label} is {p.dtype}; store it in bf16 "
                                 "(its fp32 master is bf16 + a 16-bit mantissa), float32 or "
                                 "float64, or make it an Adam row")
            if not row.get("matrix_lr_muls", (1.0,)):
                raise ValueError(f"param_table[{label!r}] matrix_lr_muls is empty: "
                                 "give at least one multiplier")
            n_matrices = p.numel() // (shape[0] * shape[1])
            if row["comms"] == "sharded" and n_matrices % self.world_size:
                raise ValueError(f"{label} bank has {n_matrices} matrices, not divisible by "
                                 f"world_size {self.world_size}: pad the bank "
                                 "(ModelConfig.bank_multiple) or use a world size that divides "
                                 f"{n_matrices}")
        if self.tied is not None:
            head, embed = self.tied
            for label in (head, embed):
                if label not in self.table or self.table[label]["optim"] != "adam":
                    raise ValueError(f"tied=({head!r}, {embed!r}): {label!r} must be an Adam "
                                     "parameter label; pass tied=None to train them separately")
            if (self.params[head].shape != self.params[embed].shape[::-1]
                    or self.params[head].dim() != 2):
                raise ValueError(f"tied {head} {tuple(self.params[head].shape)} is not the "
                                 f"transpose of {embed} {tuple(self.params[embed].shape)}: "
                                 f"store {head} as (model_dim, vocab)")

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
            return (dist.reduce_scatter_tensor(chunk, full, op=dist.ReduceOp.AVG, async_op=True),
                    chunk)
        return None, self._bank_view(label, grad)

    def _launch_gather(self, label: str):
        """Start all-gathering this rank's updated slice into the full parameter (in place); None if
        not sharded."""
        if not self._is_sharded(label):
            return None
        full = self._bank_view(label, self.params[label].detach())
        return dist.all_gather_into_tensor(full, self._local(label, full), async_op=True)

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
                        eps=self.adam_eps, step_size=step_size, decay=decay, fused=self.fused)
            return
        lr, wd = normuon_scalars(self.muon_lr, lr_factor, self.muon_wd, row["wd_mul"])
        scale = self._lr_scales[label]
        lr_eff = _fp32(scale * lr) if isinstance(scale, float) else (scale * lr).float()
        normuon_update(param, grad, buf["momentum"], buf["second_moment"], buf.get("mantissa"),
                       momentum=momentum, beta2=self.muon_beta2, lr=lr_eff, wd=wd,
                       split_final_product=row["matrix_shape"][0] > POLAR_EXPRESS_SPLIT_ROWS,
                       fused=self.fused)

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
                dist.all_gather_into_tensor(full, src)
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
# The data pipeline. Shards are FineWeb's GPT-2 token files. Training batches are BOS aligned (every
# segment starts at a document start and is at most max_seq_len long); validation batches are a
# plain cut of the val stream. Every rank builds the joint batch of all ranks and keeps its own
# part, so no communication is needed and the tokens of an optimizer step do not depend on the world
# size.

BOS_ID = 50256                          # GPT-2 <|endoftext|>; every FineWeb document starts with it
# header: 256 int32 words: magic, version, n
SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_BYTES = 20240520, 1, 1024
_QUICK_SCAN_TOKENS = 4_000_000          # the first batches come from this
                                        # prefix of shard 0 while the rest loads

_GET_DATA_HINT = ("download FineWeb shards with `python data/cached_fineweb10B.py 9` (any N also "
                  "fetches the val shard), or for a smoke test make synthetic ones with "
                  "`python data/synthetic.py --out DIR` and pass "
                  "--train_files='DIR/fineweb_train_*.bin' --val_files='DIR/fineweb_val_*.bin'")


class DataError(RuntimeError):
    """Missing or bad data, or options that do not fit the data; the message says what to run or
    change."""


def resolve_shards(pattern: str, kind: str) -> list[str]:
    """The shard files matching `pattern`, sorted; kind is "train" or "val" (for the error
    message)."""
    files = sorted(glob.glob(pattern))
    option = "--train_files" if kind == "train" else "--val_files"
    for path in files:
        if os.path.isdir(path):
            raise DataError(f"{option}={pattern} matches the folder {path}: make the pattern match "
                            f"shard files only (e.g. DIR/fineweb_{kind}_*.bin)")
        if not os.path.exists(path):
            raise DataError(f"{path} (matched by {option}={pattern}) is a broken symbolic link: "
                            "point it at its shard again or delete it")
    if files:
        return files
    folder = os.path.dirname(pattern) or "."
    problem = (f"the folder {folder!r} does not exist"
               if not glob.has_magic(folder) and not os.path.isdir(folder)
               else f"no file matches {pattern!r}")
    raise DataError(f"no {kind} shards: {problem} ({option}={pattern}); {_GET_DATA_HINT}")


def _read_header(f, path: str) -> int:
    """Check the header and the size of the open shard file `f`; return its token count n."""
    raw = f.read(SHARD_HEADER_BYTES)
    size = os.fstat(f.fileno()).st_size
    if len(raw) < SHARD_HEADER_BYTES:
        raise DataError(f"shard {path} is truncated: {size} bytes, less than the "
                        f"{SHARD_HEADER_BYTES}-byte header; delete it and download or "
                        "generate it again")
    magic, version, n = (int(w) for w in np.frombuffer(raw, dtype="<i4", count=3))
    if magic != SHARD_MAGIC:
        raise DataError(f"shard {path} has bad magic {magic} (expected {SHARD_MAGIC}), so it is "
                        "not a token shard; remove it or change --train_files/--val_files")
    if version != SHARD_VERSION:
        raise DataError(f"shard {path} has bad version {version} (expected {SHARD_VERSION}); "
                        "make it again with data/tokenize_docs.py or download it again with "
                        "data/cached_fineweb10B.py")
    expected = SHARD_HEADER_BYTES + 2 * n
    if size != expected:
        raise DataError(f"shard {path} is truncated (or has trailing bytes): its header says {n} "
                        f"tokens, so expected {expected} bytes, found {size}; delete it and "
                        "download or generate it again")
    return n


def _open_shard(path: str):
    """open(path, "rb"), with the reason a shard cannot be read as a DataError that names the
    file."""
    try:
        return open(path, "rb")
    except PermissionError:
        raise DataError(f"cannot read shard {path}: permission denied; make it readable "
                        "(chmod a+r) or change --train_files/--val_files") from None
    except OSError as e:
        raise DataError(f"cannot read shard {path}: {e.strerror or e}; check the file or change "
                        f"--train_files/--val_files") from None


def shard_num_tokens(path: str) -> int:
    """The token count of a shard, after checking its magic, version and file size."""
    with _open_shard(path) as f:
        return _read_header(f, path)


_ID_CHECK_CHUNK = 1 << 22   # tokens per max(): a background thread
                            # lets go of the GIL between chunks


def check_token_ids(tokens: np.ndarray, vocab_size: int, path: str, first: int = 0) -> None:
    """DataError if a token id does not fit the embedding table (an index past it would crash the
    GPU mid-run).
    tokens are positions first.. of the shard `path`."""
    for s in range(0, len(tokens), _ID_CHECK_CHUNK):
        chunk = tokens[s:s + _ID_CHECK_CHUNK]
        top = int(chunk.max(initial=0))
        if top >= vocab_size:
            pos = first + s + int(np.argmax(chunk >= vocab_size))
            raise DataError(f"shard {path} holds token id {top} (first bad id at token {pos:,}) "
                            f"but --vocab_size={vocab_size}: it was made with another tokenizer. "
                            "Make shards with GPT-2 ids (data/tokenize_docs.py) or raise "
                            f"--vocab_size to a multiple of 128 above {top}")


def _read_tokens(path: str, max_tokens: int | None = None,
                 out: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """(tokens uint16, n): all n tokens of a checked shard, or only its first max_tokens; read into
    `out` if given."""
    with _open_shard(path) as f:
        n = _read_header(f, path)
        count = n if max_tokens is None else min(n, max_tokens)
        tokens = np.empty(count, dtype=np.uint16) if out is None else out[:count]
        got = f.readinto(memoryview(tokens).cast("B"))
    if got != 2 * count:
        raise DataError(f"shard {path}: read {got} of {2 * count} token bytes (did the file change "
                        "while it was read?); download or generate it again")
    return tokens, n


def load_shard(path: str, pin_memory: bool = False) -> Tensor:
    """All tokens of a checked shard as a uint16 tensor (n,); page-locked if pin_memory (for fast
    copies to a GPU)."""
    tokens = torch.empty(shard_num_tokens(path), dtype=torch.uint16, pin_memory=pin_memory)
    _read_tokens(path, out=tokens.numpy())
    return tokens


def max_num_docs(num_tokens: int, tokens_per_doc_bound: int) -> int:
    """Fixed length of cu_seqlens for a batch of num_tokens: floor(N / bound) rounded up to a
    multiple of 128, at least 128. A fixed length keeps the compiled attention shapes static."""
    return max(128, -(-(num_tokens // tokens_per_doc_bound) // 128) * 128)


def _check_doc_capacity(num_seqs: int, num_tokens: int, tokens_per_doc_bound: int,
                        what: str) -> None:
    """num_seqs sequences need num_seqs + 1 boundaries in cu_seqlens; fail loudly rather than
    overflow."""
    capacity = max_num_docs(num_tokens, tokens_per_doc_bound)
    if num_seqs + 1 > capacity:
        fits = num_tokens // (num_seqs + 1)
        raise DataError(
            f"{what} of {num_tokens} tokens holds {num_seqs} sequences, but cu_seqlens has room "
            f"for {capacity - 1}: --tokens_per_doc_bound={tokens_per_doc_bound} assumes "
            "documents average more tokens than these do. Lower it: "
            f"--tokens_per_doc_bound={fits} fits this batch, {max(1, fits // 2)} leaves headroom")


class _Background:
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


class _ShardIndex:
    """A training shard's tokens (uint16) and its sorted BOS positions. For the quick index of a
    prefix (complete=False) the last document's end is unknown, so that document is left out of
    doc_lens."""

    def __init__(self, path: str, tokens: np.ndarray, complete: bool,
                 vocab_size: int | None = None):
        self.path, self.tokens, self.complete = path, tokens, complete
        if vocab_size is not None:
            check_token_ids(tokens, vocab_size, path)
        self.bos = np.flatnonzero(tokens == BOS_ID)              # (num_docs,) int64
        if len(self.bos) == 0:
            raise DataError(f"shard {path} has no document start (token {BOS_ID}) in its "
                            f"{'' if complete else 'first '}{len(tokens):,} tokens, and training "
                            "batches start at documents: make shards with data/tokenize_docs.py, "
                            "which starts every document with it")
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
    next. The first starts from a quick index of its first _QUICK_SCAN_TOKENS tokens while a thread
    indexes all of it; the quick document list is a prefix of the full one, so which index built a
    batch does not change the batch."""

    def __init__(self, files: list[str], vocab_size: int | None, first: int = 0):
        self.files, self.shard, self.vocab_size = files, first, vocab_size
        tokens, n = _read_tokens(files[first], _QUICK_SCAN_TOKENS)
        self.current = _ShardIndex(files[first], tokens, complete=len(tokens) == n,
                                   vocab_size=vocab_size)
        self.tokens_done = 0                       # tokens in the shards used up
                                                   # so far (for the error message)
        self._full_current = (None if self.current.complete
                              else _Background(lambda: self._load(first)))
        self._next = None
        if self._full_current is None:
            self._prefetch()

    def _load(self, k: int) -> _ShardIndex:
        return _ShardIndex(self.files[k], _read_tokens(self.files[k])[0], complete=True,
                           vocab_size=self.vocab_size)

    def _prefetch(self) -> None:
        k = self.shard + 1
        self._next = _Background(lambda: self._load(k)) if k < len(self.files) else None

    def _take_full_current(self) -> None:
        self.current, self._full_current = self._full_current.result(), None
        self._prefetch()

    def poll(self) -> None:
        """Re-raise a failure of a background load now; switch to the full index of shard 0 once it
        is ready."""
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
        self.current, self.shard = self._next.result(), self.shard + 1
        self._prefetch()
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


def _micro_batch_tokens(global_batch: int, grad_accum: int, world_size: int) -> int:
    """N = per-rank tokens of one micro-batch."""
    if global_batch <= 0 or grad_accum <= 0 or global_batch % (grad_accum * world_size) != 0:
        raise DataError(f"the global batch of {global_batch} tokens does not divide into "
                        f"world_size * grad_accum = {world_size} * {grad_accum} micro-batches; "
                        "change the batches in --stages or --batch_slices "
                        "(= processes * accumulation steps), or the number of processes")
    return global_batch // (grad_accum * world_size)


def _to_device(array: np.ndarray, dtype: type, device: torch.device) -> Tensor:
    """Host array -> tensor of numpy `dtype` (np.int32 / np.int64) on `device`; numpy does the cast
    (torch's uint16 casts are slow). On CUDA the data goes through a fresh pinned buffer and a
    non-blocking copy; the caching host allocator does not reuse that buffer before the copy has
    run."""
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


def train_batches(files: list[str], global_batch: int, grad_accum: int, rank: int, world_size: int,
                  device: torch.device, max_seq_len: int, tokens_per_doc_bound: int,
                  vocab_size: int | None = None, position: TrainPosition | None = None,
                  ) -> Generator[tuple[Tensor, Tensor, Tensor], tuple[int, int, int] | None, None]:
    """BOS-aligned training micro-batches of `rank`. Each request yields
    (inputs int32 (N,), targets int64 (N,), cu_seqlens int32 (max_num_docs(N),)) on device,
    N = global_batch/(A*W).
    With each request send None or (global_batch, max_seq_len, grad_accum); a triple applies to the
    batch it gets.
    The arguments are checked now; the first shard is read on the first request (inside the timed
    region, as in the record).
    With vocab_size, every shard's token ids are checked when it is loaded (in the loading thread,
    off the GPU's critical path): an id past the embedding fails with the shard and position instead
    of a device-side assert.
    The stream starts at `position` (default: the first document) and keeps it up to date."""
    if not files:
        raise DataError(f"no training shards given; {_GET_DATA_HINT}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    position = position if position is not None else TrainPosition()
    if not 0 <= position.shard < len(files):
        raise DataError(f"the stream position is in shard {position.shard}, but --train_files "
                        f"matches {len(files)} shards: give the shards the run started with")
    _micro_batch_tokens(global_batch, grad_accum, world_size)
    return _train_batch_stream(list(files), global_batch, grad_accum, rank, world_size, device,
                               max_seq_len, tokens_per_doc_bound, vocab_size, position)


def _train_batch_stream(files: list[str], global_batch: int, grad_accum: int, rank: int,
                        world_size: int, device: torch.device, max_seq_len: int,
                        tokens_per_doc_bound: int, vocab_size: int | None,
                        position: TrainPosition):
    tokens_per_rank = _micro_batch_tokens(global_batch, grad_accum, world_size)
    shards = _TrainShards(files, vocab_size, first=position.shard)
    cursor = position.cursor                     # index of the next unused
                                                 # document of the current shard
    message = None
    while True:
        if message is not None:                  # applies to the batch answering it
            global_batch, max_seq_len, grad_accum = message
            tokens_per_rank = _micro_batch_tokens(global_batch, grad_accum, world_size)
        shards.poll()
        while (cursors := _plan_joint_batch(shards.current.cum_lens(max_seq_len), cursor,
                                            tokens_per_rank, world_size)) is None:
            if shards.extend():                  # abandon the partial batch; restart
                                                 # it from the next shard's start
                cursor = 0
        shard = shards.current
        first, end = cursors[rank], cursors[rank + 1]
        cursor = cursors[-1]                     # commit after all ranks are planned
        position.shard, position.cursor = shards.shard, cursor
        # This rank's segments: documents first..end-1 cut to max_seq_len, the last one cut so that
        # the segments hold exactly N + 1 tokens (its final token is only a target).
        seg_lens = np.minimum(shard.doc_lens[first:end], max_seq_len)                    # (m,)
        seg_lens[-1] = tokens_per_rank + 1 - (seg_lens.sum() - seg_lens[-1])
        _check_doc_capacity(len(seg_lens), tokens_per_rank, tokens_per_doc_bound,
                            "a training micro-batch")
        # (N+1,) uint16
        buf = np.concatenate([shard.tokens[s:s + n] for s, n in zip(shard.bos[first:end].tolist(),
                                                                     seg_lens.tolist())])
        # Boundaries [0, l1, l1+l2, ..., N] padded with N; the last segment lent its last token as
        # the final target.
        cu_seqlens = np.full(max_num_docs(tokens_per_rank, tokens_per_doc_bound), tokens_per_rank,
                             dtype=np.int32)
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
        raise DataError(f"no validation shards given; {_GET_DATA_HINT}")
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
    sizes = [shard_num_tokens(path) for path in files]
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
        with _open_shard(files[shard]) as f:
            f.seek(SHARD_HEADER_BYTES + 2 * start)
            buf = np.fromfile(f, dtype=np.uint16, count=tokens_per_rank + 1)   # (N_val+1,) uint16
        if len(buf) != tokens_per_rank + 1:
            raise DataError(f"val shard {files[shard]} shrank while being read; "
                            "download or generate it again")
        if vocab_size is not None:
            check_token_ids(buf, vocab_size, files[shard], first=start)
        inputs = buf[:-1]
        bos = np.flatnonzero(inputs == BOS_ID)                                 # (m,) positions
        # [0, b_1, b_2, ...] padded with N_val: the partial document before b_1 is its own sequence
        # (empty if inputs[0] is a BOS), and val documents are not cut to a maximum length.
        _check_doc_capacity(len(bos) + 1, tokens_per_rank, tokens_per_doc_bound,
                            "a validation forward")
        cu_seqlens = np.full(max_num_docs(tokens_per_rank, tokens_per_doc_bound), tokens_per_rank,
                             dtype=np.int32)
        cu_seqlens[0] = 0
        cu_seqlens[1:len(bos) + 1] = bos
        yield (_to_device(inputs, np.int32, device), _to_device(buf[1:], np.int64, device),
               _to_device(cu_seqlens, np.int32, device))


# ==================================================================================================
# 6. Schedules: pure functions of the step
# ==================================================================================================

def stage_index(step: int, num_scheduled: int, num_stages: int, strict: bool = False) -> int:
    """The stage of `step`: stage k starts at the first step with
    step / num_scheduled >= k / num_stages (steps past the schedule stay in the last).
    strict: > instead of >=, which starts a stage one step later exactly where
    step / num_scheduled == k / num_stages (step 575 of the record's 1725), the record's rule for
    the lr peak."""
    x = step / num_scheduled
    return sum((x > k / num_stages) if strict else (x >= k / num_stages)
               for k in range(1, num_stages))


def global_batch_size(step: int, num_scheduled: int, stages: Sequence[Stage]) -> int:
    return stages[stage_index(step, num_scheduled, len(stages))].batch


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
    """Multiplier on every base lr: the stage's peak, then a linear cooldown to lr_min, then lr_min.
    The peak changes one step after the batch and windows where a stage starts exactly on a step
    (strict stage_index)."""
    if step > num_scheduled:
        return lr_min
    x = step / num_scheduled
    peak = stages[stage_index(step, num_scheduled, len(stages), strict=True)].lr_peak
    if x >= 1 - cooldown_frac:
        w = (1 - x) / cooldown_frac
        return peak * w + lr_min * (1 - w)
    return peak


def muon_momentum(step: int, num_iterations: int, lo: float, hi: float, warmup: int,
                  cooldown: int) -> float:
    """NorMuon momentum: lo -> hi over `warmup` steps, hi, then down by (hi - lo) over the last
    `cooldown` steps."""
    if step < warmup:
        return lo + (hi - lo) * step / warmup
    if step > num_iterations - cooldown:
        return hi - (hi - lo) * (step - (num_iterations - cooldown)) / cooldown
    return hi


def mtp_weights(step: int, num_scheduled: int, stages: Sequence[Stage]) -> tuple[float, ...]:
    """The stage's multi-token-prediction weights, the last of several fading linearly to 0 across
    the stage."""
    k, n = stage_index(step, num_scheduled, len(stages)), len(stages)
    weights = stages[k].mtp_weights
    if len(weights) == 1:
        return tuple(weights)
    fade = k + 1 - n * min(step / num_scheduled, 1.0)         # 1 at the stage's start, 0 at its end
    return (*weights[:-1], weights[-1] * fade)


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
    ws_short, ws_long = window_sizes(step, ns, hp.stages, hp.ws_long_extension)
    return StepSchedule(
        step=step,
        global_batch=global_batch_size(step, ns, hp.stages),
        ws_short=ws_short, ws_long=ws_long,
        lr_factor=lr_factor(step, ns, hp.stages, hp.lr_min, hp.cooldown_frac),
        momentum=muon_momentum(step, hp.num_iterations, hp.momentum_min, hp.momentum_max,
                               hp.momentum_warmup_steps, hp.momentum_cooldown_steps),
        mtp_weights=mtp_weights(step, ns, hp.stages),
        do_adam=step % 2 == 1,
    )


# ==================================================================================================
# 7. Validation of the configuration, preflight checks, logging, checkpoints
# ==================================================================================================


def micro_batch_tokens(global_batch: int, batch_slices: int) -> int:
    """Per-rank tokens per micro-step: the global batch cut into batch_slices, whatever the world
    size."""
    return global_batch // batch_slices


def validate_hyperparameters(hp: Hyperparameters, world_size: int) -> None:
    """Check every option and derived quantity once, right after parsing; each error names the
    option (or GPU count) to change. The model's and the optimizer's own checks run too, by building
    both on the meta device."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    for name in ("val_tokens", "val_batch_size", "train_max_seq_len", "tokens_per_doc_bound",
                 "batch_slices", "block_size", "ws_long_extension", "ws_long_final_val",
                 "vocab_size", "model_dim", "num_heads", "head_dim", "mlp_hidden", "num_layers",
                 "momentum_warmup_steps", "momentum_cooldown_steps", "rope_base", "attn_scale",
                 "adam_eps", "pg_timeout_s"):
        need(getattr(hp, name) > 0, f"--{name}={getattr(hp, name)} must be positive")
    for name in ("num_extension_iterations", "num_value_embeds", "val_loss_every",
                 "nonfinite_check_every", "checkpoint_every", "train_loss_every", "lr_min",
                 "adam_lr", "adam_wd", "muon_lr", "muon_wd", "yarn_alpha"):
        need(getattr(hp, name) >= 0, f"--{name}={getattr(hp, name)} must be >= 0")
    need(hp.compile_helpers >= -1, f"--compile_helpers={hp.compile_helpers} must be -1 (auto), "
         "0 (none) or a count")
    need(len(hp.fp8_scales) == 3 and all(v > 0 for v in hp.fp8_scales),
         f"--fp8_scales={_show(hp.fp8_scales)} needs 3 positive scales (x, w, grad)")
    need(len(hp.stages) >= 1, "--stages needs at least one stage")
    for i, st in enumerate(hp.stages):
        need(st.batch > 0 and st.ws_long > 0 and st.lr_peak >= 0 and len(st.mtp_weights) >= 1
             and st.mtp_weights[0] > 0 and min(st.mtp_weights) >= 0,
             f"stage {i + 1} of --stages ({_show((st,))}) needs a positive batch and window, "
             "an lr peak >= 0, and weights >= 0 with a positive first (next-token) weight")
    need(world_size >= 1 and hp.batch_slices % world_size == 0,
         f"world size {world_size} does not divide --batch_slices={hp.batch_slices}: "
         "run on 1, 2, 4 or 8 GPUs (./run.sh picks the GPU count; set CUDA_VISIBLE_DEVICES or "
         "NPROC to choose)")
    for st in hp.stages:
        need(st.batch % hp.batch_slices == 0
             and micro_batch_tokens(st.batch, hp.batch_slices) % 16 == 0,
             f"global batch {st.batch} in --stages must split into "
             f"--batch_slices={hp.batch_slices} micro-batches of a multiple of 16 tokens: "
             f"use a multiple of {16 * hp.batch_slices}")
    need(hp.val_batch_size % (16 * hp.batch_slices) == 0,
         f"--val_batch_size={hp.val_batch_size} must be a multiple of {16 * hp.batch_slices} "
         "(16 * --batch_slices)")
    need(hp.val_tokens % hp.val_batch_size == 0,
         f"--val_tokens={hp.val_tokens} must be a positive multiple of "
         f"--val_batch_size={hp.val_batch_size}")
    need(hp.num_scheduled_iterations >= len(hp.stages),
         f"--num_scheduled_iterations={hp.num_scheduled_iterations} must be >= {len(hp.stages)} "
         "(a step per stage)")
    need(0 < hp.cooldown_frac <= 1, f"--cooldown_frac={hp.cooldown_frac} must be in (0, 1]")
    need(0 < hp.split_frac <= 1, f"--split_frac={hp.split_frac} must be in (0, 1]")
    need(hp.split_step < hp.num_iterations,
         f"split step {hp.split_step} is past the last step: lower --split_frac")
    need(0 <= hp.momentum_min <= hp.momentum_max < 1,
         f"need 0 <= --momentum_min ({hp.momentum_min}) <= --momentum_max ({hp.momentum_max}) < 1")
    need(0 <= hp.muon_beta2 < 1, f"--muon_beta2={hp.muon_beta2} must be in [0, 1)")
    need(hp.yarn_alpha < hp.yarn_beta,
         f"--yarn_alpha={hp.yarn_alpha} must be below --yarn_beta={hp.yarn_beta}")
    need(hp.checkpoint_keep >= 1,
         f"--checkpoint_keep={hp.checkpoint_keep} must be >= 1 (2 survives a crash while writing)")
    need(hp.seed >= -1, f"--seed={hp.seed}: use -1 (unseeded) or a seed >= 0")
    need(hp.attn_backend in ("auto", *ATTN_BACKENDS),
         f"--attn_backend={hp.attn_backend} is not one of auto, {', '.join(ATTN_BACKENDS)}")
    need(hp.device in ("auto", "cuda", "cpu"),
         f"--device={hp.device} is not one of auto, cuda, cpu")
    need(hp.kernels in ("fused", "torch"), f"--kernels={hp.kernels} is not one of fused, torch")
    need(hp.run_id not in (".", "..") and "/" not in hp.run_id and os.sep not in hp.run_id,
         f"--run_id={hp.run_id!r} names the log file logs/<run_id>.txt: use letters, digits, "
         "'-', '_' or '.' only")
    need(hp.vocab_size > BOS_ID and hp.vocab_size % 16 == 0,
         f"--vocab_size={hp.vocab_size} must hold the BOS id {BOS_ID} and be a multiple of 16 "
         "(FP8 matmul)")
    if hp.profile_steps:
        ranges = [r.partition(":") for r in hp.profile_steps.split(",")]
        need(all(a.isdigit() and b.isdigit() and int(a) < int(b) <= hp.num_iterations
                 for a, _, b in ranges)
             and all(int(ranges[i][2]) <= int(ranges[i + 1][0]) for i in range(len(ranges) - 1)),
             f"--profile_steps={hp.profile_steps!r} must be 'a:b' ranges "
             f"(a < b <= {hp.num_iterations}, the step count), comma-separated in increasing order")
    try:   # the layer layout (model) and the optimizer table
           # and orders, by their own checks; meta: no memory
        model = build_model(hp, torch.device("meta"), "sdpa")
        build_optimizer(hp, model, world_size - 1, world_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def train_tokens_needed(hp: Hyperparameters) -> int:
    """Tokens that carry a loss over the whole run (467,927,040 for the record); reads are higher
    (see preflight)."""
    return sum(global_batch_size(s, hp.num_scheduled_iterations, hp.stages)
               for s in range(hp.num_iterations))


# Measured on FineWeb: the loader reads about 1.35x the trained tokens (documents cut at 2048,
# rank-boundary remainders, +1 look-ahead per rank, abandoned shard tails); 1.45 leaves a margin.
TRAIN_READ_FACTOR = 1.45


def estimate_gpu_memory_gib(hp: Hyperparameters, world_size: int) -> float:
    """A rough upper estimate of peak GPU memory per rank (weights, grads, optimizer state,
    activations, logits)."""
    D, H, V, L = hp.model_dim, hp.mlp_hidden, hp.vocab_size, hp.num_layers
    shapes = build_model(hp, torch.device("meta"), "sdpa")  # the parameter sizes, without memory
    banks = shapes.attn.numel() + shapes.mlp.numel()
    tables = (2 + hp.num_value_embeds) * V * D
    weights = 2 * (banks + tables)                       # bf16
    grads = 2 * (banks + tables)
    optim = (4 * 3 * banks + 8 * tables) / world_size    # fp32 momentum + master bits /
                                                         # Adam m, v (sharded)
    n = max(micro_batch_tokens(st.batch, hp.batch_slices) for st in hp.stages)
    acts = n * L * (28 * D + 4 * H)                      # bf16 activations saved for
                                                         # backward, per token and layer
    logits = n * V * 2 * 3                               # bf16 logits, their grad and FP8 copies
    n_val = hp.val_batch_size // hp.batch_slices
    rope = 2 * 2 * (2 * n_val) * hp.head_dim * 3         # cos/sin tables, normal and paired
    return (weights + grads + optim + acts + logits + rope) / 2**30


PREFLIGHT_SAMPLE_TOKENS = 1 << 20   # tokens of each training shard checked
                                    # before compiling (ids, a document start)


def preflight(hp: Hyperparameters, world_size: int, device: torch.device,
              rank: int = 0) -> list[str]:
    """Check data, schedule and memory before anything compiles. Raises DataError / ConfigError;
    returns notes.

    Every shard's header and size; a sample of every training shard (token ids fit the vocabulary, a
    document start exists; the loader checks all ids of each shard as it loads it); every validation
    token this rank will read, so a bad val shard fails now and not after the whole run has
    trained."""
    notes = []
    train_files = resolve_shards(hp.train_files, "train")
    val_files = resolve_shards(hp.val_files, "val")
    train_avail = sum(shard_num_tokens(f) for f in train_files)   # validates every header and size
    for path in train_files:
        sample = _read_tokens(path, PREFLIGHT_SAMPLE_TOKENS)[0]
        check_token_ids(sample, hp.vocab_size, path)
        _ShardIndex(path, sample, complete=True)  # raises if there is no document start
    val_sizes = [shard_num_tokens(f) for f in val_files]
    needed = train_tokens_needed(hp)
    shard = max(1, train_avail // len(train_files))
    if train_avail < needed:
        k = math.ceil(needed * TRAIN_READ_FACTOR / shard)
        raise DataError(f"the schedule trains on {needed:,} tokens but the {len(train_files)} "
                        f"training shard(s) matching {hp.train_files} hold {train_avail:,}: get "
                        f"more shards (python data/cached_fineweb10B.py {k}) or shorten the run "
                        "(--num_scheduled_iterations)")
    if train_avail < needed * TRAIN_READ_FACTOR:
        notes.append(f"warning: {train_avail:,} training tokens for {needed:,} trained; the loader "
                     f"reads about {TRAIN_READ_FACTOR}x that, so the run may run out of data "
                     "(the loader then stops with a message)")
    # every validation reads the same first val_tokens tokens plus one look-ahead token, from the
    # first val shard on
    if val_sizes[0] < hp.val_tokens + 2 and sum(val_sizes) < hp.val_tokens + 2 * len(val_sizes):
        raise DataError(f"validation reads {hp.val_tokens:,} tokens (+1 look-ahead) but "
                        f"{val_files[0]} holds {val_sizes[0]:,}: lower --val_tokens to a multiple "
                        f"of --val_batch_size={hp.val_batch_size} below that, or use the full "
                        "FineWeb val shard")
    grad_accum = hp.batch_slices // world_size
    for _ in val_batches(val_files, hp.val_batch_size, hp.val_tokens, grad_accum, rank, world_size,
                         torch.device("cpu"), hp.tokens_per_doc_bound, hp.vocab_size):
        pass
    check_document_density(train_files[0], hp)
    check_fused_kernel_shapes(hp, device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        est = estimate_gpu_memory_gib(hp, world_size)
        if est > 0.95 * total:
            raise ConfigError(f"this configuration needs about {est:.0f} GiB per GPU (an estimate) "
                              f"but the GPU has {total:.0f} GiB: lower the batches in --stages and "
                              "--val_batch_size, or use larger GPUs")
        notes.append(f"memory estimate: about {est:.1f} GiB per GPU of {total:.0f} GiB")
    notes.append(f"data: {len(train_files)} train shards ({train_avail:,} tokens) for {needed:,} "
                 f"trained tokens; {len(val_files)} val shard(s), {hp.val_tokens:,} tokens per "
                 "validation")
    return notes


def check_fused_kernel_shapes(hp: Hyperparameters, device: torch.device) -> None:
    """Raise ConfigError for a model dim the fused MLP kernel cannot take, before compiling; that
    kernel runs on CUDA only (elsewhere the MLP is its plain-PyTorch reference)."""
    k_step = tk._MLP_TILES[2]
    if device.type == "cuda" and hp.kernels == "fused" and hp.model_dim % k_step:
        raise ConfigError(f"the fused MLP kernel reads the model dim in steps of {k_step}: use a "
                          f"--model_dim that is a multiple of {k_step} (not {hp.model_dim}), or "
                          "--kernels=torch")


def check_document_density(path: str, hp: Hyperparameters, sample_tokens: int = 4_000_000) -> None:
    """Fail before compiling if documents are so short that cu_seqlens (max_num_docs entries) would
    overflow.

    Samples the first shard: a micro-batch of N tokens holds about
    N / mean(min(doc_len, max_seq_len)) segments.
    """
    tokens = np.memmap(path, dtype=np.uint16, mode="r", offset=SHARD_HEADER_BYTES)[:sample_tokens]
    starts = np.flatnonzero(tokens == BOS_ID)
    if len(starts) < 2:
        return
    lengths = np.minimum(np.diff(starts), hp.train_max_seq_len)
    mean_len = float(lengths.mean())
    for bs in sorted({st.batch for st in hp.stages}):
        n = micro_batch_tokens(bs, hp.batch_slices)
        expected = 1.25 * n / mean_len + 2                # 25% margin for batches of
                                                          # shorter-than-average documents
        room = max_num_docs(n, hp.tokens_per_doc_bound) - 1
        if expected > room:
            bound = max(1, int(mean_len / 1.25) - 1)
            raise ConfigError(f"documents in {path} average {mean_len:.0f} tokens, much shorter "
                              f"than FineWeb's: a {n}-token micro-batch holds about {expected:.0f} "
                              f"documents but cu_seqlens has room for {room}. Rerun with "
                              f"--tokens_per_doc_bound={bound} (default 300)")


def environment_report() -> str:
    import subprocess
    import triton
    lines = [f"python {sys.version}", f"torch {torch.__version__} (cuda {torch.version.cuda})",
             f"triton {triton.__version__}"]
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        smi = "nvidia-smi: not available"
    return "\n".join(lines) + "\n" + smi


def progress_note(done: int, total: int, train_ms: float, tokens_done: int,
                  tokens_total: int) -> str:
    """The console's end of a step line: percent of the schedule, training tokens per second and the
    time left at that rate. Counted in tokens, not steps, because later steps carry larger
    batches."""
    rate = tokens_done / max(train_ms / 1000, 1e-9)
    left = round((tokens_total - tokens_done) / rate) if rate > 0 else 0
    eta = (f"{left // 3600}h{left // 60 % 60:02d}m" if left >= 3600
           else f"{left // 60}m{left % 60:02d}s")
    return f"  {100 * done / total:.0f}% {rate:,.0f} tok/s ETA {eta}"


def result_line(val_loss: float, target: float, train_ms: float, steps: int, peak_mib: int | None,
                log_path: Path | None) -> str:
    """The run's last line: what a speedrunner reads first."""
    memory = f"{peak_mib}MiB" if peak_mib is not None else "n/a"
    return (f"result: val_loss:{val_loss:.4f} target:{target} "
            f"reached:{'yes' if val_loss <= target else 'no'} "
            f"train_time:{train_ms / 1000:.1f}s steps:{steps} peak_memory:{memory} log:{log_path}")


class RunLogger:
    """Rank 0 writes logs/<run_id>.txt (flushed every line, so a crash loses nothing) and echoes to
    the console.
    The file is created exclusively: an existing log is never overwritten (prepare_output refuses
    its run id)."""

    def __init__(self, path: Path | None):
        self.path = path
        self.file = None
        if path is not None:
            try:
                self.file = open(path, "x", buffering=1)
            except FileExistsError:
                raise ConfigError(f"{path} exists (an earlier run with this --run_id): "
                                  "choose another --run_id or move that log away") from None

    def __call__(self, msg: str, console: bool = True) -> None:
        if self.file is None:
            return
        if console:
            print(msg, flush=True)
        try:
            self.file.write(msg + "\n")
        except OSError as e:
            raise ConfigError(f"cannot write the log {self.path}: {e.strerror or e}; "
                              "free disk space or choose another --log_dir") from None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def prepare_output(hp: Hyperparameters, run_id: str, rank: int) -> Path:
    """Before anything trains: refuse a --run_id whose log exists, create the log folder (and the
    checkpoint folder with --save_checkpoint) and prove that each is writable, so no run trains for
    an hour and then cannot save.
    Returns the log path."""
    log_dir = Path(hp.log_dir)
    log_path = log_dir / f"{run_id}.txt"
    if log_path.exists():
        raise ConfigError(f"{log_path} exists (an earlier run with --run_id={run_id}): "
                          "choose another --run_id or move that log away")
    for folder in [log_dir] + ([log_dir / run_id] if hp.save_checkpoint or hp.checkpoint_every
                               else []):
        probe = folder / f".write_test_{os.getpid()}_{rank}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"cannot write to {folder}: {e.strerror or e}; "
                              "choose a writable --log_dir") from None
    return log_path


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """write(tmp) to a temporary name beside `path`, then rename it over `path`: a crash leaves the
    old file or the new one, never half of one."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.is_file():
            tmp.unlink()


def atomic_torch_save(obj: Any, path: Path) -> None:
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


# ---- the portable compile cache: torch's compiled artifacts in one file ---------------------
COMPILE_CACHE_MAGIC = b"nanogpt-speedrun compile cache 1\n"


def compile_cache_key(sources: Sequence[str], versions: str) -> str:
    """What compiled code depends on: the text of both source files and the settings
    (compile_cache_settings), and the torch / triton / CUDA versions with the GPU model."""
    import hashlib
    digest = hashlib.sha256()
    for text in (*sources, versions):
        digest.update(hashlib.sha256(text.encode()).digest())
    return digest.hexdigest()


# Settings that cannot change a compiled graph: where data and logs go, how often to validate, log,
# check or save, and how the compiling itself is organised. Every other setting (a new one too) is
# part of the compile cache's key, so a file made with another --attn_backend or model shape is not
# taken for this run's (it would cover none of its graphs and turn off the compile helpers).
CACHE_NEUTRAL_SETTINGS = frozenset({
    "train_files", "val_files", "val_loss_every", "val_loss_target", "train_loss_every", "seed",
    "run_id", "log_dir", "save_checkpoint", "checkpoint_every", "checkpoint_keep", "resume",
    "nonfinite_check_every", "pg_timeout_s", "profile_steps", "debug", "compile_cache",
    "compile_split", "compile_helpers", "warmup"})


def compile_cache_settings(hp: Hyperparameters, attn_backend: str) -> str:
    """The settings part of the compile cache's key: every setting outside CACHE_NEUTRAL_SETTINGS,
    with the attention backend resolved (auto picks differ between machines)."""
    fields = {f.name: getattr(hp, f.name) for f in dataclasses.fields(hp)
              if f.name not in CACHE_NEUTRAL_SETTINGS}
    fields["attn_backend"] = attn_backend
    return repr(sorted(fields.items()))


def compile_cache_versions(device: torch.device) -> str:
    import triton
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return (f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}, "
            f"{gpu}")


def save_compile_cache(path: Path, key: str, versions: str) -> str:
    """Write what torch compiled in this process (torch.compiler.save_cache_artifacts) atomically;
    returns the line for the log."""
    import hashlib
    import json
    try:
        saved = torch.compiler.save_cache_artifacts()
    except Exception as e:         # a cache is a convenience: never the reason a run fails
        return (f"compile cache: torch could not collect the artifacts ({type(e).__name__}); "
                f"not saved")
    if saved is None or not saved[0]:
        return "compile cache: nothing was compiled, nothing saved"
    payload = saved[0]
    header = {"key": key, "versions": versions, "bytes": len(payload),
              "sha256": hashlib.sha256(payload).hexdigest()}
    record = COMPILE_CACHE_MAGIC + json.dumps(header).encode() + b"\n" + payload
    try:
        atomic_write(path, lambda tmp: tmp.write_bytes(record))
    except OSError as e:
        return f"compile cache: could not write {path} ({e.strerror or e}); the run goes on"
    return f"compile cache: saved {path} ({len(payload) / 2**20:.1f} MiB)"


def load_compile_cache(path: Path, key: str) -> tuple[bool, str]:
    """Hand a saved cache to torch (torch.compiler.load_cache_artifacts) if it was made by this code
    on this kind of machine. (loaded, the line for the log): a missing, stale or damaged file is
    reported and ignored, never fatal."""
    import hashlib
    import json
    if not path.is_file():
        return False, f"compile cache: no {path} yet; it is written after the warmup"
    try:
        with open(path, "rb") as f:
            if f.readline() != COMPILE_CACHE_MAGIC:
                raise ValueError("not a compile cache file")
            header = json.loads(f.readline())
            payload = f.read()
        if header.get("key") != key:
            return False, (f"compile cache: {path} was made by other code, with other settings or "
                           f"on another machine ({header.get('versions')}); ignored, replaced "
                           f"after the warmup")
        if len(payload) != header.get("bytes") or (
                hashlib.sha256(payload).hexdigest() != header.get("sha256")):
            raise ValueError("truncated or damaged")
        torch.compiler.load_cache_artifacts(payload)
    except Exception as e:    # anything wrong in the file: compile as if it were absent
        reason = type(e).__name__ + (f": {str(e).splitlines()[0][:120]}" if str(e) else "")
        return False, (f"compile cache: {path} is unreadable ({reason}); ignored, replaced after "
                       f"the warmup")
    return True, f"compile cache: loaded {path} ({len(payload) / 2**20:.1f} MiB)"


# ---- where the warmup's compile time goes: one row per compilation, with why it happened -----

@dataclass(frozen=True)
class CompiledGraph:
    """One compilation seen during the warmup: a row of the compile table."""
    compile_id: str     # torch's "frame/attempt" id, e.g. "0/3"; a backward shares its forward's
    graph: str          # the compiled function (GPT.forward is "forward")
    backward: bool      # the backward graph, compiled at the first backward of that forward
    step: int           # the warmup step being run
    phase: str          # "val" (validation, no grad) or "train" (forward, backward, optimizer)
    seconds: float      # wall time of the compilation
    cache: str          # "hit", "miss", "mixed" or "-": served by torch's on-disk caches (the
                        # compile cache fills them), "-" where none was asked
    reason: str         # "first", "backward", or the guard that failed against an earlier graph


def recompile_reason(failures: Sequence[str]) -> str:
    """Why torch compiled a function again, from the guard failures it recorded just before: one per
    earlier graph of the function, newest first, each "<its id>: <first failed guard>  # source".
    The warmup alternates validation (no grad) and training, so the newest graph usually differs
    only in grad mode; the first failure against a graph of the same grad mode names what really
    changed (a shape, a window, a constant)."""
    if not failures:
        return "first"
    lines = [re.sub(r"\s+#.*$", "", f.strip().splitlines()[0]) if f.strip() else "?"
             for f in failures]                         # drop the source-line comment torch adds
    same_mode = [line for line in lines if "GLOBAL_STATE changed" not in line]
    return " ".join((same_mode or lines)[0].split())


# torch's cache counters on a compilation's metrics (the compile cache fills the local caches)
_CACHE_COUNTERS = ("inductor_fx_local_cache", "aotautograd_local_cache",
                   "inductor_fx_remote_cache", "aotautograd_remote_cache")


def cache_state(hits: int, misses: int) -> str:
    """Whether torch's FX-graph / AOTAutograd caches served a compilation."""
    return {(True, False): "hit", (False, True): "miss", (True, True): "mixed"}.get(
        (hits > 0, misses > 0), "-")


def shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def compile_table(rows: Sequence[CompiledGraph], reason_width: int = 90) -> list[str]:
    """The rows as fixed-width lines under one header line."""
    lines = [f"{'#':>3} {'id':<6} {'graph':<20} {'step':>4} {'phase':<6} {'sec':>6} {'cache':<5} "
             "reason"]
    for i, r in enumerate(rows, 1):
        graph = shorten(r.graph + (" (bw)" if r.backward else ""), 20)
        lines.append(f"{i:>3} {r.compile_id:<6} {graph:<20} {r.step:>4} {r.phase:<6} "
                     f"{r.seconds:>6.1f} {r.cache:<5} {shorten(r.reason, reason_width)}")
    return lines


def compile_summary(rows: Sequence[CompiledGraph], warmup_s: float, autotune_runs: int,
                    autotune_s: float, eager_tunings: int) -> str:
    """One line: how much of the warmup was compiling, what the compile cache saved, and Triton's
    autotuning (inductor's, at the first run of a compiled graph; the eager autotuners', counted
    only: triton keeps no total of their time)."""
    total = sum(r.seconds for r in rows)
    n_bw = sum(r.backward for r in rows)
    cached = [r for r in rows if r.cache == "hit"]
    return (f"compile: {len(rows)} graphs ({len(rows) - n_bw} forward, {n_bw} backward) took "
            f"{total:.1f}s of the warmup's {warmup_s:.1f}s; {len(cached)} were cache hits "
            f"({sum(r.seconds for r in cached):.1f}s); Triton autotuning: {autotune_runs} "
            f"kernels in compiled graphs ({autotune_s:.1f}s), {eager_tunings} eager tunings")


@dataclass
class _Compilation:
    compile_id: str
    trigger: str                 # torch's CallbackTrigger name: DYNAMO, LAZY_BACKWARD, ...
    step: int
    phase: str
    failures: list[str]          # the guard failures recorded just before it started
    t0: float
    t1: float | None = None


class CompileLog:
    """Records every torch.compile compilation while recording(): the warmup step and phase it ran
    in (set by during()), its wall time and why it happened; report() turns that into the table.

    The hooks, all present in torch 2.11 to 2.13:
      torch._dynamo.callback_handler        calls us at the start and the end of every compilation
                                            (a forward; a backward where it is compiled lazily, at
                                            its first backward: not in our runs, configure_compiler)
                                            with torch's compile id;
      torch._dynamo.utils.guard_failures    code -> the guard failures of each recompile, recorded
                                            just before the compilation starts;
      torch._dynamo.utils.get_compilation_metrics()   after it: the function's name and the cache
                                            hits (a deque of the last 64, so read after each phase);
      torch._dynamo.utils.compilation_time_metrics    the times of inductor's runtime autotuning.
    A torch without one of them gets one log line and no table, never an error."""

    AUTOTUNE_KEY = "CachingAutotuner.benchmark_all_configs"

    def __init__(self, enabled: bool, autotuners: Sequence[Any] = ()):
        """autotuners: eager triton.autotune kernels (their .cache gains a key per tuning)."""
        self.enabled, self.autotuners = enabled, list(autotuners)
        self.step, self.phase = -1, "-"
        self.compilations: list[_Compilation] = []
        self.metrics: dict[tuple[str, bool], Any] = {}   # (compile id, backward) -> torch's record
        self.missing: str | None = None                  # the hook this torch lacks
        self.autotune = (0, 0.0, 0)                      # runs, seconds, eager tunings
        self._hooks: Any = None
        self._failures_seen: dict[Any, int] = {}

    @staticmethod
    def _find_hooks() -> Any:
        from types import SimpleNamespace
        from torch._dynamo import callback, utils
        hooks = SimpleNamespace(handler=callback.callback_handler,
                                guard_failures=utils.guard_failures,
                                metrics=utils.get_compilation_metrics,
                                times=utils.compilation_time_metrics)
        for name in ("register_start_callback", "register_end_callback",
                     "remove_start_callback", "remove_end_callback"):
            getattr(hooks.handler, name)
        return hooks

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        try:
            self._hooks = self._find_hooks()
        except (ImportError, AttributeError) as e:
            self.missing = str(e).splitlines()[0] if str(e) else type(e).__name__
            yield
            return
        h = self._hooks
        self._failures_seen = {code: len(f) for code, f in list(h.guard_failures.items())}
        runs0, eager0 = len(h.times.get(self.AUTOTUNE_KEY, [])), self._eager_tunings()
        h.handler.register_start_callback(self._on_start)
        h.handler.register_end_callback(self._on_end)
        try:
            yield
        finally:
            h.handler.remove_start_callback(self._on_start)
            h.handler.remove_end_callback(self._on_end)
            self._read_metrics()
            runs = h.times.get(self.AUTOTUNE_KEY, [])[runs0:]
            self.autotune = (len(runs), float(sum(runs)), self._eager_tunings() - eager0)

    @contextlib.contextmanager
    def during(self, step: int, phase: str) -> Iterator[None]:
        """Compilations from here on belong to this warmup step and phase."""
        self.step, self.phase = step, phase
        try:
            yield
        finally:
            if self._hooks is not None:
                self._read_metrics()

    def _eager_tunings(self) -> int:
        return sum(len(getattr(a, "cache", ())) for a in self.autotuners)

    def _on_start(self, args: Any) -> None:
        try:                   # a table is a convenience: never the reason a compilation fails
            failures = []
            for code, fails in list(self._hooks.guard_failures.items()):
                failures += fails[self._failures_seen.get(code, 0):]
                self._failures_seen[code] = len(fails)
            self.compilations.append(_Compilation(
                str(args.compile_id), getattr(args.callback_trigger, "name", "?"), self.step,
                self.phase, [str(f) for f in failures], time.perf_counter()))
        except Exception:
            pass

    def _on_end(self, args: Any) -> None:
        try:
            for c in reversed(self.compilations):
                if c.compile_id == str(args.compile_id) and c.t1 is None:
                    c.t1 = time.perf_counter()
                    break
        except Exception:
            pass

    def _read_metrics(self) -> None:
        # getattr: this runs in `finally` blocks, where an error would hide the warmup's own
        for m in self._hooks.metrics():
            compile_id = getattr(m, "compile_id", None)
            if compile_id and not getattr(m, "is_runtime", False):
                self.metrics[(compile_id, getattr(m, "is_forward", None) is False)] = m

    def rows(self) -> list[CompiledGraph]:
        rows = []
        for c in self.compilations:
            backward = c.trigger == "LAZY_BACKWARD"
            m = self.metrics.get((c.compile_id, backward))
            forward = self.metrics.get((c.compile_id, False))
            hits = sum(getattr(m, f"{k}_hit_count", None) or 0 for k in _CACHE_COUNTERS)
            misses = sum(getattr(m, f"{k}_miss_count", None) or 0 for k in _CACHE_COUNTERS)
            if backward:
                reason = "backward"
            elif c.trigger != "DYNAMO":
                reason = c.trigger.lower()
            elif getattr(m, "fail_type", None):
                reason = f"failed: {m.fail_type}"
            else:
                reason = recompile_reason(c.failures)
            t1 = c.t1 if c.t1 is not None else c.t0
            rows.append(CompiledGraph(c.compile_id, getattr(forward, "co_name", None) or "?",
                                      backward, c.step, c.phase, t1 - c.t0,
                                      cache_state(hits, misses), reason))
        return rows

    def report(self, warmup_s: float) -> list[str]:
        """The log lines: nothing when not enabled; one line when this torch lacks a hook."""
        if not self.enabled:
            return []
        if self.missing is not None:
            return [f"compile table: not available with torch {torch.__version__} "
                    f"({self.missing})"]
        rows = self.rows()
        return (["compile table: one row per compilation in the warmup (val: validation; train: "
                 "forward, backward, optimizer; val* / train*: this rank compiling its share "
                 "alone, no optimizer)"] + compile_table(rows)
                + [compile_summary(rows, warmup_s, *self.autotune)])


def configure_compiler() -> None:
    """The process-wide torch.compile settings of a compiled run."""
    from torch import _dynamo
    from torch._functorch import config as functorch_config
    _dynamo.config.recompile_limit = 64   # every window / batch-size / YaRN variant is its own graph
    # The model's autograd Functions (the FP8 head with its loss, the Triton ops) are traced whole,
    # backward included, so their graphs are as cacheable as any. Without this torch does not put a
    # graph that contains one in its autograd cache: every start traces and partitions each
    # training graph again (7-10 s of each 8-10 s cache hit on an H200).
    functorch_config.autograd_cache_allow_custom_autograd_functions = True
    # A training graph's backward is compiled with its forward instead of at its first backward
    # (the same code, compiled earlier): in the compile split, a process then holds its GPU turn
    # only while it runs the graph (GpuTurns).
    functorch_config.force_non_lazy_backward_lowering = True
    # torch's on-disk caches key a graph by its ops, and a Triton op of triton_kernels.py is one op
    # there, although its launch code (tiles, arguments) is compiled into the graph; its kernels
    # count only where torch's source scan finds them (it missed the attention ops' until their
    # launchers named them). After an edit of that file the caches could hand back graphs of the
    # old code, so the file's text is part of every key.
    tag = kernels_cache_tag(Path(tk.__file__).read_text())
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
    copies of a (T, D) tensor per micro-batch, about 1% of a step. Unfused, the add runs inside the
    element-wise kernel that reads the sum anyway.
    The stored sums are the same numbers: cuBLAS's bf16 addmm rounds A @ B to bf16 before adding C
    (bitwise mm + add at every model shape tried on an H100; tests/test_model_gpu.py checks it). What
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


def kernels_cache_tag(kernels_source: str) -> str:
    """The tag of torch's compile-cache keys for this text of triton_kernels.py."""
    import hashlib
    return "triton_kernels:" + hashlib.sha256(kernels_source.encode()).hexdigest()[:16]


def eager_autotuners(module: Any) -> list[Any]:
    """The triton.autotune kernels a module defines (the optimizer runs its kernels outside the
    compiled graphs, so their tuning is no compilation)."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return []
    return [v for v in vars(module).values() if isinstance(v, Autotuner)]



def snapshot_state(model: nn.Module, opt: Any) -> dict[str, Any]:
    """A detached copy of everything a step changes (used to undo warmup and as the last good
    state)."""
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": copy.deepcopy(opt.state_dict())}


def states_equal(a: Any, b: Any) -> bool:
    """Bitwise equality of nested state (tensors compared with torch.equal, which treats NaN as
    unequal)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(states_equal(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(states_equal(x, y) for x, y in zip(a, b)))
    return a == b


# ---- checkpoints: the whole training state, so that a stopped run continues bit for bit ----------

CHECKPOINT_FORMAT = "train_gpt state 1"
CHECKPOINT_NAME = re.compile(r"state_step(\d{6,})(?:_rank(\d+))?\.pt")
# Options that do not change what a run computes; a resumed run may set them differently. Every
# other option must equal the checkpoint's, and so must what these resolve to (see run_facts).
RUN_CONTROL_OPTIONS = frozenset({
    "train_files", "val_files", "val_loss_every", "val_loss_target", "train_loss_every",
    "dry_run", "device", "attn_backend", "warmup", "compile_split", "compile_helpers", "run_id",
    "log_dir", "save_checkpoint", "checkpoint_every", "checkpoint_keep", "resume",
    "nonfinite_check_every", "pg_timeout_s",
    "profile_steps", "debug", "compile_cache"})


def checkpoint_path(folder: Path, step: int, rank: int, world_size: int) -> Path:
    """<folder>/state_step<step>.pt; with several processes one file per rank (optimizer state is
    sharded)."""
    return folder / f"state_step{step:06d}{f'_rank{rank}' if world_size > 1 else ''}.pt"


def run_facts(world_size: int, device: torch.device, attn_backend: str,
              train_files: list[str]) -> dict[str, Any]:
    """What the run-control options resolve to that the math depends on: a resumed run must match
    them."""
    return {"processes": world_size, "device": device.type, "attention backend": attn_backend,
            "training shards": [os.path.basename(f) for f in train_files]}


class Checkpointer:
    """Writes this rank's part of the training state atomically. Periodic checkpoints keep the
    newest `keep`; the ones written at the end, when stopped, or before a divergence are kept."""

    def __init__(self, hp: Hyperparameters, run_id: str, rank: int, world_size: int, facts: dict,
                 log: Callable):
        self.folder, self.keep = Path(hp.log_dir) / run_id, hp.checkpoint_keep
        self.rank, self.world_size, self.log = rank, world_size, log
        self.header = {"format": CHECKPOINT_FORMAT, "run_id": run_id,
                       "hyperparameters": dataclasses.asdict(hp),
                       "facts": facts, "code": Path(__file__).read_text()}
        self.periodic: list[int] = []

    def save(self, state: dict, periodic: bool = False) -> Path:
        path = checkpoint_path(self.folder, state["step"], self.rank, self.world_size)
        try:
            atomic_torch_save({**self.header, **state}, path)
        except OSError as e:
            raise ConfigError(f"cannot write the checkpoint {path}: {e.strerror or e}; "
                              "free disk space or choose another --log_dir") from None
        self.log(f"checkpoint: {path}")
        if periodic:
            self.periodic.append(state["step"])
            if len(self.periodic) > self.keep:
                if self.world_size > 1:
                    dist.barrier()       # every rank holds the new checkpoint
                                         # before any rank deletes an old one
                for step in self.periodic[:-self.keep]:
                    checkpoint_path(self.folder, step, self.rank,
                                    self.world_size).unlink(missing_ok=True)
                self.periodic = self.periodic[-self.keep:]
        return path


def find_checkpoint(path: str, world_size: int) -> tuple[Path, int]:
    """(folder, step) of what --resume names: a state file (any rank's) or a run folder, whose
    newest checkpoint with a file for each of world_size ranks is taken (a crash while writing
    leaves the previous one complete)."""
    p = Path(path)
    if p.is_dir():
        names = {f.name for f in p.iterdir()}
        steps = {int(m[1]) for name in names if (m := CHECKPOINT_NAME.fullmatch(name))}
        complete = [st for st in steps
                    if all(checkpoint_path(p, st, r, world_size).name in names
                           for r in range(world_size))]
        if not complete:
            found = (f"states for other process counts or incomplete (steps {sorted(steps)})"
                     if steps else "no states")
            raise ConfigError(f"--resume={path}: the folder holds {found}, none written by "
                              f"{world_size} process(es); give a run's folder (logs/<run_id>) or "
                              "one of its state_step*.pt files")
        return p, max(complete)
    m = CHECKPOINT_NAME.fullmatch(p.name)
    if m is None or not p.is_file():
        raise ConfigError(f"--resume={path} is "
                          f"{'not a file' if m else 'neither a folder nor a state_step*.pt file'}: "
                          "give a run's folder (logs/<run_id>) or one of its state_step*.pt files")
    return p.parent, int(m[1])


def load_checkpoint(path: str, rank: int, world_size: int,
                    device: str | torch.device = "cpu") -> dict:
    """This rank's state from the checkpoint `path` names (see find_checkpoint); ConfigError if it
    cannot be used."""
    folder, step = find_checkpoint(path, world_size)
    file = checkpoint_path(folder, step, rank, world_size)
    if not file.is_file():
        others = sorted(f.name for f in folder.glob(f"state_step{step:06d}*.pt"))
        raise ConfigError(f"--resume: {file} does not exist (the step-{step} state has "
                          f"{', '.join(others)}): resume with the number of processes that "
                          "wrote it")
    try:
        state = torch.load(file, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001 (a truncated or foreign file, reported as such)
        raise ConfigError(f"--resume: cannot read {file} "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                          "resume from another checkpoint") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"--resume: {file} is not a training state written by this trainer "
                          "(--checkpoint_every, --save_checkpoint)")
    state["path"] = str(file)
    return state


def resume_differences(saved: dict, hp: Hyperparameters, facts: dict) -> list[str]:
    """The options (and resolved facts) that differ between the saved run and this one and change
    the math."""
    old = hyperparameters_from_dict(saved["hyperparameters"])
    diffs = [f"--{f.name}={_show(getattr(old, f.name))} (now {_show(getattr(hp, f.name))})"
             for f in dataclasses.fields(hp)
             if f.name not in RUN_CONTROL_OPTIONS and getattr(old, f.name) != getattr(hp, f.name)]
    for key, now in facts.items():
        then = saved["facts"].get(key)
        if then != now and isinstance(now, list):     # shard lists: the count, or
                                                      # the first name that differs
            i = next((i for i, (a, b) in enumerate(zip(then, now)) if a != b), None)
            diffs.append(f"{key}: {len(then)} (now {len(now)})" if i is None else
                         f"{key}: number {i + 1} is {then[i]} (now {now[i]})")
        elif then != now:
            diffs.append(f"{key} {then} (now {now})")
    return diffs


def check_resume(saved: dict, hp: Hyperparameters, facts: dict) -> None:
    if diffs := resume_differences(saved, hp, facts):
        raise ConfigError(f"--resume: {saved['path']} was written by a run with other math: "
                          f"{'; '.join(diffs)}. Resume with the same options and processes")


# ==================================================================================================
# 8. Training: warmup, reset, the timed loop, main()
# ==================================================================================================


def variant_starts(hp: Hyperparameters) -> list[int]:
    """The first step of each compiled variant of the model: step 0 and every change of the
    windows, batch size or number of MTP weights (each is its own pair of graphs)."""
    shapes = [(sc.ws_short, sc.ws_long, sc.global_batch, len(sc.mtp_weights))
              for sc in (schedule_at(s, hp) for s in range(hp.num_iterations))]
    return [0] + [s for s in range(1, hp.num_iterations) if shapes[s] != shapes[s - 1]]


def warmup_steps(hp: Hyperparameters) -> list[int]:
    """Steps that exercise every compiled variant: the start, both sides of every variant change,
    and the split."""
    steps = ({0, 1, 2, hp.split_step, hp.split_step - 1}
             | {t + d for t in variant_starts(hp)[1:] for d in (-1, 0, 1)})
    return sorted(s for s in steps if 0 <= s < hp.num_iterations)


def split_compile_tasks(hp: Hyperparameters, workers: int) -> list[list[tuple[int, str]]]:
    """What each of `workers` processes of one machine compiles alone before the warmup: (variant
    start, "train" or "val") pairs, dealt round-robin, the longer training graphs (forward and
    backward) first. With 4 variants, 4 workers each take both graphs of one variant; 8 workers one
    graph each. Worker w runs on GPU w % ranks: the ranks themselves come first and take the
    training graphs, their helpers the rest."""
    tasks = ([(s, "train") for s in variant_starts(hp)]
             + [(s, "val") for s in variant_starts(hp)])
    return [tasks[w::workers] for w in range(workers)]


def split_processes_per_gpu(hp: Hyperparameters, ranks: int, cache_loaded: bool) -> int:
    """How many processes compile on each GPU in the split: its rank and --compile_helpers
    helpers. Auto: one variant (its two graphs) per process, at most 4 per GPU (1 GPU: 4; 2 GPUs:
    2; 4 or 8 GPUs: 1, the ranks alone), and no helpers when the compile cache file was loaded:
    the caches hold every graph, and a helper would only load graphs that its rank loads again."""
    if hp.compile_helpers >= 0:
        return 1 + hp.compile_helpers
    if cache_loaded:
        return 1
    return max(1, min(4, -(-len(variant_starts(hp)) // ranks)))


class TrainClock:
    """The timed training clock: it runs during steps and is paused for validation and checkpoints.
    Pausing and starting wait for the GPU, so the time of queued work lands on the right side."""

    def __init__(self, sync: Callable[[], None]):
        self.sync, self.ms, self.t0 = sync, 0.0, None

    def start(self) -> None:
        self.sync()
        self.t0 = time.perf_counter()

    def pause(self) -> float:
        self.sync()
        self.ms, self.t0 = self.now_ms(), None
        return self.ms

    def now_ms(self) -> float:
        """The time so far without waiting for the GPU (for progress lines)."""
        return self.ms + (1000 * (time.perf_counter() - self.t0) if self.t0 is not None else 0.0)


class StepProfiler:
    """--profile_steps=a:b,...: torch.profiler over steps a..b-1, one chrome trace per range in the
    log folder."""

    def __init__(self, hp: Hyperparameters, run_id: str, rank: int, log: Callable):
        self.ranges = dict(tuple(int(x) for x in r.split(":"))
                           for r in hp.profile_steps.split(",") if r)
        self.prefix, self.log = Path(hp.log_dir) / f"{run_id}_rank{rank}", log
        self.active, self.start, self.end = None, -1, -1

    def before_step(self, step: int) -> None:
        if step in self.ranges:
            self.active, self.start, self.end = torch.profiler.profile(), step, self.ranges[step]
            self.active.__enter__()

    def after_step(self, done: int, sync: Callable[[], None]) -> None:
        if self.active is not None and done == self.end:
            sync()
            self.active.__exit__(None, None, None)
            trace = Path(f"{self.prefix}_steps{self.start}-{done - 1}_trace.json")
            self.active.export_chrome_trace(str(trace))
            self.active = None
            self.log(f"profile of steps {self.start}..{done - 1} written to {trace}")


def replay_yarn(model: nn.Module, hp: Hyperparameters, steps_done: int) -> int:
    """Bring the model's rotary state (not in its state dict) to where training left it after
    `steps_done` steps: from the reset, every long-window change in order, as the run made them.
    Returns the last step's long window."""
    ws_long = schedule_at(0, hp).ws_long
    model.reset_rotary()
    for step in range(min(steps_done, hp.num_iterations)):
        new = schedule_at(step, hp).ws_long
        if new != ws_long:
            model.apply_yarn(ws_long, new)
            ws_long = new
    return ws_long


class Trainer:
    """The schedule state (windows, batch size) and the step/validation routines shared by warmup
    and the timed loop."""

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
        next step's batch size, and a data stream from `position`."""
        hp = self.hp
        self.ws_long = replay_yarn(self.model, hp, steps_done)
        # The stream starts with the next step's batch size (sending it a new size would do the
        # same).
        self.global_batch = schedule_at(min(steps_done, hp.num_iterations - 1), hp).global_batch
        self.position = position if position is not None else TrainPosition()
        self.loader = train_batches(self.train_files, self.global_batch, self.grad_accum, self.rank,
                                    self.world_size, self.device, hp.train_max_seq_len,
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
        self.opt.load_state_dict(state["optimizer"])
        for name, p in self.model.named_parameters():
            p.grad = state["grads"][name].to(p.device) if name in state["grads"] else None
        torch.set_rng_state(state["rng"]["cpu"])
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        self.reset_schedule_state(state["step"], TrainPosition(**state["loader"]))

    def advance_schedule(self, sched: StepSchedule) -> tuple | None:
        """Apply YaRN at a window change; return the batch-size message for this step's
        micro-batches, if any."""
        if sched.ws_long != self.ws_long:
            self.model.apply_yarn(self.ws_long, sched.ws_long)
            self.ws_long = sched.ws_long
        if sched.global_batch != self.global_batch:
            self.global_batch = sched.global_batch
            return (sched.global_batch, self.hp.train_max_seq_len, self.grad_accum)
        return None

    def train_loss(self, batch: tuple[Tensor, Tensor, Tensor], sched: StepSchedule,
                   mtp: Tensor) -> Tensor:
        """One training micro-batch's summed loss (the forward; the caller runs the backward)."""
        inputs, targets, cu_seqlens = batch
        return self.compiled(inputs, targets, cu_seqlens, sched.ws_short, sched.ws_long, mtp,
                             self.hp.train_max_seq_len)

    def val_loss(self, batch: tuple[Tensor, Tensor, Tensor], ws_short: int,
                 ws_long: int) -> Tensor:
        """One validation batch's mean loss (the model in eval mode, no grad)."""
        inputs, targets, cu_seqlens = batch
        one = torch.ones(1, device=self.device)
        return self.compiled(inputs, targets, cu_seqlens, ws_short, ws_long, one,
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
                                self.world_size, self.device, hp.train_max_seq_len,
                                hp.tokens_per_doc_bound, hp.vocab_size, TrainPosition())
        mtp = torch.tensor(sched.mtp_weights, dtype=torch.float32, device=self.device)
        self.train_loss(next(batches), sched, mtp).backward()
        batches.close()

    def train_step(self, sched: StepSchedule, message: tuple | None) -> Tensor:
        """A micro-steps of forward/backward, then the optimizer step; returns this rank's summed
        loss (on device)."""
        hp = self.hp
        mtp = torch.tensor(sched.mtp_weights,
                           dtype=torch.float32).to(self.device, non_blocking=True)
        total = torch.zeros((), device=self.device)
        for _ in range(self.grad_accum):
            loss = self.train_loss(self.loader.send(message), sched, mtp)
            (loss / self.grad_accum).backward()
            total += loss.detach()
        # a label for bench/profile_step.py; free otherwise
        with torch.profiler.record_function("optimizer_step"):
            self.opt.step(do_adam=sched.do_adam, lr_factor=sched.lr_factor, momentum=sched.momentum)
        if sched.step == hp.split_step:
            self.opt.untie()
        return total

    def mean_train_loss(self, summed: Tensor, sched: StepSchedule) -> float:
        """train_step's summed loss as a per-token mean over every rank's tokens of the step."""
        mean = summed.detach() / (sched.global_batch // self.world_size)
        if self.world_size > 1:
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        return mean.item()

    @torch.no_grad()
    def validate(self, ws_short: int, ws_long: int, max_batches: int | None = None) -> float:
        self.model.eval()
        total, count = torch.zeros((), device=self.device), 0
        for batch in self.val_batches():
            total += self.val_loss(batch, ws_short, ws_long)
            count += 1
            if max_batches is not None and count >= max_batches:
                break
        loss = total / count
        if self.world_size > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        self.model.train()
        return loss.item()


def launch_environment() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the variables torchrun sets; (0, 1, 0) without them.
    ConfigError when they are malformed or incomplete (e.g. WORLD_SIZE left in the shell from
    another job)."""
    env = os.environ
    try:
        world_size, rank = int(env.get("WORLD_SIZE", 1)), int(env.get("RANK", 0))
        local_rank = int(env.get("LOCAL_RANK", 0))
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={env.get('WORLD_SIZE')!r} RANK={env.get('RANK')!r} "
                          f"LOCAL_RANK={env.get('LOCAL_RANK')!r} must be integers (torchrun sets "
                          "them): unset them to run one process, or start with ./run.sh") from None
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise ConfigError(f"RANK={rank} is not a rank of WORLD_SIZE={world_size} "
                          f"(or LOCAL_RANK={local_rank} < 0): unset them to run one process, or "
                          "start with ./run.sh")
    return rank, world_size, local_rank


def isolate_gpu(local_rank: int, env: dict[str, str] = os.environ,
                count_gpus: Callable[[], int] = torch.cuda.device_count) -> str | None:
    """Before CUDA starts, let this process see only its own GPU (the LOCAL_RANK-th of those
    visible), which it then calls cuda:0. torch's compile caches key on the device index: with
    every rank on cuda:0 the ranks share what each compiles, and a saved compile cache serves every
    rank. Returns the CUDA_VISIBLE_DEVICES entry chosen; None where nothing changed (no GPU, or
    CUDA already started: then cuda:LOCAL_RANK as usual).
    count_gpus: torch.cuda.device_count, which reads the GPUs through NVML without starting CUDA
    and honours CUDA_VISIBLE_DEVICES."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if torch.cuda.is_initialized() or (visible is not None and not visible.strip()):
        return None
    count = count_gpus()
    if count == 0:
        return None
    if local_rank >= count:
        raise ConfigError(f"LOCAL_RANK={local_rank} but {count} GPU(s) are visible: start one "
                          "process per GPU (./run.sh does), or check CUDA_VISIBLE_DEVICES")
    entries = ([e.strip() for e in visible.split(",")] if visible is not None
               else [str(i) for i in range(count)])
    env["CUDA_VISIBLE_DEVICES"] = entries[local_rank]
    if count_gpus() != 1:    # CUDA had started (no NVML) and read the variable already: undo
        if visible is None:
            del env["CUDA_VISIBLE_DEVICES"]
        else:
            env["CUDA_VISIBLE_DEVICES"] = visible
        return None
    return entries[local_rank]


def setup_distributed(hp: Hyperparameters) -> tuple[int, int, int, torch.device]:
    import datetime
    rank, world_size, local_rank = launch_environment()
    missing = [v for v in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
               if v not in os.environ]
    if world_size > 1 and missing:
        raise ConfigError(f"WORLD_SIZE={world_size} is set but {', '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not: start multi-GPU runs with "
                          "./run.sh (torchrun sets them all), or unset WORLD_SIZE to run one "
                          "process")
    gpu = isolate_gpu(local_rank) if world_size > 1 and hp.device != "cpu" else None
    want_cuda = hp.device == "cuda" or (hp.device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise ConfigError("--device=cuda but no CUDA GPU is visible: check nvidia-smi, "
                          "or run with --device=cpu")
    if gpu is None and want_cuda and local_rank >= torch.cuda.device_count():
        raise ConfigError(f"LOCAL_RANK={local_rank} but {torch.cuda.device_count()} GPU(s) are "
                          "visible: start one process per GPU (./run.sh does), or check "
                          "CUDA_VISIBLE_DEVICES")
    if want_cuda and hp.dtype != "bfloat16":
        raise ConfigError(f"--dtype={hp.dtype} runs on a CPU only (the GPU kernels are bf16): "
                          "add --device=cpu, or drop --dtype")
    device = (torch.device("cuda", 0 if gpu is not None else local_rank) if want_cuda
              else torch.device("cpu"))
    if want_cuda:
        torch.cuda.set_device(device)
    if world_size > 1:
        # A bounded timeout: if one rank dies, the others leave their collective with an error
        # instead of hanging.
        timeout = datetime.timedelta(seconds=hp.pg_timeout_s)
        if want_cuda:
            dist.init_process_group("nccl", device_id=device, timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    return rank, world_size, local_rank, device


def build_model(hp: Hyperparameters, device: torch.device, attn_backend: str) -> nn.Module:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    n_train = max(micro_batch_tokens(st.batch, hp.batch_slices) for st in hp.stages)
    n_val = hp.val_batch_size // hp.batch_slices
    # Banks shard evenly on 8 GPUs (and on any world size --batch_slices allows), the same on every
    # world size.
    extra = dict(attn_backend=attn_backend, rotary_max_len=max(n_train, n_val),
                 bank_multiple=math.lcm(8, hp.batch_slices))
    cfg = ModelConfig(**{n: getattr(hp, n) for n in names if hasattr(hp, n) and n not in extra},
                      **extra)
    return GPT(cfg, device)


def build_optimizer(hp: Hyperparameters, model: nn.Module, rank: int, world_size: int) -> Any:
    table = {label: dict(row, **({"matrix_shape": model.bank_matrix_shapes[label]}
                                 if label in model.bank_matrix_shapes else {}))
             for label, row in hp.param_table.items()}
    return NorMuonAndAdam(dict(model.named_parameters()), table,
                          adam_lr=hp.adam_lr, adam_eps=hp.adam_eps, adam_wd=hp.adam_wd,
                          muon_lr=hp.muon_lr, muon_beta2=hp.muon_beta2, muon_wd=hp.muon_wd,
                          rank=rank, world_size=world_size, fused=hp.kernels == "fused")


# ---- how a run ends ------------------------------------------------------------------------------
# Exit codes (the README's failure table): 1 data, 2 options / environment / output folders, 3 the
# loss stopped being finite, 4 a distributed failure (usually another rank failed first), 5 an
# internal error (a bug: the log has the traceback), 128 + N a signal (130 Ctrl-C, 143 SIGTERM).
EXIT_DATA, EXIT_CONFIG, EXIT_DIVERGED, EXIT_PEER, EXIT_BUG = 1, 2, 3, 4, 5


class TrainingDiverged(FloatingPointError):
    """The loss (train or validation) stopped being finite."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM ended the run; exit_code is 128 + the signal number."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class StopSignals:
    """Ctrl-C (SIGINT) and SIGTERM. Inside the timed loop (`defer` is set) the first signal asks the
    run to stop at a step boundary that every rank agrees on, where --save_checkpoint can save a
    consistent state; a second signal (or one outside the loop) stops at once. torchrun passes a
    terminal's Ctrl-C on to its workers, who also got it from the terminal: a repeat within a second
    is that same key press, not a second one."""

    REPEAT_S = 1.0

    def __init__(self, announce: bool = True):
        self.requested: int | None = None        # the signal asking for a stop at
                                                 # the next agreed step boundary
        self.defer = False
        self.announce = announce
        self._at = 0.0
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        import signal
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        import signal
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        import signal
        name = signal.Signals(signum).name
        if self.defer and self.requested is None:
            self.requested, self._at = signum, time.monotonic()
            if self.announce:
                print(f"{name}: stopping at the next step boundary (again to stop at once)",
                      file=sys.stderr, flush=True)
            return
        if self.defer and time.monotonic() - self._at < self.REPEAT_S:
            return
        raise Interrupted(signum, f"stopped by {name}")


def describe_failure(e: BaseException, rank: int, world_size: int) -> tuple[int, str]:
    """(exit code, the one-line message) for an exception that ended the run."""
    cause = e
    while cause is not None and not isinstance(cause, (Interrupted, KeyboardInterrupt)):
        cause = cause.__cause__ or cause.__context__     # a signal inside a compile
                                                         # comes wrapped (InductorError)
    if cause is not None:
        e = cause
    if isinstance(e, ConfigError):
        return EXIT_CONFIG, str(e)
    if isinstance(e, DataError):
        return EXIT_DATA, str(e)
    if isinstance(e, TrainingDiverged):
        return EXIT_DIVERGED, str(e)
    if isinstance(e, Interrupted):
        return 128 + e.signum, str(e)
    if isinstance(e, KeyboardInterrupt):
        return 130, "stopped by SIGINT"
    if isinstance(e, torch.OutOfMemoryError):
        return EXIT_CONFIG, (f"out of GPU memory ({str(e).splitlines()[0][:160]}): lower the "
                             "batches in --stages and --val_batch_size, or use more GPUs (the math "
                             "is the same on 1, 2, 4 or 8)")
    first_line = (str(e).strip().splitlines() or [""])[0][:300]
    if world_size > 1 and isinstance(e, (RuntimeError, dist.DistError)):
        return EXIT_PEER, (f"{type(e).__name__} in a distributed run ({first_line}). If another "
                           "rank failed first, its message is the cause; this rank stopped after "
                           "at most --pg_timeout_s seconds")
    return EXIT_BUG, (f"internal error, a bug: {type(e).__name__}: {first_line} (the traceback "
                      "is in the log; --debug=true prints it here too). Please report it")


@dataclass
class Run:
    """One process's view of the run: its place among the ranks, the log, and how the run ends."""
    hp: Hyperparameters
    rank: int
    world_size: int
    device: torch.device
    run_id: str
    log: RunLogger
    stops: StopSignals
    t_process: float                     # perf_counter at process start,
                                         # for the untimed phase lines
    resumed: dict | None                 # the checkpoint this run continues, if any
    compile_cache: tuple | None = None   # (path, key, versions) to save after the warmup
    cache_loaded: bool = False           # the compile cache file filled torch's caches
    compiling: bool = False              # torch.compile is on (CUDA and --compile)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def since_start_ms(self) -> float:
        return 1000 * (time.perf_counter() - self.t_process)

    @contextlib.contextmanager
    def failures_logged(self) -> Iterator[None]:
        """The log ends with the error line main() prints (and a bug's traceback); the log is closed
        either way."""
        try:
            yield
        except BaseException as e:
            self.stops.defer = False
            if not isinstance(e, SystemExit):
                code, message = describe_failure(e, self.rank, self.world_size)
                if code in (EXIT_BUG, EXIT_PEER):
                    import traceback
                    self.log(traceback.format_exc().rstrip(), console=False)
                self.log(f"error: {message}", console=False)
            raise
        finally:
            self.log.close()


def open_run(hp: Hyperparameters, stops: StopSignals) -> Run:
    """Check the options, join the process group, read a checkpoint to resume, agree on a run id,
    create the log."""
    t_process = time.perf_counter()
    validate_hyperparameters(hp, launch_environment()[1])
    rank, world_size, _, device = setup_distributed(hp)
    stops.announce = rank == 0
    resumed = load_checkpoint(hp.resume, rank, world_size) if hp.resume else None
    run_id = hp.run_id or (f"{resumed['run_id']}-from{resumed['step']}" if resumed
                           else str(uuid.uuid4()))
    if world_size > 1:                  # one name for every rank's checkpoints and traces
        shared = [run_id]
        dist.broadcast_object_list(shared, 0)
        run_id = shared[0]
    log_path = prepare_output(hp, run_id, rank)
    if world_size > 1:
        dist.barrier()                  # every rank has checked that the log
                                        # does not exist before rank 0 makes it
    log = RunLogger(log_path if rank == 0 else None)
    return Run(hp, rank, world_size, device, run_id, log, stops, t_process, resumed)


def prepare_training(run: Run, argv_text: str) -> tuple[Trainer, Checkpointer]:
    """Log the code and settings, run the preflight checks, build the model and optimizer,
    compile."""
    hp, log, device = run.hp, run.log, run.device
    if run.rank == 0:
        print(f"logging to {log.path}", flush=True)
        code = "\n".join(f"==== {name} ====\n" + Path(__file__).with_name(name).read_text()
                         for name in ("train_gpt.py", "triton_kernels.py"))
        log(code, console=False)
        log("=" * 100 + "\n" + environment_report() + "=" * 100, console=False)
        log(f"command: {argv_text}")
        log("hyperparameters:\n" + "\n".join(f"  {f.name} = {getattr(hp, f.name)!r}"
                                              for f in dataclasses.fields(hp)), console=False)
    for note in preflight(hp, run.world_size, device, run.rank):
        log(note)
    train_files, val_files = (resolve_shards(hp.train_files, "train"),
                              resolve_shards(hp.val_files, "val"))
    try:
        attn_backend = resolve_attn_backend(hp.attn_backend, device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    compiling = run.compiling = hp.compile and device.type == "cuda"
    log(f"world_size:{run.world_size} grad_accum:{hp.batch_slices // run.world_size} "
        f"device:{device} attn_backend:{attn_backend} (asked: {hp.attn_backend}) "
        f"compile:{compiling} dtype:{hp.dtype}")
    facts = run_facts(run.world_size, device, attn_backend, train_files)
    if run.resumed is not None:
        check_resume(run.resumed, hp, facts)
        if run.resumed["code"] != Path(__file__).read_text():
            log("warning: train_gpt.py differs from the code that wrote the checkpoint "
                "(its log has that code); the continuation is exact only if the change leaves the "
                "math alone")
    checkpointer = Checkpointer(hp, run.run_id, run.rank, run.world_size, facts, log)

    if hp.seed >= 0:
        torch.manual_seed(hp.seed)
    model = build_model(hp, device, attn_backend)
    if run.world_size > 1:
        for p in model.parameters():
            dist.broadcast(p.detach(), 0)
    opt = build_optimizer(hp, model, run.rank, run.world_size)
    compiled = model
    if compiling and hp.compile_cache:
        sources = [Path(__file__).with_name(name).read_text()
                   for name in ("train_gpt.py", "triton_kernels.py")]
        path, versions = Path(hp.compile_cache).expanduser(), compile_cache_versions(device)
        key = compile_cache_key([*sources, compile_cache_settings(hp, attn_backend)], versions)
        loaded, note = load_compile_cache(path, key)
        log(note)
        run.compile_cache = None if loaded else (path, key, versions)
        run.cache_loaded = loaded
    if compiling:
        configure_compiler()
        compiled = torch.compile(model, dynamic=False, fullgraph=True)
    trainer = Trainer(hp, model, compiled, opt, device, run.rank, run.world_size, train_files,
                      val_files)
    run.sync()
    log(f"phase:startup time:{run.since_start_ms():.0f}ms")
    return trainer, checkpointer


def warmup_and_reset(trainer: Trainer, run: Run) -> None:
    """Compile every variant on real batches (warmup_steps), then restore the exact initial state,
    and check it."""
    t0 = time.perf_counter()
    model, opt = trainer.model, trainer.opt
    initial = snapshot_state(model, opt)
    steps = warmup_steps(trainer.hp)
    compile_log = CompileLog(run.compiling, eager_autotuners(tk))
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", run.world_size))   # GPUs of this machine
    per_gpu = split_processes_per_gpu(trainer.hp, ranks, run.cache_loaded)
    with compile_log.recording():
        if run.compiling and trainer.hp.compile_split and ranks * per_gpu > 1:
            compile_split(trainer, run, ranks, per_gpu, compile_log, t0)
        run.log(f"warmup: compiling on steps {steps}")
        for i, step in enumerate(steps):
            sched = schedule_at(step, trainer.hp)
            batch_change = trainer.advance_schedule(sched)
            with compile_log.during(step, "val"):
                trainer.validate(sched.ws_short, sched.ws_long, max_batches=1)
            with compile_log.during(step, "train"):
                trainer.train_step(sched, batch_change)
            run.log(f"  warmup {i + 1}/{len(steps)} step {step} done at "
                    f"{time.perf_counter() - t0:.1f}s")
    report = compile_log.report(time.perf_counter() - t0)
    for line in report[:-1]:     # the table in the file, its summary on the console too
        run.log(line, console=False)
    if report:
        run.log(report[-1])
    model.load_state_dict(initial["model"])
    opt.load_state_dict(initial["optimizer"])
    for p in model.parameters():
        p.grad = None
    if not states_equal(snapshot_state(model, opt), initial):
        raise RuntimeError("the state after the warmup reset differs from the initial state "
                           "(a bug: report it)")
    trainer.reset_schedule_state()
    run.sync()
    run.log(f"phase:warmup time:{1000 * (time.perf_counter() - t0):.0f}ms "
            "(state reset and checked)")


def compile_split(trainer: Trainer, run: Run, ranks: int, per_gpu: int, compile_log: CompileLog,
                  t0: float) -> None:
    """Each GPU's processes (its rank and the rank's helpers) compile their share of the variants
    (split_compile_tasks) alone and at the same time; torch writes each graph to its on-disk
    caches, which every process of a machine shares (the same code on cuda:0 everywhere,
    isolate_gpu), so the warmup that follows loads instead of compiling. Compiling is mostly
    single-threaded Python, so even one GPU gains from several processes; they take turns to run
    (GpuTurns). Leaves the weights, gradients and schedule state as it found them."""
    import tempfile
    hp = trainer.hp
    shares = split_compile_tasks(hp, ranks * per_gpu)
    local = run.rank % ranks
    mine, theirs = shares[local], [share for share in shares[local + ranks::ranks] if share]
    run.log(f"warmup: {ranks} rank(s), {per_gpu} process(es) per GPU, compile a share alone "
            f"first (rank 0: {describe_share(mine)}"
            + "".join(f"; helper {i + 1}: {describe_share(sh)}" for i, sh in enumerate(theirs))
            + ")")
    with tempfile.TemporaryDirectory(prefix="compile_split_") as folder:
        turns = GpuTurns(Path(folder) / "gpu.lock", trainer.device)
        helpers = [CompileHelper(trainer, share, Path(folder) / f"helper{i + 1}", turns.path)
                   for i, share in enumerate(theirs)]
        try:
            with turns.taken_after_compiling():
                for step, phase in mine:
                    with compile_log.during(step, f"{phase}*"):
                        trainer.compile_alone(step, phase)
                    turns.give(trainer.model)
            for i, helper in enumerate(helpers):
                run.log(f"  helper {i + 1}: {helper.wait()}")
        finally:
            for helper in helpers:
                helper.stop()
    trainer.reset_schedule_state()
    run.sync()
    if run.world_size > 1:
        dist.barrier()
    run.log(f"  shares compiled on every GPU at {time.perf_counter() - t0:.1f}s")


def describe_share(share: list[tuple[int, str]]) -> str:
    return ", ".join(f"{phase} of step {step}" for step, phase in share) or "nothing"


class GpuTurns:
    """The processes of one GPU in the split compile at the same time but run one at a time. A
    process takes the turn (an flock on a file they share) when one of its compilations ends, since
    running the graph is what follows (a training graph's backward is compiled with its forward,
    configure_compiler), and gives it back after its task, with the task's memory freed. So the
    split needs one process's memory for a training micro-batch (34 GiB reserved at the record's
    sizes on one GPU) and a few GiB for each other process, not a micro-batch each; and inductor
    times its autotuning candidates without another process's kernels on the GPU."""

    def __init__(self, path: Path, device: torch.device):
        self.path, self.device = path, device
        self.file = open(path, "a+b")
        self.held = False

    def take(self, *_: Any) -> None:
        import fcntl
        if not self.held:
            fcntl.flock(self.file, fcntl.LOCK_EX)
            self.held = True

    def give(self, model: nn.Module) -> None:
        import fcntl
        for p in model.parameters():
            p.grad = None
        if self.held:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.held = False

    @contextlib.contextmanager
    def taken_after_compiling(self) -> Iterator[None]:
        """Take the turn at the end of every compilation (torch's callback, CompileLog's hook)."""
        from torch._dynamo.callback import callback_handler
        callback_handler.register_end_callback(self.take)
        try:
            yield
        finally:
            callback_handler.remove_end_callback(self.take)
            self.file.close()     # an flock still held goes with it


# The variable that makes `python train_gpt.py` a compile helper: the path of its task file.
COMPILE_HELPER_ENV = "TRAIN_GPT_COMPILE_HELPER"


class CompileHelper:
    """A process beside a rank that compiles a share of the split on the rank's GPU. It runs this
    script again, as __main__ like the rank (torch's cache keys hold the module names of the
    model's classes, so a multiprocessing child, __mp_main__, would compile graphs the rank cannot
    load), with a task file instead of options (compile_helper_main). A helper that fails costs
    nothing but time: the warmup compiles whatever is not in the caches."""

    def __init__(self, trainer: Trainer, share: list[tuple[int, str]], stem: Path, lock: Path,
                 compile: bool = True):
        import pickle
        import subprocess
        t = trainer
        self.task, self.result, self.output = (stem.with_suffix(".task"),
                                               stem.with_suffix(".result"),
                                               stem.with_suffix(".out"))
        self.task.write_bytes(pickle.dumps(dict(
            hp=t.hp, device=str(t.device), attn_backend=t.model.cfg.attn_backend, rank=t.rank,
            world_size=t.world_size, train_files=t.train_files, val_files=t.val_files,
            share=share, compile=compile, lock=str(lock), result=str(self.result))))
        with open(self.output, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve())], stdout=out,
                stderr=subprocess.STDOUT, env={**os.environ, COMPILE_HELPER_ENV: str(self.task)})

    def wait(self) -> str:
        """Block until the helper is done; one line saying how it went."""
        import pickle
        code = self.process.wait()
        try:
            result = pickle.loads(self.result.read_bytes())
        except (OSError, EOFError, pickle.UnpicklingError):
            lines = self.output.read_text(errors="replace").strip().splitlines()
            result = {"error": f"exit code {code}" + (f": {lines[-1]}" if lines else "")}
        if "error" in result:
            return f"failed ({result['error']}); the warmup compiles its graphs"
        return (f"done in {result['seconds']:.1f}s, peak memory reserved "
                f"{result['peak_bytes'] / 2**20:,.0f} MiB")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait()


def exit_with_parent(interval_s: float = 1.0) -> None:
    """Leave at once (exit status 1) when the process that started this one is gone: a daemon
    thread polls the parent pid, which changes when the parent dies and this process is adopted. So
    a helper does not go on compiling for a rank killed with SIGKILL, which runs no cleanup."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(1)
    threading.Thread(target=watch, name="exit_with_parent", daemon=True).start()


def compile_helper_main(task_path: str) -> int:
    """A CompileHelper's process: the rank's model, built again on the rank's GPU with the same
    compiler settings, runs its share through Trainer.compile_alone (so its graphs are exactly the
    rank's), taking GPU turns with the rank; it writes {seconds, peak_bytes} or {error} to the
    result file. No optimizer and no process group: compile_alone needs neither."""
    import pickle
    t0 = time.perf_counter()
    exit_with_parent()
    task = pickle.loads(Path(task_path).read_bytes())
    try:
        device = torch.device(task["device"])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        hp = task["hp"]
        model = build_model(hp, device, task["attn_backend"])
        compiled = model
        if task["compile"]:
            configure_compiler()
            compiled = torch.compile(model, dynamic=False, fullgraph=True)
        trainer = Trainer(hp, model, compiled, None, device, task["rank"], task["world_size"],
                          task["train_files"], task["val_files"])
        turns = GpuTurns(Path(task["lock"]), device)
        with turns.taken_after_compiling():
            for step, phase in task["share"]:
                trainer.compile_alone(step, phase)
                turns.give(model)
        peak = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0
        result = {"seconds": time.perf_counter() - t0, "peak_bytes": peak}
    except BaseException as e:  # Ctrl-C too: the rank reports it, the helper leaves quietly
        first_line = (str(e).strip().splitlines() or [""])[0]      # the rank's log line is one line
        result = {"error": f"{type(e).__name__}: {first_line}"}
    atomic_write(Path(task["result"]), lambda tmp: tmp.write_bytes(pickle.dumps(result)))
    return 0 if "seconds" in result else 1


class Bookkeeping:
    """What the timed loop does besides training: the clock, validation lines, the NaN guard and its
    last good state, step lines and progress, checkpoints, stop signals and profiling."""

    def __init__(self, run: Run, trainer: Trainer, checkpointer: Checkpointer, start: int,
                 train_ms: float):
        hp = run.hp
        self.run, self.trainer, self.checkpointer, self.hp = run, trainer, checkpointer, hp
        self.clock = TrainClock(run.sync)
        self.clock.ms = train_ms
        self.profiler = StepProfiler(hp, run.run_id, run.rank, run.log)
        self.saving = hp.save_checkpoint or hp.checkpoint_every > 0
        self.check_every = hp.nonfinite_check_every
        # Signals are polled between steps: every step with one process (a host flag, free); with
        # several, at the NaN check's sync points (or every 25 steps), where the ranks agree on
        # stopping with one tiny all-reduce.
        self.poll_every = 1 if run.world_size == 1 else (self.check_every or 25)
        # first step with a bad loss
        self.first_bad = torch.full((), -1, dtype=torch.int64, device=run.device)
        # When states are saved, `pending` is the state at the last check; it is known good once the
        # steps after it have produced finite losses, and only then becomes `last_good` (the state
        # saved if training blows up).
        self.last_good = None
        self.pending = trainer.state(start, train_ms) if self.saving else None
        self.tokens_after = np.cumsum([schedule_at(s, hp).global_batch
                                       for s in range(hp.num_iterations)])  # ETA

    def start(self) -> None:
        self.run.log(f"phase:process_start_to_timed_loop time:{self.run.since_start_ms():.0f}ms")
        self.run.stops.defer = True
        self.clock.start()

    def validate(self, step: int, sched: StepSchedule, last: bool) -> float:
        """Validate off the clock (the final validation with the final window) and log it."""
        train_ms = self.clock.pause()
        tv = time.perf_counter()
        val_loss = self.trainer.validate(sched.ws_short,
                                         self.hp.ws_long_final_val if last else sched.ws_long)
        self.run.log(f"step:{step}/{self.hp.num_iterations} val_loss:{val_loss:.4f} "
                     f"train_time:{train_ms:.0f}ms step_avg:{train_ms / max(step, 1):.2f}ms")
        self.run.log(f"phase:validation time:{1000 * (time.perf_counter() - tv):.0f}ms",
                     console=False)
        if not math.isfinite(val_loss):
            raise TrainingDiverged(f"the validation loss is {val_loss} at step {step}: lower the "
                                   "learning rates (--adam_lr, --muon_lr) or check the data")
        self.clock.start()
        return val_loss

    @contextlib.contextmanager
    def profiled(self, step: int) -> Iterator[None]:
        self.profiler.before_step(step)
        yield
        self.profiler.after_step(step + 1, self.run.sync)

    def after_step(self, done: int, loss: Tensor, sched: StepSchedule) -> None:
        self._check_finite(done, loss)
        self._log_step(done, loss, sched)
        total = self.hp.num_iterations
        if self.hp.checkpoint_every and done % self.hp.checkpoint_every == 0 and done < total:
            # off the clock
            self.checkpointer.save(self.trainer.state(done, self.clock.pause()), periodic=True)
            self.clock.start()
        if done % self.poll_every == 0 and done < total:
            self._stop_if_asked(done)

    def _check_finite(self, done: int, loss: Tensor) -> None:
        """No sync per step: the first bad step is remembered on the device and looked at every
        check_every steps."""
        if not self.check_every:
            return
        bad_now = (self.first_bad < 0) & ~torch.isfinite(loss)
        self.first_bad.copy_(torch.where(bad_now, done - 1, self.first_bad))
        if done % self.check_every and done != self.hp.num_iterations:
            return
        bad = int(self.first_bad.item())
        if bad >= 0:
            if self.last_good is not None:
                self.checkpointer.save(self.last_good)
            raise TrainingDiverged(
                f"the training loss became NaN or infinite at step {bad}"
                + (f"; the last good state (step {self.last_good['step']}) was saved"
                   if self.last_good else "")
                + ": lower the learning rates (--adam_lr, --muon_lr) or check the data")
        if self.saving:
            self.last_good, self.pending = (self.pending,
                                            self.trainer.state(done, self.clock.now_ms()))

    def _log_step(self, done: int, loss: Tensor, sched: StepSchedule) -> None:
        total, ms = self.hp.num_iterations, self.clock.now_ms()
        line = f"step:{done}/{total} train_time:{ms:.0f}ms step_avg:{ms / done:.2f}ms"
        if self.hp.train_loss_every and done % self.hp.train_loss_every == 0:
            line += f" train_loss:{self.trainer.mean_train_loss(loss, sched):.6f}"
        self.run.log(line, console=False)      # the file keeps the fixed format;
                                               # the console adds progress
        if self.run.rank == 0:
            print(line + progress_note(done, total, ms, int(self.tokens_after[done - 1]),
                                       int(self.tokens_after[-1])),
                  flush=True)

    def _stop_if_asked(self, done: int) -> None:
        signum = self.run.stops.requested or 0
        if self.run.world_size > 1:                 # any rank's signal stops
                                                    # every rank at this same step
            agreed = torch.tensor(signum, device=self.run.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            signum = int(agreed.item())
        if signum:
            import signal
            saved = ""
            if self.saving:
                path = self.checkpointer.save(self.trainer.state(done, self.clock.pause()))
                saved = (f"; the state after step {done} is saved in {path.parent}: "
                         f"--resume={path.parent}")
            raise Interrupted(signum, f"stopped by {signal.Signals(signum).name} after step "
                                      f"{done} of {self.hp.num_iterations}{saved}")

    def finish(self, val_loss: float) -> dict[str, Any]:
        """After the last step: the final checkpoint, peak memory, the result line; returns the
        run's summary."""
        self.run.stops.defer = False
        if self.saving:
            self.checkpointer.save(self.trainer.state(self.hp.num_iterations, self.clock.ms))
        device, log = self.run.device, self.run.log
        peak_mib = (torch.cuda.max_memory_allocated(device) // 2**20 if device.type == "cuda"
                    else None)
        if peak_mib is not None:
            log(f"peak memory allocated: {peak_mib} MiB reserved: "
                f"{torch.cuda.max_memory_reserved(device) // 2**20} MiB")
        log(result_line(val_loss, self.hp.val_loss_target, self.clock.ms, self.hp.num_iterations,
                        peak_mib, log.path))
        return {"val_loss": val_loss, "train_time_ms": self.clock.ms, "run_id": self.run.run_id,
                "log": str(log.path)}


def train(hp: Hyperparameters, argv_text: str, stops: StopSignals | None = None) -> dict[str, Any]:
    """The whole run: setup, warmup and reset, then the timed loop. Returns a summary (final val
    loss, train time)."""
    run = open_run(hp, stops or StopSignals())
    with run.failures_logged():
        trainer, checkpointer = prepare_training(run, argv_text)
        if hp.warmup:
            warmup_and_reset(trainer, run)
            if run.compile_cache is not None and run.rank == 0:   # compiled: keep it for next time
                run.log(save_compile_cache(*run.compile_cache))
        import gc
        gc.collect()
        start, train_ms = 0, 0.0
        if run.resumed is not None:  # the saved state replaces the initial one
            trainer.restore(run.resumed)
            start, train_ms = run.resumed["step"], run.resumed["train_time_ms"]
            run.log(f"resumed from {run.resumed['path']} after step {start} of {hp.num_iterations} "
                    f"(train_time so far {train_ms:.0f}ms)")

        book = Bookkeeping(run, trainer, checkpointer, start, train_ms)
        val_loss, total = float("nan"), hp.num_iterations
        book.start()
        for step in range(start, total + 1):
            last = step == total
            sched = schedule_at(min(step, total - 1), hp)
            # and YaRN at a window change
            batch_change = trainer.advance_schedule(sched) if not last else None
            if last or (hp.val_loss_every > 0 and step % hp.val_loss_every == 0):
                val_loss = book.validate(step, sched, last)
            if last:
                break
            with book.profiled(step):
                loss = trainer.train_step(sched, batch_change)    # forward/backward of each
                                                                  # micro-batch, optimizer
            book.after_step(step + 1, loss, sched)                # NaN guard, step line,
                                                                  # checkpoint, stop signals
        return book.finish(val_loss)


def _debug_requested(argv: Sequence[str]) -> bool:
    """--debug / --debug=true, read before parsing (so a parse error can show its traceback too)."""
    return any(a == "--debug"
               or (a.startswith("--debug=") and a[8:].lower() in ("1", "true", "yes", "on"))
               for a in argv)


def short_environment(device: torch.device) -> str:
    """One line: GPU, driver, torch, CUDA, Triton and NCCL versions (the log keeps the full
    report)."""
    import triton
    parts = [f"torch {torch.__version__}", f"triton {triton.__version__}"]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        used = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        parts = [f"{used}x {props.name} "
                 f"({props.total_memory / 2**30:.0f} GiB)"] + parts
        parts.append(f"CUDA {torch.version.cuda}")
        if dist.is_available() and hasattr(torch.cuda, "nccl"):
            parts.append("NCCL " + ".".join(str(v) for v in torch.cuda.nccl.version()))
    else:
        parts = ["CPU"] + parts
    return ", ".join(parts)


def dry_run(hp: Hyperparameters) -> dict[str, Any]:
    """Every check train() makes before it builds or compiles anything, printed (rank 0) as a
    checklist. The first failing check raises, and main() reports it with its exit code as for a
    real run."""
    world = launch_environment()[1]
    validate_hyperparameters(hp, world)
    rank, world_size, _, device = setup_distributed(hp)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"dry run: the checks before compiling, for {world_size} process(es)")
    say(f"  ok  options: valid for {world_size} process(es) x {hp.batch_slices // world_size} "
        "accumulation steps")
    try:
        backends = available_attn_backends(device)
        chosen = resolve_attn_backend(hp.attn_backend, device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    say(f"  ok  environment: {short_environment(device)}; attention backends {', '.join(backends)} "
        f"(--attn_backend={hp.attn_backend} runs {chosen})")
    run_id = hp.run_id or "<a new run id>"
    if hp.run_id:
        prepare_output(hp, run_id, rank)
    else:
        prepare_output(dataclasses.replace(hp, save_checkpoint=False), f".dry_run_{os.getpid()}",
                       rank)
    say(f"  ok  output: {hp.log_dir}/ is writable; the log would be {hp.log_dir}/{run_id}.txt")
    if hp.resume:
        saved = load_checkpoint(hp.resume, rank, world_size)
        check_resume(saved, hp, run_facts(world_size, device, chosen,
                                          resolve_shards(hp.train_files, "train")))
        say(f"  ok  resume: {saved['path']} continues after step {saved['step']} of "
            f"{hp.num_iterations}; the math options match")
    for note in preflight(hp, world_size, device, rank):
        say(f"  {'!!' if note.startswith('warning') else 'ok'}  {note}")
    say("dry run passed: nothing was built, compiled or trained")
    return {"dry_run": True}


def main(argv: Sequence[str] | None = None) -> int:
    """Run from the command line: one `error: ...` line and an exit code for every failure
    (see EXIT_* above)."""

    if COMPILE_HELPER_ENV in os.environ:   # started by a rank's compile split, not by a user
        return compile_helper_main(os.environ.pop(COMPILE_HELPER_ENV))
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help", "help") for a in argv):
        print(help_text())
        return 0
    os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    stops = StopSignals()
    stops.install()
    try:
        hp = parse_args(argv)
        if hp.dry_run:
            dry_run(hp)
        else:
            train(hp, " ".join(argv), stops)
        return 0
    except Exception as e:
        return _report_failure(e, _debug_requested(argv))
    except KeyboardInterrupt as e:   # a Ctrl-C that arrived before the handler was installed
        return _report_failure(e, _debug_requested(argv))
    finally:
        stops.uninstall()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _report_failure(e: BaseException, debug: bool) -> int:
    distributed = dist.is_available() and dist.is_initialized()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    code, message = describe_failure(e, rank, world_size)
    if debug:
        import traceback
        traceback.print_exception(e)
    # Options, data and signals are the same on every rank: rank 0 speaks for all of them.
    if rank == 0 or code in (EXIT_DIVERGED, EXIT_PEER, EXIT_BUG):
        print(f"error: {'' if world_size == 1 else f'rank {rank}: '}{message}", file=sys.stderr,
              flush=True)

    return code


if __name__ == "__main__":
    sys.exit(main())
