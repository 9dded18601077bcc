"""Read train_gpt.py run logs (logs/<run_id>.txt): the validation lines and whether the run finished.

    python3 tools/runlogs.py logs/*.txt      # one line per log: run id, finished or why not, final val loss, time

The trainer writes the code it ran (`==== train_gpt.py ====` ... a line of 100 `=`), then one line per validation,
`step:<n>/<total> val_loss:<x> train_time:<ms>ms step_avg:<ms>ms`, and ends with a `result: ...` line; a run that
fails ends its log with an `error: ...` line instead. A resumed run (--resume) writes a new log, by default
`<run_id>-from<step>.txt`, with a line `resumed from <log_dir>/<run_id>/state_step<S>.pt after step S of <total>`.

A run counts as finished when its last validation is at step <total>, its loss is finite and no error line follows.
A log whose validation loss is NaN or infinite, or that ended with the trainer's divergence error, is "diverged".
Files that cannot be read, are empty, binary or hold none of the trainer's lines are reported as such (never an
exception): `Run.why_excluded` says why a log does not count. Exit codes of the program: 0 every log was read, 2 bad
arguments or a log that does not exist.
"""
from __future__ import annotations

import argparse
import importlib
import io
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePath

# a number as Python's float() reads it (what `{x:.4f}` writes, plus exponents); "1.2.3" or "-" is not one
NUMBER = r"[-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf)"
INT = r"\d{1,18}"      # a step or a time in ms; a longer one makes the line garbled, not an int() too large to use
VAL_LINE = re.compile(rf"^step:({INT})/({INT}) val_loss:({NUMBER}) train_time:({INT})ms(?:\s|$)")
VAL_LIKE = re.compile(r"^step:\d+/\d+ val_loss:")          # looks like a validation line (may be garbled)
STEP_LINE = re.compile(r"^step:\d+/\d+ ")
RESULT_LINE = re.compile(rf"^result: val_loss:({NUMBER}) .*?train_time:({NUMBER})s steps:({INT})(?:\s|$)")
RESUMED_LINE = re.compile(rf"^resumed from (.+) after step ({INT}) of ({INT})(?:\s|$)")
CODE_HEADER = re.compile(r"^==== \S+ ====$")               # the trainer's code dump starts here ...
CODE_END = "=" * 100                                        # ... and ends before the first line of 100 "="
OTHER_TRAINER_LINES = ("command: ", "phase:", "hyperparameters:", "world_size:", "logging to ")
# the trainer's two divergence errors (train_gpt.py, TrainingDiverged)
DIVERGED_ERROR = re.compile(r"^(the validation loss is \S+ at step|the training loss became NaN or infinite)")


