"""tools/ never lose a run and never crash on a log: Ctrl-C through tools/repeat.py, odd and diverged logs,
resumed runs counted once, a missing matplotlib, bad numbers. CPU only; no real training (a fake trainer stands in
for train_gpt.py where a run is needed)."""
import json
import os
import pty
import re
import select
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from _shards import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import plot  # noqa: E402
import repeat  # noqa: E402
import runlogs  # noqa: E402
import stats  # noqa: E402

TOTAL = 1765
HANG_GUARD_S = 120  # far beyond what any of these should take, even on a loaded machine


def write_log(path, vals, total=TOTAL, error=None, resumed=None, code_dump=True, raw_val=()):
    """A log as train_gpt.py writes it. vals: [(step, val loss, train time in s)]; resumed: (checkpoint, step);
    raw_val: validation lines written as they are (after the others)."""
    lines = ["==== train_gpt.py ====", '"""source..."""', 'error: "a line of the trainer\'s code, not output"',
             "=" * 100] if code_dump else []
    lines += ["command: --seed=1", "hyperparameters:", "phase:startup time:1849ms"]
    if resumed:
        lines.append(f"resumed from {resumed[0]} after step {resumed[1]} of {total} (train_time so far 1000ms)")
    for step, loss, t in vals:
        lines.append(f"step:{step}/{total} val_loss:{loss:.4f} train_time:{round(t * 1000)}ms "
                     f"step_avg:{t * 1000 / max(step, 1):.2f}ms")
    lines += list(raw_val)
    if error:
        lines.append(f"error: {error}")
    elif vals and vals[-1][0] == total:
        lines.append(f"result: val_loss:{vals[-1][1]:.4f} target:3.28 reached:yes train_time:{vals[-1][2]:.1f}s "
                     f"steps:{total} peak_memory:n/a log:{path}")
    Path(path).write_text("\n".join(lines) + "\n")
    return str(path)


def finished(tmp_path, name, loss=3.2771, seconds=88.0, **kw):
    vals = [(0, 10.8258, 0.0), (1000, 3.61, seconds * 0.56), (TOTAL, loss, seconds)]
    return write_log(tmp_path / f"{name}.txt", vals, **kw)


def tool(name, *args, env=None, cwd=None):
    """Run tools/<name>.py as a program."""
    return subprocess.run([sys.executable, str(ROOT / "tools" / f"{name}.py"), *map(str, args)], capture_output=True,
                          text=True, timeout=HANG_GUARD_S, env=env, cwd=cwd)


def assert_one_error_line(p, code, *words):
    """Exit `code`, stderr is one `error:` line holding every word, and no traceback anywhere."""
    assert "Traceback" not in p.stderr + p.stdout, p.stderr
    assert p.returncode == code, (p.returncode, p.stderr, p.stdout)
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), p.stderr
    for w in words:
        assert w in err[0], (w, err[0])
    return err[0]


