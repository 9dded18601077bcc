"""Compiling with several GPUs: each rank first compiles its share of the schedule's variants alone
(Trainer.compile_alone), then the warmup loads the rest from torch's on-disk caches. That works
only if compile_alone calls the model exactly as the warmup's own steps do (same shapes, Python
arguments, mode and rotary state: what torch.compile guards on and keys its caches by), and if
every rank names its GPU cuda:0 (isolate_gpu). Both are checked here on a CPU, where the model runs
uncompiled and a recorder stands in for the compiled callable."""
import dataclasses
import os
import re

import pytest
import torch

import compile_split
import harness  # noqa: E402
import train_gpt as tg
from _shards import make_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_variant_starts_and_warmup_steps_of_the_record_schedule():
    hp = tg.Hyperparameters()
    # three stages, then the extension's longer window
    assert tg.variant_starts(hp) == [0, 423, 847, 1270]
    assert tg.warmup_steps(hp) == [0, 1, 2, 422, 423, 424, 846, 847, 848, 1269, 1270, 1271]
    shapes = {s: (sc.ws_short, sc.ws_long, sc.global_batch, sc.max_doc_len, len(sc.mtp_weights))
              for s, sc in ((s, tg.schedule_at(s, hp)) for s in range(hp.num_iterations))}
    starts = tg.variant_starts(hp)
    assert len({shapes[s] for s in starts}) == len(starts)           # each start is a new variant
    assert {shapes[s] for s in starts} == set(shapes.values())       # and every step has one


@pytest.mark.parametrize("ranks, helpers, per_gpu", [(1, -1, 4), (2, -1, 2), (4, -1, 1), (8, -1, 1),
                                                      (1, 0, 1), (4, 0, 1), (1, 7, 8), (8, 1, 2)])
def test_processes_per_gpu(ranks, helpers, per_gpu):
    hp = tg.Hyperparameters(compile_helpers=helpers)
    assert compile_split.split_processes_per_gpu(hp.compile_helpers, len(tg.variant_starts(hp)), ranks,
                                           cache_loaded=False) == per_gpu
    # a loaded compile cache file: the auto count has no helpers, an explicit one stands
    assert compile_split.split_processes_per_gpu(hp.compile_helpers, len(tg.variant_starts(hp)), ranks,
                                           cache_loaded=True) == (1 if helpers == -1 else per_gpu)


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_the_ranks_take_the_training_graphs(ranks):
    hp = tg.Hyperparameters()
    per_gpu = compile_split.split_processes_per_gpu(hp.compile_helpers, len(tg.variant_starts(hp)), ranks, cache_loaded=False)
    shares = compile_split.split_compile_tasks(tg.variant_starts(hp), ranks * per_gpu)
    def trains(share):
        return sum(ph == "train" for _, ph in share)
    for rank in range(ranks):
        for helper in shares[rank + ranks::ranks]:   # the helpers of the rank's GPU
            assert trains(helper) <= trains(shares[rank]) and len(helper) <= len(shares[rank])
    assert all(trains(shares[r]) for r in range(min(ranks, len(tg.variant_starts(hp)))))


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 8])
def test_split_compile_tasks_deal_every_graph_once(workers):
    hp = tg.Hyperparameters()
    shares = compile_split.split_compile_tasks(tg.variant_starts(hp), workers)
    assert len(shares) == workers
    dealt = [task for share in shares for task in share]
    assert sorted(dealt) == sorted((s, ph) for s in tg.variant_starts(hp) for ph in ("train", "val"))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    # the longer training graphs are spread first: no worker holds two while another holds none
    trains = [sum(ph == "train" for _, ph in share) for share in shares]
    assert max(trains) - min(trains) <= 1


def _machine(gpus, cuda_started=False):
    """A stand-in for torch.cuda.device_count on a machine with `gpus` GPUs: like NVML it honours
    CUDA_VISIBLE_DEVICES, unless CUDA had already started (then the count it started with)."""
    def count(env):
        visible = env.get("CUDA_VISIBLE_DEVICES")
        if cuda_started or visible is None:
            return gpus
        return len([e for e in visible.split(",") if e.strip()])
    return count


