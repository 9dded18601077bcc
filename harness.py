"""The run machinery of train_gpt.py: everything around the training that never changes a number.

train_gpt.py is the math and the timed loop, which owns its clock; this file offers services that take
and return plain values: the run-control options and the command line, the log, the portable compile
cache and the compile table, checkpoints and resume, signals and exit codes. It never imports
train_gpt, never calls back into it and never holds its trainer, model or optimizer.

Sections, in the order a run meets them:
    1. options: run control, the command line   2. how a run ends: errors and exit codes
    3. data files: the shard globs   4. the log and output files   5. the compile cache
    6. the compile table   7. checkpoints and resume   8. processes: ranks, GPUs, signals
    9. the run: opening it, the services of the timed loop, the dry run, the command line
Nothing happens at import.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import glob
import logging
import math
import os
import re
import socket
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

# ==================================================================================================
# 1. Options: run control and the command line
# ==================================================================================================


@dataclass
class RunOptions:
    """Options that never change what a run computes: where data and logs go, how often to validate,
    log, check and save, and how compiling is organised. train_gpt.Hyperparameters extends this
    class with the fields that do change the math; that split is the one definition of "math":
    resume compares the math fields (and what the run-control ones resolve to, run_facts), the
    compile cache's key holds them, and --help groups by it."""
    # ---- data files ----
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"  # glob of training shards,
                                                              # read once in sorted order
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"      # glob of validation shards
    # ---- logging, validation and checks ----
    val_loss_every: int = 250              # validate every this many steps (0: only at the end)
    val_loss_target: float = 3.28          # the final summary line says
                                           # whether the run reached this loss
    train_loss_every: int = 0              # end every this-many-th step line with the step's train
                                           # loss (its weighted multi-token loss per token, averaged
                                           # over ranks): one sync each; 0: never
    nonfinite_check_every: int = 25        # check the loss for NaN/inf every this many steps
                                           # (no per-step sync); 0: off
    run_id: str = ""                       # log name under logs/; empty: a random UUID
    log_dir: str = "logs"                  # folder of the log (<run_id>.txt)
                                           # and checkpoints (<run_id>/)
    profile_steps: str = ""                # "a:b[,c:d...]": profile steps a..b-1 (...) with
                                           # torch.profiler into the log dir, one trace per range
                                           # (bench/profile_step.py reads them)
    debug: bool = False                    # on an error, print the Python
                                           # traceback too (the log always has it)
    dry_run: bool = False                  # run every check that comes before compiling
                                           # (options, environment, data, memory, output
                                           # folders), print them as a checklist, and exit
    # ---- checkpoints ----
    save_checkpoint: bool = False          # write logs/<run_id>/state_step<step>.pt
                                           # at the end (or when stopped)
    checkpoint_every: int = 0              # also every this many steps (0: never),
                                           # keeping the newest checkpoint_keep;
    checkpoint_keep: int = 2               # any of these states (and a stopped run's) continues
                                           # with --resume
    resume: str = ""                       # a state_step<step>.pt file, or a run's folder
                                           # (its newest state): continue that run bit for bit; the
                                           # options not given are its own (a math one given must
                                           # match, a run-control one may differ; same processes)
    # ---- processes, devices and compiling ----
    device: str = "auto"                   # auto | cuda | cpu
    attn_backend: str = "auto"             # auto | triton | fa4 | fa3 | varlen | sdpa (auto: the
                                           # fastest installed; the log names the one that ran)
    seed: int = -1                         # -1: unseeded init, like the record;
                                           # else torch.manual_seed(seed)
    pg_timeout_s: int = 600                # a rank stuck this long in a collective ends the run
    loop_timeout_s: int = 120              # the same from the timed loop on, where the ranks
                                           # run in lockstep (the long one covers the compiles)
    warmup: bool = True                    # compile every schedule variant before the clock starts
    compile_cache: str = "~/.cache/nanogpt_speedrun/compile_cache.bin"  # the compiled code,
                                           # saved after a warmup that compiled and loaded at start
                                           # when made by the same code, torch, triton and GPU
                                           # model: copy it to a new node to skip most compiling
                                           # (README); empty: off
    compile_split: bool = True             # each GPU's processes first compile their share of
                                           # the variants alone; the warmup then loads the rest
                                           # from torch's on-disk caches, shared on a node
    compile_helpers: int = -1              # helper processes per GPU that compile a share of
                                           # the split beside its rank (-1: auto, 3 on one
                                           # GPU, 1 on two, none on more or when the compile
                                           # cache file was loaded; 0: none)


def math_fields(hp: Any) -> list[str]:
    """The names of the fields of `hp` that change the math: every field not in RunOptions."""
    run = {f.name for f in dataclasses.fields(RunOptions)}
    return [f.name for f in dataclasses.fields(hp) if f.name not in run]


def show(value: Any) -> str:
    """A value as it is typed on the command line; a table row (a dataclass) as its fields joined
    by ':' with tuple fields joined by '/'."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return ":".join("/".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
                        for v in dataclasses.astuple(value))
    if isinstance(value, tuple):
        return ",".join(show(v) for v in value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def _parse_row(cls: type, text: str) -> Any:
    """One table row (e.g. a train_gpt.Stage) from 'a:b:c/d': one ':' field per dataclass field,
    '/' inside a tuple field (of floats); the annotations name each field's type. Trailing fields
    with a default may be left out (a row written before they existed keeps its meaning). A
    ValueError names the field that does not parse."""
    fields = dataclasses.fields(cls)
    required = sum(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   for f in fields)
    names = [f.name for f in fields]
    values = text.split(":")
    if not required <= len(values) <= len(names):
        count = str(len(names)) if required == len(names) else f"{required} to {len(names)}"
        raise ValueError(f"it has {len(values)} ':' fields, not {count}")
    kinds = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    parse = {"int": int, "float": lambda x: _finite(float(x))}
    row = {}
    for n, v in zip(names, values):
        try:
            row[n] = (tuple(_finite(float(x)) for x in v.split("/")) if kinds[n].startswith("tuple")
                      else parse.get(kinds[n], str)(v))
        except ValueError:
            kind = "finite floats joined by /" if kinds[n].startswith("tuple") else (
                "a finite float" if kinds[n] == "float" else f"an {kinds[n]}")
            raise ValueError(f"its {n} {v!r} is not {kind}") from None
    return cls(**row)


def _row_format(cls: type) -> str:
    fields = dataclasses.fields(cls)
    given = [f.name for f in fields if f.default is dataclasses.MISSING
             and f.default_factory is dataclasses.MISSING]
    optional = "".join(f"[:{f.name}]" for f in fields[len(given):])
    return (f"{':'.join(given)}{optional} per {cls.__name__.lower()} "
            "(tuples as a/b/...; a field in [] may be left out), comma-separated")


def _finite(x: float) -> float:
    if not math.isfinite(x):
        raise ValueError(x)
    return x


def _parse_value(text: str, like: Any, name: str) -> Any:
    """Parse a command-line value into the type of the field's default."""
    row = type(like[0]) if isinstance(like, tuple) and like else None
    if row is not None and dataclasses.is_dataclass(row):
        rows = []
        for k, r in enumerate(text.split(","), 1):
            try:
                rows.append(_parse_row(row, r))
            except ValueError as e:
                raise ConfigError(f"--{name}={text!r} is not {_row_format(row)}: "
                                  f"{row.__name__.lower()} {k} ({r!r}): {e} (default: "
                                  f"{show(like)})") from None
        return tuple(rows)
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
            return _finite(float(text))
        if isinstance(like, tuple):
            items = [t for t in text.split(",") if t.strip()]
            return tuple(_finite(row(t)) if row is float else row(t) for t in items)
        if isinstance(like, str):
            return text
    except ValueError:
        kind = ("true or false" if isinstance(like, bool)
                else f"comma-separated finite {row.__name__}s" if row is not None
                else "a finite float" if isinstance(like, float)
                else f"a{'n' if type(like).__name__[0] in 'aeiou' else ''} {type(like).__name__}")
        raise ConfigError(f"--{name}={text!r} is not {kind} (default: {show(like)})") from None
    raise ConfigError(f"--{name} cannot be set from the command line; "
                      "edit Hyperparameters in train_gpt.py")


def did_you_mean(name: str, names: Sequence[str]) -> list[str]:
    """Near misses (difflib) and names that contain `name` as a word or a substring: --lr finds
    --muon_lr, --adam_lr."""
    import difflib
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    related = [n for n in names if name in n.split("_") or (len(name) >= 3 and name in n)]
    related.sort(key=lambda n: n.split("_")[-1] != name)   # --lr: the learning rates before
                                                           # --lr_min
    return list(dict.fromkeys(close + related))[:6]


def _field_help(cls: type, defaults: Any) -> list[str]:
    """--help lines for the fields `cls` declares itself, read from its source (so the help cannot
    drift from the code): `# ---- group ----` lines start a group, comment-only lines continue the
    comment of the field above."""
    import inspect
    lines = []
    own = set(getattr(cls, "__annotations__", {}))
    for src in inspect.getsource(cls).splitlines()[1:]:
        text, indent = src.strip(), len(src) - len(src.lstrip())
        if text.startswith("# ----") and text.endswith("----"):
            if "derived" in text:
                break
            lines += ["", text.strip("# -") + ":"]
        elif text.startswith("#"):       # aligned with the trailing comments:
                                         # continues the field above
            lines.append(("      " if indent > 4 else "  ") + text.lstrip("# "))
        elif ":" in text and text.split(":")[0] in own:
            name = text.split(":")[0]
            value = getattr(defaults, name)
            comment = text.split("#", 1)[1].strip() if "#" in text else ""
            shown = ("a table: edit DEFAULT_PARAM_TABLE" if isinstance(value, dict)
                     else f"default {show(value)}")
            lines.append(f"  --{name}  [{type(value).__name__}, {shown}]  {comment}".rstrip())
    return lines


def help_text(defaults: RunOptions, presets: dict[str, dict], script: str = "train_gpt.py") -> str:
    """Usage, presets, exit codes, then every field: first those that change the math (the fields
    the script's options class declares itself), then the run-control ones (RunOptions). script:
    the file name the trainer runs under (a copy names itself)."""
    on_gpus = "./run.sh" if script == "train_gpt.py" else f"TRAIN={script} ./run.sh"
    lines = [f"usage: python3 {script} [--name=value ...]        "
             f"(on GPUs: {on_gpus} [--name=value ...])",
             "",
             f"Trains the speedrun model. Every option is a field of Hyperparameters in {script} "
             "(the math) or of",
             "RunOptions in harness.py (run control), set as --name=value; booleans take "
             "true/false (a bare --name",
             "means true), tuples take comma-separated values. --preset=NAME applies a preset "
             "first, whatever its",
             "position; the other options then override it.",
             "presets (--preset=NAME sets these fields):"]
    for name, preset in presets.items():
        sets = " ".join(f"--{k}={show(v)}" for k, v in preset.items() if not isinstance(v, dict))
        lines += textwrap.wrap(sets, 116, initial_indent=f"  {name}: ", subsequent_indent="    ")
    lines += ["",
              "exit codes: 0 done, 1 data, 2 options or environment, 3 loss not finite, "
              "4 another rank failed, 5 a bug (the log has the traceback), 6 this rank's GPU, "
              "driver or NCCL failed,",
              "129 SIGHUP, 130 Ctrl-C, 143 SIGTERM (docs/failures.md: When something is wrong).",
              "", f"==== the math (Hyperparameters, {script}; resume must keep these) ===="]
    lines += _field_help(type(defaults), defaults)
    lines += ["", "==== run control (RunOptions, harness.py; never change a number) ===="]
    return "\n".join(lines + _field_help(RunOptions, defaults))


def parse_args(argv: Sequence[str], defaults: RunOptions, presets: dict[str, dict]) -> Any:
    """`defaults` (an options instance) with `--name=value` for any of its fields; `--preset=NAME`
    first applies a preset, then the rest. A bare `--name` sets a boolean field to true. Raises
    ConfigError naming the option."""
    fields = {f.name: f for f in dataclasses.fields(defaults)}
    defaults = copy.deepcopy(defaults)
    pairs = []
    for arg in argv:
        if not arg.startswith("--"):
            raise ConfigError(f"expected --name=value, got {arg!r}; "
                              "python3 train_gpt.py --help lists the options")
        name, eq, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        if name not in fields:
            close = did_you_mean(name, list(fields))
            raise ConfigError(f"unknown option --{name}"
                              + (f"; did you mean {', '.join('--' + c for c in close)}?"
                                 if close else "; python3 train_gpt.py --help lists them"))
        if not eq:
            if not isinstance(getattr(defaults, name), bool):
                raise ConfigError(f"--{name} needs a value: write --{name}=VALUE "
                                  f"(no space; default {show(getattr(defaults, name))})")
            value = "true"
        pairs.append((name, value))
    hp = defaults
    for name, value in pairs:
        if name == "preset":
            if value not in presets and value != "":
                raise ConfigError(f"unknown --preset={value}; known presets: {', '.join(presets)}")
            hp = dataclasses.replace(hp, preset=value, **copy.deepcopy(presets.get(value, {})))
    for name, value in pairs:
        if name != "preset":       # parsed as the class default's type: an earlier value may be ()
            setattr(hp, name, _parse_value(value, getattr(defaults, name), name))
    return hp


# The options a command sets for itself, never taken from the state it resumes: which state, whether
# to dry run, the new run's id (the resume's default <id>-from<step> is free; the state's own is
# taken by its log) and --debug.
PER_COMMAND = ("resume", "dry_run", "run_id", "debug")


def given_options(argv: Sequence[str], presets: dict[str, dict]) -> set[str]:
    """The names of the options the command line `argv` (which parse_args took) sets: each --name,
    and with --preset=NAME the math fields that preset sets (typing a preset asks for its math; its
    run-control values are a new run's defaults, which a resume takes from its state instead)."""
    run = {f.name for f in dataclasses.fields(RunOptions)}
    given = set()
    for arg in argv:
        name, _, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        given.add(name)
        if name == "preset":
            given.update(set(presets.get(value, {})) - run)
    return given


def as_argument(name: str, value: Any) -> str:
    """--name=value as a shell takes it (quoted where needed); a true boolean as a bare --name."""
    import shlex
    return shlex.quote(f"--{name}" if value is True else f"--{name}={show(value)}")


