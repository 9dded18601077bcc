"""What train_gpt.py runs that only checks, probes or reports: it never changes a number.

The option and layout checks, the optimizer table's checks, the attention backends' probing (and FlashAttention-4's
ops, registered so that they compile), the --kernels switch's bookkeeping (which op runs its kernel, which reference
was edited since its kernel was checked), the shard files' checks, the shipped prefix-token table's read against its
digest, and the preflight before anything compiles (data, memory). Each function takes values: the options, the
optimizer table, parameter shapes from a model built on the meta device, file lists. Nothing here imports the
script (a copy of train_gpt.py under any name uses this file as it is); every run's log embeds this file verbatim
beside the script. Each error names the option or file to change. Nothing happens at import.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import os
from typing import Any, Callable, Collection, Sequence

import numpy as np
import torch

import harness
from data.shards import (PREFIX_TABLE_DTYPE, PREFIX_TABLE_ENTRIES, PREFIX_TABLE_PATH,
                         PREFIX_TABLE_SHA256, SHARD_HEADER_BYTES, SHARD_MAGIC, SHARD_VERSION,
                         prefix_table_digest)
from harness import ConfigError, DataError

Tensor = torch.Tensor

# ==================================================================================================
# The --kernels switch: which op runs its fused kernel, which reference was edited
# ==================================================================================================

def kernel_requests(kernels: str, ops: Sequence[str]) -> dict[str, str]:
    """What --kernels asks of each op it names (ops: the switchable ones), "torch" or "fused":
    "fused" names none (the default choice), "torch" every op, else comma-separated op:torch /
    op:fused pairs."""
    if kernels in ("fused", "torch"):
        return dict.fromkeys(ops if kernels == "torch" else (), "torch")
    pairs = [item.strip().partition(":") for item in kernels.split(",")]
    bad = [op + sep + how for op, sep, how in pairs if op not in ops
           or how not in ("torch", "fused")]
    if bad:
        raise ConfigError(f"--kernels={kernels}: {', '.join(bad)} is not op:torch or op:fused; "
                          f"use fused, torch, or ops of {', '.join(ops)} "
                          "(e.g. --kernels=mlp:torch,ce:torch)")
    requests: dict[str, str] = {}
    for op, _, how in pairs:
        if requests.setdefault(op, how) != how:
            raise ConfigError(f"--kernels={kernels} asks for both {op}:torch and {op}:fused; keep "
                              "one of them")
    return requests


def edited_references(references: dict[str, tuple[Sequence[Any], str]]) -> dict[str, str]:
    """The ops whose definitions changed since their digest was recorded, each with its new digest
    (none where the source cannot be read, e.g. a frozen install)."""
    import inspect
    edited = {}
    for op, (definitions, digest) in references.items():
        try:
            now = harness.reference_digest([inspect.getsource(d) for d in definitions])
        except (OSError, TypeError):
            continue
        if now != digest:
            edited[op] = now
    return edited


def fused_ops(kernels: str, device_type: str, edited: Collection[str],
              ops: Sequence[str]) -> frozenset[str]:
    """The ops (of `ops`) that run their fused kernel: on CUDA those --kernels forces (op:fused) or
    leaves to the default, except an op whose reference was edited (its edit runs); off CUDA
    none."""
    requests = kernel_requests(kernels, ops)
    if device_type != "cuda":
        return frozenset()
    return frozenset(op for op in ops
                     if requests.get(op, "torch" if op in edited else "fused") == "fused")


def kernel_switch_lines(kernels: str, device_type: str, edited: dict[str, str],
                        references: dict[str, tuple[Sequence[Any], str]]) -> list[str]:
    """One log line per op whose reference was edited (edited: op -> its new digest): whether this
    run uses the edit, and how to choose the other way."""
    fused, lines = fused_ops(kernels, device_type, edited, tuple(references)), []
    for op, digest in edited.items():
        names = ", ".join(d.__name__ for d in references[op][0])
        if op in fused:
            uses = (f"this run uses the fused kernel (--kernels={op}:fused), which does NOT run the "
                    "edit; drop that to run the edit")
        elif device_type == "cuda":
            uses = (f"this run uses the edit, not the fused kernel; --kernels={op}:fused forces "
                    "the kernel")
        else:
            uses = "this run uses the edit (off CUDA every op runs its reference)"
        lines.append(f"warning: {names} (op {op}) changed since its fused kernel was checked "
                     f"against it; {uses}. Once the kernel matches the edit, set the op's digest "
                     f"in KERNEL_REFERENCES to {digest}")
    return lines


def cpu_bf16_override() -> str | None:
    """NANOGPT_CPU_BF16 when it is native or emulated (it then decides cpu_runs_bf16_natively), else
    None."""
    forced = os.environ.get("NANOGPT_CPU_BF16", "")
    return forced if forced in ("native", "emulated") else None


def cpu_runs_bf16_natively(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has bf16 matrix instructions (AMX or AVX512-BF16), which torch's CPU matmuls
    use; without them torch emulates bf16, about ten times slower than float32. cpuinfo: the text
    of /proc/cpuinfo (read when None; other systems count as emulating). NANOGPT_CPU_BF16=native or
    emulated overrides the probe (tests run both paths on any machine)."""
    if forced := cpu_bf16_override():
        return forced == "native"
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    flags = {word for line in cpuinfo.splitlines() if line.startswith("flags")
             for word in line.partition(":")[2].split()}
    return bool(flags & {"amx_bf16", "avx512_bf16"})


