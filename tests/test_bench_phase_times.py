"""bench/phase_times.py: the per-phase step times of a training log, and the before/after table of several."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import phase_times  # noqa: E402


def make_log(step_ms: dict[int, float], val_every: int = 4, ns: int = 12, total: int = 14, peak: int = 1000) -> str:
    """A log in the trainer's format: the hyperparameter block, untimed phases, one line per step with the cumulative
    train time, validations (which stop the clock) and the peak memory. step_ms maps a global batch to its ms/step."""
    batches = sorted(step_ms)
    lines = [f"  num_scheduled_iterations = {ns}",
             "  stages = (" + ", ".join(f"Stage(batch={b}, lr_peak=1.0)" for b in batches) + ")",
             "phase:warmup time:61000ms (state reset and checked)"]
    t = 0.0
    for step in range(total + 1):
        if step % val_every == 0 or step == total:
            lines.append(f"step:{step}/{total} val_loss:{10 - step / 10:.4f} train_time:{t:.0f}ms step_avg:1.00ms")
            lines.append("phase:validation time:1200ms")
            t += 50   # the first step after a validation carries the restart
        if step < total:
            phase = min(step * len(batches) // ns, len(batches) - 1)
            t += step_ms[batches[phase]]
            lines.append(f"step:{step + 1}/{total} train_time:{t:.0f}ms step_avg:1.00ms")
    lines.append(f"peak memory allocated: {peak} MiB reserved: {peak + 500} MiB")
    return "\n".join(lines) + "\n"


def test_summary_takes_each_phases_median_step_without_the_restarts():
    s = phase_times.summarise(make_log({100: 10.0, 200: 20.0, 300: 30.0}))
    assert [(batch, ms) for _, _, batch, ms in s["phases"]] == [(100, 10.0), (200, 20.0), (300, 30.0)]
    assert [(a, b) for a, b, _, _ in s["phases"]] == [(0, 3), (4, 7), (8, 13)]
    assert s["vals"][-1][:2] == (14, "8.6000") and len(s["vals"]) == 5
    assert s["peak"] == (1000, 1500) and s["untimed"][0] == ("warmup", 61.0)


def test_two_logs_give_the_ratio_of_each_phase_to_the_first(tmp_path, capsys):
    before, after = tmp_path / "before.txt", tmp_path / "after.txt"
    before.write_text(make_log({100: 10.0, 200: 20.0, 300: 40.0}))
    after.write_text(make_log({100: 9.0, 200: 20.0, 300: 30.0}, peak=900))
    assert phase_times.main([str(before), str(after)]) == 0
    table = capsys.readouterr().out.split("| | before | after |")[1]
    assert "| ms/step at 100 tokens | 10.0 | 9.0 (0.900x) |" in table
    assert "| ms/step at 200 tokens | 20.0 | 20.0 (1.000x) |" in table
    assert "| ms/step at 300 tokens | 40.0 | 30.0 (0.750x) |" in table
    assert "| peak memory allocated | 1000 MiB | 900 MiB |" in table


def test_a_missing_log_is_one_error_line(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "phase_times.py"), str(tmp_path / "nope.txt")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"error: no log file at {tmp_path / 'nope.txt'}; "
                                             "pass the run's logs/<run_id>.txt"]


@pytest.mark.parametrize("command", ["ab", "full"])
@pytest.mark.parametrize("args", [[], ["/no/such/checkout"]])
def test_bench_ab_without_a_baseline_checkout_is_one_error_line(tmp_path, args, command):
    r = subprocess.run(["bash", str(ROOT / "bench" / "run.sh"), command, *args], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: '{command}' needs the baseline's folder first")
    assert "git worktree add" in lines[0]


@pytest.mark.parametrize("command", ["ab", "full"])
def test_bench_names_an_unknown_run_before_making_data(tmp_path, command):
    """RUNS is checked before anything runs: a typo costs one error line, not a data set and a training run."""
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "DATA": str(tmp_path / "data"), "RUNS": "base nwe"}
    r = subprocess.run(["bash", str(ROOT / "bench" / "run.sh"), command, str(ROOT)], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ["error: RUNS takes base, new and extra, got 'nwe'"]
    assert not (tmp_path / "data").exists()
