"""bench/profile_step.py: the bucket arithmetic on a small hand-made trace (the format torch.profiler exports)."""
import json
import sys

from _shards import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import profile_step  # noqa: E402


def kernel(name, ts, dur, corr, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": stream,
            "args": {"correlation": corr}}


def launch(ts, corr, tid=1, driver=False):
    """cudaLaunchKernel, or cuLaunchKernel (the driver call Triton's launcher makes)."""
    return {"ph": "X", "cat": "cuda_driver" if driver else "cuda_runtime", "name": "cuLaunchKernel" if driver else
            "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": tid, "args": {"correlation": corr}}


def test_buckets_overlap_and_idle(tmp_path):
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "nanogpt::fp8_head", "ts": 0, "dur": 10, "tid": 1},
        launch(1, 1, driver=True), kernel("triton_poi_fused_clamp_div_0", 100, 50, 1),    # fp8 quantiser
        launch(2, 2), kernel("sm90_xmma_gemm_e4m3_f32", 150, 200, 2),                       # FP8 head matmul
        launch(20, 3), kernel("flash_fwd_kernel", 350, 100, 3),                             # attention
        launch(21, 4), kernel("_relu2_linear_kernel", 450, 50, 4),                          # mlp
        launch(22, 5), kernel("_ce_fwd_kernel", 500, 30, 5),                                # ce
        launch(23, 6), kernel("triton_red_fused_rms_norm_1", 530, 20, 6),                  # inductor
        launch(24, 10), kernel("_qk_rotary_fwd_kernel", 550, 40, 10),                       # qk
        {"ph": "X", "cat": "user_annotation", "name": "optimizer_step", "ts": 30, "dur": 20, "tid": 1},
        launch(31, 7, driver=True), kernel("_sym_aat_kernel", 600, 100, 7),                 # optimizer compute
        launch(32, 8), kernel("ncclDevKernel_ReduceScatter", 650, 150, 8, stream=9),        # 50 hidden, 100 exposed
        launch(60, 9), kernel("Memset (Device)", 800, 10, 9),                               # other (after the step)
    ]
    path = tmp_path / "run_rank0_steps10-10_trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    r = profile_step.analyse(str(path))
    want = dict(fp8_quant=0.05, matmul=0.2, attention=0.1, mlp=0.05, ce=0.03, qk=0.04, inductor=0.02,
                opt_compute=0.1, other=0.01, opt_comm=0.1, idle=0.01, step=0.71)
    # ms; comm exposed 700..800, idle 590..600
    assert {k: round(r[k], 9) for k in want} == want and r["steps"] == 1


def test_run_and_profile_returns_only_its_own_traces(tmp_path, monkeypatch):
    """A second --run into the same folder must not pick up the first run's traces."""
    (tmp_path / "older_rank0_steps16-17_trace.json").write_text("{}")
    seen = {}

    def fake_run(cmd, cwd):
        seen["cmd"] = cmd
        run_id = next(a.split("=", 1)[1] for a in cmd if a.startswith("--run_id="))
        for r in ("16-17", "36-37"):
            (tmp_path / f"{run_id}_rank0_steps{r}_trace.json").write_text("{}")
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr("subprocess.run", fake_run)
    traces = profile_step.run_and_profile(str(tmp_path), 60, ["--seed=0"])
    assert len(traces) == 2 and not any("older" in t for t in traces)
    assert sum(a.startswith("--run_id=") for a in seen["cmd"]) == 1 and "--seed=0" in seen["cmd"]
    traces = profile_step.run_and_profile(str(tmp_path), 60, ["--run_id=mine"])
    assert [t.rsplit("/", 1)[1] for t in traces] == ["mine_rank0_steps16-17_trace.json",
                                                     "mine_rank0_steps36-37_trace.json"]


def test_owners_names_the_innermost_enclosing_ops(tmp_path):
    """Each matching kernel or copy is traced to the CPU ops around its launch, on the launching thread only."""
    def op(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "optimizer_step", "ts": 0, "dur": 1000, "tid": 5},  # one step
        op("AccumulateGrad", 0, 100), op("aten::add_", 10, 20), launch(15, 1),
        kernel("vectorized_elementwise_kernel<CUDAFunctor_add>", 200, 30, 1),
        op("aten::copy_", 50, 20), launch(55, 2),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 300, "dur": 8, "tid": 7,
         "args": {"correlation": 2}},
        op("elsewhere", 0, 1000, tid=2),                                  # another thread: never an owner
        launch(60, 3), kernel("triton_poi_fused_add_0", 400, 5, 3),      # does not match
        launch(500, 4), kernel("vectorized_elementwise_kernel<CUDAFunctor_add>", 600, 10, 4),  # launched by no op
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    rows = profile_step.owners(str(path), "Memcpy|CUDAFunctor_add")
    assert [(round(ms, 6), n, chain) for ms, n, _, chain in rows] == [
        (0.03, 1, "AccumulateGrad > aten::add_"), (0.01, 1, "(no CPU op)"), (0.008, 1, "AccumulateGrad > aten::copy_")]