# ==================================================================================================
# Attention backends: which are installed, which "auto" picks, FlashAttention-4's ops
# ==================================================================================================
# What each backend is: train_gpt.py's attention section (varlen_attention). fa3 is the module
# flash_attn_interface; fa4 the package flash-attn-4 (module flash_attn.cute; Hopper and Blackwell).
ATTN_BACKENDS = ("triton", "varlen", "fa3", "fa4", "sdpa")
# "auto" on CUDA takes the first available of these, fastest first as measured in whole runs
# (notes/history.md): FlashAttention-3 and -4 where installed, then our kernel; varlen is never
# picked while triton runs. Off CUDA "auto" means sdpa (the only CPU backward).
ATTN_AUTO_ORDER_CUDA = ("fa3", "fa4", "triton", "varlen", "sdpa")


def import_fa3() -> Any:
    """The FlashAttention-3 module, or None when it is not installed (or its CUDA library does not
    load)."""
    try:
        import flash_attn_interface
    except Exception:  # ImportError, or OSError from a .so built for another torch/CUDA
        return None
    return flash_attn_interface


def import_fa4() -> Any:
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


def import_torch_varlen() -> Callable | None:
    """torch's varlen_attn if this torch has it with sliding-window and scale arguments
    (torch >= 2.11), else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    import inspect
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn if "window_size" in params and "scale" in params else None


def available_attn_backends(device: torch.device) -> list[str]:
    """Backends that can run on `device`, in ATTN_BACKENDS order (probing the optional libraries
    registers FA4's ops)."""
    on_cuda = torch.device(device).type == "cuda"
    usable = {"triton": on_cuda, "varlen": on_cuda and import_torch_varlen() is not None,
              "fa3": on_cuda and import_fa3() is not None,
              "fa4": on_cuda and import_fa4() is not None, "sdpa": True}
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
        raise ConfigError(f"unknown --attn_backend={name!r}; "
                         f"choose auto or one of {', '.join(ATTN_BACKENDS)}")
    if name not in available:
        raise ConfigError(f"--attn_backend={name} cannot run on {device} here (fa3 needs the "
                         "flash_attn_interface module and CUDA; fa4 the flash-attn-4 package and "
                         "CUDA; varlen needs torch >= 2.11 and CUDA; triton needs CUDA); "
                         f"available: {', '.join(available)}; pass one of these or "
                         "--attn_backend=auto")
    return name


# ==================================================================================================
# The model's and the optimizer's own checks
# ==================================================================================================

def check_loss_gradient(grad_losses: Tensor, grad_scale: float) -> None:
    """Raise unless every row's incoming gradient is grad_scale (the FP8 head's loss ignores it)."""
    if not torch.equal(grad_losses, torch.full_like(grad_losses, grad_scale)):
        raise RuntimeError(
            f"the FP8 head's training loss computes its gradient in the forward for a backward of "
            f"grad_scale * sum(losses) with grad_scale={grad_scale}, but the losses received "
            f"gradients {grad_losses.unique()[:4].tolist()}: back-propagate "
            f"(loss * {grad_scale}).backward() on the summed loss, or pass the model "
            "grad_scale=<the factor your backward applies>")


def check_model_layout(hp: Any, gate_input_dim: int) -> None:
    """Raise ValueError naming the option to change for a layer layout the model cannot build (hp:
    the options; gate_input_dim: the channels every gate reads)."""
    L = hp.num_layers
    if hp.num_heads * hp.head_dim != hp.model_dim:
        raise ValueError(f"num_heads * head_dim = {hp.num_heads * hp.head_dim} must equal "
                         f"model_dim = {hp.model_dim}; change --num_heads, --head_dim or "
                         "--model_dim")
    if hp.head_dim % 4 or hp.model_dim < gate_input_dim:
        raise ValueError(f"--head_dim={hp.head_dim} must be a multiple of 4 (rotary pairs "
                         f"on its first half) and --model_dim >= {gate_input_dim} "
                         "(gate inputs)")
    if len(hp.attn_layout) != L or set(hp.attn_layout) - set("PN-"):
        raise ValueError(f"--attn_layout={hp.attn_layout!r} needs one of P, N, - per layer "
                         f"({L} layers)")
    if hp.num_heads % 2:
        raise ValueError(f"the qk bank holds Q and K by pairs of adjacent heads, and paired "
                         f"layers pair heads too: use an even --num_heads (got {hp.num_heads})")
    if len(hp.ve_layout) != L:
        raise ValueError(f"--ve_layout={hp.ve_layout} needs one entry per layer ({L})")
    bad = [j for j in hp.ve_layout if not -1 <= j < hp.num_value_embeds]
    if bad:
        raise ValueError(f"--ve_layout={hp.ve_layout} names value-embedding table(s) {bad}: "
                         "each entry is -1 (none) or a table index below "
                         f"--num_value_embeds={hp.num_value_embeds}; raise --num_value_embeds "
                         "or fix --ve_layout")
    if not 0 <= hp.cached_input_layer < L:
        raise ValueError(f"--cached_input_layer={hp.cached_input_layer} must be a layer index "
                         f"below num_layers={L} (the attention of later layers reads rms of its "
                         f"output; {L - 1} makes none do)")
    if hp.bigram_vocab_size < 2:
        raise ValueError(f"--bigram_vocab_size={hp.bigram_vocab_size} must be at least 2 (the "
                         "hash is taken modulo bigram_vocab_size - 1, whose value is the "
                         "sentinel row)")
    if any(j >= 0 and hp.attn_layout[i] == "-" for i, j in enumerate(hp.ve_layout)):
        raise ValueError("--ve_layout puts a value embedding on a layer without attention "
                         "(- in --attn_layout)")
    if any(not 0 <= i < L for i in hp.long_window_layers):
        raise ValueError(f"--long_window_layers={hp.long_window_layers} must be layer "
                         f"indices below {L}")
    if not 0 <= hp.skip_source_layer < hp.skip_dest_layer < L:
        raise ValueError("need 0 <= --skip_source_layer < --skip_dest_layer < num_layers")
    if hp.attn_layout[-1] != "N" or hp.ve_layout[-1] < 0 or hp.cached_input_layer >= L - 1:
        raise ValueError(f"the last layer is MUDD's: it needs normal attention (N last in "
                         f"--attn_layout={hp.attn_layout}), a value embedding (last entry of "
                         f"--ve_layout={hp.ve_layout} >= 0) and a --cached_input_layer before it "
                         f"(got {hp.cached_input_layer})")
    if hp.bigram_sign_rows < 1 or hp.bigram_sign_rows & (hp.bigram_sign_rows - 1):
        raise ValueError(f"--bigram_sign_rows={hp.bigram_sign_rows} must be a power of two (the "
                         "sign row is the low bits of the token pair's XOR)")
    if hp.mudd_hidden < 1:
        raise ValueError(f"--mudd_hidden={hp.mudd_hidden} must be at least 1")
    if hp.mudd_gate_hidden < 1 or hp.dc_window < 1:
        raise ValueError(f"--mudd_gate_hidden={hp.mudd_gate_hidden} and --dc_window="
                         f"{hp.dc_window} must be at least 1")
    if hp.dtype not in ("bfloat16", "float32", "float64"):
        raise ValueError(f"--dtype={hp.dtype}: use bfloat16 (training), auto, float32 or float64 "
                         "(CPU checks)")
    if hp.use_fp8 and hp.dtype != "bfloat16":
        raise ValueError("the FP8 LM head reads bf16 weights: use --use_fp8=false with "
                         f"--dtype={hp.dtype}")


def check_param_table(params: dict[str, Tensor], table: dict[str, dict], rank: int,
                      world_size: int, tied: tuple[str, str] | None) -> None:
    """Raise ValueError naming the fix for an optimizer table (one row per parameter label) that
    cannot drive these parameters on this process placement."""
    for label in params:
        if label not in table:
            raise ValueError(f"parameter {label!r} has no row in the optimizer table: "
                             "add it to param_table (DEFAULT_PARAM_TABLE in train_gpt.py)")
    for label in table:
        if label not in params:
            raise ValueError(f"param_table row {label!r} names no model parameter (parameters: "
                             f"{', '.join(params)}): remove the row or fix its name")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} / world_size {world_size} is not a valid "
                         "process placement")
    for label, row in table.items():
        p = params[label]
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
            if row["comms"] == "sharded" and p.shape[0] % world_size:
                raise ValueError(f"{label} has {p.shape[0]} rows in dim 0 of {tuple(p.shape)}, "
                                 f"not divisible by world_size {world_size}: "
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
        if row["comms"] == "sharded" and n_matrices % world_size:
            raise ValueError(f"{label} bank has {n_matrices} matrices, not divisible by "
                             f"world_size {world_size}: pad the bank "
                             "(GPT.bank_multiple) or use a world size that divides "
                             f"{n_matrices}")
    if tied is not None:
        head, embed = tied
        for label in (head, embed):
            if label not in table or table[label]["optim"] != "adam":
                raise ValueError(f"tied=({head!r}, {embed!r}): {label!r} must be an Adam "
                                 "parameter label; pass tied=None to train them separately")
        if (params[head].shape != params[embed].shape[::-1]
                or params[head].dim() != 2):
            raise ValueError(f"tied {head} {tuple(params[head].shape)} is not the "
                             f"transpose of {embed} {tuple(params[embed].shape)}: "
                             f"store {head} as (model_dim, vocab)")


# ==================================================================================================
# Shard files and the prefix-token table (their formats: data/shards.py)
# ==================================================================================================

def read_header(f, path: str) -> int:
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


def open_shard(path: str):
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
    with open_shard(path) as f:
        return read_header(f, path)


_ID_CHECK_CHUNK = 1 << 22   # tokens per max(): a background thread


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


def check_document_start(tokens: np.ndarray, path: str, bos_id: int, prefix: bool = False) -> None:
    """DataError unless `tokens` (a shard, or its first tokens) hold a document start: training
    batches start at documents."""
    if not (tokens == bos_id).any():
        raise DataError(f"shard {path} has no document start (token {bos_id}) in its "
                        f"{'first ' if prefix else ''}{len(tokens):,} tokens, and training "
                        "batches start at documents: make shards with data/tokenize_docs.py, "
                        "which starts every document with it")


def read_tokens(path: str, max_tokens: int | None = None,
                 out: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """(tokens uint16, n): all n tokens of a checked shard, or only its first max_tokens; read into
    `out` if given."""
    with open_shard(path) as f:
        n = read_header(f, path)
        count = n if max_tokens is None else min(n, max_tokens)
        tokens = np.empty(count, dtype=np.uint16) if out is None else out[:count]
        got = f.readinto(memoryview(tokens).cast("B"))
    if got != 2 * count:
        raise DataError(f"shard {path}: read {got} of {2 * count} token bytes (did the file change "
                        "while it was read?); download or generate it again")
    return tokens, n


def load_prefix_table(path: str = PREFIX_TABLE_PATH) -> Tensor:
    """The prefix-token table, (PREFIX_TABLE_ENTRIES,) int64 on the CPU: entry T is the id of the
    longest proper byte-prefix of GPT-2 token T that is itself a token, -1 if none. DataError
    unless the file holds exactly GPT-2's table (its digest)."""
    rebuild = ("rebuild it with `python3 data/prefix_table.py RANKS` (its --help says where "
               "GPT-2's ranks come from, offline too)")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise DataError(f"the prefix-token table {path} is missing; {rebuild}") from None
    except OSError as e:
        raise DataError(f"cannot read the prefix-token table {path}: {e.strerror or e}; "
                        f"{rebuild}") from None
    size = PREFIX_TABLE_ENTRIES * np.dtype(PREFIX_TABLE_DTYPE).itemsize
    if len(raw) != size:
        raise DataError(f"the prefix-token table {path} has {len(raw)} bytes, not {size} "
                        f"({PREFIX_TABLE_ENTRIES} int32 entries); {rebuild}")
    table = np.frombuffer(raw, dtype=PREFIX_TABLE_DTYPE).astype(np.int64)
    digest = prefix_table_digest(table)
    if digest != PREFIX_TABLE_SHA256:
        raise DataError(f"the prefix-token table {path} is not GPT-2's (sha256 {digest[:16]}..., "
                        f"expected {PREFIX_TABLE_SHA256[:16]}...); {rebuild}")
    return torch.from_numpy(table)


def check_doc_capacity(num_seqs: int, num_tokens: int, capacity: int, tokens_per_doc_bound: int,
                       what: str, doc_lens: np.ndarray | None = None,
                       max_doc_len: int | None = None) -> None:
    """num_seqs sequences need num_seqs + 1 boundaries in cu_seqlens, which holds `capacity`; fail
    loudly rather than overflow. doc_lens, max_doc_len: the training documents before the stage's
    cap cut them, to name it where the cut made the extra sequences."""
    if num_seqs + 1 > capacity:
        fits = num_tokens // (num_seqs + 1)
        cut = (f"; documents here are cut to the stage's max_doc_len={max_doc_len} tokens, which "
               "makes more of them: a longer max_doc_len in --stages also helps"
               if doc_lens is not None and (doc_lens[:-1] > max_doc_len).any() else "")
        raise DataError(
            f"{what} of {num_tokens} tokens holds {num_seqs} sequences, but cu_seqlens has room "
            f"for {capacity - 1}: --tokens_per_doc_bound={tokens_per_doc_bound} assumes "
            "documents average more tokens than these do. Lower it: "
            f"--tokens_per_doc_bound={fits} fits this batch, {max(1, fits // 2)} leaves headroom"
            + cut)


def check_batch_split(global_batch: int, grad_accum: int, world_size: int) -> None:
    """DataError unless the global batch cuts into world_size * grad_accum equal micro-batches."""
    if global_batch <= 0 or grad_accum <= 0 or global_batch % (grad_accum * world_size) != 0:
        raise DataError(f"the global batch of {global_batch} tokens does not divide into "
                        f"world_size * grad_accum = {world_size} * {grad_accum} micro-batches; "
                        "change the batches in --stages or --batch_slices "
                        "(= processes * accumulation steps), or the number of processes")


# Record 80's cu_seqlens length per micro-batch size (record 78, PR #246): upstream would crash on a
# micro-batch with more segments than this minus 1; ours has room, so we count them.
UPSTREAM_DOC_CAPACITY = {16_384: 64, 32_768: 96, 49_152: 128}


def over_upstream_capacity(tokens_per_rank: int, docs_per_rank: np.ndarray) -> int:
    """How many of a joint batch's micro-batches (documents per rank) upstream could not hold."""
    upstream = UPSTREAM_DOC_CAPACITY.get(tokens_per_rank)
    return 0 if upstream is None else int((docs_per_rank > upstream - 1).sum())


def upstream_capacity_note(over: int) -> str | None:
    """The run's closing note on over_upstream_capacity's count, if any."""
    if not over:
        return None
    rooms = ", ".join(f"{room - 1} at {n}" for n, room in UPSTREAM_DOC_CAPACITY.items())
    return (f"note: {over} training micro-batches held more documents than record 80's cu_seqlens "
            f"has room for ({rooms} tokens per micro-batch): upstream would have stopped there")


# ==================================================================================================
# The options, before anything is built
# ==================================================================================================

def check_options(hp: Any, world_size: int, kernel_ops: Sequence[str], bos_id: int) -> None:
    """Check every option and derived quantity once, right after parsing; each error names the
    option (or GPU count) to change. The run-control options are checked by
    harness.check_run_options; the layout and the optimizer table by the model's and the
    optimizer's own checks (check_model_layout, check_param_table), which the script runs on the
    meta device. kernel_ops: the ops --kernels may name; bos_id: the document-start token."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    for name in ("val_tokens", "val_batch_size", "tokens_per_doc_bound",
                 "batch_slices", "block_size", "ws_long_extension", "ws_long_final_val",
                 "vocab_size", "model_dim", "num_heads", "head_dim", "mlp_hidden", "num_layers",
                 "momentum_warmup_steps", "momentum_cooldown_steps", "rope_base", "attn_scale",
                 "adam_eps"):
        need(getattr(hp, name) > 0, f"--{name}={getattr(hp, name)} must be positive")
    for name in ("num_extension_iterations", "num_value_embeds", "lr_min", "adam_lr", "adam_wd",
                 "muon_lr", "muon_wd", "yarn_alpha"):
        need(getattr(hp, name) >= 0, f"--{name}={getattr(hp, name)} must be >= 0")
    harness.check_run_options(hp, hp.num_iterations, ATTN_BACKENDS)
    need(len(hp.fp8_scales) == 3 and all(v > 0 for v in hp.fp8_scales),
         f"--fp8_scales={harness.show(hp.fp8_scales)} needs 3 positive scales (x, w, grad)")
    need(len(hp.stages) >= 1, "--stages needs at least one stage")
    for i, st in enumerate(hp.stages):
        need(st.batch > 0 and st.ws_long > 0 and st.lr_peak >= 0 and st.max_doc_len > 0,
             f"stage {i + 1} of --stages ({harness.show(st)}) needs a positive batch, window and "
             "max_doc_len, and an lr peak >= 0")
        need(len(st.mtp_start) == len(st.mtp_end) >= 1
             and min(st.mtp_start[0], st.mtp_end[0]) > 0 and min(*st.mtp_start, *st.mtp_end) >= 0,
             f"stage {i + 1} of --stages ({harness.show(st)}) needs as many start as end MTP "
             "weights (a1/a2:b1/b2), all >= 0, with a positive first (next-token) weight")
        need(min(st.prefix_start, st.prefix_end) >= 0,
             f"stage {i + 1} of --stages ({harness.show(st)}) needs prefix weights "
             "(p_start:p_end) >= 0")
    need(world_size >= 1 and (hp.batch_slices % world_size == 0
                              or world_size % hp.batch_slices == 0),
         f"world size {world_size} neither divides --batch_slices={hp.batch_slices} nor is a "
         "multiple of it: run on 1, 2, 4 or 8 GPUs, or a multiple of 8 across nodes (./run.sh picks "
         "the GPU count; set CUDA_VISIBLE_DEVICES or NPROC to choose)")
    for st in hp.stages:
        need(st.batch % hp.batch_slices == 0
             and (st.batch // hp.batch_slices) % 16 == 0,
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
    need(0 < hp.cooldown_frac <= 1
         and int(hp.num_scheduled_iterations * (1 - hp.cooldown_frac)) < hp.num_scheduled_iterations,
         f"--cooldown_frac={hp.cooldown_frac} must be in (0, 1] and leave at least one cooldown "
         f"step of the {hp.num_scheduled_iterations} scheduled")
    need(0 <= hp.momentum_min <= hp.momentum_max < 1,
         f"need 0 <= --momentum_min ({hp.momentum_min}) <= --momentum_max ({hp.momentum_max}) < 1")
    need(0 <= hp.muon_beta2 < 1, f"--muon_beta2={hp.muon_beta2} must be in [0, 1)")
    need(hp.yarn_alpha < hp.yarn_beta,
         f"--yarn_alpha={hp.yarn_alpha} must be below --yarn_beta={hp.yarn_beta}")
    kernel_requests(hp.kernels, kernel_ops)  # raises ConfigError naming the bad op
    need(hp.vocab_size > bos_id and hp.vocab_size % 16 == 0,
         f"--vocab_size={hp.vocab_size} must hold the BOS id {bos_id} and be a multiple of 16 "
         "(FP8 matmul)")


# ==================================================================================================
# The preflight: data, schedule and memory, before anything compiles
# ==================================================================================================

def memory_parts(hp: Any, params: dict[str, Tensor],
                 buffers: dict[str, dict[str, Tensor]]) -> dict[str, int]:
    """A rough upper estimate of peak memory per rank, in bytes, by part: each parameter's weight
    and gradient (in its own dtype) plus its optimizer buffers (Adam's moments, NorMuon's momentum,
    second moment and mantissa: this rank's slice), then the activations saved for backward, the
    logits and the rotary tables. params and buffers: a model and its optimizer built on the meta
    device for this rank, so a new parameter or buffer is counted without an edit here."""
    parts = {label: 2 * p.numel() * p.element_size() for label, p in params.items()}
    for label, bufs in buffers.items():
        parts[label] = parts.get(label, 0) + sum(b.numel() * b.element_size()
                                                 for b in bufs.values())
    elt = torch.empty((), dtype=getattr(torch, hp.dtype), device="meta").element_size()
    D, H, V, L = hp.model_dim, hp.mlp_hidden, hp.vocab_size, hp.num_layers
    n = max(st.batch // hp.batch_slices for st in hp.stages)
    parts["activations"] = n * L * (14 * D + 2 * H) * elt   # saved for backward, per token and layer
    parts["logits"] = n * V * 3 * elt                        # logits, their grad and FP8 copies
    n_val = hp.val_batch_size // hp.batch_slices
    parts["rotary tables"] = 2 * (2 * n_val) * hp.head_dim * 3 * elt   # cos/sin, normal and paired
    return parts


# The options check_memory tries to lower, one at a time, to name the one that makes a run fit
MEMORY_SIZE_OPTIONS = ("bigram_vocab_size", "vocab_size", "num_value_embeds", "mlp_hidden",
                       "num_layers", "model_dim", "val_batch_size")


def host_memory_available(meminfo: str | None = None) -> int | None:
    """MemAvailable of /proc/meminfo in bytes (what a CPU run can still allocate without swapping),
    or None where there is none (not Linux)."""
    if meminfo is None:
        try:
            meminfo = open("/proc/meminfo").read()
        except OSError:
            return None
    for line in meminfo.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable" and value.split():
            return int(value.split()[0]) * 1024
    return None


def largest_fitting(hp: Any, option: str, estimate: Callable[[Any], int],
                    capacity: int) -> int | None:
    """The largest value below hp's of the int `option` at which estimate(hp) fits in capacity
    bytes, the others kept; None if its smallest value does not fit (or none is valid: estimate
    raises ConfigError for options it refuses). Values are multiples of the largest power of two
    (at most 1024) dividing hp's, so a rule such as a multiple of 16 for --vocab_size holds. The
    estimate grows with each of MEMORY_SIZE_OPTIONS, nearly linearly, so interpolation finds it in a
    few builds."""
    unit = min(getattr(hp, option) & -getattr(hp, option), 1024)

    def size(k: int) -> int | None:
        try:
            return estimate(dataclasses.replace(hp, **{option: k * unit}))
        except (ValueError, RuntimeError):   # a value the options' checks refuse
            return None

    hi = getattr(hp, option) // unit
    f_hi = size(hi)
    # the smallest valid power of two (some options have a floor, e.g. the bigram sentinel row)
    lo, f_lo = next(((k, f) for k in (2**j for j in range(hi.bit_length()))
                     if k < hi and (f := size(k)) is not None), (hi, None))
    if f_lo is None or f_lo > capacity or f_hi is None:
        return None
    for turn in itertools.count():   # size(lo) fits, size(hi) does not
        if hi - lo <= 1:
            return lo * unit
        # interpolate, then halve, in turns: exact in one build where the size is linear in the
        # option, never slower than halving where it is not
        mid = (lo + int((capacity - f_lo) * (hi - lo) / max(1, f_hi - f_lo)) if turn % 2 == 0
               else (lo + hi) // 2)
        mid = min(max(mid, lo + 1), hi - 1)
        f_mid = size(mid)
        if f_mid is not None and f_mid <= capacity:
            lo, f_lo = mid, f_mid
        else:
            hi, f_hi = mid, (f_hi if f_mid is None else f_mid)
    return None


def check_memory(hp: Any, estimate: Callable[[Any], dict[str, int]], capacity: int,
                 where: str) -> str:
    """Refuse (ConfigError) a run whose estimated peak memory per rank (estimate(hp): bytes by
    part, memory_parts) exceeds capacity bytes (where: "per GPU of ..." / "per process of ..."),
    naming each option of MEMORY_SIZE_OPTIONS that alone makes it fit and the largest value that
    does, else the largest parts; returns the note for the log."""
    parts = estimate(hp)
    total = sum(parts.values())
    gib = 2**30
    if total <= capacity:
        return f"memory estimate: about {total / gib:.1f} GiB {where}"
    total_of = lambda h: sum(estimate(h).values())
    fixes = []
    for option in MEMORY_SIZE_OPTIONS:
        if isinstance(getattr(hp, option, None), int) and getattr(hp, option) > 1:
            fit = largest_fitting(hp, option, total_of, capacity)
            if fit is not None:
                fixes.append((fit / getattr(hp, option), option, fit))
    largest = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
    shown = ", ".join(f"{label} {size / gib:.1f} GiB" for label, size in largest)
    if fixes:
        fix = " or ".join(f"--{option}={getattr(hp, option)} to at most {fit}"
                          for _, option, fit in sorted(fixes, reverse=True))
        fix = f"lower {fix}"
    else:
        fix = "lower the batches in --stages and --val_batch_size, or the model's sizes"
    raise ConfigError(f"this configuration needs about {total / gib:.1f} GiB {where} (an "
                      f"estimate; largest: {shown}): {fix}")


# Measured on FineWeb: the loader reads about 1.35x the trained tokens (documents cut at the maximum
# length, rank-boundary remainders, +1 look-ahead per rank, abandoned shard tails); 1.45 leaves a
# margin.
TRAIN_READ_FACTOR = 1.45


PREFLIGHT_SAMPLE_TOKENS = 1 << 20   # tokens of each training shard checked


def preflight(hp: Any, world_size: int, device: torch.device, *, trained_tokens: int,
              bos_id: int, doc_rooms: dict[tuple[int, int], int],
              memory: Callable[[Any], dict[str, int]],
              mlp_k_step: int | None) -> tuple[list[str], list[str], list[str]]:
    """Check data, schedule and memory before anything compiles. Raises DataError / ConfigError;
    returns the training and validation shards and notes for the log.

    Every shard's header and size; a sample of every training shard (token ids fit the vocabulary, a
    document start exists; the loader checks all ids of each shard as it loads it); the documents'
    density against cu_seqlens (doc_rooms: (micro-batch tokens, document cap) -> documents it
    holds); the estimated peak memory per rank (memory(hp): bytes by part, memory_parts) against the
    GPU, or for a CPU run the host's available memory shared by this host's processes, before
    anything is allocated (check_memory). trained_tokens: what the schedule trains on;
    mlp_k_step: the fused MLP kernel's step through the model dim, None when it does not run.
    The script then walks every validation token this rank will read, so a bad val shard fails now
    and not after the whole run has trained."""
    check_fused_kernel_shapes(hp, device, mlp_k_step)
    notes = []
    train_files = harness.resolve_shards(hp.train_files, "train")
    val_files = harness.resolve_shards(hp.val_files, "val")
    check_disjoint_shards(train_files, val_files, hp.train_files, hp.val_files)
    train_avail = sum(shard_num_tokens(f) for f in train_files)   # validates every header and size
    for path in train_files:
        sample = read_tokens(path, PREFLIGHT_SAMPLE_TOKENS)[0]
        check_token_ids(sample, hp.vocab_size, path)
        check_document_start(sample, path, bos_id)
    val_sizes = [shard_num_tokens(f) for f in val_files]
    needed = trained_tokens
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
    check_document_density(train_files[0], bos_id, doc_rooms)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        notes.append(check_memory(hp, memory, int(0.95 * total),
                                  f"per GPU of {total / 2**30:.0f} GiB"))
    elif (free := host_memory_available()) is not None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        notes.append(check_memory(hp, memory, free // max(1, local),
                                  f"per process of the {free / 2**30:.1f} GiB this host has "
                                  f"free for {local} process(es)"))
    notes.append(f"data: {len(train_files)} train shards ({train_avail:,} tokens) for {needed:,} "
                 f"trained tokens; {len(val_files)} val shard(s), {hp.val_tokens:,} tokens per "
                 "validation")
    return train_files, val_files, notes


def shard_digest(path: str, part: int = 1 << 20) -> tuple[int, str] | None:
    """A cheap content key: the size and the sha256 of the file if it is at most 2 MiB, else of its
    first and last MiB (two shards that agree there and in size are the same shard for our
    purpose). None if it cannot be read (the shard checks that follow name the file and the fix)."""
    h = hashlib.sha256()
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            h.update(f.read(part if size > 2 * part else size))
            if size > 2 * part:
                f.seek(size - part)
                h.update(f.read(part))
    except OSError:
        return None
    return size, h.hexdigest()


def check_disjoint_shards(train_files: Sequence[str], val_files: Sequence[str], train_glob: str,
                          val_glob: str) -> None:
    """Raise DataError if a validation shard is also a training shard: the same file (a glob that
    matches both) or a copy of it (same size and digest; only shards of equal size are read)."""
    val_by_path = {os.path.realpath(v): v for v in val_files}
    for t in train_files:
        if os.path.realpath(t) in val_by_path:
            raise DataError(f"--train_files={train_glob} and --val_files={val_glob} both match "
                            f"{t} (as {val_by_path[os.path.realpath(t)]}): the run would validate on "
                            "tokens it trained on; make the patterns match separate shards")
    val_sizes = {os.path.getsize(v) for v in val_files}
    same_size = [t for t in train_files if os.path.getsize(t) in val_sizes]
    if not same_size:
        return
    val_by_digest = {d: v for v in val_files if (d := shard_digest(v)) is not None}
    for t in same_size:
        if (d := shard_digest(t)) is not None and (v := val_by_digest.get(d)) is not None:
            raise DataError(f"training shard {t} and validation shard {v} hold the same tokens (same "
                            "size and sha256): the run would validate on tokens it trained on; "
                            "train and validate on different shards (--train_files, --val_files)")


def check_document_density(path: str, bos_id: int, doc_rooms: dict[tuple[int, int], int],
                           sample_tokens: int = 4_000_000) -> None:
    """Fail before compiling if documents are so short that a micro-batch's cu_seqlens would
    overflow. doc_rooms: (micro-batch tokens, the stage's max_doc_len) -> documents it can hold.

    Samples the first shard: a micro-batch of N tokens holds about
    N / mean(min(doc_len, max_doc_len)) segments.
    """
    tokens = np.memmap(path, dtype=np.uint16, mode="r", offset=SHARD_HEADER_BYTES)[:sample_tokens]
    starts = np.flatnonzero(tokens == bos_id)
    if len(starts) < 2:
        return
    doc_lens = np.diff(starts)
    uncut = float(doc_lens.mean())
    for (n, max_doc_len), room in sorted(doc_rooms.items()):
        mean_len = float(np.minimum(doc_lens, max_doc_len).mean())
        expected = 1.25 * n / mean_len + 2                # 25% margin for batches of
                                                          # shorter-than-average documents
        if expected > room:
            bound = max(1, int(mean_len / 1.25) - 1)
            if 1.25 * n / uncut + 2 <= room:              # the cut, not the documents, is short
                raise ConfigError(
                    f"max_doc_len={max_doc_len} in --stages cuts the documents in {path} "
                    f"(averaging {uncut:.0f} tokens) to an average of {mean_len:.0f}: a {n}-token "
                    f"micro-batch holds about {expected:.0f} pieces but cu_seqlens has room for "
                    f"{room}. Rerun with a longer max_doc_len in --stages, or "
                    f"--tokens_per_doc_bound={bound} (default 300)")
            raise ConfigError(f"documents in {path} average {mean_len:.0f} tokens, much shorter "
                              f"than FineWeb's: a {n}-token micro-batch holds about {expected:.0f} "
                              f"documents but cu_seqlens has room for {room}. Rerun with "
                              f"--tokens_per_doc_bound={bound} (default 300)")


def check_fused_kernel_shapes(hp: Any, device: torch.device, mlp_k_step: int | None) -> None:
    """Raise ConfigError, before compiling, for what the GPU kernels cannot take: a dtype other than
    bf16, or a model dim the fused MLP kernel (when it runs: mlp_k_step, its step through the model
    dim) cannot step through. Off CUDA the references run."""
    if device.type != "cuda":
        return
    if hp.dtype != "bfloat16":
        raise ConfigError(f"--dtype={hp.dtype} runs on a CPU only (the GPU kernels are bf16): add "
                          "--device=cpu, or drop --dtype")
    if mlp_k_step is not None and hp.model_dim % mlp_k_step:
        k_step = mlp_k_step
        raise ConfigError(f"the fused MLP kernel reads the model dim in steps of {k_step}: use a "
                          f"--model_dim that is a multiple of {k_step} (not {hp.model_dim}), or "
                          "--kernels=mlp:torch")
