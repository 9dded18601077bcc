"""run.sh on a CPU and without network: run.sh and the data scripts are copied into a temporary folder (so the
checkout's data/fineweb10B/ is never touched) and run there. What cannot run here is said first: a machine without a
GPU (CUDA_VISIBLE_DEVICES empty, or no driver and no torch yet) is refused with one `run.sh: error:` line naming "Try
it on a CPU", before anything is installed or downloaded. With GPUs (a PYTHON whose GPU count says so) and the default
data missing, run.sh runs data/cached_fineweb10B.py itself; offline, that download fails and run.sh ends with one
`run.sh: error:` line naming the synthetic smoke run. With a stub Python: the install of a bare machine (with
progress, the tested versions), the process count refused before any download, and the torchrun arguments of several
nodes. requirements.txt bounds torch and triton to the tested versions."""
import glob
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from _data_helpers import load_script
from _shards import ROOT, write_shard

pytestmark = pytest.mark.slow     # each run.sh call imports torch twice: several seconds

# run.sh installs requirements.txt when one of these is missing: that needs the network, so such a machine skips
for _module in ("torch", "triton", "numpy", "tiktoken", "huggingface_hub"):
    pytest.importorskip(_module)

HANG_GUARD_S = 180        # the offline download takes about 7 s (3 attempts, 2 s and 4 s apart)
SYNTHETIC_RUN = ("python3 data/synthetic.py --out data/synthetic --preset=full",
                 "./run.sh --train_files='data/synthetic/fineweb_train_*.bin' "
                 "--val_files='data/synthetic/fineweb_val_*.bin'")


@pytest.fixture
def tree(tmp_path):
    """A copy of run.sh, data/*.py and the trainer's files (train_gpt.py reads the shard format from data/shards.py):
    what run.sh needs up to the GPU check."""
    for path in [ROOT / "run.sh", *ROOT.glob("*.py")]:
        shutil.copy2(path, tmp_path / path.name)
    (tmp_path / "data").mkdir()
    for script in (ROOT / "data").glob("*.py"):
        shutil.copy2(script, tmp_path / "data" / script.name)
    return tmp_path


def default_shard_names():
    """The val shard and the train shards the download script fetches by default."""
    fineweb = load_script("cached_fineweb10B")
    return fineweb.shard_names(fineweb.DEFAULT_TRAIN_SHARDS)


def write_default_shards(tree, names):
    folder = tree / "data" / "fineweb10B"
    folder.mkdir(exist_ok=True)
    tokens = np.full(64, 50256, dtype=np.uint16)     # tiny, but a valid header and size: all the check reads
    for name in names:
        write_shard(folder / name, tokens)


def run_sh(tree, *args, gpus=None):
    """run.sh offline on a CPU; gpus: a PYTHON whose GPU count says that many (the real Python for the rest)."""
    from _shards import python_with_gpus
    python = sys.executable if gpus is None else str(python_with_gpus(tree, gpus))
    env = dict(os.environ, PYTHON=python, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1",
               HF_ENDPOINT="http://127.0.0.1:9", PYTHONUNBUFFERED="1")
    env.pop("NPROC", None)
    result = subprocess.run(["bash", str(tree / "run.sh"), *args], cwd=tree, env=env, capture_output=True, text=True,
                            timeout=HANG_GUARD_S)
    return result, result.stdout + result.stderr


def test_offline_download_fails_with_one_error_line_naming_the_synthetic_run(tree):
    result, out = run_sh(tree, gpus=1)
    assert result.returncode == 1, out
    assert "Traceback" not in out
    errors = [line for line in out.splitlines() if line.startswith("run.sh: error:")]
    assert len(errors) == 1, out
    assert "could not be downloaded" in errors[0]
    for command in SYNTHETIC_RUN:
        assert command in errors[0]
    assert "data/cached_fineweb10B.py" in out         # run.sh said what it runs
    assert "no CUDA GPU" not in out
    # nothing under a shard's name, no temporary folder left behind
    assert [p.name for p in (tree / "data" / "fineweb10B").iterdir()] == []


