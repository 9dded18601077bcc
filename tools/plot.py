"""Validation loss curves of one or more runs, against step and against training time.

    python3 tools/plot.py logs/*.txt --out=curves.png [--target=3.28] [--title=TEXT]

Two panels (loss vs step, loss vs train time in seconds), one line per run labelled by its run id, the target as a
dashed horizontal line. The loss axis spans the runs' losses (but the untrained first validation); the target line is
drawn when it lies near them, else the legend says it is off the scale (a tiny run's 9.5 -> 7.0 against 3.28).
Unfinished, failed and diverged runs are drawn too (their label says so; a NaN or infinite validation loss is left
out of the curve, and so is one above 1e6, too large to draw: "left out of <log>: ...").
Logs with nothing to draw (no validation line, not a train_gpt.py log, unreadable, named twice, only losses too large)
are listed as "skipped <log>: <reason>". The image is written atomically. Needs matplotlib
(python3 -m pip install -r tools/requirements.txt). Exit codes: 0 written, 2 bad arguments, a log that does not
exist, no validation line in any log, or matplotlib missing.
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runlogs import Run, ToolArgumentParser, finite_float, load_runs, missing_dependencies, user_path  # noqa: E402


IMAGE_SUFFIXES = (".png", ".pdf", ".svg")
# Validation losses above this are left out of the curve and listed: an axis that reaches 1.7e308 cannot be drawn
# (matplotlib's tick arithmetic overflows), and no run that far gone says anything a 1e6 point would not.
DRAWABLE_LOSS = 1e6
# The target line is drawn when it lies within half the plotted losses' span of them, or within this many nats.
TARGET_NEAR = 0.25


def drawable(x: float) -> bool:
    return math.isfinite(x) and abs(x) <= DRAWABLE_LOSS


def curves(runs: list[Run]) -> list[tuple[str, list[int], list[float], list[float]]]:
    """(label, steps, val losses, train times in s) per run with at least one validation line."""
    out = []
    for r in runs:
        if r.is_log and r.val:
            label = r.run_id if r.finished else f"{r.run_id} ({r.why_excluded.split(':')[0]})"
            steps, losses, times = (list(col) for col in zip(*r.val))
            out.append((label, steps, losses, times))
    return out


def finite(data):
    """The curves without their NaN, infinite or too large (DRAWABLE_LOSS) validations, and without curves left
    empty."""
    out = []
    for label, steps, losses, times in data:
        keep = [(s, x, t) for s, x, t in zip(steps, losses, times) if drawable(x)]
        if keep:
            out.append((label, *(list(col) for col in zip(*keep))))
    return out


def too_large(r: Run) -> str:
    """Which of r's validation losses are finite but not drawable ("" if none)."""
    huge = [(s, x) for s, x, _ in r.val if math.isfinite(x) and not drawable(x)]
    if not huge:
        return ""
    return (f"{len(huge)} validation loss(es) above {DRAWABLE_LOSS:g}, too large to draw ({huge[0][1]:.4g} at step "
            f"{huge[0][0]})")


def why_not_drawn(r: Run) -> str:
    huge = too_large(r) if r.is_log else ""
    return r.why_excluded if not huge else huge if r.finished else f"{r.why_excluded}; {huge}"


def plain(text: str) -> str:
    """Text matplotlib shows as it is (a `$` would start mathtext, which can fail to parse)."""
    return text.replace("$", r"\$")


def y_range(data, target: float) -> tuple[float, float, bool]:
    """(bottom, top, whether the target line is drawn) of the loss axis, for curves that `finite` kept. The axis
    spans the losses from the lowest one to the highest but each run's first validation (the untrained ~10.8 nats,
    which would squeeze the rest; a run with one validation keeps it). The target widens it only when it lies near
    them, within half their span (at least TARGET_NEAR nats): record runs show the target, a tiny run's 9.5 -> 7.0
    is not squeezed into the top of an axis reaching down to 3.28, and its legend says the target is off the
    scale."""
    low = min(x for _, _, losses, _ in data for x in losses)
    high = max(x for _, _, losses, _ in data for x in (losses[1:] or losses))
    near = max(0.5 * (high - low), TARGET_NEAR)
    shown = low - near <= target <= high + near
    if shown:
        low, high = min(low, target), max(high, target)
    pad = max(0.05, 0.04 * (high - low))
    return low - pad, high + pad, shown


