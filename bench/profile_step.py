"""GPU time of a training step by bucket, from the traces `train_gpt.py --profile_steps=a:b,...` writes.

    python3 bench/profile_step.py logs/<run_id>_rank0_steps*_trace.json
    python3 bench/profile_step.py --run --out=DIR [train_gpt options]   # train a short schedule on this node's GPUs
                                                                        # (./run.sh), profiling one odd (Adam) and one
                                                                        # even step late in each batch phase

One table row per trace (the steps it covers, e.g. one step of each batch phase), the time per step in ms:
    matmul      cuBLAS / CUTLASS GEMMs outside the optimizer (bf16 and the FP8 head's scaled matmuls)
    attention   flash / varlen / triton attention kernels
    mlp         the fused linear + ReLU^2 kernel (triton_kernels.py section 3)
    ce          the fused softcapped cross-entropy kernels (section 4)
    qk          the fused q/k RMSNorm + rotary kernels (section 9)
    fp8_quant   kernels inside the FP8 head op other than its matmuls (quantisation, transposes)
    inductor    other kernels of the compiled model (element-wise and reductions fused by inductor)
    opt_compute kernels launched inside the optimizer step (Polar Express, Adam, NorMuon), communication excluded
    opt_comm    communication kernels (NCCL) while no compute kernel runs: the exposed part
    other       any other kernel (copies, memsets, eager ops outside the model)
    idle        time inside the step window when no kernel runs at all
    step        the step window: first kernel start to last kernel end, divided by the number of steps
Buckets are GPU busy time on the compute stream(s); communication that overlaps compute is not counted.
A kernel is attributed to the optimizer or the FP8 op through the CPU range (record_function / op) that launched it.
--owners=REGEX lists, for the kernels and copies whose name matches, the CPU ops around their launch (an autograd node,
an aten op: where in the code a copy comes from); --gaps=N lists the N longest stretches with no kernel running and
the ops that launched the kernel after each.
When the traces of the other ranks lie beside a trace (a multi-GPU run), each step also gets the time each rank reached
its first gradient reduction, after the first rank: the waiting for the slowest rank that opt_comm counts on the others.
The profiler's own CPU cost is part of what a profiled step measures: where the CPU only just keeps ahead of the GPU
(short micro-batches), the idle time and the ranks' spread are larger than in a run without it.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

BUCKETS = ("matmul", "attention", "mlp", "ce", "qk", "fp8_quant", "inductor", "opt_compute", "opt_comm", "other",
           "idle")
MATMUL = re.compile(r"gemm|nvjet|cutlass|xmma|cublas|sm90_|splitk|scaled_mm", re.I)
ATTENTION = re.compile(r"flash|fmha|attn_|attention", re.I)   # checked first: flash kernels carry cutlass types
COMM = re.compile(r"nccl", re.I)


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def subtract(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of the union of `intervals` not covered by the union of `cover`."""
    return union_length(intervals + cover) - union_length(cover)


def enclosing(ranges: list[tuple[float, float, str]], t: float) -> list[str]:
    return [name for a, b, name in ranges if a <= t <= b]