@dataclass
class Run:
    path: str
    run_id: str
    val: list[tuple[int, float, float]] = field(default_factory=list)  # (step, val loss, train time in s)
    total_steps: int = 0
    error: str = ""
    result: dict | None = None          # the `result:` line: val_loss, train_time_s, steps
    resumed_from: str = ""              # the checkpoint a resumed run started from ...
    resumed_step: int = 0               # ... after this step
    garbled: list[tuple[int, str]] = field(default_factory=list)  # (line number, line) of unreadable val lines
    recognized: bool = False            # holds at least one line only the trainer writes
    unreadable: str = ""                # why the file could not be read ("" if it was)
    binary: bool = False
    empty: bool = False

    @property
    def diverged(self) -> bool:
        return (any(not math.isfinite(loss) for _, loss, _ in self.val)
                or bool(DIVERGED_ERROR.match(self.error)))

    @property
    def finished(self) -> bool:
        return (self.is_log and not self.error and bool(self.val) and self.val[-1][0] == self.total_steps
                and not self.diverged)

    @property
    def is_log(self) -> bool:
        """A readable train_gpt.py log (finished or not)."""
        return not (self.unreadable or self.binary or self.empty) and self.recognized

    @property
    def status(self) -> str:
        """One word: finished, diverged, failed, unfinished, unreadable or foreign."""
        if self.unreadable:
            return "unreadable"
        if not self.is_log:
            return "foreign"
        if self.diverged:
            return "diverged"
        if self.error:
            return "failed"
        return "finished" if self.finished else "unfinished"

    @property
    def why_excluded(self) -> str:
        if self.unreadable:
            return f"unreadable: cannot read it ({self.unreadable})"
        if self.empty:
            return "not a train_gpt log: the file is empty"
        if self.binary:
            return "not a train_gpt log: a binary file (a checkpoint?)"
        if not self.recognized:
            return "not a train_gpt log: none of the trainer's lines (code header, step, validation or result)"
        garbled = ""
        if self.garbled:
            n, text = self.garbled[-1]
            garbled = f"; line {n} is a garbled validation line: {text[:80]!r}"
        if self.diverged:
            if self.error:
                return f"diverged: {self.error}"
            step, loss = next((s, x) for s, x, _ in self.val if not math.isfinite(x))
            return f"diverged: the validation loss is {loss} at step {step}"
        if self.error:
            return f"failed: {self.error}"
        if not self.val:
            return "no validation line (the run stopped before its first validation)" + garbled
        step, loss, _ = self.val[-1]
        if step != self.total_steps:
            return f"unfinished: last validation at step {step} of {self.total_steps}" + garbled
        return "finished"

    @property
    def final_val_loss(self) -> float:
        return self.val[-1][1]

    @property
    def train_time_s(self) -> float:
        return self.val[-1][2]


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _event(line: str, n: int) -> tuple | None:
    """What one line of a log says, or None for lines the tools do not use."""
    m = VAL_LINE.match(line)
    if m:
        loss = _number(m[3])
        if loss is not None:
            return ("val", int(m[1]), int(m[2]), loss, int(m[4]) / 1000)
    if VAL_LIKE.match(line):
        return ("garbled", n, line.rstrip("\n"))
    if line.startswith("error:"):
        return ("error", line[len("error:"):].strip())
    m = RESULT_LINE.match(line)
    if m:
        return ("result", _number(m[1]), _number(m[2]), int(m[3]))
    m = RESUMED_LINE.match(line)
    if m:
        return ("resumed", m[1], int(m[2]))
    if STEP_LINE.match(line) or line.startswith(OTHER_TRAINER_LINES):
        return ("seen",)
    return None


def _apply(run: Run, event: tuple) -> None:
    kind = event[0]
    run.recognized = run.recognized or kind != "error"   # any program may write "error: ..."
    if kind == "val":
        _, step, total, loss, seconds = event
        run.val.append((step, loss, seconds))
        run.total_steps = total
    elif kind == "garbled":
        run.garbled.append(event[1:])
    elif kind == "error":
        run.error = event[1]
    elif kind == "result":
        run.result = {"val_loss": event[1], "train_time_s": event[2], "steps": event[3]}
    elif kind == "resumed":
        run.resumed_from, run.resumed_step = event[1], event[2]


def read_run(path: str | Path) -> Run:
    """Parse one log. Raises OSError if it cannot be read; any content gives a Run (see Run.why_excluded)."""
    path = Path(path)
    run = Run(path=str(path), run_id=path.stem)
    with open(path, "rb") as f:         # opened once: a pipe (<(cat log)) cannot be read twice
        data = f.read(4096)
        if not data:
            run.empty = True
            return run
        if b"\0" in data:              # a checkpoint given by mistake is not read whole
            run.binary = True
            return run
        data += f.read()
    # Lines inside the code dump are the trainer's source, not its output: their events count only if the dump
    # never ends (a log cut short there, or a hand-made log without the closing line).
    in_code, code_events = False, []
    text = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="replace")      # as open() reads lines
    for n, line in enumerate(text, 1):
        if in_code:
            if line.rstrip("\r\n") == CODE_END:
                in_code, code_events = False, []
                continue
            event = _event(line, n)
            if event is not None:
                code_events.append(event)
            continue
        if CODE_HEADER.match(line.rstrip("\r\n")):
            run.recognized, in_code = True, True
            continue
        event = _event(line, n)
        if event is not None:
            _apply(run, event)
    for event in code_events:
        _apply(run, event)
    return run


