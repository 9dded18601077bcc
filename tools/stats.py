"""Statistics of a set of runs, ready for a record README.

    python3 tools/stats.py logs/*.txt [--target=3.28] [--baseline OLD_LOG ...] [--json]

Prints one row per finished run (final validation loss, train time, steps), then n, mean, sample standard deviation
and 95% confidence interval of the loss and the time, and the one-sided one-sample t-test p-value for "the mean
final validation loss is below the target". With --baseline, also Welch's t-test p-value for "these runs train
faster than the baseline runs" and the mean time difference with its 95% confidence interval. Logs of failed,
diverged or unfinished runs, and files that are not train_gpt.py logs (empty, binary, foreign, unreadable), are
listed with the reason and left out of every number. --json prints one JSON object instead.

Each run counts once:
  * a log named twice (the same file, however the path is spelled) is read once;
  * a resumed run is one run with the run it continues. Its log (by default <run_id>-from<S>.txt) has the line
    `resumed from <log_dir>/<run_id>/state_step<S>.pt after step S`: the checkpoint's folder names the run id, so
    that log continues the log <run_id>.txt of the same set (the one in the continuation's folder if several
    share the name). Logs linked this way form one run, whose result is that of its finished log that was resumed
    from the latest step (the later one on the command line on a tie): its validation lines carry the whole run's
    train_time, since the clock is saved with the state. Every other log of that run is excluded, as "continued by
    <log>" (or "same run as <log>" for a second continuation of one checkpoint folder), even if it finished.
    The runs and the --baseline runs are grouped separately.
Needs numpy and scipy (python3 -m pip install -r tools/requirements.txt); without them, one error line says so.
Exit codes: 0 done, 2 bad arguments, a log that does not exist, no finished run to summarise, or numpy or scipy
missing.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runlogs import (Run, ToolArgumentParser, checkpoint_folder, finite_float, load_runs,  # noqa: E402
                     missing_dependencies, user_path)

try:
    import numpy as np
    from scipy import stats as sps
except Exception:  # noqa: BLE001 (missing or broken: main() says which, in one line, with the install line)
    np = sps = None
DEPENDENCIES = ("numpy", "scipy.stats")


def summary(values: list[float]) -> dict[str, float]:
    """n, mean, sample std (ddof=1) and the 95% t confidence interval of the mean (NaN where n < 2)."""
    x = np.asarray(values, dtype=np.float64)
    n = len(x)
    mean = float(x.mean())
    if n < 2:
        return {"n": n, "mean": mean, "std": math.nan, "ci95": (math.nan, math.nan)}
    std = float(x.std(ddof=1))
    half = float(sps.t.ppf(0.975, n - 1)) * std / math.sqrt(n)
    return {"n": n, "mean": mean, "std": std, "ci95": (mean - half, mean + half)}


def p_below_target(losses: list[float], target: float) -> float:
    """One-sided one-sample t-test of H1: mean < target (NaN for fewer than 2 runs or zero spread)."""
    if len(losses) < 2 or np.std(losses) == 0:
        return math.nan
    return float(sps.ttest_1samp(losses, target, alternative="less").pvalue)


def welch_faster(times: list[float], baseline: list[float]) -> dict[str, float]:
    """Welch's t-test of H1: mean(times) < mean(baseline), and mean(times) - mean(baseline) with its 95% CI."""
    a, b = np.asarray(times, np.float64), np.asarray(baseline, np.float64)
    diff = float(a.mean() - b.mean())
    if len(a) < 2 or len(b) < 2:
        return {"diff": diff, "ci95": (math.nan, math.nan), "p_value": math.nan}
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return {"diff": diff, "ci95": (diff, diff), "p_value": math.nan}
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = float(sps.t.ppf(0.975, df)) * se
    p = float(sps.ttest_ind(a, b, equal_var=False, alternative="less").pvalue)
    return {"diff": diff, "ci95": (diff - half, diff + half), "p_value": p}


def continued(runs: list[Run]) -> dict[int, int]:
    """{index of a resumed run's log: index of the log it continues}, within `runs` (see the module docstring)."""
    by_id: dict[str, list[int]] = {}
    for i, r in enumerate(runs):
        by_id.setdefault(Path(r.path).stem, []).append(i)
    links = {}
    for i, r in enumerate(runs):
        folder = checkpoint_folder(r) if r.is_log else None
        if folder is None:
            continue
        candidates = [j for j in by_id.get(folder.name, []) if j != i]
        if len(candidates) > 1:  # the same run id in several folders: the one beside the continuation
            here = Path(r.path).resolve().parent
            candidates = [j for j in candidates if Path(runs[j].path).resolve().parent == here] or candidates
        if candidates:
            links[i] = candidates[0]
    return links


