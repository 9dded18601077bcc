"""The portable compile cache: its key, and a missing, stale, damaged or foreign file reported in one line
and ignored, never fatal. torch's own save/load of compiled artifacts is replaced by a recorder here (a CPU
compiles nothing worth caching); the GPU side is measured by bench runs."""
import dataclasses
import logging
import types
from pathlib import Path

import pytest
import torch

import train_gpt as tg
import harness  # noqa: E402
import triton_kernels as tk

VERSIONS = "torch 2.13.0, triton 3.9.0, CUDA 12.8, NVIDIA H200"


@pytest.fixture
def artifacts(monkeypatch):
    """save_cache_artifacts returns these bytes; load_cache_artifacts records what it was given."""
    loaded = []
    payload = bytes(range(256)) * 40 + b"\n\x00tail"          # newlines and zeros inside, like real data
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (payload, None))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts",
                        lambda data: loaded.append(data) or ACCEPTED)
    return payload, loaded


ACCEPTED = torch.compiler._cache.CacheInfo({"inductor": ["a key"]})    # what torch returns for what it took


def test_key_depends_on_each_source_and_the_versions():
    key = harness.compile_cache_key(["a = 1\n", "b = 2\n"], VERSIONS)
    assert key == harness.compile_cache_key(["a = 1\n", "b = 2\n"], VERSIONS)
    assert key != harness.compile_cache_key(["a = 1 \n", "b = 2\n"], VERSIONS)     # one character of code
    assert key != harness.compile_cache_key(["a = 1\n", "b = 3\n"], VERSIONS)      # the kernels file
    assert key != harness.compile_cache_key(["a = 1\n", "b = 2\n"], VERSIONS.replace("H200", "H100"))
    assert key != harness.compile_cache_key(["a = 1\nb = 2\n", ""], VERSIONS)      # not just the concatenation


def test_key_settings_hold_what_changes_graphs_and_not_where_logs_go():
    """A cache file made with another attention backend or model shape covers none of this run's graphs (and would
    turn the compile helpers off), so those settings are in the key; where logs and data live is not."""
    hp = tg.Hyperparameters()
    base = harness.compile_cache_settings(hp, "triton")
    assert base == harness.compile_cache_settings(dataclasses.replace(hp, run_id="other", log_dir="/tmp/x", seed=3,
                                                                 val_loss_every=7), "triton")
    assert base != harness.compile_cache_settings(hp, "varlen")
    assert base != harness.compile_cache_settings(dataclasses.replace(hp, num_layers=hp.num_layers + 1), "triton")
    assert base != harness.compile_cache_settings(dataclasses.replace(hp, num_scheduled_iterations=60), "triton")
    # every run-control option leaves the key alone
    for f in dataclasses.fields(harness.RunOptions):
        other = {bool: lambda v: not v, int: lambda v: v + 7, float: lambda v: v + 0.5,
                 str: lambda v: v + "x"}[type(getattr(hp, f.name))](getattr(hp, f.name))
        assert harness.compile_cache_settings(dataclasses.replace(hp, **{f.name: other}), "triton") == base, f.name


def test_saved_cache_loads_back_exactly(tmp_path, artifacts):
    payload, loaded = artifacts
    path = tmp_path / "cache" / "compile_cache.bin"
    note = harness.save_compile_cache(path, "k1", VERSIONS)
    assert note.startswith(f"compile cache: saved {path}")
    assert [p.name for p in path.parent.iterdir()] == ["compile_cache.bin"]   # no temporary left
    ok, note = harness.load_compile_cache(path, "k1")
    assert ok and note.startswith(f"compile cache: loaded {path}") and loaded == [payload]


