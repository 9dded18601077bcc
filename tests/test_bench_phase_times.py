"""bench/phase_times.py: the per-phase step times of a training log, and the before/after table of several."""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
import phase_times  # noqa: E402
import train_gpt  # noqa: E402


def make_log(step_ms: dict[int, float], val_every: int = 4, ns: int = 12, total: int = 14, peak: int = 1000,
             ext_ms: float | None = None) -> str:
    """A log in the trainer's format: the hyperparameter block, untimed phases, one line per step with the cumulative
    train time in whole milliseconds, validations (which stop the clock) and the peak memory. step_ms maps a global
    batch to its ms/step; ext_ms is the extension steps' (those after ns), default the last batch's."""
    batches = sorted(step_ms)
    lines = [f"  num_scheduled_iterations = {ns}",
             "  stages = (" + ", ".join(f"Stage(batch={b}, lr_peak=1.0)" for b in batches) + ")",
             "phase:warmup time:61000ms (state reset and checked)"]
    t = 0.0
    for step in range(total + 1):
        if step % val_every == 0 or step == total:
            lines.append(f"step:{step}/{total} val_loss:{max(10 - step / 10, 1):.4f} "
                         f"train_time:{t:.0f}ms step_avg:1.00ms")
            lines.append("phase:validation time:1200ms")
            t += 50   # the first step after a validation carries the restart
        if step < total:
            phase = min(step * len(batches) // ns, len(batches) - 1)
            t += ext_ms if step >= ns and ext_ms is not None else step_ms[batches[phase]]
            lines.append(f"step:{step + 1}/{total} train_time:{t:.0f}ms step_avg:1.00ms")
    lines.append(f"peak memory allocated: {peak} MiB reserved: {peak + 500} MiB")
    return "\n".join(lines) + "\n"


def test_summary_takes_each_phases_mean_step_without_the_restarts():
    s = phase_times.summarise(make_log({100: 10.0, 200: 20.0, 300: 30.0}))
    assert [(batch, ms) for _, _, batch, ms in s["phases"]] == [(100, 10.0), (200, 20.0), (300, 30.0)]
    assert [(a, b) for a, b, _, _ in s["phases"]] == [(0, 3), (4, 7), (8, 11)]
    assert s["extension"] is None   # two extension steps: none left once its first steps are skipped
    assert s["vals"][-1][:2] == (14, "8.6000") and len(s["vals"]) == 5
    assert s["peak"] == (1000, 1500) and s["untimed"][0] == ("warmup", 61.0)


def test_two_logs_give_the_ratio_of_each_phase_to_the_first(tmp_path, capsys):
    before, after = tmp_path / "before.txt", tmp_path / "after.txt"
    before.write_text(make_log({100: 10.0, 200: 20.0, 300: 40.0}))
    after.write_text(make_log({100: 9.0, 200: 20.0, 300: 30.0}, peak=900))
    assert phase_times.main([str(before), str(after)]) == 0
    table = capsys.readouterr().out.split("| | before | after |")[1]
    assert "| ms/step at 100 tokens | 10.00 | 9.00 (0.900x) |" in table
    assert "| ms/step at 200 tokens | 20.00 | 20.00 (1.000x) |" in table
    assert "| ms/step at 300 tokens | 40.00 | 30.00 (0.750x) |" in table
    assert "| peak memory allocated | 1000 MiB | 900 MiB |" in table


def test_whole_millisecond_lines_still_give_a_fraction_of_a_millisecond_and_the_extension_its_own_row():
    """The log's train_time has whole milliseconds: 53.25 ms steps log differences of 53 and 54, whose median would
    say 53.0 (1.4% off, more than the changes these tables measure)."""
    s = phase_times.summarise(make_log({131072: 53.25}, val_every=100, ns=400, total=440, ext_ms=57.5))
    (a, b, batch, ms), = s["phases"]
    assert (a, b, batch) == (0, 399, 131072) and abs(ms - 53.25) < 0.02
    a, b, batch, ms = s["extension"]
    assert (a, b, batch) == (400, 439, 131072) and abs(ms - 57.5) < 0.05


def test_the_table_gives_the_extension_and_train_time_with_their_ratios(tmp_path, capsys):
    before, after = tmp_path / "before.txt", tmp_path / "after.txt"
    before.write_text(make_log({100: 10.0, 200: 20.0}, val_every=10, ns=40, total=50, ext_ms=30.0))
    after.write_text(make_log({100: 10.0, 200: 20.0}, val_every=10, ns=40, total=50, ext_ms=24.0))
    assert phase_times.main([str(before), str(after)]) == 0
    table = capsys.readouterr().out.split("| | before | after |")[1]
    assert "| ms/step in the extension | 30.00 | 24.00 (0.800x) |" in table
    # train_time: 20 steps of 10 ms, 20 of 20, 10 of the extension and a 50 ms restart after each of 5 validations
    assert f"| train_time | {(200 + 400 + 300 + 250) / 1000:.1f} s | {(200 + 400 + 240 + 250) / 1000:.1f} s " \
           f"({1090 / 1150:.3f}x) |" in table


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


@pytest.mark.parametrize("command, preset", [("ab", "bench"), ("full", "full")])
def test_bench_makes_the_data_set_its_runs_read(tmp_path, command, preset):
    """`full` trains the whole schedule: one shard of the shortened runs' set would stop it at its data check."""
    record = tmp_path / "args.txt"
    python = tmp_path / "python"   # stands in for the interpreter: notes what it was asked to run, then fails
    python.write_text(f'#!/bin/sh\necho "$@" > {record}\nexit 3\n')
    python.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "DATA": str(tmp_path / "data"), "PYTHON": str(python)}
    r = subprocess.run(["bash", str(ROOT / "bench" / "run.sh"), command, str(ROOT)], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 1 and r.stderr.startswith("error: making synthetic shards")
    assert record.read_text().split() == ["data/synthetic.py", "--out", str(tmp_path / "data"), f"--preset={preset}"]


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_bench_rank8_gives_each_gpu_one_micro_batch_of_the_8_gpu_size(tmp_path, gpus):
    """`rank8` times an 8-GPU rank's step on fewer GPUs: the options it passes to the run and to the profile must give
    every GPU one micro-batch per step, of the size a rank of the default 8-GPU run trains and validates on."""
    record = tmp_path / "calls.txt"
    python = tmp_path / "python"   # runs `-c` snippets, notes every other call (the profile) and succeeds
    python.write_text(f'#!/bin/sh\nif [ "$1" = -c ]; then exec {sys.executable} "$@"; fi\n'
                      f'echo "python $@" >> {record}\n')
    runsh = tmp_path / "run.sh"    # stands in for ./run.sh: notes NPROC and its options
    runsh.write_text(f'#!/bin/sh\necho "run.sh NPROC=$NPROC $@" >> {record}\n')
    for f in (python, runsh):
        f.chmod(0o755)
    data = tmp_path / "data"
    data.mkdir()
    (data / "fineweb_val_000000.bin").write_bytes(b"")    # a made set: no synthetic.py call
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "DATA": str(data), "PYTHON": str(python),
           "RUNSH": str(runsh), "NPROC": str(gpus), "SMI": ""}
    r = subprocess.run(["bash", str(ROOT / "bench" / "run.sh"), "rank8", "--seed=1"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    run, profile = record.read_text().splitlines()
    assert run.startswith(f"run.sh NPROC={gpus} ") and profile.startswith("python bench/profile_step.py --run ")
    default = train_gpt.Hyperparameters()
    for call in (run, profile):
        opts = [a for a in call.split() if a.startswith(("--batch_slices", "--stages", "--val_batch_size"))]
        assert len(opts) == 3 and call.endswith("--seed=1")
        hp = train_gpt.parse_args(opts)
        assert hp.batch_slices == gpus                                   # one micro-batch per GPU and step
        assert [train_gpt.micro_batch_tokens(s.batch, gpus) for s in hp.stages] == [
            train_gpt.micro_batch_tokens(s.batch, 8) for s in default.stages]
        assert hp.val_batch_size // gpus == default.val_batch_size // 8
        assert [dataclasses.replace(s, batch=0) for s in hp.stages] == [
            dataclasses.replace(s, batch=0) for s in default.stages]


def test_bench_rank8_logs_the_gpus_clocks_around_both_runs(tmp_path):
    """With an nvidia-smi (a stand-in here that logs one line and waits to be stopped), rank8 logs from before the run
    to after the profile, stops the logger and hands the log to bench/gpu_clocks.py."""
    record = tmp_path / "calls.txt"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1" = -c ]; then exec {sys.executable} "$@"; fi\n'
                      f'echo "python $@" >> {record}\n')
    out = tmp_path / "out"
    runsh = tmp_path / "run.sh"   # waits (up to 40 s) for the logger's first line, however slow its start
    runsh.write_text(f'#!/bin/sh\nfor i in $(seq 400); do [ -s {out}/rank8_clocks.csv ] && break; sleep 0.1; done\n'
                     f'echo "run.sh" >> {record}\n')
    smi = tmp_path / "smi"
    smi.write_text(f'#!/bin/sh\necho "smi $@" >> {record}\necho "0, 1600, 690, 50, 0x4"\nexec sleep 600\n')
    for f in (python, runsh, smi):
        f.chmod(0o755)
    data = tmp_path / "data"
    data.mkdir()
    (data / "fineweb_val_000000.bin").write_bytes(b"")
    env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "DATA": str(data), "PYTHON": str(python), "RUNSH": str(runsh),
           "NPROC": "2", "SMI": str(smi)}
    r = subprocess.run(["bash", str(ROOT / "bench" / "run.sh"), "rank8"], capture_output=True, text=True, env=env,
                       timeout=100)   # a hang guard: the logger sleeps 600 s unless stopped
    assert r.returncode == 0, r.stdout + r.stderr
    calls = record.read_text().splitlines()
    assert calls[0].startswith("smi --query-gpu=index,clocks.sm,power.draw,") and "-lms 200" in calls[0]
    assert calls[1] == "run.sh" and calls[2].startswith("python bench/profile_step.py --run ")
    assert calls[3] == f"python bench/gpu_clocks.py {out}/rank8_clocks.csv" and len(calls) == 4
    assert (out / "rank8_clocks.csv").read_text() == "0, 1600, 690, 50, 0x4\n"


def test_bench_rank8_needs_a_gpu_count_that_divides_8(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "DATA": str(tmp_path / "data"), "NPROC": "3"}
    r = subprocess.run(["bash", str(ROOT / "bench" / "run.sh"), "rank8"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: rank8 needs a GPU count that divides 8, got 3: set NPROC to 1, 2, 4 or 8"]
    assert not (tmp_path / "data").exists()
