"""Test helpers: write token shards in the FineWeb format and run the trainer in a subprocess."""
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BOS = 50256
# glibc returns large freed blocks to the OS and page-faults them back on the next step; keeping them cuts the CPU
# tiny preset's step time about 2.5x (measured on the 2-core CI machine).
CPU_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "68719476736",
                  "MALLOC_TOP_PAD_": "1073741824"}


def write_shard(path, tokens, magic=20240520, version=1, claimed=None):
    tokens = np.asarray(tokens, dtype=np.uint16)
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (magic, version, len(tokens) if claimed is None else claimed)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.tobytes())
    return str(path)


def structured_docs(n_tokens, seed, mean_len=200, vocab=300):
    """BOS-started documents of a learnable toy language: each token mostly follows a fixed successor map."""
    rng = np.random.default_rng(seed)
    succ = rng.integers(0, vocab, size=vocab)
    out = np.empty(n_tokens, dtype=np.int64)
    i = 0
    while i < n_tokens:
        n = max(2, int(rng.exponential(mean_len)))
        doc = np.empty(n, dtype=np.int64)
        doc[0] = BOS
        doc[1] = rng.integers(0, vocab)
        noise = rng.random(n) < 0.15
        rand = rng.integers(0, vocab, size=n)
        for j in range(2, n):
            doc[j] = rand[j] if noise[j] else succ[doc[j - 1]]
        take = min(n, n_tokens - i)
        out[i:i + take] = doc[:take]
        i += take
    return out


def make_dataset(directory, train_tokens=400_000, val_tokens=20_000, seed=0, n_train_shards=1, doc_len=200):
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    per = train_tokens // n_train_shards
    for k in range(n_train_shards):
        write_shard(d / f"fineweb_train_{k + 1:06d}.bin", structured_docs(per, seed + 1 + k, doc_len))
    write_shard(d / "fineweb_val_000000.bin", structured_docs(val_tokens, seed, doc_len))
    return str(d / "fineweb_train_*.bin"), str(d / "fineweb_val_*.bin")


# What train_gpt.py runs with: its companions, and data/shards.py, where the shard format it reads is defined
TRAINER_FILES = ("train_gpt.py", "checks.py", "harness.py", "triton_kernels.py", "compile_split.py",
                 "data/__init__.py", "data/shards.py", "data/prefix_table.bin")


def copy_trainer(folder):
    """Copy the trainer's files (TRAINER_FILES) into `folder`, as another node's or an edited copy of the project."""
    for name in TRAINER_FILES:
        (Path(folder) / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, Path(folder) / name)


def run_trainer(args, cwd, timeout=900, env=None, script=None):
    full_env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", **CPU_MALLOC_ENV, **(env or {}))
    return subprocess.run([sys.executable, str(script or ROOT / "train_gpt.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=full_env)


def python_with_gpus(folder, gpus):
    """A PYTHON for run.sh whose GPU count (run.sh's check) says `gpus`, the real Python for everything else: the
    trainer then finds no CUDA and runs on gloo."""
    fake = Path(folder) / "python"
    fake.write_text("#!/usr/bin/env bash\n"
                    f'if [ "$1" = -c ] && [[ "$2" == *device_count* ]]; then echo {gpus}; exit 0; fi\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    return fake


def run_gloo(args, world_size, cwd, timeout=900, rank_args=None, scripts=None, per_node=None, cwds=None):
    """The trainer in world_size processes on gloo, started the way torchrun would (one thread each); rank_args
    {rank: extra options}, scripts {rank: path of its train_gpt.py} and cwds {rank: its working folder} start some
    ranks differently; per_node splits them into nodes of that many (LOCAL_RANK and LOCAL_WORLD_SIZE as torchrun
    sets them), else they are one node."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", RANK=str(rank), LOCAL_RANK=str(rank % (per_node or world_size)),
                   WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   **CPU_MALLOC_ENV)
        if per_node:
            env["LOCAL_WORLD_SIZE"] = str(per_node)
        script = (scripts or {}).get(rank, ROOT / "train_gpt.py")
        procs.append(subprocess.Popen([sys.executable, str(script), *args, *(rank_args or {}).get(rank, [])],
                                      cwd=(cwds or {}).get(rank, cwd), env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results



def float64_comparable(name, one, many, rank, world_size):
    """(one, many, bound): the parts of model-state tensor `name` that a one-process float64 run and rank `rank` of a
    world_size-process run both hold current, and the relative difference float64 rounding allows. The FP8 down
    projection's scales (`fp8_down.*`) are fp32 whatever --dtype says, so the weights' 1e-13 differences can flip a
    last bit, and a rank advances only its own batch slices' activation scales (the rows of owned_slices)."""
    import torch
    import triton_kernels as tk
    assert one.dtype == many.dtype, name
    if not name.startswith("fp8_down."):
        assert one.dtype == torch.float64 or not one.dtype.is_floating_point, (name, one.dtype)
        return one, many, 1e-8
    assert one.dtype == torch.float32, name
    if name == "fp8_down.act_scales":
        rows = tk.owned_slices(rank, world_size, one.shape[0])
        one, many = one[rows], many[rows]
    return one, many, 1e-6