def analyse(path: str) -> dict[str, float]:
    trace = json.loads(Path(path).read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    # cudaLaunchKernel (runtime) for torch's kernels, cuLaunchKernel (driver) for Triton's
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "args" in e and "correlation" in e["args"]}
    # CPU ranges that own kernels: the optimizer annotation and the FP8 head ops, per thread
    ranges: dict[int, list[tuple[float, float, str]]] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("cat") in ("user_annotation", "cpu_op") and (name == "optimizer_step" or "fp8_head" in name):
            ranges.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"], name))
    steps = max(1, len([e for e in events if e.get("name") == "optimizer_step" and e.get("cat") == "user_annotation"]))
    busy = {b: 0.0 for b in BUCKETS}
    by_kernel: dict[tuple[str, str], list] = {}       # (bucket, kernel name) -> [total us, launches]
    compute, comm = [], []
    for k in kernels:
        name, span = k.get("name", ""), (k["ts"], k["ts"] + k["dur"])
        launch = launches.get(k.get("args", {}).get("correlation"))
        owners = enclosing(ranges.get(launch["tid"], []), launch["ts"]) if launch else []
        if COMM.search(name):
            comm.append(span)
            continue
        compute.append(span)
        if "optimizer_step" in owners:
            bucket = "opt_compute"
        elif ATTENTION.search(name):
            bucket = "attention"
        elif any("fp8_head" in o for o in owners) and not MATMUL.search(name):
            bucket = "fp8_quant"
        elif MATMUL.search(name):
            bucket = "matmul"
        elif "relu2_linear" in name:
            bucket = "mlp"
        elif "_ce_" in name:
            bucket = "ce"
        elif "_qk_rotary" in name:
            bucket = "qk"
        elif name.startswith("triton_"):
            bucket = "inductor"
        else:
            bucket = "other"
        busy[bucket] += k["dur"]
        by_kernel.setdefault((bucket, name[:110]), [0.0, 0])
        by_kernel[(bucket, name[:110])][0] += k["dur"]
        by_kernel[(bucket, name[:110])][1] += 1
    window = [(min(a for a, _ in compute + comm), max(b for _, b in compute + comm))] if compute else []
    busy["opt_comm"] = subtract(comm, compute)
    busy["idle"] = (window[0][1] - window[0][0]) - union_length(compute + comm) if window else 0.0
    out = {b: busy[b] / 1000 / steps for b in BUCKETS}
    out["step"] = (window[0][1] - window[0][0]) / 1000 / steps if window else 0.0
    out["steps"] = steps
    out["kernels"] = sorted(((us / 1000 / steps, n // steps, b, name) for (b, name), (us, n) in by_kernel.items()),
                            reverse=True)
    return out


class _Trace:
    """A chrome trace's complete events, with each kernel's launch (by correlation id) and the CPU ops per thread."""

    def __init__(self, path: str):
        self.events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]
        self.kernels = sorted((e for e in self.events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                              key=lambda e: e["ts"])
        self.launches = {e["args"].get("correlation"): e for e in self.events
                         if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
        self.ops: dict[int, list[tuple[float, float, str]]] = {}
        for e in self.events:
            if e.get("cat") in ("user_annotation", "cpu_op"):
                self.ops.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"], e.get("name", "")))

    def launched_by(self, kernel: dict, depth: int, width: int) -> str:
        """The innermost `depth` CPU ops around the kernel's launch, outermost first, each cut to `width`."""
        launch = self.launches.get(kernel.get("args", {}).get("correlation"))
        chain = sorted((r for r in self.ops.get(launch["tid"], []) if r[0] <= launch["ts"] <= r[1]),
                       key=lambda r: (r[0], -r[1])) if launch else []
        return " > ".join(r[2][:width] for r in chain[-depth:]) or "(no CPU op)"


def owners(path: str, pattern: str, depth: int = 4) -> list[tuple[float, int, str, str]]:
    """The CPU ops that launched the kernels / copies whose name matches `pattern`: (ms per step, launches per step,
    kernel name, the innermost `depth` enclosing ops, outermost first), most time first. This is how a copy or an
    element-wise kernel that no bucket explains is traced back to the code (an autograd node, an aten op)."""
    trace = _Trace(path)
    steps = max(1, sum(e.get("name") == "optimizer_step" and e.get("cat") == "user_annotation" for e in trace.events))
    found: dict[tuple[str, str], list] = {}
    regex = re.compile(pattern)
    for k in trace.kernels:
        if regex.search(k.get("name", "")):
            key = (k["name"][:60], trace.launched_by(k, depth, 50))
            found.setdefault(key, [0.0, 0])
            found[key][0] += k["dur"]
            found[key][1] += 1
    return sorted(((us / 1000 / steps, n // steps, name, chain) for (name, chain), (us, n) in found.items()),
                  reverse=True)


def idle_gaps(path: str, top: int = 10) -> list[tuple[float, str, str, str]]:
    """The longest stretches in the step window where no kernel runs: (ms, the kernel before, the kernel after, the CPU
    ops that launched the one after, innermost 3). A gap the launch of the next kernel explains (a sync, a Python loop,
    a data copy) points at what the GPU waited for."""
    trace = _Trace(path)
    gaps, busy_until, before = [], None, None
    for k in trace.kernels:
        if busy_until is not None and k["ts"] > busy_until:
            gaps.append((k["ts"] - busy_until, before, k))
        if busy_until is None or k["ts"] + k["dur"] > busy_until:
            busy_until, before = k["ts"] + k["dur"], k
    return [(us / 1000, prev["name"][:40], k["name"][:40], trace.launched_by(k, 3, 40))
            for us, prev, k in sorted(gaps, key=lambda g: -g[0])[:top]]


def sibling_traces(path: str) -> list[tuple[int, str]]:
    """(rank, trace) of every rank's trace of the same steps as `path` (..._rank<r>_steps<a>-<b>_trace.json), by
    rank; empty if the name has no rank in it."""
    p = Path(path)
    m = re.fullmatch(r"(.*_rank)\d+(_steps\d+-\d+_trace\.json)", p.name)
    if not m:
        return []
    found = (re.fullmatch(re.escape(m[1]) + r"(\d+)" + re.escape(m[2]), q.name) for q in p.parent.iterdir())
    return sorted((int(r[1]), str(p.parent / r[0])) for r in found if r)


def first_collectives(path: str) -> list[tuple[float, float, float]]:
    """(start, duration, host launch time) in us of each step's first communication kernel: the earliest one launched
    inside the step's optimizer_step range, which launches the gradient reductions once the backward is done."""
    trace = _Trace(path)
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace.events
                   if e.get("name") == "optimizer_step" and e.get("cat") == "user_annotation")
    first: list[tuple[float, float, float] | None] = [None] * len(steps)
    for k in trace.kernels:
        launch = trace.launches.get(k.get("args", {}).get("correlation"))
        if not COMM.search(k.get("name", "")) or launch is None:
            continue
        i = next((i for i, (a, b) in enumerate(steps) if a <= launch["ts"] <= b), None)
        if i is not None and first[i] is None:     # the kernels are in start order
            first[i] = (k["ts"], k["dur"], launch["ts"])
    return [f for f in first if f is not None]


def rank_arrivals(paths: list[str]) -> list[tuple[list[float], int, float, list[float]]]:
    """Per step, for the traces of all ranks (one per rank, the same steps): when each rank's first collective
    started, in ms after the first rank's (it ends on every rank at once, when the last one has joined), the rank
    that came last, that rank's kernel time (the reduction itself, with no waiting in it), and when each rank's host
    launched that collective, in ms after the first host's. The traces share the host's clock. A spread here is time
    the other ranks spend waiting for the slowest one's backward (different documents, clocks, or the profiler's own
    CPU cost), which the buckets count as exposed communication; a late rank whose host launched late too was held
    up by its host, one whose host launched in time by its GPU."""
    per_rank = [first_collectives(p) for p in paths]
    if len({len(f) for f in per_rank}) != 1:
        raise ValueError(f"the rank traces hold different numbers of steps: {[len(f) for f in per_rank]}")
    rows = []
    for step in zip(*per_rank):
        starts, hosts = [s for s, _, _ in step], [h for _, _, h in step]
        last = max(range(len(step)), key=lambda r: starts[r])
        rows.append(([(s - min(starts)) / 1000 for s in starts], last, step[last][1] / 1000,
                     [(h - min(hosts)) / 1000 for h in hosts]))
    return rows


def run_and_profile(out: str, scheduled: int, extra: list[str]) -> list[str]:
    """./run.sh on a short schedule (scheduled steps + 6 extension steps), profiling two steps late in each third."""
    import subprocess
    import uuid
    thirds = [scheduled // 3, 2 * scheduled // 3, scheduled]
    ranges = ",".join(f"{end - 4}:{end - 2}" for end in thirds)
    run_id = next((a.split("=", 1)[1] for a in extra if a.startswith("--run_id=")), f"profile-{uuid.uuid4().hex[:8]}")
    cmd = ["./run.sh", f"--num_scheduled_iterations={scheduled}", "--num_extension_iterations=6",
           "--val_loss_every=0", f"--log_dir={out}", f"--profile_steps={ranges}", f"--run_id={run_id}",
           *[a for a in extra if not a.startswith("--run_id=")]]
    print(" ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent)
    if proc.returncode != 0:
        raise SystemExit(f"error: the training run failed (exit {proc.returncode})")
    # this run's traces only: an earlier run into the same folder left its own
    return sorted(str(p) for p in Path(out).glob(f"{run_id}_rank0_steps*_trace.json"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="*")
    ap.add_argument("--run", action="store_true", help="train and profile first (the rest goes to train_gpt.py)")
    ap.add_argument("--out", default="logs/profile", help="log folder of --run")
    ap.add_argument("--scheduled", type=int, default=60, help="scheduled steps of --run")
    ap.add_argument("--top", type=int, default=0, help="also list the N kernels with the most time per step")
    ap.add_argument("--gaps", type=int, default=0, help="also list the N longest idle stretches of each trace")
    ap.add_argument("--owners", default="", help="also list the CPU ops that launched the kernels matching this "
                    "regular expression (e.g. 'Memcpy|CUDAFunctor_add')")
    args, rest = ap.parse_known_args(argv)
    try:
        re.compile(args.owners)
    except re.error as e:
        print(f"error: --owners={args.owners!r} is not a regular expression ({e}); e.g. --owners='Memcpy|add'",
              file=sys.stderr)
        return 2
    if args.run:
        args.traces = run_and_profile(args.out, args.scheduled, rest + args.traces)
    elif rest:
        ap.error(f"unknown arguments {rest}")
    header = ["trace", "steps", *BUCKETS, "step"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for path in args.traces:
        try:
            r = analyse(path)
        except (OSError, ValueError, KeyError) as e:
            print(f"error: cannot read the trace {path}: {e}", file=sys.stderr)
            return 1
        name = re.sub(r".*_(steps\d+-\d+)_trace\.json$", r"\1", path)
        print("| " + " | ".join([name, str(r["steps"])] + [f"{r[b]:.1f}" for b in (*BUCKETS, "step")]) + " |")
        for ms, n, bucket, kernel_name in r["kernels"][:args.top]:
            print(f"    {ms:7.2f} ms  {n:5d}x  {bucket:<11} {kernel_name}")
        if args.gaps:
            print(f"  longest idle stretches (ms; the kernel before -> the kernel after <- its launching ops):")
            for ms, prev, nxt, chain in idle_gaps(path, args.gaps):
                print(f"    {ms:7.3f} ms  {prev} -> {nxt}  <-  {chain}")
        ranks = sibling_traces(path)
        if len(ranks) > 1:
            print(f"  ranks at each step's first collective (ms after the first rank; the last rank's kernel; "
                  f"then when each host launched it, ms after the first host):")
            names = [f"rank{r}" for r, _ in ranks]
            try:
                for i, (late, last, ms, hosts) in enumerate(rank_arrivals([q for _, q in ranks])):
                    print(f"    step {i + 1}: " + "  ".join(f"{n} +{t:.2f}" for n, t in zip(names, late))
                          + f"  | {names[last]} last, its kernel {ms:.2f} ms"
                          + "  | hosts " + "  ".join(f"+{t:.2f}" for t in hosts))
            except (OSError, ValueError, KeyError) as e:
                print(f"error: cannot compare the ranks' traces of {path}: {e}", file=sys.stderr)
                return 1
        if args.owners:
            print(f"  launched by (kernels matching {args.owners!r}; ms per step, launches per step):")
            for ms, n, kernel_name, chain in owners(path, args.owners)[:20]:
                print(f"    {ms:7.2f} ms  {n:5d}x  {kernel_name}  <-  {chain}")
    print("ms per step, GPU time (see the module docstring for the buckets)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