def figure(data, target: float, title: str):
    """The two panels of the curves that `finite` keeps, as a matplotlib Figure (the Agg backend: files only)."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    data = finite(data)
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for label, steps, losses, times in data:
        line, = by_step.plot(steps, losses, marker=".", label=plain(label))
        by_time.plot(times, losses, marker=".", color=line.get_color(), label=plain(label))
    bottom, top, shown = y_range(data, target)
    for ax, xlabel in ((by_step, "step"), (by_time, "train time (s)")):
        if shown:
            ax.axhline(target, color="k", linestyle="--", linewidth=1, label=f"target {target}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
        ax.set_ylim(bottom, top)
        ax.grid(alpha=0.3)
    if not shown:  # a legend entry without a line on the axes
        side = "below" if target < bottom else "above"
        by_step.plot([], [], color="k", linestyle="--", linewidth=1,
                     label=f"target {target}: off the scale ({side} these losses)")
    by_step.legend(fontsize=8)
    fig.suptitle(plain(title))
    return fig


def plot(data, out: str, target: float, title: str) -> None:
    import matplotlib.pyplot as plt

    fig = figure(data, target, title)
    path = Path(out)
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")  # same suffix: it sets the format
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    ap = ToolArgumentParser(prog="tools/plot.py", description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+", type=user_path, help="run logs (logs/<run_id>.txt)")
    ap.add_argument("--out", required=True, type=user_path, help="image file to write (.png, .pdf or .svg)")
    ap.add_argument("--target", type=finite_float, default=3.28, help="validation loss drawn as the target line")
    ap.add_argument("--title", default="validation loss", help="figure title")
    args = ap.parse_args(argv)
    missing = missing_dependencies("tools/plot.py", "matplotlib")
    if missing:
        print(missing, file=sys.stderr)
        return 2
    try:
        runs, repeats = load_runs(args.logs)
    except FileNotFoundError as e:
        print(f"error: cannot read {e.filename}: {e.strerror}; pass existing log files", file=sys.stderr)
        return 2
    data = finite(curves(runs))
    if not data:
        reasons = "; ".join(f"{r.path}: {why_not_drawn(r)}" for r in runs)
        print(f"error: no validation line in any of the logs ({reasons}); pass logs of runs that reached a "
              f"validation", file=sys.stderr)
        return 2
    out_dir = Path(args.out).resolve().parent
    if not out_dir.is_dir():
        what = "is a file, not a folder" if out_dir.exists() else "does not exist"
        print(f"error: {out_dir} {what}; create that folder or choose another --out", file=sys.stderr)
        return 2
    if Path(args.out).suffix.lower() not in IMAGE_SUFFIXES:
        print(f"error: --out={args.out}: name a {', '.join(IMAGE_SUFFIXES)} file", file=sys.stderr)
        return 2
    if Path(args.out).is_dir():
        print(f"error: --out={args.out} is a folder; name an image file", file=sys.stderr)
        return 2
    try:
        plot(data, args.out, args.target, args.title)
    except OSError as e:
        print(f"error: cannot write {args.out}: {e.strerror}; choose a writable --out", file=sys.stderr)
        return 2
    for r in runs:
        if not (r.is_log and any(drawable(x) for _, x, _ in r.val)):
            print(f"skipped {r.path}: {why_not_drawn(r)}")
        elif too_large(r):
            print(f"left out of {r.path}: {too_large(r)}")
    for path, reason in repeats:
        print(f"skipped {path}: {reason}")
    print(f"wrote {args.out} ({len(data)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