def load(paths: list[str]) -> tuple[list[Run], list[tuple[str, str]]]:
    """(the finished runs, each counted once; [(log, reason)] for every log left out). Raises FileNotFoundError for
    a path that does not exist."""
    runs, excluded = load_runs(paths)
    links = continued(runs)
    root = list(range(len(runs)))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    for i, j in links.items():
        root[find(i)] = find(j)
    groups: dict[int, list[int]] = {}
    for i in range(len(runs)):
        groups.setdefault(find(i), []).append(i)
    done, left_out = [], {}
    for members in groups.values():
        finished = [i for i in members if runs[i].finished]
        counted = max(finished, key=lambda i: (runs[i].resumed_step, i)) if finished else None
        for i in members:
            if i == counted:
                continue
            r = runs[i]
            own = "finished" if r.finished else r.why_excluded
            followers = [k for k, j in links.items() if j == i]
            if followers:
                head = f"continued by {runs[counted if counted in followers else followers[-1]].path}"
            elif counted is not None:
                head = f"same run as {runs[counted].path}"
            else:
                left_out[i] = own
                continue
            tail = f"one run, counted once as {runs[counted].path}" if counted is not None else "one run"
            left_out[i] = f"{head} ({tail}; this log: {own})"
        if counted is not None:
            done.append(counted)
    done.sort()
    return ([runs[i] for i in done],
            [(runs[i].path, left_out[i]) for i in sorted(left_out)] + excluded)


def fmt(x: float, digits: int = 4) -> str:
    return "n/a" if math.isnan(x) else f"{x:.{digits}f}"


def report(done: list[Run], excluded: list[tuple[str, str]], target: float, base: list[Run] | None) -> dict:
    losses = [r.final_val_loss for r in done]
    times = [r.train_time_s for r in done]
    loss_s, time_s = summary(losses), summary(times)
    out = {"n": loss_s["n"], "target": target,
           "val_loss_mean": loss_s["mean"], "val_loss_std": loss_s["std"], "val_loss_ci95": list(loss_s["ci95"]),
           "p_value": p_below_target(losses, target),
           "train_time_mean_s": time_s["mean"], "train_time_std_s": time_s["std"],
           "train_time_ci95_s": list(time_s["ci95"]),
           "runs": [{"run_id": r.run_id, "val_loss": r.final_val_loss, "train_time_s": r.train_time_s,
                     "steps": r.total_steps, "log": r.path} for r in done],
           "excluded": [{"log": log, "reason": reason} for log, reason in excluded]}
    if base is not None:
        w = welch_faster(times, [r.train_time_s for r in base])
        out.update(baseline_n=len(base), baseline_train_time_mean_s=float(np.mean([r.train_time_s for r in base])),
                   time_diff_mean_s=w["diff"], time_diff_ci95_s=list(w["ci95"]), time_p_value=w["p_value"])
    return out


def json_safe(x):
    """Values JSON can hold: NaN (a statistic that needs more runs) as null, an infinity (a sum or spread of values
    too large for a double, e.g. losses near 1.7e308) as the string "inf" or "-inf"."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def markdown(r: dict) -> str:
    lines = ["| run | final val loss | train time (s) | steps |", "|---|---|---|---|"]
    lines += [f"| {x['run_id']} | {x['val_loss']:.4f} | {x['train_time_s']:.1f} | {x['steps']} |" for x in r["runs"]]
    lo, hi = r["val_loss_ci95"]
    tlo, thi = r["train_time_ci95_s"]
    lines += ["",
              f"n = {r['n']}",
              f"val loss: mean {fmt(r['val_loss_mean'])}, std {fmt(r['val_loss_std'])}, "
              f"95% CI [{fmt(lo)}, {fmt(hi)}]",
              f"train time: mean {fmt(r['train_time_mean_s'], 1)} s, std {fmt(r['train_time_std_s'], 1)} s, "
              f"95% CI [{fmt(tlo, 1)}, {fmt(thi, 1)}] s",
              f"p(mean val loss < {r['target']}) one-sided t-test: "
              + (fmt(r["p_value"], 4) if not math.isnan(r["p_value"]) else "n/a (needs 2 runs with some spread)")]
    if "baseline_n" in r:
        dlo, dhi = r["time_diff_ci95_s"]
        lines.append(f"vs {r['baseline_n']} baseline runs (mean {r['baseline_train_time_mean_s']:.1f} s): time "
                     f"difference {r['time_diff_mean_s']:+.1f} s, 95% CI [{fmt(dlo, 1)}, {fmt(dhi, 1)}] s, "
                     f"p(faster) Welch one-sided: {fmt(r['time_p_value'], 4)}")
    for x in r["excluded"]:
        lines.append(f"excluded {x['log']}: {x['reason']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = ToolArgumentParser(prog="tools/stats.py", description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+", type=user_path, help="run logs (logs/<run_id>.txt)")
    ap.add_argument("--target", type=finite_float, default=3.28, help="validation loss to beat (default 3.28)")
    ap.add_argument("--baseline", nargs="+", type=user_path, default=None, metavar="LOG",
                    help="logs of the runs to compare times with")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the markdown")
    args = ap.parse_args(argv)
    missing = missing_dependencies("tools/stats.py", *DEPENDENCIES)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    try:
        done, excluded = load(args.logs)
        base = None
        if args.baseline is not None:
            base, base_excluded = load(args.baseline)
            excluded += base_excluded
    except FileNotFoundError as e:
        print(f"error: cannot read {e.filename}: {e.strerror}; pass existing log files", file=sys.stderr)
        return 2
    if not done or (base is not None and not base):
        which = "baseline " if done else ""
        reasons = "; ".join(f"{log}: {reason}" for log, reason in excluded) or "no logs"
        print(f"error: no finished {which}run to summarise ({reasons}); pass logs of runs that reached their last "
              f"step", file=sys.stderr)
        return 2
    with np.errstate(all="ignore"):     # overflow in a mean of huge values: inf, written as "inf"
        r = report(done, excluded, args.target, base)
    print(json.dumps(json_safe(r), indent=1, allow_nan=False) if args.json else markdown(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
