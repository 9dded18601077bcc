"""A launcher killed outright: a torchrun worker follows its launcher (the parent-death signal, SIGTERM) and its stop
vote checks that the launcher is still its parent, so it stops as on the launcher's SIGTERM. The whole path under
run.sh (torchrun SIGKILLed, no worker left) is test_run_sh's test_workers_of_a_launcher_killed_outright_..."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import harness
from _shards import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc are Linux's")


def test_a_worker_gets_sigterm_when_its_launcher_dies(tmp_path):
    """A stand-in launcher starts a worker that asks for the parent-death signal and records it, then dies by
    SIGKILL; the worker is told, with SIGTERM."""
    flag = tmp_path / "got"
    worker = textwrap.dedent(f"""
        import signal, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        import harness
        signal.signal(signal.SIGTERM, lambda *a: (open({str(flag)!r}, "w").write("SIGTERM"), sys.exit(0)))
        assert harness.follow_the_launcher()
        print("ready", flush=True)
        time.sleep(60)                    # ends without the flag when no signal comes
    """)
    launcher = textwrap.dedent(f"""
        import subprocess, sys, os, signal
        p = subprocess.Popen([sys.executable, "-c", {worker!r}], stdout=subprocess.PIPE, text=True)
        print(p.pid, flush=True)
        assert p.stdout.readline().strip() == "ready"
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    run = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=120)
    assert run.returncode == -signal.SIGKILL, run.stderr
    pid = int(run.stdout.split()[0])
    guard = time.time() + 60                      # a hang guard
    while not harness._ended(pid) and time.time() < guard:
        time.sleep(0.2)
    assert harness._ended(pid) and flag.read_text() == "SIGTERM"


def test_the_stop_vote_sees_a_launcher_that_is_no_longer_the_parent(monkeypatch):
    stops = harness.StopSignals(announce=False)
    assert stops.launcher_gone() == 0                       # not a torchrun worker: nothing to follow
    stops.launcher = os.getppid()
    assert stops.launcher_gone() == 0 and stops.requested is None
    monkeypatch.setattr(os, "getppid", lambda: 1)           # handed to init: the launcher died
    assert stops.launcher_gone() == signal.SIGTERM and stops.requested == signal.SIGTERM


def test_a_torchrun_worker_records_its_launcher_when_it_installs_the_handlers(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    followed = []
    monkeypatch.setattr(harness, "follow_the_launcher", lambda: followed.append(1) or True)
    stops = harness.StopSignals(announce=False)
    stops.install()
    try:
        assert stops.launcher == os.getppid() and followed == [1]
    finally:
        stops.uninstall()