def test_missing_stale_and_damaged_files_are_ignored(tmp_path, artifacts):
    payload, loaded = artifacts
    path = tmp_path / "compile_cache.bin"
    ok, note = harness.load_compile_cache(path, "k1")
    assert not ok and "no " in note and "written after the warmup" in note
    harness.save_compile_cache(path, "k1", VERSIONS)
    ok, note = harness.load_compile_cache(path, "k2")                              # other code or GPU
    assert not ok and "made by other code, with other settings or on another machine" in note and VERSIONS in note
    whole = path.read_bytes()
    cases = {"truncated": whole[:-10], "one byte flipped": whole[:-5] + b"X" + whole[-4:],
             "no header": harness.COMPILE_CACHE_MAGIC, "foreign file": b"PK\x03\x04 a zip file",
             "bad json": harness.COMPILE_CACHE_MAGIC + b"{not json\n" + payload, "empty": b""}
    for name, data in cases.items():
        path.write_bytes(data)
        ok, note = harness.load_compile_cache(path, "k1")
        assert not ok and "is unreadable" in note and "ignored" in note, (name, note)
    assert loaded == []                                                      # torch never saw any of it
    path.unlink()
    path.mkdir()                                                             # a folder in its place
    assert not harness.load_compile_cache(path, "k1")[0]


def test_torch_rejecting_the_artifacts_is_not_fatal(tmp_path, monkeypatch, artifacts):
    path = tmp_path / "compile_cache.bin"
    harness.save_compile_cache(path, "k1", VERSIONS)

    def reject(data):
        raise RuntimeError("artifacts from another torch build")

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", reject)
    ok, note = harness.load_compile_cache(path, "k1")
    assert not ok and "RuntimeError: artifacts from another torch build" in note


def test_artifacts_torch_silently_rejects_are_not_reported_as_loaded_and_are_replaced(tmp_path, monkeypatch):
    """torch's own load (not the recorder) of a sealed payload it cannot unpickle (another torch build) logs a
    traceback and returns None: the file is then not loaded, and the run saves a new one after the warmup."""
    path = tmp_path / "compile_cache.bin"
    hp = tg.parse_args(["--preset=tiny", f"--compile_cache={path}"])
    versions = harness.compile_cache_versions(torch.device("cpu"))
    key = harness.compile_cache_key(["source", harness.compile_cache_settings(hp, "sdpa")], versions)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts of another torch build", None))
    harness.save_compile_cache(path, key, versions)
    monkeypatch.undo()
    said = []                                                   # what torch logs (its traceback) on the console
    handler = logging.Handler()
    handler.emit = said.append
    logging.getLogger("torch.compiler._cache").addHandler(handler)
    try:
        ok, note = harness.load_compile_cache(path, key)
    finally:
        logging.getLogger("torch.compiler._cache").removeHandler(handler)
    assert not ok and note.startswith(f"compile cache: torch rejected the artifacts in {path}"), note
    assert "replaced after the warmup" in note and said == [], said     # one line, not torch's traceback
    notes = []
    run = types.SimpleNamespace(device=torch.device("cpu"), log=notes.append, compile_cache=None, cache_loaded=None)
    harness.open_compile_cache(run, hp, "sdpa", ["source"])
    assert notes == [note] and run.cache_loaded is False and run.compile_cache == (path, key, versions)


def test_nothing_compiled_saves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)
    path = tmp_path / "compile_cache.bin"
    assert "nothing saved" in harness.save_compile_cache(path, "k1", VERSIONS) and not path.exists()


def test_torch_failing_to_collect_the_artifacts_is_not_fatal(tmp_path, monkeypatch):
    def fail():
        raise RuntimeError("a cache backend error")

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", fail)
    path = tmp_path / "compile_cache.bin"
    assert "not saved" in harness.save_compile_cache(path, "k1", VERSIONS) and not path.exists()


def test_an_unwritable_place_is_reported_not_fatal(tmp_path, artifacts):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    note = harness.save_compile_cache(blocker / "compile_cache.bin", "k1", VERSIONS)     # its folder is a file
    assert note.startswith(f"compile cache: could not write {blocker}/compile_cache.bin")


def test_the_cache_is_a_run_control_option():
    # a different cache path (or none) on --resume changes no number
    assert "compile_cache" not in harness.math_fields(tg.Hyperparameters())


