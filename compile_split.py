"""The compile split: before the warmup, each GPU's processes (its rank and helper processes) compile a
share of the schedule's variants alone and at the same time, so that the warmup loads its graphs from
torch's on-disk caches instead of compiling them one after another.

The training script's warmup loops over own_share, which starts the helpers and yields the
rank's own tasks; a helper is this file run with a task file (`python compile_split.py TASK`),
which loads the script by its path (load_script) to build the rank's model again. The script runs
itself the same way (its __main__ block), so a copy of train_gpt.py under any name compiles its own
graphs and its helpers load that copy. Nothing here changes a number: the graphs are the ones the
rank would compile itself. Nothing happens at import.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

import harness


def script_module_name(path: str | Path) -> str:
    """The module name a training script runs under: its file's stem (train_gpt for train_gpt.py),
    unless a module of that name is already loaded from elsewhere (then prefixed). torch's compile
    caches key graphs by the module names of the model's classes, so a rank and its helpers use
    the same one."""
    path = Path(path).resolve()
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() != path:
        name = f"_script_{name}"
    return name


def load_script(path: str | Path, name: str | None = None) -> ModuleType:
    """The training script at `path` loaded as the module `name` (default: script_module_name),
    its folder first on sys.path so that it imports its own siblings (a copy elsewhere, with its
    triton_kernels.py and the rest beside it, runs those)."""
    path = Path(path).resolve()
    name = name or script_module_name(path)
    if name in sys.modules and Path(sys.modules[name].__file__).resolve() == path:
        return sys.modules[name]
    if str(path.parent) != sys.path[0]:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module          # before running it: pickles and dataclasses look it up
    spec.loader.exec_module(module)
    return module


def split_compile_tasks(variants: Sequence[int], workers: int) -> list[list[tuple[int, str]]]:
    """What each of `workers` processes of one machine compiles alone before the warmup: (variant
    start, "train" or "val") pairs, dealt round-robin, the longer training graphs (forward and
    backward) first. With 4 variants, 4 workers each take both graphs of one variant; 8 workers one
    graph each. Worker w runs on GPU w % ranks: the ranks themselves come first and take the
    training graphs, their helpers the rest. variants: the first step of each compiled variant."""
    tasks = [(s, "train") for s in variants] + [(s, "val") for s in variants]
    return [tasks[w::workers] for w in range(workers)]


def split_processes_per_gpu(compile_helpers: int, num_variants: int, ranks: int,
                            cache_loaded: bool) -> int:
    """How many processes compile on each GPU in the split: its rank and --compile_helpers
    helpers. Auto: one variant (its two graphs) per process, at most 4 per GPU (1 GPU: 4; 2 GPUs:
    2; 4 or 8 GPUs: 1, the ranks alone), and no helpers when the compile cache file was loaded:
    the caches hold every graph, and a helper would only load graphs that its rank loads again."""
    if compile_helpers >= 0:
        return 1 + compile_helpers
    if cache_loaded:
        return 1
    return max(1, min(4, -(-num_variants // ranks)))


def own_share(run: harness.Run, variants: Sequence[int], compile_log: harness.CompileLog,
              t0: float, helper_task: dict[str, Any], model: nn.Module) -> Iterator[tuple[int, str]]:
    """The compile split, as a loop the script runs: yields this rank's own (variant start, phase)
    tasks, each to compile alone, while its helpers compile theirs. Each GPU's processes (its rank
    and the rank's helpers) compile their share of the variants (split_compile_tasks) alone and at
    the same time; torch writes each graph to its on-disk caches, which every process of a machine
    shares (the same code on cuda:0 everywhere, isolate_gpu), so the warmup that follows loads
    instead of compiling. Compiling is mostly single-threaded Python, so even one GPU gains from
    several processes; they take turns to run (GpuTurns), each turn given back with `model`'s
    gradients dropped. helper_task: what a helper needs to build the rank's model (CompileHelper).
    Yields nothing unless compiling with --compile_split and more than one process per machine
    would compile. The caller resets its schedule state afterwards."""
    import tempfile
    hp = run.hp
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", run.world_size))   # GPUs of this machine
    per_gpu = split_processes_per_gpu(hp.compile_helpers, len(variants), ranks, run.cache_loaded)
    if not (run.compiling and hp.compile_split and ranks * per_gpu > 1):
        return
    shares = split_compile_tasks(variants, ranks * per_gpu)
    local = run.rank % ranks
    mine, theirs = shares[local], [share for share in shares[local + ranks::ranks] if share]
    run.log(f"warmup: {ranks} rank(s), {per_gpu} process(es) per GPU, compile a share alone "
            f"first (rank 0: {describe_share(mine)}"
            + "".join(f"; helper {i + 1}: {describe_share(sh)}" for i, sh in enumerate(theirs))
            + ")")
    with tempfile.TemporaryDirectory(prefix="compile_split_") as folder:
        turns = GpuTurns(Path(folder) / "gpu.lock", run.device)
        helpers = [CompileHelper(helper_task, share, Path(folder) / f"helper{i + 1}", turns.path)
                   for i, share in enumerate(theirs)]
        try:
            with turns.taken_after_compiling():
                for step, phase in mine:
                    with compile_log.during(step, f"{phase}*"):
                        yield step, phase
                    turns.give(model)
            for i, helper in enumerate(helpers):
                run.log(f"  helper {i + 1}: {helper.wait()}")
        finally:
            for helper in helpers:
                helper.stop()
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
    split needs one process's memory for a training micro-batch (tens of GiB at the record's
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


class CompileHelper:
    """A process beside a rank that compiles a share of the split on the rank's GPU: this file run
    with a task file (main). It loads the rank's script by path under the rank's module name
    (task["script"], task["module"]): torch's cache keys hold the module names of the model's
    classes, so graphs compiled under another name would not serve the rank. The rest of the task
    is what builds the rank's model and data: hp, device, attn_backend, rank, world_size,
    train_files, val_files. A helper that fails costs nothing but time: the warmup compiles
    whatever is not in the caches."""

    def __init__(self, task: dict[str, Any], share: list[tuple[int, str]], stem: Path, lock: Path,
                 compile: bool = True):
        import pickle
        import subprocess
        self.task, self.result, self.output = (stem.with_suffix(".task"),
                                               stem.with_suffix(".result"),
                                               stem.with_suffix(".out"))
        # The script's own objects (hp) unpickle only once the script is loaded: they go as a
        # payload inside the task, which names the script in plain values.
        payload = pickle.dumps(dict(task, share=share, compile=compile, lock=str(lock)))
        self.task.write_bytes(pickle.dumps(dict(script=str(task["script"]), module=task["module"],
                                                result=str(self.result), payload=payload)))
        with open(self.output, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), str(self.task)], stdout=out,
                stderr=subprocess.STDOUT)

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


def main(task_path: str) -> int:
    """A CompileHelper's process: the rank's script loaded by path, its model built again on the
    rank's GPU with the same compiler settings, its share (task["share"]) run through the script
    Trainer's compile_alone (so its graphs are exactly the rank's), the GPU turn given back after
    each; {seconds, peak_bytes} or {error} written to the result file. No optimizer and no process
    group: compile_alone needs neither."""
    import pickle
    t0 = time.perf_counter()
    exit_with_parent()
    outer = pickle.loads(Path(task_path).read_bytes())
    try:
        script = load_script(outer["script"], outer["module"])
        task = pickle.loads(outer["payload"])
        device = torch.device(task["device"])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        turns = GpuTurns(Path(task["lock"]), device)
        with turns.taken_after_compiling():
            hp = task["hp"]
            model = script.build_model(hp, device, task["attn_backend"])
            compiled = script.compile_model(model) if task["compile"] else model
            trainer = script.Trainer(hp, model, compiled, None, device, task["rank"],
                                 task["world_size"], task["train_files"], task["val_files"])
            for step, phase in task["share"]:
                trainer.compile_alone(step, phase)
                turns.give(model)
        peak = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0
        result = {"seconds": time.perf_counter() - t0, "peak_bytes": peak}
    except BaseException as e:  # Ctrl-C too: the rank reports it, the helper leaves quietly
        first_line = (str(e).strip().splitlines() or [""])[0]      # the rank's log line is one line
        result = {"error": f"{type(e).__name__}: {first_line}"}
    harness.atomic_write(Path(outer["result"]), pickle.dumps(result))
    return 0 if "seconds" in result else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
