"""tools/: run statistics and loss-curve plots from run logs (the trainer's log format is the interface)."""
import json
import math
import re
import sys

import numpy as np
import pytest
from scipy import stats as sps

from _shards import ROOT, make_dataset, run_trainer

sys.path.insert(0, str(ROOT / "tools"))
import plot  # noqa: E402
import runlogs  # noqa: E402
import stats  # noqa: E402

TOTAL = 1765


def write_log(path, vals, total=TOTAL, error=None):
    """A log as train_gpt.py writes it: header, training lines, one line per validation, maybe a final error line.
    vals: [(step, val loss, train time in s)]."""
    lines = ["==== train_gpt.py ====", '"""source..."""', "command: --seed=1", "hyperparameters:",
             f"  num_scheduled_iterations = {total - 40}", "phase:startup time:1849ms"]
    for step, loss, t in vals:
        lines.append(f"step:{step}/{total} val_loss:{loss:.4f} train_time:{round(t * 1000)}ms "
                     f"step_avg:{t * 1000 / max(step, 1):.2f}ms")
        lines.append(f"step:{step + 1}/{total} train_time:{round(t * 1000) + 130}ms step_avg:130.00ms")
    if error:
        lines.append(f"error: {error}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def finished_log(tmp_path, name, loss, seconds):
    return write_log(tmp_path / f"{name}.txt",
                     [(0, 10.8258, 0.0), (1000, 3.61, seconds * 0.56), (TOTAL, loss, seconds)])


def run_json(capsys, args):
    assert stats.main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


LOSSES = [3.2771, 3.2795, 3.2782, 3.2768, 3.2790]
TIMES = [88.1, 87.6, 88.4, 87.9, 88.0]


def test_stats_match_independent_formulas_and_exclude_failed_runs(tmp_path, capsys):
    logs = [finished_log(tmp_path, f"run{i}", l, t) for i, (l, t) in enumerate(zip(LOSSES, TIMES))]
    crashed = write_log(tmp_path / "crashed.txt", [(0, 10.8258, 0.0), (1000, 3.6, 50.0)],
                        error="training stopped: the loss is nan at step 1200")
    unfinished = write_log(tmp_path / "cut.txt", [(0, 10.8258, 0.0), (1000, 3.6, 50.0)])
    r = run_json(capsys, [*logs, crashed, unfinished, "--target=3.28"])

    x = np.array(LOSSES)
    n, mean, sd = len(x), x.mean(), math.sqrt(((x - x.mean()) ** 2).sum() / (len(x) - 1))
    t_stat = (mean - 3.28) / (sd / math.sqrt(n))
    assert r["n"] == 5
    assert r["val_loss_mean"] == pytest.approx(mean, rel=1e-12)
    assert r["val_loss_std"] == pytest.approx(sd, rel=1e-12)
    assert r["p_value"] == pytest.approx(sps.t.cdf(t_stat, n - 1), rel=1e-9)
    assert r["val_loss_ci95"] == pytest.approx(list(sps.t.interval(0.95, n - 1, loc=mean, scale=sd / math.sqrt(n))))
    assert r["train_time_mean_s"] == pytest.approx(np.mean(TIMES)) and r["train_time_std_s"] == pytest.approx(
        np.std(TIMES, ddof=1))
    assert [x["run_id"] for x in r["runs"]] == [f"run{i}" for i in range(5)]
    assert {x["log"]: x["reason"] for x in r["excluded"]} == {
        crashed: "failed: training stopped: the loss is nan at step 1200",
        unfinished: f"unfinished: last validation at step 1000 of {TOTAL}"}


def test_stats_welch_comparison_with_a_baseline(tmp_path, capsys):
    new = [finished_log(tmp_path, f"new{i}", l, t) for i, (l, t) in enumerate(zip(LOSSES, TIMES))]
    base_times = [90.2, 89.1, 91.0, 89.7]
    base = [finished_log(tmp_path, f"base{i}", 3.278, t) for i, t in enumerate(base_times)]
    r = run_json(capsys, [*new, "--baseline", *base])
    a, b = np.array(TIMES), np.array(base_times)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))   # Welch-Satterthwaite
    t_stat = (a.mean() - b.mean()) / math.sqrt(va + vb)
    assert r["baseline_n"] == 4
    assert r["time_diff_mean_s"] == pytest.approx(a.mean() - b.mean())
    assert r["time_p_value"] == pytest.approx(sps.t.cdf(t_stat, df), rel=1e-9)
    half = sps.t.ppf(0.975, df) * math.sqrt(va + vb)
    assert r["time_diff_ci95_s"] == pytest.approx([a.mean() - b.mean() - half, a.mean() - b.mean() + half])
    assert r["time_p_value"] < 0.01  # 2 s faster with ~0.3-0.8 s spread


