"""Two nodes on one CPU machine, started exactly as run.sh starts them: two `run.sh` processes with NNODES=2, each a
torchrun agent with 2 gloo workers, meeting through c10d at 127.0.0.1. Four processes are more than the tiny preset's
--batch_slices=2, so this is the many-node path. A refused option is one line from the whole job; a worker SIGKILLed
mid-run (as the OOM killer does) is named by every survivor and both nodes exit 4; the states the two nodes saved
resume on two nodes and are refused on one."""
import os
import re
import signal
import subprocess
import time
import uuid

import pytest

from _shards import CPU_MALLOC_ENV, ROOT, make_dataset, python_with_gpus

pytestmark = pytest.mark.slow
HANG_GUARD_S = 300          # every wait below is bounded by it; nothing asserts how long a step takes
ARGS = ["--preset=tiny", "--model_dim=64", "--head_dim=16", "--mlp_hidden=256", "--val_loss_every=0", "--seed=0",
        "--num_scheduled_iterations=10", "--num_extension_iterations=0", "--warmup=false"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """run.sh's environment for 2 processes per node on a CPU (python_with_gpus); the data."""
    tmp = tmp_path_factory.mktemp("nodes")
    fake = python_with_gpus(tmp, 2)
    train, val = make_dataset(tmp / "d", train_tokens=300_000, val_tokens=20_000)
    env = dict(os.environ, PYTHON=str(fake), NPROC="2", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1",
               RDZV_TIMEOUT="120", **CPU_MALLOC_ENV)
    return env, [*ARGS, f"--train_files={train}", f"--val_files={val}"]


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cluster, folder, args, nodes=2):
    """`nodes` run.sh processes (one per "node"), each with its console in folder/node<i>.txt; a job mark in their
    environment finds their workers."""
    env, common = cluster
    mark, port = uuid.uuid4().hex, free_port()
    procs = []
    for i in range(nodes):
        node_env = dict(env, NNODES=str(nodes), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RDZV_ID=mark,
                        JOB_MARK=mark)
        with open(folder / f"node{i}.txt", "w") as console:
            procs.append(subprocess.Popen(["bash", str(ROOT / "run.sh"), *common, *args], cwd=folder, env=node_env,
                                          stdout=console, stderr=subprocess.STDOUT, start_new_session=True))
    return procs, mark


def finish(procs, folder):
    """Each node's exit code and console, every process ended (killed past the hang guard)."""
    try:
        for p in procs:
            p.wait(timeout=HANG_GUARD_S)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [p.returncode for p in procs], [(folder / f"node{i}.txt").read_text() for i in range(len(procs))]