def test_isolate_gpu_picks_the_local_ranks_entry(monkeypatch):
    def isolate(rank, env, **machine):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: _machine(**machine)(env))
        return harness.isolate_gpu(rank, env)

    env = {}
    assert isolate(2, env, gpus=4) == "2" and env["CUDA_VISIBLE_DEVICES"] == "2"
    env = {"CUDA_VISIBLE_DEVICES": "4, 5,6,7"}
    assert isolate(1, env, gpus=8) == "5" and env["CUDA_VISIBLE_DEVICES"] == "5"
    env = {"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}
    assert isolate(1, env, gpus=8) == "GPU-bb"
    env = {"CUDA_VISIBLE_DEVICES": ""}                               # no GPU: nothing to choose
    assert isolate(1, env, gpus=8) is None and env["CUDA_VISIBLE_DEVICES"] == ""
    env = {}
    assert isolate(1, env, gpus=0) is None and env == {}             # a machine without GPUs
    env = {}                                                         # too late: left as it was
    assert isolate(1, env, gpus=4, cuda_started=True) is None and env == {}
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert isolate(1, env, gpus=4, cuda_started=True) is None and env["CUDA_VISIBLE_DEVICES"] == "2,3"
    with pytest.raises(tg.ConfigError, match="LOCAL_RANK=2 but 2 GPU"):   # more processes than GPUs
        isolate(2, {"CUDA_VISIBLE_DEVICES": "0,1"}, gpus=8)
    with pytest.raises(tg.ConfigError, match="LOCAL_RANK=4 but 4 GPU"):
        isolate(4, {}, gpus=4)


def _meta(t):
    return (tuple(t.shape), t.dtype, t.stride(), t.device.type)


class Recorder:
    """The compiled model's stand-in: records what torch.compile would guard on, then runs the
    model."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, inputs, targets, cu_seqlens, ws_short, ws_long, mtp, max_seqlen, *train_args):
        m = self.model
        self.calls.append((_meta(inputs), _meta(targets), _meta(cu_seqlens), ws_short, ws_long,
                           _meta(mtp), tuple(mtp.tolist()), max_seqlen,
                           tuple((_meta(a), tuple(a.tolist())) if isinstance(a, torch.Tensor) else a
                                 for a in train_args), m.training,
                           torch.is_grad_enabled(), m.attn_scale, tuple(m.rotary_omega.tolist()),
                           m.rotary_cos.double().sum().item()))
        return m(inputs, targets, cu_seqlens, ws_short, ws_long, mtp, max_seqlen, *train_args)


@pytest.fixture(scope="module")
def tiny_trainer(tmp_path_factory):
    train, val = make_dataset(tmp_path_factory.mktemp("data"), train_tokens=60_000)
    hp = tg.parse_args(["--preset=tiny", f"--train_files={train}", f"--val_files={val}",
                        "--seed=0"])
    torch.manual_seed(0)
    model = tg.build_model(hp, torch.device("cpu"), "sdpa")
    opt = tg.build_optimizer(hp, model, 0, 1)
    trainer = tg.Trainer(hp, model, Recorder(model), opt, torch.device("cpu"), 0, 1,
                         harness.resolve_shards(hp.train_files, "train"),
                         harness.resolve_shards(hp.val_files, "val"))
    return hp, trainer


def test_compile_alone_calls_the_model_as_the_warmup_does(tiny_trainer):
    hp, trainer = tiny_trainer
    rec, model = trainer.compiled, trainer.model
    starts = tg.variant_starts(hp)
    assert len(starts) == 4
    warmup = {}
    for step in starts:     # the warmup's calls at each variant (its other steps repeat a variant)
        sched = tg.schedule_at(step, hp)
        change = trainer.advance_schedule(sched)
        rec.calls.clear()
        trainer.validate(sched.ws_short, sched.ws_long, max_batches=1)
        warmup[(step, "val")] = rec.calls[0]
        rec.calls.clear()
        trainer.train_step(sched, change)
        warmup[(step, "train")] = rec.calls[0]
    assert len({warmup[(s, "train")] for s in starts}) == len(starts)

    for p in model.parameters():
        p.grad = None
    trainer.reset_schedule_state()
    before = tg.snapshot_state(model, trainer.opt)
    for step in starts:
        for phase in ("train", "val"):
            rec.calls.clear()
            trainer.compile_alone(step, phase)
            assert rec.calls == [warmup[(step, phase)]], (step, phase)
    assert any(p.grad is not None for p in model.parameters())
    # the weights and the optimizer are untouched; the reset brings back the rotary state
    assert harness.states_equal(tg.snapshot_state(model, trainer.opt), before)
    trainer.reset_schedule_state()
    rec.calls.clear()
    trainer.validate(*dataclasses.astuple(tg.schedule_at(0, hp))[2:4], max_batches=1)
    assert rec.calls == [warmup[(0, "val")]]


def test_compile_helper_processes_report_back(tiny_trainer, tmp_path):
    """A helper is this script started again (as __main__, like the rank) with a task file: it
    builds the model and runs its share through compile_alone (uncompiled on a CPU), then reports
    its time, or its error as one line, which the rank logs; a failure is not fatal (the warmup
    compiles what is missing)."""
    hp, trainer = tiny_trainer
    lock = tmp_path / "gpu.lock"
    task = dict(script=tg.__file__, module=tg.__name__, hp=hp, device="cpu", attn_backend="sdpa", rank=0,
                world_size=1, train_files=trainer.train_files, val_files=trainer.val_files)
    ok = compile_split.CompileHelper(task, [(0, "train"), (0, "val")], tmp_path / "ok", lock, compile=False)
    missing = dict(task, train_files=[str(tmp_path / "gone.bin")])
    bad = compile_split.CompileHelper(missing, [(0, "train")], tmp_path / "bad", lock, compile=False)
    try:
        assert re.fullmatch(r"done in \d+\.\ds, peak memory reserved 0 MiB", ok.wait())
        line = bad.wait()
        assert line.startswith("failed (") and "gone.bin" in line and "\n" not in line
        assert line.endswith("the warmup compiles its graphs")
    finally:
        ok.stop()
        bad.stop()
    assert ok.process.returncode == 0 and bad.process.returncode == 1


def _gone(pid: int) -> bool:
    """The process has exited (a zombie counts: a container's init may not reap adopted children)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads process states from /proc (Linux)")
def test_a_helper_exits_when_its_rank_is_killed(tmp_path):
    """A rank killed with SIGKILL runs no cleanup; its helpers (exit_with_parent) notice that they were adopted and
    leave instead of compiling on. Here a stand-in rank starts a stand-in helper, then is killed."""
    import signal
    import subprocess
    import sys
    import time
    ready = tmp_path / "helper_ready"
    helper = (f"import sys, time; sys.path.insert(0, {ROOT!r}); import compile_split; compile_split.exit_with_parent(0.1); "
              f"open({str(ready)!r}, 'w').close(); time.sleep(120)")
    rank_code = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {helper!r}]); "
                 f"print(p.pid, flush=True); time.sleep(120)")
    rank = subprocess.Popen([sys.executable, "-c", rank_code], stdout=subprocess.PIPE, text=True)
    pid = int(rank.stdout.readline())
    try:
        deadline = time.time() + 120
        while not ready.exists() and time.time() < deadline:
            time.sleep(0.1)
        assert ready.exists(), "the stand-in helper did not start"
        time.sleep(0.5)
        assert not _gone(pid)                       # a living parent keeps it
        rank.send_signal(signal.SIGKILL)
        rank.wait()
        deadline = time.time() + 60             # the watcher polls every 0.1 s; slack for a loaded machine
        while not _gone(pid) and time.time() < deadline:
            time.sleep(0.1)
        assert _gone(pid), "the helper outlived its killed rank"
    finally:
        rank.kill()
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_gpu_turns_one_process_at_a_time(tmp_path):
    """The turn is taken when a compilation ends and held until given back; a second holder (another
    open file, as in another process) waits for it."""
    import threading
    model = torch.nn.Linear(2, 2)
    first = compile_split.GpuTurns(tmp_path / "gpu.lock", torch.device("cpu"))
    second = compile_split.GpuTurns(tmp_path / "gpu.lock", torch.device("cpu"))
    with first.taken_after_compiling():
        assert not first.held
        torch.compile(lambda x: x * 2, backend="eager")(torch.ones(3))
        assert first.held                       # the compilation's end took it
        waiter = threading.Thread(target=second.take)
        waiter.start()
        waiter.join(timeout=0.5)
        assert waiter.is_alive() and not second.held
        model(torch.ones(2)).sum().backward()
        first.give(model)
        assert not first.held and model.weight.grad is None
        waiter.join(timeout=10)
        assert second.held
        second.give(model)


