"""Failures that name the node at fault: whose failure an error is (the classifier, over real messages), the reports
the ranks leave in the process group's store and what a rank stopped by another says, torchrun's error file, the
shorter timeout of the timed loop, and processes killed mid-run (SIGKILL: the OOM killer's signal)."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import harness
from _shards import CPU_MALLOC_ENV, ROOT, make_dataset

HANG_GUARD_S = 300
HOST = socket.gethostname()

# ---- whose failure: the classifier over real messages --------------------------------------------------------------

GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:52117. This is typically caused by a remote worker crashing. Check the logs of the remote "
               "worker before reporting an error. GLHF! \U0001f3d6\ufe0f")       # provoked: a peer SIGKILLed
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "1000ms for recv operation to complete")                         # provoked: a peer that stops
NCCL_REMOTE = ("NCCL error: remote process exited or there was a network error, NCCL version 2.20.5\nncclRemoteError: "
               "A call failed possibly due to a network error or a remote process exiting prematurely.\nLast error:\n"
               "socketProgress: Connection closed by remote peer gpu-node1<45074>")
CUDA_IMA = ("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported "
            "at some other API call, so the stacktrace below might be incorrect.\nFor debugging consider passing "
            "CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")

# (exception class name, message, kind): gloo and TCPStore wording from libtorch_cpu (provoked or its strings), NCCL's
# from ProcessGroupNCCL / NCCLUtils.cpp (getNcclErrorDetailStr) and ncclGetErrorString, CUDA's from c10/cuda.
MESSAGES = [
    ("RuntimeError", GLOO_CLOSED, "peer"),
    ("RuntimeError", GLOO_TIMEOUT, "timeout"),
    ("RuntimeError", "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.0.0.2]:43210: Connection "
                     "reset by peer", "peer"),
    ("RuntimeError", "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Application timeout caused pair closure",
     "timeout"),
    ("DistNetworkError", "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or "
                         "crash?", "peer"),                                     # provoked: the store's process killed
    ("DistNetworkError", "Broken pipe", "peer"),                                # provoked: the same, on a send
    ("DistNetworkError", "The client socket has failed to connect to [node0]:29500 (errno: 111 - Connection refused).",
     "peer"),
    ("DistStoreError", "wait timeout after 300000ms, keys: /default_pg//0//cuda//0", "timeout"),
    ("DistBackendError", NCCL_REMOTE, "peer"),
    ("DistBackendError", "[PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread terminated with "
                         f"exception: {NCCL_REMOTE}", "peer"),
    ("DistBackendError", "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3112, OpType=ALLREDUCE, "
                         "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600094 milliseconds before timing out.",
     "timeout"),
    ("DistBackendError", "NCCL communicator was aborted on rank 2.", "peer"),
    ("DistBackendError", "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled system "
                         "error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclSystemError: System call "
                         "(e.g. socket, malloc) or external library call failed or device error. \nLast error:\nsocket"
                         "Progress: Connection closed by remote peer node3<40413>", "peer"),
    ("AcceleratorError", CUDA_IMA, "device"),
    ("RuntimeError", "CUDA error: uncorrectable ECC error encountered\nCUDA kernel errors might be asynchronously "
                     "reported at some other API call", "device"),               # torch < 2.8 raised RuntimeError
    ("DistBackendError", "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled cuda "
                         "error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclUnhandledCudaError: Call "
                         "to CUDA function failed.\nLast error:\nCuda failure 'an illegal memory access was encountered'",
     "device"),
    ("DistBackendError", "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled system "
                         "error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclSystemError: System call "
                         "(e.g. socket, malloc) or external library call failed or device error. \nLast error:\nCall to "
                         "ibv_reg_mr failed with error Cannot allocate memory", "device"),
    ("DistBackendError", "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:75, internal error - please "
                         "report this issue to the NCCL developers, NCCL version 2.21.5\nncclInternalError: Internal "
                         "check failed.", "device"),
    ("DistBackendError", "[PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread terminated with exception: "
                         f"{CUDA_IMA}", "device"),                              # a CUDA error wins over "watchdog"
    ("RuntimeError", "Triton Error [CUDA]: an illegal memory access was encountered", "device"),
    ("RuntimeError", "mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)", None),     # a bug: none of these
    ("ValueError", "too many values to unpack (expected 2)", None),
]


@pytest.mark.parametrize("type_name,text,kind", MESSAGES, ids=[f"{i}-{m[2]}" for i, m in enumerate(MESSAGES)])
def test_failure_kind_over_real_messages(type_name, text, kind):
    assert harness.failure_kind(type_name, text) == kind


def test_a_ranks_own_gpu_error_is_its_own_failure_and_a_peers_is_exit_4():
    code, message = harness.describe_failure(torch.AcceleratorError(CUDA_IMA), rank=3, world_size=8)
    assert code == harness.EXIT_DEVICE == 6 and HOST in message and "illegal memory access" in message, message
    wrapped = RuntimeError("InductorError: autotuning failed")                 # wrapped by a compile: still its own
    wrapped.__cause__ = RuntimeError("CUDA error: uncorrectable ECC error encountered")
    assert harness.describe_failure(wrapped, 3, 8)[0] == harness.EXIT_DEVICE
    code, message = harness.describe_failure(RuntimeError(GLOO_CLOSED), 1, 2)
    assert code == harness.EXIT_PEER and "Connection closed by peer [127.0.0.1]:52117" in message, message
    assert "pair.cc" not in message                                            # gloo's source location goes
    # A RuntimeError that says nothing distributed is this rank's own bug, also among several ranks
    assert harness.describe_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), 1, 2)[0] == 5
    assert harness.describe_failure(RuntimeError(GLOO_CLOSED), 0, 1)[0] == harness.EXIT_BUG   # one process: no peer


# ---- the reports in the store and what a rank stopped by another says ------------------------------------------------

def started(store, world_size, host=HOST):
    for rank in range(world_size):
        store.set(f"started/{rank}", json.dumps({"host": host, "pid": 1000 + rank}))


def test_the_first_own_failure_is_recorded_and_named_never_a_signal():
    store = dist.HashStore()
    started(store, 4)
    # rank 3 was stopped by torchrun's SIGTERM before rank 1's own failure was recorded: not the first failure
    assert harness.share_failure(store, 3, 4, 143, "stopped by SIGTERM")[:2] == (143, "stopped by SIGTERM")
    assert harness.share_failure(store, 1, 4, harness.EXIT_DATA, "training data ran out") == (
        harness.EXIT_DATA, "training data ran out", None)
    assert harness.share_failure(store, 2, 4, harness.EXIT_CONFIG, "later")[:2] == (harness.EXIT_CONFIG, "later")
    code, line, when = harness.share_failure(store, 0, 4, harness.EXIT_PEER, "stopped", wait=True, grace_s=0)
    assert (code, line) == (4, f"stopped. The first failure: rank 1 ({HOST}): training data ran out"), line
    assert when == json.loads(store.get("report/1"))["time"]
    report = json.loads(store.get("report/1"))
    assert (report["rank"], report["host"], report["pid"], report["code"], report["kind"]) == (
        1, HOST, os.getpid(), 1, "own")


def test_a_rank_that_left_no_report_is_named_with_its_host():
    store = dist.HashStore()
    started(store, 4)
    store.set("started/3", json.dumps({"host": "node-b", "pid": 77}))
    harness.share_failure(store, 2, 4, harness.EXIT_PEER, "stopped")
    dead = {1001}                                                      # rank 1's pid (this host) has ended
    code, line, _ = harness.share_failure(store, 0, 4, harness.EXIT_PEER, "stopped", wait=True, grace_s=0,
                                          ended=lambda pid: pid in dead)
    assert code == 4 and line == f"stopped. The first failure: rank 1 ({HOST}, pid 1001) {harness.SILENT}", line
    dead.clear()                                    # rank 1 alive here, rank 3 on another host: both may hang
    line = harness.share_failure(store, 0, 4, harness.EXIT_PEER, "stopped", wait=True, grace_s=0,
                                 ended=lambda pid: pid in dead)[1]
    assert line == (f"stopped. No rank reported a failure of its own; rank 3 (node-b, pid 77) sent no report: "
                    f"{harness.SILENT}, or hangs; rank 1 ({HOST}, pid 1001) is alive but sent no report: it hangs, "
                    "or has not noticed yet"), line


class StoreThatGoes:
    """A store whose host goes away after `calls` of its operations (its agent ended with its node's ranks)."""

    def __init__(self, store, calls):
        self.store, self.calls = store, calls

    def __getattr__(self, name):
        def call(*args):
            self.calls -= 1
            if self.calls < 0:
                raise dist.DistNetworkError("Connection reset by peer")
            return getattr(self.store, name)(*args)
        return call


def test_a_store_that_goes_while_a_rank_waits_still_names_the_rank_it_saw_die():
    store = dist.HashStore()
    started(store, 3)
    harness.share_failure(store, 1, 3, harness.EXIT_PEER, "stopped")                 # rank 1 reports; rank 2 dies
    # this rank's report (set_timeout, set, add), three started/ reads (check, get), then the wait: one count, the
    # reports (check, get), the first failure (check) -- then the store is gone, long before the grace ends
    going = StoreThatGoes(store, 3 + 6 + 1 + 2 * 2 + 1 + 1 + 1)
    code, line, _ = harness.share_failure(going, 0, 3, harness.EXIT_PEER, "stopped", wait=True, grace_s=600,
                                          ended=lambda pid: pid == 1002)
    assert code == 4 and line.startswith(f"stopped. The first failure: rank 2 ({HOST}, pid 1002) {harness.SILENT}. "
                                         "The run's store at MASTER_ADDR:MASTER_PORT="), line
    assert going.calls < 0                                                           # the store did go mid-wait

def test_a_signal_every_rank_got_is_the_users_but_one_after_a_silent_death_is_exit_4():
    store = dist.HashStore()
    started(store, 4)
    harness.share_failure(store, 1, 4, 130, "stopped by SIGINT")
    harness.share_failure(store, 2, 4, 130, "stopped by SIGINT")
    # rank 3, alive, has not taken the signal yet (a compile): the user's signal still
    assert harness.share_failure(store, 0, 4, 130, "stopped by SIGINT", wait=True, grace_s=0,
                                 ended=lambda pid: False)[:2] == (130, "stopped by SIGINT")
    store = dist.HashStore()                        # torchrun's SIGTERM after rank 1 was killed
    started(store, 3)
    harness.share_failure(store, 2, 3, harness.EXIT_PEER, "stopped")
    code, line, _ = harness.share_failure(store, 0, 3, 143, "stopped by SIGTERM", wait=True, grace_s=0,
                                          ended=lambda pid: pid == 1001)
    assert code == 4 and line.startswith(f"stopped by SIGTERM. The first failure: rank 1 ({HOST}, pid 1001)"), line
    store = dist.HashStore()                        # a Ctrl-C on rank 0's node only, before the timed loop
    started(store, 2)
    harness.share_failure(store, 0, 2, 130, "stopped by SIGINT", wait=True, grace_s=0)
    code, line, _ = harness.share_failure(store, 1, 2, harness.EXIT_PEER, "stopped", wait=True, grace_s=0)
    assert (code, line) == (4, f"stopped. The first to stop: rank 0 ({HOST}): stopped by SIGINT"), line


class GoneStore:
    """A store whose node went down: every call fails as TCPStore's do."""

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed. Did the remote "
                                        "server shutdown or crash?")
        return fail