def stats_json(capsys, *args):
    code = stats.main([*map(str, args), "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


# ---- fault 2: diverged, partial, foreign and garbled logs ------------------------------------------------------

def odd_logs(tmp_path):
    """Every kind of log that used to crash the tools, or that is not a finished run."""
    d = tmp_path
    logs = {
        "nan": write_log(d / "nan.txt", [(0, 10.8, 0.0), (500, 4.1, 20.0), (1000, float("nan"), 40.0)],
                         error="the validation loss is nan at step 1000: lower the learning rates "
                               "(--adam_lr, --muon_lr) or check the data"),
        "inf": write_log(d / "inf.txt", [(0, 10.8, 0.0), (500, float("inf"), 20.0)]),        # cut short, no error
        "trainnan": write_log(d / "trainnan.txt", [(0, 10.8, 0.0), (500, 4.0, 20.0)],
                              error="the training loss became NaN or infinite at step 700"),
        "garbled": write_log(d / "garbled.txt", [(0, 10.8, 0.0), (1000, 3.6, 40.0)],
                             raw_val=[f"step:{TOTAL}/{TOTAL} val_loss:1.2.3 train_time:88000ms step_avg:1ms",
                                      f"step:{TOTAL}/{TOTAL} val_loss:- train_time:88000ms step_avg:1ms"]),
        "errored": write_log(d / "errored.txt", [], error="no train shards: the folder 'x' does not exist"),
    }
    (d / "foreign.txt").write_text("some other program's output\nerror: not ours\n1.2.3\n")
    (d / "empty.txt").write_text("")
    (d / "binary.pt").write_bytes(b"PK\x03\x04\x00\x00" + bytes(range(256)) * 20)
    (d / "folder.txt").mkdir()
    logs.update(foreign=str(d / "foreign.txt"), empty=str(d / "empty.txt"), binary=str(d / "binary.pt"),
                folder=str(d / "folder.txt"))
    return logs


def test_runlogs_reads_every_odd_log_without_an_exception(tmp_path):
    logs = odd_logs(tmp_path)
    runs, repeats = runlogs.load_runs(list(logs.values()))
    why = {Path(r.path).stem: r.why_excluded for r in runs}
    assert not repeats and not any(r.finished for r in runs)
    assert why["nan"].startswith("diverged: the validation loss is nan at step 1000")
    assert why["inf"] == "diverged: the validation loss is inf at step 500"
    assert why["trainnan"].startswith("diverged: the training loss became NaN")
    assert why["garbled"].startswith("unfinished: last validation at step 1000 of 1765; line ") and "1.2.3" not in \
        why["garbled"] and "val_loss:-" in why["garbled"]
    assert why["errored"] == "failed: no train shards: the folder 'x' does not exist"   # not the code dump's line
    assert why["foreign"].startswith("not a train_gpt log")
    assert why["empty"] == "not a train_gpt log: the file is empty"
    assert why["binary"].startswith("not a train_gpt log: a binary file")
    assert why["folder"].startswith("unreadable: cannot read it (Is a directory")
    assert {r.status for r in runs} >= {"diverged", "failed", "unfinished", "foreign", "unreadable"}


def test_stats_lists_odd_logs_as_exclusions_and_counts_the_rest(tmp_path, capsys):
    logs = odd_logs(tmp_path)
    good = [finished(tmp_path, "a", 3.2771, 88.1), finished(tmp_path, "b", 3.2790, 88.4)]
    r = stats_json(capsys, *good, *logs.values())
    assert r["n"] == 2 and [x["run_id"] for x in r["runs"]] == ["a", "b"]
    reasons = {Path(x["log"]).stem: x["reason"] for x in r["excluded"]}
    assert set(reasons) == {"nan", "inf", "trainnan", "garbled", "errored", "foreign", "empty", "binary", "folder"}
    assert reasons["nan"].startswith("diverged:") and reasons["inf"].startswith("diverged:")
    assert reasons["foreign"].startswith("not a train_gpt log")

    # the program itself: markdown with one "excluded" line per odd log; only odd logs: one error line, exit 2
    p = tool("stats", *good, *logs.values())
    assert p.returncode == 0 and "Traceback" not in p.stderr and p.stderr == "", p.stderr
    assert "n = 2" in p.stdout and f"excluded {logs['nan']}: diverged:" in p.stdout
    assert f"excluded {logs['folder']}: unreadable" in p.stdout
    p = tool("stats", *logs.values())
    assert_one_error_line(p, 2, "no finished run", "diverged", "not a train_gpt log")


def test_plot_draws_diverged_and_partial_runs_and_lists_the_rest(tmp_path):
    logs = odd_logs(tmp_path)
    good = finished(tmp_path, "a", 3.2771, 88.1)
    out = tmp_path / "curves.png"
    p = tool("plot", good, *logs.values(), f"--out={out}")
    assert p.returncode == 0 and "Traceback" not in p.stderr and p.stderr == "", p.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in p.stdout and "(5 runs)" in p.stdout   # a, nan, inf, trainnan, garbled (errored: no validation)
    for name in ("errored", "foreign", "empty", "binary", "folder"):
        assert f"skipped {logs[name]}: " in p.stdout, p.stdout
    labels = [d[0] for d in plot.curves(runlogs.load_runs([good, *logs.values()])[0])]
    assert labels == ["a", "nan (diverged)", "inf (diverged)", "trainnan (diverged)", "garbled (unfinished)"]

    only_nan = write_log(tmp_path / "allnan.txt", [(0, float("nan"), 0.0)])
    p = tool("plot", only_nan, logs["foreign"], f"--out={tmp_path / 'x.png'}")
    assert_one_error_line(p, 2, "no validation line", "diverged", "not a train_gpt log")
    assert not (tmp_path / "x.png").exists()


# ---- fault 3: a log counted twice; a resumed run counted twice ------------------------------------------------

def test_stats_counts_a_log_named_twice_once(tmp_path, capsys, monkeypatch):
    a, b = finished(tmp_path, "a", 3.2771, 88.1), finished(tmp_path, "b", 3.2790, 88.4)
    (tmp_path / "link.txt").symlink_to(tmp_path / "a.txt")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    r = stats_json(capsys, a, b, "a.txt", "./a.txt", tmp_path / "sub" / ".." / "a.txt", "link.txt")
    assert r["n"] == 2 and [x["run_id"] for x in r["runs"]] == ["a", "b"]
    assert len(r["excluded"]) == 4 and all(x["reason"] == f"named twice (counted once, as {a})"
                                           for x in r["excluded"])


def test_stats_counts_a_resumed_run_and_its_continuation_once(tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    # stopped by Ctrl-C after step 500 with its state saved, then resumed: logs/a-from500.txt finished the run
    stopped = write_log(logs / "a.txt", [(0, 10.8258, 0.0), (500, 4.2, 25.0)],
                        error=f"stopped by SIGINT after step 500 of {TOTAL}; the state after step 500 is saved in "
                              f"logs/a: --resume=logs/a")
    cont = write_log(logs / "a-from500.txt", [(1000, 3.61, 50.0), (TOTAL, 3.2781, 88.0)],
                     resumed=("logs/a/state_step000500.pt", 500))
    other = finished(logs, "b", 3.2790, 88.4)
    for order in ([stopped, cont, other], [cont, other, stopped]):
        r = stats_json(capsys, *order)
        assert r["n"] == 2 and sorted(x["run_id"] for x in r["runs"]) == ["a-from500", "b"]
        assert r["excluded"] == [{"log": stopped, "reason": f"continued by {cont} (one run, counted once as {cont}; "
                                                            f"this log: failed: stopped by SIGINT after step 500 of "
                                                            f"{TOTAL}; the state after step 500 is saved in logs/a: "
                                                            f"--resume=logs/a)"}]
    # the continuation alone is the whole run (its train_time includes the time before the stop)
    r = stats_json(capsys, cont)
    assert r["n"] == 1 and r["runs"][0]["train_time_s"] == 88.0

    # a run that finished and was resumed again (from its final state, or a mid-run one): still one run
    done = finished(logs, "c", 3.2800, 90.0)
    again = write_log(logs / "c-from1765.txt", [(TOTAL, 3.2800, 90.0)], resumed=("logs/c/state_step001765.pt", TOTAL))
    redo = write_log(logs / "c-from1000.txt", [(TOTAL, 3.2799, 90.1)], resumed=("logs/c/state_step001000.pt", 1000))
    r = stats_json(capsys, done, again, redo, other)
    assert r["n"] == 2 and [x["run_id"] for x in r["runs"]] == ["c-from1765", "b"]   # in the order given
    reasons = {x["log"]: x["reason"] for x in r["excluded"]}
    assert reasons[done].startswith(f"continued by {again} (one run, counted once as {again}; this log: finished")
    assert reasons[redo].startswith(f"same run as {again}")

    # a chain: a -> a-from500 (stopped again) -> a-from500-from900 (finished)
    write_log(logs / "a-from500.txt", [(500, 4.2, 25.0)], resumed=("logs/a/state_step000500.pt", 500),
              error="stopped by SIGTERM after step 900 of 1765")
    tip = write_log(logs / "a-from500-from900.txt", [(TOTAL, 3.2770, 89.0)],
                    resumed=("/elsewhere/logs/a-from500/state_step000900.pt", 900))
    r = stats_json(capsys, stopped, cont, tip)
    assert r["n"] == 1 and r["runs"][0]["run_id"] == "a-from500-from900"
    assert [x["reason"].split(" (")[0] for x in r["excluded"]] == [f"continued by {cont}", f"continued by {tip}"]


# ---- fault 4: a missing dependency (scipy, matplotlib, ...) ---------------------------------------------------

INSTALL = "python3 -m pip install -r tools/requirements.txt"


def without(tmp_path, *modules):
    """An environment in which `import <module>` fails as for a package never installed: a stub package of that
    name, first on PYTHONPATH, raises ImportError."""
    for name in modules:
        fake = tmp_path / "without" / name
        fake.mkdir(parents=True)
        (fake / "__init__.py").write_text(f"raise ImportError(\"No module named '{name}'\")\n")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "without"), os.environ.get("PYTHONPATH", "")]))