def from_dict(defaults: RunOptions, saved: dict) -> Any:
    """`defaults` with the options a checkpoint stored with dataclasses.asdict (table rows as
    dicts); names that are not options (any more) are dropped."""
    values = {}
    for f in dataclasses.fields(defaults):
        if f.name in saved:
            like, value = getattr(defaults, f.name), saved[f.name]
            if isinstance(like, tuple) and like and dataclasses.is_dataclass(like[0]):
                value = tuple(type(like[0])(**row) for row in value)
            values[f.name] = value
    return dataclasses.replace(defaults, **values)


def expand_path(path: str) -> str:
    """A path option as the user meant it: `~` expanded ('' stays '')."""
    return os.path.expanduser(path) if path else path


def check_run_options(opts: RunOptions, num_iterations: int, attn_backends: Sequence[str]) -> None:
    """The run-control half of the option checks (train_gpt checks the math half)."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    for name in ("pg_timeout_s", "loop_timeout_s"):
        need(0 < getattr(opts, name) <= 10**9, f"--{name}={getattr(opts, name)} must be 1 .. 10**9")
    for name in ("val_loss_every", "nonfinite_check_every", "checkpoint_every",
                 "train_loss_every"):
        need(getattr(opts, name) >= 0, f"--{name}={getattr(opts, name)} must be >= 0")
    need(opts.compile_helpers >= -1, f"--compile_helpers={opts.compile_helpers} must be -1 "
         "(auto), 0 (none) or a count")
    need(opts.checkpoint_keep >= 1,
         f"--checkpoint_keep={opts.checkpoint_keep} must be >= 1 (2 survives a crash while "
         "writing)")
    need(-1 <= opts.seed < 2**63, f"--seed={opts.seed}: use -1 (unseeded) or a seed 0 .. 2**63 - 1")
    need(opts.attn_backend in ("auto", *attn_backends),
         f"--attn_backend={opts.attn_backend} is not one of auto, {', '.join(attn_backends)}")
    need(opts.device in ("auto", "cuda", "cpu"),
         f"--device={opts.device} is not one of auto, cuda, cpu")
    need(opts.run_id == "" or (re.fullmatch(r"[A-Za-z0-9._-]{1,200}", opts.run_id) is not None
                               and opts.run_id not in (".", "..")),
         f"--run_id={opts.run_id!r} names the log file logs/<run_id>.txt: use letters, digits, "
         "'-', '_' or '.' only, at most 200 of them")
    if opts.profile_steps:
        ranges = [r.partition(":") for r in opts.profile_steps.split(",")]
        need(all(a.isdigit() and b.isdigit() and int(a) < int(b) <= num_iterations
                 for a, _, b in ranges)
             and all(int(ranges[i][2]) <= int(ranges[i + 1][0]) for i in range(len(ranges) - 1)),
             f"--profile_steps={opts.profile_steps!r} must be 'a:b' ranges "
             f"(a < b <= {num_iterations}, the step count), comma-separated in increasing order")


# ==================================================================================================
# 2. How a run ends: errors and exit codes
# ==================================================================================================
# Exit codes (docs/failures.md): 1 data, 2 options / environment / output folders, 3 the
# loss stopped being finite, 4 another rank failed first (or stopped answering), 5 an internal
# error (a bug: the log has the traceback), 6 this rank's GPU, its driver or NCCL failed (a CUDA,
# ECC or NCCL-internal error: the node at fault), 128 + N a signal (130 Ctrl-C, 143 SIGTERM,
# 129 SIGHUP).
EXIT_DATA, EXIT_CONFIG, EXIT_DIVERGED, EXIT_PEER, EXIT_BUG, EXIT_DEVICE = 1, 2, 3, 4, 5, 6


class ConfigError(ValueError):
    """A bad option or an environment that cannot run it; the message names what to change."""


class DataError(RuntimeError):
    """Missing or bad data, or options that do not fit the data; the message says what to run or
    change."""


class TrainingDiverged(FloatingPointError):
    """The loss (train or validation) stopped being finite."""


class Interrupted(Exception):
    """A signal (Ctrl-C, SIGTERM, SIGHUP) ended the run; exit_code is 128 + the signal number."""

    def __init__(self, signum: int, message: str, agreed: bool = False):
        super().__init__(message)
        self.signum = signum
        self.agreed = agreed     # every rank stops here: the timed loop's vote (stopped())


def signal_cause(e: BaseException) -> BaseException | None:
    """The signal (Interrupted, KeyboardInterrupt) that ended the run, also where a compile wrapped
    it (InductorError); None for any other failure."""
    cause: BaseException | None = e
    while cause is not None and not isinstance(cause, (Interrupted, KeyboardInterrupt)):
        cause = cause.__cause__ or cause.__context__
    return cause


# Whose failure an error is, by the words torch, gloo, NCCL and CUDA use (the table of real
# messages is in tests/test_node_failures.py). A CUDA text is this rank's own even where NCCL wraps
# it, so it is looked for first; then what a peer that ended or hangs causes; NCCL's system and
# internal errors, left after that, are this rank's own too.
_DEVICE_WORDS = ("cuda error", "cuda failure", "cuda driver error", "ecc error",
                 "illegal memory access", "illegal instruction", "unspecified launch failure",
                 "unhandled cuda error", "ncclunhandledcudaerror", "device-side assert",
                 "nvlink error")
_TIMEOUT_WORDS = ("timed out", "timeout")
_PEER_WORDS = ("remote process exited", "ncclremoteerror", "by peer", "by remote peer",
               "connection reset", "connection refused", "broken pipe", "connection was likely "
               "closed", "remote worker", "pair closure", "communicator was aborted",
               "got 0 bytes", "watchdog")
_NCCL_OWN_WORDS = ("unhandled system error", "ncclsystemerror", "ncclinternalerror",
                   "internal check failed", "please report this issue to the nccl developers")
_PEER_TYPES = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")


def failure_kind(type_name: str, text: str) -> str | None:
    """Whose failure an exception of class `type_name` with message `text` is: "device" (this
    rank's GPU, driver or NCCL), "timeout" (a peer stopped answering), "peer" (a peer ended, or the
    link to it broke), or None (nothing distributed: judge it otherwise)."""
    low = text.lower()
    if type_name == "AcceleratorError" or any(w in low for w in _DEVICE_WORDS):
        return "device"
    if any(w in low for w in _TIMEOUT_WORDS):
        return "timeout"
    if any(w in low for w in _PEER_WORDS):
        return "peer"
    if any(w in low for w in _NCCL_OWN_WORDS):
        return "device"
    return "peer" if type_name in _PEER_TYPES else None


def kind_of(e: BaseException) -> str | None:
    """failure_kind of the exception or, where it says nothing, of what it wraps."""
    seen: BaseException | None = e
    while seen is not None:
        if (kind := failure_kind(type(seen).__name__, str(seen))) is not None:
            return kind
        seen = seen.__cause__ or seen.__context__
    return None


def _first_line(e: BaseException) -> str:
    """The message's first line, without the C++ source location gloo and c10d put in front."""
    line = (str(e).strip().splitlines() or [""])[0]
    line = re.sub(r"\. This is typically caused by .*", ".", line)     # gloo's advice to read the peer
    return re.sub(r"^\[[^\]]*:\d+\] ", "", line)[:300]


def describe_failure(e: BaseException, rank: int, world_size: int) -> tuple[int, str]:
    """(exit code, the one-line message) for an exception that ended the run."""
    if (cause := signal_cause(e)) is not None:
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
    if (write := write_failure(e)) is not None:
        where = next((x.filename for x in (e, e.__cause__, e.__context__)
                      if isinstance(x, OSError) and x.filename), None)
        return EXIT_CONFIG, f"cannot write{f' {where}' if where else ''}: {write}"
    kind, first_line = kind_of(e), _first_line(e)
    if kind == "device":
        return EXIT_DEVICE, (f"the GPU, driver or NCCL of this rank failed on "
                             f"{socket.gethostname()} ({type(e).__name__}: {first_line}): a "
                             "hardware or driver fault (see `nvidia-smi -q -d ECC` and the Xid "
                             "lines of `dmesg` there) or a kernel's bad access: rerun without that "
                             "GPU or node; where it follows the code to other GPUs, report it "
                             "with the log")
    if world_size > 1 and kind is not None:
        return EXIT_PEER, (f"another rank failed or stopped answering, so this one stopped "
                           f"({type(e).__name__}: {first_line})")
    return EXIT_BUG, (f"internal error, a bug: {type(e).__name__}: {first_line} (the traceback "
                      "is in the log; --debug=true prints it here too). Please report it")


# errno of a write the user's disk or folder refused, and the fix
_WRITE_FIXES = {"ENOSPC": "the disk is full: free space", "EDQUOT": "the disk quota is used up: "
                "free space", "EROFS": "the file system is read-only", "EFBIG": "the file is over "
                "the size limit (ulimit -f)", "EACCES": "permission denied", "EPERM":
                "permission denied"}
_WRITE_PHRASES = {"no space left": "ENOSPC", "file too large": "EFBIG",
                  "read-only file system": "EROFS", "quota exceeded": "EDQUOT"}


def write_failure(e: BaseException) -> str | None:
    """What the file system refused and the fix, for a write that failed on a full disk, a
    read-only folder, a size limit or a permission (also where torch.save wraps the OSError in a
    RuntimeError, or only its message survives); None for any other error."""
    import errno
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and errno.errorcode.get(seen.errno) in _WRITE_FIXES:
            name = errno.errorcode[seen.errno]
            break
        seen = seen.__cause__ or seen.__context__
    else:
        text = str(e).lower()
        name = next((n for phrase, n in _WRITE_PHRASES.items() if phrase in text), None)
        if name is None:
            return None
    return f"{_WRITE_FIXES[name]}, or choose another --log_dir"


# ==================================================================================================
# 3. Data files: the shard globs
# ==================================================================================================
DATA_HINT = ("download FineWeb shards with `python data/cached_fineweb10B.py 9` (any N also "
                  "fetches the val shard), or for a smoke test make synthetic ones with "
                  "`python data/synthetic.py --out DIR` and pass "
                  "--train_files='DIR/fineweb_train_*.bin' --val_files='DIR/fineweb_val_*.bin'")


def resolve_shards(pattern: str, kind: str) -> list[str]:
    """The shard files matching `pattern`, sorted; kind is "train" or "val" (for the error
    message)."""
    files = sorted(glob.glob(expand_path(pattern)))
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
    raise DataError(f"no {kind} shards: {problem} ({option}={pattern}); {DATA_HINT}")


# ==================================================================================================
# 4. The log and output files
# ==================================================================================================

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
                  tokens_total: int, untimed_left_s: float = 0.0) -> str:
    """The console's end of a step line: percent of the schedule, training tokens per second and the
    time left at that rate, plus untimed_left_s (the validations still to come, at the pace of
    those so far). Counted in tokens, not steps, because later steps carry larger batches."""
    rate = tokens_done / max(train_ms / 1000, 1e-9)
    left = round((tokens_total - tokens_done) / rate + untimed_left_s) if rate > 0 else 0
    return f"  {100 * done / total:.0f}% {rate:,.0f} tok/s ETA {duration(left)}"


def duration(seconds: float) -> str:
    """1m35s, or 1h06m from an hour on."""
    s = round(seconds)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """A console line now and then through a long untimed phase (a validation, the warmup), so a
    slow machine shows it is working: at most one every every_s seconds, rank 0 only, the log file
    untouched (its lines stay the fixed format)."""

    def __init__(self, rank: int, what: str, total: int, every_s: float = 10.0):
        self.rank, self.what, self.total, self.every_s = rank, what, total, every_s
        self.t0 = self.last = time.perf_counter()

    def tick(self, done: int) -> None:
        now = time.perf_counter()
        if self.rank != 0 or now - self.last < self.every_s or done >= self.total:
            return
        self.last = now
        left = (now - self.t0) / done * (self.total - done)
        to_console(f"  {self.what}: {done}/{self.total} after {duration(now - self.t0)}, "
                   f"about {duration(left)} left")


def result_line(val_loss: float, target: float, train_ms: float, steps: int, peak_mib: int | None,
                log_path: Path | None) -> str:
    """The run's last line: what a speedrunner reads first. The time is the last step line's whole
    milliseconds, so that the two lines never round one time two ways."""
    memory = f"{peak_mib}MiB" if peak_mib is not None else "n/a"
    return (f"result: val_loss:{val_loss:.4f} target:{target} "
            f"reached:{'yes' if val_loss <= target else 'no'} "
            f"train_time:{round(train_ms) / 1000:.1f}s steps:{steps} peak_memory:{memory} log:{log_path}")


def to_console(msg: str, stream: Any = None) -> None:
    """Print msg to the console (stdout, or `stream`). A console that went away (the pipe of a
    `| tee` that the Ctrl-C also stopped, an ssh session that hung up) is pointed at /dev/null, so
    that the run goes on to its step boundary, its save and its log file's last line."""
    stream = stream or sys.stdout
    try:
        print(msg, file=stream, flush=True)
    except OSError:          # BrokenPipeError, EIO
        with contextlib.suppress(OSError, ValueError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, stream.fileno())
            os.close(null)


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
            to_console(msg)
        try:
            self.file.write(msg + "\n")
        except OSError as e:
            self.file = None         # the file cannot take more: later lines go to the console only
            raise ConfigError(f"cannot write the log {self.path}: "
                              f"{write_failure(e) or e.strerror or e}") from None

    def close(self, remove: bool = False) -> None:
        """Close the file (an error while flushing is not the run's error); remove: delete it (an
        attempt refused before it trained leaves no log behind)."""
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
            self.file = None
        if remove and self.path is not None:
            self.path.unlink(missing_ok=True)


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


__version__ = "1.0"    # named in every log, with this file's digest (the log embeds the script)


def log_start(run: Any, sources: dict[str, str], argv_text: str) -> None:
    """Rank 0 writes the run's head: the script and its kernels in full (sources: name -> text), this
    file by version and digest, the environment, the command and every option."""
    if run.rank != 0:
        return
    import hashlib
    to_console(f"logging to {run.log.path}")
    code = "\n".join(f"==== {name} ====\n{text}" for name, text in sources.items())
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    run.log(f"{code}\nharness.py: version {__version__}, sha256 {digest}", console=False)
    run.log("=" * 100 + "\n" + environment_report() + "=" * 100, console=False)
    run.log(f"command: {argv_text}")
    if run.node_note is not None:
        run.log(run.node_note)
    if run.digests_note is not None:
        run.log(run.digests_note)
    run.log("hyperparameters:\n" + "\n".join(f"  {f.name} = {getattr(run.hp, f.name)!r}"
                                              for f in dataclasses.fields(run.hp)), console=False)


