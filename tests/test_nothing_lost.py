"""Nothing lost when the disk or the user goes wrong: write failures are one error line naming the file and the fix
(exit 2) with earlier states intact, files that are not states are refused by name, and values that pass a type check
but mean nothing are refused."""
import errno
import resource
import signal
from pathlib import Path

import pytest
import torch

import harness
import train_gpt as tg
from _shards import make_dataset, run_trainer


# ---- write failures ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("code,words", [(errno.ENOSPC, "the disk is full"), (errno.EROFS, "read-only"),
                                        (errno.EFBIG, "size limit")])
def test_a_refused_checkpoint_write_names_the_fix_and_keeps_the_last_state(tmp_path, monkeypatch, code, words):
    hp = tg.parse_args([f"--log_dir={tmp_path}"])
    lines = []
    saver = harness.Checkpointer(hp, "run", 0, 1, {}, lines.append, "code")
    first = saver.save({"step": 2, "model": {"w": torch.ones(3)}})
    kept = first.read_bytes()

    def refused(fd):                               # a file system that refuses the written data when it is synced
        raise OSError(code, "refused")
    monkeypatch.setattr(harness.os, "fsync", refused)
    with pytest.raises(harness.ConfigError) as info:
        saver.save({"step": 4, "model": {"w": torch.zeros(3)}})
    message = str(info.value)
    assert "state_step000004.pt" in message and words in message and "--log_dir" in message
    assert f"the last state saved, {first}, is intact" in message
    assert first.read_bytes() == kept and sorted(p.name for p in tmp_path.joinpath("run").iterdir()) == [first.name]
    assert harness.describe_failure(info.value, 0, 1)[0] == harness.EXIT_CONFIG


def test_torch_saves_runtime_error_for_a_full_disk_is_not_a_bug():
    wrapped = RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0: No space left on "
                           "device")
    code, message = harness.describe_failure(wrapped, 0, 1)
    assert code == harness.EXIT_CONFIG and "the disk is full" in message and "bug" not in message
    cause = RuntimeError("file write failed")
    cause.__cause__ = OSError(errno.EFBIG, "File too large", "/x/state.pt")
    assert harness.describe_failure(cause, 0, 1) == (harness.EXIT_CONFIG, "cannot write /x/state.pt: the file is "
                                                     "over the size limit (ulimit -f), or choose another --log_dir")
    assert harness.describe_failure(RuntimeError("shape mismatch"), 0, 1)[0] == harness.EXIT_BUG


def _file_size_limit(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)    # the write then fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("limit,what", [(8 << 20, "checkpoint"), (64 << 10, "log")])
def test_a_file_size_limit_ends_the_run_with_exit_2_and_the_fix(tmp_path, limit, what):
    """A real size limit (ulimit -f): the tiny model's checkpoint is far over 8 MiB, its log (the code) over 64 KiB."""
    import subprocess
    import sys
    from _shards import CPU_MALLOC_ENV, ROOT
    train, val = make_dataset(tmp_path / "d", train_tokens=120_000, val_tokens=20_000)
    args = ["--preset=tiny", "--num_scheduled_iterations=3", "--num_extension_iterations=1", "--seed=0",
            "--save_checkpoint", "--checkpoint_every=2", f"--train_files={train}", f"--val_files={val}",
            f"--log_dir={tmp_path}/logs", "--run_id=limited"]
    env = {"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin", **CPU_MALLOC_ENV}
    p = subprocess.run([sys.executable, str(ROOT / "train_gpt.py"), *args], cwd=tmp_path, capture_output=True,
                       text=True, timeout=500, env=env, preexec_fn=_file_size_limit(limit))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "size limit (ulimit -f)" in errors[0], p.stderr
    if what == "checkpoint":
        assert "state_step000002.pt" in errors[0] and "no earlier state of this run was saved" in errors[0]
        assert not list((tmp_path / "logs" / "limited").glob("*.pt"))     # no half-written state under its name
        assert (tmp_path / "logs" / "limited.txt").read_text().splitlines()[-1] == errors[0]
    else:
        assert "cannot write the log" in errors[0]


# ---- files that are not states --------------------------------------------------------------------------------------