@pytest.mark.parametrize("name,module", [("stats", "scipy"), ("stats", "numpy"), ("plot", "matplotlib"),
                                         ("repeat", "scipy"), ("sample", "tiktoken")])
def test_a_missing_dependency_is_one_error_line_naming_the_install_line(tmp_path, name, module):
    """Each tool without a module it needs: exit 2 and one `error:` line naming the module and the README's install
    line (tools/requirements.txt from the repository root, its whole path from elsewhere); no traceback, no output
    file, no run started; --help still works."""
    env = without(tmp_path, module)
    log = finished(tmp_path, "a")
    marker = tmp_path / "a_run_started"
    starts_a_run = shlex.join([sys.executable, "-c", f"open({str(marker)!r}, 'w')"])     # a run would leave it
    args = {"stats": [log],
            "plot": [log, f"--out={tmp_path / 'c.png'}"],
            "repeat": ["--runs=1", f"--launcher={starts_a_run}", "--", "--preset=tiny"],
            "sample": [f"--checkpoint={tmp_path / 'state_step000001.pt'}", "--encoding=bytes"]}[name]
    err = assert_one_error_line(tool(name, *args, env=env, cwd=ROOT), 2, f"tools/{name}.py needs {module}",
                                "cannot be imported", f"No module named '{module}'")
    assert err.endswith(f"; install the tools' dependencies: {INSTALL}"), err
    elsewhere = assert_one_error_line(tool(name, *args, env=env, cwd=tmp_path), 2, module)
    assert elsewhere.endswith(f"python3 -m pip install -r {ROOT / 'tools' / 'requirements.txt'}"), elsewhere
    assert not (tmp_path / "c.png").exists() and not marker.exists()
    if name == "repeat":
        assert "no run started" in err
    assert tool(name, "--help", env=env).returncode == 0    # the help needs none of them