def begin_run(run: Run, sources: dict[str, str], argv_text: str,
              attn_backend: str) -> tuple[list[str], list[str], Checkpointer]:
    """The run's head in the log (log_start) and the checks of a resume, before the script's data
    checks (which other options would fail); returns the training and validation shards and the
    checkpointer."""
    hp, device = run.hp, run.device
    log_start(run, sources, argv_text)
    for line in run.resumed["notes"] if run.resumed is not None else ():
        run.log(line)                   # the states a --resume=<folder> skipped
    for line in run.resumed.get("log_notes", ()) if run.resumed is not None else ():
        run.log(line, console=False)    # another rank's removals, said on its console
    train_files, val_files = resolve_shards(hp.train_files, "train"), resolve_shards(hp.val_files,
                                                                                     "val")
    facts = run_facts(run.world_size, device, attn_backend, train_files)
    if run.resumed is not None:
        check_resume(run.resumed, hp, facts, next(iter(sources)))
    script = next(iter(sources.values()))
    return train_files, val_files, Checkpointer(hp, run.run_id, run.rank, run.world_size, facts,
                                                run.log, script)


def accept_run(run: Run, sources: dict[str, str], attn_backend: str,
               lines: Sequence[str]) -> None:
    """After the checks passed: the preflight notes and warnings (`lines`), the setup line, and a
    warning when a resume runs other code than the state's."""
    hp, device = run.hp, run.device
    for line in lines:
        run.log(line)
    run.compiling = hp.compile and device.type == "cuda"
    run.log(f"world_size:{run.world_size} grad_accum:{hp.batch_slices // run.world_size} "
            f"device:{device} attn_backend:{attn_backend} (asked: {hp.attn_backend}) "
            f"compile:{run.compiling} dtype:{hp.dtype} kernels:{hp.kernels}")
    if run.resumed is not None and run.resumed["code"] != next(iter(sources.values())):
        run.log(f"warning: {next(iter(sources))} differs from the code that wrote the "
                "checkpoint (its log has that code); the continuation is exact only if the "
                "change leaves the math alone")
    run.accepted = True


def _canonical(node: Any) -> str:
    """A syntax tree as text, leaving out empty fields, so that the fields later Pythons add (empty
    for this code) do not change it."""
    import ast
    if isinstance(node, ast.AST):
        fields = [f"{name}={_canonical(value)}" for name, value in ast.iter_fields(node)
                  if value is not None and value != []]
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return "[" + ", ".join(_canonical(x) for x in node) + "]"
    return repr(node)


def reference_digest(sources: Sequence[str]) -> str:
    """A digest of the source text of functions or classes: their syntax trees without docstrings,
    so comments, layout and docs do not count as edits, and the same on every Python version."""
    import ast
    import hashlib
    trees = []
    for source in sources:
        tree = ast.parse(textwrap.dedent(source))
        for node in ast.walk(tree):
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    and node.body and isinstance(node.body[0], ast.Expr)
                    and isinstance(node.body[0].value, ast.Constant)
                    and isinstance(node.body[0].value.value, str)):
                node.body = node.body[1:] or [ast.Pass()]
        trees.append(_canonical(tree))
    return hashlib.sha256("\n".join(trees).encode()).hexdigest()[:16]


def default_run_id(log_dir: str, resumed: dict | None) -> str:
    """The run id when --run_id is not given: a new UUID; for a resumed run <id>-from<step>, or
    <id>-from<step>.2, .3, ... where an earlier try at that resume (stopped, say) left its log."""
    if resumed is None:
        return str(uuid.uuid4())
    base = f"{resumed['run_id']}-from{resumed['step']}"
    folder, run_id, n = Path(expand_path(log_dir)), base, 1
    while (folder / f"{run_id}.txt").exists():
        n += 1
        run_id = f"{base}.{n}"
    return run_id


def how_log_ends(log_path: Path) -> str:
    """How the run that wrote log_path ended, from its last line: "finished", "failed (error:
    ...)", or "did not finish" (stopped, killed, or still running)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        lines = []
    last = next((line.strip() for line in reversed(lines) if line.strip()), "")
    if last.startswith("result:"):
        return "finished"
    if last.startswith("error:"):
        return f"failed ({last[:100]}{'...' if len(last) > 100 else ''})"
    return "did not finish (stopped, killed, or still running)"


def remove_if_empty(folder: Path) -> None:
    """Remove `folder` if it holds nothing (a refused run's checkpoint folder); else leave it."""
    with contextlib.suppress(OSError):
        folder.rmdir()


def log_file(opts: RunOptions, run_id: str) -> Path:
    """Where rank 0 writes the run's log."""
    return Path(expand_path(opts.log_dir)) / f"{run_id}.txt"


def prepare_output(opts: RunOptions, run_id: str, rank: int) -> Path:
    """Before anything trains: refuse a --run_id whose log exists, create the log folder (and the
    checkpoint folder with --save_checkpoint) and prove that each is writable, so no run trains for
    an hour and then cannot save.
    Returns the log path."""
    log_dir = Path(expand_path(opts.log_dir))
    log_path = log_file(opts, run_id)
    if log_path.exists():
        states = log_dir / run_id
        resume = (f", or continue that run from its states: --resume={states}"
                  if any(states.glob("state_step*.pt")) else "")
        raise ConfigError(f"{log_path} exists: an earlier run with --run_id={run_id} "
                          f"{how_log_ends(log_path)}; its log is kept: choose another --run_id, or "
                          f"move that log away to reuse this one{resume}")
    saving = opts.save_checkpoint or opts.checkpoint_every
    if saving and any((log_dir / run_id).glob("state_step*.pt")):
        raise ConfigError(f"{log_dir / run_id} holds the states of an earlier run with "
                          f"--run_id={run_id}, which this run's would replace: choose another "
                          "--run_id or move that folder away")
    if saving:
        remove_stale_temporaries(log_dir / run_id)    # a reused --run_id's killed writes
    for folder in [log_dir] + ([log_dir / run_id] if saving else []):
        probe = folder / f".write_test_{os.getpid()}_{rank}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"cannot write to {folder}: {e.strerror or e}; "
                              "choose a writable --log_dir") from None
    return log_path


def atomic_write(path: Path, *chunks: bytes | memoryview) -> None:
    """The chunks, in order, to a temporary name beside `path` (<name>.tmp<pid>), flushed and
    fsynced, renamed over `path`, then the folder fsynced: after a crash or a power loss the name
    holds the old file or the whole new one, never a 0-byte or partial one."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_folder(path.parent)
    finally:
        if tmp.is_file():
            tmp.unlink()


def fsync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable. A file system that cannot sync a folder (EINVAL) is left
    as it is; any other error (EIO) is the write's error."""
    import errno
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


TEMPORARY_NAME = re.compile(r".+\.tmp(\d+)")


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Delete the <name>.tmp<pid> files in `folder` whose writer is gone (a write killed before its
    rename); a live writer's are kept. Returns the deleted paths. The pid is checked on this host:
    call it only on folders this run owns or resumes, which no live run elsewhere writes."""
    removed = []
    with contextlib.suppress(OSError):           # a folder that is not there holds nothing stale
        for f in sorted(folder.iterdir()):
            m = TEMPORARY_NAME.fullmatch(f.name)
            if m is None or not f.is_file() or _alive(int(m[1])):
                continue
            with contextlib.suppress(FileNotFoundError):     # another rank was first
                f.unlink()
                removed.append(f)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # another user's process
        return True
    except OverflowError:        # a number no process can have
        return False
    return True


# ==================================================================================================
# 5. The portable compile cache: torch's compiled artifacts in one file
# ==================================================================================================
COMPILE_CACHE_MAGIC = b"nanogpt-speedrun compile cache 1\n"


def compile_cache_key(sources: Sequence[str], versions: str) -> str:
    """What compiled code depends on: the text of both source files and the settings
    (compile_cache_settings), and the torch / triton / CUDA versions with the GPU model."""
    import hashlib
    digest = hashlib.sha256()
    for text in (*sources, versions):
        digest.update(hashlib.sha256(text.encode()).digest())
    return digest.hexdigest()


def compile_cache_settings(hp: Any, attn_backend: str) -> str:
    """The settings part of the compile cache's key: every math field (math_fields; a new one too,
    so a file made with another model shape is not taken for this run's: it would cover none of its
    graphs and turn off the compile helpers) and the resolved attention backend (auto picks differ
    between machines)."""
    fields = {name: getattr(hp, name) for name in math_fields(hp)}
    fields["attn_backend"] = attn_backend
    return repr(sorted(fields.items()))


def open_compile_cache(run: Any, hp: Any, attn_backend: str, sources: Sequence[str]) -> None:
    """Load --compile_cache into torch's caches if this code made it with these settings on this
    kind of machine (run.cache_loaded); otherwise remember where to save one after the warmup
    (run.compile_cache). Logs one line either way; never fatal."""
    path, versions = Path(expand_path(hp.compile_cache)), compile_cache_versions(run.device)
    if path.is_dir():
        run.log(f"compile cache: --compile_cache={hp.compile_cache} is a folder; give a file path "
                f"(e.g. {path / 'compile_cache.bin'}): not used")
        return
    key = compile_cache_key([*sources, compile_cache_settings(hp, attn_backend)], versions)
    loaded, note = load_compile_cache(path, key)
    run.log(note)
    run.compile_cache = None if loaded else (path, key, versions)
    run.cache_loaded = loaded


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
        atomic_write(path, record)
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
        # torch rejects a payload it cannot unpickle (another torch build) with a logged
        # traceback and None, not an exception: verified here, so the file is replaced.
        torch_log = logging.getLogger("torch.compiler._cache")
        level = torch_log.level
        torch_log.setLevel(logging.ERROR)
        try:
            info = torch.compiler.load_cache_artifacts(payload)
        finally:
            torch_log.setLevel(level)
        if info is None or not getattr(info, "artifacts", True):
            return False, (f"compile cache: torch rejected the artifacts in {path} (made by "
                           f"another torch build, or damaged before it was sealed); ignored, "
                           f"replaced after the warmup")
    except Exception as e:    # anything wrong in the file: compile as if it were absent
        reason = type(e).__name__ + (f": {str(e).splitlines()[0][:120]}" if str(e) else "")
        return False, (f"compile cache: {path} is unreadable ({reason}); ignored, replaced after "
                       f"the warmup")
    return True, f"compile cache: loaded {path} ({len(payload) / 2**20:.1f} MiB)"


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


# ==================================================================================================
# 6. The compile table: where the warmup's compile time goes
# ==================================================================================================

@dataclass(frozen=True)
class CompiledGraph:
    """One compilation seen during the warmup: a row of the compile table."""
    compile_id: str     # torch's "frame/attempt" id, e.g. "0/3"; a backward shares its forward's
    graph: str          # the compiled function (a module's forward is "forward")
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


# ==================================================================================================
# 7. Checkpoints: the whole training state, so that a stopped run continues bit for bit
# ==================================================================================================

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


CHECKPOINT_FORMAT = "train_gpt state 1"
CHECKPOINT_NAME = re.compile(r"state_step(\d{6,})(?:_rank(\d+))?\.pt")
STATE_KEYS = frozenset({"run_id", "hyperparameters", "facts", "code", "step", "model", "optimizer",
                        "grads", "train_time_ms", "loader", "rng"})
# A state file is torch.save's zip archive whose end record carries a comment: this mark, then JSON
# with the run id, step, rank, world size and a sha256 of the bytes before it and of these. It stays
# a valid zip (torch.load and unzip read it as before), and a damaged file is found before anything
# is unpickled. States written before the seal (no comment) still load; torch.load checks those.
STATE_SEAL = b"train_gpt sealed state "
_ZIP_END = b"PK\x05\x06"           # the end-of-central-directory record: 22 bytes, then the
_ZIP_END_SIZE = 22                 # comment, whose length is the record's last 2 bytes


def checkpoint_path(folder: Path, step: int, rank: int, world_size: int) -> Path:
    """<folder>/state_step<step>.pt; with several processes one file per rank (optimizer state is
    sharded)."""
    return folder / f"state_step{step:06d}{f'_rank{rank}' if world_size > 1 else ''}.pt"


def sealed_state(obj: dict, record: dict) -> list[memoryview | bytes]:
    """torch.save(obj) in memory, then its zip comment set to STATE_SEAL + the JSON of record and a
    sha256 of the bytes before the comment's length and of that record: the chunks to write (the
    archive uncopied)."""
    import hashlib
    import io
    import json
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    archive = buffer.getbuffer()
    end = bytes(archive[-_ZIP_END_SIZE:])
    if end[:4] != _ZIP_END or end[-2:] != b"\0\0":
        raise RuntimeError("torch.save wrote no zip end record without a comment")
    digest = hashlib.sha256(archive[:-2])
    digest.update(json.dumps(record, sort_keys=True).encode())
    sealed = {**record, "sha256": digest.hexdigest()}
    comment = STATE_SEAL + json.dumps(sealed, sort_keys=True).encode()
    return [archive[:-2], len(comment).to_bytes(2, "little"), comment]


def inspect_state(file: Path, step: int, rank: int, world_size: int) -> tuple[dict, str | None]:
    """(its seal's record, why it cannot be resumed or None) for the state file `file`, which
    should hold rank `rank` of `world_size` after step `step`, read without unpickling anything.
    A file written before the seal gives ({}, None): loading it is its check."""
    import hashlib
    import json
    if not file.exists():
        others = sorted(f.name for f in file.parent.glob(f"state_step{step:06d}*.pt"))
        return {}, (f"missing (the step-{step} state has {', '.join(others)})" if others
                    else "missing")
    if not file.is_file():
        return {}, "not a file"
    size = file.stat().st_size
    if size == 0:
        return {}, "empty (0 bytes, a write cut short)"
    with open(file, "rb") as f:
        f.seek(max(0, size - _ZIP_END_SIZE - 65535))
        tail = f.read()
        comment = _zip_comment(tail)
        if comment is None:
            return {}, f"truncated ({size:,} bytes and no zip end record: a write cut short)"
        if comment == b"":
            return {}, None                     # the format before the seal
        if not comment.startswith(STATE_SEAL):
            return {}, "not a training state written by this trainer (a foreign zip comment)"
        try:
            record = json.loads(comment[len(STATE_SEAL):])
            want = record.pop("sha256")
        except (ValueError, KeyError, AttributeError):
            return {}, "damaged (its seal is unreadable)"
        covered, digest = size - len(comment) - 2, hashlib.sha256()
        f.seek(0)
        while covered > 0:
            chunk = f.read(min(covered, 1 << 24))
            if not chunk:
                break
            digest.update(chunk)
            covered -= len(chunk)
    digest.update(json.dumps(record, sort_keys=True).encode())
    if digest.hexdigest() != want:
        return record, "damaged (its sha256 does not match its contents)"
    have = (record.get("step"), record.get("rank"), record.get("world_size"))
    if have != (step, rank, world_size):
        why = "a renamed file" if have[2] == world_size else "another process count"
        return record, (f"holds rank {have[1]} of {have[2]} after step {have[0]}, not rank {rank} "
                        f"of {world_size} after step {step} ({why})")
    return record, None


def seal_record(file: Path) -> dict:
    """The record a state file's seal holds (run id, step, rank, world size), read from its tail
    without checking its digest; {} where it has none that reads."""
    import json
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            f.seek(max(0, size - _ZIP_END_SIZE - 65535))
            comment = _zip_comment(f.read())
        record = json.loads(comment[len(STATE_SEAL):]) if comment and comment.startswith(
            STATE_SEAL) else {}
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def writers_of(folder: Path, step: int) -> int | None:
    """How many processes wrote the step-`step` state in `folder`: the world size a seal of one of
    its files records, else the count their names give (one unranked file: 1; rank files: the
    highest rank + 1); None where the step has no file."""
    found = [m for f in sorted(folder.glob(f"state_step{step:06d}*.pt"))
             if (m := CHECKPOINT_NAME.fullmatch(f.name))]
    for m in found:
        if isinstance(n := seal_record(folder / m[0]).get("world_size"), int) and n >= 1:
            return n
    return max((int(m[2]) + 1 if m[2] is not None else 1 for m in found), default=None)


def resume_with(n: int) -> str:
    """The advice of every refusal of a state written by another process count than this run's."""
    return ("resume with 1 process" if n == 1 else
            f"resume with {n} processes ({f'NPROC={n} ./run.sh, or ' if n <= 8 else ''}NNODES x "
            f"NPROC = {n} on several nodes)")


def _zip_comment(tail: bytes) -> bytes | None:
    """The comment of the zip end record that ends `tail` exactly; None if no record does."""
    i = tail.rfind(_ZIP_END)
    while i >= 0:
        if i + _ZIP_END_SIZE <= len(tail):
            n = int.from_bytes(tail[i + 20:i + 22], "little")
            if i + _ZIP_END_SIZE + n == len(tail):
                return tail[i + _ZIP_END_SIZE:]
        i = tail.rfind(_ZIP_END, 0, i)
    return None


def run_facts(world_size: int, device: torch.device, attn_backend: str,
              train_files: list[str]) -> dict[str, Any]:
    """What the run-control options resolve to that the math depends on: a resumed run must match
    them."""
    return {"processes": world_size, "device": device.type, "attention backend": attn_backend,
            "training shards": [os.path.basename(f) for f in train_files]}


class Checkpointer:
    """Writes this rank's part of the training state atomically and sealed (sealed_state). Periodic
    checkpoints keep the newest `keep`; the ones written at the end, when stopped, or before a
    divergence are kept."""

    def __init__(self, hp: Any, run_id: str, rank: int, world_size: int, facts: dict,
                 log: RunLogger, code: str = ""):
        """hp: the run's options (all saved; resume compares the math ones); code: the script's
        source, saved with the state (its log has it too)."""
        self.folder, self.keep = Path(expand_path(hp.log_dir)) / run_id, hp.checkpoint_keep
        self.rank, self.world_size, self.log = rank, world_size, log
        self.header = {"format": CHECKPOINT_FORMAT, "run_id": run_id,
                       "hyperparameters": dataclasses.asdict(hp), "facts": facts, "code": code}
        self.periodic: list[int] = []
        self.last: Path | None = None      # the newest state this run saved

    def save(self, state: dict, periodic: bool = False) -> Path:
        path = checkpoint_path(self.folder, state["step"], self.rank, self.world_size)
        record = {"run_id": self.header["run_id"], "step": state["step"], "rank": self.rank,
                  "world_size": self.world_size}
        try:
            atomic_write(path, *sealed_state({**self.header, **state}, record))
        except Exception as e:   # torch.save reports a full disk as a RuntimeError
            reason = write_failure(e)
            if reason is None:
                raise
            earlier = (f"the last state saved, {self.last}, is intact" if self.last is not None
                       else "no earlier state of this run was saved")
            raise ConfigError(f"cannot write the checkpoint {path}: {reason}; {earlier}") from None
        self.last = path
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


def find_checkpoint(path: str, world_size: int) -> tuple[Path, list[int]]:
    """(folder, steps newest first) of what --resume names: a state file (any rank's), its step
    alone; or a run folder, every step with a file of a world_size-process run (load_checkpoint
    walks back from the newest to the first set that is whole on every rank)."""
    p = Path(path)
    if p.is_dir():
        written: dict[int, int] = {}        # step -> processes that wrote it (1 for unranked files)
        for f in p.iterdir():
            if m := CHECKPOINT_NAME.fullmatch(f.name):
                written[int(m[1])] = max(written.get(int(m[1]), 0), int(m[2] or 0) + 1)
        ranked = world_size > 1
        steps = {int(m[1]) for f in p.iterdir() if (m := CHECKPOINT_NAME.fullmatch(f.name))
                 and (m[2] is not None) == ranked and written[int(m[1])] <= world_size}
        if not steps:
            counts = sorted(set(written.values()))
            found = (f"states of {' or '.join(map(str, counts))} process(es) (steps "
                     f"{sorted(written)})" if written else "no states")
            fix = (f"{resume_with(counts[-1])}, or give " if written else "give ")
            raise ConfigError(f"--resume={path}: the folder holds {found}, none written by "
                              f"{world_size} process(es): {fix}a run's folder (logs/<run_id>) or "
                              "one of its state_step*.pt files")
        return p, sorted(steps, reverse=True)
    m = CHECKPOINT_NAME.fullmatch(p.name)
    if m is None or not p.is_file():
        raise ConfigError(f"--resume={path} is "
                          f"{'not a file' if m else 'neither a folder nor a state_step*.pt file'}: "
                          "give a run's folder (logs/<run_id>) or one of its state_step*.pt files")
    return p.parent, [int(m[1])]


def _everyone(value: Any, world_size: int) -> list[Any]:
    """value from every rank, in rank order (all_gather_object); [value] in one process."""
    if world_size == 1:
        return [value]
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, value)
    return every


