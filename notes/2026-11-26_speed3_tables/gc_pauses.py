"""Python garbage-collector pauses from the start of the timed loop to the end of a run on one GPU.

    git worktree add /tmp/at-0288899 0288899   # the code it measured (PINNED_COMMIT): it imports train_gpt, harness
    python3 notes/2026-11-26_speed3_tables/gc_pauses.py --repo=/tmp/at-0288899 [train_gpt options]

Runs train_gpt.main in this process (one GPU, no torchrun) and times every collection with gc.callbacks, from the
timed loop's start (harness.Bookkeeping.start) to the end, validations and their compiles included. Prints one line
per generation: collections, total and longest pause.
"""
import gc
import os
import sys
import time

# The code this script measured. It imports that code from a checkout of this commit (--repo), never from the
# tree around it, whose names have moved on since.
PINNED_COMMIT = "028889970c6f373d21d3f83b7a43f7b952b51ade"


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

import harness  # noqa: E402
import train_gpt  # noqa: E402


def main(argv: list[str]) -> int:
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    state = {"timed": False, "t0": 0.0}

    def on_collect(phase: str, info: dict) -> None:
        if phase == "start":
            state["t0"] = time.perf_counter()
        elif state["timed"]:
            pauses[info["generation"]].append(1000 * (time.perf_counter() - state["t0"]))

    start = harness.Bookkeeping.start

    def timed_start(self) -> None:
        state["timed"] = True
        start(self)

    harness.Bookkeeping.start = timed_start
    gc.callbacks.append(on_collect)
    rc = train_gpt.main(argv)
    print("gc pauses from the timed loop's start to the end:")
    for generation, ms in pauses.items():
        print(f"  generation {generation}: {len(ms)} collections, {sum(ms):.1f} ms in all, "
              f"longest {max(ms, default=0.0):.2f} ms")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