def test_tools_requirements_hold_every_package_the_tools_import():
    """tools/requirements.txt (the README's one install line) names each third-party module tools/*.py import,
    torch aside (its build depends on the machine: the README installs it), and tiktoken, which sample.py loads
    through data/tokenize_docs.py."""
    import ast
    own = {p.stem for p in (ROOT / "tools").glob("*.py")} | {p.stem for p in ROOT.glob("*.py")} | {
        p.stem for p in (ROOT / "data").glob("*.py")}
    imported = {"tiktoken"}
    for path in (ROOT / "tools").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - own - {"__future__", "torch"}
    assert {"numpy", "scipy", "matplotlib", "tiktoken"} <= third_party, third_party   # the walk sees them
    listed = {re.split(r"[\s<>=!~;\[#]", line.strip(), maxsplit=1)[0].lower() for line in
              (ROOT / "tools" / "requirements.txt").read_text(encoding="utf-8").splitlines()} - {""}
    assert third_party <= listed, f"tools/requirements.txt lacks {sorted(third_party - listed)}"


# ---- fault 5: runlogs.py as a program -------------------------------------------------------------------------

def test_runlogs_program_describes_each_log(tmp_path):
    a = finished(tmp_path, "a", 3.2771, 88.1)
    cut = write_log(tmp_path / "cut.txt", [(0, 10.8258, 0.0), (1000, 3.6, 50.0)])
    foreign = tmp_path / "notes.txt"
    foreign.write_text("hello\n")
    p = tool("runlogs", a, cut, foreign, a)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == (f"{a}: run a finished; last validation step {TOTAL}/{TOTAL} val_loss 3.2771 "
                        f"train_time 88.1s")
    assert lines[1].startswith(f"{cut}: run cut unfinished; last validation step 1000/{TOTAL}")
    assert lines[2].startswith(f"{foreign}: not a train_gpt log")
    assert lines[3] == f"{a}: named twice (counted once, as {a})"
    assert_one_error_line(tool("runlogs"), 2, "logs", "--help")
    assert_one_error_line(tool("runlogs", tmp_path / "missing.txt"), 2, "missing.txt", "No such file")


# ---- fault 6: numbers must be finite; `~` is the home folder ---------------------------------------------------

@pytest.mark.parametrize("call,args,words", [
    ("stats", ["LOG", "--target=nan"], ["--target", "'nan' is not a finite number"]),
    ("stats", ["LOG", "--target=inf"], ["--target", "'inf' is not a finite number"]),
    ("stats", ["LOG", "--target=-Infinity"], ["--target", "not a finite number"]),
    ("plot", ["LOG", "--out=x.png", "--target=NaN"], ["--target", "not a finite number"]),
    ("repeat", ["--runs=2", "--target=inf"], ["--target", "not a finite number"]),
    ("repeat", ["--runs=nan"], ["--runs", "invalid int value"]),
    ("repeat", ["--runs=inf"], ["--runs", "invalid int value"]),
    ("repeat", ["--runs=2", "--first_seed=nan"], ["--first_seed", "invalid int value"]),
])
def test_numeric_options_refuse_nan_and_infinity(tmp_path, capsys, call, args, words):
    log = finished(tmp_path, "a")
    args = [log if a == "LOG" else a for a in args]
    if call == "repeat":  # never start a real run, whatever happens
        args.append("--launcher=/nonexistent/launcher")
    with pytest.raises(SystemExit) as e:
        {"stats": stats.main, "plot": plot.main, "repeat": repeat.main}[call](args)
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and "--help" in err[0], err
    for w in words:
        assert w in err[0], err
    assert repeat.main(["--runs=2", "--first_seed=-1", "--launcher=/nonexistent/launcher"]) == 2
    assert capsys.readouterr().err.startswith("error: --first_seed=-1")