def set_problem(reports: Sequence[tuple[str, str | None, str | None]]) -> tuple[str, str] | None:
    """(file name, why) for the first file of a state's set (one report per rank: file name, its
    problem, its run id or None where unknown) that keeps the set from being resumed: a bad file,
    or one of another run than rank 0's. None if every file is whole and all are of one run."""
    for name, problem, _ in reports:
        if problem is not None:
            return name, problem
    runs = [(name, run_id) for name, _, run_id in reports if run_id is not None]
    for name, run_id in runs[1:]:
        if run_id != runs[0][1]:
            return name, f"foreign (from run {run_id}; {runs[0][0]} is from run {runs[0][1]})"
    return None


def load_checkpoint(path: str, rank: int, world_size: int,
                    device: str | torch.device = "cpu") -> dict:
    """This rank's state from the checkpoint `path` names (see find_checkpoint), the same step on
    every rank: each state, newest first, is checked as a set (every rank's file there, whole,
    sealed by the same run for that step) before any rank loads it. A named state that fails is a
    ConfigError naming the file; a folder's newest whole set is taken, and state["notes"] has a
    line for each state skipped (and for each stale temporary this rank removed; another rank says
    its own on its console, and rank 0's state["log_notes"] has them for the log)."""
    try:
        mine: list[int] | str = find_checkpoint(path, world_size)[1]
    except ConfigError as e:
        mine, refused = str(e), e
    listed = _everyone(mine, world_size)      # the steps each rank sees: one node's disk need
    if all(isinstance(x, str) for x in listed):
        raise refused
    named = not Path(path).is_dir()
    folder = Path(path).parent if named else Path(path)
    steps = sorted({st for x in listed if not isinstance(x, str) for st in x},   # not hold
                   reverse=True)                                                # another's
    notes = [f"note: removed {f}, the temporary file of a write that was cut short"
             for f in remove_stale_temporaries(folder)] if not named else []
    # Every rank tries and one removes each file: the remover says so, once, on its own console;
    # rank 0's log gets every rank's (rank 0's own come with the other notes, on its console too).
    by_rank = _everyone(notes, world_size) if not named else [notes]
    if rank != 0:
        for line in notes:
            to_console(f"{line} (by rank {rank})")
        notes = []
    theirs = [f"{line} (by rank {r})" for r, lines in enumerate(by_rank) if r != 0
              for line in lines]
    skipped: list[str] = []
    others: set[int | None] = set()      # the process counts that wrote the states skipped
    for step in steps:
        file = checkpoint_path(folder, step, rank, world_size)
        record, problem = inspect_state(file, step, rank, world_size)
        why = set_problem(_everyone((file.name, problem, record.get("run_id")), world_size))
        if why is None:                  # the set is whole: now each rank unpickles its file
            state, problem = _read_state(file, step, device)
            why = set_problem(_everyone((file.name, problem, state and state["run_id"]),
                                        world_size))
        if why is None:
            break
        writers = writers_of(folder, step)
        if named:
            fix = (f"It was written by {writers} processes, this run has {world_size}: "
                   f"{resume_with(writers)}" if writers not in (None, world_size) else
                   "Resume from an earlier state (written by as many processes as this run has), "
                   f"or give the folder (--resume={folder}) to take its newest whole one")
            raise ConfigError(f"--resume: {folder / why[0]}: {why[1]}. {fix}")
        skipped.append(f"{why[0]}: {why[1]}")
        others.add(writers)
    else:
        fix = (f"They were written by {others_n} processes, this run has {world_size}: "
               f"{resume_with(others_n)}" if len(others) == 1
               and (others_n := next(iter(others))) not in (None, world_size)
               else "Start a new run, or give another run's folder")
        raise ConfigError(f"--resume={path}: no state in the folder is whole on all {world_size} "
                          f"process(es): {'; '.join(skipped)}. {fix}")
    state["path"] = str(file)
    chosen = f"state_step{step:06d}{'_rank*' if world_size > 1 else ''}.pt"
    state["notes"] = notes + [f"note: skipped {line}; resuming from {chosen}" for line in skipped]
    state["log_notes"] = theirs if rank == 0 else []      # for the log alone: said on their
    return state                                            # ranks' consoles


