"""Summarise a training log: untimed phases, ms/step in each batch-size phase, tokens/s, peak memory.

Usage: python3 bench/phase_times.py logs/<run_id>.txt
"""
import re
import sys


def main(path: str) -> None:
    text = open(path).read()
    hp = dict(re.findall(r"^  (\w+) = (.*)$", text, re.M))
    steps = {int(m[0]): float(m[1]) for m in re.findall(r"^step:(\d+)/\d+ train_time:(\d+)ms", text, re.M)}
    vals = re.findall(r"^step:(\d+)/\d+ val_loss:([\d.na]+) train_time:(\d+)ms", text, re.M)
    ns = int(hp.get("num_scheduled_iterations", 1725))
    # the stage rows as the log prints them, Stage(batch=131072, ...); logs of older code: train_bs_schedule
    bs = [int(x) for x in re.findall(r"batch=(\d+)", hp.get("stages", ""))] or \
        [int(x) for x in re.findall(r"\d+", hp.get("train_bs_schedule", "(131072, 262144, 393216)"))]
    val_steps = {int(v[0]) for v in vals}
    print(f"log: {path}")
    for name, ms in re.findall(r"^phase:(\w+) time:(\d+)ms", text, re.M):
        print(f"  untimed {name:<11} {int(ms) / 1000:8.1f} s")
    print("  phase  steps        global_batch  ms/step   tokens/s")
    if not steps:
        print("  no training steps in this log"); return
    n = len(bs)
    bounds = [(k * ns // n, (k + 1) * ns // n if k < n - 1 else max(steps)) for k in range(n)]
    for i, (a, b) in enumerate(bounds):
        # train_time is cumulative and excludes validation: the per-step time is the difference of successive lines;
        # skip steps right after a validation (their line includes the restart) and the first steps of a phase.
        d = [steps[s + 1] - steps[s] for s in range(a + 2, b) if s in steps and s + 1 in steps and s not in val_steps]
        if d:
            d.sort()
            med = d[len(d) // 2]
            print(f"  {i}      {a:>4}-{b - 1:<6} {bs[i]:>12}  {med:8.1f}  {bs[i] / med * 1000:10.0f}")
    for v in vals:
        print(f"  val step {v[0]}: {v[1]} (train_time {int(v[2]) / 1000:.1f} s)")
    m = re.search(r"peak memory allocated: (\d+) MiB reserved: (\d+) MiB", text)
    if m:
        print(f"  peak memory allocated {m[1]} MiB, reserved {m[2]} MiB")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        main(p)
