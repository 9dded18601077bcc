"""Where a Python program's main thread spends its wall time: samples its stack every few ms from a
second thread (no tracing, so the program runs at nearly full speed) and writes the functions
that were on the stack longest: seconds with the function anywhere on the stack (inclusive) and
on top of it (self).

Usage: python3 bench/stack_sampler.py [--out=FILE] [--interval_ms=5] -- SCRIPT [ARGS ...]
Example: python3 bench/stack_sampler.py --out=stacks.txt -- train_gpt.py --num_scheduled_iterations=30
"""
import collections
import os
import runpy
import sys
import threading
import time


def frame_key(code) -> str:
    return f"{code.co_name} ({os.path.relpath(code.co_filename)}:{code.co_firstlineno})"


class Sampler:
    def __init__(self, thread_id: int, interval_s: float):
        self.thread_id, self.interval_s = thread_id, interval_s
        self.inclusive: collections.Counter = collections.Counter()
        self.own: collections.Counter = collections.Counter()
        self.samples, self.total = 0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        # Each sample counts the wall time since the previous one: while the main thread holds the
        # GIL this thread wakes only at the interpreter's switch interval, later than asked.
        last = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self.thread_id)
            now = time.perf_counter()
            dt, last = now - last, now
            if frame is None:
                continue
            self.samples += 1
            self.total += dt
            self.own[frame_key(frame.f_code)] += dt
            seen = set()
            while frame is not None:
                key = frame_key(frame.f_code)
                if key not in seen:            # recursion counts once per sample
                    seen.add(key)
                    self.inclusive[key] += dt
                frame = frame.f_back

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def report(self, wall_s: float, top: int = 80) -> str:
        lines = [f"{self.samples} samples over {wall_s:.1f} s of wall time (asked: one every "
                 f"{self.interval_s * 1000:.0f} ms); seconds on the stack:",
                 f"{'inclusive':>9} {'self':>7}  function"]
        for key, sec in self.inclusive.most_common(top):
            lines.append(f"{sec:8.1f}s {self.own[key]:6.1f}s  {key}")
        lines.append("")
        lines.append("most time on top of the stack (self):")
        for key, sec in self.own.most_common(30):
            lines.append(f"{sec:8.1f}s  {key}")
        return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    split = argv.index("--")
    opts = dict(a[2:].split("=", 1) for a in argv[:split] if a.startswith("--") and "=" in a)
    script, args = argv[split + 1], argv[split + 2:]
    out = opts.get("out", "stacks.txt")
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    t0 = time.perf_counter()
    with Sampler(threading.get_ident(), float(opts.get("interval_ms", 5)) / 1000) as sampler:
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    with open(out, "w") as f:
        f.write(sampler.report(time.perf_counter() - t0))
    print(f"stack samples written to {out}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