def _read_state(file: Path, step: int,
                device: str | torch.device) -> tuple[dict | None, str | None]:
    """(the state, None) or (None, why it is not a whole training state after `step`) for a file
    inspect_state passed (for one written before the seal, loading it is the check)."""
    try:
        state = torch.load(file, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001 (a truncated or foreign file, reported as such)
        return None, (f"unreadable as a training state (torch.load: {type(e).__name__}; the file "
                      "is cut short or foreign)")
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        return None, "not a training state written by this trainer"
    missing = sorted(STATE_KEYS - set(state))
    if missing or not isinstance(state["step"], int):
        return None, f"not a whole training state (no {', '.join(missing) or 'step number'})"
    if state["step"] != step:
        return None, f"the state after step {state['step']}, not {step} (a renamed file)"
    return state, None


def read_sealed_state(path: str, needs: Collection[str] = STATE_KEYS) -> dict:
    """A state file as a tool reads it (any rank's, under any name), on the CPU: its seal checked as
    --resume checks it (inspect_state, for the step, rank and process count the seal records)
    before anything is unpickled, then loaded, with the entries `needs` names. ConfigError naming
    the file and why where it is missing, damaged, cut short, foreign or lacks one of them."""
    file = Path(expand_path(path))
    if not file.is_file():
        raise ConfigError(f"{path} is {'not a file' if file.exists() else 'missing'}: give a "
                          "state_step*.pt file written by train_gpt.py")
    record = seal_record(file)
    name = CHECKPOINT_NAME.fullmatch(file.name)
    step = record.get("step", int(name[1]) if name else 0)
    _, problem = inspect_state(file, step, record.get("rank", 0), record.get("world_size", 1))
    state = None
    if problem is None:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 (a truncated or foreign file, reported as such)
            problem = (f"unreadable as a training state (torch.load: {type(e).__name__}; the "
                       "file is cut short or foreign)")
    if problem is None and (not isinstance(state, dict)
                            or state.get("format") != CHECKPOINT_FORMAT):
        problem = "not a training state written by this trainer"
    if problem is None and (missing := sorted(set(needs) - set(state))):
        problem = f"not a whole training state (no {', '.join(missing)})"
    if problem is not None:
        raise ConfigError(f"{path}: {problem}; give a state_step*.pt file that --resume takes")
    return state


def state_options(path: str, rank: int, world_size: int) -> dict | None:
    """{"path", "hyperparameters", "facts"} of the state `path` (a --resume value) names for this
    rank, read without its tensors: torch.load with mmap reads the pickle, the weights stay on
    disk. Each rank reads its own file, before any process group exists: the files of one run's
    states hold the same options. From a folder, the newest state whose file for this rank reads.
    None where none reads: load_resume, whose checks come later, then says why."""
    p = Path(expand_path(path))
    if p.is_dir():
        try:
            steps = find_checkpoint(str(p), world_size)[1]
        except ConfigError:
            return None
        folder = p
    elif (m := CHECKPOINT_NAME.fullmatch(p.name)) is not None:
        folder, steps = p.parent, [int(m[1])]
    else:
        return None
    for step in steps:
        file = checkpoint_path(folder, step, rank, world_size)
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001 (missing, cut short or foreign: load_resume names it)
            continue
        if (isinstance(state, dict) and state.get("format") == CHECKPOINT_FORMAT
                and isinstance(state.get("hyperparameters"), dict)
                and isinstance(state.get("facts"), dict)):
            return {"path": str(file), "hyperparameters": state["hyperparameters"],
                    "facts": state["facts"]}
    return None


def reuse_state_options(hp: Any, given: set[str], saved: dict,
                        presets: dict[str, dict]) -> tuple[Any, str | None]:
    """(hp with every option the command line leaves out taken from the state, the line that names
    them) for `saved` (state_options) and `given` (given_options). Kept as given: the options on the
    command line (a math one that differs is then refused by check_resume, a run-control one
    changes), the per-command ones (PER_COMMAND) and those no command line sets (a table: the
    code's, compared as math). The line lists the state's values as a command line would: its
    --preset, then those that are not the preset's or the defaults; None where there are none
    (the command line gives every option the state sets)."""
    old = from_dict(type(hp)(), saved["hyperparameters"])
    taken = {f.name: getattr(old, f.name) for f in dataclasses.fields(hp)
             if f.name not in given and f.name not in PER_COMMAND
             and not isinstance(getattr(old, f.name), dict)}
    if not taken:
        return hp, None
    new = dataclasses.replace(hp, **copy.deepcopy(taken))
    defaults = dataclasses.replace(type(hp)(), **copy.deepcopy(presets.get(new.preset, {})))
    shown = [as_argument(name, value) for name, value in taken.items()
             if value != getattr(defaults, name) or (name == "preset" and value)]
    shown.sort(key=lambda arg: not arg.startswith("--preset="))
    return new, (f"resume: the options the command line leaves out are the state's "
                 f"({saved['path']}): {' '.join(shown)}" if shown else None)


def resume_options(hp: Any, argv: Sequence[str], presets: dict[str, dict]) -> tuple[Any, list[str]]:
    """The options of a command line with --resume: those it leaves out are the state's
    (state_options, reuse_state_options), read before they are checked and the run is built; and
    the line that names them (for the log and the dry run). hp and [] without --resume, or where
    no state reads (the resume's own checks then say why)."""
    if not hp.resume:
        return hp, []
    rank, world_size, _ = launch_environment()
    saved = state_options(hp.resume, rank, world_size)
    if saved is None:
        return hp, []
    check_state_options(saved, hp)      # another recipe's: refused before its options are read
    try:
        hp, line = reuse_state_options(hp, given_options(argv, presets), saved, presets)
    except (TypeError, ValueError):     # options this code cannot read (a table row's fields
        return hp, []                   # changed): the resume's checks compare them as today
    return hp, [line] if line else []


# the run-control option a fact (run_facts) comes from: a resume that differs there leaves it out
FACT_OPTIONS = {"device": "device", "attention backend": "attn_backend",
                "training shards": "train_files"}


def resume_command(saved: dict, hp: Any, script: str = "train_gpt.py",
                   leave_out: Sequence[str] = ()) -> str:
    """The command that continues the state `saved` (its "hyperparameters" and "facts") with its
    own options: its process count's launcher, --resume as given, and the run-control options of
    `hp` that are not the state's (a resume may change them; not those in leave_out); no math
    option, since a resume takes the state's. script: the file the trainer runs as."""
    old, defaults = from_dict(type(hp)(), saved["hyperparameters"]), type(hp)()
    args = [as_argument("resume", hp.resume)]
    for f in dataclasses.fields(RunOptions):
        if f.name == "resume" or f.name in leave_out:
            continue
        then = getattr(defaults if f.name in PER_COMMAND else old, f.name)
        if getattr(hp, f.name) != then:
            args.append(as_argument(f.name, getattr(hp, f.name)))
    n = saved["facts"].get("processes", 1)
    train = "" if script == "train_gpt.py" else f"TRAIN={script} "
    launcher = (f"python3 {script}" if n == 1 else f"{train}NPROC={n} ./run.sh" if n <= 8
                else f"{train}NNODES={n // 8} MASTER_ADDR=<the first node> ./run.sh")
    command = " ".join([launcher, *args])
    return command if n <= 8 else f"{command} (on every node)"


def option_differences(saved: dict, hp: Any) -> list[str]:
    """How the options a state stored (its "hyperparameters") differ in kind from this code's: a
    name this code has no option for, a math option (math_fields) the state lacks, a table row
    (e.g. a Stage) with a field this code's row lacks or without one it has. Empty where from_dict
    reads them (a run-control option this code added takes its default)."""
    names = {f.name for f in dataclasses.fields(hp)}
    diffs = [f"--{name} (an option this code does not have)" for name in saved
             if name not in names]
    diffs += [f"--{name} (an option of this code the state has no value for)"
              for name in math_fields(hp) if name not in saved]
    for f in dataclasses.fields(hp):
        like = getattr(hp, f.name)
        if (f.name not in saved or not isinstance(like, tuple) or not like
                or not dataclasses.is_dataclass(like[0])):
            continue
        row, rows = type(like[0]), saved[f.name]
        want = [g.name for g in dataclasses.fields(row)]
        if not isinstance(rows, (list, tuple)) or not all(isinstance(r, dict) for r in rows):
            diffs.append(f"--{f.name} (not a table of {row.__name__} rows)")
            continue
        have = [name for r in rows for name in r]
        diffs += [f"--{f.name} rows with the field {name} that this code's {row.__name__} lacks"
                  for name in dict.fromkeys(have) if name not in want]
        diffs += [f"--{f.name} rows without the field {name} that this code's {row.__name__} has"
                  for name in want if not all(name in r for r in rows)]
    return diffs


def written_by(saved: dict) -> str:
    """Where the code that wrote the state `saved` is, and how many processes wrote it: the advice
    of every refusal of a state from other code."""
    folder = Path(saved["path"]).parent
    n = saved.get("facts", {}).get("processes", 1) if isinstance(saved.get("facts"), dict) else 1
    return (f"resume it with the code that wrote it (its log {folder.parent / folder.name}.txt, "
            f"and the state's 'code' entry, hold that script), with {n} process(es)")


def check_state_options(saved: dict, hp: Any) -> None:
    """ConfigError naming each option or table field that the state `saved` (a --resume state, or
    state_options' record of one) stores and this code lacks, or lacks and this code has: a state
    of another recipe, refused before anything is read into a model."""
    options = saved.get("hyperparameters")
    diffs = (option_differences(options, hp) if isinstance(options, dict)
             else ["no options stored (a state of an older format)"])
    if diffs:
        raise ConfigError(f"--resume: {saved['path']} was written by other code than this: "
                          f"{'; '.join(diffs)}. {written_by(saved).capitalize()}")


def state_layout(tree: Any, prefix: str = "") -> dict[str, tuple[tuple[int, ...], str]]:
    """{dotted path: (shape, dtype)} of every tensor in a nested dict (a state's "model",
    "optimizer" or "grads", or the same built on the meta device)."""
    if isinstance(tree, Tensor):
        return {prefix: (tuple(tree.shape), str(tree.dtype).removeprefix("torch."))}
    if isinstance(tree, dict):
        return {path: layout for key, value in tree.items()
                for path, layout in state_layout(value, f"{prefix}.{key}" if prefix
                                                 else str(key)).items()}
    return {}


def layout_differences(saved: dict, expected: dict[str, Any]) -> list[str]:
    """The tensors whose names, shapes or dtypes differ between the state `saved` and `expected`
    (what this code would save: {"model": ..., "optimizer": ...}, built on the meta device);
    each gradient the state holds must be shaped as its parameter."""
    def name(path: str) -> str:
        return (f"parameter {path.removeprefix('model.')}" if path.startswith("model.")
                else f"gradient of {path.removeprefix('grads.')}" if path.startswith("grads.")
                else path.replace("optimizer.buffers.", "optimizer buffer "))

    def shown(layout: tuple) -> str:
        return f"{'x'.join(map(str, layout[0])) or 'a scalar'} {layout[1]}"

    here = state_layout({key: expected[key] for key in ("model", "optimizer")})
    here.update({f"grads.{path.removeprefix('model.')}": layout for path, layout in here.items()
                 if path.startswith("model.")})
    there = state_layout({key: saved.get(key, {}) for key in ("model", "optimizer", "grads")})
    diffs = []
    for path in dict.fromkeys([*here, *there]):
        if path.startswith("grads.") and path not in there:
            continue                                # a gradient not pending at that step
        if path not in there:
            diffs.append(f"{name(path)} is not in the state")
        elif path not in here:
            diffs.append(f"{name(path)} is in the state but not in this model")
        elif there[path] != here[path]:
            diffs.append(f"{name(path)} is {shown(there[path])} there, {shown(here[path])} here")
    return diffs


def check_state_layout(saved: dict, expected: dict[str, Any], hp: Any,
                       script: str = "train_gpt.py") -> None:
    """ConfigError naming the tensors of the state `saved` that this code's model and optimizer
    (expected: layout_differences') do not have as it holds them, before any is loaded: a state of
    another recipe whose options this code reads alike."""
    if diffs := layout_differences(saved, expected):
        more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
        raise ConfigError(f"--resume: {saved['path']} holds another model than this code builds "
                          f"from its options: {'; '.join(diffs[:3])}{more}. "
                          f"{written_by(saved).capitalize()}: {resume_command(saved, hp, script)}")


def load_resume(hp: Any, rank: int, world_size: int, script: str = "train_gpt.py") -> dict:
    """The state --resume names, for this rank; ConfigError when it cannot continue (see
    load_checkpoint), or when it lies past the end of these options' schedule. The state after the
    last step (saved when a signal came before or during the final validation, or at the end) is
    taken: that resume runs only the final validation and writes the result line. script: the
    file the trainer runs as, for the command a refusal gives."""
    state = load_checkpoint(expand_path(hp.resume), rank, world_size)
    check_state_options(state, hp)
    if state["step"] >= hp.num_iterations:
        try:
            total = from_dict(type(hp)(), state["hyperparameters"]).num_iterations
            command = resume_command(state, hp, script)
        except Exception:  # noqa: BLE001 (an unreadable record: the message below stands)
            total, command = hp.num_iterations, "its log's command line"
        if total != hp.num_iterations or state["step"] > total:
            raise ConfigError(f"--resume: {state['path']} is the state after step {state['step']} "
                              f"of a run of {total} steps, and these options give "
                              f"{hp.num_iterations}: continue it with its own options: {command}")
    return state


def resume_differences(saved: dict, hp: Any, facts: dict) -> list[str]:
    """The math options (math_fields) and resolved facts (run_facts) that differ between the saved
    run and this one."""
    old = from_dict(type(hp)(), saved["hyperparameters"])
    diffs = [f"--{name}={show(getattr(old, name))} (now {show(getattr(hp, name))})"
             for name in math_fields(hp) if getattr(old, name) != getattr(hp, name)]
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


def check_resume(saved: dict, hp: Any, facts: dict, script: str = "train_gpt.py") -> None:
    """ConfigError, with the command that continues the state, when this run's math options or
    facts (run_facts) differ from those of the state `saved` (or it stores options of other code:
    check_state_options)."""
    check_state_options(saved, hp)
    if diffs := resume_differences(saved, hp, facts):
        differ = [option for key, option in FACT_OPTIONS.items()
                  if saved["facts"].get(key) != facts.get(key)]
        n = saved["facts"].get("processes", 1)
        count = (f" ({resume_with(n).partition(' (')[0]}; this run has {facts['processes']})"
                 if facts.get("processes", n) != n else "")
        raise ConfigError(f"--resume: {saved['path']} was written by a run with other math: "
                          f"{'; '.join(diffs)}. A resume takes the state's options where the "
                          f"command line gives none; continue it with its {n} process(es){count}: "
                          f"{resume_command(saved, hp, script, differ)}")


# ==================================================================================================
# 8. Processes: ranks, GPUs, signals
# ==================================================================================================

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


def isolate_gpu(local_rank: int, env: dict[str, str] = os.environ) -> str | None:
    """Before CUDA starts, let this process see only its own GPU (the LOCAL_RANK-th of those
    visible), which it then calls cuda:0. torch's compile caches key on the device index: with
    every rank on cuda:0 the ranks share what each compiles, and a saved compile cache serves every
    rank. Returns the CUDA_VISIBLE_DEVICES entry chosen; None where nothing changed (no GPU, or
    CUDA already started: then cuda:LOCAL_RANK as usual). torch.cuda.device_count reads the GPUs
    through NVML without starting CUDA and honours CUDA_VISIBLE_DEVICES."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if torch.cuda.is_initialized() or (visible is not None and not visible.strip()):
        return None
    count = torch.cuda.device_count()
    if count == 0:
        return None
    if local_rank >= count:
        raise ConfigError(f"LOCAL_RANK={local_rank} but {count} GPU(s) are visible: start one "
                          "process per GPU (./run.sh does), or check CUDA_VISIBLE_DEVICES")
    entries = ([e.strip() for e in visible.split(",")] if visible is not None
               else [str(i) for i in range(count)])
    env["CUDA_VISIBLE_DEVICES"] = entries[local_rank]
    if torch.cuda.device_count() != 1:    # CUDA had started (no NVML) and read the variable already: undo
        if visible is None:
            del env["CUDA_VISIBLE_DEVICES"]
        else:
            env["CUDA_VISIBLE_DEVICES"] = visible
        return None
    return entries[local_rank]


def device_type(opts: RunOptions) -> str:
    """"cuda" or "cpu": where --device sends the run (auto: a GPU when one is visible)."""
    return "cuda" if opts.device == "cuda" or (opts.device == "auto" and
                                               torch.cuda.is_available()) else "cpu"


def setup_distributed(hp: RunOptions) -> tuple[int, int, int, torch.device]:
    """(rank, world_size, local_rank, device): this process's GPU (or the CPU) and, with several
    processes, the process group (NCCL on GPUs, gloo on CPUs)."""
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
    want_cuda = device_type(hp) == "cuda"
    if want_cuda and not torch.cuda.is_available():
        raise ConfigError("--device=cuda but no CUDA GPU is visible: check nvidia-smi, "
                          "or run with --device=cpu")
    if gpu is None and want_cuda and local_rank >= torch.cuda.device_count():
        raise ConfigError(f"LOCAL_RANK={local_rank} but {torch.cuda.device_count()} GPU(s) are "
                          "visible: start one process per GPU (./run.sh does), or check "
                          "CUDA_VISIBLE_DEVICES")
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
        announce_rank(dist.distributed_c10d._get_default_store(), rank)
    return rank, world_size, local_rank, device


def local_world_size(world_size: int) -> int:
    """The processes on this node: torchrun's LOCAL_WORLD_SIZE; all of them without it."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    except ValueError:
        return world_size


def node_line(host: str, first: int, count: int, world_size: int, host0: str,
              log_path: str) -> str | None:
    """What a node's console says about its place: its ranks (first .. first+count-1, as torchrun
    numbers them, a node's ranks in a row) and where rank 0, whose console has the steps and the
    `error:` lines, runs and keeps the log. torchrun orders the nodes itself, so rank 0 need not be
    on the MASTER_ADDR node. None on a single node (count = world_size): nothing to tell."""
    if count >= world_size:
        return None
    ranks = f"rank {first}" if count == 1 else f"ranks {first}-{first + count - 1}"
    where = "here" if first == 0 else f"on {host0}"
    return (f"node {host}: {ranks} of {world_size}; rank 0 runs {where} (the steps and errors are "
            f"on its console), its log: {log_path}")


def follow_the_launcher() -> bool:
    """Ask Linux to send this process SIGTERM when its parent (torchrun) dies (prctl
    PR_SET_PDEATHSIG), so that a launcher killed outright does not leave its workers training: they
    stop as on the launcher's own SIGTERM, saving the last step where --save_checkpoint asks. False
    where there is no prctl (not Linux); the stop vote's launcher_gone check covers those."""
    import ctypes
    import signal
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, int(signal.SIGTERM), 0, 0, 0) == 0   # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


