"""Does the GPU wait for the host between launches? Each training step starts with a GPU sleep of --sleep_ms, so the
host queues the step's work that much ahead of the GPU; on one GPU.

    git worktree add /tmp/at-607bdec 607bdec   # the code it measured (PINNED_COMMIT): it imports train_gpt
    python3 notes/2026-11-27_rank8_host_power_H200/head_start.py --repo=/tmp/at-607bdec --sleep_ms=40 \
        [train_gpt options]

Runs train_gpt.main in this process (one GPU, no torchrun) with Trainer.train_step wrapped to launch
torch.cuda._sleep first; the trainer is otherwise unchanged. If the GPU never waits for the host, every step grows by
the sleep; if it idles I ms a step waiting for launches that the head start covers, by the sleep less I. Compare the
per-phase step times (bench/phase_times.py) of a run with --sleep_ms=0 and one with it, on one warm machine. The
sleep also lowers the GPU's mean power: on a power-capped GPU the rest of the step then runs at a higher clock, which
shortens it as well (log the clock with nvidia-smi beside it: notes/2026-11-27_rank8_host_power_H200).
"""
import argparse
import os
import sys
from typing import Callable

# The code this script measured. It imports that code from a checkout of this commit (--repo), never from the
# tree around it, whose names have moved on since.
PINNED_COMMIT = "607bdec0d4b634d49f5924ea8acac0fd6e33fc33"


def pinned_checkout() -> str:
    """The checkout of PINNED_COMMIT that --repo=PATH (or --repo PATH) names, taken out of sys.argv; without one, one
    error line that names the commit to check out. Nothing heavier than os and sys is imported before it."""
    argv, repo = sys.argv[1:], None
    for i, arg in enumerate(argv):
        if arg == "--repo" or arg.startswith("--repo="):
            repo = arg[len("--repo="):] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            sys.argv[1:] = argv[:i] + argv[i + (1 if "=" in arg else 2):]
            break
    if repo is None or not os.path.isfile(os.path.join(repo, "train_gpt.py")):
        short = PINNED_COMMIT[:7]
        found = "no --repo" if repo is None else f"--repo={repo} holds no train_gpt.py"
        sys.exit(f"error: {os.path.basename(__file__)} runs on a checkout of {PINNED_COMMIT} ({found}): "
                 f"git worktree add /tmp/at-{short} {short}, then pass --repo=/tmp/at-{short}")
    return os.path.abspath(repo)


ROOT = pinned_checkout()  # the checkout's root
sys.path.insert(0, ROOT)


def with_head_start(train_step: Callable, sleep_ms: float, sleep: Callable[[int], None],
                    cycles_per_ms: Callable[[object], int]) -> Callable:
    """train_step(self, sched, message) preceded, on a CUDA trainer, by sleep(cycles) of sleep_ms at the clock that
    cycles_per_ms(device) gives (its maximum SM clock: the sleep counts cycles, so a slower clock sleeps longer)."""
    def step(self, sched, message):
        if sleep_ms > 0 and self.device.type == "cuda":
            sleep(int(cycles_per_ms(self.device) * sleep_ms))
        return train_step(self, sched, message)
    return step


def main(argv: list[str]) -> int:
    import torch

    import train_gpt
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sleep_ms", type=float, default=40.0, help="GPU sleep at the start of every step")
    args, rest = ap.parse_known_args(argv)
    train_gpt.Trainer.train_step = with_head_start(
        train_gpt.Trainer.train_step, args.sleep_ms, torch.cuda._sleep,
        lambda device: torch.cuda.get_device_properties(device).clock_rate)  # kHz: cycles per ms
    return train_gpt.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