@pytest.mark.parametrize("content", ["empty", "text", "foreign", "partial"])
def test_a_state_file_that_is_not_a_whole_state_is_refused_by_name(tmp_path, content):
    path = tmp_path / "state_step000004.pt"
    if content == "empty":
        path.write_bytes(b"")
    elif content == "text":
        path.write_text("not a checkpoint")
    elif content == "foreign":
        torch.save({"weights": torch.ones(2)}, path)
    else:
        torch.save({"format": harness.CHECKPOINT_FORMAT, "step": 4}, path)
    with pytest.raises(harness.ConfigError) as info:
        harness.load_checkpoint(str(path), 0, 1)
    message = str(info.value)
    assert message.startswith("--resume:") and str(path) in message and "\n" not in message
    assert any(words in message for words in ("empty", "truncated", "not a training state",
                                                   "not a whole training state"))


# ---- values that pass a type check but mean nothing -----------------------------------------------------------------

@pytest.mark.parametrize("arg,words", [
    ("--adam_lr=nan", "--adam_lr='nan' is not a finite float"),
    ("--val_loss_target=inf", "is not a finite float"),
    ("--fp8_scales=0.2,nan,0.1", "is not comma-separated finite floats"),
    ("--stages=131072:1.0:3:1:1:896,262144:nan:7:1:1:2048", "stage 2 ('262144:nan:7:1:1:2048'): its lr_peak 'nan' "
                                                           "is not a finite float"),
    ("--stages=" + ",".join(["512:1.0:3:1:1:64"] * 19 + ["512:1.0:x:1:1:64"]), "stage 20 ('512:1.0:x:1:1:64'): its "
                                                                              "ws_long 'x' is not an int"),
    ("--stages=512:1.0:3:1:1:1.5", "stage 1 ('512:1.0:3:1:1:1.5'): its max_doc_len '1.5' is not an int"),
    ("--stages=512:1.0:3", "stage 1 ('512:1.0:3'): it has 3 ':' fields, not 6 to 8"),
    ("--stages=512:1.0:3:1:1:64:0.25:0:1", "it has 9 ':' fields, not 6 to 8"),
    ("--stages=512:1.0:3:1:1:64:x", "its prefix_start 'x' is not a finite float"),
    ("--stages=512:1.0:3", "max_doc_len[:prefix_start][:prefix_end] per stage"),
])
def test_meaningless_values_are_refused_naming_the_field(arg, words):
    with pytest.raises(harness.ConfigError, match=None) as info:
        tg.parse_args(["--preset=tiny", arg])
    assert words in str(info.value), str(info.value)


@pytest.mark.parametrize("name,empty,value,parsed", [("long_window_layers", "", "1,4", (1, 4)),
                                                     ("ve_layout", ",", "0,1,-1", (0, 1, -1)),
                                                     ("fp8_scales", "", "0.5,0.25,0.125", (0.5, 0.25, 0.125))])
def test_an_option_given_twice_is_parsed_as_its_type_the_second_time(name, empty, value, parsed):
    """The first value, empty, leaves a tuple with no element to take the type from: the field's default gives it."""
    hp = tg.parse_args(["--preset=tiny", f"--{name}={empty}", f"--{name}={value}"])
    assert getattr(hp, name) == parsed and all(type(x) is type(y) for x, y in zip(getattr(hp, name), parsed))


def test_home_is_expanded_in_every_path_option(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    train, val = make_dataset(tmp_path / "d", train_tokens=20_000)
    files = harness.resolve_shards("~/d/fineweb_train_*.bin", "train")
    assert files == [str(tmp_path / "d" / "fineweb_train_000001.bin")]
    hp = tg.parse_args(["--log_dir=~/logs"])
    assert harness.prepare_output(hp, "r", 0) == tmp_path / "logs" / "r.txt"
    assert not (Path.cwd() / "~").exists()
    saver = harness.Checkpointer(tg.parse_args(["--log_dir=~/logs"]), "r", 0, 1, {}, lambda line: None, "")
    assert saver.save({"step": 1}).parent == tmp_path / "logs" / "r"


def test_a_compile_cache_path_that_is_a_folder_is_named_and_not_used(tmp_path):
    class FakeRun:
        device = torch.device("cpu")
        compile_cache, cache_loaded = None, False

        def __init__(self):
            self.lines = []

        def log(self, line):
            self.lines.append(line)
    run = FakeRun()
    hp = tg.parse_args([f"--compile_cache={tmp_path}"])
    harness.open_compile_cache(run, hp, "triton", ["code"])
    assert run.compile_cache is None and not run.cache_loaded
    assert len(run.lines) == 1 and "is a folder" in run.lines[0] and "compile_cache.bin" in run.lines[0]