def test_a_training_graph_takes_its_turn_once_compiled_with_its_backward(tmp_path, compiler_settings_restored):
    """configure_compiler compiles a backward with its forward, so the turn taken when the
    forward's compilation ends covers the whole training task: no compilation starts while a
    process holds it (which would keep the others waiting for a compile, not for the GPU)."""
    turns = compile_split.GpuTurns(tmp_path / "gpu.lock", torch.device("cpu"))
    log = harness.CompileLog(enabled=True)
    held_at_start = []
    tg.configure_compiler()
    compiled = torch.compile(lambda x: (x.cos() * 3).sum(), backend="aot_eager",
                             dynamic=False, fullgraph=True)
    handler = torch._dynamo.callback.callback_handler

    def on_start(*_):
        held_at_start.append(turns.held)
    with log.recording(), turns.taken_after_compiling(), log.during(0, "train*"):
        handler.register_start_callback(on_start)
        try:
            compiled(torch.ones(5, requires_grad=True)).backward()
            assert turns.held
        finally:
            handler.remove_start_callback(on_start)
        turns.give(torch.nn.Linear(1, 1))
    rows = [r for r in log.rows() if r.phase == "train*"]
    assert [r.backward for r in rows] == [False]          # no lazy backward compilation
    assert held_at_start == [False]