def workers(mark):
    """{RANK: pid} of the trainer processes of the job with this mark."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = dict(v.split("=", 1) for v in open(f"/proc/{pid}/environ").read().split("\0") if "=" in v)
            cmd = open(f"/proc/{pid}/cmdline").read()
        except OSError:
            continue
        if env.get("JOB_MARK") == mark and "RANK" in env and "train_gpt.py" in cmd:
            found[int(env["RANK"])] = int(pid)
    return found


def errors(text):
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_refused_option_is_one_line_from_the_whole_job(cluster, tmp_path):
    codes, consoles = finish(start(cluster, tmp_path, ["--bogus=1"])[0], tmp_path)
    assert codes == [2, 2], consoles
    assert errors("".join(consoles)) == ["error: unknown option --bogus; python3 train_gpt.py --help lists them"]
    assert "Traceback" not in "".join(consoles) and "ChildFailedError" not in "".join(consoles), consoles


STUB_WORKER = """import os, signal, sys, time
# a rank that has said why it stops (run.sh's exit-code folder) and exits: at once on the first node, late on the other
open(os.path.join(os.environ["RUN_SH_EXIT_DIR"], "rank" + os.environ["RANK"]), "w").write("4\\n")
signal.signal(signal.SIGTERM, lambda *_: (print("worker: SIGTERM from its agent", flush=True), sys.exit(4)))
time.sleep(float(os.environ["STUB_EXIT_AFTER_S"]))
sys.exit(4)
"""


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_node_whose_rendezvous_store_went_first_shows_none_of_torchruns_traceback(cluster, tmp_path):
    """The first node's agent hosts the c10d store; its worker stops at once, so that agent exits while the second
    node's worker is still running. The second agent then loses the store mid-poll: C++ warnings with their stacks
    and a chained RendezvousConnectionError, which go aside like torchrun's other tracebacks; the second node stops
    its worker and exits with the rank's code."""
    env, _ = cluster
    (tmp_path / "stub.py").write_text(STUB_WORKER)
    port, mark = free_port(), uuid.uuid4().hex
    procs = []
    for i, exit_after in enumerate(["0.5", str(HANG_GUARD_S)]):
        node_env = dict(env, NNODES="2", NPROC="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RDZV_ID=mark,
                        TRAIN=str(tmp_path / "stub.py"), STUB_EXIT_AFTER_S=exit_after)
        with open(tmp_path / f"node{i}.txt", "w") as console:
            procs.append(subprocess.Popen(["bash", str(ROOT / "run.sh"), "--train_files=unused"], cwd=tmp_path,
                                          env=node_env, stdout=console, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        if i == 0:                                    # the first node binds the store before the second looks for it
            deadline = time.monotonic() + HANG_GUARD_S
            while not _listening(port):
                assert time.monotonic() < deadline and procs[0].poll() is None, (tmp_path / "node0.txt").read_text()
                time.sleep(0.1)
    codes, consoles = finish(procs, tmp_path)
    assert codes == [4, 4], consoles
    assert "worker: SIGTERM from its agent" in consoles[1], consoles   # the second agent failed, not its worker
    for face in ("Traceback", "Error", "frame #", "[c10d]", "torch/distributed"):
        assert face not in consoles[1], consoles[1]


def _listening(port):
    import socket
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.timeout(3 * HANG_GUARD_S)
def test_a_killed_worker_is_named_by_every_survivor_and_the_saved_states_resume_on_two_nodes_only(cluster, tmp_path):
    logs = tmp_path / "logs"
    procs, mark = start(cluster, tmp_path, ["--checkpoint_every=2", f"--log_dir={logs}", "--run_id=two"])
    deadline = time.monotonic() + HANG_GUARD_S
    while not (logs / "two" / "state_step000004_rank3.pt").exists():     # two periodic state sets are on disk
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), finish(procs, tmp_path)
        time.sleep(0.2)
    victim = workers(mark)[3]
    os.kill(victim, signal.SIGKILL)
    codes, consoles = finish(procs, tmp_path)
    out = "".join(consoles)
    assert codes == [4, 4], out[-4000:]               # every survivor stopped because another rank failed
    lines = errors(out)
    survivors = sorted(int(re.match(r"error: rank (\d+): ", line)[1]) for line in lines)
    assert survivors == [0, 1, 2], lines              # each says so, naming the dead worker by rank and pid
    assert all("The first failure: rank 3 (" in line and f"pid {victim})" in line for line in lines), lines
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-4000:]

    # the same two nodes go on from the newest whole state set; one node (2 processes) cannot take 4 ranks' states
    procs, _ = start(cluster, tmp_path, [f"--resume={logs / 'two'}", f"--log_dir={logs}", "--run_id=again"])
    codes, consoles = finish(procs, tmp_path)
    out = "".join(consoles)
    assert codes == [0, 0], out[-4000:]
    resumed = re.search(r"^resumed from \S+state_step(\d+)_rank0\.pt after step (\d+) of 10", out, re.M)
    assert resumed and int(resumed[1]) == int(resumed[2]) >= 4, out[-4000:]
    assert re.search(r"^result: val_loss:[0-9.]+ .* steps:10 ", out, re.M), out[-4000:]
    assert "Warning" not in out, out[-4000:]          # a clean console (torch 2.13 warns on old collective names)

    procs, _ = start(cluster, tmp_path, [f"--resume={logs / 'two'}", f"--log_dir={logs}", "--run_id=one"], nodes=1)
    codes, consoles = finish(procs, tmp_path)
    assert codes == [2], consoles
    assert len(errors(consoles[0])) == 1 and "resume with 4 processes" in errors(consoles[0])[0], consoles