def test_tilde_in_paths_is_the_home_folder(tmp_path, capsys, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    finished(home, "a", 3.2771, 88.1)
    finished(home, "b", 3.2790, 88.4)
    r = stats_json(capsys, "~/a.txt", "--baseline", "~/b.txt")
    assert r["n"] == 1 and r["runs"][0]["log"] == str(home / "a.txt") and r["baseline_n"] == 1
    assert plot.main(["~/a.txt", "--out=~/c.svg"]) == 0 and (home / "c.svg").read_text().count("<svg")
    assert not (Path.cwd() / "~").exists()
    assert repeat.absolute_paths(["--log_dir=~/logs", "--resume=", "--val-files=v/*.bin", "--seed=1"], "/w") == [
        f"--log_dir={home}/logs", "--resume=", "--val-files=/w/v/*.bin", "--seed=1"]


# ---- fault 1: Ctrl-C through tools/repeat.py ------------------------------------------------------------------

# Stands in for train_gpt.py: run seed <fake_stop_seed> waits for a signal, then "saves" for --fake_save_s seconds
# (a second signal ends that at once when --fake_second_stops=1) and exits 128 + signal, as the trainer does. The
# others finish at once. It records its arguments and every signal it gets beside its log.
FAKE_TRAINER = r'''
import signal, sys, time
from pathlib import Path
opts = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
log_dir, run_id, seed = Path(opts["log_dir"]), opts["run_id"], int(opts["seed"])
got = []
def on_signal(signum, frame):
    got.append(signum)
    with open(log_dir / f"{run_id}.signals", "a") as f:
        f.write(f"{signum}\n")
signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGTERM, on_signal)
log_dir.mkdir(parents=True, exist_ok=True)
(log_dir / f"{run_id}.args").write_text("\n".join(sys.argv[1:]))
log = open(log_dir / f"{run_id}.txt", "x", buffering=1)
log.write("==== train_gpt.py ====\n(code)\n" + "=" * 100 + "\ncommand: " + " ".join(sys.argv[1:]) + "\n")
log.write("step:0/10 val_loss:10.8000 train_time:0ms step_avg:0.00ms\n")
if seed != int(opts.get("fake_stop_seed", -1)):
    log.write(f"step:10/10 val_loss:{3.27 + seed / 1000:.4f} train_time:{1000 + seed}ms step_avg:100.00ms\n")
    sys.exit(0)
(log_dir / f"{run_id}.ready").write_text("")
deadline = time.monotonic() + 120
while not got and time.monotonic() < deadline:
    time.sleep(0.01)
if not got:
    sys.exit(5)
save_until = time.monotonic() + float(opts.get("fake_save_s", "1.5"))
while time.monotonic() < save_until:
    if len(got) > 1 and opts.get("fake_second_stops") == "1":
        (log_dir / f"{run_id}.at_once").write_text("")
        log.write("error: stopped by SIGINT\n")
        sys.exit(128 + got[-1])
    time.sleep(0.01)
state = log_dir / run_id / "state_step000003.pt"
state.parent.mkdir()
state.write_bytes(b"saved state")
name = signal.Signals(got[0]).name
log.write(f"error: stopped by {name} after step 3 of 10; the state after step 3 is saved in {state.parent}: "
          f"--resume={state.parent}\n")
sys.exit(128 + got[0] if opts.get("fake_exit_zero") != "1" else 0)
'''


def wait_for(path, proc, deadline_s=HANG_GUARD_S, idle=lambda: time.sleep(0.02)):
    deadline = time.monotonic() + deadline_s
    while not path.exists():
        assert proc_alive(proc), "the wrapper exited before the run was ready"
        assert time.monotonic() < deadline, f"{path} never appeared"
        idle()


def proc_alive(proc):
    """Is the Popen (or the pid) still running? (A pid is not reaped here.)"""
    if isinstance(proc, subprocess.Popen):
        return proc.poll() is None
    return os.waitid(os.P_PID, proc, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None


def drain(master, output):
    """Read what the terminal shows (so its buffer never fills); False at its end."""
    ready, _, _ = select.select([master], [], [], 0.05)
    if not ready:
        return True
    try:
        chunk = os.read(master, 65536)
    except OSError:  # EIO: every process of the terminal has closed it
        chunk = b""
    output.append(chunk)
    return bool(chunk)


def repeat_cmd(tmp_path, runs, *trainer, name="t", log_dir=None):
    fake = tmp_path / "fake_trainer.py"
    fake.write_text(FAKE_TRAINER)
    return [sys.executable, str(ROOT / "tools" / "repeat.py"), f"--runs={runs}", "--first_seed=0", f"--name={name}",
            f"--launcher={sys.executable} {fake}", "--", f"--log_dir={log_dir or tmp_path / 'logs'}", *trainer]


def start_repeat(tmp_path, runs, *trainer):
    """tools/repeat.py in its own session, run from tmp_path."""
    return subprocess.Popen(repeat_cmd(tmp_path, runs, *trainer), cwd=tmp_path, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc):
    try:
        return proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)   # the session this test started
            proc.wait()


def signals_got(logs, run_id):
    f = logs / f"{run_id}.signals"
    return [int(x) for x in f.read_text().split()] if f.exists() else []


def assert_series_stopped(tmp_path, code, out, err, signum, before):
    """The stopped run saved, the one before it is untouched, no further run started, one error line."""
    logs = tmp_path / "logs"
    name = signal.Signals(signum).name
    assert "Traceback" not in out + err, err
    assert code == 128 + signum, (code, out, err)
    assert err.strip().splitlines() == [err.strip()] and err.startswith(
        f"error: stopped by {name} during run 2 of 3 (t-seed1, exit {128 + signum}); no further run started"), err
    assert "--first_seed=1 --runs=2" in err
    assert (logs / "t-seed1" / "state_step000003.pt").read_bytes() == b"saved state"      # it saved, not killed
    assert (logs / "t-seed1.txt").read_text().splitlines()[-1].startswith(f"error: stopped by {name} after step 3")
    assert {p.name: p.read_bytes() for p in logs.glob("t-seed0*")} == before              # run 1: byte-identical
    assert not list(logs.glob("t-seed2*"))                                                 # run 3 never started


def snapshot_run1(tmp_path):
    return {p.name: p.read_bytes() for p in (tmp_path / "logs").glob("t-seed0*")}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("signum,to_group", [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)])