# The line of a stop before the timed loop: no step ran this run, so there is nothing new to save.
BEFORE_TRAINING = "before the first step of this run: no step ran, so no new state is saved"
IN_WARMUP = "during the warmup, " + BEFORE_TRAINING


class StopSignals:
    """Ctrl-C (SIGINT), SIGTERM and SIGHUP (a closed terminal or ssh session). Inside the timed loop
    (`defer` is set) the first signal asks the run to stop at a step boundary that every rank agrees
    on, where --save_checkpoint can save a consistent state; a second signal (or one outside the
    loop) stops at once. torchrun passes a terminal's Ctrl-C on to its workers, who also got it from
    the terminal: a repeat within a second is that same key press, not a second one."""

    REPEAT_S = 1.0

    def __init__(self, announce: bool = True):
        self.requested: int | None = None        # the signal asking for a stop at
                                                 # the next agreed step boundary
        self.defer = False
        self.holding = False                     # held(): signals are noted, nothing is raised
        self.announce = announce
        self._at = 0.0
        self._previous: dict[int, Any] = {}
        self.launcher: int | None = None         # torchrun's pid, for a worker it started
        self.where: str | None = BEFORE_TRAINING  # what an immediate stop's line says it stopped;
                                                  # None in the timed loop (its callers say)

    def install(self) -> None:
        import signal
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: a closed terminal
            self._previous[signum] = signal.signal(signum, self._on_signal)
        if "TORCHELASTIC_RUN_ID" in os.environ:     # a torchrun worker: the launcher is the parent
            self.launcher = os.getppid()
            follow_the_launcher()

    def launcher_gone(self) -> int:
        """SIGTERM once the launcher that started this worker has died (it is no longer the
        parent: the process was handed to init or a subreaper), else 0; the stop vote asks it at
        every step boundary, so a launcher killed outright (SIGKILL, the OOM killer) stops its
        workers as its SIGTERM would, where the parent-death signal is unavailable or came before
        it was set."""
        import signal
        if self.launcher is None or os.getppid() == self.launcher:
            return 0
        if self.requested is None and self.announce:
            to_console(f"the launcher (pid {self.launcher}) is gone: stopping at the next step "
                       "boundary", sys.stderr)
        self.requested = self.requested or signal.SIGTERM
        return self.requested

    def uninstall(self) -> None:
        import signal
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """While a failed rank tells the others and waits (at most a few seconds) for their
        reports: the SIGTERM torchrun sends every rank once one has ended is not a second
        failure."""
        holding, self.holding = self.holding, True
        try:
            yield
        finally:
            self.holding = holding

    def _on_signal(self, signum: int, frame: Any) -> None:
        import signal
        if self.holding:
            self.requested = self.requested or signum
            return
        name = signal.Signals(signum).name
        if self.defer and self.requested is None:
            self.requested, self._at = signum, time.monotonic()
            if self.announce:
                to_console(f"{name}: stopping at the next step boundary (again to stop at once)",
                           sys.stderr)
            return
        if self.defer and time.monotonic() - self._at < self.REPEAT_S:
            return
        raise Interrupted(signum, f"stopped by {name}" + (f" {self.where}" if self.where else ""))


class StopVote:
    """A stop that every rank takes at the same step, asked at every step boundary for the price of
    one 4-byte all-reduce (MAX) that nobody waits for: each boundary reads the result of the
    all-reduce the boundary before launched (long done: a step ran since) and launches the next
    with this rank's signal. Every rank reads the same result at the same boundary, so a signal to
    any rank (torchrun passes the launcher's on to all) stops every rank after the same step, one
    step after the boundary that first saw it: well inside torchrun's 30 s before it SIGKILLs. On
    a GPU the result is copied to pinned host memory on a side stream, so reading it waits for that
    copy only, never for the step queued behind it. One process needs no vote."""

    def __init__(self, world_size: int, device: torch.device):
        self.world_size, self.device = world_size, device
        self.work: Any = None            # the all-reduce in flight, launched at the last boundary
        if world_size > 1:
            self.flag = torch.zeros((), dtype=torch.int32, device=device)
            if device.type == "cuda":
                self.host = torch.zeros((), dtype=torch.int32, pin_memory=True)
                self.copy_stream, self.copied = torch.cuda.Stream(device), torch.cuda.Event()

    def _launch(self, signum: int) -> None:
        self.flag.fill_(signum)          # on a GPU: a kernel with the value, no sync
        self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, async_op=True)
        if self.device.type == "cuda":
            with torch.cuda.stream(self.copy_stream):
                self.work.wait()         # the side stream (not the step's) waits for NCCL
                self.host.copy_(self.flag, non_blocking=True)
                self.copied.record()

    def _result(self) -> int:
        if self.work is None:
            return 0
        if self.device.type == "cuda":
            self.copied.synchronize()
            agreed = int(self.host)
        else:
            self.work.wait()
            agreed = int(self.flag)
        self.work = None
        return agreed

    def at_boundary(self, signum: int) -> int:
        """The agreed signal of the last boundary's vote (0: go on); launches this boundary's."""
        if self.world_size == 1:
            return signum
        agreed = self._result()
        if not agreed:
            self._launch(signum)
        return agreed

    def now(self, signum: int) -> int:
        """The agreed signal, waited for: the vote in flight, then one more with `signum`."""
        if self.world_size == 1:
            return signum
        earlier = self._result()
        self._launch(signum)
        return max(earlier, self._result())


# ==================================================================================================
# 9. The run: opening it, the services of the timed loop, the dry run, the command line
# ==================================================================================================
# The script's timed loop owns its clock; what it asks of this file takes and returns plain values:
# a line to log, a state to save, whether a stop was asked, whether the loss stayed finite.

@dataclass
class Run:
    """One process's view of the run: its place among the ranks, the log, and how the run ends."""
    hp: Any                              # the run's options (train_gpt.Hyperparameters)
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
    accepted: bool = False               # the checks passed (accept_run): a run refused before
                                         # this leaves no log, so the corrected command can follow
    made_folder: Path | None = None      # the checkpoint folder this run created: a failed run
                                         # that saved nothing there removes it
    node_note: str | None = None         # rank 0's node_line, which log_start logs (several nodes)
    digests_note: str | None = None      # rank 0's note on slow shard digests (log_start logs it)
    short_timeout: bool = False          # collectives time out after --loop_timeout_s (the loop)
    votes: StopVote = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.votes = StopVote(self.world_size, self.device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def shorten_timeout(self) -> None:
        """As the timed loop starts: collectives now time out after --loop_timeout_s, not
        --pg_timeout_s. Every rank runs the same steps in lockstep there, so a rank silent that long
        is gone or hung (a dead node holds the others that long); the long timeout stays for the
        compiles and the warmup before, where ranks drift apart, and for a GPU run without the
        warmup, which compiles in the loop."""
        hp = self.hp
        if self.world_size == 1 or hp.loop_timeout_s >= hp.pg_timeout_s:
            return
        if self.compiling and not hp.warmup:
            self.log(f"note: --warmup=false compiles in the timed loop: its collectives keep "
                     f"--pg_timeout_s={hp.pg_timeout_s}", console=False)
            return
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)   # private: guarded
        if set_timeout is None:
            self.log(f"note: this torch cannot change a process group's timeout: the timed loop "
                     f"keeps --pg_timeout_s={hp.pg_timeout_s}", console=False)
            return
        import datetime
        set_timeout(datetime.timedelta(seconds=hp.loop_timeout_s))
        self.short_timeout = True
        self.log(f"the timed loop's collectives time out after --loop_timeout_s="
                 f"{hp.loop_timeout_s}", console=False)

    @contextlib.contextmanager
    def long_timeout(self) -> Iterator[None]:
        """Around a state save inside the timed loop: ranks write at their disks' pace (a slow or
        shared file system can take minutes), so the collectives wait --pg_timeout_s until every
        rank has saved, then the loop's short timeout is back."""
        if not self.short_timeout:
            yield
            return
        import datetime
        set_timeout = dist.distributed_c10d._set_pg_timeout
        set_timeout(datetime.timedelta(seconds=self.hp.pg_timeout_s))
        yield
        dist.barrier()                  # every rank has saved, under the long timeout
        set_timeout(datetime.timedelta(seconds=self.hp.loop_timeout_s))

    def agreed_signal(self) -> int:
        """The signal that asked for a stop on any rank (0 if none), the same on every rank: with
        several processes one tiny all-reduce, waited for (the final validation's check)."""
        return self.votes.now(self.stops.requested or self.stops.launcher_gone())

    def vote_to_stop(self) -> int:
        """At a step boundary: the signal that asked for a stop on any rank by the boundary before
        this one (0 if none), the same on every rank, without waiting for the device (StopVote)."""
        return self.votes.at_boundary(self.stops.requested or self.stops.launcher_gone())

    def log_table(self, lines: Sequence[str]) -> None:
        """A table into the log file, its last (summary) line on the console too."""
        for line in lines[:-1]:
            self.log(line, console=False)
        if lines:
            self.log(lines[-1])

    def log_step(self, done: int, total: int, train_ms: float, tokens_done: int,
                 tokens_total: int, train_loss: float | None = None,
                 untimed_left_s: float = 0.0) -> None:
        """A step line: the log file keeps the fixed format, rank 0's console adds progress (the
        ETA counts untimed_left_s, the validations still to come)."""
        line = f"step:{done}/{total} train_time:{train_ms:.0f}ms step_avg:{train_ms / done:.2f}ms"
        if train_loss is not None:
            line += f" train_loss:{train_loss:.6f}"
        self.log(line, console=False)
        if self.rank == 0:
            to_console(line + progress_note(done, total, train_ms, tokens_done, tokens_total,
                                            untimed_left_s))

    def finish(self, val_loss: float, train_ms: float) -> dict[str, Any]:
        """Peak memory and the result line; the run's summary."""
        peak_mib = (torch.cuda.max_memory_allocated(self.device) // 2**20
                    if self.device.type == "cuda" else None)
        if peak_mib is not None:
            self.log(f"peak memory allocated: {peak_mib} MiB reserved: "
                     f"{torch.cuda.max_memory_reserved(self.device) // 2**20} MiB")
        self.log(result_line(val_loss, self.hp.val_loss_target, train_ms, self.hp.num_iterations,
                             peak_mib, self.log.path))
        return {"val_loss": val_loss, "train_time_ms": train_ms, "run_id": self.run_id,
                "log": str(self.log.path)}

    def since_start_ms(self) -> float:
        return 1000 * (time.perf_counter() - self.t_process)

    @contextlib.contextmanager
    def failures_logged(self) -> Iterator[None]:
        """The log ends with the error line main() prints (and a bug's traceback); the log is closed
        either way."""
        refused = failed = False
        try:
            yield
        except BaseException as e:
            failed = True
            if not isinstance(e, SystemExit):
                end = ending(e, self.rank, self.world_size, self.stops)
                # refused by its checks: the console's error line says all the log would, and a
                # kept log would take the run id from the corrected command
                refused = not self.accepted and end.code in (EXIT_CONFIG, EXIT_DATA)
                if end.code in (EXIT_BUG, EXIT_PEER, EXIT_DEVICE):
                    import traceback
                    self.log(traceback.format_exc().rstrip(), console=False)
                with contextlib.suppress(ConfigError):     # a log that cannot take the line
                    self.log(f"error: {end.message}", console=False)
            self.stops.defer = False
            raise
        finally:
            self.log.close(remove=refused)
            if failed and self.made_folder is not None:
                remove_if_empty(self.made_folder)


def open_run(hp: Any, stops: StopSignals, code: Sequence[Path] = ()) -> Run:
    """Join the process group, check that every rank runs the same code (the files in `code`, and
    this one) with the same options, read a checkpoint to resume, agree on a run id, create the
    log. The options were checked by the script."""
    t_process = time.perf_counter()
    rank, world_size, local_rank, device = setup_distributed(hp)
    stops.announce = rank == 0
    digests = None                      # rank 0's note on a slow shard comparison, for the log
    if world_size > 1:
        digests = check_same_everywhere(hp, [*code, Path(__file__)], world_size, device)
    script = Path(code[0]).name if code else "train_gpt.py"
    resumed = load_resume(hp, rank, world_size, script) if hp.resume else None
    run_id = hp.run_id or default_run_id(hp.log_dir, resumed)
    host0, log0 = socket.gethostname(), os.path.abspath(log_file(hp, run_id))
    if world_size > 1:                  # one name for every rank's checkpoints and traces, and
                                        # where rank 0 and its log are, for the other nodes
        shared = [run_id, host0, log0]
        dist.broadcast_object_list(shared, 0)
        run_id, host0, log0 = shared
    node_note = None                    # each node says once where it is, by its first process
    if local_rank == 0:
        node_note = node_line(socket.gethostname(), rank, local_world_size(world_size), world_size,
                              host0, log0)
        if node_note is not None and rank != 0:
            to_console(node_note)       # rank 0's goes to the log's head (log_start)
    folder = Path(expand_path(hp.log_dir)) / run_id
    made = folder if not folder.exists() else None
    log_path = prepare_output(hp, run_id, rank)
    if world_size > 1:
        dist.barrier()                  # every rank has checked that the log
                                        # does not exist before rank 0 makes it
    log = RunLogger(log_path if rank == 0 else None)
    return Run(hp, rank, world_size, device, run_id, log, stops, t_process, resumed,
               made_folder=made, node_note=node_note if rank == 0 else None,
               digests_note=digests if rank == 0 else None)