def test_a_store_that_cannot_be_reached_is_named(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    code, line, _ = harness.share_failure(GoneStore(), 1, 2, harness.EXIT_PEER, "stopped", wait=True, grace_s=0)
    assert code == 4 and line.startswith("stopped. The run's store at MASTER_ADDR:MASTER_PORT=10.0.0.1:29500 cannot "
                                         "be reached (DistNetworkError: Failed to recv"), line
    # a rank's own failure is its line, store or not
    assert harness.share_failure(GoneStore(), 1, 2, harness.EXIT_DATA, "bad shard")[:2] == (1, "bad shard")


# ---- torchrun's error file ------------------------------------------------------------------------------------------

def test_the_error_file_is_read_by_torchrun_and_its_root_cause_is_the_rank_our_line_names(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    now = int(time.time())
    own, peer = tmp_path / "own.json", tmp_path / "peer.json"
    harness.write_error_file(str(own), "error: rank 1: training data ran out", now)
    harness.write_error_file(str(peer), "error: rank 0: stopped. The first failure: rank 1 ...", now + 1)
    assert not list(tmp_path.glob("*.tmp*"))                                   # written whole, then renamed
    failure = ProcessFailure(local_rank=1, pid=11, exitcode=1, error_file=str(own))
    assert failure.timestamp == now and failure.message["message"] == "error: rank 1: training data ran out"
    failures = {0: ProcessFailure(0, 10, 4, str(peer)), 1: failure}
    assert ChildFailedError("train_gpt.py", failures).get_first_failure()[0] == 1
    assert "traceback : error: rank 1: training data ran out" in str(ChildFailedError("train_gpt.py", failures))
    # a rank killed by a signal has no file: torchrun stamps it when it sees it, before the survivor's time
    killed = ProcessFailure(local_rank=1, pid=11, exitcode=-9, error_file=str(tmp_path / "none.json"))
    harness.write_error_file(str(peer), "error: rank 0: stopped", killed.timestamp + 1)
    failures = {0: ProcessFailure(0, 10, 4, str(peer)), 1: killed}
    assert ChildFailedError("train_gpt.py", failures).get_first_failure()[0] == 1
    harness.write_error_file("", "nothing", now)                              # torchrun's "no file": nothing


# ---- processes: a gloo peer that stops, processes killed mid-run -----------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(rank, world_size, port):
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                **CPU_MALLOC_ENV)


# Both ranks join the group with the long --pg_timeout_s and enter "the timed loop" (Run.shorten_timeout); rank 1 then
# stops taking part (it sleeps, alive), and rank 0's next collective fails after --loop_timeout_s, not 600 s.
STOPPED_PEER = f"""
import sys, time
sys.path.insert(0, {str(ROOT)!r})
import torch, torch.distributed as dist, harness
opts = harness.RunOptions(device="cpu", pg_timeout_s=600, loop_timeout_s=1)
with harness.command_line([]) as outcome:
    rank, world_size, _, device = harness.setup_distributed(opts)
    dist.all_reduce(torch.ones(1))
    run = harness.Run(opts, rank, world_size, device, "t", harness.RunLogger(None), outcome.stops, 0.0, None)
    run.shorten_timeout()
    if rank == 1:
        time.sleep(3600)
    dist.all_reduce(torch.ones(1))
sys.exit(outcome.code)
"""


# The same start, but rank 1's pause is a state save (Run.long_timeout): longer than --loop_timeout_s, and both ranks go
# on, since a save waits for every rank under --pg_timeout_s.
SLOW_SAVE = STOPPED_PEER.replace("loop_timeout_s=1", "loop_timeout_s=5").replace(
    "    if rank == 1:\n        time.sleep(3600)\n",
    "    with run.long_timeout():\n        if rank == 1:\n            time.sleep(12)\n")


@pytest.mark.timeout(HANG_GUARD_S)
def test_the_loop_timeout_ends_a_collective_with_a_stopped_peer_named(tmp_path):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", STOPPED_PEER], cwd=tmp_path, env=worker_env(r, 2, port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        _, err = procs[0].communicate(timeout=120)          # a hang guard: with --pg_timeout_s it would wait 600 s
    finally:
        for p in procs:
            p.kill()
            p.wait()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert procs[0].returncode == harness.EXIT_PEER and len(errors) == 1, err
    assert "Timed out waiting" in errors[0], errors
    assert f"rank 1 ({HOST}, pid {procs[1].pid}) is alive but sent no report: it hangs" in errors[0], errors


# Four ranks in the timed loop's collectives; rank 2 SIGKILLs itself mid-loop. Ranks 1 and 3 meet it in the ring,
# rank 0 only through them: every survivor must still end on its own (not after --loop_timeout_s), naming rank 2.
DEAD_PEER = STOPPED_PEER.replace("loop_timeout_s=1", "loop_timeout_s=600").replace(
    "    if rank == 1:\n        time.sleep(3600)\n    dist.all_reduce(torch.ones(1))\n",
    "    for i in range(1000):\n        dist.all_reduce(torch.ones(4096))\n"
    "        if i == 20 and rank == 2:\n"
    "            import os, signal\n            os.kill(os.getpid(), signal.SIGKILL)\n")


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_dead_peer_at_4_processes_ends_every_survivor_with_it_named(tmp_path):
    assert "SIGKILL" in DEAD_PEER
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", DEAD_PEER], cwd=tmp_path, env=worker_env(r, 4, port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(4)]
    try:
        errs = [p.communicate(timeout=180)[1] for p in procs]   # a hang guard: far below --loop_timeout_s=600
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[2].returncode == -signal.SIGKILL
    for rank in (0, 1, 3):
        errors = [line for line in errs[rank].splitlines() if line.startswith("error:")]
        assert procs[rank].returncode == harness.EXIT_PEER and len(errors) == 1, errs[rank][-2000:]
        assert errors[0].startswith(f"error: rank {rank}: another rank failed"), errors
        assert errors[0].endswith(f"The first failure: rank 2 ({HOST}, pid {procs[2].pid}) {harness.SILENT}"), errors


NARROW = ["--preset=tiny", "--model_dim=64", "--head_dim=16", "--mlp_hidden=256", "--val_loss_every=0", "--seed=0",
          "--num_scheduled_iterations=12", "--num_extension_iterations=0"]


@pytest.fixture(scope="module")
def narrow_args(tmp_path_factory):
    train, val = make_dataset(tmp_path_factory.mktemp("data"), train_tokens=300_000, val_tokens=20_000)
    return [*NARROW, f"--train_files={train}", f"--val_files={val}"]


def children(parent):
    """{RANK: pid} of the processes `parent` started (torchrun's workers)."""
    found = {}
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                if int(open(f"/proc/{stat}/stat").read().rsplit(")", 1)[1].split()[1]) != parent:
                    continue
                env = dict(v.split("=", 1) for v in open(f"/proc/{stat}/environ").read().split("\0") if "=" in v)
            except (OSError, IndexError, ValueError):
                continue
            if "RANK" in env:
                found[int(env["RANK"])] = int(stat)
    return found


def wait_for_line(stream, prefix, seen):
    for line in stream:
        seen.append(line)
        if line.startswith(prefix):
            return True
    return False


@pytest.mark.slow
@pytest.mark.timeout(HANG_GUARD_S)
def test_a_rank_killed_mid_run_is_named_by_the_survivor_and_by_torchruns_root_cause(tmp_path, narrow_args):
    """A bare torchrun, 2 gloo processes: rank 1 is SIGKILLed (as the OOM killer does) after a step. Rank 0 names it
    in its line and exits 4; torchrun's report lists both exit codes and its Root Cause is rank 1."""
    env = dict(worker_env(0, 1, 0), PYTHONUNBUFFERED="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(ROOT / "train_gpt.py"), *narrow_args, f"--log_dir={tmp_path}/logs", "--run_id=kill"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        assert wait_for_line(proc.stdout, "step:1/", seen), "".join(seen) + proc.stderr.read()
        victim = children(proc.pid)[1]
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=HANG_GUARD_S - 60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(seen) + out + err
    assert proc.returncode == 1, out[-3000:]                                 # torchrun's own code
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 0: another rank failed"), out[-3000:]
    assert errors[0].endswith(f"The first failure: rank 1 ({HOST}, pid {victim}) {harness.SILENT}"), errors
    codes = dict(re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\n\s+exitcode\s+: (-?\d+)", out))
    assert codes == {"0": "4", "1": "-9"}, out[-3000:]
    root = out.split("Root Cause (first observed failure):", 1)[1]
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)", root) and "SIGKILL" in root, root
    assert "traceback : " + errors[0] in out                                # rank 0's error file: our line
    log = (tmp_path / "logs" / "kill.txt").read_text()
    assert "the timed loop's collectives time out after --loop_timeout_s=120" in log
    assert log.splitlines()[-1] == errors[0].replace("rank 0: ", "")


@pytest.mark.slow
@pytest.mark.timeout(HANG_GUARD_S)
def test_a_killed_rank_0_leaves_the_store_unreachable_and_the_survivor_says_where(tmp_path, narrow_args):
    """Without torchrun rank 0 holds the store (as MASTER_ADDR's node does for torchrun): killed, the other rank
    cannot read a report and names MASTER_ADDR:MASTER_PORT instead of saying nothing."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "train_gpt.py"), *narrow_args, f"--log_dir={tmp_path}/logs",
                               "--run_id=store"], cwd=tmp_path, env=worker_env(r, 2, port), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    seen = []
    try:
        assert wait_for_line(procs[0].stdout, "step:1/", seen), "".join(seen) + procs[0].stderr.read()
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        _, err = procs[1].communicate(timeout=HANG_GUARD_S - 60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode == -signal.SIGKILL
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert procs[1].returncode == harness.EXIT_PEER and len(errors) == 1, err[-3000:]
    assert f"The run's store at MASTER_ADDR:MASTER_PORT=127.0.0.1:{port} cannot be reached" in errors[0], errors
    assert "Exception raised from" not in err and "Traceback" not in err, err[-3000:]   # TCPStore's C++ dump is kept off


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_slow_state_save_in_the_loop_waits_under_the_long_timeout(tmp_path):
    assert "time.sleep(12)" in SLOW_SAVE
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", SLOW_SAVE], cwd=tmp_path, env=worker_env(r, 2, port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]      # a hang guard
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0, 0], errs