class _Scaled(torch.autograd.Function):
    """A custom autograd Function, as the model's FP8 head and Triton ops are."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * g * x


def test_graphs_with_autograd_functions_come_back_from_torchs_autograd_cache(tmp_path, monkeypatch,
                                                                            compiler_settings_restored):
    """configure_compiler lets torch's autograd cache keep a graph holding an autograd Function. Without
    that torch bypasses it, and every start re-traces and re-partitions each training graph (the bulk
    of a warm start on a GPU). Real inductor compilations on the CPU, in a fresh cache folder."""
    from torch._dynamo.utils import counters
    from torch._functorch import config as functorch_config
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(functorch_config, "autograd_cache_allow_custom_autograd_functions", False)

    def fresh_compile():
        torch._dynamo.reset()
        counters.clear()
        x = torch.linspace(-1, 1, 8, requires_grad=True)
        torch.compile(lambda t: _Scaled.apply(t).sum(), fullgraph=True)(x).backward()
        assert torch.equal(x.grad, 2 * x.detach())
        return dict(counters["aot_autograd"])

    assert fresh_compile().get("autograd_cache_bypass") == 1          # torch's default
    tg.configure_compiler()
    assert functorch_config.autograd_cache_allow_custom_autograd_functions
    assert fresh_compile().get("autograd_cache_miss") == 1            # compiled and saved
    assert fresh_compile().get("autograd_cache_hit") == 1             # a new start loads it
    torch._dynamo.reset()


def test_an_edit_of_triton_kernels_misses_torchs_caches(tmp_path, monkeypatch, compiler_settings_restored):
    """torch keys a cached graph by its ops. A Triton op's launch code is compiled into the graph but is not in that
    key, and its kernels are only where torch's source scan finds them (it missed the attention ops' once), so an
    edited triton_kernels.py could get old code back from the cache. configure_compiler puts a hash of the file's
    text into every key: the same text hits, an edited one misses. Real inductor compilations on the CPU."""
    from torch._dynamo.utils import counters
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    torch.compiler.config.cache_key_tag = "someone-elses-tag"
    kernels = tmp_path / "triton_kernels.py"
    monkeypatch.setattr(tk, "__file__", str(kernels))

    def start(kernels_text):
        kernels.write_text(kernels_text)
        tg.configure_compiler()
        torch._dynamo.reset()
        counters.clear()
        x = torch.linspace(-1, 1, 8, requires_grad=True)
        torch.compile(lambda t: _Scaled.apply(t).sum(), fullgraph=True)(x).backward()
        return dict(counters["aot_autograd"])

    assert start("BLOCK = 64\n").get("autograd_cache_miss") == 1
    assert start("BLOCK = 64\n").get("autograd_cache_hit") == 1
    assert start("BLOCK = 32\n").get("autograd_cache_miss") == 1      # the edit
    assert torch.compiler.config.cache_key_tag == "someone-elses-tag|" + harness.kernels_cache_tag("BLOCK = 32\n")
    torch._dynamo.reset()


def test_torch_finds_the_kernels_of_every_triton_op():
    """torch puts the text of a triton_op's kernels into its cache keys, when it finds them: it scans the op's source
    (and the functions it calls) for wrap_triton(<kernel name>). A launch helper that takes the kernel as an argument
    hides it (the attention ops did), and the caches key such an op by its name alone. configure_compiler's tag
    covers the trainer either way; this keeps the ops safe where they are compiled without it."""
    triton_lib = pytest.importorskip("torch._library.triton")
    if not hasattr(triton_lib, "triton_ops_to_kernels"):
        pytest.skip("this torch keeps no table of triton_op kernels")
    ours = {name: kernels for name, kernels in triton_lib.triton_ops_to_kernels.items()
            if name.startswith(tk._LIB + "::")}
    assert len(ours) >= 11
    hidden = sorted(name for name, kernels in ours.items() if not kernels)
    assert not hidden, f"torch finds no kernel in {hidden}: call wrap_triton(<kernel>) in the launcher itself"
    for kernels in ours.values():
        assert all(getattr(tk, k.fn.__name__) is k for k in kernels)