def test_idle_gaps_are_the_stretches_no_kernel_covers(tmp_path):
    """Overlapping kernels (two streams) leave no gap; the longest gaps come first, named by their neighbours."""
    events = [
        launch(0, 1), kernel("a", 100, 50, 1),
        launch(1, 2), kernel("b", 120, 80, 2, stream=8),                 # overlaps a: busy until 200
        {"ph": "X", "cat": "cpu_op", "name": "aten::item", "ts": 2, "dur": 300, "tid": 1}, launch(250, 3),
        kernel("c", 230, 10, 3),                                          # 30 us after b
        launch(260, 4), kernel("d", 300, 5, 4),                           # 60 us after c
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert profile_step.idle_gaps(str(path)) == [(0.06, "c", "d", "aten::item"), (0.03, "b", "c", "aten::item")]


def test_a_bad_owners_pattern_is_one_error_line(capsys):
    assert profile_step.main(["--owners=(", "unused_trace.json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --owners='(' is not a regular expression") and err.count("\n") == 1


def rank_trace(path, arrivals, kernel_us, hosts=(0, 0)):
    """A trace of two steps: step i's optimizer_step (CPU) launches, hosts[i] us after its start, the reduce-scatter
    that starts at arrivals[i] and runs kernel_us[i]; a later all-gather of the same step and the loss's all-reduce
    before it must not count."""
    events = []
    for i, (start, dur, host) in enumerate(zip(arrivals, kernel_us, hosts)):
        t = 10_000 * i
        corr = 10 * i
        events += [
            launch(t + 5, corr + 1), kernel("ncclDevKernel_AllReduce_Sum_f32", t + 100, 5, corr + 1, stream=9),
            {"ph": "X", "cat": "user_annotation", "name": "optimizer_step", "ts": t + 50, "dur": 2000, "tid": 1},
            launch(t + 60 + host, corr + 2),
            kernel("ncclDevKernel_ReduceScatter_Sum_bf16", start, dur, corr + 2, stream=9),
            launch(t + 70 + host, corr + 3),
            kernel("ncclDevKernel_AllGather", start + dur + 500, 40, corr + 3, stream=9),
        ]
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def test_rank_arrivals_are_the_spread_at_each_steps_first_reduction(tmp_path):
    """Rank 1 reaches the first reduce-scatter 3 ms after rank 0 in step 1 and rank 0 is 0.5 ms late in step 2;
    the one that came last reports its own kernel time (the transfer, no waiting). Rank 1's host launched it 1.5 ms
    after rank 0's in step 1, rank 0's 0.2 ms after rank 1's in step 2."""
    r0 = rank_trace(tmp_path / "run_rank0_steps16-17_trace.json", [1000, 11_500], [3300, 400], hosts=(0, 1200))
    r1 = rank_trace(tmp_path / "run_rank1_steps16-17_trace.json", [4000, 11_000], [300, 900], hosts=(1500, 1000))
    rows = profile_step.rank_arrivals([r0, r1])
    assert [([round(t, 6) for t in late], last, round(ms, 6), [round(t, 6) for t in hosts])
            for late, last, ms, hosts in rows] == [([0.0, 3.0], 1, 0.3, [0.0, 1.5]), ([0.5, 0.0], 0, 0.4, [0.2, 0.0])]


def test_sibling_traces_are_the_same_steps_of_every_rank(tmp_path):
    for name in ("run_rank0_steps16-17", "run_rank1_steps16-17", "run_rank10_steps16-17", "run_rank2_steps16-17",
                 "run_rank2_steps36-37",
                 "other_rank1_steps16-17"):
        (tmp_path / f"{name}_trace.json").write_text("{}")
    found = profile_step.sibling_traces(str(tmp_path / "run_rank0_steps16-17_trace.json"))
    assert [(r, p.rsplit("/", 1)[1]) for r, p in found] == [
        (0, "run_rank0_steps16-17_trace.json"), (1, "run_rank1_steps16-17_trace.json"),
        (2, "run_rank2_steps16-17_trace.json"), (10, "run_rank10_steps16-17_trace.json")]   # by number, not name
    assert profile_step.sibling_traces(str(tmp_path / "t.json")) == []


def test_main_prints_the_ranks_and_names_a_step_mismatch(tmp_path, capsys):
    r0 = rank_trace(tmp_path / "run_rank0_steps16-17_trace.json", [1000, 11_500], [3300, 400])
    rank_trace(tmp_path / "run_rank1_steps16-17_trace.json", [4000, 11_000], [300, 900], hosts=(1500, 0))
    assert profile_step.main([r0]) == 0
    out = capsys.readouterr().out
    assert "    step 1: rank0 +0.00  rank1 +3.00  | rank1 last, its kernel 0.30 ms  | hosts +0.00  +1.50\n" in out
    assert "    step 2: rank0 +0.50  rank1 +0.00  | rank0 last, its kernel 0.40 ms  | hosts +0.00  +0.00\n" in out
    (tmp_path / "run_rank1_steps16-17_trace.json").rename(tmp_path / "run_rank2_steps16-17_trace.json")
    assert profile_step.main([r0]) == 0                                          # rank 1's trace missing: named
    assert "    step 1: rank0 +0.00  rank2 +3.00  | rank2 last" in capsys.readouterr().out   # by their ranks
    rank_trace(tmp_path / "run_rank1_steps16-17_trace.json", [4000], [300])     # one step only
    assert profile_step.main([r0]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot compare the ranks' traces") and "[2, 1, 2]" in err and err.count("\n") == 1