DIGEST_CACHE_FORMAT = "nanogpt shard sha256 1"    # a digest cache file's first line
DIGEST_SETTLE_S = 2.0           # a shard changed less than this before its hash began is hashed but
                                # not cached: a change within the same clock tick would keep its key


def digest_cache(path: str) -> Path:
    """Where a shard's contents digest is cached: .<name>.sha256 beside it, hidden, so that no shard
    glob (fineweb_train_*) matches it."""
    return Path(path).with_name(f".{Path(path).name}.sha256")


def _stat_key(st: os.stat_result) -> str:
    return f"{st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} {st.st_ino}"


def shard_digest(path: str) -> tuple[int, str, str, str]:
    """A shard's size, its header's digest (16 hex digits), the sha256 of the whole file (what
    `sha256sum` prints) and how that was had: "cached", "hashed" (and now cached) or "not cached"
    (hashed; the folder is read-only, or the shard changed just before or while it was read). The
    cache (digest_cache) is trusted only while the shard's size, mtime, ctime and inode are those it
    was written with: any rewrite changes ctime, which nothing sets back (cp -p, rsync -t and touch
    restore mtime only), a rename-over also the inode. Hashing takes 0.2-0.3 s per 200 MB shard."""
    import hashlib
    with open(path, "rb") as f:
        before = os.fstat(f.fileno())
        header = f.read(1024)
        head = hashlib.sha256(header).hexdigest()[:16]
        key = _stat_key(before)
        with contextlib.suppress(OSError, ValueError):
            form, saved = digest_cache(path).read_text().split("\n")[:2]
            fields = saved.rsplit(" ", 1)
            if form == DIGEST_CACHE_FORMAT and fields[0] == key and re.fullmatch("[0-9a-f]{64}",
                                                                                 fields[1]):
                return before.st_size, head, fields[1], "cached"
        started = time.time_ns()
        whole = hashlib.sha256(header)
        view = memoryview(bytearray(1 << 20))
        while n := f.readinto(view):
            whole.update(view[:n])      # hashlib lets go of the GIL: threads hash shards at once
        after = os.fstat(f.fileno())
    digest, how = whole.hexdigest(), "not cached"
    if _stat_key(after) == key and before.st_ctime_ns < started - DIGEST_SETTLE_S * 1e9:
        with contextlib.suppress(OSError):         # a read-only or full folder: compare, uncached
            atomic_write(digest_cache(path), f"{DIGEST_CACHE_FORMAT}\n{key} {digest}\n".encode())
            how = "hashed"
    return before.st_size, head, digest, how


def _digest_or_error(path: str) -> tuple[int, str, str, str] | OSError:
    try:
        return shard_digest(path)
    except OSError as e:
        return e


