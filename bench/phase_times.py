"""Summarise training logs: untimed phases, ms/step in each batch-size phase, tokens/s, peak memory; with two or
more logs, also one table that compares them phase by phase against the first (a before/after measurement).

Usage: python3 bench/phase_times.py logs/<run_id>.txt [logs/<other>.txt ...]
"""
import re
import sys
from pathlib import Path


def summarise(text: str) -> dict:
    """A log's numbers: untimed phases [(name, s)], batch phases [(first step, last step, global batch, mean ms/step)],
    the extension steps' (first step, last step, global batch, mean ms/step) or None, validations [(step, loss text,
    train time s)] and peak memory (allocated, reserved MiB) or None."""
    hp = dict(re.findall(r"^  (\w+) = (.*)$", text, re.M))
    steps = {int(m[0]): float(m[1]) for m in re.findall(r"^step:(\d+)/\d+ train_time:(\d+)ms", text, re.M)}
    vals = [(int(s), loss, int(ms) / 1000)
            for s, loss, ms in re.findall(r"^step:(\d+)/\d+ val_loss:([\d.na]+) train_time:(\d+)ms", text, re.M)]
    ns = int(hp.get("num_scheduled_iterations", 1440))
    # the stage rows as the log prints them, Stage(batch=131072, ...); logs of older code: train_bs_schedule
    bs = [int(x) for x in re.findall(r"batch=(\d+)", hp.get("stages", ""))] or \
        [int(x) for x in re.findall(r"\d+", hp.get("train_bs_schedule", "(131072, 262144, 393216)"))]
    val_steps = {v[0] for v in vals}
    phases, extension = [], None
    if steps:
        n = len(bs)
        # the stages split the scheduled steps evenly; the extension steps after them run the last stage's batch
        bounds = [(k * ns // n, (k + 1) * ns // n if k < n - 1 else min(ns, max(steps))) for k in range(n)]
        if max(steps) > ns:
            bounds.append((ns, max(steps)))
        for i, (a, b) in enumerate(bounds):
            # train_time is cumulative and excludes validation: the per-step time is the difference of successive
            # lines; skip steps right after a validation (their line includes the restart) and a phase's first steps.
            # The mean, not the median: the log's whole milliseconds then cost no resolution, and a slow step counts
            # as it does in train_time.
            d = [steps[s + 1] - steps[s] for s in range(a + 2, b)
                 if s in steps and s + 1 in steps and s not in val_steps]
            if d and i < n:
                phases.append((a, b - 1, bs[i], sum(d) / len(d)))
            elif d:
                extension = (a, b - 1, bs[-1], sum(d) / len(d))
    m = re.search(r"peak memory allocated: (\d+) MiB reserved: (\d+) MiB", text)
    return {"untimed": [(name, int(ms) / 1000) for name, ms in re.findall(r"^phase:(\w+) time:(\d+)ms", text, re.M)],
            "phases": phases, "extension": extension, "vals": vals, "peak": (int(m[1]), int(m[2])) if m else None}


def print_summary(path: str, s: dict) -> None:
    print(f"log: {path}")
    for name, sec in s["untimed"]:
        print(f"  untimed {name:<11} {sec:8.1f} s")
    if not s["phases"]:
        print("  no training steps in this log")
        return
    print("  phase  steps        global_batch  ms/step   tokens/s")
    for i, (a, b, batch, ms) in enumerate(s["phases"] + ([s["extension"]] if s["extension"] else [])):
        name = "ext" if i == len(s["phases"]) else str(i)
        print(f"  {name:<6} {a:>4}-{b:<6} {batch:>12}  {ms:8.2f}  {batch / ms * 1000:10.0f}")
    for step, loss, sec in s["vals"]:
        print(f"  val step {step}: {loss} (train_time {sec:.1f} s)")
    if s["peak"]:
        print(f"  peak memory allocated {s['peak'][0]} MiB, reserved {s['peak'][1]} MiB")


def ratio_cells(values: list, fmt: str) -> str:
    """Table cells: each value in fmt with its ratio to the first log's, "-" where a log has none."""
    first = values[0]
    return " | ".join("-" if v is None else fmt.format(v) + (f" ({v / first:.3f}x)" if k and first else "")
                      for k, v in enumerate(values))


def print_comparison(paths: list[str], summaries: list[dict]) -> None:
    """ms/step per phase and train_time of every log with their ratios to the first log's, the last validation and the
    peak memory."""
    names = [Path(p).stem for p in paths]
    if len(set(names)) < len(names):   # the same run id in two folders: name them by their paths
        names = list(paths)
    print("\n| | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for batch in sorted({batch for s in summaries for _, _, batch, _ in s["phases"]}):
        values = [{b: ms for _, _, b, ms in s["phases"]}.get(batch) for s in summaries]
        print(f"| ms/step at {batch} tokens | {ratio_cells(values, '{:.2f}')} |")
    if any(s["extension"] for s in summaries):
        values = [s["extension"][3] if s["extension"] else None for s in summaries]
        print(f"| ms/step in the extension | {ratio_cells(values, '{:.2f}')} |")
    # the last validation's train_time: the whole timed loop, validation excluded
    values = [s["vals"][-1][2] if s["vals"] else None for s in summaries]
    print(f"| train_time | {ratio_cells(values, '{:.1f} s')} |")
    print("| last validation | " + " | ".join(f"{s['vals'][-1][1]} (step {s['vals'][-1][0]})" if s["vals"] else "-"
                                           for s in summaries) + " |")
    print("| peak memory allocated | " + " | ".join(f"{s['peak'][0]} MiB" if s["peak"] else "-"
                                                 for s in summaries) + " |")


def main(argv: list[str]) -> int:
    if not argv or any(a.startswith("-") for a in argv):
        print("usage: python3 bench/phase_times.py LOG [LOG ...]  (training logs, logs/<run_id>.txt)", file=sys.stderr)
        return 2
    missing = [p for p in argv if not Path(p).is_file()]
    if missing:
        print(f"error: no log file at {missing[0]}; pass the run's logs/<run_id>.txt", file=sys.stderr)
        return 2
    summaries = [summarise(Path(p).read_text(errors="replace")) for p in argv]
    for path, s in zip(argv, summaries):
        print_summary(path, s)
    if len(argv) > 1:
        print_comparison(argv, summaries)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
