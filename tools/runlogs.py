"""Read train_gpt.py run logs (logs/<run_id>.txt): the validation lines and whether the run finished.

The trainer writes one line per validation, `step:<n>/<total> val_loss:<x> train_time:<ms>ms step_avg:<ms>ms`, and a
run that fails ends its log with an `error: ...` line. A run counts as finished when its last validation is at step
<total>, its loss is finite and no error line follows.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

VAL_LINE = re.compile(r"^step:(\d+)/(\d+) val_loss:([-+0-9.eE]+|nan|inf) train_time:(\d+)ms")


@dataclass
class Run:
    path: str
    run_id: str
    val: list[tuple[int, float, float]] = field(default_factory=list)  # (step, val loss, train time in s)
    total_steps: int = 0
    error: str = ""

    @property
    def finished(self) -> bool:
        return (not self.error and bool(self.val) and self.val[-1][0] == self.total_steps
                and math.isfinite(self.val[-1][1]))

    @property
    def why_excluded(self) -> str:
        if self.error:
            return f"failed: {self.error}"
        if not self.val:
            return "no validation line (the run stopped before its first validation)"
        step, loss, _ = self.val[-1]
        if step != self.total_steps:
            return f"unfinished: last validation at step {step} of {self.total_steps}"
        return f"final validation loss is {loss}"

    @property
    def final_val_loss(self) -> float:
        return self.val[-1][1]

    @property
    def train_time_s(self) -> float:
        return self.val[-1][2]


def read_run(path: str | Path) -> Run:
    """Parse one log. Raises OSError if it cannot be read."""
    path = Path(path)
    run = Run(path=str(path), run_id=path.stem)
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = VAL_LINE.match(line)
            if m:
                run.val.append((int(m[1]), float(m[3]), int(m[4]) / 1000))
                run.total_steps = int(m[2])
            elif line.startswith("error: "):
                run.error = line[len("error: "):].strip()
    return run


class ToolArgumentParser(argparse.ArgumentParser):
    """argparse with the project's failure format: one `error:` line (no usage block) and exit code 2."""

    def error(self, message: str):
        print(f"error: {message}; see {self.prog} --help", file=sys.stderr)
        raise SystemExit(2)