def load_runs(paths: list[str]) -> tuple[list[Run], list[tuple[str, str]]]:
    """Read every log once: `~` expanded, a path named twice (the same file, however spelled) read once.
    Returns (runs in the order given, [(path, reason)] for the repeats). A file that exists but cannot be read
    gives a Run with `unreadable` set; a path that does not exist raises FileNotFoundError (a mistyped name)."""
    runs, repeats, seen = [], [], {}
    for given in paths:
        p = os.path.expanduser(given)
        if not os.path.lexists(p):
            raise FileNotFoundError(2, "No such file or directory", given)
        try:
            key = str(Path(p).resolve())
        except (OSError, RuntimeError):  # a symlink loop: still one name
            key = os.path.abspath(p)
        if key in seen:
            repeats.append((p, f"named twice (counted once, as {seen[key]})"))
            continue
        seen[key] = p
        try:
            runs.append(read_run(p))
        except OSError as e:
            runs.append(Run(path=p, run_id=Path(p).stem, unreadable=e.strerror or type(e).__name__))
    return runs, repeats


def checkpoint_folder(run: Run) -> PurePath | None:
    """The folder of the checkpoint a resumed run started from (<log_dir>/<run_id of the run it continues>)."""
    return PurePath(run.resumed_from).parent if run.resumed_from else None


def finite_float(text: str) -> float:
    """argparse type: a finite number (NaN and infinity are refused)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return x


def user_path(text: str) -> str:
    """argparse type: a path with `~` expanded."""
    return os.path.expanduser(text)


TOOLS_REQUIREMENTS = Path(__file__).resolve().parent / "requirements.txt"


def install_line() -> str:
    """The command that installs the tools' dependencies (the README's Tools section), its file named from the
    folder this command runs in: tools/requirements.txt in the repository root, else the whole path."""
    root = TOOLS_REQUIREMENTS.parent.parent
    try:
        here = Path.cwd().resolve() == root
    except OSError:  # the current folder was removed
        here = False
    return f"python3 -m pip install -r {'tools/requirements.txt' if here else TOOLS_REQUIREMENTS}"


def missing_dependencies(prog: str, *modules: str, note: str = "") -> str:
    """The one error line saying which of `modules` (e.g. "scipy.stats") `prog` cannot import (then `note`, if
    given) and the install line that brings them, or "" when every one imports."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 (ImportError, or a broken install failing in its own way)
            first = (str(e).strip().splitlines() or ["no message"])[0]
            missing.append((name.split(".")[0], f"{type(e).__name__}: {first}"))
    if not missing:
        return ""
    names = " and ".join(name for name, _ in missing)
    reasons = "; ".join(reason for _, reason in missing)
    return (f"error: {prog} needs {names}, which cannot be imported ({reasons}){'; ' + note if note else ''}; "
            f"install the tools' dependencies: {install_line()}")


class ToolArgumentParser(argparse.ArgumentParser):
    """argparse with the project's failure format: one `error:` line (no usage block) and exit code 2."""

    def error(self, message: str):
        print(f"error: {message}; see {self.prog} --help", file=sys.stderr)
        raise SystemExit(2)


def describe(run: Run) -> str:
    """One line about a log for people."""
    if not run.is_log:
        return f"{run.path}: {run.why_excluded}"
    parts = [f"{run.path}: run {run.run_id} {run.status}"]
    if run.resumed_from:
        parts.append(f"resumed from {run.resumed_from} after step {run.resumed_step}")
    if run.val:
        step, loss, seconds = run.val[-1]
        parts.append(f"last validation step {step}/{run.total_steps} val_loss {loss:.4f} train_time {seconds:.1f}s")
    if not run.finished:
        parts.append(run.why_excluded)
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = ToolArgumentParser(prog="tools/runlogs.py", description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+", help="run logs (logs/<run_id>.txt)")
    args = ap.parse_args(argv)
    try:
        runs, repeats = load_runs(args.logs)
    except FileNotFoundError as e:
        print(f"error: cannot read {e.filename}: {e.strerror}; pass existing log files", file=sys.stderr)
        return 2
    for run in runs:
        print(describe(run))
    for path, reason in repeats:
        print(f"{path}: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
