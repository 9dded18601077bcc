"""Python garbage-collector pauses in the timed loop of a run on one GPU, with train_gpt's gc.freeze() and without.

    python3 bench/gc_pauses.py [--no-freeze] [train_gpt options]

Runs train_gpt.main in this process (one GPU, no torchrun) and times every collection from the start of the timed
loop to the end of the run with gc.callbacks; --no-freeze turns the trainer's gc.freeze() into a no-op, so the
collector walks every object the setup made. Prints one line per generation: collections, total and longest pause.
"""
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import harness  # noqa: E402
import train_gpt  # noqa: E402


def main(argv: list[str]) -> int:
    freeze = "--no-freeze" not in argv
    argv = [a for a in argv if a != "--no-freeze"]
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
    if not freeze:
        gc.freeze = lambda: None
    gc.callbacks.append(on_collect)
    rc = train_gpt.main(argv)
    print(f"gc pauses in the timed loop ({'with' if freeze else 'without'} gc.freeze):")
    for generation, ms in pauses.items():
        print(f"  generation {generation}: {len(ms)} collections, {sum(ms):.1f} ms in all, "
              f"longest {max(ms, default=0.0):.2f} ms")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
