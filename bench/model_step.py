"""Time one training micro-batch of the compiled model: forward, backward, and nothing else.

    python3 bench/model_step.py [--tokens=16384] [--iters=30] [--root=DIR] [--optimizer] [option=value ...]

A quick check of a model change on one GPU: it compiles one graph (about a minute, not the trainer's whole warmup)
and prints the median ms of forward + backward over --iters micro-batches of random tokens in documents of about
--doc_len tokens, plus the peak memory. --root imports train_gpt.py from another checkout (say a baseline made with
`git worktree`), so before and after run the same script; run each in its own process. Other arguments are the
trainer's --name=value options (the model and its windows come from them).
--host also prints the host's time to launch a micro-batch while the GPU is kept busy by a sleep kernel (so no
launch waits for the GPU): when it is near the GPU time, the host bounds the step. --host_profile=N adds cProfile's
N functions with the most own time over those launches. --json=PATH (with --host) adds this size's two medians to
the times file PATH, {"<tokens>": {"gpu_ms": x, "host_ms": y}, "device": ...} (made if missing, other sizes kept), which
bench/comm_table.py reads: run once per size.
--optimizer times the optimizer step after each backward too, as the trainer runs it on one GPU (NorMuon every step,
Adam every other: the schedule at --step and --step + 1, then the FP8 weight refresh): an 8-GPU run's step in the
first batch phase is one such micro-batch per GPU, plus the gradients' communication, which one GPU has none of.
Before step tk.FP8_DOWN_BOOTSTRAP_STEPS the refresh bootstraps (dearer): give a later --step for the delayed one.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per micro-batch (the record's first phase: "
                    "131,072 / 8)")
    ap.add_argument("--doc_len", type=int, default=600, help="mean document length of the synthetic batch")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--step", type=int, default=0, help="schedule step whose windows and MTP weights are used "
                    "(the record's phases start at 0, 575 and 1150)")
    ap.add_argument("--host", action="store_true", help="also time the host's launches of a micro-batch")
    ap.add_argument("--host_profile", type=int, default=0, help="with --host: print cProfile's top N functions")
    ap.add_argument("--json", default="", help="with --host: add the medians to this times file (comm_table.py)")
    ap.add_argument("--optimizer", action="store_true", help="also run the optimizer step after each backward")
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent), help="folder of train_gpt.py")
    args, trainer_args = ap.parse_known_args(argv)
    if args.host_profile < 0:
        print(f"error: --host_profile takes a count of functions, 0 or more, got {args.host_profile}", file=sys.stderr)
        return 2
    if args.json and args.optimizer:
        print("error: --json keeps one micro-batch's times for bench/comm_table.py, which adds the optimizer itself: "
              "drop --optimizer", file=sys.stderr)
        return 2
    if args.json and not args.host:
        print("error: --json writes the GPU and the host times: add --host", file=sys.stderr)
        return 2
    sys.path.insert(0, args.root)
    import torch
    import checks
    import train_gpt as tg

    hp = tg.parse_args(trainer_args)
    device = torch.device("cuda")
    if args.json and times_device(args.json) not in (None, torch.cuda.get_device_name()):
        print(f"error: --json={args.json} holds times of {times_device(args.json)}, this is "
              f"{torch.cuda.get_device_name()}: give another file", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = tg.build_model(hp, device, checks.resolve_attn_backend(hp.attn_backend, device))
    compiled = torch.compile(model, dynamic=False, fullgraph=True)
    sched = tg.schedule_at(args.step, hp)
    T = args.tokens
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, tg.BOS_ID, (T,), generator=gen, dtype=torch.int32)
    bounds = torch.cumsum(torch.randint(1, 2 * args.doc_len, (T // args.doc_len * 2,), generator=gen), 0)
    bounds = bounds[bounds < T]
    cu = torch.full((tg.max_num_docs(T, hp.tokens_per_doc_bound),), T, dtype=torch.int32)
    cu[0] = 0
    cu[1:len(bounds) + 1] = bounds.to(torch.int32)
    inputs, targets = inputs.to(device), torch.roll(inputs, -1).long().to(device)
    cu = cu.to(device)
    mtp = torch.tensor(sched.mtp_weights, dtype=torch.float32, device=device)
    opt = tg.build_optimizer(hp, model, 0, 1) if args.optimizer else None
    turns = [tg.schedule_at(args.step + i, hp) for i in range(2)]   # Adam on the odd one
    done = [0]

    def step() -> None:
        loss = compiled(inputs, targets, cu, sched.ws_short, sched.ws_long, mtp, sched.max_doc_len)
        loss.backward()
        if opt is not None:
            s = turns[done[0] % 2]
            opt.step(do_adam=s.do_adam, lr_factor=s.lr_factor, momentum=s.momentum)
            model.refresh_fp8_down(s.step)
            done[0] += 1

    for _ in range(3):                     # compile and settle
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    what = "forward + backward + optimizer" if opt is not None else "forward + backward"
    print(f"root {args.root}: {T} tokens, windows {sched.ws_short}/{sched.ws_long} blocks, "
          f"attention {model.attn_backend}, {what} median {statistics.median(times):.3f} ms "
          f"(min {min(times):.3f}, max {max(times):.3f}) over {args.iters}; "
          f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB; {torch.cuda.get_device_name()}")
    if args.host:
        host_ms = host_launch_times(step, statistics.median(times), args.iters, args.host_profile, what)
        if args.json:
            write_times(args.json, T, statistics.median(times), host_ms, torch.cuda.get_device_name())
            print(f"{T} tokens: gpu_ms and host_ms written to {args.json}")
    return 0


def times_device(path: str) -> str | None:
    """The device a times file was measured on; None if there is no file yet."""
    p = Path(path)
    return json.loads(p.read_text()).get("device") if p.exists() else None


def write_times(path: str, tokens: int, gpu_ms: float, host_ms: float, device: str) -> None:
    """Add (or replace) one size's medians in the times file at path, sizes in order; the file's other sizes stay.
    A file of another device's times is an error, not a mix."""
    p = Path(path)
    data = json.loads(p.read_text()) if p.exists() else {"device": device}
    if data.get("device") != device:
        raise ValueError(f"{path} holds times of {data.get('device')}, this is {device}")
    data.setdefault("source", f"bench/model_step.py --host on one {device}")
    data[str(tokens)] = {"gpu_ms": round(gpu_ms, 3), "host_ms": round(host_ms, 3)}
    sizes = sorted((k for k in data if k.isdigit()), key=int)
    data = {**{k: v for k, v in data.items() if not k.isdigit()}, **{k: data[k] for k in sizes}}
    p.write_text(json.dumps(data, indent=2) + "\n")