def test_partial_data_fetches_only_what_is_missing(tree):
    names = default_shard_names()
    write_default_shards(tree, names[:3])               # the val shard and train shards 1 and 2
    result, out = run_sh(tree, gpus=1)
    assert result.returncode == 1, out
    assert f"lacks {len(names) - 3} of the {len(names)} shards" in out
    assert f"{names[0]}: present and valid, skipped" in out
    assert f"[4/{len(names)}] {names[3]}: downloading" in out     # a line per shard, as it starts
    assert sum(line.startswith("run.sh: error:") for line in out.splitlines()) == 1, out
    assert "Traceback" not in out


def test_a_cpu_machine_with_torch_is_refused_before_the_data_step(tree):
    """torch installed, CUDA_VISIBLE_DEVICES empty: one line pointing at Try it on a CPU; nothing is fetched."""
    result, out = run_sh(tree)                        # no shards at all
    assert result.returncode == 1, out
    assert out.splitlines() == [out.strip()] and out.startswith("run.sh: error: no CUDA GPU found ("), out
    assert "\"Try it on a CPU\": python3 train_gpt.py --preset=tiny" in out
    assert "cached_fineweb10B" not in out and "downloading" not in out
    assert not (tree / "data" / "fineweb10B").exists()


def test_a_bad_nproc_is_refused_before_anything_else(tree):
    env = dict(os.environ, PYTHON=sys.executable, NPROC="3", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(["bash", str(tree / "run.sh")], cwd=tree, env=env, capture_output=True, text=True,
                            timeout=HANG_GUARD_S)
    assert result.returncode == 1
    assert result.stderr.strip() == "run.sh: error: NPROC=3 must divide 8 (1, 2, 4 or 8)"
    assert not (tree / "data" / "fineweb10B").exists()


# ---- the launcher's face: torchrun with 2 gloo processes on a CPU, as run.sh starts them ----------------------------

@pytest.fixture
def two_cpu_ranks(tmp_path):
    """run.sh's environment for 2 processes on a CPU: a PYTHON whose GPU count (run.sh's check) says 2, the real
    Python for everything else; the trainer then finds no CUDA and runs on gloo."""
    from _shards import CPU_MALLOC_ENV, make_dataset, python_with_gpus
    fake = python_with_gpus(tmp_path, 2)
    train, val = make_dataset(tmp_path / "d", train_tokens=2_000_000, val_tokens=20_000)
    env = dict(os.environ, PYTHON=str(fake), NPROC="2", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1",
               **CPU_MALLOC_ENV)
    args = ["--preset=tiny", "--warmup=false", "--val_loss_every=0", "--seed=0", f"--train_files={train}",
            f"--val_files={val}", f"--log_dir={tmp_path / 'logs'}"]
    return env, args


def error_lines(out):
    return [line for line in out.splitlines() if line.startswith("error:") or ": error:" in line]


@pytest.mark.timeout(900)
def test_a_bad_option_under_run_sh_is_exit_2_and_one_error_line(two_cpu_ranks):
    env, args = two_cpu_ranks
    result = subprocess.run(["bash", str(ROOT / "run.sh"), *args, "--bogus=1"], env=env, capture_output=True,
                            text=True, timeout=HANG_GUARD_S)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert error_lines(out) == ["error: unknown option --bogus; python3 train_gpt.py --help lists them"], out
    assert "Traceback" not in out and "ChildFailedError" not in out, out


@pytest.mark.timeout(900)
def test_sigterm_to_run_sh_between_check_steps_stops_every_rank_at_one_step_with_143(two_cpu_ranks, tmp_path):
    """The NaN check (so formerly the stop) comes every 25 steps; the SIGTERM goes to run.sh at step 2's line. Every
    rank stops after the same step, a step or two later, saves it, and run.sh exits 143 with the one error line and
    no traceback (a stop after torchrun's SIGKILL would save nothing and exit otherwise). No wall time is asserted:
    the steps' pace is the machine's."""
    import signal
    import time
    import torch
    env, args = two_cpu_ranks
    proc = subprocess.Popen(["bash", str(ROOT / "run.sh"), *args, "--save_checkpoint", "--run_id=term"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, seen = time.time() + 600, []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("step:2/") or time.time() > deadline:
                break
        assert seen and seen[-1].startswith("step:2/"), "".join(seen) + proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)                    # a hang guard
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(seen) + out + err
    assert proc.returncode == 143, out[-3000:]
    assert "Traceback" not in out and "SignalException" not in out, out[-3000:]
    errors = error_lines(out)
    assert len(errors) == 1 and errors[0].startswith("error: rank 0: stopped by SIGTERM after step "), out[-3000:]
    step = int(errors[0].split("after step ")[1].split()[0])
    assert 2 <= step < 25, step                                  # not at the NaN check's step 25
    for rank in range(2):
        state = tmp_path / "logs" / "term" / f"state_step{step:06d}_rank{rank}.pt"
        assert torch.load(state, weights_only=False)["step"] == step
    assert (tmp_path / "logs" / "term.txt").read_text().splitlines()[-1] == errors[0].replace("rank 0: ", "")


def _children(pid):
    """The pids whose parent is `pid` (from /proc)."""
    from pathlib import Path
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _cmdline(pid):
    from pathlib import Path
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.timeout(900)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_of_a_launcher_killed_outright_stop_save_and_leave_no_process(two_cpu_ranks, tmp_path):
    """SIGKILL to torchrun (the OOM killer, a dropped job step): its workers stop themselves as on its SIGTERM, after
    the same step, with that step's state saved, and none is left running; run.sh ends with their code (143) and its
    EXIT trap cleans up without an error of its own."""
    import harness
    import signal
    import time
    import torch
    env, args = two_cpu_ranks
    proc = subprocess.Popen(["bash", str(ROOT / "run.sh"), *args, "--save_checkpoint", "--run_id=orphan"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers = []
    try:
        deadline, seen = time.time() + 600, []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("step:2/") or time.time() > deadline:
                break
        assert seen and seen[-1].startswith("step:2/"), "".join(seen) + proc.stderr.read()
        torchrun = [pid for pid in _children(proc.pid) if "torch.distributed.run" in _cmdline(pid)]
        assert len(torchrun) == 1, [_cmdline(pid) for pid in _children(proc.pid)]
        workers = [pid for pid in _children(torchrun[0]) if "train_gpt.py" in _cmdline(pid)]
        assert len(workers) == 2, [_cmdline(pid) for pid in _children(torchrun[0])]
        os.kill(torchrun[0], signal.SIGKILL)
        guard = time.time() + 300                                   # a hang guard, not a timing claim
        while not all(harness._ended(pid) for pid in workers) and time.time() < guard:
            time.sleep(0.5)
        left = [pid for pid in workers if not harness._ended(pid)]
        out, err = proc.communicate(timeout=300)
    finally:
        for pid in workers:
            if not harness._ended(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
    out = "".join(seen) + out + err
    assert left == [], f"workers {left} outlived their launcher: {out[-3000:]}"
    assert "unbound variable" not in out and "Traceback" not in out, out[-3000:]
    assert proc.returncode == 143, out[-3000:]
    errors = error_lines(out)
    assert len(errors) == 1 and errors[0].startswith("error: rank 0: stopped by SIGTERM after step "), out[-3000:]
    step = int(errors[0].split("after step ")[1].split()[0])
    for rank in range(2):
        state = tmp_path / "logs" / "orphan" / f"state_step{step:06d}_rank{rank}.pt"
        assert torch.load(state, weights_only=False)["step"] == step


# ---- the process count and the rendezvous, with a stub Python: no torch, GPUs, network or torchrun -----------------

@pytest.fixture
def stub_python(tree):
    """A PYTHON that says the requirements are installed and FAKE_GPUS GPUs are found, records each call in
    calls.txt, fails the download (so a test that reaches it ends at once) and, as torchrun, writes its arguments
    one a line to torchrun.txt; anything else runs in the real Python."""
    stub = tree / "python"
    stub.write_text("#!/usr/bin/env bash\n"
                    f'echo "$*" >> {tree / "calls.txt"}\n'
                    'if [ "$1" = -c ] && [[ "$2" == "import torch, triton"* ]]; then exit 0; fi\n'
                    'if [ "$1" = -c ] && [[ "$2" == *device_count* ]]; then echo "$FAKE_GPUS"; exit 0; fi\n'
                    'if [ "$1" = data/cached_fineweb10B.py ]; then exit 1; fi\n'
                    f'if [ "$1" = -m ] && [ "$2" = torch.distributed.run ]; then shift 2; '
                    f'printf "%s\\n" "$@" > {tree / "torchrun.txt"}; exit 0; fi\n'
                    f'exec {sys.executable} "$@"\n')
    stub.chmod(0o755)
    return tree


def run_stubbed(tree, gpus, *args, **env):
    """run.sh with the stub Python and the launch variables in env (the shell's own are dropped); returns the
    result, its output, the stub's calls and torchrun's arguments (None if it was not started)."""
    full = dict(os.environ, PYTHON=str(tree / "python"), FAKE_GPUS=str(gpus), **env)
    for name in ("NPROC", "NNODES", "MASTER_ADDR", "MASTER_PORT", "LOCAL_ADDR", "RDZV_TIMEOUT", "RDZV_ID"):
        if name not in env:
            full.pop(name, None)
    result = subprocess.run(["bash", str(tree / "run.sh"), *args], cwd=tree, env=full, capture_output=True, text=True,
                            timeout=HANG_GUARD_S)
    calls = (tree / "calls.txt").read_text() if (tree / "calls.txt").exists() else ""
    torchrun = (tree / "torchrun.txt").read_text().splitlines() if (tree / "torchrun.txt").exists() else None
    return result, result.stdout + result.stderr, calls, torchrun


@pytest.mark.parametrize("env, gpus, fix", [
    ({"NNODES": "3", "NPROC": "8"}, 8, "NNODES=3 x NPROC=8 = 24 processes, but a run takes 1, 2, 4, 8, 16, 32 or 64: "
                                       "set NNODES=2 or NNODES=4 (with NPROC=8)"),
    ({"NNODES": "3"}, 8, "NNODES=3 x NPROC=8 = 24 processes"),               # NPROC from the GPU count
    ({"NNODES": "5", "NPROC": "8"}, 8, "set NNODES=4 or NNODES=8 (with NPROC=8)"),
    ({"NNODES": "16", "NPROC": "8"}, 8, "NNODES=16 x NPROC=8 = 128 processes, but a run takes 1, 2, 4, 8, 16, 32 or "
                                        "64: set NNODES=8 (with NPROC=8), or NPROC=4 (with NNODES=16)"),
])
def test_a_process_count_the_trainer_refuses_is_refused_before_any_download(stub_python, env, gpus, fix):
    result, out, calls, torchrun = run_stubbed(stub_python, gpus, MASTER_ADDR="10.0.0.1", **env)
    assert result.returncode == 1, out
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("run.sh: error: ") and fix in errors[0], out
    assert "cached_fineweb10B" not in calls and "downloading" not in out      # no shards exist: it would have fetched
    assert torchrun is None
    if "NPROC" in env:
        assert calls == ""                       # refused before installing or counting anything


@pytest.mark.parametrize("env, gpus, timeout", [
    ({"NNODES": "2", "NPROC": "8", "LOCAL_ADDR": "10.0.0.2"}, 8, "1800"),
    ({"NNODES": "8", "RDZV_TIMEOUT": "7200"}, 8, "7200"),                  # 64 processes, NPROC from the GPU count
])
def test_several_nodes_start_torchrun_with_this_nodes_address_and_a_long_rendezvous(stub_python, env, gpus, timeout):
    result, out, calls, torchrun = run_stubbed(stub_python, gpus, "--train_files=elsewhere/fineweb_train_*.bin",
                                               MASTER_ADDR="10.0.0.1", **env)
    assert result.returncode == 0, out
    assert torchrun is not None, out
    assert torchrun[-2:] == ["train_gpt.py", "--train_files=elsewhere/fineweb_train_*.bin"]
    assert f"--nnodes={env['NNODES']}" in torchrun and "--nproc_per_node=8" in torchrun
    assert "--rdzv_endpoint=10.0.0.1:29500" in torchrun
    # torchrun's c10d rendezvous waits 60 s for its store and 600 s for every node to join unless told otherwise
    assert f"--rdzv_conf=read_timeout={timeout},join_timeout={timeout}" in torchrun
    if "LOCAL_ADDR" in env:
        assert "--local_addr=10.0.0.2" in torchrun
    else:
        assert not any(a.startswith("--local_addr") for a in torchrun)    # torchrun's own default: the FQDN


@pytest.mark.parametrize("env, words", [
    ({"NNODES": "2", "NPROC": "8", "RDZV_TIMEOUT": "soon"}, "RDZV_TIMEOUT=soon must be whole seconds"),
    ({"NNODES": "2", "NPROC": "8", "RDZV_TIMEOUT": "0"}, "RDZV_TIMEOUT=0 must be whole seconds"),
])
def test_a_bad_rendezvous_timeout_is_refused_with_one_line(stub_python, env, words):
    result, out, calls, torchrun = run_stubbed(stub_python, 8, MASTER_ADDR="10.0.0.1", **env)
    assert result.returncode == 1 and torchrun is None and calls == "", out
    assert result.stderr.startswith(f"run.sh: error: {words}") and len(result.stderr.splitlines()) == 1, out


def test_train_names_the_script_torchrun_starts_and_a_missing_one_is_one_line(stub_python):
    """TRAIN=my_idea.py ./run.sh starts torchrun on the copy (a path from where run.sh was started), not train_gpt.py;
    a TRAIN that is not a file is refused before anything is installed or counted."""
    shutil.copy2(stub_python / "train_gpt.py", stub_python / "my_idea.py")
    result, out, calls, torchrun = run_stubbed(stub_python, 8, "--train_files=elsewhere/fineweb_train_*.bin",
                                               TRAIN="my_idea.py")
    assert result.returncode == 0 and torchrun is not None, out
    assert torchrun[-2:] == [str(stub_python / "my_idea.py"), "--train_files=elsewhere/fineweb_train_*.bin"]
    for left in ("calls.txt", "torchrun.txt"):                  # the first run's
        (stub_python / left).unlink(missing_ok=True)
    result, out, calls, torchrun = run_stubbed(stub_python, 8, TRAIN="no_such_idea.py")
    assert result.returncode == 1 and torchrun is None and calls == "", out
    assert result.stderr.startswith("run.sh: error: TRAIN=no_such_idea.py is not a file") and \
        len(result.stderr.splitlines()) == 1, out


def test_data_present_starts_torchrun_without_downloading(stub_python):
    write_default_shards(stub_python, default_shard_names())
    result, out, calls, torchrun = run_stubbed(stub_python, 1)
    assert result.returncode == 0 and torchrun is not None, out
    assert "data/cached_fineweb10B.py" not in calls and "downloading" not in out and "fetching" not in out
    assert "--nproc_per_node=1" in torchrun and torchrun[-1] == "train_gpt.py"


@pytest.mark.parametrize("args", [("--train_files=elsewhere/fineweb_train_*.bin",), ("--dry_run",)])
def test_own_data_or_a_dry_run_skips_the_data_step(stub_python, args):
    result, out, calls, torchrun = run_stubbed(stub_python, 1, *args)      # no shards at all
    assert result.returncode == 0 and torchrun is not None, out
    assert torchrun[-1] == args[0]
    assert "cached_fineweb10B" not in calls and "downloading" not in out
    assert not (stub_python / "data" / "fineweb10B").exists()


# ---- a bare machine: no torch yet (a stub Python whose torch imports fail until its pip has run) -------------------

NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
             "latest NVIDIA driver is installed and running.", 9)
TWO_GPUS = ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1)", 0)


@pytest.fixture
def bare_python(tree):
    """A PYTHON without torch: every `-c` that imports torch fails until `-m pip` has run (which records itself and
    "installs"); after it, the GPU count says FAKE_GPUS. It records each call in calls.txt, fails the download and,
    as torchrun, writes its arguments to torchrun.txt; anything else runs in the real Python."""
    stub = tree / "python"
    stub.write_text("#!/usr/bin/env bash\n"
                    f'echo "$*" >> {tree / "calls.txt"}\n'
                    f'if [ "$1" = -m ] && [ "$2" = pip ]; then touch {tree / "installed"}; exit 0; fi\n'
                    'if [ "$1" = -c ] && [[ "$2" == *"import torch"* ]]; then\n'
                    f'  [ -e {tree / "installed"} ] || exit 1\n'
                    '  if [[ "$2" == *device_count* ]]; then echo "$FAKE_GPUS"; fi; exit 0\n'
                    'fi\n'
                    'if [ "$1" = data/cached_fineweb10B.py ]; then exit 1; fi\n'
                    f'if [ "$1" = -m ] && [ "$2" = torch.distributed.run ]; then shift 2; '
                    f'printf "%s\\n" "$@" > {tree / "torchrun.txt"}; exit 0; fi\n'
                    f'exec {sys.executable} "$@"\n')
    stub.chmod(0o755)
    return tree


def run_bare(tree, nvidia_smi, *args, gpus_after_install=0, **env):
    """run.sh with the bare stub Python; nvidia_smi: (its output, exit code) for a fake nvidia-smi first on PATH, or
    None for none at all (skipped where the machine has one, or /dev/nvidia<n> devices). CUDA_VISIBLE_DEVICES only
    as env says. Returns what run_stubbed returns."""
    bin_dir = tree / "bin"
    bin_dir.mkdir()
    if nvidia_smi is None:
        if shutil.which("nvidia-smi") or glob.glob("/dev/nvidia[0-9]*"):
            pytest.skip("this machine has nvidia-smi or an NVIDIA device")
    else:
        text, code = nvidia_smi
        (bin_dir / "nvidia-smi").write_text(f"#!/usr/bin/env bash\nprintf '%b\\n' '{text}'\nexit {code}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **env}
    if "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = None
    full = dict(os.environ, PYTHON=str(tree / "python"), FAKE_GPUS=str(gpus_after_install))
    for name in ("NPROC", "NNODES", "MASTER_ADDR", "MASTER_PORT", "LOCAL_ADDR", "RDZV_TIMEOUT", "RDZV_ID", "TRAIN"):
        full.pop(name, None)
    for name, value in env.items():
        if value is None:
            full.pop(name, None)
        else:
            full[name] = value
    result = subprocess.run(["bash", str(tree / "run.sh"), *args], cwd=tree, env=full, capture_output=True, text=True,
                            timeout=HANG_GUARD_S)
    calls = (tree / "calls.txt").read_text() if (tree / "calls.txt").exists() else ""
    torchrun = (tree / "torchrun.txt").read_text().splitlines() if (tree / "torchrun.txt").exists() else None
    return result, result.stdout + result.stderr, calls, torchrun


@pytest.mark.parametrize("nvidia_smi, env, args, why, script", [
    (NO_DRIVER, {}, (), "nvidia-smi -L lists none", "train_gpt.py"),
    (None, {}, (), "no nvidia-smi and no /dev/nvidia<n> device", "train_gpt.py"),
    (TWO_GPUS, {"CUDA_VISIBLE_DEVICES": ""}, (), "CUDA_VISIBLE_DEVICES='' selects none", "train_gpt.py"),
    (NO_DRIVER, {}, ("--dry_run",), "nvidia-smi -L lists none", "train_gpt.py"),     # a dry run's checks need GPUs
    (NO_DRIVER, {"TRAIN": "my_idea.py"}, (), "nvidia-smi -L lists none", "my_idea.py"),
])
def test_a_bare_machine_without_a_gpu_is_refused_before_any_install_or_download(bare_python, nvidia_smi, env, args,
                                                                                 why, script):
    if "TRAIN" in env:
        shutil.copy2(bare_python / "train_gpt.py", bare_python / script)
    result, out, calls, torchrun = run_bare(bare_python, nvidia_smi, *args, **env)
    assert result.returncode == 1, out
    assert out.splitlines() == [out.strip()], out                   # one line, and nothing else
    assert out.startswith(f"run.sh: error: no CUDA GPU found ({why}; nothing was installed or downloaded); "), out
    assert out.rstrip().endswith(f"see the README's \"Try it on a CPU\": python3 {script} --preset=tiny "
                                 f"--train_files=... --val_files=..."), out
    assert "pip" not in calls and "cached_fineweb10B" not in calls and torchrun is None, calls
    assert not (bare_python / "data" / "fineweb10B").exists()


def test_a_bare_machine_with_gpus_installs_the_requirements_with_progress_then_fetches(bare_python):
    """The driver lists 2 GPUs, torch is missing: run.sh says what it installs and why, runs pip without -q (its
    progress shows), counts again with torch, and only then goes on to the data step."""
    result, out, calls, torchrun = run_bare(bare_python, TWO_GPUS, gpus_after_install=2)
    assert result.returncode == 1 and torchrun is None, out                  # the stub's download fails
    calls = calls.splitlines()
    pips = [c for c in calls if c.startswith("-m pip")]
    assert pips == ["-m pip install -r requirements.txt"], calls              # once, and not quiet
    assert calls.index(pips[0]) < calls.index("data/cached_fineweb10B.py"), calls
    said = [line for line in out.splitlines() if "pip install -r requirements.txt" in line]
    assert len(said) == 1 and said[0].startswith("run.sh: ") and "cannot import" in said[0] \
        and "the versions the project tests" in said[0], out
    errors = [line for line in out.splitlines() if line.startswith("run.sh: error:")]
    assert len(errors) == 1 and "could not be downloaded" in errors[0], out


def test_a_cpu_build_installed_on_a_gpu_machine_is_one_line(bare_python):
    result, out, calls, torchrun = run_bare(bare_python, TWO_GPUS, "--train_files=elsewhere/fineweb_train_*.bin",
                                            gpus_after_install=0)
    assert result.returncode == 1 and torchrun is None, out
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("run.sh: error: no CUDA GPU found (the driver lists 2, but the "
                                                     "torch just installed sees none"), out


def test_a_bare_machine_with_gpus_and_its_own_data_starts_torchrun_on_torchs_count(bare_python):
    result, out, calls, torchrun = run_bare(bare_python, TWO_GPUS, "--train_files=elsewhere/fineweb_train_*.bin",
                                            gpus_after_install=2)
    assert result.returncode == 0 and torchrun is not None, out
    assert "--nproc_per_node=2" in torchrun and "-m pip install -r requirements.txt" in calls


# ---- the tested stack -------------------------------------------------------------------------------------------

TESTED = {"torch": ("2.11", "2.13"), "triton": ("3.6", "3.9")}      # first and last tested minor versions


def _requirements():
    from packaging.requirements import Requirement
    reqs = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            reqs[req.name] = req.specifier
    return reqs


@pytest.mark.parametrize("name", sorted(TESTED))
def test_requirements_bound_torch_and_triton_to_the_tested_versions(name):
    """requirements.txt (what ./run.sh installs) admits every release of the tested minor versions and nothing newer
    or older; docs/running.md names the same range, and CI's torch pin is inside it."""
    from packaging.version import Version
    spec = _requirements()[name]
    low, high = (Version(v) for v in TESTED[name])
    inside = [f"{low}.0", f"{high}.0", f"{high}.9"]
    outside = [f"{low.major}.{low.minor - 1}.0", f"{high.major}.{high.minor + 1}.0", f"{high.major + 1}.0.0"]
    assert [v for v in inside if v not in spec] == [], f"requirements.txt: {name}{spec}"
    assert [v for v in outside if v in spec] == [], f"requirements.txt: {name}{spec} admits untested versions"
    assert f"{name} {TESTED[name][0]} to {TESTED[name][1]}" in (ROOT / "docs" / "running.md").read_text()
    if name == "torch":
        pin = re.search(r"pip install -q torch==(\S+)", (ROOT / ".ci" / "run").read_text()).group(1)
        assert pin in spec, f".ci/run installs torch=={pin}, outside requirements.txt's {spec}"


def test_run_sh_help_documents_train_and_needs_no_gpu(tree):
    result, out = run_sh(tree, "--help")
    assert result.returncode == 0, out
    assert "TRAIN=my_idea.py ./run.sh" in out and "usage: python3 train_gpt.py" in out
    assert "no CUDA GPU" not in out and "downloading" not in out


def test_run_sh_help_on_a_bare_machine_gives_its_usage_and_how_to_list_the_options(tree):
    """Without the requirements the script cannot import to list its options: run.sh --help still prints its own
    usage, then one line naming the install and the missing module, never a traceback."""
    bare = tree / "python"
    bare.write_text(f'#!/usr/bin/env bash\nexec {sys.executable} -S "$@"\n')     # -S: no site packages (no numpy)
    bare.chmod(0o755)
    env = dict(os.environ, PYTHON=str(bare), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(["bash", str(tree / "run.sh"), "--help"], cwd=tree, env=env, capture_output=True,
                            text=True, timeout=HANG_GUARD_S)
    out = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in out, out
    assert "TRAIN=my_idea.py ./run.sh" in out and "usage: python3 train_gpt.py" not in out
    assert out.splitlines()[-1] == (f"(they are listed once its requirements are installed, {bare} -m pip install "
                                    f"-r requirements.txt, by {bare} train_gpt.py --help; here: "
                                    "ModuleNotFoundError: No module named 'numpy')"), out
