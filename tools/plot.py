"""Validation loss curves of one or more runs, against step and against training time.

    python3 tools/plot.py logs/*.txt --out=curves.png [--target=3.28] [--title=TEXT]

Two panels (loss vs step, loss vs train time in seconds), one line per run labelled by its run id, the target as a
dashed horizontal line. Unfinished runs are drawn too (their label says so). Exit codes: 0 written, 2 bad arguments
or no validation line in any log.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runlogs import Run, ToolArgumentParser, read_run  # noqa: E402


IMAGE_SUFFIXES = (".png", ".pdf", ".svg")


def curves(runs: list[Run]) -> list[tuple[str, list[int], list[float], list[float]]]:
    """(label, steps, val losses, train times in s) per run with at least one validation line."""
    out = []
    for r in runs:
        if r.val:
            label = r.run_id if r.finished else f"{r.run_id} ({r.why_excluded.split(':')[0]})"
            steps, losses, times = (list(col) for col in zip(*r.val))
            out.append((label, steps, losses, times))
    return out


def plot(data, out: str, target: float, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for label, steps, losses, times in data:
        line, = by_step.plot(steps, losses, marker=".", label=label)
        by_time.plot(times, losses, marker=".", color=line.get_color(), label=label)
    finals = [losses[-1] for _, _, losses, _ in data]
    # the interesting part is near the target: show every validation but the untrained first one (~10.8 nats)
    later = [x for _, _, losses, _ in data for x in losses[1:]] or finals
    top = max(later + [target]) + 0.05
    for ax, xlabel in ((by_step, "step"), (by_time, "train time (s)")):
        ax.axhline(target, color="k", linestyle="--", linewidth=1, label=f"target {target}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
        ax.set_ylim(min(finals + [target]) - 0.05, top)
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=8)
    fig.suptitle(title)
    path = Path(out)
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")  # same suffix: it sets the format
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    ap = ToolArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+", help="run logs (logs/<run_id>.txt)")
    ap.add_argument("--out", required=True, help="image file to write (.png)")
    ap.add_argument("--target", type=float, default=3.28, help="validation loss drawn as the target line")
    ap.add_argument("--title", default="validation loss", help="figure title")
    args = ap.parse_args(argv)
    try:
        runs = [read_run(p) for p in args.logs]
    except OSError as e:
        print(f"error: cannot read {e.filename}: {e.strerror}; pass existing log files", file=sys.stderr)
        return 2
    data = curves(runs)
    if not data:
        print("error: no validation line in any of the logs; pass logs of runs that reached a validation",
              file=sys.stderr)
        return 2
    out_dir = Path(args.out).resolve().parent
    if not out_dir.is_dir():
        print(f"error: the folder {out_dir} does not exist; create it or choose another --out", file=sys.stderr)
        return 2
    if Path(args.out).suffix.lower() not in IMAGE_SUFFIXES:
        print(f"error: --out={args.out}: name a {', '.join(IMAGE_SUFFIXES)} file", file=sys.stderr)
        return 2
    try:
        plot(data, args.out, args.target, args.title)
    except OSError as e:
        print(f"error: cannot write {args.out}: {e.strerror}; choose a writable --out", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({len(data)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