def test_repeat_passes_a_signal_on_and_waits_for_the_run_to_save(tmp_path, signum, to_group):
    """kill -INT / -TERM of the wrapper, or of its whole process group (both get it): the run gets the signal,
    saves and exits 128 + N in its own time; the wrapper waits, starts no other run and exits with that code."""
    p = start_repeat(tmp_path, 3, "--fake_stop_seed=1")
    try:
        wait_for(tmp_path / "logs" / "t-seed1.ready", p)
        before = snapshot_run1(tmp_path)
        assert before["t-seed0.txt"].count(b"step:10/10 val_loss:3.2700") == 1
        (os.killpg if to_group else os.kill)(p.pid, signum)
    finally:
        out, err = finish(p)
    assert_series_stopped(tmp_path, p.returncode, out, err, signum, before)
    got = signals_got(tmp_path / "logs", "t-seed1")
    assert got[0] == signum and (len(got) in (1, 2) if to_group else got == [signum])


@pytest.mark.timeout(300)
def test_repeat_second_ctrl_c_is_passed_on_too(tmp_path):
    p = start_repeat(tmp_path, 3, "--fake_stop_seed=1", "--fake_save_s=600", "--fake_second_stops=1")
    try:
        logs = tmp_path / "logs"
        wait_for(logs / "t-seed1.ready", p)
        os.kill(p.pid, signal.SIGINT)
        wait_for(logs / "t-seed1.signals", p)
        os.kill(p.pid, signal.SIGINT)
    finally:
        out, err = finish(p)
    assert "Traceback" not in out + err and p.returncode == 130, (p.returncode, err)
    assert err.startswith("error: stopped by SIGINT during run 2 of 3") and len(err.strip().splitlines()) == 1
    assert signals_got(logs, "t-seed1") == [signal.SIGINT, signal.SIGINT] and (logs / "t-seed1.at_once").exists()
    assert not list(logs.glob("t-seed2*"))


@pytest.mark.timeout(300)
def test_repeat_terminal_ctrl_c_reaches_the_run_once(tmp_path):
    """Ctrl-C typed in a terminal goes to the wrapper and the run (one process group); the wrapper does not send
    it a second time, waits, and stops the series."""
    cmd = repeat_cmd(tmp_path, 3, "--fake_stop_seed=1")
    pid, master = pty.fork()
    if pid == 0:  # the child: a session whose controlling terminal is the pty, as in a shell
        try:
            os.chdir(tmp_path)
            os.execv(cmd[0], cmd)
        finally:
            os._exit(127)
    output, status = [], None
    try:
        wait_for(tmp_path / "logs" / "t-seed1.ready", pid, idle=lambda: drain(master, output))
        before = snapshot_run1(tmp_path)
        os.write(master, b"\x03")                     # the terminal's Ctrl-C: SIGINT to its foreground group
        deadline = time.monotonic() + HANG_GUARD_S
        while time.monotonic() < deadline and drain(master, output):
            pass
        _, status = os.waitpid(pid, 0)
    finally:
        if status is None:
            os.kill(pid, signal.SIGKILL)              # the process this test started
            os.waitpid(pid, 0)
        os.close(master)
    output = b"".join(output)
    text = output.decode(errors="replace").replace("\r\n", "\n")
    assert os.waitstatus_to_exitcode(status) == 130, text
    assert "Traceback" not in text
    err_lines = [x for x in text.splitlines() if x.startswith("error:")]
    assert len(err_lines) == 1 and err_lines[0].startswith("error: stopped by SIGINT during run 2 of 3"), text
    assert signals_got(tmp_path / "logs", "t-seed1") == [signal.SIGINT]          # once, from the terminal
    assert (tmp_path / "logs" / "t-seed1" / "state_step000003.pt").exists()
    assert snapshot_run1(tmp_path) == before and not list((tmp_path / "logs").glob("t-seed2*"))


@pytest.mark.timeout(300)
def test_repeat_stops_the_series_even_if_the_run_finishes_after_the_signal(tmp_path):
    p = start_repeat(tmp_path, 3, "--fake_stop_seed=1", "--fake_exit_zero=1")
    try:
        wait_for(tmp_path / "logs" / "t-seed1.ready", p)
        os.kill(p.pid, signal.SIGTERM)
    finally:
        out, err = finish(p)
    assert p.returncode == 143 and "Traceback" not in err and err.startswith("error: stopped by SIGTERM during run 2")
    assert not list((tmp_path / "logs").glob("t-seed2*"))