def host_launch_times(step, gpu_ms: float, iters: int, top: int, what: str = "forward + backward") -> float:
    """The host's wall time to launch step() while a sleep kernel, longer than the GPU's own time for the
    micro-batch, holds the GPU: the launches never wait for the GPU unless its queue fills. Returns the median ms."""
    import cProfile
    import pstats
    import time

    import torch
    cycles = int(torch.cuda.get_device_properties(0).clock_rate * 4 * gpu_ms)  # kHz: cycles per ms; 4x the GPU time
    times = []
    profile = cProfile.Profile() if top else None
    for i in range(iters):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        if profile is not None and i >= iters // 2:
            profile.enable()
            step()
            profile.disable()
        else:
            step()
        times.append(1e3 * (time.perf_counter() - t0))
    torch.cuda.synchronize()
    plain = times[:max(1, iters // 2)] if top else times
    print(f"host: launching one micro-batch ({what}) takes median {statistics.median(plain):.3f} ms "
          f"(min {min(plain):.3f}, max {max(plain):.3f}) against {gpu_ms:.3f} ms of GPU time; the GPU slept "
          f"~{4 * gpu_ms:.0f} ms first")
    if profile is not None:
        print(f"cProfile over {iters - iters // 2} launches (its own overhead included), by own time:")
        pstats.Stats(profile).sort_stats("tottime").print_stats(top)
    return statistics.median(plain)


if __name__ == "__main__":
    sys.exit(main())