def node_facts(hp: Any, files: Sequence[Path], device: torch.device,
               world_size: int = 1) -> dict[str, Any]:
    """What must be the same on every node, as this rank sees it: the code's digest, the resolved
    options, the versions and GPU model, and every shard's name, size, header and contents digest
    (shard_digest: cached beside the shard, or hashed in threads, this node's cores shared among its
    processes), or the error its glob met. Every rank plans all ranks' document cursors from its own
    copy of the shards, so a node with other shards, even other tokens in one, would silently
    overlap or skip documents or train on other data. "digests" says how long the shards took."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor
    import triton
    env = {"torch": torch.__version__, "triton": triton.__version__,
           "CUDA": str(torch.version.cuda), "GPU": "CPU"}
    if device.type == "cuda":
        env["GPU"] = torch.cuda.get_device_properties(device).name
        env["NCCL"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    found: dict[str, list[str] | str] = {}
    for kind, pattern in (("train", hp.train_files), ("val", hp.val_files)):
        try:
            found[kind] = resolve_shards(pattern, kind)
        except DataError as e:
            found[kind] = f"error: {e}"
    paths = sorted({p for listing in found.values() if isinstance(listing, list) for p in listing})
    t0 = time.perf_counter()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, min(len(paths), (cores or 1) // max(1, local_world_size(world_size))))
    with ThreadPoolExecutor(threads) as pool:
        digests = dict(zip(paths, pool.map(_digest_or_error, paths)))
    shards: dict[str, Any] = {}
    for kind, listing in found.items():
        failed = [] if isinstance(listing, str) else [digests[p] for p in listing
                                                       if isinstance(digests[p], OSError)]
        shards[kind] = (listing if isinstance(listing, str) else f"error: {failed[0]}" if failed
                        else [(os.path.basename(p), *digests[p][:3]) for p in listing])
    hows = [d[3] for d in digests.values() if not isinstance(d, OSError)]
    return {"host": socket.gethostname(),
            "code": hashlib.sha256(b"".join(Path(f).read_bytes() for f in files)).hexdigest(),
            "options": {f.name: repr(getattr(hp, f.name)) for f in dataclasses.fields(hp)},
            "env": env, "shards": shards,
            "digests": {"seconds": time.perf_counter() - t0, "shards": len(paths),
                        **{how: hows.count(how) for how in ("cached", "hashed", "not cached")}}}


def first_difference(every: Sequence[dict[str, Any]], names: str) -> Exception | None:
    """The error for the first rank whose facts (node_facts) differ from rank 0's, naming the rank,
    its host and what differs; None when every rank matches. A data problem that every rank meets
    alike is left to the data checks, which name it once."""
    first = every[0]
    for r, mine in enumerate(every):
        who = f"rank {r} (host {mine['host']})"
        if mine["code"] != first["code"]:
            return ConfigError(f"{who} runs other code than rank 0 ({names} differ): copy the same "
                               "files to every node")
        diffs = [f"--{k}={mine['options'].get(k)} (rank 0: {v})"
                 for k, v in first["options"].items() if mine["options"].get(k) != v]
        if diffs:
            return ConfigError(f"{who} was started with other options than rank 0: "
                               f"{'; '.join(diffs)}. Start every node with the same command")
        diffs = [f"{k} {mine['env'].get(k)} (rank 0: {v})" for k, v in first["env"].items()
                 if mine["env"].get(k) != v]
        if diffs:
            return ConfigError(f"{who} has another environment than rank 0: {'; '.join(diffs)}. "
                               "Install the same versions on every node (pip install -r "
                               "requirements.txt) and use one GPU model")
        for kind, option in (("train", "--train_files"), ("val", "--val_files")):
            ours, theirs = mine["shards"][kind], first["shards"][kind]
            if ours == theirs:
                continue
            fix = (f"give every node the same shards ({option}; data/cached_fineweb10B.py fetches "
                   "the same files everywhere)")
            if isinstance(ours, str):
                return DataError(f"{who} cannot read its {kind} shards, rank 0 can: "
                                 f"{ours.removeprefix('error: ')}")
            if isinstance(theirs, str):
                return DataError(f"rank 0 (host {first['host']}) cannot read its {kind} shards, "
                                 f"{who} can: {theirs.removeprefix('error: ')}")
            named, named0 = {x[0]: x for x in ours}, {x[0]: x for x in theirs}
            if named.keys() != named0.keys():
                only = sorted(named.keys() - named0.keys())
                lacks = sorted(named0.keys() - named.keys())
                what = (f"has {only[0]}, which rank 0 lacks" if only else
                        f"lacks {lacks[0]}, which rank 0 has")
                return DataError(f"{who} {what} ({len(ours)} {kind} shards against rank 0's "
                                 f"{len(theirs)}): {fix}")
            name = next(n for n in sorted(named) if named[n] != named0[n])
            (_, size, head, *whole), (_, size0, head0, *whole0) = named[name], named0[name]
            if size != size0:
                what = f"{size:,} bytes (rank 0: {size0:,})"
            elif head != head0:
                what = "another header than rank 0's"
            else:
                what = (f"other tokens than rank 0's at the same size and header (sha256 "
                        f"{whole[0][:16]}..., rank 0: {whole0[0][:16]}...)")
                fix = (f"give every node the same shards ({option}): find the wrong copy with "
                       f"`sha256sum {name}`, delete it and fetch it again "
                       "(data/cached_fineweb10B.py keeps a file whose size and header are valid)")
            return DataError(f"{who} has another {name}: {what}: {fix}")
    return None


def check_same_everywhere(hp: Any, files: Sequence[Path], world_size: int,
                          device: torch.device) -> str | None:
    """ConfigError or DataError, on every rank, when a rank (a node set up differently) runs other
    code, was started with other options, has other versions or GPUs, or has other shards than
    rank 0, down to one token: node_facts gathered from every rank and compared. Returns the note
    for rank 0's log when the shards' digests took the slowest rank over a second (digests_note)."""
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, node_facts(hp, files, device, world_size))
    problem = first_difference(every, ", ".join(Path(f).name for f in files))
    if problem is not None:
        raise problem
    return digests_note(every)


def digests_note(every: Sequence[dict[str, Any]]) -> str | None:
    """How long the slowest rank took to digest its shards' contents, if over a second, and whether
    the next start will be quick (the digests cached beside the shards) or pay again."""
    times = [facts.get("digests", {}).get("seconds", 0.0) for facts in every]
    slowest = max(range(len(every)), key=times.__getitem__)
    if times[slowest] <= 1.0:
        return None
    d = every[slowest]["digests"]
    again = (f"{d['not cached']} could not be cached (a read-only folder, or changed just now), so "
             "the next start hashes them again" if d["not cached"] else
             "the digests are cached beside the shards (.<name>.sha256), so the next start reads "
             "those")
    return (f"note: comparing the shards' contents across ranks took {times[slowest]:.1f} s "
            f"(rank {slowest}, host {every[slowest]['host']}: {d['shards']} shards, "
            f"{d['hashed'] + d['not cached']} hashed); {again}")


class FiniteWatch:
    """The NaN guard without a sync per step: the first step whose loss is not finite is remembered
    on the device (record) and read every `every` steps and at the last (raise_if_bad). With
    states saved it also keeps the last good state: the state at the previous check becomes good
    once the steps after it gave finite losses (passed), and is what a divergence saves."""

    def __init__(self, every: int, total: int, device: torch.device,
                 first_state: dict | None = None):
        self.every, self.total = every, total
        self.first = torch.full((), -1, dtype=torch.int64, device=device)
        self.pending, self.last_good = first_state, None

    def record(self, done: int, loss: Tensor) -> None:
        if self.every:
            bad_now = (self.first < 0) & ~torch.isfinite(loss)
            self.first.copy_(torch.where(bad_now, done - 1, self.first))

    def due(self, done: int) -> bool:
        return self.every > 0 and (done % self.every == 0 or done == self.total)

    def first_bad(self) -> int | None:
        """The first bad step, or None (waits for the GPU)."""
        bad = int(self.first.item())
        return bad if bad >= 0 else None

    def raise_if_bad(self, checkpointer: "Checkpointer") -> None:
        """TrainingDiverged naming the first bad step, after saving the last good state if any."""
        if (bad := self.first_bad()) is None:
            return
        if self.last_good is not None:
            checkpointer.save(self.last_good)
        raise diverged(f"the training loss became NaN or infinite at step {bad}",
                       self.last_good["step"] if self.last_good is not None else None)

    def passed(self, state: dict | None) -> None:
        """The losses up to now are finite: the previous check's state is good; `state` (now's)
        waits for the next check."""
        self.last_good, self.pending = self.pending, state


def diverged(what: str, last_good_step: int | None) -> TrainingDiverged:
    return TrainingDiverged(
        f"{what}" + (f"; the last good state (step {last_good_step}) was saved"
                     if last_good_step is not None else "")
        + ": lower the learning rates (--adam_lr, --muon_lr) or check the data")


def stopped(signum: int, where: str, agreed: bool = True) -> Interrupted:
    """The stop a signal asked for, taken `where` ("after step 12 of 100; the state ..."): at a
    point every rank agreed on, unless `agreed` is False (a signal that stopped this rank at
    once)."""
    import signal
    return Interrupted(signum, f"stopped by {signal.Signals(signum).name} {where}", agreed)


class StepProfiler:
    """--profile_steps=a:b,...: torch.profiler over steps a..b-1, one chrome trace per range in the
    log folder. A range ends with a sync (the trace then holds its GPU work)."""

    def __init__(self, opts: RunOptions, run: Run):
        self.ranges = dict(tuple(int(x) for x in r.split(":"))
                           for r in opts.profile_steps.split(",") if r)
        self.prefix = Path(expand_path(opts.log_dir)) / f"{run.run_id}_rank{run.rank}"
        self.run = run
        self.active, self.start, self.end = None, -1, -1

    def before_step(self, step: int) -> None:
        if step in self.ranges:
            self.active, self.start, self.end = torch.profiler.profile(), step, self.ranges[step]
            self.active.__enter__()

    def after_step(self, done: int) -> None:
        if self.active is not None and done == self.end:
            self.run.sync()
            self.active.__exit__(None, None, None)
            trace = Path(f"{self.prefix}_steps{self.start}-{done - 1}_trace.json")
            self.active.export_chrome_trace(str(trace))
            self.active = None
            self.run.log(f"profile of steps {self.start}..{done - 1} written to {trace}")


def _debug_requested(argv: Sequence[str]) -> bool:
    """--debug / --debug=true, read before parsing (so a parse error can show its traceback too)."""
    return any(a == "--debug"
               or (a.startswith("--debug=") and a[8:].lower() in ("1", "true", "yes", "on"))
               for a in argv)


def dry_run_checks(hp: Any, rank: int, world_size: int, device: torch.device,
                   available: Sequence[str], chosen: str, script: str = "train_gpt.py",
                   notes: Sequence[str] = (), expected_state: dict | None = None) -> None:
    """The run-control half of --dry_run's checklist, printed on rank 0: the process placement, the
    options a resume takes from its state (notes: resume_options' line), the environment and
    attention backends (available, chosen: the script's), the output folder and a resume (its
    tensors against expected_state, the script's model and optimizer on the meta device:
    check_state_layout). The first failing check raises, as in a real run. script: the file the
    trainer runs as."""
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"dry run: the checks before compiling, for {world_size} process(es)")
    say(f"  ok  options: valid for {world_size} process(es) x {hp.batch_slices // world_size} "
        "accumulation steps")
    for line in notes:
        say(f"  ok  {line}")
    say(f"  ok  environment: {short_environment(device)}; attention backends "
        f"{', '.join(available)} (--attn_backend={hp.attn_backend} runs {chosen})")
    saved = load_resume(hp, rank, world_size, script) if hp.resume else None
    for line in saved["notes"] if saved is not None else ():
        say(f"  !!  {line}")
    run_id = hp.run_id or (default_run_id(hp.log_dir, saved) if saved else "<a new run id>")
    if hp.run_id:
        folder = Path(expand_path(hp.log_dir)) / run_id
        made = not folder.exists()
        prepare_output(hp, run_id, rank)
        if made:                    # the dry run writes nothing: the checkpoint folder goes again
            remove_if_empty(folder)
    else:
        prepare_output(dataclasses.replace(hp, save_checkpoint=False, checkpoint_every=0),
                       f".dry_run_{os.getpid()}", rank)
    say(f"  ok  output: {hp.log_dir}/ is writable; the log would be {hp.log_dir}/{run_id}.txt")
    if saved is not None:
        check_resume(saved, hp, run_facts(world_size, device, chosen,
                                          resolve_shards(hp.train_files, "train")), script)
        if expected_state is not None:
            check_state_layout(saved, expected_state, hp, script)
        say(f"  ok  resume: {saved['path']} continues after step {saved['step']} of "
            f"{hp.num_iterations}; the math options match")


def dry_run_notes(rank: int, notes: Sequence[str]) -> None:
    """The rest of the checklist (the script's data and memory notes) and its last line."""
    if rank == 0:
        for note in notes:
            print(f"  {'!!' if note.startswith('warning') else 'ok'}  {note}")
        print("dry run passed: nothing was built, compiled or trained")


def asks_for_help(argv: Sequence[str]) -> bool:
    return any(a in ("-h", "--help", "help") for a in argv)


@dataclass
class Outcome:
    """What command_line gives the script: the signal handlers, and the exit code it sets."""
    stops: StopSignals
    code: int = 0


@contextlib.contextmanager
def same_on_every_rank() -> Iterator[None]:
    """Around the option checks, which every process torchrun starts meets alike before the process
    group exists: their error is reported by rank 0 alone (not once per process). Checks that can
    fail on some ranks only (GPUs per node, the launch variables) stay outside: each rank says its
    own."""
    try:
        yield
    except (ConfigError, DataError) as e:
        e.same_on_every_rank = True      # type: ignore[attr-defined]
        raise


@contextlib.contextmanager
def command_line(argv: Sequence[str]) -> Iterator[Outcome]:
    """Around the script's main: signal handlers for the whole process, and for every failure one
    `error: ...` line and an exit code in outcome.code (see EXIT_* above) instead of a traceback
    (--debug prints it too)."""
    os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    outcome = Outcome(StopSignals())
    outcome.stops.install()
    try:
        yield outcome
    except Exception as e:
        outcome.code = _report_failure(e, _debug_requested(argv), outcome.stops)
    except KeyboardInterrupt as e:   # a Ctrl-C that arrived before the handler was installed
        outcome.code = _report_failure(e, _debug_requested(argv), outcome.stops)
    finally:
        if outcome.code:
            _tell_the_launcher(outcome.code)
        outcome.stops.uninstall()
        if dist.is_available() and dist.is_initialized():
            if not outcome.code:        # a clean end, for a rank that waits on the reports
                share_failure(dist.distributed_c10d._get_default_store(), dist.get_rank(),
                              dist.get_world_size(), 0, "done")
            dist.destroy_process_group()


# ---- naming the rank at fault -------------------------------------------------------------------
# Every rank that ends leaves a report in the process group's store, report/<rank>: its rank, host,
# pid, exit code, kind (end_kind) and line; the first rank that fails on its own also sets
# first_failure. A rank stopped by another waits up to REPORT_GRACE_S for the reports and names
# the ranks that left none, by the host and pid each wrote to started/<rank> when the group
# formed. Reports at the end rather than a heartbeat per rank: no thread and no store traffic
# while the run is healthy, and no beat that a long compile could delay into a false death; a
# rank only slow to notice is told from a dead one by its pid where it shares this host.
REPORT_GRACE_S = 5.0     # the wait for the others' reports: well inside the 30 s torchrun
                         # leaves between its SIGTERM and its SIGKILL
STORE_TIMEOUT_S = 5      # a store call gives up after this (its node may be gone)
SILENT = "ended without a word (killed: OOM killer, a signal, a segfault, or its node went down)"


def announce_rank(store: Any, rank: int) -> None:
    """started/<rank>: this rank's host and pid, for the others to name it by should it end
    without a word."""
    import json
    store.set(f"started/{rank}", json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))


def end_kind(code: int) -> str:
    """How a rank that exits with `code` ended: done, own (its own failure), peer (another's
    failure stopped it) or signal."""
    return ("done" if code == 0 else "peer" if code == EXIT_PEER else "signal" if code >= 128
            else "own")


@contextlib.contextmanager
def _native_stderr_quiet() -> Iterator[None]:
    """TCPStore prints a C++ stack dump on stderr (fd 2) for a connection that broke; this rank's
    line says it in one sentence."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _ended(pid: int) -> bool:
    """The process is gone, or is a zombie its parent has not reaped yet."""
    if not _alive(pid):
        return True
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return False


def store_unreachable(e: BaseException) -> str:
    """The sentence for a store that cannot be reached: where it was and what that means."""
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return (f"The run's store at MASTER_ADDR:MASTER_PORT={where} cannot be reached "
            f"({type(e).__name__}: {_first_line(e)}), so no rank's report can be read: the node "
            "of MASTER_ADDR went down, or the process holding the store there ended (torchrun's "
            "agent; rank 0 without torchrun): look there first")


def share_failure(store: Any, rank: int, world_size: int, code: int, message: str,
                  wait: bool = False, grace_s: float = REPORT_GRACE_S,
                  ended: Any = _ended) -> tuple[int, str, float | None]:
    """Tell the other ranks through the process group's store how this one ended (code, message)
    and, with `wait`, learn how they did: (exit code, line, the time of the failure it names or
    None). A rank that failed on its own records its line (the first to do so is the first
    failure), never a rank stopped by a signal. One that waits (stopped by another, or by a signal
    at once) waits up to grace_s for every rank's report, or the first failure, and adds who
    failed first (name_the_cause); it then exits 4, as stopped by another: such a signal is
    torchrun passing a failure on. A store that cannot be reached is named."""
    import json
    kind = end_kind(code)
    me = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "code": code,
          "kind": kind, "line": message, "time": time.time()}

    def read(key: str) -> dict | None:
        return json.loads(store.get(key)) if store.check([key]) else None

    try:
        import datetime
        with _native_stderr_quiet():
            store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
            store.set(f"report/{rank}", json.dumps(me))
            store.add("reported", 1)
            if kind == "own" and store.add("failures", 1) == 1:
                store.set("first_failure", json.dumps(me))
            if kind in ("own", "done") or not wait:
                return code, message, None
            started = {r: read(f"started/{r}") for r in range(world_size)}
    except Exception as e:      # noqa: BLE001 (the store's node, or its process, is gone)
        if kind in ("own", "done"):
            return code, message, None
        return code, f"{message}. {store_unreachable(e)}", None
    # The reports are read as they come: the store may go while this rank waits (its agent ends
    # once its node's ranks have), and what was read by then still names the cause.
    first, reports, lost = None, {r: None for r in range(world_size)}, None
    deadline, seen = time.monotonic() + grace_s, -1
    try:
        with _native_stderr_quiet():
            while True:
                if (count := store.add("reported", 0)) != seen:
                    seen = count
                    reports.update({r: read(f"report/{r}") for r, x in reports.items() if x is None})
                first = read("first_failure")
                if first is not None or count >= world_size or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
    except Exception as e:      # noqa: BLE001
        lost = e
    code, line, when = name_the_cause(code, message, me, first, reports, started, ended)
    if lost is not None and first is None:
        line = f"{line}. {store_unreachable(lost)}"
    return code, line, when


def _ranks(ranks: Sequence[int], started: dict[int, dict | None]) -> str:
    """rank 3 (host, pid 123), ... for at most 8 ranks."""
    named = [f"rank {r} ({started[r]['host']}, pid {started[r]['pid']})" if started.get(r)
             else f"rank {r} (host unknown)" for r in ranks[:8]]
    return ", ".join(named) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def name_the_cause(code: int, message: str, me: dict, first: dict | None,
                   reports: dict[int, dict | None], started: dict[int, dict | None],
                   ended: Any) -> tuple[int, str, float | None]:
    """(exit code, line, the named failure's time) for a rank stopped by another or by a signal,
    from the reports in the store: the first failure a rank recorded; else the ranks that left no
    report: those known dead (on this host, their pid ended: ended(pid)), else the others (on other
    hosts, or alive here: they may hang); else a signal another rank reported. A rank stopped by a
    signal stays 128+N unless a failure or a dead rank is found: the signal was then torchrun's."""
    if first is not None:
        return EXIT_PEER, (f"{message}. The first failure: rank {first['rank']} ({first['host']}): "
                           f"{first['line']}"), first["time"]
    silent = [r for r, report in reports.items() if report is None]
    here = [r for r in silent if started.get(r) and started[r]["host"] == me["host"]]
    dead = [r for r in here if ended(started[r]["pid"])]
    if dead:
        return EXIT_PEER, f"{message}. The first failure: {_ranks(dead, started)} {SILENT}", None
    if me["kind"] == "signal":   # a rank slow to take the user's signal (a compile) is no failure
        return code, message, None
    alive = [r for r in silent if r in here]
    elsewhere = [r for r in silent if r not in here]
    if silent:
        said = []
        if elsewhere:
            said.append(f"{_ranks(elsewhere, started)} sent no report: {SILENT}, or hangs")
        if alive:
            said.append(f"{_ranks(alive, started)} is alive but sent no report: it hangs, or has "
                        "not noticed yet")
        return EXIT_PEER, (f"{message}. No rank reported a failure of its own; "
                           f"{'; '.join(said)}"), None
    signalled = sorted((report for report in reports.values()
                        if report is not None and report["kind"] == "signal"),
                       key=lambda report: report["time"])
    if signalled:
        earliest = signalled[0]
        return EXIT_PEER, (f"{message}. The first to stop: rank {earliest['rank']} "
                           f"({earliest['host']}): {earliest['line']}"), earliest["time"]
    return EXIT_PEER, (f"{message}. No rank reported a failure of its own: the network between "
                       "the ranks failed, or a failing rank could not reach the store"), None


@dataclass
class Ending:
    """How this process ended: its exit code and line, and what torchrun's error file gets."""
    code: int
    message: str
    stamp: int                   # the time for torchrun (seconds): this rank's failure, or for a
                                 # rank stopped by another later than the failure it names
    rank: int
    world_size: int


def ending(e: BaseException, rank: int, world_size: int, stops: StopSignals) -> Ending:
    """How the exception `e` ends this process: described (describe_failure) and, with several
    ranks, shared with the others once (share_failure). A signal that lands while `e` unwinds
    changes nothing: the ending is found on the exception it interrupted (its __context__)."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(done := getattr(seen, "ending", None), Ending):
            return done
        seen = seen.__context__
    code, message = describe_failure(e, rank, world_size)
    stamp = time.time()
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        wait = code == EXIT_PEER or (code >= 128 and not getattr(signal_cause(e), "agreed", False))
        store = dist.distributed_c10d._get_default_store()
        with stops.held():
            if wait and dist.get_backend() == "gloo":
                # This rank's connections close now, so a rank still waiting on it fails at once
                # and reports too, not after this rank's wait (ranks failing one after another).
                # NCCL's destroy can block on a broken communicator: it stays for the end.
                dist.destroy_process_group()
            code, message, named = share_failure(store, rank, world_size, code, message, wait)
        if end_kind(code) != "own":
            stamp = max(time.time(), named or 0.0) + 1
    done = Ending(code, message, int(stamp), rank, world_size)
    with contextlib.suppress(AttributeError):
        e.ending = done                  # type: ignore[attr-defined]
    return done


def write_error_file(path: str, line: str, stamp: int) -> None:
    """torchrun's error file (TORCHELASTIC_ERROR_FILE, the format of its ErrorHandler), written
    atomically: its closing "Root Cause" names the process whose file has the smallest timestamp,
    so with our line and time it names the rank our line does (a rank stopped by another carries a
    later time than the failure it names; one killed has no file and the time torchrun saw it)."""
    import json
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                       "timestamp": str(stamp)}}}
    with contextlib.suppress(OSError):
        atomic_write(Path(path), json.dumps(data).encode())


def _launched_rank() -> int:
    """This process's rank: the process group's, else the one torchrun gave it (0 without one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return launch_environment()[0]
    except ConfigError:
        return 0


def _report_failure(e: BaseException, debug: bool, stops: StopSignals) -> int:
    distributed = dist.is_available() and dist.is_initialized()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    end = ending(e, rank, world_size, stops)
    rank, world_size = end.rank, end.world_size
    if debug:
        import traceback
        traceback.print_exception(e)
    # Options, data and signals are the same on every rank: rank 0 speaks for all of them, also
    # before the process group exists (the options' checks, a signal torchrun passed to every rank).
    if world_size == 1 and (getattr(e, "same_on_every_rank", False) or end.code >= 128):
        rank = _launched_rank()
    line = f"error: {'' if world_size == 1 else f'rank {rank}: '}{end.message}"
    if rank == 0 or end.code in (EXIT_DIVERGED, EXIT_PEER, EXIT_BUG, EXIT_DEVICE):
        to_console(line, sys.stderr)
    write_error_file(os.environ.get("TORCHELASTIC_ERROR_FILE", ""), line, end.stamp)
    return end.code


def _tell_the_launcher(code: int) -> None:
    """run.sh exits with its ranks' code, not torchrun's 1: it names a folder in RUN_SH_EXIT_DIR,
    where each failing rank leaves its exit code in rank<r>."""
    folder = os.environ.get("RUN_SH_EXIT_DIR")
    if folder:
        with contextlib.suppress(OSError):
            Path(folder, f"rank{_launched_rank()}").write_text(f"{code}\n")
