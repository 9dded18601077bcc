"""Run the trainer several times with consecutive seeds, then print the statistics of the runs (tools/stats.py).

    python3 tools/repeat.py --runs=4 [--first_seed=0] [--name=NAME] [--target=3.28] -- [train_gpt options]
    python3 tools/repeat.py --runs=3 --launcher="python3 train_gpt.py" -- --preset=tiny ...   # one process, e.g. CPU

Run i gets --seed=<first_seed + i> and --run_id=<name>-seed<seed>; everything after `--` goes to every run. A run
that fails is reported and left out of the statistics, and the next one starts; an option error (exit 2) or a
signal stops the series, since every later run would fail the same way. Exit codes: 0 all runs finished, 1 some
failed, 2 bad arguments or the series stopped.
"""
from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stats  # noqa: E402
from runlogs import ToolArgumentParser  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def option(args: list[str], name: str, default: str) -> str:
    """The value of --name=value in a trainer argument list (the last one wins, as in the trainer)."""
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return values[-1] if values else default


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, trainer = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = ToolArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, required=True, help="number of runs")
    ap.add_argument("--first_seed", type=int, default=0, help="seed of the first run; the others count up")
    ap.add_argument("--name", default=time.strftime("repeat-%Y%m%d-%H%M%S"), help="run id prefix")
    ap.add_argument("--launcher", default="./run.sh", help="command that starts one run (default ./run.sh)")
    ap.add_argument("--target", type=float, default=3.28, help="validation loss target of the statistics")
    args = ap.parse_args(ours)
    if args.runs < 1:
        print(f"error: --runs={args.runs}: give at least 1 run (2 or more for a spread and a p-value)",
              file=sys.stderr)
        return 2
    clash = [a for a in trainer if a.startswith(("--seed=", "--run_id="))]
    if clash:
        print(f"error: {clash[0]} is set per run by tools/repeat.py; use --first_seed and --name instead",
              file=sys.stderr)
        return 2
    log_dir = Path(option(trainer, "log_dir", "logs"))
    if not log_dir.is_absolute():
        log_dir = ROOT / log_dir
    logs, failed = [], []
    for i in range(args.runs):
        seed = args.first_seed + i
        run_id = f"{args.name}-seed{seed}"
        cmd = [*shlex.split(args.launcher), *trainer, f"--seed={seed}", f"--run_id={run_id}"]
        print(f"repeat: run {i + 1}/{args.runs}: {' '.join(cmd)}", flush=True)
        try:
            code = subprocess.run(cmd, cwd=ROOT).returncode
        except OSError as e:
            print(f"error: cannot start {cmd[0]}: {e.strerror}; pass a command that exists with --launcher",
                  file=sys.stderr)
            return 2
        log = log_dir / f"{run_id}.txt"
        if log.exists():
            logs.append(str(log))
        if code != 0:
            failed.append(run_id)
            print(f"repeat: run {run_id} failed (exit {code})", flush=True)
            if code == 2 or code >= 128:  # bad options, or stopped by a signal: the rest would go the same way
                print(f"error: the series stopped at run {i + 1} of {args.runs} (exit {code} of {run_id}); "
                      f"fix what its error line says and start again", file=sys.stderr)
                return 2
    print(f"repeat: {args.runs - len(failed)} of {args.runs} runs finished", flush=True)
    if logs:
        stats.main([*logs, f"--target={args.target}"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