def test_stats_markdown_single_run_and_errors(tmp_path, capsys):
    one = finished_log(tmp_path, "solo", 3.2791, 88.0)
    assert stats.main([one]) == 0
    out = capsys.readouterr().out
    assert "| solo | 3.2791 | 88.0 | 1765 |" in out and "n = 1" in out and "n/a (needs 2 runs" in out
    r = run_json(capsys, [one])
    assert r["val_loss_std"] is None and r["p_value"] is None  # JSON null, not NaN

    crashed = write_log(tmp_path / "c.txt", [(0, 10.8, 0.0)], error="a peer process failed")
    assert stats.main([crashed]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no finished run") and "a peer process failed" in err and err.count("\n") == 1
    assert stats.main([str(tmp_path / "missing.txt")]) == 2
    assert capsys.readouterr().err.startswith("error: cannot read")


def test_plot_writes_a_png_of_every_run_with_validations(tmp_path, capsys):
    a = finished_log(tmp_path, "a", 3.2771, 88.1)
    b = write_log(tmp_path / "b.txt", [(0, 10.8258, 0.0), (500, 4.1, 25.0)], error="stopped by SIGTERM")
    empty = write_log(tmp_path / "empty.txt", [])
    data = plot.curves([runlogs.read_run(p) for p in (a, b, empty)])
    assert [d[0] for d in data] == ["a", "b (failed)"]
    assert data[0][1:] == ([0, 1000, TOTAL], [10.8258, 3.61, 3.2771], [0.0, 88.1 * 0.56, 88.1])
    out = tmp_path / "curves.png"
    assert plot.main([a, b, empty, f"--out={out}"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert not list(tmp_path.glob("*.tmp*"))
    capsys.readouterr()
    assert plot.main([empty, f"--out={tmp_path / 'x.png'}"]) == 2
    assert capsys.readouterr().err.startswith("error: no validation line")
    assert plot.main([a, f"--out={tmp_path / 'nope' / 'x.png'}"]) == 2


@pytest.mark.timeout(900)
def test_tools_read_the_trainers_own_log(tmp_path, capsys):
    """The interface is the trainer's log: a real tiny run's log parses as finished, with its validation lines."""
    train, val = make_dataset(tmp_path / "d", train_tokens=200_000, val_tokens=20_000)
    p = run_trainer(["--preset=tiny", "--num_scheduled_iterations=5", "--num_extension_iterations=1",
                     "--val_loss_every=3", "--warmup=false", "--seed=0", f"--train_files={train}",
                     f"--val_files={val}", f"--log_dir={tmp_path}/logs", "--run_id=tiny"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    run = runlogs.read_run(tmp_path / "logs" / "tiny.txt")
    assert run.finished and run.total_steps == 6 and [v[0] for v in run.val] == [0, 3, 6]
    printed = [line for line in p.stdout.splitlines() if line.startswith("step:") and " val_loss:" in line]
    assert printed[-1].startswith(f"step:6/6 val_loss:{run.final_val_loss:.4f} ")
    r = run_json(capsys, [str(tmp_path / "logs" / "tiny.txt"), "--target=100"])
    assert r["n"] == 1 and r["runs"][0]["val_loss"] == run.final_val_loss

    # the file keeps one fixed format per step; the console adds progress; both end with the result line
    log_lines = (tmp_path / "logs" / "tiny.txt").read_text().splitlines()
    step_lines = [x for x in log_lines if x.startswith("step:") and "val_loss" not in x]
    assert len(step_lines) == 6
    assert all(re.fullmatch(r"step:\d+/6 train_time:\d+ms step_avg:[\d.]+ms", x) for x in step_lines)
    shown = [x for x in p.stdout.splitlines() if x.startswith("step:") and "val_loss" not in x]
    assert re.fullmatch(r"step:6/6 train_time:\d+ms step_avg:[\d.]+ms  100% [\d,]+ tok/s ETA 0m00s", shown[-1])
    want = (f"result: val_loss:{run.final_val_loss:.4f} target:3.28 reached:no train_time:{run.train_time_s:.1f}s "
            f"steps:6 peak_memory:n/a log:{tmp_path / 'logs' / 'tiny.txt'}")
    assert log_lines[-1] == want and p.stdout.splitlines()[-1] == want


def test_progress_note_counts_tokens_not_steps():
    import train_gpt as tg
    import harness
    # 1M of 20M tokens in 5 s: 200,000 tok/s, 19M left: 95 s, whatever the step count says
    assert harness.progress_note(10, 100, 5000, 1_000_000, 20_000_000) == "  10% 200,000 tok/s ETA 1m35s"
    assert harness.progress_note(1, 1765, 1000, 1000, 4_000_000) == "  0% 1,000 tok/s ETA 1h06m"
    line = harness.result_line(3.2791, 3.28, 88_123, 1765, 31010, None)
    assert line == ("result: val_loss:3.2791 target:3.28 reached:yes train_time:88.1s steps:1765 "
                    "peak_memory:31010MiB log:None")
    # the result line shows the time the last step line gave in whole ms: 4050.4 ms is "4050ms" there, which a log
    # reader takes as 4.05 s and shows as 4.0 s (4.05 is 4.0499... in binary), never as 4.1 s
    for ms in (4049.6, 4050.4, 4149.5, 88_123.0, 0.4):
        step_ms = float(f"{ms:.0f}")
        assert f"train_time:{step_ms / 1000:.1f}s " in harness.result_line(3.3, 3.28, ms, 6, None, None)


@pytest.mark.timeout(900)
def test_repeat_runs_consecutive_seeds_and_prints_their_statistics(tmp_path, capsys):
    import repeat
    train, val = make_dataset(tmp_path / "d", train_tokens=200_000, val_tokens=20_000)
    trainer = ["--preset=tiny", "--num_scheduled_iterations=6", "--num_extension_iterations=0", "--warmup=false",
               f"--train_files={train}", f"--val_files={val}", f"--log_dir={tmp_path}/logs"]
    code = repeat.main(["--runs=2", "--first_seed=5", "--name=t", "--launcher", f"{sys.executable} train_gpt.py",
                        "--", *trainer])
    out = capsys.readouterr().out
    assert code == 0
    runs = [runlogs.read_run(tmp_path / "logs" / f"t-seed{s}.txt") for s in (5, 6)]
    assert all(r.finished for r in runs) and runs[0].final_val_loss != runs[1].final_val_loss  # different seeds
    assert "| t-seed5 |" in out and "| t-seed6 |" in out and "n = 2" in out

    assert repeat.main(["--runs=2", "--", "--seed=3"]) == 2
    assert "set per run" in capsys.readouterr().err
    # an option error stops the series at the first run
    code = repeat.main(["--runs=3", "--name=bad", "--launcher", f"{sys.executable} train_gpt.py", "--", *trainer,
                        "--num_heads=5"])
    captured = capsys.readouterr()
    assert code == 2 and "stopped at run 1 of 3" in captured.err


def test_tools_reject_bad_input_with_one_error_line(tmp_path, capsys):
    import repeat
    log = finished_log(tmp_path, "a", 3.2771, 88.1)
    with open(log, "a") as f:
        f.write("step:1765/1765 val_loss:garbled train_time:1ms step_avg:1ms\n")  # not a validation line: ignored
    assert runlogs.read_run(log).final_val_loss == 3.2771
    for call, args in ((stats.main, [log, "--target=abc"]), (stats.main, []), (plot.main, [log]),
                       (repeat.main, ["--runs=two"])):
        with pytest.raises(SystemExit) as e:
            call(args)
        err = capsys.readouterr().err.splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and "--help" in err[0], err
    assert plot.main([log, f"--out={tmp_path / 'c.xyz'}"]) == 2
    assert capsys.readouterr().err.startswith("error: --out=")
    assert plot.main([log, f"--out={log}/c.svg"]) == 2                   # under a file, not a folder
    assert capsys.readouterr().err.startswith(f"error: {log} is a file, not a folder")
    for name in ("a/b", "x" * 176, "a b"):                                # every run's --run_id begins with it
        assert repeat.main(["--runs=1", f"--name={name}", "--launcher=/nonexistent/launcher"]) == 2
        assert capsys.readouterr().err.startswith(f"error: --name={name!r} begins every run's --run_id")
    assert plot.main([log, f"--out={tmp_path / 'c.svg'}"]) == 0 and (tmp_path / "c.svg").read_text().count("<svg")
    assert repeat.main(["--runs=1", "--launcher=/nonexistent/launcher", "--", "--preset=tiny"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("error: cannot start /nonexistent/launcher")


def tiny_run_log(tmp_path, name="tiny"):
    """A tiny CPU run's log (README, Try it on a CPU): 10.8 untrained, then 9.5 down to 7.0, far above 3.28."""
    return write_log(tmp_path / f"{name}.txt", [(0, 10.8258, 0.0), (8, 9.5, 12.0), (16, 8.4, 24.0), (24, 7.6, 36.0),
                                               (26, 7.0, 39.0)], total=26)


def target_lines(ax, target):
    return [line for line in ax.get_lines() if len(line.get_ydata()) and set(line.get_ydata()) == {target}]


def legend_texts(fig):
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_plot_scales_to_a_tiny_runs_losses_and_says_the_target_is_off_the_scale(tmp_path):
    """9.5 -> 7.0 fills the loss axis: 3.28 is neither in its range nor drawn, and the legend says it is off the
    scale. The untrained first validation (10.8) stays above the axis, as before."""
    import matplotlib.pyplot as plt
    data = plot.curves([runlogs.read_run(tiny_run_log(tmp_path))])
    fig = plot.figure(data, 3.28, "tiny")
    try:
        for ax in fig.axes:
            low, high = ax.get_ylim()
            assert 6.5 < low <= 7.0 and 9.5 <= high < 10.0, (low, high)
            assert target_lines(ax, 3.28) == []
        assert "target 3.28: off the scale (below these losses)" in legend_texts(fig)
    finally:
        plt.close(fig)
    assert plot.y_range(data, 3.28) == (pytest.approx(6.9), pytest.approx(9.6), False)
    # a target above every loss is off the scale the other way
    fig = plot.figure(data, 20.0, "t")
    assert "target 20.0: off the scale (above these losses)" in legend_texts(fig)
    plt.close(fig)
    out = tmp_path / "tiny.png"
    assert plot.main([str(tmp_path / "tiny.txt"), f"--out={out}"]) == 0 and out.stat().st_size > 10_000


def test_plot_draws_the_target_line_where_the_losses_come_near_it(tmp_path):
    """Record runs end near 3.28: the axis reaches the target, drawn as a dashed line on both panels."""
    import matplotlib.pyplot as plt
    runs = [runlogs.read_run(finished_log(tmp_path, name, loss, 88.0)) for name, loss in (("a", 3.2771),
                                                                                            ("b", 3.3512))]
    fig = plot.figure(plot.curves(runs), 3.28, "record")
    try:
        for ax in fig.axes:
            low, high = ax.get_ylim()
            assert low < 3.28 < 3.61 < high < 4.0, (low, high)
            assert len(target_lines(ax, 3.28)) == 1
        assert "target 3.28" in legend_texts(fig) and not any("off the scale" in t for t in legend_texts(fig))
    finally:
        plt.close(fig)
    # near: within half the losses' span of them (at least 0.25 nats), on either side
    one = [("a", [100], [3.5], [10.0])]
    assert plot.y_range(one, 3.28)[2] and plot.y_range(one, 3.74)[2]
    assert not plot.y_range(one, 3.2)[2] and not plot.y_range(one, 3.8)[2]
    spread = [("a", [0, 1, 2], [10.8, 5.0, 4.0], [0, 1, 2])]          # span 1.0 (the first validation aside)
    assert plot.y_range(spread, 3.5)[2] and not plot.y_range(spread, 3.4)[2]
