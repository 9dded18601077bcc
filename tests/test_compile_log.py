"""The warmup's compile table: CompileLog records each torch.compile compilation (its warmup step
and phase, its time, why it recompiled) through torch's hooks; the table and the reason picking are
pure functions. torch.compile runs here with the eager / aot_eager backends: the hooks are
dynamo's, whatever the backend, and these compile in well under a second on a CPU."""
import torch

import train_gpt as tg
import harness  # noqa: E402


def row(i, graph="forward", backward=False, step=0, phase="val", seconds=1.0, cache="-",
        reason="first"):
    return harness.CompiledGraph(f"0/{i}", graph, backward, step, phase, seconds, cache, reason)


def test_a_recompile_is_recorded_with_the_guard_that_failed():
    def scaled(x, n):
        return (x * n).sin().sum()

    compiled = torch.compile(scaled, backend="eager", dynamic=False, fullgraph=True)
    log = harness.CompileLog(enabled=True)
    with log.recording():
        with log.during(0, "val"):
            compiled(torch.ones(4), 3)
            compiled(torch.ones(4), 3)               # the same graph: no compile
        with log.during(1, "train"):
            compiled(torch.ones(4), 5)               # n is a constant of the graph: recompiles
    rows = [r for r in log.rows() if r.graph == "scaled"]
    assert [(r.step, r.phase, r.backward) for r in rows] == [(0, "val", False),
                                                             (1, "train", False)]
    assert rows[0].reason == "first"
    assert "n == 3" in rows[1].reason, rows[1].reason
    frames = {r.compile_id.split("/")[0] for r in rows}
    assert len(frames) == 1                                    # one function, two graphs
    assert all(0 < r.seconds < 30 for r in rows)


def test_backward_rows_and_a_shape_change_behind_a_grad_mode_change(monkeypatch):
    """Validation (no grad) between two training calls: the reason is the shape against the training
    graph, not the grad mode against the newer validation graph; a backward compiled lazily, at the
    first backward (torch's default; configure_compiler changes it), gets its own row."""
    from torch._functorch import config as functorch_config
    monkeypatch.setattr(functorch_config, "force_non_lazy_backward_lowering", False)
    def loss(x):
        return (x.sin() * 2).sum()

    compiled = torch.compile(loss, backend="aot_eager", dynamic=False, fullgraph=True)
    log = harness.CompileLog(enabled=True)
    with log.recording():
        with log.during(0, "train"):
            compiled(torch.ones(4, requires_grad=True)).backward()
        with log.during(0, "val"), torch.no_grad():
            compiled(torch.ones(4))
        with log.during(2, "train"):
            compiled(torch.ones(8, requires_grad=True)).backward()
    rows = [r for r in log.rows() if r.graph == "loss"]
    assert [(r.step, r.phase, r.backward) for r in rows] == [
        (0, "train", False), (0, "train", True), (0, "val", False), (2, "train", False),
        (2, "train", True)]
    assert [r.reason for r in rows[:2]] == ["first", "backward"]
    assert "grad_mode" in rows[2].reason, rows[2].reason
    assert "size mismatch" in rows[3].reason, rows[3]
    assert rows[3].reason.startswith(rows[0].compile_id + ":")      # against the training graph
    assert rows[4].compile_id == rows[3].compile_id


def test_the_hooks_are_removed_and_nothing_is_recorded_after():
    handler = torch._dynamo.callback.callback_handler
    before = (list(handler.start_callbacks), list(handler.end_callbacks))
    log = harness.CompileLog(enabled=True)
    with log.recording():
        assert len(handler.start_callbacks) == len(before[0]) + 1
    assert (handler.start_callbacks, handler.end_callbacks) == before
    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
    assert log.rows() == []


def test_off_when_not_compiling():
    handler = torch._dynamo.callback.callback_handler
    n = len(handler.start_callbacks)
    log = harness.CompileLog(enabled=False)
    with log.recording():
        assert len(handler.start_callbacks) == n
        torch.compile(lambda x: x * 2, backend="eager")(torch.ones(3))
    assert log.report(12.0) == []


def test_a_torch_without_a_hook_gets_one_line_and_compiles_as_usual(monkeypatch):
    monkeypatch.delattr(torch._dynamo.utils, "guard_failures")
    log = harness.CompileLog(enabled=True)
    with log.recording():
        with log.during(0, "val"):
            out = torch.compile(lambda x: x - 1, backend="eager")(torch.ones(3))
    assert torch.equal(out, torch.zeros(3))
    lines = log.report(12.0)
    assert len(lines) == 1 and lines[0].startswith("compile table: not available with torch")
    assert "guard_failures" in lines[0]


def test_eager_autotuner_tunings_are_counted():
    class FakeAutotuner:                   # triton's Autotuner gains a .cache key per tuning
        cache = {("M", 768): "config"}

    tuner = FakeAutotuner()
    log = harness.CompileLog(enabled=True, autotuners=[tuner])
    with log.recording():
        tuner.cache = {**tuner.cache, ("M", 1536): "c", ("M", 3072): "c"}
    assert log.autotune[2] == 2
    assert log.report(1.0)[-1].endswith("2 eager tunings")


def test_recompile_reason_prefers_a_graph_of_the_same_grad_mode():
    assert harness.recompile_reason([]) == "first"
    failures = ["0/3: GLOBAL_STATE changed: grad_mode ",
                "0/2: ws_long == 3            # return self.compiled(...)  # train_gpt.py:1133\n"
                "User stack trace:\n  File ...",
                "0/1: GLOBAL_STATE changed: grad_mode "]
    assert harness.recompile_reason(failures) == "0/2: ws_long == 3"
    only_mode = "0/0: GLOBAL_STATE changed: grad_mode"
    assert harness.recompile_reason([only_mode + " "]) == only_mode


def test_cache_state():
    states = [harness.cache_state(h, m) for h, m in [(0, 0), (2, 0), (0, 1), (1, 1)]]
    assert states == ["-", "hit", "miss", "mixed"]


def test_table_rows_and_summary():
    size = "0/1: tensor 'inputs' size mismatch at index 0. expected 65536, actual 131072 "
    rows = [row(0, seconds=41.24, cache="miss"),
            row(1, phase="train", seconds=52.0, cache="miss",
                reason="0/0: GLOBAL_STATE changed: grad_mode"),
            row(1, backward=True, phase="train", seconds=30.5, cache="hit", reason="backward"),
            row(2, graph="_quantize_act_with_a_long_name", step=12, phase="train*", seconds=0.44,
                reason=size * 3)]
    lines = harness.compile_table(rows)
    assert lines == [
        "  # id     graph                step phase     sec cache reason",
        "  1 0/0    forward                 0 val      41.2 miss  first",
        "  2 0/1    forward                 0 train    52.0 miss  "
        "0/0: GLOBAL_STATE changed: grad_mode",
        "  3 0/1    forward (bw)            0 train    30.5 hit   backward",
        "  4 0/2    _quantize_act_wit...   12 train*    0.4 -     " + size + "0/1: tenso...",
    ]
    assert len(lines[4]) == len(lines[1]) - len("first") + 90
    assert harness.compile_summary(rows, 200.0, 7, 3.25, 4) == (
        "compile: 4 graphs (3 forward, 1 backward) took 124.2s of the warmup's 200.0s; 1 were "
        "cache hits (30.5s); Triton autotuning: 7 kernels in compiled graphs (3.2s), 4 eager "
        "tunings")
