"""Python garbage-collector pauses from the start of the timed loop to the end of a run on one GPU.

    python3 notes/2026-11-26_speed3_tables/gc_pauses.py [train_gpt options]

Runs train_gpt.main in this process (one GPU, no torchrun) and times every collection with gc.callbacks, from the
timed loop's start (harness.Bookkeeping.start) to the end, validations and their compiles included. Prints one line
per generation: collections, total and longest pause.
"""
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # notes/<folder>/ -> repository
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
