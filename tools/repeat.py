"""Run the trainer several times with consecutive seeds, then print the statistics of the runs (tools/stats.py).

    python3 tools/repeat.py --runs=4 [--first_seed=0] [--name=NAME] [--target=3.28] -- [train_gpt options]
    python3 tools/repeat.py --runs=3 --launcher="python3 my_idea.py" -- --preset=tiny ...   # one process, a copy

Run i gets --seed=<first_seed + i> and --run_id=<name>-seed<seed>; everything after `--` goes to every run. The
launcher is ./run.sh (torchrun over this node's GPUs; TRAIN=copy.py trains a copy) unless --launcher names another.
Where no CUDA GPU is found (counted as run.sh counts them: torch.cuda.device_count() in a fresh Python, else the GPUs
`nvidia-smi -L` lists), ./run.sh cannot train, so the default is this Python running train_gpt.py (or the copy TRAIN
names) in one process, and one "repeat: note: ..." line says so. The launcher runs in the repository root; relative
paths in the trainer's path options (--train_files, --val_files, --log_dir, --resume, --compile_cache) are made
absolute from the folder this command runs in, and `~` is expanded.

The statistics need numpy and scipy: without them no run starts (one error line names the install line, exit 2). A
run that fails is reported and left out of the statistics, and the next one starts; an option error (exit 2) stops
the series, since every later run would fail the same way.

Ctrl-C or SIGTERM: the trainer stops at its next step boundary (saving its state with --save_checkpoint or
--checkpoint_every) and exits with 128 + the signal number. This wrapper passes the signal on to the run (a SIGINT
from the terminal reaches the run directly, since it shares the wrapper's process group), waits for the run to exit
on its own, starts no further run, and exits with the run's code. A second Ctrl-C is passed on too: the trainer then
stops at once.

Exit codes: 0 all runs finished, 1 some failed, 2 bad arguments or an option error stopped the series, 128 + N the
series was stopped by signal N (130 Ctrl-C, 143 SIGTERM; the stopped run's own code).
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stats  # noqa: E402
from runlogs import ToolArgumentParser, finite_float, missing_dependencies  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# the trainer's options that name files or folders (train_gpt.py Hyperparameters)
PATH_OPTIONS = ("train_files", "val_files", "log_dir", "resume", "compile_cache")
FORWARDED = (signal.SIGINT, signal.SIGTERM)
GPU_COUNT_TIMEOUT_S = 300     # a first `import torch` on a slow disk; a hung driver must not hang the series start


def gpu_count() -> int:
    """The CUDA GPUs ./run.sh would find: torch.cuda.device_count() in a fresh Python (CUDA_VISIBLE_DEVICES
    applies; nothing of torch stays loaded here); where torch cannot tell, the GPUs `nvidia-smi -L` lists; 0 if
    neither can."""
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           timeout=GPU_COUNT_TIMEOUT_S)
        if p.returncode == 0 and p.stdout.strip().isdigit():
            return int(p.stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=GPU_COUNT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):  # no driver tools: no GPU
        return 0
    return sum(line.startswith("GPU ") for line in p.stdout.splitlines()) if p.returncode == 0 else 0


def default_launcher(gpus: int, train: str, cwd: str) -> tuple[list[str], str]:
    """(the launcher, a note line or "") when --launcher is not given: ./run.sh on a node with GPUs; with none, this
    Python running the trainer (TRAIN, as run.sh reads it: a path from `cwd` if that file exists, else from the
    repository root; default train_gpt.py) directly, which a CPU can run, and a note that says so."""
    if gpus > 0:
        return ["./run.sh"], ""
    script = train or "train_gpt.py"
    if train and not os.path.isabs(train) and os.path.isfile(os.path.join(cwd, train)):
        script = os.path.abspath(os.path.join(cwd, train))
    launcher = [sys.executable, script]
    return launcher, (f"repeat: note: no CUDA GPU found, so each run starts as `{shlex.join(launcher)}` (one "
                      f"process) rather than ./run.sh, which needs GPUs; --launcher chooses the command")


def split_option(arg: str) -> tuple[str, str] | None:
    """(name with "_", value) of a trainer argument --name=value (the trainer also takes --name-with-dashes)."""
    if not arg.startswith("--") or "=" not in arg:
        return None
    name, value = arg[2:].split("=", 1)
    return name.replace("-", "_"), value


def option(args: list[str], name: str, default: str) -> str:
    """The value of --name=value in a trainer argument list (the last one wins, as in the trainer)."""
    values = [kv[1] for kv in map(split_option, args) if kv and kv[0] == name]
    return values[-1] if values else default


def absolute_paths(args: list[str], cwd: str) -> list[str]:
    """The trainer arguments with the path options' relative values made absolute from `cwd` (`~` expanded); an
    empty value (the option off) stays empty."""
    out = []
    for arg in args:
        kv = split_option(arg)
        if kv and kv[0] in PATH_OPTIONS and kv[1]:
            arg = f"{arg.split('=', 1)[0]}={os.path.abspath(os.path.join(cwd, os.path.expanduser(kv[1])))}"
        out.append(arg)
    return out


def from_terminal(signum: int) -> bool:
    """Did this SIGINT most likely come from the terminal (Ctrl-C)? Then it went to the whole foreground process
    group, the running trainer included, and passing it on would deliver it twice."""
    if signum != signal.SIGINT:
        return False
    for stream in (sys.stdin, sys.stdout, sys.stderr):
        try:
            fd = stream.fileno()
            if os.isatty(fd):
                return os.tcgetpgrp(fd) == os.getpgrp()
        except (AttributeError, OSError, ValueError):
            continue
    return False


class Forwarder:
    """While installed, SIGINT and SIGTERM do not stop this process: they are recorded and passed on to the running
    child (see from_terminal), which decides how to stop."""

    def __init__(self):
        self.child: subprocess.Popen | None = None
        self.signals: list[int] = []      # every signal received, in order
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        try:
            for signum in FORWARDED:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        except ValueError:  # not the main thread: signals cannot be handled here, they keep their default
            self.uninstall()

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _on_signal(self, signum: int, frame) -> None:
        self.signals.append(signum)
        child = self.child
        if child is not None and child.returncode is None and not from_terminal(signum):
            try:
                child.send_signal(signum)
            except OSError:  # it exited meanwhile
                pass

    def start(self, cmd: list[str]) -> subprocess.Popen:
        """Start one run. The caller starts none after a signal, so a signal seen here came while this one was
        starting: the run gets it too (at worst twice within a moment, which the trainer takes as one)."""
        self.child = subprocess.Popen(cmd, cwd=ROOT)
        if self.signals:
            self.child.send_signal(self.signals[0])
        return self.child

    @property
    def stopped_by(self) -> int:
        return self.signals[0] if self.signals else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, trainer = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = ToolArgumentParser(prog="tools/repeat.py", description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, required=True, help="number of runs")
    ap.add_argument("--first_seed", type=int, default=0, help="seed of the first run; the others count up")
    ap.add_argument("--name", default=time.strftime("repeat-%Y%m%d-%H%M%S"), help="run id prefix")
    ap.add_argument("--launcher", default=None,
                    help="command that starts one run, in the repository root (default ./run.sh; where no CUDA GPU "
                         "is found, python3 train_gpt.py)")
    ap.add_argument("--target", type=finite_float, default=3.28, help="validation loss target of the statistics")
    args = ap.parse_args(ours)
    if args.runs < 1:
        print(f"error: --runs={args.runs}: give at least 1 run (2 or more for a spread and a p-value)",
              file=sys.stderr)
        return 2
    if args.first_seed < 0:
        print(f"error: --first_seed={args.first_seed}: give a seed >= 0 (the trainer's -1 means unseeded)",
              file=sys.stderr)
        return 2
    if re.fullmatch(r"[A-Za-z0-9._-]{1,175}", args.name) is None:   # the trainer's --run_id rule, less -seed<n>
        print(f"error: --name={args.name!r} begins every run's --run_id: use letters, digits, '-', '_' or '.' only, "
              f"at most 175 of them", file=sys.stderr)
        return 2
    clash = [a for a in trainer if (split_option(a) or ("",))[0] in ("seed", "run_id")]
    if clash:
        print(f"error: {clash[0]} is set per run by tools/repeat.py; use --first_seed and --name instead",
              file=sys.stderr)
        return 2
    missing = missing_dependencies("tools/repeat.py", *stats.DEPENDENCIES,
                                   note="no run started, as the statistics after the runs (tools/stats.py) could not "
                                        "be computed")
    if missing:
        print(missing, file=sys.stderr)
        return 2
    if args.launcher is None:
        launcher, note = default_launcher(gpu_count(), os.environ.get("TRAIN", ""), os.getcwd())
        if note:
            print(note, flush=True)
    else:
        try:
            launcher = shlex.split(args.launcher)
        except ValueError as e:
            print(f"error: --launcher={args.launcher}: {e}; quote it as a shell would", file=sys.stderr)
            return 2
        if not launcher:
            print("error: --launcher is empty; give the command that starts one run, e.g. ./run.sh", file=sys.stderr)
            return 2
        launcher[0] = os.path.expanduser(launcher[0])
    trainer = absolute_paths(trainer, os.getcwd())
    log_dir = Path(option(trainer, "log_dir", "logs"))
    if not log_dir.is_absolute():
        log_dir = ROOT / log_dir
    logs, failed = [], []
    forward = Forwarder()
    forward.install()
    try:
        for i in range(args.runs):
            seed = args.first_seed + i
            run_id = f"{args.name}-seed{seed}"
            if forward.stopped_by:  # a signal between two runs: start no other
                name = signal.Signals(forward.stopped_by).name
                print(f"error: stopped by {name} after run {i} of {args.runs}; no further run started; the logs are "
                      f"in {log_dir}; for the rest: --first_seed={seed} --runs={args.runs - i} and another --name",
                      file=sys.stderr)
                return 128 + forward.stopped_by
            cmd = [*launcher, *trainer, f"--seed={seed}", f"--run_id={run_id}"]
            print(f"repeat: run {i + 1}/{args.runs}: {shlex.join(cmd)}", flush=True)
            try:
                child = forward.start(cmd)
            except OSError as e:
                print(f"error: cannot start {cmd[0]}: {e.strerror}; pass a command that exists with --launcher",
                      file=sys.stderr)
                return 2
            code = child.wait()
            forward.child = None
            if code < 0:  # ended by a signal it did not handle: the shell's 128 + N
                code = 128 - code
            log = log_dir / f"{run_id}.txt"
            if log.exists():
                logs.append(str(log))
            if forward.stopped_by or code >= 128:
                signum = forward.stopped_by or code - 128
                try:
                    name = signal.Signals(signum).name
                except ValueError:
                    name = f"signal {signum}"
                code = code or 128 + signum  # it finished all the same: the series still stops
                print(f"repeat: run {run_id} stopped (exit {code})", flush=True)
                saved = (f"its log {log} says what was saved (--resume=...)" if log.exists()
                         else "it stopped before writing its log")
                print(f"error: stopped by {name} during run {i + 1} of {args.runs} ({run_id}, exit {code}); no "
                      f"further run started; {saved}; the logs are in {log_dir}; for the rest: "
                      f"--first_seed={seed} --runs={args.runs - i} and another --name", file=sys.stderr)
                return code
            if code != 0:
                failed.append(run_id)
                print(f"repeat: run {run_id} failed (exit {code})", flush=True)
                if code == 2:  # bad options: the rest would go the same way
                    print(f"error: the series stopped at run {i + 1} of {args.runs} (exit {code} of {run_id}); "
                          f"fix what its error line says and start again", file=sys.stderr)
                    return 2
        print(f"repeat: {args.runs - len(failed)} of {args.runs} runs finished", flush=True)
        if logs:
            stats.main([*logs, f"--target={args.target}"])
        if forward.stopped_by:
            return 128 + forward.stopped_by
        return 1 if failed else 0
    finally:
        forward.uninstall()
        child = forward.child
        if child is not None and child.poll() is None:
            # leaving without waiting (an exception in this process, e.g. a test's timeout): ask the run to stop at
            # its next step boundary, saving what it saves, rather than leave it running unwatched
            child.send_signal(signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main())