@pytest.mark.timeout(300)
def test_repeat_resolves_relative_paths_from_the_callers_folder(tmp_path):
    """The runs start in the repository root; --log_dir, --train_files, ... given relative to where repeat.py was
    started (or with ~) reach the trainer as absolute paths, and the statistics find the logs there."""
    home = tmp_path / "home"
    env = dict(os.environ, HOME=str(home))
    name = f"relpaths-{uuid.uuid4().hex[:12]}"  # if the paths went wrong, the logs would land in the repository
    p = subprocess.run(repeat_cmd(tmp_path, 2, "--train_files=data/train_*.bin", "--val-files=~/val_*.bin",
                                  "--resume=", f"--compile_cache={tmp_path}/cache.bin", name=name, log_dir="logs"),
                       cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
    assert not (ROOT / "logs" / f"{name}-seed0.txt").exists()
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    args = (tmp_path / "logs" / f"{name}-seed0.args").read_text().splitlines()
    assert args == [f"--log_dir={tmp_path}/logs", f"--train_files={tmp_path}/data/train_*.bin",
                    f"--val-files={home}/val_*.bin", "--resume=", f"--compile_cache={tmp_path}/cache.bin",
                    "--seed=0", f"--run_id={name}-seed0"]
    assert f"| {name}-seed0 | 3.2700 |" in p.stdout and f"| {name}-seed1 | 3.2710 |" in p.stdout
    assert "n = 2" in p.stdout


def test_logs_with_numbers_too_long_to_use_are_garbled_lines(tmp_path):
    """A step or a time of hundreds of digits (a corrupted log) makes its line garbled, never an exception."""
    nines = "9" * 5000
    path = write_log(tmp_path / "long.txt", [(0, 10.8, 0.0)],
                     raw_val=[f"step:{TOTAL}/{TOTAL} val_loss:3.1000 train_time:{nines[:400]}ms step_avg:1ms",
                              f"step:{nines}/{TOTAL} val_loss:3.1000 train_time:5ms step_avg:1ms",
                              f"resumed from x.pt after step {nines} of {TOTAL}",
                              f"result: val_loss:3.1000 target:3.28 reached:yes train_time:1.0s steps:{nines}"])
    run = runlogs.read_run(path)
    assert run.val == [(0, 10.8, 0.0)] and len(run.garbled) == 2 and not run.resumed_from and run.result is None
    assert run.why_excluded.startswith("unfinished: last validation at step 0 of 1765; line ")
    assert_one_error_line(tool("stats", path), 2, "no finished run", "garbled validation line")


def test_a_log_given_through_a_pipe_is_read(tmp_path):
    """<(cat log) is a pipe: its data can be read once only."""
    text = Path(finished(tmp_path, "a", 3.2771, 88.1)).read_bytes()
    r, w = os.pipe()
    os.write(w, text)           # a log of a few hundred bytes fits the pipe's buffer
    os.close(w)
    try:
        p = subprocess.run([sys.executable, str(ROOT / "tools" / "runlogs.py"), f"/dev/fd/{r}"], pass_fds=(r,),
                           capture_output=True, text=True, timeout=HANG_GUARD_S)
    finally:
        os.close(r)
    assert p.returncode == 0 and f"/dev/fd/{r}: run {r} finished" in p.stdout and "3.2771" in p.stdout, p


# ---- issue 56: extreme values -------------------------------------------------------------------------------------

def strict_json(text):
    """json.loads that refuses NaN / Infinity (not JSON, though Python writes and reads them by default)."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_stats_json_is_valid_json_for_extreme_logs(tmp_path):
    """Losses near 1.7e308 (their mean overflows to inf) and 18-digit train times: the program's --json output parses
    as strict JSON, an overflowed statistic is the string "inf", one that needs more runs null."""
    huge = [write_log(tmp_path / f"h{i}.txt", [(0, 1.7e308, 0.0), (TOTAL, x, 88.0 + i)])
            for i, x in enumerate((1.7e308, 1.6e308))]
    slow = [write_log(tmp_path / f"s{i}.txt", [(0, 10.8, 0.0), (TOTAL, 3.2 + i / 100, t)])
            for i, t in enumerate((9e14, 9.99e14))]
    for logs in (huge, slow, [*slow, "--baseline", *huge], [*huge, "--baseline", *slow], huge[:1]):
        p = tool("stats", *logs, "--json")
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
        r = strict_json(p.stdout)
        assert r["n"] in (1, 2)
    r = strict_json(tool("stats", *huge, "--json").stdout)
    assert r["val_loss_mean"] == "inf" and r["runs"][0]["val_loss"] == 1.7e308
    assert strict_json(tool("stats", huge[0], "--json").stdout)["val_loss_std"] is None


def test_plot_leaves_out_losses_too_large_to_draw_and_says_so(tmp_path):
    """A loss of 1.7e308 made matplotlib's tick arithmetic overflow (a traceback, no image): it is left out of its
    curve with a line naming the log; a run with nothing else to draw is skipped, saying why."""
    partly = write_log(tmp_path / "partly.txt", [(0, 10.8, 0.0), (1000, 1.7e308, 50.0), (TOTAL, 3.3, 89.0)])
    only = write_log(tmp_path / "only.txt", [(0, 1.7e308, 0.0), (TOTAL, 1.7e308, 88.0)])
    good = finished(tmp_path, "a", 3.2771, 88.1)
    out = tmp_path / "curves.png"
    p = tool("plot", good, partly, only, f"--out={out}")
    assert p.returncode == 0 and "Traceback" not in p.stderr and p.stderr == "", p.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "(2 runs)" in p.stdout
    assert f"left out of {partly}: 1 validation loss(es) above 1e+06, too large to draw (1.7e+308 at step 1000)" \
        in p.stdout
    assert f"skipped {only}: 2 validation loss(es) above 1e+06, too large to draw" in p.stdout
    p = tool("plot", only, f"--out={tmp_path / 'x.png'}")
    assert_one_error_line(p, 2, "no validation line", "too large to draw")
    assert not (tmp_path / "x.png").exists()


# ---- fault 7: tools/repeat.py on a machine without a GPU -------------------------------------------------------

def test_repeat_without_a_gpu_runs_the_trainer_directly(tmp_path):
    """No CUDA GPU visible: the default launcher is this Python running train_gpt.py in the repository root, not
    ./run.sh (which needs GPUs), and one note line says so. The trainer's option error stops the series at its
    first run, so nothing trains (and the data paths, which do not exist, are never read)."""
    env = {k: v for k, v in os.environ.items() if k != "TRAIN"}
    env["CUDA_VISIBLE_DEVICES"] = ""                                  # torch sees no GPU, whatever the machine has
    trainer = [f"--train_files={tmp_path}/none_*.bin", f"--val_files={tmp_path}/none_*.bin",
               f"--log_dir={tmp_path}/logs", "--no_such_option=1"]
    p = tool("repeat", "--runs=2", "--name=cpu", "--", *trainer, env=env, cwd=tmp_path)
    launcher = shlex.join([sys.executable, "train_gpt.py"])
    notes = [line for line in p.stdout.splitlines() if line.startswith("repeat: note:")]
    assert notes == [f"repeat: note: no CUDA GPU found, so each run starts as `{launcher}` (one process) rather "
                     f"than ./run.sh, which needs GPUs; --launcher chooses the command"], p.stdout
    started = [line for line in p.stdout.splitlines() if line.startswith("repeat: run ")]
    assert started[0] == f"repeat: run 1/2: {launcher} {shlex.join(trainer)} --seed=0 --run_id=cpu-seed0", started
    assert p.returncode == 2 and "unknown option --no_such_option" in p.stderr, (p.returncode, p.stderr)
    assert "stopped at run 1 of 2" in p.stderr and "run.sh" not in p.stderr


def test_repeat_default_launcher_is_run_sh_only_where_there_are_gpus(tmp_path, capsys, monkeypatch):
    assert repeat.default_launcher(1, "", str(tmp_path)) == (["./run.sh"], "")
    launcher, note = repeat.default_launcher(0, "", str(tmp_path))
    assert launcher == [sys.executable, "train_gpt.py"] and note.startswith("repeat: note: no CUDA GPU found")
    # TRAIN as run.sh reads it: a file in the folder the command runs in, else a path from the repository root
    (tmp_path / "my_idea.py").write_text("")
    assert repeat.default_launcher(0, "my_idea.py", str(tmp_path)) == (
        [sys.executable, str(tmp_path / "my_idea.py")], note.replace("train_gpt.py", str(tmp_path / "my_idea.py")))
    assert repeat.default_launcher(0, "copies/b.py", str(tmp_path))[0] == [sys.executable, "copies/b.py"]
    (tmp_path / "train_gpt.py").write_text("")              # without TRAIN, the repository's trainer, as in run.sh
    assert repeat.default_launcher(0, "", str(tmp_path)) == (launcher, note)

    def no_probe():
        raise AssertionError("a --launcher given: no GPU count needed")
    monkeypatch.setattr(repeat, "gpu_count", no_probe)
    assert repeat.main(["--runs=1", "--launcher=/nonexistent/launcher"]) == 2
    out = capsys.readouterr()
    assert "note:" not in out.out and out.err.startswith("error: cannot start /nonexistent/launcher")


def test_repeat_counts_gpus_as_run_sh_does(monkeypatch):
    """torch.cuda.device_count() in a fresh Python; where torch cannot tell, the GPUs nvidia-smi -L lists; else 0."""
    answers = {}

    def fake_run(cmd, **kw):
        answer = answers[cmd[0]]
        if isinstance(answer, Exception):
            raise answer
        return subprocess.CompletedProcess(cmd, answer[0], answer[1], "")
    monkeypatch.setattr(repeat.subprocess, "run", fake_run)
    answers.update({sys.executable: (0, "2\n"), "nvidia-smi": OSError("not found")})
    assert repeat.gpu_count() == 2
    answers.update({sys.executable: (0, "0\n")})
    assert repeat.gpu_count() == 0
    smi = "GPU 0: NVIDIA H100 (UUID: GPU-1)\nGPU 1: NVIDIA H100 (UUID: GPU-2)\n"
    answers.update({sys.executable: (1, ""), "nvidia-smi": (0, smi)})   # torch missing or broken
    assert repeat.gpu_count() == 2
    answers.update({"nvidia-smi": OSError("not found")})
    assert repeat.gpu_count() == 0
    answers.update({"nvidia-smi": (9, "NVIDIA-SMI has failed")})
    assert repeat.gpu_count() == 0
